// The CPU implementations of the torch.ops.fusedopt.* operators (schemas in register.cpp).
#pragma once

#include <ATen/ATen.h>
#include <fusedopt/math.h>

#include <array>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

namespace fusedopt {
namespace cpu {

// Order of the doubles in the `float[] hyper` argument of the LAMB ops: the fields of
// fusedopt::LambHyper (math.h), booleans as 0/1. fusedopt/backends/cpp.py writes the same order.
enum LambField {
  kLambLr, kLambBeta1, kLambBeta2, kLambBeta3, kLambEps, kLambWeightDecay, kLambRatioLo,
  kLambRatioHi, kLambBiasCorrection, kLambAdapt, kLambDecoupled, kLambBounded, kLambFields
};

// Order of the doubles in the `float[] hyper` argument of the LARS ops (fields of LarsHyper).
enum LarsField {
  kLarsLr, kLarsMomentum, kLarsDampening, kLarsWeightDecay, kLarsTrustCoefficient, kLarsEps,
  kLarsNesterov, kLarsTrustClip, kLarsCombined, kLarsLrInMomentum, kLarsAdapt, kLarsFields
};

// The LambHyper / LarsHyper of a `hyper` list, with its lr (the ops override it with a tensor lr).
inline LambHyper lamb_hyper_from(at::ArrayRef<double> x) {
  TORCH_CHECK(x.size() == kLambFields, "fusedopt: LAMB hyper has ", x.size(), " values, expected ",
              static_cast<int>(kLambFields));
  LambHyper h;
  h.lr = x[kLambLr];
  h.beta1 = x[kLambBeta1];
  h.beta2 = x[kLambBeta2];
  h.beta3 = x[kLambBeta3];
  h.eps = x[kLambEps];
  h.weight_decay = x[kLambWeightDecay];
  h.ratio_lo = x[kLambRatioLo];
  h.ratio_hi = x[kLambRatioHi];
  h.bias_correction = x[kLambBiasCorrection] != 0.0;
  h.adapt = x[kLambAdapt] != 0.0;
  h.decoupled = x[kLambDecoupled] != 0.0;
  h.bounded = x[kLambBounded] != 0.0;
  return h;
}

inline LarsHyper lars_hyper_from(at::ArrayRef<double> x) {
  TORCH_CHECK(x.size() == kLarsFields, "fusedopt: LARS hyper has ", x.size(), " values, expected ",
              static_cast<int>(kLarsFields));
  LarsHyper h;
  h.lr = x[kLarsLr];
  h.momentum = x[kLarsMomentum];
  h.dampening = x[kLarsDampening];
  h.weight_decay = x[kLarsWeightDecay];
  h.trust_coefficient = x[kLarsTrustCoefficient];
  h.eps = x[kLarsEps];
  h.nesterov = x[kLarsNesterov] != 0.0;
  h.trust_clip = x[kLarsTrustClip] != 0.0;
  h.combined = x[kLarsCombined] != 0.0;
  h.lr_in_momentum = x[kLarsLrInMomentum] != 0.0;
  h.adapt = x[kLarsAdapt] != 0.0;
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
// takes up to five lists, which for thousands of small tensors outweighs the arithmetic. The
// optimizer's plan cache (fusedopt/optim.py, Note [plan cache]) keeps one BucketLists per bucket
// while its tensors stay the same. The methods are the operators above with the static lists
// filled in; they check the static lists when made and then only look whether any of their
// tensors changed (Note [checked lists] in ops.cpp), and check the grads of every step. Empty
// lists stand for the state an optimizer does not have (momentum_buffers for LAMB, params
// without masters).
class BucketLists {
 public:
  // grad_holders are the tensors whose .grad are the bucket's grads (the optimizer's params).
  BucketLists(std::vector<at::Tensor> weights, std::vector<at::Tensor> params,
              std::vector<at::Tensor> exp_avgs, std::vector<at::Tensor> exp_avg_sqs,
              std::vector<at::Tensor> momentum_buffers, std::vector<at::Tensor> steps,
              std::vector<at::Tensor> grad_holders);
  ~BucketLists();

  // Whether a step with these grads can reuse the lists: the grads have dtype grad_dtype and the
  // layout (numel, dense strides) of their weights, and the weights and params still have the
  // dtype they had when the lists were made (`model.half()` changes a param's dtype in place). One
  // C++ loop instead of a Python pass per property over thousands of tensors.
  bool accepts(const std::vector<at::Tensor>& grads, at::ScalarType grad_dtype) const;

  // Note [grads taken in C++]: reads every grad holder's .grad here, so that a step needs no
  // Python list of grads: after a backward pass the grads have no Python objects yet, and
  // `[p.grad for p in params]` would create one per tensor. Returns false (and keeps nothing) if a
  // grad is missing or accepts() would refuse the grads; else the passes called without grads use
  // these, and pass 2 lets go of them (so zero_grad(set_to_none=True) frees their memory). The
  // threads share the tensors, and also look at the static lists for pass 1 (Note [checked
  // lists] in ops.cpp).
  bool take_grads(at::ScalarType grad_dtype);
  // Per-tensor sums of squares of the taken grads (global clipping), as the sq_norms operator.
  at::Tensor taken_grad_sq_norms() const;

  // grads: this step's grads, or nullopt for the taken ones.
  using Grads = std::optional<std::vector<at::Tensor>>;
  at::Tensor lamb_pass1(const Grads& grads, const std::vector<double>& hyper,
                        const std::optional<at::Tensor>& grad_mult,
                        const std::optional<at::Tensor>& found_inf);
  void lamb_pass2(const at::Tensor& sums, const std::vector<double>& hyper,
                  const std::optional<at::Tensor>& lr, const std::optional<at::Tensor>& found_inf);
  at::Tensor lars_pass1(const Grads& grads, const std::vector<double>& hyper,
                        const std::optional<at::Tensor>& grad_mult,
                        const std::optional<at::Tensor>& found_inf);
  void lars_pass2(const Grads& grads, const at::Tensor& sums, const std::vector<double>& hyper,
                  const std::optional<at::Tensor>& lr, const std::optional<at::Tensor>& grad_mult,
                  const std::optional<at::Tensor>& found_inf);

 private:
  bool grad_fits(const at::Tensor& g, size_t i, at::ScalarType grad_dtype) const;
  struct Taken {  // Note [grads taken in C++]
    std::vector<at::Tensor> grads;
    std::vector<const void*> ptrs;  // their data
    at::ScalarType dtype = at::kFloat;
    // take_grads also found the static lists unchanged: pass 1 of this step need not look again
    bool static_lists_checked = false;
  };
  // The data pointers and dtype of a pass's grads: the given ones (checked as the operators check
  // them) or the taken ones (checked by take_grads).
  std::pair<std::vector<const void*>, at::ScalarType> grad_pointers(const Grads& grads,
                                                                    const Taken& taken) const;
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
  at::Tensor pass1(const Grads& grads, const std::optional<at::Tensor>& found_inf, const Run& run);

  std::vector<at::Tensor> weights_, params_, exp_avgs_, exp_avg_sqs_, momentum_buffers_, steps_;
  std::vector<at::Tensor> grad_holders_;
  Taken taken_;
  at::ScalarType weight_dtype_, param_dtype_;
  std::unique_ptr<CheckedLists> checked_;
  std::unique_ptr<Fingerprints> fingerprints_;
  bool checked_by_pass1_ = false;  // pass 2 of this step reuses checked_ unchanged
};

}  // namespace cpu
}  // namespace fusedopt
