// Kernels that test the SIMT emulator itself (not the optimizer): shuffles, the block reduction
// and broadcast of csrc/cuda/multi_tensor_apply.cuh, the scheduling orders, and kernels with bugs
// the emulator must report (a shared-memory race that the resume order exposes, barriers that can
// never complete). Launched through FUSEDOPT_LAUNCH_KERNEL like the optimizer's kernels; called by
// tests/test_cuda_emulated.py through simt_selftest.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "multi_tensor_apply.cuh"

namespace {

using fusedopt::cuda::block_broadcast;
using fusedopt::cuda::block_sum;

constexpr unsigned kFull = 0xffffffffu;

// 5 values per thread: v shuffled down by 1, 5, 16, 31, and by 3 within segments of 8 lanes,
// where v = 1000 * block + thread.
__global__ void shuffle_kernel(int* out) {
  const int t = static_cast<int>(threadIdx.x);
  const int v = 1000 * static_cast<int>(blockIdx.x) + t;
  int* o = out + 5 * (static_cast<int>(blockIdx.x * blockDim.x) + t);
  o[0] = __shfl_down_sync(kFull, v, 1);
  o[1] = __shfl_down_sync(kFull, v, 5);
  o[2] = __shfl_down_sync(kFull, v, 16);
  o[3] = __shfl_down_sync(kFull, v, 31);
  o[4] = __shfl_down_sync(kFull, v, 3, 8);
}

// block_sum<2, kThreads> of (v + 1, v * v), v = thread + 1000 * block, in double; thread 0
// writes the block's two sums.
template <int kThreads>
__global__ void block_sum_kernel(double* out) {
  const double v = threadIdx.x + 1000.0 * blockIdx.x;
  double acc[2] = {v + 1.0, v * v};
  block_sum<2, kThreads>(acc);
  if (threadIdx.x == 0) {
    out[2 * blockIdx.x] = acc[0];
    out[2 * blockIdx.x + 1] = acc[1];
  }
}

// Every thread writes what thread 0 computed for its block: 7 * block + 3.
__global__ void broadcast_kernel(int* out) {
  const int v = block_broadcast<int>([] { return 7 * static_cast<int>(blockIdx.x) + 3; });
  out[blockIdx.x * blockDim.x + threadIdx.x] = v;
}

// The order in which threads first run: every thread appends block * blockDim + thread.
__global__ void order_kernel(int* out, int* count) {
  out[(*count)++] = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
}

// A race: thread 0 writes shared s after the barrier while the others read it with no barrier
// in between, so what they read depends on the order in which the threads run.
__global__ void race_kernel(int* out) {
  __shared__ int s;
  if (threadIdx.x == 0) s = 0;
  __syncthreads();
  if (threadIdx.x == 0) s = 1;
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

// Thread 3 skips the barrier: the block can never get past it.
__global__ void divergent_barrier_kernel(int* out) {
  if (threadIdx.x != 3) __syncthreads();
  out[threadIdx.x] = 1;
}

// Odd and even threads wait at two different __syncthreads.
__global__ void two_barriers_kernel(int* out) {
  if (threadIdx.x % 2 == 0) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1;
}

// Half of each warp calls a full-mask shuffle.
__global__ void partial_shuffle_kernel(int* out) {
  int v = static_cast<int>(threadIdx.x);
  if (threadIdx.x % 32 < 16) v = __shfl_down_sync(kFull, v, 1);
  out[threadIdx.x] = v;
}

int finish() { return static_cast<int>(cudaGetLastError()); }

}  // namespace

extern "C" int simt_selftest(const char* which, void* out, void* extra, unsigned grid,
                             unsigned block) {
  const std::string w = which;
  if (w == "shuffle") {
    FUSEDOPT_LAUNCH_KERNEL(shuffle_kernel, grid, block, nullptr, static_cast<int*>(out));
  } else if (w == "block_sum_512") {
    FUSEDOPT_LAUNCH_KERNEL(block_sum_kernel<512>, grid, block, nullptr, static_cast<double*>(out));
  } else if (w == "block_sum_256") {
    FUSEDOPT_LAUNCH_KERNEL(block_sum_kernel<256>, grid, block, nullptr, static_cast<double*>(out));
  } else if (w == "broadcast") {
    FUSEDOPT_LAUNCH_KERNEL(broadcast_kernel, grid, block, nullptr, static_cast<int*>(out));
  } else if (w == "order") {
    FUSEDOPT_LAUNCH_KERNEL(order_kernel, grid, block, nullptr, static_cast<int*>(out),
                           static_cast<int*>(extra));
  } else if (w == "race") {
    FUSEDOPT_LAUNCH_KERNEL(race_kernel, grid, block, nullptr, static_cast<int*>(out));
  } else if (w == "divergent_barrier") {
    FUSEDOPT_LAUNCH_KERNEL(divergent_barrier_kernel, grid, block, nullptr, static_cast<int*>(out));
  } else if (w == "two_barriers") {
    FUSEDOPT_LAUNCH_KERNEL(two_barriers_kernel, grid, block, nullptr, static_cast<int*>(out));
  } else if (w == "partial_shuffle") {
    FUSEDOPT_LAUNCH_KERNEL(partial_shuffle_kernel, grid, block, nullptr, static_cast<int*>(out));
  } else {
    return -1;
  }
  return finish();
}
