// The per-key path (attend_state: scores, softmax, weighted V one key row at a
// time), the scratch buffers every path reuses, and the deterministic mode's
// key alignment.
//
// Part of paged_decode.cpp, the one translation unit that includes it: the
// unnamed namespace gives its code the internal linkage it had as one file.
#pragma once

#include "vectors.h"

namespace {

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

}  // namespace
