// Layout offset math against naive formulas written from each layout's array shape.
#include "pools/kv_layout.h"

#include <gtest/gtest.h>

#include <set>

#include "transfer/errors.h"

namespace hicache {
namespace {

// Offset of (layer, kv, token) in a C array of the documented shape, in units.
std::int64_t naive_units(HostLayout layout, std::int64_t L, std::int64_t KV, std::int64_t T,
                         std::int64_t PS, std::int64_t layer, std::int64_t kv, std::int64_t token) {
  const std::int64_t page = token / PS, in_page = token % PS;
  switch (layout) {
    case HostLayout::kLayerFirst:  // [L][KV][T]
      return (layer * KV + kv) * T + token;
    case HostLayout::kPageFirst:  // [P][PS][L][KV]
      return ((page * PS + in_page) * L + layer) * KV + kv;
    case HostLayout::kPageFirstDirect:  // [P][L][KV][PS]
      return ((page * L + layer) * KV + kv) * PS + in_page;
  }
  return -1;
}

struct Shape {
  KVGeometry geometry;
  std::int64_t tokens;
};

std::vector<Shape> shapes() {
  return {{KVGeometry::mha(3, 2, 8, DType::kFloat16, 4), 16},
          {KVGeometry::mha(5, 1, 3, DType::kFloat8E4M3, 8), 40},
          {KVGeometry::mla(4, 16, 4, DType::kBFloat16, 4), 12},
          {KVGeometry::mla(2, 7, 0, DType::kFloat32, 2), 6}};
}

TEST(KVLayout, EveryLayoutMatchesItsNaiveFormulaForMhaAndMla) {
  for (const Shape& s : shapes()) {
    for (HostLayout layout :
         {HostLayout::kLayerFirst, HostLayout::kPageFirst, HostLayout::kPageFirstDirect}) {
      const LayoutDesc d = make_host_layout(layout, s.geometry, s.tokens, nullptr);
      const auto& g = s.geometry;
      std::set<std::int64_t> seen;
      for (std::int32_t layer = 0; layer < g.num_layers; ++layer) {
        for (std::int32_t kv = 0; kv < g.num_kv(); ++kv) {
          for (std::int64_t t = 0; t < s.tokens; ++t) {
            const std::int64_t expected =
                naive_units(layout, g.num_layers, g.num_kv(), s.tokens, g.page_size, layer, kv, t) *
                g.unit_bytes();
            ASSERT_EQ(unit_offset(d, layer, kv, t), expected)
                << to_string(layout) << " " << g.describe() << " layer " << layer << " kv " << kv
                << " token " << t;
            seen.insert(expected);
          }
        }
      }
      // The units tile the buffer exactly: distinct, and the last ends at the buffer's end.
      EXPECT_EQ(static_cast<std::int64_t>(seen.size()), s.tokens * g.num_layers * g.num_kv());
      EXPECT_EQ(*seen.rbegin() + g.unit_bytes(), kv_buffer_bytes(g, s.tokens));
    }
  }
}

TEST(KVLayout, DeviceLayoutIsTokenIndexedPerLayerAndKv) {
  auto g = KVGeometry::mha(3, 2, 8, DType::kFloat16, 4);
  const LayoutDesc d = make_device_layout(g, 16, nullptr);
  for (std::int32_t layer = 0; layer < 3; ++layer) {
    for (std::int32_t kv = 0; kv < 2; ++kv) {
      for (std::int64_t t = 0; t < 16; ++t) {
        EXPECT_EQ(unit_offset(d, layer, kv, t), ((layer * 2 + kv) * 16 + t) * g.unit_bytes());
      }
    }
  }
}

TEST(KVLayout, ContiguousPagesOnlyWherePagesAreBlocks) {
  auto g = KVGeometry::mha(3, 2, 8, DType::kFloat16, 4);
  EXPECT_FALSE(page_block_contiguous(make_host_layout(HostLayout::kLayerFirst, g, 16, nullptr)));
  EXPECT_TRUE(page_block_contiguous(make_host_layout(HostLayout::kPageFirst, g, 16, nullptr)));
  EXPECT_TRUE(
      page_block_contiguous(make_host_layout(HostLayout::kPageFirstDirect, g, 16, nullptr)));
  EXPECT_TRUE(page_run_contiguous(make_host_layout(HostLayout::kLayerFirst, g, 16, nullptr)));
  EXPECT_FALSE(page_run_contiguous(make_host_layout(HostLayout::kPageFirst, g, 16, nullptr)));
  EXPECT_TRUE(page_run_contiguous(make_host_layout(HostLayout::kPageFirstDirect, g, 16, nullptr)));
}

TEST(KVLayout, ParsesNamesAndRejectsUnknownOnes) {
  for (HostLayout l :
       {HostLayout::kLayerFirst, HostLayout::kPageFirst, HostLayout::kPageFirstDirect}) {
    EXPECT_EQ(parse_host_layout(to_string(l)), l);
  }
  try {
    parse_host_layout("page_last");
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'page_last'"), std::string::npos);
  }
}

TEST(KVLayout, RejectsTokenCountsThatAreNotPositivePageMultiples) {
  auto g = KVGeometry::mha(3, 2, 8, DType::kFloat16, 4);
  for (std::int64_t bad : {0L, -4L, 6L}) {
    try {
      make_host_layout(HostLayout::kPageFirst, g, bad, nullptr);
      ADD_FAILURE() << bad;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(std::to_string(bad) + " tokens"), std::string::npos)
          << e.what();
    }
  }
}

}  // namespace
}  // namespace hicache
