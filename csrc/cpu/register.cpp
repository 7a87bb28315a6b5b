// Registration of the torch.ops.fusedopt.* operators, and the Python module fusedopt._C whose
// import loads them and which holds KeptLayout (Note [kept layout] in ops.h) and the names of
// the hyper-parameter fields (Note [hyper fields] in ops.h). Fake (meta) implementations
// are registered in Python, in fusedopt/backends/cpp.py, which set_python_module names so torch
// can import it on demand.
//
// Arguments common to the passes (see docs/backends.md):
//   weights    what the math reads as w: the fp32 masters when present, else the params
//   params     the bf16/fp16 params written with the rounded weights when masters are present,
//              else an empty list
//   steps      0-dim float32 step counts; pass 1 adds 1 unless found_inf is nonzero
//   hyper      the host-side scalars: a float64 CPU tensor of the fields of LambHyper / LarsHyper
//              (Note [hyper fields] in ops.h; fusedopt._C.lamb_fields() / lars_fields() name them)
//   lr         optional tensor learning rate, overriding hyper's lr
//   grad_mult  optional 0-dim tensor: every gradient element is read as g * grad_mult
//   found_inf  optional 0-dim float32 tensor: when nonzero the step changes nothing
//   keys       optional int64 tensor, one key per weight for the random bits of stochastic
//              rounding (Note [state formats] in csrc/fusedopt/math.h); default: the index
//   sums       [n, 2] per-tensor sums of squares returned by pass 1 (possibly all-reduced)
#include <torch/extension.h>
#include <torch/library.h>

#include <algorithm>

#include "multi_tensor.h"
#include "ops.h"

TORCH_LIBRARY(fusedopt, m) {
  m.set_python_module("fusedopt.backends.cpp");
  m.def("sq_norms(Tensor[] tensors) -> Tensor");
  m.def(
      "lamb_pass1(Tensor[] weights, Tensor[] grads, Tensor(a!)[] exp_avgs, "
      "Tensor(b!)[] exp_avg_sqs, Tensor(c!)[] steps, Tensor hyper, Tensor? grad_mult, "
      "Tensor? found_inf, Tensor? keys=None) -> Tensor");
  m.def(
      "lamb_pass2(Tensor(a!)[] weights, Tensor(b!)[] params, Tensor[] exp_avgs, "
      "Tensor[] exp_avg_sqs, Tensor[] steps, Tensor sums, Tensor hyper, Tensor? lr, "
      "Tensor? found_inf) -> ()");
  m.def(
      "lars_pass1(Tensor[] weights, Tensor[] grads, Tensor(a!)[] steps, Tensor hyper, "
      "Tensor? grad_mult, Tensor? found_inf) -> Tensor");
  m.def(
      "lars_pass2(Tensor(a!)[] weights, Tensor(b!)[] params, Tensor[] grads, "
      "Tensor(c!)[] momentum_buffers, Tensor[] steps, Tensor sums, Tensor hyper, Tensor? lr, "
      "Tensor? grad_mult, Tensor? found_inf) -> ()");
}

TORCH_LIBRARY_IMPL(fusedopt, CPU, m) {
  m.impl("sq_norms", &fusedopt::cpu::sq_norms);
  m.impl("lamb_pass1", &fusedopt::cpu::lamb_pass1);
  m.impl("lamb_pass2", &fusedopt::cpu::lamb_pass2);
  m.impl("lars_pass1", &fusedopt::cpu::lars_pass1);
  m.impl("lars_pass2", &fusedopt::cpu::lars_pass2);
}

namespace {

using fusedopt::cpu::TensorPtrs;

// The tensors of a Python list, without taking a reference to any (the caller keeps the list):
// Note [kept layout] in ops.h. A TypeError names an entry that is not a tensor.
TensorPtrs unpacked(const pybind11::list& items, const char* name) {
  TensorPtrs out(items.size());
  for (size_t i = 0; i < out.size(); ++i) {
    PyObject* obj = PyList_GET_ITEM(items.ptr(), static_cast<Py_ssize_t>(i));
    if (!THPVariable_Check(obj)) {
      throw pybind11::type_error(std::string(name) + "[" +
                                 std::to_string(i) + "] is not a tensor");
    }
    out[i] = &THPVariable_Unpack(obj);
  }
  return out;
}

// One int64 per tensor of a list, read by `read`, packed in one bytes (Note [native scans]).
template <typename Read>
pybind11::bytes int64_per_tensor(const pybind11::list& items, const char* name, Read read) {
  std::string out(items.size() * sizeof(int64_t), '\0');
  auto* values = reinterpret_cast<int64_t*>(out.data());
  const TensorPtrs ts = unpacked(items, name);
  for (size_t i = 0; i < ts.size(); ++i) values[i] = read(*ts[i]);
  return pybind11::bytes(out);
}

// The names of a hyper table's fields, in order, as a Python list of str.
template <size_t N>
pybind11::list field_names(const std::array<const char*, N>& names) {
  pybind11::list out;
  for (const char* name : names) out.append(name);
  return out;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  namespace py = pybind11;
  using fusedopt::cpu::KeptLayout;
  m.doc() = "fusedopt C++ CPU kernels, registered as torch.ops.fusedopt.*, and KeptLayout";
  m.def("cpu_isa", &fusedopt::cpu::cpu_isa_name,
        "The instruction-set clone the CPU kernels run: baseline, avx2 or avx512.");
  m.def(
      "lamb_fields", [] { return field_names(fusedopt::cpu::kLambFieldNames); },
      "The names of the LAMB operators' `hyper` values, in order (Note [hyper fields], ops.h).");
  m.def(
      "lars_fields", [] { return field_names(fusedopt::cpu::kLarsFieldNames); },
      "The names of the LARS operators' `hyper` values, in order (Note [hyper fields], ops.h).");
  // Note [native scans]: what a step reads of every tensor of its lists (the grads of the params,
  // addresses, sizes, dtypes and layouts) is read by these C loops, one per list: a Python-level
  // attribute or method call per tensor costs a multiple of the C read, and more again once
  // thousands of tensor objects no longer fit the caches (docs/performance.md, "Native scans").
  // fusedopt/_bucket.py holds their Python equivalents, for a tree without this extension.
  m.def(
      "data_ptrs",
      [](const py::list& items) {
        return int64_per_tensor(items, "data_ptrs: tensors", [](const at::Tensor& t) {
          return reinterpret_cast<int64_t>(t.data_ptr());
        });
      },
      py::arg("tensors"), "The data pointers of a list of tensors, as int64 values in one bytes.");
  m.def(
      "numels",
      [](const py::list& items) {
        return int64_per_tensor(items, "numels: tensors",
                                [](const at::Tensor& t) { return t.numel(); });
      },
      py::arg("tensors"), "The numel of each tensor of a list, as int64 values in one bytes.");
  m.def(
      "grads",
      [](const py::handle& params) {
        const auto seq = py::reinterpret_steal<py::object>(
            PySequence_Fast(params.ptr(), "grads: params must be a sequence"));
        if (!seq) throw py::error_already_set();
        const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
        PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
        // torch.Tensor and nn.Parameter read .grad from the autograd metadata; any other type
        // (a subclass may override it, or __torch_function__) is read as Python reads it
        static PyObject* const parameter =
            py::object(py::module_::import("torch.nn").attr("Parameter")).release().ptr();
        py::list out(n);
        for (Py_ssize_t i = 0; i < n; ++i) {
          PyObject* obj = items[i];
          if (!THPVariable_CheckExact(obj) &&
              Py_TYPE(obj) != reinterpret_cast<PyTypeObject*>(parameter)) {
            out[i] = py::reinterpret_borrow<py::object>(obj).attr("grad");
            continue;
          }
          const at::Tensor& grad = THPVariable_Unpack(obj).grad();
          out[i] = grad.defined() ? py::reinterpret_steal<py::object>(THPVariable_Wrap(grad))
                                  : py::none();
        }
        return out;
      },
      py::arg("params"), "[p.grad for p in params].");
  m.def(
      "dtype_codes",
      [](const py::list& items, const std::vector<at::ScalarType>& dtypes) {
        std::string out(items.size(), '\0');
        for (size_t i = 0; i < out.size(); ++i) {
          PyObject* obj = PyList_GET_ITEM(items.ptr(), static_cast<Py_ssize_t>(i));
          if (!THPVariable_Check(obj)) continue;
          const auto it = std::find(dtypes.begin(), dtypes.end(),
                                    THPVariable_Unpack(obj).scalar_type());
          if (it != dtypes.end()) out[i] = static_cast<char>(1 + (it - dtypes.begin()));
        }
        return py::bytes(out);
      },
      py::arg("tensors"), py::arg("dtypes"),
      "For each entry of a list, one byte: 1 + the index of its dtype in dtypes, 0 if it is no "
      "tensor of one of them.");
  m.def(
      "dense",
      [](const py::list& items, at::ScalarType dtype, const at::Device& device) {
        for (const py::handle item : items) {
          if (!THPVariable_Check(item.ptr())) return false;
          const at::Tensor& t = THPVariable_Unpack(item.ptr());
          if (t.layout() != at::kStrided || t.scalar_type() != dtype || t.device() != device ||
              !t.is_contiguous()) {
            return false;
          }
        }
        return true;
      },
      py::arg("tensors"), py::arg("dtype"), py::arg("device"),
      "Whether every entry of a list is a contiguous strided tensor of dtype on device.");
  // Every method runs without the GIL, as torch.ops calls do (other Python threads go on), and
  // takes the layout's mutex (Note [one call at a time], ops.h).
  using py::arg;
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  py::class_<KeptLayout>(m, "KeptLayout", "A bucket's checked lists (Note [kept layout], ops.h).")
      .def(py::init<>())
      .def(
          "bind",
          [](KeptLayout& k, const py::list& weights, const py::list& params,
             const py::list& state_a, const py::list& state_b, const py::list& steps,
             const py::list& grads, at::ScalarType grad_dtype, bool check) {
            std::array<TensorPtrs, 6> lists{
                unpacked(weights, "KeptLayout.bind: weights"), unpacked(params, "KeptLayout.bind: params"),
                unpacked(state_a, "KeptLayout.bind: state_a"),
                unpacked(state_b, "KeptLayout.bind: state_b"),
                unpacked(steps, "KeptLayout.bind: steps"), unpacked(grads, "KeptLayout.bind: grads")};
            py::gil_scoped_release no_gil;
            return k.bind(std::move(lists), grad_dtype, check);
          },
          arg("weights"), arg("params"), arg("state_a"), arg("state_b"), arg("steps"),
          arg("grads"), arg("grad_dtype"), arg("check"),
          "Binds a step's lists (kept alive by the caller until end()); Note [kept layout].")
      .def("end", &KeptLayout::end, nogil)
      .def("grad_sq_norms", &KeptLayout::grad_sq_norms, nogil)
      .def("lamb_pass1", &KeptLayout::lamb_pass1, arg("hyper"), arg("grad_mult"),
           arg("found_inf"), arg("keys") = py::none(), nogil)
      .def("lamb_pass2", &KeptLayout::lamb_pass2, arg("sums"), arg("hyper"), arg("lr"),
           arg("found_inf"), nogil)
      .def("lars_pass1", &KeptLayout::lars_pass1, arg("hyper"), arg("grad_mult"),
           arg("found_inf"), nogil)
      .def("lars_pass2", &KeptLayout::lars_pass2, arg("sums"), arg("hyper"), arg("lr"),
           arg("grad_mult"), arg("found_inf"), nogil);
}
