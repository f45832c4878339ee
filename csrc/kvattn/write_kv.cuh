// The stamping writer: kvattn.writers.write_kv (its docstring is the specification) as two kernels.
//
// write_kv_verdict_kernel, one thread per token: in range, held by the writer's owner, and the
// token's run (consecutive held tokens filling consecutive slots of one page) starting at or below
// the page's written prefix. Every verdict reads the tags as they were before the call, because
// no stamp happens until the second kernel: a run can never be let in by a stamp of the same call.
// write_kv_copy_kernel, one block per token: copies a landed token's K and V, then stamps its page
// WRITTEN with valid_len = slot + 1 by an atomic max (tags of one owner only grow), after a fence,
// so a reader that sees the stamp sees the bytes. Into fp8 pools from wider tokens it stores each
// element's code (fp8.h fp8_from_float) of x / scale of its head; fp8 tokens are stored as they are.
#pragma once

#include <type_traits>

#include "compat.cuh"
#include "fp8.h"
#include "kvattn_tags.h"
#include "launchers.h"
#include "params.h"
#include "tag_rule.cuh"

namespace kvattn {

constexpr int kWriteThreads = 128;

struct WriteToken {
  int64_t page, slot;
  bool padding, in_range, held;
  int64_t prefix;  // the page's written prefix before the call
};

KVATTN_DEVICE WriteToken write_token(const WriteKVParams& p, int64_t t) {
  WriteToken w;
  const int64_t s = p.slot_is_int64 ? static_cast<const int64_t*>(p.slot_mapping)[t * p.stride_slot]
                                    : static_cast<const int32_t*>(p.slot_mapping)[t * p.stride_slot];
  w.padding = s < 0;
  w.page = s / p.page_size;  // floor division for the non-negative ids that matter
  w.slot = s - w.page * p.page_size;
  w.in_range = !w.padding && w.page < p.num_pages;
  const int64_t tag = w.in_range ? p.page_tags[w.page] : 0;
  w.held = w.in_range && held_by(tag, p.owners[t * p.stride_owner]);
  w.prefix = w.held && (tag & tags::STATE_MASK) == tags::STATE_WRITTEN ? tag_valid_len(tag) : 0;
  return w;
}

__global__ void __launch_bounds__(kWriteThreads) write_kv_verdict_kernel(const WriteKVParams p) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWriteThreads + threadIdx.x;
  if (t >= p.num_tokens) return;
  const WriteToken me = write_token(p, t);
  // Walk back to the first token of this token's run; a run stays in one page, so this takes at
  // most page_size - 1 steps.
  WriteToken first = me;
  for (int64_t j = t; j > 0; --j) {
    const WriteToken prev = write_token(p, j - 1);
    if (!(first.held && prev.held && prev.page == first.page && first.slot == prev.slot + 1)) break;
    first = prev;
  }
  const bool landed = me.held && first.slot <= me.prefix;
  int reason = 0;
  if (!me.padding) {
    if (!me.in_range) reason = static_cast<int>(tags::WriteDrop_OUT_OF_RANGE);
    else if (!me.held) reason = static_cast<int>(tags::WriteDrop_NOT_HELD);
    else if (!landed) reason = static_cast<int>(tags::WriteDrop_GAP);
  }
  p.landed[t] = landed ? 1 : 0;
  p.drop_reasons[t] = static_cast<int8_t>(reason);
  if (reason) atomicAdd(p.dropped, 1ULL);
}

// A pool element from token element x of KV head h: x itself in a pool of its type; into an fp8 pool
// from a wider type, the code of x / scale[h], the correctly rounded float32 quotient.
template <class KV, class T>
KVATTN_DEVICE KV pool_element(T x, const float* scale, int h, bool toward_zero) {
  if constexpr (std::is_same<KV, T>::value) return x;
  else return fp8_from_float<KV>(to_float(x) / scale[h], toward_zero);
}

// T: the tokens' element type; KV: the pools' (T, or an fp8 format to quantise into).
template <class T, class KV>
__global__ void __launch_bounds__(kWriteThreads) write_kv_copy_kernel(const WriteKVParams p) {
  const int64_t t = blockIdx.x;
  if (!p.landed[t]) return;  // uniform across the block: no thread reaches the barrier below
  const WriteToken me = write_token(p, t);
  const T* k = static_cast<const T*>(p.k) + t * p.stride_kt;
  const T* v = static_cast<const T*>(p.v) + t * p.stride_vt;
  KV* k_dst = static_cast<KV*>(p.k_cache) + me.page * p.stride_kp + me.slot * p.stride_ks;
  KV* v_dst = static_cast<KV*>(p.v_cache) + me.page * p.stride_vp + me.slot * p.stride_vs;
  const bool toward_zero = p.toward_zero != 0;
  for (int i = threadIdx.x; i < p.num_kv_heads * p.head_dim; i += kWriteThreads) {
    const int h = i / p.head_dim;
    const int d = i % p.head_dim;
    k_dst[h * p.stride_kch + d] = pool_element<KV>(k[h * p.stride_kh + d * p.stride_kd], p.k_scale, h, toward_zero);
  }
  for (int i = threadIdx.x; i < p.num_kv_heads * p.head_dim_v; i += kWriteThreads) {
    const int h = i / p.head_dim_v;
    const int d = i % p.head_dim_v;
    v_dst[h * p.stride_vch + d] = pool_element<KV>(v[h * p.stride_vh + d * p.stride_vd], p.v_scale, h, toward_zero);
  }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const int64_t owner = p.owners[t * p.stride_owner];
    const long long stamp = static_cast<long long>((owner << tags::OWNER_SHIFT) |
                                                   ((me.slot + 1) << tags::VALID_LEN_SHIFT) | tags::STATE_WRITTEN);
    atomicMax(reinterpret_cast<long long*>(&p.page_tags[me.page]), stamp);
  }
}

// The launcher of csrc/kvattn/launchers.h. write_kv_verdict_kernel is not a template: this header
// is included by exactly one translation unit of a module.
template <class T, class KV>
LaunchResult WriteKVKernel<T, KV>::launch(const WriteKVParams& p, cudaStream_t stream) {
  if (p.num_tokens <= 0) return {0, nullptr, nullptr};
  if (p.num_tokens > 0x7fffffff) return {static_cast<int>(cudaErrorInvalidValue), "write_kv (launcher)", "too many tokens"};
  if (!std::is_same<T, KV>::value && (p.k_scale == nullptr || p.v_scale == nullptr))
    return {static_cast<int>(cudaErrorInvalidValue), "write_kv (launcher)", "quantising into fp8 pools needs k_scale and v_scale"};
  const unsigned blocks = static_cast<unsigned>((p.num_tokens + kWriteThreads - 1) / kWriteThreads);
  cudaError_t e = launch_kernel(&write_kv_verdict_kernel, dim3(blocks), dim3(kWriteThreads), 0, stream, p);
  if (e != cudaSuccess) return {static_cast<int>(e), "write_kv_verdict_kernel", cudaGetErrorString(e)};
  e = launch_kernel(&write_kv_copy_kernel<T, KV>, dim3(static_cast<unsigned>(p.num_tokens)), dim3(kWriteThreads), 0,
                    stream, p);
  if (e != cudaSuccess) return {static_cast<int>(e), "write_kv_copy_kernel", cudaGetErrorString(e)};
  return {0, nullptr, nullptr};
}

}  // namespace kvattn
