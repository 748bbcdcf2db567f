// A batch's priority updates split by owner and framed as each owner's message, in one pass: no tensor op
// and no encode per owner (distributed/shard_owners.py ShardOwners.update).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <vector>

namespace gear {

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
