// A batch's split across shards, drawn from the learner's torch generator (see shares.h).
#include "shares.h"

#include <ATen/CPUGeneratorImpl.h>

#include "framing.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>

namespace gear {
namespace {

constexpr int kSeedShift = 2;  // seeds are 62-bit: the wire's int64 with room to spare

// A uniform double in [0, 1) from the engine's top 53 bits.
double uniform(at::CPUGeneratorImpl* engine) {
  return static_cast<double>(engine->random64() >> 11) * 0x1.0p-53;
}

// Cumulative masses padded with +inf to a power of two, searched without branches: a batch's draws land on
// shards at random, so a search that branches mispredicts about once per level, and that dominated the split.
class Buckets {
 public:
  explicit Buckets(const std::vector<double>& masses) : masses_(masses) {
    size_t width = 1;
    while (width < masses.size()) width <<= 1;
    cumulative_.assign(width, std::numeric_limits<double>::infinity());
    double total = 0;
    for (size_t i = 0; i < masses.size(); ++i) cumulative_[i] = total += masses[i];
    total_ = total;
  }

  double total() const { return total_; }

  // The shard a draw at `target` in [0, total) falls in: the first whose cumulative mass exceeds it. Rounding
  // at the very top lands on the last shard that has mass.
  size_t at(double target) const {
    size_t below = 0;  // shards whose cumulative mass is at most `target`
    for (size_t step = cumulative_.size() >> 1; step > 0; step >>= 1) {
      below += cumulative_[below + step - 1] <= target ? step : 0;
    }
    below += cumulative_[below] <= target ? 1 : 0;  // the last level (below < width here)
    if (below < masses_.size()) return below;
    size_t i = masses_.size() - 1;
    while (masses_[i] <= 0) --i;
    return i;
  }

 private:
  const std::vector<double>& masses_;
  std::vector<double> cumulative_;
  double total_ = 0;
};

}  // namespace

Shares draw_shares(const std::vector<double>& masses, int64_t count, std::optional<at::Generator> generator) {
  TORCH_CHECK_VALUE(!masses.empty(), "draw_shares: no shards to split a batch across");
  TORCH_CHECK_VALUE(count >= 0, "draw_shares: a negative batch size, ", count);
  for (const double m : masses) {
    TORCH_CHECK_VALUE(std::isfinite(m) && m >= 0, "draw_shares: a shard reported a mass of ", m,
                      "; masses must be finite and >= 0");
  }
  at::Generator engine_of = generator ? *generator : at::detail::getDefaultCPUGenerator();
  TORCH_CHECK_VALUE(engine_of.device().is_cpu(), "draw_shares: a sharded store draws on the CPU: give the buffer a "
                    "CPU generator (rb.set_rng)");
  auto* engine = at::check_generator<at::CPUGeneratorImpl>(engine_of);
  std::lock_guard<std::mutex> lock(engine_of.mutex());

  Shares shares{std::vector<int64_t>(masses.size(), 0), std::nullopt};
  const Buckets buckets(masses);
  const double total = buckets.total();
  if (masses.size() == 1) {
    shares.counts[0] = total > 0 ? count : 0;
  } else if (total > 0) {
    for (int64_t k = 0; k < count; ++k) ++shares.counts[buckets.at(uniform(engine) * total)];
  }
  if (generator) {
    shares.seeds.emplace(masses.size());
    for (int64_t& seed : *shares.seeds) seed = static_cast<int64_t>(engine->random64() >> kSeedShift);
  }
  return shares;
}

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
