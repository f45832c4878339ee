"""The token prompts of the vLLM scenarios (tests/vllm_driver.py), importable without vLLM."""
from __future__ import annotations

import torch

BLOCK = 32  # vLLM's block (kvattn's page) in every scenario
VOCAB = 256  # the byte tokens of the test model


def prompt(seed: int, length: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (length,), generator=g).tolist()


SHORT = prompt(50, 60)  # a prompt the prefill instance holds
LONG = prompt(51, 300)  # one it cannot: over its max_model_len
FILLERS = [prompt(52 + i, 150) for i in range(3)]  # earlier requests' KV in the decode pool
