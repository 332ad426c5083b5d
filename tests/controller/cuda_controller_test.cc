// The controller on the CUDA backend: write (D->H) and layer-by-layer load (H->D) through both
// io backends, every byte checked. Skips with the reason without a GPU.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <thread>

#include "controller/hicache_controller.h"
#include "controller/wait_acks.h"
#include "pools/kv_pattern.h"
#include "transfer/errors.h"

namespace hicache {
namespace {

TEST(CudaController, RoundTripEveryLayoutAndIoBackend) {
  std::string why;
  if (!Device::cuda_available(&why)) GTEST_SKIP() << "no usable GPU: " << why;
  auto device = Device::create("cuda");
  const auto g = KVGeometry::mha(8, 8, 128, DType::kFloat16, 64);
  const std::int32_t ps = g.page_size;
  auto stream = device->create_stream();
  for (IoBackend io : {IoBackend::kDirect, IoBackend::kKernel, IoBackend::kAuto}) {
    for (HostLayout layout :
         {HostLayout::kLayerFirst, HostLayout::kPageFirst, HostLayout::kPageFirstDirect}) {
      DeviceKVPool dev(*device, g, 16 * ps);
      HostKVPool host(*device, g, layout, 16 * ps);
      if (io == IoBackend::kDirect && layout == HostLayout::kPageFirst) {
        // One token per copy on a GPU: refused with the alternatives named (the copy plan's
        // bytes on CUDA are checked in cuda_device_test).
        try {
          HiCacheController refused(*device, dev, host, ControllerConfig{.io_backend = io});
          ADD_FAILURE() << "page_first with direct I/O accepted on CUDA";
        } catch (const InvalidArgument& e) {
          EXPECT_NE(std::string(e.what()).find("use io_backend 'kernel'"), std::string::npos)
              << e.what();
        }
        EXPECT_EQ(host.free_tokens(), host.capacity_tokens());
        continue;
      }
      HiCacheController c(*device, dev, host, ControllerConfig{.io_backend = io});
      Buffer staging = device->alloc_host(dev.size_bytes());
      LayoutDesc view = dev.layout();
      view.base = reinterpret_cast<std::uint8_t*>(staging.data());
      auto d = *dev.allocator().alloc(6 * ps);
      std::vector<std::int64_t> dpages;
      slots_to_pages(d, ps, 16, "test", dpages);
      for (std::int64_t p : dpages) fill_page(view, p, 300 + p);
      stream->copy_async(dev.layout().base, staging.data(), dev.size_bytes());
      stream->synchronize();
      auto h = c.write(d, 0, NodeId{1});
      ASSERT_TRUE(h);
      auto acks = wait_acks(c, true, 1);
      ASSERT_EQ(acks.size(), 1u);
      ASSERT_TRUE(acks[0].ok);
      std::vector<std::int64_t> hpages;
      slots_to_pages(*h, ps, 16, "test", hpages);
      for (std::size_t i = 0; i < hpages.size(); ++i) {
        std::string where;
        ASSERT_TRUE(verify_page(host.layout(), hpages[i], 300 + dpages[i], &where))
            << to_string(io) << " " << to_string(layout) << " " << where;
      }
      c.evict_device(d, *h);
      std::memset(staging.data(), 0, staging.size());
      stream->copy_async(dev.layout().base, staging.data(), dev.size_bytes());
      stream->synchronize();
      auto back = c.load(*h, 0, NodeId{2});
      ASSERT_TRUE(back);
      const std::int32_t slot = c.start_loading();
      for (std::int32_t layer = 0; layer < g.num_layers; ++layer) {
        ASSERT_TRUE(dev.wait_for_layer(layer)) << "layer " << layer;
      }
      c.layer_done_counter().release(slot);
      ASSERT_EQ(wait_acks(c, false, 1).size(), 1u);
      stream->copy_async(staging.data(), dev.layout().base, dev.size_bytes());
      stream->synchronize();
      std::vector<std::int64_t> bpages;
      slots_to_pages(*back, ps, 16, "test", bpages);
      for (std::size_t i = 0; i < bpages.size(); ++i) {
        std::string where;
        ASSERT_TRUE(verify_page(view, bpages[i], 300 + dpages[i], &where))
            << to_string(io) << " " << to_string(layout) << " " << where;
      }
      c.evict_device(*back, *h);
      c.evict_host(*h);
      EXPECT_EQ(host.free_tokens(), host.capacity_tokens());
      EXPECT_EQ(dev.allocator().free_tokens(), dev.capacity_tokens());
      // One write of 12 MiB and one load: auto takes the kernel for the write (and for
      // page_first's load), direct for the others.
      const ControllerStats stats = c.stats();
      const bool page_first = layout == HostLayout::kPageFirst;
      const std::uint64_t kernel = io == IoBackend::kKernel ? 2
                                   : io == IoBackend::kDirect ? 0
                                   : page_first               ? 2
                                                              : 1;
      EXPECT_EQ(stats.kernel_batches, kernel) << to_string(io) << " " << to_string(layout);
      EXPECT_EQ(stats.direct_batches, 2 - kernel) << to_string(io) << " " << to_string(layout);
    }
  }
}

}  // namespace
}  // namespace hicache
