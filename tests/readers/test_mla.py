"""MLA paged decode (:func:`kvattn.paged_mla_decode`): the Triton kernel against the reference, both
against MLA attention written from its definition here, token by token; the peers' geometry (a
512 + 64 latent, pages of 64 tokens); splits; the ownership scenarios of docs/ownership.md section
6 on the latent cache, also through the MLA extend kernel with one query row per sequence (the
decode it equals; :mod:`test_mla_extend` holds the extend's own properties); validation errors; the
registry and the custom op.

Pools come from :class:`kvattn_testing.mla.MLABatch`: pages drawn from a random permutation of an
oversized pool, NaN in every slot a reader must not use, so a wrong address or mask shows as NaN or
a large error.
Small latents (32 + 16) keep the interpreter fast where the geometry does not matter; every
property that depends on the tile shapes is also run at 512 + 64.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kvattn
from kvattn import KVOwnershipError, Violation, backends, ops
from kvattn.tags import STATE_WRITTEN
from kvattn_testing.mla import (
    EXTEND,
    SENTINEL,
    MLABatch,
    incident,
    latent_attention,
    readable_latent,
    shared_prefix,
)
from kvattn_testing.util import DEVICE, LSE_TOLERANCE, assert_reports_equal, raises, tolerance

BACKENDS = ["reference", "triton"]
# The scenarios also run through the MLA extend kernel, one query row per sequence (MLABatch.decode).
SCENARIO_BACKENDS = BACKENDS + [EXTEND + "triton"]
# The CUDA decode's latent tile through the CPU harness: FlashMLA's 512 + 64 only.
LATENT_TILE = (
    ["cuda_sim"] if getattr(backends.load("cuda_sim")[0], "_sim", None) is not None else []
)


def mla_formula(batch: MLABatch, *, scale=None, check=True):
    """MLA decode from its definition, in float64, one token at a time (:func:`readable_latent`,
    :func:`latent_attention`)."""
    q, lora = batch.q.cpu(), batch.kv_lora_rank
    scale = q.shape[2] ** -0.5 if scale is None else scale
    out = torch.zeros(q.shape[0], q.shape[1], lora, dtype=torch.float64)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64)
    for b in range(q.shape[0]):
        keys = [row for _, row in readable_latent(batch, b, check)]
        for h in range(q.shape[1]):
            out[b, h], lse[b, h] = latent_attention(q[b, h], keys, lora, scale)
    return out, lse


def assert_matches(batch, backend, *, check=True, **kwargs):
    """``backend``'s output, lse and report against the reference (float64) and the formula;
    returns them."""
    out, lse, report = batch.decode(backend, check=check, return_lse=True, **kwargs)
    ref_out, ref_lse, ref_report = batch.reference(
        check=check, return_lse=True, scale=kwargs.get("scale")
    )
    want_out, want_lse = mla_formula(batch, check=check, scale=kwargs.get("scale"))
    assert out.shape == (*batch.q.shape[:2], batch.kv_lora_rank) and out.dtype == batch.q.dtype
    assert torch.isfinite(out).all(), "a refused or masked slot was read"
    tol = tolerance(batch.q.dtype)
    torch.testing.assert_close(ref_out, want_out.to(DEVICE), atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(ref_lse, want_lse.to(DEVICE), atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(out.double(), want_out.to(DEVICE), **tol)
    torch.testing.assert_close(lse.double(), want_lse.to(DEVICE), **LSE_TOLERANCE)
    if check:
        assert_reports_equal(report, ref_report)
    else:
        assert report is None
    return out, lse, report


def boundary_lens(page):
    return [1, max(1, page - 1), page, page + 1, 2 * page + 1]


# --- Against the reference and the formula --------------------------------------------------------

# (dtype, lora, rope, page, heads, num_splits): every dtype, page sizes below, equal to and above the
# 16/32-token tiles (1 and 5 resolved per token), heads below 16, between blocks and over two blocks,
# one and several splits, a latent without RoPE part.
CASES = [
    (torch.float16, 32, 16, 4, 4, 1),
    (torch.bfloat16, 32, 16, 5, 3, 2),
    (torch.float32, 32, 16, 1, 2, 3),
    (torch.float16, 64, 0, 16, 20, 2),
    (torch.bfloat16, 512, 64, 64, 16, 1),
    (torch.float16, 512, 64, 64, 16, 3),
    (torch.float32, 48, 8, 32, 1, 2),
]


@pytest.mark.parametrize(
    "dtype,lora,rope,page,heads,splits",
    CASES,
    ids=[f"{str(c[0])[6:]}-{c[1]}+{c[2]}-p{c[3]}-h{c[4]}-s{c[5]}" for c in CASES],
)
@pytest.mark.parametrize("check", [True, False], ids=["checked", "unchecked"])
def test_triton_matches_reference_and_formula(dtype, lora, rope, page, heads, splits, check):
    batch = MLABatch.random(
        seq_lens=boundary_lens(page),
        num_heads=heads,
        lora=lora,
        rope=rope,
        page_size=page,
        dtype=dtype,
        seed=lora + page,
    )
    _, _, report = assert_matches(batch, "triton", check=check, num_splits=splits)
    if check:
        assert not report.any() and report.pages_checked.tolist() == [
            -(-n // page) for n in boundary_lens(page)
        ]


@pytest.mark.parametrize("backend", BACKENDS)
def test_scale_is_applied(backend):
    batch = MLABatch.random(seq_lens=[9, 3], page_size=4)
    assert_matches(batch, backend, scale=0.37)


@pytest.mark.parametrize("heads", [16, 128])
def test_peer_grid_512_plus_64_page_64(heads):
    """FlashMLA's and vLLM's MLA test geometry (latent 512 + 64, bf16, pages of 64, 16 or 128 query
    heads) on a small batch: one sequence ending a slot into its third page, one ending on a page
    boundary, both split in two."""
    batch = MLABatch.random(
        seq_lens=[129, 64],
        num_heads=heads,
        lora=512,
        rope=64,
        page_size=64,
        dtype=torch.bfloat16,
        seed=heads,
    )
    out, lse, report = batch.decode("triton", return_lse=True, num_splits=2)
    ref_out, ref_lse, ref_report = batch.reference(return_lse=True)
    torch.testing.assert_close(out.double(), ref_out, **tolerance(torch.bfloat16))
    torch.testing.assert_close(lse.double(), ref_lse, **LSE_TOLERANCE)
    assert_reports_equal(report, ref_report)
    assert not report.any() and report.pages_checked.tolist() == [3, 1]


def test_bf16_output_is_not_garbage():
    """A query aligned with one latent row makes attention peaked: the output must follow that
    row's value part (the interpreter's bf16 tl.dot is wrong unless upcast)."""
    batch = MLABatch.random(
        seq_lens=[70], num_heads=16, lora=512, rope=64, page_size=64, dtype=torch.bfloat16, seed=4
    )
    p = int(batch.block_table[0, 1])
    batch.q[0] = (batch.kv_cache[p, 3, 0] * 0.5).to(torch.bfloat16)
    out, _ = batch.decode("triton")
    ref_out, _ = batch.reference()
    torch.testing.assert_close(out.double(), ref_out, **tolerance(torch.bfloat16))
    cos = torch.nn.functional.cosine_similarity(
        out[0].float(), batch.kv_cache[p, 3, 0, :512].float()[None]
    )
    assert (cos > 0.9).all()


def test_strided_pool_view_out_buffer_and_per_entry_expected():
    """The latent pool as a per-layer view of a larger buffer (rows two pools apart), the output
    into a caller's buffer, ``expected`` given per block-table entry."""
    batch = MLABatch.random(seq_lens=[6, 11], page_size=4, num_heads=3)
    batch.as_layer_view()
    out_buf = torch.full((2, 3, 32), float("nan"), dtype=batch.q.dtype, device=DEVICE)
    for backend in BACKENDS:
        out, report = batch.decode(backend, out=out_buf)
        assert out is out_buf and not report.any()
        torch.testing.assert_close(
            out.double(), mla_formula(batch)[0].to(DEVICE), **tolerance(batch.q.dtype)
        )
        out_buf.fill_(float("nan"))


def test_planned_splits_cover_the_sequence():
    """Without ``num_splits`` the planner splits a table of 2048 tokens (in two on the CPU, more on
    a GPU): the merge of the splits equals the reference."""
    from kvattn.backends.triton import paged_mla_decode as module

    batch = MLABatch.random(
        seq_lens=[2048, 700],
        page_size=64,
        pool_factor=1,
        lora=32,
        rope=16,
        num_heads=2,
        dtype=torch.float32,
    )
    args = kvattn.layout.validate_mla_decode(*batch.inputs(), kv_lora_rank=32)
    assert module.plan_splits(args)[0] == (2 if DEVICE.type == "cpu" else 8)
    out, lse, report = batch.decode("triton", return_lse=True)
    ref_out, ref_lse, ref_report = batch.reference(return_lse=True)
    torch.testing.assert_close(out.double(), ref_out, **tolerance(torch.float32))
    torch.testing.assert_close(lse.double(), ref_lse, **LSE_TOLERANCE)
    assert_reports_equal(report, ref_report)


# --- Fully refused rows and splits ---------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("splits", [1, 3])
def test_fully_refused_sequences_give_zero_and_minus_inf(backend, splits):
    batch = MLABatch.random(seq_lens=[9, 12, 1, 5], page_size=4)
    for i in range(3):
        batch.page_tags[int(batch.block_table[1, i])] = kvattn.reserved_tag(2)
    batch.seq_lens[3] = 0
    out, lse, report = assert_matches(batch, backend, num_splits=splits)
    for b in (1, 3):
        assert torch.equal(out[b], torch.zeros_like(out[b])) and torch.isneginf(lse[b]).all()
    assert torch.isfinite(lse[[0, 2]]).all()
    assert report.violations.tolist() == [0, 3, 0, 0]


def test_clean_sequences_have_finite_rows():
    """The twin: the same batch without the refused pages and empty sequence is finite throughout."""
    batch = MLABatch.random(seq_lens=[9, 12, 1, 5], page_size=4)
    _, lse, report = assert_matches(batch, "triton", num_splits=3)
    assert torch.isfinite(lse).all() and not report.any()


def test_refused_split_leaves_the_other_split_exact():
    """Two splits of 64 tokens; the first split's pages are all refused, so its partial is empty
    (m = -inf, l = 0) and the merge returns the second split's attention alone."""
    batch = MLABatch.random(
        seq_lens=[128, 128],
        page_size=16,
        lora=512,
        rope=64,
        num_heads=16,
        dtype=torch.float16,
        seed=7,
    )
    for i in range(4):
        batch.page_tags[int(batch.block_table[0, i])] = kvattn.FREE_TAG
    _, _, report = assert_matches(batch, "triton", num_splits=2)
    assert report.violations.tolist() == [4, 0]
    assert report.page_reasons[0].tolist() == [int(Violation.FREE)] * 4 + [0] * 4


# --- The scenarios of docs/ownership.md section 6 on the latent cache ----------------------------
# Pages of 4 tokens are resolved per token by the kernel (shorter than its 32-row tile), pages of 32
# tile by tile with one scalar tag test: each scenario runs on both paths.


@pytest.fixture(params=[4, 32], ids=lambda p: f"p{p}")
def page(request):
    return request.param


@pytest.fixture(params=SCENARIO_BACKENDS)
def backend(request):
    return request.param


def check_incident(batch, row, backend):
    lora = batch.kv_lora_rank
    out, _, report = assert_matches(batch, backend)
    assert report.violations.tolist() == [4]
    assert report.reasons.tolist() == [int(Violation.UNWRITTEN | Violation.RESERVED)]
    assert (
        report.page_reasons[0].tolist()
        == [int(Violation.UNWRITTEN)] + [int(Violation.RESERVED)] * 3
    )
    # Attention over B's one token is that token's value part, for every head.
    want = row[:lora].float().expand(out.shape[1], -1)
    torch.testing.assert_close(out[0].float(), want, **tolerance(batch.q.dtype))
    assert out.abs().max() < 10, "sentinel influence"


def test_incident_replay_checked_refuses_and_reports(backend, page):
    check_incident(*incident(page=page), backend)


@pytest.mark.parametrize("backend", SCENARIO_BACKENDS + LATENT_TILE)
def test_incident_replay_checked_at_512_plus_64_page_64(backend):
    check_incident(*incident(lora=512, rope=64, page=64, heads=16), backend)


@pytest.mark.parametrize("backend", LATENT_TILE)
def test_incident_replay_unchecked_at_512_plus_64_shows_the_sentinel(backend):
    """The twin on the CUDA latent tile: unchecked, B reads A's released rows."""
    batch, _ = incident(lora=512, rope=64, page=64, heads=16)
    out, report = batch.decode(backend, check=False)
    assert report is None and (out.float() > 0.9 * SENTINEL).all()


# --- The CUDA decode's latent tile (FlashMLA's 512 + 64), through the CPU harness -----------------

# (dtype, page, heads, num_splits): FlashMLA's page of 64 with one and three splits, a page that
# divides no 16-token sub-tile (5), one token a page, a GQA group over one 16-row chunk (20 heads),
# and a few heads.
LATENT_CASES = [
    (torch.bfloat16, 64, 16, 1),
    (torch.float16, 64, 16, 3),
    (torch.bfloat16, 5, 20, 2),
    (torch.float16, 1, 3, 1),
]


@pytest.mark.parametrize(
    "dtype,page,heads,splits",
    LATENT_CASES,
    ids=[f"{str(c[0])[6:]}-p{c[1]}-h{c[2]}-s{c[3]}" for c in LATENT_CASES],
)
@pytest.mark.parametrize("check", [True, False], ids=["checked", "unchecked"])
def test_cuda_latent_tile_matches_reference_and_formula(dtype, page, heads, splits, check):
    """The decode kernel's latent tile reads each 576-dim row once, as the key and (its first 512
    dims) as the value, in one block per 16 heads (no second block for the other value dims: the
    warps of a pair share each staged sub-tile): against the reference and the formula, NaN in
    every slot it must not read (``check=False`` reads no refused page here: every page is the
    sequence's own)."""
    if not LATENT_TILE:
        pytest.skip("the CUDA harness is not built here")
    batch = MLABatch.random(
        seq_lens=boundary_lens(page) + [40],
        num_heads=heads,
        lora=512,
        rope=64,
        page_size=page,
        dtype=dtype,
        seed=page + heads,
    )
    args = kvattn.layout.validate_mla_decode(*batch.inputs(), kv_lora_rank=512, num_splits=splits)
    assert backends.explain(args, "mla_decode")["cuda_sim"] is None
    plan = {}
    out = torch.empty(*batch.q.shape[:2], 512, dtype=dtype)
    lse = torch.empty(batch.q.shape[:2], dtype=torch.float32)
    report = backends.load("cuda_sim")[0].mla_decode(args, check=check, out=out, lse=lse, plan=plan)
    assert plan["num_splits"] == splits and plan["d_split"] == 1 and plan["vec"] == 1
    want_out, want_lse = mla_formula(batch, check=check)
    assert torch.isfinite(out).all(), "a refused or masked slot was read"
    torch.testing.assert_close(out.double(), want_out, **tolerance(dtype))
    torch.testing.assert_close(lse.double(), want_lse, **LSE_TOLERANCE)
    if check:
        assert_reports_equal(report, batch.reference(return_lse=True)[2])


def test_cuda_latent_tile_claims_only_flashmla_rows():
    """Other latent widths, float32 and rows that are not 16-byte aligned go to the triton backend,
    each refusal saying why; the twin, 512 + 64 fp16, is claimed."""
    if not LATENT_TILE:
        pytest.skip("the CUDA harness is not built here")

    def reason(**kw):
        lora, rope = kw.pop("lora", 512), kw.pop("rope", 64)
        batch = MLABatch.random(seq_lens=[5], lora=lora, rope=rope, page_size=4, **kw)
        args = kvattn.layout.validate_mla_decode(*batch.inputs(), kv_lora_rank=lora)
        return backends.explain(args, "mla_decode")["cuda_sim"], batch

    assert reason()[0] is None
    assert "FlashMLA's 512 + 64" in reason(lora=32, rope=16)[0]
    assert "float32" in reason(dtype=torch.float32)[0]
    _, batch = reason()
    wide = torch.full((*batch.kv_cache.shape[:3], 580), float("nan"), dtype=batch.kv_cache.dtype)
    wide[..., 4:] = batch.kv_cache
    batch.kv_cache = wide[..., 4:]
    args = kvattn.layout.validate_mla_decode(*batch.inputs(), kv_lora_rank=512)
    assert "16-byte aligned" in backends.explain(args, "mla_decode")["cuda_sim"]


def test_incident_replay_unchecked_shows_the_sentinel(backend, page):
    """The twin: without the check the same call returns the sentinel, so the scenario is real."""
    batch, _ = incident(page=page)
    out, report = batch.decode(backend, check=False)
    assert report is None and (out.float() > 0.9 * SENTINEL).all()


def test_incident_replay_truthful_length_is_clean(backend, page):
    """The twin of the over-long read: B decoded over the one token it received is clean."""
    batch, row = incident(page=page)
    batch.seq_lens[0] = 1
    out, _, report = assert_matches(batch, backend)
    assert not report.any() and report.pages_checked.tolist() == [1]
    torch.testing.assert_close(
        out[0].float(), row[:32].float().expand(4, -1), **tolerance(batch.q.dtype)
    )


def lens3(page=4):
    """Three sequences of 2, 3 and 3 pages, the first and last ending one slot into a page."""
    return [page + 1, 3 * page, 2 * page + 1]


def small(page, **kwargs):
    return MLABatch.random(seq_lens=lens3(page), page_size=page, **kwargs)


def test_clean_batch_has_no_violation(backend, page):
    _, _, report = assert_matches(small(page), backend)
    assert not report.any() and report.pages_checked.tolist() == [2, 3, 3]


@pytest.mark.parametrize("tag", ["free", "reserved"])
def test_free_and_reserved_pages_are_refused(backend, page, tag):
    batch = small(page)
    batch.page_tags[int(batch.block_table[1, 1])] = (
        kvattn.FREE_TAG if tag == "free" else kvattn.reserved_tag(2)
    )
    _, _, report = assert_matches(batch, backend)
    reason = Violation.FREE if tag == "free" else Violation.RESERVED
    assert report.violations.tolist() == [0, 1, 0]
    assert report.page_reasons[1].tolist() == [0, int(reason), 0]


@pytest.mark.parametrize("bad", ["past_pool", "negative", "int32_min"])
def test_out_of_range_and_negative_indices_are_refused(backend, page, bad):
    batch = small(page)
    num_pages = batch.kv_cache.shape[0]
    batch.block_table[2, 1] = {"past_pool": num_pages, "negative": -1, "int32_min": -(2**31)}[bad]
    _, _, report = assert_matches(batch, backend)
    assert report.violations.tolist() == [0, 0, 1]
    assert report.page_reasons[2].tolist() == [0, int(Violation.OUT_OF_RANGE), 0]


def test_padding_page_past_seq_len_is_ignored(backend, page):
    """Engines pad table rows with page 0 (someone else's); unread entries are not violations."""
    batch = small(page, extra_pages=1)
    batch.block_table[0, 2:] = 0
    batch.block_table[2, 3] = 0
    _, _, report = assert_matches(batch, backend)
    assert not report.any()


def test_padding_page_that_is_read_is_refused(backend, page):
    """The twin: a length that reaches the padding entry reads it, and the tag refuses it."""
    batch = small(page, extra_pages=1)
    batch.block_table[0, 2] = int(batch.block_table[1, 0])
    batch.seq_lens[0] = 2 * page + 1
    _, _, report = assert_matches(batch, backend)
    assert report.page_reasons[0].tolist()[:3] == [
        0,
        int(Violation.UNWRITTEN),
        int(Violation.OWNER_MISMATCH),
    ]


def test_duplicated_index_of_another_sequence_is_refused(backend, page):
    batch = small(page)
    batch.block_table[2, 0] = batch.block_table[1, 0]
    _, _, report = assert_matches(batch, backend)
    assert report.violations.tolist() == [0, 0, 1]
    assert report.reasons.tolist() == [0, 0, int(Violation.OWNER_MISMATCH)]


def test_swapped_rows_are_refused(backend, page):
    batch = small(page)
    batch.block_table[[1, 2]] = batch.block_table[[2, 1]].clone()
    out, lse, report = assert_matches(batch, backend)
    assert report.violations.tolist() == [0, 3, 3]
    assert report.reasons.tolist() == [0] + [int(Violation.OWNER_MISMATCH)] * 2
    assert torch.equal(out[1:], torch.zeros_like(out[1:])) and torch.isneginf(lse[1:]).all()


def stale_tails(batch):
    """Sentinel rows in every slot past each written page's valid_len: a previous owner's data."""
    for p in range(batch.kv_cache.shape[0]):
        tag = int(batch.page_tags[p])
        if kvattn.tag_state(tag) == STATE_WRITTEN:
            batch.kv_cache[p, kvattn.tag_valid_len(tag) :] = SENTINEL
    return batch


@pytest.mark.parametrize("pages,slots", [(1, -1), (1, 0), (1, 1), (2, 0), (2, 1)])
def test_partial_pages_at_page_boundaries_are_clean(backend, page, pages, slots):
    batch = stale_tails(
        MLABatch.random(seq_lens=[pages * page + slots, 1, 3 * page], page_size=page)
    )
    out, _, report = assert_matches(batch, backend)
    assert not report.any() and out.abs().max() < 10


@pytest.mark.parametrize(
    "written,read", [((1, -1), (1, 0)), ((0, 1), (1, 0)), ((1, 1), (2, 0)), ((2, -1), (2, 1))]
)
def test_reading_past_valid_len_is_refused(backend, page, written, read):
    """The twin: the table claims more tokens than were written; the stale tail stays out.
    ``written`` and ``read`` are (pages, slots) lengths: pages * page_size + slots."""
    written, read = (pages * page + slots for pages, slots in (written, read))
    batch = MLABatch.random(seq_lens=[written, 1, 3 * page], page_size=page, extra_pages=1)
    # Sequence 0's spare page: written for it with nothing in it yet (valid_len 0).
    spare = int(batch.block_table[0, -(-written // page)])
    batch.page_tags[spare] = kvattn.written_tag(1, 0)
    batch = stale_tails(batch)
    batch.seq_lens[0] = read
    out, _, report = assert_matches(batch, backend)
    assert report.violations.tolist()[0] >= 1
    assert report.reasons.tolist()[0] == int(Violation.UNWRITTEN)
    assert out.abs().max() < 10


def test_prefix_sharing_with_per_entry_expected_passes(backend, page):
    _, _, report = assert_matches(shared_prefix(page), backend)
    assert not report.any() and report.pages_checked.tolist() == [3, 3, 1]


def test_prefix_sharing_with_wrong_expected_fails(backend, page):
    """The twin: the shared pages expected under the child's own owner, or an unrelated one, are
    refused; per sequence, only the child's shared pages fail."""
    batch = shared_prefix(page)
    batch.expected[1, :2] = 2
    batch.expected[0, :2] = 3
    _, _, report = assert_matches(batch, backend)
    assert report.violations.tolist() == [2, 2, 0]
    assert report.page_reasons[:2, :2].tolist() == [[int(Violation.OWNER_MISMATCH)] * 2] * 2
    batch.expected = torch.tensor([1, 2, 3], dtype=torch.int64, device=DEVICE)
    _, _, report = assert_matches(batch, backend)
    assert report.violations.tolist() == [0, 2, 0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_all_valid_checked_equals_unchecked_bitwise(backend, page, dtype):
    batch = shared_prefix(page, dtype)
    checked, lse_c, report = batch.decode(backend, return_lse=True)
    unchecked, lse_u, _ = batch.decode(backend, check=False, return_lse=True)
    assert not report.any()
    assert torch.equal(checked, unchecked) and torch.equal(lse_c, lse_u)


def test_one_refused_page_makes_checked_differ_from_unchecked(backend, page):
    """The twin: one refused page (the parent's, read by the third sequence) moves the checked
    output away from the unchecked one, which reads that page's finite data."""
    batch = shared_prefix(page, torch.float32)
    batch.block_table[2, 0] = 3
    checked, report = batch.decode(backend)
    unchecked, _ = batch.decode(backend, check=False)
    assert report.violations.tolist() == [0, 0, 1]
    assert torch.equal(checked[:2], unchecked[:2])
    assert torch.equal(checked[2], torch.zeros_like(checked[2]))
    assert not torch.equal(checked[2], unchecked[2])


def test_raise_names_sequences_pages_and_reasons(backend, page):
    batch = small(page)
    batch.page_tags[int(batch.block_table[2, 1])] = kvattn.reserved_tag(3)
    batch.block_table[0, 0] = -1
    out_buf = torch.full((3, 4, 32), float("nan"), dtype=batch.q.dtype, device=DEVICE)
    with pytest.raises(KVOwnershipError) as info:
        batch.decode(backend, on_violation="raise", out=out_buf)
    assert info.value.refusals == {0: [(0, Violation.OUT_OF_RANGE)], 2: [(1, Violation.RESERVED)]}
    assert "sequence 1" not in str(info.value)
    torch.testing.assert_close(out_buf.double(), batch.reference()[0], **tolerance(batch.q.dtype))


def test_raise_is_silent_when_clean(backend, page):
    out, report = small(page).decode(backend, on_violation="raise")
    assert torch.isfinite(out).all() and not report.any()


def test_seq_len_past_the_table_reads_nothing_past_it(backend, page):
    """Unvalidated, a length beyond the table counts one OUT_OF_RANGE and reads the table only."""
    batch = small(page)
    batch.seq_lens[1] = 100 * page
    out, report = batch.decode(backend, validate=False, num_splits=2)
    assert report.beyond_table.tolist() == [0, 1, 0]
    assert report.violations.tolist() == [0, 1, 0]
    assert report.reasons.tolist() == [0, int(Violation.OUT_OF_RANGE), 0]
    assert torch.isfinite(out).all()


def test_seq_len_inside_the_table_is_not_beyond_it(backend, page):
    """The twin: a length filling the table exactly is clean."""
    batch = small(page)
    batch.seq_lens[1] = 3 * page
    _, report = batch.decode(backend, validate=False, num_splits=2)
    assert report.beyond_table.tolist() == [0, 0, 0] and not report.any()


# --- Validation, registry, custom op --------------------------------------------------------------


def _mutations():
    def replace(**changes):
        return lambda b: dataclasses.replace(b, **changes)

    def call(b, **kwargs):
        return kvattn.paged_mla_decode(*b.inputs(), **{"kv_lora_rank": b.kv_lora_rank, **kwargs})

    return {
        "q_2d": (lambda b: call(dataclasses.replace(b, q=b.q[0])), ValueError, ("q:", "3-D")),
        "two_latent_heads": (
            lambda b: call(replace(kv_cache=b.kv_cache.expand(-1, -1, 2, -1).contiguous())(b)),
            ValueError,
            ("kv_cache:", "one latent head"),
        ),
        "dim_mismatch": (
            lambda b: call(replace(q=b.q[..., :40].contiguous())(b)),
            ValueError,
            ("kv_cache:", "q's dim 2"),
        ),
        "dtype_mismatch": (
            lambda b: call(replace(q=b.q.float())(b)),
            TypeError,
            ("kv_cache:", "float32"),
        ),
        "lora_bool": (lambda b: call(b, kv_lora_rank=True), TypeError, ("kv_lora_rank:",)),
        "lora_too_big": (lambda b: call(b, kv_lora_rank=49), ValueError, ("kv_lora_rank:", "49")),
        "lora_zero": (lambda b: call(b, kv_lora_rank=0), ValueError, ("kv_lora_rank:",)),
        "out_shape": (
            lambda b: call(b, out=torch.empty_like(b.q)),
            ValueError,
            ("out:", "(3, 4, 32)"),
        ),
        "out_overlaps_q": (lambda b: call(b, out=b.q[..., :32]), ValueError, ("out:",)),
        "splits_zero": (lambda b: call(b, num_splits=0), ValueError, ("num_splits:",)),
        "splits_float": (lambda b: call(b, num_splits=2.0), ValueError, ("num_splits:",)),
        "scale_nan": (lambda b: call(b, scale=float("nan")), ValueError, ("scale:",)),
        "table_int64": (
            lambda b: call(replace(block_table=b.block_table.long())(b)),
            TypeError,
            ("block_table:",),
        ),
        "expected_shape": (
            lambda b: call(replace(expected=b.expected[:2])(b)),
            ValueError,
            ("expected:",),
        ),
        "seq_len_past_table": (
            lambda b: call(replace(seq_lens=b.seq_lens + 100)(b), validate=True),
            ValueError,
            ("seq_lens:",),
        ),
        "owner_zero": (
            lambda b: call(replace(expected=b.expected * 0)(b), validate=True),
            ValueError,
            ("expected:",),
        ),
        "raise_unchecked": (
            lambda b: call(b, check=False, on_violation="raise"),
            ValueError,
            ("on_violation:",),
        ),
    }


@pytest.mark.parametrize("name", list(_mutations()))
def test_malformed_inputs_raise_naming_the_argument(name):
    mutate, error, words = _mutations()[name]
    with raises(error, *words):
        mutate(MLABatch.random(seq_lens=lens3()))


def test_well_formed_inputs_pass_validation():
    """The twin of the table above: the unmutated batch runs on every backend of the op."""
    batch = MLABatch.random(seq_lens=lens3())
    for backend in BACKENDS:
        out, report = batch.decode(backend)
        assert out.shape == (3, 4, 32) and not report.any()


def test_registry_reasons_and_auto_choice():
    batch = MLABatch.random(seq_lens=lens3())
    args = kvattn.layout.validate_mla_decode(*batch.inputs(), kv_lora_rank=32)
    reasons = backends.explain(args, "mla_decode")
    assert reasons["reference"] is None and reasons["triton"] is None
    assert reasons["cuda"] is not None and reasons["torch"] == "no mla_decode kernel"
    assert backends.auto_choice(args, "mla_decode")[0] == "triton"
    wide = MLABatch.random(seq_lens=[3], lora=520, rope=8, num_heads=1)
    wide_args = kvattn.layout.validate_mla_decode(*wide.inputs(), kv_lora_rank=520)
    assert backends.explain(wide_args, "mla_decode")["triton"] == "kv_lora_rank 520 > 512"
    assert backends.auto_choice(wide_args, "mla_decode")[0] == "reference"
    with raises(ValueError, "backend 'triton' cannot run", "kv_lora_rank 520 > 512"):
        wide.decode("triton")
    with raises(ValueError, "backend 'cuda' cannot run"):
        batch.decode("cuda")


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck_paged_mla_decode(backend):
    batch = MLABatch.random(seq_lens=[5, 2], dtype=torch.float32)
    torch.library.opcheck(
        torch.ops.kvattn.paged_mla_decode.default,
        batch.inputs() + (32, None, True, backend, True, None, None),
    )


@pytest.mark.parametrize("corrupt", [False, True])
def test_mla_op_equals_direct_call(corrupt):
    batch = MLABatch.random(seq_lens=[5, 9, 2], dtype=torch.float32)
    if corrupt:  # sequence 0 reads sequence 1's first page: OWNER_MISMATCH
        batch.block_table[0, 0] = batch.block_table[1, 0]
    out, lse, report = ops.paged_mla_decode(
        *batch.inputs(), kv_lora_rank=32, backend="triton", return_lse=True, num_splits=2
    )
    ref_out, ref_lse, ref_report = batch.decode("triton", return_lse=True, num_splits=2)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    assert_reports_equal(report, ref_report)
    assert bool(report.violations[0]) == corrupt
    if corrupt:
        with pytest.raises(KVOwnershipError, match="OWNER_MISMATCH"):
            ops.paged_mla_decode(
                *batch.inputs(), kv_lora_rank=32, backend="reference", on_violation="raise"
            )
