"""The token-prefix digests the engine adapters keep per full page, shared by every adapter: a
prefix-cache hit on a page is expected to carry the owner that wrote it only if the writer's
digest through that page equals the reader's own (docs/vllm.md, docs/sglang.md)."""
from __future__ import annotations

import hashlib

import torch


def prefix_digests(tokens, page_size: int, known: list[bytes] | None = None) -> list[bytes]:
    """Digest of the token prefix through each full page (a hash chain, like vLLM's block hashes);
    ``known`` digests of the first pages are kept."""
    digests = list(known or ())
    parent = digests[-1] if digests else b""
    first, end = len(digests), len(tokens) // page_size
    # Only the pages not digested yet are read: a decode step adds at most one.
    new = torch.as_tensor(list(tokens[first * page_size:end * page_size]), dtype=torch.int64)
    for i in range(end - first):
        block = new[i * page_size:(i + 1) * page_size]
        parent = hashlib.blake2b(parent + block.numpy().tobytes(), digest_size=16).digest()
        digests.append(parent)
    return digests
