"""benchmarks/gpu_suite.sh in its dry run on this CPU (no build, the CUDA smoke on the harness, every
benchmark and tuning step on its tiny preset): the steps come in the order that answers the goals
first, each step's results are in the output folder as soon as the step ends (a run killed after a
step keeps them, with nothing done at the end), and the folder holds at most the 8 files the GPU
machine gives back.

Nothing here depends on how fast or loaded this machine is: the dry runs get a budget and a time
scale far past what their tiny presets need, so no step is skipped or stopped for time, and no
assertion reads a duration. The subprocesses' timeout only keeps a hung suite from hanging the
test run. Each dry run is one test, so that parallel workers do not run it twice."""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import tarfile
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_suite.sh"
pytestmark = pytest.mark.host_only

# The steps in the order the suite must take them: what answers the goals (Triton, checked against
# unchecked) first, while the CUDA module builds; the CUDA rows once it is built; the rest after.
ORDER = [
    "cuda-build",
    "versions",
    "headline-triton-decode",
    "headline-triton-extend",
    "digest",
    "graph-replay",
    "tune-triton",
    "tune-cuda",
    "headline-cuda-decode",
    "headline-cuda-extend",
    "flex",
    "sweep-decode",
    "sweep-mla",
    "sweep-extend",
    "smoke",
    "tests",
    "ncu",
    "done",
]
HANG_GUARD_S = 3600
MARKER = re.compile(r"^== \[\d+ s\] ([\w-]+)[:]", re.M)


def _env(out: pathlib.Path, runs: pathlib.Path) -> dict:
    env = dict(
        os.environ,
        OUT=str(out),
        SUITE_SKIP_BUILD="1",
        SUITE_SKIP_TESTS="1",
        SUITE_PRESET="cpu-tiny",
        SUITE_RESULTS=str(runs),
        KVATTN_COMMIT="dry-run",
        SUITE_BUDGET_S="10000000",
        SUITE_TIME_SCALE="100",
    )
    env.pop("TRITON_INTERPRET", None)  # the benchmarks choose it themselves
    return env


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _rows(out: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]


def test_dry_run(tmp_path):
    """One whole dry run (each check below reads it; one test, so that parallel workers do not
    each run the suite)."""
    out, runs = tmp_path / "out", tmp_path / "runs"
    run = subprocess.run(
        ["bash", str(SCRIPT)],
        cwd=ROOT,
        env=_env(out, runs),
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    _takes_the_steps_in_the_order_that_answers_the_goals_first(out)
    _leaves_at_most_8_files_and_packs_every_run(out, runs)
    _streams_every_row_with_its_run(out, runs)


def _takes_the_steps_in_the_order_that_answers_the_goals_first(out):
    log = (out / "suite.log").read_text()
    seen = list(dict.fromkeys(MARKER.findall(log)))
    assert seen == ORDER, seen
    assert log.rstrip().endswith("GPU suite passed")
    done = re.search(r"\] done: (.*)", log).group(1)
    statuses = dict(item.split("=") for item in done.split())
    assert statuses.pop("cuda-build") == "skipped" and statuses.pop("tests") == "skipped"
    assert statuses.pop("ncu") == "skipped"  # no GPU here
    assert set(statuses.values()) == {"0"}, statuses
    # Every step says when it started, within what limit, and how it ended.
    for name in ORDER[2:15]:
        assert re.search(rf"\] {name}: start \(at most \d+ s\)", log), name
        assert re.search(rf"\] {name}: rc=0 in \d+ s", log), name


def _leaves_at_most_8_files_and_packs_every_run(out, runs):
    entries = sorted(p.name for p in out.iterdir())
    assert len(entries) <= 8 and all((out / e).is_file() for e in entries), entries
    assert {"suite.log", "rows.jsonl", "summary.md", "results.tar.gz", "smoke.log"} <= set(entries)
    folders = sorted(p.name for p in runs.iterdir())
    with tarfile.open(out / "results.tar.gz") as tar:
        packed = {name.split("/")[0] for name in tar.getnames()}
    assert packed == set(folders), (packed, folders)
    suffixes = [re.sub(r"^\d{8}-\d{6}_cpu_[\w.-]*?(?=_|$)", "", f) for f in folders]
    # headline decode and extend, Triton then CUDA; the keyed digest; the graph replay; tuning,
    # Triton ops then CUDA; FlexAttention; the three sweeps
    assert sorted(suffixes) == sorted(
        [
            "",
            "_extend",
            "_digest",
            "_graph-replay",
            "_tune-triton-decode-triton-extend",
            "_tune-cuda-decode",
            "",
            "_extend",
            "_flex",
            "",
            "_mla",
            "_extend",
        ]
    ), suffixes
    summary = (out / "summary.md").read_text()
    assert "NOT a GPU measurement" in summary
    assert summary.count("<!-- ") == len(folders)  # each run's summary, appended as it ended
    assert (
        "## MLA decode and extend (NOT a GPU measurement)" in summary
        and "# Tuning sweep" in summary
    )
    assert "# FlexAttention against kvattn" in summary
    assert "# kvattn's ops in one CUDA graph" in summary


def _streams_every_row_with_its_run(out, runs):
    rows = _rows(out)
    by_run: dict[str, int] = {}
    for r in rows:
        by_run[r["run"]] = by_run.get(r["run"], 0) + 1
    for folder in runs.iterdir():
        own = folder / ("tune.csv" if "_tune" in folder.name else "rows.jsonl")
        count = len(own.read_text().splitlines()) - (1 if own.suffix == ".csv" else 0)
        assert by_run.get(folder.name) == count, folder.name
    # Every row names its op, the one of its run's kind.
    kinds = {
        "_extend": {"extend"},
        "_mla": {"mla_decode", "mla_extend"},
        "_flex": {"decode"},
        "_digest": {"digest"},
        "_graph-replay": {"graph_replay"},
    }
    for r in rows:
        kind = next((k for k in kinds if r["run"].endswith(k)), None)
        if "_tune-" in r["run"]:
            assert r["op"] in ("triton-decode", "triton-extend", "cuda-decode"), r
        else:
            assert r.get("op") in kinds.get(kind, {"decode"}), r
    assert {r["op"] for r in rows if r["run"].endswith("_mla")} == {"mla_decode", "mla_extend"}
    # The headline decode times the read through a verdict beside the per-call check, its ratio
    # against the same unchecked twin; extend's rows carry their TFLOP/s; the digest its GB/s
    # beside a copy of the same bytes.
    headline = [r for r in rows if r.get("preset") == "cpu-tiny" and r["op"] == "decode"]
    verdict = [r for r in headline if r["provider"] == "kvattn-triton-verdict"]
    assert verdict and all(r["status"] == "ok" and "ratio_vs_unchecked" in r for r in verdict)
    # (and the CUDA decode's, which says why it skips without a GPU)
    assert any(r["provider"] == "kvattn-cuda-verdict" for r in rows if r["op"] == "decode")
    assert all("tflops" in r for r in rows if r["op"] == "extend" and r.get("status") == "ok")
    digest = [r for r in rows if r["op"] == "digest"]
    assert len(digest) == 1 and {"copy", "attest_keyed", "verify_keyed"} <= set(digest[0])
    # The graph replay's checks, each passed: clean replays as eager, the re-tagged page caught on
    # replay, the replay whose refill was skipped reading nothing, its refilled twin.
    graph = {r["check"]: r for r in rows if r["op"] == "graph_replay"}
    assert list(graph) == ["clean", "foreign_page", "stale_buffer", "refilled"], graph
    assert all(r["passed"] and r["problems"] == [] for r in graph.values()), graph
    assert graph["clean"]["steps"] == 2 and graph["clean"]["bitwise_equal_eager"]
    assert (
        graph["foreign_page"]["failed"] == ["r0"] and graph["stale_buffer"]["nonzero_outputs"] == 0
    )
    tuned = [r for r in rows if r["run"].endswith("_tune-triton-decode-triton-extend")]
    # The default configuration is timed first at every point, checked and unchecked.
    for op in ("triton-decode", "triton-extend"):
        first = [r for r in tuned if r["op"] == op][:2]
        assert [r["default"] for r in first] == [True, True] and {r["variant"] for r in first} == {
            "checked",
            "unchecked",
        }, first
    flex = [r for r in rows if r["run"].endswith("_flex")]
    assert {r["provider"] for r in flex} == {
        "flex-paged",
        "kvattn-triton-checked",
        "kvattn-triton-unchecked",
    }
    assert all(r["status"].startswith("skipped") for r in flex if r["provider"] == "flex-paged")


def test_a_killed_run_keeps_every_finished_step(tmp_path):
    """The dry run killed (SIGKILL to every process of it: no trap, nothing done at the end) as
    soon as the step after the headline starts: what the output folder holds then was written while
    the suite ran."""
    out, runs = tmp_path / "out", tmp_path / "runs"
    out.mkdir()
    proc = subprocess.Popen(
        ["bash", str(SCRIPT)],
        cwd=ROOT,
        env=_env(out, runs),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    log = out / "suite.log"
    started = time.monotonic()
    try:
        while proc.poll() is None and time.monotonic() - started < HANG_GUARD_S:
            if log.exists() and "] tune-triton: start" in log.read_text():
                break
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            # timeout puts each step in a process group of its own: kill those too.
            for pid in [proc.pid, *_descendants(proc.pid)]:
                try:
                    os.killpg(os.getpgid(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        proc.wait()
    log = (out / "suite.log").read_text()
    assert "] headline-triton-extend: rc=0" in log and "] done:" not in log  # really cut short
    rows = _rows(out)  # every line whole
    headline = {r["run"] for r in rows if r.get("provider", "").startswith("kvattn-triton")}
    assert len(headline) == 2 and any(r.endswith("_extend") for r in headline), headline
    assert all(r["status"] == "ok" for r in rows if r["run"] in headline)
    with tarfile.open(out / "results.tar.gz") as tar:
        packed = {name.split("/")[0] for name in tar.getnames()}
        for run in headline:
            assert f"{run}/summary.md" in tar.getnames() and f"{run}/rows.jsonl" in tar.getnames()
    assert headline <= packed
    summary = (out / "summary.md").read_text()
    assert all(f"<!-- {run}/summary.md -->" in summary for run in headline)


def test_every_step_runs_under_timeout_k_within_the_budget():
    """A stuck CUDA call can ignore SIGTERM: every timeout sends SIGKILL after a grace period, and
    each step's limit comes from cap(), bounded by what is left of SUITE_BUDGET_S (470 s of the GPU
    machine's 600 s command)."""
    script = SCRIPT.read_text()
    code = "\n".join(line for line in script.splitlines() if not line.lstrip().startswith("#"))
    timeouts = re.findall(r"(?<![\w-])timeout (.*)", code)  # the command, not pytest's --timeout
    assert len(timeouts) >= 6 and all(t.startswith("-k ") for t in timeouts), timeouts
    limits = re.findall(r"^\s*(?:t=\$\(cap \d+\); )?run (\S+) (\S+) ", code, flags=re.M)
    assert len(limits) >= 12 and all(
        limit in ('"$t"', '"$limit"') or limit.startswith('"$(cap') for _, limit in limits
    ), limits
    assert re.search(r"BUDGET=\$\{SUITE_BUDGET_S:-470\}", script)
    # Results go straight into $OUT: nothing is copied out of a temporary folder at the end.
    assert "cp -r" not in code
