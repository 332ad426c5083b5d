// Ordering between the engine's compute stream and the controller's copies, per slot, on both
// backends (the CUDA run skips with the reason without a GPU). Each test provokes one hazard by
// holding the other stream back behind a long copy, so that without the ordering the bytes
// checked at the end would be the wrong ones:
//   - pending write: a backup must not copy device slots before the compute work that writes
//     them (write(..., ready_after));
//   - pending read: a load must not overwrite device slots that compute work still reads
//     (start_loading(ready_after));
//   - a loaded layer must not be read before its copy landed, also when the compute stream waits
//     on the device instead of the host (LayerDoneCounter::wait_on_stream).
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <thread>

#include "controller/hicache_controller.h"
#include "controller/wait_acks.h"
#include "controller/stream_gate.h"
#include "pools/kv_pattern.h"
#include "transfer/errors.h"

namespace hicache {
namespace {

class StreamHazard : public ::testing::TestWithParam<const char*> {
 protected:
  static constexpr std::int64_t kPages = 8;

  void SetUp() override {
    std::string why;
    if (std::string_view(GetParam()) == "cuda" && !Device::cuda_available(&why)) {
      GTEST_SKIP() << "no usable GPU: " << why;
    }
    device_ = Device::create(GetParam());
    geometry_ = KVGeometry::mha(4, 4, 64, DType::kFloat16, 16);
    dev_ = std::make_unique<DeviceKVPool>(*device_, geometry_, kPages * geometry_.page_size);
    host_ = std::make_unique<HostKVPool>(*device_, geometry_, HostLayout::kLayerFirst,
                                         2 * kPages * geometry_.page_size);
    controller_ = std::make_unique<HiCacheController>(*device_, *dev_, *host_);
    compute_ = device_->create_stream();
    if (device_->backend() == DeviceBackend::kCuda) {
      // The engine's own compute stream, as a real engine has it: wrapped, not owned.
      engine_stream_ = std::move(compute_);
      compute_ = device_->wrap_stream(engine_stream_->native_handle());
    } else {
      EXPECT_THROW(device_->wrap_stream(nullptr), InvalidArgument);
    }
    staging_ = device_->alloc_host(dev_->size_bytes());
    view_ = dev_->layout();
    view_.base = reinterpret_cast<std::uint8_t*>(staging_.data());
    gate_ = std::make_unique<StreamGate>(*device_);
  }

  void TearDown() override {
    if (gate_) gate_->open();
  }

  // While the gate holds, gives the controller's threads time to run ahead if nothing orders
  // them (a pause in a test, never in the library).
  static void let_others_run() { std::this_thread::sleep_for(std::chrono::milliseconds(150)); }

  std::vector<std::int64_t> pages_of(std::span<const std::int64_t> slots) {
    std::vector<std::int64_t> pages;
    slots_to_pages(slots, geometry_.page_size, kPages, "test", pages);
    return pages;
  }

  // Device slots of every page, holding key `base + page` (written from the staging buffer).
  std::vector<std::int64_t> fill_device(std::uint64_t base) {
    auto d = *dev_->allocator().alloc(kPages * geometry_.page_size);
    for (std::int64_t p : pages_of(d)) fill_page(view_, p, base + p);
    compute_->copy_async(dev_->layout().base, staging_.data(), dev_->size_bytes());
    compute_->synchronize();
    return d;
  }

  // Host pages in backup state holding key `base + page` of the device pages; device freed.
  std::vector<std::int64_t> backed_up_host(std::uint64_t base) {
    auto d = fill_device(base);
    auto h = controller_->write(d, 0, NodeId{1});
    EXPECT_TRUE(h);
    auto acks = wait_acks(*controller_, true, 1);
    EXPECT_TRUE(acks.size() == 1 && acks[0].ok);
    controller_->evict_device(d, *h);
    return *h;
  }

  std::unique_ptr<Device> device_;
  KVGeometry geometry_;
  std::unique_ptr<DeviceKVPool> dev_;
  std::unique_ptr<HostKVPool> host_;
  std::unique_ptr<HiCacheController> controller_;
  std::unique_ptr<Stream> engine_stream_, compute_;
  Buffer staging_;
  LayoutDesc view_;
  std::unique_ptr<StreamGate> gate_;
};

TEST_P(StreamHazard, ABackupWaitsForTheComputeWorkThatWritesItsSlots) {
  auto d = *dev_->allocator().alloc(kPages * geometry_.page_size);
  const auto pages = pages_of(d);
  for (std::int64_t p : pages) fill_page(view_, p, 700 + p);
  // The "forward pass": held at the gate, then writes the KV of every slot.
  gate_->hold(*compute_);
  compute_->copy_async(dev_->layout().base, staging_.data(), dev_->size_bytes());
  auto produced = device_->create_event();
  compute_->record(*produced);
  auto h = controller_->write(d, 0, NodeId{1}, produced.get());
  ASSERT_TRUE(h);
  let_others_run();
  std::vector<Ack> early;
  controller_->drain_write_acks(early);
  EXPECT_TRUE(early.empty()) << "the backup completed before the forward pass wrote its slots";
  gate_->open();
  auto acks = wait_acks(*controller_, true, 1 - early.size());
  acks.insert(acks.end(), early.begin(), early.end());
  ASSERT_EQ(acks.size(), 1u);
  ASSERT_TRUE(acks[0].ok);
  const auto hpages = pages_of(*h);
  for (std::size_t i = 0; i < pages.size(); ++i) {
    std::string where;
    EXPECT_TRUE(verify_page(host_->layout(), hpages[i], 700 + pages[i], &where))
        << "the backup copied slots before the forward pass wrote them: " << where;
  }
  controller_->evict_device(d, *h);
  controller_->evict_host(*h);
  EXPECT_EQ(host_->free_tokens(), host_->capacity_tokens());
}

TEST_P(StreamHazard, ALoadWaitsForComputeStillReadingTheSlotsItReuses) {
  const auto h = backed_up_host(900);  // host: keys 900 + page; device: all free
  auto d = fill_device(100);           // device: keys 100 + page, the old request's KV
  const auto old_pages = pages_of(d);
  // The old request's "attention": held at the gate, then reads every slot.
  Buffer seen = device_->alloc_host(dev_->size_bytes());
  gate_->hold(*compute_);
  compute_->copy_async(seen.data(), dev_->layout().base, dev_->size_bytes());
  auto read_done = device_->create_event();
  compute_->record(*read_done);
  // The request finishes; its slots are freed and the load of another prefix reuses them.
  dev_->allocator().free(d);
  auto back = controller_->load(h, 0, NodeId{2});
  ASSERT_TRUE(back);
  const std::int32_t slot = controller_->start_loading(read_done.get());
  let_others_run();
  EXPECT_FALSE(controller_->layer_done_counter().is_done(slot, 0))
      << "the load copied into slots the old request was still reading";
  gate_->open();
  for (std::int32_t layer = 0; layer < geometry_.num_layers; ++layer) {
    EXPECT_TRUE(dev_->wait_for_layer(layer)) << "layer " << layer;
  }
  controller_->layer_done_counter().release(slot);
  ASSERT_EQ(wait_acks(*controller_, false, 1).size(), 1u);
  compute_->synchronize();
  LayoutDesc seen_view = dev_->layout();
  seen_view.base = reinterpret_cast<std::uint8_t*>(seen.data());
  for (std::int64_t p : old_pages) {
    std::string where;
    EXPECT_TRUE(verify_page(seen_view, p, 100 + p, &where))
        << "the load overwrote a slot the old request was still reading: " << where;
  }
  // And the load itself landed.
  compute_->copy_async(staging_.data(), dev_->layout().base, dev_->size_bytes());
  compute_->synchronize();
  const auto hpages = pages_of(h);
  const auto bpages = pages_of(*back);
  for (std::size_t i = 0; i < bpages.size(); ++i) {
    std::string where;
    EXPECT_TRUE(verify_page(view_, bpages[i], 900 + hpages[i], &where)) << where;
  }
}

TEST_P(StreamHazard, ComputeWaitingOnTheDeviceReadsEveryLayerOnlyOnceItLanded) {
  const auto h = backed_up_host(400);
  const LayoutDesc& dl = dev_->layout();
  ASSERT_LE(static_cast<std::size_t>(dl.layer_stride) * geometry_.num_layers, dev_->size_bytes());
  auto back = controller_->load(h, 0, NodeId{3});
  ASSERT_TRUE(back);
  // Hold the load stream at the gate, so a compute stream that did not wait reads empty slots.
  auto holder = device_->create_stream();
  gate_->hold(*holder);
  auto held = device_->create_event();
  holder->record(*held);
  const std::int32_t slot = controller_->start_loading(held.get());
  // The forward pass: per layer, a device-side wait, then "attention" reads the layer.
  Buffer seen = device_->alloc_host(dev_->size_bytes());
  std::memset(seen.data(), 0xAB, seen.size());
  const auto t0 = std::chrono::steady_clock::now();
  for (std::int32_t layer = 0; layer < geometry_.num_layers; ++layer) {
    ASSERT_TRUE(controller_->layer_done_counter().wait_on_stream(slot, layer, *compute_));
    const std::size_t off = static_cast<std::size_t>(layer) * dl.layer_stride;
    compute_->copy_async(static_cast<std::byte*>(seen.data()) + off, dl.base + off,
                         static_cast<std::size_t>(dl.layer_stride));
  }
  const auto enqueued = std::chrono::steady_clock::now() - t0;
  let_others_run();
  EXPECT_FALSE(controller_->layer_done_counter().is_done(slot, 0));
  gate_->open();
  compute_->synchronize();
  controller_->layer_done_counter().release(slot);
  ASSERT_EQ(wait_acks(*controller_, false, 1).size(), 1u);
  LayoutDesc seen_view = dl;
  seen_view.base = reinterpret_cast<std::uint8_t*>(seen.data());
  const auto hpages = pages_of(h);
  const auto bpages = pages_of(*back);
  for (std::size_t i = 0; i < bpages.size(); ++i) {
    std::string where;
    EXPECT_TRUE(verify_page(seen_view, bpages[i], 400 + hpages[i], &where))
        << "compute read a layer before its copy landed: " << where;
  }
  // The host never waited for the held-back copies, only for the layers to be enqueued.
  std::printf("[%s] forward pass enqueued in %.2f ms while the load was held back\n", GetParam(),
              std::chrono::duration<double, std::milli>(enqueued).count());
}

TEST_P(StreamHazard, ADeviceSideWaitOnAFailedBatchReturnsFalse) {
  LayerDoneCounter counter(2, 1, device_.get());
  const std::int32_t slot = counter.acquire();
  counter.mark_layer_enqueued(slot, 0);
  EXPECT_TRUE(counter.wait_on_stream(slot, 0, *compute_));
  counter.fail(slot);
  EXPECT_FALSE(counter.wait_on_stream(slot, 1, *compute_));
  EXPECT_THROW(counter.mark_layer_enqueued(slot, 0), StateError);  // layer 0 again: out of order
  EXPECT_THROW(counter.wait_on_stream(slot, 2, *compute_), InvalidArgument);
  counter.release(slot);
  counter.release(slot);
  EXPECT_THROW(counter.mark_layer_enqueued(slot, 1), StateError);  // not claimed
}

INSTANTIATE_TEST_SUITE_P(Backends, StreamHazard, ::testing::Values("host", "cuda"),
                         [](const auto& p) { return std::string(p.param); });

}  // namespace
}  // namespace hicache
