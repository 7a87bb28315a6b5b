// CPU multi-tensor LAMB / LARS passes and sq_norms (docs/math.md, docs/backends.md).
//
// Each op does its per-tensor work (step counts, bias corrections, trust ratios) in a serial setup,
// then runs ONE parallel region over the chunks of all tensors of the bucket (multi_tensor.h).
// The per-element math is fusedopt/math.h; the chunk functors below only load, call it and store.
// Memory traffic per element and step is docs/math.md's model: LAMB pass 1 reads w, g, m, v and writes
// m, v; pass 2 reads w, m, v and writes w. LARS pass 1 reads w, g; pass 2 reads w, g, v and
// writes w, v. No parameter-sized temporary is allocated: only O(tensors + chunks) tables.
#include <cstring>
#include "ops.h"

#include <c10/core/impl/COW.h>
#include <fusedopt/checks.h>
#include <fusedopt/math.h>

#include <array>
#include <atomic>
#include <limits>
#include <mutex>
#include <type_traits>
#include <utility>
#include <vector>

#include "multi_tensor.h"

namespace fusedopt {
namespace cpu {
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

// ------------------------------------------------------------------------------ input checks

// The device policy of the shared checks of fusedopt/checks.h: CPU tensors.
struct OnCpu {
  static constexpr const char* kWho = "fusedopt cpp backend: ";
  static constexpr bool kEmptyListOk = true;
  static bool on_device(const at::Tensor& t, const at::Tensor&) { return t.device().is_cpu(); }
  static const char* elsewhere(const at::Tensor&) { return "; it runs on CPU tensors only"; }
  static const char* step_form(const at::Tensor&) { return "0-dim float32 CPU tensors"; }
};

using checks::same_layout;

at::ScalarType check_list(at::TensorList ts, at::TensorList weights, const char* name) {
  return checks::check_list<OnCpu>(ts, weights, name);
}

void check_steps(at::TensorList steps, at::TensorList weights) {
  checks::check_steps<OnCpu>(steps, weights);
}

using checks::compute_dtype;

// The value of an optional 0-dim CPU tensor (read from memory: no device synchronization).
double read_scalar(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.numel() == 1, "fusedopt cpp backend: ", name,
              " must be a one-element CPU tensor, got shape ", t.sizes(), " on ", t.device());
  return t.item<double>();
}

bool step_skipped(const std::optional<at::Tensor>& found_inf) {
  return found_inf.has_value() && read_scalar(*found_inf, "found_inf") != 0.0;
}

template <typename T>
T grad_multiplier(const std::optional<at::Tensor>& grad_mult) {
  return grad_mult.has_value() ? static_cast<T>(read_scalar(*grad_mult, "grad_mult")) : T(1);
}

// ------------------------------------------------------------------------- hyper-parameters

constexpr const char* kWho = "fusedopt cpp backend: ";

LambHyper lamb_hyper(const at::Tensor& hyper, const std::optional<at::Tensor>& lr) {
  LambHyper h = lamb_hyper_from(hyper, kWho);
  if (lr.has_value()) h.lr = read_scalar(*lr, "lr");
  return h;
}

LarsHyper lars_hyper(const at::Tensor& hyper, const std::optional<at::Tensor>& lr) {
  LarsHyper h = lars_hyper_from(hyper, kWho);
  if (lr.has_value()) h.lr = read_scalar(*lr, "lr");
  return h;
}

// Note [version counters]: the passes write tensors in place, as torch's in-place ops do, and so
// bump the version counter of every tensor they write (autograd then detects a tensor saved for
// backward that a step modified). Inference tensors have no counter. A skipped step (found_inf)
// writes nothing and bumps nothing. The bumps run in one loop before the pass's parallel region:
// bumped inside the region, in the first chunk of each tensor, each atomic increment had to wait
// for the chunk loop's pending stores (docs/performance.md, "Measurements behind the Notes").
void bump_versions(std::initializer_list<const TensorPtrs*> lists) {
  for (const TensorPtrs* ts : lists) {
    for (const at::Tensor* t : *ts) {
      c10::TensorImpl* impl = t->unsafeGetTensorImpl();
      if (impl->version_counter().enabled()) impl->bump_version();
    }
  }
}

// Adds 1 to every step count and returns the new counts t (the serial setup of pass 1).
std::vector<double> advance_steps(const std::vector<float*>& steps) {
  std::vector<double> t(steps.size());
  for (size_t i = 0; i < steps.size(); ++i) {
    *steps[i] = *steps[i] + 1.0f;
    t[i] = static_cast<double>(*steps[i]);
  }
  return t;
}

std::vector<double> read_steps(const std::vector<float*>& steps) {
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

std::vector<int64_t> numels(at::TensorList ts) {
  std::vector<int64_t> n(ts.size());
  for (size_t i = 0; i < ts.size(); ++i) n[i] = ts[i].numel();
  return n;
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

// Sum of squares of the n elements of x, prefetched block by block, on into the next_bytes at
// next (Note [read-only prefetch]).
template <typename S>
FUSEDOPT_INLINE double sq_sum(const S* __restrict__ x, int64_t n, const void* next,
                              int64_t next_bytes) {
  SqSum acc;
  for (int64_t b = 0; b < n; b += kBlock) {
    prefetch_block(x, b, n, next, next_bytes);
    acc.add(x + b, std::min(kBlock, n - b));
  }
  return acc.total();
}

// The same for elements [offset, offset + n) of a tensor of a supported dtype.
FUSEDOPT_INLINE double sq_sum(at::ScalarType dtype, const void* data, int64_t offset, int64_t n,
                              const void* next, int64_t next_bytes) {
  switch (dtype) {
    case at::kFloat:
      return sq_sum(static_cast<const float*>(data) + offset, n, next, next_bytes);
    case at::kDouble:
      return sq_sum(static_cast<const double*>(data) + offset, n, next, next_bytes);
    case at::kBFloat16:
      return sq_sum(static_cast<const c10::BFloat16*>(data) + offset, n, next, next_bytes);
    case at::kHalf:
      return sq_sum(static_cast<const c10::Half*>(data) + offset, n, next, next_bytes);
    default: return 0.0;
  }
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
const float* dynamic_units() {
  static const auto table = [] {
    std::array<float, 128> t{};
    for (int c = 0; c < 128; ++c) t[c] = q8_dynamic_unit(c);
    return t;
  }();
  return table.data();
}

const float* dynamic_thresholds() {
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
  for (int64_t k = 0; k < n; ++k) {
    const float wk = static_cast<float>(w[k]);
    const float u = lamb_direction<float>(wk, bf16_value(m[k]), bf16_value(v[k]), c);
    const float nw = lamb_apply<float>(wk, u, lr_phi, decay);
    w[k] = static_cast<W>(nw);
    store_param(p, k, nw);
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

// ------------------------------------------------------------------------- checked lists

// Checks the lists that a kept layout keeps from step to step (Note [kept layout] in ops.h) and
// returns the weights' dtype. params may be empty (no masters), state_b too (LARS), and both state
// lists for an operator whose pass reads no state.
at::ScalarType check_kept_lists(at::TensorList weights, at::TensorList params,
                                at::TensorList state_a, at::TensorList state_b,
                                at::TensorList steps, std::vector<unsigned char>& formats) {
  const at::ScalarType w_dtype = check_list(weights, weights, "weights");
  if (!params.empty()) check_list(params, weights, "params");
  const at::ScalarType compute = compute_dtype(w_dtype);
  formats.assign(weights.size(), kFullState);
  if (!state_a.empty()) {
    checks::check_state_formats<OnCpu>(state_a, weights, compute, "state", formats);
  }
  if (!state_b.empty()) {
    std::vector<unsigned char> formats_b;
    checks::check_state_formats<OnCpu>(state_b, weights, compute, "state", formats_b);
    for (size_t i = 0; i < formats.size(); ++i) {
      TORCH_CHECK(formats[i] == formats_b[i], kWho, "the two moments of weight ", i,
                  " are stored in different formats (", state_a[i].scalar_type(), " and ",
                  state_b[i].scalar_type(), "); Note [state formats]");
    }
  }
  check_steps(steps, weights);
  return w_dtype;
}

std::vector<void*> data_ptrs(at::TensorList ts) {
  std::vector<void*> p(ts.size());
  // mutable: each static list is written by one pass or the other (a copy-on-write storage is
  // materialized here, before the pointer is kept)
  for (size_t i = 0; i < ts.size(); ++i) p[i] = ts[i].mutable_data_ptr();
  return p;
}

std::vector<const void*> const_data_ptrs(const TensorPtrs& ts) {
  std::vector<const void*> p(ts.size());
  for (size_t i = 0; i < ts.size(); ++i) p[i] = ts[i]->const_data_ptr();
  return p;
}

// The tensors a list points to, as a list of tensors (for the checks, which take TensorLists).
std::vector<at::Tensor> tensors(const TensorPtrs& ts) {
  std::vector<at::Tensor> out;
  out.reserve(ts.size());
  for (const at::Tensor* t : ts) out.push_back(*t);
  return out;
}

TensorPtrs ptrs(at::TensorList ts) {
  TensorPtrs out(ts.size());
  for (size_t i = 0; i < ts.size(); ++i) out[i] = &ts[i];
  return out;
}

}  // namespace

// Note [checked lists]: the chunk loops of a pass need only the dtypes and data pointers of a
// bucket's lists and its chunk table. A kept layout checks its lists and builds these once; at each
// later bind it only looks whether the lists it is given are the tensors the checks saw
// (Fingerprints: device, dtype, sizes, strides, data pointer, not copy-on-write; a few inline
// loads per tensor). If one is not (`p.data = ...`, `model.to(memory_format=...)`,
// `share_memory_()`, a lazy clone, a state tensor replaced), bind says so and the caller checks
// everything again, naming what is wrong. The look is shared by the threads (tensor ranges, above
// kTensorGrain tensors). The grads, new every step, are checked at every bind. Checking every list
// in every pass cost a few microseconds per tensor and step (docs/performance.md, "Measurements
// behind the Notes").
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
               at::TensorList b, at::TensorList s, std::vector<unsigned char> f)
      : weight_dtype(w_dtype),
        param_dtype(p.empty() ? w_dtype : p[0].scalar_type()),
        weights(data_ptrs(w)),
        params(data_ptrs(p)),
        state_a(data_ptrs(a)),
        state_b(data_ptrs(b)),
        steps(s.size()),
        formats(std::move(f)),
        codes_offset(w.size(), 0),
        table(numels(w)) {
    for (size_t i = 0; i < s.size(); ++i) steps[i] = s[i].mutable_data_ptr<float>();
    for (size_t i = 0; i < formats.size(); ++i) {
      low_precision |= formats[i] != kFullState;
      if (formats[i] == k8bitState) codes_offset[i] = q8_codes_offset(w[i].numel());
    }
  }
  int64_t size() const { return static_cast<int64_t>(weights.size()); }
};

// Note [prefetched metadata]: a loop over thousands of tensors' metadata (TensorImpl, ~4 cache
// lines, and its StorageImpl, each a separate heap object) waits on a cache miss per object; the
// loops that run every step prefetch the objects of tensor j + kAheadImpl (and the StorageImpl of
// tensor j + kAheadStorage, whose TensorImpl came in before) while looking at tensor j
// (docs/performance.md, "Measurements behind the Notes").
constexpr size_t kAheadImpl = 16;
constexpr size_t kAheadStorage = 8;

inline void prefetch_metadata(const TensorPtrs& ts, size_t j, size_t end) {
  if (j + kAheadImpl < end) {
    const char* a = reinterpret_cast<const char*>(ts[j + kAheadImpl]->unsafeGetTensorImpl());
    for (size_t b = 0; b < sizeof(c10::TensorImpl); b += 64) __builtin_prefetch(a + b);
  }
  if (j + kAheadStorage < end) {
    const c10::TensorImpl* t = ts[j + kAheadStorage]->unsafeGetTensorImpl();
    __builtin_prefetch(t->unsafe_storage().unsafeGetStorageImpl());  // may be null: harmless
  }
}

// What the checks saw of each tensor of some lists (Note [checked lists]).
class Fingerprints {
 public:
  void add(const TensorPtrs& ts) {
    lists_.push_back({seen_.size(), ts.size()});
    for (const at::Tensor* t : ts) {
      c10::TensorImpl* i = t->unsafeGetTensorImpl();
      seen_.push_back(
          {i->mutable_data(), i->dtype(), i->device_type(), geometry_.size(), i->dim()});
      geometry_.insert(geometry_.end(), i->sizes().begin(), i->sizes().end());
      geometry_.insert(geometry_.end(), i->strides().begin(), i->strides().end());
    }
  }

  // Whether the tensors [begin, end) of each of the lists (given in the order they were added)
  // still look as they did; a range of each list, so that threads can share the looking.
  template <typename Lists>
  bool unchanged(const Lists& lists, size_t begin, size_t end) const {
    if (lists.size() != lists_.size()) return false;
    for (size_t l = 0; l < lists_.size(); ++l) {
      const TensorPtrs& ts = *lists[l];
      if (ts.size() != lists_[l].size) return false;
      const size_t stop = std::min(end, ts.size());
      for (size_t j = begin; j < stop; ++j) {
        prefetch_metadata(ts, j, stop);
        if (!same(ts[j]->unsafeGetTensorImpl(), seen_[lists_[l].first + j])) return false;
      }
    }
    return true;
  }

 private:
  struct List {
    size_t first;  // its first tensor in seen_
    size_t size;
  };
  struct Seen {
    void* data;
    caffe2::TypeMeta dtype;
    c10::DeviceType device;
    size_t geometry_at;  // dim sizes then dim strides in geometry_
    int64_t dim;
  };

  // Read-only, so that threads can look at tensors that share a storage: a copy-on-write storage
  // counts as changed (the recheck, on one thread, materializes it as the operators do).
  bool same(const c10::TensorImpl* i, const Seen& s) const {
    if (i->device_type() != s.device || i->dtype() != s.dtype || i->dim() != s.dim) return false;
    const int64_t* g = geometry_.data() + s.geometry_at;
    const c10::IntArrayRef sizes = i->sizes(), strides = i->strides();
    if (!std::equal(sizes.begin(), sizes.end(), g) ||
        !std::equal(strides.begin(), strides.end(), g + s.dim) || !i->has_storage()) {
      return false;
    }
    const c10::Storage& storage = i->unsafe_storage();
    return !c10::impl::cow::is_cow_data_ptr(storage.data_ptr()) && i->data() == s.data;
  }

  std::vector<List> lists_;
  std::vector<Seen> seen_;
  std::vector<int64_t> geometry_;
};

namespace {

// ------------------------------------------------------------------------------- the passes
// Each runs one pass on checked lists after its operator or BucketLists method has done the
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

// The random bits of stochastic rounding of one tensor (Note [state formats]): element e of a
// chunk at offset o draws sr_bits(base, first + o + e).
struct SrKey {
  unsigned int base;
  unsigned int first;
};

// The SrKey of each tensor: its key is keys[i], or i without keys.
std::vector<SrKey> sr_keys(const CheckedLists& d, const std::vector<double>& t,
                           const std::optional<at::Tensor>& keys) {
  std::vector<SrKey> out(d.size(), SrKey{0, 0});
  if (!d.low_precision) return out;
  const int64_t* k = nullptr;
  at::Tensor kt;
  if (keys.has_value()) {
    kt = keys->to(at::kCPU, at::kLong).contiguous();
    TORCH_CHECK(kt.numel() == d.size(), kWho, "keys must hold one key per weight (", d.size(),
                "), got ", kt.numel());
    k = kt.const_data_ptr<int64_t>();
  }
  for (int64_t i = 0; i < d.size(); ++i) {
    const int64_t key = k != nullptr ? k[i] : i;
    out[i] = {sr_base(t[i], key), sr_first(key)};
  }
  return out;
}

at::Tensor run_lamb_pass1(const CheckedLists& d, const std::vector<const void*>& grads,
                          at::ScalarType g_dtype, const LambHyper& h,
                          const std::optional<at::Tensor>& grad_mult,
                          const std::optional<at::Tensor>& keys) {
  return run_pass1(d, grads, g_dtype, [&](auto w_tag, auto g_tag, const std::vector<double>& t) {
    using W = typename decltype(w_tag)::type;
    using G = typename decltype(g_tag)::type;
    using T = ComputeT<W>;
    void* const* mp = d.state_a.data();
    void* const* vp = d.state_b.data();
    return [coef = lamb_coefs<T>(h, t), gm = grad_multiplier<T>(grad_mult), mp, vp,
            sr = sr_keys(d, t, keys), fmt = d.formats.data(), off = d.codes_offset.data()](
               int64_t i, const W* w, const G* g, int64_t o, int64_t len, double* out,
               const Chunk*) FUSEDOPT_INLINE_LAMBDA {
      if constexpr (std::is_same_v<T, float>) {
        if (fmt[i] == kBf16State) {
          return lamb_pass1_chunk_bf16<W, G>(w, g, static_cast<uint16_t*>(mp[i]) + o,
                                             static_cast<uint16_t*>(vp[i]) + o, len, coef[i], gm,
                                             out, sr[i].base, sr[i].first + o);
        }
        if (fmt[i] == k8bitState) {
          return lamb_pass1_chunk_q8<W, G>(w, g, packed<int8_t>(mp[i], off[i]).at(o),
                                           packed<uint8_t>(vp[i], off[i]).at(o), len, coef[i], gm,
                                           out, sr[i].base, sr[i].first + o);
        }
      }
      lamb_pass1_chunk<W, G, T>(w, g, static_cast<T*>(mp[i]) + o, static_cast<T*>(vp[i]) + o, len,
                                coef[i], gm, out);
    };
  });
}

void run_lamb_pass2(const CheckedLists& d, const at::Tensor& sums, const LambHyper& h) {
  const int64_t n = d.size();
  const std::vector<double> t = read_steps(d.steps);
  dispatch_storage(d.weight_dtype, "weights", [&](auto w_tag) {
    using W = typename decltype(w_tag)::type;
    using T = ComputeT<W>;
    dispatch_param_out<W>(!d.params.empty(), d.param_dtype, [&](auto p_tag) {
      using P = typename decltype(p_tag)::type;
      const std::vector<T> s = read_sums<T>(sums, n);
      const std::vector<LambCoef<T>> coef = lamb_coefs<T>(h, t);
      std::vector<T> lr_phi(n);
      for (int64_t i = 0; i < n; ++i) {
        lr_phi[i] = static_cast<T>(h.lr) * lamb_trust_ratio<T>(s[2 * i], s[2 * i + 1], h);
      }
      const T decay = lamb_decay<T>(h, h.lr);
      void* const* wp = d.weights.data();
      void* const* pp = d.params.empty() ? nullptr : d.params.data();
      void* const* mp = d.state_a.data();
      void* const* vp = d.state_b.data();
      const unsigned char* fmt = d.formats.data();
      const int64_t* off = d.codes_offset.data();
      d.table.parallel_for([&](int64_t, const Chunk& ch) FUSEDOPT_INLINE_LAMBDA {
        const int64_t i = ch.tensor, o = ch.offset;
        P* p = pp == nullptr ? nullptr : static_cast<P*>(pp[i]) + o;
        W* w = static_cast<W*>(wp[i]) + o;
        if constexpr (std::is_same_v<T, float>) {
          if (fmt[i] == kBf16State) {
            return lamb_pass2_chunk_bf16<W, P>(w, p, static_cast<const uint16_t*>(mp[i]) + o,
                                               static_cast<const uint16_t*>(vp[i]) + o, ch.len,
                                               coef[i], lr_phi[i], decay);
          }
          if (fmt[i] == k8bitState) {
            return lamb_pass2_chunk_q8<W, P>(w, p, packed<int8_t>(mp[i], off[i]).at(o), ch.len,
                                             coef[i], lr_phi[i], decay);
          }
        }
        lamb_pass2_chunk<W, P, T>(w, p, static_cast<const T*>(mp[i]) + o,
                                  static_cast<const T*>(vp[i]) + o, ch.len, coef[i], lr_phi[i],
                                  decay);
      });
    });
  });
}

at::Tensor run_lars_pass1(const CheckedLists& d, const std::vector<const void*>& grads,
                          at::ScalarType g_dtype, const LarsHyper& h,
                          const std::optional<at::Tensor>& grad_mult) {
  return run_pass1(d, grads, g_dtype, [&](auto w_tag, auto g_tag, const std::vector<double>&) {
    using W = typename decltype(w_tag)::type;
    using G = typename decltype(g_tag)::type;
    using T = ComputeT<W>;
    return [gm = grad_multiplier<T>(grad_mult), lambda = static_cast<T>(h.weight_decay),
            combined = h.combined, wp = d.weights.data(), gp = grads.data()](
               int64_t, const W* w, const G* g, int64_t, int64_t len, double* out,
               const Chunk* next) FUSEDOPT_INLINE_LAMBDA {
      const W* w_next = nullptr;  // Note [read-only prefetch]
      const G* g_next = nullptr;
      int64_t n_next = 0;
      if (next != nullptr) {
        w_next = static_cast<const W*>(wp[next->tensor]) + next->offset;
        g_next = static_cast<const G*>(gp[next->tensor]) + next->offset;
        n_next = next->len;
      }
      if (combined) {
        lars_pass1_chunk<true, W, G, T>(w, g, len, gm, lambda, out, w_next, g_next, n_next);
      } else {
        lars_pass1_chunk<false, W, G, T>(w, g, len, gm, lambda, out, w_next, g_next, n_next);
      }
    };
  });
}

void run_lars_pass2(const CheckedLists& d, const std::vector<const void*>& grads,
                    at::ScalarType g_dtype, const at::Tensor& sums, const LarsHyper& h,
                    const std::optional<at::Tensor>& grad_mult) {
  const int64_t n = d.size();
  const std::vector<double> t = read_steps(d.steps);
  dispatch_storage(d.weight_dtype, "weights", [&](auto w_tag) {
    using W = typename decltype(w_tag)::type;
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
  });
}

}  // namespace

// ------------------------------------------------------------------------------------- ops

namespace {

// Per-tensor Σx² of the tensors at ptrs (dtypes[i]) over the chunks of table: float64 when
// any_double, else float32.
at::Tensor sq_norms_over(const ChunkTable& table, const std::vector<at::ScalarType>& dtypes,
                         const std::vector<const void*>& ptrs, bool any_double) {
  const int64_t n = static_cast<int64_t>(ptrs.size());
  std::vector<double> partial(table.size());
  table.parallel_for([&](int64_t c, const Chunk& ch) FUSEDOPT_INLINE_LAMBDA {
    const void* next = nullptr;  // Note [read-only prefetch]
    int64_t next_bytes = 0;
    if (const Chunk* nx = table.next(c)) {
      const int64_t size = static_cast<int64_t>(c10::elementSize(dtypes[nx->tensor]));
      next = static_cast<const char*>(ptrs[nx->tensor]) + nx->offset * size;
      next_bytes = nx->len * size;
    }
    partial[c] = sq_sum(dtypes[ch.tensor], ptrs[ch.tensor], ch.offset, ch.len, next, next_bytes);
  });
  at::Tensor out = at::empty({n}, at::dtype(any_double ? at::kDouble : at::kFloat));
  if (any_double) {
    reduce_partials<double, 1>(table, partial, out.data_ptr<double>(), n);
  } else {
    reduce_partials<float, 1>(table, partial, out.data_ptr<float>(), n);
  }
  return out;
}

}  // namespace

at::Tensor sq_norms(at::TensorList tensors) {
  const int64_t n = static_cast<int64_t>(tensors.size());
  bool any_double = false;
  std::vector<at::Tensor> dense(tensors.begin(), tensors.end());
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(dense[i].device().is_cpu(), "fusedopt cpp backend: sq_norms got a tensor on ",
                dense[i].device(), "; it runs on CPU tensors only");
    any_double |= dense[i].scalar_type() == at::kDouble;
    // A dense tensor's elements fill [data_ptr, data_ptr + numel) in some order; others are
    // copied (never the case for the buckets of an optimizer step).
    if (!dense[i].is_non_overlapping_and_dense()) dense[i] = dense[i].contiguous();
  }
  std::vector<at::ScalarType> dtypes(n);
  std::vector<const void*> ptrs(n);
  for (int64_t i = 0; i < n; ++i) {
    dtypes[i] = dense[i].scalar_type();
    ptrs[i] = dense[i].const_data_ptr();
    dispatch_storage(dtypes[i], "sq_norms inputs", [](auto) {});  // rejects other dtypes
  }
  return sq_norms_over(ChunkTable(numels(dense)), dtypes, ptrs, any_double);
}

// The operators: a layout made, checked and bound for one call (Note [kept layout] in ops.h).
namespace {

// Binds the lists to k, checking them all (the lists live as long as the operator's call).
KeptLayout& bound(KeptLayout&& k, at::TensorList weights, at::TensorList params,
                  at::TensorList state_a, at::TensorList state_b, at::TensorList steps,
                  at::TensorList grads) {
  k.bind({ptrs(weights), ptrs(params), ptrs(state_a), ptrs(state_b), ptrs(steps), ptrs(grads)},
         at::kFloat, /*check=*/true);
  return k;
}

}  // namespace

at::Tensor lamb_pass1(at::TensorList weights, at::TensorList grads, at::TensorList exp_avgs,
                      at::TensorList exp_avg_sqs, at::TensorList steps, const at::Tensor& hyper,
                      const std::optional<at::Tensor>& grad_mult,
                      const std::optional<at::Tensor>& found_inf,
                      const std::optional<at::Tensor>& keys) {
  return bound(KeptLayout(), weights, {}, exp_avgs, exp_avg_sqs, steps, grads)
      .lamb_pass1(hyper, grad_mult, found_inf, keys);
}

void lamb_pass2(at::TensorList weights, at::TensorList params, at::TensorList exp_avgs,
                at::TensorList exp_avg_sqs, at::TensorList steps, const at::Tensor& sums,
                const at::Tensor& hyper, const std::optional<at::Tensor>& lr,
                const std::optional<at::Tensor>& found_inf) {
  bound(KeptLayout(), weights, params, exp_avgs, exp_avg_sqs, steps, {}).lamb_pass2(sums, hyper, lr, found_inf);
}

at::Tensor lars_pass1(at::TensorList weights, at::TensorList grads, at::TensorList steps,
                      const at::Tensor& hyper, const std::optional<at::Tensor>& grad_mult,
                      const std::optional<at::Tensor>& found_inf) {
  return bound(KeptLayout(), weights, {}, {}, {}, steps, grads).lars_pass1(hyper, grad_mult, found_inf);
}

void lars_pass2(at::TensorList weights, at::TensorList params, at::TensorList grads,
                at::TensorList momentum_buffers, at::TensorList steps, const at::Tensor& sums,
                const at::Tensor& hyper, const std::optional<at::Tensor>& lr,
                const std::optional<at::Tensor>& grad_mult,
                const std::optional<at::Tensor>& found_inf) {
  bound(KeptLayout(), weights, params, momentum_buffers, {}, steps, grads)
      .lars_pass2(sums, hyper, lr, grad_mult, found_inf);
}

// ------------------------------------------------------------------------------ KeptLayout

KeptLayout::KeptLayout() = default;
KeptLayout::~KeptLayout() = default;

bool KeptLayout::bind(std::array<TensorPtrs, 6> lists, at::ScalarType grad_dtype, bool check) {
  const std::lock_guard<std::mutex> lock(mutex_);  // Note [one call at a time]
  bound_.reset();
  Bound b{std::move(lists[0]), std::move(lists[1]), std::move(lists[2]), std::move(lists[3]),
          std::move(lists[4]), std::move(lists[5]), grad_dtype};
  if (!check) {
    // the grads must have the dtype they had when checked: the kernels were chosen for it
    if (checked_ == nullptr || grad_dtype != checked_grad_dtype_ || !unchanged(b) ||
        !grads_fit(b)) {
      return false;
    }
    bound_ = std::move(b);
    return true;
  }
  checked_.reset();
  fingerprints_.reset();
  const std::vector<at::Tensor> w = tensors(b.weights), p = tensors(b.params),
                                sa = tensors(b.state_a), sb = tensors(b.state_b),
                                st = tensors(b.steps);
  std::vector<unsigned char> formats;
  const at::ScalarType w_dtype = check_kept_lists(w, p, sa, sb, st, formats);
  if (!b.grads.empty()) b.grad_dtype = check_list(tensors(b.grads), w, "grads");
  auto fp = std::make_unique<Fingerprints>();
  for (const TensorPtrs* ts : kept_lists(b)) fp->add(*ts);
  checked_ = std::make_unique<CheckedLists>(w_dtype, w, p, sa, sb, st, std::move(formats));
  checked_grad_dtype_ = b.grad_dtype;
  fingerprints_ = std::move(fp);
  bound_ = std::move(b);
  return true;
}

void KeptLayout::end() {
  const std::lock_guard<std::mutex> lock(mutex_);  // Note [one call at a time]
  bound_.reset();
}

std::array<const TensorPtrs*, 5> KeptLayout::kept_lists(const Bound& b) {
  return {&b.weights, &b.params, &b.state_a, &b.state_b, &b.steps};
}

bool KeptLayout::unchanged(const Bound& b) const {
  const std::array<const TensorPtrs*, 5> lists = kept_lists(b);
  std::atomic<bool> same{true};
  at::parallel_for(0, static_cast<int64_t>(b.weights.size()), kTensorGrain,
                   [&](int64_t begin, int64_t end) {
                     if (!fingerprints_->unchanged(lists, begin, end)) same = false;
                   });
  return same && b.weights.size() == static_cast<size_t>(checked_->size());
}

bool KeptLayout::grads_fit(const Bound& b) const {
  if (b.grads.size() != b.weights.size()) return false;
  for (size_t i = 0; i < b.grads.size(); ++i) {
    const at::Tensor& g = *b.grads[i];
    if (!g.defined() || g.layout() != at::kStrided || g.scalar_type() != b.grad_dtype ||
        !g.device().is_cpu() || !g.is_non_overlapping_and_dense() ||
        !same_layout(g, *b.weights[i])) {
      return false;
    }
  }
  return true;
}

const KeptLayout::Bound& KeptLayout::bound() const {
  TORCH_CHECK(bound_.has_value() && checked_ != nullptr, kWho, "no lists bound (bind() first)");
  return *bound_;
}

// The bound state lists hold `lists` of the weights' length each, and the grads too if `grads`.
void require(const TensorPtrs& weights, std::initializer_list<const char*> names,
             std::initializer_list<const TensorPtrs*> lists) {
  auto name = names.begin();
  for (const TensorPtrs* l : lists) {
    TORCH_CHECK(l->size() == weights.size(), kWho, "this pass needs ", *name, " for each of the ",
                weights.size(), " weights, got ", l->size());
    ++name;
  }
}

at::Tensor KeptLayout::grad_sq_norms() {
  const std::lock_guard<std::mutex> lock(mutex_);  // Note [one call at a time]
  const Bound& b = bound();
  require(b.weights, {"grads"}, {&b.grads});
  if (b.grads.empty()) return at::zeros({0}, at::dtype(at::kFloat));
  const std::vector<at::ScalarType> dtypes(b.grads.size(), b.grad_dtype);
  // the bound grads have the weights' numels (grads_fit, check_list): the checked table serves
  return sq_norms_over(checked_->table, dtypes, const_data_ptrs(b.grads),
                       b.grad_dtype == at::kDouble);
}

at::Tensor KeptLayout::lamb_pass1(const at::Tensor& hyper,
                                  const std::optional<at::Tensor>& grad_mult,
                                  const std::optional<at::Tensor>& found_inf,
                                  const std::optional<at::Tensor>& keys) {
  const std::lock_guard<std::mutex> lock(mutex_);  // Note [one call at a time]
  const Bound& b = bound();
  require(b.weights, {"grads", "exp_avgs", "exp_avg_sqs"}, {&b.grads, &b.state_a, &b.state_b});
  const LambHyper h = lamb_hyper(hyper, std::nullopt);
  const int64_t n = checked_->size();
  if (n == 0 || step_skipped(found_inf)) {
    return at::zeros({n, 2}, at::dtype(compute_dtype(checked_->weight_dtype)));
  }
  bump_versions({&b.state_a, &b.state_b, &b.steps});
  return run_lamb_pass1(*checked_, const_data_ptrs(b.grads), b.grad_dtype, h, grad_mult, keys);
}

void KeptLayout::lamb_pass2(const at::Tensor& sums, const at::Tensor& hyper,
                            const std::optional<at::Tensor>& lr,
                            const std::optional<at::Tensor>& found_inf) {
  const std::lock_guard<std::mutex> lock(mutex_);  // Note [one call at a time]
  const Bound& b = bound();
  require(b.weights, {"exp_avgs", "exp_avg_sqs"}, {&b.state_a, &b.state_b});
  const LambHyper h = lamb_hyper(hyper, lr);
  if (checked_->size() == 0 || step_skipped(found_inf)) return;
  bump_versions({&b.weights, &b.params});
  run_lamb_pass2(*checked_, sums, h);
}

at::Tensor KeptLayout::lars_pass1(const at::Tensor& hyper,
                                  const std::optional<at::Tensor>& grad_mult,
                                  const std::optional<at::Tensor>& found_inf) {
  const std::lock_guard<std::mutex> lock(mutex_);  // Note [one call at a time]
  const Bound& b = bound();
  require(b.weights, {"grads"}, {&b.grads});
  const LarsHyper h = lars_hyper(hyper, std::nullopt);
  const int64_t n = checked_->size();
  if (n == 0 || step_skipped(found_inf)) {
    return at::zeros({n, 2}, at::dtype(compute_dtype(checked_->weight_dtype)));
  }
  bump_versions({&b.steps});
  return run_lars_pass1(*checked_, const_data_ptrs(b.grads), b.grad_dtype, h, grad_mult);
}

void KeptLayout::lars_pass2(const at::Tensor& sums, const at::Tensor& hyper,
                            const std::optional<at::Tensor>& lr,
                            const std::optional<at::Tensor>& grad_mult,
                            const std::optional<at::Tensor>& found_inf) {
  const std::lock_guard<std::mutex> lock(mutex_);  // Note [one call at a time]
  const Bound& b = bound();
  require(b.weights, {"grads", "momentum_buffers"}, {&b.grads, &b.state_a});
  const LarsHyper h = lars_hyper(hyper, lr);
  if (checked_->size() == 0 || step_skipped(found_inf)) return;
  bump_versions({&b.weights, &b.params, &b.state_a});
  run_lars_pass2(*checked_, const_data_ptrs(b.grads), b.grad_dtype, sums, h, grad_mult);
}

}  // namespace cpu
}  // namespace fusedopt
