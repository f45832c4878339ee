"""Docs that state what the code decides, held to it: each public op's docstring names the backends
the registry has for that op, the docs' head-dim limits and tiles are the backends' and the
instantiation table's, and no prose states a count of the build's instantiations or units (the
build's line and ``python -m kvattn.env`` say them; a count in prose drifts, as 201 and 19 did).

``cuda_sim`` is a registry name a caller may pass (the CUDA kernels' source on the CPU harness,
run only when named), so the docstrings name it too, as the CPU harness.
"""

from __future__ import annotations

import pathlib
import re

import pytest

import kvattn
from kvattn import backends
from kvattn.backends.cuda import launch
from kvattn_testing.build import instantiations
from kvattn_testing.util import ROOT

# public op -> the registry's op (kvattn.backends.OPS)
OPS = {
    kvattn.paged_decode: "decode",
    kvattn.paged_extend: "extend",
    kvattn.paged_mla_decode: "mla_decode",
    kvattn.paged_mla_extend: "mla_extend",
    kvattn.write_kv: "write_kv",
}


def backend_entry(doc: str) -> str:
    """The docstring's text on ``backend``: its entry of the Args section (``backend: ...`` and the
    lines indented below it), or its paragraph starting ``backend``:."""
    lines = [line.rstrip() for line in doc.expandtabs().splitlines()]
    start = next(i for i, line in enumerate(lines) if re.match(r"\s*(``)?backend(``)?:", line))
    indent = len(lines[start]) - len(lines[start].lstrip())
    paragraph = lines[start].lstrip().startswith("``")
    entry = [lines[start]]
    for line in lines[start + 1 :]:
        if not line.strip() or (not paragraph and len(line) - len(line.lstrip()) <= indent):
            break
        entry.append(line)
    return " ".join(entry)


def documented_backends(doc: str) -> set[str]:
    """The backends a docstring names for ``backend=`` (``"name"`` in double backticks), but ``auto``."""
    return set(re.findall(r'``"(\w+)"``', backend_entry(doc))) - {"auto"}


def registry_backends(op: str) -> set[str]:
    """The registry's backends with a launcher for ``op`` (the rule of kvattn.backends: a module
    attribute named after the op); the test skips where one does not import."""
    names = set()
    for name in backends.names():
        module, reason = backends.load(name)
        if module is None:
            pytest.skip(
                f"backend {name} does not import here ({reason}): which ops it has is unknown"
            )
        if hasattr(module, op):
            names.add(name)
    return names


def mismatch(func, op: str) -> str | None:
    documented, registered = documented_backends(func.__doc__), registry_backends(op)
    if documented == registered:
        return None
    return (
        f"{func.__module__}.{func.__name__}'s backend line names {sorted(documented)}; the "
        f"registry has {sorted(registered)} for {op} (missing: {sorted(registered - documented)}, "
        f"not a backend of it: {sorted(documented - registered)})"
    )


@pytest.mark.parametrize("func", list(OPS), ids=lambda f: f.__name__)
def test_each_ops_docstring_names_the_registrys_backends_of_that_op(func):
    assert mismatch(func, OPS[func]) is None


def test_a_drifted_backend_line_is_caught():
    def drifted():
        """An op.

        Args:
            backend: ``"auto"``, ``"cuda"`` or ``"reference"``; see
                :mod:`kvattn.backends` (``"torch"`` too).
            out: ``"triton"`` is not read here.
        """

    def paragraph():
        """An op.

        ``backend``: ``"torch"`` composes PyTorch ops; ``"cuda"`` the CUDA
        writer (``"cuda_sim"``: on the harness). ``"auto"`` takes one.

        ``"triton"`` is another paragraph.
        """

    assert documented_backends(drifted.__doc__) == {"cuda", "reference", "torch"}
    assert documented_backends(paragraph.__doc__) == {"torch", "cuda", "cuda_sim"}
    problem = mismatch(drifted, "decode")
    assert problem is not None and "missing: ['cpu', 'cuda_sim', 'triton']" in problem
    assert "not a backend of it: ['cuda', 'cuda_sim', 'torch']" in mismatch(paragraph, "mla_extend")


def _row(path: pathlib.Path, backend: str) -> str:
    """The line of ``backend``'s row in a Markdown table of backends."""
    rows = [line for line in path.read_text().splitlines() if line.startswith(f"| `{backend}` |")]
    assert len(rows) == 1, f"{path.name}: one table row of backend {backend}"
    return rows[0]


def test_the_docs_head_dims_are_the_backends_and_the_tables():
    """docs/backends.md's cuda row says the CUDA kernels' head dims and tiles; its triton row and
    the README's, the Triton kernels' limit (the Triton backend's own: its blocks are powers of two,
    whatever tiles the CUDA table has)."""
    table = instantiations()
    cuda_row = _row(ROOT / "docs" / "backends.md", "cuda")
    cuda = re.search(r"head dim 1\.\.(\d+) \(padded to ([\d/]+) ", cuda_row)
    assert cuda, "docs/backends.md: the cuda row's 'head dim 1..N (padded to a/b/...' moved"
    assert int(cuda.group(1)) == launch.MAX_HEAD_DIM == max(table.TILES)
    assert tuple(map(int, cuda.group(2).split("/"))) == table.TILES
    triton, reason = backends.load("triton")
    if triton is None:
        pytest.skip(f"the triton backend does not import here ({reason})")
    for path, words in (
        (ROOT / "docs" / "backends.md", "head dim"),
        (ROOT / "README.md", "head dims"),
    ):
        stated = re.search(rf"{words} 1\.\.(\d+)", _row(path, "triton"))
        assert stated and int(stated.group(1)) == triton.MAX_HEAD_DIM, path.name


# "<n> instantiations", "<n> kernel instantiations", "<n> units", "units of <n>"
COUNT = re.compile(r"\b\d+ (?:kernel )?(?:instantiations|units)\b|\bunits of \d+\b")


def count_statements(text: str) -> list[str]:
    return COUNT.findall(text)


def test_no_prose_counts_the_builds_instantiations_or_units():
    """The build's counts change with the table; where they are described (the docs, the table's
    and the build's docstrings, the record's format) they are not stated."""
    files = [
        ROOT / "README.md",
        ROOT / "setup.py",
        ROOT / "kvattn" / "extensions.py",
        *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "csrc").glob("*.py")),
    ]
    found = {
        str(path.relative_to(ROOT)): hits
        for path in files
        if (hits := count_statements(path.read_text()))
    }
    assert found == {}
    assert count_statements(
        "201 kernel instantiations; Ninja compiles the 19 units; 2 units of 16"
    ) == ["201 kernel instantiations", "19 units", "2 units"]
    assert count_statements("decode in units of 16 rows, one unit per tile") == ["units of 16"]
