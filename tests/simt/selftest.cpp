// Kernels that test the SIMT emulator itself (not the optimizer): shuffles, the block reduction
// and broadcast of csrc/cuda/multi_tensor_apply.cuh, the scheduling orders, the vector accesses of
// the kernels, and kernels with bugs the emulator must report (shared-memory races that the resume
// orders expose, barriers that can never complete, misaligned vector accesses). Launched through
// FUSEDOPT_LAUNCH_KERNEL like the optimizer's kernels; called by tests/test_cuda_emulated.py
// through simt_selftest.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "lowp.cuh"  // with multi_tensor_apply.cuh

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

// block_sum's exchange without its __syncthreads: lane 0 of every warp leaves a value in shared
// memory after a shuffle, and warp 0 reads them all after a second shuffle. A round-robin order
// releases a shuffle only at the end of a round, in which every warp has written; an order that
// lets warp 0 get past both shuffles before the other warps run makes it read the previous
// block's values. out[32 * block + w]: what warp 0 read for warp w (expected 1000 * block + w + 1).
__global__ void unsynced_sum_kernel(int* out) {
  __shared__ int warp_values[32];
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int v = __shfl_down_sync(kFull, 1000 * static_cast<int>(blockIdx.x) + warp + 1, 1);
  if (lane == 0) warp_values[warp] = v;
  if (warp == 0) {
    __shfl_down_sync(kFull, lane, 1);  // warp 0 meets once more before it reads
    const int warps = static_cast<int>(blockDim.x) / 32;
    out[32 * blockIdx.x + lane] = lane < warps ? warp_values[lane] : 0;
  }
}

// block_broadcast without its __syncthreads: thread 0 writes, every thread reads at once.
// out[block * blockDim + thread]: what the thread read (expected 7 * block + 3).
__global__ void unsynced_broadcast_kernel(int* out) {
  __shared__ int value;
  if (threadIdx.x == 0) value = 7 * static_cast<int>(blockIdx.x) + 3;
  out[blockIdx.x * blockDim.x + threadIdx.x] = value;
}

// The kernels' 16-byte vector access (load_group / store_group of multi_tensor_apply.cuh with vec
// = true): thread t doubles p[4t .. 4t + 3] in place. Faults unless p is 16-byte aligned.
__global__ void vector_access_kernel(float* p) {
  float x[4];
  const int off = 4 * static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  fusedopt::cuda::load_group<4>(x, static_cast<const float*>(p), off, 4, true);
  for (float& v : x) v *= 2.0f;
  fusedopt::cuda::store_group<4>(p, x, off, 4, true);
}

// The vector store alone: thread t writes 4t + 1 .. 4t + 4 to p[4t .. 4t + 3].
__global__ void vector_store_kernel(float* p) {
  const int off = 4 * static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  const float x[4] = {off + 1.0f, off + 2.0f, off + 3.0f, off + 4.0f};
  fusedopt::cuda::store_group<4>(p, x, off, 4, true);
}

// The 8-byte access of 8-bit codes (load_codes / store_codes of lowp.cuh with vec = true):
// thread t adds 1 to p[8t .. 8t + 7] in place. Faults unless p is 8-byte aligned.
__global__ void codes_access_kernel(signed char* p) {
  signed char c[fusedopt::cuda::kLaneElems];
  const int off = 8 * static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  fusedopt::cuda::load_codes(c, static_cast<const signed char*>(p), off, 8, true);
  for (signed char& v : c) v = static_cast<signed char>(v + 1);
  fusedopt::cuda::store_codes(p, c, off, 8, true);
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
  } else if (w == "unsynced_sum") {
    FUSEDOPT_LAUNCH_KERNEL(unsynced_sum_kernel, grid, block, nullptr, static_cast<int*>(out));
  } else if (w == "unsynced_broadcast") {
    FUSEDOPT_LAUNCH_KERNEL(unsynced_broadcast_kernel, grid, block, nullptr,
                           static_cast<int*>(out));
  } else if (w == "vector_access") {
    FUSEDOPT_LAUNCH_KERNEL(vector_access_kernel, grid, block, nullptr, static_cast<float*>(out));
  } else if (w == "vector_store") {
    FUSEDOPT_LAUNCH_KERNEL(vector_store_kernel, grid, block, nullptr, static_cast<float*>(out));
  } else if (w == "codes_access") {
    FUSEDOPT_LAUNCH_KERNEL(codes_access_kernel, grid, block, nullptr,
                           static_cast<signed char*>(out));
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
