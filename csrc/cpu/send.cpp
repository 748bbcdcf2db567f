// Rows of windows straight from the ring's columns to a socket (writev): the kernel copies each
// byte once, from where it lies, instead of after a gather into a staging batch. This is what
// lets the tcp transport run near the loopback limit on a CPU with few cores.
#include "send.h"

#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

namespace gear {
namespace {

constexpr size_t kMaxIov = 1024;  // IOV_MAX on Linux
// Rows smaller than this are copied into one staging range first: a range per tiny row (a done
// flag is one byte) costs the kernel more than the copy does.
constexpr size_t kStageBelow = 512;
alignas(64) const char kZeros[1 << 16] = {};

// Collects byte ranges and writes them in writev calls of up to kMaxIov ranges.
class IovSender {
 public:
  explicit IovSender(int fd) : fd_(fd) { iov_.reserve(kMaxIov); }

  void bytes(const char* p, size_t n) {
    if (n == 0) return;
    if (!iov_.empty() && iov_.back().iov_base != kZeros &&
        static_cast<const char*>(iov_.back().iov_base) + iov_.back().iov_len == p) {
      iov_.back().iov_len += n;  // adjacent rows: one range
      return;
    }
    push(p, n);
  }

  void zeros(size_t n) {
    while (n > 0) {
      const size_t k = std::min(n, sizeof(kZeros));
      push(kZeros, k);
      n -= k;
    }
  }

  void flush() {
    size_t i = 0;
    while (i < iov_.size()) {
      const ssize_t written = ::writev(fd_, &iov_[i], static_cast<int>(std::min(kMaxIov, iov_.size() - i)));
      if (written < 0) {
        if (errno == EINTR) continue;
        TORCH_CHECK(false, "sending rows failed: ", std::strerror(errno));
      }
      size_t left = static_cast<size_t>(written);
      while (left > 0) {  // a partial write: skip what went out
        if (left >= iov_[i].iov_len) {
          left -= iov_[i].iov_len;
          ++i;
        } else {
          iov_[i].iov_base = static_cast<char*>(iov_[i].iov_base) + left;
          iov_[i].iov_len -= left;
          left = 0;
        }
      }
    }
    iov_.clear();
  }

 private:
  void push(const char* p, size_t n) {
    iov_.push_back({const_cast<char*>(p), n});
    if (iov_.size() == kMaxIov) flush();
  }

  int fd_;
  std::vector<iovec> iov_;
};

}  // namespace

void send_windows(int64_t fd, const std::vector<at::Tensor>& columns, const at::Tensor& starts,
                  const at::Tensor& valid_begin, const at::Tensor& valid_end, int64_t seq_len) {
  TORCH_CHECK(!columns.empty(), "send_windows: no columns");
  TORCH_CHECK(seq_len >= 1, "send_windows: seq_len must be >= 1");
  for (const at::Tensor* t : {&starts, &valid_begin, &valid_end}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kLong && t->is_contiguous() &&
                    t->numel() == starts.numel(),
                "send_windows: starts, valid_begin and valid_end must be contiguous CPU int64 of one length");
  }
  const int64_t capacity = columns.front().size(0);
  TORCH_CHECK(capacity > 0, "send_windows: empty columns");
  for (const auto& col : columns) {
    TORCH_CHECK(col.device().is_cpu() && col.is_contiguous() && col.size(0) == capacity,
                "send_windows: columns must be contiguous CPU tensors with one row count");
  }
  const int64_t* start = starts.data_ptr<int64_t>();
  const int64_t* begin = valid_begin.data_ptr<int64_t>();
  const int64_t* end = valid_end.data_ptr<int64_t>();
  const int64_t windows = starts.numel();
  for (int64_t w = 0; w < windows; ++w) {
    TORCH_CHECK(0 <= begin[w] && begin[w] <= end[w] && end[w] <= seq_len,
                "send_windows: window ", w, " has valid range [", begin[w], ", ", end[w], ") outside [0, ", seq_len, ")");
  }
  IovSender sender(static_cast<int>(fd));
  std::vector<std::vector<char>> staged;  // alive until the last writev
  for (const auto& col : columns) {
    const char* base = static_cast<const char*>(col.data_ptr());
    const size_t row_bytes = static_cast<size_t>(col.numel() / capacity) * col.element_size();
    const bool stage = row_bytes < kStageBelow;
    if (stage) staged.emplace_back(static_cast<size_t>(windows * seq_len) * row_bytes, 0);
    char* stage_at = stage ? staged.back().data() : nullptr;
    for (int64_t w = 0; w < windows; ++w) {
      if (stage) stage_at += static_cast<size_t>(begin[w]) * row_bytes;
      else sender.zeros(static_cast<size_t>(begin[w]) * row_bytes);
      int64_t p = begin[w];
      while (p < end[w]) {  // a run of ring rows, split where it wraps
        const int64_t row = ((start[w] + p) % capacity + capacity) % capacity;
        const int64_t run = std::min(end[w] - p, capacity - row);
        const size_t n = static_cast<size_t>(run) * row_bytes;
        if (stage) {
          std::memcpy(stage_at, base + static_cast<size_t>(row) * row_bytes, n);
          stage_at += n;
        } else {
          sender.bytes(base + static_cast<size_t>(row) * row_bytes, n);
        }
        p += run;
      }
      if (stage) stage_at += static_cast<size_t>(seq_len - end[w]) * row_bytes;
      else sender.zeros(static_cast<size_t>(seq_len - end[w]) * row_bytes);
    }
    if (stage) sender.bytes(staged.back().data(), staged.back().size());
  }
  sender.flush();
}

}  // namespace gear
