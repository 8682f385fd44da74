// Decode attention that reads K/V straight out of the paged arena.
//
// One query token per sequence attends over its context slots, wherever they
// sit in the arena: each K/V row is read once, converted to float in
// registers and used for all the query heads that share its KV head (GQA).
// The torch fallback first gathers every context into a dense tensor (a copy
// as large as the KV itself, every layer, every step) and then runs SDPA over
// that copy; this kernel skips the copy.
//
// Shared-prefix ("cascade") decode: sequences whose contexts begin with the
// same cached rows (same slots in the radix tree) form a group; the group's
// prefix K/V rows are read once for all its members' query heads, and each
// member's own suffix is attended separately. Both give unnormalised softmax
// states (running max, sum of exponentials, weighted sum of V) that merge
// exactly by log-sum-exp, so a step reads the shared prefix once per group
// instead of once per member.
//
// Registered as torch.ops.radixmux.paged_decode, paged_decode_cascade and
// paged_extend; see paged_decode.py. This file holds the ops (argument checks,
// dtype dispatch, registration); the kernel lives in paged/, one path or
// driver per header, each including the one before it:
//   vectors.h    K/V rows to float, prefetch, the per-key path's vector ops
//   per_key.h    the per-key path (attend_state), scratch, key alignment
//   tiled.h      register-blocked tiles, few rows on AVX2, the tile softmax
//   amx_tiles.h  the AMX path (bfloat16 tiles) and packed K/V
//   rows.h       which path a task's rows take, merging softmax states
//   decode.h     the decode driver: jobs, pieces, groups, threads (run)
//   extend.h     the extend driver: prefill chunks (run_extend)

#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>

#include "paged/extend.h"

namespace {

// Calls fn(T{}, Q{}) for K/V dtype T and query dtype Q, where Q is T or
// float: models pair queries with K/V of their own dtype, and compiling every
// other pair too would triple the build time. Queries of any other dtype go
// in as float (exactly: the kernel computes in float anyway), and the
// result, computed as float, is cast back once, as it would have been.
template <typename F>
at::Tensor dispatch_types(const at::Tensor& q, const at::Tensor& k_rows, F&& fn) {
  const at::ScalarType kv = k_rows.scalar_type();
  TORCH_CHECK(kv == at::kFloat || kv == at::kBFloat16 || kv == at::kHalf ||
                  kv == at::kFloat8_e4m3fn,
              "paged_decode: unsupported KV dtype ", kv);
  const at::ScalarType qt = q.scalar_type();
  TORCH_CHECK(qt == at::kFloat || qt == at::kBFloat16 || qt == at::kHalf,
              "paged_decode: unsupported query dtype ", qt);
  const bool direct = qt == kv || qt == at::kFloat;
  const at::Tensor qd = direct ? q : q.to(at::kFloat);
  at::Tensor out = at::empty_like(qd);
  auto with_kv = [&](auto t) {
    using T = decltype(t);
    if constexpr (std::is_same_v<T, c10::Float8_e4m3fn>) fn(t, float{}, qd, out);
    else if (qd.scalar_type() == at::kFloat) fn(t, float{}, qd, out);
    else fn(t, T{}, qd, out);
  };
  if (kv == at::kFloat) with_kv(float{});
  else if (kv == at::kBFloat16) with_kv(c10::BFloat16{});
  else if (kv == at::kHalf) with_kv(c10::Half{});
  else with_kv(c10::Float8_e4m3fn{});  // queries go in as float (not direct)
  return direct ? out : out.to(qt);
}

// Shapes every entry needs: q [*, H, D], tables [N, KVH * D] or [N, KVH, D]
// (KVTable), addr int64.
void check_rows(const at::Tensor& q, const at::Tensor& k_rows, const at::Tensor& v_rows,
                const at::Tensor& addr) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "paged_decode: q must be contiguous [B, H, D]");
  TORCH_CHECK((k_rows.dim() == 2 || k_rows.dim() == 3) && k_rows.stride(-1) == 1,
              "paged_decode: k_rows must be [N, row] or [N, kv_heads, head_dim]");
  TORCH_CHECK(v_rows.sizes() == k_rows.sizes() && v_rows.strides() == k_rows.strides(),
              "paged_decode: k_rows and v_rows differ in shape");
  TORCH_CHECK(k_rows.scalar_type() == v_rows.scalar_type(), "paged_decode: K/V dtypes differ");
  TORCH_CHECK(addr.scalar_type() == at::kLong && addr.is_contiguous(), "paged_decode: addr int64");
  const int64_t dim = q.size(2);
  TORCH_CHECK(k_rows.dim() == 3 ? k_rows.size(2) == dim : k_rows.size(1) % dim == 0,
              "paged_decode: K/V rows do not hold whole heads of ", dim);
  const int64_t kv_heads = kv_table(k_rows, dim).kv_heads;
  TORCH_CHECK(kv_heads > 0 && q.size(1) % kv_heads == 0,
              "paged_decode: query heads not a multiple of KV heads");
}

at::Tensor decode(const at::Tensor& q, const at::Tensor& k_rows, const at::Tensor& v_rows,
                  const at::Tensor& addr, const at::Tensor& offsets, const Groups& groups,
                  double scale, double softcap, int64_t window, bool det) {
  check_rows(q, k_rows, v_rows, addr);
  return dispatch_types(q, k_rows, [&](auto kv, auto query, const at::Tensor& qd, at::Tensor& out) {
    run<decltype(kv), decltype(query)>(qd, out, k_rows, v_rows, addr, offsets, groups, scale,
                                       softcap, window, det);
  });
}

void check_offsets(const at::Tensor& q, const at::Tensor& offsets) {
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.is_contiguous() &&
                  offsets.numel() == q.size(0) + 1,
              "paged_decode: offsets must be int64 [B + 1]");
}

// q [B, H, D]; k_rows / v_rows [N, KVH * D] (row stride may exceed the width);
// addr: the context rows of every sequence, concatenated oldest first;
// offsets [B + 1]: sequence b owns addr[offsets[b]:offsets[b + 1]].
// softcap <= 0 and window <= 0 mean none; deterministic: the batch-invariant
// arithmetic (above). Returns [B, H, D] in q's dtype.
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_rows, const at::Tensor& v_rows,
                        const at::Tensor& addr, const at::Tensor& offsets, double scale,
                        double softcap, int64_t window, bool deterministic) {
  check_offsets(q, offsets);
  return decode(q, k_rows, v_rows, addr, offsets, Groups{}, scale, softcap, window,
                deterministic);
}

// paged_decode plus groups: group_of [B] int64, the group of each sequence
// (-1: none); group_prefix [G] int64, the number of leading context rows that
// every member of group g shares (the same addr entries; read through its
// first member's). 0 <= group_prefix[g] <= every member's context length.
// deterministic: paged_decode's bits (each member resumes its group's
// prefix state, cut at a kAlignKeys boundary, rather than merging it).
at::Tensor paged_decode_cascade(const at::Tensor& q, const at::Tensor& k_rows,
                                const at::Tensor& v_rows, const at::Tensor& addr,
                                const at::Tensor& offsets, const at::Tensor& group_of,
                                const at::Tensor& group_prefix, double scale, double softcap,
                                int64_t window, bool deterministic) {
  check_offsets(q, offsets);
  TORCH_CHECK(group_of.scalar_type() == at::kLong && group_of.is_contiguous() &&
                  group_of.dim() == 1 && group_of.numel() == q.size(0),
              "paged_decode_cascade: group_of must be int64 [B]");
  TORCH_CHECK(group_prefix.scalar_type() == at::kLong && group_prefix.is_contiguous() &&
                  group_prefix.dim() == 1,
              "paged_decode_cascade: group_prefix must be int64 [G]");
  const Groups groups{group_of.data_ptr<int64_t>(), group_prefix.data_ptr<int64_t>(),
                      group_prefix.numel()};
  const int64_t* offs = offsets.data_ptr<int64_t>();
  for (int64_t b = 0; b < q.size(0); ++b) {
    const int64_t g = groups.of[b];
    TORCH_CHECK(g >= -1 && g < groups.count, "paged_decode_cascade: group_of[", b, "] = ", g,
                " outside [-1, ", groups.count, ")");
    if (g < 0) continue;
    TORCH_CHECK(groups.prefix[g] >= 0 && groups.prefix[g] <= offs[b + 1] - offs[b],
                "paged_decode_cascade: group ", g, "'s prefix ", groups.prefix[g],
                " is longer than member ", b, "'s context (", offs[b + 1] - offs[b], ")");
  }
  return decode(q, k_rows, v_rows, addr, offsets, groups, scale, softcap, window, deterministic);
}

// Causal attention of extends (prefill chunks): q [T, H, D] the new tokens of
// every extend, sequence e's at rows q_offsets[e]:q_offsets[e + 1] (int64
// [E + 1], from 0 to T); its context rows addr[offsets[e]:offsets[e + 1]]
// (int64 [E + 1]) end with its new tokens' own rows (their K/V already
// written). softcap <= 0 and window <= 0 mean none; deterministic: the
// batch-invariant arithmetic (above). Returns [T, H, D].
at::Tensor paged_extend(const at::Tensor& q, const at::Tensor& k_rows, const at::Tensor& v_rows,
                        const at::Tensor& addr, const at::Tensor& offsets,
                        const at::Tensor& q_offsets, double scale, double softcap,
                        int64_t window, bool deterministic) {
  check_rows(q, k_rows, v_rows, addr);
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.is_contiguous() &&
                  q_offsets.scalar_type() == at::kLong && q_offsets.is_contiguous() &&
                  offsets.dim() == 1 && offsets.numel() >= 1 &&
                  q_offsets.numel() == offsets.numel(),
              "paged_extend: offsets and q_offsets must be int64 [E + 1]");
  const int64_t* offs = offsets.data_ptr<int64_t>();
  const int64_t* qoffs = q_offsets.data_ptr<int64_t>();
  const int64_t seqs = offsets.numel() - 1;
  TORCH_CHECK(qoffs[0] == 0 && qoffs[seqs] == q.size(0) && offs[0] >= 0 &&
                  offs[seqs] <= addr.numel(),
              "paged_extend: offsets do not cover q and addr");
  for (int64_t e = 0; e < seqs; ++e) {
    const int64_t n = qoffs[e + 1] - qoffs[e], len = offs[e + 1] - offs[e];
    TORCH_CHECK(n >= 0 && n <= len, "paged_extend: sequence ", e, " has ", n,
                " new tokens in a context of ", len);
  }
  return dispatch_types(q, k_rows, [&](auto kv, auto query, const at::Tensor& qd, at::Tensor& out) {
    run_extend<decltype(kv), decltype(query)>(qd, out, k_rows, v_rows, addr, offsets, q_offsets,
                                              scale, softcap, window, deterministic);
  });
}

// Whether attention over head_dim-wide heads gets the tiled vector path
// (AVX-512 or AVX2 + FMA, and a head size with unrolled code). Extends are
// faster than torch's SDPA only there; the per-key scalar loops are slower.
bool has_tiled_path(int64_t head_dim) {
  bool tiled = false;
#ifdef RADIXMUX_KEY_VECTORS
  dispatch_dim(head_dim, [&](auto nv) { tiled = decltype(nv)::value > 0; });
#endif
  return tiled;
}

// The widest vector paths this library was built with (its -march decides,
// not the CPU it runs on): what the kernels' choices between paths follow.
std::string built_isa() {
#if defined(RADIXMUX_AMX)
  return "amx";
#elif defined(__AVX512BF16__)
  return "avx512bf16";
#elif defined(__AVX512F__)
  return "avx512f";
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  return "avx2";
#else
  return "scalar";
#endif
}

}  // namespace

TORCH_LIBRARY(radixmux, m) {
  m.def(
      "paged_decode(Tensor q, Tensor k_rows, Tensor v_rows, Tensor addr, Tensor offsets, "
      "float scale, float softcap, int window, bool deterministic=False) -> Tensor");
  m.def(
      "paged_decode_cascade(Tensor q, Tensor k_rows, Tensor v_rows, Tensor addr, "
      "Tensor offsets, Tensor group_of, Tensor group_prefix, float scale, float softcap, "
      "int window, bool deterministic=False) -> Tensor");
  m.def(
      "paged_extend(Tensor q, Tensor k_rows, Tensor v_rows, Tensor addr, Tensor offsets, "
      "Tensor q_offsets, float scale, float softcap, int window, bool deterministic=False) "
      "-> Tensor");
  m.def("has_tiled_path(int head_dim) -> bool", &has_tiled_path);
  m.def("built_isa() -> str", &built_isa);
}

TORCH_LIBRARY_IMPL(radixmux, CPU, m) {
  m.impl("paged_decode", &paged_decode);
  m.impl("paged_decode_cascade", &paged_decode_cascade);
  m.impl("paged_extend", &paged_extend);
}
