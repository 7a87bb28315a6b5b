// The CPU implementations of the torch.ops.fusedopt.* operators (schemas in register.cpp).
#pragma once

#include <ATen/ATen.h>
#include <fusedopt/math.h>

#include <array>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

namespace fusedopt {
namespace cpu {

// Note [hyper fields]: the order of the doubles in the `float[] hyper` argument of the ops
// (booleans as 0/1) is one table per optimizer, X(Enumerator, member): the enum below, the names
// that fusedopt._C.lamb_fields() / lars_fields() give Python, and the parsing into LambHyper /
// LarsHyper (math.h) are all generated from it, so that they cannot disagree; a field's name in
// Python is its member's name, so Python can build `hyper` by name instead of keeping a copy of
// the order. A new member of LambHyper / LarsHyper needs a row here (the parsing sets only the
// rows' members).
#define FUSEDOPT_LAMB_FIELDS(X)                                                              \
  X(Lr, lr) X(Beta1, beta1) X(Beta2, beta2) X(Beta3, beta3) X(Eps, eps)                      \
  X(WeightDecay, weight_decay) X(RatioLo, ratio_lo) X(RatioHi, ratio_hi)                     \
  X(OneMinusBeta2, one_minus_beta2) X(LambdaInU, lambda_in_u)                                \
  X(BiasCorrection, bias_correction) X(Adapt, adapt) X(Decoupled, decoupled) X(Bounded, bounded)

#define FUSEDOPT_LARS_FIELDS(X)                                                              \
  X(Lr, lr) X(Momentum, momentum) X(Dampening, dampening) X(WeightDecay, weight_decay)       \
  X(TrustCoefficient, trust_coefficient) X(Eps, eps) X(OneMinusDampening, one_minus_dampening) \
  X(Nesterov, nesterov)                                                                      \
  X(TrustClip, trust_clip) X(Combined, combined) X(LrInMomentum, lr_in_momentum) X(Adapt, adapt)

enum LambField {
#define FUSEDOPT_ENUMERATOR(name, member) kLamb##name,
  FUSEDOPT_LAMB_FIELDS(FUSEDOPT_ENUMERATOR)
#undef FUSEDOPT_ENUMERATOR
  kLambFields
};

enum LarsField {
#define FUSEDOPT_ENUMERATOR(name, member) kLars##name,
  FUSEDOPT_LARS_FIELDS(FUSEDOPT_ENUMERATOR)
#undef FUSEDOPT_ENUMERATOR
  kLarsFields
};

#define FUSEDOPT_FIELD_NAME(name, member) #member,
// The field names in enum order (Note [hyper fields]).
inline constexpr std::array<const char*, kLambFields> kLambFieldNames = {
    FUSEDOPT_LAMB_FIELDS(FUSEDOPT_FIELD_NAME)};
inline constexpr std::array<const char*, kLarsFields> kLarsFieldNames = {
    FUSEDOPT_LARS_FIELDS(FUSEDOPT_FIELD_NAME)};
#undef FUSEDOPT_FIELD_NAME

// A field of a hyper list: a double, or a boolean given as 0/1.
inline void set_field(double& field, double x) { field = x; }
inline void set_field(bool& field, double x) { field = x != 0.0; }

// The LambHyper / LarsHyper of a `hyper` list, with its lr (the ops override it with a tensor lr).
inline LambHyper lamb_hyper_from(at::ArrayRef<double> x) {
  TORCH_CHECK(x.size() == kLambFields, "fusedopt: LAMB hyper has ", x.size(), " values, expected ",
              static_cast<int>(kLambFields));
  LambHyper h;
#define FUSEDOPT_SET_FIELD(name, member) set_field(h.member, x[kLamb##name]);
  FUSEDOPT_LAMB_FIELDS(FUSEDOPT_SET_FIELD)
#undef FUSEDOPT_SET_FIELD
  return h;
}

inline LarsHyper lars_hyper_from(at::ArrayRef<double> x) {
  TORCH_CHECK(x.size() == kLarsFields, "fusedopt: LARS hyper has ", x.size(), " values, expected ",
              static_cast<int>(kLarsFields));
  LarsHyper h;
#define FUSEDOPT_SET_FIELD(name, member) set_field(h.member, x[kLars##name]);
  FUSEDOPT_LARS_FIELDS(FUSEDOPT_SET_FIELD)
#undef FUSEDOPT_SET_FIELD
  return h;
}

at::Tensor sq_norms(at::TensorList tensors);

at::Tensor lamb_pass1(at::TensorList weights, at::TensorList grads, at::TensorList exp_avgs,
                      at::TensorList exp_avg_sqs, at::TensorList steps, at::ArrayRef<double> hyper,
                      const std::optional<at::Tensor>& grad_mult,
                      const std::optional<at::Tensor>& found_inf);

void lamb_pass2(at::TensorList weights, at::TensorList params, at::TensorList exp_avgs,
                at::TensorList exp_avg_sqs, at::TensorList steps, const at::Tensor& sums,
                at::ArrayRef<double> hyper, const std::optional<at::Tensor>& lr,
                const std::optional<at::Tensor>& found_inf);

at::Tensor lars_pass1(at::TensorList weights, at::TensorList grads, at::TensorList steps,
                      at::ArrayRef<double> hyper, const std::optional<at::Tensor>& grad_mult,
                      const std::optional<at::Tensor>& found_inf);

void lars_pass2(at::TensorList weights, at::TensorList params, at::TensorList grads,
                at::TensorList momentum_buffers, at::TensorList steps, const at::Tensor& sums,
                at::ArrayRef<double> hyper, const std::optional<at::Tensor>& lr,
                const std::optional<at::Tensor>& grad_mult,
                const std::optional<at::Tensor>& found_inf);

struct CheckedLists;  // Note [checked lists] in ops.cpp
class Fingerprints;

// Note [static lists]: the tensors of a bucket that stay the same objects from step to step (the
// weights, the bf16/fp16 params beside masters, the optimizer state and the step counts), held on
// the C++ side so that a step passes only its gradients. Converting a Python list into a
// TensorList costs a fraction of a microsecond per tensor and list through torch.ops; a pass
// takes up to five lists, which for thousands of small tensors outweighs the arithmetic. The cpp
// backend (fusedopt/backends/cpp.py) keeps one BucketLists per bucket, in the bucket's handles,
// while its tensors stay the same. The methods are the operators above with the static lists
// filled in; they check the static lists when made and then only look whether any of their
// tensors changed (Note [checked lists] in ops.cpp), and check the grads of every step. Empty
// lists stand for the state an optimizer does not have (momentum_buffers for LAMB, params
// without masters).
class BucketLists {
 public:
  BucketLists(std::vector<at::Tensor> weights, std::vector<at::Tensor> params,
              std::vector<at::Tensor> exp_avgs, std::vector<at::Tensor> exp_avg_sqs,
              std::vector<at::Tensor> momentum_buffers, std::vector<at::Tensor> steps);
  ~BucketLists();

  // Whether a step with these grads can reuse the lists: the grads have dtype grad_dtype and the
  // layout (numel, dense strides) of their weights, and no tensor of the static lists changed
  // (Note [checked lists]: `p.data = ...` with another shape, `model.half()`). False sends the
  // step down the Python path, which checks every group before any tensor is written and names
  // what is wrong; a pass that found a changed list could only raise after earlier groups
  // stepped. One C++ loop instead of a Python pass per property over thousands of tensors.
  bool accepts(const std::vector<at::Tensor>& grads, at::ScalarType grad_dtype) const;

  // Note [taken grads]: the grads of the last accepts() that said yes, held until release(), so
  // that the passes and the clipping norms of that step use them without turning a Python list
  // into tensors again (a cost per tensor: docs/performance.md). The step releases them at its
  // end, also when it raises (Backend.finish): no grad outlives its step here.
  at::Tensor lamb_pass1_taken(const std::vector<double>& hyper,
                              const std::optional<at::Tensor>& grad_mult,
                              const std::optional<at::Tensor>& found_inf);
  at::Tensor lars_pass1_taken(const std::vector<double>& hyper,
                              const std::optional<at::Tensor>& grad_mult,
                              const std::optional<at::Tensor>& found_inf);
  void lars_pass2_taken(const at::Tensor& sums, const std::vector<double>& hyper,
                        const std::optional<at::Tensor>& lr,
                        const std::optional<at::Tensor>& grad_mult,
                        const std::optional<at::Tensor>& found_inf);
  at::Tensor grad_sq_norms_taken();  // per-tensor sum of squares of the taken grads
  void release();

  // The operators of the same names with the static lists filled in; grads are this step's.
  at::Tensor lamb_pass1(const std::vector<at::Tensor>& grads, const std::vector<double>& hyper,
                        const std::optional<at::Tensor>& grad_mult,
                        const std::optional<at::Tensor>& found_inf);
  void lamb_pass2(const at::Tensor& sums, const std::vector<double>& hyper,
                  const std::optional<at::Tensor>& lr, const std::optional<at::Tensor>& found_inf);
  at::Tensor lars_pass1(const std::vector<at::Tensor>& grads, const std::vector<double>& hyper,
                        const std::optional<at::Tensor>& grad_mult,
                        const std::optional<at::Tensor>& found_inf);
  void lars_pass2(const std::vector<at::Tensor>& grads, const at::Tensor& sums,
                  const std::vector<double>& hyper, const std::optional<at::Tensor>& lr,
                  const std::optional<at::Tensor>& grad_mult,
                  const std::optional<at::Tensor>& found_inf);

 private:
  bool grad_fits(const at::Tensor& g, size_t i, at::ScalarType grad_dtype) const;
  std::vector<at::Tensor> taken() const;  // a copy of taken_, under the mutex
  std::array<at::TensorList, 6> static_lists() const;
  void recheck();                          // checks every static list, builds checked_
  // Note [checked lists]: the checked lists, looked at again (static_lists_unchanged) unless
  // reuse says that this step already did.
  const CheckedLists& checked(bool reuse);
  bool static_lists_unchanged() const;     // the fingerprints, looked at by all threads
  bool static_lists_unchanged(int64_t begin, int64_t end) const;  // of tensors [begin, end)
  void require_state(bool lamb) const;     // the lists hold LAMB (or LARS) state
  // Pass 1 of either optimizer: checks, then the zeros of a skipped step or run(lists, grad
  // pointers, grad dtype) after bumping the version counters of the tensors it writes.
  template <typename Run>
  at::Tensor pass1(const std::vector<at::Tensor>& grads, const std::optional<at::Tensor>& found_inf,
                   const Run& run);

  // Set by the constructor only.
  std::vector<at::Tensor> weights_, params_, exp_avgs_, exp_avg_sqs_, momentum_buffers_, steps_;
  at::ScalarType weight_dtype_, param_dtype_;

  // Note [one call at a time]: the passes run without the GIL (as torch.ops calls do), and a
  // recheck replaces checked_ and fingerprints_, which a pass running on another thread may be
  // reading (the pointers of its chunk loops), and checked_by_pass1_ says what the previous call
  // did. So accepts() and every pass hold mutex_ from their start to their end: calls on one
  // BucketLists from several threads run one after the other, never interleaved; different
  // BucketLists run concurrently. Every method takes mutex_ with the GIL released (the bindings
  // release it before the call, accepts() included), so that a thread waiting for mutex_ never
  // holds the GIL that the thread holding mutex_ may need.
  mutable std::mutex mutex_;
  std::unique_ptr<CheckedLists> checked_;
  std::unique_ptr<Fingerprints> fingerprints_;
  bool checked_by_pass1_ = false;  // pass 2 of this step reuses checked_ unchanged
  // accepts() found the static lists unchanged: the next pass 1 need not look again
  mutable bool checked_by_accepts_ = false;
  mutable std::vector<at::Tensor> taken_;  // Note [taken grads]
};

}  // namespace cpu
}  // namespace fusedopt
