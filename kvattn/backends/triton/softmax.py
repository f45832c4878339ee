"""The online-softmax step shared by the Triton attention kernels (decode and extend)."""
from __future__ import annotations

import triton
import triton.language as tl


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
