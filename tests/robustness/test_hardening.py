"""Malformed and hostile inputs (docs/ownership.md section 8), one class at a time, on every CPU
backend: the readers (reference, triton under the interpreter, cuda_sim), the writers (torch, triton,
cuda_sim) and the page-level writers (their host path and their device path, forced on CPU tensors).

Each class either raises a ValueError/TypeError naming the argument, the expected and the actual,
or fails closed identically everywhere: never a crash, never a foreign, NaN-poisoned or stale value
in an output, never an unwritten report entry. Each refusal has an accepted twin, and each
fail-closed outcome a twin where the same bytes are readable, so every test can fail.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import kvattn
from kvattn import Violation, WriteDrop, backends
from kvattn.backends.torch import writer as torch_writer
from kvattn.tags import OWNER_MAX
from kvattn_testing.traces import Interleave
from kvattn_testing.util import Batch, assert_reports_equal, backends_under_test, raises, tolerance

F16 = torch.float16
READERS = backends_under_test()
NOT_HELD, OOR = int(WriteDrop.NOT_HELD), int(WriteDrop.OUT_OF_RANGE)
BIT63 = -(1 << 63)  # bit 63 set, as an int64 value


def _writers() -> list[str]:
    pool = torch.zeros(2, 4, 1, 16, dtype=F16)
    probe = kvattn.write_args.validate_write_kv(
        pool[0, :1],
        pool[0, :1],
        pool,
        pool.clone(),
        torch.zeros(1, dtype=torch.int64),
        torch.zeros(2, dtype=torch.int64),
        1,
    )
    reasons = backends.explain(probe, op="write_kv")
    return [name for name in ("torch", "triton", "cuda_sim", "cpu") if reasons[name] is None]


WRITERS = _writers()


@pytest.fixture(params=["host", "device"])
def path(request, monkeypatch):
    """The page-level writers' two store paths: accepted rows picked on the host (CPU tensors) or
    set by atomic reductions (device tensors), the latter forced here on CPU tensors."""
    if request.param == "device":
        monkeypatch.setattr(torch_writer, "rows_on_host", lambda t: False)
    return request.param


def batch(**kwargs) -> Batch:
    """Two sequences (owners 1 and 2) over a NaN-poisoned pool of 24 pages of 4 slots."""
    shape = dict(
        batch=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        page_size=4,
        seq_lens=[5, 8],
        pool_factor=6,
        dtype=F16,
    )
    return Batch.random(**{**shape, **kwargs})


def extend_query(b: Batch):
    g = torch.Generator().manual_seed(7)
    q = torch.randn(3, b.q.shape[1], b.q.shape[2], generator=g).to(b.q.dtype)
    return q, torch.tensor([0, 1, 3], dtype=torch.int32)


def run(op: str, b: Batch, backend: str, q=None, cu=None, **kwargs):
    if op == "decode":
        return kvattn.paged_decode(
            b.q if q is None else q,
            b.k_cache,
            b.v_cache,
            b.block_table,
            b.seq_lens,
            b.page_tags,
            b.expected,
            backend=backend,
            **kwargs,
        )
    eq, ecu = extend_query(b)
    return kvattn.paged_extend(
        eq if q is None else q,
        b.k_cache,
        b.v_cache,
        ecu if cu is None else cu,
        b.block_table,
        b.seq_lens,
        b.page_tags,
        b.expected,
        backend=backend,
        **kwargs,
    )


def sharing(t: torch.Tensor, shape, dtype):
    """``(copy, view)``: a copy of ``t`` and a ``shape``/``dtype`` tensor over the same first bytes."""
    size = t.numel() * t.element_size()
    view_size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    buf = torch.zeros(max(size, view_size) + 16, dtype=torch.uint8)
    copy = buf[:size].view(t.dtype).view(t.shape)
    copy.copy_(t)
    return copy, buf[:view_size].view(dtype).view(shape)


# --- empty dimensions, scale ---------------------------------------------------------------------


def _emptied(b: Batch, case: str):
    """``(batch, q for decode, q for extend)`` with one dimension emptied."""
    q, _ = extend_query(b)
    if case == "no_heads":
        return b, b.q[:, :0], q[:, :0]
    if case == "no_head_dim":
        b = dataclasses.replace(b, k_cache=b.k_cache[..., :0], v_cache=b.v_cache[..., :0])
        return b, b.q[..., :0], q[..., :0]
    b = dataclasses.replace(b, k_cache=b.k_cache[:, :, :0], v_cache=b.v_cache[:, :, :0])
    return b, b.q, q


@pytest.mark.parametrize("backend", READERS)
@pytest.mark.parametrize("op", ["decode", "extend"])
@pytest.mark.parametrize(
    "case, words",
    [
        ("no_heads", ["q", "at least one head", "(2, 0, 16)"]),
        ("no_head_dim", ["q", "head_dim", "(2, 2, 0)"]),
        ("no_kv_heads", ["k_cache", "at least one KV head", "0"]),
    ],
)
def test_empty_dimensions_raise_before_any_backend_runs(backend, op, case, words):
    b, q_decode, q_extend = _emptied(batch(), case)
    if op == "extend":
        words = [w.replace("(2,", "(3,") for w in words]
    with raises(ValueError, *words):
        run(op, b, backend, q=q_decode if op == "decode" else q_extend)


def test_no_kv_heads_in_a_writer_raises():
    pool = torch.zeros(2, 4, 0, 16, dtype=F16)
    k = torch.zeros(1, 0, 16, dtype=F16)
    with raises(ValueError, "k_cache", "at least one KV head"):
        kvattn.write_kv(
            k,
            k,
            pool,
            pool.clone(),
            torch.zeros(1, dtype=torch.int64),
            torch.zeros(2, dtype=torch.int64),
            1,
        )


@pytest.mark.parametrize("backend", READERS)
@pytest.mark.parametrize("op", ["decode", "extend"])
def test_the_batch_of_these_tests_runs(backend, op):
    """The twin of the refusals here: the unchanged inputs run and match the reference."""
    b = batch()
    out, lse, report = run(op, b, backend, return_lse=True)
    ref_out, ref_lse, ref_report = run(op, b, "reference", return_lse=True)
    assert torch.isfinite(out).all() and not report.any()
    torch.testing.assert_close(out.float(), ref_out.float(), **tolerance(F16))
    assert_reports_equal(report, ref_report)


BAD_SCALES = [math.inf, -math.inf, math.nan, 0.0, -0.5, 1e-40, 2.0**127, 1e300]


@pytest.mark.parametrize("backend", READERS)
@pytest.mark.parametrize("op", ["decode", "extend"])
@pytest.mark.parametrize("scale", BAD_SCALES)
def test_scale_outside_the_float32_normal_range_raises(backend, op, scale):
    with raises(ValueError, "scale", "positive finite", repr(scale)):
        run(op, batch(), backend, scale=scale)


@pytest.mark.parametrize("backend", READERS)
@pytest.mark.parametrize("scale", [2.0**-20, 0.03, 7.5])
def test_scales_in_range_run_and_agree(backend, scale):
    b = batch()
    out, _ = run("decode", b, backend, scale=scale)
    ref, _ = b.reference(scale=scale)
    torch.testing.assert_close(out.float(), ref, **tolerance(F16))


# --- out: aliasing and overlapping elements ------------------------------------------------------

OUT_ALIASES = [
    "q",
    "k_cache",
    "v_cache",
    "page_tags",
    "block_table",
    "seq_lens",
    "expected",
    "cu_seqlens_q",
]


@pytest.mark.parametrize("backend", READERS)
@pytest.mark.parametrize("op", ["decode", "extend"])
@pytest.mark.parametrize("alias", OUT_ALIASES)
def test_out_sharing_memory_with_an_input_raises(backend, op, alias):
    if alias == "cu_seqlens_q" and op == "decode":
        pytest.skip("decode has no cu_seqlens_q")
    b = batch()
    q, cu = extend_query(b)
    q = b.q if op == "decode" else q
    if alias == "q":
        q, out = sharing(q, q.shape, q.dtype)
    elif alias == "cu_seqlens_q":
        cu, out = sharing(cu, q.shape, q.dtype)
    else:
        copy, out = sharing(getattr(b, alias), q.shape, q.dtype)
        b = dataclasses.replace(b, **{alias: copy})
    before = [t.clone() for t in (b.k_cache, b.v_cache, b.page_tags)]
    with raises(ValueError, "out", f"sharing no memory with {alias}"):
        run(op, b, backend, q=q, cu=cu, out=out)
    for t, want in zip((b.k_cache, b.v_cache, b.page_tags), before):
        assert torch.equal(t.view(torch.uint8), want.view(torch.uint8))


def _variant_tensor(name: str, op: str, b: Batch):
    """A valid ``name`` argument for the batch of :func:`batch` (2 heads; extend's query rows 1
    and 2 over 5 and 8 keys)."""
    if name == "custom_mask":
        return torch.ones(1 * 5 + 2 * 8, dtype=torch.bool)
    return torch.full((b.q.shape[1],), -0.5 if name == "alibi_slopes" else 0.25)


@pytest.mark.parametrize("backend", READERS)
@pytest.mark.parametrize(
    "op, alias",
    [("decode", "alibi_slopes"), ("decode", "sinks"), ("extend", "sinks")]
    + [("extend", "alibi_slopes"), ("extend", "custom_mask")],
)
def test_out_sharing_memory_with_a_variant_tensor_raises(backend, op, alias):
    """The kernels read slopes, sinks and the mask while they write out: out over their bytes
    would change them mid-call (the backends then disagreed). The twin: the same tensor in a
    buffer of its own is accepted, and out=None gives the same output."""
    b = batch()
    rows = b.q.shape[0] if op == "decode" else extend_query(b)[0].shape[0]
    value = _variant_tensor(alias, op, b)
    copy, out = sharing(value, (rows, b.q.shape[1], b.q.shape[2]), F16)
    with raises(ValueError, "out", f"sharing no memory with {alias}"):
        run(op, b, backend, out=out, **{alias: copy})
    apart = torch.empty(rows, b.q.shape[1], b.q.shape[2], dtype=F16)
    got = run(op, b, backend, out=apart, **{alias: value})[0]
    want = run(op, b, backend, **{alias: value})[0]
    assert got.data_ptr() == apart.data_ptr() and torch.equal(got, want)


def _folded(shape):
    """An out of ``shape`` whose heads overlap: head stride 8 < head_dim 16."""
    return torch.zeros(256, dtype=F16).as_strided(shape, (shape[1] * 8, 8, 1))


@pytest.mark.parametrize("backend", READERS)
@pytest.mark.parametrize("op", ["decode", "extend"])
@pytest.mark.parametrize("case", ["stride_0_rows", "folded_heads"])
def test_out_with_overlapping_elements_raises(backend, op, case):
    b = batch()
    rows = b.q.shape[0] if op == "decode" else extend_query(b)[0].shape[0]
    shape = (rows, 2, 16)
    out = (
        torch.zeros(1, 2, 16, dtype=F16).expand(shape)
        if case == "stride_0_rows"
        else _folded(shape)
    )
    with raises(ValueError, "out", "elements do not overlap", str(tuple(out.stride()))):
        run(op, b, backend, out=out)


@pytest.mark.parametrize("backend", READERS)
@pytest.mark.parametrize("op", ["decode", "extend"])
def test_out_apart_from_the_inputs_with_any_strides_is_written(backend, op):
    """The twin: an out of its own, strided (a slice of a wider buffer), gets what out=None gets."""
    b = batch()
    want, _ = run(op, b, backend)
    out = torch.full((want.shape[0], 2, 48), 5.0, dtype=F16)[..., 16:32]
    got, _ = run(op, b, backend, out=out)
    assert got is out and torch.equal(out, want)


# --- pools whose pages overlap -------------------------------------------------------------------


def _overlapping_pool(pool: torch.Tensor, case: str) -> torch.Tensor:
    if case == "page_stride_0":
        return pool[:1].expand(pool.shape)
    n, p, h, d = pool.shape  # pages one slot apart: page i + 1 starts at slot 1 of page i
    return pool.as_strided(pool.shape, (h * d, h * d, d, 1))


@pytest.mark.parametrize("backend", READERS)
@pytest.mark.parametrize("case", ["page_stride_0", "pages_one_slot_apart"])
def test_readers_refuse_pools_whose_pages_overlap(backend, case):
    b = batch()
    b = dataclasses.replace(b, k_cache=_overlapping_pool(b.k_cache, case))
    with raises(ValueError, "k_cache", "elements do not overlap"):
        run("decode", b, backend)


def writer_pool(num_pages=6, page_size=4, heads=1, dim=16):
    shape = (num_pages, page_size, heads, dim)
    return (
        torch.full(shape, math.nan, dtype=F16),
        torch.full(shape, math.nan, dtype=F16),
        torch.zeros(num_pages, dtype=torch.int64),
    )


def tokens(n, heads=1, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, heads, dim, generator=g).to(F16), torch.randn(
        n, heads, dim, generator=g
    ).to(F16)


@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("case", ["page_stride_0", "pages_one_slot_apart"])
def test_writers_refuse_pools_whose_pages_overlap(writer, case):
    k_cache, v_cache, tags = writer_pool()
    kvattn.reserve_pages(tags, [0, 1], 1)
    k, v = tokens(2)
    with raises(ValueError, "v_cache", "elements do not overlap"):
        kvattn.write_kv(
            k,
            v,
            k_cache,
            _overlapping_pool(v_cache, case),
            torch.tensor([0, 4]),
            tags,
            1,
            backend=writer,
        )
    assert tags.tolist()[:2] == [kvattn.reserved_tag(1)] * 2 and torch.isnan(k_cache).all()


@pytest.mark.parametrize("writer", WRITERS)
def test_writers_land_in_distinct_strided_pages(writer):
    """The twin: pages padded apart in a wider buffer are distinct; the write lands in them."""
    wide = torch.full((6, 5, 1, 16), math.nan, dtype=F16)
    k_cache, v_cache, tags = wide[:, 1:], wide.clone()[:, :4], torch.zeros(6, dtype=torch.int64)
    kvattn.reserve_pages(tags, [0, 1], 1)
    k, v = tokens(2)
    result = kvattn.write_kv(k, v, k_cache, v_cache, torch.tensor([0, 4]), tags, 1, backend=writer)
    assert result.landed.tolist() == [True, True]
    assert torch.equal(k_cache[0, 0], k[0]) and torch.equal(k_cache[1, 0], k[1])
    assert torch.isnan(wide[:, 0]).all()


# --- writers: what they read shares no memory with what they write -------------------------------


@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize(
    "case",
    [
        "slot_mapping_in_k_cache",
        "slot_mapping_in_page_tags",
        "owner_in_page_tags",
        "owner_in_v_cache",
        "page_tags_in_k_cache",
    ],
)
def test_writer_inputs_inside_what_it_writes_raise(writer, case):
    k_cache, v_cache, tags = writer_pool()
    kvattn.reserve_pages(tags, [0], 1)
    k, v = tokens(2)
    mapping, owner = torch.tensor([0, 1]), torch.ones(2, dtype=torch.int64)
    if case == "slot_mapping_in_k_cache":
        k_cache, mapping = sharing(k_cache, (2,), torch.int64)
        mapping.copy_(torch.tensor([0, 1]))
    elif case == "slot_mapping_in_page_tags":
        mapping = tags[4:6]
        mapping.copy_(torch.tensor([0, 1]))
    elif case == "owner_in_page_tags":
        owner = tags[4:6]
        owner.fill_(1)
    elif case == "owner_in_v_cache":
        v_cache, owner = sharing(v_cache, (2,), torch.int64)
        owner.fill_(1)
    else:
        k_cache, tags = sharing(k_cache, tags.shape, torch.int64)
        kvattn.reserve_pages(tags, [0], 1)
    name, other = {
        "slot_mapping_in_k_cache": ("slot_mapping", "k_cache"),
        "slot_mapping_in_page_tags": ("slot_mapping", "page_tags"),
        "owner_in_page_tags": ("owner", "page_tags"),
        "owner_in_v_cache": ("owner", "v_cache"),
        "page_tags_in_k_cache": ("page_tags", "k_cache"),
    }[case]
    tags_before = tags.clone()
    with raises(ValueError, name, f"sharing no memory with {other}"):
        kvattn.write_kv(k, v, k_cache, v_cache, mapping, tags, owner, backend=writer)
    assert torch.equal(tags, tags_before)


@pytest.mark.parametrize("fn", ["reserve", "release", "commit", "reassign"])
def test_page_writer_indices_inside_the_tags_raise(fn):
    tags = torch.zeros(8, dtype=torch.int64)
    pages = tags[6:8]  # a view of the tag array used as page ids
    call = {
        "reserve": lambda: kvattn.reserve_pages(tags, pages, 1),
        "release": lambda: kvattn.release_pages(tags, pages),
        "commit": lambda: kvattn.commit_pages(tags, pages, 1, [1, 1], 4),
        "reassign": lambda: kvattn.reassign_pages(tags, pages, 1, 2),
    }[fn]
    with raises(ValueError, "pages", "sharing no memory with page_tags"):
        call()
    assert tags.tolist() == [0] * 8


# --- slot_mapping strides ------------------------------------------------------------------------


@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_every_writer_honours_the_stride_of_slot_mapping(writer, dtype):
    slots = [0, 1, 2, 8, 9, 5]
    junk = [23, -1, 4, 0, 13, 6]  # interleaved entries that must never be read
    strided = torch.tensor([slots, junk], dtype=dtype).t().contiguous()[:, 0]
    assert strided.stride() == (2,)
    results = {}
    for name, mapping in (("contiguous", strided.contiguous()), ("strided", strided)):
        k_cache, v_cache, tags = writer_pool()
        kvattn.reserve_pages(tags, [0, 1, 2], 1)
        k, v = tokens(len(slots))
        r = kvattn.write_kv(k, v, k_cache, v_cache, mapping, tags, 1, backend=writer)
        results[name] = (
            r.landed.tolist(),
            r.drop_reasons.tolist(),
            tags.tolist(),
            k_cache.nan_to_num(9.0),
        )
    want, got = results["contiguous"], results["strided"]
    assert want[:3] == got[:3] and torch.equal(want[3], got[3])
    assert want[0] == [True, True, True, True, True, False]  # slot 5 would leave a hole: GAP


# --- owner ids outside [1, OWNER_MAX] ------------------------------------------------------------

BAD_OWNERS = [0, -1, OWNER_MAX + 1, (1 << 48) + 5]


def _page_call(fn, tags, owner, validate=None):
    return {
        "reserve": lambda: kvattn.reserve_pages(tags, [1], owner, validate=validate),
        "commit": lambda: kvattn.commit_pages(tags, [1], owner, [2], 4, validate=validate),
        "reassign_owner": lambda: kvattn.reassign_pages(tags, [1], owner, 9, validate=validate),
        "reassign_heir": lambda: kvattn.reassign_pages(tags, [1], 3, owner, validate=validate),
    }[fn]()


@pytest.mark.parametrize("fn", ["reserve", "commit", "reassign_owner", "reassign_heir"])
@pytest.mark.parametrize("bad", BAD_OWNERS)
def test_page_writers_check_cpu_tensor_owners_on_the_host(fn, bad, path):
    tags = torch.tensor([0, kvattn.reserved_tag(3), 0])
    name = "new_owner" if fn == "reassign_heir" else "owner"
    with raises(ValueError, name, f"[1, {OWNER_MAX}]", f"{name}[0] = {bad}"):
        _page_call(fn, tags, torch.tensor([bad]))
    assert tags.tolist() == [0, kvattn.reserved_tag(3), 0]


@pytest.mark.parametrize("bad", BAD_OWNERS)
def test_unchecked_reserve_with_an_impossible_owner_makes_the_page_free(bad, path):
    """Device tensors are not read on the host: the reserve fails closed. The page becomes FREE (its
    previous holder loses it, nobody holds it); a commit or write for the owner the id would wrap to
    (2**48 + 5 -> 5) then finds nothing to hold, and readers refuse the page."""
    tags = torch.tensor([0, kvattn.written_tag(3, 4), 0])
    kvattn.reserve_pages(tags, [1], torch.tensor([bad]), validate=False)
    assert tags.tolist() == [0, kvattn.FREE_TAG, 0]
    wrapped = bad & OWNER_MAX or 1
    result = kvattn.commit_pages(tags, [1], wrapped, [4], 4)
    assert result.drop_reasons.tolist() == [NOT_HELD] and tags.tolist() == [0, 0, 0]


def test_unchecked_reserve_with_valid_tensor_owners_reserves(path):
    """The twin: the same call with valid ids reserves each page for its owner."""
    tags = torch.tensor([0, kvattn.written_tag(3, 4), 0])
    kvattn.reserve_pages(tags, torch.tensor([1, 2]), torch.tensor([5, 6]), validate=False)
    assert tags.tolist() == [0, kvattn.reserved_tag(5), kvattn.reserved_tag(6)]


@pytest.mark.parametrize("bad", BAD_OWNERS)
def test_unchecked_commit_or_reassign_by_an_impossible_owner_holds_nothing(bad, path):
    before = [0, kvattn.reserved_tag(3), kvattn.written_tag(OWNER_MAX, 2)]
    tags = torch.tensor(before)
    for fn in ("commit", "reassign_owner"):
        result = _page_call(fn, tags, torch.tensor([bad]), validate=False)
        assert result.landed.tolist() == [False] and result.drop_reasons.tolist() == [NOT_HELD]
        assert tags.tolist() == before


@pytest.mark.parametrize("bad", BAD_OWNERS)
def test_unchecked_reassign_to_an_impossible_heir_frees_the_page(bad, path):
    tags = torch.tensor([0, kvattn.written_tag(3, 4), kvattn.written_tag(4, 1)])
    result = kvattn.reassign_pages(tags, [1, 2], 3, torch.tensor([bad, bad]), validate=False)
    assert result.landed.tolist() == [False, False]
    assert result.drop_reasons.tolist() == [NOT_HELD, NOT_HELD]
    assert tags.tolist() == [0, kvattn.FREE_TAG, kvattn.written_tag(4, 1)]


def test_unchecked_reassign_to_a_valid_heir_hands_the_page_over(path):
    """The twin: the same call with a valid heir keeps state and valid_len under the new owner."""
    tags = torch.tensor([0, kvattn.written_tag(3, 4), kvattn.written_tag(4, 1)])
    result = kvattn.reassign_pages(tags, [1, 2], 3, torch.tensor([9, 9]), validate=False)
    assert result.landed.tolist() == [True, False]
    assert tags.tolist() == [0, kvattn.written_tag(9, 4), kvattn.written_tag(4, 1)]


@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("bad", BAD_OWNERS)
def test_write_kv_owner_tensor_checked_on_the_host_and_refused_unchecked(writer, bad):
    k_cache, v_cache, tags = writer_pool()
    # Page 1's owner bits are all ones: the bits a negative or too large id would shift into.
    tags[0] = kvattn.reserved_tag(5)
    tags[1] = kvattn.written_tag(OWNER_MAX, 1)
    before = tags.clone()
    k, v = tokens(2)
    mapping = torch.tensor([0, 4])
    owner = torch.tensor([bad, bad])
    with raises(ValueError, "owner", f"owner[0] = {bad}"):
        kvattn.write_kv(k, v, k_cache, v_cache, mapping, tags, owner, backend=writer)
    result = kvattn.write_kv(
        k, v, k_cache, v_cache, mapping, tags, owner, backend=writer, validate=False
    )
    assert result.landed.tolist() == [False, False]
    assert result.drop_reasons.tolist() == [NOT_HELD, NOT_HELD]
    assert torch.equal(tags, before) and torch.isnan(k_cache).all() and torch.isnan(v_cache).all()


@pytest.mark.parametrize("writer", WRITERS)
def test_write_kv_with_valid_unchecked_owners_lands(writer):
    """The twin: the same write with the pages' own owners lands in both."""
    k_cache, v_cache, tags = writer_pool()
    tags[0] = kvattn.reserved_tag(5)
    tags[1] = kvattn.written_tag(OWNER_MAX, 1)
    k, v = tokens(2)
    result = kvattn.write_kv(
        k,
        v,
        k_cache,
        v_cache,
        torch.tensor([0, 4]),
        tags,
        torch.tensor([5, OWNER_MAX]),
        backend=writer,
        validate=False,
    )
    assert result.landed.tolist() == [True, True]
    assert tags.tolist()[:2] == [kvattn.written_tag(5, 1), kvattn.written_tag(OWNER_MAX, 1)]


# --- tags no writer produces, expected owners no lease holds -------------------------------------

MALFORMED_TAGS = {
    "bit63_written_owner1": kvattn.written_tag(1, 4) | BIT63,
    "state3_owner1": (1 << 16) | (4 << 2) | 3,
    "owner_bits_all_ones": (-1 << 16) | (4 << 2) | 2,  # WRITTEN, valid_len 4, bits 16..63 set
}
EXPECTED_FOR = {"bit63_written_owner1": 1, "state3_owner1": 1, "owner_bits_all_ones": -1}


@pytest.mark.parametrize("backend", READERS)
@pytest.mark.parametrize("op", ["decode", "extend"])
@pytest.mark.parametrize("case", list(MALFORMED_TAGS))
def test_readers_refuse_malformed_tags_as_free(backend, op, case):
    """Sequence 0's first page gets a word no writer produces, its bytes NaN; the expected owner is
    the one the word's owner bits spell (-1 for all ones, unvalidated). Every backend refuses it
    as FREE, reads none of it, and agrees with the page being plainly FREE."""
    b = batch()
    page = int(b.block_table[0, 0])
    b.k_cache[page] = math.nan
    b.page_tags[page] = MALFORMED_TAGS[case]
    b.expected[0] = EXPECTED_FOR[case]
    out, lse, report = run(op, b, backend, return_lse=True, validate=False)
    assert report.page_reasons[0].tolist()[0] == int(Violation.FREE)
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    freed = dataclasses.replace(b, page_tags=b.page_tags.clone())
    freed.page_tags[page] = kvattn.FREE_TAG
    want_out, want_lse, want_report = run(op, freed, backend, return_lse=True, validate=False)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    assert_reports_equal(report, want_report)


@pytest.mark.parametrize("backend", READERS)
@pytest.mark.parametrize("op", ["decode", "extend"])
@pytest.mark.parametrize("bad", [0, -1, OWNER_MAX + 1, (1 << 48) + 1, -(1 << 47) + 1])
def test_readers_never_match_an_expected_owner_outside_the_range(backend, op, bad):
    """``(1 << 48) + 1`` shifted into the owner bits wraps to owner 1's key, ``-(1 << 47) + 1`` has
    owner 1's low bits: neither may read sequence 0's pages (owner 1)."""
    b = batch()
    b.expected[0] = bad
    out, lse, report = run(op, b, backend, return_lse=True, validate=False)
    reasons = report.page_reasons[0].tolist()
    assert reasons[:2] == [int(Violation.OWNER_MISMATCH)] * 2
    rows = slice(0, 1)
    assert torch.equal(out[rows], torch.zeros_like(out[rows])) and torch.isneginf(lse[rows]).all()
    assert torch.isfinite(out).all() and report.violations.tolist()[1] == 0


@pytest.mark.parametrize("backend", READERS)
def test_expected_owner_in_range_reads_its_pages(backend):
    """The twin of both tests above: the well-formed tag, read for its owner, contributes."""
    b = batch()
    out, report = run("decode", b, backend, validate=False)
    assert report.page_reasons[0].tolist() == [0, 0] and torch.isfinite(out).all()
    assert out[0].abs().max() > 0


@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("case", list(MALFORMED_TAGS))
def test_writers_never_hold_a_malformed_tag(writer, case):
    k_cache, v_cache, tags = writer_pool()
    tags[2] = MALFORMED_TAGS[case]
    before = tags.clone()
    k, v = tokens(2)
    owner = torch.tensor([EXPECTED_FOR[case]] * 2)
    result = kvattn.write_kv(
        k, v, k_cache, v_cache, torch.tensor([8, 9]), tags, owner, backend=writer, validate=False
    )
    assert result.drop_reasons.tolist() == [NOT_HELD, NOT_HELD]
    assert torch.equal(tags, before) and torch.isnan(k_cache).all()


@pytest.mark.parametrize("case", list(MALFORMED_TAGS))
def test_page_writers_never_hold_a_malformed_tag(case, path):
    tags = torch.tensor([0, MALFORMED_TAGS[case], 0])
    owner = torch.tensor([EXPECTED_FOR[case]])
    for result in (
        kvattn.commit_pages(tags, [1], owner, [2], 4, validate=False),
        kvattn.reassign_pages(tags, [1], owner, 9, validate=False),
    ):
        assert result.drop_reasons.tolist() == [NOT_HELD]
    assert tags.tolist() == [0, MALFORMED_TAGS[case], 0]


@pytest.mark.parametrize("writer", WRITERS)
def test_writers_land_on_the_well_formed_twin(writer):
    k_cache, v_cache, tags = writer_pool()
    tags[2] = kvattn.written_tag(1, 0)
    k, v = tokens(2)
    result = kvattn.write_kv(k, v, k_cache, v_cache, torch.tensor([8, 9]), tags, 1, backend=writer)
    assert result.landed.tolist() == [True, True] and int(tags[2]) == kvattn.written_tag(1, 2)


# --- the latent race: a writer never writes back what it does not store --------------------------


def _write_back_put(dst, index, values, ok):
    """The store before this change: refused rows redirected to the first accepted one, and with none
    accepted, every row writing back what it read. Kept here to prove the test sees that race."""
    first = torch.argmax(ok.to(torch.int8)).reshape(1)
    any_ok = ok.any()
    row_ok = ok.view(-1, *([1] * (values.dim() - 1)))
    idx = tuple(torch.where(ok, i, torch.where(any_ok, i.index_select(0, first), i)) for i in index)
    values = values.to(dst.dtype).expand(ok.shape[0], *dst.shape[len(index) :])
    fallback = torch.where(any_ok, values.index_select(0, first), dst[index].to(values.dtype))
    dst.index_put_(idx, torch.where(row_ok, values, fallback).to(dst.dtype))


def _late_write_while_b_writes(monkeypatch, store):
    """A (owner 1, its lease ended) replays a write into page 2, now B's (owner 2); B's write of the
    same slots runs in between A's reads and A's stores. Returns (B's tokens, pools, tags)."""
    if store is not None:
        monkeypatch.setattr(torch_writer, "put_rows", store)
    k_cache, v_cache, tags = writer_pool()
    kvattn.reserve_pages(tags, [2], 2)
    ka, va = tokens(2, seed=1)
    kb, vb = tokens(2, seed=2)
    mapping = torch.tensor([8, 9])

    def b_writes():
        r = kvattn.write_kv(kb, vb, k_cache, v_cache, mapping, tags, 2, backend="torch")
        assert r.landed.tolist() == [True, True]

    spy = Interleave(k_cache, b_writes)
    with spy:
        late = kvattn.write_kv(ka, va, k_cache, v_cache, mapping, tags, 1, backend="torch")
    spy.finish()
    assert late.drop_reasons.tolist() == [NOT_HELD, NOT_HELD]
    return kb, vb, k_cache, v_cache, tags


def test_a_late_write_that_lands_nothing_stores_nothing(monkeypatch, path):
    kb, vb, k_cache, v_cache, tags = _late_write_while_b_writes(monkeypatch, None)
    assert int(tags[2]) == kvattn.written_tag(2, 2)
    assert torch.equal(k_cache[2, :2], kb) and torch.equal(v_cache[2, :2], vb)


def test_the_interleaving_catches_a_write_back(monkeypatch):
    """The twin: with the old store, A's write-back lands after B's write and B's stamped slots hold
    the stale (NaN) bytes again: what the test above rules out."""
    kb, _, k_cache, _, tags = _late_write_while_b_writes(monkeypatch, _write_back_put)
    assert int(tags[2]) == kvattn.written_tag(2, 2)
    assert torch.isnan(k_cache[2, :2]).all() and not torch.isnan(kb).any()


def _reassign_while_page_moves(monkeypatch, store):
    """Lease 3 ends and hands page 1 to heir 9, but page 1 is owner 4's: nothing is held. Between the
    reassign's read and its store, page 1 is released and reserved for owner 5."""
    if store is not None:
        monkeypatch.setattr(kvattn.writers, "put_rows", store)
    tags = torch.tensor([0, kvattn.written_tag(4, 2), 0])

    def page_moves():
        kvattn.release_pages(tags, [1])
        kvattn.reserve_pages(tags, [1], 5)

    spy = Interleave(tags, page_moves)
    with spy:
        result = kvattn.reassign_pages(tags, [1], 3, 9)
    spy.finish()
    assert result.drop_reasons.tolist() == [NOT_HELD]
    return tags


def test_a_reassign_that_holds_nothing_stores_nothing(monkeypatch, path):
    assert _reassign_while_page_moves(monkeypatch, None).tolist()[1] == kvattn.reserved_tag(5)


def test_the_interleaving_catches_a_reassign_write_back(monkeypatch):
    """The twin: the old store writes owner 4's tag back over owner 5's fresh reservation."""
    tags = _reassign_while_page_moves(monkeypatch, _write_back_put)
    assert tags.tolist()[1] == kvattn.written_tag(4, 2)


def test_device_stores_equal_host_stores_bit_for_bit():
    """The two store paths of the torch writer on an HND-strided bfloat16 pool with NaN payloads:
    the same elements change, to the same bits, and nothing else does."""
    g = torch.Generator().manual_seed(3)
    pool = torch.randn(5, 2, 4, 8, generator=g).to(torch.bfloat16).transpose(1, 2)
    pool[0, 0] = math.nan
    pages, slots = torch.tensor([3, 3, 0, 4, 1, 0]), torch.tensor([1, 2, 0, 3, 1, 3])
    keep = torch.tensor([True, True, False, True, False, True])
    values = torch.randn(6, 2, 8, generator=g).to(torch.bfloat16)
    host, device = pool.clone(), pool.clone()
    torch_writer.put_rows(host, (pages, slots), values, keep)
    torch_writer.atomic_put_rows(device, (pages, slots), values, keep)
    assert torch.equal(host.view(torch.int16), device.view(torch.int16))
    want = pool.clone()
    for r in range(6):
        if keep[r]:
            want[pages[r], slots[r]] = values[r]
    assert torch.equal(host.view(torch.int16), want.view(torch.int16))
    assert torch.isnan(host[0, 0]).all()  # row 2 (page 0, slot 0) was refused


# --- stale memory: rows no sequence covers --------------------------------------------------------

MALFORMED_OFFSETS = {
    "ends_early": [0, 1, 2],
    "starts_late": [2, 3, 4],
    "decreasing": [0, 3, 1],
    "negative_start": [-3, 1, 4],
}
UNCOVERED = {"ends_early": [2, 3], "starts_late": [0, 1], "decreasing": [3], "negative_start": []}


class _PoisonedAllocator:
    """``torch`` as kvattn.api sees it, except that fresh buffers hold NaN, as a reused block of
    the caching allocator might."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty_like(t, **kwargs):
        return torch.full_like(t, math.nan, **kwargs)

    @staticmethod
    def empty(*shape, **kwargs):
        return torch.full(
            shape[0] if len(shape) == 1 and not isinstance(shape[0], int) else shape,
            math.nan,
            **kwargs,
        )


@pytest.mark.parametrize("backend", READERS)
@pytest.mark.parametrize("case", list(MALFORMED_OFFSETS))
def test_rows_no_sequence_covers_come_out_zero_when_kvattn_allocates(backend, case, monkeypatch):
    monkeypatch.setattr(kvattn.api, "torch", _PoisonedAllocator())
    b = batch(seq_lens=[5, 8])
    q = extend_query(b)[0].repeat(2, 1, 1)[:4]
    cu = torch.tensor(MALFORMED_OFFSETS[case], dtype=torch.int32)
    out, lse, report = run("extend", b, backend, q=q, cu=cu, return_lse=True, validate=False)
    uncovered = UNCOVERED[case]
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    for row in uncovered:
        assert torch.equal(out[row], torch.zeros_like(out[row])) and torch.isneginf(lse[row]).all()
    ref_out, ref_lse, ref_report = kvattn.reference.paged_extend(
        q,
        b.k_cache,
        b.v_cache,
        cu,
        b.block_table,
        b.seq_lens,
        b.page_tags,
        b.expected,
        return_lse=True,
    )
    torch.testing.assert_close(out.float(), ref_out, **tolerance(F16))
    torch.testing.assert_close(lse, ref_lse, atol=1e-2, rtol=1e-2)
    assert_reports_equal(report, ref_report)


@pytest.mark.parametrize("backend", READERS)
@pytest.mark.parametrize("case", list(MALFORMED_OFFSETS))
def test_rows_no_sequence_covers_stay_unwritten_in_a_callers_out(backend, case, monkeypatch):
    monkeypatch.setattr(kvattn.api, "torch", _PoisonedAllocator())
    b = batch(seq_lens=[5, 8])
    q = extend_query(b)[0].repeat(2, 1, 1)[:4]
    cu = torch.tensor(MALFORMED_OFFSETS[case], dtype=torch.int32)
    out = torch.full_like(q, 5.0)
    _, lse, _ = run("extend", b, backend, q=q, cu=cu, out=out, return_lse=True, validate=False)
    covered = [r for r in range(4) if r not in UNCOVERED[case]]
    for row in UNCOVERED[case]:
        assert (out[row] == 5.0).all() and torch.isneginf(lse[row]).all()
    assert not (out[covered] == 5.0).all(dim=-1).any()


@pytest.mark.parametrize("backend", READERS)
def test_well_formed_offsets_write_every_row(backend, monkeypatch):
    """The twin: validated offsets cover every row, so nothing is filled first and every row of the
    poisoned buffers is written by the backend."""
    monkeypatch.setattr(kvattn.api, "torch", _PoisonedAllocator())
    b = batch(seq_lens=[5, 8])
    q = extend_query(b)[0].repeat(2, 1, 1)[:4]
    cu = torch.tensor([0, 1, 4], dtype=torch.int32)
    out, lse, _ = run("extend", b, backend, q=q, cu=cu, return_lse=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


# --- commit_pages(page_size=...) -----------------------------------------------------------------


@pytest.mark.parametrize(
    "page_size, error",
    [
        (0, ValueError),
        (-4, ValueError),
        (1025, ValueError),
        (4096, ValueError),
        (True, TypeError),
        (2.5, TypeError),
        ("4", TypeError),
    ],
)
def test_commit_page_size_is_checked(page_size, error, path):
    tags = torch.tensor([kvattn.reserved_tag(1)] * 2)
    with raises(
        error, "page_size", repr(page_size) if error is ValueError else type(page_size).__name__
    ):
        kvattn.commit_pages(tags, [0, 1], 1, [0, 1], page_size)
    assert tags.tolist() == [kvattn.reserved_tag(1)] * 2


def test_commit_with_a_page_size_commits(path):
    tags = torch.tensor([kvattn.reserved_tag(1)] * 2)
    result = kvattn.commit_pages(tags, [0, 1], 1, [0, 2], 2)
    assert result.landed.tolist() == [True, True]
    assert tags.tolist() == [kvattn.written_tag(1, 0), kvattn.written_tag(1, 2)]
    tags = torch.tensor([kvattn.reserved_tag(1)] * 2)
    result = kvattn.commit_pages(tags, [0, 1], 1, [1000, 7], 1000)  # any page size up to 1024
    assert result.landed.tolist() == [True, True]
    assert tags.tolist() == [kvattn.written_tag(1, 1000), kvattn.written_tag(1, 7)]


# --- lengths at the int32 limits -----------------------------------------------------------------

INT32_MAX, INT32_MIN = 2**31 - 1, -(2**31)


@pytest.mark.parametrize("backend", READERS)
@pytest.mark.parametrize(
    "seq_len, cu",
    [
        (INT32_MAX, [0, 0, 0]),
        (INT32_MAX - 40, [0, 1, 3]),
        (INT32_MIN, [0, 1, 3]),
        (INT32_MIN, [0, 0, 0]),
    ],
)
def test_extend_lengths_at_the_int32_limits_fail_closed(backend, seq_len, cu):
    """Unvalidated lengths near the int32 limits on the last sequence (whose spare tile slots add
    to the positions a kernel derives from them): beyond the table they read the whole table and
    count OUT_OF_RANGE once, negative they read nothing, like any length past the table or below 0.
    (The Triton extend overflowed its int32 positions here and walked negative key indices: a
    segfault under the interpreter; tests/robustness/test_fuzz.py checks the bounding against its
    oracle.)"""
    b = batch()
    b.seq_lens[1] = seq_len
    q = extend_query(b)[0][: cu[-1]]
    cu_t = torch.tensor(cu, dtype=torch.int32)
    out, lse, report = run("extend", b, backend, q=q, cu=cu_t, return_lse=True, validate=False)
    # The same call with a moderate stand-in: any length past the table, or any negative one.
    stand_in = dataclasses.replace(b, seq_lens=b.seq_lens.clone())
    stand_in.seq_lens[1] = 1000 if seq_len > 0 else -5
    ref_out, ref_lse, ref_report = run(
        "extend", stand_in, "reference", q=q, cu=cu_t, return_lse=True, validate=False
    )
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref_out.float(), **tolerance(F16))
    assert_reports_equal(report, ref_report)
    assert report.beyond_table.tolist() == [0, int(seq_len > 0)]
