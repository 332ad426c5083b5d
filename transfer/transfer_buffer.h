// TransferBuffer: a bounded FIFO between two pipeline stages of one controller (SGLang's
// TransferBuffer). Unlike OpQueue, which the engine's main loop feeds and which pushes back on
// it with a result when full (the main loop must never block), a producer thread here blocks
// while the buffer is full: the stage before waits for the stage after instead of dropping
// work. Both sides wake on work, on room and on stop, with no timed polling.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <optional>
#include <vector>

#include "transfer/errors.h"
#include "transfer/mutex.h"

namespace hicache {

template <typename T>
class TransferBuffer {
 public:
  // Throws InvalidArgument for a capacity of 0.
  explicit TransferBuffer(std::size_t capacity) : capacity_(capacity) {
    if (capacity == 0) throw InvalidArgument("TransferBuffer: capacity must be >= 1");
  }

  // Blocks while the buffer is full; false once stopped (`item` is then not moved from).
  bool put(T&& item) {
    UniqueLock lock(mu_);
    while (items_.size() >= capacity_ && !stopped_) mu_.wait(room_);
    if (stopped_) return false;
    items_.push_back(std::move(item));
    lock.unlock();
    work_.notify_one();
    return true;
  }

  // Without waiting: false when full or stopped (`item` is then not moved from). For a
  // producer that must not block (one a main loop may be waiting on).
  bool try_put(T&& item) {
    UniqueLock lock(mu_);
    if (stopped_ || items_.size() >= capacity_) return false;
    items_.push_back(std::move(item));
    lock.unlock();
    work_.notify_one();
    return true;
  }

  // Blocks until an item is there (returns it) or stop() is called (returns nothing; what is
  // left stays for drain()).
  std::optional<T> get() {
    UniqueLock lock(mu_);
    while (items_.empty() && !stopped_) mu_.wait(work_);
    if (stopped_) return std::nullopt;
    T item = take();
    lock.unlock();
    room_.notify_one();
    return item;
  }

  // The first item without waiting, or nothing when empty or stopped.
  std::optional<T> try_get() {
    UniqueLock lock(mu_);
    if (stopped_ || items_.empty()) return std::nullopt;
    T item = take();
    lock.unlock();
    room_.notify_one();
    return item;
  }

  // Wakes every waiter; put() returns false and get() nothing until reset().
  void stop() {
    {
      MutexLock lock(mu_);
      stopped_ = true;
    }
    work_.notify_all();
    room_.notify_all();
  }

  // Removes and returns every item, oldest first.
  std::vector<T> drain() {
    MutexLock lock(mu_);
    std::vector<T> out;
    out.reserve(items_.size());
    for (T& item : items_) out.push_back(std::move(item));
    items_.clear();
    room_.notify_all();
    return out;
  }

  // Clears stop; the buffer must be empty (drain() first).
  void reset() {
    MutexLock lock(mu_);
    if (!items_.empty()) throw StateError("TransferBuffer::reset: items left (drain first)");
    stopped_ = false;
  }

  std::size_t size() const {
    MutexLock lock(mu_);
    return items_.size();
  }
  std::size_t capacity() const { return capacity_; }

 private:
  // The oldest item, taken off; the caller then releases mu_ and notifies room_.
  T take() HICACHE_REQUIRES(mu_) {
    T item = std::move(items_.front());
    items_.pop_front();
    return item;
  }

  const std::size_t capacity_;
  mutable Mutex mu_;
  std::condition_variable work_, room_;
  std::deque<T> items_ HICACHE_GUARDED_BY(mu_);
  bool stopped_ HICACHE_GUARDED_BY(mu_) = false;
};

}  // namespace hicache
