// Sum, min and max trees kept in flat float64 tensors (the state is the tensor, so
// checkpoints and shared memory need nothing special).
//
// Layout: 8-ary, so the 8 children of a node fill one 64-byte cache line and a
// tree over a million rows is 7 levels deep instead of 20. Level 0 is the root
// (node 0, padded to 8 entries); level k >= 1 starts at 8 + (8^k - 8) / 7 and
// holds 8^k nodes; node i of level k has children 8i..8i+7 of level k+1; the
// leaves are the last level. tree_nodes(capacity) is the tensor size to allocate.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace gear {

int64_t tree_nodes(int64_t capacity);
int64_t tree_leaf_offset(int64_t nodes);  // where leaf 0 sits in a tree of `nodes` entries

// Leaves `index` get `values` (in order: a repeated index keeps its last value),
// then every ancestor is recomputed from its children. O(k log_8 L).
void max_tree_set(const at::Tensor& tree, const at::Tensor& index, const at::Tensor& values);

// Both trees of a priority table in one call (one core each): sum of masses, and the minimum of
// the positive ones (a zero mass counts as +inf there, so weights stay finite).
// Entries whose `keep` is false (stale rows, skipped indices) are left out.
void priority_set(const at::Tensor& sum_tree, const at::Tensor& min_tree, const at::Tensor& index,
                  const at::Tensor& mass, const std::optional<at::Tensor>& keep);

// priority_set of `count` leaves `index` (each in range: the caller checked) and their masses, as raw arrays.
void priority_set_into(const at::Tensor& sum_tree, const at::Tensor& min_tree, const int64_t* index,
                       const double* mass, int64_t count);

// For each prefix mass m in [0, total), the leaf whose cumulative range holds m.
// Never returns a zero-mass leaf while the total is positive. O(k log_8 L).
at::Tensor sum_tree_find(const at::Tensor& tree, const at::Tensor& mass);

// The leaf of each of the `n` uniforms `u` in [0, 1), scaled by the tree's total (a draw in proportion to the
// leaves' values), into `leaf`: sum_tree_find of u * total over raw arrays.
void sum_tree_pick_into(const at::Tensor& tree, const double* u, int64_t* leaf, int64_t n);

// `n` float64 uniforms in [0, 1) from `generator` (the default CPU one when none), as torch.rand fills a
// float64 tensor (a random64() each, its low 53 bits scaled), without the dispatcher: a seeded draw here is
// the one the tensor ops make, at a fraction of a small draw's cost.
void uniforms_into(std::optional<at::Generator> generator, double* u, int64_t n);

// `count` leaves drawn in proportion to their values: float64 uniforms from `generator` (uniforms_into: what
// torch.rand draws for that seed) scaled by the total, then found.
at::Tensor sum_tree_draw(const at::Tensor& tree, int64_t count, std::optional<at::Generator> generator);

// sum_tree_draw into a caller's array of `count` leaves (a native owner's reply), with no tensor made.
void sum_tree_draw_into(const at::Tensor& tree, int64_t count, std::optional<at::Generator> generator, int64_t* leaf);

// The k leaves of largest value, largest first (best-first search).
// Leaves at -inf are never returned, so fewer than k come back when fewer are finite.
at::Tensor max_tree_topk(const at::Tensor& tree, int64_t k);

}  // namespace gear
