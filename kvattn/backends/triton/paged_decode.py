"""Triton paged decode: split-KV (flash-decoding) with the ownership check as a compile-time flag.

One kernel source; ``CHECK=False`` compiles the check out and yields the unchecked variant. Both
variants keep the page-id range guard (an entry outside the pool is never dereferenced), so the
K/V loads depend on the block table in the same way and the compiler pipelines them alike: the
only difference is the tag test. Layout: :mod:`kvattn.layout`; tag format: :mod:`kvattn.tags`; the
rule itself: :mod:`.tag_rule`; launch configurations: :mod:`.configs`.

Grid ``(B, num_kv_heads, num_splits)``: one program reads one KV head's pages of one split once and
serves the whole GQA group of query heads with it. ``num_splits`` is a run-time value; each program
takes an equal, page-aligned share of its sequence's actual length
(:func:`kvattn.backends.grids.split_chunk`), so every logical page is read and checked by exactly
one program per KV head.

The report has programs of its own: checked, the grid has one more column (index 0 on axis 1) whose
program for each (sequence, split) reads that split's table entries, tags and expected owners
(never page memory), and writes their reasons and counts while the attention programs stream K/V,
so no attention program does report work after its loop. With one split it writes the final
counters; with several, its partial counts, which a program of its own in the merge grid sums.
Nothing is zeroed by a separate launch and no atomics are used; entries of ``page_reasons`` past
the sequence are zeroed by the same programs. The split planner counts the report column in both
variants, so checked and unchecked launches split alike.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ...layout import DecodeArgs
from ...report import OwnershipReport
from ...variants import FP8_DTYPES
from ..grids import plan_num_splits
from .configs import DecodeConfig, decode_config
from .softmax import (
    alibi_anchor,
    heads_read,
    online_softmax_step,
    qk_scores,
    sink_denominator,
    variant_scores,
)
from .split_report import REPORT_FIELDS, REPORT_PTRS, store_split_report
from .tag_rule import (
    LOG2E,
    LOG2E_C,
    V_OUT_OF_RANGE,
    add_fresh_refusal,
    bit_or,
    check_pages,
    fresh_tile_slots,
    tile_slots,
    verdict_tile_slots,
)

MAX_HEAD_DIM = 512


@triton.jit
def split_range(seq_len, split, num_splits, min_chunk, ALIGN: tl.constexpr):
    """``[start, end)`` of one split: kvattn.backends.grids.split_chunk on the device."""
    share = tl.cdiv(seq_len, num_splits)
    chunk = tl.maximum(tl.cdiv(share, ALIGN) * ALIGN, min_chunk)
    start = split * chunk
    return start, tl.minimum(start + chunk, seq_len), chunk


@triton.jit
def window_start(raw_len, seq_len, window_left, WINDOW: tl.constexpr, ALIGN: tl.constexpr):
    """``(first key read, first token of the splits)``: with a sliding window the query at
    ``raw_len - 1`` (the length as given, also past the table: kvattn.variants) reads keys from
    ``raw_len - 1 - window_left`` on, and the splits cover ``[span_lo, seq_len)`` (``seq_len``
    clamped to the table) from that key's ALIGN-aligned start, or from seq_len when the window
    lies past the table, so every page is still checked by one split and pages before the window
    by none."""
    if WINDOW:
        first = tl.maximum(tl.maximum(raw_len, 0) - 1 - window_left, 0)
        return first, tl.minimum(first // ALIGN * ALIGN, seq_len)
    return 0, 0


@triton.jit
def attend_tile(
    q,
    k_head,
    v_head,
    page,
    slot,
    live,
    t0,
    offs_n,
    offs_d,
    offs_dv,
    d_mask,
    dv_mask,
    stride_kp,
    stride_ks,
    stride_vp,
    stride_vs,
    first_key,
    anchor,
    qk_scale,
    soft_cap,
    alibi2,
    m_i,
    l_i,
    acc,
    WINDOW: tl.constexpr,
    FP8: tl.constexpr,
    DOT_FP32: tl.constexpr,
    SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr,
):
    """One tile of keys ``[t0, t0 + BLOCK_N)`` (``page``, ``slot``, ``live`` from the table or the
    verdict) folded into the online softmax ``(m_i, l_i, acc)`` of the program's query heads."""
    if WINDOW:
        live = live & (t0 + offs_n >= first_key)
    page = page.to(tl.int64)
    k_rows = k_head + page * stride_kp + slot * stride_ks  # [BLOCK_N]
    v_rows = v_head + page * stride_vp + slot * stride_vs
    k = tl.load(
        k_rows[:, None] + offs_d[None, :], mask=live[:, None] & d_mask[None, :], other=0.0
    )  # [BLOCK_N, BLOCK_D]
    v = tl.load(
        v_rows[:, None] + offs_dv[None, :], mask=live[:, None] & dv_mask[None, :], other=0.0
    )  # [BLOCK_N, BLOCK_DV]
    if FP8:
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    distance = (t0 + offs_n - anchor).to(tl.float32)[None, :]  # [1, BLOCK_N]
    s = variant_scores(
        qk_scores(q, k, DOT_FP32), qk_scale, soft_cap, alibi2, distance, SOFTCAP, ALIBI
    )
    s = tl.where(live[None, :], s, float("-inf"))  # [BLOCK_G, BLOCK_N]
    return online_softmax_step(s, v, m_i, l_i, acc, DOT_FP32)


@triton.jit
def paged_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    block_table_ptr,
    seq_lens_ptr,
    tags_ptr,
    expected_ptr,
    verdict_ptr,
    out_ptr,
    lse_ptr,
    part_acc_ptr,
    part_ml_ptr,
    part_report_ptr,
    violations_ptr,
    reasons_ptr,
    checked_ptr,
    beyond_ptr,
    page_reasons_ptr,
    scale_log2,
    num_pages,
    max_pages,
    num_splits,
    min_chunk,
    window_left,
    soft_cap,
    alibi_ptr,
    sinks_ptr,
    k_scale_ptr,
    v_scale_ptr,
    q_scale_ptr,
    alibi_stride,
    scale_stride,
    stride_qb,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_eb,
    stride_ep,
    stride_ob,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ALIGN: tl.constexpr,
    BLOCK_P: tl.constexpr,
    CHECK: tl.constexpr,
    VERDICT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    OWNER_PER_PAGE: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr,
    SINKS: tl.constexpr,
    FP8: tl.constexpr,
    Q_FP8: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # Checked, column 0 of each (sequence, split) writes the report: its own program, running
    # beside the attention programs instead of after one of them.
    reporter = False
    if CHECK:
        kv_head -= 1
        reporter = kv_head < 0

    raw_len = tl.load(seq_lens_ptr + b)
    capacity = max_pages * PAGE
    seq_len = tl.minimum(tl.maximum(raw_len, 0), capacity)
    q_pos = raw_len - 1  # the query's position, from the length as given (kvattn.variants)
    anchor = alibi_anchor(q_pos, capacity)
    first_key, span_lo = window_start(raw_len, seq_len, window_left, WINDOW, ALIGN)
    start, end, _ = split_range(seq_len - span_lo, split, num_splits, min_chunk, ALIGN)
    start += span_lo
    end += span_lo

    # The new token's page (logical page ``fresh``, its slot ``fresh_slot``), which a verdict
    # leaves to each call: its other slots come from the verdict, the new one from this tag.
    has_fresh = (q_pos >= 0) & (q_pos < capacity)
    fresh = tl.where(has_fresh, q_pos // PAGE, -1)
    fresh_slot = q_pos - fresh * PAGE
    verdict_row = verdict_ptr + b * max_pages
    if reporter and VERDICT:
        if (split == 0) & has_fresh:
            exp_row = expected_ptr + b * stride_eb
            add_fresh_refusal(
                verdict_row,
                exp_row,
                stride_ep,
                tags_ptr,
                page_reasons_ptr + b * max_pages,
                violations_ptr + b,
                reasons_ptr + b,
                num_pages,
                fresh,
                fresh_slot,
            )
    elif reporter:
        bt_row = block_table_ptr + b * stride_bt
        exp_row = expected_ptr + b * stride_eb
        reasons_row = page_reasons_ptr + b * max_pages
        store_split_report(
            bt_row,
            exp_row,
            stride_ep,
            tags_ptr,
            reasons_row,
            part_report_ptr,
            violations_ptr,
            reasons_ptr,
            checked_ptr,
            beyond_ptr,
            b,
            split,
            num_splits,
            num_pages,
            max_pages,
            raw_len,
            seq_len,
            first_key,
            start,
            end,
            PAGE,
            BLOCK_P,
        )
        if WINDOW:
            # And its stripe of the entries before the splits' span (before the window).
            stripe = tl.cdiv(span_lo // PAGE, num_splits)
            check_pages(
                bt_row,
                exp_row,
                stride_ep,
                tags_ptr,
                reasons_row,
                num_pages,
                seq_len,
                first_key,
                split * stripe,
                tl.minimum((split + 1) * stripe, span_lo // PAGE),
                PAGE,
                BLOCK_P,
            )
    else:
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)  # V's head dim, the output's
        offs_n = tl.arange(0, BLOCK_N)
        heads = kv_head * GROUP + offs_g  # [BLOCK_G]
        g_mask = offs_g < GROUP
        d_mask = offs_d < HEAD_DIM
        dv_mask = offs_dv < HEAD_DIM_V
        q = tl.load(
            q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
            mask=g_mask[:, None] & d_mask[None, :],
            other=0.0,
        )  # [BLOCK_G, BLOCK_D]
        if Q_FP8:
            q = q.to(tl.bfloat16)  # exact: every e4m3 and e5m2 value is a bfloat16
        bt_row = block_table_ptr + b * stride_bt
        exp_row = expected_ptr + b * stride_eb
        seq_owner = tl.load(exp_row)  # expected given per sequence: one load for every page
        k_head = k_ptr + kv_head.to(tl.int64) * stride_kh
        v_head = v_ptr + kv_head.to(tl.int64) * stride_vh
        # This sequence's slopes and scales (strides 0 when every sequence shares them).
        alibi_ptr += b * alibi_stride
        k_scale_ptr += b * scale_stride
        v_scale_ptr += b * scale_stride
        q_scale_ptr += b * scale_stride
        qk_scale = scale_log2
        if FP8:
            # Per-head dequantisation: K's scale folds into the logits, V's into the output.
            qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head)
        if Q_FP8:
            qk_scale = qk_scale * tl.load(q_scale_ptr + kv_head)  # and the query's
        alibi2 = tl.zeros([BLOCK_G], dtype=tl.float32)
        if ALIBI:
            alibi2 = tl.load(alibi_ptr + heads, mask=g_mask, other=0.0) * LOG2E_C
        m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_DV], dtype=tl.float32)
        loop_lo = start
        if WINDOW:
            loop_lo = tl.maximum(
                start, first_key // BLOCK_N * BLOCK_N
            )  # tiles wholly before: skipped
        main_end = end
        if VERDICT:
            # Tiles from the one holding the new token's page's first slot on are peeled off.
            fresh_lo = loop_lo + tl.maximum(fresh * PAGE - loop_lo, 0) // BLOCK_N * BLOCK_N
            main_end = tl.where(has_fresh, tl.minimum(end, fresh_lo), end)
        for t0 in range(loop_lo, main_end, BLOCK_N):
            if VERDICT:
                page, slot, live = verdict_tile_slots(
                    t0, end, offs_n, verdict_row, num_pages, PAGE, BLOCK_N
                )
            else:
                page, slot, live = tile_slots(
                    t0,
                    end,
                    offs_n,
                    bt_row,
                    exp_row,
                    stride_ep,
                    seq_owner,
                    tags_ptr,
                    num_pages,
                    PAGE,
                    BLOCK_N,
                    CHECK,
                    OWNER_PER_PAGE,
                )
            m_i, l_i, acc = attend_tile(
                q,
                k_head,
                v_head,
                page,
                slot,
                live,
                t0,
                offs_n,
                offs_d,
                offs_dv,
                d_mask,
                dv_mask,
                stride_kp,
                stride_ks,
                stride_vp,
                stride_vs,
                first_key,
                anchor,
                qk_scale,
                soft_cap,
                alibi2,
                m_i,
                l_i,
                acc,
                WINDOW,
                FP8,
                DOT_FP32,
                SOFTCAP,
                ALIBI,
            )
        if VERDICT:
            for t0 in range(main_end, end, BLOCK_N):
                page, slot, live = fresh_tile_slots(
                    t0,
                    end,
                    offs_n,
                    verdict_row,
                    exp_row,
                    stride_ep,
                    seq_owner,
                    tags_ptr,
                    num_pages,
                    fresh,
                    fresh_slot,
                    PAGE,
                    BLOCK_N,
                    OWNER_PER_PAGE,
                )
                m_i, l_i, acc = attend_tile(
                    q,
                    k_head,
                    v_head,
                    page,
                    slot,
                    live,
                    t0,
                    offs_n,
                    offs_d,
                    offs_dv,
                    d_mask,
                    dv_mask,
                    stride_kp,
                    stride_ks,
                    stride_vp,
                    stride_vs,
                    first_key,
                    anchor,
                    qk_scale,
                    soft_cap,
                    alibi2,
                    m_i,
                    l_i,
                    acc,
                    WINDOW,
                    FP8,
                    DOT_FP32,
                    SOFTCAP,
                    ALIBI,
                )

        if FP8:
            acc = acc * tl.load(v_scale_ptr + kv_head)  # V's scale, once (splits store scaled sums)
        if SINKS or ALIBI or FP8:
            # A head whose switch values are invalid (kvattn.variants) reads nothing: from here on its
            # state is that of a row with nothing read, in this split and in the merge.
            reads = heads_read(
                heads,
                g_mask,
                kv_head,
                sinks_ptr,
                alibi_ptr,
                k_scale_ptr,
                v_scale_ptr,
                q_scale_ptr,
                SINKS,
                ALIBI,
                FP8,
                Q_FP8,
            )
            acc = tl.where(reads[:, None], acc, 0.0)
            m_i = tl.where(reads, m_i, float("-inf"))
            l_i = tl.where(reads, l_i, 0.0)
        if num_splits == 1:
            shift2 = tl.zeros([BLOCK_G], dtype=tl.float32)
            if ALIBI:
                shift2 = alibi2 * (anchor - q_pos).to(tl.float32)  # 0 inside the table
            sink2 = tl.zeros([BLOCK_G], dtype=tl.float32)
            if SINKS:
                sink2 = tl.load(sinks_ptr + heads, mask=g_mask, other=0.0) * LOG2E_C
            out = acc / sink_denominator(l_i, m_i, sink2 - shift2, SINKS)[:, None]
            tl.store(
                out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_dv[None, :],
                out.to(out_ptr.dtype.element_ty),
                mask=g_mask[:, None] & dv_mask[None, :],
            )
            if RETURN_LSE:
                l_safe = tl.where(l_i > 0, l_i, 1.0)
                lse = tl.where(l_i > 0, (m_i + tl.log2(l_safe) + shift2) / LOG2E_C, float("-inf"))
                tl.store(lse_ptr + b * NUM_HEADS + heads, lse, mask=g_mask)
        elif start < end:
            # Splits past the sequence's end write nothing; the merge reads only the others.
            row = (b * NUM_HEADS + heads) * num_splits + split  # [BLOCK_G]
            tl.store(
                part_acc_ptr + row[:, None] * BLOCK_DV + offs_dv[None, :], acc, mask=g_mask[:, None]
            )
            tl.store(part_ml_ptr + row * 2, m_i, mask=g_mask)
            tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=g_mask)


@triton.jit
def merge_splits_kernel(
    part_acc_ptr,
    part_ml_ptr,
    part_report_ptr,
    seq_lens_ptr,
    out_ptr,
    lse_ptr,
    violations_ptr,
    reasons_ptr,
    checked_ptr,
    beyond_ptr,
    max_pages,
    num_splits,
    min_chunk,
    stride_ob,
    stride_oh,
    window_left,
    sinks_ptr,
    alibi_ptr,
    alibi_stride,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    ALIGN: tl.constexpr,
    BLOCK_S: tl.constexpr,
    CHECK: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    WINDOW: tl.constexpr,
    SINKS: tl.constexpr,
    ALIBI: tl.constexpr,
):
    """Combine the splits of one (sequence, head) that lie inside the sequence (their sums already
    scaled by an fp8 pool's v_scale); a split with nothing readable (or of a head that reads
    nothing) has m = -inf, l = 0 and weighs 0, and a row where every split is empty gets output 0
    and lse -inf. The splits' logits leave out ALiBi's shift past the table (:func:`alibi_anchor`):
    it joins here, once. Checked, program ``NUM_HEADS`` of each sequence sums the splits' report
    counts instead, beside the others."""
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    raw_len = tl.load(seq_lens_ptr + b)
    capacity = max_pages * PAGE
    seq_len = tl.minimum(tl.maximum(raw_len, 0), capacity)
    _, span_lo = window_start(raw_len, seq_len, window_left, WINDOW, ALIGN)
    _, _, chunk = split_range(seq_len - span_lo, 0, num_splits, min_chunk, ALIGN)
    active = tl.cdiv(seq_len - span_lo, chunk)
    offs_s = tl.arange(0, BLOCK_S)
    reporter = False
    if CHECK:
        reporter = head == NUM_HEADS
    if reporter:
        bad = tl.zeros([BLOCK_S], dtype=tl.int32)
        read = tl.zeros([BLOCK_S], dtype=tl.int32)
        bits = tl.zeros([BLOCK_S], dtype=tl.int32)
        for s0 in range(0, active, BLOCK_S):
            s = s0 + offs_s
            part = part_report_ptr + (b * num_splits + s) * REPORT_FIELDS
            bad += tl.load(part, mask=s < active, other=0)
            bits = bits | tl.load(part + 1, mask=s < active, other=0)
            read += tl.load(part + 2, mask=s < active, other=0)
        beyond = (raw_len > capacity).to(tl.int32)
        tl.store(beyond_ptr + b, beyond)
        reasons = tl.reduce(bits, 0, bit_or) | tl.where(beyond != 0, V_OUT_OF_RANGE, 0)
        tl.store(violations_ptr + b, tl.sum(bad, axis=0) + beyond)
        tl.store(reasons_ptr + b, reasons)
        tl.store(checked_ptr + b, tl.sum(read, axis=0))
    else:
        offs_d = tl.arange(0, BLOCK_D)
        base = (b * NUM_HEADS + head) * num_splits
        m_max = tl.full([BLOCK_S], float("-inf"), dtype=tl.float32)
        for s0 in range(0, active, BLOCK_S):
            s = s0 + offs_s
            m_max = tl.maximum(
                m_max, tl.load(part_ml_ptr + (base + s) * 2, mask=s < active, other=float("-inf"))
            )
        m_top = tl.max(m_max, axis=0)
        m_ref = tl.where(m_top == float("-inf"), 0.0, m_top)
        l_sum = tl.zeros([BLOCK_S], dtype=tl.float32)
        acc = tl.zeros([BLOCK_S, BLOCK_D], dtype=tl.float32)
        for s0 in range(0, active, BLOCK_S):
            s = s0 + offs_s
            s_mask = s < active
            m = tl.load(part_ml_ptr + (base + s) * 2, mask=s_mask, other=float("-inf"))
            w = tl.exp2(m - m_ref)  # [BLOCK_S]
            l_sum += tl.load(part_ml_ptr + (base + s) * 2 + 1, mask=s_mask, other=0.0) * w
            part = tl.load(
                part_acc_ptr + (base + s)[:, None] * BLOCK_D + offs_d[None, :],
                mask=s_mask[:, None],
                other=0.0,
            )  # [BLOCK_S, BLOCK_D]
            acc += part * w[:, None]
        l_total = tl.sum(l_sum, axis=0)
        l_safe = tl.where(l_total > 0, l_total, 1.0)
        shift2 = 0.0
        if ALIBI:
            q_pos = raw_len - 1
            slope2 = tl.load(alibi_ptr + b * alibi_stride + head) * LOG2E_C
            shift2 = slope2 * (alibi_anchor(q_pos, capacity) - q_pos).to(tl.float32)
        denominator = l_safe
        if SINKS:
            # With nothing read the sink joins no denominator (a sink of -inf would give 0 / 0).
            sink2 = tl.load(sinks_ptr + head) * LOG2E_C - shift2
            denominator = tl.where(l_total > 0, l_total + tl.exp2(sink2 - m_ref), 1.0)
        out = tl.sum(acc, axis=0) / denominator  # [BLOCK_D]
        tl.store(
            out_ptr + b * stride_ob + head * stride_oh + offs_d,
            out.to(out_ptr.dtype.element_ty),
            mask=offs_d < HEAD_DIM,
        )
        if RETURN_LSE:
            lse = tl.where(l_total > 0, (m_ref + tl.log2(l_safe) + shift2) / LOG2E_C, float("-inf"))
            tl.store(lse_ptr + b * NUM_HEADS + head, lse)


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def compute_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype of the kernels' dot operands: ``q``'s, bfloat16 for fp8 queries (upcast on
    load, exactly; the fp8 pools' tiles are upcast to it too)."""
    return torch.bfloat16 if q.dtype in FP8_DTYPES else q.dtype


def dots_in_fp32(q: torch.Tensor) -> bool:
    """DOT_FP32 of the kernels (:func:`.softmax.qk_scores`): float32 operands, and bfloat16 ones
    under the interpreter."""
    dtype = compute_dtype(q)
    return dtype == torch.float32 or (dtype == torch.bfloat16 and interpreted())


def launch_config(args: DecodeArgs, config: DecodeConfig | None = None) -> DecodeConfig:
    """The configuration a launch uses: ``config`` or the table's entry (:mod:`.configs`)."""
    return config or decode_config(
        args.q.device, compute_dtype(args.q), args.head_dim, args.page_size, args.head_dim_v
    )


def split_alignment(args: DecodeArgs, config: DecodeConfig) -> int:
    """Split chunks are whole pages (so each page is checked by one split), and whole tiles when
    one of page and tile divides the other."""
    page, tile = args.page_size, config.block_n
    return max(page, tile) if page % tile == 0 or tile % page == 0 else page


def plan_splits(
    args: DecodeArgs, config: DecodeConfig | None = None, num_splits: int | None = None
) -> tuple[int, int, int]:
    """``(num_splits, min_chunk, align)`` of a launch (:func:`kvattn.backends.grids.plan_num_splits`)."""
    config = launch_config(args, config)
    align = split_alignment(args, config)
    # Per sequence and split: one program per KV head and the report's (checked; counted in both
    # variants so that they split alike).
    splits, min_chunk = plan_num_splits(
        args,
        align,
        config.programs_per_sm,
        num_splits,
        programs_per_split=args.batch * (args.num_kv_heads + 1),
    )
    return splits, min_chunk, align


def decode(
    args: DecodeArgs,
    *,
    check: bool,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    num_splits: int | None = None,
    config: DecodeConfig | None = None,
) -> OwnershipReport | None:
    """Launch the decode kernel (and the merge when split). Writes ``out`` (and ``lse``).
    ``num_splits`` and ``config`` override the planner and the configuration table (tests, tuning
    sweeps); the grid still depends on shapes only."""
    q, k_cache, v_cache = args.q, args.k_cache, args.v_cache
    batch, num_heads, head_dim = q.shape
    group = num_heads // args.num_kv_heads
    config = launch_config(args, config)
    splits, min_chunk, align = plan_splits(args, config, num_splits)
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_dv = max(16, triton.next_power_of_2(args.head_dim_v))
    dot_fp32 = dots_in_fp32(q)
    verdict = args.verdict if check else None
    report = None
    if check:
        report = (
            verdict.report if verdict else OwnershipReport.allocate(batch, args.max_pages, q.device)
        )
    if splits > 1:
        part_acc = torch.empty(
            batch * num_heads * splits * block_dv, dtype=torch.float32, device=q.device
        )
        part_ml = torch.empty(batch * num_heads * splits * 2, dtype=torch.float32, device=q.device)
        part_report = torch.empty(
            batch * splits * REPORT_FIELDS, dtype=torch.int32, device=q.device
        )
    else:
        part_acc = part_ml = part_report = out  # unused
    # Unused pointer arguments (report when unchecked, lse when not asked) get `out`: never touched.
    r = report
    lse_arg = lse if lse is not None else out
    report_ptrs = dict(
        zip(
            REPORT_PTRS,
            (r.violations, r.reasons, r.pages_checked, r.beyond_table) if r else (out,) * 4,
        )
    )
    sw = args.variant
    # Switch tensors that are off get `out` as a never-read pointer.
    alibi, sinks, k_scale, v_scale, q_scale = (
        t if t is not None else out
        for t in (sw.alibi_slopes, sw.sinks, sw.k_scale, sw.v_scale, sw.q_scale)
    )
    switches = dict(WINDOW=sw.windowed, SINKS=sw.sinks is not None, FP8=sw.fp8, Q_FP8=sw.q_fp8)

    paged_decode_kernel[(batch, args.num_kv_heads + int(check), splits)](
        q_ptr=q,
        k_ptr=k_cache,
        v_ptr=v_cache,
        block_table_ptr=args.block_table,
        seq_lens_ptr=args.seq_lens,
        tags_ptr=args.page_tags,
        expected_ptr=args.expected,
        verdict_ptr=verdict.entries if verdict else out,
        out_ptr=out,
        lse_ptr=lse_arg,
        part_acc_ptr=part_acc,
        part_ml_ptr=part_ml,
        part_report_ptr=part_report,
        **report_ptrs,
        page_reasons_ptr=r.page_reasons if r else out,
        scale_log2=args.scale * LOG2E,
        num_pages=args.num_pages,
        max_pages=args.max_pages,
        num_splits=splits,
        min_chunk=min_chunk,
        window_left=sw.window_left,
        soft_cap=sw.logits_soft_cap,
        alibi_ptr=alibi,
        sinks_ptr=sinks,
        k_scale_ptr=k_scale,
        v_scale_ptr=v_scale,
        q_scale_ptr=q_scale,
        alibi_stride=sw.alibi_stride,
        scale_stride=sw.scale_stride,
        stride_qb=q.stride(0),
        stride_qh=q.stride(1),
        stride_kp=k_cache.stride(0),
        stride_ks=k_cache.stride(1),
        stride_kh=k_cache.stride(2),
        stride_vp=v_cache.stride(0),
        stride_vs=v_cache.stride(1),
        stride_vh=v_cache.stride(2),
        stride_bt=args.block_table.stride(0),
        stride_eb=args.expected.stride(0),
        stride_ep=args.expected.stride(1),
        stride_ob=out.stride(0),
        stride_oh=out.stride(1),
        NUM_HEADS=num_heads,
        GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        HEAD_DIM_V=args.head_dim_v,
        BLOCK_DV=block_dv,
        PAGE=args.page_size,
        BLOCK_N=config.block_n,
        ALIGN=align,
        BLOCK_P=128,
        CHECK=check,
        VERDICT=verdict is not None,
        DOT_FP32=dot_fp32,
        RETURN_LSE=lse is not None,
        OWNER_PER_PAGE=args.expected.stride(1) != 0,
        SOFTCAP=sw.logits_soft_cap > 0,
        ALIBI=sw.alibi_slopes is not None,
        **switches,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        maxnreg=config.max_registers,
    )
    # Through a verdict the report needs no sum of the splits: the resolve wrote it.
    sums = check and verdict is None
    if splits > 1:
        merge_splits_kernel[(batch, num_heads + int(sums))](
            part_acc_ptr=part_acc,
            part_ml_ptr=part_ml,
            part_report_ptr=part_report,
            seq_lens_ptr=args.seq_lens,
            out_ptr=out,
            lse_ptr=lse_arg,
            **report_ptrs,
            max_pages=args.max_pages,
            num_splits=splits,
            min_chunk=min_chunk,
            stride_ob=out.stride(0),
            stride_oh=out.stride(1),
            window_left=sw.window_left,
            sinks_ptr=sinks,
            alibi_ptr=alibi,
            alibi_stride=sw.alibi_stride,
            NUM_HEADS=num_heads,
            HEAD_DIM=args.head_dim_v,
            BLOCK_D=block_dv,
            PAGE=args.page_size,
            ALIGN=align,
            BLOCK_S=16,
            CHECK=sums,
            RETURN_LSE=lse is not None,
            WINDOW=sw.windowed,
            SINKS=sw.sinks is not None,
            ALIBI=sw.alibi_slopes is not None,
            num_warps=4,
        )
    return report
