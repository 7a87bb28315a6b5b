// Registration of the torch.ops.fusedopt.* operators, and the Python module fusedopt._C whose
// import loads them and which holds BucketLists (Note [static lists] in ops.h) and the names of
// the hyper-parameter fields (Note [hyper fields] in ops.h). Fake (meta) implementations
// are registered in Python, in fusedopt/backends/cpp.py, which set_python_module names so torch
// can import it on demand.
//
// Arguments common to the passes (see docs/backends.md):
//   weights    what the math reads as w: the fp32 masters when present, else the params
//   params     the bf16/fp16 params written with the rounded weights when masters are present,
//              else an empty list
//   steps      0-dim float32 step counts; pass 1 adds 1 unless found_inf is nonzero
//   hyper      the host-side scalars as doubles, in the order of LambField / LarsField (ops.h),
//              whose names fusedopt._C.lamb_fields() / lars_fields() give
//   lr         optional tensor learning rate, overriding hyper's lr
//   grad_mult  optional 0-dim tensor: every gradient element is read as g * grad_mult
//   found_inf  optional 0-dim float32 tensor: when nonzero the step changes nothing
//   sums       [n, 2] per-tensor sums of squares returned by pass 1 (possibly all-reduced)
#include <torch/extension.h>
#include <torch/library.h>

#include "multi_tensor.h"
#include "ops.h"

TORCH_LIBRARY(fusedopt, m) {
  m.set_python_module("fusedopt.backends.cpp");
  m.def("sq_norms(Tensor[] tensors) -> Tensor");
  m.def(
      "lamb_pass1(Tensor[] weights, Tensor[] grads, Tensor(a!)[] exp_avgs, "
      "Tensor(b!)[] exp_avg_sqs, Tensor(c!)[] steps, float[] hyper, Tensor? grad_mult, "
      "Tensor? found_inf) -> Tensor");
  m.def(
      "lamb_pass2(Tensor(a!)[] weights, Tensor(b!)[] params, Tensor[] exp_avgs, "
      "Tensor[] exp_avg_sqs, Tensor[] steps, Tensor sums, float[] hyper, Tensor? lr, "
      "Tensor? found_inf) -> ()");
  m.def(
      "lars_pass1(Tensor[] weights, Tensor[] grads, Tensor(a!)[] steps, float[] hyper, "
      "Tensor? grad_mult, Tensor? found_inf) -> Tensor");
  m.def(
      "lars_pass2(Tensor(a!)[] weights, Tensor(b!)[] params, Tensor[] grads, "
      "Tensor(c!)[] momentum_buffers, Tensor[] steps, Tensor sums, float[] hyper, Tensor? lr, "
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
  using fusedopt::cpu::BucketLists;
  m.doc() = "fusedopt C++ CPU kernels, registered as torch.ops.fusedopt.*, and BucketLists";
  m.def("cpu_isa", &fusedopt::cpu::cpu_isa_name,
        "The instruction-set clone the CPU kernels run: baseline, avx2 or avx512.");
  m.def(
      "lamb_fields", [] { return field_names(fusedopt::cpu::kLambFieldNames); },
      "The names of the LAMB operators' `hyper` values, in order (Note [hyper fields], ops.h).");
  m.def(
      "lars_fields", [] { return field_names(fusedopt::cpu::kLarsFieldNames); },
      "The names of the LARS operators' `hyper` values, in order (Note [hyper fields], ops.h).");
  // Every method runs without the GIL, as torch.ops calls do (other Python threads go on), and
  // takes the lists' mutex: calls on one BucketLists run one at a time (Note [one call at a
  // time], ops.h).
  py::class_<BucketLists>(m, "BucketLists",
                          "The static tensor lists of one bucket (Note [static lists], ops.h).")
      .def(py::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                    std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>>(),
           py::arg("weights"), py::arg("params"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"),
           py::arg("momentum_buffers"), py::arg("steps"))
      .def("accepts", &BucketLists::accepts, py::arg("grads"), py::arg("grad_dtype"),
           py::call_guard<py::gil_scoped_release>())
      .def("lamb_pass1", &BucketLists::lamb_pass1, py::arg("grads"), py::arg("hyper"),
           py::arg("grad_mult"), py::arg("found_inf"), py::call_guard<py::gil_scoped_release>())
      .def("lamb_pass2", &BucketLists::lamb_pass2, py::arg("sums"), py::arg("hyper"),
           py::arg("lr"), py::arg("found_inf"), py::call_guard<py::gil_scoped_release>())
      .def("lars_pass1", &BucketLists::lars_pass1, py::arg("grads"), py::arg("hyper"),
           py::arg("grad_mult"), py::arg("found_inf"), py::call_guard<py::gil_scoped_release>())
      .def("lars_pass2", &BucketLists::lars_pass2, py::arg("grads"), py::arg("sums"),
           py::arg("hyper"), py::arg("lr"), py::arg("grad_mult"), py::arg("found_inf"),
           py::call_guard<py::gil_scoped_release>())
      // Note [taken grads]: the same with the grads of the last accepts() that said yes
      .def("lamb_pass1_taken", &BucketLists::lamb_pass1_taken, py::arg("hyper"),
           py::arg("grad_mult"), py::arg("found_inf"), py::call_guard<py::gil_scoped_release>())
      .def("lars_pass1_taken", &BucketLists::lars_pass1_taken, py::arg("hyper"),
           py::arg("grad_mult"), py::arg("found_inf"), py::call_guard<py::gil_scoped_release>())
      .def("lars_pass2_taken", &BucketLists::lars_pass2_taken, py::arg("sums"), py::arg("hyper"),
           py::arg("lr"), py::arg("grad_mult"), py::arg("found_inf"),
           py::call_guard<py::gil_scoped_release>())
      .def("grad_sq_norms_taken", &BucketLists::grad_sq_norms_taken,
           py::call_guard<py::gil_scoped_release>())
      .def("release", &BucketLists::release, py::call_guard<py::gil_scoped_release>());
}
