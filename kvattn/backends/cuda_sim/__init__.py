"""The CUDA kernels' source run on the CPU: csrc/ compiled by the host compiler against the SIMT
harness of csrc/sim/simt.h (module ``_sim``), on CPU tensors.

This backend exists to test the CUDA kernels' logic where there is no GPU; it is slow and runs only
when named (``backend="cuda_sim"``). Same launcher and contract as :mod:`kvattn.backends.cuda`.
"""
from __future__ import annotations

import torch

from ...layout import DecodeArgs, ExtendArgs
from ...report import OwnershipReport
from ...writers import WriteResult
from ..cuda import launch

NAME = "cuda_sim"

try:
    from . import _sim
    _NOT_BUILT = None
except ImportError as e:
    _sim = None
    _NOT_BUILT = f"not built ({e}); build with `python setup.py build_ext --inplace`"


def why_not(args: DecodeArgs | ExtendArgs) -> str | None:
    """None if this backend can run ``args``, else the reason it cannot."""
    if _sim is None:
        return _NOT_BUILT
    if args.q.device.type != "cpu":
        return f"tensors are on {args.q.device}; the CPU harness runs CPU tensors only"
    return launch.unsupported(args)


def decode(args: DecodeArgs, *, check: bool, out: torch.Tensor, lse: torch.Tensor | None,
           num_splits: int | None = None, plan: dict | None = None, module=None
           ) -> OwnershipReport | None:
    """Run the decode on the harness. ``module`` selects another harness build (the tests' broken
    variants); default ``_sim``."""
    return launch.decode(module or _sim, args, check=check, out=out, lse=lse, num_splits=num_splits,
                         plan=plan)


def extend(args: ExtendArgs, *, check: bool, out: torch.Tensor, lse: torch.Tensor | None,
           tokens_per_tile: int | None = None, plan: dict | None = None
           ) -> OwnershipReport | None:
    """Run the extend on the harness."""
    return launch.extend(_sim, args, check=check, out=out, lse=lse, tokens_per_tile=tokens_per_tile,
                         plan=plan)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, page_tags: torch.Tensor, owners: torch.Tensor, *,
             module=None) -> WriteResult:
    """The CUDA writer kernels on the harness, on CPU tensors. Called by :func:`kvattn.write_kv`
    (``backend="cuda_sim"``) with validated arguments."""
    if _sim is None and module is None:
        raise RuntimeError(f"kvattn cuda_sim backend: {_NOT_BUILT}")
    if k_cache.device.type != "cpu":
        raise ValueError(f"k_cache: expected a CPU tensor (the harness runs on the CPU), got one on "
                         f"{k_cache.device}")
    return launch.write_kv(module or _sim, k, v, k_cache, v_cache, slot_mapping, page_tags, owners)


__all__ = ["NAME", "decode", "extend", "why_not", "write_kv"]
