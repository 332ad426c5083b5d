// radix::SidecarUnits: HiRadixCache's room for a hybrid model's sidecar pages (docs/hybrid.md),
// what the tree knows of them beside the KV: which of a node's pages each sidecar pool holds
// (Node::sidecars), the check and the adoption of an insert's sidecar pages, their division in
// a split, which prefix of a match every pool can restore, and the observations (the device
// slots of a pool's pages on a path, the slots the tree holds, the invariants). Moving the
// pages between the tiers is the tier policy's (tier_policy.h), in the KV's own ops.
//
// Not thread-safe: the engine's main loop owns it.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "controller/hicache_controller.h"
#include "controller/storage_controller.h"
#include "controller/radix/sidecar_types.h"
#include "controller/radix/node.h"
#include "controller/radix/tree.h"

namespace hicache::radix {

class SidecarUnits {
 public:
  // The controller's sidecar pools are the cache's. Both outlive this object.
  SidecarUnits(HiCacheController& controller, const Tree& tree)
      : controller_(controller), tree_(tree) {}

  // The cache has sidecar pools.
  bool on() const { return controller_.num_sidecars() > 0; }

  // insert()'s check of `sidecars` for a sequence of `pages` pages whose first `cached_pages`
  // the tree holds. Throws InvalidArgument naming the pool and the page or count: a pool that
  // does not exist or is given twice, pages out of order or outside the sequence, slots that do
  // not match or are not whole pages of the pool, an all_pages pool without a page the tree does
  // not hold yet.
  void check_insert(std::span<const SidecarInsert> sidecars, std::int64_t pages,
                    std::int64_t cached_pages) const;
  // Gives `leaf` (the new part of an insert, from the sequence's page `first_page`) the pages of
  // `sidecars` it covers, their device slots and their bytes (Node::sidecar_bytes); those of
  // earlier pages stay the caller's.
  void adopt(Node* leaf, std::span<const SidecarInsert> sidecars, std::int64_t first_page) const;
  // A host-only `node` (starting at the prefetch's page `first_page`) takes the pages of
  // `fetched` (StorageController's result: prefetch page indices, host slots) inside its range
  // that it does not hold, their host slots and bytes; they leave `fetched`. The rest stay the
  // caller's.
  void adopt_host(Node* node, std::vector<SidecarPagesIo>& fetched, std::int64_t first_page) const;
  // A split: `upper` (the first `upper_pages` pages of `node`'s key) takes their sidecar pages,
  // slots on every tier and bytes; `node` keeps the rest, its page offsets shifted.
  void split(Node* node, Node* upper, std::int64_t upper_pages) const;

  // For a match of `pages` pages ending at `end`, the first `device_pages` of them on the device:
  // the longest prefix every pool can restore, and the longest one within the device part.
  struct Restorable {
    std::int64_t all = 0, on_device = 0;
  };
  Restorable restorable(const Node* end, std::int64_t pages, std::int64_t device_pages) const;

  // The pages of pool `pool` that the path from the root to `node` holds on the device, page
  // indices ascending. Throws InvalidArgument for a pool that does not exist.
  std::vector<SidecarPageSlots> device_slots(const Node* node, std::int32_t pool) const;
  // The slots of pool `pool` the tree holds: {on the device, on the host} (a walk of the tree).
  std::pair<std::int64_t, std::int64_t> slots_held(std::int32_t pool) const;
  // Empty when `n`'s sidecar pages are consistent (each pool once, pages in order inside the
  // node, slots on exactly the KV's tiers), else the problem.
  std::string check(const Node& n) const;
  // Every sidecar pool's pages free again (HiRadixCache::reset, after the controller stopped).
  void reset_pools() const;

 private:
  std::int32_t slots_per_page(std::int32_t pool) const {
    return controller_.sidecar(static_cast<std::size_t>(pool)).spec().slots_per_page;
  }
  std::int64_t page_bytes(std::int32_t pool) const {
    return controller_.sidecar(static_cast<std::size_t>(pool)).spec().page_bytes();
  }

  HiCacheController& controller_;
  const Tree& tree_;
};

}  // namespace hicache::radix
