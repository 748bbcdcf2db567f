// The words of a shared store's control segment, defined here once: store/commit_log.py lays the segment
// out with them (it reads them from the extension, `_C.control`), and the native owner (owner.cpp) reads
// the store through them. The control segment is a page of int64 words: the header, then the records and
// the reader slots, which commit_log places.
#pragma once

#include <cstdint>

#include "net/python_names.h"

namespace gear::control {

// The header's words (what each holds: store/commit_log.py).
constexpr int64_t kMagicWord = 0, kCapacity = 2, kOwner = 3, kState = 4;
constexpr int64_t kReserved = 5, kPublished = 6, kNextSeq = 7, kPublishedSeq = 8, kEpoch = 9;
constexpr int64_t kInserts = 10, kSpecLen = 12, kRecords = 13, kReaders = 14, kFloor = 15;
constexpr int64_t kEvicted = 17, kEvictEpoch = 18;  // rows below EVICTED - capacity are gone, since that epoch
constexpr int64_t kReaderTimeoutUs = 19;  // how long a writer waits for a reader before revoking its read
constexpr int64_t kLayoutVersion = 20;    // bumped each time the columns' layout grows (0: none yet)
constexpr int64_t kDeadEnd = 21;  // the end of the newest run a dead writer left: readable rows above it are whole

// A reader slot's words, and how many there are.
constexpr int64_t kSlotPid = 0, kSlotEpoch = 1, kSlotRevoked = 2, kSlotLongerUs = 3;
constexpr int64_t kSlotWords = 4;

// The store's states (the header's kState word); the janitor (store/janitor.py) is handed these on its
// command line, as it runs without torch.
constexpr int64_t kOpen = 0, kClosed = 1, kOwnerDied = 2;

// Python's names for them: `_C.control.<name>` (bound in net/bindings.cpp).
inline constexpr PythonName<int64_t> kPythonNames[] = {
    {"H_MAGIC", kMagicWord},
    {"H_CAPACITY", kCapacity},
    {"H_OWNER", kOwner},
    {"H_STATE", kState},
    {"H_RESERVED", kReserved},
    {"H_PUBLISHED", kPublished},
    {"H_NEXT_SEQ", kNextSeq},
    {"H_PUBLISHED_SEQ", kPublishedSeq},
    {"H_EPOCH", kEpoch},
    {"H_INSERTS", kInserts},
    {"H_SPEC_LEN", kSpecLen},
    {"H_RECORDS", kRecords},
    {"H_READERS", kReaders},
    {"H_FLOOR", kFloor},
    {"H_EVICTED", kEvicted},
    {"H_EVICT_EPOCH", kEvictEpoch},
    {"H_READER_TIMEOUT_US", kReaderTimeoutUs},
    {"H_LAYOUT_VERSION", kLayoutVersion},
    {"H_DEAD_END", kDeadEnd},
    {"SLOT_PID", kSlotPid},
    {"SLOT_EPOCH", kSlotEpoch},
    {"SLOT_REVOKED", kSlotRevoked},
    {"SLOT_LONGER_US", kSlotLongerUs},
    {"SLOT_WORDS", kSlotWords},
    {"OPEN", kOpen},
    {"CLOSED", kClosed},
    {"OWNER_DIED", kOwnerDied},
};

}  // namespace gear::control
