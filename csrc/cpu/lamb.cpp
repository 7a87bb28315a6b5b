// LAMB passes 1 and 2 of the CPU backend (kernels.h).
#include "kernels.h"

namespace fusedopt {
namespace cpu {
namespace {

// The random bits of stochastic rounding of one tensor (Note [state formats]): element e of a
// chunk at offset o draws sr_bits(base, first + o + e).
struct SrKey {
  unsigned int base;
  unsigned int first;
};

// The SrKey of each tensor: its key is keys[i], or i without keys.
std::vector<SrKey> sr_keys(const CheckedLists& d, const std::vector<double>& t,
                           const std::optional<at::Tensor>& keys) {
  std::vector<SrKey> out(d.size(), SrKey{0, 0});
  if (!d.low_precision) return out;
  const int64_t* k = nullptr;
  at::Tensor kt;
  if (keys.has_value()) {
    kt = keys->to(at::kCPU, at::kLong).contiguous();
    TORCH_CHECK(kt.numel() == d.size(), kWho, "keys must hold one key per weight (", d.size(),
                "), got ", kt.numel());
    k = kt.const_data_ptr<int64_t>();
  }
  for (int64_t i = 0; i < d.size(); ++i) {
    const int64_t key = k != nullptr ? k[i] : i;
    out[i] = {sr_base(t[i], key), sr_first(key)};
  }
  return out;
}

}  // namespace

at::Tensor run_lamb_pass1(const CheckedLists& d, const std::vector<const void*>& grads,
                          at::ScalarType g_dtype, const LambHyper& h,
                          const std::optional<at::Tensor>& grad_mult,
                          const std::optional<at::Tensor>& keys) {
  return run_pass1(d, grads, g_dtype, [&](auto w_tag, auto g_tag, const std::vector<double>& t) {
    using W = typename decltype(w_tag)::type;
    using G = typename decltype(g_tag)::type;
    using T = ComputeT<W>;
    void* const* mp = d.state_a.data();
    void* const* vp = d.state_b.data();
    return [coef = lamb_coefs<T>(h, t), gm = grad_multiplier<T>(grad_mult), mp, vp,
            sr = sr_keys(d, t, keys), fmt = d.formats.data(), off = d.codes_offset.data()](
               int64_t i, const W* w, const G* g, int64_t o, int64_t len, double* out,
               const Chunk*) FUSEDOPT_INLINE_LAMBDA {
      if constexpr (std::is_same_v<T, float>) {
        if (fmt[i] == kBf16State) {
          return lamb_pass1_chunk_bf16<W, G>(w, g, static_cast<uint16_t*>(mp[i]) + o,
                                             static_cast<uint16_t*>(vp[i]) + o, len, coef[i], gm,
                                             out, sr[i].base, sr[i].first + o);
        }
        if (fmt[i] == k8bitState) {
          return lamb_pass1_chunk_q8<W, G>(w, g, packed<int8_t>(mp[i], off[i]).at(o),
                                           packed<uint8_t>(vp[i], off[i]).at(o), len, coef[i], gm,
                                           out, sr[i].base, sr[i].first + o);
        }
      }
      lamb_pass1_chunk<W, G, T>(w, g, static_cast<T*>(mp[i]) + o, static_cast<T*>(vp[i]) + o, len,
                                coef[i], gm, out);
    };
  });
}

void run_lamb_pass2(const CheckedLists& d, const at::Tensor& sums, const LambHyper& h) {
  const int64_t n = d.size();
  const std::vector<double> t = read_steps(d.steps);
  dispatch_storage(d.weight_dtype, "weights", [&](auto w_tag) {
    using W = typename decltype(w_tag)::type;
    using T = ComputeT<W>;
    dispatch_param_out<W>(!d.params.empty(), d.param_dtype, [&](auto p_tag) {
      using P = typename decltype(p_tag)::type;
      const std::vector<T> s = read_sums<T>(sums, n);
      const std::vector<LambCoef<T>> coef = lamb_coefs<T>(h, t);
      std::vector<T> lr_phi(n);
      for (int64_t i = 0; i < n; ++i) {
        lr_phi[i] = static_cast<T>(h.lr) * lamb_trust_ratio<T>(s[2 * i], s[2 * i + 1], h);
      }
      const T decay = lamb_decay<T>(h, h.lr);
      void* const* wp = d.weights.data();
      void* const* pp = d.params.empty() ? nullptr : d.params.data();
      void* const* mp = d.state_a.data();
      void* const* vp = d.state_b.data();
      const unsigned char* fmt = d.formats.data();
      const int64_t* off = d.codes_offset.data();
      d.table.parallel_for([&](int64_t, const Chunk& ch) FUSEDOPT_INLINE_LAMBDA {
        const int64_t i = ch.tensor, o = ch.offset;
        P* p = pp == nullptr ? nullptr : static_cast<P*>(pp[i]) + o;
        W* w = static_cast<W*>(wp[i]) + o;
        if constexpr (std::is_same_v<T, float>) {
          if (fmt[i] == kBf16State) {
            return lamb_pass2_chunk_bf16<W, P>(w, p, static_cast<const uint16_t*>(mp[i]) + o,
                                               static_cast<const uint16_t*>(vp[i]) + o, ch.len,
                                               coef[i], lr_phi[i], decay);
          }
          if (fmt[i] == k8bitState) {
            return lamb_pass2_chunk_q8<W, P>(w, p, packed<int8_t>(mp[i], off[i]).at(o), ch.len,
                                             coef[i], lr_phi[i], decay);
          }
        }
        lamb_pass2_chunk<W, P, T>(w, p, static_cast<const T*>(mp[i]) + o,
                                  static_cast<const T*>(vp[i]) + o, ch.len, coef[i], lr_phi[i],
                                  decay);
      });
    });
  });
}

}  // namespace cpu
}  // namespace fusedopt
