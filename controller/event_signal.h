// EventSignal: lets the engine's main loop sleep until something it waits for happens (an ack
// queued by a controller thread, a prefetch changing stage) instead of spinning on its queues.
//
// A sequence number that producers bump. The consumer reads seq() before it looks at its queues
// and, finding nothing to do, waits for the number to move on: whatever was queued after the read
// has bumped it, so no wake-up is lost. notify() costs an atomic increment, plus a lock and a
// condition-variable signal only while someone waits.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <optional>

#include "transfer/mutex.h"

namespace hicache {

class EventSignal {
 public:
  using Clock = std::chrono::steady_clock;

  std::uint64_t seq() const { return seq_.load(); }

  void notify() {
    seq_.fetch_add(1);
    if (waiters_.load() > 0) {
      // Under the lock: a waiter between its check and its wait holds it, so it is either past
      // the check (it saw the new number) or asleep on the condition variable (it is woken).
      { MutexLock lock(mu_); }
      cv_.notify_all();
    }
  }

  // Waits until seq() differs from `seen`, or `deadline` passes; true when it moved on.
  bool wait(std::uint64_t seen, std::optional<Clock::time_point> deadline = std::nullopt) {
    MutexLock lock(mu_);
    waiters_.fetch_add(1);
    bool moved = seq_.load() != seen;
    while (!moved) {
      if (!deadline) {
        mu_.wait(cv_);
      } else if (mu_.wait_until(cv_, *deadline) == std::cv_status::timeout) {
        moved = seq_.load() != seen;
        break;
      }
      moved = seq_.load() != seen;
    }
    waiters_.fetch_sub(1);
    return moved;
  }

 private:
  std::atomic<std::uint64_t> seq_{0};
  std::atomic<int> waiters_{0};
  // Guards no member: notify() takes it so that a waiter between its check and its wait cannot
  // miss the signal (seq_ and waiters_ are atomics).
  Mutex mu_;
  std::condition_variable cv_;
};

}  // namespace hicache
