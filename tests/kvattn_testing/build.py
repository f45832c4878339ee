"""What the build made, for the tests that hold it to its sources: the instantiation table
(csrc/instantiations.py, loaded by path as setup.py loads it), the last build's record
(kvattn/_build.json) and the kernels it compiled, and the compiled harness modules, the test-only
subset build among them."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys

import pytest

import kvattn
from kvattn_testing.util import ROOT

# A harness module the build compiles from a subset of the table (fp16, head dims up to 64, no
# score switch): test_instantiations and
# test_fp8_writer run it.
SUBSET_MODULE = "kvattn.backends.cuda_sim._sim_break_pages"


def built_module(name):
    """The compiled module ``name``; the test skips, saying so, where it was not built."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        pytest.skip(f"{name} not built: {e}")


@functools.lru_cache(maxsize=1)
def instantiations():
    """csrc/instantiations.py, the CUDA kernel instantiations (setup.py loads it by path too)."""
    spec = importlib.util.spec_from_file_location(
        "kvattn_instantiations", ROOT / "csrc" / "instantiations.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def cuda_build_record() -> dict:
    """The last build's record of the CUDA module (kvattn/_build.json), ``{}`` without one."""
    return kvattn.extensions.read_record().get("extensions", {}).get("kvattn.backends.cuda._C", {})


def built_cuda_kernels(kernel: str) -> set:
    """``{(demangled signature, arch)}`` the last CUDA build compiled of ``kernel``: its recorded
    selection of csrc/instantiations.py on its recorded architectures."""
    table, record = instantiations(), cuda_build_record()
    selection = table.Selection(
        **{
            k: tuple(v) if isinstance(v, list) else v
            for k, v in record.get("selection", {}).items()
            if k in ("dtypes", "head_dims", "variants")
        }
    )
    return {
        (row.signature, f"sm_{arch}")
        for row in table.select(selection)
        if row.kernel == kernel
        for arch in record.get("archs", ("80", "90"))
    }


def ptxas_log():
    """build/cuda/ptxas.log, the ptxas report of the last CUDA build; a test of it skips, saying
    why, where that build did not compile the CUDA module (``KVATTN_SKIP_CUDA_BUILD=1``, no nvcc)."""
    record = cuda_build_record()
    if record.get("status") != "built":
        pytest.skip(
            f"the last build did not compile the CUDA module "
            f"({record.get('status', 'no build record')}: {record.get('reason', '')}); "
            "there is no ptxas report"
        )
    log = ROOT / "build" / "cuda" / "ptxas.log"
    assert log.exists(), "build/cuda/ptxas.log missing although the CUDA module was built"
    return log
