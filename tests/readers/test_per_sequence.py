"""Per-sequence switch values (kvattn.variants): ALiBi slopes ``[batch, num_heads]``
(FlashAttention's per-sequence ``alibi_slopes``) and fp8 KV scales ``[batch, num_kv_heads]``
(FlashAttention 3's ``k_descale``/``v_descale``), on every backend that claims them.

Against :func:`kvattn_testing.variants.dense`, the float64 definition one row at a time, with a
foreign page (NaN inside) planted where a sequence reads it; the rows of the per-sequence tensors
differ from each other, so a kernel reading another sequence's row, or row 0 for all, fails. The
twins: equal rows give exactly the per-head call; an invalid value read unvalidated silences only
its own sequence's head.
"""

from __future__ import annotations

import math

import pytest
import torch

import kvattn
from kvattn import Violation
from kvattn_testing.exactness import (
    READERS,
    SPLIT_READERS,
    assert_agrees,
    assert_reads_nothing,
    run,
)
from kvattn_testing.extend import Extend
from kvattn_testing.util import DEVICE, Batch, assert_reports_equal, claims, launcher, raises
from kvattn_testing.variants import (
    DIM,
    FP8,
    HEADS,
    KV_HEADS,
    assert_every_claim_matches,
    assert_matches,
    decode_batch,
    decode_rows,
    dense,
    inputs,
    plant_foreign_page,
    to_fp8,
    tokens,
)

# Four sequences: each row its own slopes, of both signs and sizes, so every sequence's scores
# differ from every other's.
SLOPES = torch.tensor(
    [
        [0.5, 0.25, 0.125, 0.0625],
        [-0.25, 1.0, 0.0, 0.375],
        [2.0, -0.5, 0.75, 0.01],
        [0.03125, 0.0, -1.0, 1.5],
    ]
)
K_SCALES = torch.tensor([[0.125, 0.0625], [0.25, 0.03125], [0.0625, 0.5], [0.1875, 0.125]])
V_SCALES = torch.tensor([[0.25, 0.5], [0.125, 0.0625], [0.375, 0.25], [0.5, 0.03125]])


def per_seq_tokens(pages: Batch, k_scale=None, v_scale=None):
    """:func:`kvattn_testing.variants.tokens` of every sequence, dequantised by its own row of the
    scales."""
    batch = pages.seq_lens.shape[0]
    if k_scale is None:
        return [tokens(pages, b) for b in range(batch)]
    return [tokens(pages, b, k_scale[b], v_scale[b]) for b in range(batch)]


def extend_batch(seed=0) -> Extend:
    """Four sequences of 1, 5, 3 and 2 new rows after 3, 0, 9 and 12 cached tokens; sequence 3's
    third entry a foreign page (tokens 8-11: read by every row of it)."""
    ext = Extend.random(
        [1, 5, 3, 2],
        [3, 0, 9, 12],
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=DIM,
        page_size=4,
        pool_factor=2,
        seed=seed,
    )
    plant_foreign_page(ext.pages, 3, 2)
    return ext


def assert_equal_rows_agree(op: str, x, names, shared: dict, rows: dict) -> None:
    """Backends ``names`` give the per-sequence call ``rows`` exactly the output and report of
    the shared call ``shared``."""
    for backend in names:
        want = run(op, x, backend, **shared)
        got = run(op, x, backend, **rows)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), backend
        assert_reports_equal(got[2], want[2])


# --- ALiBi [batch, num_heads] ---------------------------------------------------------------------


@pytest.mark.parametrize("page", [4, 5])
def test_decode_per_sequence_slopes_match_the_definition(page):
    pages = decode_batch(page)
    slopes = SLOPES.to(DEVICE)
    want_out, want_lse = dense(
        pages.q, decode_rows(pages), per_seq_tokens(pages), DIM**-0.5, slopes=slopes
    )
    assert_every_claim_matches("decode", pages, want_out, want_lse, alibi_slopes=slopes)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_extend_per_sequence_slopes_match_the_definition(causal):
    ext = extend_batch()
    slopes = SLOPES.to(DEVICE)
    want_out, want_lse = dense(
        ext.q, ext.cu, per_seq_tokens(ext.pages), DIM**-0.5, causal=causal, slopes=slopes
    )
    assert_every_claim_matches(
        "extend", ext, want_out, want_lse, causal=causal, alibi_slopes=slopes
    )


@pytest.mark.parametrize("op", ["decode", "extend"])
def test_equal_rows_are_the_per_head_call(op):
    """The twin of the definition tests: ``[batch, num_heads]`` slopes whose rows are all one
    ``[num_heads]`` set give that call's output and report, bit for bit, on every backend."""
    x = decode_batch(4) if op == "decode" else extend_batch()
    shared = SLOPES[1].to(DEVICE)
    assert_equal_rows_agree(
        op,
        x,
        READERS,
        dict(alibi_slopes=shared),
        dict(alibi_slopes=shared.expand(4, HEADS).contiguous()),
    )


@pytest.mark.parametrize("op", ["decode", "extend"])
def test_equal_scale_rows_are_the_per_head_call(op):
    """The same twin for fp8 scales: rows all equal to one ``[num_kv_heads]`` pair."""
    x = as_fp8(decode_batch(4) if op == "decode" else extend_batch(), op)
    shared = dict(k_scale=K_SCALES[2].to(DEVICE), v_scale=V_SCALES[2].to(DEVICE))
    rows = {k: v.expand(4, KV_HEADS).contiguous() for k, v in shared.items()}
    assert_equal_rows_agree(op, x, fp8_readers(op, x, **rows), shared, rows)


# --- fp8 scales [batch, num_kv_heads] -------------------------------------------------------------

# Which scale is per sequence: both, K's only (V per tensor) or V's only (K per head); the readers
# take both with one stride, so the other one is widened.
SCALE_FORMS = ["both", "k-only", "v-only"]


def scales_of(form: str):
    """``(k_scale, v_scale)`` as passed, and both as ``[batch, num_kv_heads]`` for the definition."""
    ks, vs = K_SCALES.to(DEVICE), V_SCALES.to(DEVICE)
    if form == "both":
        return (ks, vs), (ks.cpu(), vs.cpu())
    if form == "k-only":
        return (ks, 0.25), (ks.cpu(), torch.full((4, KV_HEADS), 0.25))
    head = torch.tensor([0.0625, 0.25])
    return (head.to(DEVICE), vs), (head.expand(4, KV_HEADS), vs.cpu())


@pytest.mark.parametrize("form", SCALE_FORMS)
@pytest.mark.parametrize("fmt", list(FP8))
def test_decode_per_sequence_scales_match_the_definition(fmt, form):
    pages = to_fp8(decode_batch(4), FP8[fmt])
    (k_scale, v_scale), (ks, vs) = scales_of(form)
    want_out, want_lse = dense(
        pages.q, decode_rows(pages), per_seq_tokens(pages, ks, vs), DIM**-0.5
    )
    args = kvattn.layout.validate_decode(*inputs(pages), k_scale=k_scale, v_scale=v_scale)
    assert tuple(args.variant.v_scale.shape) == (4, KV_HEADS)
    assert_every_claim_matches(
        "decode", pages, want_out, want_lse, k_scale=k_scale, v_scale=v_scale
    )


@pytest.mark.parametrize("form", SCALE_FORMS)
@pytest.mark.parametrize("fmt", list(FP8))
def test_extend_per_sequence_scales_match_the_definition(fmt, form):
    ext = extend_batch()
    to_fp8(ext.pages, FP8[fmt])
    (k_scale, v_scale), (ks, vs) = scales_of(form)
    want_out, want_lse = dense(ext.q, ext.cu, per_seq_tokens(ext.pages, ks, vs), DIM**-0.5)
    assert_every_claim_matches("extend", ext, want_out, want_lse, k_scale=k_scale, v_scale=v_scale)


@pytest.mark.parametrize("num_splits", [2, 5])
def test_split_decode_reads_each_sequence_s_values(num_splits):
    """The split-KV path with both per-sequence switches: each split of a sequence applies that
    sequence's slopes and scales (V's once, before the merge)."""
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
    plant_foreign_page(pages, 0, 20)
    to_fp8(pages, torch.float8_e4m3fn)
    slopes = (SLOPES / 16).to(DEVICE)  # 90 keys: distances large enough to matter, not to swamp
    switches = dict(alibi_slopes=slopes, k_scale=K_SCALES.to(DEVICE), v_scale=V_SCALES.to(DEVICE))
    want_out, want_lse = dense(
        pages.q,
        decode_rows(pages),
        per_seq_tokens(pages, K_SCALES, V_SCALES),
        DIM**-0.5,
        slopes=slopes,
    )
    args = kvattn.layout.validate_decode(*inputs(pages), **switches)
    kernels = [n for n in claims(args, "decode") if n in SPLIT_READERS]
    assert kernels, "every split-KV backend reads fp8 pools with ALiBi"
    for backend in kernels:
        out = torch.empty_like(pages.q)
        lse = torch.empty(pages.q.shape[:2], dtype=torch.float32, device=DEVICE)
        report = launcher(backend).decode(args, check=True, out=out, lse=lse, num_splits=num_splits)
        assert_matches(out, lse, want_out, want_lse, pages.q.dtype)
        assert report.violations.tolist() == [1, 0, 0, 0]


# --- values: refused on the host, or silencing one sequence's head ---------------------------------


def clean_batch(op: str):
    """Two sequences that both read (no refused page), so a silenced head shows in one only."""
    if op == "decode":
        return Batch.random(
            batch=2,
            num_heads=HEADS,
            num_kv_heads=KV_HEADS,
            head_dim=DIM,
            page_size=4,
            seq_lens=[5, 9],
            pool_factor=2,
            seed=2,
        )
    return Extend.random(
        [2, 3],
        [3, 6],
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=DIM,
        page_size=4,
        pool_factor=2,
        seed=2,
    )


def rows_of(op: str, b: int) -> list[int]:
    if op == "decode":
        return [b]
    return [0, 1] if b == 0 else [2, 3, 4]


def as_fp8(x, op: str):
    pages = x if op == "decode" else x.pages
    to_fp8(pages, torch.float8_e4m3fn)
    return x


def fp8_readers(op: str, x, **scales) -> list[str]:
    """The backends under test that claim ``x`` over fp8 pools with ``scales``."""
    pages = x if op == "decode" else x.pages
    args = (
        kvattn.layout.validate_decode(*inputs(pages), validate=False, **scales)
        if op == "decode"
        else kvattn.layout.validate_extend(*x.inputs(), validate=False, **scales)
    )
    names = [n for n in READERS if n in claims(args, op)]
    assert "reference" in names and len(names) >= 2
    return names


@pytest.mark.parametrize("op", ["decode", "extend"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, 2.0**33])
def test_invalid_per_sequence_slope_is_refused_on_the_host(op, bad):
    slopes = SLOPES[:2].clone()
    slopes[1, 2] = bad
    for backend in READERS:
        with raises(ValueError, "alibi_slopes", "sequence 1, head 2"):
            run(op, clean_batch(op), backend, validate=True, alibi_slopes=slopes.to(DEVICE))


@pytest.mark.parametrize("op", ["decode", "extend"])
@pytest.mark.parametrize("bad", [math.nan, -math.inf])
def test_unvalidated_invalid_slope_silences_only_its_sequence(op, bad):
    """Sequence 1's head 2 reads nothing (0, lse -inf); head 2 of sequence 0, the other heads and
    the report are those of valid slopes, on every backend."""
    x = clean_batch(op)
    valid = SLOPES[:2].clone().to(DEVICE)
    slopes = valid.clone()
    slopes[1, 2] = bad
    want = run(op, x, "reference", validate=False, alibi_slopes=slopes)
    twin = run(op, x, "reference", validate=False, alibi_slopes=valid)
    assert_reads_nothing(want[0], want[1], rows_of(op, 1), [2])
    kept = torch.ones_like(want[1], dtype=torch.bool)
    kept[rows_of(op, 1), 2] = False
    torch.testing.assert_close(want[0][kept], twin[0][kept])
    assert torch.isfinite(want[1][rows_of(op, 0), 2]).all()
    assert_reports_equal(want[2], twin[2])
    for backend in READERS:
        assert_agrees(run(op, x, backend, validate=False, alibi_slopes=slopes), want)


@pytest.mark.parametrize("op", ["decode", "extend"])
def test_invalid_per_sequence_scale_is_refused_on_the_host(op):
    x = as_fp8(clean_batch(op), op)
    k_scale = K_SCALES[:2].clone()
    k_scale[0, 1] = 0.0
    scales = dict(k_scale=k_scale.to(DEVICE), v_scale=V_SCALES[:2].to(DEVICE))
    for backend in READERS:
        with raises(ValueError, "k_scale", "sequence 0, KV head 1"):
            run(op, x, backend, validate=True, **scales)


def test_a_widened_scale_s_error_names_its_kv_head_only():
    """A per-head ``v_scale`` beside a per-sequence ``k_scale`` is widened for the kernels; its
    error still speaks of the tensor as given."""
    x = as_fp8(clean_batch("decode"), "decode")
    v_scale = torch.tensor([0.25, math.inf], device=DEVICE)
    with pytest.raises(ValueError) as info:
        run(
            "decode",
            x,
            "reference",
            validate=True,
            k_scale=K_SCALES[:2].to(DEVICE),
            v_scale=v_scale,
        )
    message = str(info.value)
    assert "v_scale" in message and "for KV head 1" in message and "sequence" not in message


@pytest.mark.parametrize("op", ["decode", "extend"])
@pytest.mark.parametrize("name", ["k_scale", "v_scale"])
def test_unvalidated_invalid_scale_silences_only_its_sequence(op, name):
    """Sequence 0's KV head 1 (query heads 2 and 3) reads nothing; sequence 1 and KV head 0 are
    as with valid scales, on every backend that reads fp8 pools."""
    x = as_fp8(clean_batch(op), op)
    valid = dict(k_scale=K_SCALES[:2].to(DEVICE), v_scale=V_SCALES[:2].to(DEVICE))
    scales = {k: v.clone() for k, v in valid.items()}
    scales[name][0, 1] = math.nan
    want = run(op, x, "reference", validate=False, **scales)
    twin = run(op, x, "reference", validate=False, **valid)
    assert_reads_nothing(want[0], want[1], rows_of(op, 0), [2, 3])
    kept = torch.ones_like(want[1], dtype=torch.bool)
    kept[rows_of(op, 0), 2:] = False
    torch.testing.assert_close(want[0][kept], twin[0][kept])
    assert torch.isfinite(want[1][rows_of(op, 1)]).all()
    assert_reports_equal(want[2], twin[2])
    for backend in fp8_readers(op, x, **scales):
        assert_agrees(run(op, x, backend, validate=False, **scales), want)


# --- shapes --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change,words",
    [
        (
            dict(alibi_slopes=torch.zeros(5, HEADS)),
            ["alibi_slopes", f"(4, {HEADS})", f"(5, {HEADS})"],
        ),
        (
            dict(alibi_slopes=torch.zeros(4, HEADS + 1)),
            ["alibi_slopes", f"({HEADS},)", f"(4, {HEADS + 1})"],
        ),
        (dict(alibi_slopes=torch.zeros(4, HEADS, 1)), ["alibi_slopes", f"(4, {HEADS}, 1)"]),
        (
            dict(k_scale=torch.ones(3, KV_HEADS)),
            ["k_scale", f"(4, {KV_HEADS})", f"(3, {KV_HEADS})"],
        ),
        (
            dict(v_scale=torch.ones(4, KV_HEADS + 1)),
            ["v_scale", f"({KV_HEADS},)", f"(4, {KV_HEADS + 1})"],
        ),
    ],
)
@pytest.mark.parametrize("op", ["decode", "extend"])
def test_per_sequence_shapes_are_named(op, change, words):
    """The batch is the sequences' count: decode's rows, extend's ``cu_seqlens_q`` entries (11
    query rows over 4 sequences)."""
    x = decode_batch(4) if op == "decode" else extend_batch()
    if "alibi_slopes" not in change:
        as_fp8(x, op)
    change = {k: v.to(DEVICE) for k, v in change.items()}
    with pytest.raises(ValueError) as info:
        run(op, x, "reference", **change)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_extend_per_sequence_rows_are_not_per_query_row():
    """Extend's per-sequence values have one row per sequence, not per query row."""
    ext = extend_batch()
    assert ext.q.shape[0] == 11
    with raises(ValueError, "alibi_slopes", f"(4, {HEADS})", f"(11, {HEADS})"):
        run("extend", ext, "reference", alibi_slopes=torch.zeros(11, HEADS, device=DEVICE))
    run("extend", ext, "reference", alibi_slopes=SLOPES.to(DEVICE))


def test_a_variant_holds_both_scales_in_one_form():
    """The kernels read K's and V's scales with one stride: a Variant with one per sequence and
    the other per head is refused where it is built."""
    with raises(ValueError, "k_scale, v_scale", "(4, 2)", "(2,)"):
        kvattn.variants.Variant(k_scale=torch.ones(4, 2), v_scale=torch.ones(2))


def test_the_writer_takes_no_per_sequence_scale():
    """A page holds one scale whichever sequence reads it: the writer quantises by a per-tensor
    or per-head scale and names a per-sequence one; its per-head twin writes."""
    k_cache = torch.zeros(4, 4, KV_HEADS, DIM, dtype=torch.float8_e4m3fn)
    v_cache = torch.zeros_like(k_cache)
    tags = torch.zeros(4, dtype=torch.int64)
    kvattn.reserve_pages(tags, [1], 1)
    k = torch.randn(2, KV_HEADS, DIM, generator=torch.Generator().manual_seed(0)).half()
    mapping = torch.tensor([4, 5])
    with raises(ValueError, "k_scale", f"({KV_HEADS},)", f"(3, {KV_HEADS})", "for the readers"):
        kvattn.write_kv(k, k, k_cache, v_cache, mapping, tags, 1, k_scale=K_SCALES[:3], v_scale=0.5)
    with raises(ValueError, "v_scale", f"(3, {KV_HEADS})"):
        kvattn.write_kv(k, k, k_cache, v_cache, mapping, tags, 1, k_scale=0.5, v_scale=V_SCALES[:3])
    result = kvattn.write_kv(
        k, k, k_cache, v_cache, mapping, tags, 1, k_scale=K_SCALES[0], v_scale=0.5
    )
    assert result.landed.tolist() == [True, True]


def test_a_refused_sequence_stays_refused_whatever_its_values():
    """The switch values never make a page readable: a sequence whose pages are all foreign gets
    0 and lse -inf under its own slopes and scales, and the report names the page."""
    pages = to_fp8(decode_batch(4), torch.float8_e4m3fn)
    for i in range(4):  # all four pages of its 14 tokens
        plant_foreign_page(pages, 2, i)
    switches = dict(
        alibi_slopes=SLOPES.to(DEVICE), k_scale=K_SCALES.to(DEVICE), v_scale=V_SCALES.to(DEVICE)
    )
    args = kvattn.layout.validate_decode(*inputs(pages), **switches)
    for backend in claims(args, "decode"):
        out, lse, report = kvattn.paged_decode(
            *inputs(pages), backend=backend, return_lse=True, **switches
        )
        assert torch.equal(out[2], torch.zeros_like(out[2])) and torch.isneginf(lse[2]).all()
        assert report.violations.tolist() == [0, 0, 4, 1]
        assert int(report.reasons[2]) & int(Violation.OWNER_MISMATCH)
