// Float32 linear layers over weights held in bfloat16, for CPUs with AVX2 + FMA
// and no bfloat16 arithmetic (where `--dtype auto` runs float32).
//
// A model published in bfloat16 and run in float32 holds weights whose low 16
// bits are all zero: half of every weight byte a decode step streams carries
// nothing. Here each weight is stored as its bfloat16 (exactly the same value)
// and widened back to float in registers, one integer op per 8 floats, so a
// step reads half the bytes; products and sums are float32 as before. A decode
// step on such a CPU is bound by weight traffic (SmolLM2's layers at one row
// ran at 7-9 GB/s through torch's float32 product on a 2-core AMD EPYC whose
// cores stream 28 GB/s: MKL takes a generic path on AMD CPUs).
//
// Weight layout (widen_pack): [N/16][K][16] uint16, zeros past N. The 16
// values of one block at one k are 8 32-bit words; word j holds output j in its
// low half and output 8 + j in its high half, so `word << 16` is outputs 0-7
// as floats and `word & 0xffff0000` outputs 8-15: one 32-byte load and two
// integer ops give 16 weights. Each row's sum runs over k in order, one float
// accumulator per output, whatever the number of rows in the call, so a row's
// result does not depend on its batch-mates.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define RADIXMUX_WIDEN 1
#endif

namespace {

constexpr int64_t kBlock = 16;  // outputs per packed block

// Where output `row` of a packed weight sits within its block's 16 values at one k.
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

// A [N, K] float32 or bfloat16 weight in the layout above, as bfloat16 (float32
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
        // Output j of the block goes to the low half of word j, 8 + j to the high half of word j - 8.
        uint16_t* col = dst + b * k * kBlock + slot_of(row);
        const uint16_t* r = src + row * k;
        for (int64_t kk = 0; kk < k; ++kk) col[kk * kBlock] = r[kk];
      }
  });
  return out;
}

// weight[ids] as float32 ([n, k]) from the packed copy: a tied input embedding
// reads its rows here, the values it held, so its own float32 copy can go.
at::Tensor widen_gather_rows(const at::Tensor& packed, const at::Tensor& ids) {
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 3 &&
                  packed.size(2) == kBlock && packed.is_contiguous(),
              "widen_gather_rows: weights not packed by widen_pack");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong,
              "widen_gather_rows: a 1-d int64 tensor of row ids, got ", ids.sizes(), " ",
              ids.scalar_type());
  const int64_t k = packed.size(1), capacity = packed.size(0) * kBlock, n = ids.size(0);
  const at::Tensor id = ids.contiguous();
  const int64_t* row = id.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(row[i] >= 0 && row[i] < capacity, "widen_gather_rows: row ", row[i],
                " outside the packed ", capacity);
  at::Tensor out = at::empty({n, k}, packed.options().dtype(at::kFloat));
  const auto* src = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  auto* dst = reinterpret_cast<uint32_t*>(out.data_ptr());
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint16_t* s = src + row[i] / kBlock * k * kBlock + slot_of(row[i]);
      uint32_t* d = dst + i * k;
      for (int64_t kk = 0; kk < k; ++kk) d[kk] = static_cast<uint32_t>(s[kk * kBlock]) << 16;
    }
  });
  return out;
}

#ifdef RADIXMUX_WIDEN
#define UNROLL _Pragma("GCC unroll 16")
// Weight vectors (32 bytes each) fetched ahead of use.
constexpr int64_t kPrefetch = 32;

// 16 outputs as two float vectors, from one packed word vector.
inline __m256 widen_lo(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
inline __m256 widen_hi(__m256i v) {
  return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
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
// blocks starting at block b0: R x NB x 2 accumulators stay in registers over
// all of k, and each weight load serves every row. Every loop over R and NB
// unrolled and the tile not inlined: otherwise gcc kept the accumulators in
// memory too and stored them on every k (a third of the speed).
template <int R, int NB>
__attribute__((noinline)) void widen_tile(const float* x, int64_t ldx, int64_t k, const uint16_t* w, int64_t b0,
                const float* bias, float* y, int64_t ldy, int64_t n) {
  __m256 acc[R][NB][2];
  UNROLL for (int r = 0; r < R; ++r)
    UNROLL for (int b = 0; b < NB; ++b) acc[r][b][0] = acc[r][b][1] = _mm256_setzero_ps();
  const uint16_t* wb = w + b0 * k * kBlock;
  for (int64_t kk = 0; kk < k; ++kk) {
    __m256 lo[NB], hi[NB];
    UNROLL for (int b = 0; b < NB; ++b) {
      _mm_prefetch(reinterpret_cast<const char*>(wb + (b * k + kk + kPrefetch) * kBlock),
                   _MM_HINT_T0);
      const __m256i v = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(wb + (b * k + kk) * kBlock));
      lo[b] = widen_lo(v);
      hi[b] = widen_hi(v);
    }
    UNROLL for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * ldx + kk);
      UNROLL for (int b = 0; b < NB; ++b) {
        acc[r][b][0] = _mm256_fmadd_ps(xv, lo[b], acc[r][b][0]);
        acc[r][b][1] = _mm256_fmadd_ps(xv, hi[b], acc[r][b][1]);
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
// most 8 (16 vector registers hold them, the widened weights and a broadcast).
template <int R>
constexpr int blocks_for_rows() {
  return R == 1 ? 4 : R == 2 ? 2 : 1;
}

// Rows [m0, m0 + rows) (rows <= 4) times blocks [b0, b1).
template <int R>
void widen_rows(const float* x, int64_t k, const uint16_t* w, int64_t b0, int64_t b1,
                const float* bias, float* y, int64_t n) {
  constexpr int NB = blocks_for_rows<R>();
  int64_t b = b0;
  for (; b + NB <= b1; b += NB) widen_tile<R, NB>(x, k, k, w, b, bias, y, n, n);
  for (; b < b1; ++b) widen_tile<R, 1>(x, k, k, w, b, bias, y, n, n);
}

void widen_group(int64_t rows, const float* x, int64_t k, const uint16_t* w, int64_t b0,
                 int64_t b1, const float* bias, float* y, int64_t n) {
  switch (rows) {
    case 1: return widen_rows<1>(x, k, w, b0, b1, bias, y, n);
    case 2: return widen_rows<2>(x, k, w, b0, b1, bias, y, n);
    case 3: return widen_rows<3>(x, k, w, b0, b1, bias, y, n);
    case 4: return widen_rows<4>(x, k, w, b0, b1, bias, y, n);
    case 5: return widen_rows<5>(x, k, w, b0, b1, bias, y, n);
    default: return widen_rows<6>(x, k, w, b0, b1, bias, y, n);
  }
}

constexpr int64_t kGroupRows = 6;  // rows sharing each weight load
// Blocks per thread task: a panel (4 blocks: 4 x k x 32 bytes, 72 KB at k =
// 576) stays in L2 while every group of rows passes over it.
constexpr int64_t kPanelBlocks = 4;
#endif

// x @ weight.T (+ bias) in float32, weight from widen_pack.
at::Tensor widen_linear(const at::Tensor& x, const at::Tensor& packed,
                        const c10::optional<at::Tensor>& bias, int64_t out_features) {
#ifdef RADIXMUX_WIDEN
  TORCH_CHECK(x.scalar_type() == at::kFloat, "widen_linear: float32 activations, got ",
              x.scalar_type());
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 3 &&
                  packed.size(2) == kBlock && packed.is_contiguous(),
              "widen_linear: weights not packed by widen_pack");
  const int64_t k = x.size(-1), n = out_features, blocks = packed.size(0);
  TORCH_CHECK(packed.size(1) == k && blocks * kBlock >= n && blocks * kBlock - n < kBlock,
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
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
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
      for (int64_t g = 0, m0 = 0; g < groups; ++g) {
        const int64_t rows = (m - m0) / (groups - g);
        widen_group(rows, xp + m0 * k, k, wp, b0, b1, bp, yp + m0 * n, n);
        m0 += rows;
      }
    }
  }
  return y;
#else
  TORCH_CHECK(false, "widen_linear: this build has no AVX2 + FMA (see has_widen_linear)");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixmux, m) {
  m.def("has_widen_linear() -> bool", &has_widen_linear);
  m.def("widen_pack(Tensor weight) -> Tensor");
  m.def("widen_gather_rows(Tensor packed, Tensor ids) -> Tensor");
  m.def("widen_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixmux, CPU, m) {
  m.impl("widen_pack", &widen_pack);
  m.impl("widen_gather_rows", &widen_gather_rows);
  m.impl("widen_linear", &widen_linear);
}
