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
def readable_len(tag, exp_owner):
    """The ownership part of the reader's rule: how many leading slots of the page may be read --
    its valid_len if it is WRITTEN for the expected owner, else 0. Works on scalars and vectors."""
    owned = ((tag & STATE_MASK) == WRITTEN) & ((tag >> OWNER_SHIFT) == exp_owner)
    return tl.where(owned, (tag >> VALID_LEN_SHIFT) & VALID_LEN_MAX, 0)


@triton.jit
def page_reason(tag, in_range, exp_owner, slots_read):
    """The reader's rule per page as a Violation value, first failing condition winning (the order
    of kvattn.Violation); 0 when every slot read passes."""
    state = tag & STATE_MASK
    valid_len = (tag >> VALID_LEN_SHIFT) & VALID_LEN_MAX
    reason = tl.where(valid_len < slots_read, V_UNWRITTEN, 0)
    reason = tl.where((tag >> OWNER_SHIFT) != exp_owner, V_OWNER_MISMATCH, reason)
    reason = tl.where(state == RESERVED, V_RESERVED, reason)
    reason = tl.where((state != RESERVED) & (state != WRITTEN), V_FREE, reason)
    return tl.where(in_range, reason, V_OUT_OF_RANGE)


@triton.jit
def written_prefix(tag):
    """valid_len of a WRITTEN page, 0 for any other state (what a writer may extend)."""
    return tl.where((tag & STATE_MASK) == WRITTEN, (tag >> VALID_LEN_SHIFT) & VALID_LEN_MAX, 0)


@triton.jit
def held_by(tag, owner):
    """The writer's precondition: the page is RESERVED or WRITTEN for ``owner`` (> 0)."""
    state = tag & STATE_MASK
    return (owner > 0) & ((tag >> OWNER_SHIFT) == owner) & ((state == RESERVED) | (state == WRITTEN))


@triton.jit
def written_tag(owner, valid_len):
    return (owner << OWNER_SHIFT) | (valid_len << VALID_LEN_SHIFT) | WRITTEN
