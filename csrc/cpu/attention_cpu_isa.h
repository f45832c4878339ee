// The vectorized body of the CPU paged attention (attention_cpu.h, which states the method and
// includes this file once per instruction set, each time inside ``namespace KVATTN_CPU_ISA`` and
// under that set's ``#pragma GCC target``): every function here, helpers included, is compiled
// for the set from its first line, so GCC lowers the vector extension's compares and selects to
// that set's instructions. (Compiled for the baseline and cloned afterwards, as target_clones
// does, a select on two combined compares stayed a loop of scalar compares in every clone: a
// third of the decode's time.) No include guard: included once per set.

namespace kvattn {
namespace cpu {
namespace KVATTN_CPU_ISA {

KVATTN_CPU_INLINE Lanes load_lanes(const float* p) {
  Lanes x;
  std::memcpy(&x, p, sizeof x);
  return x;
}
KVATTN_CPU_INLINE void store_lanes(float* p, Lanes x) { std::memcpy(p, &x, sizeof x); }

// exp(x) for x <= 0 (scores minus their running maximum), 0 below float's range and for -inf:
// Cephes' expf (range reduction by ln 2 in two parts, a degree-5 polynomial, 2^n from the exponent
// bits), within 2 ulp of exp. For a float and for 16 lanes at once from one source: std::exp
// without -ffast-math does not vectorize, and exps are as many as scores.
KVATTN_CPU_INLINE int32_t to_int(float x) { return x == x ? static_cast<int32_t>(x) : 0; }  // NaN: y is NaN
KVATTN_CPU_INLINE IntLanes to_int(Lanes x) { return __builtin_convertvector(x, IntLanes); }
KVATTN_CPU_INLINE float as_float_bits(int32_t x) {
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}
KVATTN_CPU_INLINE Lanes as_float_bits(IntLanes x) { return reinterpret_cast<Lanes&>(x); }

template <class V>
KVATTN_CPU_INLINE V exp_nonpositive(V x) {
  const V c = x < -87.0f ? V{} - 87.0f : x;
  const V n = (c * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  const V r = c - n * 0.693359375f + n * 2.12194440e-4f;
  V y = V{} + 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const V scale = as_float_bits((to_int(n) + 127) << 23);
  return x < -87.0f ? V{} : y * scale;
}

// Without fast-math the compiler may not reorder a sum into vector lanes, so the blocked loops
// keep independent partial sums per lane themselves.

// scores [KEYS, 16 rows] (row stride ``lds``) = keys [KEYS, D] (row stride ``ldk``) x the rows'
// queries transposed, qt [D, 16 rows] (row stride ``ldq``).
template <int64_t KEYS>
KVATTN_CPU_INLINE void score_block(const float* keys, int64_t ldk, const float* qt, int64_t ldq, int64_t D,
                                   float* scores, int64_t lds) {
  Lanes acc[KEYS] = {};
  for (int64_t d = 0; d < D; ++d) {
    const Lanes q = load_lanes(qt + d * ldq);
    for (int64_t k = 0; k < KEYS; ++k) acc[k] += keys[k * ldk + d] * q;
  }
  for (int64_t k = 0; k < KEYS; ++k) store_lanes(scores + k * lds, acc[k]);
}

// The 16 sums of x[0..15], sum(x[k]) in lane k: pairs of vectors folded over one lane bit at a
// time (8, 4, 2, 1), x's lanes keeping the keys whose bit is clear, y's those whose bit is set,
// so the last fold leaves key k's sum in lane k. 15 folds of two shuffles and an add, against 16
// horizontal sums of 4 steps each.
KVATTN_CPU_INLINE Lanes fold8(Lanes x, Lanes y) {
  return __builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 24, 25, 26, 27, 28, 29, 30, 31) +
         __builtin_shufflevector(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23);
}
KVATTN_CPU_INLINE Lanes fold4(Lanes x, Lanes y) {
  return __builtin_shufflevector(x, y, 0, 1, 2, 3, 20, 21, 22, 23, 8, 9, 10, 11, 28, 29, 30, 31) +
         __builtin_shufflevector(x, y, 4, 5, 6, 7, 16, 17, 18, 19, 12, 13, 14, 15, 24, 25, 26, 27);
}
KVATTN_CPU_INLINE Lanes fold2(Lanes x, Lanes y) {
  return __builtin_shufflevector(x, y, 0, 1, 18, 19, 4, 5, 22, 23, 8, 9, 26, 27, 12, 13, 30, 31) +
         __builtin_shufflevector(x, y, 2, 3, 16, 17, 6, 7, 20, 21, 10, 11, 24, 25, 14, 15, 28, 29);
}
KVATTN_CPU_INLINE Lanes fold1(Lanes x, Lanes y) {
  return __builtin_shufflevector(x, y, 0, 17, 2, 19, 4, 21, 6, 23, 8, 25, 10, 27, 12, 29, 14, 31) +
         __builtin_shufflevector(x, y, 1, 16, 3, 18, 5, 20, 7, 22, 9, 24, 11, 26, 13, 28, 15, 30);
}
KVATTN_CPU_INLINE Lanes sums16(Lanes* x) {
  for (int k = 0; k < 8; ++k) x[k] = fold8(x[k], x[k + 8]);
  for (int k = 0; k < 4; ++k) x[k] = fold4(x[k], x[k + 4]);
  for (int k = 0; k < 2; ++k) x[k] = fold2(x[k], x[k + 2]);
  return fold1(x[0], x[1]);
}

// Row scores of an item of few rows (a decode's GQA group): key k of keys [n <= 16, D] (row
// stride ``ldk``) against the row's query q [D] in lane k (lanes past n hold 0). The head dim is in
// the lanes, so each product uses all 16 where rows in the lanes would leave most idle (13 of 16
// for a group of 3), and the 16 keys' sums come out of one fold. D is a multiple of 16.
KVATTN_CPU_INLINE Lanes row_scores(const float* keys, int64_t ldk, const float* q, int64_t D, int64_t n) {
  Lanes part[kLanes];
  if (n == kLanes) {
    // Dims outer, keys inner: 16 independent sums in registers (no chain of one key's D / 16
    // multiply-adds, no zeroed array in memory first).
    const Lanes q0 = load_lanes(q);
#pragma GCC unroll 16
    for (int64_t k = 0; k < kLanes; ++k) part[k] = load_lanes(keys + k * ldk) * q0;
    for (int64_t d = kLanes; d < D; d += kLanes) {
      const Lanes qd = load_lanes(q + d);
#pragma GCC unroll 16
      for (int64_t k = 0; k < kLanes; ++k) part[k] += load_lanes(keys + k * ldk + d) * qd;
    }
  } else {
    for (int64_t k = 0; k < kLanes; ++k) part[k] = Lanes{};
    for (int64_t k = 0; k < n; ++k)
      for (int64_t d = 0; d < D; d += kLanes) part[k] += load_lanes(keys + k * ldk + d) * load_lanes(q + d);
  }
  return sums16(part);
}

// The larger of two lanes, NaN where either is (the running maximum keeps a NaN score).
KVATTN_CPU_INLINE Lanes max_nan(Lanes a, Lanes b) { return (a > b) | (a != a) ? a : b; }

// op over the 16 lanes of x: halves, quarters, pairs, neighbours.
template <class Op>
KVATTN_CPU_INLINE float reduce_lanes(Lanes x, Op op) {
  x = op(x, __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  x = op(x, __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  x = op(x, __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  x = op(x, __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
  return x[0];
}
KVATTN_CPU_INLINE float max_lanes(Lanes x) {
  return reduce_lanes(x, [](Lanes a, Lanes b) { return max_nan(a, b); });
}
KVATTN_CPU_INLINE float sum_lanes(Lanes x) {
  return reduce_lanes(x, [](Lanes a, Lanes b) { return a + b; });
}

// acc [kRows, 16 dims] (row stride ``lda``) += w [n keys, kRows] (weight of key s for row r at
// w[s * wk + r * wr]: key-major where the rows are in the lanes, row-major on the few rows' path)
// x values [n, 16 dims] (row stride ``ldv``). A key outside a row's bounds has weight exactly 0
// and must add nothing even where its value is inf or NaN (a later position of the sequence,
// which another row of the tile reads; 0 * inf is NaN): keys whose value row is not all finite
// (``finite[s]`` 0) add only their nonzero weights.
KVATTN_CPU_INLINE void value_block(float* acc, int64_t lda, const float* w, int64_t wk, int64_t wr,
                                   const float* values, int64_t ldv, const uint8_t* finite, int64_t n) {
  Lanes o[kRows];
  for (int64_t r = 0; r < kRows; ++r) o[r] = load_lanes(acc + r * lda);
  for (int64_t s = 0; s < n; ++s) {
    const Lanes v = load_lanes(values + s * ldv);
    if (finite[s]) {
      for (int64_t r = 0; r < kRows; ++r) o[r] += w[s * wk + r * wr] * v;
    } else {
      for (int64_t r = 0; r < kRows; ++r)
        if (w[s * wk + r * wr] != 0.0f) o[r] += w[s * wk + r * wr] * v;
    }
  }
  for (int64_t r = 0; r < kRows; ++r) store_lanes(acc + r * lda, o[r]);
}

// value_block over 64 dims at once: each key's four value vectors meet each row's weight, so a
// key adds 16 independent multiply-adds where value_block's 4 wait on the previous key's.
KVATTN_CPU_INLINE void value_block64(float* acc, int64_t lda, const float* w, int64_t wk, int64_t wr,
                                     const float* values, int64_t ldv, const uint8_t* finite, int64_t n) {
  constexpr int kParts = 4;
  Lanes o[kRows][kParts];
  for (int64_t r = 0; r < kRows; ++r)
    for (int c = 0; c < kParts; ++c) o[r][c] = load_lanes(acc + r * lda + c * kLanes);
  for (int64_t s = 0; s < n; ++s) {
    Lanes v[kParts];
    for (int c = 0; c < kParts; ++c) v[c] = load_lanes(values + s * ldv + c * kLanes);
    for (int64_t r = 0; r < kRows; ++r) {
      const float ws = w[s * wk + r * wr];
      if (!finite[s] && ws == 0.0f) continue;
      for (int c = 0; c < kParts; ++c) o[r][c] += ws * v[c];
    }
  }
  for (int64_t r = 0; r < kRows; ++r)
    for (int c = 0; c < kParts; ++c) store_lanes(acc + r * lda + c * kLanes, o[r][c]);
}

// One item's scratch, float32, rows padded to 16 (padded rows stay 0 and read nothing): qt [D, R]
// (queries transposed) and qr [R, D] (as they lie, for the few rows' path), keys [KB, D] and
// values [KB, DV] of a page in float32 (where the pool's own rows cannot be read as they are),
// scores [KB, R] (key-major: the rows in lanes), weights [R, KW] (row-major, the keys in lanes:
// the few rows' path, KW the page rounded up to 16 keys), acc [R, DV]; per row m, l and the key
// positions [lo, hi) it may read.
struct Scratch {
  int64_t R, KB, KW, D, DV;
  std::vector<float> qt, qr, keys, values, scores, weights, acc, m, l;
  std::vector<int64_t> lo, hi;
  std::vector<uint8_t> finite;  // [KB]: the page's value row s holds no inf or NaN
  Scratch(int64_t rows, int64_t head_dim, int64_t Dv, int64_t page_size)
      : R(round_up(rows, kLanes)),
        KB(round_up(page_size, kKeys)),
        KW(round_up(page_size, kLanes)),
        D(head_dim),
        DV(round_up(Dv, kLanes)),
        qt(D * R),
        qr(R * D),
        keys(KB * D),
        values(KB * DV),
        scores(KB * R),
        weights(R * KW),
        acc(R * DV),
        m(R),
        l(R),
        lo(R),
        hi(R),
        finite(KB) {}
};

// The online softmax of rows [r, r + 16) over keys [0, ns) at positions first, first + 1, ...:
// scores outside a row's [lo, hi) become 0 weights, the rest exp(score - the row's new maximum),
// with the row's l and accumulator rescaled. The bounds are compared as int32 lanes relative to
// the page's first key (exact for any length); a NaN score of a key the row reads is kept, as
// the reference keeps it.
KVATTN_CPU_INLINE void softmax_block(Scratch& w, int64_t r, int64_t ns, int64_t first, float soft_cap) {
  IntLanes lo, hi;
  for (int64_t j = 0; j < kLanes; ++j) {
    lo[j] = static_cast<int32_t>(std::min<int64_t>(std::max<int64_t>(w.lo[r + j] - first, 0), ns));
    hi[j] = static_cast<int32_t>(std::min<int64_t>(std::max<int64_t>(w.hi[r + j] - first, 0), ns));
  }
  const Lanes m = load_lanes(w.m.data() + r);
  const Lanes minus_inf = Lanes{} - std::numeric_limits<float>::infinity();
  Lanes top = m;
  for (int64_t s = 0; s < ns; ++s) {
    float* row = w.scores.data() + s * w.R + r;
    Lanes x = load_lanes(row);
    if (soft_cap > 0.0f)
      for (int64_t j = 0; j < kLanes; ++j) x[j] = soft_cap * std::tanh(x[j] / soft_cap);
    const IntLanes key = IntLanes{} + static_cast<int32_t>(s);
    x = (key >= lo) & (key < hi) ? x : minus_inf;
    store_lanes(row, x);
    top = (x > top) | (x != x) ? x : top;
  }
  // A row with nothing read yet keeps m = -inf and rescales by 1: its l and accumulator are 0.
  const auto seen = top > minus_inf;
  const Lanes rescale = seen ? exp_nonpositive(m - top) : Lanes{} + 1.0f;
  Lanes sum = {};
  for (int64_t s = 0; s < ns; ++s) {
    float* row = w.scores.data() + s * w.R + r;
    const Lanes x = load_lanes(row);
    const IntLanes key = IntLanes{} + static_cast<int32_t>(s);
    const Lanes p = (key >= lo) & (key < hi) ? exp_nonpositive(x - top) : Lanes{};
    store_lanes(row, p);
    sum += p;
  }
  store_lanes(w.l.data() + r, load_lanes(w.l.data() + r) * rescale + sum);
  store_lanes(w.m.data() + r, top);
  for (int64_t j = 0; j < kLanes; ++j) {
    if (rescale[j] == 1.0f) continue;
    float* y = w.acc.data() + (r + j) * w.DV;
    for (int64_t d = 0; d < w.DV; ++d) y[d] *= rescale[j];
  }
}

// softmax_block for an item of at most kFewRows rows (a decode's GQA group) with the keys in the
// lanes instead of the rows: each row's scores 16 keys at a time (row_scores), the same bounds,
// soft-cap, running maximum (NaN kept) and rescaling, each row's scores and then its weights in
// its row of ``weights`` (whole vectors: no lane is scattered), which value_block reads for rows
// up to a multiple of kRows: the padded ones get 0.
KVATTN_CPU_INLINE void softmax_few(Scratch& w, int64_t rows, const float* keys, int64_t ldk, int64_t ns, int64_t first,
                                   float soft_cap) {
  const float inf = std::numeric_limits<float>::infinity();
  const Lanes minus_inf = Lanes{} - inf;
  IntLanes iota;
  for (int64_t j = 0; j < kLanes; ++j) iota[j] = static_cast<int32_t>(j);
  for (int64_t r = 0; r < rows; ++r) {
    float* x = w.weights.data() + r * w.KW;
    const int32_t lo = static_cast<int32_t>(std::min<int64_t>(std::max<int64_t>(w.lo[r] - first, 0), ns));
    const int32_t hi = static_cast<int32_t>(std::min<int64_t>(std::max<int64_t>(w.hi[r] - first, 0), ns));
    Lanes tops = Lanes{} + w.m[r];  // lane-wise over the blocks, one horizontal max after them
    for (int64_t s = 0; s < ns; s += kLanes) {
      Lanes v = row_scores(keys + s * ldk, ldk, w.qr.data() + r * w.D, w.D, min64(kLanes, ns - s));
      if (soft_cap > 0.0f)
        for (int64_t j = 0; j < kLanes; ++j) v[j] = soft_cap * std::tanh(v[j] / soft_cap);
      const IntLanes key = iota + static_cast<int32_t>(s);
      v = (key >= lo) & (key < hi) ? v : minus_inf;
      store_lanes(x + s, v);
      tops = max_nan(v, tops);
    }
    const float top = max_lanes(tops);
    // A row with nothing read yet keeps m = -inf and rescales by 1: its l and accumulator are 0.
    const float rescale = top > -inf ? exp_nonpositive(w.m[r] - top) : 1.0f;
    Lanes sum = {};
    for (int64_t s = 0; s < ns; s += kLanes) {
      const IntLanes key = iota + static_cast<int32_t>(s);
      const Lanes p = (key >= lo) & (key < hi) ? exp_nonpositive(load_lanes(x + s) - top) : Lanes{};
      sum += p;
      store_lanes(x + s, p);
    }
    w.l[r] = w.l[r] * rescale + sum_lanes(sum);
    w.m[r] = top;
    if (rescale != 1.0f)
      for (int64_t d = 0; d < w.DV; ++d) w.acc[r * w.DV + d] *= rescale;
  }
  std::fill(w.weights.data() + rows * w.KW, w.weights.data() + round_up(rows, kRows) * w.KW, 0.0f);
}

// dst[0, n) = src[0, n) as float32, exactly: bfloat16 16 at a time (each the high half of its
// float32), float16 16 at a time where the compiler has _Float16 (the set's conversion
// instruction: vcvtph2ps with F16C), the rest one by one. (One by one, the conversion of a
// bfloat16 pool took 80% of the decode: about a nanosecond an element.)
template <class T>
KVATTN_CPU_INLINE void to_float(float* dst, const T* src, int64_t n) {
  int64_t d = 0;
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    typedef uint16_t Bits16 __attribute__((vector_size(kLanes * sizeof(uint16_t))));
    for (; d + kLanes <= n; d += kLanes) {
      Bits16 bits;
      std::memcpy(&bits, src + d, sizeof bits);
      store_lanes(dst + d, as_float_bits(__builtin_convertvector(bits, IntLanes) << 16));
    }
  }
#ifdef __FLT16_MAX__
  if constexpr (std::is_same<T, __half>::value) {
    typedef _Float16 Half16 __attribute__((vector_size(kLanes * sizeof(_Float16))));
    for (; d + kLanes <= n; d += kLanes) {
      Half16 h;
      std::memcpy(&h, src + d, sizeof h);
      store_lanes(dst + d, __builtin_convertvector(h, Lanes));
    }
  }
#endif
  for (; d < n; ++d) dst[d] = load(src + d);
}

// The keys [s0, s0 + ns) of one page for one KV head through the item's ``rows`` rows: scores,
// online softmax, values. Float32 pools are read in place (keys always, values when their rows
// hold whole lane groups); other dtypes are converted into the scratch first.
template <class T>
void attend_page(Scratch& w, int64_t rows, const T* kpage, int64_t stride_ks, const T* vpage,
                                   int64_t stride_vs, int64_t Dv, int64_t s0, int64_t ns, int64_t first,
                                   float soft_cap) {
  const int64_t D = w.D;
  const float* keys = w.keys.data();
  int64_t ldk = D;
  if constexpr (std::is_same<T, float>::value) {
    keys = kpage + s0 * stride_ks;
    ldk = stride_ks;
  } else {
    for (int64_t s = 0; s < ns; ++s) to_float(w.keys.data() + s * D, kpage + (s0 + s) * stride_ks, D);
  }
  const float* values = w.values.data();
  int64_t ldv = w.DV;
  if (std::is_same<T, float>::value && Dv == w.DV) {
    values = reinterpret_cast<const float*>(vpage + s0 * stride_vs);
    ldv = stride_vs;
  } else {
    for (int64_t s = 0; s < ns; ++s) to_float(w.values.data() + s * w.DV, vpage + (s0 + s) * stride_vs, Dv);
  }
  // An inf or NaN has every exponent bit set, so the page's largest masked exponent says whether
  // it holds one (an integer max: one cycle a vector, no chain of adds). The rows' padded dims
  // (values converted into the scratch) are 0. Rows are judged one by one only on a page that
  // holds an inf or NaN: x * 0 is 0 for a finite x and NaN otherwise, and the sum of a row's
  // lanes is 0 exactly when they all are.
  IntLanes exponents = {};
  for (int64_t s = 0; s < ns; ++s)
    for (int64_t d = 0; d < w.DV; d += kLanes) {
      IntLanes bits;
      std::memcpy(&bits, values + s * ldv + d, sizeof bits);
      bits &= 0x7f800000;
      exponents = bits > exponents ? bits : exponents;
    }
  int32_t top_exponent = 0;
  for (int64_t j = 0; j < kLanes; ++j) top_exponent = std::max(top_exponent, exponents[j]);
  if (top_exponent != 0x7f800000) {
    std::fill(w.finite.begin(), w.finite.begin() + ns, uint8_t{1});
  } else {
    for (int64_t s = 0; s < ns; ++s) {
      Lanes z = {};
      for (int64_t d = 0; d < w.DV; d += kLanes) z += load_lanes(values + s * ldv + d) * 0.0f;
      w.finite[s] = sum_lanes(z) == 0.0f;
    }
  }
  const int64_t R = round_up(rows, kLanes);
  const bool few = rows <= kFewRows && D % kLanes == 0;
  if (few) {
    softmax_few(w, rows, keys, ldk, ns, first, soft_cap);
  } else {
    for (int64_t r = 0; r < R; r += kLanes) {
      int64_t s = 0;
      for (; s + kKeys <= ns; s += kKeys)
        score_block<kKeys>(keys + s * ldk, ldk, w.qt.data() + r, w.R, D, w.scores.data() + s * w.R + r, w.R);
      for (; s < ns; ++s) score_block<1>(keys + s * ldk, ldk, w.qt.data() + r, w.R, D, w.scores.data() + s * w.R + r, w.R);
      softmax_block(w, r, ns, first, soft_cap);
    }
  }
  // The weight of key s for row r: weights[r][s] on the few rows' path, scores[s][r] otherwise.
  const int64_t wk = few ? 1 : w.R, wr = few ? w.KW : 1;
  for (int64_t r = 0; r < round_up(rows, kRows); r += kRows) {
    const float* wts = few ? w.weights.data() + r * w.KW : w.scores.data() + r;
    float* acc = w.acc.data() + r * w.DV;
    int64_t j = 0;
    for (; j + 4 * kLanes <= w.DV; j += 4 * kLanes)
      value_block64(acc + j, w.DV, wts, wk, wr, values + j, ldv, w.finite.data(), ns);
    for (; j < w.DV; j += kLanes) value_block(acc + j, w.DV, wts, wk, wr, values + j, ldv, w.finite.data(), ns);
  }
}

// The report of one sequence under the per-call check, and each logical page's readable slots
// (pages holding no key the sequence's rows read from ``first_key`` on are neither checked nor
// read).
inline void check_sequence(const AttendParams& p, int64_t b, int64_t seq_len, int64_t raw_len, int64_t first_key,
                           int32_t* limit) {
  int bad = 0, bits = 0, read = 0;
  const int32_t* bt_row = p.block_table + b * p.stride_bt;
  const int64_t* exp_row = p.expected + b * p.stride_eb;
  for (int64_t i = 0; i < p.max_pages; ++i) {
    const int64_t slots_read = min64(max64(seq_len - i * p.page_size, 0), p.page_size);
    const bool reads = slots_read > 0 && (i + 1) * p.page_size > first_key;
    int reason = 0;
    limit[i] = 0;
    if (reads) {
      const int64_t page = bt_row[i];
      const bool in_range = page >= 0 && page < p.num_pages;
      const int64_t tag = in_range ? p.tags[page] : 0;
      const int64_t owner = exp_row[i * p.stride_ep];
      reason = page_reason(tag, in_range, owner, slots_read);
      limit[i] = in_range ? static_cast<int32_t>(std::min<int64_t>(slots_read, readable_slots(tag, owner))) : 0;
      ++read;
    }
    p.page_reasons[b * p.max_pages + i] = static_cast<int8_t>(reason);
    bad += reason != 0;
    bits |= reason;
  }
  const int beyond = raw_len > p.max_pages * p.page_size;
  p.violations[b] = bad + beyond;
  p.reasons[b] = bits | (beyond ? static_cast<int>(tags::Violation_OUT_OF_RANGE) : 0);
  p.checked[b] = read;
  p.beyond[b] = beyond;
}

// Through a verdict: each page's entry, and the new token's page against this call's tag, whose
// refusal joins the verdict's report once (kvattn.reference.verdict_slots).
inline void verdict_sequence(const AttendParams& p, int64_t b, int64_t seq_len, int64_t raw_len, int32_t* limit) {
  const int64_t* entries = p.verdict + b * p.max_pages;
  for (int64_t i = 0; i < p.max_pages; ++i) {
    // The entry's low 32 bits as the oracle reads them (kvattn.reference.unpack_verdict).
    const int64_t page = entries[i] >> 32;
    const int64_t readable = entries[i] & 0xFFFFFFFFLL;
    const int64_t slots_read = min64(max64(seq_len - i * p.page_size, 0), p.page_size);
    limit[i] = page >= 0 && page < p.num_pages ? static_cast<int32_t>(std::min<int64_t>(readable, slots_read)) : 0;
  }
  const int64_t pos = raw_len - 1;
  if (pos < 0 || pos >= p.max_pages * p.page_size) return;
  const int64_t fresh = pos / p.page_size, slot = pos - fresh * p.page_size;
  const int64_t page = entries[fresh] >> 32;
  const int64_t readable = entries[fresh] & 0xFFFFFFFFLL;
  const bool in_range = page >= 0 && page < p.num_pages;
  const int64_t tag = in_range ? p.tags[page] : 0;
  const int64_t owner = p.expected[b * p.stride_eb + fresh * p.stride_ep];
  // Older slots another layer refused stay refused; the new one is this call's tag's to certify.
  const int64_t cap = readable < slot ? readable : p.page_size;
  limit[fresh] = in_range ? static_cast<int32_t>(std::min<int64_t>({static_cast<int64_t>(readable_slots(tag, owner)), cap,
                                                                    slot + 1}))
                          : 0;
  const int why = page_reason(tag, in_range, owner, slot + 1);
  int8_t& before = p.page_reasons[b * p.max_pages + fresh];
  if (why != 0 && before == 0) {
    before = static_cast<int8_t>(why);
    p.violations[b] += 1;
    p.reasons[b] |= why;
  }
}

// Sequence b's query rows [row0, row0 + q_len), its length, and the pages its rows may read.
struct Sequence {
  int64_t row0, q_len, raw_len, seq_len;
};

struct Item {
  int64_t b, h, t0, t1;  // positions t0..t1 of sequence b's rows, KV head h
};

// One item: its rows' online softmax over the pages they may read, then out and lse.
template <class T, Mode M>
void attend_item(const AttendParams& p, const Sequence& sq, const Item& it, const int32_t* limit, Scratch& w) {
  const int64_t group = p.num_heads / p.num_kv_heads;
  const int64_t D = p.head_dim, Dv = p.head_dim_v, P = p.page_size;
  const int64_t rows = (it.t1 - it.t0) * group;
  const T* qs = static_cast<const T*>(p.q);
  std::fill(w.qt.begin(), w.qt.end(), 0.0f);
  std::fill(w.acc.begin(), w.acc.end(), 0.0f);
  // Padded rows read no key (an empty [lo, hi)) and keep weights 0.
  std::fill(w.lo.begin(), w.lo.end(), 0);
  std::fill(w.hi.begin(), w.hi.end(), 0);
  std::fill(w.m.begin(), w.m.end(), -std::numeric_limits<float>::infinity());
  std::fill(w.l.begin(), w.l.end(), 0.0f);
  int64_t tile_lo = std::numeric_limits<int64_t>::max(), tile_hi = 0;
  for (int64_t t = it.t0; t < it.t1; ++t) {
    const int64_t pos = sq.raw_len - sq.q_len + t;
    const int64_t lo = p.window_left >= 0 ? max64(pos - p.window_left, 0) : 0;
    int64_t hi = p.causal ? min64(pos + 1, sq.seq_len) : sq.seq_len;
    if (p.window_right >= 0) hi = max64(min64(hi, pos + p.window_right + 1), 0);
    tile_lo = std::min(tile_lo, lo);
    tile_hi = std::max(tile_hi, hi);
    for (int64_t g = 0; g < group; ++g) {
      const int64_t r = (t - it.t0) * group + g;
      const T* qrow = qs + (sq.row0 + t) * p.stride_qt + (it.h * group + g) * p.stride_qh;
      for (int64_t d = 0; d < D; ++d) w.qt[d * w.R + r] = w.qr[r * D + d] = load(qrow + d) * p.scale;
      w.lo[r] = lo;
      w.hi[r] = hi;
    }
  }
  const T* ks = static_cast<const T*>(p.k);
  const T* vs = static_cast<const T*>(p.v);
  const int32_t* bt_row = p.block_table + it.b * p.stride_bt;
  if (tile_lo < tile_hi) {
    for (int64_t i = tile_lo / P; i < (tile_hi + P - 1) / P; ++i) {
      const int64_t s0 = max64(tile_lo - i * P, 0);
      const int64_t s1 = min64(static_cast<int64_t>(limit[i]), tile_hi - i * P);
      if (s0 >= s1) continue;
      const int64_t page = M == Mode::kVerdict ? (p.verdict[it.b * p.max_pages + i] >> 32) : bt_row[i];
      attend_page<T>(w, rows, ks + page * p.stride_kp + it.h * p.stride_kh, p.stride_ks,
                     vs + page * p.stride_vp + it.h * p.stride_vh, p.stride_vs, Dv, s0, s1 - s0, i * P + s0,
                     p.soft_cap);
    }
  }
  T* outs = static_cast<T*>(p.out);
  for (int64_t t = it.t0; t < it.t1; ++t) {
    for (int64_t g = 0; g < group; ++g) {
      const int64_t r = (t - it.t0) * group + g, head = it.h * group + g, row = sq.row0 + t;
      T* orow = outs + row * p.stride_ot + head * p.stride_oh;
      const float inv = w.l[r] > 0.0f ? 1.0f / w.l[r] : 0.0f;
      for (int64_t d = 0; d < Dv; ++d) store(orow + d, w.acc[r * w.DV + d] * inv);
      if (p.lse != nullptr)
        p.lse[row * p.num_heads + head] =
            w.l[r] > 0.0f ? w.m[r] + std::log(w.l[r]) : -std::numeric_limits<float>::infinity();
    }
  }
}

// The whole call: each sequence's rows and report (or none), the readable slots of its pages, then
// its items.
template <class T, Mode M>
void attend(const AttendParams& p) {
  const int64_t group = p.num_heads / p.num_kv_heads;
  const int64_t capacity = p.max_pages * p.page_size;
  std::vector<Sequence> seqs(p.batch);
  std::vector<int32_t> limits(p.batch * p.max_pages, 0);
  std::vector<Item> items;
  const int64_t positions = std::max<int64_t>(kTileRows / group, 1);
  double work = 0;
  int64_t previous = 0;  // offsets clamped to [0, total_q] and made non-decreasing (layout.query_offsets)
  for (int64_t b = 0; b < p.batch; ++b) {
    Sequence& sq = seqs[b];
    if (p.cu_seqlens_q != nullptr) {
      const int64_t lo = std::max(previous, min64(max64(p.cu_seqlens_q[b], 0), p.total_q));
      const int64_t hi = std::max(lo, min64(max64(p.cu_seqlens_q[b + 1], 0), p.total_q));
      sq.row0 = lo;
      sq.q_len = hi - lo;
      previous = hi;
    } else {
      sq.row0 = b;
      sq.q_len = 1;
    }
    sq.raw_len = p.seq_lens[b];
    sq.seq_len = min64(max64(sq.raw_len, 0), capacity);
    // The first key the sequence's first row reads: the window's start; the pages before it are
    // neither checked nor read (kvattn.reference.first_keys).
    const int64_t first_key = p.window_left >= 0 ? max64(sq.raw_len - sq.q_len - p.window_left, 0) : 0;
    int32_t* limit = limits.data() + b * p.max_pages;
    if (M == Mode::kChecked) {
      check_sequence(p, b, sq.seq_len, sq.raw_len, first_key, limit);
    } else if (M == Mode::kVerdict) {
      verdict_sequence(p, b, sq.seq_len, sq.raw_len, limit);
    } else {
      const int32_t* bt_row = p.block_table + b * p.stride_bt;
      for (int64_t i = 0; i < p.max_pages; ++i) {
        const int64_t page = bt_row[i];
        limit[i] = page >= 0 && page < p.num_pages
                       ? static_cast<int32_t>(min64(max64(sq.seq_len - i * p.page_size, 0), p.page_size))
                       : 0;
      }
    }
    // A causal sequence with more rows than keys reads nothing: its rows get 0 and lse -inf (an
    // empty key range for every row).
    if (p.causal && sq.q_len > sq.raw_len) sq.seq_len = 0;
    for (int64_t h = 0; h < p.num_kv_heads; ++h)
      for (int64_t t0 = 0; t0 < sq.q_len; t0 += positions) items.push_back({b, h, t0, min64(t0 + positions, sq.q_len)});
    work += static_cast<double>(sq.q_len) * (sq.seq_len + 1) * p.num_heads * (p.head_dim + p.head_dim_v);
  }
  const int64_t threads = work < kThreadWork ? 1 : std::min<int64_t>(std::max<int64_t>(p.threads, 1), items.size());
  // Allocated before the parallel region: an exception (bad_alloc) must not leave one.
  std::vector<Scratch> scratch(threads, Scratch(positions * group, p.head_dim, p.head_dim_v, p.page_size));
  std::atomic<int64_t> next{0}, slot{0};
  const auto run = [&]() {
    Scratch& w = scratch[slot++];
    for (int64_t n = next++; n < static_cast<int64_t>(items.size()); n = next++) {
      const Item& it = items[n];
      attend_item<T, M>(p, seqs[it.b], it, limits.data() + it.b * p.max_pages, w);
    }
  };
  // OpenMP, because it is the engine's pool: torch loads its libgomp.so.1 before this module, so
  // this module's libgomp.so.1 is that one, and the region runs on the threads torch (and vLLM's
  // core binding) set up, which spin for a while after each torch op. Threads of our own would
  // compete with those spinning ones for the same cores.
#pragma omp parallel num_threads(static_cast<int>(threads)) if (threads > 1)
  run();
}

}  // namespace KVATTN_CPU_ISA
}  // namespace cpu
}  // namespace kvattn
