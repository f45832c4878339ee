"""Paged extend (chunked prefill): the reference against dense float64 attention, every extend backend
against the reference, the ownership scenarios applied to prefix pages, and the allocator's chunked
prefill, shared prefix and prefill-then-decode paths.

Shapes are tiny: under the Triton interpreter every program costs milliseconds per loop iteration.
Tile overrides (``block_m``/``block_n`` = 16) make short sequences span several query and KV tiles.
"""

from __future__ import annotations

import pytest
import torch

import kvattn
from kvattn import Violation, backends, reserved_tag, written_tag
from kvattn_testing.extend import (
    EXTEND_BACKENDS,
    KERNELS,
    LSE_TOL,
    TRITON_EXTEND,
    Extend,
    assert_close,
    assert_prefix_scenario,
    corrupt,
    dense_extend,
)
from kvattn_testing.util import DEVICE, assert_reports_equal, tolerance

needs_triton = pytest.mark.skipif(TRITON_EXTEND is None, reason="Triton backend cannot run here")


def mixed(page_size: int):
    """(q_lens, prefix_lens): every chunk size (1 token, inside a page, several pages) against
    every prefix (none, inside a page, exactly a page, several pages)."""
    chunks = [1, max(2, page_size // 2 + 1), 2 * page_size + 3]
    prefixes = [0, max(1, page_size // 2), page_size, 2 * page_size + 1]
    pairs = [(n, p) for n in chunks for p in prefixes]
    return [n for n, _ in pairs], [p for _, p in pairs]


# --- the reference against the definition ------------------------------------------------------


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("page_size,num_heads,num_kv_heads", [(1, 2, 2), (4, 4, 1), (16, 4, 2)])
def test_reference_matches_dense_attention(page_size, num_heads, num_kv_heads, causal):
    q_lens, prefixes = mixed(page_size)
    e = Extend.random(
        q_lens,
        prefixes,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        page_size=page_size,
        dtype=torch.float32,
    )
    out, lse, report = e.reference(causal=causal, compute_dtype=torch.float64)
    keys, values = zip(*(e.tokens(b) for b in range(len(q_lens))))
    allowed = [[True] * len(k) for k in keys]
    want, want_lse = dense_extend(e.q, e.cu, keys, values, allowed, 16**-0.5, causal)
    torch.testing.assert_close(out.cpu(), want, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(lse.cpu(), want_lse, atol=1e-10, rtol=1e-10)
    assert int(report.violations.sum()) == 0
    # The report is decode's for the same lengths: every page of [0, seq_len) checked once.
    decode_report = e.pages.reference()[1]
    assert_reports_equal(report, decode_report)


# --- every extend backend against the reference ------------------------------------------------


@pytest.mark.skipif(not KERNELS, reason="no extend kernel can run here")
@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_extend_matches_reference(backend, dtype, page_size):
    """Default tiles through the public API; GQA 1 and 4 alternate with the page size."""
    q_lens, prefixes = mixed(page_size)
    num_heads, num_kv_heads = (4, 1) if page_size == 4 else (2, 2)
    e = Extend.random(
        q_lens,
        prefixes,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        page_size=page_size,
        dtype=dtype,
        seed=page_size,
    )
    out, lse, report = e.run(backend, return_lse=True)
    ref, ref_lse, ref_report = e.reference()
    assert_close(out, ref, dtype)
    torch.testing.assert_close(lse.cpu(), ref_lse.cpu(), **LSE_TOL)
    assert_reports_equal(report, ref_report)
    assert int(report.violations.sum()) == 0 and int(report.pages_checked.sum()) > 0


@needs_triton
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    "dtype,page_size,num_heads,num_kv_heads",
    [
        (torch.float16, 1, 4, 1),
        (torch.bfloat16, 4, 2, 2),
        (torch.float32, 4, 4, 1),
        (torch.float16, 16, 2, 2),
    ],
)
def test_triton_small_tiles_match_reference(dtype, page_size, num_heads, num_kv_heads, causal):
    """16-row query tiles and 16-token KV tiles: chunks span several tiles, causal tiles are
    skipped, and only tile 0 of head 0 writes the report."""
    q_lens, prefixes = mixed(page_size)
    e = Extend.random(
        q_lens,
        prefixes,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        page_size=page_size,
        dtype=dtype,
        seed=3,
    )
    out, lse, report = e.launch(causal=causal)
    ref, ref_lse, ref_report = e.reference(causal=causal)
    assert_close(out, ref, dtype)
    torch.testing.assert_close(lse.cpu(), ref_lse.cpu(), **LSE_TOL)
    assert_reports_equal(report, ref_report)


@needs_triton
@pytest.mark.parametrize("causal", [True, False])
def test_triton_pre_pass_over_several_page_blocks(causal):
    """A table wider than a pre-pass program's pages (RESOLVE_PAGES): the blocks' counts add up to
    the report, and refusals in every block are reported and kept out."""
    size, blocks = 1, 3
    wide = TRITON_EXTEND.RESOLVE_PAGES * (blocks - 1) + 37
    e = Extend.random([3, 2], [wide - 3, 20], page_size=size, dtype=torch.float32, seed=9)
    table, tags = e.pages.block_table, e.pages.page_tags
    refused = [5, TRITON_EXTEND.RESOLVE_PAGES + 7, wide - 4]  # one in each block, before the rows
    tags[int(table[0, refused[0]])] = kvattn.FREE_TAG
    tags[int(table[0, refused[1]])] = reserved_tag(1)
    tags[int(table[0, refused[2]])] = written_tag(2, size)
    out, lse, report = e.launch(causal=causal)
    ref, ref_lse, ref_report = e.reference(causal=causal)
    assert_close(out, ref, torch.float32)
    torch.testing.assert_close(lse.cpu(), ref_lse.cpu(), **LSE_TOL)
    assert_reports_equal(report, ref_report)
    assert report.violations.tolist() == [3, 0]
    assert report.pages_checked.tolist() == [wide, 22]
    assert torch.nonzero(report.page_reasons[0]).flatten().tolist() == refused


@needs_triton
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_all_valid_checked_equals_unchecked(page_size):
    """Scenario 6: with every page valid the check changes no bit of the output."""
    q_lens, prefixes = mixed(page_size)
    e = Extend.random(q_lens, prefixes, num_heads=2, num_kv_heads=1, page_size=page_size, seed=5)
    checked, lse, report = e.launch(check=True)
    unchecked, unchecked_lse, none = e.launch(check=False)
    assert none is None and int(report.violations.sum()) == 0
    assert torch.equal(checked, unchecked) and torch.equal(lse, unchecked_lse)


# --- ownership scenarios on prefix pages -------------------------------------------------------

SCENARIOS = ["none", "foreign", "reserved", "free", "unwritten", "out_of_range", "negative"]


@pytest.mark.parametrize("backend", EXTEND_BACKENDS)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_prefix_page_scenarios(backend, scenario):
    """A refused prefix page is masked for every query row and counted once for its sequence;
    the NaN it holds never shows; the other sequence is untouched. "none" is the clean twin."""
    e = Extend.random([6, 3], [9, 5], num_heads=2, num_kv_heads=1, page_size=4, seed=7)
    reason, allowed = corrupt(e, scenario)
    out, lse, report = e.run(backend, return_lse=True)
    assert_prefix_scenario(e, out, lse, report, reason, allowed)
    if reason:
        with pytest.raises(kvattn.KVOwnershipError) as err:
            e.run(backend, on_violation="raise")
        assert err.value.refusals == {0: [(1, reason)]}


@needs_triton
@pytest.mark.parametrize("scenario", ["foreign", "free"])
def test_prefix_scenario_is_real_unchecked(scenario):
    """Twin of the scenario test: unchecked, the refused page is read and its NaN shows."""
    e = Extend.random([6, 3], [9, 5], num_heads=2, num_kv_heads=1, page_size=4, seed=7)
    corrupt(e, scenario)
    out, _ = e.run("triton", check=False)
    assert torch.isnan(out[:6]).any() and torch.isfinite(out[6:]).all()


@pytest.mark.parametrize("backend", EXTEND_BACKENDS)
def test_incident_replay_prefill_over_reserved_pages(backend):
    """Scenario 1 as a prefill: tenant A's sentinel KV dominates any query; A frees its pages; B
    reserves them, only its first token arrives, and B's host extends as if the whole prefix were
    there. Checked: attention over B's one token, every page reported. Unchecked: the sentinel."""
    size, heads = 4, 2
    cache = kvattn.PagedKVCache(8, size, 1, 16, dtype=torch.float32, device=DEVICE)
    a = cache.allocate(4 * size)
    sentinel = torch.full((4 * size, 1, 16), 100.0, device=DEVICE)
    cache.append(a, sentinel, sentinel)
    cache.free(a)
    b = cache.allocate(4 * size)
    g = torch.Generator().manual_seed(11)
    k0, v0 = (torch.randn(1, 1, 16, generator=g).to(DEVICE) for _ in range(2))
    cache.append(b, k0, v0)
    q = torch.randn(3, heads, 16, generator=g).abs().to(DEVICE)
    table, _, expected = cache.batch([b])
    seq_lens = torch.tensor([4 * size], dtype=torch.int32, device=DEVICE)
    cu = torch.tensor([0, 3], dtype=torch.int32, device=DEVICE)
    out, report = kvattn.paged_extend(
        q,
        cache.k_cache,
        cache.v_cache,
        cu,
        table,
        seq_lens,
        cache.page_tags,
        expected,
        backend=backend,
    )
    torch.testing.assert_close(out, v0[:, 0].expand(3, heads, 16), **tolerance(torch.float32))
    assert report.violations.tolist() == [4]
    reserved = [int(Violation.RESERVED)] * 3
    assert report.page_reasons[0].tolist() == [int(Violation.UNWRITTEN)] + reserved
    leaked, _ = kvattn.paged_extend(
        q,
        cache.k_cache,
        cache.v_cache,
        cu,
        table,
        seq_lens,
        cache.page_tags,
        expected,
        backend=backend,
        check=False,
    )
    assert (leaked - 100.0).abs().max() < 1.0


@pytest.mark.parametrize("backend", EXTEND_BACKENDS)
def test_malformed_lengths_fail_closed(backend):
    """Unvalidated: a sequence with more queries than tokens reads nothing (0, lse -inf) and keeps
    its report; a seq_len past the table reads the table and counts one OUT_OF_RANGE; a sequence
    whose every page is foreign gets 0 and -inf, never NaN."""
    e = Extend.random([3, 2, 2], [1, 4, 3], num_heads=2, num_kv_heads=1, page_size=4, seed=13)
    p = e.pages
    p.seq_lens[0] = 2  # 3 queries, 2 tokens
    p.seq_lens[1] = 6 + 4 * p.block_table.shape[1]  # past the table
    p.expected[2] = 99  # every page of sequence 2 foreign
    out, lse, report = e.run(backend, return_lse=True, validate=False)
    ref, ref_lse, ref_report = e.reference()
    assert torch.isfinite(out).all()
    assert torch.equal(out[:3].cpu(), torch.zeros(3, 2, 16, dtype=out.dtype))
    assert torch.equal(out[5:].cpu(), torch.zeros(2, 2, 16, dtype=out.dtype))
    assert (lse[:3] == float("-inf")).all() and (lse[5:] == float("-inf")).all()
    torch.testing.assert_close(out[3:5].float().cpu(), ref[3:5].cpu(), **tolerance(torch.float16))
    torch.testing.assert_close(lse.cpu(), ref_lse.cpu(), **LSE_TOL)
    assert_reports_equal(report, ref_report)
    assert report.beyond_table.tolist() == [0, 1, 0]
    assert report.violations[2] == report.pages_checked[2] > 0


# --- the allocator: chunked prefill, shared prefix, prefill then decode --------------------------


def _prompt(length, dtype, seed, heads=4, kv_heads=2, dim=16):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(length, h, dim, generator=g).to(dtype).to(DEVICE)
        for h in (heads, kv_heads, kv_heads)
    ]


def _chunked_prefill(chunks, q, k, v, dtype, page_size=4):
    cache = kvattn.PagedKVCache(16, page_size, k.shape[1], k.shape[2], dtype=dtype, device=DEVICE)
    lease = cache.allocate(0)
    outs, start = [], 0
    for n in chunks:
        out, report = cache.prefill(
            q[start : start + n], k[start : start + n], v[start : start + n], [lease], [n]
        )
        assert int(report.violations.sum()) == 0
        outs.append(out)
        start += n
    return torch.cat(outs), cache, lease


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_chunked_prefill_equals_single_shot(dtype):
    q, k, v = _prompt(23, dtype, seed=17)
    single, _, _ = _chunked_prefill([23], q, k, v, dtype)
    # A token's query row sits at another row of another query tile when the split changes, and
    # the float32 dot may round differently there: allow one unit of the output's last place.
    ulp = torch.finfo(dtype).eps * single.abs().max().item()
    for chunks in ([8, 9, 6], [1, 4, 5, 13]):
        chunked, _, _ = _chunked_prefill(chunks, q, k, v, dtype)
        torch.testing.assert_close(chunked, single, atol=ulp, rtol=0)
    want, _ = dense_extend(q, torch.tensor([0, 23]), [k.cpu()], [v.cpu()], [[True] * 23], 0.25)
    assert_close(single, want, dtype)


def test_prefill_then_decode_matches_whole_sequence():
    q, k, v = _prompt(14, torch.float16, seed=19)
    _, cache, lease = _chunked_prefill([9, 4], q[:13], k[:13], v[:13], torch.float16)
    cache.append(lease, k[13:], v[13:])
    out, report = cache.decode(q[13:], [lease])
    assert int(report.violations.sum()) == 0
    want, _ = dense_extend(q[13:], torch.tensor([0, 1]), [k.cpu()], [v.cpu()], [[True] * 14], 0.25)
    assert_close(out, want, torch.float16)


def test_shared_prefix_passes_and_foreign_prefix_is_refused():
    """B shares A's two full prefix pages (expected entries name A's owner) and prefills its own
    suffix; C's table names a page written by A under C's owner: refused, reported, masked."""
    q, k, v = _prompt(14, torch.float16, seed=23)
    _, cache, a = _chunked_prefill([10], q[:10], k[:10], v[:10], torch.float16)
    b = cache.share_prefix(a, 8)
    assert b.pages[:2] == a.pages[:2] and b.page_owners[:2] == [a.owner, a.owner]
    out, report = cache.prefill(q[8:14], k[8:14], v[8:14], [b], [6])
    assert report.violations.tolist() == [0] and report.pages_checked.tolist() == [4]
    want, _ = dense_extend(q[8:14], torch.tensor([0, 6]), [k.cpu()], [v.cpu()], [[True] * 14], 0.25)
    assert_close(out, want, torch.float16)

    c = cache.share_prefix(a, 8)
    c.page_owners[1] = c.owner  # host bookkeeping bug: A's page claimed as C's own
    out, report = cache.prefill(q[8:14], k[8:14], v[8:14], [c], [6])
    assert report.violations.tolist() == [1]
    assert report.page_reasons[0].tolist()[:4] == [0, int(Violation.OWNER_MISMATCH), 0, 0]
    allowed = [not 4 <= t < 8 for t in range(14)]
    want, _ = dense_extend(q[8:14], torch.tensor([0, 6]), [k.cpu()], [v.cpu()], [allowed], 0.25)
    assert_close(out, want, torch.float16)
    with pytest.raises(kvattn.KVOwnershipError):
        cache.prefill(q[:0], k[:0], v[:0], [c], [0], on_violation="raise")


# --- validation ----------------------------------------------------------------------------------


def _bad(e: Extend, **changes):
    names = [
        "q",
        "k_cache",
        "v_cache",
        "cu_seqlens_q",
        "block_table",
        "seq_lens",
        "page_tags",
        "expected",
    ]
    args = dict(zip(names, e.inputs()))
    kwargs = {key: changes.pop(key) for key in ("causal", "out", "scale") if key in changes}
    args.update(changes)
    return lambda: kvattn.paged_extend(*args.values(), backend="reference", **kwargs)


@pytest.mark.parametrize(
    "change,name",
    [
        (dict(cu_seqlens_q=torch.tensor([0, 2, 5])), "cu_seqlens_q"),  # int64
        (dict(cu_seqlens_q=torch.tensor([0, 5], dtype=torch.int32)), "cu_seqlens_q"),  # shape
        (dict(cu_seqlens_q=torch.tensor([1, 2, 5], dtype=torch.int32)), "cu_seqlens_q"),  # start
        (
            dict(cu_seqlens_q=torch.tensor([0, 4, 3], dtype=torch.int32)),
            "cu_seqlens_q",
        ),  # decreasing
        (
            dict(cu_seqlens_q=torch.tensor([0, 2, 4], dtype=torch.int32)),
            "cu_seqlens_q",
        ),  # != total_q
        (dict(seq_lens=torch.tensor([1, 4], dtype=torch.int32)), "seq_lens"),  # 2 queries, 1 token
        (dict(seq_lens=torch.tensor([2, 400], dtype=torch.int32)), "seq_lens"),  # past the table
        (dict(q=torch.zeros(5, 2, 16, dtype=torch.float16)[:, :, None]), "q"),
        (
            dict(
                q=torch.zeros(5, 3, 16, dtype=torch.float16),  # 3 query heads over 2 KV heads
                k_cache=torch.zeros(24, 4, 2, 16, dtype=torch.float16),
                v_cache=torch.zeros(24, 4, 2, 16, dtype=torch.float16),
            ),
            "k_cache",
        ),
        (dict(block_table=torch.zeros(3, 2, dtype=torch.int32)), "cu_seqlens_q"),
        (dict(out=torch.zeros(4, 2, 16, dtype=torch.float16)), "out"),
        (dict(causal=1), "causal"),
        (dict(expected=torch.tensor([1, 0])), "expected"),
    ],
)
def test_validation_names_the_argument(change, name):
    e = Extend.random([2, 3], [1, 2], num_heads=2, num_kv_heads=1, page_size=4)
    with pytest.raises((ValueError, TypeError)) as err:
        _bad(e, **change)()
    assert str(err.value).startswith(f"{name}:"), str(err.value)


def test_registry_offers_extend():
    e = Extend.random([2], [3], dtype=torch.float32)
    args = kvattn.layout.validate_extend(*e.inputs())
    reasons = backends.explain(args, op="extend")
    assert reasons["reference"] is None
    assert backends.select(args, "reference", op="extend").NAME == "reference"
