"""The transformers suites' shared fixtures: the conformance suite's tiny random-weight Llama (GQA,
untied embeddings) built from a config, no downloads, and the prompts of the plain adapter
tests. transformers is imported by the fixture, so this folder collects (and its modules skip)
without it."""

from __future__ import annotations

import pytest
import torch

from kvattn_testing.transformers import PROMPT_LENS


@pytest.fixture(scope="module")
def model():
    from kvattn.conformance.transformers import tiny_llama

    return tiny_llama()


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in PROMPT_LENS]
