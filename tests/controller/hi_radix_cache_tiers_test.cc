// HiRadixCache on L1 and L2: match and insert, the write policies, eviction (LRU/LFU, locks,
// inner nodes, host full), load back and its cost rule, demotion, cache identities.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <optional>
#include <random>
#include <thread>

#include "tests/controller/radix_test_engine.h"

namespace hicache {
namespace {

using namespace radix_test;  // NOLINT(google-build-using-namespace): the tests' own helpers

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

// What a request does after its match without loading back: holds `held`, computes the pages
// of `tokens` past `cached` (the device slots it uses) into fresh slots and inserts the whole;
// the slots insert reports as duplicates are freed. Returns insert's answer.
std::int64_t compute_and_insert(Engine& e, HiRadixCache::Node* held,
                                std::span<const std::int32_t> tokens,
                                std::vector<std::int64_t> cached) {
  e.cache.lock(held);
  const std::size_t from = cached.size() / kPage, pages = tokens.size() / kPage;
  const auto fresh = *e.device_pool.allocator().alloc(static_cast<std::int64_t>((pages - from) * kPage));
  for (std::size_t p = from; p < pages; ++p) {
    fill_page(e.device_pool.layout(), fresh[(p - from) * kPage] / kPage, page_seed(tokens, p, {}));
  }
  cached.insert(cached.end(), fresh.begin(), fresh.end());
  const std::int64_t dup = e.cache.insert(tokens, cached);
  const auto ours = static_cast<std::int64_t>(from * kPage);
  if (dup > ours) e.device_pool.allocator().free(std::span(cached).subspan(ours, dup - ours));
  e.cache.unlock(held);
  return dup;
}

// A node written for eviction is freed on the write's ack only if it is still free to go: a
// child that reached the device meanwhile (a request extended the prefix) keeps it there, so
// the device part of every path stays a prefix (a device page under a host-only parent would be
// matched as a host hit that no load covers: hicache-bench's hybrid runs saw it).
TEST(HiRadixCache, AWriteBackEvictionKeepsTheDeviceCopyOfANodeThatGainedADeviceChild) {
  Engine e(WritePolicy::kWriteBack, 32, 64);
  const auto a = seq({1, 2}), b = seq({1, 2, 3});
  e.run(a);
  e.settle();
  EXPECT_EQ(e.cache.evict_device(100), 0) << "a is written first, freed on the ack";
  ASSERT_EQ(e.cache.stats().writes_in_flight, 1);
  // Before that ack is applied, a request extends a by one computed page.
  auto m = e.cache.match_prefix(b);
  ASSERT_EQ(m.device_slots.size(), 2u * kPage);
  EXPECT_EQ(compute_and_insert(e, m.last_device_node, b, m.device_slots), 2 * kPage);
  e.settle();  // the write's ack
  m = e.cache.match_prefix(b);
  EXPECT_EQ(m.device_slots.size(), 3u * kPage) << "a kept its device copy below a device child";
  EXPECT_EQ(m.host_hit_tokens, 0);
  EXPECT_EQ(e.cache.stats().host_tokens, 2 * kPage) << "a's write landed";
  e.run(b);
  EXPECT_EQ(e.verified_pages, 3) << "every page of b served from the device, byte for byte";
  e.expect_accounting();
}

// A request that recomputes a host-only prefix (its load back refused) inserts its own pages
// below it: the prefix stays on the host and the new child is on the device. A later match
// counts the child in host_hit_tokens (load_back returns it) and says it is resident: what a
// load copies is host_hit_tokens - resident_host_hit_tokens, exactly.
TEST(HiRadixCache, AMatchSaysWhichHostHitsAreOnTheDeviceAlreadyBelowAHostOnlyNode) {
  Engine e(WritePolicy::kWriteThrough, 32, 64);
  const auto a = seq({1, 2}), b = seq({1, 2, 3});
  e.run(a);
  e.settle();
  ASSERT_EQ(e.cache.evict_device(100), 2 * kPage);
  auto m = e.cache.match_prefix(b);
  ASSERT_EQ(m.host_hit_tokens, 2 * kPage);
  EXPECT_EQ(m.resident_host_hit_tokens, 0);
  // Computed again instead of loaded: three fresh pages, two of them duplicates of a's.
  EXPECT_EQ(compute_and_insert(e, m.last_device_node, b, {}), 2 * kPage);
  e.settle();
  m = e.cache.match_prefix(b);
  EXPECT_TRUE(m.device_slots.empty()) << "a is on the host only";
  EXPECT_EQ(m.host_hit_tokens, 3 * kPage);
  EXPECT_EQ(m.resident_host_hit_tokens, kPage) << "[3] is on the device below it";
  const auto loaded_before = e.cache.stats().loaded_back_tokens;
  std::vector<std::int64_t> slots;
  bool loaded = false;
  HiRadixCache::Node* held = hold_match(e.cache, e.controller, e.device_pool, m, slots, &loaded);
  ASSERT_TRUE(loaded);
  ASSERT_EQ(slots.size(), 3u * kPage);
  EXPECT_EQ(e.cache.stats().loaded_back_tokens - loaded_before,
            m.host_hit_tokens - m.resident_host_hit_tokens);
  for (std::size_t p = 0; p < 3; ++p) {
    EXPECT_TRUE(verify_page(e.device_pool.layout(), slots[p * kPage] / kPage, page_seed(b, p, {})))
        << "page " << p;
  }
  e.cache.unlock(held);
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

// Operation priorities: a write that frees device memory on its ack goes before backups in the
// controller's write queue. An evicted inner node's copy, queued behind 16 write-through
// backups, goes with the next batch the write thread takes (16 ops at most), so its device
// pages are free one batch later instead of two.
TEST(HiRadixCache, AnEvictionsWriteGoesBeforeQueuedBackups) {
  Engine e(WritePolicy::kWriteThrough, 64, 64);
  e.device.fail_writes = 1;
  e.run(seq({3, 4}));
  e.settle();  // x = [3, 4]: its write failed, device only
  ASSERT_EQ(e.cache.stats().host_tokens, 0);
  e.run(seq({3, 4, 5, 6}));
  e.settle();  // y = [5, 6] under x, written through
  ASSERT_EQ(e.cache.evict_device(2 * kPage), 2 * kPage);  // y, the only device leaf
  // x: device only with a host-only child: evicting it means writing it first.
  e.device.hold_writes();
  e.run(seq({20}));  // a backup the write thread takes and holds at the gate
  e.device.wait_for_held_writes(1);
  for (std::int32_t i = 21; i <= 36; ++i) e.run(seq({i}));  // 16 backups queued behind it
  ASSERT_EQ(e.cache.evict_device(2 * kPage), 0);  // x's write, queued last, frees on the ack
  ASSERT_EQ(e.cache.stats().writes_in_flight, 18);
  e.device.allow_writes(1);  // the held backup; the thread takes the next 16 ops and waits
  e.device.wait_for_held_writes(2);
  e.device.allow_writes(1);  // those 16; the thread takes what is left and waits
  e.device.wait_for_held_writes(3);
  e.cache.check_events();
  // x went with the first 16: its device copy is freed, and the last backup queued still waits.
  EXPECT_EQ(e.cache.stats().writes_in_flight, 1);
  EXPECT_EQ(e.cache.stats().device_tokens, 17 * kPage);  // the 17 backed-up pages, x's gone
  EXPECT_EQ(e.cache.stats().host_tokens, 21 * kPage);  // x, y, 17 backups (one still writing)
  e.device.release_writes();
  e.settle();
  e.expect_accounting();
}

}  // namespace
}  // namespace hicache
