// CUDA implementations of the torch.ops.fusedopt.* operators (schemas in csrc/cpu/register.cpp,
// argument conventions in csrc/cpu/ops.h), and the (empty) Python module fusedopt._cuda whose
// import registers them. This file checks the tensors, turns them into raw pointers and calls the
// launchers of launch.h on the current stream; it never reads a device tensor's value on the
// host, so a step neither synchronizes nor copies anything between host and device. (The keys of
// LAMB's stochastic rounding, read when some state is low-precision, are a CPU tensor as the
// optimizers pass them, and so is a CPU tensor lr: Note [CPU tensor lr].)
#include <Python.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../cpu/ops.h"
#include "fusedopt/checks.h"
#include "launch.h"

namespace fusedopt {
namespace cuda {
namespace {

constexpr const char* kWho = "fusedopt cuda backend: ";

DType to_dtype(at::ScalarType s, const char* what) {
  switch (s) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kDouble: return DType::kFloat64;
    default:
      TORCH_CHECK(false, kWho, what, " of dtype ", s,
                  " are not supported (float32, float16, bfloat16, float64 are)");
  }
}

using checks::compute_dtype;

// The device policy of the shared checks of fusedopt/checks.h: CUDA tensors on the device of the
// bucket's first weight.
struct OnBucketDevice {
  static constexpr const char* kWho = "fusedopt cuda backend: ";
  static constexpr bool kEmptyListOk = false;
  static bool on_device(const at::Tensor& t, const at::Tensor& w0) {
    return t.device() == w0.device() && w0.device().is_cuda();
  }
  static std::string elsewhere(const at::Tensor& w0) {
    return c10::str(" but the bucket is on ", w0.device(), "; it runs on CUDA tensors only");
  }
  static std::string step_form(const at::Tensor& w0) {
    return c10::str("one-element float32 tensors on ", w0.device());
  }
};

at::ScalarType check_list(at::TensorList ts, at::TensorList weights, const char* name) {
  return checks::check_list<OnBucketDevice>(ts, weights, name);
}

// The state lists of a pass (the second may be empty: LARS), each tensor in any state format
// (Note [state formats] in fusedopt/math.h), both moments of a weight in the same one; returns
// the formats.
std::vector<unsigned char> check_states(at::TensorList a, at::TensorList b,
                                        at::TensorList weights, at::ScalarType compute,
                                        const char* name_a, const char* name_b) {
  std::vector<unsigned char> formats, formats_b;
  checks::check_state_formats<OnBucketDevice>(a, weights, compute, name_a, formats);
  if (name_b == nullptr) return formats;
  checks::check_state_formats<OnBucketDevice>(b, weights, compute, name_b, formats_b);
  for (size_t i = 0; i < formats.size(); ++i) {
    TORCH_CHECK(formats[i] == formats_b[i], kWho, "the two moments of weight ", i,
                " are stored in different formats (", a[i].scalar_type(), " and ",
                b[i].scalar_type(), "); Note [state formats]");
  }
  return formats;
}

bool any_low_precision(const std::vector<unsigned char>& formats) {
  for (unsigned char f : formats) {
    if (f != kFullState) return true;
  }
  return false;
}

// The keys of the random bits of LAMB's stochastic rounding (one per weight; None: the index),
// read on the host: a CPU tensor, as the optimizers pass them (a device tensor is copied, which
// synchronizes). Only read when some state is low-precision. The state row holds 24 bits of a
// key's low half (Note [state rows] in lowp.cuh).
std::vector<int64_t> read_keys(const std::optional<at::Tensor>& keys, int64_t n) {
  std::vector<int64_t> out(static_cast<size_t>(n));
  if (!keys.has_value()) {
    for (int64_t i = 0; i < n; ++i) out[static_cast<size_t>(i)] = i;
    return out;
  }
  const at::Tensor k = keys->to(at::kCPU, at::kLong).contiguous();
  TORCH_CHECK(k.numel() == n, kWho, "keys must hold one key per weight (", n, "), got ",
              k.numel());
  const int64_t* p = k.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK((static_cast<uint64_t>(p[i]) & 0xffffffffu) < (uint64_t{1} << 24), kWho,
                "the key of weight ", i, " is ", p[i] & 0xffffffff,
                "; the CUDA backend takes keys below 2^24 (the index of a param in its group)");
    out[static_cast<size_t>(i)] = p[i];
  }
  return out;
}

void check_steps(at::TensorList steps, at::TensorList weights) {
  checks::check_steps<OnBucketDevice>(steps, weights);
}

// Device pointer of an optional one-element tensor on the bucket's device, read by the kernels.
template <typename T>
const T* scalar_ptr(const std::optional<at::Tensor>& t, at::ScalarType dtype, c10::Device device,
                    const char* name) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->device() == device && t->scalar_type() == dtype && t->numel() == 1, kWho, name,
              " must be a one-element ", dtype, " tensor on ", device, ", got ", t->scalar_type(),
              " of shape ", t->sizes(), " on ", t->device());
  return static_cast<const T*>(t->const_data_ptr());
}

DeviceScalars device_scalars(const std::optional<at::Tensor>& grad_mult,
                             const std::optional<at::Tensor>& found_inf,
                             const std::optional<at::Tensor>& lr, at::ScalarType compute,
                             c10::Device device) {
  DeviceScalars s;
  s.grad_mult = scalar_ptr<void>(grad_mult, compute, device, "grad_mult");
  s.found_inf = scalar_ptr<float>(found_inf, at::kFloat, device, "found_inf");
  s.lr = scalar_ptr<double>(lr, at::kDouble, device, "lr (a tensor)");
  return s;
}

// Note [CPU tensor lr] (fusedopt/backends/triton_backend.py): a tensor lr on the CPU (torch's
// compiled-optimizer tutorial uses one with CUDA params) is read here on the host, which is no
// device sync (a copy to the device would be a pageable upload that blocks the host), and
// replaces the hyper's lr by value: the kernels read the same float64 as from the device, so the
// result is bit-identical. It is refused during CUDA-graph capture, where every replay would keep
// this step's value. A tensor lr on the bucket's device is read by the kernels as float64 (one of
// another floating dtype is cast on the device, on the current stream: no host sync). Returns the
// device tensor the kernels read, or nullopt (a number lr, or a CPU tensor lr now in hyper_lr).
std::optional<at::Tensor> device_lr(const std::optional<at::Tensor>& lr, double& hyper_lr,
                                    c10::Device device) {
  if (!lr.has_value()) return std::nullopt;
  TORCH_CHECK(lr->numel() == 1 && lr->is_floating_point(), kWho,
              "lr (a tensor) must be a one-element floating-point tensor, got ", lr->scalar_type(),
              " of shape ", lr->sizes());
  if (lr->device().is_cpu()) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(
        cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(device.index()).stream(), &status));
    TORCH_CHECK(status == cudaStreamCaptureStatusNone, kWho,
                "a CPU tensor lr cannot be captured in a CUDA graph: the step reads its value on "
                "the host, so every replay would use the value of the captured step; keep the "
                "tensor lr on the params' device for a captured step");
    hyper_lr = lr->item<double>();  // host memory: no device sync
    return std::nullopt;
  }
  TORCH_CHECK(lr->device() == device, kWho, "lr (a tensor) is on ", lr->device(),
              ", the bucket on ", device, "; put it on the CPU or on the bucket's device");
  return lr->scalar_type() == at::kDouble ? *lr : lr->to(at::kDouble);
}

// The hyper-parameter tensors are parsed as by the CPU operators (Note [hyper fields] in
// csrc/cpu/ops.h): a CPU tensor, read on the host without a device sync.
LambHyper lamb_hyper(const at::Tensor& x) {
  return fusedopt::cpu::lamb_hyper_from(x, "fusedopt cuda backend: ");
}

LarsHyper lars_hyper(const at::Tensor& x) {
  return fusedopt::cpu::lars_hyper_from(x, "fusedopt cuda backend: ");
}

// The raw pointers of a bucket's lists; owns the arrays BucketPtrs points into.
struct Pointers {
  std::vector<int64_t> numel;
  std::vector<void*> weights, grads, state1, state2, params;
  std::vector<float*> steps;
  BucketPtrs b{};

  static std::vector<void*> of(at::TensorList ts) {
    std::vector<void*> p(ts.size());
    for (size_t i = 0; i < ts.size(); ++i) p[i] = ts[i].data_ptr();
    return p;
  }

  std::vector<unsigned char> formats;  // of the state (Note [state formats]), or empty: full
  std::vector<int64_t> keys;           // of the random bits, or empty: the indices

  Pointers(at::TensorList w, at::TensorList g, at::TensorList s1, at::TensorList s2,
           at::TensorList p, at::TensorList st, std::vector<unsigned char> f = {},
           std::vector<int64_t> k = {})
      : weights(of(w)), grads(of(g)), state1(of(s1)), state2(of(s2)), params(of(p)),
        formats(std::move(f)), keys(std::move(k)) {
    numel.resize(w.size());
    steps.resize(st.size());
    for (size_t i = 0; i < w.size(); ++i) numel[i] = w[i].numel();
    for (size_t i = 0; i < st.size(); ++i) steps[i] = st[i].data_ptr<float>();
    b.n = static_cast<int64_t>(w.size());
    b.numel = numel.data();
    b.weights = weights.data();
    b.weight_dtype = to_dtype(w[0].scalar_type(), "weights");
    b.grads = g.empty() ? nullptr : grads.data();
    b.grad_dtype = g.empty() ? b.weight_dtype : to_dtype(g[0].scalar_type(), "grads");
    b.state1 = s1.empty() ? nullptr : state1.data();
    b.state2 = s2.empty() ? nullptr : state2.data();
    b.params = p.empty() ? nullptr : params.data();
    b.param_dtype = p.empty() ? b.weight_dtype : to_dtype(p[0].scalar_type(), "params");
    b.steps = steps.data();
    b.formats = any_low_precision(formats) ? formats.data() : nullptr;
    b.keys = b.formats != nullptr && !keys.empty() ? keys.data() : nullptr;
  }
};

// fusedopt/backends/cuda.py declines the other dtype combinations before any state is created;
// this is the last line of defence.
void check_supported(const BucketPtrs& b) {
  const char* why = unsupported_dtypes(b);
  TORCH_CHECK(why == nullptr, kWho, why);
}

const char* dtype_name(DType d) {
  switch (d) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat64: return "float64";
  }
  return "?";
}

// The kernel template a bucket dispatches to, for error messages.
std::string specialization(const BucketPtrs& b) {
  std::string s = std::string("(weights ") + dtype_name(b.weight_dtype);
  if (b.grads != nullptr) s += std::string(", grads ") + dtype_name(b.grad_dtype);
  if (b.params != nullptr) s += std::string(", params ") + dtype_name(b.param_dtype);
  return s + ", " + std::to_string(b.n) + " tensors)";
}

// A launcher's error, naming the backend, the operator (and so its kernels) and the specialization.
void check_launch(cudaError_t err, const char* op, const std::string& spec) {
  TORCH_CHECK(err == cudaSuccess, kWho, op, " failed for the specialization ", spec, ": ",
              cudaGetErrorString(err));
}

// The [n, 2] sums given to pass 2, as a dense tensor of the compute dtype on the device.
at::Tensor sums_arg(const at::Tensor& sums, int64_t n, at::ScalarType compute, c10::Device device) {
  TORCH_CHECK(sums.dim() == 2 && sums.size(0) == n && sums.size(1) == 2, kWho, "sums must be [",
              n, ", 2], got ", sums.sizes());
  TORCH_CHECK(sums.device() == device, kWho, "sums are on ", sums.device(), ", the bucket on ",
              device);
  return sums.to(compute).contiguous();
}

at::Tensor workspace(int64_t n, const int64_t* numel, int64_t k, const at::Tensor& like,
                     at::ScalarType dtype) {
  return at::empty({total_chunks(n, numel), k}, like.options().dtype(dtype));
}

// Pass 1 of either optimizer on the current stream: allocates the [n, 2] sums and the chunk
// workspace, which launch(sums, partials, stream) fills.
template <typename Launch>
at::Tensor run_pass1(const Pointers& p, at::ScalarType compute, c10::Device device,
                     const at::Tensor& like, const char* op, const Launch& launch) {
  check_supported(p.b);
  const c10::cuda::CUDAGuard guard(device);
  at::Tensor sums = at::empty({p.b.n, 2}, like.options().dtype(compute));
  at::Tensor partials = workspace(p.b.n, p.b.numel, 2, sums, compute);
  check_launch(launch(sums.data_ptr(), partials.data_ptr(), c10::cuda::getCurrentCUDAStream()), op,
               specialization(p.b));
  return sums;
}

// Pass 2 of either optimizer on the current stream: launch(sums, stream) with pass 1's sums as a
// dense tensor of the compute dtype.
template <typename Launch>
void run_pass2(const Pointers& p, const at::Tensor& sums, at::ScalarType compute,
               c10::Device device, const char* op, const Launch& launch) {
  check_supported(p.b);
  const c10::cuda::CUDAGuard guard(device);
  const at::Tensor s2 = sums_arg(sums, p.b.n, compute, device);
  check_launch(launch(s2.const_data_ptr(), c10::cuda::getCurrentCUDAStream()), op,
               specialization(p.b));
}

}  // namespace

// ------------------------------------------------------------------------------------- ops

at::Tensor sq_norms(at::TensorList tensors) {
  TORCH_CHECK(!tensors.empty(), kWho, "sq_norms of an empty list");
  const at::ScalarType dtype = tensors[0].scalar_type();
  const c10::Device device = tensors[0].device();
  std::vector<at::Tensor> dense(tensors.begin(), tensors.end());
  std::vector<int64_t> numel(dense.size());
  std::vector<void*> data(dense.size());
  for (size_t i = 0; i < dense.size(); ++i) {
    TORCH_CHECK(dense[i].device() == device && device.is_cuda(), kWho, "sq_norms got tensors on ",
                device, " and ", dense[i].device(), "; it runs on CUDA tensors of one device");
    TORCH_CHECK(dense[i].scalar_type() == dtype, kWho, "sq_norms got dtypes ", dtype, " and ",
                dense[i].scalar_type(), "; pass tensors of one dtype");
    // A dense tensor's elements fill [data_ptr, data_ptr + numel) in some order; others are
    // copied (never the case for the tensors of an optimizer step).
    if (!dense[i].is_non_overlapping_and_dense()) dense[i] = dense[i].contiguous();
    numel[i] = dense[i].numel();
    data[i] = dense[i].data_ptr();
  }
  const c10::cuda::CUDAGuard guard(device);
  const at::ScalarType out_dtype = compute_dtype(dtype);
  const int64_t n = static_cast<int64_t>(dense.size());
  at::Tensor out = at::empty({n}, dense[0].options().dtype(out_dtype));
  at::Tensor partials = workspace(n, numel.data(), 1, out, out_dtype);
  check_launch(launch_sq_norms(n, numel.data(), data.data(), to_dtype(dtype, "sq_norms inputs"),
                               out.data_ptr(), partials.data_ptr(),
                               c10::cuda::getCurrentCUDAStream()),
               "sq_norms", std::string("(") + c10::toString(dtype) + ", " + std::to_string(n) +
                               " tensors)");
  return out;
}

at::Tensor lamb_pass1(at::TensorList weights, at::TensorList grads, at::TensorList exp_avgs,
                      at::TensorList exp_avg_sqs, at::TensorList steps, const at::Tensor& hyper,
                      const std::optional<at::Tensor>& grad_mult,
                      const std::optional<at::Tensor>& found_inf,
                      const std::optional<at::Tensor>& keys) {
  const at::ScalarType compute = compute_dtype(check_list(weights, weights, "weights"));
  check_list(grads, weights, "grads");
  std::vector<unsigned char> formats =
      check_states(exp_avgs, exp_avg_sqs, weights, compute, "exp_avgs", "exp_avg_sqs");
  check_steps(steps, weights);
  const c10::Device device = weights[0].device();
  const LambHyper h = lamb_hyper(hyper);
  const DeviceScalars s = device_scalars(grad_mult, found_inf, std::nullopt, compute, device);
  std::vector<int64_t> key_values;
  if (any_low_precision(formats)) {
    key_values = read_keys(keys, static_cast<int64_t>(weights.size()));
  }
  const Pointers p(weights, grads, exp_avgs, exp_avg_sqs, {}, steps, std::move(formats),
                   std::move(key_values));
  return run_pass1(p, compute, device, weights[0], "lamb_pass1",
                   [&](void* sums, void* partials, cudaStream_t stream) {
                     return launch_lamb_pass1(p.b, h, s, sums, partials, stream);
                   });
}

void lamb_pass2(at::TensorList weights, at::TensorList params, at::TensorList exp_avgs,
                at::TensorList exp_avg_sqs, at::TensorList steps, const at::Tensor& sums,
                const at::Tensor& hyper, const std::optional<at::Tensor>& lr,
                const std::optional<at::Tensor>& found_inf) {
  const at::ScalarType compute = compute_dtype(check_list(weights, weights, "weights"));
  if (!params.empty()) check_list(params, weights, "params");
  std::vector<unsigned char> formats =
      check_states(exp_avgs, exp_avg_sqs, weights, compute, "exp_avgs", "exp_avg_sqs");
  check_steps(steps, weights);
  const c10::Device device = weights[0].device();
  LambHyper h = lamb_hyper(hyper);
  const std::optional<at::Tensor> lr_d = device_lr(lr, h.lr, device);  // Note [CPU tensor lr]
  const DeviceScalars s = device_scalars(std::nullopt, found_inf, lr_d, compute, device);
  const Pointers p(weights, {}, exp_avgs, exp_avg_sqs, params, steps, std::move(formats));
  run_pass2(p, sums, compute, device, "lamb_pass2", [&](const void* s2, cudaStream_t stream) {
    return launch_lamb_pass2(p.b, h, s, s2, stream);
  });
}

at::Tensor lars_pass1(at::TensorList weights, at::TensorList grads, at::TensorList steps,
                      const at::Tensor& hyper, const std::optional<at::Tensor>& grad_mult,
                      const std::optional<at::Tensor>& found_inf) {
  const at::ScalarType compute = compute_dtype(check_list(weights, weights, "weights"));
  check_list(grads, weights, "grads");
  check_steps(steps, weights);
  const c10::Device device = weights[0].device();
  const LarsHyper h = lars_hyper(hyper);
  const DeviceScalars s = device_scalars(grad_mult, found_inf, std::nullopt, compute, device);
  const Pointers p(weights, grads, {}, {}, {}, steps);
  return run_pass1(p, compute, device, weights[0], "lars_pass1",
                   [&](void* sums, void* partials, cudaStream_t stream) {
                     return launch_lars_pass1(p.b, h, s, sums, partials, stream);
                   });
}

void lars_pass2(at::TensorList weights, at::TensorList params, at::TensorList grads,
                at::TensorList momentum_buffers, at::TensorList steps, const at::Tensor& sums,
                const at::Tensor& hyper, const std::optional<at::Tensor>& lr,
                const std::optional<at::Tensor>& grad_mult,
                const std::optional<at::Tensor>& found_inf) {
  const at::ScalarType compute = compute_dtype(check_list(weights, weights, "weights"));
  check_list(grads, weights, "grads");
  if (!params.empty()) check_list(params, weights, "params");
  std::vector<unsigned char> formats =
      check_states(momentum_buffers, {}, weights, compute, "momentum_buffers", nullptr);
  check_steps(steps, weights);
  const c10::Device device = weights[0].device();
  LarsHyper h = lars_hyper(hyper);
  const std::optional<at::Tensor> lr_d = device_lr(lr, h.lr, device);  // Note [CPU tensor lr]
  const DeviceScalars s = device_scalars(grad_mult, found_inf, lr_d, compute, device);
  const Pointers p(weights, grads, momentum_buffers, {}, params, steps, std::move(formats));
  run_pass2(p, sums, compute, device, "lars_pass2", [&](const void* s2, cudaStream_t stream) {
    return launch_lars_pass2(p.b, h, s, s2, stream);
  });
}

// The CPU and CUDA kernels of an operator must share one C++ signature (the schema's).
static_assert(std::is_same_v<decltype(&sq_norms), decltype(&cpu::sq_norms)>);
static_assert(std::is_same_v<decltype(&lamb_pass1), decltype(&cpu::lamb_pass1)>);
static_assert(std::is_same_v<decltype(&lamb_pass2), decltype(&cpu::lamb_pass2)>);
static_assert(std::is_same_v<decltype(&lars_pass1), decltype(&cpu::lars_pass1)>);
static_assert(std::is_same_v<decltype(&lars_pass2), decltype(&cpu::lars_pass2)>);

}  // namespace cuda
}  // namespace fusedopt

TORCH_LIBRARY_IMPL(fusedopt, CUDA, m) {
  m.impl("sq_norms", &fusedopt::cuda::sq_norms);
  m.impl("lamb_pass1", &fusedopt::cuda::lamb_pass1);
  m.impl("lamb_pass2", &fusedopt::cuda::lamb_pass2);
  m.impl("lars_pass1", &fusedopt::cuda::lars_pass1);
  m.impl("lars_pass2", &fusedopt::cuda::lars_pass2);
}

extern "C" PyObject* PyInit__cuda(void) {
  static PyModuleDef module = {
      PyModuleDef_HEAD_INIT, "_cuda",
      "fusedopt CUDA kernels, registered as the CUDA kernels of torch.ops.fusedopt.* "
      "(import fusedopt._C first: it defines the operators)",
      -1, nullptr, nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&module);
}
