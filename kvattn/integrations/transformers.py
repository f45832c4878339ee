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
  shared (the owner recorded with the content hash the engine matched: the lease the block was
  reserved for when the engine registered that hash, recorded per registration, since a block
  freed and refilled with the same tokens comes back under its old hash), never read from the tags.
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

Not supported (refused with a message when the engine is set up): CUDA graphs, torch.compile of the forward, async batching, forking (``num_return_sequences > 1``). The
engine's decode fast path (a block table for flash's own cache write) is switched off so every cache
write goes through the stamping writer. CPU offloading of requests restores KV bytes without a
writer: such requests fail closed (their restored pages are RESERVED, not WRITTEN).
"""
from __future__ import annotations

import contextlib
import logging
from collections import Counter
from dataclasses import dataclass, field

import torch

from .. import api
from ..cache import new_owner_id
from ..report import KVOwnershipError
from ..tags import WriteDrop
from ..writers import release_pages, reserve_pages, write_kv
from .messages import flags as _flags

SUPPORTED_VERSIONS = ("5.24.0",)
ATTENTION_NAMES = ("sdpa", "paged|eager", "flash_attention_2", "flash_attention_3",
                   "flash_attention_4")

logger = logging.getLogger("kvattn")


def check_version(version: str | None = None) -> None:
    """Raise RuntimeError unless the installed transformers (or ``version``) is a tested one."""
    if version is None:
        import transformers
        version = transformers.__version__
    if version not in SUPPORTED_VERSIONS:
        raise RuntimeError(
            f"kvattn.integrations.transformers: transformers {version} is not supported; this adapter "
            f"hooks private parts of continuous batching and was tested with {list(SUPPORTED_VERSIONS)} "
            f"only. Install one of those (pip install transformers=={SUPPORTED_VERSIONS[-1]}).")


class AdapterError(RuntimeError):
    """The engine was configured in a way this adapter does not support."""


@dataclass
class _Batch:
    """What one forward of the engine needs from kvattn, built on the host when the engine prepares
    the batch (rows in the engine's request order)."""

    request_ids: list[str]
    decode_only: bool
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    block_table: torch.Tensor  # [B, max_pages] int32, the engine's block lists
    seq_lens: torch.Tensor  # [B] int32, past + new tokens
    expected: torch.Tensor  # [B, max_pages] int64
    token_owner: torch.Tensor  # [T] int64
    token_row: torch.Tensor  # [T] int64, the batch row of each new token
    refused_pages: torch.Tensor  # [B] int32, summed over layers
    pages_checked: torch.Tensor  # [B] int32, summed over layers
    dropped_tokens: torch.Tensor  # [B] int32, summed over layers
    reports: list = field(default_factory=list)  # (layer, OwnershipReport)
    drops: list = field(default_factory=list)  # (layer, drop_reasons [T])


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


class _State:
    """kvattn's view of one ``PagedAttentionCache``: page views, tags, owners, expected owners."""

    def __init__(self, cache, backend: str, check: bool, stats: Stats):
        from transformers.generation.continuous_batching.cache_allocators import FULL_ATTENTION
        if set(cache.cache_allocators) != {FULL_ATTENTION}:
            raise AdapterError(
                "kvattn.integrations.transformers: only full-attention and sliding-window layers are "
                f"supported, got attention types {sorted(cache.cache_allocators)}")
        allocator = cache.cache_allocators[FULL_ATTENTION]
        self.allocator = allocator
        self.backend = backend
        self.check = check
        self.stats = stats
        layers = allocator.pages_per_block
        page = allocator.tokens_per_page
        heads, dim = allocator.num_key_value_heads, allocator.head_dim
        rows = allocator.cache_tensor.view(-1, heads, dim)
        blocks = rows.view(-1, layers, 2, page, heads, dim)
        self.num_blocks = blocks.shape[0]
        self.page_size = page
        self.block_stride = allocator.block_physical_stride  # rows of the token view per block
        self.trash_blocks = 2 * allocator.blocks_per_sector  # the engine's padding sectors
        self.pages = {layer: (blocks[:, i, 0], blocks[:, i, 1])
                      for i, layer in enumerate(allocator.layer_indices)}
        self.tags = {layer: torch.zeros(self.num_blocks, dtype=torch.int64, device=rows.device)
                     for layer in allocator.layer_indices}
        self.device = rows.device
        self.owner: dict[str, int] = {}  # request id -> owner id
        self.expected: dict[str, list[int]] = {}  # request id -> owner per logical block
        self.block_owner: dict[int, int] = {}  # block -> owner it was reserved for
        # content hash -> (block, owner of the lease that wrote it), for the hashes the engine
        # registered and still holds; block_hash is the inverse, to drop an entry on release.
        self.hash_owner: dict[int, tuple[int, int]] = {}
        self.block_hash: dict[int, int] = {}
        self.batch: _Batch | None = None

    # -- page events ---------------------------------------------------------------------------

    def request_owner(self, request_id: str) -> int:
        if request_id not in self.owner:
            self.owner[request_id] = new_owner_id()
        return self.owner[request_id]

    def reserved(self, request_id: str, blocks: list[int]) -> None:
        owner = self.request_owner(request_id)
        if blocks:
            for tags in self.tags.values():
                reserve_pages(tags, blocks, owner)
        for b in blocks:
            self.block_owner[b] = owner
        self.expected.setdefault(request_id, []).extend([owner] * len(blocks))

    def shared(self, request_id: str, index: int, block: int) -> None:
        """The engine maps logical block ``index`` of the request to ``block`` because its content
        hash matched: expect the owner recorded when that hash was registered."""
        ledger = self.allocator.ledger
        entry = self.hash_owner.get(ledger.block_to_hash.get(block))
        # Owner 0 never matches a tag: a block without a recorded hash fails closed.
        owner = entry[1] if entry is not None and entry[0] == block else 0
        expected = self.expected.setdefault(request_id, [])
        expected.extend([0] * (index + 1 - len(expected)))
        expected[index] = owner

    def hashes_registered(self, before: dict[int, int | None]) -> None:
        """Record the writer of each hash the engine registered in one ``mark_complete_blocks``
        call: ``before`` maps the request's blocks when the call began to their hash then, and a
        block with a hash now and none then was registered by the call, for the tokens the forward
        of the lease it was reserved for wrote. Recorded per registration, not per (block, hash)
        pair: a block freed, reused and filled with the same tokens comes back under its old hash
        with a new writer, while a pair the engine kept across a free is its claim, not a write."""
        ledger = self.allocator.ledger
        for block, old in before.items():
            h = ledger.block_to_hash.get(block)
            if h is not None and old is None:
                self.hash_owner[h] = (block, self.block_owner.get(block, 0))
                self.block_hash[block] = h

    def released(self, blocks: list[int]) -> None:
        if blocks:
            for tags in self.tags.values():
                release_pages(tags, blocks)
        for b in blocks:
            self.block_owner.pop(b, None)
            # A freed block holds no registered content: a later share of it through a hash the
            # engine failed to drop finds no writer and fails closed.
            h = self.block_hash.pop(b, None)
            if h is not None and self.hash_owner.get(h, (None,))[0] == b:
                del self.hash_owner[h]

    def forget(self, request_id: str) -> None:
        self.owner.pop(request_id, None)
        self.expected.pop(request_id, None)

    def reset(self) -> None:
        for tags in self.tags.values():
            tags.zero_()
        self.owner.clear()
        self.expected.clear()
        self.block_owner.clear()
        self.hash_owner.clear()
        self.block_hash.clear()

    # -- one forward ---------------------------------------------------------------------------

    def begin_batch(self, requests: list[tuple[str, int, int]]) -> None:
        """``requests``: ``(request_id, past_length, query_length)`` in the engine's batch order."""
        tables = [self.allocator.block_table.get(rid, []) for rid, _, _ in requests]
        max_pages = max(1, max(len(t) for t in tables))
        batch = len(requests)
        table = torch.zeros(batch, max_pages, dtype=torch.int32)
        expected = torch.zeros(batch, max_pages, dtype=torch.int64)
        for b, ((rid, _, _), blocks) in enumerate(zip(requests, tables)):
            table[b, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            owners = self.expected.get(rid, [])[: len(blocks)]
            expected[b, : len(owners)] = torch.tensor(owners, dtype=torch.int64)
        q_lens = torch.tensor([q for _, _, q in requests], dtype=torch.int64)
        cu = torch.zeros(batch + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(q_lens, 0)
        owners = torch.tensor([self.request_owner(rid) for rid, _, _ in requests], dtype=torch.int64)
        to = dict(device=self.device)
        self.batch = _Batch(
            request_ids=[rid for rid, _, _ in requests],
            decode_only=bool((q_lens == 1).all()),
            cu_seqlens_q=cu.to(**to),
            block_table=table.to(**to),
            seq_lens=torch.tensor([p + q for _, p, q in requests], dtype=torch.int32, **to),
            expected=expected.to(**to),
            token_owner=torch.repeat_interleave(owners, q_lens).to(**to),
            token_row=torch.repeat_interleave(torch.arange(batch), q_lens).to(**to),
            refused_pages=torch.zeros(batch, dtype=torch.int32, **to),
            pages_checked=torch.zeros(batch, dtype=torch.int32, **to),
            dropped_tokens=torch.zeros(batch, dtype=torch.int32, **to),
        )

    def write(self, layer: int, key_states, value_states, write_index: torch.Tensor) -> None:
        """The engine's cache write of ``layer`` at ``write_index`` (rows of its token view), done by
        the stamping writer."""
        batch = self._current()
        k = key_states[0].transpose(0, 1)  # [T, kv_heads, head_dim]
        v = value_states[0].transpose(0, 1)
        if k.shape[0] != batch.token_owner.shape[0] or write_index.shape[0] != k.shape[0]:
            raise AdapterError(
                f"kvattn.integrations.transformers: expected {batch.token_owner.shape[0]} new tokens "
                f"(the batch the engine prepared), got {k.shape[0]} key rows and "
                f"{write_index.shape[0]} write indices (padded inputs are not supported)")
        block = torch.div(write_index, self.block_stride, rounding_mode="floor")
        slot = write_index - block * self.block_stride
        slots = torch.where(slot < self.page_size, block * self.page_size + slot,
                            self.num_blocks * self.page_size)  # not a slot of a page: refused
        slots = torch.where(block < self.trash_blocks, -1, slots)  # the engine's padding writes
        k_pages, v_pages = self.pages[layer]
        result = write_kv(k, v, k_pages, v_pages, slots, self.tags[layer], batch.token_owner)
        dropped = (result.drop_reasons != 0).to(torch.int32)
        batch.dropped_tokens.index_add_(0, batch.token_row, dropped)
        batch.drops.append((layer, result.drop_reasons))

    def attend(self, layer: int, query: torch.Tensor, scale: float | None, **variant) -> torch.Tensor:
        """kvattn's attention of ``layer`` for the prepared batch; ``variant``: the switches of
        :mod:`kvattn.variants` the layer uses (:func:`_variant`)."""
        batch = self._current()
        q = query[0].transpose(0, 1)  # [T, heads, head_dim]
        k_pages, v_pages = self.pages[layer]
        common = dict(scale=scale, check=self.check, backend=self.backend, validate=False, **variant)
        if batch.decode_only:
            out, report = api.paged_decode(q, k_pages, v_pages, batch.block_table, batch.seq_lens,
                                           self.tags[layer], batch.expected, **common)
        else:
            out, report = api.paged_extend(q, k_pages, v_pages, batch.cu_seqlens_q,
                                           batch.block_table, batch.seq_lens, self.tags[layer],
                                           batch.expected, causal=True, **common)
        self.stats.attention_calls += 1
        if report is not None:
            batch.refused_pages += report.violations
            batch.pages_checked += report.pages_checked
            batch.reports.append((layer, report))
        return out.unsqueeze(0)  # [1, T, heads, head_dim], the engine's attention output layout

    def end_batch(self) -> dict[str, KVOwnershipError]:
        """Errors of the requests of the last forward whose KV failed a check (synchronises once)."""
        batch, self.batch = self.batch, None
        if batch is None:
            return {}
        bad = torch.nonzero((batch.refused_pages > 0) | (batch.dropped_tokens > 0)).flatten().tolist()
        self.stats.forwards += 1
        self.stats.pages_checked += int(batch.pages_checked.sum())
        self.stats.refused_pages += int(batch.refused_pages.sum())
        self.stats.dropped_writes += int(batch.dropped_tokens.sum())
        self.stats.failed_requests += [batch.request_ids[b] for b in bad]
        return {batch.request_ids[b]: _error(batch, b) for b in bad}

    def _current(self) -> _Batch:
        if self.batch is None:
            raise AdapterError("kvattn.integrations.transformers: a cache write or attention call "
                               "came without a prepared batch")
        return self.batch


def _error(batch: _Batch, row: int) -> KVOwnershipError:
    """The failure of request ``row``, summarised across the layers of the forward: the writer's
    dropped writes first (usually the cause: a write into a page the request no longer holds leaves
    slots unwritten, which every layer's read then refuses), then the refused reads by reason and
    page, each with the number of layers it happened in."""
    rid = batch.request_ids[row]
    first = batch.cu_seqlens_q[row].item()
    last = batch.cu_seqlens_q[row + 1].item()
    drops: Counter = Counter()  # WriteDrop name -> tokens dropped, summed over layers
    drop_layers = 0
    for _, reasons in batch.drops:
        mine = reasons[first:last]
        dropped = mine[mine != 0].tolist()
        drop_layers += bool(dropped)
        drops.update(_flags(WriteDrop(int(r))) for r in dropped)
    reads: dict[str, Counter] = {}  # Violation name -> logical page -> layers refusing it
    refused: set = set()
    for _, report in batch.reports:
        pages = report.refusals().get(row, [])
        refused.update(pages)
        for page, reason in pages:
            reads.setdefault(_flags(reason), Counter())[page] += 1
    lines = []
    if drops:
        counts = ", ".join(f"{n} {name}" for name, n in sorted(drops.items()))
        lines.append(f"writes: {counts} dropped write(s) of its new tokens, in {drop_layers} of "
                     f"{len(batch.drops)} layer(s)")
    for name, pages in sorted(reads.items()):
        by_layers: dict[int, list] = {}
        for page, n in sorted(pages.items()):
            by_layers.setdefault(n, []).append(page)
        for n, group in sorted(by_layers.items(), reverse=True):
            shown = ", ".join("past the table" if i < 0 else str(i) for i in group[:8])
            more = f", ... ({len(group) - 8} more)" if len(group) > 8 else ""
            lines.append(f"reads: {name} on logical page(s) {shown}{more}, in {n} of "
                         f"{len(batch.reports)} layer(s)")
    message = (f"kvattn ownership check failed for request {rid!r}: its KV pages could not be "
               "proven to hold its own tokens, so the request was stopped.\n" + "\n".join(lines))
    return KVOwnershipError(message, {row: sorted(refused)})


def _variant(kwargs: dict, device: torch.device) -> dict:
    """The :mod:`kvattn.variants` switches of one attention call, from the keyword arguments the
    model's attention module passes to the attention function (transformers 5.24: Mistral, Qwen2,
    Gemma 2 and gpt-oss pass ``sliding_window``, Gemma 2 ``softcap``, gpt-oss ``s_aux``)."""
    variant = {}
    window = kwargs.get("sliding_window")
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise AdapterError("kvattn.integrations.transformers: expected sliding_window to be a "
                               f"positive int (keys a query attends, itself included), got {window!r}")
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
    from transformers.generation.continuous_batching.cache_allocators import (FULL_ATTENTION,
                                                                              SLIDING_ATTENTION)

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
        CacheAllocator, CachePool, FullAttentionCacheAllocator)
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
                for i, block in enumerate(self.block_table[request_id]):
                    state.shared(request_id, i, block)
        return acquire_prefix_blocks

    def mark_complete(original):
        def mark_complete_blocks(self, request_id, token_ids, new_new_blocks):
            state = _state_of(self)
            before = list(self.block_table.get(request_id, []))
            hashed = {b: self.ledger.block_to_hash.get(b) for b in before}
            original(self, request_id, token_ids, new_new_blocks)
            if state is not None:
                state.hashes_registered(hashed)
                # De-duplication: the engine swapped a block for an identical one already hashed.
                for i, (old, new) in enumerate(zip(before, self.block_table[request_id])):
                    if old != new:
                        state.shared(request_id, i, new)
        return mark_complete_blocks

    def fork(original):
        def fork_blocks(self, source_request_id, dest_request_id, past_length):
            if _state_of(self) is not None:
                raise AdapterError("kvattn.integrations.transformers: forking requests "
                                   "(num_return_sequences > 1) is not supported")
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
            rows = [(fs.state.request_id, fs.state.position_offset, fs.query_length)
                    for fs in requests_in_batch]
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
                error = failed[request.request_id]
                logger.error("%s", error)
                self._handle_request_error(error, request)
                self.scheduler.finish_request(request.request_id)
        return update

    def attention(original):
        def attention_forward(module, query, key, value, attention_mask, *args, **kwargs):
            state = kwargs.get("kvattn_state")
            if state is None:
                return original(module, query, key, value, attention_mask, *args, **kwargs)
            return state.attend(module.layer_idx, query, kwargs.get("scaling"),
                                **_variant(kwargs, query.device)), None
        return attention_forward

    try:
        patch(cb_cache, "group_layers_by_attn_type", _all_full_attention)
        patch(Cache, "__init__", cache_init)
        patch(Cache, "update", cache_update)
        patch(Cache, "reset", cache_reset)
        patch(FullAttentionCacheAllocator, "allocate_cache_to_request", allocate)
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
    if reasons:
        raise AdapterError("kvattn.integrations.transformers does not support " + "; ".join(reasons)
                           + " yet: set them in ContinuousBatchingConfig")


__all__ = ["SUPPORTED_VERSIONS", "AdapterError", "Stats", "check_version", "kvattn_attention"]
