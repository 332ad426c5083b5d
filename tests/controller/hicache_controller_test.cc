#include "controller/hicache_controller.h"
#include "controller/wait_acks.h"

#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "pools/kv_pattern.h"
#include "tests/controller/faulty_device.h"
#include "transfer/errors.h"
#include "transfer/host_device.h"

namespace hicache {
namespace {

// True when every unit of `layer` of page `page` in `d` carries the pattern of `key`.
bool layer_matches(const LayoutDesc& d, std::int64_t page, std::int32_t layer, std::uint64_t key) {
  const auto unit = static_cast<std::size_t>(d.unit_bytes);
  for (std::int32_t kv = 0; kv < d.num_kv; ++kv) {
    for (std::int32_t t = 0; t < d.page_size; ++t) {
      std::span<const std::byte> data(
          reinterpret_cast<const std::byte*>(d.base + unit_offset(d, layer, kv, page * d.page_size + t)),
          unit);
      if (find_pattern_mismatch(data, key, layer, kv, t * unit) >= 0) return false;
    }
  }
  return true;
}

struct Params {
  HostLayout layout;
  IoBackend io;
  bool mla;
};

class ControllerRoundTrip : public ::testing::TestWithParam<Params> {};

TEST_P(ControllerRoundTrip, DeviceHostDeviceByteForByte) {
  const Params p = GetParam();
  HostDevice device;
  const KVGeometry g = p.mla ? KVGeometry::mla(4, 32, 8, DType::kBFloat16, 8)
                             : KVGeometry::mha(4, 2, 16, DType::kFloat16, 8);
  DeviceKVPool dev(device, g, 16 * 8);
  HostKVPool host(device, g, p.layout, 16 * 8);
  HiCacheController c(device, dev, host, ControllerConfig{.io_backend = p.io});
  const std::int32_t ps = g.page_size;

  auto dslots = *dev.allocator().alloc(5 * ps);
  std::vector<std::int64_t> dpages;
  slots_to_pages(dslots, ps, 16, "test", dpages);
  for (std::int64_t page : dpages) fill_page(dev.layout(), page, 1000 + page);
  // Two writes with different priorities and nodes (node 0 is a real node).
  std::vector<std::int64_t> first(dslots.begin(), dslots.begin() + 2 * ps),
      second(dslots.begin() + 2 * ps, dslots.end());
  auto h1 = c.write(first, 5, NodeId{0});
  auto h2 = c.write(second, 1, NodeId{1});
  ASSERT_TRUE(h1 && h2);
  auto acks = wait_acks(c, true, 2);
  ASSERT_EQ(acks.size(), 2u);
  for (const Ack& a : acks) EXPECT_TRUE(a.ok);
  std::vector<std::int64_t> hslots = *h1;
  hslots.insert(hslots.end(), h2->begin(), h2->end());
  ASSERT_TRUE(host.all_in_state(hslots, PageState::kSynced));
  std::vector<std::int64_t> hpages;
  slots_to_pages(hslots, ps, 16, "test", hpages);
  for (std::size_t i = 0; i < hpages.size(); ++i) {
    std::string where;
    ASSERT_TRUE(verify_page(host.layout(), hpages[i], 1000 + dpages[i], &where)) << where;
  }

  // Evict the device copy, then load it back into other device slots, layer by layer.
  c.evict_device(dslots, hslots);
  ASSERT_TRUE(host.all_in_state(hslots, PageState::kBackup));
  auto blocker = *dev.allocator().alloc(5 * ps);  // force different device slots
  auto back = c.load(hslots, 0, NodeId{7});
  ASSERT_TRUE(back);
  std::vector<std::int64_t> bpages;
  slots_to_pages(*back, ps, 16, "test", bpages);
  const std::int32_t slot = c.start_loading();
  ASSERT_GE(slot, 0);
  for (std::int32_t layer = 0; layer < g.num_layers; ++layer) {
    ASSERT_TRUE(dev.wait_for_layer(layer)) << "layer " << layer;
    for (std::size_t i = 0; i < bpages.size(); ++i) {
      ASSERT_TRUE(layer_matches(dev.layout(), bpages[i], layer, 1000 + dpages[i]))
          << "layer " << layer << " page " << i;
    }
  }
  c.layer_done_counter().release(slot);
  auto load_acks = wait_acks(c, false, 1);
  ASSERT_EQ(load_acks.size(), 1u);
  EXPECT_EQ(load_acks[0].node, 7);
  EXPECT_TRUE(load_acks[0].ok);
  EXPECT_EQ(c.start_loading(), -1);  // nothing queued

  // Everything back: pools clean.
  c.evict_device(*back, hslots);
  c.evict_host(hslots);
  dev.allocator().free(blocker);
  EXPECT_EQ(dev.allocator().free_tokens(), dev.capacity_tokens());
  EXPECT_EQ(host.free_tokens(), host.capacity_tokens());
  EXPECT_EQ(c.stats().write_failures + c.stats().load_failures, 0u);
}

INSTANTIATE_TEST_SUITE_P(
    AllLayoutsIoBackendsAndAttention, ControllerRoundTrip,
    ::testing::Values(Params{HostLayout::kLayerFirst, IoBackend::kDirect, false},
                      Params{HostLayout::kPageFirst, IoBackend::kDirect, false},
                      Params{HostLayout::kPageFirstDirect, IoBackend::kDirect, false},
                      Params{HostLayout::kLayerFirst, IoBackend::kKernel, false},
                      Params{HostLayout::kPageFirst, IoBackend::kKernel, false},
                      Params{HostLayout::kPageFirstDirect, IoBackend::kKernel, false},
                      Params{HostLayout::kLayerFirst, IoBackend::kDirect, true},
                      Params{HostLayout::kPageFirst, IoBackend::kKernel, true},
                      Params{HostLayout::kPageFirstDirect, IoBackend::kDirect, true}));

// The main loop's sleep: a wait returns once the sequence moved on (at once when it already
// has: a notify between reading it and waiting is not lost), or false at the deadline.
TEST(EventSignal, WaitReturnsOnANotifyAfterTheReadAndNotBefore) {
  using namespace std::chrono_literals;
  EventSignal s;
  const std::uint64_t seen = s.seq();
  EXPECT_FALSE(s.wait(seen, std::chrono::steady_clock::now() + 20ms));
  s.notify();
  EXPECT_TRUE(s.wait(seen));  // notified before the wait: no sleep
  const std::uint64_t next = s.seq();
  EXPECT_EQ(next, seen + 1);
  std::thread late([&] {
    std::this_thread::sleep_for(20ms);
    s.notify();
  });
  EXPECT_TRUE(s.wait(next, std::chrono::steady_clock::now() + 60s));
  late.join();
  EXPECT_EQ(s.seq(), next + 1);
}

TEST(HiCacheController, HostFullAndDeviceFullLeakNothing) {
  HostDevice device;
  const auto g = KVGeometry::mha(2, 1, 8, DType::kFloat16, 4);
  DeviceKVPool dev(device, g, 4 * 4);
  HostKVPool host(device, g, HostLayout::kPageFirst, 2 * 4);
  HiCacheController c(device, dev, host);
  auto d = *dev.allocator().alloc(3 * 4);
  EXPECT_FALSE(c.write(d, 0, NodeId{1}));  // 3 pages into a 2-page host pool
  EXPECT_EQ(host.free_tokens(), 8);
  auto h = c.write(std::span(d).first(8), 0, NodeId{1});
  ASSERT_TRUE(h);
  ASSERT_EQ(wait_acks(c, true, 1).size(), 1u);
  c.evict_device(std::span(d).first(8), *h);
  auto fill = *dev.allocator().alloc(dev.allocator().free_tokens());
  const std::int64_t dev_free = dev.allocator().free_tokens();
  EXPECT_FALSE(c.load(*h, 0, NodeId{2}));  // device full
  EXPECT_EQ(dev.allocator().free_tokens(), dev_free);
  EXPECT_TRUE(host.all_in_state(*h, PageState::kBackup)) << "a refused load changed page states";
}

// A forward pass with nothing to load, after a batch whose load failed, is not failed by it: its
// layer waits no longer ask the failed batch's (released) slot.
TEST(HiCacheController, AStepWithoutLoadsAfterAFailedLoadWaitsOnNothing) {
  testing::FaultyDevice device;
  const auto g = KVGeometry::mha(2, 1, 8, DType::kFloat16, 4);
  DeviceKVPool dev(device, g, 4 * 4);
  HostKVPool host(device, g, HostLayout::kLayerFirst, 4 * 4);
  HiCacheController c(device, dev, host);
  auto d = *dev.allocator().alloc(4);
  auto h = c.write(d, 0, NodeId{1});
  ASSERT_TRUE(h);
  ASSERT_EQ(wait_acks(c, true, 1).size(), 1u);
  c.evict_device(d, *h);
  device.fail_loads = 1;
  auto back = c.load(*h, 0, NodeId{2});
  ASSERT_TRUE(back);
  const std::int32_t slot = c.start_loading();
  ASSERT_GE(slot, 0);
  const auto acks = wait_acks(c, false, 1);
  ASSERT_EQ(acks.size(), 1u);
  EXPECT_FALSE(acks[0].ok) << "the injected failure did not hit the load";
  EXPECT_FALSE(dev.wait_for_layer(0)) << "the failed batch's own forward pass";
  c.layer_done_counter().release(slot);
  dev.allocator().free(*back);
  EXPECT_EQ(c.start_loading(), -1) << "nothing queued";
  EXPECT_TRUE(dev.wait_for_layer(0)) << "a pass without loads was failed by the last batch";
  EXPECT_TRUE(dev.wait_for_layer(1));
}

// After stop(), write() and load() are refused and change nothing (a load held for a batch that
// start_loading can no longer start would keep its slots, and the caller's node, for ever).
TEST(HiCacheController, WritesAndLoadsAfterStopAreRefusedAndChangeNothing) {
  HostDevice device;
  const auto g = KVGeometry::mha(2, 1, 8, DType::kFloat16, 4);
  DeviceKVPool dev(device, g, 4 * 4);
  HostKVPool host(device, g, HostLayout::kPageFirst, 4 * 4);
  HiCacheController c(device, dev, host);
  auto d = *dev.allocator().alloc(2 * 4);
  auto h = c.write(d, 0, NodeId{1});
  ASSERT_TRUE(h);
  ASSERT_EQ(wait_acks(c, true, 1).size(), 1u);
  c.evict_device(d, *h);
  c.stop();
  const std::int64_t dev_free = dev.allocator().free_tokens(), host_free = host.free_tokens();
  EXPECT_FALSE(c.load(*h, 0, NodeId{2}));
  EXPECT_EQ(c.start_loading(), -1);
  auto d2 = *dev.allocator().alloc(4);
  EXPECT_FALSE(c.write(d2, 0, NodeId{3}));
  EXPECT_EQ(dev.allocator().free_tokens(), dev_free - 4);
  EXPECT_EQ(host.free_tokens(), host_free);
  EXPECT_TRUE(host.all_in_state(*h, PageState::kBackup)) << "a refused load changed page states";
}

TEST(HiCacheController, IllegalEvictionsNameTheStateAndChangeNothing) {
  HostDevice device;
  const auto g = KVGeometry::mha(2, 1, 8, DType::kFloat16, 4);
  DeviceKVPool dev(device, g, 4 * 4);
  HostKVPool host(device, g, HostLayout::kPageFirst, 4 * 4);
  HiCacheController c(device, dev, host);
  auto d = *dev.allocator().alloc(4);
  auto h = *host.alloc(4);  // reserved, not synced
  try {
    c.evict_device(d, h);
    FAIL();
  } catch (const StateError& e) {
    EXPECT_NE(std::string(e.what()).find("reserved"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(dev.allocator().is_allocated(d[0] / 4));
  EXPECT_THROW(c.evict_host(h), StateError);
  EXPECT_TRUE(host.all_in_state(h, PageState::kReserved));
  EXPECT_THROW(c.load(h, 0, NodeId{1}), StateError);
  EXPECT_EQ(dev.allocator().free_tokens(), 12);
  EXPECT_THROW(c.evict_device(d, std::span(h).first(0)), InvalidArgument);
  // A synced host page with a device list naming one page twice: rejected, nothing freed.
  auto d2 = *dev.allocator().alloc(4);
  auto h2 = *c.write(d2, 0, NodeId{3});
  std::vector<Ack> acks;
  while (c.drain_write_acks(acks) == 0) std::this_thread::yield();
  std::vector<std::int64_t> twice = d2;
  twice.insert(twice.end(), d2.begin(), d2.end());
  std::vector<std::int64_t> h2_twice = h2;
  h2_twice.insert(h2_twice.end(), h2.begin(), h2.end());
  EXPECT_THROW(c.evict_device(twice, h2_twice), Error);
  EXPECT_TRUE(dev.allocator().is_allocated(d2[0] / 4));
  EXPECT_TRUE(host.all_in_state(h2, PageState::kSynced));
}

TEST(HiCacheController, ConfigNamesAreParsedAndUnknownOnesRejected) {
  EXPECT_EQ(parse_write_policy("write_back"), WritePolicy::kWriteBack);
  EXPECT_EQ(parse_io_backend("kernel"), IoBackend::kKernel);
  try {
    parse_write_policy("write_sometimes");
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'write_sometimes'"), std::string::npos);
  }
  EXPECT_EQ(parse_io_backend("auto"), IoBackend::kAuto);
  for (const IoBackend io : {IoBackend::kDirect, IoBackend::kKernel, IoBackend::kAuto}) {
    EXPECT_EQ(parse_io_backend(to_string(io)), io);
  }
  try {
    parse_io_backend("dma");
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'dma': valid are direct, kernel, auto"),
              std::string::npos);
  }
}

// io_backend auto, op by op: the kernel for page_first (token-sized runs), for small runs in
// numbers and for CUDA writes of 1 MiB and more, direct otherwise; a configured path is kept
// whatever the op.
TEST(HiCacheController, AutoChoosesThePathPerOp) {
  constexpr auto kAuto = IoBackend::kAuto, kDirect = IoBackend::kDirect,
                 kKernel = IoBackend::kKernel;
  constexpr auto kCuda = DeviceBackend::kCuda, kHost = DeviceBackend::kHost;
  constexpr std::int64_t kBig = kAutoKernelWriteBytes, kSmall = kAutoKernelWriteBytes - 1;
  constexpr std::int64_t kRun = 128 << 10;  // the standard geometry's run (64 tokens x 2 KiB)
  constexpr std::int64_t kSmallRun = kAutoSmallRunBytes - 1, kMany = kAutoKernelMinRuns;
  auto op = [](bool to_host, std::int64_t bytes, std::int64_t run, std::int64_t runs) {
    return CopyShape{.to_host = to_host, .bytes = bytes, .run_bytes = run, .runs_per_call = runs};
  };
  for (const HostLayout layout : {HostLayout::kLayerFirst, HostLayout::kPageFirstDirect}) {
    SCOPED_TRACE(to_string(layout));
    // Large runs: writes by size, loads direct.
    EXPECT_EQ(choose_io_backend(kAuto, kCuda, layout, op(true, kBig, kRun, 64)), kKernel);
    EXPECT_EQ(choose_io_backend(kAuto, kCuda, layout, op(true, kSmall, kRun, 64)), kDirect);
    EXPECT_EQ(choose_io_backend(kAuto, kCuda, layout, op(false, kBig, kRun, 64)), kDirect);
    EXPECT_EQ(choose_io_backend(kAuto, kCuda, layout, op(false, kSmall, kRun, 2)), kDirect);
    // Small runs: the kernel once there are many per call, whatever the direction.
    for (const bool to_host : {true, false}) {
      EXPECT_EQ(choose_io_backend(kAuto, kCuda, layout, op(to_host, kSmall, kSmallRun, kMany)),
                kKernel);
      EXPECT_EQ(choose_io_backend(kAuto, kCuda, layout, op(to_host, kSmall, kSmallRun, kMany - 1)),
                kDirect);
      EXPECT_EQ(choose_io_backend(kAuto, kCuda, layout,
                                  op(to_host, kSmall, kAutoSmallRunBytes, kMany * 8)),
                kDirect);
    }
    // The host backend: direct.
    for (const bool to_host : {true, false}) {
      EXPECT_EQ(choose_io_backend(kAuto, kHost, layout, op(to_host, kBig, kRun, 64)), kDirect);
      EXPECT_EQ(choose_io_backend(kAuto, kHost, layout, op(to_host, kSmall, kSmallRun, kMany)),
                kDirect);
    }
  }
  for (const DeviceBackend device : {kCuda, kHost}) {
    for (const bool to_host : {true, false}) {
      for (const std::int64_t bytes : {kSmall, kBig}) {
        EXPECT_EQ(choose_io_backend(kAuto, device, HostLayout::kPageFirst,
                                    op(to_host, bytes, 2048, 2)),
                  kKernel);
        for (const HostLayout layout : {HostLayout::kLayerFirst, HostLayout::kPageFirst}) {
          for (const std::int64_t run : {kSmallRun, kRun}) {
            EXPECT_EQ(choose_io_backend(kDirect, device, layout, op(to_host, bytes, run, kMany)),
                      kDirect);
            EXPECT_EQ(choose_io_backend(kKernel, device, layout, op(to_host, bytes, run, kMany)),
                      kKernel);
          }
        }
      }
    }
  }
}

TEST(HiCacheController, ResetUnderLoadReturnsEverySlot) {
  HostDevice device;
  const auto g = KVGeometry::mha(8, 4, 64, DType::kFloat16, 16);
  DeviceKVPool dev(device, g, 64 * 16);
  HostKVPool host(device, g, HostLayout::kLayerFirst, 64 * 16);
  HiCacheController c(device, dev, host);
  for (int round = 0; round < 3; ++round) {
    auto d = *dev.allocator().alloc(32 * 16);
    for (int i = 0; i < 32; ++i) {
      ASSERT_TRUE(c.write(std::span(d).subspan(i * 16, 16), i, NodeId{i}));
    }
    const auto t0 = std::chrono::steady_clock::now();
    c.reset();
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
    // Written pages are synced (their ops ran) or were returned (queued ops): evict what ran.
    for (std::int64_t p = 0; p < host.num_pages(); ++p) {
      if (host.page_state(p) == PageState::kSynced) {
        std::vector<std::int64_t> slots;
        pages_to_slots(std::vector<std::int64_t>{p}, 16, slots);
        host.mark_backup(slots);
        host.free(slots);
      }
    }
    EXPECT_EQ(host.free_tokens(), host.capacity_tokens()) << "round " << round;
    std::vector<Ack> acks;
    EXPECT_EQ(c.drain_write_acks(acks), 0u) << "acks survived the reset";
    dev.allocator().free(d);
  }
  // Still working after the resets.
  auto d = *dev.allocator().alloc(16);
  ASSERT_TRUE(c.write(d, 0, NodeId{99}));
  auto acks = wait_acks(c, true, 1);
  ASSERT_EQ(acks.size(), 1u);
  EXPECT_EQ(acks[0].node, 99);
}

}  // namespace
}  // namespace hicache
