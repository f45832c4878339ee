"""The plain transformers adapter tests' batch, for every transformers test: the page size, the
prompts' lengths, the tokens generated, and continuous batching over them (``generate_batch``) on
the tiny random-weight Llama of the ``model`` fixture. transformers is imported when called, so
this module imports without it (the test modules skip then)."""
from __future__ import annotations

import pytest
import torch

PAGE = 4
PROMPT_LENS = (5, 11, 8, 3)
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=128, tie_word_embeddings=False,
                         initializer_range=0.2)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in PROMPT_LENS]


def generation_config():
    from transformers import GenerationConfig
    return GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1,
                            pad_token_id=0)


def generate_batch(model, prompts):
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    cb = ContinuousBatchingConfig(page_size=PAGE, num_blocks=64, max_batch_tokens=64,
                                  use_cuda_graph=False, use_async_batching=False)
    results = model.generate_batch(prompts, generation_config=generation_config(),
                                   continuous_batching_config=cb)
    return [results[f"req_{i}"] for i in range(len(prompts))]
