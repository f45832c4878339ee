"""The online-softmax step shared by the Triton attention kernels (decode and extend), and the
score and epilogue rules of the variants."""

from __future__ import annotations

import triton
import triton.language as tl

from ... import variants
from .tag_rule import LOG2E_C

SCALE_MIN = tl.constexpr(variants.MIN_SCALE)
SCALE_MAX = tl.constexpr(variants.MAX_SCALE)
SLOPE_MAX = tl.constexpr(variants.ALIBI_SLOPE_MAX)


@triton.jit
def qk_scores(q, k, DOT_FP32: tl.constexpr):
    """``q @ k^T`` [ROWS, BLOCK_N] with fp32 accumulation. DOT_FP32 upcasts both operands and asks
    for exact fp32 products: fp32 inputs (no TF32), and bf16 under the Triton 3.9 interpreter,
    whose bf16 tl.dot returns wrong results."""
    if DOT_FP32:
        return tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    return tl.dot(q, tl.trans(k))


@triton.jit
def online_softmax_step(s, v, m_i, l_i, acc, DOT_FP32: tl.constexpr):
    """Fold one tile of base-2 logits ``s`` [ROWS, BLOCK_N] (-inf where masked) and its values
    ``v`` [BLOCK_N, BLOCK_D] into the running max ``m_i``, sum ``l_i`` and accumulator ``acc``."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # While every slot of a row so far is masked, m stays -inf; subtract 0 to avoid inf - inf.
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])  # [ROWS, BLOCK_N]
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if DOT_FP32:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def variant_scores(
    qk, qk_scale, soft_cap, alibi2, distance, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr
):
    """Base-2 logits of raw scores ``qk`` [ROWS, BLOCK_N] under the score switches of
    kvattn.variants, in their order: ``qk_scale`` (scale * log2(e), times the fp8 scales of K and
    of the query), the
    soft-cap ``cap * tanh(x / cap)`` of the natural logit ``x``, then ALiBi (``alibi2`` [ROWS] is
    slope * log2(e), ``distance`` key minus the row's ALiBi anchor, broadcast to the tile)."""
    s = qk * qk_scale
    if SOFTCAP:
        # tanh(x / cap) = 1 - 2 / (exp(2x / cap) + 1), and exp(2x / cap) = exp2(2 s / cap) for the
        # base-2 logit s: one exp2 per score; an overflow to inf gives tanh = 1 exactly.
        e = tl.exp2(s * (2.0 / soft_cap))
        s = (soft_cap * LOG2E_C) * (1.0 - 2.0 / (e + 1.0))
    if ALIBI:
        s += alibi2[:, None] * distance
    return s


@triton.jit
def alibi_anchor(q_pos, capacity):
    """The position ALiBi measures the keys of rows at ``q_pos`` from, in a table of ``capacity``
    tokens (kvattn.variants.alibi_anchor): ``alibi2 * (anchor - q_pos)`` is left out of the
    logits and joins the lse and the sink's comparison once."""
    return tl.minimum(q_pos, capacity - 1)


@triton.jit
def sink_denominator(l_i, m_i, sink2, SINKS: tl.constexpr):
    """The softmax denominator of a row with running max ``m_i`` and sum ``l_i`` (base 2): with
    SINKS the sink logit ``sink2`` (base 2) joins it. A row with nothing read (``l_i == 0``, its
    accumulator 0) gets 1, so its output stays 0 whatever the sink (-inf would give 0 / 0), and
    its lse, from ``l_i`` alone, -inf."""
    if SINKS:
        m_ref = tl.where(m_i == float("-inf"), 0.0, m_i)
        return tl.where(l_i > 0, l_i + tl.exp2(sink2 - m_ref), 1.0)
    return tl.where(l_i > 0, l_i, 1.0)


@triton.jit
def heads_read(
    heads,
    mask,
    kv_head,
    sinks_ptr,
    alibi_ptr,
    k_scale_ptr,
    v_scale_ptr,
    q_scale_ptr,
    SINKS: tl.constexpr,
    ALIBI: tl.constexpr,
    FP8: tl.constexpr,
    Q_FP8: tl.constexpr,
):
    """Whether each query head of ``heads`` (where ``mask``) reads anything: False where its sink
    or ALiBi slope, or a scale of its KV head ``kv_head`` (K's, V's and, Q_FP8, the query's), is
    invalid. The rule and its ranges are
    kvattn.variants' (Variant.heads_read): such a head gets output 0 and lse -inf. Loaded and
    tested after the main loop, from values the kernel reads anyway."""
    ok = mask
    if SINKS:
        ok = ok & (tl.load(sinks_ptr + heads, mask=mask, other=0.0) < float("inf"))  # NaN: False
    if ALIBI:
        ok = ok & (tl.abs(tl.load(alibi_ptr + heads, mask=mask, other=0.0)) <= SLOPE_MAX)
    if FP8:
        k_scale = tl.load(k_scale_ptr + kv_head)
        v_scale = tl.load(v_scale_ptr + kv_head)
        scales_ok = (k_scale >= SCALE_MIN) & (k_scale <= SCALE_MAX)
        scales_ok = scales_ok & (v_scale >= SCALE_MIN) & (v_scale <= SCALE_MAX)
        if Q_FP8:
            q_scale = tl.load(q_scale_ptr + kv_head)
            scales_ok = scales_ok & (q_scale >= SCALE_MIN) & (q_scale <= SCALE_MAX)
        # A select, not `&`: the interpreter refuses a vector mask combined with a scalar bool.
        ok = tl.where(scales_ok, ok, False)
    return ok
