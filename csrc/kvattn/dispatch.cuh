// The launchers' entry point: picks the instantiation for a dtype and the check flag. Included once
// by csrc/cuda/kernels.cu (nvcc) and once by csrc/sim/kernels_sim.cpp (host compiler + harness).
#pragma once

#include "decode.cuh"
#include "extend.cuh"
#include "write_kv.cuh"

#ifndef KVATTN_HALF_ONLY
#define KVATTN_HALF_ONLY 0  // test builds of the harness compile one dtype to save build time
#endif

namespace kvattn {

template <class T>
struct TypeTag {
  using type = T;
};

// Calls launch(TypeTag<T>{}) for the element type of `dtype`; a dtype this module was not built
// with is refused in the name of `launcher`. The attention kernels run on 16-bit tensor cores:
// with `tensor_core_only`, float32 is refused (the Triton backend runs it).
template <class Launch>
LaunchResult by_dtype(DType dtype, const char* launcher, bool tensor_core_only, Launch&& launch) {
  switch (dtype) {
    case DType::kFloat16:
      return launch(TypeTag<__half>{});
#if !KVATTN_HALF_ONLY
    case DType::kBFloat16:
      return launch(TypeTag<__nv_bfloat16>{});
    case DType::kFloat32:
      if (tensor_core_only) return {static_cast<int>(cudaErrorInvalidValue), launcher, "float32 is not supported (fp16/bf16 tensor cores)"};
      return launch(TypeTag<float>{});
#endif
    default:
      break;
  }
  return {static_cast<int>(cudaErrorInvalidValue), launcher, "dtype not built into this module"};
}

LaunchResult paged_decode(DecodeParams& p, DType dtype, bool check, void* stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  return by_dtype(dtype, "paged_decode (launcher)", true, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (kTensorCoreType<T>) {
      switch (p.kv_type) {
        case KVType::kSame: return check ? launch_decode<T, T, true>(p, s) : launch_decode<T, T, false>(p, s);
#if !KVATTN_HALF_ONLY
        case KVType::kE4M3:
          return check ? launch_decode<T, Fp8E4M3, true>(p, s) : launch_decode<T, Fp8E4M3, false>(p, s);
        case KVType::kE5M2:
          return check ? launch_decode<T, Fp8E5M2, true>(p, s) : launch_decode<T, Fp8E5M2, false>(p, s);
#endif
        default: break;
      }
      return LaunchResult{static_cast<int>(cudaErrorInvalidValue), "paged_decode (launcher)",
                          "pool dtype not built into this module"};
    }
    return LaunchResult{static_cast<int>(cudaErrorInvalidValue), "paged_decode (launcher)", "unsupported dtype"};
  });
}

LaunchResult paged_extend(ExtendParams& p, DType dtype, bool check, void* stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  return by_dtype(dtype, "paged_extend (launcher)", true, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (kTensorCoreType<T>) return check ? launch_extend<T, true>(p, s) : launch_extend<T, false>(p, s);
    return LaunchResult{static_cast<int>(cudaErrorInvalidValue), "paged_extend (launcher)", "unsupported dtype"};
  });
}

LaunchResult write_kv(const WriteKVParams& p, DType dtype, void* stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  return by_dtype(dtype, "write_kv (launcher)", false, [&](auto tag) {
    using T = typename decltype(tag)::type;
    return launch_write_kv<T>(p, s);
  });
}

}  // namespace kvattn
