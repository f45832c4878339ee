"""Static sm_90 evidence of every attention kernel, both variants, compiled without a GPU
(tools/static_sm90.py: Triton through its real launchers under a stand-in sm_90 driver, CUDA from the
nvcc build's cubins). These are structure, not speed: spills, the K/V buffer count and pipelining of
checked against unchecked, main-loop instruction counts, 16-byte async K/V loads, tensor cores.

The figures come from the Triton the H200 image has (3.6.0, installed by `make static-env` into
build/venv-triton36); the committed table benchmarks/results/static_sm90.md must equal a fresh one
(`make static` rewrites it)."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from kvattn_testing.build import cuda_build_record, instantiations

# One worker takes the module (`--dist loadgroup`): its fixture compiles every kernel for sm_90
# (minutes), once per worker that runs one of its tests.
pytestmark = [pytest.mark.host_only, pytest.mark.xdist_group("static_sm90")]

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "static_sm90.py"
VENV_PY = ROOT / "build" / "venv-triton36" / "bin" / "python"
COMMITTED = ROOT / "benchmarks" / "results" / "static_sm90.md"
GPU_TRITON = "3.6.0"
# Checked/unchecked main-loop instructions of decode at page 16.
DECODE_RATIO_MAX = 1.10
# The most of the slots' time a goal shape's decode grid may leave idle in its last wave
# (kvattn.backends.grids.grid_waves).
DECODE_TAIL_MAX = 0.10
GOAL_SHAPES = {(b, c) for b in (1, 16, 64) for c in (4096, 8192, 16384, 32768)}
# The same over fp8 pools: the check's instructions are those of the 16-bit kernel (41-47 per
# loop at d64), but the unchecked loop is shorter (fp16 queries convert fp8 in one instruction),
# so the ratio of the smallest CUDA instantiation (d64, 427 -> 474) sits just above 1.10.
FP8_DECODE_RATIO_MAX = 1.12
# Through a verdict (docs/ownership.md section 9): main-loop instructions over unchecked, and the
# modelled cost of a layer's call with its share of the step's resolve.
VERDICT_RATIO_MAX = 1.02
VERDICT_MODEL_MAX = 0.03
# The extend's main loop at the goal config (Triton's and CUDA's), as a share of the bf16
# tensor-core rate when issuing is all that limits it (tools/static_sm90.py extend_estimates).
EXTEND_SHARE_MIN = 0.5
# The keyed transfer digest's modelled bandwidth, as a share of the HBM's.
DIGEST_SHARE_MIN = 0.5


@pytest.fixture(scope="module")
def static(tmp_path_factory):
    out = tmp_path_factory.mktemp("static")
    python = str(VENV_PY) if VENV_PY.exists() else sys.executable
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    run = subprocess.run(
        [python, str(TOOL), "--json", str(out / "s.json"), "--markdown", str(out / "s.md")],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads((out / "s.json").read_text())
    return data, (out / "s.md").read_text()


def pairs(records, backend):
    """{(kernel, config): {False: unchecked, True: checked}} of the attention kernels."""
    by = {}
    for r in records:
        if r["backend"] == backend and r["kernel"].startswith("paged_"):
            by.setdefault((r["kernel"], r["config"]), {})[r["check"]] = r
    return by


def backends_of(records):
    return {r["backend"] for r in records}


def test_no_kernel_spills(static):
    records = static[0]["records"]
    assert len(records) >= 30
    for r in records:
        assert r["local"] == 0, f"local memory (spills or stack): {r}"


@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_checked_and_unchecked_pipeline_alike(static, backend):
    """Same K/V buffers, same async copies and tensor-core instructions per main-loop iteration: the
    only difference between the variants is the check."""
    records = static[0]["records"]
    if backend not in backends_of(records):
        pytest.skip("no CUDA module (nvcc absent): kvattn/backends/cuda/_C*.so")
    found = pairs(records, backend)
    assert found
    for key, pair in found.items():
        u, c = pair[False], pair[True]
        # Triton 3.6 does not multi-buffer the extend's fp8 tiles (converted before the wgmma):
        # one buffer in both variants, a known cost of that configuration, not of the check.
        least = 1 if "fp8" in key[1] and key[0] == "paged_extend_kernel" else 2
        assert c["kv_buffers"] == u["kv_buffers"] and u["kv_buffers"] >= least, (key, u, c)
        for field in ("loop_ldgsts_128", "loop_mma", "shared"):
            if backend == "triton" and field == "shared":
                continue  # Triton's report and table buffers: a few hundred bytes, below
            assert c[field] == u[field], (key, field, u[field], c[field])
        if backend == "triton":
            assert c["shared"] - u["shared"] <= 1024, (key, u["shared"], c["shared"])


@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_kv_loads_are_16_byte_async_copies(static, backend):
    records = static[0]["records"]
    if backend not in backends_of(records):
        pytest.skip("no CUDA module (nvcc absent)")
    found = pairs(records, backend)
    # CUDA's element-wise variants serve pools whose rows are not 16-byte aligned, by design.
    vectorised = {key: pair for key, pair in found.items() if "elementwise" not in key[1]}
    assert vectorised and (backend == "triton" or len(vectorised) < len(found))
    for (kernel, config), pair in vectorised.items():
        for r in pair.values():
            assert r["loop_ldgsts_128"] > 0 or r["loop_ldg_128"] > 0, (kernel, config, r)


@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_extend_runs_on_tensor_cores(static, backend):
    records = static[0]["records"]
    if backend not in backends_of(records):
        pytest.skip("no CUDA module (nvcc absent)")
    extend = [
        r for r in records if r["backend"] == backend and r["kernel"] == "paged_extend_kernel"
    ]
    assert extend and {r["check"] for r in extend} == {True, False}
    for r in extend:
        assert r["loop_mma"] > 0, r
        if backend == "triton" and "fp32" not in r["config"]:
            assert r["loop_hgmma"] > 0, r  # wgmma, Hopper's warpgroup matrix instruction


def test_checked_decode_loop_within_ten_percent_at_page_16(static, capsys):
    records = static[0]["records"]
    ratios = {}
    for (kernel, config), pair in pairs(records, "triton").items():
        if kernel == "paged_decode_kernel" and " p16 " in config:
            ratios[config] = pair[True]["loop_sass"] / pair[False]["loop_sass"]
    for (kernel, config), pair in pairs(records, "cuda").items():
        if kernel == "paged_decode_kernel" and "elementwise" not in config:  # every page size
            ratios["cuda " + config] = pair[True]["loop_sass"] / pair[False]["loop_sass"]
    extend = {
        c: p[True]["loop_sass"] / p[False]["loop_sass"]
        for b in ("triton", "cuda")
        for (k, c), p in pairs(records, b).items()
        if k == "paged_extend_kernel"
    }
    with capsys.disabled():
        print(
            "\ndecode checked/unchecked main-loop instructions:",
            ", ".join(f"{c}: {r:.3f}" for c, r in sorted(ratios.items())),
        )
        print(
            "extend checked/unchecked main-loop instructions:",
            ", ".join(f"{c}: {r:.3f}" for c, r in sorted(extend.items())),
        )
    assert ratios
    for config, ratio in ratios.items():
        assert ratio <= (FP8_DECODE_RATIO_MAX if "fp8" in config else DECODE_RATIO_MAX), (
            config,
            ratio,
        )


@pytest.mark.parametrize(
    "backend, config",
    [("triton", "decode bf16 d128 p16 gqa4"), ("cuda", "decode bf16 d128 16B")],
)
def test_the_decode_through_a_verdict_loops_as_unchecked(static, backend, config):
    """docs/ownership.md section 9: through a verdict the main loop loads one entry per tile (per
    token on CUDA), as the unchecked one loads its table entry: within VERDICT_RATIO_MAX of its
    instructions, with as many resident programs; the resolve's kernels spill nothing
    (test_no_kernel_spills)."""
    records = static[0]["records"]
    if backend not in backends_of(records):
        pytest.skip("no CUDA module (nvcc absent): kvattn/backends/cuda/_C*.so")
    pair = pairs(records, backend)[("paged_decode_kernel", f"{config} verdict")]
    assert pair[True]["loop_sass"] / pair[False]["loop_sass"] <= VERDICT_RATIO_MAX, pair
    assert pair[True]["loop_ldg"] == pair[False]["loop_ldg"], pair
    assert pair[True]["resident_per_sm"] == pair[False]["resident_per_sm"], pair
    if backend == "triton":
        kernels = {r["kernel"] for r in records if r["config"].endswith(" verdict")}
        assert {"resolve_verdict_kernel", "verdict_report_kernel"} <= kernels


@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_the_verdict_is_modelled_within_three_percent_at_every_goal_shape(static, backend):
    """The decode grids' model with the step's one resolve shared by its layers: at most
    VERDICT_MODEL_MAX over unchecked at every goal shape (the per-call check is modelled at +17%
    at batch 1, 4-8K)."""
    if backend not in backends_of(static[0]["records"]):
        pytest.skip("no CUDA module (nvcc absent): kvattn/backends/cuda/_C*.so")
    rows = [r for r in static[0]["decode_grids"] if r["backend"] == backend]
    assert {(r["batch"], r["context"]) for r in rows} == GOAL_SHAPES
    for r in rows:
        assert r["modelled_verdict_cost_with_resolve"] <= VERDICT_MODEL_MAX, r
        assert r["modelled_verdict_cost"] <= r["modelled_verdict_cost_with_resolve"], r


def test_extend_estimates_count_the_tensor_cores_work(static):
    """Every extend kernel has its issue-bound estimate, from the FLOPs of its loop's tensor-core
    instructions: at the goal shape a 64-key tile over 128 dims is 64 x 64 x 128 x 2 x 2 FLOPs a
    block (CUDA: 4 warps; Triton: 128 rows on 8 warps, twice the work), and both loops reach
    EXTEND_SHARE_MIN of the rate by that ceiling, checked and unchecked."""
    rows = {(r["backend"], r["config"], r["check"]): r for r in static[0]["extend_estimates"]}
    extend = {
        (r["backend"], r["config"], r["check"])
        for r in static[0]["records"]
        if r["kernel"] == "paged_extend_kernel"
    }
    assert extend and extend <= set(rows)
    goal = [rows[("triton", "extend bf16 d128 p16 gqa4", c)] for c in (False, True)]
    assert all(r["loop_mma_flops"] * 8 == 128 * 64 * 128 * 2 * 2 for r in goal), goal
    assert all(r["tensor_core_share"] >= EXTEND_SHARE_MIN for r in goal), goal
    if "cuda" in backends_of(static[0]["records"]):
        cuda = [rows[("cuda", "extend bf16 d128 16B", c)] for c in (False, True)]
        assert all(r["loop_mma_flops"] * 4 == 64 * 64 * 128 * 2 * 2 for r in cuda), cuda
        assert all(r["tensor_core_share"] >= EXTEND_SHARE_MIN for r in cuda), cuda


def test_the_keyed_digest_is_modelled_past_half_the_hbm_bandwidth(static):
    """kvattn.backends.triton.digest: 128-bit loads, and a model (tools/static_sm90.py
    `digest_model`) of at least DIGEST_SHARE_MIN of an H200's HBM bandwidth (SGLang's own
    full-page digest: 650-710 GB/s, about 14%)."""
    model = static[0]["digest_model"]
    record = next(r for r in static[0]["records"] if r["kernel"] == "nh_kernel")
    assert record["all_ldg_128"] > 0, record
    assert model["share_of_hbm"] >= DIGEST_SHARE_MIN, model


def test_committed_table_is_current(static):
    data, table = static
    if GPU_TRITON not in data["header"]:
        pytest.skip(
            f"figures from another Triton than the GPU image's {GPU_TRITON}: {data['header']}"
        )
    if "absent" in data["header"]:
        pytest.skip("no CUDA module (nvcc absent)")
    if "a subset" in data["header"]:
        pytest.skip(
            f"the CUDA module holds a subset of csrc/instantiations.py, the committed table all of "
            f"it: {data['header']}"
        )
    assert COMMITTED.exists(), "run `make static`"
    assert COMMITTED.read_text() == table, (
        "benchmarks/results/static_sm90.md is stale: run `make static`"
    )


def test_cuda_kernels_are_the_tables_rows(static):
    """The cubins of the CUDA module hold each instantiation of its build's selection of
    csrc/instantiations.py once (tools/static_sm90.py names them by the table and refuses a kernel
    it does not list or finds twice)."""
    records = [r for r in static[0]["records"] if r["backend"] == "cuda"]
    if not records:
        pytest.skip("no CUDA module (nvcc absent)")
    # (a verdict row's unchecked twin is the plain unchecked kernel's record, repeated)
    records = [r for r in records if r["check"] or not r["config"].endswith(" verdict")]
    table, record = instantiations(), cuda_build_record()
    selection = table.Selection(
        **{
            k: tuple(v) if isinstance(v, list) else v
            for k, v in record.get("selection", {}).items()
            if k in ("dtypes", "head_dims", "variants")
        }
    )
    rows = table.select(selection)
    assert (
        len({(r["kernel"], r["config"], r["check"]) for r in records}) == len(records) == len(rows)
    )
    assert sorted((r["kernel"], r["check"]) for r in records) == sorted(
        (row.kernel, bool(row.check)) for row in rows
    )


@pytest.mark.parametrize("kernel", ["paged_mla_decode_kernel", "paged_mla_extend_kernel"])
def test_mla_on_tensor_cores_with_cheap_check_at_page_64(static, kernel):
    """The MLA kernels' products run on tensor cores (16-bit latents) and, at FlashMLA's page of 64
    (one scalar tag test or table entry per tile), the check adds at most DECODE_RATIO_MAX to the
    main loop."""
    found = {c: p for (k, c), p in pairs(static[0]["records"], "triton").items() if k == kernel}
    assert any(" p64 " in c for c in found) and any(" p1 " in c for c in found)
    for config, pair in found.items():
        for r in pair.values():
            assert ("fp32" in config) == (r["loop_mma"] == 0), (config, r)
        if " p64 " in config:
            assert pair[True]["loop_sass"] / pair[False]["loop_sass"] <= DECODE_RATIO_MAX, config


def test_docs_static_summary_matches_committed_table():
    """docs/kernels.md's summary rows quote the committed table (by config), so they cannot go
    stale."""
    records = json.loads(COMMITTED.with_suffix(".json").read_text())["records"]
    loops = {}
    for r in records:
        if r["kernel"].startswith("paged_"):
            loops.setdefault((r["backend"], r["config"]), {})[r["check"]] = r["loop_sass"]
    summary = (ROOT / "docs" / "kernels.md").read_text()
    rows = re.findall(
        r"^\| (Triton|CUDA|MLA) [^|]*\| `([^`]+)` \| (\d+) \| (\d+) \| ([\d.]+) \|$", summary, re.M
    )
    assert len(rows) >= 4
    for name, config, unchecked, checked, ratio in rows:
        pair = loops[("cuda" if name == "CUDA" else "triton", config)]
        assert (int(unchecked), int(checked)) == (pair[False], pair[True]), (config, pair)
        assert float(ratio) == round(pair[True] / pair[False], 3), config


def test_split_planners_never_assume_more_resident_programs_than_compiled(static):
    """Each decode kernel's grid is fitted to ``planned_per_sm`` programs per SM: more than its
    registers and shared memory allow, and a grid meant as one wave spills into a second."""
    planned = [r for r in static[0]["records"] if "planned_per_sm" in r]
    assert {r["backend"] for r in planned} == backends_of(static[0]["records"])
    for r in planned:
        assert r["planned_per_sm"] <= r["resident_per_sm"], r


@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_decode_grids_fill_the_goal_shapes_once(static, backend):
    """At every goal shape the planner's grid fits the resident slots (or leaves at most
    DECODE_TAIL_MAX of a last wave idle), and a grid of one wave is at least half full unless the
    table has no more splits to give."""
    rows = [r for r in static[0]["decode_grids"] if r["backend"] == backend]
    if not rows and backend not in backends_of(static[0]["records"]):
        pytest.skip("no CUDA object (nvcc absent)")
    assert {(r["batch"], r["context"]) for r in rows} == GOAL_SHAPES
    for r in rows:
        assert r["planned_per_sm"] <= r["resident_per_sm"], r
        # 8 KV heads of one chunk of 4 query heads; Triton: and the report's program (checked)
        per_split = 9 if backend == "triton" else 8
        assert r["programs"] == r["splits"] * r["batch"] * per_split, r
        assert r["tail"] <= DECODE_TAIL_MAX, r
        assert r["waves"] > 0.5 or r["splits"] == r["most_splits"], r


def test_triton_extend_is_one_launch_and_the_check_one_more(static):
    """The tile map is found by each program (no host-side torch ops); the checked call adds only
    the page pre-pass."""
    rows = static[0]["extend_launches"]
    assert rows and {r["check"] for r in rows} == {False, True}
    for r in rows:
        assert r["torch_ops"] == 0, r
        assert r["kernels"] == (["resolve_pages_kernel"] if r["check"] else []) + [
            "paged_extend_kernel"
        ], r
