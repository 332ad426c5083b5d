#include "controller/radix/ghost_set.h"

#include <xxhash.h>

#include <algorithm>

namespace hicache::radix {

namespace {

std::uint64_t page_hash(std::span<const std::int32_t> page) {
  return XXH3_64bits(page.data(), page.size_bytes());
}

std::uint64_t edge(std::uint64_t parent, std::span<const std::int32_t> first_page) {
  return XXH3_64bits_withSeed(first_page.data(), first_page.size_bytes(), parent);
}

}  // namespace

std::uint64_t GhostSet::parent_name(NodeId parent_id, bool at_root, std::string_view identity) {
  if (!at_root || identity.empty()) return static_cast<std::uint64_t>(parent_id);
  return XXH3_64bits(identity.data(), identity.size());
}

void GhostSet::remember(std::uint64_t parent, NodeId id, std::span<const std::int32_t> key,
                        std::size_t page_size) {
  const auto n = static_cast<std::int64_t>(key.size() / page_size);
  if (n == 0 || n > capacity_pages_) return;
  const std::uint64_t e = edge(parent, key.first(page_size));
  Entry& entry = entries_[e];
  pages_ -= static_cast<std::int64_t>(entry.pages.size());  // replaces an older entry
  entry.id = id;
  entry.counted = 0;
  entry.seq = next_seq_++;
  entry.pages.clear();
  for (std::size_t p = 0; p + page_size <= key.size(); p += page_size) {
    entry.pages.push_back(page_hash(key.subspan(p, page_size)));
  }
  pages_ += n;
  order_.emplace_back(e, entry.seq);
  if (order_.size() > 2 * entries_.size() + 64) {
    // Replaced entries leave stale places in the queue (a hot prefix evicted again and again
    // reuses one entry): drop them, keeping the order.
    std::erase_if(order_, [this](const auto& o) {
      auto it = entries_.find(o.first);
      return it == entries_.end() || it->second.seq != o.second;
    });
  }
  while (pages_ > capacity_pages_ && !order_.empty()) {
    const auto [old, seq] = order_.front();
    order_.pop_front();
    auto it = entries_.find(old);
    if (it == entries_.end() || it->second.seq != seq) continue;  // replaced since
    pages_ -= static_cast<std::int64_t>(it->second.pages.size());
    entries_.erase(it);
  }
}

std::int64_t GhostSet::take_evicted_tokens(std::uint64_t parent,
                                           std::span<const std::int32_t> tokens,
                                           std::size_t page_size) {
  std::int64_t fresh = 0;
  std::size_t pos = 0;
  while (!entries_.empty() && pos + page_size <= tokens.size()) {
    auto it = entries_.find(edge(parent, tokens.subspan(pos, page_size)));
    if (it == entries_.end()) break;
    Entry& entry = it->second;
    std::size_t i = 0;
    while (i < entry.pages.size() && pos + page_size <= tokens.size() &&
           entry.pages[i] == page_hash(tokens.subspan(pos, page_size))) {
      if (i >= entry.counted) fresh += static_cast<std::int64_t>(page_size);
      ++i;
      pos += page_size;
    }
    entry.counted = std::max(entry.counted, i);
    if (i < entry.pages.size()) break;  // the prompt leaves the evicted path here
    parent = static_cast<std::uint64_t>(entry.id);
  }
  return fresh;
}

void GhostSet::clear() {
  entries_.clear();
  order_.clear();
  pages_ = 0;
}

}  // namespace hicache::radix
