"""The backend ``reference``: the oracle (:mod:`kvattn.reference`, the pure-PyTorch definition every
backend is tested against) run as a backend, writing into the caller's buffers. Always available;
slow (it gathers every page of the table)."""

from __future__ import annotations

import torch

from .. import reference
from ..layout import DecodeArgs, ExtendArgs, MLADecodeArgs, MLAExtendArgs, query_offsets
from ..report import OwnershipReport

NAME = "reference"
VERDICT_OPS = ("decode",)


def why_not(args: DecodeArgs) -> str | None:
    return None


def decode(
    args: DecodeArgs, *, check: bool, out: torch.Tensor, lse: torch.Tensor | None
) -> OwnershipReport | None:
    result = reference.decode_args(args, check, return_lse=True)
    out.copy_(result[0])
    if lse is not None:
        lse.copy_(result[1])
    return result[2]


def extend(
    args: ExtendArgs, *, check: bool, out: torch.Tensor, lse: torch.Tensor | None
) -> OwnershipReport | None:
    return _covered_rows(args, reference.extend_args(args, check, return_lse=True), out, lse)


def mla_extend(
    args: MLAExtendArgs, *, check: bool, out: torch.Tensor, lse: torch.Tensor | None
) -> OwnershipReport | None:
    return _covered_rows(args, reference.mla_extend_args(args, check, return_lse=True), out, lse)


def _covered_rows(args, result, out, lse) -> OwnershipReport | None:
    """Copy an extend's ``(out, lse, report)``. Like the kernels, write only the rows some sequence
    covers (all of them when cu_seqlens_q is well formed); the oracle syncs anyway."""
    offsets = query_offsets(args.cu_seqlens_q, args.total_q)
    lo, hi = int(offsets[0]), int(offsets[-1])
    out[lo:hi].copy_(result[0][lo:hi])
    if lse is not None:
        lse[lo:hi].copy_(result[1][lo:hi])
    return result[2]


def mla_decode(
    args: MLADecodeArgs, *, check: bool, out: torch.Tensor, lse: torch.Tensor | None
) -> OwnershipReport | None:
    result = reference.paged_mla_decode(
        args.q,
        args.kv_cache,
        args.block_table,
        args.seq_lens,
        args.page_tags,
        args.expected,
        kv_lora_rank=args.kv_lora_rank,
        scale=args.scale,
        check=check,
        return_lse=True,
    )
    out.copy_(result[0])
    if lse is not None:
        lse.copy_(result[1])
    return result[2]
