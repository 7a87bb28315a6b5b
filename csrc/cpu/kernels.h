// The chunk loops of the CPU passes and what they share (docs/backends.md): included by ops.cpp
// (the operators and kept layouts) and by the translation units that compile the passes, lamb.cpp,
// lars.cpp and lars_float.cpp. The passes are split between them so that the build compiles them in
// parallel (their kernel instances, for every dtype, state format and ISA clone, are most of the
// build's time: docs/performance.md, "Building"). Everything here but CheckedLists and the passes'
// declarations has internal linkage: each unit compiles the instances it uses.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <fusedopt/math.h>

#include <cstring>

#include <array>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "multi_tensor.h"
#include "ops.h"

namespace fusedopt {
namespace cpu {

// The dtypes and data pointers of a bucket's lists and its chunk table: all that the chunk loops
// of a pass need, built once by a kept layout's checks (Note [kept layout] in ops.h).
struct CheckedLists {
  at::ScalarType weight_dtype = at::kFloat;
  at::ScalarType param_dtype = at::kFloat;  // of params, when there are
  std::vector<void*> weights, params;    // params: bf16/fp16 params beside masters, or empty
  std::vector<void*> state_a, state_b;   // exp_avgs and exp_avg_sqs, or momentum buffers and {}
  std::vector<float*> steps;
  std::vector<unsigned char> formats;    // of each tensor's state (Note [state formats])
  std::vector<int64_t> codes_offset;     // of each packed 8-bit state, else 0
  bool low_precision = false;            // whether any state is not full
  ChunkTable table;

  CheckedLists(at::ScalarType w_dtype, at::TensorList w, at::TensorList p, at::TensorList a,
               at::TensorList b, at::TensorList s, std::vector<unsigned char> f);
  int64_t size() const { return static_cast<int64_t>(weights.size()); }
};

namespace {

// ------------------------------------------------------------------------------------- types

template <typename T>
struct TypeTag {
  using type = T;
};

// Stands for "no low-precision param to write": the weights are the params themselves.
struct NoParam {};

// Math runs in float64 for float64 weights and in float32 for every other storage type.
template <typename W>
using ComputeT = std::conditional_t<std::is_same_v<W, double>, double, float>;

// Calls f(TypeTag<S>{}) with S the C++ type of a supported storage dtype.
template <typename F>
void dispatch_storage(at::ScalarType s, const char* what, const F& f) {
  switch (s) {
    case at::kFloat: return f(TypeTag<float>{});
    case at::kDouble: return f(TypeTag<double>{});
    case at::kBFloat16: return f(TypeTag<c10::BFloat16>{});
    case at::kHalf: return f(TypeTag<c10::Half>{});
    default:
      TORCH_CHECK(false, "fusedopt cpp backend: ", what, " of dtype ", s,
                  " are not supported (float32, float64, bfloat16, float16 are)");
  }
}

// Calls f(TypeTag<P>{}) with P the type of the params written beside fp32 masters (of dtype
// p_dtype), or NoParam.
template <typename W, typename F>
void dispatch_param_out(bool has_params, at::ScalarType p_dtype, const F& f) {
  if (!has_params) return f(TypeTag<NoParam>{});
  if constexpr (std::is_same_v<W, float>) {
    switch (p_dtype) {
      case at::kBFloat16: return f(TypeTag<c10::BFloat16>{});
      case at::kHalf: return f(TypeTag<c10::Half>{});
      default: break;
    }
  }
  TORCH_CHECK(false, "fusedopt cpp backend: master weights are float32 copies of bfloat16/float16 "
              "params; got params of dtype ", p_dtype);
}

// The value of an optional 0-dim CPU tensor (read from memory: no device synchronization).
inline double read_scalar(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.numel() == 1, "fusedopt cpp backend: ", name,
              " must be a one-element CPU tensor, got shape ", t.sizes(), " on ", t.device());
  return t.item<double>();
}

template <typename T>
T grad_multiplier(const std::optional<at::Tensor>& grad_mult) {
  return grad_mult.has_value() ? static_cast<T>(read_scalar(*grad_mult, "grad_mult")) : T(1);
}

// ------------------------------------------------------------------------- hyper-parameters

constexpr const char* kWho = "fusedopt cpp backend: ";

// Adds 1 to every step count and returns the new counts t (the serial setup of pass 1).
inline std::vector<double> advance_steps(const std::vector<float*>& steps) {
  std::vector<double> t(steps.size());
  for (size_t i = 0; i < steps.size(); ++i) {
    *steps[i] = *steps[i] + 1.0f;
    t[i] = static_cast<double>(*steps[i]);
  }
  return t;
}

inline std::vector<double> read_steps(const std::vector<float*>& steps) {
  std::vector<double> t(steps.size());
  for (size_t i = 0; i < steps.size(); ++i) t[i] = static_cast<double>(*steps[i]);
  return t;
}

// The LambCoef of every step count; tensors of a bucket usually share one count, whose two pow()
// calls are then made once, not once per tensor.
template <typename T>
std::vector<LambCoef<T>> lamb_coefs(const LambHyper& h, const std::vector<double>& t) {
  std::vector<LambCoef<T>> coef(t.size());
  for (size_t i = 0; i < t.size(); ++i) {
    coef[i] = (i > 0 && t[i] == t[i - 1]) ? coef[i - 1] : lamb_coef<T>(h, t[i]);
  }
  return coef;
}

// Sums of squares are returned in the compute dtype, [n, 2] (see the pass contract).
template <typename T>
at::Tensor finish_sums(const ChunkTable& table, const std::vector<double>& partial, int64_t n) {
  at::Tensor sums = at::empty({n, 2}, at::dtype(c10::CppTypeToScalarType<T>::value));
  reduce_partials<T, 2>(table, partial, sums.data_ptr<T>(), n);
  return sums;
}

// Per-tensor sums of squares of pass 1, as doubles [n][2], read from the (contiguous) sums.
template <typename T>
std::vector<T> read_sums(const at::Tensor& sums, int64_t n) {
  TORCH_CHECK(sums.dim() == 2 && sums.size(0) == n && sums.size(1) == 2,
              "fusedopt cpp backend: sums must be [", n, ", 2], got ", sums.sizes());
  const at::Tensor s = sums.to(at::kCPU, c10::CppTypeToScalarType<T>::value).contiguous();
  const T* p = s.const_data_ptr<T>();
  return std::vector<T>(p, p + 2 * n);
}

template <typename P, typename T>
FUSEDOPT_INLINE void store_param(P* p, int64_t k, T value) {
  if constexpr (!std::is_same_v<P, NoParam>) p[k] = static_cast<P>(value);
}

// ------------------------------------------------------------------------- chunk functors
// Each walks one chunk of one tensor: pointers are already offset to the chunk's first element.

// LAMB pass 1: m <- beta1*m + beta3*g ; v <- beta2*v + (1-beta2)*g^2 (written back);
// u = lamb_direction(w, m, v); out[0] = sum w^2, out[1] = sum u^2 over the chunk.
template <typename W, typename G, typename T>
FUSEDOPT_INLINE void lamb_pass1_chunk(
    const W* __restrict__ w,  // weights (fp32 master or param), read
    const G* __restrict__ g,  // gradient, read as g * gm
    T* __restrict__ m,        // exp_avg, updated
    T* __restrict__ v,        // exp_avg_sq, updated
    int64_t n, const LambCoef<T> c, const T gm, double* out) {
  alignas(64) T wb[kBlock];
  alignas(64) T ub[kBlock];
  SqSum w_sq, u_sq;
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t len = std::min(kBlock, n - b);
    for (int64_t k = 0; k < len; ++k) {
      T mk = m[b + k];
      T vk = v[b + k];
      lamb_moments<T>(static_cast<T>(g[b + k]) * gm, mk, vk, c);
      m[b + k] = mk;
      v[b + k] = vk;
      const T wk = static_cast<T>(w[b + k]);
      wb[k] = wk;
      ub[k] = lamb_direction<T>(wk, mk, vk, c);
    }
    w_sq.add(wb, len);
    u_sq.add(ub, len);
  }
  out[0] = w_sq.total();
  out[1] = u_sq.total();
}

// LAMB pass 2: u = lamb_direction(w, m, v) (the same call as pass 1), w <- w*decay - lr_phi*u;
// with masters the param gets the new weight rounded to nearest even.
template <typename W, typename P, typename T>
FUSEDOPT_INLINE void lamb_pass2_chunk(
    W* __restrict__ w,        // weights, updated
    P* __restrict__ p,        // bf16/fp16 params beside fp32 masters, or unused
    const T* __restrict__ m,  // exp_avg, read
    const T* __restrict__ v,  // exp_avg_sq, read
    int64_t n, const LambCoef<T> c, const T lr_phi, const T decay) {
  for (int64_t k = 0; k < n; ++k) {
    const T wk = static_cast<T>(w[k]);
    const T nw = lamb_apply<T>(wk, lamb_direction<T>(wk, m[k], v[k], c), lr_phi, decay);
    w[k] = static_cast<W>(nw);
    store_param(p, k, nw);
  }
}

// LARS pass 1: out[0] = sum w^2; out[1] = sum g^2, or sum (g + lambda*w)^2 when kCombined.
template <bool kCombined, typename W, typename G, typename T>
FUSEDOPT_INLINE void lars_pass1_chunk(
    const W* __restrict__ w,  // weights, read
    const G* __restrict__ g,  // gradient, read as g * gm
    int64_t n, const T gm, const T lambda, double* out,
    const W* w_next, const G* g_next, int64_t n_next) {  // the next chunk's (prefetched)
  alignas(64) T wb[kBlock];
  alignas(64) T gb[kBlock];
  SqSum w_sq, g_sq;
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t len = std::min(kBlock, n - b);
    prefetch_block(w, b, n, w_next, n_next * int64_t(sizeof(W)));  // Note [read-only prefetch]
    prefetch_block(g, b, n, g_next, n_next * int64_t(sizeof(G)));
    for (int64_t k = 0; k < len; ++k) {
      const T wk = static_cast<T>(w[b + k]);
      const T gk = static_cast<T>(g[b + k]) * gm;
      wb[k] = wk;
      gb[k] = kCombined ? gk + lambda * wk : gk;
    }
    w_sq.add(wb, len);
    g_sq.add(gb, len);
  }
  out[0] = w_sq.total();
  out[1] = g_sq.total();
}

// LARS pass 2: lars_apply (d = ratio*(g + lambda*w), momentum, w <- w - step).
template <typename W, typename G, typename P, typename T>
FUSEDOPT_INLINE void lars_pass2_chunk(
    W* __restrict__ w,        // weights, updated
    P* __restrict__ p,        // bf16/fp16 params beside fp32 masters, or unused
    const G* __restrict__ g,  // gradient, read as g * gm
    T* __restrict__ v,        // momentum buffer, updated
    int64_t n, const T gm, const LarsCoef<T> c) {
  for (int64_t k = 0; k < n; ++k) {
    T vk = v[k];
    const T nw = lars_apply<T>(static_cast<T>(w[k]), static_cast<T>(g[k]) * gm, vk, c);
    v[k] = vk;
    w[k] = static_cast<W>(nw);
    store_param(p, k, nw);
  }
}

// body(c) with the two structural switches of c (lr_in_momentum, nesterov) made compile-time
// constants in its copy of c, so that each variant's loop vectorizes (the chunk functions are
// inlined into body).
template <typename T, typename Body>
FUSEDOPT_INLINE void with_lars_variant(const LarsCoef<T>& c, Body&& body) {
  auto run = [&](auto lr_in_momentum, auto nesterov) FUSEDOPT_INLINE_LAMBDA {
    LarsCoef<T> k = c;
    k.lr_in_momentum = decltype(lr_in_momentum)::value;
    k.nesterov = decltype(nesterov)::value;
    body(k);
  };
  using std::bool_constant;
  if (c.lr_in_momentum) {
    if (c.nesterov) run(bool_constant<true>{}, bool_constant<true>{});
    else run(bool_constant<true>{}, bool_constant<false>{});
  } else {
    if (c.nesterov) run(bool_constant<false>{}, bool_constant<true>{});
    else run(bool_constant<false>{}, bool_constant<false>{});
  }
}

// ---------------------------------------------------------------- low-precision state chunks
// Note [state formats] in math.h. The chunk offset o is a multiple of kChunk, itself a multiple
// of kQBlock, so a chunk holds whole 8-bit blocks (the last one of a tensor may be short), and
// kBlock == kQBlock: the blocks of the loops below are the 8-bit blocks. Element k of a chunk
// draws sr_bits(base, e0 + k), e0 its first element's index in the whole tensor (SrKey).
static_assert(kChunk % kQBlock == 0 && kBlock == kQBlock, "8-bit blocks must be loop blocks");

// A packed 8-bit moment of one tensor: the two words of each of its blocks and its codes (Note
// [8-bit maps]); at(o) is the part from element o (a multiple of kQBlock) on.
template <typename C>
struct Packed {
  unsigned int* words;
  C* codes;
  Packed at(int64_t o) const { return {words + 2 * (o / kQBlock), codes + o}; }
};

template <typename C>
FUSEDOPT_INLINE Packed<C> packed(void* data, int64_t codes_offset) {
  unsigned char* bytes = static_cast<unsigned char*>(data);
  return {reinterpret_cast<unsigned int*>(bytes), reinterpret_cast<C*>(bytes + codes_offset)};
}

// BlockTop of a block of n <= kBlock values: one integer max per element, in a simd reduction
// (any order gives the same result); only inf and NaN lie at 0x7f800000 or above.
FUSEDOPT_INLINE BlockTop block_top(const float* __restrict__ x, int64_t n) {
  unsigned int top = 0;
#pragma omp simd reduction(max : top)
  for (int64_t k = 0; k < n; ++k) {
    const unsigned int a = float_bits(x[k]) & 0x7fffffffu;
    top = a > top ? a : top;
  }
  return {bits_float(top), top < kInfBits};
}

// The root map's words of a block whose roots' largest bit pattern (without sign) is top and
// smallest nonzero one is low (0xffffffff: none): T = top and the shift (Note [8-bit maps]); a
// block that is not finite gets (NaN, 0).
struct RootWords {
  unsigned int top;
  int sh;
  bool finite;
};

FUSEDOPT_INLINE RootWords root_words(unsigned int top, unsigned int low) {
  if (top >= kInfBits) return {kNanWord, 0, false};
  return {top, q8_root_shift(top, low == 0xffffffffu ? top : low), true};
}

// V[mag] of the dynamic map and the thresholds of q8_dynamic_code (Note [8-bit maps]), made once.
inline const float* dynamic_units() {
  static const auto table = [] {
    std::array<float, 128> t{};
    for (int c = 0; c < 128; ++c) t[c] = q8_dynamic_unit(c);
    return t;
  }();
  return table.data();
}

inline const float* dynamic_thresholds() {
  static const auto table = [] {
    std::array<float, kDynamicThresholds> t{};
    for (int c = 0; c < kDynamicThresholds; ++c) t[c] = q8_dynamic_threshold(c);
    return t;
  }();
  return table.data();
}

// The weights of a block as float32: w itself when it is float32, else converted into buf (a
// copy of float32 weights would cost a pass over them).
template <typename W>
FUSEDOPT_INLINE const float* float_block(const W* __restrict__ w, int64_t n,
                                         float* __restrict__ buf) {
  if constexpr (std::is_same_v<W, float>) {
    return w;
  } else {
    for (int64_t k = 0; k < n; ++k) buf[k] = static_cast<float>(w[k]);
    return buf;
  }
}

// LAMB pass 1 with bf16 moments: m rounded to nearest even, v stochastically; u from the stored
// values (what pass 2 reads).
template <typename W, typename G>
FUSEDOPT_INLINE void lamb_pass1_chunk_bf16(const W* __restrict__ w, const G* __restrict__ g,
                                           uint16_t* __restrict__ m, uint16_t* __restrict__ v,
                                           int64_t n, const LambCoef<float> c, const float gm,
                                           double* out, unsigned int base, int64_t e0) {
  alignas(64) float wb[kBlock];
  alignas(64) float ub[kBlock];
  SqSum w_sq, u_sq;
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t len = std::min(kBlock, n - b);
    prefetch_block(w, b, n, nullptr, 0);  // Note [write prefetch]
    prefetch_block(g, b, n, nullptr, 0);
    prefetch_block(m, b, n, nullptr, 0);
    prefetch_block(v, b, n, nullptr, 0);
    for (int64_t k = 0; k < len; ++k) {
      float mk = bf16_value(m[b + k]);
      float vk = bf16_value(v[b + k]);
      lamb_moments<float>(static_cast<float>(g[b + k]) * gm, mk, vk, c);
      const uint16_t mq = bf16_rne(mk);
      const uint16_t vq = bf16_stochastic(vk, sr_bits(base, e0 + b + k));
      m[b + k] = mq;
      v[b + k] = vq;
      const float wk = static_cast<float>(w[b + k]);
      wb[k] = wk;
      ub[k] = lamb_direction<float>(wk, bf16_value(mq), bf16_value(vq), c);
    }
    w_sq.add(wb, len);
    u_sq.add(ub, len);
  }
  out[0] = w_sq.total();
  out[1] = u_sq.total();
}

// The codes of a block widened to 32-bit lanes, and back: a loop over bytes and floats together
// vectorizes for 16 bytes at a time, one over 32-bit lanes for the ISA's whole width.
FUSEDOPT_INLINE void widen_codes(const int8_t* __restrict__ a, const uint8_t* __restrict__ b,
                                 int* __restrict__ ai, int* __restrict__ bi, int n) {
  for (int k = 0; k < n; ++k) ai[k] = a[k];
  for (int k = 0; k < n; ++k) bi[k] = b[k];
}

FUSEDOPT_INLINE void narrow_codes(const int* __restrict__ ai, const int* __restrict__ bi,
                                  int8_t* __restrict__ a, uint8_t* __restrict__ b, int n) {
  for (int k = 0; k < n; ++k) a[k] = static_cast<int8_t>(ai[k]);
  for (int k = 0; k < n; ++k) b[k] = static_cast<uint8_t>(bi[k]);
}

// LAMB pass 1 with 8-bit moments, block by block (Note [8-bit maps]): m = d*(s + eps) and
// v = s*s read from the stored codes, updated; the block's roots stored (stochastically), then
// the direction d = m / (s + eps) from the roots as stored, then u = c8*d + lambda*w from the
// directions as stored. The loops over a block count in 32-bit lanes (an int64_t counter
// widens the element index and the codes to 64-bit lanes).
template <typename W, typename G>
FUSEDOPT_INLINE void lamb_pass1_chunk_q8(const W* __restrict__ w, const G* __restrict__ g,
                                         Packed<int8_t> m, Packed<uint8_t> v, int64_t n,
                                         const LambCoef<float> c, const float gm, double* out,
                                         unsigned int base, int64_t e0) {
  alignas(64) float wb[kBlock];
  alignas(64) float mb[kBlock];
  alignas(64) float sb[kBlock];
  alignas(64) float ub[kBlock];
  alignas(64) int mi[kBlock];  // codes widened, so that the float loops run on full vectors
  alignas(64) int vi[kBlock];
  SqSum w_sq, u_sq;
  for (int64_t b = 0; b < n; b += kBlock) {
    const int len = static_cast<int>(std::min(kBlock, n - b));
    unsigned int* wm = m.words + 2 * (b / kQBlock);
    unsigned int* wv = v.words + 2 * (b / kQBlock);
    const float f0 = bits_float(wm[0]), eps0 = bits_float(wm[1]);
    const unsigned int top0 = wv[0];
    const int sh0 = static_cast<int>(wv[1]);
    int8_t* __restrict__ mc = m.codes + b;
    uint8_t* __restrict__ vc = v.codes + b;
    prefetch_block(w, b, n, nullptr, 0);  // Note [write prefetch]
    prefetch_block(g, b, n, nullptr, 0);
    prefetch_block(m.codes, b, n, nullptr, 0);
    prefetch_block(v.codes, b, n, nullptr, 0);
    widen_codes(mc, vc, mi, vi, len);
    const G* __restrict__ gb = g + b;
    unsigned int s_top = 0, s_low = 0xffffffffu;  // the root words' extremes (root_words)
#pragma omp simd reduction(max : s_top) reduction(min : s_low)
    for (int k = 0; k < len; ++k) {
      const float s0 = q8_root_value(vi[k], top0, sh0);
      float mk = mul_rn(q8_direction_value(mi[k], f0), add_rn(s0, eps0));
      float vk = mul_rn(s0, s0);
      lamb_moments<float>(static_cast<float>(gb[k]) * gm, mk, vk, c);
      mb[k] = mk;
      const float sk = std::sqrt(q8_saturate(vk));
      sb[k] = sk;
      const unsigned int bk = float_bits(sk) & 0x7fffffffu;
      s_top = bk > s_top ? bk : s_top;
      const unsigned int lk = bk == 0u ? 0xffffffffu : bk;
      s_low = lk < s_low ? lk : s_low;
    }
    const RootWords r = root_words(s_top, s_low);
    const unsigned int bits0 = sr_bits(base, static_cast<unsigned int>(e0 + b));
    unsigned int d_top = 0;  // the largest bit pattern of |d| (block_top)
    if (r.finite) {
#pragma omp simd reduction(max : d_top)
      for (int k = 0; k < len; ++k) {
        const unsigned int round = q8_root_stochastic(bits0 + sr_step(k), r.sh);
        const int cv = q8_root_code(sb[k], r.top, r.sh, round);
        vi[k] = cv;
        const float dk = div_rn(mb[k], add_rn(q8_root_value(cv, r.top, r.sh), c.eps8));
        mb[k] = dk;
        const unsigned int ak = float_bits(dk) & 0x7fffffffu;
        d_top = ak > d_top ? ak : d_top;
      }
    } else {  // codes 255 read as the NaN of the block's words
      for (int k = 0; k < len; ++k) vi[k] = 255;
      d_top = kNanWord;
    }
    wv[0] = r.top;
    wv[1] = static_cast<unsigned int>(r.sh);
    const float* __restrict__ wf = float_block(w + b, len, wb);
    const BlockTop t{bits_float(d_top), d_top < kInfBits};
    const float f = t.finite ? q8_direction_step(t.top) : std::numeric_limits<float>::quiet_NaN();
    const Scaling sc = q8_scaling(t.top, 127.0f);  // a tiny block is prescaled (P = 2^64)
    if (!t.finite) {  // coded 0, read as 0 * NaN
      for (int k = 0; k < len; ++k) mb[k] = 0.0f;
    }
#pragma omp simd
    for (int k = 0; k < len; ++k) {
      const int cm = q8_direction_code(mul_rn(mb[k], sc.p), sc.q);
      mi[k] = cm;
      ub[k] = add_rn(mul_rn(c.c8, q8_direction_value(cm, f)), mul_rn(c.lambda_in_u, wf[k]));
    }
    narrow_codes(mi, vi, mc, vc, len);
    wm[0] = float_bits(f);
    wm[1] = float_bits(c.eps8);
    w_sq.add(wf, len);
    u_sq.add(ub, len);
  }
  out[0] = w_sq.total();
  out[1] = u_sq.total();
}

// LAMB pass 2 with bf16 or 8-bit moments: u from the stored values (pass 1's u, bit for bit).
template <typename W, typename P>
FUSEDOPT_INLINE void lamb_pass2_chunk_bf16(W* __restrict__ w, P* __restrict__ p,
                                           const uint16_t* __restrict__ m,
                                           const uint16_t* __restrict__ v, int64_t n,
                                           const LambCoef<float> c, const float lr_phi,
                                           const float decay) {
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t end = std::min(n, b + kBlock);
    prefetch_block(w, b, n, nullptr, 0);  // Note [write prefetch]
    prefetch_block(m, b, n, nullptr, 0);
    prefetch_block(v, b, n, nullptr, 0);
    for (int64_t k = b; k < end; ++k) {
      const float wk = static_cast<float>(w[k]);
      const float u = lamb_direction<float>(wk, bf16_value(m[k]), bf16_value(v[k]), c);
      const float nw = lamb_apply<float>(wk, u, lr_phi, decay);
      w[k] = static_cast<W>(nw);
      store_param(p, k, nw);
    }
  }
}

// LAMB pass 2 with 8-bit moments: u = c8*d + lambda*w from the stored directions alone.
template <typename W, typename P>
FUSEDOPT_INLINE void lamb_pass2_chunk_q8(W* __restrict__ w, P* __restrict__ p,
                                         Packed<int8_t> m, int64_t n, const LambCoef<float> c,
                                         const float lr_phi, const float decay) {
  alignas(64) int mi[kBlock];
  for (int64_t b = 0; b < n; b += kBlock) {
    const int len = static_cast<int>(std::min(kBlock, n - b));
    prefetch_block(w, b, n, nullptr, 0);  // Note [write prefetch]
    prefetch_block(m.codes, b, n, nullptr, 0);
    const float f = bits_float(m.words[2 * (b / kQBlock)]);
    const int8_t* __restrict__ mc = m.codes + b;
    for (int k = 0; k < len; ++k) mi[k] = mc[k];
    W* __restrict__ wb = w + b;
#pragma omp simd
    for (int k = 0; k < len; ++k) {
      const float wk = static_cast<float>(wb[k]);
      const float u = add_rn(mul_rn(c.c8, q8_direction_value(mi[k], f)), mul_rn(c.lambda_in_u, wk));
      const float nw = lamb_apply<float>(wk, u, lr_phi, decay);
      wb[k] = static_cast<W>(nw);
      store_param(p, b + k, nw);
    }
  }
}

// LARS pass 2 with a bf16 buffer: the step from the new buffer, which is stored rounded to
// nearest even.
template <typename W, typename G, typename P>
FUSEDOPT_INLINE void lars_pass2_chunk_bf16(W* __restrict__ w, P* __restrict__ p,
                                           const G* __restrict__ g, uint16_t* __restrict__ v,
                                           int64_t n, const float gm, const LarsCoef<float> c) {
  for (int64_t k = 0; k < n; ++k) {
    const float wk = static_cast<float>(w[k]);
    const float d = lars_direction<float>(wk, static_cast<float>(g[k]) * gm, c);
    const float vk = lars_buffer<float>(d, bf16_value(v[k]), c);
    v[k] = bf16_rne(vk);
    const float nw = lars_step<float>(wk, d, vk, c);
    w[k] = static_cast<W>(nw);
    store_param(p, k, nw);
  }
}

// LARS pass 2 with an 8-bit buffer, block by block: the step from the new buffer, which is then
// stored in the dynamic map (Note [8-bit maps]).
template <typename W, typename G, typename P>
FUSEDOPT_INLINE void lars_pass2_chunk_q8(W* __restrict__ w, P* __restrict__ p,
                                         const G* __restrict__ g, Packed<int8_t> v, int64_t n,
                                         const float gm, const LarsCoef<float> c) {
  alignas(64) float vb[kBlock];
  alignas(64) float old[kBlock];
  alignas(64) int ci[kBlock];
  const float* __restrict__ units = dynamic_units();
  const float* __restrict__ thresholds = dynamic_thresholds();
  for (int64_t b = 0; b < n; b += kBlock) {
    const int len = static_cast<int>(std::min(kBlock, n - b));
    unsigned int* words = v.words + 2 * (b / kQBlock);
    const float a0 = bits_float(words[0]);
    int8_t* __restrict__ vc = v.codes + b;
    for (int k = 0; k < len; ++k) old[k] = q8_dynamic_value(vc[k], a0, units);
    W* __restrict__ wb = w + b;
    const G* __restrict__ gb = g + b;
#pragma omp simd
    for (int k = 0; k < len; ++k) {
      const float wk = static_cast<float>(wb[k]);
      const float d = lars_direction<float>(wk, static_cast<float>(gb[k]) * gm, c);
      const float vk = lars_buffer<float>(d, old[k], c);
      vb[k] = vk;
      const float nw = lars_step<float>(wk, d, vk, c);
      wb[k] = static_cast<W>(nw);
      store_param(p, b + k, nw);
    }
    const BlockTop t = block_top(vb, len);
    const Scaling sc = q8_scaling(t.top, 1.0f);
    if (t.finite) {
#pragma omp simd
      for (int k = 0; k < len; ++k) ci[k] = q8_dynamic_code(vb[k], sc, float_bits(t.top), thresholds);
      for (int k = 0; k < len; ++k) vc[k] = static_cast<int8_t>(ci[k]);
    } else {
      std::memset(vc, 0, static_cast<size_t>(len));
    }
    words[0] = t.finite ? float_bits(t.top) : kNanWord;
    words[1] = 0u;
  }
}

// ------------------------------------------------------------------------------- the passes
// Each runs one pass on checked lists after its operator or KeptLayout method has done the
// checks, the skip test (found_inf) and the version bumps.

// The frame both pass 1s share: the step counts advanced, the weights' and grads' dtypes
// dispatched, one parallel region in which chunk c writes its two partial sums to
// partial[2c, 2c + 1], and the per-tensor sums [n, 2]. make(TypeTag<W>, TypeTag<G>, t) returns the
// chunk function f(tensor, w, g, offset, len, out, next), w and g already offset to the chunk,
// next the next chunk or nullptr (for prefetching, Note [read-only prefetch]); f must be
// force-inlined (FUSEDOPT_INLINE_LAMBDA) so that it is compiled into each ISA clone.
template <typename Make>
at::Tensor run_pass1(const CheckedLists& d, const std::vector<const void*>& grads,
                     at::ScalarType g_dtype, const Make& make) {
  const std::vector<double> t = advance_steps(d.steps);
  std::vector<double> partial(2 * d.table.size());
  at::Tensor sums;
  dispatch_storage(d.weight_dtype, "weights", [&](auto w_tag) {
    using W = typename decltype(w_tag)::type;
    using T = ComputeT<W>;
    dispatch_storage(g_dtype, "grads", [&](auto g_tag) {
      using G = typename decltype(g_tag)::type;
      const auto f = make(w_tag, g_tag, t);
      void* const* wp = d.weights.data();
      const void* const* gp = grads.data();
      d.table.parallel_for([&](int64_t c, const Chunk& ch) FUSEDOPT_INLINE_LAMBDA {
        const int64_t i = ch.tensor, o = ch.offset;
        f(i, static_cast<const W*>(wp[i]) + o, static_cast<const G*>(gp[i]) + o, o, ch.len,
          &partial[2 * c], d.table.next(c));
      });
      sums = finish_sums<T>(d.table, partial, d.size());
    });
  });
  return sums;
}

// LARS pass 2 for weights of type W: run_lars_pass2, split by W between lars.cpp and
// lars_float.cpp so that the build compiles the two halves at once.
template <typename W>
void lars_pass2_for(const CheckedLists& d, const std::vector<const void*>& grads,
                    at::ScalarType g_dtype, const at::Tensor& sums, const LarsHyper& h,
                    const std::optional<at::Tensor>& grad_mult) {
  const int64_t n = d.size();
  const std::vector<double> t = read_steps(d.steps);
  using T = ComputeT<W>;
  dispatch_param_out<W>(!d.params.empty(), d.param_dtype, [&](auto p_tag) {
    using P = typename decltype(p_tag)::type;
    dispatch_storage(g_dtype, "grads", [&](auto g_tag) {
      using G = typename decltype(g_tag)::type;
      const std::vector<T> s = read_sums<T>(sums, n);
      std::vector<LarsCoef<T>> coef(n);
      for (int64_t i = 0; i < n; ++i) {
        coef[i] = lars_coef<T>(h, lars_trust_ratio<T>(s[2 * i], s[2 * i + 1], h), t[i]);
      }
      const T gm = grad_multiplier<T>(grad_mult);
      void* const* wp = d.weights.data();
      void* const* pp = d.params.empty() ? nullptr : d.params.data();
      const void* const* gp = grads.data();
      void* const* vp = d.state_a.data();
      const unsigned char* fmt = d.formats.data();
      const int64_t* off = d.codes_offset.data();
      d.table.parallel_for([&](int64_t, const Chunk& ch) FUSEDOPT_INLINE_LAMBDA {
        const int64_t i = ch.tensor, o = ch.offset;
        P* p = pp == nullptr ? nullptr : static_cast<P*>(pp[i]) + o;
        W* w = static_cast<W*>(wp[i]) + o;
        const G* g = static_cast<const G*>(gp[i]) + o;
        with_lars_variant(coef[i], [&](const LarsCoef<T>& c) FUSEDOPT_INLINE_LAMBDA {
          if constexpr (std::is_same_v<T, float>) {
            if (fmt[i] == kBf16State) {
              return lars_pass2_chunk_bf16<W, G, P>(w, p, g, static_cast<uint16_t*>(vp[i]) + o,
                                                    ch.len, gm, c);
            }
            if (fmt[i] == k8bitState) {
              return lars_pass2_chunk_q8<W, G, P>(w, p, g, packed<int8_t>(vp[i], off[i]).at(o),
                                                  ch.len, gm, c);
            }
          }
          lars_pass2_chunk<W, G, P, T>(w, p, g, static_cast<T*>(vp[i]) + o, ch.len, gm, c);
        });
      });
    });
  });
}

}  // namespace

at::Tensor run_lamb_pass1(const CheckedLists& d, const std::vector<const void*>& grads,
                          at::ScalarType g_dtype, const LambHyper& h,
                          const std::optional<at::Tensor>& grad_mult,
                          const std::optional<at::Tensor>& keys);
void run_lamb_pass2(const CheckedLists& d, const at::Tensor& sums, const LambHyper& h);
at::Tensor run_lars_pass1(const CheckedLists& d, const std::vector<const void*>& grads,
                          at::ScalarType g_dtype, const LarsHyper& h,
                          const std::optional<at::Tensor>& grad_mult);
void run_lars_pass2(const CheckedLists& d, const std::vector<const void*>& grads,
                    at::ScalarType g_dtype, const at::Tensor& sums, const LarsHyper& h,
                    const std::optional<at::Tensor>& grad_mult);
// run_lars_pass2 for float32 weights (lars_float.cpp)
void run_lars_pass2_float(const CheckedLists& d, const std::vector<const void*>& grads,
                          at::ScalarType g_dtype, const at::Tensor& sums, const LarsHyper& h,
                          const std::optional<at::Tensor>& grad_mult);

}  // namespace cpu
}  // namespace fusedopt
