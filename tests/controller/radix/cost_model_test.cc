// radix::LinkEstimate, PrefillEstimate and CostRule on their own: a link's latency and
// bandwidth fit from cumulative counters, the engine's cost per token from its reports, and the
// rule's decision with and without a queue ahead.
#include "controller/radix/cost_model.h"

#include <gtest/gtest.h>

namespace hicache::radix {
namespace {

constexpr double kMiB = 1024.0 * 1024.0;

// A link of 2 ms per call and 100 MiB/s, driven through cumulative counters as the controllers
// keep them: calls of 1, 16 and 4 MiB in turn, one to three per step.
TEST(LinkEstimate, FitsLatencyAndBandwidthFromCumulativeCounters) {
  LinkEstimate link;
  EXPECT_FALSE(link.measured());
  EXPECT_EQ(link.bytes_per_second(), 0);
  double ops = 0, bytes = 0, seconds = 0;
  const double sizes_mib[] = {1, 16, 4};
  for (int step = 0; step < 60; ++step) {
    const int calls = 1 + step % 3;
    for (int c = 0; c < calls; ++c) {
      const double mib = sizes_mib[(step + c) % 3];
      ops += 1;
      bytes += mib * kMiB;
      seconds += 0.002 + mib / 100.0;
    }
    link.sample(ops, bytes, seconds);
  }
  ASSERT_TRUE(link.measured());
  EXPECT_NEAR(link.latency_seconds(), 0.002, 1e-4);
  EXPECT_NEAR(link.bytes_per_second(), 100 * kMiB, 1 * kMiB);
  EXPECT_NEAR(link.seconds(2, 8 * kMiB), 2 * 0.002 + 0.08, 1e-3);
  // A step with no new call is no sample.
  const std::int64_t samples = link.samples();
  link.sample(ops, bytes, seconds);
  EXPECT_EQ(link.samples(), samples);
  // Counters that went back (a new store) start over: the next sample is theirs alone.
  link.sample(1, 1 * kMiB, 0.5);
  EXPECT_EQ(link.samples(), samples + 1);
  EXPECT_GT(link.seconds(1, 1 * kMiB), 0.0125);  // the slow sample pulled the estimate up
  link.reset();
  EXPECT_FALSE(link.measured());
  EXPECT_EQ(link.latency_seconds(), 0);
}

// A link that slows down (a store under load): the estimate follows within a few dozen steps.
TEST(LinkEstimate, FollowsALinkThatSlowsDown) {
  LinkEstimate link;
  double ops = 0, bytes = 0, seconds = 0;
  auto run = [&](double mib_per_s, int steps) {
    for (int i = 0; i < steps; ++i) {
      const double mib = 1 + i % 8;
      ops += 1;
      bytes += mib * kMiB;
      seconds += 0.001 + mib / mib_per_s;
      link.sample(ops, bytes, seconds);
    }
  };
  run(1000, 100);
  EXPECT_NEAR(link.bytes_per_second() / kMiB, 1000, 50);
  run(50, 150);
  EXPECT_NEAR(link.bytes_per_second() / kMiB, 50, 5);
}

TEST(PrefillEstimate, ThePriorIsRefinedByReports) {
  PrefillEstimate none(std::nullopt);
  EXPECT_FALSE(none.measured());
  none.report(0, 1.0);  // no tokens: nothing said of the cost per token
  EXPECT_FALSE(none.measured());
  none.report(1000, 0.05);
  EXPECT_DOUBLE_EQ(none.seconds_per_token(), 5e-5);

  PrefillEstimate prior(1e-4);
  EXPECT_TRUE(prior.measured());
  EXPECT_DOUBLE_EQ(prior.seconds_per_token(), 1e-4);
  for (int i = 0; i < 100; ++i) prior.report(512, 512 * 2e-5);
  EXPECT_NEAR(prior.seconds_per_token(), 2e-5, 1e-7);  // the reports win over the prior
}

TEST(RadixCostRule, OnByDefaultOffOnlyWhenSetToZero) {
  EXPECT_TRUE(CostRule(std::nullopt, 1000).on());
  EXPECT_FALSE(CostRule(0.0, 1000).on());
  CostRule with_prior(3e-6, 1000);
  EXPECT_TRUE(with_prior.on());
  EXPECT_EQ(with_prior.local()[4], 3'000'000'000);  // femtoseconds per token
  CostRule measured(std::nullopt, 1000);
  EXPECT_EQ(measured.local(), CostRule::kNothingMeasured);
  measured.report_prefill(100, 1e-3);
  EXPECT_EQ(measured.local()[4], 10'000'000'000);
  // L3 reads not measured yet: its writes' estimate stands for them.
  measured.sample(CostRule::Link::kL3Write, 1, kMiB, 0.5);
  const CostRule::Values by_writes = measured.local();
  EXPECT_NE(by_writes[2], CostRule::kUnmeasured);
  EXPECT_LT(by_writes[2], 8 * kMiB);  // a slow store: 0.5 s for a call of 1 MiB
  EXPECT_FALSE(CostRule::l3_reads_measured(by_writes));
  measured.sample(CostRule::Link::kL3Read, 1, kMiB, 0.011);
  const CostRule::Values v = measured.local();
  EXPECT_TRUE(CostRule::l3_reads_measured(v));
  EXPECT_GT(v[2], 50 * kMiB);  // the reads' own, once measured
  EXPECT_LE(v[3], 0);  // latency, negated
}

TEST(RadixCostRule, MovesOnlyWhenNoSlowerThanRecomputingTheWaitIncluded) {
  CostRule rule(std::nullopt, 1'000);  // 1 kB per token to move
  // 1 us per token to recompute; loads at 2 GB/s (0.5 us per token), L3 at 0.5 GB/s (2 us).
  const CostRule::Values v = {2'000'000'000, 0, 500'000'000, 0, 1'000'000'000};
  EXPECT_TRUE(rule.moving_pays(CostRule::Move::kLoad, v, 100));
  EXPECT_DOUBLE_EQ(rule.inputs().measured_load_gbps, 2.0);
  EXPECT_FALSE(rule.moving_pays(CostRule::Move::kPrefetch, v, 100));
  EXPECT_DOUBLE_EQ(rule.inputs().measured_prefetch_gbps, 0.5);
  EXPECT_DOUBLE_EQ(rule.inputs().last_prefetch_estimate_s, 100 * 1'000 / 5e8);
  EXPECT_DOUBLE_EQ(rule.inputs().last_recompute_estimate_s, 100 * 1e-6);
  // A load that pays alone does not behind 200 tokens queued ahead (300 tokens' bytes in 150 us
  // against 100 us of recompute), nor with a latency of 20 us per call for 3 calls.
  EXPECT_FALSE(rule.moving_pays(CostRule::Move::kLoad, v, 100, 0, 1, 200, 1));
  CostRule::Values slow_calls = v;
  slow_calls[1] = -20'000;  // ns, negated
  EXPECT_TRUE(rule.moving_pays(CostRule::Move::kLoad, slow_calls, 100, 0, 1));  // 70 us
  EXPECT_FALSE(rule.moving_pays(CostRule::Move::kLoad, slow_calls, 100, 0, 3));  // 110 us
  // Bytes that move with the tokens count too (a hybrid model's state).
  EXPECT_FALSE(rule.moving_pays(CostRule::Move::kLoad, v, 100, 200'000));
  // Unmeasured link or recompute cost: the move measures it.
  CostRule::Values no_l3 = v;
  no_l3[2] = CostRule::kUnmeasured;
  EXPECT_TRUE(rule.moving_pays(CostRule::Move::kPrefetch, no_l3, 100));
  CostRule::Values no_recompute = v;
  no_recompute[4] = CostRule::kUnmeasured;
  EXPECT_TRUE(rule.moving_pays(CostRule::Move::kPrefetch, no_recompute, 100));
  EXPECT_EQ(CostRule::recompute_seconds(no_recompute, 100), std::nullopt);
  EXPECT_DOUBLE_EQ(*CostRule::recompute_seconds(v, 100), 1e-4);
}

}  // namespace
}  // namespace hicache::radix
