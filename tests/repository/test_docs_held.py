"""Docs that state what the code decides, held to it: each public op's docstring names the backends
the registry has for that op.

``cuda_sim`` is a registry name a caller may pass (the CUDA kernels' source on the CPU harness,
run only when named), so the docstrings name it too, as the CPU harness.
"""
from __future__ import annotations

import re

import pytest

import kvattn
from kvattn import backends

# public op -> the registry's op (kvattn.backends.OPS)
OPS = {kvattn.paged_decode: "decode", kvattn.paged_extend: "extend", kvattn.paged_mla_decode: "mla_decode",
       kvattn.paged_mla_extend: "mla_extend", kvattn.write_kv: "write_kv"}


def backend_entry(doc: str) -> str:
    """The docstring's text on ``backend``: its entry of the Args section (``backend: ...`` and the
    lines indented below it), or its paragraph starting ``backend``:."""
    lines = [line.rstrip() for line in doc.expandtabs().splitlines()]
    start = next(i for i, line in enumerate(lines) if re.match(r"\s*(``)?backend(``)?:", line))
    indent = len(lines[start]) - len(lines[start].lstrip())
    paragraph = lines[start].lstrip().startswith("``")
    entry = [lines[start]]
    for line in lines[start + 1:]:
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
            pytest.skip(f"backend {name} does not import here ({reason}): which ops it has is unknown")
        if hasattr(module, op):
            names.add(name)
    return names


def mismatch(func, op: str) -> str | None:
    documented, registered = documented_backends(func.__doc__), registry_backends(op)
    if documented == registered:
        return None
    return (f"{func.__module__}.{func.__name__}'s backend line names {sorted(documented)}; the "
            f"registry has {sorted(registered)} for {op} (missing: {sorted(registered - documented)}, "
            f"not a backend of it: {sorted(documented - registered)})")


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
    assert problem is not None and "missing: ['cuda_sim', 'triton']" in problem
    assert "not a backend of it: ['cuda', 'cuda_sim', 'torch']" in mismatch(paragraph, "mla_extend")

