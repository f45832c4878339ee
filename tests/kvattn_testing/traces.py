"""Traces of paged-KV operations applied side by side to kvattn's cache and writers and to the
plain-Python model of page states (:mod:`kvattn_testing.page_model`; docs/ownership.md 6.8), for the
trace and fuzz tests: :class:`Trace` (the operations, and the checks that state and decodes match
the model), the steps of a random trace drawn by Hypothesis (:func:`_prefill`, :func:`_step`,
:func:`_decode_step`, :func:`_stray_slots`), and :class:`Interleave`, which runs another operation
at the moment a spied call first writes into a tensor (the writers' races).
"""

from __future__ import annotations

import functools
import operator

import pytest
import torch
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import kvattn
from kvattn_testing.page_model import RESERVED, WRITTEN, PageModel
from kvattn_testing.util import DEVICE, backends_under_test, precise_dtype, tolerance

NUM_PAGES, HEADS, KV_HEADS, DIM = 8, 2, 1, 16
MAX_TOKENS = 1024
DECODE_BACKENDS = [
    b for b in backends_under_test() if b in ("reference", "triton", "cuda", "cuda_sim")
]


def _signatures():
    """K small enough that every allowed slot keeps a visible softmax weight (|logit| stays ~1);
    V a one-hot per token plus noise, so any extra or missing slot moves the output far beyond the
    float32 tolerance."""
    g = torch.Generator().manual_seed(1234)
    k = 0.5 * torch.randn(MAX_TOKENS, KV_HEADS, DIM, generator=g)
    onehot = torch.nn.functional.one_hot(torch.arange(MAX_TOKENS) % DIM, DIM).float()
    v = onehot[:, None, :] + 0.5 * torch.randn(MAX_TOKENS, KV_HEADS, DIM, generator=g)
    return k, v


K_SIG, V_SIG = _signatures()


def _bits(t):
    return t.cpu().contiguous().view(torch.int32)


class Trace:
    """The real cache and the model side by side. Leases are named by their owner id."""

    def __init__(self, page_size, layout="NHD"):
        self.page_size = page_size
        self.cache = kvattn.PagedKVCache(
            NUM_PAGES, page_size, KV_HEADS, DIM, dtype=torch.float32, device=DEVICE, layout=layout
        )
        self.cache.k_cache.fill_(float("nan"))
        self.cache.v_cache.fill_(float("nan"))
        self.model = PageModel(NUM_PAGES, page_size)
        self.leases: dict[int, kvattn.Lease] = {}
        self.pending = []  # late operations of aborted leases: (kind, owner, slot ids | pages, ...)
        self.next_token = 0

    # --- helpers -----------------------------------------------------------------------------

    def live(self):
        return sorted(o for o, m in self.model.leases.items() if m.live)

    def dead(self):
        return sorted(o for o, m in self.model.leases.items() if not m.live)

    def tokens(self, count):
        ids = list(range(self.next_token, self.next_token + count))
        self.next_token += count
        assert self.next_token <= MAX_TOKENS
        return ids

    @staticmethod
    def signatures(ids):
        return K_SIG[ids].to(DEVICE), V_SIG[ids].to(DEVICE)

    def raw_write(self, owner, slot_ids, ids):
        """Bytes landing by another path (an RDMA transfer): straight into the pool, no tag."""
        k, v = self.signatures(ids)
        for j, sid in enumerate(slot_ids):
            page, slot = divmod(sid, self.page_size)
            self.cache.k_cache[page, slot] = k[j]
            self.cache.v_cache[page, slot] = v[j]
            self.model.raw_write(page, slot, owner, ids[j])

    def accounted_pages(self, slot_ids):
        """Per page touched, the end of the accounted tokens in it (what a receiver commits)."""
        ends = {}
        for sid in slot_ids:
            page, slot = divmod(sid, self.page_size)
            ends[page] = max(ends.get(page, 0), slot + 1)
        return list(ends), list(ends.values())

    @staticmethod
    def assert_result(result, landed, reasons):
        assert result.landed.tolist() == landed
        assert result.drop_reasons.tolist() == reasons
        assert result.dropped_count() == sum(r != 0 for r in reasons)

    def grow(self, owner, num_tokens):
        """Grow a lease if the model says the pool has room, else check that the cache refuses."""
        m, real = self.model.leases[owner], self.leases[owner]
        if self.model.pages_needed(m, num_tokens) > self.model.free_page_count():
            with pytest.raises(RuntimeError, match="exhausted"):
                self.cache.grow(real, num_tokens)
            return False
        before = len(real.pages)
        self.cache.grow(real, num_tokens)
        self.model.take(m, real.pages[before:])
        return True

    # --- operations --------------------------------------------------------------------------

    def allocate(self, num_tokens):
        if -(-num_tokens // self.page_size) > self.model.free_page_count():
            with pytest.raises(RuntimeError, match="exhausted"):
                self.cache.allocate(num_tokens)
            return None
        lease = self.cache.allocate(num_tokens)
        self.leases[lease.owner] = lease
        self.model.new_lease(lease.owner, list(lease.pages))
        return lease.owner

    def append(self, owner, count):
        m, real = self.model.leases[owner], self.leases[owner]
        ids = self.tokens(count)
        k, v = self.signatures(ids)
        if self.model.pages_needed(m, m.num_tokens + count) > self.model.free_page_count():
            with pytest.raises(RuntimeError, match="exhausted"):
                self.cache.append(real, k, v)
            return None
        before = len(real.pages)
        result = self.cache.append(real, k, v)
        self.model.take(m, real.pages[before:])
        expected = self.model.write(
            self.model.slot_ids(m, m.num_tokens, count), [owner] * count, ids
        )
        m.num_tokens += count
        self.assert_result(result, *expected)
        return result

    def transfer(self, owner, accounted, extra, stale=None):
        """Transfer receive: ``accounted + extra`` tokens' bytes arrive; the receiver accounted for
        ``accounted`` of them and commits exactly those. ``stale`` (a fraction) adds a repeated,
        older completion for the lease's first page, with a length at most what that page
        already holds: it must not lower ``valid_len``."""
        m, real = self.model.leases[owner], self.leases[owner]
        if not self.grow(owner, m.num_tokens + accounted + extra):
            return None
        slot_ids = self.model.slot_ids(m, m.num_tokens, accounted + extra)
        self.raw_write(owner, slot_ids, self.tokens(len(slot_ids)))
        pages, lens = self.accounted_pages(slot_ids[:accounted])
        if stale is not None:
            first = self.model.pages[m.pages[0]]
            pages.append(m.pages[0])
            lens.append(int(stale * first.valid_len) if first.state == WRITTEN else 0)
        result = kvattn.commit_pages(self.cache.page_tags, pages, owner, lens, self.page_size)
        self.assert_result(result, *self.model.commit(pages, [owner] * len(pages), lens))
        m.num_tokens += accounted
        real.num_tokens += accounted
        return result

    def abort(self, owner, kind, count):
        """Free a lease while a write (``kind="write"``) or a transfer's commit (``"commit"``, its
        bytes already arrived) of ``count`` more tokens is in flight; replay() lands it later."""
        m = self.model.leases[owner]
        if self.grow(owner, m.num_tokens + count):
            slot_ids = self.model.slot_ids(m, m.num_tokens, count)
            if kind == "write":
                self.pending.append(("write", owner, slot_ids, self.tokens(count)))
            else:
                self.raw_write(owner, slot_ids, self.tokens(count))
                self.pending.append(("commit", owner, *self.accounted_pages(slot_ids)))
        self.free(owner)

    def replay(self, index):
        kind, owner, a, b = self.pending.pop(index)
        if kind == "write":
            k, v = self.signatures(b)
            mapping = torch.tensor(a, dtype=torch.int64, device=DEVICE)
            result = kvattn.write_kv(
                k, v, self.cache.k_cache, self.cache.v_cache, mapping, self.cache.page_tags, owner
            )
            landed, reasons = self.model.write(a, [owner] * len(a), b)
        else:
            result = kvattn.commit_pages(self.cache.page_tags, a, owner, b, self.page_size)
            landed, reasons = self.model.commit(a, [owner] * len(a), b)
        assert not any(landed), "a late writer's operation landed after its lease was freed"
        self.assert_result(result, landed, reasons)
        return result

    def free(self, owner):
        heir = self.cache.free(self.leases[owner])
        self.model.free(self.model.leases[owner], heir)

    def share(self, parent, num_tokens, capacity):
        pm = self.model.leases[parent]
        if capacity is not None:
            shared = min(num_tokens, pm.num_tokens) // self.page_size
            if -(-capacity // self.page_size) - shared > self.model.free_page_count():
                capacity = None  # a refused share is tested in test_cache.py
        child = self.cache.share_prefix(self.leases[parent], num_tokens, capacity)
        self.leases[child.owner] = child
        cm = self.model.share(pm, child.owner, num_tokens)
        self.model.take(cm, child.pages[len(cm.pages) :])
        return child.owner

    def stray(self, slot_ids, owner):
        """A writer with wrong slots or a stale owner (a host bug): lands only where the rule says."""
        ids = self.tokens(len(slot_ids))
        k, v = self.signatures(ids)
        mapping = torch.tensor(slot_ids, dtype=torch.int64, device=DEVICE)
        result = kvattn.write_kv(
            k, v, self.cache.k_cache, self.cache.v_cache, mapping, self.cache.page_tags, owner
        )
        self.assert_result(result, *self.model.write(slot_ids, [owner] * len(slot_ids), ids))
        return result

    # --- checks ------------------------------------------------------------------------------

    def check_state(self):
        model = self.model
        model.check_invariant()
        assert self.cache.num_free_pages == model.free_page_count()
        for owner, real in self.leases.items():
            m = model.leases[owner]
            assert (real.pages, real.page_owners, real.num_tokens, real.freed) == (
                m.pages,
                m.page_owners,
                m.num_tokens,
                not m.live,
            )
        tags = []
        for ps in model.pages:
            tags.append(
                kvattn.written_tag(ps.owner, ps.valid_len)
                if ps.state == WRITTEN
                else kvattn.reserved_tag(ps.owner)
                if ps.state == RESERVED
                else kvattn.FREE_TAG
            )
        assert self.cache.page_tags.tolist() == tags
        want_k = torch.full((NUM_PAGES, self.page_size, KV_HEADS, DIM), float("nan"))
        want_v = want_k.clone()
        for p, ps in enumerate(model.pages):
            for s, cell in enumerate(ps.slots):
                if cell is not None:
                    want_k[p, s], want_v[p, s] = K_SIG[cell[1]], V_SIG[cell[1]]
        assert torch.equal(_bits(self.cache.k_cache), _bits(want_k))
        assert torch.equal(_bits(self.cache.v_cache), _bits(want_v))

    def check_decode(self, owners, corruptions=(), seed=0):
        """Decode ``owners``' leases (live or stale) with ``corruptions`` applied to the batch and
        compare every backend with the model. Returns the model's page reasons per sequence."""
        size = self.page_size
        table_t, lens_t, expected_t = self.cache.batch([self.leases[o] for o in owners])
        max_pages = table_t.shape[1]
        table, seq_lens, expected = [], [], []
        for o in owners:
            m = self.model.leases[o]
            pad = max_pages - len(m.pages)
            table.append(m.pages + [0] * pad)
            seq_lens.append(m.num_tokens)
            expected.append(m.page_owners + [0] * pad)
        assert (table_t.tolist(), lens_t.tolist(), expected_t.tolist()) == (
            table,
            seq_lens,
            expected,
        )
        for c in corruptions:
            if c[0] == "swap":
                table[c[1]], table[c[2]] = table[c[2]], table[c[1]]
            elif c[0] in ("stale", "oor"):
                table[c[1]][c[2]] = c[3]
            elif c[0] == "owner":
                expected[c[1]][c[2]] = c[3]
            elif c[0] == "overlong":  # the host claims every token of the row's table
                b = c[1]
                seq_lens[b] = max_pages * size
                expected[b] = [e or owners[b] for e in expected[b]]
            else:
                raise AssertionError(c)

        verdicts = [self.model.read(table[b], seq_lens[b], expected[b]) for b in range(len(owners))]
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(len(owners), HEADS, DIM, generator=g)
        want = []
        for b, (_, allowed) in enumerate(verdicts):
            cells = [self.model.pages[p].slots[s] for p, s in allowed]
            assert all(c is not None for c in cells)
            want.append(_attention(q[b], [c[1] for c in cells]))
        want = torch.stack(want)

        args = (
            q.to(DEVICE),
            self.cache.k_cache,
            self.cache.v_cache,
            torch.tensor(table, dtype=torch.int32, device=DEVICE),
            torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
            self.cache.page_tags,
            torch.tensor(expected, dtype=torch.int64, device=DEVICE),
        )
        page_reasons = [r for r, _ in verdicts]
        for backend in DECODE_BACKENDS:
            dtype = precise_dtype(backend)  # the CUDA kernels read float16 copies of the pools
            q_, k_, v_ = (t.to(dtype) for t in args[:3])
            out, report = kvattn.paged_decode(q_, k_, v_, *args[3:], backend=backend)
            assert report.page_reasons.tolist() == page_reasons, backend
            assert report.violations.tolist() == [sum(r != 0 for r in rs) for rs in page_reasons]
            assert report.reasons.tolist() == [
                functools.reduce(operator.or_, rs, 0) for rs in page_reasons
            ], backend
            assert report.pages_checked.tolist() == [
                min(max_pages, -(-n // size)) for n in seq_lens
            ]
            assert torch.isfinite(out).all(), backend
            torch.testing.assert_close(
                out.double().cpu(), want, **tolerance(dtype), msg=lambda m: f"{backend}: {m}"
            )
        return page_reasons


def _attention(q, token_ids):
    """float64 attention of ``q`` ``[H, D]`` over the signature K/V of ``token_ids``."""
    if not token_ids:
        return torch.zeros(HEADS, DIM, dtype=torch.float64)
    k = K_SIG[token_ids].double().repeat_interleave(HEADS // KV_HEADS, dim=1)  # [N, H, D]
    v = V_SIG[token_ids].double().repeat_interleave(HEADS // KV_HEADS, dim=1)
    logits = torch.einsum("hd,nhd->hn", q.double(), k) * DIM**-0.5
    return torch.einsum("hn,nhd->hd", torch.softmax(logits, dim=-1), v)


# --- random traces -------------------------------------------------------------------------------

OPS = (
    "append",
    "append",
    "transfer",
    "transfer",
    "abort",
    "abort",
    "replay",
    "replay",
    "replay",
    "free",
    "share",
    "share",
    "stray",
    "stray",
    "stray",
    "allocate",
    "allocate",
)


def _stray_slots(t, data, target):
    """Slot ids for a stray write: positions around the end of lease ``target``'s tokens, in any
    order (overwrites, extensions and gaps), or anywhere in and past the pool, padding included."""
    size = t.page_size
    m = t.model.leases[target]
    if m.pages and data.draw(st.booleans()):
        lo = max(0, m.num_tokens - 2)
        hi = min(len(m.pages) * size, m.num_tokens + size) - 1
        positions = data.draw(
            st.lists(st.integers(min(lo, hi), hi), min_size=1, max_size=4, unique=True)
        )
        return [m.pages[x // size] * size + x % size for x in positions]
    return data.draw(
        st.lists(st.integers(-1, (NUM_PAGES + 1) * size - 1), min_size=1, max_size=4, unique=True)
    )


def _step(t, data):
    live, size = t.live(), t.page_size
    ops = [
        op
        for op in OPS
        if op == "allocate"
        or (op == "replay" and t.pending)
        or (op not in ("allocate", "replay") and live)
    ]
    op = data.draw(st.sampled_from(ops), label="op")
    if op == "allocate":
        _prefill(t, data)
    elif op == "append":
        t.append(data.draw(st.sampled_from(live)), data.draw(st.integers(1, size + 2)))
    elif op == "transfer":
        t.transfer(
            data.draw(st.sampled_from(live)),
            data.draw(st.integers(1, 2 * size)),
            data.draw(st.integers(0, 2)),
            data.draw(st.none() | st.sampled_from([0, 0.5])),
        )
    elif op == "abort":
        t.abort(
            data.draw(st.sampled_from(live)),
            data.draw(st.sampled_from(["write", "commit"])),
            data.draw(st.integers(1, size + 1)),
        )
    elif op == "replay":
        t.replay(data.draw(st.integers(0, len(t.pending) - 1)))
    elif op == "free":
        t.free(data.draw(st.sampled_from(live)))
    elif op == "share":
        parent = data.draw(st.sampled_from(live))
        num_tokens = data.draw(st.integers(0, t.model.leases[parent].num_tokens + size))
        capacity = data.draw(st.none() | st.integers(0, 3 * size))
        t.share(parent, num_tokens, capacity)
    else:
        issued = sorted(t.model.leases)
        target = data.draw(st.sampled_from(issued))
        owner = data.draw(st.sampled_from([target] * 3 + issued + [t.model.last_owner + 50]))
        t.stray(_stray_slots(t, data, target), owner)
    return op


def _prefill(t, data):
    """A new lease, usually with some tokens written right away."""
    size = t.page_size
    capacity = data.draw(st.integers(0, 3 * size))
    owner = t.allocate(capacity)
    count = data.draw(st.integers(0, capacity + 1))
    if owner is not None and count:
        t.append(owner, count)


def _decode_step(t, data, seed):
    owners = t.live()[-3:]
    dead = t.dead()
    if dead and data.draw(st.booleans()):
        owners.append(data.draw(st.sampled_from(dead)))
    if not owners:
        return
    batch = len(owners)
    max_pages = max(1, max(len(t.model.leases[o].pages) for o in owners))
    row, entry = st.integers(0, batch - 1), st.integers(0, max_pages - 1)
    issued = sorted(t.model.leases) + [t.model.last_owner + 50]
    corruption = st.one_of(
        st.tuples(st.just("swap"), row, row),
        st.tuples(st.just("stale"), row, entry, st.integers(0, NUM_PAGES - 1)),
        st.tuples(st.just("oor"), row, entry, st.sampled_from([NUM_PAGES, NUM_PAGES + 7, -1, -9])),
        st.tuples(st.just("owner"), row, entry, st.sampled_from(issued)),
        st.tuples(st.just("overlong"), row),
        st.tuples(st.just("overlong"), row),
    )
    t.check_decode(owners, data.draw(st.lists(corruption, max_size=2)), seed)


# --- races: another operation at the moment a call first writes -----------------------------------


def _written_storage(func, args, kwargs):
    """Storage pointers of the tensors an aten op writes (its mutable arguments)."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        value = args[i] if i < len(args) else (kwargs or {}).get(arg.name)
        if (
            arg.alias_info is not None
            and arg.alias_info.is_write
            and isinstance(value, torch.Tensor)
        ):
            out.append(value.untyped_storage().data_ptr())
    return out


class Interleave(TorchDispatchMode):
    """Runs ``other`` once, just before the spied call's first op that writes into ``target``: the
    moment a read-then-write-back would hold stale values. If the call writes nothing there,
    ``other`` runs after it (``finish``)."""

    def __init__(self, target: torch.Tensor, other):
        super().__init__()
        self.target, self.other, self.done = target.untyped_storage().data_ptr(), other, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.done and self.target in _written_storage(func, args, kwargs):
            self.done = True
            self.other()
        return func(*args, **(kwargs or {}))

    def finish(self):
        if not self.done:
            self.done = True
            self.other()
