"""A plain-Python model of paged KV state, for the random-trace tests (docs/ownership.md 6.8).

Per physical page it keeps the tag fields (state, owner, valid_len) and, per slot, which
``(owner, token)`` last wrote its bytes (None: never written since the pool was poisoned). It also
keeps the allocator's bookkeeping (reference counts, leases). Writers and the reader's rule are
re-derived here from the docstrings of kvattn.writers and docs/ownership.md section 3 with loops
over Python ints, sharing nothing with kvattn but the flag values, so the tests compare two
independent readings of the contract.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvattn import Violation, WriteDrop

FREE, RESERVED, WRITTEN = "FREE", "RESERVED", "WRITTEN"


@dataclass
class PageState:
    slots: list
    state: str = FREE
    owner: int = 0
    valid_len: int = 0


@dataclass
class LeaseState:
    owner: int
    pages: list = field(default_factory=list)
    page_owners: list = field(default_factory=list)
    num_tokens: int = 0
    live: bool = True


class PageModel:
    def __init__(self, num_pages: int, page_size: int):
        self.num_pages = num_pages
        self.page_size = page_size
        self.pages = [PageState(slots=[None] * page_size) for _ in range(num_pages)]
        self.refs = [0] * num_pages
        self.leases: dict[int, LeaseState] = {}
        self.last_owner = 0

    # --- allocator bookkeeping ---------------------------------------------------------------

    def free_page_count(self) -> int:
        return self.refs.count(0)

    def pages_needed(self, lease: LeaseState, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.page_size) - len(lease.pages))

    def new_lease(self, owner: int, pages: list) -> LeaseState:
        """Record an allocation the allocator made; owners must only grow, pages must be unheld."""
        assert owner > self.last_owner, f"owner {owner} issued after {self.last_owner}"
        self.last_owner = owner
        lease = LeaseState(owner)
        self.leases[owner] = lease
        self.take(lease, pages)
        return lease

    def take(self, lease: LeaseState, pages: list) -> None:
        assert len(set(pages)) == len(pages), f"pages handed out twice in one call: {pages}"
        for p in pages:
            assert self.refs[p] == 0, f"page {p} handed out while still referenced"
            self.refs[p] = 1
        self.reserve(pages, lease.owner)
        lease.pages += pages
        lease.page_owners += [lease.owner] * len(pages)

    def share(self, parent: LeaseState, owner: int, num_tokens: int) -> LeaseState:
        """A child lease over ``parent``'s full pages below ``min(num_tokens, parent.num_tokens)``."""
        shared = min(num_tokens, parent.num_tokens) // self.page_size
        assert owner > self.last_owner
        self.last_owner = owner
        child = LeaseState(
            owner, parent.pages[:shared], parent.page_owners[:shared], shared * self.page_size
        )
        for p in child.pages:
            self.refs[p] += 1
        self.leases[owner] = child
        return child

    def free(self, lease: LeaseState, heir: int | None = None) -> list:
        """Drop ``lease``; release and return the pages nobody references any more. Pages it wrote
        that others still share pass to owner ``heir`` (issued by the allocator), and the sharers'
        expected owners follow."""
        lease.live = False
        released, kept = [], []
        for p, page_owner in zip(lease.pages, lease.page_owners):
            self.refs[p] -= 1
            if self.refs[p] == 0:
                released.append(p)
            elif page_owner == lease.owner:
                kept.append(p)
        self.release(released)
        assert (heir is None) == (not kept), f"heir {heir} for kept pages {kept}"
        if kept:
            assert heir > self.last_owner
            self.last_owner = heir
            for p in kept:
                if self._held(p, lease.owner):
                    ps = self.pages[p]
                    ps.owner = heir
                    # The heir holds the bytes written for the ended lease: same tokens, new owner.
                    ps.slots = [
                        (heir, c[1]) if c is not None and c[0] == lease.owner else c
                        for c in ps.slots
                    ]
            for other in self.leases.values():
                if other.live:
                    other.page_owners = [
                        heir if (o == lease.owner and p in kept) else o
                        for p, o in zip(other.pages, other.page_owners)
                    ]
        return released

    def slot_ids(self, lease: LeaseState, start: int, count: int) -> list:
        return [
            lease.pages[t // self.page_size] * self.page_size + t % self.page_size
            for t in range(start, start + count)
        ]

    # --- tags and bytes ----------------------------------------------------------------------

    def reserve(self, pages, owner: int) -> None:
        for p in pages:
            self.pages[p].state, self.pages[p].owner, self.pages[p].valid_len = RESERVED, owner, 0

    def release(self, pages) -> None:
        for p in pages:
            self.pages[p].state, self.pages[p].owner, self.pages[p].valid_len = FREE, 0, 0

    def raw_write(self, page: int, slot: int, owner: int, token: int) -> None:
        """Bytes that arrived by another path (an RDMA transfer): no tag changes."""
        self.pages[page].slots[slot] = (owner, token)

    def _held(self, page: int, owner: int) -> bool:
        ps = self.pages[page]
        return ps.state in (RESERVED, WRITTEN) and ps.owner == owner

    def _prefix(self, page: int) -> int:
        ps = self.pages[page]
        return ps.valid_len if ps.state == WRITTEN else 0

    def write(self, slot_ids: list, owners: list, tokens: list) -> tuple[list, list]:
        """``write_kv``: returns ``(landed, reasons)`` per token and applies the landed ones."""
        landed, reasons = self.decide_write(slot_ids, owners)
        self.apply_write(slot_ids, owners, tokens, landed)
        return landed, reasons

    def decide_write(self, slot_ids: list, owners: list) -> tuple[list, list]:
        """The verdicts of ``write_kv`` on the current state, applying nothing."""
        size = self.page_size
        n = len(slot_ids)
        padding = [s < 0 for s in slot_ids]
        page = [s // size for s in slot_ids]
        slot = [s % size for s in slot_ids]
        in_range = [not padding[i] and page[i] < self.num_pages for i in range(n)]
        held = [in_range[i] and self._held(page[i], owners[i]) for i in range(n)]
        prefix = [self._prefix(page[i]) if in_range[i] else 0 for i in range(n)]
        start = list(range(n))
        for i in range(1, n):
            if held[i] and held[i - 1] and page[i] == page[i - 1] and slot[i] == slot[i - 1] + 1:
                start[i] = start[i - 1]
        landed = [held[i] and slot[start[i]] <= prefix[i] for i in range(n)]
        reasons = []
        for i in range(n):
            if padding[i] or landed[i]:
                reasons.append(0)
            elif not in_range[i]:
                reasons.append(int(WriteDrop.OUT_OF_RANGE))
            elif not held[i]:
                reasons.append(int(WriteDrop.NOT_HELD))
            else:
                reasons.append(int(WriteDrop.GAP))
        return landed, reasons

    def apply_write(self, slot_ids: list, owners: list, tokens: list, landed: list) -> None:
        """Store the landed tokens and raise their pages' stamps, on the state as it is now (a
        write decided before another writer ran stores after it: the stamp only grows)."""
        for sid, owner, token, ok in zip(slot_ids, owners, tokens, landed):
            if ok:
                page, slot = divmod(sid, self.page_size)
                ps = self.pages[page]
                ps.slots[slot] = (owner, token)
                ps.valid_len = max(self._prefix(page), slot + 1)
                ps.state = WRITTEN

    def commit(self, pages: list, owners: list, lens: list) -> tuple[list, list]:
        """``commit_pages``: returns ``(landed, reasons)`` per page and applies the landed ones."""
        n = len(pages)
        in_range = [0 <= p < self.num_pages for p in pages]
        held = [in_range[i] and self._held(pages[i], owners[i]) for i in range(n)]
        good = [0 <= length <= self.page_size for length in lens]
        landed = [held[i] and good[i] for i in range(n)]
        reasons = [
            0
            if landed[i]
            else int(WriteDrop.OUT_OF_RANGE)
            if not in_range[i]
            else int(WriteDrop.NOT_HELD)
            if not held[i]
            else int(WriteDrop.BAD_LENGTH)
            for i in range(n)
        ]
        for i in range(n):
            if landed[i]:
                ps = self.pages[pages[i]]
                ps.valid_len = max(self._prefix(pages[i]), lens[i])
                ps.state = WRITTEN
        return landed, reasons

    def check_invariant(self) -> None:
        """Every slot a tag certifies holds bytes written for the tag's owner."""
        for p, ps in enumerate(self.pages):
            if ps.state == WRITTEN:
                for s in range(ps.valid_len):
                    cell = ps.slots[s]
                    assert cell is not None and cell[0] == ps.owner, (
                        f"page {p} slot {s}: tag WRITTEN(owner={ps.owner}, valid_len="
                        f"{ps.valid_len}) but the slot holds {cell}"
                    )

    # --- the reader's rule -------------------------------------------------------------------

    def read(self, row: list, seq_len: int, expected: list) -> tuple[list, list]:
        """``(page_reasons, allowed)`` for one sequence: a Violation value per logical page (0 when
        accepted or not read) and the ``(page, slot)`` pairs that may contribute, in token order."""
        size = self.page_size
        reasons, allowed = [], []
        for i, p in enumerate(row):
            slots_read = min(size, max(0, seq_len - i * size))
            if slots_read == 0:
                reasons.append(0)
                continue
            if not 0 <= p < self.num_pages:
                reasons.append(int(Violation.OUT_OF_RANGE))
                continue
            ps = self.pages[p]
            if ps.state == FREE:
                reason = Violation.FREE
            elif ps.state == RESERVED:
                reason = Violation.RESERVED
            elif ps.owner != expected[i]:
                reason = Violation.OWNER_MISMATCH
            elif ps.valid_len < slots_read:
                reason = Violation.UNWRITTEN
            else:
                reason = Violation.NONE
            reasons.append(int(reason))
            if ps.state == WRITTEN and ps.owner == expected[i]:
                allowed += [(p, s) for s in range(min(slots_read, ps.valid_len))]
        return reasons, allowed
