"""Test-only: loaded by every Python process whose path holds this folder (the engine suite
starts SGLang's servers with it on ``PYTHONPATH``, and SGLang's scheduler, tokenizer and
detokenizer processes inherit it).

- ``sglang.srt.configs`` imports ``torchvision.transforms`` for image models; the index's
  torchvision is a CUDA build that does not load beside the CPU torch, and no test reads images:
  a stand-in takes its place unless a real one is importable.
- SGLang's Mooncake sender takes page indices as pinned host tensors behind a CUDA event
  (prefill.py) unless ``MooncakeKVSender.supports_host_tensor_indices`` is False: set once the
  module is imported.

The fault injectors are not here: the conformance suite's server launcher
(``kvattn.conformance.sglang_server``) installs them.
"""

import enum
import importlib.abc
import importlib.util
import sys
import types


def _stand_in_torchvision() -> None:
    if importlib.util.find_spec("torchvision") is not None:
        return
    tv, tr, fn = (
        types.ModuleType(n)
        for n in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional")
    )
    tv.__path__, tr.__path__ = [], []

    class InterpolationMode(enum.Enum):
        NEAREST = "nearest"
        BILINEAR = "bilinear"
        BICUBIC = "bicubic"

    fn.InterpolationMode = tr.InterpolationMode = InterpolationMode
    tv.transforms, tr.functional = tr, fn
    sys.modules.update({m.__name__: m for m in (tv, tr, fn)})


def _host_indices(module) -> None:
    module.MooncakeKVSender.supports_host_tensor_indices = False


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls each of ``callbacks[name]`` with the module right after module ``name`` has run."""

    def __init__(self, callbacks):
        self.callbacks = callbacks

    def find_spec(self, fullname, path=None, target=None):
        callback = self.callbacks.get(fullname)
        if callback is None:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            for call in callback:
                call(module)

        spec.loader.exec_module = exec_module
        return spec


if importlib.util.find_spec("sglang") is not None:
    import transformers.utils.import_utils  # noqa: F401  (before the stand-in: it sees none)

    _stand_in_torchvision()
    sys.meta_path.insert(
        0, _AfterImport({"sglang.srt.disaggregation.mooncake.conn": [_host_indices]})
    )
