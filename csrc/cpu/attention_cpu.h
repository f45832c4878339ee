// Paged attention on the CPU, checked and unchecked from one source: the decode (one query row per
// sequence) and the extend (a ragged batch of new rows per sequence, causal or not), for CPU tensors
// where no GPU kernel runs (vLLM's and SGLang's CPU engines). The reader's rule is tag_rule.cuh's
// (the one C++ statement of docs/ownership.md section 3); a decode verdict (section 9) is read as
// the Triton kernel reads it. Float32 arithmetic over float32, float16 or bfloat16 pools; a sliding
// window (left, and right for the extend's rows) and the logit soft-cap; the other switches of
// kvattn.variants are refused by the backend (kvattn/backends/cpu). A refused slot is never loaded:
// only the slots a page's limit allows are read, so NaN in them cannot reach a sum.
//
// Work is cut as the GPU kernels cut it: one item per (sequence, KV head, tile of query positions),
// whose rows are the tile's positions times the GQA group's heads. An item streams the pages its
// rows can read, one page at a time: the scores of its rows (in vector lanes) against the page's
// keys, the online softmax of each row within its own causal and window bounds, then the values.
// Items are independent; a call spreads them over up to ``threads`` threads of OpenMP.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "kvattn/tag_rule.cuh"

namespace kvattn {
namespace cpu {

enum class Mode { kUnchecked, kChecked, kVerdict };

struct AttendParams {
  const void* q;  // [rows, num_heads, head_dim]
  const void* k;
  const void* v;
  const int32_t* cu_seqlens_q;  // [batch + 1]; null: a decode, sequence b's one row is row b
  const int32_t* block_table;
  const int32_t* seq_lens;
  const int64_t* tags;
  const int64_t* expected;
  const int64_t* verdict;  // [B, max_pages] page << 32 | readable (kVerdict, decode only)
  void* out;
  float* lse;  // [rows, num_heads]; null: not asked
  int32_t* violations;
  int32_t* reasons;
  int32_t* checked;
  int32_t* beyond;
  int8_t* page_reasons;  // [B, max_pages]
  int64_t batch, total_q, num_heads, num_kv_heads, head_dim, head_dim_v, page_size, max_pages, num_pages;
  int64_t stride_qt, stride_qh;
  int64_t stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh;
  int64_t stride_bt, stride_eb, stride_ep, stride_ot, stride_oh;
  float scale;
  bool causal;
  int64_t window_left;   // -1: none
  int64_t window_right;  // -1: none (rows read keys up to pos + window_right)
  float soft_cap;        // 0: none
  int64_t threads;
};

// Scores are computed with the item's rows in vector lanes (16 at a time) and 4 keys per block:
// each key element is broadcast against the rows' query elements, so a page's keys are read as
// they lie, with no transposition, and the softmax runs over whole lanes of rows. An item of few
// rows (a decode's GQA group of 1-8 heads) would leave most lanes idle that way: its scores put
// the head dim in the lanes, then its softmax the keys (softmax_few). Values come 16 dims at a
// time, 4 rows per block.
constexpr int64_t kLanes = 16;
constexpr int64_t kKeys = 4;
constexpr int64_t kRows = 4;
// An item of at most this many rows takes softmax_few: below it, rows in the lanes cost more in
// idle lanes than the folds of the sums.
constexpr int64_t kFewRows = 8;
// Query rows of one item: positions x heads of the group, at most this many (a decode's item is
// its group's heads).
constexpr int64_t kTileRows = 32;
// A call spreads its items over threads only above this much work (query rows x keys x heads x
// (D + Dv) multiply-adds, estimated per sequence): below it, starting a thread costs more than it
// saves.
constexpr double kThreadWork = 2e5;

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

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

// 16 floats (and 16 int32) as one value of GCC's vector extension: one AVX-512 register, two AVX2
// ones or four SSE ones, whichever set the body is compiled for; the blocked products hold their
// partial sums in these, so they stay in registers. Loads and stores go through memcpy (no
// alignment assumed).
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t IntLanes __attribute__((vector_size(kLanes * sizeof(int32_t))));

#define KVATTN_CPU_INLINE inline __attribute__((always_inline))

// digest_cpu.h's NH: arithmetic only, which target_clones compiles for each set as written.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KVATTN_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define KVATTN_CPU_CLONES
#endif

}  // namespace cpu
}  // namespace kvattn

// The kernel body (attention_cpu_isa.h) for AVX-512 and for AVX2 with FMA beside the baseline,
// where the compiler can; attend picks the one the CPU runs.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KVATTN_CPU_SETS 1
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v4")
#define KVATTN_CPU_ISA avx512
#include "cpu/attention_cpu_isa.h"
#undef KVATTN_CPU_ISA
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v3")
#define KVATTN_CPU_ISA avx2
#include "cpu/attention_cpu_isa.h"
#undef KVATTN_CPU_ISA
#pragma GCC pop_options
#endif
#define KVATTN_CPU_ISA baseline
#include "cpu/attention_cpu_isa.h"
#undef KVATTN_CPU_ISA

namespace kvattn {
namespace cpu {

// The instruction sets, widest first; ``cap`` bounds the choice (kvattn.backends.cpu's
// KVATTN_CPU_MAX_ISA, and the tests that run each set's code on a CPU that has them all).
enum class Isa { kAvx512 = 0, kAvx2 = 1, kBaseline = 2 };

inline Isa widest_isa(Isa cap) {
#ifdef KVATTN_CPU_SETS
  if (cap <= Isa::kAvx512 && __builtin_cpu_supports("x86-64-v4")) return Isa::kAvx512;
  if (cap <= Isa::kAvx2 && __builtin_cpu_supports("x86-64-v3")) return Isa::kAvx2;
#endif
  return Isa::kBaseline;
}

// The whole call (decode or extend), in the widest instruction set the CPU runs under ``cap``.
template <class T, Mode M>
void attend(const AttendParams& p, Isa cap) {
  switch (widest_isa(cap)) {
#ifdef KVATTN_CPU_SETS
    case Isa::kAvx512:
      return avx512::attend<T, M>(p);
    case Isa::kAvx2:
      return avx2::attend<T, M>(p);
#endif
    default:
      return baseline::attend<T, M>(p);
  }
}

// The readers' exp, for its accuracy test (the same source in every set).
inline float exp_nonpositive(float x) { return baseline::exp_nonpositive(x); }
}  // namespace cpu
}  // namespace kvattn
