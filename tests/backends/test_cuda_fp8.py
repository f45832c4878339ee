"""fp8 KV pools in the CUDA decode and extend kernels, run on the CPU harness (``cuda_sim``).

The kernel reads fp8 bytes into shared memory and builds its tensor-core fragments from them
(csrc/kvattn/attention.cuh, qk_scores_fp8 / accumulate_fp8): Q's dims are stored permuted for the
QK^T reads and the output dims come back permuted from P V, so every head-dim padding, head split
(d_split) and GQA chunking is compared here with the reference. The extend's element-wise kernels
convert the codes on the copy into their 16-bit tiles (csrc/kvattn/kv_copy.cuh copy_chunk_fp8). The
conversion of fp8.h is checked
against torch for all 256 bytes of each format. The element-wise fp8 scenarios (NaN-poisoned
foreign pages, the float64 formula) run on cuda_sim through tests/readers/test_variants.py and
tests/contract/test_variant_scenarios.py.
"""

from __future__ import annotations

import pytest
import torch

import kvattn
from kvattn import backends
from kvattn.backends.cuda import launch
from kvattn_testing.util import LSE_TOLERANCE, Batch, assert_reports_equal, tolerance

sim = pytest.importorskip("kvattn.backends.cuda_sim._sim")

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FOREIGN_OWNER = 77


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_conversion_matches_torch_for_every_byte(fmt):
    got = torch.tensor(sim.fp8_to_float(list(range(256)), fmt), dtype=torch.float32)
    want = torch.arange(256, dtype=torch.uint8).view(FORMATS[fmt]).float()
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    # Bit for bit elsewhere: signed zeros, subnormals, the largest values and (e5m2) infinities.
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))
    assert nan.sum() == (2 if fmt == "e4m3" else 6)


def test_conversion_rejects_unknown_formats_and_bytes():
    with pytest.raises(ValueError, match="format"):
        sim.fp8_to_float([0], "e3m4")
    with pytest.raises(ValueError, match="bytes"):
        sim.fp8_to_float([256], "e4m3")


def fp8_batch(fmt, q_dtype, *, head_dim, heads, kv_heads, page, lens, seed=0):
    """A NaN-poisoned batch over fp8 pools, values stored at 4x their size (read back at the
    scales below), with a foreign page full of NaN in the last sequence's second entry."""
    pages = Batch.random(
        batch=len(lens),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        page_size=page,
        seq_lens=lens,
        dtype=torch.float32,
        pool_factor=2,
        seed=seed,
    )
    used = set(pages.block_table.flatten().tolist())
    spare = next(p for p in range(pages.k_cache.shape[0]) if p not in used)
    pages.page_tags[spare] = kvattn.written_tag(FOREIGN_OWNER, page)
    pages.block_table[len(lens) - 1, 1] = spare
    pages.k_cache = (pages.k_cache * 4).to(FORMATS[fmt])
    pages.v_cache = (pages.v_cache * 4).to(FORMATS[fmt])
    pages.q = pages.q.to(q_dtype)
    return pages


def scales(kv_heads):
    """Distinct per-head scales, so that a wrong head's scale shows."""
    k = torch.tensor([0.25, 0.125, 0.3, 0.2][:kv_heads])
    v = torch.tensor([0.25, 0.5, 0.2, 0.4][:kv_heads])
    return k, v


def claimed_decode(pages, splits, **kwargs):
    """``(args, reference (out, lse, report) in float64, cuda_sim's (out, lse, report, plan))`` of
    a checked decode over ``pages`` that cuda_sim claims."""
    args = kvattn.layout.validate_decode(
        pages.q,
        pages.k_cache,
        pages.v_cache,
        pages.block_table,
        pages.seq_lens,
        pages.page_tags,
        pages.expected,
        **kwargs,
    )
    assert backends.explain(args, op="decode")["cuda_sim"] is None
    ref = kvattn.reference.paged_decode(
        pages.q,
        pages.k_cache,
        pages.v_cache,
        pages.block_table,
        pages.seq_lens,
        pages.page_tags,
        pages.expected,
        return_lse=True,
        compute_dtype=torch.float64,
        **kwargs,
    )
    out = torch.empty_like(pages.q)
    lse = torch.empty(pages.q.shape[:2], dtype=torch.float32)
    plan = {}
    report = launch.decode(sim, args, check=True, out=out, lse=lse, num_splits=splits, plan=plan)
    return args, ref, (out, lse, report, plan)


# (q dtype, format, head_dim, heads, kv heads, page, splits, switches): every padded head dim,
# a head dim padded within its tile (80 -> 128), the head split of 512 (d_split 2), a GQA group of
# 20 (two chunks of 16 rows), split-KV with its merge, and the score switches (the VARIANT
# instantiation).
CASES = {
    "fp16-e4m3-d64-gqa20": (torch.float16, "e4m3", 64, 20, 1, 16, 1, {}),
    "bf16-e5m2-d80-split3": (torch.bfloat16, "e5m2", 80, 4, 2, 5, 3, {}),
    "fp16-e5m2-d128": (torch.float16, "e5m2", 128, 4, 2, 16, 1, {}),
    "bf16-e4m3-d256-switches": (
        torch.bfloat16,
        "e4m3",
        256,
        4,
        2,
        8,
        2,
        dict(window_left=30, logits_soft_cap=3.0, sinks=torch.tensor([0.5, -1.0, 0.0, 1.0])),
    ),
    "bf16-e4m3-d512": (torch.bfloat16, "e4m3", 512, 2, 1, 16, 1, {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fp8_decode_matches_the_reference(case):
    q_dtype, fmt, head_dim, heads, kv_heads, page, splits, switches = CASES[case]
    pages = fp8_batch(
        fmt,
        q_dtype,
        head_dim=head_dim,
        heads=heads,
        kv_heads=kv_heads,
        page=page,
        lens=[3, 2 * page + 1, 40],
    )
    k_scale, v_scale = scales(kv_heads)
    args, (ref_out, ref_lse, ref_report), (out, lse, report, plan) = claimed_decode(
        pages, splits, k_scale=k_scale, v_scale=v_scale, **switches
    )
    assert plan["num_splits"] == splits and plan["vec"] == 1
    assert (
        plan["smem_bytes"]
        == sim.tile_layouts()["decode_fp8"][max(64, 1 << (head_dim - 1).bit_length())][
            "shared_bytes"
        ]
    )
    assert torch.isfinite(out).all(), "a refused slot was read"
    # K and V convert exactly to the query's 16-bit type; the kernel rounds the probabilities to it
    # before P V as in the 16-bit pools, so the bound is that of the query dtype.
    assert ref_out.abs().max() > 10 * tolerance(q_dtype)["atol"]
    torch.testing.assert_close(out.double(), ref_out, **tolerance(q_dtype))
    torch.testing.assert_close(lse.double(), ref_lse, **LSE_TOLERANCE)
    assert_reports_equal(report, ref_report)
    assert report.violations.tolist()[-1] == 1


def test_unchecked_fp8_decode_reads_the_foreign_page():
    """The violation twin: the same call unchecked reads the foreign page's NaN."""
    pages = fp8_batch(
        "e4m3", torch.float16, head_dim=64, heads=2, kv_heads=1, page=8, lens=[20, 20]
    )
    k_scale, v_scale = scales(1)
    args = kvattn.layout.validate_decode(
        pages.q,
        pages.k_cache,
        pages.v_cache,
        pages.block_table,
        pages.seq_lens,
        pages.page_tags,
        pages.expected,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    out = torch.empty_like(pages.q)
    launch.decode(sim, args, check=False, out=out, lse=None, num_splits=1)
    assert torch.isfinite(out[0]).all() and torch.isnan(out[1]).all()


def test_fp8_scales_apply_per_kv_head():
    """Doubling one KV head's v_scale doubles exactly its query heads' outputs (a power of two
    changes no rounding)."""
    pages = fp8_batch("e5m2", torch.float16, head_dim=64, heads=4, kv_heads=2, page=16, lens=[30])
    k_scale, v_scale = scales(2)

    def decode(vs):
        args = kvattn.layout.validate_decode(
            pages.q,
            pages.k_cache,
            pages.v_cache,
            pages.block_table,
            pages.seq_lens,
            pages.page_tags,
            pages.expected,
            k_scale=k_scale,
            v_scale=vs,
        )
        out = torch.empty_like(pages.q)
        launch.decode(sim, args, check=True, out=out, lse=None, num_splits=1)
        return out

    base = decode(v_scale)
    doubled = decode(v_scale * torch.tensor([1.0, 2.0]))
    assert torch.equal(doubled[:, :2], base[:, :2])
    assert torch.equal(doubled[:, 2:], base[:, 2:] * 2)


UNALIGNED = {
    # head dim 24 (rows of 24 bytes), and a 3-byte offset view of 32-wide rows in a wider pool
    "d24": dict(head_dim=24),
    "offset-view": dict(head_dim=32, offset=3),
}


def unaligned_batch(case, q_dtype=torch.bfloat16, fmt="e5m2", lens=(3, 17, 40)):
    """fp8_batch with rows that are not 16-byte aligned: an odd head dim, or the same pools seen
    through a view starting 3 codes into wider rows."""
    spec = UNALIGNED[case]
    offset = spec.get("offset", 0)
    pages = fp8_batch(
        fmt,
        q_dtype,
        head_dim=spec["head_dim"] + offset,
        heads=4,
        kv_heads=2,
        page=8,
        lens=list(lens),
    )
    if offset:
        pages.k_cache = pages.k_cache[..., offset:]
        pages.v_cache = pages.v_cache[..., offset:]
        pages.q = pages.q[..., offset:].contiguous()
    return pages


@pytest.mark.parametrize("case", list(UNALIGNED))
def test_unaligned_fp8_decode_runs_the_extend_kernels(case):
    """The fp8 decode kernels copy by 16-byte cp.async alone; pools whose rows are not 16-byte
    aligned are decoded by the extend's element-wise kernels with one row per sequence: against
    the float64 reference, the foreign NaN page refused and reported as by the decode, and the
    unchecked twin reading it. The decode kernels' own planner still refuses such pools."""
    pages = unaligned_batch(case)
    k_scale, v_scale = scales(2)
    args, (ref_out, ref_lse, ref_report), (out, lse, report, plan) = claimed_decode(
        pages,
        2,
        k_scale=k_scale,
        v_scale=v_scale,
        window_left=30,
        sinks=torch.tensor([0.5, -1.0, 0.0, 1.0]),
    )
    assert plan["tokens_per_tile"] >= 1 and plan["vec"] == 0 and plan["fp8_wide"] == (case == "d24")
    assert torch.isfinite(out).all(), "a refused slot was read"
    torch.testing.assert_close(out.double(), ref_out, **tolerance(torch.bfloat16))
    torch.testing.assert_close(lse.double(), ref_lse, **LSE_TOLERANCE)
    assert_reports_equal(report, ref_report)
    assert report.violations.tolist() == [0, 0, 1]
    launch.decode(sim, args, check=False, out=out, lse=None)
    assert torch.isnan(out[2]).all() and torch.isfinite(out[:2]).all()
    params = dict(
        launch._attention_params(args, out, None, None),
        part_acc=0,
        part_ml=0,
        part_report=0,
        verdict=0,
        verdict_fresh=0,
        stride_qb=pages.q.stride(0),
        stride_ob=out.stride(0),
        num_splits=1,
        align=8,
        min_chunk=8,
    )
    with pytest.raises(RuntimeError, match="fp8 pools need 16-byte aligned rows"):
        sim.decode(params, launch.DTYPE_CODES[out.dtype], False, 0)


def fp8_extend(pages, q_lens, seed=1, **kwargs):
    """``(args, q, cu)`` of an extend over ``pages``: ``q_lens`` new rows per sequence (at most
    its length), random queries of the pages' query dtype."""
    g = torch.Generator().manual_seed(seed)
    heads, dim = pages.q.shape[1:]
    q = torch.randn(sum(q_lens), heads, dim, generator=g).to(pages.q.dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    args = kvattn.layout.validate_extend(
        q,
        pages.k_cache,
        pages.v_cache,
        cu,
        pages.block_table,
        pages.seq_lens,
        pages.page_tags,
        pages.expected,
        **kwargs,
    )
    return args, q, cu


# (q dtype, format, head_dim, heads, kv heads, page, query rows per sequence, switches, tokens per
# tile): every padded head dim, a head dim padded within its tile (20 -> 64: rows not a whole
# number of 8-byte loads, so codes are read byte by byte), the head split of 512, a GQA group with
# several query tiles, causal and not, per-sequence scales, and the score switches with a custom
# mask (the VARIANT instantiation).
EXTEND_CASES = {
    "fp16-e4m3-d64-gqa4-tiles": (torch.float16, "e4m3", 64, 8, 2, 16, [3, 7, 12], {}, 4),
    "bf16-e5m2-d20-bytes": (torch.bfloat16, "e5m2", 20, 2, 1, 5, [1, 4, 9], {}, None),
    "fp16-e5m2-d128-noncausal": (
        torch.float16,
        "e5m2",
        128,
        4,
        2,
        16,
        [2, 5, 6],
        dict(causal=False),
        None,
    ),
    "bf16-e4m3-d256-per-seq": (
        torch.bfloat16,
        "e4m3",
        256,
        4,
        2,
        8,
        [1, 3, 2],
        dict(per_sequence=True),
        None,
    ),
    "fp16-e4m3-d512": (torch.float16, "e4m3", 512, 2, 1, 16, [2, 1, 4], {}, None),
    "bf16-e4m3-d128-switches-mask": (
        torch.bfloat16,
        "e4m3",
        128,
        4,
        2,
        8,
        [2, 6, 5],
        dict(
            window_left=30,
            logits_soft_cap=3.0,
            alibi_slopes=torch.tensor([0.1, 0.2, 0.3, 0.4]),
            sinks=torch.tensor([0.5, -1.0, 0.0, 1.0]),
            mask=True,
        ),
        None,
    ),
}


@pytest.mark.parametrize("case", list(EXTEND_CASES))
def test_fp8_extend_matches_the_reference(case):
    """The element-wise extend kernels convert the codes exactly as they copy them, k_scale joins
    the score's scale and v_scale the output: within the query dtype's tolerance of the float64
    reference, the foreign NaN page refused and reported as there."""
    q_dtype, fmt, head_dim, heads, kv_heads, page, q_lens, switches, tokens = EXTEND_CASES[case]
    switches = dict(switches)
    lens = [3, 2 * page + 1, 40]
    pages = fp8_batch(
        fmt, q_dtype, head_dim=head_dim, heads=heads, kv_heads=kv_heads, page=page, lens=lens
    )
    k_scale, v_scale = scales(kv_heads)
    if switches.pop("per_sequence", False):
        k_scale = k_scale * torch.tensor([[1.0], [2.0], [0.5]])
        v_scale = v_scale * torch.tensor([[0.5], [1.0], [4.0]])
    if switches.pop("mask", False):
        g = torch.Generator().manual_seed(5)
        switches["custom_mask"] = (
            torch.rand(sum(n * m for n, m in zip(q_lens, lens)), generator=g) < 0.7
        )
    args, q, cu = fp8_extend(pages, q_lens, k_scale=k_scale, v_scale=v_scale, **switches)
    assert backends.explain(args, op="extend")["cuda_sim"] is None
    ref_out, ref_lse, ref_report = kvattn.reference.paged_extend(
        q,
        pages.k_cache,
        pages.v_cache,
        cu,
        pages.block_table,
        pages.seq_lens,
        pages.page_tags,
        pages.expected,
        return_lse=True,
        compute_dtype=torch.float64,
        k_scale=k_scale,
        v_scale=v_scale,
        **switches,
    )
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32)
    plan = {}
    report = launch.extend(
        sim, args, check=True, out=out, lse=lse, tokens_per_tile=tokens, plan=plan
    )
    assert plan["vec"] == 0 and plan["fp8_wide"] == (head_dim % 8 == 0)
    assert torch.isfinite(out).all(), "a refused slot was read"
    assert ref_out.abs().max() > 10 * tolerance(q_dtype)["atol"]
    torch.testing.assert_close(out.double(), ref_out, **tolerance(q_dtype))
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], **LSE_TOLERANCE)
    assert torch.equal(torch.isfinite(lse), finite)
    assert_reports_equal(report, ref_report)
    assert report.violations.tolist()[-1] == 1


def test_unchecked_fp8_extend_reads_the_foreign_page():
    """The violation twin: the same extend unchecked reads the foreign page's NaN (sequence 1's
    rows), while sequence 0, whose pages are its own, stays finite."""
    pages = fp8_batch(
        "e5m2", torch.float16, head_dim=64, heads=2, kv_heads=1, page=8, lens=[20, 20]
    )
    k_scale, v_scale = scales(1)
    args, q, _ = fp8_extend(pages, [2, 3], k_scale=k_scale, v_scale=v_scale)
    out = torch.empty_like(q)
    launch.extend(sim, args, check=False, out=out, lse=None)
    assert torch.isfinite(out[:2]).all() and torch.isnan(out[2:]).all()
    launch.extend(sim, args, check=True, out=out, lse=None)
    assert torch.isfinite(out).all()


def test_fp8_extend_scales_apply_per_kv_head():
    """Doubling one KV head's v_scale doubles exactly its query heads' outputs; an invalid k_scale
    of the other head silences only that head's rows (output 0, the report unchanged)."""
    pages = fp8_batch("e4m3", torch.bfloat16, head_dim=64, heads=4, kv_heads=2, page=16, lens=[30])
    k_scale, v_scale = scales(2)

    def extend(ks, vs):
        args, q, _ = fp8_extend(pages, [4], k_scale=ks, v_scale=vs, validate=False)
        out = torch.empty_like(q)
        report = launch.extend(sim, args, check=True, out=out, lse=None)
        return out, report

    base, base_report = extend(k_scale, v_scale)
    doubled, _ = extend(k_scale, v_scale * torch.tensor([1.0, 2.0]))
    assert torch.equal(doubled[:, :2], base[:, :2])
    assert torch.equal(doubled[:, 2:], base[:, 2:] * 2)
    silenced, report = extend(k_scale * torch.tensor([float("nan"), 1.0]), v_scale)
    assert (silenced[:, :2] == 0).all() and torch.equal(silenced[:, 2:], base[:, 2:])
    assert_reports_equal(report, base_report)


def test_binding_rejects_an_unknown_pool_dtype_code():
    pages = fp8_batch("e4m3", torch.float16, head_dim=16, heads=2, kv_heads=1, page=4, lens=[9])
    args = kvattn.layout.validate_decode(
        pages.q,
        pages.k_cache,
        pages.v_cache,
        pages.block_table,
        pages.seq_lens,
        pages.page_tags,
        pages.expected,
        k_scale=0.5,
    )
    out = torch.empty_like(pages.q)
    params = dict(
        launch._attention_params(args, out, None, None),
        part_acc=0,
        part_ml=0,
        part_report=0,
        verdict=0,
        verdict_fresh=0,
        stride_qb=pages.q.stride(0),
        stride_ob=out.stride(0),
        num_splits=1,
        align=4,
        min_chunk=4,
        kv_dtype=3,
    )
    with pytest.raises(ValueError, match="kv_dtype must be 0"):
        sim.decode(params, launch.DTYPE_CODES[pages.q.dtype], True, 0)
