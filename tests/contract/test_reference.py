"""The oracle against dense float64 attention written out here, and the reader's rule of
docs/ownership.md section 3 one condition at a time, on every backend (the reference included).

Expected outputs are computed by hand from the list of slots the rule allows; everything else in the
pool is NaN, so a slot read against the rule shows as NaN.
"""

import math

import pytest
import torch

import kvattn
from kvattn import Violation
from kvattn.tags import STATE_MASK
from kvattn_testing.util import (
    DEVICE,
    LSE_TOLERANCE,
    backends_under_test,
    decode,
    lse_tolerance,
    poisoned_pool,
    tolerance,
)

PAGE = 4
HEAD_DIM = 8
NUM_PAGES = 8


def dense_attention(q, k_cache, v_cache, tokens, scale=None):
    """float64 softmax attention of ``q`` ``[B, H, D]`` over the slots ``tokens[b]`` (a list of
    ``(physical page, slot)``), KV head ``h // (H // Hkv)``. Empty: output 0, lse -inf."""
    batch, num_heads, head_dim = q.shape
    group = num_heads // k_cache.shape[2]
    scale = head_dim**-0.5 if scale is None else scale
    out = torch.zeros(batch, num_heads, head_dim, dtype=torch.float64)
    lse = torch.full((batch, num_heads), float("-inf"), dtype=torch.float64)
    for b in range(batch):
        if not tokens[b]:
            continue
        for h in range(num_heads):
            keys = torch.stack([k_cache[p, s, h // group] for p, s in tokens[b]]).double().cpu()
            values = torch.stack([v_cache[p, s, h // group] for p, s in tokens[b]]).double().cpu()
            logits = keys @ q[b, h].double().cpu() * scale
            weights = torch.softmax(logits, dim=0)
            out[b, h] = weights @ values
            lse[b, h] = torch.logsumexp(logits, dim=0)
    return out, lse


def write_page(k, v, tags, page, owner, count, *, valid_len=None, seed=0):
    """Random K/V in the first ``count`` slots of ``page`` (the rest stays NaN); the tag says
    WRITTEN for ``owner`` with ``valid_len`` (default ``count``)."""
    g = torch.Generator().manual_seed(1000 * seed + page)
    shape = (count,) + tuple(k.shape[2:])
    k[page, :count] = torch.randn(shape, generator=g).to(k.dtype).to(k.device)
    v[page, :count] = torch.randn(shape, generator=g).to(v.dtype).to(v.device)
    tags[page] = kvattn.written_tag(owner, count if valid_len is None else valid_len)


def query(batch, num_heads=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, num_heads, HEAD_DIM, generator=g).to(DEVICE)


def page_slots(page, count):
    return [(page, s) for s in range(count)]


def check_result(
    result, want_tokens, q, k, v, *, violations, reasons, page_reasons, pages_checked, beyond=None
):
    out, lse, report = result
    want_out, want_lse = dense_attention(q, k, v, want_tokens)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double().cpu(), want_out, **tolerance(out.dtype))
    torch.testing.assert_close(lse.double().cpu(), want_lse, **lse_tolerance(out.dtype))
    assert report.violations.tolist() == violations
    assert report.reasons.tolist() == [int(r) for r in reasons]
    assert report.page_reasons.tolist() == [[int(r) for r in row] for row in page_reasons]
    assert report.pages_checked.tolist() == pages_checked
    if beyond is not None:
        assert report.beyond_table.tolist() == beyond


# --- The oracle is attention --------------------------------------------------------------------


@pytest.mark.parametrize("permuted", [False, True], ids=["identity", "permuted"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (4, 1), (8, 2)])
def test_oracle_equals_dense_float64_attention(permuted, num_heads, num_kv_heads):
    page, max_pages, batch, head_dim = 4, 3, 2, 16
    g = torch.Generator().manual_seed(7)
    num_pages = batch * max_pages
    k = torch.randn(num_pages, page, num_kv_heads, head_dim, generator=g)
    v = torch.randn(num_pages, page, num_kv_heads, head_dim, generator=g)
    q = torch.randn(batch, num_heads, head_dim, generator=g)
    order = torch.randperm(num_pages, generator=g) if permuted else torch.arange(num_pages)
    table = order.view(batch, max_pages).to(torch.int32)
    seq_lens = torch.tensor([9, 12], dtype=torch.int32)
    tags = torch.tensor([kvattn.written_tag(7, page)] * num_pages, dtype=torch.int64)
    expected = torch.tensor([7, 7], dtype=torch.int64)

    # Dense attention over each sequence's tokens, gathered by hand in logical order.
    group = num_heads // num_kv_heads
    scale = 0.3
    want = torch.empty(batch, num_heads, head_dim, dtype=torch.float64)
    want_lse = torch.empty(batch, num_heads, dtype=torch.float64)
    for b in range(batch):
        n = int(seq_lens[b])
        keys = k[table[b].long()].reshape(-1, num_kv_heads, head_dim)[:n].double()  # [n, Hkv, D]
        values = v[table[b].long()].reshape(-1, num_kv_heads, head_dim)[:n].double()
        for h in range(num_heads):
            logits = keys[:, h // group] @ q[b, h].double() * scale
            want[b, h] = torch.softmax(logits, 0) @ values[:, h // group]
            want_lse[b, h] = torch.logsumexp(logits, 0)

    out, lse, report = kvattn.reference.paged_decode(
        q,
        k,
        v,
        table,
        seq_lens,
        tags,
        expected,
        scale=scale,
        return_lse=True,
        compute_dtype=torch.float64,
    )
    assert out.dtype == torch.float64 and lse.dtype == torch.float64
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, want_lse, atol=1e-12, rtol=1e-12)
    assert report.violations.tolist() == [0, 0]
    assert report.pages_checked.tolist() == [3, 3]

    # The twin: the default float32 compute is not float64-exact, only float32-close.
    out32, _ = kvattn.reference.paged_decode(q, k, v, table, seq_lens, tags, expected, scale=scale)
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), want, **tolerance(torch.float32))


def test_oracle_gqa_grouping_uses_head_div_group():
    """Query head h reads KV head h // group: swapping KV heads changes exactly the matching groups."""
    num_heads, num_kv_heads = 4, 2
    k, v, tags = poisoned_pool(NUM_PAGES, PAGE, num_kv_heads, HEAD_DIM)
    write_page(k, v, tags, 3, owner=1, count=PAGE)
    q = query(1, num_heads)
    q[0, 1] = q[0, 0]
    q[0, 3] = q[0, 0]
    table, lens, exp = [[3]], [PAGE], [1]
    out, lse, _ = decode("reference", q, k, v, table, lens, tags, exp, return_lse=True)
    want, want_lse = dense_attention(q, k, v, [page_slots(3, PAGE)])
    torch.testing.assert_close(out.double(), want, **tolerance(torch.float32))
    torch.testing.assert_close(lse.double(), want_lse, **LSE_TOLERANCE)
    # Heads 0 and 1 share KV head 0 and the same query; head 3 has that query on KV head 1.
    assert torch.equal(out[0, 0], out[0, 1])
    assert not torch.allclose(out[0, 0], out[0, 3])


# --- The reader's rule, one condition at a time, on every backend ------------------------------


@pytest.fixture(params=backends_under_test())
def backend(request):
    return request.param


def two_page_setup(first_tag=None, second_count=PAGE, second_valid=None):
    """One sequence over pages [5, 2]; page 5 full and WRITTEN for owner 3, page 2 written for owner
    3 with ``second_count`` slots; ``first_tag`` overrides page 5's tag."""
    k, v, tags = poisoned_pool(NUM_PAGES, PAGE, 1, HEAD_DIM)
    write_page(k, v, tags, 5, owner=3, count=PAGE)
    write_page(k, v, tags, 2, owner=3, count=second_count, valid_len=second_valid)
    if first_tag is not None:
        tags[5] = first_tag
    return k, v, tags


def test_all_valid_no_violation(backend):
    k, v, tags = two_page_setup()
    q = query(1)
    result = decode(backend, q, k, v, [[5, 2]], [2 * PAGE], tags, [3], return_lse=True)
    check_result(
        result,
        [page_slots(5, PAGE) + page_slots(2, PAGE)],
        q,
        k,
        v,
        violations=[0],
        reasons=[0],
        page_reasons=[[0, 0]],
        pages_checked=[2],
    )


@pytest.mark.parametrize("bad_page", [NUM_PAGES, NUM_PAGES + 100, -1, -(2**31)])
def test_out_of_range_page_refused_and_never_read(backend, bad_page):
    k, v, tags = two_page_setup()
    q = query(1)
    result = decode(backend, q, k, v, [[bad_page, 2]], [2 * PAGE], tags, [3], return_lse=True)
    check_result(
        result,
        [page_slots(2, PAGE)],
        q,
        k,
        v,
        violations=[1],
        reasons=[Violation.OUT_OF_RANGE],
        page_reasons=[[Violation.OUT_OF_RANGE, 0]],
        pages_checked=[2],
    )


@pytest.mark.parametrize("state", ["free", "state3"])
def test_free_page_refused(backend, state):
    # State 3 is never produced by a writer; the tag format reads it like FREE.
    tag = kvattn.FREE_TAG if state == "free" else kvattn.written_tag(3, PAGE) | STATE_MASK
    k, v, tags = two_page_setup(first_tag=tag)
    q = query(1)
    result = decode(backend, q, k, v, [[5, 2]], [2 * PAGE], tags, [3], return_lse=True)
    check_result(
        result,
        [page_slots(2, PAGE)],
        q,
        k,
        v,
        violations=[1],
        reasons=[Violation.FREE],
        page_reasons=[[Violation.FREE, 0]],
        pages_checked=[2],
    )


def test_reserved_page_refused(backend):
    k, v, tags = two_page_setup(first_tag=kvattn.reserved_tag(3))
    q = query(1)
    result = decode(backend, q, k, v, [[5, 2]], [2 * PAGE], tags, [3], return_lse=True)
    check_result(
        result,
        [page_slots(2, PAGE)],
        q,
        k,
        v,
        violations=[1],
        reasons=[Violation.RESERVED],
        page_reasons=[[Violation.RESERVED, 0]],
        pages_checked=[2],
    )


@pytest.mark.parametrize("per_entry", [False, True], ids=["expected[B]", "expected[B,max_pages]"])
def test_owner_mismatch_refused(backend, per_entry):
    k, v, tags = two_page_setup(first_tag=kvattn.written_tag(4, PAGE))
    q = query(1)
    expected = [[3, 3]] if per_entry else [3]
    result = decode(backend, q, k, v, [[5, 2]], [2 * PAGE], tags, expected, return_lse=True)
    check_result(
        result,
        [page_slots(2, PAGE)],
        q,
        k,
        v,
        violations=[1],
        reasons=[Violation.OWNER_MISMATCH],
        page_reasons=[[Violation.OWNER_MISMATCH, 0]],
        pages_checked=[2],
    )


def test_per_entry_expected_accepts_what_per_sequence_refuses(backend):
    """The twin of the mismatch test: expecting owner 4 for page 0 alone accepts it."""
    k, v, tags = two_page_setup(first_tag=kvattn.written_tag(4, PAGE))
    q = query(1)
    result = decode(backend, q, k, v, [[5, 2]], [2 * PAGE], tags, [[4, 3]], return_lse=True)
    check_result(
        result,
        [page_slots(5, PAGE) + page_slots(2, PAGE)],
        q,
        k,
        v,
        violations=[0],
        reasons=[0],
        page_reasons=[[0, 0]],
        pages_checked=[2],
    )


def test_unwritten_slots_refused_but_written_prefix_used(backend):
    """valid_len 2 on a page the sequence reads in full: slots 0-1 contribute, 2-3 are refused and
    the page counts once as UNWRITTEN."""
    k, v, tags = two_page_setup(second_count=2)
    q = query(1)
    result = decode(backend, q, k, v, [[5, 2]], [2 * PAGE], tags, [3], return_lse=True)
    check_result(
        result,
        [page_slots(5, PAGE) + page_slots(2, 2)],
        q,
        k,
        v,
        violations=[1],
        reasons=[Violation.UNWRITTEN],
        page_reasons=[[0, Violation.UNWRITTEN]],
        pages_checked=[2],
    )


def test_partial_page_within_valid_len_is_no_violation(backend):
    """The twin: the same page read only up to its valid_len is clean, and the length mask keeps
    the NaN tail out."""
    k, v, tags = two_page_setup(second_count=2)
    q = query(1)
    result = decode(backend, q, k, v, [[5, 2]], [PAGE + 2], tags, [3], return_lse=True)
    check_result(
        result,
        [page_slots(5, PAGE) + page_slots(2, 2)],
        q,
        k,
        v,
        violations=[0],
        reasons=[0],
        page_reasons=[[0, 0]],
        pages_checked=[2],
    )


def test_length_mask_is_not_a_violation(backend):
    """Table entries past seq_len are never examined: FREE, foreign, or out of range."""
    k, v, tags = two_page_setup()
    tags[2] = kvattn.FREE_TAG
    q = query(2)
    table = [[5, 2, -7], [5, NUM_PAGES + 3, 2]]
    result = decode(backend, q, k, v, table, [3, PAGE], tags, [3, 3], return_lse=True)
    check_result(
        result,
        [page_slots(5, 3), page_slots(5, PAGE)],
        q,
        k,
        v,
        violations=[0, 0],
        reasons=[0, 0],
        page_reasons=[[0, 0, 0], [0, 0, 0]],
        pages_checked=[1, 1],
    )


def test_seq_len_beyond_table_counts_once_and_reads_nothing_beyond(backend):
    k, v, tags = two_page_setup()
    q = query(1)
    # validate=False: on the CPU the host check would reject this length before the kernel runs.
    result = decode(
        backend, q, k, v, [[5, 2]], [2 * PAGE + 3], tags, [3], return_lse=True, validate=False
    )
    check_result(
        result,
        [page_slots(5, PAGE) + page_slots(2, PAGE)],
        q,
        k,
        v,
        violations=[1],
        reasons=[Violation.OUT_OF_RANGE],
        page_reasons=[[0, 0]],
        pages_checked=[2],
        beyond=[1],
    )


def test_seq_len_at_table_capacity_is_not_beyond(backend):
    k, v, tags = two_page_setup()
    q = query(1)
    result = decode(
        backend, q, k, v, [[5, 2]], [2 * PAGE], tags, [3], return_lse=True, validate=False
    )
    check_result(
        result,
        [page_slots(5, PAGE) + page_slots(2, PAGE)],
        q,
        k,
        v,
        violations=[0],
        reasons=[0],
        page_reasons=[[0, 0]],
        pages_checked=[2],
        beyond=[0],
    )


def test_seq_len_zero_gives_zero_output_and_minus_inf_lse(backend):
    k, v, tags = two_page_setup()
    q = query(2)
    result = decode(backend, q, k, v, [[5, 2], [5, 2]], [0, PAGE], tags, [3, 3], return_lse=True)
    out, lse, _ = result
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.isneginf(lse[0]).all()
    check_result(
        result,
        [[], page_slots(5, PAGE)],
        q,
        k,
        v,
        violations=[0, 0],
        reasons=[0, 0],
        page_reasons=[[0, 0], [0, 0]],
        pages_checked=[0, 1],
    )


# (tag of logical page 0, expected owner, slots read) -> the first failing condition of Violation.
PRECEDENCE = {
    "reserved_beats_owner": (kvattn.reserved_tag(9), 3, PAGE, Violation.RESERVED),
    "free_state3_beats_owner_and_length": (
        kvattn.written_tag(9, 1) | STATE_MASK,
        3,
        PAGE,
        Violation.FREE,
    ),
    "owner_beats_unwritten": (kvattn.written_tag(9, 1), 3, PAGE, Violation.OWNER_MISMATCH),
    "unwritten_when_owner_right": (kvattn.written_tag(3, 1), 3, PAGE, Violation.UNWRITTEN),
    "valid_len_zero_written": (kvattn.written_tag(3, 0), 3, 1, Violation.UNWRITTEN),
}


@pytest.mark.parametrize("case", list(PRECEDENCE))
def test_reason_precedence_is_first_failing_condition(backend, case):
    tag, owner, slots, reason = PRECEDENCE[case]
    k, v, tags = two_page_setup(first_tag=tag)
    q = query(1)
    result = decode(backend, q, k, v, [[5, 2]], [slots], tags, [owner], return_lse=True)
    want = kvattn.tag_valid_len(tag) if reason == Violation.UNWRITTEN else 0
    check_result(
        result,
        [page_slots(5, min(want, slots))],
        q,
        k,
        v,
        violations=[1],
        reasons=[reason],
        page_reasons=[[reason, 0]],
        pages_checked=[1],
    )


def test_out_of_range_beats_everything_and_reasons_or_per_sequence(backend):
    """Five bad pages of one sequence, one per reason: each counted once, the reasons ORed, each
    logical page carrying its own reason; a clean neighbour sequence is unaffected."""
    k, v, tags = poisoned_pool(NUM_PAGES, PAGE, 1, HEAD_DIM)
    write_page(k, v, tags, 0, owner=3, count=PAGE)
    write_page(k, v, tags, 1, owner=4, count=PAGE)  # foreign
    write_page(k, v, tags, 2, owner=3, count=PAGE, valid_len=1)  # short
    tags[3] = kvattn.reserved_tag(3)
    write_page(k, v, tags, 6, owner=5, count=PAGE)
    q = query(2)
    table = [[0, -1, 1, 2, 3, 4], [6, 6, 6, 6, 6, 6]]
    result = decode(backend, q, k, v, table, [6 * PAGE, 2 * PAGE], tags, [3, 5], return_lse=True)
    all_reasons = (
        Violation.OUT_OF_RANGE
        | Violation.OWNER_MISMATCH
        | Violation.UNWRITTEN
        | Violation.RESERVED
        | Violation.FREE
    )
    check_result(
        result,
        [page_slots(0, PAGE) + page_slots(2, 1), page_slots(6, PAGE) * 2],
        q,
        k,
        v,
        violations=[5, 0],
        reasons=[all_reasons, 0],
        page_reasons=[
            [
                0,
                Violation.OUT_OF_RANGE,
                Violation.OWNER_MISMATCH,
                Violation.UNWRITTEN,
                Violation.RESERVED,
                Violation.FREE,
            ],
            [0, 0, 0, 0, 0, 0],
        ],
        pages_checked=[6, 2],
    )


def test_pages_checked_is_pages_read_clipped_to_table(backend):
    k, v, tags = poisoned_pool(NUM_PAGES, PAGE, 1, HEAD_DIM)
    for p in range(NUM_PAGES):
        write_page(k, v, tags, p, owner=1, count=PAGE)
    lens = [1, PAGE, PAGE + 1, 3 * PAGE - 1, 3 * PAGE, 0]
    table = [[p, (p + 1) % NUM_PAGES, (p + 2) % NUM_PAGES] for p in range(len(lens))]
    q = query(len(lens))
    result = decode(backend, q, k, v, table, lens, tags, [1] * len(lens), return_lse=True)
    want_tokens = [[(table[b][t // PAGE], t % PAGE) for t in range(n)] for b, n in enumerate(lens)]
    check_result(
        result,
        want_tokens,
        q,
        k,
        v,
        violations=[0] * 6,
        reasons=[0] * 6,
        page_reasons=[[0, 0, 0]] * 6,
        pages_checked=[math.ceil(n / PAGE) for n in lens],
    )
