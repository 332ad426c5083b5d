// SlotArena: recycled slot lists for the controller's ops, so that queuing a write or a load
// does not allocate once the arena is warm (the reference concatenates index tensors for every
// op). The main loop takes lists when it queues an op; the write and load threads give them
// back when the op is done, through a lock-free queue (moodycamel) between them. At most
// `max_lists` are kept; more are freed, so a burst does not pin memory for good.
#pragma once

#include <concurrentqueue/concurrentqueue.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "transfer/cache_operation.h"

namespace hicache {

class SlotArena {
 public:
  explicit SlotArena(std::size_t max_lists = 1024) : max_lists_(max_lists) {}

  // An empty list, with the capacity it had when given back (none when the arena is empty).
  std::vector<std::int64_t> take() {
    std::vector<std::int64_t> list;
    if (free_.try_dequeue(list)) --pooled_;
    list.clear();
    return list;
  }

  // Lists longer than kMaxKeptCapacity (a merged batch) are freed, so the arena does not keep
  // max_lists batch-sized lists for one-page ops.
  static constexpr std::size_t kMaxKeptCapacity = 4096;

  void give(std::vector<std::int64_t>&& list) {
    if (list.capacity() == 0 || list.capacity() > kMaxKeptCapacity ||
        pooled_.load(std::memory_order_relaxed) >= max_lists_) {
      return;
    }
    ++pooled_;
    free_.enqueue(std::move(list));
  }

  // The op's three lists.
  void give(CacheOperation&& op) {
    give(std::move(op.host_slots));
    give(std::move(op.device_slots));
    give(std::move(op.node_ids));
  }

  std::size_t pooled() const { return pooled_.load(); }

 private:
  const std::size_t max_lists_;
  std::atomic<std::size_t> pooled_{0};
  moodycamel::ConcurrentQueue<std::vector<std::int64_t>> free_;
};

}  // namespace hicache
