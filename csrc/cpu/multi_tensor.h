// The CPU multi-tensor launcher: chunk table, one parallel region per pass, deterministic
// per-tensor sums of squares. It owns the tables and the threading; the functors in kernels.h own
// only the arithmetic (which comes from csrc/fusedopt/math.h).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

// Note [ISA clones]: the extension is compiled for the baseline x86-64 ISA (SSE2), so that one
// build runs on every CPU. On x86-64 with GCC or clang the launcher also carries an AVX2 clone and
// an AVX-512 clone (F, VL, BW, DQ; 512-bit vectors) of the chunk loop (target attributes below)
// and picks the widest the CPU has at run time. The chunk functors and the math they call are
// force-inlined into every clone, so each is vectorized for its ISA; out-of-line copies of shared
// inline functions stay baseline (no ODR hazard). The clones give bit-identical results: nothing
// is contracted into an FMA (setup.py builds with -ffp-contract=off, since the AVX-512 target
// implies FMA), every operation is an IEEE-rounded add/mul/div/sqrt in the same order, and the
// reductions use fixed lanes. AVX-512 mostly speeds up the passes that reduce
// (LAMB pass 1 and LARS pass 1; docs/performance.md); division and square root cost the same per
// element at either width.
// FUSEDOPT_CPU_ISA=baseline or =avx2 in the environment caps the clone (for tests).
#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#define FUSEDOPT_ISA_CLONES 1
#define FUSEDOPT_TARGET_AVX2 __attribute__((target("avx2")))
#if defined(__clang__)
#define FUSEDOPT_TARGET_AVX512 __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq")))
#else
#define FUSEDOPT_TARGET_AVX512 \
  __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,prefer-vector-width=512")))
#endif
#endif
#if defined(__GNUC__) || defined(__clang__)
#define FUSEDOPT_INLINE inline __attribute__((always_inline))
#define FUSEDOPT_INLINE_LAMBDA __attribute__((always_inline))
#else
#define FUSEDOPT_INLINE inline
#define FUSEDOPT_INLINE_LAMBDA
#endif

namespace fusedopt {
namespace cpu {

// Note [chunk partition]: every tensor of a bucket is cut into chunks of kChunk elements counted
// from its first element (the last chunk of a tensor is shorter; a 0-size tensor has none). The
// partition depends only on the tensor sizes, never on the number of threads, and each chunk
// writes its partial sums to its own slot; the partials of a tensor are then added in chunk order
// on one thread. So the norms are bit-identical for any thread count and from run to run.
constexpr int64_t kChunk = 1 << 15;

// Per-tensor work (looking at metadata, taking grads) is split among the threads only for lists
// of more than this many tensors; for fewer, a parallel region costs more than it saves.
constexpr int64_t kTensorGrain = 512;

// Elements staged at a time inside a chunk (in L1-resident buffers) before their squares are
// accumulated; the unit of SqSum's fixed blocking.
constexpr int64_t kBlock = 256;

// Fixed accumulation lanes of SqSum: element k of a block always goes to lane k % kLanes.
constexpr int kLanes = 32;

// Note [read-only prefetch]: the passes that only read (LARS pass 1, sq_norms) prefetch each stream
// kPrefetchBytes ahead, one block at a time, across the end of a chunk into the next chunk
// (ChunkTable::next: the next tensor's first bytes; without that each small tensor began with
// 2 KB not prefetched). With no stores to overlap, hardware prefetching alone leaves such passes
// well below the in-place passes' bandwidth. The passes that write full state do not prefetch: it
// slowed them down (docs/performance.md, "Measurements behind the Notes").
// Note [write prefetch]: the LAMB passes over bf16 and 8-bit state do, within the chunk: they
// compute more per byte than the full-state passes, and in the AVX2 clone (whose loop spills to
// the stack) hardware prefetching alone leaves them waiting for memory (docs/performance.md,
// "Low-precision state").
constexpr int64_t kPrefetchBytes = 2048;

// Prefetches (for reading) the cache lines of elements [k, k + kBlock) of x shifted by
// kPrefetchBytes, within the n elements of x; the part of that window past the end of x is taken
// from the start of `next` (the next chunk's elements of the same stream, next_bytes long, or
// nullptr), as if the chunks of a pass were one array (Note [read-only prefetch]).
template <typename S>
FUSEDOPT_INLINE void prefetch_block(const S* x, int64_t k, int64_t n, const void* next,
                                    int64_t next_bytes) {
  const uintptr_t end = reinterpret_cast<uintptr_t>(x + n);
  const uintptr_t first = reinterpret_cast<uintptr_t>(x + k) + kPrefetchBytes;
  const uintptr_t last = first + kBlock * sizeof(S);
  for (uintptr_t a = first; a < last && a < end; a += 64) {
    __builtin_prefetch(reinterpret_cast<const void*>(a), 0, 3);
  }
  if (next != nullptr && last > end) {
    const uintptr_t base = reinterpret_cast<uintptr_t>(next);
    const uintptr_t stop = base + std::min<uintptr_t>(last - end, next_bytes);
    for (uintptr_t a = base + (first > end ? first - end : 0); a < stop; a += 64) {
      __builtin_prefetch(reinterpret_cast<const void*>(a), 0, 3);
    }
  }
}

struct Chunk {
  int64_t tensor;  // index of the tensor in the bucket
  int64_t offset;  // first element of the chunk in that tensor
  int64_t len;     // number of elements, 1..kChunk
};

// Note [blocked sums of squares]: the sum of squares of one chunk, with a fixed association that
// depends only on the element's position in the chunk. The chunk is cut in blocks of kBlock
// elements; within a block, element k adds x*x into lane k % kLanes (float lanes for float32
// compute: at most kBlock / kLanes = 8 terms each; double lanes for float64), each block's lanes
// are added into kLanes double lanes, and total() adds those in lane order. Fixed lanes (rather
// than one accumulator) let the compiler vectorize without reassociating; the short float runs
// keep the cost of float32 math while the error stays that of a few float additions.
// add() may be fed a chunk whole or block by block (every call but the last kBlock long).
struct SqSum {
  double lane[kLanes] = {};

  template <typename S>
  FUSEDOPT_INLINE void add(const S* __restrict__ x, int64_t n) {
    for (int64_t b = 0; b < n; b += kBlock) add_block(x + b, std::min(kBlock, n - b));
  }

  FUSEDOPT_INLINE double total() const {
    double s = 0.0;
    for (int j = 0; j < kLanes; ++j) s += lane[j];
    return s;
  }

 private:
  template <typename S>
  FUSEDOPT_INLINE void add_block(const S* __restrict__ x, int64_t n) {
    // float64 storage is summed in double, every other storage type in float (exact conversions)
    using A = std::conditional_t<std::is_same_v<S, double>, double, float>;
    A acc[kLanes] = {};
    int64_t k = 0;
    for (; k + kLanes <= n; k += kLanes) {
      for (int j = 0; j < kLanes; ++j) {
        const A xj = static_cast<A>(x[k + j]);
        acc[j] += xj * xj;
      }
    }
    for (int j = 0; k + j < n; ++j) {
      const A xj = static_cast<A>(x[k + j]);
      acc[j] += xj * xj;
    }
    for (int j = 0; j < kLanes; ++j) lane[j] += static_cast<double>(acc[j]);
  }
};

// Runs f(c, chunks[c]) for c in [begin, end): the loop of one thread, in each ISA clone (Note [ISA
// clones]); f must be force-inlined (FUSEDOPT_INLINE_LAMBDA) so that it is compiled into each.
template <typename F>
void run_chunks_baseline(const F& f, const Chunk* chunks, int64_t begin, int64_t end) {
  for (int64_t c = begin; c < end; ++c) f(c, chunks[c]);
}

#ifdef FUSEDOPT_ISA_CLONES
template <typename F>
FUSEDOPT_TARGET_AVX2 void run_chunks_avx2(const F& f, const Chunk* chunks, int64_t begin,
                                          int64_t end) {
  for (int64_t c = begin; c < end; ++c) f(c, chunks[c]);
}

template <typename F>
FUSEDOPT_TARGET_AVX512 void run_chunks_avx512(const F& f, const Chunk* chunks, int64_t begin,
                                              int64_t end) {
  for (int64_t c = begin; c < end; ++c) f(c, chunks[c]);
}
#endif

enum class Isa { kBaseline, kAvx2, kAvx512 };

// The clone that runs: the widest the CPU has, capped by FUSEDOPT_CPU_ISA (Note [ISA clones]).
inline Isa cpu_isa() {
#ifdef FUSEDOPT_ISA_CLONES
  static const Isa isa = [] {
    __builtin_cpu_init();
    const bool avx2 = __builtin_cpu_supports("avx2");
    const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512dq");
    const char* cap = std::getenv("FUSEDOPT_CPU_ISA");
    if (cap != nullptr && std::strcmp(cap, "baseline") == 0) return Isa::kBaseline;
    if (cap != nullptr && std::strcmp(cap, "avx2") == 0) return avx2 ? Isa::kAvx2 : Isa::kBaseline;
    return avx512 ? Isa::kAvx512 : (avx2 ? Isa::kAvx2 : Isa::kBaseline);
  }();
  return isa;
#else
  return Isa::kBaseline;
#endif
}

inline const char* cpu_isa_name() {
  switch (cpu_isa()) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "baseline";
  }
}

// The chunks of a list of tensors (see Note [chunk partition]).
class ChunkTable {
 public:
  explicit ChunkTable(const std::vector<int64_t>& numels) : first_(numels.size() + 1, 0) {
    int64_t count = 0;
    for (int64_t n : numels) count += (n + kChunk - 1) / kChunk;
    chunks_.reserve(count);
    elems_before_.reserve(count + 1);
    elems_before_.push_back(0);
    for (size_t i = 0; i < numels.size(); ++i) {
      first_[i] = static_cast<int64_t>(chunks_.size());
      for (int64_t off = 0; off < numels[i]; off += kChunk) {
        const int64_t len = std::min(kChunk, numels[i] - off);
        chunks_.push_back({static_cast<int64_t>(i), off, len});
        elems_before_.push_back(elems_before_.back() + len);
      }
    }
    first_[numels.size()] = static_cast<int64_t>(chunks_.size());
  }

  int64_t size() const { return static_cast<int64_t>(chunks_.size()); }
  // The chunk after chunk c, or nullptr after the last (for prefetching: Note [read-only prefetch]).
  const Chunk* next(int64_t c) const { return c + 1 < size() ? &chunks_[c + 1] : nullptr; }
  int64_t tensor_begin(int64_t i) const { return first_[i]; }  // chunks of tensor i:
  int64_t tensor_end(int64_t i) const { return first_[i + 1]; }  // [begin, end)
  int64_t total_elements() const { return elems_before_.back(); }

  // Runs f(c, chunk) for every chunk c (f force-inlined, see run_chunks_baseline), in the ISA
  // clone that cpu_isa() chose, in ONE parallel region for the whole bucket: each thread takes a
  // contiguous run of chunks holding about total/threads elements (so many small tensors cost
  // one fork/join, not one per tensor). Buckets of at most kChunk elements run inline without
  // forking.
  template <typename F>
  void parallel_for(const F& f) const {
    const int64_t total = total_elements();
    if (total == 0) return;
    const int64_t slots = std::min<int64_t>(
        std::min<int64_t>(at::get_num_threads(), (total + kChunk - 1) / kChunk), size());
    auto run = [&](int64_t slot_begin, int64_t slot_end) {
      for (int64_t s = slot_begin; s < slot_end; ++s) {
        const int64_t begin = first_chunk_at(total * s / slots);
        const int64_t end = first_chunk_at(total * (s + 1) / slots);
#ifdef FUSEDOPT_ISA_CLONES
        switch (cpu_isa()) {
          case Isa::kAvx512: run_chunks_avx512(f, chunks_.data(), begin, end); continue;
          case Isa::kAvx2: run_chunks_avx2(f, chunks_.data(), begin, end); continue;
          default: break;
        }
#endif
        run_chunks_baseline(f, chunks_.data(), begin, end);
      }
    };
    if (slots <= 1) {
      run(0, 1);
    } else {
      at::parallel_for(0, slots, 1, run);
    }
  }

 private:
  // The first chunk that starts at or after element e of the concatenated bucket.
  int64_t first_chunk_at(int64_t e) const {
    const auto first = elems_before_.begin();
    return std::lower_bound(first, elems_before_.end() - 1, e) - first;
  }

  std::vector<Chunk> chunks_;
  std::vector<int64_t> first_;         // n + 1 entries
  std::vector<int64_t> elems_before_;  // chunks + 1 entries: prefix sums of the chunk lengths
};

// Per-tensor sums of the per-chunk partials partial[c * K + k], added in chunk order (Note [chunk
// partition]) and written to out[i * K + k] for the n tensors of the table.
template <typename T, int K>
void reduce_partials(const ChunkTable& table, const std::vector<double>& partial, T* out,
                     int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    for (int k = 0; k < K; ++k) {
      double s = 0.0;
      for (int64_t c = table.tensor_begin(i); c < table.tensor_end(i); ++c) s += partial[c * K + k];
      out[i * K + k] = static_cast<T>(s);
    }
  }
}

}  // namespace cpu
}  // namespace fusedopt
