"""The decode step's verdict on the GPU (:func:`kvattn.resolve_pages`; docs/ownership.md section 9):
:func:`kvattn.reference.resolve_verdict` as two launches.

``resolve_verdict_kernel`` (grid ``(B, ceil(max_pages / BLOCK_P))``) judges a block of one
sequence's logical pages in every layer: per page one block-table entry and expected owner, then
the tags of ``BLOCK_L`` layers at a time as one ``[BLOCK_L, BLOCK_P]`` gather, so a 61-layer model
costs two dependent loads per block, not 61. It writes the packed entries (and the new token's
page's again, per sequence), the page reasons and the block's partial counts;
``verdict_report_kernel`` (grid ``(B,)``) sums those into the report with the extend's
:func:`~.paged_extend.store_report`. No host sync, fresh buffers only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...report import OwnershipReport
from .paged_extend import store_report
from .split_report import REPORT_FIELDS
from .tag_rule import V_OUT_OF_RANGE, bit_or, page_reason, readable_len

BLOCK_P = 32
BLOCK_L = 32


@triton.jit
def resolve_verdict_kernel(
    block_table_ptr,
    seq_lens_ptr,
    tags_ptr,
    expected_ptr,
    entries_ptr,
    fresh_ptr,
    page_reasons_ptr,
    part_report_ptr,
    num_layers,
    num_pages,
    max_pages,
    window_left,
    stride_tl,
    stride_bt,
    stride_eb,
    stride_ep,
    PAGE: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_L: tl.constexpr,
    WINDOW: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    raw_len = tl.load(seq_lens_ptr + b)
    capacity = max_pages * PAGE
    seq_len = tl.minimum(tl.maximum(raw_len, 0), capacity)
    before_new = tl.minimum(tl.maximum(raw_len - 1, 0), capacity)  # tokens before the new one
    first_key = 0
    if WINDOW:
        first_key = tl.maximum(tl.maximum(raw_len, 0) - 1 - window_left, 0)
    logical = block * BLOCK_P + tl.arange(0, BLOCK_P)  # [BLOCK_P]
    in_table = logical < max_pages
    first_slot = logical * PAGE
    read = in_table & (seq_len > first_slot) & (first_slot + PAGE > first_key)
    old_slots = tl.minimum(tl.maximum(before_new - first_slot, 0), PAGE)
    page = tl.load(block_table_ptr + b * stride_bt + logical, mask=read, other=0)
    in_range = (page >= 0) & (page < num_pages)
    owner = tl.load(expected_ptr + b * stride_eb + logical * stride_ep, mask=read, other=0)
    readable = tl.full([BLOCK_P], PAGE, dtype=tl.int32)
    bits = tl.zeros([BLOCK_P], dtype=tl.int32)
    for l0 in range(0, num_layers, BLOCK_L):
        layer = l0 + tl.arange(0, BLOCK_L)  # [BLOCK_L]
        has_layer = (layer < num_layers)[:, None]
        tag = tl.load(
            tags_ptr + layer.to(tl.int64)[:, None] * stride_tl + page[None, :],
            mask=has_layer & (read & in_range)[None, :],
            other=0,
        )  # [BLOCK_L, BLOCK_P]
        certified = tl.where(has_layer, readable_len(tag, owner[None, :]), PAGE)
        readable = tl.minimum(readable, tl.min(certified, axis=0))
        why = page_reason(tag, in_range[None, :], owner[None, :], old_slots[None, :])
        bits = bits | tl.reduce(tl.where(has_layer, why, 0), 0, bit_or)
    # The new token's slot is each call's to judge: only the slots before it are judged here.
    reason = tl.where(read & (old_slots > 0), bits & -bits, 0)  # the first condition, in order
    reason = tl.where(read & ~in_range, V_OUT_OF_RANGE, reason)
    ok = read & in_range
    readable = tl.where(ok, tl.minimum(readable, old_slots), 0)
    entry = (tl.where(ok, page, -1).to(tl.int64) << 32) | readable.to(tl.int64)
    tl.store(entries_ptr + b * max_pages + logical, entry, mask=in_table)
    # The new token's page's entry again, per sequence: what a decode loads beside the length.
    # Outside the table (-1) logical page 0 stores page -1 instead.
    fresh = tl.where((raw_len >= 1) & (raw_len <= capacity), (raw_len - 1) // PAGE, -1)
    tl.store(
        fresh_ptr + b + tl.zeros_like(logical),
        tl.where(logical == fresh, entry, -(1 << 32)),
        mask=in_table & (logical == tl.maximum(fresh, 0)),
    )
    tl.store(page_reasons_ptr + b * max_pages + logical, reason.to(tl.int8), mask=in_table)
    part = part_report_ptr + (b * tl.num_programs(1) + block) * REPORT_FIELDS
    tl.store(part, tl.sum((reason != 0).to(tl.int32), axis=0))
    tl.store(part + 1, tl.reduce(reason, 0, bit_or))
    tl.store(part + 2, tl.sum(read.to(tl.int32), axis=0))


@triton.jit
def verdict_report_kernel(
    part_report_ptr,
    seq_lens_ptr,
    violations_ptr,
    reasons_ptr,
    checked_ptr,
    beyond_ptr,
    blocks,
    capacity,
    BLOCK_K: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    store_report(
        part_report_ptr,
        violations_ptr,
        reasons_ptr,
        checked_ptr,
        beyond_ptr,
        b,
        blocks,
        tl.load(seq_lens_ptr + b),
        capacity,
        BLOCK_K,
    )


def resolve(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    layer_tags: torch.Tensor,
    expected: torch.Tensor,
    page_size: int,
    window_left: int,
) -> tuple[torch.Tensor, torch.Tensor, OwnershipReport]:
    """``(entries, fresh, report)``: :func:`kvattn.reference.resolve_verdict` and
    :func:`~kvattn.reference.fresh_entries` (validated arguments:
    ``layer_tags`` ``[L, num_pages]`` with unit page stride, ``expected`` ``[B, max_pages]``)."""
    batch, max_pages = block_table.shape
    device = block_table.device
    blocks = triton.cdiv(max_pages, BLOCK_P)
    entries = torch.empty(batch, max_pages, dtype=torch.int64, device=device)
    fresh = torch.empty(batch, dtype=torch.int64, device=device)  # (a table has a column at least)
    report = OwnershipReport.allocate(batch, max_pages, device)
    part = torch.empty(batch * blocks * REPORT_FIELDS, dtype=torch.int32, device=device)
    resolve_verdict_kernel[(batch, blocks)](
        block_table_ptr=block_table,
        seq_lens_ptr=seq_lens,
        tags_ptr=layer_tags,
        expected_ptr=expected,
        entries_ptr=entries,
        fresh_ptr=fresh,
        page_reasons_ptr=report.page_reasons,
        part_report_ptr=part,
        num_layers=layer_tags.shape[0],
        num_pages=layer_tags.shape[1],
        max_pages=max_pages,
        window_left=window_left,
        stride_tl=layer_tags.stride(0),
        stride_bt=block_table.stride(0),
        stride_eb=expected.stride(0),
        stride_ep=expected.stride(1),
        PAGE=page_size,
        BLOCK_P=BLOCK_P,
        BLOCK_L=BLOCK_L,
        WINDOW=window_left >= 0,
    )
    verdict_report_kernel[(batch,)](
        part_report_ptr=part,
        seq_lens_ptr=seq_lens,
        violations_ptr=report.violations,
        reasons_ptr=report.reasons,
        checked_ptr=report.pages_checked,
        beyond_ptr=report.beyond_table,
        blocks=blocks,
        capacity=max_pages * page_size,
        BLOCK_K=16,
    )
    return entries, fresh, report
