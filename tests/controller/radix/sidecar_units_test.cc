// The sidecar room on its own: a tree and a controller with two sidecar pools, no cache.
#include "controller/radix/sidecar_units.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "transfer/errors.h"
#include "transfer/host_device.h"

namespace hicache::radix {
namespace {

using Slots = std::vector<std::int64_t>;
constexpr std::int32_t kPage = 4;

struct Rig {
  HostDevice device;
  KVGeometry g = KVGeometry::mha(1, 1, 8, DType::kFloat16, kPage);
  DeviceKVPool dev{device, g, 16 * kPage};
  HostKVPool host{device, g, HostLayout::kPageFirst, 16 * kPage};
  // 0: one state checkpoint a page (trailing, window 1); 1: an indexer's keys (all_pages).
  SidecarPool state{device, SidecarSpec{.name = "state", .policy = SidecarHitPolicy::kTrailing,
                                        .slot_bytes = 64, .device_pages = 8, .host_pages = 8}};
  SidecarPool index{device, SidecarSpec{.name = "index", .policy = SidecarHitPolicy::kAllPages,
                                        .slots_per_page = kPage, .slot_bytes = 16,
                                        .device_pages = 8, .host_pages = 8}};
  std::vector<SidecarPool*> pools{&state, &index};
  HiCacheController c{device, dev, host, ControllerConfig{}, pools};
  Tree tree{kPage, 64};
  SidecarUnits units{c, tree};

  Node* leaf(std::int32_t first_token, std::int64_t pages) {
    std::vector<std::int32_t> key;
    for (std::int64_t i = 0; i < pages * kPage; ++i) key.push_back(first_token + static_cast<std::int32_t>(i));
    Node* n = tree.add_leaf(tree.root(), key, {});
    n->device.assign(static_cast<std::size_t>(pages * kPage), 0);
    for (std::int64_t i = 0; i < pages * kPage; ++i) n->device[static_cast<std::size_t>(i)] = i;
    return n;
  }
};

// adopt takes the pages from the leaf's first page on, offsets made the leaf's own, with their
// slots; split divides them at the cut, each half with its own offsets and slots.
TEST(SidecarUnits, AdoptAndSplitKeepEachPageWithItsSlots) {
  Rig r;
  Node* n = r.leaf(100, 4);  // a sequence's pages 2..5
  const Slots state_pages{1, 3, 5}, state_slots{7, 6, 5};
  const Slots index_pages{2, 3, 4, 5};
  Slots index_slots;
  for (std::int64_t s = 0; s < 4 * kPage; ++s) index_slots.push_back(s);
  const SidecarInsert side[] = {{0, state_pages, state_slots}, {1, index_pages, index_slots}};
  r.units.adopt(n, side, 2);
  ASSERT_EQ(n->sidecars.size(), 2u);
  EXPECT_EQ(n->sidecars[0].pages, (std::vector<std::int32_t>{1, 3}));  // pages 3 and 5
  EXPECT_EQ(n->sidecars[0].device, (Slots{6, 5}));
  EXPECT_EQ(n->sidecar_bytes, 2 * 64 + 4 * 64);  // a state page 64 bytes, an index page 4 x 16
  EXPECT_EQ(r.units.check(*n), "");

  Node* upper = r.tree.split(n, 2 * kPage);
  r.units.split(n, upper, 2);
  ASSERT_EQ(upper->sidecars.size(), 2u);
  EXPECT_EQ(upper->sidecars[0].pages, (std::vector<std::int32_t>{1}));
  EXPECT_EQ(upper->sidecars[0].device, (Slots{6}));
  EXPECT_EQ(upper->sidecars[1].device.size(), 2u * kPage);
  EXPECT_EQ(n->sidecars[0].pages, (std::vector<std::int32_t>{1}));
  EXPECT_EQ(n->sidecars[0].device, (Slots{5}));
  EXPECT_EQ(n->sidecars[1].device.front(), 2 * kPage);
  EXPECT_EQ(upper->sidecar_bytes, 64 + 2 * 64);
  EXPECT_EQ(n->sidecar_bytes, 64 + 2 * 64);
  upper->device.assign(n->device.begin(), n->device.begin() + 2 * kPage);
  n->device.erase(n->device.begin(), n->device.begin() + 2 * kPage);
  EXPECT_EQ(r.units.check(*upper), "");
  EXPECT_EQ(r.units.check(*n), "");
  // device_slots walks the path from the root: the state pages of both halves, in order.
  const auto held = r.units.device_slots(n, 0);
  ASSERT_EQ(held.size(), 2u);
  EXPECT_EQ(held[0].page, 1);
  EXPECT_EQ(held[1].page, 3);
  EXPECT_EQ(r.units.slots_held(1), (std::pair<std::int64_t, std::int64_t>{4 * kPage, 0}));
}

// The restorable prefix of a path: the indexer holds every page, the state pages 1 and 3 of a
// 4-page match: 4 restores, 3 does not; on a device part of 3 pages, 2 does.
TEST(SidecarUnits, TheRestorablePrefixIsTheLargestLengthEveryPoolCanRestore) {
  Rig r;
  Node* n = r.leaf(200, 4);
  const Slots state_pages{1, 3}, state_slots{0, 1}, index_pages{0, 1, 2, 3};
  Slots index_slots;
  for (std::int64_t s = 0; s < 4 * kPage; ++s) index_slots.push_back(s);
  const SidecarInsert side[] = {{0, state_pages, state_slots}, {1, index_pages, index_slots}};
  r.units.adopt(n, side, 0);
  const auto cut = r.units.restorable(n, 4, 3);
  EXPECT_EQ(cut.all, 4);
  EXPECT_EQ(cut.on_device, 2);
  EXPECT_EQ(r.units.restorable(n, 0, 0).all, 0);
}

// check() names a node whose sidecar pages left its KV's tiers, or sit out of order.
TEST(SidecarUnits, CheckNamesPagesOffTheKvsTiersOrOutOfOrder) {
  Rig r;
  Node* n = r.leaf(300, 2);
  n->sidecars.push_back({.pool = 0, .pages = {1}, .device = {}, .host = {}});
  EXPECT_NE(r.units.check(*n).find("sidecar pool 0 has 0 device / 0 host slots"),
            std::string::npos)
      << r.units.check(*n);
  n->sidecars[0].device = {3};
  EXPECT_EQ(r.units.check(*n), "node 1: counts 0 sidecar bytes, holds 64");  // not counted
  n->sidecar_bytes = 64;
  EXPECT_EQ(r.units.check(*n), "");
  n->sidecars[0].pages = {2};
  EXPECT_NE(r.units.check(*n).find("page 2 out of order or outside the node's 2 pages"),
            std::string::npos);
  n->sidecars[0].pages = {1};
  n->sidecars.push_back(n->sidecars[0]);
  EXPECT_NE(r.units.check(*n).find("listed badly"), std::string::npos);
  EXPECT_THROW(r.units.device_slots(n, 2), InvalidArgument);
}

}  // namespace
}  // namespace hicache::radix
