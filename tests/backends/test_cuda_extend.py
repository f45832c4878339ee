"""The CUDA extend kernel (csrc/kvattn/extend.cuh) against the reference.

On every machine it runs through the CPU harness (backend ``cuda_sim``: the kernel source compiled by
the host compiler against csrc/sim/simt.h, shuffled thread order, poisoned shared memory); on a GPU
the same tests run the nvcc build (backend ``cuda``) too. Outputs start as NaN, so a row the kernel
should write and does not shows; the pools hold NaN wherever a reader must not look.
"""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

import kvattn
from kvattn import backends
from kvattn_testing.build import built_cuda_kernels, ptxas_log
from kvattn_testing.extend import Extend, assert_prefix_scenario, corrupt
from kvattn_testing.util import assert_reports_equal, tolerance

ROOT = pathlib.Path(__file__).resolve().parents[2]
BACKENDS = ["cuda_sim"] + (["cuda"] if torch.cuda.is_available() else [])
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
LSE_TOL = dict(
    atol=1e-4, rtol=1e-4
)  # float32 log-sum-exp of float32 logits (exp2/log2 in the kernel)


def on(backend: str, e: Extend) -> Extend:
    """``e`` with every tensor on the backend's device."""
    device = torch.device("cpu" if backend == "cuda_sim" else "cuda")
    p = e.pages
    for name in ("k_cache", "v_cache", "block_table", "seq_lens", "page_tags", "expected", "q"):
        setattr(p, name, getattr(p, name).to(device))
    return Extend(e.q.to(device), e.cu.to(device), p)


def launch(
    backend: str, e: Extend, *, check=True, causal=True, tokens=None, plan=None, validate=None
):
    """The backend's extend launcher with NaN-filled ``out`` and ``lse``."""
    args = kvattn.layout.validate_extend(*e.inputs(), causal=causal, validate=validate)
    module, reason = backends.load(backend)
    assert module is not None, reason
    out = torch.full_like(e.q, float("nan"))
    lse = torch.full(e.q.shape[:2], float("nan"), device=e.q.device)
    report = module.extend(args, check=check, out=out, lse=lse, tokens_per_tile=tokens, plan=plan)
    return out, lse, report


def chunks_and_prefixes(page_size: int):
    """(q_lens, prefix_lens): chunks of 1 token, inside a page and over several pages, against
    prefixes of 0, inside a page and several pages."""
    chunks = [1, max(2, page_size // 2 + 1), 2 * page_size + 3]
    prefixes = [0, max(1, page_size // 2), 2 * page_size + 1]
    pairs = [(n, p) for n in chunks for p in prefixes]
    return [n for n, _ in pairs], [p for _, p in pairs]


# dtype, page size, head_dim, query heads, KV heads, causal, pool layout
CASES = [
    (F16, 1, 64, 2, 2, True, "NHD"),
    (BF16, 4, 128, 4, 1, True, "NHD"),
    (BF16, 16, 64, 4, 1, False, "NHD"),
    (F16, 16, 128, 8, 2, True, "HND"),
    (F16, 4, 80, 2, 2, True, "NHD"),  # head_dim padded to 128 in the register tiles
    (BF16, 1, 64, 4, 1, False, "NHD"),
    (F16, 4, 64, 2, 2, False, "HND"),
    (F16, 4, 256, 16, 1, True, "NHD"),  # 32-key tiles, Q read from shared memory
    (BF16, 4, 16, 80, 1, True, "NHD"),  # a group of 80 heads: two chunks of 64 and 16 rows
    (F16, 4, 72, 4, 2, True, "NHD"),  # 72 = 4.5 k-steps
    (F16, 4, 64, 4, 2, True, "offset"),  # rows off 16-byte alignment: element copies
    (BF16, 5, 13, 4, 2, True, "NHD"),  # a page of 5 tokens, head dim 13
    (F16, 8, 512, 4, 1, False, "HND"),  # head dim 512: two blocks split the output dims
    (BF16, 20, 40, 4, 4, True, "NHD"),  # pages of 20 tokens
]


@pytest.mark.parametrize("tokens", [None, 3])
@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: "-".join(str(x).replace("torch.", "") for x in c)
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_extend_matches_reference(backend, case, tokens):
    """Default tiles, and 3-token query tiles (a chunk spans several tiles; causal tiles past the
    tile's last query are skipped)."""
    dtype, page_size, head_dim, num_heads, num_kv_heads, causal, layout = case
    q_lens, prefixes = chunks_and_prefixes(page_size)
    e = on(
        backend,
        Extend.random(
            q_lens,
            prefixes,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            page_size=page_size,
            dtype=dtype,
            layout="NHD" if layout == "offset" else layout,
            seed=page_size + head_dim,
        ),
    )
    if layout == "offset":
        e = Extend(e.q, e.cu, offset_pools(e.pages))
    group = num_heads // num_kv_heads
    if tokens is not None and tokens * min(group, 64) > 64:
        pytest.skip("the group fills a tile with one token")
    plan = {}
    out, lse, report = launch(backend, e, causal=causal, tokens=tokens, plan=plan)
    ref, ref_lse, ref_report = e.reference(causal=causal, compute_dtype=torch.float64)
    assert torch.isfinite(out).all(), (
        "NaN in the output: a poisoned slot was read or a row not written"
    )
    torch.testing.assert_close(out.cpu().double(), ref.cpu(), **tolerance(dtype))
    torch.testing.assert_close(lse.cpu().double(), ref_lse.cpu(), **LSE_TOL)
    assert_reports_equal(report, ref_report)
    assert int(report.violations.sum()) == 0 and int(report.pages_checked.sum()) > 0
    assert plan["heads_per_tile"] == min(group, 64) and plan["num_chunks"] == -(-group // 64)
    if tokens == 3:
        assert plan["tokens_per_tile"] == 3 and max(q_lens) > 3  # the longest chunk spans tiles
    assert plan["num_slots"] == -(-sum(q_lens) // plan["tokens_per_tile"]) + len(q_lens)
    assert plan["tokens_per_tile"] * plan["heads_per_tile"] <= 64
    assert plan["vec"] == (0 if layout == "offset" or head_dim % 8 else 1)
    assert plan["d_split"] == (2 if head_dim > 256 else 1)


def offset_pools(pages):
    """The pools moved one element off 16-byte alignment (forces element copies)."""
    for name in ("k_cache", "v_cache"):
        pool = getattr(pages, name)
        flat = torch.full((pool.numel() + 1,), float("nan"), dtype=pool.dtype, device=pool.device)
        moved = flat[1:].view(pool.shape)
        moved.copy_(pool)
        setattr(pages, name, moved)
    return pages


def test_matrix_covers_the_contract():
    dtypes, pages, dims, groups, causal = (
        set(x) for x in zip(*[(c[0], c[1], c[2], c[3] // c[4], c[5]) for c in CASES])
    )
    assert (
        dtypes == {F16, BF16}
        and pages >= {1, 4, 5, 8, 16, 20}
        and dims >= {13, 16, 64, 72, 80, 128, 256, 512}
    )
    assert groups >= {1, 4, 80} and causal == {True, False}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [F16, BF16])
def test_all_valid_checked_equals_unchecked(backend, dtype):
    """With every page valid the check changes no bit (same kernel source, check compiled out)."""
    q_lens, prefixes = chunks_and_prefixes(4)
    e = on(
        backend,
        Extend.random(
            q_lens,
            prefixes,
            num_heads=4,
            num_kv_heads=1,
            head_dim=64,
            page_size=4,
            dtype=dtype,
            seed=5,
        ),
    )
    checked, lse, report = launch(backend, e, tokens=2)
    unchecked, unchecked_lse, none = launch(backend, e, check=False, tokens=2)
    assert none is None and int(report.violations.sum()) == 0
    assert torch.equal(checked, unchecked) and torch.equal(lse, unchecked_lse)


SCENARIOS = ["none", "foreign", "reserved", "free", "unwritten", "out_of_range", "negative"]


@pytest.mark.parametrize("tokens", [None, 2])
@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_prefix_page_scenarios(backend, scenario, tokens):
    """A refused prefix page (NaN inside) is masked for every query row of every tile and counted
    once; the other sequence is untouched. "none" is the clean twin."""
    e = Extend.random([6, 3], [9, 5], num_heads=4, num_kv_heads=2, head_dim=16, page_size=4, seed=7)
    reason, allowed = corrupt(e, scenario)
    e = on(backend, e)
    out, lse, report = launch(backend, e, tokens=tokens)
    assert_prefix_scenario(e, out, lse, report, reason, allowed)


@pytest.mark.parametrize("scenario", ["foreign", "free", "reserved"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_prefix_scenario_is_real_unchecked(backend, scenario):
    """Twin of the scenario test: unchecked, the same kernel reads the refused page's NaN."""
    e = Extend.random([6, 3], [9, 5], num_heads=4, num_kv_heads=2, head_dim=16, page_size=4, seed=7)
    corrupt(e, scenario)
    out, _, _ = launch(backend, on(backend, e), check=False, tokens=2)
    assert torch.isnan(out[:6]).any() and torch.isfinite(out[6:]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_malformed_lengths_fail_closed(backend):
    """Unvalidated: more queries than tokens reads nothing (0, lse -inf) while its pages are still
    reported; a seq_len past the table counts one OUT_OF_RANGE; all-foreign pages give 0, -inf."""
    e = Extend.random(
        [5, 2, 2], [1, 4, 3], num_heads=2, num_kv_heads=1, head_dim=16, page_size=4, seed=13
    )
    p = e.pages
    p.seq_lens[0] = 4  # 5 queries, 4 tokens
    p.seq_lens[1] = 6 + 4 * p.block_table.shape[1]
    p.expected[2] = 99
    e = on(backend, e)
    out, lse, report = launch(backend, e, tokens=2, validate=False)
    ref, ref_lse, ref_report = e.reference()
    assert torch.equal(out[:5].cpu(), torch.zeros(5, 2, 16, dtype=out.dtype))
    assert torch.equal(out[7:].cpu(), torch.zeros(2, 2, 16, dtype=out.dtype))
    assert (lse[:5] == float("-inf")).all() and (lse[7:] == float("-inf")).all()
    torch.testing.assert_close(out[5:7].double().cpu(), ref[5:7].double().cpu(), **tolerance(F16))
    torch.testing.assert_close(lse.cpu(), ref_lse.cpu(), **LSE_TOL)
    assert_reports_equal(report, ref_report)
    assert report.pages_checked[0] == 1 and report.beyond_table.tolist() == [0, 1, 0]
    assert report.violations[2] == report.pages_checked[2] > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_clamped_offsets_leave_uncovered_rows_unwritten(backend):
    """cu_seqlens_q ending short of total_q (unvalidated): the offsets are clamped as in the Triton
    launcher, the covered rows match the reference, the rest stay as they were (NaN here)."""
    e = Extend.random([3, 2], [2, 5], num_heads=2, num_kv_heads=1, head_dim=16, page_size=4, seed=3)
    e.cu[2] = 4  # total_q is 5: row 4 belongs to no sequence; sequence 1 now has 1 query
    e = on(backend, e)
    out, lse, report = launch(backend, e, validate=False)
    ref, ref_lse, ref_report = e.reference()
    torch.testing.assert_close(out[:4].double().cpu(), ref[:4].double().cpu(), **tolerance(F16))
    torch.testing.assert_close(lse[:4].cpu(), ref_lse[:4].cpu(), **LSE_TOL)
    assert torch.isnan(out[4]).all() and torch.isnan(lse[4]).all()
    assert_reports_equal(report, ref_report)


@pytest.mark.parametrize("backend", BACKENDS)
def test_public_api_and_registry(backend):
    """paged_extend(backend=...) runs this kernel; why_not accepts extend arguments."""
    e = on(
        backend,
        Extend.random(
            [4, 1],
            [3, 6],
            num_heads=4,
            num_kv_heads=1,
            head_dim=32,
            page_size=4,
            dtype=BF16,
            seed=2,
        ),
    )
    args = kvattn.layout.validate_extend(*e.inputs())
    assert backends.explain(args, op="extend")[backend] is None
    assert backends.select(args, backend, op="extend").NAME == backend
    out, lse, report = e.run(backend, return_lse=True)
    ref, ref_lse, ref_report = e.reference()
    torch.testing.assert_close(out.cpu().float(), ref.cpu(), **tolerance(BF16))
    assert_reports_equal(report, ref_report)


def test_launcher_refuses_tiles_too_large():
    e = Extend.random([2], [3], num_heads=8, num_kv_heads=1, head_dim=128, page_size=4)
    with pytest.raises(ValueError, match="tokens_per_tile"):
        launch("cuda_sim", e, tokens=9)  # 9 tokens x 8 heads > 64 rows


def test_float32_runs_on_triton_not_cuda():
    """The CUDA kernels are fp16/bf16 tensor-core kernels; the registry says so for fp32."""
    e = Extend.random([2], [3], num_heads=2, num_kv_heads=1, head_dim=64, page_size=4, dtype=F32)
    args = kvattn.layout.validate_extend(*e.inputs())
    reason = backends.explain(args, op="extend")["cuda_sim"]
    assert reason is not None and "float32" in reason and "triton" in reason


def nvcc_present() -> bool:
    import shutil

    return shutil.which("nvcc") is not None or pathlib.Path("/usr/local/cuda/bin/nvcc").exists()


@pytest.mark.skipif(not nvcc_present(), reason="no nvcc: the CUDA module is not built here")
def test_ptxas_extend_kernels_have_no_local_memory():
    """Every extend instantiation the build selected is in setup.py's -Xptxas -v log once per
    architecture, unspilled."""
    spec = importlib.util.spec_from_file_location("ptxas_report", ROOT / "csrc" / "ptxas_report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    log = ptxas_log()
    records = [r for r in report.check(log) if "paged_extend_kernel" in r["kernel"]]
    assert {(r["kernel"], r["arch"]) for r in records} == built_cuda_kernels("paged_extend_kernel")
    assert all(
        0 < r["registers"] <= 255 and not r["spill_stores"] and not r["stack_frame"]
        for r in records
    )
