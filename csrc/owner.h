// An owner's answers that need no interpreter: uniform rows, drawn, read and sent natively
// (see cpu/owner.cpp; Python's side is distributed/native_owner.py).
#pragma once

#include <ATen/ATen.h>

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

// Why serve_sample_rows returned (negative: -errno, the connection is done for).
enum ServeCode : int64_t {
  kNextIsOther = 0,  // the next request is another op: nothing of it was read
  kServeInPython = 1,  // a SAMPLE_ROWS was read that Python answers (its fields come back)
  kCatchUp = 2,  // Python's view of the store should catch up before more are answered
};

struct Served {
  int64_t code;
  int64_t count = 0, seed = -1, columns = 0;  // the request of kServeInPython
  int64_t answered = 0;                       // requests answered natively in this call
};

// Answers SAMPLE_ROWS requests on `fd` (a blocking socket) until another op is next, one needs Python
// (empty store, rows a dead writer left, a new layout, a revoked read, a request out of bounds), the
// store's records ran `max_lag` ahead of `seen_seq`, or `catch_up_s` passed since the call began (checked
// from the second answer on, so every call answers at least one).
Served serve_sample_rows(int64_t fd, const OwnedStore& store, int64_t seen_seq, int64_t max_lag, double catch_up_s);

// The same answer into this process's memory: `count` uniform rows drawn from `seed` (-1: the global
// generator), their ring rows into `picks` and the first out.size() columns' rows into `out`, for a learner
// that reads the shard its own process serves. Returns the live rows drawn over, or -1 when Python must
// answer (the same cases as serve_sample_rows).
int64_t sample_rows_into(const OwnedStore& store, int64_t count, int64_t seed, const at::Tensor& picks,
                         const std::vector<at::Tensor>& out);

// What this file assumes of the Python side (control segment words, wire codes, limits), by the
// Python name each must equal: a test holds the two together.
std::vector<std::pair<std::string, int64_t>> owner_constants();

}  // namespace gear
