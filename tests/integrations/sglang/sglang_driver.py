"""Scenarios of kvattn's SGLang backend against SGLang 0.5.23's own classes, run in SGLang's
environment (``make sglang-env``: build/venv-sglang) by test_sglang.py, which reads the JSON
this prints.

SGLang's engine does not run on this CPU (its CPU path needs sgl-kernel's CPU build), so an
``Engine`` here plays the scheduler's part with SGLang's real pieces: ``MHATokenToKVPool``,
``ReqToTokenPool``, the token and paged allocators (``alloc``, ``alloc_extend``, ``free``),
``UnifiedRadixCache`` (``insert``, ``match_prefix``, ``evict``), ``Req``, ``ForwardBatch``
filled as ``ForwardBatch.init_new`` fills it for extend, mixed and decode batches,
``RadixAttention`` layers, ``TorchNativeAttnBackend`` and the fake disaggregation receiver.
Each layer's q, k, v are a fixed function of the request's tokens and positions, so two engines
(one on SGLang's torch-native attention, one on kvattn's)
given the same steps compute the same attention unless a check refuses a page.
"""

from __future__ import annotations

import enum
import json
import sys
import types
from array import array
from types import SimpleNamespace


def _stand_in_torchvision() -> None:
    """``sglang.srt.configs`` imports ``torchvision.transforms`` for image models; the index's
    torchvision is a CUDA build that fails to load beside CPU torch, and no test reads images.
    transformers is imported first so that it sees no torchvision."""
    import transformers.utils.import_utils  # noqa: F401

    tv, tr, fn = (
        types.ModuleType(n)
        for n in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional")
    )
    tv.__path__, tr.__path__ = [], []

    class InterpolationMode(enum.Enum):
        NEAREST = "nearest"
        BILINEAR = "bilinear"
        BICUBIC = "bicubic"

    fn.InterpolationMode = tr.InterpolationMode = InterpolationMode
    tv.transforms, tr.functional = tr, fn
    sys.modules.update({m.__name__: m for m in (tv, tr, fn)})


_stand_in_torchvision()

import torch
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.fake.conn import FakeKVReceiver
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.managers.schedule_batch import FINISH_ABORT, Req
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    InsertParams,
    MatchPrefixParams,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import (
    MHATokenToKVPool,
    MLATokenToKVPool,
    ReqToTokenPool,
)
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.model_executor.forward_context import (
    ForwardContext,
    set_forward_context,
)
from sglang.srt.runtime_context import get_parallel
from sglang.srt.sampling.sampling_params import SamplingParams

from kvattn.integrations import sglang as integration
from kvattn.integrations import sglang_backend

DTYPE = torch.float32
LAYERS = 2
# A DeepSeek-style latent row, small: kv_lora_rank 32, then a 16-dim RoPE key.
LATENT = (32, 16)


class Engine:
    """One engine's pools, allocator, requests and layers, on ``kind`` attention."""

    def __init__(
        self,
        kind: str,
        page_size: int,
        heads: int = 4,
        kv_heads: int = 2,
        head_dim: int = 16,
        size: int = 512,
        radix: bool = True,
        overlap: bool = False,
        kv_dtype: torch.dtype = DTYPE,
        latent: tuple[int, int] | None = None,
    ):
        """``latent``: ``(kv_lora_rank, rope)`` for SGLang's MLA pool and DeepSeek-style layers
        (every query head reads one latent row per token, its first ``kv_lora_rank`` dims the
        value) instead of the MHA pool."""
        self.P = page_size
        # Overlap scheduling: a decode forward runs before the previous step's result is
        # processed, so the token it feeds is not yet in the request's output_ids.
        self.overlap = overlap
        self.v_dim = head_dim
        # Layer 1 of a kvattn MLA engine gets its rows as latent and RoPE parts (split_rope).
        self.split_rope = False
        if latent is not None:
            # A single-rank engine: no decode context parallelism (the pool's write asks).
            get_parallel().override_permanently(dcp_enabled=False)
            kv_heads, head_dim, self.v_dim = 1, sum(latent), latent[0]
            self.pool = MLATokenToKVPool(
                size=size,
                page_size=page_size,
                dtype=kv_dtype,
                kv_lora_rank=latent[0],
                qk_rope_head_dim=latent[1],
                layer_num=LAYERS,
                device="cpu",
                enable_memory_saver=False,
            )
        else:
            self.pool = MHATokenToKVPool(
                size=size,
                page_size=page_size,
                dtype=kv_dtype,
                head_num=kv_heads,
                head_dim=head_dim,
                layer_num=LAYERS,
                device="cpu",
                enable_memory_saver=False,
            )
        self.req_pool = ReqToTokenPool(
            size=16, max_context_len=256, device="cpu", enable_memory_saver=False
        )
        if page_size == 1:
            self.allocator = TokenToKVPoolAllocator(
                size, kv_dtype, "cpu", self.pool, need_sort=False
            )
        else:
            self.allocator = PagedTokenToKVPoolAllocator(
                size, page_size, kv_dtype, "cpu", self.pool, need_sort=False
            )
        self.layers = [
            RadixAttention(
                num_heads=heads,
                head_dim=head_dim,
                scaling=head_dim**-0.5,
                num_kv_heads=kv_heads,
                layer_id=i,
                v_head_dim=self.v_dim,
            )
            for i in range(LAYERS)
        ]
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.runner = SimpleNamespace(
            device="cpu",
            req_to_token_pool=self.req_pool,
            token_to_kv_pool=self.pool,
            token_to_kv_pool_allocator=self.allocator,
            page_size=page_size,
            server_args=SimpleNamespace(
                speculative_algorithm=None,
                disaggregation_mode="null",
                disaggregation_transfer_backend="fake",
                disable_radix_cache=not radix,
                disable_cuda_graph=True,
                enable_dp_attention=False,
            ),
            model_config=SimpleNamespace(is_encoder_decoder=False),
            forward=self._model,
        )
        if kind == "kvattn":
            self.backend = sglang_backend.create_backend(self.runner)
            self.state = integration.state_for(self.req_pool)
        else:
            self.backend = TorchNativeAttnBackend(self.runner)
            self.state = None
        # SGLang's default prefix cache (registry.default_radix_cache_factory), full KV only.
        params = CacheInitParams(
            disable=not radix,
            req_to_token_pool=self.req_pool,
            token_to_kv_pool_allocator=self.allocator,
            page_size=page_size,
        )
        params.tree_components = (ComponentType.FULL,)
        self.tree = UnifiedRadixCache(params)
        self.reqs: dict[str, Req] = {}
        self.lens: dict[str, int] = {}  # tokens in the cache per request
        self.fed: dict[str, list[int]] = {}  # token ids fed to forwards (prompt, then decodes)
        self.inserted: dict[str, int] = {}  # tokens each request put in the radix tree
        self.salt_in_key = True
        self.outputs: list[dict[str, list]] = []  # per forward: rid -> last layer's output rows

    # -- the scheduler's part ---------------------------------------------------------------

    def admit(
        self,
        rid: str,
        tokens: list[int],
        prefix_slots: list[int] | None = None,
        cache_salt: str | None = None,
    ) -> Req:
        """A new request holding a row; ``prefix_slots``: the slots a radix-cache match gave it
        for its first tokens (what ``match_prefix`` returns as ``prefix_indices``)."""
        req = Req(rid, "", list(tokens), SamplingParams(max_new_tokens=16), cache_salt=cache_salt)
        self.req_pool.alloc([req])
        prefix = list(prefix_slots or [])
        if prefix:
            self.req_pool.write(
                (req.kv.req_pool_idx, slice(0, len(prefix))),
                torch.tensor(prefix, dtype=torch.int32),
            )
        req.prefix_indices = torch.tensor(prefix, dtype=torch.int64)
        self.reqs[rid], self.lens[rid], self.fed[rid] = req, len(prefix), list(tokens)
        return req

    def cache(self, rid: str) -> int:
        """Insert the request's computed tokens into the radix tree (page-aligned), with their
        slots, as ``cache_unfinished_req`` / ``cache_finished_req`` do; returns how many the tree
        holds."""
        tokens = self._tokens(rid)[: self.lens[rid]]
        done = self.inserted.get(rid, 0)  # what it inserted before: not a duplicate to free
        self.tree.insert(
            InsertParams(
                key=RadixKey(array("q", tokens), cache_salt=self._salt(self.reqs[rid].cache_salt)),
                value=torch.tensor(self.slots(rid), dtype=torch.int64),
                prev_prefix_len=done,
                inserted_len=done,
            )
        )
        self.inserted[rid] = len(tokens) // self.P * self.P
        return self.inserted[rid]

    def match(self, tokens: list[int], cache_salt: str | None = None) -> list[int]:
        """The slots of the longest cached prefix of ``tokens`` under ``cache_salt``
        (``match_prefix``)."""
        key = RadixKey(array("q", tokens), cache_salt=self._salt(cache_salt))
        m = self.tree.match_prefix(MatchPrefixParams(key=key))
        path = self.tree.tree_core.collect_full_device_indices(
            m.last_device_node, self.tree.root_node_handle(None)
        )
        return path[: m.device_prefix_len].tolist()

    def _salt(self, salt: str | None) -> str | None:
        # A fault may leave the salt out of every key of the tree (the class of SGLang #37160).
        return salt if self.salt_in_key else None

    def slots(self, rid: str) -> list[int]:
        req = self.reqs[rid]
        return self.req_pool.req_to_token[req.kv.req_pool_idx, : self.lens[rid]].tolist()

    def _alloc(self, rids, news) -> torch.Tensor:
        rows = [self.reqs[r].kv.req_pool_idx for r in rids]
        prefix = [self.lens[r] for r in rids]
        seq = [p + n for p, n in zip(prefix, news)]
        if self.P == 1:
            out = self.allocator.alloc(sum(news))
        else:
            last = torch.tensor(
                [
                    int(self.req_pool.req_to_token[row, p - 1]) if p else -1
                    for row, p in zip(rows, prefix)
                ],
                dtype=torch.int64,
            )
            pl, sl = torch.tensor(prefix, dtype=torch.int64), torch.tensor(seq, dtype=torch.int64)
            out = self.allocator.alloc_extend(pl, pl, sl, sl, last, sum(news))
        start = 0
        for row, p, n in zip(rows, prefix, news):
            self.req_pool.write((row, slice(p, p + n)), out[start : start + n].to(torch.int32))
            start += n
        return out

    def step(self, work: dict[str, int]) -> dict[str, list]:
        """One forward: request -> new tokens this step (1 after its prompt: a decode). All rows
        with one token and nothing else is a decode batch; else an extend (mixed if some decode)."""
        rids, news = list(work), list(work.values())
        decode = all(
            n == 1 and self.lens[r] >= len(self.reqs[r].origin_input_ids) for r, n in work.items()
        )
        sampled = {}
        for r, n in work.items():  # a decode feeds the token sampled last
            while self.lens[r] + n > len(self.fed[r]):
                self.fed[r].append(100 + len(self.fed[r]))
                sampled.setdefault(r, []).append(self.fed[r][-1])
        if not self.overlap:
            for r, ids in sampled.items():
                self.reqs[r].output_ids.extend(ids)
        out = self._alloc(rids, news)
        prefix = [self.lens[r] for r in rids]
        seq = [p + n for p, n in zip(prefix, news)]
        ids = [t for r, p, s in zip(rids, prefix, seq) for t in self._tokens(r)[p:s]]
        positions = [i for p, s in zip(prefix, seq) for i in range(p, s)]
        mode = (
            ForwardMode.DECODE
            if decode
            else (ForwardMode.MIXED if any(n == 1 for n in news) else ForwardMode.EXTEND)
        )
        fb = ForwardBatch(
            forward_mode=mode,
            batch_size=len(rids),
            input_ids=torch.tensor(ids),
            req_pool_indices=torch.tensor([self.reqs[r].kv.req_pool_idx for r in rids]),
            seq_lens=torch.tensor(seq, dtype=torch.int32),
            out_cache_loc=out,
            seq_lens_sum=sum(seq),
            seq_lens_cpu=torch.tensor(seq, dtype=torch.int32),
            positions=torch.tensor(positions),
        )
        if not decode:
            fb.extend_seq_lens = torch.tensor(news, dtype=torch.int32)
            fb.extend_prefix_lens = torch.tensor(prefix, dtype=torch.int32)
            fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu = news, prefix
            fb.extend_num_tokens = sum(news)
            fb.extend_start_loc = torch.cumsum(torch.tensor([0] + news[:-1]), 0)
        fb.kvattn_rids = rids
        result = self.runner.forward(fb)
        for r, s in zip(rids, seq):
            self.lens[r] = s
        if self.overlap:  # the previous step's result is processed now
            for r, ids in sampled.items():
                self.reqs[r].output_ids.extend(ids)
        self.outputs.append(result)
        return result

    def _tokens(self, rid: str) -> list[int]:
        return self.fed[rid]

    def _qkv(self, fb, layer: int):
        """Each token's q, k, v: a fixed function of (token id, position, layer)."""
        out = []
        for heads in (self.heads, self.kv_heads, self.kv_heads):
            vals = [
                torch.randn(
                    heads * self.head_dim,
                    generator=torch.Generator().manual_seed(
                        (int(t) * 7919 + int(p) * 104729 + layer * 15485863 + heads) % (2**31)
                    ),
                )
                for t, p in zip(fb.input_ids.tolist(), fb.positions.tolist())
            ]
            out.append(torch.stack(vals).to(DTYPE))
        q, k, v = out
        k = k.view(-1, self.kv_heads, self.head_dim)
        v = v.view(-1, self.kv_heads, self.head_dim)[..., : self.v_dim]
        if self.v_dim != self.head_dim:  # MLA: the value is the key's latent part
            v = k[..., : self.v_dim]
        return q, k, v

    def _buffers(self, layer: int) -> list[torch.Tensor]:
        if isinstance(self.pool, MLATokenToKVPool):
            return [self.pool.kv_buffer[layer]]
        return [self.pool.k_buffer[layer], self.pool.v_buffer[layer]]

    def poison(self, slots: list[int]) -> None:
        """NaN in every layer's K and V at ``slots``: bytes that must never be read (in an fp8
        pool's uint8 bytes, 0x7F: NaN in e4m3fn and e5m2 alike)."""
        nan = 0x7F if self.pool.store_dtype == torch.uint8 else float("nan")
        for layer in self.layers:
            for buffer in self._buffers(layer.layer_id):
                buffer[slots] = nan

    def _transfer(self, req, slots: torch.Tensor) -> None:
        """What a transport does: the prompt's K/V bytes (its first ``len(slots)`` tokens) written
        into ``slots`` of every layer's buffers directly (no ``set_kv_buffer``), as the prefill side
        computed them."""
        n = len(slots)
        fb = SimpleNamespace(
            input_ids=torch.tensor(list(req.origin_input_ids)[:n]), positions=torch.arange(n)
        )
        for layer in self.layers:
            _, k, v = self._qkv(fb, layer.layer_id)
            for buffer, x in zip(self._buffers(layer.layer_id), (k, v)):
                buffer[slots] = x

    def _model(self, fb):
        self.backend.init_forward_metadata(fb)
        o = None
        for layer in self.layers:
            q, k, v = self._qkv(fb, layer.layer_id)
            parts = {}
            if self.split_rope and layer.layer_id == 1:
                # How the backends SGLang lists for its absorbed MLA path get the rows: the
                # latent and RoPE parts apart (the layer's query and key, the same numbers).
                lora = self.v_dim
                q = q.view(q.shape[0], self.heads, -1)
                parts = dict(q_rope=q[..., lora:].reshape(q.shape[0], -1), k_rope=k[..., lora:])
                q, k = q[..., :lora].reshape(q.shape[0], -1), k[..., :lora]
            o = self.backend.forward(q, k, v, layer, fb, **parts)
        starts = [0]
        n = [1] * fb.batch_size if fb.forward_mode.is_decode() else fb.extend_seq_lens_cpu
        for x in n:
            starts.append(starts[-1] + x)
        return {r: o[a:b].tolist() for r, a, b in zip(fb.kvattn_rids, starts, starts[1:])}

    def finish(self, rid: str, kept: int = 0) -> None:
        """The request ends: the radix tree keeps its first ``kept`` slots, the allocator frees
        the rest, the row is freed."""
        slots = self.slots(rid)
        self.allocator.free(torch.tensor(slots[kept:], dtype=torch.int64))
        self.req_pool.free(self.reqs[rid])

    def aborted(self, rid: str) -> str | None:
        """The abort message SGLang's own finish logic gives the request (None: not aborted)."""
        req = self.reqs[rid]
        if req.discard_output_reason is not None and req.finished_reason is None:
            # What the scheduler's result processing does with it (the forward's output dropped).
            req.to_finish = req.discard_output_reason
            req.update_finish_state(0)
        reason = req.finished_reason
        return reason.message if isinstance(reason, FINISH_ABORT) else None

    def status(self, rid: str):
        reason = self.reqs[rid].finished_reason
        return None if reason is None else reason.to_json()


def _diff(a: dict, b: dict) -> float:
    return max((torch.tensor(a[r]) - torch.tensor(b[r])).abs().max().item() for r in a)


def equality(
    page_size: int,
    overlap: bool = False,
    kv_dtype: torch.dtype = DTYPE,
    latent=None,
    split_rope: bool = False,
) -> dict:
    """Extend with a radix-cache prefix, chunked prefill, mixed and decode batches, GQA, then a
    second turn whose prompt is the first request's prompt and decoded tokens (a radix hit on
    pages filled by decodes), on both attentions: the largest output gap per forward, and what
    kvattn refused. With an fp8 ``kv_dtype``, also how many of the KV bytes of every request's
    slots differ between the two pools (SGLang's own write against kvattn's)."""
    P = page_size
    runs = {}
    for kind in ("torch_native", "kvattn"):
        e = Engine(kind, P, overlap=overlap, kv_dtype=kv_dtype, latent=latent)
        e.split_rope = split_rope and kind == "kvattn"
        a = list(range(1, 2 * max(P, 8) + 6))
        e.admit("a", a)
        e.step({"a": len(a) - 5})  # a chunk of the prompt
        e.step({"a": 5})  # the rest
        e.step({"a": 1})
        e.cache("a")  # the running request's tokens in the tree
        b = a[:-5] + [77, 78, 79]
        hit = e.match(b)
        e.admit("b", b, prefix_slots=hit)
        e.admit("c", [9, 8, 7, 6, 5])
        e.step({"b": len(b) - len(hit), "c": 5, "a": 1})  # mixed: two extends and a decode
        for _ in range(P + 2):  # decodes across a page boundary
            e.step({"a": 1, "b": 1, "c": 1})
        e.cache("a")
        turn = e._tokens("a")[: e.lens["a"]] + [61, 62]
        turn_hit = e.match(turn)
        e.admit("t", turn, prefix_slots=turn_hit)
        e.step({"t": len(turn) - len(turn_hit), "a": 1})
        runs[kind] = e
    stock, mine = runs["torch_native"], runs["kvattn"]
    gaps = [_diff(s, m) for s, m in zip(stock.outputs, mine.outputs)]
    codes = [0, 0]  # bytes compared, bytes that differ
    if kv_dtype != DTYPE:
        for rid in mine.reqs:
            theirs, ours = stock.slots(rid), mine.slots(rid)
            for buffers in ("k_buffer", "v_buffer"):
                for a, b in zip(getattr(stock.pool, buffers), getattr(mine.pool, buffers)):
                    codes[0] += a[theirs].numel()
                    codes[1] += int((a[theirs] != b[ours]).sum())
    return dict(
        gaps=gaps,
        counts=dict(mine.state.counts),
        hit=len(hit),
        turn_hit=len(turn_hit),
        aborted={r: mine.aborted(r) for r in mine.reqs},
        codes_compared=codes[0],
        codes_different=codes[1],
    )


def _commit_transfer_to_req(queue, decode_req) -> None:
    """What SGLang's ``DecodeTransferQueue._commit_transfer_to_req`` does to the request that the
    hook around it must survive: it drops the receiver (decode.py, SGLang 0.5.23)."""
    decode_req.kv_receiver = None


def incident(page_size: int, received: int | None, latent=None) -> dict:
    """The incident through SGLang's classes: tenant A's KV sits in pages that are freed and
    preallocated for request B on a decode instance; B's KV never arrives (the fake receiver:
    ``received`` None; or a receiver accounting ``received`` tokens), the receiver reports success,
    B decodes beside a clean request C. ``received="all"``: the clean twin, B's KV arrived."""
    P = page_size
    out = {}
    for kind in ("torch_native", "kvattn"):
        e = Engine(kind, P, latent=latent)
        secret = list(range(500, 500 + 3 * P + 2))
        e.admit("A", secret)
        e.step({"A": len(secret)})
        a_slots = e.slots("A")
        e.finish("A")
        if kind == "kvattn":  # A's bytes stay in the freed pages; under kvattn, as NaN
            e.poison(a_slots)
        e.admit("C", [3, 1, 4, 1, 5])
        e.step({"C": 5})
        prompt = list(range(40, 40 + 3 * P + 2))
        b = e.admit("B", prompt)
        pre = e._alloc(["B"], [len(prompt)])  # the decode side's preallocation
        e.lens["B"] = len(prompt)
        count = len(prompt) if received == "all" else received
        if count:  # a transport that wrote that much of B's KV into its pages, and counted it
            e._transfer(b, pre[:count])
        if count is None:
            receiver = FakeKVReceiver(mgr=None, bootstrap_addr="fake")
            receiver.init(0)
            receiver.send_metadata(pre.tolist())
        else:
            receiver = SimpleNamespace(kvattn_received_tokens=lambda: count)
        success = count is not None or receiver.poll() == KVPoll.Success
        if kind == "kvattn":  # the hook around DecodeTransferQueue._commit_transfer_to_req
            queue = SimpleNamespace(scheduler=SimpleNamespace(req_to_token_pool=e.req_pool))
            integration.commit_transfer_hook(
                _commit_transfer_to_req, queue, SimpleNamespace(req=b, kv_receiver=receiver)
            )
        b.output_ids.append(7)  # the first token, from the prefill side's metadata
        result = e.step({"B": 1, "C": 1})
        b_pages = {s // P for s in e.slots("B")[: len(prompt)]}
        reused = sorted(b_pages & {s // P for s in a_slots})
        out[kind] = dict(
            result=result,
            aborted={r: e.aborted(r) for r in ("B", "C")},
            finish=e.status("B"),
            receiver_success=success,
            reused_pages=reused,
            counts=dict(e.state.counts) if e.state else {},
        )
        if kind == "torch_native":
            # What B's output would be over A's KV at those slots and B's one token: proof that
            # the stock read is A's data.
            out["a_slots"] = a_slots
    stock, mine = out["torch_native"], out["kvattn"]
    out["c_gap"] = _diff({"C": stock["result"]["C"]}, {"C": mine["result"]["C"]})
    out["b_gap"] = _diff({"B": stock["result"]["B"]}, {"B": mine["result"]["B"]})
    out["b_kvattn_norm"] = torch.tensor(mine["result"]["B"]).abs().max().item()
    out["b_kvattn_finite"] = bool(torch.tensor(mine["result"]["B"]).isfinite().all())
    return out


def stale_prefix(page_size: int, fault: bool, kv_dtype: torch.dtype = DTYPE, latent=None) -> dict:
    """A radix-cache hit through SGLang's radix tree: W's prompt pages stay in the tree after W
    ends, R's prompt starts with the same tokens and matches them. With ``fault``, the match is
    not locked, the tree evicts the pages before R runs (at page size 16 X reuses and rewrites
    them), and R reads the slots it matched."""
    P = page_size
    out = {}
    for kind in ("torch_native", "kvattn"):
        e = Engine(kind, P, kv_dtype=kv_dtype, latent=latent)
        shared = list(range(10, 10 + 2 * P))
        e.admit("W", shared + [1, 2, 3])
        e.step({"W": len(shared) + 3})
        w_slots = e.slots("W")[: 2 * P]
        e.finish("W", kept=e.cache("W"))
        hit = e.match(shared + [4, 5])
        if fault:  # the match was not locked (inc_lock_ref): the tree evicts what it holds
            e.tree.evict(EvictParams(num_tokens=10**6))
            if kind == "kvattn":  # what X does not overwrite must not be read either
                e.poison(w_slots)
            e.admit("X", list(range(900, 900 + 2 * P)))
            e.step({"X": 2 * P})
        e.admit("R", shared + [4, 5], prefix_slots=hit)
        e.admit("D", [8, 8, 8])
        result = e.step({"R": 2, "D": 3})
        out[kind] = dict(
            result=result,
            aborted={r: e.aborted(r) for r in ("R", "D")},
            counts=dict(e.state.counts) if e.state else {},
            hit=len(hit),
            hit_is_w=hit == w_slots,
            x_reused=fault and bool(set(e.slots("X")) & set(w_slots)),
        )
    out["r_kvattn_finite"] = bool(torch.tensor(out["kvattn"]["result"]["R"]).isfinite().all())
    out["r_gap"] = _diff(
        {"R": out["torch_native"]["result"]["R"]}, {"R": out["kvattn"]["result"]["R"]}
    )
    out["d_gap"] = _diff(
        {"D": out["torch_native"]["result"]["D"]}, {"D": out["kvattn"]["result"]["D"]}
    )
    return out


def domains(page_size: int, fault: bool) -> dict:
    """Radix-cache hits across cache salts: W computes a prompt under salt ``tenant-1`` and the
    tree keeps its pages; R sends the same prompt under ``tenant-2``, which SGLang's tree keys
    apart, so R matches nothing and computes its own; R2 (``tenant-1`` again) hits W's pages; D
    shares nothing. With ``fault``, the tree's keys leave the salt out (the class of SGLang
    #37160), so R hits W's pages."""
    P = page_size
    out = {}
    prompt = list(range(10, 10 + 2 * P)) + [4, 5]
    for kind in ("torch_native", "kvattn"):
        e = Engine(kind, P)
        e.salt_in_key = not fault
        e.admit("W", prompt, cache_salt="tenant-1")
        e.step({"W": len(prompt)})
        e.finish("W", kept=e.cache("W"))
        hits = {
            "R": e.match(prompt, cache_salt="tenant-2"),
            "R2": e.match(prompt, cache_salt="tenant-1"),
        }
        e.admit("R", prompt, prefix_slots=hits["R"], cache_salt="tenant-2")
        e.admit("R2", prompt, prefix_slots=hits["R2"], cache_salt="tenant-1")
        e.admit("D", [8, 8, 8])
        result = e.step({"R": len(prompt) - len(hits["R"]), "R2": 2, "D": 3})
        out[kind] = dict(
            result=result,
            aborted={r: e.aborted(r) for r in ("R", "R2", "D")},
            counts=dict(e.state.counts) if e.state else {},
            hits={r: len(h) for r, h in hits.items()},
        )
    for rid in ("R", "R2", "D"):
        out[f"{rid}_gap"] = _diff(
            {rid: out["torch_native"]["result"][rid]}, {rid: out["kvattn"]["result"][rid]}
        )
    return out


def session(page_size: int, fault: bool) -> dict:
    """A streaming session: the next turn is a new Req on the same row (``try_match_prefix`` sets
    ``req.kv = slot.kv``, and ``ReqToTokenPool.alloc`` sees a row it holds). With ``fault`` the
    first page of the row is freed under it and taken and written by X before the turn runs."""
    P = page_size
    out = {}
    for kind in ("torch_native", "kvattn"):
        e = Engine(kind, P)
        first = list(range(20, 20 + P + 3))
        e.admit("s1", first)
        e.step({"s1": len(first)})
        e.step({"s1": 1})
        history = e._tokens("s1")[: e.lens["s1"]]
        turn = history + [71, 72, 73]
        nxt = Req("s2", "", list(turn), SamplingParams(max_new_tokens=16))
        nxt.kv = e.reqs["s1"].kv
        nxt.kv.kv_allocated_len = e.lens["s1"]  # the scheduler's account of the row's KV
        e.req_pool.alloc([nxt])
        e.reqs["s2"], e.lens["s2"], e.fed["s2"] = nxt, e.lens["s1"], list(turn)
        if fault:
            e.allocator.free(torch.tensor(e.slots("s1")[:P], dtype=torch.int64))
            e.admit("X", list(range(900, 900 + P)))
            e.step({"X": P})
        result = e.step({"s2": 3})
        out[kind] = dict(
            result=result,
            aborted={r: e.aborted(r) for r in ("s1", "s2")},
            counts=dict(e.state.counts) if e.state else {},
        )
    out["gap"] = _diff(
        {"s2": out["torch_native"]["result"]["s2"]}, {"s2": out["kvattn"]["result"]["s2"]}
    )
    return out


def plugin() -> dict:
    """The entry point through SGLang's own plugin loader, and the CLI choice it adds."""
    import argparse

    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs

    before = "kvattn" in ATTENTION_BACKENDS
    load_plugins()
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--model-path", "m", "--attention-backend", "kvattn"])
    from importlib.metadata import entry_points

    eps = [f"{ep.name}={ep.value}" for ep in entry_points(group="sglang.srt.plugins")]
    from sglang.srt.beam_search.coordinator import BeamCoordinator
    from sglang.srt.disaggregation.decode import DecodeTransferQueue
    from sglang.srt.models import utils as model_utils

    hooked = [
        hasattr(f, "__wrapped__")
        for f in (
            DecodeTransferQueue._commit_transfer_to_req,
            BeamCoordinator.validate_and_init,
            model_utils.enable_fused_set_kv_buffer,
        )
    ]
    from sglang.srt.models import qwen3_moe  # a model that writes K/V from its rotary kernel

    late = qwen3_moe.enable_fused_set_kv_buffer is model_utils.enable_fused_set_kv_buffer
    return dict(
        before=before,
        after="kvattn" in ATTENTION_BACKENDS,
        hooked=hooked,
        late_import_hooked=late,
        factory=ATTENTION_BACKENDS.get("kvattn").__qualname__,
        parsed=args.attention_backend,
        entry_points=eps,
    )


def setup_refusal(runner) -> str | None:
    """What kvattn's setup says of an engine: None where it runs, else the refusal's message."""
    try:
        integration._refuse_unsupported(runner)
        return None
    except integration.IntegrationError as e:
        return str(e)


def pool_refusals() -> dict:
    """What kvattn's setup says of an engine whose pool is SGLang's MHA pool of each KV dtype:
    None where it runs, else the refusal's message."""
    out = {}
    for name, dtype in (
        ("float32", torch.float32),
        ("float8_e4m3fn", torch.float8_e4m3fn),
        ("float8_e5m2", torch.float8_e5m2),
        ("int8", torch.int8),
    ):
        runner = Engine("torch_native", 16, kv_dtype=dtype).runner
        out[name] = setup_refusal(runner)
    return out


def mla_refusals() -> dict:
    """What kvattn's setup says of an engine on SGLang's MLA pool, per KV dtype and per setting
    the MLA path does not cover: None where it runs, else the refusal's message."""
    out = {}
    for name, dtype, args in (
        ("float32", torch.float32, {}),
        ("bfloat16", torch.bfloat16, {}),
        ("float8_e4m3fn", torch.float8_e4m3fn, {}),
        ("decode", torch.float32, dict(disaggregation_mode="decode")),
        ("hicache", torch.float32, dict(enable_hierarchical_cache=True)),
        (
            "ngram",
            torch.float32,
            dict(speculative_algorithm="NGRAM", disable_overlap_schedule=True),
        ),
    ):
        runner = Engine("torch_native", 16, kv_dtype=dtype, latent=LATENT).runner
        vars(runner.server_args).update(args)
        out[name] = setup_refusal(runner)
    return out


def moves(fault: bool) -> dict:
    """The rows speculative decoding moves after a verify forward (the pool's ``move_kv_cache``,
    past ``set_kv_buffer``): A and B prefill, then one of A's rows moves onto another of its own
    slots; with ``fault``, a row of B's also moves into A's pages. Then both decode."""
    e = Engine("kvattn", 16)
    e.pool.use_native_move_kv_cache = True
    e.admit("A", list(range(1, 21)))
    e.admit("B", list(range(40, 60)))
    e.step({"A": 20, "B": 20})
    a, b = e.slots("A"), e.slots("B")
    tgt, src = [a[18]], [a[19]]
    if fault:
        tgt.append(a[17])
        src.append(b[5])
    before = e.pool.k_buffer[0][a[17]].clone()
    e.pool.move_kv_cache(torch.tensor(tgt), torch.tensor(src))
    out = dict(
        own_row_moved=bool(torch.equal(e.pool.k_buffer[0][a[18]], e.pool.k_buffer[0][a[19]])),
        foreign_row_kept_out=bool(torch.equal(e.pool.k_buffer[0][a[17]], before)),
    )
    e.step({"A": 1, "B": 1})
    out.update(aborted={r: e.aborted(r) for r in ("A", "B")}, counts=dict(e.state.counts))
    return out


def config_refusals() -> dict:
    """What kvattn's setup says of an engine with each configuration it does not run: SGLang's
    hybrid sliding-window pool, EAGLE speculative decoding (n-gram's runs: None), DP attention."""
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    out = {}
    for name in ("swa-pool", "eagle", "ngram", "ngram-overlap", "ngram-decode", "dp-attention"):
        runner = Engine("torch_native", 16).runner
        if name == "swa-pool":
            runner.token_to_kv_pool = SWAKVPool(
                size=256,
                size_swa=128,
                page_size=16,
                dtype=DTYPE,
                head_num=2,
                head_dim=16,
                swa_attention_layer_ids=[0],
                full_attention_layer_ids=[1],
                device="cpu",
            )
        elif name.startswith(("eagle", "ngram")):
            runner.server_args.speculative_algorithm = name.split("-")[0].upper()
            # SGLang turns overlap scheduling off for speculative decoding on a CPU.
            runner.server_args.disable_overlap_schedule = name != "ngram-overlap"
            if name == "ngram-decode":
                runner.server_args.disaggregation_mode = "decode"
        else:
            runner.server_args.enable_dp_attention = True
        out[name] = setup_refusal(runner)
    return out


def guards() -> dict:
    """kvattn's hooks on one engine of each kind: around ``enable_fused_set_kv_buffer`` under
    SGLang's forward context (off for a kvattn engine's pool whatever the platform would choose),
    around ``BeamCoordinator.validate_and_init`` (a refusal for a kvattn engine)."""
    out = {}
    for kind in ("torch_native", "kvattn"):
        e = Engine(kind, 16)
        set_forward_context(ForwardContext(attn_backend=e.backend))
        fused = integration.fused_write_hook(lambda fb: True, None)
        set_forward_context(None)
        coordinator = SimpleNamespace(tree_cache=e.tree)
        beam = integration.beam_hook(lambda c, r: None, coordinator, None)
        out[kind] = dict(fused=fused, beam=beam)
    return out


SCENARIOS = {
    "equality-1": lambda: equality(1),
    "equality-16": lambda: equality(16),
    "overlap-1": lambda: equality(1, overlap=True),
    "overlap-16": lambda: equality(16, overlap=True),
    "fp8-e4m3-16": lambda: equality(16, kv_dtype=torch.float8_e4m3fn),
    "fp8-e4m3-1": lambda: equality(1, kv_dtype=torch.float8_e4m3fn),
    "fp8-e5m2-16": lambda: equality(16, kv_dtype=torch.float8_e5m2),
    "guards": guards,
    "pool-refusals": pool_refusals,
    "session-clean-16": lambda: session(16, False),
    "session-fault-16": lambda: session(16, True),
    "incident-16": lambda: incident(16, None),
    "incident-1": lambda: incident(1, None),
    "placeholder-16": lambda: incident(16, 1),
    "transfer-16": lambda: incident(16, "all"),
    "prefix-clean-16": lambda: stale_prefix(16, False),
    "prefix-stale-16": lambda: stale_prefix(16, True),
    "prefix-stale-1": lambda: stale_prefix(1, True),
    "prefix-stale-fp8-16": lambda: stale_prefix(16, True, kv_dtype=torch.float8_e4m3fn),
    "domains-clean-16": lambda: domains(16, False),
    "domains-fault-16": lambda: domains(16, True),
    "plugin": plugin,
    "mla-equality-16": lambda: equality(16, latent=LATENT),
    "mla-split-16": lambda: equality(16, latent=LATENT, split_rope=True),
    "mla-overlap-1": lambda: equality(1, overlap=True, latent=LATENT),
    "mla-incident-16": lambda: incident(16, None, latent=LATENT),
    "mla-transfer-16": lambda: incident(16, "all", latent=LATENT),
    "mla-prefix-clean-16": lambda: stale_prefix(16, False, latent=LATENT),
    "mla-prefix-stale-16": lambda: stale_prefix(16, True, latent=LATENT),
    "mla-refusals": mla_refusals,
    "config-refusals": config_refusals,
    "moves-clean": lambda: moves(False),
    "moves-fault": lambda: moves(True),
}

if __name__ == "__main__":
    names = sys.argv[1:] or list(SCENARIOS)
    print(json.dumps({n: SCENARIOS[n]() for n in names}))
