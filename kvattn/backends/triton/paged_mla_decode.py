"""Triton paged MLA decode (multi-head latent attention, DeepSeek V2/V3 style, queries absorbed into
the latent space) with the ownership check as a compile-time flag.

One latent row per token (``kv_lora_rank + rope_dim`` dims, 512 + 64 in DeepSeek V2/V3) is the key
and, in its first ``kv_lora_rank`` dims, the value: each tile of rows is loaded once, as a latent
tile and a RoPE tile, and the latent tile feeds both products (``q_nope @ latent^T + q_pe @
rope^T``, then ``p @ latent``). A separate source from :mod:`.paged_decode` because of that load
pattern; the rest is shared with it: the reader's rule (:mod:`.tag_rule`), the split ranges and
the merge of split partials (:mod:`.paged_decode`), the post-loop report (:mod:`.split_report`),
the split planner (:mod:`kvattn.backends.grids`), the softmax step (:mod:`.softmax`). Layout:
:class:`kvattn.layout.MLADecodeArgs`; launch configurations: :mod:`.configs`.

One kernel source; ``CHECK=False`` compiles the check out. Both variants keep the page-id range
guard, so the latent loads depend on the block table in the same way and pipeline alike.

Grid ``(head_blocks, B, num_splits)``: a program serves ``BLOCK_H`` query heads (the M dimension of
its dots, so they run on tensor cores) of one sequence over one split of its actual length
(:func:`kvattn.backends.grids.split_chunk`), so every logical page is read and checked by exactly
one program per head block. Head blocks vary fastest: the programs reading the same pages run
together, and all but the first find the rows in L2. The ``head_block == 0`` programs write the
report, after the loop, from the table entries and tags (now in L2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...layout import MLADecodeArgs
from ...report import OwnershipReport
from ...variants import PLAIN, Variant
from ..grids import plan_num_splits
from .configs import MLADecodeConfig, mla_decode_config
from .paged_decode import dots_in_fp32, merge_splits_kernel, split_alignment, split_range
from .softmax import online_softmax_step, qk_scores
from .split_report import REPORT_FIELDS, REPORT_PTRS, store_split_report
from .tag_rule import LOG2E, LOG2E_C, tile_slots

MAX_KV_LORA_RANK = 512
MAX_ROPE_DIM = 64


@triton.jit
def paged_mla_decode_kernel(
    q_ptr,
    kv_ptr,
    block_table_ptr,
    seq_lens_ptr,
    tags_ptr,
    expected_ptr,
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
    stride_qb,
    stride_qh,
    stride_kvp,
    stride_kvs,
    stride_bt,
    stride_eb,
    stride_ep,
    stride_ob,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    LORA: tl.constexpr,
    BLOCK_L: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ALIGN: tl.constexpr,
    BLOCK_P: tl.constexpr,
    CHECK: tl.constexpr,
    DOT_FP32: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    OWNER_PER_PAGE: tl.constexpr,
):
    head_block = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)

    raw_len = tl.load(seq_lens_ptr + b)
    seq_len = tl.minimum(tl.maximum(raw_len, 0), max_pages * PAGE)
    start, end, _ = split_range(seq_len, split, num_splits, min_chunk, ALIGN)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    h_mask = heads < NUM_HEADS
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = tl.arange(0, BLOCK_N)
    l_mask = offs_l < LORA
    r_mask = offs_r < ROPE
    q_rows = q_ptr + b * stride_qb + heads.to(tl.int64)[:, None] * stride_qh  # [BLOCK_H, 1]
    q_nope = tl.load(
        q_rows + offs_l[None, :], mask=h_mask[:, None] & l_mask[None, :], other=0.0
    )  # [BLOCK_H, BLOCK_L]
    if ROPE > 0:
        q_pe = tl.load(
            q_rows + LORA + offs_r[None, :], mask=h_mask[:, None] & r_mask[None, :], other=0.0
        )  # [BLOCK_H, BLOCK_R]
    bt_row = block_table_ptr + b * stride_bt
    exp_row = expected_ptr + b * stride_eb
    seq_owner = tl.load(exp_row)  # expected given per sequence: one load for every page
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], dtype=tl.float32)
    for t0 in range(start, end, BLOCK_N):
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
        rows = kv_ptr + page.to(tl.int64) * stride_kvp + slot * stride_kvs  # [BLOCK_N]
        latent = tl.load(
            rows[:, None] + offs_l[None, :], mask=live[:, None] & l_mask[None, :], other=0.0
        )  # [BLOCK_N, BLOCK_L]
        s = qk_scores(q_nope, latent, DOT_FP32)  # [BLOCK_H, BLOCK_N]
        if ROPE > 0:
            rope = tl.load(
                rows[:, None] + LORA + offs_r[None, :],
                mask=live[:, None] & r_mask[None, :],
                other=0.0,
            )  # [BLOCK_N, BLOCK_R]
            s += qk_scores(q_pe, rope, DOT_FP32)
        s = tl.where(live[None, :], s * scale_log2, float("-inf"))
        m_i, l_i, acc = online_softmax_step(s, latent, m_i, l_i, acc, DOT_FP32)

    if CHECK:
        if head_block == 0:
            store_split_report(
                bt_row,
                exp_row,
                stride_ep,
                tags_ptr,
                page_reasons_ptr + b * max_pages,
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
                0,
                start,
                end,
                PAGE,
                BLOCK_P,
            )

    if num_splits == 1:
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        out = acc / l_safe[:, None]
        tl.store(
            out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_l[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=h_mask[:, None] & l_mask[None, :],
        )
        if RETURN_LSE:
            lse = tl.where(l_i > 0, (m_i + tl.log2(l_safe)) / LOG2E_C, float("-inf"))
            tl.store(lse_ptr + b * NUM_HEADS + heads, lse, mask=h_mask)
    elif start < end:
        # Splits past the sequence's end write nothing; the merge reads only the others.
        row = (b * NUM_HEADS + heads) * num_splits + split  # [BLOCK_H]
        tl.store(part_acc_ptr + row[:, None] * BLOCK_L + offs_l[None, :], acc, mask=h_mask[:, None])
        tl.store(part_ml_ptr + row * 2, m_i, mask=h_mask)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=h_mask)


@dataclass(frozen=True)
class _Programs:
    """What :func:`kvattn.backends.grids.plan_num_splits` reads of a launch. It counts
    ``num_kv_heads`` programs per sequence and split: here, the head blocks."""

    q: torch.Tensor
    batch: int
    num_kv_heads: int
    max_pages: int
    page_size: int
    variant: Variant = PLAIN


def launch_config(args: MLADecodeArgs, config: MLADecodeConfig | None = None) -> MLADecodeConfig:
    """The configuration a launch uses: ``config`` or the table's entry (:mod:`.configs`)."""
    return config or mla_decode_config(args.q.device, args.q.dtype, args.head_dim, args.page_size)


def head_block(args: MLADecodeArgs, config: MLADecodeConfig) -> int:
    """Query heads per program: the configured block, or fewer heads rounded up to 16 (the
    tensor cores' smallest M)."""
    return min(config.block_h, max(16, triton.next_power_of_2(args.num_heads)))


def plan_splits(
    args: MLADecodeArgs, config: MLADecodeConfig | None = None, num_splits: int | None = None
) -> tuple[int, int, int]:
    """``(num_splits, min_chunk, align)`` of a launch (:func:`kvattn.backends.grids.plan_num_splits`
    over ``head_blocks`` programs per sequence and split)."""
    config = launch_config(args, config)
    align = split_alignment(args, config)
    head_blocks = triton.cdiv(args.num_heads, head_block(args, config))
    programs = _Programs(args.q, args.batch, head_blocks, args.max_pages, args.page_size)
    splits, min_chunk = plan_num_splits(programs, align, config.programs_per_sm, num_splits)
    return splits, min_chunk, align


def mla_decode(
    args: MLADecodeArgs,
    *,
    check: bool,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    config: MLADecodeConfig | None = None,
) -> OwnershipReport | None:
    """Launch the MLA decode kernel (and the merge when split). Writes ``out`` ``[B, num_heads,
    kv_lora_rank]`` (and ``lse``). ``args.num_splits`` and ``config`` override the planner and the
    configuration table (tests, tuning sweeps); the grid still depends on shapes only."""
    q, kv = args.q, args.kv_cache
    batch, num_heads, _ = q.shape
    lora, rope = args.kv_lora_rank, args.rope_dim
    config = launch_config(args, config)
    block_h = head_block(args, config)
    splits, min_chunk, align = plan_splits(args, config, args.num_splits)
    block_l = max(16, triton.next_power_of_2(lora))
    block_r = max(16, triton.next_power_of_2(rope))
    dot_fp32 = dots_in_fp32(q)
    report = OwnershipReport.allocate(batch, args.max_pages, q.device) if check else None
    if splits > 1:
        part_acc = torch.empty(
            batch * num_heads * splits * block_l, dtype=torch.float32, device=q.device
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

    paged_mla_decode_kernel[(triton.cdiv(num_heads, block_h), batch, splits)](
        q_ptr=q,
        kv_ptr=kv,
        block_table_ptr=args.block_table,
        seq_lens_ptr=args.seq_lens,
        tags_ptr=args.page_tags,
        expected_ptr=args.expected,
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
        stride_qb=q.stride(0),
        stride_qh=q.stride(1),
        stride_kvp=kv.stride(0),
        stride_kvs=kv.stride(1),
        stride_bt=args.block_table.stride(0),
        stride_eb=args.expected.stride(0),
        stride_ep=args.expected.stride(1),
        stride_ob=out.stride(0),
        stride_oh=out.stride(1),
        NUM_HEADS=num_heads,
        BLOCK_H=block_h,
        LORA=lora,
        BLOCK_L=block_l,
        ROPE=rope,
        BLOCK_R=block_r,
        PAGE=args.page_size,
        BLOCK_N=config.block_n,
        ALIGN=align,
        BLOCK_P=128,
        CHECK=check,
        DOT_FP32=dot_fp32,
        RETURN_LSE=lse is not None,
        OWNER_PER_PAGE=args.expected.stride(1) != 0,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if splits > 1:
        merge_splits_kernel[(batch, num_heads + int(check))](
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
            window_left=-1,
            sinks_ptr=out,
            alibi_ptr=out,
            alibi_stride=0,
            NUM_HEADS=num_heads,
            HEAD_DIM=lora,
            BLOCK_D=block_l,
            PAGE=args.page_size,
            ALIGN=align,
            BLOCK_S=16,
            CHECK=check,
            RETURN_LSE=lse is not None,
            WINDOW=False,
            SINKS=False,
            ALIBI=False,
            num_warps=4,
        )
    return report
