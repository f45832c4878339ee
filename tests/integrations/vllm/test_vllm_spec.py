"""Speculative decoding under kvattn in vLLM 0.32 (the CPU build): vLLM's n-gram proposer drafts up
to 3 tokens a step from the request's own tokens, the verify step reads them as one causal extend
over the request's KV (its drafts' KV written first, under its own owner), and vLLM rolls back past
the first rejected draft, whose slots the next step rewrites.

The model is the tiny Llama drawn with a narrow initialiser (kvattn.conformance.model ``llama-narrow``):
its greedy answers settle into short loops, so drafts are both accepted (several tokens a step,
across block boundaries) and rejected. vllm_driver.py's ``spec`` scenario runs once on vLLM's
attention and once on kvattn's: greedy tokens, log-probabilities and vLLM's own speculation
counters equal, a later request hitting the prefix cache, and a next turn hitting the blocks the
answer's accepted drafts filled; then a foreign block-table entry, which
fails only its victim on kvattn and changes the victim's answer on vLLM's. Other proposers (a draft
model, EAGLE, tree drafts) are refused when the engine is set up (test_vllm_setup.py).
"""

from __future__ import annotations

import pytest

from kvattn_testing import engines
from kvattn_testing.engines import ROOT, why_no_vllm

DRIVER = ROOT / "tests" / "integrations" / "vllm" / "vllm_driver.py"
LOGPROB_TOL = 1e-3  # as test_vllm_variants.py: float32 softmax in two orders

pytestmark = pytest.mark.slow

if why_no_vllm():
    pytest.skip(why_no_vllm(), allow_module_level=True)


@pytest.fixture(scope="module")
def spec():
    runs = engines.Runs()
    results = runs.shared(
        "spec",
        lambda: runs.drive(
            [("spec-stock", DRIVER, False, ("spec",)), ("spec-kvattn", DRIVER, True, ("spec",))],
            family="llama-narrow",
        ),
    )
    return results["spec-stock"], results["spec-kvattn"]


def test_kvattn_matches_vllm_attention_under_speculation(spec):
    stock, kvattn = spec
    assert kvattn["equality"].keys() == stock["equality"].keys()
    for request, result in stock["equality"].items():
        mine = kvattn["equality"][request]
        assert result["finish_reason"] == mine["finish_reason"] == "length", request
        assert mine["tokens"] == result["tokens"], request
        assert mine["cached"] == result["cached"], request
        assert max(abs(a - b) for a, b in zip(mine["logprobs"], result["logprobs"])) < LOGPROB_TOL
    assert stock["equality"]["shared"]["cached"] == 64  # the prefix-cache hit happened
    # The next turn hits the seven full blocks of the first turn's prompt and answer: five were
    # filled by decode steps that accepted drafts (the ledger records a block once vLLM accepted
    # the tokens in it, whichever step that is).
    first, second = stock["second_turn"]["second"], kvattn["second_turn"]["second"]
    assert first["cached"] == second["cached"] == 224
    assert second["finish_reason"] == "length" and second["tokens"] == first["tokens"]
    # vLLM verified the same drafts and accepted the same ones; some of each.
    assert kvattn["spec"] == stock["spec"]
    drafted, accepted = stock["spec"]["num_draft_tokens"], stock["spec"]["num_accepted_tokens"]
    assert 20 <= accepted <= drafted - 20, stock["spec"]
    # kvattn ran and refused nothing in the clean runs: its one failure is the fault's victim.
    assert kvattn["counts"]["leases"] >= 10 and kvattn["failures_total"] == 1


def test_a_foreign_entry_fails_only_its_victim_under_speculation(spec):
    stock, kvattn = spec
    for run in (stock, kvattn):
        fault = run["foreign_entry"]
        assert fault["injected"]
        clean, faulted = fault["clean"], fault["faulted"]
        for name in ("other", "third"):
            assert faulted[name]["tokens"] == clean[name]["tokens"], name
            assert faulted[name]["finish_reason"] == "length"
    fault = stock["foreign_entry"]
    assert fault["faulted"]["victim"]["tokens"] != fault["clean"]["victim"]["tokens"]
    assert stock["foreign_entry"]["failures"] == []
    victim = kvattn["foreign_entry"]["faulted"]["victim"]
    assert victim["finish_reason"] == "error"
    assert [name for name, _ in kvattn["foreign_entry"]["failures"]] == ["victim"]
    assert "OWNER_MISMATCH" in kvattn["foreign_entry"]["failures"][0][1]
