// A shared selection core's lock, one object that Python (selection/selector_registry.py, as a context
// manager) and the native owner (net/owner.cpp) both take: a native draw never sees a table that a
// learner's priority update, a checkpoint or a pick in Python has half changed.
#pragma once

#include <atomic>
#include <mutex>

namespace gear {

struct SelectorLock {
  std::mutex mutex;
  std::atomic<bool> held_by_python{false};  // a release without an acquire is refused, not undefined
};

}  // namespace gear
