"""The token prompts of the vLLM scenarios (vllm_driver.py), importable without vLLM."""

from __future__ import annotations

from kvattn.conformance.model import prompt
from kvattn.conformance.vllm import BLOCK

SHORT = prompt(50, 60)  # a prompt the prefill instance holds
LONG = prompt(51, 300)  # one it cannot: over its max_model_len
FILLERS = [prompt(52 + i, 150) for i in range(3)]  # earlier requests' KV in the decode pool

# Disaggregated prefill over NIXL (vllm_nixl.py, test_vllm_nixl.py).
EARLIER = [prompt(70 + i, 100) for i in range(3)]  # other users' requests on the prefill side
WARMUPS = [prompt(90 + i, 40) for i in range(3)]  # the first transfer also makes the handshake
SHARED = SHORT[:BLOCK] + prompt(81, 30)  # shares the short prompt's first block
LOCAL_HIT = SHORT[:BLOCK] + prompt(83, 20)  # decoded locally: a hit on a block that arrived
CORRUPT = prompt(82, 60)
LONG2 = prompt(84, 300)  # a second prompt the prefill instance cannot hold
BESIDE = prompt(80, 40)
