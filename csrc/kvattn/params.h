// Kernel parameters and launcher interface: plain C++, no CUDA and no torch, so the binding
// (csrc/module.cpp) builds with the host compiler alone. Layout of every tensor: kvattn/layout.py.
#pragma once

#include <cstdint>

#include "fp8.h"

namespace kvattn {

// The attention kernels' element types, and the writer's tokens' (fp8 tokens: stored as they are
// into pools of their format).
enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kE4M3 = 3, kE5M2 = 4 };

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
// ones compile them out): sliding window, logit soft-cap, ALiBi slopes, attention sinks, and the
// extend's custom mask and right window edge.
struct ScoreVariant {
  int window_left;      // keys from position q_pos - window_left on; -1: no window
  int window_right;     // extend only: keys up to position q_pos + window_right; -1: no edge
  float soft_cap;       // cap * tanh(x / cap) of the natural logit x; 0: off
  const float* alibi;   // [num_heads] slopes, or per sequence b from alibi + b * alibi_stride; or null
  int64_t alibi_stride; // 0: one set of slopes for every sequence
  const float* sinks;   // [num_heads] sink logits (natural), or null
  // Extend only: [mask_numel] bool, per sequence b a row-major [q_len_b, max(seq_len_b, 0)] block
  // from mask_start[b] on; entries past mask_numel read as false. Null: no custom mask.
  const uint8_t* custom_mask;
  const int64_t* mask_start;  // [B]
  int64_t mask_numel;
};

// The kernel arguments the Python launchers pass (kvattn/backends/cuda/launch.py), written once:
// each list declares the fields of its struct below and is what the binding (csrc/module.cpp)
// reads by name, refusing a missing or an unknown name. X(kind, type, name): kind says how the
// binding reads the value (PTR an address, I64 an int64, I32 an int, F32 a float). A new argument
// is one line here and its value in the launcher.
#define KVATTN_ATTENTION_ARGS(X)                                                                   \
  X(PTR, const void*, q)             /* decode [B, H, D], extend [total_q, H, D] */                \
  X(PTR, const void*, k)             /* [num_pages, page_size, Hkv, D], any strides, last dim contiguous */ \
  X(PTR, const void*, v)                                                                           \
  X(PTR, const int32_t*, block_table) /* [B, max_pages] */                                         \
  X(PTR, const int32_t*, seq_lens)   /* [B] (extend: the new tokens included) */                   \
  X(PTR, const int64_t*, page_tags)  /* [num_pages] */                                             \
  X(PTR, const int64_t*, expected)   /* [B, max_pages], stride 0 in dim 1 when given per sequence */ \
  X(PTR, void*, out)                 /* as q */                                                    \
  X(PTR, float*, lse)                /* [rows, H] contiguous, or null */                          \
  X(PTR, int32_t*, violations)       /* report, [B] each; null when unchecked */                  \
  X(PTR, int32_t*, reasons)                                                                        \
  X(PTR, int32_t*, pages_checked)                                                                  \
  X(PTR, int32_t*, beyond_table)                                                                   \
  X(PTR, int8_t*, page_reasons)      /* [B, max_pages] contiguous */                              \
  /* fp8 pools (kv_type kE4M3/kE5M2): a key element is k[...] * k_scale[kv_head], likewise V; */   \
  /* [num_kv_heads] float32 each (sequence b's from k_scale + b * scale_stride), null with kSame */ \
  /* (pools of the query's type). scale_stride 0: one set for every sequence. */                  \
  X(PTR, const float*, k_scale)                                                                    \
  X(PTR, const float*, v_scale)                                                                    \
  X(I64, int64_t, scale_stride)                                                                    \
  /* fp8 queries (q_dtype 1 float8_e4m3fn, 2 float8_e5m2; 0: q of the output's type T) over fp8 */ \
  /* pools: a query element is q[...] * q_scale[kv_head] ([num_kv_heads] float32, per sequence */   \
  /* by scale_stride as k_scale), the codes converted to T exactly as they are staged */           \
  X(I32, int, q_dtype)                                                                             \
  X(PTR, const float*, q_scale)                                                                    \
  X(I64, int64_t, stride_qh)                                                                       \
  X(I64, int64_t, stride_kp) X(I64, int64_t, stride_ks) X(I64, int64_t, stride_kh)               \
  X(I64, int64_t, stride_vp) X(I64, int64_t, stride_vs) X(I64, int64_t, stride_vh)               \
  X(I64, int64_t, stride_bt_b) X(I64, int64_t, stride_bt_p) X(I64, int64_t, stride_sl)           \
  X(I64, int64_t, stride_eb) X(I64, int64_t, stride_ep) X(I64, int64_t, stride_oh)               \
  X(I64, int64_t, num_pages)                                                                       \
  X(F32, float, scale_log2)          /* scale * log2(e): the kernels work in base 2 */             \
  X(I32, int, batch) X(I32, int, num_heads) X(I32, int, num_kv_heads) X(I32, int, head_dim)       \
  X(I32, int, head_dim_v)            /* V's (and the output's) head dim, at most head_dim */       \
  X(I32, int, max_pages)

// Decode's own: split-KV, num_splits programs per (sequence, KV head); each takes an equal share of
// its sequence's actual length rounded up to `align` (a multiple of the page size and of 16), at
// least `min_chunk` (kvattn.backends.grids.split_chunk).
#define KVATTN_DECODE_ARGS(X)                                                                      \
  X(PTR, float*, part_acc)           /* [B, H, num_splits, head_dim_v] when num_splits > 1 */              \
  X(PTR, float*, part_ml)            /* [B, H, num_splits, 2] (running max in log2 units, sum) */  \
  X(PTR, int32_t*, part_report)      /* [B, num_splits, 3] when checked and num_splits > 1 */     \
  /* A decode step's verdict (kvattn.resolve_pages, docs/ownership.md section 9), read instead of */ \
  /* the table and the tags: [B, max_pages] entries (page << 32 | readable) and [B] the new */     \
  /* token's page's entry; null: the call checks its pages itself */                             \
  X(PTR, const int64_t*, verdict) X(PTR, const int64_t*, verdict_fresh)                          \
  X(I64, int64_t, stride_qb) X(I64, int64_t, stride_ob)                                           \
  X(I32, int, num_splits) X(I32, int, align) X(I32, int, min_chunk)

#define KVATTN_EXTEND_ARGS(X)                                                                      \
  X(PTR, const int32_t*, q_start)    /* [B + 1] query row offsets, clamped and non-decreasing */   \
  X(PTR, const int32_t*, tile_start) /* [B] first grid slot of each sequence's query tiles */      \
  /* [B, max_pages] (page << 32 | readable slots), written by the checked launch's pre-pass; */    \
  /* null when unchecked */                                                                        \
  X(PTR, int64_t*, effective)                                                                      \
  X(I64, int64_t, stride_qt) X(I64, int64_t, stride_ot)                                           \
  X(I32, int, causal)                                                                              \
  X(I32, int, num_slots)             /* grid x: ceil(total_q / tokens_per_tile) + B, from shapes */ \
  X(I32, int, heads_per_tile)        /* query heads of one GQA chunk in a tile */                  \
  X(I32, int, tokens_per_tile)       /* query tokens per tile (the launcher's tile map agrees) */

#define KVATTN_WRITE_KV_ARGS(X)                                                                    \
  X(PTR, const void*, k)             /* [T, Hkv, D], any strides */                               \
  X(PTR, const void*, v)                                                                           \
  X(PTR, void*, k_cache)             /* pools as for the readers */                               \
  X(PTR, void*, v_cache)                                                                           \
  X(PTR, const void*, slot_mapping)  /* [T] int32 or int64: page * page_size + slot; < 0 padding */ \
  X(PTR, const int64_t*, owners)     /* [T] (stride 0 for one owner) */                           \
  X(PTR, int64_t*, page_tags)        /* [num_pages] */                                             \
  X(PTR, uint8_t*, landed)           /* [T] bool */                                                \
  X(PTR, int8_t*, drop_reasons)      /* [T] kvattn.WriteDrop flags */                             \
  X(PTR, unsigned long long*, dropped) /* 0-d, zeroed by the caller */                            \
  X(I64, int64_t, stride_kt) X(I64, int64_t, stride_kh) X(I64, int64_t, stride_kd)               \
  X(I64, int64_t, stride_vt) X(I64, int64_t, stride_vh) X(I64, int64_t, stride_vd)               \
  X(I64, int64_t, stride_kp) X(I64, int64_t, stride_ks) X(I64, int64_t, stride_kch)              \
  X(I64, int64_t, stride_vp) X(I64, int64_t, stride_vs) X(I64, int64_t, stride_vch)              \
  X(I64, int64_t, stride_slot) X(I64, int64_t, stride_owner)                                      \
  X(I64, int64_t, num_tokens) X(I64, int64_t, num_pages)                                          \
  X(I32, int, slot_is_int64) X(I32, int, page_size) X(I32, int, num_kv_heads) X(I32, int, head_dim) \
  X(I32, int, head_dim_v)  /* V's head dim (the pools' dim 3 may differ) */                      \
  /* pools of an fp8 format (1 float8_e4m3fn, 2 float8_e5m2; 0: the tokens' type). From wider */  \
  /* tokens the writer stores the code of x / scale of the element's KV head, [num_kv_heads] */    \
  /* float32 each (null when the tokens are stored as they are), rounded to nearest even or, */     \
  /* toward_zero 1, toward zero (kvattn.write_kv's two rules) */                                  \
  X(I32, int, kv_dtype)                                                                            \
  X(PTR, const float*, k_scale) X(PTR, const float*, v_scale) X(I32, int, toward_zero)

#define KVATTN_DECLARE_ARG(kind, type, name) type name;

// What decode and extend share. The binding also reads `page_size` (into `page`), `kv_dtype` (into
// `kv_type`: 0 the query's dtype, 1 float8_e4m3fn, 2 float8_e5m2) and the score switches
// `window_left`, `window_right`, `soft_cap`, `alibi`, `alibi_stride`, `sinks` (into `var`).
struct AttentionParams {
  KVATTN_ATTENTION_ARGS(KVATTN_DECLARE_ARG)
  ScoreVariant var;
  KVType kv_type;
  PageDiv page;  // page_size, for token -> (logical page, slot)

  // Filled by the launcher (plan_decode, plan_extend), not by the caller.
  int group;       // query heads per KV head
  int num_chunks;  // blocks per KV head: the group in chunks of kWarpRows heads
  int d_split;     // blocks sharing one (KV head, chunk): each accumulates 1/d_split of the head dim
  int vec;         // 1: K/V rows copied by 16-byte cp.async (aligned); 0: element by element
  int fp8_wide;    // extend over fp8 pools (element by element): 1 when 8 codes are one aligned load
  int smem_bytes;  // dynamic shared memory of the kernel
};

struct DecodeParams : AttentionParams {
  KVATTN_DECODE_ARGS(KVATTN_DECLARE_ARG)
};

// The extend reads fp8 pools with its element-wise kernels, converting the codes on the copy. The
// binding reads the custom mask's fields of `var` (`custom_mask`, `mask_start`, `mask_numel`) for
// the extend only.
struct ExtendParams : AttentionParams {
  KVATTN_EXTEND_ARGS(KVATTN_DECLARE_ARG)
};

// Whether a launch needs the VARIANT instantiation (any score switch on).
inline bool has_variant(const ScoreVariant& v) {
  return v.window_left >= 0 || v.window_right >= 0 || v.soft_cap > 0.0f || v.alibi != nullptr ||
         v.sinks != nullptr || v.custom_mask != nullptr;
}

struct LaunchResult {
  int code;            // 0 on success (cudaError_t value otherwise)
  const char* kernel;  // the kernel that failed, or the launcher that refused the arguments
  const char* message;
};

struct WriteKVParams {
  KVATTN_WRITE_KV_ARGS(KVATTN_DECLARE_ARG)
};

// Enqueues the decode (and the split merge) on `stream`; never synchronises, never exits.
LaunchResult paged_decode(DecodeParams& params, DType dtype, bool check, void* stream);

// Enqueues the extend (kvattn.paged_extend semantics); never synchronises, never exits.
LaunchResult paged_extend(ExtendParams& params, DType dtype, bool check, void* stream);

// Enqueues the stamping writer (kvattn.writers.write_kv semantics): verdicts for every token first,
// then the K/V copies of the landed tokens, each followed by its page's stamp.
LaunchResult write_kv(const WriteKVParams& params, DType dtype, void* stream);

}  // namespace kvattn
