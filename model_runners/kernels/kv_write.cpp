// Writing a step's new K/V rows into the arena by slot (KVStore.write).
//
// torch's index_copy_ moves the rows element by element through a
// TensorIterator, and the K/V it gets are views transposed from the
// attention's [kv_heads, tokens, head_dim] layout, so KVStore first copied them
// into token-major rows as well: two passes, the second on one thread at
// prefill sizes (a 1,024-token chunk of SmolLM2: ~450 us per layer for K and
// V, ~5% of the step). Here each (token, head) slice is one memcpy straight
// from the strided source into its arena row, the tokens split across
// threads: the same bytes land in the same places.
//
// Registered as torch.ops.radixmux.scatter_rows; see kv_store.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kv_table.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

using radixmux::KVTable;

// `t` (a table or a source: KVTable's two forms) as rows of `heads` x `dim`:
// 3-d must match them; 2-d must be heads * dim wide.
KVTable rows_of(const at::Tensor& t, int64_t heads, int64_t dim) {
  TORCH_CHECK(t.stride(-1) == 1, "scatter_rows: rows must have a unit last stride, got strides ",
              t.strides());
  TORCH_CHECK(t.dim() == 3 ? t.size(1) == heads && t.size(2) == dim
                           : t.dim() == 2 && t.size(1) == heads * dim,
              "scatter_rows: ", t.sizes(), " is not ", heads, " heads of ", dim);
  return radixmux::kv_table(t, dim);
}

// table[addr[i]] = src[i] for every i < n: `table` and `src` are each 2-d
// rows or 3-d heads (KVTable), of one dtype; the heads of whichever is 3-d
// split the other's rows.
void scatter_rows(at::Tensor& table, const at::Tensor& addr, const at::Tensor& src) {
  TORCH_CHECK(table.dim() == 2 || table.dim() == 3, "scatter_rows: table must be 2-d or 3-d, got ",
              table.sizes());
  TORCH_CHECK(src.dim() == 2 || src.dim() == 3, "scatter_rows: src must be 2-d or 3-d, got ",
              src.sizes());
  TORCH_CHECK(src.scalar_type() == table.scalar_type(), "scatter_rows: src is ",
              src.scalar_type(), ", table ", table.scalar_type());
  TORCH_CHECK(addr.dim() == 1 && addr.scalar_type() == at::kLong && addr.is_contiguous(),
              "scatter_rows: addr must be a contiguous int64 vector");
  const at::Tensor& shaped = table.dim() == 3 ? table : src;
  const int64_t heads = shaped.dim() == 3 ? shaped.size(1) : 1;
  const int64_t dim = shaped.size(-1);
  const KVTable to_rows = rows_of(table, heads, dim), from_rows = rows_of(src, heads, dim);
  const int64_t n = addr.size(0), rows = table.size(0);
  TORCH_CHECK(src.size(0) == n, "scatter_rows: src ", src.sizes(), " for ", n, " rows");
  const int64_t* a = addr.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(a[i] >= 0 && a[i] < rows, "scatter_rows: row ", a[i], " outside the table of ",
                rows);
  const int64_t item = table.element_size();
  const int64_t slice = dim * item;
  const auto* from = static_cast<const char*>(src.data_ptr());
  auto* to = static_cast<char*>(table.data_ptr());
  // Rows per task: a decode step's few rows stay on the calling thread.
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(heads * slice, 1));
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      char* dst = to + a[i] * to_rows.row * item;
      const char* s = from + i * from_rows.row * item;
      for (int64_t h = 0; h < heads; ++h)
        std::memcpy(dst + h * to_rows.head * item, s + h * from_rows.head * item,
                    slice);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixmux, m) {
  m.def("scatter_rows(Tensor(a!) table, Tensor addr, Tensor src) -> ()");
}

TORCH_LIBRARY_IMPL(radixmux, CPU, m) { m.impl("scatter_rows", &scatter_rows); }
