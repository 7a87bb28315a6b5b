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
// the passes) and rides along so that the encoding is the whole dataclass. The tables
// X(Enumerator, member, type) list the fields in the dataclasses' order: the structs here and
// the parsing of the encoding (csrc/cpu/ops.h) are generated from them.
//   LAMB: beta3 = 1 - beta1 if grad_averaging else 1; weight_decay is lambda; decoupled is
//   decoupled_weight_decay; ratio_lo/ratio_hi are trust_ratio_bounds (used when bounded);
//   lambda_in_u is lambda unless decoupled (then 0), decoupled_lambda lambda if decoupled.
//   LARS: momentum is mu, weight_decay lambda, trust_coefficient kappa; combined is
//   denominator == "combined" (kappa*|w| / (|g + lambda*w| + eps)).
#define FUSEDOPT_LAMB_FIELDS(X)                                                                \
  X(Lr, lr, double) X(Beta1, beta1, double) X(Beta2, beta2, double) X(Beta3, beta3, double)    \
  X(Eps, eps, double) X(WeightDecay, weight_decay, double)                                     \
  X(BiasCorrection, bias_correction, bool) X(Adapt, adapt, bool)                               \
  X(Decoupled, decoupled, bool) X(Bounded, bounded, bool) X(RatioLo, ratio_lo, double)         \
  X(RatioHi, ratio_hi, double) X(MaxGradNorm, max_grad_norm, double)                           \
  X(OneMinusBeta2, one_minus_beta2, double) X(LambdaInU, lambda_in_u, double)                  \
  X(DecoupledLambda, decoupled_lambda, double)

#define FUSEDOPT_LARS_FIELDS(X)                                                                \
  X(Lr, lr, double) X(Momentum, momentum, double) X(Dampening, dampening, double)              \
  X(WeightDecay, weight_decay, double) X(TrustCoefficient, trust_coefficient, double)          \
  X(Eps, eps, double) X(Nesterov, nesterov, bool) X(TrustClip, trust_clip, bool)               \
  X(Combined, combined, bool) X(LrInMomentum, lr_in_momentum, bool) X(Adapt, adapt, bool)      \
  X(MaxGradNorm, max_grad_norm, double) X(OneMinusDampening, one_minus_dampening, double)

#define FUSEDOPT_MEMBER(name, member, type) type member;
struct LambHyper {
  FUSEDOPT_LAMB_FIELDS(FUSEDOPT_MEMBER)
};

struct LarsHyper {
  FUSEDOPT_LARS_FIELDS(FUSEDOPT_MEMBER)
};
#undef FUSEDOPT_MEMBER

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
  T eps8, c8;        // 8-bit state (Note [8-bit maps]): eps / r2 and r1 / r2
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
  c.eps8 = div_rn(c.eps, c.r2);
  c.c8 = div_rn(c.r1, c.r2);
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
constexpr int kWordAlign = 16;        // block words padded to 64 bytes before the codes

// Bytes before the codes of a packed 8-bit tensor of n elements (two 32-bit words per block),
// and its whole size.
FUSEDOPT_HD long long q8_codes_offset(long long n) {
  const long long blocks = (n + kQBlock - 1) / kQBlock;
  return 4 * ((2 * blocks + kWordAlign - 1) / kWordAlign) * kWordAlign;
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

// bits(e) of the element e of the tensor: base + e * 0x9e3779b9 (mod 2^32), a Weyl sequence
// from the hashed base, so that the bits of the elements of a block are the bits of its first
// element plus sr_step(k) (an addition per element), and those of one element over the steps are
// as independent as the bases.
constexpr unsigned int kWeyl = 0x9e3779b9u;

FUSEDOPT_HD unsigned int sr_step(unsigned int k) { return k * kWeyl; }

FUSEDOPT_HD unsigned int sr_bits(unsigned int base, long long e) {
  return base + sr_step(static_cast<unsigned int>(e));
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

// Note [8-bit maps]: docs/math.md, "8-bit". Three maps, one per state key, each with two 32-bit
// words per block (w0, w1) before the codes; integer operations on float32 bit patterns and
// float32 operations with one rounding each, so every backend stores the same bytes.
constexpr unsigned int kNanWord = 0x7fc00000u;
constexpr unsigned int kInfBits = 0x7f800000u;
constexpr float kTiny = 5.42101086242752217e-20f;   // 2^-64: below it a block is prescaled
constexpr float kPrescale = 1.8446744073709552e19f; // 2^64
constexpr unsigned int kRootRange = 24u << 23;      // the root map's 24 octaves of bit patterns
constexpr int kRootShifts = 21;                     // 254 << 20 covers kRootRange

// The largest |x| of a block of n <= kQBlock values (from the largest bit pattern of |x|: for
// magnitudes their order is the values') and whether they are all finite.
struct BlockTop {
  float top;
  bool finite;
};

// The prescale P (2^64 below 2^-64, else 1) and factor q = c / (a*P) of a block whose largest
// magnitude is a (q = 0 for a = 0), so that q is finite for a tiny a.
struct Scaling {
  float p;
  float q;
};

FUSEDOPT_HD Scaling q8_scaling(float a, float c) {
  const float p = a < kTiny ? kPrescale : 1.0f;
  return {p, a > 0.0f ? div_rn(c, mul_rn(a, p)) : 0.0f};
}

// Linear map (LAMB's direction d = m / (s + eps)): code = rint((d*P)*q) with q = 127/(a*P)
// (q8_scaling: the caller multiplies d by P, which is 1 unless the block is tiny); value =
// code * f, f = a / 127. rint rounds half to even, here by adding and subtracting 1.5 * 2^23.
// Only finite blocks are coded; a block that is not finite has codes 0.
FUSEDOPT_HD float q8_direction_step(float a) { return div_rn(a, 127.0f); }

constexpr float kRoundMagic = 12582912.0f;  // 1.5 * 2^23: (y + it) - it rounds |y| < 2^22

FUSEDOPT_HD int q8_direction_code(float d, float q) {
  // |d| <= a, so |d*q| <= 127 * (1 + 2^-22) rounds to at most 127: no clamp
  return static_cast<int>(sub_rn(add_rn(mul_rn(d, q), kRoundMagic), kRoundMagic));
}

FUSEDOPT_HD float q8_direction_value(int code, float f) {
  return mul_rn(static_cast<float>(code), f);
}

// Root map (LAMB's exp_avg_sq, s = sqrt(v)): with T the block's largest bits(s) and sh its
// shift, code 0 is s = 0 and code c >= 1 the float of bits T - ((255 - c) << sh) (0 below 0).
// round: the random bits' top sh bits in a step (stochastic), 2^sh >> 1 for nearest.
FUSEDOPT_HD int q8_root_shift(unsigned int top, unsigned int low) {
  if (top - low > kRootRange) low = top - kRootRange;
  const unsigned int span = top - low;
  int sh = 0;
  while (sh < kRootShifts - 1 && span > (254u << sh)) ++sh;
  return sh;
}

FUSEDOPT_HD unsigned int q8_root_stochastic(unsigned int bits, int sh) {
  return (bits >> 1) >> (31 - sh);
}

FUSEDOPT_HD unsigned int q8_root_nearest(int sh) { return (1u << sh) >> 1; }

FUSEDOPT_HD int q8_root_code(float s, unsigned int top, int sh, unsigned int round) {
  const unsigned int b = float_bits(s) & 0x7fffffffu;
  const unsigned int k = (top - b + round) >> sh;
  const unsigned int c = 255u - (k < 254u ? k : 254u);
  return static_cast<int>(c & (0u - static_cast<unsigned int>(b != 0u)));
}

FUSEDOPT_HD float q8_root_value(int c, unsigned int top, int sh) {
  const int x = static_cast<int>(top) - ((255 - c) << sh);
  // integer selects (masks), which the host loops vectorize
  const unsigned int nonzero = 0u - static_cast<unsigned int>(c != 0);
  return bits_float(static_cast<unsigned int>(x > 0 ? x : 0) & nonzero);
}

// Dynamic map of base 8 (LARS's buffer): with y = (|x|*P)*q, q = 1/(a*P), the magnitude is 127
// for |x| = a (top: its bit pattern), 0 below 8^-7, else 2^L + j in the decade t = (126 - E)/3
// below the top (E the biased exponent of y), L = 6 - t, then moved to the neighbour whose value
// is nearer to y where one is (thr: the table of q8_dynamic_threshold); the value of a magnitude
// is V[mag] * a.
// Written without branches (selects only), so that the host loops over a block vectorize: a
// branch on the sign alone would be mispredicted half of the time.
FUSEDOPT_HD int q8_dynamic_code(float x, Scaling s, unsigned int top,
                                const float* __restrict__ thr) {
  const unsigned int xb = float_bits(x) & 0x7fffffffu;
  const float y = mul_rn(mul_rn(bits_float(xb), s.p), s.q);
  const unsigned int yb = float_bits(y);
  const int e = static_cast<int>(yb >> 23);
  const int d = e > 126 ? 0 : 126 - e;
  int t = (d * 171) >> 9;  // d / 3 for d < 384
  t = t > 6 ? 6 : t;
  const int level = 6 - t;
  const int count = level == 6 ? 63 : 1 << level;
  const float z = bits_float(yb + (static_cast<unsigned int>(3 * t + 3) << 23));
  // K[L] = float32(n / 7): 9 for n = 63, else float32(1/7) * 2^L (0x3e124925 is float32(1/7))
  const float k = level == 6 ? 9.0f : bits_float(0x3e124925u + (static_cast<unsigned int>(level) << 23));
  int j = static_cast<int>(mul_rn(sub_rn(z, 1.0f), k));
  j = j < count - 1 ? j : count - 1;
  int mag = (1 << level) + j;
  mag = e < 106 ? 0 : mag;  // y < 2^-21 = 8^-7
  // the block's largest |x| itself (y may round below 1); a block of zeros stores 0
  // (an or of masks: a select there reaches the gather's addresses as 64-bit offsets, which GCC
  // does not vectorize)
  mag |= -(static_cast<int>(xb == top) & static_cast<int>(top != 0u)) & 127;
  // to the nearest value: the part's mean is, within its decade; at a decade's edge the
  // neighbour's may be nearer. thr[c] is the midpoint between c - 1 and c, 0 for c = 0 and +inf
  // for c = 128, so that neither end needs a test of mag (GCC vectorizes neither a gather by a
  // selected index nor an & of a float and an int comparison).
  mag = mag - static_cast<int>(y < thr[mag]) + static_cast<int>(y >= thr[mag + 1]);
  return x < 0.0f ? -mag : mag;
}

// The midpoint between magnitudes c and c + 1: (V[c] + V[c + 1]) * 0.5.
FUSEDOPT_HD float q8_dynamic_mid(int c);

// V[mag] (float32, one rounding per operation; V[0] = 0, V[127] = 1).
FUSEDOPT_HD float q8_dynamic_unit(int mag) {
  if (mag <= 0) return 0.0f;
  if (mag >= 127) return 1.0f;
  int level = 0;
  while ((2 << level) <= mag) ++level;
  const float count = level == 6 ? 63.0f : static_cast<float>(1 << level);
  const float j = static_cast<float>(mag - (1 << level));
  const float frac = div_rn(mul_rn(7.0f, add_rn(j, 0.5f)), count);
  return mul_rn(add_rn(1.0f, frac), bits_float(static_cast<unsigned int>(127 - 3 * (7 - level)) << 23));
}

FUSEDOPT_HD float q8_dynamic_mid(int c) {
  return mul_rn(add_rn(q8_dynamic_unit(c), q8_dynamic_unit(c + 1)), 0.5f);
}

// The thresholds of q8_dynamic_code, c = 0..128: q8_dynamic_mid(c - 1), 0 at 0 and +inf at 128.
constexpr int kDynamicThresholds = 129;

FUSEDOPT_HD float q8_dynamic_threshold(int c) {
  if (c <= 0) return 0.0f;
  if (c >= 128) return bits_float(kInfBits);
  return q8_dynamic_mid(c - 1);
}

FUSEDOPT_HD float q8_dynamic_value(int code, float a, const float* __restrict__ unit) {
  int c = code < 0 ? -code : code;
  c = c > 127 ? 127 : c;
  const float y = mul_rn(unit[c], a);
  return code < 0 ? -y : y;
}

// v >= 0 saturated at the largest float32 (8-bit state; NaN kept): +inf, the one value above it,
// becomes its neighbour below, in integer operations (a float select folds the root of the
// constant into a branch that keeps the host loops from vectorizing).
FUSEDOPT_HD float q8_saturate(float v) {
  const unsigned int b = float_bits(v);
  return bits_float(b - static_cast<unsigned int>(b == kInfBits));
}

// Whether x is finite, as the sum of x*0 over a block tests it (0 for finite x, NaN otherwise).
FUSEDOPT_HD bool finite_rn(float x) { return mul_rn(x, 0.0f) == 0.0f; }

}  // namespace fusedopt
