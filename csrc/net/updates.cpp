// A batch's priority updates split by owner and framed as each owner's message (see updates.h).
#include "net/updates.h"

#include "net/framing.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace gear {

UpdateSplit split_updates(const at::Tensor& shards, const at::Tensor& rows, const at::Tensor& priority,
                          const std::optional<at::Tensor>& generation, const std::vector<int64_t>& capacities,
                          int64_t op, const std::string& meta) {
  const int64_t n = rows.numel();
  TORCH_CHECK(shards.scalar_type() == at::kLong && rows.scalar_type() == at::kLong && shards.numel() == n &&
                  priority.scalar_type() == at::kDouble && priority.numel() == n && shards.is_cpu() && rows.is_cpu() &&
                  priority.is_cpu(),
              "split_updates: int64 shards and rows, and float64 priorities, one each per entry, on the CPU");
  TORCH_CHECK(!generation || (generation->scalar_type() == at::kLong && generation->numel() == n),
              "split_updates: one int64 generation per entry");
  TORCH_CHECK(op >= 0 && op <= 0xffff && meta.size() <= kMaxMeta, "split_updates: bad op or metadata");
  const at::Tensor s = shards.contiguous(), r = rows.contiguous(), p = priority.contiguous();
  const int64_t *sp = s.data_ptr<int64_t>(), *rp = r.data_ptr<int64_t>();
  const double* pp = p.data_ptr<double>();
  UpdateSplit out;
  for (int64_t i = 0; i < n; ++i) {
    if (!(std::isfinite(pp[i]) && pp[i] >= 0)) {
      out.refused = kBadPriority;
      out.at = i;
      return out;
    }
  }
  const auto num_shards = static_cast<int64_t>(capacities.size());
  std::vector<int64_t> count(capacities.size(), 0), lo(capacities.size(), std::numeric_limits<int64_t>::max()),
      hi(capacities.size(), std::numeric_limits<int64_t>::min());
  int64_t past = -1;  // the smallest shard named past the store's
  for (int64_t i = 0; i < n; ++i) {
    const int64_t shard = sp[i];
    if (shard < 0 || shard >= num_shards) {
      past = past < 0 ? shard : std::min(past, shard);
      continue;
    }
    ++count[shard];
    lo[shard] = std::min(lo[shard], rp[i]);
    hi[shard] = std::max(hi[shard], rp[i]);
  }
  for (int64_t shard = 0; shard < num_shards; ++shard) {
    if (count[shard] && capacities[shard] >= 0 && (lo[shard] < -1 || hi[shard] >= capacities[shard])) {
      out.refused = kBadRow;
      out.at = shard;
      out.lo = lo[shard];
      out.hi = hi[shard];
      return out;
    }
  }
  if (past >= 0) {
    out.refused = kBadShard;
    out.at = past;
    return out;
  }
  // Where each owner's entries start in the grouped tensors, then a stable pass that places them.
  std::vector<int64_t> start(capacities.size(), 0);
  int64_t told = 0;
  for (int64_t shard = 0; shard < num_shards; ++shard) {
    if (!count[shard] || capacities[shard] < 0) continue;
    out.owners.push_back(shard);
    out.counts.push_back(count[shard]);
    start[shard] = told;
    told += count[shard];
  }
  out.rows = at::empty({told}, at::kLong);
  out.priority = at::empty({told}, at::kDouble);
  int64_t* ro = out.rows.data_ptr<int64_t>();
  double* po = out.priority.data_ptr<double>();
  const at::Tensor g = generation ? generation->contiguous() : at::Tensor();
  const int64_t* gp = generation ? g.data_ptr<int64_t>() : nullptr;
  int64_t* go = nullptr;
  if (generation) {
    out.generation = at::empty({told}, at::kLong);
    go = out.generation.data_ptr<int64_t>();
  }
  std::vector<int64_t> next = start;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t shard = sp[i];
    if (shard < 0 || shard >= num_shards || capacities[shard] < 0) continue;
    const int64_t k = next[shard]++;
    ro[k] = rp[i];
    po[k] = pp[i];
    if (go) go[k] = gp[i];
  }
  // wire.header's layout: magic, op, three arrays, the JSON, their lengths, then the arrays' bytes.
  for (size_t o = 0; o < out.owners.size(); ++o) {
    const int64_t first = start[out.owners[o]];
    const uint64_t bytes = 8 * static_cast<uint64_t>(out.counts[o]);
    const std::vector<uint64_t> lengths{bytes, bytes, go ? bytes : 0};
    std::string frame(kHeader + meta.size() + 24 + lengths[0] + lengths[1] + lengths[2], '\0');
    char* f = frame.data() + write_head(frame.data(), static_cast<uint16_t>(op), meta, lengths);
    std::memcpy(f, ro + first, lengths[0]);
    std::memcpy(f + lengths[0], po + first, lengths[1]);
    if (go) std::memcpy(f + lengths[0] + lengths[1], go + first, lengths[2]);
    out.frames.push_back(std::move(frame));
  }
  return out;
}

}  // namespace gear
