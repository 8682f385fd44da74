// The extend driver: prefill chunks' query tokens in blocks over their
// contexts, a long prompt's K/V packed once per call (run_extend).
//
// Part of paged_decode.cpp, the one translation unit that includes it: the
// unnamed namespace gives its code the internal linkage it had as one file.
#pragma once

#include "decode.h"

namespace {

// ---- extends (prefill chunks) ----------------------------------------------------------
// Query tokens per extend task, as query rows (tokens x query heads per KV
// head): enough rows to fill the vector lanes and amortise each key tile,
// few enough that the causal diagonal wastes little of a tile.
constexpr int64_t kExtendRows = 96;
// A chunk whose tokens see at least this many earlier keys takes twice the
// rows per task: there the diagonal is a small part of each row's keys, and
// each key tile's gather and V transpose serve twice the rows (100 new
// tokens over 1,000 cached: 6-13% faster; from scratch, 96 rows stay 3% ahead).
constexpr int64_t kLongContext = 512;

// Where pack_extend_kv's packs live: one buffer, reused by every call (a
// multi-megabyte allocation per layer would fault its pages in every time).
std::vector<uint32_t>& extend_pack_buffer() {
  static std::vector<uint32_t> buffer;
  return buffer;
}

// A packed head's layout in extend_pack_buffer(), in 32-bit words: K rows
// [steps * kAmxKeys, dim] bfloat16, then V^T [steps][dim, kAmxKeys / 2]
// pairs, each half `half` words (one step of either: step_words), heads one
// after another.
struct PackLayout {
  int64_t steps, step_words, half;
  PackLayout(int64_t len, int64_t dim)
      : steps((len + kAmxKeys - 1) / kAmxKeys),
        step_words(dim * kAmxKeys / 2),
        half(steps * step_words) {}
  int64_t head(int64_t h) const { return h * 2 * half; }
  int64_t k_step(int64_t j) const { return j * step_words; }
  int64_t vt_step(int64_t j) const { return half + j * step_words; }
};

// K and V^T of every KV head of each sequence whose prompt spans several
// query blocks, packed once for all its tasks (PackedKV), where extends run
// on the AMX tiles without a window (a window starts each block's keys at
// a different place). Returns, per sequence, its packs' offset in
// extend_pack_buffer() in 32-bit words (-1: not packed), laid out as
// PackLayout says.
template <typename T, typename Q>
std::vector<int64_t> pack_extend_kv(const at::Tensor& k_rows, const at::Tensor& v_rows,
                                    const int64_t* addr, const int64_t* offs,
                                    const int64_t* qoffs, int64_t seqs, int64_t kv_heads,
                                    int64_t dim, int64_t window, int64_t block) {
  std::vector<int64_t> at(static_cast<size_t>(seqs), -1);
#ifdef RADIXMUX_AMX
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<Q, c10::BFloat16>) {
    bool tiles = false;
    dispatch_dim(dim, [&](auto nv) { tiles = decltype(nv)::value % 2 == 0; });
    if (!tiles || window > 0 || !amx_ready()) return at;
    int64_t words = 0;
    struct Item {
      int64_t seq, head, step;
    };
    std::vector<Item> items;
    for (int64_t e = 0; e < seqs; ++e) {
      // Worth it from four tasks per head (blocks are up to twice `block`
      // long): 100 new tokens after 1,000 cached, two tasks per head, went
      // from 0.41-0.42 to 0.46-0.49 ms per layer packed (a pass of its own,
      // then its reads from L2), 512 new from 0.65-0.68 to 0.61-0.62.
      if (qoffs[e + 1] - qoffs[e] < 8 * block) continue;
      const PackLayout layout(offs[e + 1] - offs[e], dim);
      at[e] = words;
      words += layout.head(kv_heads);
      for (int64_t h = 0; h < kv_heads; ++h)
        for (int64_t j = 0; j < layout.steps; ++j) items.push_back({e, h, j});
    }
    if (items.empty()) return at;
    std::vector<uint32_t>& buffer = extend_pack_buffer();
    if (buffer.size() < static_cast<size_t>(words)) buffer.resize(static_cast<size_t>(words));
    const auto* kp = reinterpret_cast<const c10::BFloat16*>(k_rows.data_ptr());
    const auto* vp = reinterpret_cast<const c10::BFloat16*>(v_rows.data_ptr());
    const KVTable table = kv_table(k_rows, dim);
    run_tasks(static_cast<int64_t>(items.size()), [&](int64_t i, Scratch& s) {
      const Item& it = items[i];
      const int64_t len = offs[it.seq + 1] - offs[it.seq];
      const PackLayout layout(len, dim);
      const int64_t j0 = it.step * kAmxKeys, n = std::min(kAmxKeys, len - j0);
      uint32_t* head = buffer.data() + at[it.seq] + layout.head(it.head);
      const int64_t* a = addr + offs[it.seq];
      s.vf.resize(static_cast<size_t>(kAmxKeys / 2 * dim));
      dispatch_dim(dim, [&](auto nv) {
        constexpr int NV = decltype(nv)::value;
        if constexpr (NV > 0 && NV % 2 == 0) {
          gather_k_step<NV>(kp + it.head * table.head, table.row, a, j0, n,
                            reinterpret_cast<uint16_t*>(head + layout.k_step(it.step)));
          pack_v_step<NV>(vp + it.head * table.head, table.row, a, j0, n,
                          reinterpret_cast<uint32_t*>(s.vf.data()),
                          head + layout.vt_step(it.step));
        }
      });
    });
  }
#endif
  return at;
}

// Sequence e's KV head h packs (none where pack_extend_kv made none).
inline PackedKV packed_of(const std::vector<int64_t>& at, int64_t e, int64_t h, int64_t dim,
                          int64_t len) {
  if (at[e] < 0) return {};
  const PackLayout layout(len, dim);
  const uint32_t* head = extend_pack_buffer().data() + at[e] + layout.head(h);
  return {reinterpret_cast<const uint16_t*>(head + layout.k_step(0)), head + layout.vt_step(0)};
}

// Causal attention of each extend's new tokens over its whole context,
// read in place: sequence e's context is addr[offsets[e]:offsets[e + 1]]
// and its new tokens are the last n_e = q_offsets[e + 1] - q_offsets[e] of
// it, their queries q[q_offsets[e]:q_offsets[e + 1]]. A task is (sequence,
// KV head, block of new tokens); it visits only keys some token of the
// block sees (nothing above the diagonal, nothing before the window), and
// key tiles every row sees whole skip the masks.
template <typename T, typename Q>
void run_extend(const at::Tensor& q, at::Tensor& out, const at::Tensor& k_rows,
                const at::Tensor& v_rows, const at::Tensor& addr, const at::Tensor& offsets,
                const at::Tensor& q_offsets, double scale, double softcap, int64_t window,
                bool det) {
  const int64_t seqs = offsets.numel() - 1, heads = q.size(1), dim = q.size(2);
  const KVTable table = kv_table(k_rows, dim);
  const int64_t kv_heads = table.kv_heads, qpk = heads / kv_heads;
  const int64_t row_stride = table.row, head_stride = table.head;
  const Q* qp = q.data_ptr<Q>();
  Q* op = out.data_ptr<Q>();
  const T* kp = k_rows.data_ptr<T>();
  const T* vp = v_rows.data_ptr<T>();
  const int64_t* ap = addr.data_ptr<int64_t>();
  const int64_t* offs = offsets.data_ptr<int64_t>();
  const int64_t* qoffs = q_offsets.data_ptr<int64_t>();
  const float sc = static_cast<float>(scale), cap = static_cast<float>(softcap);
  const int64_t short_block = std::max<int64_t>(1, kExtendRows / qpk);

  struct Task {
    int64_t seq, head, t0, t1, cost;
  };
  std::vector<Task> tasks;
  // Oldest key a token at context index c sees.
  auto oldest = [&](int64_t c) { return window > 0 ? std::max<int64_t>(0, c - window + 1) : 0; };
  for (int64_t e = 0; e < seqs; ++e) {
    const int64_t n = qoffs[e + 1] - qoffs[e], cached = offs[e + 1] - offs[e] - n;
    const int64_t block = cached - oldest(cached) >= kLongContext ? 2 * short_block : short_block;
    for (int64_t t0 = 0; t0 < n; t0 += block) {
      const int64_t t1 = std::min(n, t0 + block);
      const int64_t keys = cached + t1 - oldest(cached + t0);
      for (int64_t h = 0; h < kv_heads; ++h)
        tasks.push_back({e, h, t0, t1, keys * ((t1 - t0) * qpk + kKeyCost)});
    }
  }
  // Costliest first, then any thread takes the next (as for decodes).
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const Task& a, const Task& b) { return a.cost > b.cost; });
  const std::vector<int64_t> packs = pack_extend_kv<T, Q>(k_rows, v_rows, ap, offs, qoffs, seqs,
                                                          kv_heads, dim, window, short_block);
  run_tasks(static_cast<int64_t>(tasks.size()), [&](int64_t i, Scratch& s) {
    const Task& t = tasks[i];
    const int64_t n = qoffs[t.seq + 1] - qoffs[t.seq];
    const int64_t cached = offs[t.seq + 1] - offs[t.seq] - n;
    // Keys [begin, end).
    const int64_t begin = aligned_begin(oldest(cached + t.t0), det), end = cached + t.t1;
    const int64_t rows = (t.t1 - t.t0) * qpk;
    s.state.resize(static_cast<size_t>(rows * (dim + 2)));
    float *m = s.state.data(), *sum = m + rows, *acc = sum + rows;
    // Row r: token t0 + r / qpk (context index c), query head h * qpk + r % qpk.
    auto row = [&](int64_t r) {
      const int64_t token = t.t0 + r / qpk, c = cached + token;
      return QueryRow<Q>{qp + ((qoffs[t.seq] + token) * heads + t.head * qpk + r % qpk) * dim,
                         oldest(c) - begin, c - begin};
    };
    dispatch_dim(dim, [&](auto nv) {
      attend_rows<T, Q, decltype(nv)::value>(row, rows, kp + t.head * head_stride,
                                             vp + t.head * head_stride,
                                             row_stride, ap + offs[t.seq] + begin,
                                             end - begin, dim, sc, cap, s, m, sum, acc,
                                             /*amx_any=*/true, det,
                                             packed_of(packs, t.seq, t.head, dim,
                                                       offs[t.seq + 1] - offs[t.seq]));
    });
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t token = t.t0 + r / qpk;
      Q* dst = op + ((qoffs[t.seq] + token) * heads + t.head * qpk + r % qpk) * dim;
      write_normalised(acc + r * dim, sum[r], dim, dst);
    }
  });
}

}  // namespace
