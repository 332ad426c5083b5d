// HostDevice must keep CUDA's ordering rules exactly: these tests gate stream work on latches
// so that "not yet" is observed deterministically, never by sleeping.
#include "transfer/host_device.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <future>
#include <numeric>
#include <vector>

#include "transfer/errors.h"

namespace hicache {
namespace {

// A gate that stream work blocks on until the test opens it.
class Gate {
 public:
  void open() { promise_.set_value(); }
  std::function<void()> blocker() {
    auto f = future_;
    return [f] { f.wait(); };
  }

 private:
  std::promise<void> promise_;
  std::shared_future<void> future_ = promise_.get_future().share();
};

TEST(HostDevice, WorkOnOneStreamRunsInEnqueueOrder) {
  HostDevice device;
  auto stream = device.create_stream();
  std::vector<int> order;
  std::vector<int> src(1000), dst(1000, -1);
  std::iota(src.begin(), src.end(), 0);
  for (int i = 0; i < 1000; ++i) {
    stream->copy_async(&dst[i], &src[i], sizeof(int));
    // The function sees the copy enqueued just before it.
    stream->launch_host_func([&order, &dst, i] { order.push_back(dst[i] == i ? i : -1); });
  }
  stream->synchronize();
  std::vector<int> expected(1000);
  std::iota(expected.begin(), expected.end(), 0);
  EXPECT_EQ(order, expected);
}

TEST(HostDevice, EventCapturesExactlyTheWorkEnqueuedBeforeIt) {
  HostDevice device;
  auto stream = device.create_stream();
  auto e1 = device.create_event();
  auto e2 = device.create_event();
  Gate g1, g2;
  std::atomic<int> ran{0};
  stream->launch_host_func(g1.blocker());
  stream->launch_host_func([&] { ran = 1; });
  stream->record(*e1);
  stream->launch_host_func(g2.blocker());
  stream->launch_host_func([&] { ran = 2; });
  stream->record(*e2);
  EXPECT_FALSE(e1->query());
  EXPECT_FALSE(e2->query());
  g1.open();
  e1->synchronize();
  EXPECT_TRUE(e1->query());
  EXPECT_EQ(ran.load(), 1);
  EXPECT_FALSE(e2->query()) << "e2 completed before the work it captured";
  g2.open();
  e2->synchronize();
  EXPECT_EQ(ran.load(), 2);
}

// The worker wakes waiters only when it reaches the lowest point one of them waits for; a
// waiter for a later point sleeps on and must still be woken when its own point is reached,
// whichever of them started waiting first. A lost wake-up hangs here (CTest's timeout fails it).
TEST(HostDevice, WaitersForDifferentPointsEachWakeAtTheirOwn) {
  for (bool far_first : {true, false}) {
    HostDevice device;
    auto stream = device.create_stream();
    auto near = device.create_event();
    auto far = device.create_event();
    Gate g1, g2;
    std::atomic<int> ran{0};
    stream->launch_host_func(g1.blocker());
    stream->launch_host_func([&] { ran = 1; });
    stream->record(*near);
    stream->launch_host_func(g2.blocker());
    stream->launch_host_func([&] { ran = 2; });
    stream->record(*far);
    auto waiter = [&ran](Event& e) {
      return std::async(std::launch::async, [&ran, &e] {
        e.synchronize();
        return ran.load();
      });
    };
    std::future<int> far_done = far_first ? waiter(*far) : std::future<int>{};
    std::future<int> near_done = waiter(*near);
    std::future<void> sync_done = std::async(std::launch::async, [&] { stream->synchronize(); });
    if (!far_first) far_done = waiter(*far);
    g1.open();
    EXPECT_EQ(near_done.get(), 1) << "far_first=" << far_first;
    EXPECT_FALSE(far->query()) << "the far point passed before its gate opened";
    g2.open();
    EXPECT_EQ(far_done.get(), 2) << "far_first=" << far_first;
    sync_done.get();
  }
}

TEST(HostDevice, EventNeverRecordedIsComplete) {
  HostDevice device;
  auto e = device.create_event();
  EXPECT_TRUE(e->query());
  e->synchronize();
  auto stream = device.create_stream();
  stream->wait(*e);  // waiting on it orders nothing
  stream->synchronize();
}

TEST(HostDevice, ReRecordingMovesTheEventToTheNewPoint) {
  HostDevice device;
  auto stream = device.create_stream();
  auto e = device.create_event();
  stream->record(*e);
  EXPECT_TRUE(e->query());
  Gate g;
  stream->launch_host_func(g.blocker());
  stream->record(*e);
  EXPECT_FALSE(e->query());
  g.open();
  e->synchronize();
  EXPECT_TRUE(e->query());
}

TEST(HostDevice, StreamWaitOrdersLaterWorkAfterTheOtherStreamsEvent) {
  HostDevice device;
  auto producer = device.create_stream();
  auto consumer = device.create_stream();
  auto produced = device.create_event();
  auto consumed = device.create_event();
  std::vector<std::uint8_t> a(4096, 0), b(4096, 0);
  Gate g;
  producer->launch_host_func(g.blocker());
  producer->launch_host_func([&] { std::fill(a.begin(), a.end(), 7); });
  producer->record(*produced);
  consumer->wait(*produced);
  consumer->copy_async(b.data(), a.data(), a.size());
  consumer->record(*consumed);
  EXPECT_FALSE(consumed->query()) << "consumer ran ahead of the producer's event";
  g.open();
  consumer->synchronize();
  EXPECT_TRUE(produced->query());
  EXPECT_EQ(b, std::vector<std::uint8_t>(4096, 7));
}

TEST(HostDevice, WaitUsesTheRecordCurrentAtTheTimeOfTheCall) {
  HostDevice device;
  auto a = device.create_stream();
  auto b = device.create_stream();
  auto e = device.create_event();
  auto b_done = device.create_event();
  Gate g1, g2;
  a->launch_host_func(g1.blocker());
  a->record(*e);
  b->wait(*e);
  b->record(*b_done);
  a->launch_host_func(g2.blocker());
  a->record(*e);  // re-recorded after the wait: b must not wait for g2
  g1.open();
  b_done->synchronize();
  EXPECT_FALSE(e->query());
  g2.open();
  a->synchronize();
}

TEST(HostDevice, SynchronizeReportsAFailedHostFuncOnceAndTheStreamKeepsWorking) {
  HostDevice device;
  auto stream = device.create_stream();
  stream->launch_host_func([] { throw std::runtime_error("boom in stream work"); });
  int after = 0;
  stream->launch_host_func([&] { after = 1; });
  try {
    stream->synchronize();
    FAIL() << "no exception";
  } catch (const DeviceError& e) {
    EXPECT_NE(std::string(e.what()).find("boom in stream work"), std::string::npos);
  }
  EXPECT_EQ(after, 1) << "work after the failure did not run";
  EXPECT_NO_THROW(stream->synchronize());
}

TEST(HostDevice, DestroyingAStreamLetsItsQueuedWorkFinish) {
  HostDevice device;
  std::atomic<int> count{0};
  auto e = device.create_event();
  {
    auto stream = device.create_stream();
    for (int i = 0; i < 100; ++i) stream->launch_host_func([&] { ++count; });
    stream->record(*e);
  }
  EXPECT_EQ(count.load(), 100);
  EXPECT_TRUE(e->query());  // the event outlives its stream
}

TEST(HostDevice, DeviceSynchronizeWaitsForEveryStream) {
  HostDevice device;
  auto s1 = device.create_stream();
  auto s2 = device.create_stream();
  std::atomic<int> count{0};
  for (int i = 0; i < 50; ++i) {
    s1->launch_host_func([&] { ++count; });
    s2->launch_host_func([&] { ++count; });
  }
  device.synchronize();
  EXPECT_EQ(count.load(), 100);
}

TEST(HostDevice, CopiesMoveExactBytes) {
  HostDevice device;
  Buffer src = device.alloc_host(1 << 20);
  Buffer dst = device.alloc_device(1 << 20);
  for (std::size_t i = 0; i < src.size(); ++i) src.data()[i] = std::byte(i * 31 + 7);
  auto stream = device.create_stream();
  std::vector<CopyRegion> regions;
  for (std::size_t off = 0; off < src.size(); off += 4096 + 13) {
    const std::size_t n = std::min<std::size_t>(4096 + 13, src.size() - off);
    regions.push_back({dst.data() + off, src.data() + off, n});
  }
  stream->copy_batch_async(regions);
  regions.clear();  // the stream copied the list
  stream->synchronize();
  EXPECT_EQ(std::memcmp(dst.data(), src.data(), src.size()), 0);
}

class ForeignEvent final : public Event {
 public:
  bool query() const override { return true; }
  void synchronize() const override {}
};

TEST(HostDevice, RejectsBadArgumentsWithoutEnqueuing) {
  HostDevice device;
  auto stream = device.create_stream();
  ForeignEvent foreign;
  EXPECT_THROW(stream->record(foreign), InvalidArgument);
  EXPECT_THROW(stream->wait(foreign), InvalidArgument);
  int x = 0;
  EXPECT_THROW(stream->copy_async(nullptr, &x, 4), InvalidArgument);
  const CopyRegion bad[] = {{&x, &x, 0}, {&x, nullptr, 4}};
  EXPECT_THROW(stream->copy_batch_async(bad), InvalidArgument);
  EXPECT_THROW(stream->launch_host_func(nullptr), InvalidArgument);
  EXPECT_THROW(device.alloc_device(0), InvalidArgument);
  EXPECT_THROW(device.alloc_host(0), InvalidArgument);
  stream->synchronize();
}

}  // namespace
}  // namespace hicache
