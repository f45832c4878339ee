// Copying K/V rows from the pools into shared memory, shared by the decode and extend kernels:
// which 16-byte chunk of a tile each thread moves, and the move itself (cp.async when rows are
// 16-byte aligned, else element by element). One source for nvcc and for the CPU harness.
#pragma once

#include "compat.cuh"
#include "warp_ops.cuh"

namespace kvattn {

// Copy k of thread t, when N threads move N consecutive 16-byte chunks of a tile at a time, moves
// chunk k * N + t of a tile with kChunks chunks per row. Written so that an unrolled loop folds k
// away: a constant plus one per-thread term, computed once.
template <int kChunks, int N>
struct ChunkMap {
  static_assert(kChunks % N == 0 || N % kChunks == 0, "chunks per row and threads must divide");
  static KVATTN_DEVICE int row(int k, int t) {
    if constexpr (kChunks <= N) return k * (N / kChunks) + t / kChunks;
    else return k / (kChunks / N);
  }
  static KVATTN_DEVICE int col(int k, int t) {
    if constexpr (kChunks <= N) return t % kChunks;
    else return (k % (kChunks / N)) * N + t;
  }
};

// Moves 16 bytes (8 16-bit or 16 fp8 elements) of a row: by cp.async when rows are 16-byte aligned (VEC), else
// element by element, stored at once (visible after the warp's next sync). Elements past
// head_dim and rows not read become zeros; the source of a 0-byte copy is never read.
template <class T, bool VEC>
KVATTN_DEVICE void copy_chunk(unsigned char* dst, const T* src, int valid, bool read) {
  if constexpr (VEC) {
    cp_async_16(dst, src, read && valid > 0 ? 16 : 0);
  } else {
#pragma unroll
    for (int e = 0; e < static_cast<int>(16 / sizeof(T)); ++e)
      reinterpret_cast<T*>(dst)[e] = read && e < valid ? src[e] : from_float<T>(0.0f);
  }
}

}  // namespace kvattn
