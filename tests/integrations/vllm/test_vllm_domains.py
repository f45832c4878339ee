"""Prefix-cache hits across the KV's domain under kvattn in vLLM 0.32 (the CPU build): LoRA adapters,
cache salts and the images of a multimodal model. vLLM keys a cached block on the adapter, the
salt and the images behind its placeholder tokens besides the tokens; kvattn's ledger keys its own
digest of the block on them too (``cache_domain``, ``media_key``), independently, so that a hit the
engine keys wrongly (the class of vLLM #44701 and SGLang #37160: a domain part left out of the
cache key) still fails closed.

The conformance suite's class-5 lanes (``domains`` of :mod:`kvattn.conformance.vllm`) send one
prompt of two full blocks under adapter A, adapter B, then A again (``a1``, ``b1``, ``a2``), under
cache salts 1, 2, then 1 again (``t1``, ``t2``, ``t1b``), and, to a tiny LLaVA, with image 1,
image 2, then image 1 again (``i1``, ``i2``, ``i1b``; the images' placeholders in the first
block), each request admitted once the one before finished, on vLLM's attention and on kvattn's:
clean, then with the adapter (the salt, the images) left out of vLLM's block hash, which makes the
other domain's request (``b1``, ``t2``, ``i2``) hit the first one's blocks.
"""

from __future__ import annotations

import pytest

from kvattn.conformance.vllm import DOMAIN_LANES as LANES
from kvattn_testing import engines
from kvattn_testing.engines import why_no_vllm

HIT = 64  # tokens: the prompt's two full blocks

pytestmark = pytest.mark.slow

if why_no_vllm():
    pytest.skip(why_no_vllm(), allow_module_level=True)


@pytest.fixture(scope="module")
def domains():
    run = engines.Runs().vllm_conformance()
    return run["stock"]["domains"], run["kvattn"]["domains"]


@pytest.mark.parametrize("lane", LANES)
def test_a_hit_within_a_domain_is_read_and_none_crosses_one(domains, lane):
    """Clean: both attentions give the same tokens; the same domain's second request hits the
    first's blocks and reads them, the other domain's computes its own; nothing is refused."""
    stock, mine = domains
    first, other, again = LANES[lane]
    for run in (stock, mine):
        clean = run[lane]["clean"]
        assert clean[again]["cached"] == HIT and clean[other]["cached"] == 0
        assert all(r["finish_reason"] == "length" and len(r["tokens"]) == 8 for r in clean.values())
        assert clean[again]["tokens"] == clean[first]["tokens"]
    assert {n: r["tokens"] for n, r in mine[lane]["clean"].items()} == {
        n: r["tokens"] for n, r in stock[lane]["clean"].items()
    }
    if lane != "cache_salt":  # adapters and images change the KV, so the answers
        assert stock[lane]["clean"][other]["tokens"] != stock[lane]["clean"][first]["tokens"]
    # Both blocks hit by the same domain's second request, clean and faulted, in each lane.
    hits = mine["counts"]["prefix_hit_blocks"] + mine["mm"]["counts"]["prefix_hit_blocks"]
    assert hits >= 2 * 2 * len(LANES)


@pytest.mark.parametrize("lane", LANES)
def test_a_hit_across_domains_is_served_by_vllm(domains, lane):
    """The fault is real on vLLM's attention: the other domain's request reads the first one's
    blocks and answers. Under another adapter its answer changes; under another salt the bytes
    are the same (a salt separates tenants, not values), and the tenant boundary is what was
    crossed."""
    stock, _ = domains
    _, other, _ = LANES[lane]
    run = stock[lane]
    assert run["injected"] and run["failures"] == []
    assert run["faulted"][other]["cached"] == HIT
    assert run["faulted"][other]["finish_reason"] == "length"
    if lane != "cache_salt":
        assert run["faulted"][other]["tokens"] != run["clean"][other]["tokens"]


@pytest.mark.parametrize("lane", LANES)
def test_a_hit_across_domains_fails_that_request_only_on_kvattn(domains, lane):
    """On kvattn's: the other domain's request fails before its first token, naming the blocks
    whose owner it could not prove; the first domain's requests, before and after it (a hit on
    the same blocks), keep their clean answers."""
    _, mine = domains
    first, other, again = LANES[lane]
    run = mine[lane]
    assert run["injected"]
    assert run["faulted"][other]["finish_reason"] == "error"
    assert run["faulted"][other]["tokens"] == []
    ((name, message),) = run["failures"]
    assert name == other
    assert "OWNER_MISMATCH on logical page(s) 0 (block" in message and ", 1 (block" in message
    for name in (first, again):
        assert run["faulted"][name] == run["clean"][name]
    assert mine["failures_total"] == len(LANES) - 1  # the domains engine's: all lanes but mm
