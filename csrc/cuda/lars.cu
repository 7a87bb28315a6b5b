// LARS on CUDA (docs/math.md, the form of the Paddle lars_momentum kernel), two passes per bucket:
//   pass 1  sums = (|w|^2, |g|^2) per tensor, or (|w|^2, |g + lambda*w|^2) for "combined"
//   pass 2  ratio = kappa*|w| / (|g| + lambda*|w| + eps)  or  kappa*|w| / (|g + lambda*w| + eps)
//           (zero-norm rule, trust_clip, adapt) ;  d = ratio*(g + lambda*w) ;  momentum ;  w -= step
// Memory traffic per element is docs/math.md's 28 B for fp32: pass 1 reads w, g; pass 2 reads w, g, v
// and writes w, v.
//
// The trust ratio, the per-tensor coefficients and the per-element update are calls into
// fusedopt/math.h (lars_trust_ratio, lars_coef, lars_apply): see Note [shared math] in lamb.cu.
// The only arithmetic written here is the quantity whose norm pass 1 needs (g, or g + lambda*w,
// the same expression as lars_apply's d before the ratio).
#include "multi_tensor_apply.cuh"

namespace fusedopt {
namespace cuda {
namespace {

// Pass 1 of one chunk. Table rows: w, g, step (the step is advanced by the reduction: Note [step
// counts in reduce_kernel] in multi_tensor_apply.cuh).
template <typename T, typename W, typename G>
struct LarsPass1 {
  enum Row { kW, kG, kStep, kRows };
  static constexpr int N = ilp_for<T, W, G>();
  LarsHyper h;
  const T* grad_mult;      // 0-dim or nullptr
  const float* found_inf;  // 0-dim or nullptr
  T* partials;             // [chunks, 2] workspace

  static TableRows<kRows> rows(const BucketPtrs& b) {
    return {{b.weights, b.grads, step_row(b)}};
  }

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

  static TableRows<kRows> rows(const BucketPtrs& b) {
    if constexpr (kHasParam) {
      return {{b.weights, b.grads, b.state1, b.params, step_row(b)}};
    } else {
      return {{b.weights, b.grads, b.state1, step_row(b)}};
    }
  }

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

}  // namespace

cudaError_t launch_lars_pass1(const BucketPtrs& b, const LarsHyper& h, const DeviceScalars& s,
                              void* sums, void* partials, cudaStream_t stream) {
  return launch_pass1<LarsPass1>(b, h, s, sums, partials, stream);
}

cudaError_t launch_lars_pass2(const BucketPtrs& b, const LarsHyper& h, const DeviceScalars& s,
                              const void* sums, cudaStream_t stream) {
  return launch_pass2</*kReadsGrads=*/true>(
      b, stream, [&](auto c_tag, auto w_tag, auto g_tag, auto p_tag) {
        using C = typename decltype(c_tag)::type;
        using Op = LarsPass2<C, typename decltype(w_tag)::type, typename decltype(g_tag)::type,
                             typename decltype(p_tag)::type>;
        return Op{h, static_cast<const C*>(sums), static_cast<const C*>(s.grad_mult), s.found_inf,
                  s.lr};
      });
}

}  // namespace cuda
}  // namespace fusedopt
