// Packed sequences (gear_torchrl/selection/packed.py): spans of episodes, and their tokens laid end to end.
//
// With T = max_train training steps at most, an episode of L steps offers
// max(L - T + 1, 1) training spans of min(L, T) steps, at offsets 0, 1, ...;
// a sequence is a span with up to burn_in steps of its episode before it. One
// pass over the draws, and one over the pack's tokens, instead of a dozen tensor
// operations each: the sampler's fixed cost per pack.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace gear {

// Each sequence's window row of its first token (episode_start[slot] + offset - burn-in, not wrapped),
// its length (burn-in included), its burn-in and its first token's step in its episode: int64 [S] each.
using Sequences = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// The sequence whose training span starts `offset` steps (int64 [S]) into episode `slots`.
Sequences place_spans(const at::Tensor& episode_start, const at::Tensor& episode_length, const at::Tensor& slots,
                      const at::Tensor& offset, int64_t max_train, int64_t burn_in);

// A uniform span of each chosen episode: u in [0, 1) (float64 [S]) picks one of its spans.
Sequences uniform_spans(const at::Tensor& episode_start, const at::Tensor& episode_length, const at::Tensor& slots,
                        const at::Tensor& u, int64_t max_train, int64_t burn_in);

// The packing rule (next fit, the last sequence cut): sequences (first, length, burn_in, step: int64
// [S]) laid end to end in order into `budget` tokens; the first that does not fit is cut to the room
// left when that holds a trained step (more than its burn-in), else the room is padding; the rest are
// not used. Per token: its window row (modulo window_rows; 0 on padding), whether it holds data (int64
// 0/1), its position in its sequence and step in its episode (-1 on padding), whether it is trained
// (bool: not burn-in, not padding), its sequence (-1 on padding) and whether it ends its sequence.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> pack_tokens(
    const at::Tensor& first, const at::Tensor& length, const at::Tensor& burn_in, const at::Tensor& step,
    int64_t budget, int64_t window_rows);

}  // namespace gear
