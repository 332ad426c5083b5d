// Eviction for HiRadixCache's tree: the order (an LRU/LFU policy behind a small interface), and
// the index that keeps each tier's candidates in that order with the running totals stats()
// reports, so that evicting k nodes costs O(k log n) and stats() reads counters.
//
//   Device candidates: unlocked nodes with device KV, no write or load in flight, no child on
//                      the device, not passed over by the evict_device call under way.
//   Host candidates:   unlocked leaves with host KV only, no write or load in flight.
//
// The contract with the rest of the cache: every change to a node's tiers, lock, ops in flight,
// hits or children is followed by refresh(node); a node leaving the tree or being split is
// forgotten first (forget(node)). An access (Tree::touch) needs no refresh: the index keeps the
// node's older key and re-keys it when it reaches the front (next_victim), so a hit costs no
// index update. check() recomputes everything from the tree and names what was missed.
//
// Not thread-safe: the engine's main loop owns it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "controller/radix/eviction_policy.h"
#include "controller/radix/node.h"
#include "controller/radix/tree.h"

namespace hicache {
namespace radix {

// A node's eviction mark on `tier`: when it is due, on its access clock (Tree::touch). A node
// without sidecar pages: its last access, so the orders below are plain LRU and LFU. A node
// whose footprint is KV bytes k plus sidecar bytes s (a hybrid model's state, docs/hybrid.md):
//   F + (last access - F) * k / (k + s),   F = the tier's frontier at that access,
// the Greedy-Dual-Size rule with the frontier as its inflation value (the mark of the latest
// node evicted from the tier). A node that holds many state bytes per token it saves ages that
// much faster: a KV-only node stays about one turnover of the tier after its last access, a
// node whose state is 9x its KV about a tenth of one. Never decreases while the node lives
// (its access and the frontiers only grow, and its footprint changes only in a split, which
// forgets and re-indexes it). `kv_bytes_per_token` 0: unweighted (the last access).
std::uint64_t eviction_mark(const Node& node, Tier tier, std::int64_t kv_bytes_per_token);

// An eviction policy: a key per node and tier; eviction takes the smallest first. REQUIRES of
// an implementation: a node's key never decreases while it lives (hits and marks only grow),
// since the index keeps stale keys until they reach the front; the last element is the node's
// id, so no two nodes tie.
class EvictionOrder {
 public:
  virtual ~EvictionOrder() = default;
  virtual EvictKey key(const Node& node, Tier tier) const = 0;
  // LRU: (0, mark, id). LFU: (hits, mark, id). Marks weigh footprints by kv_bytes_per_token
  // (eviction_mark).
  static std::unique_ptr<EvictionOrder> make(EvictionPolicy policy,
                                             std::int64_t kv_bytes_per_token = 0);
};

class EvictionIndex {
 public:
  // What the tree holds, kept current by refresh() and forget().
  struct Totals {
    std::int64_t nodes = 0, device_tokens = 0, host_tokens = 0, stored_tokens = 0;
    std::int64_t writing = 0, loading = 0, backing_up = 0;  // nodes with that op in flight
    std::int64_t evictable_device_tokens = 0;  // device tokens of unlocked nodes, no op in flight
  };

  // `kv_bytes_per_token`: a token's KV bytes on one tier, what a node's sidecar bytes are
  // weighed against (eviction_mark); 0: unweighted.
  EvictionIndex(EvictionPolicy policy, std::int32_t page_size,
                std::int64_t kv_bytes_per_token = 0);
  // Forgets every entry and total (the tree was dropped); nodes still alive must not be
  // refreshed or forgotten afterwards.
  void clear();

  // Brings the indexes and totals up to date with `node`, and its parent's count of children
  // on the device (then the parent too). Nothing for the root (no parent).
  void refresh(Node* node);
  // Takes `node` out of the indexes and totals (before it leaves the tree or is split).
  void forget(Node* node);
  // The first candidate of `tier` in eviction order (re-keying stale entries on the way), still
  // in the index; nullptr when there is none. The caller that takes it off the tier advances
  // the tier's frontier to its mark (Tree::advance_frontier(tier, mark(node, tier))).
  Node* next_victim(Tier tier);
  // `node`'s eviction mark on `tier` (eviction_mark, with this index's weighting).
  std::uint64_t mark(const Node& node, Tier tier) const {
    return std::get<1>(order_->key(node, tier));
  }

  const Totals& totals() const { return totals_; }
  EvictKey key(const Node& node, Tier tier) const { return order_->key(node, tier); }
  std::size_t candidates(Tier tier) const {
    return tier == Tier::kDevice ? device_.size() : host_.size();
  }

  // Empty when the indexes and totals match `tree` as it is now (every change refreshed); else
  // the first difference found. O(n): for tests and checks.
  std::string check(const Tree& tree) const;

 private:
  void add(const Node::Indexed& x, std::int64_t sign);
  // Moves `node`'s entry from `at` to `key` (nothing: out of the index).
  static void move(EvictIndex& index, std::optional<EvictIndex::iterator>& at,
                   const std::optional<EvictKey>& key, Node* node);

  std::unique_ptr<EvictionOrder> order_;
  std::int32_t page_size_;
  EvictIndex device_, host_;
  Totals totals_;
};

}  // namespace radix
}  // namespace hicache
