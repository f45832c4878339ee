"""The compiled extensions: whether each one is built, and if not, why, in words a user can act on.

setup.py records its last build in ``kvattn/_build.json`` (:data:`RECORD`) beside the modules it
built: in the source tree for ``make build`` (``setup.py build_ext --inplace``), inside the wheel
for ``pip install`` and ``python -m build``. The record (:func:`write_record` writes it)::

    {"kvattn": "0.1.0", "summary": "<the one line setup.py printed>",
     "extensions": {"kvattn.backends.cuda._C": {"status": "built" | "skipped" | "failed",
                                                "reason": "...",        # skipped or failed
                                                "seconds": 31.2,        # built
                                                "archs": ["80", "90"], "nvcc": "13.0",
                                                "nvcc_parallel": ["--split-compile=16"],
                                                "jobs": ["-j2"],        # ninja's, when set
                                                "selection": {...},     # of csrc/instantiations.py
                                                "instantiations": <n>, "units": <n>,
                                                "resources": [...]}}}   # the CUDA module

``selection`` is what the CUDA module holds of the instantiation table (``Selection.as_dict`` of
csrc/instantiations.py: dtypes, head dims, variants, ``full``; the module's ``SELECTION`` too), in
``units`` generated translation units. ``resources`` holds the static figures ptxas printed for
every kernel instantiation and architecture (registers, static shared memory, stack frame and
spill bytes), as in ``build/cuda/resources.json`` (csrc/ptxas_report.py parses the ``-Xptxas -v``
log).

A module is *built* when it imports, *not built* when there is no file for it (the record says
why setup.py skipped it, when it did), and *build failed* when its file does not load or the last
build of it failed. In a source checkout (``make build``, an editable install) a module is *stale*,
and is not used, when it was compiled from other sources than ``csrc/`` holds now: every module
carries the :func:`source_digest` of its build (``SOURCE_DIGEST``), so a kernel whose launcher
changed since the last build can never run with the new launcher's arguments. Standard library
only: setup.py loads this file by path, without importing
kvattn (which needs torch).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import json
import pathlib
from dataclasses import dataclass, field
from types import ModuleType

RECORD = "_build.json"
BUILT, NOT_BUILT, FAILED, STALE = "built", "not built", "build failed", "stale"

# Harness builds with a deliberate defect that the tests require to fail: built into a source
# checkout only (``make build``), never into a wheel, where they would be dead weight.
TEST_ONLY = (
    "kvattn.backends.cuda_sim._sim_break_barrier",
    "kvattn.backends.cuda_sim._sim_break_pages",
    "kvattn.backends.cuda_sim._sim_break_fragment",
)
# What setup.py builds (csrc/ holds the sources): the CUDA kernels (nvcc), the same sources on the
# CPU harness (a C++ compiler), the CPU readers (a C++ compiler), and the test-only harness builds.
EXTENSIONS = (
    "kvattn.backends.cuda._C",
    "kvattn.backends.cuda_sim._sim",
    "kvattn.backends.cpu._cpu",
    *TEST_ONLY,
)
# What the modules are compiled from, besides kvattn/tags.py (the tag header is generated from it)
# and the instantiation table (the kernel units and the dispatch's list are generated from it).
SOURCE_SUFFIXES = (".h", ".cuh", ".cpp", ".cu")
TABLE = "csrc/instantiations.py"
# where a module can be built, when that is not every machine with a C++ compiler
_WHERE = {"kvattn.backends.cuda._C": " where nvcc is installed"}


@dataclass(frozen=True)
class Status:
    """What is known of one extension module."""

    module: str
    state: str  # BUILT, NOT_BUILT, FAILED or STALE
    reason: str | None = None  # why it is not usable or what went wrong; for a built one, a caveat
    path: str | None = None  # the file it was (or would have been) loaded from
    record: dict = field(default_factory=dict)  # its entry in the build record

    def line(self) -> str:
        """``state`` and what follows from it, for a report."""
        text = self.state
        if self.reason:
            text += f": {self.reason}"
        elif self.path:
            text += f" ({self.path})"
        return text


def source_digest(root: pathlib.Path) -> str:
    """16 hex digits of SHA-256 over what setup.py compiles from the checkout at ``root``: every
    C++/CUDA file under ``csrc/`` (path and bytes), the instantiation table and ``kvattn/tags.py``.
    The selection a module was built with (``KVATTN_CUDA_*``) is no source: a subset module is
    current, and says what it holds (its ``SELECTION``)."""
    files = sorted(p for p in (root / "csrc").rglob("*") if p.suffix in SOURCE_SUFFIXES)
    h = hashlib.sha256()
    for path in [*files, root / TABLE, root / "kvattn" / "tags.py"]:
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def source_tree() -> pathlib.Path | None:
    """The checkout this package is imported from, or None for an installed package (whose
    modules were built with it and come without sources)."""
    root = pathlib.Path(__file__).resolve().parent.parent
    return root if (root / "setup.py").is_file() and (root / "csrc").is_dir() else None


@functools.lru_cache(maxsize=1)
def _tree_digest() -> str | None:
    tree = source_tree()
    return None if tree is None else source_digest(tree)


def record_path() -> pathlib.Path:
    return pathlib.Path(__file__).resolve().parent / RECORD


def read_record() -> dict:
    """The build record beside this package, or ``{}`` when there is none (a build older than the
    record, an install without extensions) or it cannot be read."""
    try:
        record = json.loads(record_path().read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def write_record(path: pathlib.Path, version: str, summary: str, entries: dict[str, dict]) -> None:
    """The record setup.py leaves beside the modules it built (format in the module docstring)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps({"kvattn": version, "summary": summary, "extensions": entries}, indent=1) + "\n"
    )


def load(module: str) -> tuple[ModuleType | None, Status]:
    """Import the extension ``module``: ``(module, status)``, or ``(None, status)`` saying why not."""
    where = _WHERE.get(module, "")
    entry = read_record().get("extensions", {}).get(module, {})
    recorded = entry.get("status")
    spec = importlib.util.find_spec(module)
    if spec is None:
        if recorded == "failed":
            return None, Status(
                module,
                FAILED,
                f"the last build failed ({entry.get('reason')}); "
                f"fix it and run `make build`{where}",
                record=entry,
            )
        skipped = f" (setup.py skipped it: {entry['reason']})" if recorded == "skipped" else ""
        return None, Status(module, NOT_BUILT, f"run `make build`{where}{skipped}", record=entry)
    try:
        loaded = importlib.import_module(module)
    except ImportError as e:
        return None, Status(
            module,
            FAILED,
            f"{spec.origin} does not load ({e}); run `make build` again{where}",
            spec.origin,
            entry,
        )
    current = _tree_digest() if module.startswith("kvattn.") else None
    built = getattr(loaded, "SOURCE_DIGEST", None)
    if current is not None and built != current:
        return None, Status(
            module,
            STALE,
            f"{spec.origin} was built from other sources than "
            f"{source_tree() / 'csrc'} holds now (built from "
            f"{built or 'an unrecorded version'}, sources {current}); "
            f"run `make build`{where}",
            spec.origin,
            entry,
        )
    if recorded == "failed":
        return loaded, Status(
            module,
            FAILED,
            f"the last build failed ({entry.get('reason')}); an "
            f"older build is loaded from {spec.origin}",
            spec.origin,
            entry,
        )
    if recorded == "skipped":
        return loaded, Status(
            module,
            BUILT,
            f"{spec.origin}, left by an earlier build (the last "
            f"one skipped it: {entry.get('reason')})",
            spec.origin,
            entry,
        )
    return loaded, Status(module, BUILT, path=spec.origin, record=entry)


def statuses() -> dict[str, Status]:
    """:class:`Status` of every extension setup.py builds here: an installed package has no
    test-only module."""
    installed = source_tree() is None
    return {n: load(n)[1] for n in EXTENSIONS if not (installed and n in TEST_ONLY)}
