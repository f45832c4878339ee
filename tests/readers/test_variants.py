"""The attention variants of kvattn.variants (sliding window on one side or two, logit soft-cap,
attention sinks, ALiBi, fp8 KV) on every backend that claims them: against the reference and
against :func:`dense`, the definitions written out one query row at a time in float64
(tests/kvattn_testing/variants.py), with NaN-filled foreign pages planted where a sequence reads
them (and, for the window, where it does not).

Peer grids where they exist: windows 64/128/256 and soft-caps 30/50 (vLLM's and FlashInfer's
tests), fp8 e4m3/e5m2 with per-tensor and per-head scales.
"""

from __future__ import annotations

import pytest
import torch

import kvattn
from kvattn import Violation
from kvattn_testing.extend import Extend
from kvattn_testing.util import (
    DEVICE,
    Batch,
    assert_reports_equal,
    backends_under_test,
    claims,
    launcher,
    split_kv_backends,
)
from kvattn_testing.variants import (
    CASES,
    DIM,
    FP8,
    HEADS,
    KV_HEADS,
    assert_matches,
    decode_batch,
    decode_rows,
    dense,
    inputs,
    per_head,
    plant_foreign_page,
    to_fp8,
    tokens,
)


@pytest.mark.parametrize("page", [4, 5])
@pytest.mark.parametrize("case", list(CASES))
def test_decode_variants_match_the_definition(case, page):
    ours, theirs = CASES[case]
    pages = decode_batch(page)
    args = kvattn.layout.validate_decode(*inputs(pages), **ours)
    names = claims(args, "decode")
    seqs = [tokens(pages, b) for b in range(4)]
    want_out, want_lse = dense(pages.q, decode_rows(pages), seqs, DIM**-0.5, **theirs)
    ref_report = None
    for backend in names:
        out, lse, report = kvattn.paged_decode(
            *inputs(pages), backend=backend, return_lse=True, **ours
        )
        assert_matches(out, lse, want_out, want_lse, pages.q.dtype)
        ref_report = ref_report or report
        assert_reports_equal(report, ref_report)
        refused = report.violations.tolist()
        assert refused[:3] == [0, 0, 0] and refused[3] == 1


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("case", list(CASES))
def test_extend_variants_match_the_definition(case, causal):
    ours, theirs = CASES[case]
    page = 4
    ext = Extend.random(
        [1, 5, 3, 2],
        [page - 1, 0, 2 * page + 1, 3 * page],
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=DIM,
        page_size=page,
        pool_factor=2,
    )
    plant_foreign_page(ext.pages, 3, 2)
    args = kvattn.layout.validate_extend(*ext.inputs(), causal=causal, **ours)
    seqs = [tokens(ext.pages, b) for b in range(4)]
    want_out, want_lse = dense(ext.q, ext.cu, seqs, DIM**-0.5, causal=causal, **theirs)
    ref_report = None
    for backend in claims(args, "extend"):
        out, lse, report = ext.run(backend, causal=causal, return_lse=True, **ours)
        assert_matches(out, lse, want_out, want_lse, ext.q.dtype)
        ref_report = ref_report or report
        assert_reports_equal(report, ref_report)
        # Sequence 3's foreign page is refused when some row's window reaches it.
        k, _, ok = seqs[3]
        first = max(0, len(k) - 2 - theirs.get("window_left", len(k)))
        assert report.violations.tolist() == [0, 0, 0, int(not all(ok[first:]))]


SPLIT_CASES = ["window", "softcap", "sinks", "alibi", "all"]


@pytest.mark.parametrize("num_splits", [2, 5])
@pytest.mark.parametrize("case", SPLIT_CASES)
def test_decode_variants_across_splits(case, num_splits):
    """The kernels' split-KV path: partial results merged with the sink added once and the window
    spread over the splits from its aligned start; the report is the unsplit one."""
    ours, theirs = CASES[case]
    if "window_left" in ours:
        ours, theirs = dict(ours, window_left=37), dict(theirs, window_left=37)
    lens = [90, 17, 1, 64]
    pages = Batch.random(
        batch=4,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=DIM,
        page_size=4,
        seq_lens=lens,
        pool_factor=2,
        seed=7,
    )
    plant_foreign_page(pages, 0, 20)  # tokens 80-83: inside every window here
    args = kvattn.layout.validate_decode(*inputs(pages), **ours)
    want_out, want_lse = dense(
        pages.q, decode_rows(pages), [tokens(pages, b) for b in range(4)], DIM**-0.5, **theirs
    )
    ref = kvattn.paged_decode(*inputs(pages), backend="reference", **ours)[1]
    kernels = [n for n in claims(args, "decode") if n in split_kv_backends()]
    for backend in kernels:
        out = torch.empty_like(pages.q)
        lse = torch.empty(pages.q.shape[:2], dtype=torch.float32, device=DEVICE)
        report = launcher(backend).decode(args, check=True, out=out, lse=lse, num_splits=num_splits)
        assert_matches(out, lse, want_out, want_lse, pages.q.dtype)
        assert_reports_equal(report, ref)
    assert ref.violations.tolist() == [1, 0, 0, 0]


def small_tile_extend(ext: Extend, causal: bool, **switches):
    """``(out, lse, report)`` of the Triton extend launcher with 16-row, 16-key tiles."""
    if "triton" not in backends_under_test():
        pytest.skip("triton cannot run here")
    module = __import__("kvattn.backends.triton.paged_extend", fromlist=["extend"])
    args = kvattn.layout.validate_extend(*ext.inputs(), causal=causal, **switches)
    out = torch.empty_like(ext.q)
    lse = torch.empty(ext.q.shape[:2], dtype=torch.float32, device=DEVICE)
    report = module.extend(args, check=True, out=out, lse=lse, block_m=16, block_n=16)
    return out, lse, report


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("case", ["window", "all"])
def test_triton_extend_small_tiles_skip_tiles_before_the_window(case, causal):
    """16-row, 16-key tiles over 60-token sequences: whole key tiles before a query tile's window
    are skipped and the edge tiles masked per element."""
    ours, theirs = CASES[case]
    ext = Extend.random(
        [20, 3],
        [40, 29],
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=DIM,
        page_size=4,
        pool_factor=2,
        seed=11,
    )
    plant_foreign_page(ext.pages, 1, 7)  # tokens 28-31: in the window of sequence 1's rows
    want_out, want_lse = dense(
        ext.q, ext.cu, [tokens(ext.pages, b) for b in range(2)], DIM**-0.5, causal=causal, **theirs
    )
    out, lse, report = small_tile_extend(ext, causal, **ours)
    assert_matches(out, lse, want_out, want_lse, ext.q.dtype)
    assert_reports_equal(report, ext.reference(causal=causal, **ours)[2])
    assert report.violations.tolist() == [0, 1]


# --- fp8 KV -------------------------------------------------------------------------------------

SCALES = {
    "tensor": (0.125, 0.25),
    "per-head": (torch.tensor([0.125, 0.0625]), torch.tensor([0.25, 0.5])),
}


@pytest.mark.parametrize("scales", list(SCALES))
@pytest.mark.parametrize("fmt", list(FP8))
@pytest.mark.parametrize("q_dtype", [torch.float16, torch.bfloat16])
def test_fp8_decode_matches_the_dequantised_definition(q_dtype, fmt, scales):
    k_scale, v_scale = SCALES[scales]
    if isinstance(k_scale, torch.Tensor):
        k_scale, v_scale = k_scale.to(DEVICE), v_scale.to(DEVICE)
    pages = to_fp8(decode_batch(4), FP8[fmt])
    pages.q = pages.q.to(q_dtype)
    ks = torch.as_tensor(k_scale).expand(KV_HEADS)
    vs = torch.as_tensor(v_scale).expand(KV_HEADS)
    seqs = [tokens(pages, b, ks.cpu(), vs.cpu()) for b in range(4)]
    want_out, want_lse = dense(pages.q, decode_rows(pages), seqs, DIM**-0.5)
    args = kvattn.layout.validate_decode(*inputs(pages), k_scale=k_scale, v_scale=v_scale)
    names = claims(args, "decode")
    assert "reference" in names
    for backend in names:
        out, lse, report = kvattn.paged_decode(
            *inputs(pages), backend=backend, return_lse=True, k_scale=k_scale, v_scale=v_scale
        )
        assert out.dtype == q_dtype
        assert_matches(out, lse, want_out, want_lse, q_dtype)
        assert report.violations.tolist() == [0, 0, 0, 1]


@pytest.mark.parametrize("fmt", list(FP8))
def test_fp8_extend_matches_the_dequantised_definition(fmt):
    ext = Extend.random(
        [1, 5, 3, 2],
        [3, 0, 9, 12],
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=DIM,
        page_size=4,
        pool_factor=2,
    )
    plant_foreign_page(ext.pages, 3, 2)
    to_fp8(ext.pages, FP8[fmt])
    k_scale, v_scale = torch.tensor([0.125, 0.0625], device=DEVICE), 0.25
    seqs = [tokens(ext.pages, b, k_scale.cpu(), torch.full((KV_HEADS,), 0.25)) for b in range(4)]
    want_out, want_lse = dense(ext.q, ext.cu, seqs, DIM**-0.5)
    args = kvattn.layout.validate_extend(*ext.inputs(), k_scale=k_scale, v_scale=v_scale)
    for backend in claims(args, "extend"):
        out, lse, report = ext.run(backend, return_lse=True, k_scale=k_scale, v_scale=v_scale)
        assert_matches(out, lse, want_out, want_lse, ext.q.dtype)
        assert report.violations.tolist() == [0, 0, 0, 1]


def test_fp8_pools_without_scales_dequantise_by_one():
    pages = to_fp8(decode_batch(4), torch.float8_e4m3fn)
    one = kvattn.paged_decode(*inputs(pages), backend="reference")[0]
    explicit = kvattn.paged_decode(*inputs(pages), backend="reference", k_scale=1.0, v_scale=1.0)[0]
    assert torch.equal(one, explicit)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_extend_window_far_into_a_long_sequence(causal):
    """A 230-token sequence whose 10 rows read a 40-key window: every backend skips the key tiles
    before it (the CUDA kernel's 64-key tiles included), and pages there are neither read nor
    reported, even foreign ones."""
    ext = Extend.random(
        [10, 2],
        [220, 5],
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=DIM,
        page_size=8,
        pool_factor=2,
        seed=5,
    )
    plant_foreign_page(ext.pages, 0, 3)  # tokens 24-31: long before the window
    plant_foreign_page(ext.pages, 0, 23)  # tokens 184-191: inside it
    args = kvattn.layout.validate_extend(*ext.inputs(), causal=causal, window_left=40)
    want_out, want_lse = dense(
        ext.q,
        ext.cu,
        [tokens(ext.pages, b) for b in range(2)],
        DIM**-0.5,
        causal=causal,
        window_left=40,
    )
    names = claims(args, "extend")
    assert set(names) == set(backends_under_test("extend"))
    for backend in names:
        out, lse, report = ext.run(backend, causal=causal, return_lse=True, window_left=40)
        assert_matches(out, lse, want_out, want_lse, ext.q.dtype)
        assert report.violations.tolist() == [1, 0]
        assert report.page_reasons[0].tolist()[3] == 0
        # Window of the first row: keys 180 .. 229, pages 22 .. 28.
        assert report.pages_checked.tolist() == [7, 1]


# --- two-sided windows (window_right, extend) ---------------------------------------------------

# (window_left, window_right): two-sided, right edge only, the row alone, FlashAttention's causal
# local (left, 0), and an edge past every key.
TWO_SIDED = [(5, 2), (-1, 3), (0, 0), (4, 0), (-1, 2**31 - 2)]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize(
    "left,right", TWO_SIDED, ids=[f"l{left}-r{right}" for left, right in TWO_SIDED]
)
def test_two_sided_window_matches_the_definition(left, right, causal):
    """Rows read keys in ``[pos - left, pos + right]`` on every backend claiming the switch;
    causal rows also stop at their own position (the edge changes nothing there). The pages
    checked and reported are those without the edge: the last row reads through the last key."""
    page = 4
    ext = Extend.random(
        [1, 7, 3, 2, 9],
        [page - 1, 0, 2 * page + 1, 3 * page, 2],
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=DIM,
        page_size=page,
        pool_factor=2,
        seed=9,
    )
    plant_foreign_page(ext.pages, 3, 2)
    plant_foreign_page(ext.pages, 1, 0)  # under sequence 1's first rows
    args = kvattn.layout.validate_extend(
        *ext.inputs(), causal=causal, window_left=left, window_right=right
    )
    names = claims(args, "extend")
    assert set(names) == set(backends_under_test("extend"))
    seqs = [tokens(ext.pages, b) for b in range(5)]
    want_out, want_lse = dense(
        ext.q, ext.cu, seqs, DIM**-0.5, causal=causal, window_left=left, window_right=right
    )
    without = ext.reference(causal=causal, window_left=left)[2]
    for backend in names:
        out, lse, report = ext.run(
            backend, causal=causal, return_lse=True, window_left=left, window_right=right
        )
        assert_matches(out, lse, want_out, want_lse, ext.q.dtype)
        assert_reports_equal(report, without)
    if causal:
        plain, plain_lse, _ = ext.run("reference", causal=True, return_lse=True, window_left=left)
        torch.testing.assert_close(
            ext.run("reference", causal=True, window_left=left, window_right=right)[0],
            plain,
            atol=0,
            rtol=0,
        )


def test_the_right_edge_removes_keys():
    """The twin: without causality an edge of 2 changes the rows that had later keys (all but the
    last three of a 7-row chunk over no prefix) and leaves the last three as they were."""
    ext = Extend.random(
        [7], [0], num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM, page_size=4, seed=9
    )
    full = ext.run("reference", causal=False)[0]
    edged = ext.run("reference", causal=False, window_right=2)[0]
    moved = (edged - full).abs().flatten(1).amax(dim=1)
    assert (moved[:4] > 1e-3).all() and (moved[4:] == 0).all()


@pytest.mark.parametrize("left,right", [(6, 3), (-1, 5)])
def test_triton_extend_small_tiles_stop_after_the_right_edge(left, right):
    """16-row, 16-key tiles, non-causal rows: a query tile's key loop stops after its last row's
    edge, the edge tile masked per element."""
    ext = Extend.random(
        [40, 3],
        [20, 29],
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=DIM,
        page_size=4,
        pool_factor=2,
        seed=12,
    )
    plant_foreign_page(ext.pages, 0, 12)  # tokens 48-51: read by sequence 0's later rows
    sw = dict(window_left=left, window_right=right)
    want_out, want_lse = dense(
        ext.q, ext.cu, [tokens(ext.pages, b) for b in range(2)], DIM**-0.5, causal=False, **sw
    )
    out, lse, report = small_tile_extend(ext, False, **sw)
    assert_matches(out, lse, want_out, want_lse, ext.q.dtype)
    assert_reports_equal(report, ext.reference(causal=False, **sw)[2])
    assert report.violations.tolist() == [1, 0]


@pytest.mark.parametrize(
    "bad,error", [(-2, ValueError), (2**31 - 1, ValueError), (True, TypeError), (1.0, TypeError)]
)
def test_window_right_is_validated(bad, error):
    ext = Extend.random([2], [3], num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM, page_size=4)
    with pytest.raises(error, match="window_right"):
        ext.run("reference", causal=False, window_right=bad)


# --- sliding window: what is read and what is reported -------------------------------------------


def window_batch(page):
    """One sequence of 4P + 2 tokens whose query reads keys from 3P + 1 - window on."""
    return Batch.random(
        batch=1,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=DIM,
        page_size=page,
        seq_lens=[4 * page + 2],
        pool_factor=3,
    )


@pytest.mark.parametrize("backend", backends_under_test())
def test_pages_before_the_window_are_neither_read_nor_checked(backend):
    """window_left = P + 1 from position 4P + 1: keys from 3P on. Pages 0-2 lie wholly before the
    window; a foreign NaN page there is not read and not reported, and pages_checked counts the 2
    pages the window touches."""
    page = 4
    pages = window_batch(page)
    plant_foreign_page(pages, 0, 1)
    args = kvattn.layout.validate_decode(*inputs(pages), window_left=page + 1)
    if backend not in claims(args, "decode"):
        pytest.skip(f"{backend} does not run sliding windows")
    out, lse, report = kvattn.paged_decode(
        *inputs(pages), backend=backend, return_lse=True, window_left=page + 1
    )
    seqs = [tokens(pages, 0)]
    want_out, want_lse = dense(pages.q, decode_rows(pages), seqs, DIM**-0.5, window_left=page + 1)
    assert_matches(out, lse, want_out, want_lse, pages.q.dtype)
    assert not report.any() and report.pages_checked.tolist() == [2]
    assert report.page_reasons[0].tolist() == [0] * pages.block_table.shape[1]


@pytest.mark.parametrize("backend", backends_under_test())
def test_a_page_straddling_the_window_edge_is_checked(backend):
    """The twin: window_left = P + 2 reaches one slot into page 2, so a foreign page there is read
    through that slot and refused; the rest of the window still attends."""
    page = 4
    pages = window_batch(page)
    plant_foreign_page(pages, 0, 2)
    args = kvattn.layout.validate_decode(*inputs(pages), window_left=page + 2)
    if backend not in claims(args, "decode"):
        pytest.skip(f"{backend} does not run sliding windows")
    out, lse, report = kvattn.paged_decode(
        *inputs(pages), backend=backend, return_lse=True, window_left=page + 2
    )
    want_out, want_lse = dense(
        pages.q, decode_rows(pages), [tokens(pages, 0)], DIM**-0.5, window_left=page + 2
    )
    assert_matches(out, lse, want_out, want_lse, pages.q.dtype)
    assert report.violations.tolist() == [1] and report.pages_checked.tolist() == [3]
    assert int(report.page_reasons[0, 2]) == int(Violation.OWNER_MISMATCH)


def test_window_of_a_straddling_page_needs_only_its_read_prefix_written():
    """valid_len must cover the slots up to the last one read, as without a window: a page whose
    unread head is stale but written passes; one whose read tail is unwritten is refused."""
    page = 4
    pages = window_batch(page)
    ref = kvattn.paged_decode(*inputs(pages), backend="reference", window_left=page)[1]
    assert not ref.any()
    last = int(pages.block_table[0, 4])
    pages.page_tags[last] = kvattn.written_tag(1, 1)  # 2 slots of the last page are read
    report = kvattn.paged_decode(*inputs(pages), backend="reference", window_left=page)[1]
    assert report.page_reasons[0].tolist()[4] == int(Violation.UNWRITTEN)


# --- sinks: a refused row gives 0, not the sink's share ----------------------------------------


@pytest.mark.parametrize("backend", backends_under_test())
def test_fully_refused_row_with_sinks_gives_zero_and_minus_inf(backend):
    pages = decode_batch(4)
    for i in range(4):
        pages.page_tags[int(pages.block_table[2, i])] = kvattn.FREE_TAG
    sinks = per_head((0.0, 1.0))
    args = kvattn.layout.validate_decode(*inputs(pages), sinks=sinks)
    if backend not in claims(args, "decode"):
        pytest.skip(f"{backend} does not run sinks")
    out, lse, report = kvattn.paged_decode(
        *inputs(pages), backend=backend, return_lse=True, sinks=sinks
    )
    assert torch.equal(out[2], torch.zeros_like(out[2])) and torch.isneginf(lse[2]).all()
    assert torch.isfinite(out).all() and report.violations.tolist()[2] == 4


def test_a_large_sink_takes_the_mass_and_a_small_one_none():
    pages = decode_batch(4)
    plain = kvattn.paged_decode(*inputs(pages), backend="reference")[0]
    big = kvattn.paged_decode(
        *inputs(pages), backend="reference", sinks=torch.full((HEADS,), 80.0, device=DEVICE)
    )[0]
    small = kvattn.paged_decode(
        *inputs(pages), backend="reference", sinks=torch.full((HEADS,), -80.0, device=DEVICE)
    )[0]
    assert big.abs().max() < 1e-6
    torch.testing.assert_close(small, plain)


# --- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change,error,words",
    [
        (dict(window_left=-2), ValueError, ["window_left", "-2"]),
        (dict(window_left=2.0), TypeError, ["window_left", "float"]),
        (dict(logits_soft_cap=-1.0), ValueError, ["logits_soft_cap", "-1.0"]),
        (dict(logits_soft_cap=float("inf")), ValueError, ["logits_soft_cap", "inf"]),
        (dict(sinks=torch.zeros(3)), ValueError, ["sinks", "(4,)", "(3,)"]),
        (dict(sinks=torch.zeros(4, dtype=torch.float16)), TypeError, ["sinks", "float32"]),
        (dict(alibi_slopes=[0.5] * 4), TypeError, ["alibi_slopes", "list"]),
        (dict(k_scale=2.0), ValueError, ["k_scale", "fp8"]),
    ],
)
def test_variant_arguments_are_named(change, error, words):
    pages = decode_batch(4)
    with pytest.raises(error) as info:
        kvattn.paged_decode(*inputs(pages), backend="reference", **change)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


# vLLM's and FlashInfer's kernel tests: windows of 64/128/256 keys, soft-caps of 30 and 50.
PEER_GRID = [(window, cap) for window in (64, 128, 256) for cap in (30.0, 50.0)]
# Unit-variance q and k give logits of about 1, where a cap of 30 changes nothing; q scaled up
# so logits reach the cap's bend (tanh(s / cap) visibly below s / cap) and a missing cap fails.
PEER_Q_GAIN = 12.0


@pytest.mark.parametrize("window,cap", PEER_GRID)
def test_decode_peer_grid_windows_and_soft_caps(window, cap):
    lens = [300, 129, 65, 1]
    pages = Batch.random(
        batch=4,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=DIM,
        page_size=16,
        seq_lens=lens,
        pool_factor=2,
        seed=11,
    )
    pages.q.mul_(PEER_Q_GAIN)
    plant_foreign_page(pages, 0, 17)  # tokens 272-287: inside every window of sequence 0
    plant_foreign_page(pages, 0, 1)  # tokens 16-31: before every window
    ours = dict(window_left=window, logits_soft_cap=cap)
    args = kvattn.layout.validate_decode(*inputs(pages), **ours)
    want_out, want_lse = dense(
        pages.q,
        decode_rows(pages),
        [tokens(pages, b) for b in range(4)],
        DIM**-0.5,
        window_left=window,
        cap=cap,
    )
    reports = []
    for backend in claims(args, "decode"):
        out, lse, report = kvattn.paged_decode(
            *inputs(pages), backend=backend, return_lse=True, **ours
        )
        assert_matches(out, lse, want_out, want_lse, pages.q.dtype)
        reports.append(report)
    assert len(reports) >= 2
    for report in reports:
        assert_reports_equal(report, reports[0])
    assert reports[0].violations.tolist() == [1, 0, 0, 0]


@pytest.mark.parametrize("window,cap", PEER_GRID[::2])
def test_extend_peer_grid_windows_and_soft_caps(window, cap):
    ext = Extend.random(
        [3, 2, 1, 2],
        [297, 127, 64, 0],
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=DIM,
        page_size=16,
        pool_factor=2,
        seed=5,
    )
    ext.q.mul_(PEER_Q_GAIN)
    plant_foreign_page(ext.pages, 0, 17)
    plant_foreign_page(ext.pages, 0, 1)
    ours = dict(window_left=window, logits_soft_cap=cap)
    args = kvattn.layout.validate_extend(*ext.inputs(), causal=True, **ours)
    want_out, want_lse = dense(
        ext.q,
        ext.cu,
        [tokens(ext.pages, b) for b in range(4)],
        DIM**-0.5,
        causal=True,
        window_left=window,
        cap=cap,
    )
    reports = []
    for backend in claims(args, "extend"):
        out, lse, report = ext.run(backend, causal=True, return_lse=True, **ours)
        assert_matches(out, lse, want_out, want_lse, ext.q.dtype)
        reports.append(report)
    assert len(reports) >= 2
    for report in reports:
        assert_reports_equal(report, reports[0])
    assert reports[0].violations.tolist() == [1, 0, 0, 0]
