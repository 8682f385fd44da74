// Greedy sampling's argmax over a vocabulary, read straight from bfloat16 logits.
//
// The runner's logits come out of the output projection in the model's dtype.
// Greedy rows need only the index of each row's largest logit, but torch's
// path converts the whole [rows, vocab] block to float first and then runs
// max(-1): at 15 rows of a 49k vocabulary that was 0.59 ms for the copy and
// 0.44 for the max, every step. Converting a bfloat16 to float is exact, so the
// index is the same when each value is widened in a register instead.
//
// The result is torch's: the first index of the largest value, where -0 and
// +0 are equal and a NaN counts as largest (the first NaN wins).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr uint16_t kMagnitude = 0x7fff;
constexpr uint16_t kInfinity = 0x7f80;  // a magnitude above this is a NaN

// The first NaN of a row (its bits: magnitude above infinity's); -1 if none.
int64_t first_nan(const uint16_t* row, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if ((row[i] & kMagnitude) > kInfinity) return i;
  return -1;
}

#ifdef __AVX512F__
inline __m512 widen(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// Index of the first largest value of one row of n >= 16 bfloat16 values.
// Each lane keeps its own first maximum (a later value replaces it only when
// strictly greater); the row's answer is the smallest index among the lanes
// that hold the row's maximum. NaNs never compare greater, so they are looked
// for apart, on the bits (the library builds with -ffast-math: no float test
// for NaN can be trusted there).
int64_t argmax_row(const uint16_t* row, int64_t n) {
  const auto* p = reinterpret_cast<const __m256i*>(row);
  __m256i bits = _mm256_loadu_si256(p);
  __m512 best = widen(bits);
  __m512i best_at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i at = best_at;
  const __m512i step = _mm512_set1_epi32(16);
  const __m256i magnitude = _mm256_set1_epi16(static_cast<int16_t>(kMagnitude));
  __m256i largest = _mm256_and_si256(bits, magnitude);  // unsigned max of magnitudes
  int64_t i = 16;
  for (; i + 16 <= n; i += 16) {
    bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + i));
    at = _mm512_add_epi32(at, step);
    const __m512 v = widen(bits);
    const __mmask16 greater = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, greater, v);
    best_at = _mm512_mask_mov_epi32(best_at, greater, at);
    largest = _mm256_max_epu16(largest, _mm256_and_si256(bits, magnitude));
  }
  alignas(64) uint16_t mags[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(mags), largest);
  for (int l = 0; l < 16; ++l)
    if (mags[l] > kInfinity) return first_nan(row, n);
  alignas(64) float vals[16];
  alignas(64) int32_t idx[16];
  _mm512_store_ps(vals, best);
  _mm512_store_si512(idx, best_at);
  float top = vals[0];
  int64_t top_at = idx[0];
  for (int l = 1; l < 16; ++l)
    if (vals[l] > top || (vals[l] == top && idx[l] < top_at)) {
      top = vals[l];
      top_at = idx[l];
    }
  // The tail past the last whole vector, in order: only a strictly greater
  // value (at a later index) moves the answer.
  for (; i < n; ++i) {
    if ((row[i] & kMagnitude) > kInfinity) return first_nan(row, n);
    const float v = c10::detail::f32_from_bits(row[i]);
    if (v > top) {
      top = v;
      top_at = i;
    }
  }
  return top_at;
}
#endif

bool has_argmax_rows() {
#ifdef __AVX512F__
  return true;
#else
  return false;
#endif
}

// logits [rows, vocab] bfloat16 (rows contiguous) -> int64 [rows]: each row's
// argmax as torch's max(-1).indices gives it on the float values.
at::Tensor argmax_rows(const at::Tensor& logits) {
#ifdef __AVX512F__
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kBFloat16,
              "argmax_rows: [rows, vocab] bfloat16 logits, got ", logits.sizes(), " ",
              logits.scalar_type());
  TORCH_CHECK(logits.size(1) >= 16, "argmax_rows: a vocabulary of at least 16, got ",
              logits.size(1));
  const at::Tensor x = logits.stride(1) == 1 ? logits : logits.contiguous();
  const int64_t rows = x.size(0), n = x.size(1), ld = x.stride(0);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const auto* base = reinterpret_cast<const uint16_t*>(x.data_ptr());
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = argmax_row(base + r * ld, n);
  });
  return out;
#else
  TORCH_CHECK(false, "argmax_rows: this build has no AVX-512 (see has_argmax_rows)");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixmux, m) {
  m.def("has_argmax_rows() -> bool", &has_argmax_rows);
  m.def("argmax_rows(Tensor logits) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixmux, CPU, m) { m.impl("argmax_rows", &argmax_rows); }
