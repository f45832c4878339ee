"""The Triton kernels of ``write_kv``, the stamping writer: :func:`kvattn.write_kv` as two launches
instead of a chain of torch ops.

The semantics are those of :func:`kvattn.writers.write_kv` (its docstring is authoritative): a
token lands if its page is in range, its owner holds the page, and its run (consecutive entries
filling consecutive slots of one page) starts at or below the page's ``valid_len``. Launch 1 decides
every token against the tags as they were before the call, stores the K/V of landed tokens only, and
records each landed token's stamp; launch 2 raises the tags with ``atomic_max``. Deciding before any
stamp is what keeps the result independent of the order programs run in. Into fp8 pools, launch 1
quantises each landed element by its head's scale (:mod:`.fp8`) and stores the code through a byte
view of the pool.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fp8 import exact_float32, fp8_bits, fp8_format
from .tag_rule import (
    DROP_GAP,
    DROP_NOT_HELD,
    DROP_OUT_OF_RANGE,
    held_by,
    written_prefix,
    written_tag,
)


@triton.jit
def write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    tags_ptr,
    owner_ptr,
    stamp_ptr,
    reasons_ptr,
    k_scale_ptr,
    v_scale_ptr,
    num_pages,
    stride_slot,
    stride_owner,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cp,
    stride_cs,
    stride_ch,
    stride_dp,
    stride_ds,
    stride_dh,
    PAGE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    QUANT: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    MAX_BITS: tl.constexpr,
    TOWARD_ZERO: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    target = tl.load(slot_mapping_ptr + i * stride_slot).to(tl.int64)
    owner = tl.load(owner_ptr + i * stride_owner)
    page = target // PAGE
    slot = target % PAGE
    in_range = (target >= 0) & (page < num_pages)
    tag = tl.load(tags_ptr + tl.where(in_range, page, 0))
    held = in_range & held_by(tag, owner)
    prefix = written_prefix(tag)

    # Walk back to where this token's run starts, but only as far as needed: once the run reaches
    # the written prefix the token lands. A predecessor continues the run when it targets the slot
    # just before on the same page under the same owner (then it is held exactly when this one is).
    start = slot
    j = i
    walking = held & (start > prefix)
    while walking:
        prev_target = tl.load(slot_mapping_ptr + (j - 1) * stride_slot, mask=j > 0, other=-1).to(
            tl.int64
        )
        prev_owner = tl.load(owner_ptr + (j - 1) * stride_owner, mask=j > 0, other=0)
        continues = (
            (j > 0)
            & (start > 0)
            & (prev_target == target - (slot - start) - 1)
            & (prev_owner == owner)
        )
        start = tl.where(continues, start - 1, start)
        j = tl.where(continues, j - 1, j)
        walking = continues & (start > prefix)
    landed = held & (start <= prefix)

    reason = tl.where(landed, 0, DROP_GAP)
    reason = tl.where(held, reason, DROP_NOT_HELD)
    reason = tl.where(in_range, reason, DROP_OUT_OF_RANGE)
    reason = tl.where(target < 0, 0, reason)  # padding: neither written nor counted
    tl.store(reasons_ptr + i, reason.to(tl.int8))
    tl.store(stamp_ptr + i, tl.where(landed, written_tag(owner, slot + 1), 0))

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    # A refused token has no heads to move (a scalar bool cannot join a vector mask directly).
    num_heads = tl.where(landed, NUM_KV_HEADS, 0)
    hd_mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < HEAD_DIM)  # [BLOCK_H, BLOCK_D]
    hdv_mask = (offs_h[:, None] < num_heads) & (
        offs_dv[None, :] < HEAD_DIM_V
    )  # [BLOCK_H, BLOCK_DV]
    k = tl.load(k_ptr + i * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=hd_mask)
    v = tl.load(
        v_ptr + i * stride_vt + offs_h[:, None] * stride_vh + offs_dv[None, :], mask=hdv_mask
    )
    if QUANT:
        # div_rn: the correctly rounded quotient the torch writer computes (not a fast reciprocal).
        ks = tl.load(k_scale_ptr + offs_h, mask=offs_h < NUM_KV_HEADS, other=1.0)
        vs = tl.load(v_scale_ptr + offs_h, mask=offs_h < NUM_KV_HEADS, other=1.0)
        k = fp8_bits(
            tl.math.div_rn(exact_float32(k), ks[:, None]), MANT, BIAS, MAX_BITS, TOWARD_ZERO
        )
        v = fp8_bits(
            tl.math.div_rn(exact_float32(v), vs[:, None]), MANT, BIAS, MAX_BITS, TOWARD_ZERO
        )
    safe_page = tl.where(landed, page, 0)
    tl.store(
        k_cache_ptr
        + safe_page * stride_cp
        + slot * stride_cs
        + offs_h[:, None] * stride_ch
        + offs_d[None, :],
        k,
        mask=hd_mask,
    )
    tl.store(
        v_cache_ptr
        + safe_page * stride_dp
        + slot * stride_ds
        + offs_h[:, None] * stride_dh
        + offs_dv[None, :],
        v,
        mask=hdv_mask,
    )


@triton.jit
def stamp_kernel(
    slot_mapping_ptr,
    stamp_ptr,
    tags_ptr,
    num_tokens,
    stride_slot,
    PAGE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    stamp = tl.load(stamp_ptr + offs, mask=offs < num_tokens, other=0)
    target = tl.load(slot_mapping_ptr + offs * stride_slot, mask=offs < num_tokens, other=0).to(
        tl.int64
    )
    # While one owner holds a page its tag only grows, so the largest stamp is the new tag.
    tl.atomic_max(tags_ptr + target // PAGE, stamp, mask=stamp != 0)


def write_kv(
    k,
    v,
    k_cache,
    v_cache,
    slot_mapping,
    page_tags,
    owners,
    k_scale=None,
    v_scale=None,
    fp8_rounding="nearest",
):
    """Launch both kernels; arguments already validated by :func:`kvattn.writers.write_kv`
    (``owners`` an int64 tensor ``[T]``, possibly a stride-0 expansion; ``slot_mapping`` read
    through its stride, as the other writers do; ``k_scale``/``v_scale`` ``[num_kv_heads]`` float32
    and ``fp8_rounding`` when quantising into fp8 pools). Returns ``(landed, drop_reasons)``."""
    import torch

    quant = k_scale is not None
    mant, bias, max_bits = fp8_format(k_cache.dtype) if quant else (0, 0, 0)
    if quant:
        # The kernel stores codes it computed itself: a byte view of the same pages (same strides,
        # one byte per element).
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    num_tokens = slot_mapping.shape[0]
    num_pages, page_size, num_kv_heads, head_dim = k_cache.shape
    stamps = torch.empty(num_tokens, dtype=torch.int64, device=k.device)
    reasons = torch.empty(num_tokens, dtype=torch.int8, device=k.device)
    write_kv_kernel[(num_tokens,)](
        k_ptr=k,
        v_ptr=v,
        k_cache_ptr=k_cache,
        v_cache_ptr=v_cache,
        slot_mapping_ptr=slot_mapping,
        tags_ptr=page_tags,
        owner_ptr=owners,
        stamp_ptr=stamps,
        reasons_ptr=reasons,
        k_scale_ptr=k_scale if quant else stamps,
        v_scale_ptr=v_scale if quant else stamps,
        num_pages=num_pages,
        stride_slot=slot_mapping.stride(0),
        stride_owner=owners.stride(0),
        stride_kt=k.stride(0),
        stride_kh=k.stride(1),
        stride_vt=v.stride(0),
        stride_vh=v.stride(1),
        stride_cp=k_cache.stride(0),
        stride_cs=k_cache.stride(1),
        stride_ch=k_cache.stride(2),
        stride_dp=v_cache.stride(0),
        stride_ds=v_cache.stride(1),
        stride_dh=v_cache.stride(2),
        PAGE=page_size,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_V=v_cache.shape[3],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_DV=triton.next_power_of_2(v_cache.shape[3]),
        QUANT=quant,
        MANT=mant,
        BIAS=bias,
        MAX_BITS=max_bits,
        TOWARD_ZERO=fp8_rounding == "toward_zero",
    )
    block = 256
    stamp_kernel[(triton.cdiv(num_tokens, block),)](
        slot_mapping_ptr=slot_mapping,
        stamp_ptr=stamps,
        tags_ptr=page_tags,
        num_tokens=num_tokens,
        stride_slot=slot_mapping.stride(0),
        PAGE=page_size,
        BLOCK=block,
    )
    return stamps != 0, reasons
