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
  return h.decoupled ? T(1.0 - lr * h.weight_decay) : T(1);
}

template <typename T>
FUSEDOPT_HD void lamb_moments(T g, T& m, T& v, const LambCoef<T>& c) {
  m = c.beta1 * m + c.beta3 * g;
  v = c.beta2 * v + c.one_minus_beta2 * g * g;
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
template <typename T>
FUSEDOPT_HD T lamb_direction(T w, T m, T v, const LambCoef<T>& c) {
  return (m * c.r1) / (std::sqrt(v) * c.r2 + c.eps) + c.lambda_in_u * w;
}

// phi = |w| / |u| (zero-norm rule), clamped to the bounds; 1 when not adapting.
template <typename T>
FUSEDOPT_HD T lamb_trust_ratio(T w_sq, T u_sq, const LambHyper& h) {
  if (!h.adapt) return T(1);
  const T w_n = std::sqrt(w_sq);
  const T u_n = std::sqrt(u_sq);
  T phi = zero_norm_rule<T>(w_n, u_n, w_n / u_n);
  if (h.bounded) phi = phi < T(h.ratio_lo) ? T(h.ratio_lo) : (phi > T(h.ratio_hi) ? T(h.ratio_hi) : phi);
  return phi;
}

// w <- w*decay - lr_phi*u, with decay = 1 - lr*lambda (decoupled) or 1, lr_phi = lr*phi.
template <typename T>
FUSEDOPT_HD T lamb_apply(T w, T u, T lr_phi, T decay) {
  return w * decay - lr_phi * u;
}

// ---------------------------------------------------------------------------------------- LARS

// ratio = kappa*|w| / (|g| + lambda*|w| + eps)   ("sum")
// ratio = kappa*|w| / (|g + lambda*w| + eps)     ("combined"; g_sq is then |g + lambda*w|^2)
// zero-norm rule on |w| and the gradient norm of the formula; min(ratio, 1) if trust_clip.
template <typename T>
FUSEDOPT_HD T lars_trust_ratio(T w_sq, T g_sq, const LarsHyper& h) {
  if (!h.adapt) return T(1);
  const T w_n = std::sqrt(w_sq);
  const T g_n = std::sqrt(g_sq);
  const T den = h.combined ? g_n + T(h.eps) : g_n + T(h.weight_decay) * w_n + T(h.eps);
  T ratio = zero_norm_rule<T>(w_n, g_n, T(h.trust_coefficient) * w_n / den);
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

// d = ratio*(g + lambda*w); v <- keep*v + add*d; returns the new w = w - step, where
//   lr_in_momentum: step = v            (nesterov: lr*d + mu*v)
//   otherwise:      step = lr*v         (nesterov: lr*(d + mu*v))
template <typename T>
FUSEDOPT_HD T lars_apply(T w, T g, T& v, const LarsCoef<T>& c) {
  const T d = c.ratio * (g + c.lambda * w);
  v = c.keep * v + c.add * d;
  T step;
  if (c.lr_in_momentum) {
    step = c.nesterov ? c.lr * d + c.mu * v : v;
  } else {
    step = c.nesterov ? c.lr * (d + c.mu * v) : c.lr * v;
  }
  return w - step;
}

}  // namespace fusedopt
