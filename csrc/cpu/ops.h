// The CPU implementations of the torch.ops.fusedopt.* operators (schemas in register.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <fusedopt/math.h>

#include <array>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

namespace fusedopt {
namespace cpu {

// Note [hyper fields]: the host-side scalars of a step reach every kernel in one encoding, the
// `Tensor hyper` argument: a float64 CPU tensor holding the fields of the Python dataclass
// LambHyper / LarsHyper (fusedopt/_hyper.py, `encode`) in declaration order, booleans as 0/1 and
// a missing value as NaN. Under torch.compile the tensor is built in the graph from the group's
// options, so a scheduler that changes a float option changes a graph input, not a constant of
// the graph. The tables of math.h, X(Enumerator, member, type), list the fields in that order; the
// enums, the names that fusedopt._C.lamb_fields() / lars_fields() give Python (a test compares
// them with the dataclasses) and the parsing into the LambHyper / LarsHyper of math.h are
// generated from them here, so that they cannot disagree.

enum LambField {
#define FUSEDOPT_ENUMERATOR(name, member, type) kLamb##name,
  FUSEDOPT_LAMB_FIELDS(FUSEDOPT_ENUMERATOR)
#undef FUSEDOPT_ENUMERATOR
  kLambFields
};

enum LarsField {
#define FUSEDOPT_ENUMERATOR(name, member, type) kLars##name,
  FUSEDOPT_LARS_FIELDS(FUSEDOPT_ENUMERATOR)
#undef FUSEDOPT_ENUMERATOR
  kLarsFields
};

#define FUSEDOPT_FIELD_NAME(name, member, type) #member,
// The field names in enum order (Note [hyper fields]).
inline constexpr std::array<const char*, kLambFields> kLambFieldNames = {
    FUSEDOPT_LAMB_FIELDS(FUSEDOPT_FIELD_NAME)};
inline constexpr std::array<const char*, kLarsFields> kLarsFieldNames = {
    FUSEDOPT_LARS_FIELDS(FUSEDOPT_FIELD_NAME)};
#undef FUSEDOPT_FIELD_NAME

// A field of a hyper tensor: a double, or a boolean given as 0/1.
inline void set_field(double& field, double x) { field = x; }
inline void set_field(bool& field, double x) { field = x != 0.0; }

// The values of a `hyper` argument (Note [hyper fields]), checked: a contiguous float64 CPU tensor
// of `fields` elements.
inline const double* hyper_values(const at::Tensor& hyper, int64_t fields, const char* who) {
  TORCH_CHECK(hyper.scalar_type() == at::kDouble && hyper.device().is_cpu() && hyper.dim() == 1 &&
                  hyper.numel() == fields && hyper.is_contiguous(),
              who, "hyper must be a contiguous float64 CPU tensor of ", fields,
              " values (Note [hyper fields]), got ", hyper.scalar_type(), " of shape ",
              hyper.sizes(), " on ", hyper.device());
  return hyper.const_data_ptr<double>();
}

// The LambHyper / LarsHyper of a `hyper` tensor (a tensor lr, passed beside it, overrides lr).
inline LambHyper lamb_hyper_from(const at::Tensor& hyper, const char* who) {
  const double* x = hyper_values(hyper, kLambFields, who);
  LambHyper h;
#define FUSEDOPT_SET_FIELD(name, member, type) set_field(h.member, x[kLamb##name]);
  FUSEDOPT_LAMB_FIELDS(FUSEDOPT_SET_FIELD)
#undef FUSEDOPT_SET_FIELD
  return h;
}

inline LarsHyper lars_hyper_from(const at::Tensor& hyper, const char* who) {
  const double* x = hyper_values(hyper, kLarsFields, who);
  LarsHyper h;
#define FUSEDOPT_SET_FIELD(name, member, type) set_field(h.member, x[kLars##name]);
  FUSEDOPT_LARS_FIELDS(FUSEDOPT_SET_FIELD)
#undef FUSEDOPT_SET_FIELD
  return h;
}

at::Tensor sq_norms(at::TensorList tensors);

at::Tensor lamb_pass1(at::TensorList weights, at::TensorList grads, at::TensorList exp_avgs,
                      at::TensorList exp_avg_sqs, at::TensorList steps, const at::Tensor& hyper,
                      const std::optional<at::Tensor>& grad_mult,
                      const std::optional<at::Tensor>& found_inf,
                      const std::optional<at::Tensor>& keys);

void lamb_pass2(at::TensorList weights, at::TensorList params, at::TensorList exp_avgs,
                at::TensorList exp_avg_sqs, at::TensorList steps, const at::Tensor& sums,
                const at::Tensor& hyper, const std::optional<at::Tensor>& lr,
                const std::optional<at::Tensor>& found_inf);

at::Tensor lars_pass1(at::TensorList weights, at::TensorList grads, at::TensorList steps,
                      const at::Tensor& hyper, const std::optional<at::Tensor>& grad_mult,
                      const std::optional<at::Tensor>& found_inf);

void lars_pass2(at::TensorList weights, at::TensorList params, at::TensorList grads,
                at::TensorList momentum_buffers, at::TensorList steps, const at::Tensor& sums,
                const at::Tensor& hyper, const std::optional<at::Tensor>& lr,
                const std::optional<at::Tensor>& grad_mult,
                const std::optional<at::Tensor>& found_inf);

struct CheckedLists;  // kernels.h (Note [kept layout])
class Fingerprints;

// A list of tensors that somebody else holds for as long as the list is used.
using TensorPtrs = std::vector<const at::Tensor*>;

// Note [kept layout]: a step of a kept bucket (fusedopt/backends/cpp.py) binds its lists once and
// runs its passes on them, instead of handing up to five lists to each operator: converting a
// Python list into a TensorList costs a fraction of a microsecond per tensor and list, and the
// checks of a list a few microseconds per tensor, which for thousands of small tensors outweigh
// the arithmetic (docs/performance.md). The layout keeps what the checks of the lists that do not
// change from step to step (weights, the bf16/fp16 params beside masters, the optimizer state,
// the step counts) saw (CheckedLists in kernels.h: the dtypes, data pointers and chunk table
// that the chunk loops need), and bind() only looks whether the lists it is given are the
// tensors the checks saw (Fingerprints: device, dtype, sizes, strides, data pointer, not
// copy-on-write; a few inline loads per tensor, the look shared by the threads above
// kTensorGrain tensors). If one is not (`p.data = ...`, `model.to(memory_format=...)`,
// `share_memory_()`, a lazy clone, a state tensor replaced), bind says so and the caller checks
// everything again, naming what is wrong; the grads, new every step, are checked at every bind.
// Checking every list in every pass cost a few microseconds per tensor and step
// (docs/performance.md, "Measurements behind the Notes"). The operators above are a layout
// made, checked and bound for one call. Empty lists stand for what a bucket does not have
// (momentum buffers for LAMB, params without masters).
class KeptLayout {
 public:
  KeptLayout();
  ~KeptLayout();

  // Binds a step's lists (weights, params, state_a, state_b, steps, grads) for the passes until
  // end(); the caller holds the tensors until then (the bound lists are pointers: taking a
  // reference to each of thousands of tensors, and letting go of it, cost more than the checks).
  // With check=false: whether they are the tensors and layouts the last check saw and the grads
  // (of grad_dtype, as dense as their weights) fit; nothing is bound when they are not, so that
  // the caller can check them all and name what is wrong. With check=true: every list is
  // checked (raising the operators' errors) and kept; returns true.
  bool bind(std::array<TensorPtrs, 6> lists, at::ScalarType grad_dtype, bool check);
  void end();  // lets go of the bound lists (also after a step that raised)

  at::Tensor grad_sq_norms();  // per-tensor sum of squares of the bound grads
  at::Tensor lamb_pass1(const at::Tensor& hyper, const std::optional<at::Tensor>& grad_mult,
                        const std::optional<at::Tensor>& found_inf,
                        const std::optional<at::Tensor>& keys);
  void lamb_pass2(const at::Tensor& sums, const at::Tensor& hyper,
                  const std::optional<at::Tensor>& lr, const std::optional<at::Tensor>& found_inf);
  at::Tensor lars_pass1(const at::Tensor& hyper, const std::optional<at::Tensor>& grad_mult,
                        const std::optional<at::Tensor>& found_inf);
  void lars_pass2(const at::Tensor& sums, const at::Tensor& hyper,
                  const std::optional<at::Tensor>& lr, const std::optional<at::Tensor>& grad_mult,
                  const std::optional<at::Tensor>& found_inf);

 private:
  struct Bound {
    TensorPtrs weights, params, state_a, state_b, steps, grads;
    at::ScalarType grad_dtype = at::kFloat;
  };
  static std::array<const TensorPtrs*, 5> kept_lists(const Bound& b);  // all but the grads
  const Bound& bound() const;  // the bound lists; raises when nothing is bound
  bool unchanged(const Bound& b) const;  // the fingerprints, looked at by all threads
  bool grads_fit(const Bound& b) const;

  // Note [one call at a time]: the passes run without the GIL (as torch.ops calls do), and bind
  // replaces what the passes read. So every method holds mutex_ from its start to its end: calls
  // on one layout from several threads run one after the other, never interleaved; different
  // layouts run concurrently. The bindings release the GIL before each call, so that a thread
  // waiting for mutex_ never holds the GIL that the thread holding mutex_ may need.
  mutable std::mutex mutex_;
  std::unique_ptr<CheckedLists> checked_;
  std::unique_ptr<Fingerprints> fingerprints_;
  at::ScalarType checked_grad_dtype_ = at::kFloat;  // of the grads of the last check
  std::optional<Bound> bound_;
};

}  // namespace cpu
}  // namespace fusedopt
