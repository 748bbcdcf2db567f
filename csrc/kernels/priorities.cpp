// One pass instead of a dozen tensor ops (min/max, finiteness, masks, gathers, pow, max), each a dispatch
// that would cost more than the work at a learner's batch sizes.
#include "kernels/priorities.h"

#include "kernels/trees.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace gear {

PriorityUpdate priority_update(const at::Tensor& sum_tree, const at::Tensor& min_tree, const at::Tensor& generation,
                               const at::Tensor& rows, const at::Tensor& priority,
                               const std::optional<at::Tensor>& drawn, double alpha, double eps, int64_t bound) {
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_cpu(), "rows must be 1-D int64 on the CPU");
  TORCH_CHECK(priority.dim() == 1 && priority.scalar_type() == at::kDouble && priority.numel() == rows.numel(),
              "priority must be 1-D float64 with one value per row");
  TORCH_CHECK(generation.dim() == 1 && generation.scalar_type() == at::kLong && generation.is_contiguous(),
              "generation must be a contiguous 1-D int64 tensor");
  TORCH_CHECK(bound <= generation.numel(), "rows are bounded by the table's capacity, ", generation.numel());
  const at::Tensor r = rows.contiguous(), p = priority.contiguous();
  const int64_t n = r.numel();
  const int64_t* rp = r.data_ptr<int64_t>();
  const double* pp = p.data_ptr<double>();
  PriorityUpdate out{false, std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::min(), -1, 0.0};
  for (int64_t i = 0; i < n; ++i) {
    out.lo = std::min(out.lo, rp[i]);
    out.hi = std::max(out.hi, rp[i]);
    if (out.bad < 0 && !(std::isfinite(pp[i]) && pp[i] >= 0)) out.bad = i;
  }
  if (n && (out.lo < -1 || out.hi >= bound || out.bad >= 0)) return out;
  out.applied = true;
  if (!n) return out;

  at::Tensor d;
  const int64_t* dp = nullptr;
  if (drawn) {
    TORCH_CHECK(drawn->numel() == n && drawn->scalar_type() == at::kLong, "drawn generations: one int64 per row");
    d = drawn->contiguous();
    dp = d.data_ptr<int64_t>();
  }
  const int64_t* gp = generation.data_ptr<int64_t>();
  // The masses as torch.pow computes them (the same values a GPU table and a restored state hold).
  const at::Tensor mass = at::pow(p + eps, alpha);
  at::Tensor keep = at::empty({n}, at::kBool);
  bool* kp = keep.data_ptr<bool>();
  for (int64_t i = 0; i < n; ++i) {
    kp[i] = rp[i] >= 0 && (!dp || gp[rp[i]] == dp[i]);
    if (kp[i]) out.landed_max = std::max(out.landed_max, pp[i]);
  }
  priority_set(sum_tree, min_tree, r, mass, keep);
  return out;
}

}  // namespace gear
