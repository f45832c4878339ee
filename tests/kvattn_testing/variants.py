"""The attention variants' batches and their definition, for every test of a switch: NaN-filled
foreign pages planted where a sequence reads them (:func:`plant_foreign_page`), each sequence's
K/V by plain indexing (:func:`tokens`), attention written out one query row at a time in float64
(:func:`dense`), the switch cases (:data:`CASES`), fp8 pools (:func:`to_fp8`), and the check that
every backend claiming a call gives the definition's result (:func:`assert_every_claim_matches`).
"""

from __future__ import annotations

import math

import torch

import kvattn
from kvattn_testing.exactness import run, validated
from kvattn_testing.util import DEVICE, LSE_TOLERANCE, Batch, claims, tolerance

FOREIGN_OWNER = 99
HEADS, KV_HEADS, DIM = 4, 2, 16


def inputs(pages: Batch) -> tuple:
    return (
        pages.q,
        pages.k_cache,
        pages.v_cache,
        pages.block_table,
        pages.seq_lens,
        pages.page_tags,
        pages.expected,
    )


def plant_foreign_page(pages: Batch, b: int, i: int) -> None:
    """Entry ``i`` of sequence ``b`` names a page written in full for another owner, NaN inside."""
    used = set(pages.block_table.flatten().tolist())
    spare = next(p for p in range(pages.k_cache.shape[0]) if p not in used)
    pages.k_cache[spare] = float("nan")
    pages.v_cache[spare] = float("nan")
    pages.page_tags[spare] = kvattn.written_tag(FOREIGN_OWNER, pages.k_cache.shape[1])
    pages.block_table[b, i] = spare


def tokens(pages: Batch, b: int, k_scale=None, v_scale=None):
    """K/V ``[seq_len, Hkv, D]`` float64 of sequence ``b`` by plain indexing (dequantised by the
    per-head scales), and which tokens are not on a foreign page."""
    n = int(pages.seq_lens[b])
    size = pages.k_cache.shape[1]
    idx = torch.arange(n)
    phys = pages.block_table[b].long().cpu()[idx // size]
    ok = [
        int(pages.page_tags[p]) >> kvattn.tags.OWNER_SHIFT != FOREIGN_OWNER for p in phys.tolist()
    ]
    k = pages.k_cache.cpu()[phys, idx % size].double()
    v = pages.v_cache.cpu()[phys, idx % size].double()
    if k_scale is not None:
        k = k * torch.as_tensor(k_scale).double().reshape(-1, 1)
        v = v * torch.as_tensor(v_scale).double().reshape(-1, 1)
    return k, v, ok


def dense(
    q,
    cu,
    seqs,
    scale,
    *,
    causal=True,
    window_left=-1,
    cap=0.0,
    slopes=None,
    sinks=None,
    blocks=None,
    window_right=-1,
):
    """Attention from the definitions, float64, one row and head at a time. ``seqs``: per sequence
    ``(k, v, ok)`` as from :func:`tokens`. Row ``j`` of sequence ``b`` sits at ``len(k) - q_len + j``.
    ``slopes``: ``[H]``, or ``[B, H]`` (sequence ``b`` uses row ``b``).
    ``blocks``: per sequence a ``[q_len, len(k)]`` bool custom mask (row ``j`` reads key ``t`` only
    where ``blocks[b][j, t]``); ``window_right``: row ``j`` reads keys ``t <= pos + window_right``
    only (when >= 0). The output is as wide as V."""
    total_q, num_heads, _ = q.shape
    out = torch.zeros(total_q, num_heads, seqs[0][1].shape[-1], dtype=torch.float64)
    lse = torch.full((total_q, num_heads), float("-inf"), dtype=torch.float64)
    starts = cu.cpu().tolist()
    for b, (k, v, ok) in enumerate(seqs):
        group = num_heads // k.shape[1]
        q_len = starts[b + 1] - starts[b]
        seq_slopes = slopes[b] if slopes is not None and slopes.dim() == 2 else slopes
        for j in range(q_len):
            pos = len(k) - q_len + j
            keys = [
                t
                for t in range(len(k))
                if ok[t]
                and (not causal or t <= pos)
                and (window_left < 0 or t >= pos - window_left)
                and (window_right < 0 or t <= pos + window_right)
                and (blocks is None or bool(blocks[b][j, t]))
            ]
            if not keys:
                continue
            row = starts[b] + j
            for h in range(num_heads):
                scores = []
                for t in keys:
                    s = scale * float(q[row, h].cpu().double() @ k[t, h // group])
                    if cap > 0:
                        s = cap * math.tanh(s / cap)
                    if slopes is not None:
                        d = t - pos
                        s += float(seq_slopes[h]) * (d if causal else -abs(d))
                    scores.append(s)
                m = max(scores)
                weights = [math.exp(s - m) for s in scores]
                total = sum(weights)
                lse[row, h] = m + math.log(total)
                if sinks is not None:
                    total += math.exp(float(sinks[h]) - m)
                acc = sum(w * v[t, h // group] for w, t in zip(weights, keys))
                out[row, h] = acc / total
    return out, lse


def decode_rows(pages: Batch):
    batch = pages.q.shape[0]
    return torch.arange(batch + 1, dtype=torch.int32)


def assert_matches(out, lse, want_out, want_lse, dtype):
    assert torch.isfinite(out).all(), "a refused or masked slot was read"
    tol = tolerance(dtype)
    assert want_out.abs().max() > 10 * tol["atol"], "expected output too small to tell"
    torch.testing.assert_close(out.cpu().double(), want_out, **tol)
    finite = torch.isfinite(want_lse)
    assert torch.isneginf(lse.cpu()[~finite]).all()
    torch.testing.assert_close(lse.cpu().double()[finite], want_lse[finite], **LSE_TOLERANCE)


def per_head(values, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(HEADS, generator=g) * (values[1] - values[0]) + values[0]).to(DEVICE)


# Each case: the switches as kvattn takes them, and the same for dense().
def switch_cases():
    slopes = torch.tensor([2.0 ** -(i + 1) for i in range(HEADS)], device=DEVICE)
    sinks = per_head((-1.0, 2.0), seed=3)
    return {
        "window": (dict(window_left=5), dict(window_left=5)),
        "window0": (dict(window_left=0), dict(window_left=0)),
        "softcap": (dict(logits_soft_cap=0.7), dict(cap=0.7)),
        "sinks": (dict(sinks=sinks), dict(sinks=sinks)),
        "alibi": (dict(alibi_slopes=slopes), dict(slopes=slopes)),
        "all": (
            dict(window_left=6, logits_soft_cap=1.5, sinks=sinks, alibi_slopes=slopes),
            dict(window_left=6, cap=1.5, sinks=sinks, slopes=slopes),
        ),
    }


CASES = switch_cases()


def decode_batch(page, seed=0):
    """Lengths around page boundaries and past the window; a foreign page in the last sequence's
    second entry (read by every case here: it is inside every window used below)."""
    lens = [1, page + 1, 3 * page + 2, 3 * page]
    pages = Batch.random(
        batch=len(lens),
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=DIM,
        page_size=page,
        seq_lens=lens,
        pool_factor=2,
        seed=seed,
    )
    plant_foreign_page(pages, 3, 2)
    return pages


FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def to_fp8(pages: Batch, dtype) -> Batch:
    """The same batch with fp8 pools (NaN stays NaN), values scaled into fp8's range."""
    pages.k_cache = (pages.k_cache.float() * 8).to(dtype)
    pages.v_cache = (pages.v_cache.float() * 8).to(dtype)
    return pages


def assert_every_claim_matches(
    op: str, x, want_out, want_lse, violations=(0, 0, 0, 1), **kwargs
) -> None:
    """Every backend claiming ``x`` (a Batch for decode, an Extend for extend) with ``kwargs``, at
    least one beside the reference, gives the definition's output (as wide as V) and lse, and
    refuses ``violations`` pages per sequence (by default sequence 3's foreign page alone)."""
    names = claims(validated(op, x, **kwargs), op)
    assert "reference" in names and len(names) >= 2, names
    for backend in names:
        out, lse, report = run(op, x, backend, **kwargs)
        assert out.shape[2] == want_out.shape[2], backend
        assert_matches(out, lse, want_out, want_lse, out.dtype)
        assert report.violations.tolist() == list(violations), backend
