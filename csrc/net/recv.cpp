// A batch arrives as a few large arrays. Receiving each in one C++ loop, with the GIL
// released throughout, spares the learner's threads a Python iteration, a GIL hand-off and
// a poll per chunk the kernel delivers (tens per MiB on loopback).
#include "net/recv.h"

#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <cmath>

namespace gear {

int64_t recv_exact(int64_t fd, const at::Tensor& out, double timeout_s) {
  TORCH_CHECK(out.device().is_cpu() && out.is_contiguous(), "recv_exact: needs a contiguous CPU tensor");
  char* p = static_cast<char*>(out.data_ptr());
  const int64_t n = out.numel() * static_cast<int64_t>(out.element_size());
  const int wait_ms = timeout_s < 0 ? -1 : static_cast<int>(std::ceil(timeout_s * 1000.0));
  int64_t got = 0;
  while (got < n) {
    const ssize_t k = ::recv(static_cast<int>(fd), p + got, static_cast<size_t>(n - got), MSG_DONTWAIT);
    if (k > 0) {
      got += k;
      continue;
    }
    if (k == 0) return got;  // the peer closed the connection
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return -errno;
    pollfd pfd{static_cast<int>(fd), POLLIN, 0};
    const int ready = ::poll(&pfd, 1, wait_ms);
    if (ready == 0) return -ETIMEDOUT;
    if (ready < 0 && errno != EINTR) return -errno;
  }
  return got;
}

}  // namespace gear
