// The warp-level building blocks of the attention kernels: 16-byte async copies global -> shared
// with zero-fill, ldmatrix, and the m16n8k16 tensor-core product with f32 accumulators. Under nvcc
// they are the PTX instructions; under the CPU harness (csrc/sim/simt.h) they run with the same
// per-lane fragment layouts and the latest completion the hardware allows.
//
// Fragments (g = lane / 4, t = lane % 4), for A 16x16 row-major, B 16x8 column-major, C/D 16x8:
//   a[0] = A[g][2t..2t+1]   a[1] = A[g+8][2t..2t+1]   a[2] = A[g][2t+8..2t+9]   a[3] = A[g+8][2t+8..]
//   b[0] = B[2t..2t+1][g]   b[1] = B[2t+8..2t+9][g]
//   c[0..1] = C[g][2t..2t+1]   c[2..3] = C[g+8][2t..2t+1]
// So the C fragments of two adjacent 8-column tiles, packed to 16 bits, are the A fragment of the
// 16x16 tile they form (the probabilities of QK^T become the A operand of P @ V in registers).
#pragma once

#include "compat.cuh"
#include "fp8.h"

#if defined(__CUDACC__)
#include <cuda_fp8.h>
#endif

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace kvattn {

// Copies 16 bytes from global `src` to shared `dst`; only the first `src_bytes` (0 or 16 here)
// are read, the rest is zero-filled. Both addresses 16-byte aligned (`src` even when 0 bytes).
KVATTN_DEVICE void cp_async_16(void* dst, const void* src, int src_bytes) {
#if defined(__CUDACC__)
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(src_bytes));
#else
  ::kvsim::cp_async_16(dst, src, src_bytes);
#endif
}

KVATTN_DEVICE void cp_async_commit() {
#if defined(__CUDACC__)
  asm volatile("cp.async.commit_group;\n" ::);
#else
  ::kvsim::cp_async_commit();
#endif
}

// Waits until at most `N` of this thread's committed copy groups are still in flight.
template <int N>
KVATTN_DEVICE void cp_async_wait() {
#if defined(__CUDACC__)
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#else
  ::kvsim::cp_async_wait(N);
#endif
}

// Four 8x8 b16 matrices; lanes 8i..8i+7 give the 16-byte rows of matrix i.
KVATTN_DEVICE void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
#if defined(__CUDACC__)
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
#else
  ::kvsim::ldmatrix<4>(r, row, false);
#endif
}

KVATTN_DEVICE void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
#if defined(__CUDACC__)
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
#else
  ::kvsim::ldmatrix<4>(r, row, true);
#endif
}

// d += A * B for one 16x16 (A) by 16x8 (B) tile, T = __half or __nv_bfloat16.
template <class T>
KVATTN_DEVICE void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

template <>
KVATTN_DEVICE void mma_16816<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDACC__)
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  const uint32_t b[2] = {b0, b1};
  ::kvsim::mma_m16n8k16<::kvsim::half_bits_to_float>(d, a, b, d);
#endif
}

template <>
KVATTN_DEVICE void mma_16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDACC__)
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  const uint32_t b[2] = {b0, b1};
  ::kvsim::mma_m16n8k16<::kvsim::bf16_bits_to_float>(d, a, b, d);
#endif
}

// 2^x by the special-function unit alone (ex2.approx.ftz): exp2f wraps it in a range fix-up, a
// compare and two multiplies, to keep results under 2^-126 subnormal. The softmax's weights are
// relative to their row's running maximum, whose own weight is 1: one flushed to 0 weighed under
// 2^-126 of it in the average of V rows the output is (FlashAttention's kernels flush them too).
// -inf gives 0, NaN stays NaN. The harness flushes as the unit does.
KVATTN_DEVICE float fast_exp2(float x) {
#if defined(__CUDACC__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
#else
  return ::kvsim::ex2_approx_ftz(x);
#endif
}

// Two floats rounded to T and packed, `lo` in the low 16 bits (the fragments' element order).
template <class T>
KVATTN_DEVICE uint32_t pack2(float lo, float hi) {
  const T l = from_float<T>(lo), h = from_float<T>(hi);
  uint16_t lb, hb;
  std::memcpy(&lb, &l, 2);
  std::memcpy(&hb, &h, 2);
  return static_cast<uint32_t>(lb) | static_cast<uint32_t>(hb) << 16;
}

// 4 bytes of shared memory at a 4-byte aligned address (the fp8 fragments are built from them).
KVATTN_DEVICE uint32_t load_shared_u32(const unsigned char* address) {
#if defined(__CUDACC__)
  return *reinterpret_cast<const uint32_t*>(address);
#else
  uint32_t w;
  std::memcpy(&w, address, 4);
  return w;
#endif
}

// __byte_perm(x, y, s) in its default mode: byte i of the result is byte (s >> 4i) & 7 of the
// 8 bytes y:x (x the low four).
KVATTN_DEVICE uint32_t byte_perm(uint32_t x, uint32_t y, uint32_t s) {
#if defined(__CUDACC__)
  return __byte_perm(x, y, s);
#else
  const uint64_t xy = static_cast<uint64_t>(y) << 32 | x;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= static_cast<uint32_t>((xy >> (8 * ((s >> (4 * i)) & 7u))) & 0xffu) << (8 * i);
  return r;
#endif
}

// The two fp8 values in the low 16 bits of `pair` (element 0 in the low byte) as two T packed like
// pack2: exactly, since every e4m3 and e5m2 value is a float16 and a bfloat16 value. On the
// device one cvt to f16x2 (sm_89 and later; cuda_fp8.h emulates it before), then for bf16 through
// float; on the harness the conversion of fp8.h.
template <class T, class KV>
KVATTN_DEVICE uint32_t fp8x2_to(uint32_t pair) {
#if defined(__CUDACC__)
  constexpr __nv_fp8_interpretation_t kFormat = std::is_same<KV, Fp8E4M3>::value ? __NV_E4M3 : __NV_E5M2;
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair & 0xffffu), kFormat);
  if constexpr (std::is_same<T, __half>::value) {
    return static_cast<uint32_t>(h.x) | static_cast<uint32_t>(h.y) << 16;
  } else {
    const __nv_bfloat162 b = __float22bfloat162_rn(__half22float2(__half2(h)));
    uint32_t r;
    std::memcpy(&r, &b, 4);
    return r;
  }
#else
  return pack2<T>(fp8_to_float(KV{static_cast<uint8_t>(pair & 0xffu)}),
                  fp8_to_float(KV{static_cast<uint8_t>((pair >> 8) & 0xffu)}));
#endif
}

}  // namespace kvattn
