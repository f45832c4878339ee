"""Resolve once per forward: the block table judged against every layer's tags before a decode
step, so that each layer's attention reads a verdict instead of the table and the tags
(docs/ownership.md section 9).

A per-call check costs each layer a dependent chain per page (block-table entry, then the page's
tag, then its K/V). A decode step's layers read the same pages for the same owners; only the new
token's slot changes between them, as each layer writes it. :func:`resolve_pages` runs once per
step and packs, per logical page, the page id and the slots readable in *every* layer; a layer's
:func:`kvattn.paged_decode` given that :class:`PageVerdict` loads one entry per page, and checks the
new token's page against its own tags.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import reference
from .layout import _check_index_tensors, check_tensor, is_page_size
from .report import OwnershipReport
from .writers import _layer_rows, tag_generation


@dataclass(frozen=True)
class PageVerdict:
    """What :func:`resolve_pages` found for one decode step; pass it as ``verdict=`` to each
    layer's :func:`kvattn.paged_decode`.

    - ``entries`` ``[B, max_pages]`` int64: per logical page ``page << 32 | readable``, the
      physical page and how many of its leading slots every layer's tag certifies for the expected
      owner, within the tokens before the new one (the extend's effective table has the same
      form); page -1 and 0 readable for a page the step does not read or whose id lies outside
      the pool.
    - ``fresh`` ``[B]`` int64: the entry of each sequence's new-token page again (its column of
      ``entries``; page -1 where the new token lies outside the table), so that a kernel can load
      that page's tag without waiting for the length first.
    - ``report``: the step's :class:`~kvattn.OwnershipReport`, in device memory. Each call given
      the verdict returns it, after adding the new token's page if that call's tag refuses it.

    The rest records what it was resolved against, which a call must match
    (:func:`usable`): the tag array (``[layers, num_pages]`` or one row), its generation
    (:func:`kvattn.writers.tag_generation`), the block table, lengths and expected owners, the
    page size and the window.
    """

    entries: torch.Tensor
    fresh: torch.Tensor
    report: OwnershipReport
    page_tags: torch.Tensor
    generation: int
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    expected: torch.Tensor
    page_size: int
    window_left: int


def resolve_pages(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_tags: torch.Tensor,
    expected: torch.Tensor,
    *,
    page_size: int,
    window_left: int = -1,
    backend: str = "auto",
) -> PageVerdict:
    """Judge a decode step's pages once, for every layer (docs/ownership.md section 9).

    Call it before the step's first attention, with the tags as they are before any layer writes
    the new tokens (or after some have: a slot counts as readable only where every layer's tag
    certifies it). Sequence ``b``'s new token sits at position ``seq_lens[b] - 1``; the slots
    before it are judged here, in every row of ``page_tags``, and the new token's slot by each
    call against that call's own tags. Every later :func:`kvattn.paged_decode` of the step takes
    ``verdict=`` with the same ``block_table``, ``seq_lens`` and ``expected`` tensors, a row of
    the same ``page_tags`` (or the array itself), the same page size and ``window_left``.

    Runs as two Triton launches on GPU tensors and as tensor ops on CPU tensors; either way with
    no host synchronisation and into fresh buffers (capture it with the forward under a CUDA
    graph).

    Args:
        block_table: ``[B, max_pages]`` int32, as for :func:`kvattn.paged_decode`.
        seq_lens: ``[B]`` int32 tokens per sequence, the new token included.
        page_tags: ``[num_pages]`` int64 tags, or ``[num_layers, num_pages]`` (one contiguous row
            per layer: what each layer's call is given).
        expected: ``[B]`` or ``[B, max_pages]`` int64 owner ids the pages must carry.
        page_size: tokens per page (the pools' dim 1).
        window_left: the decode's sliding window (-1: none); pages wholly before every query's
            window are neither read nor checked, as in the calls.
        backend: ``"auto"`` (Triton on GPU tensors, tensor ops elsewhere), ``"triton"`` or
            ``"reference"``.

    Returns:
        A :class:`PageVerdict`.

    Raises:
        ValueError, TypeError: malformed inputs, naming the argument.
    """
    if isinstance(page_size, bool) or not isinstance(page_size, int):
        raise TypeError(f"page_size: expected an int, got {type(page_size).__name__}")
    if not is_page_size(page_size):
        raise ValueError(f"page_size: expected an int in [1, 1024], got {page_size}")
    if isinstance(window_left, bool) or not isinstance(window_left, int):
        raise TypeError(f"window_left: expected an int, got {type(window_left).__name__}")
    if window_left < -1:
        raise ValueError(f"window_left: expected -1 (no window) or >= 0, got {window_left}")
    check_tensor("page_tags", page_tags, dtypes=(torch.int64,))
    if page_tags.dim() not in (1, 2):
        raise ValueError(
            f"page_tags: expected [num_pages] or [num_layers, num_pages], got shape "
            f"{tuple(page_tags.shape)}"
        )
    layers = _layer_rows(page_tags)
    check_tensor("block_table", block_table, ndim=2)
    device = block_table.device
    expected = _check_index_tensors(
        block_table,
        seq_lens,
        layers[0],
        expected,
        block_table.shape[0],
        layers.shape[1],
        device,
    )
    if backend not in ("auto", "triton", "reference"):
        raise ValueError(f"backend: expected 'auto', 'triton' or 'reference', got {backend!r}")
    if backend == "auto":
        backend = "reference" if device.type == "cpu" else "triton"
    first_key = reference.first_keys(seq_lens, 1, window_left)
    if backend == "triton":
        from .backends.triton.resolve import resolve

        entries, fresh, report = resolve(
            block_table, seq_lens, layers, expected, page_size, window_left
        )
    else:
        entries, report = reference.resolve_verdict(
            block_table, seq_lens, layers, expected, page_size, first_key
        )
        fresh = reference.fresh_entries(entries, seq_lens, page_size)
    return PageVerdict(
        entries=entries,
        fresh=fresh,
        report=report,
        page_tags=page_tags,
        generation=tag_generation(page_tags),
        block_table=block_table,
        seq_lens=seq_lens,
        expected=expected,
        page_size=page_size,
        window_left=window_left,
    )


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same elements of the same memory (host metadata only: no sync)."""
    return (
        a.device == b.device
        and a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
    )


def _is_row(tags: torch.Tensor, of: torch.Tensor) -> bool:
    """``tags`` is ``of`` itself or one of its rows."""
    if _same(tags, of):
        return True
    if of.dim() != 2 or tags.dim() != 1 or tags.shape[0] != of.shape[1] or tags.stride() != (1,):
        return False
    if tags.device != of.device or tags.untyped_storage().data_ptr() != (
        of.untyped_storage().data_ptr()
    ):
        return False
    offset = (tags.data_ptr() - of.data_ptr()) // tags.element_size()
    row, rest = divmod(offset, of.stride(0)) if of.stride(0) else (0, offset)
    return rest == 0 and 0 <= row < of.shape[0]


def usable(verdict, args, check: bool) -> bool:
    """Whether a decode on validated ``args`` reads ``verdict``: True, or False when the tags were
    reserved, reassigned or released since it was resolved (the call then checks every page
    itself). Raises ValueError naming ``verdict`` when it does not belong to the call."""
    if not isinstance(verdict, PageVerdict):
        raise TypeError(
            f"verdict: expected a kvattn.PageVerdict from kvattn.resolve_pages, got "
            f"{type(verdict).__name__}"
        )
    if not check:
        raise ValueError("verdict: expected None with check=False (nothing is checked)")
    mismatches = [
        name
        for name, ok in (
            ("block_table", _same(args.block_table, verdict.block_table)),
            ("seq_lens", _same(args.seq_lens, verdict.seq_lens)),
            ("expected", _same(args.expected, verdict.expected)),
            ("page_tags", _is_row(args.page_tags, verdict.page_tags)),
            ("page size", args.page_size == verdict.page_size),
            ("window_left", args.variant.window_left == verdict.window_left),
        )
        if not ok
    ]
    if mismatches:
        raise ValueError(
            "verdict: expected one resolved for this call's block_table, seq_lens, expected, "
            "page_tags (the array or one of its rows), page size and window_left; it differs "
            f"in {', '.join(mismatches)}"
        )
    return tag_generation(verdict.page_tags) == verdict.generation


__all__ = ["PageVerdict", "resolve_pages", "usable"]
