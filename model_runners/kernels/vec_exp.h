// e^x on a vector of floats at once, inline, shared by the attention and element-wise kernels:
// 16 with AVX-512 (exp16), 8 with AVX2 + FMA (exp8).
#pragma once

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>

namespace radixmux {

// The degree-6 Taylor coefficients of e^r, highest first after 1/720.
inline constexpr float kExpTaylor[6] = {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};

#ifdef __AVX512F__
// e^x for x in [-87, 88] (callers clamp), inline: the vector math library's
// exp is a call that spills every live vector. x = n ln2 + r with
// |r| <= ln2 / 2 (ln2 in two parts, so r is exact), e^r by its degree-6
// Taylor polynomial (relative error 1.2e-7), times 2^n by vscalefps.
inline __m512 exp16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-6f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  for (const float c : kExpTaylor) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}
#else
// exp16's arithmetic on 8 lanes, for x in [-87, 88]: 2^n (n in [-126, 127]
// there, a normal float) built from its exponent bits, AVX2 having no vscalefps.
inline __m256 exp8(__m256 x) {
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-6f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  for (const float c : kExpTaylor) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i two_n =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}
#endif

}  // namespace radixmux
#endif
