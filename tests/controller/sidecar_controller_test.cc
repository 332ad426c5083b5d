// Sidecar pools through HiCacheController: a hybrid model's state pages move in the same op as
// the KV, byte for byte, and are acked, failed, returned and evicted with it.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "controller/hicache_controller.h"
#include "controller/wait_acks.h"
#include "pools/kv_pattern.h"
#include "pools/sidecar_pool.h"
#include "tests/controller/faulty_device.h"
#include "transfer/errors.h"
#include "transfer/host_device.h"

namespace hicache {
namespace {

using Slots = std::vector<std::int64_t>;

constexpr std::int32_t kPage = 8;

SidecarSpec mamba_spec() {  // one state checkpoint per page, 3 layers of 4 KiB
  return SidecarSpec{.name = "mamba",
                     .policy = SidecarHitPolicy::kTrailing,
                     .layers = 3,
                     .slots_per_page = 1,
                     .slot_bytes = 4096,
                     .dtype = DType::kFloat32,
                     .device_pages = 6,
                     .host_pages = 12};
}

SidecarSpec swa_spec() {  // per-token data of the KV page size, 2 layers
  return SidecarSpec{.name = "swa",
                     .policy = SidecarHitPolicy::kTrailing,
                     .window_pages = 2,
                     .layers = 2,
                     .slots_per_page = kPage,
                     .slot_bytes = 64,
                     .dtype = DType::kBFloat16,
                     .device_pages = 6,
                     .host_pages = 12};
}

// A controller over small KV pools and two sidecar pools on `Dev`.
template <typename Dev>
struct Rig {
  Dev device;
  KVGeometry g = KVGeometry::mha(4, 2, 16, DType::kFloat16, kPage);
  DeviceKVPool dev{device, g, 16 * kPage};
  HostKVPool host{device, g, HostLayout::kPageFirstDirect, 32 * kPage};
  SidecarPool mamba{device, mamba_spec()};
  SidecarPool swa{device, swa_spec()};
  std::vector<SidecarPool*> pools{&mamba, &swa};
  HiCacheController c{device, dev, host, ControllerConfig{}, pools};

  SidecarPool& pool(std::int32_t i) { return *pools[static_cast<std::size_t>(i)]; }
  // Fills every page of `slots` of pool i's device tier with the pattern of `key0 + page index`.
  void fill(std::int32_t i, const Slots& slots, std::uint64_t key0) {
    Slots pages;
    slots_to_pages(slots, pool(i).spec().slots_per_page, pool(i).device_pool().num_pages(),
                   "test", pages);
    for (std::size_t k = 0; k < pages.size(); ++k) {
      fill_page(pool(i).device_pool().layout(), pages[k], key0 + k);
    }
  }
  // True when page k of `slots` in `layout` holds the pattern of key0 + k.
  bool holds(std::int32_t i, const LayoutDesc& layout, const Slots& slots, std::uint64_t key0,
             std::string* where) {
    Slots pages;
    slots_to_pages(slots, pool(i).spec().slots_per_page, 1 << 20, "test", pages);
    for (std::size_t k = 0; k < pages.size(); ++k) {
      if (!verify_page(layout, pages[k], key0 + k, where)) return false;
    }
    return true;
  }
  bool clean() {
    for (SidecarPool* p : pools) {
      if (p->host_pool().free_tokens() != p->host_pool().capacity_tokens()) return false;
      if (p->device_pool().allocator().free_tokens() != p->device_pool().capacity_tokens()) {
        return false;
      }
    }
    return host.free_tokens() == host.capacity_tokens() &&
           dev.allocator().free_tokens() == dev.capacity_tokens();
  }
};

// Write a node's KV (2 pages) with its state (one checkpoint) and its window (2 SWA pages),
// evict the device copies, load them back into other slots: every byte of every pool arrives,
// the sidecars before layer 0 is marked done, and the byte counts include them.
TEST(SidecarController, StatePagesMoveWithTheKvByteForByte) {
  Rig<HostDevice> r;
  const Slots kv_dev = *r.dev.allocator().alloc(2 * kPage);
  const Slots m_dev = *r.mamba.device_pool().allocator().alloc(1);
  const Slots s_dev = *r.swa.device_pool().allocator().alloc(2 * kPage);
  r.fill(0, m_dev, 500);
  r.fill(1, s_dev, 700);
  const Slots kv_host = *r.c.reserve_write(2 * kPage);
  const Slots m_host = *r.mamba.host_pool().alloc(1);
  const Slots s_host = *r.swa.host_pool().alloc(2 * kPage);
  const SidecarIo w[] = {{0, m_host, m_dev}, {1, s_host, s_dev}};
  ASSERT_TRUE(r.c.write_reserved(kv_dev, kv_host, 0, NodeId{1}, nullptr, w));
  auto acks = wait_acks(r.c, true, 1);
  ASSERT_EQ(acks.size(), 1u);
  ASSERT_TRUE(acks[0].ok);
  EXPECT_TRUE(r.mamba.host_pool().all_in_state(m_host, PageState::kSynced));
  EXPECT_TRUE(r.swa.host_pool().all_in_state(s_host, PageState::kSynced));
  std::string where;
  EXPECT_TRUE(r.holds(0, r.mamba.host_pool().layout(), m_host, 500, &where)) << where;
  EXPECT_TRUE(r.holds(1, r.swa.host_pool().layout(), s_host, 700, &where)) << where;
  const auto kv_bytes = static_cast<std::uint64_t>(2 * r.g.page_bytes());
  const auto side_bytes =
      static_cast<std::uint64_t>(mamba_spec().page_bytes() + 2 * swa_spec().page_bytes());
  EXPECT_EQ(r.c.stats().bytes_written, kv_bytes + side_bytes);

  EXPECT_EQ(r.c.evict_device(kv_dev, kv_host, w), 2 * kPage);
  EXPECT_TRUE(r.mamba.host_pool().all_in_state(m_host, PageState::kBackup));
  EXPECT_EQ(r.mamba.device_pool().allocator().free_tokens(), 6);

  // Back into other slots (a blocker takes the old ones).
  const Slots m_block = *r.mamba.device_pool().allocator().alloc(1);
  const Slots m_back = *r.mamba.device_pool().allocator().alloc(1);
  const Slots s_back = *r.swa.device_pool().allocator().alloc(2 * kPage);
  const Slots kv_back = *r.dev.allocator().alloc(2 * kPage);
  ASSERT_NE(m_back, m_dev);
  const SidecarIo l[] = {{0, m_host, m_back}, {1, s_host, s_back}};
  ASSERT_TRUE(r.c.load_into(kv_host, kv_back, 0, NodeId{2}, l));
  const std::int32_t slot = r.c.start_loading();
  ASSERT_GE(slot, 0);
  ASSERT_TRUE(r.dev.wait_for_layer(0));
  EXPECT_TRUE(r.holds(0, r.mamba.device_pool().layout(), m_back, 500, &where)) << where;
  EXPECT_TRUE(r.holds(1, r.swa.device_pool().layout(), s_back, 700, &where)) << where;
  for (std::int32_t layer = 1; layer < r.g.num_layers; ++layer) {
    ASSERT_TRUE(r.dev.wait_for_layer(layer));
  }
  r.c.layer_done_counter().release(slot);
  acks = wait_acks(r.c, false, 1);
  ASSERT_EQ(acks.size(), 1u);
  EXPECT_TRUE(acks[0].ok);
  EXPECT_TRUE(r.swa.host_pool().all_in_state(s_host, PageState::kSynced));
  EXPECT_EQ(r.c.stats().bytes_loaded, kv_bytes + side_bytes);

  // Both tiers go, the sidecars with the KV.
  r.c.evict_device(kv_back, kv_host, l);
  r.c.evict_host(kv_host, w);
  r.mamba.device_pool().allocator().free(m_block);
  EXPECT_TRUE(r.clean());
}

TEST(SidecarController, BadSidecarArgumentsAreNamedAndChangeNothing) {
  Rig<HostDevice> r;
  const Slots kv_dev = *r.dev.allocator().alloc(kPage);
  const Slots m_dev = *r.mamba.device_pool().allocator().alloc(1);
  // `mamba_free`: the sidecar host pages free afterwards (its reservation is consumed, except
  // when the pool index names no pool: then the slots are nobody's the controller knows).
  const auto expect_error = [&](const SidecarIo& io, const char* want, std::int64_t mamba_free) {
    const Slots kv_host = *r.c.reserve_write(kPage);
    const SidecarIo w[] = {io};
    try {
      r.c.write_reserved(kv_dev, kv_host, 0, NodeId{1}, nullptr, w);
      ADD_FAILURE() << "accepted: " << want;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
    // The reservations were consumed: nothing left reserved or protected.
    EXPECT_EQ(r.host.free_tokens(), r.host.capacity_tokens()) << want;
    EXPECT_EQ(r.mamba.host_pool().free_tokens(), mamba_free) << want;
  };
  {
    const Slots h = *r.mamba.host_pool().alloc(1);
    expect_error({2, h, m_dev}, "sidecar pool 2 does not exist (2 sidecar pools)", 11);
    r.mamba.host_pool().free(h);
  }
  {
    const Slots h = *r.mamba.host_pool().alloc(2);
    expect_error({0, h, m_dev}, "2 host slots for 1 device slots", 12);
  }
  const Slots page3{3}, slot99{99}, slot5{5}, slot4{4};
  expect_error({0, page3, m_dev}, "page 3 (slot 3) is free, needs reserved", 12);
  {
    const Slots h = *r.mamba.host_pool().alloc(1);
    expect_error({0, h, slot99}, "sidecar 'mamba') device", 12);
  }
  // A load of pages that are not in backup, or into device slots nobody allocated.
  const Slots kv_host = *r.c.reserve_write(kPage);
  const Slots m_host = *r.mamba.host_pool().alloc(1);
  const SidecarIo w[] = {{0, m_host, m_dev}};
  ASSERT_TRUE(r.c.write_reserved(kv_dev, kv_host, 0, NodeId{1}, nullptr, w));
  ASSERT_EQ(wait_acks(r.c, true, 1).size(), 1u);
  const Slots kv_back = *r.dev.allocator().alloc(kPage);
  const SidecarIo synced[] = {{0, m_host, m_dev}};
  try {
    r.c.load_into(kv_host, kv_back, 0, NodeId{2}, synced);
    ADD_FAILURE() << "loaded pages that are not in backup";
  } catch (const StateError& e) {
    EXPECT_NE(std::string(e.what()).find("needs backup"), std::string::npos) << e.what();
  }
  // Evicting with a sidecar whose device page is not allocated changes nothing.
  const SidecarIo stray[] = {{0, m_host, slot5}};
  try {
    r.c.evict_device(kv_dev, kv_host, stray);
    ADD_FAILURE() << "evicted a sidecar page nobody allocated";
  } catch (const StateError& e) {
    EXPECT_NE(std::string(e.what()).find("(sidecar 'mamba'): device page 5 is not allocated"),
              std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(r.host.all_in_state(kv_host, PageState::kSynced));
  EXPECT_TRUE(r.dev.allocator().is_allocated(kv_dev[0] / kPage));
  EXPECT_TRUE(r.mamba.host_pool().all_in_state(m_host, PageState::kSynced));
  // Evicting the host copy while the device one lives is refused, the sidecar's too.
  EXPECT_THROW(r.c.evict_host(Slots{}, synced), StateError);
  EXPECT_TRUE(r.mamba.host_pool().all_in_state(m_host, PageState::kSynced));
  r.c.evict_device(kv_dev, kv_host, w);
  const SidecarIo loaded_into_nothing[] = {{0, m_host, slot4}};
  try {
    r.c.load_into(kv_host, kv_back, 0, NodeId{2}, loaded_into_nothing);
    ADD_FAILURE() << "loaded into a device page nobody allocated";
  } catch (const StateError& e) {
    EXPECT_NE(std::string(e.what()).find("device page 4 is not allocated"), std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(r.mamba.host_pool().all_in_state(m_host, PageState::kBackup));
  r.c.evict_host(kv_host, w);
  r.dev.allocator().free(kv_back);
  EXPECT_TRUE(r.clean());
}

// A failed write frees the sidecars' host pages with the KV's; a failed load puts them back to
// backup, and the device slots stay the caller's.
TEST(SidecarController, FailuresReturnTheSidecarPagesWithTheKv) {
  Rig<testing::FaultyDevice> r;
  const Slots kv_dev = *r.dev.allocator().alloc(kPage);
  const Slots m_dev = *r.mamba.device_pool().allocator().alloc(1);
  r.device.fail_writes = 1;
  {
    const Slots kv_host = *r.c.reserve_write(kPage);
    const Slots m_host = *r.mamba.host_pool().alloc(1);
    const SidecarIo w[] = {{0, m_host, m_dev}};
    ASSERT_TRUE(r.c.write_reserved(kv_dev, kv_host, 0, NodeId{1}, nullptr, w));
    auto acks = wait_acks(r.c, true, 1);
    ASSERT_EQ(acks.size(), 1u);
    EXPECT_FALSE(acks[0].ok);
    EXPECT_EQ(r.mamba.host_pool().free_tokens(), 12);
    EXPECT_EQ(r.host.free_tokens(), r.host.capacity_tokens());
  }
  const Slots kv_host = *r.c.reserve_write(kPage);
  const Slots m_host = *r.mamba.host_pool().alloc(1);
  const SidecarIo w[] = {{0, m_host, m_dev}};
  ASSERT_TRUE(r.c.write_reserved(kv_dev, kv_host, 0, NodeId{2}, nullptr, w));
  ASSERT_TRUE(wait_acks(r.c, true, 1).at(0).ok);
  r.c.evict_device(kv_dev, kv_host, w);
  r.device.fail_loads = 1;  // the first copy into the device: the sidecar's
  const Slots kv_back = *r.dev.allocator().alloc(kPage);
  const Slots m_back = *r.mamba.device_pool().allocator().alloc(1);
  const SidecarIo l[] = {{0, m_host, m_back}};
  ASSERT_TRUE(r.c.load_into(kv_host, kv_back, 0, NodeId{3}, l));
  const std::int32_t slot = r.c.start_loading();
  ASSERT_GE(slot, 0);
  EXPECT_FALSE(r.dev.wait_for_layer(0));
  auto acks = wait_acks(r.c, false, 1);
  ASSERT_EQ(acks.size(), 1u);
  EXPECT_FALSE(acks[0].ok);
  EXPECT_TRUE(r.mamba.host_pool().all_in_state(m_host, PageState::kBackup));
  EXPECT_TRUE(r.host.all_in_state(kv_host, PageState::kBackup));
  r.c.evict_host(kv_host, w);
  r.dev.allocator().free(kv_back);
  r.mamba.device_pool().allocator().free(m_back);
  EXPECT_TRUE(r.clean());
}

// A reset with sidecar writes and loads queued returns every page: what ran is synced (and is
// then evicted here), the rest is free again.
TEST(SidecarController, ResetReturnsQueuedSidecarPages) {
  Rig<HostDevice> r;
  for (int round = 0; round < 3; ++round) {
    const Slots kv_dev = *r.dev.allocator().alloc(6 * kPage);
    const Slots m_dev = *r.mamba.device_pool().allocator().alloc(6);
    for (int i = 0; i < 6; ++i) {
      const Slots kv_host = *r.c.reserve_write(kPage);
      const Slots m_host = *r.mamba.host_pool().alloc(1);
      const Slots m_slot{m_dev[static_cast<std::size_t>(i)]};
      const SidecarIo w[] = {{0, m_host, m_slot}};
      ASSERT_TRUE(r.c.write_reserved(std::span(kv_dev).subspan(i * kPage, kPage), kv_host, i,
                                     NodeId{i}, nullptr, w));
    }
    r.c.reset();
    for (HostKVPool* h : {&r.host, &r.mamba.host_pool()}) {
      for (std::int64_t p = 0; p < h->num_pages(); ++p) {
        const PageState s = h->page_state(p);
        ASSERT_TRUE(s == PageState::kFree || s == PageState::kSynced)
            << "round " << round << " page " << p << " is " << to_string(s);
        if (s == PageState::kSynced) {
          Slots slots;
          pages_to_slots(Slots{p}, h->geometry().page_size, slots);
          h->mark_backup(slots);
          h->free(slots);
        }
      }
    }
    r.dev.allocator().free(kv_dev);
    r.mamba.device_pool().allocator().free(m_dev);
    EXPECT_TRUE(r.clean()) << "round " << round;
  }
}

// A reset with sidecar loads queued (not yet handed to the load thread) returns them: the host
// pages back to backup, the device slots to their allocators.
TEST(SidecarController, ResetReturnsQueuedSidecarLoads) {
  Rig<HostDevice> r;
  const Slots kv_dev = *r.dev.allocator().alloc(2 * kPage);
  const Slots m_dev = *r.mamba.device_pool().allocator().alloc(2);
  const Slots kv_host = *r.c.reserve_write(2 * kPage);
  const Slots m_host = *r.mamba.host_pool().alloc(2);
  const SidecarIo w[] = {{0, m_host, m_dev}};
  ASSERT_TRUE(r.c.write_reserved(kv_dev, kv_host, 0, NodeId{1}, nullptr, w));
  ASSERT_TRUE(wait_acks(r.c, true, 1).at(0).ok);
  r.c.evict_device(kv_dev, kv_host, w);
  const Slots kv_back = *r.dev.allocator().alloc(2 * kPage);
  const Slots m_back = *r.mamba.device_pool().allocator().alloc(2);
  const SidecarIo l[] = {{0, m_host, m_back}};
  ASSERT_TRUE(r.c.load_into(kv_host, kv_back, 0, NodeId{2}, l));
  EXPECT_TRUE(r.mamba.host_pool().all_in_state(m_host, PageState::kProtected));
  r.c.reset();  // the load was queued, never started
  EXPECT_TRUE(r.mamba.host_pool().all_in_state(m_host, PageState::kBackup));
  EXPECT_TRUE(r.host.all_in_state(kv_host, PageState::kBackup));
  EXPECT_EQ(r.mamba.device_pool().allocator().free_tokens(), 6) << "device slots returned";
  EXPECT_EQ(r.dev.allocator().free_tokens(), r.dev.capacity_tokens());
  r.c.evict_host(kv_host, w);
  EXPECT_TRUE(r.clean());
}

TEST(SidecarController, ASidecarPoolGivenTwiceIsRefused) {
  HostDevice device;
  const KVGeometry g = KVGeometry::mha(2, 2, 16, DType::kFloat16, kPage);
  DeviceKVPool dev(device, g, 4 * kPage);
  HostKVPool host(device, g, HostLayout::kLayerFirst, 4 * kPage);
  SidecarPool mamba(device, mamba_spec());
  SidecarPool* twice[] = {&mamba, &mamba};
  try {
    HiCacheController c(device, dev, host, ControllerConfig{}, twice);
    FAIL() << "accepted one pool twice";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("sidecar pool 'mamba' is given twice"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace hicache
