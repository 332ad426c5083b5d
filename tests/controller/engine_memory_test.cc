// Engine-owned KV memory: a HiCache whose device and host pools wrap buffers the engine
// allocated, in SGLang's dimension orders (and hicache's), for every host layout, MHA and MLA.
// Every check reads the engine's buffers through the engine's own pointers and index math
// written here from SGLang's shapes, not through the pools. On the host backend and, where a GPU
// answers, on CUDA (device buffers from cudaMalloc through Device::alloc_device, host buffers
// plain pageable memory that the pool page-locks); without a GPU the CUDA cases skip.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "controller/hicache.h"
#include "pools/kv_pattern.h"
#include "tests/controller/wait_acks.h"
#include "transfer/errors.h"

namespace hicache {
namespace {

constexpr std::int32_t kLayers = 3, kPage = 4;
constexpr std::int64_t kDeviceTokens = 64, kHostTokens = 128;

KVGeometry geometry(bool mla) {
  return mla ? KVGeometry::mla(kLayers, 24, 8, DType::kBFloat16, kPage)
             : KVGeometry::mha(kLayers, 2, 8, DType::kBFloat16, kPage);
}

// Byte offset of (kv, layer, slot) in a buffer of `slots` slots, from the shapes alone.
std::int64_t sglang_offset(const std::string& layout, bool mla, std::int64_t slots, int kv,
                           int l, std::int64_t t, std::int64_t u) {
  const std::int64_t L = kLayers, P = kPage, c = mla ? 0 : kv;
  const std::int64_t half = mla ? 0 : c * L * slots * u;  // K/V outermost
  if (layout == "layer_first") return half + (l * slots + t) * u;                 // (2, L, S)
  if (layout == "page_first") return half + (t * L + l) * u;                      // (2, S, L)
  return half + ((t / P * L + l) * P + t % P) * u;                                // (2, S/P, L, P)
}
std::int64_t hicache_offset(const std::string& layout, bool mla, std::int64_t slots, int kv,
                            int l, std::int64_t t, std::int64_t u) {
  const std::int64_t L = kLayers, P = kPage, K = mla ? 1 : 2, c = mla ? 0 : kv;
  if (layout == "layer_first") return ((l * K + c) * slots + t) * u;               // [L][kv][T]
  if (layout == "page_first") return ((t * L + l) * K + c) * u;                   // [T][L][kv]
  return (((t / P * L + l) * K + c) * P + t % P) * u;                             // [p][L][kv][P]
}

struct Case {
  const char* backend;
  const char* layout;
  bool mla;
  bool sglang;
};

std::string name(const Case& c) {
  return std::string(c.backend) + "_" + c.layout + (c.mla ? "_mla" : "_mha") +
         (c.sglang ? "_sglang" : "_hicache");
}

class EngineMemory : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    std::string why;
    if (std::string_view(GetParam().backend) == "cuda" && !Device::cuda_available(&why)) {
      GTEST_SKIP() << "no usable GPU, the CUDA case of engine-owned memory is not run: " << why;
    }
    device_ = Device::create(GetParam().backend);
    stream_ = device_->create_stream();
  }
  // Bytes between device memory and the host, through the runtime (device memory may not be
  // addressable from the CPU).
  void to_device(std::byte* dst, const std::vector<std::byte>& src) {
    stream_->copy_async(dst, src.data(), src.size());
    stream_->synchronize();
  }
  std::vector<std::byte> from_device(const std::byte* src, std::size_t n) {
    std::vector<std::byte> out(n);
    stream_->copy_async(out.data(), src, n);
    stream_->synchronize();
    return out;
  }
  // Writes 4 fresh device pages to the host and waits for the ack: ok.
  static void write_pages(HiCache& hc, std::vector<std::int64_t>& slots,
                          std::vector<std::int64_t>& host_slots) {
    auto fresh = hc.device_pool().allocator().alloc(4 * kPage);
    ASSERT_TRUE(fresh.has_value());
    slots = *fresh;
    auto written = hc.controller().write(slots, 0, NodeId{1});
    ASSERT_TRUE(written.has_value());
    host_slots = *written;
    const auto acks = wait_acks(hc.controller(), true, 1);
    ASSERT_EQ(acks.size(), 1u);
    ASSERT_TRUE(acks[0].ok);
  }
  // Loads host_slots into `into` as the forward pass would (every layer waited for), and waits
  // for the ack: ok.
  static void load_back(HiCache& hc, const std::vector<std::int64_t>& host_slots,
                        const std::vector<std::int64_t>& into) {
    ASSERT_TRUE(hc.controller().load_into(host_slots, into, 0, NodeId{2}));
    const std::int32_t counter = hc.controller().start_loading();
    ASSERT_GE(counter, 0);
    for (int l = 0; l < kLayers; ++l) ASSERT_TRUE(hc.device_pool().wait_for_layer(l));
    hc.controller().layer_done_counter().release(counter);
    const auto acks = wait_acks(hc.controller(), false, 1);
    ASSERT_EQ(acks.size(), 1u);
    ASSERT_TRUE(acks[0].ok);
  }

  std::unique_ptr<Device> device_;
  std::unique_ptr<Stream> stream_;
};

TEST_P(EngineMemory, PagesRoundTripThroughTheEnginesBuffersByteForByte) {
  const Case& c = GetParam();
  const KVGeometry g = geometry(c.mla);
  const std::int64_t u = g.unit_bytes();
  const auto offset = c.sglang ? sglang_offset : hicache_offset;
  // The engine's memory: device KV from the runtime, host KV a plain vector (pageable).
  const auto device_bytes = static_cast<std::size_t>(kv_buffer_bytes(g, kDeviceTokens));
  Buffer engine_device = device_->alloc_device(device_bytes);
  std::vector<std::byte> engine_host(static_cast<std::size_t>(kv_buffer_bytes(g, kHostTokens)));
  const DimOrder order = c.sglang ? DimOrder::kSglang : DimOrder::kHicache;

  HiCacheConfig config;
  config.device = c.backend;
  config.geometry = g;
  config.device_tokens = kDeviceTokens;
  config.host_size = HostPoolSize{.tokens = kHostTokens};
  config.host_layout = parse_host_layout(c.layout);
  config.controller.io_backend = IoBackend::kKernel;
  config.metrics = false;
  HiCacheParts parts{.device = device_.get()};
  parts.device_kv = ExternalKVBuffer{engine_device.data(), device_bytes, order};
  parts.host_kv = ExternalKVBuffer{engine_host.data(), engine_host.size(), order};
  HiCache hc(config, std::move(parts));
  ASSERT_TRUE(hc.device_pool().wraps_engine_memory());
  ASSERT_TRUE(hc.host_pool().wraps_engine_memory());
  ASSERT_EQ(reinterpret_cast<void*>(hc.device_pool().k_buffer(0)), engine_device.data());

  // The engine writes its KV (random bytes) into device slots, in its own order.
  std::vector<std::byte> image(device_bytes);
  std::mt19937_64 rng(7);
  for (auto& b : image) b = static_cast<std::byte>(rng());
  to_device(engine_device.data(), image);

  // Device -> host: the engine's host buffer holds those bytes where SGLang's shapes put them.
  std::vector<std::int64_t> slots, host_slots;
  write_pages(hc, slots, host_slots);
  if (HasFatalFailure()) return;
  const int kvs = c.mla ? 1 : 2;
  for (std::size_t i = 0; i < slots.size(); ++i) {
    for (int kv = 0; kv < kvs; ++kv) {
      for (int l = 0; l < kLayers; ++l) {
        const auto d = offset("layer_first", c.mla, kDeviceTokens, kv, l, slots[i], u);
        const auto h = offset(c.layout, c.mla, kHostTokens, kv, l, host_slots[i], u);
        ASSERT_EQ(std::memcmp(engine_host.data() + h, image.data() + d, static_cast<std::size_t>(u)), 0)
            << "slot " << slots[i] << " -> host slot " << host_slots[i] << ", layer " << l
            << ", kv " << kv;
      }
    }
  }

  // Host -> device, into slots the engine chose: the engine's device buffer gets the bytes back.
  hc.controller().evict_device(slots, host_slots);
  auto into = hc.device_pool().allocator().alloc(4 * kPage);
  ASSERT_TRUE(into.has_value());
  to_device(engine_device.data(), std::vector<std::byte>(device_bytes));  // engine zeroes it
  load_back(hc, host_slots, *into);
  if (HasFatalFailure()) return;
  const auto back = from_device(engine_device.data(), device_bytes);
  for (std::size_t i = 0; i < into->size(); ++i) {
    for (int kv = 0; kv < kvs; ++kv) {
      for (int l = 0; l < kLayers; ++l) {
        const auto now = offset("layer_first", c.mla, kDeviceTokens, kv, l, (*into)[i], u);
        const auto was = offset("layer_first", c.mla, kDeviceTokens, kv, l, slots[i], u);
        ASSERT_EQ(std::memcmp(back.data() + now, image.data() + was, static_cast<std::size_t>(u)), 0)
            << "device slot " << (*into)[i] << ", layer " << l << ", kv " << kv;
      }
    }
  }
  hc.stop();
  // Nothing of the engine's memory was freed or moved: it is still the engine's to read.
  EXPECT_EQ(from_device(engine_device.data(), 16).size(), 16u);
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (const char* backend : {"host", "cuda"}) {
    for (const char* layout : {"layer_first", "page_first", "page_first_direct"}) {
      for (bool mla : {false, true}) {
        for (bool sglang : {true, false}) out.push_back({backend, layout, mla, sglang});
      }
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Layouts, EngineMemory, ::testing::ValuesIn(cases()),
                         [](const auto& p) { return name(p.param); });

// SGLang's device pool is a list of per-layer K and V tensors. Cut from one allocation at a
// constant stride they are addressed by strides, at unrelated addresses through a table; buffers
// that overlap, are missing or have another size are refused, naming them.
TEST(EngineMemoryBuffers, PerLayerBuffersAreWrappedWhereverTheyLieAndBadOnesRefused) {
  auto device = Device::create("host");
  const KVGeometry g = geometry(false);
  const std::int64_t run = kDeviceTokens * g.unit_bytes();
  // Layer l's K at l * 2 * run, its V at (2l + 1) * run: interleaved, stride 2 * run.
  std::vector<std::byte> memory(static_cast<std::size_t>(2 * kLayers * run));
  std::vector<void*> k, v;
  for (int l = 0; l < kLayers; ++l) {
    k.push_back(memory.data() + 2 * l * run);
    v.push_back(memory.data() + (2 * l + 1) * run);
  }
  const auto each = static_cast<std::size_t>(run);
  DeviceKVPool pool(*device, g, kDeviceTokens, k, v, each);
  for (int l = 0; l < kLayers; ++l) {
    EXPECT_EQ(static_cast<void*>(pool.k_buffer(l)), k[l]);
    EXPECT_EQ(static_cast<void*>(pool.v_buffer(l)), v[l]);
  }
  EXPECT_EQ(pool.layout().layer_offsets, nullptr) << "one stride needs no table";
  // Layer 2's K elsewhere (past the others, unaligned to them): through the table.
  std::vector<std::byte> more(static_cast<std::size_t>(2 * kLayers * run + run + 64));
  auto moved = k;
  moved[2] = more.data() + 64;
  DeviceKVPool table(*device, g, kDeviceTokens, moved, v, each);
  ASSERT_NE(table.layout().layer_offsets, nullptr);
  for (int l = 0; l < kLayers; ++l) {
    EXPECT_EQ(static_cast<void*>(table.k_buffer(l)), moved[l]);
    EXPECT_EQ(static_cast<void*>(table.v_buffer(l)), v[l]);
  }
  auto overlapping = v;
  for (auto& p : overlapping) p = static_cast<std::byte*>(p) - run / 2;
  EXPECT_THROW(DeviceKVPool(*device, g, kDeviceTokens, k, overlapping, each), InvalidArgument);
  EXPECT_THROW(DeviceKVPool(*device, g, kDeviceTokens, std::span(k).first(2), v, each),
               InvalidArgument);
  // Buffers of another slot count than device_tokens: refused, naming both sizes.
  try {
    DeviceKVPool refused(*device, g, kDeviceTokens, k, v, each + g.unit_bytes() * kPage);
    ADD_FAILURE() << "buffers of another size were wrapped";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("must be their slot count"), std::string::npos)
        << e.what();
  }
}

// Per-layer device buffers at unrelated addresses (SGLang's k_buffer / v_buffer, one tensor
// each): writes read and loads fill each layer's own buffer, through the kernels' table and
// through the direct copies' plans alike.
class EnginePerLayerMemory
    : public EngineMemory {};  // GetParam().layout: the io backend, "kernel" or "direct"

TEST_P(EnginePerLayerMemory, PagesRoundTripThroughBuffersAtUnrelatedAddresses) {
  const Case& c = GetParam();
  const KVGeometry g = geometry(false);
  const std::int64_t u = g.unit_bytes();
  const std::int64_t run = kDeviceTokens * u;  // one layer's K or V
  // 2 * kLayers buffers in one allocation, in a shuffled order with gaps of odd sizes: no
  // stride relates them.
  const std::int64_t order[] = {3, 0, 5, 1, 4, 2};
  const std::int64_t total = 2 * kLayers * (run + 96);
  Buffer memory = device_->alloc_device(static_cast<std::size_t>(total));
  std::vector<void*> k, v;
  std::vector<std::int64_t> at;  // byte offset of buffer b (K of layer l: b = l, V: kLayers + l)
  for (int b = 0; b < 2 * kLayers; ++b) at.push_back(order[b] * (run + 96) + 32 * (b % 3));
  for (int l = 0; l < kLayers; ++l) {
    k.push_back(memory.data() + at[static_cast<std::size_t>(l)]);
    v.push_back(memory.data() + at[static_cast<std::size_t>(kLayers + l)]);
  }
  HiCacheConfig config;
  config.device = c.backend;
  config.geometry = g;
  config.device_tokens = kDeviceTokens;
  config.host_size = HostPoolSize{.tokens = kHostTokens};
  config.host_layout = HostLayout::kPageFirst;
  const bool direct = std::string_view(c.layout) == "direct";
  config.controller.io_backend = direct ? IoBackend::kDirect : IoBackend::kKernel;
  config.metrics = false;
  auto parts_for = [&] {
    HiCacheParts parts{.device = device_.get()};
    parts.device_k = k;
    parts.device_v = v;
    parts.device_layer_bytes = static_cast<std::size_t>(run);
    return parts;
  };
  if (direct && std::string_view(c.backend) == "cuda") {
    // page_first with direct copies on CUDA is refused by design (one token of one layer per
    // copy), naming the layout and the io backend; page_first_direct is direct's layout there.
    try {
      HiCache refused(config, parts_for());
      ADD_FAILURE() << "page_first with io_backend 'direct' on CUDA was accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("'page_first' with io_backend 'direct' on CUDA"),
                std::string::npos)
          << e.what();
    }
    config.host_layout = HostLayout::kPageFirstDirect;
  }
  HiCache hc(config, parts_for());
  ASSERT_NE(hc.device_pool().layout().layer_offsets, nullptr);

  std::vector<std::byte> image(static_cast<std::size_t>(total));
  std::mt19937_64 rng(11);
  for (auto& b : image) b = static_cast<std::byte>(rng());
  to_device(memory.data(), image);
  const auto unit_at = [&](int kv, int l, std::int64_t slot) {
    return at[static_cast<std::size_t>(kv * kLayers + l)] + slot * u;
  };
  std::vector<std::int64_t> slots, host_slots;
  write_pages(hc, slots, host_slots);
  if (HasFatalFailure()) return;
  const std::byte* host = hc.host_pool().layout().base == nullptr
                              ? nullptr
                              : reinterpret_cast<const std::byte*>(hc.host_pool().layout().base);
  ASSERT_NE(host, nullptr);
  for (std::size_t i = 0; i < slots.size(); ++i) {
    for (int kv = 0; kv < 2; ++kv) {
      for (int l = 0; l < kLayers; ++l) {
        const auto h = unit_offset(hc.host_pool().layout(), l, kv, host_slots[i]);
        ASSERT_EQ(std::memcmp(host + h, image.data() + unit_at(kv, l, slots[i]),
                              static_cast<std::size_t>(u)),
                  0)
            << "slot " << slots[i] << ", layer " << l << ", kv " << kv;
      }
    }
  }
  hc.controller().evict_device(slots, host_slots);
  auto into = hc.device_pool().allocator().alloc(4 * kPage);
  ASSERT_TRUE(into.has_value());
  to_device(memory.data(), std::vector<std::byte>(static_cast<std::size_t>(total)));
  load_back(hc, host_slots, *into);
  if (HasFatalFailure()) return;
  const auto back = from_device(memory.data(), static_cast<std::size_t>(total));
  std::size_t nonzero = 0;
  for (std::size_t i = 0; i < into->size(); ++i) {
    for (int kv = 0; kv < 2; ++kv) {
      for (int l = 0; l < kLayers; ++l) {
        ASSERT_EQ(std::memcmp(back.data() + unit_at(kv, l, (*into)[i]),
                              image.data() + unit_at(kv, l, slots[i]), static_cast<std::size_t>(u)),
                  0)
            << "device slot " << (*into)[i] << ", layer " << l << ", kv " << kv;
      }
    }
  }
  // Nothing else of the buffers was written: the loaded units are the only non-zero bytes.
  for (std::byte b : back) nonzero += b != std::byte{0} ? 1 : 0;
  std::size_t loaded = 0;
  for (std::size_t i = 0; i < into->size(); ++i) {
    for (int kv = 0; kv < 2; ++kv) {
      for (int l = 0; l < kLayers; ++l) {
        const std::byte* p = image.data() + unit_at(kv, l, slots[i]);
        for (std::int64_t j = 0; j < u; ++j) loaded += p[j] != std::byte{0} ? 1 : 0;
      }
    }
  }
  EXPECT_EQ(nonzero, loaded);
  hc.stop();
}

INSTANTIATE_TEST_SUITE_P(Backends, EnginePerLayerMemory,
                         ::testing::Values(Case{"host", "kernel", false, true},
                                           Case{"host", "direct", false, true},
                                           Case{"cuda", "kernel", false, true},
                                           Case{"cuda", "direct", false, true}),
                         [](const auto& p) { return std::string(p.param.backend) + "_" + p.param.layout; });

TEST(EngineMemoryBuffers, ShortOrNullBuffersAreRefusedNamingTheSizes) {
  auto device = Device::create("host");
  const KVGeometry g = geometry(false);
  std::vector<std::byte> small(100);
  try {
    HostKVPool refused(*device, g, HostLayout::kPageFirst, kHostTokens,
                       ExternalKVBuffer{small.data(), small.size(), DimOrder::kSglang});
    ADD_FAILURE() << "a short buffer was wrapped";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("(100 bytes at"), std::string::npos) << e.what();
  }
  // One page more than the config says (SGLang's padding page forgotten in device_tokens): the
  // layers would be read at the wrong strides, so it is refused too.
  std::vector<std::byte> larger(static_cast<std::size_t>(kv_buffer_bytes(g, kDeviceTokens + kPage)));
  EXPECT_THROW(DeviceKVPool(*device, g, kDeviceTokens,
                            ExternalKVBuffer{larger.data(), larger.size(), DimOrder::kSglang}),
               InvalidArgument);
  EXPECT_THROW(DeviceKVPool(*device, g, kDeviceTokens, ExternalKVBuffer{nullptr, 1 << 20}),
               InvalidArgument);
  EXPECT_THROW((void)device->wrap_host(nullptr, 8), InvalidArgument);
  EXPECT_THROW((void)device->wrap_device(small.data(), 0), InvalidArgument);
}

// An engine allocator in SGLang's manner: pages from 1 up (page 0 is padding), handed out in
// order, counted.
class EngineAllocator final : public TokenSlotAllocator {
 public:
  using TokenSlotAllocator::alloc;
  explicit EngineAllocator(std::int64_t pages) : allocated_(static_cast<std::size_t>(pages), false) {}
  std::int32_t page_size() const override { return kPage; }
  std::int64_t num_pages() const override { return static_cast<std::int64_t>(allocated_.size()); }
  std::int64_t free_tokens() const override {
    return kPage * std::count(allocated_.begin() + 1, allocated_.end(), false);
  }
  bool is_allocated(std::int64_t page) const override {
    return page >= 0 && page < num_pages() && allocated_[static_cast<std::size_t>(page)];
  }
  bool alloc(std::int64_t tokens, std::vector<std::int64_t>& slots) override {
    ++allocs;
    std::vector<std::int64_t> pages;
    for (std::int64_t p = 1; p < num_pages() && static_cast<std::int64_t>(pages.size()) * kPage < tokens; ++p) {
      if (!allocated_[static_cast<std::size_t>(p)]) pages.push_back(p);
    }
    if (static_cast<std::int64_t>(pages.size()) * kPage < tokens) return false;
    for (std::int64_t p : pages) {
      allocated_[static_cast<std::size_t>(p)] = true;
      for (std::int64_t t = 0; t < kPage; ++t) slots.push_back(p * kPage + t);
    }
    return true;
  }
  void free(std::span<const std::int64_t> slots) override {
    ++frees;
    for (std::size_t i = 0; i < slots.size(); i += kPage) {
      allocated_[static_cast<std::size_t>(slots[i] / kPage)] = false;
    }
  }
  void reset() override { std::fill(allocated_.begin(), allocated_.end(), false); }
  int allocs = 0, frees = 0;

 private:
  std::vector<bool> allocated_;
};

TEST(EngineMemoryBuffers, LoadsGoIntoTheEnginesSlotsAndBadSlotsAreRefused) {
  auto device = Device::create("host");
  const KVGeometry g = geometry(true);
  std::vector<std::byte> dev(static_cast<std::size_t>(kv_buffer_bytes(g, kDeviceTokens)));
  std::vector<std::byte> host(static_cast<std::size_t>(kv_buffer_bytes(g, kHostTokens)));
  for (std::size_t i = 0; i < dev.size(); ++i) dev[i] = static_cast<std::byte>(i * 31 + 7);
  EngineAllocator engine(kDeviceTokens / kPage);
  HiCacheConfig config;
  config.device = "host";
  config.geometry = g;
  config.device_tokens = kDeviceTokens;
  config.host_size = HostPoolSize{.tokens = kHostTokens};
  config.metrics = false;
  HiCacheParts parts{.device = device.get()};
  parts.device_kv = ExternalKVBuffer{dev.data(), dev.size(), DimOrder::kSglang};
  parts.host_kv = ExternalKVBuffer{host.data(), host.size(), DimOrder::kSglang};
  parts.device_allocator = &engine;
  HiCache hc(config, std::move(parts));
  ASSERT_EQ(&hc.device_pool().allocator(), &engine);
  auto slots = engine.alloc(2 * kPage);
  ASSERT_TRUE(slots && (*slots)[0] == kPage) << "page 0 is the engine's padding";
  const std::vector<std::byte> before(dev.begin(), dev.end());
  auto host_slots = hc.controller().write(*slots, 0, NodeId{1});
  ASSERT_TRUE(host_slots);
  ASSERT_TRUE(wait_acks(hc.controller(), true, 1).at(0).ok);
  hc.controller().evict_device(*slots, *host_slots);  // frees them back to the engine
  EXPECT_EQ(engine.frees, 1);
  // Illegal twins first: nothing changes.
  const std::vector<std::int64_t> unallocated{0, 1, 2, 3, 4, 5, 6, 7};
  EXPECT_THROW(hc.controller().load_into(*host_slots, unallocated, 0, NodeId{2}), StateError);
  auto into = engine.alloc(2 * kPage);
  ASSERT_TRUE(into);
  EXPECT_THROW(hc.controller().load_into(*host_slots, std::span(*into).first(4), 0, NodeId{2}),
               InvalidArgument);
  const std::vector<std::int64_t> free_host{100, 101, 102, 103, 104, 105, 106, 107};
  EXPECT_THROW(hc.controller().load_into(free_host, *into, 0, NodeId{2}), StateError);
  EXPECT_EQ(hc.host_pool().count_in_state(PageState::kBackup), 2);
  // Into the engine's slots.
  std::fill(dev.begin(), dev.end(), std::byte{0});
  ASSERT_TRUE(hc.controller().load_into(*host_slots, *into, 0, NodeId{2}));
  const std::int32_t counter = hc.controller().start_loading();
  for (int l = 0; l < kLayers; ++l) ASSERT_TRUE(hc.device_pool().wait_for_layer(l));
  hc.controller().layer_done_counter().release(counter);
  ASSERT_TRUE(wait_acks(hc.controller(), false, 1).at(0).ok);
  const std::int64_t u = g.unit_bytes();
  for (std::size_t i = 0; i < into->size(); ++i) {
    for (int l = 0; l < kLayers; ++l) {
      const auto now = sglang_offset("layer_first", true, kDeviceTokens, 0, l, (*into)[i], u);
      const auto was = sglang_offset("layer_first", true, kDeviceTokens, 0, l, (*slots)[i], u);
      ASSERT_EQ(std::memcmp(dev.data() + now, before.data() + was, static_cast<std::size_t>(u)), 0);
    }
  }
  EXPECT_EQ(engine.allocs, 2) << "hicache took no slot of its own";
}

TEST(EngineMemoryBuffers, AnEngineAllocatorWithoutTheEnginesMemoryIsRefused) {
  EngineAllocator engine(kDeviceTokens / kPage);
  HiCacheConfig config;
  config.device = "host";
  config.geometry = geometry(false);
  config.device_tokens = kDeviceTokens;
  config.metrics = false;
  HiCacheParts parts;
  parts.device_allocator = &engine;
  EXPECT_THROW(HiCache(config, std::move(parts)), InvalidArgument);
  EngineAllocator wrong_page(kDeviceTokens);  // page 4 but 256 slots: larger than the pool
  std::vector<std::byte> dev(static_cast<std::size_t>(kv_buffer_bytes(config.geometry, kDeviceTokens)));
  auto device = Device::create("host");
  EXPECT_THROW(DeviceKVPool(*device, config.geometry, kDeviceTokens,
                            ExternalKVBuffer{dev.data(), dev.size()}, &wrong_page),
               InvalidArgument);
}

// L3 through engine-owned memory in SGLang's page_first order, where an MHA page is two blocks
// (K, V) and storage I/O goes through a staging copy: one engine computes a prompt and backs it
// up; a second engine, with buffers of its own, prefetches it from the file store and loads it
// back into its device buffer, every page checked.
TEST(EngineMemoryBuffers, PagesGoToL3AndBackThroughSglangOrderedBuffers) {
  namespace fs = std::filesystem;
  const fs::path root = fs::temp_directory_path() / ("hicache-engine-l3-" + std::to_string(::getpid()));
  fs::remove_all(root);
  auto device = Device::create("host");
  const KVGeometry g = geometry(false);
  HiCacheConfig config;
  config.device = "host";
  config.geometry = g;
  config.device_tokens = kDeviceTokens;
  config.host_size = HostPoolSize{.tokens = kHostTokens};
  config.host_layout = HostLayout::kPageFirst;
  config.storage = R"({"backend": "file", "root": ")" + root.string() + R"("})";
  config.storage_controller.prefetch_threshold_tokens = kPage;
  config.storage_controller.policy = PrefetchPolicy::kWaitComplete;
  config.metrics = false;
  std::vector<std::int32_t> prompt(8 * kPage);
  std::iota(prompt.begin(), prompt.end(), 500);
  const auto settle = [](HiCache& hc) {
    for (int i = 0; i < 1000; ++i) {
      const std::uint64_t seen = hc.cache().event_seq();
      hc.cache().check_events();
      const auto st = hc.cache().stats();
      if (st.writes_in_flight + st.loads_in_flight + st.backups_in_flight == 0 &&
          hc.cache().prefetches_in_flight() == 0) {
        return;
      }
      hc.cache().wait_for_events(seen, std::chrono::steady_clock::now() + std::chrono::seconds(1));
    }
    FAIL() << "the cache never settled";
  };
  const auto engine = [&](std::vector<std::byte>& dev, std::vector<std::byte>& host) {
    dev.assign(static_cast<std::size_t>(kv_buffer_bytes(g, kDeviceTokens)), std::byte{0});
    host.assign(static_cast<std::size_t>(kv_buffer_bytes(g, kHostTokens)), std::byte{0});
    HiCacheParts parts{.device = device.get()};
    parts.device_kv = ExternalKVBuffer{dev.data(), dev.size(), DimOrder::kSglang};
    parts.host_kv = ExternalKVBuffer{host.data(), host.size(), DimOrder::kSglang};
    return std::make_unique<HiCache>(config, std::move(parts));
  };
  {
    std::vector<std::byte> dev, host;
    auto hc = engine(dev, host);
    ASSERT_FALSE(hc->host_pool().has_contiguous_pages());
    auto slots = hc->device_pool().allocator().alloc(static_cast<std::int64_t>(prompt.size()));
    ASSERT_TRUE(slots);
    for (std::size_t p = 0; p < 8; ++p) {
      fill_page(hc->device_pool().layout(), (*slots)[p * kPage] / kPage, 1000 + p);
    }
    hc->cache().insert(prompt, *slots);
    settle(*hc);
    ASSERT_EQ(hc->storage()->stats().set_written, 8u);
  }
  std::vector<std::byte> dev, host;
  auto hc = engine(dev, host);
  auto& cache = hc->cache();
  auto m = cache.match_prefix(prompt);
  ASSERT_EQ(m.device_slots.size() + static_cast<std::size_t>(m.host_hit_tokens), 0u);
  ASSERT_TRUE(cache.prefetch_from_storage("r", m.last_host_node, prompt));
  std::int64_t inserted = -1;
  while (!cache.check_prefetch_progress("r", &inserted)) settle(*hc);
  const auto st = hc->storage()->stats();
  ASSERT_EQ(inserted, static_cast<std::int64_t>(prompt.size()))
      << "store: " << st.to_json();
  m = cache.match_prefix(prompt);
  ASSERT_EQ(m.host_hit_tokens, static_cast<std::int64_t>(prompt.size()));
  cache.lock(m.last_host_node);
  auto back = cache.load_back(m.last_host_node);
  ASSERT_TRUE(back);
  const std::int32_t batch = hc->controller().start_loading();
  for (int l = 0; l < kLayers; ++l) ASSERT_TRUE(hc->device_pool().wait_for_layer(l));
  if (batch >= 0) hc->controller().layer_done_counter().release(batch);
  for (std::size_t p = 0; p < 8; ++p) {
    EXPECT_TRUE(verify_page(hc->device_pool().layout(), (*back)[p * kPage] / kPage, 1000 + p))
        << "page " << p;
  }
  cache.unlock(m.last_host_node);
  settle(*hc);
  hc.reset();
  fs::remove_all(root);
}

}  // namespace
}  // namespace hicache
