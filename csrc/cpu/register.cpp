// Registration of the torch.ops.fusedopt.* operators, and the Python module fusedopt._C whose
// import loads them and which holds BucketLists (Note [static lists] in ops.h) and the plan
// cache's identity scan (Note [identity scans] in python_helpers.h). Fake (meta) implementations
// are registered in Python, in fusedopt/backends/cpp.py, which set_python_module names so torch
// can import it on demand.
//
// Arguments common to the passes (see docs/CONTRIBUTING_BACKENDS.md):
//   weights    what the math reads as w: the fp32 masters when present, else the params
//   params     the bf16/fp16 params written with the rounded weights when masters are present,
//              else an empty list
//   steps      0-dim float32 step counts; pass 1 adds 1 unless found_inf is nonzero
//   hyper      the host-side scalars as doubles, in the order of LambField / LarsField (ops.h)
//   lr         optional tensor learning rate, overriding hyper's lr
//   grad_mult  optional 0-dim tensor: every gradient element is read as g * grad_mult
//   found_inf  optional 0-dim float32 tensor: when nonzero the step changes nothing
//   sums       [n, 2] per-tensor sums of squares returned by pass 1 (possibly all-reduced)
#include <torch/extension.h>
#include <torch/library.h>

#include "multi_tensor.h"
#include "ops.h"
#include "python_helpers.h"

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

PYBIND11_MODULE(_C, m) {
  namespace py = pybind11;
  using fusedopt::cpu::BucketLists;
  m.doc() = "fusedopt C++ CPU kernels, registered as torch.ops.fusedopt.*, and BucketLists";
  m.def("cpu_isa", &fusedopt::cpu::cpu_isa_name,
        "The instruction-set clone the CPU kernels run: baseline, avx2 or avx512.");
  m.def("entries_are", &fusedopt::cpu::entries_are, py::arg("dicts"), py::arg("keys"),
        py::arg("lists"),
        "Whether dicts[i][keys[j]] is lists[j][i] for all i, j (Note [identity scans]).");
  m.def("items_are", &fusedopt::cpu::items_are, py::arg("a"), py::arg("b"),
        "Whether two lists hold the same objects in the same order.");
  m.def("dict_items_are", &fusedopt::cpu::dict_items_are, py::arg("d"), py::arg("keys"),
        py::arg("values"), "Whether a dict's items, in order, are exactly these keys and values.");
  py::class_<BucketLists>(m, "BucketLists",
                          "The static tensor lists of one bucket (Note [static lists], ops.h).")
      .def(py::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                    std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                    std::vector<at::Tensor>>(),
           py::arg("weights"), py::arg("params"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"),
           py::arg("momentum_buffers"), py::arg("steps"), py::arg("grad_holders"))
      .def("accepts", &BucketLists::accepts, py::arg("grads"), py::arg("grad_dtype"))
      .def("take_grads", &BucketLists::take_grads, py::arg("grad_dtype"))
      .def("taken_grad_sq_norms", &BucketLists::taken_grad_sq_norms)
      // the passes run without the GIL, as torch.ops calls do (other Python threads go on);
      // grads=None: the grads of take_grads (Note [grads taken in C++], ops.h)
      .def("lamb_pass1", &BucketLists::lamb_pass1, py::arg("grads"), py::arg("hyper"),
           py::arg("grad_mult"), py::arg("found_inf"), py::call_guard<py::gil_scoped_release>())
      .def("lamb_pass2", &BucketLists::lamb_pass2, py::arg("sums"), py::arg("hyper"),
           py::arg("lr"), py::arg("found_inf"), py::call_guard<py::gil_scoped_release>())
      .def("lars_pass1", &BucketLists::lars_pass1, py::arg("grads"), py::arg("hyper"),
           py::arg("grad_mult"), py::arg("found_inf"), py::call_guard<py::gil_scoped_release>())
      .def("lars_pass2", &BucketLists::lars_pass2, py::arg("grads"), py::arg("sums"),
           py::arg("hyper"), py::arg("lr"), py::arg("grad_mult"), py::arg("found_inf"),
           py::call_guard<py::gil_scoped_release>());
}
