#include "trees.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <queue>
#include <tuple>
#include <vector>

namespace gear {
namespace {

constexpr int64_t kFanout = 8;
constexpr int64_t kMaxDepth = 20;  // 8^20 leaves: far beyond any capacity

int64_t pow8(int64_t k) { return int64_t{1} << (3 * k); }

int64_t level_offset(int64_t k) { return k == 0 ? 0 : kFanout + (pow8(k) - kFanout) / (kFanout - 1); }

struct Layout {
  int64_t depth = 1;  // the leaves are level `depth`
  std::array<int64_t, kMaxDepth + 1> offset{};
  int64_t leaves() const { return pow8(depth); }
};

Layout layout_for(int64_t nodes) {
  Layout layout;
  for (layout.depth = 1; layout.depth <= kMaxDepth; ++layout.depth) {
    if (level_offset(layout.depth) + pow8(layout.depth) == nodes) break;
  }
  TORCH_CHECK(layout.depth <= kMaxDepth, "a tree of ", nodes, " nodes: allocate tree_nodes(capacity)");
  for (int64_t k = 0; k <= layout.depth; ++k) layout.offset[k] = level_offset(k);
  return layout;
}

Layout layout_of(const at::Tensor& tree) {
  TORCH_CHECK(tree.dim() == 1 && tree.scalar_type() == at::kDouble && tree.is_contiguous() && tree.is_cpu(),
              "tree must be a contiguous 1-D float64 CPU tensor");
  return layout_for(tree.numel());
}

// Checked index and values of a set, as raw arrays.
struct SetArgs {
  at::Tensor index, values;
  const int64_t* ip;
  const double* vp;
  int64_t count;
};

SetArgs set_args(const Layout& layout, const at::Tensor& index, const at::Tensor& values) {
  TORCH_CHECK(index.dim() == 1 && index.scalar_type() == at::kLong, "index must be a 1-D int64 tensor");
  TORCH_CHECK(values.dim() == 1 && values.numel() == index.numel(), "values must be 1-D with ", index.numel(),
              " elements, got ", values.numel());
  SetArgs a{index.contiguous(), values.to(at::kDouble).contiguous(), nullptr, nullptr, index.numel()};
  a.ip = a.index.data_ptr<int64_t>();
  a.vp = a.values.data_ptr<double>();
  for (int64_t i = 0; i < a.count; ++i) {
    TORCH_CHECK_INDEX(a.ip[i] >= 0 && a.ip[i] < layout.leaves(), "tree index ", a.ip[i], " is out of range for ",
                      layout.leaves(), " leaves");
  }
  return a;
}

// Recompute the ancestors of `leaf` from their children.
template <typename Combine>
void update_path(double* t, const Layout& layout, int64_t leaf, Combine combine) {
  int64_t node = leaf;
  for (int64_t level = layout.depth - 1; level >= 0; --level) {
    node /= kFanout;
    const double* children = t + layout.offset[level + 1] + kFanout * node;
    double acc = children[0];
    for (int64_t j = 1; j < kFanout; ++j) acc = combine(acc, children[j]);
    t[layout.offset[level] + node] = acc;
  }
}

const auto kSum = [](double a, double b) { return a + b; };
const auto kMin = [](double a, double b) { return std::min(a, b); };
const auto kMax = [](double a, double b) { return std::max(a, b); };

template <typename Combine>
void tree_set(const at::Tensor& tree, const at::Tensor& index, const at::Tensor& values, Combine combine) {
  const Layout layout = layout_of(tree);
  const SetArgs a = set_args(layout, index, values);
  double* t = tree.data_ptr<double>();
  for (int64_t i = 0; i < a.count; ++i) t[layout.offset[layout.depth] + a.ip[i]] = a.vp[i];
  for (int64_t i = 0; i < a.count; ++i) update_path(t, layout, a.ip[i], combine);
}

}  // namespace

int64_t tree_nodes(int64_t capacity) {
  TORCH_CHECK(capacity >= 1, "capacity must be positive, got ", capacity);
  int64_t depth = 1;
  while (pow8(depth) < capacity) ++depth;
  return level_offset(depth) + pow8(depth);
}

int64_t tree_leaf_offset(int64_t nodes) {
  const Layout layout = layout_for(nodes);
  return layout.offset[layout.depth];
}

void max_tree_set(const at::Tensor& tree, const at::Tensor& index, const at::Tensor& values) {
  tree_set(tree, index, values, kMax);
}

void priority_set(const at::Tensor& sum_tree, const at::Tensor& min_tree, const at::Tensor& index,
                  const at::Tensor& mass) {
  const Layout layout = layout_of(sum_tree);
  TORCH_CHECK(layout_of(min_tree).depth == layout.depth, "sum and min trees differ in size");
  const SetArgs a = set_args(layout, index, mass);
  double* s = sum_tree.data_ptr<double>();
  double* m = min_tree.data_ptr<double>();
  const double inf = std::numeric_limits<double>::infinity();
  const int64_t leaf0 = layout.offset[layout.depth];
  for (int64_t i = 0; i < a.count; ++i) {
    s[leaf0 + a.ip[i]] = a.vp[i];
    m[leaf0 + a.ip[i]] = a.vp[i] > 0.0 ? a.vp[i] : inf;
  }
  for (int64_t i = 0; i < a.count; ++i) {
    update_path(s, layout, a.ip[i], kSum);
    update_path(m, layout, a.ip[i], kMin);
  }
}

// Index of the child of `children` whose cumulative range holds u (u is reduced
// to the offset inside it). Branch-free on the common path: the child is the
// number of running sums at or below u, so a child without mass is never it.
inline int64_t pick_child(const double* children, double& u) {
  double running[kFanout];
  double acc = 0.0;
  for (int64_t j = 0; j < kFanout; ++j) running[j] = acc += children[j];
  int64_t chosen = 0;
  for (int64_t j = 0; j < kFanout; ++j) chosen += running[j] <= u;
  if (chosen == kFanout) {  // rounding carried u past the total: the last child with mass
    chosen = kFanout - 1;
    while (chosen > 0 && !(children[chosen] > 0.0)) --chosen;
    u = std::nextafter(children[chosen], 0.0);
    return chosen;
  }
  u -= chosen ? running[chosen - 1] : 0.0;
  return chosen;
}

at::Tensor sum_tree_find(const at::Tensor& tree, const at::Tensor& mass) {
  TORCH_CHECK(mass.dim() == 1, "mass must be 1-D");
  const Layout layout = layout_of(tree);
  const at::Tensor m = mass.to(at::kDouble).contiguous();
  at::Tensor out = at::empty({m.numel()}, at::kLong);
  const double* t = tree.data_ptr<double>();
  const double* mp = m.data_ptr<double>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, m.numel(), 1024, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      double u = std::max(mp[i], 0.0);
      int64_t node = 0;
      for (int64_t level = 0; level < layout.depth; ++level) {
        node = kFanout * node + pick_child(t + layout.offset[level + 1] + kFanout * node, u);
      }
      op[i] = node;
    }
  });
  return out;
}

at::Tensor max_tree_topk(const at::Tensor& tree, int64_t k) {
  TORCH_CHECK(k >= 0, "k must be non-negative, got ", k);
  const Layout layout = layout_of(tree);
  const double* t = tree.data_ptr<double>();
  const double none = -std::numeric_limits<double>::infinity();
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(std::min(k, layout.leaves())));
  std::priority_queue<std::tuple<double, int64_t, int64_t>> frontier;  // (value, -level, node)
  frontier.emplace(t[0], 0, 0);
  while (static_cast<int64_t>(out.size()) < k && !frontier.empty()) {
    const auto [value, neg_level, node] = frontier.top();
    frontier.pop();
    if (!(value > none)) break;  // only -inf (or NaN) left
    const int64_t level = -neg_level;
    if (level == layout.depth) {
      out.push_back(node);
      continue;
    }
    const double* children = t + layout.offset[level + 1] + kFanout * node;
    for (int64_t j = 0; j < kFanout; ++j) {
      if (children[j] > none) frontier.emplace(children[j], -(level + 1), kFanout * node + j);
    }
  }
  at::Tensor result = at::empty({static_cast<int64_t>(out.size())}, at::kLong);
  std::copy(out.begin(), out.end(), result.data_ptr<int64_t>());
  return result;
}

}  // namespace gear
