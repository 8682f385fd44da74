// Scalar loads of the KV and activation dtypes as float, shared by the kernels.
#pragma once

#include <c10/util/BFloat16.h>
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

}  // namespace radixmux
