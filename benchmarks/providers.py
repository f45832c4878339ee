"""The decode and extend implementations the benchmarks time, each behind the same small interface.

A provider says whether it can run a point (``why_not``) and builds a ``run(i)`` that runs the op on
rotation set ``i`` and returns ``(out, report)`` (``report`` is None for providers without the
check). ``build`` also returns the output buffer ``run`` writes into, when there is one, so the
harness can poison it before the correctness check. Everything a provider needs that a serving
engine would prepare once per batch (plans, index casts) happens in ``build``, outside the timing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import kvattn
from kvattn import backends

from .common import DTYPES, DecodeInputs, ExtendInputs, MLAInputs


@dataclass(frozen=True)
class Provider:
    name: str
    family: str  # checked and unchecked variants of one kernel share a family
    checked: bool
    why_not: Callable[[DecodeInputs | ExtendInputs], str | None]
    build: Callable[[DecodeInputs | ExtendInputs], tuple]


# kvattn's entry points by op: (validation, which reads the arguments' shapes, and the call).
_OPS = {
    "decode": (kvattn.layout.validate_decode, kvattn.paged_decode),
    "extend": (kvattn.layout.validate_extend, kvattn.paged_extend),
}


def _kvattn(backend: str, check: bool, op: str) -> Provider:
    validate, call = _OPS[op]

    def why_not(inp: DecodeInputs | ExtendInputs) -> str | None:
        args = validate(*inp.args(0), scale=inp.scale, validate=False, **inp.variant)
        return backends.explain(args, op=op)[backend]

    def build(inp: DecodeInputs | ExtendInputs):
        out = inp.new_out()

        def run(i: int):
            return call(
                *inp.args(i), scale=inp.scale, check=check, backend=backend, out=out, **inp.variant
            )

        return run, out

    variant = "checked" if check else "unchecked"
    return Provider(f"kvattn-{backend}-{variant}", f"kvattn-{backend}", check, why_not, build)


def _verdict(backend: str) -> Provider:
    """kvattn's checked decode through a verdict (docs/ownership.md section 9): the pages resolved
    once per rotation set in ``build``, outside the timing, as an engine resolves them once per
    forward for all its layers; each call reads the verdict instead of the table and the tags."""
    plain = _kvattn(backend, True, "decode")

    def why_not(inp: DecodeInputs) -> str | None:
        args = kvattn.layout.validate_decode(
            *inp.args(0), scale=inp.scale, validate=False, **inp.variant
        )
        args.verdict = kvattn.resolve_pages(
            *inp.args(0)[3:],
            page_size=inp.k_cache.shape[1],
            window_left=inp.variant.get("window_left", -1),
        )
        return backends.explain(args, op="decode")[backend]

    def build(inp: DecodeInputs):
        out = inp.new_out()
        window = inp.variant.get("window_left", -1)
        verdicts = [
            kvattn.resolve_pages(
                *inp.args(i)[3:], page_size=inp.k_cache.shape[1], window_left=window
            )
            for i in range(inp.sets)
        ]

        def run(i: int):
            return kvattn.paged_decode(
                *inp.args(i),
                scale=inp.scale,
                backend=backend,
                out=out,
                verdict=verdicts[i],
                **inp.variant,
            )

        return run, out

    return Provider(f"kvattn-{backend}-verdict", plain.family, True, why_not, build)


def _gather_why_not(inp: DecodeInputs | ExtendInputs, need: int) -> str | None:
    """Why a gather needing ``need`` bytes of device memory cannot run now (None when it can)."""
    if inp.q.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(inp.q.device)
        if need > free:
            return f"gathering the KV needs about {need / 1e9:.1f} GB, {free / 1e9:.1f} GB free"
    return None


def _sdpa_why_not(inp: DecodeInputs) -> str | None:
    # The gather materialises K and V of one set; SDPA may make one more contiguous copy.
    return _gather_why_not(inp, 3 * inp.point.kv_set_bytes())


def _sdpa_build(inp: DecodeInputs):
    """What a user without a paged kernel does: gather the pages into a contiguous KV tensor, then
    call SDPA. GQA is expressed by viewing the group of query heads as a query length (no KV
    repeat); all lengths are equal, so no mask is needed."""
    p = inp.point
    group = p.num_heads // p.num_kv_heads
    tables = [t.long() for t in inp.tables]

    def run(i: int):
        k = inp.k_cache[tables[i]].flatten(1, 2)[:, : p.context].transpose(1, 2)  # [B, Hkv, N, D]
        v = inp.v_cache[tables[i]].flatten(1, 2)[:, : p.context].transpose(1, 2)
        q = inp.q.view(p.batch, p.num_kv_heads, group, p.head_dim)  # [B, Hkv, G, D]
        out = F.scaled_dot_product_attention(q, k, v, scale=inp.scale)
        return out.reshape(p.batch, p.num_heads, p.head_dim), None

    return run, None


def _flashinfer_why_not(inp: DecodeInputs) -> str | None:
    try:
        import flashinfer  # noqa: F401
    except ImportError as e:
        return f"not importable ({e})"
    if inp.q.device.type != "cuda":
        return "needs a CUDA device"
    return None


def _flashinfer_build(inp: DecodeInputs):
    """FlashInfer's documented paged decode: one planned wrapper per rotation set (the plan is
    host work an engine does once per batch), NHD pools shared with kvattn."""
    import flashinfer

    p = inp.point
    dev = inp.q.device
    dtype = DTYPES[p.dtype]
    indptr = torch.arange(p.batch + 1, dtype=torch.int32, device=dev) * p.pages_per_seq
    last_len = torch.full(
        (p.batch,), p.context - (p.pages_per_seq - 1) * p.page_size, dtype=torch.int32, device=dev
    )
    wrappers = []
    for table in inp.tables:
        workspace = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        w.plan(
            indptr,
            table.reshape(-1),
            last_len,
            p.num_heads,
            p.num_kv_heads,
            p.head_dim,
            p.page_size,
            pos_encoding_mode="NONE",
            q_data_type=dtype,
            kv_data_type=dtype,
        )
        wrappers.append(w)

    def run(i: int):
        return wrappers[i].run(inp.q, (inp.k_cache, inp.v_cache)), None

    return run, None


def _flex_why_not(inp: DecodeInputs | ExtendInputs) -> str | None:
    try:
        from torch.nn.attention.experimental._paged_attention import PagedAttention  # noqa: F401
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError as e:
        return f"not importable ({e})"
    if inp.q.device.type != "cuda":
        return "needs a CUDA device (eager FlexAttention off the GPU reads every key, NaN poison included)"
    return None


_FLEX = {}


def _flex_attention():
    """``flex_attention`` compiled once (the eager version is a reference that reads every key).
    ``fullgraph=True``: a graph break, or a shape past dynamo's recompile limit, raises instead of
    running that eager version, so the provider fails and says why rather than timing it."""
    if "fn" not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False, fullgraph=True)
    return _FLEX["fn"]


def _flex_block_masks(pool: DecodeInputs, q_len: int, mask_mod):
    """PyTorch's paged attention on FlexAttention, over kvattn's own pools: the physical block
    mask of each rotation set, converted from a logical one by ``PagedAttention`` with the set's
    block table as its page table (a page is a key block, so only listed pages are visited)."""
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import create_block_mask

    p = pool.point
    dev = pool.q.device
    num_pages = pool.k_cache.shape[0]
    rows = torch.arange(p.batch, device=dev)[:, None].expand(p.batch, p.pages_per_seq)
    logical = torch.arange(p.pages_per_seq, device=dev)[None, :].expand(p.batch, p.pages_per_seq)
    masks = []
    for table in pool.tables:
        paged = PagedAttention(num_pages, p.page_size, p.batch, device=str(dev))
        paged.page_table[:, : p.pages_per_seq] = table.long()
        paged.physical_to_logical[rows, table.long()] = logical
        block_mask = create_block_mask(
            mask_mod,
            p.batch,
            None,
            q_len,
            p.pages_per_seq * p.page_size,
            device=str(dev),
            BLOCK_SIZE=(128, p.page_size),
        )
        masks.append(paged.convert_logical_block_mask(block_mask, kv_len=pool.seq_lens.long()))
    return masks


def _flex_pools(pool: DecodeInputs):
    """The NHD pools as FlexAttention's ``[1, Hkv, pages * page_size, D]`` (strided views, no copy)."""
    p = pool.point
    n = pool.k_cache.shape[0] * p.page_size
    k = pool.k_cache.view(1, n, p.num_kv_heads, p.head_dim).transpose(1, 2)
    v = pool.v_cache.view(1, n, p.num_kv_heads, p.head_dim).transpose(1, 2)
    return k, v


def _flex_build(inp: DecodeInputs):
    p = inp.point
    lens = inp.seq_lens.long()
    masks = _flex_block_masks(inp, 1, lambda b, h, q_idx, kv_idx: kv_idx < lens[b])
    k, v = _flex_pools(inp)
    q = inp.q.view(p.batch, p.num_heads, 1, p.head_dim)
    flex = _flex_attention()

    def run(i: int):
        out = flex(q, k, v, block_mask=masks[i], scale=inp.scale, enable_gqa=True)
        return out.view(p.batch, p.num_heads, p.head_dim), None

    return run, None


def _flex_extend_build(inp: ExtendInputs):
    """Causal, aligned to the end of each sequence: chunk row ``j`` sees keys up to ``prefix + j``."""
    p = inp.point
    masks = _flex_block_masks(
        inp.pool, p.chunk, lambda b, h, q_idx, kv_idx: kv_idx <= q_idx + p.prefix
    )
    k, v = _flex_pools(inp.pool)
    q = inp.q.view(p.batch, p.chunk, p.num_heads, p.head_dim).transpose(1, 2)  # [B, H, chunk, D]
    flex = _flex_attention()

    def run(i: int):
        out = flex(q, k, v, block_mask=masks[i], scale=inp.scale, enable_gqa=True)
        return out.transpose(1, 2).reshape(p.q_tokens, p.num_heads, p.head_dim), None

    return run, None


def _reference_why_not(inp: DecodeInputs) -> str | None:
    if inp.q.device.type != "cpu":
        return "timed only on CPU tiny points (it gathers every page in float32)"
    return None


def _reference_build(op: str):
    call = _OPS[op][1]

    def build(inp: DecodeInputs | ExtendInputs):
        out = inp.new_out()

        def run(i: int):
            return call(*inp.args(i), scale=inp.scale, backend="reference", out=out, **inp.variant)

        return run, out

    return build


def _sdpa_extend_why_not(inp: ExtendInputs) -> str | None:
    # The gathered K/V of one set, the copies SDPA may make of it, and Q/O.
    return _gather_why_not(
        inp, 3 * inp.point.pool_point().kv_set_bytes() + 3 * inp.q.numel() * inp.q.element_size()
    )


def _sdpa_extend_build(inp: ExtendInputs):
    """What a user without a paged prefill kernel does: gather each sequence's pages into a
    contiguous K/V, then one batched SDPA call with causal masking aligned to the end of the keys
    (``causal_lower_right``: the chunk's row ``j`` sees the prefix and rows up to ``j``), GQA by
    ``enable_gqa`` (no K/V head repeat). Lengths are uniform, so no padding mask is needed."""
    from torch.nn.attention.bias import causal_lower_right

    p = inp.point
    tables = [t.long() for t in inp.pool.tables]
    mask = causal_lower_right(p.chunk, p.context)
    q = inp.q.view(p.batch, p.chunk, p.num_heads, p.head_dim).transpose(1, 2)  # [B, H, chunk, D]

    def run(i: int):
        k = (
            inp.pool.k_cache[tables[i]].flatten(1, 2)[:, : p.context].transpose(1, 2)
        )  # [B, Hkv, N, D]
        v = inp.pool.v_cache[tables[i]].flatten(1, 2)[:, : p.context].transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=inp.scale, enable_gqa=True
        )  # [B, H, chunk, D]
        return out.transpose(1, 2).reshape(p.q_tokens, p.num_heads, p.head_dim), None

    return run, None


def _flashinfer_extend_build(inp: ExtendInputs):
    """FlashInfer's documented paged prefill: ``BatchPrefillWithPagedKVCacheWrapper`` planned once
    per rotation set (host work an engine does once per batch), causal (FlashInfer aligns it to the
    end of the keys when queries are fewer), NHD pools shared with kvattn."""
    import flashinfer

    p = inp.point
    pool = inp.pool
    dev = inp.q.device
    dtype = DTYPES[p.dtype]
    kv_indptr = torch.arange(p.batch + 1, dtype=torch.int32, device=dev) * p.pages_per_seq
    last_len = torch.full(
        (p.batch,), p.context - (p.pages_per_seq - 1) * p.page_size, dtype=torch.int32, device=dev
    )
    wrappers = []
    for table in pool.tables:
        workspace = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        w.plan(
            inp.cu_seqlens_q,
            kv_indptr,
            table.reshape(-1),
            last_len,
            p.num_heads,
            p.num_kv_heads,
            p.head_dim,
            p.page_size,
            causal=True,
            pos_encoding_mode="NONE",
            sm_scale=inp.scale,
            q_data_type=dtype,
            kv_data_type=dtype,
        )
        wrappers.append(w)

    def run(i: int):
        return wrappers[i].run(inp.q, (pool.k_cache, pool.v_cache)), None

    return run, None


def _plain_only(why_not):
    """A peer's ``why_not`` that also refuses the attention variants and a V head dim of its own
    (the peers run as plain attention here; those rows compare kvattn checked with kvattn
    unchecked)."""

    def refuse(inp):
        if inp.variant:
            return f"plain attention only in this harness (variant {inp.point.variant})"
        if getattr(inp.point, "head_dim_v", None) is not None:
            return "one head dim for K and V only in this harness"
        return why_not(inp)

    return refuse


def all_providers(op: str = "decode") -> list[Provider]:
    """Every provider of ``op`` (``"decode"``, ``"extend"`` or ``"mla_decode"``), kvattn's first."""
    if op == "mla_decode":
        return mla_providers()
    if op not in _OPS:
        raise ValueError(f"op: expected 'decode' or 'extend', got {op!r}")
    decode = op == "decode"
    return [
        _kvattn("triton", True, op),
        _kvattn("triton", False, op),
        *([_verdict("triton")] if decode else []),
        _kvattn("cuda", True, op),
        _kvattn("cuda", False, op),
        *([_verdict("cuda")] if decode else []),
        Provider(
            "torch-sdpa-gather",
            "torch-sdpa-gather",
            False,
            _plain_only(_sdpa_why_not if decode else _sdpa_extend_why_not),
            _sdpa_build if decode else _sdpa_extend_build,
        ),
        Provider(
            "flex-paged",
            "flex-paged",
            False,
            _plain_only(_flex_why_not),
            _flex_build if decode else _flex_extend_build,
        ),
        Provider(
            "flashinfer",
            "flashinfer",
            False,
            _plain_only(_flashinfer_why_not),
            _flashinfer_build if decode else _flashinfer_extend_build,
        ),
        Provider(
            "kvattn-reference", "kvattn-reference", True, _reference_why_not, _reference_build(op)
        ),
    ]


def select(names: list[str] | None, op: str = "decode") -> list[Provider]:
    """Providers of ``op`` by name (all when ``names`` is empty); unknown names raise ValueError."""
    providers = all_providers(op)
    if not names:
        return providers
    known = {p.name for p in providers}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"--providers: expected names from {sorted(known)}, got {unknown}")
    return [p for p in providers if p.name in names]


def _mla_op(inp: MLAInputs) -> str:
    return "mla_decode" if inp.point.q_len == 1 else "mla_extend"


def _mla_kvattn(backend: str, check: bool) -> Provider:
    def why_not(inp: MLAInputs) -> str | None:
        return backends.explain(inp.validated(), op=_mla_op(inp))[backend]

    def build(inp: MLAInputs):
        out = inp.q.new_empty(*inp.q.shape[:2], inp.point.kv_lora_rank)

        def run(i: int):
            return inp.call(i, check=check, backend=backend, out=out)

        return run, out

    variant = "checked" if check else "unchecked"
    return Provider(f"kvattn-{backend}-{variant}", f"kvattn-{backend}", check, why_not, build)


def _mla_sdpa_why_not(inp: MLAInputs) -> str | None:
    if inp.point.q_len > 1:
        return "decode points only (one query row per sequence)"
    return _gather_why_not(inp, 3 * inp.point.kv_set_bytes())


def _mla_sdpa_build(inp: MLAInputs):
    """Without a paged MLA kernel: gather the latent rows into a contiguous tensor, then SDPA with
    the heads as the query length (MQA: one latent head), the whole row as the key and its first
    ``kv_lora_rank`` dims as the value."""
    p = inp.point
    tables = [t.long() for t in inp.tables]

    def run(i: int):
        latent = (
            inp.kv_cache[tables[i]].flatten(1, 2)[:, : p.context].transpose(1, 2)
        )  # [B, 1, N, D]
        q = inp.q.view(p.batch, 1, p.num_heads, p.head_dim)
        out = F.scaled_dot_product_attention(
            q, latent, latent[..., : p.kv_lora_rank], scale=inp.scale
        )
        return out.view(p.batch, p.num_heads, p.kv_lora_rank), None

    return run, None


def _mla_reference_build(inp: MLAInputs):
    out = inp.q.new_empty(*inp.q.shape[:2], inp.point.kv_lora_rank)

    def run(i: int):
        return inp.call(i, backend="reference", out=out)

    return run, out


def mla_providers() -> list[Provider]:
    """The MLA providers: kvattn's Triton kernel checked and unchecked (decode, or extend for points
    with several query rows), the CUDA latent tile checked and unchecked (decode points at 512 +
    64), SDPA over gathered latent rows (decode), the reference (CPU)."""
    return [
        _mla_kvattn("triton", True),
        _mla_kvattn("triton", False),
        _mla_kvattn("cuda", True),
        _mla_kvattn("cuda", False),
        Provider(
            "torch-sdpa-gather", "torch-sdpa-gather", False, _mla_sdpa_why_not, _mla_sdpa_build
        ),
        Provider(
            "kvattn-reference", "kvattn-reference", True, _reference_why_not, _mla_reference_build
        ),
    ]
