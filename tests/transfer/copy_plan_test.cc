// L1 -> L2 -> L1 through copy plans, byte for byte, for every host layout and MHA/MLA.
#include "transfer/copy_plan.h"

#include <gtest/gtest.h>

#include "pools/device_kv_pool.h"
#include "pools/host_kv_pool.h"
#include "pools/kv_pattern.h"
#include "transfer/errors.h"
#include "transfer/host_device.h"

namespace hicache {
namespace {

std::vector<KVGeometry> geometries() {
  return {KVGeometry::mha(3, 2, 8, DType::kFloat16, 4), KVGeometry::mha(2, 1, 3, DType::kFloat8E4M3, 8),
          KVGeometry::mla(3, 16, 4, DType::kBFloat16, 4)};
}

TEST(CopyPlan, RoundTripDeviceHostDeviceEveryLayout) {
  HostDevice device;
  auto stream = device.create_stream();
  for (const KVGeometry& g : geometries()) {
    for (HostLayout layout :
         {HostLayout::kLayerFirst, HostLayout::kPageFirst, HostLayout::kPageFirstDirect}) {
      DeviceKVPool dev(device, g, 8 * g.page_size);
      HostKVPool host(device, g, layout, 6 * g.page_size);
      const std::vector<std::int64_t> dev_pages{5, 1, 2}, host_pages{4, 0, 3}, back{0, 7, 3};
      for (std::int64_t p : dev_pages) fill_page(dev.layout(), p, 100 + p);
      std::vector<CopyRegion> regions;
      append_page_copies(host.layout(), host_pages, dev.layout(), dev_pages, 0, g.num_layers,
                         regions);
      stream->copy_batch_async(regions);
      stream->synchronize();
      for (std::size_t i = 0; i < 3; ++i) {
        std::string where;
        ASSERT_TRUE(verify_page(host.layout(), host_pages[i], 100 + dev_pages[i], &where))
            << to_string(layout) << " " << g.describe() << " " << where;
      }
      // Back into other device pages, one layer at a time as the load thread does.
      for (std::int32_t layer = 0; layer < g.num_layers; ++layer) {
        regions.clear();
        append_page_copies(dev.layout(), back, host.layout(), host_pages, layer, layer + 1,
                           regions);
        stream->copy_batch_async(regions);
      }
      stream->synchronize();
      for (std::size_t i = 0; i < 3; ++i) {
        std::string where;
        ASSERT_TRUE(verify_page(dev.layout(), back[i], 100 + dev_pages[i], &where))
            << to_string(layout) << " " << g.describe() << " " << where;
      }
      // Untouched host pages stay zero: no copy strayed outside its page.
      EXPECT_FALSE(verify_page(host.layout(), 1, 101));
    }
  }
}

TEST(CopyPlan, RejectsMismatchedInputsAndAppendsNothing) {
  HostDevice device;
  auto g = KVGeometry::mha(2, 1, 8, DType::kFloat16, 4);
  DeviceKVPool dev(device, g, 16);
  HostKVPool host(device, g, HostLayout::kPageFirst, 16);
  HostKVPool other(device, KVGeometry::mha(2, 2, 8, DType::kFloat16, 4), HostLayout::kPageFirst,
                   16);
  std::vector<CopyRegion> regions;
  const std::vector<std::int64_t> one{0}, two{0, 1}, out_of_range{4}, negative{-1};
  EXPECT_THROW(append_page_copies(host.layout(), one, dev.layout(), two, 0, 2, regions),
               InvalidArgument);
  EXPECT_THROW(append_page_copies(host.layout(), out_of_range, dev.layout(), one, 0, 2, regions),
               InvalidArgument);
  EXPECT_THROW(append_page_copies(host.layout(), one, dev.layout(), negative, 0, 2, regions),
               InvalidArgument);
  EXPECT_THROW(append_page_copies(host.layout(), one, dev.layout(), one, 1, 1, regions),
               InvalidArgument);
  EXPECT_THROW(append_page_copies(host.layout(), one, dev.layout(), one, 0, 3, regions),
               InvalidArgument);
  EXPECT_THROW(append_page_copies(other.layout(), one, dev.layout(), one, 0, 2, regions),
               InvalidArgument);
  EXPECT_TRUE(regions.empty());
}

}  // namespace
}  // namespace hicache
