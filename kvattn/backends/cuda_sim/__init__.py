"""The CUDA kernels' source run on the CPU: csrc/ compiled by the host compiler against the SIMT
harness of csrc/sim/simt.h (module ``_sim``), on CPU tensors.

This backend exists to test the CUDA kernels' logic where there is no GPU; it is slow and runs only
when named (``backend="cuda_sim"``). Same launcher and contract as :mod:`kvattn.backends.cuda`.
"""

from __future__ import annotations

import torch

from ... import extensions
from ...layout import DecodeArgs, ExtendArgs, MLADecodeArgs
from ...report import OwnershipReport, WriteResult
from ...write_args import WriteArgs
from ..cuda import launch

# The writer quantises into fp8 pools by either rounding (csrc/kvattn/fp8.h fp8_from_float).
WRITE_SWITCHES = frozenset({"fp8 KV", "fp8 toward_zero"})
# The decode reads a step's verdict (kvattn.resolve_pages) with 16-byte copies (launch.unsupported).
VERDICT_OPS = ("decode",)
NAME = "cuda_sim"

_sim, STATUS = extensions.load("kvattn.backends.cuda_sim._sim")
_NOT_BUILT = None if _sim is not None else STATUS.line()


def _why_not_here(device: torch.device) -> str | None:
    if _sim is None:
        return _NOT_BUILT
    if device.type != "cpu":
        return f"tensors are on {device}; the CPU harness runs CPU tensors only"
    return None


def why_not(args: DecodeArgs | ExtendArgs) -> str | None:
    """None if this backend can run ``args`` (decode or extend), else the reason it cannot."""
    return _why_not_here(args.q.device) or launch.unsupported(args) or launch.not_built(_sim, args)


def why_not_write_kv(args: WriteArgs) -> str | None:
    """None if the harness writer can run ``args``, else the reason it cannot."""
    return _why_not_here(args.k_cache.device) or launch.not_built_write_kv(_sim, args)


def decode(
    args: DecodeArgs,
    *,
    check: bool,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    num_splits: int | None = None,
    plan: dict | None = None,
    module=None,
) -> OwnershipReport | None:
    """Run the decode on the harness. ``module`` selects another harness build (the tests' broken
    variants); default ``_sim``."""
    return launch.decode(
        module or _sim, args, check=check, out=out, lse=lse, num_splits=num_splits, plan=plan
    )


def extend(
    args: ExtendArgs,
    *,
    check: bool,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    tokens_per_tile: int | None = None,
    plan: dict | None = None,
) -> OwnershipReport | None:
    """Run the extend on the harness."""
    return launch.extend(
        _sim, args, check=check, out=out, lse=lse, tokens_per_tile=tokens_per_tile, plan=plan
    )


def why_not_mla_decode(args: MLADecodeArgs) -> str | None:
    """None if the harness's latent decode tile can run ``args``, else the reason it cannot."""
    return (
        _why_not_here(args.q.device)
        or launch.unsupported_mla(args)
        or launch.not_built(_sim, launch.mla_as_decode(args))
    )


def mla_decode(
    args: MLADecodeArgs,
    *,
    check: bool,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    plan: dict | None = None,
) -> OwnershipReport | None:
    """Run the MLA decode (the decode kernel's latent tile) on the harness."""
    return launch.mla_decode(_sim, args, check=check, out=out, lse=lse, plan=plan)


def write_kv(args: WriteArgs) -> WriteResult:
    """The CUDA writer kernels on the harness, on CPU tensors (arguments accepted by
    :func:`why_not_write_kv`)."""
    return launch.write_kv(_sim, args)


__all__ = [
    "NAME",
    "VERDICT_OPS",
    "WRITE_SWITCHES",
    "decode",
    "extend",
    "mla_decode",
    "why_not",
    "why_not_mla_decode",
    "why_not_write_kv",
    "write_kv",
]
