// Configuration keys at work: each ConfigEffect test builds a HiCache from JSON text and asserts
// a behaviour the key changes, through HiCache's API (the component tests build their parts from
// structs, so they cannot show that a key reaches its component). Which test shows each key's
// effect or refusal is the table tests/controller/config_key_tests.tsv, rendered in
// docs/configuration.md; ConfigKeyTests below keeps it in step with the schema, and
// tests/config_key_tests_check.sh checks that every test it names is registered with ctest.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <thread>

#include "controller/config_schema.h"
#include "controller/hicache.h"
#include "storage/file_storage.h"
#include "storage/redis_storage.h"
#include "tests/controller/error_of.h"
#include "tests/controller/faulty_device.h"
#include "transfer/errors.h"

namespace hicache {
namespace {

namespace fs = std::filesystem;
using std::chrono::milliseconds;
using std::chrono::steady_clock;

// The rows of the table: key -> (tests that show its effect, tests that show its refusal).
struct Row {
  std::string effect, refused;
};

std::map<std::string, Row> read_key_table(std::vector<std::string>* duplicates) {
  std::ifstream in(HICACHE_CONFIG_KEY_TESTS);
  std::map<std::string, Row> rows;
  std::string line;
  bool header = true;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    if (header) {  // the column names
      header = false;
      continue;
    }
    std::stringstream fields(line);
    std::string key;
    Row row;
    std::getline(fields, key, '\t');
    std::getline(fields, row.effect, '\t');
    std::getline(fields, row.refused, '\t');
    if (!rows.emplace(key, row).second) duplicates->push_back(key);
  }
  return rows;
}

// Every key of the schema, every SGLang alias and every key of the store object (the stores'
// own lists of the keys they read: storage.file.<key>, storage.redis.<key>,
// storage.redis.tls.<key>) has one row that names at least one test, and every row is such a
// key. (The names themselves are checked against ctest's list by tests/config_key_tests_check.sh.)
TEST(ConfigKeyTests, EveryKeyAndAliasHasARowAndEveryRowAKey) {
  std::vector<std::string> duplicates;
  const auto rows = read_key_table(&duplicates);
  ASSERT_FALSE(rows.empty()) << "cannot read " << HICACHE_CONFIG_KEY_TESTS;
  EXPECT_TRUE(duplicates.empty()) << "keys with two rows, the first: " << duplicates.front();
  std::set<std::string> known;
  for (const ConfigKeyInfo& k : config_keys()) known.emplace(k.key);
  for (const ConfigAliasInfo& a : config_aliases()) known.emplace(a.alias);
  for (const std::string_view k : FileStorageConfig::kJsonKeys) {
    known.emplace(str_cat("storage.file.", k));
  }
  for (const std::string_view k : RedisConfig::kJsonKeys) known.emplace(str_cat("storage.redis.", k));
  for (const std::string_view k : RedisTlsConfig::kJsonKeys) {
    known.emplace(str_cat("storage.redis.tls.", k));
  }
  for (const std::string& key : known) {
    const auto row = rows.find(key);
    if (row == rows.end()) {
      ADD_FAILURE() << "key '" << key << "' has no row in " << HICACHE_CONFIG_KEY_TESTS
                    << ": name the tests that show its effect or its refusal";
      continue;
    }
    EXPECT_TRUE(row->second.effect != "-" || row->second.refused != "-")
        << "key '" << key << "' names no test";
    EXPECT_FALSE(row->second.effect.empty() || row->second.refused.empty())
        << "key '" << key << "': give both columns ('-' for none)";
  }
  for (const auto& [key, row] : rows) {
    EXPECT_TRUE(known.count(key)) << "row '" << key << "' is no key of the schema";
  }
}

constexpr std::int32_t kPage = 4;

std::string json_string(std::string_view s) { return str_cat("\"", s, "\""); }

// A small MHA model on the host backend (2 layers, 1 KV head of 8, fp16, pages of 4 tokens:
// 256 bytes a page) with a 64-token device pool; `keys` (key -> JSON text) replace or add
// top-level keys.
HiCacheConfig config_with(std::map<std::string, std::string> keys = {}) {
  std::map<std::string, std::string> all = {
      {"device", R"("host")"},
      {"page_size", "4"},
      {"device_tokens", "64"},
      {"model", R"({"layers": 2, "kv_heads": 1, "head_dim": 8})"}};
  for (auto& [k, v] : keys) all[k] = v;
  std::string text;
  for (const auto& [k, v] : all)
    text += str_cat(text.empty() ? "{" : ", ", json_string(k), ": ", v);
  return HiCacheConfig::from_json_text(text + "}");
}

struct TempDir {
  fs::path path = fs::temp_directory_path() / str_cat("hicache-effect-", ::getpid(), "-", ++count);
  TempDir() {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
  static inline int count = 0;
};

// `pages` whole pages of tokens no other seed shares.
std::vector<std::int32_t> tokens_of(int seed, int pages) {
  std::vector<std::int32_t> t;
  for (int i = 0; i < pages * kPage; ++i) t.push_back(seed * 1000 + i);
  return t;
}

// What a forward pass leaves: the tokens' KV in fresh device slots, inserted into the tree.
void insert_fresh(HiCache& hc, std::span<const std::int32_t> tokens) {
  auto slots = hc.device_pool().allocator().alloc(static_cast<std::int64_t>(tokens.size()));
  ASSERT_TRUE(slots) << "device pool full";
  ASSERT_EQ(hc.cache().insert(tokens, *slots), 0);
}

// Steps until no write, load or backup is in flight, sleeping on the cache's events in between.
void settle(HiCache& hc) {
  const auto deadline = steady_clock::now() + std::chrono::seconds(60);
  while (true) {
    const std::uint64_t seen = hc.cache().event_seq();
    hc.cache().check_events();
    const RadixCacheStats s = hc.cache().stats();
    if (s.writes_in_flight == 0 && s.loads_in_flight == 0 && s.backups_in_flight == 0) return;
    if (!hc.cache().wait_for_events(seen, deadline)) {
      ADD_FAILURE() << "writes, loads or backups never finished";
      return;
    }
  }
}

// `tokens` in the tree on the host only: inserted, written through, evicted from the device.
void make_host_only(HiCache& hc, std::span<const std::int32_t> tokens) {
  insert_fresh(hc, tokens);
  settle(hc);
  const auto n = static_cast<std::int64_t>(tokens.size());
  ASSERT_EQ(hc.cache().evict_device(n), n);
  const auto m = hc.cache().match_prefix(tokens);
  ASSERT_TRUE(m.device_slots.empty());
  ASSERT_EQ(m.host_hit_tokens, n);
}

// A request's load back of host-only `tokens`: the node it locked, and the device slots (nothing
// when the cache refused).
struct LoadBack {
  HiRadixCache::Node* node;
  std::optional<std::vector<std::int64_t>> slots;
};
LoadBack load_back(HiCache& hc, std::span<const std::int32_t> tokens) {
  const auto m = hc.cache().match_prefix(tokens);
  hc.cache().lock(m.last_host_node);
  return {m.last_host_node, hc.cache().load_back(m.last_host_node)};
}

// The forward pass of a load batch: waits for every layer, then releases the batch's slot.
void consume(HiCache& hc, std::int32_t slot) {
  ASSERT_GE(slot, 0);
  LayerDoneCounter& counter = hc.controller().layer_done_counter();
  for (std::int32_t layer = 0; layer < counter.num_layers(); ++layer) {
    EXPECT_TRUE(counter.wait_until(slot, layer)) << "layer " << layer;
  }
  counter.release(slot);
}

// device: the runtime HiCache builds when the engine passes none.
TEST(ConfigEffect, DeviceChoosesTheRuntime) {
  HiCache host(config_with());
  EXPECT_EQ(host.device().backend(), DeviceBackend::kHost);
  std::string why;
  const bool gpu = Device::cuda_available(&why);
  HiCache automatic(config_with({{"device", R"("auto")"}}));
  EXPECT_EQ(automatic.device().backend(), gpu ? DeviceBackend::kCuda : DeviceBackend::kHost);
  if (gpu) {
    HiCache cuda(config_with({{"device", R"("cuda")"}}));
    EXPECT_EQ(cuda.device().backend(), DeviceBackend::kCuda);
  } else {
    const std::string e = error_of([] { HiCache cuda(config_with({{"device", R"("cuda")"}})); });
    EXPECT_NE(e, "(no error)") << "device cuda without a GPU (" << why << ") was accepted";
  }
}

// page_size and the model keys: the bytes of every page of both pools, and the KV dtype in the
// key namespace.
TEST(ConfigEffect, ModelKeysAndPageSizeShapeEveryPage) {
  struct Case {
    const char* page_size;
    const char* model;
    std::int64_t page_bytes;  // layers x (K and V, or one latent) x width x dtype x tokens
    const char* dtype;
  };
  const Case cases[] = {
      {"4", R"({"layers": 2, "kv_heads": 1, "head_dim": 8})", 2 * 2 * 8 * 2 * 4, "fp16"},
      {"8", R"({"layers": 2, "kv_heads": 1, "head_dim": 8})", 2 * 2 * 8 * 2 * 8, "fp16"},
      {"4", R"({"layers": 3, "kv_heads": 1, "head_dim": 8})", 3 * 2 * 8 * 2 * 4, "fp16"},
      {"4", R"({"layers": 2, "kv_heads": 2, "head_dim": 8})", 2 * 2 * 16 * 2 * 4, "fp16"},
      {"4", R"({"layers": 2, "kv_heads": 1, "head_dim": 16})", 2 * 2 * 16 * 2 * 4, "fp16"},
      {"4", R"({"layers": 2, "kv_heads": 1, "head_dim": 8, "dtype": "fp32"})", 2 * 2 * 8 * 4 * 4,
       "fp32"},
      {"4", R"({"layers": 2, "kv_heads": 1, "head_dim": 8, "dtype": "fp8"})", 2 * 2 * 8 * 1 * 4,
       "fp8_e4m3"},
      {"4", R"({"attention": "mla", "layers": 2, "kv_lora_rank": 16, "qk_rope_head_dim": 8})",
       2 * 1 * (16 + 8) * 2 * 4, "fp16"},
      {"4", R"({"attention": "mla", "layers": 2, "kv_lora_rank": 32, "qk_rope_head_dim": 8})",
       2 * 1 * (32 + 8) * 2 * 4, "fp16"},
      {"4", R"({"attention": "mla", "layers": 2, "kv_lora_rank": 16, "qk_rope_head_dim": 16})",
       2 * 1 * (16 + 16) * 2 * 4, "fp16"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(str_cat("page_size ", c.page_size, ", model ", c.model));
    HiCache hc(config_with({{"page_size", c.page_size}, {"model", c.model}}));
    EXPECT_EQ(hc.device_pool().geometry().page_bytes(), c.page_bytes);
    EXPECT_EQ(hc.host_pool().geometry().page_bytes(), c.page_bytes);
    EXPECT_EQ(hc.cache().page_size(), std::stoi(c.page_size));
    EXPECT_EQ(hc.device_pool().geometry().attention == AttentionKind::kMLA,
              std::string_view(c.model).find("mla") != std::string_view::npos);
    const std::string prefix = hc.key_namespace().prefix();
    EXPECT_NE(prefix.find(str_cat(".", c.dtype, ".")), std::string::npos) << prefix;
    EXPECT_NE(prefix.find(str_cat(".p", c.page_size, ".")), std::string::npos) << prefix;
  }
}

// device_tokens sizes the device pool; host_ratio, host_bytes or host_tokens the host pool.
TEST(ConfigEffect, PoolSizesFollowTheirKeys) {
  EXPECT_EQ(HiCache(config_with()).device_pool().allocator().capacity_tokens(), 64);
  EXPECT_EQ(
      HiCache(config_with({{"device_tokens", "128"}})).device_pool().allocator().capacity_tokens(),
      128);
  EXPECT_EQ(HiCache(config_with()).host_pool().capacity_tokens(), 128) << "host_ratio 2";
  EXPECT_EQ(HiCache(config_with({{"host_ratio", "3"}})).host_pool().capacity_tokens(), 192);
  EXPECT_EQ(HiCache(config_with({{"host_tokens", "96"}})).host_pool().capacity_tokens(), 96);
  // 20 pages of 256 bytes and a part of one: whole pages only.
  EXPECT_EQ(HiCache(config_with({{"host_bytes", "5200"}})).host_pool().capacity_tokens(),
            20 * kPage);
}

// sidecars: pools of their own size that the controller and the cache move with the KV; a
// match restores only what they can (a prefix without a state checkpoint restores nothing).
TEST(ConfigEffect, SidecarsBuildPoolsThatMoveWithTheKv) {
  EXPECT_EQ(HiCache(config_with()).controller().num_sidecars(), 0u);
  HiCache hc(config_with(
      {{"write_policy", R"("write_through")"},
       {"sidecars", R"({"state": {"policy": "trailing", "layers": 2, "slot_bytes": 512,
                                   "dtype": "fp32", "device_pages": 4, "host_pages": 8}})"}}));
  ASSERT_EQ(hc.controller().num_sidecars(), 1u);
  SidecarPool& state = hc.sidecar_pool("state");
  EXPECT_EQ(state.device_pool().num_pages(), 4);
  EXPECT_EQ(state.host_pool().num_pages(), 8);
  EXPECT_EQ(state.spec().page_bytes(), 1024);
  EXPECT_EQ(hc.device_pool().allocator().capacity_tokens(), 64) << "the KV pools keep their size";
  const auto t = tokens_of(1, 2);
  const auto kv = *hc.device_pool().allocator().alloc(2 * kPage);
  const auto st = *state.device_pool().allocator().alloc(1);
  const std::vector<std::int64_t> last{1};
  const HiRadixCache::SidecarInsert side[] = {{hc.sidecar_index("state"), last, st}};
  hc.cache().insert(t, kv, {}, side);
  for (int i = 0; i < 1000 && hc.cache().stats().writes_in_flight > 0; ++i) {
    hc.cache().wait_for_events(hc.cache().event_seq(), steady_clock::now() + milliseconds(10));
    hc.cache().check_events();
  }
  EXPECT_EQ(state.host_pool().free_tokens(), 7) << "the state went to the host with its KV";
  EXPECT_EQ(hc.cache().match_prefix(t).device_slots.size(), 2u * kPage);
  const std::vector<std::int32_t> first(t.begin(), t.begin() + kPage);
  EXPECT_TRUE(hc.cache().match_prefix(first).device_slots.empty()) << "no state after page 0";
  EXPECT_THROW(hc.sidecar_index("mamba"), InvalidArgument);
}

// host_layout: the host pool's layout, and the key namespace (pages of another layout are
// never read as this one's).
TEST(ConfigEffect, HostLayoutIsThePoolsAndTheNamespaces) {
  for (const HostLayout layout :
       {HostLayout::kLayerFirst, HostLayout::kPageFirst, HostLayout::kPageFirstDirect}) {
    const std::string name(to_string(layout));
    HiCache hc(config_with({{"host_layout", json_string(name)}, {"io_backend", R"("kernel")"}}));
    EXPECT_EQ(hc.host_pool().host_layout(), layout) << name;
    EXPECT_NE(hc.key_namespace().prefix().find(str_cat(".", name, ".")), std::string::npos)
        << hc.key_namespace().prefix();
  }
}

// io_backend: the copies go as copy batches (direct) or page transfers (kernel), the latter with
// kernel_max_blocks as their block cap.
TEST(ConfigEffect, IoBackendAndKernelMaxBlocksChooseTheCopyPath) {
  struct Case {
    const char* io;
    const char* max_blocks;  // null: the default
    bool kernel;
    int blocks_seen;
    const char* layout = nullptr;  // null: the default (layer_first)
  };
  // auto on the host backend: direct, but the kernel for page_first (choose_io_backend).
  for (const Case& c :
       {Case{"direct", "5", false, -1}, Case{"kernel", "5", true, 5}, Case{"kernel", nullptr, true, 0},
        Case{"auto", nullptr, false, -1}, Case{"auto", "3", true, 3, "page_first"},
        Case{"auto", nullptr, false, -1, "page_first_direct"}}) {
    SCOPED_TRACE(str_cat(c.io, " ", c.max_blocks ? c.max_blocks : "(default)", " ",
                         c.layout ? c.layout : "(default layout)"));
    testing::FaultyDevice device;  // counts the copies by path
    HiCacheParts parts;
    parts.device = &device;
    std::map<std::string, std::string> keys = {{"io_backend", json_string(c.io)}};
    if (c.max_blocks != nullptr) keys["kernel_max_blocks"] = c.max_blocks;
    if (c.layout != nullptr) keys["host_layout"] = json_string(c.layout);
    HiCache hc(config_with(keys), std::move(parts));
    const int batches = device.copy_batches, transfers = device.page_transfers;
    insert_fresh(hc, tokens_of(1, 2));  // written through to the host at once
    settle(hc);
    const ControllerStats stats = hc.controller().stats();
    ASSERT_EQ(stats.writes_done, 1u);
    EXPECT_EQ(device.copy_batches > batches, !c.kernel);
    EXPECT_EQ(device.page_transfers > transfers, c.kernel);
    EXPECT_EQ(device.max_blocks_seen, c.blocks_seen);
    EXPECT_EQ(stats.kernel_batches, c.kernel ? 1u : 0u);
    EXPECT_EQ(stats.direct_batches, c.kernel ? 0u : 1u);
  }
}

// layer_slots: the load batches that may be in flight at once, their consumers still reading.
TEST(ConfigEffect, LayerSlotsAreTheLoadBatchesInFlightAtOnce) {
  for (const int n : {1, 2, 5}) {
    HiCache hc(config_with({{"layer_slots", std::to_string(n)}}));
    EXPECT_EQ(hc.controller().layer_done_counter().num_slots(), n);
  }
  HiCache hc(config_with({{"layer_slots", "2"}}));
  const auto a = tokens_of(1, 1), b = tokens_of(2, 1);
  make_host_only(hc, a);
  make_host_only(hc, b);
  const LoadBack first = load_back(hc, a);
  ASSERT_TRUE(first.slots);
  const std::int32_t slot_a = hc.controller().start_loading();
  const LoadBack second = load_back(hc, b);
  ASSERT_TRUE(second.slots);
  const std::int32_t slot_b = hc.controller().start_loading();  // a has not been released
  EXPECT_NE(slot_a, slot_b);
  EXPECT_EQ(hc.controller().layer_done_counter().busy_slots(), 2);
  consume(hc, slot_a);
  consume(hc, slot_b);
  hc.cache().unlock(first.node);
  hc.cache().unlock(second.node);
  settle(hc);
  EXPECT_EQ(hc.cache().check_invariants(), "");
}

// queue_capacity: the loads queued before a batch starts (as the writes queued for the write
// thread): one more is refused, and nothing changes for it.
TEST(ConfigEffect, QueueCapacityBoundsTheLoadsQueuedForABatch) {
  for (const int capacity : {2, 3}) {
    SCOPED_TRACE(str_cat("queue_capacity ", capacity));
    HiCache hc(config_with({{"queue_capacity", std::to_string(capacity)}}));
    const std::vector<std::vector<std::int32_t>> requests = {tokens_of(1, 1), tokens_of(2, 1),
                                                             tokens_of(3, 1)};
    for (const auto& r : requests) make_host_only(hc, r);
    std::vector<LoadBack> loads;
    for (const auto& r : requests) loads.push_back(load_back(hc, r));
    EXPECT_TRUE(loads[0].slots && loads[1].slots);
    EXPECT_EQ(loads[2].slots.has_value(), capacity == 3);
    if (capacity == 2) {
      EXPECT_EQ(hc.cache().match_prefix(requests[2]).host_hit_tokens, kPage)
          << "a refused load leaves the page on the host only";
    }
    consume(hc, hc.controller().start_loading());
    for (const LoadBack& l : loads) hc.cache().unlock(l.node);
    settle(hc);
    EXPECT_EQ(hc.cache().check_invariants(), "");
  }
}

// host_tier: false keeps nothing on the host; evicted pages are gone.
TEST(ConfigEffect, HostTierFalseKeepsNothingOnTheHost) {
  for (const bool tier : {true, false}) {
    SCOPED_TRACE(str_cat("host_tier ", tier));
    HiCache hc(config_with({{"host_tier", tier ? "true" : "false"}}));
    const auto t = tokens_of(1, 2);
    insert_fresh(hc, t);
    settle(hc);
    EXPECT_EQ(hc.controller().stats().writes_done, tier ? 1u : 0u);
    EXPECT_EQ(hc.cache().evict_device(2 * kPage), 2 * kPage);
    EXPECT_EQ(hc.cache().match_prefix(t).host_hit_tokens, tier ? 2 * kPage : 0);
    EXPECT_EQ(hc.host_pool().capacity_tokens(), tier ? 128 : kPage);
  }
}

// load_back_min_tokens: a host hit shorter than it is recomputed (load_back refuses it).
TEST(ConfigEffect, LoadBackMinTokensRecomputesShorterHostHits) {
  for (const int min_tokens : {0, 8, 12}) {
    SCOPED_TRACE(str_cat("load_back_min_tokens ", min_tokens));
    HiCache hc(config_with({{"load_back_min_tokens", std::to_string(min_tokens)}}));
    const auto t = tokens_of(1, 2);  // a host hit of 8 tokens
    make_host_only(hc, t);
    const LoadBack l = load_back(hc, t);
    EXPECT_EQ(l.slots.has_value(), min_tokens <= 8);
    if (l.slots) consume(hc, hc.controller().start_loading());
    hc.cache().unlock(l.node);
    settle(hc);
    EXPECT_EQ(hc.cache().match_prefix(t).device_slots.size(), l.slots ? 8u : 0u);
  }
}

// A hit on `tokens` by a request: matched, then inserted again with the slots the tree gave it
// (all of them cached already, so none is the caller's to free).
void hit(HiCache& hc, std::span<const std::int32_t> tokens) {
  const auto m = hc.cache().match_prefix(tokens);
  ASSERT_EQ(m.device_slots.size(), tokens.size());
  hc.cache().lock(m.last_device_node);
  EXPECT_EQ(hc.cache().insert(tokens, m.device_slots), static_cast<std::int64_t>(tokens.size()));
  hc.cache().unlock(m.last_device_node);
}

// write_policy and write_through_threshold: when a node's pages reach the host (at insert,
// after that many hits, or at eviction), and so what an eviction keeps there.
TEST(ConfigEffect, WritePolicyAndThresholdDecideWhenPagesReachTheHost) {
  struct Case {
    const char* policy;
    const char* threshold;  // null: the default
    std::int64_t host_after_insert, host_after_a_hit, host_after_eviction;
  };
  const Case cases[] = {
      {"write_through", nullptr, 8, 8, 8},
      {"write_through_selective", "1", 0, 8, 8},
      {"write_through_selective", "2", 0, 0, 0},
      {"write_back", nullptr, 0, 0, 8},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(str_cat(c.policy, " threshold ", c.threshold ? c.threshold : "(default)"));
    std::map<std::string, std::string> keys = {{"write_policy", json_string(c.policy)}};
    if (c.threshold != nullptr) keys["write_through_threshold"] = c.threshold;
    HiCache hc(config_with(keys));
    const auto t = tokens_of(1, 2);
    insert_fresh(hc, t);
    settle(hc);
    EXPECT_EQ(hc.cache().stats().host_tokens, c.host_after_insert);
    hit(hc, t);
    settle(hc);
    EXPECT_EQ(hc.cache().stats().host_tokens, c.host_after_a_hit);
    hc.cache().evict_device(2 * kPage);  // write-back: written now, freed on the ack
    settle(hc);
    EXPECT_EQ(hc.cache().stats().device_tokens, 0);
    EXPECT_EQ(hc.cache().match_prefix(t).host_hit_tokens, c.host_after_eviction);
  }
}

// eviction_policy: the least recently used node goes first, or the least often hit.
TEST(ConfigEffect, EvictionPolicyChoosesWhatGoesFirst) {
  for (const char* policy : {"lru", "lfu"}) {
    SCOPED_TRACE(policy);
    HiCache hc(config_with({{"eviction_policy", json_string(policy)}}));
    const auto often = tokens_of(1, 2), recent = tokens_of(2, 2);
    insert_fresh(hc, often);
    for (int i = 0; i < 4; ++i) hit(hc, often);
    insert_fresh(hc, recent);
    settle(hc);
    ASSERT_EQ(hc.cache().evict_device(2 * kPage), 2 * kPage);
    const bool lfu = std::string_view(policy) == "lfu";
    EXPECT_EQ(hc.cache().match_prefix(often).device_slots.size(), lfu ? 8u : 0u);
    EXPECT_EQ(hc.cache().match_prefix(recent).device_slots.size(), lfu ? 0u : 8u);
  }
}

// demote_low_watermark / demote_high_watermark: a step that finds less than low of the device
// free frees nodes (their host copies stay) until high is free; none without them.
TEST(ConfigEffect, DemoteWatermarksFreeTheDeviceAheadOfNeed) {
  for (const bool demote : {false, true}) {
    SCOPED_TRACE(str_cat("demote ", demote));
    std::map<std::string, std::string> keys;
    if (demote) keys = {{"demote_low_watermark", "0.25"}, {"demote_high_watermark", "0.5"}};
    HiCache hc(config_with(keys));
    for (int seed = 1; seed <= 7; ++seed) {
      insert_fresh(hc, tokens_of(seed, 2));
      settle(hc);  // the 7th leaves 2 of 16 pages free: 12.5%, under 25%
    }
    EXPECT_EQ(hc.cache().stats().demotions, demote ? 1 : 0);
    EXPECT_EQ(hc.device_pool().allocator().free_tokens(), demote ? 8 * kPage : 2 * kPage);
    EXPECT_EQ(hc.cache().stats().host_tokens, 14 * kPage) << "demoted nodes keep their host copy";
  }
}

// recompute_seconds_per_token: once a load has measured the copy bandwidth, a host hit that is
// slower to move than to recompute at this cost is recomputed (load_back refuses it); 0: off.
TEST(ConfigEffect, RecomputeSecondsPerTokenRecomputesWhatIsSlowerToMove) {
  for (const std::string cost : {"0", "1e-15", "1"}) {
    SCOPED_TRACE(str_cat("recompute_seconds_per_token ", cost));
    HiCache hc(config_with({{"recompute_seconds_per_token", cost}}));
    const auto first = tokens_of(1, 2), second = tokens_of(2, 2);
    make_host_only(hc, first);
    make_host_only(hc, second);
    const LoadBack measured = load_back(hc, first);  // nothing measured yet: it moves the bytes
    ASSERT_TRUE(measured.slots);
    consume(hc, hc.controller().start_loading());
    hc.cache().unlock(measured.node);
    settle(hc);
    const LoadBack l = load_back(hc, second);  // 8 tokens: 8e-15 s to recompute at 1e-15
    const bool cheaper_to_recompute = cost == "1e-15";
    EXPECT_EQ(l.slots.has_value(), !cheaper_to_recompute);
    EXPECT_EQ(hc.cache().stats().load_backs_refused_by_cost, cheaper_to_recompute ? 1 : 0);
    if (l.slots) consume(hc, hc.controller().start_loading());
    hc.cache().unlock(l.node);
    settle(hc);
  }
}

// A file store whose hit queries wait while a test holds `gate` (a prefetch stays queued), and
// which counts its batch reads.
class GatedStore final : public StorageBackend {
 public:
  explicit GatedStore(const std::string& root) : file_(FileStorageConfig{.root = root}) {}
  std::string_view name() const override { return "gated file"; }
  std::size_t batch_exists(std::span<const std::string> keys) override {
    std::lock_guard hold(gate);
    return file_.batch_exists(keys);
  }
  bool remove(const std::string& key) override { return file_.remove(key); }
  void clear() override { file_.clear(); }
  std::mutex gate;
  std::atomic<int> batch_gets{0};

 protected:
  std::vector<IoResult> do_batch_get(std::span<const std::string> keys,
                                     std::span<const ByteSpan> dst) override {
    ++batch_gets;
    return file_.batch_get(keys, dst);
  }
  std::vector<IoResult> do_batch_set(std::span<const std::string> keys,
                                     std::span<const ConstByteSpan> src) override {
    return file_.batch_set(keys, src);
  }

 private:
  FileStorage file_;
};

// prefetch_policy and the prefetch_timeout_* keys: whether the scheduler may end a prefetch that
// still loads, and from when (the timeout policy: base + per_page x pages, at most cap; a
// prefetch still in its hit query counts one page).
TEST(ConfigEffect, PrefetchPolicyAndTimeoutsDecideWhenAPrefetchMayEnd) {
  struct Case {
    const char* policy;
    int base_ms, per_page_ms, cap_ms;
    bool may_end_now;
    std::optional<milliseconds> timeout;  // when the timeout policy lets it end
  };
  const Case cases[] = {
      {"best_effort", 1000, 100, 60000, true, std::nullopt},
      {"wait_complete", 1000, 100, 60000, false, std::nullopt},
      {"timeout", 1000, 100, 60000, false, milliseconds(1100)},
      {"timeout", 2000, 0, 60000, false, milliseconds(2000)},
      {"timeout", 1000, 100000, 3000, false, milliseconds(3000)},
      {"timeout", 0, 0, 60000, true, milliseconds(0)},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(
        str_cat(c.policy, " base ", c.base_ms, " per page ", c.per_page_ms, " cap ", c.cap_ms));
    TempDir dir;
    auto store = std::make_shared<GatedStore>(dir.path.string());
    HiCacheParts parts;
    parts.storage = store;
    HiCache hc(config_with({{"prefetch_policy", json_string(c.policy)},
                            {"prefetch_timeout_base_ms", std::to_string(c.base_ms)},
                            {"prefetch_timeout_per_page_ms", std::to_string(c.per_page_ms)},
                            {"prefetch_timeout_cap_ms", std::to_string(c.cap_ms)}}),
               std::move(parts));
    StorageController& sc = *hc.storage_controller();
    std::shared_ptr<PrefetchOperation> op;
    {
      std::lock_guard hold(store->gate);  // the prefetch stays in its hit query
      const auto before = steady_clock::now();
      op = sc.prefetch("r", tokens_of(1, 4));
      const auto after = steady_clock::now();
      ASSERT_NE(op, nullptr);
      ASSERT_EQ(op->stage(), PrefetchStage::kQueued);
      EXPECT_EQ(sc.can_terminate(*op), c.may_end_now);
      const auto deadline = sc.terminate_deadline(*op);
      ASSERT_EQ(deadline.has_value(), c.timeout.has_value());
      if (deadline) {
        EXPECT_GE(*deadline - before, *c.timeout);
        EXPECT_LE(*deadline - after, *c.timeout);
      }
    }
    // Nothing is stored: the hit is empty and the prefetch is revoked, holding nothing.
    while (op->stage() == PrefetchStage::kQueued) std::this_thread::yield();
    EXPECT_EQ(op->stage(), PrefetchStage::kRevoked);
  }
}

// model_name and model_fingerprint: the start of every page key (a new revision never reads an
// old one's pages); empty ones are refused.
TEST(ConfigEffect, ModelNameAndFingerprintNameEveryPageKey) {
  HiCache r7(config_with({{"model_name", R"("llama")"}, {"model_fingerprint", R"("r7")"}}));
  HiCache r8(config_with({{"model_name", R"("llama")"}, {"model_fingerprint", R"("r8")"}}));
  HiCache other(config_with({{"model_name", R"("qwen")"}, {"model_fingerprint", R"("r7")"}}));
  EXPECT_EQ(r7.key_namespace().prefix().rfind("llama.r7.", 0), 0u) << r7.key_namespace().prefix();
  EXPECT_EQ(r8.key_namespace().prefix().rfind("llama.r8.", 0), 0u) << r8.key_namespace().prefix();
  EXPECT_EQ(other.key_namespace().prefix().rfind("qwen.r7.", 0), 0u);
  for (const char* key : {"model_name", "model_fingerprint"}) {
    const std::string e = error_of([&] { (void)config_with({{key, R"("")"}}); });
    EXPECT_NE(e.find(str_cat(key, " ''")), std::string::npos) << e;
  }
}

// Whether a TCP connection to `address`:`port` is accepted.
bool accepts(const char* address, int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(static_cast<std::uint16_t>(port));
  ::inet_pton(AF_INET, address, &to.sin_addr);
  const bool ok = ::connect(fd, reinterpret_cast<const sockaddr*>(&to), sizeof(to)) == 0;
  ::close(fd);
  return ok;
}

// metrics_bind: the address the metrics server listens on, and no other.
TEST(ConfigEffect, MetricsBindIsTheAddressTheServerListensOn) {
  HiCache other(config_with({{"metrics_port", "0"}, {"metrics_bind", R"("127.0.0.2")"}}));
  ASSERT_GT(other.metrics_port(), 0);
  EXPECT_TRUE(accepts("127.0.0.2", other.metrics_port()));
  EXPECT_FALSE(accepts("127.0.0.1", other.metrics_port())) << "listens on the default address";
  HiCache loopback(config_with({{"metrics_port", "0"}}));
  EXPECT_TRUE(accepts("127.0.0.1", loopback.metrics_port()));
  EXPECT_FALSE(accepts("127.0.0.2", loopback.metrics_port()));
}

// SGLang's names take SGLang's values, refused as their keys' are, and never beside the key
// they stand for.
TEST(ConfigEffect, SglangSizeAndExtraConfigRefuseBadValues) {
  const std::string file = R"("file")";
  const std::pair<std::map<std::string, std::string>, const char*> cases[] = {
      {{{"hicache_size", "-1"}}, "key 'hicache_size' is -1; allowed: GB >= 0"},
      {{{"hicache_size", R"("2GB")"}}, "key 'hicache_size' is \"2GB\""},
      {{{"hicache_size", "2"}, {"host_bytes", "1000000"}},
       "'hicache_size' (SGLang's name) and 'host_bytes' both given"},
      {{{"hicache_io_backend", R"("dma")"}}, "key 'io_backend' is \"dma\""},
      {{{"hicache_io_backend", R"("kernel")"}, {"io_backend", R"("direct")"}},
       "'hicache_io_backend' (SGLang's name) and 'io_backend' both given"},
      {{{"hicache_mem_layout", R"("page_last")"}}, "key 'host_layout' is \"page_last\""},
      {{{"hicache_mem_layout", R"("page_first")"}, {"host_layout", R"("page_first")"}},
       "both given"},
      {{{"hicache_storage_prefetch_policy", R"("eager")"}}, "key 'prefetch_policy' is \"eager\""},
      {{{"hicache_storage_prefetch_policy", R"("timeout")"}, {"prefetch_policy", R"("timeout")"}},
       "both given"},
      {{{"hicache_storage_backend", file}, {"hicache_storage_backend_extra_config", "[1]"}},
       "key 'hicache_storage_backend_extra_config' is [1]; it must be a JSON object"},
      {{{"hicache_storage_backend", file},
        {"hicache_storage_backend_extra_config", R"({"prefetch_timeout_base": -1})"}},
       "'prefetch_timeout_base' is -1; allowed: seconds >= 0"},
      {{{"hicache_storage_backend", file},
        {"hicache_storage_backend_extra_config", R"({"prefetch_threshold": 64})"},
        {"prefetch_threshold_tokens", "64"}},
       "'prefetch_threshold' (SGLang's extra config) and 'prefetch_threshold_tokens' both given"},
      {{{"hicache_storage_backend", file}, {"storage", R"({"backend": "file", "root": "x"})"}},
       "'hicache_storage_backend' (SGLang's name) and 'storage' both given"},
  };
  for (const auto& [keys, needle] : cases) {
    const std::string e = error_of([&] { (void)config_with(keys); });
    EXPECT_NE(e.find(needle), std::string::npos) << "'" << e << "' does not say " << needle;
  }
}

// Stores `tokens` in a file store at `root` as an engine does: a write-through cache backs them
// up. Returns the tokens stored.
std::int64_t store_in_l3(const fs::path& root, std::span<const std::int32_t> tokens) {
  HiCache hc(config_with(
      {{"storage", str_cat(R"({"backend": "file", "root": ")", root.string(), R"("})")}}));
  insert_fresh(hc, tokens);
  settle(hc);
  return hc.cache().stats().stored_tokens;
}

// A request whose tokens the tree lacks prefetches them from L3 and steps until the prefetch is
// over; returns the tokens it added to the tree (0: declined or revoked).
std::int64_t prefetch(HiCache& hc, std::span<const std::int32_t> tokens) {
  const auto m = hc.cache().match_prefix(tokens);
  if (!hc.cache().prefetch_from_storage("r", m.last_host_node, tokens)) return 0;
  const auto deadline = steady_clock::now() + std::chrono::seconds(60);
  while (true) {
    const std::uint64_t seen = hc.cache().event_seq();
    hc.cache().check_events();
    std::int64_t inserted = 0;
    if (hc.cache().check_prefetch_progress("r", &inserted)) return inserted;
    if (!hc.cache().wait_for_events(seen, deadline)) {
      ADD_FAILURE() << "the prefetch never ended";
      return 0;
    }
  }
}

// sidecars with storage: the state goes to L3 with its KV, and a fresh cache on the same store
// prefetches both back (the prefix restores only with its state). attach_storage at run time
// gives the storage controller the same pools.
TEST(ConfigEffect, SidecarsWithStorageGoToL3AndComeBack) {
  TempDir dir;
  const std::string sidecars = R"({"state": {"policy": "trailing", "layers": 2, "slot_bytes": 512,
                                   "dtype": "fp32", "device_pages": 4, "host_pages": 8}})";
  const std::string storage = str_cat(R"({"backend": "file", "root": ")", dir.path.string(), R"("})");
  const auto t = tokens_of(3, 2);
  {
    HiCache hc(config_with({{"write_policy", R"("write_through")"}, {"sidecars", sidecars},
                            {"storage", storage}}));
    ASSERT_NE(hc.storage_controller(), nullptr);
    EXPECT_EQ(hc.storage_controller()->num_sidecars(), 1u);
    SidecarPool& state = hc.sidecar_pool("state");
    const auto kv = *hc.device_pool().allocator().alloc(2 * kPage);
    const auto st = *state.device_pool().allocator().alloc(1);
    const std::vector<std::int64_t> last{1};
    const HiRadixCache::SidecarInsert side[] = {{hc.sidecar_index("state"), last, st}};
    hc.cache().insert(t, kv, {}, side);
    settle(hc);
    EXPECT_EQ(hc.cache().stats().stored_tokens, 2 * kPage);
    EXPECT_EQ(hc.storage_controller()->sidecar_written_bytes(), state.spec().page_bytes());
  }
  HiCache fresh(config_with({{"write_policy", R"("write_through")"}, {"sidecars", sidecars},
                             {"storage", storage}, {"prefetch_threshold_tokens", "4"},
                             {"prefetch_policy", R"("wait_complete")"}}));
  EXPECT_EQ(prefetch(fresh, t), 2 * kPage);
  EXPECT_EQ(fresh.cache().match_prefix(t).host_hit_tokens, 2 * kPage) << "restorable from L3";
  EXPECT_EQ(fresh.storage_controller()->sidecar_read_bytes(), fresh.sidecar_pool("state").spec().page_bytes());
  fresh.detach_storage();
  fresh.attach_storage(storage);
  EXPECT_EQ(fresh.storage_controller()->num_sidecars(), 1u);
}

// prefetch_threshold_tokens, prefetch_budget_tokens and storage_batch_pages: whether an L3 hit
// is read at all (a hit below the threshold is revoked, one past the budget declined), and in
// how many storage calls.
TEST(ConfigEffect, PrefetchThresholdBudgetAndBatchPagesShapeAnL3Read) {
  TempDir root;
  const auto t = tokens_of(1, 8);  // 32 tokens
  ASSERT_EQ(store_in_l3(root.path, t), 32);
  struct Case {
    std::map<std::string, std::string> keys;
    std::int64_t inserted;
    int min_batch_gets, max_batch_gets;
  };
  const Case cases[] = {
      // Automatic batches: paced reads from one page, at most doubling (1, 2, 4, 1 at least).
      {{{"prefetch_threshold_tokens", "16"}}, 32, 4, 8},
      {{{"prefetch_threshold_tokens", "64"}}, 0, 0, 0},
      {{{"prefetch_threshold_tokens", "16"}, {"prefetch_budget_tokens", "16"}}, 0, 0, 0},
      {{{"prefetch_threshold_tokens", "16"}, {"storage_batch_pages", "2"}}, 32, 4, 4},
      {{{"prefetch_threshold_tokens", "16"}, {"storage_batch_pages", "3"}}, 32, 3, 3},
  };
  for (const Case& c : cases) {
    std::string trace;
    for (const auto& [k, v] : c.keys) trace += str_cat(k, " ", v, " ");
    SCOPED_TRACE(trace);
    auto store = std::make_shared<GatedStore>(root.path.string());
    HiCacheParts parts;
    parts.storage = store;
    auto keys = c.keys;
    keys["prefetch_policy"] = R"("wait_complete")";  // ends when it has read everything
    HiCache hc(config_with(keys), std::move(parts));
    EXPECT_EQ(prefetch(hc, t), c.inserted);
    EXPECT_GE(store->batch_gets, c.min_batch_gets);
    EXPECT_LE(store->batch_gets, c.max_batch_gets);
    EXPECT_EQ(hc.cache().match_prefix(t).host_hit_tokens, c.inserted);
  }
}

// storage_admission: write_through backs a page up to L3 as soon as it reaches the host;
// exclusive only as host eviction takes it (freed on the backup's ack, not at once).
TEST(ConfigEffect, StorageAdmissionDecidesWhenHostPagesReachL3) {
  for (const char* admission : {"write_through", "exclusive"}) {
    SCOPED_TRACE(admission);
    const bool exclusive = std::string_view(admission) == "exclusive";
    TempDir dir;
    HiCache hc(config_with({{"storage_admission", json_string(admission)},
                            {"storage", str_cat(R"({"backend": "file", "root": )",
                                                json_string(dir.path.string()), "}")}}));
    const auto t = tokens_of(1, 2);
    make_host_only(hc, t);
    const std::int64_t page_bytes = hc.host_pool().geometry().token_bytes() * kPage;
    EXPECT_EQ(hc.storage_controller()->written_bytes(), exclusive ? 0 : 2 * page_bytes);
    EXPECT_EQ(hc.cache().evict_host(2 * kPage), exclusive ? 0 : 2 * kPage);
    settle(hc);
    EXPECT_EQ(hc.storage_controller()->written_bytes(), 2 * page_bytes);
    EXPECT_EQ(hc.cache().stats().host_tokens, 0);
  }
}

// storage_admission reuse with storage_admission_min_hits: a node's pages reach L3 only once
// that many later matches passed it (1: the first request that asks again).
TEST(ConfigEffect, StorageAdmissionMinHitsIsTheMatchesBeforeL3) {
  for (const int min_hits : {1, 2}) {
    SCOPED_TRACE(str_cat("storage_admission_min_hits ", min_hits));
    TempDir dir;
    HiCache hc(config_with({{"storage_admission", json_string("reuse")},
                            {"storage_admission_min_hits", std::to_string(min_hits)},
                            {"storage", str_cat(R"({"backend": "file", "root": )",
                                                json_string(dir.path.string()), "}")}}));
    const auto t = tokens_of(1, 2);
    const std::int64_t page_bytes = hc.host_pool().geometry().token_bytes() * kPage;
    insert_fresh(hc, t);
    settle(hc);
    EXPECT_EQ(hc.storage_controller()->written_bytes(), 0) << "used once: not in L3";
    for (int match = 1; match <= 2; ++match) {
      hc.cache().match_prefix(t);
      settle(hc);
      EXPECT_EQ(hc.storage_controller()->written_bytes(), match >= min_hits ? 2 * page_bytes : 0)
          << "after match " << match;
    }
  }
}

std::map<std::string, std::string> tp_keys(int rank, const fs::path& dir) {
  return {{"tp_size", "2"},
          {"tp_rank", std::to_string(rank)},
          {"tp_store_dir", json_string(dir.string())}};
}

// tp_connect_timeout_ms: a rank whose peer never starts gives up on the rendezvous after it, not
// after the default two minutes.
TEST(ConfigEffect, TpConnectTimeoutEndsARendezvousNoPeerJoins) {
  TempDir rendezvous;
  auto keys = tp_keys(0, rendezvous.path);
  keys["tp_connect_timeout_ms"] = "300";
  const auto start = steady_clock::now();
  const std::string e = error_of([&] { HiCache alone(config_with(keys)); });
  const auto took = steady_clock::now() - start;
  EXPECT_NE(e, "(no error)");
  EXPECT_GE(took, milliseconds(250)) << e;
  EXPECT_LT(took, milliseconds(60000)) << "waited as long as the default: " << e;
}

// tp_hostname: the address the rank listens on; one that is not this host's fails at once.
TEST(ConfigEffect, TpHostnameIsTheAddressTheRankListensOn) {
  TempDir rendezvous;
  auto keys = tp_keys(0, rendezvous.path);
  keys["tp_hostname"] = R"("192.0.2.1")";  // TEST-NET-1: never an address of this host
  keys["tp_connect_timeout_ms"] = "5000";  // were it ignored: no two-minute wait for the peer
  const std::string e = error_of([&] { HiCache hc(config_with(keys)); });
  EXPECT_NE(e, "(no error)");
  EXPECT_NE(e.find("192.0.2.1"), std::string::npos) << e;
}

// tp_timeout_ms: an agreement call a peer never joins fails after it (the cache goes on alone
// and counts the failure), not after the default 30 s. (The lower bounds leave the transport
// its rounding of the deadline.)
TEST(ConfigEffect, TpTimeoutEndsAnAgreementAPeerNeverJoins) {
  TempDir rendezvous;
  const auto make = [&](int rank) {
    auto keys = tp_keys(rank, rendezvous.path);
    keys["tp_timeout_ms"] = "300";
    keys["tp_connect_timeout_ms"] = "30000";
    return std::make_unique<HiCache>(config_with(keys));
  };
  std::unique_ptr<HiCache> other;
  std::string other_error;
  std::thread t([&] { other_error = error_of([&] { other = make(1); }); });
  std::unique_ptr<HiCache> first;
  const std::string error = error_of([&] { first = make(0); });
  t.join();
  ASSERT_TRUE(first && other) << error << " / " << other_error;
  const auto start = steady_clock::now();
  EXPECT_TRUE(first->cache().on_every_rank(true, "effect.alone")) << "alone: its own value";
  const auto took = steady_clock::now() - start;
  EXPECT_EQ(first->cache().stats().tp_failures, 1);
  EXPECT_GE(took, milliseconds(250));
  EXPECT_LT(took, milliseconds(20000)) << "waited as long as the default";
}

}  // namespace
}  // namespace hicache
