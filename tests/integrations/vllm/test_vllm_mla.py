"""kvattn under vLLM 0.32 (the CPU build) on a model with multi-head latent attention: a
random-weight DeepSeek-V2-style model (4 heads, DeepSeek's 512-dim latent and 64-dim RoPE key per
token, two dense layers) that the tests build locally, on vLLM's own CPU MLA backend and on
kvattn's MLA backend (``KVATTN_VLLM=1``), one engine per process (vllm_driver.py's ``mla``).

vLLM's CPU platform runs MLA models with block size 16, chunked prefill and prefix caching off.
Under kvattn every token reaches the backend's absorbed path (kvattn's MLA extend and decode over
vLLM's latent cache) and every latent row is written under its request's owner. Greedy tokens
compare exactly (float32 softmax over the same latent rows, stable argmax for these weights);
each fault runs on both attentions: on vLLM's the victim's tokens change, on kvattn's the victim
alone fails with the ownership error and the others keep their clean tokens.
"""

from __future__ import annotations

import pytest
from vllm_scenarios import Runs

from kvattn_testing.engines import why_no_vllm

pytestmark = pytest.mark.slow

if why_no_vllm():
    pytest.skip(why_no_vllm(), allow_module_level=True)

FAULTS = {
    "foreign_entry": "OWNER_MISMATCH",
    "early_free": "OWNER_MISMATCH",
    "lost_prefill": "RESERVED",
}


@pytest.fixture(scope="module")
def mla():
    return Runs().mla()


def test_kvattn_s_mla_backend_gives_vllm_s_tokens(mla):
    stock, mine = mla["mla-stock"], mla["mla-kvattn"]
    assert stock["impls"] == ["CPUMLAImpl"] and mine["impls"] == ["KVAttnMLAImpl"]
    assert stock["block_size"] == mine["block_size"] == 16
    tokens = {n: r["tokens"] for n, r in mine["equality"].items()}
    assert tokens == {n: r["tokens"] for n, r in stock["equality"].items()}
    assert len(tokens) == 6 and all(len(t) == 8 for t in tokens.values())
    assert len({t for ts in tokens.values() for t in ts}) > 20  # the answers are informative
    ledger = mine["equality_ledger"]
    assert ledger["failures"] == 0 and ledger["pages_checked"] > 0
    assert ledger["counts"]["refused_pages"] == 0 and ledger["counts"]["dropped_writes"] == 0
    for fault in FAULTS:  # every clean twin too
        assert mine[fault]["clean"] == stock[fault]["clean"]


@pytest.mark.parametrize("fault", FAULTS)
def test_fault_changes_the_victims_answer_on_vllm_s_mla(mla, fault):
    run = mla["mla-stock"][fault]
    assert run["injected"], "the fault was never injected"
    assert run["faulted"]["victim"]["finish_reason"] == "length"
    assert run["faulted"]["victim"]["tokens"] != run["clean"]["victim"]["tokens"]


@pytest.mark.parametrize("fault", FAULTS)
def test_fault_fails_only_the_victim_under_kvattn_s_mla(mla, fault):
    run = mla["mla-kvattn"][fault]
    assert run["injected"], "the fault was never injected"
    victim = run["faulted"]["victim"]
    assert victim["finish_reason"] == "error"
    clean = run["clean"]["victim"]["tokens"]
    assert len(victim["tokens"]) < len(clean) and victim["tokens"] == clean[: len(victim["tokens"])]
    ((name, message),) = run["failures"]
    assert name == "victim"
    assert f"reads: {FAULTS[fault]} on logical page(s) 0 (block " in message
    assert "model.layers.0.self_attn.attn" in message
    for other, result in run["faulted"].items():
        if other != "victim":
            assert result == run["clean"][other], other
