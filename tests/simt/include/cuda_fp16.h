// Emulated __half for the SIMT emulation of the tests (docs/cuda_emulation.md): storage and the
// conversions the kernels use, in integer arithmetic on the bits. The CUDA build defines
// __CUDA_NO_HALF_CONVERSIONS__ and __CUDA_NO_HALF_OPERATORS__ (torch's nvcc flags), so the kernels
// convert only through these functions; this __half has no implicit conversion or operator
// either, and code relying on one fails to compile here as it does there.
#pragma once

#include <cstdint>
#include <cstring>

#include "simt/defines.h"

struct alignas(2) __half {
  unsigned short __x;
};

// Exact: every half is a float. Infinities keep their sign; a NaN stays a NaN (quiet, its payload
// kept in the high mantissa bits).
__host__ __device__ inline float __half2float(__half h) {
  const uint32_t sign = static_cast<uint32_t>(h.__x & 0x8000u) << 16;
  const uint32_t exponent = (h.__x >> 10) & 0x1fu;
  const uint32_t mantissa = h.__x & 0x3ffu;
  uint32_t bits;
  if (exponent == 0x1fu) {
    bits = sign | 0x7f800000u | (mantissa != 0 ? 0x00400000u | (mantissa << 13) : 0u);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);  // rebias 15 -> 127
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal m * 2^-24: normalize so that the leading one is bit 10
    uint32_t m = mantissa;
    uint32_t e = 113;  // biased float exponent of 2^-14
    while ((m & 0x400u) == 0) {
      m <<= 1;
      --e;
    }
    bits = sign | (e << 23) | ((m & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Round to nearest, ties to even; overflow gives infinity (|x| >= 65520), underflow gradual
// (subnormal halves) down to 0. A NaN gives the canonical NaN 0x7fff, as the device's
// cvt.rn.f16.f32 does.
__host__ __device__ inline __half __float2half_rn(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  __half h;
  if (x > 0x7f800000u) {
    h.__x = 0x7fffu;
  } else if (x >= 0x477ff000u) {  // 65520 and above (infinity included) round to infinity
    h.__x = static_cast<uint16_t>(sign | 0x7c00u);
  } else if (x >= 0x38800000u) {  // normal half: drop 13 mantissa bits, rounding to even
    uint32_t r = x - 0x38000000u;  // rebias 127 -> 15
    r += 0x0fffu + ((r >> 13) & 1u);
    h.__x = static_cast<uint16_t>(sign | (r >> 13));
  } else {  // |x| < 2^-14: a multiple of 2^-24, rounded to even (0x400 is the smallest normal)
    const uint32_t exponent = x >> 23;
    const uint32_t mantissa = (x & 0x7fffffu) | (exponent != 0 ? 0x800000u : 0u);
    // |x| = mantissa * 2^(exponent - 150) = (mantissa >> shift) units of 2^-24, plus a rest
    const uint32_t shift = exponent != 0 ? 126u - exponent : 125u;
    uint32_t q = 0;
    if (shift < 32) {
      q = mantissa >> shift;
      const uint32_t rest = mantissa & ((1u << shift) - 1u);
      const uint32_t half = 1u << (shift - 1);
      if (rest > half || (rest == half && (q & 1u))) ++q;
    }
    h.__x = static_cast<uint16_t>(sign | q);
  }
  return h;
}

__host__ __device__ inline __half __float2half(float f) { return __float2half_rn(f); }
__host__ __device__ inline unsigned short __half_as_ushort(__half h) { return h.__x; }
__host__ __device__ inline __half __ushort_as_half(unsigned short x) { return __half{x}; }
