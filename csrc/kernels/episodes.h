// Episode indices of rings of steps: one per column, updated for a write of time steps in one pass.
//
// Column e keeps its episodes by serial number: the live ones are [first[e], next[e]), episode
// `serial` held at slot serial mod S of the [E, S] records (start: ring row of its first live step,
// length, closed). Live episodes tile the column's stored steps in ring order, so the oldest steps
// a write overwrites are dropped by episode lengths alone, and the new steps split into episodes at
// their end flags: the first continues the column's open episode, if there is one.
#pragma once

#include <ATen/ATen.h>

namespace gear {

// Drop the `evicted` oldest steps of every column, then record `rows` (int64 [n], ring rows) as its
// newest steps, `ends` (bool [n, E]) flagging those that end an episode; new episodes are marked
// `dead` (a crashed writer's rows). Updates the records and serials in place and returns the slots
// that changed, as e * S + slot. Every column must have room for its live episodes, one per end flag
// before the last row and one more (checked first: a refused call changes nothing).
at::Tensor episodes_append(const at::Tensor& start, const at::Tensor& length, const at::Tensor& closed,
                           const at::Tensor& dead, const at::Tensor& first, const at::Tensor& next,
                           const at::Tensor& rows, const at::Tensor& ends, int64_t evicted, int64_t ring_rows,
                           bool dead_rows);

}  // namespace gear
