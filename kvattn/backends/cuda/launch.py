"""Launch the CUDA decode kernels through their raw-pointer binding (csrc/module.cpp).

Shared by the ``cuda`` backend (module ``_C``, device tensors) and the ``cuda_sim`` backend (module
``_sim``: the same kernel sources compiled for the CPU harness, CPU tensors). Decode arguments
arrive validated by :func:`kvattn.layout.validate_decode`; this module plans the launch and passes
pointers, sizes and strides. :func:`write_kv` receives arguments validated by :func:`kvattn.writers.write_kv`.
"""
from __future__ import annotations

import torch

from ...layout import DecodeArgs
from ...report import OwnershipReport
from ...writers import WriteResult
from ..splits import plan_splits as plan_kv_splits

LOG2E = 1.4426950408889634
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
MAX_HEAD_DIM = 256


def unsupported(args: DecodeArgs) -> str | None:
    """Why the kernels cannot run these (already validated) inputs, or None."""
    if args.q.dtype not in DTYPE_CODES:
        return f"dtype {args.q.dtype} is not supported (float16, bfloat16, float32)"
    if args.head_dim % 8 or args.head_dim > MAX_HEAD_DIM:
        return f"head_dim {args.head_dim} is not a multiple of 8 up to {MAX_HEAD_DIM}"
    if args.batch >= 2 ** 31 or args.num_kv_heads > 65535 // max(1, args.num_heads // args.num_kv_heads):
        return f"grid too large (batch {args.batch}, {args.num_heads} heads)"
    return None


def plan_splits(args: DecodeArgs, num_splits: int | None = None) -> tuple[int, int]:
    """(num_splits, tokens_per_split): :func:`kvattn.backends.splits.plan_splits`, page-aligned."""
    return plan_kv_splits(args, args.page_size, num_splits)


def decode(ext, args: DecodeArgs, *, check: bool, out: torch.Tensor, lse: torch.Tensor | None,
           num_splits: int | None = None, stream: int = 0, plan: dict | None = None
           ) -> OwnershipReport | None:
    """Enqueue the decode on ``stream`` with the binding ``ext``; writes ``out`` (and ``lse``).
    A CUDA or harness error raises RuntimeError naming the kernel. ``plan``, when given, receives
    the launcher's choices (tile_n, heads_per_chunk, num_chunks, kv_vec, num_splits, ...)."""
    q, k, v = args.q, args.k_cache, args.v_cache
    device = q.device
    splits, tokens_per_split = plan_splits(args, num_splits)
    report = OwnershipReport.allocate(args.batch, args.max_pages, device) if check else None
    part_acc = part_ml = None
    if splits > 1:
        part_acc = torch.empty(args.batch * args.num_heads * splits * args.head_dim, dtype=torch.float32,
                               device=device)
        part_ml = torch.empty(args.batch * args.num_heads * splits * 2, dtype=torch.float32, device=device)

    def ptr(t):
        return 0 if t is None else t.data_ptr()

    params = dict(
        q=ptr(q), k=ptr(k), v=ptr(v), block_table=ptr(args.block_table), seq_lens=ptr(args.seq_lens),
        page_tags=ptr(args.page_tags), expected=ptr(args.expected), out=ptr(out), lse=ptr(lse),
        part_acc=ptr(part_acc), part_ml=ptr(part_ml),
        violations=ptr(report.violations) if report else 0,
        reasons=ptr(report.reasons) if report else 0,
        pages_checked=ptr(report.pages_checked) if report else 0,
        beyond_table=ptr(report.beyond_table) if report else 0,
        page_reasons=ptr(report.page_reasons) if report else 0,
        stride_qb=q.stride(0), stride_qh=q.stride(1),
        stride_kp=k.stride(0), stride_ks=k.stride(1), stride_kh=k.stride(2),
        stride_vp=v.stride(0), stride_vs=v.stride(1), stride_vh=v.stride(2),
        stride_bt_b=args.block_table.stride(0), stride_bt_p=args.block_table.stride(1),
        stride_sl=args.seq_lens.stride(0),
        stride_eb=args.expected.stride(0), stride_ep=args.expected.stride(1),
        stride_ob=out.stride(0), stride_oh=out.stride(1),
        num_pages=args.num_pages, scale_log2=args.scale * LOG2E,
        batch=args.batch, num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
        head_dim=args.head_dim, page_shift=args.page_size.bit_length() - 1, max_pages=args.max_pages,
        tokens_per_split=tokens_per_split, num_splits=splits,
    )
    if lse is not None and not lse.is_contiguous():
        raise ValueError(f"lse: expected a contiguous tensor, got strides {lse.stride()}")
    chosen = ext.decode(params, DTYPE_CODES[q.dtype], check, stream)
    if plan is not None:
        plan.update(chosen)
    return report


def write_kv(ext, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, page_tags: torch.Tensor, owners: torch.Tensor, *,
             stream: int = 0) -> WriteResult:
    """:func:`kvattn.writers.write_kv` on the binding ``ext``; arguments validated there
    (``owners``: int64 ``[T]``, possibly a stride-0 expansion)."""
    device = k_cache.device
    num_pages, page_size, num_kv_heads, head_dim = k_cache.shape
    num_tokens = slot_mapping.shape[0]
    landed = torch.zeros(num_tokens, dtype=torch.bool, device=device)
    drop_reasons = torch.zeros(num_tokens, dtype=torch.int8, device=device)
    dropped = torch.zeros((), dtype=torch.int64, device=device)
    if num_tokens == 0:
        return WriteResult(landed, drop_reasons, dropped)
    params = dict(
        k=k.data_ptr(), v=v.data_ptr(), k_cache=k_cache.data_ptr(), v_cache=v_cache.data_ptr(),
        slot_mapping=slot_mapping.data_ptr(), owners=owners.data_ptr(), page_tags=page_tags.data_ptr(),
        landed=landed.data_ptr(), drop_reasons=drop_reasons.data_ptr(), dropped=dropped.data_ptr(),
        stride_kt=k.stride(0), stride_kh=k.stride(1), stride_kd=k.stride(2),
        stride_vt=v.stride(0), stride_vh=v.stride(1), stride_vd=v.stride(2),
        stride_kp=k_cache.stride(0), stride_ks=k_cache.stride(1), stride_kch=k_cache.stride(2),
        stride_vp=v_cache.stride(0), stride_vs=v_cache.stride(1), stride_vch=v_cache.stride(2),
        stride_slot=slot_mapping.stride(0), stride_owner=owners.stride(0),
        num_tokens=num_tokens, num_pages=num_pages, slot_is_int64=int(slot_mapping.dtype == torch.int64),
        page_shift=page_size.bit_length() - 1, num_kv_heads=num_kv_heads, head_dim=head_dim,
    )
    ext.write_kv(params, DTYPE_CODES[k_cache.dtype], stream)
    return WriteResult(landed, drop_reasons, dropped)
