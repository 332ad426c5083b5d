// radix::Agreement and CostRule on their own: two ranks as threads agree on what arrived on
// both, with the worst outcome, and on the slowest bandwidth; one rank needs no collective;
// the cost rule moves KV only when that is no slower than recomputing it.
#include "controller/radix/agreement.h"

#include <gtest/gtest.h>

#include <thread>

namespace hicache::radix {
namespace {

TEST(RadixAgreement, OnlyAcksThatArrivedOnEveryRankAreAppliedWithTheWorstOutcome) {
  std::shared_ptr<InProcessGroup> group;
  auto tp = InProcessGroup::make_ranks(2, std::chrono::seconds(30), &group);
  // Both ranks run the same ops: writes 1, 2, 3 and load 10.
  std::vector<PendingOps> pending(2);
  for (PendingOps& p : pending) {
    for (NodeId id : {1, 2, 3}) p.writes[id] = PendingOps::Op{};
    p.loads[10] = PendingOps::Op{};
  }
  std::vector<ArrivedAcks> arrived(2);
  arrived[0].writes = {{1, ArrivedAcks::kOk}, {2, ArrivedAcks::kOk}};
  arrived[0].loads = {{10, ArrivedAcks::kOk}};
  arrived[1].writes = {{1, ArrivedAcks::kFailed}, {3, ArrivedAcks::kOk}};
  arrived[1].loads = {{10, ArrivedAcks::kOk}};
  std::vector<Agreement::Step> steps(2);
  std::vector<std::int64_t> load_bps(2);
  auto rank = [&](int r) {
    const auto i = static_cast<std::size_t>(r);
    Agreement agreement(tp[i].get());
    ASSERT_TRUE(agreement.agreeing());
    const Agreement::Step* step = agreement.reduce(pending[i], arrived[i], nullptr, 4,
                                                   r == 0 ? 5'000 : 3'000, CostRule::kUnmeasured);
    ASSERT_NE(step, nullptr);
    steps[i] = *step;
    load_bps[i] = agreement.load_bps(r == 0 ? 5'000 : 3'000);
  };
  std::thread other(rank, 1);
  rank(0);
  other.join();
  EXPECT_EQ(group->divergence(), "");
  for (std::size_t r = 0; r < 2; ++r) {
    ASSERT_EQ(steps[r].writes.size(), 1u) << "rank " << r;  // only write 1 arrived on both
    EXPECT_EQ(steps[r].writes[0].id, 1);
    EXPECT_EQ(steps[r].writes[0].agreed, ArrivedAcks::kFailed);  // the worst rank's
    ASSERT_EQ(steps[r].loads.size(), 1u);
    EXPECT_EQ(steps[r].loads[0].agreed, ArrivedAcks::kOk);
    EXPECT_EQ(load_bps[r], 3'000);  // the slowest rank's
    EXPECT_TRUE(arrived[r].loads.empty());
  }
  EXPECT_EQ(steps[0].writes[0].local, ArrivedAcks::kOk);
  EXPECT_EQ(steps[1].writes[0].local, ArrivedAcks::kFailed);
  // What arrived on one rank only waits for the next step.
  EXPECT_EQ(arrived[0].writes.count(2), 1u);
  EXPECT_EQ(arrived[1].writes.count(3), 1u);
  EXPECT_EQ(arrived[0].writes.count(1), 0u);
}

TEST(RadixAgreement, WithoutRanksEveryAnswerIsLocal) {
  Agreement agreement(nullptr);
  EXPECT_FALSE(agreement.agreeing());
  EXPECT_FALSE(agreement.lockstep());
  bool failed = false;
  EXPECT_TRUE(agreement.on_every_rank(true, "t", &failed));
  EXPECT_FALSE(agreement.on_every_rank(false, "t", &failed));
  EXPECT_FALSE(failed);
  EXPECT_EQ(agreement.load_bps(123), 123);
}

TEST(RadixCostRule, MovesOnlyWhenNoSlowerThanRecomputing) {
  CostRule rule(1e-6, 1'000);  // 1 us per token to recompute, 1 kB per token to move
  EXPECT_TRUE(rule.on());
  EXPECT_TRUE(rule.moving_pays(CostRule::Move::kLoad, 100, CostRule::kUnmeasured));
  EXPECT_EQ(rule.inputs().measured_load_gbps, 0);  // nothing recorded before a measurement
  EXPECT_TRUE(rule.moving_pays(CostRule::Move::kLoad, 100, 2'000'000'000));  // 0.5 us/token
  EXPECT_DOUBLE_EQ(rule.inputs().measured_load_gbps, 2.0);
  EXPECT_FALSE(rule.moving_pays(CostRule::Move::kPrefetch, 100, 500'000'000));  // 2 us/token
  EXPECT_DOUBLE_EQ(rule.inputs().measured_prefetch_gbps, 0.5);
  EXPECT_DOUBLE_EQ(rule.inputs().last_prefetch_estimate_s, 100 * 1'000 / 5e8);
  EXPECT_DOUBLE_EQ(rule.inputs().last_recompute_estimate_s, 100 * 1e-6);
  EXPECT_FALSE(CostRule(0, 1'000).on());
  EXPECT_EQ(CostRule::rate(0, 1), CostRule::kUnmeasured);
  EXPECT_EQ(CostRule::rate(10, 0), CostRule::kUnmeasured);
  EXPECT_EQ(CostRule::rate(10, 4), 2);
  EXPECT_EQ(CostRule::rate(1, 10), 1);  // at least 1
}

}  // namespace
}  // namespace hicache::radix
