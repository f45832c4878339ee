"""A V head dim of its own (``v_cache`` ``[..., head_dim_v]``: DeepSeek's 192-dim keys with 128-dim
values, FlashAttention 3's ``dv``): the readers' output is as wide as V, the scores are K's.

Against :func:`kvattn_testing.variants.dense`, the float64 definition one row at a time, with a
foreign page (NaN in K and V) planted where a sequence reads it, on every backend that claims the
shapes; the CUDA kernels run a V narrower than K and refuse a wider one, saying so. V narrower and
wider than K, and a width no tile has (24).
The twins: a clean batch reports nothing; the narrow V's output is the wide one's first columns.
"""

from __future__ import annotations

import pytest
import torch

import kvattn
from kvattn import backends
from kvattn.backends.triton.configs import ExtendConfig, extend_config
from kvattn_testing.exactness import SPLIT_READERS, run, validated
from kvattn_testing.extend import Extend
from kvattn_testing.util import (
    DEVICE,
    Batch,
    assert_reports_equal,
    backends_under_test,
    claims,
    launcher,
    raises,
)
from kvattn_testing.variants import (
    FP8,
    HEADS,
    KV_HEADS,
    assert_every_claim_matches,
    assert_matches,
    decode_rows,
    dense,
    inputs,
    plant_foreign_page,
    tokens,
)

# (K's head dim, V's): V narrower (DeepSeek's 192/128), wider, and not a power of two.
DIMS = [(32, 16), (16, 32), (16, 24)]
DIM_IDS = [f"dk{k}-dv{v}" for k, v in DIMS]


def decode_batch(dk: int, dv: int, page: int = 4, seed: int = 0, foreign: bool = True) -> Batch:
    """Four sequences of 3, 9, 1 and 14 tokens; sequence 3's second entry a foreign page."""
    pages = Batch.random(
        batch=4,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=dk,
        head_dim_v=dv,
        page_size=page,
        seq_lens=[3, 9, 1, 14],
        pool_factor=2,
        seed=seed,
    )
    if foreign:
        plant_foreign_page(pages, 3, 1)
    return pages


def extend_batch(dk: int, dv: int, seed: int = 0) -> Extend:
    """Four sequences of 1, 5, 3 and 2 new rows after 3, 0, 9 and 12 cached tokens; sequence 3's
    third entry a foreign page (tokens 8-11: read by every row of it)."""
    ext = Extend.random(
        [1, 5, 3, 2],
        [3, 0, 9, 12],
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=dk,
        head_dim_v=dv,
        page_size=4,
        pool_factor=2,
        seed=seed,
    )
    plant_foreign_page(ext.pages, 3, 2)
    return ext


def definition(x, op: str, **switches):
    pages = x if op == "decode" else x.pages
    rows = decode_rows(pages) if op == "decode" else x.cu
    seqs = [tokens(pages, b) for b in range(pages.seq_lens.shape[0])]
    return dense(
        x.q if op == "extend" else pages.q, rows, seqs, pages.q.shape[2] ** -0.5, **switches
    )


def assert_claims_match(x, op: str, want_violations, *, theirs=None, **kwargs) -> None:
    """Every backend claiming ``x`` (at least one beside the reference) gives the definition's
    ``[rows, heads, head_dim_v]`` output and the expected violations
    (:func:`kvattn_testing.variants.assert_every_claim_matches`)."""
    want_out, want_lse = definition(x, op, **(kwargs if theirs is None else theirs))
    assert_every_claim_matches(op, x, want_out, want_lse, want_violations, **kwargs)


@pytest.mark.parametrize("dims", DIMS, ids=DIM_IDS)
@pytest.mark.parametrize("page", [4, 5])
def test_decode_matches_the_definition(dims, page):
    assert_claims_match(decode_batch(*dims, page), "decode", [0, 0, 0, 1])


@pytest.mark.parametrize("dims", DIMS, ids=DIM_IDS)
def test_clean_decode_reports_nothing(dims):
    """The twin: without the foreign page every sequence reads all of its keys."""
    assert_claims_match(decode_batch(*dims, foreign=False), "decode", [0, 0, 0, 0])


@pytest.mark.parametrize("dims", DIMS, ids=DIM_IDS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_extend_matches_the_definition(dims, causal):
    assert_claims_match(extend_batch(*dims), "extend", [0, 0, 0, 1], causal=causal)


def test_variants_with_their_own_v_width():
    """Window, soft-cap, ALiBi and sinks together: the score switches act on K's scores only."""
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], device=DEVICE)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], device=DEVICE)
    ours = dict(window_left=6, logits_soft_cap=5.0, alibi_slopes=slopes, sinks=sinks)
    theirs = dict(window_left=6, cap=5.0, slopes=slopes.cpu(), sinks=sinks.cpu())
    assert_claims_match(extend_batch(32, 16), "extend", [0, 0, 0, 1], theirs=theirs, **ours)
    assert_claims_match(decode_batch(16, 24), "decode", [0, 0, 0, 1], theirs=theirs, **ours)


@pytest.mark.parametrize("op", ["decode", "extend"])
def test_fp8_pools_with_their_own_v_width(op):
    """fp8 K and V pools of different widths, per-head scales."""
    x = decode_batch(32, 16) if op == "decode" else extend_batch(32, 16)
    pages = x if op == "decode" else x.pages
    k_scale = torch.tensor([0.125, 0.25], device=DEVICE)
    v_scale = torch.tensor([0.5, 0.0625], device=DEVICE)
    pages.k_cache = pages.k_cache.to(FP8["e4m3"])
    pages.v_cache = pages.v_cache.to(FP8["e4m3"])
    seqs = [tokens(pages, b, k_scale.cpu(), v_scale.cpu()) for b in range(4)]
    want_out, want_lse = dense(
        x.q if op == "extend" else pages.q,
        decode_rows(pages) if op == "decode" else x.cu,
        seqs,
        32**-0.5,
    )
    args = validated(op, x, k_scale=k_scale, v_scale=v_scale)
    names = claims(args, op)
    assert "triton" in names or "triton" not in backends_under_test(), backends.explain(args, op)
    for backend in names:
        out, lse, report = run(op, x, backend, k_scale=k_scale, v_scale=v_scale)
        assert_matches(out, lse, want_out, want_lse, out.dtype)
        assert report.violations.tolist() == [0, 0, 0, 1]


@pytest.mark.parametrize("num_splits", [2, 5])
@pytest.mark.parametrize("dims", DIMS, ids=DIM_IDS)
def test_split_decode_merges_v_wide_partials(dims, num_splits):
    """The split-KV path stores and merges partial sums as wide as V."""
    pages = Batch.random(
        batch=4,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=dims[0],
        head_dim_v=dims[1],
        page_size=4,
        seq_lens=[90, 17, 1, 64],
        pool_factor=2,
        seed=7,
    )
    plant_foreign_page(pages, 0, 20)
    args = validated("decode", pages)
    want_out, want_lse = definition(pages, "decode")
    kernels = [n for n in claims(args, "decode") if n in SPLIT_READERS]
    if not kernels:
        pytest.skip("no split-KV backend claims a V head dim of its own here")
    for backend in kernels:
        out = pages.q.new_empty(*pages.q.shape[:2], dims[1])
        lse = torch.empty(pages.q.shape[:2], dtype=torch.float32, device=DEVICE)
        report = launcher(backend).decode(args, check=True, out=out, lse=lse, num_splits=num_splits)
        assert_matches(out, lse, want_out, want_lse, out.dtype)
        assert report.violations.tolist() == [1, 0, 0, 0]


@pytest.mark.parametrize("d_split", [2, 4])
def test_triton_extend_splits_v_columns(d_split):
    """``d_split`` programs share a tile, each storing its part of V's columns; a part keeps 16
    columns at least (V of 32 in two parts, never four)."""
    if "triton" not in backends_under_test():
        pytest.skip("triton cannot run here")
    from kvattn.backends.triton import paged_extend

    ext = extend_batch(16, 32)
    args = validated("extend", ext)
    want_out, want_lse = definition(ext, "extend")
    out = ext.q.new_full((*ext.q.shape[:2], 32), float("nan"))
    lse = torch.empty(ext.q.shape[:2], dtype=torch.float32, device=DEVICE)
    config = ExtendConfig(block_m=16, block_n=16, num_warps=4, d_split=d_split)
    report = paged_extend.extend(args, check=True, out=out, lse=lse, config=config)
    assert_matches(out, lse, want_out, want_lse, out.dtype)
    assert report.violations.tolist() == [0, 0, 0, 1]


def test_triton_extend_config_is_keyed_by_the_wider_head():
    ext = extend_batch(16, 32)
    from kvattn.backends.triton import paged_extend

    wide = extend_config(DEVICE, ext.q.dtype, 32, 4)
    assert paged_extend.launch_config(validated("extend", ext)) == wide


@pytest.mark.parametrize("op", ["decode", "extend"])
def test_narrow_v_is_the_first_columns_of_the_wide_one(op):
    """The scores are K's alone: cutting V to its first 16 columns cuts the output the same way
    (on each claiming backend, to float32 rounding of the same products)."""
    wide = decode_batch(16, 32) if op == "decode" else extend_batch(16, 32)
    pages = wide if op == "decode" else wide.pages
    full_v = pages.v_cache
    names = claims(validated(op, wide), op)
    results = {name: run(op, wide, name) for name in names}
    pages.v_cache = full_v[..., :16]
    for name in names:
        out, lse, report = run(op, wide, name)
        torch.testing.assert_close(out, results[name][0][..., :16], atol=1e-3, rtol=1e-3)
        torch.testing.assert_close(lse, results[name][1], atol=1e-5, rtol=1e-5)
        assert_reports_equal(report, results[name][2])


@pytest.mark.parametrize("op", ["decode", "extend"])
def test_cuda_kernels_refuse_v_wider_than_k_saying_why(op):
    """The CUDA kernels' tiles are sized by K's head dim: both CUDA backends refuse a wider V,
    naming the widths, and a named one raises that reason; the narrower V of the same width pair
    is claimed (the twin, and ``test_cuda_v_narrower_than_k_at_every_tile``)."""
    x = decode_batch(16, 32) if op == "decode" else extend_batch(16, 32)
    args = validated(op, x)
    why = "V head dim 32 > K head dim 16"
    assert why in kvattn.backends.cuda.launch.unsupported(args)
    assert (
        kvattn.backends.cuda.launch.unsupported(
            validated(op, decode_batch(32, 16) if op == "decode" else extend_batch(32, 16))
        )
        is None
    )
    if backends.load("cuda_sim")[0]._sim is None:
        pytest.skip("the CUDA harness is not built here")
    assert why in backends.explain(args, op)["cuda_sim"]
    with raises(ValueError, "cuda_sim", why):
        run(op, x, "cuda_sim")


# (K's head dim, V's): DeepSeek's 192/128 (tile 256), a split head (tile 512, two blocks of 256
# output columns) whose V fills one block and part of the other, and one whose V fits the first
# block alone (the second writes nothing), and a V of 40 (rows not a whole number of 16-byte
# copies: element-wise), each decode with and without splits and extend, fp16.
CUDA_DIMS = [(192, 128), (320, 288), (320, 256), (64, 40)]


@pytest.mark.parametrize("dims", CUDA_DIMS, ids=[f"dk{k}-dv{v}" for k, v in CUDA_DIMS])
def test_cuda_v_narrower_than_k_at_every_tile(dims):
    """cuda_sim against the definition with a foreign NaN page, checked; the unchecked twin reads
    the page's NaN."""
    if backends.load("cuda_sim")[0]._sim is None:
        pytest.skip("the CUDA harness is not built here")
    dk, dv = dims
    pages = Batch.random(
        batch=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=dk,
        head_dim_v=dv,
        page_size=8,
        seq_lens=[5, 30, 17],
        pool_factor=2,
        seed=3,
        dtype=torch.float16,
        device=torch.device("cpu"),
    )
    plant_foreign_page(pages, 1, 2)
    args = validated("decode", pages)
    assert backends.explain(args, "decode")["cuda_sim"] is None
    want_out, want_lse = definition(pages, "decode")
    for splits in (1, 3):
        out = pages.q.new_empty(*pages.q.shape[:2], dv)
        lse = torch.empty(pages.q.shape[:2], dtype=torch.float32)
        report = launcher("cuda_sim").decode(args, check=True, out=out, lse=lse, num_splits=splits)
        assert_matches(out, lse, want_out, want_lse, out.dtype)
        assert report.violations.tolist() == [0, 1, 0]
    out = pages.q.new_empty(*pages.q.shape[:2], dv)
    launcher("cuda_sim").decode(args, check=False, out=out, lse=None, num_splits=1)
    assert torch.isnan(out[1]).all() and torch.isfinite(out[[0, 2]]).all()

    ext = Extend.random(
        [2, 5, 1],
        [3, 20, 9],
        num_heads=4,
        num_kv_heads=2,
        head_dim=dk,
        head_dim_v=dv,
        page_size=8,
        pool_factor=2,
        seed=4,
        dtype=torch.float16,
        device=torch.device("cpu"),
    )
    plant_foreign_page(ext.pages, 1, 1)
    want_out, want_lse = definition(ext, "extend")
    out, lse, report = run("extend", ext, "cuda_sim")
    assert out.shape[2] == dv
    assert_matches(out, lse, want_out, want_lse, out.dtype)
    assert report.violations.tolist() == [0, 1, 0]


# --- validation ------------------------------------------------------------------------------------


def test_v_pool_must_match_k_but_for_its_head_dim():
    pages = decode_batch(32, 16)
    other_heads = pages.v_cache[:, :, :1]
    with raises(ValueError, "v_cache", "head_dim_v", f"{tuple(other_heads.shape)}"):
        kvattn.paged_decode(
            pages.q,
            pages.k_cache,
            other_heads,
            pages.block_table,
            pages.seq_lens,
            pages.page_tags,
            pages.expected,
        )


@pytest.mark.parametrize("op", ["decode", "extend"])
def test_out_is_as_wide_as_v(op):
    x = decode_batch(32, 16) if op == "decode" else extend_batch(32, 16)
    q = x.q
    with raises(ValueError, "out", f"{(*q.shape[:2], 16)}"):
        validated(op, x, out=torch.empty_like(q))
    out = q.new_empty(*q.shape[:2], 16)
    validated(op, x, out=out)
    got = run(op, x, "reference", out=out)[0]
    assert got.data_ptr() == out.data_ptr() and got.shape[2] == 16


@pytest.mark.parametrize("op", ["decode", "extend"])
def test_custom_ops_return_v_wide_outputs(op):
    """``torch.ops.kvattn``: the op and its fake both size the output by V."""
    from kvattn import ops

    x = decode_batch(32, 16) if op == "decode" else extend_batch(32, 16)
    args = (*inputs(x),) if op == "decode" else x.inputs()
    fn = ops.paged_decode if op == "decode" else ops.paged_extend
    out, report = fn(*args, backend="reference")
    assert out.shape == (*x.q.shape[:2], 16)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(t) for t in args]
        fake_out = fn(*fake_args, backend="reference", validate=False)[0]
    assert fake_out.shape == out.shape


# --- the writers -------------------------------------------------------------------------------------

WRITERS = ["torch", "triton", "cuda_sim", "cpu"]


@pytest.mark.parametrize("dims", DIMS, ids=DIM_IDS)
def test_writers_store_v_rows_of_their_own_width(dims):
    """Each writer claiming the pools lands K and V rows of their widths, stamps the page, and
    writes nothing past a row (NaN stays in every other slot)."""
    dk, dv = dims
    num_pages, page, hk = 3, 4, KV_HEADS
    g = torch.Generator().manual_seed(3)
    k = torch.randn(5, hk, dk, generator=g).half().to(DEVICE)
    v = torch.randn(5, hk, dv, generator=g).half().to(DEVICE)
    slots = torch.tensor([4, 5, 6, 7, 8], dtype=torch.int32, device=DEVICE)  # page 1, then page 2
    written = 0
    for backend in WRITERS:
        module, _ = backends.load(backend)
        k_cache = torch.full(
            (num_pages, page, hk, dk), float("nan"), dtype=torch.half, device=DEVICE
        )
        v_cache = torch.full(
            (num_pages, page, hk, dv), float("nan"), dtype=torch.half, device=DEVICE
        )
        tags = torch.tensor([0, kvattn.reserved_tag(7), kvattn.reserved_tag(7)], device=DEVICE)
        args = kvattn.write_args.validate_write_kv(k, v, k_cache, v_cache, slots, tags, 7)
        if backends.explain(args, "write_kv")[backend] is not None:
            continue
        result = kvattn.write_kv(k, v, k_cache, v_cache, slots, tags, 7, backend=backend)
        assert result.landed.all() and int(result.dropped) == 0, backend
        assert torch.equal(k_cache.flatten(0, 1)[4:9], k) and torch.equal(
            v_cache.flatten(0, 1)[4:9], v
        )
        assert (
            torch.isnan(k_cache.flatten(0, 1)[9:]).all()
            and torch.isnan(v_cache.flatten(0, 1)[9:]).all()
        )
        assert torch.isnan(v_cache[0]).all()
        assert tags.tolist() == [0, kvattn.written_tag(7, 4), kvattn.written_tag(7, 1)], backend
        written += 1
    assert written >= 2


def test_writer_v_rows_must_match_their_pool():
    k_cache = torch.zeros(2, 4, KV_HEADS, 32, dtype=torch.half, device=DEVICE)
    v_cache = torch.zeros(2, 4, KV_HEADS, 16, dtype=torch.half, device=DEVICE)
    k = torch.zeros(1, KV_HEADS, 32, dtype=torch.half, device=DEVICE)
    tags = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    slots = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    with raises(ValueError, "v", f"(1, {KV_HEADS}, 16)", f"(1, {KV_HEADS}, 32)"):
        kvattn.write_kv(k, k.clone(), k_cache, v_cache, slots, tags, 1)


def test_paged_kv_cache_with_its_own_v_width():
    """The allocator's pools take ``head_dim_v``: prefill and decode give V-wide outputs equal to
    the reference over the same pools; a page re-tagged for another owner is refused for its
    sequence alone (the twin)."""
    cache = kvattn.PagedKVCache(8, 4, KV_HEADS, 32, head_dim_v=16, device=DEVICE)
    assert cache.v_cache.shape == (8, 4, KV_HEADS, 16)
    g = torch.Generator().manual_seed(5)

    def randn(*shape):
        return torch.randn(*shape, generator=g).half().to(DEVICE)

    leases = [cache.allocate(6), cache.allocate(5)]
    out, report = cache.prefill(
        randn(11, HEADS, 32), randn(11, KV_HEADS, 32), randn(11, KV_HEADS, 16), leases, [6, 5]
    )
    assert out.shape == (11, HEADS, 16) and report.violations.tolist() == [0, 0]
    q = randn(2, HEADS, 32)
    for tamper in (False, True):
        if tamper:
            cache.page_tags[leases[1].pages[0]] = kvattn.written_tag(99, 4)
        out, report = cache.decode(q, leases)
        table, seq_lens, expected = cache.batch(leases)
        want, _ = kvattn.reference.paged_decode(
            q, cache.k_cache, cache.v_cache, table, seq_lens, cache.page_tags, expected
        )
        assert out.shape == (2, HEADS, 16)
        torch.testing.assert_close(out.float(), want, atol=2e-3, rtol=2e-3)
        assert report.violations.tolist() == ([0, 1] if tamper else [0, 0])


def test_paged_kv_cache_head_dim_v_is_checked():
    with raises(ValueError, "head_dim_v", "0"):
        kvattn.PagedKVCache(8, 4, KV_HEADS, 32, head_dim_v=0)
