"""fp8 queries (``q`` e4m3/e5m2 over fp8 pools, ``q_scale``: FlashAttention 3's ``q_descale``,
vLLM's fp8 attention), per tensor, per KV head and per sequence.

Against :func:`kvattn_testing.variants.dense`, the float64 definition one row at a time, fed the
dequantised queries (codes times their KV head's scale) and keys; a foreign page (NaN in K and V)
planted where a sequence reads it, on every backend that claims the call (the CUDA kernels too,
but for a float32 output, which they refuse saying so). The twins: a clean batch reports nothing;
a NaN ``q_scale`` for one KV head empties that head's rows only; the validated call names the
argument.
"""

from __future__ import annotations

import pytest
import torch

import kvattn
from kvattn import backends, ops
from kvattn.backends.cuda import launch as cuda_launch
from kvattn_testing.extend import Extend
from kvattn_testing.util import (
    DEVICE,
    Batch,
    claims,
    launcher,
    raises,
    split_kv_backends,
    tolerance,
)
from kvattn_testing.variants import (
    CASES,
    DIM,
    FP8,
    HEADS,
    KV_HEADS,
    assert_matches,
    decode_rows,
    dense,
    inputs,
    plant_foreign_page,
    to_fp8,
    tokens,
)

GROUP = HEADS // KV_HEADS
K_SCALE, V_SCALE = torch.tensor([0.125, 0.0625]), torch.tensor([0.25, 0.5])
# q_scale per tensor, per KV head, per sequence (four sequences); the codes are q / scale, so the
# smaller scales stretch randn queries toward fp8's range.
Q_SCALES = {
    "tensor": 0.25,
    "per-head": torch.tensor([0.25, 0.125]),
    "per-seq": torch.tensor([[0.25, 0.125], [0.5, 0.0625], [0.125, 0.25], [1.0, 0.5]]),
}


def as_rows(scale, batch: int) -> torch.Tensor:
    """``[batch, num_kv_heads]`` float64 form of a scale as passed (float, per head or per seq)."""
    t = torch.as_tensor(scale, dtype=torch.float64).cpu()
    return t.expand(batch, KV_HEADS) if t.dim() < 2 else t


def quantise_q(q: torch.Tensor, scale, seq_of_row: torch.Tensor, fmt: str):
    """``(codes, dequantised)``: ``q`` as fp8 codes of ``q / scale`` (the row's sequence's scale of
    each head's KV head), and the float64 queries the codes stand for."""
    per_row = as_rows(scale, int(seq_of_row.max()) + 1)[seq_of_row]  # [rows, KV_HEADS]
    per_head = per_row.repeat_interleave(GROUP, dim=1)[..., None]  # [rows, HEADS, 1]
    codes = (q.cpu().double() / per_head).to(FP8[fmt])
    return codes.to(DEVICE), codes.double() * per_head


def device_scale(scale):
    return scale.to(DEVICE) if isinstance(scale, torch.Tensor) else scale


def fp8_decode_batch(fmt: str = "e4m3", foreign: bool = True, lens=(1, 5, 14, 12), seed=0):
    """fp8 pools, a foreign page in the last sequence's second entry (unless ``foreign=False``)."""
    pages = Batch.random(
        batch=4,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=DIM,
        page_size=4,
        seq_lens=list(lens),
        pool_factor=2,
        seed=seed,
    )
    if foreign:
        plant_foreign_page(pages, 3, 1)
    return to_fp8(pages, FP8[fmt])


def decode_case(fmt: str, form: str, **kwargs):
    """``(pages, call kwargs, dequantised q)`` of an fp8 decode whose q_scale has ``form``."""
    pages = fp8_decode_batch(fmt, **kwargs)
    pages.q, q_deq = quantise_q(pages.q, Q_SCALES[form], torch.arange(4), fmt)
    scales = dict(
        k_scale=K_SCALE.to(DEVICE), v_scale=V_SCALE.to(DEVICE), q_scale=device_scale(Q_SCALES[form])
    )
    return pages, scales, q_deq


def seqs_of(pages: Batch):
    return [tokens(pages, b, K_SCALE, V_SCALE) for b in range(pages.seq_lens.shape[0])]


def assert_decode_claims_match(pages, scales, q_deq, violations, theirs=None, **switches):
    want_out, want_lse = dense(
        q_deq, decode_rows(pages), seqs_of(pages), DIM**-0.5, **(theirs or {})
    )
    names = claims(kvattn.layout.validate_decode(*inputs(pages), **scales, **switches), "decode")
    assert "reference" in names and "triton" in names, names
    for backend in names:
        out, lse, report = kvattn.paged_decode(
            *inputs(pages), backend=backend, return_lse=True, **scales, **switches
        )
        assert out.dtype == torch.bfloat16, backend
        assert_matches(out, lse, want_out, want_lse, out.dtype)
        assert report.violations.tolist() == violations, backend


@pytest.mark.parametrize("form", list(Q_SCALES))
@pytest.mark.parametrize("fmt", list(FP8))
def test_fp8_query_decode_matches_the_definition(fmt, form):
    pages, scales, q_deq = decode_case(fmt, form)
    assert_decode_claims_match(pages, scales, q_deq, [0, 0, 0, 1])


def test_a_clean_fp8_query_batch_reports_nothing():
    pages, scales, q_deq = decode_case("e4m3", "per-head", foreign=False)
    assert_decode_claims_match(pages, scales, q_deq, [0, 0, 0, 0])


@pytest.mark.parametrize("case", ["all", "softcap"])
def test_fp8_queries_under_the_score_switches(case):
    ours, theirs = CASES[case]
    pages, scales, q_deq = decode_case("e4m3", "per-seq")
    assert_decode_claims_match(pages, scales, q_deq, [0, 0, 0, 1], theirs=theirs, **ours)


@pytest.mark.parametrize("num_splits", [2, 5])
def test_fp8_query_decode_across_splits(num_splits):
    """Split partials carry the query's scale in their logits: merged, they are the unsplit call."""
    pages = fp8_decode_batch(foreign=False, lens=(90, 17, 1, 64), seed=7)
    plant_foreign_page(pages, 0, 20)
    pages.q, q_deq = quantise_q(pages.q, Q_SCALES["per-seq"], torch.arange(4), "e5m2")
    scales = dict(
        k_scale=K_SCALE.to(DEVICE),
        v_scale=V_SCALE.to(DEVICE),
        q_scale=Q_SCALES["per-seq"].to(DEVICE),
    )
    args = kvattn.layout.validate_decode(*inputs(pages), **scales)
    want_out, want_lse = dense(q_deq, decode_rows(pages), seqs_of(pages), DIM**-0.5)
    kernels = [n for n in claims(args, "decode") if n in split_kv_backends()]
    assert kernels
    for backend in kernels:
        out = torch.empty(pages.q.shape, dtype=torch.bfloat16, device=DEVICE)
        lse = torch.empty(pages.q.shape[:2], dtype=torch.float32, device=DEVICE)
        report = launcher(backend).decode(args, check=True, out=out, lse=lse, num_splits=num_splits)
        assert_matches(out, lse, want_out, want_lse, out.dtype)
        assert report.violations.tolist() == [1, 0, 0, 0]


def extend_case(fmt: str, form: str):
    """Four sequences of 1, 5, 3 and 2 new rows after 3, 0, 9 and 12 cached tokens; sequence 3's
    third entry a foreign page (read by every row of it)."""
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
    seq_of_row = torch.repeat_interleave(torch.arange(4), torch.tensor([1, 5, 3, 2]))
    ext.q, q_deq = quantise_q(ext.q, Q_SCALES[form], seq_of_row, fmt)
    scales = dict(
        k_scale=K_SCALE.to(DEVICE), v_scale=V_SCALE.to(DEVICE), q_scale=device_scale(Q_SCALES[form])
    )
    return ext, scales, q_deq


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("form", list(Q_SCALES))
def test_fp8_query_extend_matches_the_definition(form, causal):
    ext, scales, q_deq = extend_case("e4m3" if causal else "e5m2", form)
    want_out, want_lse = dense(q_deq, ext.cu, seqs_of(ext.pages), DIM**-0.5, causal=causal)
    names = claims(kvattn.layout.validate_extend(*ext.inputs(), causal=causal, **scales), "extend")
    assert "reference" in names and "triton" in names, names
    for backend in names:
        out, lse, report = ext.run(backend, return_lse=True, causal=causal, **scales)
        assert out.dtype == torch.bfloat16, backend
        assert_matches(out, lse, want_out, want_lse, out.dtype)
        assert report.violations.tolist() == [0, 0, 0, 1], backend


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32])
def test_the_caller_s_out_sets_the_output_dtype(out_dtype):
    pages, scales, q_deq = decode_case("e4m3", "per-head")
    want_out, want_lse = dense(q_deq, decode_rows(pages), seqs_of(pages), DIM**-0.5)
    out = torch.empty(pages.q.shape, dtype=out_dtype, device=DEVICE)
    args = kvattn.layout.validate_decode(*inputs(pages), out=out, **scales)
    for backend in claims(args, "decode"):
        got, lse, _ = kvattn.paged_decode(
            *inputs(pages), backend=backend, out=out, return_lse=True, **scales
        )
        assert got is out
        # The kernels' products are bf16's whatever the output's dtype.
        assert_matches(out, lse, want_out, want_lse, torch.bfloat16)


@pytest.mark.parametrize("op", ["decode", "extend"])
def test_an_invalid_q_scale_empties_its_kv_head_s_rows_only(op):
    """Unvalidated, a NaN q_scale for KV head 1 makes that head's query heads read nothing (output
    0, lse -inf, kvattn.variants' rule); KV head 0's rows are the definition's, and the report is
    unchanged."""
    if op == "decode":
        x, scales, q_deq = decode_case("e4m3", "per-head")
        pages, rows = x, decode_rows(x)
    else:
        x, scales, q_deq = extend_case("e4m3", "per-head")
        pages, rows = x.pages, x.cu
    bad = dict(scales, q_scale=torch.tensor([0.25, float("nan")], device=DEVICE))
    want_out, want_lse = dense(q_deq, rows, seqs_of(pages), DIM**-0.5)
    call = (lambda **kw: kvattn.paged_decode(*inputs(x), **kw)) if op == "decode" else x.run
    with raises(ValueError, "q_scale", "KV head 1"):
        call(backend="reference", **bad)
    args = (
        kvattn.layout.validate_decode(*inputs(x), validate=False, **bad)
        if op == "decode"
        else kvattn.layout.validate_extend(*x.inputs(), validate=False, **bad)
    )
    for backend in claims(args, op):
        out, lse, report = call(backend=backend, return_lse=True, validate=False, **bad)
        kept = slice(0, GROUP)
        assert_matches(out[:, kept], lse[:, kept], want_out[:, kept], want_lse[:, kept], out.dtype)
        assert (out[:, GROUP:] == 0).all() and torch.isneginf(lse[:, GROUP:]).all(), backend
        assert report.violations.tolist() == [0, 0, 0, 1], backend


def test_the_cuda_kernels_refuse_a_float32_out_for_fp8_queries():
    """The CUDA kernels' element type is the output's: bfloat16 (kvattn's default for fp8 queries)
    or float16 run there, a caller's float32 out is refused naming it (the triton backend runs it)."""
    pages, scales, _ = decode_case("e4m3", "per-head")
    for op, x in (("decode", pages), ("extend", extend_case("e5m2", "per-seq")[0])):
        validate = (
            kvattn.layout.validate_decode if op == "decode" else kvattn.layout.validate_extend
        )
        given = inputs(x) if op == "decode" else x.inputs()
        sc = scales if op == "decode" else extend_case("e5m2", "per-seq")[1]
        q = given[0]
        assert cuda_launch.unsupported(validate(*given, **sc)) is None
        assert (
            cuda_launch.unsupported(
                validate(*given, out=torch.empty(q.shape, dtype=torch.float16, device=DEVICE), **sc)
            )
            is None
        )
        wide = validate(*given, out=torch.empty(q.shape, dtype=torch.float32, device=DEVICE), **sc)
        reason = cuda_launch.unsupported(wide)
        assert reason is not None and "out dtype float32" in reason and "triton" in reason
        assert backends.explain(wide, op=op)["cuda_sim"] is not None


def test_a_per_sequence_q_scale_widens_the_kv_scales():
    """The kernels read every scale with one stride: per-head K/V scales beside a per-sequence
    q_scale become ``[batch, num_kv_heads]``, and their value errors still name the KV head only."""
    pages, scales, _ = decode_case("e4m3", "per-seq")
    sw = kvattn.layout.validate_decode(*inputs(pages), **scales).variant
    assert sw.k_scale.shape == sw.v_scale.shape == sw.q_scale.shape == (4, KV_HEADS)
    assert sw.widened == ("k_scale", "v_scale") and sw.scale_stride == KV_HEADS
    with raises(ValueError, "v_scale", "KV head 1") as error:
        kvattn.layout.validate_decode(
            *inputs(pages), **dict(scales, v_scale=torch.tensor([0.5, 0.0], device=DEVICE))
        )
    assert "sequence" not in str(error.value)
    with raises(ValueError, "q_scale", "sequence 2, KV head 0"):
        q_scale = Q_SCALES["per-seq"].clone()
        q_scale[2, 0] = float("inf")
        kvattn.layout.validate_decode(*inputs(pages), **dict(scales, q_scale=q_scale.to(DEVICE)))


def test_fp8_query_arguments_are_named():
    pages, scales, _ = decode_case("e4m3", "per-head")
    q8 = pages.q
    with raises(TypeError, "k_cache", "fp8"):  # an fp8 q over 16-bit pools
        bf16 = Batch.random(
            batch=4,
            num_heads=HEADS,
            num_kv_heads=KV_HEADS,
            head_dim=DIM,
            page_size=4,
            seq_lens=[1, 5, 14, 12],
            pool_factor=2,
        )
        kvattn.paged_decode(q8, *inputs(bf16)[1:], backend="reference")
    with raises(ValueError, "q_scale", "None", "float16"):  # a q_scale with a 16-bit q
        kvattn.paged_decode(
            q8.to(torch.float16), *inputs(pages)[1:], backend="reference", q_scale=0.5
        )
    with raises(ValueError, "q_scale", "shape"):
        kvattn.paged_decode(
            *inputs(pages), backend="reference", q_scale=torch.ones(3, device=DEVICE)
        )
    with raises(ValueError, "q_scale", "[2**-126, 2**126]"):
        kvattn.paged_decode(*inputs(pages), backend="reference", q_scale=0.0)
    with raises(TypeError, "out", "dtype"):
        kvattn.paged_decode(
            *inputs(pages),
            backend="reference",
            **scales,
            out=torch.empty(pages.q.shape, dtype=torch.int32, device=DEVICE),
        )
    with raises(TypeError, "q", "dtype"):  # MLA reads 16-bit latents only
        kvattn.paged_mla_decode(
            q8, pages.k_cache[:, :, :1], *inputs(pages)[3:], kv_lora_rank=8, backend="reference"
        )


def test_the_custom_ops_take_q_scale():
    pages, scales, _ = decode_case("e4m3", "per-seq")
    out, lse, report = ops.paged_decode(
        *inputs(pages), backend="reference", return_lse=True, **scales
    )
    direct = kvattn.paged_decode(*inputs(pages), backend="reference", return_lse=True, **scales)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, direct[0]) and torch.equal(lse, direct[1])
    # The twin: without the query's scale (1 for every head) the answer differs.
    ones = dict(scales, q_scale=1.0)
    assert (
        ops.paged_decode(*inputs(pages), backend="reference", **ones)[0].float() - out.float()
    ).abs().max() > 10 * tolerance(torch.bfloat16)["atol"]
    ext, ext_scales, _ = extend_case("e4m3", "per-seq")
    got = ops.paged_extend(*ext.inputs(), backend="reference", **ext_scales)[0]
    assert torch.equal(got, ext.run("reference", **ext_scales)[0])
