"""The reference as a backend: the oracle of :mod:`kvattn.reference`, writing into the caller's
buffers. Always available; slow (it gathers every page of the table)."""
from __future__ import annotations

import torch

from .. import reference
from ..layout import DecodeArgs, ExtendArgs
from ..report import OwnershipReport

NAME = "reference"


def why_not(args: DecodeArgs) -> str | None:
    return None


def decode(args: DecodeArgs, *, check: bool, out: torch.Tensor,
           lse: torch.Tensor | None) -> OwnershipReport | None:
    result = reference.paged_decode(args.q, args.k_cache, args.v_cache, args.block_table,
                                    args.seq_lens, args.page_tags, args.expected, scale=args.scale,
                                    check=check, return_lse=True)
    out.copy_(result[0])
    if lse is not None:
        lse.copy_(result[1])
    return result[2]


def extend(args: ExtendArgs, *, check: bool, out: torch.Tensor,
           lse: torch.Tensor | None) -> OwnershipReport | None:
    result = reference.paged_extend(args.q, args.k_cache, args.v_cache, args.cu_seqlens_q,
                                    args.block_table, args.seq_lens, args.page_tags, args.expected,
                                    scale=args.scale, causal=args.causal, check=check,
                                    return_lse=True)
    out.copy_(result[0])
    if lse is not None:
        lse.copy_(result[1])
    return result[2]
