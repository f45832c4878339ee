"""benchmarks/graph_replay.py on its CPU path (no capture: a "replay" runs the captured forward's
Python on the same fixed buffers, which is what the kernels of a replay read), tiny shapes, the
Triton kernels under the interpreter.

Pairs: clean replays equal eager / a page re-tagged between replays is refused for its request
alone; a replay whose refill was skipped reads and writes nothing / its refilled twin reads
again; and the checks themselves fail when what they check is broken (a replay that misses its
refill, buffers never poisoned after a forward), with the exit status that fails the suite."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from benchmarks import graph_replay
from kvattn.integrations.ledger import GraphBuffers

pytestmark = [
    pytest.mark.host_only,
    pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path of the script"),
]

TINY = replace(graph_replay.PRESETS["tiny"], max_steps=2)
CPU = torch.device("cpu")


def _run(shape=TINY) -> dict[str, dict]:
    rows = graph_replay.run(shape, CPU, "triton", 600, lambda row: None)
    return {r["check"]: r for r in rows}


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory) -> dict:
    """One run through the command line: its exit status, files and rows."""
    out = tmp_path_factory.mktemp("graph-replay")
    stream = out / "stream.jsonl"
    argv = ["--device", "cpu", "--backend", "triton", "--steps", "2", "--out-dir", str(out)]
    rc = graph_replay.main(argv + ["--stream", str(stream)])
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    rows = [json.loads(line) for line in (run_dir / "rows.jsonl").read_text().splitlines()]
    return dict(
        rc=rc,
        run_dir=run_dir,
        rows={r["check"]: r for r in rows},
        stream=[json.loads(line) for line in stream.read_text().splitlines()],
    )


def test_clean_replays_equal_eager(clean_run):
    """Two decode steps (request 0 starts a page: one reserved between the replays): outputs,
    tags and pools of the replayed world bit for bit the eager world's, within float32 rounding
    of an attention over each request's tokens, nothing refused; no capture, no timing here."""
    r = clean_run["rows"]["clean"]
    assert r["passed"] and r["problems"] == []
    assert r["steps"] == 2 and r["bitwise_equal_eager"] and r["max_abs_err_ref"] < 1e-5
    assert r["captured"] is False and "replay_ms" not in r


def test_a_page_retagged_between_replays_is_caught_on_replay(clean_run):
    """The twin: request 0's first page released, reserved and poisoned (K 1e4, V NaN) by request
    1 between replays, request 0's table unchanged. Request 0 alone is refused that page, once per
    layer, and named with logical page 0; its output is the attention without the page, finite;
    the replayed world still bit for bit the eager one."""
    r = clean_run["rows"]["foreign_page"]
    assert r["passed"] and r["problems"] == []
    assert r["refused"] == [TINY.layers, 0] and r["failed"] == ["r0"]
    assert "reads: OWNER_MISMATCH on logical page(s) 0 (page " in r["message"]
    assert r["max_abs_err_ref"] < 1e-5 and r["bitwise_equal_eager"]


def test_a_replay_whose_refill_was_skipped_reads_and_writes_nothing(clean_run):
    """The refill skipped on purpose after the faulted forward (its owners poisoned to 0): every
    page of every live row refused in every layer, every write dropped, outputs exactly 0, tags
    and pools unchanged bit for bit, every live request named."""
    r = clean_run["rows"]["stale_buffer"]
    assert r["passed"] and r["problems"] == []
    assert all(n > 0 for n in r["refused"]) and all(n == TINY.layers for n in r["dropped"])
    assert r["nonzero_outputs"] == 0 and r["state_unchanged"] and r["failed"] == ["r0", "r1"]


def test_the_refilled_twin_reads_again(clean_run):
    r = clean_run["rows"]["refilled"]
    assert r["passed"] and r["rows"] == 1 and r["bitwise_equal_eager"]
    assert r["max_abs_err_ref"] < 1e-5


def test_the_command_writes_its_rows_and_summary(clean_run):
    assert clean_run["rc"] == 0
    assert clean_run["run_dir"].name.endswith("_graph-replay")
    assert [r["check"] for r in clean_run["stream"]] == list(clean_run["rows"])
    assert all(
        r["op"] == "graph_replay" and r["run"] == clean_run["run_dir"].name
        for r in clean_run["stream"]
    )
    summary = (clean_run["run_dir"] / "summary.md").read_text()
    assert "NOT a GPU measurement" in summary and "no capture" in summary
    assert summary.count("| True |") == 4


def test_a_replay_that_misses_its_refill_fails_the_clean_check(monkeypatch):
    """The clean check's violation twin: the ledger's buffers never refilled (the fixed query/K/V
    tensors are). The replays read nothing and write nothing, unlike eager: the check fails."""
    monkeypatch.setattr(graph_replay.GraphWorld, "fill", graph_replay.GraphWorld.load)
    rows = _run(replace(TINY, max_steps=1))
    clean = rows["clean"]
    assert not clean["passed"] and not clean["bitwise_equal_eager"]
    assert any("differs from eager" in p for p in clean["problems"])
    assert any("tags or pools differ" in p for p in clean["problems"])


def test_a_refused_page_in_a_clean_step_fails_the_clean_check(monkeypatch):
    """The clean check's other twin: request 0's first page expected under owner 0 in both
    worlds (the replay still equals eager): the refusal and the failed request fail the check."""
    plan = graph_replay.Scenario.plan

    def wrong_owner(self, requests):
        inp = plan(self, requests)
        inp.expected[0, 0] = 0
        return inp

    monkeypatch.setattr(graph_replay.Scenario, "plan", wrong_owner)
    clean = _run(replace(TINY, max_steps=1))["clean"]
    assert not clean["passed"] and clean["bitwise_equal_eager"]
    assert any("pages refused or writes dropped" in p for p in clean["problems"])
    assert any("requests failed: ['r0'] ['r0']" in p for p in clean["problems"])


def test_buffers_never_poisoned_fail_the_stale_check(monkeypatch, tmp_path):
    """The issue's safety rule, broken on purpose: without the ledger's poison after each
    forward, a replay nobody refilled reads the last batch's pages under their owners and writes
    into them. The stale check says so and the command exits 1 (the suite fails the step)."""
    monkeypatch.setattr(GraphBuffers, "poison", lambda self: None)
    argv = ["--device", "cpu", "--backend", "triton", "--steps", "1", "--out-dir", str(tmp_path)]
    assert graph_replay.main(argv) == 1
    (run_dir,) = list(tmp_path.iterdir())
    rows = {
        r["check"]: r for r in map(json.loads, (run_dir / "rows.jsonl").read_text().splitlines())
    }
    stale = rows["stale_buffer"]
    assert not stale["passed"] and stale["nonzero_outputs"] > 0 and not stale["state_unchanged"]
    assert (
        "| stale_buffer | a replay whose refill was skipped | False |"
        in (run_dir / "summary.md").read_text()
    )


def test_a_raise_is_a_failed_row(monkeypatch):
    """A capture that raises (on a GPU: a host read inside the captured region) ends the run
    with a failed row naming the stage."""

    def capture(self):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graph_replay.GraphWorld, "capture", capture)
    rows = _run()
    assert list(rows) == ["capture"]
    assert not rows["capture"]["passed"]
    assert "RuntimeError: operation not permitted" in rows["capture"]["problems"][0]


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--steps", "0"], "--steps: expected at least 1"),
        (["--time-budget-s", "0"], "--time-budget-s: expected a positive number"),
        (["--device", "meta"], "--device: expected cuda or cpu"),
    ],
)
def test_bad_arguments_raise_naming_them(argv, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        graph_replay.main(argv + ["--out-dir", str(tmp_path)])


def test_shapes_the_faults_cannot_use_are_refused():
    with pytest.raises(ValueError, match="contexts: expected two requests or more"):
        graph_replay.Scenario(replace(TINY, contexts=(8,)), CPU, "triton")
    with pytest.raises(ValueError, match="contexts: expected 1 to 2 requests"):
        graph_replay.Scenario(replace(TINY, contexts=(8, 6, 5)), CPU, "triton")
