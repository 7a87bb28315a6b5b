// Low-precision optimizer state on CUDA (docs/math.md "Low-precision state", Note [state formats]
// in fusedopt/math.h): the per-tensor format in the launch tables, the packed 8-bit layout, the
// iteration over 8-bit blocks and the reduction of a block's largest value. The functors of
// lamb.cu and lars.cu branch on a tensor's format once per chunk; the per-element math is the
// rounded-operation functions of math.h (Note [rounded operations]), so that the kernels store
// the bits the cpp backend stores (csrc/cpu/ops.cpp, lamb_pass1_chunk_q8 and its siblings).
#pragma once

#include <cstdint>
#include <vector>

#include "multi_tensor_apply.cuh"

namespace fusedopt {
namespace cuda {

// ------------------------------------------------------------------------------ the tables
// Note [state rows]: a launch whose bucket holds some low-precision state has one more table row
// than the full-state launch, after the others. Its entry for each tensor is not a pointer but
// the tensor's StateFormat (bits 0-7) and the two halves of the key of its random bits (LAMB
// pass 1; sr_base and sr_first in math.h): the low half in bits 8-31 (below 2^24, checked when
// the keys are read) and sr_first in bits 32-63, read by thread 0 with the other per-tensor
// scalars (Note [per-tensor scalars]). A bucket of full state launches the full-state kernels,
// which have no such row and no branch.
static_assert(sizeof(void*) == 8, "the state row packs a format and a key in a pointer");

inline bool has_low_precision(const BucketPtrs& b) {
  if (b.formats == nullptr) return false;
  for (int64_t i = 0; i < b.n; ++i) {
    if (b.formats[i] != kFullState) return true;
  }
  return false;
}

// The state row of the bucket (Note [state rows]), one entry per tensor.
inline std::vector<void*> state_row(const BucketPtrs& b) {
  std::vector<void*> row(static_cast<size_t>(b.n));
  for (int64_t i = 0; i < b.n; ++i) {
    const uint64_t key = static_cast<uint64_t>(b.keys != nullptr ? b.keys[i] : i);
    const uint64_t format = b.formats != nullptr ? b.formats[i] : uint64_t{kFullState};
    row[static_cast<size_t>(i)] = reinterpret_cast<void*>(static_cast<uintptr_t>(
        format | (key & 0xffffffu) << 8 | uint64_t{sr_first(static_cast<long long>(key))} << 32));
  }
  return row;
}

template <int kRows>
__device__ __forceinline__ unsigned char slot_format(const TensorTable<kRows>& t, int row,
                                                     int slot) {
  return static_cast<unsigned char>(reinterpret_cast<uintptr_t>(t.ptrs[row][slot]) & 0xffu);
}

template <int kRows>
__device__ __forceinline__ unsigned int slot_key(const TensorTable<kRows>& t, int row, int slot) {
  return static_cast<unsigned int>(reinterpret_cast<uintptr_t>(t.ptrs[row][slot]) >> 8) & 0xffffffu;
}

template <int kRows>
__device__ __forceinline__ unsigned int slot_first(const TensorTable<kRows>& t, int row, int slot) {
  return static_cast<unsigned int>(reinterpret_cast<uintptr_t>(t.ptrs[row][slot]) >> 32);
}

// --------------------------------------------------------------------------- 8-bit layout

// A packed 8-bit moment from a chunk's first element on (a multiple of kQBlock): the scales of
// its blocks and its codes (C: signed char for the signed map, unsigned char for the root map).
template <typename C>
struct Packed {
  float* scales;
  C* codes;
};

template <typename C, int kRows>
__device__ __forceinline__ Packed<C> chunk_packed(const TensorTable<kRows>& t, int row, int slot,
                                                  int64_t begin) {
  unsigned char* bytes = static_cast<unsigned char*>(t.ptrs[row][slot]);
  return {reinterpret_cast<float*>(bytes) + begin / kQBlock,
          reinterpret_cast<C*>(bytes + q8_codes_offset(t.numel[slot])) + begin};
}

static_assert(kChunkSize % kQBlock == 0, "a chunk holds whole 8-bit blocks");

constexpr int kWarps = kBlockSize / 32;
constexpr int kLaneElems = kQBlock / 32;  // elements of an 8-bit block per lane
static_assert(kBlockSize % 32 == 0 && kQBlock % 32 == 0 && kLaneElems == 8,
              "a warp holds one 8-bit block, 8 elements per lane");

template <typename C>
struct alignas(8) Codes8 {
  C v[kLaneElems];
};

template <typename... C>
__device__ __forceinline__ bool all_aligned8(const C*... p) {
  return ((reinterpret_cast<uintptr_t>(p) | ...) & 7u) == 0;
}

// x[k] = p[off + k] for k < n (0 past n); vec: one 8-byte access (n == kLaneElems, aligned).
template <typename C>
__device__ __forceinline__ void load_codes(C (&x)[kLaneElems], const C* __restrict__ p, int off,
                                           int n, bool vec) {
  if (vec) {
    const Codes8<C> c = *reinterpret_cast<const Codes8<C>*>(p + off);
#pragma unroll
    for (int k = 0; k < kLaneElems; ++k) x[k] = c.v[k];
  } else {
#pragma unroll
    for (int k = 0; k < kLaneElems; ++k) x[k] = k < n ? p[off + k] : C(0);
  }
}

template <typename C>
__device__ __forceinline__ void store_codes(C* __restrict__ p, const C (&x)[kLaneElems], int off,
                                            int n, bool vec) {
  if (vec) {
    Codes8<C> c;
#pragma unroll
    for (int k = 0; k < kLaneElems; ++k) c.v[k] = x[k];
    *reinterpret_cast<Codes8<C>*>(p + off) = c;
  } else {
#pragma unroll
    for (int k = 0; k < kLaneElems; ++k) {
      if (k < n) p[off + k] = x[k];
    }
  }
}

// ------------------------------------------------------------------------ 8-bit iteration

// Note [8-bit blocks on CUDA]: the 8-bit blocks of a chunk (kQBlock elements counted from the
// tensor's first element; a chunk starts on a block boundary and the tensor's last block may be
// short) are handed out one per warp, in rounds of kWarps blocks: in round r warp w holds block
// q = r*kWarps + w, lane l its elements [8l, 8l + 8). body(round, q, off, n) gets off = q*kQBlock
// + 8l, the lane's first element in the chunk, and n, how many of its 8 elements exist (0 for a
// lane past the chunk's end or a warp without a block in the last round). Every thread of the
// block calls body the same number of times, so body may meet at block_tops.
template <typename Body>
__device__ __forceinline__ void for_each_q8_slice(int count, const Body& body) {
  const int blocks = (count + kQBlock - 1) / kQBlock;
  const int rounds = (blocks + kWarps - 1) / kWarps;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  for (int r = 0; r < rounds; ++r) {
    const int q = r * kWarps + warp;
    const int off = q * kQBlock + lane * kLaneElems;
    const int left = count - off;
    body(r, q, off, left < 0 ? 0 : (left > kLaneElems ? kLaneElems : left));
  }
}

// The largest value of top[k] and whether every finite[k] is true over the warp's lanes, for
// each of K moments, given to every lane: shuffles down to lane 0, which leaves them in shared
// memory for its warp, read after one __syncthreads. The buffer alternates with the round's
// parity, so a round's writes never meet the previous round's reads (those happened before the
// barrier of the round in between). Every thread of the block calls this once per round of
// for_each_q8_slice. The largest value and the test do not depend on the order of the lanes:
// the block's scales are those of block_top in csrc/cpu/ops.cpp.
template <int K>
__device__ __forceinline__ void block_tops(float (&top)[K], bool (&finite)[K], int round) {
  __shared__ float tops[2][K][kWarps];
  __shared__ int oks[2][K][kWarps];
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int buf = round & 1;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    float t = top[k];
    int ok = finite[k] ? 1 : 0;
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) {
      const float o = __shfl_down_sync(0xffffffffu, t, d);
      t = o > t ? o : t;
      ok &= __shfl_down_sync(0xffffffffu, ok, d);
    }
    if (lane == 0) {
      tops[buf][k][warp] = t;
      oks[buf][k][warp] = ok;
    }
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < K; ++k) {
    top[k] = tops[buf][k][warp];
    finite[k] = oks[buf][k][warp] != 0;
  }
}

// A lane's contribution to block_tops: the largest |x| (NaN never wins) and the finite test.
__device__ __forceinline__ void lane_top(float x, float& top, bool& finite) {
  const float a = std::fabs(x);
  top = a > top ? a : top;
  finite = finite && finite_rn(x);
}

// The scale stored for a block: NaN when it holds a value that is not finite (its codes are 0).
__device__ __forceinline__ float block_scale(float scale, bool finite) {
  return finite ? scale : bits_float(0x7fc00000u);
}

}  // namespace cuda
}  // namespace fusedopt
