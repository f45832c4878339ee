"""Writers: the only code that changes page tags. Layout: :mod:`kvattn.layout`; tags: :mod:`kvattn.tags`.

The tag certifies the bytes, not the reservation (docs/ownership.md section 4):

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
device tensors. :func:`write_kv` runs on the backend the registry (:mod:`kvattn.backends`) picks;
the page-level writers are a few PyTorch ops on any device.
"""
from __future__ import annotations

import torch

from . import backends
from .backends.pytorch import masked_put, written
from .layout import check_page_tags, check_tensor
from .report import WriteResult
from .tags import OWNER_SHIFT, STATE_RESERVED, WriteDrop, held_by
from .write_args import INDEX_DTYPES, owner_ids, validate_write_kv


def _as_index(name: str, pages, device) -> torch.Tensor:
    if not isinstance(pages, torch.Tensor):
        pages = torch.as_tensor(pages, dtype=torch.int64)
    check_tensor(name, pages, ndim=1, dtypes=INDEX_DTYPES)
    return pages.to(device=device, dtype=torch.int64)


def reserve_pages(page_tags: torch.Tensor, pages, owner: int) -> None:
    """Mark ``pages`` RESERVED for ``owner`` (allocation). Page ids must lie in
    ``[0, num_pages)``; they are checked on the host when given as a list or a CPU tensor."""
    pages = _pages_in_range(page_tags, pages)
    owners = owner_ids(owner, pages.numel(), page_tags.device)
    page_tags.index_put_((pages,), (owners << OWNER_SHIFT) | STATE_RESERVED)


def _pages_held(page_tags, pages, owner):
    """``(safe page ids, their tags, in range, held by owner)`` for a page-level writer; out-of-range
    ids are clamped for the reads and never counted as held."""
    check_page_tags(page_tags, page_tags.shape[0])
    num_pages = page_tags.shape[0]
    pages = _as_index("pages", pages, page_tags.device)
    owners = owner_ids(owner, pages.numel(), page_tags.device)
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
    heirs = owner_ids(new_owner, safe.numel(), page_tags.device)
    masked_put(page_tags, (safe,), (heirs << OWNER_SHIFT) | (tag & ((1 << OWNER_SHIFT) - 1)), held)
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
    owners = owner_ids(owner, safe.numel(), page_tags.device)
    lens = _as_index("valid_lens", valid_lens, page_tags.device)
    if lens.numel() != safe.numel():
        raise ValueError(f"valid_lens: expected {safe.numel()} lengths (one per page), "
                         f"got {lens.numel()}")
    good_len = (lens >= 0) & (lens <= page_size)
    landed = held & good_len
    reasons = torch.where(good_len, 0, int(WriteDrop.BAD_LENGTH))
    reasons = torch.where(held, reasons, int(WriteDrop.NOT_HELD))
    reasons = torch.where(in_range, reasons, int(WriteDrop.OUT_OF_RANGE)).to(torch.int8)
    stamp = torch.where(landed, written(owners, lens.clamp(0, page_size)), 0)
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

    ``backend``: picked by the registry, :mod:`kvattn.backends`, like the readers' (a named backend
    that cannot run the inputs raises ``ValueError`` with its reason). ``"torch"`` composes the
    steps from PyTorch ops (any device); ``"triton"`` runs
    :mod:`kvattn.backends.triton.stamp_writer`; ``"cuda"`` the CUDA writer of csrc/ (``"cuda_sim"``:
    the same source on the CPU harness). ``"auto"`` takes ``cuda`` for CUDA tensors when it is
    built, else ``triton``, and ``torch`` for CPU tensors (the interpreter would run one slow
    program per token). All give the same result, except in that race.
    """
    args = validate_write_kv(k, v, k_cache, v_cache, slot_mapping, page_tags, owner)
    impl = backends.select(args, backend, op="write_kv")
    if args.num_tokens == 0:
        return WriteResult.empty(k_cache.device)
    return impl.write_kv(args)
