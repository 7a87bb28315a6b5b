// The CPU multi-tensor launcher: chunk table, one parallel region per pass, deterministic
// per-tensor sums of squares. It owns the tables and the threading; the functors in ops.cpp own
// only the arithmetic (which comes from csrc/fusedopt/math.h).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace fusedopt {
namespace cpu {

// Note [chunk partition]: every tensor of a bucket is cut into chunks of kChunk elements counted
// from its first element (the last chunk of a tensor is shorter; a 0-size tensor has none). The
// partition depends only on the tensor sizes, never on the number of threads, and each chunk
// writes its partial sums to its own slot; the partials of a tensor are then added in chunk order
// on one thread. So the norms are bit-identical for any thread count and from run to run.
constexpr int64_t kChunk = 1 << 15;

// Elements staged at a time inside a chunk (in L1-resident buffers) before their squares are
// accumulated; a multiple of kLanes.
constexpr int64_t kBlock = 256;

// Independent double accumulators of SqSum: element k of a chunk always goes to lane k % kLanes.
constexpr int kLanes = 8;

struct Chunk {
  int64_t tensor;  // index of the tensor in the bucket
  int64_t offset;  // first element of the chunk in that tensor
  int64_t len;     // number of elements, 1..kChunk
};

// Sum of squares of the elements of one chunk, fed block by block (every block but the last a
// multiple of kLanes long), accumulated in double in kLanes fixed lanes and reduced in lane order.
// Fixed lanes (rather than one accumulator) let the compiler vectorize without reassociating.
struct SqSum {
  double lane[kLanes] = {};

  template <typename T>
  void add(const T* __restrict__ x, int64_t n) {
    int64_t k = 0;
    for (; k + kLanes <= n; k += kLanes) {
      for (int j = 0; j < kLanes; ++j) {
        const double xj = static_cast<double>(x[k + j]);
        lane[j] += xj * xj;
      }
    }
    for (int j = 0; k + j < n; ++j) {
      const double xj = static_cast<double>(x[k + j]);
      lane[j] += xj * xj;
    }
  }

  double total() const {
    double s = 0.0;
    for (int j = 0; j < kLanes; ++j) s += lane[j];
    return s;
  }
};

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
  int64_t tensor_begin(int64_t i) const { return first_[i]; }  // chunks of tensor i:
  int64_t tensor_end(int64_t i) const { return first_[i + 1]; }  // [begin, end)
  int64_t total_elements() const { return elems_before_.back(); }

  // Runs f(c, chunk) for every chunk c, in ONE parallel region for the whole bucket: each thread
  // takes a contiguous run of chunks holding about total/threads elements (so many small tensors
  // cost one fork/join, not one per tensor). Small buckets run inline without forking.
  template <typename F>
  void parallel_for(const F& f) const {
    const int64_t total = total_elements();
    if (total == 0) return;
    const int64_t slots = std::min<int64_t>(
        std::min<int64_t>(at::get_num_threads(), (total + kChunk - 1) / kChunk), size());
    auto run = [&](int64_t slot_begin, int64_t slot_end) {
      for (int64_t s = slot_begin; s < slot_end; ++s) {
        const int64_t c_end = first_chunk_at(total * (s + 1) / slots);
        for (int64_t c = first_chunk_at(total * s / slots); c < c_end; ++c) f(c, chunks_[c]);
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
    return std::lower_bound(elems_before_.begin(), elems_before_.end() - 1, e) - elems_before_.begin();
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
