// LARS passes 1 and 2 of the CPU backend (kernels.h); pass 2 of float32 weights is
// lars_float.cpp.
#include "kernels.h"

namespace fusedopt {
namespace cpu {

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
  dispatch_storage(d.weight_dtype, "weights", [&](auto w_tag) {
    using W = typename decltype(w_tag)::type;
    if constexpr (std::is_same_v<W, float>) {
      run_lars_pass2_float(d, grads, g_dtype, sums, h, grad_mult);
    } else {
      lars_pass2_for<W>(d, grads, g_dtype, sums, h, grad_mult);
    }
  });
}

}  // namespace cpu
}  // namespace fusedopt
