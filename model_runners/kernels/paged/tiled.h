// The tiled paths: many query rows against a tile of keys in registers
// (AVX-512 and AVX2), few rows on AVX2 with the keys in the lanes, the online
// softmax of one tile, and attend_state_tiled.
//
// Part of paged_decode.cpp, the one translation unit that includes it: the
// unnamed namespace gives its code the internal linkage it had as one file.
#pragma once

#include "per_key.h"

namespace {

#ifdef RADIXMUX_KEY_VECTORS
// ---- many query rows at once: register-blocked tiles --------------------------------------
// When one key is scored against many query rows (a group's shared prefix)
// the per-key loops above spend most of their time reducing vectors to
// scalars and reloading accumulators. Here the query rows lie in the vector
// lanes instead: the queries are transposed once per task (rows padded to a
// multiple of the lanes, `rp`: 16, or 8 with AVX2), scores come out as
// st [keys, rp] from broadcast multiply-adds, the softmax runs online (per
// tile, across rows in lanes), and P.V accumulates into registers that stay
// put for a whole tile.

// Keys per tile: its K and V rows as floats stay in L1 (16 KB at head_dim 64).
constexpr int64_t kTile = 32;
// Fewest query rows for the tiled path: fewer leave too many lanes idle.
// With AVX2 the per-key path holds out longer (cascade decodes over 1,000
// shared + 100 own float32 keys, SmolLM2's shapes, 30 layers, 2 threads, a
// Zen 3 EPYC: groups of 4 sequences, 12 rows, 30.6 ms a step per key against
// 43.8 tiled; groups of 16, 48 rows, 24.3 against 25.1), while extends'
// 96-row blocks gain (bench_decode_attention --parts extend: 1.1-2.3x SDPA).
#ifdef __AVX512F__
constexpr int64_t kTiledRows = 12;
#else
constexpr int64_t kTiledRows = 64;
#endif
// Keys scored per block, and accumulator vectors held in registers: AVX-512's
// 32 registers take 8 keys x 2 row vectors of scores and a whole head row of
// P.V for up to 24 / NV rows; AVX2's 16 take 4 keys x 2 and 12 accumulators,
// P.V's head row in turns of at most 4 vectors (kColsAtOnce). The order of
// every sum is the same either way: key by key, per row and element.
// Tiles of K and V asked for ahead. With AVX2, one tile ahead left a few
// rows' work (a decode in deterministic mode: 3 rows a KV head) waiting on
// memory: --deterministic decodes of 16 float32 contexts of 1,100 keys,
// SmolLM2's shapes, 30 layers, Zen 3: 120-122 ms a step at one tile ahead,
// 106 at two, 106-124 at three, 121-141 at four (the default arithmetic: 81-93).
#ifdef __AVX512F__
constexpr int64_t kTilesAhead = 1;
#else
constexpr int64_t kTilesAhead = 2;
#endif
#ifdef __AVX512F__
constexpr int kScoreKeys = 8;
constexpr int kAccRegs = 24;
template <int W>
constexpr int kColsAtOnce = W;
#else
constexpr int kScoreKeys = 4;
constexpr int kAccRegs = 12;
template <int W>
constexpr int kColsAtOnce = W % 4 == 0 ? 4 : W % 2 == 0 ? 2 : 1;
#endif
#ifdef __AVX512BF16__
constexpr bool kBf16Dot = true;
#else
constexpr bool kBf16Dot = false;
#endif

// Calls block(std::integral_constant<int, B>, i) over i0..n-1 in blocks of
// B = KB, then of halved B for the remainder: every count is covered by a
// few unrolled block sizes.
template <int KB, typename F>
inline void blocks_of(int64_t i0, int64_t n, F&& block) {
  for (; i0 + KB <= n; i0 += KB) block(std::integral_constant<int, KB>{}, i0);
  if constexpr (KB > 1) {
    if (i0 < n) blocks_of<KB / 2>(i0, n, block);
  }
}

template <typename T, int NV>
inline void rows_to_float(const T* base, const int64_t* addr, int64_t row_stride, int64_t n,
                          float* dst) {
  for (int64_t j = 0; j < n; ++j) {
    const T* src = base + addr[j] * row_stride;
    for (int c = 0; c < kVecs<NV>; ++c)
      vstore(dst + j * NV * 16 + c * kLanes, vload(src + kLanes * c));
  }
}

// Asks for every cache line of the K, then the V, head slices (bytes long)
// of the tile of keys j0 .. min(j0 + n, len) - 1 ahead of use, into L2: a
// tile's worth of requests at once would fill L1's miss buffers and stall
// the core. Always inlined: called out of line, GCC 12 (modref) finds that
// it has no side effects, prefetches having none it can see, and deletes
// the call.
template <typename T>
__attribute__((always_inline)) inline void prefetch_tile(const T* k_base, const T* v_base,
                                                         int64_t row_stride, const int64_t* addr,
                                                         int64_t j0, int64_t n, int64_t len,
                                                         int64_t bytes) {
  const int64_t end = std::min(j0 + n, len);
  for (int64_t j = j0; j < end; ++j) prefetch_slice<2>(k_base + addr[j] * row_stride, bytes);
  for (int64_t j = j0; j < end; ++j) prefetch_slice<2>(v_base + addr[j] * row_stride, bytes);
}

// The tiles' two products (scores, P.V) are each one loop nest over a lane
// type L: FloatLanes, one float per 32-bit lane and an FMA per step, or, with
// AVX512-BF16, Bf16PairLanes, a bfloat16 pair per lane and vdpbf16ps per
// step (two multiply-adds per lane per instruction; bfloat16 products are
// exact in float, so its scores are as accurate as the float path's).
struct FloatLanes {
  using Elem = float;  // one lane of an operand row
  using Vec = vfloat;
  using Keys = const float*;  // a block's keys: float rows [KB, dim]
  static constexpr int kPer = 1;  // values per lane
  template <int NV>
  static Elem key(Keys kf, int k, int d) { return kf[k * NV * 16 + d]; }
  static Vec load(const Elem* p) { return vload(p); }
  static Vec broadcast(Elem x) { return vset1(x); }
  static vfloat madd(vfloat acc, Vec a, Vec b) { return vfma(a, b, acc); }
};

#ifdef __AVX512BF16__
struct Bf16PairLanes {
  using Elem = uint32_t;
  using Vec = __m512bh;
  using Keys = const c10::BFloat16* const*;  // a block's key rows, read in place
  static constexpr int kPer = 2;
  template <int NV>
  static Elem key(Keys keys, int k, int d) {
    uint32_t pair;
    std::memcpy(&pair, keys[k] + 2 * d, sizeof(pair));
    return pair;
  }
  static Vec load(const Elem* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static Vec broadcast(Elem x) { return (__m512bh)_mm512_set1_epi32(static_cast<int>(x)); }
  static __m512 madd(__m512 acc, Vec a, Vec b) { return _mm512_dpbf16_ps(acc, a, b); }
};
#endif

// st[k, kLanes * RV lanes] = q . k_k for KB keys and queries qt [dim /
// L::kPer, rp]: per step d, RV loads and KB broadcasts of lane d of key k into
// KB * RV accumulators.
template <typename L, int NV, int KB, int RV>
inline void score_block(const typename L::Elem* qt, int64_t rp, typename L::Keys keys, float* st) {
  vfloat acc[KB][RV];
  for (int k = 0; k < KB; ++k)
    for (int v = 0; v < RV; ++v) acc[k][v] = vzero();
  for (int d = 0; d < NV * 16 / L::kPer; ++d) {
    typename L::Vec qv[RV];
    for (int v = 0; v < RV; ++v) qv[v] = L::load(qt + d * rp + kLanes * v);
    for (int k = 0; k < KB; ++k) {
      const typename L::Vec kb = L::broadcast(L::template key<NV>(keys, k, d));
      for (int v = 0; v < RV; ++v) acc[k][v] = L::madd(acc[k][v], qv[v], kb);
    }
  }
  for (int k = 0; k < KB; ++k)
    for (int v = 0; v < RV; ++v) vstore(st + k * rp + kLanes * v, acc[k][v]);
}

#ifdef __AVX512BF16__
// P.V for bfloat16 V the same way: keys go in pairs, V rows interleaved lane
// by lane and the weights rounded to bfloat16 pairs, half the instructions
// of float FMAs. torch's own CPU attention rounds the weights to bfloat16 for
// its P.V as well.
alignas(64) constexpr uint16_t kInterleave32[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                                    37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                                    11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
alignas(64) constexpr uint16_t kInterleave16[32] = {0,  16, 1,  17, 2,  18, 3,  19, 4,  20, 5,
                                                    21, 6,  22, 7,  23, 8,  24, 9,  25, 10, 26,
                                                    11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

// dst[c][d] = (a[16c + d], b[16c + d]) as one 32-bit lane (b null: zeros).
template <int NV>
inline void interleave_rows(const c10::BFloat16* a, const c10::BFloat16* b, uint32_t* dst) {
  const __m512i idx = _mm512_load_si512(kInterleave32);
  for (int c = 0; c < NV; ++c) {
    const __m512i x = _mm512_castsi256_si512(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 16 * c)));
    const __m512i y = b ? _mm512_castsi256_si512(_mm256_loadu_si256(
                              reinterpret_cast<const __m256i*>(b + 16 * c)))
                        : _mm512_setzero_si512();
    _mm512_storeu_si512(dst + 16 * c, _mm512_permutex2var_epi16(x, idx, y));
  }
}

// Rows' weights of two keys (pb null: the second is absent) as bfloat16
// pairs: dst[r] = (pa[r], pb[r]) for rp rows.
inline void pair_weights(const float* pa, const float* pb, int64_t rp, uint32_t* dst) {
  const __m512i idx = _mm512_load_si512(kInterleave16);
  for (int64_t r = 0; r < rp; r += 16) {
    const __m512 b = pb ? _mm512_loadu_ps(pb + r) : _mm512_setzero_ps();
    const __m512bh both = _mm512_cvtne2ps_pbh(b, _mm512_loadu_ps(pa + r));
    _mm512_storeu_si512(dst + r, _mm512_permutexvar_epi16(idx, (__m512i)both));
  }
}
#endif

// acc[r0 + i] = acc[r0 + i] * rescale[r0 + i] + sum_k pt[k, r0 + i] * v_k for
// RB rows: the accumulators stay in registers for the whole tile (for each
// turn of kColsAtOnce vectors of the head row). A step k is one key
// (FloatLanes: pt [n, rp], vt [n, dim] floats) or a key pair (Bf16PairLanes:
// pt and vt from pair_weights and interleave_rows).
template <typename L, int NV, int RB>
inline void accumulate_block(const typename L::Elem* pt, int64_t rp, const typename L::Elem* vt,
                             int64_t steps, const float* rescale, int64_t r0, float* acc) {
  constexpr int W = kVecs<NV>, CW = kColsAtOnce<W>;
  for (int c0 = 0; c0 < W; c0 += CW) {
    vfloat a[RB][CW];
    for (int i = 0; i < RB; ++i) {
      const vfloat c = vset1(rescale[r0 + i]);
      for (int v = 0; v < CW; ++v)
        a[i][v] = vmul(c, vload(acc + (r0 + i) * NV * 16 + (c0 + v) * kLanes));
    }
    for (int64_t k = 0; k < steps; ++k) {
      const typename L::Elem* pk = pt + k * rp + r0;
      for (int v = 0; v < CW; ++v) {
        const typename L::Vec vv = L::load(vt + (k * W + c0 + v) * kLanes);
        for (int i = 0; i < RB; ++i) a[i][v] = L::madd(a[i][v], L::broadcast(pk[i]), vv);
      }
    }
    for (int i = 0; i < RB; ++i)
      for (int v = 0; v < CW; ++v) vstore(acc + (r0 + i) * NV * 16 + (c0 + v) * kLanes, a[i][v]);
  }
}

// e^x for the softmax: x in [kMinExponent, 0] (vec_exp.h).
#ifdef __AVX512F__
inline vfloat exp_nonpositive(vfloat x) { return radixmux::exp16(x); }
#else
inline vfloat exp_nonpositive(vfloat x) { return radixmux::exp8(x); }
#endif

// The softmax's lane masks of visible keys: AVX-512's mask registers, or
// AVX2's vectors of all-ones lanes.
#ifdef __AVX512F__
using vmask = __mmask16;
inline vmask all_lanes() { return 0xffff; }
// Lanes r whose rows see key j: first[r] <= j <= last[r].
inline vmask lanes_seeing(int32_t j, const int32_t* first, const int32_t* last) {
  const __m512i jv = _mm512_set1_epi32(j);
  return _mm512_cmp_epi32_mask(jv, _mm512_loadu_si512(first), _MM_CMPINT_NLT) &
         _mm512_cmp_epi32_mask(jv, _mm512_loadu_si512(last), _MM_CMPINT_LE);
}
// max(t, x) in the lanes of m, t in the others.
inline vfloat vmax_where(vfloat t, vmask m, vfloat x) { return _mm512_mask_max_ps(t, m, t, x); }
// x in the lanes of m, 0 in the others.
inline vfloat vkeep(vmask m, vfloat x) { return _mm512_maskz_mov_ps(m, x); }
#else
using vmask = __m256;
inline vmask all_lanes() { return _mm256_castsi256_ps(_mm256_set1_epi32(-1)); }
inline vmask lanes_seeing(int32_t j, const int32_t* first, const int32_t* last) {
  const __m256i jv = _mm256_set1_epi32(j);
  const __m256i f = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(first));
  const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(last));
  const __m256i hidden = _mm256_or_si256(_mm256_cmpgt_epi32(f, jv), _mm256_cmpgt_epi32(jv, l));
  return _mm256_castsi256_ps(_mm256_xor_si256(hidden, _mm256_set1_epi32(-1)));
}
inline vfloat vmax_where(vfloat t, vmask m, vfloat x) {
  return _mm256_blendv_ps(t, _mm256_max_ps(t, x), m);
}
inline vfloat vkeep(vmask m, vfloat x) { return _mm256_and_ps(m, x); }

// ---- few query rows on AVX2: the keys in the lanes ------------------------------------------
// A decode in deterministic mode has a KV head's few query rows (3 for
// SmolLM2, 4 for Gemma 3 or Llama 3 8B) in 8 lanes: score_block spends a
// broadcast and an FMA per key and input for 3 useful lanes of 8. With at
// most kFewRows rows the tile's K rows go transposed instead (kt [dim,
// kTile]: 8x8 blocks in registers), and a row's scores of 16 keys come from
// two loads and two FMAs per input, each (row, key) the same FMA chain over
// the inputs from zero as score_block's: the same bits.
constexpr int64_t kFewRows = 4;

// r[i] lane j <- r[j] lane i.
inline void transpose8(__m256 r[8]) {
  __m256 t[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  __m256 u[8];
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

// kt [dim, kTile]: the K rows of keys addr[0 .. n) as floats, transposed
// (keys past n: zeros, never read).
template <typename T, int NV>
inline void keys_to_lanes(const T* base, const int64_t* addr, int64_t row_stride, int64_t n,
                          float* kt) {
  constexpr int64_t dim = NV * 16;
  for (int64_t k0 = 0; k0 < kTile; k0 += 8) {
    const T* rows[8];
    for (int i = 0; i < 8; ++i) rows[i] = k0 + i < n ? base + addr[k0 + i] * row_stride : nullptr;
    for (int64_t d = 0; d < dim; d += 8) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i) r[i] = rows[i] ? vload(rows[i] + d) : vzero();
      transpose8(r);
      for (int i = 0; i < 8; ++i) vstore(kt + (d + i) * kTile + k0, r[i]);
    }
  }
}

// st [n, rp] = scores of the R query rows of qt [dim, rp] against kt's keys
// (padding lanes 0).
template <int NV, int R>
inline void score_few_rows(const float* qt, int64_t rp, const float* kt, int64_t n, float* st) {
  constexpr int64_t dim = NV * 16;
  alignas(32) float out[R][kTile];
  for (int64_t h = 0; h < kTile; h += 16) {
    vfloat acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = vzero();
    for (int64_t d = 0; d < dim; ++d) {
      const vfloat k0 = vload(kt + d * kTile + h), k1 = vload(kt + d * kTile + h + 8);
      for (int r = 0; r < R; ++r) {
        const vfloat q = vset1(qt[d * rp + r]);
        acc[r][0] = vfma(q, k0, acc[r][0]);
        acc[r][1] = vfma(q, k1, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      vstore(out[r] + h, acc[r][0]);
      vstore(out[r] + h + 8, acc[r][1]);
    }
  }
  for (int64_t k = 0; k < n; ++k)
    for (int64_t r = 0; r < rp; ++r) st[k * rp + r] = r < R ? out[r][k] : 0.f;
}
#endif

// One tile of the online softmax over st [n, rp], kLanes rows per vector: scale
// (and soft-cap) the scores, raise each row's running max m over the tile's
// visible keys (j0 + k in [first[r], last[r]]; every key when !masked),
// rescale its sum s, leave in rescale[r] the factor its accumulator needs,
// and turn the scores into weights (exactly 0 for keys a row must not see):
// in st as floats, or, given p2, as bfloat16 pairs p2 [pairs, rp] of keys
// (2k, 2k + 1) for k < pairs (zeros past n), st keeping the scaled scores.
// Maxima and sums run as four interleaved chains (keys k mod 4): a single
// chain waits on each add's latency; the order is fixed, so a row's result
// still depends only on its own scores. Never inlined: -ffast-math lets GCC
// reassociate the sums differently in each place it is compiled, and a
// caller inlining it would change the weights in the last bit.
__attribute__((noinline)) void softmax_tile(float* st, int64_t n, int64_t rp, int64_t j0,
                                            bool masked, const int32_t* first,
                                            const int32_t* last, float scale, float softcap,
                                            float* m, float* s, float* rescale,
                                            uint32_t* p2 = nullptr, int64_t pairs = 0) {
  if (softcap > 0.f) {  // vectorised through the vector math library's tanh
    const float inner = scale / softcap;
    for (int64_t i = 0; i < n * rp; ++i) st[i] = std::tanh(st[i] * inner) * softcap;
    scale = 1.f;
  }
  const vfloat sc = vset1(scale), floor = vset1(kMinExponent);
  for (int64_t r = 0; r < rp; r += kLanes) {
    auto seen = [&](int64_t k) -> vmask {
      if (!masked) return all_lanes();
      return lanes_seeing(static_cast<int32_t>(j0 + k), first + r, last + r);
    };
    auto score = [&](int64_t k) { return vmul(vload(st + k * rp + r), sc); };
    const vfloat old_max = vload(m + r);
    // Named chains, not an array indexed by k & 3: that one lived on the
    // stack, each step waiting on a store-to-load forward.
    vfloat t0 = old_max, t1 = old_max, t2 = old_max, t3 = old_max;
    auto raise = [&](vfloat& t, int64_t k) { t = vmax_where(t, seen(k), score(k)); };
    int64_t k4 = 0;
    for (; k4 + 4 <= n; k4 += 4) {
      raise(t0, k4);
      raise(t1, k4 + 1);
      raise(t2, k4 + 2);
      raise(t3, k4 + 3);
    }
    if (k4 < n) raise(t0, k4);
    if (k4 + 1 < n) raise(t1, k4 + 1);
    if (k4 + 2 < n) raise(t2, k4 + 2);
    const vfloat top = vmax(vmax(t0, t1), vmax(t2, t3));
    // Both -FLT_MAX (nothing seen yet): factor 1 on a zero sum.
    const vfloat c = exp_nonpositive(vmax(vsub(old_max, top), floor));
    // Key k's weight joins chain k mod 4 (named, as for the maxima).
    vfloat s0 = vzero(), s1 = s0, s2 = s0, s3 = s0;
    auto weight = [&](int64_t k, vfloat& part) {
      if (k >= n) return vzero();
      const vfloat p = vkeep(seen(k), exp_nonpositive(vmax(vsub(score(k), top), floor)));
      part = vadd(part, p);
      return p;
    };
#ifdef __AVX512BF16__
    if (p2) {
      const __m512i interleave = _mm512_load_si512(kInterleave16);
      auto store_pair = [&](int64_t k, __m512 a, __m512 b) {
        const __m512bh both = _mm512_cvtne2ps_pbh(b, a);
        _mm512_storeu_si512(p2 + k * rp + r, _mm512_permutexvar_epi16(interleave, (__m512i)both));
      };
      // Pair k holds keys 2k and 2k + 1: chains 0 and 1 for even k, 2 and 3 for odd.
      int64_t k = 0;
      for (; k + 2 <= pairs; k += 2) {
        const __m512 a = weight(2 * k, s0), b = weight(2 * k + 1, s1);
        store_pair(k, a, b);
        const __m512 c = weight(2 * k + 2, s2), d = weight(2 * k + 3, s3);
        store_pair(k + 1, c, d);
      }
      if (k < pairs) {
        const __m512 a = weight(2 * k, s0), b = weight(2 * k + 1, s1);
        store_pair(k, a, b);
      }
    } else
#endif
    {
      int64_t k = 0;
      for (; k + 4 <= n; k += 4) {
        vstore(st + k * rp + r, weight(k, s0));
        vstore(st + (k + 1) * rp + r, weight(k + 1, s1));
        vstore(st + (k + 2) * rp + r, weight(k + 2, s2));
        vstore(st + (k + 3) * rp + r, weight(k + 3, s3));
      }
      if (k < n) vstore(st + k * rp + r, weight(k, s0));
      if (k + 1 < n) vstore(st + (k + 1) * rp + r, weight(k + 1, s1));
      if (k + 2 < n) vstore(st + (k + 2) * rp + r, weight(k + 2, s2));
    }
    const vfloat sum = vadd(vadd(s0, s1), vadd(s2, s3));
    vstore(m + r, top);
    vstore(s + r, vadd(vmul(vload(s + r), c), sum));
    vstore(rescale + r, c);
  }
}

// attend_state for many rows: the same contract, but the queries come
// transposed and unscaled (qt: [dim, rp] floats, or [dim / 2, rp] bfloat16
// pairs when DP; padding rows zero), and row r sees keys first[r]..last[r]
// (padding rows see none). Padding rows' weights are never read. With
// `resume`, m, s and acc come in holding the rows' state over earlier keys,
// and the online softmax goes on from it: a state left at a tile boundary and
// resumed gives the same bits as one pass over both runs of keys.
template <typename T, int NV, bool DP>
__attribute__((noinline)) void attend_state_tiled(const void* qt, int64_t rows, int64_t rp,
                                                  const T* k_base, const T* v_base,
                                                  int64_t row_stride, const int64_t* addr,
                                                  int64_t len, const int32_t* first,
                                                  const int32_t* last, float scale, float softcap,
                                                  Scratch& sc, float* m, float* s, float* acc,
                                                  bool resume) {
  constexpr int64_t dim = NV * 16;
  constexpr int RB = std::max(1, std::min(8, kAccRegs / kColsAtOnce<kVecs<NV>>));  // acc rows
  sc.kf.resize(static_cast<size_t>(std::max(kTile * dim, kTile / 2 * rp)));  // or P pairs
  sc.vf.resize(kTile * dim);
  sc.scores.resize(static_cast<size_t>(kTile * rp));
  sc.rowstate.resize(static_cast<size_t>(3 * rp));
  float *kf = sc.kf.data(), *vf = sc.vf.data(), *st = sc.scores.data();
  float *mr = sc.rowstate.data(), *sr = mr + rp, *rescale = sr + rp;
  std::fill(mr, mr + rp, -FLT_MAX);
  std::fill(sr, sr + rp, 0.f);
  if (resume) {
    std::copy(m, m + rows, mr);
    std::copy(s, s + rows, sr);
  } else {
    std::fill(acc, acc + rows * dim, 0.f);
  }
  // Tiles inside [first_all, last_all] are seen whole by every row: no masks.
  const int32_t first_all = *std::max_element(first, first + rows);
  const int32_t last_all = *std::min_element(last, last + rows);
  const int64_t bytes = dim * static_cast<int64_t>(sizeof(T));
  constexpr bool fp8 = std::is_same_v<T, c10::Float8_e4m3fn>;
  if constexpr (fp8) {
    sc.k16.resize(kTile * dim);
    sc.v16.resize(kTile * dim);
  }
  prefetch_tile(k_base, v_base, row_stride, addr, 0, kTilesAhead * kTile, len, bytes);
  for (int64_t j0 = 0; j0 < len; j0 += kTile) {
    const int64_t n = std::min(kTile, len - j0);
    // Later tiles' K and V arrive while this one is computed.
    prefetch_tile(k_base, v_base, row_stride, addr, j0 + kTilesAhead * kTile, kTile, len, bytes);
    auto score_rows = [&](auto rv, int64_t v) {
      constexpr int RV = decltype(rv)::value;
      // Blocks of kScoreKeys keys, a piece's last few one by one (two block
      // shapes compile in half the time of a halving series, for a rare tail).
      auto block = [&](auto kb, int64_t k0) {
        constexpr int KB = decltype(kb)::value;
#ifdef __AVX512BF16__
        if constexpr (DP) {
          const c10::BFloat16* keys[KB];
          for (int k = 0; k < KB; ++k) {
            if constexpr (fp8) keys[k] = sc.k16.data() + (k0 + k) * dim;
            else keys[k] = k_base + addr[j0 + k0 + k] * row_stride;
          }
          score_block<Bf16PairLanes, NV, KB, RV>(static_cast<const uint32_t*>(qt) + v, rp, keys,
                                                 st + k0 * rp + v);
          return;
        }
#endif
        score_block<FloatLanes, NV, KB, RV>(static_cast<const float*>(qt) + v, rp, kf + k0 * dim,
                                            st + k0 * rp + v);
      };
      int64_t k0 = 0;
      for (; k0 + kScoreKeys <= n; k0 += kScoreKeys)
        block(std::integral_constant<int, kScoreKeys>{}, k0);
      for (; k0 < n; ++k0) block(std::integral_constant<int, 1>{}, k0);
    };
#ifndef __AVX512F__
    const bool few = rows <= kFewRows;  // the keys in the lanes (AVX2 only)
#else
    constexpr bool few = false;
#endif
    if (few) {
#ifndef __AVX512F__
      keys_to_lanes<T, NV>(k_base, addr + j0, row_stride, n, kf);
      const float* q = static_cast<const float*>(qt);
      if (rows == 1) score_few_rows<NV, 1>(q, rp, kf, n, st);
      else if (rows == 2) score_few_rows<NV, 2>(q, rp, kf, n, st);
      else if (rows == 3) score_few_rows<NV, 3>(q, rp, kf, n, st);
      else score_few_rows<NV, 4>(q, rp, kf, n, st);
#endif
    } else {
      if constexpr (!DP) rows_to_float<T, NV>(k_base, addr + j0, row_stride, n, kf);
#ifdef __AVX512BF16__
      if constexpr (DP && fp8) {
        for (int64_t k = 0; k < n; ++k) {
          fp8_to_bf16(k_base + addr[j0 + k] * row_stride, sc.k16.data() + k * dim, dim);
          fp8_to_bf16(v_base + addr[j0 + k] * row_stride, sc.v16.data() + k * dim, dim);
        }
      }
#endif
      int64_t v = 0;
      for (; v + 2 * kLanes <= rp; v += 2 * kLanes) score_rows(std::integral_constant<int, 2>{}, v);
      if (v < rp) score_rows(std::integral_constant<int, 1>{}, v);
    }
    const bool masked = j0 < first_all || j0 + n - 1 > last_all;
    softmax_tile(st, n, rp, j0, masked, first, last, scale, softcap, mr, sr, rescale);
#ifdef __AVX512BF16__
    if constexpr (std::is_same_v<T, c10::BFloat16> || (DP && fp8)) {
      uint32_t* v2 = reinterpret_cast<uint32_t*>(vf);  // [pairs, dim]: as many bytes as vf
      uint32_t* p2 = reinterpret_cast<uint32_t*>(kf);  // [pairs, rp]
      const int64_t pairs = (n + 1) / 2;
      auto v_row = [&](int64_t k) -> const c10::BFloat16* {
        if constexpr (fp8) return sc.v16.data() + k * dim;
        else return v_base + addr[j0 + k] * row_stride;
      };
      for (int64_t k = 0; k < pairs; ++k) {
        const bool two = 2 * k + 1 < n;
        interleave_rows<NV>(v_row(2 * k), two ? v_row(2 * k + 1) : nullptr, v2 + k * dim);
        pair_weights(st + 2 * k * rp, two ? st + (2 * k + 1) * rp : nullptr, rp, p2 + k * rp);
      }
      blocks_of<RB>(0, rows, [&](auto rb, int64_t r0) {
        accumulate_block<Bf16PairLanes, NV, decltype(rb)::value>(p2, rp, v2, pairs, rescale, r0,
                                                                 acc);
      });
      continue;
    }
#endif
    rows_to_float<T, NV>(v_base, addr + j0, row_stride, n, vf);
    blocks_of<RB>(0, rows, [&](auto rb, int64_t r0) {
      accumulate_block<FloatLanes, NV, decltype(rb)::value>(st, rp, vf, n, rescale, r0, acc);
    });
  }
  std::copy(mr, mr + rows, m);
  std::copy(sr, sr + rows, s);
}
#endif

}  // namespace
