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
#include <mutex>
#include <optional>

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
      { std::lock_guard lock(mu_); }
      cv_.notify_all();
    }
  }

  // Waits until seq() differs from `seen`, or `deadline` passes; true when it moved on.
  bool wait(std::uint64_t seen, std::optional<Clock::time_point> deadline = std::nullopt) {
    std::unique_lock lock(mu_);
    waiters_.fetch_add(1);
    const auto moved = [&] { return seq_.load() != seen; };
    bool result;
    if (deadline) {
      result = cv_.wait_until(lock, *deadline, moved);
    } else {
      cv_.wait(lock, moved);
      result = true;
    }
    waiters_.fetch_sub(1);
    return result;
  }

 private:
  std::atomic<std::uint64_t> seq_{0};
  std::atomic<int> waiters_{0};
  std::mutex mu_;
  std::condition_variable cv_;
};

}  // namespace hicache
