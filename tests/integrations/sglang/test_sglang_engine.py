"""SGLang's engine and HTTP server under kvattn (``--attention-backend kvattn``), against the same
server on SGLang's own ``torch_native`` attention: the differential suite.

Seeded workloads go to both servers at page sizes 16 and 1: two system prompts shared by most
requests (radix-cache hits, and evictions in a pool of 512 tokens), prompts longer than the
32-token prefill chunk (chunked prefill), requests in flight together (overlap scheduling, on by
default), one request aborted while it runs. Clean, every request's greedy tokens are the same on
both servers and kvattn refuses no page and fails no request.

Then each workload again with one bookkeeping fault aimed at one request, the victim
(``standins/kvattn_faults.py`` says how each is made): a ``req_to_token`` entry naming another
request's page (vLLM #52234, SGLang #22716), a radix hit whose page was handed out and rewritten
meanwhile (vLLM #37152, SGLang #22819), a prefill write that never reached the request's pages
(TensorRT-LLM #19545). On SGLang's own attention the victim answers HTTP 200 with other tokens
than its clean run (the fault is real); under kvattn the victim, and only the victim, fails with
an error naming the refused pages, and every other request's tokens equal its clean run's.

The counts are printed (``pytest -s``) and written to build/differential/sglang.json.
"""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
import sglang_engine as engine

from kvattn_testing.engines import ROOT, Runs

pytestmark = pytest.mark.slow

if engine.why_no_sglang():
    pytest.skip(engine.why_no_sglang(), allow_module_level=True)

PAGE_SIZES = (16, 1)
FAULTS = ("foreign-entry", "stale-hit", "lost-write")
SEEDS = (0, 1)
POOL = ("--max-total-tokens", "512")


def workload(seed: int, fault: str | None = None) -> list[list[dict]]:
    """Waves of requests sent together, each wave after the last one ended: ``{rid, ids, new}``.
    The victim of ``fault`` (in the second wave) shares a system prompt cached by the first."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, 250) for _ in range(rng.randrange(20, 40))] for _ in range(2)]

    def request(name: str, system: int | None, user: int, new: int) -> dict:
        prefix = systems[system] if system is not None else []
        return dict(
            rid=f"{seed}-{name}", new=new, ids=prefix + [rng.randrange(3, 250) for _ in range(user)]
        )

    first = [
        request("a", 0, rng.randrange(4, 30), 12),
        request("b", 1, rng.randrange(4, 30), 16),
        request("c", None, rng.randrange(36, 70), 10),
    ]
    second = [
        request("d", 0, rng.randrange(4, 30), 20),
        request("e", 1, rng.randrange(4, 30), 14),
        request("v", 0, rng.randrange(8, 20), 16),
        request("f", None, rng.randrange(40, 60), 8),
    ]
    if fault is not None:
        second[2]["rid"] = f"{fault}:{second[2]['rid']}"
    third = [request("g", 1, rng.randrange(4, 12), 24), dict(request("x", 0, 6, 64), abort=True)]
    return [first, second, third]


def run_workload(server: engine.Server, waves: list[list[dict]]) -> dict:
    """``{rid: result}`` of every request but the aborted ones (which end whenever the abort
    lands, on either engine), from an empty radix cache."""
    server.flush_cache()
    out = {}
    for wave in waves:
        calls = [
            (lambda r=r: server.generate(r["rid"], r["ids"], r["new"]))
            for r in wave
            if not r.get("abort")
        ]
        calls += [
            (lambda r=r: server.abort_midway(r["rid"], r["ids"], r["new"]))
            for r in wave
            if r.get("abort")
        ]
        results = engine.concurrently(calls)
        out.update(
            {r["rid"]: res for r, res in zip([r for r in wave if not r.get("abort")], results)}
        )
    return out


def _suite(runs: Runs) -> dict:
    folder = runs.dir / "sglang-engine"
    folder.mkdir(exist_ok=True)
    model = engine.model(runs.dir)
    servers = [
        engine.Server(f"{kind}-p{p}", kind, folder, page_size=p, extra=POOL)
        for p in PAGE_SIZES
        for kind in ("torch_native", "kvattn")
    ]
    out = {}
    with engine.running(model, *servers):
        for server in servers:
            runs_of = {}
            for seed in SEEDS:
                runs_of[f"clean-{seed}"] = run_workload(server, workload(seed))
                for fault in FAULTS:
                    runs_of[f"{fault}-{seed}"] = run_workload(server, workload(seed, fault))
            out[server.name] = dict(runs=runs_of, faults=server.faults(), counts=server.counts())
    return out


@pytest.fixture(scope="module")
def suite():
    return Runs().shared("sglang-engine", lambda: _suite(Runs()))


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_clean_workloads_give_sglang_s_tokens_and_refuse_nothing(suite, page_size):
    stock, mine = suite[f"torch_native-p{page_size}"], suite[f"kvattn-p{page_size}"]
    for seed in SEEDS:
        a, b = stock["runs"][f"clean-{seed}"], mine["runs"][f"clean-{seed}"]
        assert set(a) == set(b) and len(a) == 8
        for rid in a:
            assert a[rid]["status"] == b[rid]["status"] == 200, (rid, b[rid]["message"])
            assert b[rid]["ids"] == a[rid]["ids"], rid
    # Faults' victims aside, kvattn refused no page and failed no other request.
    victims = {
        rid
        for name, results in mine["runs"].items()
        if not name.startswith("clean")
        for rid in results
        if ":" in rid
    }
    assert set(mine["counts"]["failures"]) <= victims
    assert mine["counts"]["pages_checked"] > 0 and mine["counts"].get("prefix_hit_pages", 0) > 0


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("fault", FAULTS)
def test_a_fault_fails_the_victim_and_only_the_victim(suite, page_size, fault):
    stock, mine = suite[f"torch_native-p{page_size}"], suite[f"kvattn-p{page_size}"]
    for seed in SEEDS:
        victim = f"{fault}:{seed}-v"
        for server in (stock, mine):
            assert victim in {f["rid"] for f in server["faults"]}, "the fault was not applied"
        clean_stock = stock["runs"][f"clean-{seed}"]
        faulted_stock = stock["runs"][f"{fault}-{seed}"]
        # On SGLang's own attention the victim answers, over KV that is not its own.
        assert faulted_stock[victim]["status"] == 200
        assert faulted_stock[victim]["ids"] != clean_stock[f"{seed}-v"]["ids"]
        faulted = mine["runs"][f"{fault}-{seed}"]
        assert faulted[victim]["status"] >= 400 and faulted[victim]["ids"] is None
        assert "kvattn ownership check failed" in faulted[victim]["message"]
        assert "reads: " in faulted[victim]["message"] or "writes: " in faulted[victim]["message"]
        clean = mine["runs"][f"clean-{seed}"]
        for rid, result in faulted.items():
            if rid != victim:
                assert result["status"] == 200 and result["ids"] == clean[rid]["ids"], rid


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
                victim = f"{fault}:{seed}-v"
                faulted = mine["runs"][f"{fault}-{seed}"]
                failed = sorted(rid for rid, r in faulted.items() if r["status"] != 200)
                counts[f"{fault}_injected"] += 1
                counts[f"{fault}_only_the_victim_failed"] += failed == [victim]
                counts["stock_victim_answered_otherwise"] += (
                    stock["runs"][f"{fault}-{seed}"][victim]["status"] == 200
                    and stock["runs"][f"{fault}-{seed}"][victim]["ids"]
                    != stock["runs"][f"clean-{seed}"][f"{seed}-v"]["ids"]
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
