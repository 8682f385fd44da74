// Decode attention that reads K/V straight out of the paged arena.
//
// One query token per sequence attends over its context slots, wherever they
// sit in the arena: each K/V row is read once, converted to float in
// registers and used for all the query heads that share its KV head (GQA).
// The torch fallback first gathers every context into a dense tensor (a copy
// as large as the KV itself, every layer, every step) and then runs SDPA over
// that copy; this kernel skips the copy.
//
// Registered as torch.ops.radixmux.paged_decode; see paged_decode.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  // bfloat16 is the high half of a float32: a shift the compiler vectorises.
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }

template <typename T>
inline void row_to_float(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

// Rows ahead to prefetch: context slots are mostly runs inside arena blocks,
// but a sequence hops between blocks, and a miss there stalls the dot products.
constexpr int64_t kPrefetch = 8;

#ifdef __AVX512F__
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// q.k for every query head of the group against one K row, 16 lanes at a time.
template <typename T, int NV>
inline void row_scores(const float* qf, const T* k, int64_t group, float* out, int64_t stride) {
  __m512 kv[NV];
  for (int c = 0; c < NV; ++c) kv[c] = load16(k + 16 * c);
  for (int64_t g = 0; g < group; ++g) {
    const float* qg = qf + g * NV * 16;
    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qg), kv[0]);
    for (int c = 1; c < NV; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), kv[c], acc);
    out[g * stride] = _mm512_reduce_add_ps(acc);
  }
}

// The four lane sums of a, b, c, d in one vector: one reduction tree for four
// dot products instead of four.
inline __m128 fold128(__m512 x) {
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1));
  const __m256 y = _mm256_add_ps(_mm512_castps512_ps256(x), hi);
  return _mm_add_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1));
}
inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m128 ab = _mm_hadd_ps(fold128(a), fold128(b));
  const __m128 cd = _mm_hadd_ps(fold128(c), fold128(d));
  return _mm_hadd_ps(ab, cd);
}

// Scores of four K rows at once (head_dim <= 64: the rows stay in registers);
// out[g * stride + 0..3] are adjacent in the [group, len] score table.
template <typename T, int NV>
inline void four_row_scores(const float* qf, const T* const* rows, int64_t group, float* out,
                            int64_t stride) {
  __m512 kv[4][NV];
  for (int t = 0; t < 4; ++t)
    for (int c = 0; c < NV; ++c) kv[t][c] = load16(rows[t] + 16 * c);
  for (int64_t g = 0; g < group; ++g) {
    const float* qg = qf + g * NV * 16;
    __m512 acc[4];
    for (int t = 0; t < 4; ++t) acc[t] = _mm512_setzero_ps();
    for (int c = 0; c < NV; ++c) {
      const __m512 qc = _mm512_loadu_ps(qg + 16 * c);
      for (int t = 0; t < 4; ++t) acc[t] = _mm512_fmadd_ps(qc, kv[t][c], acc[t]);
    }
    _mm_storeu_ps(out + g * stride, sum4(acc[0], acc[1], acc[2], acc[3]));
  }
}

// acc[g] += p[g] * v for every query head of the group.
template <typename T, int NV>
inline void row_accumulate(const T* v, const float* p, int64_t stride, int64_t group, float* acc) {
  __m512 vv[NV];
  for (int c = 0; c < NV; ++c) vv[c] = load16(v + 16 * c);
  for (int64_t g = 0; g < group; ++g) {
    const __m512 pg = _mm512_set1_ps(p[g * stride]);
    float* ag = acc + g * NV * 16;
    for (int c = 0; c < NV; ++c)
      _mm512_storeu_ps(ag + 16 * c, _mm512_fmadd_ps(pg, vv[c], _mm512_loadu_ps(ag + 16 * c)));
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

// One (sequence, KV head) pair: the G query heads sharing that KV head attend
// over the context rows addr[0:len]. NV > 0: head_dim is NV vectors of 16.
template <typename T, typename Q, int NV>
void attend_one(const Q* q, Q* out, const T* k_rows, const T* v_rows, int64_t row_stride,
                int64_t head_offset, const int64_t* addr, int64_t len, int64_t group,
                int64_t dim, float scale, float softcap, std::vector<float>& scores,
                std::vector<float>& buf) {
  // scores is [group, len]: the softmax runs over contiguous rows.
  scores.resize(static_cast<size_t>(group * len));
  buf.resize(static_cast<size_t>(2 * group * dim + dim + group));
  float* qf = buf.data();          // [group, dim] scaled queries
  float* acc = qf + group * dim;   // [group, dim] weighted sum of V
  float* row = acc + group * dim;  // [dim] scratch row (scalar path)
  float* total = row + dim;        // [group] softmax denominators
  for (int64_t i = 0; i < group * dim; ++i) qf[i] = to_float(q[i]) * scale;
  const T* k_base = k_rows + head_offset;
  const T* v_base = v_rows + head_offset;
  int64_t j = 0;
#ifdef __AVX512F__
  if constexpr (NV > 0 && NV <= 4) {
    for (; j + 4 <= len; j += 4) {
      for (int64_t t = j + kPrefetch; t < std::min(j + kPrefetch + 4, len); ++t)
        __builtin_prefetch(k_base + addr[t] * row_stride);
      const T* rows[4];
      for (int t = 0; t < 4; ++t) rows[t] = k_base + addr[j + t] * row_stride;
      four_row_scores<T, NV>(qf, rows, group, scores.data() + j, len);
    }
  }
#endif
  for (; j < len; ++j) {
    if (j + kPrefetch < len) __builtin_prefetch(k_base + addr[j + kPrefetch] * row_stride);
    float* sj = scores.data() + j;
#ifdef __AVX512F__
    if constexpr (NV > 0) {
      row_scores<T, NV>(qf, k_base + addr[j] * row_stride, group, sj, len);
    } else
#endif
    {
      row_scores_any<T>(qf, k_base + addr[j] * row_stride, group, dim, row, sj, len);
    }
  }
  if (softcap > 0.f) {
    for (int64_t i = 0; i < group * len; ++i)
      scores[i] = std::tanh(scores[i] / softcap) * softcap;
  }
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores.data() + g * len;
    float m = -FLT_MAX;
    for (int64_t j = 0; j < len; ++j) m = std::max(m, sg[j]);
    float t = 0.f;
    for (int64_t j = 0; j < len; ++j) {
      sg[j] = std::exp(sg[j] - m);
      t += sg[j];
    }
    total[g] = t;
  }
  std::fill(acc, acc + group * dim, 0.f);
  for (int64_t j = 0; j < len; ++j) {
    if (j + kPrefetch < len) __builtin_prefetch(v_base + addr[j + kPrefetch] * row_stride);
    const float* pj = scores.data() + j;
#ifdef __AVX512F__
    if constexpr (NV > 0) {
      row_accumulate<T, NV>(v_base + addr[j] * row_stride, pj, len, group, acc);
    } else
#endif
    {
      row_accumulate_any<T>(v_base + addr[j] * row_stride, pj, len, group, dim, row, acc);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const float inv = 1.f / total[g];
    for (int64_t d = 0; d < dim; ++d) out[g * dim + d] = static_cast<Q>(acc[g * dim + d] * inv);
  }
}

template <typename T, typename Q>
void run(const at::Tensor& q, at::Tensor& out, const at::Tensor& k_rows,
         const at::Tensor& v_rows, const at::Tensor& addr, const at::Tensor& offsets,
         double scale, double softcap, int64_t window) {
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_rows.size(1) / dim, group = heads / kv_heads;
  const int64_t row_stride = k_rows.stride(0);
  const Q* qp = q.data_ptr<Q>();
  Q* op = out.data_ptr<Q>();
  const T* kp = k_rows.data_ptr<T>();
  const T* vp = v_rows.data_ptr<T>();
  const int64_t* ap = addr.data_ptr<int64_t>();
  const int64_t* offs = offsets.data_ptr<int64_t>();
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> scores, buf;
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t b = task / kv_heads, h = task % kv_heads;
      int64_t begin = offs[b];
      const int64_t end = offs[b + 1];
      // Positions are consecutive, so a sliding window keeps the newest keys.
      if (window > 0 && end - begin > window) begin = end - window;
      const int64_t at = (b * heads + h * group) * dim;
      const float sc = static_cast<float>(scale), cap = static_cast<float>(softcap);
      const int64_t len = end - begin;
      auto one = [&](auto nv) {
        attend_one<T, Q, decltype(nv)::value>(qp + at, op + at, kp, vp, row_stride, h * dim,
                                              ap + begin, len, group, dim, sc, cap, scores,
                                              buf);
      };
      switch (dim) {  // head sizes models use get unrolled vector code
        case 16: one(std::integral_constant<int, 1>{}); break;
        case 32: one(std::integral_constant<int, 2>{}); break;
        case 64: one(std::integral_constant<int, 4>{}); break;
        case 80: one(std::integral_constant<int, 5>{}); break;
        case 96: one(std::integral_constant<int, 6>{}); break;
        case 128: one(std::integral_constant<int, 8>{}); break;
        case 256: one(std::integral_constant<int, 16>{}); break;
        default: one(std::integral_constant<int, 0>{}); break;
      }
    }
  });
}

template <typename T>
void run_for_query(const at::Tensor& q, at::Tensor& out, const at::Tensor& k_rows,
                   const at::Tensor& v_rows, const at::Tensor& addr,
                   const at::Tensor& offsets, double scale, double softcap, int64_t window) {
  switch (q.scalar_type()) {
    case at::kFloat:
      return run<T, float>(q, out, k_rows, v_rows, addr, offsets, scale, softcap, window);
    case at::kBFloat16:
      return run<T, c10::BFloat16>(q, out, k_rows, v_rows, addr, offsets, scale, softcap, window);
    case at::kHalf:
      return run<T, c10::Half>(q, out, k_rows, v_rows, addr, offsets, scale, softcap, window);
    default:
      TORCH_CHECK(false, "paged_decode: unsupported query dtype ", q.scalar_type());
  }
}

// q [B, H, D]; k_rows / v_rows [N, KVH * D] (row stride may exceed the width);
// addr: the context rows of every sequence, concatenated oldest first;
// offsets [B + 1]: sequence b owns addr[offsets[b]:offsets[b + 1]].
// softcap <= 0 and window <= 0 mean none. Returns [B, H, D] in q's dtype.
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_rows, const at::Tensor& v_rows,
                        const at::Tensor& addr, const at::Tensor& offsets, double scale,
                        double softcap, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "paged_decode: q must be contiguous [B, H, D]");
  TORCH_CHECK(k_rows.dim() == 2 && k_rows.stride(1) == 1, "paged_decode: k_rows must be [N, row]");
  TORCH_CHECK(v_rows.sizes() == k_rows.sizes() && v_rows.strides() == k_rows.strides(),
              "paged_decode: k_rows and v_rows differ in shape");
  TORCH_CHECK(k_rows.scalar_type() == v_rows.scalar_type(), "paged_decode: K/V dtypes differ");
  TORCH_CHECK(addr.scalar_type() == at::kLong && addr.is_contiguous(), "paged_decode: addr int64");
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.is_contiguous() &&
                  offsets.numel() == q.size(0) + 1,
              "paged_decode: offsets must be int64 [B + 1]");
  const int64_t dim = q.size(2);
  TORCH_CHECK(k_rows.size(1) % dim == 0, "paged_decode: row width not a multiple of head_dim");
  const int64_t kv_heads = k_rows.size(1) / dim;
  TORCH_CHECK(kv_heads > 0 && q.size(1) % kv_heads == 0,
              "paged_decode: query heads not a multiple of KV heads");
  at::Tensor out = at::empty_like(q);
  switch (k_rows.scalar_type()) {
    case at::kFloat:
      run_for_query<float>(q, out, k_rows, v_rows, addr, offsets, scale, softcap, window);
      break;
    case at::kBFloat16:
      run_for_query<c10::BFloat16>(q, out, k_rows, v_rows, addr, offsets, scale, softcap, window);
      break;
    case at::kHalf:
      run_for_query<c10::Half>(q, out, k_rows, v_rows, addr, offsets, scale, softcap, window);
      break;
    default:
      TORCH_CHECK(false, "paged_decode: unsupported KV dtype ", k_rows.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(radixmux, m) {
  m.def(
      "paged_decode(Tensor q, Tensor k_rows, Tensor v_rows, Tensor addr, Tensor offsets, "
      "float scale, float softcap, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixmux, CPU, m) { m.impl("paged_decode", &paged_decode); }
