"""Test-only: loaded by the vLLM engine processes the suites start (``kvattn_testing.engines.env``
puts this folder on their ``PYTHONPATH``).

vLLM's LLaVA imports ``transformers.models.pixtral.image_processing_pixtral``, which imports
``torchvision.transforms.v2.functional`` at module level; the index's torchvision is a CUDA build
that does not load beside the CPU torch, so vLLM's environment has none. The tiny LLaVA of the
multimodal lane (``kvattn.conformance.vllm.media_lane``) processes its images with PIL alone and
never calls into torchvision: while that one module runs (and only then, so that transformers still
sees no torchvision and picks its PIL image processors), empty stand-ins take torchvision's place.
Where a real torchvision is importable, nothing is stood in.
"""

import importlib.abc
import importlib.util
import sys
import types

NEEDS_TORCHVISION = "transformers.models.pixtral.image_processing_pixtral"
STAND_INS = (
    "torchvision",
    "torchvision.transforms",
    "torchvision.transforms.v2",
    "torchvision.transforms.v2.functional",
)


class _WhileImporting(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != NEEDS_TORCHVISION:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        run = spec.loader.exec_module

        def exec_module(module):
            added = [name for name in STAND_INS if name not in sys.modules]
            for name in added:
                sys.modules[name] = types.ModuleType(name)
                sys.modules[name].__path__ = []
            try:
                run(module)
            finally:
                for name in added:
                    sys.modules.pop(name, None)

        spec.loader.exec_module = exec_module
        return spec


if importlib.util.find_spec("torchvision") is None and importlib.util.find_spec("vllm") is not None:
    sys.meta_path.insert(0, _WhileImporting())
