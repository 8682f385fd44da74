// Float32 linear layers over weights held in fewer bits, for CPUs with AVX2 +
// FMA and no bfloat16 arithmetic (where `--dtype auto` runs float32).
//
// A float32 weight often holds far fewer distinct values than its 32 bits can
// name, and a decode step on such a CPU is bound by weight traffic (SmolLM2's
// layers at one row ran at 7-9 GB/s through torch's float32 product on a
// 2-core AMD EPYC whose cores stream 28 GB/s: MKL takes a generic path on AMD
// CPUs). Each weight is stored in a compact form that holds exactly its value
// and is widened back to float in registers, so a step reads fewer bytes;
// products and sums are float32 as before, over the very same weights. Two
// forms:
//
// - bfloat16 (widen_pack): a model published in bfloat16 and run in float32
//   has weights whose low 16 bits are zero. Layout [N/16][K][16] uint16, zeros
//   past N. The 16 values of one block at one k are 8 32-bit words; word j
//   holds output j in its low half and output 8 + j in its high half, so
//   `word << 16` is outputs 0-7 as floats and `word & 0xffff0000` outputs 8-15.
// - a grid of 4 or 8 bits (grid_pack): a model de-quantised from a GGUF file
//   (the embedded models: Q4_1, Q4_K, Q5_0, Q8_0) holds, in every run of 32
//   weights along k, values fma(q, d, m) for small integers q and one float
//   scale d and offset m. Layout [N/16][K/32][group]: per 16 outputs and 32 k,
//   d of the 16 outputs, m of the 16 (floats), then per k the 16 q's: 8 bytes
//   at 4 bits (byte j: output j low nibble, 8 + j high nibble), 16 at 8 bits.
//   grid_pack keeps a weight only if that fma gives back every value bit for
//   bit: 6 bits a weight read instead of 32 at 4 bits, 10 at 8.
//
// Each row's sum runs over k in order, one float accumulator per output,
// whatever the number of rows in the call, so a row's result does not depend
// on its batch-mates.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define RADIXMUX_WIDEN 1
#endif

namespace {

constexpr int64_t kBlock = 16;  // outputs per packed block
constexpr int64_t kGroupK = 32;  // k per grid scale and offset
constexpr int64_t kHeader = 2 * kBlock * sizeof(float);  // d[16], m[16] of a grid group

// Bytes of one grid group (header and 32 k of 16 q's) at `bits` (4 or 8).
constexpr int64_t group_bytes(int64_t bits) { return kHeader + kGroupK * kBlock * bits / 8; }

// Where output `row` of a packed bfloat16 weight sits within its block's 16 values at one k.
inline int64_t slot_of(int64_t row) {
  const int64_t j = row % kBlock;
  return j < 8 ? 2 * j : 2 * (j - 8) + 1;
}

bool has_widen_linear() {
#ifdef RADIXMUX_WIDEN
  return true;
#else
  return false;
#endif
}

// A [N, K] float32 or bfloat16 weight in the bfloat16 layout above (float32
// values are rounded to nearest: exact for weights that came from bfloat16).
at::Tensor widen_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "widen_pack: a 2-d weight, got ", weight.dim(), " dims");
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
              "widen_pack: float32 or bfloat16 weights, got ", weight.scalar_type());
  const at::Tensor w = weight.to(at::kBFloat16).contiguous();
  const int64_t n = w.size(0), k = w.size(1), blocks = (n + kBlock - 1) / kBlock;
  at::Tensor out = at::zeros({blocks, k, kBlock}, w.options());
  const auto* src = reinterpret_cast<const uint16_t*>(w.data_ptr());
  auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t j = 0; j < kBlock; ++j) {
        const int64_t row = b * kBlock + j;
        if (row >= n) break;
        uint16_t* col = dst + b * k * kBlock + slot_of(row);
        const uint16_t* r = src + row * k;
        for (int64_t kk = 0; kk < k; ++kk) col[kk * kBlock] = r[kk];
      }
  });
  return out;
}

// ---- Grid packing: finding d, m and the q's of each run of 32 weights. ----

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// Whether fma(q_i, d, m) gives back every v_i bit for bit with q_i in [0, levels].
// Compared as bits: the library builds with -ffast-math.
bool fits(const float* v, int levels, float d, float m, uint8_t* q) {
  if (!(d > 0.0f) || (bits_of(d) & 0x7f800000u) == 0x7f800000u) return false;
  for (int i = 0; i < kGroupK; ++i) {
    const double t = std::nearbyint((static_cast<double>(v[i]) - m) / d);
    if (t < 0 || t > levels) return false;
    const uint32_t got = bits_of(std::fmaf(static_cast<float>(t), d, m)), want = bits_of(v[i]);
    if (got != want && ((got | want) & 0x7fffffffu) != 0) return false;  // (+0 and -0 pass)
    q[i] = static_cast<uint8_t>(t);
  }
  return true;
}

// The float step nearest `step`, its half-precision rounding (GGUF scales are
// fp16) and its neighbours: one of them is the d that produced the values.
bool fits_near(const float* v, int levels, double step, float m, uint8_t* q, float& d) {
  const float f = static_cast<float>(step);
  const float half = static_cast<float>(c10::Half(f));
  for (const float c : {f, half, std::nextafter(f, 0.0f), std::nextafter(f, 2.0f * f)})
    if (fits(v, levels, c, m, q)) return d = c, true;
  return false;
}

// d and m (= the smallest value) for one run of 32 weights, or false.
bool fit_group(const float* v, int levels, uint8_t* q, float& d, float& m) {
  float lo = v[0], hi = v[0], amax = 0.0f;
  for (int i = 0; i < kGroupK; ++i) {
    if ((bits_of(v[i]) & 0x7f800000u) == 0x7f800000u) return false;  // inf or nan
    lo = std::min(lo, v[i]);
    hi = std::max(hi, v[i]);
    amax = std::max(amax, std::fabs(v[i]));
  }
  m = lo;
  if (bits_of(hi) == bits_of(lo)) {
    d = 1.0f;
    std::fill(q, q + kGroupK, 0);
    return fits(v, levels, d, m, q);
  }
  const double span = static_cast<double>(hi) - lo;
  // The whole range over every level (Q4_1), the largest magnitude over the
  // signed formats' largest q (Q8_0: 127; Q5_0: 16), then the smallest gap
  // between values as one step (any other format).
  for (const double step : {span / levels, amax / 127.0, amax / 16.0})
    if (fits_near(v, levels, step, m, q, d)) return true;
  float s[kGroupK];
  std::copy(v, v + kGroupK, s);
  std::sort(s, s + kGroupK);
  double gap = span;
  for (int i = 1; i < kGroupK; ++i)
    if (s[i] > s[i - 1]) gap = std::min(gap, static_cast<double>(s[i]) - s[i - 1]);
  // (Taken as 1, 2 or 3 steps: the values need not hold two neighbouring q's.)
  for (int r = 1; r <= 3; ++r) {
    const double steps = std::nearbyint(span / (gap / r));
    if (steps >= 1 && steps <= levels && fits_near(v, levels, span / steps, m, q, d)) return true;
  }
  return false;
}

// A [N, K] float32 weight as a 4- or 8-bit grid (layout above), or an empty
// tensor if some run of 32 weights is on no such grid (or K % 32 != 0).
at::Tensor grid_pack(const at::Tensor& weight, int64_t bits) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat,
              "grid_pack: a 2-d float32 weight, got ", weight.sizes(), " ", weight.scalar_type());
  TORCH_CHECK(bits == 4 || bits == 8, "grid_pack: 4 or 8 bits, got ", bits);
  const int64_t n = weight.size(0), k = weight.size(1);
  if (k == 0 || k % kGroupK || n == 0) return at::empty({0}, weight.options().dtype(at::kByte));
  const at::Tensor w = weight.contiguous();
  const int64_t blocks = (n + kBlock - 1) / kBlock, groups = k / kGroupK;
  const int64_t gbytes = group_bytes(bits);
  at::Tensor out = at::zeros({blocks, groups, gbytes}, w.options().dtype(at::kByte));
  const float* src = w.data_ptr<float>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int levels = (1 << bits) - 1;
  std::atomic<bool> ok{true};
  at::parallel_for(0, n, 64, [&](int64_t r0, int64_t r1) {
    uint8_t q[kGroupK];
    for (int64_t row = r0; row < r1 && ok.load(std::memory_order_relaxed); ++row) {
      const int64_t b = row / kBlock, j = row % kBlock;
      for (int64_t g = 0; g < groups; ++g) {
        float d, m;
        if (!fit_group(src + row * k + g * kGroupK, levels, q, d, m)) {
          ok = false;
          return;
        }
        uint8_t* grp = dst + (b * groups + g) * gbytes;
        std::memcpy(grp + j * sizeof(float), &d, sizeof d);
        std::memcpy(grp + (kBlock + j) * sizeof(float), &m, sizeof m);
        uint8_t* data = grp + kHeader;
        for (int i = 0; i < kGroupK; ++i) {
          if (bits == 8) {
            data[i * kBlock + j] = q[i];
          } else {
            const int shift = j < 8 ? 0 : 4;
            data[i * 8 + j % 8] |= static_cast<uint8_t>(q[i] << shift);
          }
        }
      }
    }
  });
  if (!ok) return at::empty({0}, w.options().dtype(at::kByte));
  return out;
}

#ifdef RADIXMUX_WIDEN
#define UNROLL _Pragma("GCC unroll 16")

// How each compact form gives 16 outputs' weights at one k (lo: outputs 0-7,
// hi: 8-15). A block's bytes are contiguous: block_bytes(k) of them.
struct Bf16Form {
  static constexpr int64_t kGroup = 1;  // k per scale group: no scales
  struct Scales {};
  static int64_t block_bytes(int64_t k) { return k * kBlock * 2; }
  static Scales scales(const uint8_t*, int64_t) { return {}; }
  static const uint8_t* at(const uint8_t* block, int64_t g, int64_t) { return block + g * 32; }
  // Each k's 32 bytes, 32 vectors ahead.
  static void prefetch(const uint8_t* block, int64_t g) {
    _mm_prefetch(reinterpret_cast<const char*>(block + (g + 32) * 32), _MM_HINT_T0);
  }
  static void decode(const uint8_t* p, const Scales&, __m256& lo, __m256& hi) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
  }
};

template <int Bits>
struct GridForm {
  static constexpr int64_t kGroup = kGroupK;
  static constexpr int64_t kBytes = group_bytes(Bits);
  struct Scales {
    __m256 d_lo, d_hi, m_lo, m_hi;
  };
  static int64_t block_bytes(int64_t k) { return k / kGroupK * kBytes; }
  static Scales scales(const uint8_t* block, int64_t g) {
    const auto* f = reinterpret_cast<const float*>(block + g * kBytes);
    return {_mm256_loadu_ps(f), _mm256_loadu_ps(f + 8), _mm256_loadu_ps(f + 16),
            _mm256_loadu_ps(f + 24)};
  }
  static const uint8_t* at(const uint8_t* block, int64_t g, int64_t i) {
    return block + g * kBytes + kHeader + i * (kBlock * Bits / 8);
  }
  // A whole group, two groups ahead: a line per 64 bytes, not a prefetch per k.
  static void prefetch(const uint8_t* block, int64_t g) {
    for (int64_t line = 0; line < kBytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(block + (g + 2) * kBytes + line), _MM_HINT_T0);
  }
  static void decode(const uint8_t* p, const Scales& s, __m256& lo, __m256& hi) {
    __m256i q_lo, q_hi;
    if constexpr (Bits == 4) {
      const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
      q_lo = _mm256_and_si256(b, _mm256_set1_epi32(0xf));
      q_hi = _mm256_srli_epi32(b, 4);
    } else {
      q_lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
      q_hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
    }
    lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q_lo), s.d_lo, s.m_lo);
    hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q_hi), s.d_hi, s.m_hi);
  }
};

// A panel of blocks already widened to floats ([k][16] a block): a grid's
// calls of several row groups widen each panel once (widen_panel) and every
// group reads it from L2, instead of decoding it again per group.
struct F32Form {
  static constexpr int64_t kGroup = 1;
  struct Scales {};
  static int64_t block_bytes(int64_t k) { return k * kBlock * 4; }
  static Scales scales(const uint8_t*, int64_t) { return {}; }
  static void prefetch(const uint8_t*, int64_t) {}
  static const uint8_t* at(const uint8_t* block, int64_t g, int64_t) { return block + g * 64; }
  static void decode(const uint8_t* p, const Scales&, __m256& lo, __m256& hi) {
    lo = _mm256_loadu_ps(reinterpret_cast<const float*>(p));
    hi = _mm256_loadu_ps(reinterpret_cast<const float*>(p) + 8);
  }
};

// Blocks [b0, b1) of a packed weight widened into `out` in F32Form's layout.
template <class F>
void widen_panel(const uint8_t* w, int64_t b0, int64_t b1, int64_t k, float* out) {
  const int64_t stride = F::block_bytes(k);
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* wb = w + b * stride;
    float* ob = out + (b - b0) * k * kBlock;
    for (int64_t g = 0; g < k / F::kGroup; ++g) {
      const typename F::Scales s = F::scales(wb, g);
      for (int64_t i = 0; i < F::kGroup; ++i) {
        __m256 lo, hi;
        F::decode(F::at(wb, g, i), s, lo, hi);
        _mm256_storeu_ps(ob + (g * F::kGroup + i) * kBlock, lo);
        _mm256_storeu_ps(ob + (g * F::kGroup + i) * kBlock + 8, hi);
      }
    }
  }
}

// The first `cols` (at most 16) of 8 + 8 outputs (lo, hi) plus their bias.
inline void store_block(__m256 lo, __m256 hi, const float* bias, float* y, int64_t cols) {
  const __m256i first = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i mask_lo = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(cols)), first);
  const __m256i mask_hi = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(cols) - 8), first);
  if (bias) {
    lo = _mm256_add_ps(lo, _mm256_maskload_ps(bias, mask_lo));
    hi = _mm256_add_ps(hi, _mm256_maskload_ps(bias + 8, mask_hi));
  }
  _mm256_maskstore_ps(y, mask_lo, lo);
  _mm256_maskstore_ps(y + 8, mask_hi, hi);
}

// R rows of x ([R][k] floats, row stride ldx) times NB consecutive packed
// blocks starting at block b0 (w points at block wfirst): R x NB x 2
// accumulators stay in registers over all of k, and each weight decoded
// serves every row. Every loop over R and NB unrolled, the partial block
// stored through masks and the tile not inlined: otherwise gcc kept the
// accumulators in memory and stored them on every k (a third of the speed).
template <class F, int R, int NB>
__attribute__((noinline)) void widen_tile(const float* x, int64_t ldx, int64_t k,
                                          const uint8_t* w, int64_t wfirst, int64_t b0,
                                          const float* bias, float* y, int64_t ldy, int64_t n) {
  __m256 acc[R][NB][2];
  UNROLL for (int r = 0; r < R; ++r)
    UNROLL for (int b = 0; b < NB; ++b) acc[r][b][0] = acc[r][b][1] = _mm256_setzero_ps();
  const int64_t stride = F::block_bytes(k);
  const uint8_t* wb = w + (b0 - wfirst) * stride;
  for (int64_t g = 0; g < k / F::kGroup; ++g) {
    typename F::Scales s[NB];
    UNROLL for (int b = 0; b < NB; ++b) {
      F::prefetch(wb + b * stride, g);
      s[b] = F::scales(wb + b * stride, g);
    }
    for (int64_t i = 0; i < F::kGroup; ++i) {
      const int64_t kk = g * F::kGroup + i;
      __m256 lo[NB], hi[NB];
      UNROLL for (int b = 0; b < NB; ++b) {
        F::decode(F::at(wb + b * stride, g, i), s[b], lo[b], hi[b]);
      }
      UNROLL for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_broadcast_ss(x + r * ldx + kk);
        UNROLL for (int b = 0; b < NB; ++b) {
          acc[r][b][0] = _mm256_fmadd_ps(xv, lo[b], acc[r][b][0]);
          acc[r][b][1] = _mm256_fmadd_ps(xv, hi[b], acc[r][b][1]);
        }
      }
    }
  }
  UNROLL for (int b = 0; b < NB; ++b) {
    const int64_t c0 = (b0 + b) * kBlock;
    const int64_t cols = std::min<int64_t>(kBlock, n - c0);
    UNROLL for (int r = 0; r < R; ++r)
      store_block(acc[r][b][0], acc[r][b][1], bias ? bias + c0 : nullptr, y + r * ldy + c0, cols);
  }
}

// Blocks per register tile at each row count: R x NB x 2 accumulators, at
// most 12 of the 16 vector registers (the rest hold the decoded weights and a
// broadcast).
template <class F, int R>
constexpr int blocks_for_rows() {
  if (F::kGroup > 1) return R == 1 ? 2 : 1;  // (a grid's scales take 4 registers a block)
  return R == 1 ? 4 : R == 2 ? 2 : 1;
}

// Rows [m0, m0 + R) (R <= 6) times blocks [b0, b1).
template <class F, int R>
void widen_rows(const float* x, int64_t k, const uint8_t* w, int64_t wfirst, int64_t b0,
                int64_t b1, const float* bias, float* y, int64_t n) {
  constexpr int NB = blocks_for_rows<F, R>();
  int64_t b = b0;
  for (; b + NB <= b1; b += NB) widen_tile<F, R, NB>(x, k, k, w, wfirst, b, bias, y, n, n);
  for (; b < b1; ++b) widen_tile<F, R, 1>(x, k, k, w, wfirst, b, bias, y, n, n);
}

template <class F>
void widen_group(int64_t rows, const float* x, int64_t k, const uint8_t* w, int64_t wfirst,
                 int64_t b0, int64_t b1, const float* bias, float* y, int64_t n) {
  switch (rows) {
    case 1: return widen_rows<F, 1>(x, k, w, wfirst, b0, b1, bias, y, n);
    case 2: return widen_rows<F, 2>(x, k, w, wfirst, b0, b1, bias, y, n);
    case 3: return widen_rows<F, 3>(x, k, w, wfirst, b0, b1, bias, y, n);
    case 4: return widen_rows<F, 4>(x, k, w, wfirst, b0, b1, bias, y, n);
    case 5: return widen_rows<F, 5>(x, k, w, wfirst, b0, b1, bias, y, n);
    default: return widen_rows<F, 6>(x, k, w, wfirst, b0, b1, bias, y, n);
  }
}

constexpr int64_t kGroupRows = 6;  // rows sharing each weight load
// Blocks per thread task: a panel (4 blocks: 72 KB of bfloat16 at k = 576)
// stays in L2 while every group of rows passes over it.
constexpr int64_t kPanelBlocks = 4;
// A grid's panel widened to floats: at most this many bytes (in L2 with the rows).
constexpr int64_t kWidePanelBytes = 256 << 10;

// x ([m, k]) times every block of a packed weight into y ([m, n]).
template <class F>
void widen_product(const float* xp, int64_t m, int64_t k, const uint8_t* wp, int64_t blocks,
                   const float* bp, float* yp, int64_t n) {
  // One thread for a small product: waking the other costs more than it saves.
  const int64_t work = blocks * k * 32 * ((m + kGroupRows - 1) / kGroupRows);
  const int64_t threads = work > (1 << 17) ? std::max(1, at::get_num_threads()) : 1;
  // Each thread takes an equal run of blocks (a layer of 12 blocks splits 6:6,
  // not 8:4 as whole panels would), panel by panel.
#pragma omp parallel for schedule(static, 1) num_threads(threads) if (threads > 1)
  for (int64_t t = 0; t < threads; ++t) {
    const int64_t first = blocks * t / threads, last = blocks * (t + 1) / threads;
    for (int64_t b0 = first; b0 < last; b0 += kPanelBlocks) {
      const int64_t b1 = std::min(last, b0 + kPanelBlocks);
      // Rows in groups as even as 6 allows (8 rows: 4 + 4, not 6 + 2).
      const int64_t groups = (m + kGroupRows - 1) / kGroupRows;
      if (F::kGroup > 1 && groups > 1) {
        // A grid under several row groups: its panel widened once, in slices
        // that stay in L2. The same floats as decoded in registers, summed in
        // the same order: a row's bits do not change.
        thread_local std::vector<float> wide;
        const int64_t slice = std::clamp<int64_t>(kWidePanelBytes / (k * kBlock * 4), 1, b1 - b0);
        wide.resize(slice * k * kBlock);
        for (int64_t s0 = b0; s0 < b1; s0 += slice) {
          const int64_t s1 = std::min(b1, s0 + slice);
          widen_panel<F>(wp, s0, s1, k, wide.data());
          const auto* panel = reinterpret_cast<const uint8_t*>(wide.data());
          for (int64_t g = 0, m0 = 0; g < groups; ++g) {
            const int64_t rows = (m - m0) / (groups - g);
            widen_group<F32Form>(rows, xp + m0 * k, k, panel, s0, s0, s1, bp, yp + m0 * n, n);
            m0 += rows;
          }
        }
        continue;
      }
      for (int64_t g = 0, m0 = 0; g < groups; ++g) {
        const int64_t rows = (m - m0) / (groups - g);
        widen_group<F>(rows, xp + m0 * k, k, wp, 0, b0, b1, bp, yp + m0 * n, n);
        m0 += rows;
      }
    }
  }
}

// fn(F{}) for the form of a packed weight (checked by packed_k).
template <typename Fn>
void with_form(const at::Tensor& packed, Fn&& fn) {
  if (packed.scalar_type() == at::kBFloat16) fn(Bf16Form{});
  else if (packed.size(2) == group_bytes(4)) fn(GridForm<4>{});
  else fn(GridForm<8>{});
}
#endif

// The unpacked K of a packed weight (bfloat16 or grid), checking its form.
int64_t packed_k(const at::Tensor& packed, const char* op) {
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() &&
                  ((packed.scalar_type() == at::kBFloat16 && packed.size(2) == kBlock) ||
                   (packed.scalar_type() == at::kByte &&
                    (packed.size(2) == group_bytes(4) || packed.size(2) == group_bytes(8)))),
              op, ": weights not packed by widen_pack or grid_pack");
  return packed.scalar_type() == at::kBFloat16 ? packed.size(1) : packed.size(1) * kGroupK;
}

// weight[ids] as float32 ([n, k]) from a packed copy: a tied input embedding
// reads its rows here, the values it held, so its own float32 copy can go.
at::Tensor widen_gather_rows(const at::Tensor& packed, const at::Tensor& ids) {
  const int64_t k = packed_k(packed, "widen_gather_rows");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong,
              "widen_gather_rows: a 1-d int64 tensor of row ids, got ", ids.sizes(), " ",
              ids.scalar_type());
  const int64_t capacity = packed.size(0) * kBlock, n = ids.size(0);
  const at::Tensor id = ids.contiguous();
  const int64_t* row = id.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(row[i] >= 0 && row[i] < capacity, "widen_gather_rows: row ", row[i],
                " outside the packed ", capacity);
#ifdef RADIXMUX_WIDEN
  at::Tensor out = at::empty({n, k}, packed.options().dtype(at::kFloat));
  float* dst = out.data_ptr<float>();
  const auto* src = reinterpret_cast<const uint8_t*>(packed.data_ptr());
  // Each row's block widened by its form's own decode (as the products read
  // it), then the row's column of it taken.
  with_form(packed, [&](auto form) {
    using F = decltype(form);
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      thread_local std::vector<float> wide;
      wide.resize(static_cast<size_t>(k * kBlock));
      for (int64_t i = begin; i < end; ++i) {
        widen_panel<F>(src, row[i] / kBlock, row[i] / kBlock + 1, k, wide.data());
        const int64_t j = row[i] % kBlock;
        for (int64_t kk = 0; kk < k; ++kk) dst[i * k + kk] = wide[kk * kBlock + j];
      }
    });
  });
  return out;
#else
  TORCH_CHECK(false, "widen_gather_rows: this build has no AVX2 + FMA (see has_widen_linear)");
#endif
}

// x @ weight.T (+ bias) in float32, weight from widen_pack or grid_pack.
at::Tensor widen_linear(const at::Tensor& x, const at::Tensor& packed,
                        const c10::optional<at::Tensor>& bias, int64_t out_features) {
#ifdef RADIXMUX_WIDEN
  TORCH_CHECK(x.scalar_type() == at::kFloat, "widen_linear: float32 activations, got ",
              x.scalar_type());
  const int64_t pk = packed_k(packed, "widen_linear");
  const int64_t k = x.size(-1), n = out_features, blocks = packed.size(0);
  TORCH_CHECK(pk == k && blocks * kBlock >= n && blocks * kBlock - n < kBlock,
              "widen_linear: input of ", k, " features and ", n,
              " outputs do not fit the packed weight");
  const int64_t m = x.numel() / std::max<int64_t>(k, 1);
  const at::Tensor x2 = x.reshape({m, k}).contiguous();
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "widen_linear: bias of ", bias->numel(), " for ", n,
                " outputs");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor y = at::empty(shape, x.options());
  if (m == 0) return y;
  const float* xp = x2.data_ptr<float>();
  const auto* wp = reinterpret_cast<const uint8_t*>(packed.data_ptr());
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  with_form(packed, [&](auto form) {
    widen_product<decltype(form)>(xp, m, k, wp, blocks, bp, yp, n);
  });
  return y;
#else
  TORCH_CHECK(false, "widen_linear: this build has no AVX2 + FMA (see has_widen_linear)");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixmux, m) {
  m.def("has_widen_linear() -> bool", &has_widen_linear);
  m.def("widen_pack(Tensor weight) -> Tensor");
  m.def("grid_pack(Tensor weight, int bits) -> Tensor");
  m.def("widen_gather_rows(Tensor packed, Tensor ids) -> Tensor");
  m.def("widen_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixmux, CPU, m) {
  m.impl("widen_pack", &widen_pack);
  m.impl("grid_pack", &grid_pack);
  m.impl("widen_gather_rows", &widen_gather_rows);
  m.impl("widen_linear", &widen_linear);
}
