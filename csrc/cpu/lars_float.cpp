// LARS pass 2 of the CPU backend for float32 weights (lars.cpp, kernels.h).
#include "kernels.h"

namespace fusedopt {
namespace cpu {

void run_lars_pass2_float(const CheckedLists& d, const std::vector<const void*>& grads,
                          at::ScalarType g_dtype, const at::Tensor& sums, const LarsHyper& h,
                          const std::optional<at::Tensor>& grad_mult) {
  lars_pass2_for<float>(d, grads, g_dtype, sums, h, grad_mult);
}

}  // namespace cpu
}  // namespace fusedopt
