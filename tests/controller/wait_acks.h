// Drains a controller's acks until `n` arrived or 60 s passed (tests only: an engine's main loop
// never waits on acks, it drains what is there each step).
#pragma once

#include <chrono>
#include <thread>
#include <vector>

#include "controller/hicache_controller.h"

namespace hicache {

inline std::vector<Ack> wait_acks(HiCacheController& c, bool write, std::size_t n) {
  std::vector<Ack> acks;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (acks.size() < n && std::chrono::steady_clock::now() < deadline) {
    write ? c.drain_write_acks(acks) : c.drain_load_acks(acks);
    std::this_thread::yield();
  }
  return acks;
}

}  // namespace hicache
