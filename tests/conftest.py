import os

import torch

# Without a GPU the Triton kernels run under the interpreter; it must be chosen before triton loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import settings  # noqa: E402

settings.register_profile("kvattn", deadline=None, max_examples=40, derandomize=True)
settings.load_profile("kvattn")


def pytest_collection_modifyitems(config, items):
    """Slow tests first: under xdist they then overlap with the rest instead of ending the run."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
