"""MLA paged extend (:func:`kvattn.paged_mla_extend`): several query rows per sequence on the latent
cache (chunked prefill, prefill over a cached prefix, speculative verify). The Triton kernel against
the reference, both against MLA attention written from its definition (:mod:`kvattn_testing.mla`'s
``readable_latent`` and ``latent_attention``) row by row with each row's causal position; ragged
batches whose tiles span several query tokens, the causal diagonal, non-causal rows, the peers'
geometry; the report against decode's; the ownership scenarios with several rows; fail-closed
handling of malformed lengths and offsets; validation, registry and the custom op.

The scenarios of docs/ownership.md section 6 with one row per sequence run in :mod:`test_mla`
through this kernel too. Pools are :class:`kvattn_testing.mla.MLABatch`'s: NaN in every slot a
reader must not use.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kvattn
from kvattn import KVOwnershipError, Violation, backends, ops
from kvattn_testing.mla import MLABatch, incident, latent_attention, readable_latent, shared_prefix
from kvattn_testing.util import DEVICE, LSE_TOLERANCE, assert_reports_equal, raises, tolerance

BACKENDS = ["reference", "triton"]


@dataclasses.dataclass
class ExtendBatch:
    """An MLA extend over an :class:`MLABatch`'s pools: ``q`` ``[total_q, H, lora + rope]``,
    sequence ``b`` owning rows ``cu[b] .. cu[b + 1]``."""

    pools: MLABatch
    q: torch.Tensor
    cu: torch.Tensor
    causal: bool = True

    @classmethod
    def random(cls, *, seq_lens, q_lens, causal=True, seed=0, **kwargs) -> ExtendBatch:
        pools = MLABatch.random(seq_lens=seq_lens, seed=seed, **kwargs)
        return cls.over(pools, q_lens, causal, seed)

    @classmethod
    def over(cls, pools: MLABatch, q_lens, causal=True, seed=0) -> ExtendBatch:
        """New query rows (``q_lens[b]`` for sequence ``b``) over existing pools."""
        g = torch.Generator().manual_seed(seed + 1)
        heads, dim = pools.q.shape[1:]
        q = torch.randn(sum(q_lens), heads, dim, generator=g).to(pools.q.dtype).to(DEVICE)
        cu = torch.tensor(
            [0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE
        )
        return cls(pools, q, cu, causal)

    def inputs(self):
        p = self.pools
        return (self.q, p.kv_cache, self.cu, p.block_table, p.seq_lens, p.page_tags, p.expected)

    def run(self, backend, **kwargs):
        kwargs.setdefault("causal", self.causal)
        return kvattn.paged_mla_extend(
            *self.inputs(), kv_lora_rank=self.pools.kv_lora_rank, backend=backend, **kwargs
        )

    def reference(self, **kwargs):
        kwargs.setdefault("causal", self.causal)
        return kvattn.reference.paged_mla_extend(
            *self.inputs(),
            kv_lora_rank=self.pools.kv_lora_rank,
            compute_dtype=torch.float64,
            **kwargs,
        )


def extend_formula(batch: ExtendBatch, *, scale=None, check=True, causal=None):
    """MLA extend from its definition, in float64: row ``j`` of sequence ``b`` (``q_len`` rows,
    ``seq_len`` tokens) sits at position ``seq_len - q_len + j`` and reads the readable latent rows
    up to it (all of them without causality); a causal sequence with more rows than tokens reads
    nothing."""
    causal = batch.causal if causal is None else causal
    q, lora = batch.q.cpu(), batch.pools.kv_lora_rank
    scale = q.shape[2] ** -0.5 if scale is None else scale
    cu, lens = batch.cu.tolist(), batch.pools.seq_lens.tolist()
    out = torch.zeros(q.shape[0], q.shape[1], lora, dtype=torch.float64)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64)
    for b in range(len(lens)):
        q_len = cu[b + 1] - cu[b]
        if causal and q_len > lens[b]:
            continue
        rows = readable_latent(batch.pools, b, check)
        for j in range(q_len):
            pos = lens[b] - q_len + j
            keys = [row for t, row in rows if not causal or t <= pos]
            for h in range(q.shape[1]):
                out[cu[b] + j, h], lse[cu[b] + j, h] = latent_attention(
                    q[cu[b] + j, h], keys, lora, scale
                )
    return out, lse


def assert_matches(batch: ExtendBatch, backend, *, check=True, **kwargs):
    """``backend``'s output, lse and report against the reference (float64) and the formula, and
    the report against MLA decode's for the same lengths; returns them."""
    out, lse, report = batch.run(backend, check=check, return_lse=True, **kwargs)
    ref_out, ref_lse, ref_report = batch.reference(
        check=check, return_lse=True, scale=kwargs.get("scale")
    )
    want_out, want_lse = extend_formula(batch, check=check, scale=kwargs.get("scale"))
    assert out.shape == (*batch.q.shape[:2], batch.pools.kv_lora_rank)
    assert out.dtype == batch.q.dtype
    assert torch.isfinite(out).all(), "a refused or masked slot was read"
    torch.testing.assert_close(ref_out, want_out.to(DEVICE), atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(ref_lse, want_lse.to(DEVICE), atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(out.double(), want_out.to(DEVICE), **tolerance(batch.q.dtype))
    torch.testing.assert_close(lse.double(), want_lse.to(DEVICE), **LSE_TOLERANCE)
    if check:
        assert_reports_equal(report, ref_report)
        # The report is decode's for the same lengths: each page once per sequence.
        assert_reports_equal(report, batch.pools.reference()[1])
    else:
        assert report is None
    return out, lse, report


# --- Against the reference and the formula --------------------------------------------------------

# (dtype, lora, rope, page, heads, causal): every dtype; pages resolved per token (1, 5) and by
# tile (16, 32); heads below, at and above a tile's rows (the Triton tile holds 32 rows: 4 heads
# take 8 tokens a tile, 3 take 10 with two rows idle, 40 heads two chunks of 32 and 8); no RoPE
# part; causal and not.
CASES = [
    (torch.float16, 32, 16, 4, 4, True),
    (torch.bfloat16, 32, 16, 5, 3, True),
    (torch.float32, 32, 16, 1, 2, True),
    (torch.float16, 64, 0, 16, 40, True),
    (torch.float16, 32, 16, 4, 4, False),
    (torch.float32, 48, 8, 32, 1, False),
]
# Sequences: a whole prompt (q_len == seq_len) across several tiles, a chunk over a cached prefix
# ending one slot into a page, one decode row, a sequence with no new rows, a chunk on a page edge.
LENS, Q_LENS = [21, 13, 9, 6, 16], [21, 9, 1, 0, 4]


@pytest.mark.parametrize(
    "dtype,lora,rope,page,heads,causal",
    CASES,
    ids=[
        f"{str(c[0])[6:]}-{c[1]}+{c[2]}-p{c[3]}-h{c[4]}-{'causal' if c[5] else 'full'}"
        for c in CASES
    ],
)
@pytest.mark.parametrize("check", [True, False], ids=["checked", "unchecked"])
def test_triton_matches_reference_and_formula(dtype, lora, rope, page, heads, causal, check):
    batch = ExtendBatch.random(
        seq_lens=LENS,
        q_lens=Q_LENS,
        causal=causal,
        num_heads=heads,
        lora=lora,
        rope=rope,
        page_size=page,
        dtype=dtype,
        seed=lora + page,
    )
    _, _, report = assert_matches(batch, "triton", check=check)
    if check:
        assert not report.any() and report.pages_checked.tolist() == [-(-n // page) for n in LENS]


@pytest.mark.parametrize("heads,q_lens", [(16, [37, 5]), (128, [3, 2])], ids=["h16", "h128"])
def test_peer_grid_512_plus_64_page_64(heads, q_lens):
    """FlashInfer's and SGLang's MLA geometry (latent 512 + 64, bf16, pages of 64, 16 or 128 query
    heads): a chunk crossing a page boundary over a cached prefix, a short verify chunk."""
    batch = ExtendBatch.random(
        seq_lens=[129, 64],
        q_lens=q_lens,
        num_heads=heads,
        lora=512,
        rope=64,
        page_size=64,
        dtype=torch.bfloat16,
        seed=heads,
    )
    out, lse, report = batch.run("triton", return_lse=True)
    ref_out, ref_lse, ref_report = batch.reference(return_lse=True)
    torch.testing.assert_close(out.double(), ref_out, **tolerance(torch.bfloat16))
    torch.testing.assert_close(lse.double(), ref_lse, **LSE_TOLERANCE)
    assert_reports_equal(report, ref_report)
    assert not report.any() and report.pages_checked.tolist() == [3, 1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_scale_is_applied(backend):
    assert_matches(
        ExtendBatch.random(seq_lens=[9, 3], q_lens=[4, 3], page_size=4), backend, scale=0.37
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_more_rows_than_keys_without_causality(backend):
    """Non-causal rows read every key, so a sequence may have more rows than tokens (FlashInfer
    allows it); causal, the same sequence is refused by validation."""
    batch = ExtendBatch.random(seq_lens=[3, 6], q_lens=[7, 2], causal=False, page_size=4)
    assert_matches(batch, backend)
    with raises(ValueError, "seq_lens:", "seq_lens[0] = 3 with 7 query tokens"):
        batch.run(backend, causal=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_row_per_sequence_equals_mla_decode(backend):
    """A causal extend of each sequence's last token is the MLA decode of it."""
    pools = MLABatch.random(seq_lens=[9, 17, 4], page_size=4, num_heads=3)
    batch = ExtendBatch(pools, pools.q, torch.arange(4, dtype=torch.int32, device=DEVICE))
    out, lse, report = batch.run(backend, return_lse=True)
    dec_out, dec_lse, dec_report = pools.decode(backend, return_lse=True)
    torch.testing.assert_close(out, dec_out, **tolerance(pools.q.dtype))
    torch.testing.assert_close(lse, dec_lse, **LSE_TOLERANCE)
    assert_reports_equal(report, dec_report)


def test_bf16_rows_follow_their_peaked_key():
    """Each query row aligned with a different latent row at or before its position (rows 0..5
    sit at 64..69; row 1 picks its own token): the rows' outputs follow those rows' value parts
    (catches rows mixed up across tokens or heads in a tile)."""
    batch = ExtendBatch.random(
        seq_lens=[70],
        q_lens=[6],
        num_heads=16,
        lora=512,
        rope=64,
        page_size=64,
        dtype=torch.bfloat16,
        seed=4,
    )
    kv, table = batch.pools.kv_cache, batch.pools.block_table
    picks = [(0, 10), (1, 1), (0, 63), (1, 3), (0, 0), (1, 5)]  # (logical page, slot) per row
    for j, (i, s) in enumerate(picks):
        batch.q[j] = (kv[int(table[0, i]), s, 0] * 0.5).to(torch.bfloat16)
    out, _ = batch.run("triton")
    ref_out, _ = batch.reference()
    torch.testing.assert_close(out.double(), ref_out, **tolerance(torch.bfloat16))
    for j, (i, s) in enumerate(picks):
        value = kv[int(table[0, i]), s, 0, :512].float()[None]
        assert (torch.nn.functional.cosine_similarity(out[j].float(), value) > 0.9).all()


def test_strided_pool_view_out_buffer_and_per_entry_expected():
    batch = ExtendBatch.random(seq_lens=[6, 11], q_lens=[2, 5], page_size=4, num_heads=3)
    batch.pools.as_layer_view()
    out_buf = torch.full((7, 3, 32), float("nan"), dtype=batch.q.dtype, device=DEVICE)
    for backend in BACKENDS:
        out, report = batch.run(backend, out=out_buf)
        assert out is out_buf and not report.any()
        torch.testing.assert_close(
            out.double(), extend_formula(batch)[0].to(DEVICE), **tolerance(batch.q.dtype)
        )
        out_buf.fill_(float("nan"))


# --- Ownership with several rows per sequence ----------------------------------------------------


@pytest.fixture(params=[4, 32], ids=lambda p: f"p{p}")
def page(request):
    return request.param


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def incident_chunk(page, rows=3):
    """:func:`kvattn_testing.mla.incident` read by a chunk of ``rows`` new rows at the end of B's
    claimed length: every row reads refused pages only, plus B's one token."""
    pools, row = incident(page=page)
    batch = ExtendBatch.over(pools, [rows])
    # The incident's query, for which the previous tenant's rows dominate.
    batch.q = pools.q.expand(rows, -1, -1).contiguous()
    return batch, row


def test_incident_replay_with_a_chunk_refuses_every_row(backend, page):
    batch, row = incident_chunk(page)
    out, _, report = assert_matches(batch, backend)
    assert report.violations.tolist() == [4]
    assert (
        report.page_reasons[0].tolist()
        == [int(Violation.UNWRITTEN)] + [int(Violation.RESERVED)] * 3
    )
    torch.testing.assert_close(
        out.float(), row[:32].float().expand(3, 4, -1), **tolerance(batch.q.dtype)
    )


def test_incident_replay_with_a_chunk_unchecked_shows_the_sentinel(backend, page):
    """The twin: unchecked, every row attends over the previous tenant's rows."""
    batch, _ = incident_chunk(page)
    out, report = batch.run(backend, check=False)
    assert report is None and (out.float() > 90).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_refused_prefix_page_leaves_rows_before_it_unread(backend):
    """A chunk of 8 rows over 16 tokens in pages of 4, the third page refused: every row reads
    past it (pages before and after count), the report names it once; clean twin below."""
    batch = ExtendBatch.random(seq_lens=[16], q_lens=[8], page_size=4, num_heads=4, seed=3)
    batch.pools.page_tags[int(batch.pools.block_table[0, 2])] = kvattn.FREE_TAG
    _, _, report = assert_matches(batch, backend)
    assert report.violations.tolist() == [1] and report.pages_checked.tolist() == [4]
    assert report.page_reasons[0].tolist() == [0, 0, int(Violation.FREE), 0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_clean_prefix_is_clean(backend):
    batch = ExtendBatch.random(seq_lens=[16], q_lens=[8], page_size=4, num_heads=4, seed=3)
    _, lse, report = assert_matches(batch, backend)
    assert not report.any() and torch.isfinite(lse).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_refused_and_empty_sequences_give_zero_and_minus_inf(backend):
    batch = ExtendBatch.random(seq_lens=[9, 12, 5], q_lens=[3, 4, 0], page_size=4)
    for i in range(3):
        batch.pools.page_tags[int(batch.pools.block_table[1, i])] = kvattn.reserved_tag(2)
    out, lse, report = assert_matches(batch, backend)
    assert torch.equal(out[3:7], torch.zeros_like(out[3:7])) and torch.isneginf(lse[3:7]).all()
    assert torch.isfinite(lse[:3]).all()
    assert report.violations.tolist() == [0, 3, 0] and report.pages_checked.tolist() == [3, 3, 2]


def test_prefix_sharing_with_per_entry_expected(backend, page):
    """The child extends over the parent's shared pages (per-entry expected); the twin: expected
    under the child's own owner, the shared pages are refused for the child only."""
    pools = shared_prefix(page)
    batch = ExtendBatch.over(pools, [2, 3, 1])
    _, _, report = assert_matches(batch, backend)
    assert not report.any() and report.pages_checked.tolist() == [3, 3, 1]
    pools.expected[1, :2] = 2
    _, _, report = assert_matches(batch, backend)
    assert report.violations.tolist() == [0, 2, 0]
    assert report.page_reasons[1, :2].tolist() == [int(Violation.OWNER_MISMATCH)] * 2


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_all_valid_checked_equals_unchecked_bitwise(backend, page, dtype):
    batch = ExtendBatch.over(shared_prefix(page, dtype), [2, 3, 1])
    checked, lse_c, report = batch.run(backend, return_lse=True)
    unchecked, lse_u, _ = batch.run(backend, check=False, return_lse=True)
    assert not report.any()
    assert torch.equal(checked, unchecked) and torch.equal(lse_c, lse_u)


def test_one_refused_page_makes_checked_differ_from_unchecked(backend, page):
    """The twin: the third sequence reading the parent's page is refused; the others are exact."""
    batch = ExtendBatch.over(shared_prefix(page, torch.float32), [2, 3, 1])
    batch.pools.block_table[2, 0] = 3
    checked, report = batch.run(backend)
    unchecked, _ = batch.run(backend, check=False)
    assert report.violations.tolist() == [0, 0, 1]
    assert torch.equal(checked[:5], unchecked[:5])
    assert torch.equal(checked[5], torch.zeros_like(checked[5]))
    assert not torch.equal(checked[5], unchecked[5])


def test_raise_names_sequences_pages_and_reasons(backend):
    batch = ExtendBatch.random(seq_lens=[5, 12, 9], q_lens=[2, 3, 4], page_size=4)
    batch.pools.page_tags[int(batch.pools.block_table[2, 1])] = kvattn.reserved_tag(3)
    batch.pools.block_table[0, 0] = -1
    with pytest.raises(KVOwnershipError) as info:
        batch.run(backend, on_violation="raise")
    assert info.value.refusals == {0: [(0, Violation.OUT_OF_RANGE)], 2: [(1, Violation.RESERVED)]}
    out, report = ExtendBatch.random(seq_lens=[5, 12], q_lens=[2, 3], page_size=4).run(
        backend, on_violation="raise"
    )
    assert torch.isfinite(out).all() and not report.any()


# --- Malformed lengths and offsets, unvalidated: fail closed -------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_sequence_with_more_rows_than_tokens_reads_nothing(backend):
    """Unvalidated, a causal sequence with 8 rows over 6 tokens gets 0 and -inf (its last rows
    would otherwise find readable keys in its first page); its pages are still checked and
    reported (here its second page refused), the other sequence is exact."""
    batch = ExtendBatch.random(seq_lens=[6, 9], q_lens=[8, 2], page_size=4)
    batch.pools.page_tags[int(batch.pools.block_table[0, 1])] = kvattn.FREE_TAG
    out, lse, report = batch.run(backend, validate=False, return_lse=True)
    assert torch.equal(out[:8], torch.zeros_like(out[:8])) and torch.isneginf(lse[:8]).all()
    torch.testing.assert_close(
        out[8:].double(), extend_formula(batch)[0][8:].to(DEVICE), **tolerance(batch.q.dtype)
    )
    assert report.violations.tolist() == [1, 0] and report.pages_checked.tolist() == [2, 3]


@pytest.mark.parametrize("backend", BACKENDS)
def test_offsets_past_the_rows_are_clamped(backend):
    """Unvalidated ``cu_seqlens_q`` ending past ``total_q``: clamped, so sequence 1 owns rows 3..5
    only; no row outside ``q`` is touched, and kvattn's own output is fully written."""
    batch = ExtendBatch.random(seq_lens=[6, 9], q_lens=[3, 3], page_size=4)
    batch.cu[2] = 40
    out, lse, report = batch.run(backend, validate=False, return_lse=True)
    batch.cu[2] = 6
    want, _ = extend_formula(batch)
    torch.testing.assert_close(out.double(), want.to(DEVICE), **tolerance(batch.q.dtype))
    assert torch.isfinite(lse).all() and not report.any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_no_sequence_covers_are_zero(backend):
    """Offsets starting at 2: rows 0 and 1 belong to no sequence; kvattn's output has 0 and -inf
    there, a caller's buffer is left as it was."""
    batch = ExtendBatch.random(seq_lens=[6, 9], q_lens=[3, 3], page_size=4)
    batch.cu[0] = 2
    out, lse, _ = batch.run(backend, validate=False, return_lse=True)
    assert torch.equal(out[:2], torch.zeros_like(out[:2])) and torch.isneginf(lse[:2]).all()
    assert torch.isfinite(lse[2:]).all()
    buf = torch.full((6, 4, 32), 7.0, dtype=batch.q.dtype, device=DEVICE)
    batch.run(backend, validate=False, out=buf)
    assert (buf[:2] == 7).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_seq_len_past_the_table_reads_nothing_past_it(backend):
    batch = ExtendBatch.random(seq_lens=[5, 12], q_lens=[2, 3], page_size=4)
    batch.pools.seq_lens[1] = 400
    out, report = batch.run(backend, validate=False, causal=False)
    assert report.beyond_table.tolist() == [0, 1] and report.violations.tolist() == [0, 1]
    assert report.reasons.tolist() == [0, int(Violation.OUT_OF_RANGE)]
    assert torch.isfinite(out).all()


# --- Validation, registry, custom op --------------------------------------------------------------


def _mutations():
    def call(b, **kwargs):
        return kvattn.paged_mla_extend(*b.inputs(), **{"kv_lora_rank": 32, **kwargs})

    def with_cu(cu):
        return lambda b: call(dataclasses.replace(b, cu=torch.tensor(cu, dtype=torch.int32)))

    return {
        "q_2d": (lambda b: call(dataclasses.replace(b, q=b.q[0])), ValueError, ("q:", "3-D")),
        "dim_mismatch": (
            lambda b: call(dataclasses.replace(b, q=b.q[..., :40].contiguous())),
            ValueError,
            ("kv_cache:", "q's dim 2"),
        ),
        "lora_too_big": (lambda b: call(b, kv_lora_rank=49), ValueError, ("kv_lora_rank:", "49")),
        "cu_int64": (
            lambda b: call(dataclasses.replace(b, cu=b.cu.long())),
            TypeError,
            ("cu_seqlens_q:",),
        ),
        "cu_shape": (with_cu([0, 2, 5]), ValueError, ("cu_seqlens_q:", "(4,)")),
        "cu_not_from_0": (with_cu([1, 2, 5, 7]), ValueError, ("cu_seqlens_q:", "= 0")),
        "cu_decreasing": (with_cu([0, 3, 2, 7]), ValueError, ("cu_seqlens_q:", "non-decreasing")),
        "cu_short_end": (with_cu([0, 2, 5, 6]), ValueError, ("cu_seqlens_q:", "total_q = 7")),
        "causal_int": (lambda b: call(b, causal=1), TypeError, ("causal:",)),
        "out_shape": (
            lambda b: call(b, out=torch.empty_like(b.q)),
            ValueError,
            ("out:", "(7, 4, 32)"),
        ),
        "out_overlaps_q": (lambda b: call(b, out=b.q[..., :32]), ValueError, ("out:",)),
        "scale_nan": (lambda b: call(b, scale=float("nan")), ValueError, ("scale:",)),
        "owner_zero": (
            lambda b: call(
                dataclasses.replace(
                    b, pools=dataclasses.replace(b.pools, expected=b.pools.expected * 0)
                )
            ),
            ValueError,
            ("expected:",),
        ),
        "raise_unchecked": (
            lambda b: call(b, check=False, on_violation="raise"),
            ValueError,
            ("on_violation:",),
        ),
    }


def small_batch():
    return ExtendBatch.random(seq_lens=[5, 12, 9], q_lens=[2, 3, 2], page_size=4)


@pytest.mark.parametrize("name", list(_mutations()))
def test_malformed_inputs_raise_naming_the_argument(name):
    mutate, error, words = _mutations()[name]
    with raises(error, *words):
        mutate(small_batch())


def test_well_formed_inputs_pass_validation():
    """The twin of the table above: the unmutated batch runs on every backend of the op."""
    for backend in BACKENDS:
        out, report = small_batch().run(backend)
        assert out.shape == (7, 4, 32) and not report.any()


def test_registry_reasons_and_auto_choice():
    args = kvattn.layout.validate_mla_extend(*small_batch().inputs(), kv_lora_rank=32)
    reasons = backends.explain(args, "mla_extend")
    assert reasons["reference"] is None and reasons["triton"] is None
    assert reasons["cuda"] is not None and reasons["torch"] == "no mla_extend kernel"
    assert backends.auto_choice(args, "mla_extend")[0] == "triton"
    wide = ExtendBatch.random(seq_lens=[3], q_lens=[2], lora=520, rope=8, num_heads=1)
    wide_args = kvattn.layout.validate_mla_extend(*wide.inputs(), kv_lora_rank=520)
    assert backends.explain(wide_args, "mla_extend")["triton"] == "kv_lora_rank 520 > 512"
    assert backends.auto_choice(wide_args, "mla_extend")[0] == "reference"
    with raises(ValueError, "backend 'cuda' cannot run"):
        small_batch().run("cuda")


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck_paged_mla_extend(backend):
    batch = ExtendBatch.random(seq_lens=[5, 2], q_lens=[3, 2], dtype=torch.float32)
    torch.library.opcheck(
        torch.ops.kvattn.paged_mla_extend.default,
        batch.inputs() + (32, None, True, True, backend, True, None),
    )


@pytest.mark.parametrize("corrupt", [False, True])
def test_op_equals_direct_call(corrupt):
    batch = ExtendBatch.random(seq_lens=[5, 9, 2], q_lens=[2, 4, 1], dtype=torch.float32)
    if corrupt:  # sequence 0 reads sequence 1's first page: OWNER_MISMATCH
        batch.pools.block_table[0, 0] = batch.pools.block_table[1, 0]
    out, lse, report = ops.paged_mla_extend(
        *batch.inputs(), kv_lora_rank=32, backend="triton", return_lse=True
    )
    ref_out, ref_lse, ref_report = batch.run("triton", return_lse=True)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    assert_reports_equal(report, ref_report)
    assert bool(report.violations[0]) == corrupt
    if corrupt:
        with pytest.raises(KVOwnershipError, match="OWNER_MISMATCH"):
            ops.paged_mla_extend(
                *batch.inputs(), kv_lora_rank=32, backend="reference", on_violation="raise"
            )
