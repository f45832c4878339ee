// Copying K/V rows from the pools into shared memory, shared by the decode and extend kernels:
// which 16-byte chunk of a tile each thread moves, and the move itself (cp.async when rows are
// 16-byte aligned, else element by element, fp8 codes converted on the way). One source for nvcc
// and for the CPU harness.
#pragma once

#include "compat.cuh"
#include "warp_ops.cuh"

namespace kvattn {

// Copy k of thread t, when N threads move N consecutive 16-byte chunks of a tile at a time, moves
// chunk k * N + t of a tile with kChunks chunks per row. Written so that an unrolled loop folds k
// away: a constant plus one per-thread term, computed once.
// Rows whose chunk count neither divides nor is divided by N (the MLA latent row's 72) take the
// plain division of the chunk index.
template <int kChunks, int N>
struct ChunkMap {
  static constexpr bool kDivides = kChunks % N == 0 || N % kChunks == 0;
  static KVATTN_DEVICE int row(int k, int t) {
    if constexpr (!kDivides) return (k * N + t) / kChunks;
    else if constexpr (kChunks <= N) return k * (N / kChunks) + t / kChunks;
    else return k / (kChunks / N);
  }
  static KVATTN_DEVICE int col(int k, int t) {
    if constexpr (!kDivides) return (k * N + t) % kChunks;
    else if constexpr (kChunks <= N) return t % kChunks;
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

// The element-wise copy of 8 fp8 codes of a row (e4m3, or e5m2 when `e5m2`) as 8 T, exactly (every
// e4m3 and e5m2 value is a float16 and a bfloat16 value): the extend's path over fp8 pools, whose
// rows need no alignment. `wide`: rows are 8-byte aligned and whole chunks, so a chunk's 8 codes
// are one 8-byte load; else byte by byte. Codes past `valid` and rows not read become zeros.
template <class T>
KVATTN_DEVICE void copy_chunk_fp8(unsigned char* dst, const uint8_t* src, int valid, bool read, bool wide, bool e5m2) {
  uint32_t codes[2] = {0u, 0u};  // code e in byte e % 4 of word e / 4
  if (read && wide && valid >= 8) {
    const uint64_t w = *reinterpret_cast<const uint64_t*>(src);
    codes[0] = static_cast<uint32_t>(w);
    codes[1] = static_cast<uint32_t>(w >> 32);
  } else if (read) {
    for (int e = 0; e < 8 && e < valid; ++e) codes[e / 4] |= static_cast<uint32_t>(src[e]) << (8 * (e % 4));
  }
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t pair = codes[i / 2] >> (16 * (i % 2));
    out[i] = e5m2 ? fp8x2_to<T, Fp8E5M2>(pair) : fp8x2_to<T, Fp8E4M3>(pair);
  }
}

}  // namespace kvattn
