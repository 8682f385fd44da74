// How a K (or V) table of the arena is addressed, shared by the attention
// ops (paged/) and the K/V writes (kv_write.cpp).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace radixmux {

// A table the ops get: [N, KVH * D] rows, or [N, KVH, D] with any head
// stride (the arena's head-major blocks, memory/layout.py, where a row's
// heads are a block's worth of rows apart). Key `a` of KV head h starts at
// base + a * row + h * head elements; only a head's start differs between
// the two forms, so a head's keys are always base + a * row.
struct KVTable {
  int64_t kv_heads, row, head;
};

inline KVTable kv_table(const at::Tensor& t, int64_t dim) {
  if (t.dim() == 3) return {t.size(1), t.stride(0), t.stride(1)};
  return {t.size(1) / dim, t.stride(0), dim};
}

}  // namespace radixmux
