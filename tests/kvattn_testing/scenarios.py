"""The reader scenarios of docs/ownership.md section 6 as batches, for the scenario tests of every
reader: page geometries (:class:`Geometry`, :data:`DEFAULT`), the incident replay (a freed
tenant's sentinel K/V under a new lease: :func:`incident`), a shared prefix through the paged
cache (:func:`shared_prefix_cache`, :func:`cache_batch`), and the refusing decode batches each
switch is run over (:data:`SCENARIOS`). Every slot a reader must not use holds NaN or a sentinel
(:data:`SENTINEL_V`) engineered to dominate attention.
"""

from __future__ import annotations

import dataclasses

import torch

import kvattn
from kvattn_testing.util import DEVICE, Batch

SENTINEL_V = 100.0


@dataclasses.dataclass(frozen=True)
class Geometry:
    page: int
    head_dim: int

    def small_batch(self, seq_lens, *, dtype=torch.float16, seed=0, **kwargs):
        return Batch.random(
            batch=len(seq_lens),
            num_heads=4,
            num_kv_heads=2,
            head_dim=self.head_dim,
            page_size=self.page,
            seq_lens=seq_lens,
            dtype=dtype,
            seed=seed,
            **kwargs,
        )

    @property
    def lens3(self):
        """Three sequences of 2, 3 and 3 pages, the first and last ending one slot into a page."""
        return [self.page + 1, 3 * self.page, 2 * self.page + 1]


DEFAULT = Geometry(page=4, head_dim=32)


def incident(geo, num_pages_b, dtype=torch.float16):
    """Tenant A fills the whole pool with K aligned to B's queries (x8) and V = 100, then releases
    it; B reserves ``num_pages_b`` pages and one token is written. Returns the cache, B's lease, B's
    query and B's one token."""
    num_kv_heads, group, head_dim, page = 2, 2, geo.head_dim, geo.page
    g = torch.Generator().manual_seed(42)
    # The query heads of a group are equal, so one sentinel key dominates each of them.
    q = torch.randn(1, num_kv_heads, head_dim, generator=g).repeat_interleave(group, dim=1)
    q = q.to(dtype).to(DEVICE)
    cache = kvattn.PagedKVCache(8, page, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
    cache.k_cache.fill_(float("nan"))
    cache.v_cache.fill_(float("nan"))
    tenant_a = cache.allocate(8 * page)
    sentinel_k = (8 * q[0, ::group]).expand(8 * page, num_kv_heads, head_dim)
    sentinel_v = torch.full_like(sentinel_k, SENTINEL_V)
    assert cache.append(tenant_a, sentinel_k.contiguous(), sentinel_v).dropped_count() == 0
    cache.free(tenant_a)

    lease_b = cache.allocate(num_pages_b * page)
    k1 = torch.randn(1, num_kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    v1 = torch.randn(1, num_kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    assert cache.append(lease_b, k1, v1).dropped_count() == 0
    assert lease_b.num_tokens == 1 and len(lease_b.pages) == num_pages_b
    return cache, lease_b, q, k1, v1


def shared_prefix_cache(geo, dtype=torch.float16):
    g = torch.Generator().manual_seed(5)
    page, head_dim = geo.page, geo.head_dim
    cache = kvattn.PagedKVCache(12, page, 2, head_dim, dtype=dtype, device=DEVICE)
    cache.k_cache.fill_(float("nan"))
    cache.v_cache.fill_(float("nan"))

    def kv(n):
        return [torch.randn(n, 2, head_dim, generator=g).to(dtype).to(DEVICE) for _ in range(2)]

    parent = cache.allocate(2 * page + 2)
    cache.append(parent, *kv(2 * page + 2))
    child = cache.share_prefix(parent, 2 * page + 2, capacity=3 * page)
    cache.append(child, *kv(3))
    other = cache.allocate(page)
    cache.append(other, *kv(page))
    q = torch.randn(3, 4, head_dim, generator=g).to(dtype).to(DEVICE)
    return cache, parent, child, other, q


def cache_batch(cache, leases, q, expected=None):
    table, seq_lens, per_entry = cache.batch(leases)
    return Batch(
        q,
        cache.k_cache,
        cache.v_cache,
        table,
        seq_lens,
        cache.page_tags,
        per_entry if expected is None else expected,
    )


# --- decode batches that refuse something, for the scenarios under each switch -------------------


def incident_batch() -> Batch:
    cache, lease_b, q, _, _ = incident(DEFAULT, 4)
    table, _, expected = cache.batch([lease_b])
    seq_lens = torch.tensor([4 * DEFAULT.page], dtype=torch.int32, device=DEVICE)
    return Batch(q, cache.k_cache, cache.v_cache, table, seq_lens, cache.page_tags, expected)


def refused_pages_batch() -> Batch:
    batch = DEFAULT.small_batch(DEFAULT.lens3)
    batch.page_tags[int(batch.block_table[1, 1])] = kvattn.FREE_TAG
    batch.page_tags[int(batch.block_table[2, 0])] = kvattn.reserved_tag(3)
    batch.block_table[0, 1] = -1
    return batch


def swapped_rows_batch() -> Batch:
    batch = DEFAULT.small_batch(DEFAULT.lens3)
    batch.block_table[[1, 2]] = batch.block_table[[2, 1]].clone()
    return batch


def foreign_prefix_batch() -> Batch:
    cache, parent, child, other, q = shared_prefix_cache(DEFAULT)
    table, _, per_entry = cache.batch([parent, child, other])
    wrong = per_entry.clone()
    wrong[1, :2] = child.owner
    return cache_batch(cache, [parent, child, other], q, expected=wrong)


SCENARIOS = {
    "incident": incident_batch,
    "refused_pages": refused_pages_batch,
    "swapped_rows": swapped_rows_batch,
    "foreign_prefix": foreign_prefix_batch,
}
