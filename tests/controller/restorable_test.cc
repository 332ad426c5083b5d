#include "controller/restorable.h"

#include <gtest/gtest.h>

#include <string>
#include <thread>
#include <vector>

#include "transfer/errors.h"

namespace hicache {
namespace {

using Pages = std::vector<std::int64_t>;

std::vector<std::uint8_t> held(std::int64_t n, const Pages& pages) {
  std::vector<std::uint8_t> h(static_cast<std::size_t>(n), 0);
  for (std::int64_t p : pages) h[static_cast<std::size_t>(p)] = 1;
  return h;
}

void intersect(RestorablePrefix& r, SidecarHitPolicy policy, std::int32_t window,
               const std::vector<std::uint8_t>& h) {
  r.intersect(policy, window, h);
}

TEST(RestorablePrefix, TheKvHitAloneRestoresEveryLengthUpToIt) {
  RestorablePrefix r;
  r.reset(5, 8);
  EXPECT_EQ(r.endpoints(), (Pages{1, 2, 3, 4, 5}));
  EXPECT_EQ(r.largest(), 5);
  EXPECT_FALSE(r.restorable(6));
  EXPECT_FALSE(r.restorable(0));
  r.reset(0, 8);
  EXPECT_EQ(r.largest(), 0);
  EXPECT_TRUE(r.endpoints().empty());
}

TEST(RestorablePrefix, AllPagesStopsAtTheFirstMissingPage) {
  RestorablePrefix r;
  r.reset(6, 6);
  intersect(r, SidecarHitPolicy::kAllPages, 1, held(6, {0, 1, 2, 4, 5}));
  EXPECT_EQ(r.endpoints(), (Pages{1, 2, 3}));
  EXPECT_EQ(r.largest(), 3);
}

// A state checkpoint (window 1) at pages 1 and 3 restores 2 and 4 only; a window of 2 needs the
// two pages before the end (from page 0 for the first length).
TEST(RestorablePrefix, TrailingRestoresOnlyWhereItsWindowIsHeldWithGaps) {
  RestorablePrefix r;
  r.reset(6, 6);
  intersect(r, SidecarHitPolicy::kTrailing, 1, held(6, {1, 3}));
  EXPECT_EQ(r.endpoints(), (Pages{2, 4}));
  EXPECT_FALSE(r.restorable(3));
  r.reset(6, 6);
  intersect(r, SidecarHitPolicy::kTrailing, 2, held(6, {0, 2, 3, 5}));
  // 1: page 0 (all there is before it); 4: pages 2, 3; 2 needs 0 and 1; 6 needs 4 and 5.
  EXPECT_EQ(r.endpoints(), (Pages{1, 4}));
}

// SGLang #39147's shape in one rank: SWA legal at {1, 3}, Mamba at {1, 2}: the answer is 1.
TEST(RestorablePrefix, PoolsIntersectTheirEndpointsNotTheirMaxima) {
  RestorablePrefix r;
  r.reset(3, 3);
  intersect(r, SidecarHitPolicy::kTrailing, 1, held(3, {0, 2}));  // SWA-like: {1, 3}
  intersect(r, SidecarHitPolicy::kTrailing, 1, held(3, {0, 1}));  // Mamba: {1, 2}
  EXPECT_EQ(r.endpoints(), (Pages{1}));
  EXPECT_EQ(r.largest(), 1);
}

TEST(RestorablePrefix, BadArgumentsAreNamedAndChangeNothing) {
  RestorablePrefix r;
  r.reset(2, 4);
  try {
    r.reset(5, 4);
    FAIL() << "accepted kv_pages above max_pages";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("kv_pages 5 and max_pages 4"), std::string::npos);
  }
  try {
    intersect(r, SidecarHitPolicy::kTrailing, 0, held(4, {0, 1}));
    FAIL() << "accepted window 0";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("window 0"), std::string::npos);
  }
  EXPECT_EQ(r.endpoints(), (Pages{1, 2}));
}

// TP: rank 0 restores {2, 4}, rank 1 {2, 3}. The minimum of the maxima (3) is a prefix rank 0
// cannot restore; the ranks agree on 2, in one collective each.
TEST(RestorablePrefix, TpRanksAgreeOnTheLargestCommonLengthInOneCollective) {
  auto ranks = InProcessGroup::make_ranks(2);
  const std::vector<Pages> checkpoints = {{1, 3}, {1, 2}};
  std::vector<Pages> agreed(2);
  std::vector<std::int64_t> largest(2, -1);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] {
      RestorablePrefix r;
      r.reset(4, 8);
      intersect(r, SidecarHitPolicy::kTrailing, 1, held(8, checkpoints[rank]));
      if (r.agree(*ranks[rank], "test.restorable")) {
        agreed[rank] = r.endpoints();
        largest[rank] = r.largest();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(agreed[rank], (Pages{2})) << "rank " << rank;
    EXPECT_EQ(largest[rank], 2) << "rank " << rank;
    EXPECT_EQ(ranks[rank]->calls(), 1u);
  }
}

// Past kCollectiveMaxValues lengths the agreement goes in calls of that many lengths, longest
// first, until one finds a common length: 200 pages, rank 0 restoring {10, 150}, rank 1 {10,
// 140}, agree on 10 after 4 calls (lengths 139-200, 77-138, 15-76, 1-14); with 150 common, one
// call. Every rank makes the same calls; lengths below the deciding call are dropped.
TEST(RestorablePrefix, ALongPrefixAgreesInCallsFromTheLongestLengthsDown) {
  struct Case {
    std::vector<Pages> checkpoints;  // trailing window 1: the page before each endpoint
    std::int64_t want;
    std::uint64_t calls;
  };
  for (const Case& c : {Case{{{9, 149}, {9, 139}}, 10, 4}, Case{{{9, 149, 189}, {9, 149}}, 150, 1}}) {
    auto ranks = InProcessGroup::make_ranks(2);
    std::vector<std::int64_t> largest(2, -1);
    std::vector<Pages> agreed(2);
    std::vector<std::thread> threads;
    for (int rank = 0; rank < 2; ++rank) {
      threads.emplace_back([&, rank] {
        RestorablePrefix r;
        r.reset(200, 200);
        intersect(r, SidecarHitPolicy::kTrailing, 1, held(200, c.checkpoints[rank]));
        if (r.agree(*ranks[rank], "test.restorable")) {
          largest[rank] = r.largest();
          agreed[rank] = r.endpoints();
        }
      });
    }
    for (auto& t : threads) t.join();
    for (int rank = 0; rank < 2; ++rank) {
      EXPECT_EQ(largest[rank], c.want) << "rank " << rank;
      EXPECT_EQ(agreed[rank], (Pages{c.want})) << "rank " << rank;
      EXPECT_EQ(ranks[rank]->calls(), c.calls) << "rank " << rank;
      EXPECT_EQ(ranks[rank]->failure(), "");
    }
  }
  // One call of more values than a collective carries fails (as over Gloo).
  auto one = InProcessGroup::make_ranks(1);
  std::vector<std::int64_t> too_many(kCollectiveMaxValues + 1, 1);
  EXPECT_FALSE(one[0]->min_allreduce(too_many, "test.too_many").ok);
}

// A failed agreement restores nothing on this rank: zero hits, never a length a peer lacks.
TEST(RestorablePrefix, AFailedAgreementRestoresNothing) {
  auto ranks = InProcessGroup::make_ranks(2);
  ranks[0]->cancel("test: the group stops");
  RestorablePrefix r;
  r.reset(4, 4);
  EXPECT_FALSE(r.agree(*ranks[0], "test.restorable"));
  EXPECT_EQ(r.largest(), 0);
  EXPECT_TRUE(r.endpoints().empty());
}

}  // namespace
}  // namespace hicache
