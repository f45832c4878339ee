"""The engine-level differential suite of the transformers adapter, which is the conformance
suite's transformers run (:mod:`kvattn.conformance.transformers` says what the workloads hold and
how each fault is made): seeded random workloads through transformers continuous batching on the
engine's stock attention and under ``kvattn_attention()``, clean and with one bookkeeping fault.

Clean runs: kvattn's tokens equal stock's for every request, no request fails, no page is refused
and no write dropped, and the engine's own events (prefix hits, de-duplicated blocks, chunked
prefills, preemptions, evictions, reused blocks) are the same in both runs: the adapter changes no
scheduling decision. Fault runs: under kvattn the victim (the reader for ``stale_prefix``), and
only the victim, fails with the ownership error, and every other request's tokens equal the clean
run's. Under stock attention the same fault changes the victim's tokens: asserted for at least
one seed per fault kind (the twin: the fault is real), counted per seed (``early_free`` changes
nothing until another request has overwritten the block).

A block shared through the engine's hash table is accepted only for the writer recorded when the
engine registered that hash, and only if kvattn's own digest of the writer's token prefix equals
the reader's (the ``hash_collision`` fault: a block the engine matches to a prompt whose first
page differs fails that reader); a pair of tests, run in phases while the engine is idle between
requests, holds that rule: a cached system block freed, refilled with the same page by the next
request (registered anew) and shared by a third one passes, and its twin, refilled with another
page under the hash the engine kept, fails the third request.

The last tests print the counts (``pytest -s``) and write them to
``build/differential/transformers.json``, and the conformance table to
``build/differential/conformance-transformers.md``. The runs are computed once per test run and
shared by the xdist workers through files under a lock per seed.
"""

from __future__ import annotations

import fcntl
import json
import os
import pathlib
import random
import re
from collections import Counter

import pytest

pytest.importorskip("transformers")

from kvattn.conformance import transformers as conformance

if conformance.why_unsupported():
    pytest.skip(conformance.why_unsupported(), allow_module_level=True)

from transformers.generation.continuous_batching.cache_allocators import FULL_ATTENTION
from transformers.generation.continuous_batching.requests import RequestStatus

from kvattn.conformance.transformers import OWNERSHIP_ERROR, PAGE, VOCAB, compute_seed, run

ROOT = pathlib.Path(__file__).resolve().parents[3]
SEEDS = (0, 1, 2, 3, 4)
FAULTS = tuple(conformance.FAULTS)


def _store() -> pathlib.Path:
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID", str(os.getpid()))
    path = ROOT / "build" / "differential" / "runs" / run_id
    path.mkdir(parents=True, exist_ok=True)
    return path


def seed_runs(model, seed: int) -> dict:
    """The runs of ``seed``, computed by the first worker that asks (one lock per seed, so two
    workers compute two seeds at once)."""
    store = _store()
    path = store / f"seed-{seed}.json"
    with open(store / f"seed-{seed}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            path.write_text(json.dumps(compute_seed(model, seed)))
    return json.loads(path.read_text())


def _tokens(run_: dict) -> dict:
    return {rid: r["tokens"] for rid, r in run_["results"].items()}


@pytest.mark.parametrize("seed", SEEDS)
def test_clean_workload_matches_stock(model, seed):
    data = seed_runs(model, seed)
    stock, checked = data["runs"]["clean/stock"], data["runs"]["clean/kvattn"]
    requests = list(data["workload"]["prompts"])
    assert sorted(stock["results"]) == sorted(checked["results"]) == sorted(requests)
    assert [r["error"] for r in stock["results"].values()] == [None] * len(requests)
    assert {rid: r["error"] for rid, r in checked["results"].items()} == dict.fromkeys(requests)
    assert _tokens(checked) == _tokens(stock)
    stats = checked["stats"]
    assert stats["failed_requests"] == [] and stats["refused_pages"] == 0
    assert stats["dropped_writes"] == 0
    assert stats["pages_checked"] > 0 and stats["attention_calls"] == 2 * stats["forwards"]
    # The adapter changes no scheduling decision of the engine.
    assert checked["events"] == stock["events"]
    assert stats["forwards"] == stock["events"]["forwards"]


@pytest.mark.parametrize("seed", SEEDS)
def test_each_fault_fails_only_its_victim(model, seed):
    """The twin of the clean test: with one bookkeeping fault, kvattn fails exactly the request
    whose KV the fault touched, and the others' tokens are the clean run's."""
    runs = seed_runs(model, seed)["runs"]
    clean = _tokens(runs["clean/stock"])
    for kind in FAULTS:
        checked, stock = runs[f"{kind}/kvattn"], runs[f"{kind}/stock"]
        fault = checked["fault"]
        assert fault["applied"] and stock["fault"]["applied"], f"seed {seed}: {kind} not applied"
        assert sorted(checked["results"]) == sorted(stock["results"]) == sorted(clean)
        victim = fault["victim"]
        result = checked["results"][victim]
        assert result["status"] == int(RequestStatus.FAILED), (seed, kind)
        assert result["error"].startswith(OWNERSHIP_ERROR), (seed, kind, result["error"])
        assert checked["stats"]["failed_requests"] == [victim], (seed, kind)
        for rid, other in checked["results"].items():
            if rid != victim:
                assert other["error"] is None, (seed, kind, rid, other["error"])
                assert other["tokens"] == clean[rid], (seed, kind, rid)


def _refill(same_tokens: bool) -> dict:
    """Three requests, one after the other: ``req_a`` (a system page and one token) finishes, and
    the engine keeps its system block cached under the page's hash; the block goes back to the
    free pool (how depends on the test) and ``req_b`` is allocated that same block, filling it with
    the system page again (``same_tokens``) or with a page of its own; then ``req_c`` (the system
    page and another token) reaches the block through the system page's hash."""
    rng = random.Random(18)
    system, other = ([rng.randrange(VOCAB) for _ in range(PAGE)] for _ in range(2))
    prompts = {
        "req_a": system + [rng.randrange(VOCAB)],
        "req_b": (system if same_tokens else other) + [rng.randrange(VOCAB)],
        "req_c": system + [rng.randrange(VOCAB)],
    }
    return dict(
        prompts=prompts,
        max_new={"req_a": 2, "req_b": 6, "req_c": 6},
        num_blocks=8,
        max_batch_tokens=16,
        phases=[["req_a"], ["req_b"], ["req_c"]],
    )


def _evict(cache) -> None:
    """The engine's own eviction of the blocks it keeps cached (what memory pressure does)."""
    assert cache.evict_cached_blocks(), "nothing was cached to evict"


def _free_keeping_hashes(cache) -> None:
    """The bug: the cached blocks go back to the free pool with their hashes still registered."""
    allocator = cache.cache_allocators[FULL_ATTENTION]
    blocks = list(allocator.ledger.cached_blocks)
    assert blocks, "nothing was cached"
    allocator.ledger.cached_blocks.clear()
    allocator.pool.free_blocks(allocator.index, blocks)


def _refill_runs(model, same_tokens: bool, between) -> tuple[dict, dict]:
    workload = _refill(same_tokens)
    stock = run(model, workload, kvattn=False, between=between)
    checked = run(model, workload, kvattn=True, between=between)
    for r in (stock, checked):
        assert sorted(r["results"]) == sorted(workload["prompts"])
        tables = r["tables"]
        # The scenario happened: one physical block passed from req_a to req_b and req_c read it.
        assert tables["req_a"][0] == tables["req_b"][0] == tables["req_c"][0], tables
    return stock, checked


def test_block_refilled_under_its_old_hash_is_shared_under_its_new_writer(model):
    """Regression: the engine evicts a cached system block, hands the same physical block to the
    next request, which writes the same page into it, and registers it under the same hash again;
    a later request sharing it must expect the new writer. The adapter had kept the first writer's
    owner for that (block, hash) pair and failed every later sharer (OWNER_MISMATCH)."""
    stock, checked = _refill_runs(model, same_tokens=True, between=_evict)
    assert [r["error"] for r in checked["results"].values()] == [None] * 3
    assert _tokens(checked) == _tokens(stock)
    assert checked["stats"]["refused_pages"] == 0
    assert checked["events"]["prefix_hits"] == 1


def test_block_refilled_under_a_stale_hash_fails_its_sharer(model):
    """The twin: the block goes back to the pool with its hash still registered and the next
    request writes a page of its own into it. The third request matches the stale hash and reads
    that page: stock attention gives it other tokens than its clean run, kvattn fails it and only
    it. Registering the stale pair anew once the second request completes the block would accept
    the share; only a registration the engine makes is proof."""
    clean, _ = _refill_runs(model, same_tokens=True, between=_evict)
    stock, checked = _refill_runs(model, same_tokens=False, between=_free_keeping_hashes)
    assert stock["results"]["req_c"]["tokens"] != clean["results"]["req_c"]["tokens"]
    assert checked["results"]["req_c"]["error"].startswith(OWNERSHIP_ERROR)
    assert checked["stats"]["failed_requests"] == ["req_c"]
    for rid in ("req_a", "req_b"):
        assert checked["results"][rid]["error"] is None
        assert checked["results"][rid]["tokens"] == stock["results"][rid]["tokens"]


def _summary(all_runs: dict) -> dict:
    clean = Counter()
    faults = {kind: Counter() for kind in FAULTS}
    for data in all_runs.values():
        stock, checked = data["runs"]["clean/stock"], data["runs"]["clean/kvattn"]
        clean["runs"] += 1
        clean["requests"] += len(checked["results"])
        clean["generated_tokens"] += sum(len(r["tokens"]) for r in checked["results"].values())
        clean["requests_equal_to_stock"] += sum(
            r["tokens"] == stock["results"][rid]["tokens"] for rid, r in checked["results"].items()
        )
        clean.update(checked["events"])
        clean.update({k: v for k, v in checked["stats"].items() if k != "failed_requests"})
        clean["failed_requests"] += len(checked["stats"]["failed_requests"])
        clean_tokens = _tokens(stock)
        for kind in FAULTS:
            run_stock, run_checked = data["runs"][f"{kind}/stock"], data["runs"][f"{kind}/kvattn"]
            victim = run_checked["fault"]["victim"]
            failed = run_checked["stats"]["failed_requests"]
            counts = faults[kind]
            counts["injected"] += run_checked["fault"]["applied"]
            counts["detected"] += victim in failed and run_checked["results"][victim][
                "error"
            ].startswith(OWNERSHIP_ERROR)
            counts["only_the_victim_failed"] += failed == [victim]
            for reason in re.findall(
                r"^reads: (\S+) on",
                run_checked["results"][victim]["error"] or "",
                flags=re.MULTILINE,
            ):
                counts[f"victim_refused_{reason}"] += 1
            counts["others_equal_to_clean"] += all(
                r["tokens"] == clean_tokens[rid]
                for rid, r in run_checked["results"].items()
                if rid != victim
            )
            counts["stock_victim_tokens_changed"] += (
                run_stock["results"][victim]["tokens"] != clean_tokens[victim]
            )
            if kind == "early_free":
                counts["stock_block_reused_while_victim_ran"] += bool(
                    run_stock["fault"].get("reused_by")
                )
    return dict(
        seeds=list(all_runs),
        clean=dict(clean),
        faults={kind: dict(c) for kind, c in faults.items()},
        workloads={
            seed: dict(
                requests=len(d["workload"]["prompts"]),
                num_blocks=d["workload"]["num_blocks"],
                max_batch_tokens=d["workload"]["max_batch_tokens"],
            )
            for seed, d in all_runs.items()
        },
    )


def test_faults_change_stock_tokens_and_counts_are_written(model):
    """Each fault kind changes the victim's tokens on stock attention in at least one seed (so the
    faults are real, not absorbed by the engine), and the clean runs exercised what the workloads
    are for; the counts go to stdout and build/differential/transformers.json."""
    summary = _summary({seed: seed_runs(model, seed) for seed in SEEDS})
    out = ROOT / "build" / "differential" / "transformers.json"
    out.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    print("\ntransformers differential suite:", json.dumps(summary, indent=2, sort_keys=True))
    for kind, counts in summary["faults"].items():
        assert counts.get("stock_victim_tokens_changed", 0) >= 1, kind
    clean = summary["clean"]
    for event in (
        "prefix_hits",
        "deduplicated_blocks",
        "chunked_prefills",
        "preemptions",
        "evictions",
        "blocks_reused",
    ):
        assert clean.get(event, 0) > 0, event


def test_conformance_table(model):
    """The table ``python -m kvattn.conformance --engine transformers`` prints, from the same
    runs: every fault caught with the victim alone affected, no clean request refused; written to
    build/differential/conformance-transformers.md."""
    report = conformance.judge({seed: seed_runs(model, seed) for seed in SEEDS})
    text = report.markdown()
    (ROOT / "build" / "differential" / "conformance-transformers.md").write_text(text)
    print(text)
    assert sorted({row.cls for row in report.rows}) == [1, 2, 3, 4]
    assert sorted(report.not_replayed) == [5, 6]
    assert all(row.ok and row.runs == len(SEEDS) for row in report.rows)
    assert all(row.stock_changed >= 1 for row in report.rows)
    assert report.false_refusals == 0
    assert report.clean_equal_to_stock == report.clean_requests > 50
    assert report.ok and text.endswith("Conformant.\n")
