"""``python -m kvattn.conformance``, the command users run: transformers end to end at one seed,
its exit status, the table it prints and the files it writes; its refusals of bad arguments and
of engines it cannot run; and the report's verdict on a fault missed or a clean request refused.
The engines' differential suites run the command itself at full size for vLLM
(vllm/test_vllm_differential.py) and SGLang (sglang/test_sglang_engine.py, test_sglang_pd.py);
transformers' (transformers/test_transformers_differential.py) runs its workloads in-process and
judges them with the command's code."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from kvattn.conformance import Report, Row
from kvattn_testing.engines import ROOT, VENV_PY, why_no_vllm


def _cli(python, *args, cwd=ROOT, timeout=600):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVATTN_", "TRITON_"))}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(
        [str(python), "-m", "kvattn.conformance", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=timeout,
    )


def _files(out, engine: str) -> tuple[dict, str]:
    return (
        json.loads((out / f"conformance-{engine}.json").read_text()),
        (out / f"conformance-{engine}.md").read_text(),
    )


@pytest.mark.slow
def test_transformers_run_of_one_seed(tmp_path):
    pytest.importorskip("transformers")
    done = _cli(sys.executable, "--engine", "transformers", "--seeds", "3", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    report, text = _files(tmp_path, "transformers")
    assert done.stdout == text
    assert text.startswith("`python -m kvattn.conformance --engine transformers --seeds 3")
    assert report["ok"] and report["seeds"] == [3] and report["false_refusals"] == 0
    assert [row["cls"] for row in report["rows"]] == [3, 1, 2, 2, 4]
    assert all(row["caught"] == row["victim_only"] == row["runs"] == 1 for row in report["rows"])
    assert "| 1 | lost_write | TensorRT-LLM #19545" in text and text.endswith("Conformant.\n")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--engine", "tensorrt-llm"], "invalid choice: 'tensorrt-llm'"),
        (["--engine", "vllm", "--seeds", "1,x"], "expected comma-separated integers"),
        (["--engine", "vllm", "--seeds", "-1"], "expected non-negative integers"),
        (["--engine", "transformers", "--model", "m"], "--model: transformers runs its own"),
        (["--engine", "vllm", "--model", "/nonexistent"], "--model: expected a model directory"),
    ],
)
def test_bad_arguments_are_named(args, message):
    done = _cli(sys.executable, *args, timeout=120)
    assert done.returncode == 2 and message in done.stderr, done.stderr


@pytest.mark.parametrize("engine, name", [("vllm", "vLLM"), ("sglang", "SGLang")])
def test_an_engine_not_installed_is_an_error_not_a_verdict(engine, name):
    """In an environment without the engine the command says so and exits 2 with no table."""
    if importlib.util.find_spec(engine) is not None:
        pytest.skip(f"{name} is installed in this environment")
    done = _cli(sys.executable, "--engine", engine, "--seeds", "0", timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert f"conformance run of {engine} failed: {name} is not installed" in done.stderr


@pytest.mark.slow
def test_an_engine_that_fails_is_an_error_not_a_verdict(tmp_path):
    """Engine processes that fail (here: a model whose config vLLM cannot read) make the command
    exit 2 with their log's tail and no table: a crash is not a conformance result."""
    if why_no_vllm() is not None:
        pytest.skip(why_no_vllm())
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    done = _cli(VENV_PY, "--engine", "vllm", "--seeds", "0", "--model", str(tmp_path / "model"))
    assert done.returncode == 2 and done.stdout == ""
    assert "conformance run of vllm failed: the engine process failed" in done.stderr


def _report(**changes) -> Report:
    row = Row(2, "early_free", "vLLM #42571", runs=3, injected=3, caught=3, victim_only=3)
    report = Report("e", "1", [0, 1, 2], [row], clean_requests=10, clean_equal_to_stock=10)
    for key, value in changes.items():
        if hasattr(row, key):
            setattr(row, key, value)
        else:
            setattr(report, key, value)
    return report


def test_report_is_conformant_only_when_every_fault_is_caught_and_no_clean_request_refused():
    assert _report().ok and _report().markdown().endswith("\nConformant.\n")
    for changes in (
        dict(caught=2),  # a fault missed
        dict(victim_only=2),  # a bystander failed or changed
        dict(injected=2),  # a fault that never happened proves nothing
        dict(false_refusals=1),
        dict(clean_equal_to_stock=9),  # kvattn changed a clean answer
        dict(clean_requests=0, clean_equal_to_stock=0),
        dict(rows=[]),
    ):
        report = _report(**changes)
        assert not report.ok, changes
        assert report.markdown().endswith("\nNOT conformant.\n")


@pytest.mark.parametrize("engine", ["vllm", "sglang", "transformers"])
def test_the_recorded_tables_are_conformant_and_the_docs_show_them(engine):
    """benchmarks/results/conformance_ENGINE.md is the command's output, at a named commit, and
    conformant; docs/conformance.md shows that table as recorded."""
    recorded = (ROOT / "benchmarks" / "results" / f"conformance_{engine}.md").read_text()
    first, _, table = recorded.partition("\n\n")
    assert first.startswith(f"`python -m kvattn.conformance --engine {engine}")
    assert re.search(r"\(commit [0-9a-f]{7,}\)", first), "recorded at a clean commit"
    assert table.endswith("\nConformant.\n")
    docs = (ROOT / "docs" / "conformance.md").read_text()
    block = re.search(
        rf"<!-- conformance-{engine} -->\n(.*?)<!-- /conformance-{engine} -->", docs, re.S
    )
    assert block, f"docs/conformance.md: the markers of {engine}'s table are missing"
    assert table in block.group(1)
