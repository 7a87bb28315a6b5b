// The SIMT scheduler's interface: device builtins and the launcher (implemented in
// tests/simt/runtime.cpp). See docs/cuda_emulation.md.
//
// A launch runs its blocks one after another. Each thread of a block is a fiber with a stack of
// its own; the scheduler resumes the runnable fibers of the block in a configurable order, and a
// fiber runs until it finishes or waits at a barrier:
//   __syncthreads()          every thread of the block, at the same __syncthreads call;
//   __shfl_down_sync(mask)   every lane of `mask` in the caller's warp, at the same call.
// When all the threads a barrier waits for have arrived, it releases them (a shuffle hands each
// lane its source lane's value first). A barrier that can never complete (threads exited, or
// waiting at another barrier) is a fault: the launch stops and reports cudaErrorLaunchFailure,
// and simt::fault_message() says what happened. So is a load or store through a pointer that is
// not aligned to its type (a 16-byte vector through a pointer 4 bytes past a 16-byte boundary),
// which faults on the device: the launch stops at once and reports cudaErrorMisalignedAddress.
// The library is built with -fsanitize=alignment, which checks every access; runtime.cpp defines
// the functions the failed checks call, without the sanitizer's runtime.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <source_location>
#include <tuple>
#include <type_traits>
#include <utility>

#include "../cuda_runtime_api.h"
#include "defines.h"

namespace simt {
namespace detail {
// The running thread's coordinates, set by the scheduler before it resumes a fiber.
inline uint3 thread_idx{0, 0, 0};
inline uint3 block_idx{0, 0, 0};
inline dim3 block_dim{1, 1, 1};
inline dim3 grid_dim{1, 1, 1};
}  // namespace detail

// Orders in which the scheduler resumes runnable fibers and runs blocks. kForward, kReverse and
// kRandom work in rounds: every runnable fiber of the block is resumed once per round, in that
// order (kRandom: reshuffled every round). The warp-skewed orders (threads only) run one warp at a
// time, as far as it can go without the others: its fibers are resumed and its shuffles released
// until each of them has exited or waits at a __syncthreads; then the next warp runs, and the
// __syncthreads is released once every warp has reached it. kWarpSkew takes warp 0 first and the
// lanes of a warp from the last one down; kWarpSkewRandom takes the warps and the lanes in a
// seeded random order, reshuffled every time.
enum class Order : int {
  kForward = 0,
  kReverse = 1,
  kRandom = 2,
  kWarpSkew = 3,
  kWarpSkewRandom = 4,
};

void set_schedule(Order threads, Order blocks, uint64_t seed);

struct Stats {
  int64_t launches;        // successful or not
  int64_t blocks;          // blocks run
  int64_t threads;         // fibers started
  int64_t resumes;         // fiber switches
  int64_t block_barriers;  // __syncthreads releases
  int64_t warp_shuffles;   // __shfl_down_sync releases (one per warp)
};
Stats stats();
void reset_stats();
// One line per launch since reset_stats(): "<kernel> grid=<x> block=<x>".
const char* launch_log();
// What the last fault was (empty when none since reset_stats()).
const char* fault_message();

// Runs body(ctx) once per thread of a grid x block launch and records the launch's error.
void run_grid(const char* kernel, dim3 grid, dim3 block, void (*body)(void*), void* ctx);

// Device builtins, called by the running fiber.
void block_barrier(const char* file, unsigned line);
uint64_t shuffle_down(unsigned mask, uint64_t bits, unsigned delta, int width, const char* file,
                      unsigned line);

// The launch: the arguments are converted to the kernel's parameter types once (CUDA copies them
// once into the launch's parameter space) and every thread calls the kernel with that copy.
template <typename... P, typename... A>
void launch(const char* name, void (*kernel)(P...), dim3 grid, dim3 block, cudaStream_t,
            A&&... args) {
  static_assert(sizeof...(P) == sizeof...(A), "kernel launched with a wrong argument count");
  static_assert((0 + ... + sizeof(P)) <= 4096, "kernel arguments over 4 KiB");
  struct Frame {
    void (*kernel)(P...);
    std::tuple<std::remove_cv_t<P>...> params;
  };
  Frame frame{kernel, std::tuple<std::remove_cv_t<P>...>(std::forward<A>(args)...)};
  run_grid(
      name, grid, block,
      [](void* p) {
        Frame* f = static_cast<Frame*>(p);
        std::apply(f->kernel, f->params);
      },
      &frame);
}

}  // namespace simt

// threadIdx and friends read the scheduler's values; like the CUDA builtins they cannot be
// assigned.
inline const uint3& threadIdx = simt::detail::thread_idx;
inline const uint3& blockIdx = simt::detail::block_idx;
inline const dim3& blockDim = simt::detail::block_dim;
inline const dim3& gridDim = simt::detail::grid_dim;

// The call site (a defaulted argument) identifies the barrier: threads of one block must meet at
// the same __syncthreads, as CUDA requires.
inline void __syncthreads(std::source_location at = std::source_location::current()) {
  simt::block_barrier(at.file_name(), at.line());
}

// __shfl_down_sync(mask, var, delta, width): lane l receives var of lane l + delta of its
// width-wide segment, or its own var when that lane is past the segment's end.
template <typename T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize,
                          std::source_location at = std::source_location::current()) {
  static_assert(std::is_trivially_copyable<T>::value && sizeof(T) <= 8,
                "__shfl_down_sync moves values of at most 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &var, sizeof(T));
  bits = simt::shuffle_down(mask, bits, delta, width, at.file_name(), at.line());
  T out;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}
