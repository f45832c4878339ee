// The warp-level attention step shared by the decode and extend kernels: one warp's 16 query rows
// against a tile of NK keys staged in shared memory, on tensor cores (warp_ops.cuh), with the
// online softmax in base 2. A warp keeps its rows' output accumulators, running maxima and running
// sums in registers; callers mask the logits between qk_scores and softmax_step.
//
// Element ownership in a warp (g = lane / 4, t = lane % 4): score s[n][c] is row g + 8 * (c / 2),
// key 8n + 2t + c % 2; accumulator o[j][c] is row g + 8 * (c / 2), dimension 8j + 2t + c % 2.
#pragma once

#include "params.h"
#include "tiles.h"
#include "warp_ops.cuh"

#ifndef KVATTN_SIM_BREAK
// Test-only defects (tests/backends/test_cuda.py); never set in a real build.
#define KVATTN_SIM_BREAK 0
#endif

namespace kvattn {

constexpr float kLn2 = 0.6931471805599453f;

KVATTN_DEVICE int lane_index() { return static_cast<int>(threadIdx.x) % 32; }

// The A fragments of 16 query rows for k-step kk, from shared memory rows of `row_bytes`.
KVATTN_DEVICE void load_a_fragment(uint32_t (&a)[4], const unsigned char* rows, int row_bytes, int kk) {
  const int lane = lane_index();
  const int i = lane / 8;  // ldmatrix matrix i: rows (i % 2) * 8 .., columns (i / 2) * 8 .. of the 16x16 tile
  ldmatrix_x4(a, rows + ((i % 2) * 8 + lane % 8) * row_bytes + (kk * 16 + (i / 2) * 8) * 2);
}

// Query fragments held in registers for the whole key loop (D <= 128) or read from shared memory
// at every k-step (D = 256, where registers go to the accumulators).
template <int D, bool IN_REGISTERS = (D <= 128)>
struct QueryFragments;

template <int D>
struct QueryFragments<D, true> {
  uint32_t frag[D / 16][4];
  KVATTN_DEVICE void load(const unsigned char* rows, int ksteps) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      if (kk < ksteps) load_a_fragment(frag[kk], rows, tile_row_bytes<D>(), kk);
  }
  KVATTN_DEVICE void get(int kk, uint32_t (&a)[4]) const {
#pragma unroll
    for (int r = 0; r < 4; ++r) a[r] = frag[kk][r];
  }
};

template <int D>
struct QueryFragments<D, false> {
  const unsigned char* rows;
  KVATTN_DEVICE void load(const unsigned char* q_rows, int) { rows = q_rows; }
  KVATTN_DEVICE void get(int kk, uint32_t (&a)[4]) const { load_a_fragment(a, rows, tile_row_bytes<D>(), kk); }
};

// s = Q K^T for NK keys whose rows start at `k_rows` (shared memory, rows of tile_row_bytes<D>());
// `ksteps` = ceil(head_dim / 16) k-steps are computed, the rest of D is padding.
template <class T, int D, int NK, class Q>
KVATTN_DEVICE void qk_scores(float (&s)[NK / 8][4], const Q& q, const unsigned char* k_rows, int ksteps) {
  const int lane = lane_index();
  const int i = lane / 8;  // matrix i: keys (i / 2) * 8 .., dimensions (i % 2) * 8 .. (B = K^T, column-major)
#pragma unroll
  for (int n = 0; n < NK / 8; ++n)
#pragma unroll
    for (int c = 0; c < 4; ++c) s[n][c] = 0.0f;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    if (kk < ksteps) {
      uint32_t a[4];
      q.get(kk, a);
#pragma unroll
      for (int n16 = 0; n16 < NK / 16; ++n16) {
        uint32_t b[4];
        ldmatrix_x4(b, k_rows + (n16 * 16 + (i / 2) * 8 + lane % 8) * tile_row_bytes<D>() + (kk * 16 + (i % 2) * 8) * 2);
        mma_16816<T>(s[2 * n16], a, b[0], b[1]);
        mma_16816<T>(s[2 * n16 + 1], a, b[2], b[3]);
      }
    }
  }
}

// fp8 pools: the fragments are built from shared-memory words instead of ldmatrix (which moves
// 16-bit elements), so the dims are laid out for 32-bit reads.
//
// QK^T sums over the head dims, so any order of them serves if Q and K agree. In each 16-dim
// k-step, lane t takes the four bytes K[key][4t .. 4t + 3] as its B fragment (b0: dims 4t, 4t + 1
// as k-indices 2t, 2t + 1; b1: dims 4t + 2, 4t + 3 as 2t + 8, 2t + 9): one 32-bit load per key and
// k-step. Q is stored in shared memory with its dims in that order (fp8_q_column), so its ldmatrix
// A fragments match.
KVATTN_HOST_DEVICE int fp8_q_column(int d) {
  const int p = d & 15, t = p >> 2, j = p & 3;
  return (d & ~15) + 2 * t + (j & 1) + (j >> 1) * 8;
}

// P V sums over keys, which come from the scores in mma order; here the output dims are permuted
// instead: column n of n8-tile j (the lane's g for B, 2t + {0, 1} for the accumulators) is dim
// 32 (j / 4) + 4 n + j % 4. Lane g then reads V[key][32 J + 4g .. + 3] for tiles 4J .. 4J + 3 of one
// key in one 32-bit load, and the accumulator o[j][c] is this dim of the output.
KVATTN_HOST_DEVICE int fp8_v_dim(int j, int n) { return 32 * (j / 4) + 4 * n + j % 4; }

// qk_scores for an fp8 K stage (rows of D bytes and 16 of padding) against Q stored in
// fp8_q_column order.
template <class T, class KV, int D, int NK, class Q>
KVATTN_DEVICE void qk_scores_fp8(float (&s)[NK / 8][4], const Q& q, const unsigned char* k_rows, int ksteps) {
  constexpr int kRow = D + 16;
  const int lane = lane_index();
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int n = 0; n < NK / 8; ++n)
#pragma unroll
    for (int c = 0; c < 4; ++c) s[n][c] = 0.0f;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    if (kk < ksteps) {
      uint32_t a[4];
      q.get(kk, a);
#pragma unroll
      for (int n = 0; n < NK / 8; ++n) {
        const uint32_t w = load_shared_u32(k_rows + (n * 8 + g) * kRow + kk * 16 + 4 * t);
        mma_16816<T>(s[n], a, fp8x2_to<T, KV>(w), fp8x2_to<T, KV>(w >> 16));
      }
    }
  }
}

KVATTN_DEVICE float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

KVATTN_DEVICE float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// One warp's 16 rows of flash attention state.
template <class T, int D>
struct WarpAttention {
  float o[D / 8][4];  // unnormalised output
  float m[2];         // running max of rows g and g + 8 (base-2 logits), -inf while all masked
  float l[2];         // this lane's part of the running sums (summed over the quad by finish())

  KVATTN_DEVICE void init() {
#pragma unroll
    for (int j = 0; j < D / 8; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) o[j][c] = 0.0f;
    m[0] = m[1] = -INFINITY;
    l[0] = l[1] = 0.0f;
  }

  // Folds one tile of base-2 logits (-inf where masked) into the state; `s` becomes the tile's
  // probabilities relative to the new running max.
  template <int NK>
  KVATTN_DEVICE void softmax_step(float (&s)[NK / 8][4]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float tile_max = -INFINITY;
#pragma unroll
      for (int n = 0; n < NK / 8; ++n) tile_max = fmaxf(tile_max, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
      const float m_new = fmaxf(m[r], quad_max(tile_max));
      // While every key so far is masked, m stays -inf: subtract 0 instead of inf - inf.
      const float m_ref = m_new == -INFINITY ? 0.0f : m_new;
      const float alpha = fast_exp2(m[r] - m_ref);
      float sum = 0.0f;
#pragma unroll
      for (int n = 0; n < NK / 8; ++n) {
#pragma unroll
        for (int c = 2 * r; c < 2 * r + 2; ++c) {
          s[n][c] = fast_exp2(s[n][c] - m_ref);
          sum += s[n][c];
        }
      }
      l[r] = l[r] * alpha + sum;
      m[r] = m_new;
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        o[j][2 * r] *= alpha;
        o[j][2 * r + 1] *= alpha;
      }
    }
  }

  // o += P V for the NK keys whose V rows start at `v_rows`, ROW bytes apart (the latent tile reads
  // them from its K rows); `dsteps` = ceil(head_dim / 16).
  template <int NK, int ROW = tile_row_bytes<D>()>
  KVATTN_DEVICE void accumulate(const float (&p)[NK / 8][4], const unsigned char* v_rows, int dsteps) {
    const int lane = lane_index();
    const int i = lane / 8;  // matrix i: keys (i % 2) * 8 .., dimensions (i / 2) * 8 .. (B = V, transposed)
#pragma unroll
    for (int n16 = 0; n16 < NK / 16; ++n16) {
      // The C fragments of keys 16 n16 .. +7 and +8 .. +15 are the A fragment of these 16 keys.
      const float(&lo)[4] = p[2 * n16];
      const float(&hi)[4] = p[2 * n16 + 1];
#if KVATTN_SIM_BREAK == 3
      const uint32_t a[4] = {pack2<T>(lo[0], lo[1]), pack2<T>(hi[0], hi[1]), pack2<T>(lo[2], lo[3]),
                             pack2<T>(hi[2], hi[3])};  // rows g + 8 and keys 8 .. 15 swapped
#else
      const uint32_t a[4] = {pack2<T>(lo[0], lo[1]), pack2<T>(lo[2], lo[3]), pack2<T>(hi[0], hi[1]),
                             pack2<T>(hi[2], hi[3])};
#endif
#pragma unroll
      for (int dn = 0; dn < D / 16; ++dn) {
        if (dn < dsteps) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, v_rows + (n16 * 16 + (i % 2) * 8 + lane % 8) * ROW + (dn * 16 + (i / 2) * 8) * 2);
          mma_16816<T>(o[2 * dn], a, b[0], b[1]);
          mma_16816<T>(o[2 * dn + 1], a, b[2], b[3]);
        }
      }
    }
  }

  // accumulate for an fp8 V stage (rows of D bytes and 16 of padding): o[j] holds the dims of
  // fp8_v_dim. `groups` = ceil(head_dim / 32) groups of four n8-tiles are computed.
  template <class KV, int NK>
  KVATTN_DEVICE void accumulate_fp8(const float (&p)[NK / 8][4], const unsigned char* v_rows, int groups) {
    static_assert(D % 32 == 0, "fp8 V groups of 32 dims");
    constexpr int kRow = D + 16;
    const int lane = lane_index();
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int n16 = 0; n16 < NK / 16; ++n16) {
      const float(&lo)[4] = p[2 * n16];
      const float(&hi)[4] = p[2 * n16 + 1];
      const uint32_t a[4] = {pack2<T>(lo[0], lo[1]), pack2<T>(lo[2], lo[3]), pack2<T>(hi[0], hi[1]),
                             pack2<T>(hi[2], hi[3])};
      // The B fragment's keys 2t, 2t + 1 (b0) and 2t + 8, 2t + 9 (b1) of these 16.
      const unsigned char* row = v_rows + (n16 * 16 + 2 * t) * kRow + 4 * g;
#pragma unroll
      for (int J = 0; J < D / 32; ++J) {
        if (J < groups) {
          const uint32_t w0 = load_shared_u32(row + J * 32), w1 = load_shared_u32(row + kRow + J * 32);
          const uint32_t w8 = load_shared_u32(row + 8 * kRow + J * 32), w9 = load_shared_u32(row + 9 * kRow + J * 32);
#pragma unroll
          for (int m = 0; m < 4; ++m) {
            const uint32_t pick = m | (m + 4) << 4;  // byte m of the first word, then of the second
            mma_16816<T>(o[4 * J + m], a, fp8x2_to<T, KV>(byte_perm(w0, w1, pick)),
                         fp8x2_to<T, KV>(byte_perm(w8, w9, pick)));
          }
        }
      }
    }
  }

  // Sums the running sums over the quad; after this every lane holds its rows' full sums.
  KVATTN_DEVICE void finish() {
    l[0] = quad_sum(l[0]);
    l[1] = quad_sum(l[1]);
  }
};

// The score switches of kvattn.variants on one base-2 logit `x` (already scaled), in their order:
// the soft-cap cap * tanh(x' / cap) of the natural logit x' (tanh(y) = 1 - 2 / (e^2y + 1), and
// e^(2x'/cap) = 2^(2x/cap): one exp2, an overflow to inf giving tanh = 1 exactly), then ALiBi
// (`alibi2` = slope * log2(e), `distance` the key's position minus the row's ALiBi anchor, or
// minus its absolute value without causality: alibi_anchor).
KVATTN_DEVICE float variant_score(float x, const ScoreVariant& v, float alibi2, float distance) {
  if (v.soft_cap > 0.0f) {
    const float e = exp2f(x * (2.0f / v.soft_cap));
    x = v.soft_cap * (1.0f / kLn2) * (1.0f - 2.0f / (e + 1.0f));
  }
  if (v.alibi != nullptr) x += alibi2 * distance;
  return x;
}

// The ranges of the switch values, kvattn/variants.py's (MIN_SCALE, MAX_SCALE, ALIBI_SLOPE_MAX).
constexpr float kScaleMin = 0x1p-126f, kScaleMax = 0x1p126f, kSlopeMax = 0x1p32f;

KVATTN_DEVICE bool scale_ok(float x) { return x >= kScaleMin && x <= kScaleMax; }  // false for NaN

// The ALiBi slopes of sequence b ([num_heads]); null without ALiBi.
KVATTN_DEVICE const float* seq_slopes(const ScoreVariant& v, int64_t b) {
  return v.alibi != nullptr ? v.alibi + b * v.alibi_stride : nullptr;
}

// The position ALiBi measures the keys of a row at q_pos from, in a table of `capacity` tokens
// (kvattn/variants.py alibi_anchor): the row's own, or for a row past the table (an unvalidated
// seq_len) the table's last key, so that the distances of the keys it reads stay small and exact
// in float32. What that leaves out of every logit of the row, alibi_shift2, joins its lse and its
// sink's comparison once.
KVATTN_DEVICE int64_t alibi_anchor(int64_t q_pos, int64_t capacity) { return q_pos < capacity ? q_pos : capacity - 1; }

// slope * (anchor - q_pos) (base 2) of query head `head` of sequence b's row at q_pos; 0 inside the
// table and without ALiBi.
template <bool VARIANT>
KVATTN_DEVICE float alibi_shift2(const ScoreVariant& v, int64_t b, int head, int64_t q_pos, int64_t capacity) {
  if (!VARIANT || v.alibi == nullptr) return 0.0f;
  return seq_slopes(v, b)[head] * (1.0f / kLn2) * static_cast<float>(alibi_anchor(q_pos, capacity) - q_pos);
}

// Whether query head `head` of sequence b reads anything as far as its score switches go: false
// when its sink is NaN or +inf or its ALiBi slope is not within kSlopeMax (the fp8 scales:
// fp8_scales_ok). The rule is kvattn/variants.py's (Variant.heads_read): such a head gets output 0
// and lse -inf. Tested once per row after the key loop, from values the kernel reads anyway.
template <bool VARIANT>
KVATTN_DEVICE bool head_reads(const ScoreVariant& v, int64_t b, int head) {
  bool ok = true;
  if (VARIANT) {
    if (v.sinks != nullptr) ok = ok && v.sinks[head] < INFINITY;
    if (v.alibi != nullptr) ok = ok && fabsf(seq_slopes(v, b)[head]) <= kSlopeMax;
  }
  return ok;
}

// Element i of the query rows at `q`: of type T, or (fp8 queries, q_dtype 1 or 2) an fp8 code
// converted to T exactly (every e4m3 and e5m2 value is a float16 and a bfloat16 value).
template <class T>
KVATTN_DEVICE T query_element(const void* q, int64_t i, int q_dtype) {
  if (q_dtype == static_cast<int>(KVType::kE4M3)) return from_float<T>(fp8_to_float(static_cast<const Fp8E4M3*>(q)[i]));
  if (q_dtype == static_cast<int>(KVType::kE5M2)) return from_float<T>(fp8_to_float(static_cast<const Fp8E5M2*>(q)[i]));
  return static_cast<const T*>(q)[i];
}

// The scale of the scores of sequence b's KV head over fp8 pools: the logit scale (base 2) times
// k_scale and, for fp8 queries, q_scale.
KVATTN_DEVICE float fp8_score_scale(const AttentionParams& p, int64_t b, int kv_head) {
  const int64_t i = b * p.scale_stride + kv_head;
  return p.scale_log2 * p.k_scale[i] * (p.q_dtype != 0 ? p.q_scale[i] : 1.0f);
}

// Whether sequence b's fp8 scales of its KV head are in range (kvattn/variants.py scale_ok), the
// query's too for fp8 queries: else the head reads nothing (head_reads).
KVATTN_DEVICE bool fp8_scales_ok(const AttentionParams& p, int64_t b, int kv_head) {
  const int64_t i = b * p.scale_stride + kv_head;
  return scale_ok(p.k_scale[i]) && scale_ok(p.v_scale[i]) && (p.q_dtype == 0 || scale_ok(p.q_scale[i]));
}

// The softmax denominator of a row with running max m (base 2) and sum l: an attention sink's
// logit (natural) joins it, less the row's ALiBi shift (base 2) its logits left out. A row with
// nothing read (l == 0) is 0 / -inf whatever the sink.
KVATTN_DEVICE float with_sink(float l, float m, const float* sinks, int head, float shift2) {
  if (sinks == nullptr || l == 0.0f) return l;
  return l + exp2f(sinks[head] * (1.0f / kLn2) - shift2 - (m == -INFINITY ? 0.0f : m));
}

}  // namespace kvattn
