"""The oracle: paged attention with the reader's rule of docs/ownership.md section 3, in plain
PyTorch.

Every backend is tested against this module. It favours being obviously right over being fast: it
gathers every page of the block table into a dense tensor and masks. It runs on any device and
computes in float32, or float64 when asked. Layout: :mod:`kvattn.layout`.
"""

from __future__ import annotations

import torch

from .layout import (
    query_offsets,
    validate_decode,
    validate_extend,
    validate_mla_decode,
    validate_mla_extend,
)
from .report import OwnershipReport
from .tags import (
    STATE_WRITTEN,
    Violation,
    page_reason,
    tag_owner,
    tag_state,
    tag_valid_len,
    valid_owner,
)
from .variants import PLAIN, Variant, alibi_anchor


def page_verdicts(block_table, seq_lens, page_tags, expected, page_size: int, first_key=None):
    """Apply the reader's rule to every logical page of a batch.

    Returns ``(slot_ok, report)``: ``slot_ok`` ``[B, max_pages, page_size]`` bool is True where a
    slot may contribute (length mask and ownership rule both pass); the report counts refused pages.
    ``expected`` is ``[B, max_pages]`` (broadcast a ``[B]`` one first). ``first_key`` ``[B]``: the
    first key any query of the sequence reads (a sliding window); pages wholly before it are not
    read, so neither checked nor refused.
    """
    num_pages = page_tags.shape[0]
    batch, max_pages = block_table.shape
    pages = block_table.long()
    in_range = (pages >= 0) & (pages < num_pages)
    tags = torch.where(in_range, page_tags[pages.clamp(0, num_pages - 1)], 0)  # [B, M]

    capacity = max_pages * page_size
    lens = seq_lens.long().clamp(0, capacity)
    first_slot = torch.arange(max_pages, device=pages.device) * page_size
    slots_read = (lens[:, None] - first_slot[None, :]).clamp(0, page_size)  # [B, M]
    read = slots_read > 0
    if first_key is not None:
        read &= first_slot[None, :] + page_size > first_key[:, None]

    reason = torch.where(read, page_reason(tags, in_range, expected, slots_read), 0)
    report = _report(reason, read, seq_lens, capacity)

    slot = torch.arange(page_size, device=pages.device)
    owned = in_range & (tag_state(tags) == STATE_WRITTEN) & (tag_owner(tags) == expected)
    owned &= valid_owner(expected)
    slot_ok = (
        (slot < slots_read[..., None]) & owned[..., None] & (slot < tag_valid_len(tags)[..., None])
    )
    return slot_ok, report


def verdict_entries(readable: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """``page << 32 | readable`` as int64, the packed entry of docs/ownership.md section 9 (the
    extend's effective table's too), ``page`` -1 where nothing may be read."""
    return (pages.long() << 32) | readable.long()


def unpack_verdict(entries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(readable, page)`` int64 of packed entries (:func:`verdict_entries`)."""
    return entries & 0xFFFFFFFF, entries >> 32


def fresh_pages(seq_lens, max_pages: int, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logical page, slot)`` ``[B]`` of each sequence's new token, at position ``seq_len - 1``
    (logical page -1 when that position lies outside the table: no token is written there)."""
    pos = seq_lens.long() - 1
    inside = (pos >= 0) & (pos < max_pages * page_size)
    logical = torch.where(inside, torch.div(pos, page_size, rounding_mode="floor"), -1)
    return logical, torch.where(inside, pos - logical * page_size, 0)


def fresh_entries(entries: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """``[B]`` int64: each sequence's new-token page's column of ``entries`` (page -1, 0 readable
    where the new token lies outside the table), the verdict's ``fresh``."""
    fresh, _ = fresh_pages(seq_lens, entries.shape[1], page_size)
    column = entries.gather(1, fresh.clamp(min=0)[:, None])[:, 0]
    return torch.where(
        fresh >= 0, column, verdict_entries(torch.zeros_like(fresh), -torch.ones_like(fresh))
    )


def resolve_verdict(block_table, seq_lens, layer_tags, expected, page_size: int, first_key):
    """The oracle of :func:`kvattn.resolve_pages` (docs/ownership.md section 9): ``(entries,
    report)`` of a decode step over ``layer_tags`` ``[L, num_pages]``, every layer's tags before
    the step's new tokens are written. Entry ``[b, i]`` packs (:func:`verdict_entries`) the page
    id and the slots readable in every layer, within the tokens before the new one (page -1 for a
    page not read or outside the pool); the report
    judges those slots, the first failing condition over the layers winning, and counts the new
    token's page as checked (each call checks its new slot against its own layer's tag)."""
    num_pages = layer_tags.shape[1]
    batch, max_pages = block_table.shape
    pages = block_table.long()
    in_range = (pages >= 0) & (pages < num_pages)
    safe = pages.clamp(0, num_pages - 1)
    capacity = max_pages * page_size
    first_slot = torch.arange(max_pages, device=pages.device) * page_size
    lens = seq_lens.long().clamp(0, capacity)
    old = (seq_lens.long() - 1).clamp(0, capacity)
    read = ((lens[:, None] - first_slot[None, :]) > 0) & (
        first_slot[None, :] + page_size > first_key[:, None]
    )
    old_slots = (old[:, None] - first_slot[None, :]).clamp(0, page_size)  # [B, M]
    # Every layer at once: [L, B, M] (a Python loop over layers cost a CPU engine ~0.1 ms a layer).
    tag = torch.where(in_range, layer_tags[:, safe], 0)
    owned = (tag_state(tag) == STATE_WRITTEN) & (tag_owner(tag) == expected) & valid_owner(expected)
    readable = torch.where(owned, tag_valid_len(tag), 0).amin(dim=0).clamp(max=page_size)
    layer_reasons = page_reason(tag, in_range, expected, old_slots)  # one Violation each
    bits = torch.zeros_like(old_slots)
    for flag in Violation:
        if flag:
            bits |= torch.where((layer_reasons == int(flag)).any(dim=0), int(flag), 0)
    judged = read & (old_slots > 0)
    reason = torch.where(judged, bits & -bits, 0)  # the first condition in Violation's order
    reason = torch.where(read & ~in_range, int(Violation.OUT_OF_RANGE), reason)
    readable = torch.where(read & in_range, torch.minimum(readable, old_slots), 0)
    entries = verdict_entries(readable, torch.where(read & in_range, pages, -1))
    return entries, _report(reason, read, seq_lens, capacity)


def _report(reason, read, seq_lens, capacity: int) -> OwnershipReport:
    """The report of per-page reasons ``[B, M]`` over the pages ``read``, with the overflow of
    lengths past the table counted as one more OUT_OF_RANGE page."""
    beyond = (seq_lens.long() > capacity).to(torch.int32)
    reasons = torch.zeros(reason.shape[0], dtype=torch.int32, device=reason.device)
    for flag in Violation:
        if flag:
            reasons |= torch.where((reason & flag).any(dim=1), int(flag), 0).to(torch.int32)
    reasons |= beyond * int(Violation.OUT_OF_RANGE)
    return OwnershipReport(
        violations=((reason != 0).sum(dim=1) + beyond).to(torch.int32),
        reasons=reasons,
        pages_checked=read.sum(dim=1).to(torch.int32),
        page_reasons=reason.to(torch.int8),
        beyond_table=beyond,
    )


def verdict_slots(a):
    """``(allowed [B, max_pages, page_size], report)`` of a decode through ``a.verdict``: every
    page's readable slots from its entry, the new token's page from this call's tags, whose
    refusal joins the verdict's report in place (once per page: docs/ownership.md section 9)."""
    verdict = a.verdict
    report = verdict.report
    readable, pages = unpack_verdict(verdict.entries)
    in_range = (pages >= 0) & (pages < a.num_pages)
    fresh, slot = fresh_pages(a.seq_lens, a.max_pages, a.page_size)
    has = fresh >= 0
    col = fresh.clamp(min=0)[:, None]
    f_page = pages.gather(1, col)[:, 0]
    f_in = in_range.gather(1, col)[:, 0]
    f_readable = readable.gather(1, col)[:, 0]
    f_owner = a.expected.gather(1, col)[:, 0]
    tag = torch.where(f_in, a.page_tags[f_page.clamp(0, a.num_pages - 1)], 0)
    owned = (tag_state(tag) == STATE_WRITTEN) & (tag_owner(tag) == f_owner) & valid_owner(f_owner)
    # Old slots another layer refused stay refused; the new slot is this layer's tag's to certify.
    cap = torch.where(f_readable < slot, f_readable, a.page_size)
    f_limit = torch.minimum(torch.where(owned, tag_valid_len(tag), 0), cap)
    limit = readable.scatter(1, col, torch.where(has, f_limit, f_readable)[:, None])
    limit = torch.where(in_range, limit, 0)

    why = torch.where(has, page_reason(tag, f_in, f_owner, slot + 1), 0)
    before = report.page_reasons.gather(1, col)[:, 0]
    new = (why != 0) & (before == 0)
    report.page_reasons.scatter_(1, col, torch.where(new, why, before).to(torch.int8)[:, None])
    report.violations += new.to(torch.int32)
    report.reasons |= torch.where(new, why, 0).to(torch.int32)

    lens = a.seq_lens.long().clamp(0, a.max_pages * a.page_size)
    first_slot = torch.arange(a.max_pages, device=lens.device) * a.page_size
    slots_read = (lens[:, None] - first_slot[None, :]).clamp(0, a.page_size)
    slot_ids = torch.arange(a.page_size, device=lens.device)
    return slot_ids < torch.minimum(limit, slots_read)[..., None], report


def length_mask(block_table, seq_lens, page_size: int):
    """``[B, max_pages, page_size]`` bool: the ordinary length mask, no ownership (``check=False``)."""
    max_pages = block_table.shape[1]
    lens = seq_lens.long().clamp(0, max_pages * page_size)
    token = torch.arange(max_pages * page_size, device=block_table.device)
    return (token[None, :] < lens[:, None]).view(-1, max_pages, page_size)


def first_keys(seq_lens, q_lens, window_left: int):
    """``[B]`` int64: the first key a sequence's queries read under a sliding window (0 without
    one): the window of its first query, at position ``seq_len - q_len``."""
    lens = seq_lens.long()
    if window_left < 0:
        return torch.zeros_like(lens)
    return (lens - q_lens - window_left).clamp(min=0)


def readable_slots(a, check: bool, first_key=None):
    """``(allowed [B, max_pages, page_size], report)`` for validated arguments ``a``: the reader's
    rule when ``check``, else the length mask alone (entries outside the pool read as nothing) and
    no report. ``first_key``: as in :func:`page_verdicts` (the window is applied per query by
    :func:`attend`; here it only decides which pages are checked)."""
    if check and getattr(a, "verdict", None) is not None:
        return verdict_slots(a)
    if check:
        return page_verdicts(
            a.block_table, a.seq_lens, a.page_tags, a.expected, a.page_size, first_key
        )
    pages = a.block_table.long()
    in_range = (pages >= 0) & (pages < a.num_pages)
    return length_mask(a.block_table, a.seq_lens, a.page_size) & in_range[..., None], None


def gather_pages(a, pool, scale):
    """``[B, max_pages * page_size, Hkv, D]``: a pool read through the block table (entries outside
    the pool read page 0; the caller masks them), dequantised by ``scale`` ``[Hkv]`` or ``[B,
    Hkv]`` when fp8."""
    pages = a.block_table.long().clamp(0, a.num_pages - 1)
    x = pool[pages].flatten(1, 2)
    if scale is None:
        return x
    return x.float() * scale.view(-1, 1, scale.shape[-1], 1)


def attend(
    q,
    k,
    v,
    allowed,
    scale: float,
    compute_dtype=torch.float32,
    *,
    q_pos=None,
    causal: bool = True,
    variant: Variant = PLAIN,
):
    """Softmax attention of ``q`` ``[B, H, D]`` over ``k`` ``[B, N, Hkv, D]`` and ``v`` ``[B, N, Hkv,
    Dv]`` where ``allowed`` ``[B, N]``; GQA by head groups. ``q_pos`` ``[B]``: each query's
    position (key ``n`` sits at position ``n``, and ``N`` is the table's width in tokens), needed
    by the window and ALiBi of ``variant`` (:mod:`kvattn.variants`), which ``causal`` selects the
    ALiBi form of (its per-sequence values, if any, one row per query row). Returns ``out`` ``[B,
    H, Dv]`` and ``lse`` ``[B, H]`` (over the keys: sinks join only the output's denominator) in
    ``compute_dtype``; a row with nothing allowed, and a head with an invalid switch value
    (:meth:`kvattn.variants.Variant.heads_read`), gets output 0 and lse -inf."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    key_pos = torch.arange(k.shape[1], device=q.device)
    if variant.windowed:
        allowed = allowed & (key_pos[None, :] >= q_pos[:, None] - variant.window_left)
    if variant.right_windowed:
        allowed = allowed & (key_pos[None, :] <= q_pos[:, None] + variant.window_right)
    # Disallowed slots may hold NaN (poisoned or foreign pages): zero them before any arithmetic.
    k = torch.where(allowed[..., None, None], k, 0).to(compute_dtype)
    v = torch.where(allowed[..., None, None], v, 0).to(compute_dtype)
    qg = q.to(compute_dtype).view(batch, num_kv_heads, group, head_dim)
    if variant.q_fp8:
        # [1 or B, Hkv, 1, 1]: each query head takes the scale of the KV head it reads.
        qg = qg * variant.q_scale.to(compute_dtype).view(-1, num_kv_heads, 1, 1)
    logits = torch.einsum("bkgd,bnkd->bkgn", qg, k) * scale  # [B, Hkv, G, N]
    if variant.logits_soft_cap > 0:
        cap = variant.logits_soft_cap
        logits = cap * torch.tanh(logits / cap)
    # The part of each row's logits that is the same for every key (ALiBi's beyond its anchor,
    # kvattn.variants): the softmax runs without it, the lse and the sink see it.
    shift = torch.zeros(batch, num_kv_heads, group, dtype=compute_dtype, device=q.device)
    if variant.alibi_slopes is not None:
        anchor = alibi_anchor(q_pos, k.shape[1])
        distance = (key_pos[None, :] - anchor[:, None]).to(compute_dtype)  # [B, N]
        if not causal:
            distance = -distance.abs()
        # [1 or B, Hkv, G]: per-sequence slopes, when given so, are per query row here.
        slopes = variant.alibi_slopes.to(compute_dtype).view(-1, num_kv_heads, group)
        logits = logits + slopes[..., None] * distance[:, None, None, :]
        shift = slopes * (anchor - q_pos).to(compute_dtype)[:, None, None]
    logits = logits.masked_fill(~allowed[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # [B, Hkv, G], -inf where nothing is allowed
    probs = torch.exp(logits - torch.where(torch.isfinite(lse), lse, 0)[..., None])
    out = torch.einsum("bkgn,bnkd->bkgd", probs, v)
    if variant.sinks is not None:
        # The sink's share of the denominator: out *= e^lse / (e^lse + e^sink) = sigmoid(lse -
        # sink); a sink of -inf takes none, also from a row with nothing allowed (lse - sink = NaN).
        sinks = variant.sinks.to(compute_dtype).view(1, num_kv_heads, group)
        share = torch.where(torch.isneginf(sinks), 1.0, torch.sigmoid(lse - (sinks - shift)))
        out = out * share[..., None]
    lse = lse + shift
    reads = variant.heads_read(num_heads)
    if reads is not None:
        reads = reads.view(-1, num_kv_heads, group)
        out = torch.where(reads[..., None], out, 0)
        lse = torch.where(reads, lse, float("-inf"))
    return out.reshape(batch, num_heads, v.shape[-1]), lse.reshape(batch, num_heads)


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
    return_lse=False,
    compute_dtype=torch.float32,
    **variant,
):
    """Reference paged decode. Arguments and layout as :func:`kvattn.paged_decode` (``variant``: the
    switches of :mod:`kvattn.variants`).

    Returns ``(out, report)`` or ``(out, lse, report)``; ``out`` is in ``compute_dtype`` (float32 by
    default, float64 on request), ``report`` is None when ``check=False``. Unchecked, the block table
    is trusted except that entries outside the pool are read as nothing (the kernels' unchecked
    variants read them blindly: that is undefined behaviour there, so tests never rely on it).
    """
    a = validate_decode(
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
    return decode_args(a, check, return_lse, compute_dtype)


def decode_args(a, check: bool, return_lse: bool, compute_dtype=torch.float32):
    """:func:`paged_decode` on validated arguments (:class:`kvattn.layout.DecodeArgs`)."""
    sw = a.variant
    q_pos = a.seq_lens.long() - 1
    allowed, report = readable_slots(a, check, first_keys(a.seq_lens, 1, sw.window_left))
    k = gather_pages(a, a.k_cache, sw.k_scale)  # [B, M * P, Hkv, D]
    v = gather_pages(a, a.v_cache, sw.v_scale)
    out, lse = attend(
        a.q, k, v, allowed.flatten(1), a.scale, compute_dtype, q_pos=q_pos, variant=sw
    )
    return (out, lse, report) if return_lse else (out, report)


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
    return_lse=False,
    compute_dtype=torch.float32,
    **variant,
):
    """Reference paged extend (chunked prefill). Arguments and semantics as
    :func:`kvattn.paged_extend`; layout in :mod:`kvattn.layout`.

    Sequence ``b`` has ``q_len = cu_seqlens_q[b + 1] - cu_seqlens_q[b]`` new query rows, the last
    ``q_len`` of its ``seq_lens[b]`` tokens; row ``j`` sits at position ``seq_lens[b] - q_len + j``
    and, when ``causal``, reads keys at positions up to its own. The reader's rule and the report
    are exactly those of :func:`paged_decode` for the same ``seq_lens``: every page covering
    ``[0, seq_len)`` is checked and counted once per sequence. A causal sequence with ``q_len >
    seq_len`` reads nothing (its rows get 0 and lse -inf); without causality every row reads all
    ``seq_len`` keys. Rows outside every sequence (possible only when
    ``cu_seqlens_q`` fails validation) come out 0 here; the kernels leave them unwritten.

    Returns ``(out, report)`` or ``(out, lse, report)``, ``out`` ``[total_q, num_heads,
    head_dim_v]`` in ``compute_dtype``, ``lse`` ``[total_q, num_heads]``; ``report`` is None when unchecked.
    With a sliding window the pages checked are those holding a key some row reads.
    """
    a = validate_extend(
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
    return extend_args(a, check, return_lse, compute_dtype)


def extend_args(a, check: bool, return_lse: bool, compute_dtype=torch.float32):
    """:func:`paged_extend` on validated arguments (:class:`kvattn.layout.ExtendArgs`)."""
    sw = a.variant
    offsets = query_offsets(a.cu_seqlens_q, a.total_q)
    allowed, report = readable_slots(
        a, check, first_keys(a.seq_lens, offsets[1:] - offsets[:-1], sw.window_left)
    )
    allowed = allowed.flatten(1)  # [B, M * P]
    k = gather_pages(a, a.k_cache, sw.k_scale)  # [B, M * P, Hkv, D]
    v = gather_pages(a, a.v_cache, sw.v_scale)
    q = a.q

    out = torch.zeros(a.total_q, a.num_heads, a.head_dim_v, dtype=compute_dtype, device=q.device)
    lse = torch.full((a.total_q, a.num_heads), float("-inf"), dtype=compute_dtype, device=q.device)
    starts = offsets.tolist()
    key_pos = torch.arange(allowed.shape[1], device=q.device)
    for b in range(a.batch):
        lo, hi = starts[b], starts[b + 1]
        seq_len = int(a.seq_lens[b])
        if hi == lo or (a.causal and hi - lo > seq_len):
            continue
        q_pos = seq_len - (hi - lo) + torch.arange(hi - lo, device=q.device)  # [q_len]
        rows_allowed = allowed[b][None, :].expand(hi - lo, -1)  # [q_len, N]
        if a.causal:
            rows_allowed = rows_allowed & (key_pos[None, :] <= q_pos[:, None])
        if sw.custom_mask is not None:
            rows_allowed = rows_allowed & mask_block(
                sw, b, torch.arange(hi - lo, device=q.device), key_pos, seq_len
            )
        n = rows_allowed.shape[1]
        out[lo:hi], lse[lo:hi] = attend(
            a.q[lo:hi],
            k[b].expand(hi - lo, n, -1, -1),
            v[b].expand(hi - lo, n, -1, -1),
            rows_allowed,
            a.scale,
            compute_dtype,
            q_pos=q_pos,
            causal=a.causal,
            variant=sw.of_sequences(b),
        )
    return (out, lse, report) if return_lse else (out, report)


def mask_block(
    sw: Variant, b: int, rows: torch.Tensor, keys: torch.Tensor, seq_len: int
) -> torch.Tensor:
    """``[len(rows), len(keys)]`` bool: entries ``[rows, keys]`` of sequence ``b``'s block of
    ``custom_mask`` (:mod:`kvattn.variants`; ``rows``: query rows within the sequence, ``keys``:
    key positions); keys outside ``[0, seq_len)`` and entries past the mask's end are False."""
    mask, width = sw.custom_mask, max(seq_len, 0)
    index = int(sw.mask_start[b]) + rows[:, None] * width + keys[None, :]
    inside = (index < mask.numel()) & (keys >= 0)[None, :] & (keys < width)[None, :]
    if mask.numel() == 0:
        return inside
    return inside & mask[index.clamp(0, mask.numel() - 1)]


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
    return_lse=False,
    compute_dtype=torch.float32,
):
    """Reference MLA paged decode. Arguments and layout as :func:`kvattn.paged_mla_decode`
    (:class:`kvattn.layout.MLADecodeArgs`): every query head attends over the one latent head,
    the whole latent row is the key and its first ``kv_lora_rank`` dims the value. The reader's
    rule and the report are :func:`paged_decode`'s.

    Returns ``(out, report)`` or ``(out, lse, report)``; ``out`` ``[B, num_heads, kv_lora_rank]``
    in ``compute_dtype``, ``report`` None when ``check=False`` (unchecked, entries outside the pool
    read as nothing, as in :func:`paged_decode`).
    """
    a = validate_mla_decode(
        q,
        kv_cache,
        block_table,
        seq_lens,
        page_tags,
        expected,
        kv_lora_rank=kv_lora_rank,
        scale=scale,
        validate=False,
    )
    allowed, report = readable_slots(a, check)
    pages = a.block_table.long().clamp(0, a.num_pages - 1)
    latent = a.kv_cache[pages].flatten(1, 2)  # [B, M * P, 1, D]
    # Attention with the whole latent row as the value: the first kv_lora_rank output dims are
    # exactly those of the value part, the rest is dropped.
    out, lse = attend(a.q, latent, latent, allowed.flatten(1), a.scale, compute_dtype)
    out = out[..., : a.kv_lora_rank].contiguous()
    return (out, lse, report) if return_lse else (out, report)


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
    return_lse=False,
    compute_dtype=torch.float32,
):
    """Reference MLA paged extend. Arguments and layout as :func:`kvattn.paged_mla_extend`
    (:class:`kvattn.layout.MLAExtendArgs`): :func:`paged_extend` over the one latent head, the
    whole latent row as key and value, of whose output the first ``kv_lora_rank`` dims are kept.
    The rows, their positions, the causal rule, the reader's rule and the report are
    :func:`paged_extend`'s.

    Returns ``(out, report)`` or ``(out, lse, report)``; ``out`` ``[total_q, num_heads,
    kv_lora_rank]`` in ``compute_dtype``, ``report`` None when ``check=False``.
    """
    a = validate_mla_extend(
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
    return mla_extend_args(a, check, return_lse, compute_dtype)


def mla_extend_args(a, check: bool, return_lse: bool, compute_dtype=torch.float32):
    """:func:`paged_mla_extend` on validated arguments (:class:`kvattn.layout.MLAExtendArgs`)."""
    out, lse, report = extend_args(a.as_extend(), check, True, compute_dtype)
    out = out[..., : a.kv_lora_rank].contiguous()
    return (out, lse, report) if return_lse else (out, report)
