"""MLA latent batches and their definition, for the MLA decode and extend tests: :class:`MLABatch`
(pages drawn from a random permutation of an oversized latent pool, NaN in every slot a reader
must not use), the rows a reader may use and attention over them from the definition
(:func:`readable_latent`, :func:`latent_attention`), and the scenarios both kernels replay: the
incident (:func:`incident`, a freed tenant's :data:`SENTINEL` rows under a new lease) and a shared
prefix (:func:`shared_prefix`).
"""

from __future__ import annotations

import dataclasses
import math

import torch

import kvattn
from kvattn.tags import STATE_WRITTEN
from kvattn_testing.util import DEVICE

SENTINEL = 100.0
# A backend named "extend:NAME" runs the decode as the MLA extend it equals (MLABatch.decode).
EXTEND = "extend:"


@dataclasses.dataclass
class MLABatch:
    """A decode batch over a NaN-poisoned latent pool ``[num_pages, page_size, 1, lora + rope]``."""

    q: torch.Tensor
    kv_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    page_tags: torch.Tensor
    expected: torch.Tensor
    kv_lora_rank: int

    @classmethod
    def random(
        cls,
        *,
        seq_lens,
        num_heads=4,
        lora=32,
        rope=16,
        page_size=4,
        dtype=torch.float16,
        pool_factor=3,
        extra_pages=0,
        seed=0,
    ) -> MLABatch:
        """Sequence ``b`` owns ``ceil(seq_lens[b] / page_size)`` (+ ``extra_pages``) pages of a
        randomly permuted pool ``pool_factor`` times larger than needed, WRITTEN for owner ``b + 1``
        up to its tokens (RESERVED when empty); every other slot holds NaN and every other page is
        FREE."""
        g = torch.Generator().manual_seed(seed)
        seq_lens = [int(s) for s in seq_lens]
        pages_per_seq = [-(-s // page_size) + extra_pages for s in seq_lens]
        max_pages = max(1, max(pages_per_seq))
        num_pages = max(4, pool_factor * sum(pages_per_seq))
        kv = torch.full((num_pages, page_size, 1, lora + rope), float("nan"), dtype=dtype)
        tags = torch.zeros(num_pages, dtype=torch.int64)
        table = torch.zeros(len(seq_lens), max_pages, dtype=torch.int32)
        perm = torch.randperm(num_pages, generator=g).tolist()
        for b, (length, n) in enumerate(zip(seq_lens, pages_per_seq)):
            pages = [perm.pop() for _ in range(n)]
            table[b, :n] = torch.tensor(pages, dtype=torch.int32)
            for i, p in enumerate(pages):
                filled = min(page_size, max(0, length - i * page_size))
                kv[p, :filled] = torch.randn(filled, 1, lora + rope, generator=g).to(dtype)
                tags[p] = (
                    kvattn.written_tag(b + 1, filled) if filled else kvattn.reserved_tag(b + 1)
                )
        q = torch.randn(len(seq_lens), num_heads, lora + rope, generator=g).to(dtype)
        return cls(
            q.to(DEVICE),
            kv.to(DEVICE),
            table.to(DEVICE),
            torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
            tags.to(DEVICE),
            torch.arange(1, len(seq_lens) + 1, dtype=torch.int64, device=DEVICE),
            lora,
        )

    def inputs(self):
        return (
            self.q,
            self.kv_cache,
            self.block_table,
            self.seq_lens,
            self.page_tags,
            self.expected,
        )

    def as_layer_view(self) -> None:
        """The latent pool becomes a per-layer view of a larger buffer (rows two pools apart, NaN
        between them) and ``expected`` is given per block-table entry."""
        n, page, _, dim = self.kv_cache.shape
        layers = torch.full(
            (n, page, 2, dim), float("nan"), dtype=self.kv_cache.dtype, device=DEVICE
        )
        layers[:, :, 1:2] = self.kv_cache
        self.kv_cache = layers[:, :, 1:2]
        self.expected = self.expected[:, None].expand(-1, self.block_table.shape[1]).contiguous()

    def decode(self, backend, **kwargs):
        """The decode on ``backend``; ``"extend:NAME"`` runs it as the MLA extend it equals (one
        query row per sequence) on backend NAME, so the scenarios hold the extend kernel too."""
        if backend.startswith(EXTEND):
            kwargs.pop("num_splits", None)
            cu = torch.arange(self.q.shape[0] + 1, dtype=torch.int32, device=DEVICE)
            return kvattn.paged_mla_extend(
                self.q,
                self.kv_cache,
                cu,
                *self.inputs()[2:],
                kv_lora_rank=self.kv_lora_rank,
                backend=backend[len(EXTEND) :],
                **kwargs,
            )
        return kvattn.paged_mla_decode(
            *self.inputs(), kv_lora_rank=self.kv_lora_rank, backend=backend, **kwargs
        )

    def reference(self, **kwargs):
        return kvattn.reference.paged_mla_decode(
            *self.inputs(), kv_lora_rank=self.kv_lora_rank, compute_dtype=torch.float64, **kwargs
        )


def readable_latent(batch: MLABatch, b: int, check: bool = True) -> list:
    """``[(t, row)]``: the latent rows of sequence ``b`` a reader may use, from the definition:
    token ``t`` lies in slot ``t % P`` of page ``block_table[b, t // P]`` and counts when that page
    is in the pool and (checked) its tag is WRITTEN for the expected owner with the slot below its
    valid_len."""
    kv, table, lens, tags, expected = (t.cpu() for t in batch.inputs()[1:])
    page = kv.shape[1]
    rows = []
    for t in range(int(lens[b])):
        p = int(table[b, t // page])
        if not 0 <= p < kv.shape[0]:
            continue
        owner = int(expected[b] if expected.dim() == 1 else expected[b, t // page])
        tag = int(tags[p])
        if check and (
            kvattn.tag_state(tag) != STATE_WRITTEN
            or kvattn.tag_owner(tag) != owner
            or t % page >= kvattn.tag_valid_len(tag)
        ):
            continue
        rows.append((t, kv[p, t % page, 0].double()))
    return rows


def latent_attention(query: torch.Tensor, keys: list, lora: int, scale: float):
    """``(out [lora], lse)`` of one head's query over latent rows, in float64: logits are the
    query dotted with each whole row, scaled; the output the softmax-weighted sum of the rows'
    first ``lora`` entries. ``(0, -inf)`` over no rows."""
    if not keys:
        return torch.zeros(lora, dtype=torch.float64), float("-inf")
    logits = [scale * float(query.double() @ k) for k in keys]
    top = max(logits)
    weights = [math.exp(x - top) for x in logits]
    total = sum(weights)
    return sum(w * k[:lora] for w, k in zip(weights, keys)) / total, top + math.log(total)


def incident(lora=32, rope=16, page=4, num_pages_b=4, heads=4, dtype=torch.float16):
    """Tenant A's latent rows fill the pool, with a constant value part of 100 that dominates B's
    logits, then the pages are released; B reserves ``num_pages_b`` pages, one token arrives and
    is committed. Returns a batch of B reading all of its pages, and B's one row."""
    g = torch.Generator().manual_seed(42)
    num_pages = 8
    # A positive query: the sentinel rows' constant value part then dominates every head's logits.
    q = torch.randn(1, 1, lora + rope, generator=g).abs().expand(1, heads, -1).to(dtype).to(DEVICE)
    kv = torch.full((num_pages, page, 1, lora + rope), float("nan"), dtype=dtype, device=DEVICE)
    tags = torch.zeros(num_pages, dtype=torch.int64, device=DEVICE)
    pages_a = list(range(num_pages))
    kvattn.reserve_pages(tags, pages_a, 1)
    kv[:, :, 0, :lora] = SENTINEL
    kv[:, :, 0, lora:] = 8 * q[0, 0, lora:]
    kvattn.commit_pages(tags, pages_a, 1, [page] * num_pages, page)
    kvattn.release_pages(tags, pages_a)

    pages_b = torch.randperm(num_pages, generator=g)[:num_pages_b].tolist()
    kvattn.reserve_pages(tags, pages_b, 2)
    row = torch.randn(lora + rope, generator=g).to(dtype).to(DEVICE)
    kv[pages_b[0], 0, 0] = row
    assert kvattn.commit_pages(tags, pages_b[:1], 2, [1], page).dropped_count() == 0
    table = torch.tensor([pages_b], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([num_pages_b * page], dtype=torch.int32, device=DEVICE)
    expected = torch.tensor([2], dtype=torch.int64, device=DEVICE)
    return MLABatch(q.contiguous(), kv, table, lens, tags, expected, lora), row


def shared_prefix(page, dtype=torch.float16):
    """Parent writes 2 pages + 2 tokens under owner 1; the child (owner 2) shares the parent's two
    full pages and wrote 3 tokens of its own; another sequence (owner 3) wrote one page. Latent
    rows arrive by another path and are committed by the tokens received (commit_pages)."""
    g = torch.Generator().manual_seed(5)
    dim = 48
    kv = torch.full((12, page, 1, dim), float("nan"), dtype=dtype, device=DEVICE)
    tags = torch.zeros(12, dtype=torch.int64, device=DEVICE)

    def write(pages, owner, tokens):
        kvattn.reserve_pages(tags, pages, owner)
        for i, p in enumerate(pages):
            n = min(page, tokens - i * page)
            kv[p, :n] = torch.randn(n, 1, dim, generator=g).to(dtype).to(DEVICE)
            assert kvattn.commit_pages(tags, [p], owner, [n], page).dropped_count() == 0

    write([3, 7, 1], 1, 2 * page + 2)
    write([9], 2, 3)
    write([4], 3, page)
    table = torch.tensor([[3, 7, 1], [3, 7, 9], [4, 0, 0]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([2 * page + 2, 2 * page + 3, page], dtype=torch.int32, device=DEVICE)
    per_entry = torch.tensor([[1, 1, 1], [1, 1, 2], [3, 3, 3]], dtype=torch.int64, device=DEVICE)
    q = torch.randn(3, 4, dim, generator=g).to(dtype).to(DEVICE)
    return MLABatch(q, kv, table, lens, tags, per_entry, 32)
