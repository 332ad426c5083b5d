// HiRadixCache against a simple model on random operations (every eviction policy, colliding
// edge hashes), and random workloads under each write policy serving only correct bytes.
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
