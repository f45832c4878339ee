"""The CUDA backend: the kernels of csrc/ built by setup.py with nvcc (module ``_C``).

The binding takes raw pointers, so this module imports on any machine; :func:`why_not` says why it
cannot run (not built, no GPU, tensors not on a GPU, unsupported dtype or shape).
"""
from __future__ import annotations

import torch

from ...layout import DecodeArgs, ExtendArgs
from ...report import OwnershipReport
from ...writers import WriteResult
from . import launch

NAME = "cuda"

try:
    from . import _C
    _NOT_BUILT = None
except ImportError as e:
    _C = None
    _NOT_BUILT = f"not built ({e}); build with `python setup.py build_ext --inplace` where nvcc is installed"


def why_not(args: DecodeArgs | ExtendArgs) -> str | None:
    """None if this backend can run ``args``, else the reason it cannot."""
    if _C is None:
        return _NOT_BUILT
    if not torch.cuda.is_available():
        return "no GPU (torch.cuda.is_available() is False)"
    if args.q.device.type != "cuda":
        return f"tensors are on {args.q.device}, the CUDA kernels need them on a GPU"
    return launch.unsupported(args)


def decode(args: DecodeArgs, *, check: bool, out: torch.Tensor, lse: torch.Tensor | None,
           num_splits: int | None = None, plan: dict | None = None) -> OwnershipReport | None:
    """Enqueue the decode on the current stream; a CUDA error raises RuntimeError naming the kernel."""
    with torch.cuda.device(args.q.device):
        stream = torch.cuda.current_stream().cuda_stream
        return launch.decode(_C, args, check=check, out=out, lse=lse, num_splits=num_splits, stream=stream,
                                 plan=plan)


def extend(args: ExtendArgs, *, check: bool, out: torch.Tensor, lse: torch.Tensor | None,
           tokens_per_tile: int | None = None, plan: dict | None = None
           ) -> OwnershipReport | None:
    """Enqueue the extend on the current stream; a CUDA error raises RuntimeError naming the kernel."""
    with torch.cuda.device(args.q.device):
        stream = torch.cuda.current_stream().cuda_stream
        return launch.extend(_C, args, check=check, out=out, lse=lse, stream=stream,
                             tokens_per_tile=tokens_per_tile, plan=plan)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, page_tags: torch.Tensor, owners: torch.Tensor) -> WriteResult:
    """The CUDA writer kernels, enqueued on the current stream. Called by
    :func:`kvattn.write_kv` (``backend="cuda"``) with validated arguments."""
    if _C is None:
        raise RuntimeError(f"kvattn cuda backend: {_NOT_BUILT}")
    if k_cache.device.type != "cuda":
        raise ValueError(f"k_cache: expected a tensor on a CUDA device, got one on {k_cache.device}")
    with torch.cuda.device(k_cache.device):
        stream = torch.cuda.current_stream().cuda_stream
        return launch.write_kv(_C, k, v, k_cache, v_cache, slot_mapping, page_tags, owners, stream=stream)


__all__ = ["NAME", "decode", "extend", "why_not", "write_kv"]
