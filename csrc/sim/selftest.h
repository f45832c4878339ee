// Kernels that test the harness itself (tests/backends/test_cuda.py::test_harness_*): that it
// reports a barrier or a shuffle not reached by every thread, and that a missing barrier shows as
// wrong data; and that the sanitizer build (make sanitize, tests/backends/test_sanitize.py) reports
// an out-of-bounds read made on a fiber's stack frame.
#pragma once

#include <string>
#include <vector>

#include "simt.h"
#include "../kvattn/warp_ops.cuh"

namespace kvsim {
namespace selftest {

enum Mode { kCorrect = 0, kExitBeforeBarrier = 1, kPartialShuffle = 2, kMissingBarrier = 3, kReadPastOut = 4 };

struct Params {
  int* out;
  int mode;
};

// Each thread stores its index in shared memory and reads its neighbour's after the barrier, then
// adds a warp sum; the broken modes skip or break one synchronisation.
__global__ void neighbour_kernel(const Params p) {
  int* s = reinterpret_cast<int*>(dynamic_smem());
  const int tid = threadIdx.x;
  const int n = blockDim.x;
  s[tid] = tid;
  if (p.mode == kExitBeforeBarrier && tid == 0) return;
  if (p.mode != kMissingBarrier) __syncthreads();
  int v = s[(tid + 1) % n];
  if (p.mode == kPartialShuffle && tid % 32 >= 16) {
    p.out[tid] = v;
    return;
  }
  for (int offset = 16; offset > 0; offset >>= 1) v += 0 * __shfl_xor_sync(0xffffffffu, v, offset);
  // Only the sanitizer test asks for this: the last thread reads one element past `out`.
  if (p.mode == kReadPastOut) v += static_cast<const volatile int*>(p.out)[tid + 1] & 0;
  p.out[tid] = v;
}

// Runs one block of `threads`; returns the values written and the harness's error ("" if none).
inline std::pair<std::vector<int>, std::string> run(int mode, int threads) {
  std::vector<int> out(threads, -7);
  const Params p{out.data(), mode};
  const cudaError_t e = launch(&neighbour_kernel, dim3(1), dim3(threads), threads * sizeof(int), p);
  return {out, e == cudaSuccess ? std::string() : std::string(cudaGetErrorString(e))};
}

struct MmaParams {
  const uint16_t* a;  // [16][16] row-major
  const uint16_t* b;  // [16][8] row-major (k, n)
  uint32_t* frags;    // [32][6]: a0..a3, b0, b1 per lane
  float* d;           // [32][4] per lane
  bool bf16;
};

// One warp: A into shared memory row-major, B as B^T (n rows of 16 k), both read by ldmatrix_x4,
// then one mma.m16n8k16.
__global__ void mma_kernel(const MmaParams p) {
  unsigned char* smem = dynamic_smem();
  uint16_t* a_s = reinterpret_cast<uint16_t*>(smem);        // [16][16]
  uint16_t* bt_s = reinterpret_cast<uint16_t*>(smem + 512);  // [8][16]: B^T
  const int lane = threadIdx.x;
  for (int i = lane; i < 256; i += 32) a_s[i] = p.a[i];
  for (int i = lane; i < 128; i += 32) bt_s[(i % 8) * 16 + i / 8] = p.b[i];
  __syncwarp();
  uint32_t a[4], b[4];
  const int m = lane / 8;
  kvattn::ldmatrix_x4(a, smem + ((m % 2) * 8 + lane % 8) * 32 + (m / 2) * 16);
  kvattn::ldmatrix_x4(b, smem + 512 + (lane % 8) * 32 + (m % 2) * 16);
  float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  if (p.bf16) {
    kvattn::mma_16816<__nv_bfloat16>(d, a, b[0], b[1]);
  } else {
    kvattn::mma_16816<__half>(d, a, b[0], b[1]);
  }
  for (int i = 0; i < 4; ++i) p.frags[lane * 6 + i] = a[i];
  p.frags[lane * 6 + 4] = b[0];
  p.frags[lane * 6 + 5] = b[1];
  for (int i = 0; i < 4; ++i) p.d[lane * 4 + i] = d[i];
}

// Returns (per-lane [a0..a3, b0, b1], per-lane [d0..d3], error or "").
inline std::tuple<std::vector<uint32_t>, std::vector<float>, std::string> mma(const std::vector<uint16_t>& a,
                                                                             const std::vector<uint16_t>& b, bool bf16) {
  std::vector<uint32_t> frags(32 * 6);
  std::vector<float> d(32 * 4);
  if (a.size() != 256 || b.size() != 128) return {frags, d, "expected 256 A and 128 B elements"};
  const MmaParams p{a.data(), b.data(), frags.data(), d.data(), bf16};
  const cudaError_t e = launch(&mma_kernel, dim3(1), dim3(32), 768, p);
  return {frags, d, e == cudaSuccess ? std::string() : std::string(cudaGetErrorString(e))};
}

}  // namespace selftest
}  // namespace kvsim
