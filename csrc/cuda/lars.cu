// LARS on CUDA (docs/math.md, the form of the Paddle lars_momentum kernel), two passes per bucket:
//   pass 1  sums = (|w|^2, |g|^2) per tensor, or (|w|^2, |g + lambda*w|^2) for "combined"
//   pass 2  ratio = kappa*|w| / (|g| + lambda*|w| + eps)  or  kappa*|w| / (|g + lambda*w| + eps)
//           (zero-norm rule, trust_clip, adapt) ;  d = ratio*(g + lambda*w) ;  momentum ;  w -= step
// Memory traffic per element is docs/math.md's 28 B for fp32: pass 1 reads w, g; pass 2 reads w, g, v
// and writes w, v.
//
// Note [shared math]: the trust ratio, the per-tensor coefficients and the per-element update are
// calls into fusedopt/math.h (lars_trust_ratio, lars_coef, lars_apply), the header the C++ CPU
// backend uses too and that its tests exercise on the host against the float64 reference. The
// only arithmetic written here is the quantity whose norm pass 1 needs (g, or g + lambda*w, the
// same expression as lars_apply's d before the ratio).
#include "multi_tensor_apply.cuh"

namespace fusedopt {
namespace cuda {
namespace {

// Pass 1 of one chunk. Table rows: w, g, step (the step is advanced by the reduction).
template <typename T, typename W, typename G>
struct LarsPass1 {
  enum Row { kW, kG, kStep, kRows };
  static constexpr int N = ilp_for<T, W, G>();
  LarsHyper h;
  const T* grad_mult;      // 0-dim or nullptr
  const float* found_inf;  // 0-dim or nullptr
  T* partials;             // [chunks, 2] workspace

  __device__ void operator()(const TensorTable<kRows>& t, int slot, int64_t begin, int count,
                             int64_t row) const {
    T acc[2] = {T(0), T(0)};
    if (!step_skipped(found_inf)) {
      const W* w = chunk_ptr<const W>(t, kW, slot, begin);
      const G* g = chunk_ptr<const G>(t, kG, slot, begin);
      const T gm = grad_mult != nullptr ? *grad_mult : T(1);
      const bool combined = h.combined;
      const T lambda = static_cast<T>(h.weight_decay);
      for_each_group<N>(count, all_aligned(w, g), [&](int off, int n, bool vec) {
        T wr[N], gr[N];
        load_group(wr, w, off, n, vec);
        load_group(gr, g, off, n, vec);
#pragma unroll
        for (int k = 0; k < N; ++k) {
          const T gk = gr[k] * gm;
          const T d = combined ? gk + lambda * wr[k] : gk;  // lars_apply's d before the ratio
          if (k < n) {
            acc[0] += wr[k] * wr[k];
            acc[1] += d * d;
          }
        }
      });
    }
    write_partials(acc, partials, row);
  }
};

// Pass 2 of one chunk. Table rows: w, g, momentum buffer, [param,] step.
template <typename T, typename W, typename G, typename P>
struct LarsPass2 {
  static constexpr bool kHasParam = !std::is_same<P, NoParam>::value;
  enum Row { kW, kG, kBuf, kP, kStep = kHasParam ? 4 : 3, kRows = kStep + 1 };
  static constexpr int N = kHasParam ? ilp_for<T, W, G, P>() : ilp_for<T, W, G>();
  struct Scalars {
    LarsCoef<T> c;
    T gm;
  };
  LarsHyper h;
  const T* sums;           // [n, 2] from pass 1 (possibly all-reduced)
  const T* grad_mult;      // 0-dim or nullptr
  const float* found_inf;  // 0-dim or nullptr
  const double* lr;        // 0-dim or nullptr

  __device__ void operator()(const TensorTable<kRows>& t, int slot, int64_t begin, int count,
                             int64_t) const {
    if (step_skipped(found_inf)) return;  // the same for every thread of the block
    const Scalars sc = block_broadcast<Scalars>([&] {
      LarsHyper hl = h;
      if (lr != nullptr) hl.lr = *lr;
      const int64_t i = t.index[slot];
      const T ratio = lars_trust_ratio<T>(sums[2 * i], sums[2 * i + 1], hl);
      const float step = *static_cast<const float*>(t.ptrs[kStep][slot]);
      return Scalars{lars_coef<T>(hl, ratio, step), grad_mult != nullptr ? *grad_mult : T(1)};
    });
    W* w = chunk_ptr<W>(t, kW, slot, begin);
    const G* g = chunk_ptr<const G>(t, kG, slot, begin);
    T* buf = chunk_ptr<T>(t, kBuf, slot, begin);
    P* p = nullptr;
    if constexpr (kHasParam) p = chunk_ptr<P>(t, kP, slot, begin);
    const bool aligned = kHasParam ? all_aligned(w, g, buf, p) : all_aligned(w, g, buf);
    for_each_group<N>(count, aligned, [&](int off, int n, bool vec) {
      T wr[N], gr[N], vr[N];
      load_group(wr, w, off, n, vec);
      load_group(gr, g, off, n, vec);
      load_group(vr, buf, off, n, vec);
#pragma unroll
      for (int k = 0; k < N; ++k) wr[k] = lars_apply<T>(wr[k], gr[k] * sc.gm, vr[k], sc.c);
      store_group(buf, vr, off, n, vec);
      store_group(w, wr, off, n, vec);
      if constexpr (kHasParam) store_group(p, wr, off, n, vec);
    });
  }
};

template <typename T, typename W, typename G>
cudaError_t run_pass1(const BucketPtrs& b, const LarsHyper& h, const DeviceScalars& s, T* sums,
                      T* partials, cudaStream_t stream) {
  using Op = LarsPass1<T, W, G>;
  const Op op{h, static_cast<const T*>(s.grad_mult), s.found_inf, partials};
  void* const* const lists[Op::kRows] = {b.weights, b.grads,
                                         reinterpret_cast<void* const*>(b.steps)};
  return run_pass_with_norms<2, Op::kStep>(b.n, b.numel, lists, op,
                                            static_cast<const T*>(partials), sums, s.found_inf,
                                            stream);
}

template <typename T, typename W, typename G, typename P>
cudaError_t run_pass2(const BucketPtrs& b, const LarsHyper& h, const DeviceScalars& s,
                      const T* sums, cudaStream_t stream) {
  using Op = LarsPass2<T, W, G, P>;
  const Op op{h, sums, static_cast<const T*>(s.grad_mult), s.found_inf, s.lr};
  void* const* const steps = reinterpret_cast<void* const*>(b.steps);
  if constexpr (Op::kHasParam) {
    void* const* const lists[Op::kRows] = {b.weights, b.grads, b.state1, b.params, steps};
    return run_pass(b.n, b.numel, lists, op, stream);
  } else {
    void* const* const lists[Op::kRows] = {b.weights, b.grads, b.state1, steps};
    return run_pass(b.n, b.numel, lists, op, stream);
  }
}

}  // namespace

cudaError_t launch_lars_pass1(const BucketPtrs& b, const LarsHyper& h, const DeviceScalars& s,
                              void* sums, void* partials, cudaStream_t stream) {
  return dispatch_weights_and_grads(b, [&](auto c_tag, auto w_tag, auto g_tag) {
    using C = typename decltype(c_tag)::type;
    using W = typename decltype(w_tag)::type;
    using G = typename decltype(g_tag)::type;
    return run_pass1<C, W, G>(b, h, s, static_cast<C*>(sums), static_cast<C*>(partials), stream);
  });
}

cudaError_t launch_lars_pass2(const BucketPtrs& b, const LarsHyper& h, const DeviceScalars& s,
                              const void* sums, cudaStream_t stream) {
  if (b.weight_dtype == DType::kFloat64) {
    if (b.grad_dtype != DType::kFloat64 || b.params != nullptr) return cudaErrorNotSupported;
    return run_pass2<double, double, double, NoParam>(b, h, s, static_cast<const double*>(sums),
                                                      stream);
  }
  return dispatch_fp32_compute(b.weight_dtype, [&](auto w_tag) {
    using W = typename decltype(w_tag)::type;
    return dispatch_param_out<W>(b, [&](auto p_tag) {
      using P = typename decltype(p_tag)::type;
      // the grads belong to the params: stored as P beside masters, else as W
      using S = std::conditional_t<std::is_same<P, NoParam>::value, W, P>;
      return dispatch_grad<S>(b.grad_dtype, [&](auto g_tag) {
        using G = typename decltype(g_tag)::type;
        return run_pass2<float, W, G, P>(b, h, s, static_cast<const float*>(sums), stream);
      });
    });
  });
}

}  // namespace cuda
}  // namespace fusedopt
