// Paged extend (chunked prefill) with the ownership check (ownership.md section 3) as a template
// parameter. One source for nvcc and for the CPU harness (csrc/sim/simt.h). Semantics:
// kvattn.paged_extend; layout: kvattn/layout.py.
//
// Grid (query-tile slots, num_kv_heads * num_chunks), kDecodeThreads threads. The launcher
// (kvattn/backends/cuda/launch.py) gives sequence b max(1, ceil(q_len_b / block_m)) consecutive slots
// from tile_start[b] on, computed with device ops; a block finds its sequence by binary search in
// tile_start. The grid, ceil(total_q / block_m) + B slots, depends on shapes only (no host sync), and
// the spare slots past the last tile write nothing. A block serves block_m query rows times the
// heads of one chunk of a KV head's GQA group: rows = block_m * heads, row r is query m = r / heads
// of the tile and head g = r % heads of the chunk, so each K/V tile is read once for all of them.
// Per tile of tile_n tokens, the steps of the decode kernel (decode.cuh): resolve and check each
// token's page (a refused token is never loaded), stage K and V in shared memory, logits with the
// causal mask, online softmax one warp per row in base 2, P @ V into registers.
// Causal tiles entirely after the tile's last query position are never visited. The report is
// written by the block of query tile 0, KV head 0, chunk 0 of each sequence (every sequence has a
// tile 0, even one without query rows), which checks every table entry once.
#pragma once

#include "decode.cuh"

namespace kvattn {

// A minimum of one block per SM lets ptxas go past the 64 registers it otherwise aims for on sm_90,
// where the checked variant spilled; shared memory limits the blocks per SM before registers do.
template <class T, bool CHECK>
__global__ void __launch_bounds__(kDecodeThreads, 1) paged_extend_kernel(const ExtendParams p) {
  static_assert(kDecodeThreads * kMaxOutPerThread == kExtendMaxRowElems, "accumulator size");
  KVATTN_DYNAMIC_SMEM(smem);
  const int tid = threadIdx.x;
  const int64_t slot_id = blockIdx.x;
  const int kv_head = static_cast<int>(blockIdx.y) / p.num_chunks;
  const int chunk = static_cast<int>(blockIdx.y) % p.num_chunks;
  const int D = p.head_dim;
  const int tile_n = p.tile_n;
  const int head0 = kv_head * p.group + chunk * p.heads_per_chunk;
  const int heads = static_cast<int>(min64(p.heads_per_chunk, p.group - chunk * p.heads_per_chunk));
  const int rows = p.block_m * heads;
  const int64_t capacity = static_cast<int64_t>(p.max_pages) << p.page_shift;

  // The sequence of this slot: the last one whose first tile is at or before it (tile_start[0] = 0).
  int64_t lo = 0, hi = p.batch - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (p.tile_start[mid] <= slot_id) lo = mid; else hi = mid - 1;
  }
  const int64_t b = lo;
  const int64_t tile = slot_id - p.tile_start[b];

  const int64_t row0 = p.q_start[b];
  const int64_t q_len = p.q_start[b + 1] - row0;
  const int32_t raw_len = p.seq_lens[b * p.stride_sl];
  const int64_t seq_len = min64(max64(raw_len, 0), capacity);
  const int64_t first_pos = raw_len - q_len;  // position of the sequence's first query token
  const int64_t m0 = tile * p.block_m;
  // One past the last key the tile reads; 0 for a spare slot and for a sequence holding fewer tokens
  // than it has queries (malformed: it fails closed and reads nothing).
  int64_t kv_hi = seq_len;
  if (p.causal) kv_hi = min64(kv_hi, first_pos + min64(m0 + p.block_m, q_len));
  if (m0 >= q_len || q_len > raw_len) kv_hi = 0;

  const TileSmem L = tile_smem<T>(p.block_m * p.heads_per_chunk, D, tile_n);
  float* q_s = reinterpret_cast<float*>(smem + L.q);  // [rows, D]
  unsigned char* k_s = smem + L.k;                     // [tile_n, D + pad] of T
  unsigned char* v_s = smem + L.v;
  float* s_s = reinterpret_cast<float*>(smem + L.s);   // [rows, tile_n]
  int64_t* tok_page = reinterpret_cast<int64_t*>(smem + L.tok_page);
  int32_t* tok_slot = reinterpret_cast<int32_t*>(smem + L.tok_slot);
  float* m_s = reinterpret_cast<float*>(smem + L.stats);  // [rows], log2 units
  float* l_s = m_s + rows;
  float* alpha_s = l_s + rows;
  const size_t row_bytes = kv_row_bytes<T>(D);

  const int32_t* bt_row = p.block_table + b * p.stride_bt_b;
  const int64_t* exp_row = p.expected + b * p.stride_eb;

  const T* q = static_cast<const T*>(p.q);
  for (int i = tid; i < rows * D; i += kDecodeThreads) {
    const int r = i / D;
    const int64_t m = m0 + r / heads;
    const int head = head0 + r % heads;
    q_s[i] = m < q_len ? to_float(q[(row0 + m) * p.stride_qt + head * p.stride_qh + i % D]) : 0.0f;
  }
  for (int r = tid; r < rows; r += kDecodeThreads) {
    m_s[r] = -INFINITY;
    l_s[r] = 0.0f;
  }
  float acc[kMaxOutPerThread];  // output (r, d) = (i / D, i % D) for i = tid + j * kDecodeThreads
#pragma unroll
  for (int j = 0; j < kMaxOutPerThread; ++j) acc[j] = 0.0f;
  __syncthreads();

  const T* k_pool = static_cast<const T*>(p.k);
  const T* v_pool = static_cast<const T*>(p.v);
  for (int64_t t0 = 0; t0 < kv_hi; t0 += tile_n) {
    resolve_tile<CHECK>(t0, kv_hi, tile_n, p.page_shift, bt_row, p.stride_bt_p, exp_row, p.stride_ep, p.page_tags,
                        p.num_pages, tok_page, tok_slot);
    __syncthreads();

    load_tile<T>(k_s, k_pool, p.stride_kp, p.stride_ks, kv_head * p.stride_kh, tok_page, tok_slot, tile_n, D,
                 p.kv_vec != 0);
    load_tile<T>(v_s, v_pool, p.stride_vp, p.stride_vs, kv_head * p.stride_vh, tok_page, tok_slot, tile_n, D,
                 p.kv_vec != 0);
    __syncthreads();

    for (int i = tid; i < rows * tile_n; i += kDecodeThreads) {
      const int r = i / tile_n;
      const int n = i % tile_n;
      const int64_t m = m0 + r / heads;
      bool visible = tok_slot[n] >= 0 && m < q_len;
      if (p.causal) visible = visible && t0 + n <= first_pos + m;
      float s = -INFINITY;
      if (visible) {
        const T* k_row = reinterpret_cast<const T*>(k_s + n * row_bytes);
        const float* q_row = q_s + r * D;
        float dot = 0.0f;
        for (int d = 0; d < D; ++d) dot += q_row[d] * to_float(k_row[d]);
        s = dot * p.scale_log2;
      }
      s_s[i] = s;
    }
    __syncthreads();

    softmax_tile(s_s, m_s, l_s, alpha_s, rows, tile_n);
    __syncthreads();

    accumulate_pv<T>(acc, s_s, alpha_s, v_s, row_bytes, rows, D, tile_n);
    __syncthreads();  // the next tile overwrites the shared tiles
  }

  // Only an empty row (l == 0) gets the 0 / -inf convention; a NaN read from a page that passed the
  // check propagates, as in the reference. Rows past the sequence's queries are not written.
  T* out = static_cast<T*>(p.out);
#pragma unroll
  for (int j = 0; j < kMaxOutPerThread; ++j) {
    const int i = tid + j * kDecodeThreads;
    if (i < rows * D) {
      const int r = i / D;
      const int64_t m = m0 + r / heads;
      if (m < q_len) {
        const float l = l_s[r];
        out[(row0 + m) * p.stride_ot + (head0 + r % heads) * p.stride_oh + i % D] =
            from_float<T>(l == 0.0f ? 0.0f : acc[j] / l);
      }
    }
  }
  if (p.lse != nullptr) {
    for (int r = tid; r < rows; r += kDecodeThreads) {
      const int64_t m = m0 + r / heads;
      if (m < q_len) {
        const float l = l_s[r];
        p.lse[(row0 + m) * p.num_heads + head0 + r % heads] = l == 0.0f ? -INFINITY : (m_s[r] + log2f(l)) * kLn2;
      }
    }
  }

  if (CHECK && kv_head == 0 && chunk == 0 && tile == 0) {
    int32_t* counters = reinterpret_cast<int32_t*>(smem + L.counters);  // violations, reasons, checked
    if (tid < 3) counters[tid] = 0;
    __syncthreads();
    check_pages(bt_row, p.stride_bt_p, exp_row, p.stride_ep, p.page_tags, p.num_pages, p.page_shift, seq_len,
                0, p.max_pages, p.page_reasons + b * p.max_pages, counters);
    __syncthreads();
    if (tid == 0) {
      // A seq_len past the table: nothing beyond it is read, and it counts once.
      const int beyond = raw_len > capacity;
      p.beyond_table[b] = beyond;
      p.violations[b] = counters[0] + beyond;
      p.reasons[b] = counters[1] | (beyond ? static_cast<int>(tags::Violation_OUT_OF_RANGE) : 0);
      p.pages_checked[b] = counters[2];
    }
  }
}

// Fills the launcher's fields of `p`; returns an error message for arguments the kernel cannot run.
template <class T>
const char* plan_extend(ExtendParams& p) {
  constexpr int kVec = 16 / sizeof(T);
  if (p.head_dim < 8 || p.head_dim > kMaxHeadDim || p.head_dim % 8) return "head_dim must be a multiple of 8 in [8, 256]";
  if (p.num_kv_heads < 1 || p.num_heads % p.num_kv_heads) return "num_heads must be a multiple of num_kv_heads";
  if (p.page_shift < 0 || p.page_shift > 8) return "page_size must be a power of two in [1, 256]";
  if (p.max_pages < 1 || p.batch < 1) return "empty block table or batch";
  p.group = p.num_heads / p.num_kv_heads;
  if (p.block_m < 1 || p.heads_per_chunk < 1 || p.heads_per_chunk > p.group ||
      static_cast<int64_t>(p.block_m) * p.heads_per_chunk * p.head_dim > kExtendMaxRowElems)
    return "block_m * heads_per_chunk * head_dim must be at most kExtendMaxRowElems";
  if (p.num_slots < p.batch) return "num_slots must give every sequence a tile";
  p.num_chunks = (p.group + p.heads_per_chunk - 1) / p.heads_per_chunk;
  if (static_cast<int64_t>(p.num_kv_heads) * p.num_chunks > 65535) return "too many KV heads";
  p.tile_n = decode_tile_tokens<T>(p.head_dim);
  const auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  const int64_t strides[] = {p.stride_kp, p.stride_ks, p.stride_kh, p.stride_vp, p.stride_vs, p.stride_vh};
  bool vec = aligned(p.k) && aligned(p.v) && p.head_dim % kVec == 0;
  for (int64_t s : strides) vec = vec && s % kVec == 0;
  p.kv_vec = vec;
  p.smem_bytes = static_cast<int>(tile_smem<T>(p.block_m * p.heads_per_chunk, p.head_dim, p.tile_n).total);
  return nullptr;
}

template <class T, bool CHECK>
LaunchResult launch_extend(ExtendParams& p, cudaStream_t stream) {
  const char* refused = plan_extend<T>(p);
  if (refused != nullptr) return {static_cast<int>(cudaErrorInvalidValue), "paged_extend (launcher)", refused};
  if (CHECK && (p.violations == nullptr || p.reasons == nullptr || p.pages_checked == nullptr ||
                p.beyond_table == nullptr || p.page_reasons == nullptr))
    return {static_cast<int>(cudaErrorInvalidValue), "paged_extend (launcher)", "report buffers missing"};
  const dim3 grid(static_cast<unsigned>(p.num_slots), static_cast<unsigned>(p.num_kv_heads * p.num_chunks));
  const cudaError_t e = launch_kernel(&paged_extend_kernel<T, CHECK>, grid, dim3(kDecodeThreads),
                                      static_cast<size_t>(p.smem_bytes), stream, static_cast<const ExtendParams&>(p));
  if (e != cudaSuccess) {
    return {static_cast<int>(e), CHECK ? "paged_extend_kernel<check=true>" : "paged_extend_kernel<check=false>",
            cudaGetErrorString(e)};
  }
  return {0, nullptr, nullptr};
}

}  // namespace kvattn
