// CPU multi-tensor LAMB / LARS passes and sq_norms (docs/math.md, docs/backends.md).
//
// Each op does its per-tensor work (step counts, bias corrections, trust ratios) in a serial setup,
// then runs ONE parallel region over the chunks of all tensors of the bucket (multi_tensor.h).
// The per-element math is fusedopt/math.h; the chunk functors of kernels.h only load, call it and
// store; this file holds the operators, the kept layouts and sq_norms.
// Memory traffic per element and step is docs/math.md's model: LAMB pass 1 reads w, g, m, v and writes
// m, v; pass 2 reads w, m, v and writes w. LARS pass 1 reads w, g; pass 2 reads w, g, v and
// writes w, v. No parameter-sized temporary is allocated: only O(tensors + chunks) tables.
#include "kernels.h"

#include <ATen/ATen.h>
#include <c10/core/impl/COW.h>
#include <fusedopt/checks.h>

#include <atomic>
#include <mutex>

#include "multi_tensor.h"

namespace fusedopt {
namespace cpu {
namespace {

// ------------------------------------------------------------------------------ input checks

// The device policy of the shared checks of fusedopt/checks.h: CPU tensors.
struct OnCpu {
  static constexpr const char* kWho = "fusedopt cpp backend: ";
  static constexpr bool kEmptyListOk = true;
  static bool on_device(const at::Tensor& t, const at::Tensor&) { return t.device().is_cpu(); }
  static const char* elsewhere(const at::Tensor&) { return "; it runs on CPU tensors only"; }
  static const char* step_form(const at::Tensor&) { return "0-dim float32 CPU tensors"; }
};

using checks::same_layout;

at::ScalarType check_list(at::TensorList ts, at::TensorList weights, const char* name) {
  return checks::check_list<OnCpu>(ts, weights, name);
}

void check_steps(at::TensorList steps, at::TensorList weights) {
  checks::check_steps<OnCpu>(steps, weights);
}

using checks::compute_dtype;

bool step_skipped(const std::optional<at::Tensor>& found_inf) {
  return found_inf.has_value() && read_scalar(*found_inf, "found_inf") != 0.0;
}
LambHyper lamb_hyper(const at::Tensor& hyper, const std::optional<at::Tensor>& lr) {
  LambHyper h = lamb_hyper_from(hyper, kWho);
  if (lr.has_value()) h.lr = read_scalar(*lr, "lr");
  return h;
}

LarsHyper lars_hyper(const at::Tensor& hyper, const std::optional<at::Tensor>& lr) {
  LarsHyper h = lars_hyper_from(hyper, kWho);
  if (lr.has_value()) h.lr = read_scalar(*lr, "lr");
  return h;
}

// Note [version counters]: the passes write tensors in place, as torch's in-place ops do, and so
// bump the version counter of every tensor they write (autograd then detects a tensor saved for
// backward that a step modified). Inference tensors have no counter. A skipped step (found_inf)
// writes nothing and bumps nothing. The bumps run in one loop before the pass's parallel region:
// bumped inside the region, in the first chunk of each tensor, each atomic increment had to wait
// for the chunk loop's pending stores (docs/performance.md, "Measurements behind the Notes").
void bump_versions(std::initializer_list<const TensorPtrs*> lists) {
  for (const TensorPtrs* ts : lists) {
    for (const at::Tensor* t : *ts) {
      c10::TensorImpl* impl = t->unsafeGetTensorImpl();
      if (impl->version_counter().enabled()) impl->bump_version();
    }
  }
}
std::vector<int64_t> numels(at::TensorList ts) {
  std::vector<int64_t> n(ts.size());
  for (size_t i = 0; i < ts.size(); ++i) n[i] = ts[i].numel();
  return n;
}
// Sum of squares of the n elements of x, prefetched block by block, on into the next_bytes at
// next (Note [read-only prefetch]).
template <typename S>
FUSEDOPT_INLINE double sq_sum(const S* __restrict__ x, int64_t n, const void* next,
                              int64_t next_bytes) {
  SqSum acc;
  for (int64_t b = 0; b < n; b += kBlock) {
    prefetch_block(x, b, n, next, next_bytes);
    acc.add(x + b, std::min(kBlock, n - b));
  }
  return acc.total();
}

// The same for elements [offset, offset + n) of a tensor of a supported dtype.
FUSEDOPT_INLINE double sq_sum(at::ScalarType dtype, const void* data, int64_t offset, int64_t n,
                              const void* next, int64_t next_bytes) {
  switch (dtype) {
    case at::kFloat:
      return sq_sum(static_cast<const float*>(data) + offset, n, next, next_bytes);
    case at::kDouble:
      return sq_sum(static_cast<const double*>(data) + offset, n, next, next_bytes);
    case at::kBFloat16:
      return sq_sum(static_cast<const c10::BFloat16*>(data) + offset, n, next, next_bytes);
    case at::kHalf:
      return sq_sum(static_cast<const c10::Half*>(data) + offset, n, next, next_bytes);
    default: return 0.0;
  }
}
// ------------------------------------------------------------------------- checked lists

// Checks the lists that a kept layout keeps from step to step (Note [kept layout] in ops.h) and
// returns the weights' dtype. params may be empty (no masters), state_b too (LARS), and both state
// lists for an operator whose pass reads no state.
at::ScalarType check_kept_lists(at::TensorList weights, at::TensorList params,
                                at::TensorList state_a, at::TensorList state_b,
                                at::TensorList steps, std::vector<unsigned char>& formats) {
  const at::ScalarType w_dtype = check_list(weights, weights, "weights");
  if (!params.empty()) check_list(params, weights, "params");
  const at::ScalarType compute = compute_dtype(w_dtype);
  formats.assign(weights.size(), kFullState);
  if (!state_a.empty()) {
    checks::check_state_formats<OnCpu>(state_a, weights, compute, "state", formats);
  }
  if (!state_b.empty()) {
    std::vector<unsigned char> formats_b;
    checks::check_state_formats<OnCpu>(state_b, weights, compute, "state", formats_b);
    for (size_t i = 0; i < formats.size(); ++i) {
      TORCH_CHECK(formats[i] == formats_b[i], kWho, "the two moments of weight ", i,
                  " are stored in different formats (", state_a[i].scalar_type(), " and ",
                  state_b[i].scalar_type(), "); Note [state formats]");
    }
  }
  check_steps(steps, weights);
  return w_dtype;
}

std::vector<void*> data_ptrs(at::TensorList ts) {
  std::vector<void*> p(ts.size());
  // mutable: each static list is written by one pass or the other (a copy-on-write storage is
  // materialized here, before the pointer is kept)
  for (size_t i = 0; i < ts.size(); ++i) p[i] = ts[i].mutable_data_ptr();
  return p;
}

std::vector<const void*> const_data_ptrs(const TensorPtrs& ts) {
  std::vector<const void*> p(ts.size());
  for (size_t i = 0; i < ts.size(); ++i) p[i] = ts[i]->const_data_ptr();
  return p;
}

// The tensors a list points to, as a list of tensors (for the checks, which take TensorLists).
std::vector<at::Tensor> tensors(const TensorPtrs& ts) {
  std::vector<at::Tensor> out;
  out.reserve(ts.size());
  for (const at::Tensor* t : ts) out.push_back(*t);
  return out;
}

TensorPtrs ptrs(at::TensorList ts) {
  TensorPtrs out(ts.size());
  for (size_t i = 0; i < ts.size(); ++i) out[i] = &ts[i];
  return out;
}

}  // namespace

CheckedLists::CheckedLists(at::ScalarType w_dtype, at::TensorList w, at::TensorList p, at::TensorList a,
             at::TensorList b, at::TensorList s, std::vector<unsigned char> f)
    : weight_dtype(w_dtype),
      param_dtype(p.empty() ? w_dtype : p[0].scalar_type()),
      weights(data_ptrs(w)),
      params(data_ptrs(p)),
      state_a(data_ptrs(a)),
      state_b(data_ptrs(b)),
      steps(s.size()),
      formats(std::move(f)),
      codes_offset(w.size(), 0),
      table(numels(w)) {
  for (size_t i = 0; i < s.size(); ++i) steps[i] = s[i].mutable_data_ptr<float>();
  for (size_t i = 0; i < formats.size(); ++i) {
    low_precision |= formats[i] != kFullState;
    if (formats[i] == k8bitState) codes_offset[i] = q8_codes_offset(w[i].numel());
  }
}

// Note [prefetched metadata]: a loop over thousands of tensors' metadata (TensorImpl, ~4 cache
// lines, and its StorageImpl, each a separate heap object) waits on a cache miss per object; the
// loops that run every step prefetch the objects of tensor j + kAheadImpl (and the StorageImpl of
// tensor j + kAheadStorage, whose TensorImpl came in before) while looking at tensor j
// (docs/performance.md, "Measurements behind the Notes").
constexpr size_t kAheadImpl = 16;
constexpr size_t kAheadStorage = 8;

inline void prefetch_metadata(const TensorPtrs& ts, size_t j, size_t end) {
  if (j + kAheadImpl < end) {
    const char* a = reinterpret_cast<const char*>(ts[j + kAheadImpl]->unsafeGetTensorImpl());
    for (size_t b = 0; b < sizeof(c10::TensorImpl); b += 64) __builtin_prefetch(a + b);
  }
  if (j + kAheadStorage < end) {
    const c10::TensorImpl* t = ts[j + kAheadStorage]->unsafeGetTensorImpl();
    __builtin_prefetch(t->unsafe_storage().unsafeGetStorageImpl());  // may be null: harmless
  }
}

// What the checks saw of each tensor of some lists (Note [kept layout]).
class Fingerprints {
 public:
  void add(const TensorPtrs& ts) {
    lists_.push_back({seen_.size(), ts.size()});
    for (const at::Tensor* t : ts) {
      c10::TensorImpl* i = t->unsafeGetTensorImpl();
      seen_.push_back(
          {i->mutable_data(), i->dtype(), i->device_type(), geometry_.size(), i->dim()});
      geometry_.insert(geometry_.end(), i->sizes().begin(), i->sizes().end());
      geometry_.insert(geometry_.end(), i->strides().begin(), i->strides().end());
    }
  }

  // Whether the tensors [begin, end) of each of the lists (given in the order they were added)
  // still look as they did; a range of each list, so that threads can share the looking.
  template <typename Lists>
  bool unchanged(const Lists& lists, size_t begin, size_t end) const {
    if (lists.size() != lists_.size()) return false;
    for (size_t l = 0; l < lists_.size(); ++l) {
      const TensorPtrs& ts = *lists[l];
      if (ts.size() != lists_[l].size) return false;
      const size_t stop = std::min(end, ts.size());
      for (size_t j = begin; j < stop; ++j) {
        prefetch_metadata(ts, j, stop);
        if (!same(ts[j]->unsafeGetTensorImpl(), seen_[lists_[l].first + j])) return false;
      }
    }
    return true;
  }

 private:
  struct List {
    size_t first;  // its first tensor in seen_
    size_t size;
  };
  struct Seen {
    void* data;
    caffe2::TypeMeta dtype;
    c10::DeviceType device;
    size_t geometry_at;  // dim sizes then dim strides in geometry_
    int64_t dim;
  };

  // Read-only, so that threads can look at tensors that share a storage: a copy-on-write storage
  // counts as changed (the recheck, on one thread, materializes it as the operators do).
  bool same(const c10::TensorImpl* i, const Seen& s) const {
    if (i->device_type() != s.device || i->dtype() != s.dtype || i->dim() != s.dim) return false;
    const int64_t* g = geometry_.data() + s.geometry_at;
    const c10::IntArrayRef sizes = i->sizes(), strides = i->strides();
    if (!std::equal(sizes.begin(), sizes.end(), g) ||
        !std::equal(strides.begin(), strides.end(), g + s.dim) || !i->has_storage()) {
      return false;
    }
    const c10::Storage& storage = i->unsafe_storage();
    return !c10::impl::cow::is_cow_data_ptr(storage.data_ptr()) && i->data() == s.data;
  }

  std::vector<List> lists_;
  std::vector<Seen> seen_;
  std::vector<int64_t> geometry_;
};

// ------------------------------------------------------------------------------------- ops

namespace {

// Per-tensor Σx² of the tensors at ptrs (dtypes[i]) over the chunks of table: float64 when
// any_double, else float32.
at::Tensor sq_norms_over(const ChunkTable& table, const std::vector<at::ScalarType>& dtypes,
                         const std::vector<const void*>& ptrs, bool any_double) {
  const int64_t n = static_cast<int64_t>(ptrs.size());
  std::vector<double> partial(table.size());
  table.parallel_for([&](int64_t c, const Chunk& ch) FUSEDOPT_INLINE_LAMBDA {
    const void* next = nullptr;  // Note [read-only prefetch]
    int64_t next_bytes = 0;
    if (const Chunk* nx = table.next(c)) {
      const int64_t size = static_cast<int64_t>(c10::elementSize(dtypes[nx->tensor]));
      next = static_cast<const char*>(ptrs[nx->tensor]) + nx->offset * size;
      next_bytes = nx->len * size;
    }
    partial[c] = sq_sum(dtypes[ch.tensor], ptrs[ch.tensor], ch.offset, ch.len, next, next_bytes);
  });
  at::Tensor out = at::empty({n}, at::dtype(any_double ? at::kDouble : at::kFloat));
  if (any_double) {
    reduce_partials<double, 1>(table, partial, out.data_ptr<double>(), n);
  } else {
    reduce_partials<float, 1>(table, partial, out.data_ptr<float>(), n);
  }
  return out;
}

}  // namespace

at::Tensor sq_norms(at::TensorList tensors) {
  const int64_t n = static_cast<int64_t>(tensors.size());
  bool any_double = false;
  std::vector<at::Tensor> dense(tensors.begin(), tensors.end());
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(dense[i].device().is_cpu(), "fusedopt cpp backend: sq_norms got a tensor on ",
                dense[i].device(), "; it runs on CPU tensors only");
    any_double |= dense[i].scalar_type() == at::kDouble;
    // A dense tensor's elements fill [data_ptr, data_ptr + numel) in some order; others are
    // copied (never the case for the buckets of an optimizer step).
    if (!dense[i].is_non_overlapping_and_dense()) dense[i] = dense[i].contiguous();
  }
  std::vector<at::ScalarType> dtypes(n);
  std::vector<const void*> ptrs(n);
  for (int64_t i = 0; i < n; ++i) {
    dtypes[i] = dense[i].scalar_type();
    ptrs[i] = dense[i].const_data_ptr();
    dispatch_storage(dtypes[i], "sq_norms inputs", [](auto) {});  // rejects other dtypes
  }
  return sq_norms_over(ChunkTable(numels(dense)), dtypes, ptrs, any_double);
}

// The operators: a layout made, checked and bound for one call (Note [kept layout] in ops.h).
namespace {

// Binds the lists to k, checking them all (the lists live as long as the operator's call).
KeptLayout& bound(KeptLayout&& k, at::TensorList weights, at::TensorList params,
                  at::TensorList state_a, at::TensorList state_b, at::TensorList steps,
                  at::TensorList grads) {
  k.bind({ptrs(weights), ptrs(params), ptrs(state_a), ptrs(state_b), ptrs(steps), ptrs(grads)},
         at::kFloat, /*check=*/true);
  return k;
}

}  // namespace

at::Tensor lamb_pass1(at::TensorList weights, at::TensorList grads, at::TensorList exp_avgs,
                      at::TensorList exp_avg_sqs, at::TensorList steps, const at::Tensor& hyper,
                      const std::optional<at::Tensor>& grad_mult,
                      const std::optional<at::Tensor>& found_inf,
                      const std::optional<at::Tensor>& keys) {
  return bound(KeptLayout(), weights, {}, exp_avgs, exp_avg_sqs, steps, grads)
      .lamb_pass1(hyper, grad_mult, found_inf, keys);
}

void lamb_pass2(at::TensorList weights, at::TensorList params, at::TensorList exp_avgs,
                at::TensorList exp_avg_sqs, at::TensorList steps, const at::Tensor& sums,
                const at::Tensor& hyper, const std::optional<at::Tensor>& lr,
                const std::optional<at::Tensor>& found_inf) {
  bound(KeptLayout(), weights, params, exp_avgs, exp_avg_sqs, steps, {}).lamb_pass2(sums, hyper, lr, found_inf);
}

at::Tensor lars_pass1(at::TensorList weights, at::TensorList grads, at::TensorList steps,
                      const at::Tensor& hyper, const std::optional<at::Tensor>& grad_mult,
                      const std::optional<at::Tensor>& found_inf) {
  return bound(KeptLayout(), weights, {}, {}, {}, steps, grads).lars_pass1(hyper, grad_mult, found_inf);
}

void lars_pass2(at::TensorList weights, at::TensorList params, at::TensorList grads,
                at::TensorList momentum_buffers, at::TensorList steps, const at::Tensor& sums,
                const at::Tensor& hyper, const std::optional<at::Tensor>& lr,
                const std::optional<at::Tensor>& grad_mult,
                const std::optional<at::Tensor>& found_inf) {
  bound(KeptLayout(), weights, params, momentum_buffers, {}, steps, grads)
      .lars_pass2(sums, hyper, lr, grad_mult, found_inf);
}

// ------------------------------------------------------------------------------ KeptLayout

KeptLayout::KeptLayout() = default;
KeptLayout::~KeptLayout() = default;

bool KeptLayout::bind(std::array<TensorPtrs, 6> lists, at::ScalarType grad_dtype, bool check) {
  const std::lock_guard<std::mutex> lock(mutex_);  // Note [one call at a time]
  bound_.reset();
  Bound b{std::move(lists[0]), std::move(lists[1]), std::move(lists[2]), std::move(lists[3]),
          std::move(lists[4]), std::move(lists[5]), grad_dtype};
  if (!check) {
    // the grads must have the dtype they had when checked: the kernels were chosen for it
    if (checked_ == nullptr || grad_dtype != checked_grad_dtype_ || !unchanged(b) ||
        !grads_fit(b)) {
      return false;
    }
    bound_ = std::move(b);
    return true;
  }
  checked_.reset();
  fingerprints_.reset();
  const std::vector<at::Tensor> w = tensors(b.weights), p = tensors(b.params),
                                sa = tensors(b.state_a), sb = tensors(b.state_b),
                                st = tensors(b.steps);
  std::vector<unsigned char> formats;
  const at::ScalarType w_dtype = check_kept_lists(w, p, sa, sb, st, formats);
  if (!b.grads.empty()) b.grad_dtype = check_list(tensors(b.grads), w, "grads");
  auto fp = std::make_unique<Fingerprints>();
  for (const TensorPtrs* ts : kept_lists(b)) fp->add(*ts);
  checked_ = std::make_unique<CheckedLists>(w_dtype, w, p, sa, sb, st, std::move(formats));
  checked_grad_dtype_ = b.grad_dtype;
  fingerprints_ = std::move(fp);
  bound_ = std::move(b);
  return true;
}

void KeptLayout::end() {
  const std::lock_guard<std::mutex> lock(mutex_);  // Note [one call at a time]
  bound_.reset();
}

std::array<const TensorPtrs*, 5> KeptLayout::kept_lists(const Bound& b) {
  return {&b.weights, &b.params, &b.state_a, &b.state_b, &b.steps};
}

bool KeptLayout::unchanged(const Bound& b) const {
  const std::array<const TensorPtrs*, 5> lists = kept_lists(b);
  std::atomic<bool> same{true};
  at::parallel_for(0, static_cast<int64_t>(b.weights.size()), kTensorGrain,
                   [&](int64_t begin, int64_t end) {
                     if (!fingerprints_->unchanged(lists, begin, end)) same = false;
                   });
  return same && b.weights.size() == static_cast<size_t>(checked_->size());
}

bool KeptLayout::grads_fit(const Bound& b) const {
  if (b.grads.size() != b.weights.size()) return false;
  for (size_t i = 0; i < b.grads.size(); ++i) {
    const at::Tensor& g = *b.grads[i];
    if (!g.defined() || g.layout() != at::kStrided || g.scalar_type() != b.grad_dtype ||
        !g.device().is_cpu() || !g.is_non_overlapping_and_dense() ||
        !same_layout(g, *b.weights[i])) {
      return false;
    }
  }
  return true;
}

const KeptLayout::Bound& KeptLayout::bound() const {
  TORCH_CHECK(bound_.has_value() && checked_ != nullptr, kWho, "no lists bound (bind() first)");
  return *bound_;
}

// The bound state lists hold `lists` of the weights' length each, and the grads too if `grads`.
void require(const TensorPtrs& weights, std::initializer_list<const char*> names,
             std::initializer_list<const TensorPtrs*> lists) {
  auto name = names.begin();
  for (const TensorPtrs* l : lists) {
    TORCH_CHECK(l->size() == weights.size(), kWho, "this pass needs ", *name, " for each of the ",
                weights.size(), " weights, got ", l->size());
    ++name;
  }
}

at::Tensor KeptLayout::grad_sq_norms() {
  const std::lock_guard<std::mutex> lock(mutex_);  // Note [one call at a time]
  const Bound& b = bound();
  require(b.weights, {"grads"}, {&b.grads});
  if (b.grads.empty()) return at::zeros({0}, at::dtype(at::kFloat));
  const std::vector<at::ScalarType> dtypes(b.grads.size(), b.grad_dtype);
  // the bound grads have the weights' numels (grads_fit, check_list): the checked table serves
  return sq_norms_over(checked_->table, dtypes, const_data_ptrs(b.grads),
                       b.grad_dtype == at::kDouble);
}

at::Tensor KeptLayout::lamb_pass1(const at::Tensor& hyper,
                                  const std::optional<at::Tensor>& grad_mult,
                                  const std::optional<at::Tensor>& found_inf,
                                  const std::optional<at::Tensor>& keys) {
  const std::lock_guard<std::mutex> lock(mutex_);  // Note [one call at a time]
  const Bound& b = bound();
  require(b.weights, {"grads", "exp_avgs", "exp_avg_sqs"}, {&b.grads, &b.state_a, &b.state_b});
  const LambHyper h = lamb_hyper(hyper, std::nullopt);
  const int64_t n = checked_->size();
  if (n == 0 || step_skipped(found_inf)) {
    return at::zeros({n, 2}, at::dtype(compute_dtype(checked_->weight_dtype)));
  }
  bump_versions({&b.state_a, &b.state_b, &b.steps});
  return run_lamb_pass1(*checked_, const_data_ptrs(b.grads), b.grad_dtype, h, grad_mult, keys);
}

void KeptLayout::lamb_pass2(const at::Tensor& sums, const at::Tensor& hyper,
                            const std::optional<at::Tensor>& lr,
                            const std::optional<at::Tensor>& found_inf) {
  const std::lock_guard<std::mutex> lock(mutex_);  // Note [one call at a time]
  const Bound& b = bound();
  require(b.weights, {"exp_avgs", "exp_avg_sqs"}, {&b.state_a, &b.state_b});
  const LambHyper h = lamb_hyper(hyper, lr);
  if (checked_->size() == 0 || step_skipped(found_inf)) return;
  bump_versions({&b.weights, &b.params});
  run_lamb_pass2(*checked_, sums, h);
}

at::Tensor KeptLayout::lars_pass1(const at::Tensor& hyper,
                                  const std::optional<at::Tensor>& grad_mult,
                                  const std::optional<at::Tensor>& found_inf) {
  const std::lock_guard<std::mutex> lock(mutex_);  // Note [one call at a time]
  const Bound& b = bound();
  require(b.weights, {"grads"}, {&b.grads});
  const LarsHyper h = lars_hyper(hyper, std::nullopt);
  const int64_t n = checked_->size();
  if (n == 0 || step_skipped(found_inf)) {
    return at::zeros({n, 2}, at::dtype(compute_dtype(checked_->weight_dtype)));
  }
  bump_versions({&b.steps});
  return run_lars_pass1(*checked_, const_data_ptrs(b.grads), b.grad_dtype, h, grad_mult);
}

void KeptLayout::lars_pass2(const at::Tensor& sums, const at::Tensor& hyper,
                            const std::optional<at::Tensor>& lr,
                            const std::optional<at::Tensor>& grad_mult,
                            const std::optional<at::Tensor>& found_inf) {
  const std::lock_guard<std::mutex> lock(mutex_);  // Note [one call at a time]
  const Bound& b = bound();
  require(b.weights, {"grads", "momentum_buffers"}, {&b.grads, &b.state_a});
  const LarsHyper h = lars_hyper(hyper, lr);
  if (checked_->size() == 0 || step_skipped(found_inf)) return;
  bump_versions({&b.weights, &b.params, &b.state_a});
  run_lars_pass2(*checked_, const_data_ptrs(b.grads), b.grad_dtype, sums, h, grad_mult);
}

}  // namespace cpu
}  // namespace fusedopt

