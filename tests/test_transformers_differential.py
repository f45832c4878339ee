"""The transformers adapter under transformers continuous batching, driven through the engine's
manager with every request added before its loop starts (so every run schedules the same
batches), in phases when a test needs the engine idle between requests; the engine's own events
are counted the same way on stock attention and under ``kvattn_attention()``.

A block shared through the engine's hash table is accepted only for the writer recorded when the
engine registered that hash: the tests below free a cached system block, let the next request
refill the same physical block (with the same page, registered anew, or with a page of its own
under the hash the engine kept), and share it with a third request. Greedy tokens are compared
exactly, as in the plain adapter tests.
"""
from __future__ import annotations

import contextlib
import random
from collections import Counter

import pytest

transformers = pytest.importorskip("transformers")

from kvattn.integrations import transformers as adapter  # noqa: E402

if transformers.__version__ not in adapter.SUPPORTED_VERSIONS:
    pytest.skip(f"transformers {transformers.__version__} is not a supported version",
                allow_module_level=True)

from transformers import GenerationConfig  # noqa: E402
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402
from transformers.generation.continuous_batching import cache as cb_cache  # noqa: E402
from transformers.generation.continuous_batching import input_outputs  # noqa: E402
from transformers.generation.continuous_batching.cache_allocators import (  # noqa: E402
    FULL_ATTENTION, CacheAllocator, FullAttentionCacheAllocator)
from transformers.generation.continuous_batching.offloading_manager import (  # noqa: E402
    OffloadingManager)
from transformers.generation.continuous_batching.requests import RequestState  # noqa: E402
# The model of the plain adapter tests, whose greedy tokens those tests hold to per-prompt generate.
from test_transformers import PAGE, model  # noqa: E402,F401

VOCAB = 128
OWNERSHIP_ERROR = "kvattn ownership check failed"
IOs = input_outputs.ContinuousBatchingIOs
Cache = cb_cache.PagedAttentionCache


@contextlib.contextmanager
def patched(owner, name: str, make):
    """``owner.name`` replaced by ``make(original)`` inside the block."""
    original = owner.__dict__[name]
    setattr(owner, name, make(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


class Probe:
    """Counts the engine's own events in a run; installed the same way for stock and kvattn."""

    def __init__(self):
        self.counts: Counter = Counter()
        self.chunked: set = set()
        self.last_holder: dict[int, str] = {}  # block -> the request it was last allocated to
        self.tables: dict[str, list[int]] = {}  # request -> its block table when it was freed

    def install(self, stack: contextlib.ExitStack) -> None:
        counts = self.counts

        def search(original):
            def search_prefix_match(cache, request_id, prompt_ids):
                matched = original(cache, request_id, prompt_ids)
                if matched:
                    counts["prefix_hits"] += 1
                    counts["prefix_blocks"] += matched // PAGE
                return matched
            return search_prefix_match

        def mark(original):
            def mark_complete_blocks(allocator, request_id, token_ids, new_new_blocks):
                before = list(allocator.block_table.get(request_id, []))
                original(allocator, request_id, token_ids, new_new_blocks)
                after = allocator.block_table.get(request_id, [])
                counts["deduplicated_blocks"] += sum(a != b for a, b in zip(before, after))
            return mark_complete_blocks

        def allocate(original):
            def allocate_cache_to_request(allocator, request_id, past_length, query_length):
                before = len(allocator.block_table.get(request_id, []))
                original(allocator, request_id, past_length, query_length)
                for block in allocator.block_table[request_id][before:]:
                    if self.last_holder.get(block, request_id) != request_id:
                        counts["blocks_reused"] += 1
                    self.last_holder[block] = request_id
            return allocate_cache_to_request

        def prepare(original):
            def prepare_batch_tensors(io, requests_in_batch, *args, **kwargs):
                counts["forwards"] += 1
                for fs in requests_in_batch:
                    if not fs.has_new_token:
                        counts["prefill_chunks"] += 1
                        self.chunked.add(fs.state.request_id)
                return original(io, requests_in_batch, *args, **kwargs)
            return prepare_batch_tensors

        def soft_reset(original):
            def create_equivalent_initial_request(state):
                counts["preemptions"] += 1
                return original(state)
            return create_equivalent_initial_request

        def evict(original):
            def evict_cached_blocks(cache):
                evicted = original(cache)
                counts["evictions"] += bool(evicted)
                return evicted
            return evict_cached_blocks

        def free(original):
            def free_blocks(allocator, request_id, no_cache=False):
                self.tables[request_id] = list(allocator.block_table.get(request_id, []))
                return original(allocator, request_id, no_cache)
            return free_blocks

        def offload(original):
            def _offload_to_cpu(manager, victims, victim_block_tables):
                offloaded = original(manager, victims, victim_block_tables)
                counts["cpu_offloads"] += len(offloaded)
                return offloaded
            return _offload_to_cpu

        stack.enter_context(patched(Cache, "search_prefix_match", search))
        stack.enter_context(patched(CacheAllocator, "free_blocks", free))
        stack.enter_context(patched(OffloadingManager, "_offload_to_cpu", offload))
        stack.enter_context(patched(CacheAllocator, "mark_complete_blocks", mark))
        stack.enter_context(patched(FullAttentionCacheAllocator, "allocate_cache_to_request",
                                    allocate))
        stack.enter_context(patched(IOs, "prepare_batch_tensors", prepare))
        stack.enter_context(patched(RequestState, "create_equivalent_initial_request", soft_reset))
        stack.enter_context(patched(Cache, "evict_cached_blocks", evict))

    def result(self) -> dict:
        return dict(self.counts, chunked_prefills=len(self.chunked),
                    cpu_offloads=self.counts["cpu_offloads"])


def generate(model, workload: dict, between=None) -> dict:
    """The workload through the engine's continuous batching manager. Its requests (``prompts``)
    are added before the loop starts, as ``generate_batch`` adds them but without the race between
    the loop's first batch and the submissions. A workload with ``phases`` (lists of request ids)
    runs them one after the other: each phase is added once the one before has finished, while
    the loop is paused; ``between(cache)`` runs there once, after the first phase."""
    gen = GenerationConfig(max_new_tokens=max(workload["max_new"].values()), do_sample=False,
                           eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(page_size=PAGE, num_blocks=workload["num_blocks"],
                                  max_batch_tokens=workload["max_batch_tokens"],
                                  use_cuda_graph=False, use_async_batching=False)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    phases = workload.get("phases", [list(workload["prompts"])])
    results = {}

    def submit(rids):
        for rid in rids:
            manager.add_request(workload["prompts"][rid], request_id=rid,
                                max_new_tokens=workload["max_new"][rid])

    def collect(rids):
        while not set(rids) <= set(results):
            out = manager.get_result(timeout=1)
            if out is not None and out.is_finished():
                results[out.request_id] = out
            elif out is None and not manager.is_running():
                return

    try:
        manager.warmup()
        submit(phases[0])
        manager.start()
        collect(phases[0])
        for i, rids in enumerate(phases[1:]):
            with manager.pause():
                if between is not None and i == 0:
                    between(manager.batch_processor.cache)
                submit(rids)
            collect(rids)
    finally:
        manager.stop(block=True)
        manager.destroy()
    return {rid: dict(tokens=r.generated_tokens, status=int(r.status), error=r.error)
            for rid, r in results.items()}


def run(model, workload: dict, kvattn: bool, between=None) -> dict:
    probe = Probe()
    with contextlib.ExitStack() as stack:
        probe.install(stack)
        stats = stack.enter_context(adapter.kvattn_attention(backend="torch")) if kvattn else None
        results = generate(model, workload, between)
    out = dict(results=results, events=probe.result(), tables=probe.tables)
    if stats is not None:
        out["stats"] = dict(forwards=stats.forwards, attention_calls=stats.attention_calls,
                            pages_checked=stats.pages_checked, refused_pages=stats.refused_pages,
                            dropped_writes=stats.dropped_writes,
                            failed_requests=list(stats.failed_requests))
    return out


def _tokens(run_: dict) -> dict:
    return {rid: r["tokens"] for rid, r in run_["results"].items()}


def _refill(same_tokens: bool) -> dict:
    """Three requests, one after the other: ``req_a`` (a system page and one token) finishes, and
    the engine keeps its system block cached under the page's hash; the block goes back to the
    free pool (how depends on the test) and ``req_b`` is allocated that same block, filling it with
    the system page again (``same_tokens``) or with a page of its own; then ``req_c`` (the system
    page and another token) reaches the block through the system page's hash."""
    rng = random.Random(18)
    system, other = ([rng.randrange(VOCAB) for _ in range(PAGE)] for _ in range(2))
    prompts = {"req_a": system + [rng.randrange(VOCAB)],
               "req_b": (system if same_tokens else other) + [rng.randrange(VOCAB)],
               "req_c": system + [rng.randrange(VOCAB)]}
    return dict(prompts=prompts, max_new={"req_a": 2, "req_b": 6, "req_c": 6}, num_blocks=8,
                max_batch_tokens=16, phases=[["req_a"], ["req_b"], ["req_c"]])


def _evict(cache) -> None:
    """The engine's own eviction of the blocks it keeps cached (what memory pressure does)."""
    assert cache.evict_cached_blocks(), "nothing was cached to evict"


def _free_keeping_hashes(cache) -> None:
    """The bug: the cached blocks go back to the free pool with their hashes still registered."""
    allocator = cache.cache_allocators[FULL_ATTENTION]
    blocks = list(allocator.ledger.cached_blocks)
    assert blocks, "nothing was cached"
    allocator.ledger.cached_blocks.clear()
    allocator.pool.free_blocks(allocator.index, blocks)


def _refill_runs(model, same_tokens: bool, between) -> tuple[dict, dict]:
    workload = _refill(same_tokens)
    stock = run(model, workload, kvattn=False, between=between)
    checked = run(model, workload, kvattn=True, between=between)
    for r in (stock, checked):
        assert sorted(r["results"]) == sorted(workload["prompts"])
        tables = r["tables"]
        # The scenario happened: one physical block passed from req_a to req_b and req_c read it.
        assert tables["req_a"][0] == tables["req_b"][0] == tables["req_c"][0], tables
    return stock, checked


def test_block_refilled_under_its_old_hash_is_shared_under_its_new_writer(model):
    """Regression: the engine evicts a cached system block, hands the same physical block to the
    next request, which writes the same page into it, and registers it under the same hash again;
    a later request sharing it must expect the new writer. The adapter had kept the first writer's
    owner for that (block, hash) pair and failed every later sharer (OWNER_MISMATCH)."""
    stock, checked = _refill_runs(model, same_tokens=True, between=_evict)
    assert [r["error"] for r in checked["results"].values()] == [None] * 3
    assert _tokens(checked) == _tokens(stock)
    assert checked["stats"]["refused_pages"] == 0
    assert checked["events"]["prefix_hits"] == 1


def test_block_refilled_under_a_stale_hash_fails_its_sharer(model):
    """The twin: the block goes back to the pool with its hash still registered and the next
    request writes a page of its own into it. The third request matches the stale hash and reads
    that page: stock attention gives it other tokens than its clean run, kvattn fails it and only
    it. Registering the stale pair anew once the second request completes the block would accept
    the share; only a registration the engine makes is proof."""
    clean, _ = _refill_runs(model, same_tokens=True, between=_evict)
    stock, checked = _refill_runs(model, same_tokens=False, between=_free_keeping_hashes)
    assert stock["results"]["req_c"]["tokens"] != clean["results"]["req_c"]["tokens"]
    assert checked["results"]["req_c"]["error"].startswith(OWNERSHIP_ERROR)
    assert checked["stats"]["failed_requests"] == ["req_c"]
    for rid in ("req_a", "req_b"):
        assert checked["results"][rid]["error"] is None
        assert checked["results"][rid]["tokens"] == stock["results"][rid]["tokens"]
