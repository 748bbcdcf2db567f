// Receive a tensor's bytes from a socket without the interpreter (see cpu/recv.cpp).
#pragma once

#include <ATen/ATen.h>

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

// One reply from each of many sockets, received at once (see cpu/replies.cpp).
struct Reply {
  int64_t status;                 // 0, or -errno: -ECONNRESET (peer closed), -ETIMEDOUT, -EPROTO (not our framing)
  int64_t op = -1;                // the reply's op (wire.Op), once its header arrived
  std::vector<int64_t> tally;     // a ROWS, WINDOWS or PRIORITIZED reply's first array, read here: no parse
  at::Tensor head;                // the fixed header, the JSON metadata and the arrays' lengths, as sent
  std::vector<at::Tensor> small;  // the arrays before the last len(landing) ones (after the tally), as uint8
};

// Receives one framed message (distributed/wire.py) on each fd, all sockets waited on together.
// The last landing[i].size() arrays of an OK, ROWS, WINDOWS or PRIORITIZED reply land in landing[i]'s
// tensors (contiguous, CPU), tensor j from row first[i][j] on (a reply longer than the rows left is a
// protocol error); the others come back in `small`, but for the tally of a ROWS reply (live rows, picks), a
// WINDOWS reply (live rows, picks, the mass's float64 bits) or a PRIORITIZED reply (live rows, picks, the
// float64 bits of the mass and of the smallest positive mass), which comes back as numbers. A socket that
// delivers nothing for timeout_s (negative: no limit) times out.
std::vector<Reply> receive_replies(const std::vector<int64_t>& fds, const std::vector<std::vector<at::Tensor>>& landing,
                                   const std::vector<std::vector<int64_t>>& first, double timeout_s);

// Sends frames[i] whole on fds[i], each socket in turn, blocking or not (a full socket waits up to timeout_s
// for room; negative: no limit). Each send's status: 0, or -errno (-ETIMEDOUT). One socket's failure is its
// own: the others are still sent to.
std::vector<int64_t> send_requests(const std::vector<int64_t>& fds, const std::vector<std::string>& frames,
                                   double timeout_s);

}  // namespace gear
