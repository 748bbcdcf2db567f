// A proportional priority table's batched update (selection/priorities.py on the CPU) in one pass:
// every entry checked before anything changes, rows -1 and rows rewritten since they were drawn left
// out, the others' masses (p + eps)^alpha set in the sum and min trees.
#pragma once

#include "kernels/windows.h"

#include <ATen/ATen.h>

#include <optional>

namespace gear {

struct PriorityUpdate {
  bool applied;       // false: a check failed and nothing changed (the facts below say which)
  int64_t lo, hi;     // the smallest and largest row
  int64_t bad;        // the first entry whose priority is not finite and >= 0 (-1: none)
  double landed_max;  // the largest priority that landed (0 when none did)
};

// An update's arrays, `count` entries each: rows, priorities and the rows' generations when drawn (nullptr: none).
struct UpdateArrays {
  const int64_t* rows;
  const double* priority;
  const int64_t* drawn;
  int64_t count;
};

// `rows` (int64, -1: skip) below `bound`, `priority` (float64, finite and >= 0) one per row; where
// `drawn` (the rows' generations when they were drawn) is given, a row whose `generation` moved on
// keeps its mass.
PriorityUpdate priority_update(const at::Tensor& sum_tree, const at::Tensor& min_tree, const at::Tensor& generation,
                               const at::Tensor& rows, const at::Tensor& priority,
                               const std::optional<at::Tensor>& drawn, double alpha, double eps, int64_t bound);

// An update checked (`facts`), and the entries that land: rows -1 and rows whose `generation` moved on since
// `drawn` left out, the others with their masses (p + eps)^alpha, computed in one pow over the whole update.
// `rows` and `mass` are this thread's scratch, valid until its next call.
struct LandingUpdate {
  PriorityUpdate facts;
  const int64_t* rows = nullptr;
  const double* mass = nullptr;
  int64_t count = 0;
};
LandingUpdate landing_update(const at::Tensor& generation, const UpdateArrays& update, double alpha, double eps,
                             int64_t bound);

// The same update from raw arrays (a native owner's, as received): one tensor op, the masses' pow.
PriorityUpdate priority_update(const at::Tensor& sum_tree, const at::Tensor& min_tree, const at::Tensor& generation,
                               const UpdateArrays& update, double alpha, double eps, int64_t bound);

// Where a rule of prioritized windows lets a window's training steps start (PriorityWindowSelector._key_offsets).
struct WindowKeys {
  int64_t window_len, burn_in;
  bool strict_length, include_open;

  // Whether ring row `row` keys a window of one of `live`'s episodes.
  bool keys(const LiveEpisodes& live, int64_t row) const;
  // Throws unless 1 <= window_len and 0 <= burn_in < window_len.
  void check() const;
};

// PriorityWindowSelector.update on the CPU (selection/priority_windows.py) in one pass: checked and landed as
// priority_update lands rows, each landing row's mass kept in `row_mass` (float64 [capacity]) and set in the
// trees where the row keys a window of `live`, elsewhere none. A refused update changes nothing.
PriorityUpdate priority_window_update(const at::Tensor& sum_tree, const at::Tensor& min_tree,
                                      const at::Tensor& generation, const at::Tensor& row_mass,
                                      const UpdateArrays& update, double alpha, double eps, int64_t bound,
                                      const LiveEpisodes& live, const WindowKeys& keys);

// The same update from tensors (a learner's update of its own store), checked first.
PriorityUpdate priority_window_update(const at::Tensor& sum_tree, const at::Tensor& min_tree,
                                      const at::Tensor& generation, const at::Tensor& row_mass,
                                      const at::Tensor& rows, const at::Tensor& priority,
                                      const std::optional<at::Tensor>& drawn, double alpha, double eps, int64_t bound,
                                      const LiveTensors& live, const WindowKeys& keys);

}  // namespace gear
