"""write_kv into fp8 pools: the stored codes against the rounding rules written out here (nearest
finite value of a table of every code, ties to the even code; or the largest magnitude not above
the quotient's, vLLM's CPU rule), on the torch and Triton writers alike; write-then-read round
trips against float64 attention over the dequantised values, with NaN-filled foreign pages; the
writer's refusals with fp8 pools; which writers claim fp8 pools; the scales' validation;
PagedKVCache with fp8 pools.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvattn
from kvattn import WriteDrop, backends
from kvattn_testing.build import SUBSET_MODULE, built_module
from kvattn_testing.extend import Extend
from kvattn_testing.util import DEVICE
from kvattn_testing.variants import FOREIGN_OWNER, assert_matches, dense, plant_foreign_page, tokens

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
SOURCES = [torch.float32, torch.float16, torch.bfloat16]
WRITERS = ["torch", "triton", "cuda_sim"]
NAN_CODE = 0x7F
HEADS, KV_HEADS, DIM = 4, 2, 16


def code_values(dtype) -> np.ndarray:
    """float64 value of each of the 256 codes, decoded from the bit fields (NaN, inf as such)."""
    exp_bits, mant_bits, bias = (4, 3, 7) if dtype == torch.float8_e4m3fn else (5, 2, 15)
    values = np.empty(256)
    for c in range(256):
        sign = -1.0 if c >> 7 else 1.0
        e = (c >> mant_bits) & ((1 << exp_bits) - 1)
        m = c & ((1 << mant_bits) - 1)
        if dtype == torch.float8_e4m3fn and e == 15 and m == 7:
            values[c] = np.nan
        elif dtype == torch.float8_e5m2 and e == 31:
            values[c] = sign * np.inf if m == 0 else np.nan
        elif e == 0:
            values[c] = sign * m * 2.0 ** (1 - bias - mant_bits)
        else:
            values[c] = sign * (1 + m / 2**mant_bits) * 2.0 ** (e - bias)
    return values


def expected_codes(
    x: torch.Tensor, scale: np.ndarray, dtype, rounding: str = "nearest"
) -> np.ndarray:
    """The codes the writer must store for ``x`` (any float dtype, ``[..., heads, dim]``) with the
    per-head ``scale``: the float32 quotient, saturated to the largest finite value, then
    ``"nearest"``: the nearest code of the same sign, ties to the even code, NaN as 0x7f;
    ``"toward_zero"``: the code of the same sign with the largest magnitude not above the
    quotient's, a quotient below float32's normal range as +0, NaN as the positive largest finite
    value."""
    values = code_values(dtype)
    finite = np.isfinite(values)
    top = values[finite].max()
    y = x.float().numpy() / scale.astype(np.float32)[:, None]
    y = np.clip(y, -top, top).reshape(-1)
    codes = np.arange(256)
    out = np.empty(y.shape, dtype=np.uint8)
    for i, yi in enumerate(y):
        if np.isnan(yi):
            largest = int(np.argmax(np.where(finite, values, -np.inf)))
            out[i] = NAN_CODE if rounding == "nearest" else largest
            continue
        if rounding == "toward_zero" and abs(yi) < np.finfo(np.float32).tiny:
            out[i] = 0
            continue
        same_sign = finite & ((codes >> 7) == int(np.signbit(yi)))
        cand = codes[same_sign]
        if rounding == "toward_zero":
            below = cand[np.abs(values[cand]) <= abs(float(yi))]
            out[i] = below[np.argmax(np.abs(values[below]))]
            continue
        dist = np.abs(values[cand] - float(yi))
        best = cand[dist == dist.min()]
        out[i] = best[best % 2 == 0][0] if len(best) > 1 else best[0]
    return out


def probe_values(dtype) -> torch.Tensor:
    """float32 values where the rounding rule is easy to get wrong: every code's value, the exact
    midpoints between neighbouring magnitudes (ties, subnormal ones included, and between the
    largest subnormal and the smallest normal) and the float32 values either side of them, values
    past the largest finite one and infinities (saturation), signed zeros, float32 subnormals, NaN,
    and random magnitudes over the whole range."""
    values = code_values(dtype)
    mags = np.unique(np.abs(values[np.isfinite(values)]))
    mids = ((mags[:-1] + mags[1:]) / 2).astype(np.float32)
    around = np.concatenate(
        [mids, np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(0))]
    )
    top = mags.max()
    past = np.array([top * 1.03, top * 1.07, top * 2, 1e30, np.inf], dtype=np.float32)
    tiny = np.array([0.0, 1e-40, mags[1] / 4, mags[1] / 2], dtype=np.float32)
    g = np.random.default_rng(0)
    spread = (2.0 ** g.uniform(np.log2(mags[1]) - 2, np.log2(top) + 1, 200)).astype(np.float32)
    pos = np.concatenate([mags.astype(np.float32), around, past, tiny, spread])
    allv = np.concatenate([pos, -pos, np.array([np.nan], dtype=np.float32)])
    return torch.from_numpy(allv)


def as_tokens(flat: torch.Tensor) -> torch.Tensor:
    """``flat`` padded with zeros into ``[T, KV_HEADS, 32]`` tokens."""
    per = KV_HEADS * 32
    pad = (-flat.numel()) % per
    return torch.cat([flat, torch.zeros(pad, dtype=flat.dtype)]).reshape(-1, KV_HEADS, 32)


def poisoned_pools(num_pages, page, dtype):
    """fp8 pools filled with the NaN code: a slot the writer does not store stays NaN."""
    shape = (num_pages, page, KV_HEADS, 32)
    k = torch.full(shape, NAN_CODE, dtype=torch.uint8).view(dtype)
    return k.to(DEVICE), k.clone().to(DEVICE)


@pytest.mark.parametrize("rounding", ["nearest", "toward_zero"])
@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("src", SOURCES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("fmt", list(FP8))
def test_stored_codes_follow_the_rounding_rule(fmt, src, writer, rounding):
    dtype = FP8[fmt]
    k = as_tokens(probe_values(dtype)).to(src)
    v = k.flip(0).contiguous()
    # Power-of-two scales keep the midpoints exact ties; 3 makes inexact quotients.
    k_scale, v_scale = np.array([1.0, 0.25]), np.array([3.0, 3.0])
    page = 4
    num_tokens = k.shape[0]
    k_cache, v_cache = poisoned_pools(-(-num_tokens // page), page, dtype)
    tags = torch.full((k_cache.shape[0],), kvattn.reserved_tag(1), device=DEVICE)
    r = kvattn.write_kv(
        k.to(DEVICE),
        v.to(DEVICE),
        k_cache,
        v_cache,
        torch.arange(num_tokens, device=DEVICE),
        tags,
        1,
        backend=writer,
        k_scale=torch.tensor(k_scale, dtype=torch.float32, device=DEVICE),
        v_scale=3.0,
        fp8_rounding=rounding,
    )
    assert bool(r.landed.all())
    got_k = k_cache.view(torch.uint8).reshape(-1)[: k.numel()].cpu().numpy()
    got_v = v_cache.view(torch.uint8).reshape(-1)[: v.numel()].cpu().numpy()
    want_k = expected_codes(k, k_scale, dtype, rounding)
    want_v = expected_codes(v, v_scale, dtype, rounding)
    bad = np.nonzero(got_k != want_k)[0]
    assert bad.size == 0, (k.reshape(-1)[bad[:5]], got_k[bad[:5]], want_k[bad[:5]])
    np.testing.assert_array_equal(got_v, want_v)
    # Saturation: no finite input became NaN or infinity.
    nonfinite = ~np.isfinite(code_values(dtype)[got_k])
    nan_in = np.isnan(k.float().numpy().reshape(-1))
    assert np.array_equal(nonfinite, nan_in if rounding == "nearest" else np.zeros_like(nan_in))


# float32 subnormals (what a bfloat16 holds below 2**-126), each sign, from the smallest up.
SUBNORMALS = np.float32(2.0**-149) * np.array([1, 3, 2**10 + 1, 2**16, 2**22 + 2**21, 2**23 - 1])


@pytest.mark.parametrize("rounding", ["nearest", "toward_zero"])
@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", list(FP8))
def test_subnormal_tokens_over_small_scales_follow_the_rule(fmt, src, writer, rounding):
    """Tokens below float32's normal range, over the smallest scales the writers take (2**-126,
    2**-100): the quotient is a normal number that rounds to a nonzero code, or a tiny one that
    rounds to a signed zero, by the same rule as any other. The Triton writer converted bfloat16
    subnormals wrongly under the interpreter (and stored zeros or other codes here)."""
    dtype = FP8[fmt]
    pos = SUBNORMALS[np.isfinite(SUBNORMALS)]
    flat = torch.from_numpy(np.concatenate([pos, -pos]).astype(np.float32))
    if src == torch.bfloat16:  # the ones a bfloat16 holds exactly: the upper 7 mantissa bits
        flat = flat[flat.to(torch.bfloat16).float() == flat]
    k = as_tokens(flat).to(src)
    assert k.float().abs().max() < 2.0**-126 and k.float().abs().min() == 0  # subnormals, padding
    scale = np.array([2.0**-126, 2.0**-100])
    k_cache, v_cache = poisoned_pools(-(-k.shape[0] // 4), 4, dtype)
    tags = torch.full((k_cache.shape[0],), kvattn.reserved_tag(1), device=DEVICE)
    kvattn.write_kv(
        k.to(DEVICE),
        k.to(DEVICE),
        k_cache,
        v_cache,
        torch.arange(k.shape[0], device=DEVICE),
        tags,
        1,
        backend=writer,
        k_scale=torch.tensor(scale, dtype=torch.float32, device=DEVICE),
        v_scale=2.0**-126,
        fp8_rounding=rounding,
    )
    want_k = expected_codes(k, scale, dtype, rounding)
    assert np.count_nonzero(want_k & 0x7F) > 0  # some quotients reach nonzero codes
    np.testing.assert_array_equal(k_cache.view(torch.uint8).reshape(-1)[: k.numel()].cpu(), want_k)
    want_v = expected_codes(k, np.array([2.0**-126] * KV_HEADS), dtype, rounding)
    np.testing.assert_array_equal(v_cache.view(torch.uint8).reshape(-1)[: k.numel()].cpu(), want_v)


@pytest.mark.parametrize("rounding", ["nearest", "toward_zero"])
@pytest.mark.parametrize("fmt", list(FP8))
def test_every_writer_stores_identical_bytes(fmt, rounding):
    """On random batches with refusals (the writers decide the same tokens, see
    tests/writers/test_triton_writer.py), the bytes of both pools and the tags agree exactly."""
    dtype = FP8[fmt]
    g = torch.Generator().manual_seed(3)
    k = (torch.randn(12, KV_HEADS, 32, generator=g) * torch.logspace(-6, 3, 32)).to(torch.bfloat16)
    v = (torch.randn(12, KV_HEADS, 32, generator=g) * 500).to(torch.bfloat16)
    slots = torch.tensor([0, 1, 2, 9, 10, 4, 5, 30, 12, 13, 14, 15])
    tags = torch.tensor(
        [
            kvattn.reserved_tag(1),
            kvattn.written_tag(1, 1),
            kvattn.reserved_tag(2),
            kvattn.reserved_tag(1),
        ]
    )
    results = []
    for writer in WRITERS:
        k_cache, v_cache = poisoned_pools(4, 4, dtype)
        t = tags.clone().to(DEVICE)
        r = kvattn.write_kv(
            k.to(DEVICE),
            v.to(DEVICE),
            k_cache,
            v_cache,
            slots.to(DEVICE),
            t,
            1,
            backend=writer,
            k_scale=torch.tensor([0.5, 0.01], device=DEVICE),
            v_scale=torch.tensor(2.0, device=DEVICE),
            fp8_rounding=rounding,
        )
        results.append((k_cache.view(torch.uint8), v_cache.view(torch.uint8), t, r.drop_reasons))
    for writer, result in zip(WRITERS[1:], results[1:]):
        for a, b in zip(results[0], result):
            assert torch.equal(a, b), writer
    assert (results[0][3] != 0).any() and (results[0][3] == 0).any()


# --- write, then read ----------------------------------------------------------------------------


def rewrite_as_fp8(ext: Extend, dtype, writer, k_scale, v_scale):
    """Replace the batch's pools by fp8 pools that only the writer fills: every sequence's tokens
    (the float16 values of the original pages) written by ``writer`` under its owner into pages
    RESERVED for it; other pages hold the NaN code, foreign ones stay WRITTEN for their owner.
    Returns the original float16 pools."""
    p = ext.pages
    page = p.k_cache.shape[1]
    before = (p.k_cache.clone(), p.v_cache.clone())
    shape = p.k_cache.shape
    k_cache = torch.full(shape, NAN_CODE, dtype=torch.uint8, device=DEVICE).view(dtype)
    v_cache = k_cache.clone()
    want_tags = p.page_tags.clone()
    tags = p.page_tags.clone()
    foreign = (tags >> kvattn.tags.OWNER_SHIFT) == FOREIGN_OWNER
    for b in range(p.block_table.shape[0]):
        n = int(p.seq_lens[b])
        own = p.block_table[b, : -(-n // page)].long()
        own = own[~foreign[own]]
        tags[own] = kvattn.reserved_tag(b + 1)
        idx = torch.arange(n, device=DEVICE)
        phys = p.block_table[b].long()[idx // page]
        slot = phys * page + idx % page
        mine = ~foreign[phys]
        r = kvattn.write_kv(
            p.k_cache[phys, idx % page][mine],
            p.v_cache[phys, idx % page][mine],
            k_cache,
            v_cache,
            slot[mine],
            tags,
            b + 1,
            backend=writer,
            k_scale=k_scale,
            v_scale=v_scale,
        )
        assert bool(r.landed.all())
    assert torch.equal(tags, want_tags), "the writer's stamps differ from the pages' contents"
    p.k_cache, p.v_cache = k_cache, v_cache
    return before


# fp8 keeps 3 (e4m3) or 2 (e5m2) mantissa bits: round to nearest is off by at most half a unit in
# the last place, 2**-4 (e4m3) or 2**-3 (e5m2) of the value, in the normal range; below it the
# error is at most half the smallest subnormal, times the scale.
RELATIVE = {"e4m3": 2.0**-4, "e5m2": 2.0**-3}


@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("fmt", list(FP8))
@pytest.mark.parametrize("foreign", [False, True], ids=["clean", "foreign-page"])
def test_write_then_read_matches_dense_attention(fmt, writer, foreign):
    """``clean``: every page a sequence reads is its own (no violation); ``foreign-page``: one of
    sequence 2's table entries names a page written for another owner, full of NaN (violation
    detected: reported, its tokens left out, the output finite)."""
    dtype = FP8[fmt]
    ext = Extend.random(
        [1, 3, 2],
        [6, 9, 4],
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=DIM,
        page_size=4,
        pool_factor=2,
    )
    if foreign:
        plant_foreign_page(ext.pages, 2, 0)
    k_scale = torch.tensor([0.125, 0.5], device=DEVICE)
    v_scale = 0.25
    before = rewrite_as_fp8(ext, dtype, writer, k_scale, v_scale)
    p = ext.pages
    vs = torch.full((KV_HEADS,), v_scale)
    seqs = [tokens(p, b, k_scale.cpu(), vs) for b in range(3)]
    orig = [
        (
            before[0][
                p.block_table[b].long()[torch.arange(int(p.seq_lens[b])) // 4],
                torch.arange(int(p.seq_lens[b])) % 4,
            ]
            .cpu()
            .double()
        )
        for b in range(3)
    ]
    smallest = code_values(dtype)[1]
    for (k, _, ok), x in zip(seqs, orig):
        keep = torch.tensor(ok)
        err = (k[keep] - x[keep]).abs()
        assert (err <= RELATIVE[fmt] * x[keep].abs() + smallest / 2 * 0.5).all()
    want_out, want_lse = dense(ext.q, ext.cu, seqs, DIM**-0.5)
    expect_violations = [0, 0, 1] if foreign else [0, 0, 0]
    for backend in ("reference", "triton"):
        out, lse, report = ext.run(backend, return_lse=True, k_scale=k_scale, v_scale=v_scale)
        assert_matches(out, lse, want_out, want_lse, ext.q.dtype)
        assert report.violations.tolist() == expect_violations
        # Decode of each sequence's last row over the same pages.
        last = ext.cu[1:].long() - 1
        out, lse, report = kvattn.paged_decode(
            ext.q[last],
            p.k_cache,
            p.v_cache,
            p.block_table,
            p.seq_lens,
            p.page_tags,
            p.expected,
            backend=backend,
            return_lse=True,
            k_scale=k_scale,
            v_scale=v_scale,
        )
        assert_matches(out, lse, want_out[last.cpu()], want_lse[last.cpu()], ext.q.dtype)
        assert report.violations.tolist() == expect_violations
        if foreign:
            assert report.reasons[2].item() == int(kvattn.Violation.OWNER_MISMATCH)


# --- refusals ------------------------------------------------------------------------------------

REFUSALS = {
    # (tags of pages 0 and 1, slots, expected drop reason of every token)
    "not-held": ([kvattn.written_tag(2, 4), kvattn.reserved_tag(1)], [0, 1], WriteDrop.NOT_HELD),
    "gap": ([kvattn.reserved_tag(1), kvattn.reserved_tag(1)], [2, 3], WriteDrop.GAP),
    "out-of-range": (
        [kvattn.reserved_tag(1), kvattn.reserved_tag(1)],
        [8, 9],
        WriteDrop.OUT_OF_RANGE,
    ),
}


@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("fmt", list(FP8))
@pytest.mark.parametrize("case", list(REFUSALS))
def test_refused_tokens_leave_fp8_pools_and_tags_untouched(case, fmt, writer):
    tag_list, slots, reason = REFUSALS[case]
    k_cache, v_cache = poisoned_pools(2, 4, FP8[fmt])
    tags = torch.tensor(tag_list, device=DEVICE)
    k = torch.randn(2, KV_HEADS, 32, device=DEVICE)
    r = kvattn.write_kv(
        k,
        k,
        k_cache,
        v_cache,
        torch.tensor(slots, device=DEVICE),
        tags,
        1,
        backend=writer,
        k_scale=0.5,
        v_scale=0.5,
    )
    assert r.drop_reasons.tolist() == [int(reason)] * 2 and int(r.dropped) == 2
    assert (k_cache.view(torch.uint8) == NAN_CODE).all() and (
        v_cache.view(torch.uint8) == NAN_CODE
    ).all()
    assert tags.tolist() == tag_list


@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("fmt", list(FP8))
def test_held_tokens_land_in_fp8_pools(fmt, writer):
    """The twin: the same two tokens at slots 0 and 1 of a page the owner holds land, quantised."""
    k_cache, v_cache = poisoned_pools(2, 4, FP8[fmt])
    tags = torch.tensor([kvattn.reserved_tag(1), kvattn.reserved_tag(1)], device=DEVICE)
    k = torch.randn(2, KV_HEADS, 32, device=DEVICE)
    r = kvattn.write_kv(
        k,
        k,
        k_cache,
        v_cache,
        torch.tensor([0, 1], device=DEVICE),
        tags,
        1,
        backend=writer,
        k_scale=0.5,
        v_scale=0.5,
    )
    assert r.drop_reasons.tolist() == [0, 0]
    assert tags.tolist() == [kvattn.written_tag(1, 2), kvattn.reserved_tag(1)]
    want = expected_codes(k.cpu(), np.array([0.5, 0.5]), FP8[fmt])
    np.testing.assert_array_equal(k_cache[0, :2].view(torch.uint8).reshape(-1).cpu().numpy(), want)
    assert (k_cache.view(torch.uint8)[0, 2:] == NAN_CODE).all()


# --- which writers claim fp8 pools -------------------------------------------------------------


def write_args(pool_dtype, k_dtype=torch.float16, **scales):
    k_cache = torch.zeros(2, 4, KV_HEADS, 32, dtype=pool_dtype)
    k = torch.zeros(1, KV_HEADS, 32, dtype=k_dtype)
    return kvattn.write_args.validate_write_kv(
        k,
        k,
        k_cache,
        k_cache.clone(),
        torch.zeros(1, dtype=torch.int64),
        torch.zeros(2, dtype=torch.int64),
        1,
        **scales,
    )


@pytest.mark.parametrize("k_dtype", [torch.float16, "fp8"], ids=["quantised", "as-is"])
@pytest.mark.parametrize("fmt", list(FP8))
def test_every_writer_claims_fp8_pools(fmt, k_dtype):
    """Wider tokens quantised, and fp8 tokens stored as they are: every writer backend accepts
    them (the CUDA writer by its fp8 instantiations, csrc/instantiations.py)."""
    k_dtype = FP8[fmt] if k_dtype == "fp8" else k_dtype
    reasons = backends.explain(write_args(FP8[fmt], k_dtype=k_dtype), "write_kv")
    assert reasons["torch"] is None
    if _sim_built():
        assert reasons["cuda_sim"] is None


@pytest.mark.parametrize("fmt", list(FP8))
def test_fp8_tokens_are_stored_as_they_are(fmt):
    """fp8 tokens into pools of their format: the same bytes on every writer, refusals as for
    any write (token 2 aims past the written prefix of a page it holds: GAP)."""
    dtype = FP8[fmt]
    k = torch.randint(0, 256, (3, KV_HEADS, 32), dtype=torch.uint8)
    k[k == NAN_CODE] = 0
    k, v = k.view(dtype), k.flip(0).view(dtype)
    results = []
    for writer in WRITERS:
        k_cache, v_cache = poisoned_pools(2, 4, dtype)
        tags = torch.tensor([kvattn.reserved_tag(1), kvattn.written_tag(1, 1)], device=DEVICE)
        r = kvattn.write_kv(
            k.to(DEVICE),
            v.to(DEVICE),
            k_cache,
            v_cache,
            torch.tensor([0, 1, 6], device=DEVICE),
            tags,
            1,
            backend=writer,
        )
        assert r.drop_reasons.tolist() == [0, 0, int(WriteDrop.GAP)], writer
        got = k_cache.view(torch.uint8)
        assert torch.equal(got[0, :2], k[:2].view(torch.uint8)), writer
        assert (got[0, 2:] == NAN_CODE).all() and (got[1] == NAN_CODE).all(), writer
        assert torch.equal(v_cache.view(torch.uint8)[0, :2], v[:2].view(torch.uint8)), writer
        results.append((k_cache.view(torch.uint8), v_cache.view(torch.uint8), tags))
    for writer, result in zip(WRITERS[1:], results[1:]):
        for a, b in zip(results[0], result):
            assert torch.equal(a, b), writer


def _sim_built() -> bool:
    sim = kvattn.backends.load("cuda_sim")[0]
    return sim is not None and sim._sim is not None


@pytest.mark.parametrize("k_dtype", [torch.float16, "fp8"], ids=["quantised", "as-is"])
def test_a_module_built_without_fp8_refuses_fp8_pools(k_dtype, monkeypatch):
    """A harness module built from a subset of the table (fp16 only) has no fp8 writer: the registry
    names the missing type and KVATTN_CUDA_DTYPES; the full module's twin is the test above."""
    subset = built_module(SUBSET_MODULE)
    monkeypatch.setattr(backends.load("cuda_sim")[0], "_sim", subset)
    k_dtype = torch.float8_e4m3fn if k_dtype == "fp8" else k_dtype
    reason = backends.explain(write_args(torch.float8_e4m3fn, k_dtype=k_dtype), "write_kv")[
        "cuda_sim"
    ]
    want = "dtype e4m3" if k_dtype == torch.float8_e4m3fn else "pool dtype e4m3"
    assert reason.startswith(f"{want} not built into this module (it has: dtypes fp16;"), reason
    assert "KVATTN_CUDA_DTYPES builds more" in reason
    assert backends.explain(write_args(torch.float16), "write_kv")["cuda_sim"] is None


def test_good_scales_are_accepted_as_per_head_tensors():
    """The twin: a float, a 0-d, a [1] and a [num_kv_heads] tensor all validate."""
    for scale in (0.5, torch.tensor(0.5), torch.tensor([0.5]), torch.tensor([0.5, 0.5])):
        args = write_args(torch.float8_e4m3fn, torch.bfloat16, k_scale=scale, v_scale=scale)
        assert torch.equal(args.k_scale, torch.tensor([0.5, 0.5]))
    assert write_args(torch.float8_e4m3fn, torch.float8_e4m3fn).k_scale is None
    rounded = write_args(torch.float8_e4m3fn, torch.bfloat16, fp8_rounding="toward_zero")
    assert rounded.fp8_rounding == "toward_zero"
    assert rounded.switches() == ["fp8 KV", "fp8 toward_zero"]


def test_only_the_quantising_writers_claim_rounding_toward_zero():
    """Every writer backend claims the rounding; the switch exists only where the writer quantises
    (the twin, ``test_fp8_rounding_needs_a_quantising_write``-style: fp16 pools refuse it)."""
    args = write_args(torch.float8_e4m3fn, torch.bfloat16, fp8_rounding="toward_zero")
    for name in ("torch", "triton", "cuda", "cuda_sim"):
        module = kvattn.backends.load(name)[0]
        if module is not None:
            assert "fp8 toward_zero" in module.WRITE_SWITCHES
    reasons = backends.explain(args, "write_kv")
    assert reasons["torch"] is None
    if _sim_built():
        assert reasons["cuda_sim"] is None
    with pytest.raises(ValueError, match="fp8_rounding: expected 'nearest'"):
        write_args(torch.float16, fp8_rounding="toward_zero")


def test_k_and_v_of_different_dtypes_are_refused():
    k_cache = torch.zeros(2, 4, KV_HEADS, 32, dtype=torch.float8_e4m3fn)
    k = torch.zeros(1, KV_HEADS, 32, dtype=torch.float16)
    with pytest.raises(TypeError, match="v: expected dtype float16, got float32"):
        kvattn.write_kv(
            k,
            k.float(),
            k_cache,
            k_cache.clone(),
            torch.zeros(1, dtype=torch.int64),
            torch.zeros(2, dtype=torch.int64),
            1,
        )


# --- PagedKVCache ------------------------------------------------------------------------------


@pytest.mark.parametrize("stale", [False, True], ids=["live", "stale-lease"])
def test_paged_kv_cache_with_fp8_pools(stale):
    """A cache of e4m3 pools quantises what it appends and dequantises what it reads: decode
    matches dense attention over the dequantised tokens. ``stale-lease``: the lease was freed and
    its pages handed to another lease before the read (violation detected, nothing read)."""
    cache = kvattn.PagedKVCache(
        num_pages=6,
        page_size=4,
        num_kv_heads=KV_HEADS,
        head_dim=DIM,
        dtype=torch.float8_e4m3fn,
        device=DEVICE,
        k_scale=torch.tensor([0.25, 0.5], device=DEVICE),
        v_scale=0.125,
    )
    g = torch.Generator().manual_seed(5)
    kv = torch.randn(7, KV_HEADS, DIM, generator=g).to(torch.float16).to(DEVICE)
    lease = cache.allocate(7)
    assert not bool(cache.append(lease, kv, kv * 2).dropped)
    k = cache.k_cache[torch.tensor(lease.pages)].reshape(-1, KV_HEADS, DIM)[:7].cpu().double()
    v = cache.v_cache[torch.tensor(lease.pages)].reshape(-1, KV_HEADS, DIM)[:7].cpu().double()
    k, v = k * torch.tensor([0.25, 0.5]).double()[:, None], v * 0.125
    # fp8 e4m3 dequantised values are within 2**-4 (relative) of what was appended, plus half the
    # smallest subnormal (2**-10) times the scale near zero.
    assert ((k - kv.cpu().double()).abs() <= kv.cpu().double().abs() / 16 + 2.0**-10 * 0.5).all()
    q = torch.randn(1, HEADS, DIM, generator=g).to(torch.float16).to(DEVICE)
    if stale:
        cache.free(lease)
        other = cache.allocate(8)
        cache.append(other, kv[:1].repeat(8, 1, 1), kv[:1].repeat(8, 1, 1))
    out, report = cache.decode(q, [lease], backend="reference")
    if stale:
        assert report.violations.tolist() == [2] and (out == 0).all()
        return
    want, _ = dense(q, torch.tensor([0, 1]), [(k, v, [True] * 7)], DIM**-0.5)
    assert report.violations.tolist() == [0]
    torch.testing.assert_close(out.cpu().double(), want, atol=8e-3, rtol=8e-3)


def test_paged_kv_cache_refuses_scales_with_wide_pools():
    with pytest.raises(ValueError, match="k_scale: expected None with float16 pools"):
        kvattn.PagedKVCache(num_pages=2, page_size=4, num_kv_heads=1, head_dim=8, k_scale=0.5)


# --- the custom op -------------------------------------------------------------------------------


@pytest.mark.parametrize("held", [True, False], ids=["held", "not-held"])
def test_write_kv_op_quantises_like_the_direct_call(held):
    """``kvattn.ops.write_kv`` with scales stores the direct call's bytes and drops what it drops
    (``not-held``: owner 8 holds no page, every token is refused); opcheck passes with scales
    (but its schema test, which multiplies the mutated tensors, a CPU op torch lacks for fp8)."""
    from kvattn import ops

    g = torch.Generator().manual_seed(2)
    k = torch.randn(3, KV_HEADS, 32, generator=g) * 40
    v = torch.randn(3, KV_HEADS, 32, generator=g)
    slots = torch.tensor([4, 5, 6])
    owner = 7 if held else 8
    results = []
    for write in (ops.write_kv, kvattn.write_kv):
        k_cache, v_cache = poisoned_pools(3, 4, torch.float8_e5m2)
        k_cache, v_cache = k_cache.cpu(), v_cache.cpu()
        tags = torch.zeros(3, dtype=torch.int64)
        kvattn.reserve_pages(tags, [1], 7)
        r = write(
            k,
            v,
            k_cache,
            v_cache,
            slots,
            tags,
            owner,
            k_scale=torch.tensor([0.5, 2.0]),
            v_scale=0.25,
        )
        results.append((k_cache.view(torch.uint8), v_cache.view(torch.uint8), tags, r.drop_reasons))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert bool((results[0][3] == 0).all()) == held
    k_cache, v_cache = poisoned_pools(3, 4, torch.float8_e5m2)
    tags = torch.zeros(3, dtype=torch.int64)
    kvattn.reserve_pages(tags, [1], 7)
    torch.library.opcheck(
        torch.ops.kvattn.write_kv.default,
        (
            k,
            v,
            k_cache.cpu(),
            v_cache.cpu(),
            slots,
            tags,
            torch.tensor(owner),
            torch.tensor([0.5, 2.0]),
            torch.tensor([0.25, 0.25]),
        ),
        test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"),
    )
