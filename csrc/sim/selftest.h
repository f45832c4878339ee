// Kernels that test the harness itself (tests/test_cuda.py::test_harness_*): that it reports a
// barrier or a shuffle not reached by every thread, and that a missing barrier shows as wrong data.
#pragma once

#include <string>
#include <vector>

#include "simt.h"

namespace kvsim {
namespace selftest {

enum Mode { kCorrect = 0, kExitBeforeBarrier = 1, kPartialShuffle = 2, kMissingBarrier = 3 };

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
  p.out[tid] = v;
}

// Runs one block of `threads`; returns the values written and the harness's error ("" if none).
inline std::pair<std::vector<int>, std::string> run(int mode, int threads) {
  std::vector<int> out(threads, -7);
  const Params p{out.data(), mode};
  const cudaError_t e = launch(&neighbour_kernel, dim3(1), dim3(threads), threads * sizeof(int), p);
  return {out, e == cudaSuccess ? std::string() : std::string(cudaGetErrorString(e))};
}

}  // namespace selftest
}  // namespace kvsim
