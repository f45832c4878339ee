// Paged decode with the ownership check (docs/ownership.md, section 3) as a template parameter,
// split-KV, and the merge of the splits. One source for nvcc and for the CPU harness
// (csrc/sim/simt.h); the rule itself is tag_rule.cuh, the tensor-core step attention.cuh, the K/V
// copies kv_copy.cuh (the three shared with extend.cuh), the tile shapes tiles.h, the host-side
// plan plan.h.
//
// Grid (B, num_kv_heads * num_chunks * d_split, plus one report column checked per call,
// num_splits), 4 warps. A block serves the query heads of one chunk of a KV head's GQA group (up
// to 16 heads: the rows of one mma tile) over one split, an equal page-aligned share of the
// sequence's actual length (kvattn.backends.grids.split_chunk), so each KV page is read once for
// the whole group (heads over 256 wide: d_split = 2 blocks, each with all of QK^T and half of the
// output dims). Each warp streams its own sub-tiles of 16 tokens (sub-tile j goes to warp j % 4)
// through a private pipeline of kStages shared-memory stages; the MLA latent tile's warps pair up
// instead, so that one block reads each 576-wide row once: warps w and w + 2 share pipeline w % 2
// (sub-tile j goes to pipeline j % 2), copy half of each row each, and accumulate value dims
// [0, 256) and [256, 512) of it, with a block barrier per sub-tile (tiles.h DecodeLayout):
//   - resolve: lane r < 16 looks up token r's block-table entry and, when CHECK, its tag and expected
//     owner (for pages of 16 or more tokens the 16 lanes load the same words), in two steps a
//     sub-tile ahead of the copy, so the latency hides behind the compute of the current one; a
//     token the rule refuses, past the split's end or in a page outside the pool (both variants)
//     gets no bytes. Any page size: token -> page is a multiply and a shift (params.h PageDiv);
//   - copy: K and V rows by 16-byte cp.async when rows are 16-byte aligned (VEC), else element by
//     element, zero-filled for tokens that are not read (a refused slot is never loaded and
//     contributes 0 * 0, never NaN) and past head_dim;
//   - compute: S = Q K^T and O += P V on tensor cores, online softmax in registers.
// The warps' partial states are merged through shared memory at the end. Checked per call, the
// report has blocks of its own, column 0 of the grid's second axis (launched first): one per
// sequence and split reads the split's table entries, tags and expected owners (never page
// memory) and writes their reasons and counts while the attention blocks stream K/V, so no block
// has report work after its loop: final counters with one split, per-split partial counts summed
// by the merge kernel otherwise. No separate zeroing launch, no global atomics.
//
// Through a verdict (VERDICT, docs/ownership.md section 9) the resolve step loads one packed entry
// per token (page << 32 | readable) instead of the table entry and then the tag. The new token's
// page is this call's to judge: its entry (kept per sequence by the verdict) and tag load before
// the loop, beside the length, and become two bounds of the loop (FreshPage); the block that holds
// the new token adds its refusal to the step's report right after the pipeline's first copies,
// whose loads it overlaps. The report is otherwise the resolve's: no report work after the loop,
// no counts to merge.
#pragma once

#include "attention.cuh"
#include "kv_copy.cuh"
#include "launchers.h"
#include "params.h"
#include "tag_rule.cuh"

#include <algorithm>

namespace kvattn {

constexpr int kMergeThreads = 128;

struct SplitRange {
  int64_t start, end, chunk;
};

// kvattn.backends.grids.split_chunk on the device.
KVATTN_HOST_DEVICE SplitRange split_range(int64_t seq_len, int split, int num_splits, int align, int min_chunk) {
  const int64_t share = (seq_len + num_splits - 1) / num_splits;
  int64_t chunk = (share + align - 1) / align * align;
  chunk = chunk > min_chunk ? chunk : min_chunk;
  chunk = chunk > align ? chunk : align;
  const int64_t start = static_cast<int64_t>(split) * chunk;
  const int64_t end = start + chunk < seq_len ? start + chunk : seq_len;
  return {start, end, chunk};
}

// The first key a decode query reads (0 without a sliding window), and the first token of the
// splits: that key's align-aligned start (kvattn.backends.grids, window_start in the Triton
// kernel), so that every page is still checked by exactly one split and pages before it by none.
// The query sits at raw_len - 1, the length as given even past the table (kvattn/variants.py);
// a window wholly past the table (seq_len, the clamped length) spans nothing.
struct WindowSpan {
  int64_t first_key, span_lo;
};

template <bool VARIANT>
KVATTN_HOST_DEVICE WindowSpan window_span(int32_t raw_len, int64_t seq_len, const ScoreVariant& v, int align) {
  if (!VARIANT || v.window_left < 0) return {0, 0};
  const int64_t q_pos = (raw_len > 0 ? raw_len : 0) - int64_t{1};
  const int64_t first = q_pos - v.window_left > 0 ? q_pos - v.window_left : 0;
  const int64_t span_lo = first / align * align;
  return {first, span_lo < seq_len ? span_lo : seq_len};
}

// What a block of split `split` of sequence b reads: the length as given (raw_len), clamped to the
// table (seq_len), the window's span and the split's range of tokens (from the window's span on).
struct DecodeSpan {
  int32_t raw_len;
  int64_t seq_len;
  WindowSpan win;
  SplitRange range;
};

template <bool VARIANT>
KVATTN_DEVICE DecodeSpan decode_span(const DecodeParams& p, int64_t b, int split) {
  const int64_t capacity = static_cast<int64_t>(p.max_pages) * p.page.size;
  const int32_t raw_len = p.seq_lens[b * p.stride_sl];
  const int64_t seq_len = min64(max64(raw_len, 0), capacity);
  const WindowSpan win = window_span<VARIANT>(raw_len, seq_len, p.var, p.align);
  SplitRange range = split_range(seq_len - win.span_lo, split, p.num_splits, p.align, p.min_chunk);
  range.start += win.span_lo;
  range.end += win.span_lo;
  return {raw_len, seq_len, win, range};
}

// Resolving a sub-tile's 16 tokens takes two dependent loads (block-table entry, then tag) and is
// pipelined across the warp's iterations so that no load result is used in the iteration that
// issues it: lane r < 16 resolves token t0 + r (for pages of 16 tokens or more all 16 lanes load
// the same entry and tag, one transaction each).
struct TokenEntry {  // after the block-table load
  int32_t page;      // physical page, 0 when out of range
  int32_t slot;
  int64_t logical;
  bool live;         // token inside the split
  bool in_range;
  int32_t readable;  // through a verdict: the slots that may be read (none when out of range)
};

// The new token's page through a verdict, as the bounds the key loop reads it by: its first token
// `start` (past every token when the new token lies outside the table) and `end`, the split's end
// cut to the slots this call may read of that page, the older ones as the verdict says and the
// new one only if this call's tag certifies it (kvattn.reference.verdict_slots). Tokens from
// `start` on are the new token's page's (the sequence's last page), read up to `end`; the
// others as their entries say, up to `end` too (it lies past them). What its report needs too.
struct FreshPage {
  int32_t start;  // (a table holds fewer than 2**31 tokens: kvattn/backends/cuda/launch.py)
  int64_t end;
  int64_t logical, tag, owner, slot;
  bool in_range;
};

// The new token's page's entry and tag load beside the length, the expected owner after it.
template <bool VERDICT>
KVATTN_DEVICE FreshPage fresh_page(const DecodeParams& p, int64_t b, int32_t raw_len, const int64_t* exp_row,
                                   int64_t seq_owner, int64_t split_end) {
  FreshPage f{INT32_MAX, split_end, -1, 0, 0, 0, false};
  if (!VERDICT) return f;
  const int64_t packed = p.verdict_fresh[b];
  const int64_t page = packed >> 32;
  f.in_range = page >= 0 && page < p.num_pages;
  f.tag = f.in_range ? p.page_tags[page] : 0;
  const int64_t capacity = static_cast<int64_t>(p.max_pages) * p.page.size;
  if (raw_len < 1 || raw_len > capacity) return f;
  f.logical = page_of(p.page, raw_len - int64_t{1});
  f.start = static_cast<int32_t>(f.logical * p.page.size);
  f.slot = raw_len - 1 - f.start;
  f.owner = p.stride_ep == 0 ? seq_owner : exp_row[f.logical * p.stride_ep];
  const int64_t readable = static_cast<int32_t>(packed & 0xffffffff);
  // Older slots another layer refused stay refused; the new slot is this call's tag's to certify.
  const int64_t cap = readable < f.slot ? readable : p.page.size;
  const int64_t limit = f.in_range ? max64(min64(readable_slots(f.tag, f.owner), cap), 0) : 0;
  f.end = min64(split_end, f.start + limit);
  return f;
}

// Adds the new token's page to the step's report if this call's tag refuses it, unless the step
// counts that page already (a page counts once per step): one thread of the block that reads the
// new token.
KVATTN_DEVICE void report_fresh(const DecodeParams& p, int64_t b, const FreshPage& f) {
  if (f.logical < 0) return;
  const int why = page_reason(f.tag, f.in_range, f.owner, f.slot + 1);
  int8_t* reason = p.page_reasons + b * p.max_pages + f.logical;
  if (why != 0 && *reason == 0) {
    *reason = static_cast<int8_t>(why);
    p.violations[b] += 1;
    p.reasons[b] |= why;
  }
}

struct TokenVerdict {  // after the tag load
  TokenEntry e;
  int readable;  // slots of the page that may be read (the split's end and, checked, the tag)
};

// `first`: the first key of the window (VARIANT only); tokens before it are not read.
// VERDICT: `row` is the sequence's verdict entries (int64_t), else its block-table row (int32_t).
// Through a verdict the entry is all there is to resolve: the readable slots come with it (none of
// a page outside the pool), those of the new token's page from `fresh_start` on up to `end`, and no
// entry makes a slot past `end` readable (the split's end, cut by FreshPage; `guard` <= it loads:
// the split's end while FreshPage's tag may still be on its way).
template <bool VARIANT, bool VERDICT>
KVATTN_DEVICE TokenEntry fetch_entry(const DecodeParams& p, const void* row, int64_t t0, int64_t first,
                                     int64_t guard, int64_t end, int32_t fresh_start) {
  const int lane = lane_index();
  TokenEntry e{0, 0, 0, false, false, 0};
  const int64_t t = t0 + lane;
  if (lane < kSubTile && t < guard && (!VARIANT || t >= first)) {
    e.logical = page_of(p.page, t);
    e.live = true;
    e.slot = static_cast<int32_t>(t - e.logical * p.page.size);
    if constexpr (VERDICT) {
      const int64_t packed = static_cast<const int64_t*>(row)[e.logical];
      const int64_t page = packed >> 32, from = e.logical * p.page.size;
      const int64_t readable = from >= fresh_start ? p.page.size : static_cast<int32_t>(packed & 0xffffffff);
      e.in_range = page >= 0 && page < p.num_pages;
      e.page = e.in_range ? static_cast<int32_t>(page) : 0;
      const int64_t limit = min64(readable, end - from);
      e.readable = e.in_range ? static_cast<int32_t>(max64(limit, 0)) : 0;
    } else {
      const int32_t page = static_cast<const int32_t*>(row)[e.logical * p.stride_bt_p];
      e.in_range = page >= 0 && page < p.num_pages;
      e.page = e.in_range ? page : 0;
    }
  }
  return e;
}

template <bool CHECK, bool VERDICT>
KVATTN_DEVICE TokenVerdict fetch_verdict(const DecodeParams& p, const int64_t* exp_row, int64_t seq_owner,
                                         const TokenEntry& e, int64_t end) {
  TokenVerdict v{e, 0};
  if (VERDICT) {
    v.readable = e.readable;  // 0 for a token that is not read
  } else if (e.live && e.in_range) {
    // The length mask in slots of the page; the range guard holds in both variants.
    int64_t limit = end - e.logical * p.page.size;
    if (CHECK) {
      const int64_t owner = p.stride_ep == 0 ? seq_owner : exp_row[e.logical * p.stride_ep];
      limit = min64(limit, readable_slots(p.page_tags[e.page], owner));
    }
    v.readable = static_cast<int>(min64(limit, int64_t{1} << 30));
  }
  return v;
}

// Writes each token's K and V row offsets into `offsets` ([16][2] elements from the pool bases) and
// returns the mask of the tokens that may be read (bit r: token t0 + r).
KVATTN_DEVICE uint32_t place_sub_tile(const DecodeParams& p, const TokenVerdict& v, int64_t k_head_off,
                                      int64_t v_head_off, int64_t* offsets) {
  const int lane = lane_index();
  const bool ok = v.e.slot < v.readable;
  if (lane < kSubTile) {
    offsets[2 * lane] = v.e.page * p.stride_kp + v.e.slot * p.stride_ks + k_head_off;
    offsets[2 * lane + 1] = v.e.page * p.stride_vp + v.e.slot * p.stride_vs + v_head_off;
  }
  return __ballot_sync(0xffffffffu, lane < kSubTile && ok) & 0xffffu;
}

// Copies one sub-tile's K rows (all D) and V rows (this block's DV columns from v_col) into a
// stage, zero-filled for tokens outside `mask`: the warp's 32 lanes move 32 consecutive 16-byte
// chunks of the rows at a time (lane l: chunk l % chunks-per-row of row l / chunks-per-row); the
// latent tile's pair of warps shares the stage, and warp `part` of it moves the chunks of lanes
// 32 part .. 32 part + 31 of 64. KV: the pool element type (fp8 pools: 16 elements a chunk, VEC
// only).
template <class KV, int D, bool VEC>
KVATTN_DEVICE void copy_sub_tile(const DecodeParams& p, uint32_t mask, const int64_t* offsets, int v_col, int part,
                                 unsigned char* stage) {
  using L = DecodeLayout<D, sizeof(KV)>;
  constexpr int kElems = 16 / sizeof(KV);  // elements of a chunk
  constexpr int kLanes = 32 * kWarps / L::kPipelines;  // the lanes that fill a stage
  const int lane = lane_index() + 32 * part;
  const KV* k_pool = static_cast<const KV*>(p.k);
  const KV* v_pool = static_cast<const KV*>(p.v);
  constexpr int kCopiesK = kSubTile * L::kChunksK / kLanes, kCopiesV = kSubTile * L::kChunksV / kLanes;
  // Element-wise copies of a 512-wide head keep eight loads per copy live: unrolled by 2 only.
  // (Read by #pragma unroll alone, which the harness build's g++ ignores: hence maybe_unused.)
  [[maybe_unused]] constexpr int kUnrollK = VEC || D <= 256 ? copy_unroll(kCopiesK) : 2;
  [[maybe_unused]] constexpr int kUnrollV = VEC || D <= 256 ? copy_unroll(kCopiesV) : 2;
#pragma unroll kUnrollK
  for (int k = 0; k < kCopiesK; ++k) {
    using M = ChunkMap<L::kChunksK, kLanes>;
    const int row = M::row(k, lane), c = M::col(k, lane);
    copy_chunk<KV, VEC>(stage + row * L::kRowK + c * 16, k_pool + offsets[2 * row] + c * kElems,
                        p.head_dim - c * kElems, (mask >> row) & 1u);
  }
  if constexpr (!L::kLatent) {  // the latent tile reads its values from the K rows
    unsigned char* v_stage = stage + kSubTile * L::kRowK;
#pragma unroll kUnrollV
    for (int k = 0; k < kCopiesV; ++k) {
      using M = ChunkMap<L::kChunksV, kLanes>;
      const int row = M::row(k, lane), c = M::col(k, lane);
      copy_chunk<KV, VEC>(v_stage + row * L::kRowV + c * 16, v_pool + offsets[2 * row + 1] + v_col + c * kElems,
                          p.head_dim_v - v_col - c * kElems, (mask >> row) & 1u);
    }
  }
}

// First token of a pipeline's i-th sub-tile: sub-tile j = pipe + pipes i of the split.
KVATTN_DEVICE int64_t sub_tile_start(int64_t start, int pipe, int pipes, int i) {
  return start + static_cast<int64_t>(pipe + i * pipes) * kSubTile;
}

// What one warp's copy issue needs (fixed for the whole key loop).
struct DecodeWarp {
  const DecodeParams& p;
  const void* row;  // the block-table row, or through a verdict the sequence's entries
  const int64_t* exp_row;
  int32_t fresh_start;
  int64_t seq_owner, start, first_key, end;  // end: through a verdict, cut by FreshPage
  int pipe, pipes, mine;  // this warp's pipeline of stages, their number, its sub-tiles
  int64_t k_head_off, v_head_off;
  int v_col;  // first head dim this warp accumulates (d_split > 1, or the latent tile's second half)
  int part;   // which half of each row this warp copies (the latent tile's pairs; else 0)
  int64_t* offsets;  // [16][2] shared memory of this warp
  uint32_t* masks;   // [kStages]
  unsigned char* stages;
};

// Copies the warp's sub-tile n into its stage (when it exists), then advances the resolve
// pipeline: `verdict` becomes sub-tile n + 1's (its tag loads issued now) and `entry` n + 2's.
// Every call commits one group of copies, possibly empty, so waits count stages.
template <class KV, int D, bool CHECK, bool VEC, bool VARIANT, bool VERDICT>
KVATTN_DEVICE void issue_sub_tile(const DecodeWarp& w, int n, TokenEntry& entry, TokenVerdict& verdict,
                                  int& stage) {
  using L = DecodeLayout<D, sizeof(KV)>;
  if (n < w.mine) {
    const uint32_t mask = place_sub_tile(w.p, verdict, w.k_head_off, w.v_head_off, w.offsets);
    if (lane_index() == 0) w.masks[stage] = mask;
    __syncwarp();
    copy_sub_tile<KV, D, VEC>(w.p, mask, w.offsets, w.v_col, w.part, w.stages + stage * L::kStageBytes);
    __syncwarp();  // the offsets are rewritten by the next issue
    stage = stage + 1 == L::kStages ? 0 : stage + 1;
    verdict = fetch_verdict<CHECK, VERDICT>(w.p, w.exp_row, w.seq_owner, entry, w.end);
    entry = fetch_entry<VARIANT, VERDICT>(w.p, w.row, sub_tile_start(w.start, w.pipe, w.pipes, n + 2), w.first_key,
                                          w.end, w.end, w.fresh_start);
  }
  cp_async_commit();
}

// Rows [0, 16) of `rows` shared-memory rows of D elements: the query heads head0 .. head0 + heads
// of sequence b at `q` (zeros past them and past head_dim); FP8 (fp8 pools): dim d at column
// fp8_q_column(d), and the queries may be fp8 codes (q_dtype, converted on the way).
template <class T, int D, bool FP8>
KVATTN_DEVICE void load_query_rows(unsigned char* rows, const void* q, int64_t stride_h, int heads, int head_dim,
                                   int q_dtype) {
  for (int i = threadIdx.x; i < kWarpRows * D; i += kThreads) {
    const int r = i / D, d = i % D;
    const int64_t at = r * stride_h + d;
    T x = from_float<T>(0.0f);
    if (r < heads && d < head_dim) x = FP8 ? query_element<T>(q, at, q_dtype) : static_cast<const T*>(q)[at];
    reinterpret_cast<T*>(rows + r * tile_row_bytes<D>())[FP8 ? fp8_q_column(d) : d] = x;
  }
}

// The per-call check's report of sequence blockIdx.x's split blockIdx.z, by a block of its own: each
// of the split's pages' reason, and the counts (docs/ownership.md section 3).
template <bool VARIANT>
KVATTN_DEVICE void report_split(const DecodeParams& p, int32_t* counters) {
  const int tid = threadIdx.x;
  const int64_t b = blockIdx.x;
  const int split = blockIdx.z;
  const DecodeSpan span = decode_span<VARIANT>(p, b, split);
  const int64_t capacity = static_cast<int64_t>(p.max_pages) * p.page.size;
  const bool active = span.range.start < span.range.end;
  if (tid < kReportFields) counters[tid] = 0;
  __syncthreads();
  int8_t* reasons_row = p.page_reasons + b * p.max_pages;
  const int64_t page_size = p.page.size;
  const int64_t page_lo = span.range.start / page_size;  // splits are whole pages
  int64_t page_hi = (span.range.end + page_size - 1) / page_size;
#if KVATTN_SIM_BREAK == 2
  page_hi -= 1;
#endif
  if (active) {
    check_pages(p.block_table + b * p.stride_bt_b, p.stride_bt_p, p.expected + b * p.stride_eb, p.stride_ep,
                p.page_tags, p.num_pages, page_size, span.seq_len, span.win.first_key, page_lo, page_hi, reasons_row,
                counters, kThreads);
  }
  // This split's stripe of the table entries past the sequence: nothing is read there; zeroed so
  // that every entry of page_reasons is written by the call.
  const int64_t unread = (span.seq_len + page_size - 1) / page_size;
  const int64_t stripe = (p.max_pages - unread + p.num_splits - 1) / p.num_splits;
  const int64_t lo = unread + split * stripe;
  for (int64_t i = lo + tid; i < min64(lo + stripe, p.max_pages); i += kThreads) reasons_row[i] = 0;
  if (VARIANT) {
    // And its stripe of the entries before the splits' span (wholly before the window).
    const int64_t before = span.win.span_lo / page_size;
    const int64_t stripe_b = (before + p.num_splits - 1) / p.num_splits;
    for (int64_t i = split * stripe_b + tid; i < min64((split + 1) * stripe_b, before); i += kThreads)
      reasons_row[i] = 0;
  }
  __syncthreads();
  if (tid == 0) {
    if (p.num_splits == 1) {
      // A seq_len past the table: nothing beyond it is read, and it counts once.
      const int beyond = span.raw_len > capacity;
      p.beyond_table[b] = beyond;
      p.violations[b] = counters[0] + beyond;
      p.reasons[b] = counters[1] | (beyond ? static_cast<int>(tags::Violation_OUT_OF_RANGE) : 0);
      p.pages_checked[b] = counters[2];
    } else if (active) {
      int32_t* part = p.part_report + (b * p.num_splits + split) * kReportFields;
      part[0] = counters[0];
      part[1] = counters[1];
      part[2] = counters[2];
    }
  }
}

// A minimum of one block per SM leaves ptxas the whole register file (shared memory limits the
// blocks per SM to two or one before registers do); without it one instantiation spilled 4 bytes.
// KV: the pools' element type, T (16-bit pools) or Fp8E4M3 / Fp8E5M2 (T is then the query's type,
// the output's and the tensor cores'; k_scale joins the score's scale and v_scale the output, once).
template <class T, class KV, int D, bool CHECK, bool VEC, bool VARIANT, bool VERDICT>
__global__ void __launch_bounds__(kThreads, 1) paged_decode_kernel(const DecodeParams p) {
  static_assert(CHECK || !VERDICT, "a verdict is read by the checked kernel only");
  static_assert(DecodeLayout<D, sizeof(KV)>::kCounterBytes >= 4 * (kReportFields + 1), "counters and the length");
  constexpr bool kFp8 = !std::is_same<T, KV>::value;
  using L = DecodeLayout<D, sizeof(KV)>;
  constexpr int DV = L::kDV;
  constexpr bool kReportColumn = CHECK && !VERDICT;
  KVATTN_DYNAMIC_SMEM(smem);
  int32_t* counters = reinterpret_cast<int32_t*>(smem + L::kQBytes + L::kStagesBytes + L::kMaskBytes +
                                                 L::kOffsetBytes);
  if (kReportColumn && blockIdx.y == 0) return report_split<VARIANT>(p, counters);
  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  const int64_t b = blockIdx.x;
  const int column = static_cast<int>(blockIdx.y) - (kReportColumn ? 1 : 0);
  const int d_part = column % HeadSplit<D>::kSplit;
  const int kv_head = column / HeadSplit<D>::kSplit / p.num_chunks;
  const int chunk = column / HeadSplit<D>::kSplit % p.num_chunks;
  // The latent tile's warps w and w + 2 share pipeline w % 2 and take value dims half * DV on.
  constexpr int kPipes = L::kPipelines, kHalves = kWarps / kPipes;
  const int pipe = kHalves == 1 ? warp : warp % kPipes, half = kHalves == 1 ? 0 : warp / kPipes;
  const int block_col = d_part * DV;   // the block's first output dim
  const int v_col = block_col + half * DV;  // and this warp's
  const int split = blockIdx.z;
  const int head0 = kv_head * p.group + chunk * kWarpRows;
  const int heads = static_cast<int>(min64(kWarpRows, p.group - chunk * kWarpRows));
  const int64_t capacity = static_cast<int64_t>(p.max_pages) * p.page.size;
  const DecodeSpan span = decode_span<VARIANT>(p, b, split);
  const int32_t raw_len = span.raw_len;
  const WindowSpan win = span.win;
  const SplitRange range = span.range;
  // The warps' sub-tiles start at the window's 16-token block: earlier ones would read nothing.
  const int64_t tiles_lo = VARIANT ? max64(range.start, win.first_key / kSubTile * kSubTile) : range.start;
  const int32_t* bt_row = p.block_table + b * p.stride_bt_b;
  const int64_t* exp_row = p.expected + b * p.stride_eb;
  const void* row = VERDICT ? static_cast<const void*>(p.verdict + b * p.max_pages) : bt_row;
  const int ksteps = (p.head_dim + 15) / 16;  // QK^T over the whole head
  // Output dims of this warp: none for the second half of a split head whose V is at most DV wide.
  const int dv = static_cast<int>(max64(min64(DV, p.head_dim_v - v_col), 0));
  const int dsteps = kFp8 ? (dv + 31) / 32 : (dv + 15) / 16;  // fp8: groups of 32 dims (accumulate_fp8)

  unsigned char* q_rows = smem;
  unsigned char* stages = smem + L::kQBytes + pipe * L::kPipeBytes;
  uint32_t* masks = reinterpret_cast<uint32_t*>(smem + L::kQBytes + L::kStagesBytes) + warp * L::kStages;
  int64_t* offsets = reinterpret_cast<int64_t*>(smem + L::kQBytes + L::kStagesBytes + L::kMaskBytes) +
                     warp * 2 * kSubTile;

  const int64_t q_at = b * p.stride_qb + head0 * p.stride_qh;  // elements of T, or codes of fp8 queries
  const void* q_rows_at = p.q_dtype != 0 ? static_cast<const void*>(static_cast<const uint8_t*>(p.q) + q_at)
                                         : static_cast<const void*>(static_cast<const T*>(p.q) + q_at);
  load_query_rows<T, D, kFp8>(q_rows, q_rows_at, p.stride_qh, heads, p.head_dim, p.q_dtype);
  // The length again for after the key loop, where holding it in a register cost a spill.
  if (tid == kReportFields) counters[kReportFields] = raw_len;
  __syncthreads();
  QueryFragments<D> q;
  q.load(q_rows, ksteps);
  WarpAttention<T, DV> att;
  att.init();

  // This warp's sub-tiles: j = pipe, pipe + pipes, ... of the split's ceil((end - tiles_lo) / 16).
  const int n_sub = static_cast<int>(range.end > tiles_lo ? (range.end - tiles_lo + kSubTile - 1) / kSubTile : 0);
  const int mine = n_sub > pipe ? (n_sub - pipe + kPipes - 1) / kPipes : 0;
  const int64_t seq_owner = exp_row[0];
  const int64_t k_head_off = kv_head * p.stride_kh, v_head_off = kv_head * p.stride_vh;
  // This sequence's fp8 scales, re-read from the parameters where used: a pointer held across
  // the key loop costs registers (a block fewer per SM for some head dims).
  const float score_scale = kFp8 ? fp8_score_scale(p, b, kv_head) : p.scale_log2;

  // The resolve pipeline (fetch_entry -> fetch_verdict -> place_sub_tile), one step per iteration;
  // sub-tiles at or past the end resolve to an empty mask without loading anything.
  // The block that reads the new token (the first of KV head 0 of its split) reports its page.
  const bool reports =
      VERDICT && kv_head == 0 && chunk == 0 && d_part == 0 && range.start < raw_len && raw_len <= range.end;
  const FreshPage fresh = fresh_page<VERDICT>(p, b, raw_len, exp_row, seq_owner, range.end);
  TokenEntry entry = fetch_entry<VARIANT, VERDICT>(p, row, sub_tile_start(tiles_lo, pipe, kPipes, 0), win.first_key,
                                                   range.end, fresh.end, fresh.start);
  TokenVerdict verdict = fetch_verdict<CHECK, VERDICT>(p, exp_row, seq_owner, entry, range.end);
  entry = fetch_entry<VARIANT, VERDICT>(p, row, sub_tile_start(tiles_lo, pipe, kPipes, 1), win.first_key, range.end,
                                        fresh.end, fresh.start);
  int issue_stage = 0;  // stage of the next sub-tile to copy (n % kStages, kept incrementally)
  const DecodeWarp w{p,    row,    exp_row, fresh.start, seq_owner,  tiles_lo,   win.first_key, fresh.end, pipe,
                     kPipes, mine, k_head_off, v_head_off, v_col, half, offsets, masks, stages};
  // ALiBi slopes (base 2) of this lane's rows g and g + 8, and the query's anchor.
  const int64_t anchor = alibi_anchor(raw_len - int64_t{1}, capacity);
  float alibi2[2] = {0.0f, 0.0f};
  if (VARIANT && p.var.alibi != nullptr) {
    const float* slopes = seq_slopes(p.var, b);
    for (int r = 0; r < 2; ++r) {
      const int row = lane / 4 + 8 * r;
      alibi2[r] = row < heads ? slopes[head0 + row] * (1.0f / kLn2) : 0.0f;
    }
  }
#pragma unroll
  for (int s = 0; s < L::kStages - 1; ++s)
    issue_sub_tile<KV, D, CHECK, VEC, VARIANT, VERDICT>(w, s, entry, verdict, issue_stage);
  // After the first copies are issued, so that its loads wait beside theirs.
  if (reports && tid == 0) report_fresh(p, b, fresh);
  // This warp's sub-tile i, staged in stage st, into its state.
  const auto attend = [&](int i, int st) {
    const unsigned char* k_rows = stages + st * L::kStageBytes;
    const uint32_t mask = masks[st];
    float s[kSubTile / 8][4];
    if constexpr (kFp8) qk_scores_fp8<T, KV, D, kSubTile>(s, q, k_rows, ksteps);
    else qk_scores<T, D, kSubTile>(s, q, k_rows, ksteps);
    // Position of token 0 of this sub-tile minus the row's ALiBi anchor.
    const float distance0 = VARIANT ? static_cast<float>(sub_tile_start(tiles_lo, pipe, kPipes, i) - anchor) : 0.0f;
#pragma unroll
    for (int n = 0; n < kSubTile / 8; ++n)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int token = n * 8 + 2 * (lane % 4) + c % 2;
        float x = s[n][c] * score_scale;
        if (VARIANT) x = variant_score(x, p.var, alibi2[c / 2], distance0 + static_cast<float>(token));
        s[n][c] = (mask >> token) & 1u ? x : -INFINITY;
      }
    att.template softmax_step<kSubTile>(s);
    if constexpr (kFp8) att.template accumulate_fp8<KV, kSubTile>(s, k_rows + kSubTile * L::kRowK, dsteps);
    else if constexpr (L::kLatent) att.template accumulate<kSubTile, L::kRowK>(s, k_rows + v_col * 2, dsteps);
    else att.template accumulate<kSubTile>(s, k_rows + kSubTile * L::kRowK, dsteps);
  };
  if constexpr (L::kLatent) {
    // Both warps of a pair read each stage: a block barrier once the pair's copies of sub-tile i
    // have landed, after which the stage sub-tile i - 1 used is refilled. Every warp runs the
    // longest pipeline's trips, so that each reaches every barrier.
    const int trips = (n_sub + kPipes - 1) / kPipes;
    for (int i = 0, st = 0; i < trips; ++i, st = st + 1 == L::kStages ? 0 : st + 1) {
#if KVATTN_SIM_BREAK != 1
      cp_async_wait<L::kStages - 2>();
#endif
      __syncthreads();
      issue_sub_tile<KV, D, CHECK, VEC, VARIANT, VERDICT>(w, i + L::kStages - 1, entry, verdict, issue_stage);
      if (i < mine) attend(i, st);
    }
  } else {
    for (int i = 0, st = 0; i < mine; ++i, st = st + 1 == L::kStages ? 0 : st + 1) {
      issue_sub_tile<KV, D, CHECK, VEC, VARIANT, VERDICT>(w, i + L::kStages - 1, entry, verdict, issue_stage);
#if KVATTN_SIM_BREAK != 1
      cp_async_wait<L::kStages - 1>();
#endif
      __syncwarp();
      attend(i, st);
      __syncwarp();  // the stage is overwritten by the copy issued next
    }
  }
  cp_async_wait<0>();
  att.finish();

  // Merge the warps' states through the stage memory, once every warp is done with it: per warp
  // [16][DV] outputs, then m and l.
  __syncthreads();
  float* w_out = reinterpret_cast<float*>(smem + L::kQBytes + warp * L::kMergeBytes);
  float* w_ml = w_out + kWarpRows * DV;
  const int g = lane / 4, t = lane % 4;
  const float out_scale = kFp8 ? p.v_scale[b * p.scale_stride + kv_head] : 1.0f;
  const bool scales_ok = !kFp8 || fp8_scales_ok(p, b, kv_head);
#pragma unroll
  for (int j = 0; j < DV / 8; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int dim = kFp8 ? fp8_v_dim(j, 2 * t + c % 2) : 8 * j + 2 * t + c % 2;
      w_out[(g + 8 * (c / 2)) * DV + dim] = kFp8 ? att.o[j][c] * out_scale : att.o[j][c];
    }
  if (t == 0) {
    w_ml[g] = att.m[0];
    w_ml[g + 8] = att.m[1];
    w_ml[kWarpRows + g] = att.l[0];
    w_ml[kWarpRows + g + 8] = att.l[1];
  }
  __syncthreads();
  const bool active = range.start < range.end;
  const int32_t len = counters[kReportFields];  // raw_len
  // The block's output dims: the latent tile's both halves (its V is 512 wide), each merged over
  // the pipelines of the warps that hold it (warp = pipe + pipes * half).
  const int block_dv = kHalves == 1 ? dv : kHalves * DV;
  for (int i = tid; i < heads * block_dv; i += kThreads) {
    const int r = i / block_dv, d = i % block_dv;
    const int h = kHalves == 1 ? 0 : d / DV, dd = d - h * DV;  // the half, the dim within it
    const float* state = reinterpret_cast<const float*>(smem + L::kQBytes + h * kPipes * L::kMergeBytes);
    float m_top = -INFINITY;
    for (int k = 0; k < kPipes; ++k) m_top = fmaxf(m_top, (state + k * L::kMergeBytes / 4)[kWarpRows * DV + r]);
    const float m_ref = m_top == -INFINITY ? 0.0f : m_top;
    float o = 0.0f, l = 0.0f;
    for (int k = 0; k < kPipes; ++k) {
      const float* wo = state + k * L::kMergeBytes / 4;
      const float* ml = wo + kWarpRows * DV;
      const float weight = exp2f(ml[r] - m_ref);
      o += wo[r * DV + dd] * weight;
      l += ml[kWarpRows + r] * weight;
    }
    // Only an empty row (l == 0), or a head that reads nothing (head_reads), gets the 0 / -inf
    // convention; a NaN read from a page that passed the check propagates, as in the reference.
    // Blocks of a head split write their columns; the first writes the row's statistics.
    const bool reads = scales_ok && head_reads<VARIANT>(p.var, b, head0 + r);
    if (p.num_splits == 1) {
      const float shift2 = reads ? alibi_shift2<VARIANT>(p.var, b, head0 + r, len - int64_t{1}, capacity) : 0.0f;
      const float denominator = VARIANT ? with_sink(l, m_ref, p.var.sinks, head0 + r, shift2) : l;
      static_cast<T*>(p.out)[b * p.stride_ob + (head0 + r) * p.stride_oh + block_col + d] =
          from_float<T>(l == 0.0f || !reads ? 0.0f : o / denominator);
      if (d == 0 && d_part == 0 && p.lse != nullptr)
        p.lse[b * p.num_heads + head0 + r] = l == 0.0f || !reads ? -INFINITY : (m_ref + log2f(l) + shift2) * kLn2;
    } else if (active) {
      // A head that reads nothing stores the state of a split with nothing read.
      const int64_t row = (b * p.num_heads + head0 + r) * p.num_splits + split;
      p.part_acc[row * p.head_dim_v + block_col + d] = reads ? o : 0.0f;
      if (d == 0 && d_part == 0) {
        p.part_ml[row * 2] = reads ? m_top : -INFINITY;
        p.part_ml[row * 2 + 1] = reads ? l : 0.0f;
      }
    }
  }
}

// Combines the splits of one (sequence, head) that lie inside the sequence. A split with nothing
// readable has m = -inf, l = 0 and weighs 0; a row where every split is empty gets output 0 and
// lse -inf; an attention sink joins the denominator once, here. The head-0 block of each sequence
// also sums the splits' report counts.
template <class T, bool VARIANT>
__global__ void __launch_bounds__(kMergeThreads) merge_splits_kernel(const DecodeParams p) {
  const int64_t b = blockIdx.x;
  const int head = blockIdx.y;
  const int S = p.num_splits;
  const int64_t capacity = static_cast<int64_t>(p.max_pages) * p.page.size;
  const int32_t raw_len = p.seq_lens[b * p.stride_sl];
  const int64_t seq_len = min64(max64(raw_len, 0), capacity);
  const int64_t span = seq_len - window_span<VARIANT>(raw_len, seq_len, p.var, p.align).span_lo;
  const SplitRange first = split_range(span, 0, S, p.align, p.min_chunk);
  const int active = static_cast<int>((span + first.chunk - 1) / first.chunk);
  const int64_t row0 = (b * p.num_heads + head) * S;
  float m_max = -INFINITY;
  for (int s = 0; s < active; ++s) m_max = fmaxf(m_max, p.part_ml[(row0 + s) * 2]);
  const float m_ref = m_max == -INFINITY ? 0.0f : m_max;
  float l_sum = 0.0f;
  for (int s = 0; s < active; ++s) l_sum += p.part_ml[(row0 + s) * 2 + 1] * exp2f(p.part_ml[(row0 + s) * 2] - m_ref);
  T* out = static_cast<T*>(p.out) + b * p.stride_ob + head * p.stride_oh;
  // The splits' logits leave out the row's ALiBi shift past the table: it joins here, once (0 for
  // a head that reads nothing, whose slope may be NaN: its splits stored l = 0).
  const float shift2 = l_sum == 0.0f ? 0.0f : alibi_shift2<VARIANT>(p.var, b, head, raw_len - int64_t{1}, capacity);
  const float denominator = VARIANT ? with_sink(l_sum, m_ref, p.var.sinks, head, shift2) : l_sum;
  for (int d = threadIdx.x; d < p.head_dim_v; d += kMergeThreads) {
    float o = 0.0f;
    for (int s = 0; s < active; ++s) o += p.part_acc[(row0 + s) * p.head_dim_v + d] * exp2f(p.part_ml[(row0 + s) * 2] - m_ref);
    out[d] = from_float<T>(l_sum == 0.0f ? 0.0f : o / denominator);
  }
  if (threadIdx.x == 0 && p.lse != nullptr) {
    p.lse[b * p.num_heads + head] = l_sum == 0.0f ? -INFINITY : (m_ref + log2f(l_sum) + shift2) * kLn2;
  }
  if (p.violations != nullptr && head == 0 && threadIdx.x == 0) {
    int bad = 0, bits = 0, read = 0;
    for (int s = 0; s < active; ++s) {
      const int32_t* part = p.part_report + (b * S + s) * kReportFields;
      bad += part[0];
      bits |= part[1];
      read += part[2];
    }
    const int beyond = raw_len > capacity;
    p.beyond_table[b] = beyond;
    p.violations[b] = bad + beyond;
    p.reasons[b] = bits | (beyond ? static_cast<int>(tags::Violation_OUT_OF_RANGE) : 0);
    p.pages_checked[b] = read;
  }
}

// The launchers of csrc/kvattn/launchers.h; dispatch.cuh picks the instantiation.
template <class T, class KV, int D, bool CHECK, bool VEC, bool VARIANT, bool VERDICT>
cudaError_t DecodeKernel<T, KV, D, CHECK, VEC, VARIANT, VERDICT>::launch(const DecodeParams& p, cudaStream_t stream) {
  // Checked per call, one column more: the report's blocks.
  const int columns = p.num_kv_heads * p.num_chunks * p.d_split + (CHECK && !VERDICT ? 1 : 0);
  const dim3 grid(static_cast<unsigned>(p.batch), static_cast<unsigned>(columns), static_cast<unsigned>(p.num_splits));
  return launch_kernel(&paged_decode_kernel<T, KV, D, CHECK, VEC, VARIANT, VERDICT>, grid, dim3(kThreads),
                       static_cast<size_t>(p.smem_bytes), stream, p);
}

template <class T, bool VARIANT>
cudaError_t MergeKernel<T, VARIANT>::launch(const DecodeParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.batch), static_cast<unsigned>(p.num_heads));
  return launch_kernel(&merge_splits_kernel<T, VARIANT>, grid, dim3(kMergeThreads), 0, stream, p);
}

}  // namespace kvattn
