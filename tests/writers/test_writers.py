"""The writers of kvattn.writers against their docstrings: what lands, what is refused and why, and that
refused bytes never reach the pool. Pools start as NaN; "untouched" is checked bit for bit."""

import pytest
import torch

import kvattn
from kvattn import WriteDrop
from kvattn_testing.util import DEVICE, backends_under_test

NUM_PAGES, PAGE, HEADS, DIM = 6, 4, 2, 16
OOR, NOT_HELD, GAP, BAD_LENGTH = (
    int(WriteDrop.OUT_OF_RANGE),
    int(WriteDrop.NOT_HELD),
    int(WriteDrop.GAP),
    int(WriteDrop.BAD_LENGTH),
)
LAYOUTS = ("NHD", "HND", "strided")
DECODE_BACKENDS = [b for b in backends_under_test() if b in ("reference", "triton", "cuda")]
_INT_OF = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}


class Pool:
    """NaN-filled K/V pools over raw buffers. ``k``/``v`` are the NHD-shaped views kvattn takes:
    NHD buffers as they are, HND buffers transposed, and ``strided``: layer 1 of a two-layer buffer
    that holds K and V side by side in its last dimension (last dimension contiguous, nothing else)."""

    def __init__(self, layout="NHD", num_pages=NUM_PAGES, page_size=PAGE, dtype=torch.float16):
        self.layout = layout
        shape = (num_pages, page_size, HEADS, DIM)
        if layout == "NHD":
            self.bufs = [torch.full(shape, float("nan"), dtype=dtype, device=DEVICE) for _ in "kv"]
        elif layout == "HND":
            shape = (num_pages, HEADS, page_size, DIM)
            self.bufs = [torch.full(shape, float("nan"), dtype=dtype, device=DEVICE) for _ in "kv"]
        elif layout == "strided":
            self.bufs = [
                torch.full((2, *shape[:3], 2 * DIM), float("nan"), dtype=dtype, device=DEVICE)
            ]
        else:
            raise AssertionError(layout)
        self.k, self.v = self.views(self.bufs)
        self.tags = torch.zeros(num_pages, dtype=torch.int64, device=DEVICE)

    def views(self, bufs):
        if self.layout == "NHD":
            return bufs[0], bufs[1]
        if self.layout == "HND":
            return bufs[0].transpose(1, 2), bufs[1].transpose(1, 2)
        return bufs[0][1, ..., :DIM], bufs[0][1, ..., DIM:]

    def snapshot(self):
        return [b.clone() for b in self.bufs]

    def expect(self, before, writes):
        """``before`` with ``writes`` (``(page, slot, k_row, v_row)``) applied through the views."""
        bufs = [b.clone() for b in before]
        k, v = self.views(bufs)
        for page, slot, k_row, v_row in writes:
            k[page, slot] = k_row
            v[page, slot] = v_row
        return bufs

    def assert_bufs(self, expected):
        for got, want in zip(self.bufs, expected):
            assert_bits_equal(got, want)


def assert_bits_equal(got, want):
    """Bitwise equality (NaN payloads included), which ``torch.equal`` cannot say of NaN."""
    int_dtype = _INT_OF[got.dtype]
    diff = got.view(int_dtype) != want.view(int_dtype)
    assert not diff.any(), (
        f"{int(diff.sum())} elements differ, first at {diff.nonzero()[0].tolist()}"
    )


def kv(num_tokens, seed=0, dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_tokens, HEADS, DIM, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(num_tokens, HEADS, DIM, generator=g).to(dtype).to(DEVICE)
    return k, v


def slots(*pairs):
    """Slot ids ``page * PAGE + slot`` from ``(page, slot)`` pairs; a bare int is used as is."""
    ids = [x[0] * PAGE + x[1] if isinstance(x, tuple) else x for x in pairs]
    return torch.tensor(ids, dtype=torch.int64, device=DEVICE)


def write(pool, k, v, slot_mapping, owner):
    return kvattn.write_kv(k, v, pool.k, pool.v, slot_mapping, pool.tags, owner)


def tag(pool, page):
    return int(pool.tags[page])


def result_lists(result):
    return result.landed.tolist(), result.drop_reasons.tolist(), result.dropped_count()


# --- write_kv: landing and stamping --------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_write_lands_in_its_slots_and_stamps_the_landed_prefix(layout):
    pool = Pool(layout)
    kvattn.reserve_pages(pool.tags, [3, 1], owner=7)
    before = pool.snapshot()
    k, v = kv(6)
    mapping = slots((3, 0), (3, 1), (3, 2), (3, 3), (1, 0), (1, 1))
    result = write(pool, k, v, mapping, 7)
    assert result_lists(result) == ([True] * 6, [0] * 6, 0)
    assert result.landed.dtype == torch.bool and result.drop_reasons.dtype == torch.int8
    assert result.dropped.dtype == torch.int64 and result.dropped.dim() == 0
    assert tag(pool, 3) == kvattn.written_tag(7, 4)
    assert tag(pool, 1) == kvattn.written_tag(7, 2)
    assert [tag(pool, p) for p in (0, 2, 4, 5)] == [kvattn.FREE_TAG] * 4
    writes = [(3, s, k[s], v[s]) for s in range(4)] + [(1, s, k[4 + s], v[4 + s]) for s in range(2)]
    pool.assert_bufs(pool.expect(before, writes))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_write_lands_bit_exact_in_every_cache_dtype(dtype):
    pool = Pool(dtype=dtype)
    kvattn.reserve_pages(pool.tags, [2], owner=1)
    before = pool.snapshot()
    k, v = kv(3, dtype=dtype)
    result = write(pool, k, v, slots((2, 0), (2, 1), (0, 0)), 1)
    assert result_lists(result) == ([True, True, False], [0, 0, NOT_HELD], 1)
    pool.assert_bufs(pool.expect(before, [(2, 0, k[0], v[0]), (2, 1, k[1], v[1])]))


def test_write_lands_in_raw_hnd_and_strided_positions():
    hnd = Pool("HND")
    kvattn.reserve_pages(hnd.tags, [2], owner=1)
    k, v = kv(2)
    write(hnd, k, v, slots((2, 0), (2, 1)), 1)
    for head in range(HEADS):
        assert torch.equal(hnd.bufs[0][2, head, 1], k[1, head])  # [num_pages, heads, page, dim]
        assert torch.equal(hnd.bufs[1][2, head, 0], v[0, head])
    strided = Pool("strided")
    kvattn.reserve_pages(strided.tags, [2], owner=1)
    write(strided, k, v, slots((2, 0), (2, 1)), 1)
    assert torch.equal(strided.bufs[0][1, 2, 1, :, :DIM], k[1])
    assert torch.equal(strided.bufs[0][1, 2, 1, :, DIM:], v[1])
    assert torch.isnan(strided.bufs[0][0]).all()  # the other layer of the buffer


@pytest.mark.parametrize("layout", LAYOUTS)
def test_write_to_pages_not_held_is_dropped_and_touches_nothing(layout):
    pool = Pool(layout)
    kvattn.reserve_pages(pool.tags, [3], owner=7)
    kvattn.reserve_pages(pool.tags, [1], owner=8)
    tags_before, before = pool.tags.clone(), pool.snapshot()
    k, v = kv(6)
    mapping = slots(
        (3, 0), (3, 1), (1, 0), (1, 1), (4, 0), (4, 1)
    )  # owner 8's page, then a FREE one
    result = write(pool, k, v, mapping, 9)
    assert result_lists(result) == ([False] * 6, [NOT_HELD] * 6, 6)
    assert torch.equal(pool.tags, tags_before)
    pool.assert_bufs(before)


def test_write_past_the_pool_is_dropped_out_of_range():
    pool = Pool()
    kvattn.reserve_pages(pool.tags, [NUM_PAGES - 1], owner=1)
    before, tags_before = pool.snapshot(), pool.tags.clone()
    k, v = kv(3)
    mapping = slots((NUM_PAGES, 0), (NUM_PAGES, 1), (1000, 3))
    result = write(pool, k, v, mapping, 1)
    assert result_lists(result) == ([False] * 3, [OOR] * 3, 3)
    assert torch.equal(pool.tags, tags_before)
    pool.assert_bufs(before)  # in particular the last page, where the ids would clamp to


def test_write_to_the_last_page_lands():
    pool = Pool()
    kvattn.reserve_pages(pool.tags, [NUM_PAGES - 1], owner=1)
    before = pool.snapshot()
    k, v = kv(1)
    result = write(pool, k, v, slots((NUM_PAGES - 1, 0)), 1)
    assert result_lists(result) == ([True], [0], 0)
    pool.assert_bufs(pool.expect(before, [(NUM_PAGES - 1, 0, k[0], v[0])]))


# --- runs, gaps, order, overwrites ---------------------------------------------------------------


def test_run_starting_at_the_prefix_extends_it():
    pool = Pool()
    kvattn.reserve_pages(pool.tags, [2], owner=3)
    k, v = kv(4)
    write(pool, k[:2], v[:2], slots((2, 0), (2, 1)), 3)
    before = pool.snapshot()
    result = write(pool, k[2:], v[2:], slots((2, 2), (2, 3)), 3)
    assert result_lists(result) == ([True, True], [0, 0], 0)
    assert tag(pool, 2) == kvattn.written_tag(3, 4)
    pool.assert_bufs(pool.expect(before, [(2, 2, k[2], v[2]), (2, 3, k[3], v[3])]))


def test_run_starting_past_the_prefix_is_dropped_whole_as_gap():
    pool = Pool()
    kvattn.reserve_pages(pool.tags, [2], owner=3)
    k, v = kv(4)
    write(pool, k[:2], v[:2], slots((2, 0), (2, 1)), 3)
    before, tags_before = pool.snapshot(), pool.tags.clone()
    result = write(pool, k[3:], v[3:], slots((2, 3)), 3)  # slot 2 would stay a hole
    assert result_lists(result) == ([False], [GAP], 1)
    assert torch.equal(pool.tags, tags_before)
    pool.assert_bufs(before)


def test_gap_on_a_reserved_page_drops_the_run_and_keeps_it_reserved():
    pool = Pool()
    kvattn.reserve_pages(pool.tags, [2], owner=3)
    before = pool.snapshot()
    k, v = kv(2)
    result = write(pool, k, v, slots((2, 1), (2, 2)), 3)
    assert result_lists(result) == ([False, False], [GAP, GAP], 2)
    assert tag(pool, 2) == kvattn.reserved_tag(3)
    pool.assert_bufs(before)


def test_prefix_is_the_one_before_the_call():
    """A page's new tokens must come as one run: a second run of the same page in the same call is
    judged against the valid_len the page had before the call."""
    pool = Pool()
    kvattn.reserve_pages(pool.tags, [2, 4], owner=3)
    before = pool.snapshot()
    k, v = kv(5)
    mapping = slots((2, 0), (2, 1), (4, 0), (2, 2), (2, 3))
    result = write(pool, k, v, mapping, 3)
    assert result_lists(result) == ([True, True, True, False, False], [0, 0, 0, GAP, GAP], 2)
    assert tag(pool, 2) == kvattn.written_tag(3, 2)
    assert tag(pool, 4) == kvattn.written_tag(3, 1)
    pool.assert_bufs(
        pool.expect(before, [(2, 0, k[0], v[0]), (2, 1, k[1], v[1]), (4, 0, k[2], v[2])])
    )


def test_out_of_order_tokens_land_only_where_no_hole_is_left():
    pool = Pool()
    kvattn.reserve_pages(pool.tags, [0], owner=5)
    before = pool.snapshot()
    k, v = kv(2)
    result = write(pool, k, v, slots((0, 1), (0, 0)), 5)
    # Token 0 starts a run at slot 1 (past the empty prefix); token 1 starts a new run at slot 0.
    assert result_lists(result) == ([False, True], [GAP, 0], 1)
    assert tag(pool, 0) == kvattn.written_tag(5, 1)
    pool.assert_bufs(pool.expect(before, [(0, 0, k[1], v[1])]))


def test_in_order_twin_of_the_out_of_order_write_lands_both():
    pool = Pool()
    kvattn.reserve_pages(pool.tags, [0], owner=5)
    before = pool.snapshot()
    k, v = kv(2)
    result = write(pool, k, v, slots((0, 0), (0, 1)), 5)
    assert result_lists(result) == ([True, True], [0, 0], 0)
    assert tag(pool, 0) == kvattn.written_tag(5, 2)
    pool.assert_bufs(pool.expect(before, [(0, 0, k[0], v[0]), (0, 1, k[1], v[1])]))


def test_out_of_order_overwrites_inside_the_prefix_land():
    pool = Pool()
    kvattn.reserve_pages(pool.tags, [0], owner=5)
    k, v = kv(5)
    write(pool, k[:3], v[:3], slots((0, 0), (0, 1), (0, 2)), 5)
    before = pool.snapshot()
    result = write(pool, k[3:], v[3:], slots((0, 2), (0, 0)), 5)
    assert result_lists(result) == ([True, True], [0, 0], 0)
    assert tag(pool, 0) == kvattn.written_tag(5, 3)
    pool.assert_bufs(pool.expect(before, [(0, 2, k[3], v[3]), (0, 0, k[4], v[4])]))


def test_overwrite_below_valid_len_lands_without_changing_valid_len():
    pool = Pool()
    kvattn.reserve_pages(pool.tags, [1], owner=2)
    k, v = kv(5)
    write(pool, k[:4], v[:4], slots((1, 0), (1, 1), (1, 2), (1, 3)), 2)
    before = pool.snapshot()
    result = write(pool, k[4:], v[4:], slots((1, 1)), 2)
    assert result_lists(result) == ([True], [0], 0)
    assert tag(pool, 1) == kvattn.written_tag(2, 4)
    pool.assert_bufs(pool.expect(before, [(1, 1, k[4], v[4])]))


def test_overwrite_by_another_owner_is_dropped():
    pool = Pool()
    kvattn.reserve_pages(pool.tags, [1], owner=2)
    k, v = kv(5)
    write(pool, k[:4], v[:4], slots((1, 0), (1, 1), (1, 2), (1, 3)), 2)
    before, tags_before = pool.snapshot(), pool.tags.clone()
    result = write(pool, k[4:], v[4:], slots((1, 1)), 3)
    assert result_lists(result) == ([False], [NOT_HELD], 1)
    assert torch.equal(pool.tags, tags_before)
    pool.assert_bufs(before)


def test_padding_is_neither_written_nor_counted():
    pool = Pool()
    kvattn.reserve_pages(pool.tags, [1, 2], owner=4)
    before = pool.snapshot()
    k, v = kv(5)
    mapping = slots((1, 0), (1, 1), -1, (2, 0), -7)
    result = write(pool, k, v, mapping, 4)
    assert result_lists(result) == ([True, True, False, True, False], [0] * 5, 0)
    assert tag(pool, 1) == kvattn.written_tag(4, 2)
    assert tag(pool, 2) == kvattn.written_tag(4, 1)
    pool.assert_bufs(
        pool.expect(before, [(1, 0, k[0], v[0]), (1, 1, k[1], v[1]), (2, 0, k[3], v[3])])
    )


def test_padding_only_write_changes_nothing():
    pool = Pool()
    kvattn.reserve_pages(pool.tags, [0], owner=4)
    before, tags_before = pool.snapshot(), pool.tags.clone()
    k, v = kv(3)
    result = write(pool, k, v, slots(-1, -1, -1), 4)
    assert result_lists(result) == ([False] * 3, [0] * 3, 0)
    assert torch.equal(pool.tags, tags_before)
    pool.assert_bufs(before)


def test_padding_inside_a_page_run_breaks_the_run():
    """Runs are stretches of consecutive entries that pass the range and holder checks; padding does
    not, so the tokens after it start a new run, which here would leave a hole (fail closed)."""
    pool = Pool()
    kvattn.reserve_pages(pool.tags, [1], owner=4)
    before = pool.snapshot()
    k, v = kv(3)
    result = write(pool, k, v, slots((1, 0), -1, (1, 1)), 4)
    assert result_lists(result) == ([True, False, False], [0, 0, GAP], 1)
    assert tag(pool, 1) == kvattn.written_tag(4, 1)
    pool.assert_bufs(pool.expect(before, [(1, 0, k[0], v[0])]))


def test_empty_write_returns_empty_result():
    pool = Pool()
    k, v = kv(0)
    result = write(pool, k, v, slots(), 1)
    assert result.landed.shape == (0,) and result.drop_reasons.shape == (0,)
    assert result.dropped_count() == 0


# --- owners per token ----------------------------------------------------------------------------


def test_owner_tensor_per_token_and_mixed_owners_in_one_call():
    pool = Pool()
    kvattn.reserve_pages(pool.tags, [1], owner=10)
    kvattn.reserve_pages(pool.tags, [4], owner=11)
    before = pool.snapshot()
    k, v = kv(5)
    mapping = slots((1, 0), (4, 0), (1, 1), (4, 1), (4, 2))
    owners = torch.tensor([10, 11, 10, 11, 10], dtype=torch.int64, device=DEVICE)
    result = write(pool, k, v, mapping, owners)
    # Interleaved pages break the runs: (1, 1) and (4, 1) start runs past the empty prefix. The
    # last token is owner 10 aiming at owner 11's page.
    assert result_lists(result) == (
        [True, True, False, False, False],
        [0, 0, GAP, GAP, NOT_HELD],
        3,
    )
    assert tag(pool, 1) == kvattn.written_tag(10, 1)
    assert tag(pool, 4) == kvattn.written_tag(11, 1)
    pool.assert_bufs(pool.expect(before, [(1, 0, k[0], v[0]), (4, 0, k[1], v[1])]))


def test_mixed_owner_runs_in_slot_order_extend_each_page():
    pool = Pool()
    kvattn.reserve_pages(pool.tags, [1], owner=10)
    kvattn.reserve_pages(pool.tags, [4], owner=11)
    before = pool.snapshot()
    k, v = kv(4)
    mapping = slots((1, 0), (1, 1), (4, 0), (4, 1))
    owners = torch.tensor([10, 10, 11, 11], dtype=torch.int64, device=DEVICE)
    result = write(pool, k, v, mapping, owners)
    assert result_lists(result) == ([True] * 4, [0] * 4, 0)
    assert tag(pool, 1) == kvattn.written_tag(10, 2)
    assert tag(pool, 4) == kvattn.written_tag(11, 2)
    pool.assert_bufs(
        pool.expect(
            before, [(1, 0, k[0], v[0]), (1, 1, k[1], v[1]), (4, 0, k[2], v[2]), (4, 1, k[3], v[3])]
        )
    )


def test_owner_as_zero_dim_tensor():
    pool = Pool()
    kvattn.reserve_pages(pool.tags, [1], owner=10)
    k, v = kv(2)
    owner = torch.tensor(10, dtype=torch.int64, device=DEVICE)
    assert result_lists(write(pool, k[:1], v[:1], slots((1, 0)), owner)) == ([True], [0], 0)
    other = torch.tensor(11, dtype=torch.int64, device=DEVICE)
    assert result_lists(write(pool, k[1:], v[1:], slots((1, 1)), other)) == ([False], [NOT_HELD], 1)
    assert tag(pool, 1) == kvattn.written_tag(10, 1)


def test_owner_zero_in_an_unchecked_tensor_matches_no_page():
    pool = Pool()
    pool.tags[1] = 0  # FREE: owner field 0 too, but FREE is never held
    k, v = kv(1)
    owner = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    result = kvattn.write_kv(k, v, pool.k, pool.v, slots((1, 0)), pool.tags, owner, validate=False)
    assert result_lists(result) == ([False], [NOT_HELD], 1)
    assert tag(pool, 1) == kvattn.FREE_TAG


def test_owner_zero_in_a_checked_tensor_raises():
    """The twin: checked (the default for a CPU tensor, or validate=True), the same owner is a
    ValueError naming it, and nothing is written."""
    pool = Pool()
    k, v = kv(1)
    owner = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match=r"owner: expected owner ids in \[1, .*got owner\[0\] = 0"):
        kvattn.write_kv(k, v, pool.k, pool.v, slots((1, 0)), pool.tags, owner, validate=True)
    assert tag(pool, 1) == kvattn.FREE_TAG and torch.isnan(pool.k).all()


# --- a dropped and a landed token aimed at one slot ----------------------------------------------


@pytest.mark.parametrize("order", ["dropped_first", "landed_first", "landed_between"])
def test_landed_token_wins_over_a_dropped_one_at_the_same_slot(order):
    owners_of = {
        "dropped_first": [9, 9, 3],
        "landed_first": [3, 9, 9],
        "landed_between": [9, 3, 9],
    }[order]
    for repeat in range(3):
        pool = Pool()
        kvattn.reserve_pages(pool.tags, [2], owner=3)
        before = pool.snapshot()
        k, v = kv(3, seed=repeat)
        owners = torch.tensor(owners_of, dtype=torch.int64, device=DEVICE)
        result = write(pool, k, v, slots((2, 0), (2, 0), (2, 0)), owners)
        winner = owners_of.index(3)
        assert result.landed.tolist() == [o == 3 for o in owners_of]
        assert result.drop_reasons.tolist() == [0 if o == 3 else NOT_HELD for o in owners_of]
        assert tag(pool, 2) == kvattn.written_tag(3, 1)
        pool.assert_bufs(pool.expect(before, [(2, 0, k[winner], v[winner])]))


def test_landed_token_wins_over_a_gap_dropped_one_at_the_same_slot():
    pool = Pool()
    kvattn.reserve_pages(pool.tags, [2], owner=3)
    before = pool.snapshot()
    k, v = kv(3)
    result = write(pool, k, v, slots((2, 1), (2, 0), (2, 1)), 3)
    assert result_lists(result) == ([False, True, True], [GAP, 0, 0], 1)
    assert tag(pool, 2) == kvattn.written_tag(3, 2)
    pool.assert_bufs(pool.expect(before, [(2, 0, k[1], v[1]), (2, 1, k[2], v[2])]))


def test_out_of_range_token_does_not_clobber_a_landed_one_on_the_clamped_page():
    pool = Pool()
    last = NUM_PAGES - 1
    kvattn.reserve_pages(pool.tags, [last], owner=3)
    before = pool.snapshot()
    k, v = kv(2)
    # Page ids past the pool clamp to the last page internally; slot 0 of both.
    result = write(pool, k, v, slots((last, 0), (last + 1, 0)), 3)
    assert result_lists(result) == ([True, False], [0, OOR], 1)
    pool.assert_bufs(pool.expect(before, [(last, 0, k[0], v[0])]))


# --- late writer (docs/ownership.md 6.2) ---------------------------------------------------------


def _late_writer_setup(layout):
    """A holds pages 1 and 3, writes 2 tokens, keeps a write of 2 more (page 1, slots 2-3) in flight
    and is aborted; B reserves the same pages and writes 5 tokens, over the slots the late write aims
    at. Returns the pool, B's owner, B's write and A's late write."""
    pool = Pool(layout)
    a, b = 1, 2
    kvattn.reserve_pages(pool.tags, [1, 3], owner=a)
    ka, va = kv(4, seed=1)
    a_slots = slots((1, 0), (1, 1), (1, 2), (1, 3))
    assert write(pool, ka[:2], va[:2], a_slots[:2], a).dropped_count() == 0
    late = (ka[2:], va[2:], a_slots[2:], a)
    kvattn.release_pages(pool.tags, [1, 3])
    kvattn.reserve_pages(pool.tags, [1, 3], owner=b)
    kb, vb = kv(5, seed=2)
    b_slots = slots((1, 0), (1, 1), (1, 2), (1, 3), (3, 0))
    assert write(pool, kb, vb, b_slots, b).dropped_count() == 0
    return pool, b, (kb, vb, b_slots), late


def _decode_b(pool, b, backend):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2 * HEADS, DIM, generator=g).to(pool.k.dtype).to(DEVICE)
    table = torch.tensor([[1, 3]], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    expected = torch.tensor([b], dtype=torch.int64, device=DEVICE)
    out, report = kvattn.paged_decode(
        q, pool.k, pool.v, table, seq_lens, pool.tags, expected, backend=backend
    )
    return out, report


def _clean_b(layout, b, b_write):
    pool = Pool(layout)
    kvattn.reserve_pages(pool.tags, [1, 3], owner=b)
    assert write(pool, *b_write, b).dropped_count() == 0
    return pool


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("backend", DECODE_BACKENDS)
def test_late_write_after_reuse_is_dropped_and_b_is_bit_identical_to_a_clean_run(layout, backend):
    pool, b, b_write, (k, v, mapping, a) = _late_writer_setup(layout)
    before, tags_before = pool.snapshot(), pool.tags.clone()
    result = kvattn.write_kv(k, v, pool.k, pool.v, mapping, pool.tags, a)
    assert result_lists(result) == ([False, False], [NOT_HELD, NOT_HELD], 2)
    assert torch.equal(pool.tags, tags_before)
    pool.assert_bufs(before)
    out, report = _decode_b(pool, b, backend)
    assert int(report.violations.sum()) == 0
    clean_out, clean_report = _decode_b(_clean_b(layout, b, b_write), b, backend)
    assert int(clean_report.violations.sum()) == 0
    assert torch.isfinite(out).all()
    assert_bits_equal(out, clean_out)


@pytest.mark.parametrize("backend", DECODE_BACKENDS)
def test_late_write_that_lands_changes_b_so_the_scenario_is_real(backend):
    """Twin: the same late write made without the holder check (as B's owner) lands in B's slots and
    changes B's output, so the dropped replay above is what kept B clean."""
    pool, b, b_write, (k, v, mapping, a) = _late_writer_setup("NHD")
    landed = kvattn.write_kv(k, v, pool.k, pool.v, mapping, pool.tags, b)
    assert landed.dropped_count() == 0
    out, _ = _decode_b(pool, b, backend)
    clean_out, _ = _decode_b(_clean_b("NHD", b, b_write), b, backend)
    assert (out.float() - clean_out.float()).abs().max() > 1e-2


def test_write_before_release_lands_for_its_owner():
    """Twin of the late writer: the same write while A still holds its pages lands."""
    pool = Pool()
    kvattn.reserve_pages(pool.tags, [1, 3], owner=1)
    k, v = kv(4, seed=1)
    mapping = slots((1, 0), (1, 1), (1, 2), (1, 3))
    assert write(pool, k[:2], v[:2], mapping[:2], 1).dropped_count() == 0
    result = write(pool, k[2:], v[2:], mapping[2:], 1)
    assert result_lists(result) == ([True, True], [0, 0], 0)
    assert tag(pool, 1) == kvattn.written_tag(1, 4)


# --- reserve / release / commit ------------------------------------------------------------------


def test_reserve_and_release_set_tags_and_leave_bytes():
    pool = Pool()
    kvattn.reserve_pages(pool.tags, torch.tensor([0, 5], dtype=torch.int32), owner=12)
    assert [tag(pool, p) for p in range(NUM_PAGES)] == (
        [kvattn.reserved_tag(12)] + [0] * 4 + [kvattn.reserved_tag(12)]
    )
    k, v = kv(2)
    write(pool, k, v, slots((0, 0), (5, 0)), 12)
    before = pool.snapshot()
    kvattn.release_pages(pool.tags, [0])
    assert tag(pool, 0) == kvattn.FREE_TAG
    assert tag(pool, 5) == kvattn.written_tag(12, 1)
    pool.assert_bufs(before)  # release never zeroes


def test_reserve_over_a_written_page_resets_it_for_the_new_owner():
    pool = Pool()
    kvattn.reserve_pages(pool.tags, [2], owner=1)
    k, v = kv(1)
    write(pool, k, v, slots((2, 0)), 1)
    kvattn.reserve_pages(pool.tags, [2], owner=2)
    assert tag(pool, 2) == kvattn.reserved_tag(2)


@pytest.mark.parametrize("fn", ["reserve", "release"])
def test_reserve_and_release_refuse_page_ids_outside_the_pool(fn):
    pool = Pool()
    call = (
        (lambda pages: kvattn.reserve_pages(pool.tags, pages, owner=1))
        if fn == "reserve"
        else (lambda pages: kvattn.release_pages(pool.tags, pages))
    )
    for bad in ([NUM_PAGES], [-1], [0, NUM_PAGES + 3]):
        with pytest.raises(ValueError, match="pages"):
            call(bad)
    assert int(pool.tags.abs().sum()) == 0


def test_reserve_validates_owner():
    pool = Pool()
    with pytest.raises(ValueError, match="owner"):
        kvattn.reserve_pages(pool.tags, [0], owner=0)
    with pytest.raises(ValueError, match="owner"):
        kvattn.reserve_pages(pool.tags, [0], owner=1 << 47)
    with pytest.raises(TypeError, match="owner"):
        kvattn.reserve_pages(pool.tags, [0], owner=True)
    with pytest.raises(TypeError, match="pages"):
        kvattn.reserve_pages(pool.tags, torch.tensor([0.0]), owner=1)
    assert int(pool.tags.abs().sum()) == 0


def commit(pool, pages, owner, lens):
    return kvattn.commit_pages(pool.tags, pages, owner, lens, PAGE)


def test_commit_marks_reserved_pages_written_with_the_accounted_length():
    pool = Pool()
    kvattn.reserve_pages(pool.tags, [1, 2, 3], owner=6)
    result = commit(pool, [1, 2, 3], 6, [4, 3, 0])
    assert result_lists(result) == ([True] * 3, [0] * 3, 0)
    assert [tag(pool, p) for p in (1, 2, 3)] == [
        kvattn.written_tag(6, 4),
        kvattn.written_tag(6, 3),
        kvattn.written_tag(6, 0),
    ]


def test_commit_to_pages_not_held_is_dropped():
    pool = Pool()
    kvattn.reserve_pages(pool.tags, [1], owner=6)
    kvattn.reserve_pages(pool.tags, [2], owner=7)
    before = pool.tags.clone()
    result = commit(pool, [1, 2, 4], 7 + 1, [2, 2, 2])  # 4 is FREE
    assert result_lists(result) == ([False] * 3, [NOT_HELD] * 3, 3)
    assert torch.equal(pool.tags, before)


def test_commit_with_a_length_outside_the_page_is_dropped():
    pool = Pool()
    kvattn.reserve_pages(pool.tags, [1, 2], owner=6)
    before = pool.tags.clone()
    result = commit(pool, [1, 2], 6, [PAGE + 1, -1])
    assert result_lists(result) == ([False, False], [BAD_LENGTH, BAD_LENGTH], 2)
    assert torch.equal(pool.tags, before)


def test_commit_past_the_pool_is_dropped_out_of_range():
    pool = Pool()
    kvattn.reserve_pages(pool.tags, [NUM_PAGES - 1], owner=6)
    before = pool.tags.clone()
    result = commit(pool, [NUM_PAGES, -1], 6, [1, 1])
    assert result_lists(result) == ([False, False], [OOR, OOR], 2)
    assert torch.equal(pool.tags, before)


def test_commit_never_lowers_valid_len():
    pool = Pool()
    kvattn.reserve_pages(pool.tags, [1], owner=6)
    assert commit(pool, [1], 6, [3]).dropped_count() == 0
    result = commit(pool, [1], 6, [1])
    assert result_lists(result) == ([True], [0], 0)
    assert tag(pool, 1) == kvattn.written_tag(6, 3)
    assert commit(pool, [1], 6, [4]).dropped_count() == 0
    assert tag(pool, 1) == kvattn.written_tag(6, 4)


def test_commit_with_duplicate_pages_keeps_the_largest_landed_length():
    pool = Pool()
    kvattn.reserve_pages(pool.tags, [1, 2], owner=6)
    result = commit(pool, [1, 1, 2, 2], 6, [3, 2, 1, PAGE + 5])
    assert result_lists(result) == ([True, True, True, False], [0, 0, 0, BAD_LENGTH], 1)
    assert tag(pool, 1) == kvattn.written_tag(6, 3)
    assert tag(pool, 2) == kvattn.written_tag(6, 1)


def test_commit_owner_per_page():
    pool = Pool()
    kvattn.reserve_pages(pool.tags, [1], owner=6)
    kvattn.reserve_pages(pool.tags, [2], owner=7)
    owners = torch.tensor([6, 7, 6], dtype=torch.int64, device=DEVICE)
    result = commit(pool, [1, 2, 2], owners, [2, 4, 3])
    assert result_lists(result) == ([True, True, False], [0, 0, NOT_HELD], 1)
    assert tag(pool, 1) == kvattn.written_tag(6, 2)
    assert tag(pool, 2) == kvattn.written_tag(7, 4)


def test_late_commit_after_release_and_reuse_is_dropped():
    pool = Pool()
    kvattn.reserve_pages(pool.tags, [1], owner=6)
    kvattn.release_pages(pool.tags, [1])
    kvattn.reserve_pages(pool.tags, [1], owner=7)
    result = commit(pool, [1], 6, [4])
    assert result_lists(result) == ([False], [NOT_HELD], 1)
    assert tag(pool, 1) == kvattn.reserved_tag(7)


def test_commit_validates_arguments():
    pool = Pool()
    kvattn.reserve_pages(pool.tags, [1], owner=6)
    with pytest.raises(ValueError, match="valid_lens"):
        commit(pool, [1], 6, [1, 2])
    with pytest.raises(ValueError, match="owner"):
        commit(pool, [1], 0, [1])
    with pytest.raises(ValueError, match="owner"):
        commit(pool, [1], torch.tensor([6, 6]), [1])
    with pytest.raises(TypeError, match="pages"):
        commit(pool, torch.tensor([1.0]), 6, [1])
    with pytest.raises(TypeError, match="page_tags"):
        kvattn.commit_pages(pool.tags.int(), [1], 6, [1], PAGE)
    assert tag(pool, 1) == kvattn.reserved_tag(6)


# --- write_kv argument validation ----------------------------------------------------------------


def test_write_validates_arguments():
    pool = Pool()
    kvattn.reserve_pages(pool.tags, [1], owner=1)
    k, v = kv(2)
    mapping = slots((1, 0), (1, 1))
    cases = [
        (TypeError, "k", dict(k=k.float())),
        (ValueError, "k", dict(k=k[:1])),
        (ValueError, "v", dict(v=v[:, :1])),
        (TypeError, "slot_mapping", dict(slot_mapping=mapping.float())),
        (ValueError, "slot_mapping", dict(slot_mapping=mapping[None])),
        (ValueError, "owner", dict(owner=0)),
        (TypeError, "owner", dict(owner=1.0)),
        (TypeError, "owner", dict(owner=torch.ones(2, dtype=torch.int32))),
        (ValueError, "owner", dict(owner=torch.ones(3, dtype=torch.int64))),
        (TypeError, "page_tags", dict(page_tags=pool.tags.int())),
        (ValueError, "page_tags", dict(page_tags=pool.tags[:-1])),
        (TypeError, "v_cache", dict(v_cache=pool.v.float())),
        (ValueError, "k_cache", dict(k_cache=pool.k[:, :0], v_cache=pool.v[:, :0])),
    ]
    for error, name, change in cases:
        args = dict(
            k=k,
            v=v,
            k_cache=pool.k,
            v_cache=pool.v,
            slot_mapping=mapping,
            page_tags=pool.tags,
            owner=1,
        )
        args.update(change)
        with pytest.raises(error, match=name):
            kvattn.write_kv(**args)
    assert tag(pool, 1) == kvattn.reserved_tag(1)
    assert torch.isnan(pool.k).all() and torch.isnan(pool.v).all()


def test_reassign_pages_hands_written_pages_to_the_heir():
    tags = torch.tensor(
        [
            kvattn.written_tag(3, 5),
            kvattn.reserved_tag(3),
            kvattn.written_tag(4, 2),
            kvattn.FREE_TAG,
        ],
        device=DEVICE,
    )
    result = kvattn.reassign_pages(tags, [0, 1, 2, 3], owner=3, new_owner=9)
    assert result.landed.tolist() == [True, True, False, False]
    assert result.drop_reasons.tolist() == [0, 0, int(WriteDrop.NOT_HELD), int(WriteDrop.NOT_HELD)]
    assert int(result.dropped) == 2
    # State and valid_len kept, owner replaced; pages of other owners (and FREE ones) untouched.
    assert tags.tolist() == [
        kvattn.written_tag(9, 5),
        kvattn.reserved_tag(9),
        kvattn.written_tag(4, 2),
        kvattn.FREE_TAG,
    ]


def test_reassign_pages_refuses_an_owner_that_does_not_hold_them():
    tags = torch.tensor([kvattn.written_tag(3, 5)], device=DEVICE)
    result = kvattn.reassign_pages(tags, [0], owner=4, new_owner=9)
    assert result.landed.tolist() == [False] and tags.tolist() == [kvattn.written_tag(3, 5)]
