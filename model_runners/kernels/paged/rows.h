// One task's query rows: which path takes them (RowPaths, attend_rows), the
// log-sum-exp merge of softmax states and the head-size dispatch.
//
// Part of paged_decode.cpp, the one translation unit that includes it: the
// unnamed namespace gives its code the internal linkage it had as one file.
#pragma once

#include "../kv_table.h"
#include "amx_tiles.h"

namespace {

using radixmux::KVTable;
using radixmux::kv_table;

// One query row of a task: its head_dim values (unscaled) and the keys it
// sees, first..last, as indices into the task's key run.
template <typename Q>
struct QueryRow {
  const Q* q;
  int64_t first, last;
};

// Which vector paths attend_rows has for query type Q over K/V of type T,
// head_dim 16 * NV.
template <typename T, typename Q, int NV>
struct RowPaths {
  static constexpr bool fp8 = std::is_same_v<T, c10::Float8_e4m3fn>;
#ifdef RADIXMUX_KEY_VECTORS
  // bfloat16 K/V are tiled for bfloat16 queries only (the pairing models
  // use); float queries over them take the per-key path rather than add a
  // rarely used set of tiled instantiations to the build.
  static constexpr bool tiled = NV > 0 && (!kBf16Dot || !std::is_same_v<T, c10::BFloat16> ||
                                           std::is_same_v<Q, c10::BFloat16>);
  // float8 K/V take the bfloat16 dot products too, each tile's rows
  // widened to bfloat16 first (exactly) and the queries rounded to it.
  static constexpr bool dp =
      kBf16Dot &&
      ((std::is_same_v<T, c10::BFloat16> && std::is_same_v<Q, c10::BFloat16>) || fp8);
#else
  static constexpr bool tiled = false, dp = false;
#endif
  // The AMX path, for the rows the tiled path would take.
  static bool amx() {
#ifdef RADIXMUX_AMX
    return tiled && dp && !fp8 && NV % 2 == 0 && amx_ready();
#else
    return false;
#endif
  }
};

// Softmax state (as attend_state's) of `rows` query rows from anywhere,
// row(r) giving row r, over the keys addr[0:len] of one KV head (kh, vh):
// the tiled path for many rows, the per-key path for few. With `amx_any`
// (extends) every row count takes the AMX path where it applies, so a
// prompt token's result does not depend on how many tokens its chunk has;
// with `det` every row count takes the tiled path (AMX where it applies).
// `resume` (only where can_resume): m, sum and acc hold the rows' state over
// earlier keys, ending at a tile boundary, and the softmax goes on from it.
template <typename T, typename Q, int NV, typename RowFn>
void attend_rows(RowFn&& row, int64_t rows, const T* kh, const T* vh, int64_t row_stride,
                 const int64_t* addr, int64_t len, int64_t dim, float scale, float softcap,
                 Scratch& s, float* m, float* sum, float* acc, bool amx_any = false,
                 bool det = false, PackedKV packed = {}, bool resume = false) {
  using Paths = RowPaths<T, Q, NV>;
  TORCH_CHECK(!resume || (det && Paths::tiled),
              "paged_decode: a softmax state resumes on the tiled and AMX paths only");
#ifdef RADIXMUX_KEY_VECTORS
  if constexpr (Paths::tiled) {
    constexpr bool fp8 = Paths::fp8, dp = Paths::dp;
    const bool amx = Paths::amx();
    // Without AMX, bfloat16 K/V take the tiles' dot products at every row
    // count, plain decodes too: one decode step of SmolLM2's shapes, 30
    // layers, 2 threads, AVX512-BF16 EPYC: 4 x 1,100 keys 9.3 -> 6.2 ms,
    // 16 x 1,100 38.3 -> 25.6 against the per-key path (whose reductions
    // to scalars per key cost more than the lanes padding a row to 16 wastes).
    const bool dot_tiles = dp && !amx;
    if (rows >= kTiledRows || (amx && amx_any) || det || dot_tiles) {
      // Queries transposed, rows in lanes: bfloat16 pairs when both sides are
      // bfloat16 (vdpbf16ps), else floats; padding rows zero and seeing nothing.
      const int64_t rp = (rows + kLanes - 1) / kLanes * kLanes;
      s.first32.assign(static_cast<size_t>(rp), INT32_MAX);
      s.last32.assign(static_cast<size_t>(rp), -1);
      s.qt.assign(static_cast<size_t>((dp ? dim / 2 : dim) * rp), 0.f);
      uint32_t* pairs = reinterpret_cast<uint32_t*>(s.qt.data());  // as wide as a float
      for (int64_t r = 0; r < rows; ++r) {
        const QueryRow<Q> qr = row(r);
        s.first32[r] = static_cast<int32_t>(qr.first);
        s.last32[r] = static_cast<int32_t>(qr.last);
        for (int64_t d = 0; d < dim; d += 2) {
          if constexpr (dp) {
            pairs[d / 2 * rp + r] = static_cast<uint32_t>(c10::BFloat16(qr.q[d]).x) |
                                    static_cast<uint32_t>(c10::BFloat16(qr.q[d + 1]).x) << 16;
          } else {
            s.qt[d * rp + r] = to_float(qr.q[d]);
            s.qt[(d + 1) * rp + r] = to_float(qr.q[d + 1]);
          }
        }
      }
#ifdef RADIXMUX_AMX
      if constexpr (dp && !fp8 && NV % 2 == 0) {
        if (amx) {
          attend_state_amx<NV>(pairs, rows, rp, kh, vh, row_stride, addr, len, s.first32.data(),
                               s.last32.data(), scale, softcap, s, m, sum, acc, packed, resume);
          return;
        }
      }
#endif
      attend_state_tiled<T, NV, dp>(s.qt.data(), rows, rp, kh, vh, row_stride, addr, len,
                                    s.first32.data(), s.last32.data(), scale, softcap, s, m, sum,
                                    acc, resume);
      return;
    }
  }
#endif
  s.qf.resize(static_cast<size_t>(rows * dim));
  s.first.resize(static_cast<size_t>(rows));
  s.last.resize(static_cast<size_t>(rows));
  bool masked = false;
  for (int64_t r = 0; r < rows; ++r) {
    const QueryRow<Q> qr = row(r);
    for (int64_t d = 0; d < dim; ++d) s.qf[r * dim + d] = to_float(qr.q[d]) * scale;
    s.first[r] = qr.first;
    s.last[r] = qr.last;
    masked |= qr.first > 0 || qr.last < len - 1;
  }
  attend_state<T, NV>(s.qf.data(), rows, kh, vh, row_stride, addr, len,
                      masked ? s.first.data() : nullptr, masked ? s.last.data() : nullptr, dim,
                      softcap, s, m, sum, acc);
}

// Folds the state (m2, s2, acc2) of one query row into (m, s, acc): the
// log-sum-exp merge of two softmaxes over disjoint key sets.
inline void merge_state(float& m, float& s, float* acc, float m2, float s2, const float* acc2,
                        int64_t dim) {
  if (s2 == 0.f) return;  // the other part saw no key
  if (s == 0.f) {
    m = m2;
    s = s2;
    std::copy(acc2, acc2 + dim, acc);
    return;
  }
  const float top = std::max(m, m2);
  const float c1 = std::exp(m - top), c2 = std::exp(m2 - top);
  s = s * c1 + s2 * c2;
  for (int64_t d = 0; d < dim; ++d) acc[d] = acc[d] * c1 + acc2[d] * c2;
  m = top;
}

template <typename Q>
inline void write_normalised(const float* acc, float s, int64_t dim, Q* out) {
  const float inv = s > 0.f ? 1.f / s : 0.f;
  int64_t d = 0;
#ifdef __AVX512BF16__
  // Round to nearest even, as the scalar conversion below (which was a
  // tenth of a prefill's attention time, element by element).
  if constexpr (std::is_same_v<Q, c10::BFloat16>) {
    const __m512 scale = _mm512_set1_ps(inv);
    for (; d + 16 <= dim; d += 16) {
      const __m256bh v = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(acc + d), scale));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + d), (__m256i)v);
    }
  }
#endif
  for (; d < dim; ++d) out[d] = static_cast<Q>(acc[d] * inv);
}

// Calls fn(std::integral_constant<int, NV>) for head_dim = 16 * NV: head
// sizes models use get unrolled vector code, others NV = 0 (scalar loops).
template <typename F>
inline void dispatch_dim(int64_t dim, F&& fn) {
  switch (dim) {
    case 16: return fn(std::integral_constant<int, 1>{});
    case 32: return fn(std::integral_constant<int, 2>{});
    case 64: return fn(std::integral_constant<int, 4>{});
    case 80: return fn(std::integral_constant<int, 5>{});
    case 96: return fn(std::integral_constant<int, 6>{});
    case 128: return fn(std::integral_constant<int, 8>{});
    case 256: return fn(std::integral_constant<int, 16>{});
    default: return fn(std::integral_constant<int, 0>{});
  }
}

}  // namespace
