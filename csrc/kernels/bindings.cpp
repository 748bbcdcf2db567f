// The kernels' Python face (`_C`'s gather, trees, window geometry, priorities, episode indices, packing,
// shares): raw tensors in, raw tensors out. Nothing here knows sockets or the store's control segment.
#include "kernels/bindings.h"

#include <torch/extension.h>

#include "kernels/episodes.h"
#include "kernels/gather.h"
#include "kernels/packing.h"
#include "kernels/priorities.h"
#include "kernels/shares.h"
#include "kernels/trees.h"
#include "kernels/windows.h"

namespace {

gear::GatherArgs make_args(std::vector<at::Tensor> columns, std::vector<at::Tensor> out, at::Tensor starts,
                           std::optional<at::Tensor> valid_begin, std::optional<at::Tensor> valid_end,
                           int64_t window_len, std::optional<at::Tensor> mask, std::vector<at::Tensor> hot_columns,
                           std::optional<at::Tensor> hot_owner) {
  gear::GatherArgs args{std::move(columns),   std::move(out),  std::move(starts),      std::move(valid_begin),
                        std::move(valid_end), std::move(mask), window_len, std::move(hot_columns),
                        std::move(hot_owner)};
  gear::check_gather_args(args);
  return args;
}

void gather(std::vector<at::Tensor> columns, std::vector<at::Tensor> out, at::Tensor starts,
            std::optional<at::Tensor> valid_begin, std::optional<at::Tensor> valid_end, int64_t window_len,
            std::optional<at::Tensor> mask, std::vector<at::Tensor> hot_columns,
            std::optional<at::Tensor> hot_owner) {
  const gear::GatherArgs args =
      make_args(std::move(columns), std::move(out), std::move(starts), std::move(valid_begin), std::move(valid_end),
                window_len, std::move(mask), std::move(hot_columns), std::move(hot_owner));
  if (args.out.front().is_cuda()) {
#ifdef GEAR_WITH_CUDA
    gear::gather_cuda(args);
    return;
#else
    TORCH_CHECK(false, "gather into CUDA tensors needs the extension's CUDA part, which this build of "
                       "gear_torchrl does not have (it was built without nvcc or with a CPU torch)");
#endif
  }
  for (const auto& col : args.columns) {
    TORCH_CHECK(col.device().is_cpu(), "gather: CPU outputs need CPU columns, got a column on ", col.device());
  }
  TORCH_CHECK(args.starts.device().is_cpu(), "gather: CPU outputs need CPU starts");
  gear::gather_cpu(args);
}

bool built_with_cuda() {
#ifdef GEAR_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace

void bind_kernels(py::module_& m) {
  m.def("gather", &gather, "Fill `out` from `columns` for windows (rows are windows of length 1)",
        py::arg("columns"), py::arg("out"), py::arg("starts"), py::arg("valid_begin") = py::none(),
        py::arg("valid_end") = py::none(), py::arg("window_len") = 1, py::arg("mask") = py::none(),
        py::arg("hot_columns") = std::vector<at::Tensor>{}, py::arg("hot_owner") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def(
      "draw_shares",
      [](const std::vector<double>& masses, int64_t count, std::optional<at::Generator> generator) {
        gear::Shares shares = gear::draw_shares(masses, count, std::move(generator));
        return std::make_pair(std::move(shares.counts), std::move(shares.seeds));
      },
      "A batch's split across shards of `masses`, and a seed per owner (None without a generator)",
      py::arg("masses"), py::arg("count"), py::arg("generator") = py::none());
  m.def("built_with_cuda", &built_with_cuda);
  m.def("tree_nodes", &gear::tree_nodes, "Size of a tree tensor over `capacity` leaves", py::arg("capacity"));
  m.def("tree_leaf_offset", &gear::tree_leaf_offset, py::arg("nodes"));
  m.def("max_tree_set", &gear::max_tree_set, py::arg("tree"), py::arg("index"), py::arg("values"),
        py::call_guard<py::gil_scoped_release>());
  m.def("max_tree_topk", &gear::max_tree_topk, py::arg("tree"), py::arg("k"),
        py::call_guard<py::gil_scoped_release>());
  m.def("priority_set", &gear::priority_set, py::arg("sum_tree"), py::arg("min_tree"), py::arg("index"),
        py::arg("mass"), py::arg("keep") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("sum_tree_find", &gear::sum_tree_find, py::arg("tree"), py::arg("mass"),
        py::call_guard<py::gil_scoped_release>());
  m.def("sum_tree_draw", &gear::sum_tree_draw, "`count` leaves drawn in proportion to their values",
        py::arg("tree"), py::arg("count"), py::arg("generator") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def(
      "priority_update",
      [](const at::Tensor& sum_tree, const at::Tensor& min_tree, const at::Tensor& generation, const at::Tensor& rows,
         const at::Tensor& priority, const std::optional<at::Tensor>& drawn, double alpha, double eps, int64_t bound) {
        const gear::PriorityUpdate u =
            gear::priority_update(sum_tree, min_tree, generation, rows, priority, drawn, alpha, eps, bound);
        return std::make_tuple(u.applied, u.lo, u.hi, u.bad, u.landed_max);
      },
      "A priority table's checked update in one pass: (applied, lowest row, highest row, first bad priority, "
      "largest priority landed)",
      py::arg("sum_tree"), py::arg("min_tree"), py::arg("generation"), py::arg("rows"), py::arg("priority"),
      py::arg("drawn"), py::arg("alpha"), py::arg("eps"), py::arg("bound"), py::call_guard<py::gil_scoped_release>());
  m.def(
      "priority_window_update",
      [](const at::Tensor& sum_tree, const at::Tensor& min_tree, const at::Tensor& generation,
         const at::Tensor& row_mass, const at::Tensor& rows, const at::Tensor& priority,
         const std::optional<at::Tensor>& drawn, double alpha, double eps, int64_t bound, at::Tensor live_start,
         at::Tensor live_length, at::Tensor live_ends, at::Tensor live_closed, int64_t first_start, int64_t window_len,
         int64_t burn_in, bool strict_length, bool include_open) {
        const gear::LiveTensors live{std::move(live_start), std::move(live_length), std::move(live_ends),
                                     std::move(live_closed), first_start};
        const gear::PriorityUpdate u =
            gear::priority_window_update(sum_tree, min_tree, generation, row_mass, rows, priority, drawn, alpha, eps,
                                         bound, live, {window_len, burn_in, strict_length, include_open});
        return std::make_tuple(u.applied, u.lo, u.hi, u.bad, u.landed_max);
      },
      "A prioritized window table's checked update in one pass (PriorityWindowSelector.update): (applied, lowest "
      "row, highest row, first bad priority, largest priority landed)",
      py::arg("sum_tree"), py::arg("min_tree"), py::arg("generation"), py::arg("row_mass"), py::arg("rows"),
      py::arg("priority"), py::arg("drawn"), py::arg("alpha"), py::arg("eps"), py::arg("bound"), py::arg("live_start"),
      py::arg("live_length"), py::arg("live_ends"), py::arg("live_closed"), py::arg("first_start"),
      py::arg("window_len"), py::arg("burn_in"), py::arg("strict_length"), py::arg("include_open"),
      py::call_guard<py::gil_scoped_release>());
  m.def("episodes_append", &gear::episodes_append,
        "Evict the oldest steps of every column and record new ones (see episodes.h)", py::arg("start"),
        py::arg("length"), py::arg("closed"), py::arg("dead"), py::arg("first"), py::arg("next"), py::arg("rows"),
        py::arg("ends"), py::arg("evicted"), py::arg("ring_rows"), py::arg("dead_rows") = false);
  m.def("place_windows", &gear::place_windows, "Windows at positions `first` of episode slots",
        py::arg("episode_start"), py::arg("episode_length"), py::arg("slots"), py::arg("first"),
        py::arg("window_len"));
  m.def("uniform_windows", &gear::uniform_windows, "A uniform window of each chosen episode",
        py::arg("episode_start"), py::arg("episode_length"), py::arg("slots"), py::arg("u"), py::arg("window_len"),
        py::arg("burn_in"), py::arg("strict_length"));
  m.def("draw_windows", &gear::draw_windows,
        "Windows drawn as WindowSelector draws them: episodes by a sum tree's masses, a uniform window in each",
        py::arg("tree"), py::arg("episode_start"), py::arg("episode_length"), py::arg("u"), py::arg("window_len"),
        py::arg("burn_in"), py::arg("strict_length"));
  m.def("place_spans", &gear::place_spans, "Packed sequences whose training spans start at `offset` (see packing.h)",
        py::arg("episode_start"), py::arg("episode_length"), py::arg("slots"), py::arg("offset"),
        py::arg("max_train"), py::arg("burn_in"));
  m.def("uniform_spans", &gear::uniform_spans, "A uniform packed sequence of each chosen episode",
        py::arg("episode_start"), py::arg("episode_length"), py::arg("slots"), py::arg("u"), py::arg("max_train"),
        py::arg("burn_in"));
  m.def("pack_tokens", &gear::pack_tokens, "Sequences packed into a budget of tokens by the packing rule (see packing.h)",
        py::arg("first"), py::arg("length"), py::arg("burn_in"), py::arg("step"), py::arg("budget"),
        py::arg("window_rows"));
  m.def("window_rows", &gear::window_rows, "Flat ring rows of windows", py::arg("starts"), py::arg("window_len"),
        py::arg("capacity"));
  m.def("window_mask", &gear::window_mask, "Which positions of windows hold data", py::arg("valid_begin"),
        py::arg("valid_end"), py::arg("window_len"));
  m.def("check_windows", &gear::check_windows, "Bounds of a request's windows", py::arg("starts"),
        py::arg("valid_begin"), py::arg("valid_end"), py::arg("window_len"), py::arg("capacity"));
  m.def("first_row_outside", &gear::first_row_outside, "First valid row outside a ring interval, or -1",
        py::arg("starts"), py::arg("valid_begin"), py::arg("valid_end"), py::arg("window_len"), py::arg("capacity"),
        py::arg("first"), py::arg("count"));
#ifdef GEAR_WITH_CUDA
  m.def("cuda_host_register", &gear::cuda_host_register,
        "Pin and map a host tensor's memory so CUDA kernels read it in place");
  m.def("cuda_host_unregister", &gear::cuda_host_unregister);
#endif
}
