// Draining an acknowledgement queue (moodycamel) into a caller's vector without blocking: how
// every controller hands results to the engine's main loop.
#pragma once

#include <concurrentqueue/concurrentqueue.h>

#include <cstddef>
#include <utility>
#include <vector>

namespace hicache {

// Appends everything queued now to `out`; returns how many.
template <typename T>
std::size_t drain_queue(moodycamel::ConcurrentQueue<T>& queue, std::vector<T>& out) {
  T item{};
  std::size_t n = 0;
  while (queue.try_dequeue(item)) {
    out.push_back(std::move(item));
    ++n;
  }
  return n;
}

}  // namespace hicache
