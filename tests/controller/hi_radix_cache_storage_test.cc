// HiRadixCache with L3 (its L3 paths): backups, prefetches (continuation, counting, corrupt
// records, cost, revoke/abort), identities in L3 keys, attach/detach, a shared store.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <tuple>

#include "tests/controller/radix_test_engine.h"

namespace hicache {
namespace {

using namespace radix_test;  // NOLINT(google-build-using-namespace): the tests' own helpers

TEST(HiRadixCacheStorage, IdentitiesNeverShareL3Pages) {
  L3 l3("identity");
  const auto t = seq({1, 2, 3, 4});
  EXPECT_EQ(store_in_l3(l3, t, "lora-7"), 4 * kPage);
  Engine second(WritePolicy::kWriteThrough, 32, 64, {}, &l3);
  for (std::string_view other : {"lora-8", ""}) {
    auto m = second.cache.match_prefix(t, other);
    EXPECT_FALSE(second.cache.prefetch_from_storage(str_cat("req-", other), m.last_host_node, t,
                                                    other))
        << "the file store's index holds none of its pages";
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

// One rank, a store that answers existence from memory (the file store's index): the radix
// cache asks it before anything is reserved. A span L3 does not hold is declined at once
// (declined_absent): no host page reserved or evicted for it, no query queued, the request not
// held for a step; a span it holds in part reserves and reads exactly the held pages. A store
// that does not answer from memory (a wrapper that says nothing) still goes through the
// storage controller's query, which revokes the miss.
TEST(HiRadixCacheStorage, AStoreThatAnswersFromMemoryIsAskedBeforeAnyHostPageIsReserved) {
  L3 l3("absent");
  const auto a = seq({1, 2, 3, 4});
  ASSERT_EQ(store_in_l3(l3, a), 4 * kPage);
  ASSERT_TRUE(l3.file.exists_without_io());
  MetricsRegistry r;
  // A host of 4 pages, full of two other sequences' pages (device copies dropped).
  Engine e(WritePolicy::kWriteThrough, 32, 4, {}, &l3, {.policy = PrefetchPolicy::kWaitComplete});
  e.cache.register_metrics(r);
  e.storage->register_metrics(r);
  const auto outcome = [&](const char* o) {
    return r.value("hicache_prefetch_outcomes_total", {{"outcome", o}});
  };
  e.run(seq({7, 8}));
  e.run(seq({9, 10}));
  e.settle();
  e.cache.evict_device(100);
  ASSERT_EQ(e.host_pool.free_tokens(), 0);
  const double absent_before = outcome("declined_absent");  // the two runs' own asks
  const auto absent = seq({5, 6, 7});
  EXPECT_FALSE(e.cache.prefetch_from_storage("absent", e.cache.match_prefix(absent).last_host_node,
                                             absent));
  EXPECT_EQ(outcome("declined_absent"), absent_before + 1);
  EXPECT_EQ(outcome("issued"), 0);
  EXPECT_EQ(e.cache.prefetches_in_flight(), 0u);
  EXPECT_EQ(e.cache.stats().host_tokens, 4 * kPage) << "no host page evicted for a miss";
  EXPECT_EQ(e.cache.stats().evicted_host_tokens, 0);
  // Pages 0-1 of `part` are a's (held), 2-3 are not: two pages reserved (evicted for), and read.
  const auto part = seq({1, 2, 11, 12});
  ASSERT_TRUE(
      e.cache.prefetch_from_storage("part", e.cache.match_prefix(part).last_host_node, part));
  EXPECT_EQ(outcome("issued"), 1);
  EXPECT_EQ(e.cache.stats().evicted_host_tokens, 2 * kPage) << "room for the held pages only";
  std::int64_t inserted = -1;
  while (!e.cache.check_prefetch_progress("part", &inserted)) e.check();
  EXPECT_EQ(inserted, 2 * kPage);
  const std::int64_t verified = e.verified_pages;
  e.run(part);
  EXPECT_EQ(e.verified_pages - verified, 2) << "the two pages read from L3, byte for byte";
  e.expect_accounting();

  // The same miss through a store that does not say it answers from memory: queued, revoked.
  Forwarding asking(l3.file);
  ASSERT_FALSE(asking.exists_without_io());
  L3 other("absent-asked");
  other.store = &asking;
  MetricsRegistry r2;
  Engine f(WritePolicy::kWriteThrough, 32, 64, {}, &other);
  f.cache.register_metrics(r2);
  f.storage->register_metrics(r2);
  ASSERT_TRUE(f.cache.prefetch_from_storage("absent", f.cache.match_prefix(absent).last_host_node,
                                            absent));
  while (!f.cache.check_prefetch_progress("absent")) f.check();
  EXPECT_EQ(r2.value("hicache_prefetch_outcomes_total", {{"outcome", "revoked_full_miss"}}), 1);
  EXPECT_EQ(r2.value("hicache_prefetch_outcomes_total", {{"outcome", "declined_absent"}}), 0);
  f.expect_accounting();
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
  EXPECT_FALSE(third.cache.prefetch_from_storage("never-stored", m.last_host_node, b))
      << "L3 holds nothing of b: declined from the file store's index";
  EXPECT_TRUE(third.cache.check_prefetch_progress("never-stored", &inserted));
  EXPECT_EQ(inserted, 0);
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
  // One read of all six pages: it finds page 4's record gone too (the store's index, which a
  // removal behind its back leaves stale, learns it), so that the backup below writes it again.
  Engine second(WritePolicy::kWriteThrough, 32, 64, {}, &l3,
                {.io_batch_pages = 6, .policy = PrefetchPolicy::kWaitComplete});
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

// Cost-aware prefetch, on by default: once an L3 read was measured and the engine reported
// what a token costs to compute, a prefetch is declined when reading the pages would take
// longer than recomputing them.
TEST(HiRadixCacheStorage, PrefetchIsDeclinedWhenRecomputingIsCheaper) {
  L3 l3("cost");
  const auto a = seq({1, 2, 3, 4});
  store_in_l3(l3, a);
  for (double cost : {1e-15, 1.0}) {
    Engine e(WritePolicy::kWriteThrough, 32, 64, {}, &l3,
             {.policy = PrefetchPolicy::kWaitComplete});
    e.run(a);  // nothing measured yet: prefetched (which measures the read bandwidth)
    e.settle();
    ASSERT_EQ(e.cache.stats().prefetched_tokens, 4 * kPage);
    // The engine's forward pass: 1000 tokens computed at `cost` seconds each.
    e.cache.record_prefill(0, 0, 0, 1000, 1000 * cost);
    e.cache.evict_device(std::int64_t{1} << 40);
    e.cache.evict_host(std::int64_t{1} << 40);
    ASSERT_EQ(e.cache.stats().nodes, 0);
    const auto recomputed = e.recomputed_pages;
    e.run(a);
    e.settle();
    const auto s = e.cache.stats();
    EXPECT_GT(s.measured_prefetch_gbps, 0);
    EXPECT_EQ(s.prefetches_cut, 0);
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
  // recompute_seconds_per_token 0, set explicitly: off, whatever the engine reports.
  Engine off(WritePolicy::kWriteThrough, 32, 64, {.recompute_seconds_per_token = 0.0}, &l3,
             {.policy = PrefetchPolicy::kWaitComplete});
  off.run(a);
  off.settle();
  off.cache.record_prefill(0, 0, 0, 1000, 1e-12);
  off.cache.evict_device(std::int64_t{1} << 40);
  off.cache.evict_host(std::int64_t{1} << 40);
  off.run(a);
  off.settle();
  EXPECT_EQ(off.cache.stats().prefetched_tokens, 8 * kPage);
  EXPECT_EQ(off.cache.stats().prefetches_refused_by_cost, 0);
  off.expect_accounting();
}

// storage_admission reuse: a request's pages reach L3 only once a later request asked for them
// again; what nobody asked for twice never costs a write, and a fresh engine finds the reused
// prefix in L3 (byte for byte) and recomputes the rest.
TEST(HiRadixCacheStorage, ReuseAdmissionBacksUpOnlyWhatRequestsAskedForAgain) {
  L3 l3("reuse");
  const auto a = seq({1, 2, 3, 4}), b = seq({5, 6, 7, 8});
  {
    Engine e(WritePolicy::kWriteThrough, 32, 64,
             {.storage_admission = StorageAdmission::kReuse}, &l3);
    e.run(a);
    e.run(b);
    e.settle();
    EXPECT_EQ(e.cache.stats().stored_tokens, 0) << "used once, written to L3";
    e.run(a);  // asked for again: a goes to L3
    e.settle();
    EXPECT_EQ(e.cache.stats().stored_tokens, 4 * kPage);
    e.expect_accounting();
  }
  Engine fresh(WritePolicy::kWriteThrough, 32, 64, {}, &l3,
               {.policy = PrefetchPolicy::kWaitComplete});
  fresh.run(a);
  EXPECT_EQ(fresh.cache.stats().prefetched_tokens, 4 * kPage);
  EXPECT_EQ(fresh.verified_pages, 4);
  const auto recomputed = fresh.recomputed_pages;
  fresh.run(b);
  EXPECT_EQ(fresh.recomputed_pages, recomputed + 4) << "b was never asked for twice";
  EXPECT_EQ(fresh.cache.stats().prefetched_tokens, 4 * kPage);
  fresh.expect_accounting();
}

// Writes take `delay` each.
class SlowWrites final : public Forwarding {
 public:
  SlowWrites(StorageBackend& inner, std::chrono::milliseconds delay)
      : Forwarding(inner), delay_(delay) {}

 protected:
  std::vector<IoResult> do_batch_set(std::span<const std::string> keys,
                                     std::span<const ConstByteSpan> src) override {
    std::this_thread::sleep_for(delay_);  // the slow store (a test's, never a hot path)
    return inner_.batch_set(keys, src);
  }

 private:
  const std::chrono::milliseconds delay_;
};

// Writes wait at the gate.
class HeldWrites final : public Forwarding {
 public:
  using Forwarding::Forwarding;
  ~HeldWrites() override { gate.open(); }
  Gate gate;

 protected:
  std::vector<IoResult> do_batch_set(std::span<const std::string> keys,
                                     std::span<const ConstByteSpan> src) override {
    gate.pass();
    return inner_.batch_set(keys, src);
  }
};

// A backup reads the node's host copy, and holds only that: while L3 has not answered, the
// node's device copy can be evicted (a lock held it, and its path, on the device for as long as
// a slow store took), and host eviction leaves the host copy alone; after the ack the pages
// are in L3 and the host copy can go. A fresh engine then reads them back byte for byte.
TEST(HiRadixCacheStorage, ABackupHoldsOnlyTheHostCopyItReads) {
  L3 l3("backup-holds-host");
  HeldWrites gated(l3.file);
  l3.store = &gated;
  const auto a = seq({1, 2, 3, 4});
  {
    Engine e(WritePolicy::kWriteThrough, 32, 64, {}, &l3);
    e.run(a);
    // The host write's ack queues the backup, which waits at the store.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (!gated.gate.held()) {
      ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "no backup reached the store";
      e.check();
      std::this_thread::yield();
    }
    ASSERT_EQ(e.cache.stats().backups_in_flight, 1);
    EXPECT_EQ(e.cache.evict_device(std::int64_t{1} << 40), 4 * kPage);
    EXPECT_EQ(e.cache.stats().device_tokens, 0);
    EXPECT_EQ(e.cache.evict_host(std::int64_t{1} << 40), 0) << "freed the pages a backup reads";
    EXPECT_EQ(e.cache.stats().host_tokens, 4 * kPage);
    EXPECT_EQ(e.cache.check_invariants(), "");
    gated.gate.open();
    e.settle();
    EXPECT_EQ(e.cache.stats().stored_tokens, 4 * kPage);
    EXPECT_EQ(e.cache.evict_host(std::int64_t{1} << 40), 4 * kPage);
    e.expect_accounting();
  }
  Engine fresh(WritePolicy::kWriteThrough, 32, 64, {}, &l3,
               {.policy = PrefetchPolicy::kWaitComplete});
  fresh.run(a);
  EXPECT_EQ(fresh.cache.stats().prefetched_tokens, 4 * kPage);
  EXPECT_EQ(fresh.verified_pages, 4);
  fresh.expect_accounting();
}

// The cost rule's deadline: a prefetch still loading once recomputing its tokens would have
// been done is cut. Its I/O stops after the batch in flight (the scheduler never waits for it),
// the pages that arrived go into the tree byte for byte, and exactly the host pages it did not
// use are freed.
TEST(HiRadixCacheStorage, APrefetchPastItsDeadlineIsCutAndFreesExactlyThePagesItDidNotUse) {
  L3 l3("cut");
  const auto a = seq({1, 2, 3, 4});
  store_in_l3(l3, a);
  SlowReads slow(l3.file, std::chrono::milliseconds(0), /*free_reads=*/1);
  l3.store = &slow;
  // A picosecond per token: the 16 tokens' deadline is the prefetch's start (a microsecond per
  // token left 16 us, which the query and the first read can beat: nothing was cut then).
  Engine e(WritePolicy::kWriteThrough, 32, 64, {.recompute_seconds_per_token = 1e-12}, &l3,
           {.io_batch_pages = 1, .policy = PrefetchPolicy::kWaitComplete});
  const std::int64_t host_free = e.host_pool.free_tokens();
  auto m = e.cache.match_prefix(a);
  ASSERT_TRUE(e.cache.prefetch_from_storage("cut", m.last_host_node, a));
  EXPECT_EQ(e.host_pool.free_tokens(), host_free - 4 * kPage);  // reserved for the whole span
  slow.gate.wait_held();  // page 1 landed, page 2's read is in flight
  e.cache.check_events();
  EXPECT_EQ(e.cache.stats().prefetches_cut, 1);
  EXPECT_FALSE(e.cache.check_prefetch_progress("cut")) << "ended before its I/O stopped";
  slow.gate.open();  // the batch in flight lands; the I/O stops there
  std::int64_t inserted = -1;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  for (;;) {
    const std::uint64_t seen = e.cache.event_seq();
    e.cache.check_events();
    if (e.cache.check_prefetch_progress("cut", &inserted)) break;
    ASSERT_TRUE(e.cache.wait_for_events(seen, deadline)) << "the cut prefetch never ended";
  }
  EXPECT_EQ(inserted, 2 * kPage);
  EXPECT_EQ(slow.reads(), 2) << "read past the cut";
  EXPECT_EQ(e.cache.stats().prefetched_tokens, 2 * kPage);
  EXPECT_EQ(e.host_pool.free_tokens(), host_free - 2 * kPage);  // the 2 it did not use: freed
  // The two pages are served byte for byte; the other two are computed.
  const auto verified = e.verified_pages;
  e.run(a);
  EXPECT_EQ(e.verified_pages, verified + 2);
  e.expect_accounting();
}

// A store that writes slowly and reads fast: until a read was measured the writes' estimate
// stands for the reads, which would decline every prefetch and never measure a read. One
// prefetch at a time still goes, measures the reads, and from then on they are weighed as they
// are: fetched.
TEST(HiRadixCacheStorage, AStoreThatWritesSlowlyIsStillReadToMeasureItsReads) {
  L3 l3("slow-writes");
  const auto a = seq({1, 2, 3, 4}), b = seq({5, 6, 7, 8});
  store_in_l3(l3, a);
  SlowWrites slow(l3.file, std::chrono::milliseconds(300));
  l3.store = &slow;
  Engine e(WritePolicy::kWriteThrough, 32, 64, {}, &l3, {.policy = PrefetchPolicy::kWaitComplete});
  e.cache.record_prefill(0, 0, 0, 1000, 1000 * 2e-3);  // 32 ms for 16 tokens
  e.run(b);  // not in L3: backed up over the slow writes (the write link measured)
  e.settle();
  for (int round = 0; round < 2; ++round) {
    SCOPED_TRACE(str_cat("round ", round));
    e.cache.evict_device(std::int64_t{1} << 40);
    e.cache.evict_host(std::int64_t{1} << 40);
    const auto recomputed = e.recomputed_pages;
    e.run(a);
    e.settle();
    EXPECT_EQ(e.recomputed_pages, recomputed) << "read from L3";
    EXPECT_EQ(e.cache.stats().prefetched_tokens, (round + 1) * 4 * kPage);
  }
  EXPECT_EQ(e.cache.stats().prefetches_refused_by_cost, 0);
  e.expect_accounting();
}

// The decision on a constructed case, the engine's cost reported as a forward pass does: over
// a store whose reads take 300 ms, a prefetch of 16 tokens costing 2 ms each to compute is cut
// (before anything was measured) and the next one declined; over the file store as it is, both
// are fetched.
TEST(HiRadixCacheStorage, ASlowStoreIsRecomputedAndAFastOneFetched) {
  for (const bool slow_store : {true, false}) {
    SCOPED_TRACE(slow_store ? "slow store" : "fast store");
    L3 l3(slow_store ? "slow" : "fast");
    const auto a = seq({1, 2, 3, 4});
    store_in_l3(l3, a);
    SlowReads slow(l3.file, std::chrono::milliseconds(slow_store ? 300 : 0), 1 << 30);
    l3.store = &slow;
    Engine e(WritePolicy::kWriteThrough, 32, 64, {}, &l3,
             {.policy = PrefetchPolicy::kWaitComplete});
    e.cache.record_prefill(0, 0, 0, 1000, 1000 * 2e-3);
    e.run(a);
    e.settle();
    e.cache.evict_device(std::int64_t{1} << 40);
    e.cache.evict_host(std::int64_t{1} << 40);
    const auto recomputed = e.recomputed_pages;
    e.run(a);
    e.settle();
    const auto s = e.cache.stats();
    if (slow_store) {
      EXPECT_EQ(s.prefetches_cut, 1);
      EXPECT_EQ(s.prefetches_refused_by_cost, 1);
      EXPECT_EQ(e.recomputed_pages, recomputed + 4);
    } else {
      EXPECT_EQ(s.prefetches_cut, 0);
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
  // Asked on the prefetch thread (the file store's index would decline it at once).
  Forwarding asking(l3.file);
  L3 via("revoke-asked");
  via.store = &asking;
  Engine picky(WritePolicy::kWriteThrough, 32, 64, {}, &via,
               {.prefetch_threshold_tokens = 4 * kPage});
  auto m = picky.cache.match_prefix(a);
  EXPECT_FALSE(picky.cache.prefetch_from_storage("short", m.last_host_node, a))
      << "a span below the threshold is declined before any query";
  // Asked for four pages, L3 holds three of them: revoked after the query.
  const auto longer = seq({1, 2, 3, 4});
  ASSERT_TRUE(picky.cache.prefetch_from_storage("small", m.last_host_node, longer));
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

// hicache_prefetch_confirm_steps: a prefetch that read its whole hit is taken at the first step
// after its last page landed (0 or 1 steps begun in between: none when it landed within the
// step that took it); a revoked prefetch (a full miss) counts nothing.
TEST(HiRadixCacheStorage, APrefetchIsTakenAtTheFirstStepAfterItsPagesLanded) {
  L3 l3("confirm");
  const auto a = seq({1, 2, 3, 4});
  store_in_l3(l3, a);
  Forwarding asking(l3.file);  // the miss below is asked on the prefetch thread, and revoked
  l3.store = &asking;
  MetricsRegistry registry;  // outlives the engine, which forgets its series at the end
  // wait_complete: the prefetch ends once every page landed (best_effort ends it when asked).
  Engine e(WritePolicy::kWriteThrough, 32, 64, {}, &l3, {.policy = PrefetchPolicy::kWaitComplete});
  e.cache.register_metrics(registry);
  const auto confirm_steps = [&] {
    const auto all = nlohmann::json::parse(registry.json_text());
    const auto& series = all.at("hicache_prefetch_confirm_steps").at("series").at(0);
    return std::pair{series.at("count").get<std::uint64_t>(), series.at("sum").get<double>()};
  };
  ASSERT_TRUE(e.cache.prefetch_from_storage("whole", e.cache.match_prefix(a).last_host_node, a));
  while (!e.cache.check_prefetch_progress("whole")) e.cache.check_events();
  EXPECT_EQ(e.cache.stats().prefetched_tokens, 4 * kPage);
  auto [count, sum] = confirm_steps();
  EXPECT_EQ(count, 1u);
  EXPECT_LE(sum, 1.0);
  const auto never = seq({7, 8, 9, 10});
  ASSERT_TRUE(
      e.cache.prefetch_from_storage("miss", e.cache.match_prefix(never).last_host_node, never));
  while (!e.cache.check_prefetch_progress("miss")) e.cache.check_events();
  EXPECT_EQ(e.cache.stats().revoked_prefetches, 1);
  std::tie(count, sum) = confirm_steps();
  EXPECT_EQ(count, 1u) << "a revoked prefetch is not a confirmation";
}

// Each prefetch asked for counts once by outcome, and every token of an agreed L3 hit reaches
// the tree or counts once as unfulfilled, by why (hicache_prefetch_outcomes_total,
// hicache_prefetch_unfulfilled_tokens_total; SGLang's names in docs/metrics.md).
TEST(HiRadixCacheStorage, PrefetchOutcomesAndUnfulfilledTokensAddUpToTheAgreedHit) {
  L3 l3("outcomes");
  const auto a = seq({1, 2, 3, 4, 5, 6});
  ASSERT_EQ(store_in_l3(l3, a), 6 * kPage);
  // Asked on the prefetch thread: the storage controller's outcomes (the file store's index
  // declines misses before a query: AStoreThatAnswersFromMemoryIsAskedBeforeAnyHostPageIsReserved).
  Forwarding asking(l3.file);
  l3.store = &asking;
  const StorageControllerConfig sc = {.prefetch_threshold_tokens = 3 * kPage,
                                      .policy = PrefetchPolicy::kWaitComplete};
  MetricsRegistry r;  // before the engines: their metrics go first
  Engine e(WritePolicy::kWriteThrough, 32, 64, {}, &l3, sc);
  e.cache.register_metrics(r);
  e.storage->register_metrics(r);
  const auto outcome = [&](const char* o) {
    return r.value("hicache_prefetch_outcomes_total", {{"outcome", o}});
  };
  const auto unfulfilled = [&](const char* why) {
    return r.value("hicache_prefetch_unfulfilled_tokens_total", {{"reason", why}});
  };
  const auto hit = [&] { return r.value("hicache_prefetch_hit_tokens_total"); };
  // Runs a prefetch to its end: the tokens it inserted, or nothing when it was declined.
  const auto prefetch = [&](const std::string& id,
                            std::span<const std::int32_t> t) -> std::optional<std::int64_t> {
    if (!e.cache.prefetch_from_storage(id, e.cache.match_prefix(t).last_host_node, t)) {
      return std::nullopt;
    }
    std::int64_t inserted = 0;
    while (!e.cache.check_prefetch_progress(id, &inserted)) e.check();
    return inserted;
  };
  EXPECT_EQ(prefetch("short", seq({1, 2})), std::nullopt);
  EXPECT_EQ(outcome("declined_too_short"), 1);
  EXPECT_EQ(outcome("issued"), 0);
  EXPECT_EQ(prefetch("miss", seq({50, 51, 52})), 0);
  EXPECT_EQ(outcome("revoked_full_miss"), 1);
  EXPECT_EQ(hit(), 0);
  EXPECT_EQ(prefetch("part", seq({1, 2, 77, 78})), 0) << "two pages in L3, three needed";
  EXPECT_EQ(outcome("revoked_insufficient"), 1);
  EXPECT_EQ(hit(), 2 * kPage);
  EXPECT_EQ(unfulfilled("below_threshold"), 2 * kPage);
  EXPECT_EQ(prefetch("all", a), 6 * kPage);
  EXPECT_EQ(hit(), 8 * kPage);
  EXPECT_EQ(unfulfilled("storage_transfer") + unfulfilled("shrunk"), 0);
  ASSERT_EQ(e.cache.evict_host(1 << 20), 6 * kPage);
  // Aborted once past the agreement: the whole hit dropped.
  ASSERT_TRUE(e.cache.prefetch_from_storage("gone", e.cache.match_prefix(a).last_host_node, a));
  e.cache.release_aborted_request("gone");
  EXPECT_EQ(unfulfilled("dropped"), 6 * kPage);
  EXPECT_EQ(hit(), 14 * kPage);
  // Cached by another request while it read: what it read is not inserted again.
  ASSERT_TRUE(e.cache.prefetch_from_storage("dup", e.cache.match_prefix(a).last_host_node, a));
  auto slots = e.device_pool.allocator().alloc(6 * kPage);
  ASSERT_TRUE(slots.has_value());
  EXPECT_EQ(e.cache.insert(a, *slots), 0);
  std::int64_t inserted = -1;
  while (!e.cache.check_prefetch_progress("dup", &inserted)) e.check();
  EXPECT_EQ(inserted, 0);
  EXPECT_EQ(unfulfilled("shrunk"), 6 * kPage);
  EXPECT_EQ(outcome("attempts"), 6);
  EXPECT_EQ(outcome("issued"), 5);
  EXPECT_EQ(r.value("hicache_prefetched_tokens_total"), 12 * kPage) << "all, dup";
  EXPECT_EQ(hit(), 6 * kPage /* inserted by "all" */ + unfulfilled("below_threshold") +
                       unfulfilled("host_capacity") + unfulfilled("storage_transfer") +
                       unfulfilled("dropped") + unfulfilled("shrunk"));
  EXPECT_EQ(hit(), 20 * kPage);
  e.settle();
  e.expect_accounting();

  // Records that fail their checksum when read: the hit was agreed, nothing arrived.
  L3 bad("outcomes-corrupt");
  const auto b = seq({7, 8, 9, 10});
  ASSERT_EQ(store_in_l3(bad, b), 4 * kPage);
  for (const auto& f : std::filesystem::recursive_directory_iterator(bad.root)) {
    if (!f.is_regular_file()) continue;
    std::fstream io(f.path(), std::ios::in | std::ios::out | std::ios::binary);
    io.seekg(-1, std::ios::end);
    const char last = static_cast<char>(io.get());
    io.seekp(-1, std::ios::end);
    io.put(static_cast<char>(last ^ 0x5a));
  }
  MetricsRegistry rf;
  Engine f(WritePolicy::kWriteThrough, 32, 64, {}, &bad, sc);
  f.cache.register_metrics(rf);
  f.storage->register_metrics(rf);
  ASSERT_TRUE(f.cache.prefetch_from_storage("bad", f.cache.match_prefix(b).last_host_node, b));
  inserted = -1;
  while (!f.cache.check_prefetch_progress("bad", &inserted)) f.check();
  EXPECT_EQ(inserted, 0);
  EXPECT_EQ(rf.value("hicache_prefetch_hit_tokens_total"), 4 * kPage);
  EXPECT_EQ(rf.value("hicache_prefetch_unfulfilled_tokens_total", {{"reason", "storage_transfer"}}),
            4 * kPage);

  // Declined before a query: the prefetch budget, or no host room for the span.
  StorageControllerConfig tight = sc;
  tight.prefetch_budget_tokens = 2 * kPage;
  MetricsRegistry rg, rh;
  Engine g(WritePolicy::kWriteThrough, 32, 64, {}, &l3, tight);
  g.cache.register_metrics(rg);
  EXPECT_FALSE(g.cache.prefetch_from_storage("big", g.cache.match_prefix(a).last_host_node, a));
  EXPECT_EQ(rg.value("hicache_prefetch_outcomes_total", {{"outcome", "declined_rate_limited"}}), 1);
  Engine h(WritePolicy::kWriteThrough, 32, 2, {}, &l3, sc);
  h.cache.register_metrics(rh);
  EXPECT_FALSE(
      h.cache.prefetch_from_storage("roomless", h.cache.match_prefix(a).last_host_node, a));
  EXPECT_EQ(rh.value("hicache_prefetch_outcomes_total", {{"outcome", "declined_host_full"}}), 1);
  EXPECT_EQ(rh.value("hicache_prefetch_outcomes_total", {{"outcome", "issued"}}), 0);
}

// A file store whose writes wait while `gate` is held, and fail while `fail_sets` is set.
class GatedWrites final : public testing::FileForwarding {
 public:
  using FileForwarding::FileForwarding;
  std::string_view name() const override { return "gated writes"; }
  std::mutex gate;
  std::atomic<bool> fail_sets{false};  // every key of a set is an error, nothing stored

 protected:
  std::vector<IoResult> do_batch_set(std::span<const std::string> keys,
                                     std::span<const ConstByteSpan> src) override {
    std::lock_guard hold(gate);
    if (fail_sets) return std::vector<IoResult>(keys.size(), IoResult::error("injected failure"));
    return inner_.batch_set(keys, src);
  }
};

// A synced host copy whose backup finds the backup queue full (one op, held by a backup that
// cannot finish) stays host-only: counted as a dropped backup (SGLang's
// hicache_backup_dropped_tokens_total).
TEST(HiRadixCacheStorage, ABackupThatFindsTheQueueFullIsDroppedAndCounted) {
  L3 l3("backup-drop");  // its directory and its collective
  GatedWrites store((l3.root / "gated").string());
  MetricsRegistry r;  // before the engine: its metrics go first
  Engine e(WritePolicy::kWriteThrough, 32, 64);
  e.storage =
      std::make_unique<StorageController>(e.host_pool, store, e.ns, l3.local, l3.local, l3.local,
                                          StorageControllerConfig{.queue_capacity = 1});
  e.cache.attach_storage(*e.storage, e.ns);
  e.cache.register_metrics(r);
  const auto insert = [&](std::int32_t p) {
    const auto t = seq({p, p + 1});
    auto slots = e.device_pool.allocator().alloc(2 * kPage);
    ASSERT_TRUE(slots.has_value());
    e.cache.insert(t, *slots);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (e.cache.stats().writes_in_flight > 0 && std::chrono::steady_clock::now() < deadline) {
      e.cache.check_events();  // the write ack queues (or drops) the node's backup
      std::this_thread::yield();
    }
    ASSERT_EQ(e.cache.stats().writes_in_flight, 0);
  };
  {
    std::unique_lock hold(store.gate);
    insert(10);
    EXPECT_EQ(e.cache.stats().backups_in_flight, 1) << "queued, and held at the store";
    EXPECT_EQ(r.value("hicache_backup_dropped_tokens_total", {{"reason", "queue_full"}}), 0);
    insert(20);
    EXPECT_EQ(e.cache.stats().backups_in_flight, 1);
    EXPECT_EQ(r.value("hicache_backup_dropped_tokens_total", {{"reason", "queue_full"}}),
              2 * kPage);
  }
  e.settle();
  EXPECT_EQ(e.cache.stats().stored_tokens, 2 * kPage) << "one of the two nodes reached L3";
  e.expect_accounting();
  e.cache.detach_storage();  // before the store goes
  e.storage.reset();
}

constexpr RadixCacheConfig kExclusive{.storage_admission = StorageAdmission::kExclusive};

// Exclusive admission: a page reaching the host is not written to L3; host eviction backs it up
// (the pages stay on the host, locked, until the ack) and frees it on the ack; the pages read
// back from L3 are the bytes written. A page L3 holds already leaves the host with no write.
TEST(HiRadixCacheStorage, ExclusiveWritesL3AsPagesLeaveTheHostAndFreesThemOnTheAck) {
  L3 l3("exclusive");
  Engine e(WritePolicy::kWriteThrough, 32, 64, kExclusive, &l3,
           {.policy = PrefetchPolicy::kWaitComplete});  // run() reads every page back
  const auto a = seq({1, 2, 3});
  e.run(a);
  e.settle();
  EXPECT_EQ(e.cache.stats().host_tokens, 3 * kPage);
  EXPECT_EQ(e.cache.stats().stored_tokens, 0) << "the host write backed nothing up";
  EXPECT_EQ(e.storage->written_bytes(), 0);
  EXPECT_EQ(e.cache.evict_device(100), 3 * kPage);
  EXPECT_EQ(e.cache.evict_host(100), 0) << "freed on the backup's ack, not now";
  RadixCacheStats s = e.cache.stats();
  EXPECT_EQ(s.backups_in_flight, 1);
  EXPECT_EQ(s.host_tokens, 3 * kPage) << "kept until the ack";
  EXPECT_EQ(e.cache.evict_host(100), 0) << "locked while it is written: not taken twice";
  e.settle();
  s = e.cache.stats();
  EXPECT_EQ(s.host_tokens, 0);
  EXPECT_EQ(s.nodes, 0);
  EXPECT_EQ(s.evicted_host_tokens, 3 * kPage);
  EXPECT_EQ(s.backup_kept_tokens, 0);
  const std::int64_t written = e.storage->written_bytes();
  EXPECT_EQ(written, 3 * geometry().token_bytes() * kPage);
  e.expect_accounting();

  e.run(a);  // prefetched from L3, loaded back, every page verified
  EXPECT_EQ(e.verified_pages, 3);
  EXPECT_EQ(e.recomputed_pages, 3) << "nothing recomputed the second time";
  e.settle();
  EXPECT_EQ(e.cache.evict_device(100), 3 * kPage);
  EXPECT_EQ(e.cache.evict_host(100), 3 * kPage) << "in L3 already: it leaves at once";
  EXPECT_EQ(e.cache.stats().backups_in_flight, 0);
  EXPECT_EQ(e.storage->written_bytes(), written) << "nothing written twice";
  e.expect_accounting();
}

// The illegal twin: under write_through (the default) the host write backs the page up at once,
// and host eviction frees it with no further write.
TEST(HiRadixCacheStorage, WriteThroughAdmissionBacksUpAtTheHostWrite) {
  L3 l3("write-through-admission");
  Engine e(WritePolicy::kWriteThrough, 32, 64, {}, &l3);
  const auto a = seq({1, 2, 3});
  e.run(a);
  e.settle();
  const std::int64_t written = 3 * geometry().token_bytes() * kPage;
  EXPECT_EQ(e.cache.stats().stored_tokens, 3 * kPage);
  EXPECT_EQ(e.storage->written_bytes(), written);
  EXPECT_EQ(e.cache.evict_device(100), 3 * kPage);
  EXPECT_EQ(e.cache.evict_host(100), 3 * kPage) << "freed at once";
  EXPECT_EQ(e.cache.stats().backups_in_flight, 0);
  EXPECT_EQ(e.storage->written_bytes(), written);
  e.expect_accounting();
}

// Exclusive admission: a backup on leaving the host that fails keeps the pages on the host
// (counted), where they serve byte for byte; a later eviction tries again and frees them once
// L3 took them.
TEST(HiRadixCacheStorage, ExclusiveKeepsPagesWhoseBackupFailedOnTheHost) {
  L3 l3("exclusive-fail");
  GatedWrites store((l3.root / "gated").string());
  MetricsRegistry r;
  Engine e(WritePolicy::kWriteThrough, 32, 64, kExclusive);
  e.storage = std::make_unique<StorageController>(
      e.host_pool, store, e.ns, l3.local, l3.local, l3.local,
      StorageControllerConfig{.policy = PrefetchPolicy::kWaitComplete});
  e.cache.attach_storage(*e.storage, e.ns);
  e.cache.register_metrics(r);
  const auto a = seq({1, 2, 3});
  e.run(a);
  e.settle();
  EXPECT_EQ(e.cache.evict_device(100), 3 * kPage);
  store.fail_sets = true;
  EXPECT_EQ(e.cache.evict_host(100), 0);
  e.settle();
  RadixCacheStats s = e.cache.stats();
  EXPECT_EQ(s.host_tokens, 3 * kPage) << "nothing lost";
  EXPECT_EQ(s.stored_tokens, 0);
  EXPECT_EQ(s.backup_kept_tokens, 3 * kPage);
  EXPECT_EQ(s.evicted_host_tokens, 0);
  EXPECT_EQ(r.value("hicache_backup_kept_tokens_total", {{"reason", "backup_failed"}}), 3 * kPage);
  EXPECT_EQ(e.cache.match_prefix(a).host_hit_tokens, 3 * kPage);
  e.expect_accounting();

  store.fail_sets = false;
  EXPECT_EQ(e.cache.evict_host(100), 0);
  e.settle();
  EXPECT_EQ(e.cache.stats().host_tokens, 0);
  EXPECT_EQ(e.cache.stats().backup_kept_tokens, 3 * kPage) << "counted once";
  e.run(a);  // from L3 now
  EXPECT_EQ(e.verified_pages, 3);
  EXPECT_EQ(e.recomputed_pages, 3);
  e.expect_accounting();
  e.cache.detach_storage();  // before the store goes
  e.storage.reset();
}

// Exclusive admission: a page hit again while it is written to L3 (loaded back to the device)
// stays on the host when the ack comes, and is known to be in L3.
TEST(HiRadixCacheStorage, ExclusiveKeepsAPageUsedAgainWhileItWasWritten) {
  L3 l3("exclusive-reused");
  GatedWrites store((l3.root / "gated").string());
  Engine e(WritePolicy::kWriteThrough, 32, 64, kExclusive);
  e.storage =
      std::make_unique<StorageController>(e.host_pool, store, e.ns, l3.local, l3.local, l3.local);
  e.cache.attach_storage(*e.storage, e.ns);
  const auto a = seq({1, 2});
  e.run(a);
  e.settle();
  EXPECT_EQ(e.cache.evict_device(100), 2 * kPage);
  {
    std::unique_lock hold(store.gate);
    EXPECT_EQ(e.cache.evict_host(100), 0);
    e.run(a);  // a host hit: loaded back while its backup waits at the store
    EXPECT_EQ(e.loaded_requests, 1);
  }
  e.settle();
  const RadixCacheStats s = e.cache.stats();
  EXPECT_EQ(s.host_tokens, 2 * kPage) << "used again: kept";
  EXPECT_EQ(s.stored_tokens, 2 * kPage);
  EXPECT_EQ(e.verified_pages, 2);
  e.expect_accounting();
  e.cache.detach_storage();
  e.storage.reset();
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

}  // namespace
}  // namespace hicache
