"""The ``torch`` backend's readers, as PyTorch ops: paged decode and extend that read only the
pages a sequence covers, for CPU tensors where no kernel runs (``backend="auto"`` takes them there
before the reference). Any device; every variant of :mod:`kvattn.variants`; float32 compute.

Semantics and report are those of :mod:`kvattn.reference`: its reader's rule
(:func:`~kvattn.reference.readable_slots`) decides which slots may contribute and writes the report,
so the two cannot disagree on what is refused. What differs is the work: the reference gathers every
page of the block table for every query row, these launchers gather ``ceil(seq_len / page_size)``
pages per sequence (from the window's first page on), once per sequence, and multiply a tile of
query rows by those keys. Decode batches sequences of similar length into one gather.
"""

from __future__ import annotations

import torch

from ... import reference
from ...layout import DecodeArgs, ExtendArgs, query_offsets
from ...report import OwnershipReport
from ...variants import Variant, alibi_anchor

# Logits of one extend tile (rows x query heads x keys, float32) are kept under this many elements,
# so a long prefill never materialises its whole score matrix.
TILE_ELEMENTS = 1 << 22
# Decode sequences share a gather while the shortest reads at least half the pages of the longest
# (or all read only a few pages): padding then at most doubles a bucket's work.
BUCKET_FLOOR_PAGES = 4


def _page_ranges(a, first_key: torch.Tensor) -> tuple[list[int], list[int]]:
    """Per sequence, the logical pages ``[lo, hi)`` holding a key some query reads: up to the
    (table-clipped) length, from the page of the window's first key on."""
    capacity = a.block_table.shape[1] * a.page_size
    lens = a.seq_lens.long().clamp(0, capacity)
    hi = torch.div(lens + a.page_size - 1, a.page_size, rounding_mode="floor")
    lo = torch.minimum(torch.div(first_key.clamp(min=0), a.page_size, rounding_mode="floor"), hi)
    return lo.tolist(), hi.tolist()


def _gather(
    a, pool: torch.Tensor, scale, pages: torch.Tensor, allowed: torch.Tensor
) -> torch.Tensor:
    """``[S, C * P, Hkv, D]`` float32 (``D``: the pool's head dim): logical pages ``pages`` ``[S,
    C]`` (indices already in the
    pool) dequantised by ``scale`` when fp8, zero wherever ``allowed`` ``[S, C * P]`` is False:
    refused and foreign slots may hold NaN, which must not reach any product."""
    x = pool.index_select(0, pages.flatten())  # a copy, whole pages at a time
    x = x.view(pages.shape[0], -1, a.num_kv_heads, pool.shape[3]).float()
    if scale is not None:
        x = x * scale.view(-1, 1, a.num_kv_heads, 1)  # per head, or per gathered sequence
    # Usually only the tail of the last page is masked: zero those slots, not the whole copy.
    seq, slot = torch.nonzero(~allowed, as_tuple=True)
    if seq.numel():
        x[seq, slot] = 0
    return x


def _per_kv_head(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[h] = a[h] @ b[:, :, h]`` for ``a`` ``[Hkv, S, R, X]``, ``b`` ``[S, X, Hkv, Y]`` read
    in place (a head's keys are a strided matrix of the gathered pages; copying them head-major
    would cost a pass over the keys)."""
    for h in range(a.shape[0]):
        torch.bmm(a[h], b[:, :, h], out=out[h])
    return out


def _attend(q, k, v, mask, q_pos, key_pos, variant: Variant, causal: bool, capacity: int):
    """Softmax attention of ``q`` ``[Hkv, S, G, T, D]`` (float32, already scaled) over ``k`` ``[S, N,
    Hkv, D]`` and ``v`` ``[S, N, Hkv, Dv]`` where ``mask`` ``[S, T, N]``; ``q_pos`` ``[S, T]`` and
    ``key_pos`` ``[S, N]`` are positions in the sequence, whose table holds ``capacity`` tokens
    (ALiBi's anchor, :func:`kvattn.variants.alibi_anchor`). The score transforms are those of
    :func:`kvattn.reference.attend`, in its order. Returns ``out`` ``[Hkv, S, G, T, Dv]`` and ``lse``
    ``[Hkv, S, G, T]``; a row with nothing in ``mask``, and a head that reads nothing
    (:meth:`kvattn.variants.Variant.heads_read`), gets output 0 and lse -inf. ``variant``'s
    per-sequence values, if any, are those of the ``S`` sequences."""
    hkv, s, g, t, d = q.shape
    n = k.shape[1]
    logits = q.new_empty(hkv, s, g * t, n)
    _per_kv_head(q.reshape(hkv, s, g * t, d), k.transpose(1, 3), logits)
    logits = logits.view(hkv, s, g, t, n)
    if variant.logits_soft_cap > 0:
        cap = variant.logits_soft_cap
        logits = cap * torch.tanh(logits / cap)
    shift = 0.0  # the reference's: the part of each row's logits that is the same for every key
    if variant.alibi_slopes is not None:
        anchor = alibi_anchor(q_pos, capacity)  # [S, T]
        distance = (key_pos[:, None, :] - anchor[:, :, None]).float()  # [S, T, N]
        if not causal:
            distance = -distance.abs()
        slopes = _by_kv_head(variant.alibi_slopes.float(), hkv, g)[..., None, None]
        logits = logits + slopes * distance[None, :, None]
        shift = slopes[..., 0] * (anchor - q_pos).float()[None, :, None]  # [Hkv, S, G, T]
    logits = logits.masked_fill(~mask[None, :, None], float("-inf"))
    top = logits.amax(dim=-1, keepdim=True)
    top = top.masked_fill(top == float("-inf"), 0)
    probs = torch.exp(logits - top)
    denom = probs.sum(dim=-1)  # [Hkv, S, G, T], 0 where nothing is allowed
    lse = top.squeeze(-1) + torch.log(denom)
    dv = v.shape[3]
    out = _per_kv_head(probs.view(hkv, s, g * t, n), v, q.new_empty(hkv, s, g * t, dv))
    out = out.view(hkv, s, g, t, dv)
    out = out / denom.masked_fill(denom == 0, 1)[..., None]
    if variant.sinks is not None:
        # As the reference: the sink's share of the denominator is sigmoid(lse - sink), 1 for -inf.
        sinks = variant.sinks.float().view(hkv, 1, g, 1)
        share = torch.where(torch.isneginf(sinks), 1.0, torch.sigmoid(lse - (sinks - shift)))
        out = out * share[..., None]
    lse = lse + shift
    reads = variant.heads_read(hkv * g)
    if reads is not None:
        reads = _by_kv_head(reads, hkv, g)[..., None]
        out = torch.where(reads[..., None], out, 0)
        lse = torch.where(reads, lse, float("-inf"))
    return out, lse


def _queries(a, q: torch.Tensor, variant: Variant) -> torch.Tensor:
    """``q`` ``[S, H, D]`` in float32, scaled by the logit scale and, for an fp8 ``q``, by each
    KV head's ``q_scale`` (``variant``'s rows are those of the ``S`` sequences, or shared)."""
    q = q.float() * a.scale
    if variant.q_fp8:
        g = a.num_heads // a.num_kv_heads
        q = (
            q.view(q.shape[0], a.num_kv_heads, g, -1)
            * variant.q_scale.view(-1, a.num_kv_heads, 1, 1)
        ).view(q.shape)
    return q


def _by_kv_head(x: torch.Tensor, hkv: int, g: int) -> torch.Tensor:
    """``[Hkv, 1 or S, G]``: per-head values ``[H]`` or per-sequence ones ``[S, H]``."""
    return x.view(-1, hkv, g).transpose(0, 1)


def _window_mask(variant: Variant, q_pos, key_pos):
    """``[S, T, N]`` True where a key lies inside the query's window, on either side (None
    without one)."""
    mask = None
    if variant.windowed:
        mask = key_pos[:, None, :] >= q_pos[:, :, None] - variant.window_left
    if variant.right_windowed:
        right = key_pos[:, None, :] <= q_pos[:, :, None] + variant.window_right
        mask = right if mask is None else mask & right
    return mask


def _buckets(counts: list[int], rows: list[int]) -> list[list[int]]:
    """Sequences ``rows`` grouped for one gather each, longest first (see BUCKET_FLOOR_PAGES)."""
    order = sorted(rows, key=lambda b: -counts[b])
    groups: list[list[int]] = []
    for b in order:
        if groups:
            longest = counts[groups[-1][0]]
            if longest <= BUCKET_FLOOR_PAGES or 2 * counts[b] >= longest:
                groups[-1].append(b)
                continue
        groups.append([b])
    return groups


def decode(
    args: DecodeArgs, *, check: bool, out: torch.Tensor, lse: torch.Tensor | None
) -> OwnershipReport | None:
    a, sw = args, args.variant
    first_key = reference.first_keys(a.seq_lens, 1, sw.window_left)
    allowed, report = reference.readable_slots(a, check, first_key)
    allowed = allowed.flatten(1)  # [B, M * P]
    lo, hi = _page_ranges(a, first_key)
    counts = [h - low for low, h in zip(lo, hi)]
    device, page = a.q.device, a.page_size
    capacity = a.max_pages * page
    q_pos_all = a.seq_lens.long() - 1
    g = a.num_heads // a.num_kv_heads
    reading = [b for b in range(a.batch) if counts[b] > 0]
    idle = [b for b in range(a.batch) if counts[b] == 0]
    if idle:
        rows = torch.tensor(idle, device=device)
        out.index_fill_(0, rows, 0)
        if lse is not None:
            lse.index_fill_(0, rows, float("-inf"))
    for group in _buckets(counts, reading):
        rows = torch.tensor(group, device=device)
        width = counts[group[0]]
        start = torch.tensor([lo[b] for b in group], device=device)
        logical = start[:, None] + torch.arange(width, device=device)  # [S, C]
        inside = logical < torch.tensor([hi[b] for b in group], device=device)[:, None]
        logical = torch.where(inside, logical, start[:, None])
        pages = a.block_table.index_select(0, rows).long().gather(1, logical)
        pages = pages.clamp(0, a.num_pages - 1)
        slot = torch.arange(page, device=device)
        key_pos = (logical[..., None] * page + slot).flatten(1)  # [S, C * P]
        ok = allowed.index_select(0, rows).gather(1, key_pos)
        ok &= inside.repeat_interleave(page, dim=1)
        q_pos = q_pos_all.index_select(0, rows)[:, None]  # [S, 1]
        window = _window_mask(sw, q_pos, key_pos)
        if window is not None:
            # Slots of the window's first page before it are not read: zeroed with the refused
            # ones, so whatever they hold never enters a product.
            ok &= window[:, 0]
        mask = ok[:, None, :]
        variant = sw.of_sequences(rows)
        k = _gather(a, a.k_cache, variant.k_scale, pages, ok)
        v = _gather(a, a.v_cache, variant.v_scale, pages, ok)
        q = _queries(a, a.q.index_select(0, rows), variant)
        q = q.view(len(group), a.num_kv_heads, g, 1, a.head_dim).transpose(0, 1)
        o, lse_rows = _attend(q, k, v, mask, q_pos, key_pos, variant, True, capacity)
        o = o.transpose(0, 1).reshape(len(group), a.num_heads, a.head_dim_v)
        out.index_copy_(0, rows, o.to(out.dtype))
        if lse is not None:
            lse.index_copy_(0, rows, lse_rows.transpose(0, 1).reshape(len(group), a.num_heads))
    return report


def extend(
    args: ExtendArgs, *, check: bool, out: torch.Tensor, lse: torch.Tensor | None
) -> OwnershipReport | None:
    a, sw = args, args.variant
    offsets = query_offsets(a.cu_seqlens_q, a.total_q)
    first_key = reference.first_keys(a.seq_lens, offsets[1:] - offsets[:-1], sw.window_left)
    allowed, report = reference.readable_slots(a, check, first_key)
    allowed = allowed.flatten(1)  # [B, M * P]
    lo, hi = _page_ranges(a, first_key)
    starts = offsets.tolist()
    seq_lens = a.seq_lens.tolist()
    device, page = a.q.device, a.page_size
    capacity = a.max_pages * page
    g = a.num_heads // a.num_kv_heads
    for b in range(a.batch):
        r0, r1 = starts[b], starts[b + 1]
        q_len, seq_len = r1 - r0, seq_lens[b]
        if q_len == 0:
            continue
        if hi[b] == lo[b] or (a.causal and q_len > seq_len):
            out[r0:r1] = 0
            if lse is not None:
                lse[r0:r1] = float("-inf")
            continue
        logical = torch.arange(lo[b], hi[b], device=device)
        pages = a.block_table[b].long().index_select(0, logical).clamp(0, a.num_pages - 1)[None]
        key_pos = torch.arange(lo[b] * page, hi[b] * page, device=device)
        ok = allowed[b, lo[b] * page : hi[b] * page][None]  # [1, N]
        variant = sw.of_sequences(b)
        k = _gather(a, a.k_cache, variant.k_scale, pages, ok)  # [1, N, Hkv, D]
        v = _gather(a, a.v_cache, variant.v_scale, pages, ok)
        tile = max(1, min(q_len, TILE_ELEMENTS // (a.num_heads * key_pos.numel())))
        for t0 in range(0, q_len, tile):
            t1 = min(q_len, t0 + tile)
            first, last = seq_len - q_len + t0, seq_len - q_len + t1 - 1
            # Keys this tile can read: causal rows stop at their own position, windowed rows
            # start at their window and stop at its right edge; the rest of the gathered keys
            # stay untouched.
            k0 = max(0, first - sw.window_left - lo[b] * page) if sw.windowed else 0
            k1 = min(key_pos.numel(), last + 1 - lo[b] * page) if a.causal else key_pos.numel()
            if sw.right_windowed:
                k1 = max(0, min(k1, last + sw.window_right + 1 - lo[b] * page))
            q = _queries(a, a.q[r0 + t0 : r0 + t1], variant)  # [T, H, D]
            q = q.view(t1 - t0, a.num_kv_heads, g, a.head_dim).permute(1, 2, 0, 3)[:, None]
            if k1 <= k0:
                out[r0 + t0 : r0 + t1] = 0
                if lse is not None:
                    lse[r0 + t0 : r0 + t1] = float("-inf")
                continue
            q_pos = torch.arange(first, last + 1, device=device)[None]  # [1, T]
            kp = key_pos[k0:k1][None]
            mask = ok[:, None, k0:k1]
            if a.causal:
                mask = mask & (kp[:, None, :] <= q_pos[:, :, None])
            window = _window_mask(sw, q_pos, kp)
            if window is not None:
                mask = mask & window
            if sw.custom_mask is not None:
                rows = torch.arange(t0, t1, device=device)
                mask = mask & reference.mask_block(sw, b, rows, kp[0], seq_len)[None]
            kt, vt = k[:, k0:k1], v[:, k0:k1]
            if sw.custom_mask is not None:
                # Keys no row of the tile reads are not read at all: whatever they hold stays out
                # of the products (as the kernels never load a key no row of theirs reads).
                unread = ~mask.any(dim=1)[..., None, None]  # [1, N, 1, 1]
                kt, vt = kt.masked_fill(unread, 0), vt.masked_fill(unread, 0)
            o, lse_rows = _attend(q, kt, vt, mask, q_pos, kp, variant, a.causal, capacity)
            out[r0 + t0 : r0 + t1] = (
                o[:, 0]
                .permute(2, 0, 1, 3)
                .reshape(t1 - t0, a.num_heads, a.head_dim_v)
                .to(out.dtype)
            )
            if lse is not None:
                lse[r0 + t0 : r0 + t1] = (
                    lse_rows[:, 0].permute(2, 0, 1).reshape(t1 - t0, a.num_heads)
                )
    return report


__all__ = ["decode", "extend"]
