// Send windows of ring rows to a socket without gathering them first (see cpu/send.cpp).
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace gear {

// Writes, column by column, every position of every window to `fd` (a blocking socket):
// ring rows (start + p) mod capacity for p in [valid_begin, valid_end), zeros elsewhere.
// The byte stream equals the window gather's output, columns one after the other.
void send_windows(int64_t fd, const std::vector<at::Tensor>& columns, const at::Tensor& starts,
                  const at::Tensor& valid_begin, const at::Tensor& valid_end, int64_t seq_len);

}  // namespace gear
