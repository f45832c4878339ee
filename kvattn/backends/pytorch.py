"""The writer as a composition of PyTorch ops (backend ``"torch"``): any device, no kernel of its
own. ``backend="auto"`` takes it for CPU tensors; it is also the model the writer kernels are tested
against. Semantics: :func:`kvattn.write_kv` (authoritative)."""
from __future__ import annotations

import torch

from ..report import WriteResult
from ..tags import (OWNER_SHIFT, STATE_WRITTEN, VALID_LEN_SHIFT, WriteDrop, held_by, tag_state,
                    tag_valid_len)
from ..write_args import WriteArgs

NAME = "torch"


def why_not(args: WriteArgs) -> str | None:
    return None


def written(owner: torch.Tensor, valid_len: torch.Tensor) -> torch.Tensor:
    """WRITTEN tags of ``owner`` with ``valid_len`` leading slots (int64 tensors)."""
    return (owner << OWNER_SHIFT) | (valid_len << VALID_LEN_SHIFT) | STATE_WRITTEN


def masked_put(dst: torch.Tensor, index: tuple, values: torch.Tensor, ok: torch.Tensor) -> None:
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


def write_kv(args: WriteArgs) -> WriteResult:
    """The writer's steps as PyTorch ops, on validated arguments."""
    k, v, k_cache, v_cache, slot_mapping, page_tags, owners = args.tensors()
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
    masked_put(k_cache, (safe_page, safe_slot), k, landed)
    masked_put(v_cache, (safe_page, safe_slot), v, landed)
    stamp = torch.where(landed, written(owners, slot + 1), 0)
    page_tags.scatter_reduce_(0, safe_page, stamp, reduce="amax", include_self=True)
    return WriteResult(landed, reasons, (reasons != 0).sum())


__all__ = ["NAME", "why_not", "write_kv"]
