// The controller's hot path does not allocate per op once warm: slot lists come from its
// SlotArena and the main loop's scratch is reused. Counted with a replaced global operator new
// whose counter is per thread, so only the calls under test (on this thread) count. The one
// allocation a write() or load() makes is the slot list it returns (the caller keeps it: the
// radix tree stores it in its node).
#include <gtest/gtest.h>

#include <cstdlib>
#include <new>
#include <thread>

#include "controller/hicache_controller.h"
#include "transfer/host_device.h"

namespace {
thread_local std::int64_t t_allocations = 0;
}  // namespace

void* operator new(std::size_t n) {
  ++t_allocations;
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }

namespace hicache {
namespace {

TEST(ControllerAllocations, WritesAndLoadsAllocateOnlyTheSlotListsTheyReturn) {
  HostDevice device;
  const KVGeometry g = KVGeometry::mha(2, 1, 8, DType::kFloat16, 4);
  DeviceKVPool dev(device, g, 64 * 4);
  HostKVPool host(device, g, HostLayout::kLayerFirst, 64 * 4);
  HiCacheController c(device, dev, host);
  std::vector<Ack> acks;
  acks.reserve(64);

  std::int64_t write_calls = 0, write_allocations = 0;
  std::int64_t load_calls = 0, load_allocations = 0, start_allocations = 0;
  for (int round = 0; round < 400; ++round) {
    const bool measured = round >= 100;  // the first rounds warm the arena and the queues
    const auto page = *dev.allocator().alloc(4 * g.page_size);  // 4 fresh device pages
    std::vector<std::vector<std::int64_t>> written;
    for (int i = 0; i < 4; ++i) {
      const std::span<const std::int64_t> slots(page.data() + i * g.page_size, g.page_size);
      const std::int64_t before = t_allocations;
      auto h = c.write(slots, 0, NodeId{i});
      if (measured) {
        write_allocations += t_allocations - before;
        ++write_calls;
      }
      ASSERT_TRUE(h);
      written.push_back(std::move(*h));
    }
    for (std::size_t got = 0; got < 4;) {
      acks.clear();
      got += c.drain_write_acks(acks);
      std::this_thread::yield();
    }
    // Load the host copies back (their device copies are evicted first), then free both.
    for (int i = 0; i < 4; ++i) {
      c.evict_device(std::span<const std::int64_t>(page.data() + i * g.page_size, g.page_size),
                     written[static_cast<std::size_t>(i)]);
    }
    std::vector<std::vector<std::int64_t>> loaded;
    for (int i = 0; i < 4; ++i) {
      const std::int64_t before = t_allocations;
      auto d = c.load(written[static_cast<std::size_t>(i)], 0, NodeId{i});
      if (measured) {
        load_allocations += t_allocations - before;
        ++load_calls;
      }
      ASSERT_TRUE(d);
      loaded.push_back(std::move(*d));
    }
    const std::int64_t before = t_allocations;
    const std::int32_t slot = c.start_loading();
    if (measured) start_allocations += t_allocations - before;
    ASSERT_GE(slot, 0);
    for (std::size_t got = 0; got < 4;) {
      acks.clear();
      got += c.drain_load_acks(acks);
      std::this_thread::yield();
    }
    c.layer_done_counter().release(slot);
    for (int i = 0; i < 4; ++i) {
      // The loaded device copy goes; the host copy (synced again) goes with it.
      c.evict_device(loaded[static_cast<std::size_t>(i)], written[static_cast<std::size_t>(i)]);
      c.evict_host(written[static_cast<std::size_t>(i)]);
    }
  }
  EXPECT_EQ(dev.allocator().free_tokens(), dev.capacity_tokens());
  EXPECT_EQ(host.free_tokens(), host.capacity_tokens());
  // One allocation per call: the returned list. Before the arena a write made five (the
  // returned list, a page check list, two slot copies, the node id list) and a load four.
  EXPECT_EQ(write_allocations, write_calls) << "per write: " << double(write_allocations) / write_calls;
  EXPECT_EQ(load_allocations, load_calls) << "per load: " << double(load_allocations) / load_calls;
  // start_loading merges the step's ops into one batch: a list may grow now and then while
  // the arena's lists settle at the batch size, never once per step.
  EXPECT_LE(start_allocations, 30) << "over 300 steps";
}

}  // namespace
}  // namespace hicache
