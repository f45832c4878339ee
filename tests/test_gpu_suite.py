"""benchmarks/gpu_suite.sh end to end in its dry run on this CPU (no build, the CUDA smoke on the
harness, the tuning sweep and both benchmark sweeps on their tiny presets): it must pass, leave at
most the 8 files the device tool brings back, and keep its steps inside the budget."""
from __future__ import annotations

import os
import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.host_only


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("out")
    results = tmp_path_factory.mktemp("results")
    env = dict(os.environ, OUT=str(out), SUITE_SKIP_BUILD="1", SUITE_SKIP_TESTS="1",
               SUITE_PRESET="cpu-tiny", SUITE_RESULTS=str(results), KVATTN_COMMIT="dry-run")
    env.pop("TRITON_INTERPRET", None)  # the benchmarks choose it themselves
    run = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_suite.sh")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    return run, out, results


def test_dry_run_passes_and_names_every_step(dry_run):
    run, out, results = dry_run
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    log = (out / "suite.log").read_text()
    for step in ("device and versions", "under compute-sanitizer", "tuning sweep", "decode benchmark sweep",
                 "mla benchmark sweep", "extend benchmark sweep", "done:"):
        assert step in log, step
    assert log.rstrip().endswith("GPU suite passed")
    assert re.search(r"done: build=skipped smoke=0 tests=skipped tune=0 decode=0 extend=0 mla=0", log)
    assert "## MLA decode (NOT a GPU measurement)" in log  # its summary, in the log


def test_dry_run_leaves_what_the_device_tool_brings_back(dry_run):
    _, out, results = dry_run
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8, files
    assert {"suite.log", "smoke.log", "summary.md", "extend-summary.md", "results.tar.gz"} <= set(files)
    folders = sorted(p.name for p in results.iterdir())
    assert any(f.endswith("_extend") for f in folders) and any(f.endswith("_tune") for f in folders)
    assert any(f.endswith("_mla") for f in folders)
    for folder in results.iterdir():
        if not folder.name.endswith("_tune"):
            assert (folder / "rows.jsonl").exists(), folder  # each point written as it was measured
    assert "NOT a GPU measurement" in (out / "summary.md").read_text()


def test_every_step_timeout_is_bounded_by_the_budget():
    """Each step's timeout goes through cap(): a step that hangs cannot push the suite past
    SUITE_BUDGET_S (470 s of the device tool's 600 s call)."""
    script = (ROOT / "benchmarks" / "gpu_suite.sh").read_text()
    timeouts = re.findall(r"^\s*(?:\S+=\S+ )*timeout (\S+)", script, flags=re.M)
    assert len(timeouts) >= 8 and all(t == '"$(cap' for t in timeouts), timeouts
    assert re.search(r"BUDGET=\$\{SUITE_BUDGET_S:-470\}", script)
