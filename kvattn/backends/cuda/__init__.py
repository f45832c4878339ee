"""The CUDA backend: the kernels of csrc/ built by setup.py with nvcc (module ``_C``).

The binding takes raw pointers, so this module imports on any machine; :func:`why_not` says why it
cannot run (not built, no GPU, tensors not on a GPU, unsupported dtype or shape).
"""

from __future__ import annotations

import torch

from ... import extensions
from ...layout import DecodeArgs, ExtendArgs, MLADecodeArgs
from ...report import OwnershipReport, WriteResult
from ...write_args import WriteArgs
from . import launch

# The writer quantises into fp8 pools by either rounding (csrc/kvattn/fp8.h fp8_from_float).
WRITE_SWITCHES = frozenset({"fp8 KV", "fp8 toward_zero"})
# The decode reads a step's verdict (kvattn.resolve_pages) with 16-byte copies (launch.unsupported).
VERDICT_OPS = ("decode",)
NAME = "cuda"

_C, STATUS = extensions.load("kvattn.backends.cuda._C")
_NOT_BUILT = None if _C is not None else STATUS.line()


def _why_not_here(device: torch.device) -> str | None:
    if _C is None:
        return _NOT_BUILT
    if not torch.cuda.is_available():
        return "no GPU (torch.cuda.is_available() is False)"
    if device.type != "cuda":
        return f"tensors are on {device}, the CUDA kernels need them on a GPU"
    return None


def why_not(args: DecodeArgs | ExtendArgs) -> str | None:
    """None if this backend can run ``args`` (decode or extend), else the reason it cannot."""
    return _why_not_here(args.q.device) or launch.unsupported(args) or launch.not_built(_C, args)


def why_not_write_kv(args: WriteArgs) -> str | None:
    """None if the CUDA writer can run ``args``, else the reason it cannot."""
    return _why_not_here(args.k_cache.device) or launch.not_built_write_kv(_C, args)


def decode(
    args: DecodeArgs,
    *,
    check: bool,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    num_splits: int | None = None,
    plan: dict | None = None,
) -> OwnershipReport | None:
    """Enqueue the decode on the current stream; a CUDA error raises RuntimeError naming the kernel."""
    with torch.cuda.device(args.q.device):
        stream = torch.cuda.current_stream().cuda_stream
        return launch.decode(
            _C, args, check=check, out=out, lse=lse, num_splits=num_splits, stream=stream, plan=plan
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
    """Enqueue the extend on the current stream; a CUDA error raises RuntimeError naming the kernel."""
    with torch.cuda.device(args.q.device):
        stream = torch.cuda.current_stream().cuda_stream
        return launch.extend(
            _C,
            args,
            check=check,
            out=out,
            lse=lse,
            stream=stream,
            tokens_per_tile=tokens_per_tile,
            plan=plan,
        )


def why_not_mla_decode(args: MLADecodeArgs) -> str | None:
    """None if the latent decode tile can run ``args``, else the reason it cannot."""
    return (
        _why_not_here(args.q.device)
        or launch.unsupported_mla(args)
        or launch.not_built(_C, launch.mla_as_decode(args))
    )


def mla_decode(
    args: MLADecodeArgs,
    *,
    check: bool,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    plan: dict | None = None,
) -> OwnershipReport | None:
    """Enqueue the MLA decode on the current stream (the decode kernel's latent tile)."""
    with torch.cuda.device(args.q.device):
        stream = torch.cuda.current_stream().cuda_stream
        return launch.mla_decode(_C, args, check=check, out=out, lse=lse, stream=stream, plan=plan)


def write_kv(args: WriteArgs) -> WriteResult:
    """The CUDA writer kernels, enqueued on the current stream (arguments accepted by
    :func:`why_not_write_kv`)."""
    with torch.cuda.device(args.k_cache.device):
        stream = torch.cuda.current_stream().cuda_stream
        return launch.write_kv(_C, args, stream=stream)


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
