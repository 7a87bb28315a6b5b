// Per-tensor sums of squares sum x^2 on CUDA (global gradient clipping, gradient noise scale): the
// two-stage deterministic reduction of Note [chunks], accumulated in float32 (float64 for float64
// input). Reads each element once; no copy of the tensors.
#include "multi_tensor_apply.cuh"

namespace fusedopt {
namespace cuda {
namespace {

// Partial sum of squares of one chunk. Table row: x.
template <typename T, typename S>
struct SqNorm {
  enum Row { kX, kRows };
  static constexpr int N = ilp_for<T, S>();
  T* partials;  // [chunks] workspace

  __device__ void operator()(const TensorTable<kRows>& t, int slot, int64_t begin, int count,
                             int64_t row) const {
    const S* x = chunk_ptr<const S>(t, kX, slot, begin);
    T acc[1] = {T(0)};
    for_each_group<N>(count, all_aligned(x), [&](int off, int n, bool vec) {
      T xr[N];
      load_group(xr, x, off, n, vec);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        if (k < n) acc[0] += xr[k] * xr[k];
      }
    });
    write_partials(acc, partials, row);
  }
};

template <typename T, typename S>
cudaError_t run(int64_t n, const int64_t* numel, void* const* data, T* out, T* partials,
                cudaStream_t stream) {
  using Op = SqNorm<T, S>;
  const Op op{partials};
  void* const* const lists[Op::kRows] = {data};
  return run_pass_with_norms<1, -1>(n, numel, lists, op, static_cast<const T*>(partials), out,
                                    nullptr, stream);
}

}  // namespace

cudaError_t launch_sq_norms(int64_t n, const int64_t* numel, void* const* data, DType dtype,
                            void* out, void* partials, cudaStream_t stream) {
  if (dtype == DType::kFloat64) {
    return run<double, double>(n, numel, data, static_cast<double*>(out),
                               static_cast<double*>(partials), stream);
  }
  return dispatch_fp32_compute(dtype, [&](auto tag) {
    using S = typename decltype(tag)::type;
    return run<float, S>(n, numel, data, static_cast<float*>(out), static_cast<float*>(partials),
                         stream);
  });
}

}  // namespace cuda
}  // namespace fusedopt
