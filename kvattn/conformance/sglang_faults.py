"""The conformance suite's fault injectors under SGLang, installed into a server's processes by
:mod:`kvattn.conformance.sglang_server` (:func:`install`). Each acts only on requests whose
``rid`` starts with its name and a colon (``"lost-write:w3"``), once per request, and appends what
it did to the JSON-lines file ``KVATTN_CONFORMANCE_FAULT_LOG``. A request without such a prefix
is never touched. They stand for the bookkeeping errors of the public record
(:data:`kvattn.conformance.sglang.FAULTS` says which), applied to SGLang's own structures:

- ``placeholder`` (prefill instance): the request's prompt becomes a one-token placeholder when it
  enters the prefill queue (what SGLang did with a prompt too long for the prefill node before
  0.5.23 retired such requests at intake); the decode instance, which reserved pages for the
  whole prompt, is told the transfer is done.
- ``short-transfer`` (prefill instance): each chunk hands the transfer engine its first page only,
  as one finished transfer (a transport that moved less than it reported).
- ``bad-attestation`` (prefill instance): the attestation frame of the request names no page
  correctly (a malformed frame from a broken or hostile peer).
- ``replayed-attestation`` (prefill instance): the request's attestation frame repeats the one
  sent for the previous transfer (a replayed or misrouted frame).
- ``corrupt-arrival`` (decode instance): the first page's K bytes change after the transfer
  arrived, before the request is committed (a completion reported before the bytes were right).
- ``foreign-entry``: for one decode forward the request's ``req_to_token`` entries of its first
  page (at least ``SPAN`` tokens) name another request's pages (a misrouted or stale table entry).
- ``stale-hit``: for the forward that reads a radix-cache hit, the hit's first page (at least
  ``SPAN`` tokens) is another request's (a prefix match whose pages were meanwhile handed out and
  rewritten).
- ``lost-write``: the request's first extend forward stores its K/V into SGLang's padding slot
  instead of its pages (a write that never reached the pages its table names). The slots it
  misses are first given the bytes of a free page another request wrote last, what a reused
  page holds in service: left as they were, they could hold the request's own bytes from an
  earlier run of its workload, and reading them would change nothing.
- ``boundary-hit``: for the extend forward right after a radix hit of exactly ``SPAN`` tokens
  (one page at page size 16), the request's ``req_to_token`` entries of the tokens after the hit
  name free pages, holding whatever KV their last holder left, while its writes still go to its
  own (corruption exactly at ``prefix_len == page_size``). Not pages the same request wrote in
  an earlier run of its workload: they hold the very bytes it writes now. Only in the forward
  that completes the prompt: a chunk before it would be inserted into the radix cache while the
  entries are swapped (SGLang inserts a chunked request's pages while the next forward runs).
  Free pages, not another request's live ones: a table that names a live page at a new
  token's position is a write into that page too, which the ledger follows (the page is
  reserved for the writer, and its other readers fail from then on), so the fault would reach
  requests beyond its victim.
- ``host-corrupt`` (a server with HiCache): when the request's radix match is loaded back from
  host memory, the host copy of the first page to come back has changed (K bytes + 1) before
  the copy to the device (a restore that read the host copy before its bytes were right, or a
  copy changed while offloaded).
- ``salt-ignored``: acts on cache salts instead of request ids: a salt that starts with
  ``salt-ignored:`` is left out of every radix key built with it, so requests under two such salts
  share one another's cached pages (a cache that ignores the salt).

With ``KVATTN_CONFORMANCE_COUNTS`` set, a kvattn server also writes its ledger's counts and
failed requests to that JSON file after each forward (a server keeps them in memory only).
"""

from __future__ import annotations

import dataclasses
import importlib.abc
import importlib.util
import json
import os
import sys
import threading

import torch

FAULT_LOG = "KVATTN_CONFORMANCE_FAULT_LOG"
COUNTS = "KVATTN_CONFORMANCE_COUNTS"
PREFILL_FAULTS = ("placeholder", "short-transfer", "bad-attestation", "replayed-attestation")
DECODE_FAULTS = ("corrupt-arrival",)
FORWARD_FAULTS = ("foreign-entry", "stale-hit", "lost-write", "boundary-hit")
KEY_FAULTS = ("salt-ignored",)
OFFLOAD_FAULTS = ("host-corrupt",)

_lock = threading.Lock()
_applied: set[str] = set()
_rows: dict[int, str] = {}  # req_to_token row -> rid of the request holding it
_prompts: dict[int, int] = {}  # req_to_token row -> its request's prompt length
_first_pages: dict[str, torch.Tensor] = {}  # rid -> the slots of its first span, once written
SPAN = 16  # tokens
_rooms: dict[int, str] = {}  # bootstrap room -> rid (prefill instance)
_writers: dict[int, str] = {}  # page -> the request that last wrote it, its fault prefix dropped


def fault_of(rid) -> str | None:
    name = str(rid).split(":", 1)[0] if rid is not None and ":" in str(rid) else None
    known = PREFILL_FAULTS + DECODE_FAULTS + FORWARD_FAULTS + KEY_FAULTS + OFFLOAD_FAULTS
    return name if name in known else None


def _unfaulted(rid) -> str:
    """The request id without its fault's prefix: the same request in its workload's every run."""
    return str(rid).split(":", 1)[1] if fault_of(rid) else str(rid)


def _once(rid: str, **detail) -> bool:
    """Record that the fault of ``rid`` is applied now; False if it was already."""
    with _lock:
        if rid in _applied:
            return False
        _applied.add(rid)
    _log(fault=fault_of(rid), rid=rid, **detail)
    return True


def _log(**record) -> None:
    path = os.environ.get(FAULT_LOG)
    if path:
        with _lock, open(path, "a") as log:
            log.write(json.dumps(record) + "\n")


# -- request rows --------------------------------------------------------------------------------


def _track_rows(module) -> None:
    for cls in (module.ReqToTokenPool,):
        alloc, free = cls.alloc, cls.free

        def alloc_hook(self, reqs, _alloc=alloc):
            rows = _alloc(self, reqs)
            if rows is not None:
                for r in reqs:
                    _rows[r.kv.req_pool_idx] = r.rid
                    _prompts[r.kv.req_pool_idx] = len(r.origin_input_ids)
            return rows

        def free_hook(self, req, _free=free):
            _rows.pop(req.kv.req_pool_idx, None)
            return _free(self, req)

        cls.alloc, cls.free = alloc_hook, free_hook


# -- the radix key -------------------------------------------------------------------------------


def _wrap_radix_key(module) -> None:
    init = module.RadixKey.__init__

    def init_hook(self, *args, **kwargs):
        # RadixKey(token_ids, extra_key=None, is_bigram=False, limit=None, cache_salt=None)
        salt = kwargs.get("cache_salt", args[4] if len(args) > 4 else None)
        if fault_of(salt) == "salt-ignored":
            if len(args) > 4:
                args = args[:4] + (None,) + args[5:]
            else:
                kwargs["cache_salt"] = None
            _once(salt)
        init(self, *args, **kwargs)

    module.RadixKey.__init__ = init_hook


# -- forwards ------------------------------------------------------------------------------------


def _donor(rid: str, mine: torch.Tensor) -> torch.Tensor | None:
    """The first slots of another request that wrote them earlier (the newest) sharing none of
    ``mine``: pages holding another request's KV, running or kept by the radix cache."""
    for other, slots in reversed(list(_first_pages.items())):
        if (
            other != rid
            and slots.shape == mine.shape
            and not set(slots.tolist()) & set(mine.tolist())
        ):
            return slots
    return None


def _free_slots(allocator, n: int, P: int, writer: str) -> torch.Tensor | None:
    """``n`` slots of the allocator's free pages (page size ``P``), in no request's table, none
    last written by ``writer``: a page the same request wrote in an earlier run of its workload
    holds the bytes it is about to write, and reading it would change nothing."""
    free = allocator.free_pages
    if free is None:
        return None
    pages = [p for p in free.tolist() if _writers.get(p) != writer][: -(-n // P)]
    if len(pages) * P < n:
        return None
    pages = torch.tensor(pages, dtype=torch.int64)
    return (pages[:, None] * P + torch.arange(P)).flatten()[:n]


def _copy_slots(pool, dst: torch.Tensor, src: torch.Tensor) -> None:
    """Every layer's K/V of slots ``src`` into slots ``dst``, past the pool's own methods (which
    kvattn follows as writes): bytes a page's last holder left behind."""
    if getattr(pool, "use_hnd", False):
        raise NotImplementedError("the fault injector reads pools of token-major layout only")
    for name in ("k_buffer", "v_buffer", "kv_buffer"):
        for buffer in getattr(pool, name, None) or ():
            to = dict(device=buffer.device, dtype=torch.int64)
            buffer[dst.to(**to)] = buffer[src.to(**to)]


def _apply(runner, fb):
    """The faults due in this forward; returns the function that undoes them and records the
    first pages its requests will have written."""
    undo, written = [], []
    rows = [int(r) for r in fb.req_pool_indices.tolist()]
    seq_lens = (fb.seq_lens_cpu if fb.seq_lens_cpu is not None else fb.seq_lens).tolist()
    # Speculative decoding's verify forwards are its decodes: each request's draft tokens after
    # its committed ones (seq_lens).
    verify = fb.forward_mode.is_target_verify()
    decode = fb.forward_mode.is_decode() or verify
    P = runner.token_to_kv_pool_allocator.page_size
    table = runner.req_to_token_pool.req_to_token
    if verify:
        q_lens = [int(fb.spec_info.draft_token_num)] * len(rows)
    else:
        q_lens = [1] * len(rows) if decode else [int(n) for n in fb.extend_seq_lens_cpu]
    prefix = [0] * len(rows) if decode else [int(n) for n in fb.extend_prefix_lens_cpu]
    # The span a swap covers: one page, and at least SPAN tokens (so that at page size 1 the
    # fault changes what SGLang's own attention answers).
    span = P * -(-SPAN // P)
    start = 0
    for b, row in enumerate(rows):
        rid = _rows.get(row)
        fault = fault_of(rid)
        first, start = start, start + q_lens[b]
        if rid is not None:
            for page in (fb.out_cache_loc[first:start] // P).tolist():
                _writers[page] = _unfaulted(rid)
        if seq_lens[b] >= span and rid is not None:
            written.append((rid, table[row, :span].clone()))
        swap = (fault == "foreign-entry" and decode and seq_lens[b] > span) or (
            fault == "stale-hit" and not decode and prefix[b] >= span
        )
        boundary = (
            fault == "boundary-hit"
            and not decode
            and prefix[b] == span
            and span < seq_lens[b] == _prompts.get(row)
        )
        if boundary:
            n = min(seq_lens[b], 2 * span) - span  # the hit's next tokens this forward reads
            saved = table[row, span : span + n].clone()
            spare = _free_slots(runner.token_to_kv_pool_allocator, n, P, _unfaulted(rid))
            if spare is not None and _once(rid, page_size=P, tokens=n):
                table[row, span : span + n] = spare.to(table.dtype)
                undo.append(
                    lambda row=row, saved=saved, n=n: table[row, span : span + n].copy_(saved)
                )
        elif swap:
            saved = table[row, :span].clone()
            donor = _donor(rid, saved)
            if donor is not None and _once(rid, page_size=P, tokens=span):
                table[row, :span] = donor
                undo.append(lambda row=row, saved=saved: table[row, :span].copy_(saved))
        elif fault == "lost-write" and not decode and q_lens[b] > 0:
            loc = fb.out_cache_loc
            stale = _free_slots(runner.token_to_kv_pool_allocator, q_lens[b], P, _unfaulted(rid))
            if stale is not None and _once(rid, tokens=q_lens[b]):
                _copy_slots(runner.token_to_kv_pool, loc[first:start], stale)
                saved = loc[first:start].clone()
                loc[first:start] = 0  # SGLang's padding slot: no request's page
                undo.append(
                    lambda first=first, end=start, saved=saved: fb.out_cache_loc[first:end].copy_(
                        saved
                    )
                )

    def restore():
        for step in reversed(undo):
            step()
        for rid, slots in written:
            _first_pages.pop(rid, None)
            _first_pages[rid] = slots

    return restore


def _wrap_forward(module) -> None:
    forward = module.ModelRunner.forward

    def forward_hook(self, forward_batch, *args, **kwargs):
        restore = _apply(self, forward_batch)
        try:
            return forward(self, forward_batch, *args, **kwargs)
        finally:
            restore()

    module.ModelRunner.forward = forward_hook


# -- the prefill instance ------------------------------------------------------------------------


def _wrap_prefill(module) -> None:
    add = module.PrefillBootstrapQueue.add

    def add_hook(self, req, *args, **kwargs):
        fault = fault_of(req.rid)
        if fault in PREFILL_FAULTS:
            _rooms[int(req.bootstrap_room)] = req.rid
        if fault == "placeholder" and _once(req.rid, prompt=len(req.origin_input_ids)):
            req.origin_input_ids = type(req.origin_input_ids)("q", list(req.origin_input_ids)[:1])
        return add(self, req, *args, **kwargs)

    module.PrefillBootstrapQueue.add = add_hook


def _wrap_transfer(module) -> None:
    add_transfer_request = module.MooncakeKVManager.add_transfer_request

    def hook(self, bootstrap_room, kv_indices, index_slice, *args, **kwargs):
        rid = _rooms.get(int(bootstrap_room))
        if fault_of(rid) == "short-transfer" and len(kv_indices) > 1:
            _once(rid, pages=len(kv_indices))
            kv_indices = kv_indices[:1]
            index_slice = slice(index_slice.start, index_slice.start + 1)
        return add_transfer_request(self, bootstrap_room, kv_indices, index_slice, *args, **kwargs)

    module.MooncakeKVManager.add_transfer_request = hook


def _wrap_attestation(module) -> None:
    send_frame = module._send_frame
    last: list = [module._Room(None)]

    def hook(manager, room, attested, targets):
        rid = _rooms.get(int(room))
        fault = fault_of(rid)
        if fault == "bad-attestation" and _once(rid):
            attested = dataclasses.replace(attested, pages={"page": attested.pages})
        elif fault == "replayed-attestation" and _once(rid, replayed=len(last[0].pages)):
            attested = last[0]  # its key too: the frame as it was sent
        else:
            last[0] = attested
        return send_frame(manager, room, attested, targets)

    module._send_frame = hook


# -- the decode instance -------------------------------------------------------------------------


def _wrap_commit(module) -> None:
    commit = module.DecodeTransferQueue._commit_transfer_to_req

    def hook(self, decode_req, *args, **kwargs):
        req = decode_req.req
        P = self.scheduler.token_to_kv_pool_allocator.page_size
        row = self.scheduler.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
        # Every transfer's pages, so that a test can show which earlier request's KV they held.
        _log(
            transfer=req.rid,
            pages=sorted({int(s) // P for s in row[: len(req.origin_input_ids)].tolist()}),
        )
        if fault_of(req.rid) == "corrupt-arrival" and _once(req.rid):
            pool = self.scheduler.token_to_kv_pool_allocator.get_kvcache()
            # The first layer's K (an MLA pool's latent rows: one buffer per layer).
            first = pool.k_buffer[0] if hasattr(pool, "k_buffer") else pool.kv_buffer[0]
            first[row[:P].to(torch.int64)] += 1.0
        return commit(self, decode_req, *args, **kwargs)

    module.DecodeTransferQueue._commit_transfer_to_req = hook


def _wrap_load_back(module) -> None:
    init_load_back = module.UnifiedRadixCache.init_load_back

    def hook(self, params, *args, **kwargs):
        controller = getattr(self, "cache_controller", None)
        rid = params.req.rid if params.req is not None else None
        queued = len(controller.load_queue) if controller is not None else 0
        result = init_load_back(self, params, *args, **kwargs)
        if controller is not None and fault_of(rid) == "host-corrupt":
            ops = list(controller.load_queue)[queued:]
            if (
                ops
                and ops[0].host_indices.numel()
                and _once(rid, tokens=int(ops[0].host_indices.numel()))
            ):
                host = controller.mem_pool_host
                host = getattr(getattr(host, "anchor_entry", None), "host_pool", host)
                rows = ops[0].host_indices[: controller.page_size].to(torch.int64)
                # [layers, tokens, heads, head_dim] (an MLA pool's: [layers, tokens, 1, dims]),
                # layer_first
                (host.k_buffer if hasattr(host, "k_buffer") else host.kv_buffer)[:, rows] += 1.0
        return result

    module.UnifiedRadixCache.init_load_back = hook


def _write_counts(module) -> None:
    end_forward = module.SGLangOwnership.end_forward
    path = os.environ[COUNTS]

    def end_forward_hook(self, *args, **kwargs):
        try:
            return end_forward(self, *args, **kwargs)
        finally:
            record = dict(
                self.counts,
                forwards=self.forwards,
                pages_checked=self.pages_checked,
                failures=[name for name, _ in self.failures],
            )
            with open(path + ".tmp", "w") as f:
                json.dump(record, f)
            os.replace(path + ".tmp", path)

    module.SGLangOwnership.end_forward = end_forward_hook


CALLBACKS = {
    "sglang.srt.mem_cache.memory_pool": _track_rows,
    "sglang.srt.mem_cache.radix_cache": _wrap_radix_key,
    "sglang.srt.model_executor.model_runner": _wrap_forward,
    "sglang.srt.disaggregation.prefill": _wrap_prefill,
    "sglang.srt.disaggregation.mooncake.conn": _wrap_transfer,
    "sglang.srt.disaggregation.decode": _wrap_commit,
    "kvattn.integrations.sglang_transfer": _wrap_attestation,
    "sglang.srt.mem_cache.unified_radix_cache": _wrap_load_back,
}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``callbacks[name]`` with the module right after module ``name`` has run (other
    finders of this kind compose: each wraps the loader the next one returned)."""

    def __init__(self, callbacks):
        self.callbacks = callbacks

    def find_spec(self, fullname, path=None, target=None):
        callback = self.callbacks.get(fullname)
        if callback is None:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            callback(module)

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """The injectors (and, with ``KVATTN_CONFORMANCE_COUNTS``, the counts) hooked into SGLang's
    modules as they are imported in this process. Idempotent."""
    if any(isinstance(f, _AfterImport) for f in sys.meta_path):
        return
    callbacks = dict(CALLBACKS)
    if os.environ.get(COUNTS):
        callbacks["kvattn.integrations.sglang"] = _write_counts
    already = sorted(set(callbacks) & set(sys.modules))
    if already:
        raise RuntimeError(f"install the injectors before SGLang is imported; imported: {already}")
    sys.meta_path.insert(0, _AfterImport(callbacks))
