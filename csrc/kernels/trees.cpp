#include "kernels/trees.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <mutex>
#include <queue>
#include <tuple>
#include <utility>
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

// The entries of index and values where keep is true, in order.
std::pair<at::Tensor, at::Tensor> kept(const at::Tensor& index, const at::Tensor& values, const at::Tensor& keep) {
  TORCH_CHECK(keep.dim() == 1 && keep.scalar_type() == at::kBool && keep.numel() == index.numel(),
              "keep must be a 1-D bool tensor with ", index.numel(), " elements");
  const at::Tensor k = keep.contiguous();
  const bool* kp = k.data_ptr<bool>();
  at::Tensor out_index = at::empty_like(index), out_values = at::empty_like(values);
  const int64_t* ip = index.data_ptr<int64_t>();
  const double* vp = values.data_ptr<double>();
  int64_t* oi = out_index.data_ptr<int64_t>();
  double* ov = out_values.data_ptr<double>();
  int64_t count = 0;
  for (int64_t i = 0; i < index.numel(); ++i) {
    oi[count] = ip[i];
    ov[count] = vp[i];
    count += kp[i];
  }
  return {out_index.narrow(0, 0, count), out_values.narrow(0, 0, count)};
}

SetArgs set_args(const Layout& layout, const at::Tensor& index, const at::Tensor& values,
                 const std::optional<at::Tensor>& keep = std::nullopt) {
  TORCH_CHECK(index.dim() == 1 && index.scalar_type() == at::kLong, "index must be a 1-D int64 tensor");
  TORCH_CHECK(values.dim() == 1 && values.numel() == index.numel(), "values must be 1-D with ", index.numel(),
              " elements, got ", values.numel());
  SetArgs a{index.contiguous(), values.to(at::kDouble).contiguous(), nullptr, nullptr, 0};
  if (keep) std::tie(a.index, a.values) = kept(a.index, a.values, *keep);
  a.count = a.index.numel();
  a.ip = a.index.data_ptr<int64_t>();
  a.vp = a.values.data_ptr<double>();
  for (int64_t i = 0; i < a.count; ++i) {
    TORCH_CHECK_INDEX(a.ip[i] >= 0 && a.ip[i] < layout.leaves(), "tree index ", a.ip[i], " is out of range for ",
                      layout.leaves(), " leaves");
  }
  return a;
}

// Random reads into trees of millions of leaves miss the cache at every level;
// looking this many entries ahead keeps that many misses in flight at once.
constexpr int64_t kPrefetchDistance = 32;

inline void prefetch(const double* p) { __builtin_prefetch(p); }

// Writes the leaves, prefetching the ones a few entries ahead.
template <typename Leaf>
void write_leaves(double* t, const Layout& layout, const SetArgs& a, Leaf leaf) {
  double* leaves = t + layout.offset[layout.depth];
  for (int64_t i = 0; i < a.count; ++i) {
    if (i + kPrefetchDistance < a.count) prefetch(leaves + a.ip[i + kPrefetchDistance]);
    leaves[a.ip[i]] = leaf(a.vp[i]);
  }
}

// Recomputes every ancestor of the leaves `ip` from its children, one level at a
// time from the bottom: the nodes of a level are independent of each other, so
// their cache misses overlap (walking each leaf's path instead serializes them).
// A level with no more nodes than leaves were set is recomputed whole, in order.
template <typename Combine>
void recompute_ancestors(double* t, const Layout& layout, const int64_t* ip, int64_t count, Combine combine) {
  for (int64_t level = layout.depth - 1; level >= 0; --level) {
    const int64_t shift = 3 * (layout.depth - level);
    double* parents = t + layout.offset[level];
    const double* children = t + layout.offset[level + 1];
    auto recompute = [&](int64_t node) {
      const double* c = children + kFanout * node;
      double acc = c[0];
      for (int64_t j = 1; j < kFanout; ++j) acc = combine(acc, c[j]);
      parents[node] = acc;
    };
    if (pow8(level) <= count) {
      for (int64_t node = 0; node < pow8(level); ++node) recompute(node);
      continue;
    }
    for (int64_t i = 0; i < count; ++i) {
      if (i + kPrefetchDistance < count) prefetch(children + kFanout * (ip[i + kPrefetchDistance] >> shift));
      recompute(ip[i] >> shift);
    }
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
  write_leaves(t, layout, a, [](double v) { return v; });
  recompute_ancestors(t, layout, a.ip, a.count, combine);
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

namespace {

// Both trees' leaves `a` set, then their ancestors (one task each: the trees are independent).
void set_both(const at::Tensor& sum_tree, const at::Tensor& min_tree, const Layout& layout, const SetArgs& a) {
  double* s = sum_tree.data_ptr<double>();
  double* m = min_tree.data_ptr<double>();
  const double inf = std::numeric_limits<double>::infinity();
  // The two trees are independent: one task each.
  at::parallel_for(0, 2, 1, [&](int64_t first, int64_t last) {
    for (int64_t tree = first; tree < last; ++tree) {
      if (tree == 0) {
        write_leaves(s, layout, a, [](double v) { return v; });
        recompute_ancestors(s, layout, a.ip, a.count, kSum);
      } else {
        write_leaves(m, layout, a, [inf](double v) { return v > 0.0 ? v : inf; });
        recompute_ancestors(m, layout, a.ip, a.count, kMin);
      }
    }
  });
}

}  // namespace

void priority_set(const at::Tensor& sum_tree, const at::Tensor& min_tree, const at::Tensor& index,
                  const at::Tensor& mass, const std::optional<at::Tensor>& keep) {
  const Layout layout = layout_of(sum_tree);
  TORCH_CHECK(layout_of(min_tree).depth == layout.depth, "sum and min trees differ in size");
  set_both(sum_tree, min_tree, layout, set_args(layout, index, mass, keep));
}

void priority_set_into(const at::Tensor& sum_tree, const at::Tensor& min_tree, const int64_t* index,
                       const double* mass, int64_t count) {
  const Layout layout = layout_of(sum_tree);
  TORCH_CHECK(layout_of(min_tree).depth == layout.depth, "sum and min trees differ in size");
  set_both(sum_tree, min_tree, layout, SetArgs{at::Tensor(), at::Tensor(), index, mass, count});
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

// Searches run in lanes: each level advances every lane by one node and
// prefetches the children it will read next, so the lanes' cache misses overlap
// instead of each search waiting out its own misses one level at a time.
constexpr int64_t kLanes = 32;

// Prefix masses `mass[g] * scale` (scale 1: the masses themselves).
void find_lanes(const double* t, const Layout& layout, const double* mass, double scale, int64_t* leaf,
                int64_t lanes) {
  double u[kLanes];
  int64_t node[kLanes];
  for (int64_t g = 0; g < lanes; ++g) {
    u[g] = std::max(mass[g] * scale, 0.0);
    node[g] = 0;
  }
  for (int64_t level = 0; level < layout.depth; ++level) {
    const double* children = t + layout.offset[level + 1];
    const double* grandchildren = level + 1 < layout.depth ? t + layout.offset[level + 2] : nullptr;
    for (int64_t g = 0; g < lanes; ++g) {
      node[g] = kFanout * node[g] + pick_child(children + kFanout * node[g], u[g]);
      if (grandchildren) prefetch(grandchildren + kFanout * node[g]);
    }
  }
  std::copy(node, node + lanes, leaf);
}

namespace {

// The leaf of each prefix mass `mass[i] * scale` of the checked tree `tree`.
void find_all(const at::Tensor& tree, const double* mass, double scale, int64_t* leaf, int64_t n) {
  const Layout layout = layout_of(tree);
  const double* t = tree.data_ptr<double>();
  at::parallel_for(0, n, 1024, [&](int64_t first, int64_t last) {
    for (int64_t lane0 = first; lane0 < last; lane0 += kLanes) {
      find_lanes(t, layout, mass + lane0, scale, leaf + lane0, std::min(kLanes, last - lane0));
    }
  });
}

}  // namespace

at::Tensor sum_tree_find(const at::Tensor& tree, const at::Tensor& mass) {
  TORCH_CHECK(mass.dim() == 1, "mass must be 1-D");
  const at::Tensor m = mass.to(at::kDouble).contiguous();
  at::Tensor out = at::empty({m.numel()}, at::kLong);
  find_all(tree, m.data_ptr<double>(), 1.0, out.data_ptr<int64_t>(), m.numel());
  return out;
}

void sum_tree_pick_into(const at::Tensor& tree, const double* u, int64_t* leaf, int64_t n) {
  layout_of(tree);  // checks it is a tree before its root is read
  find_all(tree, u, tree.data_ptr<double>()[0], leaf, n);
}

void uniforms_into(std::optional<at::Generator> generator, double* u, int64_t n) {
  at::Generator g = generator.has_value() && generator->defined() ? *generator : at::detail::getDefaultCPUGenerator();
  auto* engine = at::check_generator<at::CPUGeneratorImpl>(g);
  std::lock_guard<std::mutex> lock(g.mutex());
  constexpr uint64_t kMantissa = (uint64_t{1} << 53) - 1;
  for (int64_t i = 0; i < n; ++i) u[i] = static_cast<double>(engine->random64() & kMantissa) * 0x1.0p-53;
}

void sum_tree_draw_into(const at::Tensor& tree, int64_t count, std::optional<at::Generator> generator, int64_t* leaf) {
  TORCH_CHECK_VALUE(count >= 0, "cannot draw a negative number of rows, ", count);
  layout_of(tree);  // a tree, before the generator advances
  std::vector<double> u(static_cast<size_t>(count));
  uniforms_into(std::move(generator), u.data(), count);
  sum_tree_pick_into(tree, u.data(), leaf, count);
}

at::Tensor sum_tree_draw(const at::Tensor& tree, int64_t count, std::optional<at::Generator> generator) {
  TORCH_CHECK_VALUE(count >= 0, "cannot draw a negative number of rows, ", count);
  at::Tensor out = at::empty({count}, at::kLong);
  sum_tree_draw_into(tree, count, std::move(generator), out.data_ptr<int64_t>());
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
