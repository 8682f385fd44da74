// Scalar loads of the KV and activation dtypes as float, shared by the kernels.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace radixmux {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  // bfloat16 is the high half of a float32: a shift the compiler vectorises.
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }
// float8 e4m3 (the --kv-cache-dtype fp8 arena): exponent bias 7, no
// infinities. A normal value moves its exponent to float's bias; a subnormal
// one (exponent 0) is its 3-bit mantissa times 2^-9.
inline float to_float(c10::Float8_e4m3fn x) {
  const uint32_t sign = static_cast<uint32_t>(x.x & 0x80) << 24;
  const uint32_t em = x.x & 0x7f;
  float out;
  if (em >> 3) {
    const uint32_t bits = sign | ((em << 20) + (120u << 23));
    std::memcpy(&out, &bits, sizeof(out));
  } else {
    out = static_cast<float>(em) * 0.001953125f;
    if (sign) out = -out;
  }
  return out;
}

}  // namespace radixmux
