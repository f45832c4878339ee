"""Triton paged extend (chunked prefill): tiles of new query tokens against KV tiles gathered through
the block table, with the ownership check as a compile-time flag.

One kernel source; ``CHECK=False`` compiles the check out. Layout: :mod:`kvattn.layout`; semantics:
:func:`kvattn.paged_extend`. The reader's rule and the tag constants come from
:mod:`.tag_rule`, so both kernels apply the same test to a page.

Grid ``(query-tile slots, num_heads)``. Sequence ``b`` gets ``max(1, ceil(q_len_b / BLOCK_M))``
consecutive slots; slot ``t`` of the grid finds its sequence by counting the per-sequence tile
starts at or below ``t`` (a device-side prefix sum, so neither the grid nor the launch needs
``cu_seqlens_q`` on the host: the grid size ``ceil(total_q / BLOCK_M) + B`` depends on shapes only
and spare slots do nothing). One program serves one query head, reading its KV head's pages; under
GQA the other heads of the group re-read the same pages from L2.

Causal tiles entirely above the diagonal are not visited: a query tile's KV loop stops after the
last query's position. The report is written by the program of query tile 0 and head 0 of each
sequence alone (every sequence has a tile 0, even one with no query token), which runs the page
loop of the decode kernel once over the whole table, so each logical page counts once per sequence
however many query tiles read it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...layout import ExtendArgs
from ...report import OwnershipReport
from ..grids import extend_tile_map
from .paged_decode import interpreted
from .softmax import online_softmax_step, qk_scores
from .tag_rule import LOG2E, LOG2E_C, V_OUT_OF_RANGE, check_pages, readable_len


@triton.jit
def paged_extend_kernel(
    q_ptr, k_ptr, v_ptr, q_start_ptr, tile_start_ptr, block_table_ptr, seq_lens_ptr, tags_ptr,
    expected_ptr, out_ptr, lse_ptr,
    violations_ptr, reasons_ptr, checked_ptr, beyond_ptr, page_reasons_ptr,
    scale_log2, batch, num_pages, max_pages,
    stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_bt, stride_eb, stride_ep, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
    BLOCK_P: tl.constexpr, CAUSAL: tl.constexpr, CHECK: tl.constexpr, DOT_FP32: tl.constexpr,
    RETURN_LSE: tl.constexpr,
):
    slot_id = tl.program_id(0)
    head = tl.program_id(1)

    # The sequence of this tile slot: how many sequences' tiles all start at or below it, minus one.
    # Spare slots past the last tile land on the last sequence with a tile index past its rows.
    n_started = tl.zeros([BLOCK_B], dtype=tl.int32)
    for c0 in range(0, batch, BLOCK_B):
        idx = c0 + tl.arange(0, BLOCK_B)
        first_tile = tl.load(tile_start_ptr + idx, mask=idx < batch, other=2147483647)
        n_started += (first_tile <= slot_id).to(tl.int32)
    b = (tl.sum(n_started, axis=0) - 1).to(tl.int64)
    tile = slot_id - tl.load(tile_start_ptr + b)

    row0 = tl.load(q_start_ptr + b)
    # Positions stay int32 (64-bit masks over a tile cost registers); addresses are int64.
    q_len = tl.load(q_start_ptr + b + 1) - row0
    raw_len = tl.load(seq_lens_ptr + b)
    seq_len = tl.minimum(tl.maximum(raw_len, 0), max_pages * PAGE)
    first_pos = raw_len - q_len  # position of the sequence's first query token
    m0 = tile * BLOCK_M
    # One past the last key this tile reads; 0 for spare slots and for a sequence holding fewer
    # tokens than it has queries (malformed: it fails closed and reads nothing).
    kv_hi = seq_len
    if CAUSAL:
        kv_hi = tl.minimum(kv_hi, first_pos + tl.minimum(m0 + BLOCK_M, q_len))
    kv_hi = tl.where((m0 < q_len) & (q_len <= raw_len), kv_hi, 0)

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q_idx = m0 + offs_m  # [BLOCK_M]
    row_ok = q_idx < q_len
    q_pos = first_pos + q_idx
    rows = (row0 + q_idx).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]

    bt_row = block_table_ptr + b * stride_bt
    exp_row = expected_ptr + b * stride_eb
    kv_head = (head // GROUP).to(tl.int64)
    k_head = k_ptr + kv_head * stride_kh
    v_head = v_ptr + kv_head * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for t0 in range(0, kv_hi, BLOCK_N):
        tok = t0 + offs_n  # [BLOCK_N]
        logical = tok // PAGE
        slot = tok % PAGE
        live = tok < kv_hi
        page = tl.load(bt_row + logical, mask=live, other=0)  # [BLOCK_N]
        if CHECK:
            # Tag and expected owner load beside the block table; a failed page is never loaded.
            in_range = (page >= 0) & (page < num_pages)
            tag = tl.load(tags_ptr + page, mask=live & in_range, other=0)
            exp_owner = tl.load(exp_row + logical * stride_ep, mask=live, other=0)
            live = live & in_range & (slot < readable_len(tag, exp_owner))
        page = page.to(tl.int64)
        kv_mask = live[:, None] & d_mask[None, :]
        k = tl.load(k_head + page[:, None] * stride_kp + slot[:, None] * stride_ks + offs_d[None, :],
                    mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_head + page[:, None] * stride_vp + slot[:, None] * stride_vs + offs_d[None, :],
                    mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        s = qk_scores(q, k, DOT_FP32)  # [BLOCK_M, BLOCK_N]
        visible = live[None, :] & row_ok[:, None]
        if CAUSAL:
            visible = visible & (tok[None, :] <= q_pos[:, None])
        s = tl.where(visible, s * scale_log2, float("-inf"))
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, DOT_FP32)

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_mask[None, :])
    if RETURN_LSE:
        lse = tl.where(l_i > 0, (m_i + tl.log2(l_safe)) / LOG2E_C, float("-inf"))
        tl.store(lse_ptr + rows * NUM_HEADS + head, lse, mask=row_ok)

    if CHECK:
        if head == 0:
            if tile == 0:
                n_bad, reasons, n_read = check_pages(bt_row, exp_row, stride_ep, tags_ptr,
                                                     page_reasons_ptr + b * max_pages, num_pages,
                                                     seq_len, 0, max_pages, PAGE, BLOCK_P)
                # A seq_len past the table: nothing beyond it is read, and it counts once.
                beyond = (raw_len > max_pages * PAGE).to(tl.int32)
                reasons = reasons | tl.where(beyond != 0, V_OUT_OF_RANGE, 0)
                tl.store(beyond_ptr + b, beyond)
                tl.store(violations_ptr + b, n_bad + beyond)
                tl.store(reasons_ptr + b, reasons)
                tl.store(checked_ptr + b, n_read)


def tile_sizes(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_D, BLOCK_M, BLOCK_N, num_warps). tl.dot needs every dimension >= 16. Chosen from
    sm_90 compiles (registers and spills from cuobjdump, not timings): 16-bit tiles of 64 x 64 with
    8 warps for heads of 128 and more stay unspilled with the check; a 256-wide head halves the KV
    tile. The float32 path (exact "ieee" dots) holds far more per thread and gets 32 x 32 tiles."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    if dtype == torch.float32:
        return block_d, 32, 32, 4
    return block_d, 64, 64 if block_d <= 128 else 32, 8 if block_d >= 128 else 4


def extend(args: ExtendArgs, *, check: bool, out: torch.Tensor, lse: torch.Tensor | None,
           block_m: int | None = None, block_n: int | None = None) -> OwnershipReport | None:
    """Launch the extend kernel. Writes ``out`` (and ``lse``) for every row of every sequence.
    ``block_m``/``block_n`` override the tile sizes (powers of two >= 16), for tests."""
    q, k_cache, v_cache = args.q, args.k_cache, args.v_cache
    block_d, default_m, default_n, num_warps = tile_sizes(args.head_dim, q.dtype)
    block_m = block_m or default_m
    block_n = block_n or default_n
    dot_fp32 = q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and interpreted())
    q_start, tile_start, slots = extend_tile_map(args, block_m)
    report = OwnershipReport.allocate(args.batch, args.max_pages, q.device) if check else None
    # Unused pointer arguments (report when unchecked, lse when not asked) get `out`: never touched.
    return_lse = lse is not None

    paged_extend_kernel[(slots, args.num_heads)](
        q, k_cache, v_cache, q_start, tile_start, args.block_table, args.seq_lens, args.page_tags,
        args.expected, out, lse if return_lse else out,
        report.violations if check else out, report.reasons if check else out,
        report.pages_checked if check else out, report.beyond_table if check else out,
        report.page_reasons if check else out,
        args.scale * LOG2E, args.batch, args.num_pages, args.max_pages,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        args.block_table.stride(0), args.expected.stride(0), args.expected.stride(1),
        out.stride(0), out.stride(1),
        NUM_HEADS=args.num_heads, GROUP=args.num_heads // args.num_kv_heads, HEAD_DIM=args.head_dim,
        BLOCK_D=block_d, PAGE=args.page_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_B=64,
        BLOCK_P=64, CAUSAL=args.causal, CHECK=check, DOT_FP32=dot_fp32, RETURN_LSE=return_lse,
        num_warps=num_warps,
    )
    return report
