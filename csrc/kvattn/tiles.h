// Tile shapes and shared-memory layouts of the attention kernels: plain C++, so the binding
// (csrc/module.cpp) can report them without compiling a kernel. Used by decode.cuh and extend.cuh.
#pragma once

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

// Head dims are padded to one of these for the register tiles; the padding is zero and skipped.
KVATTN_TILE_FN int padded_head_dim(int head_dim) {
  return head_dim <= 64 ? 64 : head_dim <= 128 ? 128 : 256;
}

template <int D>
struct DecodeLayout {
  static constexpr int kStages = D <= 128 ? 3 : 2;
  static constexpr int kRow = tile_row_bytes<D>();
  static constexpr int kChunks = D * 2 / 16;                      // 16-byte chunks per row
  static constexpr int kStageBytes = 2 * kSubTile * kRow;         // K and V of one sub-tile
  static constexpr int kQBytes = kWarpRows * kRow;
  static constexpr int kWarpBytes = kStages * kStageBytes;
  static constexpr int kMaskBytes = (kWarps * kStages * 4 + 15) / 16 * 16;
  static constexpr int kOffsetBytes = kWarps * kSubTile * 2 * 8;  // per warp: [16 tokens][K, V] int64
  static constexpr int kCounterBytes = 16;
  static constexpr int kTotal = kQBytes + kWarps * kWarpBytes + kMaskBytes + kOffsetBytes + kCounterBytes;
  // The merge of the warps reuses each warp's stage memory: [kWarpRows][D] outputs, m and l.
  static_assert(kWarpRows * D * 4 + 2 * kWarpRows * 4 <= kWarpBytes, "warp merge area");
};

template <int D>
struct ExtendLayout {
  static constexpr int kStages = 2;
  static constexpr int kKeys = D <= 128 ? 64 : 32;  // keys per tile
  static constexpr int kRow = tile_row_bytes<D>();
  static constexpr int kChunks = D * 2 / 16;
  static constexpr int kKeySlots = 3;  // key entries: tile j read, tile j + 1 copied, tile j + 2 stored
  static constexpr int kQBytes = kExtendRows * kRow;
  static constexpr int kTileBytes = 2 * kKeys * kRow;  // K and V of one tile
  static constexpr int kKeyBytes = kKeySlots * kKeys * 8;  // per key: page (-1: not read) and slot
  static constexpr int kMaskBytes = kKeySlots * 8;
  static constexpr int kTotal = kQBytes + kStages * kTileBytes + kKeyBytes + kMaskBytes;
};

}  // namespace kvattn
