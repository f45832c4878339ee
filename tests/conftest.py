import os

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

    _spec = importlib.util.spec_from_file_location("kvattn.backends.cuda_sim._sim",
                                                   os.environ["KVATTN_SIM_MODULE"])
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
    sys.modules[_spec.name] = _module

from hypothesis import settings  # noqa: E402

settings.register_profile("kvattn", deadline=None, max_examples=40, derandomize=True)
settings.load_profile("kvattn")


# The lanes of the suite (`pytest -m <lane>`, markers in pytest.ini): every test file is in one.
# `make test-fast` runs the kernel lanes; tests/test_repository.py holds this table to tests/.
LANES = {
    "contract": ("test_reference", "test_scenarios", "test_variant_scenarios", "test_report_written",
                 "test_traces", "test_exactness"),
    "readers": ("test_decode", "test_extend", "test_mla", "test_mla_extend", "test_shapes",
                "test_variants", "test_per_sequence", "test_head_dim_v", "test_fp8_query",
                "test_custom_mask",
                "test_torch_reader", "test_cuda_graphs", "test_ops"),
    "writers": ("test_writers", "test_writers_layers", "test_fp8_writer", "test_triton_writer",
                "test_writer_registry", "test_cache", "test_transfer"),
    "backends": ("test_cuda", "test_cuda_extend", "test_cuda_fp8", "test_instantiations", "test_sanitize",
                 "test_static_sm90"),
    "robustness": ("test_hardening", "test_fuzz", "test_validation"),
    "integrations": ("test_transformers", "test_transformers_differential",
                     "test_transformers_variants", "test_adapter_messages", "test_vllm",
                     "test_vllm_differential", "test_vllm_variants", "test_vllm_spec",
                     "test_vllm_nixl", "test_sglang"),
    "repository": ("test_repository", "test_readme", "test_support_matrix", "test_env",
                   "test_demo", "test_install", "test_gpu_suite", "test_benchmarks_smoke"),
}
_LANE_OF = {module: lane for lane, modules in LANES.items() for module in modules}


def pytest_collection_modifyitems(config, items):
    """Each test gets its file's lane marker. Slow tests first: under xdist they then overlap with
    the rest instead of ending the run."""
    for item in items:
        lane = _LANE_OF.get(item.path.stem)
        if lane is not None:
            item.add_marker(getattr(pytest.mark, lane))
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem):
    """A test that needs a kernel instantiation its module was built without (a subset of
    csrc/instantiations.py: KVATTN_CUDA_DTYPES, _HEAD_DIMS, _VARIANTS) skips, saying which."""
    from kvattn.backends.cuda.launch import NotBuilt
    try:
        return (yield)
    except NotBuilt as e:
        pytest.skip(f"not built into this module: {e}")
