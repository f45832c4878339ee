"""The ``torch`` backend's writer: :func:`kvattn.write_kv` as a composition of PyTorch ops, any
device, no kernel of its own. ``backend="auto"`` takes it for CPU tensors; it is also the model the
writer kernels are tested against. Semantics: :func:`kvattn.write_kv` (authoritative).

Its stores and those of the page-level writers (:mod:`kvattn.writers`) go through :func:`put_rows`
and :func:`max_rows`, which touch the elements of accepted rows only: a refused row's element is
never read back and rewritten, so a concurrent writer's fresh bytes or stamp cannot be undone.
"""

from __future__ import annotations

import torch

from ...report import WriteResult
from ...tags import (
    OWNER_SHIFT,
    STATE_RESERVED,
    STATE_WRITTEN,
    VALID_LEN_SHIFT,
    WriteDrop,
    held_by,
    tag_state,
    tag_valid_len,
)
from ...variants import FP8_MAX
from ...write_args import WriteArgs

# float32's smallest normal: below it a quotient may or may not be flushed to zero by the device's
# division, so the rounding toward zero stores every such quotient as +0.
FLOAT32_TINY = torch.finfo(torch.float32).tiny
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def rows_on_host(t: torch.Tensor) -> bool:
    """Whether the stores pick their accepted rows on the host: for CPU tensors, where that waits
    for no device. (Tests replace it to run the device path on CPU tensors.)"""
    return t.device.type == "cpu"


def written(owner: torch.Tensor, valid_len: torch.Tensor) -> torch.Tensor:
    """WRITTEN tags of ``owner`` with ``valid_len`` leading slots (int64 tensors)."""
    return (owner << OWNER_SHIFT) | (valid_len << VALID_LEN_SHIFT) | STATE_WRITTEN


def reserved(owner: torch.Tensor) -> torch.Tensor:
    """RESERVED tags of ``owner`` (an int64 tensor)."""
    return (owner << OWNER_SHIFT) | STATE_RESERVED


def put_rows(dst: torch.Tensor, index: tuple, values: torch.Tensor, ok: torch.Tensor) -> None:
    """``dst[index] = values`` for the rows where ``ok``; no other element of ``dst`` is read or
    written, and nothing waits for the device.

    ``index``: int64 ``[n]`` tensors for the leading dimensions of ``dst``, already clamped in range;
    ``values``: broadcastable to ``[n, *dst.shape[len(index):]]``. Two accepted rows aimed at one
    element race (either value, per element). On CPU tensors the accepted rows are picked on the
    host (there is no device to wait for); elsewhere :func:`atomic_put_rows` sets them.
    """
    values = values.to(dst.dtype).expand(ok.shape[0], *dst.shape[len(index) :])
    if not rows_on_host(dst):
        atomic_put_rows(dst, index, values, ok)
        return
    rows = torch.nonzero(ok).flatten()
    if rows.numel():
        dst.index_put_(tuple(i.index_select(0, rows) for i in index), values.index_select(0, rows))


def max_rows(
    dst: torch.Tensor, index: torch.Tensor, values: torch.Tensor, ok: torch.Tensor
) -> None:
    """``dst[index] = max(dst[index], values)`` for the rows where ``ok`` (1-D int64 ``dst``: the
    tags' stamps), touching no other element. On a device the refused rows carry the identity of
    max, which the atomic reduction leaves as it finds."""
    if not rows_on_host(dst):
        floor = torch.full_like(values, torch.iinfo(torch.int64).min)
        dst.scatter_reduce_(
            0, index, torch.where(ok, values, floor), reduce="amax", include_self=True
        )
        return
    rows = torch.nonzero(ok).flatten()
    if rows.numel():
        dst.scatter_reduce_(
            0,
            index.index_select(0, rows),
            values.index_select(0, rows),
            reduce="amax",
            include_self=True,
        )


def _element_offsets(dst: torch.Tensor, index: tuple) -> torch.Tensor:
    """``[n, m]`` storage offsets of the ``m`` elements of each row ``dst[index[0][r], ...]``."""
    base = dst.storage_offset() + sum(i * s for i, s in zip(index, dst.stride()))
    inner = torch.zeros((), dtype=torch.int64, device=dst.device)
    for size, stride in zip(dst.shape[len(index) :], dst.stride()[len(index) :]):
        inner = inner[..., None] + torch.arange(size, device=dst.device) * stride
    return base[:, None] + inner.reshape(1, -1)


def atomic_put_rows(
    dst: torch.Tensor, index: tuple, values: torch.Tensor, ok: torch.Tensor
) -> None:
    """:func:`put_rows` as two reductions over an integer view of ``dst``'s storage: a min that
    takes the accepted elements to the smallest integer, then a max that raises them to their
    values' bit patterns. A refused row's elements receive the identity of each (the largest, then
    the smallest integer), and a device's atomic min/max leaves them as it finds them, whatever a
    concurrent writer put there meanwhile. Between the two an accepted element holds the sign bit
    alone (``-0.0``, or a malformed tag, which reads as FREE): it is being overwritten anyway.
    Atomic only where ``scatter_reduce_`` is (CUDA); exact everywhere."""
    int_dtype = _INT_OF_SIZE[dst.element_size()]
    n = ok.shape[0]
    if n == 0:
        return
    offsets = _element_offsets(dst, index)
    bits = values.contiguous().view(int_dtype).reshape(offsets.shape)
    accepted = ok[:, None].expand_as(offsets)
    info = torch.iinfo(int_dtype)
    low, high = torch.full_like(bits, info.min), torch.full_like(bits, info.max)
    storage = dst.view(int_dtype).as_strided(
        (dst.untyped_storage().nbytes() // dst.element_size(),), (1,), 0
    )
    offsets = offsets.flatten()
    storage.scatter_reduce_(0, offsets, torch.where(accepted, low, high).flatten(), reduce="amin")
    storage.scatter_reduce_(0, offsets, torch.where(accepted, bits, low).flatten(), reduce="amax")


def quantise(
    x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, rounding: str = "nearest"
) -> torch.Tensor:
    """``x`` ``[T, num_kv_heads, head_dim]`` as ``dtype`` (fp8) by the per-head ``scale``, the rule
    of :func:`kvattn.write_kv`: float32 ``x / scale``, saturated to the largest finite value, then
    by ``rounding``: ``"nearest"``, torch's round-to-nearest-even cast, NaN as the positive NaN;
    ``"toward_zero"``, that cast stepped one code toward zero where it rounded away from zero, a
    quotient below float32's normal range as +0 and NaN as the largest finite value."""
    limit = FP8_MAX[dtype]
    y = (x.float() / scale[None, :, None]).clamp(-limit, limit)
    if rounding == "nearest":
        # The sign of a NaN quotient depends on the device; one NaN code makes the bytes identical.
        return y.masked_fill(torch.isnan(y), float("nan")).to(dtype)
    y = y.nan_to_num(nan=limit)
    q = y.to(dtype)
    # fp8 codes are sign and magnitude, so one code down in the magnitude bits is one step
    # toward zero; a magnitude that rounded up never passes the (representable) limit.
    codes = q.view(torch.uint8) - (q.float().abs() > y.abs()).to(torch.uint8)
    return codes.masked_fill(y.abs() < FLOAT32_TINY, 0).view(dtype)


def write_kv(args: WriteArgs) -> WriteResult:
    """The writer's steps as PyTorch ops, on validated arguments."""
    k, v, k_cache, v_cache, slot_mapping, page_tags, owners = args.tensors()
    if args.quantises:
        k = quantise(k, args.k_scale, k_cache.dtype, args.fp8_rounding)
        v = quantise(v, args.v_scale, v_cache.dtype, args.fp8_rounding)
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
    put_rows(k_cache, (safe_page, safe_slot), k, landed)
    put_rows(v_cache, (safe_page, safe_slot), v, landed)
    max_rows(page_tags, safe_page, written(owners, slot + 1), landed)
    return WriteResult(landed, reasons, (reasons != 0).sum())


__all__ = ["max_rows", "put_rows", "quantise", "reserved", "write_kv", "written"]
