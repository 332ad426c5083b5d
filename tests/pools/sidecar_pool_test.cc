#include "pools/sidecar_pool.h"

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "transfer/errors.h"
#include "transfer/host_device.h"

namespace hicache {
namespace {

SidecarSpec mamba() {
  return SidecarSpec{.name = "mamba",
                     .policy = SidecarHitPolicy::kTrailing,
                     .window_pages = 1,
                     .layers = 3,
                     .slots_per_page = 1,
                     .slot_bytes = 8192,
                     .dtype = DType::kBFloat16,
                     .device_pages = 4,
                     .host_pages = 10};
}

std::string error_of(const SidecarSpec& spec) {
  try {
    spec.validate();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

TEST(SidecarSpec, PoliciesParseByNameAndABadOneIsNamed) {
  EXPECT_EQ(parse_sidecar_hit_policy("all_pages"), SidecarHitPolicy::kAllPages);
  EXPECT_EQ(parse_sidecar_hit_policy("trailing"), SidecarHitPolicy::kTrailing);
  EXPECT_EQ(parse_sidecar_hit_policy("trailing_pages"), SidecarHitPolicy::kTrailing);
  EXPECT_EQ(to_string(SidecarHitPolicy::kTrailing), "trailing");
  try {
    parse_sidecar_hit_policy("last_page");
    FAIL() << "accepted last_page";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'last_page'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("all_pages, trailing"), std::string::npos) << e.what();
  }
}

TEST(SidecarSpec, AGoodSpecHasALatentShapedGeometryOfItsOwnSize) {
  const SidecarSpec s = mamba();
  EXPECT_EQ(error_of(s), "");
  EXPECT_EQ(s.page_bytes(), 3 * 8192);
  const KVGeometry g = s.geometry();
  EXPECT_EQ(g.attention, AttentionKind::kMLA);
  EXPECT_EQ(g.num_layers, 3);
  EXPECT_EQ(g.page_size, 1);
  EXPECT_EQ(g.page_bytes(), s.page_bytes());
  EXPECT_EQ(s.describe(),
            "mamba: trailing (window 1), 3 layers x 1 slot x 8 KiB bf16 = 24 KiB/page, "
            "device 4 / host 10 pages");
  // Per-token data: a page is the KV page's tokens.
  SidecarSpec swa = s;
  swa.name = "swa";
  swa.window_pages = 4;
  swa.slots_per_page = 16;
  swa.slot_bytes = 256;
  EXPECT_EQ(error_of(swa), "");
  EXPECT_EQ(swa.page_bytes(), 3 * 16 * 256);
  EXPECT_EQ(swa.geometry().page_size, 16);
}

TEST(SidecarSpec, EachBadFieldIsNamedWithItsValue) {
  struct Case {
    void (*change)(SidecarSpec&);
    const char* expect;
  };
  const Case cases[] = {
      {[](SidecarSpec& s) { s.name = ""; }, "a name is 1-64 characters"},
      {[](SidecarSpec& s) { s.name = "kv"; }, "sidecar pool 'kv'"},
      {[](SidecarSpec& s) { s.name = "Mamba"; }, "sidecar pool 'Mamba'"},
      {[](SidecarSpec& s) { s.name = std::string(65, 'a'); }, "1-64 characters"},
      {[](SidecarSpec& s) { s.layers = 0; }, "layers 0: must be > 0"},
      {[](SidecarSpec& s) { s.slots_per_page = -1; }, "slots_per_page -1: must be > 0"},
      {[](SidecarSpec& s) { s.window_pages = 0; }, "window_pages 0: must be > 0"},
      {[](SidecarSpec& s) {
         s.policy = SidecarHitPolicy::kAllPages;
         s.window_pages = 2;
       },
       "window_pages 2: applies to the trailing policy only"},
      {[](SidecarSpec& s) { s.slot_bytes = 7; }, "slot_bytes 7: must be a positive multiple of 2"},
      {[](SidecarSpec& s) { s.slot_bytes = 0; }, "slot_bytes 0"},
      {[](SidecarSpec& s) { s.slot_bytes = (std::int64_t{1} << 30) + 2; }, "at most 1 GiB"},
      {[](SidecarSpec& s) { s.device_pages = 0; }, "device_pages 0: must be > 0"},
      {[](SidecarSpec& s) { s.host_pages = 3; }, "host_pages 3: must be at least device_pages (4)"},
      {[](SidecarSpec& s) { s.host_pages = std::int64_t{1} << 60; }, "larger than an int64"},
  };
  for (const Case& c : cases) {
    SidecarSpec s = mamba();
    c.change(s);
    const std::string e = error_of(s);
    EXPECT_NE(e.find(c.expect), std::string::npos) << "got: " << e << "\nwanted: " << c.expect;
  }
}

// The pool's tiers are sized by its own spec, whatever the KV pools are, and a page written on
// either tier reads back byte for byte through the host pool's storage views.
TEST(SidecarPool, TiersAreSizedByTheSpecAndPagesRoundTrip) {
  HostDevice device;
  const SidecarSpec s = mamba();
  SidecarPool pool(device, s);
  EXPECT_EQ(pool.device_pool().num_pages(), 4);
  EXPECT_EQ(pool.device_pool().size_bytes(), static_cast<std::size_t>(4 * s.page_bytes()));
  EXPECT_EQ(pool.host_pool().num_pages(), 10);
  EXPECT_EQ(pool.host_pool().size_bytes(), static_cast<std::size_t>(10 * s.page_bytes()));
  ASSERT_TRUE(pool.host_pool().has_contiguous_pages());
  auto slots = pool.host_pool().alloc(2);
  ASSERT_TRUE(slots);
  std::vector<std::byte> in(static_cast<std::size_t>(s.page_bytes()));
  for (std::size_t i = 0; i < in.size(); ++i) in[i] = static_cast<std::byte>(i * 7 + 3);
  pool.host_pool().copy_page_in((*slots)[1], in);
  std::vector<std::byte> out(in.size());
  pool.host_pool().copy_page_out((*slots)[1], out);
  EXPECT_EQ(out, in);
  const auto view = pool.host_pool().page_bytes((*slots)[1]);
  ASSERT_EQ(view.size(), in.size());
  EXPECT_TRUE(std::equal(view.begin(), view.end(), in.begin()));
  pool.host_pool().free(*slots);
  EXPECT_EQ(pool.host_pool().free_tokens(), 10);
}

// The engine's device memory (SGLang's order: layers, slots, 1, elements) is the device tier:
// a page written through the pool's layout is in the engine's buffer where the engine reads it;
// a buffer of another size is refused naming the pool and both sizes.
TEST(SidecarPool, TheEnginesDeviceMemoryIsTheDeviceTier) {
  HostDevice device;
  const SidecarSpec s = mamba();  // 3 layers x 8192 bytes, 4 pages of 1 slot
  const std::int64_t elems = s.slot_bytes / 2;
  std::vector<std::uint16_t> engine(static_cast<std::size_t>(s.layers * s.device_pages * elems));
  SidecarPool pool(device, s,
                   ExternalKVBuffer{engine.data(), engine.size() * sizeof(std::uint16_t),
                                    DimOrder::kSglang});
  EXPECT_EQ(pool.device_pool().num_pages(), 4);
  const LayoutDesc& d = pool.device_pool().layout();
  // Slot 2, layer 1: the engine's [1][2][0][*].
  const std::uint16_t mark = 0xBEEF;
  std::memcpy(d.base + unit_offset(d, 1, 0, 2), &mark, sizeof(mark));
  EXPECT_EQ(engine[static_cast<std::size_t>((1 * s.device_pages + 2) * elems)], 0xBEEF);
  try {
    SidecarPool short_pool(device, s, ExternalKVBuffer{engine.data(), 100, DimOrder::kSglang});
    FAIL() << "wrapped a short buffer";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("sidecar pool 'mamba': the engine's device buffer is "
                                         "100 bytes; it must be 98304 bytes"),
              std::string::npos)
        << e.what();
  }
}

TEST(SidecarPool, ABadSpecAllocatesNothingAndIsNamed) {
  HostDevice device;
  SidecarSpec s = mamba();
  s.host_pages = 1;
  try {
    SidecarPool pool(device, s);
    FAIL() << "built a pool with fewer host than device pages";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("sidecar pool 'mamba': host_pages 1"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace hicache
