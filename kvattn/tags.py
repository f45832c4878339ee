"""The page tag: one int64 word per physical KV page, and the reasons a page can fail the check.

This module is the only place that knows the bit layout. Kernels receive the constants below as
compile-time arguments; callers and tests use the helpers, never their own shifts.

Bit layout of a tag (bit 63 is always 0, so every valid tag is a non-negative int64)::

    63    62 ............................ 16  15 ............... 2  1 .. 0
    [ 0 ][ owner (47 bits, 1 .. 2**47-1)   ][ valid_len (14 bits) ][ state ]

- ``state``: ``FREE`` (0), ``RESERVED`` (1) or ``WRITTEN`` (2). The all-zero word is ``FREE``, so a
  zero-initialised tag array fails closed. No writer produces state 3 or a word with bit 63 set;
  every reader and writer treats such a *malformed* word like ``FREE`` (refused, never held).
- ``valid_len``: the number of leading token slots of the page that hold data written by ``owner``.
  Only meaningful when ``state == WRITTEN``; 14 bits cover every supported page size (<= 1024).
- ``owner``: the lease id the page was reserved or written for. Owner 0 is invalid: no helper
  produces a RESERVED or WRITTEN tag with owner 0, so an expected owner of 0 never matches.

A reader accepts a page for owner ``e`` when ``1 <= e <= OWNER_MAX`` and ``tag & ~VALID_LEN_MASK ==
(e << OWNER_SHIFT) | WRITTEN``: one compare tests the state, the owner and bit 63; ``valid_len``
then masks the slots.
"""

from __future__ import annotations

import enum
import itertools
import threading

import torch

STATE_BITS = 2
STATE_MASK = (1 << STATE_BITS) - 1
STATE_FREE = 0
STATE_RESERVED = 1
STATE_WRITTEN = 2

VALID_LEN_SHIFT = 2
VALID_LEN_BITS = 14
VALID_LEN_MAX = (1 << VALID_LEN_BITS) - 1
VALID_LEN_MASK = VALID_LEN_MAX << VALID_LEN_SHIFT

OWNER_SHIFT = 16
OWNER_BITS = 47
OWNER_MAX = (1 << OWNER_BITS) - 1

FREE_TAG = 0


class Violation(enum.IntFlag):
    """Why a logical page was refused. A report ORs these per sequence.

    Exactly one reason is recorded per refused page: the first failing condition in the order
    below (an out-of-range page has no tag to read, a page that is not WRITTEN has no owner to
    compare, and so on), so the reasons are the same on every backend.
    """

    NONE = 0
    OUT_OF_RANGE = 1  # block-table entry outside [0, num_pages), or seq_len beyond the table
    FREE = 2  # tag state FREE, or a malformed word (state 3, bit 63 set) no writer produces
    RESERVED = 4  # allocated for a lease but never written
    OWNER_MISMATCH = 8  # WRITTEN, but for another owner than the one expected
    UNWRITTEN = 16  # right owner, but a slot the sequence reads lies at or past valid_len


class WriteDrop(enum.IntFlag):
    """Why a writer refused a token or a page (see :mod:`kvattn.writers`)."""

    NONE = 0
    OUT_OF_RANGE = 1  # page id outside [0, num_pages) or slot outside [0, page_size)
    NOT_HELD = 2  # the page is not RESERVED or WRITTEN for the writer's owner (late writer)
    GAP = 4  # the token's slot lies past the page's written prefix, leaving a hole before it
    BAD_LENGTH = 8  # commit: accounted length outside [0, page_size]


def check_owner(owner: int, name: str = "owner") -> int:
    """``owner`` if it is an id a lease can hold, ``[1, OWNER_MAX]``; else raises naming ``name``
    (owner 0 is never valid: it would match tags whose owner field is 0)."""
    if isinstance(owner, bool) or not isinstance(owner, int):
        raise TypeError(f"{name}: expected an int, got {type(owner).__name__} ({owner!r})")
    if not 1 <= owner <= OWNER_MAX:
        raise ValueError(f"{name}: expected an id in [1, {OWNER_MAX}], got {owner}")
    return owner


_owner_lock = threading.Lock()
_owner_ids = itertools.count(1)


def new_owner_id() -> int:
    """A fresh owner id, never handed out before in this process (thread-safe): every lease of
    every cache and engine ledger of the process draws from this one counter, so a stale page can
    never carry a live owner."""
    with _owner_lock:
        owner = next(_owner_ids)
    if owner > OWNER_MAX:
        raise RuntimeError("owner ids exhausted in this process (2**47 - 1 issued)")
    return owner


def reserved_tag(owner: int) -> int:
    """Tag of a page allocated to ``owner`` and not written yet."""
    return (check_owner(owner) << OWNER_SHIFT) | STATE_RESERVED


def written_tag(owner: int, valid_len: int) -> int:
    """Tag of a page whose first ``valid_len`` slots were written for ``owner``."""
    if isinstance(valid_len, bool) or not isinstance(valid_len, int):
        raise TypeError(f"valid_len: expected an int, got {type(valid_len).__name__}")
    if not 0 <= valid_len <= VALID_LEN_MAX:
        raise ValueError(f"valid_len: expected a length in [0, {VALID_LEN_MAX}], got {valid_len}")
    return (check_owner(owner) << OWNER_SHIFT) | (valid_len << VALID_LEN_SHIFT) | STATE_WRITTEN


def tag_state(tag):
    """State field of a tag (int or int64 tensor); ``STATE_FREE`` for a malformed word (bit 63 set,
    or the unused state 3), which every reader and writer treats as FREE."""
    if isinstance(tag, torch.Tensor):
        state = tag & STATE_MASK
        return torch.where((tag < 0) | (state == 3), STATE_FREE, state)
    return STATE_FREE if tag < 0 or tag & STATE_MASK == 3 else tag & STATE_MASK


def tag_valid_len(tag):
    """``valid_len`` field of a tag (int or int64 tensor)."""
    return (tag >> VALID_LEN_SHIFT) & VALID_LEN_MAX


def tag_owner(tag):
    """Owner field of a tag (int or int64 tensor)."""
    return (tag >> OWNER_SHIFT) & OWNER_MAX


def accept_key(owner):
    """``tag & ~VALID_LEN_MASK`` of a WRITTEN page of ``owner`` (int or int64 tensor)."""
    return (owner << OWNER_SHIFT) | STATE_WRITTEN


def valid_owner(owner):
    """True where ``owner`` is an id a lease can hold, ``[1, OWNER_MAX]`` (int or int64 tensor)."""
    return (owner >= 1) & (owner <= OWNER_MAX)


def held_by(tag, owner):
    """True where ``tag`` is RESERVED or WRITTEN for ``owner``: the writer's precondition. An owner
    outside ``[1, OWNER_MAX]`` holds nothing."""
    state = tag_state(tag)
    held_state = (state == STATE_RESERVED) | (state == STATE_WRITTEN)
    return held_state & (tag_owner(tag) == owner) & valid_owner(owner)


def describe_tag(tag: int) -> str:
    """Human-readable form of one tag, for error messages and the demo."""
    tag = int(tag)
    state = tag_state(tag)
    if state == STATE_WRITTEN:
        return f"WRITTEN(owner={tag_owner(tag)}, valid_len={tag_valid_len(tag)})"
    if state == STATE_RESERVED:
        return f"RESERVED(owner={tag_owner(tag)})"
    return "FREE"


def page_reason(
    tag: torch.Tensor, in_range: torch.Tensor, expected: torch.Tensor, slots_read: torch.Tensor
) -> torch.Tensor:
    """Reason (a :class:`Violation` value per element, 0 when accepted) for pages read by a sequence.

    All arguments broadcast together. ``tag`` must already be 0 where ``in_range`` is False (the
    caller never reads it there); ``slots_read`` is how many leading slots the sequence reads from
    the page. This is the reader's rule of docs/ownership.md section 3, in the precedence order of
    :class:`Violation`; the kernels implement the same order.
    """
    state = tag_state(tag)
    reason = torch.where(tag_valid_len(tag) < slots_read, int(Violation.UNWRITTEN), 0)
    foreign = (tag_owner(tag) != expected) | ~valid_owner(expected)
    reason = torch.where(foreign, int(Violation.OWNER_MISMATCH), reason)
    reason = torch.where(state == STATE_RESERVED, int(Violation.RESERVED), reason)
    reason = torch.where(state == STATE_FREE, int(Violation.FREE), reason)
    reason = torch.where(in_range, reason, int(Violation.OUT_OF_RANGE))
    return reason.to(torch.int32)
