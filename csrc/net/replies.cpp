// A learner asks every shard owner for its share of a batch, then waits for all of them. Sending every
// request in one call and waiting here, on every socket at once with the GIL released, replaces a Python
// send and a Python receive loop per owner: the learner's cost per batch stays flat as owners are added.
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>

#include "kernels/gather.h"
#include "net/framing.h"
#include "net/recv.h"

namespace gear {
namespace {

// A reply's first read takes up to this much: all of a share of a batch split across owners, and no more than
// a copy of a few microseconds for a big one, whose rest is read in place. Where more replies are owed on the
// connection and they are small (Inbox::first_read), it takes up to a whole inbox: theirs too, if they are there.
constexpr size_t kStash = 16 << 10;

struct Pending {
  int fd;
  const std::vector<at::Tensor>* landing;
  const std::vector<int64_t>* first;  // the row of each landing tensor the reply's array starts at
  std::vector<uint8_t> head = std::vector<uint8_t>(kHeader);  // grows to the JSON and lengths once they are known
  std::vector<uint64_t> lengths;
  std::vector<char*> targets;  // where each array's bytes go
  size_t part = 0;             // 0: fixed header, 1: JSON and lengths, 2 + i: array i
  uint64_t got = 0;            // bytes of the current part received
  std::vector<iovec> scatter;  // the arrays still due, for one read
  std::shared_ptr<Inbox> box;  // a reply's first read (its header and what fits of its arrays), and what follows
  bool keeps_past = false;     // bytes past the reply stay in `box` (the caller's) for the replies owed next
  std::chrono::steady_clock::time_point heard;  // when bytes last arrived (or the call began)
  bool readable = false;  // worth a read: when poll says so
  Reply reply;
  bool done = false;
};

void finish(Pending& p, int64_t status) {
  p.reply.status = status;
  p.done = true;
}

// The part now being received: where its bytes go and how many there are.
std::pair<char*, uint64_t> current(Pending& p) {
  char* head = reinterpret_cast<char*>(p.head.data());
  if (p.part == 0) return {head, kHeader};
  if (p.part == 1) return {head + kHeader, static_cast<uint64_t>(p.head.size()) - kHeader};
  return {p.targets[p.part - 2], p.lengths[p.part - 2]};
}

// Sets up what follows the fixed header; false (and finished) if it is not our framing.
bool read_header(Pending& p) {
  const uint8_t* h = p.head.data();
  const auto count = field<uint16_t>(h + 6);
  const auto meta = field<uint32_t>(h + 8);
  const auto total = field<uint64_t>(h + 12);
  if (std::memcmp(h, kWireMagic, 4) != 0 || meta > kMaxMeta || count > kMaxArrays || total > kMaxTotal) {
    finish(p, -EPROTO);
    return false;
  }
  p.head.resize(kHeader + meta + 8ull * count);
  p.lengths.assign(count, 0);
  return true;
}

// Places every array once their lengths are known; false (and finished) if they do not fit.
bool place_arrays(Pending& p) {
  const uint8_t* h = p.head.data();
  const auto count = field<uint16_t>(h + 6);
  const auto op = field<uint16_t>(h + 4);
  const auto meta = field<uint32_t>(h + 8);
  uint64_t total = 0;
  for (size_t i = 0; i < count; ++i) {
    p.lengths[i] = field<uint64_t>(h + kHeader + meta + 8 * i);
    total += p.lengths[i];
  }
  const bool lands = op == kOk || op == kRows || op == kWindows || op == kPrioritized;  // an error lands nowhere
  const size_t ncols = lands ? p.landing->size() : 0;
  const size_t tally = op == kRows ? 2 : op == kWindows ? 3 : op == kPrioritized ? 4 : 0;  // int64 values
  const size_t tallied = tally ? 1 : 0;
  if (total != field<uint64_t>(h + 12) || count < ncols + tallied || (tallied && p.lengths[0] != 8 * tally)) {
    finish(p, -EPROTO);
    return false;
  }
  p.reply.op = op;
  p.box->last_reply = kHeader + meta + 8ull * count + total;
  for (size_t i = 0; i < count; ++i) {
    if (i < tallied) {
      p.reply.tally.assign(tally, 0);
      p.targets.push_back(reinterpret_cast<char*>(p.reply.tally.data()));
      continue;
    }
    if (i + ncols < count) {
      p.reply.small.push_back(at::empty({static_cast<int64_t>(p.lengths[i])}, at::kByte));
      p.targets.push_back(static_cast<char*>(p.reply.small.back().data_ptr()));
      continue;
    }
    const size_t j = i + ncols - count;
    const at::Tensor& out = (*p.landing)[j];
    const int64_t rows = out.size(0), first = (*p.first)[j];
    const int64_t row_bytes = row_bytes_of(out);
    if (first > rows || p.lengths[i] > static_cast<uint64_t>((rows - first) * row_bytes)) {
      finish(p, -EPROTO);
      return false;
    }
    p.targets.push_back(static_cast<char*>(out.data_ptr()) + first * row_bytes);
  }
  return true;
}

// Moves to the next part once one is complete (skipping empty ones); finishes after the last.
void advance(Pending& p) {
  while (!p.done) {
    const uint64_t need = current(p).second;
    if (p.got < need) return;
    p.got = 0;
    if (p.part == 0 && !read_header(p)) return;
    if (p.part == 1 && !place_arrays(p)) return;
    ++p.part;
    if (p.part >= 2 + p.lengths.size()) {
      p.reply.head = std::move(p.head);
      finish(p, 0);
    }
  }
}

// Counts `k` bytes just received against the parts they filled, in order.
void took(Pending& p, uint64_t k) {
  while (k > 0 && !p.done) {
    const uint64_t step = std::min(k, current(p).second - p.got);
    p.got += step;
    k -= step;
    advance(p);
  }
}

// The inbox's bytes, copied into the parts they belong to, in order, until the reply is whole. Bytes past it
// are the next replies' where the caller keeps them; else not our framing (a socket then carries one reply at
// a time: a learner sends its next request after taking the last reply).
void unstash(Pending& p) {
  Inbox& box = *p.box;
  while (box.held() > 0 && !p.done) {
    auto [where, need] = current(p);
    const uint64_t step = std::min<uint64_t>(box.held(), need - p.got);
    std::memcpy(where + p.got, box.bytes.get() + box.begin, static_cast<size_t>(step));
    box.begin += static_cast<size_t>(step);
    took(p, step);
  }
  if (box.held() > 0 && !p.keeps_past) finish(p, -EPROTO);
}

// Every array left, in one scatter read.
ssize_t receive_arrays(Pending& p) {
  std::vector<iovec>& parts = p.scatter;
  parts.clear();
  for (size_t i = p.part - 2; i < p.lengths.size() && parts.size() < IOV_MAX; ++i) {
    const uint64_t skip = i == p.part - 2 ? p.got : 0;
    if (p.lengths[i] > skip) parts.push_back({p.targets[i] + skip, static_cast<size_t>(p.lengths[i] - skip)});
  }
  msghdr message{};
  message.msg_iov = parts.data();
  message.msg_iovlen = parts.size();
  return ::recvmsg(p.fd, &message, MSG_DONTWAIT);
}

// One receive, its bytes counted: at a reply's start, whatever of it fits the stash (for a share of a batch
// across many owners, the whole reply: one call per owner); then the part now due, or (once the arrays are
// placed) every array left in one scatter read, so a reply costs the same few calls whatever its columns.
ssize_t receive_some(Pending& p) {
  if (p.part == 0 && p.got == 0) {  // the inbox is empty: a reply starts with it or is read whole
    Inbox& box = *p.box;
    if (!box.bytes) box.bytes.reset(new char[Inbox::kCapacity]);
    box.begin = box.end = 0;
    const ssize_t k = ::recv(p.fd, box.bytes.get(), box.first_read(kStash), MSG_DONTWAIT);
    if (k > 0) {
      box.end = static_cast<size_t>(k);
      unstash(p);
    }
    return k;
  }
  ssize_t k;
  if (p.part < 2) {
    auto [where, need] = current(p);
    k = ::recv(p.fd, where + p.got, static_cast<size_t>(need - p.got), MSG_DONTWAIT);
  } else {
    k = receive_arrays(p);
  }
  if (k > 0) took(p, static_cast<uint64_t>(k));
  return k;
}

// Takes what the socket holds now; false when it would block.
bool drain(Pending& p) {
  bool heard = false;
  while (!p.done) {
    const ssize_t k = receive_some(p);
    if (k > 0) {
      heard = true;
      continue;
    }
    if (heard) p.heard = std::chrono::steady_clock::now();
    if (k == 0) {
      finish(p, -ECONNRESET);
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      return false;
    } else if (errno != EINTR) {
      finish(p, -errno);
    }
  }
  return true;
}

// Sends all of `n` bytes; 0, or -errno. A socket with no room (a non-blocking one: Python's sockets with a
// timeout are) waits up to wait_ms for it.
int64_t send_whole(int fd, const char* p, size_t n, int wait_ms) {
  while (n > 0) {
    const ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k >= 0) {
      p += k;
      n -= static_cast<size_t>(k);
      continue;
    }
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return -errno;
    pollfd room{fd, POLLOUT, 0};
    const int ready = ::poll(&room, 1, wait_ms);
    if (ready == 0) return -ETIMEDOUT;
    if (ready < 0 && errno != EINTR) return -errno;
  }
  return 0;
}

double bits_as_double(int64_t bits) {
  double value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

void check_landing(const std::vector<at::Tensor>& landing) {
  for (const auto& c : landing) {
    TORCH_CHECK(c.device().is_cpu() && c.is_contiguous() && c.dim() >= 1,
                "receive_replies: landing tensors must be contiguous CPU tensors of at least one dimension");
  }
}

// A reply read whole is struck off its inbox's tickets; bytes held past the last one owed break the protocol.
void strike_off(Pending& p) {
  if (p.reply.status != 0) return;
  Inbox& box = *p.box;
  box.owed.pop_front();
  if (box.owed.empty() && box.held() > 0) p.reply.status = kBytesPast;
}

// receive_replies, each socket's landing tensors named by pointer (a round's shares all land in one batch).
std::vector<Reply> receive_into(const std::vector<int64_t>& fds,
                                const std::vector<const std::vector<at::Tensor>*>& landing,
                                const std::vector<std::vector<int64_t>>& first, double timeout_s,
                                const std::vector<std::shared_ptr<Inbox>>& inboxes, int64_t ticket) {
  TORCH_CHECK(fds.size() == landing.size() && fds.size() == first.size(),
              "receive_replies: one list of landing tensors and one of first rows per socket");
  TORCH_CHECK(inboxes.empty() || inboxes.size() == fds.size(), "receive_replies: one inbox per socket, or none");
  const bool matched = ticket >= 0 && !inboxes.empty();
  std::vector<Pending> pending(fds.size());
  for (size_t i = 0; i < fds.size(); ++i) {
    Pending& p = pending[i];
    p.keeps_past = !inboxes.empty();
    p.box = p.keeps_past ? inboxes[i] : std::make_shared<Inbox>();
    TORCH_CHECK(p.box, "receive_replies: an inbox that is None");
    p.fd = static_cast<int>(fds[i]);
    p.landing = landing[i];
    p.first = &first[i];
    TORCH_CHECK(first[i].size() == landing[i]->size(), "receive_replies: one first row per landing tensor");
    for (const int64_t f : first[i]) TORCH_CHECK(f >= 0, "receive_replies: a negative first row");
  }
  using Clock = std::chrono::steady_clock;
  const auto patience = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(timeout_s < 0 ? 1e9 : timeout_s));
  for (auto& p : pending) {
    p.heard = Clock::now();
    if (matched) {
      if (p.box->first_owed() != ticket) {
        finish(p, kNotOwed);
        continue;
      }
      p.box->reads_ahead = p.box->owed.size() > 1;
      p.readable = p.box->reads_ahead;  // asked for with later ones, so likely there already: read before polling
    }
    if (p.box->held() > 0) unstash(p);  // read ahead with an earlier reply
  }
  std::vector<pollfd> waiting;
  std::vector<Pending*> of;
  while (true) {
    waiting.clear();
    of.clear();
    const auto now = Clock::now();
    auto wake = now + patience;
    for (auto& p : pending) {
      if (p.done || (p.readable && drain(p))) continue;
      if (now - p.heard >= patience) {
        finish(p, -ETIMEDOUT);
        continue;
      }
      waiting.push_back({p.fd, POLLIN, 0});
      of.push_back(&p);
      wake = std::min(wake, p.heard + patience);
    }
    if (waiting.empty()) break;
    const auto wait_ms = std::chrono::duration_cast<std::chrono::milliseconds>(wake - now).count() + 1;
    const int ready = ::poll(waiting.data(), waiting.size(), static_cast<int>(std::min<int64_t>(wait_ms, 1 << 30)));
    if (ready < 0 && errno != EINTR) {
      for (auto* p : of) finish(*p, -errno);
      break;
    }
    for (size_t i = 0; i < waiting.size(); ++i) of[i]->readable = ready < 0 || waiting[i].revents != 0;
  }
  std::vector<Reply> replies;
  replies.reserve(pending.size());
  for (auto& p : pending) {
    if (matched && p.reply.status != kNotOwed) strike_off(p);
    replies.push_back(std::move(p.reply));
  }
  return replies;
}

}  // namespace

std::vector<int64_t> send_requests(const std::vector<int64_t>& fds, const std::vector<std::string>& frames,
                                   double timeout_s) {
  TORCH_CHECK(fds.size() == frames.size(), "send_requests: one frame per socket");
  const int wait_ms = timeout_s < 0 ? -1 : static_cast<int>(std::min(std::ceil(timeout_s * 1000.0), 1e9));
  std::vector<int64_t> statuses(fds.size());
  for (size_t i = 0; i < fds.size(); ++i) {
    statuses[i] = send_whole(static_cast<int>(fds[i]), frames[i].data(), frames[i].size(), wait_ms);
  }
  return statuses;
}

std::vector<int64_t> send_shares(const std::vector<int64_t>& fds, const std::string& head,
                                 const std::vector<int64_t>& counts, const std::vector<int64_t>& seeds,
                                 int64_t columns, double timeout_s) {
  const size_t n = fds.size();
  TORCH_CHECK(n > 0 && !counts.empty() && counts.size() % n == 0 && seeds.size() == counts.size(),
              "send_shares: one count and one seed per socket for each batch");
  std::vector<std::string> frames(n);
  for (size_t i = 0; i < n; ++i) frames[i].reserve((head.size() + 24) * (counts.size() / n));
  for (size_t at = 0; at < counts.size(); ++at) {
    const int64_t ask[3] = {counts[at], seeds[at], columns};
    frames[at % n].append(head).append(reinterpret_cast<const char*>(ask), sizeof ask);
  }
  return send_requests(fds, frames, timeout_s);
}

std::vector<Reply> receive_replies(const std::vector<int64_t>& fds, const std::vector<std::vector<at::Tensor>>& landing,
                                   const std::vector<std::vector<int64_t>>& first, double timeout_s,
                                   const std::vector<std::shared_ptr<Inbox>>& inboxes, int64_t ticket) {
  std::vector<const std::vector<at::Tensor>*> lands;
  for (const auto& l : landing) {
    check_landing(l);
    lands.push_back(&l);
  }
  return receive_into(fds, lands, first, timeout_s, inboxes, ticket);
}

ShareReplies receive_shares(const std::vector<int64_t>& fds, const std::vector<at::Tensor>& landing,
                            int64_t pick_arrays, const std::vector<int64_t>& firsts,
                            const std::vector<int64_t>& asked, int64_t rows_per_pick, int64_t op, double timeout_s,
                            const std::vector<std::shared_ptr<Inbox>>& inboxes, int64_t ticket) {
  const size_t n = fds.size();
  TORCH_CHECK(firsts.size() == n && asked.size() == n, "receive_shares: one first pick and one count per socket");
  TORCH_CHECK(pick_arrays >= 0 && static_cast<size_t>(pick_arrays) <= landing.size() && rows_per_pick >= 1,
              "receive_shares: pick_arrays within the landing tensors, rows_per_pick at least 1");
  TORCH_CHECK(op == kRows || op == kWindows || op == kPrioritized, "receive_shares: a ROWS, WINDOWS or PRIORITIZED op");
  check_landing(landing);
  const std::vector<const std::vector<at::Tensor>*> lands(n, &landing);
  std::vector<std::vector<int64_t>> rows_from(n);
  for (size_t i = 0; i < n; ++i) {
    rows_from[i].assign(landing.size(), firsts[i] * rows_per_pick);
    std::fill_n(rows_from[i].begin(), pick_arrays, firsts[i]);
  }
  std::vector<Reply> replies = receive_into(fds, lands, rows_from, timeout_s, inboxes, ticket);
  const size_t tally = op == kRows ? 2 : op == kWindows ? 3 : 4;
  ShareReplies out;
  for (auto* v : {&out.status, &out.count, &out.rows}) v->assign(n, 0);
  out.mass.assign(n, 0.0);
  out.min_mass.assign(n, 0.0);
  out.heads.resize(n);
  for (size_t i = 0; i < n; ++i) {
    Reply& r = replies[i];
    out.status[i] = r.status;
    if (r.status != 0) continue;
    if (r.op != op) {
      if (r.op == kError) {
        out.heads[i] = std::move(r.head);
      } else {
        out.status[i] = -EPROTO;
      }
      continue;
    }
    const int64_t rows = r.tally[0], count = r.tally[1];
    if (r.tally.size() != tally || !r.small.empty() || count < 0 || count > asked[i] || rows < 0) {
      out.status[i] = -EPROTO;
      continue;
    }
    out.rows[i] = rows;
    out.count[i] = count;
    out.mass[i] = tally > 2 ? bits_as_double(r.tally[2]) : static_cast<double>(rows);
    if (tally > 3) out.min_mass[i] = bits_as_double(r.tally[3]);
  }
  return out;
}

}  // namespace gear
