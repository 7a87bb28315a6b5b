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
//
// Low-precision state (docs/math.md "Low-precision state"): pass 1 reads no state; pass 2 of a
// bucket that holds some runs LarsPass2 with kLowp, which reads each tensor's format from the state
// row (Note [state rows] in lowp.cuh): a bf16 buffer rounded to nearest even, or an 8-bit one in
// blocks of the dynamic map (Note [8-bit blocks on CUDA]; Note [8-bit maps] in math.h), with the
// rounded float32 operations of math.h (Note [rounded operations]), element for element the
// operations of csrc/cpu/kernels.h (lars_pass2_chunk_bf16 / _q8). The step moves by the buffer
// just computed in float32, and the state stores that buffer rounded: the trust ratio does not
// depend on the buffer, so nothing reads the rounded one before the next step.
#include "lowp.cuh"

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

  static TableRows<kRows> rows(const BucketPtrs& b, void* const*) {
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

// Pass 2 of one chunk. Table rows: w, g, momentum buffer, [param,] step[, state row (kLowp)].
template <typename T, typename W, typename G, typename P, bool kLowp>
struct LarsPass2 {
  static_assert(!kLowp || std::is_same<T, float>::value, "low-precision state is float32 math");
  static constexpr bool kHasParam = !std::is_same<P, NoParam>::value;
  enum Row {
    kW, kG, kBuf, kP,
    kStep = kHasParam ? 4 : 3,
    kState,
    kRows = kLowp ? kState + 1 : kState
  };
  static constexpr int N = kHasParam ? ilp_for<T, W, G, P>() : ilp_for<T, W, G>();
  struct Scalars {
    LarsCoef<T> c;
    T gm;
    unsigned char format;
  };
  LarsHyper h;
  const T* sums;           // [n, 2] from pass 1 (possibly all-reduced)
  const T* grad_mult;      // 0-dim or nullptr
  const float* found_inf;  // 0-dim or nullptr
  const double* lr;        // 0-dim or nullptr

  static TableRows<kRows> rows(const BucketPtrs& b, void* const* state) {
    if constexpr (kHasParam && kLowp) {
      return {{b.weights, b.grads, b.state1, b.params, step_row(b), state}};
    } else if constexpr (kHasParam) {
      return {{b.weights, b.grads, b.state1, b.params, step_row(b)}};
    } else if constexpr (kLowp) {
      return {{b.weights, b.grads, b.state1, step_row(b), state}};
    } else {
      return {{b.weights, b.grads, b.state1, step_row(b)}};
    }
  }

  __device__ void operator()(const TensorTable<kRows>& t, int slot, int64_t begin, int count,
                             int64_t) const {
    if (step_skipped(found_inf)) return;  // the same for every thread of the block
    if constexpr (kLowp) {
      // the dynamic map's tables, published by block_broadcast's barrier (every thread reads the
      // format from the table of the launch, so the branch is the same for the whole block)
      if (slot_format(t, kState, slot) == k8bitState) fill_dynamic_tables();
    }
    const Scalars sc = block_broadcast<Scalars>([&] {
      LarsHyper hl = h;
      if (lr != nullptr) hl.lr = *lr;
      const int64_t i = t.index[slot];
      unsigned char format = kFullState;
      if constexpr (kLowp) format = slot_format(t, kState, slot);
      const T ratio = lars_trust_ratio<T>(sums[2 * i], sums[2 * i + 1], hl);
      const float step = *static_cast<const float*>(t.ptrs[kStep][slot]);
      return Scalars{lars_coef<T>(hl, ratio, step), grad_mult != nullptr ? *grad_mult : T(1),
                     format};
    });
    W* w = chunk_ptr<W>(t, kW, slot, begin);
    const G* g = chunk_ptr<const G>(t, kG, slot, begin);
    P* p = nullptr;
    if constexpr (kHasParam) p = chunk_ptr<P>(t, kP, slot, begin);
    if constexpr (kLowp) {
      if (sc.format == kBf16State) return bf16_chunk(t, slot, begin, count, sc, w, g, p);
      if (sc.format == k8bitState) return q8_chunk(t, slot, begin, count, sc, w, g, p);
    }
    T* buf = chunk_ptr<T>(t, kBuf, slot, begin);
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

  // A bf16 buffer (16-bit words): the step from the new buffer in float32, which is stored
  // rounded to nearest even.
  __device__ __forceinline__ void bf16_chunk(const TensorTable<kRows>& t, int slot, int64_t begin,
                                             int count, const Scalars& sc, W* w, const G* g,
                                             P* p) const {
    constexpr int M = kHasParam ? ilp_for<float, W, G, P, unsigned short>()
                                : ilp_for<float, W, G, unsigned short>();
    unsigned short* buf = chunk_ptr<unsigned short>(t, kBuf, slot, begin);
    const bool aligned = kHasParam ? all_aligned(w, g, buf, p) : all_aligned(w, g, buf);
    for_each_group<M>(count, aligned, [&](int off, int n, bool vec) {
      float wr[M], gr[M];
      unsigned short vr[M];
      load_group(wr, w, off, n, vec);
      load_group(gr, g, off, n, vec);
      load_group(vr, buf, off, n, vec);
#pragma unroll
      for (int k = 0; k < M; ++k) {
        const float d = lars_direction<float>(wr[k], mul_rn(gr[k], sc.gm), sc.c);
        const float vk = lars_buffer<float>(d, bf16_value(vr[k]), sc.c);
        vr[k] = bf16_rne(vk);
        wr[k] = lars_step<float>(wr[k], d, vk, sc.c);
      }
      store_group(buf, vr, off, n, vec);
      store_group(w, wr, off, n, vec);
      if constexpr (kHasParam) store_group(p, wr, off, n, vec);
    });
  }

  // An 8-bit buffer, a block per warp (Note [8-bit blocks on CUDA]), as lars_pass2_chunk_q8 of
  // csrc/cpu/kernels.h: the new buffer from the stored one (the dynamic map, Note [8-bit maps]),
  // the step from the new buffer in float32 (w is stored before the reduction, which it does not
  // wait for), then the block's largest |value| (block_max), its words and codes.
  __device__ __forceinline__ void q8_chunk(const TensorTable<kRows>& t, int slot, int64_t begin,
                                           int count, const Scalars& sc, W* w, const G* g,
                                           P* p) const {
    constexpr int L = kLaneElems;
    const Packed<signed char> buf = chunk_packed<signed char>(t, kBuf, slot, begin);
    const DynamicTables& tables = dynamic_tables();  // filled before block_broadcast's barrier
    const bool vec = kHasParam ? all_aligned(w, g, p) : all_aligned(w, g);
    const bool vec8 = all_aligned8(buf.codes);
    const bool lane0 = (threadIdx.x & 31) == 0;
    for_each_q8_slice(count, [&](int round, int q, int off, int n) {
      const bool whole = n == L;
      float vr[L];
      signed char vc[L];
      unsigned int top[1] = {0u};
      {
        float wr[L], gr[L];
        load_group(wr, w, off, n, vec && whole);
        load_group(gr, g, off, n, vec && whole);
        load_codes(vc, buf.codes, off, n, vec8 && whole);
        const float a0 = n > 0 ? bits_float(buf.words[2 * q]) : 0.0f;  // none without a block
#pragma unroll
        for (int k = 0; k < L; ++k) {
          const float d = lars_direction<float>(wr[k], mul_rn(gr[k], sc.gm), sc.c);
          vr[k] = lars_buffer<float>(d, q8_dynamic_value(vc[k], a0, tables.unit), sc.c);
          wr[k] = lars_step<float>(wr[k], d, vr[k], sc.c);
          if (k < n) top[0] = max_u32(top[0], magnitude_bits(vr[k]));
        }
        store_group(w, wr, off, n, vec && whole);
        if constexpr (kHasParam) store_group(p, wr, off, n, vec && whole);
      }
      // every lane has read the block's old words: lane 0 may write the new ones below
      block_max<kBufferTopSite>(top, round);
      const bool finite = top[0] < kInfBits;
      const Scaling s = q8_scaling(bits_float(top[0]), 1.0f);  // P = 2^64 for a tiny block
      if (lane0 && n > 0) {
        buf.words[2 * q] = finite ? top[0] : kNanWord;
        buf.words[2 * q + 1] = 0u;
      }
#pragma unroll
      for (int k = 0; k < L; ++k) {
        // a block that is not finite stores codes 0 (read as 0 * NaN)
        vc[k] = static_cast<signed char>(finite ? q8_dynamic_code(vr[k], s, top[0], tables.thr)
                                                : 0);
      }
      store_codes(buf.codes, vc, off, n, vec8 && whole);
    });
  }
};

template <bool kLowp>
cudaError_t lars_pass2_of(const BucketPtrs& b, const LarsHyper& h, const DeviceScalars& s,
                          const void* sums, cudaStream_t stream, void* const* state) {
  return launch_pass2</*kReadsGrads=*/true, kLowp>(
      b, stream,
      [&](auto c_tag, auto w_tag, auto g_tag, auto p_tag) {
        using C = typename decltype(c_tag)::type;
        using Op = LarsPass2<C, typename decltype(w_tag)::type, typename decltype(g_tag)::type,
                             typename decltype(p_tag)::type, kLowp>;
        return Op{h, static_cast<const C*>(sums), static_cast<const C*>(s.grad_mult),
                  s.found_inf, s.lr};
      },
      state);
}

}  // namespace

cudaError_t launch_lars_pass1(const BucketPtrs& b, const LarsHyper& h, const DeviceScalars& s,
                              void* sums, void* partials, cudaStream_t stream) {
  return launch_pass1<LarsPass1>(b, h, s, sums, partials, stream);
}

cudaError_t launch_lars_pass2(const BucketPtrs& b, const LarsHyper& h, const DeviceScalars& s,
                              const void* sums, cudaStream_t stream) {
  if (!has_low_precision(b)) return lars_pass2_of<false>(b, h, s, sums, stream, nullptr);
  const std::vector<void*> state = state_row(b);
  return lars_pass2_of<true>(b, h, s, sums, stream, state.data());
}

}  // namespace cuda
}  // namespace fusedopt
