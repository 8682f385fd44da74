// bfloat16 arithmetic shared by the element-wise kernels (act_and_mul) and the
// AMX linear kernel's fused activation (amx_gate_up_act), so the two give the
// same bits by construction: rounding by integer arithmetic, and the
// activation table's product.
#pragma once

#ifdef __AVX512F__
#include <immintrin.h>

#include <cstdint>

namespace radixmux {

// Floats rounded to bfloat16 (nearest even, denormals kept), as 32-bit lanes.
inline __m512i round16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd)), 16);
}

// table[g] * u for 16 lanes, rounded to bfloat16: `gate_bits` holds the gate
// values' bf16 bits (one per 32-bit lane), `table` act(g) for every bf16 bit
// pattern (65,537 entries: 32-bit gathers at 2-byte steps read the entry in
// the low half, and the last one a spare).
inline __m256i table_act_mul(__m512i gate_bits, __m512 up, const uint16_t* table) {
  const __m512i a = _mm512_slli_epi32(_mm512_i32gather_epi32(gate_bits, table, 2), 16);
  return _mm512_cvtepi32_epi16(round16(_mm512_mul_ps(_mm512_castsi512_ps(a), up)));
}

}  // namespace radixmux
#endif
