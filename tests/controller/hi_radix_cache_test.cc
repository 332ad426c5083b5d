#include "controller/hi_radix_cache.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <optional>
#include <random>
#include <thread>

#include <filesystem>
#include <fstream>
#include <unistd.h>

#include "pools/kv_pattern.h"
#include "storage/file_storage.h"
#include "transfer/errors.h"
#include "transfer/host_device.h"
#include "tests/controller/faulty_device.h"

namespace hicache {
namespace {

constexpr std::int32_t kPage = 4;

KVGeometry geometry() { return KVGeometry::mha(2, 1, 8, DType::kFloat16, kPage); }

// The data of page i of a sequence derives from its whole token prefix, as a model's KV does,
// and from the cache identity (a LoRA adapter's KV differs for the same tokens).
std::uint64_t page_seed(std::span<const std::int32_t> tokens, std::size_t page,
                        std::string_view identity = {}) {
  const auto prefix = tokens.first((page + 1) * kPage);
  return std::hash<std::string_view>{}(std::string_view(
             reinterpret_cast<const char*>(prefix.data()), prefix.size_bytes())) ^
         (identity.empty() ? 0 : std::hash<std::string_view>{}(identity) * 31);
}

KeyNamespace key_ns() {
  return {.model = "m", .fingerprint = "f", .dtype = "fp16", .layout = "page_first",
          .page_size = kPage};
}

// An L3 shared by several engines: a file store in a temporary directory.
struct L3 {
  std::filesystem::path root;
  FileStorage file;
  LocalCollective local;
  // The storage controller's collectives (TP tests give each its group).
  Collective* prefetch = &local;
  Collective* backup = &local;
  Collective* main = &local;
  explicit L3(const std::string& name)
      : root(std::filesystem::temp_directory_path() / str_cat("hicache-radix-", name, "-", ::getpid())),
        file(FileStorageConfig{.root = (std::filesystem::remove_all(root), root.string())}) {}
  ~L3() { std::filesystem::remove_all(root); }
};

// A small engine around the cache: what a scheduler does for one request.
struct Engine {
  testing::FaultyDevice device;  // fails nothing unless a test asks
  DeviceKVPool device_pool;
  HostKVPool host_pool;
  HiCacheController controller;
  KeyNamespace ns = key_ns();
  std::unique_ptr<StorageController> storage;
  HiRadixCache cache;
  std::int64_t verified_pages = 0, recomputed_pages = 0, loaded_requests = 0, dropped = 0;
  std::int64_t requests = 0;

  Engine(WritePolicy policy, std::int64_t device_pages, std::int64_t host_pages,
         RadixCacheConfig config = {}, L3* l3 = nullptr, StorageControllerConfig sc = {},
         Collective* tp = nullptr)
      : device_pool(device, geometry(), device_pages * kPage),
        host_pool(device, geometry(), HostLayout::kPageFirst, host_pages * kPage),
        controller(device, device_pool, host_pool, ControllerConfig{.write_policy = policy}),
        storage(l3 == nullptr ? nullptr
                              : std::make_unique<StorageController>(host_pool, l3->file, ns,
                                                                    *l3->prefetch, *l3->backup,
                                                                    *l3->main, sc)),
        cache(controller, device_pool, host_pool, config, storage.get(),
              l3 == nullptr ? nullptr : &ns, tp) {}

  // Runs one request: match, load back, "compute" the rest, insert, release. Every page it reads
  // from the cache is checked byte for byte against the data its prefix derives.
  void run(std::span<const std::int32_t> tokens, std::string_view identity = {}) {
    check();
    auto m = cache.match_prefix(tokens, identity);
    const std::size_t known = m.device_slots.size() + static_cast<std::size_t>(m.host_hit_tokens);
    if (storage && tokens.size() / kPage * kPage > known) {
      // Past the tree: ask L3 for the rest, wait for it (a scheduler would run other requests
      // meanwhile), and match again.
      const std::string id = str_cat("req-", ++requests);
      if (cache.prefetch_from_storage(id, m.last_host_node, tokens.subspan(known), identity)) {
        while (!cache.check_prefetch_progress(id)) check();
        m = cache.match_prefix(tokens, identity);
      }
    }
    HiRadixCache::Node* held = m.last_host_node;
    cache.lock(held);
    std::vector<std::int64_t> slots = m.device_slots;
    if (m.host_hit_tokens > 0) {
      if (auto back = cache.load_back(held)) {
        slots = std::move(*back);
        const std::int32_t slot = controller.start_loading();
        if (slot >= 0) {
          for (std::int32_t l = 0; l < geometry().num_layers; ++l) {
            EXPECT_TRUE(device_pool.wait_for_layer(l)) << "a load failed: layer " << l;
          }
          controller.layer_done_counter().release(slot);
        }
        ++loaded_requests;
      } else {
        cache.unlock(held);
        held = m.last_device_node;
        cache.lock(held);
      }
    }
    const std::size_t cached_pages = slots.size() / kPage;
    for (std::size_t p = 0; p < cached_pages; ++p) {
      ASSERT_TRUE(verify_page(device_pool.layout(), slots[p * kPage] / kPage,
                              page_seed(tokens, p, identity)))
          << "page " << p << " served with wrong bytes";
      ++verified_pages;
    }
    const std::size_t total_pages = tokens.size() / kPage;
    const auto missing = static_cast<std::int64_t>((total_pages - cached_pages) * kPage);
    if (missing > 0) {
      auto fresh = device_pool.allocator().alloc(missing);
      if (!fresh) {
        cache.evict_device(missing);
        fresh = device_pool.allocator().alloc(missing);
      }
      for (int attempt = 0; attempt < 4 && !fresh; ++attempt) {
        // Nodes with writes or loads in flight cannot go yet (write-back frees on the ack):
        // wait for them, as a scheduler keeps the request queued, then evict again.
        settle();
        fresh = device_pool.allocator().alloc(missing);
        if (!fresh) {
          cache.evict_device(missing);
          fresh = device_pool.allocator().alloc(missing);
        }
      }
      if (!fresh) {  // everything left is in use by this request: drop it
        ++dropped;
        cache.unlock(held);
        return;
      }
      for (std::size_t p = cached_pages; p < total_pages; ++p) {
        fill_page(device_pool.layout(), (*fresh)[(p - cached_pages) * kPage] / kPage,
                  page_seed(tokens, p, identity));
        ++recomputed_pages;
      }
      slots.insert(slots.end(), fresh->begin(), fresh->end());
    }
    const std::int64_t dup = cache.insert(tokens.first(total_pages * kPage), slots, identity);
    // Slots [cached, dup) are ours and duplicate the tree's: free them.
    const auto ours_from = static_cast<std::int64_t>(cached_pages * kPage);
    if (dup > ours_from) {
      device_pool.allocator().free(std::span(slots).subspan(ours_from, dup - ours_from));
    }
    cache.unlock(held);
  }

  // The step's check_events, counted when an op was in flight (under TP the only call that
  // reduces, and only then).
  void check() {
    const auto s = cache.stats();
    if (s.writes_in_flight + s.loads_in_flight + s.backups_in_flight > 0 ||
        cache.prefetches_in_flight() > 0) {
      ++busy_checks;
    }
    cache.check_events();
  }
  std::int64_t busy_checks = 0;

  // Lets every write and load finish and applies the acks.
  void settle() {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    do {
      check();
      const auto s = cache.stats();
      if (s.writes_in_flight == 0 && s.loads_in_flight == 0 && s.backups_in_flight == 0 &&
          cache.prefetches_in_flight() == 0) {
        return;
      }
      std::this_thread::yield();
    } while (std::chrono::steady_clock::now() < deadline);
    FAIL() << "writes or loads never finished";
  }

  // Every device and host slot is the tree's (no request holds any between runs).
  void expect_accounting() {
    settle();
    const auto s = cache.stats();
    EXPECT_EQ(device_pool.allocator().capacity_tokens() - device_pool.allocator().free_tokens(),
              s.device_tokens);
    EXPECT_EQ(host_pool.capacity_tokens() - host_pool.free_tokens(), s.host_tokens);
    EXPECT_EQ(cache.check_invariants(), "");
  }
};

std::vector<std::int32_t> seq(std::initializer_list<std::int32_t> pages_of) {
  std::vector<std::int32_t> t;
  for (std::int32_t v : pages_of) {
    for (int i = 0; i < kPage; ++i) t.push_back(v * 10 + i);
  }
  return t;
}

// Stores `tokens` in L3 as an engine does: a write-through engine runs them and settles.
// Returns the tokens it backed up.
std::int64_t store_in_l3(L3& l3, std::span<const std::int32_t> tokens,
                         std::string_view identity = {}) {
  Engine first(WritePolicy::kWriteThrough, 32, 64, {}, &l3);
  first.run(tokens, identity);
  first.settle();
  first.expect_accounting();
  return first.cache.stats().stored_tokens;
}

TEST(HiRadixCache, MatchSplitsAtPageBoundariesAndReturnsTheDevicePrefix) {
  Engine e(WritePolicy::kWriteThroughSelective, 32, 64);
  const auto a = seq({1, 2, 3, 4});
  e.run(a);
  const auto b = seq({1, 2, 7});
  auto m = e.cache.match_prefix(b);
  EXPECT_EQ(m.device_slots.size(), 2u * kPage);
  EXPECT_EQ(m.host_hit_tokens, 0);
  e.run(b);
  EXPECT_EQ(e.cache.stats().nodes, 3) << "[1,2] split off, [3,4] and [7] below it";
  EXPECT_EQ(e.cache.match_prefix(a).device_slots.size(), 4u * kPage);
  // A partial trailing page never matches.
  auto partial = seq({1, 2});
  partial.push_back(99);
  EXPECT_EQ(e.cache.match_prefix(partial).device_slots.size(), 2u * kPage);
  e.expect_accounting();
  EXPECT_EQ(e.verified_pages, 2);
}

TEST(HiRadixCache, InsertReturnsTheCachedPrefixAndRejectsBadInput) {
  Engine e(WritePolicy::kWriteThroughSelective, 32, 64);
  const auto a = seq({1, 2});
  e.run(a);
  auto slots = *e.device_pool.allocator().alloc(3 * kPage);
  const auto b = seq({1, 2, 3});
  EXPECT_EQ(e.cache.insert(b, slots), 2 * kPage);
  e.device_pool.allocator().free(std::span(slots).first(2 * kPage));
  EXPECT_THROW(e.cache.insert(std::vector<std::int32_t>(kPage + 1, 5),
                              std::vector<std::int64_t>(kPage + 1, 0)),
               InvalidArgument);
  EXPECT_THROW(e.cache.insert(seq({9}), std::vector<std::int64_t>(kPage - 1, 0)), InvalidArgument);
  auto m = e.cache.match_prefix(b);
  EXPECT_THROW(e.cache.unlock(m.last_device_node), StateError) << "unlock below zero";
  e.expect_accounting();
}

TEST(HiRadixCache, WriteThroughBacksUpOnInsertAndEvictionKeepsTheHostCopy) {
  Engine e(WritePolicy::kWriteThrough, 32, 64);
  const auto a = seq({1, 2, 3});
  e.run(a);
  e.settle();
  EXPECT_EQ(e.cache.stats().host_tokens, 3 * kPage);
  EXPECT_EQ(e.cache.evict_device(100), 3 * kPage);
  auto m = e.cache.match_prefix(a);
  EXPECT_TRUE(m.device_slots.empty());
  EXPECT_EQ(m.host_hit_tokens, 3 * kPage);
  e.run(a);  // loads back and verifies every page
  EXPECT_EQ(e.loaded_requests, 1);
  EXPECT_EQ(e.verified_pages, 3);
  EXPECT_EQ(e.recomputed_pages, 3) << "nothing recomputed the second time";
  e.expect_accounting();
}

TEST(HiRadixCache, SelectiveWritesAfterTheThresholdOnly) {
  Engine e(WritePolicy::kWriteThroughSelective, 32, 64, {.write_through_threshold = 2});
  const auto a = seq({1, 2});
  e.run(a);  // insert: no hit yet
  e.settle();
  EXPECT_EQ(e.cache.stats().host_tokens, 0);
  e.run(a);  // hit 1
  e.settle();
  EXPECT_EQ(e.cache.stats().host_tokens, 0);
  e.run(a);  // hit 2: written
  e.settle();
  EXPECT_EQ(e.cache.stats().host_tokens, 2 * kPage);
  // Without a host copy, eviction drops the KV entirely.
  const auto b = seq({5, 6});
  e.run(b);
  e.settle();
  EXPECT_EQ(e.cache.evict_device(100), 4 * kPage);
  EXPECT_EQ(e.cache.match_prefix(b).host_hit_tokens, 0) << "b had no host copy";
  EXPECT_EQ(e.cache.match_prefix(a).host_hit_tokens, 2 * kPage);
  e.expect_accounting();
}

TEST(HiRadixCache, WriteBackWritesOnEvictionAndFreesOnTheAck) {
  Engine e(WritePolicy::kWriteBack, 32, 64);
  const auto a = seq({1, 2, 3});
  e.run(a);
  e.settle();
  EXPECT_EQ(e.cache.stats().host_tokens, 0) << "nothing written before eviction";
  EXPECT_EQ(e.cache.evict_device(100), 0) << "freed on the ack, not now";
  e.settle();
  const auto s = e.cache.stats();
  EXPECT_EQ(s.device_tokens, 0);
  EXPECT_EQ(s.host_tokens, 3 * kPage);
  e.run(a);
  EXPECT_EQ(e.verified_pages, 3);
  e.expect_accounting();
}

TEST(HiRadixCache, LockedNodesAreNeverEvictedAndHostEvictionTakesLeaves) {
  Engine e(WritePolicy::kWriteThrough, 32, 64);
  const auto a = seq({1, 2}), b = seq({1, 3});
  e.run(a);
  e.run(b);
  e.settle();
  auto m = e.cache.match_prefix(a);
  e.cache.lock(m.last_device_node);
  EXPECT_EQ(e.cache.evict_device(100), kPage) << "only b's own page is free to go";
  e.cache.unlock(m.last_device_node);
  EXPECT_EQ(e.cache.evict_device(100), 2 * kPage);
  EXPECT_EQ(e.cache.evict_host(kPage), kPage);  // one leaf
  EXPECT_EQ(e.cache.evict_host(100), 2 * kPage);  // the other leaf, then their parent
  EXPECT_EQ(e.cache.stats().nodes, 0);
  e.expect_accounting();
}

TEST(HiRadixCache, HostFullLeavesNodesDeviceOnly) {
  Engine e(WritePolicy::kWriteThrough, 32, 2);
  e.run(seq({1, 2}));
  e.run(seq({3, 4}));  // the host pool holds 2 pages: this write finds it full
  e.settle();
  const auto s = e.cache.stats();
  EXPECT_EQ(s.device_tokens, 4 * kPage);
  EXPECT_EQ(s.host_tokens, 2 * kPage);
  e.expect_accounting();
}

// Device full of locked pages: load_back refuses and changes nothing; once the lock goes, the
// same load back evicts and succeeds.
TEST(HiRadixCache, DeviceFullOfLockedPagesRefusesLoadBackAndLeaksNothing) {
  Engine e(WritePolicy::kWriteThrough, 4, 64);
  const auto a = seq({1, 2, 3, 4});
  const auto c = seq({5, 6, 7, 8});
  e.run(a);
  e.settle();
  ASSERT_EQ(e.cache.evict_device(100), 4 * kPage);  // a: host only
  e.run(c);                                         // c fills the device
  e.settle();
  auto mc = e.cache.match_prefix(c);
  e.cache.lock(mc.last_device_node);  // a running request holds c
  auto ma = e.cache.match_prefix(a);
  ASSERT_EQ(ma.host_hit_tokens, 4 * kPage);
  const auto host_free = e.host_pool.free_tokens();
  EXPECT_FALSE(e.cache.load_back(ma.last_host_node).has_value());
  EXPECT_EQ(e.device_pool.allocator().free_tokens(), 0);
  EXPECT_EQ(e.host_pool.free_tokens(), host_free);
  EXPECT_EQ(e.cache.stats().loads_in_flight, 0);
  EXPECT_EQ(e.cache.check_invariants(), "");
  e.cache.unlock(mc.last_device_node);
  const auto verified = e.verified_pages;
  e.run(a);  // evicts c's device copy (synced) and loads a back, verified
  EXPECT_EQ(e.verified_pages, verified + 4);
  e.expect_accounting();
}

// Cost-aware load back: once a load was measured, a host hit is loaded only when copying it is
// predicted cheaper than recomputing it; the decision's inputs are in the stats.
TEST(HiRadixCache, LoadBackIsRefusedWhenRecomputingIsCheaper) {
  for (double cost : {1e-15, 1.0}) {  // seconds per token: recompute far cheaper / far dearer
    Engine e(WritePolicy::kWriteThrough, 32, 64, {.recompute_seconds_per_token = cost});
    const auto a = seq({1, 2, 3});
    e.run(a);
    e.settle();
    e.cache.evict_device(100);
    e.run(a);  // nothing measured yet: loads (that is how the bandwidth gets measured)
    e.settle();
    ASSERT_EQ(e.loaded_requests, 1);
    e.cache.evict_device(100);
    e.run(a);
    e.settle();
    const auto s = e.cache.stats();
    EXPECT_GT(s.measured_load_gbps, 0);
    EXPECT_GT(s.last_load_estimate_s, 0);
    EXPECT_DOUBLE_EQ(s.last_recompute_estimate_s, 3 * kPage * cost);
    if (cost < 1e-9) {
      EXPECT_EQ(e.loaded_requests, 1) << "loaded although recomputing is cheaper";
      EXPECT_EQ(s.load_backs_refused_by_cost, 1);
    } else {
      EXPECT_EQ(e.loaded_requests, 2);
      EXPECT_EQ(s.load_backs_refused_by_cost, 0);
    }
    e.expect_accounting();
  }
}

// Write-back demotion between watermarks: below `low` free, check_events starts writing the
// LRU nodes back until `high` would be free, without blocking; pages come back byte for byte.
TEST(HiRadixCache, WriteBackDemotesBetweenWatermarksWithoutBlocking) {
  Engine e(WritePolicy::kWriteBack, 16, 64,
           {.demote_low_watermark = 0.25, .demote_high_watermark = 0.5});
  for (int f = 0; f < 7; ++f) e.run(seq({10 * f + 1, 10 * f + 2}));  // 14 of 16 pages used
  EXPECT_EQ(e.device_pool.allocator().free_tokens(), 2 * kPage);
  e.cache.check_events();  // 12.5% free < 25%: demote 6 pages (3 nodes), freed on the acks
  EXPECT_EQ(e.cache.stats().demotions, 1);
  EXPECT_EQ(e.cache.stats().writes_in_flight, 3);
  e.cache.check_events();  // what is on its way out counts: nothing more is started
  EXPECT_EQ(e.cache.stats().demotions, 1);
  e.settle();
  EXPECT_GE(e.device_pool.allocator().free_tokens(), 8 * kPage);
  EXPECT_EQ(e.cache.stats().host_tokens, 6 * kPage);
  const auto verified = e.verified_pages;
  e.run(seq({1, 2}));  // the oldest, demoted: loaded back and verified
  EXPECT_EQ(e.verified_pages, verified + 2);
  EXPECT_EQ(e.loaded_requests, 1);
  e.expect_accounting();
  EXPECT_THROW(Engine(WritePolicy::kWriteBack, 16, 64,
                      {.demote_low_watermark = 0.6, .demote_high_watermark = 0.5}),
               InvalidArgument);
}

TEST(HiRadixCache, EdgeHashBitsOutsideOneTo64AreNamed) {
  for (int bits : {0, 65}) {
    try {
      RadixCacheConfig{.edge_hash_bits = bits}.validate();
      FAIL() << "accepted edge_hash_bits " << bits;
    } catch (const InvalidArgument& err) {
      EXPECT_NE(std::string(err.what()).find(str_cat("edge_hash_bits ", bits, " is not in 1..64")),
                std::string::npos)
          << err.what();
    }
  }
  RadixCacheConfig{.edge_hash_bits = 1}.validate();
}

// What evict_device can free: device tokens of nodes no request holds and no copy is in flight
// for. A held node leaves it (and so does its path), a write in flight too; eviction takes it
// down by what it frees.
TEST(HiRadixCache, EvictableDeviceTokensFollowLocksWritesAndEviction) {
  Engine e(WritePolicy::kWriteThrough, 32, 64);
  const auto a = seq({1, 2}), b = seq({1, 2, 3});
  e.run(a);
  e.run(b);
  e.settle();
  EXPECT_EQ(e.cache.stats().evictable_device_tokens, 3 * kPage);
  auto m = e.cache.match_prefix(b);
  e.cache.lock(m.last_device_node);  // a request holds the whole path
  EXPECT_EQ(e.cache.stats().evictable_device_tokens, 0);
  EXPECT_EQ(e.cache.evictable_device_tokens(), 0);
  EXPECT_EQ(e.cache.evict_device(kPage), 0) << "nothing evictable, nothing evicted";
  e.cache.unlock(m.last_device_node);
  EXPECT_EQ(e.cache.stats().evictable_device_tokens, 3 * kPage);
  EXPECT_EQ(e.cache.evict_device(kPage), kPage);  // the leaf {3}
  EXPECT_EQ(e.cache.stats().evictable_device_tokens, 2 * kPage);
  e.run(seq({4}));  // inserted and written through: out of it while the write is in flight
  const auto s = e.cache.stats();
  EXPECT_EQ(s.evictable_device_tokens, s.writes_in_flight > 0 ? 2 * kPage : 3 * kPage);
  EXPECT_EQ(e.cache.evictable_device_tokens(), s.evictable_device_tokens);
  e.settle();
  EXPECT_EQ(e.cache.stats().evictable_device_tokens, 3 * kPage);
  EXPECT_EQ(e.cache.check_invariants(), "");
}

// LRU evicts the least recently used node; LFU the least often hit one, whatever its age.
TEST(HiRadixCache, LfuKeepsTheOftenHitNodeLruTheRecentOne) {
  for (EvictionPolicy policy : {EvictionPolicy::kLru, EvictionPolicy::kLfu}) {
    Engine e(WritePolicy::kWriteThrough, 32, 64, {.eviction_policy = policy});
    const auto often = seq({1, 2});
    const auto recent = seq({3, 4});
    for (int i = 0; i < 5; ++i) e.run(often);
    e.run(recent);
    e.settle();
    ASSERT_EQ(e.cache.evict_device(2 * kPage), 2 * kPage) << to_string(policy);
    const bool often_kept = !e.cache.match_prefix(often).device_slots.empty();
    const bool recent_kept = !e.cache.match_prefix(recent).device_slots.empty();
    EXPECT_EQ(often_kept, policy == EvictionPolicy::kLfu) << to_string(policy);
    EXPECT_EQ(recent_kept, policy == EvictionPolicy::kLru) << to_string(policy);
    e.expect_accounting();
  }
  EXPECT_EQ(parse_eviction_policy("lfu"), EvictionPolicy::kLfu);
  try {
    parse_eviction_policy("fifo");
    FAIL() << "accepted fifo";
  } catch (const InvalidArgument& err) {
    EXPECT_NE(std::string(err.what()).find("'fifo' (valid: lru, lfu)"), std::string::npos);
  }
}

// Regression: an inner node whose write-through write found the host full, with a host-only
// child, used to be no eviction candidate at all; a device full of such nodes made the engine
// reject requests that fit. It is now written on eviction and freed on the ack.
TEST(HiRadixCache, AnInnerNodeWhoseWriteFoundTheHostFullIsWrittenWhenEvicted) {
  Engine e(WritePolicy::kWriteThrough, 32, 4);
  e.run(seq({1, 2}));
  e.run(seq({7, 8}));
  e.settle();  // the host pool is full
  e.run(seq({3, 4}));
  e.settle();  // x = [3, 4]: its write found the host full, device only
  ASSERT_EQ(e.cache.stats().host_tokens, 4 * kPage);
  ASSERT_EQ(e.cache.evict_device(4 * kPage), 4 * kPage);  // the two older nodes, LRU
  ASSERT_EQ(e.cache.evict_host(4 * kPage), 4 * kPage);
  const auto xy = seq({3, 4, 5, 6});
  e.run(xy);
  e.settle();  // y = [5, 6] is written; x, already in the tree, is not written again
  ASSERT_EQ(e.cache.stats().host_tokens, 2 * kPage);
  ASSERT_EQ(e.cache.evict_device(2 * kPage), 2 * kPage);  // y, the only leaf
  // x: device only, with a host-only child. Eviction writes it and frees it on the ack.
  EXPECT_EQ(e.cache.evict_device(100), 0);
  EXPECT_EQ(e.cache.stats().writes_in_flight, 1);
  e.settle();
  EXPECT_EQ(e.cache.stats().device_tokens, 0);
  EXPECT_EQ(e.cache.stats().host_tokens, 4 * kPage);
  const auto verified = e.verified_pages;
  e.run(xy);  // all four pages load back from the host, every byte checked
  EXPECT_EQ(e.verified_pages, verified + 4);
  e.expect_accounting();
}

// The same inner node when the host is full of host-only leaves: eviction frees the least
// recently used of them for its copy (before, it kept the node, and a device full of such
// nodes, with nothing in flight, could never admit a request again).
TEST(HiRadixCache, AnInnerNodeFindingTheHostFullMakesRoomThereWhenEvicted) {
  Engine e(WritePolicy::kWriteThrough, 32, 4);
  e.run(seq({1, 2}));
  e.run(seq({7, 8}));
  e.settle();  // the host pool is full
  e.run(seq({3, 4}));
  e.settle();  // x = [3, 4]: device only
  ASSERT_EQ(e.cache.evict_device(4 * kPage), 4 * kPage);  // [1, 2] and [7, 8] stay on host
  ASSERT_EQ(e.cache.evict_host(2 * kPage), 2 * kPage);    // [1, 2], the older
  const auto xy = seq({3, 4, 5, 6});
  e.run(xy);
  e.settle();  // y = [5, 6] written: the host is full again ([7, 8], y)
  ASSERT_EQ(e.cache.evict_device(2 * kPage), 2 * kPage);  // y's device copy
  ASSERT_EQ(e.host_pool.free_tokens(), 0);
  // x: device only, a host-only child, the host full. [7, 8] goes to make room; x is written.
  EXPECT_EQ(e.cache.evict_device(100), 0);
  EXPECT_EQ(e.cache.stats().writes_in_flight, 1);
  EXPECT_EQ(e.cache.stats().evicted_host_tokens, 4 * kPage);
  e.settle();
  EXPECT_EQ(e.cache.stats().device_tokens, 0);
  EXPECT_EQ(e.cache.stats().host_tokens, 4 * kPage);
  EXPECT_EQ(e.cache.cached_prefix_tokens(seq({7, 8})), 0);
  const auto verified = e.verified_pages;
  e.run(xy);  // all four pages load back from the host, every byte checked
  EXPECT_EQ(e.verified_pages, verified + 4);
  e.expect_accounting();
}

// Cache identities (tenants, LoRA adapters): the same tokens under two identities are two
// sequences on every tier of the tree; each is served only its own bytes (the page data
// derives from the identity, so a page served across identities fails its check).
TEST(HiRadixCache, IdentitiesNeverShareNodesOnTheDeviceOrTheHost) {
  Engine e(WritePolicy::kWriteThrough, 32, 64);
  const auto t = seq({1, 2, 3});
  e.run(t, "tenant-a");
  e.settle();
  EXPECT_EQ(e.cache.match_prefix(t, "tenant-a").device_slots.size(), 3u * kPage);
  for (std::string_view other : {"tenant-b", "", "tenant-a "}) {
    const auto m = e.cache.match_prefix(t, other);
    EXPECT_EQ(m.device_slots.size(), 0u) << "'" << other << "'";
    EXPECT_EQ(m.host_hit_tokens, 0) << "'" << other << "'";
    EXPECT_EQ(e.cache.cached_prefix_tokens(t, other), 0) << "'" << other << "'";
  }
  e.run(t, "tenant-b");  // computes every page itself
  EXPECT_EQ(e.recomputed_pages, 6);
  e.settle();
  EXPECT_EQ(e.cache.stats().nodes, 2);
  const std::string tree = e.cache.describe();
  EXPECT_NE(tree.find("(tenant-a)"), std::string::npos) << tree;
  EXPECT_NE(tree.find("(tenant-b)"), std::string::npos) << tree;
  // Both on the host only: each loads back its own pages, every byte checked against its own
  // identity's data.
  ASSERT_EQ(e.cache.evict_device(1 << 20), 6 * kPage);
  EXPECT_EQ(e.cache.match_prefix(t, "tenant-b").host_hit_tokens, 3 * kPage);
  const auto verified = e.verified_pages;
  e.run(t, "tenant-b");
  e.run(t, "tenant-a");
  EXPECT_EQ(e.verified_pages, verified + 6);
  EXPECT_EQ(e.recomputed_pages, 6);
  // A split under the root keeps the identity: a shorter prompt of tenant-a splits its node.
  e.run(seq({1, 9}), "tenant-a");
  EXPECT_EQ(e.cache.match_prefix(t, "tenant-b").device_slots.size(), 3u * kPage);
  EXPECT_EQ(e.cache.cached_prefix_tokens(seq({1, 9}), "tenant-b"), kPage);
  EXPECT_EQ(e.cache.cached_prefix_tokens(seq({1, 9}), ""), 0);
  EXPECT_EQ(e.cache.check_invariants(), "");
  e.expect_accounting();
}

// L3: a page stored under one identity is never prefetched under another (its keys chain from
// the identity), and is prefetched, loaded back and verified under its own.
TEST(HiRadixCacheStorage, IdentitiesNeverShareL3Pages) {
  L3 l3("identity");
  const auto t = seq({1, 2, 3, 4});
  EXPECT_EQ(store_in_l3(l3, t, "lora-7"), 4 * kPage);
  Engine second(WritePolicy::kWriteThrough, 32, 64, {}, &l3);
  for (std::string_view other : {"lora-8", ""}) {
    auto m = second.cache.match_prefix(t, other);
    ASSERT_TRUE(second.cache.prefetch_from_storage(str_cat("req-", other), m.last_host_node, t,
                                                   other));
    second.settle();
    EXPECT_EQ(second.cache.stats().prefetched_tokens, 0) << "'" << other << "'";
  }
  auto m = second.cache.match_prefix(t, "lora-7");
  ASSERT_TRUE(second.cache.prefetch_from_storage("req-own", m.last_host_node, t, "lora-7"));
  second.settle();
  EXPECT_EQ(second.cache.stats().prefetched_tokens, 4 * kPage);
  EXPECT_EQ(second.cache.match_prefix(t, "lora-7").host_hit_tokens, 4 * kPage);
  EXPECT_EQ(second.cache.match_prefix(t, "lora-8").host_hit_tokens, 0);
  second.run(t, "lora-7");
  EXPECT_EQ(second.verified_pages, 4) << "every page read from L3 holds its identity's bytes";
  EXPECT_EQ(second.recomputed_pages, 0);
  second.expect_accounting();
}

// The store emptied while a backup is in flight (clear_storage): whatever that backup then
// completes counts as nothing, so the tree never claims pages the store no longer holds.
TEST(HiRadixCacheStorage, ABackupInFlightWhenTheStoreIsClearedCountsNothing) {
  L3 l3("forget");
  Engine e(WritePolicy::kWriteThrough, 32, 64, {}, &l3);
  e.run(seq({1, 2, 3}));
  for (int i = 0; i < 100000 && e.cache.stats().backups_in_flight == 0; ++i) {
    e.cache.check_events();  // applies the write ack, which queues the backup
    std::this_thread::yield();
  }
  ASSERT_EQ(e.cache.stats().backups_in_flight, 1);
  l3.file.clear();
  e.cache.forget_stored_pages();
  e.settle();
  EXPECT_EQ(e.cache.stats().stored_tokens, 0);
  EXPECT_EQ(e.cache.check_invariants(), "");
  e.run(seq({5, 6}));  // a later backup counts again
  e.settle();
  EXPECT_EQ(e.cache.stats().stored_tokens, 2 * kPage);
}

// L3 detached and attached at run time: a detach with backups and a prefetch in flight lets
// go of every op (locks released, pages freed or inserted once), L1/L2 keep serving, and a new
// store attached afterwards takes backups that another engine prefetches byte for byte.
TEST(HiRadixCacheStorage, DetachAndAttachL3WhileServing) {
  L3 first("detach-a"), second("detach-b");
  Engine e(WritePolicy::kWriteThrough, 32, 64, {}, &first);
  const auto r1 = seq({1, 2, 3, 4, 5, 6}), r2 = seq({1, 2, 8}), r3 = seq({20, 21, 22, 23});
  e.run(r1);  // its backup is queued (or running) now
  e.cache.detach_storage();
  e.storage.reset();
  RadixCacheStats st = e.cache.stats();
  EXPECT_EQ(st.backups_in_flight, 0);
  EXPECT_EQ(st.stored_tokens, 0);
  EXPECT_EQ(e.cache.check_invariants(), "");
  EXPECT_FALSE(e.cache.prefetch_from_storage("detached", e.cache.match_prefix(r3).last_host_node, r3));
  e.run(r2);
  e.run(r1);
  e.settle();
  e.expect_accounting();
  e.cache.detach_storage();  // nothing attached: nothing happens

  // A key namespace of another page size is refused and changes nothing.
  StorageController other_sc(e.host_pool, second.file, e.ns, second.local, second.local,
                             second.local);
  KeyNamespace wrong = e.ns;
  wrong.page_size = 2 * kPage;
  EXPECT_THROW(e.cache.attach_storage(other_sc, wrong), InvalidArgument);
  EXPECT_FALSE(e.cache.prefetch_from_storage("still-detached",
                                             e.cache.match_prefix(r3).last_host_node, r3));
  e.storage = std::make_unique<StorageController>(e.host_pool, second.file, e.ns, second.local,
                                                  second.local, second.local);
  e.cache.attach_storage(*e.storage, e.ns);
  EXPECT_THROW(e.cache.attach_storage(other_sc, e.ns), StateError);
  e.run(r3);
  e.settle();
  EXPECT_EQ(e.cache.stats().stored_tokens, 4 * kPage) << "backups go to the attached store";

  // Another engine finds r3 in the new store; detached with its prefetch in flight, it holds
  // no page of it afterwards, and serves on.
  Engine f(WritePolicy::kWriteThrough, 32, 64, {}, &second);
  auto m = f.cache.match_prefix(r3);
  ASSERT_TRUE(f.cache.prefetch_from_storage("in-flight", m.last_host_node, r3));
  f.cache.detach_storage();
  f.storage.reset();
  EXPECT_EQ(f.cache.prefetches_in_flight(), 0u);
  f.settle();
  f.expect_accounting();
  f.run(r3);  // from the tree if the prefetch got its pages in, else recomputed: verified
  EXPECT_EQ(f.verified_pages + f.recomputed_pages, 4);
  Engine g(WritePolicy::kWriteThrough, 32, 64, {}, &second);
  ASSERT_TRUE(g.cache.prefetch_from_storage("g", g.cache.match_prefix(r3).last_host_node, r3));
  g.settle();  // check_events inserts the finished prefetch
  EXPECT_EQ(g.cache.stats().prefetched_tokens, 4 * kPage);
  g.run(r3);
  EXPECT_EQ(g.verified_pages, 4) << "every page read from the attached store";
  EXPECT_EQ(g.recomputed_pages, 0);
  g.expect_accounting();
}

// L3: pages backed up by one engine are prefetched by another (a restarted engine, or another
// instance sharing the store), inserted as host-resident nodes, loaded back, verified.
TEST(HiRadixCacheStorage, PagesStoredByOneEngineServeAnother) {
  L3 l3("share");
  const auto a = seq({1, 2, 3, 4, 5, 6});
  EXPECT_EQ(store_in_l3(l3, a), 6 * kPage);
  Engine second(WritePolicy::kWriteThrough, 32, 64, {}, &l3);
  auto m = second.cache.match_prefix(a);
  EXPECT_EQ(m.host_hit_tokens, 0);
  ASSERT_TRUE(second.cache.prefetch_from_storage("req", m.last_host_node, a));
  EXPECT_FALSE(second.cache.prefetch_from_storage("req", m.last_host_node, a)) << "id in use";
  second.settle();  // check_events inserts the finished prefetch
  EXPECT_EQ(second.cache.stats().prefetched_tokens, 6 * kPage);
  m = second.cache.match_prefix(a);
  EXPECT_EQ(m.host_hit_tokens, 6 * kPage);
  second.run(a);
  EXPECT_EQ(second.verified_pages, 6) << "every page read from L3 holds its prefix's bytes";
  EXPECT_EQ(second.recomputed_pages, 0);
  second.expect_accounting();
}

TEST(HiRadixCacheStorage, PrefetchContinuesFromAHostPrefixAndStopsAtTheStoredPrefix) {
  L3 l3("partial");
  const auto a = seq({1, 2, 3, 4, 5, 6});
  store_in_l3(l3, std::span(a).first(4 * kPage));  // L3 holds pages 0-3 only
  // wait_complete: prefetches always run to the end, so the counts below are exact.
  Engine second(WritePolicy::kWriteThrough, 32, 64, {}, &l3,
                {.policy = PrefetchPolicy::kWaitComplete});
  second.run(std::span(a).first(2 * kPage));  // pages 0-1 come from L3
  second.settle();
  EXPECT_EQ(second.verified_pages, 2);
  EXPECT_EQ(second.recomputed_pages, 0);
  auto m = second.cache.match_prefix(a);
  EXPECT_EQ(m.device_slots.size(), 2u * kPage);
  ASSERT_TRUE(second.cache.prefetch_from_storage("req", m.last_host_node,
                                                 std::span(a).subspan(2 * kPage)));
  while (!second.cache.check_prefetch_progress("req")) second.cache.check_events();
  m = second.cache.match_prefix(a);
  EXPECT_EQ(m.device_slots.size(), 2u * kPage);
  EXPECT_EQ(m.host_hit_tokens, 2 * kPage) << "pages 2-3 from L3; 4-5 were never stored";
  second.run(a);
  EXPECT_EQ(second.verified_pages, 2 + 4);
  EXPECT_EQ(second.recomputed_pages, 2) << "only pages 4-5, which L3 never had";
  second.expect_accounting();
}

// A prefetch says how many tokens it added to the tree: what it read from L3 less what another
// request computed and inserted while it was in flight (those pages keep the tree's copy, and
// are not L3 hits). The engine's report counts L3 hits from this.
TEST(HiRadixCacheStorage, APrefetchCountsOnlyThePagesItAddedToTheTree) {
  L3 l3("inserted");
  const auto a = seq({1, 2, 3, 4, 5, 6});
  store_in_l3(l3, a);
  Engine second(WritePolicy::kWriteThrough, 32, 64, {}, &l3,
                {.policy = PrefetchPolicy::kWaitComplete});
  auto m = second.cache.match_prefix(a);
  ASSERT_TRUE(second.cache.prefetch_from_storage("req", m.last_host_node, a));
  // Meanwhile another request computes pages 0-2 and inserts them (the prefetch is applied only
  // by check_events / check_prefetch_progress on this thread, so this comes first).
  auto computed = second.device_pool.allocator().alloc(3 * kPage);
  ASSERT_TRUE(computed);
  for (std::size_t p = 0; p < 3; ++p) {
    fill_page(second.device_pool.layout(), (*computed)[p * kPage] / kPage, page_seed(a, p));
  }
  EXPECT_EQ(second.cache.insert(std::span(a).first(3 * kPage), *computed), 0);
  std::int64_t inserted = -1;
  while (!second.cache.check_prefetch_progress("req", &inserted)) {
    EXPECT_EQ(inserted, 0) << "nothing is added while the prefetch still loads";
  }
  EXPECT_EQ(inserted, 3 * kPage) << "6 pages read, 3 of them were in the tree already";
  EXPECT_EQ(second.cache.stats().prefetched_tokens, 6 * kPage);
  // Asked again, it is over and adds nothing more.
  EXPECT_TRUE(second.cache.check_prefetch_progress("req", &inserted));
  EXPECT_EQ(inserted, 0);
  second.run(a);
  EXPECT_EQ(second.verified_pages, 6);
  EXPECT_EQ(second.recomputed_pages, 0);
  second.expect_accounting();

  // A prefetch the engine finds already applied by check_events reports the same way, and a
  // revoked one adds nothing.
  Engine third(WritePolicy::kWriteThrough, 32, 64, {}, &l3,
               {.policy = PrefetchPolicy::kWaitComplete});
  m = third.cache.match_prefix(a);
  ASSERT_TRUE(third.cache.prefetch_from_storage("req", m.last_host_node, a));
  third.settle();  // check_events finishes and inserts it
  EXPECT_EQ(third.cache.prefetches_in_flight(), 0u);
  EXPECT_TRUE(third.cache.check_prefetch_progress("req", &inserted));
  EXPECT_EQ(inserted, 6 * kPage);
  const auto b = seq({7, 8});
  m = third.cache.match_prefix(b);
  ASSERT_TRUE(third.cache.prefetch_from_storage("never-stored", m.last_host_node, b));
  while (!third.cache.check_prefetch_progress("never-stored", &inserted)) third.cache.check_events();
  EXPECT_EQ(inserted, 0) << "L3 holds nothing of b: the prefetch is revoked";
  third.expect_accounting();
}

// A record corrupted behind the store's back (a disk fault) and one that vanished: the
// prefetch stops at the first bad page, the bad record is counted and removed, no wrong byte is
// ever served, and the rest is recomputed.
TEST(HiRadixCacheStorage, CorruptOrMissingRecordsEndThePrefetchWithoutWrongBytes) {
  L3 l3("corrupt");
  const auto a = seq({1, 2, 3, 4, 5, 6});
  ASSERT_EQ(store_in_l3(l3, a), 6 * kPage);
  PageKeyer keyer(key_ns());
  std::vector<std::string> keys;
  keyer.keys(a, nullptr, keys);
  {  // flip one payload byte of page 2's record; remove page 4's
    std::fstream f(l3.root / keys[2], std::ios::in | std::ios::out | std::ios::binary);
    ASSERT_TRUE(f.is_open()) << keys[2];
    f.seekg(-1, std::ios::end);
    char c = 0;
    f.get(c);
    f.seekp(-1, std::ios::end);
    f.put(static_cast<char>(c ^ 0x5A));
  }
  std::filesystem::remove(l3.root / keys[4]);
  Engine second(WritePolicy::kWriteThrough, 32, 64, {}, &l3,
                {.policy = PrefetchPolicy::kWaitComplete});
  second.run(a);  // prefetch pages 0-1, then recompute 2-5
  second.settle();
  EXPECT_EQ(second.verified_pages, 2) << "only the pages before the corrupt one come from L3";
  EXPECT_EQ(second.recomputed_pages, 4);
  EXPECT_EQ(second.cache.stats().prefetched_tokens, 2 * kPage);
  EXPECT_GE(l3.file.stats().bad_records, 1u);
  second.run(a);  // now all on the device, every page verified
  EXPECT_EQ(second.verified_pages, 2 + 6);
  second.expect_accounting();
  // The recomputed pages were backed up again over the bad and missing records: a third engine
  // gets all six from L3, byte for byte.
  Engine third(WritePolicy::kWriteThrough, 32, 64, {}, &l3,
               {.policy = PrefetchPolicy::kWaitComplete});
  third.run(a);
  EXPECT_EQ(third.verified_pages, 6);
  EXPECT_EQ(third.recomputed_pages, 0);
  third.expect_accounting();
}

// Cost-aware prefetch: once an L3 read was measured, a prefetch is declined when reading the
// pages would take longer than recomputing them.
TEST(HiRadixCacheStorage, PrefetchIsDeclinedWhenRecomputingIsCheaper) {
  L3 l3("cost");
  const auto a = seq({1, 2, 3, 4});
  store_in_l3(l3, a);
  for (double cost : {1e-15, 1.0}) {
    Engine e(WritePolicy::kWriteThrough, 32, 64, {.recompute_seconds_per_token = cost}, &l3,
             {.policy = PrefetchPolicy::kWaitComplete});
    e.run(a);  // nothing measured yet: prefetched (which measures the read bandwidth)
    e.settle();
    ASSERT_EQ(e.cache.stats().prefetched_tokens, 4 * kPage);
    e.cache.evict_device(std::int64_t{1} << 40);
    e.cache.evict_host(std::int64_t{1} << 40);
    ASSERT_EQ(e.cache.stats().nodes, 0);
    const auto recomputed = e.recomputed_pages;
    e.run(a);
    e.settle();
    const auto s = e.cache.stats();
    EXPECT_GT(s.measured_prefetch_gbps, 0);
    if (cost < 1e-9) {
      EXPECT_EQ(s.prefetches_refused_by_cost, 1);
      EXPECT_EQ(e.recomputed_pages, recomputed + 4);
    } else {
      EXPECT_EQ(s.prefetches_refused_by_cost, 0);
      EXPECT_EQ(s.prefetched_tokens, 8 * kPage);
      EXPECT_EQ(e.recomputed_pages, recomputed);
    }
    e.expect_accounting();
  }
}

TEST(HiRadixCacheStorage, RevokedAndAbortedPrefetchesHoldNothing) {
  L3 l3("revoke");
  const auto a = seq({1, 2, 3});
  store_in_l3(l3, a);
  Engine picky(WritePolicy::kWriteThrough, 32, 64, {}, &l3,
               {.prefetch_threshold_tokens = 4 * kPage});
  auto m = picky.cache.match_prefix(a);
  ASSERT_TRUE(picky.cache.prefetch_from_storage("small", m.last_host_node, a));
  picky.settle();
  EXPECT_EQ(picky.cache.stats().revoked_prefetches, 1);
  EXPECT_EQ(picky.cache.stats().nodes, 0);
  EXPECT_EQ(picky.host_pool.free_tokens(), picky.host_pool.capacity_tokens());

  Engine aborter(WritePolicy::kWriteThrough, 32, 64, {}, &l3);
  m = aborter.cache.match_prefix(a);
  ASSERT_TRUE(aborter.cache.prefetch_from_storage("gone", m.last_host_node, a));
  aborter.cache.release_aborted_request("gone");
  EXPECT_EQ(aborter.cache.prefetches_in_flight(), 0u);
  EXPECT_EQ(aborter.host_pool.free_tokens(), aborter.host_pool.capacity_tokens());
  EXPECT_EQ(aborter.cache.check_invariants(), "");
  EXPECT_THROW(aborter.cache.unlock(m.last_host_node), StateError) << "the root lock was returned";
}

// The random workload with a small host pool over L3: pages go device -> host -> file store,
// leave the host, and come back through prefetch; every page served is verified.
TEST(HiRadixCacheStorage, RandomWorkloadThroughAllThreeTiers) {
  L3 l3("random");
  Engine e(WritePolicy::kWriteThrough, 24, 28, {}, &l3,
           {.policy = PrefetchPolicy::kWaitComplete});
  std::mt19937 rng(77);
  for (int step = 0; step < 300; ++step) {
    const int family = static_cast<int>(rng() % 6);
    std::vector<std::int32_t> tokens;
    const int pages = 1 + static_cast<int>(rng() % 7);
    for (int i = 0; i < pages * kPage; ++i) tokens.push_back(family * 1000 + i);
    e.run(tokens);
    if (HasFatalFailure()) return;
    ASSERT_EQ(e.cache.check_invariants(), "") << "step " << step;
    if (step % 5 == 0) {
      e.settle();
      e.cache.evict_device(static_cast<std::int64_t>(rng() % 12) * kPage);
      e.cache.evict_host(static_cast<std::int64_t>(rng() % 16) * kPage);
    }
  }
  e.expect_accounting();
  const auto s = e.cache.stats();
  EXPECT_GT(s.prefetched_tokens, 0) << "nothing ever came back from L3";
  EXPECT_GT(s.evicted_host_tokens, 0);
  std::printf("three tiers: %lld pages verified, %lld recomputed, %lld tokens prefetched, %lld "
              "loaded back\n",
              static_cast<long long>(e.verified_pages), static_cast<long long>(e.recomputed_pages),
              static_cast<long long>(s.prefetched_tokens),
              static_cast<long long>(s.loaded_back_tokens));
}

// A reference model of the tree, simple and slow: a map from every cached page's whole token
// prefix to the tiers holding it, with the page's last access and hits. Seeded random requests
// (which match, load back, compute and insert), evictions of everything from the device or the
// host, and evictions of one node, whose victim the model predicts from the policy: the
// candidate page (on the tier, nothing below it there) that goes first under LRU or LFU is the
// last page of the node the tree must take. The real tree's answers and tier sizes must equal
// the model's after every operation, with the invariants (the eviction indexes and running
// totals included) and the slot accounting holding. Also with children keyed by 2 bits of
// their edge's hash: nearly every edge then collides with a sibling's.
class RadixModel : public ::testing::TestWithParam<std::tuple<EvictionPolicy, int>> {};

TEST_P(RadixModel, AgreesWithASimpleModelOnRandomOperations) {
  const auto [policy, edge_bits] = GetParam();
  const bool lfu = policy == EvictionPolicy::kLfu;
  struct Tiers {
    bool device = false, host = false;
    std::uint64_t last = 0;  // the model's clock at the page's last touch
    std::int64_t hits = 0;
  };
  using Prefix = std::vector<std::int32_t>;
  std::map<Prefix, Tiers> model;
  auto prefix = [](std::span<const std::int32_t> tokens, std::size_t pages) {
    return Prefix(tokens.begin(), tokens.begin() + static_cast<std::ptrdiff_t>(pages * kPage));
  };
  auto model_match = [&](std::span<const std::int32_t> tokens) {
    std::pair<std::int64_t, std::int64_t> r{0, 0};  // device prefix, host hit tokens
    bool device_run = true;
    for (std::size_t p = 1; p * kPage <= tokens.size(); ++p) {
      auto it = model.find(prefix(tokens, p));
      if (it == model.end()) break;
      if (device_run && it->second.device) {
        r.first += kPage;
      } else {
        device_run = false;
        r.second += kPage;
      }
    }
    return r;
  };
  auto count = [&](bool Tiers::*tier) {
    std::int64_t n = 0;
    for (const auto& [k, t] : model) n += (t.*tier) ? kPage : 0;
    return n;
  };

  // The page of `model` that eviction from a tier takes first, among those `candidate` accepts.
  auto first_victim = [&](auto candidate) {
    auto best = model.end();
    for (auto it = model.begin(); it != model.end(); ++it) {
      if (!candidate(it)) continue;
      auto key = [&](const auto& i) {
        return std::pair(lfu ? i->second.hits : 0, i->second.last);
      };
      if (best == model.end() || key(it) < key(best)) best = it;
    }
    return best;
  };
  auto has_child = [&](const Prefix& p, bool device_only) {
    return std::any_of(model.begin(), model.end(), [&](const auto& kv) {
      return kv.first.size() == p.size() + kPage &&
             std::equal(p.begin(), p.end(), kv.first.begin()) &&
             (!device_only || kv.second.device);
    });
  };
  std::uint64_t clock = 0;

  Engine e(WritePolicy::kWriteThrough, 2048, 4096,
           {.eviction_policy = policy, .edge_hash_bits = edge_bits});
  std::mt19937 rng(4242);
  for (int step = 0; step < 1500; ++step) {
    const unsigned op = rng() % 14;
    if (op >= 12 || op < 7) {
      std::vector<std::int32_t> tokens;
      const int family = static_cast<int>(rng() % 4);
      const int shared = 1 + static_cast<int>(rng() % 6);
      for (int i = 0; i < shared * kPage; ++i) tokens.push_back(family * 1000 + i);
      const int own = static_cast<int>(rng() % 3);
      for (int i = 0; i < own * kPage; ++i) tokens.push_back(100000 + static_cast<int>(rng() % 4));
      const auto want = model_match(tokens);
      const auto m = e.cache.match_prefix(tokens);
      ASSERT_EQ(static_cast<std::int64_t>(m.device_slots.size()), want.first) << "step " << step;
      ASSERT_EQ(m.host_hit_tokens, want.second) << "step " << step;
      const auto matched = static_cast<std::size_t>((want.first + want.second) / kPage);
      if (op >= 12) {
        // A match alone (a scheduler looking at a waiting request): hits and access times
        // move, with no lock that would re-key the eviction indexes on the way.
        for (std::size_t p = 1; p <= matched; ++p) {
          Tiers& t = model[prefix(tokens, p)];
          t.last = ++clock;
          ++t.hits;
        }
      } else {
        e.run(tokens);
        e.settle();
        // Both matches (above and the request's own) hit what they found; insert touched the
        // whole path last, in order.
        for (std::size_t p = 1; p * kPage <= tokens.size(); ++p) {
          Tiers& t = model[prefix(tokens, p)];
          t.device = t.host = true;  // computed or loaded; write-through
          t.last = ++clock;
          if (p <= matched) t.hits += 2;
        }
      }
    } else if (op == 9 || op == 10) {
      // One node: the tree frees the whole node whose last page the model picks.
      const bool device = op == 9;
      const auto victim = device ? first_victim([&](auto it) {
        return it->second.device && !has_child(it->first, true);
      })
                                 : first_victim([&](auto it) {
        return !it->second.device && it->second.host && !has_child(it->first, false);
      });
      const std::int64_t freed = device ? e.cache.evict_device(1) : e.cache.evict_host(1);
      if (victim == model.end()) {
        ASSERT_EQ(freed, 0) << "step " << step;
        continue;
      }
      ASSERT_GE(freed, kPage) << "step " << step;
      ASSERT_EQ(freed % kPage, 0);
      Prefix p = victim->first;
      for (std::int64_t n = freed / kPage; n > 0; --n) {
        auto it = model.find(p);
        ASSERT_TRUE(it != model.end() && (device ? it->second.device : it->second.host))
            << "step " << step << ": freed " << freed << " tokens, more than the victim's node";
        if (device) {
          it->second.device = false;
        } else {
          model.erase(it);
        }
        p.resize(p.size() - kPage);
      }
    } else if (op < 9) {
      std::int64_t want = count(&Tiers::device);
      for (auto& [k, t] : model) t.device = false;
      ASSERT_EQ(e.cache.evict_device(std::int64_t{1} << 40), want) << "step " << step;
    } else {
      // Host-only pages with nothing cached below them go, repeatedly.
      std::int64_t want = 0;
      for (bool changed = true; changed;) {
        changed = false;
        for (auto it = model.begin(); it != model.end();) {
          if (!it->second.device && !has_child(it->first, false)) {
            want += kPage;
            it = model.erase(it);
            changed = true;
          } else {
            ++it;
          }
        }
      }
      ASSERT_EQ(e.cache.evict_host(std::int64_t{1} << 40), want) << "step " << step;
    }
    const auto s = e.cache.stats();
    ASSERT_EQ(s.device_tokens, count(&Tiers::device)) << "step " << step;
    ASSERT_EQ(s.host_tokens, count(&Tiers::host)) << "step " << step;
    ASSERT_EQ(s.nodes > 0, !model.empty()) << "step " << step;
    ASSERT_EQ(e.cache.check_invariants(), "") << "step " << step;
  }
  e.expect_accounting();
  EXPECT_GT(e.loaded_requests, 10);
  EXPECT_GT(e.verified_pages, 100);
  EXPECT_GT(e.cache.stats().evicted_host_tokens, 0);
}

INSTANTIATE_TEST_SUITE_P(HiRadixCacheModel, RadixModel,
                         ::testing::Combine(::testing::Values(EvictionPolicy::kLru, EvictionPolicy::kLfu),
                                            ::testing::Values(64, 2)),
                         [](const auto& p) {
                           return str_cat(to_string(std::get<0>(p.param)), "_edge_bits_",
                                          std::get<1>(p.param));
                         });

// The three two-rank groups of a TP engine with L3: the main loop's (the radix cache and the
// storage controller's terminate), the prefetch thread's and the backup thread's.
struct TpGroups {
  std::shared_ptr<InProcessGroup> main_group, prefetch_group, backup_group;
  std::vector<std::unique_ptr<Collective>> tp, pre, back;
  TpGroups()
      : tp(InProcessGroup::make_ranks(2, std::chrono::seconds(30), &main_group)),
        pre(InProcessGroup::make_ranks(2, std::chrono::seconds(30), &prefetch_group)),
        back(InProcessGroup::make_ranks(2, std::chrono::seconds(30), &backup_group)) {}
  // Rank r's storage controller uses the groups.
  void wire(L3& l3, int r) {
    l3.prefetch = pre[static_cast<std::size_t>(r)].get();
    l3.backup = back[static_cast<std::size_t>(r)].get();
    l3.main = tp[static_cast<std::size_t>(r)].get();
  }
  void expect_in_step() const {
    EXPECT_EQ(main_group->divergence(), "");
    EXPECT_EQ(prefetch_group->divergence(), "");
    EXPECT_EQ(backup_group->divergence(), "");
  }
};

// 1..max_pages whole pages of family f's prompt (family * 1000 + i): requests over a few shared
// prefixes, drawn from `rng`.
std::vector<std::int32_t> family_prompt(std::mt19937& rng, int families, int max_pages) {
  const int family = static_cast<int>(rng() % static_cast<unsigned>(families));
  const int pages = 1 + static_cast<int>(rng() % static_cast<unsigned>(max_pages));
  std::vector<std::int32_t> tokens;
  for (int i = 0; i < pages * kPage; ++i) tokens.push_back(family * 1000 + i);
  return tokens;
}

// TP=2 in process: each rank has its own pools, controller and tree, and both run the same
// requests; their acks arrive at different times. With the agreement in check_events the two
// trees are identical after every request (tiers, ops in flight, locks), and every served page
// is still verified.
TEST(HiRadixCacheTp, TwoRanksKeepIdenticalTreesUnderEviction) {
  std::shared_ptr<InProcessGroup> group;
  auto tp = InProcessGroup::make_ranks(2, std::chrono::seconds(30), &group);
  std::vector<std::vector<std::string>> trees(2);
  std::vector<std::int64_t> verified(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      Engine e(WritePolicy::kWriteThrough, 24, 40, {}, nullptr, {}, tp[r].get());
      std::mt19937 rng(99);
      for (int step = 0; step < 300; ++step) {
        e.run(family_prompt(rng, 5, 7));
        if (step % 9 == 0) e.cache.evict_host(static_cast<std::int64_t>(rng() % 8) * kPage);
        trees[r].push_back(e.cache.describe());
      }
      e.settle();
      trees[r].push_back(e.cache.describe());
      verified[r] = e.verified_pages;
      EXPECT_EQ(e.cache.stats().tp_failures, 0);
    });
  }
  for (auto& t : ranks) t.join();
  EXPECT_EQ(group->divergence(), "");
  ASSERT_EQ(trees[0].size(), trees[1].size());
  for (std::size_t i = 0; i < trees[0].size(); ++i) {
    ASSERT_EQ(trees[0][i], trees[1][i]) << "the trees differ after request " << i;
  }
  EXPECT_EQ(verified[0], verified[1]);
  EXPECT_GT(verified[0], 50);
}

// An idle step costs no collective: with nothing pending on either rank, check_events skips the
// reduction on both alike; with a write pending it makes one per step, and the ranks stay in
// step either way.
TEST(HiRadixCacheTp, AStepWithNothingPendingMakesNoCollective) {
  std::shared_ptr<InProcessGroup> group;
  auto tp = InProcessGroup::make_ranks(2, std::chrono::seconds(30), &group);
  std::vector<std::uint64_t> idle_calls(2), busy_calls(2);
  std::vector<std::string> trees(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      Engine e(WritePolicy::kWriteThrough, 24, 40, {}, nullptr, {}, tp[r].get());
      std::mt19937 rng(5);
      for (int step = 0; step < 20; ++step) e.run(family_prompt(rng, 3, 4));
      e.settle();
      ASSERT_EQ(e.cache.stats().writes_in_flight, 0);
      const std::uint64_t before = tp[r]->calls();
      for (int i = 0; i < 50; ++i) e.cache.check_events();
      idle_calls[r] = tp[r]->calls() - before;
      // A new prompt: its write pending, the next step agrees on it, once.
      std::vector<std::int32_t> fresh;
      for (int i = 0; i < 2 * kPage; ++i) fresh.push_back(99'000 + i);
      e.run(fresh);
      ASSERT_GT(e.cache.stats().writes_in_flight, 0);
      const std::uint64_t busy = tp[r]->calls();
      e.cache.check_events();
      busy_calls[r] = tp[r]->calls() - busy;
      e.settle();
      trees[r] = e.cache.describe();
    });
  }
  for (auto& t : ranks) t.join();
  EXPECT_EQ(group->divergence(), "");
  EXPECT_EQ(idle_calls[0], 0u);
  EXPECT_EQ(idle_calls[1], 0u);
  EXPECT_EQ(trees[0], trees[1]);
  EXPECT_EQ(busy_calls[0], 1u);
  EXPECT_EQ(busy_calls[1], 1u);
}

// TP=2 where rank 0's writes fail now and then: its controller's thread frees a failed write's
// host pages at once, so for a while rank 0's pool has more free than rank 1's. Host room for
// a write or a prefetch, and host eviction, must not go by the pools' own counts (one rank
// would write a node the other keeps device-only, and every later agreement would name
// different ops): host_room() is the same on both ranks at every step, and so are the trees.
TEST(HiRadixCacheTp, AWriteFailingOnOneRankOnlyDoesNotSplitTheTrees) {
  std::shared_ptr<InProcessGroup> group;
  auto tp = InProcessGroup::make_ranks(2, std::chrono::seconds(30), &group);
  std::vector<std::vector<std::string>> trees(2);
  std::vector<std::vector<std::int64_t>> rooms(2);
  std::vector<std::int64_t> device_only(2), failures(2), pool_ahead(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      Engine e(WritePolicy::kWriteThrough, 24, 30, {}, nullptr, {}, tp[r].get());
      std::mt19937 rng(17);
      for (int step = 0; step < 200; ++step) {
        if (r == 0 && step % 7 == 3) e.device.fail_writes = 1;
        e.run(family_prompt(rng, 5, 7));
        if (step % 11 == 0) e.cache.evict_host_to_free(static_cast<std::int64_t>(rng() % 12) * kPage);
        const std::string tree = e.cache.describe();
        // Device-only nodes: writes refused for want of host room.
        for (std::size_t at = tree.find(" host 0 "); at != std::string::npos;
             at = tree.find(" host 0 ", at + 1)) {
          ++device_only[r];
        }
        trees[r].push_back(tree);
        rooms[r].push_back(e.cache.host_room());
        if (e.host_pool.free_tokens() > e.cache.host_room()) ++pool_ahead[r];
      }
      e.settle();
      trees[r].push_back(e.cache.describe());
      EXPECT_EQ(e.cache.stats().tp_failures, 0);
      EXPECT_EQ(e.cache.host_room(), e.host_pool.free_tokens()) << "rank " << r << " settled";
      failures[r] = e.cache.stats().write_failures;
      e.expect_accounting();
    });
  }
  for (auto& t : ranks) t.join();
  EXPECT_EQ(group->divergence(), "");
  ASSERT_EQ(trees[0].size(), trees[1].size());
  for (std::size_t i = 0; i < trees[0].size(); ++i) {
    ASSERT_EQ(trees[0][i], trees[1][i]) << "the trees differ after request " << i;
  }
  EXPECT_EQ(rooms[0], rooms[1]);
  EXPECT_GT(device_only[0], 0) << "the host was never full: the test shows nothing";
  EXPECT_GT(failures[0], 0) << "no write failed: the test shows nothing";
  EXPECT_EQ(failures[0], failures[1]) << "a failed write counts on every rank";
  EXPECT_GT(pool_ahead[0], 0) << "rank 0's pool never ran ahead of the agreed room";
}

// Reset under TP: both ranks reset at the same step (every 37 requests) with ops in flight;
// their trees are empty and identical, and stay identical as traffic goes on. With L3 every
// collective is a real two-rank group (prefetch and backup threads, main loop): the storage
// threads run what both ranks queued before they stop, so no collective fails, and L3 refills
// the trees afterwards.
// Every 37 requests both ranks reset (kReset), or detach L3 and attach it again (kDetach).
enum class TpEvent { kReset, kDetach };

void run_tp_resets(bool with_l3, TpEvent event = TpEvent::kReset) {
  TpGroups groups;
  std::vector<std::vector<std::string>> trees(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      std::unique_ptr<L3> l3;
      if (with_l3) {
        l3 = std::make_unique<L3>(str_cat("tp-reset-", r));
        groups.wire(*l3, r);
      }
      // wait_complete: what a prefetch brings does not depend on timing.
      Engine e(WritePolicy::kWriteThrough, 24, 40, {}, l3.get(),
               {.policy = PrefetchPolicy::kWaitComplete}, groups.tp[r].get());
      std::mt19937 rng(21);
      for (int step = 0; step < 150; ++step) {
        e.run(family_prompt(rng, 5, 7));
        if (step % 37 == 36 && event == TpEvent::kDetach) {
          // Queued backups and prefetches run first on both ranks, then every op ends.
          e.cache.detach_storage();
          e.storage.reset();
          const auto st = e.cache.stats();
          EXPECT_EQ(st.backups_in_flight, 0);
          EXPECT_EQ(st.stored_tokens, 0);
          EXPECT_EQ(e.cache.prefetches_in_flight(), 0u);
          l3->prefetch->resume();  // nothing was in flight when the stop cancelled them
          l3->backup->resume();
          ASSERT_EQ(l3->prefetch->failure(), "");
          e.storage = std::make_unique<StorageController>(
              e.host_pool, l3->file, e.ns, *l3->prefetch, *l3->backup, *l3->main,
              StorageControllerConfig{.policy = PrefetchPolicy::kWaitComplete});
          e.cache.attach_storage(*e.storage, e.ns);
        } else if (step % 37 == 36) {
          e.cache.reset();
          EXPECT_EQ(e.cache.stats().nodes, 0);
          EXPECT_EQ(e.device_pool.allocator().free_tokens(), e.device_pool.capacity_tokens());
          EXPECT_EQ(e.host_pool.free_tokens(), e.host_pool.capacity_tokens());
        }
        trees[r].push_back(e.cache.describe());
      }
      e.settle();
      trees[r].push_back(e.cache.describe());
      const auto st = e.cache.stats();
      EXPECT_EQ(st.tp_failures, 0);
      EXPECT_EQ(st.resets, event == TpEvent::kReset ? 4 : 0);
      if (event == TpEvent::kDetach) e.expect_accounting();
      if (with_l3 && event == TpEvent::kReset) {
        EXPECT_GT(st.prefetched_tokens, 0) << "L3 never refilled the tree after a reset";
      }
      if (with_l3 && event == TpEvent::kDetach) {
        // What is written after the last attach goes to L3 (the tree's older pages are not
        // backed up again).
        e.run(seq({990, 991}));
        e.settle();
        trees[r].push_back(e.cache.describe());
        EXPECT_EQ(e.cache.stats().stored_tokens, 2 * kPage) << "no backup after the attach";
      }
      if (with_l3) {
        EXPECT_EQ(e.storage->failed_ops(), 0);
      }
    });
  }
  for (auto& t : ranks) t.join();
  groups.expect_in_step();
  ASSERT_EQ(trees[0].size(), trees[1].size());
  for (std::size_t i = 0; i < trees[0].size(); ++i) {
    ASSERT_EQ(trees[0][i], trees[1][i]) << "the trees differ after request " << i;
  }
}

TEST(HiRadixCacheTp, BothRanksResetInStepAndStayIdentical) { run_tp_resets(false); }
TEST(HiRadixCacheTp, ResetWithL3KeepsTheRanksInStep) { run_tp_resets(true); }
TEST(HiRadixCacheTp, DetachAndAttachL3KeepTheRanksInStep) {
  run_tp_resets(true, TpEvent::kDetach);
}

// TP=2 with L3 and storage queues of one op: each rank's storage threads take ops at their own
// pace, so a queue is full on one rank while the other's has room. A backup or a prefetch made
// on one rank only would split the trees (and the storage threads' collectives): the cache
// counts its own ops in flight against the capacity, the same count on every rank.
TEST(HiRadixCacheTp, StorageQueuesFullOnOneRankOnlyDoNotSplitTheTrees) {
  // Every collective is a two-rank group (the storage threads' too: with local ones the ranks'
  // prefetches would agree on nothing and the trees split for that reason).
  TpGroups groups;
  std::vector<std::vector<std::string>> trees(2);
  std::vector<std::int64_t> stored(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      L3 l3(str_cat("tp-room-", r));
      groups.wire(l3, r);
      StorageControllerConfig sc;
      sc.policy = PrefetchPolicy::kWaitComplete;
      sc.queue_capacity = 1;
      Engine e(WritePolicy::kWriteThrough, 24, 40, {}, &l3, sc, groups.tp[r].get());
      std::mt19937 rng(5);
      for (int step = 0; step < 150; ++step) {
        e.run(family_prompt(rng, 5, 7));
        if (step % 9 == 0) e.cache.evict_host(static_cast<std::int64_t>(rng() % 8) * kPage);
        trees[r].push_back(e.cache.describe());
      }
      e.settle();
      trees[r].push_back(e.cache.describe());
      stored[r] = e.cache.stats().stored_tokens;
      EXPECT_EQ(e.cache.stats().tp_failures, 0);
      // Writes, loads, backups, prefetches and their terminations: none made a collective call
      // of its own; check_events made exactly one when an op was in flight.
      EXPECT_EQ(groups.tp[r]->calls(), static_cast<std::uint64_t>(e.busy_checks));
      EXPECT_GT(e.cache.stats().prefetched_tokens, 0) << "no prefetch: the count shows little";
    });
  }
  for (auto& t : ranks) t.join();
  groups.expect_in_step();
  ASSERT_EQ(trees[0].size(), trees[1].size());
  for (std::size_t i = 0; i < trees[0].size(); ++i) {
    ASSERT_EQ(trees[0][i], trees[1][i]) << "the trees differ after request " << i;
  }
  EXPECT_EQ(stored[0], stored[1]);
  EXPECT_GT(stored[0], 0) << "nothing was backed up at all";
}

class RadixPolicies : public ::testing::TestWithParam<WritePolicy> {};

// Seeded random requests over a few shared prefixes, with pools small enough to evict all the
// time: every page served is verified, and the invariants and the slot accounting hold after
// every step.
TEST_P(RadixPolicies, RandomWorkloadServesOnlyCorrectBytes) {
  Engine e(GetParam(), 24, 40, {.write_through_threshold = 1});
  std::mt19937 rng(1234 + static_cast<int>(GetParam()));
  std::vector<std::vector<std::int32_t>> families;
  for (int f = 0; f < 5; ++f) {
    std::vector<std::int32_t> t;
    for (int i = 0; i < 8 * kPage; ++i) t.push_back(f * 1000 + i);
    families.push_back(std::move(t));
  }
  for (int step = 0; step < 400; ++step) {
    const auto& fam = families[rng() % families.size()];
    std::vector<std::int32_t> tokens(fam.begin(),
                                     fam.begin() + static_cast<std::ptrdiff_t>((1 + rng() % 6) * kPage));
    const int extra = static_cast<int>(rng() % 3);
    for (int i = 0; i < extra * kPage; ++i) tokens.push_back(500000 + static_cast<int>(rng() % 50));
    e.run(tokens);
    if (HasFatalFailure()) return;
    ASSERT_EQ(e.cache.check_invariants(), "") << "step " << step;
    if (step % 7 == 0) e.cache.evict_host(static_cast<std::int64_t>(rng() % 8) * kPage);
  }
  e.expect_accounting();
  const auto s = e.cache.stats();
  EXPECT_GT(e.verified_pages, 100);
  EXPECT_GT(s.evicted_device_tokens, 0);
  EXPECT_EQ(e.dropped, 0) << "a request needs at most 8 of the 24 device pages";
  std::printf("policy %s: %lld pages verified, %lld recomputed, %lld load-backs, %lld tokens "
              "loaded back\n",
              std::string(to_string(GetParam())).c_str(), static_cast<long long>(e.verified_pages),
              static_cast<long long>(e.recomputed_pages), static_cast<long long>(e.loaded_requests),
              static_cast<long long>(s.loaded_back_tokens));
}

INSTANTIATE_TEST_SUITE_P(HiRadixCache, RadixPolicies,
                         ::testing::Values(WritePolicy::kWriteThrough,
                                           WritePolicy::kWriteThroughSelective,
                                           WritePolicy::kWriteBack));

}  // namespace
}  // namespace hicache
