// The launchers' entry point: turns a launch's runtime choices (element type, pool type, check
// flag, head-dim tile, copy width, score switches) into one kernel instantiation and enqueues it,
// or refuses one this module was not built with, naming the axis that is missing. The
// instantiations are the table of csrc/instantiations.py; a build compiles a selection of it
// (KVATTN_CUDA_DTYPES, KVATTN_CUDA_HEAD_DIMS, KVATTN_CUDA_VARIANTS) and Built<K> (launchers.h, the
// generated kvattn_built.h) says which. Included once by csrc/cuda/dispatch.cu (nvcc: no kernel
// is compiled there, the generated units hold them) and once by csrc/sim/kernels_sim.cpp (host
// compiler + harness, beside the kernels' definitions).
#pragma once

#include "launchers.h"
#include "plan.h"

namespace kvattn {

// The 16-bit element types of the tensor-core kernels (float32 pools run on the Triton backend).
template <class T>
constexpr bool kTensorCoreType = false;
template <>
constexpr bool kTensorCoreType<__half> = true;
template <>
constexpr bool kTensorCoreType<__nv_bfloat16> = true;

using DecodeLaunch = cudaError_t (*)(const DecodeParams&, cudaStream_t);
using ExtendLaunch = cudaError_t (*)(const ExtendParams&, cudaStream_t);

// &K::launch when this module has K, else null (K is then never instantiated here).
template <class K, class Launch>
constexpr Launch launcher_of() {
  if constexpr (Built<K>::value) return &K::launch;
  else return nullptr;
}

inline LaunchResult refuse(const char* launcher, const char* why) {
  return {static_cast<int>(cudaErrorInvalidValue), launcher, why};
}

#define KVATTN_NOT_BUILT(what) what " not built into this module (it has: " KVATTN_SELECTION ")"
// KVATTN_BUILT_HEAD_DIM_<d> of kvattn_selection.h for a macro's value d (the latent tile's).
#define KVATTN_BUILT_LATENT_(d) KVATTN_BUILT_LATENT__(d)
#define KVATTN_BUILT_LATENT__(d) KVATTN_BUILT_HEAD_DIM_##d

// Why a launch's instantiation is not in this module: the first axis of the build's selection
// that lacks it (a selection is a product over the axes: csrc/instantiations.py select()).
inline const char* not_built(DType dtype, KVType pool, int tile, bool variant) {
  const bool dtype_built = dtype == DType::kFloat16    ? KVATTN_BUILT_DTYPE_FP16
                           : dtype == DType::kBFloat16 ? KVATTN_BUILT_DTYPE_BF16
                           : dtype == DType::kE4M3     ? KVATTN_BUILT_DTYPE_E4M3
                           : dtype == DType::kE5M2     ? KVATTN_BUILT_DTYPE_E5M2
                                                       : KVATTN_BUILT_DTYPE_FP32;
  if (!dtype_built) return KVATTN_NOT_BUILT("dtype");
  if ((pool == KVType::kE4M3 && !KVATTN_BUILT_DTYPE_E4M3) || (pool == KVType::kE5M2 && !KVATTN_BUILT_DTYPE_E5M2))
    return KVATTN_NOT_BUILT("pool dtype");
#define KVATTN_TILE_NOT_BUILT(D, FIRST) \
  if (tile == D && !KVATTN_BUILT_HEAD_DIM_##D) return KVATTN_NOT_BUILT("head_dim " #FIRST ".." #D " (tile " #D ")");
  KVATTN_HEAD_DIM_TILES(KVATTN_TILE_NOT_BUILT)
#undef KVATTN_TILE_NOT_BUILT
  if (tile == kLatentDim && !KVATTN_BUILT_LATENT_(KVATTN_LATENT_DIM))
    return KVATTN_NOT_BUILT("head_dim " KVATTN_STR(KVATTN_LATENT_DIM) " (the MLA latent tile)");
  if (variant && !KVATTN_BUILT_VARIANTS) return KVATTN_NOT_BUILT("score switches (window, soft-cap, ALiBi, sinks, custom mask)");
  return KVATTN_NOT_BUILT("instantiation");
}

// Calls launch(TypeTag<T>{}) for the element type of `dtype`, refused in the name of `launcher`
// when unknown. The attention kernels run on 16-bit tensor cores: with `tensor_core_only`, float32
// is refused (the Triton backend runs it).
template <class Launch>
LaunchResult by_dtype(DType dtype, const char* launcher, bool tensor_core_only, Launch&& launch) {
  switch (dtype) {
    case DType::kFloat16:
      return launch(TypeTag<__half>{});
    case DType::kBFloat16:
      return launch(TypeTag<__nv_bfloat16>{});
    case DType::kFloat32:
      if (tensor_core_only) return refuse(launcher, "float32 is not supported (fp16/bf16 tensor cores)");
      return launch(TypeTag<float>{});
    default:
      break;
  }
  return refuse(launcher, "unknown dtype");
}

// ---- decode ----

template <class T, class KV, bool CHECK, bool VEC, bool VARIANT, bool VERDICT>
DecodeLaunch decode_of_tile(int tile) {
#define KVATTN_DECODE_TILE(D, FIRST) \
  case D:                             \
    return launcher_of<DecodeKernel<T, KV, D, CHECK, VEC, VARIANT, VERDICT>, DecodeLaunch>();
  switch (tile) {
    KVATTN_HEAD_DIM_TILES(KVATTN_DECODE_TILE)
    default: return launcher_of<DecodeKernel<T, KV, kLatentDim, CHECK, VEC, VARIANT, VERDICT>, DecodeLaunch>();
  }
#undef KVATTN_DECODE_TILE
}

// The instantiation of the copy width and the score switches (fp8 pools: 16-byte copies only,
// plan_decode refuses the others; a verdict is read by 16-byte copies only, and not by the latent
// tile); null when this module does not have it.
template <class T, class KV, bool CHECK, bool VERDICT>
DecodeLaunch pick_decode(const DecodeParams& p) {
  const int tile = padded_head_dim(p.head_dim);
  const bool variant = has_variant(p.var);
  if (kFp8Type<KV> || p.vec)
    return variant ? decode_of_tile<T, KV, CHECK, true, true, VERDICT>(tile)
                   : decode_of_tile<T, KV, CHECK, true, false, VERDICT>(tile);
  if constexpr (!kFp8Type<KV> && !VERDICT)
    return variant ? decode_of_tile<T, KV, CHECK, false, true, false>(tile)
                   : decode_of_tile<T, KV, CHECK, false, false, false>(tile);
  return nullptr;
}

template <class T, class KV, bool CHECK, bool VERDICT = false>
LaunchResult launch_decode(DecodeParams& p, DType dtype, cudaStream_t stream) {
  const char* refused = plan_decode<T, KV>(p);
  if (refused != nullptr) return refuse("paged_decode (launcher)", refused);
  const bool variant = has_variant(p.var);
  const DecodeLaunch kernel = pick_decode<T, KV, CHECK, VERDICT>(p);
  if (VERDICT && kernel == nullptr && (!p.vec || padded_head_dim(p.head_dim) == kLatentDim))
    return refuse("paged_decode (launcher)", "a verdict is read with 16-byte copies only, and not by the latent tile");
  const DecodeLaunch merge = variant ? launcher_of<MergeKernel<T, true>, DecodeLaunch>()
                                     : launcher_of<MergeKernel<T, false>, DecodeLaunch>();
  if (kernel == nullptr || (p.num_splits > 1 && merge == nullptr))
    return refuse("paged_decode (launcher)", not_built(dtype, p.kv_type, padded_head_dim(p.head_dim), variant));
  if (CHECK && (p.violations == nullptr || p.reasons == nullptr || p.pages_checked == nullptr ||
                p.beyond_table == nullptr || p.page_reasons == nullptr ||
                (!VERDICT && p.num_splits > 1 && p.part_report == nullptr)))
    return refuse("paged_decode (launcher)", "report buffers missing");
  if (VERDICT && p.verdict_fresh == nullptr) return refuse("paged_decode (launcher)", "verdict_fresh missing");
  cudaError_t e = kernel(p, stream);
  if (e != cudaSuccess) {
    return {static_cast<int>(e), CHECK ? "paged_decode_kernel<check=true>" : "paged_decode_kernel<check=false>",
            cudaGetErrorString(e)};
  }
  if (p.num_splits > 1) {
    DecodeParams m = p;
    if (!CHECK || VERDICT) m.violations = nullptr;  // the report needs no sum of the splits
    e = merge(m, stream);
    if (e != cudaSuccess) return {static_cast<int>(e), "merge_splits_kernel", cudaGetErrorString(e)};
  }
  return {0, nullptr, nullptr};
}

// Unchecked, checked call by call, or checked through a step's verdict (p.verdict given).
template <class T, class KV>
LaunchResult launch_decode_checked(DecodeParams& p, DType dtype, bool check, cudaStream_t stream) {
  if (!check) {
    if (p.verdict != nullptr) return refuse("paged_decode (launcher)", "a verdict with check=false");
    return launch_decode<T, KV, false>(p, dtype, stream);
  }
  return p.verdict != nullptr ? launch_decode<T, KV, true, true>(p, dtype, stream)
                              : launch_decode<T, KV, true, false>(p, dtype, stream);
}

LaunchResult paged_decode(DecodeParams& p, DType dtype, bool check, void* stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  return by_dtype(dtype, "paged_decode (launcher)", true, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (kTensorCoreType<T>) {
      switch (p.kv_type) {
        case KVType::kSame:
          return launch_decode_checked<T, T>(p, dtype, check, s);
        case KVType::kE4M3:
          return launch_decode_checked<T, Fp8E4M3>(p, dtype, check, s);
        case KVType::kE5M2:
          return launch_decode_checked<T, Fp8E5M2>(p, dtype, check, s);
        default:
          break;
      }
      return refuse("paged_decode (launcher)", "unknown pool dtype");
    }
    return refuse("paged_decode (launcher)", "unsupported dtype");
  });
}

// ---- extend ----

template <class T, bool CHECK, bool VEC, bool VARIANT>
ExtendLaunch extend_of_tile(int tile) {
#define KVATTN_EXTEND_TILE(D, FIRST) \
  case D:                             \
    return launcher_of<ExtendKernel<T, D, CHECK, VEC, VARIANT>, ExtendLaunch>();
  switch (tile) {
    KVATTN_HEAD_DIM_TILES(KVATTN_EXTEND_TILE)
    default: return nullptr;  // no extend tile (plan_extend refuses head dims over kMaxHeadDim)
  }
#undef KVATTN_EXTEND_TILE
}

template <class T, bool CHECK>
ExtendLaunch pick_extend(const ExtendParams& p) {
  const int tile = padded_head_dim(p.head_dim);
  const bool variant = has_variant(p.var);
  if (p.vec) return variant ? extend_of_tile<T, CHECK, true, true>(tile) : extend_of_tile<T, CHECK, true, false>(tile);
  return variant ? extend_of_tile<T, CHECK, false, true>(tile) : extend_of_tile<T, CHECK, false, false>(tile);
}

template <class T, bool CHECK>
LaunchResult launch_extend(ExtendParams& p, DType dtype, cudaStream_t stream) {
  const char* refused = plan_extend<T>(p);
  if (refused != nullptr) return refuse("paged_extend (launcher)", refused);
  const ExtendLaunch kernel = pick_extend<T, CHECK>(p);
  constexpr bool kResolve = Built<ResolvePagesKernel>::value;  // the checked launch's pre-pass
  if (kernel == nullptr || (CHECK && !kResolve))
    return refuse("paged_extend (launcher)",
                  not_built(dtype, p.kv_type, padded_head_dim(p.head_dim), has_variant(p.var)));
  if constexpr (CHECK && kResolve) {
    if (p.violations == nullptr || p.reasons == nullptr || p.pages_checked == nullptr || p.beyond_table == nullptr ||
        p.page_reasons == nullptr || p.effective == nullptr)
      return refuse("paged_extend (launcher)", "report buffers missing");
    const cudaError_t e = ResolvePagesKernel::launch(p, stream);
    if (e != cudaSuccess) return {static_cast<int>(e), "resolve_pages_kernel", cudaGetErrorString(e)};
  }
  const cudaError_t e = kernel(p, stream);
  if (e != cudaSuccess) {
    return {static_cast<int>(e), CHECK ? "paged_extend_kernel<check=true>" : "paged_extend_kernel<check=false>",
            cudaGetErrorString(e)};
  }
  return {0, nullptr, nullptr};
}

LaunchResult paged_extend(ExtendParams& p, DType dtype, bool check, void* stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  return by_dtype(dtype, "paged_extend (launcher)", true, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (kTensorCoreType<T>)
      return check ? launch_extend<T, true>(p, dtype, s) : launch_extend<T, false>(p, dtype, s);
    return refuse("paged_extend (launcher)", "unsupported dtype");
  });
}

// ---- the writer ----

template <class T, class KV>
LaunchResult launch_write_kv(const WriteKVParams& p, DType dtype, cudaStream_t stream) {
  if constexpr (Built<WriteKVKernel<T, KV>>::value) return WriteKVKernel<T, KV>::launch(p, stream);
  else return refuse("write_kv (launcher)", not_built(dtype, static_cast<KVType>(p.kv_dtype), 0, false));
}

// The tokens' type `dtype` into pools of the type kv_dtype names: the tokens' own, or an fp8
// format that float tokens are quantised into; fp8 tokens go into pools of their format only.
LaunchResult write_kv(const WriteKVParams& p, DType dtype, void* stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const auto pool = static_cast<KVType>(p.kv_dtype);
  if (dtype == DType::kE4M3 || dtype == DType::kE5M2) {
    if (pool != KVType::kSame) return refuse("write_kv (launcher)", "fp8 tokens are stored into pools of their format only");
    return dtype == DType::kE4M3 ? launch_write_kv<Fp8E4M3, Fp8E4M3>(p, dtype, s)
                                 : launch_write_kv<Fp8E5M2, Fp8E5M2>(p, dtype, s);
  }
  return by_dtype(dtype, "write_kv (launcher)", false, [&](auto tag) {
    using T = typename decltype(tag)::type;
    switch (pool) {
      case KVType::kSame: return launch_write_kv<T, T>(p, dtype, s);
      case KVType::kE4M3: return launch_write_kv<T, Fp8E4M3>(p, dtype, s);
      case KVType::kE5M2: return launch_write_kv<T, Fp8E5M2>(p, dtype, s);
      default: break;
    }
    return refuse("write_kv (launcher)", "unknown pool dtype");
  });
}

}  // namespace kvattn
