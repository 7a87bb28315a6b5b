// Emulated __nv_bfloat16 for the SIMT emulation of the tests (docs/cuda_emulation.md): storage
// and the conversions the kernels use, in integer arithmetic on the bits. As with __half (see
// cuda_fp16.h), there is no implicit conversion or operator: the CUDA build defines
// __CUDA_NO_BFLOAT16_CONVERSIONS__.
#pragma once

#include <cstdint>
#include <cstring>

#include "simt/defines.h"

struct alignas(2) __nv_bfloat16 {
  unsigned short __x;
};

// Exact: a bfloat16 is the high half of a float.
__host__ __device__ inline float __bfloat162float(__nv_bfloat16 h) {
  const uint32_t bits = static_cast<uint32_t>(h.__x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Round to nearest, ties to even (large finite values round up to infinity as in IEEE); a NaN
// gives the canonical NaN 0x7fff, as the device's cvt.rn.bf16.f32 does.
__host__ __device__ inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  __nv_bfloat16 h;
  if ((x & 0x7fffffffu) > 0x7f800000u) {
    h.__x = 0x7fffu;
  } else {
    x += 0x7fffu + ((x >> 16) & 1u);
    h.__x = static_cast<uint16_t>(x >> 16);
  }
  return h;
}

__host__ __device__ inline __nv_bfloat16 __float2bfloat16(float f) {
  return __float2bfloat16_rn(f);
}
__host__ __device__ inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }
__host__ __device__ inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short x) {
  return __nv_bfloat16{x};
}
