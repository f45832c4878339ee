"""The engine-level differential suite under vLLM 0.32 (the CPU build), which is the conformance
suite's vLLM run (:mod:`kvattn.conformance.vllm` says what its workloads hold): seeded random
workloads served by vLLM's own attention and by kvattn's, clean and then with one bookkeeping
fault injected into the engine per run.

Clean, kvattn must give vLLM's tokens with no failed request, no refused page and no dropped
write. Faulted, the fault's victim, and only it, fails on kvattn (the other requests keep their
tokens from the clean run of the same requests) while vLLM's own attention answers the victim
with other tokens (the fault is real). The counts are printed (``pytest -s``) and written to
build/differential/vllm.json, the conformance table to build/differential/conformance-vllm.md.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

import pytest

from kvattn.conformance import vllm as conformance
from kvattn_testing import engines
from kvattn_testing.engines import ROOT, VLLM_CONFORMANCE_SEEDS, why_no_vllm

SEEDS = VLLM_CONFORMANCE_SEEDS
FAULTS = tuple(conformance.FAULTS)

pytestmark = pytest.mark.slow

if why_no_vllm():
    pytest.skip(why_no_vllm(), allow_module_level=True)


@pytest.fixture(scope="module")
def conformance_run():
    return engines.Runs().vllm_conformance()


@pytest.fixture(scope="module")
def runs(conformance_run):
    return {
        "differential-stock": conformance_run["stock"]["workloads"],
        "differential-kvattn": conformance_run["kvattn"]["workloads"],
    }


answer = conformance.answer


def _clean_ledger(entry: dict) -> Counter:
    before = Counter(entry["ledger_before"].get("counts", {}))
    return Counter(entry["ledger_after"]["counts"]) - before


@pytest.mark.parametrize("seed", SEEDS)
def test_clean_workload_matches_vllm_with_no_refusal(runs, seed):
    stock, kvattn = runs["differential-stock"][str(seed)], runs["differential-kvattn"][str(seed)]
    assert kvattn["requests"] == stock["requests"]
    assert kvattn["clean"] == stock["clean"]
    assert kvattn["clean_failures"] == []
    ledger = _clean_ledger(kvattn)
    assert ledger["refused_pages"] == 0 and ledger["dropped_writes"] == 0
    assert kvattn["ledger_after"]["pages_checked"] > kvattn["ledger_before"].get("pages_checked", 0)
    finished = [r for r in kvattn["clean"].values() if not r["aborted"]]
    assert finished and all(f == "length" for r in finished for f in r["finish"])


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("seed", SEEDS)
def test_fault_fails_the_victim_and_only_the_victim(runs, seed, fault):
    stock = runs["differential-stock"][str(seed)]["faults"][fault]
    kvattn = runs["differential-kvattn"][str(seed)]["faults"][fault]
    victim = kvattn["victim"]
    assert kvattn["injected"] and stock["injected"], "the fault was never injected"
    # The same requests, clean, on both attentions; vLLM's answers the victim otherwise faulted.
    assert {n: answer(r) for n, r in kvattn["reference"].items()} == {
        n: answer(r) for n, r in stock["reference"].items()
    }
    assert answer(stock["faulted"][victim]) != answer(stock["reference"][victim])
    assert stock["failures"] == []
    assert [name for name, _ in kvattn["failures"]] == [victim]
    assert kvattn["failures"][0][1].startswith("kvattn ownership check failed for request")
    assert kvattn["faulted"][victim]["finish"] == ["error"]
    # A request kvattn ends reports the prefix-cache hits vLLM reports for it.
    assert kvattn["faulted"][victim]["cached"] == stock["faulted"][victim]["cached"]
    for name, result in kvattn["faulted"].items():
        if name != victim:
            assert answer(result) == answer(kvattn["reference"][name]), name


def test_counts(runs):
    """The suite's counts over every seed, printed and written to build/differential/vllm.json;
    the workloads exercise what they are drawn for."""
    totals: Counter = Counter()
    for seed in SEEDS:
        stock = runs["differential-stock"][str(seed)]
        kvattn = runs["differential-kvattn"][str(seed)]
        clean = kvattn["clean"]
        ledger = _clean_ledger(kvattn)
        totals["workloads"] += 1
        totals["requests"] += len(kvattn["requests"])
        totals["parallel_requests"] += sum(r["n"] > 1 for r in kvattn["requests"])
        totals["aborts"] += sum(r["aborted"] for r in clean.values())
        totals["requests_with_prefix_hits"] += sum(bool(r["cached"]) for r in clean.values())
        totals["prefix_hit_blocks"] += ledger["prefix_hit_blocks"]
        totals["same_step_hit_blocks"] += ledger["same_step_hit_blocks"]
        totals["cached_blocks_reused"] += ledger["cached_blocks_reused"]
        totals["preemptions"] += kvattn["preemptions"]
        totals["clean_failures"] += len(kvattn["clean_failures"])
        totals["clean_refused_pages"] += ledger["refused_pages"]
        for fault in FAULTS:
            run = kvattn["faults"][fault]
            totals["faults_injected"] += run["injected"]
            totals["faults_detected"] += [n for n, _ in run["failures"]] == [run["victim"]]
            totals["faults_changing_vllm_answer"] += answer(
                stock["faults"][fault]["faulted"][run["victim"]]
            ) != answer(stock["faults"][fault]["reference"][run["victim"]])
    out = ROOT / "build" / "differential"
    out.mkdir(parents=True, exist_ok=True)
    (out / "vllm.json").write_text(json.dumps(dict(seeds=list(SEEDS), **totals), indent=1))
    print("vLLM differential suite:", ", ".join(f"{k} {v}" for k, v in totals.items()))
    for key in (
        "parallel_requests",
        "aborts",
        "requests_with_prefix_hits",
        "same_step_hit_blocks",
        "cached_blocks_reused",
        "preemptions",
    ):
        assert totals[key] > 0, key
    assert totals["faults_detected"] == totals["faults_injected"] == len(SEEDS) * len(FAULTS)


def test_conformance_table(conformance_run):
    """The table ``python -m kvattn.conformance --engine vllm`` printed for these runs: every
    fault caught with the victim alone affected, each real on vLLM's attention, no clean request
    refused, exit status 0; written to build/differential/conformance-vllm.md. The command's
    verdict is the judge's of the raw results."""
    report, text = conformance_run["report"], conformance_run["stdout"]
    out = ROOT / "build" / "differential"
    out.mkdir(parents=True, exist_ok=True)
    (out / "conformance-vllm.md").write_text(text)
    print(text)
    assert conformance_run["returncode"] == 0 and text.endswith("Conformant.\n"), text
    assert text.startswith("`python -m kvattn.conformance --engine vllm --seeds 0,1,2,3,4,5")
    judged = conformance.judge(conformance_run["stock"], conformance_run["kvattn"])
    assert report["rows"] == [dataclasses.asdict(row) for row in judged.rows]
    assert sorted({row["cls"] for row in report["rows"]}) == [1, 2, 3, 4, 5]
    assert list(report["not_replayed"]) == ["6"]
    # The multimodal lane ran here (the stand-ins let vLLM's LLaVA load without torchvision).
    assert report["lanes_not_run"] == {}
    assert "mm_left_out_of_key" in {row["fault"] for row in report["rows"]}
    for row in report["rows"]:
        assert row["injected"] == row["caught"] == row["victim_only"] == row["runs"] > 0, row
        if row["fault"] != "cache_salt_left_out_of_key":  # same bytes, another tenant's
            assert row["stock_changed"] == row["runs"], row
    assert report["false_refusals"] == 0
    assert report["clean_equal_to_stock"] == report["clean_requests"] > 100
