// One pass instead of a dozen tensor ops (min/max, finiteness, masks, gathers, pow, max), each a dispatch
// that would cost more than the work at a learner's batch sizes.
#include "kernels/priorities.h"

#include "kernels/trees.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace gear {

PriorityUpdate priority_update(const at::Tensor& sum_tree, const at::Tensor& min_tree, const at::Tensor& generation,
                               const at::Tensor& rows, const at::Tensor& priority,
                               const std::optional<at::Tensor>& drawn, double alpha, double eps, int64_t bound) {
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_cpu(), "rows must be 1-D int64 on the CPU");
  TORCH_CHECK(priority.dim() == 1 && priority.scalar_type() == at::kDouble && priority.numel() == rows.numel(),
              "priority must be 1-D float64 with one value per row");
  if (drawn) {
    TORCH_CHECK(drawn->numel() == rows.numel() && drawn->scalar_type() == at::kLong,
                "drawn generations: one int64 per row");
  }
  const at::Tensor r = rows.contiguous(), p = priority.contiguous();
  const at::Tensor d = drawn ? drawn->contiguous() : at::Tensor();
  return priority_update(sum_tree, min_tree, generation,
                         {r.data_ptr<int64_t>(), p.data_ptr<double>(), d.defined() ? d.data_ptr<int64_t>() : nullptr,
                          r.numel()},
                         alpha, eps, bound);
}

LandingUpdate landing_update(const at::Tensor& generation, const UpdateArrays& u, double alpha, double eps,
                             int64_t bound) {
  TORCH_CHECK(generation.dim() == 1 && generation.scalar_type() == at::kLong && generation.is_contiguous(),
              "generation must be a contiguous 1-D int64 tensor");
  TORCH_CHECK(bound <= generation.numel(), "rows are bounded by the table's capacity, ", generation.numel());
  const int64_t n = u.count;
  LandingUpdate out{{false, std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::min(), -1, 0.0}};
  PriorityUpdate& facts = out.facts;
  for (int64_t i = 0; i < n; ++i) {
    facts.lo = std::min(facts.lo, u.rows[i]);
    facts.hi = std::max(facts.hi, u.rows[i]);
    if (facts.bad < 0 && !(std::isfinite(u.priority[i]) && u.priority[i] >= 0)) facts.bad = i;
  }
  if (n && (facts.lo < -1 || facts.hi >= bound || facts.bad >= 0)) return out;
  facts.applied = true;
  if (!n) return out;

  // The masses as torch.pow computes them over the whole update (the same values a GPU table and a restored
  // state hold: its vector and scalar lanes split the n entries as Python's pow does), into scratch arrays.
  thread_local std::vector<double> mass;
  thread_local std::vector<int64_t> kept_rows;
  thread_local std::vector<double> kept_mass;
  mass.resize(2 * n);
  double* base = mass.data() + n;
  for (int64_t i = 0; i < n; ++i) base[i] = u.priority[i] + eps;
  at::Tensor masses = at::from_blob(mass.data(), {n}, at::kDouble);
  at::pow_out(masses, at::from_blob(base, {n}, at::kDouble), alpha);
  // Rows -1 and rows rewritten since they were drawn keep their masses; the others land in order (a repeated
  // row keeps its last).
  const int64_t* gp = generation.data_ptr<int64_t>();
  kept_rows.clear();
  kept_mass.clear();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = u.rows[i];
    if (row < 0 || (u.drawn && gp[row] != u.drawn[i])) continue;
    kept_rows.push_back(row);
    kept_mass.push_back(mass[i]);
    facts.landed_max = std::max(facts.landed_max, u.priority[i]);
  }
  out.rows = kept_rows.data();
  out.mass = kept_mass.data();
  out.count = static_cast<int64_t>(kept_rows.size());
  return out;
}

PriorityUpdate priority_update(const at::Tensor& sum_tree, const at::Tensor& min_tree, const at::Tensor& generation,
                               const UpdateArrays& u, double alpha, double eps, int64_t bound) {
  const LandingUpdate landing = landing_update(generation, u, alpha, eps, bound);
  if (landing.count > 0) priority_set_into(sum_tree, min_tree, landing.rows, landing.mass, landing.count);
  return landing.facts;
}

}  // namespace gear
