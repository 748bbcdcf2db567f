// The shard protocol's framing as distributed/wire.py writes it, for the native ends of a connection:
// "<4sHHIQ" (magic, op, number of arrays, JSON bytes, array bytes), then the JSON, then u64 lengths.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <string_view>
#include <vector>

#include "net/python_names.h"

namespace gear {

// The wire's numbers, defined here once: distributed/wire.py reads them from the extension (`_C.wire`) and
// says what each op asks or answers (wire.Op).
constexpr char kWireMagic[] = "GEAR";  // a message's first 4 bytes
constexpr size_t kHeader = 20;         // "<4sHHIQ"
constexpr uint16_t kOk = 0;
constexpr uint16_t kError = 1;
constexpr uint16_t kSelect = 2;
constexpr uint16_t kRead = 3;
constexpr uint16_t kRelease = 4;
constexpr uint16_t kUpdate = 5;
constexpr uint16_t kDescribe = 6;
constexpr uint16_t kGiveBack = 7;
constexpr uint16_t kDump = 8;
constexpr uint16_t kLoad = 9;
constexpr uint16_t kSampleRows = 10;
constexpr uint16_t kRows = 11;
constexpr uint16_t kSampleWindows = 12;
constexpr uint16_t kWindows = 13;
constexpr uint16_t kSamplePrioritized = 14;
constexpr uint16_t kPrioritized = 15;
constexpr uint16_t kPostUpdate = 16;
constexpr uint16_t kInsert = 17;
constexpr uint16_t kHeld = 18;

// Limits checked before anything is allocated, so a peer cannot make the other side allocate or read out
// of bounds.
constexpr uint32_t kMaxMeta = 1u << 16;       // JSON bytes in one message
constexpr uint16_t kMaxArrays = 64;           // arrays in one message
constexpr uint64_t kMaxTotal = 1ull << 34;    // array bytes in one message (16 GiB)
constexpr int64_t kMaxReadPositions = 1 << 24;  // rows (window positions) in one READ or SAMPLE_* reply

// Python's names for the ops (`_C.wire.<name>`, wire.Op) and the limits (wire.MAX_*, bound in net/bindings.cpp).
inline constexpr PythonName<uint64_t> kWireOps[] = {
    {"OK", kOk},
    {"ERROR", kError},
    {"SELECT", kSelect},
    {"READ", kRead},
    {"RELEASE", kRelease},
    {"UPDATE", kUpdate},
    {"DESCRIBE", kDescribe},
    {"GIVE_BACK", kGiveBack},
    {"DUMP", kDump},
    {"LOAD", kLoad},
    {"SAMPLE_ROWS", kSampleRows},
    {"ROWS", kRows},
    {"SAMPLE_WINDOWS", kSampleWindows},
    {"WINDOWS", kWindows},
    {"SAMPLE_PRIORITIZED", kSamplePrioritized},
    {"PRIORITIZED", kPrioritized},
    {"POST_UPDATE", kPostUpdate},
    {"INSERT", kInsert},
    {"HELD", kHeld},
};
inline constexpr PythonName<uint64_t> kWireLimits[] = {
    {"HEADER_BYTES", kHeader},
    {"MAX_META_BYTES", kMaxMeta},
    {"MAX_ARRAYS", kMaxArrays},
    {"MAX_ARRAY_BYTES", kMaxTotal},
    {"MAX_READ_POSITIONS", static_cast<uint64_t>(kMaxReadPositions)},
};

// A little-endian field of a message, wherever it lies.
template <typename T>
T field(const void* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// A message's head as wire.header writes it (magic, op, number of arrays, JSON bytes, array bytes, the JSON,
// each array's length), written at `out`, which has room for it; returns its size. The arrays follow it.
inline size_t write_head(char* out, uint16_t op, std::string_view meta, const std::vector<uint64_t>& lengths) {
  const auto arrays = static_cast<uint16_t>(lengths.size());
  const auto meta_bytes = static_cast<uint32_t>(meta.size());
  const uint64_t total = std::accumulate(lengths.begin(), lengths.end(), uint64_t{0});
  std::memcpy(out, kWireMagic, 4);
  std::memcpy(out + 4, &op, 2);
  std::memcpy(out + 6, &arrays, 2);
  std::memcpy(out + 8, &meta_bytes, 4);
  std::memcpy(out + 12, &total, 8);
  std::memcpy(out + kHeader, meta.data(), meta.size());
  std::memcpy(out + kHeader + meta.size(), lengths.data(), 8 * lengths.size());
  return kHeader + meta.size() + 8 * lengths.size();
}

}  // namespace gear
