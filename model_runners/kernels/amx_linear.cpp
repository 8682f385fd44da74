// Linear layers of small batches in bfloat16: on AMX tiles, or with AVX512-BF16
// dot products (vdpbf16ps) where the CPU has no AMX.
//
// A decode step multiplies a few rows of activations by every weight matrix of
// the model. oneDNN's packed matmul (packed_linear.py) costs about 20 us per
// call at such sizes whatever the matrix, which is most of a small layer's
// time: SmolLM2 makes 181 such calls per step. This kernel does the same
// product with the same arithmetic (bfloat16 pairs multiplied into float
// accumulators by AMX's tdpbf16ps, bias added in float, one rounding to
// bfloat16 at the end) in 3.5-10 us for SmolLM2's layers at 1-16 rows, and
// stays ahead of oneDNN up to a few hundred rows; above that oneDNN's deeper
// blocking wins, so packed_linear.py picks by row count.
//
// Weight layout (amx_pack): [N/16][KP][16][2] bfloat16, KP = K/2 rounded up to
// a multiple of 16 (zeros past K, and past N in the last block): 16 consecutive
// pair-rows of one N-block are exactly one B tile (16 rows of 64 bytes).
// Tiles: C00 C01 C10 C11 (float, 16x16) = 0-3, A0 A1 (activations, up to 16
// rows x 32 k) = 4-5, B0 B1 (weights, 32 k x 16 n) = 6-7: a 32 x 32 output
// block per inner loop.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include <omp.h>

#include "amx.h"
#include "bf16_round.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlockN = 16;   // outputs per B tile
constexpr int64_t kPairRows = 16; // k pairs per B tile (32 k)
// Rows of activations kept in L2 while every weight panel passes over them.
constexpr int64_t kRowBlock = 256;

#ifdef __AVX512BF16__
inline __mmask16 col_mask(int64_t cols) { return static_cast<__mmask16>((1u << cols) - 1); }

// The bias of one block of 16 outputs (zeros past `cols`, or without a bias).
inline __m512 bias_block(const float* bias, int64_t cols) {
  return bias ? _mm512_maskz_loadu_ps(col_mask(cols), bias) : _mm512_setzero_ps();
}

// 16 float outputs plus their bias block, rounded to bfloat16 as every output
// of this kernel is.
inline __m256i round_out(__m512 v, __m512 bias) {
  return (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(v, bias));
}

// round_out into the first `cols` of `out`.
inline void store_row(__m512 v, __m512 bias, uint16_t* out, int64_t cols) {
  _mm256_mask_storeu_epi16(out, col_mask(cols), round_out(v, bias));
}

// ---- AVX512-BF16 dot products: the same packed weights without AMX ----------------------
// One 64-byte vector of the packed layout is a k pair of 16 outputs, exactly
// vdpbf16ps's operand: each activation row's k pair is broadcast against it,
// which is tdpbf16ps's arithmetic one row at a time. R rows share each weight
// load (R x NB accumulators in registers), so a decode step streams every
// weight once whatever its batch; oneDNN's fixed ~20 us per call is what this
// path saves, and its deeper blocking wins again at larger row counts
// (packed_linear.py picks by rows).
template <int R, int NB>
inline void dot_products(const uint16_t* x, int64_t kp, const uint16_t* w, __m512 (&acc)[R][NB]) {
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_setzero_ps();
  const int64_t w_block = kp * 32;  // elements per packed N-block
  const int32_t* xr = reinterpret_cast<const int32_t*>(x);
  for (int64_t p = 0; p < kp; ++p) {
    __m512bh wv[NB];
    for (int b = 0; b < NB; ++b)
      wv[b] = (__m512bh)_mm512_loadu_si512(w + b * w_block + p * 32);
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(xr[r * kp + p]);
      for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], xv, wv[b]);
    }
  }
}

template <int R, int NB>
void dot_tile(const uint16_t* x, int64_t kp, const uint16_t* w, const float* bias, uint16_t* y,
              int64_t n, int64_t n0) {
  __m512 acc[R][NB];
  dot_products<R, NB>(x, kp, w, acc);
  for (int b = 0; b < NB; ++b) {
    const int64_t c0 = n0 + b * kBlockN;
    const int64_t cols = std::min<int64_t>(kBlockN, n - c0);
    const __m512 bv = bias_block(bias ? bias + c0 : nullptr, cols);
    for (int r = 0; r < R; ++r) store_row(acc[r][b], bv, y + r * n + c0, cols);
  }
}

template <int NB>
void dot_rows(int64_t rows, const uint16_t* x, int64_t kp, const uint16_t* w, const float* bias,
              uint16_t* y, int64_t n, int64_t n0) {
  switch (rows) {
    case 1: return dot_tile<1, NB>(x, kp, w, bias, y, n, n0);
    case 2: return dot_tile<2, NB>(x, kp, w, bias, y, n, n0);
    case 3: return dot_tile<3, NB>(x, kp, w, bias, y, n, n0);
    default: return dot_tile<4, NB>(x, kp, w, bias, y, n, n0);
  }
}

constexpr int64_t kDotRows = 4;    // activation rows per pass over a panel
constexpr int64_t kDotBlocks = 4;  // N-blocks per panel (16 accumulators at 4 rows)

// The gated MLP's act(gate) * up for R rows and NB blocks of 16 outputs from
// `c0` (of `inter`): the gate's products rounded to bfloat16 as dot_tile stores
// them, then the up projection's, combined as act_and_mul's table path
// combines them (bf16_round.h), so the bits are act_and_mul(amx_linear(x))'s
// while the merged 2 x inter product never leaves the core.
template <int R, int NB>
void dot_gate_up_tile(const uint16_t* x, int64_t kp, const uint16_t* w, int64_t inter,
                      const float* bias, const uint16_t* table, uint16_t* y, int64_t c0) {
  const int64_t up = inter / kBlockN * kp * 32;  // the up half's first block
  alignas(32) uint16_t gate[R][NB][16];
  __m512 acc[R][NB];
  dot_products<R, NB>(x, kp, w, acc);
  for (int b = 0; b < NB; ++b) {
    const __m512 bv = bias_block(bias ? bias + c0 + b * kBlockN : nullptr, kBlockN);
    for (int r = 0; r < R; ++r)
      _mm256_store_si256(reinterpret_cast<__m256i*>(gate[r][b]), round_out(acc[r][b], bv));
  }
  dot_products<R, NB>(x, kp, w + up, acc);
  for (int b = 0; b < NB; ++b) {
    const __m512 bv = bias_block(bias ? bias + inter + c0 + b * kBlockN : nullptr, kBlockN);
    for (int r = 0; r < R; ++r) {
      const __m256i u16 = round_out(acc[r][b], bv);
      const __m512 u = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(u16), 16));
      const __m512i idx = _mm512_cvtepu16_epi32(
          _mm256_load_si256(reinterpret_cast<const __m256i*>(gate[r][b])));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * inter + c0 + b * kBlockN),
                          radixmux::table_act_mul(idx, u, table));
    }
  }
}

template <int NB>
void dot_gate_up_rows(int64_t rows, const uint16_t* x, int64_t kp, const uint16_t* w,
                      int64_t inter, const float* bias, const uint16_t* table, uint16_t* y,
                      int64_t c0) {
  switch (rows) {
    case 1: return dot_gate_up_tile<1, NB>(x, kp, w, inter, bias, table, y, c0);
    case 2: return dot_gate_up_tile<2, NB>(x, kp, w, inter, bias, table, y, c0);
    case 3: return dot_gate_up_tile<3, NB>(x, kp, w, inter, bias, table, y, c0);
    default: return dot_gate_up_tile<4, NB>(x, kp, w, inter, bias, table, y, c0);
  }
}

// dot_gemm's split (panels of the gate half across threads, rows inside) with
// dot_gate_up_tile's epilogue; a panel of the gate and its up panel stay in L2.
void dot_gate_up(const uint16_t* x, int64_t m_rows, int64_t kp, const uint16_t* w, int64_t inter,
                 const float* bias, const uint16_t* table, uint16_t* y, int64_t threads) {
  const int64_t blocks = inter / kBlockN;
  const int64_t panels = (blocks + kDotBlocks - 1) / kDotBlocks;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t nb = p * kDotBlocks;
    for (int64_t m0 = 0; m0 < m_rows; m0 += kDotRows) {
      const int64_t rows = std::min(kDotRows, m_rows - m0);
      const uint16_t* xm = x + m0 * kp * 2;
      uint16_t* ym = y + m0 * inter;
      if (nb + kDotBlocks <= blocks) {
        dot_gate_up_rows<kDotBlocks>(rows, xm, kp, w + nb * kp * 32, inter, bias, table, ym,
                                     nb * kBlockN);
      } else {
        for (int64_t b = nb; b < blocks; ++b)
          dot_gate_up_rows<1>(rows, xm, kp, w + b * kp * 32, inter, bias, table, ym,
                              b * kBlockN);
      }
    }
  }
}

void dot_gemm(const uint16_t* x, int64_t m_rows, int64_t kp, const uint16_t* w, int64_t n_blocks,
              const float* bias, uint16_t* y, int64_t n, int64_t threads) {
  const int64_t panels = (n_blocks + kDotBlocks - 1) / kDotBlocks;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t nb = p * kDotBlocks;
    const uint16_t* wp = w + nb * kp * 32;
    // A panel (4 x kp x 64 bytes: 72 KB for k = 576) stays in L2 while every
    // row block passes over it.
    for (int64_t m0 = 0; m0 < m_rows; m0 += kDotRows) {
      const int64_t rows = std::min(kDotRows, m_rows - m0);
      const uint16_t* xm = x + m0 * kp * 2;
      uint16_t* ym = y + m0 * n;
      if (nb + kDotBlocks <= n_blocks) {
        dot_rows<kDotBlocks>(rows, xm, kp, wp, bias, ym, n, nb * kBlockN);
      } else {
        for (int64_t b = nb; b < n_blocks; ++b)
          dot_rows<1>(rows, xm, kp, w + b * kp * 32, bias, ym, n, b * kBlockN);
      }
    }
  }
}
#endif  // __AVX512BF16__

#ifdef RADIXMUX_AMX
using radixmux::request_amx;
using radixmux::TileConfig;

// rows0 / rows1: activation rows of the two 16-row halves (rows1 may be 0).
void configure(int rows0, int rows1) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64;
  cfg.rows[0] = cfg.rows[1] = cfg.rows[4] = static_cast<uint8_t>(rows0);
  cfg.rows[2] = cfg.rows[3] = cfg.rows[5] = static_cast<uint8_t>(rows1 ? rows1 : 1);
  cfg.rows[6] = cfg.rows[7] = kPairRows;
  _tile_loadconfig(&cfg);
}

// One 16 x 16 float tile (in `acc`) plus bias, rounded to bfloat16 into `rows`
// rows of `out` (row stride `ld`), the first `cols` columns.
void store_block(const float* acc, const float* bias, int64_t rows, uint16_t* out, int64_t ld,
                 int64_t cols) {
  const __m512 b = bias_block(bias, cols);
  for (int64_t m = 0; m < rows; ++m) store_row(_mm512_load_ps(acc + m * 16), b, out + m * ld, cols);
}

// One 32 x 32 block of outputs: rows [m0, m0 + 32) (cut at `mend`) of the N-block
// pair starting at `nb`, over the whole k. Tile rows are reconfigured only
// when a block's row counts differ from the last one's (`cur`).
// Where a block's products landed: first output n0, columns of its two
// N-blocks (cols1 0: only one), activation rows of its two 16-row halves.
struct BlockShape {
  int64_t n0, cols0, cols1;
  int r0, r1;
};

struct AmxBlocks {
  const uint16_t* x;
  int64_t kp;
  const uint16_t* w;
  int64_t n_blocks;
  const float* bias;
  uint16_t* y;
  int64_t n;

  // The block's products into acc (tiles 0-3 as [16][16] floats, no bias);
  // returns its shape.
  BlockShape products(int64_t nb, int64_t m0, int64_t mend, int (&cur)[2],
                      float (&acc)[4][256]) const {
    const int64_t ldx = kp * 4;  // bytes per activation row (kp pairs of 2 bytes)
    const int64_t chunks = kp / kPairRows;
    const bool two = nb + 1 < n_blocks;
    const uint16_t* w0 = w + nb * kp * 32;
    const uint16_t* w1 = w0 + kp * 32;
    const int64_t n0 = nb * kBlockN;
    const int64_t cols0 = std::min<int64_t>(kBlockN, n - n0);
    const int64_t cols1 = std::min<int64_t>(kBlockN, n - n0 - kBlockN);
    const int64_t rest = mend - m0;
    const int r0 = static_cast<int>(std::min<int64_t>(rest, 16));
    const int r1 = static_cast<int>(std::min<int64_t>(std::max<int64_t>(rest - 16, 0), 16));
    if (r0 != cur[0] || r1 != cur[1]) {
      configure(r0, r1);
      cur[0] = r0;
      cur[1] = r1;
    }
    const uint16_t* x0 = x + m0 * kp * 2;
    const uint16_t* x1 = x0 + 16 * kp * 2;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c = 0; c < chunks; ++c) {
      _tile_loadd(6, w0 + c * 512, 64);
      _tile_loadd(4, x0 + c * 32, ldx);
      _tile_dpbf16ps(0, 4, 6);
      if (two) {
        _tile_loadd(7, w1 + c * 512, 64);
        _tile_dpbf16ps(1, 4, 7);
      }
      if (r1) {
        _tile_loadd(5, x1 + c * 32, ldx);
        _tile_dpbf16ps(2, 5, 6);
        if (two) _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, acc[0], 64);
    if (two) _tile_stored(1, acc[1], 64);
    if (r1) {
      _tile_stored(2, acc[2], 64);
      if (two) _tile_stored(3, acc[3], 64);
    }
    return {n0, cols0, two ? cols1 : 0, r0, r1};
  }

  void run(int64_t nb, int64_t m0, int64_t mend, int (&cur)[2], float (&acc)[4][256]) const {
    const BlockShape b = products(nb, m0, mend, cur, acc);
    const float* b0 = bias ? bias + b.n0 : nullptr;
    const float* b1 = bias ? bias + b.n0 + kBlockN : nullptr;
    uint16_t* y0 = y + m0 * n + b.n0;
    store_block(acc[0], b0, b.r0, y0, n, b.cols0);
    if (b.cols1 > 0) store_block(acc[1], b1, b.r0, y0 + kBlockN, n, b.cols1);
    if (b.r1) {
      store_block(acc[2], b0, b.r1, y0 + 16 * n, n, b.cols0);
      if (b.cols1 > 0) store_block(acc[3], b1, b.r1, y0 + 16 * n + kBlockN, n, b.cols1);
    }
  }
};

// Threads split the rows (`split_rows`) or the outputs. Split by outputs,
// each thread reads half the weights but every row of activations, half of
// which the op before (itself split by rows) left dirty in the other core's
// cache; split by rows, each reads every weight but only its own rows.
// Reading the other core's dirty lines is the dearer of the two once the
// activations are not much smaller than the weights (SmolLM2's q/o/k/v/down
// at 256-1,024 rows, weights cycled through 30 layers' copies: 0.6-0.9x the
// time of the output split). Each output is the same sequence of tile
// products either way, so the split never changes a result.
// block(p, m0, mend, cur, acc) computes rows [m0, mend) of output pair p.
template <typename Block>
void amx_gemm(int64_t pairs, int64_t m_rows, int64_t threads, bool split_rows, Block&& block) {
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    alignas(64) float acc[4][256];
    int cur[2] = {-1, -1};
    // This thread's rows [lo, hi) (whole 16-row tiles) and output pairs [plo, phi).
    const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
    auto share = [&](int64_t total, int64_t grain) {
      const int64_t per = ((total + nt - 1) / nt + grain - 1) / grain * grain;
      const int64_t begin = std::min(total, t * per);
      return std::pair<int64_t, int64_t>{begin, std::min(total, begin + per)};
    };
    const auto [lo, hi] = split_rows ? share(m_rows, 16) : std::pair<int64_t, int64_t>{0, m_rows};
    const auto [plo, phi] = split_rows ? std::pair<int64_t, int64_t>{0, pairs} : share(pairs, 1);
    for (int64_t mb = lo; mb < hi; mb += kRowBlock) {
      const int64_t mend = std::min(mb + kRowBlock, hi);
      for (int64_t p = plo; p < phi; ++p)
        for (int64_t m0 = mb; m0 < mend; m0 += 32) block(p, m0, mend, cur, acc);
    }
    if (cur[0] >= 0) _tile_release();
  }
}

// ---- a gated MLP's merged gate/up projection with its activation ----------------------
// act(gate) * up straight from the tiles: outputs [0, I) of the merged weight
// are the gate, [I, 2I) the up projection. A 32 x 32 block of the gate and
// the matching block of the up projection are multiplied in turn, each
// rounded to bfloat16 exactly as amx_linear stores it, and combined as
// act_and_mul's table path combines them (bf16_round.h's table_act_mul, both),
// so the result has act_and_mul(amx_linear(x))'s bits while the 2I-wide
// product never leaves the core (at 1,024 rows of SmolLM2 it was 6.3 MB
// written, then read back, per layer).
void gate_up_act_block(const AmxBlocks& g, int64_t p, int64_t m0, int64_t mend, int (&cur)[2],
                       float (&acc)[4][256], const uint16_t* table, uint16_t* out) {
  const int64_t inter = g.n / 2, nb = 2 * p;
  alignas(64) uint16_t gate[4][256];  // the gate tiles' bfloat16 bits
  const BlockShape gs = g.products(nb, m0, mend, cur, acc);
  const int rows[4] = {gs.r0, gs.r0, gs.r1, gs.r1};
  for (int t = 0; t < 4; ++t) {
    const __m512 b = bias_block(g.bias ? g.bias + gs.n0 + (t % 2) * kBlockN : nullptr, kBlockN);
    for (int m = 0; m < rows[t]; ++m)
      _mm256_store_si256(reinterpret_cast<__m256i*>(gate[t] + m * 16),
                         round_out(_mm512_load_ps(acc[t] + m * 16), b));
  }
  const BlockShape us = g.products(nb + inter / kBlockN, m0, mend, cur, acc);
  for (int t = 0; t < 4; ++t) {
    const __m512 b = bias_block(g.bias ? g.bias + us.n0 + (t % 2) * kBlockN : nullptr, kBlockN);
    uint16_t* o = out + (m0 + (t / 2) * 16) * inter + gs.n0 + (t % 2) * kBlockN;
    for (int m = 0; m < rows[t]; ++m) {
      // The up projection's value as amx_linear stores it, back in a float.
      const __m256i u16 = round_out(_mm512_load_ps(acc[t] + m * 16), b);
      const __m512 u = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(u16), 16));
      const __m512i idx = _mm512_cvtepu16_epi32(
          _mm256_load_si256(reinterpret_cast<const __m256i*>(gate[t] + m * 16)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + m * inter),
                          radixmux::table_act_mul(idx, u, table));
    }
  }
}
#endif  // RADIXMUX_AMX

bool has_amx_linear() {
#ifdef RADIXMUX_AMX
  return request_amx();
#else
  return false;
#endif
}

at::Tensor amx_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "amx_pack: a 2-d bfloat16 weight, got ", weight.sizes(), " ", weight.scalar_type());
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1);
  const int64_t n_blocks = (n + kBlockN - 1) / kBlockN;
  const int64_t kp = ((k + 1) / 2 + kPairRows - 1) / kPairRows * kPairRows;
  at::Tensor out = at::zeros({n_blocks, kp, kBlockN, 2}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, n_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb)
      for (int64_t j = 0; j < kBlockN && nb * kBlockN + j < n; ++j) {
        const uint16_t* row = src + (nb * kBlockN + j) * k;
        uint16_t* base = dst + nb * kp * kBlockN * 2 + j * 2;
        for (int64_t c = 0; c < k; ++c) base[(c / 2) * kBlockN * 2 + (c % 2)] = row[c];
      }
  });
  return out;
}

// Rows `ids` of the [rows, dim] weight that amx_pack tiled into `tiles`: row
// n's k pair p is the 32-bit word at [n / 16][p][n % 16], one word in each
// 64-byte line of its block. A tied model's input embedding reads its rows
// here (tied_embedding.py); torch's advanced indexing over the same tiles
// copied them two bytes at a time, element by element (2.7 ms of a step of
// 1,000 prompt tokens of SmolLM2).
at::Tensor amx_gather_rows(const at::Tensor& tiles, const at::Tensor& ids, int64_t dim) {
  TORCH_CHECK(tiles.dim() == 4 && tiles.size(2) == kBlockN && tiles.size(3) == 2 &&
                  tiles.element_size() == 2 && tiles.is_contiguous(),
              "amx_gather_rows: tiles packed by amx_pack, got ", tiles.sizes());
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong,
              "amx_gather_rows: a 1-d int64 tensor of row ids, got ", ids.sizes(), " ",
              ids.scalar_type());
  const int64_t kp = tiles.size(1), capacity = tiles.size(0) * kBlockN, n = ids.size(0);
  TORCH_CHECK(dim > 0 && dim <= 2 * kp, "amx_gather_rows: rows of ", dim,
              " values from tiles of ", 2 * kp);
  const at::Tensor id = ids.contiguous();
  const int64_t* row = id.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(row[i] >= 0 && row[i] < capacity, "amx_gather_rows: row ", row[i],
                " outside the tiles' ", capacity);
  at::Tensor out = at::empty({n, 2 * kp}, tiles.options());
  const auto* src = reinterpret_cast<const uint32_t*>(tiles.data_ptr());
  auto* dst = reinterpret_cast<uint32_t*>(out.data_ptr());
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint32_t* s = src + row[i] / kBlockN * kp * kBlockN + row[i] % kBlockN;
      uint32_t* d = dst + i * kp;
      for (int64_t p = 0; p < kp; ++p) d[p] = s[p * kBlockN];
    }
  });
  return dim == 2 * kp ? out : out.narrow(1, 0, dim).contiguous();
}

bool has_dpbf16_linear() {
#ifdef __AVX512BF16__
  return true;
#else
  return false;
#endif
}

#ifdef __AVX512BF16__
// One call's operands, checked: the activations as [m, 2 kp] rows (zero-padded
// past k), the bias as floats, and how many threads the product is worth.
struct LinearCall {
  at::Tensor x2, bias_f;
  int64_t m, n, n_blocks, kp, threads;

  LinearCall(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
             int64_t out_features, const char* what)
      : n(out_features), n_blocks(packed.size(0)), kp(packed.size(1)) {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, what,
                ": bfloat16 activations and weights, got ", x.scalar_type(), " and ",
                packed.scalar_type());
    TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kBlockN && packed.size(3) == 2, what,
                ": weights not packed by amx_pack");
    const int64_t k = x.size(-1);
    TORCH_CHECK(kp * 2 >= k && kp * 2 - k < 2 * kPairRows && n_blocks * kBlockN >= n &&
                    n_blocks * kBlockN - n < kBlockN,
                what, ": input of ", k, " features and ", n,
                " outputs do not fit the packed weight");
    m = x.numel() / std::max<int64_t>(k, 1);
    x2 = x.reshape({m, k});
    if (k != kp * 2) {
      at::Tensor padded = at::zeros({m, kp * 2}, x.options());
      padded.narrow(1, 0, k).copy_(x2);
      x2 = padded;
    } else {
      x2 = x2.contiguous();
    }
    if (bias.has_value() && bias->defined()) {
      TORCH_CHECK(bias->numel() == n, what, ": bias of ", bias->numel(), " for ", n, " outputs");
      bias_f = bias->to(at::kFloat).contiguous();
    }
    // One thread for a small product: waking the others costs more than it saves.
    const int64_t work = n_blocks * kp * 64 * ((m + 15) / 16);
    threads = work > (1 << 17) ? std::max<int64_t>(1, at::get_num_threads()) : 1;
  }

  // Whether the tile kernel splits this product by rows across threads (else
  // by outputs): when each thread gets a 32-row block and there are at most
  // 4x as many weights as activations, each thread then reads every weight
  // (from L3, a layer's weights being cold) but only its own rows. In the
  // model (SmolLM2 bf16, 2 threads, steps interleaved): 15 decodes + a
  // 512-token chunk 143.3 -> 137.5 ms; a 64-decode step is unchanged at 4x
  // and 6% slower at 16x, where q/o/down would split by rows too.
  bool split_rows() const { return threads > 1 && m >= 32 * threads && n <= 4 * m; }

  // x's shape with the last dimension `last`.
  std::vector<int64_t> shape(const at::Tensor& x, int64_t last) const {
    std::vector<int64_t> out(x.sizes().begin(), x.sizes().end());
    out.back() = last;
    return out;
  }

  const uint16_t* xp() const { return reinterpret_cast<const uint16_t*>(x2.data_ptr()); }
  const float* bp() const { return bias_f.defined() ? bias_f.data_ptr<float>() : nullptr; }
#ifdef RADIXMUX_AMX
  AmxBlocks blocks(const at::Tensor& packed, uint16_t* y) const {
    return {xp(), kp, reinterpret_cast<const uint16_t*>(packed.data_ptr()), n_blocks, bp(), y, n};
  }
#endif
};
#endif

// x @ unpacked(packed).T (+ bias) in bfloat16: on AMX tiles where this process
// may use them, else with AVX512-BF16 dot products (same pairs, same float
// accumulation, one rounding).
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed,
                      const c10::optional<at::Tensor>& bias, int64_t out_features) {
#ifdef __AVX512BF16__
  const LinearCall c(x, packed, bias, out_features, "amx_linear");
  at::Tensor y = at::empty(c.shape(x, c.n), x.options());
  if (c.m == 0) return y;
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
#ifdef RADIXMUX_AMX
  if (request_amx()) {
    const AmxBlocks g = c.blocks(packed, yp);
    amx_gemm((c.n_blocks + 1) / 2, c.m, c.threads, c.split_rows(),
             [&](int64_t p, int64_t m0, int64_t mend, int (&cur)[2], float (&acc)[4][256]) {
               g.run(2 * p, m0, mend, cur, acc);
             });
    return y;
  }
#endif
  dot_gemm(c.xp(), c.m, c.kp, reinterpret_cast<const uint16_t*>(packed.data_ptr()), c.n_blocks,
           c.bp(), yp, c.n, c.threads);
  return y;
#else
  TORCH_CHECK(false, "amx_linear: this build has neither AMX nor AVX512-BF16 (see has_dpbf16_linear)");
#endif
}

// act(x @ gate.T) * (x @ up.T) for a merged gate/up weight of `out_features`
// = 2I outputs packed by amx_pack, on AMX tiles where this process may use
// them, else with AVX512-BF16 dot products: the bits of
// act_and_mul(amx_linear(x, ...), act, table) (gate_up_act_block,
// dot_gate_up_tile). `table`:
// act_and_mul's 65,537 int16 (the activation of every bfloat16). I must be a
// multiple of 32 (whole tile pairs in each half).
at::Tensor amx_gate_up_act(const at::Tensor& x, const at::Tensor& packed,
                           const c10::optional<at::Tensor>& bias, int64_t out_features,
                           const at::Tensor& table) {
#ifdef __AVX512BF16__
  TORCH_CHECK(out_features % 64 == 0, "amx_gate_up_act: ", out_features,
              " outputs are not two halves of whole tile pairs");
  TORCH_CHECK(table.scalar_type() == at::kShort && table.is_contiguous() &&
                  table.numel() == 65537,
              "amx_gate_up_act: the table must be 65,537 contiguous int16 (every bf16, one spare)");
  const LinearCall c(x, packed, bias, out_features, "amx_gate_up_act");
  const int64_t inter = c.n / 2;
  at::Tensor y = at::empty(c.shape(x, inter), x.options());
  if (c.m == 0) return y;
  const auto* tp = reinterpret_cast<const uint16_t*>(table.data_ptr<int16_t>());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
#ifdef RADIXMUX_AMX
  if (request_amx()) {
    const AmxBlocks g = c.blocks(packed, nullptr);
    // Split as amx_linear splits the merged product.
    amx_gemm(inter / 32, c.m, c.threads, c.split_rows(),
             [&](int64_t p, int64_t m0, int64_t mend, int (&cur)[2], float (&acc)[4][256]) {
               gate_up_act_block(g, p, m0, mend, cur, acc, tp, yp);
             });
    return y;
  }
#endif
  dot_gate_up(c.xp(), c.m, c.kp, reinterpret_cast<const uint16_t*>(packed.data_ptr()), inter,
              c.bp(), tp, yp, c.threads);
  return y;
#else
  TORCH_CHECK(false, "amx_gate_up_act: this build has neither AMX nor AVX512-BF16");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixmux, m) {
  m.def("has_amx_linear() -> bool", &has_amx_linear);
  m.def("has_dpbf16_linear() -> bool", &has_dpbf16_linear);
  m.def("amx_pack(Tensor weight) -> Tensor");
  m.def("amx_gather_rows(Tensor tiles, Tensor ids, int dim) -> Tensor");
  m.def("amx_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  m.def(
      "amx_gate_up_act(Tensor x, Tensor packed, Tensor? bias, int out_features, Tensor table) -> "
      "Tensor");
}

TORCH_LIBRARY_IMPL(radixmux, CPU, m) {
  m.impl("amx_pack", &amx_pack);
  m.impl("amx_gather_rows", &amx_gather_rows);
  m.impl("amx_linear", &amx_linear);
  m.impl("amx_gate_up_act", &amx_gate_up_act);
}
