// Drains a controller's acks until `n` arrived or 60 s passed, sleeping on the controller's
// event signal between drains (as an engine's main loop does when a step can run nothing).
#pragma once

#include <chrono>
#include <vector>

#include "controller/hicache_controller.h"

namespace hicache {

inline std::vector<Ack> wait_acks(HiCacheController& c, bool write, std::size_t n) {
  std::vector<Ack> acks;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (true) {
    const std::uint64_t seen = c.events()->seq();  // before draining: no ack is missed
    write ? c.drain_write_acks(acks) : c.drain_load_acks(acks);
    if (acks.size() >= n || !c.events()->wait(seen, deadline)) break;
  }
  return acks;
}

}  // namespace hicache
