// Floats rounded to bfloat16 by integer arithmetic, shared by the element-wise
// kernels and the AMX linear kernel's fused activation, so both round alike.
#pragma once

#ifdef __AVX512F__
#include <immintrin.h>

namespace radixmux {

// Floats rounded to bfloat16 (nearest even, denormals kept), as 32-bit lanes.
inline __m512i round16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd)), 16);
}

}  // namespace radixmux
#endif
