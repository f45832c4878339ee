import os

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


def pytest_collection_modifyitems(config, items):
    """Slow tests first: under xdist they then overlap with the rest instead of ending the run."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
