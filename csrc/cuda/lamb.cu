// LAMB on CUDA (docs/math.md, NVLAMB form), two passes per bucket:
//   pass 1  m <- beta1*m + beta3*g ;  v <- beta2*v + (1-beta2)*g^2   (written back)
//           u = m_hat / (sqrt(v_hat) + eps) + lambda*w ;  sums = (|w|^2, |u|^2) per tensor
//   pass 2  phi = |w| / |u| (zero-norm rule, bounds, adapt) ;  w <- w*decay - lr*phi*u
// Memory traffic per element is docs/math.md's 40 B for fp32: pass 1 reads w, g, m, v and writes m, v;
// pass 2 reads w, m, v (recomputing u with the same call as pass 1) and writes w.
//
// Note [shared math]: every per-element and per-tensor formula of the CUDA passes is a call into
// fusedopt/math.h (here lamb_coef, lamb_moments, lamb_direction, lamb_trust_ratio, lamb_decay,
// lamb_apply; in lars.cu lars_trust_ratio, lars_coef, lars_apply), the header the C++ CPU backend
// uses too and that its tests exercise on the host against the float64 reference. The functors
// only load, call the math, accumulate and store (lars.cu's pass 1 also forms the vector whose
// norm it needs). Their launchers are launch_pass1 / launch_pass2 of multi_tensor_apply.cuh.
#include "multi_tensor_apply.cuh"

namespace fusedopt {
namespace cuda {
namespace {

// Pass 1 of one chunk. Table rows: w, g, m, v, step.
template <typename T, typename W, typename G>
struct LambPass1 {
  enum Row { kW, kG, kM, kV, kStep, kRows };
  static constexpr int N = ilp_for<T, W, G>();
  struct Scalars {
    LambCoef<T> c;
    T gm;
  };
  LambHyper h;
  const T* grad_mult;      // 0-dim or nullptr
  const float* found_inf;  // 0-dim or nullptr
  T* partials;             // [chunks, 2] workspace

  static TableRows<kRows> rows(const BucketPtrs& b) {
    return {{b.weights, b.grads, b.state1, b.state2, step_row(b)}};
  }

  __device__ void operator()(const TensorTable<kRows>& t, int slot, int64_t begin, int count,
                             int64_t row) const {
    T acc[2] = {T(0), T(0)};
    if (!step_skipped(found_inf)) {  // the same for every thread of the block
      const Scalars sc = block_broadcast<Scalars>([&] {
        // pass 1 uses the new t; the reduction stores it after every chunk (Note [step counts in
        // reduce_kernel] in multi_tensor_apply.cuh)
        const float step = *static_cast<const float*>(t.ptrs[kStep][slot]) + 1.0f;
        return Scalars{lamb_coef<T>(h, step), grad_mult != nullptr ? *grad_mult : T(1)};
      });
      const W* w = chunk_ptr<const W>(t, kW, slot, begin);
      const G* g = chunk_ptr<const G>(t, kG, slot, begin);
      T* m = chunk_ptr<T>(t, kM, slot, begin);
      T* v = chunk_ptr<T>(t, kV, slot, begin);
      for_each_group<N>(count, all_aligned(w, g, m, v), [&](int off, int n, bool vec) {
        T wr[N], gr[N], mr[N], vr[N];
        load_group(wr, w, off, n, vec);
        load_group(gr, g, off, n, vec);
        load_group(mr, m, off, n, vec);
        load_group(vr, v, off, n, vec);
#pragma unroll
        for (int k = 0; k < N; ++k) {
          lamb_moments<T>(gr[k] * sc.gm, mr[k], vr[k], sc.c);
          const T u = lamb_direction<T>(wr[k], mr[k], vr[k], sc.c);
          if (k < n) {
            acc[0] += wr[k] * wr[k];
            acc[1] += u * u;
          }
        }
        store_group(m, mr, off, n, vec);
        store_group(v, vr, off, n, vec);
      });
    }
    write_partials(acc, partials, row);
  }
};

// Pass 2 of one chunk. Table rows: w, m, v, [param,] step.
template <typename T, typename W, typename P>
struct LambPass2 {
  static constexpr bool kHasParam = !std::is_same<P, NoParam>::value;
  enum Row { kW, kM, kV, kP, kStep = kHasParam ? 4 : 3, kRows = kStep + 1 };
  static constexpr int N = kHasParam ? ilp_for<T, W, P>() : ilp_for<T, W>();
  struct Scalars {
    LambCoef<T> c;
    T lr_phi;  // lr * phi
    T decay;   // 1 - lr*lambda (decoupled) or 1
  };
  LambHyper h;
  const T* sums;           // [n, 2] from pass 1 (possibly all-reduced)
  const float* found_inf;  // 0-dim or nullptr
  const double* lr;        // 0-dim or nullptr

  static TableRows<kRows> rows(const BucketPtrs& b) {
    if constexpr (kHasParam) {
      return {{b.weights, b.state1, b.state2, b.params, step_row(b)}};
    } else {
      return {{b.weights, b.state1, b.state2, step_row(b)}};
    }
  }

  __device__ void operator()(const TensorTable<kRows>& t, int slot, int64_t begin, int count,
                             int64_t) const {
    if (step_skipped(found_inf)) return;  // the same for every thread of the block
    const Scalars sc = block_broadcast<Scalars>([&] {
      const float step = *static_cast<const float*>(t.ptrs[kStep][slot]);
      const int64_t i = t.index[slot];
      const double lr_value = lr != nullptr ? *lr : h.lr;
      const T phi = lamb_trust_ratio<T>(sums[2 * i], sums[2 * i + 1], h);
      return Scalars{lamb_coef<T>(h, step), static_cast<T>(lr_value) * phi,
                     lamb_decay<T>(h, lr_value)};
    });
    W* w = chunk_ptr<W>(t, kW, slot, begin);
    const T* m = chunk_ptr<const T>(t, kM, slot, begin);
    const T* v = chunk_ptr<const T>(t, kV, slot, begin);
    P* p = nullptr;
    if constexpr (kHasParam) p = chunk_ptr<P>(t, kP, slot, begin);
    const bool aligned = kHasParam ? all_aligned(w, m, v, p) : all_aligned(w, m, v);
    for_each_group<N>(count, aligned, [&](int off, int n, bool vec) {
      T wr[N], mr[N], vr[N];
      load_group(wr, w, off, n, vec);
      load_group(mr, m, off, n, vec);
      load_group(vr, v, off, n, vec);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const T u = lamb_direction<T>(wr[k], mr[k], vr[k], sc.c);
        wr[k] = lamb_apply<T>(wr[k], u, sc.lr_phi, sc.decay);
      }
      store_group(w, wr, off, n, vec);
      if constexpr (kHasParam) store_group(p, wr, off, n, vec);
    });
  }
};

}  // namespace

cudaError_t launch_lamb_pass1(const BucketPtrs& b, const LambHyper& h, const DeviceScalars& s,
                              void* sums, void* partials, cudaStream_t stream) {
  return launch_pass1<LambPass1>(b, h, s, sums, partials, stream);
}

cudaError_t launch_lamb_pass2(const BucketPtrs& b, const LambHyper& h, const DeviceScalars& s,
                              const void* sums, cudaStream_t stream) {
  return launch_pass2</*kReadsGrads=*/false>(b, stream, [&](auto c_tag, auto w_tag, auto p_tag) {
    using C = typename decltype(c_tag)::type;
    using Op = LambPass2<C, typename decltype(w_tag)::type, typename decltype(p_tag)::type>;
    return Op{h, static_cast<const C*>(sums), s.found_inf, s.lr};
  });
}

}  // namespace cuda
}  // namespace fusedopt
