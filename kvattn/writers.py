"""Writers: the only code that changes page tags. Layout: :mod:`kvattn.layout`; tags: :mod:`kvattn.tags`.

The tag certifies the bytes, not the reservation (ownership.md section 4):

- :func:`reserve_pages` makes pages ``RESERVED`` for a new owner; reads of them fail.
- :func:`write_kv` writes new tokens' K/V into their slots and only then stamps the pages
  ``WRITTEN``, raising ``valid_len`` over the contiguous prefix it wrote.
- :func:`commit_pages` marks KV that arrived by another path (RDMA, a copy) as written, by the number
  of tokens the receiver accounted for.
- :func:`release_pages` makes pages ``FREE``; the bytes stay, the tag makes zeroing unnecessary.
- :func:`reassign_pages` hands written pages to a new owner id when the lease that wrote them ends
  while others still read them, so its late writes are refused.

While one owner holds a page its tag only grows (``RESERVED < WRITTEN(len) < WRITTEN(len + 1)`` as
int64 for the same owner), so the stamps are ``scatter_reduce(amax)``: concurrent stamps of one call
never lower ``valid_len``. Only reserve, reassign and release set a tag outright.

Everything here runs as device ops on the tensors' device with no host synchronisation; results are
device tensors.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .layout import check_kv_pools, check_last_dim_contiguous, check_page_tags, check_tensor
from .tags import (OWNER_MAX, OWNER_SHIFT, STATE_RESERVED, STATE_WRITTEN, VALID_LEN_SHIFT, WriteDrop,
                   held_by, tag_state, tag_valid_len)

_INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass
class WriteResult:
    """Outcome of :func:`write_kv` or :func:`commit_pages`, per item, in device memory.

    ``landed`` ``[n]`` bool: the item was written (and its page stamped). ``drop_reasons`` ``[n]``
    int8: a :class:`~kvattn.tags.WriteDrop` flag per refused item, 0 for landed items and padding.
    ``dropped`` 0-d int64: how many items were refused (padding is not counted).
    """

    landed: torch.Tensor
    drop_reasons: torch.Tensor
    dropped: torch.Tensor

    def dropped_count(self) -> int:
        """Number of refused items (synchronises)."""
        return int(self.dropped.item())


def _as_index(name: str, pages, device) -> torch.Tensor:
    if not isinstance(pages, torch.Tensor):
        pages = torch.as_tensor(pages, dtype=torch.int64)
    check_tensor(name, pages, ndim=1, dtypes=_INDEX_DTYPES)
    return pages.to(device=device, dtype=torch.int64)


def _as_owner(owner, n: int, device) -> torch.Tensor:
    """Owner ids as an int64 tensor of ``n``; a Python int is checked here, a tensor is trusted
    (an owner that holds no page simply matches none)."""
    if isinstance(owner, torch.Tensor):
        check_tensor("owner", owner, dtypes=(torch.int64,))
        if owner.dim() == 0:
            return owner.to(device).expand(n)
        if tuple(owner.shape) != (n,):
            raise ValueError(f"owner: expected an int or an int64 tensor of shape ({n},), "
                             f"got shape {tuple(owner.shape)}")
        return owner.to(device)
    if isinstance(owner, bool) or not isinstance(owner, int):
        raise TypeError(f"owner: expected an int or an int64 tensor, got {type(owner).__name__}")
    if not 1 <= owner <= OWNER_MAX:
        raise ValueError(f"owner: expected an id in [1, {OWNER_MAX}], got {owner}")
    return torch.full((n,), owner, dtype=torch.int64, device=device)


def _written(owner: torch.Tensor, valid_len: torch.Tensor) -> torch.Tensor:
    return (owner << OWNER_SHIFT) | (valid_len << VALID_LEN_SHIFT) | STATE_WRITTEN


def _masked_put(dst: torch.Tensor, index: tuple, values: torch.Tensor, ok: torch.Tensor) -> None:
    """``dst[index] = values`` for the rows where ``ok``, leaving every other element of ``dst`` as
    it was, with no host synchronisation.

    Refused rows are redirected to the first accepted row (same index, same value), so a refused row
    can never race an accepted write to the same element; if no row is accepted, every row writes
    back what its (clamped) index already holds. ``index`` entries must already be clamped in range.
    """
    # index_select with a 1-element index tensor: indexing with a 0-d tensor would call .item().
    first = torch.argmax(ok.to(torch.int8)).reshape(1)  # 0 when nothing is accepted
    any_ok = ok.any()
    row_ok = ok.view(-1, *([1] * (values.dim() - 1)))
    idx = tuple(torch.where(ok, i, torch.where(any_ok, i.index_select(0, first), i)) for i in index)
    fallback = torch.where(any_ok, values.index_select(0, first), dst[index].to(values.dtype))
    dst.index_put_(idx, torch.where(row_ok, values, fallback).to(dst.dtype))


def reserve_pages(page_tags: torch.Tensor, pages, owner: int) -> None:
    """Mark ``pages`` RESERVED for ``owner`` (allocation). Page ids must lie in
    ``[0, num_pages)``; they are checked on the host when given as a list or a CPU tensor."""
    pages = _pages_in_range(page_tags, pages)
    owners = _as_owner(owner, pages.numel(), page_tags.device)
    page_tags.index_put_((pages,), (owners << OWNER_SHIFT) | STATE_RESERVED)


def _pages_held(page_tags, pages, owner):
    """``(safe page ids, their tags, in range, held by owner)`` for a page-level writer; out-of-range
    ids are clamped for the reads and never counted as held."""
    check_page_tags(page_tags, page_tags.shape[0])
    num_pages = page_tags.shape[0]
    pages = _as_index("pages", pages, page_tags.device)
    owners = _as_owner(owner, pages.numel(), page_tags.device)
    in_range = (pages >= 0) & (pages < num_pages)
    safe = pages.clamp(0, num_pages - 1)
    tag = page_tags[safe]
    return safe, tag, in_range, in_range & held_by(tag, owners)


def reassign_pages(page_tags: torch.Tensor, pages, owner: int, new_owner: int) -> WriteResult:
    """Hand ``pages`` held by ``owner`` over to ``new_owner``, keeping their state and ``valid_len``.

    For a lease that ends while other leases still read pages it wrote (a shared prefix): under a
    new owner id the readers keep reading the same bytes, and a late write of the ended lease no
    longer finds its owner on the page (``NOT_HELD``). Pages ``owner`` does not hold are left as they
    are and counted.
    """
    safe, tag, in_range, held = _pages_held(page_tags, pages, owner)
    heirs = _as_owner(new_owner, safe.numel(), page_tags.device)
    _masked_put(page_tags, (safe,), (heirs << OWNER_SHIFT) | (tag & ((1 << OWNER_SHIFT) - 1)), held)
    reasons = torch.where(held, 0, int(WriteDrop.NOT_HELD))
    reasons = torch.where(in_range, reasons, int(WriteDrop.OUT_OF_RANGE)).to(torch.int8)
    return WriteResult(held, reasons, (~held).sum())


def release_pages(page_tags: torch.Tensor, pages) -> None:
    """Mark ``pages`` FREE. The K/V bytes are left as they are."""
    pages = _pages_in_range(page_tags, pages)
    page_tags.index_fill_(0, pages, 0)


def _pages_in_range(page_tags, pages) -> torch.Tensor:
    check_page_tags(page_tags, page_tags.shape[0])
    on_host = not isinstance(pages, torch.Tensor) or pages.device.type == "cpu"
    pages = _as_index("pages", pages, page_tags.device)
    if on_host and pages.numel():
        lo, hi = int(pages.min()), int(pages.max())
        if lo < 0 or hi >= page_tags.shape[0]:
            bad = lo if lo < 0 else hi
            raise ValueError(f"pages: expected page ids in [0, {page_tags.shape[0]}), got {bad}")
    return pages


def commit_pages(page_tags: torch.Tensor, pages, owner, valid_lens, page_size: int) -> WriteResult:
    """Transfer receive: mark ``pages`` WRITTEN for ``owner`` with ``valid_lens`` leading slots.

    ``valid_lens`` must be the number of tokens the receiver accounted for (bytes it saw arrive),
    never a count the sender claimed. A page is committed only if ``owner`` holds it (RESERVED or
    WRITTEN for ``owner``) and ``0 <= valid_len <= page_size``; otherwise it is left as it was and
    counted in the result (``NOT_HELD``, ``BAD_LENGTH``, ``OUT_OF_RANGE``). A commit never lowers
    a page's ``valid_len``: slots already marked written for this owner were written for it.
    """
    safe, _, in_range, held = _pages_held(page_tags, pages, owner)
    owners = _as_owner(owner, safe.numel(), page_tags.device)
    lens = _as_index("valid_lens", valid_lens, page_tags.device)
    if lens.numel() != safe.numel():
        raise ValueError(f"valid_lens: expected {safe.numel()} lengths (one per page), "
                         f"got {lens.numel()}")
    good_len = (lens >= 0) & (lens <= page_size)
    landed = held & good_len
    reasons = torch.where(good_len, 0, int(WriteDrop.BAD_LENGTH))
    reasons = torch.where(held, reasons, int(WriteDrop.NOT_HELD))
    reasons = torch.where(in_range, reasons, int(WriteDrop.OUT_OF_RANGE)).to(torch.int8)
    stamp = torch.where(landed, _written(owners, lens.clamp(0, page_size)), 0)
    page_tags.scatter_reduce_(0, safe, stamp, reduce="amax", include_self=True)
    return WriteResult(landed, reasons, (~landed).sum())


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, page_tags: torch.Tensor, owner, *,
             backend: str = "auto") -> WriteResult:
    """Append new tokens' K/V to their page slots, then stamp the pages (``reshape_and_cache``).

    ``k``, ``v``: ``[T, num_kv_heads, head_dim]``, the cache dtype. ``slot_mapping``: ``[T]`` int32/
    int64, ``page * page_size + slot`` per token; a negative entry is padding and is skipped without
    being counted. ``owner``: the writer's lease id, an int or an int64 tensor ``[T]`` (one per
    token). Pools and tags as in :mod:`kvattn.layout`.

    A token lands only if all hold, else nothing of it is written and it is counted as dropped:

    1. its page lies in ``[0, num_pages)`` (else ``OUT_OF_RANGE``);
    2. its owner holds the page: the tag is RESERVED or WRITTEN for that owner (else ``NOT_HELD``;
       this is the late writer whose lease was released and whose pages now belong to another);
    3. it does not leave a hole. Tokens are grouped into *runs*: maximal stretches of consecutive
       entries of ``slot_mapping`` that pass 1-2 and fill consecutive slots of one page. A run lands
       when its first slot is at most the page's current ``valid_len`` (it overwrites written slots
       and/or extends the written prefix); a run that starts past ``valid_len`` would leave unwritten
       slots before it and is dropped whole (``GAP``).

    After the K/V bytes are stored, each page's ``valid_len`` becomes the largest end of a landed run
    on it (never lower than before), so every slot below ``valid_len`` was written for the owner.
    Consequences: tokens out of slot order break a run, and a run that then starts past the prefix is
    dropped rather than stamped; a page's new tokens must appear as one run in slot order to extend
    it, which is how engines lay out ``slot_mapping`` (a sequence's tokens are consecutive). Two
    landed tokens aimed at the same slot race as in vLLM: each element of the slot holds one of the
    two tokens' values, not necessarily the same token's for every element (the owner is the same
    either way; a refused token never lands).

    ``backend``: ``"torch"`` composes the steps from PyTorch ops (any device); ``"triton"`` runs
    :mod:`kvattn.backends.triton.stamp_writer`; ``"cuda"`` the CUDA writer of csrc/ (``"cuda_sim"``:
    the same source on the CPU harness). ``"auto"`` takes ``cuda`` for CUDA tensors when it is
    built, else ``triton``, and ``torch`` for CPU tensors (the interpreter would run one slow
    program per token). All give the same result, except in that race.
    """
    owners = validate_write_kv(k, v, k_cache, v_cache, slot_mapping, page_tags, owner)
    if backend not in _WRITERS:
        raise ValueError(f"backend: expected one of {list(_WRITERS)}, got {backend!r}")
    if backend == "auto":
        backend = _auto_writer(k_cache.device)
    if slot_mapping.shape[0] == 0:
        empty = torch.zeros(0, dtype=torch.bool, device=k_cache.device)
        return WriteResult(empty, empty.to(torch.int8),
                           torch.zeros((), dtype=torch.int64, device=k_cache.device))
    return _WRITERS[backend]()(k, v, k_cache, v_cache, slot_mapping, page_tags, owners)


def validate_write_kv(k, v, k_cache, v_cache, slot_mapping, page_tags, owner) -> torch.Tensor:
    """The argument checks of :func:`write_kv`; returns the owners as an int64 tensor ``[T]``."""
    check_kv_pools(k_cache, v_cache)
    device = k_cache.device
    num_pages, page_size, num_kv_heads, head_dim = k_cache.shape
    check_page_tags(page_tags, num_pages, device)
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=_INDEX_DTYPES, device=device)
    num_tokens = slot_mapping.shape[0]
    for name, t in (("k", k), ("v", v)):
        check_tensor(name, t, ndim=3, dtypes=(k_cache.dtype,), device=device)
        if tuple(t.shape) != (num_tokens, num_kv_heads, head_dim):
            raise ValueError(f"{name}: expected shape ({num_tokens}, {num_kv_heads}, {head_dim}) "
                             f"(tokens of slot_mapping, heads and head_dim of the cache), "
                             f"got {tuple(t.shape)}")
        check_last_dim_contiguous(name, t)
    return _as_owner(owner, num_tokens, device)


def _auto_writer(device: torch.device) -> str:
    if device.type != "cuda":
        return "torch"
    from .backends import cuda
    return "cuda" if cuda._C is not None else "triton"


def _cuda_writer():
    from .backends.cuda import write_kv as cuda_write_kv
    return cuda_write_kv


def _cuda_sim_writer():
    from .backends.cuda_sim import write_kv as sim_write_kv
    return sim_write_kv


def _triton_writer():
    from .backends.triton.stamp_writer import write_kv as triton_write_kv

    def run(k, v, k_cache, v_cache, slot_mapping, page_tags, owners) -> WriteResult:
        landed, reasons = triton_write_kv(k, v, k_cache, v_cache, slot_mapping, page_tags, owners)
        return WriteResult(landed, reasons, (reasons != 0).sum())
    return run


def _torch_write_kv(k, v, k_cache, v_cache, slot_mapping, page_tags, owners) -> WriteResult:
    """The writer's steps as PyTorch ops (validated arguments)."""
    num_tokens = slot_mapping.shape[0]
    device = k_cache.device
    page_size = k_cache.shape[1]
    num_pages = k_cache.shape[0]
    slots = slot_mapping.long()
    padding = slots < 0
    page = torch.div(slots, page_size, rounding_mode="floor")
    slot = slots - page * page_size
    in_range = ~padding & (page < num_pages)
    safe_page = page.clamp(0, num_pages - 1)
    tag = page_tags[safe_page]
    held = in_range & held_by(tag, owners)
    prefix = torch.where(tag_state(tag) == STATE_WRITTEN, tag_valid_len(tag), 0)

    # A token continues its predecessor's run when both are held and it fills the next slot of the
    # same page; the run's first slot then decides (cummax carries the index of the run's start).
    index = torch.arange(num_tokens, device=device)
    continues = torch.zeros_like(held)
    continues[1:] = held[1:] & held[:-1] & (page[1:] == page[:-1]) & (slot[1:] == slot[:-1] + 1)
    run_start = torch.cummax(torch.where(continues, 0, index), dim=0).values
    landed = held & (slot[run_start] <= prefix)

    reasons = torch.where(landed | padding, 0, int(WriteDrop.GAP))
    reasons = torch.where(held | padding, reasons, int(WriteDrop.NOT_HELD))
    reasons = torch.where(in_range | padding, reasons, int(WriteDrop.OUT_OF_RANGE)).to(torch.int8)

    safe_slot = slot.clamp(0, page_size - 1)
    _masked_put(k_cache, (safe_page, safe_slot), k, landed)
    _masked_put(v_cache, (safe_page, safe_slot), v, landed)
    stamp = torch.where(landed, _written(owners, slot + 1), 0)
    page_tags.scatter_reduce_(0, safe_page, stamp, reduce="amax", include_self=True)
    return WriteResult(landed, reasons, (reasons != 0).sum())


# backend name -> function returning the implementation (imported on first use)
_WRITERS = {"auto": None, "torch": lambda: _torch_write_kv, "triton": _triton_writer,
            "cuda": _cuda_writer, "cuda_sim": _cuda_sim_writer}
