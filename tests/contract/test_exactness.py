"""Every variant fails closed identically on every backend.

Each test poisons (NaN) what the contract says a call does not read, or passes a switch value it
refuses, and compares every reader backend (reference, torch, triton under the interpreter,
cuda_sim) with the reference: report fields exactly, outputs and LSEs within the tolerances of
tests/kvattn_testing/util.py. Each has a twin where the same poison is read, or the same value is
valid, so a test that passed by accident would show. One section per rule:

- 1, 2: a sliding window never loads the slots of a straddling page before every query's window
  (decode and extend);
- 3: a query sits at ``seq_len - 1`` (extend rows at ``seq_len - q_len + j``) even for an
  unvalidated ``seq_len`` past the table, up to 2**31 - 1 under ALiBi;
- 6, 7: a soft-cap or a float fp8 scale outside ``[2**-126, 2**126]`` raises a ValueError naming
  it, in the readers and the writers;
- 4, 5, 8: a sink of -inf is no sink; NaN/+inf sinks, fp8 scale tensors outside that range and
  ALiBi slopes past 2**32 or not finite raise a ValueError naming the argument where the values
  are on the host, and unvalidated make the head read nothing (output 0, lse -inf);
- 9: the page-level writers refuse layered tags whose rows overlap in memory.
"""

from __future__ import annotations

import math

import pytest
import torch

import kvattn
from kvattn import backends
from kvattn_testing.exactness import (
    F16,
    READERS,
    SPLIT_READERS,
    assert_agrees,
    assert_reads_nothing,
    run,
)
from kvattn_testing.extend import Extend
from kvattn_testing.util import Batch, assert_reports_equal, claims, launcher, raises, tolerance

HEADS, KV_HEADS, DIM = 4, 2, 16
NAN = math.nan


def decode_batch(seq_lens, page_size=4, seed=0, **kwargs) -> Batch:
    return Batch.random(
        batch=len(seq_lens),
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=DIM,
        page_size=page_size,
        seq_lens=seq_lens,
        pool_factor=2,
        seed=seed,
        **kwargs,
    )


def extend_batch(q_lens, prefixes, page_size=4, seed=0) -> Extend:
    return Extend.random(
        q_lens,
        prefixes,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=DIM,
        page_size=page_size,
        pool_factor=2,
        seed=seed,
    )


def poison_slots(pages: Batch, b: int, first: int, last: int) -> None:
    """NaN into K and V of sequence ``b``'s tokens ``[first, last)``, tags untouched (the slots stay
    certified as written: only the window decides they are not read)."""
    size = pages.k_cache.shape[1]
    for t in range(first, last):
        page = int(pages.block_table[b, t // size])
        pages.k_cache[page, t % size] = NAN
        pages.v_cache[page, t % size] = NAN


def refused_batch(op: str, first_len: int = 5):
    """Sequence 1 (9 tokens) reads nothing: every page of it FREE (its bytes NaN)."""
    x = decode_batch([first_len, 9]) if op == "decode" else extend_batch([2, 3], [first_len - 2, 6])
    pages = x if op == "decode" else x.pages
    for i in range(3):
        page = int(pages.block_table[1, i])
        pages.page_tags[page] = kvattn.FREE_TAG
        pages.k_cache[page] = NAN
        pages.v_cache[page] = NAN
    return x


def rows_of(op: str, b: int) -> list[int]:
    """The output rows of sequence ``b`` of :func:`refused_batch`."""
    if op == "decode":
        return [b]
    return [0, 1] if b == 0 else [2, 3, 4]


# --- 1, 2: slots of a straddling page before every query's window ---------------------------------

DECODE_WINDOWS = [(5, 23, 0), (4, 18, 2), (3, 31, 4)]  # (page size, seq_len, window_left)


@pytest.mark.parametrize("backend", READERS)
@pytest.mark.parametrize("page, seq_len, window", DECODE_WINDOWS)
def test_decode_window_never_reads_the_head_of_its_first_page(backend, page, seq_len, window):
    """The query at seq_len - 1 reads keys from seq_len - 1 - window on; the slots of that key's
    page before it hold NaN (written for the owner: stale, as a sliding-window cache leaves them)
    and must not reach the output."""
    clean = decode_batch([seq_len], page)
    first = seq_len - 1 - window
    assert first % page, "the window must start inside a page"
    want = clean.reference(return_lse=True, window_left=window)
    pages = decode_batch([seq_len], page)
    poison_slots(pages, 0, first // page * page, first)
    got = run("decode", pages, backend, window_left=window)
    assert_agrees(got, want)
    assert want[2].pages_checked.tolist() == [-(-seq_len // page) - first // page]


@pytest.mark.parametrize("backend", READERS)
def test_decode_window_reaching_the_poison_reads_it(backend):
    """The twin: one key wider, the window covers the last poisoned slot, and every backend's output
    is NaN there (the poison is placed where a window edge one slot off would read it)."""
    page, seq_len, window = DECODE_WINDOWS[0]
    pages = decode_batch([seq_len], page)
    first = seq_len - 1 - window
    poison_slots(pages, 0, first // page * page, first)
    out, _, _ = run("decode", pages, backend, window_left=window + 1)
    assert torch.isnan(out).all()


EXTEND_WINDOWS = [(3, 26, 5, 4), (4, 13, 3, 2)]  # (page size, prefix, q_len, window_left)


@pytest.mark.parametrize("backend", READERS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("page, prefix, q_len, window", EXTEND_WINDOWS)
def test_extend_window_never_reads_before_every_rows_window(
    backend, causal, page, prefix, q_len, window
):
    """Row 0 sits at position prefix and reads keys from prefix - window on, every later row from
    further on: the slots of that key's page before it are read by no row. Poisoned, they must
    reach no row (a kernel that loads them for the tile gives every row 0 * NaN)."""
    first = prefix - window
    assert first % page, "the window must start inside a page"
    want = extend_batch([q_len], [prefix], page).reference(causal=causal, window_left=window)
    ext = extend_batch([q_len], [prefix], page)
    poison_slots(ext.pages, 0, first // page * page, first)
    got = run("extend", ext, backend, causal=causal, window_left=window)
    assert_agrees(got, want)


@pytest.mark.parametrize("backend", READERS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_extend_window_reaching_the_poison_reads_it(backend, causal):
    """The twin: one key wider, row 0's window covers the last poisoned slot: its output is NaN on
    every backend."""
    page, prefix, q_len, window = EXTEND_WINDOWS[0]
    ext = extend_batch([q_len], [prefix], page)
    first = prefix - window
    poison_slots(ext.pages, 0, first // page * page, first)
    out, _, _ = run("extend", ext, backend, causal=causal, window_left=window + 1)
    assert torch.isnan(out[0]).all()


# --- 3: a window with an unvalidated seq_len past the table ---------------------------------------

# (seq_len, window_left, alibi): the table holds 12 tokens (3 pages of 4).
BEYOND = [(14, 5, False), (14, 5, True), (13, 1, True), (30, 3, False), (15, 20, True)]
SLOPES = [0.5, 0.25, 0.125, 2.0**-10]


def beyond_the_table(op: str, seq_len: int, held: int = 12):
    """Sequence 0's pages hold ``held`` tokens (the table's width) and its seq_len says
    ``seq_len``; sequence 1 is an ordinary one."""
    if op == "decode":
        x = decode_batch([held, 7])
        pages = x
    else:
        x = extend_batch([2, 3], [held - 2, 4])
        pages = x.pages
    pages.seq_lens[0] = seq_len
    return x


def variant_args(window, alibi):
    kwargs = dict(window_left=window)
    if alibi:
        kwargs["alibi_slopes"] = torch.tensor(SLOPES)
    return kwargs


@pytest.mark.parametrize("backend", READERS)
@pytest.mark.parametrize("op", ["decode", "extend"])
@pytest.mark.parametrize("seq_len, window, alibi", BEYOND)
def test_window_past_the_table_places_the_query_at_seq_len(backend, op, seq_len, window, alibi):
    """kvattn.variants: the query sits at seq_len - 1 (extend rows at seq_len - q_len + j) whatever
    the table holds; the window starts and ALiBi measures from there, nothing past the table is
    read and the length counts one OUT_OF_RANGE. Every backend agrees on output, lse and report
    (pages_checked: the pages of the window inside the table)."""
    x = beyond_the_table(op, seq_len)
    kwargs = variant_args(window, alibi)
    want = run(op, x, "reference", validate=False, **kwargs)
    report = want[2]
    assert report.beyond_table.tolist() == [1, 0] and report.violations.tolist() == [1, 0]
    first = max(0, seq_len - (1 if op == "decode" else 2) - window)
    assert report.pages_checked.tolist()[0] == max(0, 3 - first // 4)
    got = run(op, x, backend, validate=False, **kwargs)
    assert_agrees(got, want)


# Lengths far past the table, where the distance from a key to the query no longer fits
# float32's 24-bit significand: a logit of slope * (key - q_pos) would keep no digit that tells two
# keys apart, and each backend rounded it its own way (by up to 6.95 in the output, before ALiBi
# was measured from each row's anchor, kvattn.variants.alibi_anchor).
FAR = [2**24 + 5, 2**31 - 1]


@pytest.mark.parametrize("backend", READERS)
@pytest.mark.parametrize("op, causal", [("decode", True), ("extend", True), ("extend", False)])
@pytest.mark.parametrize("seq_len", FAR)
def test_alibi_far_past_the_table_agrees(backend, op, causal, seq_len):
    """Every backend gives the softmax over the keys the table holds that the slopes' distances
    from seq_len - 1 define (the same as from the table's last key: the difference is one constant
    per row), and an lse within float32's relative rounding of ``slope * seq_len``."""
    x = beyond_the_table(op, seq_len)
    kwargs = variant_args(-1, True) | ({} if op == "decode" else {"causal": causal})
    want = run(op, x, "reference", validate=False, **kwargs)
    assert want[2].beyond_table.tolist() == [1, 0]
    assert_agrees(run(op, x, backend, validate=False, **kwargs), want)


# The same over a table of 36 tokens (9 pages): windows that span several 16-token splits.
BEYOND_SPLITS = [(40, 20, True), (40, 20, False), (38, 30, True), (60, 3, False)]
BEYOND_SPLITS += [(seq_len, -1, True) for seq_len in FAR]


@pytest.mark.parametrize("backend", SPLIT_READERS)
@pytest.mark.parametrize("num_splits", [2, 3])
@pytest.mark.parametrize("seq_len, window, alibi", BEYOND_SPLITS)
def test_window_past_the_table_across_splits(backend, num_splits, seq_len, window, alibi):
    """The split-KV path of the decode kernels: the splits cover the window from the same first key,
    and the merge spans the same splits."""
    pages = beyond_the_table("decode", seq_len, held=36)
    kwargs = variant_args(window, alibi)
    want = run("decode", pages, "reference", validate=False, **kwargs)
    args = kvattn.layout.validate_decode(
        pages.q,
        pages.k_cache,
        pages.v_cache,
        pages.block_table,
        pages.seq_lens,
        pages.page_tags,
        pages.expected,
        validate=False,
        **kwargs,
    )
    out = torch.empty_like(pages.q)
    lse = torch.empty(pages.q.shape[:2], dtype=torch.float32)
    report = launcher(backend).decode(args, check=True, out=out, lse=lse, num_splits=num_splits)
    assert_agrees((out, lse, report), want)


@pytest.mark.parametrize("backend", READERS)
@pytest.mark.parametrize("op", ["decode", "extend"])
def test_window_inside_the_table_agrees(backend, op):
    """The twin: the same call with the length the table holds."""
    x = beyond_the_table(op, 12)
    kwargs = variant_args(5, True)
    want = run(op, x, "reference", validate=False, **kwargs)
    assert not want[2].any()
    assert_agrees(run(op, x, backend, validate=False, **kwargs), want)


# --- 6, 7: soft-caps and float scales outside the float32 normal range ----------------------------


@pytest.mark.parametrize("op", ["decode", "extend"])
@pytest.mark.parametrize("cap", [1e39, 2.0**127, 1e-39, 2.0**-127, 10**400])
def test_soft_cap_outside_the_float32_normal_range_is_named(op, cap):
    x = refused_batch(op)
    with raises(ValueError, "logits_soft_cap", repr(cap)):
        run(op, x, "reference", logits_soft_cap=cap)


@pytest.mark.parametrize("op", ["decode", "extend"])
def test_soft_cap_at_the_upper_end_is_taken(op):
    """The twin: 2**126 is a valid cap, which leaves logits of order 1 as they are."""
    x = refused_batch(op)
    want = run(op, x, "reference", logits_soft_cap=2.0**126)
    torch.testing.assert_close(want[0], run(op, x, "reference")[0], **tolerance(F16))


@pytest.mark.parametrize("backend", READERS)
@pytest.mark.parametrize("op", ["decode", "extend"])
def test_soft_cap_at_the_lower_end_agrees(backend, op):
    """2**-126 is valid too: it flattens the logits to uniform weights, on every backend."""
    x = refused_batch(op)
    want = run(op, x, "reference", logits_soft_cap=2.0**-126)
    assert_agrees(run(op, x, backend, logits_soft_cap=2.0**-126), want)


def fp8_batch(op: str):
    """:func:`refused_batch` with e4m3 pools (values scaled into its range, NaN stays NaN)."""
    x = refused_batch(op)
    pages = x if op == "decode" else x.pages
    pages.k_cache = (pages.k_cache.float() * 8).to(torch.float8_e4m3fn)
    pages.v_cache = (pages.v_cache.float() * 8).to(torch.float8_e4m3fn)
    return x


FLOAT_SCALES = [1e39, 1e300, 2.0**127, 1e-39, 2.0**-127]


@pytest.mark.parametrize("op", ["decode", "extend"])
@pytest.mark.parametrize("name", ["k_scale", "v_scale"])
@pytest.mark.parametrize("bad", FLOAT_SCALES)
def test_float_scale_outside_the_range_is_named_by_the_readers(op, name, bad):
    """Raised by the validation every reader backend shares, before one is chosen (torch's own
    RuntimeError converting 1e39 to float32 before)."""
    x = fp8_batch(op)
    with raises(ValueError, name, repr(bad)):
        run(op, x, "reference", **{name: bad})


def fp8_writer_args():
    k_cache = torch.full((4, 4, KV_HEADS, DIM), NAN).to(torch.float8_e4m3fn)
    tags = torch.zeros(4, dtype=torch.int64)
    kvattn.reserve_pages(tags, [0], 1)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(2, KV_HEADS, DIM, generator=g).to(F16)
    return k, k.clone(), k_cache, k_cache.clone(), torch.tensor([0, 1]), tags


def fp8_writers() -> list[str]:
    k, v, k_cache, v_cache, mapping, tags = fp8_writer_args()
    args = kvattn.write_args.validate_write_kv(k, v, k_cache, v_cache, mapping, tags, 1)
    reasons = backends.explain(args, op="write_kv")
    return [n for n in ("torch", "triton") if reasons[n] is None]


@pytest.mark.parametrize("writer", fp8_writers())
@pytest.mark.parametrize("name", ["k_scale", "v_scale"])
@pytest.mark.parametrize("bad", FLOAT_SCALES)
def test_float_scale_outside_the_range_is_named_by_the_writers(writer, name, bad):
    k, v, k_cache, v_cache, mapping, tags = fp8_writer_args()
    before = tags.clone()
    with raises(ValueError, name, repr(bad)):
        kvattn.write_kv(k, v, k_cache, v_cache, mapping, tags, 1, backend=writer, **{name: bad})
    assert torch.equal(tags, before)


@pytest.mark.parametrize("writer", fp8_writers())
@pytest.mark.parametrize("scale", [2.0**-126, 2.0**126])
def test_float_scales_at_the_range_ends_write(writer, scale):
    """The twin: the ends of the range are scales the writers take."""
    k, v, k_cache, v_cache, mapping, tags = fp8_writer_args()
    result = kvattn.write_kv(
        k, v, k_cache, v_cache, mapping, tags, 1, backend=writer, k_scale=scale, v_scale=scale
    )
    assert result.landed.tolist() == [True, True]


# --- 4: sinks of -inf (no sink), NaN and +inf -----------------------------------------------------

NO_SINK = [-math.inf] * HEADS
MIXED_SINKS = [-math.inf, 0.5, -math.inf, 1.5]


@pytest.mark.parametrize("backend", READERS)
@pytest.mark.parametrize("op", ["decode", "extend"])
@pytest.mark.parametrize("sinks", [NO_SINK, MIXED_SINKS], ids=["all", "mixed"])
def test_minus_inf_sink_is_no_sink(backend, op, sinks):
    """A head whose sink is -inf computes as without a sink; a row with nothing readable still gives
    output 0 and lse -inf (not -inf - -inf)."""
    x = refused_batch(op)
    sinks = torch.tensor(sinks)
    want = run(op, x, "reference", sinks=sinks)
    plain = run(op, x, "reference")
    none = torch.isneginf(sinks)
    torch.testing.assert_close(want[0][:, none], plain[0][:, none])
    torch.testing.assert_close(want[1], plain[1])
    assert_reads_nothing(want[0], want[1], rows_of(op, 1), list(range(HEADS)))
    assert_agrees(run(op, x, backend, sinks=sinks), want)


BAD_SINKS = [NAN, math.inf]


@pytest.mark.parametrize("backend", READERS)
@pytest.mark.parametrize("op", ["decode", "extend"])
@pytest.mark.parametrize("bad", BAD_SINKS)
def test_nan_or_inf_sink_is_refused_on_the_host(backend, op, bad):
    sinks = torch.tensor([0.5, bad, 0.0, 1.0])
    with raises(ValueError, "sinks", repr(bad), "head 1"):
        run(op, refused_batch(op), backend, sinks=sinks)


@pytest.mark.parametrize("backend", READERS)
@pytest.mark.parametrize("op", ["decode", "extend"])
@pytest.mark.parametrize("bad", BAD_SINKS)
def test_unvalidated_invalid_sink_head_reads_nothing(backend, op, bad):
    """On the device path the head with the invalid sink reads nothing (0, lse -inf); the other
    heads and the report are those of the valid sinks."""
    x = refused_batch(op)
    valid = torch.tensor([0.5, -1.0, 0.0, 1.0])
    sinks = valid.clone()
    sinks[1] = bad
    want = run(op, x, "reference", validate=False, sinks=sinks)
    twin = run(op, x, "reference", validate=False, sinks=valid)
    rows = list(range(want[0].shape[0]))
    assert_reads_nothing(want[0], want[1], rows, [1])
    for h in (0, 2, 3):
        torch.testing.assert_close(want[0][:, h], twin[0][:, h])
    assert_reports_equal(want[2], twin[2])
    assert_agrees(run(op, x, backend, validate=False, sinks=sinks), want)


@pytest.mark.parametrize("backend", SPLIT_READERS)
@pytest.mark.parametrize(
    "sinks",
    [NO_SINK, MIXED_SINKS, [0.5, NAN, math.inf, -math.inf]],
    ids=["all", "mixed", "invalid"],
)
def test_sinks_across_splits(backend, sinks):
    """The merge of split-KV decode: a -inf sink is no sink there too, an invalid one reads nothing,
    and a refused sequence merges to 0 and -inf (sequence 0's 40 tokens span three 16-token
    splits)."""
    pages = refused_batch("decode", first_len=40)
    sinks = torch.tensor(sinks)
    want = run("decode", pages, "reference", validate=False, sinks=sinks)
    args = kvattn.layout.validate_decode(
        pages.q,
        pages.k_cache,
        pages.v_cache,
        pages.block_table,
        pages.seq_lens,
        pages.page_tags,
        pages.expected,
        validate=False,
        sinks=sinks,
    )
    out = torch.empty_like(pages.q)
    lse = torch.empty(pages.q.shape[:2], dtype=torch.float32)
    report = launcher(backend).decode(args, check=True, out=out, lse=lse, num_splits=3)
    assert_agrees((out, lse, report), want)


# --- 5: fp8 scale tensors -------------------------------------------------------------------------

BAD_SCALES = [NAN, math.inf, 0.0, -0.5, 2.0**127, 2.0**-127]


def fp8_readers(op: str, x, **kwargs) -> list[str]:
    pages = x if op == "decode" else x.pages
    if op == "decode":
        args = kvattn.layout.validate_decode(
            pages.q,
            pages.k_cache,
            pages.v_cache,
            pages.block_table,
            pages.seq_lens,
            pages.page_tags,
            pages.expected,
            validate=False,
            **kwargs,
        )
    else:
        args = kvattn.layout.validate_extend(*x.inputs(), validate=False, **kwargs)
    return [n for n in claims(args, op) if n in READERS]


@pytest.mark.parametrize("op", ["decode", "extend"])
@pytest.mark.parametrize("name", ["k_scale", "v_scale"])
@pytest.mark.parametrize("bad", BAD_SCALES)
def test_invalid_scale_tensor_is_refused_on_the_host(op, name, bad):
    x = fp8_batch(op)
    scales = dict(k_scale=torch.tensor([0.125, 0.25]), v_scale=torch.tensor([0.125, 0.25]))
    scales[name][1] = bad
    for backend in fp8_readers(op, x, **scales):
        with raises(ValueError, name, "KV head 1"):
            run(op, x, backend, **scales)


@pytest.mark.parametrize("op", ["decode", "extend"])
@pytest.mark.parametrize("name", ["k_scale", "v_scale"])
@pytest.mark.parametrize("bad", BAD_SCALES)
def test_unvalidated_invalid_scale_kv_head_reads_nothing(op, name, bad):
    """Device path: the query heads of KV head 1 (heads 2 and 3) read nothing; KV head 0's heads and
    the report are those of valid scales, on every backend that reads fp8 pools."""
    x = fp8_batch(op)
    valid = dict(k_scale=torch.tensor([0.125, 0.25]), v_scale=torch.tensor([0.125, 0.25]))
    scales = {k: v.clone() for k, v in valid.items()}
    scales[name][1] = bad
    want = run(op, x, "reference", validate=False, **scales)
    twin = run(op, x, "reference", validate=False, **valid)
    rows = list(range(want[0].shape[0]))
    assert_reads_nothing(want[0], want[1], rows, [2, 3])
    torch.testing.assert_close(want[0][:, :2], twin[0][:, :2])
    assert_reports_equal(want[2], twin[2])
    names = fp8_readers(op, x, **scales)
    assert "reference" in names and len(names) >= 2
    for backend in names:
        assert_agrees(run(op, x, backend, validate=False, **scales), want)


@pytest.mark.parametrize("op", ["decode", "extend"])
def test_scales_in_range_read_on_every_backend(op):
    """The twin: valid scales are read, identically on every backend (2**-126, the range's lower
    end, flattens KV head 1's logits to uniform weights); a refused sequence still gives 0."""
    x = fp8_batch(op)
    scales = dict(k_scale=torch.tensor([0.125, 2.0**-126]), v_scale=torch.tensor([0.25, 0.0625]))
    want = run(op, x, "reference", **scales)
    assert_reads_nothing(want[0], want[1], rows_of(op, 1), list(range(HEADS)))
    names = fp8_readers(op, x, **scales)
    assert len(names) >= 2
    for backend in names:
        assert_agrees(run(op, x, backend, **scales), want)


@pytest.mark.parametrize("op", ["decode", "extend"])
def test_scale_tensors_at_the_range_ends_pass_the_host_check(op):
    x = fp8_batch(op)
    ends = torch.tensor([2.0**-126, 2.0**126])
    validate = kvattn.layout.validate_decode if op == "decode" else kvattn.layout.validate_extend
    inputs = (
        (x.q, x.k_cache, x.v_cache, x.block_table, x.seq_lens, x.page_tags, x.expected)
        if op == "decode"
        else x.inputs()
    )
    args = validate(*inputs, validate=True, k_scale=ends, v_scale=ends.flip(0))
    assert torch.equal(args.variant.k_scale, ends)


@pytest.mark.parametrize("writer", fp8_writers())
def test_writer_scale_tensor_outside_the_range_is_refused(writer):
    """The writers take the readers' range for scale tensors on the host: 2**127 is finite and
    positive but outside it."""
    k, v, k_cache, v_cache, mapping, tags = fp8_writer_args()
    with raises(ValueError, "k_scale", "KV head 1"):
        kvattn.write_kv(
            k,
            v,
            k_cache,
            v_cache,
            mapping,
            tags,
            1,
            backend=writer,
            k_scale=torch.tensor([1.0, 2.0**127]),
        )


# --- 8: ALiBi slopes ------------------------------------------------------------------------------

BAD_SLOPES = [NAN, math.inf, -1e38, 2.0**32 * (1 + 2**-20)]


@pytest.mark.parametrize("backend", READERS)
@pytest.mark.parametrize("op", ["decode", "extend"])
@pytest.mark.parametrize("bad", BAD_SLOPES)
def test_invalid_alibi_slope_is_refused_on_the_host(backend, op, bad):
    slopes = torch.tensor([0.5, 0.25, bad, 0.125])
    with raises(ValueError, "alibi_slopes", "head 2"):
        run(op, refused_batch(op), backend, alibi_slopes=slopes)


@pytest.mark.parametrize("backend", READERS)
@pytest.mark.parametrize(
    "op, causal",
    [("decode", True), ("extend", True), ("extend", False)],
    ids=["decode", "extend-causal", "extend-full"],
)
@pytest.mark.parametrize("bad", BAD_SLOPES)
def test_unvalidated_invalid_slope_head_reads_nothing(backend, op, causal, bad):
    """Both ALiBi forms (causal and not): the head with the invalid slope reads nothing, the
    others and the report are those of valid slopes."""
    x = refused_batch(op)
    kwargs = dict(validate=False) if op == "decode" else dict(validate=False, causal=causal)
    valid = torch.tensor([0.5, 0.25, 0.0625, 0.125])
    slopes = valid.clone()
    slopes[2] = bad
    want = run(op, x, "reference", alibi_slopes=slopes, **kwargs)
    twin = run(op, x, "reference", alibi_slopes=valid, **kwargs)
    assert_reads_nothing(want[0], want[1], list(range(want[0].shape[0])), [2])
    for h in (0, 1, 3):
        torch.testing.assert_close(want[0][:, h], twin[0][:, h])
    assert_reports_equal(want[2], twin[2])
    assert_agrees(run(op, x, backend, alibi_slopes=slopes, **kwargs), want)


@pytest.mark.parametrize("backend", READERS)
@pytest.mark.parametrize("op", ["decode", "extend"])
def test_slopes_at_the_bound_agree(backend, op):
    """The twin: |slope| = 2**32 is valid; such a head attends to the key nearest its query."""
    x = refused_batch(op)
    slopes = torch.tensor([2.0**32, -(2.0**32), 0.5, 0.0])
    want = run(op, x, "reference", alibi_slopes=slopes)
    assert torch.isfinite(want[0]).all()
    assert_agrees(run(op, x, backend, alibi_slopes=slopes), want)


# --- 9: layered tags whose rows overlap -----------------------------------------------------------


def folded_layers():
    """``[2, 6]`` tags over 10 words: layer 1's page 1 is layer 0's page 5."""
    words = torch.zeros(10, dtype=torch.int64)
    return words, words.as_strided((2, 6), (4, 1))


def overlapping_tags(case: str):
    if case == "stride_0":
        words = torch.zeros(6, dtype=torch.int64)
        return words, words.expand(2, 6)
    return folded_layers()


@pytest.mark.parametrize("fn", ["reserve", "release"])
@pytest.mark.parametrize("case", ["stride_0", "folded"])
def test_layered_tags_whose_rows_overlap_are_refused(fn, case):
    words, tags = overlapping_tags(case)
    words[5] = kvattn.written_tag(1, 4)
    before = words.clone()
    call = (
        (lambda: kvattn.reserve_pages(tags, [1], 2))
        if fn == "reserve"
        else (lambda: kvattn.release_pages(tags, [1]))
    )
    with raises(ValueError, "page_tags", "do not overlap", str(tags.stride())):
        call()
    assert torch.equal(words, before)


@pytest.mark.parametrize("fn", ["reserve", "release"])
def test_layered_tags_of_distinct_rows_are_written_per_layer(fn):
    """The twin: rows apart in a wider buffer (strided) are distinct layers; page 1 of both changes,
    page 5 of layer 0 (owner 1's) stays."""
    words = torch.zeros(2, 8, dtype=torch.int64)
    tags = words[:, 1:7]
    tags[0, 5] = kvattn.written_tag(1, 4)
    tags[:, 1] = kvattn.written_tag(3, 2)
    if fn == "reserve":
        kvattn.reserve_pages(tags, [1], 2)
        assert tags[:, 1].tolist() == [kvattn.reserved_tag(2)] * 2
    else:
        kvattn.release_pages(tags, [1])
        assert tags[:, 1].tolist() == [kvattn.FREE_TAG] * 2
    assert int(tags[0, 5]) == kvattn.written_tag(1, 4)
    assert words[:, 0].tolist() == [0, 0] and words[:, 7].tolist() == [0, 0]
