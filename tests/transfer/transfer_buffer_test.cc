#include "transfer/transfer_buffer.h"

#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <thread>

namespace hicache {
namespace {

TEST(TransferBuffer, FifoWithinCapacity) {
  TransferBuffer<int> b(3);
  EXPECT_EQ(b.capacity(), 3u);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(b.put(int{i}));
  EXPECT_EQ(b.size(), 3u);
  int extra = 9;
  EXPECT_FALSE(b.try_put(std::move(extra))) << "try_put on a full buffer";
  EXPECT_EQ(b.size(), 3u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(b.get(), i);
  EXPECT_FALSE(b.try_get());
  EXPECT_TRUE(b.try_put(int{4}));
  EXPECT_EQ(b.get(), 4);
  b.stop();
  EXPECT_FALSE(b.try_put(int{5}));
  EXPECT_THROW(TransferBuffer<int>(0), InvalidArgument);
}

// A producer that finds the buffer full waits for the consumer (it cannot finish before the
// first get), then every item arrives once, in order.
TEST(TransferBuffer, AFullBufferHoldsTheProducerUntilTheConsumerTakes) {
  TransferBuffer<int> b(2);
  std::atomic<bool> done{false};
  std::thread producer([&] {
    for (int i = 0; i < 5; ++i) ASSERT_TRUE(b.put(int{i}));
    done = true;
  });
  while (b.size() < 2) std::this_thread::yield();
  EXPECT_FALSE(done.load()) << "put returned with the buffer full";
  for (int i = 0; i < 5; ++i) EXPECT_EQ(b.get(), i);
  producer.join();
  EXPECT_TRUE(done.load());
  EXPECT_EQ(b.size(), 0u);
}

TEST(TransferBuffer, StopWakesABlockedProducerAndConsumer) {
  TransferBuffer<std::unique_ptr<int>> full(1);
  ASSERT_TRUE(full.put(std::make_unique<int>(1)));
  auto item = std::make_unique<int>(2);
  std::atomic<int> put_result{-1};
  std::thread producer([&] { put_result = full.put(std::move(item)) ? 1 : 0; });
  TransferBuffer<int> empty(1);
  std::optional<int> got = 7;
  std::thread consumer([&] { got = empty.get(); });
  full.stop();
  empty.stop();
  producer.join();
  consumer.join();
  EXPECT_EQ(put_result.load(), 0);
  ASSERT_TRUE(item) << "a refused put moved the item away";
  EXPECT_EQ(*item, 2);
  EXPECT_FALSE(got.has_value());
  EXPECT_FALSE(full.get());
  EXPECT_FALSE(full.try_get());
  // What was left is drained, then the buffer works again; reset with items left is refused.
  EXPECT_THROW(full.reset(), StateError);
  auto left = full.drain();
  ASSERT_EQ(left.size(), 1u);
  EXPECT_EQ(*left[0], 1);
  full.reset();
  EXPECT_TRUE(full.put(std::make_unique<int>(3)));
  EXPECT_EQ(*full.get().value(), 3);
}

}  // namespace
}  // namespace hicache
