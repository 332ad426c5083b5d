// radix::Agreement on its own: two ranks as threads agree on what arrived on both, with the
// worst outcome, and on the cautious view of the cost estimates; a step keeps within one call's
// values; one rank needs no collective.
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
  // Rank 0: load link 5000 B/s, 1 us per call, L3 unmeasured, recompute 7 fs per token; rank 1:
  // 3000 B/s, 4 us, L3 at 9 B/s and 2 us, recompute not reported.
  const std::vector<CostRule::Values> local = {
      {5'000, -1'000, CostRule::kUnmeasured, 0, 7, 0},
      {3'000, -4'000, 9, -2'000, CostRule::kUnmeasured, 1}};
  std::vector<CostRule::Values> agreed(2);
  auto rank = [&](int r) {
    const auto i = static_cast<std::size_t>(r);
    Agreement agreement(tp[i].get());
    ASSERT_TRUE(agreement.agreeing());
    EXPECT_EQ(agreement.costs(local[i]), CostRule::kNothingMeasured);  // before a reduction
    const Agreement::Step* step = agreement.reduce(pending[i], arrived[i], nullptr, 4, local[i]);
    ASSERT_NE(step, nullptr);
    steps[i] = *step;
    agreed[i] = agreement.costs(local[i]);
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
    // The cautious view: the slowest link, the longest latency, what was measured anywhere.
    // L3 reads count as measured only when measured on every rank.
    EXPECT_EQ(agreed[r], (CostRule::Values{3'000, -4'000, 9, -2'000, 7, 0})) << "rank " << r;
    EXPECT_TRUE(arrived[r].loads.empty());
  }
  EXPECT_EQ(steps[0].writes[0].local, ArrivedAcks::kOk);
  EXPECT_EQ(steps[1].writes[0].local, ArrivedAcks::kFailed);
  // What arrived on one rank only waits for the next step.
  EXPECT_EQ(arrived[0].writes.count(2), 1u);
  EXPECT_EQ(arrived[1].writes.count(3), 1u);
  EXPECT_EQ(arrived[0].writes.count(1), 0u);
}

// A Gloo call carries at most 62 values: a step with more ops pending than fit agrees on the
// oldest of each kind in turn, and the rest at the next steps; the collective never fails
// (the in-process group refuses a longer call, as Gloo does).
TEST(RadixAgreement, AStepWithMoreOpsThanOneCallCarriesTakesTheOldestOfEachKindInTurn) {
  std::shared_ptr<InProcessGroup> group;
  auto tp = InProcessGroup::make_ranks(2, std::chrono::seconds(30), &group);
  std::vector<PendingOps> pending(2);
  std::vector<ArrivedAcks> arrived(2);
  for (std::size_t r = 0; r < 2; ++r) {
    for (NodeId id = 1; id <= 100; ++id) {
      pending[r].writes[id] = PendingOps::Op{};
      arrived[r].writes[id] = ArrivedAcks::kOk;
    }
    for (NodeId id = 1000; id < 1010; ++id) {
      pending[r].backups[id] = PendingOps::Op{};
      arrived[r].backups[id] = 1;
    }
  }
  std::vector<std::vector<std::size_t>> applied(2);  // writes, then backups, per step
  std::vector<NodeId> first_write(2), last_write(2);
  auto rank = [&](int r) {
    const auto i = static_cast<std::size_t>(r);
    Agreement agreement(tp[i].get());
    for (int step = 0; step < 2; ++step) {
      const Agreement::Step* s =
          agreement.reduce(pending[i], arrived[i], nullptr, 4, CostRule::kNothingMeasured);
      ASSERT_NE(s, nullptr) << "step " << step;
      applied[i].push_back(s->writes.size());
      applied[i].push_back(s->backups.size());
      if (step == 0) {
        first_write[i] = s->writes.front().id;
        last_write[i] = s->writes.back().id;
      }
      for (const auto& a : s->writes) pending[i].writes.erase(a.id);
      for (const auto& a : s->backups) pending[i].backups.erase(a.id);
    }
  };
  std::thread other(rank, 1);
  rank(0);
  other.join();
  EXPECT_EQ(group->divergence(), "");
  for (std::size_t r = 0; r < 2; ++r) {
    // 62 values less the 6 estimates: 56 acks, all 10 backups and 46 writes; then the other 54.
    EXPECT_EQ(applied[r], (std::vector<std::size_t>{46, 10, 54, 0})) << "rank " << r;
    EXPECT_EQ(first_write[r], 1);  // the oldest first
    EXPECT_EQ(last_write[r], 46);
    EXPECT_TRUE(arrived[r].writes.empty());
  }
}

TEST(RadixAgreement, WithoutRanksEveryAnswerIsLocal) {
  Agreement agreement(nullptr);
  EXPECT_FALSE(agreement.agreeing());
  EXPECT_FALSE(agreement.lockstep());
  bool failed = false;
  EXPECT_TRUE(agreement.on_every_rank(true, "t", &failed));
  EXPECT_FALSE(agreement.on_every_rank(false, "t", &failed));
  EXPECT_FALSE(failed);
  const CostRule::Values local = {123, -4, 5, -6, 7, 1};
  EXPECT_EQ(agreement.costs(local), local);
}

}  // namespace
}  // namespace hicache::radix
