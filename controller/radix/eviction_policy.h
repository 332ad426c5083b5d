// EvictionPolicy: which unlocked node HiRadixCache's eviction takes first (the order itself is
// radix::EvictionOrder, eviction.h). Part of the radix cache's public configuration.
#pragma once

#include <string_view>

namespace hicache {

// Least recently used, or least frequently used (fewest hits, then least recently used), as
// SGLang's --radix-eviction-policy.
enum class EvictionPolicy { kLru, kLfu };
// "lru" or "lfu"; anything else throws InvalidArgument naming it and the valid ones.
EvictionPolicy parse_eviction_policy(std::string_view name);
std::string_view to_string(EvictionPolicy policy);

}  // namespace hicache
