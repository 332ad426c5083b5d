// CudaDevice tests: run on a machine with a GPU, skip with the reason elsewhere.
#include <gtest/gtest.h>

#include <cstring>

#include "pools/device_kv_pool.h"
#include "pools/host_kv_pool.h"
#include "pools/kv_pattern.h"
#include "transfer/copy_plan.h"
#include "transfer/device.h"
#include "transfer/errors.h"

namespace hicache {
namespace {

class CudaDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!Device::cuda_available(&why)) GTEST_SKIP() << "no usable GPU: " << why;
    device_ = Device::create("cuda");
  }
  std::unique_ptr<Device> device_;
};

TEST_F(CudaDeviceTest, CopiesRoundTripThroughDeviceMemory) {
  ASSERT_EQ(device_->backend(), DeviceBackend::kCuda);
  Buffer host = device_->alloc_host(8 << 20);
  Buffer back = device_->alloc_host(8 << 20);
  Buffer dev = device_->alloc_device(8 << 20);
  for (std::size_t i = 0; i < host.size(); ++i) host.data()[i] = std::byte(i * 131 + 3);
  auto stream = device_->create_stream();
  stream->copy_async(dev.data(), host.data(), host.size());
  stream->copy_async(back.data(), dev.data(), host.size());
  stream->synchronize();
  EXPECT_EQ(std::memcmp(host.data(), back.data(), host.size()), 0);
}

// CUDA host functions must not block on the test thread (the runtime may serialise them with
// other work and deadlock), so ordering is shown with a copy large enough that a consumer
// ignoring the event would read the destination before the producer's copy lands.
TEST_F(CudaDeviceTest, StreamWaitOrdersWorkAcrossStreams) {
  constexpr std::size_t kBytes = std::size_t{256} << 20;
  auto a = device_->create_stream();
  auto b = device_->create_stream();
  auto e = device_->create_event();
  Buffer host = device_->alloc_host(kBytes);
  Buffer dev = device_->alloc_device(kBytes);
  Buffer out = device_->alloc_host(kBytes);
  for (int round = 1; round <= 3; ++round) {
    std::memset(host.data(), 0x10 + round, kBytes);
    a->copy_async(dev.data(), host.data(), kBytes);
    a->record(*e);
    b->wait(*e);
    b->copy_async(out.data(), dev.data(), kBytes);
    b->synchronize();
    EXPECT_TRUE(e->query());
    for (std::size_t i = 0; i < kBytes; i += 4096) {
      ASSERT_EQ(out.data()[i], std::byte(0x10 + round)) << "round " << round << " byte " << i;
    }
    ASSERT_EQ(out.data()[kBytes - 1], std::byte(0x10 + round));
  }
}

TEST_F(CudaDeviceTest, HostFuncFailureIsReportedBySynchronize) {
  auto s = device_->create_stream();
  s->launch_host_func([] { throw std::runtime_error("cuda host func boom"); });
  try {
    s->synchronize();
    FAIL();
  } catch (const DeviceError& e) {
    EXPECT_NE(std::string(e.what()).find("cuda host func boom"), std::string::npos);
  }
  EXPECT_NO_THROW(s->synchronize());
}

TEST_F(CudaDeviceTest, PoolsRoundTripEveryLayoutByteForByte) {
  auto g = KVGeometry::mha(4, 2, 64, DType::kBFloat16, 16);
  auto stream = device_->create_stream();
  for (HostLayout layout :
       {HostLayout::kLayerFirst, HostLayout::kPageFirst, HostLayout::kPageFirstDirect}) {
    DeviceKVPool dev(*device_, g, 8 * 16);
    HostKVPool host(*device_, g, layout, 8 * 16);
    for (std::int64_t p = 0; p < 4; ++p) fill_page(host.layout(), p, 500 + p);
    const std::vector<std::int64_t> host_pages{0, 1, 2, 3}, dev_pages{6, 2, 7, 0},
        back_pages{7, 6, 5, 4};
    std::vector<CopyRegion> regions;
    append_page_copies(dev.layout(), dev_pages, host.layout(), host_pages, 0, 4, regions);
    append_page_copies(host.layout(), back_pages, dev.layout(), dev_pages, 0, 4, regions);
    stream->copy_batch_async(regions);
    stream->synchronize();
    for (std::size_t i = 0; i < 4; ++i) {
      std::string where;
      EXPECT_TRUE(verify_page(host.layout(), back_pages[i], 500 + host_pages[i], &where))
          << to_string(layout) << " " << where;
    }
  }
}

// The CUDA kernel against the CPU implementation of the same index math: every layout, both
// directions, MHA and MLA, unit sizes down to 3 bytes, a capped and an uncapped grid; the
// destination is poisoned so every byte is checked.
TEST_F(CudaDeviceTest, TransferKernelMatchesCpuForEveryLayoutAndDirection) {
  const KVGeometry geometries[] = {KVGeometry::mha(3, 8, 128, DType::kFloat16, 16),
                                   KVGeometry::mha(2, 1, 3, DType::kFloat8E4M3, 8),
                                   KVGeometry::mla(3, 512, 64, DType::kBFloat16, 4)};
  auto stream = device_->create_stream();
  Buffer lists = device_->alloc_host(4096);
  auto* src_pages = reinterpret_cast<std::int64_t*>(lists.data());
  auto* dst_pages = src_pages + 64;
  const std::int64_t n = 5;
  const std::int64_t sp[n] = {9, 0, 4, 11, 2}, dp[n] = {3, 10, 1, 7, 6};
  std::copy(sp, sp + n, src_pages);
  std::copy(dp, dp + n, dst_pages);
  for (const KVGeometry& g : geometries) {
    const std::int64_t tokens = 12 * g.page_size;
    const auto bytes = static_cast<std::size_t>(kv_buffer_bytes(g, tokens));
    DeviceKVPool dev(*device_, g, tokens);
    Buffer staging = device_->alloc_host(bytes);
    for (HostLayout layout :
         {HostLayout::kLayerFirst, HostLayout::kPageFirst, HostLayout::kPageFirstDirect}) {
      for (int max_blocks : {0, 3}) {
        HostKVPool host(*device_, g, layout, tokens);
        for (std::int64_t p = 0; p < 12; ++p) fill_page(host.layout(), p, 7 * p + 1);
        // H2D by the kernel, into a poisoned device pool.
        std::memset(staging.data(), 0xC3, bytes);
        stream->copy_async(dev.layout().base, staging.data(), bytes);
        stream->transfer_pages_async(
            {dev.layout(), host.layout(), dst_pages, src_pages, n, 0, g.num_layers}, max_blocks);
        stream->copy_async(staging.data(), dev.layout().base, bytes);
        stream->synchronize();
        LayoutDesc seen = dev.layout();
        seen.base = reinterpret_cast<std::uint8_t*>(staging.data());
        // The CPU reference of the same transfer, on a poisoned host copy.
        std::vector<std::uint8_t> expected(bytes, 0xC3);
        LayoutDesc ref = dev.layout();
        ref.base = expected.data();
        transfer_pages_cpu({ref, host.layout(), dst_pages, src_pages, n, 0, g.num_layers});
        ASSERT_EQ(std::memcmp(expected.data(), staging.data(), bytes), 0)
            << "H2D " << to_string(layout) << " " << g.describe() << " blocks " << max_blocks;
        for (std::int64_t i = 0; i < n; ++i) ASSERT_TRUE(verify_page(seen, dp[i], 7 * sp[i] + 1));
        // D2H by the kernel, one layer per launch as the load/write threads do.
        HostKVPool back(*device_, g, layout, tokens);
        std::memset(back.layout().base, 0x3C, back.size_bytes());
        for (std::int32_t layer = 0; layer < g.num_layers; ++layer) {
          stream->transfer_pages_async(
              {back.layout(), dev.layout(), src_pages, dst_pages, n, layer, layer + 1},
              max_blocks);
        }
        stream->synchronize();
        for (std::int64_t i = 0; i < n; ++i) {
          std::string where;
          ASSERT_TRUE(verify_page(back.layout(), sp[i], 7 * sp[i] + 1, &where))
              << "D2H " << to_string(layout) << " " << where;
        }
        ASSERT_FALSE(verify_page(back.layout(), 1, 8));  // untouched page keeps its poison
      }
    }
  }
}

}  // namespace
}  // namespace hicache
