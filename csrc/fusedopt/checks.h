// The input checks of the operators' tensor lists, shared by the C++ CPU backend
// (csrc/cpu/ops.cpp) and the CUDA binding (csrc/cuda/bindings.cpp). Each file instantiates them
// with a device policy:
//
//   struct Device {
//     static constexpr const char* kWho;   // message prefix: "fusedopt <name> backend: "
//     static constexpr bool kEmptyListOk;  // whether a list may hold no tensor
//     // whether t is where the backend runs, for a bucket whose first weight is w0
//     static bool on_device(const at::Tensor& t, const at::Tensor& w0);
//     // message parts (anything TORCH_CHECK prints; built only when a check fails): what follows
//     // "<list>[i] is on <device>", and what step counts must be
//     static ... elsewhere(const at::Tensor& w0);
//     static ... step_form(const at::Tensor& w0);
//   };
//
// Host code only, and torch's CPU headers only: the CUDA binding must compile against the CPU
// wheel too, which lacks the dependencies of ATen/cuda/*.
#pragma once

#include <ATen/ATen.h>
#include <fusedopt/math.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace fusedopt {
namespace checks {

// Whether dense t lays its elements out as dense w does, so that both walk as flat arrays of
// numel() elements from data_ptr() in the same order: equal sizes, and equal strides on every
// dimension of size > 1 (a size-1 dimension's stride is never used; a tensor of at most one
// element has a single layout).
// Math runs in float64 for float64 weights and in float32 for every other dtype (as
// fusedopt/_bucket.py compute_dtype).
inline at::ScalarType compute_dtype(at::ScalarType weight_dtype) {
  return weight_dtype == at::kDouble ? at::kDouble : at::kFloat;
}

inline bool same_layout(const at::Tensor& t, const at::Tensor& w) {
  const c10::TensorImpl* a = t.unsafeGetTensorImpl();
  const c10::TensorImpl* b = w.unsafeGetTensorImpl();
  if (a->numel() != b->numel()) return false;
  if (a->numel() <= 1) return true;
  const c10::IntArrayRef as = a->sizes(), bs = b->sizes(), ast = a->strides(), bst = b->strides();
  if (as.size() != bs.size()) return false;
  for (size_t d = 0; d < as.size(); ++d) {
    if (as[d] != bs[d] || (as[d] != 1 && ast[d] != bst[d])) return false;
  }
  return true;
}

// Checks one tensor list of a bucket and returns its dtype: one tensor per weight, all of one
// dtype on the backend's device, each non-overlapping and dense with the layout of the matching
// weight (same_layout). An empty list (when the device allows it) has dtype float32.
template <typename Device>
at::ScalarType check_list(at::TensorList ts, at::TensorList weights, const char* name) {
  TORCH_CHECK(ts.size() == weights.size(), Device::kWho, weights.size(), " weights but ",
              ts.size(), " ", name);
  if (ts.empty()) {
    TORCH_CHECK(Device::kEmptyListOk, Device::kWho, "empty bucket (", name, ")");
    return at::kFloat;
  }
  const at::ScalarType dtype = ts[0].scalar_type();
  const at::Tensor& w0 = weights[0];
  for (size_t i = 0; i < ts.size(); ++i) {
    const at::Tensor& t = ts[i];
    TORCH_CHECK(Device::on_device(t, w0), Device::kWho, name, "[", i, "] is on ", t.device(),
                Device::elsewhere(w0));
    TORCH_CHECK(t.scalar_type() == dtype, Device::kWho, name, " mix dtypes ", dtype, " and ",
                t.scalar_type());
    TORCH_CHECK(t.is_non_overlapping_and_dense(), Device::kWho, name, "[", i,
                "] is not dense (strides ", t.strides(), ")");
    TORCH_CHECK(same_layout(t, weights[i]), Device::kWho, name, "[", i, "] has shape ", t.sizes(),
                " and strides ", t.strides(), " but its weight ", weights[i].sizes(), " and ",
                weights[i].strides());
  }
  return dtype;
}

// check_list, and the list (if not empty) is in the compute dtype.
template <typename Device>
void check_state(at::TensorList ts, at::TensorList weights, at::ScalarType compute,
                 const char* name) {
  const at::ScalarType dtype = check_list<Device>(ts, weights, name);
  TORCH_CHECK(ts.empty() || dtype == compute, Device::kWho, name, " must be ", compute,
              " (the compute dtype), got ", dtype);
}

// A state list whose tensors may each be stored in a low-precision format (Note [state formats]
// in math.h): the compute dtype, bfloat16 (float32 compute) with the weight's layout, or a packed
// 8-bit uint8 tensor (float32 compute): one dimension, contiguous, q8_packed_numel(numel) bytes
// from a 4-byte boundary. Writes the format of each tensor to formats (resized).
template <typename Device>
void check_state_formats(at::TensorList ts, at::TensorList weights, at::ScalarType compute,
                         const char* name, std::vector<unsigned char>& formats) {
  TORCH_CHECK(ts.size() == weights.size(), Device::kWho, weights.size(), " weights but ",
              ts.size(), " ", name);
  formats.assign(ts.size(), kFullState);
  for (size_t i = 0; i < ts.size(); ++i) {
    const at::Tensor& t = ts[i];
    const at::Tensor& w = weights[i];
    TORCH_CHECK(Device::on_device(t, weights[0]), Device::kWho, name, "[", i, "] is on ",
                t.device(), Device::elsewhere(weights[0]));
    const at::ScalarType dtype = t.scalar_type();
    const bool low = compute == at::kFloat;
    if (dtype == at::kByte && low) {
      TORCH_CHECK(t.dim() == 1 && t.is_contiguous() && t.numel() == q8_packed_numel(w.numel()) &&
                      reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 4 == 0,
                  Device::kWho, name, "[", i, "] is uint8 but not a packed 8-bit state of its ",
                  w.numel(), "-element weight (one contiguous dimension of ",
                  q8_packed_numel(w.numel()), " bytes from a 4-byte boundary; got shape ",
                  t.sizes(), ")");
      formats[i] = k8bitState;
      continue;
    }
    TORCH_CHECK(dtype == compute || (low && dtype == at::kBFloat16), Device::kWho, name, "[", i,
                "] must be ", compute, " (the compute dtype)",
                low ? ", bfloat16 or a packed 8-bit uint8 tensor" : "", ", got ", dtype);
    TORCH_CHECK(t.is_non_overlapping_and_dense(), Device::kWho, name, "[", i,
                "] is not dense (strides ", t.strides(), ")");
    TORCH_CHECK(same_layout(t, w), Device::kWho, name, "[", i, "] has shape ", t.sizes(),
                " and strides ", t.strides(), " but its weight ", w.sizes(), " and ", w.strides());
    formats[i] = dtype == compute ? kFullState : kBf16State;
  }
}

// One step count per weight: a one-element float32 tensor on the backend's device.
template <typename Device>
void check_steps(at::TensorList steps, at::TensorList weights) {
  TORCH_CHECK(steps.size() == weights.size(), Device::kWho, weights.size(), " weights but ",
              steps.size(), " steps");
  for (const at::Tensor& s : steps) {
    TORCH_CHECK(Device::on_device(s, weights[0]) && s.scalar_type() == at::kFloat &&
                    s.numel() == 1,
                Device::kWho, "step counts must be ", Device::step_form(weights[0]), ", got ",
                s.scalar_type(), " of shape ", s.sizes(), " on ", s.device());
  }
}

}  // namespace checks
}  // namespace fusedopt
