"""Scenarios run inside vLLM (the vLLM environment's Python, engine in-process), for
test_vllm.py. One engine per invocation; results go to a JSON file:

    python tests/integrations/vllm/vllm_driver.py SCENARIO MODEL_DIR OUT_JSON [STORAGE_DIR]

``KVATTN_VLLM=1`` in the environment runs the engine on kvattn attention, without it on vLLM's own.
Scenarios: ``main [LAYOUT]`` (greedy tokens with chunked prefill and prefix caching, then four
faults injected into vLLM's bookkeeping, each next to a clean run of the same requests; ``gpu``
runs kvattn's backend of vLLM's GPU cache layout, then the configurations that layout refuses
and kvattn's answers to vLLM's CUDA backend selection), ``same_step``
(prefix-cache hits on blocks written in the same step), ``variants SWITCH`` (a model whose
attention has a score switch: exact answers, the switch turned off, a fault), ``spec``
(speculative decoding with vLLM's n-gram proposer: tokens, its counters, a fault), ``produce``
(a prefill instance writing KV files through vLLM's connector, and the incident's substitute),
``decode`` (a decode instance loading them).

Requests are added to the engine step by step (``LLMEngine.add_request``/``step``), so a fault can
wait for the moment it needs (a request decoding, another arriving); the engine runner and the
fault injectors are the conformance suite's (:mod:`kvattn.conformance.vllm`). Each fault is injected the
same way on both attentions: on vLLM's own it must change the victim's tokens (the fault is real),
on kvattn's it must fail the victim and leave the others as in the clean run.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch
from vllm_prompts import BLOCK, FILLERS, LONG, SHORT, prompt

from kvattn.conformance.vllm import (
    Engine,
    early_free,
    foreign_entry,
    lost_prefill,
    make_llm,
    patch,
    scenario,
    stale_prefix,
)
from kvattn.conformance.vllm import ledger as _ledger


def counts(engine: Engine) -> dict:
    """What kvattn's ledger followed (empty on vLLM's attention)."""
    return _ledger(engine).get("counts", {})


def cache_layout(engine: Engine) -> dict:
    """The backend the engine's first attention layer runs and how its KV cache lies in memory
    (the logical view ``[num_blocks, kv_heads, block_size, 2 * head_dim]`` and its strides)."""
    runner = engine.runner
    context = runner.compilation_config.static_forward_context
    name = min(n for n, layer in context.items() if hasattr(layer, "attn_backend"))
    layer = context[name]
    return dict(
        backend=layer.attn_backend.get_name(),
        backend_class=layer.attn_backend.__name__,
        impl=type(layer.impl).__name__,
        kv_cache_layout=runner.vllm_config.cache_config.kv_cache_layout,
        shape=list(layer.kv_cache.shape),
        stride=list(layer.kv_cache.stride()),
        cudagraph_mode=runner.vllm_config.compilation_config.cudagraph_mode.name,
    )


def refused_at_setup(model: str, **overrides) -> str:
    """The first line of the error an engine of ``overrides`` stops with as it is set up."""
    try:
        make_llm(model, **overrides)
    except Exception as e:  # vLLM wraps some setup errors in its own types
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return ""


def cuda_selection() -> dict:
    """What vLLM's CUDA platform gets for a layer with kvattn enabled, asked as vLLM's selector
    asks it (``get_attn_backend_cls(backend, attn_selector_config=..., num_heads=...)``) of a
    stand-in platform class through the hook kvattn installs on ``CudaPlatform`` (whose module
    does not import on this CPU build): the class path, or the error's first line."""
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

    from kvattn.integrations import vllm as integration

    capability = DeviceCapability(9, 0)

    class Platform:
        @classmethod
        def get_device_capability(cls):
            return capability

        @classmethod
        def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
            return "vLLM's own choice"

    integration._install_cuda_selection(Platform)
    base = AttentionSelectorConfig(
        head_size=128, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=None
    )
    cases = {
        "default": (None, base, (9, 0)),
        "sm80": (None, base, (8, 0)),
        "sm100": (None, base, (10, 0)),
        "named_kvattn": (AttentionBackendEnum[integration.GPU_BACKEND_NAME], base, (9, 0)),
        "named_flash_attn": (AttentionBackendEnum.FLASH_ATTN, base, (9, 0)),
        "window_sinks": (None, base._replace(has_sliding_window=True, has_sink=True), (9, 0)),
        "mla": (None, base._replace(use_mla=True, head_size=576), (9, 0)),
        "fp8": (None, base._replace(kv_cache_dtype="fp8"), (9, 0)),
        "cross_attention": (None, base._replace(attn_type="encoder_decoder"), (9, 0)),
        "kv_connector": (None, base._replace(use_kv_connector=True), (9, 0)),
    }
    out = {}
    for name, (selected, config, (major, minor)) in cases.items():
        capability = DeviceCapability(major, minor)
        try:
            out[name] = Platform.get_attn_backend_cls(
                selected, attn_selector_config=config, num_heads=8
            )
        except Exception as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out


def block_faults(engine: Engine) -> dict:
    """A foreign table entry, an early free and a lost prefill, each next to a clean run of the
    same requests (the victim is ``victim``)."""
    v, o = prompt(30, 70), prompt(31, 50)
    return dict(
        foreign_entry=scenario(
            engine,
            [("victim", v, 10, None), ("other", o, 10, None), ("third", prompt(32, 20), 10, None)],
            foreign_entry,
        ),
        early_free=scenario(
            engine,
            [
                ("victim", v, 12, None),
                ("other", prompt(33, 30), 12, None),
                ("newcomer", prompt(34, 45), 8, ("tokens", "victim", 2)),
            ],
            early_free,
        ),
        lost_prefill=scenario(
            engine,
            [("victim", prompt(35, 100), 8, None), ("other", prompt(36, 40), 8, None)],
            lost_prefill,
        ),
    )


def main_scenario(model: str, layout: str = "cpu") -> dict:
    """``layout``: kvattn's backend class by vLLM cache layout (``KVATTN_VLLM_LAYOUT``: ``gpu``
    runs the class vLLM's CUDA platform gets, here on the CPU); vLLM's own attention ignores it.
    On the GPU layout, the configurations that layout refuses are then set up once each."""
    from kvattn.integrations.vllm import LAYOUT_ENV

    os.environ[LAYOUT_ENV] = layout
    engine = Engine(make_llm(model))
    out: dict = {"layout": cache_layout(engine)}
    first = [(f"p{i}", prompt(10 + i, n), 8, None) for i, n in enumerate((17, 40, 75, 130))]
    shared = [
        (f"s{i}", prompt(10 + i, 96)[:64] + prompt(20 + i, 10 + 7 * i), 8, ("finished", "p3"))
        for i in (2, 3)
    ] + [("r3", prompt(13, 130), 8, ("finished", "p3"))]
    engine.llm.reset_prefix_cache()
    out["equality"] = engine.run(first + shared)
    out["equality_ledger"] = _ledger(engine)
    out.update(block_faults(engine))
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
    if layout == "gpu":
        transfer = {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": tempfile.mkdtemp()},
        }
        out["refused"] = {
            "fp8": refused_at_setup(model, kv_cache_dtype="fp8"),
            "connector": refused_at_setup(model, kv_transfer_config=transfer),
        }
        out["cuda_selection"] = cuda_selection()
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


def mla_scenario(model: str) -> dict:
    """A DeepSeek-V2-style model (multi-head latent attention: vLLM's MLA layer and latent cache):
    greedy tokens of prompts of 5 to 130 tokens in one batch and a request arriving while they
    decode, then three faults each next to a clean run of the same requests (vLLM's CPU platform
    turns chunked prefill and prefix caching off for MLA models, so the stale-prefix fault has
    nothing to act on)."""
    engine = Engine(make_llm(model, block_size=16))
    out: dict = {"block_size": engine.runner.cache_config.block_size}
    backends = {
        type(layer.impl).__name__
        for layer in engine.runner.compilation_config.static_forward_context.values()
        if hasattr(layer, "impl")
    }
    out["impls"] = sorted(backends)
    first = [(f"p{i}", prompt(10 + i, n), 8, None) for i, n in enumerate((5, 17, 40, 75, 130))]
    late = [("late", prompt(16, 33), 8, ("tokens", "p2", 3))]
    out["equality"] = engine.run(first + late)
    out["equality_ledger"] = _ledger(engine)
    out.update(block_faults(engine))
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
        "mla": mla_scenario,
    }[name](model_dir, *extra)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
