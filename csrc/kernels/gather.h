// One gather for every column of a table: rows are windows of length 1.
//
// Window i covers ring rows (starts[i] + j) mod capacity for j in [0, window_len).
// Positions j outside [valid_begin[i], valid_end[i]) are head/tail padding:
// zero-filled, mask false. The ring wrap makes every index in range by
// construction, so a bad start can never read outside a column.
//
// A hot tier (CUDA only) holds copies of some rows in GPU memory: hot_columns[c]
// is [hot_rows, *step_shape] on the outputs' device, and row r sits in slot
// r % hot_rows when hot_owner[r % hot_rows] == r; those rows are read from there.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

namespace gear {

// Bytes of one row of a column [rows, *row_shape] (0 for a column of no rows).
inline int64_t row_bytes_of(const at::Tensor& column) {
  const int64_t rows = column.size(0);
  return rows ? column.numel() / rows * column.element_size() : 0;
}

struct GatherArgs {
  std::vector<at::Tensor> columns;  // each [capacity, *step_shape], contiguous
  std::vector<at::Tensor> out;      // each [num_windows * window_len, *step_shape]
  at::Tensor starts;                // int64 [num_windows]
  std::optional<at::Tensor> valid_begin;  // int64 [num_windows], or all 0
  std::optional<at::Tensor> valid_end;    // int64 [num_windows], or all window_len
  std::optional<at::Tensor> mask;         // bool [num_windows * window_len]
  int64_t window_len = 1;
  std::vector<at::Tensor> hot_columns;    // empty: no hot tier
  std::optional<at::Tensor> hot_owner;    // int64 [hot_rows]

  int64_t capacity() const { return columns.front().size(0); }
  int64_t num_windows() const { return starts.size(0); }
  int64_t row_bytes(size_t c) const { return row_bytes_of(columns[c]); }
};

// Checks shapes, dtypes and devices; throws (a Python RuntimeError) on any mismatch.
void check_gather_args(const GatherArgs& args);

void gather_cpu(const GatherArgs& args);

#ifdef GEAR_WITH_CUDA
void gather_cuda(const GatherArgs& args);
void cuda_host_register(const at::Tensor& host);
void cuda_host_unregister(const at::Tensor& host);
#endif

}  // namespace gear
