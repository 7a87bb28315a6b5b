// The CUDA execution-space qualifiers and builtin types, for the host compiler. Part of the SIMT
// emulation of the tests (docs/cuda_emulation.md): tests/simt/include stands first on the include
// path, so that <cuda_runtime.h> and the other CUDA headers named by csrc/cuda resolve to these
// files and the toolkit's headers are never read.
#pragma once

#ifdef __CUDACC__
#error "tests/simt/include is the host-compiler emulation of CUDA; nvcc must not see it"
#endif

// Every function is an ordinary host function: a kernel runs once per emulated thread.
#define __host__
#define __device__
#define __global__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)  // register budgets mean nothing on the host
// Tables are passed by value and read by the kernel, never written: the copy each emulated thread
// gets has the values a __grid_constant__ parameter has (its in-place reads are not emulated).
#define __grid_constant__
#define __align__(n) alignas(n)
// __shared__: one object per block. The emulator runs the blocks of a launch one after another,
// never two at a time, so a single static object per variable is exactly one per block. It is not
// cleared between blocks (CUDA leaves shared memory undefined at block start; a kernel that reads
// shared memory before writing it sees the previous block's values here instead of garbage).
#define __shared__ static
// __restrict__ is a keyword of g++ and clang++ as well: nothing to define.

struct uint3 {
  unsigned int x, y, z;
};

struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1)
      : x(vx), y(vy), z(vz) {}
};

constexpr int warpSize = 32;
