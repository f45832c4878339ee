"""Writers: the only code that changes page tags. Layout: :mod:`kvattn.layout`; tags: :mod:`kvattn.tags`.

The tag certifies the bytes, not the reservation (docs/ownership.md section 4):

- :func:`reserve_pages` makes pages ``RESERVED`` for a new owner; reads of them fail.
- :func:`write_kv` writes new tokens' K/V into their slots and only then stamps the pages
  ``WRITTEN``, raising ``valid_len`` over the contiguous prefix it wrote.
- :func:`commit_pages` marks KV that arrived by another path (RDMA, a copy) as written, by the number
  of tokens the receiver accounted for.
- :func:`release_pages` makes pages ``FREE``; the bytes stay, the tag makes zeroing unnecessary.
  Given an ``owner``, only the pages that owner still holds are released.
- :func:`reassign_pages` hands written pages to a new owner id when the lease that wrote them ends
  while others still read them, so its late writes are refused.

While one owner holds a page its tag only grows (``RESERVED < WRITTEN(len) < WRITTEN(len + 1)`` as
int64 for the same owner), so the stamps are ``scatter_reduce(amax)``: concurrent stamps of one call
never lower ``valid_len``. Only reserve, reassign and release set a tag outright.

Everything here runs as device ops on the tensors' device with no host synchronisation; results are
device tensors. :func:`write_kv` runs on the backend the registry (:mod:`kvattn.backends`) picks;
the page-level writers are a few PyTorch ops on any device. No writer touches an element it does
not write: a refused token or page is never read back and stored again, so a concurrent writer's
fresh bytes or stamp cannot be undone (:func:`kvattn.backends.torch.writer.put_rows`).

Tags for many layers (an engine's pages are one block of every layer): :func:`reserve_pages` and
:func:`release_pages` also take ``page_tags`` of shape ``[num_layers, num_pages]`` (each row one
layer's contiguous tag array, what the readers take), and apply to page ``p`` of every layer in one
call. The rows must not overlap in memory (``ValueError`` otherwise, as for pools whose pages do).

Generations: :func:`reserve_pages`, :func:`reassign_pages` and :func:`release_pages`, the writers
that set tags outright (and so may take a page from its owner), advance a counter per tag storage,
:func:`tag_generation`. A :class:`kvattn.PageVerdict` resolved before such a write is stale, and a
call given it checks every page itself (docs/ownership.md section 9). :func:`write_kv` and
:func:`commit_pages` only raise a held page's ``valid_len`` and advance nothing: a verdict resolved
before them is conservative, never wrong.

Malformed values (``validate``, :mod:`kvattn.write_args`): owner ids outside ``[1, OWNER_MAX]`` and
(for reserve and release) page ids outside the pool raise ``ValueError`` where the values are on
the host (ints, lists, CPU tensors; any tensor with ``validate=True``). Unchecked (device tensors by
default, ``validate=False``) the writers fail closed on the same values: an owner outside the range
holds no page (``NOT_HELD``) and is never written into a tag (reserve and reassign make such a
page FREE instead), an out-of-range page id changes nothing.
"""

from __future__ import annotations

import itertools
import threading

import torch

from . import backends
from .backends.torch.writer import max_rows, put_rows, reserved, written
from .layout import (
    MAX_PAGE_SIZE,
    check_apart,
    check_distinct_elements,
    check_page_tags,
    check_tensor,
    is_page_size,
)
from .report import WriteResult
from .tags import FREE_TAG, OWNER_SHIFT, WriteDrop, held_by, valid_owner
from .write_args import INDEX_DTYPES, on_host, owner_ids, validate_write_kv

_generation_lock = threading.Lock()
_generation_clock = itertools.count(1)
_generations: dict[int, int] = {}


def tag_generation(page_tags: torch.Tensor) -> int:
    """The generation of the storage holding ``page_tags`` (any row of a layered array): a value
    that changes whenever a reserve, reassign or release writes into it (0 before any has)."""
    return _generations.get(page_tags.untyped_storage().data_ptr(), 0)


def _advance_generation(page_tags: torch.Tensor) -> None:
    with _generation_lock:
        _generations[page_tags.untyped_storage().data_ptr()] = next(_generation_clock)


def _as_index(name: str, values, page_tags) -> torch.Tensor:
    if not isinstance(values, torch.Tensor):
        values = torch.as_tensor(values, dtype=torch.int64)
    check_tensor(name, values, ndim=1, dtypes=INDEX_DTYPES)
    check_apart(name, values, dict(page_tags=page_tags))
    return values.to(device=page_tags.device, dtype=torch.int64)


def _layer_rows(page_tags) -> torch.Tensor:
    """``page_tags`` as ``[num_layers, num_pages]``: a 1-D tag array is one layer."""
    if isinstance(page_tags, torch.Tensor) and page_tags.dim() == 2:
        check_tensor("page_tags", page_tags, ndim=2, dtypes=(torch.int64,))
        if page_tags.shape[0] < 1 or page_tags.shape[1] < 1:
            raise ValueError(
                f"page_tags: expected at least one layer and one page, got shape "
                f"{tuple(page_tags.shape)}"
            )
        if page_tags.shape[1] > 1 and page_tags.stride(1) != 1:
            raise ValueError(
                f"page_tags: expected contiguous rows (one per layer, stride 1), got "
                f"strides {page_tags.stride()}"
            )
        # Rows sharing words (stride 0, or folded onto each other) would let a write for one
        # layer's page land in another layer's page.
        check_distinct_elements("page_tags", page_tags)
        return page_tags
    check_page_tags(page_tags, page_tags.shape[0] if isinstance(page_tags, torch.Tensor) else 0)
    return page_tags[None]


def _page_ids(page_tags, pages, validate) -> tuple[torch.Tensor, torch.Tensor]:
    """``(page ids clamped into the pool, in range)`` for a writer that sets tags outright; page ids
    outside the pool raise ValueError where :func:`~kvattn.write_args.on_host` says so."""
    num_pages = page_tags.shape[-1]
    checked = on_host(pages, validate)
    pages = _as_index("pages", pages, page_tags)
    if checked and pages.numel():
        lo, hi = int(pages.min()), int(pages.max())
        if lo < 0 or hi >= num_pages:
            bad = lo if lo < 0 else hi
            raise ValueError(f"pages: expected page ids in [0, {num_pages}), got {bad}")
    return pages.clamp(0, num_pages - 1), (pages >= 0) & (pages < num_pages)


def _every_layer(rows: torch.Tensor, safe: torch.Tensor) -> tuple:
    """``(layer, page)`` index pairs of ``safe``'s pages in every row, page-major (``[n * L]``)."""
    layers = torch.arange(rows.shape[0], device=rows.device)
    return layers.repeat(safe.numel()), safe.repeat_interleave(rows.shape[0])


def reserve_pages(page_tags: torch.Tensor, pages, owner, *, validate: bool | None = None) -> None:
    """Mark ``pages`` RESERVED for ``owner`` (allocation), whatever they held before.

    ``page_tags``: ``[num_pages]``, or ``[num_layers, num_pages]`` to reserve the pages in every
    layer at once. ``owner``: an int, or an int64 tensor (0-d or one per page). Page ids must lie in
    ``[0, num_pages)`` and owners in ``[1, OWNER_MAX]``: ``ValueError`` where the values are on the
    host (a list, an int, CPU tensors) or with ``validate=True``. Unchecked (device tensors by
    default, ``validate=False``), an out-of-range page id changes nothing, and a page whose owner is
    outside ``[1, OWNER_MAX]`` becomes FREE: its previous holder loses it as with a valid owner,
    nobody holds it, and no tag carries an impossible owner.
    """
    rows = _layer_rows(page_tags)
    safe, in_range = _page_ids(rows, pages, validate)
    owners = owner_ids(owner, safe.numel(), rows.device, validate=validate)
    check_apart("owner", owners, dict(page_tags=page_tags))
    tags = torch.where(valid_owner(owners), reserved(owners), FREE_TAG)
    width = rows.shape[0]
    _advance_generation(rows)
    put_rows(
        rows,
        _every_layer(rows, safe),
        tags.repeat_interleave(width),
        in_range.repeat_interleave(width),
    )


def _pages_held(page_tags, pages, owner, validate):
    """``(safe page ids, their tags, owners, in range, held by owner)`` for a page-level writer;
    out-of-range ids are clamped for the reads and never counted as held."""
    check_page_tags(page_tags, page_tags.shape[0])
    num_pages = page_tags.shape[0]
    pages = _as_index("pages", pages, page_tags)
    owners = owner_ids(owner, pages.numel(), page_tags.device, validate=validate)
    check_apart("owner", owners, dict(page_tags=page_tags))
    in_range = (pages >= 0) & (pages < num_pages)
    safe = pages.clamp(0, num_pages - 1)
    tag = page_tags[safe]
    return safe, tag, owners, in_range, in_range & held_by(tag, owners)


def reassign_pages(
    page_tags: torch.Tensor, pages, owner, new_owner, *, validate: bool | None = None
) -> WriteResult:
    """Hand ``pages`` held by ``owner`` over to ``new_owner``, keeping their state and ``valid_len``.

    For a lease that ends while other leases still read pages it wrote (a shared prefix): under a
    new owner id the readers keep reading the same bytes, and a late write of the ended lease no
    longer finds its owner on the page (``NOT_HELD``). Pages ``owner`` does not hold are left as they
    are, untouched, and counted. Owners are checked as in :func:`reserve_pages`; unchecked, a page
    whose ``new_owner`` is outside ``[1, OWNER_MAX]`` becomes FREE (the ended lease loses it, its
    readers are refused) and is counted ``NOT_HELD`` (the heir cannot hold it).
    """
    safe, tag, _, in_range, held = _pages_held(page_tags, pages, owner, validate)
    heirs = owner_ids(
        new_owner, safe.numel(), page_tags.device, name="new_owner", validate=validate
    )
    check_apart("new_owner", heirs, dict(page_tags=page_tags))
    kept = tag & ((1 << OWNER_SHIFT) - 1)
    handed = torch.where(valid_owner(heirs), (heirs << OWNER_SHIFT) | kept, FREE_TAG)
    _advance_generation(page_tags)
    put_rows(page_tags, (safe,), handed, held)
    landed = held & valid_owner(heirs)
    reasons = torch.where(landed, 0, int(WriteDrop.NOT_HELD))
    reasons = torch.where(in_range, reasons, int(WriteDrop.OUT_OF_RANGE)).to(torch.int8)
    return WriteResult(landed, reasons, (~landed).sum())


def release_pages(
    page_tags: torch.Tensor, pages, owner=None, *, validate: bool | None = None
) -> WriteResult:
    """Mark ``pages`` FREE. The K/V bytes are left as they are.

    ``page_tags``: ``[num_pages]``, or ``[num_layers, num_pages]`` for the pages of every layer.
    Without ``owner`` every page in range is released. With ``owner`` (an int or an int64 tensor,
    0-d or one per page; the lease that ends) only pages that owner still holds (RESERVED or
    WRITTEN for it) become FREE: a page meanwhile reserved for, or shared under, another owner is
    left as it is and counted ``NOT_HELD``, so an engine can release a finished request's pages
    without freeing one that another request holds now. With many layers an item is one page of one
    layer (page-major: ``[len(pages) * num_layers]``). Page ids are checked as in
    :func:`reserve_pages` (unchecked, an out-of-range id changes nothing and counts
    ``OUT_OF_RANGE``); owners as there (unchecked, an owner outside ``[1, OWNER_MAX]`` holds
    nothing).
    """
    rows = _layer_rows(page_tags)
    safe, in_range = _page_ids(rows, pages, validate)
    layer, page = _every_layer(rows, safe)
    width = rows.shape[0]
    in_range = in_range.repeat_interleave(width)
    landed = in_range
    if owner is not None:
        owners = owner_ids(owner, safe.numel(), rows.device, validate=validate)
        check_apart("owner", owners, dict(page_tags=page_tags))
        landed = in_range & held_by(rows[layer, page], owners.repeat_interleave(width))
    _advance_generation(rows)
    put_rows(rows, (layer, page), torch.zeros_like(page), landed)
    reasons = torch.where(landed, 0, int(WriteDrop.NOT_HELD))
    reasons = torch.where(in_range, reasons, int(WriteDrop.OUT_OF_RANGE)).to(torch.int8)
    return WriteResult(landed, reasons, (~landed).sum())


def check_page_size(page_size) -> int:
    """``page_size`` given apart from the pools (:func:`commit_pages`): an int in
    ``[1, MAX_PAGE_SIZE]``, as the pools' dimension 1 must be."""
    if isinstance(page_size, bool) or not isinstance(page_size, int):
        raise TypeError(
            f"page_size: expected an int (the pools' dim 1), got {type(page_size).__name__}"
        )
    if not is_page_size(page_size):
        raise ValueError(
            f"page_size: expected an int in [1, {MAX_PAGE_SIZE}] (the pools' "
            f"dim 1), got {page_size}"
        )
    return page_size


def commit_pages(
    page_tags: torch.Tensor,
    pages,
    owner,
    valid_lens,
    page_size: int,
    *,
    validate: bool | None = None,
) -> WriteResult:
    """Transfer receive: mark ``pages`` WRITTEN for ``owner`` with ``valid_lens`` leading slots.

    ``valid_lens`` must be the number of tokens the receiver accounted for (bytes it saw arrive),
    never a count the sender claimed. A page is committed only if ``owner`` holds it (RESERVED or
    WRITTEN for ``owner``) and ``0 <= valid_len <= page_size``; otherwise it is left as it was and
    counted in the result (``NOT_HELD``, ``BAD_LENGTH``, ``OUT_OF_RANGE``). A commit never lowers
    a page's ``valid_len``: slots already marked written for this owner were written for it.
    ``page_size`` (the pools' dimension 1, 1 to 1024 tokens) is checked; owners as in
    :func:`reserve_pages` (unchecked, an owner outside ``[1, OWNER_MAX]`` holds nothing:
    ``NOT_HELD``).
    """
    page_size = check_page_size(page_size)
    safe, _, owners, in_range, held = _pages_held(page_tags, pages, owner, validate)
    lens = _as_index("valid_lens", valid_lens, page_tags)
    if lens.numel() != safe.numel():
        raise ValueError(
            f"valid_lens: expected {safe.numel()} lengths (one per page), got {lens.numel()}"
        )
    good_len = (lens >= 0) & (lens <= page_size)
    landed = held & good_len
    reasons = torch.where(good_len, 0, int(WriteDrop.BAD_LENGTH))
    reasons = torch.where(held, reasons, int(WriteDrop.NOT_HELD))
    reasons = torch.where(in_range, reasons, int(WriteDrop.OUT_OF_RANGE)).to(torch.int8)
    max_rows(page_tags, safe, written(owners, lens.clamp(0, page_size)), landed)
    return WriteResult(landed, reasons, (~landed).sum())


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    page_tags: torch.Tensor,
    owner,
    *,
    backend: str = "auto",
    validate: bool | None = None,
    k_scale=None,
    v_scale=None,
    fp8_rounding: str = "nearest",
) -> WriteResult:
    """Append new tokens' K/V to their page slots, then stamp the pages (``reshape_and_cache``).

    ``k``, ``v``: ``[T, num_kv_heads, head_dim]`` (``v``: the head dim of ``v_cache``), the cache
    dtype (or, for fp8 pools, float16/bfloat16/float32 to quantise: see ``k_scale``).
    ``slot_mapping``: ``[T]`` int32/
    int64 (any stride), ``page * page_size + slot`` per token; a negative entry is padding and is
    skipped without being counted. ``owner``: the writer's lease id, an int or an int64 tensor
    ``[T]`` (one per
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

    ``validate``: check a tensor ``owner``'s ids on the host (default: when it is a CPU tensor);
    unchecked, an owner outside ``[1, OWNER_MAX]`` holds no page and its tokens drop ``NOT_HELD``.
    ``slot_mapping`` and the owners must share no memory with the pools or the tags, nor the tags with
    the pools (:mod:`kvattn.layout`): the kernels read them again after storing K/V.

    ``k_scale``, ``v_scale``: with fp8 pools (``float8_e4m3fn``/``float8_e5m2``) and wider ``k``/``v``,
    the dequantisation scales of :mod:`kvattn.variants` (a float, or a float32 tensor ``[]``,
    ``[1]`` or ``[num_kv_heads]`` on the pools' device; default 1): the stored element is ``x /
    scale`` computed in float32 (correctly rounded), saturated to the format's largest finite value
    (448 for e4m3, 57344 for e5m2, as vLLM's cache writer does: e4m3fn has no infinity), then
    rounded to nearest even; NaN is stored as the positive NaN code ``0x7f``.
    ``fp8_rounding="toward_zero"`` is vLLM's CPU cache writer's rule instead (so that an engine's
    cache holds the bytes its own writer would store): the same quotient and saturation, rounded
    toward zero, a quotient below float32's normal range (``2**-126``) stored as ``+0`` (a larger
    one that rounds to zero keeps its sign), NaN saturated to the largest finite value. vLLM stores
    a negative float32-subnormal quotient as ``-0``: the only bytes that differ, both zero (a
    device's division may flush such a quotient, so the rule cannot depend on it). Every writer
    that quantises stores the same bytes for a rule. ``k``/``v`` already in the pools' fp8 dtype
    are stored as they are (then the scales must be None). Scales with non-fp8 pools raise
    ``ValueError``. The tags are those of any write.

    ``backend``: picked by the registry, :mod:`kvattn.backends`, like the readers' (a named backend
    that cannot run the inputs raises ``ValueError`` with its reason). ``"torch"`` composes the
    steps from PyTorch ops (any device); ``"triton"`` runs
    :mod:`kvattn.backends.triton.paged_write_kv`; ``"cuda"`` the CUDA writer of csrc/ (``"cuda_sim"``:
    the same source on the CPU harness); ``"cpu"`` the writer compiled for the CPU
    (csrc/cpu/write_kv_cpu.h; pools of the tokens' dtype, no fp8). ``"auto"`` takes ``cuda`` for
    CUDA tensors when it is built, else ``triton``, and for CPU tensors ``cpu`` where it is built
    and accepts them, else ``torch`` (the interpreter would run one slow program per token). All
    give the same result, except in that race.
    """
    args = validate_write_kv(
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        page_tags,
        owner,
        validate=validate,
        k_scale=k_scale,
        v_scale=v_scale,
        fp8_rounding=fp8_rounding,
    )
    impl = backends.select(args, backend, op="write_kv")
    if args.num_tokens == 0:
        return WriteResult.empty(k_cache.device)
    return impl.write_kv(args)
