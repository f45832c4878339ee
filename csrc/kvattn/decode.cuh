// Paged decode with the ownership check (ownership.md section 3) as a template parameter, split-KV,
// and the merge of the splits. One source for nvcc and for the CPU harness (csrc/sim/simt.h).
//
// Grid (B, num_kv_heads * num_chunks, num_splits), kDecodeThreads threads. A block serves the query
// heads of one KV head's GQA group (in chunks of at most heads_per_chunk heads, so that each
// thread's share of the [heads, D] accumulator fits in registers) over the page-aligned token range
// of one split, so it reads each KV page of the range once for the whole group. Per tile of tile_n
// tokens:
//   1. resolve each token's page from the block table and, when CHECK, its tag and expected owner;
//      a refused token is never loaded;
//   2. load the tile's K and V rows into shared memory (16-byte loads when the layout allows;
//      refused tokens get zeros);
//   3. logits of every (head, token) pair;
//   4. online softmax, one warp per head, in base 2;
//   5. accumulate P @ V into registers.
// The report is written by the chunk-0 block of KV head 0 of each split, over that split's pages.
#pragma once

#include "compat.cuh"
#include "kvattn_tags.h"
#include "params.h"

#include <algorithm>

#ifndef KVATTN_SIM_BREAK
#define KVATTN_SIM_BREAK 0  // test-only defects, see tests/test_cuda.py; never set in a real build
#endif

namespace kvattn {

constexpr int kDecodeThreads = 128;
constexpr int kWarps = kDecodeThreads / 32;
constexpr int kMaxOutPerThread = 16;  // heads_per_chunk * head_dim <= kDecodeThreads * this
constexpr int kMaxHeadDim = 256;
constexpr int kTileBytes = 16384;  // K (and V) bytes of one tile in shared memory, before padding
constexpr int kMergeThreads = 128;
constexpr float kLn2 = 0.6931471805599453f;

// One 4-byte bank of padding per K/V row: threads reading one column of consecutive rows then hit
// different banks (the row length in words, head_dim * sizeof(T) / 4 + 1, is odd).
template <class T>
KVATTN_HOST_DEVICE size_t kv_row_bytes(int head_dim) {
  return static_cast<size_t>(head_dim) * sizeof(T) + 4;
}

KVATTN_HOST_DEVICE size_t align16(size_t x) { return (x + 15) & ~static_cast<size_t>(15); }

// Shared memory of a block of the decode and extend kernels, which serve `rows` query rows (decode:
// the heads of a GQA chunk; extend: query tokens x heads) over tiles of `tile_n` tokens.
struct TileSmem {
  size_t q, k, v, s, tok_page, tok_slot, stats, counters, total;
};

template <class T>
KVATTN_HOST_DEVICE TileSmem tile_smem(int rows, int head_dim, int tile_n) {
  TileSmem L;
  size_t off = 0;
  L.q = off;  // float [rows, D]
  off = align16(off + sizeof(float) * rows * head_dim);
  L.k = off;  // T [tile_n, D + pad]
  off = align16(off + kv_row_bytes<T>(head_dim) * tile_n);
  L.v = off;
  off = align16(off + kv_row_bytes<T>(head_dim) * tile_n);
  L.s = off;  // float [rows, tile_n]: logits, then probabilities
  off = align16(off + sizeof(float) * rows * tile_n);
  L.tok_page = off;  // int64 [tile_n]
  off = align16(off + sizeof(int64_t) * tile_n);
  L.tok_slot = off;  // int32 [tile_n], -1 for a token that is not read
  off = align16(off + sizeof(int32_t) * tile_n);
  L.stats = off;  // float [3, rows]: running max, running sum, rescale factor of the tile
  off = align16(off + sizeof(float) * 3 * rows);
  L.counters = off;  // int32 [4]: the report's per-block sums
  off = align16(off + sizeof(int32_t) * 4);
  L.total = off;
  return L;
}

KVATTN_DEVICE int64_t tag_owner(int64_t tag) {
  return (tag >> tags::OWNER_SHIFT) & tags::OWNER_MAX;
}

KVATTN_DEVICE int64_t tag_valid_len(int64_t tag) {
  return (tag >> tags::VALID_LEN_SHIFT) & tags::VALID_LEN_MAX;
}

// The ownership part of the reader's rule for one slot.
KVATTN_DEVICE bool slot_ok(int64_t tag, int64_t expected_owner, int64_t slot) {
  return (tag & tags::STATE_MASK) == tags::STATE_WRITTEN && tag_owner(tag) == expected_owner &&
         slot < tag_valid_len(tag);
}

// The reader's rule per page as a Violation value; the first failing condition in the order of
// kvattn.Violation wins, as in kvattn.tags.page_reason. `tag` is 0 when the page is out of range.
KVATTN_DEVICE int page_reason(int64_t tag, bool in_range, int64_t expected_owner, int64_t slots_read) {
  if (!in_range) return static_cast<int>(tags::Violation_OUT_OF_RANGE);
  const int64_t state = tag & tags::STATE_MASK;
  if (state != tags::STATE_RESERVED && state != tags::STATE_WRITTEN) return static_cast<int>(tags::Violation_FREE);
  if (state == tags::STATE_RESERVED) return static_cast<int>(tags::Violation_RESERVED);
  if (tag_owner(tag) != expected_owner) return static_cast<int>(tags::Violation_OWNER_MISMATCH);
  if (tag_valid_len(tag) < slots_read) return static_cast<int>(tags::Violation_UNWRITTEN);
  return 0;
}

KVATTN_DEVICE float warp_max(float x) {
  for (int offset = 16; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

KVATTN_DEVICE float warp_sum(float x) {
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

KVATTN_DEVICE int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
KVATTN_DEVICE int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

// Copies token rows of one KV pool into a shared-memory tile; rows of tokens not read get zeros,
// so that a refused slot contributes 0 * 0 and never NaN.
template <class T>
KVATTN_DEVICE void load_tile(unsigned char* tile, const T* pool, int64_t stride_p, int64_t stride_s,
                             int64_t head_offset, const int64_t* tok_page, const int32_t* tok_slot,
                             int tile_n, int head_dim, bool vec) {
  const size_t row_bytes = kv_row_bytes<T>(head_dim);
  if (vec) {
    constexpr int kVec = 16 / sizeof(T);
    const int vecs_per_row = head_dim / kVec;
    for (int i = threadIdx.x; i < tile_n * vecs_per_row; i += kDecodeThreads) {
      const int n = i / vecs_per_row;
      const int c = i % vecs_per_row;
      uint4 w = {0u, 0u, 0u, 0u};
      if (tok_slot[n] >= 0) {
        const T* src = pool + tok_page[n] * stride_p + tok_slot[n] * stride_s + head_offset + c * kVec;
        w = *reinterpret_cast<const uint4*>(src);
      }
      // Padded rows are only 4-byte aligned in shared memory: store the vector as four words.
      uint32_t* dst = reinterpret_cast<uint32_t*>(tile + n * row_bytes + c * 16);
      dst[0] = w.x;
      dst[1] = w.y;
      dst[2] = w.z;
      dst[3] = w.w;
    }
  } else {
    for (int i = threadIdx.x; i < tile_n * head_dim; i += kDecodeThreads) {
      const int n = i / head_dim;
      const int d = i % head_dim;
      T x = from_float<T>(0.0f);
      if (tok_slot[n] >= 0) x = pool[tok_page[n] * stride_p + tok_slot[n] * stride_s + head_offset + d];
      reinterpret_cast<T*>(tile + n * row_bytes)[d] = x;
    }
  }
}

// Where tokens [t0, t0 + tile_n) of one sequence live: tok_page/tok_slot per token, slot -1 for a
// token at or past `limit` and, when CHECK, for one whose page fails the reader's rule (the tag and
// expected owner are read beside the block-table entry; a refused token is never loaded).
template <bool CHECK>
KVATTN_DEVICE void resolve_tile(int64_t t0, int64_t limit, int tile_n, int page_shift, const int32_t* bt_row,
                                int64_t stride_bt_p, const int64_t* exp_row, int64_t stride_ep,
                                const int64_t* page_tags, int64_t num_pages, int64_t* tok_page,
                                int32_t* tok_slot) {
  for (int n = threadIdx.x; n < tile_n; n += kDecodeThreads) {
    const int64_t t = t0 + n;
    int64_t page = 0;
    int32_t slot = -1;
    if (t < limit) {
      const int64_t logical = t >> page_shift;
      const int32_t s = static_cast<int32_t>(t & ((int64_t{1} << page_shift) - 1));
      page = bt_row[logical * stride_bt_p];
      bool ok = true;
      if (CHECK) ok = page >= 0 && page < num_pages && slot_ok(page_tags[page], exp_row[logical * stride_ep], s);
      if (ok) slot = s;
    }
    tok_page[n] = page;
    tok_slot[n] = slot;
  }
}

// One tile of online softmax, one warp per row: base-2 logits s_s [rows, tile_n] (-inf where
// masked) become probabilities in place; the running max m_s and sum l_s advance and alpha_s holds
// the factor that rescales the row's accumulator.
KVATTN_DEVICE void softmax_tile(float* s_s, float* m_s, float* l_s, float* alpha_s, int rows, int tile_n) {
  const int lane = threadIdx.x % 32;
  for (int r = threadIdx.x / 32; r < rows; r += kWarps) {
    float* s_row = s_s + r * tile_n;
    float tile_max = -INFINITY;
    for (int n = lane; n < tile_n; n += 32) tile_max = fmaxf(tile_max, s_row[n]);
    tile_max = warp_max(tile_max);
    const float m_old = m_s[r];
    const float m_new = fmaxf(m_old, tile_max);
    // While every slot so far is masked m stays -inf; subtract 0 instead to avoid inf - inf.
    const float m_ref = m_new == -INFINITY ? 0.0f : m_new;
    float sum = 0.0f;
    for (int n = lane; n < tile_n; n += 32) {
      const float prob = exp2f(s_row[n] - m_ref);
      s_row[n] = prob;
      sum += prob;
    }
    sum = warp_sum(sum);
    if (lane == 0) {
      const float alpha = exp2f(m_old - m_ref);
      alpha_s[r] = alpha;
      l_s[r] = l_s[r] * alpha + sum;
      m_s[r] = m_new;
    }
  }
}

// acc (row, d) = (i / D, i % D) for i = threadIdx.x + j * kDecodeThreads: rescaled by alpha_s, plus
// the tile's probabilities times its V rows.
template <class T>
KVATTN_DEVICE void accumulate_pv(float (&acc)[kMaxOutPerThread], const float* s_s, const float* alpha_s,
                                 const unsigned char* v_s, size_t row_bytes, int rows, int D, int tile_n) {
#pragma unroll
  for (int j = 0; j < kMaxOutPerThread; ++j) {
    const int i = threadIdx.x + j * kDecodeThreads;
    if (i < rows * D) {
      const int r = i / D;
      const int d = i % D;
      const float* p_row = s_s + r * tile_n;
      float a = acc[j] * alpha_s[r];
      for (int n = 0; n < tile_n; ++n) a += p_row[n] * to_float(reinterpret_cast<const T*>(v_s + n * row_bytes)[d]);
      acc[j] = a;
    }
  }
}

// The report for logical pages [page_lo, page_hi) of one sequence of seq_len tokens: each page's
// reason into reasons_row (0 when accepted or not read), and the block's sums (refused pages, OR of
// reasons, pages read) added into counters[0..2], which the caller zeroed. Page memory is untouched.
KVATTN_DEVICE void check_pages(const int32_t* bt_row, int64_t stride_bt_p, const int64_t* exp_row, int64_t stride_ep,
                               const int64_t* page_tags, int64_t num_pages, int page_shift, int64_t seq_len,
                               int64_t page_lo, int64_t page_hi, int8_t* reasons_row, int32_t* counters) {
  const int64_t page_size = int64_t{1} << page_shift;
  int bad = 0, bits = 0, read = 0;
  for (int64_t i = page_lo + threadIdx.x; i < page_hi; i += kDecodeThreads) {
    const int64_t slots_read = min64(max64(seq_len - (i << page_shift), 0), page_size);
    int reason = 0;
    if (slots_read > 0) {
      const int64_t page = bt_row[i * stride_bt_p];
      const bool in_range = page >= 0 && page < num_pages;
      reason = page_reason(in_range ? page_tags[page] : 0, in_range, exp_row[i * stride_ep], slots_read);
      ++read;
    }
    reasons_row[i] = static_cast<int8_t>(reason);
    bad += reason != 0;
    bits |= reason;
  }
  if (bad) atomicAdd(&counters[0], bad);
  if (bits) atomicOr(&counters[1], bits);
  if (read) atomicAdd(&counters[2], read);
}

template <class T, bool CHECK>
__global__ void __launch_bounds__(kDecodeThreads) paged_decode_kernel(const DecodeParams p) {
  KVATTN_DYNAMIC_SMEM(smem);
  const int tid = threadIdx.x;
  const int64_t b = blockIdx.x;
  const int kv_head = static_cast<int>(blockIdx.y) / p.num_chunks;
  const int chunk = static_cast<int>(blockIdx.y) % p.num_chunks;
  const int split = blockIdx.z;
  const int D = p.head_dim;
  const int tile_n = p.tile_n;
  const int head0 = kv_head * p.group + chunk * p.heads_per_chunk;
  const int heads = static_cast<int>(min64(p.heads_per_chunk, p.group - chunk * p.heads_per_chunk));
  const int64_t capacity = static_cast<int64_t>(p.max_pages) << p.page_shift;

  const TileSmem L = tile_smem<T>(p.heads_per_chunk, D, tile_n);
  float* q_s = reinterpret_cast<float*>(smem + L.q);       // [heads, D]
  unsigned char* k_s = smem + L.k;                          // [tile_n, D + pad] of T
  unsigned char* v_s = smem + L.v;
  float* s_s = reinterpret_cast<float*>(smem + L.s);        // [heads, tile_n]
  int64_t* tok_page = reinterpret_cast<int64_t*>(smem + L.tok_page);
  int32_t* tok_slot = reinterpret_cast<int32_t*>(smem + L.tok_slot);
  float* m_s = reinterpret_cast<float*>(smem + L.stats);    // [heads], log2 units
  float* l_s = m_s + heads;
  float* alpha_s = l_s + heads;
  const size_t row_bytes = kv_row_bytes<T>(D);

  const int32_t raw_len = p.seq_lens[b * p.stride_sl];
  const int64_t seq_len = min64(max64(raw_len, 0), capacity);
  const int64_t start = static_cast<int64_t>(split) * p.tokens_per_split;
  const int64_t end = min64(start + p.tokens_per_split, seq_len);
  const int32_t* bt_row = p.block_table + b * p.stride_bt_b;
  const int64_t* exp_row = p.expected + b * p.stride_eb;

  const T* q = static_cast<const T*>(p.q) + b * p.stride_qb;
  for (int i = tid; i < heads * D; i += kDecodeThreads) {
    q_s[i] = to_float(q[(head0 + i / D) * p.stride_qh + i % D]);
  }
  for (int g = tid; g < heads; g += kDecodeThreads) {
    m_s[g] = -INFINITY;
    l_s[g] = 0.0f;
  }
  float acc[kMaxOutPerThread];  // output (g, d) = (i / D, i % D) for i = tid + j * kDecodeThreads
#pragma unroll
  for (int j = 0; j < kMaxOutPerThread; ++j) acc[j] = 0.0f;
  __syncthreads();

  const T* k_pool = static_cast<const T*>(p.k);
  const T* v_pool = static_cast<const T*>(p.v);
  for (int64_t t0 = start; t0 < end; t0 += tile_n) {
    resolve_tile<CHECK>(t0, end, tile_n, p.page_shift, bt_row, p.stride_bt_p, exp_row, p.stride_ep, p.page_tags,
                        p.num_pages, tok_page, tok_slot);
    __syncthreads();

    load_tile<T>(k_s, k_pool, p.stride_kp, p.stride_ks, kv_head * p.stride_kh, tok_page, tok_slot, tile_n, D,
                 p.kv_vec != 0);
    load_tile<T>(v_s, v_pool, p.stride_vp, p.stride_vs, kv_head * p.stride_vh, tok_page, tok_slot, tile_n, D,
                 p.kv_vec != 0);
#if KVATTN_SIM_BREAK != 1
    __syncthreads();
#endif

    for (int i = tid; i < heads * tile_n; i += kDecodeThreads) {
      const int g = i / tile_n;
      const int n = i % tile_n;
      float s = -INFINITY;
      if (tok_slot[n] >= 0) {
        const T* k_row = reinterpret_cast<const T*>(k_s + n * row_bytes);
        const float* q_row = q_s + g * D;
        float dot = 0.0f;
        for (int d = 0; d < D; ++d) dot += q_row[d] * to_float(k_row[d]);
        s = dot * p.scale_log2;
      }
      s_s[i] = s;
    }
    __syncthreads();

    softmax_tile(s_s, m_s, l_s, alpha_s, heads, tile_n);
    __syncthreads();

    accumulate_pv<T>(acc, s_s, alpha_s, v_s, row_bytes, heads, D, tile_n);
    __syncthreads();  // the next tile overwrites the shared tiles
  }

  // Only an empty row (l == 0) gets the 0 / -inf convention; a NaN read from a page that passed the
  // check propagates, as in the reference, instead of being turned into a plausible 0.
  if (p.num_splits == 1) {
    T* out = static_cast<T*>(p.out) + b * p.stride_ob;
#pragma unroll
    for (int j = 0; j < kMaxOutPerThread; ++j) {
      const int i = tid + j * kDecodeThreads;
      if (i < heads * D) {
        const float l = l_s[i / D];
        out[(head0 + i / D) * p.stride_oh + i % D] = from_float<T>(l == 0.0f ? 0.0f : acc[j] / l);
      }
    }
    if (p.lse != nullptr) {
      for (int g = tid; g < heads; g += kDecodeThreads) {
        const float l = l_s[g];
        p.lse[b * p.num_heads + head0 + g] = l == 0.0f ? -INFINITY : (m_s[g] + log2f(l)) * kLn2;
      }
    }
  } else {
#pragma unroll
    for (int j = 0; j < kMaxOutPerThread; ++j) {
      const int i = tid + j * kDecodeThreads;
      if (i < heads * D) {
        const int64_t row = (b * p.num_heads + head0 + i / D) * p.num_splits + split;
        p.part_acc[row * D + i % D] = acc[j];
      }
    }
    for (int g = tid; g < heads; g += kDecodeThreads) {
      const int64_t row = (b * p.num_heads + head0 + g) * p.num_splits + split;
      p.part_ml[row * 2] = m_s[g];
      p.part_ml[row * 2 + 1] = l_s[g];
    }
  }

  if (CHECK && kv_head == 0 && chunk == 0) {
    int32_t* counters = reinterpret_cast<int32_t*>(smem + L.counters);  // violations, reasons, checked
    if (tid < 3) counters[tid] = 0;
    __syncthreads();
    const int64_t page_lo = start >> p.page_shift;
    int64_t page_hi = min64((start + p.tokens_per_split) >> p.page_shift, p.max_pages);
#if KVATTN_SIM_BREAK == 2
    page_hi -= 1;
#endif
    check_pages(bt_row, p.stride_bt_p, exp_row, p.stride_ep, p.page_tags, p.num_pages, p.page_shift, seq_len,
                page_lo, page_hi, p.page_reasons + b * p.max_pages, counters);
    __syncthreads();
    if (tid == 0) {
      int n_bad = counters[0];
      int reasons = counters[1];
      if (split == 0) {
        // A seq_len past the table: nothing beyond it is read, and it counts once.
        const int beyond = raw_len > capacity;
        p.beyond_table[b] = beyond;
        n_bad += beyond;
        if (beyond) reasons |= static_cast<int>(tags::Violation_OUT_OF_RANGE);
      }
      if (n_bad) atomicAdd(&p.violations[b], n_bad);
      if (reasons) atomicOr(&p.reasons[b], reasons);
      if (counters[2]) atomicAdd(&p.pages_checked[b], counters[2]);
    }
  }
}

// Combines the splits of one (sequence, head). A split with nothing readable has m = -inf, l = 0
// and weighs 0; a row where every split is empty gets output 0 and lse -inf.
template <class T>
__global__ void __launch_bounds__(kMergeThreads) merge_splits_kernel(const DecodeParams p) {
  const int64_t b = blockIdx.x;
  const int head = blockIdx.y;
  const int S = p.num_splits;
  const int64_t row0 = (b * p.num_heads + head) * S;
  float m_max = -INFINITY;
  for (int s = 0; s < S; ++s) m_max = fmaxf(m_max, p.part_ml[(row0 + s) * 2]);
  const float m_ref = m_max == -INFINITY ? 0.0f : m_max;
  float l_sum = 0.0f;
  for (int s = 0; s < S; ++s) l_sum += p.part_ml[(row0 + s) * 2 + 1] * exp2f(p.part_ml[(row0 + s) * 2] - m_ref);
  T* out = static_cast<T*>(p.out) + b * p.stride_ob + head * p.stride_oh;
  for (int d = threadIdx.x; d < p.head_dim; d += kMergeThreads) {
    float o = 0.0f;
    for (int s = 0; s < S; ++s) o += p.part_acc[(row0 + s) * p.head_dim + d] * exp2f(p.part_ml[(row0 + s) * 2] - m_ref);
    out[d] = from_float<T>(l_sum == 0.0f ? 0.0f : o / l_sum);
  }
  if (threadIdx.x == 0 && p.lse != nullptr) {
    p.lse[b * p.num_heads + head] = l_sum == 0.0f ? -INFINITY : (m_ref + log2f(l_sum)) * kLn2;
  }
}

template <class T>
int decode_tile_tokens(int head_dim) {
  int tile = 64;
  while (tile > 8 && static_cast<size_t>(tile) * head_dim * sizeof(T) > static_cast<size_t>(kTileBytes)) tile /= 2;
  return tile;
}

// Fills the launcher's fields of `p`; returns an error message for arguments the kernels cannot run.
template <class T>
const char* plan_decode(DecodeParams& p) {
  constexpr int kVec = 16 / sizeof(T);
  if (p.head_dim < 8 || p.head_dim > kMaxHeadDim || p.head_dim % 8) return "head_dim must be a multiple of 8 in [8, 256]";
  if (p.num_kv_heads < 1 || p.num_heads % p.num_kv_heads) return "num_heads must be a multiple of num_kv_heads";
  if (p.page_shift < 0 || p.page_shift > 8) return "page_size must be a power of two in [1, 256]";
  if (p.max_pages < 1 || p.batch < 1) return "empty block table or batch";
  const int64_t page_size = int64_t{1} << p.page_shift;
  if (p.tokens_per_split < 1 || p.tokens_per_split % page_size) return "tokens_per_split must be a positive multiple of page_size";
  if (p.num_splits < 1 || p.num_splits > 65535 ||
      static_cast<int64_t>(p.num_splits) * p.tokens_per_split < (static_cast<int64_t>(p.max_pages) << p.page_shift))
    return "num_splits * tokens_per_split must cover max_pages * page_size";
  if (p.num_splits > 1 && (p.part_acc == nullptr || p.part_ml == nullptr)) return "split buffers missing";
  p.group = p.num_heads / p.num_kv_heads;
  p.heads_per_chunk = std::min(p.group, kDecodeThreads * kMaxOutPerThread / p.head_dim);
  p.num_chunks = (p.group + p.heads_per_chunk - 1) / p.heads_per_chunk;
  if (static_cast<int64_t>(p.num_kv_heads) * p.num_chunks > 65535) return "too many KV heads";
  p.tile_n = decode_tile_tokens<T>(p.head_dim);
  const auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  const int64_t strides[] = {p.stride_kp, p.stride_ks, p.stride_kh, p.stride_vp, p.stride_vs, p.stride_vh};
  bool vec = aligned(p.k) && aligned(p.v) && p.head_dim % kVec == 0;
  for (int64_t s : strides) vec = vec && s % kVec == 0;
  p.kv_vec = vec;
  p.smem_bytes = static_cast<int>(tile_smem<T>(p.heads_per_chunk, p.head_dim, p.tile_n).total);
  return nullptr;
}

template <class T, bool CHECK>
LaunchResult launch_decode(DecodeParams& p, cudaStream_t stream) {
  const char* refused = plan_decode<T>(p);
  if (refused != nullptr) return {static_cast<int>(cudaErrorInvalidValue), "paged_decode (launcher)", refused};
  if (CHECK && (p.violations == nullptr || p.reasons == nullptr || p.pages_checked == nullptr ||
                p.beyond_table == nullptr || p.page_reasons == nullptr))
    return {static_cast<int>(cudaErrorInvalidValue), "paged_decode (launcher)", "report buffers missing"};
  const size_t smem = static_cast<size_t>(p.smem_bytes);
  const dim3 grid(static_cast<unsigned>(p.batch), static_cast<unsigned>(p.num_kv_heads * p.num_chunks),
                  static_cast<unsigned>(p.num_splits));
  cudaError_t e = launch_kernel(&paged_decode_kernel<T, CHECK>, grid, dim3(kDecodeThreads), smem, stream,
                                static_cast<const DecodeParams&>(p));
  if (e != cudaSuccess) {
    return {static_cast<int>(e), CHECK ? "paged_decode_kernel<check=true>" : "paged_decode_kernel<check=false>",
            cudaGetErrorString(e)};
  }
  if (p.num_splits > 1) {
    const dim3 merge_grid(static_cast<unsigned>(p.batch), static_cast<unsigned>(p.num_heads));
    e = launch_kernel(&merge_splits_kernel<T>, merge_grid, dim3(kMergeThreads), 0, stream,
                      static_cast<const DecodeParams&>(p));
    if (e != cudaSuccess) return {static_cast<int>(e), "merge_splits_kernel", cudaGetErrorString(e)};
  }
  return {0, nullptr, nullptr};
}

}  // namespace kvattn
