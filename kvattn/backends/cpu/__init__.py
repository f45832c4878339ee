"""The backend ``cpu``: the paged decode and extend and the stamping writer compiled for the CPU
(csrc/cpu/, module ``_cpu``): decode and extend from one source, checked and unchecked, the decode
also through a verdict (docs/ownership.md section 9). For CPU tensors where no GPU kernel runs:
``backend="auto"`` takes it there before the PyTorch ops of the ``torch`` backend (vLLM's and
SGLang's CPU engines). A call spreads its work over ``torch.get_num_threads()`` threads (the
engine's setting) when it is large enough to pay for them, else runs on the calling thread.
The kernels are compiled for AVX-512, for AVX2 with FMA and for the baseline x86-64 (one source),
and a call runs the widest set the CPU has (:func:`isa`); ``KVATTN_CPU_MAX_ISA=avx2`` or
``baseline`` caps it.

Decode and extend (causal or not): float32, float16 and bfloat16 queries and pools (float32
arithmetic), any head dims and page size, a sliding window (left and right) and the logit
soft-cap; the other switches of :mod:`kvattn.variants` (sinks, ALiBi, fp8, a custom mask) are
refused with their names, and the registry takes the next backend. ``write_kv``: tokens into
pools of their own dtype (float32, float16, bfloat16); fp8 pools are refused (``WRITE_SWITCHES``
is empty).
"""

from __future__ import annotations

import os

import torch

from ... import extensions
from ...layout import DecodeArgs, ExtendArgs
from ...report import OwnershipReport, WriteResult
from ...write_args import WriteArgs

NAME = "cpu"
VERDICT_OPS = ("decode",)
SWITCHES = frozenset({"window_left", "window_right", "logits_soft_cap"})
WRITE_SWITCHES = frozenset()
_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_MODES = {"unchecked": 0, "checked": 1, "verdict": 2}

_cpu, STATUS = extensions.load("kvattn.backends.cpu._cpu")

ISA_NAMES = ("avx512", "avx2", "baseline")  # widest first


def _max_isa() -> int:
    value = os.environ.get("KVATTN_CPU_MAX_ISA", ISA_NAMES[0]).strip().lower()
    if value not in ISA_NAMES:
        raise ValueError(
            f"KVATTN_CPU_MAX_ISA: expected one of {', '.join(ISA_NAMES)}, got {value!r}"
        )
    return ISA_NAMES.index(value)


MAX_ISA = _max_isa()


def isa() -> str | None:
    """The instruction set the compiled kernels run in on this CPU (under KVATTN_CPU_MAX_ISA);
    None where the module is not built."""
    return _cpu.isa(MAX_ISA) if _cpu is not None else None


def why_not(args: DecodeArgs) -> str | None:
    """None if the compiled decode can run ``args``, else the reason it cannot."""
    if _cpu is None:
        return STATUS.line()
    if args.q.device.type != "cpu":
        return f"tensors are on {args.q.device}; this backend runs CPU tensors"
    unsupported = [s for s in args.variant.switches() if s not in SWITCHES]
    if unsupported:
        return f"no kernel for {', '.join(unsupported)}"
    if args.q.dtype not in _DTYPES or args.k_cache.dtype != args.q.dtype:
        return f"no kernel for {args.q.dtype} queries over {args.k_cache.dtype} pools"
    if args.out_dtype not in (None, args.q.dtype):
        return f"no kernel writing a {args.out_dtype} output for {args.q.dtype} queries"
    return None


def decode(
    args: DecodeArgs, *, check: bool, out: torch.Tensor, lse: torch.Tensor | None
) -> OwnershipReport | None:
    """Run the compiled decode (arguments accepted by :func:`why_not`); writes ``out``, ``lse``
    and the report (the verdict's, when the call reads one)."""
    verdict = args.verdict if check else None
    report = None
    if verdict is not None:
        report = verdict.report
    elif check:
        report = OwnershipReport.allocate(args.batch, args.max_pages, args.q.device)
    mode = "verdict" if verdict is not None else "checked" if check else "unchecked"
    _attend(args, mode, None, True, verdict, out, lse, report)
    return report


def extend(
    args: ExtendArgs, *, check: bool, out: torch.Tensor, lse: torch.Tensor | None
) -> OwnershipReport | None:
    """Run the compiled extend (arguments accepted by :func:`why_not`); writes ``out`` (rows
    outside every sequence are left as they are), ``lse`` and the report."""
    report = OwnershipReport.allocate(args.batch, args.max_pages, args.q.device) if check else None
    mode = "checked" if check else "unchecked"
    _attend(args, mode, args.cu_seqlens_q, args.causal, None, out, lse, report)
    return report


def _attend(args, mode: str, cu_seqlens_q, causal: bool, verdict, out, lse, report) -> None:
    none = 0  # the address of what the call does not read or write
    q, k, v = args.q, args.k_cache, args.v_cache
    call = dict(
        q=q.data_ptr(),
        k=k.data_ptr(),
        v=v.data_ptr(),
        cu_seqlens_q=cu_seqlens_q.data_ptr() if cu_seqlens_q is not None else none,
        block_table=args.block_table.data_ptr(),
        seq_lens=args.seq_lens.data_ptr(),
        tags=args.page_tags.data_ptr(),
        expected=args.expected.data_ptr(),
        verdict=verdict.entries.data_ptr() if verdict is not None else none,
        out=out.data_ptr(),
        lse=lse.data_ptr() if lse is not None else none,
        violations=report.violations.data_ptr() if report else none,
        reasons=report.reasons.data_ptr() if report else none,
        checked=report.pages_checked.data_ptr() if report else none,
        beyond=report.beyond_table.data_ptr() if report else none,
        page_reasons=report.page_reasons.data_ptr() if report else none,
        batch=args.batch,
        total_q=q.shape[0],
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        head_dim_v=args.head_dim_v,
        page_size=args.page_size,
        max_pages=args.max_pages,
        num_pages=args.num_pages,
        stride_qt=q.stride(0),
        stride_qh=q.stride(1),
        stride_kp=k.stride(0),
        stride_ks=k.stride(1),
        stride_kh=k.stride(2),
        stride_vp=v.stride(0),
        stride_vs=v.stride(1),
        stride_vh=v.stride(2),
        stride_bt=args.block_table.stride(0),
        stride_eb=args.expected.stride(0),
        stride_ep=args.expected.stride(1),
        stride_ot=out.stride(0),
        stride_oh=out.stride(1),
        scale=args.scale,
        causal=causal,
        window_left=args.variant.window_left,
        window_right=args.variant.window_right,
        soft_cap=args.variant.logits_soft_cap,
        threads=torch.get_num_threads(),
        max_isa=MAX_ISA,
    )
    _cpu.attend(call, _DTYPES[q.dtype], _MODES[mode])


def why_not_write_kv(args: WriteArgs) -> str | None:
    """None if the compiled writer can run ``args``, else the reason it cannot."""
    if _cpu is None:
        return STATUS.line()
    if args.k_cache.device.type != "cpu":
        return f"tensors are on {args.k_cache.device}; this backend runs CPU tensors"
    if args.switches():
        return None  # fp8 pools: the registry refuses them by WRITE_SWITCHES, naming the switch
    pools = (args.k_cache.dtype, args.v_cache.dtype)
    if args.k_cache.dtype not in _DTYPES or (args.k.dtype, args.v.dtype) != pools:
        return f"no write_kv kernel for {args.k.dtype} tokens into {args.k_cache.dtype} pools"
    return None


def write_kv(args: WriteArgs) -> WriteResult:
    """Run the compiled writer (arguments accepted by :func:`why_not_write_kv`)."""
    k, v, k_cache, v_cache, slots, tags, owners = args.tensors()
    n = slots.shape[0]
    landed = torch.empty(n, dtype=torch.bool)
    reasons = torch.empty(n, dtype=torch.int8)
    dropped = torch.empty((), dtype=torch.int64)
    slots64 = slots if slots.dtype == torch.int64 else slots.to(torch.int64)
    _cpu.write_kv(
        dict(
            k=k.data_ptr(),
            v=v.data_ptr(),
            k_cache=k_cache.data_ptr(),
            v_cache=v_cache.data_ptr(),
            slot_mapping=slots64.data_ptr(),
            tags=tags.data_ptr(),
            owners=owners.data_ptr(),
            landed=landed.data_ptr(),
            drop_reasons=reasons.data_ptr(),
            dropped=dropped.data_ptr(),
            num_tokens=n,
            num_pages=k_cache.shape[0],
            page_size=k_cache.shape[1],
            num_kv_heads=k_cache.shape[2],
            head_dim=k_cache.shape[3],
            head_dim_v=v_cache.shape[3],
            element_size=k_cache.element_size(),
            stride_slots=slots64.stride(0),
            stride_owner=owners.stride(0),
            stride_kt=k.stride(0),
            stride_kh=k.stride(1),
            stride_vt=v.stride(0),
            stride_vh=v.stride(1),
            stride_kp=k_cache.stride(0),
            stride_ks=k_cache.stride(1),
            stride_kkh=k_cache.stride(2),
            stride_vp=v_cache.stride(0),
            stride_vs=v_cache.stride(1),
            stride_vvh=v_cache.stride(2),
        )
    )
    return WriteResult(landed, reasons, dropped)


__all__ = [
    "NAME",
    "SWITCHES",
    "VERDICT_OPS",
    "WRITE_SWITCHES",
    "decode",
    "extend",
    "why_not",
    "why_not_write_kv",
    "write_kv",
]
