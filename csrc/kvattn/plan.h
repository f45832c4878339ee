// What the launchers decide on the host before a kernel is picked (dispatch.cuh): the argument
// limits, the head chunking, the copy width and the dynamic shared memory of a decode or extend
// launch. Plain C++ (no kernel), so the dispatch compiles without the kernels' sources.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "fp8.h"
#include "params.h"
#include "tiles.h"

namespace kvattn {

// True when K/V rows can be copied in pieces of `bytes` bytes: pools aligned to them, strides and
// head_dim in multiples of the `chunk` elements of such a piece (16 bytes: 8 16-bit, 16 fp8).
inline bool kv_rows_aligned(const void* k, const void* v, const int64_t (&strides)[6], int head_dim, int chunk = 8,
                            int bytes = 16) {
  const auto aligned = [bytes](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; };
  bool vec = aligned(k) && aligned(v) && head_dim % chunk == 0;
  for (int64_t s : strides) vec = vec && s % chunk == 0;
  return vec;
}

template <class KV>
constexpr bool kFp8Type = std::is_same<KV, Fp8E4M3>::value || std::is_same<KV, Fp8E5M2>::value;

// fp8 queries are read over fp8 pools only (the kernels that convert codes), with their scales.
inline const char* plan_query(const AttentionParams& p, bool fp8_pools) {
  if (p.q_dtype < 0 || p.q_dtype > 2) return "q_dtype must be 0, 1 (float8_e4m3fn) or 2 (float8_e5m2)";
  if (p.q_dtype != 0 && (!fp8_pools || p.q_scale == nullptr)) return "fp8 queries need fp8 pools and q_scale";
  return nullptr;
}

// Fills the launcher's fields of `p`; returns an error message for arguments the kernels cannot run.
template <class T, class KV>
const char* plan_decode(DecodeParams& p) {
  const bool latent = p.head_dim == kLatentDim;
  if (p.head_dim < 1 || (p.head_dim > kMaxHeadDim && !latent))
    return "head_dim must be in [1, " KVATTN_STR(KVATTN_MAX_HEAD_DIM_TILE) "], or " KVATTN_STR(KVATTN_LATENT_DIM) " (an MLA latent row)";
  // V's rows are staged in tiles sized by K's head dim.
  if (p.head_dim_v < 1 || p.head_dim_v > p.head_dim) return "head_dim_v must be in [1, head_dim]";
  if (p.num_kv_heads < 1 || p.num_heads < 1 || p.num_heads % p.num_kv_heads)
    return "num_heads must be a positive multiple of num_kv_heads";
  if (p.page.size < 1 || p.page.size > 1024) return "page_size must be in [1, 1024]";
  if (p.max_pages < 1 || p.batch < 1) return "empty block table or batch";
  if (static_cast<int64_t>(p.max_pages) * p.page.size >= (int64_t{1} << 31)) return "table capacity must stay below 2**31 tokens";
  if (p.align < 1 || p.align % p.page.size || p.min_chunk < p.align || p.min_chunk % p.align)
    return "align must be a multiple of page_size, min_chunk a multiple of align";
  if (p.num_splits < 1 || p.num_splits > 65535) return "num_splits must be in [1, 65535]";
  if (p.num_splits > 1 && (p.part_acc == nullptr || p.part_ml == nullptr)) return "split buffers missing";
  p.group = p.num_heads / p.num_kv_heads;
  p.num_chunks = (p.group + kWarpRows - 1) / kWarpRows;
  const int d = padded_head_dim(p.head_dim);
  p.d_split = d > 256 && !latent ? 2 : 1;  // tiles.h HeadSplit
  // And one column more for the per-call check's report (decode.cuh).
  if (static_cast<int64_t>(p.num_kv_heads) * p.num_chunks * p.d_split + 1 > 65535) return "too many KV heads";
  const int64_t strides[6] = {p.stride_kp, p.stride_ks, p.stride_kh, p.stride_vp, p.stride_vs, p.stride_vh};
  constexpr int kb = sizeof(KV);
  p.vec = kv_rows_aligned(p.k, p.v, strides, p.head_dim, 16 / kb) && p.head_dim_v % (16 / kb) == 0;
  // The latent tile reads each row once, as the key and (its first 512 dims) as the value.
  if (latent && (p.v != p.k || p.stride_vp != p.stride_kp || p.stride_vs != p.stride_ks || p.head_dim_v != kLatentRank ||
                 p.num_kv_heads != 1 || kFp8Type<KV> || !p.vec))
    return "head_dim " KVATTN_STR(KVATTN_LATENT_DIM) " is the MLA latent tile: one KV head of 16-bit, 16-byte aligned rows, V their first 512 dims";
  if (kFp8Type<KV>) {
    // The fp8 instantiations copy by cp.async only (kvattn/backends/cuda/launch.py refuses others
    // first, so they go to the Triton backend).
    if (!p.vec) return "fp8 pools need 16-byte aligned rows: head_dim and K/V strides multiples of 16 elements";
    if (p.k_scale == nullptr || p.v_scale == nullptr) return "fp8 pools need k_scale and v_scale";
  }
  if (const char* why = plan_query(p, kFp8Type<KV>)) return why;
#define KVATTN_DECODE_SMEM(D, FIRST) d == D ? DecodeLayout<D, kb>::kTotal:
  p.smem_bytes = KVATTN_HEAD_DIM_TILES(KVATTN_DECODE_SMEM) DecodeLayout<kLatentDim>::kTotal;
#undef KVATTN_DECODE_SMEM
  return nullptr;
}

// Fills the launcher's fields of `p`; returns an error message for arguments the kernel cannot run.
template <class T>
const char* plan_extend(ExtendParams& p) {
  if (p.head_dim < 1 || p.head_dim > kMaxHeadDim) return "head_dim must be in [1, " KVATTN_STR(KVATTN_MAX_HEAD_DIM_TILE) "]";
  // V's rows are staged in tiles sized by K's head dim.
  if (p.head_dim_v < 1 || p.head_dim_v > p.head_dim) return "head_dim_v must be in [1, head_dim]";
  if (p.num_kv_heads < 1 || p.num_heads < 1 || p.num_heads % p.num_kv_heads)
    return "num_heads must be a positive multiple of num_kv_heads";
  if (p.page.size < 1 || p.page.size > 1024) return "page_size must be in [1, 1024]";
  if (p.max_pages < 1 || p.batch < 1) return "empty block table or batch";
  if (static_cast<int64_t>(p.max_pages) * p.page.size >= (int64_t{1} << 31)) return "table capacity must stay below 2**31 tokens";
  p.group = p.num_heads / p.num_kv_heads;
  if (p.heads_per_tile < 1 || p.heads_per_tile > std::min(p.group, kExtendRows) || p.tokens_per_tile < 1 ||
      p.tokens_per_tile * p.heads_per_tile > kExtendRows)
    return "tokens_per_tile * heads_per_tile must be at most 64, heads_per_tile at most the GQA group";
  if (p.num_slots < p.batch) return "num_slots must give every sequence a tile";
  p.num_chunks = (p.group + p.heads_per_tile - 1) / p.heads_per_tile;
  const int d = padded_head_dim(p.head_dim);
  p.d_split = d > 256 ? 2 : 1;
  if (static_cast<int64_t>(p.num_kv_heads) * p.num_chunks * p.d_split > 65535) return "too many KV heads";
  const int64_t strides[6] = {p.stride_kp, p.stride_ks, p.stride_kh, p.stride_vp, p.stride_vs, p.stride_vh};
  if (p.kv_type == KVType::kSame) {
    p.vec = kv_rows_aligned(p.k, p.v, strides, p.head_dim) && p.head_dim_v % 8 == 0;
  } else {
    // fp8 pools: the element-wise kernels convert the codes as they copy them into the 16-bit tiles
    // (8 codes a load when the rows allow it), so the rows need no alignment.
    if (p.k_scale == nullptr || p.v_scale == nullptr) return "fp8 pools need k_scale and v_scale";
    p.vec = 0;
    p.fp8_wide = kv_rows_aligned(p.k, p.v, strides, p.head_dim, 8, 8) && p.head_dim_v % 8 == 0;
  }
  if (const char* why = plan_query(p, p.kv_type != KVType::kSame)) return why;
#define KVATTN_EXTEND_SMEM(D, FIRST) d == D ? ExtendLayout<D>::kTotal:
  p.smem_bytes = KVATTN_HEAD_DIM_TILES(KVATTN_EXTEND_SMEM) 0;  // (d is a tile: head_dim <= kMaxHeadDim)
#undef KVATTN_EXTEND_SMEM
  // A block's tokens (at most kExtendRows = 64) index the bits of the custom mask's key rows.
  if (p.var.custom_mask != nullptr)
    p.smem_bytes += d <= 128 ? ExtendLayout<128>::kRowBitsBytes : ExtendLayout<512>::kRowBitsBytes;
  return nullptr;
}

}  // namespace kvattn
