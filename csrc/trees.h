// Sum and min trees kept in flat float64 tensors (the state is the tensor, so
// checkpoints and shared memory need nothing special). Node i has children 2i
// and 2i+1; the leaves are nodes [L, 2L) with L a power of two; node 0 is unused.
#pragma once

#include <ATen/ATen.h>

namespace gear {

// Leaves `index` get `values` (in order: a repeated index keeps its last value),
// then every ancestor is recomputed from its children. O(k log L).
void sum_tree_set(const at::Tensor& tree, const at::Tensor& index, const at::Tensor& values);
void min_tree_set(const at::Tensor& tree, const at::Tensor& index, const at::Tensor& values);
void max_tree_set(const at::Tensor& tree, const at::Tensor& index, const at::Tensor& values);

// For each prefix mass m in [0, total), the leaf whose cumulative range holds m.
// Never returns a zero-mass leaf while the total is positive. O(k log L).
at::Tensor sum_tree_find(const at::Tensor& tree, const at::Tensor& mass);

// The k leaves of largest value, largest first (best-first search: O(k log k + k log L)).
// Leaves at -inf are never returned, so fewer than k come back when fewer are finite.
at::Tensor max_tree_topk(const at::Tensor& tree, int64_t k);

}  // namespace gear
