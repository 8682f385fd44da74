// Decode attention that reads K/V straight out of the paged arena.
//
// One query token per sequence attends over its context slots, wherever they
// sit in the arena: each K/V row is read once, converted to float in
// registers and used for all the query heads that share its KV head (GQA).
// The torch fallback first gathers every context into a dense tensor (a copy
// as large as the KV itself, every layer, every step) and then runs SDPA over
// that copy; this kernel skips the copy.
//
// Shared-prefix ("cascade") decode: sequences whose contexts begin with the
// same cached rows (same slots in the radix tree) form a group; the group's
// prefix K/V rows are read once for all its members' query heads, and each
// member's own suffix is attended separately. Both give unnormalised softmax
// states (running max, sum of exponentials, weighted sum of V) that merge
// exactly by log-sum-exp, so a step reads the shared prefix once per group
// instead of once per member.
//
// Registered as torch.ops.radixmux.paged_decode and
// torch.ops.radixmux.paged_decode_cascade; see paged_decode.py.

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

#include "amx.h"
#include "to_float.h"
#include "vec_exp.h"

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

// Buffers one thread reuses across its tasks.
struct Scratch {
  std::vector<float> scores, qf, qt, state, row, kf, vf, rowstate;
  std::vector<c10::BFloat16> k16, v16;  // a tile's float8 K and V rows as bfloat16
  std::vector<int64_t> first, last;
  std::vector<int32_t> first32, last32;
};

// Softmax state of `rows` query rows qf [rows, dim] (scaled) over the keys
// addr[0:len], unnormalised so that states over disjoint key runs merge
// exactly: m[r] the largest score, s[r] the sum of exp(score - m[r]), acc[r]
// the sum of exp(score - m[r]) * v. Row r sees keys first[r]..last[r] (null
// arrays: all of them); a row that sees none gets s = 0 and acc = 0.
// NV > 0: head_dim is NV vectors of 16.
// (Not inlined, nor is attend_state_tiled: they are large, run once per
// task, and inlining them into every caller only lengthens the build.)
template <typename T, int NV>
__attribute__((noinline)) void attend_state(const float* qf, int64_t rows, const T* k_base,
                                            const T* v_base, int64_t row_stride,
                                            const int64_t* addr, int64_t len,
                                            const int64_t* first, const int64_t* last,
                                            int64_t dim, float softcap, Scratch& sc, float* m,
                                            float* s, float* acc) {
  // scores is [rows, len]: the softmax runs over contiguous rows.
  sc.scores.resize(static_cast<size_t>(rows * len));
  sc.row.resize(static_cast<size_t>(dim));
  float* scores = sc.scores.data();
  float* row = sc.row.data();  // scratch row (scalar path)
  const int64_t slice_bytes = dim * static_cast<int64_t>(sizeof(T));
  // The four-row lambdas take `auto` rows so that they are instantiated only
  // for the head sizes walk_keys calls them with.
  walk_keys<NV>(
      k_base, addr, len, row_stride, slice_bytes,
      [&](auto ks, int64_t j) {
#ifdef RADIXMUX_KEY_VECTORS
        four_row_scores<T, NV>(qf, ks, rows, scores + j, len);
#endif
      },
      [&](const T* k, int64_t j) {
#ifdef RADIXMUX_KEY_VECTORS
        if constexpr (NV > 0) return row_scores<T, NV>(qf, k, rows, scores + j, len);
#endif
        row_scores_any<T>(qf, k, rows, dim, row, scores + j, len);
      });
  if (softcap > 0.f) {
    for (int64_t i = 0; i < rows * len; ++i) scores[i] = std::tanh(scores[i] / softcap) * softcap;
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = scores + r * len;
    const int64_t f = first ? first[r] : 0, l = last ? std::min(last[r] + 1, len) : len;
    float mr = -FLT_MAX;
    for (int64_t k = f; k < l; ++k) mr = std::max(mr, sr[k]);
    float t = 0.f;
    for (int64_t k = f; k < l; ++k) {
      sr[k] = std::exp(std::max(sr[k] - mr, kMinExponent));
      t += sr[k];
    }
    // Keys the row must not see weigh exactly nothing.
    std::fill(sr, sr + std::min(f, len), 0.f);
    if (l > f) std::fill(sr + l, sr + len, 0.f);
    else std::fill(sr, sr + len, 0.f);
    m[r] = mr;
    s[r] = t;
  }
  std::fill(acc, acc + rows * dim, 0.f);
  walk_keys<NV>(
      v_base, addr, len, row_stride, slice_bytes,
      [&](auto vs, int64_t j) {
#ifdef RADIXMUX_KEY_VECTORS
        four_row_accumulate<T, NV>(vs, scores + j, len, rows, acc);
#endif
      },
      [&](const T* v, int64_t j) {
#ifdef RADIXMUX_KEY_VECTORS
        if constexpr (NV > 0) return row_accumulate<T, NV>(v, scores + j, len, rows, acc);
#endif
        row_accumulate_any<T>(v, scores + j, len, rows, dim, row, acc);
      });
}

// Deterministic (batch-invariant) mode, asked per call: every query row,
// decode or extend, takes the one tiled path, over key tiles aligned to
// absolute context positions (kAlignKeys), decodes uncut, and a group's
// shared prefix (cut at kAlignKeys) a state its members resume rather than
// merge, so a row's result depends only on its own query and keys: not on its
// batch, its chunk, its group, or whether its prefix was cached.
// Key runs start at a multiple of kAlignKeys there: the tiled path's kTile
// and the AMX path's step (kAmxKeys) both divide it.
constexpr int64_t kAlignKeys = 128;
inline int64_t aligned_begin(int64_t begin, bool det) {
  return det ? begin / kAlignKeys * kAlignKeys : begin;
}
// The AMX path's keys per step (a multiple of 32); the extend packs'
// layout (PackLayout) is in these steps on every build.
constexpr int64_t kAmxKeys = 128;

#ifdef RADIXMUX_KEY_VECTORS
// ---- many query rows at once: register-blocked tiles --------------------------------------
// When one key is scored against many query rows (a group's shared prefix)
// the per-key loops above spend most of their time reducing vectors to
// scalars and reloading accumulators. Here the query rows lie in the vector
// lanes instead: the queries are transposed once per task (rows padded to a
// multiple of the lanes, `rp`: 16, or 8 with AVX2), scores come out as
// st [keys, rp] from broadcast multiply-adds, the softmax runs online (per
// tile, across rows in lanes), and P.V accumulates into registers that stay
// put for a whole tile.

// Keys per tile: its K and V rows as floats stay in L1 (16 KB at head_dim 64).
constexpr int64_t kTile = 32;
// Fewest query rows for the tiled path: fewer leave too many lanes idle.
// With AVX2 the per-key path holds out longer (cascade decodes over 1,000
// shared + 100 own float32 keys, SmolLM2's shapes, 30 layers, 2 threads, a
// Zen 3 EPYC: groups of 4 sequences, 12 rows, 30.6 ms a step per key against
// 43.8 tiled; groups of 16, 48 rows, 24.3 against 25.1), while extends'
// 96-row blocks gain (bench_decode_attention --parts extend: 1.1-2.3x SDPA).
#ifdef __AVX512F__
constexpr int64_t kTiledRows = 12;
#else
constexpr int64_t kTiledRows = 64;
#endif
// Keys scored per block, and accumulator vectors held in registers: AVX-512's
// 32 registers take 8 keys x 2 row vectors of scores and a whole head row of
// P.V for up to 24 / NV rows; AVX2's 16 take 4 keys x 2 and 12 accumulators,
// P.V's head row in turns of at most 4 vectors (kColsAtOnce). The order of
// every sum is the same either way: key by key, per row and element.
// Tiles of K and V asked for ahead. With AVX2, one tile ahead left a few
// rows' work (a decode in deterministic mode: 3 rows a KV head) waiting on
// memory: --deterministic decodes of 16 float32 contexts of 1,100 keys,
// SmolLM2's shapes, 30 layers, Zen 3: 120-122 ms a step at one tile ahead,
// 106 at two, 106-124 at three, 121-141 at four (the default arithmetic: 81-93).
#ifdef __AVX512F__
constexpr int64_t kTilesAhead = 1;
#else
constexpr int64_t kTilesAhead = 2;
#endif
#ifdef __AVX512F__
constexpr int kScoreKeys = 8;
constexpr int kAccRegs = 24;
template <int W>
constexpr int kColsAtOnce = W;
#else
constexpr int kScoreKeys = 4;
constexpr int kAccRegs = 12;
template <int W>
constexpr int kColsAtOnce = W % 4 == 0 ? 4 : W % 2 == 0 ? 2 : 1;
#endif
#ifdef __AVX512BF16__
constexpr bool kBf16Dot = true;
#else
constexpr bool kBf16Dot = false;
#endif

// Calls block(std::integral_constant<int, B>, i) over i0..n-1 in blocks of
// B = KB, then of halved B for the remainder: every count is covered by a
// few unrolled block sizes.
template <int KB, typename F>
inline void blocks_of(int64_t i0, int64_t n, F&& block) {
  for (; i0 + KB <= n; i0 += KB) block(std::integral_constant<int, KB>{}, i0);
  if constexpr (KB > 1) {
    if (i0 < n) blocks_of<KB / 2>(i0, n, block);
  }
}

template <typename T, int NV>
inline void rows_to_float(const T* base, const int64_t* addr, int64_t row_stride, int64_t n,
                          float* dst) {
  for (int64_t j = 0; j < n; ++j) {
    const T* src = base + addr[j] * row_stride;
    for (int c = 0; c < kVecs<NV>; ++c)
      vstore(dst + j * NV * 16 + c * kLanes, vload(src + kLanes * c));
  }
}

// Asks for every cache line of the K, then the V, head slices (bytes long)
// of the tile of keys j0 .. min(j0 + n, len) - 1 ahead of use, into L2: a
// tile's worth of requests at once would fill L1's miss buffers and stall
// the core. Always inlined: called out of line, GCC 12 (modref) finds that
// it has no side effects, prefetches having none it can see, and deletes
// the call.
template <typename T>
__attribute__((always_inline)) inline void prefetch_tile(const T* k_base, const T* v_base,
                                                         int64_t row_stride, const int64_t* addr,
                                                         int64_t j0, int64_t n, int64_t len,
                                                         int64_t bytes) {
  const int64_t end = std::min(j0 + n, len);
  for (int64_t j = j0; j < end; ++j) prefetch_slice<2>(k_base + addr[j] * row_stride, bytes);
  for (int64_t j = j0; j < end; ++j) prefetch_slice<2>(v_base + addr[j] * row_stride, bytes);
}

// The tiles' two products (scores, P.V) are each one loop nest over a lane
// type L: FloatLanes, one float per 32-bit lane and an FMA per step, or, with
// AVX512-BF16, Bf16PairLanes, a bfloat16 pair per lane and vdpbf16ps per
// step (two multiply-adds per lane per instruction; bfloat16 products are
// exact in float, so its scores are as accurate as the float path's).
struct FloatLanes {
  using Elem = float;  // one lane of an operand row
  using Vec = vfloat;
  using Keys = const float*;  // a block's keys: float rows [KB, dim]
  static constexpr int kPer = 1;  // values per lane
  template <int NV>
  static Elem key(Keys kf, int k, int d) { return kf[k * NV * 16 + d]; }
  static Vec load(const Elem* p) { return vload(p); }
  static Vec broadcast(Elem x) { return vset1(x); }
  static vfloat madd(vfloat acc, Vec a, Vec b) { return vfma(a, b, acc); }
};

#ifdef __AVX512BF16__
struct Bf16PairLanes {
  using Elem = uint32_t;
  using Vec = __m512bh;
  using Keys = const c10::BFloat16* const*;  // a block's key rows, read in place
  static constexpr int kPer = 2;
  template <int NV>
  static Elem key(Keys keys, int k, int d) {
    uint32_t pair;
    std::memcpy(&pair, keys[k] + 2 * d, sizeof(pair));
    return pair;
  }
  static Vec load(const Elem* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static Vec broadcast(Elem x) { return (__m512bh)_mm512_set1_epi32(static_cast<int>(x)); }
  static __m512 madd(__m512 acc, Vec a, Vec b) { return _mm512_dpbf16_ps(acc, a, b); }
};
#endif

// st[k, kLanes * RV lanes] = q . k_k for KB keys and queries qt [dim /
// L::kPer, rp]: per step d, RV loads and KB broadcasts of lane d of key k into
// KB * RV accumulators.
template <typename L, int NV, int KB, int RV>
inline void score_block(const typename L::Elem* qt, int64_t rp, typename L::Keys keys, float* st) {
  vfloat acc[KB][RV];
  for (int k = 0; k < KB; ++k)
    for (int v = 0; v < RV; ++v) acc[k][v] = vzero();
  for (int d = 0; d < NV * 16 / L::kPer; ++d) {
    typename L::Vec qv[RV];
    for (int v = 0; v < RV; ++v) qv[v] = L::load(qt + d * rp + kLanes * v);
    for (int k = 0; k < KB; ++k) {
      const typename L::Vec kb = L::broadcast(L::template key<NV>(keys, k, d));
      for (int v = 0; v < RV; ++v) acc[k][v] = L::madd(acc[k][v], qv[v], kb);
    }
  }
  for (int k = 0; k < KB; ++k)
    for (int v = 0; v < RV; ++v) vstore(st + k * rp + kLanes * v, acc[k][v]);
}

#ifdef __AVX512BF16__
// P.V for bfloat16 V the same way: keys go in pairs, V rows interleaved lane
// by lane and the weights rounded to bfloat16 pairs, half the instructions
// of float FMAs. torch's own CPU attention rounds the weights to bfloat16 for
// its P.V as well.
alignas(64) constexpr uint16_t kInterleave32[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                                    37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                                    11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
alignas(64) constexpr uint16_t kInterleave16[32] = {0,  16, 1,  17, 2,  18, 3,  19, 4,  20, 5,
                                                    21, 6,  22, 7,  23, 8,  24, 9,  25, 10, 26,
                                                    11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

// dst[c][d] = (a[16c + d], b[16c + d]) as one 32-bit lane (b null: zeros).
template <int NV>
inline void interleave_rows(const c10::BFloat16* a, const c10::BFloat16* b, uint32_t* dst) {
  const __m512i idx = _mm512_load_si512(kInterleave32);
  for (int c = 0; c < NV; ++c) {
    const __m512i x = _mm512_castsi256_si512(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 16 * c)));
    const __m512i y = b ? _mm512_castsi256_si512(_mm256_loadu_si256(
                              reinterpret_cast<const __m256i*>(b + 16 * c)))
                        : _mm512_setzero_si512();
    _mm512_storeu_si512(dst + 16 * c, _mm512_permutex2var_epi16(x, idx, y));
  }
}

// Rows' weights of two keys (pb null: the second is absent) as bfloat16
// pairs: dst[r] = (pa[r], pb[r]) for rp rows.
inline void pair_weights(const float* pa, const float* pb, int64_t rp, uint32_t* dst) {
  const __m512i idx = _mm512_load_si512(kInterleave16);
  for (int64_t r = 0; r < rp; r += 16) {
    const __m512 b = pb ? _mm512_loadu_ps(pb + r) : _mm512_setzero_ps();
    const __m512bh both = _mm512_cvtne2ps_pbh(b, _mm512_loadu_ps(pa + r));
    _mm512_storeu_si512(dst + r, _mm512_permutexvar_epi16(idx, (__m512i)both));
  }
}
#endif

// acc[r0 + i] = acc[r0 + i] * rescale[r0 + i] + sum_k pt[k, r0 + i] * v_k for
// RB rows: the accumulators stay in registers for the whole tile (for each
// turn of kColsAtOnce vectors of the head row). A step k is one key
// (FloatLanes: pt [n, rp], vt [n, dim] floats) or a key pair (Bf16PairLanes:
// pt and vt from pair_weights and interleave_rows).
template <typename L, int NV, int RB>
inline void accumulate_block(const typename L::Elem* pt, int64_t rp, const typename L::Elem* vt,
                             int64_t steps, const float* rescale, int64_t r0, float* acc) {
  constexpr int W = kVecs<NV>, CW = kColsAtOnce<W>;
  for (int c0 = 0; c0 < W; c0 += CW) {
    vfloat a[RB][CW];
    for (int i = 0; i < RB; ++i) {
      const vfloat c = vset1(rescale[r0 + i]);
      for (int v = 0; v < CW; ++v)
        a[i][v] = vmul(c, vload(acc + (r0 + i) * NV * 16 + (c0 + v) * kLanes));
    }
    for (int64_t k = 0; k < steps; ++k) {
      const typename L::Elem* pk = pt + k * rp + r0;
      for (int v = 0; v < CW; ++v) {
        const typename L::Vec vv = L::load(vt + (k * W + c0 + v) * kLanes);
        for (int i = 0; i < RB; ++i) a[i][v] = L::madd(a[i][v], L::broadcast(pk[i]), vv);
      }
    }
    for (int i = 0; i < RB; ++i)
      for (int v = 0; v < CW; ++v) vstore(acc + (r0 + i) * NV * 16 + (c0 + v) * kLanes, a[i][v]);
  }
}

// e^x for the softmax: x in [kMinExponent, 0] (vec_exp.h).
#ifdef __AVX512F__
inline vfloat exp_nonpositive(vfloat x) { return radixmux::exp16(x); }
#else
inline vfloat exp_nonpositive(vfloat x) { return radixmux::exp8(x); }
#endif

// The softmax's lane masks of visible keys: AVX-512's mask registers, or
// AVX2's vectors of all-ones lanes.
#ifdef __AVX512F__
using vmask = __mmask16;
inline vmask all_lanes() { return 0xffff; }
// Lanes r whose rows see key j: first[r] <= j <= last[r].
inline vmask lanes_seeing(int32_t j, const int32_t* first, const int32_t* last) {
  const __m512i jv = _mm512_set1_epi32(j);
  return _mm512_cmp_epi32_mask(jv, _mm512_loadu_si512(first), _MM_CMPINT_NLT) &
         _mm512_cmp_epi32_mask(jv, _mm512_loadu_si512(last), _MM_CMPINT_LE);
}
// max(t, x) in the lanes of m, t in the others.
inline vfloat vmax_where(vfloat t, vmask m, vfloat x) { return _mm512_mask_max_ps(t, m, t, x); }
// x in the lanes of m, 0 in the others.
inline vfloat vkeep(vmask m, vfloat x) { return _mm512_maskz_mov_ps(m, x); }
#else
using vmask = __m256;
inline vmask all_lanes() { return _mm256_castsi256_ps(_mm256_set1_epi32(-1)); }
inline vmask lanes_seeing(int32_t j, const int32_t* first, const int32_t* last) {
  const __m256i jv = _mm256_set1_epi32(j);
  const __m256i f = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(first));
  const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(last));
  const __m256i hidden = _mm256_or_si256(_mm256_cmpgt_epi32(f, jv), _mm256_cmpgt_epi32(jv, l));
  return _mm256_castsi256_ps(_mm256_xor_si256(hidden, _mm256_set1_epi32(-1)));
}
inline vfloat vmax_where(vfloat t, vmask m, vfloat x) {
  return _mm256_blendv_ps(t, _mm256_max_ps(t, x), m);
}
inline vfloat vkeep(vmask m, vfloat x) { return _mm256_and_ps(m, x); }

// ---- few query rows on AVX2: the keys in the lanes ------------------------------------------
// A decode in deterministic mode has a KV head's few query rows (3 for
// SmolLM2, 4 for Gemma 3 or Llama 3 8B) in 8 lanes: score_block spends a
// broadcast and an FMA per key and input for 3 useful lanes of 8. With at
// most kFewRows rows the tile's K rows go transposed instead (kt [dim,
// kTile]: 8x8 blocks in registers), and a row's scores of 16 keys come from
// two loads and two FMAs per input, each (row, key) the same FMA chain over
// the inputs from zero as score_block's: the same bits.
constexpr int64_t kFewRows = 4;

// r[i] lane j <- r[j] lane i.
inline void transpose8(__m256 r[8]) {
  __m256 t[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  __m256 u[8];
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

// kt [dim, kTile]: the K rows of keys addr[0 .. n) as floats, transposed
// (keys past n: zeros, never read).
template <typename T, int NV>
inline void keys_to_lanes(const T* base, const int64_t* addr, int64_t row_stride, int64_t n,
                          float* kt) {
  constexpr int64_t dim = NV * 16;
  for (int64_t k0 = 0; k0 < kTile; k0 += 8) {
    const T* rows[8];
    for (int i = 0; i < 8; ++i) rows[i] = k0 + i < n ? base + addr[k0 + i] * row_stride : nullptr;
    for (int64_t d = 0; d < dim; d += 8) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i) r[i] = rows[i] ? vload(rows[i] + d) : vzero();
      transpose8(r);
      for (int i = 0; i < 8; ++i) vstore(kt + (d + i) * kTile + k0, r[i]);
    }
  }
}

// st [n, rp] = scores of the R query rows of qt [dim, rp] against kt's keys
// (padding lanes 0).
template <int NV, int R>
inline void score_few_rows(const float* qt, int64_t rp, const float* kt, int64_t n, float* st) {
  constexpr int64_t dim = NV * 16;
  alignas(32) float out[R][kTile];
  for (int64_t h = 0; h < kTile; h += 16) {
    vfloat acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = vzero();
    for (int64_t d = 0; d < dim; ++d) {
      const vfloat k0 = vload(kt + d * kTile + h), k1 = vload(kt + d * kTile + h + 8);
      for (int r = 0; r < R; ++r) {
        const vfloat q = vset1(qt[d * rp + r]);
        acc[r][0] = vfma(q, k0, acc[r][0]);
        acc[r][1] = vfma(q, k1, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      vstore(out[r] + h, acc[r][0]);
      vstore(out[r] + h + 8, acc[r][1]);
    }
  }
  for (int64_t k = 0; k < n; ++k)
    for (int64_t r = 0; r < rp; ++r) st[k * rp + r] = r < R ? out[r][k] : 0.f;
}
#endif

// One tile of the online softmax over st [n, rp], kLanes rows per vector: scale
// (and soft-cap) the scores, raise each row's running max m over the tile's
// visible keys (j0 + k in [first[r], last[r]]; every key when !masked),
// rescale its sum s, leave in rescale[r] the factor its accumulator needs,
// and turn the scores into weights (exactly 0 for keys a row must not see):
// in st as floats, or, given p2, as bfloat16 pairs p2 [pairs, rp] of keys
// (2k, 2k + 1) for k < pairs (zeros past n), st keeping the scaled scores.
// Maxima and sums run as four interleaved chains (keys k mod 4): a single
// chain waits on each add's latency; the order is fixed, so a row's result
// still depends only on its own scores. Never inlined: -ffast-math lets GCC
// reassociate the sums differently in each place it is compiled, and a
// caller inlining it would change the weights in the last bit.
__attribute__((noinline)) void softmax_tile(float* st, int64_t n, int64_t rp, int64_t j0,
                                            bool masked, const int32_t* first,
                                            const int32_t* last, float scale, float softcap,
                                            float* m, float* s, float* rescale,
                                            uint32_t* p2 = nullptr, int64_t pairs = 0) {
  if (softcap > 0.f) {  // vectorised through the vector math library's tanh
    const float inner = scale / softcap;
    for (int64_t i = 0; i < n * rp; ++i) st[i] = std::tanh(st[i] * inner) * softcap;
    scale = 1.f;
  }
  const vfloat sc = vset1(scale), floor = vset1(kMinExponent);
  for (int64_t r = 0; r < rp; r += kLanes) {
    auto seen = [&](int64_t k) -> vmask {
      if (!masked) return all_lanes();
      return lanes_seeing(static_cast<int32_t>(j0 + k), first + r, last + r);
    };
    auto score = [&](int64_t k) { return vmul(vload(st + k * rp + r), sc); };
    const vfloat old_max = vload(m + r);
    // Named chains, not an array indexed by k & 3: that one lived on the
    // stack, each step waiting on a store-to-load forward.
    vfloat t0 = old_max, t1 = old_max, t2 = old_max, t3 = old_max;
    auto raise = [&](vfloat& t, int64_t k) { t = vmax_where(t, seen(k), score(k)); };
    int64_t k4 = 0;
    for (; k4 + 4 <= n; k4 += 4) {
      raise(t0, k4);
      raise(t1, k4 + 1);
      raise(t2, k4 + 2);
      raise(t3, k4 + 3);
    }
    if (k4 < n) raise(t0, k4);
    if (k4 + 1 < n) raise(t1, k4 + 1);
    if (k4 + 2 < n) raise(t2, k4 + 2);
    const vfloat top = vmax(vmax(t0, t1), vmax(t2, t3));
    // Both -FLT_MAX (nothing seen yet): factor 1 on a zero sum.
    const vfloat c = exp_nonpositive(vmax(vsub(old_max, top), floor));
    // Key k's weight joins chain k mod 4 (named, as for the maxima).
    vfloat s0 = vzero(), s1 = s0, s2 = s0, s3 = s0;
    auto weight = [&](int64_t k, vfloat& part) {
      if (k >= n) return vzero();
      const vfloat p = vkeep(seen(k), exp_nonpositive(vmax(vsub(score(k), top), floor)));
      part = vadd(part, p);
      return p;
    };
#ifdef __AVX512BF16__
    if (p2) {
      const __m512i interleave = _mm512_load_si512(kInterleave16);
      auto store_pair = [&](int64_t k, __m512 a, __m512 b) {
        const __m512bh both = _mm512_cvtne2ps_pbh(b, a);
        _mm512_storeu_si512(p2 + k * rp + r, _mm512_permutexvar_epi16(interleave, (__m512i)both));
      };
      // Pair k holds keys 2k and 2k + 1: chains 0 and 1 for even k, 2 and 3 for odd.
      int64_t k = 0;
      for (; k + 2 <= pairs; k += 2) {
        const __m512 a = weight(2 * k, s0), b = weight(2 * k + 1, s1);
        store_pair(k, a, b);
        const __m512 c = weight(2 * k + 2, s2), d = weight(2 * k + 3, s3);
        store_pair(k + 1, c, d);
      }
      if (k < pairs) {
        const __m512 a = weight(2 * k, s0), b = weight(2 * k + 1, s1);
        store_pair(k, a, b);
      }
    } else
#endif
    {
      int64_t k = 0;
      for (; k + 4 <= n; k += 4) {
        vstore(st + k * rp + r, weight(k, s0));
        vstore(st + (k + 1) * rp + r, weight(k + 1, s1));
        vstore(st + (k + 2) * rp + r, weight(k + 2, s2));
        vstore(st + (k + 3) * rp + r, weight(k + 3, s3));
      }
      if (k < n) vstore(st + k * rp + r, weight(k, s0));
      if (k + 1 < n) vstore(st + (k + 1) * rp + r, weight(k + 1, s1));
      if (k + 2 < n) vstore(st + (k + 2) * rp + r, weight(k + 2, s2));
    }
    const vfloat sum = vadd(vadd(s0, s1), vadd(s2, s3));
    vstore(m + r, top);
    vstore(s + r, vadd(vmul(vload(s + r), c), sum));
    vstore(rescale + r, c);
  }
}

// attend_state for many rows: the same contract, but the queries come
// transposed and unscaled (qt: [dim, rp] floats, or [dim / 2, rp] bfloat16
// pairs when DP; padding rows zero), and row r sees keys first[r]..last[r]
// (padding rows see none). Padding rows' weights are never read. With
// `resume`, m, s and acc come in holding the rows' state over earlier keys,
// and the online softmax goes on from it: a state left at a tile boundary and
// resumed gives the same bits as one pass over both runs of keys.
template <typename T, int NV, bool DP>
__attribute__((noinline)) void attend_state_tiled(const void* qt, int64_t rows, int64_t rp,
                                                  const T* k_base, const T* v_base,
                                                  int64_t row_stride, const int64_t* addr,
                                                  int64_t len, const int32_t* first,
                                                  const int32_t* last, float scale, float softcap,
                                                  Scratch& sc, float* m, float* s, float* acc,
                                                  bool resume) {
  constexpr int64_t dim = NV * 16;
  constexpr int RB = std::max(1, std::min(8, kAccRegs / kColsAtOnce<kVecs<NV>>));  // acc rows
  sc.kf.resize(static_cast<size_t>(std::max(kTile * dim, kTile / 2 * rp)));  // or P pairs
  sc.vf.resize(kTile * dim);
  sc.scores.resize(static_cast<size_t>(kTile * rp));
  sc.rowstate.resize(static_cast<size_t>(3 * rp));
  float *kf = sc.kf.data(), *vf = sc.vf.data(), *st = sc.scores.data();
  float *mr = sc.rowstate.data(), *sr = mr + rp, *rescale = sr + rp;
  std::fill(mr, mr + rp, -FLT_MAX);
  std::fill(sr, sr + rp, 0.f);
  if (resume) {
    std::copy(m, m + rows, mr);
    std::copy(s, s + rows, sr);
  } else {
    std::fill(acc, acc + rows * dim, 0.f);
  }
  // Tiles inside [first_all, last_all] are seen whole by every row: no masks.
  const int32_t first_all = *std::max_element(first, first + rows);
  const int32_t last_all = *std::min_element(last, last + rows);
  const int64_t bytes = dim * static_cast<int64_t>(sizeof(T));
  constexpr bool fp8 = std::is_same_v<T, c10::Float8_e4m3fn>;
  if constexpr (fp8) {
    sc.k16.resize(kTile * dim);
    sc.v16.resize(kTile * dim);
  }
  prefetch_tile(k_base, v_base, row_stride, addr, 0, kTilesAhead * kTile, len, bytes);
  for (int64_t j0 = 0; j0 < len; j0 += kTile) {
    const int64_t n = std::min(kTile, len - j0);
    // Later tiles' K and V arrive while this one is computed.
    prefetch_tile(k_base, v_base, row_stride, addr, j0 + kTilesAhead * kTile, kTile, len, bytes);
    auto score_rows = [&](auto rv, int64_t v) {
      constexpr int RV = decltype(rv)::value;
      // Blocks of kScoreKeys keys, a piece's last few one by one (two block
      // shapes compile in half the time of a halving series, for a rare tail).
      auto block = [&](auto kb, int64_t k0) {
        constexpr int KB = decltype(kb)::value;
#ifdef __AVX512BF16__
        if constexpr (DP) {
          const c10::BFloat16* keys[KB];
          for (int k = 0; k < KB; ++k) {
            if constexpr (fp8) keys[k] = sc.k16.data() + (k0 + k) * dim;
            else keys[k] = k_base + addr[j0 + k0 + k] * row_stride;
          }
          score_block<Bf16PairLanes, NV, KB, RV>(static_cast<const uint32_t*>(qt) + v, rp, keys,
                                                 st + k0 * rp + v);
          return;
        }
#endif
        score_block<FloatLanes, NV, KB, RV>(static_cast<const float*>(qt) + v, rp, kf + k0 * dim,
                                            st + k0 * rp + v);
      };
      int64_t k0 = 0;
      for (; k0 + kScoreKeys <= n; k0 += kScoreKeys)
        block(std::integral_constant<int, kScoreKeys>{}, k0);
      for (; k0 < n; ++k0) block(std::integral_constant<int, 1>{}, k0);
    };
#ifndef __AVX512F__
    const bool few = rows <= kFewRows;  // the keys in the lanes (AVX2 only)
#else
    constexpr bool few = false;
#endif
    if (few) {
#ifndef __AVX512F__
      keys_to_lanes<T, NV>(k_base, addr + j0, row_stride, n, kf);
      const float* q = static_cast<const float*>(qt);
      if (rows == 1) score_few_rows<NV, 1>(q, rp, kf, n, st);
      else if (rows == 2) score_few_rows<NV, 2>(q, rp, kf, n, st);
      else if (rows == 3) score_few_rows<NV, 3>(q, rp, kf, n, st);
      else score_few_rows<NV, 4>(q, rp, kf, n, st);
#endif
    } else {
      if constexpr (!DP) rows_to_float<T, NV>(k_base, addr + j0, row_stride, n, kf);
#ifdef __AVX512BF16__
      if constexpr (DP && fp8) {
        for (int64_t k = 0; k < n; ++k) {
          fp8_to_bf16(k_base + addr[j0 + k] * row_stride, sc.k16.data() + k * dim, dim);
          fp8_to_bf16(v_base + addr[j0 + k] * row_stride, sc.v16.data() + k * dim, dim);
        }
      }
#endif
      int64_t v = 0;
      for (; v + 2 * kLanes <= rp; v += 2 * kLanes) score_rows(std::integral_constant<int, 2>{}, v);
      if (v < rp) score_rows(std::integral_constant<int, 1>{}, v);
    }
    const bool masked = j0 < first_all || j0 + n - 1 > last_all;
    softmax_tile(st, n, rp, j0, masked, first, last, scale, softcap, mr, sr, rescale);
#ifdef __AVX512BF16__
    if constexpr (std::is_same_v<T, c10::BFloat16> || (DP && fp8)) {
      uint32_t* v2 = reinterpret_cast<uint32_t*>(vf);  // [pairs, dim]: as many bytes as vf
      uint32_t* p2 = reinterpret_cast<uint32_t*>(kf);  // [pairs, rp]
      const int64_t pairs = (n + 1) / 2;
      auto v_row = [&](int64_t k) -> const c10::BFloat16* {
        if constexpr (fp8) return sc.v16.data() + k * dim;
        else return v_base + addr[j0 + k] * row_stride;
      };
      for (int64_t k = 0; k < pairs; ++k) {
        const bool two = 2 * k + 1 < n;
        interleave_rows<NV>(v_row(2 * k), two ? v_row(2 * k + 1) : nullptr, v2 + k * dim);
        pair_weights(st + 2 * k * rp, two ? st + (2 * k + 1) * rp : nullptr, rp, p2 + k * rp);
      }
      blocks_of<RB>(0, rows, [&](auto rb, int64_t r0) {
        accumulate_block<Bf16PairLanes, NV, decltype(rb)::value>(p2, rp, v2, pairs, rescale, r0,
                                                                 acc);
      });
      continue;
    }
#endif
    rows_to_float<T, NV>(v_base, addr + j0, row_stride, n, vf);
    blocks_of<RB>(0, rows, [&](auto rb, int64_t r0) {
      accumulate_block<FloatLanes, NV, decltype(rb)::value>(st, rp, vf, n, rescale, r0, acc);
    });
  }
  std::copy(mr, mr + rows, m);
  std::copy(sr, sr + rows, s);
}
#endif

// One KV head's keys of one sequence, gathered and packed once for all the
// tasks (query blocks) that read them: K rows [steps * kAmxKeys, dim] and
// V^T [steps][dim, kAmxKeys / 2], per step of kAmxKeys keys from the first
// key. A long prompt's blocks each read most of its keys: packed per task,
// a key was gathered and repacked once per block after it.
struct PackedKV {
  const uint16_t* k = nullptr;
  const uint32_t* vt = nullptr;
};

#ifdef RADIXMUX_AMX
// ---- many query rows on AMX tiles (bfloat16 K/V and queries) ---------------------------
// attend_state_tiled's contract and order of work with both products on AMX
// (tdpbf16ps: bfloat16 pairs into float accumulators, 16 x 16 x 32 per
// instruction). The scores come out transposed, S^T = K . Q^T, with the K
// rows gathered into whole tiles and the queries as the same bfloat16 pairs
// qt [dim / 2, rp], so softmax_tile runs on them unchanged (rows in lanes);
// its weights go back as pairs P^T [keys / 2, rp] (rounded to bfloat16, as
// the tiled path and torch's CPU attention round them) and O^T += V^T . P^T
// accumulates in acc_t [dim, rp], rescaled lane by lane. Key tiles start at
// fixed offsets from the first key and each output element is a per-row sum
// in a fixed order, so a row's result does not depend on which other rows
// share its task (a prompt's tokens come out the same computed whole or over
// its cached prefix).

// dst[j * ldd + i] = src[i * lds + j] for a 16 x 16 block of 32-bit values.
inline void transpose16(const uint32_t* src, int64_t lds, uint32_t* dst, int64_t ldd) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + i * lds);
  for (int i = 0; i < 16; i += 2) {  // per 128-bit lane: a0 b0 a1 b1 | a2 b2 a3 b3
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // r[i + c], lane L: rows i..i+3 of column 4L + c
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // column 4L + c: lane L of r[c], r[4 + c], r[8 + c], r[12 + c]
    const __m512i u0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44);
    const __m512i u1 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
    const __m512i u2 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
    const __m512i u3 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
    _mm512_storeu_si512(dst + (0 + c) * ldd, _mm512_shuffle_i32x4(u0, u1, 0x88));
    _mm512_storeu_si512(dst + (4 + c) * ldd, _mm512_shuffle_i32x4(u0, u1, 0xDD));
    _mm512_storeu_si512(dst + (8 + c) * ldd, _mm512_shuffle_i32x4(u2, u3, 0x88));
    _mm512_storeu_si512(dst + (12 + c) * ldd, _mm512_shuffle_i32x4(u2, u3, 0xDD));
  }
}

// Whether this process may use AMX tiles (asked once).
inline bool amx_ready() { return radixmux::request_amx(); }

// C (+)= A . B over one row of 32 x 32 blocks: both of attend_state_amx's
// products (S^T = K . Q^T, O^T += V^T . P^T) are this loop nest. A is 32 rows
// of `steps` 64-byte chunks of bfloat16 pairs, lda bytes apart; B [16 * steps,
// 16 * groups] pairs and C [32, 16 * groups] floats have rows of rp lanes. C
// starts from zero, or with Accumulate from what it holds. Tiles: 0-3 C,
// 4-5 A, 6-7 B (all 16 x 64 bytes).
template <bool Accumulate>
inline void amx_block_row(const void* a, int64_t lda, int64_t steps, const uint32_t* b, float* c,
                          int64_t rp, int64_t groups) {
  const int64_t ld = rp * 4;  // bytes per row of B and C
  const char* a0 = static_cast<const char*>(a);
  const char* a1 = a0 + 16 * lda;
  for (int64_t g = 0; g < groups; g += 2) {
    const bool two = g + 1 < groups;
    float* c0 = c + 16 * g;
    float* c1 = c0 + 16 * rp;
    if constexpr (Accumulate) {
      _tile_loadd(0, c0, ld);
      _tile_loadd(1, c1, ld);
      if (two) {
        _tile_loadd(2, c0 + 16, ld);
        _tile_loadd(3, c1 + 16, ld);
      }
    } else {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int64_t k = 0; k < steps; ++k) {
      const uint32_t* bk = b + 16 * k * rp + 16 * g;
      _tile_loadd(4, a0 + 64 * k, lda);
      _tile_loadd(5, a1 + 64 * k, lda);
      _tile_loadd(6, bk, ld);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 5, 6);
      if (two) {
        _tile_loadd(7, bk + 16, ld);
        _tile_dpbf16ps(2, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, c0, ld);
    _tile_stored(1, c1, ld);
    if (two) {
      _tile_stored(2, c0 + 16, ld);
      _tile_stored(3, c1 + 16, ld);
    }
  }
}

// The K rows of keys addr[j0 .. j0 + n) as whole tiles: kb [kAmxKeys, dim]
// (zero rows past n: their scores are never used).
template <int NV>
inline void gather_k_step(const c10::BFloat16* k_base, int64_t row_stride, const int64_t* addr,
                          int64_t j0, int64_t n, uint16_t* kb) {
  constexpr int64_t dim = NV * 16, bytes = dim * 2;
  for (int64_t k = 0; k < n; ++k)
    std::memcpy(kb + k * dim, k_base + addr[j0 + k] * row_stride, bytes);
  if (n < kAmxKeys) std::memset(kb + n * dim, 0, (kAmxKeys - n) * bytes);
}

// V^T of the same keys as the P.V tiles read it: vt [dim, kAmxKeys / 2] key
// pairs (row d: the step's pairs at d; zeros past n: weight 0 on a zero row
// adds nothing), through v2 [kAmxKeys / 2, dim] (V rows interleaved by pairs).
template <int NV>
inline void pack_v_step(const c10::BFloat16* v_base, int64_t row_stride, const int64_t* addr,
                        int64_t j0, int64_t n, uint32_t* v2, uint32_t* vt) {
  constexpr int64_t dim = NV * 16, pairs = kAmxKeys / 2;
  const int64_t chunks = (n + 31) / 32;  // key chunks of one V^T tile (32 keys)
  for (int64_t k = 0; k < 16 * chunks; ++k) {
    if (2 * k < n) {
      const bool both = 2 * k + 1 < n;
      interleave_rows<NV>(v_base + addr[j0 + 2 * k] * row_stride,
                          both ? v_base + addr[j0 + 2 * k + 1] * row_stride : nullptr,
                          v2 + k * dim);
    } else {
      std::memset(v2 + k * dim, 0, dim * 4);
    }
  }
  for (int64_t pb = 0; pb < chunks; ++pb)
    for (int64_t d = 0; d < dim; d += 16)
      transpose16(v2 + 16 * pb * dim + d, dim, vt + d * pairs + 16 * pb, pairs);
}

template <int NV>
__attribute__((noinline)) void attend_state_amx(const uint32_t* qt, int64_t rows, int64_t rp,
                                                const c10::BFloat16* k_base,
                                                const c10::BFloat16* v_base, int64_t row_stride,
                                                const int64_t* addr, int64_t len,
                                                const int32_t* first, const int32_t* last,
                                                float scale, float softcap, Scratch& sc, float* m,
                                                float* s, float* acc, PackedKV packed = {}) {
  static_assert(NV % 2 == 0, "head_dim must be a multiple of 32 (one tile's k)");
  constexpr int64_t dim = NV * 16, KT = kAmxKeys, pairs = KT / 2;
  const int64_t groups = rp / 16;
  sc.kf.resize(static_cast<size_t>(KT * dim / 2 + pairs * rp));  // K rows, then P^T pairs
  sc.vf.resize(static_cast<size_t>(2 * pairs * dim));            // V pairs, then V^T
  sc.scores.resize(static_cast<size_t>(KT * rp));
  sc.row.assign(static_cast<size_t>(dim * rp), 0.f);  // acc_t
  sc.rowstate.resize(static_cast<size_t>(3 * rp));
  uint16_t* kb = reinterpret_cast<uint16_t*>(sc.kf.data());  // [KT, dim] bfloat16
  uint32_t* p2 = reinterpret_cast<uint32_t*>(sc.kf.data() + KT * dim / 2);  // [pairs, rp]
  uint32_t* v2 = reinterpret_cast<uint32_t*>(sc.vf.data());                 // [pairs, dim]
  uint32_t* vt = v2 + pairs * dim;  // [dim, pairs]: row d is V^T's 32 keys at d
  float *st = sc.scores.data(), *acc_t = sc.row.data();
  float *mr = sc.rowstate.data(), *sr = mr + rp, *rescale = sr + rp;
  std::fill(mr, mr + rp, -FLT_MAX);
  std::fill(sr, sr + rp, 0.f);
  const int32_t first_all = *std::max_element(first, first + rows);
  const int32_t last_all = *std::min_element(last, last + rows);
  constexpr int64_t bytes = dim * static_cast<int64_t>(sizeof(c10::BFloat16));
  prefetch_tile(k_base, v_base, row_stride, addr, 0, KT, len, bytes);
  radixmux::configure_full_tiles();
  for (int64_t j0 = 0; j0 < len; j0 += KT) {
    const int64_t n = std::min(KT, len - j0);
    // A packed step holds real keys past n (later tokens'), where a step
    // packed here holds zeros: the scores past n are never read and their
    // weights are 0, so both give the same bits.
    const uint16_t* ks = kb;
    if (packed.k) ks = packed.k + j0 * dim;
    else gather_k_step<NV>(k_base, row_stride, addr, j0, n, kb);
    // S^T [KT, rp] = K . Q^T in 2 x 2 blocks of 16 keys x 16 query rows
    // (key groups wholly past n skipped). The next step's K and V slices are
    // prefetched a block's keys at a time between the blocks' products, not
    // all at once before them: a burst of 512 prefetches holds the core until
    // the fill buffers drain, with no tile work queued behind it (cascade
    // decodes, 16 sequences in groups of 4 over 1,000 shared + 100 own keys,
    // 30 layers: 11.8-12.5 -> 11.2-11.7 ms a step).
    const int64_t key_groups = (n + 15) / 16;
    for (int64_t kg = 0; kg < KT / 16; kg += 2) {
      if (!packed.k) prefetch_tile(k_base, v_base, row_stride, addr, j0 + KT + 16 * kg, 32, len, bytes);
      if (kg < key_groups)
        amx_block_row<false>(ks + 16 * kg * dim, dim * 2, NV / 2, qt, st + 16 * kg * rp, rp, groups);
    }
    // P^T and V as key pairs (zeros past n: weight 0 on a zero row adds nothing).
    const bool masked = j0 < first_all || j0 + n - 1 > last_all;
    const int64_t chunks = (n + 31) / 32;  // key chunks of one V^T tile (32 keys)
    softmax_tile(st, n, rp, j0, masked, first, last, scale, softcap, mr, sr, rescale, p2,
                 16 * chunks);
    const uint32_t* vs = vt;
    if (packed.vt) vs = packed.vt + j0 / KT * dim * pairs;
    else pack_v_step<NV>(v_base, row_stride, addr, j0, n, v2, vt);
    // The accumulators' rescale, skipped for a group whose maxima all held.
    for (int64_t g = 0; g < groups; ++g) {
      const __m512 c = _mm512_loadu_ps(rescale + 16 * g);
      if (_mm512_cmp_ps_mask(c, _mm512_set1_ps(1.f), _CMP_EQ_OQ) == 0xffff) continue;
      for (int64_t d = 0; d < dim; ++d) {
        float* a = acc_t + d * rp + 16 * g;
        _mm512_storeu_ps(a, _mm512_mul_ps(_mm512_loadu_ps(a), c));
      }
    }
    // O^T [dim, rp] += V^T . P^T in 2 x 2 blocks of 16 dims x 16 rows, the
    // accumulators in tiles over the step's key chunks.
    for (int64_t dg = 0; dg < NV; dg += 2)
      amx_block_row<true>(vs + 16 * dg * pairs, pairs * 4, chunks, p2, acc_t + 16 * dg * rp, rp,
                          groups);
  }
  // acc [rows, dim] = acc_t^T: whole 16-row groups by blocks, the rest by element.
  const int64_t whole = rows / 16 * 16;
  for (int64_t r = 0; r < whole; r += 16)
    for (int64_t d = 0; d < dim; d += 16)
      transpose16(reinterpret_cast<const uint32_t*>(acc_t) + d * rp + r, rp,
                  reinterpret_cast<uint32_t*>(acc) + r * dim + d, dim);
  for (int64_t r = whole; r < rows; ++r)
    for (int64_t d = 0; d < dim; ++d) acc[r * dim + d] = acc_t[d * rp + r];
  std::copy(mr, mr + rows, m);
  std::copy(sr, sr + rows, s);
}
#endif

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
  TORCH_CHECK(!resume || (det && Paths::tiled && !Paths::amx()),
              "paged_decode: a softmax state resumes on the tiled path only");
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
                               s.last32.data(), scale, softcap, s, m, sum, acc, packed);
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

// A step's decode work, cut into tasks for the threads. A *job* is a set of
// query rows (those of its member sequences) attending over one run of keys
// of its first member's context: a sequence's own context, a group's shared
// prefix, or a group member's own suffix. A job is cut into *pieces* along
// its keys so that every core has work even with one sequence or one group;
// a task is one (piece, KV head), and a thread runs a piece's tasks
// together. Pieces write softmax states that a second pass merges per
// sequence, except a sequence alone in one piece, which writes its output
// directly (the common ungrouped case costs no merge).
struct Job {
  int64_t member0, members;  // its sequences: member_list[member0 : member0 + members]
  int64_t begin, end;        // the key run, as indices into member0's context
  // Deterministic mode: the job (a group's prefix) whose softmax state this
  // one's rows go on from, at its row resume_row; -1: none.
  int64_t resume_job = -1, resume_row = 0;
};
struct Piece {
  int64_t job, begin, end;
  int64_t state;  // offset of its KV head 0 state block in `states`; -1: writes the output
};
struct Source {  // where one sequence finds part of its softmax
  int64_t piece, row0;  // its first query row among the piece's rows
};

// Per-key cost of reading one K and one V row from memory, in units of one
// query row's arithmetic on that key: it weighs jobs when cutting them.
constexpr int64_t kKeyCost = 8;
// Pieces aim at this many per thread (balance under noisy neighbours)...
constexpr int64_t kTasksPerThread = 4;
// ...but are never shorter than this many keys (each piece costs a merge)...
constexpr int64_t kMinPiece = 32;
// ...and keep the per-key path's [rows, keys] score table within this many
// floats (L2).
constexpr int64_t kMaxScores = 1 << 16;

// Groups of a call: of[b] the group of sequence b (-1: none), prefix[g] how
// many leading context rows group g's members share.
struct Groups {
  const int64_t* of = nullptr;
  const int64_t* prefix = nullptr;
  int64_t count = 0;
};

// Runs task(i, scratch) for i = 0..n-1, every thread taking the next task
// not yet taken (callers put the costliest first): a core slowed by other
// work simply takes fewer.
template <typename F>
void run_tasks(int64_t n, F&& task) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::max<int64_t>(1, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    Scratch s;
    for (int64_t i; (i = next.fetch_add(1)) < n;) task(i, s);
  });
}

// Whether a deterministic decode can resume a softmax state (attend_rows'
// `resume`): the tiled path takes every row there, not the AMX one.
template <typename T, typename Q>
bool can_resume(int64_t dim) {
  bool ok = false;
  dispatch_dim(dim, [&](auto nv) {
    using P = RowPaths<T, Q, decltype(nv)::value>;
    ok = P::tiled && !P::amx();
  });
  return ok;
}

template <typename T, typename Q>
void run(const at::Tensor& q, at::Tensor& out, const at::Tensor& k_rows,
         const at::Tensor& v_rows, const at::Tensor& addr, const at::Tensor& offsets,
         const Groups& groups, double scale, double softcap, int64_t window, bool det) {
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_rows.size(1) / dim, qpk = heads / kv_heads;
  const int64_t row_stride = k_rows.stride(0);
  const Q* qp = q.data_ptr<Q>();
  Q* op = out.data_ptr<Q>();
  const T* kp = k_rows.data_ptr<T>();
  const T* vp = v_rows.data_ptr<T>();
  const int64_t* ap = addr.data_ptr<int64_t>();
  const int64_t* offs = offsets.data_ptr<int64_t>();
  const float sc = static_cast<float>(scale), cap = static_cast<float>(softcap);
  // Deterministic mode groups only where a member's softmax can go on from
  // its group's prefix state (resume, below): two states merged by
  // log-sum-exp round differently from one pass over both key runs.
  const bool grouping = groups.count > 0 && (!det || can_resume<T, Q>(dim));
  const int64_t *group_of = grouping ? groups.of : nullptr, *group_prefix = groups.prefix;
  const int64_t num_groups = grouping ? groups.count : 0;

  // Oldest key each sequence sees: positions are consecutive and the newest
  // key is the query's own, so a sliding window keeps the last `window` keys.
  std::vector<int64_t> lo(batch);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = offs[b + 1] - offs[b];
    lo[b] = window > 0 ? std::max<int64_t>(0, len - window) : 0;
  }

  // ---- jobs --------------------------------------------------------------------------
  std::vector<int64_t> member_list;
  std::vector<Job> jobs;
  std::vector<int64_t> prefix_job(num_groups, -1), prefix_end(num_groups);
  if (num_groups > 0) {
    std::vector<std::vector<int64_t>> members(num_groups);
    for (int64_t b = 0; b < batch; ++b)
      if (group_of[b] >= 0) members[group_of[b]].push_back(b);
    for (int64_t g = 0; g < num_groups; ++g) {
      if (members[g].empty()) continue;
      // Keys of the prefix that some member sees (windows cut each differently).
      int64_t begin = group_prefix[g], end = group_prefix[g];
      for (int64_t b : members[g]) begin = std::min(begin, lo[b]);
      if (det) {
        // Members resume the prefix's state, so it ends at an absolute tile
        // boundary and starts where each member's one pass would: the tiles
        // are then those of one pass over each member's whole context.
        end = end / kAlignKeys * kAlignKeys;
        begin = aligned_begin(begin, true);
        bool same = true;
        for (int64_t b : members[g]) same &= aligned_begin(lo[b], true) == begin;
        if (!same) continue;
      }
      if (begin >= end) continue;
      prefix_job[g] = static_cast<int64_t>(jobs.size());
      prefix_end[g] = end;
      jobs.push_back({static_cast<int64_t>(member_list.size()),
                      static_cast<int64_t>(members[g].size()), begin, end});
      member_list.insert(member_list.end(), members[g].begin(), members[g].end());
    }
  }
  // Jobs before own_jobs0 are group prefixes; in deterministic mode every
  // member of one resumes its state.
  const int64_t own_jobs0 = static_cast<int64_t>(jobs.size());
  const bool resumes = det && own_jobs0 > 0;
  std::vector<int64_t> own_job(batch);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t g = group_of ? group_of[b] : -1;
    const int64_t pj = g >= 0 ? prefix_job[g] : -1;
    own_job[b] = static_cast<int64_t>(jobs.size());
    // After its group's prefix (in deterministic mode every member's window
    // starts inside it), else from the first key it sees.
    Job own{static_cast<int64_t>(member_list.size()), 1,
            pj >= 0 ? std::max(prefix_end[g], lo[b]) : aligned_begin(lo[b], det),
            offs[b + 1] - offs[b]};
    if (det && pj >= 0) {
      const Job& prefix = jobs[pj];
      const int64_t* mem = member_list.data() + prefix.member0;
      own.resume_job = pj;
      own.resume_row = (std::find(mem, mem + prefix.members, b) - mem) * qpk;
    }
    jobs.push_back(own);
    member_list.push_back(b);
  }

  // ---- pieces ------------------------------------------------------------------------
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  int64_t total = 0;
  for (const Job& j : jobs) total += (j.end - j.begin) * (j.members * qpk + kKeyCost);
  const int64_t target = std::max<int64_t>(1, total / (kTasksPerThread * threads));
  std::vector<Piece> pieces;
  std::vector<int64_t> first_piece(jobs.size() + 1);
  int64_t state_size = 0;
  for (size_t i = 0; i < jobs.size(); ++i) {
    const Job& j = jobs[i];
    first_piece[i] = static_cast<int64_t>(pieces.size());
    const int64_t len = j.end - j.begin, rows = j.members * qpk;
    // No keys of its own (deterministic mode: a context that ends where its
    // group's prefix state does): the prefix state alone, merged below.
    if (len <= 0) continue;
    int64_t n = (len * (rows + kKeyCost) + target - 1) / target;
    n = std::min(n, (len + kMinPiece - 1) / kMinPiece);
    n = std::max({n, (rows * len + kMaxScores - 1) / kMaxScores, int64_t{1}});
    if (det) n = 1;  // pieces merge by log-sum-exp: another rounding
    // A sequence's own job, whole, needs no merge unless a prefix state joins it
    // (in deterministic mode, it resumes that state instead).
    const bool direct = static_cast<int64_t>(i) >= own_jobs0 && n == 1 &&
                        (det || !group_of || group_of[member_list[j.member0]] < 0);
    for (int64_t p = 0; p < n; ++p) {
      pieces.push_back({static_cast<int64_t>(i), j.begin + len * p / n,
                        j.begin + len * (p + 1) / n, direct ? -1 : state_size});
      if (!direct) state_size += kv_heads * rows * (dim + 2);
    }
  }
  first_piece[jobs.size()] = static_cast<int64_t>(pieces.size());
  std::vector<float> states(static_cast<size_t>(state_size));

  // ---- merges ------------------------------------------------------------------------
  // Every sequence not written directly gathers its softmax from states: its
  // group's prefix pieces, then its own. Whichever thread completes the last
  // state a (sequence, KV head) awaits merges it, so one parallel region
  // does everything: under contention each region's closing barrier can
  // wait a whole time slice for a descheduled thread.
  std::vector<int64_t> merged;                 // the sequences merged
  std::vector<std::vector<Source>> sources;    // per merged sequence
  std::vector<std::vector<int64_t>> users(pieces.size());  // piece -> merged sequences
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t oj = own_job[b];
    if (first_piece[oj + 1] - first_piece[oj] == 1 && pieces[first_piece[oj]].state < 0)
      continue;
    std::vector<Source> from;
    const int64_t g = group_of ? group_of[b] : -1;
    if (g >= 0 && prefix_job[g] >= 0) {
      const Job& j = jobs[prefix_job[g]];
      const int64_t* mem = member_list.data() + j.member0;
      const int64_t at = std::find(mem, mem + j.members, b) - mem;
      for (int64_t p = first_piece[prefix_job[g]]; p < first_piece[prefix_job[g] + 1]; ++p)
        from.push_back({p, at * qpk});
    }
    for (int64_t p = first_piece[oj]; p < first_piece[oj + 1]; ++p) from.push_back({p, 0});
    for (const Source& src : from) users[src.piece].push_back(static_cast<int64_t>(merged.size()));
    merged.push_back(b);
    sources.push_back(std::move(from));
  }
  std::unique_ptr<std::atomic<int64_t>[]> awaiting(
      new std::atomic<int64_t>[merged.size() * kv_heads]);
  for (size_t i = 0; i < merged.size(); ++i)
    for (int64_t h = 0; h < kv_heads; ++h)
      awaiting[i * kv_heads + h].store(static_cast<int64_t>(sources[i].size()));

  auto merge = [&](int64_t i, int64_t h, Scratch& s) {
    s.row.resize(static_cast<size_t>(dim));
    float* acc = s.row.data();
    Q* dst = op + (merged[i] * heads + h * qpk) * dim;
    for (int64_t r = 0; r < qpk; ++r) {
      float m = -FLT_MAX, sum = 0.f;
      for (const Source& src : sources[i]) {
        const Piece& p = pieces[src.piece];
        const int64_t rows = jobs[p.job].members * qpk, at = src.row0 + r;
        const float* block = states.data() + p.state + h * rows * (dim + 2);
        merge_state(m, sum, acc, block[at], block[rows + at], block + 2 * rows + at * dim, dim);
      }
      write_normalised(acc, sum, dim, dst + r * dim);
    }
  };

  // ---- tasks -------------------------------------------------------------------------
  // Costliest first, for run_tasks; where members resume their group's prefix
  // state, the prefix pieces go first, in a phase of their own.
  const int64_t num_pieces = static_cast<int64_t>(pieces.size());
  const int64_t phase2 = resumes ? first_piece[own_jobs0] : num_pieces;
  auto cost = [&](int64_t i) {
    const Piece& p = pieces[i];
    return (p.end - p.begin) * (jobs[p.job].members * qpk + kKeyCost);
  };
  std::vector<int64_t> piece_order(num_pieces);
  for (int64_t i = 0; i < num_pieces; ++i) piece_order[i] = i;
  std::stable_sort(piece_order.begin(), piece_order.end(), [&](int64_t a, int64_t b) {
    return (a >= phase2) != (b >= phase2) ? a < phase2 : cost(a) > cost(b);
  });

  auto run_task = [&](int64_t task, Scratch& s) {
    const int64_t piece = task / kv_heads, h = task % kv_heads;
    const Piece& p = pieces[piece];
    const Job& j = jobs[p.job];
    const int64_t* mem = member_list.data() + j.member0;
    const int64_t rows = j.members * qpk, len = p.end - p.begin;
    float* block;
    if (p.state >= 0) {
      block = states.data() + p.state + h * rows * (dim + 2);
    } else {
      s.state.resize(static_cast<size_t>(rows * (dim + 2)));
      block = s.state.data();
    }
    float *m = block, *sum = block + rows, *acc = block + 2 * rows;
    if (j.resume_job >= 0) {  // the group prefix's state, complete (an earlier phase)
      const int64_t from_rows = jobs[j.resume_job].members * qpk, r0 = j.resume_row;
      const float* from =
          states.data() + pieces[first_piece[j.resume_job]].state + h * from_rows * (dim + 2);
      std::copy(from + r0, from + r0 + rows, m);
      std::copy(from + from_rows + r0, from + from_rows + r0 + rows, sum);
      const float* from_acc = from + 2 * from_rows + r0 * dim;
      std::copy(from_acc, from_acc + rows * dim, acc);
    }
    // Query rows: member i's qpk heads of KV head h, each seeing the keys of
    // this piece from its own window start on.
    auto row = [&](int64_t r) {
      const int64_t b = mem[r / qpk];
      return QueryRow<Q>{qp + (b * heads + h * qpk + r % qpk) * dim,
                         std::clamp<int64_t>(lo[b] - p.begin, 0, len), len - 1};
    };
    dispatch_dim(dim, [&](auto nv) {
      attend_rows<T, Q, decltype(nv)::value>(row, rows, kp + h * dim, vp + h * dim, row_stride,
                                             ap + offs[mem[0]] + p.begin, len, dim, sc, cap, s,
                                             m, sum, acc, /*amx_any=*/false, det,
                                             PackedKV{}, j.resume_job >= 0);
    });
    if (p.state < 0) {
      Q* dst = op + (mem[0] * heads + h * qpk) * dim;
      for (int64_t r = 0; r < rows; ++r)
        write_normalised(acc + r * dim, sum[r], dim, dst + r * dim);
      return;
    }
    // acq_rel: the last thread to finish sees every other thread's state.
    for (const int64_t i : users[piece])
      if (awaiting[i * kv_heads + h].fetch_sub(1, std::memory_order_acq_rel) == 1) merge(i, h, s);
  };
  // A thread takes a piece's KV heads together: a K or V row holds every
  // head, so the first head's reads bring the others' bytes into this core's
  // L2 (a head per thread made both cores pull every line from memory). With
  // fewer pieces than threads (deterministic mode never cuts a job: one
  // decode, or one group's prefix, is one piece) a task per KV head instead,
  // or cores would idle.
  auto run_pieces = [&](int64_t from, int64_t to) {
    if (to - from >= threads) {
      run_tasks(to - from, [&](int64_t i, Scratch& s) {
        for (int64_t h = 0; h < kv_heads; ++h) run_task(piece_order[from + i] * kv_heads + h, s);
      });
      return;
    }
    run_tasks((to - from) * kv_heads, [&](int64_t i, Scratch& s) {
      run_task(piece_order[from + i / kv_heads] * kv_heads + i % kv_heads, s);
    });
  };
  if (phase2 > 0) run_pieces(0, phase2);
  if (phase2 < num_pieces) run_pieces(phase2, num_pieces);
}

// ---- extends (prefill chunks) ----------------------------------------------------------
// Query tokens per extend task, as query rows (tokens x query heads per KV
// head): enough rows to fill the vector lanes and amortise each key tile,
// few enough that the causal diagonal wastes little of a tile.
constexpr int64_t kExtendRows = 96;
// A chunk whose tokens see at least this many earlier keys takes twice the
// rows per task: there the diagonal is a small part of each row's keys, and
// each key tile's gather and V transpose serve twice the rows (100 new
// tokens over 1,000 cached: 6-13% faster; from scratch, 96 rows stay 3% ahead).
constexpr int64_t kLongContext = 512;

// Where pack_extend_kv's packs live: one buffer, reused by every call (a
// multi-megabyte allocation per layer would fault its pages in every time).
std::vector<uint32_t>& extend_pack_buffer() {
  static std::vector<uint32_t> buffer;
  return buffer;
}

// A packed head's layout in extend_pack_buffer(), in 32-bit words: K rows
// [steps * kAmxKeys, dim] bfloat16, then V^T [steps][dim, kAmxKeys / 2]
// pairs, each half `half` words (one step of either: step_words), heads one
// after another.
struct PackLayout {
  int64_t steps, step_words, half;
  PackLayout(int64_t len, int64_t dim)
      : steps((len + kAmxKeys - 1) / kAmxKeys),
        step_words(dim * kAmxKeys / 2),
        half(steps * step_words) {}
  int64_t head(int64_t h) const { return h * 2 * half; }
  int64_t k_step(int64_t j) const { return j * step_words; }
  int64_t vt_step(int64_t j) const { return half + j * step_words; }
};

// K and V^T of every KV head of each sequence whose prompt spans several
// query blocks, packed once for all its tasks (PackedKV), where extends run
// on the AMX tiles without a window (a window starts each block's keys at
// a different place). Returns, per sequence, its packs' offset in
// extend_pack_buffer() in 32-bit words (-1: not packed), laid out as
// PackLayout says.
template <typename T, typename Q>
std::vector<int64_t> pack_extend_kv(const at::Tensor& k_rows, const at::Tensor& v_rows,
                                    const int64_t* addr, const int64_t* offs,
                                    const int64_t* qoffs, int64_t seqs, int64_t kv_heads,
                                    int64_t dim, int64_t window, int64_t block) {
  std::vector<int64_t> at(static_cast<size_t>(seqs), -1);
#ifdef RADIXMUX_AMX
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<Q, c10::BFloat16>) {
    bool tiles = false;
    dispatch_dim(dim, [&](auto nv) { tiles = decltype(nv)::value % 2 == 0; });
    if (!tiles || window > 0 || !amx_ready()) return at;
    int64_t words = 0;
    struct Item {
      int64_t seq, head, step;
    };
    std::vector<Item> items;
    for (int64_t e = 0; e < seqs; ++e) {
      // Worth it from four tasks per head (blocks are up to twice `block`
      // long): 100 new tokens after 1,000 cached, two tasks per head, went
      // from 0.41-0.42 to 0.46-0.49 ms per layer packed (a pass of its own,
      // then its reads from L2), 512 new from 0.65-0.68 to 0.61-0.62.
      if (qoffs[e + 1] - qoffs[e] < 8 * block) continue;
      const PackLayout layout(offs[e + 1] - offs[e], dim);
      at[e] = words;
      words += layout.head(kv_heads);
      for (int64_t h = 0; h < kv_heads; ++h)
        for (int64_t j = 0; j < layout.steps; ++j) items.push_back({e, h, j});
    }
    if (items.empty()) return at;
    std::vector<uint32_t>& buffer = extend_pack_buffer();
    if (buffer.size() < static_cast<size_t>(words)) buffer.resize(static_cast<size_t>(words));
    const auto* kp = reinterpret_cast<const c10::BFloat16*>(k_rows.data_ptr());
    const auto* vp = reinterpret_cast<const c10::BFloat16*>(v_rows.data_ptr());
    const int64_t row_stride = k_rows.stride(0);
    run_tasks(static_cast<int64_t>(items.size()), [&](int64_t i, Scratch& s) {
      const Item& it = items[i];
      const int64_t len = offs[it.seq + 1] - offs[it.seq];
      const PackLayout layout(len, dim);
      const int64_t j0 = it.step * kAmxKeys, n = std::min(kAmxKeys, len - j0);
      uint32_t* head = buffer.data() + at[it.seq] + layout.head(it.head);
      const int64_t* a = addr + offs[it.seq];
      s.vf.resize(static_cast<size_t>(kAmxKeys / 2 * dim));
      dispatch_dim(dim, [&](auto nv) {
        constexpr int NV = decltype(nv)::value;
        if constexpr (NV > 0 && NV % 2 == 0) {
          gather_k_step<NV>(kp + it.head * dim, row_stride, a, j0, n,
                            reinterpret_cast<uint16_t*>(head + layout.k_step(it.step)));
          pack_v_step<NV>(vp + it.head * dim, row_stride, a, j0, n,
                          reinterpret_cast<uint32_t*>(s.vf.data()),
                          head + layout.vt_step(it.step));
        }
      });
    });
  }
#endif
  return at;
}

// Sequence e's KV head h packs (none where pack_extend_kv made none).
inline PackedKV packed_of(const std::vector<int64_t>& at, int64_t e, int64_t h, int64_t dim,
                          int64_t len) {
  if (at[e] < 0) return {};
  const PackLayout layout(len, dim);
  const uint32_t* head = extend_pack_buffer().data() + at[e] + layout.head(h);
  return {reinterpret_cast<const uint16_t*>(head + layout.k_step(0)), head + layout.vt_step(0)};
}

// Causal attention of each extend's new tokens over its whole context,
// read in place: sequence e's context is addr[offsets[e]:offsets[e + 1]]
// and its new tokens are the last n_e = q_offsets[e + 1] - q_offsets[e] of
// it, their queries q[q_offsets[e]:q_offsets[e + 1]]. A task is (sequence,
// KV head, block of new tokens); it visits only keys some token of the
// block sees (nothing above the diagonal, nothing before the window), and
// key tiles every row sees whole skip the masks.
template <typename T, typename Q>
void run_extend(const at::Tensor& q, at::Tensor& out, const at::Tensor& k_rows,
                const at::Tensor& v_rows, const at::Tensor& addr, const at::Tensor& offsets,
                const at::Tensor& q_offsets, double scale, double softcap, int64_t window,
                bool det) {
  const int64_t seqs = offsets.numel() - 1, heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_rows.size(1) / dim, qpk = heads / kv_heads;
  const int64_t row_stride = k_rows.stride(0);
  const Q* qp = q.data_ptr<Q>();
  Q* op = out.data_ptr<Q>();
  const T* kp = k_rows.data_ptr<T>();
  const T* vp = v_rows.data_ptr<T>();
  const int64_t* ap = addr.data_ptr<int64_t>();
  const int64_t* offs = offsets.data_ptr<int64_t>();
  const int64_t* qoffs = q_offsets.data_ptr<int64_t>();
  const float sc = static_cast<float>(scale), cap = static_cast<float>(softcap);
  const int64_t short_block = std::max<int64_t>(1, kExtendRows / qpk);

  struct Task {
    int64_t seq, head, t0, t1, cost;
  };
  std::vector<Task> tasks;
  // Oldest key a token at context index c sees.
  auto oldest = [&](int64_t c) { return window > 0 ? std::max<int64_t>(0, c - window + 1) : 0; };
  for (int64_t e = 0; e < seqs; ++e) {
    const int64_t n = qoffs[e + 1] - qoffs[e], cached = offs[e + 1] - offs[e] - n;
    const int64_t block = cached - oldest(cached) >= kLongContext ? 2 * short_block : short_block;
    for (int64_t t0 = 0; t0 < n; t0 += block) {
      const int64_t t1 = std::min(n, t0 + block);
      const int64_t keys = cached + t1 - oldest(cached + t0);
      for (int64_t h = 0; h < kv_heads; ++h)
        tasks.push_back({e, h, t0, t1, keys * ((t1 - t0) * qpk + kKeyCost)});
    }
  }
  // Costliest first, then any thread takes the next (as for decodes).
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const Task& a, const Task& b) { return a.cost > b.cost; });
  const std::vector<int64_t> packs = pack_extend_kv<T, Q>(k_rows, v_rows, ap, offs, qoffs, seqs,
                                                          kv_heads, dim, window, short_block);
  run_tasks(static_cast<int64_t>(tasks.size()), [&](int64_t i, Scratch& s) {
    const Task& t = tasks[i];
    const int64_t n = qoffs[t.seq + 1] - qoffs[t.seq];
    const int64_t cached = offs[t.seq + 1] - offs[t.seq] - n;
    // Keys [begin, end).
    const int64_t begin = aligned_begin(oldest(cached + t.t0), det), end = cached + t.t1;
    const int64_t rows = (t.t1 - t.t0) * qpk;
    s.state.resize(static_cast<size_t>(rows * (dim + 2)));
    float *m = s.state.data(), *sum = m + rows, *acc = sum + rows;
    // Row r: token t0 + r / qpk (context index c), query head h * qpk + r % qpk.
    auto row = [&](int64_t r) {
      const int64_t token = t.t0 + r / qpk, c = cached + token;
      return QueryRow<Q>{qp + ((qoffs[t.seq] + token) * heads + t.head * qpk + r % qpk) * dim,
                         oldest(c) - begin, c - begin};
    };
    dispatch_dim(dim, [&](auto nv) {
      attend_rows<T, Q, decltype(nv)::value>(row, rows, kp + t.head * dim, vp + t.head * dim,
                                             row_stride, ap + offs[t.seq] + begin,
                                             end - begin, dim, sc, cap, s, m, sum, acc,
                                             /*amx_any=*/true, det,
                                             packed_of(packs, t.seq, t.head, dim,
                                                       offs[t.seq + 1] - offs[t.seq]));
    });
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t token = t.t0 + r / qpk;
      Q* dst = op + ((qoffs[t.seq] + token) * heads + t.head * qpk + r % qpk) * dim;
      write_normalised(acc + r * dim, sum[r], dim, dst);
    }
  });
}

// Calls fn(T{}, Q{}) for K/V dtype T and query dtype Q, where Q is T or
// float: models pair queries with K/V of their own dtype, and compiling every
// other pair too would triple the build time. Queries of any other dtype go
// in as float (exactly: the kernel computes in float anyway), and the
// result, computed as float, is cast back once, as it would have been.
template <typename F>
at::Tensor dispatch_types(const at::Tensor& q, const at::Tensor& k_rows, F&& fn) {
  const at::ScalarType kv = k_rows.scalar_type();
  TORCH_CHECK(kv == at::kFloat || kv == at::kBFloat16 || kv == at::kHalf ||
                  kv == at::kFloat8_e4m3fn,
              "paged_decode: unsupported KV dtype ", kv);
  const at::ScalarType qt = q.scalar_type();
  TORCH_CHECK(qt == at::kFloat || qt == at::kBFloat16 || qt == at::kHalf,
              "paged_decode: unsupported query dtype ", qt);
  const bool direct = qt == kv || qt == at::kFloat;
  const at::Tensor qd = direct ? q : q.to(at::kFloat);
  at::Tensor out = at::empty_like(qd);
  auto with_kv = [&](auto t) {
    using T = decltype(t);
    if constexpr (std::is_same_v<T, c10::Float8_e4m3fn>) fn(t, float{}, qd, out);
    else if (qd.scalar_type() == at::kFloat) fn(t, float{}, qd, out);
    else fn(t, T{}, qd, out);
  };
  if (kv == at::kFloat) with_kv(float{});
  else if (kv == at::kBFloat16) with_kv(c10::BFloat16{});
  else if (kv == at::kHalf) with_kv(c10::Half{});
  else with_kv(c10::Float8_e4m3fn{});  // queries go in as float (not direct)
  return direct ? out : out.to(qt);
}

// Shapes every entry needs: q [*, H, D], row tables [N, KVH * D], addr int64.
void check_rows(const at::Tensor& q, const at::Tensor& k_rows, const at::Tensor& v_rows,
                const at::Tensor& addr) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "paged_decode: q must be contiguous [B, H, D]");
  TORCH_CHECK(k_rows.dim() == 2 && k_rows.stride(1) == 1, "paged_decode: k_rows must be [N, row]");
  TORCH_CHECK(v_rows.sizes() == k_rows.sizes() && v_rows.strides() == k_rows.strides(),
              "paged_decode: k_rows and v_rows differ in shape");
  TORCH_CHECK(k_rows.scalar_type() == v_rows.scalar_type(), "paged_decode: K/V dtypes differ");
  TORCH_CHECK(addr.scalar_type() == at::kLong && addr.is_contiguous(), "paged_decode: addr int64");
  const int64_t dim = q.size(2);
  TORCH_CHECK(k_rows.size(1) % dim == 0, "paged_decode: row width not a multiple of head_dim");
  const int64_t kv_heads = k_rows.size(1) / dim;
  TORCH_CHECK(kv_heads > 0 && q.size(1) % kv_heads == 0,
              "paged_decode: query heads not a multiple of KV heads");
}

at::Tensor decode(const at::Tensor& q, const at::Tensor& k_rows, const at::Tensor& v_rows,
                  const at::Tensor& addr, const at::Tensor& offsets, const Groups& groups,
                  double scale, double softcap, int64_t window, bool det) {
  check_rows(q, k_rows, v_rows, addr);
  return dispatch_types(q, k_rows, [&](auto kv, auto query, const at::Tensor& qd, at::Tensor& out) {
    run<decltype(kv), decltype(query)>(qd, out, k_rows, v_rows, addr, offsets, groups, scale,
                                       softcap, window, det);
  });
}

void check_offsets(const at::Tensor& q, const at::Tensor& offsets) {
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.is_contiguous() &&
                  offsets.numel() == q.size(0) + 1,
              "paged_decode: offsets must be int64 [B + 1]");
}

// q [B, H, D]; k_rows / v_rows [N, KVH * D] (row stride may exceed the width);
// addr: the context rows of every sequence, concatenated oldest first;
// offsets [B + 1]: sequence b owns addr[offsets[b]:offsets[b + 1]].
// softcap <= 0 and window <= 0 mean none; deterministic: the batch-invariant
// arithmetic (above). Returns [B, H, D] in q's dtype.
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_rows, const at::Tensor& v_rows,
                        const at::Tensor& addr, const at::Tensor& offsets, double scale,
                        double softcap, int64_t window, bool deterministic) {
  check_offsets(q, offsets);
  return decode(q, k_rows, v_rows, addr, offsets, Groups{}, scale, softcap, window,
                deterministic);
}

// paged_decode plus groups: group_of [B] int64, the group of each sequence
// (-1: none); group_prefix [G] int64, the number of leading context rows that
// every member of group g shares (the same addr entries; read through its
// first member's). 0 <= group_prefix[g] <= every member's context length.
// deterministic: paged_decode's bits (each member resumes its group's
// prefix state, cut at a kAlignKeys boundary, rather than merging it).
at::Tensor paged_decode_cascade(const at::Tensor& q, const at::Tensor& k_rows,
                                const at::Tensor& v_rows, const at::Tensor& addr,
                                const at::Tensor& offsets, const at::Tensor& group_of,
                                const at::Tensor& group_prefix, double scale, double softcap,
                                int64_t window, bool deterministic) {
  check_offsets(q, offsets);
  TORCH_CHECK(group_of.scalar_type() == at::kLong && group_of.is_contiguous() &&
                  group_of.dim() == 1 && group_of.numel() == q.size(0),
              "paged_decode_cascade: group_of must be int64 [B]");
  TORCH_CHECK(group_prefix.scalar_type() == at::kLong && group_prefix.is_contiguous() &&
                  group_prefix.dim() == 1,
              "paged_decode_cascade: group_prefix must be int64 [G]");
  const Groups groups{group_of.data_ptr<int64_t>(), group_prefix.data_ptr<int64_t>(),
                      group_prefix.numel()};
  const int64_t* offs = offsets.data_ptr<int64_t>();
  for (int64_t b = 0; b < q.size(0); ++b) {
    const int64_t g = groups.of[b];
    TORCH_CHECK(g >= -1 && g < groups.count, "paged_decode_cascade: group_of[", b, "] = ", g,
                " outside [-1, ", groups.count, ")");
    if (g < 0) continue;
    TORCH_CHECK(groups.prefix[g] >= 0 && groups.prefix[g] <= offs[b + 1] - offs[b],
                "paged_decode_cascade: group ", g, "'s prefix ", groups.prefix[g],
                " is longer than member ", b, "'s context (", offs[b + 1] - offs[b], ")");
  }
  return decode(q, k_rows, v_rows, addr, offsets, groups, scale, softcap, window, deterministic);
}

// Causal attention of extends (prefill chunks): q [T, H, D] the new tokens of
// every extend, sequence e's at rows q_offsets[e]:q_offsets[e + 1] (int64
// [E + 1], from 0 to T); its context rows addr[offsets[e]:offsets[e + 1]]
// (int64 [E + 1]) end with its new tokens' own rows (their K/V already
// written). softcap <= 0 and window <= 0 mean none; deterministic: the
// batch-invariant arithmetic (above). Returns [T, H, D].
at::Tensor paged_extend(const at::Tensor& q, const at::Tensor& k_rows, const at::Tensor& v_rows,
                        const at::Tensor& addr, const at::Tensor& offsets,
                        const at::Tensor& q_offsets, double scale, double softcap,
                        int64_t window, bool deterministic) {
  check_rows(q, k_rows, v_rows, addr);
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.is_contiguous() &&
                  q_offsets.scalar_type() == at::kLong && q_offsets.is_contiguous() &&
                  offsets.dim() == 1 && offsets.numel() >= 1 &&
                  q_offsets.numel() == offsets.numel(),
              "paged_extend: offsets and q_offsets must be int64 [E + 1]");
  const int64_t* offs = offsets.data_ptr<int64_t>();
  const int64_t* qoffs = q_offsets.data_ptr<int64_t>();
  const int64_t seqs = offsets.numel() - 1;
  TORCH_CHECK(qoffs[0] == 0 && qoffs[seqs] == q.size(0) && offs[0] >= 0 &&
                  offs[seqs] <= addr.numel(),
              "paged_extend: offsets do not cover q and addr");
  for (int64_t e = 0; e < seqs; ++e) {
    const int64_t n = qoffs[e + 1] - qoffs[e], len = offs[e + 1] - offs[e];
    TORCH_CHECK(n >= 0 && n <= len, "paged_extend: sequence ", e, " has ", n,
                " new tokens in a context of ", len);
  }
  return dispatch_types(q, k_rows, [&](auto kv, auto query, const at::Tensor& qd, at::Tensor& out) {
    run_extend<decltype(kv), decltype(query)>(qd, out, k_rows, v_rows, addr, offsets, q_offsets,
                                              scale, softcap, window, deterministic);
  });
}

// Whether attention over head_dim-wide heads gets the tiled vector path
// (AVX-512 or AVX2 + FMA, and a head size with unrolled code). Extends are
// faster than torch's SDPA only there; the per-key scalar loops are slower.
bool has_tiled_path(int64_t head_dim) {
  bool tiled = false;
#ifdef RADIXMUX_KEY_VECTORS
  dispatch_dim(head_dim, [&](auto nv) { tiled = decltype(nv)::value > 0; });
#endif
  return tiled;
}

// The widest vector paths this library was built with (its -march decides,
// not the CPU it runs on): what the kernels' choices between paths follow.
std::string built_isa() {
#if defined(RADIXMUX_AMX)
  return "amx";
#elif defined(__AVX512BF16__)
  return "avx512bf16";
#elif defined(__AVX512F__)
  return "avx512f";
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  return "avx2";
#else
  return "scalar";
#endif
}

}  // namespace

TORCH_LIBRARY(radixmux, m) {
  m.def(
      "paged_decode(Tensor q, Tensor k_rows, Tensor v_rows, Tensor addr, Tensor offsets, "
      "float scale, float softcap, int window, bool deterministic=False) -> Tensor");
  m.def(
      "paged_decode_cascade(Tensor q, Tensor k_rows, Tensor v_rows, Tensor addr, "
      "Tensor offsets, Tensor group_of, Tensor group_prefix, float scale, float softcap, "
      "int window, bool deterministic=False) -> Tensor");
  m.def(
      "paged_extend(Tensor q, Tensor k_rows, Tensor v_rows, Tensor addr, Tensor offsets, "
      "Tensor q_offsets, float scale, float softcap, int window, bool deterministic=False) "
      "-> Tensor");
  m.def("has_tiled_path(int head_dim) -> bool", &has_tiled_path);
  m.def("built_isa() -> str", &built_isa);
}

TORCH_LIBRARY_IMPL(radixmux, CPU, m) {
  m.impl("paged_decode", &paged_decode);
  m.impl("paged_decode_cascade", &paged_decode_cascade);
  m.impl("paged_extend", &paged_extend);
}
