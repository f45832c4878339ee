"""The plain transformers adapter tests' batch, for every transformers test: the page size, the
prompts' lengths, the tokens generated, and continuous batching over them (``generate_batch``) on
the tiny random-weight Llama of the ``model`` fixture (tests/integrations/transformers/conftest.py).
transformers is imported when called, so this module imports without it (the test modules skip
then)."""

from __future__ import annotations

PAGE = 4
PROMPT_LENS = (5, 11, 8, 3)
NEW_TOKENS = 6


def generation_config():
    from transformers import GenerationConfig

    return GenerationConfig(
        max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0
    )


def generate_batch(model, prompts):
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    cb = ContinuousBatchingConfig(
        page_size=PAGE,
        num_blocks=64,
        max_batch_tokens=64,
        use_cuda_graph=False,
        use_async_batching=False,
    )
    results = model.generate_batch(
        prompts, generation_config=generation_config(), continuous_batching_config=cb
    )
    return [results[f"req_{i}"] for i in range(len(prompts))]
