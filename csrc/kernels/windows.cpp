#include "kernels/windows.h"

#include "kernels/trees.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace gear {
namespace {

bool int64_vector(const at::Tensor& t) {
  return t.device().is_cpu() && t.scalar_type() == at::kLong && t.dim() == 1 && t.is_contiguous();
}

void check_episodes(const at::Tensor& start, const at::Tensor& length) {
  TORCH_CHECK(int64_vector(start) && int64_vector(length),
              "windows: episode_start and episode_length must be contiguous 1-D int64 CPU tensors");
  TORCH_CHECK(start.numel() == length.numel(), "windows: episode_start and episode_length must be of one length");
}

void check_episode_args(const at::Tensor& start, const at::Tensor& length, const at::Tensor& slots,
                        const at::Tensor& per_window, at::ScalarType per_window_dtype, const char* per_window_name) {
  check_episodes(start, length);
  TORCH_CHECK(int64_vector(slots), "windows: slots must be a contiguous 1-D int64 CPU tensor");
  TORCH_CHECK(per_window.device().is_cpu() && per_window.scalar_type() == per_window_dtype && per_window.dim() == 1 &&
                  per_window.numel() == slots.numel(),
              "windows: ", per_window_name, " must be a 1-D ", c10::toString(per_window_dtype),
              " CPU tensor with one entry per slot");
}

// Where placed windows go: each one's start and valid range.
struct Into {
  int64_t *s, *b, *e;

  // Window i: position 0 is `first` steps into an episode starting at `start` of `length` steps.
  void set(int64_t i, int64_t start, int64_t length, int64_t first, int64_t window_len) const {
    s[i] = start + first;
    b[i] = std::min(std::max<int64_t>(-first, 0), window_len);
    e[i] = std::max(std::min(length - first, window_len), b[i]);
  }
};

// Placed windows in tensors of their own.
struct Placed : Into {
  at::Tensor starts, valid_begin, valid_end;
  explicit Placed(int64_t n)
      : starts(at::empty({n}, at::kLong)), valid_begin(at::empty({n}, at::kLong)), valid_end(at::empty({n}, at::kLong)) {
    s = starts.data_ptr<int64_t>();
    b = valid_begin.data_ptr<int64_t>();
    e = valid_end.data_ptr<int64_t>();
  }
  std::tuple<at::Tensor, at::Tensor, at::Tensor> done() { return {starts, valid_begin, valid_end}; }
};

int64_t checked_slot(const int64_t* slots, int64_t i, int64_t num_slots) {
  const int64_t slot = slots[i];
  TORCH_CHECK(slot >= 0 && slot < num_slots, "windows: slot ", slot, " out of range [0, ", num_slots, ")");
  return slot;
}

// A uniform window of each of `n` episode slots: u[i] in [0, 1) picks one of the episode's
// max(length - tail, 0) windows (see windows.h), into `out`.
void place_uniform(const at::Tensor& episode_start, const at::Tensor& episode_length, const int64_t* slot,
                   const double* u, int64_t n, int64_t window_len, int64_t burn_in, bool strict_length,
                   const Into& out) {
  TORCH_CHECK(window_len >= 1 && burn_in >= 0 && burn_in < window_len,
              "windows: need window_len >= 1 and 0 <= burn_in < window_len, got ", window_len, ", ", burn_in);
  const int64_t num_slots = episode_start.numel();
  const int64_t tail = strict_length ? window_len - 1 : 0;
  const int64_t shift = strict_length ? 0 : burn_in;  // padded windows may start burn_in steps early
  const int64_t *start = episode_start.data_ptr<int64_t>(), *length = episode_length.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t k = checked_slot(slot, i, num_slots);
    const int64_t choices = std::max<int64_t>(length[k] - tail, 0);
    // u * choices can round up to choices itself: clamp to the last window.
    const int64_t offset = std::min(static_cast<int64_t>(std::floor(u[i] * static_cast<double>(choices))), choices - 1);
    out.set(i, start[k], length[k], offset - shift, window_len);
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> place_windows(const at::Tensor& episode_start,
                                                             const at::Tensor& episode_length,
                                                             const at::Tensor& slots, const at::Tensor& first,
                                                             int64_t window_len) {
  check_episode_args(episode_start, episode_length, slots, first, at::kLong, "first");
  TORCH_CHECK(window_len >= 1, "windows: window_len must be >= 1, got ", window_len);
  const int64_t n = slots.numel(), num_slots = episode_start.numel();
  const int64_t *start = episode_start.data_ptr<int64_t>(), *length = episode_length.data_ptr<int64_t>();
  const int64_t *slot = slots.data_ptr<int64_t>(), *f = first.data_ptr<int64_t>();
  Placed out(n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t k = checked_slot(slot, i, num_slots);
    out.set(i, start[k], length[k], f[i], window_len);
  }
  return out.done();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> uniform_windows(const at::Tensor& episode_start,
                                                               const at::Tensor& episode_length,
                                                               const at::Tensor& slots, const at::Tensor& u,
                                                               int64_t window_len, int64_t burn_in,
                                                               bool strict_length) {
  check_episode_args(episode_start, episode_length, slots, u, at::kDouble, "u");
  Placed out(slots.numel());
  place_uniform(episode_start, episode_length, slots.data_ptr<int64_t>(), u.data_ptr<double>(), slots.numel(),
                window_len, burn_in, strict_length, out);
  return out.done();
}

void draw_windows_into(const at::Tensor& tree, const at::Tensor& episode_start, const at::Tensor& episode_length,
                       const double* u, int64_t n, int64_t window_len, int64_t burn_in, bool strict_length,
                       int64_t* starts, int64_t* valid_begin, int64_t* valid_end) {
  check_episodes(episode_start, episode_length);
  std::vector<int64_t> slots(static_cast<size_t>(n));
  sum_tree_pick_into(tree, u, slots.data(), n);
  place_uniform(episode_start, episode_length, slots.data(), u + n, n, window_len, burn_in, strict_length,
                Into{starts, valid_begin, valid_end});
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> draw_windows(const at::Tensor& tree, const at::Tensor& episode_start,
                                                            const at::Tensor& episode_length, const at::Tensor& u,
                                                            int64_t window_len, int64_t burn_in, bool strict_length) {
  TORCH_CHECK(u.device().is_cpu() && u.scalar_type() == at::kDouble && u.dim() == 2 && u.size(0) == 2 &&
                  u.is_contiguous(),
              "draw_windows: u must be a contiguous float64 CPU tensor of shape [2, W]");
  const int64_t n = u.size(1);
  Placed out(n);
  draw_windows_into(tree, episode_start, episode_length, u.data_ptr<double>(), n, window_len, burn_in, strict_length,
                    out.s, out.b, out.e);
  return out.done();
}

std::pair<int64_t, int64_t> LiveEpisodes::locate(int64_t row) const {
  const int64_t logical = ((row - first_start) % capacity + capacity) % capacity;
  const int64_t i = std::upper_bound(ends, ends + count, logical) - ends;  // searchsorted(right=True)
  if (i >= count) return {-1, 0};
  return {i, logical - (ends[i] - length[i])};
}

LiveEpisodes live_episodes(const LiveTensors& live, int64_t capacity) {
  const int64_t count = live.start.numel();
  TORCH_CHECK(int64_vector(live.start) && int64_vector(live.length) && int64_vector(live.ends) &&
                  live.length.numel() == count && live.ends.numel() == count,
              "live episodes: starts, lengths and ends are contiguous 1-D int64 CPU tensors of one size");
  TORCH_CHECK(live.closed.device().is_cpu() && live.closed.scalar_type() == at::kBool && live.closed.dim() == 1 &&
                  live.closed.is_contiguous() && live.closed.numel() == count,
              "live episodes: one closed flag each");
  TORCH_CHECK(capacity >= 1, "live episodes: a ring of at least one row");
  return {live.start.data_ptr<int64_t>(), live.length.data_ptr<int64_t>(), live.ends.data_ptr<int64_t>(),
          live.closed.data_ptr<bool>(),   count,                            live.first_start,
          capacity};
}

bool place_keyed_windows_into(const LiveEpisodes& live, const int64_t* keys, int64_t n, int64_t window_len,
                              int64_t burn_in, int64_t* starts, int64_t* valid_begin, int64_t* valid_end) {
  const Into out{starts, valid_begin, valid_end};
  for (int64_t i = 0; i < n; ++i) {
    const auto [episode, offset] = live.locate(keys[i]);
    if (episode < 0) return false;
    out.set(i, live.start[episode], live.length[episode], offset - burn_in, window_len);
  }
  return true;
}

at::Tensor window_rows(const at::Tensor& starts, int64_t window_len, int64_t capacity) {
  TORCH_CHECK(starts.device().is_cpu() && starts.scalar_type() == at::kLong && starts.dim() == 1,
              "window_rows: starts must be a 1-D int64 CPU tensor");
  TORCH_CHECK(window_len >= 1 && capacity >= 1, "window_rows: need window_len >= 1 and capacity >= 1, got ", window_len,
              ", ", capacity);
  const at::Tensor s = starts.contiguous();
  const int64_t n = s.numel();
  at::Tensor rows = at::empty({n * window_len}, at::kLong);
  const int64_t* sp = s.data_ptr<int64_t>();
  int64_t* out = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    int64_t row = sp[i] % capacity;
    if (row < 0) row += capacity;
    for (int64_t j = 0; j < window_len; ++j) {
      out[i * window_len + j] = row;
      if (++row == capacity) row = 0;
    }
  }
  return rows;
}

at::Tensor window_mask(const at::Tensor& valid_begin, const at::Tensor& valid_end, int64_t window_len) {
  TORCH_CHECK(window_len >= 1, "window_mask: window_len must be >= 1, got ", window_len);
  for (const at::Tensor* t : {&valid_begin, &valid_end}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kLong && t->dim() == 1,
                "window_mask: valid_begin and valid_end must be 1-D int64 CPU tensors");
  }
  TORCH_CHECK(valid_begin.numel() == valid_end.numel(), "window_mask: valid_begin and valid_end differ in length");
  const at::Tensor b = valid_begin.contiguous(), e = valid_end.contiguous();
  const int64_t n = b.numel();
  at::Tensor mask = at::zeros({n * window_len}, at::kBool);
  bool* m = mask.data_ptr<bool>();
  const int64_t *bp = b.data_ptr<int64_t>(), *ep = e.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t lo = std::min(std::max<int64_t>(bp[i], 0), window_len), hi = std::min(std::max(ep[i], lo), window_len);
    std::fill(m + i * window_len + lo, m + i * window_len + hi, true);
  }
  return mask;
}

namespace {

void check_window_tensors(const at::Tensor& starts, const at::Tensor& valid_begin, const at::Tensor& valid_end) {
  for (const at::Tensor* t : {&starts, &valid_begin, &valid_end}) {
    TORCH_CHECK_VALUE(t->device().is_cpu() && t->scalar_type() == at::kLong && t->dim() == 1 && t->is_contiguous(),
                      "windows: starts, valid_begin and valid_end must be contiguous 1-D int64 CPU tensors");
  }
  TORCH_CHECK_VALUE(starts.numel() == valid_begin.numel() && starts.numel() == valid_end.numel(),
                    "starts, valid_begin and valid_end differ in length");
}

}  // namespace

void check_windows(const at::Tensor& starts, const at::Tensor& valid_begin, const at::Tensor& valid_end,
                   int64_t window_len, int64_t capacity) {
  check_window_tensors(starts, valid_begin, valid_end);
  TORCH_CHECK_VALUE(window_len >= 1 && window_len <= capacity, "window_len ", window_len, " is outside [1, ", capacity, "]");
  const int64_t *s = starts.data_ptr<int64_t>(), *b = valid_begin.data_ptr<int64_t>(),
                *e = valid_end.data_ptr<int64_t>();
  for (int64_t i = 0; i < starts.numel(); ++i) {
    TORCH_CHECK_INDEX(s[i] >= 0 && s[i] < capacity, "row ", s[i], " is out of range for a shard of ", capacity,
                      " rows");
    TORCH_CHECK_INDEX(0 <= b[i] && b[i] <= e[i] && e[i] <= window_len,
                      "valid ranges must satisfy 0 <= valid_begin <= valid_end <= window_len (", window_len,
                      "); window ", i, " has [", b[i], ", ", e[i], ")");
  }
}

int64_t first_row_outside(const at::Tensor& starts, const at::Tensor& valid_begin, const at::Tensor& valid_end,
                          int64_t window_len, int64_t capacity, int64_t first, int64_t count) {
  check_window_tensors(starts, valid_begin, valid_end);
  TORCH_CHECK_VALUE(capacity >= 1 && first >= 0 && first < capacity && count >= 0,
                    "first_row_outside: need 0 <= first < capacity and count >= 0");
  if (count >= capacity) return -1;
  const int64_t *s = starts.data_ptr<int64_t>(), *b = valid_begin.data_ptr<int64_t>(),
                *e = valid_end.data_ptr<int64_t>();
  for (int64_t i = 0; i < starts.numel(); ++i) {
    for (int64_t j = b[i]; j < e[i]; ++j) {
      int64_t row = (s[i] + j) % capacity;
      if (row < 0) row += capacity;
      const int64_t from_first = row >= first ? row - first : row + capacity - first;
      if (from_first >= count) return row;
    }
  }
  return -1;
}

}  // namespace gear
