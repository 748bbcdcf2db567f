// How a learner splits a batch across shards: each shard's share is a multinomial draw over the shards'
// masses, and each owner gets a seed for its own draw. Both come from the learner's generator, so a
// seeded learner gets the same batches; drawing them here is one call per batch, not a tensor op each.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

namespace gear {

struct Shares {
  std::vector<int64_t> counts;                 // per shard, summing to the batch (or all 0: no mass anywhere)
  std::optional<std::vector<int64_t>> seeds;   // per shard, in [0, 2^62); none without a generator
};

// `count` draws over shards of `masses` (finite, >= 0). One shard takes the whole batch without a draw.
// Without a generator the split draws from torch's default one, and the owners from their own.
Shares draw_shares(const std::vector<double>& masses, int64_t count, std::optional<at::Generator> generator);

}  // namespace gear
