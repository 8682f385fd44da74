// The AMX path: attend_state_amx, both products on bfloat16 AMX tiles, and the
// packed K/V an extend's tasks share.
//
// Part of paged_decode.cpp, the one translation unit that includes it: the
// unnamed namespace gives its code the internal linkage it had as one file.
#pragma once

#include "tiled.h"

namespace {

// One KV head's keys of one sequence, gathered and packed once for all the
// tasks (query blocks) that read them: K rows [steps * kAmxKeys, dim] and
// V^T [steps][dim, kAmxKeys / 2], per step of kAmxKeys keys from the first
// key. A long prompt's blocks each read most of its keys: packed per task,
// a key was gathered and repacked once per block after it.
struct PackedKV {
  const uint16_t* k = nullptr;
  const uint32_t* vt = nullptr;
};

#ifdef RADIXMUX_AMX
// ---- many query rows on AMX tiles (bfloat16 K/V and queries) ---------------------------
// attend_state_tiled's contract and order of work with both products on AMX
// (tdpbf16ps: bfloat16 pairs into float accumulators, 16 x 16 x 32 per
// instruction). The scores come out transposed, S^T = K . Q^T, with the K
// rows gathered into whole tiles and the queries as the same bfloat16 pairs
// qt [dim / 2, rp], so softmax_tile runs on them unchanged (rows in lanes);
// its weights go back as pairs P^T [keys / 2, rp] (rounded to bfloat16, as
// the tiled path and torch's CPU attention round them) and O^T += V^T . P^T
// accumulates in acc_t [dim, rp], rescaled lane by lane. Key tiles start at
// fixed offsets from the first key and each output element is a per-row sum
// in a fixed order, so a row's result does not depend on which other rows
// share its task (a prompt's tokens come out the same computed whole or over
// its cached prefix).

// dst[j * ldd + i] = src[i * lds + j] for a 16 x 16 block of 32-bit values.
inline void transpose16(const uint32_t* src, int64_t lds, uint32_t* dst, int64_t ldd) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + i * lds);
  for (int i = 0; i < 16; i += 2) {  // per 128-bit lane: a0 b0 a1 b1 | a2 b2 a3 b3
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // r[i + c], lane L: rows i..i+3 of column 4L + c
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // column 4L + c: lane L of r[c], r[4 + c], r[8 + c], r[12 + c]
    const __m512i u0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44);
    const __m512i u1 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
    const __m512i u2 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
    const __m512i u3 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
    _mm512_storeu_si512(dst + (0 + c) * ldd, _mm512_shuffle_i32x4(u0, u1, 0x88));
    _mm512_storeu_si512(dst + (4 + c) * ldd, _mm512_shuffle_i32x4(u0, u1, 0xDD));
    _mm512_storeu_si512(dst + (8 + c) * ldd, _mm512_shuffle_i32x4(u2, u3, 0x88));
    _mm512_storeu_si512(dst + (12 + c) * ldd, _mm512_shuffle_i32x4(u2, u3, 0xDD));
  }
}

// Whether this process may use AMX tiles (asked once).
inline bool amx_ready() { return radixmux::request_amx(); }

// C (+)= A . B over one row of 32 x 32 blocks: both of attend_state_amx's
// products (S^T = K . Q^T, O^T += V^T . P^T) are this loop nest. A is 32 rows
// of `steps` 64-byte chunks of bfloat16 pairs, lda bytes apart; B [16 * steps,
// 16 * groups] pairs and C [32, 16 * groups] floats have rows of rp lanes. C
// starts from zero, or with Accumulate from what it holds. Tiles: 0-3 C,
// 4-5 A, 6-7 B (all 16 x 64 bytes).
template <bool Accumulate>
inline void amx_block_row(const void* a, int64_t lda, int64_t steps, const uint32_t* b, float* c,
                          int64_t rp, int64_t groups) {
  const int64_t ld = rp * 4;  // bytes per row of B and C
  const char* a0 = static_cast<const char*>(a);
  const char* a1 = a0 + 16 * lda;
  for (int64_t g = 0; g < groups; g += 2) {
    const bool two = g + 1 < groups;
    float* c0 = c + 16 * g;
    float* c1 = c0 + 16 * rp;
    if constexpr (Accumulate) {
      _tile_loadd(0, c0, ld);
      _tile_loadd(1, c1, ld);
      if (two) {
        _tile_loadd(2, c0 + 16, ld);
        _tile_loadd(3, c1 + 16, ld);
      }
    } else {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int64_t k = 0; k < steps; ++k) {
      const uint32_t* bk = b + 16 * k * rp + 16 * g;
      _tile_loadd(4, a0 + 64 * k, lda);
      _tile_loadd(5, a1 + 64 * k, lda);
      _tile_loadd(6, bk, ld);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 5, 6);
      if (two) {
        _tile_loadd(7, bk + 16, ld);
        _tile_dpbf16ps(2, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, c0, ld);
    _tile_stored(1, c1, ld);
    if (two) {
      _tile_stored(2, c0 + 16, ld);
      _tile_stored(3, c1 + 16, ld);
    }
  }
}

// The K rows of keys addr[j0 .. j0 + n) as whole tiles: kb [kAmxKeys, dim]
// (zero rows past n: their scores are never used).
template <int NV>
inline void gather_k_step(const c10::BFloat16* k_base, int64_t row_stride, const int64_t* addr,
                          int64_t j0, int64_t n, uint16_t* kb) {
  constexpr int64_t dim = NV * 16, bytes = dim * 2;
  for (int64_t k = 0; k < n; ++k)
    std::memcpy(kb + k * dim, k_base + addr[j0 + k] * row_stride, bytes);
  if (n < kAmxKeys) std::memset(kb + n * dim, 0, (kAmxKeys - n) * bytes);
}

// V^T of the same keys as the P.V tiles read it: vt [dim, kAmxKeys / 2] key
// pairs (row d: the step's pairs at d; zeros past n: weight 0 on a zero row
// adds nothing), through v2 [kAmxKeys / 2, dim] (V rows interleaved by pairs).
template <int NV>
inline void pack_v_step(const c10::BFloat16* v_base, int64_t row_stride, const int64_t* addr,
                        int64_t j0, int64_t n, uint32_t* v2, uint32_t* vt) {
  constexpr int64_t dim = NV * 16, pairs = kAmxKeys / 2;
  const int64_t chunks = (n + 31) / 32;  // key chunks of one V^T tile (32 keys)
  for (int64_t k = 0; k < 16 * chunks; ++k) {
    if (2 * k < n) {
      const bool both = 2 * k + 1 < n;
      interleave_rows<NV>(v_base + addr[j0 + 2 * k] * row_stride,
                          both ? v_base + addr[j0 + 2 * k + 1] * row_stride : nullptr,
                          v2 + k * dim);
    } else {
      std::memset(v2 + k * dim, 0, dim * 4);
    }
  }
  for (int64_t pb = 0; pb < chunks; ++pb)
    for (int64_t d = 0; d < dim; d += 16)
      transpose16(v2 + 16 * pb * dim + d, dim, vt + d * pairs + 16 * pb, pairs);
}

template <int NV>
__attribute__((noinline)) void attend_state_amx(const uint32_t* qt, int64_t rows, int64_t rp,
                                                const c10::BFloat16* k_base,
                                                const c10::BFloat16* v_base, int64_t row_stride,
                                                const int64_t* addr, int64_t len,
                                                const int32_t* first, const int32_t* last,
                                                float scale, float softcap, Scratch& sc, float* m,
                                                float* s, float* acc, PackedKV packed = {},
                                                bool resume = false) {
  static_assert(NV % 2 == 0, "head_dim must be a multiple of 32 (one tile's k)");
  constexpr int64_t dim = NV * 16, KT = kAmxKeys, pairs = KT / 2;
  const int64_t groups = rp / 16;
  sc.kf.resize(static_cast<size_t>(KT * dim / 2 + pairs * rp));  // K rows, then P^T pairs
  sc.vf.resize(static_cast<size_t>(2 * pairs * dim));            // V pairs, then V^T
  sc.scores.resize(static_cast<size_t>(KT * rp));
  sc.row.assign(static_cast<size_t>(dim * rp), 0.f);  // acc_t
  sc.rowstate.resize(static_cast<size_t>(3 * rp));
  uint16_t* kb = reinterpret_cast<uint16_t*>(sc.kf.data());  // [KT, dim] bfloat16
  uint32_t* p2 = reinterpret_cast<uint32_t*>(sc.kf.data() + KT * dim / 2);  // [pairs, rp]
  uint32_t* v2 = reinterpret_cast<uint32_t*>(sc.vf.data());                 // [pairs, dim]
  uint32_t* vt = v2 + pairs * dim;  // [dim, pairs]: row d is V^T's 32 keys at d
  float *st = sc.scores.data(), *acc_t = sc.row.data();
  float *mr = sc.rowstate.data(), *sr = mr + rp, *rescale = sr + rp;
  std::fill(mr, mr + rp, -FLT_MAX);
  std::fill(sr, sr + rp, 0.f);
  if (resume) {
    // The rows' state over earlier keys (this path's own output, ending at a
    // step boundary: decode.h cuts group prefixes at kAlignKeys = kAmxKeys),
    // taken back into the accumulators' transposed layout exactly, so the
    // steps below go on as one pass over both key runs would.
    std::copy(m, m + rows, mr);
    std::copy(s, s + rows, sr);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t d = 0; d < dim; ++d) acc_t[d * rp + r] = acc[r * dim + d];
  }
  const int32_t first_all = *std::max_element(first, first + rows);
  const int32_t last_all = *std::min_element(last, last + rows);
  constexpr int64_t bytes = dim * static_cast<int64_t>(sizeof(c10::BFloat16));
  prefetch_tile(k_base, v_base, row_stride, addr, 0, KT, len, bytes);
  radixmux::configure_full_tiles();
  for (int64_t j0 = 0; j0 < len; j0 += KT) {
    const int64_t n = std::min(KT, len - j0);
    // A packed step holds real keys past n (later tokens'), where a step
    // packed here holds zeros: the scores past n are never read and their
    // weights are 0, so both give the same bits.
    const uint16_t* ks = kb;
    if (packed.k) ks = packed.k + j0 * dim;
    else gather_k_step<NV>(k_base, row_stride, addr, j0, n, kb);
    // S^T [KT, rp] = K . Q^T in 2 x 2 blocks of 16 keys x 16 query rows
    // (key groups wholly past n skipped). The next step's K and V slices are
    // prefetched a block's keys at a time between the blocks' products, not
    // all at once before them: a burst of 512 prefetches holds the core until
    // the fill buffers drain, with no tile work queued behind it (cascade
    // decodes, 16 sequences in groups of 4 over 1,000 shared + 100 own keys,
    // 30 layers: 11.8-12.5 -> 11.2-11.7 ms a step).
    const int64_t key_groups = (n + 15) / 16;
    for (int64_t kg = 0; kg < KT / 16; kg += 2) {
      if (!packed.k) prefetch_tile(k_base, v_base, row_stride, addr, j0 + KT + 16 * kg, 32, len, bytes);
      if (kg < key_groups)
        amx_block_row<false>(ks + 16 * kg * dim, dim * 2, NV / 2, qt, st + 16 * kg * rp, rp, groups);
    }
    // P^T and V as key pairs (zeros past n: weight 0 on a zero row adds nothing).
    const bool masked = j0 < first_all || j0 + n - 1 > last_all;
    const int64_t chunks = (n + 31) / 32;  // key chunks of one V^T tile (32 keys)
    softmax_tile(st, n, rp, j0, masked, first, last, scale, softcap, mr, sr, rescale, p2,
                 16 * chunks);
    const uint32_t* vs = vt;
    if (packed.vt) vs = packed.vt + j0 / KT * dim * pairs;
    else pack_v_step<NV>(v_base, row_stride, addr, j0, n, v2, vt);
    // The accumulators' rescale, skipped for a group whose maxima all held.
    for (int64_t g = 0; g < groups; ++g) {
      const __m512 c = _mm512_loadu_ps(rescale + 16 * g);
      if (_mm512_cmp_ps_mask(c, _mm512_set1_ps(1.f), _CMP_EQ_OQ) == 0xffff) continue;
      for (int64_t d = 0; d < dim; ++d) {
        float* a = acc_t + d * rp + 16 * g;
        _mm512_storeu_ps(a, _mm512_mul_ps(_mm512_loadu_ps(a), c));
      }
    }
    // O^T [dim, rp] += V^T . P^T in 2 x 2 blocks of 16 dims x 16 rows, the
    // accumulators in tiles over the step's key chunks.
    for (int64_t dg = 0; dg < NV; dg += 2)
      amx_block_row<true>(vs + 16 * dg * pairs, pairs * 4, chunks, p2, acc_t + 16 * dg * rp, rp,
                          groups);
  }
  // acc [rows, dim] = acc_t^T: whole 16-row groups by blocks, the rest by element.
  const int64_t whole = rows / 16 * 16;
  for (int64_t r = 0; r < whole; r += 16)
    for (int64_t d = 0; d < dim; d += 16)
      transpose16(reinterpret_cast<const uint32_t*>(acc_t) + d * rp + r, rp,
                  reinterpret_cast<uint32_t*>(acc) + r * dim + d, dim);
  for (int64_t r = whole; r < rows; ++r)
    for (int64_t d = 0; d < dim; ++d) acc[r * dim + d] = acc_t[d * rp + r];
  std::copy(mr, mr + rows, m);
  std::copy(sr, sr + rows, s);
}
#endif

}  // namespace
