"""The transformers adapter on models with attention variants, end to end under continuous batching
with tiny random-weight models built from configs (no downloads): sliding-window layers (Mistral:
every layer; Qwen2: the layers ``layer_types`` makes sliding), Gemma 2 (sliding and full layers
alternating, logit soft-cap) and gpt-oss (sliding and full layers, attention sinks).

Greedy tokens are compared exactly with per-prompt ``generate`` under transformers' own eager
attention (neither the engine's cache nor kvattn's): float32 softmaxes over the same K/V, and the
argmax over a 128-token vocabulary is stable under their rounding differences for these weights.
Each model also runs with the adapter's variant switches dropped, which must change the tokens:
the switch, not luck, makes them equal. The engine's own ``paged|eager`` attention is not the
reference: in transformers 5.24 it ignores Gemma 2's soft-cap.

The corruption tests pair a checked run (the victim fails, the others match) with an unchecked twin
(the same corruption changes the victim's tokens), and show the window's rule: a page wholly before
every layer's window is neither read nor checked, so corrupting it changes nothing.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvattn.integrations import transformers as adapter

if transformers.__version__ not in adapter.SUPPORTED_VERSIONS:
    pytest.skip(
        f"transformers {transformers.__version__} is not a supported version",
        allow_module_level=True,
    )

from transformers.generation.continuous_batching import input_outputs
from transformers.generation.continuous_batching.requests import RequestStatus

# The batch and page size of the plain adapter tests (their prompts: conftest.py).
from kvattn_testing.transformers import (
    NEW_TOKENS,
    PAGE,
    PROMPT_LENS,
    generate_batch,
    generation_config,
)

WINDOW = 7  # keys a query attends, itself included: not a multiple of the page
COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    initializer_range=0.2,
)


def build(name: str):
    torch.manual_seed(0)
    if name == "mistral":
        model = transformers.MistralForCausalLM(
            transformers.MistralConfig(sliding_window=WINDOW, intermediate_size=128, **COMMON)
        )
    elif name == "qwen2":
        model = transformers.Qwen2ForCausalLM(
            transformers.Qwen2Config(
                sliding_window=WINDOW,
                use_sliding_window=True,
                max_window_layers=1,
                intermediate_size=128,
                **COMMON,
            )
        )
    elif name == "gemma2":
        # A cap of 1 bounds every logit to (-1, 1): far from the identity at these scores.
        model = transformers.Gemma2ForCausalLM(
            transformers.Gemma2Config(
                sliding_window=WINDOW,
                attn_logit_softcapping=1.0,
                final_logit_softcapping=None,
                query_pre_attn_scalar=16,
                intermediate_size=128,
                **COMMON,
            )
        )
    else:
        model = transformers.GptOssForCausalLM(
            transformers.GptOssConfig(
                sliding_window=WINDOW,
                num_local_experts=2,
                num_experts_per_tok=1,
                intermediate_size=64,
                **COMMON,
            )
        )
        with torch.no_grad():  # sinks large enough to take a visible share of the softmax
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0, 2)
    return model.eval()


MODELS = {name: None for name in ("mistral", "qwen2", "gemma2", "gpt_oss")}
# What each model's layers use, from its config (checked below, so the test covers what it says).
SWITCHES = {
    "mistral": {"window_left"},
    "qwen2": {"window_left"},
    "gemma2": {"window_left", "logits_soft_cap"},
    "gpt_oss": {"window_left", "sinks"},
}


def model_of(name: str):
    if MODELS[name] is None:
        MODELS[name] = build(name)
    return MODELS[name]


_eager: dict = {}


def eager_tokens(name, prompts):
    """Per-prompt ``generate`` with transformers' eager attention (cached per model)."""
    if name not in _eager:
        model = model_of(name)
        tokens = []
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), generation_config=generation_config())
            tokens.append(out[0, len(prompt) :].tolist())
        assert len({t for ts in tokens for t in ts}) > NEW_TOKENS, "tokens too uniform to tell"
        _eager[name] = tokens
    return _eager[name]


def recording_switches(seen: set):
    """Wrap the adapter's translation of the attention kwargs to record the switches used."""
    original = adapter._variant

    def _variant(kwargs, device):
        variant = original(kwargs, device)
        seen.update(variant)
        return variant

    return _variant


@pytest.mark.parametrize("name", list(MODELS))
def test_kvattn_matches_eager_generate(name, prompts, monkeypatch):
    seen: set = set()
    monkeypatch.setattr(adapter, "_variant", recording_switches(seen))
    with adapter.kvattn_attention(backend="reference") as stats:
        results = generate_batch(model_of(name), prompts)
    assert [r.error for r in results] == [None] * len(prompts)
    assert [r.generated_tokens for r in results] == eager_tokens(name, prompts)
    assert seen == SWITCHES[name]
    assert stats.attention_calls == 2 * stats.forwards and stats.failed_requests == []


@pytest.mark.parametrize("name", list(MODELS))
def test_without_the_switches_the_tokens_differ(name, prompts, monkeypatch):
    """The twin: the same run with the adapter passing no variant switch gives other tokens."""
    monkeypatch.setattr(adapter, "_variant", lambda kwargs, device: {})
    with adapter.kvattn_attention(backend="reference"):
        results = generate_batch(model_of(name), prompts)
    assert [r.generated_tokens for r in results] != eager_tokens(name, prompts)


@pytest.mark.parametrize("name", ["gemma2", "gpt_oss"])
def test_triton_matches_eager_generate(name, prompts):
    with adapter.kvattn_attention(backend="triton"):
        results = generate_batch(model_of(name), prompts)
    assert [r.generated_tokens for r in results] == eager_tokens(name, prompts)


def _corrupt_when_decoding(victim: str, index: int):
    """Once ``victim`` decodes past its first new token, point its block-table entry ``index`` at
    another request's first block (its reference count raised as for a mistaken share)."""
    IOs = input_outputs.ContinuousBatchingIOs
    original = IOs.__dict__["prepare_batch_tensors"]
    done = []

    def prepare_batch_tensors(self, requests_in_batch, *args, **kwargs):
        allocator = self.cache.cache_allocators["full_attention"]
        decoding = {
            fs.state.request_id: fs.state.position_offset
            for fs in requests_in_batch
            if fs.state.position_offset > len(fs.state.initial_tokens)
        }
        if not done and victim in decoding:
            block = allocator.block_table["req_2"][0]
            allocator.block_table[victim][index] = block
            allocator.ledger.acquire(block)
            done.append(decoding[victim])
        return original(self, requests_in_batch, *args, **kwargs)

    IOs.prepare_batch_tensors = prepare_batch_tensors
    return lambda: setattr(IOs, "prepare_batch_tensors", original), done


def run_corrupted(name, prompts, index, check=True):
    with adapter.kvattn_attention(backend="reference", check=check) as stats:
        restore, done = _corrupt_when_decoding("req_1", index)
        try:
            results = generate_batch(model_of(name), prompts)
        finally:
            restore()
    assert done, "the corruption was never applied"
    # The victim (11-token prompt) decodes position 12 when corrupted: its window holds keys
    # 6..12, so logical page 1 (keys 4..7) straddles the window edge and page 0 is before it.
    assert done[0] == PROMPT_LENS[1] + 1 and (done[0] - WINDOW + 1) // PAGE == 1
    return results, stats


@pytest.mark.parametrize("name", ["mistral", "gemma2"])
def test_corrupt_page_in_the_window_fails_only_the_victim(name, prompts):
    results, stats = run_corrupted(name, prompts, index=1)
    failed = results[1]
    assert failed.status == RequestStatus.FAILED
    assert "kvattn ownership check" in failed.error and "OWNER_MISMATCH" in failed.error
    assert stats.failed_requests == ["req_1"]
    clean = eager_tokens(name, prompts)
    for i, result in enumerate(results):
        if i != 1:
            assert result.error is None and result.generated_tokens == clean[i]


@pytest.mark.parametrize("name", ["mistral", "gemma2"])
def test_corrupt_page_in_the_window_leaks_when_unchecked(name, prompts):
    """The twin: unchecked, the same corruption silently changes the victim's tokens."""
    results, _ = run_corrupted(name, prompts, index=1, check=False)
    assert [r.error for r in results] == [None] * len(prompts)
    assert results[1].generated_tokens != eager_tokens(name, prompts)[1]


def test_corrupt_page_before_every_window_is_neither_read_nor_checked(prompts):
    """Mistral's layers all slide: page 0 of the victim is before every query's window once it
    decodes position 12, so no layer reads it, nothing is refused and the tokens are the clean ones
    (Gemma 2's full-attention layers read the same page and fail the victim: the twin)."""
    results, stats = run_corrupted("mistral", prompts, index=0)
    assert [r.error for r in results] == [None] * len(prompts)
    assert [r.generated_tokens for r in results] == eager_tokens("mistral", prompts)
    results, _ = run_corrupted("gemma2", prompts, index=0)
    assert results[1].status == RequestStatus.FAILED and "OWNER_MISMATCH" in results[1].error


def test_engine_sliding_allocator_is_restored(prompts):
    from transformers.generation.continuous_batching import cache as cb_cache

    config = model_of("mistral").config
    before = cb_cache.group_layers_by_attn_type(config)
    assert set(before) == {"sliding_attention"}
    with adapter.kvattn_attention(backend="reference"):
        assert cb_cache.group_layers_by_attn_type(config) == {"full_attention": [0, 1]}
    assert cb_cache.group_layers_by_attn_type(config) == before


def test_bad_sliding_window_is_refused_naming_it():
    with pytest.raises(adapter.IntegrationError, match="sliding_window.*positive int.*got 0"):
        adapter._variant(dict(sliding_window=0), torch.device("cpu"))
    assert adapter._variant(dict(sliding_window=1, softcap=None), torch.device("cpu")) == {
        "window_left": 0
    }
