// Receive a tensor's bytes from a socket without the interpreter (see recv.cpp).
#pragma once

#include <ATen/ATen.h>

#include <deque>
#include <memory>
#include <string>
#include <vector>

namespace gear {

// Receives exactly out's bytes (a contiguous CPU tensor) from `fd`, blocking or not, waiting
// at most timeout_s for each chunk (negative: no limit). Returns the bytes received: all of
// them, fewer when the peer closed the connection, or -errno (-ETIMEDOUT after a wait that
// timed out). Python turns that into the socket error it would have raised.
int64_t recv_exact(int64_t fd, const at::Tensor& out, double timeout_s);

}  // namespace gear

namespace gear {

// One reply from each of many sockets, received at once (see replies.cpp).
struct Reply {
  int64_t status;                 // 0, or -errno: -ECONNRESET (peer closed), -ETIMEDOUT, -EPROTO (not our framing)
  int64_t op = -1;                // the reply's op (wire.Op), once its header arrived
  std::vector<int64_t> tally;     // a ROWS, WINDOWS or PRIORITIZED reply's first array, read here: no parse
  std::vector<uint8_t> head;      // the fixed header, the JSON metadata and the arrays' lengths, as sent
  std::vector<at::Tensor> small;  // the arrays before the last len(landing) ones (after the tally), as uint8
};

// A connection's bytes read past the reply being taken: the start of replies owed after it (a learner may ask
// one owner for several batches at once), kept for them. Nothing else reads a connection while it holds any.
// It also keeps the tickets of the replies owed, in the order they come, so a round's replies are matched to
// their requests here, for every owner in one call, not in a Python loop per owner.
struct Inbox {
  static constexpr size_t kCapacity = 64 << 10;
  std::unique_ptr<char[]> bytes;  // kCapacity of them, once a reply is first read
  size_t begin = 0, end = 0;  // the bytes not taken yet
  bool reads_ahead = false;   // more replies are owed after the next: its first read may take theirs too
  uint64_t last_reply = 0;    // the last reply's bytes: a big one's successors are read in place, not copied
  std::deque<int64_t> owed;   // the tickets of the replies owed on the connection, in order
  size_t held() const { return end - begin; }
  // What a reply's first read may take: several replies like the last one, where they are small.
  size_t first_read(size_t stash) const { return reads_ahead && 2 * last_reply <= kCapacity ? kCapacity : stash; }
  int64_t first_owed() const { return owed.empty() ? -1 : owed.front(); }
};

// Statuses of a reply matched to its ticket (receive_replies' `ticket`), besides 0 and -errno:
constexpr int64_t kNotOwed = 1;    // the connection does not owe that reply next (it was read past): nothing read
constexpr int64_t kBytesPast = 2;  // the reply landed, but bytes followed the last reply owed: a broken protocol

// Receives one framed message (distributed/wire.py) on each fd, all sockets waited on together.
// The last landing[i].size() arrays of an OK, ROWS, WINDOWS or PRIORITIZED reply land in landing[i]'s
// tensors (contiguous, CPU), tensor j from row first[i][j] on (a reply longer than the rows left is a
// protocol error); the others come back in `small`, but for the tally of a ROWS reply (live rows, picks), a
// WINDOWS reply (live rows, picks, the mass's float64 bits) or a PRIORITIZED reply (live rows, picks, the
// float64 bits of the mass and of the smallest positive mass), which comes back as numbers. A socket that
// delivers nothing for timeout_s (negative: no limit) times out. With `inboxes` (one per fd), a reply starts with
// the bytes its fd's inbox holds, and bytes read past it are kept there; without, bytes behind a reply (read
// with its first 16 KiB) are a protocol error, -EPROTO. With a `ticket` (>= 0) and inboxes, only a socket whose
// inbox owes that ticket next is read (the others: kNotOwed); a reply read whole is struck off its inbox's
// tickets, and one after which the inbox holds bytes but owes nothing more is kBytesPast.
std::vector<Reply> receive_replies(const std::vector<int64_t>& fds, const std::vector<std::vector<at::Tensor>>& landing,
                                   const std::vector<std::vector<int64_t>>& first, double timeout_s,
                                   const std::vector<std::shared_ptr<Inbox>>& inboxes = {}, int64_t ticket = -1);

// Every owner's share of one batch, received at once: what receive_replies does for a round of SAMPLE_* asks
// whose replies (op `op`: ROWS, WINDOWS or PRIORITIZED) all land in the same tensors, owner i's picks from pick
// firsts[i] on (the first `pick_arrays` tensors) and its rows from row firsts[i] * rows_per_pick on. A reply of
// another op but ERROR, of more picks than asked[i], of negative rows, or with arrays besides its tally and
// landing, is -EPROTO. The tally comes back as arrays, one value per owner: nothing per owner to unpack.
struct ShareReplies {
  std::vector<int64_t> status, count, rows;  // status: 0, or -errno as receive_replies says
  std::vector<double> mass;       // the tally's mass (a ROWS reply: its rows)
  std::vector<double> min_mass;   // a PRIORITIZED reply's least positive mass (0: none)
  std::vector<std::vector<uint8_t>> heads;  // an ERROR reply's head, to read its message (empty for the others)
};
ShareReplies receive_shares(const std::vector<int64_t>& fds, const std::vector<at::Tensor>& landing,
                            int64_t pick_arrays, const std::vector<int64_t>& firsts,
                            const std::vector<int64_t>& asked, int64_t rows_per_pick, int64_t op, double timeout_s,
                            const std::vector<std::shared_ptr<Inbox>>& inboxes = {}, int64_t ticket = -1);

// Sends frames[i] whole on fds[i], each socket in turn, blocking or not (a full socket waits up to timeout_s
// for room; negative: no limit). Each send's status: 0, or -errno (-ETIMEDOUT). One socket's failure is its
// own: the others are still sent to.
std::vector<int64_t> send_requests(const std::vector<int64_t>& fds, const std::vector<std::string>& frames,
                                   double timeout_s);

// Sends every owner its share of one or more batches as send_requests would, each owner's asks in one write:
// for every batch r, `head` (a SAMPLE_*'s, the same for every ask) and the 24 bytes of the ask (counts[r * n +
// i], seeds[r * n + i] (-1: none), columns) for fds[i], framed here.
std::vector<int64_t> send_shares(const std::vector<int64_t>& fds, const std::string& head,
                                 const std::vector<int64_t>& counts, const std::vector<int64_t>& seeds,
                                 int64_t columns, double timeout_s);

}  // namespace gear
