"""SGLang's engine and HTTP server under kvattn (``--attention-backend kvattn``), against the same
server on SGLang's own ``torch_native`` attention: the differential suite, which is the
conformance suite's SGLang run (``python -m kvattn.conformance --engine sglang``, run by
sglang_engine.py; :mod:`kvattn.conformance.sglang` holds the workloads).

Seeded workloads go to both servers at page sizes 16 and 1: two system prompts shared by most
requests (radix-cache hits, and evictions in a pool of 512 tokens), prompts longer than the
32-token prefill chunk (chunked prefill), requests in flight together (overlap scheduling, on by
default), one request aborted while it runs. Clean, every request's greedy tokens are the same on
both servers and kvattn refuses no page and fails no request.

Then each workload again with one bookkeeping fault aimed at one request, the victim
(:mod:`kvattn.conformance.sglang_faults` says how each is made): a ``req_to_token`` entry naming
another request's page (SGLang #22716), a radix hit whose page was handed out and rewritten
meanwhile (vLLM #52234), a prefill write that never reached the request's pages (TensorRT-LLM
#19545), and, for a request whose radix hit is exactly one page, the entries of the tokens after
the hit naming free pages (SGLang #22819), and, on servers with HiCache, a prefix loaded back
from host memory whose host copy changed (vLLM #45704). On SGLang's own attention the victim
answers HTTP 200 with other tokens than its clean run (the fault is real); under kvattn the
victim, and only the victim, fails with an error naming the refused pages, and every other
request's tokens equal its clean run's.

The counts are printed (``pytest -s``) and written to build/differential/sglang.json.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import sglang_engine as engine

from kvattn.conformance import sglang as conformance
from kvattn_testing.engines import ROOT

pytestmark = pytest.mark.slow

if engine.why_no_sglang():
    pytest.skip(engine.why_no_sglang(), allow_module_level=True)

PAGE_SIZES = conformance.PAGE_SIZES
FAULTS = tuple(conformance.FAULTS)
SEEDS = engine.SEEDS


@pytest.fixture(scope="module")
def suite():
    return engine.conformance()["raw"]["servers"]["servers"]


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_clean_workloads_give_sglang_s_tokens_and_refuse_nothing(suite, page_size):
    engine.assert_clean(suite[f"torch_native-p{page_size}"], suite[f"kvattn-p{page_size}"], SEEDS)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("fault", FAULTS)
def test_a_fault_fails_the_victim_and_only_the_victim(suite, page_size, fault):
    stock, mine = suite[f"torch_native-p{page_size}"], suite[f"kvattn-p{page_size}"]
    engine.assert_only_the_victim_fails(stock, mine, fault, SEEDS)


def test_counts(suite):
    """The suite's counts, printed and written to build/differential/sglang.json."""
    counts: Counter = Counter()
    for page_size in PAGE_SIZES:
        stock, mine = suite[f"torch_native-p{page_size}"], suite[f"kvattn-p{page_size}"]
        for seed in SEEDS:
            counts["clean_requests"] += len(mine["runs"][f"clean-{seed}"])
            counts["clean_tokens_equal"] += sum(
                r["ids"] == stock["runs"][f"clean-{seed}"][rid]["ids"]
                for rid, r in mine["runs"][f"clean-{seed}"].items()
            )
            for fault in FAULTS:
                victim = conformance.victim(fault, seed)
                faulted = mine["runs"][f"{fault}-{seed}"]
                failed = sorted(rid for rid, r in faulted.items() if r["status"] != 200)
                counts[f"{fault}_injected"] += 1
                counts[f"{fault}_only_the_victim_failed"] += failed == [victim]
                counts["stock_victim_answered_otherwise"] += (
                    stock["runs"][f"{fault}-{seed}"][victim]["status"] == 200
                    and stock["runs"][f"{fault}-{seed}"][victim]["ids"]
                    != stock["runs"][f"clean-{seed}"][victim.split(":", 1)[1]]["ids"]
                )
        counts[f"kvattn_p{page_size}_refused_pages"] = mine["counts"]["refused_pages"]
        counts[f"kvattn_p{page_size}_pages_checked"] = mine["counts"]["pages_checked"]
    out = ROOT / "build" / "differential"
    out.mkdir(parents=True, exist_ok=True)
    (out / "sglang.json").write_text(json.dumps(counts, indent=1, sort_keys=True))
    print("\nSGLang differential suite:", dict(sorted(counts.items())))
    assert counts["clean_tokens_equal"] == counts["clean_requests"]
    for fault in FAULTS:
        assert counts[f"{fault}_only_the_victim_failed"] == counts[f"{fault}_injected"]


def test_conformance_table():
    """The command's table over both runs (this suite's servers and test_sglang_pd.py's pairs):
    every fault caught with the victim alone affected, each real on SGLang's attention, no clean
    request refused; exit status 0; written to build/differential/conformance-sglang.md."""
    run = engine.conformance()
    report = run["report"]
    out = ROOT / "build" / "differential"
    out.mkdir(parents=True, exist_ok=True)
    (out / "conformance-sglang.md").write_text(run["stdout"])
    print(run["stdout"])
    assert run["returncode"] == 0 and run["stdout"].endswith("Conformant.\n"), run["stdout"]
    rows = {row["fault"]: row for row in report["rows"]}
    pair = engine.why_no_mooncake() is None
    expected = set(FAULTS) | set(conformance.DOMAIN_FAULTS) | set(conformance.OFFLOAD_FAULTS)
    assert set(rows) == expected | (set(conformance.PD_FAULTS) if pair else set())
    for row in rows.values():
        assert row["injected"] == row["caught"] == row["victim_only"] == row["runs"] > 0, row
        # Under another salt the bytes are the same: the tenant boundary is what is crossed.
        assert row["stock_changed"] == (0 if row["fault"] == "salt-ignored" else row["runs"]), row
    assert rows["lost-write"]["runs"] == len(SEEDS) * len(PAGE_SIZES)
    assert sorted({row["cls"] for row in rows.values()}) == [1, 2, 3, 4, 5, 6]
    assert report["not_replayed"] == {}
    assert report["false_refusals"] == 0
    bystanders = 4 if pair else 0  # of the pair: the tenant's and the clean requests
    lanes = len(PAGE_SIZES) * len(conformance.DOMAIN_LANE)  # the class-5 lanes' clean runs
    lanes += 2 + len(conformance.FILLERS)  # the offload lane's clean run
    clean = 4 * 10  # (2 seeds x 2 page sizes) x 10 requests
    assert report["clean_requests"] == report["clean_equal_to_stock"] == clean + lanes + bystanders


def test_a_prefix_loaded_back_from_host_memory_is_read_once_verified():
    engine.assert_offload(engine.conformance()["raw"]["offload"])


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_a_cache_salt_separates_tenants_unless_the_key_drops_it(suite, page_size):
    """Clean: tenant 2's request computes its own pages, tenant 1's second one hits the first's;
    both attentions give the same tokens. With the salt left out of the radix key, SGLang's
    attention serves tenant 2 from tenant 1's pages (the same bytes, so the same tokens: the
    tenant boundary is what is crossed); kvattn fails tenant 2, naming the pages it could not
    prove, and serves tenant 1's requests as in the clean lane."""
    stock, mine = suite[f"torch_native-p{page_size}"], suite[f"kvattn-p{page_size}"]
    for server in (stock, mine):
        clean = server["runs"]["domains-clean"]
        assert all(r["status"] == 200 for r in clean.values())
        assert clean["t2"]["cached"] == 0 and clean["t1b"]["cached"] >= 32
    assert {n: r["ids"] for n, r in mine["runs"]["domains-clean"].items()} == {
        n: r["ids"] for n, r in stock["runs"]["domains-clean"].items()
    }
    faulted = stock["runs"]["domains-salt-ignored"]
    assert faulted["t2"]["status"] == 200 and faulted["t2"]["cached"] >= 32
    faulted = mine["runs"]["domains-salt-ignored"]
    assert faulted["t2"]["status"] >= 400 and "OWNER_MISMATCH" in faulted["t2"]["message"]
    for name in ("t1", "t1b"):
        assert faulted[name]["ids"] == mine["runs"]["domains-clean"][name]["ids"]
