// The shard protocol's framing as distributed/wire.py writes it, for the native ends of a connection:
// "<4sHHIQ" (magic, op, number of arrays, JSON bytes, array bytes), then the JSON, then u64 lengths.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace gear {

constexpr size_t kHeader = 20;
constexpr uint16_t kOk = 0;
constexpr uint16_t kSampleRows = 10;
constexpr uint16_t kRows = 11;
constexpr uint16_t kSampleWindows = 12;
constexpr uint16_t kWindows = 13;
constexpr uint16_t kSamplePrioritized = 14;
constexpr uint16_t kPrioritized = 15;
constexpr uint16_t kPostUpdate = 16;
constexpr uint32_t kMaxMeta = 1u << 16;
constexpr uint16_t kMaxArrays = 64;
constexpr uint64_t kMaxTotal = 1ull << 34;

// A little-endian field of a message, wherever it lies.
template <typename T>
T field(const void* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

}  // namespace gear
