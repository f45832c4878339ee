"""kvattn.PagedKVCache: owner ids, reserve/append/free, prefix sharing, batches, and decode over leases
against attention over exactly the tokens each lease appended. Pools are NaN-poisoned first."""

import threading

import pytest
import torch

import kvattn
from kvattn import Violation
from kvattn_testing.util import DEVICE, backends_under_test, raises, tolerance

PAGE, HEADS, KV_HEADS, DIM = 4, 4, 2, 16
DECODE_BACKENDS = [b for b in backends_under_test() if b in ("reference", "triton", "cuda")]


def make_cache(num_pages=8, layout="NHD", dtype=torch.float32):
    cache = kvattn.PagedKVCache(
        num_pages, PAGE, KV_HEADS, DIM, dtype=dtype, device=DEVICE, layout=layout
    )
    cache.k_cache.fill_(float("nan"))
    cache.v_cache.fill_(float("nan"))
    return cache


class Tokens:
    """Distinct K/V per appended token, remembered per lease so attention can be recomputed from
    what each lease wrote rather than from the pool."""

    def __init__(self, seed=0):
        self.g = torch.Generator().manual_seed(seed)
        self.written: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def append(self, cache, lease, count):
        k = torch.randn(count, KV_HEADS, DIM, generator=self.g).to(cache.k_cache.dtype).to(DEVICE)
        v = torch.randn(count, KV_HEADS, DIM, generator=self.g).to(cache.k_cache.dtype).to(DEVICE)
        result = cache.append(lease, k, v)
        self.written.setdefault(lease.owner, []).extend(zip(k, v))
        return result, k, v


def attention(q, kv_rows):
    """float64 softmax attention of one query ``[H, D]`` over ``kv_rows`` (``[(k [Hkv, D],
    v [Hkv, D])]``); GQA by head groups; zeros when there is nothing to attend."""
    if not kv_rows:
        return torch.zeros(q.shape, dtype=torch.float64)
    k = torch.stack([r[0] for r in kv_rows]).double().cpu()  # [N, Hkv, D]
    v = torch.stack([r[1] for r in kv_rows]).double().cpu()
    group = q.shape[0] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # [N, H, D]
    v = v.repeat_interleave(group, dim=1)
    logits = torch.einsum("hd,nhd->hn", q.double().cpu(), k) * DIM**-0.5
    return torch.einsum("hn,nhd->hd", torch.softmax(logits, dim=-1), v)


def query(batch, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, HEADS, DIM, generator=g).to(dtype).to(DEVICE)


def page_tags(cache, pages):
    return [int(cache.page_tags[p]) for p in pages]


# --- owners and allocation -----------------------------------------------------------------------


def test_owner_ids_strictly_increase_across_allocate_free_share_cycles():
    cache = make_cache()
    tokens = Tokens()
    owners = []
    for _ in range(4):
        a = cache.allocate(3)
        tokens.append(cache, a, PAGE + 1)
        b = cache.share_prefix(a, PAGE)
        c = cache.allocate(0)
        owners += [a.owner, b.owner, c.owner]
        for lease in (b, a, c):
            cache.free(lease)
    assert all(x < y for x, y in zip(owners, owners[1:])), owners
    assert owners[0] >= 1
    assert cache.num_free_pages == 8


def test_allocate_reserves_pages_for_a_fresh_owner():
    cache = make_cache()
    a = cache.allocate(PAGE + 1)
    b = cache.allocate(0)
    assert len(a.pages) == 2 and b.pages == []
    assert a.page_owners == [a.owner] * 2
    assert a.num_tokens == 0 and not a.freed
    assert page_tags(cache, a.pages) == [kvattn.reserved_tag(a.owner)] * 2
    assert cache.num_free_pages == 6
    untouched = [p for p in range(8) if p not in a.pages]
    assert page_tags(cache, untouched) == [kvattn.FREE_TAG] * 6


@pytest.mark.parametrize("backend", DECODE_BACKENDS)
def test_reading_reserved_pages_is_refused(backend):
    """Incident 1 in small: the host believes the reserved tokens are there; the tags say RESERVED."""
    cache = make_cache()
    a = cache.allocate(3 * PAGE)
    table, _, expected = cache.batch([a])
    seq_lens = torch.tensor([3 * PAGE], dtype=torch.int32, device=DEVICE)
    out, report = kvattn.paged_decode(
        query(1),
        cache.k_cache,
        cache.v_cache,
        table,
        seq_lens,
        cache.page_tags,
        expected,
        backend=backend,
    )
    assert report.violations.tolist() == [3]
    assert report.reasons.tolist() == [int(Violation.RESERVED)]
    assert torch.equal(out.cpu(), torch.zeros_like(out.cpu()))


# --- append --------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_append_writes_stamps_and_grows(layout):
    cache = make_cache(layout=layout)
    if layout == "HND":
        assert cache.k_cache.stride()[1:] == (DIM, PAGE * DIM, 1)
    tokens = Tokens()
    lease = cache.allocate(2)
    assert len(lease.pages) == 1
    result, k, v = tokens.append(cache, lease, PAGE + 2)
    assert result.dropped_count() == 0 and bool(result.landed.all())
    assert len(lease.pages) == 2 and lease.num_tokens == PAGE + 2
    assert page_tags(cache, lease.pages) == [
        kvattn.written_tag(lease.owner, PAGE),
        kvattn.written_tag(lease.owner, 2),
    ]
    for t in range(PAGE + 2):
        page, slot = lease.pages[t // PAGE], t % PAGE
        assert torch.equal(cache.k_cache[page, slot], k[t])
        assert torch.equal(cache.v_cache[page, slot], v[t])
    assert torch.isnan(cache.k_cache[lease.pages[1], 2:]).all()
    result, k2, _ = tokens.append(cache, lease, 3)
    assert result.dropped_count() == 0
    assert page_tags(cache, lease.pages) == [kvattn.written_tag(lease.owner, PAGE)] * 2 + [
        kvattn.written_tag(lease.owner, 1)
    ]
    assert torch.equal(cache.k_cache[lease.pages[2], 0], k2[2])


def test_append_to_pages_released_behind_the_allocator_is_dropped():
    cache = make_cache()
    tokens = Tokens()
    lease = cache.allocate(PAGE)
    kvattn.release_pages(cache.page_tags, lease.pages)
    result, _, _ = tokens.append(cache, lease, 2)
    assert result.dropped_count() == 2
    assert result.drop_reasons.tolist() == [int(kvattn.WriteDrop.NOT_HELD)] * 2
    assert torch.isnan(cache.k_cache).all() and torch.isnan(cache.v_cache).all()
    assert page_tags(cache, lease.pages) == [kvattn.FREE_TAG]


# --- free ----------------------------------------------------------------------------------------


def test_free_releases_pages_keeps_bytes_and_reuses_them_first():
    cache = make_cache()
    tokens = Tokens()
    a = cache.allocate(0)
    tokens.append(cache, a, 2 * PAGE)
    k_before = cache.k_cache.clone()
    cache.free(a)
    assert a.freed
    assert page_tags(cache, a.pages) == [kvattn.FREE_TAG] * 2
    assert cache.num_free_pages == 8
    assert torch.equal(cache.k_cache.nan_to_num(7.0), k_before.nan_to_num(7.0))
    b = cache.allocate(2 * PAGE)
    assert b.pages == a.pages
    assert page_tags(cache, b.pages) == [kvattn.reserved_tag(b.owner)] * 2


@pytest.mark.parametrize("backend", DECODE_BACKENDS)
def test_stale_lease_after_reuse_is_refused_while_the_new_lease_reads_clean(backend):
    cache = make_cache()
    tokens = Tokens()
    a = cache.allocate(0)
    tokens.append(cache, a, PAGE + 1)
    table_a, lens_a, expected_a = cache.batch([a])
    cache.free(a)
    b = cache.allocate(0)
    tokens.append(cache, b, PAGE + 1)
    assert b.pages == a.pages
    q = query(1)
    out, report = cache.decode(q, [b], backend=backend)
    assert report.violations.tolist() == [0]
    torch.testing.assert_close(
        out[0].double().cpu(), attention(q[0], tokens.written[b.owner]), **tolerance(torch.float32)
    )
    out, report = kvattn.paged_decode(
        q,
        cache.k_cache,
        cache.v_cache,
        table_a,
        lens_a,
        cache.page_tags,
        expected_a,
        backend=backend,
    )
    assert report.violations.tolist() == [2]
    assert report.page_reasons[0, :2].tolist() == [int(Violation.OWNER_MISMATCH)] * 2
    assert torch.equal(out.cpu(), torch.zeros_like(out.cpu()))


# --- prefix sharing ------------------------------------------------------------------------------


def test_share_prefix_shares_only_full_written_pages():
    cache = make_cache(num_pages=10)
    tokens = Tokens()
    parent = cache.allocate(3 * PAGE)
    tokens.append(cache, parent, PAGE + 3)  # one full page, one partial, one reserved
    child = cache.share_prefix(parent, 3 * PAGE)
    assert child.pages == parent.pages[:1]
    assert child.page_owners == [parent.owner]
    assert child.num_tokens == PAGE
    assert child.owner > parent.owner
    tokens.append(cache, parent, 1)  # the partial page is full now
    short = cache.share_prefix(parent, PAGE + 3)  # asks for less than two full pages
    assert short.pages == parent.pages[:1] and short.num_tokens == PAGE
    full = cache.share_prefix(parent, 2 * PAGE, capacity=3 * PAGE)
    assert full.pages[:2] == parent.pages[:2] and len(full.pages) == 3
    assert full.pages[2] not in parent.pages
    assert full.page_owners == [parent.owner, parent.owner, full.owner]
    assert page_tags(cache, full.pages[2:]) == [kvattn.reserved_tag(full.owner)]


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("backend", DECODE_BACKENDS)
def test_shared_pages_survive_the_parent_and_are_released_after_both(layout, backend):
    cache = make_cache(layout=layout)
    tokens = Tokens()
    parent = cache.allocate(0)
    tokens.append(cache, parent, 2 * PAGE + 1)
    child = cache.share_prefix(parent, 2 * PAGE)
    tokens.append(cache, child, 2)
    shared, parent_only = parent.pages[:2], parent.pages[2]
    assert child.pages[2] != parent_only
    heir = cache.free(parent)
    # The shared pages pass to a fresh owner (the parent's late writes must not land there) and the
    # child's expected owners follow.
    assert heir is not None and heir > child.owner
    assert page_tags(cache, shared) == [kvattn.written_tag(heir, PAGE)] * 2
    assert child.page_owners[:2] == [heir, heir]
    assert page_tags(cache, [parent_only]) == [kvattn.FREE_TAG]
    q = query(1)
    out, report = cache.decode(q, [child], backend=backend)
    assert report.violations.tolist() == [0]
    assert report.pages_checked.tolist() == [3]
    rows = tokens.written[parent.owner][: 2 * PAGE] + tokens.written[child.owner]
    torch.testing.assert_close(
        out[0].double().cpu(), attention(q[0], rows), **tolerance(torch.float32)
    )
    cache.free(child)
    assert page_tags(cache, child.pages) == [kvattn.FREE_TAG] * 3
    assert cache.num_free_pages == 8


@pytest.mark.parametrize("backend", DECODE_BACKENDS)
def test_prefix_page_passes_only_for_the_owner_it_was_written_under(backend):
    """docs/ownership.md 6.5: the shared page was written under lease X (the parent); the child's
    entry expecting X passes; expecting the child's own owner, a dead owner or a never-issued one
    fails."""
    cache = make_cache()
    tokens = Tokens()
    dead = cache.allocate(0)
    cache.free(dead)
    parent = cache.allocate(0)
    tokens.append(cache, parent, PAGE)
    child = cache.share_prefix(parent, PAGE)
    tokens.append(cache, child, 3)
    q = query(1)
    table, seq_lens, expected = cache.batch([child])
    assert expected.tolist() == [[parent.owner, child.owner]]
    out, report = cache.decode(q, [child], backend=backend)
    assert report.violations.tolist() == [0]
    rows = tokens.written[parent.owner] + tokens.written[child.owner]
    torch.testing.assert_close(
        out[0].double().cpu(), attention(q[0], rows), **tolerance(torch.float32)
    )
    own_rows = tokens.written[child.owner]
    for wrong in (child.owner, dead.owner, child.owner + 100):
        bad = expected.clone()
        bad[0, 0] = wrong
        out, report = kvattn.paged_decode(
            q, cache.k_cache, cache.v_cache, table, seq_lens, cache.page_tags, bad, backend=backend
        )
        assert report.violations.tolist() == [1], wrong
        assert report.page_reasons.tolist() == [[int(Violation.OWNER_MISMATCH), 0]]
        torch.testing.assert_close(
            out[0].double().cpu(), attention(q[0], own_rows), **tolerance(torch.float32)
        )
    per_sequence = torch.tensor([child.owner], dtype=torch.int64, device=DEVICE)
    _, report = kvattn.paged_decode(
        q,
        cache.k_cache,
        cache.v_cache,
        table,
        seq_lens,
        cache.page_tags,
        per_sequence,
        backend=backend,
    )
    assert report.reasons.tolist() == [int(Violation.OWNER_MISMATCH)]


# --- batch and decode ----------------------------------------------------------------------------


def test_batch_builds_table_lengths_and_per_entry_owners():
    cache = make_cache()
    tokens = Tokens()
    a = cache.allocate(0)
    tokens.append(cache, a, 2 * PAGE + 1)
    b = cache.share_prefix(a, PAGE)
    tokens.append(cache, b, 1)
    c = cache.allocate(0)
    table, seq_lens, expected = cache.batch([a, b, c])
    assert table.dtype == torch.int32 and seq_lens.dtype == torch.int32
    assert expected.dtype == torch.int64
    assert table.tolist() == [a.pages, b.pages + [0], [0, 0, 0]]
    assert seq_lens.tolist() == [2 * PAGE + 1, PAGE + 1, 0]
    assert expected.tolist() == [[a.owner] * 3, [a.owner, b.owner, 0], [0, 0, 0]]


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("backend", DECODE_BACKENDS)
def test_decode_over_leases_matches_the_reference_and_the_written_tokens(layout, backend):
    cache = make_cache(num_pages=10, layout=layout)
    tokens = Tokens()
    leases = [cache.allocate(0) for _ in range(3)]
    for lease, count in zip(leases, (1, PAGE, 2 * PAGE + 3)):
        tokens.append(cache, lease, count)
    empty = cache.allocate(PAGE)
    leases.append(empty)
    q = query(len(leases))
    out, lse, report = cache.decode(q, leases, backend=backend, return_lse=True)
    table, seq_lens, expected = cache.batch(leases)
    ref_out, ref_lse, ref_report = kvattn.reference.paged_decode(
        q, cache.k_cache, cache.v_cache, table, seq_lens, cache.page_tags, expected, return_lse=True
    )
    torch.testing.assert_close(out.float(), ref_out, **tolerance(torch.float32))
    torch.testing.assert_close(lse, ref_lse, **tolerance(torch.float32))
    for field in ("violations", "reasons", "pages_checked", "page_reasons"):
        assert torch.equal(getattr(report, field), getattr(ref_report, field)), field
    assert report.violations.tolist() == [0] * 4
    assert report.pages_checked.tolist() == [1, 1, 3, 0]
    for b, lease in enumerate(leases):
        rows = tokens.written.get(lease.owner, [])
        torch.testing.assert_close(
            out[b].double().cpu(), attention(q[b], rows), **tolerance(torch.float32)
        )
    assert lse[3].tolist() == [float("-inf")] * HEADS


# --- failures ------------------------------------------------------------------------------------


def test_pool_exhaustion_raises_and_changes_nothing():
    cache = make_cache(num_pages=4)
    tokens = Tokens()
    a = cache.allocate(0)
    tokens.append(cache, a, 3 * PAGE)
    tags_before = cache.page_tags.clone()
    with pytest.raises(RuntimeError, match="exhausted"):
        cache.allocate(2 * PAGE)
    with pytest.raises(RuntimeError, match="exhausted"):
        tokens.append(cache, a, PAGE + 1)
    with pytest.raises(RuntimeError, match="exhausted"):
        cache.grow(a, 5 * PAGE)
    assert cache.num_free_pages == 1 and len(a.pages) == 3 and a.num_tokens == 3 * PAGE
    assert torch.equal(cache.page_tags, tags_before)
    b = cache.allocate(PAGE)
    assert len(b.pages) == 1 and cache.num_free_pages == 0


def test_failed_share_prefix_leaks_no_page():
    cache = make_cache(num_pages=4)
    tokens = Tokens()
    parent = cache.allocate(0)
    tokens.append(cache, parent, 2 * PAGE)
    with pytest.raises(RuntimeError, match="exhausted"):
        cache.share_prefix(parent, 2 * PAGE, capacity=10 * PAGE)
    cache.free(parent)
    assert cache.num_free_pages == 4
    assert page_tags(cache, parent.pages) == [kvattn.FREE_TAG] * 2


def test_a_freed_lease_cannot_be_used():
    cache = make_cache()
    tokens = Tokens()
    lease = cache.allocate(0)
    tokens.append(cache, lease, 2)
    cache.free(lease)
    free_before = cache.num_free_pages
    with pytest.raises(ValueError, match="lease"):
        tokens.append(cache, lease, 1)
    with pytest.raises(ValueError, match="lease"):
        cache.grow(lease, 3 * PAGE)
    with pytest.raises(ValueError, match="lease"):
        cache.free(lease)
    with pytest.raises(ValueError, match="lease"):
        cache.share_prefix(lease, 1)
    assert cache.num_free_pages == free_before
    assert int(cache.page_tags.abs().sum()) == 0


def test_cache_validates_dtype_and_layout():
    with pytest.raises(TypeError, match="dtype"):
        kvattn.PagedKVCache(4, PAGE, KV_HEADS, DIM, dtype=torch.int8)
    with pytest.raises(ValueError, match="layout"):
        kvattn.PagedKVCache(4, PAGE, KV_HEADS, DIM, layout="HDN")


@pytest.mark.parametrize("backend", DECODE_BACKENDS)
def test_late_write_of_a_freed_parent_cannot_touch_the_shared_prefix(backend):
    """Incident 2 on a shared prefix: the parent is aborted while a write of its own is in flight;
    the child still reads the parent's pages. The late write (an overwrite under the parent's owner)
    is refused, and the child's output is what it was."""
    cache = make_cache()
    tokens = Tokens()
    parent = cache.allocate(0)
    tokens.append(cache, parent, 2 * PAGE)
    child = cache.share_prefix(parent, 2 * PAGE)
    tokens.append(cache, child, 1)
    q = query(1)
    before, _ = cache.decode(q, [child], backend=backend)
    late_slots = cache.slot_mapping(parent, 0, 2)
    cache.free(parent)
    garbage = torch.full(
        (2, cache.k_cache.shape[2], cache.k_cache.shape[3]),
        100.0,
        dtype=cache.k_cache.dtype,
        device=cache.device,
    )
    late = kvattn.write_kv(
        garbage, garbage, cache.k_cache, cache.v_cache, late_slots, cache.page_tags, parent.owner
    )
    assert late.dropped_count() == 2
    assert set(late.drop_reasons.tolist()) == {int(kvattn.WriteDrop.NOT_HELD)}
    after, report = cache.decode(q, [child], backend=backend)
    assert report.violations.tolist() == [0]
    assert torch.equal(after, before)


def test_late_write_twin_lands_while_the_parent_lives():
    """The twin: the same overwrite while the parent still holds its pages lands (so the test above
    is refusing something that would otherwise happen)."""
    cache = make_cache()
    tokens = Tokens()
    parent = cache.allocate(0)
    tokens.append(cache, parent, 2 * PAGE)
    cache.share_prefix(parent, 2 * PAGE)
    garbage = torch.full(
        (2, cache.k_cache.shape[2], cache.k_cache.shape[3]),
        100.0,
        dtype=cache.k_cache.dtype,
        device=cache.device,
    )
    late = kvattn.write_kv(
        garbage,
        garbage,
        cache.k_cache,
        cache.v_cache,
        cache.slot_mapping(parent, 0, 2),
        cache.page_tags,
        parent.owner,
    )
    assert late.dropped_count() == 0


# --- hostile use: owners across caches, foreign leases, geometry, counts -----------------------


def small_cache(**kwargs):
    return kvattn.PagedKVCache(
        **{**dict(num_pages=4, page_size=4, num_kv_heads=1, head_dim=16), **kwargs}
    )


def test_owner_ids_are_unique_across_caches_and_threads():
    caches = [small_cache(num_pages=64) for _ in range(4)]
    owners, lock = [], threading.Lock()

    def allocate(c):
        got = [c.allocate(0).owner for _ in range(50)]
        with lock:
            owners.extend(got)

    threads = [threading.Thread(target=allocate, args=(c,)) for c in caches]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(owners) == len(set(owners)) == 200


def _lease_misuses(b, lease):
    k = torch.zeros(1, 1, 16, dtype=torch.float16)
    q = torch.zeros(1, 2, 16, dtype=torch.float16)
    return {
        "append": lambda: b.append(lease, k, k),
        "grow": lambda: b.grow(lease, 8),
        "free": lambda: b.free(lease),
        "share_prefix": lambda: b.share_prefix(lease, 4),
        "batch": lambda: b.batch([lease]),
        "decode": lambda: b.decode(q, [lease]),
        "slot_mapping": lambda: b.slot_mapping(lease, 0, 1),
    }


@pytest.mark.parametrize(
    "use", ["append", "grow", "free", "share_prefix", "batch", "decode", "slot_mapping"]
)
def test_a_lease_of_another_cache_is_refused(use):
    """Cache A's lease used on cache B: before, both started at owner 1, so A's lease landed in B's
    lease of the same id and B then read A's tokens as its own."""
    a, b = small_cache(), small_cache()
    lease = a.allocate(4)
    mine = b.allocate(4)
    tags_before = b.page_tags.clone()
    with raises(ValueError, "lease", "issued by this cache", str(lease.owner)):
        _lease_misuses(b, lease)[use]()
    assert torch.equal(b.page_tags, tags_before) and b.num_free_pages == 3
    assert mine.owner != lease.owner


def test_a_hand_made_lease_is_refused_and_a_non_lease_is_a_type_error():
    c = small_cache()
    real = c.allocate(4)
    fake = kvattn.Lease(
        owner=real.owner, pages=list(real.pages), page_owners=list(real.page_owners)
    )
    with raises(ValueError, "lease", "issued by this cache"):
        c.append(
            fake,
            torch.zeros(1, 1, 16, dtype=torch.float16),
            torch.zeros(1, 1, 16, dtype=torch.float16),
        )
    with raises(TypeError, "lease", "Lease", "dict"):
        c.batch([{"owner": real.owner}])


def test_the_issuing_cache_takes_its_own_leases():
    """The twin: every use above runs on the cache that issued the lease."""
    c = small_cache()
    lease = c.allocate(4)
    k = torch.randn(2, 1, 16).to(torch.float16)
    assert c.append(lease, k, k).dropped_count() == 0
    c.grow(lease, 8)
    assert c.slot_mapping(lease, 0, 2).tolist() == [lease.pages[0] * 4, lease.pages[0] * 4 + 1]
    child = c.share_prefix(lease, 4)
    out, report = c.decode(torch.randn(1, 2, 16).to(torch.float16), [lease], backend="reference")
    assert not report.any() and torch.isfinite(out).all()
    c.free(child)
    c.free(lease)
    with raises(ValueError, "lease", "already freed"):
        c.free(lease)
    assert c.batch([lease])[1].tolist() == [2]  # a stale lease of this cache may still be read


@pytest.mark.parametrize(
    "field, value, error, words",
    [
        ("num_pages", 0, ValueError, ["num_pages", ">= 1", "0"]),
        ("num_pages", -3, ValueError, ["num_pages", "-3"]),
        ("page_size", 1025, ValueError, ["page_size", "[1, 1024]", "1025"]),
        ("page_size", -2, ValueError, ["page_size", "-2"]),
        ("page_size", 0, ValueError, ["page_size", "0"]),
        ("num_kv_heads", 0, ValueError, ["num_kv_heads", "0"]),
        ("head_dim", 0, ValueError, ["head_dim", "0"]),
        ("head_dim", True, TypeError, ["head_dim", "bool"]),
        ("page_size", 2.5, TypeError, ["page_size", "float"]),
        ("num_pages", "8", TypeError, ["num_pages", "str"]),
    ],
)
def test_cache_geometry_is_validated_at_construction(field, value, error, words):
    with raises(error, *words):
        small_cache(**{field: value})


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda c, lease: c.allocate(-5), ValueError, ["num_tokens", ">= 0", "-5"]),
        (lambda c, lease: c.allocate(True), TypeError, ["num_tokens", "bool"]),
        (lambda c, lease: c.allocate(2.5), TypeError, ["num_tokens", "float"]),
        (lambda c, lease: c.grow(lease, -1), ValueError, ["num_tokens", "-1"]),
        (lambda c, lease: c.share_prefix(lease, -4), ValueError, ["num_tokens", "-4"]),
        (lambda c, lease: c.share_prefix(lease, 4, capacity=-1), ValueError, ["capacity", "-1"]),
        (lambda c, lease: c.slot_mapping(lease, -1, 1), ValueError, ["start", "-1"]),
        (lambda c, lease: c.slot_mapping(lease, 2, 3), ValueError, ["count", "1 page(s)"]),
    ],
)
def test_bad_token_counts_raise(call, error, words):
    c = small_cache()
    lease = c.allocate(4)
    free_before = c.num_free_pages
    with raises(error, *words):
        call(c, lease)
    assert c.num_free_pages == free_before


def test_good_token_counts_are_accepted():
    """The twin: zero and in-range counts work."""
    c = small_cache()
    assert c.allocate(0).pages == [] and len(c.allocate(5).pages) == 2
    lease = c.allocate(4)
    c.grow(lease, 0)
    assert c.slot_mapping(lease, 1, 3).shape == (3,) and c.slot_mapping(lease, 4, 0).shape == (0,)
