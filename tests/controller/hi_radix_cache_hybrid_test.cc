// HiRadixCache with sidecar pools: a hybrid reference model (a recurrent state checkpointed at
// some pages, a sliding window of per-token KV, an indexer's per-token keys, beside the
// attention KV) served from the device and the host. The state after a prefix is a function of
// the whole prefix; every request restores it at the restorable prefix and must find exactly
// the bytes computed from scratch.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "controller/hi_radix_cache.h"
#include "pools/kv_pattern.h"
#include "pools/sidecar_pool.h"
#include "tests/controller/radix_test_engine.h"
#include "transfer/errors.h"
#include "transfer/host_device.h"

namespace hicache::radix_test {
namespace {

using Slots = std::vector<std::int64_t>;
using Tokens = std::vector<std::int32_t>;

enum Pool : std::int32_t { kState = 0, kSwa = 1, kIndex = 2 };

// The data of pool `pool`'s page `page` of a sequence: a function of the prefix up to the end of
// that page, as a model's state after it is.
std::uint64_t side_seed(std::span<const std::int32_t> tokens, std::size_t page, Pool pool) {
  return page_seed(tokens, page) * 1000003ULL + static_cast<std::uint64_t>(pool) + 1;
}

SidecarSpec spec(Pool pool, std::int64_t device_pages, std::int64_t host_pages,
                 std::int64_t state_slot_bytes = 256) {
  switch (pool) {
    case kState:  // a recurrent state checkpoint: one slot a page, 2 layers
      return {.name = "state", .policy = SidecarHitPolicy::kTrailing, .window_pages = 1,
              .layers = 2, .slots_per_page = 1, .slot_bytes = state_slot_bytes,
              .dtype = DType::kFloat32,
              .device_pages = device_pages, .host_pages = host_pages};
    case kSwa:  // a sliding window of 2 pages of per-token KV
      return {.name = "swa", .policy = SidecarHitPolicy::kTrailing, .window_pages = 2,
              .layers = 1, .slots_per_page = kPage, .slot_bytes = 32, .dtype = DType::kBFloat16,
              .device_pages = device_pages, .host_pages = host_pages};
    case kIndex:  // an indexer's keys for every page
    default:
      return {.name = "index", .policy = SidecarHitPolicy::kAllPages, .layers = 1,
              .slots_per_page = kPage, .slot_bytes = 16, .dtype = DType::kBFloat16,
              .device_pages = device_pages, .host_pages = host_pages};
  }
}

// What a test may change of the hybrid engine beyond its pool sizes.
struct HybridOptions {
  RadixCacheConfig config;
  std::int64_t state_slot_bytes = 256;
  // The state pool's own sizes; 0: the other sidecar pools'.
  std::int64_t state_device_pages = 0, state_host_pages = 0;
  L3* l3 = nullptr;  // an L3 store: every request asks it for what the tree lacks
  int tp_rank = 0, tp_size = 1;  // the L3 namespace's shard
};

// An engine of the hybrid model: pools, a controller with three sidecar pools, the cache.
struct Hybrid {
  HostDevice device;
  DeviceKVPool device_pool;
  HostKVPool host_pool;
  std::vector<std::unique_ptr<SidecarPool>> owned;
  std::vector<SidecarPool*> pools;
  HiCacheController controller;
  KeyNamespace ns;
  std::unique_ptr<StorageController> storage;
  HiRadixCache cache;
  std::int64_t requests = 0, restored_states = 0, host_loads = 0, dropped = 0;
  std::int64_t prefetched = 0;  // requests whose prefix grew by a prefetch
  std::int64_t restored_tokens = 0;  // prefixes restored (KV and state), summed
  std::int64_t checkpoint_every = 2;  // the engine checkpoints its state every 2 pages and at the end

  static std::vector<std::unique_ptr<SidecarPool>> make_pools(HostDevice& d, std::int64_t dev,
                                                              std::int64_t host,
                                                              const HybridOptions& o) {
    std::vector<std::unique_ptr<SidecarPool>> p;
    for (Pool pool : {kState, kSwa, kIndex}) {
      const bool state = pool == kState;
      p.push_back(std::make_unique<SidecarPool>(
          d, spec(pool, state && o.state_device_pages > 0 ? o.state_device_pages : dev,
                  state && o.state_host_pages > 0 ? o.state_host_pages : host,
                  o.state_slot_bytes)));
    }
    return p;
  }
  static std::vector<SidecarPool*> raw(const std::vector<std::unique_ptr<SidecarPool>>& p) {
    std::vector<SidecarPool*> out;
    for (const auto& x : p) out.push_back(x.get());
    return out;
  }

  Hybrid(WritePolicy policy, std::int64_t device_pages, std::int64_t host_pages,
         std::int64_t side_device_pages, std::int64_t side_host_pages, Collective* tp = nullptr,
         const HybridOptions& options = {})
      : device_pool(device, geometry(), device_pages * kPage),
        host_pool(device, geometry(), HostLayout::kPageFirst, host_pages * kPage),
        owned(make_pools(device, side_device_pages, side_host_pages, options)),
        pools(raw(owned)),
        controller(device, device_pool, host_pool, ControllerConfig{.write_policy = policy},
                   pools),
        ns(namespace_of(options)),
        storage(options.l3 == nullptr
                    ? nullptr
                    : std::make_unique<StorageController>(
                          host_pool, options.l3->file, ns, *options.l3->prefetch,
                          *options.l3->backup, *options.l3->main,
                          StorageControllerConfig{.policy = PrefetchPolicy::kWaitComplete},
                          pools)),
        cache(controller, device_pool, host_pool, options.config, storage.get(),
              storage ? &ns : nullptr, tp) {}

  static KeyNamespace namespace_of(const HybridOptions& o) {
    KeyNamespace k = key_ns();
    k.tp_rank = o.tp_rank;
    k.tp_size = o.tp_size;
    return k;
  }

  SidecarPool& pool(Pool p) { return *pools[static_cast<std::size_t>(p)]; }

  void settle() {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (std::chrono::steady_clock::now() < deadline) {
      cache.check_events();
      const auto s = cache.stats();
      if (s.writes_in_flight == 0 && s.loads_in_flight == 0 && s.backups_in_flight == 0 &&
          cache.prefetches_in_flight() == 0) {
        return;
      }
      std::this_thread::yield();
    }
    FAIL() << "writes or loads never finished";
  }

  // Device slots of `pages` pages of pool `p`, evicting tree nodes while it is short.
  std::optional<Slots> alloc(Pool p, std::int64_t pages) {
    TokenSlotAllocator& a = pool(p).device_pool().allocator();
    const std::int64_t n = pages * pool(p).spec().slots_per_page;
    auto s = a.alloc(n);
    for (int i = 0; i < 64 && !s; ++i) {
      if (cache.evict_device(kPage) == 0) settle();
      s = a.alloc(n);
    }
    return s;
  }
  std::optional<Slots> alloc_kv(std::int64_t tokens) {
    auto s = device_pool.allocator().alloc(tokens);
    for (int i = 0; i < 64 && !s; ++i) {
      if (cache.evict_device(tokens) == 0) settle();
      s = device_pool.allocator().alloc(tokens);
    }
    return s;
  }

  // Checks the state the match restores: for a prefix of p pages the state checkpoint at page
  // p-1, the window's pages p-2 and p-1, and every indexer page, each against the bytes of the
  // prefix computed from scratch.
  void verify_restored(std::span<const std::int32_t> tokens, const HiRadixCache::Node* node,
                       std::int64_t p) {
    if (p == 0) return;
    struct Need {
      Pool pool;
      std::int64_t from;
    };
    for (const Need need : {Need{kState, p - 1}, Need{kSwa, std::max<std::int64_t>(0, p - 2)},
                            Need{kIndex, 0}}) {
      const auto held = cache.sidecar_device_slots(node, need.pool);
      for (std::int64_t page = need.from; page < p; ++page) {
        const auto it = std::find_if(held.begin(), held.end(),
                                     [&](const auto& h) { return h.page == page; });
        ASSERT_NE(it, held.end()) << "pool " << need.pool << " page " << page
                                  << " missing at a restorable prefix of " << p;
        std::string where;
        ASSERT_TRUE(verify_page(pool(need.pool).device_pool().layout(),
                                it->device_slots[0] / pool(need.pool).spec().slots_per_page,
                                side_seed(tokens, static_cast<std::size_t>(page), need.pool),
                                &where))
            << "pool " << need.pool << " page " << page << " restored wrong: " << where;
      }
    }
    ++restored_states;
  }

  // One request: match, load back, check what is restored, compute the rest, insert.
  void run(std::span<const std::int32_t> tokens) {
    ++requests;
    cache.check_events();
    ASSERT_EQ(cache.check_invariants(), "");
    auto m = cache.match_prefix(tokens);
    const std::size_t known = m.device_slots.size() + static_cast<std::size_t>(m.host_hit_tokens);
    if (storage && tokens.size() > known) {
      // Past the restorable prefix: ask L3 (KV and state together), wait, match again.
      const std::string id = str_cat("req-", requests);
      if (cache.prefetch_from_storage(id, m.last_host_node, tokens.subspan(known))) {
        std::int64_t inserted = 0;
        while (!cache.check_prefetch_progress(id, &inserted)) cache.check_events();
        m = cache.match_prefix(tokens);
        prefetched += inserted > 0 ? 1 : 0;
      }
    }
    Slots slots;
    bool loaded = false;
    HiRadixCache::Node* held = hold_match(cache, controller, device_pool, m, slots, &loaded);
    host_loads += loaded ? 1 : 0;
    const auto p = static_cast<std::int64_t>(slots.size()) / kPage;
    for (std::int64_t page = 0; page < p; ++page) {
      ASSERT_TRUE(verify_page(device_pool.layout(), slots[static_cast<std::size_t>(page * kPage)] / kPage,
                              page_seed(tokens, static_cast<std::size_t>(page))))
          << "KV page " << page << " served wrong";
    }
    verify_restored(tokens, held, p);
    if (::testing::Test::HasFatalFailure()) return;
    restored_tokens += p * kPage;

    // Compute pages p..n-1: KV, the window and the indexer for each, the state at checkpoints.
    const auto n = static_cast<std::int64_t>(tokens.size()) / kPage;
    if (n == p) {  // all of it restored: nothing to compute
      cache.unlock(held);
      return;
    }
    std::vector<std::int64_t> state_pages, all_pages;
    for (std::int64_t page = p; page < n; ++page) {
      all_pages.push_back(page);
      if ((page + 1) % checkpoint_every == 0 || page == n - 1) state_pages.push_back(page);
    }
    auto kv = alloc_kv((n - p) * kPage);
    auto st = alloc(kState, static_cast<std::int64_t>(state_pages.size()));
    auto swa = alloc(kSwa, n - p);
    auto idx = alloc(kIndex, n - p);
    if (!kv || !st || !swa || !idx) {  // everything left is this request's: drop it
      if (kv) device_pool.allocator().free(*kv);
      if (st) pool(kState).device_pool().allocator().free(*st);
      if (swa) pool(kSwa).device_pool().allocator().free(*swa);
      if (idx) pool(kIndex).device_pool().allocator().free(*idx);
      ++dropped;
      cache.unlock(held);
      return;
    }
    for (std::int64_t page = p; page < n; ++page) {
      const auto k = static_cast<std::size_t>(page - p);
      fill_page(device_pool.layout(), (*kv)[k * kPage] / kPage,
                page_seed(tokens, static_cast<std::size_t>(page)));
      fill_page(pool(kSwa).device_pool().layout(), (*swa)[k * kPage] / kPage,
                side_seed(tokens, static_cast<std::size_t>(page), kSwa));
      fill_page(pool(kIndex).device_pool().layout(), (*idx)[k * kPage] / kPage,
                side_seed(tokens, static_cast<std::size_t>(page), kIndex));
    }
    for (std::size_t k = 0; k < state_pages.size(); ++k) {
      fill_page(pool(kState).device_pool().layout(), (*st)[k],
                side_seed(tokens, static_cast<std::size_t>(state_pages[k]), kState));
    }
    slots.insert(slots.end(), kv->begin(), kv->end());
    const HiRadixCache::SidecarInsert side[] = {
        {kState, state_pages, *st}, {kSwa, all_pages, *swa}, {kIndex, all_pages, *idx}};
    const std::int64_t dup = cache.insert(tokens, slots, {}, side);
    // Ours and already in the tree (past the restorable prefix): free them.
    const std::int64_t dup_pages = dup / kPage;
    if (dup_pages > p) {
      device_pool.allocator().free(std::span(*kv).first(static_cast<std::size_t>((dup_pages - p) * kPage)));
      pool(kSwa).device_pool().allocator().free(std::span(*swa).first(static_cast<std::size_t>((dup_pages - p) * kPage)));
      pool(kIndex).device_pool().allocator().free(std::span(*idx).first(static_cast<std::size_t>((dup_pages - p) * kPage)));
      Slots st_dup;
      for (std::size_t k = 0; k < state_pages.size(); ++k) {
        if (state_pages[k] < dup_pages) st_dup.push_back((*st)[k]);
      }
      if (!st_dup.empty()) pool(kState).device_pool().allocator().free(st_dup);
    }
    cache.unlock(held);
  }

  // Every slot of every pool is the tree's, and the tree is consistent.
  void expect_accounting() {
    settle();
    expect_tree_accounting(cache, device_pool, host_pool);
    for (Pool p : {kState, kSwa, kIndex}) {
      const auto [on_device, on_host] = cache.sidecar_slots_held(p);
      const TokenSlotAllocator& a = pool(p).device_pool().allocator();
      EXPECT_EQ(a.capacity_tokens() - a.free_tokens(), on_device) << "pool " << p;
      EXPECT_EQ(pool(p).host_pool().capacity_tokens() - pool(p).host_pool().free_tokens(), on_host)
          << "pool " << p;
    }
  }
  bool sidecars_free() {
    for (SidecarPool* p : pools) {
      if (p->device_pool().allocator().free_tokens() != p->device_pool().capacity_tokens() ||
          p->host_pool().free_tokens() != p->host_pool().capacity_tokens()) {
        return false;
      }
    }
    return true;
  }
};

Tokens prompt(std::int32_t id, std::int64_t pages) {
  Tokens t;
  for (std::int64_t i = 0; i < pages * kPage; ++i) t.push_back(id * 1000 + static_cast<std::int32_t>(i));
  return t;
}

// `n` requests over `bases` 6-page prompts (ids from `first_id`): each a random 1-6 page prefix of
// one of them and 0-2 pages of its own.
std::vector<Tokens> shared_prefix_requests(std::uint32_t seed, std::int32_t bases,
                                           std::int32_t first_id, int n) {
  std::mt19937 rng(seed);
  std::vector<Tokens> base;
  for (std::int32_t b = 0; b < bases; ++b) base.push_back(prompt(first_id + b, 6));
  std::vector<Tokens> out;
  for (int r = 0; r < n; ++r) {
    Tokens t = base[rng() % base.size()];
    t.resize(static_cast<std::size_t>((1 + rng() % 6) * kPage));
    for (std::uint32_t extra = rng() % 3; extra > 0; --extra) {
      for (int i = 0; i < kPage; ++i) t.push_back(static_cast<std::int32_t>(rng() % 50000));
    }
    out.push_back(std::move(t));
  }
  return out;
}

// A prefix restores only as far as its last checkpoint: 6 of 8 cached pages with checkpoints
// at pages 1, 3 and 7 restore 4 pages, the node split there; no checkpoint restores nothing.
TEST(HybridRadix, AMatchStopsAtTheLastRestorableCheckpoint) {
  Hybrid e(WritePolicy::kWriteBack, 32, 64, 32, 64);
  const Tokens a = prompt(1, 8);
  e.run(a);  // checkpoints at pages 1, 3, 5 and 7
  const Tokens six(a.begin(), a.begin() + 6 * kPage);
  auto m = e.cache.match_prefix(six);
  EXPECT_EQ(m.device_slots.size(), 6u * kPage);  // 1, 3, 5: page 5 ends the six
  e.checkpoint_every = 4;
  const Tokens b = prompt(2, 8);
  e.run(b);  // checkpoints at pages 3 and 7
  const Tokens b6(b.begin(), b.begin() + 6 * kPage);
  m = e.cache.match_prefix(b6);
  ASSERT_EQ(m.device_slots.size(), 4u * kPage);
  EXPECT_EQ(m.host_hit_tokens, 0);
  e.verify_restored(b6, m.last_device_node, 4);
  // The cut split b's node at page 4: a node ends there now.
  EXPECT_NE(e.cache.describe().find("[2000..+16]"), std::string::npos) << e.cache.describe();
  const Tokens b2(b.begin(), b.begin() + 2 * kPage);
  m = e.cache.match_prefix(b2);  // no checkpoint in the first two pages: nothing restorable
  EXPECT_TRUE(m.device_slots.empty());
  EXPECT_EQ(m.last_host_node, m.last_device_node);
  EXPECT_EQ(e.cache.check_invariants(), "");
}

// A match whose device part restores less than the device holds: A's path is [0, 4) with a
// checkpoint at page 3, [4, 6) without one (B diverged at page 6), both on the device, and
// [6, 8) with a checkpoint at page 7 on the host only. The device part restores 4 pages; the
// host hit restores 8, of which pages 4 and 5 are on the device already (resident): load_back
// copies the 2 others.
TEST(HybridRadix, AHostHitNamesThePagesOnTheDeviceAlready) {
  Hybrid e(WritePolicy::kWriteThrough, 32, 64, 32, 64);
  e.checkpoint_every = 4;
  const Tokens a = prompt(7, 8);
  e.run(a);  // checkpoints at pages 3 and 7
  Tokens b(a.begin(), a.begin() + 6 * kPage);
  const Tokens tail = prompt(8, 2);
  b.insert(b.end(), tail.begin(), tail.end());
  e.run(b);  // restores 4, computes 4..7: the tree splits A's part at 6
  e.settle();
  e.cache.match_prefix(b);  // b's leaf younger than a's
  ASSERT_EQ(e.cache.evict_device(2 * kPage), 2 * kPage);  // a's [6, 8): host only
  const auto m = e.cache.match_prefix(a);
  EXPECT_EQ(m.device_slots.size(), 4u * kPage);
  EXPECT_EQ(m.host_hit_tokens, 4 * kPage);
  EXPECT_EQ(m.resident_host_hit_tokens, 2 * kPage) << e.cache.describe();
  const std::int64_t loaded = e.cache.stats().loaded_back_tokens;
  e.run(a);  // loads back and checks every restored byte
  EXPECT_EQ(e.cache.stats().loaded_back_tokens - loaded, 2 * kPage);
  EXPECT_EQ(e.cache.check_invariants(), "");
}

// A node's state, window and index pages go to the host with its KV, come back with it, and
// arrive byte for byte; then both tiers free every pool's pages.
TEST(HybridRadix, SidecarPagesMoveWithTheirNodeThroughTheHostAndBack) {
  Hybrid e(WritePolicy::kWriteThrough, 32, 64, 32, 64);
  const Tokens a = prompt(3, 6);
  e.run(a);
  e.settle();
  EXPECT_EQ(e.pool(kState).host_pool().free_tokens(), 64 - 3);  // pages 1, 3, 5
  EXPECT_EQ(e.cache.evict_device(6 * kPage), 6 * kPage);
  EXPECT_EQ(e.pool(kState).device_pool().allocator().free_tokens(), 32);
  EXPECT_EQ(e.pool(kIndex).device_pool().allocator().free_tokens(), 32 * kPage);
  EXPECT_EQ(e.cache.check_invariants(), "");
  auto m = e.cache.match_prefix(a);
  EXPECT_TRUE(m.device_slots.empty());
  EXPECT_EQ(m.host_hit_tokens, 6 * kPage);
  const std::int64_t loads = e.host_loads;
  e.run(a);  // loads back and checks every restored byte
  EXPECT_EQ(e.host_loads, loads + 1);
  EXPECT_EQ(e.restored_states, 1);
  e.settle();
  EXPECT_EQ(e.cache.check_invariants(), "");
  e.cache.evict_device(6 * kPage);
  e.cache.evict_host(6 * kPage);
  EXPECT_EQ(e.cache.stats().nodes, 0);
  EXPECT_TRUE(e.sidecars_free());
}

// SGLang #39436's shape: 8 conversations, their device copies evicted, replayed: every one is a
// host hit that restores its whole prompt, state included (SGLang's host state pool was too
// small and got 0 of 8).
TEST(HybridRadix, EightConversationsReplayedFromTheHostAllHit) {
  Hybrid e(WritePolicy::kWriteThrough, 48, 96, 48, 96);
  std::vector<Tokens> conversations;
  for (std::int32_t c = 0; c < 8; ++c) conversations.push_back(prompt(100 + c, 5));
  for (const Tokens& t : conversations) e.run(t);
  e.settle();
  EXPECT_EQ(e.cache.evict_device(8 * 5 * kPage), 8 * 5 * kPage);
  const std::int64_t restored = e.restored_states, loads = e.host_loads;
  for (const Tokens& t : conversations) {
    const auto m = e.cache.match_prefix(t);
    EXPECT_EQ(m.host_hit_tokens, 5 * kPage) << "a conversation missed the host";
    e.run(t);
  }
  EXPECT_EQ(e.host_loads - loads, 8);
  EXPECT_EQ(e.restored_states - restored, 8);
  e.expect_accounting();
}

TEST(HybridRadix, BadSidecarInsertsAreNamedAndChangeNothing) {
  Hybrid e(WritePolicy::kWriteBack, 32, 64, 32, 64);
  const Tokens a = prompt(4, 2);
  const Slots kv = *e.device_pool.allocator().alloc(2 * kPage);
  const Slots st = *e.pool(kState).device_pool().allocator().alloc(1);
  const Slots idx = *e.pool(kIndex).device_pool().allocator().alloc(2 * kPage);
  const Slots one{1}, both{0, 1}, backwards{1, 0}, beyond{2};
  const Slots idx_one(idx.begin(), idx.begin() + kPage);
  const Slots repeated(2 * kPage, 3);  // one slot, many times: not whole pages of the pool
  struct Case {
    std::vector<HiRadixCache::SidecarInsert> side;
    const char* want;
  };
  const Case cases[] = {
      {{{7, one, st}}, "sidecar pool 7 does not exist (3 sidecar pools)"},
      {{{kState, one, st}, {kState, one, st}}, "sidecar pool 'state' is given twice"},
      {{{kState, backwards, st}}, "page 0 (entry 1) is out of order"},
      {{{kState, beyond, st}}, "page 2 (entry 0) is out of order or outside the sequence's 2"},
      {{{kIndex, one, idx_one}}, "'index' is all_pages: it needs pages 0..1"},
      {{{kState, both, st}}, "1 device slots for 2 pages of 1 slots"},
      {{{kIndex, both, repeated}}, "sidecar pool 'index'"},
      {{{kState, one, st}}, "'index' is all_pages: it needs pages 0..1 (the tree holds the first 0), got none"},
  };
  for (const Case& c : cases) {
    try {
      e.cache.insert(a, kv, {}, c.side);
      ADD_FAILURE() << "accepted: " << c.want;
    } catch (const InvalidArgument& err) {
      EXPECT_NE(std::string(err.what()).find(c.want), std::string::npos) << err.what();
    }
    EXPECT_EQ(e.cache.stats().nodes, 0) << c.want;
  }
  const HiRadixCache::SidecarInsert good[] = {{kState, one, st}, {kIndex, both, idx}};
  EXPECT_EQ(e.cache.insert(a, kv, {}, good), 0);
  EXPECT_NE(e.cache.describe().find("sidecars 0@[1] 2@[0,1]"), std::string::npos)
      << e.cache.describe();
  EXPECT_THROW(e.cache.sidecar_device_slots(e.cache.match_prefix(a).last_device_node, 3),
               InvalidArgument);
}

// The storage controller must move the same sidecar pools as the controller: one built without
// them is refused at construction and by attach_storage, naming both counts.
TEST(HybridRadix, AStorageControllerWithoutTheSidecarPoolsIsRefused) {
  HostDevice device;
  DeviceKVPool dev(device, geometry(), 8 * kPage);
  HostKVPool host(device, geometry(), HostLayout::kPageFirst, 16 * kPage);
  SidecarPool state(device, spec(kState, 4, 8));
  SidecarPool* pools[] = {&state};
  HiCacheController c(device, dev, host, ControllerConfig{}, pools);
  L3 l3("hybrid-refused");
  KeyNamespace ns = key_ns();
  StorageController storage(host, l3.file, ns, l3.local, l3.local, l3.local, {});
  try {
    HiRadixCache cache(c, dev, host, {}, &storage, &ns);
    FAIL() << "accepted a storage controller without the sidecar pools";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("the storage controller has 0 sidecar pools, the "
                                         "controller 1"),
              std::string::npos)
        << e.what();
  }
  HiRadixCache cache(c, dev, host);
  EXPECT_THROW(cache.attach_storage(storage, ns), InvalidArgument);
  StorageController with(host, l3.file, ns, l3.local, l3.local, l3.local, {},
                         std::vector<SidecarPool*>{&state});
  cache.attach_storage(with, ns);  // the same pools: accepted
  EXPECT_THROW(cache.attach_storage(with, ns), StateError);  // attached already
  cache.detach_storage();
}

// Many requests sharing prefixes, pools small enough to evict on both tiers, under each write
// policy: every request finds the KV and the state it restores exactly as computed from
// scratch, the tree stays consistent, and a reset leaves every pool empty.
TEST(HybridRadix, EveryRequestRestoresTheStateComputedFromScratch) {
  for (const WritePolicy policy : {WritePolicy::kWriteThrough, WritePolicy::kWriteBack,
                                   WritePolicy::kWriteThroughSelective}) {
    Hybrid e(policy, 24, 48, 12, 24);
    const std::vector<Tokens> requests = shared_prefix_requests(7, 6, 10, 300);
    for (std::size_t r = 0; r < requests.size(); ++r) {
      e.run(requests[r]);
      ASSERT_FALSE(::testing::Test::HasFatalFailure()) << "request " << r;
      if (r % 50 == 49) e.expect_accounting();
    }
    EXPECT_GT(e.restored_states, 50) << to_string(policy);
    if (policy != WritePolicy::kWriteBack) {
      EXPECT_GT(e.host_loads, 5) << to_string(policy);
    }
    EXPECT_LT(e.dropped, 10) << to_string(policy);
    e.expect_accounting();
    // Evicting everything frees every page of every pool (a leak or a double free shows here).
    while (e.cache.evict_device(1 << 20) > 0 || e.cache.stats().writes_in_flight > 0) e.settle();
    e.cache.evict_host(1 << 20);
    EXPECT_EQ(e.cache.stats().nodes, 0) << to_string(policy);
    EXPECT_TRUE(e.sidecars_free()) << to_string(policy);
    e.cache.reset();
    EXPECT_TRUE(e.sidecars_free()) << to_string(policy);
  }
}

// L3 beside the tiers: an engine writes through to a file store; a fresh engine on the same
// store (nothing on its device or host) serves the same requests from L3, state and KV
// prefetched together, and every request restores exactly the state computed from scratch.
// Then the store loses some state records: prefixes end earlier, never with wrong bytes.
TEST(HybridRadix, AFreshEngineRestoresKvAndStateFromL3ByteForByte) {
  L3 l3("hybrid-l3");
  const auto requests = shared_prefix_requests(31, 4, 300, 120);
  {
    Hybrid first(WritePolicy::kWriteThrough, 96, 192, 96, 192, nullptr,
                 HybridOptions{.l3 = &l3});
    for (const Tokens& t : requests) {
      first.run(t);
      if (::testing::Test::HasFatalFailure()) return;
    }
    first.expect_accounting();
    EXPECT_GT(first.cache.stats().stored_tokens, 0);
    EXPECT_GT(first.storage->sidecar_written_bytes(), 0);
  }
  Hybrid second(WritePolicy::kWriteThrough, 96, 192, 96, 192, nullptr, HybridOptions{.l3 = &l3});
  second.run(requests[0]);  // an empty tree: all it restores comes from L3
  EXPECT_EQ(second.prefetched, 1);
  EXPECT_EQ(second.restored_states, 1);
  for (std::size_t i = 1; i < requests.size(); ++i) {
    second.run(requests[i]);
    if (::testing::Test::HasFatalFailure()) return;
  }
  second.expect_accounting();
  EXPECT_GT(second.prefetched, static_cast<std::int64_t>(requests.size()) / 2);
  EXPECT_GT(second.storage->sidecar_read_bytes(), 0);
  std::printf("hybrid L3: %lld of %lld requests grew by a prefetch, %lld restored a state\n",
              static_cast<long long>(second.prefetched), static_cast<long long>(second.requests),
              static_cast<long long>(second.restored_states));

  // Every state record gone: a fresh engine restores no prefix from L3 that needs one.
  std::vector<std::string> state_keys;  // a record's file is named by its key
  for (const auto& entry : std::filesystem::recursive_directory_iterator(l3.root)) {
    const std::string name = entry.path().filename().string();
    if (name.find("sidecar=state") != std::string::npos) state_keys.push_back(name);
  }
  ASSERT_FALSE(state_keys.empty());
  for (const auto& k : state_keys) EXPECT_TRUE(l3.file.remove(k)) << k;
  Hybrid third(WritePolicy::kWriteThrough, 96, 192, 96, 192, nullptr, HybridOptions{.l3 = &l3});
  for (const Tokens& t : requests) {
    third.run(t);
    if (::testing::Test::HasFatalFailure()) return;
  }
  EXPECT_EQ(third.prefetched, 0) << "a prefix restored without its state";
  third.expect_accounting();
}

// Footprint-weighted eviction (radix::eviction_mark), measured against the order of the last
// access alone: 8 documents of 16 pages, each checkpointed once at its end and asked again
// every round, and between them one-page chats never asked again, each with its own
// checkpoint. A checkpoint is 64 KV pages' bytes; the state pool (12 checkpoints on the
// device, 24 on the host) is what runs short. With 2 chats per document a round's checkpoints
// fit the host and both orders restore about the same; with 4 they do not, and the last access
// alone gives the one-off chats' checkpoints the room of the documents that come back, while
// weighing each node's state bytes against its KV's evicts the chats first (a chat saves one
// page for a whole checkpoint, a document 16). The figures are printed (docs/hybrid.md).
TEST(HybridRadix, WeighingTheFootprintKeepsTheNodesThatSaveMoreTokensPerStateByte) {
  auto restored = [](int chats, bool weigh) -> std::int64_t {
    std::vector<Tokens> requests;
    std::int32_t chat = 5000;
    for (int round = 0; round < 12; ++round) {
      for (std::int32_t d = 0; d < 8; ++d) {
        requests.push_back(prompt(100 + d, 16));
        for (int c = 0; c < chats; ++c) requests.push_back(prompt(chat++, 1));
      }
    }
    Hybrid e(WritePolicy::kWriteThrough, 512, 1024, 512, 1024, nullptr,
             HybridOptions{.config = RadixCacheConfig{.weigh_footprint = weigh},
                           .state_slot_bytes = 64 * 256 / 2,  // 2 layers: 64 KV pages
                           .state_device_pages = 12,
                           .state_host_pages = 24});
    e.checkpoint_every = 1000;  // only at the end of a prompt
    for (const Tokens& t : requests) {
      e.run(t);
      if (::testing::Test::HasFatalFailure()) return -1;
      e.settle();  // every write acked before the next request: the same figures every run
    }
    e.expect_accounting();
    std::printf("footprint eviction, %d chats per document, %s: restored %lld of %d tokens\n",
                chats, weigh ? "weighed" : "last access", static_cast<long long>(e.restored_tokens),
                12 * 8 * (16 + chats) * kPage);
    return e.restored_tokens;
  };
  const std::int64_t fits_lru = restored(2, false), fits_weighed = restored(2, true);
  const std::int64_t short_lru = restored(4, false), short_weighed = restored(4, true);
  // The documents' reuses alone are 11 rounds x 8 x 64 tokens.
  EXPECT_GE(fits_weighed, fits_lru * 95 / 100);  // room for all: about the same
  EXPECT_GE(short_weighed, 11 * 8 * 16 * kPage * 9 / 10);  // short: the documents stay
  EXPECT_GT(short_weighed, 2 * short_lru);
}

// TP 2, ranks as threads: the same requests on each rank, pools small enough to evict on both
// tiers. The trees stay identical (their descriptions match), every rank restores exactly the
// state computed from scratch, and each rank's pools hold exactly what its tree holds.
TEST(HybridRadix, TpRanksKeepIdenticalTreesAndRestoreTheSameState) {
  auto ranks = InProcessGroup::make_ranks(2);
  const std::vector<Tokens> requests = shared_prefix_requests(11, 5, 40, 200);
  std::vector<std::string> trees(2);
  std::vector<std::int64_t> restored(2), loads(2);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] {
      Hybrid e(WritePolicy::kWriteThrough, 24, 48, 12, 24, ranks[rank].get());
      for (const Tokens& t : requests) {
        e.run(t);
        if (::testing::Test::HasFatalFailure()) return;
      }
      e.expect_accounting();
      trees[rank] = e.cache.describe();
      restored[rank] = e.restored_states;
      loads[rank] = e.host_loads;
      e.cache.reset();  // every rank at the same step
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(trees[0], trees[1]);
  EXPECT_NE(trees[0].find("sidecars"), std::string::npos);
  EXPECT_EQ(restored[0], restored[1]);
  EXPECT_EQ(loads[0], loads[1]);
  EXPECT_GT(restored[0], 40);
  EXPECT_GT(loads[0], 3);
  EXPECT_EQ(ranks[0]->failure(), "");
}

// TP 2 with L3: each rank writes through to its own store; then rank 1's store loses some
// state records and fresh engines serve the same requests from L3. The ranks' restorable
// prefixes differ, so every prefetch's hit is their intersection: the trees stay identical, both
// restore the same prefixes, every restored byte is the one computed from scratch, and no
// collective diverges.
TEST(HybridRadix, TpRanksWithDifferentL3RecordsAgreeAndStayIdentical) {
  std::shared_ptr<InProcessGroup> main_group, prefetch_group, backup_group;
  auto tp = InProcessGroup::make_ranks(2, std::chrono::seconds(30), &main_group);
  auto pre = InProcessGroup::make_ranks(2, std::chrono::seconds(30), &prefetch_group);
  auto back = InProcessGroup::make_ranks(2, std::chrono::seconds(30), &backup_group);
  std::vector<std::unique_ptr<L3>> stores;
  for (int r = 0; r < 2; ++r) {
    stores.push_back(std::make_unique<L3>(str_cat("hybrid-tp-l3-", r)));
    stores[r]->prefetch = pre[r].get();
    stores[r]->backup = back[r].get();
    stores[r]->main = tp[r].get();
  }
  const std::vector<Tokens> requests = shared_prefix_requests(17, 4, 600, 80);
  auto run_all = [&](std::vector<std::string>& trees, std::vector<std::int64_t>& prefetched,
                     std::vector<std::int64_t>& restored) {
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        Hybrid e(WritePolicy::kWriteThrough, 48, 96, 48, 96, tp[r].get(),
                 HybridOptions{.l3 = stores[r].get(), .tp_rank = r, .tp_size = 2});
        for (const Tokens& t : requests) {
          e.run(t);
          if (::testing::Test::HasFatalFailure()) return;
        }
        e.expect_accounting();
        trees[r] = e.cache.describe();
        prefetched[r] = e.prefetched;
        restored[r] = e.restored_states;
      });
    }
    for (auto& t : threads) t.join();
  };
  std::vector<std::string> trees(2);
  std::vector<std::int64_t> prefetched(2), restored(2);
  run_all(trees, prefetched, restored);
  ASSERT_EQ(trees[0], trees[1]);
  // Rank 1 loses every third state record.
  int n = 0, removed = 0;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(stores[1]->root)) {
    const std::string name = entry.path().filename().string();
    if (name.find("sidecar=state") != std::string::npos && n++ % 3 == 0) {
      removed += stores[1]->file.remove(name) ? 1 : 0;
    }
  }
  EXPECT_GT(removed, 0);
  run_all(trees, prefetched, restored);
  EXPECT_EQ(trees[0], trees[1]);
  EXPECT_EQ(prefetched[0], prefetched[1]);
  EXPECT_EQ(restored[0], restored[1]);
  EXPECT_GT(prefetched[0], 0);
  EXPECT_EQ(main_group->divergence(), "");
  EXPECT_EQ(prefetch_group->divergence(), "");
  EXPECT_EQ(backup_group->divergence(), "");
}

}  // namespace
}  // namespace hicache::radix_test
