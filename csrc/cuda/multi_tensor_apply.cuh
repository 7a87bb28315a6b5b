// The CUDA multi-tensor launcher: tables of tensor pointers and sizes passed as kernel arguments,
// chunk -> tensor mapping, launch splitting, vectorized group loads/stores and the deterministic
// two-stage per-tensor sums of squares. It owns the tables, the launches and the memory access
// pattern; the functors in lamb.cu / lars.cu / norms.cu own only the arithmetic, which comes from
// fusedopt/math.h.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <type_traits>

#include "launch.h"

namespace fusedopt {
namespace cuda {

constexpr int kBlockSize = 512;        // threads of a chunk block
constexpr int kReduceBlockSize = 256;  // threads of a per-tensor reduction block
// Bytes of kernel argument space a table may use: tables are passed by value and kernel
// arguments are limited to 4 KiB, which the functor's own members share.
constexpr int kTableBytes = 3584;

// Tables are read in place from the kernel argument space, also at dynamic indices;
// __grid_constant__ (CUDA 11.7+, sm_70+) guarantees that no local copy is made.
#if (__CUDACC_VER_MAJOR__ > 11 || (__CUDACC_VER_MAJOR__ == 11 && __CUDACC_VER_MINOR__ >= 7)) && \
    (!defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 700)
#define FUSEDOPT_GRID_CONSTANT __grid_constant__
#else
#define FUSEDOPT_GRID_CONSTANT
#endif

// Every kernel launch of the backend goes through this macro (the kernel, when a template-id,
// in parentheses), so that another launcher can stand in for <<<...>>>: the SIMT emulation of
// the tests defines it before this header to run the kernels on the CPU
// (docs/cuda_emulation.md).
#ifndef FUSEDOPT_LAUNCH_KERNEL
#define FUSEDOPT_LAUNCH_KERNEL(kernel, grid, block, stream, ...) \
  kernel<<<grid, block, 0, stream>>>(__VA_ARGS__)
#endif

static_assert(kChunkSize % 16 == 0, "chunks start 16-byte aligned in a 16-byte aligned tensor");

// ------------------------------------------------------------------------------------ tables

// Note [tensor table]: the tensors of one launch. Row r of ptrs holds list r of the bucket (for
// example w, g, m, v, steps); slot j is the j-th tensor of this launch, index[j] its position in
// the bucket (the row of sums). The blocks of tensor j are block_start[j] .. block_start[j+1]-1,
// block b covering elements [(b - block_start[j]) * kChunkSize, ...) of it, and writing its
// partial sums to workspace row partial_base + b. 0-size tensors take a slot but no block, so
// the reduction still writes their sums (0) and advances their step counts.
template <int kRows>
struct TensorTable {
  static constexpr int kMaxTensors = (kTableBytes - 24) / (8 * kRows + 16);
  void* ptrs[kRows][kMaxTensors];
  int64_t numel[kMaxTensors];
  int32_t index[kMaxTensors];
  int32_t block_start[kMaxTensors + 1];
  int32_t n;
  int64_t partial_base;
};

// Note [launch splitting]: for_each_table fills a table with consecutive tensors of the bucket and
// calls launch(table, blocks) when it is full (kMaxTensors slots, or the grid size limit), then
// starts the next table; partial_base keeps the workspace rows of successive launches apart. A
// launch thus covers every chunk of its tensors, so each tensor's partials are complete when the
// reduction of the same table runs right after it on the stream. keep_empty=false leaves 0-size
// tensors out (passes without norms or step counts have nothing to do for them).
template <int kRows, typename Launch>
cudaError_t for_each_table(int64_t n, const int64_t* numel, void* const* const (&lists)[kRows],
                           bool keep_empty, const Launch& launch) {
  TensorTable<kRows> table;
  table.n = 0;
  table.partial_base = 0;
  int64_t blocks = 0;
  auto flush = [&]() -> cudaError_t {
    table.block_start[table.n] = static_cast<int32_t>(blocks);
    const cudaError_t err = launch(static_cast<const TensorTable<kRows>&>(table), blocks);
    table.partial_base += blocks;
    table.n = 0;
    blocks = 0;
    return err;
  };
  for (int64_t i = 0; i < n; ++i) {
    if (numel[i] == 0 && !keep_empty) continue;
    const int64_t chunks = num_chunks(numel[i]);
    if (chunks > INT_MAX) return cudaErrorInvalidValue;
    if (table.n == TensorTable<kRows>::kMaxTensors || blocks + chunks > INT_MAX) {
      const cudaError_t err = flush();
      if (err != cudaSuccess) return err;
    }
    const int j = table.n++;
    for (int r = 0; r < kRows; ++r) table.ptrs[r][j] = lists[r][i];
    table.numel[j] = numel[i];
    table.index[j] = static_cast<int32_t>(i);
    table.block_start[j] = static_cast<int32_t>(blocks);
    blocks += chunks;
  }
  return table.n > 0 ? flush() : cudaSuccess;
}

// ---------------------------------------------------------------------------------- kernels

// The slot of the tensor that block b belongs to: the last slot whose first block is <= b (0-size
// tensors own no block, so they are never found).
template <int kRows>
__host__ __device__ __forceinline__ int slot_of_block(const TensorTable<kRows>& table, int32_t b) {
  int lo = 0;
  int hi = table.n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (table.block_start[mid] <= b) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// One block per chunk: hands chunk (b - block_start[slot]) of its tensor to the functor.
template <int kRows, typename Op>
__global__ void __launch_bounds__(kBlockSize)
    chunk_kernel(const FUSEDOPT_GRID_CONSTANT TensorTable<kRows> table, const Op op) {
  const int32_t b = static_cast<int32_t>(blockIdx.x);
  const int slot = slot_of_block(table, b);
  const int64_t begin = static_cast<int64_t>(b - table.block_start[slot]) * kChunkSize;
  const int64_t left = table.numel[slot] - begin;
  const int count = static_cast<int>(left < kChunkSize ? left : kChunkSize);
  op(table, slot, begin, count, table.partial_base + b);
}

// Sums of the K values of every thread, in a fixed order (warp shuffles, then the warps' sums in
// warp order); the result is valid in thread 0.
template <int K, int kThreads, typename T>
__device__ __forceinline__ void block_sum(T (&v)[K]) {
  constexpr int kWarps = kThreads / 32;
  __shared__ T warp_sums[K][kWarps];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
#pragma unroll
  for (int k = 0; k < K; ++k) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v[k] += __shfl_down_sync(0xffffffffu, v[k], off);
    if (lane == 0) warp_sums[k][warp] = v[k];
  }
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      v[k] = lane < kWarps ? warp_sums[k][lane] : T(0);
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) v[k] += __shfl_down_sync(0xffffffffu, v[k], off);
    }
  }
}

// Note [per-tensor scalars]: the per-tensor values of a chunk (bias corrections, which take a
// pow in double, trust ratios, grad_mult) are computed once per block by thread 0 and handed to
// the other threads through shared memory. Every thread of the block calls this once per kernel.
template <typename V, typename F>
__device__ __forceinline__ V block_broadcast(const F& f) {
  __shared__ V value;
  if (threadIdx.x == 0) value = f();
  __syncthreads();
  return value;
}

// Writes the block's K partial sums to its workspace row.
template <int K, typename T>
__device__ __forceinline__ void write_partials(T (&acc)[K], T* partials, int64_t row) {
  block_sum<K, kBlockSize>(acc);
  if (threadIdx.x == 0) {
#pragma unroll
    for (int k = 0; k < K; ++k) partials[row * K + k] = acc[k];
  }
}

__device__ __forceinline__ bool step_skipped(const float* found_inf) {
  return found_inf != nullptr && *found_inf != 0.0f;
}

// Note [step counts in reduce_kernel]: the second stage of a pass 1. One block per slot of the
// table adds the tensor's partial rows in chunk order and writes its row of sums; thread 0 then
// advances the step count (row kStepRow of the table, -1: none) unless found_inf is set. Every
// chunk block of pass 1 has read the OLD count (and used old + 1) before this kernel starts on
// the same stream, so the single increment here is race-free. (The Triton kernels keep the same
// rule in one launch: Note [step counts] in fusedopt/kernels/common.py.)
template <int K, int kStepRow, typename T, int kRows>
__global__ void __launch_bounds__(kReduceBlockSize)
    reduce_kernel(const FUSEDOPT_GRID_CONSTANT TensorTable<kRows> table,
                  const T* __restrict__ partials,  // [rows, K] chunk partial sums
                  T* __restrict__ sums,            // [n, K] per-tensor sums, by bucket index
                  const float* found_inf) {        // nullptr or 0-dim float32
  const int j = blockIdx.x;
  const int64_t first = table.partial_base + table.block_start[j];
  const int64_t last = table.partial_base + table.block_start[j + 1];
  T acc[K];
#pragma unroll
  for (int k = 0; k < K; ++k) acc[k] = T(0);
  for (int64_t r = first + threadIdx.x; r < last; r += kReduceBlockSize) {
#pragma unroll
    for (int k = 0; k < K; ++k) acc[k] += partials[r * K + k];
  }
  block_sum<K, kReduceBlockSize>(acc);
  if (threadIdx.x == 0) {
    const int64_t i = table.index[j];
#pragma unroll
    for (int k = 0; k < K; ++k) sums[i * K + k] = acc[k];
    if constexpr (kStepRow >= 0) {
      if (!step_skipped(found_inf)) {
        float* step = static_cast<float*>(table.ptrs[kStepRow][j]);
        *step = *step + 1.0f;
      }
    }
  }
}

// Launches the chunk kernel of one table (if it has any chunk) and, for a pass with norms, the
// reduction of the same table.
template <int kRows, typename Op>
cudaError_t launch_chunks(const TensorTable<kRows>& table, int64_t blocks, const Op& op,
                          cudaStream_t stream) {
  static_assert(sizeof(TensorTable<kRows>) + sizeof(Op) <= 4096, "kernel arguments over 4 KiB");
  if (blocks > 0) {
    FUSEDOPT_LAUNCH_KERNEL((chunk_kernel<kRows, Op>), static_cast<unsigned>(blocks), kBlockSize,
                           stream, table, op);
  }
  return cudaGetLastError();
}

template <int K, int kStepRow, typename T, int kRows>
cudaError_t launch_reduce(const TensorTable<kRows>& table, const T* partials, T* sums,
                          const float* found_inf, cudaStream_t stream) {
  FUSEDOPT_LAUNCH_KERNEL((reduce_kernel<K, kStepRow, T, kRows>), static_cast<unsigned>(table.n),
                         kReduceBlockSize, stream, table, partials, sums, found_inf);
  return cudaGetLastError();
}

// A pass with norms (sq_norms, pass 1 of LAMB and LARS): for each table of `lists` (one row per
// list, in Op's row order), Op's chunk kernel writes K partial sums per chunk, then the reduction
// adds them per tensor in chunk order into sums [n, K] (and advances the step counts of row
// kStepRow unless found_inf; -1: no step counts).
template <int K, int kStepRow, typename Op, typename T>
cudaError_t run_pass_with_norms(int64_t n, const int64_t* numel,
                                void* const* const (&lists)[Op::kRows], const Op& op,
                                const T* partials, T* sums, const float* found_inf,
                                cudaStream_t stream) {
  return for_each_table<Op::kRows>(
      n, numel, lists, /*keep_empty=*/true,
      [&](const TensorTable<Op::kRows>& table, int64_t blocks) {
        const cudaError_t err = launch_chunks(table, blocks, op, stream);
        if (err != cudaSuccess) return err;
        return launch_reduce<K, kStepRow>(table, partials, sums, found_inf, stream);
      });
}

// A pass without norms (pass 2 of LAMB and LARS): Op's chunk kernel over each table of `lists`;
// 0-size tensors are left out.
template <typename Op>
cudaError_t run_pass(int64_t n, const int64_t* numel, void* const* const (&lists)[Op::kRows],
                     const Op& op, cudaStream_t stream) {
  return for_each_table<Op::kRows>(
      n, numel, lists, /*keep_empty=*/false,
      [&](const TensorTable<Op::kRows>& table, int64_t blocks) {
        return launch_chunks(table, blocks, op, stream);
      });
}

// ------------------------------------------------------------------------ element access

// Stands for "no low-precision param to write": the weights are the params themselves.
struct NoParam {};

template <typename T>
struct Tag {
  using type = T;
};

// Conversions between storage and compute types; float -> bf16/fp16 rounds to nearest even.
template <typename T, typename S>
__device__ __forceinline__ T to_compute(S x) {
  return static_cast<T>(x);
}
template <>
__device__ __forceinline__ float to_compute<float, __half>(__half x) {
  return __half2float(x);
}
template <>
__device__ __forceinline__ float to_compute<float, __nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
template <typename S, typename T>
__device__ __forceinline__ S to_storage(T x) {
  return static_cast<S>(x);
}
template <>
__device__ __forceinline__ __half to_storage<__half, float>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 to_storage<__nv_bfloat16, float>(float x) {
  return __float2bfloat16_rn(x);
}

// Note [vectorization]: a thread handles groups of N consecutive elements, N (ilp_for) chosen so that
// the narrowest array of the functor moves exactly 16 bytes per group (fp32: 4 elements, with a
// bf16/fp16 array: 8, fp64: 2); wider arrays move 2 or 4 16-byte vectors. When every pointer of
// the chunk is 16-byte aligned, full groups use 16-byte loads/stores; otherwise, and for the last
// partial group of a chunk, elements are accessed one by one. Either way thread t handles groups
// t, t + kBlockSize, ... in increasing order and element k of a group in order k, so the partial
// sums do not depend on the alignment.
template <typename... S>
constexpr int ilp_for() {
  int narrowest = 16;
  ((narrowest = static_cast<int>(sizeof(S)) < narrowest ? static_cast<int>(sizeof(S)) : narrowest),
   ...);
  return 16 / narrowest;
}

template <typename... P>
__device__ __forceinline__ bool all_aligned(const P*... p) {
  return ((reinterpret_cast<uintptr_t>(p) | ...) & 15u) == 0;
}

// Visits the groups of one chunk of `count` elements: body(offset, n, vec), n elements from
// offset (n == N except for the last group), vec: 16-byte accesses allowed.
template <int N, typename Body>
__device__ __forceinline__ void for_each_group(int count, bool aligned, const Body& body) {
  const int full = count / N;
  for (int gi = threadIdx.x; gi < full; gi += kBlockSize) body(gi * N, N, aligned);
  const int tail = count - full * N;
  if (tail != 0 && static_cast<int>(threadIdx.x) == full % kBlockSize) body(full * N, tail, false);
}

template <typename S, int N>
struct alignas(16) Pack16 {
  static constexpr int kPer = 16 / static_cast<int>(sizeof(S));
  static_assert(N % kPer == 0, "a group is a whole number of 16-byte vectors");
  S v[kPer];
};

// x[k] = p[off + k] for k < n (elements past n are set to 0 and must not be used).
template <int N, typename T, typename S>
__device__ __forceinline__ void load_group(T (&x)[N], const S* __restrict__ p, int off, int n,
                                           bool vec) {
  if (vec) {
    using V = Pack16<S, N>;
    const V* q = reinterpret_cast<const V*>(p + off);
#pragma unroll
    for (int u = 0; u < N / V::kPer; ++u) {
      const V pk = q[u];
#pragma unroll
      for (int j = 0; j < V::kPer; ++j) x[u * V::kPer + j] = to_compute<T>(pk.v[j]);
    }
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) x[k] = k < n ? to_compute<T>(p[off + k]) : T(0);
  }
}

// p[off + k] = x[k] for k < n, rounded to S.
template <int N, typename S, typename T>
__device__ __forceinline__ void store_group(S* __restrict__ p, const T (&x)[N], int off, int n,
                                            bool vec) {
  if (vec) {
    using V = Pack16<S, N>;
    V* q = reinterpret_cast<V*>(p + off);
#pragma unroll
    for (int u = 0; u < N / V::kPer; ++u) {
      V pk;
#pragma unroll
      for (int j = 0; j < V::kPer; ++j) pk.v[j] = to_storage<S>(x[u * V::kPer + j]);
      q[u] = pk;
    }
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) {
      if (k < n) p[off + k] = to_storage<S>(x[k]);
    }
  }
}

// The chunk's part of row r of the table, as an array of S.
template <typename S, int kRows>
__device__ __forceinline__ S* chunk_ptr(const TensorTable<kRows>& t, int row, int slot,
                                        int64_t begin) {
  return static_cast<S*>(t.ptrs[row][slot]) + begin;
}

// --------------------------------------------------------------------------------- dispatch

// Calls f(Tag<S>{}) with S the storage type of a float32/float16/bfloat16 dtype.
template <typename F>
cudaError_t dispatch_fp32_compute(DType d, const F& f) {
  switch (d) {
    case DType::kFloat32: return f(Tag<float>{});
    case DType::kFloat16: return f(Tag<__half>{});
    case DType::kBFloat16: return f(Tag<__nv_bfloat16>{});
    default: return cudaErrorNotSupported;
  }
}

template <typename S>
constexpr DType dtype_of() {
  return std::is_same<S, __half>::value           ? DType::kFloat16
         : std::is_same<S, __nv_bfloat16>::value ? DType::kBFloat16
         : std::is_same<S, double>::value        ? DType::kFloat64
                                                 : DType::kFloat32;
}

// Calls f(Tag<G>{}) with G the type of the gradients of params stored as S: float32 params take
// float32, bfloat16 or float16 grads; bfloat16/float16 params take their own dtype or float32.
template <typename S, typename F>
cudaError_t dispatch_grad(DType d, const F& f) {
  if constexpr (std::is_same<S, float>::value) {
    return dispatch_fp32_compute(d, f);
  } else {
    if (d == DType::kFloat32) return f(Tag<float>{});
    if (d == dtype_of<S>()) return f(Tag<S>{});
    return cudaErrorNotSupported;
  }
}

// Calls f(Tag<C>{}, Tag<W>{}, Tag<G>{}) with the compute, weight and grad types of a pass that
// reads weights and grads: all float64, or float32 math for float32/float16/bfloat16 weights
// with the grads dispatch_grad accepts. Shared by the pass-1 launchers of LAMB and LARS.
template <typename F>
cudaError_t dispatch_weights_and_grads(const BucketPtrs& b, const F& f) {
  if (b.weight_dtype == DType::kFloat64) {
    if (b.grad_dtype != DType::kFloat64) return cudaErrorNotSupported;
    return f(Tag<double>{}, Tag<double>{}, Tag<double>{});
  }
  return dispatch_fp32_compute(b.weight_dtype, [&](auto w_tag) {
    using W = typename decltype(w_tag)::type;
    return dispatch_grad<W>(b.grad_dtype, [&](auto g_tag) { return f(Tag<float>{}, w_tag, g_tag); });
  });
}

// Calls f(Tag<P>{}) with P the type of the params written beside fp32 masters (W = float), or
// NoParam when the weights are the params.
template <typename W, typename F>
cudaError_t dispatch_param_out(const BucketPtrs& b, const F& f) {
  if (b.params == nullptr) return f(Tag<NoParam>{});
  if constexpr (std::is_same<W, float>::value) {
    switch (b.param_dtype) {
      case DType::kFloat16: return f(Tag<__half>{});
      case DType::kBFloat16: return f(Tag<__nv_bfloat16>{});
      default: break;
    }
  }
  return cudaErrorNotSupported;
}

// ------------------------------------------------------------------------- pass launchers

// The bucket's lists in the row order of a pass functor (Note [tensor table]): every functor of
// lamb.cu and lars.cu has a `static TableRows<kRows> rows(const BucketPtrs&, void* const* state)`
// naming them (state: the state row of Note [state rows] in lowp.cuh, used by the functors of
// low-precision state).
template <int kRows>
struct TableRows {
  void* const* lists[kRows];
};

inline void* const* step_row(const BucketPtrs& b) {
  return reinterpret_cast<void* const*>(b.steps);
}

// Pass 1 of LAMB and LARS: Pass1<C, W, G>{h, grad_mult, found_inf, partials} (C, W, G from
// dispatch_weights_and_grads) over the bucket's tables, whose rows are Pass1::rows(b, state)
// (state: the state row of Note [state rows] in lowp.cuh, or nullptr); the reduction writes the
// two per-tensor sums of squares to sums [n, 2] and advances the step counts of row Pass1::kStep.
// kFloat32Only: Pass1 exists for float32 math only (low-precision state); float64 weights are
// cudaErrorNotSupported.
template <template <typename, typename, typename> class Pass1, bool kFloat32Only = false,
          typename H>
cudaError_t launch_pass1(const BucketPtrs& b, const H& h, const DeviceScalars& s, void* sums,
                         void* partials, cudaStream_t stream, void* const* state = nullptr) {
  return dispatch_weights_and_grads(b, [&](auto c_tag, auto w_tag, auto g_tag) {
    using C = typename decltype(c_tag)::type;
    if constexpr (kFloat32Only && !std::is_same<C, float>::value) {
      return cudaErrorNotSupported;
    } else {
      using Op = Pass1<C, typename decltype(w_tag)::type, typename decltype(g_tag)::type>;
      const Op op{h, static_cast<const C*>(s.grad_mult), s.found_inf, static_cast<C*>(partials)};
      const TableRows<Op::kRows> rows = Op::rows(b, state);
      return run_pass_with_norms<2, Op::kStep>(b.n, b.numel, rows.lists, op,
                                                static_cast<const C*>(partials),
                                                static_cast<C*>(sums), s.found_inf, stream);
    }
  });
}

// Pass 2 of LAMB and LARS: the functor make(Tag<C>{}, Tag<W>{}, [Tag<G>{},] Tag<P>{}) returns,
// over the bucket's tables (rows Op::rows(b, state), as in launch_pass1). All float64 (grads
// float64, no params), or float32 math for float32/float16/bfloat16 weights with P from
// dispatch_param_out; with kReadsGrads, G is the grads' type from dispatch_grad for the params'
// storage type (P beside masters, else W). kFloat32Only: as in launch_pass1.
template <bool kReadsGrads, bool kFloat32Only = false, typename Make>
cudaError_t launch_pass2(const BucketPtrs& b, cudaStream_t stream, const Make& make,
                         void* const* state = nullptr) {
  auto run = [&](auto... tags) {
    const auto op = make(tags...);
    using Op = std::remove_const_t<decltype(op)>;
    const TableRows<Op::kRows> rows = Op::rows(b, state);
    return run_pass(b.n, b.numel, rows.lists, op, stream);
  };
  if (b.weight_dtype == DType::kFloat64) {
    if constexpr (kFloat32Only) {
      return cudaErrorNotSupported;
    } else {
      if ((kReadsGrads && b.grad_dtype != DType::kFloat64) || b.params != nullptr) {
        return cudaErrorNotSupported;
      }
      if constexpr (kReadsGrads) {
        return run(Tag<double>{}, Tag<double>{}, Tag<double>{}, Tag<NoParam>{});
      } else {
        return run(Tag<double>{}, Tag<double>{}, Tag<NoParam>{});
      }
    }
  }
  return dispatch_fp32_compute(b.weight_dtype, [&](auto w_tag) {
    using W = typename decltype(w_tag)::type;
    return dispatch_param_out<W>(b, [&](auto p_tag) {
      if constexpr (kReadsGrads) {
        using P = typename decltype(p_tag)::type;
        // the grads belong to the params: stored as P beside masters, else as W
        using S = std::conditional_t<std::is_same<P, NoParam>::value, W, P>;
        return dispatch_grad<S>(b.grad_dtype, [&](auto g_tag) {
          return run(Tag<float>{}, w_tag, g_tag, p_tag);
        });
      } else {
        return run(Tag<float>{}, w_tag, p_tag);
      }
    });
  });
}

}  // namespace cuda
}  // namespace fusedopt
