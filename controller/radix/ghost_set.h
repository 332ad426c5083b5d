// radix::GhostSet: pages that left HiRadixCache's tree (no copy on any tier), remembered so that
// a later miss on them is counted as "evicted" rather than never cached (the hicache_misses_total
// reason). Each removed node is one entry, found by the edge it hung on (its parent's name and
// its first page) and holding a hash per page and the node's own id, under which the entries of
// its children (removed before it) are found: a miss walks on from the deepest node still in the
// tree. Bounded to capacity_pages pages, oldest out first; 64-bit hashes, so a collision can only
// move a count between two miss reasons.
//
// Not thread-safe: the engine's main loop owns it.
#pragma once

#include <cstdint>
#include <deque>
#include <span>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "transfer/cache_operation.h"

namespace hicache::radix {

class GhostSet {
 public:
  // Keeps at most `capacity_pages` pages (0: remembers nothing).
  explicit GhostSet(std::int64_t capacity_pages) : capacity_pages_(capacity_pages) {}

  // The name of a parent node for its edges: its id, or under the root with a cache identity
  // the identity's hash (so identities never share an entry).
  static std::uint64_t parent_name(NodeId parent_id, bool at_root, std::string_view identity);

  // Remembers the node `id` whose `key` (whole pages of `page_size`) hung under `parent`,
  // replacing an older entry on the same edge. Keys over the capacity are not remembered.
  void remember(std::uint64_t parent, NodeId id, std::span<const std::int32_t> key,
                std::size_t page_size);
  // Whole-page tokens of `tokens` (which follow the node named `parent`) that were in the tree,
  // left it, and were not asked for since: each evicted page counts once, so an engine that
  // matches a waiting request every step does not count its misses again.
  std::int64_t take_evicted_tokens(std::uint64_t parent, std::span<const std::int32_t> tokens,
                                   std::size_t page_size);
  void clear();
  std::int64_t pages() const { return pages_; }

 private:
  struct Entry {
    NodeId id = 0;
    std::vector<std::uint64_t> pages;
    std::size_t counted = 0;  // leading pages already counted as missed
    std::uint64_t seq = 0;
  };
  std::unordered_map<std::uint64_t, Entry> entries_;           // by edge
  std::deque<std::pair<std::uint64_t, std::uint64_t>> order_;  // (edge, seq), oldest first
  std::int64_t pages_ = 0;
  std::int64_t capacity_pages_;
  std::uint64_t next_seq_ = 0;
};

}  // namespace hicache::radix
