"""The checked receive of a KV transfer, for any transfer engine: what the sender attests about
the pages it sends, and what the receiver verifies before :func:`kvattn.commit_pages` stamps them.

A transfer moves whole pages. What a receiver can prove about a page it received is only what
arrived; what it must also know is how many leading slots of that page the sender had written for
the request, because the rest of a sender's page is whatever an earlier request left there (pages
are reused, never zeroed). So the sender attests, per page it sends, from its own tags:

- ``valid_len``: the leading slots its tags hold WRITTEN for the request's owner in every layer
  (0 for a page the request does not hold: a padded or stale entry in the sender's list);
- ``digest``: :func:`page_digest` of those slots' K and V bytes in every layer.

The receiver, once the transfer engine reports a page's bytes arrived, recomputes the digest of
the same slots of its own copy (:func:`verify_arrived`) and commits the page by the attested
``valid_len`` only if the digests are equal: bytes that differ (a torn or misdirected write, a
sender that attests bytes it did not send) leave the page RESERVED, and a read of it is refused.
A page without an attestation is not committed. The attestation travels beside the transfer's own
metadata (``kvattn.integrations.vllm_connector`` puts it in vLLM's ``kv_transfer_params``); it is
as trustworthy as the sender's tags, which is the point: the sender's ledger, not its scheduler's
token count, says what its pages hold.

The digest is BLAKE3 (:func:`page_digest`; 16 bytes) over, per layer in order, the K then the V
bytes of slots ``[0, valid_len)`` of the page in the pools' logical NHD order ``[slot, kv_head,
head_dim]``, then a context (bytes both sides derive on their own, such as a digest of the token
prefix through the page: then a page verifies only for the tokens and the position it was written
for), then the length and the context's length as 4 little-endian bytes each; both sides must lay
the pages out alike (same dtype, heads and head dim). A cryptographic hash, because the bytes are a tenant's
to steer (its prompt makes its KV): no tenant can construct another page's digest, and two pages
collide by accident with probability about 2^-128. It needs no key, so no message has to travel
from the receiver to the sender before the sender attests (vLLM's pull transfers have none).

It runs on the host: CPU pools are read in place, device pools are copied to the host in batches of
whole pages (at most ``STAGE_BYTES`` at a time), and one call's pages are spread over
:func:`set_digest_threads` threads (BLAKE3 hashes with the GIL released).
:func:`attest_pages_async` and :func:`verify_arrived_async` check their arguments and read the tags
on the calling thread, then digest on kvattn's transfer thread, off an engine's step; they return a
:class:`concurrent.futures.Future`. Bytes overwritten before the transfer thread reads them give a
digest that matches nothing: the receiver refuses the page, never commits it.

Every function here is a trust boundary (the attestation arrives from another machine, the page lists
from an engine's bookkeeping): every argument is validated and a wrong one raises ``TypeError`` or
``ValueError`` naming it, before any tag or byte is read. A page id outside the pools (``-1``, the
padding engines put in block lists, included) is refused, never wrapped around.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

try:
    import blake3 as _blake3
except ImportError:  # a digest then says what to install; lengths alone still work
    _blake3 = None

from .layout import check_tensor
from .tags import STATE_WRITTEN, check_owner, tag_owner, tag_state, tag_valid_len

DIGEST_BYTES = 16


@dataclass(frozen=True)
class PageAttestation:
    """What the sender says of one page it sends: written slots and their digest (hex)."""

    valid_len: int
    digest: str

    def __post_init__(self):
        if isinstance(self.valid_len, bool) or not isinstance(self.valid_len, int):
            raise TypeError(
                f"valid_len: expected an int, got {type(self.valid_len).__name__} "
                f"({self.valid_len!r})"
            )
        if not isinstance(self.digest, str):
            raise TypeError(f"digest: expected a hex str, got {type(self.digest).__name__}")

    def to_json(self) -> list:
        return [self.valid_len, self.digest]

    @classmethod
    def from_json(cls, value) -> PageAttestation:
        if (
            not isinstance(value, (list, tuple))
            or len(value) != 2
            or isinstance(value[0], bool)
            or not isinstance(value[0], int)
            or not isinstance(value[1], str)
        ):
            raise ValueError(f"attestation: expected [valid_len, digest hex], got {value!r}")
        return cls(int(value[0]), value[1])


def _check_pools(k_caches, v_caches) -> tuple[int, int]:
    """``(num_pages, page_size)`` of the layers' K and V pools, each ``[num_pages, page_size,
    kv_heads, head_dim]``, one per layer in a list (one 4-D tensor is not a list of layers: its
    pages would be digested as layers)."""
    for name, pools in (("k_caches", k_caches), ("v_caches", v_caches)):
        if isinstance(pools, torch.Tensor) or not isinstance(pools, Sequence):
            raise TypeError(
                f"{name}: expected a list of per-layer pools [num_pages, page_size, kv_heads, "
                f"head_dim], got {type(pools).__name__}"
                + (" (one tensor: pass [pool] for one layer)" if torch.is_tensor(pools) else "")
            )
        if not pools:
            raise ValueError(f"{name}: expected at least one layer, got an empty list")
        for i, pool in enumerate(pools):
            check_tensor(f"{name}[{i}]", pool, ndim=4)
    if len(k_caches) != len(v_caches):
        raise ValueError(
            f"v_caches: expected one pool per layer of k_caches ({len(k_caches)}), "
            f"got {len(v_caches)}"
        )
    pages_and_size = tuple(k_caches[0].shape[:2])
    for name, pools in (("k_caches", k_caches), ("v_caches", v_caches)):
        for i, pool in enumerate(pools):
            if tuple(pool.shape[:2]) != pages_and_size:
                raise ValueError(
                    f"{name}[{i}]: expected {pages_and_size[0]} pages of {pages_and_size[1]} slots "
                    f"(k_caches[0]'s), got shape {tuple(pool.shape)}"
                )
    return pages_and_size


def _check_pages(pages, num_pages: int) -> list[int]:
    """``pages`` as a list of ids in ``[0, num_pages)``: a sequence of ints or a 1-D integer
    tensor."""
    if isinstance(pages, torch.Tensor):
        if pages.dim() != 1 or pages.dtype.is_floating_point or pages.dtype == torch.bool:
            raise TypeError(
                f"pages: expected a 1-D integer tensor or a list of ints, got a "
                f"{pages.dim()}-D {str(pages.dtype).replace('torch.', '')} tensor"
            )
        pages = pages.tolist()
    if isinstance(pages, (str, bytes)) or not isinstance(pages, Sequence):
        raise TypeError(f"pages: expected a list of page ids, got {type(pages).__name__}")
    return [_check_int(f"pages[{i}]", page, 0, num_pages - 1) for i, page in enumerate(pages)]


def _check_int(name: str, value, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} ({value!r})")
    if not low <= value <= high:
        raise ValueError(f"{name}: expected an int in [{low}, {high}], got {value}")
    return value


def _check_per_page(name: str, values, count: int) -> list:
    """``values`` (one per page) as a list of ``count``."""
    if isinstance(values, (str, bytes, torch.Tensor)) or not isinstance(values, Sequence):
        raise TypeError(
            f"{name}: expected a list with one entry per page, got {type(values).__name__}"
        )
    if len(values) != count:
        raise ValueError(f"{name}: expected one entry per page ({count}), got {len(values)}")
    return list(values)


def _check_contexts(contexts, count: int) -> list[bytes]:
    if contexts is None:
        return [b""] * count
    out = _check_per_page("contexts", contexts, count)
    for i, context in enumerate(out):
        if not isinstance(context, (bytes, bytearray)):
            raise TypeError(f"contexts[{i}]: expected bytes, got {type(context).__name__}")
    return [bytes(c) for c in out]


def page_digest(
    k_caches: Sequence[torch.Tensor],
    v_caches: Sequence[torch.Tensor],
    page: int,
    valid_len: int,
    context: bytes = b"",
    *,
    key: DigestKey | None = None,
) -> str:
    """The digest of slots ``[0, valid_len)`` of ``page`` over every layer's K and V pools
    (NHD views ``[num_pages, page_size, kv_heads, head_dim]``, any strides), as hex.
    ``context``: bytes both sides derive on their own for this page (an engine's digest of the
    token prefix the page ends, say), so that the page verifies only where it belongs."""
    num_pages, page_size = _check_pools(k_caches, v_caches)
    _check_int("page", page, 0, num_pages - 1)
    _check_int("valid_len", valid_len, 0, page_size)
    (context,) = _check_contexts([context], 1)
    key = _key(key)
    _check_keyable(k_caches, v_caches, key)
    return _digests(k_caches, v_caches, [page], [valid_len], [context], key)[0]


# Host bytes staged from device pools per batch of pages.
STAGE_BYTES = 256 << 20
_threads = max(1, min(8, os.cpu_count() or 1))
_lock = threading.Lock()
_workers: ThreadPoolExecutor | None = None
_transfer: ThreadPoolExecutor | None = None


def set_digest_threads(threads: int) -> None:
    """How many threads one call's digests are spread over (default: the CPU's cores, at most
    8)."""
    global _threads, _workers
    _check_int("threads", threads, 1, 256)
    with _lock:
        if _workers is not None:
            _workers.shutdown(wait=True)
        _threads, _workers = threads, None


def _pool() -> ThreadPoolExecutor:
    global _workers
    with _lock:
        if _workers is None:
            _workers = ThreadPoolExecutor(_threads, thread_name_prefix="kvattn-digest")
        return _workers


def _transfer_thread() -> ThreadPoolExecutor:
    global _transfer
    with _lock:
        if _transfer is None:
            _transfer = ThreadPoolExecutor(1, thread_name_prefix="kvattn-transfer")
        return _transfer


def _hasher(prefix: bytes):
    if _blake3 is None:
        raise ImportError(
            "kvattn.transfer: page digests need the blake3 package (pip install blake3), "
            "declared by kvattn; digests=False or check_bytes=False work without it"
        )
    return _blake3.blake3(prefix)


class _Bytes:
    """A host pool's pages as bytes: a ``[num_pages, page bytes]`` view of its memory when each
    page's slots lie contiguously (NHD, any page stride: read in place, each page a slice of
    it), else per page a copy in NHD order."""

    def __init__(self, pool: torch.Tensor):
        self.pool = pool
        pages, slots, heads, dim = pool.shape
        self.row = heads * dim * pool.element_size()  # bytes per slot
        self.rows = None
        if pool.stride()[1:] == (heads * dim, dim, 1) and pool.numel():
            whole = torch.as_strided(pool, (pages, slots * heads * dim), (pool.stride(0), 1))
            self.rows = whole.view(torch.uint8).numpy()

    def slots(self, page: int, valid_len: int):
        """Slots ``[0, valid_len)`` of ``page`` (never past the page)."""
        if self.rows is not None:
            return self.rows[page, : min(valid_len, self.pool.shape[1]) * self.row]
        rows = self.pool[page, :valid_len].contiguous()
        return rows.reshape(-1).view(torch.uint8).numpy()


def _one(pools: list[_Bytes], page: int, valid_len: int, context: bytes) -> str:
    # The bytes first: BLAKE3 hashes whole power-of-two subtrees at once only from positions
    # aligned to them, which a leading context of any length would break (2.4x slower here).
    h = _hasher(b"")
    for pool in pools:
        h.update(pool.slots(page, valid_len))
    h.update(context + int(valid_len).to_bytes(4, "little") + len(context).to_bytes(4, "little"))
    return h.hexdigest(length=DIGEST_BYTES)


def _staged(pools, pages: list[int]):
    """``(host pools, page ids in them, positions in pages)`` per batch of whole pages copied to the
    host, at most STAGE_BYTES (or one page) a batch."""
    per_page = sum(pool[0].numel() * pool.element_size() for pool in pools)
    step = max(1, STAGE_BYTES // per_page)
    for lo in range(0, len(pages), step):
        ids = pages[lo : lo + step]
        index = torch.tensor(ids, dtype=torch.int64, device=pools[0].device)
        host = [pool.index_select(0, index).cpu() for pool in pools]
        yield host, list(range(len(ids))), range(lo, lo + len(ids))


def _digests(k_caches, v_caches, pages: list[int], lens: list[int], contexts, key=None):
    """:func:`page_digest` of each page, the pages spread over the digest threads; device pools
    staged on the host a batch of whole pages at a time. With a ``key``, the keyed digest."""
    if not pages:
        return []
    if key is not None:
        return _keyed_digests(k_caches, v_caches, pages, lens, contexts, key)
    pools = [pool for pair in zip(k_caches, v_caches, strict=True) for pool in pair]
    _hasher(b"")  # the missing package is said before any work
    on_host = all(pool.device.type == "cpu" for pool in pools)
    batches = [(pools, pages, range(len(pages)))] if on_host else _staged(pools, pages)
    out: list[str] = [""] * len(pages)
    for host, local, where in batches:
        host = [_Bytes(pool) for pool in host]
        jobs = list(zip(local, where))
        chunks = [jobs[i::_threads] for i in range(min(_threads, len(jobs)))]

        def run(chunk, host=host):
            return [(j, _one(host, p, lens[j], contexts[j])) for p, j in chunk]

        if len(chunks) <= 1:
            done = [run(c) for c in chunks]
        else:
            done = list(_pool().map(run, chunks))
        for chunk in done:
            for j, digest in chunk:
                out[j] = digest
    return out


@dataclass(frozen=True)
class DigestKey:
    """The key of one transfer's keyed digest (docs/transfer.md, "The keyed digest"): 32 secret
    bytes the receiver draws (:meth:`new`) and sends to the sender before the sender attests (or
    the sender draws after its pages are written and sends with the attestation). The key words
    of NH are derived from them with BLAKE3's key derivation, the same on every machine."""

    seed: bytes

    def __post_init__(self):
        if not isinstance(self.seed, bytes) or len(self.seed) != 32:
            raise TypeError(
                f"seed: expected 32 bytes, got {type(self.seed).__name__}"
                + (f" of length {len(self.seed)}" if isinstance(self.seed, bytes) else "")
            )

    @classmethod
    def new(cls) -> DigestKey:
        return cls(os.urandom(32))

    def hex(self) -> str:
        return self.seed.hex()

    @classmethod
    def for_pools(cls, k_caches, v_caches) -> DigestKey | None:
        """A fresh key (:meth:`new`) for a transfer of pages of these pools where the keyed digest
        reads them in place at speed: pools on a device (the Triton kernel), or host pools with
        the compiled CPU module built; None where the keyless digest is the one to use (pools
        not in 16-byte units, or host pools with only NumPy's NH, slower than BLAKE3). What an
        engine's sender calls once per transfer, after the pages' bytes are written."""
        _check_pools(k_caches, v_caches)
        pools = [pool for pair in zip(k_caches, v_caches) for pool in pair]
        try:
            _keyable(pools)
        except ValueError:
            return None
        if pools[0].device.type == "cpu":
            from .backends import cpu as cpu_backend

            if cpu_backend._cpu is None:
                return None
        return cls.new()

    @classmethod
    def from_hex(cls, text) -> DigestKey:
        if not isinstance(text, str) or len(text) != 64:
            raise ValueError(f"digest key: expected 64 hex digits, got {text!r}")
        try:
            return cls(bytes.fromhex(text))
        except ValueError:
            raise ValueError(f"digest key: expected 64 hex digits, got {text!r}") from None

    def words(self, count: int, device) -> torch.Tensor:
        """The first ``count`` 32-bit key words (int32, on ``device``)."""
        cached = _key_cache.get((self.seed, count, str(device)))
        if cached is None:
            stream = _blake3_module().blake3(self.seed, derive_key_context=KEY_CONTEXT)
            raw = bytearray(stream.digest(length=4 * count))
            cached = torch.frombuffer(raw, dtype=torch.int32).to(device)
            if len(_key_cache) > 16:
                _key_cache.clear()
            _key_cache[(self.seed, count, str(device))] = cached
        return cached


KEY_CONTEXT = "kvattn 2026-12-06 transfer digest NH key"
_key_cache: dict = {}


def _blake3_module():
    _hasher(b"")
    return _blake3


def _keyable(pools: list[torch.Tensor]) -> None:
    """The pools a keyed digest reads as 32-bit words, 4 at a time: what lies back to back of a
    slot (its row, or each head's row where the heads are apart: HND, K and V interleaved) a
    whole number of 16-byte units, every stride and address on a 16-byte boundary."""
    names = [f"{'k' if i % 2 == 0 else 'v'}_caches[{i // 2}]" for i in range(len(pools))]
    for name, pool in zip(names, pools):
        size = pool.element_size()
        if pool.stride(3) != 1 and pool.shape[3] > 1:
            raise ValueError(f"{name}: expected contiguous head rows, got strides {pool.stride()}")
        apart = pool.shape[2] > 1 and pool.stride(2) != pool.shape[3]
        run = pool.shape[3] * size * (1 if apart else pool.shape[2])
        strides = tuple(pool.stride(d) * size for d in range(3 if apart else 2))
        if run % 16 or any(s % 16 for s in strides):
            raise ValueError(
                f"{name}: expected {'head' if apart else 'slot'} rows of 16-byte units on "
                f"16-byte boundaries, got {run}-byte rows and byte strides {strides}"
            )
        if pool.data_ptr() % 16:
            raise ValueError(f"{name}: expected memory aligned to 16 bytes")
    if len({pool.device for pool in pools}) != 1:
        raise ValueError("k_caches, v_caches: expected every pool on one device")


def _nh_host(pools: list[_Bytes], page: int, valid_len: int, key: np.ndarray) -> bytes:
    """The four NH values of one page (the device kernel's, in NumPy's wrapping uint64)."""
    from .backends.triton.digest import INSTANCES, SHIFT

    acc = [0] * INSTANCES
    at = 0
    for pool in pools:
        m = pool.slots(page, valid_len).view(np.uint32)
        for j in range(INSTANCES):
            s = m + key[at + SHIFT * j : at + SHIFT * j + m.size]  # wraps mod 2^32
            products = s[0::2].astype(np.uint64) * s[1::2].astype(np.uint64)
            acc[j] = (acc[j] + int(products.sum(dtype=np.uint64))) % 2**64
        at += pool.pool.shape[1] * pool.row // 4
    return b"".join(value.to_bytes(8, "little") for value in acc)


def _nh_cpu(pools: list[torch.Tensor], pages: list[int], lens: list[int], key: torch.Tensor):
    """The NH values of pages of host pools: the compiled CPU module's (csrc/cpu/digest_cpu.h,
    vectorized, pages over the digest threads, the GIL released) where it is built, else NumPy's
    (:func:`_nh_host`, one page at a time). Pools and pages are validated by the caller."""
    from .backends import cpu as cpu_backend
    from .backends.triton.digest import INSTANCES
    from .backends.triton.digest import row_shape as digest_shape

    ext = cpu_backend._cpu
    if ext is None:
        host = [_Bytes(pool) for pool in pools]
        key_np = key.numpy().view(np.uint32)
        return [_nh_host(host, p, n, key_np) for p, n in zip(pages, lens)]
    rows, at = [], 0
    for pool in pools:
        size = pool.element_size()
        row_words, head_words = digest_shape(pool)
        strides = [pool.stride(d) * size for d in range(3)]
        rows.append([pool.data_ptr(), *strides, row_words, head_words, at, pool.shape[0]])
        at += pool.shape[1] * row_words
    chunks = torch.tensor(rows, dtype=torch.int64)
    index = torch.tensor(pages, dtype=torch.int64)
    counts = torch.tensor(lens, dtype=torch.int64)
    out = torch.empty(len(pages), INSTANCES, dtype=torch.int64)
    ext.nh_pages(
        dict(
            chunks=chunks.data_ptr(),
            num_chunks=len(rows),
            pages=index.data_ptr(),
            lens=counts.data_ptr(),
            n=len(pages),
            page_size=pools[0].shape[1],
            key=key.data_ptr(),
            key_words=key.numel(),
            out=out.data_ptr(),
            threads=_threads,
        )
    )
    return [row.tobytes() for row in out.numpy()]


def _keyed_digests(k_caches, v_caches, pages, lens, contexts, key: DigestKey) -> list[str]:
    """The keyed digest of each page: NH on the pools' device (the Triton kernel; NumPy on CPU
    pools), then BLAKE3 over its 32 bytes, the context and the lengths, on the host. The callers
    check the pools first (:func:`_check_keyable`)."""
    from .backends.triton.digest import key_words

    pools = [pool for pair in zip(k_caches, v_caches, strict=True) for pool in pair]
    words = key.words(key_words(pools), pools[0].device)
    if pools[0].device.type == "cpu":
        values = _nh_cpu(pools, pages, lens, words)
    else:
        from .backends.triton.digest import nh

        device = pools[0].device
        index = torch.tensor(pages, dtype=torch.int64, device=device)
        counts = torch.tensor(lens, dtype=torch.int64, device=device).clamp(0, pools[0].shape[1])
        found = nh(pools, index, counts, words).cpu().numpy()
        values = [row.tobytes() for row in found]
    out = []
    for value, n, context in zip(values, lens, contexts, strict=True):
        h = _hasher(value)
        h.update(context + int(n).to_bytes(4, "little") + len(context).to_bytes(4, "little"))
        out.append(h.hexdigest(length=DIGEST_BYTES))
    return out


def attest_pages(
    page_tags: torch.Tensor,
    owner,
    pages: Sequence[int],
    k_caches: Sequence[torch.Tensor],
    v_caches: Sequence[torch.Tensor],
    *,
    digests: bool = True,
    contexts: Sequence[bytes] | None = None,
    key: DigestKey | None = None,
) -> list[PageAttestation]:
    """The sender's attestation of ``pages`` for a request: ``owner`` is the owner each page must
    carry for it, an int or one per page (a prefix-cache hit carries the owner that wrote it);
    0 for a page the request does not hold there, which attests nothing whatever its tag says.

    ``page_tags``: ``[num_pages]`` or ``[num_layers, num_pages]`` (one row per layer of the
    pools). A page's ``valid_len`` is the smallest over the layers of its WRITTEN length for its
    owner (0 where a layer's tag is not WRITTEN for that owner). ``contexts``: one per page, for
    :func:`page_digest` (the receiver must pass the same). ``digests=False`` leaves the digests
    empty, for a deployment whose receivers commit by the lengths alone."""
    return _attest(page_tags, owner, pages, k_caches, v_caches, digests, contexts, key)()


def attest_pages_async(
    page_tags: torch.Tensor,
    owner,
    pages: Sequence[int],
    k_caches: Sequence[torch.Tensor],
    v_caches: Sequence[torch.Tensor],
    *,
    digests: bool = True,
    contexts: Sequence[bytes] | None = None,
    key: DigestKey | None = None,
) -> Future:
    """:func:`attest_pages` off the caller's thread: the arguments are checked and the tags read
    here (a ``ValueError`` or ``TypeError`` is raised here), the digests computed on kvattn's
    transfer thread; the future's result is the attestations."""
    return _transfer_thread().submit(
        _attest(page_tags, owner, pages, k_caches, v_caches, digests, contexts, key)
    )


def _attest(page_tags, owner, pages, k_caches, v_caches, digests, contexts, key):
    """A function that digests and returns the attestations, every check done and the tags read
    before it returns."""
    key = _key(key)
    num_pages, _ = _check_pools(k_caches, v_caches)
    check_tensor("page_tags", page_tags, dtypes=(torch.int64,))
    layers = len(k_caches)
    if page_tags.dim() not in (1, 2) or page_tags.shape[-1] != num_pages:
        raise ValueError(
            f"page_tags: expected shape ({num_pages},) or ({layers}, {num_pages}) (the pools' "
            f"pages, one row per layer), got {tuple(page_tags.shape)}"
        )
    if page_tags.dim() == 2 and page_tags.shape[0] != layers:
        # Fewer rows than layers would attest layers whose tags nobody read.
        raise ValueError(
            f"page_tags: expected one row per layer of the pools ({layers}), got "
            f"{page_tags.shape[0]} rows"
        )
    pages = _check_pages(pages, num_pages)
    owners = _check_owners(owner, len(pages))
    contexts = _check_contexts(contexts, len(pages))
    tags = page_tags if page_tags.dim() == 2 else page_tags[None]
    index = torch.tensor(pages, dtype=torch.int64, device=tags.device)
    rows = tags[:, index]  # [num_layers, P]
    expected = torch.tensor(owners, dtype=torch.int64, device=tags.device)  # [P]
    # Owner 0 holds nothing, even a tag whose owner field is 0.
    mine = (tag_state(rows) == STATE_WRITTEN) & (tag_owner(rows) == expected) & (expected > 0)
    # amin, not min: min's value-and-index reduction runs an OpenMP region on CPU tensors, whose
    # threads then spin and take the cores from the digest threads (measured: 11 -> 7 GB/s).
    lens = torch.where(mine, tag_valid_len(rows), 0).amin(dim=0).tolist()
    if not digests:
        return lambda: [PageAttestation(n, "") for n in lens]
    _check_keyable(k_caches, v_caches, key)
    return lambda: [
        PageAttestation(n, d)
        for n, d in zip(lens, _digests(k_caches, v_caches, pages, lens, contexts, key), strict=True)
    ]


def _check_keyable(k_caches, v_caches, key) -> None:
    """A keyed digest's pools, checked by the caller's thread, before any work is queued."""
    if key is not None:
        _keyable([pool for pair in zip(k_caches, v_caches) for pool in pair])


def _key(key) -> DigestKey | None:
    if key is not None and not isinstance(key, DigestKey):
        raise TypeError(
            f"key: expected a kvattn.transfer.DigestKey or None, got {type(key).__name__}"
        )
    return key


def _check_owners(owner, count: int) -> list[int]:
    """``owner``, an int or one per page, as one owner per page: an id, or 0 for none."""
    if isinstance(owner, torch.Tensor):
        if owner.dtype != torch.int64 or owner.dim() > 1:
            raise TypeError(
                f"owner: expected an int, a list of ints or a 0-D/1-D int64 tensor, got a "
                f"{owner.dim()}-D {str(owner.dtype).replace('torch.', '')} tensor"
            )
        owner = owner.tolist()
    if isinstance(owner, (list, tuple)):
        owners = _check_per_page("owner", owner, count)
        return [_owner_or_none(o, f"owner[{i}]") for i, o in enumerate(owners)]
    return [_owner_or_none(owner, "owner")] * count


def _owner_or_none(value, name: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value == 0:
        return 0
    return check_owner(value, name)


def verify_arrived(
    attested: Sequence[PageAttestation | None],
    pages: Sequence[int],
    k_caches: Sequence[torch.Tensor],
    v_caches: Sequence[torch.Tensor],
    *,
    check_bytes: bool = True,
    contexts: Sequence[bytes] | None = None,
    key: DigestKey | None = None,
) -> tuple[list[int], list[str | None]]:
    """The receiver's side: for each of its ``pages`` (whose bytes the transfer engine reported
    arrived) and the sender's attestation of the page it came from, the length to commit and
    None, or 0 and why not (``"not attested"``, ``"digest mismatch"``). ``check_bytes=False``
    commits by the attested lengths without recomputing digests (the ownership half of the
    rule only: bytes that differ go unnoticed). ``contexts``: as the sender's, one per page
    (derived here: a page that arrived in the wrong place, or for other tokens, then differs)."""
    return _verify(attested, pages, k_caches, v_caches, check_bytes, contexts, key)()


def verify_arrived_async(
    attested: Sequence[PageAttestation | None],
    pages: Sequence[int],
    k_caches: Sequence[torch.Tensor],
    v_caches: Sequence[torch.Tensor],
    *,
    check_bytes: bool = True,
    contexts: Sequence[bytes] | None = None,
    key: DigestKey | None = None,
) -> Future:
    """:func:`verify_arrived` off the caller's thread: the arguments are checked here, the digests
    computed on kvattn's transfer thread; the future's result is ``(lengths, reasons)``."""
    return _transfer_thread().submit(
        _verify(attested, pages, k_caches, v_caches, check_bytes, contexts, key)
    )


def _verify(attested, pages, k_caches, v_caches, check_bytes, contexts, key):
    """A function that digests the arrived pages and returns ``(lengths, reasons)``, every check
    done before it returns."""
    num_pages, page_size = _check_pools(k_caches, v_caches)
    pages = _check_pages(pages, num_pages)
    claims = _check_per_page("attested", attested, len(pages))
    for i, claim in enumerate(claims):
        if claim is not None and not isinstance(claim, PageAttestation):
            raise TypeError(
                f"attested[{i}]: expected a PageAttestation or None (PageAttestation.from_json "
                f"parses the wire form), got {type(claim).__name__}"
            )
    contexts = _check_contexts(contexts, len(pages))
    key = _key(key)
    lens: list[int] = []
    reasons: list[str | None] = []
    for claim in claims:
        if claim is None:
            lens.append(0)
            reasons.append("not attested")
        elif not 0 <= claim.valid_len <= page_size:
            lens.append(0)
            reasons.append(f"attested length {claim.valid_len} outside [0, {page_size}]")
        else:
            lens.append(claim.valid_len)
            reasons.append(None)
    todo = [j for j, why in enumerate(reasons) if why is None] if check_bytes else []
    if check_bytes:
        _check_keyable(k_caches, v_caches, key)

    def run():
        found = _digests(
            k_caches,
            v_caches,
            [pages[j] for j in todo],
            [lens[j] for j in todo],
            [contexts[j] for j in todo],
            key,
        )
        for j, digest in zip(todo, found, strict=True):
            if digest != claims[j].digest:
                lens[j], reasons[j] = 0, "digest mismatch"
        return lens, reasons

    return run


__all__ = [
    "DIGEST_BYTES",
    "DigestKey",
    "PageAttestation",
    "attest_pages",
    "attest_pages_async",
    "page_digest",
    "set_digest_threads",
    "verify_arrived",
    "verify_arrived_async",
]
