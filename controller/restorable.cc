#include "controller/restorable.h"

#include <algorithm>

#include "transfer/errors.h"

namespace hicache {

void RestorablePrefix::reset(std::int64_t kv_pages, std::int64_t max_pages) {
  if (kv_pages < 0 || max_pages < kv_pages) {
    throw InvalidArgument(str_cat("RestorablePrefix: kv_pages ", kv_pages, " and max_pages ",
                                  max_pages, ": need 0 <= kv_pages <= max_pages"));
  }
  legal_.assign(static_cast<std::size_t>(max_pages) + 1, 0);
  std::fill(legal_.begin() + 1, legal_.begin() + 1 + kv_pages, 1);
}

void RestorablePrefix::intersect(SidecarHitPolicy policy, std::int32_t window,
                                 std::span<const std::uint8_t> held) {
  if (window < 1) {
    throw InvalidArgument(str_cat("RestorablePrefix: window ", window, ": must be >= 1"));
  }
  // run: the held pages that end at page p-1, consecutively.
  std::int64_t run = 0;
  for (std::int64_t p = 1; p <= max_pages(); ++p) {
    const auto page = static_cast<std::size_t>(p - 1);
    run = page < held.size() && held[page] != 0 ? run + 1 : 0;
    const std::int64_t needed =
        policy == SidecarHitPolicy::kAllPages ? p : std::min<std::int64_t>(window, p);
    if (run < needed) legal_[static_cast<std::size_t>(p)] = 0;
  }
}

std::int64_t RestorablePrefix::largest() const {
  for (std::int64_t p = max_pages(); p >= 1; --p) {
    if (legal_[static_cast<std::size_t>(p)] != 0) return p;
  }
  return 0;
}

std::vector<std::int64_t> RestorablePrefix::endpoints() const {
  std::vector<std::int64_t> out;
  for (std::int64_t p = 1; p <= max_pages(); ++p) {
    if (legal_[static_cast<std::size_t>(p)] != 0) out.push_back(p);
  }
  return out;
}

bool RestorablePrefix::agree(Collective& tp, std::string_view tag) {
  const std::size_t n = legal_.size() - 1;  // lengths 1..n
  if (n == 0) {
    // Nothing to reduce, but every rank still joins the same call.
    return tp.min_allreduce({}, tag).ok;
  }
  // From the longest lengths down, as many per call as the collective carries, until a call
  // finds a common one: every rank sees the same result of each call, so all make the same
  // calls. The lengths below that call's are not agreed: dropped.
  const std::size_t chunk = std::max<std::size_t>(1, tp.max_values());
  for (std::size_t end = n; end > 0;) {
    const std::size_t begin = end > chunk ? end - chunk : 0;  // lengths begin+1..end
    const auto part = std::span<std::int64_t>(legal_).subspan(1 + begin, end - begin);
    if (const auto r = tp.min_allreduce(part, tag); !r.ok) {
      std::fill(legal_.begin(), legal_.end(), 0);
      return false;
    }
    if (std::find(part.begin(), part.end(), 1) != part.end()) {
      std::fill(legal_.begin() + 1, legal_.begin() + 1 + static_cast<std::ptrdiff_t>(begin), 0);
      return true;
    }
    end = begin;
  }
  return true;  // no common length
}

}  // namespace hicache
