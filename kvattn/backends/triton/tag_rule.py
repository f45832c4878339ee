"""The reader's rule and the tag format as Triton code, shared by every kernel of this backend.

The constants come from :mod:`kvattn.tags` (the only place that defines the bit layout) and enter
the kernels as compile-time values; the functions below are the one Triton statement of
ownership.md section 3, used by the decode and extend kernels, and of the writer's precondition.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ... import tags as T
from ...tags import Violation, WriteDrop

LOG2E = 1.4426950408889634
LOG2E_C = tl.constexpr(LOG2E)

STATE_MASK = tl.constexpr(T.STATE_MASK)
RESERVED = tl.constexpr(T.STATE_RESERVED)
WRITTEN = tl.constexpr(T.STATE_WRITTEN)
VALID_LEN_SHIFT = tl.constexpr(T.VALID_LEN_SHIFT)
VALID_LEN_MAX = tl.constexpr(T.VALID_LEN_MAX)
OWNER_SHIFT = tl.constexpr(T.OWNER_SHIFT)
OWNER_MAX = tl.constexpr(T.OWNER_MAX)
# Every bit but valid_len: a WRITTEN tag of owner e, with bit 63 clear, is (e << OWNER_SHIFT) | WRITTEN
# under this mask. A negative constant, so it sign-extends to the 64-bit mask.
KEY_MASK = tl.constexpr(~T.VALID_LEN_MASK)
V_OUT_OF_RANGE = tl.constexpr(int(Violation.OUT_OF_RANGE))
V_FREE = tl.constexpr(int(Violation.FREE))
V_RESERVED = tl.constexpr(int(Violation.RESERVED))
V_OWNER_MISMATCH = tl.constexpr(int(Violation.OWNER_MISMATCH))
V_UNWRITTEN = tl.constexpr(int(Violation.UNWRITTEN))
DROP_OUT_OF_RANGE = tl.constexpr(int(WriteDrop.OUT_OF_RANGE))
DROP_NOT_HELD = tl.constexpr(int(WriteDrop.NOT_HELD))
DROP_GAP = tl.constexpr(int(WriteDrop.GAP))


@triton.jit
def bit_or(a, b):
    return a | b


@triton.jit
def valid_owner(owner):
    return (owner >= 1) & (owner <= OWNER_MAX)


@triton.jit
def readable_len(tag, exp_owner):
    """The ownership part of the reader's rule: how many leading slots of the page may be read --
    its valid_len if it is WRITTEN for the expected owner, else 0 (also for an expected owner
    outside [1, OWNER_MAX] and a tag with bit 63 set, which no writer produces). One compare
    tests state and owner. Works on scalars and vectors."""
    owned = ((tag & KEY_MASK) == ((exp_owner << OWNER_SHIFT) | WRITTEN)) & valid_owner(exp_owner)
    # valid_len fits in 32 bits: the slot masks it feeds then need no 64-bit compares.
    return tl.where(owned, ((tag >> VALID_LEN_SHIFT) & VALID_LEN_MAX).to(tl.int32), 0)


@triton.jit
def page_reason(tag, in_range, exp_owner, slots_read):
    """The reader's rule per page as a Violation value, first failing condition winning (the order
    of kvattn.Violation, as kvattn.tags.page_reason); 0 when every slot read passes."""
    state = (tag & STATE_MASK).to(tl.int32)
    valid_len = ((tag >> VALID_LEN_SHIFT) & VALID_LEN_MAX).to(tl.int32)
    reason = tl.where(valid_len < slots_read, V_UNWRITTEN, 0)
    foreign = ((tag >> OWNER_SHIFT) != exp_owner) | ~valid_owner(exp_owner)
    reason = tl.where(foreign, V_OWNER_MISMATCH, reason)
    reason = tl.where(state == RESERVED, V_RESERVED, reason)
    malformed = (tag < 0) | ((state != RESERVED) & (state != WRITTEN))
    reason = tl.where(malformed, V_FREE, reason)
    return tl.where(in_range, reason, V_OUT_OF_RANGE)


@triton.jit
def tile_slots(
    t0,
    end,
    offs_n,
    bt_row,
    exp_row,
    stride_ep,
    seq_owner,
    tags_ptr,
    num_pages,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CHECK: tl.constexpr,
    OWNER_PER_PAGE: tl.constexpr,
):
    """The decode tile of tokens ``[t0, t0 + BLOCK_N)`` read before ``end``: ``(page, slot,
    live)``, the physical page(s), the slot in the page and whether each token may contribute
    (inside the length, a page id in the pool and, checked, a slot the tag certifies for the
    expected owner). ``page`` is a scalar when a tile lies inside one page (one table entry and
    one tag for the tile), else ``[BLOCK_N]`` (resolved per token)."""
    if PAGE % BLOCK_N == 0:
        logical = t0 // PAGE
        page = tl.load(bt_row + logical)
        in_range = (page >= 0) & (page < num_pages)
        limit = tl.where(in_range, end - logical * PAGE, 0)  # length mask, in slots of the page
        if CHECK:
            tag = tl.load(tags_ptr + tl.where(in_range, page, 0))
            owner = seq_owner
            if OWNER_PER_PAGE:
                owner = tl.load(exp_row + logical * stride_ep)
            limit = tl.minimum(limit, readable_len(tag, owner))
        slot = t0 % PAGE + offs_n  # [BLOCK_N]
        live = slot < limit
    else:
        tok = t0 + offs_n  # [BLOCK_N]
        logical = tok // PAGE
        slot = tok % PAGE
        live = tok < end
        page = tl.load(bt_row + logical, mask=live, other=0)  # [BLOCK_N]
        live = live & (page >= 0) & (page < num_pages)
        if CHECK:
            tag = tl.load(tags_ptr + page, mask=live, other=0)
            owner = seq_owner
            if OWNER_PER_PAGE:
                owner = tl.load(exp_row + logical * stride_ep, mask=live, other=0)
            live = live & (slot < readable_len(tag, owner))
    return page, slot, live


@triton.jit
def unpack_entry(entry, num_pages):
    """``(page, readable slots)`` of a verdict's packed entry ``page << 32 | readable``
    (docs/ownership.md section 9), readable 0 unless the page id lies in the pool: a forged or
    stale entry never dereferences a page outside it."""
    page = (entry >> 32).to(tl.int32)  # exact: the high word
    readable = entry.to(tl.int32)  # the low word (negative only if forged: then nothing)
    return page, tl.where((page >= 0) & (page < num_pages), readable, 0)


@triton.jit
def verdict_tile_slots(
    t0, end, offs_n, verdict_row, num_pages, PAGE: tl.constexpr, BLOCK_N: tl.constexpr
):
    """:func:`tile_slots` through a verdict: one packed entry per page, no block-table entry, no
    tag. The tile lies before the new token's page, so wholly inside the sequence: an entry alone
    says what is read (a forged one reads at most its own page, never past the length)."""
    if PAGE % BLOCK_N == 0:
        logical = t0 // PAGE
        page, readable = unpack_entry(tl.load(verdict_row + logical), num_pages)
        slot = t0 % PAGE + offs_n  # [BLOCK_N]
        live = slot < readable
    else:
        tok = t0 + offs_n  # [BLOCK_N]
        logical = tok // PAGE
        slot = tok % PAGE
        live = tok < end
        page, readable = unpack_entry(tl.load(verdict_row + logical, mask=live, other=0), num_pages)
        live = live & (slot < readable)
    return page, slot, live


@triton.jit
def fresh_tile_slots(
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
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    OWNER_PER_PAGE: tl.constexpr,
):
    """:func:`verdict_tile_slots` for the tiles that hold the new token's page (logical page
    ``fresh``, the new token at ``fresh_slot``): that page's new slot is readable only if this
    call's tag certifies it, its older slots only as the verdict says (a slot another layer
    refused stays refused); the other pages' slots come from their entries."""
    if PAGE % BLOCK_N == 0:
        logical = t0 // PAGE
        page, readable = unpack_entry(tl.load(verdict_row + logical), num_pages)
        in_range = (page >= 0) & (page < num_pages)
        limit = readable
        if logical == fresh:
            tag = tl.load(tags_ptr + tl.where(in_range, page, 0))
            owner = seq_owner
            if OWNER_PER_PAGE:
                owner = tl.load(exp_row + logical * stride_ep)
            cap = tl.where(readable < fresh_slot, readable, PAGE)
            limit = tl.minimum(readable_len(tag, owner), cap)
        limit = tl.where(in_range, limit, 0)
        slot = t0 % PAGE + offs_n  # [BLOCK_N]
        live = slot < tl.minimum(limit, end - logical * PAGE)
    else:
        tok = t0 + offs_n  # [BLOCK_N]
        logical = tok // PAGE
        slot = tok % PAGE
        live = tok < end
        page, readable = unpack_entry(tl.load(verdict_row + logical, mask=live, other=0), num_pages)
        is_fresh = live & (logical == fresh)
        in_range = (page >= 0) & (page < num_pages)
        tag = tl.load(tags_ptr + page, mask=is_fresh & in_range, other=0)
        owner = seq_owner
        if OWNER_PER_PAGE:
            owner = tl.load(exp_row + logical * stride_ep, mask=is_fresh, other=0)
        cap = tl.where(readable < fresh_slot, readable, PAGE)
        limit = tl.where(is_fresh, tl.minimum(readable_len(tag, owner), cap), readable)
        live = live & in_range & (slot < limit)
    return page, slot, live


@triton.jit
def add_fresh_refusal(
    verdict_row,
    exp_row,
    stride_ep,
    tags_ptr,
    reasons_row,
    violations_ptr,
    reasons_ptr,
    num_pages,
    fresh,
    fresh_slot,
):
    """The report's part of a call through a verdict: the new token's page judged against this
    call's tag, through its new slot, and added to the verdict's report unless a resolve or an
    earlier call already counts it (so a page counts once per step)."""
    page = tl.load(verdict_row + fresh) >> 32
    in_range = (page >= 0) & (page < num_pages)
    tag = tl.load(tags_ptr + tl.where(in_range, page, 0))
    tag = tl.where(in_range, tag, 0)
    owner = tl.load(exp_row + fresh * stride_ep)
    why = page_reason(tag, in_range, owner, fresh_slot + 1)
    new = (why != 0) & (tl.load(reasons_row + fresh) == 0)
    tl.store(reasons_row + fresh, why.to(tl.int8), mask=new)
    tl.store(violations_ptr, tl.load(violations_ptr) + 1, mask=new)
    tl.store(reasons_ptr, tl.load(reasons_ptr) | why, mask=new)


@triton.jit
def check_pages(
    bt_row,
    exp_row,
    stride_ep,
    tags_ptr,
    reasons_row,
    num_pages,
    seq_len,
    first_key,
    page_lo,
    page_hi,
    PAGE: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """The report for logical pages ``[page_lo, page_hi)`` of one sequence of ``seq_len`` tokens
    whose queries read keys from ``first_key`` on (a sliding window; 0 without one): writes each
    page's reason to ``reasons_row`` (0 when accepted or not read) and returns ``(refused pages, OR
    of their reasons, pages read)``. Pages are read in blocks of BLOCK_P, each with its block-table
    entry, tag and expected owner; page memory is never touched."""
    bad = tl.zeros([BLOCK_P], dtype=tl.int32)
    n_read = tl.zeros([BLOCK_P], dtype=tl.int32)
    bits = tl.zeros([BLOCK_P], dtype=tl.int32)
    for p0 in range(page_lo, page_hi, BLOCK_P):
        logical = p0 + tl.arange(0, BLOCK_P)  # [BLOCK_P]
        in_table = logical < page_hi
        slots_read = tl.minimum(tl.maximum(seq_len - logical * PAGE, 0), PAGE)
        read = in_table & (slots_read > 0) & ((logical + 1) * PAGE > first_key)
        page = tl.load(bt_row + logical, mask=read, other=0)
        in_range = (page >= 0) & (page < num_pages)
        tag = tl.load(tags_ptr + page, mask=read & in_range, other=0)
        exp_owner = tl.load(exp_row + logical * stride_ep, mask=read, other=0)
        reason = tl.where(read, page_reason(tag, in_range, exp_owner, slots_read), 0)
        tl.store(reasons_row + logical, reason.to(tl.int8), mask=in_table)
        bad += (reason != 0).to(tl.int32)
        n_read += read.to(tl.int32)
        bits = bits | reason
    return tl.sum(bad, axis=0), tl.reduce(bits, 0, bit_or), tl.sum(n_read, axis=0)


@triton.jit
def written_prefix(tag):
    """valid_len of a WRITTEN page, 0 for any other state (what a writer may extend)."""
    return tl.where((tag & STATE_MASK) == WRITTEN, (tag >> VALID_LEN_SHIFT) & VALID_LEN_MAX, 0)


@triton.jit
def held_by(tag, owner):
    """The writer's precondition: the page is RESERVED or WRITTEN for ``owner`` (> 0)."""
    state = tag & STATE_MASK
    return (
        (owner > 0) & ((tag >> OWNER_SHIFT) == owner) & ((state == RESERVED) | (state == WRITTEN))
    )


@triton.jit
def written_tag(owner, valid_len):
    return (owner << OWNER_SHIFT) | (valid_len << VALID_LEN_SHIFT) | WRITTEN
