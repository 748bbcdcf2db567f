// Uniform rows are the one rule with no state of its own: a draw over the shard's readable range. An
// owner answers them here, the interpreter released, with the same steps as the Python path: open a
// read section in the store's control segment, draw from the learner's seed exactly as torch.randint
// would, gather the rows out of the ring (kernels/gather.cpp, into the reply itself), close the section
// (a revoked one is never sent) and send the reply in one framed message. A learner reading the shard
// its own process serves gets the same answer into its batch (sample_rows_into), with no socket.
// Uniform windows take the same steps, drawn from the state Python's view keeps (WindowRule) while
// that view is current, and go back as the WINDOWS reply Python would send; prioritized rows are drawn
// from the shared core's own tables (PriorityRule) under its lock, which follow the store first, and the
// learners' posted priority updates are applied to them. Prioritized windows take both: keys drawn from the
// shared core's tables under its lock, their windows placed in the episodes of the view that derived those
// tables, while that view is current (PriorityWindowRule).
// Anything unusual goes back to Python, which answers it in full; the rows Python picks go out framed
// and gathered here too (frame_rows_reply, then send_framed_reply once Python closed its read section).
#include "net/owner.h"

#include "kernels/gather.h"
#include "kernels/priorities.h"
#include "kernels/trees.h"
#include "kernels/windows.h"
#include "net/control_words.h"
#include "net/framing.h"

#include <ATen/CPUGeneratorImpl.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace gear {
namespace {

constexpr size_t kAskBytes = 8 + 24;  // after the JSON: one array's length, then count, seed (-1: none), columns
constexpr size_t kKeepBytes = 64u << 20;            // a thread keeps its reply buffer up to this size
constexpr size_t kFlushBytes = 1u << 20;            // replies held for one write, at most (then sent at once)

using namespace control;  // the store's header words, a reader slot's, its states

int64_t load(const int64_t* words, int64_t i) { return __atomic_load_n(words + i, __ATOMIC_ACQUIRE); }
void store(int64_t* words, int64_t i, int64_t v) { __atomic_store_n(words + i, v, __ATOMIC_RELEASE); }

template <typename T>
void put(std::vector<char>& out, size_t at, T v) {
  std::memcpy(out.data() + at, &v, sizeof(T));
}

struct Request {
  int64_t count, seed, columns;
};

// The oldest readable position, as commit_log.begin_read finds it.
int64_t readable_lo(const int64_t* header) {
  const int64_t evicted_end = std::max(load(header, kReserved), load(header, kEvicted));
  return std::max({evicted_end - load(header, kCapacity), load(header, kFloor), int64_t{0}});
}

// The readable positions [lo, hi) while a read section is open; it closes at the latest when it goes.
struct Section {
  int64_t* header;
  int64_t* reader;
  int64_t revocations;
  int64_t lo, hi;
  bool open = true;

  Section(int64_t* h, int64_t* r) : header(h), reader(r) {
    // The slot's epoch is stamped before the ends are read (the fence orders the two): a writer that
    // evicts after we read them sees the stamp and waits; one that evicted before shows in the ends.
    store(reader, kSlotEpoch, load(header, kEpoch));
    revocations = load(reader, kSlotRevoked);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    lo = readable_lo(header);
    hi = load(header, kPublished);
  }
  Section(const Section&) = delete;
  Section& operator=(const Section&) = delete;
  ~Section() {
    if (open) close();  // (an error on the way: the rows are not sent)
  }

  // Closes the section; false if a writer revoked it meanwhile (what was copied may be torn).
  bool close() {
    __atomic_thread_fence(__ATOMIC_SEQ_CST);  // the copy is done before the count is read
    const bool kept = load(reader, kSlotRevoked) == revocations;
    store(reader, kSlotLongerUs, 0);
    store(reader, kSlotEpoch, 0);
    open = false;
    return kept;
  }
};

// Reads exactly n bytes (peek: leaves them queued); -errno, or -ECONNRESET at the end. It waits in poll,
// not in a blocking recv: a recv that sleeps holds the socket's lock across the wake-up, which the sender's
// softirq then spins on (a third of the owner's time, measured on these VMs). A new request is seldom there
// yet after a reply, so that wait comes first; the rest of a request it began (wait_first false) is read at
// once, as a request arrives whole.
int64_t receive(int fd, char* p, size_t n, bool peek, bool wait_first) {
  size_t got = 0;
  for (bool wait = wait_first;; wait = true) {
    pollfd pfd{fd, POLLIN, 0};
    if (wait && ::poll(&pfd, 1, -1) < 0 && errno != EINTR) return -errno;
    const ssize_t k = ::recv(fd, p + got, n - got, MSG_DONTWAIT | (peek ? MSG_PEEK : 0));
    if (k == static_cast<ssize_t>(n - got)) return 0;
    if (k == 0) return -ECONNRESET;
    if (k > 0 && peek) {  // part of a header: wait for the rest where it lies (rare, so no poll loop)
      const ssize_t all = ::recv(fd, p, n, MSG_PEEK | MSG_WAITALL);
      if (all == static_cast<ssize_t>(n)) return 0;
      if (all == 0) return -ECONNRESET;
      if (all < 0 && errno != EINTR) return -errno;
      continue;
    }
    if (k > 0) {
      got += static_cast<size_t>(k);
      continue;
    }
    if (errno != EINTR && errno != EAGAIN && errno != EWOULDBLOCK) return -errno;
  }
}

// Peeks at up to `cap` bytes of the next request, at least its fixed header: how many bytes it saw (all of a
// request the size of an ask, in one call), or -errno. With `wait`, it waits for one to come; without, one not
// there yet is -EAGAIN.
int64_t peek_request(int fd, char* p, size_t cap, bool wait) {
  for (;;) {
    pollfd pfd{fd, POLLIN, 0};
    if (wait && ::poll(&pfd, 1, -1) < 0 && errno != EINTR) return -errno;
    const ssize_t k = ::recv(fd, p, cap, MSG_DONTWAIT | MSG_PEEK);
    if (k >= static_cast<ssize_t>(kHeader)) return k;
    if (k == 0) return -ECONNRESET;
    if (k > 0) {  // part of a header (rare): wait for the rest
      const int64_t status = receive(fd, p, kHeader, true, false);
      return status < 0 ? status : static_cast<int64_t>(kHeader);
    }
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return -errno;
    if (!wait) return -EAGAIN;
  }
}

int64_t send_all(int fd, const char* p, size_t n) {
  while (n > 0) {
    const ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k < 0) {
      if (errno == EINTR) continue;
      return errno == EAGAIN || errno == EWOULDBLOCK ? -ETIMEDOUT : -errno;  // SO_SNDTIMEO ran out
    }
    p += k;
    n -= static_cast<size_t>(k);
  }
  return 0;
}

// Replies framed on this thread, the first `used` bytes sent only when the owner is about to wait for the next
// ask or hand back to Python: a learner that asks for several batches at once gets their replies in one write
// (one pass through the network stack and one wake-up on its side instead of one each).
struct Outbox {
  std::vector<char> bytes;
  size_t used = 0;
};

Outbox& outbox() {
  thread_local Outbox box;
  return box;
}

// Sends the replies held; 0, or -errno. A buffer grown past kKeepBytes is let go.
int64_t flush(int fd) {
  Outbox& box = outbox();
  const int64_t sent = box.used > 0 ? send_all(fd, box.bytes.data(), box.used) : 0;
  box.used = 0;
  if (box.bytes.size() > kKeepBytes) std::vector<char>().swap(box.bytes);
  return sent;
}

// The generator a request's seed makes (none: the global one, for a request without a seed).
std::optional<at::Generator> seeded(const Request& q) {
  if (q.seed < 0) return std::nullopt;
  return at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(q.seed));
}

// torch.randint(0, n, (count,), generator=...) as ATen's CPU kernel draws it (one engine output per value,
// two above 2**32, taken modulo n, in order), without the dispatcher: a third of a small answer's cost.
// Ring rows of the live positions [lo, lo + n) those offsets name, into `row`. tests/test_native_owner.py
// holds this to the Python path's draw.
void draw_rows(const Request& q, int64_t lo, int64_t n, int64_t capacity, int64_t* row) {
  at::Generator generator = seeded(q).value_or(at::detail::getDefaultCPUGenerator());
  auto* engine = at::check_generator<at::CPUGeneratorImpl>(generator);
  std::lock_guard<std::mutex> lock(generator.mutex());
  const auto range = static_cast<uint64_t>(n);
  for (int64_t i = 0; i < q.count; ++i) {
    const uint64_t bits = range >= (uint64_t{1} << 32) ? engine->random64() : engine->random();
    row[i] = (lo + static_cast<int64_t>(bits % range)) % capacity;
  }
}

// Whether the extension may answer `q` at all (what it asks is in bounds); the store's state is checked
// under the read section. An ask of no picks is answered too: a learner asks a shard its round gave no share
// for its mass, so the next round splits by what each shard holds now.
bool answerable(const OwnedStore& s, const Request& q) {
  return q.count >= 0 && q.count <= kMaxReadPositions && q.seed >= -1 && q.columns > 0 &&
         static_cast<size_t>(q.columns) <= s.columns.size();
}

// Whether the store is open and still laid out as the columns the caller mapped.
bool readable_as_mapped(const OwnedStore& s) {
  const int64_t* header = s.header.data_ptr<int64_t>();
  return load(header, kLayoutVersion) == s.layout_version && load(header, kState) == kOpen;
}

// Every SAMPLE_ROWS answer's work, wherever its rows go: open a read section, draw, gather the picks' rows
// into `out` (the first q.columns columns, each [q.count, ...]) and their ring rows into `picks`, close the
// section. Returns the live rows drawn over, or -1 when Python must answer (see serve_samples).
int64_t sample_rows(const OwnedStore& s, const Request& q, const at::Tensor& picks, std::vector<at::Tensor> out) {
  int64_t* header = s.header.data_ptr<int64_t>();
  if (!answerable(s, q) || !readable_as_mapped(s)) return -1;
  Section section(header, s.reader.data_ptr<int64_t>());
  const int64_t live = section.hi - section.lo;
  if (live <= 0 || load(header, kDeadEnd) > section.lo) {  // empty, or rows a dead writer left are in range
    section.close();
    return -1;
  }
  if (q.count > 0) {
    draw_rows(q, section.lo, live, s.columns.front().size(0), picks.data_ptr<int64_t>());
    gather_cpu({std::vector<at::Tensor>(s.columns.begin(), s.columns.begin() + q.columns), std::move(out), picks});
  }
  return section.close() ? live : -1;  // held too long: Python draws again (the same rows, for a seed)
}

// A reply taking shape in this thread's outbox, after the replies held there: where each array's bytes go
// (offsets in the outbox), and the message's size.
struct Reply {
  std::vector<char>& out;
  size_t base;
  std::vector<size_t> at;
  size_t bytes;
};

// Frames a reply as wire.header does: `op`, the JSON `meta`, then arrays of `lengths` bytes, then the first
// `ncols` columns' rows, `positions` of each; the arrays' bytes are left to fill.
Reply frame_reply(uint16_t op, std::string_view meta, std::vector<uint64_t> lengths,
                  const std::vector<at::Tensor>& columns, size_t ncols, int64_t positions) {
  for (size_t c = 0; c < ncols; ++c) {
    lengths.push_back(static_cast<uint64_t>(positions) * static_cast<uint64_t>(row_bytes_of(columns[c])));
  }
  const size_t head = kHeader + meta.size() + 8 * lengths.size();
  Outbox& box = outbox();
  Reply reply{box.bytes, box.used, {}, head + std::accumulate(lengths.begin(), lengths.end(), size_t{0})};
  if (reply.out.size() < reply.base + reply.bytes) reply.out.resize(reply.base + reply.bytes);
  size_t at = reply.base + write_head(reply.out.data() + reply.base, op, meta, lengths);
  for (const uint64_t n : lengths) {
    reply.at.push_back(at);
    at += n;
  }
  return reply;
}

// The reply's last `ncols` arrays as the columns' rows, `positions` each: where the gather writes them.
std::vector<at::Tensor> rows_in(const Reply& reply, const std::vector<at::Tensor>& columns, size_t ncols,
                                int64_t positions) {
  std::vector<at::Tensor> rows;
  const size_t first = reply.at.size() - ncols;
  for (size_t c = 0; c < ncols; ++c) {
    std::vector<int64_t> shape = columns[c].sizes().vec();
    shape[0] = positions;
    rows.push_back(at::from_blob(reply.out.data() + reply.at[first + c], shape, columns[c].options()));
  }
  return rows;
}

// The reply frame_rows_reply framed on this thread, until send_framed_reply sends it.
std::optional<Reply>& pending_reply() {
  thread_local std::optional<Reply> pending;
  return pending;
}

// Holds a framed reply for the next write (sent now if the outbox is full); 0, or -errno.
int64_t hold_reply(int fd, const Reply& reply) {
  Outbox& box = outbox();
  box.used = reply.base + reply.bytes;
  return box.used >= kFlushBytes ? flush(fd) : 0;
}

// The ROWS reply (wire.Op.ROWS, shard_server._Session._sample): the tally (live rows, picks), the picks' ring
// rows, then each column's rows; no JSON, so the learner lands it without parsing anything.
// Returns 0 once framed in the outbox, 1 when Python must answer, or -errno (the connection is broken).
int64_t answer(int fd, const OwnedStore& s, const Request& q) {
  if (!answerable(s, q)) return 1;
  const auto ncols = static_cast<size_t>(q.columns);
  const Reply reply = frame_reply(kRows, {}, {16, 8 * static_cast<uint64_t>(q.count)}, s.columns, ncols, q.count);
  const at::Tensor picks = at::from_blob(reply.out.data() + reply.at[1], {q.count}, at::kLong);
  const int64_t live = sample_rows(s, q, picks, rows_in(reply, s.columns, ncols, q.count));
  if (live < 0) return 1;
  put<int64_t>(reply.out, reply.at[0], live);
  put<int64_t>(reply.out, reply.at[0] + 8, q.count);
  return hold_reply(fd, reply);
}

// What a WindowRule's draw gives: each window's ring row of position 0 and its valid range.
struct Drawn {
  at::Tensor starts, valid_begin, valid_end;
};

// Where a window answer's rows go, once drawn: one output per column asked (see sample_windows).
using Landing = std::function<std::vector<at::Tensor>(const Drawn& drawn, int64_t live, double mass)>;

// WindowSelector.pick's draw (selection/windows.py), the same kernel from the same uniforms, so a seed gives
// the same windows: episode slots by the tree's masses, a uniform window in each, its start taken modulo the
// ring. No tensor op runs but the outputs' allocation (uniforms_into, draw_windows_into): the dispatcher
// would cost more than the draw itself in a small answer.
Drawn request_windows(const Request& q, const WindowRule& r, int64_t capacity) {
  const int64_t n = q.count;
  std::vector<double> u(static_cast<size_t>(2 * n));
  uniforms_into(seeded(q), u.data(), 2 * n);
  Drawn d{at::empty({n}, at::kLong), at::empty({n}, at::kLong), at::empty({n}, at::kLong)};
  int64_t* starts = d.starts.data_ptr<int64_t>();
  draw_windows_into(r.tree, r.episode_start, r.episode_length, u.data(), n, r.window_len, r.burn_in, r.strict_length,
                    starts, d.valid_begin.data_ptr<int64_t>(), d.valid_end.data_ptr<int64_t>());
  for (int64_t i = 0; i < n; ++i) starts[i] = ((starts[i] % capacity) + capacity) % capacity;
  return d;
}

// Every SAMPLE_WINDOWS answer's work: open a read section, check that nothing was published or evicted
// since the view behind `r` caught up (`seen_seq`), draw, gather the windows' rows into the outputs `land`
// gives, close the section. Returns the rows the view holds, or -1 when Python must answer.
int64_t sample_windows(const OwnedStore& s, const Request& q, const WindowRule& r, int64_t seen_seq,
                       const Landing& land) {
  int64_t* header = s.header.data_ptr<int64_t>();
  if (!answerable(s, q) || q.count > kMaxReadPositions / r.window_len || !readable_as_mapped(s)) return -1;
  Section section(header, s.reader.data_ptr<int64_t>());
  const double mass = r.tree.data_ptr<double>()[0];
  if (load(header, kPublishedSeq) != seen_seq || section.lo > r.seen_lo || !(mass > 0)) return -1;
  const int64_t live = r.seen_hi - r.seen_lo;  // (the index's rows are all readable: check each window's anyway)
  if (q.count == 0) {  // the mass alone
    const at::Tensor none = at::empty({0}, at::kLong);
    land({none, none, none}, live, mass);
    return section.close() ? live : -1;
  }
  const int64_t capacity = s.columns.front().size(0);
  const Drawn d = request_windows(q, r, capacity);
  if (first_row_outside(d.starts, d.valid_begin, d.valid_end, r.window_len, capacity, r.seen_lo % capacity, live) >=
      0) {
    return -1;
  }
  std::vector<at::Tensor> out = land(d, live, mass);
  gather_cpu({std::vector<at::Tensor>(s.columns.begin(), s.columns.begin() + q.columns), std::move(out), d.starts,
              d.valid_begin, d.valid_end, std::nullopt, r.window_len});
  return section.close() ? live : -1;
}

// The WINDOWS reply (wire.Op.WINDOWS, shard_server._Session._sample): the tally (live rows, picks, the mass's
// float64 bits), the windows' starts and valid ranges, then each column's rows; no JSON, like ROWS.
// Returns 0 once framed in the outbox, 1 when Python must answer, or -errno.
int64_t answer_windows(int fd, const OwnedStore& s, const Request& q, const WindowRule& r, int64_t seen_seq) {
  std::optional<Reply> reply;
  const Landing land = [&](const Drawn& d, int64_t live, double mass) {
    const auto ncols = static_cast<size_t>(q.columns);
    const auto count = static_cast<uint64_t>(q.count);
    reply.emplace(frame_reply(kWindows, {}, {24, 8 * count, 8 * count, 8 * count}, s.columns, ncols,
                              q.count * r.window_len));
    put<int64_t>(reply->out, reply->at[0], live);
    put<int64_t>(reply->out, reply->at[0] + 8, q.count);
    put<double>(reply->out, reply->at[0] + 16, mass);
    size_t i = 1;
    for (const at::Tensor& t : {d.starts, d.valid_begin, d.valid_end}) {
      if (count > 0) std::memcpy(reply->out.data() + reply->at[i], t.data_ptr<int64_t>(), 8 * count);
      ++i;
    }
    return rows_in(*reply, s.columns, ncols, q.count * r.window_len);
  };
  if (sample_windows(s, q, r, seen_seq, land) < 0) return 1;
  return hold_reply(fd, *reply);
}

// What a PriorityRule's draw gives, copied out under the core's lock: the picks' ring rows, masses and
// generations (in the reply itself), the total mass and the least positive one.
struct PrioritizedPicks {
  int64_t* rows;
  double* mass;
  int64_t* generation;
};

// Selector.follow of a PrioritySelector on a shared shard (selection/base.py, store/shared_commits.py
// rows_changed_since), under the core's lock: rows evicted since the core last looked lose their mass, rows
// committed since get a new generation and the mass of the largest priority seen, and the core has followed
// the live positions [lo, hi). False where Python must follow: a core replaced or emptied, or rows a dead
// writer left among the new ones.
bool follow(const PriorityRule& r, int64_t lo, int64_t hi, int64_t dead_end, int64_t capacity) {
  int64_t* followed = r.followed.data_ptr<int64_t>();
  const int64_t old_lo = followed[0], old_hi = followed[1];
  if (old_lo == lo && old_hi == hi) return true;
  const int64_t first_new = std::max(old_hi, lo);
  if (old_lo < 0 || old_hi < old_lo || lo < old_lo || hi < old_hi || dead_end > first_new) return false;
  const int64_t gone_end = std::min(lo, old_hi);
  const at::Tensor gone = at::arange(std::max(old_lo, gone_end - capacity), std::max(old_lo, gone_end), at::kLong)
                              .remainder_(capacity);
  priority_set(r.sum_tree, r.min_tree, gone, at::zeros({gone.numel()}, at::kDouble), std::nullopt);
  const at::Tensor rows = at::arange(first_new, hi, at::kLong).remainder_(capacity);
  int64_t* generation = r.generation.data_ptr<int64_t>();
  const int64_t* row = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.numel(); ++i) ++generation[row[i]];
  const at::Tensor mass = at::pow(r.max_priority + r.eps, r.alpha);  // as PrioritySelector.written computes it
  priority_set(r.sum_tree, r.min_tree, rows, mass.expand({rows.numel()}).contiguous(), std::nullopt);
  followed[0] = lo;
  followed[1] = hi;
  return true;
}

// PrioritySelector.pick's draw (selection/priorities.py), under the core's lock and a read section: the
// core follows what the section shows first, and must hold mass, or Python answers (its pick follows the
// store itself, or says why nothing can be drawn). The picks' rows are gathered
// into `out` once the lock is let go. Returns the rows the shard holds, or -1.
int64_t sample_prioritized(const OwnedStore& s, const Request& q, const PriorityRule& r, const PrioritizedPicks& picks,
                           double& mass, double& min_mass, std::vector<at::Tensor> out) {
  int64_t* header = s.header.data_ptr<int64_t>();
  if (!answerable(s, q) || !readable_as_mapped(s)) return -1;
  Section section(header, s.reader.data_ptr<int64_t>());
  const int64_t lo = (section.lo + r.rows_per_step - 1) / r.rows_per_step * r.rows_per_step;
  if (section.hi <= lo) return -1;
  {
    std::lock_guard<std::mutex> lock(r.lock->mutex);
    if (!follow(r, lo, section.hi, load(header, kDeadEnd), s.columns.front().size(0))) return -1;
    mass = r.sum_tree.data_ptr<double>()[0];
    if (!(mass > 0)) return -1;
    min_mass = r.min_tree.data_ptr<double>()[0];
    if (q.count > 0) {
      sum_tree_draw_into(r.sum_tree, q.count, seeded(q), picks.rows);  // the picks land in the reply itself
      const double* leaves = r.sum_tree.data_ptr<double>() + tree_leaf_offset(r.sum_tree.numel());
      const int64_t* generation = r.generation.data_ptr<int64_t>();
      for (int64_t i = 0; i < q.count; ++i) {
        picks.mass[i] = leaves[picks.rows[i]];
        picks.generation[i] = generation[picks.rows[i]];
      }
    }
  }
  if (q.count > 0) {
    const at::Tensor rows = at::from_blob(picks.rows, {q.count}, at::kLong);
    gather_cpu({std::vector<at::Tensor>(s.columns.begin(), s.columns.begin() + q.columns), std::move(out), rows});
  }
  return section.close() ? section.hi - lo : -1;
}

// A PRIORITIZED reply's tally (rows the shard holds, picks, the float64 bits of the mass and of the least positive
// mass) written, then the reply held for the next write; 0, or -errno.
int64_t hold_prioritized(int fd, const Reply& reply, int64_t live, int64_t count, double mass, double min_mass) {
  put<int64_t>(reply.out, reply.at[0], live);
  put<int64_t>(reply.out, reply.at[0] + 8, count);
  put<double>(reply.out, reply.at[0] + 16, mass);
  put<double>(reply.out, reply.at[0] + 24, min_mass);
  return hold_reply(fd, reply);
}

// The PRIORITIZED reply (wire.Op.PRIORITIZED, shard_server._Session._sample): the tally (rows the shard holds,
// picks, the float64 bits of the mass and of the least positive mass), the picks' ring rows, masses and
// generations, then each column's rows. Returns 0 once framed in the outbox, 1 when Python must answer, or -errno.
int64_t answer_prioritized(int fd, const OwnedStore& s, const Request& q, const PriorityRule& r) {
  if (!answerable(s, q)) return 1;
  const auto ncols = static_cast<size_t>(q.columns);
  const auto count = static_cast<uint64_t>(q.count);
  const Reply reply = frame_reply(kPrioritized, {}, {32, 8 * count, 8 * count, 8 * count}, s.columns, ncols, q.count);
  char* at = reply.out.data();
  const PrioritizedPicks picks{reinterpret_cast<int64_t*>(at + reply.at[1]), reinterpret_cast<double*>(at + reply.at[2]),
                               reinterpret_cast<int64_t*>(at + reply.at[3])};
  double mass = 0, min_mass = 0;
  const int64_t live = sample_prioritized(s, q, r, picks, mass, min_mass, rows_in(reply, s.columns, ncols, q.count));
  return live < 0 ? 1 : hold_prioritized(fd, reply, live, q.count, mass, min_mass);
}

// Where a prioritized window answer's picks go (the reply itself, or a learner's tensors): each window's start
// and valid range, and its key's mass and generation.
struct KeyedWindows {
  int64_t *starts, *valid_begin, *valid_end;
  double* mass;
  int64_t* generation;
};

// Whether the core's trees are those derived from the rule's episodes still (under the core's lock).
bool derived_as_taken(const PriorityWindowRule& r) { return r.derivation.data_ptr<int64_t>()[0] == r.derived; }

// PriorityWindowSelector.pick's draw (selection/priority_windows.py) under a read section and the core's lock,
// while the view behind `r` is current and the trees still those derived from its episodes: keys by the trees'
// masses, their masses and generations, their windows placed and taken modulo the ring; then, the lock let go,
// the windows' rows gathered into `out`. Returns the rows the view holds, or -1 when Python must answer.
int64_t sample_priority_windows(const OwnedStore& s, const Request& q, const PriorityWindowRule& r, int64_t seen_seq,
                                const KeyedWindows& picks, double& mass, double& min_mass, std::vector<at::Tensor> out) {
  int64_t* header = s.header.data_ptr<int64_t>();
  if (!answerable(s, q) || q.count > kMaxReadPositions / r.keys.window_len || !readable_as_mapped(s)) return -1;
  Section section(header, s.reader.data_ptr<int64_t>());
  if (load(header, kPublishedSeq) != seen_seq || section.lo > r.seen_lo) return -1;
  const int64_t capacity = s.columns.front().size(0);
  {
    std::lock_guard<std::mutex> lock(r.lock->mutex);
    if (!derived_as_taken(r)) return -1;
    mass = r.sum_tree.data_ptr<double>()[0];
    if (!(mass > 0)) return -1;
    min_mass = r.min_tree.data_ptr<double>()[0];
    if (q.count > 0) {
      sum_tree_draw_into(r.sum_tree, q.count, seeded(q), picks.starts);  // the keys, each placed over by its window
      const double* leaves = r.sum_tree.data_ptr<double>() + tree_leaf_offset(r.sum_tree.numel());
      const int64_t* generation = r.generation.data_ptr<int64_t>();
      for (int64_t i = 0; i < q.count; ++i) {
        picks.mass[i] = leaves[picks.starts[i]];
        picks.generation[i] = generation[picks.starts[i]];
      }
      if (!place_keyed_windows_into(live_episodes(r.live, capacity), picks.starts, q.count, r.keys.window_len, r.keys.burn_in,
                                    picks.starts, picks.valid_begin, picks.valid_end)) {
        return -1;
      }
    }
  }
  const int64_t live = r.seen_hi - r.seen_lo;
  if (q.count > 0) {
    for (int64_t i = 0; i < q.count; ++i) picks.starts[i] = ((picks.starts[i] % capacity) + capacity) % capacity;
    const at::Tensor starts = at::from_blob(picks.starts, {q.count}, at::kLong);
    const at::Tensor begin = at::from_blob(picks.valid_begin, {q.count}, at::kLong);
    const at::Tensor end = at::from_blob(picks.valid_end, {q.count}, at::kLong);
    if (first_row_outside(starts, begin, end, r.keys.window_len, capacity, r.seen_lo % capacity, live) >= 0) return -1;
    gather_cpu({std::vector<at::Tensor>(s.columns.begin(), s.columns.begin() + q.columns), std::move(out), starts,
                begin, end, std::nullopt, r.keys.window_len});
  }
  return section.close() ? live : -1;
}

// The PRIORITIZED reply of a rule of windows: the tally (rows the view holds, picks, the float64 bits of the mass
// and of the least positive mass), the windows' starts and valid ranges, their keys' masses and generations, then
// each column's rows. Returns 0 once framed in the outbox, 1 when Python must answer, or -errno.
int64_t answer_priority_windows(int fd, const OwnedStore& s, const Request& q, const PriorityWindowRule& r,
                                int64_t seen_seq) {
  if (!answerable(s, q) || q.count > kMaxReadPositions / r.keys.window_len) return 1;
  const auto ncols = static_cast<size_t>(q.columns);
  const auto count = static_cast<uint64_t>(q.count);
  const int64_t positions = q.count * r.keys.window_len;
  const Reply reply = frame_reply(kPrioritized, {}, {32, 8 * count, 8 * count, 8 * count, 8 * count, 8 * count},
                                  s.columns, ncols, positions);
  char* at = reply.out.data();
  const KeyedWindows picks{reinterpret_cast<int64_t*>(at + reply.at[1]), reinterpret_cast<int64_t*>(at + reply.at[2]),
                           reinterpret_cast<int64_t*>(at + reply.at[3]), reinterpret_cast<double*>(at + reply.at[4]),
                           reinterpret_cast<int64_t*>(at + reply.at[5])};
  double mass = 0, min_mass = 0;
  const int64_t live =
      sample_priority_windows(s, q, r, seen_seq, picks, mass, min_mass, rows_in(reply, s.columns, ncols, positions));
  return live < 0 ? 1 : hold_prioritized(fd, reply, live, q.count, mass, min_mass);
}

// Whether the head at `p` (JSON of `meta` bytes) frames an update Python would parse: rows, as many priorities,
// generations or none, within the request limit.
bool frames_update(const char* p, size_t meta) {
  const char* lengths = p + kHeader + meta;
  const auto rows = field<uint64_t>(lengths), priorities = field<uint64_t>(lengths + 8);
  const auto generations = field<uint64_t>(lengths + 16);
  return rows % 8 == 0 && priorities == rows && (generations == 0 || generations == rows) &&
         rows / 8 <= static_cast<uint64_t>(kMaxReadPositions) && field<uint64_t>(p + 12) == rows + priorities + generations;
}

// A POST_UPDATE as received: its three arrays' bytes (rows, priorities, drawn generations) one after another.
struct ReceivedUpdate {
  std::vector<char>& bytes;  // this thread's, kept from one update to the next: no allocation per update
  std::array<int64_t, 3> lengths{};

  UpdateArrays arrays() const {
    const char* at = bytes.data();
    return {reinterpret_cast<const int64_t*>(at), reinterpret_cast<const double*>(at + lengths[0]),
            lengths[2] > 0 ? reinterpret_cast<const int64_t*>(at + lengths[0] + lengths[1]) : nullptr,
            lengths[0] / 8};
  }

  // The arrays as tensors of their own (for Python, which says why an update was refused, or applies it).
  std::vector<at::Tensor> tensors() const {
    std::vector<at::Tensor> out;
    int64_t at = 0;
    for (const int64_t n : lengths) {
      out.push_back(at::from_blob(const_cast<char*>(bytes.data()) + at, {n}, at::kByte).clone());
      at += n;
    }
    return out;
  }
};

std::vector<char>& update_bytes() {
  thread_local std::vector<char> bytes;
  return bytes;
}

// A POST_UPDATE whose head (at `p`) frames_update, read whole into `got`; 0 or -errno.
int64_t receive_update(int fd, char* p, size_t meta, ReceivedUpdate& got) {
  for (size_t i = 0; i < 3; ++i) got.lengths[i] = static_cast<int64_t>(field<uint64_t>(p + kHeader + meta + 8 * i));
  int64_t status = receive(fd, p, kHeader + meta + 24, false, false);
  if (status < 0) return status;
  // The three arrays in one buffer, read in one go: one receive, not one per array.
  const int64_t total = got.lengths[0] + got.lengths[1] + got.lengths[2];
  if (got.bytes.size() < static_cast<size_t>(total)) got.bytes.resize(static_cast<size_t>(total));
  if (total > 0) status = receive(fd, got.bytes.data(), static_cast<size_t>(total), false, false);
  return status;
}

// PrioritySelector.update on the CPU (selection/priorities.py), under the core's lock: true once applied;
// false, with nothing changed, when a check refused it (Python then says why) or the core was replaced or
// emptied meanwhile (Python applies it to the core there is now).
bool apply_update(const PriorityRule& r, const UpdateArrays& update) {
  std::lock_guard<std::mutex> lock(r.lock->mutex);
  if (r.followed.data_ptr<int64_t>()[0] < 0) return false;
  const PriorityUpdate done =
      priority_update(r.sum_tree, r.min_tree, r.generation, update, r.alpha, r.eps, r.generation.numel());
  if (done.applied) {
    double* max_priority = r.max_priority.data_ptr<double>();
    *max_priority = std::max(*max_priority, done.landed_max);
  }
  return done.applied;
}

// PriorityWindowSelector.update on the CPU (selection/priority_windows.py), under the core's lock: each landing
// row's mass kept, and in the trees where the row keys a window of the episodes the trees were derived from
// (elsewhere none). False, with nothing changed, when a check refused it (Python says why) or the trees were
// derived anew since the rule was made (Python applies it).
bool apply_update(const PriorityWindowRule& r, const UpdateArrays& update) {
  std::lock_guard<std::mutex> lock(r.lock->mutex);
  if (!derived_as_taken(r)) return false;
  const int64_t capacity = r.generation.numel();
  const PriorityUpdate done =
      priority_window_update(r.sum_tree, r.min_tree, r.generation, r.row_mass, update, r.alpha, r.eps, capacity,
                             live_episodes(r.live, capacity), r.keys);
  if (done.applied) {
    double* max_priority = r.max_priority.data_ptr<double>();
    *max_priority = std::max(*max_priority, done.landed_max);
  }
  return done.applied;
}

// A POST_UPDATE of `r` met by serve_samples: applied (true), or `served` says what Python does next: read
// it itself (another rule's, or one it refuses with its own words: nothing of it was read), answer the one
// not applied here whose arrays it carries, or end the connection.
template <typename Rule>
bool took_update(int fd, char* p, size_t seen, const Rule& r, Served& served) {
  const size_t meta = r.update_key.size();
  if (field<uint16_t>(p + 6) != 3 || field<uint32_t>(p + 8) != meta) return false;
  served.code = seen >= kHeader + meta + 24 ? 0 : receive(fd, p, kHeader + meta + 24, true, false);
  if (served.code < 0) return false;
  served.code = kNextIsOther;
  if (std::memcmp(p + kHeader, r.update_key.data(), meta) != 0 || !frames_update(p, meta)) return false;
  ReceivedUpdate update{update_bytes()};
  served.code = receive_update(fd, p, meta, update);
  if (served.code < 0) return false;
  if (apply_update(r, update.arrays())) return true;
  served.code = kServeInPython;
  served.op = kPostUpdate;
  served.arrays = update.tensors();
  return false;
}

// Whether the view behind a rule is current: nothing published or evicted since it caught up (to `seen_seq`,
// its index covering positions from `seen_lo`).
bool current(const int64_t* header, int64_t seen_seq, int64_t seen_lo) {
  return load(header, kPublishedSeq) == seen_seq && readable_lo(header) <= seen_lo;
}

// Whether the header at `p` frames exactly one ask after `meta` bytes of JSON (its array's length aside).
bool frames_one_ask(const char* p, size_t meta) {
  return field<uint16_t>(p + 6) == 1 && field<uint32_t>(p + 8) == meta && field<uint64_t>(p + 12) == 24;
}

// The ask of a SAMPLE_ROWS, SAMPLE_WINDOWS or SAMPLE_PRIORITIZED whose bytes (JSON of `meta` bytes) are at
// `p`; false if malformed.
bool parse_ask(const char* p, size_t meta, Request& q) {
  if (field<uint64_t>(p + kHeader + meta) != 24) return false;
  const char* ask = p + kHeader + meta + 8;
  q = {field<int64_t>(ask), field<int64_t>(ask + 8), field<int64_t>(ask + 16)};
  return true;
}

void check_window_rule(const WindowRule& r) {
  TORCH_CHECK(r.tree.scalar_type() == at::kDouble && r.tree.dim() == 1 && r.tree.numel() > 0 && r.tree.is_contiguous(),
              "window rule: the tree is a contiguous float64 tensor");
  TORCH_CHECK(r.window_len >= 1 && r.burn_in >= 0 && r.seen_lo >= 0 && r.seen_hi >= r.seen_lo && !r.key.empty() &&
                  r.key.size() <= kMaxMeta,
              "window rule: bad geometry, positions or key");
}

void check_priority_rule(const PriorityRule& r) {
  for (const at::Tensor* tree : {&r.sum_tree, &r.min_tree}) {
    TORCH_CHECK(tree->scalar_type() == at::kDouble && tree->dim() == 1 && tree->is_contiguous() && tree->is_cpu() &&
                    tree->numel() == r.sum_tree.numel(),
                "priority rule: the trees are contiguous float64 CPU tensors of one size");
  }
  TORCH_CHECK(r.generation.scalar_type() == at::kLong && r.generation.dim() == 1 && r.generation.is_contiguous() &&
                  tree_leaf_offset(r.sum_tree.numel()) + r.generation.numel() <= r.sum_tree.numel(),
              "priority rule: one contiguous int64 generation per leaf");
  TORCH_CHECK(r.followed.scalar_type() == at::kLong && r.followed.numel() == 2 && r.followed.is_contiguous(),
              "priority rule: followed is two int64 positions");
  TORCH_CHECK(r.max_priority.scalar_type() == at::kDouble && r.max_priority.numel() == 1 && r.max_priority.is_cpu(),
              "priority rule: the largest priority is one float64 on the CPU");
  TORCH_CHECK(r.rows_per_step >= 1 && r.lock != nullptr && !r.key.empty() && r.key.size() <= kMaxMeta &&
                  !r.update_key.empty() && r.update_key.size() <= kMaxMeta,
              "priority rule: bad step, lock or keys");
}

void check_priority_window_rule(const PriorityWindowRule& r) {
  for (const at::Tensor* tree : {&r.sum_tree, &r.min_tree}) {
    TORCH_CHECK(tree->scalar_type() == at::kDouble && tree->dim() == 1 && tree->is_contiguous() && tree->is_cpu() &&
                    tree->numel() == r.sum_tree.numel(),
                "priority window rule: the trees are contiguous float64 CPU tensors of one size");
  }
  const int64_t capacity = r.generation.numel();
  TORCH_CHECK(r.generation.scalar_type() == at::kLong && r.generation.dim() == 1 && r.generation.is_contiguous() &&
                  tree_leaf_offset(r.sum_tree.numel()) + capacity <= r.sum_tree.numel(),
              "priority window rule: one contiguous int64 generation per leaf");
  TORCH_CHECK(r.row_mass.scalar_type() == at::kDouble && r.row_mass.dim() == 1 && r.row_mass.is_contiguous() &&
                  r.row_mass.numel() == capacity,
              "priority window rule: one contiguous float64 mass per row");
  TORCH_CHECK(r.max_priority.scalar_type() == at::kDouble && r.max_priority.numel() == 1 && r.max_priority.is_cpu(),
              "priority window rule: the largest priority is one float64 on the CPU");
  TORCH_CHECK(r.derivation.scalar_type() == at::kLong && r.derivation.numel() == 1 && r.derivation.is_cpu(),
              "priority window rule: the derivation is one int64 on the CPU");
  live_episodes(r.live, capacity);  // (checks them)
  r.keys.check();
  TORCH_CHECK(r.seen_lo >= 0 && r.seen_hi >= r.seen_lo && r.lock != nullptr && !r.key.empty() &&
                  r.key.size() <= kMaxMeta && !r.update_key.empty() && r.update_key.size() <= kMaxMeta,
              "priority window rule: bad positions, lock or keys");
}

void check_owned_store(const OwnedStore& s) {
  TORCH_CHECK(s.header.scalar_type() == at::kLong && s.header.numel() > kDeadEnd, "owned store: bad header");
  TORCH_CHECK(s.reader.scalar_type() == at::kLong && s.reader.numel() == 4, "owned store: bad reader slot");
  TORCH_CHECK(!s.columns.empty(), "owned store: no columns");
  for (const auto& c : s.columns) {
    TORCH_CHECK(c.device().is_cpu() && c.dim() >= 1 && c.size(0) == s.columns.front().size(0) && c.is_contiguous(),
                "owned store: columns are contiguous CPU rings of one capacity");
  }
}

}  // namespace

int64_t sample_rows_into(const OwnedStore& s, int64_t count, int64_t seed, const at::Tensor& picks,
                         const std::vector<at::Tensor>& out) {
  check_owned_store(s);
  const Request q{count, seed, static_cast<int64_t>(out.size())};
  if (!answerable(s, q)) return -1;
  TORCH_CHECK(picks.device().is_cpu() && picks.scalar_type() == at::kLong && picks.dim() == 1 &&
                  picks.numel() == count && picks.is_contiguous(),
              "sample_rows_into: picks must be a contiguous CPU int64 tensor of ", count, " rows");
  check_gather_args({std::vector<at::Tensor>(s.columns.begin(), s.columns.begin() + q.columns), out, picks});
  TORCH_CHECK(out.front().device().is_cpu(), "sample_rows_into: the outputs must be CPU tensors");
  return sample_rows(s, q, picks, out);
}

WindowsInto sample_windows_into(const OwnedStore& s, const WindowRule& r, int64_t seen_seq, int64_t count,
                                int64_t seed, const std::vector<at::Tensor>& out) {
  check_owned_store(s);
  check_window_rule(r);
  const Request q{count, seed, static_cast<int64_t>(out.size())};
  WindowsInto got;
  if (!answerable(s, q) || q.count > kMaxReadPositions / r.window_len) return got;
  const at::Tensor none = at::zeros({count}, at::kLong);  // (the shapes alone are checked before the draw)
  check_gather_args({std::vector<at::Tensor>(s.columns.begin(), s.columns.begin() + q.columns), out, none, none,
                     none, std::nullopt, r.window_len});
  TORCH_CHECK(out.front().device().is_cpu(), "sample_windows_into: the outputs must be CPU tensors");
  const Landing land = [&](const Drawn& d, int64_t live, double mass) {
    got = {live, mass, d.starts, d.valid_begin, d.valid_end};
    return out;
  };
  got.live = sample_windows(s, q, r, seen_seq, land);
  return got;
}

PrioritizedInto sample_prioritized_into(const OwnedStore& s, const PriorityRule& r, int64_t count, int64_t seed,
                                        const at::Tensor& picks, const at::Tensor& mass, const at::Tensor& generation,
                                        const std::vector<at::Tensor>& out) {
  check_owned_store(s);
  check_priority_rule(r);
  const Request q{count, seed, static_cast<int64_t>(out.size())};
  PrioritizedInto got;
  if (!answerable(s, q)) return got;
  for (const auto& [t, type] : {std::pair{&picks, at::kLong}, {&mass, at::kDouble}, {&generation, at::kLong}}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == type && t->dim() == 1 && t->numel() == count &&
                    t->is_contiguous(),
                "sample_prioritized_into: picks, masses and generations are contiguous CPU tensors of ", count,
                " values (int64, float64, int64)");
  }
  check_gather_args({std::vector<at::Tensor>(s.columns.begin(), s.columns.begin() + q.columns), out, picks});
  TORCH_CHECK(out.front().device().is_cpu(), "sample_prioritized_into: the outputs must be CPU tensors");
  const PrioritizedPicks into{picks.data_ptr<int64_t>(), mass.data_ptr<double>(), generation.data_ptr<int64_t>()};
  got.live = sample_prioritized(s, q, r, into, got.mass, got.min_mass, out);
  return got;
}

PrioritizedInto sample_priority_windows_into(const OwnedStore& s, const PriorityWindowRule& r, int64_t seen_seq,
                                             int64_t count, int64_t seed, const std::vector<at::Tensor>& windows,
                                             const at::Tensor& mass, const at::Tensor& generation,
                                             const std::vector<at::Tensor>& out) {
  check_owned_store(s);
  check_priority_window_rule(r);
  const Request q{count, seed, static_cast<int64_t>(out.size())};
  PrioritizedInto got;
  if (!answerable(s, q) || q.count > kMaxReadPositions / r.keys.window_len) return got;
  TORCH_CHECK(windows.size() == 3, "sample_priority_windows_into: windows are starts, valid_begin and valid_end");
  for (const auto& [t, type] : {std::pair{&windows[0], at::kLong}, {&windows[1], at::kLong}, {&windows[2], at::kLong},
                                {&mass, at::kDouble}, {&generation, at::kLong}}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == type && t->dim() == 1 && t->numel() == count &&
                    t->is_contiguous(),
                "sample_priority_windows_into: starts, valid ranges, masses and generations are contiguous CPU "
                "tensors of ",
                count, " values (int64 but the masses' float64)");
  }
  check_gather_args({std::vector<at::Tensor>(s.columns.begin(), s.columns.begin() + q.columns), out, windows[0],
                     windows[1], windows[2], std::nullopt, r.keys.window_len});
  TORCH_CHECK(out.front().device().is_cpu(), "sample_priority_windows_into: the outputs must be CPU tensors");
  const KeyedWindows into{windows[0].data_ptr<int64_t>(), windows[1].data_ptr<int64_t>(),
                          windows[2].data_ptr<int64_t>(), mass.data_ptr<double>(), generation.data_ptr<int64_t>()};
  got.live = sample_priority_windows(s, q, r, seen_seq, into, got.mass, got.min_mass, out);
  return got;
}

int64_t frame_rows_reply(int64_t op, const std::string& meta, const std::vector<at::Tensor>& arrays,
                         const std::vector<at::Tensor>& columns, const at::Tensor& starts,
                         const at::Tensor& valid_begin, const at::Tensor& valid_end, int64_t window_len) {
  TORCH_CHECK(op >= 0 && op <= 0xffff && meta.size() <= kMaxMeta, "frame_rows_reply: bad op or metadata");
  const int64_t positions = starts.numel() * window_len;
  TORCH_CHECK(positions <= kMaxReadPositions, "frame_rows_reply: ", positions, " rows in one reply");
  std::vector<uint64_t> lengths;
  for (const at::Tensor& a : arrays) {
    TORCH_CHECK(a.device().is_cpu() && a.is_contiguous(), "frame_rows_reply: arrays are contiguous CPU tensors");
    lengths.push_back(static_cast<uint64_t>(a.nbytes()));
  }
  std::optional<Reply>& pending = pending_reply();
  pending.reset();
  Reply reply = frame_reply(static_cast<uint16_t>(op), meta, lengths, columns, columns.size(), positions);
  for (size_t i = 0; i < arrays.size(); ++i) {
    if (lengths[i] > 0) std::memcpy(reply.out.data() + reply.at[i], arrays[i].data_ptr(), lengths[i]);
  }
  if (!columns.empty()) {
    check_windows(starts, valid_begin, valid_end, window_len, columns.front().size(0));
    const GatherArgs rows{columns, rows_in(reply, columns, columns.size(), positions), starts, valid_begin,
                          valid_end, std::nullopt, window_len};
    check_gather_args(rows);
    gather_cpu(rows);
  }
  pending.emplace(std::move(reply));
  return static_cast<int64_t>(pending->bytes);
}

int64_t send_framed_reply(int64_t fd) {
  std::optional<Reply>& pending = pending_reply();
  TORCH_CHECK(pending.has_value(), "send_framed_reply: no reply was framed on this thread");
  const int64_t held = hold_reply(static_cast<int>(fd), *pending);
  pending.reset();
  const int64_t sent = flush(static_cast<int>(fd));
  return held < 0 ? held : sent;
}

Served serve_samples(int64_t fd_, const OwnedStore& s, int64_t seen_seq, int64_t max_lag, double catch_up_s,
                     const WindowRule* windows, const PriorityRule* priorities,
                     const PriorityWindowRule* priority_windows) {
  check_owned_store(s);
  if (windows != nullptr) check_window_rule(*windows);
  if (priorities != nullptr) check_priority_rule(*priorities);
  if (priority_windows != nullptr) check_priority_window_rule(*priority_windows);
  TORCH_CHECK(priorities == nullptr || priority_windows == nullptr,
              "serve_samples: one prioritized rule at a time (rows or windows: both answer SAMPLE_PRIORITIZED)");
  const int fd = static_cast<int>(fd_);
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(catch_up_s);
  const int64_t* header = s.header.data_ptr<int64_t>();
  const std::string none;
  // The JSON each op this call answers must carry, byte for byte (uniform rows carry none).
  const auto key_of = [&](uint16_t op) -> const std::string* {
    if (op == kSampleRows) return &none;
    if (op == kSampleWindows && windows != nullptr) return &windows->key;
    if (op == kSamplePrioritized && priorities != nullptr) return &priorities->key;
    if (op == kSamplePrioritized && priority_windows != nullptr) return &priority_windows->key;
    return nullptr;
  };
  const size_t key_bytes = std::max({windows != nullptr ? windows->key.size() : 0,
                                     priorities != nullptr ? priorities->key.size() : 0,
                                     priorities != nullptr ? priorities->update_key.size() : 0,
                                     priority_windows != nullptr ? priority_windows->key.size() : 0,
                                     priority_windows != nullptr ? priority_windows->update_key.size() : 0});
  // Room for the longest ask and the next one's header: a peek that sees past its ask knows another is queued.
  std::vector<char> request(kHeader + key_bytes + kAskBytes + kHeader);
  char* p = request.data();
  Served served{kNextIsOther};
  // Every way out sends the replies held first: what follows (Python's answer, or nothing) comes after them.
  const auto leave = [&](Served out) -> Served {
    const int64_t sent = flush(fd);
    return sent < 0 && out.code >= 0 ? Served{sent, 0, -1, 0, out.answered} : out;
  };
  bool queued = false;  // the last peek saw bytes past the ask it led to: the next request is there already
  for (;;) {
    int64_t seen = queued ? peek_request(fd, p, request.size(), false) : -EAGAIN;
    if (seen == -EAGAIN) {  // none yet: the replies held go out before waiting
      const int64_t sent = flush(fd);
      seen = sent < 0 ? sent : peek_request(fd, p, request.size(), true);  // until a request (or the end) comes
    }
    if (seen < 0) return leave({seen, 0, -1, 0, served.answered});
    if (std::memcmp(p, kWireMagic, 4) != 0) return leave(served);
    // Anything else, a malformed ask included, is Python's to read and answer (so nothing here waits for
    // bytes a message does not have).
    const auto op = field<uint16_t>(p + 4);
    if (op == kPostUpdate && (priorities != nullptr || priority_windows != nullptr)) {
      const bool took = priorities != nullptr ? took_update(fd, p, static_cast<size_t>(seen), *priorities, served)
                                              : took_update(fd, p, static_cast<size_t>(seen), *priority_windows, served);
      if (!took) return leave(served);
      queued = true;  // (whether another is there, the next peek finds out)
      continue;
    }
    const std::string* key = key_of(op);
    if (key == nullptr || !frames_one_ask(p, key->size())) return leave(served);
    const size_t meta = key->size();
    const size_t whole = kHeader + meta + kAskBytes;
    if (meta > 0) {  // an armed rule's, byte for byte, or Python's to answer
      const int64_t status = static_cast<size_t>(seen) >= whole ? 0 : receive(fd, p, whole, true, false);
      if (status < 0) return leave({status, 0, -1, 0, served.answered});
      if (std::memcmp(p + kHeader, key->data(), meta) != 0) return leave(served);
    }
    const bool due = std::chrono::steady_clock::now() > until || load(header, kPublishedSeq) - seen_seq > max_lag;
    if (due && served.answered > 0) {  // (the first answer of a call comes right after Python's turn)
      return leave({kCatchUp, 0, -1, 0, served.answered});
    }
    const int64_t* seen_lo = op == kSampleWindows                                   ? &windows->seen_lo
                             : op == kSamplePrioritized && priority_windows != nullptr ? &priority_windows->seen_lo
                                                                                       : nullptr;
    if (seen_lo != nullptr && !current(header, seen_seq, *seen_lo)) {  // windows are drawn from the view's index
      return leave({kCatchUp, 0, -1, 0, served.answered});
    }
    queued = static_cast<size_t>(seen) > whole;
    const int64_t got = receive(fd, p, whole, false, false);
    if (got < 0) return leave({got, 0, -1, 0, served.answered});
    Request q{};
    if (!parse_ask(p, meta, q)) return leave({-EPROTO, 0, -1, 0, served.answered});
    const int64_t done = op == kSampleWindows ? answer_windows(fd, s, q, *windows, seen_seq)
                         : op == kSamplePrioritized && priorities != nullptr ? answer_prioritized(fd, s, q, *priorities)
                         : op == kSamplePrioritized ? answer_priority_windows(fd, s, q, *priority_windows, seen_seq)
                                                    : answer(fd, s, q);
    if (done < 0) return leave({done, 0, -1, 0, served.answered});
    if (done == 1) return leave({kServeInPython, q.count, q.seed, q.columns, served.answered, op});
    ++served.answered;
  }
}

}  // namespace gear
