"""Every kernel backend against the reference: dtypes, page sizes, head dims, GQA, lengths around
page boundaries, split counts, strided pools, ``out=`` and ``return_lse``.

Pools come from :class:`kvattn_testing.util.Batch`: pages drawn from a random permutation of an
oversized pool, NaN in every slot that is not its reader's, so an address or mask error shows as NaN
or a large error.
"""

import dataclasses
import importlib
import itertools

import pytest
import torch

import kvattn
from kvattn import Violation
from kvattn.backends import grids
from kvattn_testing.util import (
    LSE_TOLERANCE,
    Batch,
    assert_close_to_reference,
    assert_reports_equal,
    backends_under_test,
    kernel_backends,
    runs_float32,
)

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
PAGE_SIZES = [1, 2, 16, 64, 256]
HEAD_DIMS = [64, 80, 96, 128, 256]
GROUPS = [1, 4, 8]


def covering_cases():
    """15 cases, five per dtype, each five a different pairing of head dims with page sizes: every
    head dim and every page size meets every dtype once and three values of the other. GQA ratios
    and 1 or 2 KV heads rotate through them."""
    cases = []
    for i in range(15):
        cases.append(
            dict(
                head_dim=HEAD_DIMS[i % 5],
                page_size=PAGE_SIZES[(i + i // 5) % 5],
                dtype=DTYPES[i // 5],
                group=GROUPS[i % 3],
                num_kv_heads=1 + (i // 2) % 2,
            )
        )
    return cases


CASES = covering_cases()


def case_id(case):
    return (
        f"d{case['head_dim']}-p{case['page_size']}-{str(case['dtype'])[6:]}"
        f"-g{case['group']}-kv{case['num_kv_heads']}"
    )


def boundary_lens(page_size):
    """seq_len 1, page - 1, page, page + 1 and two pages + 1: an odd batch."""
    return [1, max(1, page_size - 1), page_size, page_size + 1, 2 * page_size + 1]


def for_backend(case, backend):
    """``case`` in float16 where the backend does not run float32 (the CUDA tensor-core kernels)."""
    if case["dtype"] == torch.float32 and not runs_float32(backend):
        return dict(case, dtype=torch.float16)
    return case


def make_batch(case, seq_lens, **kwargs):
    return Batch.random(
        batch=len(seq_lens),
        num_heads=case["group"] * case["num_kv_heads"],
        num_kv_heads=case["num_kv_heads"],
        head_dim=case["head_dim"],
        page_size=case["page_size"],
        seq_lens=seq_lens,
        dtype=case["dtype"],
        **kwargs,
    )


def test_covering_design_covers():
    for key, values in [("head_dim", HEAD_DIMS), ("page_size", PAGE_SIZES)]:
        pairs = {(c[key], c["dtype"]) for c in CASES}
        assert pairs == set(itertools.product(values, DTYPES))
    for value_key, other_key in [
        ("head_dim", "page_size"),
        ("page_size", "head_dim"),
        ("group", "head_dim"),
        ("group", "page_size"),
        ("group", "dtype"),
    ]:
        for value in {c[value_key] for c in CASES}:
            assert len({c[other_key] for c in CASES if c[value_key] == value}) >= 3
    assert {c["group"] for c in CASES} == set(GROUPS)
    assert {c["page_size"] for c in CASES} == set(PAGE_SIZES)


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("backend", kernel_backends())
def test_checked_matches_reference(backend, case):
    case = for_backend(case, backend)
    batch = make_batch(case, boundary_lens(case["page_size"]), seed=len(case_id(case)))
    out, lse, report = batch.decode(backend, return_lse=True)
    ref_out, ref_lse, ref_report = batch.reference(return_lse=True, compute_dtype=torch.float64)
    assert out.dtype == case["dtype"] and lse.dtype == torch.float32
    assert_close_to_reference(out, ref_out, case["dtype"])
    torch.testing.assert_close(lse.double(), ref_lse, **LSE_TOLERANCE)
    assert_reports_equal(report, ref_report)
    assert report.violations.sum() == 0 and report.pages_checked.sum() > 0


@pytest.mark.parametrize("case", CASES[::2], ids=case_id)
@pytest.mark.parametrize("backend", kernel_backends())
def test_batch_of_one(backend, case):
    case = for_backend(case, backend)
    page = case["page_size"]
    batch = make_batch(case, [page + 1], seed=3)
    out, report = batch.decode(backend)
    ref_out, ref_report = batch.reference(compute_dtype=torch.float64)
    assert_close_to_reference(out, ref_out, case["dtype"])
    assert_reports_equal(report, ref_report)


@pytest.mark.parametrize("case", CASES[1::2], ids=case_id)
@pytest.mark.parametrize("backend", kernel_backends())
def test_unchecked_matches_reference(backend, case):
    case = for_backend(case, backend)
    batch = make_batch(case, boundary_lens(case["page_size"]), seed=5)
    out, lse, report = batch.decode(backend, check=False, return_lse=True)
    ref_out, ref_lse, _ = batch.reference(check=False, return_lse=True, compute_dtype=torch.float64)
    assert report is None
    assert_close_to_reference(out, ref_out, case["dtype"])
    torch.testing.assert_close(lse.double(), ref_lse, **LSE_TOLERANCE)


@pytest.mark.parametrize("case", CASES[::3], ids=case_id)
@pytest.mark.parametrize("backend", backends_under_test())
def test_all_valid_checked_is_bit_identical_to_unchecked(backend, case):
    case = for_backend(case, backend)
    batch = make_batch(case, boundary_lens(case["page_size"]), seed=11)
    checked, lse_c, report = batch.decode(backend, return_lse=True)
    unchecked, lse_u, _ = batch.decode(backend, check=False, return_lse=True)
    assert not report.any()
    assert torch.equal(checked, unchecked)
    assert torch.equal(lse_c, lse_u)


@pytest.mark.parametrize("backend", kernel_backends())
def test_bf16_output_is_not_garbage(backend):
    """bf16 on its own, with a query that makes attention peaked: the output must track the one
    dominant V row (the Triton interpreter's bf16 tl.dot returns garbage unless upcast)."""
    case = dict(head_dim=64, page_size=16, dtype=torch.bfloat16, group=4, num_kv_heads=1)
    batch = make_batch(case, [33], seed=2)
    p = int(batch.block_table[0, 1])
    batch.q[0] = batch.k_cache[p, 3, 0] * 4
    out, report = batch.decode(backend)
    ref_out, _ = batch.reference(compute_dtype=torch.float64)
    assert_close_to_reference(out, ref_out, torch.bfloat16)
    # The dominant token carries most of the weight, so the output points along its V row.
    cos = torch.nn.functional.cosine_similarity(
        out[0].float(), batch.v_cache[p, 3, 0].float()[None]
    )
    assert (cos > 0.9).all()


# --- Splits of split-KV ------------------------------------------------------------------------


def triton_decode_module():
    # kvattn.backends.triton re-exports the launcher under the submodule's name; fetch the module.
    return importlib.import_module("kvattn.backends.triton.paged_decode")


def split_backends():
    return [name for name in kernel_backends() if name == "triton"]


SPLIT_LENS = [1, 64, 65, 200, 448]  # page 16, block 64: 448 tokens fill the 28-page table


def split_batch(seed=0):
    case = dict(head_dim=64, page_size=16, dtype=torch.float16, group=2, num_kv_heads=1)
    return make_batch(case, SPLIT_LENS, seed=seed)


def split_plan(batch, num_splits, seq: int = -1):
    """The Triton launch's split bounds ``[(start, end)]`` of sequence ``seq``, after checking the
    plan really makes ``num_splits``."""
    module = triton_decode_module()
    args = batch.args()
    splits, min_chunk, align = module.plan_splits(args, num_splits=num_splits)
    assert splits == num_splits, f"asked for {num_splits} splits, the plan made {splits}"
    return grids.split_bounds(int(batch.seq_lens[seq]), splits, align, min_chunk)


def run_splits(batch, num_splits, *, check, return_lse=True):
    module = triton_decode_module()
    args = batch.args()
    out = torch.full_like(batch.q, float("nan"))
    lse = torch.full(batch.q.shape[:2], float("nan"), device=batch.q.device) if return_lse else None
    report = module.decode(args, check=check, out=out, lse=lse, num_splits=num_splits)
    return out, lse, report


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7])
@pytest.mark.parametrize("check", [True, False], ids=["checked", "unchecked"])
@pytest.mark.parametrize("backend", split_backends())
def test_split_counts_match_reference(backend, num_splits, check):
    """Short sequences leave later splits entirely beyond seq_len; they must weigh nothing."""
    batch = split_batch()
    last_start, last_end = split_plan(batch, num_splits, seq=0)[-1]
    assert num_splits == 1 or last_start >= last_end  # the 1-token sequence leaves splits empty
    out, lse, report = run_splits(batch, num_splits, check=check)
    ref_out, ref_lse, ref_report = batch.reference(
        check=check, return_lse=True, compute_dtype=torch.float64
    )
    assert_close_to_reference(out, ref_out, torch.float16)
    torch.testing.assert_close(lse.double(), ref_lse, **LSE_TOLERANCE)
    if check:
        assert_reports_equal(report, ref_report)
    else:
        assert report is None


@pytest.mark.parametrize("num_splits", [2, 3, 7])
@pytest.mark.parametrize("backend", split_backends())
def test_split_with_every_page_refused_does_not_disturb_the_merge(backend, num_splits):
    """Sequence 4 (448 tokens) loses every page of its second split; sequence 3 loses every page:
    the first equals the reference over the remaining splits, the second is 0 with lse -inf."""
    batch = split_batch(seed=1)
    page = batch.k_cache.shape[1]
    start, end = split_plan(batch, num_splits, seq=4)[1]
    lo, hi = start // page, -(-end // page)
    assert 0 < lo < hi
    for i in range(lo, hi):
        batch.page_tags[int(batch.block_table[4, i])] = kvattn.reserved_tag(5)
    for i in range(-(-SPLIT_LENS[3] // page)):
        batch.page_tags[int(batch.block_table[3, i])] = kvattn.FREE_TAG
    out, lse, report = run_splits(batch, num_splits, check=True)
    ref_out, ref_lse, ref_report = batch.reference(return_lse=True, compute_dtype=torch.float64)
    assert_close_to_reference(out, ref_out, torch.float16)
    torch.testing.assert_close(lse.double(), ref_lse, **LSE_TOLERANCE)
    assert_reports_equal(report, ref_report)
    assert torch.equal(out[3], torch.zeros_like(out[3])) and torch.isneginf(lse[3]).all()
    assert report.violations.tolist() == [0, 0, 0, -(-SPLIT_LENS[3] // page), hi - lo]
    assert report.reasons.tolist() == [0, 0, 0, int(Violation.FREE), int(Violation.RESERVED)]


def test_grid_waves_and_tail():
    assert grids.grid_waves(896, 924) == (896 / 924, 0.0)  # one wave: no tail
    waves, tail = grids.grid_waves(1024, 924)  # today's 1.11 waves: the last leaves 45% idle
    assert waves == 1024 / 924 and tail == pytest.approx(1 - waves / 2)
    assert grids.grid_waves(1848, 924) == (2.0, 0.0)


@pytest.mark.parametrize(
    "per_split, slots, most, splits",
    [
        (128, 924, 64, 7),  # batch 16 x 8 KV heads on 7 x 132 slots: 896 programs, one wave
        (512, 924, 64, 1),  # batch 64: 512, more splits would spill into a second wave
        (8, 924, 16, 16),  # batch 1 at 4K: the table's chunks of 256 tokens limit it
        (8, 924, 64, 64),  # and MAX_SPLITS
        (1000, 924, 64, 5),  # the batch alone overflows a wave: 5.41 waves, 9.8% of their time idle
        (2000, 924, 1, 1),  # no split to give
    ],
)
def test_fit_splits(per_split, slots, most, splits):
    assert grids.fit_splits(per_split, slots, most) == splits
    waves, tail = grids.grid_waves(per_split * splits, slots)
    assert tail <= grids.TAIL_MAX or most == 1


@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_gpu_split_plan_fits_the_slots(monkeypatch, backend):
    """The planners on an H200's 132 SMs (shapes only): every goal shape's grid fills at most one
    wave of the resident slots, with chunks of whole pages, at least GPU_MIN_CHUNK long."""
    if backend == "triton":
        module = triton_decode_module()
        slots = 7 * 132
    else:
        module = importlib.import_module("kvattn.backends.cuda.launch")
        slots = 2 * 132
    monkeypatch.setattr(grids, "device_sms", lambda device: 132)
    for b, context in itertools.product((1, 16, 64), (4096, 32768)):
        q = torch.zeros(b, 32, 128, dtype=torch.bfloat16)
        pool = torch.zeros(4, 16, 8, 128, dtype=torch.bfloat16)
        args = kvattn.layout.validate_decode(
            q,
            pool,
            pool.clone(),
            torch.zeros(b, context // 16, dtype=torch.int32),
            torch.full((b,), context, dtype=torch.int32),
            torch.zeros(4, dtype=torch.int64),
            torch.ones(b, dtype=torch.int64),
            validate=False,
        )
        splits, min_chunk, align = module.plan_splits(args)
        programs = b * 8 * splits
        assert min_chunk % align == 0 and align % 16 == 0 and min_chunk >= grids.GPU_MIN_CHUNK
        assert grids.grid_waves(programs, slots)[1] <= grids.TAIL_MAX, (b, context, splits)
        assert programs <= slots or splits == 1, (b, context, splits)
        bounds = grids.split_bounds(context, splits, align, min_chunk)
        assert bounds[0][0] == 0 and max(e for _, e in bounds) == context
        assert all(s % align == 0 for s, _ in bounds)


# --- Strided pools, out= and return_lse --------------------------------------------------------


def restride(batch, how):
    """The batch's pools copied into a view with other strides; slots outside the view are NaN."""
    k, v = batch.k_cache, batch.v_cache
    pages, page, heads, dim = k.shape
    nan = float("nan")
    if how == "kv_interleaved":  # [pages, 2, page, heads, dim]: one buffer holds K and V
        buf = torch.full((pages, 2, page, heads, dim), nan, dtype=k.dtype, device=k.device)
        new_k, new_v = buf[:, 0], buf[:, 1]
    elif how == "layer_inner":  # [pages, layers, page, heads, dim], layer 1 of 3
        bufs = [
            torch.full((pages, 3, page, heads, dim), nan, dtype=k.dtype, device=k.device)
            for _ in range(2)
        ]
        new_k, new_v = bufs[0][:, 1], bufs[1][:, 1]
    elif how == "layer_outer_hnd":  # [layers, pages, heads, page, dim], layer 2 of 3, head-major
        bufs = [
            torch.full((3, pages, heads, page, dim), nan, dtype=k.dtype, device=k.device)
            for _ in range(2)
        ]
        new_k, new_v = bufs[0][2].transpose(1, 2), bufs[1][2].transpose(1, 2)
    elif how == "padded_head_dim":  # rows padded to dim + 8 elements
        bufs = [
            torch.full((pages, page, heads, dim + 8), nan, dtype=k.dtype, device=k.device)
            for _ in range(2)
        ]
        new_k, new_v = bufs[0][..., :dim], bufs[1][..., :dim]
    else:
        raise ValueError(how)
    new_k.copy_(k)
    new_v.copy_(v)
    assert not new_k.is_contiguous() and new_k.stride(-1) == 1
    return dataclasses.replace(batch, k_cache=new_k, v_cache=new_v)


STRIDE_CASES = [
    dict(head_dim=64, page_size=16, dtype=torch.float16, group=4, num_kv_heads=2),
    dict(head_dim=80, page_size=2, dtype=torch.bfloat16, group=1, num_kv_heads=2),
    dict(head_dim=128, page_size=64, dtype=torch.float32, group=8, num_kv_heads=1),
]


STRIDINGS = ["HND", "kv_interleaved", "layer_inner", "layer_outer_hnd", "padded_head_dim"]


@pytest.mark.parametrize("how", STRIDINGS)
@pytest.mark.parametrize("backend", kernel_backends())
def test_strided_pools(backend, how):
    case = for_backend(STRIDE_CASES[STRIDINGS.index(how) % len(STRIDE_CASES)], backend)
    lens = boundary_lens(case["page_size"])
    if how == "HND":
        batch = make_batch(case, lens, layout="HND", seed=4)
        assert batch.k_cache.stride(1) != batch.k_cache.shape[2] * batch.k_cache.shape[3]
    else:
        batch = restride(make_batch(case, lens, seed=4), how)
    for check in (True, False):
        out, lse, report = batch.decode(backend, check=check, return_lse=True)
        ref_out, ref_lse, ref_report = batch.reference(
            check=check, return_lse=True, compute_dtype=torch.float64
        )
        assert_close_to_reference(out, ref_out, case["dtype"])
        torch.testing.assert_close(lse.double(), ref_lse, **LSE_TOLERANCE)
        if check:
            assert_reports_equal(report, ref_report)


@pytest.mark.parametrize("backend", backends_under_test())
def test_out_buffer_is_written_in_place_and_nothing_else(backend):
    case = CASES[4]
    batch = make_batch(case, boundary_lens(case["page_size"]), seed=6)
    dim = case["head_dim"]
    # A strided out: rows of dim + 16 elements; the padding must keep its sentinel.
    buf = torch.full(
        batch.q.shape[:2] + (dim + 16,), 7.0, dtype=case["dtype"], device=batch.q.device
    )
    out_view = buf[..., :dim]
    out, report = batch.decode(backend, out=out_view)
    assert out.data_ptr() == out_view.data_ptr()
    ref_out, _ = batch.reference(compute_dtype=torch.float64)
    assert_close_to_reference(buf[..., :dim], ref_out, case["dtype"])
    assert (buf[..., dim:] == 7.0).all()
    assert not report.any()


@pytest.mark.parametrize("backend", backends_under_test())
def test_return_lse_shapes_the_result(backend):
    case = CASES[0]
    batch = make_batch(case, [3, 40, 1], seed=8)
    two = batch.decode(backend)
    three = batch.decode(backend, return_lse=True)
    assert len(two) == 2 and len(three) == 3
    assert three[1].shape == batch.q.shape[:2] and three[1].dtype == torch.float32
    assert torch.equal(two[0], three[0])
    _, ref_lse, _ = batch.reference(return_lse=True, compute_dtype=torch.float64)
    torch.testing.assert_close(three[1].double(), ref_lse, **LSE_TOLERANCE)
    assert_reports_equal(two[1], three[2])
