// RestorablePrefix: how far a cached prefix of a hybrid model can be restored (docs/hybrid.md).
//
// A prefix of p pages is restorable when the KV holds pages 0..p-1 and every sidecar pool can
// restore it under its hit policy (pools/sidecar_pool.h): an all_pages pool holds pages
// 0..p-1, a trailing pool of window w holds pages max(0, p-w)..p-1. The restorable lengths (the
// "endpoints") have gaps with trailing pools: a state checkpoint at pages 2 and 4 but not 3
// restores 2 and 4, never 3. A match restores the largest endpoint, never a longer prefix.
//
// Under tensor parallelism each rank's pools hold their own shard, so the ranks intersect their
// endpoint sets and take the largest common one. The minimum of each rank's largest is wrong
// (rank 0 {2, 4}, rank 1 {2, 3}: the answer is 2, not 3). agree() does the intersection in one
// collective: an element-wise minimum over one 0/1 element per length, which is an AND.
//
// Not thread-safe; cheap to reuse (clear() keeps the memory).
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "pools/sidecar_pool.h"
#include "storage/collective.h"

namespace hicache {

class RestorablePrefix {
 public:
  // Every length 1..kv_pages restorable (the KV's own hit: pages 0..kv_pages-1 are held), and
  // lengths up to `max_pages` considered (the vector agree() reduces has max_pages elements on
  // every rank: the same value everywhere). Throws InvalidArgument unless
  // 0 <= kv_pages <= max_pages.
  void reset(std::int64_t kv_pages, std::int64_t max_pages);
  // Keeps the lengths a pool can restore: held[i] != 0 when the pool holds page i (pages
  // past held's end are not held). Throws InvalidArgument for a window < 1.
  void intersect(SidecarHitPolicy policy, std::int32_t window, std::span<const std::uint8_t> held);

  // The largest restorable length, 0 when there is none.
  std::int64_t largest() const;
  // Every restorable length, ascending (SGLang's restorable_prefix_pages).
  std::vector<std::int64_t> endpoints() const;
  bool restorable(std::int64_t pages) const {
    return pages >= 1 && pages <= max_pages() && legal_[static_cast<std::size_t>(pages)] != 0;
  }
  std::int64_t max_pages() const { return static_cast<std::int64_t>(legal_.size()) - 1; }

  // TP: keeps the lengths every rank of `tp` can restore (every rank calls it with the same
  // max_pages): one min-reduction under `tag` when max_pages fits one call
  // (Collective::max_values); else calls of that many lengths from the longest down until one
  // finds a common length, the shorter lengths then dropped (largest() is exact; endpoints()
  // lists the agreed ones). False when the collective failed: then nothing is restorable on
  // this rank (a failed agreement counts as zero hits, as the prefetch hit does).
  bool agree(Collective& tp, std::string_view tag);

 private:
  std::vector<std::int64_t> legal_;  // legal_[p]: 1 when length p is restorable; [0] unused
};

}  // namespace hicache
