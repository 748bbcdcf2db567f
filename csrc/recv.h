// Receive a tensor's bytes from a socket without the interpreter (see cpu/recv.cpp).
#pragma once

#include <ATen/ATen.h>

namespace gear {

// Receives exactly out's bytes (a contiguous CPU tensor) from `fd`, blocking or not, waiting
// at most timeout_s for each chunk (negative: no limit). Returns the bytes received: all of
// them, fewer when the peer closed the connection, or -errno (-ETIMEDOUT after a wait that
// timed out). Python turns that into the socket error it would have raised.
int64_t recv_exact(int64_t fd, const at::Tensor& out, double timeout_s);

}  // namespace gear
