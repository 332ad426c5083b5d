// radix::Tree: the structure of HiRadixCache's tree, without tiers: nodes keyed by whole pages
// of token ids, children found by the hash of their edge (first page, and under the root the
// cache identity), lookups, leaves added and removed, nodes split at a page boundary. It knows
// nothing of device or host slots, eviction or L3: the coordinator (hi_radix_cache.cc) moves a
// node's tiers and refreshes the eviction index around each structural change.
//
// Ids: nodes and the cache's load ops take ids from one sequence (next_id()), so an ack's id
// never names both. TP ranks that make the same calls give the same ids.
//
// Not thread-safe: the engine's main loop owns it.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "controller/radix/node.h"

namespace hicache::radix {

class Tree {
 public:
  // REQUIRES: page_size >= 1 and 1 <= edge_hash_bits <= 64 (RadixCacheConfig::validate).
  // Only tests lower edge_hash_bits: edges then collide, which the tree handles, slower.
  Tree(std::int32_t page_size, std::int32_t edge_hash_bits);

  Node* root() const { return root_.get(); }
  std::int32_t page_size() const { return page_size_; }
  // Drops every node and starts again from a new root. Ids and the clock go on.
  void clear();

  // The next id for a node or an op.
  NodeId next_id() { return next_id_++; }
  // Sets the node's access time to the clock's next tick (every call a later time), and
  // records each tier's eviction frontier at that time.
  void touch(Node* node) {
    node->last_access = ++clock_;
    node->access_frontier = frontier_;
  }
  // A tier's eviction frontier: the largest eviction mark (eviction.h) of a node taken from
  // that tier so far, an access time of the clock's scale. It only grows; clear() keeps it, as
  // it keeps the clock.
  std::uint64_t frontier(Tier tier) const { return frontier_[static_cast<std::size_t>(tier)]; }
  void advance_frontier(Tier tier, std::uint64_t mark) {
    auto& f = frontier_[static_cast<std::size_t>(tier)];
    f = std::max(f, mark);
  }

  // The child of `node` whose key starts with `page` (one whole page) and, when `node` is the
  // root, whose identity is `identity` (ignored below the root); nullptr when there is none.
  Node* child_of(const Node* node, std::span<const std::int32_t> page,
                 std::string_view identity) const;
  // Tokens (whole pages) that `child`'s key shares with the start of `tokens`.
  std::size_t common_tokens(const Node* child, std::span<const std::int32_t> tokens) const;
  // How many leading tokens of `tokens` (whole pages) the tree holds: the longest path from the
  // root, with no side effect (no split, no access time, no hit).
  std::size_t prefix_tokens(std::span<const std::int32_t> tokens, std::string_view identity) const;

  // A new child of `parent` holding `key` (whole pages, at least one, starting with no page of
  // a sibling's edge) with the next id, touched; `identity` is kept when `parent` is the root.
  // Holds no KV: the caller gives it its tiers.
  Node* add_leaf(Node* parent, std::span<const std::int32_t> key, std::string_view identity);
  // Splits `node` after its first `tokens` (whole pages, fewer than its key): a new upper node
  // with the next id takes those tokens and node's place under its parent (same edge), and node
  // goes under it with the rest. The upper node copies the lock, hits, access time (and its
  // frontiers) and identity;
  // the tiers (slots, ops, digests) stay all on `node` for the caller to divide. Returns the
  // upper node.
  Node* split(Node* node, std::size_t tokens);
  // Takes a leaf (no children, not the root) out of its parent and frees it.
  void remove_leaf(Node* node);

  // fn(node) for every node but the root, each parent before its children.
  template <typename Fn>
  void for_each_node(Fn&& fn) const {
    std::vector<Node*> todo{root_.get()};
    while (!todo.empty()) {
      Node* n = todo.back();
      todo.pop_back();
      if (n != root_.get()) fn(n);
      n->children.for_each([&](Node* c) { todo.push_back(c); });
    }
  }
  // `node`'s children in a canonical order (by their edge's bytes: under the root the identity,
  // length first, then the first page), the same on every TP rank whose tree is the same.
  std::vector<const Node*> ordered_children(const Node* node) const;

  // Empty when `node`'s structure is sound: a key of whole pages (not the root), lock >= 0 and
  // at least its children's, each child pointing back to it and found under its own edge; else
  // the first problem found.
  std::string check_node(const Node* node) const;

 private:
  // The key of the edge to a child of `parent` that starts with `page` in `parent`'s map.
  std::uint64_t edge_of(const Node* parent, std::string_view identity,
                        std::span<const std::int32_t> page) const;

  std::int32_t page_size_;
  std::int32_t edge_hash_bits_;
  std::unique_ptr<Node> root_;
  NodeId next_id_ = 1;
  std::uint64_t clock_ = 0;
  std::array<std::uint64_t, 2> frontier_{};
};

}  // namespace hicache::radix
