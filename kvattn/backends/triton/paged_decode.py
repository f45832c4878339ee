"""Triton paged decode: split-KV (flash-decoding) with the ownership check as a compile-time flag.

One kernel source; ``CHECK=False`` compiles the check out and yields the unchecked variant, which
trusts the block table like any other paged kernel. Layout: :mod:`kvattn.layout`; tag format:
:mod:`kvattn.tags`; the rule itself: :mod:`.tag_rule`.

Grid ``(B, num_kv_heads, num_splits)``: one program reads one KV head's pages of one split once and
serves the whole GQA group of query heads with it. Splits cover page-aligned token ranges, so every
logical page is checked by exactly one split. The report is written by the ``kv_head == 0`` program
of each split (atomics into zeroed counters); other heads apply the same mask without counting.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ...layout import DecodeArgs
from ...report import OwnershipReport
from ..grids import plan_splits as plan_kv_splits
from .softmax import online_softmax_step, qk_scores
from .tag_rule import LOG2E, LOG2E_C, V_OUT_OF_RANGE, check_pages, readable_len

MAX_HEAD_DIM = 256


@triton.jit
def paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, block_table_ptr, seq_lens_ptr, tags_ptr, expected_ptr,
    out_ptr, lse_ptr, part_acc_ptr, part_ml_ptr,
    violations_ptr, reasons_ptr, checked_ptr, beyond_ptr, page_reasons_ptr,
    scale_log2, num_pages, max_pages, tokens_per_split,
    stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_bt, stride_eb, stride_ep, stride_ob, stride_oh,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_P: tl.constexpr, NUM_SPLITS: tl.constexpr, CHECK: tl.constexpr, DOT_FP32: tl.constexpr,
    RETURN_LSE: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    raw_len = tl.load(seq_lens_ptr + b)
    seq_len = tl.minimum(tl.maximum(raw_len, 0), max_pages * PAGE)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_g  # [BLOCK_G]
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
    bt_row = block_table_ptr + b * stride_bt
    exp_row = expected_ptr + b * stride_eb
    k_head = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_ptr + kv_head.to(tl.int64) * stride_vh

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for t0 in range(start, end, BLOCK_N):
        tok = t0 + offs_n  # [BLOCK_N]
        slot = tok % PAGE
        # The tag and expected owner load beside the block-table entry; a refused page (or slot)
        # is masked out of the K/V loads, so its memory is never read.
        if PAGE >= BLOCK_N:
            # The tile lies inside one page: one block-table entry and one tag, as scalars. The
            # check only lowers the scalar slot limit, so the per-element mask costs what the
            # length mask alone costs.
            logical = t0 // PAGE
            page = tl.load(bt_row + logical)
            limit = end - logical * PAGE  # the length mask in slot coordinates of this page
            if CHECK:
                in_range = (page >= 0) & (page < num_pages)
                tag = tl.load(tags_ptr + tl.where(in_range, page, 0))
                readable = readable_len(tag, tl.load(exp_row + logical * stride_ep))
                limit = tl.minimum(limit, tl.where(in_range, readable, 0))
            live = slot < limit
            k_rows = k_head + page.to(tl.int64) * stride_kp + slot * stride_ks  # [BLOCK_N]
            v_rows = v_head + page.to(tl.int64) * stride_vp + slot * stride_vs
        else:
            # Small pages: the tile spans BLOCK_N // PAGE pages, gathered per token.
            live = tok < end
            logical = tok // PAGE
            page = tl.load(bt_row + logical, mask=live, other=0)  # [BLOCK_N]
            if CHECK:
                in_range = (page >= 0) & (page < num_pages)
                tag = tl.load(tags_ptr + page, mask=live & in_range, other=0)
                exp_owner = tl.load(exp_row + logical * stride_ep, mask=live, other=0)
                live = live & (slot < tl.where(in_range, readable_len(tag, exp_owner), 0))
            k_rows = k_head + page.to(tl.int64) * stride_kp + slot * stride_ks  # [BLOCK_N]
            v_rows = v_head + page.to(tl.int64) * stride_vp + slot * stride_vs
        kv_mask = live[:, None] & d_mask[None, :]
        k = tl.load(k_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        s = qk_scores(q, k, DOT_FP32)
        s = tl.where(live[None, :], s * scale_log2, float("-inf"))  # [BLOCK_G, BLOCK_N]
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, DOT_FP32)

    if CHECK:
        if kv_head == 0:
            page_lo = start // PAGE
            page_hi = tl.minimum((start + tokens_per_split) // PAGE, max_pages)
            n_bad, reasons, n_read = check_pages(bt_row, exp_row, stride_ep, tags_ptr,
                                                 page_reasons_ptr + b * max_pages, num_pages,
                                                 seq_len, page_lo, page_hi, PAGE, BLOCK_P)
            if split == 0:
                # A seq_len past the table: nothing beyond it is read, and it counts once.
                beyond = (raw_len > max_pages * PAGE).to(tl.int32)
                tl.store(beyond_ptr + b, beyond)
                n_bad += beyond
                reasons = reasons | tl.where(beyond != 0, V_OUT_OF_RANGE, 0)
            tl.atomic_add(violations_ptr + b, n_bad)
            tl.atomic_or(reasons_ptr + b, reasons)
            tl.atomic_add(checked_ptr + b, n_read)

    if NUM_SPLITS == 1:
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        out = acc / l_safe[:, None]
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
        if RETURN_LSE:
            lse = tl.where(l_i > 0, (m_i + tl.log2(l_safe)) / LOG2E_C, float("-inf"))
            tl.store(lse_ptr + b * NUM_HEADS + heads, lse, mask=g_mask)
    else:
        row = (b * NUM_HEADS + heads) * NUM_SPLITS + split  # [BLOCK_G]
        tl.store(part_acc_ptr + row[:, None] * BLOCK_D + offs_d[None, :], acc, mask=g_mask[:, None])
        tl.store(part_ml_ptr + row * 2, m_i, mask=g_mask)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=g_mask)


@triton.jit
def merge_splits_kernel(
    part_acc_ptr, part_ml_ptr, out_ptr, lse_ptr, stride_ob, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, RETURN_LSE: tl.constexpr,
):
    """Combine the splits of one (sequence, head); splits with nothing readable have m = -inf, l = 0
    and weigh 0, and a row where every split is empty gets output 0 and lse -inf."""
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    row = (b * NUM_HEADS + head) * NUM_SPLITS + offs_s  # [BLOCK_S]
    m = tl.load(part_ml_ptr + row * 2, mask=s_mask, other=float("-inf"))
    l_s = tl.load(part_ml_ptr + row * 2 + 1, mask=s_mask, other=0.0)
    m_max = tl.max(m, axis=0)
    m_ref = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_ref)  # [BLOCK_S]
    l_sum = tl.sum(l_s * w, axis=0)
    acc = tl.load(part_acc_ptr + row[:, None] * BLOCK_D + offs_d[None, :], mask=s_mask[:, None],
                  other=0.0)  # [BLOCK_S, BLOCK_D]
    l_safe = tl.where(l_sum > 0, l_sum, 1.0)
    out = tl.sum(acc * w[:, None], axis=0) / l_safe  # [BLOCK_D]
    tl.store(out_ptr + b * stride_ob + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)
    if RETURN_LSE:
        lse = tl.where(l_sum > 0, (m_ref + tl.log2(l_safe)) / LOG2E_C, float("-inf"))
        tl.store(lse_ptr + b * NUM_HEADS + head, lse)


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def tile_sizes(head_dim: int, page_size: int) -> tuple[int, int]:
    """(BLOCK_D, BLOCK_N). tl.dot needs every dimension >= 16. 16-token tiles: on sm_90 compiles
    (tools/triton_resources.py; registers, not timings) the checked variant holds 56 registers at
    head_dim 128 and 80 at 256, against 89/159 with 32-token and 145/230 with 64-token tiles; the
    loads of later tiles are kept in flight by the software pipeline. Pages of 16 tokens or more
    then give one scalar block-table entry and tag per tile."""
    return max(16, triton.next_power_of_2(head_dim)), 16


def plan_splits(args: DecodeArgs, block_n: int, num_splits: int | None = None) -> tuple[int, int]:
    """(num_splits, tokens_per_split): :func:`kvattn.backends.grids.plan_splits`, aligned to both
    the page and the tile."""
    return plan_kv_splits(args, max(block_n, args.page_size), num_splits)


def decode(args: DecodeArgs, *, check: bool, out: torch.Tensor, lse: torch.Tensor | None,
           num_splits: int | None = None) -> OwnershipReport | None:
    """Launch the decode kernel (and the merge when split). Writes ``out`` (and ``lse``)."""
    q, k_cache, v_cache = args.q, args.k_cache, args.v_cache
    batch, num_heads, head_dim = q.shape
    group = num_heads // args.num_kv_heads
    block_d, block_n = tile_sizes(head_dim, args.page_size)
    splits, tokens_per_split = plan_splits(args, block_n, num_splits)
    dot_fp32 = q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and interpreted())
    report = OwnershipReport.allocate(batch, args.max_pages, q.device) if check else None
    if splits > 1:
        part_acc = torch.empty(batch * num_heads * splits * block_d, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(batch * num_heads * splits * 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    # Unused pointer arguments (report when unchecked, lse when not asked) get `out`: never touched.
    r = report if check else None
    return_lse = lse is not None
    lse_arg = lse if return_lse else out

    paged_decode_kernel[(batch, args.num_kv_heads, splits)](
        q, k_cache, v_cache, args.block_table, args.seq_lens, args.page_tags, args.expected,
        out, lse_arg, part_acc, part_ml,
        r.violations if r else out, r.reasons if r else out, r.pages_checked if r else out,
        r.beyond_table if r else out, r.page_reasons if r else out,
        args.scale * LOG2E, args.num_pages, args.max_pages, tokens_per_split,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        args.block_table.stride(0), args.expected.stride(0), args.expected.stride(1),
        out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_D=block_d, PAGE=args.page_size, BLOCK_N=block_n, BLOCK_P=64,
        NUM_SPLITS=splits, CHECK=check, DOT_FP32=dot_fp32, RETURN_LSE=return_lse,
        num_warps=4,
    )
    if splits > 1:
        merge_splits_kernel[(batch, num_heads)](
            part_acc, part_ml, out, lse_arg, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=splits,
            BLOCK_S=max(2, triton.next_power_of_2(splits)), RETURN_LSE=return_lse,
            num_warps=4,
        )
    return report
