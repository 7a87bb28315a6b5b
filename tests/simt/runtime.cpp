// The SIMT scheduler of the test-only CUDA emulation (interface and semantics:
// include/simt/runtime.h; what it does and does not emulate: docs/cuda_emulation.md).
//
// Each thread of a block is a fiber with a stack of its own. Everything runs on the calling OS
// thread, one fiber at a time; launches are serialized by a mutex. Fibers switch with a few
// instructions on x86-64 (simt_switch below: the callee-saved registers, the stack pointer and the
// floating-point control words, as a function call would preserve them); elsewhere, or with
// -DSIMT_UCONTEXT, with makecontext/swapcontext, which also save the signal mask at the cost of
// a system call per switch.
//
// The orders (Order in include/simt/runtime.h): round-robin, every runnable fiber of the block
// once per round, or warp-skewed, one warp at a time as far as it can go alone. A fiber also stops
// on a misaligned access (the handlers of -fsanitize=alignment's checks, at the end of this file).
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "simt/runtime.h"

namespace simt {
namespace {

constexpr size_t kStackBytes = 128 * 1024;  // per fiber; a guard page below each stack
constexpr unsigned kMaxThreadsPerBlock = 1024;
constexpr unsigned kMaxGridX = 0x7fffffffu;

#if defined(__x86_64__) && !defined(SIMT_UCONTEXT)
#define SIMT_FAST_SWITCH 1
#else
#define SIMT_FAST_SWITCH 0
#endif

#if SIMT_FAST_SWITCH
// simt_switch(save, load): saves the caller's callee-saved registers and control words on its
// stack and the stack pointer in *save, then continues the context whose stack pointer is load.
extern "C" void simt_switch(void** save, void* load);
asm(R"(
  .text
  .p2align 4
  .type simt_switch, @function
simt_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size simt_switch, .-simt_switch
)");

struct Context {
  void* sp = nullptr;
};
#else
struct Context {
  ucontext_t uc;
};
#endif

// kFaulted: stopped by a fault of its own (a misaligned access); it never runs again.
enum class State : uint8_t { kReady, kAtSyncthreads, kAtShuffle, kDone, kFaulted };

struct Fiber {
  Context context;
  State state;
  // where the fiber waits (kAtSyncthreads, kAtShuffle)
  const char* file;
  unsigned line;
  // a shuffle's operands and result
  unsigned mask;
  unsigned delta;
  int width;
  uint64_t value;
  uint64_t result;
};

struct Stack {
  char* base = nullptr;  // lowest address of the mapping
  size_t bytes = 0;      // of the mapping
  size_t guard = 0;      // bytes of the inaccessible guard page at base
};

struct Scheduler {
  std::mutex mutex;
  Order thread_order = Order::kForward;
  Order block_order = Order::kForward;
  std::mt19937_64 rng{0};
  Stats stats{};
  std::string log;
  std::string fault;
  cudaError_t last_error = cudaSuccess;
  // set by a fiber that stopped on a fault of its own (State::kFaulted)
  std::string fiber_fault;
  cudaError_t fiber_error = cudaSuccess;

  std::vector<Stack> stacks;
  std::vector<Fiber> fibers;
  Context home;  // the scheduler's own context
  int current = -1;  // running fiber, -1: the scheduler
  void (*body)(void*) = nullptr;
  void* ctx = nullptr;
};

Scheduler& sched() {
  static Scheduler s;
  return s;
}

[[noreturn]] void misuse(const char* what) {
  std::fprintf(stderr, "simt: %s\n", what);
  std::abort();
}

void ensure_stacks(Scheduler& s, unsigned n) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  while (s.stacks.size() < n) {
    Stack st;
    st.bytes = kStackBytes + page;
    st.guard = page;
    void* p = mmap(nullptr, st.bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) misuse("cannot map a fiber stack");
    st.base = static_cast<char*>(p);
    if (mprotect(st.base, page, PROT_NONE) != 0) misuse("cannot protect a fiber's guard page");
    s.stacks.push_back(st);
  }
}

void switch_context(Context& save, Context& load) {
#if SIMT_FAST_SWITCH
  simt_switch(&save.sp, load.sp);
#else
  if (swapcontext(&save.uc, &load.uc) != 0) misuse("swapcontext failed");
#endif
}

// Runs the body in the current fiber, then returns to the scheduler for good.
void fiber_entry() {
  Scheduler& s = sched();
  s.body(s.ctx);
  Fiber& f = s.fibers[static_cast<size_t>(s.current)];
  f.state = State::kDone;
  switch_context(f.context, s.home);
  misuse("a finished fiber was resumed");
}

// Prepares `c` to run fiber_entry from the top of the stack [base, base + bytes).
void start_context(Context& c, char* base, size_t bytes) {
#if SIMT_FAST_SWITCH
  // What simt_switch pops, from the initial stack pointer up: the control words (MXCSR and the
  // x87 control word at their defaults), r15, r14, r13, r12, rbx, rbp, then the return address
  // fiber_entry above a null one, so that fiber_entry starts as if called (rsp + 8 16-aligned).
  uintptr_t top = reinterpret_cast<uintptr_t>(base + bytes) & ~uintptr_t{15};
  uint64_t* sp = reinterpret_cast<uint64_t*>(top);
  *--sp = 0;
  *--sp = reinterpret_cast<uint64_t>(&fiber_entry);
  for (int r = 0; r < 6; ++r) *--sp = 0;
  *--sp = uint64_t{0x1f80} | (uint64_t{0x037f} << 32);
  c.sp = sp;
#else
  if (getcontext(&c.uc) != 0) misuse("getcontext failed");
  c.uc.uc_stack.ss_sp = base;
  c.uc.uc_stack.ss_size = bytes;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, fiber_entry, 0);
#endif
}

// Suspends the running fiber (which has recorded why) until the scheduler resumes it.
void yield_to_scheduler() {
  Scheduler& s = sched();
  switch_context(s.fibers[static_cast<size_t>(s.current)].context, s.home);
}

Fiber& running_fiber(const char* builtin) {
  Scheduler& s = sched();
  if (s.current < 0) {
    std::fprintf(stderr, "simt: %s called outside a kernel\n", builtin);
    std::abort();
  }
  return s.fibers[static_cast<size_t>(s.current)];
}

void make_order(Scheduler& s, Order order, std::vector<int>& v) {
  if (order == Order::kReverse) {
    std::reverse(v.begin(), v.end());
  } else if (order == Order::kRandom) {
    std::shuffle(v.begin(), v.end(), s.rng);
  }
}

std::string site(const char* file, unsigned line) {
  const char* slash = std::strrchr(file, '/');
  return std::string(slash != nullptr ? slash + 1 : file) + ":" + std::to_string(line);
}

const char* state_name(State st) {
  switch (st) {
    case State::kReady: return "running";
    case State::kAtSyncthreads: return "at __syncthreads";
    case State::kAtShuffle: return "at __shfl_down_sync";
    case State::kDone: return "exited";
    case State::kFaulted: return "faulted";
  }
  return "?";
}

bool same_site(const Fiber& a, const Fiber& b) {
  return a.line == b.line && std::strcmp(a.file, b.file) == 0;
}

std::string describe(const Fiber& f, int t) {
  std::string out = "thread " + std::to_string(t) + " " + state_name(f.state);
  if (f.state == State::kAtSyncthreads || f.state == State::kAtShuffle) {
    out += " (" + site(f.file, f.line) + ")";
  }
  return out;
}

// Releases the shuffle of warp w if every lane of its mask waits at it; returns whether it did,
// or sets `fault` when the shuffle can never complete.
bool resolve_shuffle(Scheduler& s, int w, int nthreads, std::string& fault) {
  const int first = w * warpSize;
  const int last = std::min(first + warpSize, nthreads);
  int leader = -1;
  for (int t = first; t < last; ++t) {
    if (s.fibers[static_cast<size_t>(t)].state == State::kAtShuffle) {
      leader = t;
      break;
    }
  }
  if (leader < 0) return false;
  const Fiber& lf = s.fibers[static_cast<size_t>(leader)];
  const unsigned mask = lf.mask;
  const int width = lf.width;
  const std::string where = site(lf.file, lf.line);
  // every lane named in the mask must exist and wait at this very shuffle with the same mask
  for (int lane = 0; lane < warpSize; ++lane) {
    const int t = first + lane;
    const bool named = (mask >> lane) & 1u;
    if (!named) {
      if (t < last && s.fibers[static_cast<size_t>(t)].state == State::kAtShuffle) {
        fault = "__shfl_down_sync at " + where + " in warp " + std::to_string(w) + ": " +
                describe(s.fibers[static_cast<size_t>(t)], t) + " is not in the mask";
      }
      continue;
    }
    if (t >= last) {
      fault = "__shfl_down_sync at " + where + ": the mask names lane " + std::to_string(lane) +
              ", which the block does not have";
      return false;
    }
    const Fiber& f = s.fibers[static_cast<size_t>(t)];
    if (f.state != State::kAtShuffle || !same_site(f, lf) || f.mask != mask || f.width != width) {
      fault = "__shfl_down_sync at " + where + " in warp " + std::to_string(w) +
              " can never complete: " + describe(f, t);
      if (f.state == State::kAtShuffle && same_site(f, lf)) {
        fault += " with another mask or width";
      }
      return false;
    }
  }
  if (!fault.empty()) return false;
  for (int lane = 0; lane < warpSize; ++lane) {
    if (!((mask >> lane) & 1u)) continue;
    Fiber& f = s.fibers[static_cast<size_t>(first + lane)];
    const int segment = lane & ~(width - 1);
    const int src = lane + static_cast<int>(f.delta);
    if (src >= segment + width) {
      f.result = f.value;
    } else if (!((mask >> src) & 1u)) {
      fault = "__shfl_down_sync at " + where + ": lane " + std::to_string(lane) +
              " reads lane " + std::to_string(src) + ", which is not in the mask";
      return false;
    } else {
      f.result = s.fibers[static_cast<size_t>(first + src)].value;
    }
  }
  for (int lane = 0; lane < warpSize; ++lane) {
    if ((mask >> lane) & 1u) s.fibers[static_cast<size_t>(first + lane)].state = State::kReady;
  }
  ++s.stats.warp_shuffles;
  return true;
}

// Resumes fiber t until it exits, waits at a barrier or faults.
void resume(Scheduler& s, int t, dim3 block) {
  s.current = t;
  detail::thread_idx = uint3{static_cast<unsigned>(t) % block.x,
                             (static_cast<unsigned>(t) / block.x) % block.y,
                             static_cast<unsigned>(t) / (block.x * block.y)};
  ++s.stats.resumes;
  switch_context(s.home, s.fibers[static_cast<size_t>(t)].context);
  s.current = -1;
}

bool warp_skewed(Order order) {
  return order == Order::kWarpSkew || order == Order::kWarpSkewRandom;
}

// The warp-skewed step of run_block: every warp, one after another, runs alone until none of its
// fibers can move (each has exited or waits at a __syncthreads, or its lanes wait at a shuffle
// that can never complete, which is a fault). Returns false on a fault (`fault` set, or
// s.fiber_error for a fiber's own).
bool run_warps_alone(Scheduler& s, int nthreads, dim3 block, std::string& fault) {
  const int warps = (nthreads + warpSize - 1) / warpSize;
  std::vector<int> warp_order(static_cast<size_t>(warps));
  std::iota(warp_order.begin(), warp_order.end(), 0);
  if (s.thread_order == Order::kWarpSkewRandom) {
    std::shuffle(warp_order.begin(), warp_order.end(), s.rng);
  }
  std::vector<int> lanes;
  for (int w : warp_order) {
    const int first = w * warpSize;
    const int last = std::min(first + warpSize, nthreads);
    for (;;) {
      lanes.clear();
      for (int t = first; t < last; ++t) {
        if (s.fibers[static_cast<size_t>(t)].state == State::kReady) lanes.push_back(t);
      }
      if (s.thread_order == Order::kWarpSkew) {
        std::reverse(lanes.begin(), lanes.end());
      } else {
        std::shuffle(lanes.begin(), lanes.end(), s.rng);
      }
      for (int t : lanes) {
        resume(s, t, block);
        if (s.fiber_error != cudaSuccess) return false;
      }
      if (!resolve_shuffle(s, w, nthreads, fault)) break;
    }
    if (!fault.empty()) return false;
  }
  return true;
}

// Runs one block to completion; returns an empty string or the description of a fault (a fiber's
// own fault also sets s.fiber_error).
std::string run_block(Scheduler& s, int nthreads, dim3 block) {
  std::vector<int> order;
  order.reserve(static_cast<size_t>(nthreads));
  for (int t = 0; t < nthreads; ++t) {
    Fiber& f = s.fibers[static_cast<size_t>(t)];
    f.state = State::kReady;
    const Stack& st = s.stacks[static_cast<size_t>(t)];
    start_context(f.context, st.base + st.guard, st.bytes - st.guard);
  }
  s.stats.threads += nthreads;
  const int warps = (nthreads + warpSize - 1) / warpSize;
  const bool skewed = warp_skewed(s.thread_order);
  for (;;) {
    std::string fault;
    if (skewed) {
      if (!run_warps_alone(s, nthreads, block, fault)) {
        return s.fiber_error != cudaSuccess ? s.fiber_fault : fault;
      }
    } else {
      // one round: every runnable fiber runs until it exits or waits at a barrier
      order.clear();
      for (int t = 0; t < nthreads; ++t) {
        if (s.fibers[static_cast<size_t>(t)].state == State::kReady) order.push_back(t);
      }
      make_order(s, s.thread_order, order);
      for (int t : order) {
        resume(s, t, block);
        if (s.fiber_error != cudaSuccess) return s.fiber_fault;
      }
    }
    // then release the barriers that every awaited thread has reached
    int done = 0, at_sync = 0;
    for (int t = 0; t < nthreads; ++t) {
      const State st = s.fibers[static_cast<size_t>(t)].state;
      done += st == State::kDone;
      at_sync += st == State::kAtSyncthreads;
    }
    if (done == nthreads) return {};
    if (!skewed) {  // (a skewed step leaves no shuffle that could be released)
      bool released = false;
      for (int w = 0; w < warps; ++w) {
        released |= resolve_shuffle(s, w, nthreads, fault);
        if (!fault.empty()) return fault;
      }
      if (released) continue;
    }
    if (at_sync == nthreads) {
      const Fiber& f0 = s.fibers[0];
      for (int t = 1; t < nthreads; ++t) {
        const Fiber& f = s.fibers[static_cast<size_t>(t)];
        if (!same_site(f, f0)) {
          return "threads of one block wait at different __syncthreads: " + describe(f0, 0) +
                 ", " + describe(f, t);
        }
      }
      for (int t = 0; t < nthreads; ++t) s.fibers[static_cast<size_t>(t)].state = State::kReady;
      ++s.stats.block_barriers;
      continue;
    }
    // nothing can move: describe the first thread of every state
    std::string what = "deadlock (a barrier not reached by every thread it waits for):";
    bool seen[5] = {false, false, false, false, false};
    for (int t = 0; t < nthreads; ++t) {
      const Fiber& f = s.fibers[static_cast<size_t>(t)];
      const int k = static_cast<int>(f.state);
      if (!seen[k]) {
        seen[k] = true;
        what += " " + describe(f, t) + ";";
      }
    }
    return what;
  }
}

}  // namespace

void set_schedule(Order threads, Order blocks, uint64_t seed) {
  const int th = static_cast<int>(threads), bl = static_cast<int>(blocks);
  if (th < 0 || th > static_cast<int>(Order::kWarpSkewRandom)) misuse("no such thread order");
  if (bl < 0 || bl > static_cast<int>(Order::kRandom)) misuse("no such block order (warp-skewed?)");
  Scheduler& s = sched();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.thread_order = threads;
  s.block_order = blocks;
  s.rng.seed(seed);
}

Stats stats() {
  Scheduler& s = sched();
  std::lock_guard<std::mutex> lock(s.mutex);
  return s.stats;
}

void reset_stats() {
  Scheduler& s = sched();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.stats = Stats{};
  s.log.clear();
  s.fault.clear();
}

const char* launch_log() { return sched().log.c_str(); }

const char* fault_message() { return sched().fault.c_str(); }

void run_grid(const char* kernel, dim3 grid, dim3 block, void (*body)(void*), void* ctx) {
  Scheduler& s = sched();
  if (s.current >= 0) misuse("a kernel launched from a kernel");
  std::lock_guard<std::mutex> lock(s.mutex);
  ++s.stats.launches;
  s.fault.clear();
  s.fiber_fault.clear();
  s.fiber_error = cudaSuccess;
  s.log += std::string(kernel) + " grid=" + std::to_string(grid.x) + "x" +
           std::to_string(grid.y) + "x" + std::to_string(grid.z) + " block=" +
           std::to_string(block.x) + "x" + std::to_string(block.y) + "x" +
           std::to_string(block.z) + "\n";
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  const uint64_t blocks = uint64_t{grid.x} * grid.y * grid.z;
  if (threads == 0 || threads > kMaxThreadsPerBlock || blocks == 0 || grid.x > kMaxGridX ||
      grid.y > 65535 || grid.z > 65535 || block.z > 64) {
    s.last_error = cudaErrorInvalidConfiguration;
    return;
  }
  const int nthreads = static_cast<int>(threads);
  ensure_stacks(s, static_cast<unsigned>(nthreads));
  s.fibers.resize(std::max(s.fibers.size(), static_cast<size_t>(nthreads)));
  s.body = body;
  s.ctx = ctx;
  detail::block_dim = block;
  detail::grid_dim = grid;
  std::vector<int64_t> order(blocks);
  std::iota(order.begin(), order.end(), 0);
  if (s.block_order == Order::kReverse) {
    std::reverse(order.begin(), order.end());
  } else if (s.block_order == Order::kRandom) {
    std::shuffle(order.begin(), order.end(), s.rng);
  }
  for (int64_t b : order) {
    const uint64_t ub = static_cast<uint64_t>(b);
    detail::block_idx = uint3{static_cast<unsigned>(ub % grid.x),
                              static_cast<unsigned>((ub / grid.x) % grid.y),
                              static_cast<unsigned>(ub / (uint64_t{grid.x} * grid.y))};
    ++s.stats.blocks;
    std::string fault = run_block(s, nthreads, block);
    if (!fault.empty()) {
      s.fault = std::string(kernel) + ", block " + std::to_string(b) + ": " + fault;
      s.last_error = s.fiber_error != cudaSuccess ? s.fiber_error : cudaErrorLaunchFailure;
      return;
    }
  }
}

void block_barrier(const char* file, unsigned line) {
  Fiber& f = running_fiber("__syncthreads");
  f.state = State::kAtSyncthreads;
  f.file = file;
  f.line = line;
  yield_to_scheduler();
}

uint64_t shuffle_down(unsigned mask, uint64_t bits, unsigned delta, int width, const char* file,
                      unsigned line) {
  Fiber& f = running_fiber("__shfl_down_sync");
  if (width <= 0 || width > warpSize || (width & (width - 1)) != 0) {
    misuse("__shfl_down_sync: width must be a power of two <= 32");
  }
  f.state = State::kAtShuffle;
  f.file = file;
  f.line = line;
  f.mask = mask;
  f.delta = delta;
  f.width = width;
  f.value = bits;
  yield_to_scheduler();
  return f.result;
}

// ------------------------------------------------------------------------ faulting accesses
// The library is compiled with -fsanitize=alignment (tests/test_cuda_emulated.py): before every
// load and store through a pointer, the compiler checks that the address is a multiple of the
// alignment of the pointed-to type, and calls __ubsan_handle_type_mismatch_v1 (or its _abort
// variant, with -fno-sanitize-recover) when it is not. The handlers below take the place of the
// sanitizer's runtime, which is not linked: a misaligned access in a kernel stops its thread at
// once, as the device does (on x86 the access itself would go through, or crash the process when
// the compiler chose an aligned vector instruction), and the launch reports
// cudaErrorMisalignedAddress with the address, the type and the source line. The same handler
// receives the null and object-size checks of -fsanitize=undefined (FUSEDOPT_SIMT_CXXFLAGS).

namespace {

// The arguments of the check's handler (the sanitizer's ABI, "type mismatch" version 1, shared by
// gcc and clang).
struct SourceLocation {
  const char* file;
  uint32_t line;
  uint32_t column;
};
struct TypeDescriptor {
  uint16_t kind;
  uint16_t info;
  char name[1];  // NUL-terminated, e.g. 'const struct Pack16<float, 4>'
};
struct TypeMismatchData {
  SourceLocation location;
  const TypeDescriptor* type;
  unsigned char log_alignment;
  unsigned char check_kind;
};

[[noreturn]] void bad_access(const TypeMismatchData* d, uintptr_t address) {
  static const char* const kKinds[] = {
      "load of", "store to", "reference binding to", "member access within", "member call on",
      "constructor call on", "downcast of", "downcast of", "upcast of",
      "cast to virtual base of", "_Nonnull binding to", "dynamic operation on"};
  const uintptr_t alignment = uintptr_t{1} << d->log_alignment;
  const bool misaligned = address != 0 && (address & (alignment - 1)) != 0;
  char where[64];
  std::snprintf(where, sizeof where, "address 0x%llx", static_cast<unsigned long long>(address));
  std::string what = d->check_kind < sizeof(kKinds) / sizeof(kKinds[0])
                         ? kKinds[d->check_kind]
                         : "access to";
  what += std::string(" ") + d->type->name + " at ";
  if (address == 0) {
    what = "null pointer: " + what + "address 0";
  } else if (misaligned) {
    what = "misaligned address: " + what + where + ", " +
           std::to_string(address & (alignment - 1)) + " bytes past a " +
           std::to_string(alignment) + "-byte boundary";
  } else {
    what = "object too small: " + what + where;
  }
  what += " (" + site(d->location.file, d->location.line) + ")";
  Scheduler& s = sched();
  if (s.current < 0) {
    std::fprintf(stderr, "simt: outside a kernel: %s\n", what.c_str());
    std::abort();
  }
  Fiber& f = s.fibers[static_cast<size_t>(s.current)];
  f.state = State::kFaulted;
  s.fiber_fault = "thread " + std::to_string(s.current) + ": " + what;
  s.fiber_error = misaligned ? cudaErrorMisalignedAddress : cudaErrorLaunchFailure;
  yield_to_scheduler();
  misuse("a faulted fiber was resumed");
}

}  // namespace
}  // namespace simt

// Hidden: the calls of this library bind to these even where the sanitizer's runtime is linked
// too (FUSEDOPT_SIMT_CXXFLAGS="-fsanitize=undefined").
#define SIMT_HIDDEN __attribute__((visibility("hidden")))
extern "C" {
[[noreturn]] SIMT_HIDDEN void __ubsan_handle_type_mismatch_v1(void* data, uintptr_t address) {
  simt::bad_access(static_cast<const simt::TypeMismatchData*>(data), address);
}
[[noreturn]] SIMT_HIDDEN void __ubsan_handle_type_mismatch_v1_abort(void* data,
                                                                   uintptr_t address) {
  simt::bad_access(static_cast<const simt::TypeMismatchData*>(data), address);
}
}

cudaError_t cudaGetLastError() {
  simt::Scheduler& s = simt::sched();
  const cudaError_t e = s.last_error;
  s.last_error = cudaSuccess;
  return e;
}

cudaError_t cudaPeekAtLastError() { return simt::sched().last_error; }

const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorMisalignedAddress: return "misaligned address";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    case cudaErrorNotSupported: return "operation not supported";
  }
  return "unrecognized error code";
}
