// The launchers' entry point: picks the instantiation for a dtype and the check flag. Included once
// by csrc/cuda/kernels.cu (nvcc) and once by csrc/sim/kernels_sim.cpp (host compiler + harness).
#pragma once

#include "decode.cuh"
#include "extend.cuh"
#include "write_kv.cuh"

#ifndef KVATTN_FP32_ONLY
#define KVATTN_FP32_ONLY 0  // test builds of the harness compile one dtype to save build time
#endif

namespace kvattn {

template <class T>
LaunchResult dispatch_check(DecodeParams& p, bool check, cudaStream_t stream) {
  return check ? launch_decode<T, true>(p, stream) : launch_decode<T, false>(p, stream);
}

LaunchResult paged_decode(DecodeParams& p, DType dtype, bool check, void* stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case DType::kFloat32:
      return dispatch_check<float>(p, check, s);
#if !KVATTN_FP32_ONLY
    case DType::kFloat16:
      return dispatch_check<__half>(p, check, s);
    case DType::kBFloat16:
      return dispatch_check<__nv_bfloat16>(p, check, s);
#endif
    default:
      break;
  }
  return {static_cast<int>(cudaErrorInvalidValue), "paged_decode (launcher)", "dtype not built into this module"};
}

template <class T>
LaunchResult dispatch_check(ExtendParams& p, bool check, cudaStream_t stream) {
  return check ? launch_extend<T, true>(p, stream) : launch_extend<T, false>(p, stream);
}

LaunchResult paged_extend(ExtendParams& p, DType dtype, bool check, void* stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case DType::kFloat32:
      return dispatch_check<float>(p, check, s);
#if !KVATTN_FP32_ONLY
    case DType::kFloat16:
      return dispatch_check<__half>(p, check, s);
    case DType::kBFloat16:
      return dispatch_check<__nv_bfloat16>(p, check, s);
#endif
    default:
      break;
  }
  return {static_cast<int>(cudaErrorInvalidValue), "paged_extend (launcher)", "dtype not built into this module"};
}

LaunchResult write_kv(const WriteKVParams& p, DType dtype, void* stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case DType::kFloat32:
      return launch_write_kv<float>(p, s);
#if !KVATTN_FP32_ONLY
    case DType::kFloat16:
      return launch_write_kv<__half>(p, s);
    case DType::kBFloat16:
      return launch_write_kv<__nv_bfloat16>(p, s);
#endif
    default:
      break;
  }
  return {static_cast<int>(cudaErrorInvalidValue), "write_kv (launcher)", "dtype not built into this module"};
}

}  // namespace kvattn
