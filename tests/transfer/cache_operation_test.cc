#include "transfer/cache_operation.h"

#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <numeric>

#include "transfer/errors.h"
#include "transfer/op_queue.h"

namespace hicache {
namespace {

std::vector<std::int64_t> iota_slots(std::int64_t first, std::int64_t n) {
  std::vector<std::int64_t> v(n);
  std::iota(v.begin(), v.end(), first);
  return v;
}

TEST(CacheOperation, NoAcknowledgementIsExplicit) {
  auto silent = CacheOperation::make(iota_slots(0, 4), iota_slots(8, 4), 1, std::nullopt);
  EXPECT_FALSE(silent.needs_ack());
  auto node0 = CacheOperation::make(iota_slots(0, 4), iota_slots(8, 4), 1, NodeId{0});
  EXPECT_TRUE(node0.needs_ack()) << "node 0 is a valid node, not 'none'";
  EXPECT_EQ(node0.node_ids, std::vector<NodeId>{0});
  EXPECT_THROW(CacheOperation::make(iota_slots(0, 4), iota_slots(0, 8), 0, 1), InvalidArgument);
  EXPECT_THROW(CacheOperation::make({}, {}, 0, 1), InvalidArgument);
}

TEST(CacheOperation, MergeConcatenatesAndTakesTheLowerPriority) {
  auto a = CacheOperation::make(iota_slots(0, 4), iota_slots(100, 4), 5, NodeId{1});
  auto b = CacheOperation::make(iota_slots(40, 4), iota_slots(200, 4), 2, NodeId{2});
  a.merge(std::move(b));
  EXPECT_EQ(a.priority, 2);
  EXPECT_EQ(a.host_slots, (std::vector<std::int64_t>{0, 1, 2, 3, 40, 41, 42, 43}));
  EXPECT_EQ(a.device_slots, (std::vector<std::int64_t>{100, 101, 102, 103, 200, 201, 202, 203}));
  EXPECT_EQ(a.node_ids, (std::vector<NodeId>{1, 2}));
}

struct Item {
  std::int64_t priority;
  int tag;
};

TEST(OpQueue, LowerPriorityFirstThenFifo) {
  OpQueue<Item> q(16);
  const Item items[] = {{5, 0}, {1, 1}, {5, 2}, {1, 3}, {0, 4}, {5, 5}};
  for (Item it : items) ASSERT_EQ(q.push(std::move(it)), PushResult::kOk);
  std::vector<int> order;
  while (auto it = q.try_pop()) order.push_back(it->tag);
  EXPECT_EQ(order, (std::vector<int>{4, 1, 3, 0, 2, 5}));
}

TEST(OpQueue, AFullQueuePushesBackAndKeepsTheOp) {
  OpQueue<CacheOperation> q(2);
  for (int i = 0; i < 2; ++i) {
    ASSERT_EQ(q.push(CacheOperation::make(iota_slots(0, 4), iota_slots(0, 4), i, i)),
              PushResult::kOk);
  }
  auto extra = CacheOperation::make(iota_slots(0, 4), iota_slots(0, 4), 0, NodeId{7});
  EXPECT_EQ(q.push(std::move(extra)), PushResult::kFull);
  EXPECT_EQ(extra.host_slots.size(), 4u) << "a refused op must be left to the caller intact";
  EXPECT_EQ(q.size(), 2u);
}

TEST(OpQueue, AWaitingConsumerWakesOnWorkAndOnStop) {
  OpQueue<Item> q(4);
  auto consumer = std::async(std::launch::async, [&] { return q.pop(); });
  EXPECT_EQ(consumer.wait_for(std::chrono::milliseconds(20)), std::future_status::timeout);
  q.push(Item{3, 42});
  auto got = consumer.get();
  ASSERT_TRUE(got);
  EXPECT_EQ(got->tag, 42);
  auto stopped = std::async(std::launch::async, [&] { return q.pop(); });
  q.stop();
  EXPECT_FALSE(stopped.get());
  EXPECT_EQ(q.push(Item{0, 1}), PushResult::kStopped);
  q.reset();
  EXPECT_EQ(q.push(Item{0, 1}), PushResult::kOk);
  EXPECT_EQ(q.drain().size(), 1u);
  EXPECT_EQ(q.size(), 0u);
}

// pop_spinning: work pushed while the consumer looks, or after it fell asleep, is taken in
// priority order; stop ends it in either phase.
TEST(OpQueue, ASpinningConsumerTakesWorkInEitherPhaseAndStops) {
  OpQueue<Item> q(4);
  q.push(Item{2, 1});
  q.push(Item{1, 2});
  auto first = q.pop_spinning(std::chrono::milliseconds(50));
  ASSERT_TRUE(first);
  EXPECT_EQ(first->tag, 2) << "lower priority first";
  auto asleep = std::async(std::launch::async,
                           [&] { return q.pop_spinning(std::chrono::microseconds(1)); });
  auto second = asleep.get();  // queued already
  ASSERT_TRUE(second);
  EXPECT_EQ(second->tag, 1);
  auto waiter = std::async(std::launch::async,
                           [&] { return q.pop_spinning(std::chrono::microseconds(100)); });
  EXPECT_EQ(waiter.wait_for(std::chrono::milliseconds(20)), std::future_status::timeout)
      << "past its spin it blocks";
  q.push(Item{0, 3});
  auto third = waiter.get();
  ASSERT_TRUE(third);
  EXPECT_EQ(third->tag, 3);
  auto spinning = std::async(std::launch::async,
                             [&] { return q.pop_spinning(std::chrono::seconds(30)); });
  q.stop();
  EXPECT_EQ(spinning.wait_for(std::chrono::seconds(5)), std::future_status::ready)
      << "stop ends the spin at once";
  EXPECT_FALSE(spinning.get());
}

}  // namespace
}  // namespace hicache
