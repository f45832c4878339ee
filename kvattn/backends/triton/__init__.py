"""The Triton backend: one module per op's kernels (``paged_decode``, ``paged_extend``,
``paged_mla_decode``, ``paged_mla_extend``, ``paged_write_kv``), the reader's rule they share
(``tag_rule``), and this facade for the registry."""

from __future__ import annotations

import torch

from ...report import WriteResult
from ...write_args import WriteArgs
from . import paged_write_kv
from .paged_decode import MAX_HEAD_DIM, decode, interpreted
from .paged_extend import extend
from .paged_mla_decode import MAX_KV_LORA_RANK, MAX_ROPE_DIM, mla_decode
from .paged_mla_extend import mla_extend

# The switches of kvattn.variants the kernels compile in.
SWITCHES = frozenset(
    {
        "window_left",
        "window_right",
        "logits_soft_cap",
        "sinks",
        "alibi_slopes",
        "fp8 KV",
        "fp8 queries",
        "custom_mask",
    }
)

# The switches of kvattn.variants the stamping writer implements (fp8 pools, quantising on write
# with either rounding).
WRITE_SWITCHES = frozenset({"fp8 KV", "fp8 toward_zero"})

NAME = "triton"
# Ops whose kernels read a kvattn.PageVerdict (docs/ownership.md section 9).
VERDICT_OPS = ("decode",)


def _why_not_here(device: torch.device) -> str | None:
    if device.type == "cpu" and not interpreted():
        return (
            "CPU tensors need the Triton interpreter (TRITON_INTERPRET=1 before importing triton)"
        )
    if device.type not in ("cpu", "cuda"):
        return f"device {device.type} is not supported"
    return None


def why_not(args) -> str | None:
    """None if this backend can run ``args`` (decode or extend), else the reason it cannot."""
    reason = _why_not_here(args.q.device)
    if reason is None and args.head_dim > MAX_HEAD_DIM:
        return f"head_dim {args.head_dim} > {MAX_HEAD_DIM}"
    if reason is None and args.head_dim_v > MAX_HEAD_DIM:
        return f"V head dim {args.head_dim_v} > {MAX_HEAD_DIM}"
    unsupported = [s for s in args.variant.switches() if s not in SWITCHES]
    if reason is None and unsupported:
        return f"no kernel for {', '.join(unsupported)}"
    return reason


def why_not_write_kv(args: WriteArgs) -> str | None:
    """None if the stamping writer can run ``args``, else the reason it cannot."""
    return _why_not_here(args.k_cache.device)


def write_kv(args: WriteArgs) -> WriteResult:
    """:mod:`.paged_write_kv`'s two launches (arguments accepted by :func:`why_not_write_kv`)."""
    landed, reasons = paged_write_kv.write_kv(
        *args.tensors(), args.k_scale, args.v_scale, args.fp8_rounding
    )
    return WriteResult(landed, reasons, (reasons != 0).sum())


def why_not_mla_decode(args) -> str | None:
    """None if the MLA kernels can run ``args`` (:class:`kvattn.layout.MLADecodeArgs` or
    :class:`~kvattn.layout.MLAExtendArgs`): the latent and RoPE parts within the kernels' tiles."""
    reason = _why_not_here(args.q.device)
    if reason is None and args.kv_lora_rank > MAX_KV_LORA_RANK:
        return f"kv_lora_rank {args.kv_lora_rank} > {MAX_KV_LORA_RANK}"
    if reason is None and args.rope_dim > MAX_ROPE_DIM:
        return f"rope_dim {args.rope_dim} > {MAX_ROPE_DIM}"
    return reason


why_not_mla_extend = why_not_mla_decode

__all__ = [
    "NAME",
    "VERDICT_OPS",
    "WRITE_SWITCHES",
    "decode",
    "extend",
    "mla_decode",
    "mla_extend",
    "why_not",
    "why_not_mla_decode",
    "why_not_mla_extend",
    "why_not_write_kv",
    "write_kv",
]
