"""A small paged KV allocator that shows the intended use of the tags.

Each allocation is a :class:`Lease` with a fresh owner id, unique across every cache of the process
(ids are never reused, so a stale page can never carry a live owner, and a lease of one cache can
never pass for another cache's). A lease is bound to the cache that issued it: another cache
refuses it. Allocation reserves pages (reads fail until something is written), writes
go through :func:`kvattn.write_kv` under the lease's owner, freeing releases pages whose last
reference is gone. A lease may share another lease's full, written prefix pages; its block-table
entries for them expect the other lease's owner (per-entry ``expected``).

Page bookkeeping (free list, reference counts, which pages a lease maps) is on the host, as in every
engine; the tags on the device are what the kernels trust, so a bookkeeping bug turns into refused
pages and a report, not a leak.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from .api import paged_decode, paged_extend
from .layout import KV_DTYPES, check_pool_geometry
from .tags import new_owner_id
from .variants import FP8_DTYPES
from .write_args import write_scales
from .writers import WriteResult, reassign_pages, release_pages, reserve_pages, write_kv


def _count(name: str, value, *, optional: bool = False) -> None:
    """A token count a caller gives: a non-negative int (or None when ``optional``)."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name}: expected a token count >= 0, got {value}")


@dataclass
class Lease:
    """One request's hold on pages. ``pages[i]`` is logical page ``i``; ``page_owners[i]`` the owner
    its tag must carry (this lease's owner, or the owner of the lease whose prefix it shares)."""

    owner: int
    pages: list[int] = field(default_factory=list)
    page_owners: list[int] = field(default_factory=list)
    num_tokens: int = 0
    freed: bool = False


class PagedKVCache:
    """K/V page pools, their tag array and a free list.

    Args:
        num_pages, page_size, num_kv_heads, head_dim: pool geometry (:mod:`kvattn.layout`): ints
            >= 1, ``page_size`` at most 1024 (else TypeError/ValueError).
        dtype, device: of the pools: float16/bfloat16/float32, or fp8 (``float8_e4m3fn``,
            ``float8_e5m2``), which :meth:`append` fills by quantising wider K/V by ``k_scale``/
            ``v_scale`` (:func:`kvattn.write_kv`) and :meth:`decode`/:meth:`prefill` read back
            dequantised by the same scales.
        k_scale, v_scale: fp8 pools only (a float, or a float32 tensor ``[]``, ``[1]`` or
            ``[num_kv_heads]`` on ``device``; default 1), else ``ValueError``.
        layout: ``"NHD"`` or ``"HND"``: the byte order of the pool buffers. Either way
            ``k_cache``/``v_cache`` are NHD-shaped views (HND ones are transposed views).
        head_dim_v: the value pool's own head dim (an int >= 1; default ``head_dim``), that of
            the outputs of :meth:`decode`/:meth:`prefill` and of the ``v`` they append.

    Every method that takes a lease refuses (ValueError) one this cache did not issue, and token
    counts must be non-negative ints.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float16,
        device=None,
        layout: str = "NHD",
        k_scale=None,
        v_scale=None,
        head_dim_v: int | None = None,
    ):
        check_pool_geometry(num_pages, page_size, num_kv_heads, head_dim)
        if head_dim_v is None:
            head_dim_v = head_dim
        check_pool_geometry(
            num_pages, page_size, num_kv_heads, head_dim_v, head_dim_name="head_dim_v"
        )
        if dtype not in KV_DTYPES + FP8_DTYPES:
            raise TypeError(f"dtype: expected one of {KV_DTYPES + FP8_DTYPES}, got {dtype}")
        if layout == "NHD":
            shape = (num_pages, page_size, num_kv_heads)
            self.k_cache = torch.empty(*shape, head_dim, dtype=dtype, device=device)
            self.v_cache = torch.empty(*shape, head_dim_v, dtype=dtype, device=device)
        elif layout == "HND":
            shape = (num_pages, num_kv_heads, page_size)
            self.k_cache = torch.empty(*shape, head_dim, dtype=dtype, device=device).transpose(1, 2)
            self.v_cache = torch.empty(*shape, head_dim_v, dtype=dtype, device=device).transpose(
                1, 2
            )
        else:
            raise ValueError(f"layout: expected 'NHD' or 'HND', got {layout!r}")
        self.page_size = page_size
        self.device = self.k_cache.device
        # [num_kv_heads] float32 for fp8 pools (what the writer divides by and the readers multiply
        # by), else None.
        self.k_scale, self.v_scale = write_scales(
            torch.float32, self.k_cache, k_scale, v_scale, None
        )
        self.page_tags = torch.zeros(num_pages, dtype=torch.int64, device=self.device)
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: freed pages are reused first
        self._refs = [0] * num_pages
        self._live: dict[int, Lease] = {}
        # Every lease this cache issued and someone still holds, freed ones included (batch()
        # accepts those: reading a stale lease is how a bug shows as refused pages).
        self._issued: weakref.WeakValueDictionary[int, Lease] = weakref.WeakValueDictionary()

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def _new_lease(self, **fields) -> Lease:
        lease = Lease(owner=new_owner_id(), **fields)
        self._issued[lease.owner] = lease
        return lease

    def _take_pages(self, lease: Lease, count: int) -> None:
        if count > len(self._free):
            raise RuntimeError(f"KV pool exhausted: need {count} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(count)]
        for p in pages:
            self._refs[p] += 1
        if pages:
            reserve_pages(self.page_tags, pages, lease.owner)
        lease.pages += pages
        lease.page_owners += [lease.owner] * count

    def allocate(self, num_tokens: int) -> Lease:
        """A new lease with a fresh owner and enough RESERVED pages for ``num_tokens`` tokens."""
        _count("num_tokens", num_tokens)
        if -(-num_tokens // self.page_size) > len(self._free):  # before an owner id is spent
            raise RuntimeError(
                f"KV pool exhausted: need {-(-num_tokens // self.page_size)} pages, "
                f"{len(self._free)} free"
            )
        lease = self._new_lease()
        self._take_pages(lease, -(-num_tokens // self.page_size))
        self._live[lease.owner] = lease
        return lease

    def grow(self, lease: Lease, num_tokens: int) -> None:
        """Reserve pages so ``lease`` can hold ``num_tokens`` tokens in all."""
        self._check_live(lease)
        _count("num_tokens", num_tokens)
        self._take_pages(lease, max(0, -(-num_tokens // self.page_size) - len(lease.pages)))

    def share_prefix(self, parent: Lease, num_tokens: int, capacity: int | None = None) -> Lease:
        """A new lease whose first pages are ``parent``'s full pages covering up to ``num_tokens``
        tokens (a partial last page is not shared: the new lease must write those tokens itself).
        Its ``num_tokens`` starts at the shared length; ``capacity`` (tokens) reserves more pages."""
        self._check_live(parent)
        _count("num_tokens", num_tokens)
        _count("capacity", capacity, optional=True)
        shared = min(num_tokens, parent.num_tokens) // self.page_size
        extra = 0 if capacity is None else max(0, -(-capacity // self.page_size) - shared)
        if extra > len(self._free):  # before any reference is taken, so a refusal leaks nothing
            raise RuntimeError(f"KV pool exhausted: need {extra} pages, {len(self._free)} free")
        lease = self._new_lease(
            pages=parent.pages[:shared],
            page_owners=parent.page_owners[:shared],
            num_tokens=shared * self.page_size,
        )
        for p in lease.pages:
            self._refs[p] += 1
        self._take_pages(lease, extra)
        self._live[lease.owner] = lease
        return lease

    def slot_mapping(self, lease: Lease, start: int, count: int) -> torch.Tensor:
        """``[count]`` int64 slots (``page * page_size + slot``) of tokens ``start ..`` of ``lease``,
        which must lie in its pages."""
        self._check_issued(lease)
        _count("start", start)
        _count("count", count)
        if start + count > len(lease.pages) * self.page_size:
            raise ValueError(
                f"count: expected tokens {start} .. {start + count} to lie in the lease's "
                f"{len(lease.pages)} page(s) of {self.page_size}, got {count} tokens"
            )
        tokens = torch.arange(start, start + count)
        pages = torch.tensor(lease.pages, dtype=torch.int64)[tokens // self.page_size]
        return (pages * self.page_size + tokens % self.page_size).to(self.device)

    def append(self, lease: Lease, k: torch.Tensor, v: torch.Tensor) -> WriteResult:
        """Write ``k``/``v`` ``[T, num_kv_heads, head_dim]`` (``v``: ``head_dim_v``) after the
        lease's tokens, growing it as needed, and stamp the pages. Tokens refused by the writer
        are counted in the result; the lease's ``num_tokens`` advances all the same (it is the
        host's view of the sequence), so readers find the refused slots unwritten and report
        them."""
        self._check_live(lease)
        count = k.shape[0]
        self.grow(lease, lease.num_tokens + count)
        # fp8 tokens go in as they are; wider ones into fp8 pools are quantised by the scales.
        scales = (
            {}
            if k.dtype == self.k_cache.dtype
            else dict(k_scale=self.k_scale, v_scale=self.v_scale)
        )
        result = write_kv(
            k,
            v,
            self.k_cache,
            self.v_cache,
            self.slot_mapping(lease, lease.num_tokens, count),
            self.page_tags,
            lease.owner,
            **scales,
        )
        lease.num_tokens += count
        return result

    def free(self, lease: Lease) -> int | None:
        """Drop the lease; pages no other lease shares become FREE and go back to the pool.

        Pages the lease wrote that other leases still share are handed to a fresh owner id (the
        heir, returned; None when there is none) and the sharers' expected owners follow: a late
        write of the ended lease can then no longer land in pages others read.
        """
        self._check_live(lease)
        lease.freed = True
        del self._live[lease.owner]
        released, kept = [], []
        for p, page_owner in zip(lease.pages, lease.page_owners):
            self._refs[p] -= 1
            if self._refs[p] == 0:
                released.append(p)
            elif page_owner == lease.owner:
                kept.append(p)
        if released:
            release_pages(self.page_tags, released)
        self._free += reversed(released)
        if not kept:
            return None
        heir = new_owner_id()
        reassign_pages(self.page_tags, kept, lease.owner, heir)
        for other in self._live.values():
            other.page_owners = [
                heir if (o == lease.owner and p in kept) else o
                for p, o in zip(other.pages, other.page_owners)
            ]
        return heir

    def batch(self, leases: list[Lease]):
        """``(block_table, seq_lens, expected)`` for ``leases``, on the cache's device; ``expected``
        is per entry (``[B, max_pages]``), unused entries hold page 0 and owner 0."""
        if not leases:
            raise ValueError("leases: expected at least one lease, got an empty list")
        for lease in leases:
            self._check_issued(lease)
        max_pages = max(1, max(len(lease.pages) for lease in leases))
        table = torch.zeros(len(leases), max_pages, dtype=torch.int32)
        expected = torch.zeros(len(leases), max_pages, dtype=torch.int64)
        for b, lease in enumerate(leases):
            table[b, : len(lease.pages)] = torch.tensor(lease.pages, dtype=torch.int32)
            expected[b, : len(lease.pages)] = torch.tensor(lease.page_owners, dtype=torch.int64)
        seq_lens = torch.tensor([lease.num_tokens for lease in leases], dtype=torch.int32)
        return table.to(self.device), seq_lens.to(self.device), expected.to(self.device)

    def decode(self, q: torch.Tensor, leases: list[Lease], **kwargs):
        """:func:`kvattn.paged_decode` of ``q`` ``[B, num_heads, head_dim]`` over ``leases``."""
        table, seq_lens, expected = self.batch(leases)
        return paged_decode(
            q,
            self.k_cache,
            self.v_cache,
            table,
            seq_lens,
            self.page_tags,
            expected,
            **self._scales(kwargs),
        )

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        leases: list[Lease],
        q_lens,
        **kwargs,
    ):
        """One chunk of (chunked) prefill for a batch of leases: append each lease's new K/V after
        its tokens, then :func:`kvattn.paged_extend` of its queries over all its pages (a shared
        prefix included, checked against the owner that wrote it).

        ``q`` ``[total_q, num_heads, head_dim]``, ``k``/``v`` ``[total_q, num_kv_heads, head_dim]``
        (``v``: ``head_dim_v``):
        the new tokens of ``leases[0]``, then of ``leases[1]``, ...; ``q_lens``: how many belong to
        each lease (host ints: the chunk schedule is host bookkeeping). A token the writer refuses
        leaves its slot unwritten, so the attention refuses it and the report shows it.
        Returns what :func:`kvattn.paged_extend` returns.
        """
        q_lens = [int(n) for n in q_lens]
        if len(q_lens) != len(leases) or min(q_lens, default=0) < 0:
            raise ValueError(
                f"q_lens: expected {len(leases)} non-negative counts (one per lease), got {q_lens}"
            )
        if sum(q_lens) != k.shape[0]:
            raise ValueError(
                f"k: expected {sum(q_lens)} tokens (the sum of q_lens), got {k.shape[0]}"
            )
        start = 0
        for lease, count in zip(leases, q_lens):
            self.append(lease, k[start : start + count], v[start : start + count])
            start += count
        offsets = torch.tensor([0] + q_lens, dtype=torch.int64).cumsum(0).to(torch.int32)
        table, seq_lens, expected = self.batch(leases)
        return paged_extend(
            q,
            self.k_cache,
            self.v_cache,
            offsets.to(self.device),
            table,
            seq_lens,
            self.page_tags,
            expected,
            **self._scales(kwargs),
        )

    def _scales(self, kwargs: dict) -> dict:
        """The readers' keyword arguments with this cache's fp8 scales (unless given)."""
        if self.k_scale is None:
            return kwargs
        return dict(dict(k_scale=self.k_scale, v_scale=self.v_scale), **kwargs)

    def _check_issued(self, lease) -> None:
        if not isinstance(lease, Lease):
            raise TypeError(f"lease: expected a kvattn.Lease, got {type(lease).__name__}")
        if self._issued.get(lease.owner) is not lease:
            raise ValueError(
                f"lease: expected a lease issued by this cache, got the lease of owner "
                f"{lease.owner}, which it did not issue (another cache's, or built by "
                "hand)"
            )

    def _check_live(self, lease) -> None:
        self._check_issued(lease)
        if lease.freed:
            raise ValueError(
                f"lease: expected a live lease, got lease of owner {lease.owner} "
                "that was already freed"
            )
