#include "transfer/layer_done_counter.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <deque>
#include <future>
#include <thread>

#include "transfer/errors.h"
#include "transfer/host_device.h"

namespace hicache {
namespace {

// Hands slots from the consumer (the main loop's start_loading) to the producer (load thread).
class SlotQueue {
 public:
  void push(std::int32_t v) {
    {
      std::lock_guard lock(mu_);
      q_.push_back(v);
    }
    cv_.notify_one();
  }
  std::int32_t pop() {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return !q_.empty(); });
    const std::int32_t v = q_.front();
    q_.pop_front();
    return v;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::int32_t> q_;
};

// The producer writes every word of a layer before marking it; the consumer checks every word
// as soon as wait_until returns. Two batches are always in flight (overlap mode), so all slots
// rotate; a stale or early count shows up as a wrong word (and as a race under TSan).
TEST(LayerDoneCounter, ConsumerNeverSeesAPartialLayer) {
  constexpr std::int32_t kLayers = 8, kSlots = 3, kBatches = 400, kWords = 2048;
  LayerDoneCounter counter(kLayers, kSlots);
  std::vector<std::vector<std::uint64_t>> memory(kSlots * kLayers,
                                                 std::vector<std::uint64_t>(kWords, 0));
  SlotQueue to_producer;
  std::thread producer([&] {
    for (std::int32_t b = 0; b < kBatches; ++b) {
      const std::int32_t slot = to_producer.pop();
      for (std::int32_t layer = 0; layer < kLayers; ++layer) {
        auto& words = memory[slot * kLayers + layer];
        for (auto& w : words) w = static_cast<std::uint64_t>(b) * 1000 + layer;
        counter.mark_layer_done(slot, layer);
      }
      counter.release(slot);
    }
  });
  std::deque<std::pair<std::int32_t, std::int32_t>> in_flight;  // (batch, slot)
  std::int64_t checked = 0;
  auto consume_oldest = [&] {
    auto [b, slot] = in_flight.front();
    in_flight.pop_front();
    for (std::int32_t layer = 0; layer < kLayers; ++layer) {
      ASSERT_TRUE(counter.wait_until(slot, layer));
      for (std::uint64_t w : memory[slot * kLayers + layer]) {
        ASSERT_EQ(w, static_cast<std::uint64_t>(b) * 1000 + layer) << "batch " << b;
      }
      ++checked;
    }
    counter.release(slot);
  };
  for (std::int32_t b = 0; b < kBatches; ++b) {
    const std::int32_t slot = counter.acquire();
    ASSERT_GE(slot, 0);
    in_flight.emplace_back(b, slot);
    to_producer.push(slot);
    if (in_flight.size() == 2) consume_oldest();
  }
  while (!in_flight.empty()) consume_oldest();
  producer.join();
  EXPECT_EQ(checked, std::int64_t{kBatches} * kLayers);
  EXPECT_EQ(counter.busy_slots(), 0);
}

TEST(LayerDoneCounter, AReusedSlotStartsAtZero) {
  LayerDoneCounter counter(4, 1);
  std::int32_t slot = counter.acquire();
  for (std::int32_t l = 0; l < 4; ++l) counter.mark_layer_done(slot, l);
  EXPECT_TRUE(counter.is_done(slot, 3));
  counter.release(slot);
  counter.release(slot);
  slot = counter.acquire();
  EXPECT_EQ(slot, 0);
  EXPECT_FALSE(counter.is_done(slot, 0)) << "the previous batch's count leaked into this one";
  counter.mark_layer_done(slot, 0);
  EXPECT_TRUE(counter.is_done(slot, 0));
  EXPECT_FALSE(counter.is_done(slot, 1));
}

TEST(LayerDoneCounter, AProducerWaitsForAFreeSlotInsteadOfFailing) {
  LayerDoneCounter counter(2, 2);
  const std::int32_t a = counter.acquire();
  const std::int32_t b = counter.acquire();
  EXPECT_NE(a, b);
  auto third = std::async(std::launch::async, [&] { return counter.acquire(); });
  EXPECT_EQ(third.wait_for(std::chrono::milliseconds(30)), std::future_status::timeout);
  counter.release(a);  // the producer's release alone does not free the slot
  EXPECT_EQ(third.wait_for(std::chrono::milliseconds(30)), std::future_status::timeout);
  counter.release(a);
  EXPECT_EQ(third.get(), a);
  EXPECT_EQ(counter.busy_slots(), 2);
}

TEST(LayerDoneCounter, FailureWakesTheConsumerWithFalse) {
  LayerDoneCounter counter(3, 2);
  const std::int32_t slot = counter.acquire();
  counter.mark_layer_done(slot, 0);
  auto waiter = std::async(std::launch::async, [&] { return counter.wait_until(slot, 2); });
  counter.fail(slot);
  EXPECT_FALSE(waiter.get());
  EXPECT_TRUE(counter.wait_until(slot, 0));  // layers done before the failure stay done
}

TEST(LayerDoneCounter, StopWakesEveryWaiter) {
  LayerDoneCounter counter(3, 1);
  const std::int32_t slot = counter.acquire();
  auto consumer = std::async(std::launch::async, [&] { return counter.wait_until(slot, 0); });
  auto producer = std::async(std::launch::async, [&] { return counter.acquire(); });
  counter.stop();
  EXPECT_FALSE(consumer.get());
  EXPECT_EQ(producer.get(), -1);
  counter.reset();
  EXPECT_EQ(counter.busy_slots(), 0);
  EXPECT_EQ(counter.acquire(), 0);
}

TEST(LayerDoneCounter, IllegalUseRaisesAndChangesNothing) {
  EXPECT_THROW(LayerDoneCounter(0, 3), InvalidArgument);
  EXPECT_THROW(LayerDoneCounter(4, 0), InvalidArgument);
  LayerDoneCounter counter(4, 2);
  EXPECT_THROW(counter.mark_layer_done(0, 0), StateError);  // slot not claimed
  const std::int32_t slot = counter.acquire();
  EXPECT_THROW(counter.mark_layer_done(slot, 1), StateError);  // layer 0 first
  counter.mark_layer_done(slot, 0);
  EXPECT_THROW(counter.mark_layer_done(slot, 0), StateError);  // twice
  EXPECT_TRUE(counter.is_done(slot, 0));
  EXPECT_FALSE(counter.is_done(slot, 1));
  EXPECT_THROW(counter.wait_until(slot, 4), InvalidArgument);
  EXPECT_THROW(counter.wait_until(2, 0), InvalidArgument);
  EXPECT_THROW(counter.release(-1), InvalidArgument);
  counter.release(slot);
  counter.release(slot);
  EXPECT_THROW(counter.release(slot), StateError);
  EXPECT_EQ(counter.layer_event(0, 0), nullptr);
}

TEST(LayerDoneCounter, WithADeviceEachSlotAndLayerHasAnEvent) {
  HostDevice device;
  LayerDoneCounter counter(3, 2, &device);
  EXPECT_NE(counter.layer_event(1, 2), nullptr);
  EXPECT_NE(counter.layer_event(0, 0), counter.layer_event(1, 0));
  EXPECT_THROW(counter.layer_event(0, 3), InvalidArgument);
}

// The controller's producer only records an event after each layer's copy: a layer is done once
// that event completed, and not a moment earlier (the stream is held at a gate meanwhile).
TEST(LayerDoneCounter, WithADeviceALayerIsDoneWhenItsEventCompletes) {
  HostDevice device;
  LayerDoneCounter counter(2, 1, &device);
  auto stream = device.create_stream();
  Buffer src = device.alloc_host(64), dst = device.alloc_device(64);
  std::memset(src.data(), 0x5A, src.size());
  std::promise<void> open;
  std::shared_future<void> gate = open.get_future().share();
  const std::int32_t slot = counter.acquire();
  ASSERT_GE(slot, 0);
  stream->launch_host_func([gate] { gate.wait(); });
  stream->copy_async(dst.data(), src.data(), 64);
  stream->record(*counter.layer_event(slot, 0));
  counter.mark_layer_enqueued(slot, 0);
  EXPECT_FALSE(counter.is_done(slot, 0)) << "the copy is held at the gate";
  auto waiter = std::async(std::launch::async, [&] {
    const bool done = counter.wait_until(slot, 0);
    // What the consumer reads once told the layer is done.
    return done && std::memcmp(dst.data(), src.data(), 64) == 0;
  });
  EXPECT_EQ(waiter.wait_for(std::chrono::milliseconds(50)), std::future_status::timeout)
      << "done before its copy ran";
  open.set_value();
  EXPECT_TRUE(waiter.get()) << "done, but the layer's bytes were not there";
  EXPECT_TRUE(counter.is_done(slot, 0));
  EXPECT_FALSE(counter.is_done(slot, 1)) << "never enqueued";
  EXPECT_THROW(counter.is_done(slot, 2), InvalidArgument);
  counter.fail(slot);
  EXPECT_FALSE(counter.wait_until(slot, 1)) << "a failed batch's missing layer";
  counter.release(slot);
  counter.release(slot);
  stream->synchronize();
}

}  // namespace
}  // namespace hicache
