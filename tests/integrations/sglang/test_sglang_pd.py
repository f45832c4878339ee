"""The incident's own stack: SGLang prefill and decode servers over the Mooncake transfer engine
(TCP on the loopback), kvattn's attestation riding SGLang's status channel
(``kvattn.integrations.sglang_transfer``), against the same pair on SGLang's own attention: the
conformance suite's prefill/decode run (``replay_incident`` of :mod:`kvattn.conformance.sglang`,
run by its command through sglang_engine.py).

The replay: an earlier tenant's long request leaves its KV in the decode's pages (a pool of 640
tokens, so the next request's pages are the tenant's); then a request whose prompt the prefill
turns into a one-token placeholder (SGLang #30233: what the prefill did with a prompt too long for
it) is told "transfer done" with one token of KV, beside a clean request. SGLang's own decode
answers HTTP 200 over the tenant's KV (other tokens than the same prompt's clean run); kvattn's
decode fails that request, naming the pages nobody attested, and serves the clean one unchanged.

The attestation's own failure modes, each one request: a transport that moved one page per chunk
(digest mismatch), bytes changed after arrival (digest mismatch), a malformed frame, a replayed
frame of another transfer; and the mixed pairs: a kvattn prefill with SGLang's own decode (the
frame is dropped as an unknown status; the answer is right), SGLang's own prefill with a kvattn
decode (no attestation: the request fails, saying so).

The whole replay runs twice: on the conformance suite's Llama (SGLang's MHA pool) and on a
DeepSeek-V2-style model (its MLA pool, whose latent rows are what Mooncake moves).
"""

from __future__ import annotations

import json

import pytest
import sglang_engine as engine

from kvattn.conformance.sglang import ATTESTATION_FAULTS, NEW
from kvattn_testing.engines import ROOT

pytestmark = pytest.mark.slow

if engine.why_no_mooncake():
    pytest.skip(engine.why_no_mooncake(), allow_module_level=True)


@pytest.fixture(scope="module", params=["llama", "deepseek-v2"])
def model(request):
    """The conformance suite's Llama (MHA pool), or the DeepSeek-V2-style model (MLA pool: one
    latent row per token, which the prefill attests and the decode verifies as it does K and V)."""
    return request.param


@pytest.fixture(scope="module")
def suite(model):
    return engine.conformance()["raw"]["incident"] if model == "llama" else engine.mla_incident()


def _pages(log: list[dict], rid: str) -> set[int]:
    return {p for record in log if record.get("transfer") == rid for p in record["pages"]}


def test_the_pair_serves_sglang_s_tokens_under_kvattn(suite):
    stock, mine = suite["stock"]["results"], suite["kvattn"]["results"]
    for name in ("tenant", "clean", "beside", "beside-clean"):
        assert stock[name]["status"] == mine[name]["status"] == 200, mine[name]["message"]
        assert mine[name]["ids"] == stock[name]["ids"] and len(mine[name]["ids"]) == NEW
    counts = suite["kvattn"]["counts"]
    assert counts["received_transfers"] >= 4 and counts["received_pages_committed"] >= 4 + 36
    # Every attestation that parsed was keyed (the pools are 16-byte units, the CPU module is
    # built): only the malformed frame's transfer gave no key.
    assert counts["received_keyed_transfers"] == counts["received_transfers"] - 1


def test_the_incident_stock_answers_over_the_tenant_s_kv(suite):
    """SGLang's own decode: HTTP 200 for the placeholder's request, over pages that held the
    earlier tenant's KV, with other tokens than the same prompt's clean run."""
    run = suite["stock"]
    assert {f["rid"] for f in run["prefill_faults"]} >= {"placeholder:stock-victim"}
    assert _pages(run["decode_log"], "placeholder:stock-victim") & _pages(
        run["decode_log"], "stock-tenant"
    )
    victim = run["results"]["victim"]
    assert victim["status"] == 200 and victim["ids"] != run["results"]["clean"]["ids"]


def test_the_incident_kvattn_refuses_the_unattested_pages(suite):
    """kvattn's decode: the same request fails with an error naming what the prefill attested
    and the pages it read none of; the request beside it is served as in its clean run."""
    run = suite["kvattn"]
    tenant = _pages(run["decode_log"], "kvattn-tenant")
    victim_pages = _pages(run["decode_log"], "placeholder:kvattn-victim")
    assert victim_pages & tenant
    victim = run["results"]["victim"]
    assert victim["status"] >= 400 and victim["ids"] is None
    message = victim["message"]
    assert "kvattn ownership check failed for request 'placeholder:kvattn-victim'" in message
    assert "attestation of 1 page(s) from the prefill" in message
    assert "logical page 1" in message and "not attested" in message
    assert "reads: RESERVED on logical page(s) 1" in message
    beside = run["results"]["beside"]
    assert beside["status"] == 200 and beside["ids"] == run["results"]["beside-clean"]["ids"]


@pytest.mark.parametrize("fault", ATTESTATION_FAULTS)
def test_an_attestation_that_does_not_prove_the_bytes_commits_nothing_of_them(suite, fault):
    stock, mine = suite["stock"]["results"], suite["kvattn"]["results"]
    assert stock[fault]["status"] == 200  # SGLang's own decode cannot tell
    assert mine[fault]["status"] >= 400 and mine[fault]["ids"] is None
    why = {
        "short-transfer": "digest mismatch",
        "corrupt-arrival": "digest mismatch",
        "bad-attestation": "a malformed attestation arrived",
        "replayed-attestation": "digest mismatch",
    }[fault]
    assert why in mine[fault]["message"], mine[fault]["message"]
    if fault in ("short-transfer", "corrupt-arrival"):  # the fault changed what SGLang answers
        assert stock[fault]["ids"] != stock["clean"]["ids"]


def test_a_kvattn_prefill_serves_sglang_s_own_decode(suite):
    """The attestation frame is an unknown status to a stock decode, which drops it."""
    result = suite["kvattn-prefill-stock-decode"]
    assert result["status"] == 200
    assert result["ids"] == suite["stock"]["results"]["clean"]["ids"]


def test_a_kvattn_decode_fails_what_a_stock_prefill_sends(suite):
    result = suite["stock-prefill-kvattn-decode"]
    assert result["status"] >= 400 and result["ids"] is None
    assert "no attestation arrived from the prefill instance" in result["message"]


def test_counts(suite, model):
    """The replay's counts, printed (``pytest -s``) and written to build/differential/sglang-pd.json
    (sglang-pd-deepseek-v2.json)."""
    stock, mine = suite["stock"], suite["kvattn"]
    counts = {
        "victim_pages_that_held_the_tenant_s_kv": len(
            _pages(mine["decode_log"], "placeholder:kvattn-victim")
            & _pages(mine["decode_log"], "kvattn-tenant")
        ),
        "stock_victim_status": stock["results"]["victim"]["status"],
        "stock_victim_tokens_differ_from_clean": stock["results"]["victim"]["ids"]
        != stock["results"]["clean"]["ids"],
        "kvattn_victim_status": mine["results"]["victim"]["status"],
        "kvattn_beside_tokens_equal_clean": mine["results"]["beside"]["ids"]
        == mine["results"]["beside-clean"]["ids"],
        "attestation_faults_failed_under_kvattn": sum(
            mine["results"][f]["status"] >= 400 for f in ATTESTATION_FAULTS
        ),
        "attestation_faults_answered_200_by_stock": sum(
            stock["results"][f]["status"] == 200 for f in ATTESTATION_FAULTS
        ),
        **{f"kvattn_decode_{k}": v for k, v in mine["counts"].items() if k != "failures"},
    }
    out = ROOT / "build" / "differential"
    out.mkdir(parents=True, exist_ok=True)
    name = "sglang-pd.json" if model == "llama" else f"sglang-pd-{model}.json"
    (out / name).write_text(json.dumps(counts, indent=1, sort_keys=True))
    print(f"\nSGLang P/D incident replay ({model}):", counts)
    assert counts["victim_pages_that_held_the_tenant_s_kv"] > 0
    assert counts["attestation_faults_failed_under_kvattn"] == len(ATTESTATION_FAULTS)
