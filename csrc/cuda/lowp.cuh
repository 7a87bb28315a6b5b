// Low-precision optimizer state on CUDA (docs/math.md "Low-precision state", Note [state formats]
// and Note [8-bit maps] in fusedopt/math.h): the per-tensor format in the launch tables, the
// packed 8-bit layout, the iteration over 8-bit blocks, the reductions of a block's words and the
// dynamic map's tables. The functors of lamb.cu and lars.cu branch on a tensor's format once per
// chunk; the per-element math is the rounded-operation functions of math.h (Note [rounded
// operations]), so that the kernels store the bytes the cpp backend stores (csrc/cpu/kernels.h,
// lamb_pass1_chunk_q8 and its siblings).
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

// A packed 8-bit moment from a chunk's first element on (a multiple of kQBlock): the two 32-bit
// words (w0, w1) of each of its blocks (Note [8-bit maps] in fusedopt/math.h) and its codes (C:
// signed char for the direction and dynamic maps, unsigned char for the root map). The words
// start on a 4-byte boundary only (the packed tensor does), so they are read one by one.
template <typename C>
struct Packed {
  unsigned int* words;  // words[2q], words[2q + 1]: block q of the chunk
  C* codes;
};

template <typename C, int kRows>
__device__ __forceinline__ Packed<C> chunk_packed(const TensorTable<kRows>& t, int row, int slot,
                                                  int64_t begin) {
  unsigned char* bytes = static_cast<unsigned char*>(t.ptrs[row][slot]);
  return {reinterpret_cast<unsigned int*>(bytes) + 2 * (begin / kQBlock),
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
// block calls body the same number of times, so body may meet at block_max. A block's words are
// read by every lane of its warp before the block's first block_max and written by lane 0 after
// it, so no lane reads a word another has already replaced.
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

// The reductions over an 8-bit block, one site each (kSite): every site has a shared buffer of
// its own, so that the reductions of one round may follow each other with no barrier between
// them.
enum ReduceSite : int { kRootWordsSite, kDirectionTopSite, kBufferTopSite };

// The largest of x[k] over the lanes of the warp, for each of K unsigned values, given to every
// lane: shuffles down to lane 0, which leaves them in shared memory for its warp, read after one
// __syncthreads. The buffer alternates with the round's parity, so a round's writes never meet
// the previous round's reads (those happened before the barrier of the round in between). Every
// thread of the block calls this once per round of for_each_q8_slice and site. The maps' block
// values are largest bit patterns of magnitudes (Note [8-bit maps]: for magnitudes their order is
// the values', and only inf and NaN lie at kInfBits or above); an integer maximum does not depend
// on the order of the lanes, so the words are those of csrc/cpu/kernels.h's block_top and
// root_words.
template <int kSite, int K>
__device__ __forceinline__ void block_max(unsigned int (&x)[K], int round) {
  __shared__ unsigned int tops[2][K][kWarps];
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int buf = round & 1;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    unsigned int t = x[k];
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) {
      const unsigned int o = __shfl_down_sync(0xffffffffu, t, d);
      t = o > t ? o : t;
    }
    if (lane == 0) tops[buf][k][warp] = t;
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < K; ++k) x[k] = tops[buf][k][warp];
}

// The bit pattern of |x| (integer operations: exact on the device as on the host).
__device__ __forceinline__ unsigned int magnitude_bits(float x) {
  return float_bits(x) & 0x7fffffffu;
}

__device__ __forceinline__ unsigned int max_u32(unsigned int a, unsigned int b) {
  return a > b ? a : b;
}

// A lane's part of the root map's words (q8_root_shift): x[0] the largest bit pattern of its
// roots, x[1] the largest complement of the nonzero ones (its smallest nonzero pattern, or 0 for
// none), so that one maximum reduces both.
__device__ __forceinline__ void lane_root_words(float s, unsigned int (&x)[2]) {
  const unsigned int b = magnitude_bits(s);
  x[0] = max_u32(x[0], b);
  x[1] = max_u32(x[1], b == 0u ? 0u : ~b);
}

// The dynamic map's tables (Note [8-bit maps]) for every thread of the block, in shared memory:
// V[mag] and the thresholds of q8_dynamic_code, which fill_dynamic_tables writes (threads
// 0..256, one value each, with q8_dynamic_unit and q8_dynamic_threshold themselves, so the values are
// those of the host's tables bit for bit); they may be read after the next __syncthreads of the
// block. Shared memory, not constant memory: the lanes of a warp read different entries.
struct DynamicTables {
  float unit[128];  // V[mag], mag = 0..127
  float thr[kDynamicThresholds];  // the midpoint below c, c = 0..128 (0 and +inf at the ends)
};
constexpr int kDynamicValues = 128 + kDynamicThresholds;
static_assert(kBlockSize >= kDynamicValues, "one thread per value of the dynamic map's tables");

__device__ __forceinline__ DynamicTables& dynamic_tables() {
  __shared__ DynamicTables tables;
  return tables;
}

__device__ __forceinline__ void fill_dynamic_tables() {
  const int i = static_cast<int>(threadIdx.x);
  DynamicTables& t = dynamic_tables();
  if (i < 128) t.unit[i] = q8_dynamic_unit(i);
  else if (i < kDynamicValues) t.thr[i - 128] = q8_dynamic_threshold(i - 128);
}

}  // namespace cuda
}  // namespace fusedopt
