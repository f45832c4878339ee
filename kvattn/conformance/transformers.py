"""The conformance suite under transformers continuous batching: seeded random workloads run on the
engine's stock attention and under ``kvattn_attention()``, clean and with one bookkeeping fault
injected into the engine (``python -m kvattn.conformance --engine transformers`` runs it).

Each seed draws a workload on a tiny random-weight Llama (:func:`tiny_llama`, page size 4):

- system prompts of 1, 2 and 3 pages shared by several requests: transformers 5.24 shares prefix
  blocks (``allow_block_sharing=True``, its default, for models whose layers are all full
  attention): it hashes every complete block after the forward that completes it, matches a new
  prompt's leading blocks against the hashes, and keeps the blocks of finished requests cached
  for that until memory runs short. Duplicated prompts are submitted back to back: in one batch
  the engine swaps the second one's blocks for the first one's after the forward
  (de-duplication), in a later batch the second one matches them;
- prompts and generation lengths of mixed sizes, a ``max_batch_tokens`` of 8, 12 or 16 (longer
  prompts are prefilled in chunks) and a ``num_blocks`` of 14 to 20 for 10 to 21 requests: the
  pool runs out, the engine evicts its cached blocks and preempts requests, and freed blocks pass
  to later requests. transformers preempts by "soft reset" (the request's blocks are freed and it
  is prefilled again with the tokens it generated) unless ``cpu_offload_space`` is set, and CPU
  offloading needs pinned memory, which a machine without an accelerator cannot allocate: no run
  here offloads (the counts say so), and the adapter fails offloaded requests closed by design;
- a *donor* and a *reader* whose prompts share two private pages, the donor done after two or
  three tokens (a request finished by the forward that completes its blocks never has them
  hashed) while the reader, right behind it, decodes long; and a *victim* with a prompt of its own
  and a long generation.

The requests are added before the engine's loop starts, so every run of a workload schedules the
same batches up to a fault. Greedy tokens are compared exactly, as in the plain adapter tests: the
engine's attention and kvattn's compute float32 softmaxes over the same K/V, and the argmax over
the 128-token vocabulary is stable under their rounding differences.

Clean runs: kvattn's tokens equal stock's for every request, no request fails, no page is refused
and no write dropped, and the engine's own events (prefix hits, de-duplicated blocks, chunked
prefills, preemptions, evictions, reused blocks) are the same in both runs: the adapter changes no
scheduling decision.

Fault runs, each workload once per fault kind, each fault touching one request's KV
(:data:`FAULTS` gives each one's class of public bug report):

- ``foreign_block``: once the victim decodes past two pages, its block-table entry 0 points at
  block 0 of another request in the batch (reference counts moved as for a mistaken share);
- ``lost_write``: the victim's first decode token is written to the engine's write-trash sector
  instead of its page;
- ``early_free``: once the victim decodes past two pages, its block 0 goes back to the free pool
  while the victim still maps it, and later allocations hand it to other requests;
- ``stale_prefix``: the reader holds the donor's first block through the engine's hash table (a
  prefix match or a de-duplication); once the donor is gone, the engine hands that block to the
  next allocation of another request with its hash still registered, and that request writes its
  own tokens where the reader's shared prefix was.

Under kvattn the victim (the reader for ``stale_prefix``), and only the victim, fails with the
ownership error, and every other request's tokens equal the clean run's. Under stock attention the
same fault changes the victim's tokens: asserted for at least one seed per fault kind (the twin:
the fault is real), counted per seed (``early_free`` changes nothing until another request has
overwritten the block).
"""

from __future__ import annotations

import contextlib
import random
from collections import Counter

import torch
import transformers
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching import cache as cb_cache
from transformers.generation.continuous_batching import input_outputs
from transformers.generation.continuous_batching.cache_allocators import (
    FULL_ATTENTION,
    CacheAllocator,
    FullAttentionCacheAllocator,
)
from transformers.generation.continuous_batching.offloading_manager import (
    OffloadingManager,
)
from transformers.generation.continuous_batching.requests import RequestState

from kvattn.conformance import Report, Row
from kvattn.integrations import transformers as adapter

PAGE = 4
VOCAB = 128
OWNERSHIP_ERROR = "kvattn ownership check failed"
# fault -> (conformance class, the public reports it stands for). The order is the runs' order.
FAULTS = {
    "foreign_block": (3, "SGLang #22716 (a metadata index collision)"),
    "lost_write": (1, "TensorRT-LLM #19545 (SUCCESS without the writes)"),
    "early_free": (2, "vLLM #42571, SGLang #24226 (freed while live)"),
    "stale_prefix": (2, "vLLM #52234 (a stale reference after block reuse)"),
    "hash_collision": (4, "Mooncake #4153 (a mismatched block hit)"),
}
NOT_REPLAYED = {
    5: "transformers' continuous batching serves no LoRA adapter or cache salt per request: "
    "its prefix cache has no domain to leave out of a key",
    6: "tags cannot see bytes changed inside a page its owner wrote, and this engine moves no "
    "KV between instances; its CPU offload needs pinned memory, which a machine without an "
    "accelerator cannot allocate",
}
IOs = input_outputs.ContinuousBatchingIOs
Cache = cb_cache.PagedAttentionCache


def why_unsupported() -> str | None:
    """None when the installed transformers is one the adapter supports, else why not."""
    if transformers.__version__ not in adapter.SUPPORTED_VERSIONS:
        return f"transformers {transformers.__version__} is not a supported version"
    return None


def tiny_llama():
    """The random-weight Llama the workloads run on (GQA, untied embeddings), built from a config:
    no download."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
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


def draw(seed: int) -> dict:
    """The workload of ``seed``: prompts and generation lengths in arrival order, the pool and batch
    sizes, and the requests the faults aim at (the module docstring says what each is for)."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(VOCAB) for _ in range(n)]

    systems = [tokens(PAGE * pages) for pages in (1, 2, 3)]
    private = tokens(2 * PAGE)
    prompts: dict[str, list[int]] = {}
    max_new: dict[str, int] = {}

    def add(prompt: list[int], new: int) -> str:
        rid = f"req_{len(prompts)}"
        prompts[rid], max_new[rid] = prompt, new
        return rid

    donor = add(private + tokens(rng.randint(1, 3)), rng.randint(2, 3))
    reader = add(private + tokens(rng.randint(1, 3)), rng.randint(12, 16))
    victim = add(tokens(rng.randint(6, 9)), rng.randint(12, 16))
    for _ in range(rng.randint(7, 9)):
        prompt = rng.choice(systems + [[]]) + tokens(rng.randint(1, 9))
        add(prompt, rng.randint(2, 10))
        if rng.random() < 0.3:
            add(list(prompt), rng.randint(2, 10))
    return dict(
        seed=seed,
        prompts=prompts,
        max_new=max_new,
        num_blocks=rng.randint(14, 20),
        max_batch_tokens=rng.choice((8, 12, 16)),
        donor=donor,
        reader=reader,
        victim=victim,
    )


@contextlib.contextmanager
def patched(owner, name: str, make):
    """``owner.name`` replaced by ``make(original)`` inside the block."""
    original = owner.__dict__[name]
    setattr(owner, name, make(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


def _decoding(fs) -> bool:
    return fs.query_length == 1 and bool(fs.state.generated_tokens)


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
        stack.enter_context(
            patched(FullAttentionCacheAllocator, "allocate_cache_to_request", allocate)
        )
        stack.enter_context(patched(IOs, "prepare_batch_tensors", prepare))
        stack.enter_context(patched(RequestState, "create_equivalent_initial_request", soft_reset))
        stack.enter_context(patched(Cache, "evict_cached_blocks", evict))

    def result(self) -> dict:
        return dict(
            self.counts,
            chunked_prefills=len(self.chunked),
            cpu_offloads=self.counts["cpu_offloads"],
        )


class Fault:
    """One bookkeeping fault of the engine (``kind``, one of FAULTS), applied once to ``victim``.
    Its hooks go in before the adapter's, beneath them: to the adapter they are the engine, so it
    sees the engine's state as the fault left it, as it would see a real bug's."""

    def __init__(self, kind: str, workload: dict):
        self.kind = kind
        self.workload = workload
        # hash_collision's victim is the first request it can reach, found as the run goes.
        self.victim = {"stale_prefix": workload["reader"], "hash_collision": None}.get(
            kind, workload["victim"]
        )
        self.applied = False
        self.detail: dict = {}

    def install(self, stack: contextlib.ExitStack) -> None:
        getattr(self, "_" + self.kind)(stack)

    def _foreign_block(self, stack):
        def prepare(original):
            def prepare_batch_tensors(io, requests_in_batch, *args, **kwargs):
                fs = next((f for f in requests_in_batch if f.state.request_id == self.victim), None)
                if (
                    not self.applied
                    and fs is not None
                    and _decoding(fs)
                    and fs.state.position_offset >= 2 * PAGE
                ):
                    others = [
                        f.state.request_id
                        for f in requests_in_batch
                        if f.state.request_id != self.victim and f.state.position_offset >= PAGE
                    ]
                    if others:
                        allocator = io.cache.cache_allocators[FULL_ATTENTION]
                        table = allocator.block_table[self.victim]
                        own, foreign = table[0], allocator.block_table[others[0]][0]
                        table[0] = foreign
                        # As for a mistaken share: the foreign block gains a reference, the
                        # victim's own block loses one.
                        allocator.ledger.acquire(foreign)
                        if allocator.ledger.release(own):
                            allocator.pool.free_blocks(allocator.index, [own])
                        self.applied = True
                        self.detail = dict(owner_of_block=others[0])
                return original(io, requests_in_batch, *args, **kwargs)

            return prepare_batch_tensors

        stack.enter_context(patched(IOs, "prepare_batch_tensors", prepare))

    def _lost_write(self, stack):
        prompt_len = len(self.workload["prompts"][self.victim])

        def extend(original):
            def extend_read_and_write_indices(
                cache, request_id, past_length, query_length, read_index, write_index
            ):
                original(cache, request_id, past_length, query_length, read_index, write_index)
                if not self.applied and request_id == self.victim and past_length >= prompt_len:
                    allocator = cache.cache_allocators[FULL_ATTENTION]
                    write_index[allocator.index][-1] = allocator.write_trash_index
                    self.applied = True
                    self.detail = dict(position=past_length)

            return extend_read_and_write_indices

        stack.enter_context(patched(Cache, "extend_read_and_write_indices", extend))

    def _early_free(self, stack):
        freed = []

        def prepare(original):
            def prepare_batch_tensors(io, requests_in_batch, *args, **kwargs):
                fs = next((f for f in requests_in_batch if f.state.request_id == self.victim), None)
                if (
                    not self.applied
                    and fs is not None
                    and _decoding(fs)
                    and fs.state.position_offset >= 2 * PAGE
                ):
                    allocator = io.cache.cache_allocators[FULL_ATTENTION]
                    block = allocator.block_table[self.victim][0]
                    if allocator.ledger.release(block, no_cache=True):
                        allocator.pool.free_blocks(allocator.index, [block])
                    freed.append(block)
                    self.applied = True
                    self.detail = dict(reused_by=[])
                return original(io, requests_in_batch, *args, **kwargs)

            return prepare_batch_tensors

        def allocate(original):
            def allocate_cache_to_request(allocator, request_id, past_length, query_length):
                before = len(allocator.block_table.get(request_id, []))
                original(allocator, request_id, past_length, query_length)
                if (
                    freed
                    and freed[0] in allocator.block_table[request_id][before:]
                    and self.victim in allocator.block_table
                ):
                    self.detail["reused_by"].append(request_id)

            return allocate_cache_to_request

        def free(original):
            def free_blocks(allocator, request_id, no_cache=False):
                table = allocator.block_table.get(request_id)
                # The early free was the fault; the victim's own free must not free the block a
                # second time under the request that holds it now.
                if request_id == self.victim and freed and table and table[0] == freed[0]:
                    table.pop(0)
                return original(allocator, request_id, no_cache)

            return free_blocks

        stack.enter_context(patched(IOs, "prepare_batch_tensors", prepare))
        stack.enter_context(
            patched(FullAttentionCacheAllocator, "allocate_cache_to_request", allocate)
        )
        stack.enter_context(patched(CacheAllocator, "free_blocks", free))

    def _hash_collision(self, stack):
        """The first request whose prompt's first page matches no registered block, while some
        block is registered, is handed that block as its first, as if the page's hash had matched
        (a hash collision): the engine's bookkeeping stays consistent (the block gains a
        reference), and the request reads another prompt's KV as its first page."""

        def search(original):
            def search_prefix_match(cache, request_id, prompt_ids):
                matched = original(cache, request_id, prompt_ids)
                allocator = cache.cache_allocators[FULL_ATTENTION]
                registered = sorted(allocator.ledger.block_to_hash)
                if self.applied or matched or len(prompt_ids) <= PAGE or not registered:
                    return matched
                allocator.acquire_prefix_blocks(request_id, PAGE, registered[:1])
                self.applied = True
                self.victim = request_id
                self.detail = dict(block=registered[0])
                return PAGE

            return search_prefix_match

        stack.enter_context(patched(Cache, "search_prefix_match", search))

    def _stale_prefix(self, stack):
        donor, reader = self.workload["donor"], self.workload["reader"]
        own: set = set()  # blocks the reader was allocated (not reached through a hash)
        donor_done = []

        def allocate(original):
            def allocate_cache_to_request(allocator, request_id, past_length, query_length):
                before = len(allocator.block_table.get(request_id, []))
                original(allocator, request_id, past_length, query_length)
                new = allocator.block_table[request_id][before:]
                if request_id == reader:
                    own.update(new)
                    return
                held = allocator.block_table.get(reader)
                if self.applied or not new or not donor_done or not held:
                    return
                block = held[0]
                if (
                    block in own
                    or block not in allocator.ledger.block_to_hash
                    or any(
                        block in table
                        for rid, table in allocator.block_table.items()
                        if rid not in (reader, request_id)
                    )
                ):
                    return
                # Handed out as if free, its hash left registered: the new holder gets a reference
                # of its own (so the counts stay consistent) and writes its tokens into the block.
                allocator.block_table[request_id][-1] = block
                allocator.ledger.acquire(block)
                allocator.pool.free_blocks(allocator.index, [new[-1]])
                self.applied = True
                self.detail = dict(writer=request_id)

            return allocate_cache_to_request

        def free(original):
            def free_blocks(allocator, request_id, no_cache=False):
                original(allocator, request_id, no_cache)
                if request_id == donor:
                    donor_done.append(True)

            return free_blocks

        stack.enter_context(
            patched(FullAttentionCacheAllocator, "allocate_cache_to_request", allocate)
        )
        stack.enter_context(patched(CacheAllocator, "free_blocks", free))


def generate(model, workload: dict, between=None) -> dict:
    """The workload through the engine's continuous batching manager. Its requests (``prompts``)
    are added before the loop starts, as ``generate_batch`` adds them but without the race between
    the loop's first batch and the submissions. A workload with ``phases`` (lists of request ids)
    runs them one after the other: each phase is added once the one before has finished, while
    the loop is paused; ``between(cache)`` runs there once, after the first phase."""
    gen = GenerationConfig(
        max_new_tokens=max(workload["max_new"].values()),
        do_sample=False,
        eos_token_id=-1,
        pad_token_id=0,
    )
    cb = ContinuousBatchingConfig(
        page_size=PAGE,
        num_blocks=workload["num_blocks"],
        max_batch_tokens=workload["max_batch_tokens"],
        use_cuda_graph=False,
        use_async_batching=False,
    )
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    phases = workload.get("phases", [list(workload["prompts"])])
    results = {}

    def submit(rids):
        for rid in rids:
            manager.add_request(
                workload["prompts"][rid], request_id=rid, max_new_tokens=workload["max_new"][rid]
            )

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
    return {
        rid: dict(tokens=r.generated_tokens, status=int(r.status), error=r.error)
        for rid, r in results.items()
    }


def run(model, workload: dict, kvattn: bool, fault: str | None = None, between=None) -> dict:
    probe = Probe()
    injected = Fault(fault, workload) if fault else None
    with contextlib.ExitStack() as stack:
        probe.install(stack)
        if injected is not None:
            injected.install(stack)
        stats = stack.enter_context(adapter.kvattn_attention(backend="torch")) if kvattn else None
        results = generate(model, workload, between)
    out = dict(results=results, events=probe.result(), tables=probe.tables)
    if stats is not None:
        out["stats"] = dict(
            forwards=stats.forwards,
            attention_calls=stats.attention_calls,
            pages_checked=stats.pages_checked,
            refused_pages=stats.refused_pages,
            dropped_writes=stats.dropped_writes,
            failed_requests=list(stats.failed_requests),
        )
    if injected is not None:
        out["fault"] = dict(
            kind=fault, victim=injected.victim, applied=injected.applied, **injected.detail
        )
    return out


def compute_seed(model, seed: int) -> dict:
    workload = draw(seed)
    runs = {
        "clean/stock": run(model, workload, kvattn=False),
        "clean/kvattn": run(model, workload, kvattn=True),
    }
    for kind in FAULTS:
        runs[f"{kind}/stock"] = run(model, workload, kvattn=False, fault=kind)
        runs[f"{kind}/kvattn"] = run(model, workload, kvattn=True, fault=kind)
    return dict(workload=workload, runs=runs)


def judge(all_runs: dict) -> Report:
    """The conformance report of :func:`compute_seed`'s results, per seed."""
    rows = {kind: Row(cls, kind, reports) for kind, (cls, reports) in FAULTS.items()}
    report = Report("transformers", transformers.__version__, [int(s) for s in all_runs], [])
    for data in all_runs.values():
        stock, mine = data["runs"]["clean/stock"], data["runs"]["clean/kvattn"]
        clean = {rid: r["tokens"] for rid, r in stock["results"].items()}
        for rid, result in mine["results"].items():
            report.clean_requests += 1
            report.false_refusals += result["error"] is not None
            report.clean_equal_to_stock += result["tokens"] == clean[rid]
        for kind, row in rows.items():
            k, s = data["runs"][f"{kind}/kvattn"], data["runs"][f"{kind}/stock"]
            victim = k["fault"]["victim"]
            row.runs += 1
            row.injected += k["fault"]["applied"] and s["fault"]["applied"]
            row.caught += (k["results"][victim]["error"] or "").startswith(OWNERSHIP_ERROR)
            row.victim_only += k["stats"]["failed_requests"] == [victim] and all(
                r["error"] is None and r["tokens"] == clean[rid]
                for rid, r in k["results"].items()
                if rid != victim
            )
            row.stock_changed += s["results"][victim]["tokens"] != clean[victim]
    report.rows = list(rows.values())
    report.not_replayed = dict(NOT_REPLAYED)
    return report
