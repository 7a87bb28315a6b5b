// C ABI of the SIMT emulation library, loaded by tests/test_cuda_emulated.py with ctypes: the
// launchers of csrc/cuda/launch.h (compiled from the real csrc/cuda/*.cu by the host compiler)
// with raw host pointers, the scheduler's knobs and counters, and the emulated fp16/bf16
// conversions. See docs/cuda_emulation.md.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "multi_tensor_apply.cuh"

#if defined(CUDART_VERSION) || defined(__CUDA_RUNTIME_H__) || defined(__CUDACC__)
#error "the toolkit's CUDA headers were found before tests/simt/include"
#endif

using fusedopt::LambHyper;
using fusedopt::LarsHyper;
using fusedopt::cuda::BucketPtrs;
using fusedopt::cuda::DeviceScalars;
using fusedopt::cuda::DType;

namespace {

// The launchers return the first error; a fault left behind would also show here.
int finish(cudaError_t err) {
  const cudaError_t last = cudaGetLastError();
  return static_cast<int>(err != cudaSuccess ? err : last);
}

template <int kRows>
int32_t capacity() {
  return fusedopt::cuda::TensorTable<kRows>::kMaxTensors;
}

}  // namespace

extern "C" {

// ------------------------------------------------------------------------------ launchers

int simt_launch_sq_norms(int64_t n, const int64_t* numel, void* const* data, int32_t dtype,
                         void* out, void* partials) {
  return finish(fusedopt::cuda::launch_sq_norms(n, numel, data, static_cast<DType>(dtype), out,
                                                partials, nullptr));
}

int simt_launch_lamb_pass1(const BucketPtrs* b, const LambHyper* h, const DeviceScalars* s,
                           void* sums, void* partials) {
  return finish(fusedopt::cuda::launch_lamb_pass1(*b, *h, *s, sums, partials, nullptr));
}

int simt_launch_lamb_pass2(const BucketPtrs* b, const LambHyper* h, const DeviceScalars* s,
                           const void* sums) {
  return finish(fusedopt::cuda::launch_lamb_pass2(*b, *h, *s, sums, nullptr));
}

int simt_launch_lars_pass1(const BucketPtrs* b, const LarsHyper* h, const DeviceScalars* s,
                           void* sums, void* partials) {
  return finish(fusedopt::cuda::launch_lars_pass1(*b, *h, *s, sums, partials, nullptr));
}

int simt_launch_lars_pass2(const BucketPtrs* b, const LarsHyper* h, const DeviceScalars* s,
                           const void* sums) {
  return finish(fusedopt::cuda::launch_lars_pass2(*b, *h, *s, sums, nullptr));
}

// The binding's dtype check (check_supported in csrc/cuda/bindings.cpp): nullptr or the reason.
const char* simt_unsupported_dtypes(const BucketPtrs* b) {
  return fusedopt::cuda::unsupported_dtypes(*b);
}

const char* simt_error_string(int err) { return cudaGetErrorString(static_cast<cudaError_t>(err)); }

// -------------------------------------------------------------------- sizes and layouts

int64_t simt_chunk_size() { return fusedopt::cuda::kChunkSize; }

int64_t simt_total_chunks(int64_t n, const int64_t* numel) {
  return fusedopt::cuda::total_chunks(n, numel);
}

// TensorTable<rows>::kMaxTensors: how many tensors one launch of a pass with `rows` lists takes.
int32_t simt_table_capacity(int32_t rows) {
  switch (rows) {
    case 1: return capacity<1>();
    case 2: return capacity<2>();
    case 3: return capacity<3>();
    case 4: return capacity<4>();
    case 5: return capacity<5>();
    case 6: return capacity<6>();
    default: return -1;
  }
}

// sizeof and offsetof of the structs the Python side mirrors, in a fixed order (the test checks
// its ctypes structures against them): returns how many values it wrote.
int32_t simt_layout(int64_t* out, int32_t cap) {
  const int64_t v[] = {
      sizeof(BucketPtrs),
      offsetof(BucketPtrs, n),
      offsetof(BucketPtrs, numel),
      offsetof(BucketPtrs, weights),
      offsetof(BucketPtrs, weight_dtype),
      offsetof(BucketPtrs, grads),
      offsetof(BucketPtrs, grad_dtype),
      offsetof(BucketPtrs, state1),
      offsetof(BucketPtrs, state2),
      offsetof(BucketPtrs, params),
      offsetof(BucketPtrs, param_dtype),
      offsetof(BucketPtrs, steps),
      offsetof(BucketPtrs, formats),
      offsetof(BucketPtrs, keys),
      sizeof(LambHyper),
      offsetof(LambHyper, lr),
      offsetof(LambHyper, beta1),
      offsetof(LambHyper, beta2),
      offsetof(LambHyper, beta3),
      offsetof(LambHyper, eps),
      offsetof(LambHyper, weight_decay),
      offsetof(LambHyper, bias_correction),
      offsetof(LambHyper, adapt),
      offsetof(LambHyper, decoupled),
      offsetof(LambHyper, bounded),
      offsetof(LambHyper, ratio_lo),
      offsetof(LambHyper, ratio_hi),
      offsetof(LambHyper, max_grad_norm),
      offsetof(LambHyper, one_minus_beta2),
      offsetof(LambHyper, lambda_in_u),
      offsetof(LambHyper, decoupled_lambda),
      sizeof(LarsHyper),
      offsetof(LarsHyper, lr),
      offsetof(LarsHyper, momentum),
      offsetof(LarsHyper, dampening),
      offsetof(LarsHyper, weight_decay),
      offsetof(LarsHyper, trust_coefficient),
      offsetof(LarsHyper, eps),
      offsetof(LarsHyper, nesterov),
      offsetof(LarsHyper, trust_clip),
      offsetof(LarsHyper, combined),
      offsetof(LarsHyper, lr_in_momentum),
      offsetof(LarsHyper, adapt),
      offsetof(LarsHyper, max_grad_norm),
      offsetof(LarsHyper, one_minus_dampening),
      sizeof(DeviceScalars),
      offsetof(DeviceScalars, grad_mult),
      offsetof(DeviceScalars, found_inf),
      offsetof(DeviceScalars, lr),
      sizeof(DType),
      sizeof(bool),
  };
  const int32_t n = static_cast<int32_t>(sizeof(v) / sizeof(v[0]));
  for (int32_t i = 0; i < n && i < cap; ++i) out[i] = v[i];
  return n;
}

// ------------------------------------------------------------------------------ scheduler

// threads, blocks: 0 forward, 1 reverse, 2 random (seeded; reshuffled every round / launch).
void simt_set_schedule(int32_t threads, int32_t blocks, uint64_t seed) {
  simt::set_schedule(static_cast<simt::Order>(threads), static_cast<simt::Order>(blocks), seed);
}

void simt_reset_stats() { simt::reset_stats(); }

// launches, blocks, threads, resumes, block barriers, warp shuffles
void simt_stats(int64_t* out) {
  const simt::Stats s = simt::stats();
  const int64_t v[] = {s.launches, s.blocks, s.threads, s.resumes, s.block_barriers,
                       s.warp_shuffles};
  for (int i = 0; i < 6; ++i) out[i] = v[i];
}

const char* simt_launch_log() { return simt::launch_log(); }

const char* simt_fault_message() { return simt::fault_message(); }

// ---------------------------------------------------------------------------- conversions

void simt_half_to_float(const uint16_t* in, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = __half2float(__ushort_as_half(in[i]));
}

void simt_float_to_half(const float* in, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = __half_as_ushort(__float2half_rn(in[i]));
}

void simt_bfloat16_to_float(const uint16_t* in, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = __bfloat162float(__ushort_as_bfloat16(in[i]));
}

void simt_float_to_bfloat16(const float* in, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = __bfloat16_as_ushort(__float2bfloat16_rn(in[i]));
}

}  // extern "C"
