// Tile shapes and shared-memory layouts of the attention kernels: plain C++, so the binding
// (csrc/module.cpp) can report them without compiling a kernel. Used by decode.cuh and extend.cuh.
#pragma once

// Generated from csrc/instantiations.py (TILES, LATENT): KVATTN_HEAD_DIM_TILES(X), X(tile, first
// head dim it runs) for each tile in increasing order, KVATTN_MAX_HEAD_DIM_TILE, KVATTN_LATENT_DIM.
#include "kvattn_head_dims.h"

#define KVATTN_STR_(x) #x
#define KVATTN_STR(x) KVATTN_STR_(x)  // a macro's value as a string literal

#if defined(__CUDACC__)
#define KVATTN_TILE_FN __host__ __device__ constexpr
#else
#define KVATTN_TILE_FN constexpr
#endif

namespace kvattn {

constexpr int kThreads = 128;  // 4 warps, for every attention kernel here
constexpr int kWarps = kThreads / 32;
constexpr int kWarpRows = 16;    // query rows per warp: the M of one mma tile
constexpr int kSubTile = 16;     // tokens a decode warp handles per pipeline stage
constexpr int kExtendRows = kWarps * kWarpRows;  // query rows of an extend block

// Bytes of one row of a Q, K or V tile in shared memory: D 16-bit elements and 16 bytes of
// padding, so the eight 16-byte rows one ldmatrix reads start in distinct bank groups.
template <int D>
KVATTN_TILE_FN int tile_row_bytes() {
  return D * 2 + 16;
}

// The MLA latent row (DeepSeek V2/V3, FlashMLA: 512 latent + 64 RoPE dims): a decode tile of its
// own, whose value is the first kLatentRank dims of the key row itself (read from the K stage).
constexpr int kLatentDim = KVATTN_LATENT_DIM, kLatentRank = 512;
constexpr int kMaxHeadDim = KVATTN_MAX_HEAD_DIM_TILE;  // the widest tile but the latent one

// Head dims are padded to the smallest tile that holds them for the register tiles; the padding is
// zero and skipped. The latent tile takes the MLA row exactly (plan.h refuses other head dims over
// kMaxHeadDim).
#define KVATTN_PAD_TO_TILE(tile, first) head_dim <= tile ? tile:
KVATTN_TILE_FN int padded_head_dim(int head_dim) {
  return KVATTN_HEAD_DIM_TILES(KVATTN_PAD_TO_TILE) kLatentDim;
}
#undef KVATTN_PAD_TO_TILE

// Unroll factor of a copy loop of `copies` iterations per thread: complete up to 8 (head dims up
// to 128), 4 beyond: completely unrolled, the copies of a 256- or 512-wide head keep too many
// addresses live and spill (measured with ptxas -v).
KVATTN_TILE_FN int copy_unroll(int copies) {
  return copies <= 16 ? copies : 4;
}

// Heads wider than 256: two blocks share a tile, each computes all of QK^T (over D) and
// accumulates half of the output dims (DV = D / 2), so the accumulators fit in registers. The
// latent tile keeps one block and splits its 512 value dims between the warps of a pair instead
// (DecodeLayout), so that each latent row is read once.
template <int D>
struct HeadSplit {
  static constexpr int kSplit = D > 256 && D != kLatentDim ? 2 : 1;
  static constexpr int kDV = D == kLatentDim ? kLatentRank / 2 : D / kSplit;  // dims a warp accumulates
};

// KB: bytes of a pool element, 2 (the query's 16-bit type) or 1 (fp8 pools: K/V rows of D bytes
// and 16 of padding in shared memory, converted to 16 bits when the fragments are built; the query
// rows stay 16-bit).
// The latent tile stages K rows only: its values are read from them. Its warps pair up: warps w and
// w + 2 share pipeline w % 2 of stages (each copies half of every staged row, both compute QK^T
// over it) and accumulate value dims [0, 256) and [256, 512) of the same sub-tiles.
template <int D, int KB = 2>
struct DecodeLayout {
  static_assert(KB == 1 || KB == 2, "pool elements of 1 or 2 bytes");
  static constexpr bool kLatent = D == kLatentDim;
  static constexpr int kDV = HeadSplit<D>::kDV;
  static constexpr int kPipelines = kLatent ? kWarps / 2 : kWarps;  // of stages, one per warp or pair
  static constexpr int kStages = kLatent || D <= 128 ? 3 : 2;
  static constexpr int kRowK = D * KB + 16;
  static constexpr int kRowV = kLatent ? kRowK : kDV * KB + 16;
  static constexpr int kChunksK = D * KB / 16;                // 16-byte chunks per K row
  static constexpr int kChunksV = kLatent ? 0 : kDV * KB / 16;  // per V row (this block's part)
  static constexpr int kStageBytes = kSubTile * (kLatent ? kRowK : kRowK + kRowV);  // K and V of one sub-tile
  static constexpr int kQBytes = kWarpRows * tile_row_bytes<D>();
  static constexpr int kPipeBytes = kStages * kStageBytes;
  static constexpr int kStagesBytes = kPipelines * kPipeBytes;
  static constexpr int kMaskBytes = (kWarps * kStages * 4 + 15) / 16 * 16;
  static constexpr int kOffsetBytes = kWarps * kSubTile * 2 * 8;  // per warp: [16 tokens][K, V] int64
  static constexpr int kCounterBytes = 16;  // the report's three counters, then the length
  static constexpr int kTotal = kQBytes + kStagesBytes + kMaskBytes + kOffsetBytes + kCounterBytes;
  // The merge of the warps reuses the stage memory: per warp [kWarpRows][DV] outputs, m and l.
  static constexpr int kMergeBytes = kWarpRows * kDV * 4 + 2 * kWarpRows * 4;
  static_assert(kWarps * kMergeBytes <= kStagesBytes, "warp merge area");
};

template <int D>
struct ExtendLayout {
  static constexpr int kDV = HeadSplit<D>::kDV;
  static constexpr int kStages = 2;
  static constexpr int kKeys = D <= 128 ? 64 : 32;  // keys per tile
  static constexpr int kRowK = tile_row_bytes<D>();
  static constexpr int kRowV = tile_row_bytes<kDV>();
  static constexpr int kChunksK = D * 2 / 16;
  static constexpr int kChunksV = kDV * 2 / 16;
  static constexpr int kKeySlots = 3;  // key entries: tile j read, tile j + 1 copied, tile j + 2 stored
  static constexpr int kQBytes = kExtendRows * kRowK;
  static constexpr int kTileBytes = kKeys * (kRowK + kRowV);  // K and V of one tile
  static constexpr int kKeyBytes = kKeySlots * kKeys * 16;  // per key: its K and V row offsets (KeyRows)
  static constexpr int kMaskBytes = kKeySlots * 8;
  static constexpr int kTotal = kQBytes + kStages * kTileBytes + kKeyBytes + kMaskBytes;
  // With a custom mask, after kTotal: per key entry, which of the block's query tokens read it.
  static constexpr int kRowBitsBytes = kKeySlots * kKeys * 8;
};

}  // namespace kvattn
