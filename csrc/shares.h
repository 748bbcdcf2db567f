// How a learner splits a batch across shards: each shard's share is a multinomial draw over the shards'
// masses, and each owner gets a seed for its own draw. Both come from the learner's generator, so a
// seeded learner gets the same batches; drawing them here is one call per batch, not a tensor op each.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <vector>

namespace gear {

struct Shares {
  std::vector<int64_t> counts;                 // per shard, summing to the batch (or all 0: no mass anywhere)
  std::optional<std::vector<int64_t>> seeds;   // per shard, in [0, 2^62); none without a generator
};

// `count` draws over shards of `masses` (finite, >= 0). One shard takes the whole batch without a draw.
// Without a generator the split draws from torch's default one, and the owners from their own.
Shares draw_shares(const std::vector<double>& masses, int64_t count, std::optional<at::Generator> generator);

// A batch's priority updates split by owner and framed as each owner's message, in one pass where each
// owner had cost the learner a dozen tensor ops and an encode (distributed/shard_set.py ShardSet.update).
enum UpdateRefusal : int64_t { kUpdateOk = 0, kBadPriority = 1, kBadRow = 2, kBadShard = 3 };

struct UpdateSplit {
  int64_t refused = kUpdateOk;
  int64_t at = -1;         // kBadPriority: the entry; kBadRow: the owner; kBadShard: the shard named
  int64_t lo = 0, hi = 0;  // kBadRow: that owner's smallest and largest row
  std::vector<int64_t> owners, counts;    // owners told, ascending, and how many entries each gets
  at::Tensor rows, priority, generation;  // the entries of those owners, grouped by owner in the batch's order
  std::vector<std::string> frames;        // each owner's message (`op`, `meta`: wire.encode's bytes)
};

// `rows` of `shards` (int64, the batch's order), float64 `priority` and optional int64 `generation`, one per
// row. `capacities[s]` bounds shard s's rows; -1 leaves its entries out (a skipped shard). Every check runs
// before anything is framed, in the order Python's refusals take: priorities, then each owner's rows, then
// shards past the store's. A stable sort keeps a repeated row's last priority last.
UpdateSplit split_updates(const at::Tensor& shards, const at::Tensor& rows, const at::Tensor& priority,
                          const std::optional<at::Tensor>& generation, const std::vector<int64_t>& capacities,
                          int64_t op, const std::string& meta);

}  // namespace gear
