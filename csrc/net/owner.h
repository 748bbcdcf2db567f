// An owner's answers that need no interpreter: uniform rows and windows, prioritized rows and windows drawn,
// read and sent, and posted priority updates applied, natively (see owner.cpp; Python's side is
// distributed/native_owner.py).
#pragma once

#include "kernels/priorities.h"
#include "kernels/windows.h"
#include "net/selector_lock.h"

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace gear {

// What the native owner reads of one shared store (store/commit_log.py lays these words out).
struct OwnedStore {
  at::Tensor header;                // int64: the control segment's header words
  at::Tensor reader;                // int64 [4]: this connection's reader slot (pid, epoch, revoked, longer_us)
  std::vector<at::Tensor> columns;  // the ring's mapped columns, each [capacity, ...] with contiguous rows
  int64_t layout_version;           // the layout those columns are mapped for
};

// A rule of windows the extension draws as selection/windows.py's WindowSelector does, from the state
// Python's view of the shard keeps (its episode index, the selector's tree of windows per episode slot).
// That state is exact only while nothing was published or evicted since the view last caught up: the
// extension checks so under its read section and otherwise leaves the request to Python.
struct WindowRule {
  std::string key;            // the rule's JSON, byte for byte as learners send it in SAMPLE_WINDOWS
  at::Tensor tree;            // float64 sum tree over episode slots (selection/trees.py)
  at::Tensor episode_start;   // int64 [slots]: ring row of each episode's first live step
  at::Tensor episode_length;  // int64 [slots]
  int64_t window_len, burn_in;
  bool strict_length;
  int64_t seen_lo, seen_hi;  // the positions the view's episode index covers
};

// A rule of prioritized rows the extension draws as selection/priorities.py's PrioritySelector does, from
// that core's own tables, under its lock. Before a draw the core takes in the commits and evictions the
// read section shows since it last looked (`followed`), as its Python follow would; a core replaced or
// emptied (`followed` is -1) or dead rows among the new ones leave the request to Python.
// Priority updates a learner posts (POST_UPDATE) are applied here too, as the core's update does on the
// CPU (kernels/priorities.cpp); one the checks refuse is handed to Python whole, which logs why.
struct PriorityRule {
  std::string key;          // the rule's JSON, byte for byte as learners send it in SAMPLE_PRIORITIZED
  std::string update_key;   // a POST_UPDATE's JSON for that rule
  at::Tensor sum_tree;      // float64 masses (p + eps)^alpha (selection/trees.py PriorityTrees.sum)
  at::Tensor min_tree;      // float64: the least positive mass
  at::Tensor generation;    // int64 [capacity]: each row's write generation
  at::Tensor followed;      // int64 [2]: the positions [lo, hi) the core has followed
  at::Tensor max_priority;  // float64 scalar: the largest raw priority seen (new rows get it)
  double alpha, eps;        // the core's, when Python armed the call (a restored owner core is a new core)
  int64_t rows_per_step;    // a live range starts on a whole time step (store/addressing.py)
  std::shared_ptr<SelectorLock> lock;
};

// A rule of prioritized windows the extension draws and updates as selection/priority_windows.py's
// PriorityWindowSelector does: window keys drawn from the shared core's trees, under its lock, located in the
// live episodes of the index the trees were derived from (a view's). Exact while nothing was published or
// evicted since that view caught up and the core's trees were not derived anew since (`derivation` still
// `derived`); otherwise the request goes back to Python.
struct PriorityWindowRule {
  std::string key;          // the rule's JSON, byte for byte as learners send it in SAMPLE_PRIORITIZED
  std::string update_key;   // a POST_UPDATE's JSON for that rule
  at::Tensor sum_tree;      // float64 masses of window keys (selection/trees.py PriorityTrees.sum)
  at::Tensor min_tree;      // float64: the least positive mass
  at::Tensor generation;    // int64 [capacity]: each row's write generation
  at::Tensor row_mass;      // float64 [capacity]: each row's (p + eps)^alpha, a key or not
  at::Tensor max_priority;  // float64 scalar: the largest raw priority seen
  at::Tensor derivation;    // int64 [1]: moves whenever Python derives the trees anew
  int64_t derived;          // its value when these tables were taken
  LiveTensors live;         // the live episodes of the view's index (kernels/windows.h), oldest first
  double alpha, eps;
  WindowKeys keys;          // the windows' geometry: where a key sits, which rows may key one
  int64_t seen_lo, seen_hi;  // the positions the view's episode index covers
  std::shared_ptr<SelectorLock> lock;
};

// Why serve_samples returned (negative: -errno, the connection is done for); Python reads these as _C.SERVE_*.
enum ServeCode : int64_t {
  kNextIsOther = 0,  // the next request is another op: nothing of it was read
  kServeInPython = 1,  // a SAMPLE_* was read that Python answers (its fields come back), or a POST_UPDATE refused
                       // here (its arrays come back)
  kCatchUp = 2,  // Python's view of the store should catch up before more are answered
};

struct Served {
  int64_t code;
  int64_t count = 0, seed = -1, columns = 0;  // the request of kServeInPython
  int64_t answered = 0;                       // requests answered natively in this call
  int64_t op = 0;                             // that request's op (SAMPLE_ROWS, or an armed rule's)
  std::vector<at::Tensor> arrays;             // a POST_UPDATE the checks refused: its arrays, as received
};

// Answers SAMPLE_ROWS requests, SAMPLE_WINDOWS of the `windows` rule and SAMPLE_PRIORITIZED and
// POST_UPDATE of the `priorities` or the `priority_windows` rule (each if any, one of the last two), on `fd`
// (a blocking socket) until another op is next, one needs Python
// (empty store, rows a dead writer left, a new layout, a revoked read, a request out of bounds, windows
// drawn from a view no longer current, priorities whose core has not followed the store), the store's
// records ran `max_lag` ahead of `seen_seq`, or `catch_up_s` passed since the call began (checked from the
// second answer on, so every call answers at least one). A request for windows (uniform or prioritized) met
// while the view is behind returns kCatchUp at once, unread.
Served serve_samples(int64_t fd, const OwnedStore& store, int64_t seen_seq, int64_t max_lag, double catch_up_s,
                     const WindowRule* windows, const PriorityRule* priorities,
                     const PriorityWindowRule* priority_windows);

// The same answer into this process's memory: `count` uniform rows drawn from `seed` (-1: the global
// generator), their ring rows into `picks` and the first out.size() columns' rows into `out`, for a learner
// that reads the shard its own process serves. Returns the live rows drawn over, or -1 when Python must
// answer (the same cases as serve_samples).
int64_t sample_rows_into(const OwnedStore& store, int64_t count, int64_t seed, const at::Tensor& picks,
                         const std::vector<at::Tensor>& out);

// A window answer into this process's memory: the windows drawn, the rows the view holds (-1: Python must
// answer) and the tree's mass.
struct WindowsInto {
  int64_t live = -1;
  double mass = 0;
  at::Tensor starts, valid_begin, valid_end;
};

// serve_samples's answer of `count` windows of `rule` into `out` (the first out.size() columns, each
// [count * window_len, ...]), for a learner that reads the shard its own process serves; `seen_seq` is what
// the view behind `rule` has caught up to.
WindowsInto sample_windows_into(const OwnedStore& store, const WindowRule& rule, int64_t seen_seq, int64_t count,
                                int64_t seed, const std::vector<at::Tensor>& out);

// A prioritized answer into this process's memory: the rows the shard holds (-1: Python must answer), the
// table's mass and least positive mass.
struct PrioritizedInto {
  int64_t live = -1;
  double mass = 0, min_mass = 0;
};

// serve_samples's answer of `count` prioritized rows of `rule` into this process's tensors, for a learner
// that reads the shard its own process serves: their ring rows, masses and generations into `picks`,
// `mass` and `generation` (contiguous, `count` each), their rows into `out` (the first out.size() columns).
PrioritizedInto sample_prioritized_into(const OwnedStore& store, const PriorityRule& rule, int64_t count, int64_t seed,
                                        const at::Tensor& picks, const at::Tensor& mass, const at::Tensor& generation,
                                        const std::vector<at::Tensor>& out);

// serve_samples's answer of `count` prioritized windows of `rule` into this process's tensors, for a learner
// that reads the shard its own process serves: their starts and valid ranges into `windows` (three contiguous
// int64 tensors of `count`), their keys' masses and generations into `mass` and `generation`, their rows into
// `out` (the first out.size() columns, each [count * window_len, ...]); `seen_seq` is what the view behind
// `rule` has caught up to.
PrioritizedInto sample_priority_windows_into(const OwnedStore& store, const PriorityWindowRule& rule,
                                             int64_t seen_seq, int64_t count, int64_t seed,
                                             const std::vector<at::Tensor>& windows, const at::Tensor& mass,
                                             const at::Tensor& generation, const std::vector<at::Tensor>& out);

// A reply of rows Python picked (shard_server._send_rows), framed into this thread's reply buffer while
// Python holds the read section: `op`, the JSON `meta`, the contiguous `arrays`, then every window's rows
// of each of `columns` (zeros outside its valid range), as wire.header frames a message. Returns its bytes.
// Python then ends its read section and sends the reply with send_framed_reply, so a learner slow to take
// it never holds back the writers.
int64_t frame_rows_reply(int64_t op, const std::string& meta, const std::vector<at::Tensor>& arrays,
                         const std::vector<at::Tensor>& columns, const at::Tensor& starts,
                         const at::Tensor& valid_begin, const at::Tensor& valid_end, int64_t window_len);

// Sends the reply frame_rows_reply framed on this thread: 0, or -errno (the connection is done for).
int64_t send_framed_reply(int64_t fd);

}  // namespace gear
