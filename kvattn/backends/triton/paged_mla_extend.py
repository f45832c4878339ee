"""Triton paged MLA extend (multi-head latent attention over several query rows per sequence:
chunked prefill and speculative verify on DeepSeek V2/V3's latent cache, queries absorbed) with the
ownership check as a compile-time flag.

The extend kernel's schedule (:mod:`.paged_extend`) with the MLA decode kernel's load pattern
(:mod:`.paged_mla_decode`): the checked launch first runs the page pre-pass
(:func:`.paged_extend.resolve_pages`), which applies the reader's rule once per logical page and
writes the effective table; the attention kernel then loads one table entry per key in both
variants (:func:`.paged_extend.key_entries`). Each tile of latent rows is loaded once, as a latent
tile and a RoPE tile, and the latent tile feeds both products (``q_nope @ latent^T + q_pe @
rope^T``, then ``p @ latent``). Layout: :class:`kvattn.layout.MLAExtendArgs`; semantics:
:func:`kvattn.paged_mla_extend`; launch configurations: :mod:`.configs`.

Grid ``(query-tile slots, head chunks)``. A tile holds ``BLOCK_M`` rows: ``TOKENS`` query tokens
times ``HEADS`` query heads (row ``r`` is token ``r // HEADS``, head ``r % HEADS``), every head
reading the one latent head, so each latent tile serves all the tile's rows. Slots, their lookup
in ``cu_seqlens_q``, the longest-first order of a causal sequence's tiles and the keys a tile
reads (to its last query position; none for a malformed sequence) are the extend kernel's
(:func:`.paged_extend.query_tile`).

Unlike the extend kernel, one loop over key tiles with the causal mask applied per element on
every tile: split into the extend's two loops (unmasked tiles, then the diagonal), each loop got
its own latent buffers and Triton 3.6 single-buffered both (tools/static_sm90.py). With pages a
multiple of the tile, a tile's keys share one table entry, loaded once (``TILE_PAGE`` of
:func:`.paged_extend.key_entries`): per-key entries also cost a pipeline stage, and left one
latent buffer at three stages.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...layout import MLAExtendArgs
from ...report import OwnershipReport
from .configs import MLAExtendConfig, mla_extend_config
from .paged_decode import dots_in_fp32
from .paged_extend import key_entries, query_tile, resolve_pages, store_report
from .softmax import online_softmax_step, qk_scores
from .tag_rule import LOG2E, LOG2E_C


@triton.jit
def latent_tile_step(
    q_nope,
    q_pe,
    kv_ptr,
    bt_row,
    eff_row,
    t0,
    kv_hi,
    num_pages,
    stride_kvp,
    stride_kvs,
    offs_n,
    offs_l,
    offs_r,
    q_pos,
    scale_log2,
    m_i,
    l_i,
    acc,
    LORA: tl.constexpr,
    ROPE: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CHECK: tl.constexpr,
    DIAGONAL: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Fold latent rows ``t0 + offs_n`` (``t0 < kv_hi``) into the rows' running softmax: the rows
    that may be read (:func:`key_entries`), and, DIAGONAL (causal), only those at or before each
    query row's position ``q_pos`` [BLOCK_M]."""
    tok = t0 + offs_n  # [BLOCK_N]
    page, slot, live = key_entries(
        bt_row, eff_row, tok, 0, kv_hi, num_pages, PAGE, CHECK, False, PAGE % BLOCK_N == 0
    )
    rows = kv_ptr + page * stride_kvp + slot * stride_kvs  # [BLOCK_N]
    latent = tl.load(
        rows[:, None] + offs_l[None, :], mask=live[:, None] & (offs_l < LORA)[None, :], other=0.0
    )  # [BLOCK_N, BLOCK_L]
    s = qk_scores(q_nope, latent, DOT_FP32)  # [BLOCK_M, BLOCK_N]
    if ROPE > 0:
        rope = tl.load(
            rows[:, None] + LORA + offs_r[None, :],
            mask=live[:, None] & (offs_r < ROPE)[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_R]
        s += qk_scores(q_pe, rope, DOT_FP32)
    visible = live[None, :]
    if DIAGONAL:
        visible = visible & (tok[None, :] <= q_pos[:, None])
    s = tl.where(visible, s * scale_log2, float("-inf"))
    return online_softmax_step(s, latent, m_i, l_i, acc, DOT_FP32)


@triton.jit
def paged_mla_extend_kernel(
    q_ptr,
    kv_ptr,
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
    page_blocks,
    stride_qt,
    stride_qh,
    stride_kvp,
    stride_kvs,
    stride_bt,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEADS: tl.constexpr,
    TOKENS: tl.constexpr,
    LORA: tl.constexpr,
    BLOCK_L: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
    CAUSAL: tl.constexpr,
    CHECK: tl.constexpr,
    DOT_FP32: tl.constexpr,
    RETURN_LSE: tl.constexpr,
):
    # Slot-major launch order, every head chunk of a slot before the next slot (paged_extend).
    columns = tl.num_programs(1)
    launched = tl.program_id(0).to(tl.int64) + tl.program_id(1).to(tl.int64) * tl.num_programs(0)
    slot_id = (launched // columns).to(tl.int32)
    chunk = (launched % columns).to(tl.int32)

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

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    q_idx = m0 + offs_m // HEADS  # [BLOCK_M] query token of each row
    head = chunk * HEADS + offs_m % HEADS  # [BLOCK_M] query head of each row
    row_ok = (offs_m < TOKENS * HEADS) & (q_idx < q_len) & (head < NUM_HEADS)
    q_pos = first_pos + q_idx
    rows = (row0 + q_idx).to(tl.int64)
    q_rows = q_ptr + rows[:, None] * stride_qt + head[:, None] * stride_qh  # [BLOCK_M, 1]
    q_nope = tl.load(
        q_rows + offs_l[None, :], mask=row_ok[:, None] & (offs_l < LORA)[None, :], other=0.0
    )  # [BLOCK_M, BLOCK_L]
    q_pe = q_nope  # unused without a RoPE part
    if ROPE > 0:
        q_pe = tl.load(
            q_rows + LORA + offs_r[None, :],
            mask=row_ok[:, None] & (offs_r < ROPE)[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_R]

    bt_row = block_table_ptr + b * stride_bt
    eff_row = effective_ptr + b * max_pages
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_L], dtype=tl.float32)
    for t0 in range(0, kv_hi, BLOCK_N):
        m_i, l_i, acc = latent_tile_step(
            q_nope,
            q_pe,
            kv_ptr,
            bt_row,
            eff_row,
            t0,
            kv_hi,
            num_pages,
            stride_kvp,
            stride_kvs,
            offs_n,
            offs_l,
            offs_r,
            q_pos,
            scale_log2,
            m_i,
            l_i,
            acc,
            LORA,
            ROPE,
            PAGE,
            BLOCK_N,
            CHECK,
            CAUSAL,
            DOT_FP32,
        )

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_l[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & (offs_l < LORA)[None, :],
    )
    if RETURN_LSE:
        lse = tl.where(l_i > 0, (m_i + tl.log2(l_safe)) / LOG2E_C, float("-inf"))
        tl.store(lse_ptr + rows * NUM_HEADS + head, lse, mask=row_ok)
    if CHECK:
        if (local == 0) & (chunk == 0):
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


def launch_config(args: MLAExtendArgs, config: MLAExtendConfig | None = None) -> MLAExtendConfig:
    """The configuration a launch uses: ``config`` or the table's entry (:mod:`.configs`)."""
    return config or mla_extend_config(args.q.device, args.q.dtype, args.head_dim, args.page_size)


def row_layout(args: MLAExtendArgs, block_m: int) -> tuple[int, int, int]:
    """``(heads, tokens, head chunks)`` of a tile of ``block_m`` rows: the query heads first (in
    chunks of at most ``block_m``), the remaining rows for query tokens."""
    heads = min(args.num_heads, block_m)
    return heads, block_m // heads, -(-args.num_heads // heads)


def mla_extend(
    args: MLAExtendArgs,
    *,
    check: bool,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    config: MLAExtendConfig | None = None,
) -> OwnershipReport | None:
    """Launch the MLA extend (after the page pre-pass when checked). Writes ``out`` ``[total_q,
    num_heads, kv_lora_rank]`` (and ``lse``) for every row of every sequence. ``config``
    overrides the table (tests, tuning sweeps)."""
    q, kv = args.q, args.kv_cache
    config = launch_config(args, config)
    heads, tokens, chunks = row_layout(args, config.block_m)
    lora, rope = args.kv_lora_rank, args.rope_dim
    dot_fp32 = dots_in_fp32(q)
    # The grid from shapes only, as paged_extend's: ceil(total_q / tokens) + B slots.
    slots = triton.cdiv(args.total_q, tokens) + args.batch
    report, effective, part_report, page_blocks, report_ptrs = resolve_pages(args, check, out)
    paged_mla_extend_kernel[(slots, chunks)](
        q_ptr=q,
        kv_ptr=kv,
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
        page_blocks=page_blocks,
        stride_qt=q.stride(0),
        stride_qh=q.stride(1),
        stride_kvp=kv.stride(0),
        stride_kvs=kv.stride(1),
        stride_bt=args.block_table.stride(0),
        stride_ot=out.stride(0),
        stride_oh=out.stride(1),
        NUM_HEADS=args.num_heads,
        HEADS=heads,
        TOKENS=tokens,
        LORA=lora,
        BLOCK_L=max(16, triton.next_power_of_2(lora)),
        ROPE=rope,
        BLOCK_R=max(16, triton.next_power_of_2(rope)),
        PAGE=args.page_size,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_B=64,
        CAUSAL=args.causal,
        CHECK=check,
        DOT_FP32=dot_fp32,
        RETURN_LSE=lse is not None,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return report
