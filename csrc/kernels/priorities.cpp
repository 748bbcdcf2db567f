// One pass instead of a dozen tensor ops (min/max, finiteness, masks, gathers, pow, max), each a dispatch
// that would cost more than the work at a learner's batch sizes.
#include "kernels/priorities.h"

#include "kernels/trees.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace gear {

namespace {

// An update's tensors checked and made contiguous, alive as long as the arrays they lend.
struct UpdateTensors {
  at::Tensor rows, priority, drawn;

  UpdateTensors(const at::Tensor& r, const at::Tensor& p, const std::optional<at::Tensor>& d) {
    TORCH_CHECK(r.dim() == 1 && r.scalar_type() == at::kLong && r.is_cpu(), "rows must be 1-D int64 on the CPU");
    TORCH_CHECK(p.dim() == 1 && p.scalar_type() == at::kDouble && p.numel() == r.numel() && p.is_cpu(),
                "priority must be 1-D float64 on the CPU with one value per row");
    if (d) {
      TORCH_CHECK(d->numel() == r.numel() && d->scalar_type() == at::kLong && d->is_cpu(),
                  "drawn generations: one int64 per row");
    }
    rows = r.contiguous();
    priority = p.contiguous();
    drawn = d ? d->contiguous() : at::Tensor();
  }

  UpdateArrays arrays() const {
    return {rows.data_ptr<int64_t>(), priority.data_ptr<double>(),
            drawn.defined() ? drawn.data_ptr<int64_t>() : nullptr, rows.numel()};
  }
};

}  // namespace

PriorityUpdate priority_update(const at::Tensor& sum_tree, const at::Tensor& min_tree, const at::Tensor& generation,
                               const at::Tensor& rows, const at::Tensor& priority,
                               const std::optional<at::Tensor>& drawn, double alpha, double eps, int64_t bound) {
  const UpdateTensors update(rows, priority, drawn);
  return priority_update(sum_tree, min_tree, generation, update.arrays(), alpha, eps, bound);
}

PriorityUpdate priority_window_update(const at::Tensor& sum_tree, const at::Tensor& min_tree,
                                      const at::Tensor& generation, const at::Tensor& row_mass,
                                      const at::Tensor& rows, const at::Tensor& priority,
                                      const std::optional<at::Tensor>& drawn, double alpha, double eps, int64_t bound,
                                      const LiveTensors& live, const WindowKeys& keys) {
  keys.check();
  const LiveEpisodes episodes = live_episodes(live, generation.numel());
  const UpdateTensors update(rows, priority, drawn);
  return priority_window_update(sum_tree, min_tree, generation, row_mass, update.arrays(), alpha, eps, bound,
                                episodes, keys);
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

void WindowKeys::check() const {
  TORCH_CHECK(window_len >= 1 && burn_in >= 0 && burn_in < window_len,
              "window keys: need window_len >= 1 and 0 <= burn_in < window_len, got ", window_len, ", ", burn_in);
}

bool WindowKeys::keys(const LiveEpisodes& live, int64_t row) const {
  const auto [episode, offset] = live.locate(row);
  if (episode < 0 || !(include_open || live.closed[episode])) return false;
  const int64_t length = live.length[episode];
  const int64_t lo = strict_length ? burn_in : 0;
  const int64_t hi = strict_length ? std::max(length - (window_len - burn_in) + 1, burn_in) : length;
  return offset >= lo && offset < hi;
}

PriorityUpdate priority_window_update(const at::Tensor& sum_tree, const at::Tensor& min_tree,
                                      const at::Tensor& generation, const at::Tensor& row_mass,
                                      const UpdateArrays& u, double alpha, double eps, int64_t bound,
                                      const LiveEpisodes& live, const WindowKeys& keys) {
  TORCH_CHECK(row_mass.dim() == 1 && row_mass.scalar_type() == at::kDouble && row_mass.is_contiguous() &&
                  row_mass.numel() == generation.numel(),
              "row_mass must be a contiguous float64 tensor of one mass per row");
  const LandingUpdate landing = landing_update(generation, u, alpha, eps, bound);
  if (landing.count == 0) return landing.facts;
  double* mass = row_mass.data_ptr<double>();
  for (int64_t i = 0; i < landing.count; ++i) mass[landing.rows[i]] = landing.mass[i];  // a repeat keeps its last
  thread_local std::vector<double> key_mass;
  key_mass.resize(static_cast<size_t>(landing.count));
  for (int64_t i = 0; i < landing.count; ++i) {
    const int64_t row = landing.rows[i];
    key_mass[static_cast<size_t>(i)] = keys.keys(live, row) ? mass[row] : 0.0;
  }
  priority_set_into(sum_tree, min_tree, landing.rows, key_mass.data(), landing.count);
  return landing.facts;
}

}  // namespace gear
