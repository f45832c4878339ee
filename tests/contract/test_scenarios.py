"""The reader scenarios of docs/ownership.md section 6 (1, 3-7), on every backend and three page
geometries: 4-token pages with head dim 32, a page size that is not a power of two (5), and head
dim 512 (the kernels that tile over D).

Every slot a reader must not use holds NaN or a sentinel engineered to dominate attention; checked
results must be finite and equal the reference over the slots the rule allows. Each "no violation"
case has a "violation detected" twin.
"""

import dataclasses
import importlib

import pytest
import torch

import kvattn
from kvattn import KVOwnershipError, Violation
from kvattn_testing.scenarios import (
    DEFAULT,
    SENTINEL_V,
    Geometry,
    cache_batch,
    incident,
    shared_prefix_cache,
)
from kvattn_testing.util import (
    DEVICE,
    LSE_TOLERANCE,
    Batch,
    assert_close_to_reference,
    assert_reports_equal,
    backends_under_test,
    decode,
    precise_dtype,
    runs_float32,
    tolerance,
)

GEOMETRIES = [DEFAULT, Geometry(page=5, head_dim=32), Geometry(page=4, head_dim=512)]


@pytest.fixture(params=backends_under_test())
def backend(request):
    return request.param


@pytest.fixture(params=GEOMETRIES, ids=lambda g: f"p{g.page}-d{g.head_dim}")
def geo(request):
    return request.param


def check_against_reference(batch, backend, **kwargs):
    """Decode on ``backend``; output, lse and report equal the reference. Returns the results."""
    out, lse, report = batch.decode(backend, return_lse=True, **kwargs)
    ref_out, ref_lse, ref_report = batch.reference(return_lse=True, compute_dtype=torch.float64)
    assert torch.isfinite(out).all(), "a refused or masked slot was read"
    torch.testing.assert_close(out.double(), ref_out, **tolerance(batch.q.dtype))
    torch.testing.assert_close(lse.double(), ref_lse, **LSE_TOLERANCE)
    assert_reports_equal(report, ref_report)
    return out, lse, report


# --- 1. Incident replay ------------------------------------------------------------------------


@pytest.mark.parametrize("num_pages_b", [1, 4])
def test_incident_replay_checked_refuses_and_reports(backend, geo, num_pages_b):
    cache, lease_b, q, k1, v1 = incident(geo, num_pages_b)
    table, _, expected = cache.batch([lease_b])
    # The decode node believes the whole prompt arrived: it attends over every reserved page.
    seq_lens = torch.tensor([num_pages_b * geo.page], dtype=torch.int32, device=DEVICE)
    out, lse, report = decode(
        backend,
        q,
        cache.k_cache,
        cache.v_cache,
        table,
        seq_lens,
        cache.page_tags,
        expected,
        return_lse=True,
    )
    assert report.violations.tolist() == [num_pages_b]
    want_reasons = Violation.UNWRITTEN | (Violation.RESERVED if num_pages_b > 1 else 0)
    assert report.reasons.tolist() == [int(want_reasons)]
    assert report.page_reasons[0].tolist() == (
        [int(Violation.UNWRITTEN)] + [int(Violation.RESERVED)] * (num_pages_b - 1)
    )
    assert report.pages_checked.tolist() == [num_pages_b]

    # Attention over B's one token: the reference over a one-token sequence, which is v1 itself.
    ref_out, ref_lse, ref_report = kvattn.reference.paged_decode(
        q,
        cache.k_cache,
        cache.v_cache,
        table[:, :1],
        torch.tensor([1], dtype=torch.int32, device=DEVICE),
        cache.page_tags,
        expected[:, :1],
        return_lse=True,
        compute_dtype=torch.float64,
    )
    assert not ref_report.any()
    assert_close_to_reference(out, ref_out, q.dtype)
    torch.testing.assert_close(lse.double(), ref_lse, **LSE_TOLERANCE)
    torch.testing.assert_close(
        out.float(), v1.float().repeat_interleave(2, dim=1), **tolerance(q.dtype)
    )
    assert out.abs().max() < 10, "sentinel influence"


@pytest.mark.parametrize("num_pages_b", [1, 4])
def test_incident_replay_unchecked_shows_the_sentinel(backend, geo, num_pages_b):
    """The twin: without the check the same call returns the sentinel, so the scenario is real."""
    cache, lease_b, q, _, _ = incident(geo, num_pages_b)
    table, _, expected = cache.batch([lease_b])
    seq_lens = torch.tensor([num_pages_b * geo.page], dtype=torch.int32, device=DEVICE)
    out, report = decode(
        backend,
        q,
        cache.k_cache,
        cache.v_cache,
        table,
        seq_lens,
        cache.page_tags,
        expected,
        check=False,
    )
    assert report is None
    assert (out.float() > 0.9 * SENTINEL_V).all()


def test_incident_replay_truthful_length_is_clean(backend, geo):
    """The twin of the over-long read: decoding B with the length the writer accounted for (1)
    reports nothing and gives the same answer."""
    cache, lease_b, q, _, v1 = incident(geo, 4)
    table, seq_lens, expected = cache.batch([lease_b])
    out, report = decode(
        backend, q, cache.k_cache, cache.v_cache, table, seq_lens, cache.page_tags, expected
    )
    assert not report.any() and report.pages_checked.tolist() == [1]
    torch.testing.assert_close(
        out.float(), v1.float().repeat_interleave(2, dim=1), **tolerance(q.dtype)
    )


# --- 3. FREE / RESERVED pages, padding, bad indices, duplicates, swapped rows ------------------


def test_clean_batch_has_no_violation(backend, geo):
    batch = geo.small_batch(geo.lens3)
    _, _, report = check_against_reference(batch, backend)
    assert not report.any() and report.pages_checked.tolist() == [2, 3, 3]


@pytest.mark.parametrize("tag", ["free", "reserved"])
def test_free_and_reserved_pages_are_refused(backend, geo, tag):
    batch = geo.small_batch(geo.lens3)
    page = int(batch.block_table[1, 1])
    batch.page_tags[page] = kvattn.FREE_TAG if tag == "free" else kvattn.reserved_tag(2)
    _, _, report = check_against_reference(batch, backend)
    reason = Violation.FREE if tag == "free" else Violation.RESERVED
    assert report.violations.tolist() == [0, 1, 0]
    assert report.page_reasons[1].tolist() == [0, int(reason), 0]


def test_padding_page_past_seq_len_is_ignored(backend, geo):
    """Engines pad table rows with page 0 (someone else's); unread entries are not violations."""
    batch = geo.small_batch(geo.lens3, extra_pages=1)
    batch.block_table[0, 2:] = 0
    batch.block_table[2, 3] = 0
    _, _, report = check_against_reference(batch, backend)
    assert not report.any()


def test_padding_page_that_is_read_is_refused(backend, geo):
    """The twin: a length that reaches the padding entry reads it, and the tag refuses it."""
    batch = geo.small_batch(geo.lens3, extra_pages=1)
    batch.block_table[0, 2] = int(batch.block_table[1, 0])  # seq 1's page as padding
    batch.seq_lens[0] = 2 * geo.page + 1
    _, _, report = check_against_reference(batch, backend)
    # Page 1 of seq 0 holds 1 written slot of a page now read; page 2 is seq 1's.
    assert report.page_reasons[0].tolist()[:3] == [
        0,
        int(Violation.UNWRITTEN),
        int(Violation.OWNER_MISMATCH),
    ]


@pytest.mark.parametrize("bad", ["past_pool", "negative", "int32_min"])
def test_out_of_range_and_negative_indices_are_refused(backend, geo, bad):
    batch = geo.small_batch(geo.lens3)
    num_pages = batch.k_cache.shape[0]
    batch.block_table[2, 1] = {"past_pool": num_pages, "negative": -1, "int32_min": -(2**31)}[bad]
    _, _, report = check_against_reference(batch, backend)
    assert report.violations.tolist() == [0, 0, 1]
    assert report.page_reasons[2].tolist() == [0, int(Violation.OUT_OF_RANGE), 0]


def test_duplicated_index_of_another_sequence_is_refused(backend, geo):
    batch = geo.small_batch(geo.lens3)
    batch.block_table[2, 0] = batch.block_table[1, 0]
    _, _, report = check_against_reference(batch, backend)
    assert report.violations.tolist() == [0, 0, 1]
    assert report.reasons.tolist() == [0, 0, int(Violation.OWNER_MISMATCH)]


def test_duplicated_index_of_own_full_page_passes(backend, geo):
    """The twin, and a stated limit: a sequence listing its own full page twice reads it twice. The
    tag proves who wrote a page, not where in the sequence it belongs."""
    batch = geo.small_batch(geo.lens3)
    batch.block_table[1, 1] = batch.block_table[1, 0]
    _, _, report = check_against_reference(batch, backend)
    assert not report.any()


def test_swapped_rows_are_refused(backend, geo):
    batch = geo.small_batch(geo.lens3)
    batch.block_table[[1, 2]] = batch.block_table[[2, 1]].clone()
    out, lse, report = check_against_reference(batch, backend)
    assert report.violations.tolist() == [0, 3, 3]
    assert report.reasons.tolist() == [0] + [int(Violation.OWNER_MISMATCH)] * 2
    assert torch.equal(out[1:], torch.zeros_like(out[1:])) and torch.isneginf(lse[1:]).all()


# --- 4. Partial pages with stale tails ---------------------------------------------------------


def stale_tails(batch):
    """Sentinel V (and large K) in every slot past each page's valid_len: a previous owner's data."""
    for p in range(batch.k_cache.shape[0]):
        tag = int(batch.page_tags[p])
        if kvattn.tag_state(tag) == kvattn.tags.STATE_WRITTEN:
            n = kvattn.tag_valid_len(tag)
            batch.k_cache[p, n:] = 4.0
            batch.v_cache[p, n:] = SENTINEL_V
    return batch


@pytest.mark.parametrize("pages,slots", [(1, -1), (1, 0), (1, 1), (2, -1), (2, 0), (2, 1)])
def test_partial_pages_at_page_boundaries_are_clean(backend, geo, pages, slots):
    length = pages * geo.page + slots
    batch = stale_tails(geo.small_batch([length, 1, 3 * geo.page]))
    out, _, report = check_against_reference(batch, backend)
    assert not report.any()
    assert out.abs().max() < 10


@pytest.mark.parametrize(
    "written,read", [((1, -1), (1, 0)), ((0, 1), (1, 0)), ((1, 1), (2, 0)), ((2, -1), (2, 1))]
)
def test_reading_past_valid_len_is_refused(backend, geo, written, read):
    """The twin: the table claims more tokens than were written; the stale tail stays out.
    ``written`` and ``read`` are (pages, slots) lengths: pages * page_size + slots."""
    written, read = (pages * geo.page + slots for pages, slots in (written, read))
    batch = geo.small_batch([written, 1, 3 * geo.page], extra_pages=1)
    # Sequence 0's spare page: written for it with nothing in it yet (valid_len 0).
    spare = int(batch.block_table[0, -(-written // geo.page)])
    batch.page_tags[spare] = kvattn.written_tag(1, 0)
    batch = stale_tails(batch)
    batch.seq_lens[0] = read
    out, _, report = check_against_reference(batch, backend)
    assert report.violations.tolist()[0] >= 1
    assert report.reasons.tolist()[0] == int(Violation.UNWRITTEN)
    assert out.abs().max() < 10


# --- 5. Prefix sharing ---------------------------------------------------------------------------


def test_prefix_sharing_with_per_entry_expected_passes(backend, geo):
    cache, parent, child, other, q = shared_prefix_cache(geo)
    assert child.pages[:2] == parent.pages[:2] and child.page_owners[:2] == [parent.owner] * 2
    batch = cache_batch(cache, [parent, child, other], q)
    _, _, report = check_against_reference(batch, backend)
    assert not report.any() and report.pages_checked.tolist() == [3, 3, 1]
    cache.free(parent)  # the child still references the shared pages: they stay written
    batch = cache_batch(cache, [child, child, other], q)
    _, _, report = check_against_reference(batch, backend)
    assert not report.any()


def test_prefix_sharing_with_wrong_expected_fails(backend, geo):
    """The twin: the shared pages expected under the child's own owner, or under an unrelated
    lease, are refused; the child's own page still passes."""
    cache, parent, child, other, q = shared_prefix_cache(geo)
    table, _, per_entry = cache.batch([parent, child, other])
    wrong = per_entry.clone()
    wrong[1, :2] = child.owner
    wrong[0, :2] = other.owner
    batch = cache_batch(cache, [parent, child, other], q, expected=wrong)
    _, _, report = check_against_reference(batch, backend)
    assert report.violations.tolist() == [2, 2, 0]
    assert report.page_reasons[:2, :2].tolist() == [[int(Violation.OWNER_MISMATCH)] * 2] * 2
    per_sequence = torch.tensor(
        [parent.owner, child.owner, other.owner], dtype=torch.int64, device=DEVICE
    )
    _, _, report = check_against_reference(
        dataclasses.replace(batch, expected=per_sequence), backend
    )
    assert report.violations.tolist() == [0, 2, 0]


# --- 6. All valid: checked == unchecked, bitwise ------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_all_valid_checked_equals_unchecked_bitwise(backend, geo, dtype):
    if dtype == torch.float32 and not runs_float32(backend):
        pytest.skip(f"{backend} runs fp16/bf16 only (tensor cores)")
    cache, parent, child, other, q = shared_prefix_cache(geo, dtype)
    batch = cache_batch(cache, [parent, child, other], q)
    checked, lse_c, report = batch.decode(backend, return_lse=True)
    unchecked, lse_u, _ = batch.decode(backend, check=False, return_lse=True)
    assert not report.any()
    assert torch.equal(checked, unchecked) and torch.equal(lse_c, lse_u)


def test_one_refused_page_makes_checked_differ_from_unchecked(backend, geo):
    """The twin: refuse one page and the checked output moves away from the unchecked one (which
    reads the refused page's NaN-free stale data)."""
    cache, parent, child, other, q = shared_prefix_cache(geo, precise_dtype(backend))
    batch = cache_batch(cache, [parent, child, other], q)
    batch.expected[2, 0] = parent.owner
    checked, report = batch.decode(backend)
    unchecked, _ = batch.decode(backend, check=False)
    assert report.violations.tolist() == [0, 0, 1]
    assert torch.equal(checked[:2], unchecked[:2])
    assert torch.equal(checked[2], torch.zeros_like(checked[2]))
    assert not torch.equal(checked[2], unchecked[2])


# --- 7. Fully masked sequences and splits --------------------------------------------------------


def test_fully_masked_sequences_give_zero_and_minus_inf(backend, geo):
    batch = geo.small_batch([2 * geo.page + 1, 3 * geo.page, 1, geo.page + 1])
    for i in range(3):
        batch.page_tags[int(batch.block_table[1, i])] = kvattn.reserved_tag(2)
    batch.seq_lens[3] = 0
    out, lse, report = check_against_reference(batch, backend)
    for b in (1, 3):
        assert torch.equal(out[b], torch.zeros_like(out[b])) and torch.isneginf(lse[b]).all()
    assert torch.isfinite(lse[[0, 2]]).all()
    assert report.violations.tolist() == [0, 3, 0, 0]


def test_masked_split_leaves_other_splits_exact(backend):
    """A 2048-token sequence (two splits in the Triton CPU plan) whose first half is refused, next to
    a clean one: the merge of an empty split and a full one equals the reference."""
    dtype = precise_dtype(backend)
    batch = Batch.random(
        batch=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        page_size=64,
        seq_lens=[2048, 2048],
        dtype=dtype,
        pool_factor=1,
    )
    for i in range(16):
        batch.page_tags[int(batch.block_table[0, i])] = kvattn.FREE_TAG
    if backend == "triton":
        module = importlib.import_module("kvattn.backends.triton.paged_decode")
        args = batch.args()
        assert module.plan_splits(args)[0] == 2
    out, lse, report = check_against_reference(batch, backend)
    assert report.violations.tolist() == [16, 0]
    assert_close_to_reference(out, batch.reference(compute_dtype=torch.float64)[0], dtype)


# --- on_violation="raise" and the report API ----------------------------------------------------


def test_raise_names_sequences_pages_and_reasons(backend):
    batch = DEFAULT.small_batch(DEFAULT.lens3)
    batch.page_tags[int(batch.block_table[2, 1])] = kvattn.reserved_tag(3)
    batch.block_table[0, 0] = -1
    out_buf = torch.full_like(batch.q, float("nan"))
    with pytest.raises(KVOwnershipError) as info:
        batch.decode(backend, on_violation="raise", out=out_buf)
    message = str(info.value)
    assert "sequence 0" in message and "page 0: OUT_OF_RANGE" in message
    assert "sequence 2" in message and "page 1: RESERVED" in message
    assert "sequence 1" not in message
    assert info.value.refusals == {0: [(0, Violation.OUT_OF_RANGE)], 2: [(1, Violation.RESERVED)]}
    # The output was written before raising, refused slots masked.
    ref_out, _ = batch.reference(compute_dtype=torch.float64)
    torch.testing.assert_close(out_buf.double(), ref_out, **tolerance(batch.q.dtype))


def test_raise_is_silent_when_clean(backend):
    batch = DEFAULT.small_batch(DEFAULT.lens3)
    out, report = batch.decode(backend, on_violation="raise")
    assert torch.isfinite(out).all()
    report.raise_if_any()
    assert not report.any() and report.refusals() == {}
    assert report.summary() == "no violation (8 pages checked)"
    assert report.ok().tolist() == [True, True, True]


def test_report_api_on_violations(backend):
    batch = DEFAULT.small_batch(DEFAULT.lens3)
    batch.page_tags[int(batch.block_table[1, 0])] = kvattn.FREE_TAG
    batch.page_tags[int(batch.block_table[1, 2])] = kvattn.written_tag(9, DEFAULT.page)
    _, report = batch.decode(backend, validate=False)
    assert report.any()
    assert report.ok().tolist() == [True, False, True]
    assert report.refusals() == {1: [(0, Violation.FREE), (2, Violation.OWNER_MISMATCH)]}
    assert report.summary() == "sequence 1: 2 refused page(s): page 0: FREE, page 2: OWNER_MISMATCH"
    with pytest.raises(KVOwnershipError) as info:
        report.raise_if_any()
    assert info.value.refusals == report.refusals()


def test_report_names_seq_len_beyond_table_as_page_minus_one(backend):
    batch = DEFAULT.small_batch(DEFAULT.lens3)
    batch.seq_lens[1] = batch.block_table.shape[1] * DEFAULT.page + 1
    _, report = batch.decode(backend, validate=False)
    assert report.refusals() == {1: [(-1, Violation.OUT_OF_RANGE)]}
    assert "page -1: OUT_OF_RANGE" in report.summary()
