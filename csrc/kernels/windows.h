// Window geometry for sequence sampling: where each drawn window sits in the ring.
//
// A window is window_len steps whose position 0 is `first` steps after its
// episode's first step (negative: it starts before the episode, head padding).
// Positions outside the episode are padding: valid positions are
// [valid_begin, valid_end). One pass over the batch instead of a dozen tensor
// operations, the sampler's fixed cost per batch.
#pragma once

#include <ATen/ATen.h>

#include <tuple>
#include <utility>

namespace gear {

// For episode slots and window positions `first` (int64 [W]): the ring row of each
// window's position 0 (episode_start[slot] + first, not wrapped), valid_begin and valid_end.
std::tuple<at::Tensor, at::Tensor, at::Tensor> place_windows(const at::Tensor& episode_start,
                                                             const at::Tensor& episode_length,
                                                             const at::Tensor& slots, const at::Tensor& first,
                                                             int64_t window_len);

// A uniform window of each chosen episode: u in [0, 1) (float64 [W]) picks one of the
// episode's max(length - tail, 0) windows, tail = window_len - 1 when windows must fit
// inside the episode, else 0 (windows start at every step, burn_in before it padded).
std::tuple<at::Tensor, at::Tensor, at::Tensor> uniform_windows(const at::Tensor& episode_start,
                                                               const at::Tensor& episode_length,
                                                               const at::Tensor& slots, const at::Tensor& u,
                                                               int64_t window_len, int64_t burn_in,
                                                               bool strict_length);

// WindowSelector's draw (selection/windows.py), which an owner repeats for a request (net/owner.cpp): episode
// slots by the masses of the sum tree `tree` (u[0] times its total), then a uniform window of each (u[1]).
// u: float64 [2, W] in [0, 1).
std::tuple<at::Tensor, at::Tensor, at::Tensor> draw_windows(const at::Tensor& tree, const at::Tensor& episode_start,
                                                            const at::Tensor& episode_length, const at::Tensor& u,
                                                            int64_t window_len, int64_t burn_in, bool strict_length);

// draw_windows over raw arrays, with no tensor made (a native owner's small answers): `u` holds the 2 * n
// uniforms (n to pick episodes, then n to place a window in each); starts, valid_begin and valid_end get n
// each, starts not wrapped.
void draw_windows_into(const at::Tensor& tree, const at::Tensor& episode_start, const at::Tensor& episode_length,
                       const double* u, int64_t n, int64_t window_len, int64_t burn_in, bool strict_length,
                       int64_t* starts, int64_t* valid_begin, int64_t* valid_end);

// A shard's live episodes as EpisodeIndex.locate searches them (store/episodes.py): oldest first, their
// starts, lengths, closed flags and lengths' running sums `ends`, the oldest starting at ring row `first_start`.
// Live episodes tile the stored rows in ring order, so a row's episode is a binary search away.
struct LiveEpisodes {
  const int64_t *start, *length, *ends;
  const bool* closed;
  int64_t count, first_start, capacity;

  // The live episode holding ring row `row` (-1: none) and the row's offset in it, as locate finds them.
  std::pair<int64_t, int64_t> locate(int64_t row) const;
};

// The same live episodes as tensors (EpisodeIndex.located): int64 starts, lengths and running ends, bool closed.
struct LiveTensors {
  at::Tensor start, length, ends, closed;
  int64_t first_start;
};

// `live`'s arrays, checked (contiguous CPU vectors of one size), over a ring of `capacity` rows.
LiveEpisodes live_episodes(const LiveTensors& live, int64_t capacity);

// PriorityWindowSelector's windows after its draw (selection/priority_windows.py): each of the `n` key rows
// located in `live` and its window placed with the key `burn_in` steps in, starts not wrapped. False when a key
// lies in no live episode (the keys were derived from other episodes): nothing may be drawn from them.
bool place_keyed_windows_into(const LiveEpisodes& live, const int64_t* keys, int64_t n, int64_t window_len,
                              int64_t burn_in, int64_t* starts, int64_t* valid_begin, int64_t* valid_end);

// Flat ring rows of every position of every window: (starts[i] mod capacity + j) mod capacity,
// int64 [W * window_len].
at::Tensor window_rows(const at::Tensor& starts, int64_t window_len, int64_t capacity);

// Which positions of each window hold data: j in [valid_begin[i], valid_end[i]), bool [W * window_len].
at::Tensor window_mask(const at::Tensor& valid_begin, const at::Tensor& valid_end, int64_t window_len);

// A request's windows against a ring of `capacity` rows: same lengths, starts in
// [0, capacity), 0 <= valid_begin <= valid_end <= window_len. Throws IndexError or
// ValueError naming the first bad window (a remote learner's request: nothing trusted).
void check_windows(const at::Tensor& starts, const at::Tensor& valid_begin, const at::Tensor& valid_end,
                   int64_t window_len, int64_t capacity);

// The first ring row at a valid position of the windows outside the ring interval of `count`
// rows from row `first` (count >= capacity: the whole ring), or -1 when every row is inside.
// What a store can read is such an interval, so this is a readability check per row in one pass.
int64_t first_row_outside(const at::Tensor& starts, const at::Tensor& valid_begin, const at::Tensor& valid_end,
                          int64_t window_len, int64_t capacity, int64_t first, int64_t count);

}  // namespace gear
