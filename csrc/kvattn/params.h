// Kernel parameters and launcher interface: plain C++, no CUDA and no torch, so the binding
// (csrc/module.cpp) builds with the host compiler alone. Layout of every tensor: kvattn/layout.py.
#pragma once

#include <cstdint>

#include "fp8.h"

namespace kvattn {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// n / d and n % d for 0 <= n < 2**31 and a divisor d in [1, 2**16) fixed for a launch, by a
// multiply and a shift: m = ceil(2**(31 + s) / d) with s = ceil(log2 d) gives floor(n * m /
// 2**(31 + s)) = floor(n / d) exactly (the error n * (m - 2**(31+s)/d) / 2**(31+s) stays below
// 2**-s <= 1/d). For a power of two it is the shift. Filled on the host (make_page_div).
struct PageDiv {
  int size;       // the divisor: tokens per page
  uint32_t mul;   // m
  int shift;      // 31 + s
};

inline PageDiv make_page_div(int size) {
  int s = 0;
  while ((1 << s) < size) ++s;
  const uint64_t m = ((uint64_t{1} << (31 + s)) + static_cast<uint64_t>(size) - 1) / static_cast<uint64_t>(size);
  return {size, static_cast<uint32_t>(m), 31 + s};
}

#if defined(__CUDACC__)
#define KVATTN_PARAMS_FN __host__ __device__ inline
#else
#define KVATTN_PARAMS_FN inline
#endif

// The logical page of token n (0 <= n < 2**31).
KVATTN_PARAMS_FN int64_t page_of(const PageDiv& d, int64_t n) {
  return static_cast<int64_t>((static_cast<uint64_t>(n) * d.mul) >> d.shift);
}

// The score switches of kvattn.variants (the kernels' VARIANT instantiations read them; the plain
// ones compile them out): sliding window, logit soft-cap, ALiBi slopes, attention sinks.
struct ScoreVariant {
  int window_left;      // keys from position q_pos - window_left on; -1: no window
  float soft_cap;       // cap * tanh(x / cap) of the natural logit x; 0: off
  const float* alibi;   // [num_heads] slopes, or null
  const float* sinks;   // [num_heads] sink logits (natural), or null
};

struct DecodeParams {
  const void* q;            // [B, H, D]
  const void* k;            // [num_pages, page_size, Hkv, D], any strides, last dim contiguous
  const void* v;
  const int32_t* block_table;  // [B, max_pages]
  const int32_t* seq_lens;     // [B]
  const int64_t* page_tags;    // [num_pages]
  const int64_t* expected;     // [B, max_pages], stride 0 in dim 1 when given per sequence
  void* out;                   // [B, H, D]
  float* lse;                  // [B, H] contiguous, or null
  float* part_acc;             // [B, H, num_splits, D] when num_splits > 1
  float* part_ml;              // [B, H, num_splits, 2] (running max in log2 units, sum)
  int32_t* part_report;        // [B, num_splits, 3] when checked and num_splits > 1
  int32_t* violations;         // report, [B] each; null when unchecked
  int32_t* reasons;
  int32_t* pages_checked;
  int32_t* beyond_table;
  int8_t* page_reasons;        // [B, max_pages] contiguous

  int64_t stride_qb, stride_qh;
  int64_t stride_kp, stride_ks, stride_kh;
  int64_t stride_vp, stride_vs, stride_vh;
  int64_t stride_bt_b, stride_bt_p, stride_sl, stride_eb, stride_ep;
  int64_t stride_ob, stride_oh;
  int64_t num_pages;

  float scale_log2;  // scale * log2(e): the kernels work in base 2
  ScoreVariant var;
  // fp8 pools (kv_type kE4M3/kE5M2): a key element is k[...] * k_scale[kv_head], likewise V;
  // [num_kv_heads] float32 each, null with kSame (pools of the query's type).
  KVType kv_type;
  const float* k_scale;
  const float* v_scale;
  int batch, num_heads, num_kv_heads, head_dim;
  PageDiv page;  // page_size, for token -> (logical page, slot)
  int max_pages;
  // Split-KV: num_splits programs per (sequence, KV head); each takes an equal share of its
  // sequence's actual length rounded up to `align` (a multiple of the page size and of 16), at
  // least `min_chunk` (kvattn.backends.grids.split_chunk).
  int num_splits, align, min_chunk;

  // Filled by the launcher (plan_decode), not by the caller.
  int group;       // query heads per KV head
  int num_chunks;  // blocks per KV head: the group in chunks of kWarpRows heads
  int d_split;     // blocks sharing one (KV head, chunk): each accumulates 1/d_split of the head dim
  int vec;         // 1: K/V rows copied by 16-byte cp.async (aligned); 0: element by element
  int smem_bytes;  // dynamic shared memory of the decode kernel
};

struct ExtendParams {
  const void* q;               // [total_q, H, D]
  const void* k;               // pools as in DecodeParams
  const void* v;
  const int32_t* q_start;      // [B + 1] query row offsets, clamped and non-decreasing
  const int32_t* tile_start;   // [B] first grid slot of each sequence's query tiles (tile_start[0] = 0)
  const int32_t* block_table;  // [B, max_pages]
  const int32_t* seq_lens;     // [B], the new tokens included
  const int64_t* page_tags;    // [num_pages]
  const int64_t* expected;     // [B, max_pages], stride 0 in dim 1 when given per sequence
  int64_t* effective;          // [B, max_pages] (page << 32 | readable slots), written by the
                               // checked launch's pre-pass; null when unchecked
  void* out;                   // [total_q, H, D]
  float* lse;                  // [total_q, H] contiguous, or null
  int32_t* violations;         // report, [B] each; null when unchecked
  int32_t* reasons;
  int32_t* pages_checked;
  int32_t* beyond_table;
  int8_t* page_reasons;        // [B, max_pages] contiguous

  int64_t stride_qt, stride_qh;
  int64_t stride_kp, stride_ks, stride_kh;
  int64_t stride_vp, stride_vs, stride_vh;
  int64_t stride_bt_b, stride_bt_p, stride_sl, stride_eb, stride_ep;
  int64_t stride_ot, stride_oh;
  int64_t num_pages;

  float scale_log2;  // scale * log2(e)
  ScoreVariant var;
  KVType kv_type;  // as in DecodeParams; the extend runs kSame only (fp8 pools are refused)
  const float* k_scale;
  const float* v_scale;
  int batch, num_heads, num_kv_heads, head_dim;
  PageDiv page;
  int max_pages;
  int causal;
  int num_slots;        // grid x: ceil(total_q / tokens_per_tile) + B, from shapes only
  int heads_per_tile;   // query heads of one GQA chunk in a tile (row r: token r / heads, head r % heads)
  int tokens_per_tile;  // query tokens per tile (the launcher's tile map uses the same value)

  // Filled by the launcher (plan_extend), not by the caller.
  int group;
  int num_chunks;
  int d_split;
  int vec;
  int smem_bytes;
};

// Whether a launch needs the VARIANT instantiation (any score switch on).
inline bool has_variant(const ScoreVariant& v) {
  return v.window_left >= 0 || v.soft_cap > 0.0f || v.alibi != nullptr || v.sinks != nullptr;
}

struct LaunchResult {
  int code;            // 0 on success (cudaError_t value otherwise)
  const char* kernel;  // the kernel that failed, or the launcher that refused the arguments
  const char* message;
};

struct WriteKVParams {
  const void* k;               // [T, Hkv, D], any strides
  const void* v;
  void* k_cache;               // pools as in DecodeParams
  void* v_cache;
  const void* slot_mapping;    // [T] int32 or int64: page * page_size + slot; negative = padding
  const int64_t* owners;       // [T] (stride 0 for one owner)
  int64_t* page_tags;          // [num_pages]
  uint8_t* landed;             // [T] bool
  int8_t* drop_reasons;        // [T] kvattn.WriteDrop flags
  unsigned long long* dropped; // 0-d, zeroed by the caller

  int64_t stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd;
  int64_t stride_kp, stride_ks, stride_kch, stride_vp, stride_vs, stride_vch;
  int64_t stride_slot, stride_owner;
  int64_t num_tokens, num_pages;
  int slot_is_int64;
  int page_size, num_kv_heads, head_dim;
};

// Enqueues the decode (and the split merge) on `stream`; never synchronises, never exits.
LaunchResult paged_decode(DecodeParams& params, DType dtype, bool check, void* stream);

// Enqueues the extend (kvattn.paged_extend semantics); never synchronises, never exits.
LaunchResult paged_extend(ExtendParams& params, DType dtype, bool check, void* stream);

// Enqueues the stamping writer (kvattn.writers.write_kv semantics): verdicts for every token first,
// then the K/V copies of the landed tokens, each followed by its page's stamp.
LaunchResult write_kv(const WriteKVParams& params, DType dtype, void* stream);

}  // namespace kvattn
