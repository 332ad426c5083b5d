// radix::Node: one node of HiRadixCache's tree, shared by the rooms of controller/radix/. Each
// field says which room writes it:
//   tree (tree.h)          key, id, parent, children, same_hash, identity, lock, hits,
//                          last_access, access_frontier: the structure and what a match
//                          records;
//   tiers (the tier policy, tier_policy.h, the L3 paths, l3_paths.h, and the coordinator's
//   split, hi_radix_cache.cc)
//                          device, host, sidecars, sidecar_bytes, write_op, load_op,
//                          backup_op, digests,
//                          stored_pages, evict_after_write, leave_host_after_backup;
//   eviction (eviction.h)  device_children, passed_over, indexed;
//   KV events (tier_events.h) announced.
// A node and its key are one allocation (make()): the key's tokens follow the node, so a lookup
// fetches both from the node's address at once. The fields match_prefix reads of a child it
// passes come first: one cache line (the node is aligned to one) in a tree too large for the
// caches.
//
// Not thread-safe: the engine's main loop owns the tree.
#pragma once

#include <algorithm>
#include <array>
#include <boost/unordered/unordered_flat_map.hpp>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "storage/page_key.h"
#include "transfer/cache_operation.h"
#include "transfer/errors.h"

namespace hicache::radix {

struct Node;

// A tier eviction takes nodes from; its value indexes Node::access_frontier.
enum class Tier { kDevice = 0, kHost = 1 };

// A node's place in an eviction order, ascending (eviction.h): (policy's rank, last access, id).
// The id breaks the tie between the two halves of a split, the same way on every TP rank.
using EvictKey = std::tuple<std::int64_t, std::uint64_t, NodeId>;
using EvictIndex = std::map<EvictKey, Node*>;

struct alignas(64) Node {
  // A node holding a copy of `key` (whole pages; the root's is empty), nothing else set.
  static std::unique_ptr<Node> make(std::span<const std::int32_t> key) {
    constexpr std::align_val_t kAlign{alignof(Node)};
    void* at = ::operator new(sizeof(Node) + key.size_bytes(), kAlign);
    Node* n = nullptr;
    try {
      n = ::new (at) Node();
    } catch (...) {
      ::operator delete(at, kAlign);
      throw;
    }
    auto node = std::unique_ptr<Node>(n);
    std::copy(key.begin(), key.end(), node->key_tokens());
    node->key_size = key.size();
    return node;
  }
  // The one deallocation function `delete` finds: unsized (the allocation is larger than the
  // node), aligned like the allocation.
  static void operator delete(void* at, std::align_val_t align) { ::operator delete(at, align); }
  // The key is not part of the object: a copy or move would lose it.
  Node(const Node&) = delete;
  Node& operator=(const Node&) = delete;
  // Frees a chain of colliding siblings in a loop (a recursion as deep as the chain otherwise,
  // and chains are long with the tests' few hash bits).
  ~Node() {
    while (std::unique_ptr<Node> next = std::move(same_hash)) {
      same_hash = std::move(next->same_hash);
    }
  }

  // Whole pages.
  std::span<const std::int32_t> key() const { return {key_tokens(), key_size}; }
  // Drops the key's first `tokens`, fewer than it has (a split: the upper half took them).
  void drop_key_front(std::size_t tokens) {
    std::memmove(key_tokens(), key_tokens() + tokens, (key_size - tokens) * sizeof(std::int32_t));
    key_size -= tokens;
  }
  // Asks the memory for the node and its key's first tokens, ahead of reading them.
  void prefetch() const {
    __builtin_prefetch(this);
    __builtin_prefetch(key_tokens());
  }

  // A node's children by their edge: the first page of the child's key and, under the root, its
  // cache identity. An open-addressing map (Boost's unordered_flat_map) from the edge's 64-bit
  // hash holds the child itself (16 bytes a slot), so a lookup touches one group of the slot
  // array and then the child with its key, fetched together. Edges whose hashes collide share a
  // slot, chained through the children's `same_hash`: still correct, only slower.
  class Children {
   public:
    // The child under `hash` for which `same_edge(child)` holds, or nullptr.
    template <typename SameEdge>
    Node* find(std::uint64_t hash, SameEdge&& same_edge) const {
      const auto it = map_.find(hash);
      if (it == map_.end()) return nullptr;
      for (Node* c = it->second.get(); c != nullptr; c = c->same_hash.get()) {
        c->prefetch();
        if (same_edge(*c)) return c;
      }
      return nullptr;
    }
    // Adds `child` under `hash`. Throws StateError when `child` is in a chain already.
    void add(std::uint64_t hash, std::unique_ptr<Node> child) {
      if (child->same_hash) {
        throw StateError(str_cat("radix cache: node ", child->id, " is in a chain already"));
      }
      std::unique_ptr<Node>& slot = map_[hash];
      child->same_hash = std::move(slot);
      slot = std::move(child);
      ++size_;
    }
    // Takes `child` (held under `hash`) out and hands it back; `replacement`, when given, takes
    // its place. Throws StateError when `child` is not there.
    std::unique_ptr<Node> take(std::uint64_t hash, const Node* child,
                               std::unique_ptr<Node> replacement = nullptr) {
      const auto it = map_.find(hash);
      std::unique_ptr<Node>* at = it == map_.end() ? nullptr : &it->second;
      while (at != nullptr && at->get() != child) at = *at ? &(*at)->same_hash : nullptr;
      if (at == nullptr || !*at) {
        throw StateError(str_cat("radix cache: node ", child->id, " is not its parent's child"));
      }
      std::unique_ptr<Node> out = std::move(*at);
      if (replacement) {
        replacement->same_hash = std::move(out->same_hash);
        *at = std::move(replacement);
        return out;
      }
      *at = std::move(out->same_hash);
      --size_;
      if (!it->second) map_.erase(it);
      return out;
    }
    bool empty() const { return size_ == 0; }
    std::size_t size() const { return size_; }
    template <typename Fn>
    void for_each(Fn&& fn) const {
      for (const auto& [hash, first] : map_) {
        for (Node* c = first.get(); c != nullptr; c = c->same_hash.get()) fn(c);
      }
    }

   private:
    struct Identity {  // the key is a hash already
      using is_avalanching = void;
      std::size_t operator()(std::uint64_t h) const { return static_cast<std::size_t>(h); }
    };
    boost::unordered_flat_map<std::uint64_t, std::unique_ptr<Node>, Identity> map_;
    std::size_t size_ = 0;
  };

  // First cache line: what match_prefix reads and writes of a child it passes.
  std::size_t key_size = 0;          // tree
  std::vector<std::int64_t> device;  // tiers: device slots, one per token; empty: not there
  std::int64_t hits = 0;             // tree: matches that passed it
  std::uint64_t last_access = 0;     // tree: Tree::touch's clock
  std::unique_ptr<Node> same_hash;   // tree: the next child of the parent's map slot
  std::vector<std::int64_t> host;    // tiers: host slots; empty: not on the host
  NodeId id = 0;                     // tree
  Node* parent = nullptr;            // tree (null: the root)
  Children children;                 // tree
  // tree: requests and ops holding it; a holder holds every ancestor too. The root: 1, always.
  std::int64_t lock = 0;
  NodeId write_op = 0;               // tiers: the write in flight (the node's id), 0: none
  NodeId load_op = 0;                // tiers: the load in flight, 0: none
  std::int64_t backup_op = 0;        // tiers: the backup to L3 in flight, 0: none
  std::vector<PageDigest> digests;   // L3 paths: one per page while L3 is on (chains the keys)
  // tiers: the node's pages of each sidecar pool (a hybrid model's state, docs/hybrid.md), one
  // entry per pool that holds any of them. They live on exactly the tiers the KV lives on:
  // device slots while `device` is set, host slots while `host` is.
  struct SidecarPages {
    std::int32_t pool = 0;
    std::vector<std::int32_t> pages;   // page offsets inside the node, ascending
    std::vector<std::int64_t> device;  // slots_per_page slots per page, or empty
    std::vector<std::int64_t> host;    // the same on the host, or empty
  };
  std::vector<SidecarPages> sidecars;
  // tiers: the bytes of `sidecars`' pages on one tier (the same on either), kept with them by
  // the sidecar room (sidecar_units.h); eviction weighs them against the node's KV bytes.
  std::int64_t sidecar_bytes = 0;
  // tree: each tier's eviction frontier (Tree::frontier) at the node's last access, by Tier.
  std::array<std::uint64_t, 2> access_frontier{};
  std::string identity;              // tree: a child of the root's cache identity (empty: none)
  std::int64_t stored_pages = 0;     // tiers: leading pages known to be in L3
  bool evict_after_write = false;    // tiers: write_back frees the device copy on the ack
  // tiers: exclusive storage admission frees the host copy on the backup's ack
  bool leave_host_after_backup = false;
  bool passed_over = false;          // eviction: evict_device keeps it this call (out of the index)
  // KV events: the tiers its pages were last announced on (a split copies it to both halves).
  struct Announced {
    bool device = false, host = false;
  } announced;
  std::int64_t device_children = 0;  // eviction: children with KV on the device
  // eviction: what the node added to the indexes and totals at its last refresh.
  struct Indexed {
    bool counted = false;    // in the totals (every node but the root once refreshed)
    bool on_device = false;  // counted in the parent's device_children
    std::int64_t device_tokens = 0, host_tokens = 0, stored_tokens = 0;
    std::int64_t evictable_device_tokens = 0;  // device_tokens when unlocked, no op in flight
    bool writing = false, loading = false, backing_up = false;
    std::optional<EvictIndex::iterator> device_at, host_at;  // its entries
  } indexed;

 private:
  Node() = default;
  std::int32_t* key_tokens() {
    // The tokens make() copied there (int32 arrays are created implicitly in the allocation);
    // no std::launder, whose precondition an empty key (the root) would not meet.
    return reinterpret_cast<std::int32_t*>(reinterpret_cast<std::byte*>(this) + sizeof(Node));
  }
  const std::int32_t* key_tokens() const { return const_cast<Node*>(this)->key_tokens(); }
};

}  // namespace hicache::radix
