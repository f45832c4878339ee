// The fp8 pool elements (kvattn.variants: float8_e4m3fn and float8_e5m2 k_cache/v_cache), their
// exact conversion to float and the writers' encoding: plain C++, so the binding (csrc/module.cpp),
// the CPU harness and the tests (tests/backends/test_cuda_fp8.py, all 256 bytes of each format
// against torch) use one definition.
// On the device the kernels convert pairs with cvt.rn.f16x2.{e4m3,e5m2}x2 (cuda_fp8.h), which is
// exact as well: every e4m3 and e5m2 value is a float16 value.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define KVATTN_FP8_FN __host__ __device__ inline
#else
#define KVATTN_FP8_FN inline
#endif

namespace kvattn {

// One byte each in the pools; distinct types so that the kernels' cache element type selects the
// fp8 path (the format is the type).
struct Fp8E4M3 {
  uint8_t bits;
};
struct Fp8E5M2 {
  uint8_t bits;
};

KVATTN_FP8_FN float fp8_float_from_bits(uint32_t bits) {
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

// e4m3fn: bias 7, no infinity, S.1111.111 the only NaN (so the largest value is 448), subnormals
// m * 2**-9.
KVATTN_FP8_FN float e4m3_to_float(uint8_t x) {
  const uint32_t sign = static_cast<uint32_t>(x & 0x80u) << 24;
  const uint32_t e = (x >> 3) & 0xfu, m = x & 0x7u;
  if (e == 0xfu && m == 0x7u) return fp8_float_from_bits(sign | 0x7fc00000u);
  if (e == 0) {
    // m * 2**-9 is exact in float; the sign is set on the bits so that 0x80 gives -0.0.
    uint32_t bits;
    const float v = static_cast<float>(m) * 0.001953125f;
    memcpy(&bits, &v, 4);
    return fp8_float_from_bits(bits | sign);
  }
  return fp8_float_from_bits(sign | ((e + 120u) << 23) | (m << 20));
}

// e5m2: bias 15 with IEEE infinities and NaNs (exponent 31), subnormals m * 2**-16.
KVATTN_FP8_FN float e5m2_to_float(uint8_t x) {
  const uint32_t sign = static_cast<uint32_t>(x & 0x80u) << 24;
  const uint32_t e = (x >> 2) & 0x1fu, m = x & 0x3u;
  if (e == 0x1fu) return fp8_float_from_bits(sign | (m == 0 ? 0x7f800000u : 0x7fc00000u));
  if (e == 0) {
    uint32_t bits;
    const float v = static_cast<float>(m) * 0.0000152587890625f;
    memcpy(&bits, &v, 4);
    return fp8_float_from_bits(bits | sign);
  }
  return fp8_float_from_bits(sign | ((e + 112u) << 23) | (m << 21));
}

KVATTN_FP8_FN float fp8_to_float(Fp8E4M3 x) { return e4m3_to_float(x.bits); }
KVATTN_FP8_FN float fp8_to_float(Fp8E5M2 x) { return e5m2_to_float(x.bits); }

// The fields of a format the encoder needs: mantissa bits, exponent bias, and the float32 bits of
// the largest finite value (448 for e4m3fn, 57344 for e5m2).
template <class KV>
struct Fp8Format;
template <>
struct Fp8Format<Fp8E4M3> {
  static constexpr int kMant = 3, kBias = 7;
  static constexpr uint32_t kMaxBits = 0x43e00000u;
};
template <>
struct Fp8Format<Fp8E5M2> {
  static constexpr int kMant = 2, kBias = 15;
  static constexpr uint32_t kMaxBits = 0x47600000u;
};

// The fp8 code of float32 x by the writers' rule (kvattn.write_kv's docstring): saturated to the
// largest finite value, then rounded to nearest even with NaN as the positive NaN 0x7f; or,
// toward_zero (vLLM's CPU cache writer), truncated with NaN as the positive largest finite value
// and anything below float32's normal range as +0. Integer arithmetic on the float's bits, step for
// step that of the Triton writer (kvattn/backends/triton/fp8.py fp8_bits), so every writer stores
// the same bytes whatever the device's own conversions do with subnormals.
template <class KV>
KVATTN_FP8_FN KV fp8_from_float(float x, bool toward_zero) {
  using F = Fp8Format<KV>;
  uint32_t u;
  memcpy(&u, &x, 4);
  uint32_t sign = u >> 31;
  uint32_t a = u & 0x7fffffffu;
  const bool nan = a > 0x7f800000u;
  // Positive floats order like their bit patterns, so saturation is an integer minimum.
  a = a < F::kMaxBits ? a : F::kMaxBits;
  const int exp = static_cast<int>(a >> 23);
  const int e_t = exp - (127 - F::kBias);  // the exponent field in fp8, < 1 below its normal range
  const bool normal = e_t >= 1;
  // Normal: rebias the exponent and drop 23 - kMant mantissa bits (a carry rolls into the exponent,
  // as it must). Subnormal: shift the significand with its implicit bit further right; past 31
  // bits everything is dropped (float32 subnormals included), which rounds to zero.
  uint32_t v = normal ? a - (static_cast<uint32_t>(127 - F::kBias) << 23) : ((a & 0x7fffffu) | 0x800000u);
  if (exp == 0) v = 0;
  const int below = 24 - F::kMant - e_t;
  const int shift = normal ? 23 - F::kMant : (below < 31 ? below : 31);
  uint32_t q = v >> shift;
  if (toward_zero) {
    if (nan || a < 0x800000u) sign = 0;
    return KV{static_cast<uint8_t>(q | (sign << 7))};
  }
  const uint32_t rem = v & ((1u << shift) - 1u), half = 1u << (shift - 1);
  q += (rem > half || (rem == half && (q & 1u))) ? 1u : 0u;
  return KV{static_cast<uint8_t>(nan ? 0x7fu : (q | (sign << 7)))};
}

// The pool element types of the launchers (kv_dtype in the binding): the query's type, or fp8.
enum class KVType : int { kSame = 0, kE4M3 = 1, kE5M2 = 2 };

}  // namespace kvattn
