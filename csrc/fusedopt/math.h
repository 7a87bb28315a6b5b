// fusedopt per-element math: the one C++ statement of docs/math.md, shared by the CPU (csrc/cpu) and
// CUDA (csrc/cuda) backends. Everything here is a pure function of scalars, valid host and device
// code; no tensors, no launch logic. Symbols follow docs/math.md: w weight, g gradient (already
// multiplied by grad_mult = 1 / (amp_scale * clip divisor)), m, v LAMB moments, v LARS momentum
// buffer, t step count, lambda weight decay, kappa trust coefficient, mu momentum.
#pragma once

#include <cmath>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define FUSEDOPT_HD __host__ __device__ __forceinline__
#else
#define FUSEDOPT_HD inline
#endif

namespace fusedopt {

// Note [rounded operations]: every floating-point operation of this header is one IEEE rounding
// (to nearest even) in the order written, on the host and on a GPU, so that the backends store
// the same bits (docs/math.md). nvcc contracts a*b + c into a fused multiply-add by default and
// --use_fast_math makes division and square root approximate; the __f*_rn / __d*_rn intrinsics
// are never contracted nor approximated. The host spelling is the plain operator, which the C++
// builds do not contract (-ffp-contract=off).
#if defined(__CUDA_ARCH__)
#define FUSEDOPT_RN(name, f_op, d_op, expr)                                      \
  template <typename T>                                                         \
  FUSEDOPT_HD T name(T a, T b) {                                                \
    if constexpr (sizeof(T) == sizeof(float)) return f_op(a, b); else return d_op(a, b); \
  }
#else
#define FUSEDOPT_RN(name, f_op, d_op, expr) \
  template <typename T>                     \
  FUSEDOPT_HD T name(T a, T b) { return expr; }
#endif
FUSEDOPT_RN(mul_rn, __fmul_rn, __dmul_rn, a * b)
FUSEDOPT_RN(add_rn, __fadd_rn, __dadd_rn, a + b)
FUSEDOPT_RN(sub_rn, __fsub_rn, __dsub_rn, a - b)
FUSEDOPT_RN(div_rn, __fdiv_rn, __ddiv_rn, a / b)
#undef FUSEDOPT_RN

template <typename T>
FUSEDOPT_HD T sqrt_rn(T a) {
#if defined(__CUDA_ARCH__)
  if constexpr (sizeof(T) == sizeof(float)) return __fsqrt_rn(a); else return __dsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}

// Host-side scalars of one param group, member for member the dataclasses LambHyper / LarsHyper
// of fusedopt/_hyper.py (Note [hyper fields] in csrc/cpu/ops.h); booleans arrive as 0/1, a
// missing max_grad_norm as NaN. max_grad_norm is the engine's (global clipping happens before
// the passes) and rides along so that the encoding is the whole dataclass.
struct LambHyper {
  double lr;
  double beta1;
  double beta2;
  double beta3;         // (1 - beta1) if grad_averaging else 1
  double eps;
  double weight_decay;  // lambda
  bool bias_correction;
  bool adapt;
  bool decoupled;       // decoupled_weight_decay
  bool bounded;
  double ratio_lo;      // trust_ratio_bounds (used when bounded)
  double ratio_hi;
  double max_grad_norm;
  double one_minus_beta2;
  double lambda_in_u;       // lambda unless decoupled (then 0)
  double decoupled_lambda;  // lambda if decoupled (else 0)
};

struct LarsHyper {
  double lr;
  double momentum;           // mu
  double dampening;
  double weight_decay;       // lambda
  double trust_coefficient;  // kappa
  double eps;
  bool nesterov;
  bool trust_clip;
  bool combined;        // denominator == "combined": kappa*|w| / (|g + lambda*w| + eps)
  bool lr_in_momentum;
  bool adapt;
  double max_grad_norm;
  double one_minus_dampening;
};

// 1 - beta^t, in double whatever the compute type (same formula as fusedopt.functional).
FUSEDOPT_HD double bias_correction(double beta, double t) { return 1.0 - pow(beta, t); }

// Note [zero-norm rule]: a trust ratio is exactly 1 when |w| or the other norm of its formula
// (|u| for LAMB, the gradient norm for LARS) is 0; weight decay is still applied. Every trust
// ratio goes through this function.
//
// Note [NaN propagation]: a NaN norm gives a NaN trust ratio, and the bounds (LAMB's
// trust_ratio_bounds, LARS's trust_clip) keep a NaN ratio NaN, as torch.clamp does: an inf or
// NaN in a weight or gradient shows in the whole tensor's update instead of being hidden by a
// ratio of 1 or a bound. Every backend writes the test and the clamps as comparisons that are
// false for NaN (the Triton kernels too, whose tl.minimum/tl.maximum would drop it).
template <typename T>
FUSEDOPT_HD T zero_norm_rule(T w_norm, T other_norm, T ratio) {
  return (w_norm == T(0) || other_norm == T(0)) ? T(1) : ratio;
}

// ---------------------------------------------------------------------------------------- LAMB

// Per-tensor LAMB scalars of step t, in the compute type T.
template <typename T>
struct LambCoef {
  T beta1, beta2, beta3, one_minus_beta2, eps;
  T r1, r2;          // 1 / (1 - beta1^t) and 1 / sqrt(1 - beta2^t), or 1 without bias correction
  T lambda_in_u;     // lambda unless decoupled (then 0)
};

template <typename T>
FUSEDOPT_HD LambCoef<T> lamb_coef(const LambHyper& h, double t) {
  LambCoef<T> c;
  c.beta1 = T(h.beta1);
  c.beta2 = T(h.beta2);
  c.beta3 = T(h.beta3);
  c.one_minus_beta2 = T(h.one_minus_beta2);
  c.eps = T(h.eps);
  c.r1 = h.bias_correction ? T(1.0 / bias_correction(h.beta1, t)) : T(1);
  c.r2 = h.bias_correction ? T(1.0 / sqrt(bias_correction(h.beta2, t))) : T(1);
  c.lambda_in_u = T(h.lambda_in_u);
  return c;
}

// m <- beta1*m + beta3*g ;  v <- beta2*v + (1-beta2)*g^2
// The factor on w before LAMB's update: 1 - lr*lambda with decoupled weight decay, else 1; in
// double, rounded once to T (the eager backend: fusedopt/_hyper.py decay_factor). lr is read
// where it lives (a device tensor on CUDA), so the factor is formed beside the kernel.
template <typename T>
FUSEDOPT_HD T lamb_decay(const LambHyper& h, double lr) {
  return h.decoupled ? T(sub_rn(1.0, mul_rn(lr, h.weight_decay))) : T(1);
}

template <typename T>
FUSEDOPT_HD void lamb_moments(T g, T& m, T& v, const LambCoef<T>& c) {
  m = add_rn(mul_rn(c.beta1, m), mul_rn(c.beta3, g));
  v = add_rn(mul_rn(c.beta2, v), mul_rn(mul_rn(c.one_minus_beta2, g), g));
}

// u = m_hat / (sqrt(v_hat) + eps) + lambda*w. Pass 1 (for |u|^2) and pass 2 (for the update)
// both call this with the same arguments, so both see the same u bit for bit.
//
// Note [bias-correction factors]: m_hat = m * r1 and sqrt(v_hat) = sqrt(v) * r2 with the per-tensor
// factors r1 = 1/(1-beta1^t), r2 = 1/sqrt(1-beta2^t), computed in double and rounded once. That is
// docs/math.md's u exactly in real arithmetic, with one division and one square root per element instead
// of three divisions and a root (division and root are the slowest vector instructions, and LAMB
// runs them in both passes); each value is within a few ulp of the three-division form. Every
// backend evaluates u in this order (fusedopt/kernels/math.py, fusedopt/backends/eager.py).
// The same with s = sqrt(v) given (low-precision state stores s for 8-bit: Note [state formats]).
template <typename T>
FUSEDOPT_HD T lamb_direction_s(T w, T m, T s, const LambCoef<T>& c) {
  return add_rn(div_rn(mul_rn(m, c.r1), add_rn(mul_rn(s, c.r2), c.eps)), mul_rn(c.lambda_in_u, w));
}

template <typename T>
FUSEDOPT_HD T lamb_direction(T w, T m, T v, const LambCoef<T>& c) {
  return lamb_direction_s<T>(w, m, sqrt_rn(v), c);
}

// phi = |w| / |u| (zero-norm rule), clamped to the bounds; 1 when not adapting.
template <typename T>
FUSEDOPT_HD T lamb_trust_ratio(T w_sq, T u_sq, const LambHyper& h) {
  if (!h.adapt) return T(1);
  const T w_n = sqrt_rn(w_sq);
  const T u_n = sqrt_rn(u_sq);
  T phi = zero_norm_rule<T>(w_n, u_n, div_rn(w_n, u_n));
  if (h.bounded) phi = phi < T(h.ratio_lo) ? T(h.ratio_lo) : (phi > T(h.ratio_hi) ? T(h.ratio_hi) : phi);
  return phi;
}

// w <- w*decay - lr_phi*u, with decay = 1 - lr*lambda (decoupled) or 1, lr_phi = lr*phi.
template <typename T>
FUSEDOPT_HD T lamb_apply(T w, T u, T lr_phi, T decay) {
  return sub_rn(mul_rn(w, decay), mul_rn(lr_phi, u));
}

// ---------------------------------------------------------------------------------------- LARS

// ratio = kappa*|w| / (|g| + lambda*|w| + eps)   ("sum")
// ratio = kappa*|w| / (|g + lambda*w| + eps)     ("combined"; g_sq is then |g + lambda*w|^2)
// zero-norm rule on |w| and the gradient norm of the formula; min(ratio, 1) if trust_clip.
template <typename T>
FUSEDOPT_HD T lars_trust_ratio(T w_sq, T g_sq, const LarsHyper& h) {
  if (!h.adapt) return T(1);
  const T w_n = sqrt_rn(w_sq);
  const T g_n = sqrt_rn(g_sq);
  const T den = h.combined ? add_rn(g_n, T(h.eps))
                           : add_rn(add_rn(g_n, mul_rn(T(h.weight_decay), w_n)), T(h.eps));
  T ratio = zero_norm_rule<T>(w_n, g_n, div_rn(mul_rn(T(h.trust_coefficient), w_n), den));
  if (h.trust_clip && ratio > T(1)) ratio = T(1);
  return ratio;
}

// Per-tensor LARS scalars of one step, in the compute type T.
template <typename T>
struct LarsCoef {
  T ratio;     // trust ratio of the tensor
  T lambda;
  T lr;
  T mu;
  T keep;      // factor on the old buffer: mu, or 0 on the first step of the torch-SGD form
  T add;       // factor on d: lr (lr_in_momentum) or 1-dampening (1 on the first step)
  bool nesterov;
  bool lr_in_momentum;
};

template <typename T>
FUSEDOPT_HD LarsCoef<T> lars_coef(const LarsHyper& h, T ratio, double t) {
  LarsCoef<T> c;
  const bool first = t == 1.0;
  c.ratio = ratio;
  c.lambda = T(h.weight_decay);
  c.lr = T(h.lr);
  c.mu = T(h.momentum);
  c.nesterov = h.nesterov;
  c.lr_in_momentum = h.lr_in_momentum;
  if (h.lr_in_momentum) {
    c.keep = T(h.momentum);
    c.add = T(h.lr);
  } else {
    c.keep = first ? T(0) : T(h.momentum);
    c.add = first ? T(1) : T(h.one_minus_dampening);
  }
  return c;
}

// d = ratio*(g + lambda*w) and the new buffer keep*v + add*d.
template <typename T>
FUSEDOPT_HD T lars_direction(T w, T g, const LarsCoef<T>& c) {
  return mul_rn(c.ratio, add_rn(g, mul_rn(c.lambda, w)));
}

template <typename T>
FUSEDOPT_HD T lars_buffer(T d, T v, const LarsCoef<T>& c) {
  return add_rn(mul_rn(c.keep, v), mul_rn(c.add, d));
}

// The new w = w - step from d and the buffer v as stored, where
//   lr_in_momentum: step = v            (nesterov: lr*d + mu*v)
//   otherwise:      step = lr*v         (nesterov: lr*(d + mu*v))
template <typename T>
FUSEDOPT_HD T lars_step(T w, T d, T v, const LarsCoef<T>& c) {
  T step;
  if (c.lr_in_momentum) {
    step = c.nesterov ? add_rn(mul_rn(c.lr, d), mul_rn(c.mu, v)) : v;
  } else {
    step = c.nesterov ? mul_rn(c.lr, add_rn(d, mul_rn(c.mu, v))) : mul_rn(c.lr, v);
  }
  return sub_rn(w, step);
}

// lars_direction, lars_buffer (v updated) and lars_step: the step with full-precision state.
template <typename T>
FUSEDOPT_HD T lars_apply(T w, T g, T& v, const LarsCoef<T>& c) {
  const T d = lars_direction<T>(w, g, c);
  v = lars_buffer<T>(d, v, c);
  return lars_step<T>(w, d, v, c);
}

// ------------------------------------------------------------------- low-precision state
// Note [state formats]: docs/math.md, "Low-precision state". A moment is stored in full precision
// (the compute type), as bf16, or in 8 bits per element in blocks of kQBlock elements with one
// float32 scale per block. Every function here is float32 arithmetic with one IEEE rounding per
// operation in the order written (the CPU build does not contract into FMA; the CUDA build must
// not either: __fmul_rn/__fadd_rn where it matters), so the backends store the same bits.
enum StateFormat : unsigned char { kFullState = 0, kBf16State = 1, k8bitState = 2 };

constexpr int kQBlock = 256;          // elements per 8-bit block
constexpr int kScaleAlign = 16;       // scales padded to 64 bytes before the codes

// Bytes before the codes of a packed 8-bit tensor of n elements, and its whole size.
FUSEDOPT_HD long long q8_codes_offset(long long n) {
  const long long blocks = (n + kQBlock - 1) / kQBlock;
  return 4 * ((blocks + kScaleAlign - 1) / kScaleAlign) * kScaleAlign;
}
FUSEDOPT_HD long long q8_packed_numel(long long n) { return q8_codes_offset(n) + n; }

// docs/math.md's mix: a 32-bit integer hash (wrapping arithmetic).
FUSEDOPT_HD unsigned int mix32(unsigned int x) {
  x ^= x >> 16;
  x *= 0x21f0aaadu;
  x ^= x >> 15;
  x *= 0x735a2d97u;
  x ^= x >> 15;
  return x;
}

// The per-tensor base of the random bits of step t (after the increment) for the tensor's key:
// its low 32 bits. Its high 32 bits are sr_first(key), the index (mod 2^32) in the whole tensor
// of the first element stepped: 0 for a whole tensor, a shard's first element for a shard that is
// a run of its tensor (docs/math.md, "Random bits"), so that element e of the run draws
// sr_bits(base, sr_first(key) + e) whatever the sharding.
FUSEDOPT_HD unsigned int sr_base(double t, long long key) {
  const unsigned int ti = static_cast<unsigned int>(static_cast<long long>(t));
  return mix32(mix32(0x9e3779b9u ^ ti) ^ static_cast<unsigned int>(key));
}

FUSEDOPT_HD unsigned int sr_first(long long key) {
  return static_cast<unsigned int>(static_cast<unsigned long long>(key) >> 32);
}

// bits(e) of the element e of the tensor.
FUSEDOPT_HD unsigned int sr_bits(unsigned int base, long long e) {
  return mix32(base ^ static_cast<unsigned int>(e));
}

FUSEDOPT_HD unsigned int float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  unsigned int u;
  __builtin_memcpy(&u, &x, sizeof u);
  return u;
#endif
}

FUSEDOPT_HD float bits_float(unsigned int u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  __builtin_memcpy(&x, &u, sizeof x);
  return x;
#endif
}

// bf16 (as its 16 bits) of x rounded to nearest even; NaN stays NaN.
FUSEDOPT_HD unsigned short bf16_rne(float x) {
  const unsigned int u = float_bits(x);
  if (x != x) return 0x7fc0;  // the NaN that c10::BFloat16 gives
  return static_cast<unsigned short>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// bf16 of x rounded stochastically with the random bits: the float32 bits plus bits >> 16, the
// low 16 dropped; inf and NaN rounded to nearest (kept).
FUSEDOPT_HD unsigned short bf16_stochastic(float x, unsigned int bits) {
  const unsigned int u = float_bits(x);
  if ((u & 0x7f800000u) == 0x7f800000u) return bf16_rne(x);
  return static_cast<unsigned short>((u + (bits >> 16)) >> 16);
}

FUSEDOPT_HD float bf16_value(unsigned short h) { return bits_float(static_cast<unsigned int>(h) << 16); }

// The 8-bit maps are minifloats relative to the block's largest value, written with integer
// operations on float32 bit patterns (exact, so every backend gets the same codes).
//
// Signed map (m, LARS's buffer), E4M3: with a the block's largest |x|, the scale f = a / 1.875
// and the factor q = 1.875 / a (0 for a = 0); y = |x|*q rounded to nearest even at 3 mantissa
// bits; the code is sign(x)*c, c = clamp(bits(y)' - 896, 0, 127), and its value
// f * float(bits (c + 896) << 20), 0 for c = 0: 15 octaves down from a, magnitudes below
// 2^-15 * a stored as 0.
constexpr unsigned int kSignedOffset = (127 - 15) << 3;  // 896
constexpr float kSignedTop = 1.875f;                     // the largest code's value, 2^0 * 15/8

FUSEDOPT_HD float q8_signed_scale(float a) { return a / kSignedTop; }
FUSEDOPT_HD float q8_signed_factor(float a) { return a > 0.0f ? kSignedTop / a : 0.0f; }

FUSEDOPT_HD signed char q8_signed_code(float x, float q) {
  const unsigned int b = float_bits(std::fabs(x) * q);
  const int t = static_cast<int>((b + 0x7ffffu + ((b >> 20) & 1u)) >> 20) -
                static_cast<int>(kSignedOffset);
  const int c = t < 0 ? 0 : (t > 127 ? 127 : t);
  return static_cast<signed char>(x < 0.0f ? -c : c);
}

FUSEDOPT_HD float q8_signed_value(signed char code, float f) {
  const int c = code < 0 ? -code : code;
  const float y = c == 0 ? 0.0f : bits_float(static_cast<unsigned int>(c + kSignedOffset) << 20);
  return (code < 0 ? -y : y) * f;
}

// Square-root map (LAMB's v, by s = sqrt(v)), E4M4 with no zero: with S the block's largest s,
// the scale f = S / 1.9375 and the factor q = 1.9375 / S (0 for S = 0); y = s*q rounded at 4
// mantissa bits by adding `round` (19 bits: (bits(e) >> 13) for stochastic rounding, 0x3ffff plus
// the kept bit's parity for nearest even) to its bit pattern; the code
// c = clamp(bits' - 1792, 0, 255), its value f * float(bits (c + 1792) << 19). The smallest
// value is 2^-15 * S: a nonzero block stores no v = 0.
constexpr unsigned int kRootOffset = (127 - 15) << 4;  // 1792
constexpr float kRootTop = 1.9375f;                    // 2^0 * 31/16

FUSEDOPT_HD float q8_root_scale(float s_max) { return s_max / kRootTop; }
FUSEDOPT_HD float q8_root_factor(float s_max) { return s_max > 0.0f ? kRootTop / s_max : 0.0f; }

FUSEDOPT_HD unsigned char q8_root_code(float s, float q, unsigned int bits) {
  const unsigned int b = float_bits(s * q);
  const int t = static_cast<int>((b + (bits >> 13)) >> 19) - static_cast<int>(kRootOffset);
  return static_cast<unsigned char>(t < 0 ? 0 : (t > 255 ? 255 : t));
}

FUSEDOPT_HD float q8_root_value(unsigned char c, float f) {
  return bits_float(static_cast<unsigned int>(c + kRootOffset) << 19) * f;
}

// Whether x is finite, as the sum of x*0 over a block tests it (0 for finite x, NaN otherwise).
FUSEDOPT_HD bool finite_rn(float x) { return mul_rn(x, 0.0f) == 0.0f; }

}  // namespace fusedopt
