// Paged extend (chunked prefill) with the ownership check (docs/ownership.md, section 3) as a
// template parameter. One source for nvcc and for the CPU harness (csrc/sim/simt.h). Semantics:
// kvattn.paged_extend; layout: kvattn/layout.py; the rule: tag_rule.cuh; the tensor-core step:
// attention.cuh.
//
// The checked launch first runs resolve_pages_kernel, one block per sequence: the reader's rule on
// every logical page once, the report, and an effective table whose entry packs the physical page
// and its readable slots (page << 32 | readable). The attention kernel then reads one entry per key
// in both variants (the effective entry, or the block-table entry behind the range guard), so the
// check adds no work to the inner loop and the two variants pipeline the same way.
//
// Grid (query-tile slots, num_kv_heads * num_chunks), 4 warps of 16 rows. A block's 64 rows are
// tokens_per_tile query tokens times the heads_per_tile heads of one chunk of a KV head's GQA group
// (row r: token r / heads_per_tile, head r % heads_per_tile), so each K/V tile is gathered once for
// the whole group and the tensor-core tiles are full even for a one-token chunk. The launcher
// (kvattn/backends/cuda/launch.py) gives sequence b max(1, ceil(q_len_b / tokens_per_tile))
// consecutive slots from tile_start[b] on, with device ops; a block finds its sequence by binary
// search in tile_start; the ceil(total_q / tokens_per_tile) + B slots depend on shapes only and the
// spare ones write nothing. Key tiles are double-buffered by cp.async (zero-fill for keys that may
// not be read); each key's page entry is loaded one tile ahead of its copy and stored as the byte
// offsets of its K and V rows (KeyRows), so that a copy adds one offset to its base. Causal tiles
// wholly after the block's last query position are never visited, and only tiles that cross the
// diagonal apply the causal mask; each lane folds the tile's masks into one word of bits per row,
// so that each score tests a constant bit. With a custom mask (kvattn.variants; VARIANT
// instantiations), each key entry also carries which of the block's query tokens read the key, one
// bit per token read from the mask's bytes when the entry is loaded and kept in shared memory
// beside it: a key no token of the block reads is not copied, and the score loop masks each row by
// its bit.
// fp8 pools (and fp8 queries over them) run the element-wise instantiations: the codes are read
// and converted exactly into the 16-bit tiles as they are copied (kv_copy.cuh copy_chunk_fp8),
// k_scale and q_scale join the score scale and v_scale the output, so the tensor-core step is the
// 16-bit one.
#pragma once

#include "attention.cuh"
#include "kv_copy.cuh"
#include "launchers.h"
#include "params.h"
#include "tag_rule.cuh"

namespace kvattn {

// The block's view of the custom mask (kvattn.variants): the entries of its first query token start
// at `row0`, those of each next token `width` further; `tokens` tokens. Inactive without a mask.
struct MaskRows {
  bool active;
  int64_t row0, width;
  int tokens;
};

// Which of the block's query tokens read key t under the custom mask: bit i for token i of the
// block (at most kExtendRows = 64 tokens); entries past the mask's end read as false.
KVATTN_DEVICE uint64_t mask_row_bits(const ScoreVariant& v, const MaskRows& m, int64_t t) {
  uint64_t bits = 0;
  for (int i = 0; i < m.tokens; ++i) {
    const int64_t idx = m.row0 + i * m.width + t;
    if (idx < v.mask_numel && v.custom_mask[idx]) bits |= uint64_t{1} << i;
  }
  return bits;
}

// Where key t0 + tid lives (threads tid < kKeys): page (-1 when the key may not be read) and slot;
// `rows`: the custom mask's bits of the key (mask_row_bits), when it has one. VARIANT: keys before
// `first` (the first key any row of the block reads, under a sliding window), and keys the custom
// mask removes from every row of the block, are not read either: masked by scores alone, whatever
// they hold would still reach the other rows as 0 * NaN.
template <bool CHECK, bool VARIANT>
KVATTN_DEVICE int2 load_key_entry(const ExtendParams& p, const int32_t* bt_row, const int64_t* eff_row, int64_t t0,
                                  int64_t first, int64_t kv_hi, int keys, const MaskRows& mask, uint64_t& rows) {
  const int tid = threadIdx.x;
  int2 entry = make_int2(-1, 0);
  const int64_t t = t0 + tid;
  rows = 0;
  if (tid < keys && t < kv_hi && (!VARIANT || t >= first)) {
    const int64_t logical = page_of(p.page, t);
    const int slot = static_cast<int>(t - logical * p.page.size);
    if (CHECK) {
      const int64_t e = eff_row[logical];
      if (slot < static_cast<int>(e & 0xffffffff)) entry = make_int2(static_cast<int>(e >> 32), slot);
    } else {
      const int32_t page = bt_row[logical * p.stride_bt_p];
      if (page >= 0 && page < p.num_pages) entry = make_int2(page, slot);
    }
    if (VARIANT && mask.active && entry.x >= 0) {
      rows = mask_row_bits(p.var, mask, t);
      if (rows == 0) entry = make_int2(-1, 0);
    }
  }
  return entry;
}

// Where a key's rows lie in the pools, in bytes from their bases (the KV head's, and the V columns
// of the block, included); the pools' first rows for a key that is not read (the tile's mask says
// which, and no byte of them is copied).
struct KeyRows {
  int64_t k, v;
};

// Bits 0 .. last of a tile's key mask: none when last < 0, all 64 from 63 on.
KVATTN_DEVICE uint64_t keys_through(int64_t last) {
  return last < 0 ? 0 : last >= 63 ? ~uint64_t{0} : (uint64_t{2} << last) - 1;
}

// A minimum of one block per SM leaves ptxas the whole register file, as for decode.
template <class T, int D, bool CHECK, bool VEC, bool VARIANT>
__global__ void __launch_bounds__(kThreads, 1) paged_extend_kernel(const ExtendParams p) {
  using L = ExtendLayout<D>;
  constexpr int NK = L::kKeys;
  constexpr int DV = L::kDV;
  KVATTN_DYNAMIC_SMEM(smem);
  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  const int64_t slot_id = blockIdx.x;
  const int d_part = static_cast<int>(blockIdx.y) % HeadSplit<D>::kSplit;
  const int kv_head = static_cast<int>(blockIdx.y) / HeadSplit<D>::kSplit / p.num_chunks;
  const int chunk = static_cast<int>(blockIdx.y) / HeadSplit<D>::kSplit % p.num_chunks;
  const int v_col = d_part * DV;
  const int H = p.heads_per_tile, TOK = p.tokens_per_tile;
  const int64_t capacity = static_cast<int64_t>(p.max_pages) * p.page.size;
  const int ksteps = (p.head_dim + 15) / 16;  // QK^T over the whole head
  // Output dims of this block: none for the second half of a split head whose V is at most DV wide.
  const int dv = static_cast<int>(max64(min64(DV, p.head_dim_v - v_col), 0));
  const int dsteps = (dv + 15) / 16;

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
  const int64_t m0 = tile * TOK;
  // One past the last key the block reads; 0 for a spare slot and, when causal, for a sequence
  // holding fewer tokens than it has queries (malformed: it fails closed and reads nothing).
  int64_t kv_hi = seq_len;
  if (p.causal) kv_hi = min64(kv_hi, first_pos + min64(m0 + TOK, q_len));
  // Without causality a sequence may have more queries than keys: each row reads them all.
  if (m0 >= q_len || (p.causal && q_len > raw_len)) kv_hi = 0;
  // Keys after every row's right window edge are not copied: the block stops after its last row's.
  const bool right_edged = VARIANT && p.var.window_right >= 0;
  if (right_edged) kv_hi = min64(kv_hi, max64(first_pos + min64(m0 + TOK, q_len) + p.var.window_right, 0));
  const int64_t n_tiles = (kv_hi + NK - 1) / NK;
  // Key tiles from here on may hold keys after the block's first query position: causal mask.
  const int64_t diagonal = p.causal ? max64(first_pos + m0 + 1, 0) / NK * NK : kv_hi;
  // With a sliding window, key tiles wholly before the window of the block's first row are skipped.
  const bool windowed = VARIANT && p.var.window_left >= 0;
  const int64_t first_key = windowed ? max64(first_pos + m0 - p.var.window_left, 0) : 0;
  const int64_t j0 = windowed ? min64(first_key / NK, n_tiles) : 0;
  const bool custom = VARIANT && p.var.custom_mask != nullptr;
  const int64_t mask_width = max64(raw_len, 0);
  const MaskRows mask_rows{custom, custom ? p.var.mask_start[b] + m0 * mask_width : 0, mask_width,
                           static_cast<int>(max64(min64(TOK, q_len - m0), 0))};

  unsigned char* q_rows = smem;
  unsigned char* tiles = smem + L::kQBytes;
  KeyRows* keys = reinterpret_cast<KeyRows*>(tiles + L::kStages * L::kTileBytes);
  uint32_t* masks = reinterpret_cast<uint32_t*>(keys + L::kKeySlots * NK);
  // After L::kTotal, with a custom mask only (plan_extend adds it to the launch's shared memory).
  uint64_t* key_rows = reinterpret_cast<uint64_t*>(smem + L::kTotal);

  // Row r of the block: token m0 + r / H, head kv_head * group + chunk * H + r % H; rows past the
  // sequence's queries, past the group or past TOK * H read q = 0 and are never stored.
  auto row_token = [&](int r) { return m0 + r / H; };
  auto row_head = [&](int r) { return chunk * H + r % H; };  // within the GQA group
  auto row_ok = [&](int r) { return r < TOK * H && row_token(r) < q_len && row_head(r) < p.group; };
  for (int i = tid; i < kExtendRows * D; i += kThreads) {
    const int r = i / D, d = i % D;
    T x = from_float<T>(0.0f);
    if (row_ok(r) && d < p.head_dim) {
      const int64_t at = (row0 + row_token(r)) * p.stride_qt + (kv_head * p.group + row_head(r)) * p.stride_qh + d;
      // fp8 queries come over fp8 pools only: the element-wise kernels convert their codes.
      x = VEC ? static_cast<const T*>(p.q)[at] : query_element<T>(p.q, at, p.q_dtype);
    }
    reinterpret_cast<T*>(q_rows + r * L::kRowK)[d] = x;
  }
  const int32_t* bt_row = p.block_table + b * p.stride_bt_b;
  const int64_t* eff_row = CHECK ? p.effective + b * p.max_pages : nullptr;
  uint64_t entry_rows;
  int2 entry = load_key_entry<CHECK, VARIANT>(p, bt_row, eff_row, j0 * NK, first_key, kv_hi, NK, mask_rows, entry_rows);

  const int64_t k_head_off = kv_head * p.stride_kh, v_head_off = kv_head * p.stride_vh + v_col;
  // Stores where the keys of tile j lie (their entries loaded one tile earlier) and their mask:
  // keys 32w .. 32w + 31 by warp w.
  auto store_keys = [&](int64_t j) {
    const int ks = static_cast<int>(j % L::kKeySlots);
    if (tid < NK) {
      const int64_t page = entry.x, slot = entry.y;
      const int64_t bytes = VEC || p.kv_type == KVType::kSame ? sizeof(T) : 1;  // of a pool element
      keys[ks * NK + tid] = page >= 0 ? KeyRows{(page * p.stride_kp + slot * p.stride_ks + k_head_off) * bytes,
                                                (page * p.stride_vp + slot * p.stride_vs + v_head_off) * bytes}
                                      : KeyRows{0, 0};
    }
    if (custom && tid < NK) key_rows[ks * NK + tid] = entry_rows;
    const unsigned bits = __ballot_sync(0xffffffffu, tid < NK && entry.x >= 0);
    if (lane == 0 && warp < NK / 32) masks[ks * 2 + warp] = bits;
  };
  // Which keys of tile j may be read (bit i: key i), once store_keys(j) is visible.
  auto tile_mask = [&](int64_t j) {
    const int ks = static_cast<int>(j % L::kKeySlots);
    return static_cast<uint64_t>(masks[ks * 2]) | (NK > 32 ? static_cast<uint64_t>(masks[ks * 2 + 1]) << 32 : 0);
  };
  // The block's 128 threads move 128 consecutive 16-byte chunks of the tile's rows at a time; a key
  // that is not read copies 0 bytes (kv_copy.cuh copy_chunk).
  // KV: the pools' element type, T, or (element-wise kernels) uint8_t for fp8 codes of either
  // format, converted on the copy by loops that are not unrolled (the 16-bit copies stay as they
  // were, and the kernel's code grows by one short loop).
  auto copy_rows = [&](int64_t j, auto pool_type) {
    using KV = typename decltype(pool_type)::type;
    constexpr bool kSame = std::is_same<KV, T>::value;
    const unsigned char* k_pool = static_cast<const unsigned char*>(p.k);
    const unsigned char* v_pool = static_cast<const unsigned char*>(p.v);
    const KeyRows* tile_keys = keys + (j % L::kKeySlots) * NK;
    const uint64_t reads = tile_mask(j);
    // Whether this thread's row of copy k may be read: bit row(k) - row(0) of its shifted mask, a
    // constant bit where rows step by a constant.
    const auto row_read = [&](auto map, int k) {
      using M = decltype(map);
      return ((reads >> M::row(0, tid)) >> (M::row(k, tid) - M::row(0, tid))) & 1u;
    };
    unsigned char* k_tile = tiles + (j % L::kStages) * L::kTileBytes;
    unsigned char* v_tile = k_tile + NK * L::kRowK;
    const auto copy = [&](unsigned char* dst, const unsigned char* at, int valid, bool read) {
      const KV* src = reinterpret_cast<const KV*>(at);
      if constexpr (kSame) copy_chunk<T, VEC>(dst, src, valid, read);
      else copy_chunk_fp8<T>(dst, src, valid, read, p.fp8_wide != 0, p.kv_type == KVType::kE5M2);
    };
    constexpr int kCopiesK = NK * L::kChunksK / kThreads, kCopiesV = NK * L::kChunksV / kThreads;
    [[maybe_unused]] constexpr int kUnrollK = kSame ? copy_unroll(kCopiesK) : 1;
    [[maybe_unused]] constexpr int kUnrollV = kSame ? copy_unroll(kCopiesV) : 1;
#pragma unroll kUnrollK
    for (int k = 0; k < kCopiesK; ++k) {
      using M = ChunkMap<L::kChunksK, kThreads>;
      const int row = M::row(k, tid), c = M::col(k, tid);
      copy(k_tile + row * L::kRowK + c * 16, k_pool + c * 8 * sizeof(KV) + tile_keys[row].k, p.head_dim - c * 8,
           row_read(M{}, k));
    }
#pragma unroll kUnrollV
    for (int k = 0; k < kCopiesV; ++k) {
      using M = ChunkMap<L::kChunksV, kThreads>;
      const int row = M::row(k, tid), c = M::col(k, tid);
      copy(v_tile + row * L::kRowV + c * 16, v_pool + c * 8 * sizeof(KV) + tile_keys[row].v,
           p.head_dim_v - v_col - c * 8, row_read(M{}, k));
    }
  };
  auto copy_tile = [&](int64_t j) {
    if constexpr (!VEC) {
      if (p.kv_type != KVType::kSame) return copy_rows(j, TypeTag<uint8_t>{});
    }
    copy_rows(j, TypeTag<T>{});
  };

  store_keys(j0);
  entry = load_key_entry<CHECK, VARIANT>(p, bt_row, eff_row, (j0 + 1) * NK, first_key, kv_hi, NK, mask_rows, entry_rows);
  __syncthreads();
  if (j0 < n_tiles) copy_tile(j0);
  cp_async_commit();
  QueryFragments<D> q;
  q.load(q_rows + warp * kWarpRows * L::kRowK, ksteps);
  WarpAttention<T, DV> att;
  att.init();
  const int g = lane / 4, t = lane % 4;
  int64_t q_pos[2];   // positions of this lane's rows g and g + 8
  int64_t anchor[2];  // and their ALiBi anchors
  int row_bit[2];     // their tokens within the block: the bit of the custom mask's key rows
  for (int r = 0; r < 2; ++r) {
    row_bit[r] = (warp * kWarpRows + g + 8 * r) / H;
    q_pos[r] = first_pos + row_token(warp * kWarpRows + g + 8 * r);
    anchor[r] = alibi_anchor(q_pos[r], capacity);
  }
  // fp8 pools (element-wise kernels only): k_scale (and an fp8 query's q_scale) of this
  // sequence's KV head joins the score's scale, v_scale the output (after the loop).
  const bool fp8 = !VEC && p.kv_type != KVType::kSame;
  const float score_scale = fp8 ? fp8_score_scale(p, b, kv_head) : p.scale_log2;
  float alibi2[2] = {0.0f, 0.0f};  // ALiBi slopes (base 2) of those rows
  if (VARIANT && p.var.alibi != nullptr) {
    const float* slopes = seq_slopes(p.var, b);
    for (int r = 0; r < 2; ++r) {
      const int row = warp * kWarpRows + g + 8 * r;
      alibi2[r] = row_ok(row) ? slopes[kv_head * p.group + row_head(row)] * (1.0f / kLn2) : 0.0f;
    }
  }

  for (int64_t j = j0; j < n_tiles; ++j) {
    store_keys(j + 1);  // entries of tile j + 1, loaded during tile j - 1
    entry = load_key_entry<CHECK, VARIANT>(p, bt_row, eff_row, (j + 2) * NK, first_key, kv_hi, NK, mask_rows, entry_rows);
    __syncthreads();  // tile j + 1's entries visible; every warp is done with tile j - 1's buffer
    if (j + 1 < n_tiles) copy_tile(j + 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();  // tile j landed for every thread

    const unsigned char* k_rows = tiles + (j % L::kStages) * L::kTileBytes;
    const int ks = static_cast<int>(j % L::kKeySlots);
    const uint64_t mask = tile_mask(j);
    const int64_t t0 = j * NK;
    float s[NK / 8][4];
    qk_scores<T, D, NK>(s, q, k_rows, ksteps);
    const bool causal_tile = p.causal && t0 + NK > diagonal;
    // The keys each of this lane's rows may read, bit n * 8 + c % 2 for score s[n][c] (whose key is
    // n * 8 + 2t + c % 2): the tile's mask shifted by 2t, cut by the row's causal and window edges.
    const int64_t lane_t0 = t0 + 2 * t;
    uint64_t row_keys[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      uint64_t bits = mask >> (2 * t);
      if (causal_tile) bits &= keys_through(q_pos[r] - lane_t0);
      if (windowed) bits &= ~keys_through(q_pos[r] - p.var.window_left - 1 - lane_t0);
      if (right_edged) bits &= keys_through(q_pos[r] + p.var.window_right - lane_t0);
      row_keys[r] = bits;
    }
#pragma unroll
    for (int n = 0; n < NK / 8; ++n)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int key = n * 8 + 2 * t + c % 2;
        const bool visible = (row_keys[c / 2] >> (n * 8 + c % 2)) & 1u;
        float x = s[n][c] * score_scale;
        if (VARIANT) {
          const float distance = static_cast<float>(t0 + key - anchor[c / 2]);
          x = variant_score(x, p.var, alibi2[c / 2], p.causal ? distance : -fabsf(distance));
        }
        s[n][c] = visible ? x : -INFINITY;
      }
    if (custom) {
      // A pass of its own under a block-uniform branch: without a mask it costs one branch a tile.
      const uint64_t* tile_rows = key_rows + ks * NK;
#pragma unroll
      for (int n = 0; n < NK / 8; ++n)
#pragma unroll
        for (int c = 0; c < 4; ++c)
          if (!((tile_rows[n * 8 + 2 * t + c % 2] >> row_bit[c / 2]) & 1u)) s[n][c] = -INFINITY;
    }
    att.template softmax_step<NK>(s);
    att.template accumulate<NK>(s, k_rows + NK * L::kRowK, dsteps);
  }
  cp_async_wait<0>();
  att.finish();

  // Only an empty row (l == 0), or a head that reads nothing (head_reads), gets the 0 / -inf
  // convention; a NaN read from a page that passed the check propagates, as in the reference.
  T* out = static_cast<T*>(p.out);
  // The scales re-read from the parameters here rather than held across the loop (registers).
  const float out_scale = fp8 ? p.v_scale[b * p.scale_stride + kv_head] : 1.0f;
  const bool scales_ok = !fp8 || fp8_scales_ok(p, b, kv_head);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = warp * kWarpRows + g + 8 * r;
    if (!row_ok(row)) continue;
    const bool reads = scales_ok && head_reads<VARIANT>(p.var, b, kv_head * p.group + row_head(row));
    const float l = reads ? att.l[r] : 0.0f;
    const int head = kv_head * p.group + row_head(row);
    const float shift2 = reads ? alibi_shift2<VARIANT>(p.var, b, head, q_pos[r], capacity) : 0.0f;
    const float denominator = VARIANT ? with_sink(l, att.m[r], p.var.sinks, head, shift2) : l;
    T* out_row = out + (row0 + row_token(row)) * p.stride_ot + (kv_head * p.group + row_head(row)) * p.stride_oh;
#pragma unroll
    for (int jd = 0; jd < DV / 8; ++jd)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int d = 8 * jd + 2 * t + c;
        if (d < dv) out_row[v_col + d] = from_float<T>(l == 0.0f ? 0.0f : att.o[jd][2 * r + c] * out_scale / denominator);
      }
    if (t == 0 && d_part == 0 && p.lse != nullptr) {
      p.lse[(row0 + row_token(row)) * p.num_heads + kv_head * p.group + row_head(row)] =
          l == 0.0f ? -INFINITY : (att.m[r] + log2f(l) + shift2) * kLn2;
    }
  }
}

// The launcher of csrc/kvattn/launchers.h; dispatch.cuh picks the instantiation.
template <class T, int D, bool CHECK, bool VEC, bool VARIANT>
cudaError_t ExtendKernel<T, D, CHECK, VEC, VARIANT>::launch(const ExtendParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.num_slots), static_cast<unsigned>(p.num_kv_heads * p.num_chunks * p.d_split));
  return launch_kernel(&paged_extend_kernel<T, D, CHECK, VEC, VARIANT>, grid, dim3(kThreads),
                       static_cast<size_t>(p.smem_bytes), stream, p);
}

}  // namespace kvattn
