"""The ownership report of one split-KV decode program (GQA and MLA decode), after its main loop.

With one split the program stores the sequence's final counters; with several, its partial counts
(``REPORT_FIELDS`` int32 per sequence and split), which ``merge_splits_kernel`` sums.
``page_reasons`` entries past the sequence are zeroed by stripes, one
per split, so every entry is written by the call without a zeroing launch or atomics.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .tag_rule import V_OUT_OF_RANGE, check_pages

REPORT_FIELDS = tl.constexpr(3)  # refused pages, OR of reasons, pages read (per split)
# The attention kernels' report arguments, by name (their launchers pass them as keywords).
REPORT_PTRS = ("violations_ptr", "reasons_ptr", "checked_ptr", "beyond_ptr")


@triton.jit
def store_split_report(
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
    PAGE: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """The report of the logical pages of tokens ``[start, end)`` of sequence ``b`` (``raw_len``
    as given, ``seq_len`` clamped to the table). Their table entries and tags are read again (from
    L2), once per program instead of once per tile; page memory is never touched."""
    bad, reasons, read = check_pages(
        bt_row,
        exp_row,
        stride_ep,
        tags_ptr,
        reasons_row,
        num_pages,
        seq_len,
        first_key,
        start // PAGE,
        tl.cdiv(end, PAGE),
        PAGE,
        BLOCK_P,
    )
    if num_splits == 1:
        # A seq_len past the table: nothing beyond it is read, and it counts once.
        beyond = (raw_len > max_pages * PAGE).to(tl.int32)
        tl.store(beyond_ptr + b, beyond)
        tl.store(violations_ptr + b, bad + beyond)
        tl.store(reasons_ptr + b, reasons | tl.where(beyond != 0, V_OUT_OF_RANGE, 0))
        tl.store(checked_ptr + b, read)
    elif start < end:
        part = part_report_ptr + (b * num_splits + split) * REPORT_FIELDS
        tl.store(part, bad)
        tl.store(part + 1, reasons)
        tl.store(part + 2, read)
    unread = tl.cdiv(seq_len, PAGE)
    stripe = tl.cdiv(max_pages - unread, num_splits)
    lo = unread + split * stripe
    check_pages(
        bt_row,
        exp_row,
        stride_ep,
        tags_ptr,
        reasons_row,
        num_pages,
        seq_len,
        first_key,
        lo,
        tl.minimum(lo + stripe, max_pages),
        PAGE,
        BLOCK_P,
    )
