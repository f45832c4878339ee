"""kvattn under Hugging Face transformers continuous batching (``generate_batch``), end to end on a
small random-weight Llama (GQA, untied embeddings) built from a config: no downloads.

Greedy tokens are compared exactly: the engine's own attention and kvattn's compute the same float32
softmax over the same K/V, and the argmax over a 128-token vocabulary is stable under their rounding
differences for these weights (checked against per-prompt ``generate``, which shares neither the
engine's cache nor kvattn's). The corruption tests pair a checked run (the victim fails with the
ownership error, the others match the clean run) with an unchecked twin (the same corruption changes
the victim's tokens), so a test cannot pass because the corruption had no effect.
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
from transformers.generation.continuous_batching.requests import (
    RequestState,
    RequestStatus,
)

# The batch and the page size of every transformers test (the model and prompts: conftest.py).
from kvattn_testing.transformers import (
    NEW_TOKENS,
    PAGE,
    generate_batch,
    generation_config,
)


@pytest.fixture(scope="module")
def clean_run(model, prompts):
    return [r.generated_tokens for r in generate_batch(model, prompts)]


def test_engine_matches_per_prompt_generate(model, prompts, clean_run):
    for prompt, tokens in zip(prompts, clean_run):
        out = model.generate(torch.tensor([prompt]), generation_config=generation_config())
        assert out[0, len(prompt) :].tolist() == tokens
    # Informative tokens: the requests do not all collapse onto one repeated token.
    assert len({t for tokens in clean_run for t in tokens}) > NEW_TOKENS


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_kvattn_matches_engine(model, prompts, clean_run, backend):
    with adapter.kvattn_attention(backend=backend) as stats:
        results = generate_batch(model, prompts)
    assert [r.error for r in results] == [None] * len(prompts)
    assert [r.generated_tokens for r in results] == clean_run
    # kvattn computed every attention and checked pages: 2 layers per forward, at least one
    # forward per new token.
    assert stats.forwards >= NEW_TOKENS and stats.attention_calls == 2 * stats.forwards
    assert stats.pages_checked > 0 and stats.failed_requests == []
    assert stats.refused_pages == stats.dropped_writes == 0


def _corrupt_when_decoding(victim: str, target):
    """Patch the engine's batch preparation (on top of the adapter's hook) so that, once ``victim``
    decodes, its first block-table entry points at the block ``target(cache)`` picks. The engine's
    reference count of that block is raised as for a mistaken share, so freeing the victim later
    does not also free the block under its real holder."""
    IOs = input_outputs.ContinuousBatchingIOs
    original = IOs.__dict__["prepare_batch_tensors"]
    done = []

    def prepare_batch_tensors(self, requests_in_batch, *args, **kwargs):
        allocator = self.cache.cache_allocators["full_attention"]
        decoding = {
            fs.state.request_id
            for fs in requests_in_batch
            if fs.state.position_offset > len(fs.state.initial_tokens)
        }
        if not done and victim in decoding:
            block = target(self.cache)
            allocator.block_table[victim][0] = block
            allocator.ledger.acquire(block)
            done.append(block)
        return original(self, requests_in_batch, *args, **kwargs)

    IOs.prepare_batch_tensors = prepare_batch_tensors
    return lambda: setattr(IOs, "prepare_batch_tensors", original), done


def _other_requests_page(cache):
    return cache.cache_allocators["full_attention"].block_table["req_2"][0]


def _reserved_never_written_page(cache):
    # A block allocated through the engine (so reserved under a new owner) and never written.
    ghost = RequestState(request_id="ghost", initial_tokens=[])
    assert cache.can_store_request_tokens(ghost, PAGE)
    return cache.cache_allocators["full_attention"].block_table["ghost"][0]


@pytest.mark.parametrize(
    "target, reason",
    [(_other_requests_page, "OWNER_MISMATCH"), (_reserved_never_written_page, "RESERVED")],
)
def test_corrupt_mapping_fails_only_the_victim(model, prompts, clean_run, target, reason):
    victim = 1
    with adapter.kvattn_attention(backend="reference") as stats:
        restore, done = _corrupt_when_decoding(f"req_{victim}", target)
        try:
            results = generate_batch(model, prompts)
        finally:
            restore()
    assert done, "the corruption was never applied"
    failed = results[victim]
    assert failed.status == RequestStatus.FAILED
    assert "kvattn ownership check" in failed.error and reason in failed.error
    assert stats.failed_requests == [f"req_{victim}"]
    # The victim is failed by the first forward that reads the page, in both layers.
    assert stats.refused_pages == 2 and stats.dropped_writes == 0
    for i, result in enumerate(results):
        if i != victim:
            assert result.error is None
            assert result.generated_tokens == clean_run[i]


@pytest.mark.parametrize("target", [_other_requests_page, _reserved_never_written_page])
def test_corrupt_mapping_leaks_when_unchecked(model, prompts, clean_run, target):
    """The twin: without the check the same corruption silently changes the victim's answer."""
    victim = 1
    with adapter.kvattn_attention(backend="reference", check=False):
        restore, done = _corrupt_when_decoding(f"req_{victim}", target)
        try:
            results = generate_batch(model, prompts)
        finally:
            restore()
    assert done
    assert [r.error for r in results] == [None] * len(prompts)
    assert results[victim].generated_tokens != clean_run[victim]


def test_hooks_are_restored(model, prompts, clean_run):
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    before = (PagedAttentionCache.update, ALL_ATTENTION_FUNCTIONS["sdpa"])
    with adapter.kvattn_attention(backend="reference"):
        assert PagedAttentionCache.update is not before[0]
        with pytest.raises(RuntimeError, match="does not nest"):
            with adapter.kvattn_attention():
                pass
    assert (PagedAttentionCache.update, ALL_ATTENTION_FUNCTIONS["sdpa"]) == before


def test_unsupported_version_is_refused():
    with pytest.raises(RuntimeError, match=r"transformers 4\.57\.0 is not supported.*5\.24\.0"):
        adapter.check_version("4.57.0")
    adapter.check_version(adapter.SUPPORTED_VERSIONS[0])
