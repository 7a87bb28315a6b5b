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
//
// Low-precision state (docs/math.md "Low-precision state"): a bucket that holds some launches the
// functors with kLowp, which read each tensor's format from the state row (Note [state rows] in
// lowp.cuh) and run, per chunk, the full-state code or that of its format, with the rounded
// float32 operations of math.h (Note [rounded operations]): bf16 moments (m to nearest even, v
// stochastically with sr_bits of the element), or 8-bit blocks (Note [8-bit blocks on CUDA]):
// exp_avg holds the direction d = m / (s + eps8) in the linear map and exp_avg_sq the root s in
// the root map (Note [8-bit maps] in fusedopt/math.h), so that u = c8*d + lambda*w.
// Pass 1 computes u from the values it stored and pass 2 from the same stored values, as
// csrc/cpu/kernels.h does (lamb_pass1_chunk_bf16 / _q8, lamb_pass2_chunk_bf16 / _q8), element for
// element the same operations.
#include "lowp.cuh"

namespace fusedopt {
namespace cuda {
namespace {

// Pass 1 of one chunk. Table rows: w, g, m, v, step[, state row (kLowp)].
template <typename T, typename W, typename G, bool kLowp>
struct LambPass1Of {
  static_assert(!kLowp || std::is_same<T, float>::value, "low-precision state is float32 math");
  enum Row { kW, kG, kM, kV, kStep, kState, kRows = kLowp ? kState + 1 : kState };
  static constexpr int N = ilp_for<T, W, G>();
  struct Scalars {
    LambCoef<T> c;
    T gm;
    unsigned int base;     // sr_base of the new step count and the tensor's key (kLowp)
    unsigned int first;    // sr_first of the tensor's key (kLowp)
    unsigned char format;  // StateFormat of the tensor's moments
  };
  LambHyper h;
  const T* grad_mult;      // 0-dim or nullptr
  const float* found_inf;  // 0-dim or nullptr
  T* partials;             // [chunks, 2] workspace

  static TableRows<kRows> rows(const BucketPtrs& b, void* const* state) {
    if constexpr (kLowp) {
      return {{b.weights, b.grads, b.state1, b.state2, step_row(b), state}};
    } else {
      return {{b.weights, b.grads, b.state1, b.state2, step_row(b)}};
    }
  }

  __device__ void operator()(const TensorTable<kRows>& t, int slot, int64_t begin, int count,
                             int64_t row) const {
    T acc[2] = {T(0), T(0)};
    if (!step_skipped(found_inf)) {  // the same for every thread of the block
      const Scalars sc = block_broadcast<Scalars>([&] {
        // pass 1 uses the new t; the reduction stores it after every chunk (Note [step counts in
        // reduce_kernel] in multi_tensor_apply.cuh)
        const float step = *static_cast<const float*>(t.ptrs[kStep][slot]) + 1.0f;
        Scalars s{lamb_coef<T>(h, step), grad_mult != nullptr ? *grad_mult : T(1), 0u, 0u,
                  kFullState};
        if constexpr (kLowp) {
          s.format = slot_format(t, kState, slot);
          if (s.format != kFullState) {
            s.base = sr_base(step, slot_key(t, kState, slot));
            s.first = slot_first(t, kState, slot);
          }
        }
        return s;
      });
      if constexpr (kLowp) {
        if (sc.format == kBf16State) {
          bf16_chunk(t, slot, begin, count, sc, acc);
        } else if (sc.format == k8bitState) {
          q8_chunk(t, slot, begin, count, sc, acc);
        } else {
          full_chunk(t, slot, begin, count, sc, acc);
        }
      } else {
        full_chunk(t, slot, begin, count, sc, acc);
      }
    }
    write_partials(acc, partials, row);
  }

  __device__ __forceinline__ void full_chunk(const TensorTable<kRows>& t, int slot, int64_t begin,
                                             int count, const Scalars& sc, T (&acc)[2]) const {
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

  // bf16 moments (16-bit words): m rounded to nearest even, v stochastically with the bits of its
  // element; u from the stored values.
  __device__ __forceinline__ void bf16_chunk(const TensorTable<kRows>& t, int slot, int64_t begin,
                                             int count, const Scalars& sc,
                                             float (&acc)[2]) const {
    constexpr int M = ilp_for<float, W, G, unsigned short>();
    const W* w = chunk_ptr<const W>(t, kW, slot, begin);
    const G* g = chunk_ptr<const G>(t, kG, slot, begin);
    unsigned short* m = chunk_ptr<unsigned short>(t, kM, slot, begin);
    unsigned short* v = chunk_ptr<unsigned short>(t, kV, slot, begin);
    for_each_group<M>(count, all_aligned(w, g, m, v), [&](int off, int n, bool vec) {
      float wr[M], gr[M];
      unsigned short mr[M], vr[M];
      load_group(wr, w, off, n, vec);
      load_group(gr, g, off, n, vec);
      load_group(mr, m, off, n, vec);
      load_group(vr, v, off, n, vec);
#pragma unroll
      for (int k = 0; k < M; ++k) {
        float mk = bf16_value(mr[k]);
        float vk = bf16_value(vr[k]);
        lamb_moments<float>(mul_rn(gr[k], sc.gm), mk, vk, sc.c);
        mr[k] = bf16_rne(mk);
        vr[k] = bf16_stochastic(vk, sr_bits(sc.base, sc.first + begin + off + k));
        const float u = lamb_direction<float>(wr[k], bf16_value(mr[k]), bf16_value(vr[k]), sc.c);
        if (k < n) {
          acc[0] += wr[k] * wr[k];
          acc[1] += u * u;
        }
      }
      store_group(m, mr, off, n, vec);
      store_group(v, vr, off, n, vec);
    });
  }

  // 8-bit moments, a block per warp (Note [8-bit blocks on CUDA]), as lamb_pass1_chunk_q8 of
  // csrc/cpu/kernels.h (Note [8-bit maps]): m = d*(s + eps) and v = s*s read from the stored codes
  // and updated; the block's root words (block_max) and the codes of s = sqrt(v) (stochastic);
  // the direction d = m / (s + eps8) from the roots as stored, its block's largest |d|
  // (block_max), words and codes (to nearest); u = c8*d + lambda*w from the directions as stored.
  __device__ __forceinline__ void q8_chunk(const TensorTable<kRows>& t, int slot, int64_t begin,
                                           int count, const Scalars& sc, float (&acc)[2]) const {
    constexpr int L = kLaneElems;
    const W* w = chunk_ptr<const W>(t, kW, slot, begin);
    const G* g = chunk_ptr<const G>(t, kG, slot, begin);
    const Packed<signed char> m = chunk_packed<signed char>(t, kM, slot, begin);
    const Packed<unsigned char> v = chunk_packed<unsigned char>(t, kV, slot, begin);
    const bool vec = all_aligned(w, g);
    const bool vec8 = all_aligned8(m.codes, v.codes);
    const bool lane0 = (threadIdx.x & 31) == 0;
    for_each_q8_slice(count, [&](int round, int q, int off, int n) {
      const bool whole = n == L;
      float wr[L], mr[L], sr[L];
      signed char mc[L];
      unsigned char vc[L];
      unsigned int roots[2] = {0u, 0u};  // lane_root_words
      {
        float gr[L];
        load_group(wr, w, off, n, vec && whole);
        load_group(gr, g, off, n, vec && whole);
        load_codes(mc, m.codes, off, n, vec8 && whole);
        load_codes(vc, v.codes, off, n, vec8 && whole);
        // the block's words as stored (a warp without a block reads none)
        const float f0 = n > 0 ? bits_float(m.words[2 * q]) : 0.0f;
        const float eps0 = n > 0 ? bits_float(m.words[2 * q + 1]) : 0.0f;
        const unsigned int top0 = n > 0 ? v.words[2 * q] : 0u;
        const int sh0 = n > 0 ? static_cast<int>(v.words[2 * q + 1]) : 0;
#pragma unroll
        for (int k = 0; k < L; ++k) {
          const float s0 = q8_root_value(vc[k], top0, sh0);
          float mk = mul_rn(q8_direction_value(mc[k], f0), add_rn(s0, eps0));
          float vk = mul_rn(s0, s0);
          lamb_moments<float>(mul_rn(gr[k], sc.gm), mk, vk, sc.c);
          mr[k] = mk;
          sr[k] = sqrt_rn(q8_saturate(vk));
          if (k < n) lane_root_words(sr[k], roots);
        }
      }
      // every lane has read the block's old words: lane 0 may write the new ones below
      block_max<kRootWordsSite>(roots, round);
      const bool roots_finite = roots[0] < kInfBits;
      const unsigned int top = roots_finite ? roots[0] : kNanWord;
      const int sh = roots_finite ? q8_root_shift(top, roots[1] != 0u ? ~roots[1] : top) : 0;
      unsigned int d_top[1] = {0u};
#pragma unroll
      for (int k = 0; k < L; ++k) {
        if (roots_finite) {
          const unsigned int bits = sr_bits(sc.base, sc.first + begin + off + k);
          const int cv = q8_root_code(sr[k], top, sh, q8_root_stochastic(bits, sh));
          vc[k] = static_cast<unsigned char>(cv);
          mr[k] = div_rn(mr[k], add_rn(q8_root_value(cv, top, sh), sc.c.eps8));  // d
        } else {  // codes 255, read as the NaN of the block's words
          vc[k] = 255;
          mr[k] = bits_float(kNanWord);
        }
        if (k < n) d_top[0] = max_u32(d_top[0], magnitude_bits(mr[k]));
      }
      block_max<kDirectionTopSite>(d_top, round);
      const bool d_finite = d_top[0] < kInfBits;
      const float a = bits_float(d_top[0]);
      const float f = d_finite ? q8_direction_step(a) : bits_float(kNanWord);
      const Scaling ds = q8_scaling(a, 127.0f);  // a tiny block is prescaled (P = 2^64)
      if (lane0 && n > 0) {
        v.words[2 * q] = top;
        v.words[2 * q + 1] = static_cast<unsigned int>(sh);
        m.words[2 * q] = float_bits(f);
        m.words[2 * q + 1] = float_bits(sc.c.eps8);
      }
#pragma unroll
      for (int k = 0; k < L; ++k) {
        // a block that is not finite stores codes 0 (read as 0 * NaN)
        const int cm = d_finite ? q8_direction_code(mul_rn(mr[k], ds.p), ds.q) : 0;
        mc[k] = static_cast<signed char>(cm);
        const float u = add_rn(mul_rn(sc.c.c8, q8_direction_value(cm, f)),
                               mul_rn(sc.c.lambda_in_u, wr[k]));
        if (k < n) {
          acc[0] += wr[k] * wr[k];
          acc[1] += u * u;
        }
      }
      store_codes(m.codes, mc, off, n, vec8 && whole);
      store_codes(v.codes, vc, off, n, vec8 && whole);
    });
  }
};

template <typename T, typename W, typename G>
using LambPass1 = LambPass1Of<T, W, G, false>;
template <typename T, typename W, typename G>
using LambPass1Lowp = LambPass1Of<T, W, G, true>;

// Pass 2 of one chunk. Table rows: w, m, v, [param,] step[, state row (kLowp)].
template <typename T, typename W, typename P, bool kLowp>
struct LambPass2 {
  static_assert(!kLowp || std::is_same<T, float>::value, "low-precision state is float32 math");
  static constexpr bool kHasParam = !std::is_same<P, NoParam>::value;
  enum Row {
    kW, kM, kV, kP,
    kStep = kHasParam ? 4 : 3,
    kState,
    kRows = kLowp ? kState + 1 : kState
  };
  static constexpr int N = kHasParam ? ilp_for<T, W, P>() : ilp_for<T, W>();
  struct Scalars {
    LambCoef<T> c;
    T lr_phi;  // lr * phi
    T decay;   // 1 - lr*lambda (decoupled) or 1
    unsigned char format;
  };
  LambHyper h;
  const T* sums;           // [n, 2] from pass 1 (possibly all-reduced)
  const float* found_inf;  // 0-dim or nullptr
  const double* lr;        // 0-dim or nullptr

  static TableRows<kRows> rows(const BucketPtrs& b, void* const* state) {
    if constexpr (kHasParam && kLowp) {
      return {{b.weights, b.state1, b.state2, b.params, step_row(b), state}};
    } else if constexpr (kHasParam) {
      return {{b.weights, b.state1, b.state2, b.params, step_row(b)}};
    } else if constexpr (kLowp) {
      return {{b.weights, b.state1, b.state2, step_row(b), state}};
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
      unsigned char format = kFullState;
      if constexpr (kLowp) format = slot_format(t, kState, slot);
      return Scalars{lamb_coef<T>(h, step), mul_rn(static_cast<T>(lr_value), phi),
                     lamb_decay<T>(h, lr_value), format};
    });
    W* w = chunk_ptr<W>(t, kW, slot, begin);
    P* p = nullptr;
    if constexpr (kHasParam) p = chunk_ptr<P>(t, kP, slot, begin);
    if constexpr (kLowp) {
      if (sc.format == kBf16State) return bf16_chunk(t, slot, begin, count, sc, w, p);
      if (sc.format == k8bitState) return q8_chunk(t, slot, begin, count, sc, w, p);
    }
    const T* m = chunk_ptr<const T>(t, kM, slot, begin);
    const T* v = chunk_ptr<const T>(t, kV, slot, begin);
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

  // bf16 moments: u from the stored values (pass 1's u, bit for bit).
  __device__ __forceinline__ void bf16_chunk(const TensorTable<kRows>& t, int slot, int64_t begin,
                                             int count, const Scalars& sc, W* w, P* p) const {
    constexpr int M = kHasParam ? ilp_for<float, W, P, unsigned short>()
                                : ilp_for<float, W, unsigned short>();
    const unsigned short* m = chunk_ptr<const unsigned short>(t, kM, slot, begin);
    const unsigned short* v = chunk_ptr<const unsigned short>(t, kV, slot, begin);
    const bool aligned = kHasParam ? all_aligned(w, m, v, p) : all_aligned(w, m, v);
    for_each_group<M>(count, aligned, [&](int off, int n, bool vec) {
      float wr[M];
      unsigned short mr[M], vr[M];
      load_group(wr, w, off, n, vec);
      load_group(mr, m, off, n, vec);
      load_group(vr, v, off, n, vec);
#pragma unroll
      for (int k = 0; k < M; ++k) {
        const float u = lamb_direction<float>(wr[k], bf16_value(mr[k]), bf16_value(vr[k]), sc.c);
        wr[k] = lamb_apply<float>(wr[k], u, sc.lr_phi, sc.decay);
      }
      store_group(w, wr, off, n, vec);
      if constexpr (kHasParam) store_group(p, wr, off, n, vec);
    });
  }

  // 8-bit moments, 8 elements of a block per lane (Note [8-bit blocks on CUDA]; nothing is
  // reduced here, so no lane waits for another): u = c8*d + lambda*w from the stored directions
  // alone (lamb_pass2_chunk_q8 of csrc/cpu/kernels.h), so exp_avg_sq is not read.
  __device__ __forceinline__ void q8_chunk(const TensorTable<kRows>& t, int slot, int64_t begin,
                                           int count, const Scalars& sc, W* w, P* p) const {
    constexpr int L = kLaneElems;
    const Packed<signed char> m = chunk_packed<signed char>(t, kM, slot, begin);
    const bool vec = kHasParam ? all_aligned(w, p) : all_aligned(w);
    const bool vec8 = all_aligned8(m.codes);
    for_each_q8_slice(count, [&](int, int q, int off, int n) {
      if (n == 0) return;
      const bool whole = n == L;
      float wr[L];
      signed char mc[L];
      load_group(wr, w, off, n, vec && whole);
      load_codes(mc, m.codes, off, n, vec8 && whole);
      const float f = bits_float(m.words[2 * q]);
#pragma unroll
      for (int k = 0; k < L; ++k) {
        const float u = add_rn(mul_rn(sc.c.c8, q8_direction_value(mc[k], f)),
                               mul_rn(sc.c.lambda_in_u, wr[k]));
        wr[k] = lamb_apply<float>(wr[k], u, sc.lr_phi, sc.decay);
      }
      store_group(w, wr, off, n, vec && whole);
      if constexpr (kHasParam) store_group(p, wr, off, n, vec && whole);
    });
  }
};

template <bool kLowp>
cudaError_t lamb_pass2_of(const BucketPtrs& b, const LambHyper& h, const DeviceScalars& s,
                          const void* sums, cudaStream_t stream, void* const* state) {
  return launch_pass2</*kReadsGrads=*/false, kLowp>(
      b, stream,
      [&](auto c_tag, auto w_tag, auto p_tag) {
        using C = typename decltype(c_tag)::type;
        using Op = LambPass2<C, typename decltype(w_tag)::type, typename decltype(p_tag)::type,
                             kLowp>;
        return Op{h, static_cast<const C*>(sums), s.found_inf, s.lr};
      },
      state);
}

}  // namespace

cudaError_t launch_lamb_pass1(const BucketPtrs& b, const LambHyper& h, const DeviceScalars& s,
                              void* sums, void* partials, cudaStream_t stream) {
  if (!has_low_precision(b)) return launch_pass1<LambPass1>(b, h, s, sums, partials, stream);
  const std::vector<void*> state = state_row(b);
  return launch_pass1<LambPass1Lowp, /*kFloat32Only=*/true>(b, h, s, sums, partials, stream,
                                                            state.data());
}

cudaError_t launch_lamb_pass2(const BucketPtrs& b, const LambHyper& h, const DeviceScalars& s,
                              const void* sums, cudaStream_t stream) {
  if (!has_low_precision(b)) return lamb_pass2_of<false>(b, h, s, sums, stream, nullptr);
  const std::vector<void*> state = state_row(b);
  return lamb_pass2_of<true>(b, h, s, sums, stream, state.data());
}

}  // namespace cuda
}  // namespace fusedopt
