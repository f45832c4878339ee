"""The compiled extensions: whether each one is built, and if not, why, in words a user can act on.

setup.py records its last build in ``kvattn/_build.json`` (:data:`RECORD`) beside the modules it
built: in the source tree for ``make build`` (``setup.py build_ext --inplace``), inside the wheel
for ``pip install`` and ``python -m build``. The record (:func:`write_record` writes it)::

    {"kvattn": "0.1.0", "summary": "<the one line setup.py printed>",
     "extensions": {"kvattn.backends.cuda._C": {"status": "built" | "skipped" | "failed",
                                                "reason": "...",        # skipped or failed
                                                "seconds": 31.2,        # built
                                                "archs": ["80", "90"], "nvcc": "13.0",
                                                "resources": [...]}}}   # the CUDA module

``resources`` holds the static figures ptxas printed for every kernel instantiation and
architecture (registers, static shared memory, stack frame and spill bytes), as in
``build/cuda/resources.json`` (csrc/ptxas_report.py parses the ``-Xptxas -v`` log).

A module is *built* when it imports, *not built* when there is no file for it (the record says
why setup.py skipped it, when it did), and *build failed* when its file does not load or the last
build of it failed. Standard library only: setup.py loads this file by path, without importing
kvattn (which needs torch).
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import pathlib
from dataclasses import dataclass, field
from types import ModuleType

RECORD = "_build.json"
BUILT, NOT_BUILT, FAILED = "built", "not built", "build failed"

# What setup.py builds (csrc/ holds the sources): the CUDA kernels (nvcc), the same sources on the
# CPU harness (a C++ compiler), and three harness builds with a deliberate defect the tests require
# to fail.
EXTENSIONS = (
    "kvattn.backends.cuda._C",
    "kvattn.backends.cuda_sim._sim",
    "kvattn.backends.cuda_sim._sim_break_barrier",
    "kvattn.backends.cuda_sim._sim_break_pages",
    "kvattn.backends.cuda_sim._sim_break_fragment",
)
# where a module can be built, when that is not every machine with a C++ compiler
_WHERE = {"kvattn.backends.cuda._C": " where nvcc is installed"}


@dataclass(frozen=True)
class Status:
    """What is known of one extension module."""

    module: str
    state: str  # BUILT, NOT_BUILT or FAILED
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
    path.write_text(json.dumps({"kvattn": version, "summary": summary, "extensions": entries},
                               indent=1) + "\n")


def load(module: str) -> tuple[ModuleType | None, Status]:
    """Import the extension ``module``: ``(module, status)``, or ``(None, status)`` saying why not."""
    where = _WHERE.get(module, "")
    entry = read_record().get("extensions", {}).get(module, {})
    recorded = entry.get("status")
    spec = importlib.util.find_spec(module)
    if spec is None:
        if recorded == "failed":
            return None, Status(module, FAILED, f"the last build failed ({entry.get('reason')}); "
                                                f"fix it and run `make build`{where}", record=entry)
        skipped = f" (setup.py skipped it: {entry['reason']})" if recorded == "skipped" else ""
        return None, Status(module, NOT_BUILT, f"run `make build`{where}{skipped}", record=entry)
    try:
        loaded = importlib.import_module(module)
    except ImportError as e:
        return None, Status(module, FAILED, f"{spec.origin} does not load ({e}); run `make build` "
                                            f"again{where}", spec.origin, entry)
    if recorded == "failed":
        return loaded, Status(module, FAILED, f"the last build failed ({entry.get('reason')}); an "
                                              f"older build is loaded from {spec.origin}",
                              spec.origin, entry)
    if recorded == "skipped":
        return loaded, Status(module, BUILT, f"{spec.origin}, left by an earlier build (the last "
                                             f"one skipped it: {entry.get('reason')})", spec.origin,
                              entry)
    return loaded, Status(module, BUILT, path=spec.origin, record=entry)


def statuses() -> dict[str, Status]:
    """:class:`Status` of every extension setup.py can build."""
    return {name: load(name)[1] for name in EXTENSIONS}
