// Fused element-wise layers of a decoder block: RMSNorm (alone or after the
// residual add), activation-and-multiply of a gated MLP, and rotary position
// embedding.
//
// transformers writes each of these as a chain of small torch ops (RMSNorm is
// six: cast, pow, mean, add, rsqrt, mul, mul, cast). On a CPU every op is a
// dispatch (a few microseconds, which dominates a decode step's non-matmul
// time) and, at prefill sizes, a full pass over a tensor larger than the
// caches. Each function here is one pass that reproduces the eager chain's
// roundings: wherever transformers rounds an intermediate to the model's dtype
// (bfloat16 or float16), the kernel rounds it too (round to nearest even), so
// results match eager to the last bit except where transformers' own
// reductions or exp order its float sums differently.
//
// Registered in torch.ops.radixmux next to the attention kernels; see
// fused_ops.py, which swaps them in for modules whose code is the eager chain.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

// The library builds with -ffast-math, which lets gcc contract a*b + c into one
// fused multiply-add: one rounding where eager has two. Here every rounding is
// the point, so this file keeps products and sums apart.
#pragma GCC optimize("fp-contract=off")

#include "bf16_round.h"
#include "to_float.h"

namespace {

template <typename T>
inline float load(T x) { return radixmux::to_float(x); }

// Round a float to T, as storing an intermediate tensor of dtype T would.
template <typename T>
inline T store(float v);
template <>
inline float store<float>(float v) { return v; }
template <>
inline c10::BFloat16 store<c10::BFloat16>(float v) {
  // Round to nearest even by integer arithmetic (vectorises; inputs are finite).
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  c10::BFloat16 out;
  out.x = static_cast<uint16_t>(bits >> 16);
  return out;
}
template <>
inline c10::Half store<c10::Half>(float v) { return c10::Half(v); }

template <typename T>
inline float round_to(float v) { return load(store<T>(v)); }

// Rows per parallel task: small batches (decode) stay on one thread, where
// waking the others would cost more than the work.
inline int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(row_elems, 1)); }

template <typename F>
void dispatch(const at::Tensor& t, const char* what, F&& fn) {
  switch (t.scalar_type()) {
    case at::kFloat: fn(float{}); break;
    case at::kBFloat16: fn(c10::BFloat16{}); break;
    case at::kHalf: fn(c10::Half{}); break;
    default: TORCH_CHECK(false, what, ": dtype ", t.scalar_type(), " not supported");
  }
}

#ifdef __AVX512F__
// Floats rounded to bfloat16 (nearest even, as store), as 32-bit lanes.
using radixmux::round16;

// 16 bfloat16s as floats (the lanes of `mask` only: a row's tail; others 0),
// stored rounded, and round_to in lanes.
inline __mmask16 lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1);
}
inline __m512 load16(const c10::BFloat16* p, __mmask16 mask = 0xffff) {
  const __m256i h = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline void store16(c10::BFloat16* p, __m512 v, __mmask16 mask) {
  _mm256_mask_storeu_epi16(p, mask, _mm512_cvtepi32_epi16(round16(v)));
}
inline __m512 round_to16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(round16(v), 16));
}
#endif

// ---- RMSNorm --------------------------------------------------------------------------
// Llama-style (gemma=false):  w * (x * rsqrt(mean(x^2) + eps)).to(T)   (two roundings)
// Gemma-style (gemma=true):   (x * rsqrt(mean(x^2) + eps) * (1 + w)).to(T)   (one)
template <typename T>
void rms_norm_rows(const T* x, const T* w, T* y, int64_t rows, int64_t dim, float eps,
                   bool gemma, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    const T* xr = x + r * dim;
    T* yr = y + r * dim;
    float sq = 0.f;
    for (int64_t i = 0; i < dim; ++i) {
      const float v = load(xr[i]);
      sq += v * v;
    }
    const float inv = 1.f / std::sqrt(sq / static_cast<float>(dim) + eps);
    if (gemma) {
      for (int64_t i = 0; i < dim; ++i) yr[i] = store<T>(load(xr[i]) * inv * (1.f + load(w[i])));
    } else {
      for (int64_t i = 0; i < dim; ++i)
        yr[i] = store<T>(load(w[i]) * round_to<T>(load(xr[i]) * inv));
    }
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool gemma) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "rms_norm: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm: x is ", x.scalar_type(),
              ", weight ", weight.scalar_type());
  const int64_t dim = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == dim, "rms_norm: weight of ",
              weight.numel(), " for rows of ", dim);
  at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor y = at::empty_like(xc);
  const int64_t rows = dim ? xc.numel() / dim : 0;
  dispatch(x, "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = xc.data_ptr<T>();
    const T* wp = wc.data_ptr<T>();
    T* yp = y.data_ptr<T>();
    at::parallel_for(0, rows, grain(dim), [&](int64_t b, int64_t e) {
      rms_norm_rows<T>(xp, wp, yp, rows, dim, static_cast<float>(eps), gemma, b, e);
    });
  });
  return y;
}

// ---- residual add, then RMSNorm ------------------------------------------------------
// (x + delta).to(T) and its RMSNorm in one pass over each row: eager's
// ``h = residual + out; norm(h)``, two ops and two passes over the activations.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta,
                                                const at::Tensor& weight, double eps, bool gemma) {
  TORCH_CHECK(x.sizes() == delta.sizes() && x.scalar_type() == delta.scalar_type(),
              "add_rms_norm: x is ", x.sizes(), " ", x.scalar_type(), ", delta ", delta.sizes(),
              " ", delta.scalar_type());
  TORCH_CHECK(x.device().is_cpu() && delta.device().is_cpu() && weight.device().is_cpu(),
              "add_rms_norm: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "add_rms_norm: x is ", x.scalar_type(),
              ", weight ", weight.scalar_type());
  const int64_t dim = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == dim, "add_rms_norm: weight of ",
              weight.numel(), " for rows of ", dim);
  at::Tensor xc = x.contiguous(), dc = delta.contiguous(), wc = weight.contiguous();
  at::Tensor sum = at::empty_like(xc), y = at::empty_like(xc);
  const int64_t rows = dim ? xc.numel() / dim : 0;
  dispatch(x, "add_rms_norm", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = xc.data_ptr<T>();
    const T* dp = dc.data_ptr<T>();
    const T* wp = wc.data_ptr<T>();
    T* sp = sum.data_ptr<T>();
    T* yp = y.data_ptr<T>();
    at::parallel_for(0, rows, grain(dim), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        for (int64_t i = r * dim; i < (r + 1) * dim; ++i)
          sp[i] = store<T>(load(xp[i]) + load(dp[i]));
        rms_norm_rows<T>(sp, wp, yp, rows, dim, static_cast<float>(eps), gemma, r, r + 1);
      }
    });
  });
  return {sum, y};
}

// ---- activation and multiply ----------------------------------------------------------
// act(gate).to(T) * up, rounded: the eager ``act_fn(gate_proj(x)) * up_proj(x)`` with
// gate and up side by side in one [rows, 2 * inter] tensor (one fused projection).
enum Act : int64_t { kSilu = 0, kGeluTanh = 1 };

inline float activate(float g, int64_t act) {
  if (act == kSilu) return g / (1.f + std::exp(-g));
  const float inner = 0.7978845608028654f * (g + 0.044715f * g * g * g);  // sqrt(2/pi)
  return 0.5f * g * (1.f + std::tanh(inner));
}

#ifdef __AVX512F__
// table[g] * u, rounded, 16 lanes at a time: table holds act(g).to(bf16) for
// every bfloat16 bit pattern g, computed by eager's own activation (its exp
// and tanh, whose last float bit decides a bf16 rounding near a tie), so the
// product is eager's to the bit, without an exp per element (bf16_round.h).
inline int64_t table_act_mul16(const c10::BFloat16* g, const c10::BFloat16* u,
                               const uint16_t* table, c10::BFloat16* o, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i idx =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + i)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i),
                        radixmux::table_act_mul(idx, load16(u + i), table));
  }
  return i;
}
#endif

at::Tensor act_and_mul(const at::Tensor& gate_up, int64_t act,
                       const std::optional<at::Tensor>& table) {
  TORCH_CHECK(gate_up.device().is_cpu(), "act_and_mul: CPU tensors only");
  TORCH_CHECK(act == kSilu || act == kGeluTanh, "act_and_mul: unknown activation ", act);
  const bool tabled = table.has_value() && gate_up.scalar_type() == at::kBFloat16;
  TORCH_CHECK(!tabled || (table->scalar_type() == at::kShort && table->is_contiguous() &&
                          table->numel() == 65537),
              "act_and_mul: the table must be 65,537 contiguous int16 (every bf16, one spare)");
  const uint16_t* tp =
      tabled ? reinterpret_cast<const uint16_t*>(table->data_ptr<int16_t>()) : nullptr;
  const int64_t width = gate_up.size(-1);
  TORCH_CHECK(width % 2 == 0, "act_and_mul: last dimension ", width, " is not even");
  const int64_t inter = width / 2;
  at::Tensor gu = gate_up.contiguous();
  std::vector<int64_t> shape(gu.sizes().begin(), gu.sizes().end());
  shape.back() = inter;
  at::Tensor out = at::empty(shape, gu.options());
  const int64_t rows = inter ? out.numel() / inter : 0;
  dispatch(gu, "act_and_mul", [&](auto tag) {
    using T = decltype(tag);
    const T* src = gu.data_ptr<T>();
    T* dst = out.data_ptr<T>();
    at::parallel_for(0, rows, grain(width), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const T* g = src + r * width;
        const T* u = g + inter;
        T* o = dst + r * inter;
        int64_t i = 0;
        if constexpr (std::is_same_v<T, c10::BFloat16>) {
          if (tp) {
#ifdef __AVX512F__
            i = table_act_mul16(g, u, tp, o, inter);
#endif
            for (; i < inter; ++i) {
              c10::BFloat16 a;
              a.x = tp[g[i].x];
              o[i] = store<T>(load(a) * load(u[i]));
            }
          }
        }
        for (; i < inter; ++i)
          o[i] = store<T>(round_to<T>(activate(load(g[i]), act)) * load(u[i]));
      }
    });
  });
  return out;
}

// ---- rotary position embedding --------------------------------------------------------
// x * cos + rotate_half(x) * sin, each product and the sum rounded to T as eager
// does; rotate_half(x) = cat(-x[D/2:], x[:D/2]). x is [tokens, heads, head_dim]
// with any strides but a unit last one; cos and sin are [tokens, head_dim].
// The result is contiguous [tokens, heads, head_dim].
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu(), "rotary: CPU tensors only");
  TORCH_CHECK(x.dim() == 3, "rotary: x must be [tokens, heads, head_dim]");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  TORCH_CHECK(dim % 2 == 0, "rotary: odd head_dim ", dim);
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == tokens &&
                  cos.size(1) == dim,
              "rotary: cos/sin must be [tokens, head_dim]");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rotary: cos/sin dtype differs from x");
  at::Tensor xs = x.stride(2) == 1 ? x : x.contiguous();
  at::Tensor cc = cos.contiguous(), sc = sin.contiguous();
  at::Tensor out = at::empty({tokens, heads, dim}, x.options());
  const int64_t st = xs.stride(0), sh = xs.stride(1), half = dim / 2;
  dispatch(x, "rotary", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = xs.data_ptr<T>();
    const T* cp = cc.data_ptr<T>();
    const T* sp = sc.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, tokens * heads, grain(dim), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const int64_t t = r / heads, h = r % heads;
        const T* xr = xp + t * st + h * sh;
        const T* c = cp + t * dim;
        const T* s = sp + t * dim;
        T* o = op + r * dim;
#ifdef __AVX512F__
        if constexpr (std::is_same_v<T, c10::BFloat16>) {
          // Negation by the sign bit, as eager's -x (a zero keeps its sign).
          const __m512 sign = _mm512_set1_ps(-0.f);
          for (int64_t i = 0; i < half; i += 16) {
            const __mmask16 m = lanes(half - i);
            const __m512 lo = load16(xr + i, m), hi = load16(xr + half + i, m);
            const __m512 c0 = load16(c + i, m), c1 = load16(c + half + i, m);
            const __m512 s0 = load16(s + i, m), s1 = load16(s + half + i, m);
            const __m512 a0 = round_to16(_mm512_mul_ps(lo, c0));
            const __m512 b0 = round_to16(_mm512_mul_ps(_mm512_xor_ps(hi, sign), s0));
            const __m512 a1 = round_to16(_mm512_mul_ps(hi, c1));
            const __m512 b1 = round_to16(_mm512_mul_ps(lo, s1));
            store16(o + i, _mm512_add_ps(a0, b0), m);
            store16(o + half + i, _mm512_add_ps(a1, b1), m);
          }
          continue;
        }
#endif
        for (int64_t i = 0; i < half; ++i) {
          const float a = round_to<T>(load(xr[i]) * load(c[i]));
          const float bb = round_to<T>(-load(xr[i + half]) * load(s[i]));
          o[i] = store<T>(a + bb);
        }
        for (int64_t i = half; i < dim; ++i) {
          const float a = round_to<T>(load(xr[i]) * load(c[i]));
          const float bb = round_to<T>(load(xr[i - half]) * load(s[i]));
          o[i] = store<T>(a + bb);
        }
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixmux, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, bool gemma) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor weight, float eps, bool gemma) -> (Tensor, Tensor)");
  m.def("act_and_mul(Tensor gate_up, int act, Tensor? table=None) -> Tensor");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixmux, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("act_and_mul", &act_and_mul);
  m.impl("rotary", &rotary);
}
