"""kvattn's operations as torch custom ops (``torch.ops.kvattn.*``), for torch.compile and export.

Registered ops (``torch.library.custom_op``, each with a fake implementation for tracing):

- ``kvattn::paged_decode`` and ``kvattn::paged_extend``: the attention plus the ownership report as
  plain tensors, ``(out, lse, counts, page_reasons)``. ``counts`` ``[4, B]`` int32 stacks the report's
  ``violations``, ``reasons``, ``pages_checked`` and ``beyond_table``; ``page_reasons`` is
  ``[B, max_pages]`` int8. ``lse`` is empty (``[0]``) unless asked for. With ``check=False`` the
  report tensors are zeros and the wrappers below return ``None`` for the report.
- ``kvattn::paged_mla_decode`` and ``kvattn::paged_mla_extend``: the MLA decode and extend, with
  the same four results (``out`` ``[rows, num_heads, kv_lora_rank]``).
- ``kvattn::write_kv``: mutates ``k_cache``, ``v_cache`` and ``page_tags``; returns ``(landed,
  drop_reasons, dropped)`` as in :class:`kvattn.WriteResult`.

The Python wrappers of this module have the signatures of :func:`kvattn.paged_decode`,
:func:`kvattn.paged_extend` and :func:`kvattn.write_kv` (minus ``out=``) and return the same
objects. Shapes, dtypes and devices are checked by the wrappers before dispatch (at trace time
under torch.compile); the value checks (``validate``, default on CPU tensors) run inside the op, so
they read no host values during tracing. Either way a malformed input raises the ValueError/TypeError
of the direct call. ``on_violation="raise"``
synchronises after the op (a graph break under torch.compile); ``"report"`` never does.

The op boundary costs a dispatcher round trip per call; the direct functions of :mod:`kvattn`
remain the fast path for eager callers (``tests/readers/test_ops.py`` measures the difference).
"""

from __future__ import annotations

import torch

from . import api, writers
from .api import check_mode
from .layout import (
    check_kv_pools,
    check_tensor,
    output_dtype,
    validate_decode,
    validate_extend,
    validate_mla_decode,
    validate_mla_extend,
)
from .report import OwnershipReport
from .tags import OWNER_MAX
from .write_args import check_fp8_rounding, write_scales


def _report_tensors(report: OwnershipReport | None, batch: int, max_pages: int, device):
    if report is None:
        return (
            torch.zeros(4, batch, dtype=torch.int32, device=device),
            torch.zeros(batch, max_pages, dtype=torch.int8, device=device),
        )
    counts = torch.stack(
        [report.violations, report.reasons, report.pages_checked, report.beyond_table]
    ).to(torch.int32)
    return counts, report.page_reasons


def _report_from_tensors(counts: torch.Tensor, page_reasons: torch.Tensor) -> OwnershipReport:
    return OwnershipReport(
        violations=counts[0],
        reasons=counts[1],
        pages_checked=counts[2],
        beyond_table=counts[3],
        page_reasons=page_reasons,
    )


@torch.library.custom_op("kvattn::paged_decode", mutates_args=())
def _paged_decode_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_tags: torch.Tensor,
    expected: torch.Tensor,
    scale: float | None,
    check: bool,
    backend: str,
    return_lse: bool,
    validate: bool | None,
    window_left: int,
    logits_soft_cap: float,
    sinks: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    q_scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    out, lse, report = api.paged_decode(
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        page_tags,
        expected,
        scale=scale,
        check=check,
        backend=backend,
        return_lse=True,
        validate=validate,
        window_left=window_left,
        logits_soft_cap=logits_soft_cap,
        sinks=sinks,
        alibi_slopes=alibi_slopes,
        k_scale=k_scale,
        v_scale=v_scale,
        q_scale=q_scale,
    )
    counts, page_reasons = _report_tensors(report, q.shape[0], block_table.shape[1], q.device)
    return out, lse if return_lse else lse.new_empty(0), counts, page_reasons


@_paged_decode_op.register_fake
def _(
    q,
    k_cache,
    v_cache,
    block_table,
    seq_lens,
    page_tags,
    expected,
    scale,
    check,
    backend,
    return_lse,
    validate,
    *variant,
):
    batch, max_pages = block_table.shape
    lse = q.new_empty(q.shape[:2] if return_lse else (0,), dtype=torch.float32)
    return (
        q.new_empty(*q.shape[:2], v_cache.shape[3], dtype=output_dtype(q)),
        lse,
        q.new_empty(4, batch, dtype=torch.int32),
        q.new_empty(batch, max_pages, dtype=torch.int8),
    )


@torch.library.custom_op("kvattn::paged_extend", mutates_args=())
def _paged_extend_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_tags: torch.Tensor,
    expected: torch.Tensor,
    scale: float | None,
    causal: bool,
    check: bool,
    backend: str,
    return_lse: bool,
    validate: bool | None,
    window_left: int,
    logits_soft_cap: float,
    sinks: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    q_scale: torch.Tensor | None,
    custom_mask: torch.Tensor | None,
    window_right: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    out, lse, report = api.paged_extend(
        q,
        k_cache,
        v_cache,
        cu_seqlens_q,
        block_table,
        seq_lens,
        page_tags,
        expected,
        scale=scale,
        causal=causal,
        check=check,
        backend=backend,
        return_lse=True,
        validate=validate,
        window_left=window_left,
        logits_soft_cap=logits_soft_cap,
        sinks=sinks,
        alibi_slopes=alibi_slopes,
        k_scale=k_scale,
        v_scale=v_scale,
        q_scale=q_scale,
        custom_mask=custom_mask,
        window_right=window_right,
    )
    counts, page_reasons = _report_tensors(
        report, block_table.shape[0], block_table.shape[1], q.device
    )
    return out, lse if return_lse else lse.new_empty(0), counts, page_reasons


@_paged_extend_op.register_fake
def _(
    q,
    k_cache,
    v_cache,
    cu_seqlens_q,
    block_table,
    seq_lens,
    page_tags,
    expected,
    scale,
    causal,
    check,
    backend,
    return_lse,
    validate,
    *variant,
):
    batch, max_pages = block_table.shape
    lse = q.new_empty(q.shape[:2] if return_lse else (0,), dtype=torch.float32)
    return (
        q.new_empty(*q.shape[:2], v_cache.shape[3], dtype=output_dtype(q)),
        lse,
        q.new_empty(4, batch, dtype=torch.int32),
        q.new_empty(batch, max_pages, dtype=torch.int8),
    )


@torch.library.custom_op("kvattn::write_kv", mutates_args=("k_cache", "v_cache", "page_tags"))
def _write_kv_op(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    page_tags: torch.Tensor,
    owner: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    backend: str = "auto",
    validate: bool | None = None,
    fp8_rounding: str = "nearest",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    result = writers.write_kv(
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        page_tags,
        owner,
        backend=backend,
        validate=validate,
        k_scale=k_scale,
        v_scale=v_scale,
        fp8_rounding=fp8_rounding,
    )
    return result.landed, result.drop_reasons, result.dropped


@_write_kv_op.register_fake
def _(
    k,
    v,
    k_cache,
    v_cache,
    slot_mapping,
    page_tags,
    owner,
    k_scale=None,
    v_scale=None,
    backend="auto",
    validate=None,
    fp8_rounding="nearest",
):
    n = slot_mapping.shape[0]
    return (
        slot_mapping.new_empty(n, dtype=torch.bool),
        slot_mapping.new_empty(n, dtype=torch.int8),
        slot_mapping.new_empty((), dtype=torch.int64),
    )


def _finish(out, lse, counts, page_reasons, check, on_violation, return_lse):
    report = _report_from_tensors(counts, page_reasons) if check else None
    if on_violation == "raise":
        report.raise_if_any()
    return (out, lse, report) if return_lse else (out, report)


def _variant_args(sw):
    """The op's positional variant arguments (scales as the validated tensors, so the op schema
    takes tensors only)."""
    return (
        sw.window_left,
        sw.logits_soft_cap,
        sw.sinks,
        sw.alibi_slopes,
        sw.k_scale,
        sw.v_scale,
        sw.q_scale,
    )


def paged_decode(
    q,
    k_cache,
    v_cache,
    block_table,
    seq_lens,
    page_tags,
    expected,
    *,
    scale=None,
    check=True,
    on_violation="report",
    backend="auto",
    return_lse=False,
    validate=None,
    **variant,
):
    """:func:`kvattn.paged_decode` through the ``kvattn::paged_decode`` custom op (no ``out=``)."""
    check_mode(check, on_violation)
    args = validate_decode(
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        page_tags,
        expected,
        scale=scale,
        validate=False,
        **variant,
    )
    out, lse, counts, page_reasons = torch.ops.kvattn.paged_decode(
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        page_tags,
        expected,
        args.scale,
        check,
        backend,
        return_lse,
        validate,
        *_variant_args(args.variant),
    )
    return _finish(out, lse, counts, page_reasons, check, on_violation, return_lse)


def paged_extend(
    q,
    k_cache,
    v_cache,
    cu_seqlens_q,
    block_table,
    seq_lens,
    page_tags,
    expected,
    *,
    scale=None,
    causal=True,
    check=True,
    on_violation="report",
    backend="auto",
    return_lse=False,
    validate=None,
    **variant,
):
    """:func:`kvattn.paged_extend` through the ``kvattn::paged_extend`` custom op (no ``out=``)."""
    check_mode(check, on_violation)
    args = validate_extend(
        q,
        k_cache,
        v_cache,
        cu_seqlens_q,
        block_table,
        seq_lens,
        page_tags,
        expected,
        scale=scale,
        causal=causal,
        validate=False,
        **variant,
    )
    out, lse, counts, page_reasons = torch.ops.kvattn.paged_extend(
        q,
        k_cache,
        v_cache,
        cu_seqlens_q,
        block_table,
        seq_lens,
        page_tags,
        expected,
        args.scale,
        causal,
        check,
        backend,
        return_lse,
        validate,
        *_variant_args(args.variant),
        args.variant.custom_mask,
        args.variant.window_right,
    )
    return _finish(out, lse, counts, page_reasons, check, on_violation, return_lse)


def write_kv(
    k,
    v,
    k_cache,
    v_cache,
    slot_mapping,
    page_tags,
    owner,
    *,
    backend="auto",
    validate=None,
    k_scale=None,
    v_scale=None,
    fp8_rounding="nearest",
) -> writers.WriteResult:
    """:func:`kvattn.write_kv` through the ``kvattn::write_kv`` custom op, with its signature.
    ``owner`` may be an int (checked here) or an int64 tensor, 0-d or ``[T]``; float scales become
    the validated ``[num_kv_heads]`` tensors (the op schema takes tensors only)."""
    # The op schema's types, named here; whether the rounding applies (the writer quantises) is
    # checked inside the op.
    check_fp8_rounding(fp8_rounding, quantises=True)
    if not isinstance(backend, str):
        raise TypeError(f"backend: expected a str, got {type(backend).__name__}")
    if validate is not None and not isinstance(validate, bool):
        raise TypeError(f"validate: expected a bool or None, got {type(validate).__name__}")
    if k_scale is not None or v_scale is not None:
        check_kv_pools(k_cache, v_cache)
        check_tensor("k", k, ndim=3)
        # Values are checked inside the op (write_kv validates the tensors again), not at trace time.
        k_scale, v_scale = write_scales(k.dtype, k_cache, k_scale, v_scale, False)
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int32, torch.int64))
    if isinstance(owner, torch.Tensor):
        check_tensor("owner", owner, dtypes=(torch.int64,))
    elif isinstance(owner, bool) or not isinstance(owner, int):
        raise TypeError(f"owner: expected an int or an int64 tensor, got {type(owner).__name__}")
    elif not 1 <= owner <= OWNER_MAX:
        raise ValueError(f"owner: expected an id in [1, {OWNER_MAX}], got {owner}")
    else:
        owner = torch.tensor(owner, dtype=torch.int64, device=slot_mapping.device)
    landed, drop_reasons, dropped = torch.ops.kvattn.write_kv(
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        page_tags,
        owner,
        k_scale,
        v_scale,
        backend,
        validate,
        fp8_rounding,
    )
    return writers.WriteResult(landed, drop_reasons, dropped)


@torch.library.custom_op("kvattn::paged_mla_decode", mutates_args=())
def _paged_mla_decode_op(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_tags: torch.Tensor,
    expected: torch.Tensor,
    kv_lora_rank: int,
    scale: float | None,
    check: bool,
    backend: str,
    return_lse: bool,
    validate: bool | None,
    num_splits: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    out, lse, report = api.paged_mla_decode(
        q,
        kv_cache,
        block_table,
        seq_lens,
        page_tags,
        expected,
        kv_lora_rank=kv_lora_rank,
        scale=scale,
        check=check,
        backend=backend,
        return_lse=True,
        validate=validate,
        num_splits=num_splits,
    )
    counts, page_reasons = _report_tensors(report, q.shape[0], block_table.shape[1], q.device)
    return out, lse if return_lse else lse.new_empty(0), counts, page_reasons


@_paged_mla_decode_op.register_fake
def _(
    q,
    kv_cache,
    block_table,
    seq_lens,
    page_tags,
    expected,
    kv_lora_rank,
    scale,
    check,
    backend,
    return_lse,
    validate,
    num_splits,
):
    batch, max_pages = block_table.shape
    lse = q.new_empty(q.shape[:2] if return_lse else (0,), dtype=torch.float32)
    return (
        q.new_empty(batch, q.shape[1], kv_lora_rank),
        lse,
        q.new_empty(4, batch, dtype=torch.int32),
        q.new_empty(batch, max_pages, dtype=torch.int8),
    )


def paged_mla_decode(
    q,
    kv_cache,
    block_table,
    seq_lens,
    page_tags,
    expected,
    *,
    kv_lora_rank=512,
    scale=None,
    check=True,
    on_violation="report",
    backend="auto",
    return_lse=False,
    validate=None,
    num_splits=None,
):
    """:func:`kvattn.paged_mla_decode` through the ``kvattn::paged_mla_decode`` custom op (no
    ``out=``)."""
    check_mode(check, on_violation)
    args = validate_mla_decode(
        q,
        kv_cache,
        block_table,
        seq_lens,
        page_tags,
        expected,
        kv_lora_rank=kv_lora_rank,
        scale=scale,
        validate=False,
        num_splits=num_splits,
    )
    out, lse, counts, page_reasons = torch.ops.kvattn.paged_mla_decode(
        q,
        kv_cache,
        block_table,
        seq_lens,
        page_tags,
        expected,
        kv_lora_rank,
        args.scale,
        check,
        backend,
        return_lse,
        validate,
        num_splits,
    )
    return _finish(out, lse, counts, page_reasons, check, on_violation, return_lse)


@torch.library.custom_op("kvattn::paged_mla_extend", mutates_args=())
def _paged_mla_extend_op(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_tags: torch.Tensor,
    expected: torch.Tensor,
    kv_lora_rank: int,
    scale: float | None,
    causal: bool,
    check: bool,
    backend: str,
    return_lse: bool,
    validate: bool | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    out, lse, report = api.paged_mla_extend(
        q,
        kv_cache,
        cu_seqlens_q,
        block_table,
        seq_lens,
        page_tags,
        expected,
        kv_lora_rank=kv_lora_rank,
        scale=scale,
        causal=causal,
        check=check,
        backend=backend,
        return_lse=True,
        validate=validate,
    )
    counts, page_reasons = _report_tensors(
        report, block_table.shape[0], block_table.shape[1], q.device
    )
    return out, lse if return_lse else lse.new_empty(0), counts, page_reasons


@_paged_mla_extend_op.register_fake
def _(
    q,
    kv_cache,
    cu_seqlens_q,
    block_table,
    seq_lens,
    page_tags,
    expected,
    kv_lora_rank,
    scale,
    causal,
    check,
    backend,
    return_lse,
    validate,
):
    batch, max_pages = block_table.shape
    lse = q.new_empty(q.shape[:2] if return_lse else (0,), dtype=torch.float32)
    return (
        q.new_empty(q.shape[0], q.shape[1], kv_lora_rank),
        lse,
        q.new_empty(4, batch, dtype=torch.int32),
        q.new_empty(batch, max_pages, dtype=torch.int8),
    )


def paged_mla_extend(
    q,
    kv_cache,
    cu_seqlens_q,
    block_table,
    seq_lens,
    page_tags,
    expected,
    *,
    kv_lora_rank=512,
    scale=None,
    causal=True,
    check=True,
    on_violation="report",
    backend="auto",
    return_lse=False,
    validate=None,
):
    """:func:`kvattn.paged_mla_extend` through the ``kvattn::paged_mla_extend`` custom op (no
    ``out=``)."""
    check_mode(check, on_violation)
    args = validate_mla_extend(
        q,
        kv_cache,
        cu_seqlens_q,
        block_table,
        seq_lens,
        page_tags,
        expected,
        kv_lora_rank=kv_lora_rank,
        scale=scale,
        causal=causal,
        validate=False,
    )
    out, lse, counts, page_reasons = torch.ops.kvattn.paged_mla_extend(
        q,
        kv_cache,
        cu_seqlens_q,
        block_table,
        seq_lens,
        page_tags,
        expected,
        kv_lora_rank,
        args.scale,
        causal,
        check,
        backend,
        return_lse,
        validate,
    )
    return _finish(out, lse, counts, page_reasons, check, on_violation, return_lse)


__all__ = ["paged_decode", "paged_extend", "paged_mla_decode", "paged_mla_extend", "write_kv"]
