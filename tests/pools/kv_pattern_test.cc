#include "pools/kv_pattern.h"

#include <gtest/gtest.h>

#include <vector>

#include "pools/kv_layout.h"

namespace hicache {
namespace {

TEST(KVPattern, DependsOnKeyLayerKvAndOffset) {
  std::vector<std::byte> a(64), b(64);
  fill_pattern(a, 1, 0, 0);
  fill_pattern(b, 1, 0, 0);
  EXPECT_EQ(a, b);
  for (auto [key, layer, kv] : {std::tuple{2, 0, 0}, {1, 1, 0}, {1, 0, 1}}) {
    fill_pattern(b, key, layer, kv);
    EXPECT_NE(a, b) << key << layer << kv;
  }
  // A run filled from an unaligned offset equals the tail of the run filled from 0.
  std::vector<std::byte> tail(61);
  fill_pattern(tail, 1, 0, 0, 3);
  EXPECT_TRUE(std::equal(tail.begin(), tail.end(), a.begin() + 3));
  EXPECT_EQ(find_pattern_mismatch(a, 1, 0, 0), -1);
  a[37] ^= std::byte{1};
  EXPECT_EQ(find_pattern_mismatch(a, 1, 0, 0), 37);
}

TEST(KVPattern, VerifyPageFindsASingleFlippedByteInEveryLayout) {
  auto g = KVGeometry::mha(2, 2, 3, DType::kFloat16, 4);  // 12-byte units: unaligned runs
  for (HostLayout layout :
       {HostLayout::kLayerFirst, HostLayout::kPageFirst, HostLayout::kPageFirstDirect}) {
    std::vector<std::uint8_t> mem(kv_buffer_bytes(g, 8));
    LayoutDesc d = make_host_layout(layout, g, 8, mem.data());
    fill_page(d, 1, 9);
    ASSERT_TRUE(verify_page(d, 1, 9));
    EXPECT_FALSE(verify_page(d, 1, 10));
    mem[unit_offset(d, 1, 1, 6) + 5] ^= 0x80;
    std::string where;
    EXPECT_FALSE(verify_page(d, 1, 9, &where));
    EXPECT_EQ(where, "page 1 layer 1 kv 1 token 2 byte 5") << to_string(layout);
  }
}

}  // namespace
}  // namespace hicache
