// A batch's split across shards, drawn from the learner's torch generator (see shares.h).
#include "kernels/shares.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cmath>
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

}  // namespace gear
