// The sidecar page lists HiRadixCache's API takes and gives (docs/hybrid.md): apart from the
// room that handles them (sidecar_units.h), so that the cache's public header names them
// without the tree's internals.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace hicache::radix {

// A sidecar pool's pages of an inserted sequence: `pages` are page indices of the tokens,
// ascending (an all_pages pool lists every page the tree does not hold yet), their device slots
// slots_per_page each, taken from the pool's device allocator.
struct SidecarInsert {
  std::int32_t pool = 0;
  std::span<const std::int64_t> pages;
  std::span<const std::int64_t> device_slots;
};

// One sidecar page on a path: its page index in the prefix and its device slots.
struct SidecarPageSlots {
  std::int64_t page = 0;
  std::vector<std::int64_t> device_slots;
};

}  // namespace hicache::radix
