// e^x on 16 floats at once, inline, shared by the attention and element-wise kernels.
#pragma once

#ifdef __AVX512F__
#include <immintrin.h>

namespace radixmux {

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
  for (const float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

}  // namespace radixmux
#endif
