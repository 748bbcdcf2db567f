#include "trees.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <limits>
#include <queue>
#include <utility>
#include <vector>

namespace gear {
namespace {

void check_tree(const at::Tensor& tree, const at::Tensor& index, const at::Tensor* values) {
  TORCH_CHECK(tree.dim() == 1 && tree.scalar_type() == at::kDouble && tree.is_contiguous() && tree.is_cpu(),
              "tree must be a contiguous 1-D float64 CPU tensor");
  const int64_t nodes = tree.numel();
  TORCH_CHECK(nodes >= 2 && (nodes & (nodes - 1)) == 0, "tree must hold 2L nodes with L a power of two, got ",
              nodes);
  TORCH_CHECK(index.dim() == 1 && index.scalar_type() == at::kLong, "index must be a 1-D int64 tensor");
  if (values) {
    TORCH_CHECK(values->dim() == 1 && values->numel() == index.numel(), "values must be 1-D with ",
                index.numel(), " elements, got ", values->numel());
  }
}

template <typename Combine>
void tree_set(const at::Tensor& tree, const at::Tensor& index, const at::Tensor& values, Combine combine) {
  check_tree(tree, index, &values);
  const at::Tensor idx = index.contiguous();
  const at::Tensor val = values.to(at::kDouble).contiguous();
  double* t = tree.data_ptr<double>();
  const int64_t leaves = tree.numel() / 2;
  const int64_t* ip = idx.data_ptr<int64_t>();
  const double* vp = val.data_ptr<double>();
  const int64_t k = idx.numel();
  for (int64_t i = 0; i < k; ++i) {
    TORCH_CHECK_INDEX(ip[i] >= 0 && ip[i] < leaves, "tree index ", ip[i], " is out of range for ", leaves,
                      " leaves");
  }
  for (int64_t i = 0; i < k; ++i) t[leaves + ip[i]] = vp[i];
  for (int64_t i = 0; i < k; ++i) {
    for (int64_t node = (leaves + ip[i]) >> 1; node >= 1; node >>= 1) {
      t[node] = combine(t[2 * node], t[2 * node + 1]);
    }
  }
}

}  // namespace

void sum_tree_set(const at::Tensor& tree, const at::Tensor& index, const at::Tensor& values) {
  tree_set(tree, index, values, [](double a, double b) { return a + b; });
}

void min_tree_set(const at::Tensor& tree, const at::Tensor& index, const at::Tensor& values) {
  tree_set(tree, index, values, [](double a, double b) { return std::min(a, b); });
}

void max_tree_set(const at::Tensor& tree, const at::Tensor& index, const at::Tensor& values) {
  tree_set(tree, index, values, [](double a, double b) { return std::max(a, b); });
}

at::Tensor max_tree_topk(const at::Tensor& tree, int64_t k) {
  check_tree(tree, at::empty({0}, at::kLong), nullptr);
  TORCH_CHECK(k >= 0, "k must be non-negative, got ", k);
  const double* t = tree.data_ptr<double>();
  const int64_t leaves = tree.numel() / 2;
  const double none = -std::numeric_limits<double>::infinity();
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(std::min(k, leaves)));
  std::priority_queue<std::pair<double, int64_t>> frontier;
  frontier.emplace(t[1], 1);
  while (static_cast<int64_t>(out.size()) < k && !frontier.empty()) {
    const auto [value, node] = frontier.top();
    frontier.pop();
    if (!(value > none)) break;  // only -inf (or NaN) left
    if (node >= leaves) {
      out.push_back(node - leaves);
    } else {
      frontier.emplace(t[2 * node], 2 * node);
      frontier.emplace(t[2 * node + 1], 2 * node + 1);
    }
  }
  at::Tensor result = at::empty({static_cast<int64_t>(out.size())}, at::kLong);
  std::copy(out.begin(), out.end(), result.data_ptr<int64_t>());
  return result;
}

at::Tensor sum_tree_find(const at::Tensor& tree, const at::Tensor& mass) {
  TORCH_CHECK(mass.dim() == 1, "mass must be 1-D");
  check_tree(tree, at::empty({0}, at::kLong), nullptr);
  const at::Tensor m = mass.to(at::kDouble).contiguous();
  at::Tensor out = at::empty({m.numel()}, at::kLong);
  const double* t = tree.data_ptr<double>();
  const double* mp = m.data_ptr<double>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t leaves = tree.numel() / 2;
  at::parallel_for(0, m.numel(), 1024, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      double u = std::max(mp[i], 0.0);
      int64_t node = 1;
      while (node < leaves) {
        const double left = t[2 * node];
        // Rounding can leave u just past the left mass with an empty right subtree: stay left.
        if (u < left || t[2 * node + 1] <= 0.0) {
          node = 2 * node;
          u = std::min(u, left);
        } else {
          u -= left;
          node = 2 * node + 1;
        }
      }
      op[i] = node - leaves;
    }
  });
  return out;
}

}  // namespace gear
