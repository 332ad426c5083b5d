#include "pools/device_kv_pool.h"

#include <gtest/gtest.h>

#include <vector>

#include "transfer/errors.h"
#include "transfer/host_device.h"

namespace hicache {
namespace {

TEST(DeviceKVPool, PerLayerBuffersAreDisjointAndInOrder) {
  HostDevice device;
  auto g = KVGeometry::mha(3, 2, 4, DType::kFloat16, 4);
  DeviceKVPool pool(device, g, 32);
  const std::int64_t buffer_bytes = 32 * g.unit_bytes();
  EXPECT_EQ(pool.size_bytes() >= static_cast<std::size_t>(buffer_bytes * 6), true);
  for (std::int32_t layer = 0; layer < 3; ++layer) {
    EXPECT_EQ(pool.k_buffer(layer) + buffer_bytes, pool.v_buffer(layer));
    if (layer > 0) {
      EXPECT_EQ(pool.v_buffer(layer - 1) + buffer_bytes, pool.k_buffer(layer));
    }
  }
  EXPECT_THROW(pool.k_buffer(3), InvalidArgument);
  EXPECT_THROW(pool.buffer(0, 2), InvalidArgument);
  EXPECT_EQ(pool.allocator().capacity_tokens(), 32);
}

TEST(DeviceKVPool, MlaHasOnlyTheLatentBuffer) {
  HostDevice device;
  DeviceKVPool pool(device, KVGeometry::mla(2, 16, 4, DType::kBFloat16, 4), 8);
  EXPECT_NO_THROW(pool.buffer(1, 0));
  EXPECT_THROW(pool.v_buffer(0), InvalidArgument);
}

TEST(DeviceKVPool, LayerWaitHookSeesEveryLayerInOrder) {
  HostDevice device;
  DeviceKVPool pool(device, KVGeometry::mha(4, 1, 8, DType::kFloat32, 2), 8);
  EXPECT_TRUE(pool.wait_for_layer(0));  // no hook: returns at once
  std::vector<std::int32_t> seen;
  pool.set_layer_wait_hook([&](std::int32_t layer) {
    seen.push_back(layer);
    return layer != 2;  // layer 2's loads failed
  });
  for (std::int32_t layer = 0; layer < 4; ++layer) {
    EXPECT_EQ(pool.wait_for_layer(layer), layer != 2) << "layer " << layer;
  }
  EXPECT_EQ(seen, (std::vector<std::int32_t>{0, 1, 2, 3}));
  EXPECT_THROW((void)pool.wait_for_layer(4), InvalidArgument);
  EXPECT_EQ(seen.size(), 4u);
}

TEST(DeviceKVPool, RejectsBadSizes) {
  HostDevice device;
  auto g = KVGeometry::mha(2, 1, 8, DType::kFloat16, 4);
  EXPECT_THROW(DeviceKVPool(device, g, 0), InvalidArgument);
  EXPECT_THROW(DeviceKVPool(device, g, -4), InvalidArgument);
  EXPECT_THROW(DeviceKVPool(device, g, 5), InvalidArgument);
}

}  // namespace
}  // namespace hicache
