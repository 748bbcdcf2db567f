// Python face of the extension: raw tensors in, raw tensors out.
#include <torch/extension.h>

#include "episodes.h"
#include "gather.h"
#include "owner.h"
#include "packing.h"
#include "priorities.h"
#include "recv.h"
#include "shares.h"
#include "trees.h"
#include "windows.h"

namespace {

// A WindowRule as Python passes it: (key, tree, episode_start, episode_length, window_len, burn_in,
// strict_length, seen_lo, seen_hi).
using WindowRuleArgs =
    std::tuple<std::string, at::Tensor, at::Tensor, at::Tensor, int64_t, int64_t, bool, int64_t, int64_t>;

gear::WindowRule window_rule(WindowRuleArgs&& args) {
  auto& [key, tree, start, length, window_len, burn_in, strict, seen_lo, seen_hi] = args;
  return {std::move(key), std::move(tree), std::move(start), std::move(length), window_len, burn_in, strict,
          seen_lo, seen_hi};
}

// A PriorityRule as Python passes it: (key, update key, sum tree, min tree, generation, followed, largest
// priority, alpha, eps, rows per step, lock).
using PriorityRuleArgs = std::tuple<std::string, std::string, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                                    double, double, int64_t, std::shared_ptr<gear::SelectorLock>>;

gear::PriorityRule priority_rule(PriorityRuleArgs&& args) {
  auto& [key, update_key, sum_tree, min_tree, generation, followed, max_priority, alpha, eps, rows_per_step, lock] =
      args;
  return {std::move(key),  std::move(update_key),   std::move(sum_tree), std::move(min_tree),
          std::move(generation), std::move(followed), std::move(max_priority), alpha, eps, rows_per_step,
          std::move(lock)};
}

// Takes a SelectorLock from Python: at once when it is free, else waiting with the GIL released (its
// holder may be a native owner's thread, or a Python thread that needs the GIL to let it go).
void acquire(gear::SelectorLock& lock) {
  if (!lock.mutex.try_lock()) {
    py::gil_scoped_release released;
    lock.mutex.lock();
  }
  lock.held_by_python = true;
}

void release(gear::SelectorLock& lock) {
  if (!lock.held_by_python.exchange(false)) throw std::runtime_error("release of a SelectorLock nobody acquired");
  lock.mutex.unlock();
}

gear::GatherArgs make_args(std::vector<at::Tensor> columns, std::vector<at::Tensor> out, at::Tensor starts,
                           std::optional<at::Tensor> valid_begin, std::optional<at::Tensor> valid_end,
                           int64_t seq_len, std::optional<at::Tensor> mask, std::vector<at::Tensor> hot_columns,
                           std::optional<at::Tensor> hot_owner) {
  gear::GatherArgs args{std::move(columns),   std::move(out),  std::move(starts),      std::move(valid_begin),
                        std::move(valid_end), std::move(mask), seq_len, std::move(hot_columns),
                        std::move(hot_owner)};
  gear::check_gather_args(args);
  return args;
}

void gather(std::vector<at::Tensor> columns, std::vector<at::Tensor> out, at::Tensor starts,
            std::optional<at::Tensor> valid_begin, std::optional<at::Tensor> valid_end, int64_t seq_len,
            std::optional<at::Tensor> mask, std::vector<at::Tensor> hot_columns,
            std::optional<at::Tensor> hot_owner) {
  const gear::GatherArgs args =
      make_args(std::move(columns), std::move(out), std::move(starts), std::move(valid_begin), std::move(valid_end),
                seq_len, std::move(mask), std::move(hot_columns), std::move(hot_owner));
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

// Bytes as a uint8 tensor, for Python to read (a reply's head).
at::Tensor byte_tensor(const std::vector<uint8_t>& bytes) {
  at::Tensor out = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  std::memcpy(out.data_ptr(), bytes.data(), bytes.size());
  return out;
}

// Runs f with the GIL released, for calls that wait on sockets (a server's daemon threads make them).
// At interpreter exit, a daemon thread that takes the GIL back is ended by pthread_exit, which unwinds
// its stack: taking the GIL back here, rather than in gil_scoped_release's destructor (noexcept), lets
// that unwind pass instead of calling std::terminate (seen as SIGABRT when a job ends).
template <typename F>
auto without_gil(F&& f) {
  PyThreadState* state = PyEval_SaveThread();
  std::optional<decltype(f())> result;
  std::exception_ptr error;
  try {
    result.emplace(f());
  } catch (...) {
    error = std::current_exception();
  }
  PyEval_RestoreThread(state);
  if (error) std::rethrow_exception(error);
  return std::move(*result);
}

using Inboxes = std::vector<std::shared_ptr<gear::Inbox>>;

bool built_with_cuda() {
#ifdef GEAR_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "gear_torchrl kernels: gather, trees, window geometry, episode indices";
  py::class_<gear::SelectorLock, std::shared_ptr<gear::SelectorLock>>(
      m, "SelectorLock", "A shared selection core's lock, taken by Python and by the native owner alike")
      .def(py::init<>())
      .def("acquire", &acquire)
      .def("release", &release)
      .def("__enter__", &acquire)
      .def("__exit__", [](gear::SelectorLock& lock, const py::args&) {
        release(lock);
        return false;
      });
  py::class_<gear::Inbox, std::shared_ptr<gear::Inbox>>(
      m, "Inbox", "A connection's bytes read past the reply being taken, kept for the replies owed after it")
      .def(py::init<>())
      .def_property_readonly("held", &gear::Inbox::held, "bytes kept, not taken yet")
      .def_readwrite("reads_ahead", &gear::Inbox::reads_ahead,
                     "more replies are owed after the next: its first read may take theirs too")
      .def(
          "owe", [](gear::Inbox& box, const std::vector<int64_t>& tickets) {
            box.owed.insert(box.owed.end(), tickets.begin(), tickets.end());
          },
          "Owe replies with these tickets, after those owed already", py::arg("tickets"))
      .def_property_readonly(
          "owed", [](const gear::Inbox& box) { return std::vector<int64_t>(box.owed.begin(), box.owed.end()); },
          "the tickets of the replies owed, in order")
      .def_property_readonly("first_owed", &gear::Inbox::first_owed, "the ticket of the reply owed next (-1: none)");
  m.attr("NOT_OWED") = gear::kNotOwed;
  m.attr("BYTES_PAST") = gear::kBytesPast;
  m.def("gather", &gather, "Fill `out` from `columns` for windows (rows are windows of length 1)",
        py::arg("columns"), py::arg("out"), py::arg("starts"), py::arg("valid_begin") = py::none(),
        py::arg("valid_end") = py::none(), py::arg("seq_len") = 1, py::arg("mask") = py::none(),
        py::arg("hot_columns") = std::vector<at::Tensor>{}, py::arg("hot_owner") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def(
      "recv_exact",
      [](int64_t fd, const at::Tensor& out, double timeout_s) {
        return without_gil([&] { return gear::recv_exact(fd, out, timeout_s); });
      },
      "Receive exactly a tensor's bytes from a socket (GIL released)", py::arg("fd"), py::arg("out"),
      py::arg("timeout_s"));
  m.def(
      "receive_replies",
      [](const std::vector<int64_t>& fds, const std::vector<std::vector<at::Tensor>>& landing,
         const std::vector<std::vector<int64_t>>& first, double timeout_s, const Inboxes& inboxes, int64_t ticket) {
        std::vector<gear::Reply> replies =
            without_gil([&] { return gear::receive_replies(fds, landing, first, timeout_s, inboxes, ticket); });
        std::vector<std::tuple<int64_t, int64_t, std::vector<int64_t>, at::Tensor, std::vector<at::Tensor>>> out;
        for (auto& r : replies) {
          out.emplace_back(r.status, r.op, std::move(r.tally), byte_tensor(r.head), std::move(r.small));
        }
        return out;
      },
      "One framed reply from each socket, waited on together (GIL released): (status, op, tally of a ROWS or "
      "WINDOWS reply, head, small arrays). With inboxes (one per socket), bytes read past a reply are kept there; "
      "with a ticket too, only sockets owing it next are read (else status NOT_OWED), and a reply read is struck "
      "off (BYTES_PAST: bytes follow the last reply owed).",
      py::arg("fds"), py::arg("landing"), py::arg("first"), py::arg("timeout_s"), py::arg("inboxes") = Inboxes{},
      py::arg("ticket") = -1);
  m.def(
      "send_requests",
      [](const std::vector<int64_t>& fds, const std::vector<std::string>& frames, double timeout_s) {
        return without_gil([&] { return gear::send_requests(fds, frames, timeout_s); });
      },
      "Each socket its framed request, sent whole in turn (GIL released): 0 or -errno per socket", py::arg("fds"),
      py::arg("frames"), py::arg("timeout_s"));
  m.def(
      "send_shares",
      [](const std::vector<int64_t>& fds, const std::string& head, const std::vector<int64_t>& counts,
         const std::vector<int64_t>& seeds, int64_t columns, double timeout_s) {
        return without_gil([&] { return gear::send_shares(fds, head, counts, seeds, columns, timeout_s); });
      },
      "Each socket its share of one or more batches (counts and seeds batch by batch, one per socket each), `head` "
      "and each ask (count, seed, columns) framed here, one write per socket (GIL released): 0 or -errno per socket",
      py::arg("fds"), py::arg("head"), py::arg("counts"), py::arg("seeds"), py::arg("columns"), py::arg("timeout_s"));
  m.def(
      "receive_shares",
      [](const std::vector<int64_t>& fds, const std::vector<at::Tensor>& landing, int64_t pick_arrays,
         const std::vector<int64_t>& firsts, const std::vector<int64_t>& asked, int64_t rows_per_pick, int64_t op,
         double timeout_s, const Inboxes& inboxes, int64_t ticket) {
        gear::ShareReplies r = without_gil([&] {
          return gear::receive_shares(fds, landing, pick_arrays, firsts, asked, rows_per_pick, op, timeout_s, inboxes,
                                      ticket);
        });
        py::list heads;
        for (auto& h : r.heads) heads.append(h.empty() ? py::none() : py::cast(byte_tensor(h)));
        return py::make_tuple(r.status, r.count, r.rows, r.mass, r.min_mass, heads);
      },
      "Every owner's share of one batch, received together into the same landing tensors (GIL released): lists "
      "of status, picks, live rows, mass and least positive mass per socket, and an ERROR reply's head (else "
      "None); inboxes and a ticket as receive_replies takes them",
      py::arg("fds"), py::arg("landing"), py::arg("pick_arrays"), py::arg("firsts"), py::arg("asked"),
      py::arg("rows_per_pick"), py::arg("op"), py::arg("timeout_s"), py::arg("inboxes") = Inboxes{},
      py::arg("ticket") = -1);
  m.def(
      "serve_samples",
      [](int64_t fd, at::Tensor header, at::Tensor reader, std::vector<at::Tensor> columns, int64_t layout_version,
         int64_t seen_seq, int64_t max_lag, double catch_up_s, std::optional<WindowRuleArgs> windows,
         std::optional<PriorityRuleArgs> priorities) {
        const gear::OwnedStore store{std::move(header), std::move(reader), std::move(columns), layout_version};
        std::optional<gear::WindowRule> rule;
        if (windows) rule = window_rule(std::move(*windows));
        std::optional<gear::PriorityRule> prioritized;
        if (priorities) prioritized = priority_rule(std::move(*priorities));
        const gear::Served s = without_gil([&] {
          return gear::serve_samples(fd, store, seen_seq, max_lag, catch_up_s, rule ? &*rule : nullptr,
                                     prioritized ? &*prioritized : nullptr);
        });
        return std::make_tuple(s.code, s.count, s.seed, s.columns, s.answered, s.op, s.arrays);
      },
      "Answer SAMPLE_ROWS, and SAMPLE_WINDOWS, SAMPLE_PRIORITIZED and POST_UPDATE of the armed rules, natively "
      "until Python must act (GIL released): (code, count, seed, columns, answered, op of the request Python "
      "answers, a refused update's arrays)",
      py::arg("fd"), py::arg("header"), py::arg("reader"), py::arg("columns"), py::arg("layout_version"),
      py::arg("seen_seq"), py::arg("max_lag"), py::arg("catch_up_s"), py::arg("windows") = py::none(),
      py::arg("priorities") = py::none());
  m.def(
      "sample_rows_into",
      [](at::Tensor header, at::Tensor reader, std::vector<at::Tensor> columns, int64_t layout_version, int64_t count,
         int64_t seed, const at::Tensor& picks, const std::vector<at::Tensor>& out) {
        const gear::OwnedStore store{std::move(header), std::move(reader), std::move(columns), layout_version};
        return gear::sample_rows_into(store, count, seed, picks, out);
      },
      "serve_samples's answer of rows into this process's tensors (GIL released): the live rows drawn over, or -1 "
      "when Python must answer",
      py::arg("header"), py::arg("reader"), py::arg("columns"), py::arg("layout_version"), py::arg("count"),
      py::arg("seed"), py::arg("picks"), py::arg("out"), py::call_guard<py::gil_scoped_release>());
  m.def(
      "sample_prioritized_into",
      [](at::Tensor header, at::Tensor reader, std::vector<at::Tensor> columns, int64_t layout_version,
         PriorityRuleArgs priorities, int64_t count, int64_t seed, const at::Tensor& picks, const at::Tensor& mass,
         const at::Tensor& generation, const std::vector<at::Tensor>& out) {
        const gear::OwnedStore store{std::move(header), std::move(reader), std::move(columns), layout_version};
        const gear::PriorityRule rule = priority_rule(std::move(priorities));
        const gear::PrioritizedInto got = without_gil(
            [&] { return gear::sample_prioritized_into(store, rule, count, seed, picks, mass, generation, out); });
        return std::make_tuple(got.live, got.mass, got.min_mass);
      },
      "serve_samples's answer of prioritized rows into this process's tensors (GIL released): (the rows the shard "
      "holds, or -1 where Python must answer; the mass; the least positive mass)",
      py::arg("header"), py::arg("reader"), py::arg("columns"), py::arg("layout_version"), py::arg("priorities"),
      py::arg("count"), py::arg("seed"), py::arg("picks"), py::arg("mass"), py::arg("generation"), py::arg("out"));
  m.def(
      "sample_windows_into",
      [](at::Tensor header, at::Tensor reader, std::vector<at::Tensor> columns, int64_t layout_version,
         WindowRuleArgs windows, int64_t seen_seq, int64_t count, int64_t seed, const std::vector<at::Tensor>& out) {
        const gear::OwnedStore store{std::move(header), std::move(reader), std::move(columns), layout_version};
        const gear::WindowRule rule = window_rule(std::move(windows));
        gear::WindowsInto got =
            without_gil([&] { return gear::sample_windows_into(store, rule, seen_seq, count, seed, out); });
        return std::make_tuple(got.live, got.mass, std::move(got.starts), std::move(got.valid_begin),
                               std::move(got.valid_end));
      },
      "serve_samples's answer of windows into this process's tensors (GIL released): (the view's rows, or -1 "
      "when Python must answer; the mass; starts, valid_begin, valid_end)",
      py::arg("header"), py::arg("reader"), py::arg("columns"), py::arg("layout_version"), py::arg("windows"),
      py::arg("seen_seq"), py::arg("count"), py::arg("seed"), py::arg("out"));
  m.def("frame_rows_reply", &gear::frame_rows_reply,
        "Frame a reply of rows Python picked into this thread's reply buffer (GIL released): its bytes",
        py::arg("op"), py::arg("meta"), py::arg("arrays"), py::arg("columns"), py::arg("starts"),
        py::arg("valid_begin"), py::arg("valid_end"), py::arg("seq_len"), py::call_guard<py::gil_scoped_release>());
  m.def("send_framed_reply", &gear::send_framed_reply,
        "Send the reply frame_rows_reply framed on this thread (GIL released): 0, or -errno", py::arg("fd"),
        py::call_guard<py::gil_scoped_release>());
  m.def(
      "draw_shares",
      [](const std::vector<double>& masses, int64_t count, std::optional<at::Generator> generator) {
        gear::Shares shares = gear::draw_shares(masses, count, std::move(generator));
        return std::make_pair(std::move(shares.counts), std::move(shares.seeds));
      },
      "A batch's split across shards of `masses`, and a seed per owner (None without a generator)",
      py::arg("masses"), py::arg("count"), py::arg("generator") = py::none());
  m.def(
      "split_updates",
      [](const at::Tensor& shards, const at::Tensor& rows, const at::Tensor& priority,
         const std::optional<at::Tensor>& generation, const std::vector<int64_t>& capacities, int64_t op,
         const std::string& meta) {
        gear::UpdateSplit split = [&] {
          py::gil_scoped_release released;
          return gear::split_updates(shards, rows, priority, generation, capacities, op, meta);
        }();
        std::vector<py::bytes> frames(split.frames.begin(), split.frames.end());
        return py::make_tuple(split.refused, split.at, split.lo, split.hi, split.owners, split.counts, split.rows,
                              split.priority, split.generation.defined() ? py::cast(split.generation) : py::none(),
                              frames);
      },
      "A batch's priority updates checked, grouped by owner and framed: (refused, at, lo, hi, owners, counts, rows, "
      "priority, generation, frames)",
      py::arg("shards"), py::arg("rows"), py::arg("priority"), py::arg("generation"), py::arg("capacities"),
      py::arg("op"), py::arg("meta"));
  m.def("owner_constants", &gear::owner_constants);
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
  m.def("place_spans", &gear::place_spans, "Packed sequences whose training spans start at `offset` (see packing.h)",
        py::arg("episode_start"), py::arg("episode_length"), py::arg("slots"), py::arg("offset"),
        py::arg("max_train"), py::arg("burn_in"));
  m.def("uniform_spans", &gear::uniform_spans, "A uniform packed sequence of each chosen episode",
        py::arg("episode_start"), py::arg("episode_length"), py::arg("slots"), py::arg("u"), py::arg("max_train"),
        py::arg("burn_in"));
  m.def("pack_tokens", &gear::pack_tokens, "Sequences packed into a budget of tokens by the packing rule (see packing.h)",
        py::arg("first"), py::arg("length"), py::arg("burn_in"), py::arg("step"), py::arg("budget"),
        py::arg("window_rows"));
  m.def("window_rows", &gear::window_rows, "Flat ring rows of windows", py::arg("starts"), py::arg("seq_len"),
        py::arg("capacity"));
  m.def("window_mask", &gear::window_mask, "Which positions of windows hold data", py::arg("valid_begin"),
        py::arg("valid_end"), py::arg("seq_len"));
  m.def("check_windows", &gear::check_windows, "Bounds of a request's windows", py::arg("starts"),
        py::arg("valid_begin"), py::arg("valid_end"), py::arg("seq_len"), py::arg("capacity"));
  m.def("first_row_outside", &gear::first_row_outside, "First valid row outside a ring interval, or -1",
        py::arg("starts"), py::arg("valid_begin"), py::arg("valid_end"), py::arg("seq_len"), py::arg("capacity"),
        py::arg("first"), py::arg("count"));
#ifdef GEAR_WITH_CUDA
  m.def("cuda_host_register", &gear::cuda_host_register,
        "Pin and map a host tensor's memory so CUDA kernels read it in place");
  m.def("cuda_host_unregister", &gear::cuda_host_unregister);
#endif
}
