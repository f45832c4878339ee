"""The public operations. Arguments are validated once here; the math lives in the backends."""

from __future__ import annotations

import torch

from . import backends
from .layout import (
    output_dtype,
    validate_decode,
    validate_extend,
    validate_mla_decode,
    validate_mla_extend,
)
from .report import OwnershipReport
from .verdict import PageVerdict, usable


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_tags: torch.Tensor,
    expected: torch.Tensor,
    *,
    scale: float | None = None,
    check: bool = True,
    on_violation: str = "report",
    backend: str = "auto",
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    validate: bool | None = None,
    window_left: int = -1,
    logits_soft_cap: float = 0.0,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    k_scale=None,
    v_scale=None,
    q_scale=None,
    verdict: PageVerdict | None = None,
):
    """Ownership-checked paged attention for one new query token per sequence.

    Shapes, dtypes and the paged layout are defined once in :mod:`kvattn.layout`; the tag format in
    :mod:`kvattn.tags`. Slot ``s`` of logical page ``i`` of sequence ``b`` contributes only if the
    page id ``p = block_table[b, i]`` is in range, ``page_tags[p]`` is WRITTEN for owner
    ``expected[b, i]`` (or ``expected[b]``), ``s`` is below the page's ``valid_len``, and the token
    lies inside ``seq_lens[b]`` (docs/ownership.md section 3). Refused slots have logit -inf; a
    sequence with nothing readable gets output 0 and lse -inf.

    Args:
        q: ``[B, num_heads, head_dim]`` query of the new token (fp8 over fp8 pools with
            ``q_scale``).
        k_cache, v_cache: the page pools (may be strided views; never copied); ``v_cache`` may
            have a head dim of its own, ``head_dim_v``, which is the output's.
        block_table: ``[B, max_pages]`` int32 logical-to-physical page map.
        seq_lens: ``[B]`` int32 tokens per sequence, the new token's K/V included.
        page_tags: ``[num_pages]`` int64 page tags.
        expected: ``[B]`` or ``[B, max_pages]`` int64 owner ids the pages must carry.
        scale: logit scale; default ``head_dim ** -0.5``.
        check: False runs the unchecked variant (same kernel, check compiled out, no report).
        on_violation: ``"report"`` returns the report; ``"raise"`` also synchronises and raises
            :class:`kvattn.KVOwnershipError` if any page was refused (the output is written first).
        backend: ``"auto"``, ``"cuda"``, ``"triton"``, ``"torch"``, ``"reference"`` (or
            ``"cpu"``, the compiled CPU readers, and ``"cuda_sim"`` on CPU tensors); see
            :mod:`kvattn.backends` (``KVATTN_BACKEND`` overrides ``"auto"``).
        out: optional ``[B, num_heads, head_dim_v]`` output buffer (dtype of ``q``; for an fp8
            ``q`` bfloat16, float16 or float32, bfloat16 when allocated here).
        return_lse: also return the ``[B, num_heads]`` float32 natural-log LSE.
        validate: run the value checks of :mod:`kvattn.layout` (default: only when the tensors are
            on the CPU, where they cost no device synchronisation).
        window_left, logits_soft_cap, sinks, alibi_slopes, k_scale, v_scale, q_scale: the
            attention variants (sliding window, soft-cap, attention sinks, ALiBi, fp8 KV and query
            dequantisation), defined in :mod:`kvattn.variants`; all off by default.
        verdict: a :class:`kvattn.PageVerdict` of this decode step (:func:`kvattn.resolve_pages`):
            every page but the new token's is read through it, without its block-table entry or
            tag, and the report returned is the verdict's, to which this call adds the new token's
            page if its tag refuses it (docs/ownership.md section 9). A verdict the writers made
            stale (a reserve, reassign or release since it was resolved) is not read: the call
            checks every page itself. One resolved for other tensors, page size or window is a
            ``ValueError``; so is a verdict with ``check=False``.

    Returns:
        ``(out, report)``, or ``(out, lse, report)`` with ``return_lse``. ``report`` is an
        :class:`kvattn.OwnershipReport` in device memory (no host sync), None when ``check=False``.

    Raises:
        ValueError, TypeError: malformed inputs, naming the argument, the expected and the actual.
        KVOwnershipError: with ``on_violation="raise"`` when a page was refused.
    """
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
        out=out,
        validate=validate,
        window_left=window_left,
        logits_soft_cap=logits_soft_cap,
        sinks=sinks,
        alibi_slopes=alibi_slopes,
        k_scale=k_scale,
        v_scale=v_scale,
        q_scale=q_scale,
    )
    if verdict is not None and usable(verdict, args, check):
        args.verdict = verdict
    return _run("decode", args, backend, check, on_violation, out, return_lse, args.head_dim_v)


def paged_extend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_tags: torch.Tensor,
    expected: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
    check: bool = True,
    on_violation: str = "report",
    backend: str = "auto",
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    validate: bool | None = None,
    window_left: int = -1,
    logits_soft_cap: float = 0.0,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    k_scale=None,
    v_scale=None,
    custom_mask: torch.Tensor | None = None,
    window_right: int = -1,
    q_scale=None,
):
    """Ownership-checked paged attention for a ragged batch of new query tokens (chunked prefill,
    prefill over a cached prefix).

    Sequence ``b`` owns query rows ``cu_seqlens_q[b] .. cu_seqlens_q[b + 1]`` (``q_len_b`` of them).
    ``seq_lens[b]`` is the sequence's full length *including* those tokens, whose K/V must already
    be appended to the pages (:func:`kvattn.write_kv`), so every key and value the call reads comes
    from pages and passes the check. The new tokens are the last ``q_len_b`` tokens: query row
    ``j`` sits at position ``seq_lens[b] - q_len_b + j`` and, with ``causal``, attends to keys at
    positions up to its own (causal masking aligned to the end of the sequence); without it, to all
    ``seq_lens[b]`` keys, and a sequence may then have more query rows than keys (cross-attention
    style, as FlashInfer allows). GQA, the reader's rule, the masking of refused slots and the report are
    those of :func:`kvattn.paged_decode` (docs/ownership.md section 3): every logical page covering
    ``[0, seq_lens[b])`` is checked and, if refused, counted once for the sequence however many
    query rows read it; the report equals decode's for the same ``seq_lens``. A row with nothing
    readable gets output 0 and lse -inf.

    Malformed lengths (value checks, run on CPU tensors or with ``validate=True``): a causal
    sequence with more query tokens than tokens (``q_len_b > seq_lens[b]``, its K/V cannot all be
    in pages) is a ``ValueError``; unvalidated, that sequence fails closed: none of its rows reads
    anything (output
    0, lse -inf) while its pages are still checked and reported. ``cu_seqlens_q`` that does not
    start at 0, decreases or does not end at ``total_q`` is a ``ValueError``; unvalidated, it is
    clamped to ``[0, total_q]`` and made non-decreasing, so no row outside ``q`` is touched; rows no
    sequence covers get output 0 and lse -inf when kvattn allocates the output (``out=None``; the
    lse is always kvattn's), and are left unwritten in a caller's ``out``, on every backend.
    ``seq_lens`` past the table count as in decode.

    Args:
        q: ``[total_q, num_heads, head_dim]`` queries of the new tokens, sequence by sequence
            (fp8 over fp8 pools with ``q_scale``).
        k_cache, v_cache: the page pools (:mod:`kvattn.layout`; may be strided views; never
            copied); ``v_cache`` may have a head dim of its own, ``head_dim_v``, the output's.
        cu_seqlens_q: ``[B + 1]`` int32 row offsets of the sequences in ``q``.
        block_table: ``[B, max_pages]`` int32 logical-to-physical page map.
        seq_lens: ``[B]`` int32 tokens per sequence, the new ones included.
        page_tags: ``[num_pages]`` int64 page tags.
        expected: ``[B]`` or ``[B, max_pages]`` int64 owner ids the pages must carry (per entry for a
            prefix shared from another lease).
        scale: logit scale; default ``head_dim ** -0.5``.
        causal: mask keys after each query's position (default True).
        check: False runs the unchecked variant (same kernel, check compiled out, no report).
        on_violation: ``"report"`` or ``"raise"`` (synchronises; raises
            :class:`kvattn.KVOwnershipError` after writing the output).
        backend: ``"auto"``, ``"cuda"``, ``"triton"``, ``"torch"``, ``"reference"`` (or
            ``"cpu"``, the compiled CPU readers, and ``"cuda_sim"`` on CPU tensors); see
            :mod:`kvattn.backends`.
        out: optional ``[total_q, num_heads, head_dim_v]`` output buffer (dtype of ``q``; for an
            fp8 ``q`` as in :func:`paged_decode`).
        return_lse: also return the ``[total_q, num_heads]`` float32 natural-log LSE.
        validate: run the value checks (default: only on CPU tensors, where they cost no sync).
        window_left, logits_soft_cap, sinks, alibi_slopes, k_scale, v_scale, q_scale: the
            attention variants of :mod:`kvattn.variants`, as in :func:`paged_decode`. With a
            sliding window each row reads its own window; the pages checked (and reported) are
            those holding a key some row of the sequence reads.
        custom_mask: 1-D bool, FlashInfer's layout: per sequence a row-major ``[q_len_b,
            seq_lens[b]]`` block of which keys each query row may read (tree attention for
            speculative decoding), ANDed with every other mask; see :mod:`kvattn.variants`.
        window_right: the window's right edge (FlashAttention's two-sided local attention, for
            ``causal=False``): each row reads keys up to ``window_right`` after its position; -1
            (default) is no edge. Pages checked are unchanged; see :mod:`kvattn.variants`.

    Returns:
        ``(out, report)``, or ``(out, lse, report)`` with ``return_lse``; ``report`` is an
        :class:`kvattn.OwnershipReport` in device memory, None when ``check=False``.

    Raises:
        ValueError, TypeError: malformed inputs, naming the argument, the expected and the actual.
        KVOwnershipError: with ``on_violation="raise"`` when a page was refused.
    """
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
        out=out,
        validate=validate,
        window_left=window_left,
        logits_soft_cap=logits_soft_cap,
        sinks=sinks,
        alibi_slopes=alibi_slopes,
        k_scale=k_scale,
        v_scale=v_scale,
        custom_mask=custom_mask,
        window_right=window_right,
        q_scale=q_scale,
    )
    return _run("extend", args, backend, check, on_violation, out, return_lse, args.head_dim_v)


def check_mode(check, on_violation) -> None:
    if on_violation not in ("report", "raise"):
        raise ValueError(f"on_violation: expected 'report' or 'raise', got {on_violation!r}")
    if not isinstance(check, bool):
        raise TypeError(f"check: expected a bool, got {type(check).__name__}")
    if not check and on_violation == "raise":
        raise ValueError(
            "on_violation: expected 'report' when check=False (nothing is checked), got 'raise'"
        )


def _run(
    op: str,
    args,
    backend: str,
    check: bool,
    on_violation: str,
    out,
    return_lse: bool,
    out_dim: int | None = None,
):
    """Pick the backend for ``op``, allocate what the caller did not give, launch, report.
    ``out_dim``: the output's last dim when it is not ``q``'s (V's head dim; MLA's
    ``kv_lora_rank``)."""
    impl = backends.select(args, backend, op=op)
    q = args.q
    # Unvalidated extend offsets may leave rows no sequence covers, which no kernel writes: what
    # kvattn allocates is then filled first, so no stale memory of the allocator comes back.
    uncovered = op in ("extend", "mla_extend") and not args.rows_covered
    if out is None:
        shape = (*q.shape[:2], q.shape[2] if out_dim is None else out_dim)
        out = (torch.zeros if uncovered else torch.empty)(
            shape, dtype=output_dtype(q), device=q.device
        )
    lse = None
    if return_lse:
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        if uncovered:
            lse.fill_(float("-inf"))
    report: OwnershipReport | None = getattr(impl, op)(args, check=check, out=out, lse=lse)
    if on_violation == "raise":
        report.raise_if_any()
    return (out, lse, report) if return_lse else (out, report)


def paged_mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_tags: torch.Tensor,
    expected: torch.Tensor,
    *,
    kv_lora_rank: int = 512,
    scale: float | None = None,
    check: bool = True,
    on_violation: str = "report",
    backend: str = "auto",
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    validate: bool | None = None,
    num_splits: int | None = None,
):
    """Ownership-checked paged MLA decode (multi-head latent attention, DeepSeek V2/V3 style) for
    one new query token per sequence, with the queries already absorbed into the latent space (as
    FlashMLA and vLLM's MLA backends take them).

    The latent layout is defined in :class:`kvattn.layout.MLADecodeArgs`: one row of
    ``kv_lora_rank + rope_dim`` dims per token (512 + 64 in DeepSeek V2/V3) is the key of every
    query head, its first ``kv_lora_rank`` dims the value. One tag per page, and the reader's rule,
    the masking of refused slots and the report of :func:`kvattn.paged_decode` (docs/ownership.md
    section 3): slot ``s`` of logical page ``i`` of sequence ``b`` contributes only if the page id
    is in range, its tag is WRITTEN for owner ``expected[b, i]`` (or ``expected[b]``), ``s`` is
    below the page's ``valid_len`` and the token lies inside ``seq_lens[b]``. A sequence with
    nothing readable gets output 0 and lse -inf.

    Args:
        q: ``[B, num_heads, kv_lora_rank + rope_dim]``: the absorbed no-PE query, then its RoPE part.
        kv_cache: ``[num_pages, page_size, 1, kv_lora_rank + rope_dim]`` latent pool (may be a
            strided view; never copied).
        block_table: ``[B, max_pages]`` int32 logical-to-physical page map.
        seq_lens: ``[B]`` int32 tokens per sequence, the new token's latent row included.
        page_tags: ``[num_pages]`` int64 page tags.
        expected: ``[B]`` or ``[B, max_pages]`` int64 owner ids the pages must carry.
        kv_lora_rank: the value dims at the front of each latent row (default 512).
        scale: logit scale; default ``(kv_lora_rank + rope_dim) ** -0.5`` (FlashMLA's default;
            DeepSeek models pass their own softmax scale).
        check: False runs the unchecked variant (same kernel, check compiled out, no report).
        on_violation: ``"report"`` or ``"raise"`` (synchronises; raises
            :class:`kvattn.KVOwnershipError` after writing the output).
        backend: ``"auto"``, ``"cuda"``, ``"triton"`` or ``"reference"`` (or ``"cuda_sim"`` on
            CPU tensors); see :mod:`kvattn.backends`.
        out: optional ``[B, num_heads, kv_lora_rank]`` output buffer (dtype of ``q``).
        return_lse: also return the ``[B, num_heads]`` float32 natural-log LSE.
        validate: run the value checks of :mod:`kvattn.layout` (default: only on CPU tensors).
        num_splits: split-KV programs per sequence and head block (default: planned from the
            device's occupancy; the reference ignores it).

    Returns:
        ``(out, report)``, or ``(out, lse, report)`` with ``return_lse``; ``report`` is an
        :class:`kvattn.OwnershipReport` in device memory, None when ``check=False``.

    Raises:
        ValueError, TypeError: malformed inputs, naming the argument, the expected and the actual.
        KVOwnershipError: with ``on_violation="raise"`` when a page was refused.
    """
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
        out=out,
        validate=validate,
        num_splits=num_splits,
    )
    return _run("mla_decode", args, backend, check, on_violation, out, return_lse, kv_lora_rank)


def paged_mla_extend(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_tags: torch.Tensor,
    expected: torch.Tensor,
    *,
    kv_lora_rank: int = 512,
    scale: float | None = None,
    causal: bool = True,
    check: bool = True,
    on_violation: str = "report",
    backend: str = "auto",
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    validate: bool | None = None,
):
    """Ownership-checked paged MLA attention for a ragged batch of new query tokens (chunked
    prefill, prefill over a cached prefix, the verify step of speculative decoding) on DeepSeek
    V2/V3's latent cache, with absorbed queries as in :func:`paged_mla_decode` (FlashInfer's MLA
    attention with ``qo_len > 1``).

    The latent layout is :class:`kvattn.layout.MLADecodeArgs`'s and the rows those of
    :func:`paged_extend` (:class:`kvattn.layout.MLAExtendArgs`): sequence ``b`` owns query rows
    ``cu_seqlens_q[b] .. cu_seqlens_q[b + 1]``, the last ``q_len_b`` of its ``seq_lens[b]``
    tokens, whose latent rows are already in the pages; row ``j`` sits at position ``seq_lens[b] -
    q_len_b + j`` and, with ``causal``, reads the latent rows up to its own. Every query head reads
    the one latent row per token, all of it as the key and its first ``kv_lora_rank`` dims as the
    value. The reader's rule, the masking, the report (equal to decode's for the same
    ``seq_lens``: each page counted once per sequence) and the handling of malformed lengths and
    offsets are :func:`paged_extend`'s. A row with nothing readable gets output 0 and lse -inf.

    Args:
        q: ``[total_q, num_heads, kv_lora_rank + rope_dim]``: absorbed no-PE queries, then RoPE.
        kv_cache: ``[num_pages, page_size, 1, kv_lora_rank + rope_dim]`` latent pool (may be a
            strided view; never copied).
        cu_seqlens_q: ``[B + 1]`` int32 row offsets of the sequences in ``q``.
        block_table: ``[B, max_pages]`` int32 logical-to-physical page map.
        seq_lens: ``[B]`` int32 tokens per sequence, the new ones included.
        page_tags: ``[num_pages]`` int64 page tags.
        expected: ``[B]`` or ``[B, max_pages]`` int64 owner ids the pages must carry.
        kv_lora_rank: the value dims at the front of each latent row (default 512).
        scale: logit scale; default ``(kv_lora_rank + rope_dim) ** -0.5``.
        causal: mask keys after each query's position (default True).
        check: False runs the unchecked variant (same kernel, check compiled out, no report).
        on_violation: ``"report"`` or ``"raise"`` (synchronises; raises
            :class:`kvattn.KVOwnershipError` after writing the output).
        backend: ``"auto"``, ``"triton"`` or ``"reference"``; see :mod:`kvattn.backends`.
        out: optional ``[total_q, num_heads, kv_lora_rank]`` output buffer (dtype of ``q``).
        return_lse: also return the ``[total_q, num_heads]`` float32 natural-log LSE.
        validate: run the value checks (default: only on CPU tensors, where they cost no sync).

    Returns:
        ``(out, report)``, or ``(out, lse, report)`` with ``return_lse``; ``report`` is an
        :class:`kvattn.OwnershipReport` in device memory, None when ``check=False``.

    Raises:
        ValueError, TypeError: malformed inputs, naming the argument, the expected and the actual.
        KVOwnershipError: with ``on_violation="raise"`` when a page was refused.
    """
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
        out=out,
        validate=validate,
    )
    return _run("mla_extend", args, backend, check, on_violation, out, return_lse, kv_lora_rank)
