import os
import pathlib

import pytest
import torch

# Without a GPU the Triton kernels run under the interpreter; it must be chosen before triton loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# make sanitize: the harness module built with AddressSanitizer and UBSan (a file outside the
# package) stands in for kvattn.backends.cuda_sim._sim, for every import of it.
if os.environ.get("KVATTN_SIM_MODULE"):
    import importlib.util
    import sys

    _spec = importlib.util.spec_from_file_location(
        "kvattn.backends.cuda_sim._sim", os.environ["KVATTN_SIM_MODULE"]
    )
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
    sys.modules[_spec.name] = _module

from hypothesis import settings  # noqa: E402

settings.register_profile("kvattn", deadline=None, max_examples=40, derandomize=True)
settings.load_profile("kvattn")


# The lanes of the suite (`pytest -m <lane>`, markers in pytest.ini): each lane is one or more
# folders of tests/, and every test file lies in one of them (tests/repository/test_repository.py
# holds this table to tests/ and to pytest.ini). `make test-fast` runs the kernel lanes.
LANES = {
    "contract": ("contract",),
    "readers": ("readers",),
    "writers": ("writers",),
    "backends": ("backends",),
    "robustness": ("robustness",),
    "integrations": ("integrations",),
    "repository": ("repository", "benchmarks"),
}
_TESTS = pathlib.Path(__file__).resolve().parent
_LANE_OF = {folder: lane for lane, folders in LANES.items() for folder in folders}


def lane_of(path) -> str | None:
    """The lane of the test file at ``path``: that of its top folder under tests/."""
    try:
        relative = pathlib.Path(path).resolve().relative_to(_TESTS)
    except ValueError:
        return None
    return _LANE_OF.get(relative.parts[0]) if len(relative.parts) > 1 else None


# Engine suites whose module's tests read engine runs computed once (kvattn_testing.engines.Runs):
# under `--dist loadgroup` one worker takes a whole module, so that the other never waits on it.
_ENGINE_FOLDERS = (_TESTS / "integrations" / "vllm", _TESTS / "integrations" / "sglang")
# The modules that start SGLang servers (several processes each, up to ten servers at once) share
# one group: one worker runs them one after another, so that two of them never hold twenty
# servers' memory together.
_SHARED_GROUPS = dict.fromkeys(
    ("test_sglang_engine", "test_sglang_pd", "test_sglang_mla", "test_sglang_spec"),
    "sglang_servers",
)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """Each test gets its folder's lane marker, an engine suite's test its module's xdist group.
    Slow tests first: under xdist they then overlap with the rest instead of ending the run."""
    for item in items:
        lane = lane_of(item.path)
        if lane is not None:
            item.add_marker(getattr(pytest.mark, lane))
        if item.path.parent in _ENGINE_FOLDERS:
            stem = item.path.stem
            item.add_marker(pytest.mark.xdist_group(_SHARED_GROUPS.get(stem, stem)))
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


# Backends that implement part of the readers' switches and ops on purpose (the compiled CPU
# decode: docs/backends.md pins what it claims, tests/repository/test_support_matrix.py holds it
# to that): a test written for every reader skips one of them where it refuses the inputs.
PARTIAL_BACKENDS = frozenset({"cpu"})


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem):
    """A test that needs a kernel instantiation its module was built without (a subset of
    csrc/instantiations.py: KVATTN_CUDA_DTYPES, _HEAD_DIMS, _VARIANTS) skips, saying which; so
    does one that names a backend of PARTIAL_BACKENDS for inputs it does not claim."""
    from kvattn.backends.cuda.launch import NotBuilt

    try:
        return (yield)
    except NotBuilt as e:
        pytest.skip(f"not built into this module: {e}")
    except ValueError as e:  # the registry's refusal of a named backend carries its name
        if getattr(e, "backend", None) not in PARTIAL_BACKENDS:
            raise
        pytest.skip(f"{e.backend} does not claim these inputs: {e.reason}")
