// HiRadixCache under tensor parallelism (its agreement): ranks as threads in one process keep
// identical trees under eviction, failures on one rank, resets, L3 detach/attach and full queues.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <optional>
#include <random>
#include <thread>

#include <nlohmann/json.hpp>

#include "tests/controller/radix_test_engine.h"

namespace hicache {
namespace {

using namespace radix_test;  // NOLINT(google-build-using-namespace): the tests' own helpers

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

// The cost rule under TP: each rank's engine reports its own prefill cost (rank 0 next to
// nothing, rank 1 a second per token), so each rank alone would decide a load back the other way.
// The ranks weigh the agreed estimates (the cheapest recompute) and refuse the same load backs:
// the trees stay identical after every request.
TEST(HiRadixCacheTp, RanksThatMeasureDifferentCostsDecideAlike) {
  std::shared_ptr<InProcessGroup> group;
  auto tp = InProcessGroup::make_ranks(2, std::chrono::seconds(30), &group);
  std::vector<std::vector<std::string>> trees(2);
  std::vector<std::int64_t> refused(2), loaded(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      Engine e(WritePolicy::kWriteThrough, 24, 40, {}, nullptr, {}, tp[r].get());
      std::mt19937 rng(7);
      for (int step = 0; step < 200; ++step) {
        e.run(family_prompt(rng, 5, 7));
        e.cache.record_prefill(0, 0, 0, 100, r == 0 ? 100 * 1e-15 : 100 * 1.0);
        trees[r].push_back(e.cache.describe());
      }
      e.settle();
      trees[r].push_back(e.cache.describe());
      refused[r] = e.cache.stats().load_backs_refused_by_cost;
      loaded[r] = e.loaded_requests;
      EXPECT_EQ(e.cache.stats().tp_failures, 0);
    });
  }
  for (auto& t : ranks) t.join();
  EXPECT_EQ(group->divergence(), "");
  ASSERT_EQ(trees[0].size(), trees[1].size());
  for (std::size_t i = 0; i < trees[0].size(); ++i) {
    ASSERT_EQ(trees[0][i], trees[1][i]) << "the trees differ after request " << i;
  }
  EXPECT_EQ(refused[0], refused[1]);
  EXPECT_GT(refused[0], 0) << "the agreed (cheapest) recompute refused nothing";
  EXPECT_EQ(loaded[0], loaded[1]);
}

// Under TP a prefetch's pages serve a request once every rank has them: confirmation counts
// from the last rank's landing (hicache_prefetch_confirm_steps, at most 1 on every rank), and
// the steps a rank's landed pages waited for the others' are the ranks' skew
// (hicache_prefetch_rank_wait_steps). Rank 1's reads wait at a gate that opens 4 steps after
// rank 0's pages landed.
TEST(HiRadixCacheTp, APrefetchIsConfirmedAtTheFirstStepAfterTheLastRanksPagesLanded) {
  TpGroups groups;
  const auto a = seq({1, 2, 3, 4});
  std::vector<std::unique_ptr<L3>> l3;
  for (int r = 0; r < 2; ++r) {
    l3.push_back(std::make_unique<L3>(str_cat("tp-confirm-", r)));
    ASSERT_EQ(store_in_l3(*l3.back(), a), 4 * kPage);
  }
  // Rank 0's reads say when they returned; rank 1's wait at the gate.
  class Announcing final : public Forwarding {
   public:
    using Forwarding::Forwarding;
    std::atomic<bool> returned{false};

   protected:
    std::vector<IoResult> do_batch_get(std::span<const std::string> keys,
                                       std::span<const ByteSpan> dst) override {
      auto out = inner_.batch_get(keys, dst);
      returned = true;
      return out;
    }
  };
  Announcing announcing(l3[0]->file);
  SlowReads gated(l3[1]->file, std::chrono::milliseconds(0), 0);
  l3[0]->store = &announcing;
  l3[1]->store = &gated;
  std::vector<MetricsRegistry> registries(2);
  std::vector<std::pair<std::uint64_t, double>> confirm(2), wait(2);
  std::vector<std::string> trees(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    groups.wire(*l3[static_cast<std::size_t>(r)], r);
    ranks.emplace_back([&, r] {
      Engine e(WritePolicy::kWriteThrough, 32, 64, {}, l3[static_cast<std::size_t>(r)].get(),
               {.policy = PrefetchPolicy::kWaitComplete}, groups.tp[static_cast<std::size_t>(r)].get());
      MetricsRegistry& registry = registries[static_cast<std::size_t>(r)];
      e.cache.register_metrics(registry);
      ASSERT_TRUE(e.cache.prefetch_from_storage("p", e.cache.match_prefix(a).last_host_node, a));
      int since_rank0 = -1;
      while (!e.cache.check_prefetch_progress("p")) {
        e.cache.check_events();
        if (r == 1 && since_rank0 < 0 && announcing.returned) {
          // Rank 0's read returned; its prefetch thread marks the pages landed just after. This
          // rank's pause holds both ranks' steps (the next check_events is a collective), not
          // that thread: a test's wait, so that rank 0 has landed before the 4 steps count.
          std::this_thread::sleep_for(std::chrono::milliseconds(200));
          since_rank0 = 0;
        } else if (r == 1 && since_rank0 >= 0 && since_rank0 < 4 && ++since_rank0 == 4) {
          gated.gate.open();
        }
      }
      EXPECT_EQ(e.cache.stats().prefetched_tokens, 4 * kPage) << "rank " << r;
      const auto all = nlohmann::json::parse(registry.json_text());
      const auto histogram = [&](const char* name) {
        const auto& series = all.at(name).at("series").at(0);
        return std::pair{series.at("count").get<std::uint64_t>(), series.at("sum").get<double>()};
      };
      confirm[static_cast<std::size_t>(r)] = histogram("hicache_prefetch_confirm_steps");
      wait[static_cast<std::size_t>(r)] = histogram("hicache_prefetch_rank_wait_steps");
      e.settle();
      trees[static_cast<std::size_t>(r)] = e.cache.describe();
      EXPECT_EQ(e.cache.stats().tp_failures, 0);
      e.expect_accounting();
    });
  }
  for (auto& t : ranks) t.join();
  groups.expect_in_step();
  EXPECT_EQ(trees[0], trees[1]);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(confirm[static_cast<std::size_t>(r)].first, 1u) << "rank " << r;
    EXPECT_LE(confirm[static_cast<std::size_t>(r)].second, 1.0)
        << "rank " << r << " counted from its own landing, not the last rank's";
    EXPECT_EQ(wait[static_cast<std::size_t>(r)].first, 1u) << "rank " << r;
  }
  EXPECT_GE(wait[0].second, 3.0) << "rank 0's pages waited for rank 1's";
  EXPECT_EQ(wait[1].second, 0.0) << "rank 1 landed last";
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

}  // namespace
}  // namespace hicache
