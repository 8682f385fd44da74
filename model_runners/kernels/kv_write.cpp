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

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

// table[addr[i]] = src[i] for every i < n: `table` is [N, R] with unit column
// stride; `src` is [n, R] or [n, H, D] (H * D = R) with unit last-dimension
// stride and any other strides; both of one dtype.
void scatter_rows(at::Tensor& table, const at::Tensor& addr, const at::Tensor& src) {
  TORCH_CHECK(table.dim() == 2 && table.stride(1) == 1,
              "scatter_rows: table must be [N, R] with contiguous rows, got ", table.sizes(),
              " strides ", table.strides());
  TORCH_CHECK(src.scalar_type() == table.scalar_type(), "scatter_rows: src is ",
              src.scalar_type(), ", table ", table.scalar_type());
  TORCH_CHECK(addr.dim() == 1 && addr.scalar_type() == at::kLong && addr.is_contiguous(),
              "scatter_rows: addr must be a contiguous int64 vector");
  TORCH_CHECK(src.dim() == 2 || src.dim() == 3, "scatter_rows: src must be 2-d or 3-d, got ",
              src.sizes());
  const int64_t n = addr.size(0), rows = table.size(0), row = table.size(1);
  const int64_t heads = src.dim() == 3 ? src.size(1) : 1;
  const int64_t dim = src.size(-1);
  TORCH_CHECK(src.size(0) == n && heads * dim == row && src.stride(-1) == 1,
              "scatter_rows: src ", src.sizes(), " (strides ", src.strides(), ") for ", n,
              " rows of ", row);
  const int64_t* a = addr.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(a[i] >= 0 && a[i] < rows, "scatter_rows: row ", a[i], " outside the table of ",
                rows);
  const int64_t item = table.element_size();
  const int64_t token_stride = src.stride(0) * item;
  const int64_t head_stride = (src.dim() == 3 ? src.stride(1) : dim) * item;
  const int64_t table_stride = table.stride(0) * item;
  const int64_t slice = dim * item;
  const auto* from = static_cast<const char*>(src.data_ptr());
  auto* to = static_cast<char*>(table.data_ptr());
  // Rows per task: a decode step's few rows stay on the calling thread.
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(row * item, 1));
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      char* dst = to + a[i] * table_stride;
      const char* s = from + i * token_stride;
      for (int64_t h = 0; h < heads; ++h) std::memcpy(dst + h * slice, s + h * head_stride, slice);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixmux, m) {
  m.def("scatter_rows(Tensor(a!) table, Tensor addr, Tensor src) -> ()");
}

TORCH_LIBRARY_IMPL(radixmux, CPU, m) { m.impl("scatter_rows", &scatter_rows); }
