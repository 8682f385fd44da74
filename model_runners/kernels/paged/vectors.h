// Vector primitives of the paged attention kernel: K/V rows to float, prefetch,
// the per-key path's vector ops (16 floats with AVX-512, 8 with AVX2) and its
// row kernels (one key row against a KV head's query rows), and walk_keys.
//
// Part of paged_decode.cpp, the one translation unit that includes it: the
// unnamed namespace gives its code the internal linkage it had as one file.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <string>
#include <climits>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "../amx.h"
#include "../to_float.h"
#include "../vec_exp.h"

namespace {

using radixmux::to_float;

template <typename T>
inline void row_to_float(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

// Rows ahead to prefetch, and every line of a row's head slice: the per-key
// path is bound by how many misses are in flight, and asking for only the
// first line of each slice 8 rows ahead left the second line (head_dim 64 in
// bfloat16 is two lines) to miss on use (decode attention of 16 x 530 tokens,
// SmolLM2, 30 layers: 16.4-17.6 -> 12.4-13.4 ms; 4 x 1,100: 8.9-9.0 -> 6.5-6.8).
// Into L2 far ahead, then into L1 near: L1 prefetches hold a fill buffer
// each until their line arrives, so 32 rows of them ahead (two lines a row)
// stalled the core on full buffers, and the nearer L1 requests now mostly
// hit L2. Decode attention over distinct 1,100-token contexts, 30 layers,
// 2 threads (bench_decode_attention --parts decode), L1 at 32 rows against
// L2 at 64 and L1 at 8: 64 sequences 93.3-98.8 -> 86.6-87.0 ms a step, 4
// sequences 5.3-5.8 -> 4.8-4.9, 16 22.0-23.4 -> 21.9-22.5.
constexpr int64_t kPrefetchL2 = 64;
constexpr int64_t kPrefetchL1 = 8;

// Every cache line of `bytes` from p (one head's slice of a K or V row), into
// L1 (Locality 3) or L2 (2).
template <int Locality = 3>
inline void prefetch_slice(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(c + b, 0, Locality);
}

// exp(-80) = 2e-35: a weight that small changes no sum it joins (the
// largest weight of a row is 1), and clamping exponents there keeps glibc's
// vector exp on its fast path (a lane that underflows sends the whole
// vector through a scalar slow path).
constexpr float kMinExponent = -80.f;

#ifdef __AVX512F__
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// 16 float8 e4m3 values as floats, exactly (to_float's rule in 32-bit lanes).
inline __m512 load16(const c10::Float8_e4m3fn* p) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i em = _mm512_and_si512(b, _mm512_set1_epi32(0x7f));
  const __m512i normal = _mm512_add_epi32(_mm512_slli_epi32(em, 20), _mm512_set1_epi32(120 << 23));
  const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(em), _mm512_set1_ps(0.001953125f));
  const __mmask16 is_normal = _mm512_test_epi32_mask(b, _mm512_set1_epi32(0x78));
  const __m512i mag = _mm512_mask_blend_epi32(is_normal, _mm512_castps_si512(sub), normal);
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
  return _mm512_castsi512_ps(_mm512_or_si512(mag, sign));
}
#endif

#ifdef __AVX512BF16__
// n float8 e4m3 values as bfloat16, exactly (every e4m3 value is a bfloat16
// one): a normal value's exponent moves to bfloat16's bias; a subnormal one
// (m * 2^-9, m < 8) comes from a table of the eight.
inline void fp8_to_bf16(const c10::Float8_e4m3fn* src, c10::BFloat16* dst, int64_t n) {
  alignas(64) static constexpr uint16_t kSub[32] = {
      0, 118 << 7, 119 << 7, (119 << 7) | 0x40, 120 << 7, (120 << 7) | 0x20, (120 << 7) | 0x40,
      (120 << 7) | 0x60};
  const __m512i table = _mm512_load_si512(kSub);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
    const __m512i em = _mm512_and_si512(b, _mm512_set1_epi16(0x7f));
    const __m512i normal = _mm512_add_epi16(_mm512_slli_epi16(em, 4), _mm512_set1_epi16(120 << 7));
    const __m512i sub = _mm512_permutexvar_epi16(em, table);  // em < 8 where it is used
    const __mmask32 is_normal = _mm512_test_epi16_mask(b, _mm512_set1_epi16(0x78));
    const __m512i mag = _mm512_mask_blend_epi16(is_normal, sub, normal);
    const __m512i sign = _mm512_slli_epi16(_mm512_and_si512(b, _mm512_set1_epi16(0x80)), 8);
    _mm512_storeu_si512(dst + i, _mm512_or_si512(mag, sign));
  }
  for (; i < n; ++i) dst[i] = c10::BFloat16(to_float(src[i]));
}
#endif

// ---- the per-key path's vectors: 16 floats with AVX-512, 8 with AVX2 -----------------------
// The per-key helpers below are written once over these; without either ISA
// the scalar loops after them run (auto-vectorised at best: on an AVX2 CPU
// that left decode attention at a third of the memory bandwidth).
#if defined(__AVX512F__)
#define RADIXMUX_KEY_VECTORS 1
using vfloat = __m512;
constexpr int kLanes = 16;
template <typename T>
inline vfloat vload(const T* p) { return load16(p); }
inline vfloat vmul(vfloat a, vfloat b) { return _mm512_mul_ps(a, b); }
inline vfloat vadd(vfloat a, vfloat b) { return _mm512_add_ps(a, b); }
inline vfloat vsub(vfloat a, vfloat b) { return _mm512_sub_ps(a, b); }
inline vfloat vmax(vfloat a, vfloat b) { return _mm512_max_ps(a, b); }
inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm512_fmadd_ps(a, b, c); }
inline vfloat vset1(float x) { return _mm512_set1_ps(x); }
inline vfloat vzero() { return _mm512_setzero_ps(); }
inline void vstore(float* p, vfloat v) { _mm512_storeu_ps(p, v); }
inline float vsum(vfloat v) { return _mm512_reduce_add_ps(v); }
// The four lane sums of a, b, c, d in one vector: one reduction tree for four
// dot products instead of four.
inline __m128 fold128(__m512 x) {
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1));
  const __m256 y = _mm256_add_ps(_mm512_castps512_ps256(x), hi);
  return _mm_add_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1));
}
inline __m128 vsum4(vfloat a, vfloat b, vfloat c, vfloat d) {
  const __m128 ab = _mm_hadd_ps(fold128(a), fold128(b));
  const __m128 cd = _mm_hadd_ps(fold128(c), fold128(d));
  return _mm_hadd_ps(ab, cd);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define RADIXMUX_KEY_VECTORS 1
using vfloat = __m256;
constexpr int kLanes = 8;
inline vfloat vload(const float* p) { return _mm256_loadu_ps(p); }
inline vfloat vload(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline vfloat vload(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline vfloat vload(const c10::Float8_e4m3fn* p) {  // load16's rule, 8 lanes
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i em = _mm256_and_si256(b, _mm256_set1_epi32(0x7f));
  const __m256i normal = _mm256_add_epi32(_mm256_slli_epi32(em, 20), _mm256_set1_epi32(120 << 23));
  const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(em), _mm256_set1_ps(0.001953125f));
  const __m256i is_sub = _mm256_cmpeq_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x78)),
                                            _mm256_setzero_si256());
  const __m256i mag = _mm256_blendv_epi8(normal, _mm256_castps_si256(sub), is_sub);
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
  return _mm256_castsi256_ps(_mm256_or_si256(mag, sign));
}
inline vfloat vmul(vfloat a, vfloat b) { return _mm256_mul_ps(a, b); }
inline vfloat vadd(vfloat a, vfloat b) { return _mm256_add_ps(a, b); }
inline vfloat vsub(vfloat a, vfloat b) { return _mm256_sub_ps(a, b); }
inline vfloat vmax(vfloat a, vfloat b) { return _mm256_max_ps(a, b); }
inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm256_fmadd_ps(a, b, c); }
inline vfloat vset1(float x) { return _mm256_set1_ps(x); }
inline vfloat vzero() { return _mm256_setzero_ps(); }
inline void vstore(float* p, vfloat v) { _mm256_storeu_ps(p, v); }
inline float vsum(vfloat v) {
  const __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 y = _mm_hadd_ps(x, x);
  return _mm_cvtss_f32(_mm_hadd_ps(y, y));
}
inline __m128 vsum4(vfloat a, vfloat b, vfloat c, vfloat d) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}
#endif

#ifdef RADIXMUX_KEY_VECTORS
// A head of NV * 16 floats is kVecs<NV> vectors.
template <int NV>
constexpr int kVecs = NV * 16 / kLanes;

// q.k for every query head of the group against one K row.
template <typename T, int NV>
inline void row_scores(const float* qf, const T* k, int64_t group, float* out, int64_t stride) {
  constexpr int W = kVecs<NV>;
  vfloat kv[W];
  for (int c = 0; c < W; ++c) kv[c] = vload(k + kLanes * c);
  for (int64_t g = 0; g < group; ++g) {
    const float* qg = qf + g * NV * 16;
    vfloat acc = vmul(vload(qg), kv[0]);
    for (int c = 1; c < W; ++c) acc = vfma(vload(qg + kLanes * c), kv[c], acc);
    out[g * stride] = vsum(acc);
  }
}

// Scores of four K rows at once (head_dim <= 64: the rows stay in registers
// with AVX-512; AVX2's sixteen spill some, to L1); out[g * stride + 0..3] are
// adjacent in the [group, len] score table.
template <typename T, int NV>
inline void four_row_scores(const float* qf, const T* const* rows, int64_t group, float* out,
                            int64_t stride) {
  constexpr int W = kVecs<NV>;
  vfloat kv[4][W];
  for (int t = 0; t < 4; ++t)
    for (int c = 0; c < W; ++c) kv[t][c] = vload(rows[t] + kLanes * c);
  for (int64_t g = 0; g < group; ++g) {
    const float* qg = qf + g * NV * 16;
    vfloat acc[4];
    for (int t = 0; t < 4; ++t) acc[t] = vzero();
    for (int c = 0; c < W; ++c) {
      const vfloat qc = vload(qg + kLanes * c);
      for (int t = 0; t < 4; ++t) acc[t] = vfma(qc, kv[t][c], acc[t]);
    }
    _mm_storeu_ps(out + g * stride, vsum4(acc[0], acc[1], acc[2], acc[3]));
  }
}

// acc[g] += p[g] * v for every query head of the group.
template <typename T, int NV>
inline void row_accumulate(const T* v, const float* p, int64_t stride, int64_t group, float* acc) {
  constexpr int W = kVecs<NV>;
  vfloat vv[W];
  for (int c = 0; c < W; ++c) vv[c] = vload(v + kLanes * c);
  for (int64_t g = 0; g < group; ++g) {
    const vfloat pg = vset1(p[g * stride]);
    float* ag = acc + g * NV * 16;
    for (int c = 0; c < W; ++c) vstore(ag + kLanes * c, vfma(pg, vv[c], vload(ag + kLanes * c)));
  }
}

// acc[g] += sum_t p[g][t] * v_t over four V rows at once, so each accumulator
// row is loaded and stored once per four keys instead of once per key;
// p[g * stride + 0..3] are adjacent.
template <typename T, int NV>
inline void four_row_accumulate(const T* const* rows, const float* p, int64_t stride,
                                int64_t group, float* acc) {
  constexpr int W = kVecs<NV>;
  vfloat vv[4][W];
  for (int t = 0; t < 4; ++t)
    for (int c = 0; c < W; ++c) vv[t][c] = vload(rows[t] + kLanes * c);
  for (int64_t g = 0; g < group; ++g) {
    const float* pg = p + g * stride;
    vfloat pt[4];
    for (int t = 0; t < 4; ++t) pt[t] = vset1(pg[t]);
    float* ag = acc + g * NV * 16;
    for (int c = 0; c < W; ++c) {
      vfloat a = vload(ag + kLanes * c);
      for (int t = 0; t < 4; ++t) a = vfma(pt[t], vv[t][c], a);
      vstore(ag + kLanes * c, a);
    }
  }
}
#endif

template <typename T>
inline void row_scores_any(const float* qf, const T* k, int64_t group, int64_t dim, float* row,
                           float* out, int64_t stride) {
  row_to_float(k, row, dim);
  for (int64_t g = 0; g < group; ++g) {
    const float* qg = qf + g * dim;
    float s = 0.f;
    for (int64_t d = 0; d < dim; ++d) s += qg[d] * row[d];
    out[g * stride] = s;
  }
}

template <typename T>
inline void row_accumulate_any(const T* v, const float* p, int64_t stride, int64_t group,
                               int64_t dim, float* row, float* acc) {
  row_to_float(v, row, dim);
  for (int64_t g = 0; g < group; ++g) {
    float* ag = acc + g * dim;
    const float pg = p[g * stride];
    for (int64_t d = 0; d < dim; ++d) ag[d] += pg * row[d];
  }
}

// Keys [j, j + count) prefetched ahead of their use: into L2 kPrefetchL2 keys
// ahead, into L1 kPrefetchL1 ahead (none past the run's `len` keys). Forced
// inline, as prefetch_tile: a function of prefetches alone looks free of
// side effects to gcc, which then drops its calls (decode attention ran as
// without any prefetch, 64 x 1,100: 87 -> 146 ms a step).
template <typename T>
__attribute__((always_inline)) inline void prefetch_keys_ahead(const T* base, const int64_t* addr, int64_t j, int64_t count,
                                int64_t len, int64_t row_stride, int64_t slice_bytes) {
  for (int64_t t = j + kPrefetchL2; t < std::min(j + kPrefetchL2 + count, len); ++t)
    prefetch_slice<2>(base + addr[t] * row_stride, slice_bytes);
  for (int64_t t = j + kPrefetchL1; t < std::min(j + kPrefetchL1 + count, len); ++t)
    prefetch_slice(base + addr[t] * row_stride, slice_bytes);
}

// attend_state's two passes (K rows into scores, V rows into acc) walk the
// keys alike and differ only in what they do with a row: four(rows, j) takes
// keys j..j + 3 where a head fits the registers four rows at a time (NV <= 4),
// one(row, j) the others, each key prefetched ahead (prefetch_keys_ahead).
template <int NV, typename T, typename Four, typename One>
inline void walk_keys(const T* base, const int64_t* addr, int64_t len, int64_t row_stride,
                      int64_t slice_bytes, Four&& four, One&& one) {
  int64_t j = 0;
#ifdef RADIXMUX_KEY_VECTORS
  if constexpr (NV > 0 && NV <= 4) {
    for (; j + 4 <= len; j += 4) {
      prefetch_keys_ahead(base, addr, j, 4, len, row_stride, slice_bytes);
      const T* rows[4];
      for (int t = 0; t < 4; ++t) rows[t] = base + addr[j + t] * row_stride;
      four(rows, j);
    }
  }
#endif
  for (; j < len; ++j) {
    prefetch_keys_ahead(base, addr, j, 1, len, row_stride, slice_bytes);
    one(base + addr[j] * row_stride, j);
  }
}

}  // namespace
