// Token pages for the tests of controller/radix/: distinct, recognisable keys.
#pragma once

#include <cstdint>
#include <numeric>
#include <vector>

namespace hicache::radix {

inline constexpr std::int32_t kTestPage = 4;

// `pages` whole pages of kTestPage tokens: first * 100, first * 100 + 1, ...
inline std::vector<std::int32_t> pages_from(std::int32_t first, int pages) {
  std::vector<std::int32_t> t(static_cast<std::size_t>(pages * kTestPage));
  std::iota(t.begin(), t.end(), first * 100);
  return t;
}

}  // namespace hicache::radix
