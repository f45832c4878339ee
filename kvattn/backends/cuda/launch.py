"""Launch the CUDA decode and extend kernels through their raw-pointer binding (csrc/module.cpp).

Shared by the ``cuda`` backend (module ``_C``, device tensors) and the ``cuda_sim`` backend (module
``_sim``: the same kernel sources compiled for the CPU harness, CPU tensors). Decode and extend
arguments arrive validated by :func:`kvattn.layout.validate_decode` /
:func:`~kvattn.layout.validate_extend`; this module plans the launch and passes pointers, sizes and
strides. :func:`write_kv` receives arguments validated by :func:`kvattn.writers.write_kv`.
"""

from __future__ import annotations

import torch

from ...layout import DecodeArgs, ExtendArgs, MLADecodeArgs
from ...report import OwnershipReport, WriteResult
from ...write_args import WriteArgs
from ..grids import extend_tile_map, plan_num_splits

LOG2E = 1.4426950408889634
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
# kv_dtype of the binding (csrc/kvattn/fp8.h KVType): 0, pools of the query's dtype.
FP8_CODES = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}
# The writer's tokens (csrc/kvattn/params.h DType): fp8 tokens are stored as they are.
WRITE_DTYPE_CODES = {**DTYPE_CODES, torch.float8_e4m3fn: 3, torch.float8_e5m2: 4}
TENSOR_CORE_DTYPES = (torch.float16, torch.bfloat16)
# The MLA latent decode tile (csrc/kvattn/tiles.h kLatentDim): FlashMLA's 512 latent + 64 RoPE dims,
# the latent row read once as the key and, its first 512 dims, as the value, by one block per 16
# heads (132 KB of shared memory: one block per SM).
LATENT_DIM, LATENT_RANK = 576, 512
# The switches of kvattn.variants the kernels compile in: the score switches in both (the custom
# mask exists for the extend only); fp8 pools are read by both (the decode by fp8 instantiations,
# the extend by its element-wise ones, converting on the copy), and so are fp8 queries over them
# (converted as they are staged).
SWITCHES = frozenset(
    {"window_left", "window_right", "logits_soft_cap", "sinks", "alibi_slopes", "custom_mask"}
)
READ_SWITCHES = SWITCHES | {"fp8 KV", "fp8 queries"}
# Decode blocks resident on one H100/H200 SM (228 KB of shared memory, 64K registers, 4 warps a
# block) per head-dim tile of csrc/instantiations.py (TILES, then LATENT: a tile added to the table
# needs its figures here, tests/backends/test_instantiations.py says so), from the registers and
# shared memory of every instantiation in benchmarks/results/static_sm90.md
# (tests/backends/test_static_sm90.py holds the planner to them):
# 59 KB and 150-156 registers at 64, 110 KB at 128, 145 KB at 256, 218 KB at 512. The score switches
# take d64 to 170-180 registers (two blocks); fp8 pools halve the shared memory, which lets two
# d256 blocks share an SM.
DECODE_BLOCKS_PER_SM = {64: 3, 128: 2, 256: 1, 512: 1, LATENT_DIM: 1}
DECODE_BLOCKS_PER_SM_SWITCHED = {64: 2, 128: 2, 256: 1, 512: 1, LATENT_DIM: 1}
DECODE_BLOCKS_PER_SM_FP8 = {64: 3, 128: 2, 256: 2, 512: 1, LATENT_DIM: 1}
SUB_TILE = 16  # tokens a decode warp copies per pipeline stage
# The axes of a build's selection of the kernel instantiations (csrc/instantiations.py; a module's
# SELECTION): element types, fp8 pool formats, head-dim tiles (csrc/kvattn/tiles.h), the latent one
# last; the widest other tile bounds the head dims the kernels take.
DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
FP8_NAMES = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
HEAD_DIM_TILES = tuple(sorted(DECODE_BLOCKS_PER_SM))
MAX_HEAD_DIM = max(d for d in HEAD_DIM_TILES if d != LATENT_DIM)


class NotBuilt(RuntimeError):
    """The module was built without the kernel instantiation a call needs (a subset of the table,
    ``KVATTN_CUDA_DTYPES`` / ``_HEAD_DIMS`` / ``_VARIANTS``); the registry's ``why_not`` says so
    first, so ``backend="auto"`` never meets it."""


def unsupported(args: DecodeArgs | ExtendArgs) -> str | None:
    """Why the kernels cannot run these (already validated) inputs, or None."""
    # The kernels' element type is the output's: the query's, or for fp8 queries (converted as
    # they are staged) the output's, bfloat16 unless the caller's out says otherwise.
    if args.output_dtype not in TENSOR_CORE_DTYPES:
        what = "out dtype" if args.variant.q_fp8 else "dtype"
        return (
            f"{what} {str(args.output_dtype).replace('torch.', '')} is not supported (the CUDA kernels "
            "run fp16/bf16 on tensor cores; the triton backend runs float32)"
        )
    if args.head_dim > MAX_HEAD_DIM and not _latent_rows(args):
        return f"head_dim {args.head_dim} > {MAX_HEAD_DIM}"
    if args.head_dim_v > args.head_dim:
        return (
            f"V head dim {args.head_dim_v} > K head dim {args.head_dim} (the CUDA kernels' "
            "tiles are sized by K's; the triton backend runs it)"
        )
    missing = [s for s in args.variant.switches() if s not in READ_SWITCHES]
    if missing:
        return f"no kernel for {', '.join(missing)}"
    if args.max_pages * args.page_size >= 2**31:
        return f"a table of {args.max_pages} pages of {args.page_size} tokens holds 2**31 tokens or more"
    if getattr(args, "verdict", None) is not None and not _rows_of_16_bytes(args):
        return (
            "a verdict is read with 16-byte copies only: K/V rows 16-byte aligned (head dims and "
            "strides multiples of 16 bytes; the triton backend reads it from any rows)"
        )
    if (
        args.batch >= 2**31
        or args.num_kv_heads * -(-(args.num_heads // args.num_kv_heads) // 16) > 32767
    ):
        return f"grid too large (batch {args.batch}, {args.num_heads} heads)"
    return None


def not_built(ext, args: DecodeArgs | ExtendArgs) -> str | None:
    """Why the module ``ext`` lacks the instantiation ``args`` needs, or None: the first axis of
    its selection (``ext.SELECTION``) without it, as the dispatch (csrc/kvattn/dispatch.cuh)
    would refuse it. Arguments :func:`unsupported` accepts."""
    selection = getattr(ext, "SELECTION", None)
    if selection is None or selection["full"]:
        return None
    tile = next(t for t in HEAD_DIM_TILES if args.head_dim <= t)
    switches = [s for s in args.variant.switches() if s in SWITCHES]
    fp8 = FP8_NAMES.get(args.k_cache.dtype)
    if DTYPE_NAMES[args.output_dtype] not in selection["dtypes"]:
        missing = (f"dtype {DTYPE_NAMES[args.output_dtype]}", "DTYPES")
    elif fp8 is not None and fp8 not in selection["dtypes"] and isinstance(args, DecodeArgs):
        # (the extend reads fp8 pools with the 16-bit instantiations)
        missing = (f"pool dtype {fp8}", "DTYPES")
    elif tile not in selection["head_dims"]:
        missing = (f"head_dim {args.head_dim} (tile {tile})", "HEAD_DIMS")
    elif switches and not selection["variants"]:
        missing = (f"the score switches ({', '.join(switches)})", "VARIANTS")
    else:
        return None
    return (
        f"{missing[0]} not built into this module (it has: {selection['text']}; "
        f"KVATTN_CUDA_{missing[1]} builds more)"
    )


def not_built_write_kv(ext, args: WriteArgs) -> str | None:
    """Why the module ``ext`` has no writer of ``args``' tokens into its pools, or None."""
    selection = getattr(ext, "SELECTION", None)
    if selection is None or selection["full"]:
        return None
    names = {**DTYPE_NAMES, **FP8_NAMES}
    for what, dtype in (("dtype", args.k.dtype), ("pool dtype", args.k_cache.dtype)):
        if names[dtype] not in selection["dtypes"]:
            return (
                f"{what} {names[dtype]} not built into this module (it has: {selection['text']}; "
                f"KVATTN_CUDA_DTYPES builds more)"
            )
    return None


def _latent_rows(args) -> bool:
    """Whether a decode's pools are MLA latent rows the latent tile runs: one KV head of 16-bit,
    16-byte aligned 576-dim rows whose first 512 dims are V (a view of the same rows), no switch."""
    k, v = args.k_cache, args.v_cache
    return (
        isinstance(args, DecodeArgs)
        and args.head_dim == LATENT_DIM
        and args.head_dim_v == LATENT_RANK
        and args.num_kv_heads == 1
        and v.data_ptr() == k.data_ptr()
        and v.stride() == k.stride()
        and not args.variant.switches()
        and k.data_ptr() % 16 == 0
        and all(s % 8 == 0 for s in k.stride()[:3])
    )


def _rows_of_16_bytes(args) -> bool:
    """Whether the decode can copy these pools' rows by 16-byte cp.async (csrc/kvattn/plan.h
    ``kv_rows_aligned``): the only copies of the fp8 kernels and of a decode through a verdict."""
    pools = (args.k_cache, args.v_cache)
    per_copy = 16 // args.k_cache.element_size()  # elements of one 16-byte copy
    return (
        args.head_dim % per_copy == 0
        and args.head_dim_v % per_copy == 0
        and all(t.data_ptr() % 16 == 0 for t in pools)
        and all(s % per_copy == 0 for t in pools for s in t.stride()[:3])
    )


def padded_head_dim(head_dim: int) -> int:
    """The head dim a decode instantiation is compiled for (csrc/kvattn/tiles.h)."""
    return next(d for d in HEAD_DIM_TILES if head_dim <= d)


def decode_blocks_per_sm(head_dim: int, fp8: bool = False, scores: bool = False) -> int:
    """Decode blocks one SM holds at once for this head dim (its padded register tile), over fp8
    pools and with score switches (kvattn.variants) compiled in."""
    d = padded_head_dim(head_dim)
    blocks = DECODE_BLOCKS_PER_SM_FP8[d] if fp8 else DECODE_BLOCKS_PER_SM[d]
    return min(blocks, DECODE_BLOCKS_PER_SM_SWITCHED[d]) if scores else blocks


def decode_blocks_per_split(args: DecodeArgs) -> int:
    """Attention blocks of one split (csrc/kvattn/decode.cuh plan_decode): per sequence and KV head,
    one per chunk of 16 query heads of its GQA group, times two for heads over 256 wide but the
    latent row (whose warps share each staged sub-tile and split the value dims instead). The
    per-call check's report block of each sequence and split is not counted: it loads table
    entries and tags, no K/V, and is launched first, so its slot frees before the last wave."""
    group = args.num_heads // args.num_kv_heads
    d = padded_head_dim(args.head_dim)
    d_split = 2 if d > 256 and d != LATENT_DIM else 1
    return args.batch * args.num_kv_heads * -(-group // 16) * d_split


def plan_splits(
    args: DecodeArgs, num_splits: int | None = None, blocks_per_sm: int | None = None
) -> tuple[int, int, int]:
    """``(num_splits, min_chunk, align)``: :func:`kvattn.backends.grids.plan_num_splits` over the
    blocks of a split, with chunks of whole pages (and whole 16-token sub-tiles when one of page and
    sub-tile divides the other); ``blocks_per_sm`` overrides the occupancy target (for tuning)."""
    page = args.page_size
    align = max(page, SUB_TILE) if page % SUB_TILE == 0 or SUB_TILE % page == 0 else page
    sw = args.variant
    scores = any(s in SWITCHES for s in sw.switches())
    target = blocks_per_sm or decode_blocks_per_sm(args.head_dim, fp8=sw.fp8, scores=scores)
    splits, min_chunk = plan_num_splits(
        args, align, target, num_splits, programs_per_split=decode_blocks_per_split(args)
    )
    return splits, min_chunk, align


def _ptr(t) -> int:
    return 0 if t is None else t.data_ptr()


def _attention_params(args, out: torch.Tensor, lse, report) -> dict:
    """The arguments decode and extend share (csrc/kvattn/params.h ``KVATTN_ATTENTION_ARGS``, and
    those the binding derives: ``page_size``, ``kv_dtype``, the score switches)."""
    q, k, v = args.q, args.k_cache, args.v_cache
    r = report
    return dict(
        q=_ptr(q),
        k=_ptr(k),
        v=_ptr(v),
        block_table=_ptr(args.block_table),
        seq_lens=_ptr(args.seq_lens),
        page_tags=_ptr(args.page_tags),
        expected=_ptr(args.expected),
        out=_ptr(out),
        lse=_ptr(lse),
        violations=_ptr(r and r.violations),
        reasons=_ptr(r and r.reasons),
        pages_checked=_ptr(r and r.pages_checked),
        beyond_table=_ptr(r and r.beyond_table),
        page_reasons=_ptr(r and r.page_reasons),
        stride_qh=q.stride(1),
        stride_kp=k.stride(0),
        stride_ks=k.stride(1),
        stride_kh=k.stride(2),
        stride_vp=v.stride(0),
        stride_vs=v.stride(1),
        stride_vh=v.stride(2),
        stride_bt_b=args.block_table.stride(0),
        stride_bt_p=args.block_table.stride(1),
        stride_sl=args.seq_lens.stride(0),
        stride_eb=args.expected.stride(0),
        stride_ep=args.expected.stride(1),
        stride_oh=out.stride(1),
        num_pages=args.num_pages,
        scale_log2=args.scale * LOG2E,
        batch=args.batch,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        head_dim_v=args.head_dim_v,
        page_size=args.page_size,
        max_pages=args.max_pages,
        window_left=args.variant.window_left,
        window_right=args.variant.window_right,
        soft_cap=args.variant.logits_soft_cap,
        alibi=_ptr(args.variant.alibi_slopes),
        alibi_stride=args.variant.alibi_stride,
        sinks=_ptr(args.variant.sinks),
        kv_dtype=FP8_CODES.get(k.dtype, 0),
        k_scale=_ptr(args.variant.k_scale),
        v_scale=_ptr(args.variant.v_scale),
        scale_stride=args.variant.scale_stride,
        q_dtype=FP8_CODES.get(q.dtype, 0),
        q_scale=_ptr(args.variant.q_scale),
    )


def decode(
    ext,
    args: DecodeArgs,
    *,
    check: bool,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    num_splits: int | None = None,
    stream: int = 0,
    plan: dict | None = None,
) -> OwnershipReport | None:
    """Enqueue the decode on ``stream`` with the binding ``ext``; writes ``out`` (and ``lse``).
    A CUDA or harness error raises RuntimeError naming the kernel. ``plan``, when given, receives
    the launcher's choices (num_chunks, smem_bytes, num_splits, align, min_chunk)."""
    missing = not_built(ext, args)
    if missing:
        raise NotBuilt(f"paged_decode: {missing}")
    if args.variant.fp8 and not _rows_of_16_bytes(args):
        # The fp8 decode kernels copy rows by cp.async alone; other fp8 pools run the extend's
        # element-wise kernels with one query row per sequence: the same rows, positions, rule
        # and report, without splits (num_splits is not applied).
        return extend(
            ext, as_one_row_extend(args), check=check, out=out, lse=lse, stream=stream, plan=plan
        )
    q = args.q
    device = q.device
    splits, min_chunk, align = plan_splits(args, num_splits)
    # Through a verdict the report is the step's (the call adds the new token's page to it).
    verdict = args.verdict if check else None
    report = None
    if check:
        report = (
            verdict.report
            if verdict is not None
            else OwnershipReport.allocate(args.batch, args.max_pages, device)
        )
    part_acc = part_ml = part_report = None
    if splits > 1:
        part_acc = torch.empty(
            args.batch * args.num_heads * splits * args.head_dim_v,
            dtype=torch.float32,
            device=device,
        )
        part_ml = torch.empty(
            args.batch * args.num_heads * splits * 2, dtype=torch.float32, device=device
        )
        if check and verdict is None:
            part_report = torch.empty(args.batch * splits * 3, dtype=torch.int32, device=device)
    if lse is not None and not lse.is_contiguous():
        raise ValueError(f"lse: expected a contiguous tensor, got strides {lse.stride()}")
    params = dict(
        _attention_params(args, out, lse, report),
        part_acc=_ptr(part_acc),
        part_ml=_ptr(part_ml),
        part_report=_ptr(part_report),
        verdict=_ptr(verdict and verdict.entries),
        verdict_fresh=_ptr(verdict and verdict.fresh),
        stride_qb=q.stride(0),
        stride_ob=out.stride(0),
        num_splits=splits,
        align=align,
        min_chunk=min_chunk,
    )
    chosen = ext.decode(params, DTYPE_CODES[out.dtype], check, stream)
    if plan is not None:
        plan.update(chosen, align=align, min_chunk=min_chunk)
    return report


def unsupported_mla(args: MLADecodeArgs) -> str | None:
    """Why the latent decode tile cannot run these (validated) MLA inputs, or None."""
    if args.q.dtype not in TENSOR_CORE_DTYPES:
        return (
            f"dtype {str(args.q.dtype).replace('torch.', '')} is not supported (the CUDA MLA decode "
            "runs fp16/bf16 on tensor cores; the triton backend runs float32)"
        )
    if (args.kv_lora_rank, args.rope_dim) != (LATENT_RANK, LATENT_DIM - LATENT_RANK):
        return (
            f"latent {args.kv_lora_rank} + {args.rope_dim}: the CUDA MLA decode is FlashMLA's "
            f"{LATENT_RANK} + {LATENT_DIM - LATENT_RANK} (the triton backend runs others)"
        )
    kv = args.kv_cache
    if kv.data_ptr() % 16 or any(s % 8 for s in kv.stride()[:3]):
        return (
            f"latent rows not 16-byte aligned (kv_cache strides {kv.stride()}): the CUDA MLA "
            "decode copies them by cp.async (the triton backend runs them)"
        )
    return unsupported(mla_as_decode(args))


def mla_as_decode(args: MLADecodeArgs) -> DecodeArgs:
    """The MLA decode as a decode of one KV head whose keys are the latent rows and whose values
    their first ``kv_lora_rank`` dims (a view of the same rows: the latent tile reads them once)."""
    kv = args.kv_cache
    return DecodeArgs(
        args.q,
        kv,
        kv[..., : args.kv_lora_rank],
        args.block_table,
        args.seq_lens,
        args.page_tags,
        args.expected,
        args.scale,
    )


def as_one_row_extend(args: DecodeArgs) -> ExtendArgs:
    """The decode ``args`` as an extend of one query row per sequence: row ``b`` sits at
    ``seq_lens[b] - 1``, as the decode's query does, and reads what it reads."""
    rows = torch.arange(args.batch + 1, dtype=torch.int32, device=args.q.device)
    return ExtendArgs(
        args.q,
        args.k_cache,
        args.v_cache,
        rows,
        args.block_table,
        args.seq_lens,
        args.page_tags,
        args.expected,
        args.scale,
        causal=True,
        rows_covered=True,
        variant=args.variant,
        out_dtype=args.out_dtype,
    )


def mla_decode(
    ext,
    args: MLADecodeArgs,
    *,
    check: bool,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    stream: int = 0,
    plan: dict | None = None,
) -> OwnershipReport | None:
    """:func:`kvattn.paged_mla_decode` on the latent tile (arguments accepted by
    :func:`unsupported_mla`): the decode of :func:`mla_as_decode`, with its splits and report."""
    return decode(
        ext,
        mla_as_decode(args),
        check=check,
        out=out,
        lse=lse,
        num_splits=args.num_splits,
        stream=stream,
        plan=plan,
    )


def extend_tiles(ext, args: ExtendArgs, tokens_per_tile: int | None = None) -> tuple[int, int]:
    """``(tokens_per_tile, heads_per_tile)``: a block's ``EXTEND_ROWS`` rows are the heads of a GQA
    group (at most that many per block, the group chunked beyond) times query tokens.
    ``tokens_per_tile`` overrides the tokens (tests: several query tiles per sequence)."""
    rows = ext.EXTEND_ROWS
    heads = min(args.num_heads // args.num_kv_heads, rows)
    if tokens_per_tile is None:
        return rows // heads, heads
    if not 1 <= tokens_per_tile <= rows // heads:
        raise ValueError(
            f"tokens_per_tile: expected 1 .. {rows // heads} for {heads} heads per tile, "
            f"got {tokens_per_tile}"
        )
    return tokens_per_tile, heads


def extend(
    ext,
    args: ExtendArgs,
    *,
    check: bool,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    stream: int = 0,
    tokens_per_tile: int | None = None,
    plan: dict | None = None,
) -> OwnershipReport | None:
    """Enqueue the extend on ``stream`` with the binding ``ext`` (after the page pre-pass when
    checked); writes ``out`` (and ``lse``) for every row of every sequence. The tile map (the
    triton launcher's) is built with device ops, and the grid, ``ceil(total_q / tokens_per_tile) + B``
    slots, from shapes only: no host sync. A CUDA or harness error raises RuntimeError naming the
    kernel; ``plan`` receives the launcher's choices."""
    missing = not_built(ext, args)
    if missing:
        raise NotBuilt(f"paged_extend: {missing}")
    q = args.q
    tokens, heads = extend_tiles(ext, args, tokens_per_tile)
    q_start, tile_start, slots = extend_tile_map(args, tokens)
    report = effective = None
    if check:
        report = OwnershipReport.allocate(args.batch, args.max_pages, q.device)
        effective = torch.empty(args.batch, args.max_pages, dtype=torch.int64, device=q.device)
    if lse is not None and not lse.is_contiguous():
        raise ValueError(f"lse: expected a contiguous tensor, got strides {lse.stride()}")

    mask = args.variant.custom_mask
    if mask is not None:
        # One byte per entry; an empty mask (every entry past its end, so none readable) as one
        # False entry, since a null mask means none.
        mask = (
            mask.view(torch.uint8)
            if mask.numel()
            else torch.zeros(1, dtype=torch.uint8, device=q.device)
        )
    params = dict(
        _attention_params(args, out, lse, report),
        custom_mask=_ptr(mask),
        mask_start=_ptr(args.variant.mask_start),
        mask_numel=0 if mask is None else mask.numel(),
        q_start=_ptr(q_start),
        tile_start=_ptr(tile_start),
        effective=_ptr(effective),
        stride_qt=q.stride(0),
        stride_ot=out.stride(0),
        causal=int(args.causal),
        num_slots=slots,
        heads_per_tile=heads,
        tokens_per_tile=tokens,
    )
    chosen = ext.extend(params, DTYPE_CODES[out.dtype], check, stream)
    if plan is not None:
        plan.update(chosen)
    return report


def write_kv(ext, args: WriteArgs, *, stream: int = 0) -> WriteResult:
    """:func:`kvattn.writers.write_kv` on the binding ``ext``; arguments validated there
    (``owners``: int64 ``[T]``, possibly a stride-0 expansion; ``k_scale``/``v_scale``
    ``[num_kv_heads]`` float32 when quantising into fp8 pools)."""
    missing = not_built_write_kv(ext, args)
    if missing:
        raise NotBuilt(f"write_kv: {missing}")
    k, v, k_cache, v_cache, slot_mapping, page_tags, owners = args.tensors()
    device = k_cache.device
    num_pages, page_size, num_kv_heads, head_dim = k_cache.shape
    num_tokens = slot_mapping.shape[0]
    landed = torch.zeros(num_tokens, dtype=torch.bool, device=device)
    drop_reasons = torch.zeros(num_tokens, dtype=torch.int8, device=device)
    dropped = torch.zeros((), dtype=torch.int64, device=device)
    if num_tokens == 0:
        return WriteResult(landed, drop_reasons, dropped)
    params = dict(
        k=k.data_ptr(),
        v=v.data_ptr(),
        k_cache=k_cache.data_ptr(),
        v_cache=v_cache.data_ptr(),
        slot_mapping=slot_mapping.data_ptr(),
        owners=owners.data_ptr(),
        page_tags=page_tags.data_ptr(),
        landed=landed.data_ptr(),
        drop_reasons=drop_reasons.data_ptr(),
        dropped=dropped.data_ptr(),
        stride_kt=k.stride(0),
        stride_kh=k.stride(1),
        stride_kd=k.stride(2),
        stride_vt=v.stride(0),
        stride_vh=v.stride(1),
        stride_vd=v.stride(2),
        stride_kp=k_cache.stride(0),
        stride_ks=k_cache.stride(1),
        stride_kch=k_cache.stride(2),
        stride_vp=v_cache.stride(0),
        stride_vs=v_cache.stride(1),
        stride_vch=v_cache.stride(2),
        stride_slot=slot_mapping.stride(0),
        stride_owner=owners.stride(0),
        num_tokens=num_tokens,
        num_pages=num_pages,
        slot_is_int64=int(slot_mapping.dtype == torch.int64),
        page_size=page_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        head_dim_v=v_cache.shape[3],
        kv_dtype=FP8_CODES[k_cache.dtype] if args.quantises else 0,
        k_scale=_ptr(args.k_scale),
        v_scale=_ptr(args.v_scale),
        toward_zero=int(args.fp8_rounding == "toward_zero"),
    )
    ext.write_kv(params, WRITE_DTYPE_CODES[k.dtype], stream)
    return WriteResult(landed, drop_reasons, dropped)
