#include "pools/paged_token_allocator.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <set>

#include "transfer/errors.h"

namespace hicache {
namespace {

// The reference model: a set of allocated pages.
struct Model {
  std::int64_t num_pages;
  std::set<std::int64_t> allocated;
  std::int64_t free_pages() const { return num_pages - static_cast<std::int64_t>(allocated.size()); }
};

TEST(PagedTokenAllocator, MatchesReferenceModelUnderRandomAllocFree) {
  constexpr std::int32_t kPage = 16;
  constexpr std::int64_t kPages = 97;
  for (std::uint32_t seed : {1u, 2u, 3u, 20261122u}) {
    std::mt19937 rng(seed);
    PagedTokenAllocator a(kPages * kPage, kPage);
    Model m{kPages, {}};
    std::vector<std::vector<std::int64_t>> live;  // slot lists handed out
    for (int step = 0; step < 5000; ++step) {
      const bool do_alloc = live.empty() || rng() % 2 == 0;
      if (do_alloc) {
        const std::int64_t pages = 1 + rng() % 12;
        std::vector<std::int64_t> slots{-7};  // alloc appends; existing content is kept
        const bool ok = a.alloc(pages * kPage, slots);
        ASSERT_EQ(ok, pages <= m.free_pages()) << "seed " << seed << " step " << step;
        if (!ok) {
          ASSERT_EQ(slots.size(), 1u);
          continue;
        }
        ASSERT_EQ(slots.size(), static_cast<std::size_t>(1 + pages * kPage));
        slots.erase(slots.begin());
        for (std::size_t i = 0; i < slots.size(); ++i) {
          const std::int64_t page = slots[i] / kPage;
          ASSERT_EQ(slots[i], page * kPage + static_cast<std::int64_t>(i % kPage));
          if (i % kPage == 0) {
            ASSERT_TRUE(m.allocated.insert(page).second) << "page handed twice";
          }
        }
        live.push_back(std::move(slots));
      } else {
        const std::size_t k = rng() % live.size();
        a.free(live[k]);
        for (std::size_t i = 0; i < live[k].size(); i += kPage) m.allocated.erase(live[k][i] / kPage);
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
      }
      ASSERT_EQ(a.free_pages(), m.free_pages());
      for (std::int64_t p = 0; p < kPages; p += 7) {
        ASSERT_EQ(a.is_allocated(p), m.allocated.count(p) == 1);
      }
    }
  }
}

TEST(PagedTokenAllocator, AllocIsAllOrNothing) {
  PagedTokenAllocator a(4 * 8, 8);
  auto first = a.alloc(24);
  ASSERT_TRUE(first);
  EXPECT_FALSE(a.alloc(16));
  EXPECT_EQ(a.free_pages(), 1);
  EXPECT_TRUE(a.alloc(8));
  EXPECT_EQ(a.free_pages(), 0);
}

TEST(PagedTokenAllocator, RejectsBadConstructorArguments) {
  EXPECT_THROW(PagedTokenAllocator(0, 8), InvalidArgument);
  EXPECT_THROW(PagedTokenAllocator(-16, 8), InvalidArgument);
  EXPECT_THROW(PagedTokenAllocator(12, 8), InvalidArgument);
  EXPECT_THROW(PagedTokenAllocator(16, 0), InvalidArgument);
}

TEST(PagedTokenAllocator, RejectsAllocSizesThatAreNotPositivePageMultiples) {
  PagedTokenAllocator a(64, 8);
  std::vector<std::int64_t> slots;
  for (std::int64_t bad : {0L, -8L, 5L, 12L}) {
    EXPECT_THROW(a.alloc(bad, slots), InvalidArgument) << bad;
  }
  EXPECT_TRUE(slots.empty());
  EXPECT_EQ(a.free_pages(), 8);
}

// Every malformed free raises, names the slot or page, and changes nothing.
TEST(PagedTokenAllocator, BadFreesRaiseAndChangeNothing) {
  PagedTokenAllocator a(8 * 4, 4);
  auto held = *a.alloc(8);  // two pages
  const std::vector<std::int64_t> page0(held.begin(), held.begin() + 4);
  std::vector<std::int64_t> not_allocated;
  for (std::int64_t p = 0; p < 8; ++p) {
    if (!a.is_allocated(p)) {
      for (int j = 0; j < 4; ++j) not_allocated.push_back(p * 4 + j);
      break;
    }
  }
  struct Case {
    std::vector<std::int64_t> slots;
    const char* needle;
  } cases[] = {
      {{page0[0], page0[1], page0[2]}, "not a whole number of pages"},
      {{100, 101, 102, 103}, "slot 100 is out of range"},
      {{-4, -3, -2, -1}, "slot -4 is out of range"},
      {{page0[1], page0[2], page0[3], page0[0]}, "does not start a page"},
      {{page0[0], page0[0] + 2, page0[0] + 1, page0[0] + 3}, "breaks page"},
      {not_allocated, "is not allocated"},
  };
  for (const Case& c : cases) {
    try {
      a.free(c.slots);
      ADD_FAILURE() << "no exception for " << c.needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(c.needle), std::string::npos) << e.what();
    }
    EXPECT_EQ(a.free_pages(), 6) << c.needle;
  }
  // A page listed twice in one call: nothing freed, not even the first occurrence.
  std::vector<std::int64_t> twice = page0;
  twice.insert(twice.end(), page0.begin(), page0.end());
  try {
    a.free(twice);
    FAIL();
  } catch (const StateError& e) {
    EXPECT_NE(std::string(e.what()).find("listed twice"), std::string::npos) << e.what();
  }
  EXPECT_EQ(a.free_pages(), 6);
  EXPECT_TRUE(a.is_allocated(page0[0] / 4));
  // Double free across calls.
  a.free(page0);
  EXPECT_THROW(a.free(page0), StateError);
  EXPECT_EQ(a.free_pages(), 7);
}

TEST(PagedTokenAllocator, ResetFreesEverything) {
  PagedTokenAllocator a(64, 8);
  ASSERT_TRUE(a.alloc(64));
  a.reset();
  EXPECT_EQ(a.free_pages(), 8);
  EXPECT_TRUE(a.alloc(64));
}

TEST(PagedTokenAllocator, SlotPageConversionRoundTrips) {
  std::vector<std::int64_t> pages{3, 0, 5}, slots, back;
  pages_to_slots(pages, 4, slots);
  EXPECT_EQ(slots.size(), 12u);
  EXPECT_EQ(slots[0], 12);
  EXPECT_EQ(slots[4], 0);
  slots_to_pages(slots, 4, 6, "test", back);
  EXPECT_EQ(back, pages);
}

}  // namespace
}  // namespace hicache
