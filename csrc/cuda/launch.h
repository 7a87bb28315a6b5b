// The interface between the torch binding (bindings.cpp) and the CUDA kernels (lamb.cu, lars.cu,
// norms.cu): raw device pointers, host-side sizes, dtypes and the hyper-parameter structs of
// fusedopt/math.h. Nothing here depends on torch, so the .cu files compile without its headers.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "fusedopt/math.h"

namespace fusedopt {
namespace cuda {

enum class DType : int32_t { kFloat32, kFloat16, kBFloat16, kFloat64 };

// Note [chunks]: every tensor is cut into chunks of kChunkSize elements counted from its first
// element (the last chunk is shorter; a 0-size tensor has none). One thread block handles one
// chunk; a pass that needs norms writes the chunk's partial sums of squares to the chunk's own
// row of a workspace, and a second kernel adds the rows of each tensor in chunk order. The
// partition, the order inside a block and the order of the rows depend only on the tensor sizes,
// so the norms are bit-identical from run to run and never use float atomics.
constexpr int64_t kChunkSize = 65536;

inline int64_t num_chunks(int64_t numel) { return (numel + kChunkSize - 1) / kChunkSize; }

// Rows of partial sums a pass needs in its workspace: one per chunk of every tensor.
inline int64_t total_chunks(int64_t n, const int64_t* numel) {
  int64_t c = 0;
  for (int64_t i = 0; i < n; ++i) c += num_chunks(numel[i]);
  return c;
}

// The tensors of one bucket as device pointers; entry i of every list belongs to param i, and all
// of them hold numel[i] elements laid out alike (each is walked as a flat array from its pointer).
struct BucketPtrs {
  int64_t n;
  const int64_t* numel;  // host array [n]
  void* const* weights;  // w: the fp32 masters when present, else the params
  DType weight_dtype;
  void* const* grads;    // gradients (nullptr for a pass that reads none)
  DType grad_dtype;
  void* const* state1;   // exp_avgs (LAMB) or momentum_buffers (LARS), compute dtype
  void* const* state2;   // exp_avg_sqs (LAMB), compute dtype
  void* const* params;   // bf16/fp16 params written beside fp32 masters in pass 2, else nullptr
  DType param_dtype;
  float* const* steps;   // 0-dim float32 step counts
  // Note [state formats] in fusedopt/math.h: the StateFormat of each param's state (host array
  // [n]; bf16 state as 16-bit words, 8-bit state packed as q8_packed_numel bytes), or nullptr:
  // all full (the compute dtype). Low-precision state needs float32 compute.
  const unsigned char* formats;
  // The key of each param's random bits (LAMB pass 1: sr_base of its step count and key; host
  // array [n]), or nullptr: its index in the lists.
  const int64_t* keys;
};

// Why the kernels have no build for a bucket's dtypes, or nullptr: float64 weights with float64
// grads; float32 params with float32/bfloat16/float16 grads; bfloat16/float16 params (with or
// without fp32 masters) with grads of their own dtype or float32. Pass 1 is given no params, so
// there float32 weights (params or masters) take any of the three grad dtypes.
inline const char* unsupported_dtypes(const BucketPtrs& b) {
  const bool wide = b.weight_dtype == DType::kFloat64;
  if (b.grads != nullptr && wide != (b.grad_dtype == DType::kFloat64))
    return "float64 weights need float64 grads, and other weights non-float64 grads";
  if (b.params != nullptr &&
      !(b.weight_dtype == DType::kFloat32 &&
        (b.param_dtype == DType::kFloat16 || b.param_dtype == DType::kBFloat16)))
    return "master weights are float32 copies of bfloat16/float16 params";
  const DType stored = b.params != nullptr ? b.param_dtype : b.weight_dtype;
  if (b.grads != nullptr && b.grad_dtype != stored && b.grad_dtype != DType::kFloat32 &&
      !(b.params == nullptr && b.weight_dtype == DType::kFloat32))
    return "bfloat16/float16 params need grads of their own dtype or float32";
  return nullptr;
}

// Scalars of a step that stay on the device: the kernels read them, the host never does.
struct DeviceScalars {
  const void* grad_mult;   // 0-dim, compute dtype: every g is read as g * grad_mult (nullptr: 1)
  const float* found_inf;  // 0-dim float32: nonzero makes the whole pass a no-op (nullptr: 0)
  const double* lr;        // 0-dim float64 learning rate replacing the hyper's lr (nullptr: none)
};

// Per-tensor sums of squares out[i] = sum x^2 (compute dtype: float64 for float64 input, float32
// otherwise). partials: total_chunks(n, numel) elements of that dtype.
cudaError_t launch_sq_norms(int64_t n, const int64_t* numel, void* const* data, DType dtype,
                            void* out, void* partials, cudaStream_t stream);

// LAMB pass 1: steps += 1, m and v updated, sums[i] = (|w|^2, |u|^2) ([n, 2], compute dtype).
// partials: 2 * total_chunks(n, numel) elements of the compute dtype.
cudaError_t launch_lamb_pass1(const BucketPtrs& b, const LambHyper& h, const DeviceScalars& s,
                              void* sums, void* partials, cudaStream_t stream);

// LAMB pass 2: trust ratios from sums ([n, 2], compute dtype), w (and params) updated.
cudaError_t launch_lamb_pass2(const BucketPtrs& b, const LambHyper& h, const DeviceScalars& s,
                              const void* sums, cudaStream_t stream);

// LARS pass 1: steps += 1, sums[i] = (|w|^2, |g|^2) or (|w|^2, |g + lambda*w|^2) when combined.
cudaError_t launch_lars_pass1(const BucketPtrs& b, const LarsHyper& h, const DeviceScalars& s,
                              void* sums, void* partials, cudaStream_t stream);

// LARS pass 2: trust ratios from sums, momentum buffers and w (and params) updated.
cudaError_t launch_lars_pass2(const BucketPtrs& b, const LarsHyper& h, const DeviceScalars& s,
                              const void* sums, cudaStream_t stream);

}  // namespace cuda
}  // namespace fusedopt
