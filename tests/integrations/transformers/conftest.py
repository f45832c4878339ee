"""The transformers suites' shared fixtures: the tiny random-weight Llama (GQA, untied embeddings)
built from a config, no downloads, and the prompts of the plain adapter tests. transformers is
imported by the fixture, so this folder collects (and its modules skip) without it."""

from __future__ import annotations

import pytest
import torch

from kvattn_testing.transformers import PROMPT_LENS


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        initializer_range=0.2,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in PROMPT_LENS]
