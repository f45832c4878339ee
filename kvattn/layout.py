"""The paged KV layout, written down once, and the validation every backend shares.

Paged KV layout (every docstring in kvattn points here)
-------------------------------------------------------
``k_cache``, ``v_cache``: ``[num_pages, page_size, num_kv_heads, head_dim]`` (NHD), separate K and V
    pools of one dtype (``v_cache`` may have a head dim of its own, ``head_dim_v``: DeepSeek's
    192-dim keys with 128-dim values, FlashAttention 3's ``dv``; the rest of its shape is K's):
    that of ``q`` (float16, bfloat16 or float32), or fp8 (``float8_e4m3fn``, ``float8_e5m2``)
    dequantised by ``k_scale``/``v_scale`` (:mod:`kvattn.variants`). ``page_size`` is any size
    from 1 to 1024 (powers of two take the kernels' fast paths; ``valid_len`` stays exact at every
    size).
    Only the last dimension must be contiguous: the pools may be strided views into a larger buffer,
    as engines hand out per-layer views of one flat allocation. A head-major (HND) buffer
    ``[num_pages, num_kv_heads, page_size, head_dim]`` is passed as ``buf.transpose(1, 2)``: the
    logical shape is always NHD, the strides say where the bytes are. kvattn never copies a pool.
``page_tags``: ``[num_pages]`` int64, contiguous; one tag per physical page (format in
    :mod:`kvattn.tags`). A caller may keep one tag array per layer or one for all layers.
``block_table``: ``[B, max_pages]`` int32; entry ``[b, i]`` is the physical page holding tokens
    ``[i * page_size, (i + 1) * page_size)`` of sequence ``b``. Entries past a sequence's length are
    never read; entries outside ``[0, num_pages)`` that would be read are refused (``OUT_OF_RANGE``)
    and never dereferenced.
``seq_lens``: ``[B]`` int32; tokens of each sequence held in pages (for decode: including the token
    whose K/V was just appended).
``expected``: ``[B]`` or ``[B, max_pages]`` int64 owner ids; the owner each logical page must carry
    (``[B]`` broadcasts over the pages; ``[B, max_pages]`` lets a sequence read prefix pages written
    under another lease). Entries for pages a sequence does not read are ignored.
``q``: ``[B, num_heads, head_dim]``, ``out``: ``[B, num_heads, head_dim_v]``, last dimensions
    contiguous; ``q`` may be fp8 over fp8 pools (dequantised by ``q_scale``), ``out`` is then
    bfloat16, float16 or float32 (:func:`output_dtype`: bfloat16 when kvattn allocates it);
    ``num_heads`` is a multiple of ``num_kv_heads`` (GQA: query head ``h`` reads KV
    head ``h // (num_heads // num_kv_heads)``).
``lse``: ``[B, num_heads]`` float32, natural-log sum of exp of the scaled logits; ``-inf`` for a
    sequence with no readable slot (whose output is 0).

Value checks (``seq_lens`` in ``[0, max_pages * page_size]``, expected owners in ``[1, 2**47)``, the
values of the variants' tensors of :mod:`kvattn.variants`) need the values on the host. They run
when the index tensors are on the CPU, or when ``validate=True`` (one device synchronisation). On a
GPU they are skipped by default, and the kernels fail closed on the same inputs: a ``seq_len`` past
the table reads nothing past it and counts one ``OUT_OF_RANGE`` violation, a negative ``seq_len``
reads nothing, owner 0 never matches a tag, and a head with an invalid sink, slope or KV scale
reads nothing.

Memory: a tensor a call writes shares no memory with any tensor it reads (``out`` with the inputs;
for the writers, the pools and tags with ``slot_mapping`` and the owners, the tags with the pools),
and no two of its elements share an address (no stride 0 over a dimension longer than 1); the
pools' elements are distinct too, so no two pages overlap. These checks read only shapes, strides
and pointers, so they run on every device.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .tags import OWNER_MAX
from .variants import FP8_DTYPES, MAX_SCALE, MIN_SCALE, PLAIN, Variant, check_values, check_variant

KV_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_PAGE_SIZE = 1024


class _PagedShapes:
    """Sizes read off validated tensors, shared by the argument records of every op."""

    @property
    def num_heads(self) -> int:
        return self.q.shape[1]

    @property
    def head_dim(self) -> int:
        return self.q.shape[2]

    @property
    def head_dim_v(self) -> int:
        """The value pool's head dim: that of ``out`` (``head_dim`` unless V has its own)."""
        return self.v_cache.shape[3]

    @property
    def num_pages(self) -> int:
        return self.k_cache.shape[0]

    @property
    def page_size(self) -> int:
        return self.k_cache.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k_cache.shape[2]

    @property
    def max_pages(self) -> int:
        return self.block_table.shape[1]

    @property
    def batch(self) -> int:
        return self.block_table.shape[0]

    @property
    def output_dtype(self) -> torch.dtype:
        """The output's dtype: the caller's ``out``'s, else :func:`output_dtype`'s."""
        return self.out_dtype or output_dtype(self.q)


@dataclass
class DecodeArgs(_PagedShapes):
    """Validated decode inputs. ``expected`` is always 2-D here (a stride-0 view for ``[B]``)."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    page_tags: torch.Tensor
    expected: torch.Tensor
    scale: float
    variant: Variant = PLAIN
    out_dtype: torch.dtype | None = None  # the caller's ``out``'s; None: :func:`output_dtype`'s
    verdict: object = None  # a current kvattn.PageVerdict the call reads instead of the tags


def _fail(name: str, expected: str, got) -> None:
    raise ValueError(f"{name}: expected {expected}, got {got}")


def check_tensor(name: str, t, *, ndim: int | None = None, dtypes=None, device=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        _fail(name, f"a {ndim}-D tensor", f"shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        names = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name}: expected dtype {names}, got {str(t.dtype).replace('torch.', '')}")
    if device is not None and t.device != device:
        _fail(name, f"a tensor on {device} (the device of q)", f"one on {t.device}")


def check_shape(name: str, t: torch.Tensor, shape: tuple) -> None:
    if tuple(t.shape) != tuple(shape):
        _fail(name, f"shape {tuple(shape)}", f"{tuple(t.shape)}")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        _fail(name, "a contiguous last dimension (stride 1)", f"strides {t.stride()}")


def _byte_span(t: torch.Tensor) -> tuple[int, int] | None:
    """``[first, end)`` byte addresses of ``t``'s elements; None when it has no element or no
    memory of its own (meta tensors, and the fake tensors of tracing, whose storage is meta)."""
    if t.is_meta or t.numel() == 0:
        return None
    if type(t) is not torch.Tensor:  # a subclass (the fake tensors of tracing) may have no memory
        try:
            if t.untyped_storage().device.type == "meta":
                return None
        except (RuntimeError, NotImplementedError):  # wrapper subclasses without a storage
            return None
    start = t.data_ptr()
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return start, start + (last + 1) * t.element_size()


def check_apart(name: str, t, others: dict) -> None:
    """``t`` shares no memory with any tensor of ``others`` (``{name: tensor or None}``).

    By address ranges: views that interleave with another tensor without sharing an element are
    refused too; a buffer a kernel writes has no reason to sit inside one it reads."""
    span = _byte_span(t) if isinstance(t, torch.Tensor) else None
    if span is None:
        return
    for other_name, other in others.items():
        if not isinstance(other, torch.Tensor) or other is t or other.device != t.device:
            continue
        o = _byte_span(other)
        if o is not None and span[0] < o[1] and o[0] < span[1]:
            _fail(
                name,
                f"a tensor sharing no memory with {other_name}",
                f"one whose bytes [{span[0]:#x}, {span[1]:#x}) overlap {other_name}'s "
                f"[{o[0]:#x}, {o[1]:#x})",
            )


def check_distinct_elements(name: str, t: torch.Tensor) -> None:
    """Every element of ``t`` has its own address: no stride 0 over a dimension longer than 1, no
    strides that fold rows onto each other. Sorted by stride, each dimension must step past all the
    smaller ones span (sufficient; an exotic layout that interleaves without overlap is refused)."""
    if t.numel() == 0:
        return
    reach = 0
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape) if n > 1):
        if stride <= reach:
            _fail(
                name,
                "a tensor whose elements do not overlap (no stride 0 over a dimension of "
                "size > 1, no rows folded onto each other)",
                f"shape {tuple(t.shape)} with strides {t.stride()}",
            )
        reach += stride * (size - 1)


def is_page_size(page_size) -> bool:
    """A page size kvattn supports: any size in ``[1, MAX_PAGE_SIZE]``."""
    return 1 <= page_size <= MAX_PAGE_SIZE


def check_pool_geometry(
    num_pages, page_size, num_kv_heads, head_dim, *, head_dim_name: str = "head_dim"
) -> None:
    """The geometry of a pool given as ints (:class:`kvattn.PagedKVCache`; ``head_dim_name``
    names the head dim in messages: ``head_dim_v`` for the value pool's own)."""
    for name, value in (
        ("num_pages", num_pages),
        ("page_size", page_size),
        ("num_kv_heads", num_kv_heads),
        (head_dim_name, head_dim),
    ):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
        if value < 1:
            _fail(name, "an int >= 1", value)
    if not is_page_size(page_size):
        _fail("page_size", f"an int in [1, {MAX_PAGE_SIZE}]", page_size)


def check_kv_pools(k_cache, v_cache, device=None) -> None:
    """Shape, dtype and stride checks of the two pools (the layout above)."""
    check_tensor("k_cache", k_cache, ndim=4, dtypes=KV_DTYPES + FP8_DTYPES, device=device)
    check_tensor("v_cache", v_cache, ndim=4, dtypes=KV_DTYPES + FP8_DTYPES, device=device)
    if tuple(v_cache.shape[:3]) != tuple(k_cache.shape[:3]) or v_cache.shape[3] < 1:
        _fail(
            "v_cache",
            f"shape ({', '.join(map(str, k_cache.shape[:3]))}, head_dim_v >= 1) "
            "(pages, slots and heads of k_cache)",
            f"{tuple(v_cache.shape)}",
        )
    if v_cache.dtype != k_cache.dtype:
        raise TypeError(
            f"v_cache: expected dtype {k_cache.dtype} (that of k_cache), got {v_cache.dtype}"
        )
    num_pages, page_size, num_kv_heads, head_dim = k_cache.shape
    if not is_page_size(page_size):
        _fail("k_cache", f"page_size (dim 1) in [1, {MAX_PAGE_SIZE}]", page_size)
    if num_pages < 1:
        _fail("k_cache", "at least one page (dim 0)", num_pages)
    if num_kv_heads < 1:
        _fail("k_cache", "at least one KV head (dim 2)", num_kv_heads)
    if head_dim < 1:
        _fail("k_cache", "head_dim (dim 3) >= 1", head_dim)
    check_last_dim_contiguous("k_cache", k_cache)
    check_last_dim_contiguous("v_cache", v_cache)
    check_distinct_elements("k_cache", k_cache)
    check_distinct_elements("v_cache", v_cache)


def check_page_tags(page_tags, num_pages: int, device=None) -> None:
    check_tensor("page_tags", page_tags, ndim=1, dtypes=(torch.int64,), device=device)
    check_shape("page_tags", page_tags, (num_pages,))
    if page_tags.stride(0) != 1:
        _fail("page_tags", "a contiguous tensor", f"stride {page_tags.stride()}")


def output_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype of the output kvattn allocates for ``q``: ``q``'s, bfloat16 for an fp8 ``q``
    (FlashAttention 3's, whose fp8 attention returns bfloat16)."""
    return torch.bfloat16 if q.dtype in FP8_DTYPES else q.dtype


def _check_query_and_pools(q, k_cache, v_cache) -> None:
    """``q`` (``[rows, num_heads, head_dim]``) against the pools: dtype, head_dim, GQA grouping."""
    check_tensor("q", q, ndim=3, dtypes=KV_DTYPES + FP8_DTYPES)
    if q.shape[1] < 1:
        _fail("q", "at least one head (dim 1)", f"shape {tuple(q.shape)}")
    if q.shape[2] < 1:
        _fail("q", "head_dim (dim 2) >= 1", f"shape {tuple(q.shape)}")
    check_kv_pools(k_cache, v_cache, q.device)
    if q.dtype in FP8_DTYPES and k_cache.dtype not in FP8_DTYPES:
        raise TypeError(
            f"k_cache: expected an fp8 dtype (an fp8 q reads fp8 pools), got {k_cache.dtype}"
        )
    if k_cache.dtype != q.dtype and k_cache.dtype not in FP8_DTYPES:
        raise TypeError(
            f"k_cache: expected dtype {q.dtype} (that of q) or an fp8 dtype, got {k_cache.dtype}"
        )
    num_heads, head_dim = q.shape[1:]
    num_kv_heads, kv_head_dim = k_cache.shape[2:]
    if kv_head_dim != head_dim:
        _fail("k_cache", f"head_dim {head_dim} (that of q) in dim 3", kv_head_dim)
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        _fail("k_cache", f"num_kv_heads (dim 2) dividing q's {num_heads} heads", num_kv_heads)
    check_last_dim_contiguous("q", q)


def _check_index_tensors(
    block_table, seq_lens, page_tags, expected, batch: int, num_pages: int, device
) -> torch.Tensor:
    """The block table, lengths, tags and expected owners; returns ``expected`` as ``[B, max_pages]``
    (a stride-0 view when given per sequence)."""
    check_tensor("block_table", block_table, ndim=2, dtypes=(torch.int32,), device=device)
    if block_table.shape[0] != batch or block_table.shape[1] < 1:
        _fail("block_table", f"shape ({batch}, max_pages >= 1)", f"{tuple(block_table.shape)}")
    check_last_dim_contiguous("block_table", block_table)
    max_pages = block_table.shape[1]
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,), device=device)
    check_shape("seq_lens", seq_lens, (batch,))
    check_last_dim_contiguous("seq_lens", seq_lens)
    check_page_tags(page_tags, num_pages, device)
    check_tensor("expected", expected, dtypes=(torch.int64,), device=device)
    if tuple(expected.shape) == (batch,):
        return expected[:, None].expand(batch, max_pages)
    if tuple(expected.shape) != (batch, max_pages):
        _fail("expected", f"shape ({batch},) or ({batch}, {max_pages})", f"{tuple(expected.shape)}")
    return expected


def _tensors_of(variant: dict) -> dict:
    """The tensors among a call's variant arguments (sinks, slopes, scales): read by the kernels
    while they write ``out``, so ``out`` must not overlap them either."""
    return {name: value for name, value in variant.items() if isinstance(value, torch.Tensor)}


def _check_scale_and_out(scale, out, q, inputs: dict, out_dim: int | None = None) -> float:
    """``scale`` (resolved, by default from q's head dim) and ``out`` (``q``'s rows and heads,
    ``out_dim`` wide: V's head dim; None: q's); ``inputs`` are the tensors the call reads, which
    ``out`` must not overlap (the output would land in a page its tag still certifies, or in the
    tags)."""
    if scale is None:
        scale = q.shape[2] ** -0.5
    elif (
        isinstance(scale, bool)
        or not isinstance(scale, (int, float))
        or not MIN_SCALE <= scale <= MAX_SCALE
    ):  # False for NaN; exact for ints of any size
        _fail("scale", "a positive finite float in [2**-126, 2**126] or None", repr(scale))
    if out is not None:
        dtypes = KV_DTYPES if q.dtype in FP8_DTYPES else (q.dtype,)
        check_tensor("out", out, ndim=3, dtypes=dtypes, device=q.device)
        check_shape("out", out, (*q.shape[:2], q.shape[2] if out_dim is None else out_dim))
        check_last_dim_contiguous("out", out)
        check_distinct_elements("out", out)
        check_apart("out", out, inputs)
    return float(scale)


def validate_decode(
    q,
    k_cache,
    v_cache,
    block_table,
    seq_lens,
    page_tags,
    expected,
    *,
    scale=None,
    out=None,
    validate=None,
    **variant,
) -> DecodeArgs:
    """Check every decode input against the layout above and the switches of
    :mod:`kvattn.variants` (``variant``: its keyword arguments); raise ValueError/TypeError naming
    the argument, what was expected and what was got. Returns the inputs in canonical form."""
    _check_query_and_pools(q, k_cache, v_cache)
    batch = q.shape[0]
    switches = check_variant(q, k_cache, batch, **variant)
    if batch < 1:
        _fail("q", "a batch of at least one sequence", f"shape {tuple(q.shape)}")
    inputs = dict(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_table=block_table,
        seq_lens=seq_lens,
        page_tags=page_tags,
        expected=expected,
        **_tensors_of(variant),
    )
    expected = _check_index_tensors(
        block_table, seq_lens, page_tags, expected, batch, k_cache.shape[0], q.device
    )
    scale = _check_scale_and_out(scale, out, q, inputs, v_cache.shape[3])
    if validate is None:
        validate = q.device.type == "cpu"
    if validate:
        check_lengths_and_owners(seq_lens, expected, k_cache.shape[1], block_table.shape[1])
        check_values(switches)
    return DecodeArgs(
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        page_tags,
        expected,
        scale,
        switches,
        None if out is None else out.dtype,
    )


def check_lengths_and_owners(seq_lens, expected, page_size: int, max_pages: int) -> None:
    """The value checks of the layout (host-side: synchronises on a device tensor)."""
    lens = seq_lens.cpu().to(torch.int64)
    capacity = max_pages * page_size
    bad = torch.nonzero((lens < 0) | (lens > capacity)).flatten()
    if bad.numel():
        b = int(bad[0])
        _fail(
            "seq_lens",
            f"lengths in [0, {capacity}] (max_pages {max_pages} x page_size "
            f"{page_size}) for every sequence",
            f"seq_lens[{b}] = {int(lens[b])}",
        )
    pages_read = (lens + page_size - 1) // page_size
    read = torch.arange(max_pages)[None, :] < pages_read[:, None]
    owners = expected.cpu()
    bad = torch.nonzero(read & ((owners < 1) | (owners > OWNER_MAX)))
    if bad.numel():
        b, i = (int(x) for x in bad[0])
        _fail(
            "expected",
            f"owner ids in [1, {OWNER_MAX}] for every page read",
            f"expected[{b}, {i}] = {int(owners[b, i])}",
        )


@dataclass
class ExtendArgs(_PagedShapes):
    """Validated extend (chunked prefill) inputs; ``expected`` is 2-D as in :class:`DecodeArgs`.

    Ragged batch: sequence ``b`` owns query rows ``cu_seqlens_q[b] .. cu_seqlens_q[b + 1]`` of
    ``q`` ``[total_q, num_heads, head_dim]``. ``seq_lens[b]`` counts every token of the sequence in
    pages, the new ones included (their K/V were appended first), so the new tokens are the last
    ``q_len_b`` tokens: query row ``j`` of ``b`` sits at position ``seq_lens[b] - q_len_b + j``.
    ``rows_covered``: ``cu_seqlens_q`` passed :func:`check_query_offsets`, so every row of ``q``
    belongs to a sequence (False when the value checks were skipped: it may not).
    """

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cu_seqlens_q: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    page_tags: torch.Tensor
    expected: torch.Tensor
    scale: float
    causal: bool
    rows_covered: bool = False
    variant: Variant = PLAIN
    out_dtype: torch.dtype | None = None  # the caller's ``out``'s; None: :func:`output_dtype`'s

    @property
    def total_q(self) -> int:
        return self.q.shape[0]


def validate_extend(
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
    out=None,
    validate=None,
    custom_mask=None,
    **variant,
) -> ExtendArgs:
    """Check every extend input against the layout above (``q`` is ``[total_q, num_heads,
    head_dim]`` here, ``out`` ``[total_q, num_heads, head_dim_v]``, ``cu_seqlens_q`` ``[B + 1]``
    int32); raise ValueError/TypeError naming the argument, what was expected and what was got.

    Value checks (with ``validate``, default on CPU tensors): those of decode, plus
    ``cu_seqlens_q`` starting at 0, non-decreasing and ending at ``total_q``, and, when causal,
    every sequence holding at least its query tokens (``seq_lens[b] >= q_len_b``), and a
    ``custom_mask`` as long as its blocks (:func:`check_mask_length`). Skipped, the kernels fail
    closed: see :func:`kvattn.paged_extend`. ``variant``: as in :func:`validate_decode`;
    ``custom_mask``: :mod:`kvattn.variants`, extend only.
    """
    _check_query_and_pools(q, k_cache, v_cache)
    batch = _check_ragged_rows(cu_seqlens_q, block_table, q.device)
    switches = check_variant(q, k_cache, batch, **variant)
    max_pages = block_table.shape[1]
    inputs = dict(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        cu_seqlens_q=cu_seqlens_q,
        block_table=block_table,
        seq_lens=seq_lens,
        page_tags=page_tags,
        expected=expected,
        custom_mask=custom_mask,
        **_tensors_of(variant),
    )
    expected = _check_index_tensors(
        block_table, seq_lens, page_tags, expected, batch, k_cache.shape[0], q.device
    )
    scale = _check_scale_and_out(scale, out, q, inputs, v_cache.shape[3])
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    if validate is None:
        validate = q.device.type == "cpu"
    if validate:
        check_query_offsets(cu_seqlens_q, seq_lens, q.shape[0], causal)
        check_lengths_and_owners(seq_lens, expected, k_cache.shape[1], max_pages)
        check_values(switches)
    if custom_mask is not None:
        switches = with_custom_mask(switches, custom_mask, cu_seqlens_q, seq_lens, q.shape[0])
        if validate:
            check_mask_length(custom_mask, cu_seqlens_q, seq_lens, q.shape[0])
    return ExtendArgs(
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
        rows_covered=bool(validate),
        variant=switches,
        out_dtype=None if out is None else out.dtype,
    )


def _check_ragged_rows(cu_seqlens_q, block_table, device) -> int:
    """The block table's batch and ``cu_seqlens_q`` ``[B + 1]`` int32 against it; returns B."""
    check_tensor("block_table", block_table, ndim=2, dtypes=(torch.int32,), device=device)
    batch = block_table.shape[0]
    if batch < 1:
        _fail("block_table", "shape (B >= 1, max_pages >= 1)", f"{tuple(block_table.shape)}")
    check_tensor("cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=(torch.int32,), device=device)
    check_shape("cu_seqlens_q", cu_seqlens_q, (batch + 1,))
    check_last_dim_contiguous("cu_seqlens_q", cu_seqlens_q)
    return batch


def check_query_offsets(cu_seqlens_q, seq_lens, total_q: int, causal: bool = True) -> None:
    """The value checks of ``cu_seqlens_q`` (host-side: synchronises on a device tensor). Causal
    attention needs every query's own key in the pages (``seq_lens[b] >= q_len_b``); without
    causality a sequence may have more query rows than keys (each row reads all of them)."""
    cu = cu_seqlens_q.cpu().to(torch.int64)
    if int(cu[0]) != 0:
        _fail("cu_seqlens_q", "cu_seqlens_q[0] = 0", f"cu_seqlens_q[0] = {int(cu[0])}")
    q_lens = cu[1:] - cu[:-1]
    bad = torch.nonzero(q_lens < 0).flatten()
    if bad.numel():
        b = int(bad[0])
        _fail(
            "cu_seqlens_q",
            "non-decreasing offsets",
            f"cu_seqlens_q[{b + 1}] = {int(cu[b + 1])} < cu_seqlens_q[{b}] = {int(cu[b])}",
        )
    if int(cu[-1]) != total_q:
        _fail(
            "cu_seqlens_q",
            f"a last offset equal to total_q = {total_q} (q's dim 0)",
            f"cu_seqlens_q[-1] = {int(cu[-1])}",
        )
    if not causal:
        return
    lens = seq_lens.cpu().to(torch.int64)
    bad = torch.nonzero(q_lens > lens).flatten()
    if bad.numel():
        b = int(bad[0])
        _fail(
            "seq_lens",
            "each length to include the sequence's new query tokens "
            "(seq_lens[b] >= cu_seqlens_q[b + 1] - cu_seqlens_q[b])",
            f"seq_lens[{b}] = {int(lens[b])} with {int(q_lens[b])} query tokens",
        )


def query_offsets(cu_seqlens_q: torch.Tensor, total_q: int) -> torch.Tensor:
    """``[B + 1]`` int64 offsets the kernels use: ``cu_seqlens_q`` clamped to ``[0, total_q]`` and
    made non-decreasing (device ops, no synchronisation). Equal to ``cu_seqlens_q`` when it passes
    :func:`check_query_offsets`; otherwise every row a kernel touches still lies inside ``q`` and
    belongs to one sequence only, and rows outside every sequence (before ``offsets[0]`` or from
    ``offsets[-1]`` on) are not written by the kernels."""
    return torch.cummax(cu_seqlens_q.long().clamp(0, total_q), dim=0).values


def with_custom_mask(
    variant: Variant, custom_mask, cu_seqlens_q, seq_lens, total_q: int
) -> Variant:
    """``variant`` with ``custom_mask`` (:mod:`kvattn.variants`) and the start of each sequence's
    block (``mask_start`` ``[B]`` int64: the running sum of ``q_len_b * max(seq_lens[b], 0)`` over
    the offsets of :func:`query_offsets`; device ops, no synchronisation)."""
    check_tensor(
        "custom_mask", custom_mask, ndim=1, dtypes=(torch.bool,), device=cu_seqlens_q.device
    )
    check_last_dim_contiguous("custom_mask", custom_mask)
    offsets = query_offsets(cu_seqlens_q, total_q)
    sizes = (offsets[1:] - offsets[:-1]) * seq_lens.long().clamp(min=0)
    start = torch.cumsum(sizes, 0) - sizes
    return replace(variant, custom_mask=custom_mask, mask_start=start)


def check_mask_length(custom_mask, cu_seqlens_q, seq_lens, total_q: int) -> None:
    """A ``custom_mask`` holds exactly its blocks, ``sum_b q_len_b * seq_lens[b]`` elements, for
    lengths and offsets that passed their own checks (host-side: synchronises on a device
    tensor)."""
    offsets = query_offsets(cu_seqlens_q, total_q).cpu()
    need = int(((offsets[1:] - offsets[:-1]) * seq_lens.cpu().long().clamp(min=0)).sum())
    if custom_mask.numel() != need:
        _fail(
            "custom_mask",
            f"{need} elements (the sum over sequences of q_len * seq_len)",
            f"{custom_mask.numel()}",
        )


MAX_SPLITS_GRID = 65535  # the grid dimension the decode kernels put their splits on


class _LatentShapes(_PagedShapes):
    """Sizes of a latent (MLA) call: the one latent pool serves as the key pool."""

    @property
    def k_cache(self) -> torch.Tensor:
        """The latent pool as the key pool (the registry reads the device of ``k_cache``)."""
        return self.kv_cache

    @property
    def rope_dim(self) -> int:
        return self.head_dim - self.kv_lora_rank


@dataclass
class MLADecodeArgs(_LatentShapes):
    """Validated MLA paged-decode inputs (multi-head latent attention, DeepSeek V2/V3 style, with
    the queries already absorbed into the latent space as FlashMLA and vLLM's MLA backends take
    them). ``expected`` is 2-D as in :class:`DecodeArgs`.

    Latent layout: ``kv_cache`` ``[num_pages, page_size, 1, kv_lora_rank + rope_dim]`` (512 + 64 in
    DeepSeek V2/V3, pages of 64 tokens in the peers' kernels), one dtype (float16, bfloat16 or
    float32), last dimension contiguous, any other strides (a per-layer view of a larger buffer).
    One row per token serves as the key (all ``kv_lora_rank + rope_dim`` dims) and as the value
    (its first ``kv_lora_rank`` dims, the compressed latent; the rest is the decoupled RoPE key).
    ``q`` ``[B, num_heads, kv_lora_rank + rope_dim]`` (the absorbed no-PE part, then the RoPE part),
    ``out`` ``[B, num_heads, kv_lora_rank]``, ``lse`` ``[B, num_heads]``. Every query head reads
    the one latent head (MQA). ``page_tags``, ``block_table``, ``seq_lens`` and ``expected`` are
    those of the paged layout above, one tag per page: the reader's rule and the report are
    decode's. ``num_splits``: the split-KV count asked for (None: the planner's).
    """

    q: torch.Tensor
    kv_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    page_tags: torch.Tensor
    expected: torch.Tensor
    scale: float
    kv_lora_rank: int
    num_splits: int | None = None


@dataclass
class MLAExtendArgs(_LatentShapes):
    """Validated MLA extend inputs: the latent layout of :class:`MLADecodeArgs` with the ragged
    query rows of :class:`ExtendArgs` (``q`` ``[total_q, num_heads, kv_lora_rank + rope_dim]``,
    ``out`` ``[total_q, num_heads, kv_lora_rank]``, ``lse`` ``[total_q, num_heads]``; sequence
    ``b`` owns rows ``cu_seqlens_q[b] .. cu_seqlens_q[b + 1]``, the last ``q_len_b`` of its
    ``seq_lens[b]`` tokens, whose latent rows are already in the pages). ``rows_covered`` as in
    :class:`ExtendArgs`."""

    q: torch.Tensor
    kv_cache: torch.Tensor
    cu_seqlens_q: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    page_tags: torch.Tensor
    expected: torch.Tensor
    scale: float
    kv_lora_rank: int
    causal: bool
    rows_covered: bool = False

    @property
    def total_q(self) -> int:
        return self.q.shape[0]

    def as_extend(self) -> ExtendArgs:
        """The same call as a plain extend over one KV head whose key and value rows are both the
        whole latent row (the output's first ``kv_lora_rank`` dims are then MLA's output)."""
        return ExtendArgs(
            self.q,
            self.kv_cache,
            self.kv_cache,
            self.cu_seqlens_q,
            self.block_table,
            self.seq_lens,
            self.page_tags,
            self.expected,
            self.scale,
            self.causal,
            self.rows_covered,
        )


def _check_latent_query(q, kv_lora_rank, rows: str | None) -> None:
    """``q`` ``[rows, num_heads, kv_lora_rank + rope_dim]`` and ``kv_lora_rank`` within it
    (``rows``: what dim 0 must hold, for the message; None: any count, as extend's rows)."""
    check_tensor("q", q, ndim=3, dtypes=KV_DTYPES)
    if rows is not None and q.shape[0] < 1:
        _fail("q", rows, f"shape {tuple(q.shape)}")
    if q.shape[1] < 1:
        _fail("q", "at least one head (dim 1)", f"shape {tuple(q.shape)}")
    if isinstance(kv_lora_rank, bool) or not isinstance(kv_lora_rank, int):
        raise TypeError(f"kv_lora_rank: expected an int, got {type(kv_lora_rank).__name__}")
    if not 1 <= kv_lora_rank <= q.shape[2]:
        _fail(
            "kv_lora_rank",
            f"an int in [1, {q.shape[2]}] (q's dim 2 = kv_lora_rank + rope_dim)",
            kv_lora_rank,
        )
    check_last_dim_contiguous("q", q)


def _check_latent_pool(kv_cache, q) -> None:
    """``kv_cache`` against the latent layout of :class:`MLADecodeArgs` and against ``q``."""
    check_tensor("kv_cache", kv_cache, ndim=4, dtypes=KV_DTYPES, device=q.device)
    if kv_cache.dtype != q.dtype:
        raise TypeError(f"kv_cache: expected dtype {q.dtype} (that of q), got {kv_cache.dtype}")
    num_pages, page_size, num_latent_heads, dim = kv_cache.shape
    if num_pages < 1:
        _fail("kv_cache", "at least one page (dim 0)", num_pages)
    if not is_page_size(page_size):
        _fail("kv_cache", f"page_size (dim 1) in [1, {MAX_PAGE_SIZE}]", page_size)
    if num_latent_heads != 1:
        _fail("kv_cache", "one latent head (dim 2 of size 1)", f"shape {tuple(kv_cache.shape)}")
    if dim != q.shape[2]:
        _fail("kv_cache", f"kv_lora_rank + rope_dim = {q.shape[2]} (q's dim 2) in dim 3", dim)
    check_last_dim_contiguous("kv_cache", kv_cache)
    check_distinct_elements("kv_cache", kv_cache)


def _check_latent_out(out, q, kv_lora_rank: int, inputs: dict) -> None:
    if out is None:
        return
    check_tensor("out", out, ndim=3, dtypes=(q.dtype,), device=q.device)
    check_shape("out", out, (*q.shape[:2], kv_lora_rank))
    check_last_dim_contiguous("out", out)
    check_distinct_elements("out", out)
    check_apart("out", out, inputs)


def validate_mla_decode(
    q,
    kv_cache,
    block_table,
    seq_lens,
    page_tags,
    expected,
    *,
    kv_lora_rank=512,
    scale=None,
    out=None,
    validate=None,
    num_splits=None,
) -> MLADecodeArgs:
    """Check every MLA decode input against the latent layout of :class:`MLADecodeArgs` and the
    paged layout above; raise ValueError/TypeError naming the argument, what was expected and what
    was got. ``scale`` defaults to ``(kv_lora_rank + rope_dim) ** -0.5`` (FlashMLA's default;
    DeepSeek models pass their own). Value checks as for decode."""
    _check_latent_query(q, kv_lora_rank, "a batch of at least one sequence")
    _check_latent_pool(kv_cache, q)
    if num_splits is not None and (
        isinstance(num_splits, bool)
        or not isinstance(num_splits, int)
        or not 1 <= num_splits <= MAX_SPLITS_GRID
    ):
        _fail("num_splits", f"None or an int in [1, {MAX_SPLITS_GRID}]", repr(num_splits))
    inputs = dict(
        q=q,
        kv_cache=kv_cache,
        block_table=block_table,
        seq_lens=seq_lens,
        page_tags=page_tags,
        expected=expected,
    )
    expected = _check_index_tensors(
        block_table, seq_lens, page_tags, expected, q.shape[0], kv_cache.shape[0], q.device
    )
    scale = _check_scale_and_out(scale, None, q, inputs)
    _check_latent_out(out, q, kv_lora_rank, inputs)
    if validate is None:
        validate = q.device.type == "cpu"
    if validate:
        check_lengths_and_owners(seq_lens, expected, kv_cache.shape[1], block_table.shape[1])
    return MLADecodeArgs(
        q, kv_cache, block_table, seq_lens, page_tags, expected, scale, kv_lora_rank, num_splits
    )


def validate_mla_extend(
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
    out=None,
    validate=None,
) -> MLAExtendArgs:
    """Check every MLA extend input against :class:`MLAExtendArgs` (the latent layout, the ragged
    rows of extend); raise ValueError/TypeError naming the argument, what was expected and what
    was got. ``scale`` as in :func:`validate_mla_decode`; value checks those of
    :func:`validate_extend`."""
    _check_latent_query(q, kv_lora_rank, None)
    _check_latent_pool(kv_cache, q)
    batch = _check_ragged_rows(cu_seqlens_q, block_table, q.device)
    inputs = dict(
        q=q,
        kv_cache=kv_cache,
        cu_seqlens_q=cu_seqlens_q,
        block_table=block_table,
        seq_lens=seq_lens,
        page_tags=page_tags,
        expected=expected,
    )
    expected = _check_index_tensors(
        block_table, seq_lens, page_tags, expected, batch, kv_cache.shape[0], q.device
    )
    scale = _check_scale_and_out(scale, None, q, inputs)
    _check_latent_out(out, q, kv_lora_rank, inputs)
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    if validate is None:
        validate = q.device.type == "cpu"
    if validate:
        check_query_offsets(cu_seqlens_q, seq_lens, q.shape[0], causal)
        check_lengths_and_owners(seq_lens, expected, kv_cache.shape[1], block_table.shape[1])
    return MLAExtendArgs(
        q,
        kv_cache,
        cu_seqlens_q,
        block_table,
        seq_lens,
        page_tags,
        expected,
        scale,
        kv_lora_rank,
        causal,
        rows_covered=bool(validate),
    )
