"""The CUDA kernels of csrc/ against the reference.

On every machine they run through the CPU harness (backend ``cuda_sim``: the same kernel source
compiled by the host compiler against csrc/sim/simt.h); on a GPU the same tests also run the nvcc
build (backend ``cuda``). The harness itself is tested too: its 16-bit conversions round like the
hardware, and two deliberately broken builds of the kernel source (a missing barrier, an off-by-one
in the report's page loop) must disagree with the reference.
"""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
import re
import shutil

import pytest
import torch

import kvattn
from kvattn import Violation, backends, tags
from kvattn.backends import grids
from kvattn.backends.cuda import launch
from kvattn_testing.build import built_cuda_kernels, ptxas_log
from kvattn_testing.extend import Extend
from kvattn_testing.util import Batch, assert_reports_equal, backends_under_test, tolerance

ROOT = pathlib.Path(__file__).resolve().parents[2]
BACKENDS = ["cuda_sim"] + (["cuda"] if torch.cuda.is_available() else [])
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
# LSE: float32 logs of float32 sums of exponentials of float32 dot products (exp2/log2 in the
# kernel, natural log in the reference): differences are float32 roundings, ~1e-6 relative.
LSE_TOL = dict(atol=1e-4, rtol=1e-4)


def device_of(backend: str) -> torch.device:
    return torch.device("cpu" if backend == "cuda_sim" else "cuda")


def module_of(backend: str):
    module, reason = backends.load(backend)
    assert module is not None, reason
    return module


def make(
    backend: str,
    *,
    dtype=F16,
    page_size=16,
    head_dim=64,
    num_heads=4,
    num_kv_heads=2,
    seq_lens=(1, 37, 80),
    layout="NHD",
    seed=0,
    extra_pages=0,
) -> Batch:
    """A NaN-poisoned batch on the backend's device; ``layout="offset"`` moves the pools one element
    off 16-byte alignment, which forces the kernels' element-wise (non-vector) loads."""
    batch = Batch.random(
        batch=len(seq_lens),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        seq_lens=list(seq_lens),
        dtype=dtype,
        layout="HND" if layout == "HND" else "NHD",
        seed=seed,
        extra_pages=extra_pages,
        device=device_of(backend),
    )
    if layout == "offset":
        for name in ("k_cache", "v_cache"):
            pool = getattr(batch, name)
            flat = torch.full((pool.numel() + 1,), float("nan"), dtype=dtype, device=pool.device)
            moved = flat[1:].view(pool.shape)
            moved.copy_(pool)
            setattr(batch, name, moved)
    return batch


def run(backend: str, batch: Batch, *, check=True, num_splits=None, args=None, plan=None):
    """The backend's launcher with NaN-filled outputs (so an unwritten element shows)."""
    args = args if args is not None else batch.args()
    out = torch.full_like(batch.q, float("nan"))
    lse = torch.full(batch.q.shape[:2], float("nan"), device=batch.q.device)
    report = module_of(backend).decode(
        args, check=check, out=out, lse=lse, num_splits=num_splits, plan=plan
    )
    return out, lse, report


def assert_matches_reference(batch: Batch, out, lse, report, *, check=True, args=None):
    if args is None:
        ref_out, ref_lse, ref_report = batch.reference(
            check=check, return_lse=True, compute_dtype=torch.float64
        )
    else:
        ref_out, ref_lse, ref_report = kvattn.reference.paged_decode(
            args.q,
            args.k_cache,
            args.v_cache,
            args.block_table,
            args.seq_lens,
            args.page_tags,
            args.expected,
            check=check,
            return_lse=True,
            compute_dtype=torch.float64,
        )
    assert not torch.isnan(out).any(), "output holds NaN: a poisoned slot was read or not written"
    torch.testing.assert_close(out.double(), ref_out, **tolerance(batch.q.dtype))
    torch.testing.assert_close(lse.double(), ref_lse, **LSE_TOL)
    if check:
        assert_reports_equal(report, ref_report)
    else:
        assert report is None
    return ref_out


# (dtype, page_size, head_dim, num_heads, num_kv_heads, seq_lens, num_splits, layout)
MATRIX = [
    (F16, 16, 64, 8, 2, (1, 37, 80), None, "NHD"),
    (BF16, 1, 80, 4, 4, (5, 9, 1), 2, "NHD"),
    (F16, 256, 128, 4, 1, (300, 3), 2, "NHD"),  # sequence 1's second split is beyond its length
    (F16, 256, 256, 2, 1, (256, 17), 1, "HND"),
    (BF16, 16, 96, 6, 2, (0, 50, 33), 4, "HND"),  # an empty sequence: output 0, lse -inf
    (BF16, 16, 256, 16, 1, (40, 9), 3, "NHD"),  # group 16 x D 256: one tile of 16 rows
    (F16, 1, 128, 8, 2, (7, 1), 3, "offset"),  # rows off 16-byte alignment: element copies
    (BF16, 4, 80, 64, 2, (13, 6), 2, "NHD"),  # group 32: two head chunks of 16
    (F16, 16, 16, 2, 1, (3, 16), 1, "NHD"),
    (BF16, 2, 64, 4, 2, (9,), 5, "HND"),
    (F16, 8, 72, 20, 1, (70, 33), 2, "NHD"),  # group 20: chunks of 16 and 4; 72 = 4.5 k-steps
    (BF16, 5, 13, 4, 2, (11, 5, 26), 2, "NHD"),  # a page of 5 tokens, head dim 13: element copies
    (F16, 48, 512, 8, 1, (100, 48), 2, "HND"),  # head dim 512: two blocks split the output dims
    (BF16, 1000, 40, 4, 4, (1001, 999), 2, "NHD"),  # pages of 1000 tokens
]


def case_id(case) -> str:
    dtype, page, dim, heads, kv_heads, lens, splits, layout = case
    return f"{str(dtype)[6:]}-p{page}-d{dim}-g{heads // kv_heads}-s{splits}-{layout}"


@pytest.mark.parametrize("case", MATRIX, ids=case_id)
@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_matrix_matches_reference(backend, case):
    dtype, page, dim, heads, kv_heads, lens, splits, layout = case
    batch = make(
        backend,
        dtype=dtype,
        page_size=page,
        head_dim=dim,
        num_heads=heads,
        num_kv_heads=kv_heads,
        seq_lens=lens,
        layout=layout,
        seed=len(lens) + dim,
    )
    plan = {}
    out_c, lse_c, report = run(backend, batch, num_splits=splits, plan=plan)
    ref_out = assert_matches_reference(batch, out_c, lse_c, report)
    assert ref_out.abs().max() > 0.1, "reference too small to tell right from wrong"
    assert int(report.violations.sum()) == 0
    out_u, lse_u, none = run(backend, batch, check=False, num_splits=splits)
    assert_matches_reference(batch, out_u, lse_u, none, check=False)
    # One source: with every page valid, the check must not change a single bit.
    assert torch.equal(out_c, out_u) and torch.equal(lse_c, lse_u)

    assert plan["num_chunks"] == -(-(heads // kv_heads) // 16)
    # Rows off 16-byte alignment or head dims not a multiple of 8 are copied element by element.
    assert plan["vec"] == (0 if layout == "offset" or dim % 8 else 1)
    assert plan["d_split"] == (2 if dim > 256 else 1)
    if splits is not None:
        assert plan["num_splits"] == splits


def test_matrix_covers_the_contract():
    """The matrix holds both 16-bit dtypes, page sizes 1/16/256 and non-powers of two, the listed
    head dims (a multiple of 8 or not, up to 512), GQA, splits, strided (HND) and unaligned pools."""
    assert {c[0] for c in MATRIX} == {F16, BF16}
    assert {1, 5, 16, 48, 256, 1000} <= {c[1] for c in MATRIX}
    assert {13, 16, 64, 72, 80, 96, 128, 256, 512} <= {c[2] for c in MATRIX}
    assert max(c[3] // c[4] for c in MATRIX) > 1 and max(c[6] or 1 for c in MATRIX) > 1
    assert {"NHD", "HND", "offset"} == {c[7] for c in MATRIX}


# ---- ownership scenarios (docs/ownership.md section 6), each with its clean twin ----


def sentinel_pool(backend, dtype, num_pages, page, kv_heads, dim, q):
    """Tenant A's pages: K aligned with q (dominates any softmax), V = 100; then released."""
    device = device_of(backend)
    k = (
        (8 * q[0, :: q.shape[1] // kv_heads])
        .to(dtype)
        .expand(num_pages, page, kv_heads, dim)
        .contiguous()
    )
    v = torch.full((num_pages, page, kv_heads, dim), 100.0, dtype=dtype, device=device)
    tags_ = torch.zeros(num_pages, dtype=torch.int64, device=device)
    return k, v, tags_


@pytest.mark.parametrize("n_pages", [1, 4])
@pytest.mark.parametrize("backend", BACKENDS)
def test_incident_replay(backend, n_pages):
    """B reserves n pages over A's stale sentinel KV, one token is written, B decodes the full
    reservation: checked reports n pages (RESERVED, and the first page UNWRITTEN) and equals
    attention over the one token; unchecked shows the sentinel (the scenario is real)."""
    device, dtype, page, kv_heads, dim = device_of(backend), F16, 16, 2, 64
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, dim, generator=g).to(dtype).to(device)
    k_cache, v_cache, page_tags = sentinel_pool(backend, dtype, 8, page, kv_heads, dim, q)
    # A wrote every slot of the pool (the sentinel) under its lease, then released it.
    page_tags[:] = kvattn.written_tag(1, page)
    kvattn.release_pages(page_tags, list(range(8)))
    pages = [5, 2, 7, 0][:n_pages]
    kvattn.reserve_pages(page_tags, pages, owner=2)
    k1 = torch.randn(1, kv_heads, dim, generator=g).to(dtype).to(device)
    v1 = torch.randn(1, kv_heads, dim, generator=g).to(dtype).to(device)
    slot = torch.tensor([pages[0] * page], dtype=torch.int64, device=device)
    assert kvattn.write_kv(k1, v1, k_cache, v_cache, slot, page_tags, owner=2).dropped_count() == 0
    table = torch.tensor([pages], dtype=torch.int32, device=device)
    lens = torch.tensor([n_pages * page], dtype=torch.int32, device=device)
    expected = torch.tensor([2], dtype=torch.int64, device=device)
    batch = Batch(q, k_cache, v_cache, table, lens, page_tags, expected)

    out, lse, report = run(backend, batch)
    assert_matches_reference(batch, out, lse, report)
    assert int(report.violations[0]) == n_pages
    want = Violation.UNWRITTEN | (Violation.RESERVED if n_pages > 1 else 0)
    assert int(report.reasons[0]) == int(want)
    one_token = v1[0].repeat_interleave(2, dim=0).float()  # [H, D]: softmax over one slot is 1
    torch.testing.assert_close(out[0].float(), one_token, **tolerance(dtype))

    out_u, _, _ = run(backend, batch, check=False)
    assert (out_u[0].float() - one_token).abs().max() > 10, (
        "unchecked read did not show the sentinel"
    )


BAD_ENTRIES = [
    "free",
    "reserved",
    "out_of_range",
    "negative",
    "duplicate_of_other",
    "swapped_rows",
    "owner_mismatch",
    "unwritten_tail",
]


@pytest.mark.parametrize("kind", BAD_ENTRIES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_table_entries_are_refused_and_reported(backend, kind):
    batch = make(backend, dtype=F16, page_size=4, head_dim=64, seq_lens=(9, 14, 6), seed=11)
    out, lse, report = run(backend, batch)
    assert_matches_reference(batch, out, lse, report)
    assert int(report.violations.sum()) == 0, "the clean twin must pass"

    table, tags_ = batch.block_table, batch.page_tags
    b, i, want = 1, 2, None
    if kind == "free":
        tags_[int(table[b, i])] = kvattn.FREE_TAG
        want = Violation.FREE
    elif kind == "reserved":
        tags_[int(table[b, i])] = kvattn.reserved_tag(b + 1)
        want = Violation.RESERVED
    elif kind == "out_of_range":
        table[b, i] = tags_.shape[0] + 3
        want = Violation.OUT_OF_RANGE
    elif kind == "negative":
        table[b, i] = -5
        want = Violation.OUT_OF_RANGE
    elif kind == "duplicate_of_other":
        table[b, i] = table[0, 0]
        want = Violation.OWNER_MISMATCH
    elif kind == "swapped_rows":
        table[[0, 1]] = table[[1, 0]].clone()
        want = Violation.OWNER_MISMATCH
    elif kind == "owner_mismatch":
        batch.expected[b] = 77
        want = Violation.OWNER_MISMATCH
    elif kind == "unwritten_tail":
        p = int(table[b, i])
        tags_[p] = kvattn.written_tag(b + 1, int(kvattn.tag_valid_len(int(tags_[p]))) - 1)
        want = Violation.UNWRITTEN
    out, lse, report = run(backend, batch)
    assert_matches_reference(batch, out, lse, report)
    assert int(report.reasons[b]) & int(want)
    assert int(report.page_reasons[b, i]) == int(want) or kind == "swapped_rows"


@pytest.mark.parametrize("length", [15, 16, 17, 31, 32, 33])
@pytest.mark.parametrize("backend", BACKENDS)
def test_partial_pages_around_boundaries(backend, length):
    """Stale (NaN) tails past valid_len stay out; a valid_len one short of what is read is refused."""
    batch = make(backend, dtype=BF16, page_size=16, head_dim=80, seq_lens=(length, 3), seed=length)
    out, lse, report = run(backend, batch, num_splits=2)
    assert_matches_reference(batch, out, lse, report)
    assert int(report.violations.sum()) == 0
    last = int(batch.block_table[0, (length - 1) // 16])
    valid = int(kvattn.tag_valid_len(int(batch.page_tags[last])))
    batch.page_tags[last] = kvattn.written_tag(1, valid - 1)
    out, lse, report = run(backend, batch, num_splits=2)
    assert_matches_reference(batch, out, lse, report)
    assert int(report.reasons[0]) == int(Violation.UNWRITTEN) and int(report.violations[0]) == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefix_sharing_per_entry_expected(backend):
    """Sequence 1 reads sequence 0's first page (written under lease 1): passes when its expected
    entry names lease 1, fails (OWNER_MISMATCH) under its own lease."""
    batch = make(backend, dtype=F16, page_size=8, head_dim=64, seq_lens=(20, 20), seed=5)
    batch.block_table[1, 0] = batch.block_table[0, 0]
    per_entry = torch.stack([torch.full((3,), 1), torch.tensor([1, 2, 2])]).to(batch.q.device)
    batch.expected = per_entry
    out, lse, report = run(backend, batch)
    assert_matches_reference(batch, out, lse, report)
    assert int(report.violations.sum()) == 0
    batch.expected = per_entry.clone()
    batch.expected[1, 0] = 2
    out, lse, report = run(backend, batch)
    assert_matches_reference(batch, out, lse, report)
    assert int(report.page_reasons[1, 0]) == int(Violation.OWNER_MISMATCH)


@pytest.mark.parametrize("num_splits", [2, 3])
@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_masked_rows_and_splits(backend, num_splits):
    """Sequence 0 loses every page of its second split, sequence 1 every page: the first equals the
    reference over what is left, the second is 0 with lse -inf, never NaN."""
    batch = make(backend, dtype=F16, page_size=16, head_dim=64, seq_lens=(448, 200), seed=2)
    plan = {}
    run(backend, batch, num_splits=num_splits, plan=plan)
    start, end = grids.split_bounds(448, num_splits, plan["align"], plan["min_chunk"])[1]
    for i in range(start // 16, -(-end // 16)):
        batch.page_tags[int(batch.block_table[0, i])] = kvattn.reserved_tag(1)
    for i in range(-(-200 // 16)):
        batch.page_tags[int(batch.block_table[1, i])] = kvattn.FREE_TAG
    out, lse, report = run(backend, batch, num_splits=num_splits)
    assert_matches_reference(batch, out, lse, report)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.isinf(lse[1]).all() and (lse[1] < 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_seq_len_beyond_table_counts_once_and_reads_nothing_past_it(backend):
    batch = make(backend, dtype=F16, page_size=4, head_dim=64, seq_lens=(8, 5), seed=9)
    batch.seq_lens[0] = 8 + 7  # the table holds 2 pages of 4
    args = kvattn.layout.validate_decode(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.block_table,
        batch.seq_lens,
        batch.page_tags,
        batch.expected,
        validate=False,
    )
    out, lse, report = run(backend, batch, args=args)
    assert_matches_reference(batch, out, lse, report, args=args)
    assert int(report.beyond_table[0]) == 1 and int(report.violations[0]) == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_late_writer_is_dropped_and_reader_unchanged(backend):
    """A's write replayed after its pages went to B is dropped; B's output is bit-identical to a
    run without the late write."""
    batch = make(backend, dtype=F16, page_size=8, head_dim=64, seq_lens=(12,), seed=4)
    clean, clean_lse, _ = run(backend, batch)
    page = int(batch.block_table[0, 0])
    late_k = torch.full((1, 2, 64), 50.0, dtype=F16, device=batch.q.device)
    slot = torch.tensor([page * 8 + 3], device=batch.q.device)
    result = kvattn.write_kv(
        late_k, late_k, batch.k_cache, batch.v_cache, slot, batch.page_tags, owner=99
    )
    assert result.dropped_count() == 1
    out, lse, report = run(backend, batch)
    assert torch.equal(out, clean) and torch.equal(lse, clean_lse)
    assert int(report.violations.sum()) == 0


@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_in_an_accepted_slot_is_not_hidden(backend, num_splits):
    """The 0 / -inf convention is for empty rows only: a NaN the caller wrote into a page that passes
    the check reaches the output as in the reference, and stays in its own sequence."""
    batch = make(backend, dtype=F16, page_size=4, head_dim=64, seq_lens=(30, 7), seed=6)
    batch.k_cache[int(batch.block_table[0, 5]), 1, 0, 3] = float("nan")
    out, lse, report = run(backend, batch, num_splits=num_splits)
    ref_out, ref_lse, ref_report = batch.reference(return_lse=True)
    assert torch.isnan(ref_out[0, :2]).all() and torch.isnan(out[0, :2]).all()
    assert torch.isnan(lse[0, :2]).all()
    torch.testing.assert_close(out[1].float(), ref_out[1], **tolerance(F16))
    assert_reports_equal(report, ref_report)


@pytest.mark.parametrize("k", [10.875, 11.0])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_weight_under_2_to_the_126_of_the_row_max_is_flushed(backend, k):
    """The softmax weights come from ex2.approx.ftz (warp_ops.cuh fast_exp2), which flushes
    results under 2^-126 to 0; the harness flushes as the device does. Key 1's logit sits
    125.5 (K = -10.875) or 126.96 (K = -11) below key 0's in base 2, and its V row is the
    largest bfloat16 (~2^128), so it moves the reference's output by 2^2.5 or 2^1.04: the first
    is read as the reference reads it, the second contributes nothing."""
    batch = make(backend, dtype=BF16, num_heads=1, num_kv_heads=1, seq_lens=(2,))
    page = int(batch.block_table[0, 0])
    batch.q.fill_(1.0)
    batch.k_cache[page, 0].zero_()
    batch.k_cache[page, 1].fill_(-k)  # logit -k * 64 / 8 (natural), 11.54 k below key 0's in base 2
    batch.v_cache[page, 1].fill_(torch.finfo(BF16).max)
    out, _, _ = run(backend, batch, num_splits=1)
    ref_out, _ = batch.reference(compute_dtype=torch.float64)
    key_0 = batch.v_cache[page, 0].double()  # [1, 64]: the output with key 1 flushed
    if k == 10.875:
        torch.testing.assert_close(out.double(), ref_out, **tolerance(BF16))
        assert (ref_out - key_0).min() > 5.0
    else:
        torch.testing.assert_close(out.double(), key_0[None], **tolerance(BF16))
        assert (ref_out - key_0).min() > 1.5


@pytest.mark.parametrize("backend", BACKENDS)
def test_public_api_runs_the_backend(backend):
    batch = make(backend, dtype=F16, seq_lens=(5, 30))
    batch.page_tags[int(batch.block_table[1, 1])] = kvattn.FREE_TAG
    with pytest.raises(kvattn.KVOwnershipError, match="sequence 1"):
        batch.decode(backend, on_violation="raise")


# ---- the harness, the build and the registry ----


def midpoints(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Exact float32 midpoints between the 16-bit values ``bits`` and their successors (ties)."""
    lo = bits.to(torch.int16).view(dtype).double()
    hi = (bits + 1).to(torch.int16).view(dtype).double()
    return ((lo + hi) / 2).float()


def test_harness_rounds_like_the_hardware():
    """float -> half / bfloat16 round to nearest even (ties, subnormals, overflow, NaN), bit for
    bit as torch does; half -> float is exact."""
    sim = importlib.import_module("kvattn.backends.cuda_sim._sim")
    g = torch.Generator().manual_seed(0)
    scaled = torch.randn(4000, generator=g) * 10.0 ** torch.randint(-9, 6, (4000,), generator=g)
    finite_half = torch.randint(0, 0x7BFF, (2000,), generator=g, dtype=torch.int32)
    finite_bf16 = torch.randint(0, 0x7F7F, (2000,), generator=g, dtype=torch.int32)
    specials = torch.tensor(
        [
            65504.0,
            65519.0,
            65520.0,
            7e4,
            2.0**-24,
            2.0**-25,
            3e-8,
            0.0,
            -0.0,
            float("inf"),
            float("-inf"),
        ]
    )
    for dtype, to_bits, finite in (
        (torch.float16, sim.float_to_half_bits, finite_half),
        (torch.bfloat16, sim.float_to_bf16_bits, finite_bf16),
    ):
        ties = midpoints(finite, dtype)
        xs = torch.cat([scaled, ties, -ties, specials])
        got = torch.tensor(to_bits(xs.tolist()), dtype=torch.int32)
        want = xs.to(dtype).view(torch.int16).to(torch.int32) & 0xFFFF
        assert torch.equal(got, want), dtype
        nan = torch.tensor(to_bits([float("nan")]), dtype=torch.int32).to(torch.int16).view(dtype)
        assert torch.isnan(nan).all()  # NaN payloads differ between implementations; NaN stays NaN
    bits = torch.arange(0, 65536, dtype=torch.int32)
    halves = bits.to(torch.int16).view(torch.float16)
    finite = torch.isfinite(halves)
    back = torch.tensor(sim.half_bits_to_float(bits[finite].tolist()))
    assert torch.equal(back, halves[finite].float())


def built_modules() -> list:
    names = [
        "kvattn.backends.cuda_sim._sim",
        "kvattn.backends.cuda_sim._sim_break_barrier",
        "kvattn.backends.cuda_sim._sim_break_pages",
        "kvattn.backends.cuda_sim._sim_break_fragment",
    ]
    mods = [importlib.import_module(n) for n in names]
    try:
        mods.append(importlib.import_module("kvattn.backends.cuda._C"))
    except ImportError:
        assert shutil.which("nvcc") is None, "nvcc is installed but the CUDA module was not built"
    return mods


def test_built_modules_use_the_tag_layout_of_kvattn_tags():
    """The C++ header is generated from kvattn/tags.py; a stale build would fail here."""
    want = {
        name: getattr(tags, name)
        for name in (
            "STATE_MASK",
            "STATE_FREE",
            "STATE_RESERVED",
            "STATE_WRITTEN",
            "VALID_LEN_SHIFT",
            "VALID_LEN_BITS",
            "VALID_LEN_MAX",
            "OWNER_SHIFT",
            "OWNER_BITS",
            "OWNER_MAX",
        )
    }
    want.update({f"Violation_{f.name}": int(f) for f in Violation if f})
    want.update({f"WriteDrop_{f.name}": int(f) for f in kvattn.WriteDrop if f})
    for module in built_modules():
        assert module.tag_layout() == want, module.__name__


def broken_disagrees(module_name: str, seed: int) -> tuple[bool, bool]:
    """(output differs, report differs) between a harness build and the reference on one batch."""
    module = importlib.import_module(module_name)
    module.set_seed(seed)
    batch = make(
        "cuda_sim",
        dtype=F16,
        page_size=4,
        head_dim=64,
        num_heads=4,
        num_kv_heads=1,
        seq_lens=(70, 23, 41),
        seed=seed,
    )
    args = batch.args()
    out = torch.full_like(batch.q, float("nan"))
    report = module_of("cuda_sim").decode(
        args, check=True, out=out, lse=None, num_splits=2, module=module
    )
    ref_out, ref_report = batch.reference(compute_dtype=torch.float64)
    out_wrong = not torch.allclose(out.double(), ref_out, **tolerance(F16))
    report_wrong = any(
        not torch.equal(getattr(report, f), getattr(ref_report, f))
        for f in ("violations", "reasons", "pages_checked", "page_reasons")
    )
    return out_wrong, report_wrong


@pytest.mark.parametrize("seed", [0, 1])
def test_harness_catches_a_missing_wait_for_the_async_copies(seed):
    """Without the cp.async wait before a stage is used, the harness lands no copy in time: the
    warp computes on the poison or on the previous sub-tile and the output must be wrong. The
    correct build, on the same batch, is right."""
    assert broken_disagrees("kvattn.backends.cuda_sim._sim", seed) == (False, False)
    out_wrong, _ = broken_disagrees("kvattn.backends.cuda_sim._sim_break_barrier", seed)
    assert out_wrong


def test_harness_catches_an_off_by_one_in_the_page_loop():
    assert broken_disagrees("kvattn.backends.cuda_sim._sim", 3) == (False, False)
    _, report_wrong = broken_disagrees("kvattn.backends.cuda_sim._sim_break_pages", 3)
    assert report_wrong


@pytest.mark.parametrize("seed", [0, 1])
def test_harness_catches_a_wrong_mma_fragment_index(seed):
    """Two registers of the P @ V A-fragment swapped (rows g + 8 and keys 8..15): the harness's mma
    hands each lane the hardware's elements, so decode and extend outputs must be wrong while the
    reports (computed without the tensor cores) stay right."""
    out_wrong, report_wrong = broken_disagrees("kvattn.backends.cuda_sim._sim_break_fragment", seed)
    assert out_wrong and not report_wrong
    broken = importlib.import_module("kvattn.backends.cuda_sim._sim_break_fragment")
    e = Extend.random(
        [5, 17], [3, 20], num_heads=4, num_kv_heads=1, head_dim=64, page_size=4, seed=seed
    )
    args = kvattn.layout.validate_extend(*e.inputs())
    ref = e.reference(compute_dtype=torch.float64)[0]
    for module, wrong in (
        (importlib.import_module("kvattn.backends.cuda_sim._sim"), False),
        (broken, True),
    ):
        out = torch.full_like(e.q, float("nan"))
        launch.extend(module, args, check=True, out=out, lse=None)
        assert (not torch.allclose(out.double(), ref, **tolerance(F16))) == wrong, module.__name__


def _bits(x: torch.Tensor) -> list[int]:
    """The 16-bit words of a half-precision tensor, as the harness takes them."""
    return (x.view(torch.int16).to(torch.int32) & 0xFFFF).flatten().tolist()


def test_harness_mma_and_ldmatrix_follow_the_ptx_fragment_layout():
    """ldmatrix and mma.m16n8k16 on the harness: each lane's A and B registers hold exactly the
    elements of the PTX ISA's fragment figures (g = lane // 4, t = lane % 4), and D = A @ B."""
    sim = importlib.import_module("kvattn.backends.cuda_sim._sim")
    g_ = torch.Generator().manual_seed(0)
    for dtype, bf16 in ((F16, False), (BF16, True)):
        a = torch.randn(16, 16, generator=g_).to(dtype)
        b = torch.randn(16, 8, generator=g_).to(dtype)
        frags, d, error = sim.mma_selftest(_bits(a), _bits(b), bf16)
        assert error == ""

        def half(reg, hi, dtype=dtype):
            word = (reg >> 16) if hi else (reg & 0xFFFF)
            return torch.tensor([word], dtype=torch.int32).to(torch.int16).view(dtype)[0]

        for lane in range(32):
            gi, t = lane // 4, lane % 4
            regs = frags[lane * 6 : (lane + 1) * 6]
            want_a = [(gi, 2 * t), (gi + 8, 2 * t), (gi, 2 * t + 8), (gi + 8, 2 * t + 8)]
            for reg, (row, col) in zip(regs[:4], want_a):
                assert half(reg, False) == a[row, col] and half(reg, True) == a[row, col + 1]
            for reg, k in zip(regs[4:], (2 * t, 2 * t + 8)):
                assert half(reg, False) == b[k, gi] and half(reg, True) == b[k + 1, gi]
        want = a.double() @ b.double()
        got = torch.zeros(16, 8, dtype=torch.float64)
        for lane in range(32):
            gi, t = lane // 4, lane % 4
            for c in range(4):
                got[gi + 8 * (c // 2), 2 * t + c % 2] = d[lane * 4 + c]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_page_division_is_exact_for_every_page_size():
    """The kernels split a token index into (page, slot) by multiply-shift; it must equal floor
    division for every supported page size at every page boundary and up to the 2**31 capacity."""
    sim = importlib.import_module("kvattn.backends.cuda_sim._sim")
    top = 2**31 - 1
    for size in range(1, 1025):
        last = top // size
        pages = [0, 1, 2, 3, 1000, 65535, last - 1, last]
        ns = sorted(
            {
                n
                for k in pages
                for n in (k * size - 1, k * size, k * size + size - 1)
                if 0 <= n <= top
            }
            | {top}
        )
        assert sim.page_div(size, ns) == [n // size for n in ns], f"page size {size}"


def test_launcher_errors_raise_naming_the_kernel():
    batch = make("cuda_sim", dtype=F16, head_dim=64, page_size=1024, seq_lens=(4,))
    args = batch.args()
    # 2**21 table columns of 1024-token pages: the launcher's own capacity limit refuses, not a crash
    args.block_table = args.block_table[:, :1].expand(args.batch, 2**21).contiguous()
    args.expected = args.expected[:, :1].expand(args.batch, 2**21).contiguous()
    out = torch.empty_like(args.q)
    sim = importlib.import_module("kvattn.backends.cuda_sim._sim")
    with pytest.raises(
        RuntimeError, match=r"paged_decode .*table capacity must stay below 2\*\*31 tokens"
    ):
        launch.decode(sim, args, check=True, out=out, lse=None, num_splits=1)


def test_why_not_gives_reasons():
    probe = make("cuda_sim", dtype=F16, head_dim=16, page_size=4, seq_lens=(3,)).args()
    assert module_of("cuda_sim").why_not(probe) is None
    reason = module_of("cuda").why_not(probe)
    if torch.cuda.is_available():
        assert reason is not None and "cuda:" not in reason
    else:
        assert reason is not None and ("not built" in reason or "no GPU" in reason)
    odd = make("cuda_sim", dtype=F16, head_dim=20, page_size=7, seq_lens=(3,)).args()
    assert module_of("cuda_sim").why_not(odd) is None
    big = make("cuda_sim", dtype=F16, head_dim=520, page_size=4, seq_lens=(3,)).args()
    assert "head_dim 520" in module_of("cuda_sim").why_not(big)
    fp32 = make("cuda_sim", dtype=F32, head_dim=16, page_size=4, seq_lens=(3,)).args()
    assert "float32" in module_of("cuda_sim").why_not(fp32) and "triton" in module_of(
        "cuda_sim"
    ).why_not(fp32)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="on a GPU the scenario suites probe CUDA tensors"
)
def test_scenario_suites_include_the_harness():
    assert "cuda_sim" in backends_under_test()


def nvcc_present() -> bool:
    return shutil.which("nvcc") is not None or pathlib.Path("/usr/local/cuda/bin/nvcc").exists()


@pytest.mark.skipif(not nvcc_present(), reason="no nvcc: the CUDA module is not built here")
def test_ptxas_resources_have_no_local_memory():
    """setup.py keeps the -Xptxas -v output; every decode instantiation the build selected from
    csrc/instantiations.py is there once for each architecture it was built for (sm_80 and sm_90
    by default), with registers recorded and no spill or stack frame
    (tests/backends/test_instantiations.py holds the table to the dispatch's axes)."""
    report = _load_ptxas_report()
    log = ptxas_log()
    records = report.check(log)
    decode = [r for r in records if "paged_decode_kernel" in r["kernel"]]
    assert {(r["kernel"], r["arch"]) for r in decode} == built_cuda_kernels("paged_decode_kernel")
    assert all(0 < r["registers"] <= 255 for r in records)


def test_ptxas_check_fails_on_spills():
    report = _load_ptxas_report()
    log = (
        "ptxas info    : Compiling entry function "
        "'_ZN6kvattn19paged_decode_kernelIfLb1EEEvNS_12DecodeParamsE'"
        " for 'sm_90'\nptxas info    : Function properties for x\n"
        "    64 bytes stack frame, 32 bytes spill stores, 32 bytes spill loads\n"
        "ptxas info    : Used 255 registers, used 1 barriers, 912 bytes cmem[0]\n"
    )
    records = report.parse(log)
    assert records[0]["registers"] == 255 and records[0]["spill_stores"] == 32
    assert report.local_memory_problems(records)
    assert (
        report.summary(records) == "1 kernels (1 for sm_90), 255-255 registers, 1 with local memory"
    )


def test_the_build_prints_one_line_of_the_ptxas_figures_and_files_the_table():
    """make build prints the summary line (units, instantiations, ptxas figures), not the table of
    every kernel, which it writes to build/cuda/ptxas-table.txt."""
    report = _load_ptxas_report()
    records = [
        dict(
            kernel=f"k{i}",
            arch=arch,
            registers=40 + i,
            smem_static=0,
            stack_frame=0,
            spill_stores=0,
            spill_loads=0,
        )
        for i, arch in enumerate(("sm_80", "sm_80", "sm_90"))
    ]
    assert report.summary(records) == (
        "3 kernels (2 for sm_80, 1 for sm_90), 40-42 registers, no spills, no stack frames"
    )
    source = (ROOT / "setup.py").read_text()
    assert "print(report.table(" not in source and "report.summary(records)" in source
    ptxas_log()  # skips where the last build compiled no CUDA module
    table = (ROOT / "build" / "cuda" / "ptxas-table.txt").read_text().splitlines()
    assert len(table) == 1 + len(report.parse(ptxas_log().read_text()))


def _load_ptxas_report():
    spec = importlib.util.spec_from_file_location("ptxas_report", ROOT / "csrc" / "ptxas_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- the stamping writer ----


def writer_case(seed: int, device, dtype=F16, layout="NHD"):
    """Pages in every state and a slot mapping with runs, gaps, out-of-order and duplicate-free
    slots, padding, out-of-range pages and a late writer; returns the arguments of write_kv."""
    g = torch.Generator().manual_seed(seed)
    num_pages, page, kv_heads, dim = 6, 4, 2, 16
    shape = (
        (num_pages, kv_heads, page, dim) if layout == "HND" else (num_pages, page, kv_heads, dim)
    )
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    if layout == "HND":
        k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    owner, other = 5, 9
    page_tags = torch.tensor(
        [
            kvattn.reserved_tag(owner),
            kvattn.written_tag(owner, 2),
            kvattn.written_tag(owner, 4),
            kvattn.FREE_TAG,
            kvattn.written_tag(other, 3),
            kvattn.reserved_tag(other),
        ]
    )
    page_tags = page_tags[torch.randperm(num_pages, generator=g)]
    slots: list[int] = []
    while len(slots) < 20:
        kind = int(torch.randint(0, 10, (1,), generator=g))
        if kind == 0:
            slots.append(-1)
            continue
        p = int(torch.randint(0, num_pages + 1, (1,), generator=g))  # num_pages: out of range
        start = int(torch.randint(0, page, (1,), generator=g))
        length = int(torch.randint(1, page - start + 1, (1,), generator=g))
        run = [p * page + s for s in range(start, start + length)]
        if kind == 1:
            run.reverse()  # out of slot order
        slots += [s for s in run if s not in slots]
    slot_mapping = torch.tensor(slots, dtype=torch.int32 if seed % 2 else torch.int64)
    n = slot_mapping.numel()
    k = torch.randn(n, kv_heads, dim, generator=g).to(dtype)
    v = torch.randn(n, kv_heads, dim, generator=g).to(dtype)
    owners = owner if seed % 3 else torch.where(torch.rand(n, generator=g) < 0.8, owner, other)
    to = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t  # noqa: E731
    return [to(x) for x in (k, v, k_cache, v_cache, slot_mapping, page_tags, owners)]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32).cpu()


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("backend", BACKENDS)
def test_write_kv_equals_the_python_writer(backend, seed):
    device = device_of(backend)
    layout = "HND" if seed % 4 == 1 else "NHD"
    dtype = (F16, BF16, F32)[seed % 3]
    ours = writer_case(seed, device, dtype, layout)
    theirs = [x.clone() if isinstance(x, torch.Tensor) else x for x in ours]
    got = kvattn.write_kv(*ours, backend=backend)
    want = kvattn.write_kv(*theirs, backend="torch")
    assert torch.equal(got.landed.cpu(), want.landed.cpu())
    assert torch.equal(got.drop_reasons.cpu(), want.drop_reasons.cpu())
    assert got.dropped_count() == want.dropped_count()
    assert torch.equal(ours[5].cpu(), theirs[5].cpu()), "page tags differ"
    assert torch.equal(bits(ours[2]), bits(theirs[2])) and torch.equal(
        bits(ours[3]), bits(theirs[3])
    )
    if seed == 0:
        reasons = set(want.drop_reasons.tolist())
        assert {0, int(kvattn.WriteDrop.NOT_HELD), int(kvattn.WriteDrop.GAP)} <= reasons


@pytest.mark.parametrize("backend", BACKENDS)
def test_write_kv_cases_cover_every_verdict(backend):
    """Across the seeds above, every WriteDrop reason and padding occur (the cases are not vacuous)."""
    seen = set()
    for seed in range(12):
        args = writer_case(seed, device_of(backend))
        result = kvattn.write_kv(*args, backend="torch")
        seen |= set(result.drop_reasons.tolist())
        seen |= {"padding"} if (args[4] < 0).any() else set()
        seen |= {"landed"} if result.landed.any() else set()
    assert seen >= {0, 1, 2, 4, "padding", "landed"}


@pytest.mark.parametrize("backend", BACKENDS)
def test_write_kv_then_decode_reads_only_landed_tokens(backend):
    """The CUDA writer and decode together: a late write is dropped, B's tokens are read."""
    device = device_of(backend)
    page, kv_heads, dim = 8, 2, 64
    k_cache = torch.full((4, page, kv_heads, dim), float("nan"), dtype=F16, device=device)
    v_cache = torch.full_like(k_cache, float("nan"))
    page_tags = torch.zeros(4, dtype=torch.int64, device=device)
    kvattn.reserve_pages(page_tags, [2, 0], owner=3)
    g = torch.Generator().manual_seed(1)
    k = torch.randn(11, kv_heads, dim, generator=g).to(F16).to(device)
    v = torch.randn(11, kv_heads, dim, generator=g).to(F16).to(device)
    slots = torch.tensor([16 + s for s in range(8)] + [0, 1, 2], device=device)
    assert (
        kvattn.write_kv(
            k, v, k_cache, v_cache, slots, page_tags, 3, backend=backend
        ).dropped_count()
        == 0
    )
    late = kvattn.write_kv(
        k[:1] * 50, v[:1] * 50, k_cache, v_cache, slots[:1], page_tags, 4, backend=backend
    )
    assert late.dropped_count() == 1 and int(late.drop_reasons[0]) == int(kvattn.WriteDrop.NOT_HELD)
    q = torch.randn(1, 4, dim, generator=g).to(F16).to(device)
    batch = Batch(
        q,
        k_cache,
        v_cache,
        torch.tensor([[2, 0]], dtype=torch.int32, device=device),
        torch.tensor([11], dtype=torch.int32, device=device),
        page_tags,
        torch.tensor([3], dtype=torch.int64, device=device),
    )
    out, lse, report = run(backend, batch)
    assert_matches_reference(batch, out, lse, report)
    assert int(report.violations.sum()) == 0


def test_harness_reports_unmatched_synchronisation():
    """A barrier one thread never reaches, or a shuffle half a warp skips, is a launch error (the
    kernel would hang or read undefined values on a GPU); the correct kernel runs clean."""
    sim = importlib.import_module("kvattn.backends.cuda_sim._sim")
    values, error = sim.harness_selftest(0, 64)
    assert error == "" and values == [(t + 1) % 64 for t in range(64)]
    _, error = sim.harness_selftest(1, 64)
    assert "deadlock" in error and "__syncthreads" in error
    _, error = sim.harness_selftest(2, 64)
    assert "deadlock" in error and "warp shuffle" in error


def test_harness_exposes_a_missing_barrier_as_poison():
    """Without the barrier, threads scheduled before their neighbour read shared memory still
    holding the 0xFF poison (-1)."""
    sim = importlib.import_module("kvattn.backends.cuda_sim._sim")
    sim.set_seed(0)
    values, error = sim.harness_selftest(3, 128)
    assert error == ""
    assert -1 in values and values != [(t + 1) % 128 for t in range(128)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where CUDA calls fail")
def test_real_module_turns_a_cuda_error_into_an_exception_naming_the_kernel():
    """The nvcc-built module on a machine without a usable GPU: the launch fails inside CUDA, and the
    binding raises (never exits) with the kernel's name and CUDA's message."""
    real = importlib.import_module("kvattn.backends.cuda")
    if real._C is None:
        pytest.skip(real._NOT_BUILT)
    batch = make("cuda_sim", dtype=F16, head_dim=64, seq_lens=(3,))
    args = batch.args()
    with pytest.raises(
        RuntimeError, match=r"kvattn: paged_decode_kernel<check=true> failed: .+ \(error \d+\)"
    ):
        launch.decode(real._C, args, check=True, out=torch.empty_like(args.q), lse=None)


def param_lists() -> dict[str, list[str]]:
    """The argument names of csrc/kvattn/params.h's lists, by list (KVATTN_ATTENTION_ARGS, ...)."""
    text = (ROOT / "csrc" / "kvattn" / "params.h").read_text()
    lists = {}
    for name, body in re.findall(r"#define (KVATTN_\w+_ARGS)\(X\)((?:.*\\\n)*.*)", text):
        body = re.sub(r"/\*.*?\*/", "", body)
        lists[name] = re.findall(r"X\(\w+, [^,]+, (\w+)\)", body)
    return lists


class Recorder:
    """A binding that records the argument dict a launcher hands it, then refuses to launch."""

    EXTEND_ROWS = importlib.import_module("kvattn.backends.cuda_sim._sim").EXTEND_ROWS
    SELECTION = importlib.import_module(
        "kvattn.backends.cuda_sim._sim"
    ).SELECTION  # the whole table

    def __getattr__(self, op):
        def record(params, *rest):
            self.params = params
            raise StopIteration

        return record


# What the binding reads beyond the lists (csrc/module.cpp fill_attention): derived fields; and the
# extend's custom mask (csrc/module.cpp extend).
DERIVED = {
    "page_size",
    "kv_dtype",
    "window_left",
    "window_right",
    "soft_cap",
    "alibi",
    "alibi_stride",
    "sinks",
}
EXTEND_DERIVED = {"custom_mask", "mask_start", "mask_numel"}


@pytest.mark.parametrize("op", ["decode", "extend", "write_kv"])
def test_launchers_pass_exactly_the_arguments_params_h_lists(op):
    """A launcher's dict names every argument of its kernel's lists and nothing else: params.h's
    lists declare the structs and drive the binding, so one list is the whole contract."""
    lists = param_lists()
    want = {
        "decode": set(lists["KVATTN_ATTENTION_ARGS"] + lists["KVATTN_DECODE_ARGS"]) | DERIVED,
        "extend": set(lists["KVATTN_ATTENTION_ARGS"] + lists["KVATTN_EXTEND_ARGS"])
        | DERIVED
        | EXTEND_DERIVED,
        "write_kv": set(lists["KVATTN_WRITE_KV_ARGS"]),
    }[op]
    batch = make("cuda_sim", seq_lens=(5, 9))
    binding = Recorder()
    with pytest.raises(StopIteration):
        if op == "decode":
            launch.decode(
                binding, batch.args(), check=True, out=torch.empty_like(batch.q), lse=None
            )
        elif op == "extend":
            args = kvattn.layout.validate_extend(
                batch.q,
                batch.k_cache,
                batch.v_cache,
                torch.tensor([0, 1, 2], dtype=torch.int32),
                batch.block_table,
                batch.seq_lens,
                batch.page_tags,
                batch.expected,
            )
            launch.extend(binding, args, check=True, out=torch.empty_like(batch.q), lse=None)
        else:
            k = torch.randn(2, batch.k_cache.shape[2], batch.k_cache.shape[3], dtype=F16)
            launch.write_kv(
                binding,
                kvattn.write_args.validate_write_kv(
                    k,
                    k,
                    batch.k_cache,
                    batch.v_cache,
                    torch.tensor([0, 1], dtype=torch.int64),
                    batch.page_tags,
                    1,
                ),
            )
    assert set(binding.params) == want


@pytest.mark.parametrize("change", ["unknown", "missing"])
def test_the_binding_refuses_an_argument_it_does_not_list(change):
    """The twin: a dict with a name the lists lack, or without one they have, raises naming it
    before any launch."""
    sim = importlib.import_module("kvattn.backends.cuda_sim._sim")
    batch = make("cuda_sim", seq_lens=(5, 9))
    binding = Recorder()
    with pytest.raises(StopIteration):
        launch.decode(binding, batch.args(), check=True, out=torch.empty_like(batch.q), lse=None)
    params = dict(binding.params)
    if change == "unknown":
        params["stride_qx"] = 1
    else:
        del params["stride_kh"]
    with pytest.raises(KeyError, match="stride_qx" if change == "unknown" else "stride_kh"):
        sim.decode(params, 1, True, 0)
