"""fp8 encoding as integer arithmetic on float32 bits, for the stamping writer.

Triton's own ``.to(tl.float8e4nv / tl.float8e5)`` is not usable here: under the Triton 3.9
interpreter it rounds values below the formats' normal range differently from torch (fp32 and
bf16 sources flush fp8 subnormals to zero, fp16 sources turn tiny values into nonzero codes).
Computing the code from the float32 bit pattern with integer operations keeps this writer's bytes
equal to the torch writer's, interpreted or compiled: round to nearest, ties to even, subnormals
included.
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from ...variants import FP8_MAX


def fp8_format(dtype: torch.dtype) -> tuple[int, int, int]:
    """``(mantissa bits, exponent bias, float32 bits of the largest finite value)`` of ``dtype``."""
    mant, bias = {torch.float8_e4m3fn: (3, 7), torch.float8_e5m2: (2, 15)}[dtype]
    return mant, bias, struct.unpack("<i", struct.pack("<f", FP8_MAX[dtype]))[0]


@triton.jit
def exact_float32(x):
    """``x`` as float32, exactly. A bfloat16 is the upper half of a float32's bits, so its bits are
    shifted into place: the Triton interpreter's conversion gets bfloat16 subnormals wrong (it
    turned -6.4e-40 into -8.8e-39), which a small scale then lifts into nonzero codes. Compiled
    for sm_90 the conversion (``cvt.f32.bf16``) is exact as well, so both paths store the same
    bytes."""
    if x.dtype.is_bf16():
        return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def fp8_bits(
    x,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    MAX_BITS: tl.constexpr,
    TOWARD_ZERO: tl.constexpr = False,
):
    """The fp8 code (uint8) of float32 ``x``: saturated to the largest finite value (``MAX_BITS``,
    its float32 bit pattern), then rounded to nearest even with NaN as the positive NaN 0x7f; or,
    ``TOWARD_ZERO``, truncated with NaN as the positive largest finite value and a quotient
    below float32's normal range as +0."""
    u = x.to(tl.int32, bitcast=True)
    sign = (u >> 31) & 1
    a = u & 0x7FFFFFFF
    nan = a > 0x7F800000
    # Positive floats order like their bit patterns, so saturation is an integer minimum.
    a = tl.minimum(a, MAX_BITS)
    exp = a >> 23
    e_t = exp - (127 - BIAS)  # the exponent field in the fp8 format, < 1 below its normal range
    normal = e_t >= 1
    # Normal: rebias the exponent and drop 23 - MANT mantissa bits (a carry rolls into the
    # exponent, as it must). Subnormal: shift the significand with its implicit bit further right;
    # past 31 bits everything is dropped (float32 subnormals included), which rounds to zero.
    v = tl.where(normal, a - ((127 - BIAS) << 23), (a & 0x7FFFFF) | 0x800000)
    v = tl.where(exp == 0, 0, v)
    shift = tl.where(normal, 23 - MANT, tl.minimum(24 - MANT - e_t, 31))
    q = v >> shift
    if TOWARD_ZERO:
        # The dropped bits are the truncation. A quotient below float32's normal range is +0
        # whether or not the division flushed it, and NaN, saturated above, the positive maximum.
        sign = tl.where(nan | (a < 0x800000), 0, sign)
        bits = q | (sign << 7)
    else:
        rem = v & ((1 << shift) - 1)
        half = 1 << (shift - 1)
        q = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
        bits = tl.where(nan, 0x7F, q | (sign << 7))
    return bits.to(tl.uint8)
