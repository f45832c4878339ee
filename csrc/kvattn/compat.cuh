// What lets one kernel source compile under nvcc and, against csrc/sim/simt.h, under the host
// compiler: the 16-bit float conversions, the dynamic shared memory declaration and the launch.
#pragma once

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#define KVATTN_DEVICE __device__ __forceinline__
#define KVATTN_HOST_DEVICE __host__ __device__ __forceinline__
#define KVATTN_DYNAMIC_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#else
#include "../sim/simt.h"
#define KVATTN_DEVICE inline
#define KVATTN_HOST_DEVICE inline
#define KVATTN_DYNAMIC_SMEM(name) unsigned char* name = ::kvsim::dynamic_smem()
#endif

#include <cstddef>
#include <cstdint>

namespace kvattn {

KVATTN_DEVICE float to_float(float x) { return x; }
KVATTN_DEVICE float to_float(__half x) { return __half2float(x); }
KVATTN_DEVICE float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <class T>
KVATTN_DEVICE T from_float(float x);
template <>
KVATTN_DEVICE float from_float<float>(float x) { return x; }
template <>
KVATTN_DEVICE __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
KVATTN_DEVICE __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// A type as a value, for generic lambdas that pick an instantiation at run time.
template <class T>
struct TypeTag {
  using type = T;
};

// Every kernel takes one parameter struct by value.
template <class Params>
inline cudaError_t launch_kernel(void (*kernel)(Params), dim3 grid, dim3 block, size_t smem_bytes,
                                 cudaStream_t stream, const Params& params) {
#if defined(__CUDACC__)
  if (smem_bytes > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(smem_bytes));
    if (e != cudaSuccess) return e;
  }
  kernel<<<grid, block, smem_bytes, stream>>>(params);
  return cudaGetLastError();
#else
  (void)stream;
  return ::kvsim::launch(kernel, grid, block, smem_bytes, params);
#endif
}

}  // namespace kvattn
