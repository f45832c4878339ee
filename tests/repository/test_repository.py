"""The repository stands on its own: no file refers to a path outside it, and the import graph of
the kvattn package has no cycle."""

from __future__ import annotations

import ast
import os
import pathlib
import re
import subprocess

import pytest

pytestmark = pytest.mark.host_only

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "kvattn"


def _repository_files() -> list[str]:
    try:
        listed = subprocess.run(
            [
                "git",
                "-C",
                str(ROOT),
                "ls-files",
                "-z",
                "--cached",
                "--others",
                "--exclude-standard",
            ],
            capture_output=True,
            check=False,
        )
    except OSError:
        pytest.skip("no git on this machine: the repository's files are not known")
    if listed.returncode != 0:
        pytest.skip("not a git checkout: the repository's files are not known")
    files = [f for f in listed.stdout.decode().split("\0") if f and (ROOT / f).is_file()]
    # A virtual environment made inside the checkout (`python3 -m venv .venv`, any name) is the
    # user's, not the repository's, whether .gitignore names it or not.
    venvs = tuple(f[: -len("pyvenv.cfg")] for f in files if f.rsplit("/", 1)[-1] == "pyvenv.cfg")
    return [f for f in files if not f.startswith(venvs)]


# A relative path that climbs: one or more "../" and what follows.
_CLIMBING = re.compile(r"(?<![\w.])((?:\.\./)+[\w./-]*)")
# A relative path to a file: directories, then a name with an extension.
_FILE_PATH = re.compile(r"(?<![\w./-])((?:[\w.-]+/)+[\w.-]+\.[A-Za-z]\w*)")


def outside_references(relative: str, text: str, root: pathlib.Path = ROOT) -> list[str]:
    """The places in ``text`` (the file ``relative`` of the repository at ``root``) that name a
    path outside the repository:

    - a relative path that, read from the file's folder, climbs out of the repository;
    - an absolute path into the folder that holds the repository, or into the home folder;
    - a relative path to a file that is not in the repository but exists beside it (a folder next
      to the checkout, such as a project's notes, is not shipped with it).
    """
    found = []
    here = (root / relative).parent
    for m in _CLIMBING.finditer(text):
        target = pathlib.Path(os.path.normpath(here / m.group(1)))
        if target != root and root not in target.parents:
            found.append(f"{relative}: {m.group(1)} climbs out of the repository")
    prefixes = {str(root.parent).rstrip("/") + "/", str(pathlib.Path.home()).rstrip("/") + "/"}
    for prefix in prefixes - {"/"}:
        for m in re.finditer(re.escape(prefix) + r"[\w./-]*", text):
            found.append(f"{relative}: {m.group(0)} is an absolute path outside the repository")
    for m in _FILE_PATH.finditer(text):
        path = m.group(1)
        if path.startswith("./") or (root / path).exists() or (here / path).exists():
            continue
        if (root.parent / path).exists():
            found.append(f"{relative}: {path} names a file beside the repository, not in it")
    return found


def test_the_scanner_finds_each_kind_of_outside_reference(tmp_path):
    """Without this the scan below could pass by finding nothing at all."""
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "mod.h").write_text("")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "machine.md").write_text("")
    up = "../"  # spelled apart: this file is scanned too
    text = (
        f"see {up}{up}notes/machine.md and {up}pkg/mod.h; {tmp_path}/notes/machine.md; "
        "notes/machine.md; pkg/mod.h; mod.h"
    )
    found = outside_references("pkg/readme.md", text, repo)
    assert len(found) == 3, found
    assert (
        "climbs out" in found[0]
        and "absolute path" in found[1]
        and "beside the repository" in found[2]
    )


def test_no_file_refers_to_a_path_outside_the_repository():
    problems = []
    for relative in _repository_files():
        try:
            text = (ROOT / relative).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary
        problems += outside_references(relative, text)
    assert not problems, "\n".join(problems)


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """``{module: modules of the package it imports}`` from ``{module: (source, is_package)}``.

    Every ``import`` and ``from ... import`` counts, at module level or inside a function, relative
    ones resolved. ``from P import N`` depends on ``P.N`` when that is a module, else on ``P``
    (``N`` is a name ``P`` defines); importing a module also imports the packages above it, except
    those the importer lies in (they are being imported already). Imports by string
    (``importlib.import_module``, the backend registry's lazy loading) are not seen.
    """
    graph: dict[str, set[str]] = {}
    for name, (source, is_package) in sources.items():
        package = name if is_package else name.rpartition(".")[0]
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        targets: set[str] = set()

        def depend(module: str, with_parents: bool = True) -> None:
            parts = module.split(".")
            for i in range(1, len(parts) + 1):
                prefix = ".".join(parts[:i])
                if prefix in sources and (i == len(parts) or (with_parents and prefix not in own)):
                    targets.add(prefix)

        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    depend(alias.name)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    origin = ".".join(base + ([node.module] if node.module else []))
                else:
                    origin = node.module
                for alias in node.names:
                    if f"{origin}.{alias.name}" in sources:
                        depend(f"{origin}.{alias.name}")
                        if origin not in own:
                            depend(origin)
                    else:
                        depend(origin)
        graph[name] = targets - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_sees_relative_and_function_level_imports():
    """The circle this repository had: writers imported a backend (inside a function) that
    imported the result type back from writers."""
    sources = {
        "pkg": ("", True),
        "pkg.writers": ("def pick():\n    from .backends import cuda\n", False),
        "pkg.backends": ("", True),
        "pkg.backends.cuda": ("from ..writers import WriteResult\n", False),
    }
    assert find_cycle(import_graph(sources)) == [
        "pkg.backends.cuda",
        "pkg.writers",
        "pkg.backends.cuda",
    ]
    sources["pkg.backends.cuda"] = ("from ..report import WriteResult\n", False)
    assert find_cycle(import_graph(sources)) is None
    # A module taking a name its own package defines, while the package imports it, is a circle.
    sources["pkg"] = ("from .writers import pick\nVERSION = 1\n", True)
    sources["pkg.writers"] = ("from . import VERSION\n", False)
    assert find_cycle(import_graph(sources)) == ["pkg", "pkg.writers", "pkg"]


def test_the_kvattn_import_graph_has_no_cycle():
    sources = {
        _module_name(p, ROOT): (p.read_text(), p.name == "__init__.py")
        for p in PACKAGE.rglob("*.py")
    }
    graph = import_graph(sources)
    assert "kvattn.backends.cuda" in graph["kvattn.backends.cuda_sim"]  # the graph is not empty
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def _lanes(config) -> dict:
    """tests/conftest.py's LANES, from the conftest pytest loaded (a folder's own conftest.py would
    answer a plain ``import conftest``)."""
    for plugin in config.pluginmanager.get_plugins():
        path = getattr(plugin, "__file__", None)
        if path and pathlib.Path(path).resolve() == ROOT / "tests" / "conftest.py":
            return plugin.LANES
    raise AssertionError("tests/conftest.py is not loaded")


def _imported_modules(path: pathlib.Path) -> set[str]:
    """The top-level names of every module ``path`` imports (absolute imports)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_every_test_file_is_in_one_lane(pytestconfig):
    """Every test file lies in a lane's folder (tests/conftest.py's LANES: a new folder must pick
    its lane), each folder in one lane, and pytest.ini registers each lane as a marker. Test files
    keep distinct names (pytest's default import mode), and none imports another: what tests share
    lives in tests/kvattn_testing/."""
    lanes = _lanes(pytestconfig)
    folders = [folder for owned in lanes.values() for folder in owned]
    assert len(folders) == len(set(folders)), folders
    tests = ROOT / "tests"
    files = sorted(tests.rglob("test_*.py"))
    outside = [
        str(p.relative_to(tests))
        for p in files
        if p.parent == tests or p.relative_to(tests).parts[0] not in folders
    ]
    assert not outside, f"test files outside every lane's folder: {outside}"
    assert all((tests / folder).is_dir() for folder in folders), folders
    names = [p.stem for p in files]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    importers = {
        str(p.relative_to(tests)): sorted(_imported_modules(p) & set(names))
        for p in tests.rglob("*.py")
    }
    importers = {path: imported for path, imported in importers.items() if imported}
    assert not importers, f"test modules imported as libraries: {importers}"
    markers = (ROOT / "pytest.ini").read_text()
    assert all(f"\n    {lane}:" in markers for lane in lanes)


LAUNCH_OPTIONS = {"num_warps", "num_stages", "maxnreg", "num_ctas"}


def triton_launches(folder: pathlib.Path = ROOT / "kvattn" / "backends" / "triton") -> list:
    """``(file, line, kernel, positional args, keywords, parameters)`` of every ``kernel[grid](...)``
    call of a ``@triton.jit`` function in ``folder``."""
    trees = {p: ast.parse(p.read_text()) for p in folder.glob("*.py")}
    kernels = {}
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and any(
                ast.unparse(d).endswith("jit") for d in node.decorator_list
            ):
                kernels[node.name] = [a.arg for a in node.args.args]
    launches = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Subscript)
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id in kernels
            ):
                launches.append(
                    (
                        path.name,
                        node.lineno,
                        node.func.value.id,
                        node.args,
                        node.keywords,
                        kernels[node.func.value.id],
                    )
                )
    return launches


def launch_problems(launches) -> list[str]:
    problems = []
    for file, line, kernel, args, keywords, params in launches:
        if args:
            problems.append(f"{file}:{line}: {kernel} launched with positional arguments")
        unknown = {k.arg for k in keywords if k.arg is not None} - LAUNCH_OPTIONS - set(params)
        if unknown:
            problems.append(f"{file}:{line}: {kernel} has no parameter {sorted(unknown)}")
    return problems


def test_triton_kernels_are_launched_by_keyword():
    """Every Triton launch names its arguments (a swapped positional argument would be silent),
    and every name is a parameter of the kernel or a launch option."""
    launches = triton_launches()
    assert len(launches) >= 8
    assert launch_problems(launches) == []


def test_the_launch_check_sees_positional_and_unknown_arguments(tmp_path):
    (tmp_path / "k.py").write_text(
        "import triton\n@triton.jit\ndef kern(x_ptr, n, BLOCK: 'tl.constexpr'):\n    pass\n"
        "def go(x):\n    kern[(1,)](x, n=1, BLOCK=4)\n    kern[(1,)](x_ptr=x, m=1, BLOCK=4, num_warps=4)\n"
    )
    assert launch_problems(triton_launches(tmp_path)) == [
        "k.py:6: kern launched with positional arguments",
        "k.py:7: kern has no parameter ['m']",
    ]
