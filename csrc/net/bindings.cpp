// The network owner and receiver's Python face: the native owner's answers (owner.h), replies received and
// requests sent without the interpreter (recv.h), priority updates framed per owner (updates.h), and the
// numbers Python shares with them, defined once in C++: the wire's ops and limits (`_C.wire`, framing.h) and
// the control segment's words (`_C.control`, control_words.h).
#include "net/bindings.h"

#include <torch/extension.h>

#include "net/control_words.h"
#include "net/framing.h"
#include "net/owner.h"
#include "net/recv.h"
#include "net/updates.h"

namespace {

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

// The numbers Python reads rather than repeats, as attributes of `_C.control` and `_C.wire`.
void bind_numbers(py::module_& m) {
  py::module_ control = m.def_submodule(
      "control", "The control segment's words, a reader slot's and the store's states (csrc/net/control_words.h)");
  for (const auto& [name, value] : gear::control::kPythonNames) control.attr(name) = value;
  py::module_ wire =
      m.def_submodule("wire", "The shard protocol's ops, magic and limits (csrc/net/framing.h; wire.Op names them)");
  for (const auto& [name, value] : gear::kWireOps) wire.attr(name) = value;
  for (const auto& [name, value] : gear::kWireLimits) wire.attr(name) = value;
  wire.attr("MAGIC") = py::bytes(gear::kWireMagic, 4);
  // Statuses and codes the calls below return.
  m.attr("NOT_OWED") = gear::kNotOwed;
  m.attr("BYTES_PAST") = gear::kBytesPast;
  m.attr("SERVE_NEXT_IS_OTHER") = static_cast<int64_t>(gear::kNextIsOther);
  m.attr("SERVE_IN_PYTHON") = static_cast<int64_t>(gear::kServeInPython);
  m.attr("SERVE_CATCH_UP") = static_cast<int64_t>(gear::kCatchUp);
  m.attr("UPDATE_BAD_PRIORITY") = static_cast<int64_t>(gear::kBadPriority);
  m.attr("UPDATE_BAD_ROW") = static_cast<int64_t>(gear::kBadRow);
  m.attr("UPDATE_BAD_SHARD") = static_cast<int64_t>(gear::kBadShard);
}

// The native owner's rules, built by keyword from Python (distributed/native_owner.py): see owner.h.
void bind_rules(py::module_& m) {
  py::class_<gear::WindowRule>(m, "WindowRule", "Uniform windows the native owner draws (csrc/net/owner.h)")
      .def(py::init([](std::string key, at::Tensor tree, at::Tensor episode_start, at::Tensor episode_length,
                       int64_t window_len, int64_t burn_in, bool strict_length, int64_t seen_lo, int64_t seen_hi) {
             return gear::WindowRule{std::move(key),    std::move(tree), std::move(episode_start),
                                     std::move(episode_length), window_len, burn_in, strict_length, seen_lo,
                                     seen_hi};
           }),
           py::kw_only(), py::arg("key"), py::arg("tree"), py::arg("episode_start"), py::arg("episode_length"),
           py::arg("window_len"), py::arg("burn_in"), py::arg("strict_length"), py::arg("seen_lo"),
           py::arg("seen_hi"));
  py::class_<gear::PriorityRule>(m, "PriorityRule",
                                 "Prioritized rows the native owner draws and updates (csrc/net/owner.h)")
      .def(py::init([](std::string key, std::string update_key, at::Tensor sum_tree, at::Tensor min_tree,
                       at::Tensor generation, at::Tensor followed, at::Tensor max_priority, double alpha, double eps,
                       int64_t rows_per_step, std::shared_ptr<gear::SelectorLock> lock) {
             return gear::PriorityRule{std::move(key),        std::move(update_key), std::move(sum_tree),
                                       std::move(min_tree),   std::move(generation), std::move(followed),
                                       std::move(max_priority), alpha, eps, rows_per_step, std::move(lock)};
           }),
           py::kw_only(), py::arg("key"), py::arg("update_key"), py::arg("sum_tree"), py::arg("min_tree"),
           py::arg("generation"), py::arg("followed"), py::arg("max_priority"), py::arg("alpha"), py::arg("eps"),
           py::arg("rows_per_step"), py::arg("lock"));
  py::class_<gear::PriorityWindowRule>(m, "PriorityWindowRule",
                                       "Prioritized windows the native owner draws and updates (csrc/net/owner.h)")
      .def(py::init([](std::string key, std::string update_key, at::Tensor sum_tree, at::Tensor min_tree,
                       at::Tensor generation, at::Tensor row_mass, at::Tensor max_priority, at::Tensor derivation,
                       int64_t derived, int64_t first_start, at::Tensor live_start, at::Tensor live_length,
                       at::Tensor live_ends, at::Tensor live_closed, double alpha, double eps, int64_t window_len,
                       int64_t burn_in, bool strict_length, bool include_open, int64_t seen_lo, int64_t seen_hi,
                       std::shared_ptr<gear::SelectorLock> lock) {
             gear::LiveTensors live{std::move(live_start), std::move(live_length), std::move(live_ends),
                                    std::move(live_closed), first_start};
             return gear::PriorityWindowRule{std::move(key),          std::move(update_key), std::move(sum_tree),
                                             std::move(min_tree),     std::move(generation), std::move(row_mass),
                                             std::move(max_priority), std::move(derivation), derived,
                                             std::move(live),         alpha,                 eps,
                                             {window_len, burn_in, strict_length, include_open},
                                             seen_lo,                 seen_hi,               std::move(lock)};
           }),
           py::kw_only(), py::arg("key"), py::arg("update_key"), py::arg("sum_tree"), py::arg("min_tree"),
           py::arg("generation"), py::arg("row_mass"), py::arg("max_priority"), py::arg("derivation"),
           py::arg("derived"), py::arg("first_start"), py::arg("live_start"), py::arg("live_length"),
           py::arg("live_ends"), py::arg("live_closed"), py::arg("alpha"), py::arg("eps"), py::arg("window_len"),
           py::arg("burn_in"), py::arg("strict_length"), py::arg("include_open"), py::arg("seen_lo"),
           py::arg("seen_hi"), py::arg("lock"));
}

}  // namespace

void bind_net(py::module_& m) {
  bind_numbers(m);
  bind_rules(m);
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
         int64_t seen_seq, int64_t max_lag, double catch_up_s, const gear::WindowRule* windows,
         const gear::PriorityRule* priorities, const gear::PriorityWindowRule* priority_windows) {
        const gear::OwnedStore store{std::move(header), std::move(reader), std::move(columns), layout_version};
        const gear::Served s = without_gil([&] {
          return gear::serve_samples(fd, store, seen_seq, max_lag, catch_up_s, windows, priorities, priority_windows);
        });
        return std::make_tuple(s.code, s.count, s.seed, s.columns, s.answered, s.op, s.arrays);
      },
      "Answer SAMPLE_ROWS, and SAMPLE_WINDOWS, SAMPLE_PRIORITIZED and POST_UPDATE of the armed rules, natively "
      "until Python must act (GIL released): (code, count, seed, columns, answered, op of the request Python "
      "answers, a refused update's arrays)",
      py::arg("fd"), py::arg("header"), py::arg("reader"), py::arg("columns"), py::arg("layout_version"),
      py::arg("seen_seq"), py::arg("max_lag"), py::arg("catch_up_s"), py::arg("windows") = py::none(),
      py::arg("priorities") = py::none(), py::arg("priority_windows") = py::none());
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
         const gear::PriorityRule& priorities, int64_t count, int64_t seed, const at::Tensor& picks,
         const at::Tensor& mass, const at::Tensor& generation, const std::vector<at::Tensor>& out) {
        const gear::OwnedStore store{std::move(header), std::move(reader), std::move(columns), layout_version};
        const gear::PrioritizedInto got = without_gil([&] {
          return gear::sample_prioritized_into(store, priorities, count, seed, picks, mass, generation, out);
        });
        return std::make_tuple(got.live, got.mass, got.min_mass);
      },
      "serve_samples's answer of prioritized rows into this process's tensors (GIL released): (the rows the shard "
      "holds, or -1 where Python must answer; the mass; the least positive mass)",
      py::arg("header"), py::arg("reader"), py::arg("columns"), py::arg("layout_version"), py::arg("priorities"),
      py::arg("count"), py::arg("seed"), py::arg("picks"), py::arg("mass"), py::arg("generation"), py::arg("out"));
  m.def(
      "sample_priority_windows_into",
      [](at::Tensor header, at::Tensor reader, std::vector<at::Tensor> columns, int64_t layout_version,
         const gear::PriorityWindowRule& rule, int64_t seen_seq, int64_t count, int64_t seed,
         const std::vector<at::Tensor>& windows, const at::Tensor& mass, const at::Tensor& generation,
         const std::vector<at::Tensor>& out) {
        const gear::OwnedStore store{std::move(header), std::move(reader), std::move(columns), layout_version};
        const gear::PrioritizedInto got = without_gil([&] {
          return gear::sample_priority_windows_into(store, rule, seen_seq, count, seed, windows, mass, generation,
                                                    out);
        });
        return std::make_tuple(got.live, got.mass, got.min_mass);
      },
      "serve_samples's answer of prioritized windows into this process's tensors (GIL released): (the view's rows, "
      "or -1 where Python must answer; the mass; the least positive mass)",
      py::arg("header"), py::arg("reader"), py::arg("columns"), py::arg("layout_version"), py::arg("rule"),
      py::arg("seen_seq"), py::arg("count"), py::arg("seed"), py::arg("windows"), py::arg("mass"),
      py::arg("generation"), py::arg("out"));
  m.def(
      "sample_windows_into",
      [](at::Tensor header, at::Tensor reader, std::vector<at::Tensor> columns, int64_t layout_version,
         const gear::WindowRule& windows, int64_t seen_seq, int64_t count, int64_t seed,
         const std::vector<at::Tensor>& out) {
        const gear::OwnedStore store{std::move(header), std::move(reader), std::move(columns), layout_version};
        gear::WindowsInto got =
            without_gil([&] { return gear::sample_windows_into(store, windows, seen_seq, count, seed, out); });
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
        py::arg("valid_begin"), py::arg("valid_end"), py::arg("window_len"), py::call_guard<py::gil_scoped_release>());
  m.def("send_framed_reply", &gear::send_framed_reply,
        "Send the reply frame_rows_reply framed on this thread (GIL released): 0, or -errno", py::arg("fd"),
        py::call_guard<py::gil_scoped_release>());
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
}
