// The kernel I/O path's CPU implementation against the direct path (copy plans), and through
// a host stream, for every pair of layouts, MHA and MLA, and unit sizes that are not multiples
// of 16 bytes. The destination is poisoned first so every byte is checked.
#include "kernels/page_transfer.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "pools/kv_layout.h"
#include "pools/kv_pattern.h"
#include "transfer/copy_plan.h"
#include "transfer/errors.h"
#include "transfer/host_device.h"

namespace hicache {
namespace {

struct Arena {
  std::vector<std::uint8_t> bytes;
  LayoutDesc desc;
  Arena(const KVGeometry& g, std::int64_t tokens, HostLayout layout, std::uint8_t poison)
      : bytes(kv_buffer_bytes(g, tokens), poison),
        desc(make_host_layout(layout, g, tokens, bytes.data())) {}
};

const HostLayout kLayouts[] = {HostLayout::kLayerFirst, HostLayout::kPageFirst,
                               HostLayout::kPageFirstDirect};

std::vector<KVGeometry> geometries() {
  return {KVGeometry::mha(3, 2, 8, DType::kFloat16, 4),      // 32-byte units
          KVGeometry::mha(2, 1, 3, DType::kFloat8E4M3, 8),   // 3-byte units
          KVGeometry::mha(2, 3, 5, DType::kBFloat16, 2),     // 30-byte units
          KVGeometry::mla(3, 16, 4, DType::kBFloat16, 4)};   // 40-byte units
}

TEST(PageTransfer, CpuKernelPathMatchesDirectPathForEveryLayoutPair) {
  std::mt19937 rng(7);
  for (const KVGeometry& g : geometries()) {
    for (HostLayout from : kLayouts) {
      for (HostLayout to : kLayouts) {
        Arena src(g, 8 * g.page_size, from, 0);
        Arena a(g, 8 * g.page_size, to, 0xA5), b(g, 8 * g.page_size, to, 0xA5);
        for (std::int64_t p = 0; p < 8; ++p) fill_page(src.desc, p, 31 * p + 5);
        std::vector<std::int64_t> src_pages{6, 0, 3, 7}, dst_pages{1, 5, 2, 6};
        std::shuffle(dst_pages.begin(), dst_pages.end(), rng);
        const std::int32_t lb = 1 % g.num_layers, le = g.num_layers;
        PageTransfer t{a.desc, src.desc, dst_pages.data(), src_pages.data(), 4, lb, le};
        validate_page_transfer(t);
        transfer_pages_cpu(t);
        std::vector<CopyRegion> regions;
        append_page_copies(b.desc, dst_pages, src.desc, src_pages, lb, le, regions);
        for (const CopyRegion& r : regions) std::memcpy(r.dst, r.src, r.bytes);
        ASSERT_EQ(a.bytes, b.bytes) << to_string(from) << " -> " << to_string(to) << " "
                                    << g.describe();
        if (lb == 0) {
          for (std::size_t i = 0; i < 4; ++i) {
            ASSERT_TRUE(verify_page(a.desc, dst_pages[i], 31 * src_pages[i] + 5));
          }
        }
      }
    }
  }
}

TEST(PageTransfer, HostStreamRunsTheKernelPathInOrder) {
  HostDevice device;
  auto stream = device.create_stream();
  const auto g = KVGeometry::mha(4, 2, 8, DType::kFloat16, 4);
  Arena src(g, 16, HostLayout::kPageFirst, 0), dst(g, 16, HostLayout::kLayerFirst, 0xFF);
  for (std::int64_t p = 0; p < 4; ++p) fill_page(src.desc, p, p + 90);
  const std::vector<std::int64_t> sp{0, 1, 2, 3}, dp{3, 2, 1, 0};
  for (std::int32_t layer = 0; layer < 4; ++layer) {
    stream->transfer_pages_async({dst.desc, src.desc, dp.data(), sp.data(), 4, layer, layer + 1});
  }
  stream->synchronize();
  for (std::size_t i = 0; i < 4; ++i) EXPECT_TRUE(verify_page(dst.desc, dp[i], sp[i] + 90));
}

TEST(PageTransfer, VectorWidthFollowsAlignment) {
  const auto g16 = KVGeometry::mha(2, 2, 8, DType::kFloat16, 4);  // 32-byte units
  Arena a(g16, 8, HostLayout::kPageFirst, 0), b(g16, 8, HostLayout::kLayerFirst, 0);
  PageTransfer t{a.desc, b.desc, nullptr, nullptr, 0, 0, 2};
  EXPECT_EQ(transfer_vector_bytes(t), 16);
  t.src.base += 4;
  EXPECT_EQ(transfer_vector_bytes(t), 4);
  const auto g3 = KVGeometry::mha(2, 1, 3, DType::kFloat8E4M3, 4);  // 3-byte units
  Arena c(g3, 8, HostLayout::kPageFirst, 0), d(g3, 8, HostLayout::kPageFirst, 0);
  EXPECT_EQ(transfer_vector_bytes({c.desc, d.desc, nullptr, nullptr, 0, 0, 2}), 1);
}

TEST(PageTransfer, StreamRejectsBadTransfersAndEnqueuesNothing) {
  HostDevice device;
  auto stream = device.create_stream();
  const auto g = KVGeometry::mha(2, 2, 8, DType::kFloat16, 4);
  Arena a(g, 8, HostLayout::kPageFirst, 0), b(g, 8, HostLayout::kLayerFirst, 0);
  const std::vector<std::int64_t> ok{0}, bad{2}, neg{-1};
  EXPECT_THROW(stream->transfer_pages_async({a.desc, b.desc, bad.data(), ok.data(), 1, 0, 2}),
               InvalidArgument);
  EXPECT_THROW(stream->transfer_pages_async({a.desc, b.desc, ok.data(), neg.data(), 1, 0, 2}),
               InvalidArgument);
  EXPECT_THROW(stream->transfer_pages_async({a.desc, b.desc, ok.data(), ok.data(), 1, 0, 3}),
               InvalidArgument);
  EXPECT_THROW(stream->transfer_pages_async({a.desc, b.desc, nullptr, nullptr, 1, 0, 2}),
               InvalidArgument);
  Arena other(KVGeometry::mha(2, 1, 8, DType::kFloat16, 4), 8, HostLayout::kPageFirst, 0);
  EXPECT_THROW(stream->transfer_pages_async({other.desc, b.desc, ok.data(), ok.data(), 1, 0, 2}),
               InvalidArgument);
  stream->synchronize();
  EXPECT_TRUE(std::all_of(a.bytes.begin(), a.bytes.end(), [](std::uint8_t x) { return x == 0; }));
}

}  // namespace
}  // namespace hicache
