// The paged decode on the CPU, checked and unchecked from one source: for CPU tensors where no GPU
// kernel runs (vLLM's and SGLang's CPU engines). The reader's rule is tag_rule.cuh's (the one C++
// statement of docs/ownership.md section 3); a verdict (section 9) is read as the Triton kernel
// reads it. Float32 arithmetic over float32, float16 or bfloat16 pools; a sliding window and the
// logit soft-cap; the other switches of kvattn.variants are refused by the backend
// (kvattn/backends/cpu). A refused slot is never loaded: only the slots a page's limit allows are
// read, so NaN in them cannot reach a sum.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "kvattn/tag_rule.cuh"

namespace kvattn {
namespace cpu {

enum class Mode { kUnchecked, kChecked, kVerdict };

struct DecodeParams {
  const void* q;
  const void* k;
  const void* v;
  const int32_t* block_table;
  const int32_t* seq_lens;
  const int64_t* tags;
  const int64_t* expected;
  const int64_t* verdict;  // [B, max_pages] page << 32 | readable (kVerdict)
  void* out;
  float* lse;  // null: not asked
  int32_t* violations;
  int32_t* reasons;
  int32_t* checked;
  int32_t* beyond;
  int8_t* page_reasons;  // [B, max_pages]
  int64_t batch, num_heads, num_kv_heads, head_dim, head_dim_v, page_size, max_pages, num_pages;
  int64_t stride_qb, stride_qh;
  int64_t stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh;
  int64_t stride_bt, stride_eb, stride_ep, stride_ob, stride_oh;
  float scale;
  int64_t window_left;  // -1: none
  float soft_cap;       // 0: none
};

// The hot loops, compiled for AVX2 with FMA beside the baseline where the compiler can (the loader
// picks the clone the CPU runs): a dot product kept in 16 partial sums (without fast-math the
// compiler may not reorder one sum into vector lanes) and y += w x.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KVATTN_CPU_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define KVATTN_CPU_CLONES
#endif

// out[g] = q[g] . key for the group's ``heads`` query rows q [heads, n].
KVATTN_CPU_CLONES inline void dots(const float* q, int64_t heads, const float* key, int64_t n, float* out) {
  for (int64_t g = 0; g < heads; ++g) {
    const float* a = q + g * n;
    float lanes[16] = {0.f};
    int64_t d = 0;
    for (; d + 16 <= n; d += 16)
      for (int j = 0; j < 16; ++j) lanes[j] += a[d + j] * key[d + j];
    float sum = 0.f;
    for (int j = 0; j < 16; ++j) sum += lanes[j];
    for (; d < n; ++d) sum += a[d] * key[d];
    out[g] = sum;
  }
}

// acc[g] += w[g] value for the group's ``heads`` accumulator rows acc [heads, n].
KVATTN_CPU_CLONES inline void axpys(float* acc, int64_t heads, const float* w, const float* value, int64_t n) {
  for (int64_t g = 0; g < heads; ++g) {
    float* y = acc + g * n;
    const float wg = w[g];
    for (int64_t d = 0; d < n; ++d) y[d] += wg * value[d];
  }
}

KVATTN_CPU_CLONES inline void scale_row(float* y, float w, int64_t n) {
  for (int64_t d = 0; d < n; ++d) y[d] *= w;
}

inline float load(const float* p) { return *p; }
inline float load(const __half* p) { return __half2float(*p); }
inline float load(const __nv_bfloat16* p) {
  // A bfloat16 is the high half of a float32: exact, and cheaper than the harness's conversion.
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float x;
  std::memcpy(&x, &wide, 4);
  return x;
}
inline void store(float* p, float x) { *p = x; }
inline void store(__half* p, float x) { *p = __float2half_rn(x); }
inline void store(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }

// Row ``row`` of ``n`` elements as float32: float32 rows as they are, others converted into
// ``dst``.
inline const float* as_float(const float* row, int64_t, float*) { return row; }
template <class T>
inline const float* as_float(const T* row, int64_t n, float* dst) {
  for (int64_t d = 0; d < n; ++d) dst[d] = load(row + d);
  return dst;
}

// The report of one sequence under the per-call check, and each logical page's readable slots.
inline void check_sequence(const DecodeParams& p, int64_t b, int64_t seq_len, int64_t raw_len,
                           int64_t first_key, int32_t* limit) {
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
inline void verdict_sequence(const DecodeParams& p, int64_t b, int64_t seq_len, int64_t raw_len, int32_t* limit) {
  const int64_t* entries = p.verdict + b * p.max_pages;
  for (int64_t i = 0; i < p.max_pages; ++i) {
    const int64_t page = entries[i] >> 32;
    const int32_t readable = static_cast<int32_t>(entries[i]);
    const int64_t slots_read = min64(max64(seq_len - i * p.page_size, 0), p.page_size);
    limit[i] = page >= 0 && page < p.num_pages ? static_cast<int32_t>(std::min<int64_t>(readable, slots_read)) : 0;
  }
  const int64_t pos = raw_len - 1;
  if (pos < 0 || pos >= p.max_pages * p.page_size) return;
  const int64_t fresh = pos / p.page_size, slot = pos - fresh * p.page_size;
  const int64_t page = entries[fresh] >> 32;
  const int32_t readable = static_cast<int32_t>(entries[fresh]);
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

// One sequence: its report (or none), then, per KV head, the online softmax of its GQA group's
// query heads over the slots each page's limit allows, within the window.
template <class T, Mode M>
void decode_sequence(const DecodeParams& p, int64_t b, std::vector<int32_t>& limit, std::vector<float>& work) {
  const int64_t raw_len = p.seq_lens[b];
  const int64_t capacity = p.max_pages * p.page_size;
  const int64_t seq_len = min64(max64(raw_len, 0), capacity);
  const int64_t first_key = p.window_left >= 0 ? max64(max64(raw_len, 0) - 1 - p.window_left, 0) : 0;
  if (M == Mode::kChecked) {
    check_sequence(p, b, seq_len, raw_len, first_key, limit.data());
  } else if (M == Mode::kVerdict) {
    verdict_sequence(p, b, seq_len, raw_len, limit.data());
  } else {
    const int32_t* bt_row = p.block_table + b * p.stride_bt;
    for (int64_t i = 0; i < p.max_pages; ++i) {
      const int64_t page = bt_row[i];
      limit[i] = page >= 0 && page < p.num_pages
                     ? static_cast<int32_t>(min64(max64(seq_len - i * p.page_size, 0), p.page_size))
                     : 0;
    }
  }
  const int64_t group = p.num_heads / p.num_kv_heads;
  const int64_t D = p.head_dim, Dv = p.head_dim_v, P = p.page_size;
  // work: q [G, D], k row [D], v row [Dv], scores [P, G], acc [G, Dv], m [G], l [G]
  float* q = work.data();
  float* krow = q + group * D;
  float* vrow = krow + D;
  float* scores = vrow + Dv;
  float* acc = scores + P * group;
  float* m = acc + group * Dv;
  float* l = m + group;
  const T* qs = static_cast<const T*>(p.q);
  const T* ks = static_cast<const T*>(p.k);
  const T* vs = static_cast<const T*>(p.v);
  const int32_t* bt_row = p.block_table + b * p.stride_bt;
  const int64_t first_page = first_key / P;
  const int64_t last_page = (seq_len + P - 1) / P;
  for (int64_t h = 0; h < p.num_kv_heads; ++h) {
    for (int64_t g = 0; g < group; ++g) {
      const T* qrow = qs + b * p.stride_qb + (h * group + g) * p.stride_qh;
      for (int64_t d = 0; d < D; ++d) q[g * D + d] = load(qrow + d) * p.scale;
      m[g] = -std::numeric_limits<float>::infinity();
      l[g] = 0.f;
    }
    std::fill(acc, acc + group * Dv, 0.f);
    for (int64_t i = first_page; i < last_page; ++i) {
      const int64_t n = limit[i];
      if (n <= 0) continue;
      const int64_t page = M == Mode::kVerdict ? (p.verdict[b * p.max_pages + i] >> 32) : bt_row[i];
      const int64_t s0 = max64(first_key - i * P, 0);
      if (s0 >= n) continue;
      const T* kpage = ks + page * p.stride_kp + h * p.stride_kh;
      const T* vpage = vs + page * p.stride_vp + h * p.stride_vh;
      for (int64_t s = s0; s < n; ++s) {
        float* row = scores + (s - s0) * group;
        dots(q, group, as_float(kpage + s * p.stride_ks, D, krow), D, row);
        if (p.soft_cap > 0.f)
          for (int64_t g = 0; g < group; ++g) row[g] = p.soft_cap * std::tanh(row[g] / p.soft_cap);
      }
      for (int64_t g = 0; g < group; ++g) {
        float top = m[g];
        for (int64_t s = s0; s < n; ++s) top = std::max(top, scores[(s - s0) * group + g]);
        const float rescale = std::exp(m[g] - top);  // 0 for the first page read (m = -inf)
        l[g] *= rescale;
        scale_row(acc + g * Dv, rescale, Dv);
        m[g] = top;
        for (int64_t s = s0; s < n; ++s) {
          float& x = scores[(s - s0) * group + g];
          x = std::exp(x - top);
          l[g] += x;
        }
      }
      for (int64_t s = s0; s < n; ++s) {
        axpys(acc, group, scores + (s - s0) * group, as_float(vpage + s * p.stride_vs, Dv, vrow), Dv);
      }
    }
    T* outs = static_cast<T*>(p.out);
    for (int64_t g = 0; g < group; ++g) {
      const int64_t head = h * group + g;
      T* orow = outs + b * p.stride_ob + head * p.stride_oh;
      const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
      for (int64_t d = 0; d < Dv; ++d) store(orow + d, acc[g * Dv + d] * inv);
      if (p.lse != nullptr)
        p.lse[b * p.num_heads + head] = l[g] > 0.f ? m[g] + std::log(l[g]) : -std::numeric_limits<float>::infinity();
    }
  }
}

template <class T, Mode M>
void decode(const DecodeParams& p) {
  const int64_t group = p.num_heads / p.num_kv_heads;
  std::vector<int32_t> limit(p.max_pages);
  std::vector<float> work(group * p.head_dim + p.head_dim + p.head_dim_v + p.page_size * group +
                          group * p.head_dim_v + 2 * group);
  for (int64_t b = 0; b < p.batch; ++b) decode_sequence<T, M>(p, b, limit, work);
}

}  // namespace cpu
}  // namespace kvattn
