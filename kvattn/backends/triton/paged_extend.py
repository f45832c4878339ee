"""Triton paged extend (chunked prefill): tiles of new query rows against KV tiles gathered through
the block table, with the ownership check as a compile-time flag.

One kernel source; ``CHECK=False`` compiles the check out. Layout: :mod:`kvattn.layout`; semantics:
:func:`kvattn.paged_extend`; launch configurations: :mod:`.configs`.

The checked launch first runs :func:`resolve_pages_kernel`, one program per sequence and block of
``RESOLVE_PAGES`` pages, which applies the reader's rule (:mod:`.tag_rule`) once to every logical
page: it writes the page reasons, partial counts and an *effective table* whose entry packs the
physical page and the number of its slots that may be read (``page << 32 | readable``; 0 readable
for a refused page); the first attention program of each sequence sums the counts into the
report. The attention kernel loads one entry per token, as the unchecked variant loads one
block-table entry per token (keeping its page-id range guard), so both variants gather and
pipeline K/V the same way and the tag test never runs in the inner loop. A call is one launch
unchecked, two checked: no host-side tile map.

Grid ``(query-tile slots, num_kv_heads * head chunks)``. A tile holds ``BLOCK_M`` rows: ``TOKENS``
query tokens times the ``HEADS`` query heads of one chunk of a KV head's GQA group (row ``r`` is
token ``r // HEADS``, head ``r % HEADS``), so each K/V tile is gathered once for the whole group and
the tensor-core tiles are full even for one-token chunks. Sequence ``b`` gets
``max(1, ceil(q_len_b / TOKENS))`` consecutive slots; each program finds the sequence of its slot
from ``cu_seqlens_q`` itself (:func:`locate_tile`: a device-side scan, so neither the grid nor the
launch needs ``cu_seqlens_q`` on the host: ``ceil(total_q / TOKENS) + B`` slots depend on shapes
only, and spare slots do nothing). Programs take the slots in launch order with every head column
of a slot together, and a causal sequence's tiles longest first (its last query tile, which reads
the most keys, first). Causal tiles entirely above the diagonal are not visited: a query tile's KV
loop stops after its last query's position.

With a custom mask (``CUSTOM``, :mod:`kvattn.variants`), each KV tile loads the mask's entries of
its rows and keys ``[BLOCK_M, BLOCK_N]`` before K/V: a key no row of the tile reads is not loaded,
and the scores are masked per element.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from ...layout import ExtendArgs
from ...report import OwnershipReport
from .configs import ExtendConfig, extend_config
from .paged_decode import compute_dtype, dots_in_fp32
from .softmax import (
    alibi_anchor,
    heads_read,
    online_softmax_step,
    qk_scores,
    sink_denominator,
    variant_scores,
)
from .split_report import REPORT_FIELDS, REPORT_PTRS
from .tag_rule import LOG2E, LOG2E_C, V_OUT_OF_RANGE, bit_or, page_reason, readable_len

SLOT_BITS = tl.constexpr(32)
# Pages per pre-pass program: one pass of loads, the table of a sequence spread over programs.
RESOLVE_PAGES = 256
CUSTOM_MASK_BLOCK_N = 32  # key tiles under a custom mask (launch_config)


@triton.jit
def max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def query_rows(cu_seqlens_ptr, b, total_q, BLOCK_B: tl.constexpr):
    """``(first row, one past the last)`` of sequence ``b``: ``cu_seqlens_q`` clamped to
    ``[0, total_q]`` and made non-decreasing (kvattn.layout.query_offsets) up to entry ``b + 1``."""
    row0 = 0
    row1 = 0
    for c0 in range(0, b + 2, BLOCK_B):
        idx = c0 + tl.arange(0, BLOCK_B)
        cu = tl.load(cu_seqlens_ptr + idx, mask=idx <= b + 1, other=0)
        cu = tl.minimum(tl.maximum(cu, 0), total_q)
        row0 = tl.maximum(row0, tl.max(tl.where(idx <= b, cu, 0), axis=0))
        row1 = tl.maximum(row1, tl.max(cu, axis=0))
    return row0, row1


@triton.jit
def locate_tile(
    cu_seqlens_ptr, slot_id, batch, total_q, TOKENS: tl.constexpr, BLOCK_B: tl.constexpr
):
    """``(b, local tile, tiles of b, first row, query rows)`` of grid slot ``slot_id``: the tile map
    (kvattn.backends.grids.extend_tile_map) computed by each program from ``cu_seqlens_q``, clamped
    and made non-decreasing as kvattn.layout.query_offsets does. Sequence ``b`` has ``max(1,
    ceil(q_len / TOKENS))`` consecutive slots; slots past the last sequence's land on it with a
    local tile past its tiles."""
    carry_q = 0  # the offsets' running maximum before this chunk
    carry_t = 0  # tiles of the sequences before this chunk
    n_started = 0
    row0 = 0
    row1 = 0
    first = 0
    for c0 in range(0, batch, BLOCK_B):
        idx = c0 + tl.arange(0, BLOCK_B)
        m = idx < batch
        lo = tl.minimum(tl.maximum(tl.load(cu_seqlens_ptr + idx, mask=m, other=0), 0), total_q)
        hi = tl.minimum(tl.maximum(tl.load(cu_seqlens_ptr + idx + 1, mask=m, other=0), 0), total_q)
        lo = tl.maximum(tl.associative_scan(lo, 0, max_combine), carry_q)  # [BLOCK_B]
        hi = tl.maximum(hi, lo)
        tiles = tl.where(m, tl.maximum(tl.cdiv(hi - lo, TOKENS), 1), 0)
        starts = carry_t + tl.cumsum(tiles, 0) - tiles
        started = m & (starts <= slot_id)
        n_started += tl.sum(started.to(tl.int32), axis=0)
        # Offsets and tile starts grow with b: their largest among the started is b's.
        row0 = tl.maximum(row0, tl.max(tl.where(started, lo, 0), axis=0))
        row1 = tl.maximum(row1, tl.max(tl.where(started, hi, 0), axis=0))
        first = tl.maximum(first, tl.max(tl.where(started, starts, 0), axis=0))
        carry_q = tl.maximum(carry_q, tl.max(tl.where(m, hi, 0), axis=0))
        carry_t += tl.sum(tiles, axis=0)
    q_len = row1 - row0
    return n_started - 1, slot_id - first, tl.maximum(tl.cdiv(q_len, TOKENS), 1), row0, q_len


@triton.jit
def query_tile(
    cu_seqlens_ptr,
    seq_lens_ptr,
    slot_id,
    batch,
    total_q,
    max_pages,
    TOKENS: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_B: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    """The query tile of grid slot ``slot_id`` and the keys it reads: ``(b, local tile, first row,
    q_len, raw seq_len, first query position, first token of the tile, kv_hi)``. A causal
    sequence's tiles are taken longest first (its last query tile, which reads the most keys,
    from local tile 0). ``kv_hi``: one past the last key the tile reads; 0 for spare slots and,
    when causal, for a sequence holding fewer tokens than it has queries (malformed: it fails
    closed and reads nothing). Positions stay int32 (64-bit masks over a tile cost registers)."""
    b32, local, tiles, row0, q_len = locate_tile(
        cu_seqlens_ptr, slot_id, batch, total_q, TOKENS, BLOCK_B
    )
    b = b32.to(tl.int64)
    tile = local
    if CAUSAL:
        tile = tl.where(local < tiles, tiles - 1 - local, local)
    raw_len = tl.load(seq_lens_ptr + b)
    seq_len = tl.minimum(tl.maximum(raw_len, 0), max_pages * PAGE)
    first_pos = raw_len - q_len  # position of the sequence's first query token
    m0 = tile * TOKENS
    kv_hi = seq_len
    if CAUSAL:
        kv_hi = tl.minimum(kv_hi, first_pos + tl.minimum(m0 + TOKENS, q_len))
    if CAUSAL:
        kv_hi = tl.where((m0 < q_len) & (q_len <= raw_len), kv_hi, 0)
    else:
        kv_hi = tl.where(m0 < q_len, kv_hi, 0)  # more queries than keys: each reads them all
    return b, local, row0, q_len, raw_len, first_pos, m0, kv_hi


@triton.jit
def resolve_pages_kernel(
    block_table_ptr,
    seq_lens_ptr,
    cu_seqlens_ptr,
    tags_ptr,
    expected_ptr,
    effective_ptr,
    part_report_ptr,
    page_reasons_ptr,
    total_q,
    num_pages,
    max_pages,
    stride_bt,
    stride_eb,
    stride_ep,
    window_left,
    PAGE: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_B: tl.constexpr,
    WINDOW: tl.constexpr,
):
    """Pages ``[BLOCK_P * k, BLOCK_P * (k + 1))`` of sequence ``b`` (grid ``(B, k)``): each table
    entry's reason (0 when accepted or not read), the effective entry ``page << 32 | readable
    slots`` of every page it reads, and the block's counts (refused, OR of reasons, read), which
    the attention kernel sums into the report. With a sliding window, pages wholly before the first
    row's window are not read."""
    b = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    raw_len = tl.load(seq_lens_ptr + b)
    seq_len = tl.minimum(tl.maximum(raw_len, 0), max_pages * PAGE)
    first_key = 0
    if WINDOW:
        row0, row1 = query_rows(cu_seqlens_ptr, tl.program_id(0), total_q, BLOCK_B)
        first_key = tl.maximum(raw_len.to(tl.int64) - (row1 - row0) - window_left, 0)
    logical = block * BLOCK_P + tl.arange(0, BLOCK_P)  # [BLOCK_P]
    in_table = logical < max_pages
    slots_read = tl.minimum(tl.maximum(seq_len - logical * PAGE, 0), PAGE)
    read = in_table & (slots_read > 0) & ((logical + 1) * PAGE > first_key)
    page = tl.load(block_table_ptr + b * stride_bt + logical, mask=read, other=0)
    in_range = (page >= 0) & (page < num_pages)
    tag = tl.load(tags_ptr + page, mask=read & in_range, other=0)
    owner = tl.load(expected_ptr + b * stride_eb + logical * stride_ep, mask=read, other=0)
    reason = tl.where(read, page_reason(tag, in_range, owner, slots_read), 0)
    readable = tl.where(read & in_range, readable_len(tag, owner), 0)
    effective = (tl.where(in_range, page, 0).to(tl.int64) << SLOT_BITS) | readable.to(tl.int64)
    tl.store(effective_ptr + b * max_pages + logical, effective, mask=in_table)
    tl.store(page_reasons_ptr + b * max_pages + logical, reason.to(tl.int8), mask=in_table)
    part = part_report_ptr + (b * tl.num_programs(1) + block) * REPORT_FIELDS
    tl.store(part, tl.sum((reason != 0).to(tl.int32), axis=0))
    tl.store(part + 1, tl.reduce(reason, 0, bit_or))
    tl.store(part + 2, tl.sum(read.to(tl.int32), axis=0))


@triton.jit
def store_report(
    part_report_ptr,
    violations_ptr,
    reasons_ptr,
    checked_ptr,
    beyond_ptr,
    b,
    blocks,
    raw_len,
    capacity,
    BLOCK_K: tl.constexpr,
):
    """Sequence ``b``'s counters from the pre-pass's ``blocks`` partial counts; a seq_len past the
    table counts once more (nothing beyond it is read)."""
    bad = tl.zeros([BLOCK_K], dtype=tl.int32)
    read = tl.zeros([BLOCK_K], dtype=tl.int32)
    bits = tl.zeros([BLOCK_K], dtype=tl.int32)
    for k0 in range(0, blocks, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        part = part_report_ptr + (b * blocks + k) * REPORT_FIELDS
        bad += tl.load(part, mask=k < blocks, other=0)
        bits = bits | tl.load(part + 1, mask=k < blocks, other=0)
        read += tl.load(part + 2, mask=k < blocks, other=0)
    beyond = (raw_len > capacity).to(tl.int32)
    tl.store(beyond_ptr + b, beyond)
    tl.store(violations_ptr + b, tl.sum(bad, axis=0) + beyond)
    tl.store(reasons_ptr + b, tl.reduce(bits, 0, bit_or) | tl.where(beyond != 0, V_OUT_OF_RANGE, 0))
    tl.store(checked_ptr + b, tl.sum(read, axis=0))


@triton.jit
def key_entries(
    bt_row,
    eff_row,
    tok,
    kv_lo,
    kv_hi,
    num_pages,
    PAGE: tl.constexpr,
    CHECK: tl.constexpr,
    WINDOW: tl.constexpr,
    TILE_PAGE: tl.constexpr = False,
):
    """``(page int64, slot, live)`` of keys ``tok`` [BLOCK_N]: live where below ``kv_hi`` (and,
    WINDOW, at or after ``kv_lo``), in the pool and (checked) among the page's readable slots. One
    table entry per key in both variants: the effective entry (checked) or the block-table entry
    with its range guard (unchecked); TILE_PAGE (the tile lies inside one page: ``PAGE`` a
    multiple of the tile, ``tok`` starting on a tile boundary) loads one entry for the tile, and
    ``page`` is a scalar."""
    logical = tok // PAGE
    slot = tok % PAGE
    live = tok < kv_hi
    if WINDOW:
        # Keys before every row's window are not loaded: masked by scores alone, whatever they
        # hold would still reach the other rows as 0 * NaN.
        live = live & (tok >= kv_lo)
    if TILE_PAGE:
        # The tile starts below kv_hi (the callers' loops), so its one entry is inside the table.
        logical = tl.min(logical, axis=0)
        if CHECK:
            entry = tl.load(eff_row + logical)
            page = entry >> SLOT_BITS
            live = live & (slot < (entry & 0xFFFFFFFF).to(tl.int32))
        else:
            page = tl.load(bt_row + logical).to(tl.int64)
            # A select: the interpreter refuses a vector mask combined with a scalar bool.
            live = tl.where((page >= 0) & (page < num_pages), live, False)
    else:
        if CHECK:
            entry = tl.load(eff_row + logical, mask=live, other=0)  # [BLOCK_N]
            page = entry >> SLOT_BITS
            live = live & (slot < (entry & 0xFFFFFFFF).to(tl.int32))
        else:
            page = tl.load(bt_row + logical, mask=live, other=0).to(tl.int64)  # [BLOCK_N]
            live = live & (page >= 0) & (page < num_pages)
    return page, slot, live


@triton.jit
def load_kv_tile(
    k_head,
    v_head,
    bt_row,
    eff_row,
    t0,
    kv_lo,
    kv_hi,
    num_pages,
    stride_kp,
    stride_ks,
    stride_vp,
    stride_vs,
    offs_n,
    offs_d,
    offs_dv,
    mask_ptr,
    mask_row,
    mask_numel,
    token_ok,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    PAGE: tl.constexpr,
    CHECK: tl.constexpr,
    WINDOW: tl.constexpr,
    CUSTOM: tl.constexpr,
    TOKENS: tl.constexpr,
    HEADS: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """K ``[BLOCK_N, BLOCK_D]`` and V ``[BLOCK_N, DV]`` (this program's slice of V's head dim) of
    keys ``t0 + offs_n``, the mask of those that may be read: below ``kv_hi`` (and, WINDOW, at or
    after ``kv_lo``), in the pool and (checked) among the page's readable slots, and (CUSTOM) the
    custom mask's entries of the tile's rows ``[BLOCK_M, BLOCK_N]``, loaded once per query token
    (``mask_row`` ``[TOKENS]``: where each token's entries start; ``token_ok``: the tokens of the
    sequence; past ``mask_numel`` entries read as False) and repeated for its ``HEADS`` rows. One
    table entry per key in both variants: the effective entry (checked) or the block-table entry.
    A key the custom mask removes from every row of the tile is not loaded."""
    tok = t0 + offs_n  # [BLOCK_N]
    page, slot, live = key_entries(
        bt_row, eff_row, tok, kv_lo, kv_hi, num_pages, PAGE, CHECK, WINDOW
    )
    allowed = live[None, :]
    if CUSTOM:
        idx = mask_row[:, None] + tok[None, :]  # [TOKENS, BLOCK_N] int64
        by_token = (
            tl.load(
                mask_ptr + idx, mask=token_ok[:, None] & live[None, :] & (idx < mask_numel), other=0
            )
            != 0
        )
        live = live & (tl.max(by_token.to(tl.int32), axis=0) > 0)
        # Row r is token r // HEADS (row_layout: TOKENS * HEADS == BLOCK_M under a custom mask).
        allowed = tl.reshape(
            tl.broadcast_to(by_token[:, None, :], (TOKENS, HEADS, tok.shape[0])),
            (BLOCK_M, tok.shape[0]),
        )
    k = tl.load(
        k_head + page[:, None] * stride_kp + slot[:, None] * stride_ks + offs_d[None, :],
        mask=live[:, None] & (offs_d < HEAD_DIM)[None, :],
        other=0.0,
    )  # [BLOCK_N, BLOCK_D]
    v = tl.load(
        v_head + page[:, None] * stride_vp + slot[:, None] * stride_vs + offs_dv[None, :],
        mask=live[:, None] & (offs_dv < HEAD_DIM_V)[None, :],
        other=0.0,
    )  # [BLOCK_N, DV]
    return k, v, live, allowed


@triton.jit
def tile_scores(
    q,
    k,
    live,
    allowed,
    tok,
    q_pos,
    anchor,
    qk_scale,
    soft_cap,
    alibi2,
    window_left,
    right_edge,
    DIAGONAL: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr,
    DOT_FP32: tl.constexpr,
    CUSTOM: tl.constexpr,
    RIGHT: tl.constexpr,
):
    """Base-2 logits [BLOCK_M, BLOCK_N] of one KV tile (keys ``tok``) for rows at ``q_pos`` (ALiBi
    measured from ``anchor`` [BLOCK_M], :func:`.softmax.alibi_anchor`), -inf
    where a key may not be read (``live``), the custom mask removes it from the row (``allowed``,
    CUSTOM), it lies after the row (DIAGONAL tiles), before its window or (RIGHT) after the
    window's right edge, ``right_edge`` [BLOCK_M]."""
    distance = 0.0
    if ALIBI:
        distance = (tok[None, :] - anchor[:, None]).to(tl.float32)  # [BLOCK_M, BLOCK_N]
        if not CAUSAL:
            distance = -tl.abs(distance)
    s = variant_scores(
        qk_scores(q, k, DOT_FP32), qk_scale, soft_cap, alibi2, distance, SOFTCAP, ALIBI
    )
    visible = live[None, :]
    if CUSTOM:
        visible = visible & allowed
    if DIAGONAL:
        visible = visible & (tok[None, :] <= q_pos[:, None])
    if WINDOW:
        visible = visible & (tok[None, :] >= q_pos[:, None] - window_left)
    if RIGHT:
        visible = visible & (tok[None, :] <= right_edge[:, None])
    return tl.where(visible, s, float("-inf"))


@triton.jit
def paged_extend_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cu_seqlens_ptr,
    block_table_ptr,
    effective_ptr,
    seq_lens_ptr,
    out_ptr,
    lse_ptr,
    part_report_ptr,
    violations_ptr,
    reasons_ptr,
    checked_ptr,
    beyond_ptr,
    scale_log2,
    batch,
    total_q,
    num_pages,
    max_pages,
    num_chunks,
    page_blocks,
    window_left,
    window_right,
    soft_cap,
    alibi_ptr,
    sinks_ptr,
    k_scale_ptr,
    v_scale_ptr,
    q_scale_ptr,
    alibi_stride,
    scale_stride,
    mask_ptr,
    mask_start_ptr,
    mask_numel,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEADS: tl.constexpr,
    TOKENS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
    D_SPLIT: tl.constexpr,
    CAUSAL: tl.constexpr,
    CHECK: tl.constexpr,
    DOT_FP32: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr,
    SINKS: tl.constexpr,
    FP8: tl.constexpr,
    CUSTOM: tl.constexpr,
    RIGHT: tl.constexpr,
    Q_FP8: tl.constexpr,
):
    # Programs launch in grid order, axis 0 fastest; read that order slot-major, every column (KV
    # head, head chunk, output part) of a slot before the next slot, so that a causal sequence's
    # longest tiles (below) start first on all heads.
    columns = tl.num_programs(1)
    launched = tl.program_id(0).to(tl.int64) + tl.program_id(1).to(tl.int64) * tl.num_programs(0)
    slot_id = (launched // columns).to(tl.int32)
    column = (launched % columns).to(tl.int32)
    # The column: KV head, head chunk and, for the widest heads, which part of the output dims
    # this program accumulates (D_SPLIT programs share a tile: each computes the full QK^T,
    # registers hold only its DV = BLOCK_DV / D_SPLIT output columns; V's head dim is the output's).
    d_part = column % D_SPLIT
    kv_head = column // D_SPLIT // num_chunks
    chunk = column // D_SPLIT % num_chunks

    b, local, row0, q_len, raw_len, first_pos, m0, kv_hi = query_tile(
        cu_seqlens_ptr,
        seq_lens_ptr,
        slot_id,
        batch,
        total_q,
        max_pages,
        TOKENS,
        PAGE,
        BLOCK_B,
        CAUSAL,
    )
    if RIGHT:
        # Keys after every row's right edge are not loaded: the tile stops after its last row's
        # (in 64 bits: the edge may lie past the int32 range).
        last_edge = (first_pos + tl.minimum(m0 + TOKENS, q_len) - 1).to(tl.int64) + window_right
        kv_hi = tl.maximum(tl.minimum(kv_hi.to(tl.int64), last_edge + 1), 0).to(tl.int32)

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    DV: tl.constexpr = BLOCK_DV // D_SPLIT
    offs_dv = d_part * DV + tl.arange(0, DV)
    d_mask = offs_d < HEAD_DIM
    # Rows past the sequence's queries or the group read q = 0 and are never stored.
    q_idx = m0 + offs_m // HEADS  # [BLOCK_M] query token of each row
    head = kv_head * GROUP + chunk * HEADS + offs_m % HEADS  # [BLOCK_M] query head of each row
    row_ok = (offs_m < TOKENS * HEADS) & (q_idx < q_len) & (chunk * HEADS + offs_m % HEADS < GROUP)
    q_pos = first_pos + q_idx
    anchor = alibi_anchor(q_pos, max_pages * PAGE)
    right_edge = q_pos  # unused unless RIGHT
    if RIGHT:
        right_edge = tl.minimum(q_pos.to(tl.int64) + window_right, 2**31 - 1).to(tl.int32)
    rows = (row0 + q_idx).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    if Q_FP8:
        q = q.to(tl.bfloat16)  # exact: every e4m3 and e5m2 value is a bfloat16

    mask_row = rows  # unused unless CUSTOM
    token_ok = row_ok
    if CUSTOM:
        # Row j of the sequence's [q_len, seq_len] block of the custom mask (kvattn.variants), for
        # each query token of the tile.
        width = tl.maximum(raw_len, 0).to(tl.int64)
        token = m0 + tl.arange(0, TOKENS)  # [TOKENS]
        token_ok = token < q_len
        mask_row = tl.load(mask_start_ptr + b) + token.to(tl.int64) * width

    bt_row = block_table_ptr + b * stride_bt
    eff_row = effective_ptr + b * max_pages
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
    alibi2 = tl.zeros([BLOCK_M], dtype=tl.float32)
    if ALIBI:
        alibi2 = tl.load(alibi_ptr + head, mask=row_ok, other=0.0) * LOG2E_C
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DV], dtype=tl.float32)
    # Key tiles wholly at or before the tile's first query position need no causal mask: only the
    # per-key mask (length, range guard, ownership). The rest get the causal mask per element.
    diagonal = kv_hi
    if CAUSAL:
        # At least 0: with a length near the int32 limits first_pos + m0 + 1 wraps negative, and a
        # negative start would walk keys below 0 (they pass tok < kv_hi).
        diagonal = tl.maximum(tl.minimum(kv_hi, (first_pos + m0 + 1) // BLOCK_N * BLOCK_N), 0)
    first_key = 0  # the first key any row of the tile reads: its first row's window start
    kv_lo = 0
    if WINDOW:
        # Tiles wholly before the window of the tile's first row are skipped; the window mask
        # applies per element on the others.
        first_key = tl.maximum(first_pos + m0 - window_left, 0)
        kv_lo = first_key // BLOCK_N * BLOCK_N
        diagonal = tl.maximum(diagonal, kv_lo)
    for t0 in range(kv_lo, diagonal, BLOCK_N):
        k, v, live, allowed = load_kv_tile(
            k_head,
            v_head,
            bt_row,
            eff_row,
            t0,
            first_key,
            kv_hi,
            num_pages,
            stride_kp,
            stride_ks,
            stride_vp,
            stride_vs,
            offs_n,
            offs_d,
            offs_dv,
            mask_ptr,
            mask_row,
            mask_numel,
            token_ok,
            HEAD_DIM,
            HEAD_DIM_V,
            PAGE,
            CHECK,
            WINDOW,
            CUSTOM,
            TOKENS,
            HEADS,
            BLOCK_M,
        )
        if FP8:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        s = tile_scores(
            q,
            k,
            live,
            allowed,
            t0 + offs_n,
            q_pos,
            anchor,
            qk_scale,
            soft_cap,
            alibi2,
            window_left,
            right_edge,
            False,
            CAUSAL,
            WINDOW,
            SOFTCAP,
            ALIBI,
            DOT_FP32,
            CUSTOM,
            RIGHT,
        )  # [BLOCK_M, BLOCK_N]
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, DOT_FP32)
    for t0 in range(diagonal, kv_hi, BLOCK_N):
        k, v, live, allowed = load_kv_tile(
            k_head,
            v_head,
            bt_row,
            eff_row,
            t0,
            first_key,
            kv_hi,
            num_pages,
            stride_kp,
            stride_ks,
            stride_vp,
            stride_vs,
            offs_n,
            offs_d,
            offs_dv,
            mask_ptr,
            mask_row,
            mask_numel,
            token_ok,
            HEAD_DIM,
            HEAD_DIM_V,
            PAGE,
            CHECK,
            WINDOW,
            CUSTOM,
            TOKENS,
            HEADS,
            BLOCK_M,
        )
        if FP8:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        s = tile_scores(
            q,
            k,
            live,
            allowed,
            t0 + offs_n,
            q_pos,
            anchor,
            qk_scale,
            soft_cap,
            alibi2,
            window_left,
            right_edge,
            CAUSAL,
            CAUSAL,
            WINDOW,
            SOFTCAP,
            ALIBI,
            DOT_FP32,
            CUSTOM,
            RIGHT,
        )  # [BLOCK_M, BLOCK_N]
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, DOT_FP32)

    shift2 = tl.zeros([BLOCK_M], dtype=tl.float32)
    if ALIBI:
        shift2 = alibi2 * (anchor - q_pos).to(tl.float32)  # 0 inside the table
    sink2 = tl.zeros([BLOCK_M], dtype=tl.float32)
    if SINKS:
        sink2 = tl.load(sinks_ptr + head, mask=row_ok, other=0.0) * LOG2E_C
    if FP8:
        acc = acc * tl.load(v_scale_ptr + kv_head)
    if SINKS or ALIBI or FP8:
        # A head whose switch values are invalid (kvattn.variants) reads nothing: its rows end as
        # rows with nothing read.
        reads = heads_read(
            head,
            row_ok,
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
        l_i = tl.where(reads, l_i, 0.0)
    out = acc / sink_denominator(l_i, m_i, sink2 - shift2, SINKS)[:, None]
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    tl.store(
        out_ptr + rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_dv[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & (offs_dv < HEAD_DIM_V)[None, :],
    )
    if RETURN_LSE:
        lse = tl.where(l_i > 0, (m_i + tl.log2(l_safe) + shift2) / LOG2E_C, float("-inf"))
        # One program of a d_split group writes the LSE (a vector test: the interpreter refuses a
        # vector mask combined with a scalar bool).
        tl.store(lse_ptr + rows * NUM_HEADS + head, lse, mask=row_ok & ((offs_m * 0 + d_part) == 0))
    if CHECK:
        if (local == 0) & (column == 0):
            # The first program of each sequence (every sequence has a tile) writes its counters.
            store_report(
                part_report_ptr,
                violations_ptr,
                reasons_ptr,
                checked_ptr,
                beyond_ptr,
                b,
                page_blocks,
                raw_len,
                max_pages * PAGE,
                16,
            )


def launch_config(args: ExtendArgs, config: ExtendConfig | None = None) -> ExtendConfig:
    """The configuration a launch uses: ``config`` or the table's entry (:mod:`.configs`)."""
    if config is not None:
        return config
    # Keyed by the wider head: the query and K tiles, or V's accumulator, bound the registers.
    config = extend_config(
        args.q.device, compute_dtype(args.q), max(args.head_dim, args.head_dim_v), args.page_size
    )
    if args.variant.custom_mask is not None:
        # The mask's [BLOCK_M, BLOCK_N] entries beside the scores: 64-key tiles spill at d128
        # (tools/static_sm90.py), 32-key tiles do not.
        config = replace(config, block_n=min(config.block_n, CUSTOM_MASK_BLOCK_N))
    return config


def row_layout(args: ExtendArgs, block_m: int) -> tuple[int, int, int]:
    """``(heads, tokens, head chunks)`` of a tile of ``block_m`` rows: the GQA group's heads first
    (in chunks of at most ``block_m``), the remaining rows for query tokens. Under a custom mask
    the heads are a power of two (a group of 3 takes 4 rows per token, one idle), so the tile is
    ``tokens x heads`` exactly and a token's mask entries repeat over its rows by a reshape."""
    group = args.num_heads // args.num_kv_heads
    heads = min(group, block_m)
    if args.variant.custom_mask is not None:
        heads = triton.next_power_of_2(heads)
    return heads, block_m // heads, -(-group // heads)


def resolve_pages(args, check: bool, out: torch.Tensor, window_left: int = -1):
    """The checked launch's pre-pass (:func:`resolve_pages_kernel`) for extend-shaped ``args``
    (ragged rows over a block table: :class:`kvattn.layout.ExtendArgs` or
    :class:`~kvattn.layout.MLAExtendArgs`). Returns ``(report, effective table, partial counts,
    page blocks, report pointers)``; unchecked, nothing is launched and the pointers the kernel
    never reads are ``out`` and the block table."""
    page_blocks = triton.cdiv(args.max_pages, RESOLVE_PAGES)
    if not check:
        return (
            None,
            args.block_table,
            args.block_table,
            page_blocks,
            dict.fromkeys(REPORT_PTRS, out),
        )
    device = args.q.device
    report = OwnershipReport.allocate(args.batch, args.max_pages, device)
    counts = (report.violations, report.reasons, report.pages_checked, report.beyond_table)
    effective = torch.empty(args.batch, args.max_pages, dtype=torch.int64, device=device)
    part_report = torch.empty(
        args.batch * page_blocks * REPORT_FIELDS, dtype=torch.int32, device=device
    )
    resolve_pages_kernel[(args.batch, page_blocks)](
        block_table_ptr=args.block_table,
        seq_lens_ptr=args.seq_lens,
        cu_seqlens_ptr=args.cu_seqlens_q,
        tags_ptr=args.page_tags,
        expected_ptr=args.expected,
        effective_ptr=effective,
        part_report_ptr=part_report,
        page_reasons_ptr=report.page_reasons,
        total_q=args.total_q,
        num_pages=args.num_pages,
        max_pages=args.max_pages,
        stride_bt=args.block_table.stride(0),
        stride_eb=args.expected.stride(0),
        stride_ep=args.expected.stride(1),
        window_left=window_left,
        PAGE=args.page_size,
        BLOCK_P=RESOLVE_PAGES,
        BLOCK_B=128,
        WINDOW=window_left >= 0,
        num_warps=4,
    )
    return report, effective, part_report, page_blocks, dict(zip(REPORT_PTRS, counts))


def extend(
    args: ExtendArgs,
    *,
    check: bool,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    block_m: int | None = None,
    block_n: int | None = None,
    config: ExtendConfig | None = None,
) -> OwnershipReport | None:
    """Launch the extend (after the page pre-pass when checked). Writes ``out`` (and ``lse``) for
    every row of every sequence. ``config`` overrides the table; ``block_m``/``block_n`` override
    its tile sizes (powers of two >= 16), for tests."""
    q, k_cache, v_cache = args.q, args.k_cache, args.v_cache
    config = launch_config(args, config)
    block_m = block_m or config.block_m
    block_n = block_n or config.block_n
    block_d = max(16, triton.next_power_of_2(args.head_dim))
    block_dv = max(16, triton.next_power_of_2(args.head_dim_v))
    # Each part of a split output keeps at least 16 columns (a tensor-core tile's N).
    d_split = min(config.d_split, block_dv // 16)
    heads, tokens, chunks = row_layout(args, block_m)
    dot_fp32 = dots_in_fp32(q)
    # The grid from shapes only: every sequence has at least one tile, so ceil(total_q / tokens) + B
    # slots cover the tiles; each program finds its own in cu_seqlens_q (spare slots do nothing).
    slots = triton.cdiv(args.total_q, tokens) + args.batch
    sw = args.variant
    report, effective, part_report, page_blocks, report_ptrs = resolve_pages(
        args, check, out, sw.window_left
    )
    # Switch tensors that are off get `out` as a never-read pointer.
    alibi, sinks, k_scale, v_scale, q_scale, mask_start = (
        t if t is not None else out
        for t in (sw.alibi_slopes, sw.sinks, sw.k_scale, sw.v_scale, sw.q_scale, sw.mask_start)
    )
    custom = sw.custom_mask is not None
    # A bool tensor as bytes: one load per entry; an empty mask (every entry past its end) is
    # never dereferenced.
    mask = sw.custom_mask.view(torch.uint8) if custom and sw.custom_mask.numel() else out
    paged_extend_kernel[(slots, args.num_kv_heads * chunks * d_split)](
        q_ptr=q,
        k_ptr=k_cache,
        v_ptr=v_cache,
        cu_seqlens_ptr=args.cu_seqlens_q,
        block_table_ptr=args.block_table,
        effective_ptr=effective,
        seq_lens_ptr=args.seq_lens,
        out_ptr=out,
        lse_ptr=lse if lse is not None else out,
        part_report_ptr=part_report,
        **report_ptrs,
        scale_log2=args.scale * LOG2E,
        batch=args.batch,
        total_q=args.total_q,
        num_pages=args.num_pages,
        max_pages=args.max_pages,
        num_chunks=chunks,
        page_blocks=page_blocks,
        window_left=sw.window_left,
        window_right=sw.window_right,
        soft_cap=sw.logits_soft_cap,
        alibi_ptr=alibi,
        sinks_ptr=sinks,
        k_scale_ptr=k_scale,
        v_scale_ptr=v_scale,
        q_scale_ptr=q_scale,
        alibi_stride=sw.alibi_stride,
        scale_stride=sw.scale_stride,
        mask_ptr=mask,
        mask_start_ptr=mask_start,
        mask_numel=sw.custom_mask.numel() if custom else 0,
        stride_qt=q.stride(0),
        stride_qh=q.stride(1),
        stride_kp=k_cache.stride(0),
        stride_ks=k_cache.stride(1),
        stride_kh=k_cache.stride(2),
        stride_vp=v_cache.stride(0),
        stride_vs=v_cache.stride(1),
        stride_vh=v_cache.stride(2),
        stride_bt=args.block_table.stride(0),
        stride_ot=out.stride(0),
        stride_oh=out.stride(1),
        NUM_HEADS=args.num_heads,
        GROUP=args.num_heads // args.num_kv_heads,
        HEADS=heads,
        TOKENS=tokens,
        HEAD_DIM=args.head_dim,
        BLOCK_D=block_d,
        HEAD_DIM_V=args.head_dim_v,
        BLOCK_DV=block_dv,
        PAGE=args.page_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_B=64,
        D_SPLIT=d_split,
        CAUSAL=args.causal,
        CHECK=check,
        DOT_FP32=dot_fp32,
        RETURN_LSE=lse is not None,
        WINDOW=sw.windowed,
        SOFTCAP=sw.logits_soft_cap > 0,
        ALIBI=sw.alibi_slopes is not None,
        SINKS=sw.sinks is not None,
        FP8=sw.fp8,
        CUSTOM=custom,
        RIGHT=sw.right_windowed,
        Q_FP8=sw.q_fp8,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return report
