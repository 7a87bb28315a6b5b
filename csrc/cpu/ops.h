// The CPU implementations of the torch.ops.fusedopt.* operators (schemas in register.cpp).
#pragma once

#include <ATen/ATen.h>

#include <optional>

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

}  // namespace cpu
}  // namespace fusedopt
