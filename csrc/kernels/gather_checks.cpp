#include "kernels/gather.h"

namespace gear {

namespace {

void check_hot_tier(const GatherArgs& a, const at::Device& out_device) {
  if (a.hot_columns.empty()) {
    TORCH_CHECK(!a.hot_owner.has_value(), "gather: hot_owner without hot_columns");
    return;
  }
  TORCH_CHECK(out_device.is_cuda(), "gather: a hot tier needs CUDA outputs");
  TORCH_CHECK(a.hot_columns.size() == a.columns.size(), "gather: ", a.hot_columns.size(),
              " hot columns for ", a.columns.size(), " columns");
  TORCH_CHECK(a.hot_owner.has_value(), "gather: hot_columns without hot_owner");
  const at::Tensor& owner = *a.hot_owner;
  TORCH_CHECK(owner.dim() == 1 && owner.numel() > 0 && owner.scalar_type() == at::kLong && owner.is_contiguous(),
              "gather: hot_owner must be a contiguous non-empty int64 vector");
  TORCH_CHECK(owner.device() == out_device, "gather: hot_owner must be on the outputs' device ", out_device);
  for (size_t c = 0; c < a.columns.size(); ++c) {
    const at::Tensor& hot = a.hot_columns[c];
    TORCH_CHECK(hot.device() == out_device && hot.is_contiguous() && hot.scalar_type() == a.columns[c].scalar_type()
                    && hot.dim() >= 1 && hot.size(0) == owner.numel()
                    && hot.sizes().slice(1) == a.columns[c].sizes().slice(1),
                "gather: hot column ", c, " must be a contiguous ", a.columns[c].scalar_type(), " tensor [",
                owner.numel(), ", ", a.columns[c].sizes().slice(1), "] on ", out_device);
  }
}

}  // namespace

void check_gather_args(const GatherArgs& a) {
  TORCH_CHECK(!a.columns.empty(), "gather: no columns");
  TORCH_CHECK(a.columns.size() == a.out.size(), "gather: ", a.columns.size(), " columns but ",
              a.out.size(), " outputs");
  TORCH_CHECK(a.window_len >= 1, "gather: window_len must be >= 1, got ", a.window_len);
  TORCH_CHECK(a.starts.dim() == 1 && a.starts.scalar_type() == at::kLong,
              "gather: starts must be a 1-D int64 tensor, got ", a.starts.scalar_type(), " of dim ",
              a.starts.dim());
  const int64_t capacity = a.capacity();
  const int64_t num_windows = a.num_windows();
  TORCH_CHECK(capacity > 0 || num_windows == 0, "gather: cannot gather from an empty table");
  for (const auto* bound : {&a.valid_begin, &a.valid_end}) {
    if (bound->has_value()) {
      const at::Tensor& b = bound->value();
      TORCH_CHECK(b.dim() == 1 && b.size(0) == num_windows && b.scalar_type() == at::kLong,
                  "gather: valid_begin/valid_end must be int64 [", num_windows, "]");
      TORCH_CHECK(b.device() == a.starts.device(), "gather: bounds must be on the device of starts");
    }
  }
  if (a.mask.has_value()) {
    const at::Tensor& m = a.mask.value();
    TORCH_CHECK(m.scalar_type() == at::kBool && m.is_contiguous() && m.numel() == num_windows * a.window_len,
                "gather: mask must be a contiguous bool tensor of ", num_windows * a.window_len, " elements");
  }
  const at::Device out_device = a.out.front().device();
  for (size_t c = 0; c < a.columns.size(); ++c) {
    const at::Tensor& col = a.columns[c];
    const at::Tensor& out = a.out[c];
    TORCH_CHECK(col.dim() >= 1 && col.size(0) == capacity, "gather: column ", c, " has ",
                col.dim() ? col.size(0) : 0, " rows, expected ", capacity);
    TORCH_CHECK(col.is_contiguous() && out.is_contiguous(), "gather: column ", c,
                " and its output must be contiguous");
    TORCH_CHECK(col.scalar_type() == out.scalar_type(), "gather: column ", c, " is ",
                col.scalar_type(), " but its output is ", out.scalar_type());
    TORCH_CHECK(out.dim() >= 1 && out.size(0) == num_windows * a.window_len, "gather: output ", c,
                " must have ", num_windows * a.window_len, " rows");
    TORCH_CHECK(out.sizes().slice(1) == col.sizes().slice(1), "gather: output ", c, " rows have shape ",
                out.sizes().slice(1), " but the column's rows have shape ", col.sizes().slice(1));
    TORCH_CHECK(out.device() == out_device, "gather: all outputs must be on one device");
  }
  if (a.mask.has_value()) {
    TORCH_CHECK(a.mask->device() == out_device, "gather: mask must be on the outputs' device");
  }
  check_hot_tier(a, out_device);
}

}  // namespace gear
