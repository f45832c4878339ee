"""The benchmark harnesses (decode, extend and MLA decode) end to end on tiny CPU points: they check every
provider before timing it, refuse a wrong one, and write their files labelled as not a GPU
measurement."""

import csv
import dataclasses
import importlib.util
import json

import pytest
import torch

from benchmarks import decode, extend, mla, providers
from benchmarks.common import Device, ExtendPoint, MLAPoint, Point, TimingConfig

TINY = Point(
    batch=1, context=40, page_size=16, num_heads=4, num_kv_heads=2, head_dim=32, dtype="fp16"
)
# Two pages per sequence, the last one partly read; the prefix ends inside the first page.
TINY_EXTEND = ExtendPoint(
    batch=2,
    chunk=8,
    prefix=12,
    page_size=16,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    dtype="fp16",
)
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path of the harness")


def _cpu() -> Device:
    return Device("CPU test", "cpu", False, 8 << 20, 0, 1)


@CPU_ONLY
def test_run_point_times_checked_providers_and_pairs_the_ratio():
    chosen = providers.select(
        ["kvattn-triton-checked", "kvattn-triton-unchecked", "torch-sdpa-gather"]
    )
    rows = decode.run_point(
        TINY,
        chosen,
        _cpu(),
        TimingConfig(cpu_runs=1, repeats=2, graphs=False),
        copy_tbps=1.0,
        log=print,
    )
    ok = {r["provider"]: r for r in rows if r["status"] == "ok"}
    assert set(ok) == {p.name for p in chosen}
    for r in ok.values():
        assert r["max_abs_err"] <= 1e-2 and r["median_ms"] > 0 and len(r["times_ms"]) == 2
    checked, unchecked = ok["kvattn-triton-checked"], ok["kvattn-triton-unchecked"]
    assert (
        checked["total_bytes"] - unchecked["total_bytes"] == 8 * 3 + 8 + 3 + 16
    )  # tags, expected, report
    assert checked["ratio_min"] <= checked["ratio_vs_unchecked"] <= checked["ratio_max"]


@CPU_ONLY
@pytest.mark.parametrize(
    "point",
    [
        dataclasses.replace(TINY, variant=v)
        for v in decode.VARIANTS
        if v != "plain" and not v.startswith("window")  # a window: in the cpu-tiny sweep
    ]
    + [dataclasses.replace(TINY, head_dim_v=16)],
    ids=lambda p: p.variant if p.variant != "plain" else "head_dim_v",
)
def test_every_decode_variant_point_runs_checked_and_unchecked(point):
    """The variant points the GPU suite's decode sweep times (decode.variant_points), at the tiny
    shape: each provider that takes the variant passes its check against the reference before it
    is timed (a variant's set-up broken here would only show on the GPU machine)."""
    chosen = providers.select(["kvattn-triton-checked", "kvattn-triton-unchecked"])
    rows = decode.run_point(
        point,
        chosen,
        _cpu(),
        TimingConfig(cpu_runs=1, repeats=1, graphs=False),
        copy_tbps=1.0,
        log=print,
    )
    assert {r["provider"]: r["status"] for r in rows} == {p.name: "ok" for p in chosen}, rows


@CPU_ONLY
@pytest.mark.parametrize(
    "bench, point", [(decode, TINY), (extend, TINY_EXTEND)], ids=["decode", "extend"]
)
def test_run_point_refuses_a_provider_with_wrong_output(bench, point):
    def build(inp):
        out = torch.empty_like(inp.q)

        def run(i):
            out.copy_(inp.q)  # finite, right shape, wrong values
            return out, None

        return run, out

    wrong = providers.Provider("wrong", "wrong", False, lambda inp: None, build)
    rows = bench.run_point(
        point,
        [wrong],
        _cpu(),
        TimingConfig(cpu_runs=1, repeats=1, graphs=False),
        copy_tbps=1.0,
        log=print,
    )
    assert len(rows) == 1
    assert rows[0]["status"].startswith("failed: AssertionError") and "median_ms" not in rows[0]


def _quick_run(tmp_path, monkeypatch, bench, point, table: str, plots: set[str]):
    """Runs ``bench``'s command line on ``point`` alone with the reference and SDPA, checks what
    every run writes (labelled as not a GPU measurement) and returns the run folder and its meta."""
    monkeypatch.setattr(bench, "preset_points", lambda name: [point])
    chosen = ["kvattn-reference", "torch-sdpa-gather"]
    assert bench.main(["--quick", "--out-dir", str(tmp_path), "--providers", *chosen]) == 0
    (run_dir,) = tmp_path.iterdir()
    assert run_dir.name.split("_")[1] == "cpu"
    names = {p.name for p in run_dir.iterdir()}
    assert {f"{table}.csv", "run.json", "summary.md", "log.txt"} <= names
    summary = (run_dir / "summary.md").read_text()
    assert "NOT a GPU measurement" in summary and "| kvattn-reference | cpu |" in summary
    with (run_dir / f"{table}.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert rows and all(r["measurement"].startswith("NOT a GPU measurement") for r in rows)
    assert {r["provider"] for r in rows if r["status"] == "ok"} == set(chosen)
    meta = json.loads((run_dir / "run.json").read_text())["meta"]
    assert meta["gpu_measurement"] is False
    if importlib.util.find_spec("matplotlib") is not None:
        assert plots <= names
    return run_dir, meta


@CPU_ONLY
def test_quick_run_writes_labelled_files(tmp_path, monkeypatch):
    run_dir, meta = _quick_run(
        tmp_path, monkeypatch, decode, TINY, "decode", {"overhead.png", "bandwidth.png"}
    )
    with (run_dir / "writer.csv").open() as f:
        writer = [r for r in csv.DictReader(f) if r["status"] == "ok"]
    assert {r["provider"] for r in writer} == {"kvattn-write_kv", "index_put"}
    assert meta["copy_bandwidth_start"]["tbps"] > 0


@CPU_ONLY
def test_extend_run_point_times_checked_providers_and_pairs_the_ratio():
    chosen = providers.select(
        [
            "kvattn-triton-checked",
            "kvattn-triton-unchecked",
            "kvattn-cuda-checked",
            "torch-sdpa-gather",
        ],
        op="extend",
    )
    rows = extend.run_point(
        TINY_EXTEND,
        chosen,
        _cpu(),
        TimingConfig(cpu_runs=1, repeats=2, graphs=False),
        copy_tbps=1.0,
        log=print,
    )
    ok = {r["provider"]: r for r in rows if r["status"] == "ok"}
    assert set(ok) == {"kvattn-triton-checked", "kvattn-triton-unchecked", "torch-sdpa-gather"}
    (cuda,) = [r for r in rows if r["provider"] == "kvattn-cuda-checked"]
    assert cuda["status"].startswith("skipped:") and "median_ms" not in cuda
    pairs = 8 * 12 + 8 * 9 // 2  # each of the 8 rows meets the prefix and the rows up to itself
    for r in ok.values():
        assert r["max_abs_err"] <= 1e-2 and len(r["times_ms"]) == 2 and r["rows_checked"] == 16
        assert r["flops"] == 4 * 2 * 4 * 32 * pairs and r["tflops"] > 0
    checked, unchecked = ok["kvattn-triton-checked"], ok["kvattn-triton-unchecked"]
    assert checked["total_bytes"] - unchecked["total_bytes"] == 8 * 4 + 8 * 2 + 4 + 16 * 2
    assert (
        unchecked["other_bytes"] == 2 * 16 * 4 * 32 * 2 + 4 * 4 + 2 * 4 + 3 * 4
    )  # q/o, table, lens, cu
    assert checked["ratio_min"] <= checked["ratio_vs_unchecked"] <= checked["ratio_max"]


@CPU_ONLY
def test_extend_quick_run_writes_labelled_files(tmp_path, monkeypatch):
    run_dir, meta = _quick_run(
        tmp_path,
        monkeypatch,
        extend,
        TINY_EXTEND,
        "extend",
        {"extend_overhead.png", "extend_tflops.png"},
    )
    assert run_dir.name.endswith("_extend") and meta["op"] == "extend"


TINY_MLA = MLAPoint(
    batch=2, context=40, page_size=16, num_heads=4, kv_lora_rank=32, rope_dim=16, dtype="fp16"
)


@CPU_ONLY
def test_mla_run_point_times_checked_providers_and_pairs_the_ratio():
    chosen = providers.select(
        ["kvattn-triton-checked", "kvattn-triton-unchecked", "torch-sdpa-gather"], op="mla_decode"
    )
    rows = mla.run_point(
        TINY_MLA,
        chosen,
        _cpu(),
        TimingConfig(cpu_runs=1, repeats=2, graphs=False),
        copy_tbps=1.0,
        log=print,
    )
    ok = {r["provider"]: r for r in rows if r["status"] == "ok"}
    assert set(ok) == {p.name for p in chosen}
    for r in ok.values():
        assert r["max_abs_err"] <= 1e-2 and r["median_ms"] > 0 and len(r["times_ms"]) == 2
    checked, unchecked = ok["kvattn-triton-checked"], ok["kvattn-triton-unchecked"]
    # One latent row per token read once; q of 48 dims read, o of 32 written per head.
    assert (
        unchecked["kv_bytes"] == 2 * 40 * 48 * 2
        and unchecked["other_bytes"] == 2 * 4 * 80 * 2 + 6 * 4 + 2 * 4
    )
    assert checked["total_bytes"] - unchecked["total_bytes"] == 8 * 6 + 8 * 2 + 6 + 16 * 2
    assert checked["ratio_min"] <= checked["ratio_vs_unchecked"] <= checked["ratio_max"]


TINY_MLA_EXTEND = dataclasses.replace(TINY_MLA, q_len=3)


@CPU_ONLY
def test_mla_extend_point_runs_the_extend_and_skips_the_decode_only_peer():
    """A point with 3 query rows per sequence times kvattn's MLA extend (checked against the
    extend reference row by row) and refuses SDPA-over-gathered-rows, which is decode only."""
    chosen = providers.select(
        ["kvattn-triton-checked", "kvattn-triton-unchecked", "torch-sdpa-gather"], op="mla_decode"
    )
    rows = mla.run_point(
        TINY_MLA_EXTEND,
        chosen,
        _cpu(),
        TimingConfig(cpu_runs=1, repeats=1, graphs=False),
        copy_tbps=1.0,
        log=print,
    )
    status = {r["provider"]: r["status"] for r in rows}
    assert status["kvattn-triton-checked"] == status["kvattn-triton-unchecked"] == "ok"
    assert "decode points only" in status["torch-sdpa-gather"]
    unchecked = next(r for r in rows if r["provider"] == "kvattn-triton-unchecked")
    assert unchecked["other_bytes"] == 2 * 3 * 4 * 80 * 2 + 6 * 4 + 2 * 4  # q and o of every row


@CPU_ONLY
def test_mla_extend_point_refuses_rows_from_the_wrong_positions():
    """The twin: decode's answer (every row reading the whole sequence) is not the extend's."""

    def build(inp):
        out = inp.q.new_empty(*inp.q.shape[:2], 32)

        def run(i):
            full, report = inp.call(i, causal=False, backend="reference")
            out.copy_(full)
            return out, report

        return run, out

    wrong = providers.Provider("wrong", "wrong", True, lambda inp: None, build)
    rows = mla.run_point(
        TINY_MLA_EXTEND,
        [wrong],
        _cpu(),
        TimingConfig(cpu_runs=1, repeats=1, graphs=False),
        copy_tbps=1.0,
        log=print,
    )
    assert len(rows) == 1 and rows[0]["status"].startswith("failed: AssertionError")


@CPU_ONLY
def test_mla_run_point_refuses_a_provider_with_wrong_output():
    def build(inp):
        out = inp.q.new_empty(2, 4, 32)

        def run(i):
            out.copy_(inp.q[..., :32])  # finite, right shape, wrong values
            return out, None

        return run, out

    wrong = providers.Provider("wrong", "wrong", False, lambda inp: None, build)
    rows = mla.run_point(
        TINY_MLA,
        [wrong],
        _cpu(),
        TimingConfig(cpu_runs=1, repeats=1, graphs=False),
        copy_tbps=1.0,
        log=print,
    )
    assert len(rows) == 1 and rows[0]["status"].startswith("failed: AssertionError")


@CPU_ONLY
def test_mla_quick_run_writes_labelled_files(tmp_path, monkeypatch):
    run_dir, meta = _quick_run(
        tmp_path, monkeypatch, mla, TINY_MLA, "mla", {"mla_overhead.png", "mla_bandwidth.png"}
    )
    assert run_dir.name.endswith("_mla") and meta["op"] == "mla_decode"


def test_headline_presets_hold_the_goal_points_and_the_sweeps_can_leave_them_out():
    from benchmarks.sweep import HEADLINE_PRESETS, Sweep, parse_args

    labels = [p.label() for p in decode.preset_points("headline")]
    assert labels == [
        f"B{b}_ctx{c}_p16_h32x8_d128_bf16"
        for b, c in ((16, 8192), (16, 32768), (64, 8192), (64, 32768), (1, 4096), (1, 32768))
    ]
    assert [(p.batch, p.chunk, p.prefix) for p in extend.preset_points("headline")] == [
        (1, 4096, 0),
        (1, 512, 8192),
    ]
    args = parse_args(
        "decode", "", ["--preset", "gpu-suite", "--skip-preset", "headline"], HEADLINE_PRESETS
    )
    sweep = Sweep.start(args, decode.preset_points, "decode")
    left = {p.label() for p in sweep.points}
    assert not left & set(labels) and len(left) == len(decode.preset_points("gpu-suite")) - 6


def test_tune_times_the_default_first_then_the_split_counts_that_fill_the_slots():
    from benchmarks import tune
    from kvattn.backends.triton import configs

    default = configs.decode_config(torch.device("cpu"), torch.bfloat16, 128, 16)
    units, slots = 16 * 8, default.programs_per_sm * 132  # batch 16 x 8 KV heads on an H200
    for planner in (-(-slots // units), slots // units):  # a planner that rounds up, one that fits
        candidates = tune.triton_decode_candidates(default, planner, units, slots, 32, gpu=True)
        assert candidates[0] == ("planner", default, planner)  # the default, whatever the planner
        splits = [n for _, config, n in candidates if config == default]
        assert len(splits) == len(set(splits)) and slots // units in splits
        assert units * (slots // units) <= slots < units * (slots // units + 1)  # one wave, no tail
        neighbours = [config for rule, config, n in candidates if rule == "neighbour"]
        assert neighbours and all(n is None for rule, _, n in candidates if rule == "neighbour")
        for config in neighbours:  # one field one step away
            assert (
                sum(
                    getattr(config, f) != getattr(default, f)
                    for f in ("block_n", "num_warps", "num_stages", "programs_per_sm")
                )
                == 1
            )
    assert tune.split_candidates(64, 8, None, 64) == [("planner", 64)]  # capped, no duplicates


def test_tune_shares_the_budget_by_op_then_by_point():
    from benchmarks import tune

    now = [0.0]
    shares = tune.Shares(100.0, list(tune.OPS), clock=lambda: now[0])
    assert shares.start_op("triton-decode", 3) == pytest.approx(50.0)  # weights 2 : 1 : 1
    assert shares.point_deadline() == pytest.approx(50.0 / 3)
    now[0] = 40.0  # the first point ran past its share: the others still get one
    assert shares.point_deadline() == pytest.approx(45.0)
    now[0] = 45.0
    assert shares.point_deadline() == pytest.approx(50.0)
    now[0] = 50.0
    assert shares.start_op("triton-extend", 2) == pytest.approx(75.0)
    now[0] = 60.0  # what an op leaves passes to the next
    assert shares.start_op("cuda-decode", 1) == pytest.approx(100.0)


def test_flex_times_the_first_call_apart():
    from types import SimpleNamespace

    from benchmarks import flex

    calls = []

    def build(inp):
        def run(i):
            calls.append(i)
            return inp.q, None

        return run, None

    record = {}
    prov = flex.first_call_timed(
        providers.Provider("p", "p", False, lambda inp: None, build), record
    )
    run, _ = prov.build(SimpleNamespace(q=torch.zeros(1)))
    run(0)
    first = dict(record)
    assert set(first) == {"compile_s", "dynamo_graphs", "warnings"} and first["compile_s"] >= 0
    run(1)
    assert record == first and calls == [0, 1]
    assert len(flex.preset_points("headline")) <= 2  # each shape is a compile


@CPU_ONLY
def test_the_kernels_for_nsight_compute_run(capsys):
    from benchmarks import ncu_kernels

    assert ncu_kernels.main() == 0
    ran = [line for line in capsys.readouterr().out.splitlines() if line.startswith("ran")]
    assert [line.split(": ")[1].split()[0] for line in ran] == [
        "decode-checked",
        "decode-unchecked",
        "extend-checked",
    ]


def test_transfer_digest_benchmark_writes_its_table(tmp_path):
    """The checked receive's cost script on a tiny pool: the copy, the hashes alone and kvattn's
    calls timed side by side for 1 thread and every core, labelled as CPU."""
    from benchmarks import transfer_digest

    out = tmp_path / "digest.md"
    transfer_digest.main(
        [
            "--layers",
            "2",
            "--pages",
            "3",
            "--page-size",
            "4",
            "--kv-heads",
            "1",
            "--head-dim",
            "8",
            "--repeats",
            "1",
            "--markdown",
            str(out),
        ]
    )
    text = out.read_text()
    assert "not a GPU measurement" in text
    header = next(line for line in text.splitlines() if line.startswith("| threads"))
    for column in ("copy of the same bytes", "BLAKE3 alone", "`attest_pages`", "`verify_arrived`"):
        assert column in header
    rows = [line for line in text.splitlines() if line.startswith("| 1 |")]
    assert len(rows) == 1 and "%)" in rows[0]
