// ReadPacer: the pages of a prefetch's next read, sized to about 20 ms a read from the reads it
// saw. Each case feeds it reads timed by a model store (seconds = latency + pages x per_page)
// and checks where it settles, how fast it may grow, and its bounds.
#include "controller/read_pacer.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>

namespace hicache {
namespace {

struct ModelStore {
  double latency_s, per_page_s;
  double seconds(std::int64_t pages) const {
    return latency_s + static_cast<double>(pages) * per_page_s;
  }
};

// Runs `reads` reads through the pacer; returns the size it asks for next. Every read is at most
// twice the one before it, at least one page and at most the cap.
std::int64_t settle(ReadPacer& pacer, const ModelStore& store, int reads, std::int64_t cap) {
  std::int64_t last = pacer.next_pages();
  EXPECT_EQ(last, 1) << "starts at one page";
  for (int i = 0; i < reads; ++i) {
    const std::int64_t n = pacer.next_pages();
    EXPECT_GE(n, 1);
    EXPECT_LE(n, cap);
    EXPECT_LE(n, 2 * last) << "read " << i << " grew more than twice";
    pacer.observe(n, store.seconds(n));
    last = n;
  }
  return pacer.next_pages();
}

TEST(ReadPacer, ABandwidthBoundStoreReadsAboutTwentyMillisecondsAtATime) {
  ReadPacer pacer(4096);
  const ModelStore store{0, 0.001};  // 16 KiB pages at 16 MB/s: a millisecond a page
  const std::int64_t n = settle(pacer, store, 200, 4096);
  EXPECT_GE(n, 19);
  EXPECT_LE(n, 40) << "at most one doubling past the target while it re-measures";
  EXPECT_NEAR(pacer.latency_seconds(), 0, 1e-6);
}

TEST(ReadPacer, ALatencyBoundStoreReadsBatchesWorthItsLatency) {
  ReadPacer pacer(1 << 20);
  const ModelStore store{0.02, 1e-5};  // 20 ms a call, 10 us a page
  const std::int64_t n = settle(pacer, store, 200, 1 << 20);
  // The target is twice the latency: 40 ms, of which 20 ms of pages.
  EXPECT_GE(n, 1800);
  EXPECT_LE(n, 4000);
  EXPECT_NEAR(pacer.latency_seconds(), 0.02, 1e-4);
}

TEST(ReadPacer, AFastStoreReachesTheCapAndASlowOneStaysAtOnePage) {
  ReadPacer fast(64);
  EXPECT_EQ(settle(fast, ModelStore{1e-4, 1e-6}, 40, 64), 64);
  ReadPacer slow(64);
  EXPECT_EQ(settle(slow, ModelStore{0, 1.0}, 40, 64), 1) << "a second a page: one at a time";
  ReadPacer one(1);
  EXPECT_EQ(settle(one, ModelStore{0, 1e-6}, 10, 1), 1) << "a cap of one page";
  ReadPacer zero(0);
  EXPECT_EQ(zero.next_pages(), 1) << "a cap below one page is one page";
}

// A store that slows down (a link that got busy): the pacer follows it down within a few reads.
TEST(ReadPacer, AStoreThatSlowsDownGetsSmallerReads) {
  ReadPacer pacer(4096);
  EXPECT_GE(settle(pacer, ModelStore{0, 1e-5}, 100, 4096), 1000);
  std::int64_t n = 0;
  for (int i = 0; i < 10; ++i) {
    n = pacer.next_pages();
    pacer.observe(n, ModelStore{0, 1e-3}.seconds(n));
  }
  EXPECT_LE(pacer.next_pages(), 40) << "at a millisecond a page, about 20 pages";
}

// What is not a read is ignored: no pages, a negative or non-finite time.
TEST(ReadPacer, ObservationsThatAreNotReadsChangeNothing) {
  ReadPacer pacer(64);
  pacer.observe(0, 0.001);
  pacer.observe(4, -1);
  pacer.observe(4, std::numeric_limits<double>::infinity());
  pacer.observe(4, std::numeric_limits<double>::quiet_NaN());
  EXPECT_EQ(pacer.next_pages(), 1);
}

}  // namespace
}  // namespace hicache
