"""Scenarios run inside vLLM (the vLLM environment's Python, engine in-process), for
test_vllm.py. One engine per invocation; results go to a JSON file:

    python tests/integrations/vllm/vllm_driver.py SCENARIO MODEL_DIR OUT_JSON [STORAGE_DIR]

``KVATTN_VLLM=1`` in the environment runs the engine on kvattn attention, without it on vLLM's own.
Scenarios: ``main`` (greedy tokens with chunked prefill and prefix caching, then four faults
injected into vLLM's bookkeeping, each next to a clean run of the same requests), ``same_step``
(prefix-cache hits on blocks written in the same step), ``variants SWITCH`` (a model whose
attention has a score switch: exact answers, the switch turned off, a fault), ``spec``
(speculative decoding with vLLM's n-gram proposer: tokens, its counters, a fault), ``domains
DIR`` (prefix hits within and across LoRA adapters and cache salts, adapters written to DIR;
a fault leaves the adapter or the salt out of vLLM's block hash), ``produce``
(a prefill instance writing KV files through vLLM's connector, and the incident's substitute),
``decode`` (a decode instance loading them).

Requests are added to the engine step by step (``LLMEngine.add_request``/``step``), so a fault can
wait for the moment it needs (a request decoding, another arriving). Each fault is injected the
same way on both attentions: on vLLM's own it must change the victim's tokens (the fault is real),
on kvattn's it must fail the victim and leave the others as in the clean run.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch
from vllm_prompts import BLOCK, FILLERS, LONG, SHORT, prompt


def make_llm(model: str, **overrides):
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

    def run(self, schedule, max_steps: int = 400, logprobs: bool = False, domains=None) -> dict:
        """``schedule``: ``(name, tokens, max_tokens, after)``; ``after`` is None (at once),
        ``("finished", name)`` or ``("tokens", name, k)``: added once that holds. With
        ``logprobs``, each result also has the log-probability of every token it produced.
        ``domains``: name -> ``(LoRARequest or None, cache salt or None)``."""
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
                    request = {"prompt_token_ids": tokens}
                    if salt is not None:
                        request["cache_salt"] = salt
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


def scenario(engine: Engine, schedule, inject, logprobs: bool = False, domains=None) -> dict:
    """A clean run and a faulted run of ``schedule`` (prefix cache reset before each)."""
    engine.llm.reset_prefix_cache()
    clean = engine.run(schedule, logprobs=logprobs, domains=domains)
    engine.llm.reset_prefix_cache()
    seen = len(engine.failures())
    injected, restore = inject(engine)
    try:
        faulted = engine.run(schedule, logprobs=logprobs, domains=domains)
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


def main_scenario(model: str) -> dict:
    engine = Engine(make_llm(model))
    out: dict = {}
    first = [(f"p{i}", prompt(10 + i, n), 8, None) for i, n in enumerate((17, 40, 75, 130))]
    shared = [
        (f"s{i}", prompt(10 + i, 96)[:64] + prompt(20 + i, 10 + 7 * i), 8, ("finished", "p3"))
        for i in (2, 3)
    ] + [("r3", prompt(13, 130), 8, ("finished", "p3"))]
    engine.llm.reset_prefix_cache()
    out["equality"] = engine.run(first + shared)
    v, o = prompt(30, 70), prompt(31, 50)
    out["foreign_entry"] = scenario(
        engine,
        [("victim", v, 10, None), ("other", o, 10, None), ("third", prompt(32, 20), 10, None)],
        foreign_entry,
    )
    out["early_free"] = scenario(
        engine,
        [
            ("victim", v, 12, None),
            ("other", prompt(33, 30), 12, None),
            ("newcomer", prompt(34, 45), 8, ("tokens", "victim", 2)),
        ],
        early_free,
    )
    out["lost_prefill"] = scenario(
        engine,
        [("victim", prompt(35, 100), 8, None), ("other", prompt(36, 40), 8, None)],
        lost_prefill,
    )
    a = prompt(37, 70)
    out["stale_prefix"] = scenario(
        engine,
        [
            ("writer", a, 4, None),
            ("overwriter", prompt(38, 20), 6, ("finished", "writer")),
            ("reader", a[:64] + prompt(39, 20), 8, ("finished", "overwriter")),
        ],
        stale_prefix,
    )
    out["failures_total"] = len(engine.failures())
    return out


def same_step_scenario(model: str) -> dict:
    """Prefix-cache hits on blocks written in the same step, through ``LLM.generate`` with
    vLLM's defaults (prefix caching on): a duplicated 70-token prompt, parallel sampling (the
    sampler restricted to the top token, so the samples compare exactly), and three requests
    sharing a 64-token system prompt, each batch admitted in one step."""
    from vllm import SamplingParams

    llm = make_llm(model, max_num_batched_tokens=2048)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    def generate(prompts, params=greedy):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [
            dict(
                tokens=[list(c.token_ids) for c in o.outputs],
                finish=[c.finish_reason for c in o.outputs],
                cached=o.num_cached_tokens or 0,
            )
            for o in outs
        ]

    out = {}
    p = prompt(60, 70)
    out["duplicate"] = generate([p, p])
    llm.reset_prefix_cache()
    out["parallel"] = generate(
        [prompt(61, 70)],
        SamplingParams(n=2, max_tokens=8, temperature=1.0, top_k=1, ignore_eos=True),
    )
    llm.reset_prefix_cache()
    system = prompt(62, 64)
    out["system_prompt"] = generate([system + prompt(63 + i, 20) for i in range(3)])
    engine = Engine(llm)
    out["failures"] = engine.failures()
    return out


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
    (``"lora"`` or ``"cache_salt"``) left out of the key of every block hashed while it is on,
    so a request hits blocks another domain computed. kvattn's digests do not use the engine's
    key: the hit must fail."""

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


def domains_scenario(model: str, folder: str) -> dict:
    """One prompt of two full blocks under two LoRA adapters, then under two cache salts, each
    request admitted after the one before finished: the same domain's second request is a
    prefix hit (``a2``, ``t1b``), another domain's is not (``b1``, ``t2``), clean and with the
    domain part left out of vLLM's block hash (the victim is then the other domain's
    request)."""
    from vllm.lora.request import LoRARequest

    engine = Engine(make_llm(model, enable_lora=True, max_loras=2, max_lora_rank=8))
    lora_a = LoRARequest("a", 1, write_adapter(model, os.path.join(folder, "lora-a"), 1))
    lora_b = LoRARequest("b", 2, write_adapter(model, os.path.join(folder, "lora-b"), 2))
    p = prompt(70, 70)

    def chain(names):
        return [
            (n, p, 8, None if i == 0 else ("finished", names[i - 1])) for i, n in enumerate(names)
        ]

    out = {}
    out["lora"] = scenario(
        engine,
        chain(["a1", "b1", "a2"]),
        key_without("lora"),
        domains={"a1": (lora_a, None), "b1": (lora_b, None), "a2": (lora_a, None)},
    )
    out["cache_salt"] = scenario(
        engine,
        chain(["t1", "t2", "t1b"]),
        key_without("cache_salt"),
        domains={"t1": (None, "tenant-1"), "t2": (None, "tenant-2"), "t1b": (None, "tenant-1")},
    )
    out["counts"] = counts(engine)
    out["failures_total"] = len(engine.failures())
    return out


# The score switches as vLLM's CPU attention and kvattn's backend both hold them on their impl.
SWITCH_OFF = {"logits_soft_cap": 0.0, "alibi_slopes": None, "sinks": None}


def switches_off(engine: Engine, switch: str):
    """Every attention layer's ``switch`` turned off (on either attention); returns the restorer."""
    impls = [
        m.impl for m in engine.runner.model.modules() if hasattr(getattr(m, "impl", None), switch)
    ]
    saved = [getattr(impl, switch) for impl in impls]
    for impl in impls:
        setattr(impl, switch, SWITCH_OFF[switch])
    return len(impls), lambda: [setattr(impl, switch, v) for impl, v in zip(impls, saved)]


def counts(engine: Engine) -> dict:
    """What kvattn's ledger followed (empty on vLLM's attention)."""
    from kvattn.integrations import vllm as integration

    state = integration.state_for(engine.runner.vllm_config)
    return dict(state.counts) if state is not None else {}


FP8_CACHES = ("fp8", "fp8_e5m2")  # vLLM's --kv-cache-dtype values (fp8 is e4m3)


def vllm_rows(cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V codes ``[num_blocks, block_size, kv_heads, head_dim]`` of vLLM's CPU fp8 cache
    ``[num_blocks, kv_heads, block_size, 2 * head_dim]`` uint8 as vLLM's own writer lays them out:
    per block and head, K dimension-major (for its AVX-512 dot products), then V token-major."""
    nb, hk, bs, _ = cache.shape
    halves = cache.reshape(nb, hk, 2, bs * head_dim)
    k = halves[:, :, 0].reshape(nb, hk, head_dim, bs).permute(0, 3, 1, 2)
    v = halves[:, :, 1].reshape(nb, hk, bs, head_dim).permute(0, 2, 1, 3)
    return k, v


def compare_fp8_writes(engine: Engine, cache_dtype: str):
    """On kvattn's attention: every KV write of the engine is also done by vLLM's own CPU cache
    writer into a scratch cache, and the codes of the written slots compared (kvattn keeps K
    token-major, so the comparison is per element). Returns the tally and the restorer."""
    from vllm import _custom_ops as ops

    from kvattn.integrations.vllm_backend import KVAttnImpl

    tally = {"calls": 0, "elements": 0, "mismatches": 0}

    def make(original):
        def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
            original(self, layer, key, value, kv_cache, slot_mapping)
            n = slot_mapping.shape[0]
            live = slot_mapping[:n] >= 0
            if not bool(live.any()):
                return
            nb, hk, bs, _ = kv_cache.shape
            d = self.head_size
            scratch = torch.zeros_like(kv_cache)
            keys, values = scratch.view(nb, hk, bs * 2, d).chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(
                key[:n],
                value[:n],
                keys,
                values,
                slot_mapping[:n],
                "vec",
                k_scale=layer._k_scale_float,
                v_scale=layer._v_scale_float,
                kv_cache_dtype=cache_dtype,
            )
            want_k, want_v = vllm_rows(scratch, d)
            got_k, got_v = (t.view(torch.uint8) for t in self._pools(kv_cache))
            slots = slot_mapping[:n][live].long()
            page, slot = slots // bs, slots % bs
            for got, want in ((got_k, want_k), (got_v, want_v)):
                tally["elements"] += got[page, slot].numel()
                tally["mismatches"] += int((got[page, slot] != want[page, slot]).sum())
            tally["calls"] += 1

        return do_kv_cache_update

    return tally, patch(KVAttnImpl, "do_kv_cache_update", make)


def probe_fp8_codes(cache_dtype: str) -> dict:
    """vLLM's CPU cache writer and kvattn's ``write_kv(fp8_rounding="toward_zero")`` on values
    where a rounding rule is easy to get wrong (magnitudes over the float32 range with both
    signs, zeros, infinities, NaN, values past the format's largest), in each source dtype and
    for scales below, at and above 1: the elements compared, those that differ, and of those the
    ones kvattn's rule documents (a negative float32-subnormal quotient: vLLM -0, kvattn +0)."""
    from vllm import _custom_ops as ops

    import kvattn
    from kvattn.integrations.vllm import FP8_CACHE_DTYPES

    fmt = FP8_CACHE_DTYPES[cache_dtype]
    nb, hk, bs, d = 8, 2, BLOCK, 64
    g = torch.Generator().manual_seed(0)
    tally = {"elements": 0, "mismatches": 0, "subnormal_sign": 0}
    for src in (torch.float32, torch.float16, torch.bfloat16):
        for scale in (0.37, 1.0, 3.1):
            n = nb * bs
            mags = torch.exp(torch.empty(n, hk, d).uniform_(-100, 25, generator=g))
            signs = torch.randint(0, 2, (n, hk, d), generator=g) * 2 - 1
            x = mags * signs
            x.view(-1)[:8] = torch.tensor(
                [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e30, -1e30, 1e-45]
            )
            x = x.to(src)
            cache = torch.zeros(nb, hk, bs, 2 * d, dtype=torch.uint8)
            keys, values = cache.view(nb, hk, bs * 2, d).chunk(2, dim=2)
            slots = torch.arange(n)
            ops.cpu_attn_reshape_and_cache(
                x,
                x,
                keys,
                values,
                slots,
                "vec",
                k_scale=scale,
                v_scale=scale,
                kv_cache_dtype=cache_dtype,
            )
            want, _ = vllm_rows(cache, d)
            pools = torch.zeros(nb, bs, hk, d, dtype=fmt), torch.zeros(nb, bs, hk, d, dtype=fmt)
            tags = torch.full((nb,), kvattn.reserved_tag(1))
            kvattn.write_kv(
                x,
                x,
                *pools,
                slots,
                tags,
                1,
                k_scale=scale,
                v_scale=scale,
                fp8_rounding="toward_zero",
            )
            got = pools[0].view(torch.uint8)
            differ = got.reshape(n, hk, d) != want.reshape(n, hk, d)
            q = x.float() / torch.tensor(scale)
            documented = differ & (q < 0) & (q.abs() < torch.finfo(torch.float32).tiny)
            tally["elements"] += differ.numel()
            tally["mismatches"] += int(differ.sum())
            tally["subnormal_sign"] += int(documented.sum())
    return tally


def variants_scenario(model: str, switch: str) -> dict:
    """A model whose attention has the switch ``switch``: greedy tokens and their
    log-probabilities with chunked prefill and prefix caching; the foreign block-table fault next
    to a clean run. A score switch is then turned off in every layer (it must change the answer,
    or the comparison proves nothing). A sliding window runs instead on a pool small enough that
    the blocks vLLM frees out of the window are handed out again, with decodes long enough that
    the window moves, and the foreign entry once more where the window has left the victim's
    first block (nothing reads it: no change, no failure). A ``switch`` that is a vLLM
    ``--kv-cache-dtype`` (``auto`` or one of ``FP8_CACHES``) runs the model on that cache; on
    kvattn's attention every KV write into an fp8 cache is compared with vLLM's own writer's
    codes."""
    window = switch == "sliding_window"
    fp8 = switch in FP8_CACHES
    cache = fp8 or switch == "auto"  # a KV cache dtype, not a score switch
    with open(os.path.join(model, "config.json")) as f:
        groups = len(set(json.load(f).get("layer_types") or ["one"]))  # vLLM's KV cache groups
    # 20 blocks a group: a request holds blocks in every group.
    engine = Engine(
        make_llm(
            model,
            **(dict(num_gpu_blocks_override=20 * groups) if window else {}),
            **(dict(kv_cache_dtype=switch) if cache else {}),
        )
    )
    from kvattn.integrations import vllm as integration

    tally, restore_tally = ({}, lambda: None)
    if fp8 and integration.enabled():
        tally, restore_tally = compare_fp8_writes(engine, switch)
    out = {"fp8_probe": probe_fp8_codes(switch) if fp8 and integration.enabled() else {}}
    new = 40 if window else 8
    schedule = [(f"p{i}", prompt(10 + i, n), new, None) for i, n in enumerate((17, 40, 75, 130))]
    # The prefix hit: 64 tokens once p3 is done; under the window 128 tokens as p3 starts
    # decoding, while the blocks under the hit's window still serve p3 (vLLM's sliding-window
    # lookup found no hit here on blocks the window had left), and the blocks before it come as
    # vLLM's null block.
    shared = prompt(13, 130)[: 128 if window else 64]
    schedule.append(
        ("s3", shared + prompt(23, 30), new, ("tokens", "p3", 1) if window else ("finished", "p3"))
    )
    engine.llm.reset_prefix_cache()
    out["equality"] = engine.run(schedule, logprobs=True)
    restore_tally()
    out["fp8_writes"] = tally
    if not (window or cache):
        engine.llm.reset_prefix_cache()
        layers, restore = switches_off(engine, switch)
        try:
            out["switch_off"] = engine.run(schedule, logprobs=True)
        finally:
            restore()
        out["layers_switched"] = layers
    out["foreign_entry"] = scenario(
        engine,
        [
            ("victim", prompt(30, 70), 10, None),
            ("other", prompt(31, 50), 10, None),
            ("third", prompt(32, 20), 10, None),
        ],
        foreign_entry,
        logprobs=True,
    )
    if groups > 1:  # the full-attention layers' group
        out["foreign_entry_full"] = scenario(
            engine,
            [("victim", prompt(30, 70), 10, None), ("other", prompt(31, 50), 10, None)],
            lambda e: foreign_entry(e, group=1),
            logprobs=True,
        )
    if window:
        out["before_window"] = scenario(
            engine,
            [("victim", prompt(33, 130), 10, None), ("other", prompt(34, 50), 10, None)],
            foreign_entry,
            logprobs=True,
        )
        # The other bookkeeping faults, each on a block inside the victim's window when it is
        # read (the window is 48 tokens; the victims' first blocks are still in it).
        out["early_free"] = scenario(
            engine,
            [
                ("victim", prompt(30, 70), 12, None),
                ("other", prompt(33, 30), 12, None),
                ("newcomer", prompt(34, 45), 8, ("tokens", "victim", 2)),
            ],
            early_free,
            logprobs=True,
        )
        out["lost_prefill"] = scenario(
            engine,
            [("victim", prompt(35, 100), 8, None), ("other", prompt(36, 40), 8, None)],
            lost_prefill,
            logprobs=True,
        )
        a = prompt(37, 70)
        out["stale_prefix"] = scenario(
            engine,
            [
                ("writer", a, 4, None),
                ("overwriter", prompt(38, 20), 6, ("finished", "writer")),
                ("reader", a[:64] + prompt(39, 20), 8, ("finished", "overwriter")),
            ],
            stale_prefix,
            logprobs=True,
        )
    out["failures_total"] = len(engine.failures())
    out["counts"] = counts(engine)
    return out


# -- disaggregated prefill through vLLM's KV connector ----------------------------------------

PREFILL_CAPACITY = 128


def _transfer_dir(storage: str, tokens: list[int]) -> str:
    """The folder the debug connector keys a prompt's transfer by (its prompt, block-aligned)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import align_to_block_size
    from vllm.utils.hashing import safe_hash

    n = align_to_block_size(len(tokens), BLOCK)
    data = torch.tensor(tokens)[:n].numpy().tobytes()
    return os.path.join(storage, safe_hash(data, usedforsecurity=False).hexdigest())


def produce_scenario(model: str, storage: str) -> dict:
    """The prefill instance: vLLM's ExampleConnector as producer writes each prompt's KV to files
    (rows of the instance's own cache layout: vLLM's CPU attention writes an ISA-specific block
    interior, kvattn plain rows, so prefill and decode instances run the same attention). The
    long prompt is over its capacity; like the incident's prefill node it substitutes a
    placeholder (its first token), transfers that one token of KV under the long prompt's key and
    reports the transfer done."""
    import safetensors.torch

    transfer = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": storage},
    }
    engine = Engine(make_llm(model, max_model_len=PREFILL_CAPACITY, kv_transfer_config=transfer))
    from vllm.exceptions import VLLMValidationError

    refused = ""
    try:
        engine.run([("long", LONG, 1, None)])
    except VLLMValidationError as e:
        refused = str(e).splitlines()[0]
    # The placeholder's KV: the first token of the long prompt, prefilled here, one row kept.
    engine.run([("short", SHORT, 1, None), ("head", LONG[: BLOCK + 2], 1, None)])
    head, target = _transfer_dir(storage, LONG[: BLOCK + 2]), _transfer_dir(storage, LONG)
    os.makedirs(target, exist_ok=True)
    for name in sorted(os.listdir(head)):
        rows = safetensors.torch.load_file(os.path.join(head, name))["kv_cache"]
        safetensors.torch.save_file({"kv_cache": rows[:1].contiguous()}, os.path.join(target, name))
    return dict(refused=refused, files=sorted(os.listdir(target)))


def decode_scenario(model: str, storage: str) -> dict:
    """The decode instance, loading through the checked receiver: earlier requests fill the pool,
    then the short prompt (transferred whole) and the long one (one row of KV arrived)."""
    transfer = {
        "kv_connector": "CheckedExampleConnector",
        "kv_connector_module_path": "kvattn.integrations.vllm_connector",
        "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"shared_storage_path": storage},
    }
    engine = Engine(
        make_llm(
            model,
            kv_transfer_config=transfer,
            num_gpu_blocks_override=20,
            enable_prefix_caching=False,
        )
    )
    out = {}
    for i, tokens in enumerate(FILLERS):
        out.update(engine.run([(f"filler{i}", tokens, 4, None)]))
    out.update(engine.run([("short", SHORT, 8, None)]))
    out.update(engine.run([("long", LONG, 8, None)]))
    return dict(results=out, failures=[(engine.name_of(r), m) for r, m in engine.failures()])


def local_scenario(model: str) -> dict:
    """The same requests decoded on one instance, no transfer: the answers a correct transfer
    gives."""
    engine = Engine(make_llm(model, enable_prefix_caching=False))
    return engine.run([("short", SHORT, 8, None), ("long", LONG, 8, None)])


# vLLM's n-gram proposer: up to 3 draft tokens a step, from the longest match of the last 1-4
# tokens earlier in the request's own tokens.
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 1,
}


def spec_counters(llm) -> dict:
    """vLLM's speculative-decoding counters (drafts, draft tokens, accepted tokens) so far."""
    return {
        m.name.split("spec_decode_")[1]: m.value
        for m in llm.get_metrics()
        if "spec_decode_num" in m.name and hasattr(m, "value")
    }


def spec_scenario(model: str) -> dict:
    """Speculative decoding with the n-gram proposer: each decode step of a request verifies its
    draft tokens in one causal extend over its own KV, writes KV for every draft, and vLLM rolls
    back past the first rejected one (those slots are rewritten by the next step). Chunked
    prefill and prefix caching on, a prompt that repeats itself (so drafts are found and some
    accepted), a later request hitting its cached blocks, a next turn hitting blocks of the
    answer; then a foreign table entry next to a clean run, under speculation."""
    llm = make_llm(model, disable_log_stats=False, speculative_config=NGRAM)
    engine = Engine(llm)
    loop = (prompt(40, 12) * 6)[:70]
    # A long answer fills five blocks, each ending at an accepted draft or at a step's first
    # token as the acceptance falls.
    schedule = [
        ("loop", loop, 160, None),
        ("p1", prompt(41, 37), 48, None),
        ("p2", prompt(42, 90), 40, None),
        ("shared", loop[:64] + prompt(43, 9), 32, ("finished", "loop")),
    ]
    llm.reset_prefix_cache()
    out: dict = {"equality": engine.run(schedule, logprobs=True), "spec": spec_counters(llm)}
    # The next turn of "loop": its prompt is the first's and its answer, so it hits the blocks
    # that accepted drafts filled.
    second = loop + out["equality"]["loop"]["tokens"] + prompt(44, 7)
    out["second_turn"] = engine.run([("second", second, 16, None)], logprobs=True)
    out["foreign_entry"] = scenario(
        engine,
        [
            ("victim", prompt(30, 70), 24, None),
            ("other", prompt(31, 50), 24, None),
            ("third", prompt(32, 20), 24, None),
        ],
        foreign_entry,
    )
    out["spec_total"] = spec_counters(llm)
    out["counts"] = counts(engine)
    out["failures_total"] = len(engine.failures())
    return out


if __name__ == "__main__":
    name, model_dir, out_path = sys.argv[1:4]
    extra = sys.argv[4:]
    result = {
        "main": main_scenario,
        "produce": produce_scenario,
        "decode": decode_scenario,
        "local": local_scenario,
        "same_step": same_step_scenario,
        "variants": variants_scenario,
        "spec": spec_scenario,
        "domains": domains_scenario,
    }[name](model_dir, *extra)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
