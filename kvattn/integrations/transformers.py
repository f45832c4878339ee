"""kvattn as the attention of Hugging Face transformers continuous batching (``generate_batch``).

Usage::

    from kvattn.integrations.transformers import kvattn_attention

    with kvattn_attention():
        results = model.generate_batch(prompts, generation_config=..., continuous_batching_config=...)
    # a request whose KV failed the ownership check ends with status FAILED and an error that
    # starts with "kvattn ownership check"; the other requests are unaffected.

Tested with transformers ``SUPPORTED_VERSIONS`` only; other versions are refused on entry, because the
hooks below follow private methods of the engine.

How it hooks in (all installed on entry, restored on exit, for caches created inside the block):

- **Pages.** The engine keeps one byte buffer; a full-attention "block" holds one page per layer,
  ``[layer][K|V][page_size][kv_heads][head_dim]``. Viewing it as ``[blocks, layers, 2, page_size,
  kv_heads, head_dim]`` gives each layer's K and V pools as strided ``[num_blocks, page_size,
  kv_heads, head_dim]`` views (:mod:`kvattn.layout`), physical page id = the engine's block id, with
  one tag array per layer. Nothing is copied.
- **Tags follow the engine's own events.** A block the allocator hands to a request is reserved for
  that request's owner id (a fresh id per request); the engine's cache write
  (``PagedAttentionCache.update``, which receives ``write_index``) is replaced by
  :func:`kvattn.write_kv` at the same slots, which stamps pages WRITTEN only for tokens it wrote; a
  block going back to the engine's free pool (``CachePool.free_blocks``) becomes FREE. The expected
  owner of each logical block is recorded when the block is allocated (the request's owner) or
  shared through the engine's hash table: the lease the block was reserved for when the engine
  registered its hash (recorded per registration, since a block freed and refilled with the same
  tokens comes back under its old hash), and only if kvattn's own digest of the writer's token
  prefix through that block equals the reader's (the ledger's prefix digests, not the engine's
  hash: a block the engine matches wrongly, a hash collision, fails closed); never read from the
  tags.
- **Attention.** The engine's attention function (``sdpa``, ``paged|eager``, ``flash_attention_*``)
  is wrapped: calls coming through a hooked cache run :func:`kvattn.paged_extend` (or
  :func:`kvattn.paged_decode` when every request has one new token) over the pages, through a block
  table built from the engine's per-request block lists; the gathered K/V the engine would pass are
  not built. Other calls go to the original function.
- **Variants.** What the model's attention module passes to the attention function becomes the
  switches of :mod:`kvattn.variants`: ``sliding_window=W`` (the layers the config makes sliding:
  ``config.layer_types``, or every layer when the config has a ``sliding_window`` and no layer
  types) is ``window_left = W - 1`` (the query and the ``W - 1`` keys before it, as transformers'
  sliding-window mask), ``softcap`` (Gemma 2's ``attn_logit_softcapping``) is
  ``logits_soft_cap``, and ``s_aux`` (gpt-oss's per-head sinks) is ``sinks``. Sliding-window layers
  keep every token in full-attention pages (the engine's cache is set up as if all layers were
  full attention): transformers' sliding allocator is a ring buffer that overwrites a slot in place
  when its token leaves the window, which a page's written prefix cannot describe. kvattn's window
  then neither reads nor checks the pages before it, so memory is that of full attention.
- **Failure.** Reports and writer drops are accumulated per request over the layers of a forward;
  after the forward (where the engine reads its sampled tokens back anyway) one synchronisation
  reads them, and each affected request is failed through the engine's own per-request error path
  (``_handle_request_error`` + ``scheduler.finish_request``) with a :class:`kvattn.KVOwnershipError`
  message, before its token is accepted. The other requests of the batch proceed unchanged: refused
  slots are masked, never attended, so nothing leaks across requests.

Not supported (refused with a message when the engine is set up): CUDA graphs, torch.compile of the
forward, async batching, forking (``num_return_sequences > 1``). The
engine's decode fast path (a block table for flash's own cache write) is switched off so every cache
write goes through the stamping writer. CPU offloading of requests restores KV bytes without a
writer: such requests fail closed (their restored pages are RESERVED, not WRITTEN).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from ..report import KVOwnershipError
from .ledger import IntegrationError, Ledger, refuse
from .ledger import check_version as _check_version

SUPPORTED_VERSIONS = ("5.24.0",)
ATTENTION_NAMES = (
    "sdpa",
    "paged|eager",
    "flash_attention_2",
    "flash_attention_3",
    "flash_attention_4",
)


def check_version(version: str | None = None) -> None:
    """Raise RuntimeError unless the installed transformers (or ``version``) is a tested one."""
    if version is None:
        import transformers

        version = transformers.__version__
    _check_version(
        "transformers",
        "transformers",
        version,
        SUPPORTED_VERSIONS,
        f"Install one of those (pip install transformers=={SUPPORTED_VERSIONS[-1]}).",
    )


@dataclass
class Stats:
    """What the adapter did inside one ``with kvattn_attention()`` block (counted on the host after
    each forward), so a caller can prove kvattn ran: forwards, kvattn attention calls, logical pages
    the checks examined and refused, new tokens whose cache write the writer dropped (each summed
    over layers), and the ids of the requests it failed: a request with a refused page or a dropped
    write is failed, so a clean run ends with both counts 0."""

    forwards: int = 0
    attention_calls: int = 0
    pages_checked: int = 0
    refused_pages: int = 0
    dropped_writes: int = 0
    failed_requests: list = field(default_factory=list)


class _State(Ledger):
    """kvattn's ledger of one ``PagedAttentionCache``: the allocator's and the cache pool's events
    translated into leases, reservations, releases and hits on registered content hashes."""

    adapter = "transformers"

    def __init__(self, cache, backend: str, check: bool, stats: Stats):
        from transformers.generation.continuous_batching.cache_allocators import FULL_ATTENTION

        if set(cache.cache_allocators) != {FULL_ATTENTION}:
            raise IntegrationError(
                "kvattn.integrations.transformers: only full-attention and sliding-window layers are "
                f"supported, got attention types {sorted(cache.cache_allocators)}"
            )
        allocator = cache.cache_allocators[FULL_ATTENTION]
        super().__init__(allocator.tokens_per_page, backend=backend, check=check)
        self.allocator = allocator
        self.stats = stats
        layers = allocator.pages_per_block
        page = allocator.tokens_per_page
        heads, dim = allocator.num_key_value_heads, allocator.head_dim
        rows = allocator.cache_tensor.view(-1, heads, dim)
        blocks = rows.view(-1, layers, 2, page, heads, dim)
        self.num_blocks = blocks.shape[0]
        self.block_stride = allocator.block_physical_stride  # rows of the token view per block
        self.trash_blocks = 2 * allocator.blocks_per_sector  # the engine's padding sectors
        self.pages = {
            layer: (blocks[:, i, 0], blocks[:, i, 1])
            for i, layer in enumerate(allocator.layer_indices)
        }
        self.layer_row = {layer: i for i, layer in enumerate(allocator.layer_indices)}
        self.allocate_tags(len(self.layer_row), self.num_blocks, rows.device)
        self.device = rows.device
        self.block_owner: dict[int, int] = {}  # block -> owner it was reserved for
        self.searching: dict[str, list[int]] = {}  # request -> prompt, while its prefix is matched

    # -- page events ---------------------------------------------------------------------------

    def request_owner(self, request_id: str) -> int:
        lease = self.leases.get(request_id)
        if lease is None:
            lease = self.open_lease(request_id)
        return lease.owner

    def reserved(self, request_id: str, blocks: list[int]) -> None:
        owner = self.request_owner(request_id)
        self.reserve(blocks, owner)
        for b in blocks:
            self.block_owner[b] = owner
        self.leases[request_id].expected[0].extend([owner] * len(blocks))

    def shared(self, request_id: str, index: int, block: int, key: bytes | None) -> None:
        """The engine maps logical block ``index`` of the request to ``block`` because its content
        hash matched: expect the owner recorded when that hash was registered, if the digest it
        was registered with is ``key``, the reader's own digest of its tokens through that block
        (owner 0, which never matches a tag, otherwise or for ``key`` None: it fails closed)."""
        self.request_owner(request_id)
        expected = self.leases[request_id].expected[0]
        expected.extend([0] * (index + 1 - len(expected)))
        expected[index] = self.hit_owner(block, key)

    def hashes_registered(
        self, before: list[int], hashed: dict[int, int | None], keys: list[bytes]
    ) -> None:
        """Record the writer of each hash the engine registered in one ``mark_complete_blocks``
        call: ``before`` is the request's block table when the call began, ``hashed`` each of
        those blocks' hash then, ``keys`` the digests of the request's token prefixes through each
        block. A block with a hash now and none then was registered by the call, for the tokens
        the forward of the lease it was reserved for wrote. Recorded per registration, not per
        (block, hash) pair: a block freed, reused and filled with the same tokens comes back under
        its old hash with a new writer, while a pair the engine kept across a free is its claim,
        not a write."""
        ledger = self.allocator.ledger
        for i, block in enumerate(before):
            if ledger.block_to_hash.get(block) is not None and hashed.get(block) is None:
                key = keys[i] if i < len(keys) else None
                self.remember(block, self.block_owner.get(block, 0), key)

    def released(self, blocks: list[int]) -> None:
        self.release(blocks)
        for b in blocks:
            self.block_owner.pop(b, None)
            # A freed block holds no registered content: a later share of it through a hash the
            # engine failed to drop finds no writer and fails closed.
            self.content.pop(b, None)

    def forget(self, request_id: str) -> None:
        self.close_lease(request_id)

    def reset(self) -> None:
        self.tags.zero_()
        self.leases.clear()
        self.block_owner.clear()
        self.content.clear()

    # -- one forward ---------------------------------------------------------------------------

    def begin_batch(self, requests: list[tuple[str, int, int]]) -> None:
        """``requests``: ``(request_id, past_length, query_length)`` in the engine's batch order."""
        tables = [self.allocator.block_table.get(rid, []) for rid, _, _ in requests]
        max_pages = max(1, max(len(t) for t in tables))
        batch = len(requests)
        table = torch.zeros(batch, max_pages, dtype=torch.int32)
        expected = torch.zeros(batch, max_pages, dtype=torch.int64)
        owners = [self.request_owner(rid) for rid, _, _ in requests]
        for b, ((rid, _, _), blocks) in enumerate(zip(requests, tables)):
            table[b, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            row = self.leases[rid].expected[0][: len(blocks)]
            expected[b, : len(row)] = torch.tensor(row, dtype=torch.int64)
        self.start_step(
            [rid for rid, _, _ in requests],
            owners,
            [q for _, _, q in requests],
            table.to(self.device),
            expected,
            [p + q for _, p, q in requests],
        )

    def write(self, layer: int, key_states, value_states, write_index: torch.Tensor) -> None:
        """The engine's cache write of ``layer`` at ``write_index`` (rows of its token view), done by
        the stamping writer."""
        step = self.step()
        k = key_states[0].transpose(0, 1)  # [T, kv_heads, head_dim]
        v = value_states[0].transpose(0, 1)
        if k.shape[0] != step.token_row.shape[0] or write_index.shape[0] != k.shape[0]:
            raise IntegrationError(
                f"kvattn.integrations.transformers: expected {step.token_row.shape[0]} new tokens "
                f"(the batch the engine prepared), got {k.shape[0]} key rows and "
                f"{write_index.shape[0]} write indices (padded inputs are not supported)"
            )
        block = torch.div(write_index, self.block_stride, rounding_mode="floor")
        slot = write_index - block * self.block_stride
        slots = torch.where(
            slot < self.page_size, block * self.page_size + slot, self.num_blocks * self.page_size
        )  # not a slot of a page: refused
        slots = torch.where(block < self.trash_blocks, -1, slots)  # the engine's padding writes
        k_pages, v_pages = self.pages[layer]
        step.write(f"layer {layer}", k, v, k_pages, v_pages, slots, self.layer_tags(layer))

    def layer_tags(self, layer: int) -> torch.Tensor:
        return self.tags[self.layer_row[layer]]

    def attend(
        self, layer: int, query: torch.Tensor, scale: float | None, **variant
    ) -> torch.Tensor:
        """kvattn's attention of ``layer`` for the prepared batch; ``variant``: the switches of
        :mod:`kvattn.variants` the layer uses (:func:`_variant`)."""
        q = query[0].transpose(0, 1)  # [T, heads, head_dim]
        k_pages, v_pages = self.pages[layer]
        out = self.step().attend(
            f"layer {layer}", q, k_pages, v_pages, self.layer_tags(layer), scale=scale, **variant
        )
        self.stats.attention_calls += 1
        return out.unsqueeze(0)  # [1, T, heads, head_dim], the engine's attention output layout

    def end_batch(self) -> dict[str, KVOwnershipError]:
        """Errors of the requests of the last forward whose KV failed a check (synchronises once)."""
        if not self.steps:
            return {}
        before = (self.pages_checked, self.counts["refused_pages"], self.counts["dropped_writes"])
        failed = self.finish()
        self.stats.forwards += 1
        self.stats.pages_checked += self.pages_checked - before[0]
        self.stats.refused_pages += self.counts["refused_pages"] - before[1]
        self.stats.dropped_writes += self.counts["dropped_writes"] - before[2]
        self.stats.failed_requests += list(failed)
        return {
            rid: KVOwnershipError(message, {row: step.refusals(row)})
            for rid, (step, row, message) in failed.items()
        }


def _variant(kwargs: dict, device: torch.device) -> dict:
    """The :mod:`kvattn.variants` switches of one attention call, from the keyword arguments the
    model's attention module passes to the attention function (transformers 5.24: Mistral, Qwen2,
    Gemma 2 and gpt-oss pass ``sliding_window``, Gemma 2 ``softcap``, gpt-oss ``s_aux``)."""
    variant = {}
    window = kwargs.get("sliding_window")
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise IntegrationError(
                "kvattn.integrations.transformers: expected sliding_window to "
                "be a positive int (keys a query attends, itself included), "
                f"got {window!r}"
            )
        variant["window_left"] = window - 1
    cap = kwargs.get("softcap")
    if cap is not None and cap != 0:
        variant["logits_soft_cap"] = float(cap)
    sinks = kwargs.get("s_aux")
    if sinks is not None:
        variant["sinks"] = sinks.detach().to(device=device, dtype=torch.float32).contiguous()
    return variant


def _all_full_attention(original):
    """transformers' grouping of layers by attention type, with sliding-window layers grouped with
    the full-attention ones: they keep all their tokens in pages, and kvattn applies the window
    (the module docstring says why). Other attention types stay apart, and the cache refuses them."""
    from transformers.generation.continuous_batching.cache_allocators import (
        FULL_ATTENTION,
        SLIDING_ATTENTION,
    )

    def group_layers_by_attn_type(config):
        groups = original(config)
        if not set(groups) <= {FULL_ATTENTION, SLIDING_ATTENTION}:
            return groups
        return {FULL_ATTENTION: sorted(i for layers in groups.values() for i in layers)}

    return group_layers_by_attn_type


def _state_of(obj) -> _State | None:
    return getattr(obj, "_kvattn_state", None)


@contextlib.contextmanager
def kvattn_attention(*, backend: str = "auto", check: bool = True):
    """Route transformers continuous batching through kvattn inside the ``with`` block.

    ``backend``: as in :func:`kvattn.paged_decode`. ``check=False`` runs the unchecked attention
    kernels (for measurements): reads are no longer checked, but the writer still refuses writes into
    pages the request does not hold and fails the request whose writes it dropped. Yields a
    :class:`Stats`. Only caches the engine creates inside the block are hooked; do not keep a
    manager alive across the block (``persistent_manager=True``): after exit its cache is no longer
    stamped.
    """
    check_version()
    if getattr(kvattn_attention, "_active", False):
        raise RuntimeError("kvattn_attention(): already active (it does not nest)")
    from transformers.generation.continuous_batching import cache as cb_cache
    from transformers.generation.continuous_batching import continuous_api, input_outputs
    from transformers.generation.continuous_batching.cache_allocators import (
        CacheAllocator,
        CachePool,
        FullAttentionCacheAllocator,
    )
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    Cache = cb_cache.PagedAttentionCache
    IOs = input_outputs.ContinuousBatchingIOs
    Processor = continuous_api.ContinuousBatchProcessor
    originals: list[tuple[object, str, object]] = []
    saved_attention: dict[str, object] = {}
    stats = Stats()

    def patch(owner, name, make):
        original = owner.__dict__[name]
        originals.append((owner, name, original))
        setattr(owner, name, make(original))

    def cache_init(original):
        def __init__(self, config, continuous_batching_config, *args, **kwargs):
            original(self, config, continuous_batching_config, *args, **kwargs)
            _refuse_unsupported(continuous_batching_config)
            state = _State(self, backend, check, stats)
            # The decode fast path hands the cache write to flash's kernel; without it every write
            # goes through update(), where kvattn stamps it.
            self.max_blocks_per_request = 0
            self.max_decode_fast_path_length = 0
            self._kvattn_state = self.pool._kvattn_state = state.allocator._kvattn_state = state

        return __init__

    def cache_update(original):
        def update(self, key_states, value_states, layer_idx, kwargs):
            state = _state_of(self)
            if state is None:
                return original(self, key_states, value_states, layer_idx, kwargs)
            allocator = self.layer_to_allocator[layer_idx]
            kwargs["cu_seq_lens_k"] = kwargs["cu_seq_lens_k"][allocator.layer_type].to(torch.int32)
            kwargs["max_length_k"] = kwargs["max_length_k"][allocator.layer_type]
            state.write(layer_idx, key_states, value_states, kwargs["write_index"][allocator.index])
            kwargs["kvattn_state"] = state
            return key_states, value_states

        return update

    def cache_reset(original):
        def reset(self):
            original(self)
            if _state_of(self) is not None:
                _state_of(self).reset()

        return reset

    def allocate(original):
        def allocate_cache_to_request(self, request_id, past_length, query_length):
            before = len(self.block_table.get(request_id, []))
            original(self, request_id, past_length, query_length)
            if _state_of(self) is not None:
                _state_of(self).reserved(request_id, self.block_table[request_id][before:])

        return allocate_cache_to_request

    def acquire(original):
        def acquire_prefix_blocks(self, request_id, prefix_len, block_ids):
            original(self, request_id, prefix_len, block_ids)
            state = _state_of(self)
            if state is not None:
                state.forget(request_id)
                # The prompt the engine matched (search), digested here; none known: no proof.
                keys = state.digests(state.searching.get(request_id, []))
                for i, block in enumerate(self.block_table[request_id]):
                    state.shared(request_id, i, block, keys[i] if i < len(keys) else None)

        return acquire_prefix_blocks

    def search(original):
        def search_prefix_match(self, request_id, prompt_ids):
            state = _state_of(self)
            if state is None:
                return original(self, request_id, prompt_ids)
            state.searching[request_id] = list(prompt_ids)
            try:
                return original(self, request_id, prompt_ids)
            finally:
                del state.searching[request_id]

        return search_prefix_match

    def mark_complete(original):
        def mark_complete_blocks(self, request_id, token_ids, new_new_blocks):
            state = _state_of(self)
            before = list(self.block_table.get(request_id, []))
            hashed = {b: self.ledger.block_to_hash.get(b) for b in before}
            original(self, request_id, token_ids, new_new_blocks)
            if state is not None:
                keys = state.digests(token_ids)
                state.hashes_registered(before, hashed, keys)
                # De-duplication: the engine swapped a block for an identical one already hashed.
                for i, (old, new) in enumerate(zip(before, self.block_table[request_id])):
                    if old != new:
                        state.shared(request_id, i, new, keys[i] if i < len(keys) else None)

        return mark_complete_blocks

    def fork(original):
        def fork_blocks(self, source_request_id, dest_request_id, past_length):
            if _state_of(self) is not None:
                raise IntegrationError(
                    "kvattn.integrations.transformers: forking requests "
                    "(num_return_sequences > 1) is not supported"
                )
            return original(self, source_request_id, dest_request_id, past_length)

        return fork_blocks

    def free_request(original):
        def free_blocks(self, request_id, no_cache=False):
            original(self, request_id, no_cache)
            if _state_of(self) is not None:
                _state_of(self).forget(request_id)

        return free_blocks

    def pool_free(original):
        def free_blocks(self, index, block_ids):
            original(self, index, block_ids)
            state = _state_of(self)
            if state is not None and index == state.allocator.index:
                state.released(list(block_ids))

        return free_blocks

    def prepare(original):
        def prepare_batch_tensors(self, requests_in_batch, *args, **kwargs):
            rows = [
                (fs.state.request_id, fs.state.position_offset, fs.query_length)
                for fs in requests_in_batch
            ]
            original(self, requests_in_batch, *args, **kwargs)
            state = _state_of(self.cache)
            if state is not None:
                state.begin_batch(rows)

        return prepare_batch_tensors

    def update_batch(original):
        def update(self):
            state = _state_of(self.cache)
            failed = state.end_batch() if state is not None else {}
            if not failed:
                return original(self)
            io = self.inputs_and_outputs
            read_back = io.prepare_batch_update
            failed_states = []

            def without_failed():
                requests, tokens, logprobs = read_back()
                kept, kept_tokens, kept_logprobs, k = [], [], [], 0
                for fs in requests:
                    if fs.has_new_token:
                        token = tokens[k]
                        logprob = logprobs[k] if logprobs is not None else None
                        k += 1
                    if fs.state.request_id in failed:
                        failed_states.append(fs.state)
                        continue
                    kept.append(fs)
                    if fs.has_new_token:
                        kept_tokens.append(token)
                        kept_logprobs.append(logprob)
                return kept, kept_tokens, kept_logprobs if logprobs is not None else None

            io.prepare_batch_update = without_failed
            try:
                original(self)
            finally:
                del io.prepare_batch_update
            for request in failed_states:
                self._handle_request_error(failed[request.request_id], request)
                self.scheduler.finish_request(request.request_id)

        return update

    def attention(original):
        def attention_forward(module, query, key, value, attention_mask, *args, **kwargs):
            state = kwargs.get("kvattn_state")
            if state is None:
                return original(module, query, key, value, attention_mask, *args, **kwargs)
            return state.attend(
                module.layer_idx, query, kwargs.get("scaling"), **_variant(kwargs, query.device)
            ), None

        return attention_forward

    try:
        patch(cb_cache, "group_layers_by_attn_type", _all_full_attention)
        patch(Cache, "__init__", cache_init)
        patch(Cache, "update", cache_update)
        patch(Cache, "reset", cache_reset)
        patch(FullAttentionCacheAllocator, "allocate_cache_to_request", allocate)
        patch(Cache, "search_prefix_match", search)
        patch(CacheAllocator, "acquire_prefix_blocks", acquire)
        patch(CacheAllocator, "mark_complete_blocks", mark_complete)
        patch(CacheAllocator, "fork_blocks", fork)
        patch(CacheAllocator, "free_blocks", free_request)
        patch(CachePool, "free_blocks", pool_free)
        patch(IOs, "prepare_batch_tensors", prepare)
        patch(Processor, "update_batch", update_batch)
        for name in ATTENTION_NAMES:
            if name in ALL_ATTENTION_FUNCTIONS:
                saved_attention[name] = ALL_ATTENTION_FUNCTIONS._local_mapping.get(name)
                ALL_ATTENTION_FUNCTIONS[name] = attention(ALL_ATTENTION_FUNCTIONS[name])
        kvattn_attention._active = True
        yield stats
    finally:
        kvattn_attention._active = False
        for owner, name, original in reversed(originals):
            setattr(owner, name, original)
        for name, fn in saved_attention.items():
            if fn is None:
                ALL_ATTENTION_FUNCTIONS._local_mapping.pop(name, None)
            else:
                ALL_ATTENTION_FUNCTIONS[name] = fn


def _refuse_unsupported(cb_config) -> None:
    reasons = []
    if any(cb_config.cuda_graph_booleans):
        reasons.append("CUDA graphs (use_cuda_graph=False)")
    if cb_config.varlen_compile_config is not None or cb_config.decode_compile_config is not None:
        reasons.append("torch.compile of the forward (no varlen/decode compile config)")
    if cb_config.use_async_batching:
        reasons.append("async batching (use_async_batching=False)")
    refuse("transformers", reasons, " yet: set them in ContinuousBatchingConfig")


__all__ = ["SUPPORTED_VERSIONS", "IntegrationError", "Stats", "check_version", "kvattn_attention"]
