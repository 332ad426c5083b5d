#include "controller/hi_radix_cache.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include <boost/unordered/unordered_flat_map.hpp>
#include <xxhash.h>

#include "transfer/errors.h"

namespace hicache {

// Eviction order: (hits under LFU else 0, last access, id) ascending; the id breaks the tie
// between the two halves of a split, the same way on every TP rank.
using EvictKey = std::tuple<std::int64_t, std::uint64_t, NodeId>;
using EvictIndex = std::map<EvictKey, HiRadixCache::Node*>;

struct alignas(64) HiRadixCache::Node {
  // A node and its key are one allocation, the key's tokens right after the node (make()): a
  // lookup fetches both at once, from the node's address alone, instead of one after the other.
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

  // What match_prefix reads and writes of a child it passes, first: one cache line (the node is
  // aligned to one) in a tree too large for the caches.
  std::size_t key_size = 0;
  std::vector<std::int64_t> device;  // empty: not on the device
  std::int64_t hits = 0;
  std::uint64_t last_access = 0;
  std::unique_ptr<Node> same_hash;   // the next child of the parent's map slot (a collision)
  std::vector<std::int64_t> host;    // empty: not on the host
  NodeId id = 0;
  Node* parent = nullptr;
  Children children;
  std::int64_t lock = 0;
  NodeId write_op = 0;  // in flight, 0: none
  NodeId load_op = 0;
  std::int64_t backup_op = 0;
  std::vector<PageDigest> digests;  // one per page, when storage is on (chains the keys)
  std::string identity;  // a child of the root: its cache identity (empty: none)
  std::int64_t stored_pages = 0;    // leading pages known to be in L3
  bool evict_after_write = false;  // write_back: free the device copy on the ack
  bool passed_over = false;  // evict_device keeps it this call: out of the device index
  std::int64_t device_children = 0;  // children with KV on the device
  // What the node added to the indexes and totals at its last refresh().
  struct Indexed {
    bool counted = false;  // in the totals (every node but the root once refreshed)
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

// The eviction candidates of each tier in eviction order, and the totals stats() reports, kept
// current by refresh(): evicting k nodes costs O(k log n), and stats() reads counters.
// Device candidates: unlocked nodes with device KV, no op in flight and no child on the device.
// Host candidates: unlocked leaves with host KV only and no op in flight.
struct HiRadixCache::Index {
  EvictIndex device, host;
  std::int64_t nodes = 0, device_tokens = 0, host_tokens = 0, stored_tokens = 0;
  std::int64_t writing = 0, loading = 0, backing_up = 0;
  std::int64_t evictable_device_tokens = 0;

  void add(const Node::Indexed& x, std::int64_t sign) {
    nodes += sign * (x.counted ? 1 : 0);
    device_tokens += sign * x.device_tokens;
    evictable_device_tokens += sign * x.evictable_device_tokens;
    host_tokens += sign * x.host_tokens;
    stored_tokens += sign * x.stored_tokens;
    writing += sign * (x.writing ? 1 : 0);
    loading += sign * (x.loading ? 1 : 0);
    backing_up += sign * (x.backing_up ? 1 : 0);
  }
  // Moves `node`'s entry from `at` to `key` (nothing: out of the index). A touched node goes
  // last under LRU: its insertion at the end, like the erase by iterator, is amortized O(1).
  static void move(EvictIndex& index, std::optional<EvictIndex::iterator>& at,
                   const std::optional<EvictKey>& key, Node* node) {
    if (at && key && (*at)->first == *key) return;
    if (at) index.erase(*at);
    at.reset();
    if (!key) return;
    const bool last = index.empty() || std::prev(index.end())->first < *key;
    at = last ? index.emplace_hint(index.end(), *key, node) : index.emplace(*key, node).first;
  }
};

// Ops in flight: the node that holds the op's lock, and every node the op covers (a split adds
// the new upper part).
struct HiRadixCache::Pending {
  struct Op {
    Node* holder = nullptr;
    std::vector<Node*> nodes;
  };
  std::unordered_map<NodeId, Op> writes, loads, backups;
  // Backups in flight when the store was cleared: whatever they complete counts as nothing.
  std::unordered_set<NodeId> forgotten_backups;
  struct Prefetch {
    std::shared_ptr<PrefetchOperation> op;
    Node* node = nullptr;  // locked while the prefetch lasts
    std::vector<std::int32_t> tokens;
    std::string identity;
    std::int64_t reserved = 0;  // host tokens reserved for it (prefetch_reserved_tokens_)
    // TP: what the last check_events agreed (whether every rank's policy lets it terminate, and
    // the pages every rank had completed then).
    bool agreed_ready = false;
    std::int64_t agreed_pages = 0;
  };
  std::unordered_map<std::string, Prefetch> prefetches;
  // Prefetches that ended (check_events may end one before the scheduler asks): the tokens each
  // added to the tree, until check_prefetch_progress or release_aborted_request takes them.
  std::unordered_map<std::string, std::int64_t> inserted;

  // Removes and returns the op an ack names (nothing for an op this cache did not start).
  static std::optional<Op> take(std::unordered_map<NodeId, Op>& ops, NodeId id) {
    auto it = ops.find(id);
    if (it == ops.end()) return std::nullopt;
    Op op = std::move(it->second);
    ops.erase(it);
    return op;
  }
};

// Acks that arrived on this rank and are not applied yet (TP: not yet agreed), each already
// encoded as the value the ranks min-reduce (never 0, which means "not arrived"): writes and
// loads kOk or kFailed, backups completed tokens + 1.
// Pages that left the tree (no copy on any tier), remembered so that a later miss on them is
// counted as "evicted" rather than never cached. Each removed node is one entry, found by the
// edge it hung on (its parent's id and its first page) and holding a hash per page and its own
// id, under which the entries of its children (removed before it) are found: a miss walks on
// from the deepest node still in the tree. Bounded to `capacity_pages` pages, oldest out first;
// 64-bit hashes, so a collision can only move a count between two miss reasons.
struct HiRadixCache::Ghost {
  struct Entry {
    NodeId id = 0;
    std::vector<std::uint64_t> pages;
    std::size_t counted = 0;  // leading pages already counted as missed
    std::uint64_t seq = 0;
  };
  std::unordered_map<std::uint64_t, Entry> entries;  // by edge
  std::deque<std::pair<std::uint64_t, std::uint64_t>> order;  // (edge, seq), oldest first
  std::int64_t pages = 0;
  std::int64_t capacity_pages = 0;
  std::uint64_t next_seq = 0;

  static std::uint64_t page_hash(std::span<const std::int32_t> page) {
    return XXH3_64bits(page.data(), page.size_bytes());
  }
  static std::uint64_t edge(std::uint64_t parent, std::span<const std::int32_t> first_page) {
    return XXH3_64bits_withSeed(first_page.data(), first_page.size_bytes(),
                                static_cast<std::uint64_t>(parent));
  }

  void remember(std::uint64_t parent, NodeId id, std::span<const std::int32_t> key,
                std::size_t page_size) {
    const auto n = static_cast<std::int64_t>(key.size() / page_size);
    if (n == 0 || n > capacity_pages) return;
    const std::uint64_t e = edge(parent, key.first(page_size));
    Entry& entry = entries[e];
    pages -= static_cast<std::int64_t>(entry.pages.size());  // replaces an older entry
    entry.id = id;
    entry.counted = 0;
    entry.seq = next_seq++;
    entry.pages.clear();
    for (std::size_t p = 0; p + page_size <= key.size(); p += page_size) {
      entry.pages.push_back(page_hash(key.subspan(p, page_size)));
    }
    pages += n;
    order.emplace_back(e, entry.seq);
    if (order.size() > 2 * entries.size() + 64) {
      // Replaced entries leave stale places in the queue (a hot prefix evicted again and again
      // reuses one entry): drop them, keeping the order.
      std::erase_if(order, [this](const auto& o) {
        auto it = entries.find(o.first);
        return it == entries.end() || it->second.seq != o.second;
      });
    }
    while (pages > capacity_pages && !order.empty()) {
      const auto [old, seq] = order.front();
      order.pop_front();
      auto it = entries.find(old);
      if (it == entries.end() || it->second.seq != seq) continue;  // replaced since
      pages -= static_cast<std::int64_t>(it->second.pages.size());
      entries.erase(it);
    }
  }

  // Whole-page tokens of `tokens` (which follow node `parent`'s prefix) that were in the tree,
  // left it, and were not asked for since: each evicted page counts once, so an engine that
  // matches a waiting request every step does not count its misses again.
  std::int64_t take_evicted_tokens(std::uint64_t parent, std::span<const std::int32_t> tokens,
                                   std::size_t page_size) {
    std::int64_t fresh = 0;
    std::size_t pos = 0;
    while (!entries.empty() && pos + page_size <= tokens.size()) {
      auto it = entries.find(edge(parent, tokens.subspan(pos, page_size)));
      if (it == entries.end()) break;
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

  void clear() {
    entries.clear();
    order.clear();
    pages = 0;
  }
};

struct HiRadixCache::Arrived {
  static constexpr std::int64_t kFailed = 1, kOk = 2;
  static std::int64_t outcome(bool ok) { return ok ? kOk : kFailed; }
  std::unordered_map<NodeId, std::int64_t> writes, loads, backups;
  std::unordered_set<std::string> revoked;  // prefetch request ids
};

namespace {

std::string page_key(std::span<const std::int32_t> page) {
  return std::string(reinterpret_cast<const char*>(page.data()), page.size_bytes());
}

// The hash of an edge in its parent's map: its first page, and under the root the cache
// identity too (the page hashed with the identity's hash as the seed).
std::uint64_t edge_hash(bool at_root, std::string_view identity, std::span<const std::int32_t> page) {
  const XXH64_hash_t seed =
      at_root && !identity.empty() ? XXH3_64bits(identity.data(), identity.size()) : 0;
  return XXH3_64bits_withSeed(page.data(), page.size_bytes(), seed);
}

// The order of an edge among its siblings in describe(): its first page's bytes, and under the
// root its cache identity before them (length first, so an identity and a page never pose as
// another pair).
std::string edge_key(bool at_root, std::string_view identity, std::span<const std::int32_t> page) {
  if (!at_root || identity.empty()) return page_key(page);
  const auto n = static_cast<std::uint32_t>(identity.size());
  std::string key(reinterpret_cast<const char*>(&n), sizeof n);
  key += identity;
  key.append(reinterpret_cast<const char*>(page.data()), page.size_bytes());
  return key;
}

template <typename T>
void append(std::vector<T>& to, const std::vector<T>& from) {
  to.insert(to.end(), from.begin(), from.end());
}

}  // namespace

EvictionPolicy parse_eviction_policy(std::string_view name) {
  if (name == "lru") return EvictionPolicy::kLru;
  if (name == "lfu") return EvictionPolicy::kLfu;
  throw InvalidArgument(str_cat("unknown eviction policy '", name, "' (valid: lru, lfu)"));
}

std::string_view to_string(EvictionPolicy policy) {
  return policy == EvictionPolicy::kLfu ? "lfu" : "lru";
}

HiRadixCache::HiRadixCache(HiCacheController& controller, DeviceKVPool& device_pool,
                           HostKVPool& host_pool, RadixCacheConfig config,
                           StorageController* storage, const KeyNamespace* keys,
                           Collective* tp)
    : controller_(controller), device_pool_(device_pool), host_pool_(host_pool), config_(config),
      page_size_(device_pool.geometry().page_size), policy_(controller.config().write_policy),
      root_(Node::make({})), pending_(std::make_unique<Pending>()),
      arrived_(std::make_unique<Arrived>()), ghost_(std::make_unique<Ghost>()),
      index_(std::make_unique<Index>()), storage_(storage), tp_(tp) {
  ghost_->capacity_pages =
      (host_pool.capacity_tokens() + device_pool.allocator().capacity_tokens()) / page_size_;
  if ((storage == nullptr) != (keys == nullptr)) {
    throw InvalidArgument("radix cache: storage and its key namespace go together");
  }
  if (!config_.host_tier && storage != nullptr) {
    throw InvalidArgument("radix cache: host_tier false (device only) with a storage tier");
  }
  if (keys != nullptr) {
    keyer_ = std::make_unique<PageKeyer>(*keys);
    if (keyer_->page_size() != page_size_) {
      throw InvalidArgument(str_cat("radix cache: key namespace page_size ", keyer_->page_size(),
                                    " differs from the pools' ", page_size_));
    }
  }
  if (host_pool.geometry().page_size != page_size_) {
    throw InvalidArgument(str_cat("radix cache: host page size ", host_pool.geometry().page_size,
                                  " differs from the device's ", page_size_));
  }
  config_.validate();
  config_.load_back_min_tokens = std::max<std::int64_t>(config_.load_back_min_tokens, page_size_);
  root_->lock = 1;  // never evicted
  if (storage_ != nullptr) storage_->set_event_signal(controller_.events());
}

void RadixCacheConfig::validate() const {
  if (write_through_threshold < 1) {
    throw InvalidArgument(
        str_cat("radix cache: write_through_threshold ", write_through_threshold, " < 1"));
  }
  if (!(demote_low_watermark >= 0 && demote_low_watermark <= demote_high_watermark &&
        demote_high_watermark <= 1)) {
    throw InvalidArgument(str_cat("radix cache: demote watermarks low ", demote_low_watermark,
                                  " high ", demote_high_watermark,
                                  " must satisfy 0 <= low <= high <= 1"));
  }
  if (load_back_min_tokens < 0) {
    throw InvalidArgument(
        str_cat("radix cache: load_back_min_tokens ", load_back_min_tokens, " < 0"));
  }
  if (!(recompute_seconds_per_token >= 0 && std::isfinite(recompute_seconds_per_token))) {
    throw InvalidArgument(str_cat("radix cache: recompute_seconds_per_token ",
                                  recompute_seconds_per_token, " is not a finite number >= 0"));
  }
  if (edge_hash_bits < 1 || edge_hash_bits > 64) {
    throw InvalidArgument(str_cat("radix cache: edge_hash_bits ", edge_hash_bits, " is not in 1..64"));
  }
}

HiRadixCache::~HiRadixCache() = default;

void HiRadixCache::reset() {
  // The threads first: once they are stopped nothing reads or writes a page of either pool, and
  // every ack, revoke and op they held is dropped (reset starts them again). The storage
  // controller runs what is queued before it stops, so that TP ranks stop in step.
  if (storage_ != nullptr) storage_->reset();
  controller_.reset();
  pending_ = std::make_unique<Pending>();  // prefetch ops go; their host pages go with the pool
  prefetch_reserved_tokens_ = 0;
  arrived_ = std::make_unique<Arrived>();
  acks_.clear();
  backup_acks_.clear();
  revoked_.clear();
  ghost_->clear();  // node ids start again below the new root
  index_ = std::make_unique<Index>();
  root_ = Node::make({});
  root_->lock = 1;  // never evicted
  device_pool_.allocator().reset();
  host_pool_.reset();
  ++events_.resets;
}

std::uint64_t HiRadixCache::edge_of(const Node* parent, std::string_view identity,
                                    std::span<const std::int32_t> page) const {
  const std::uint64_t h = edge_hash(parent == root_.get(), identity, page);
  return config_.edge_hash_bits >= 64 ? h : h & ((std::uint64_t{1} << config_.edge_hash_bits) - 1);
}

HiRadixCache::Node* HiRadixCache::child_of(Node* node, std::span<const std::int32_t> page,
                                           std::string_view identity) const {
  const bool at_root = node == root_.get();
  return node->children.find(edge_of(node, identity, page), [&](const Node& c) {
    return (!at_root || c.identity == identity) &&
           std::equal(page.begin(), page.end(), c.key().begin());
  });
}

// Lazy: the node's entry in an eviction index keeps its older key (keys only grow: hits and
// access time), and eviction re-keys an entry it finds stale before taking it (next_victim), so
// a hit costs no index update.
void HiRadixCache::touch(Node* node) { node->last_access = ++clock_; }

std::uint64_t HiRadixCache::ghost_parent(const Node* parent, std::string_view identity) const {
  if (parent != root_.get() || identity.empty()) return static_cast<std::uint64_t>(parent->id);
  return XXH3_64bits(identity.data(), identity.size());
}

EvictKey HiRadixCache::evict_key(const Node* node) const {
  return {config_.eviction_policy == EvictionPolicy::kLfu ? node->hits : 0, node->last_access,
          node->id};
}

HiRadixCache::Node* HiRadixCache::next_victim(bool device) {
  EvictIndex& index = device ? index_->device : index_->host;
  while (!index.empty()) {
    auto first = index.begin();
    Node* n = first->second;
    const EvictKey now = evict_key(n);
    if (first->first == now) return n;  // every other key is older yet, and so is the node's
    auto& at = device ? n->indexed.device_at : n->indexed.host_at;
    index.erase(first);
    at = index.emplace(now, n).first;
  }
  return nullptr;
}

void HiRadixCache::refresh(Node* node) {
  if (node == root_.get()) return;  // holds no KV, never evicted
  const bool free_to_go = node->lock == 0 && node->write_op == 0 && node->load_op == 0;
  const EvictKey key = evict_key(node);
  Node::Indexed now;
  now.counted = true;
  now.on_device = !node->device.empty();
  now.device_tokens = static_cast<std::int64_t>(node->device.size());
  now.evictable_device_tokens = free_to_go ? now.device_tokens : 0;
  now.host_tokens = static_cast<std::int64_t>(node->host.size());
  now.stored_tokens = node->stored_pages * page_size_;
  now.writing = node->write_op != 0;
  now.loading = node->load_op != 0;
  now.backing_up = node->backup_op != 0;
  std::optional<EvictKey> device_key, host_key;
  if (free_to_go && now.on_device && node->device_children == 0 && !node->passed_over) {
    device_key = key;
  }
  if (free_to_go && !now.on_device && !node->host.empty() && node->children.empty()) {
    host_key = key;
  }
  Node::Indexed& was = node->indexed;
  index_->add(was, -1);
  index_->add(now, 1);
  now.device_at = was.device_at;
  now.host_at = was.host_at;
  Index::move(index_->device, now.device_at, device_key, node);
  Index::move(index_->host, now.host_at, host_key, node);
  const bool device_changed = was.on_device != now.on_device;
  was = now;
  if (device_changed) {
    node->parent->device_children += now.on_device ? 1 : -1;
    refresh(node->parent);  // it may have become (or stopped being) a device candidate
  }
}

void HiRadixCache::forget(Node* node) {
  Node::Indexed& was = node->indexed;
  index_->add(was, -1);
  Index::move(index_->device, was.device_at, std::nullopt, node);
  Index::move(index_->host, was.host_at, std::nullopt, node);
  const bool was_on_device = was.on_device;
  was = Node::Indexed{};
  if (was_on_device) {
    --node->parent->device_children;
    refresh(node->parent);
  }
}

HiRadixCache::Node* HiRadixCache::add_leaf(Node* parent, std::span<const std::int32_t> key,
                                           std::string_view identity) {
  auto leaf = Node::make(key);
  Node* l = leaf.get();
  l->id = next_id_++;
  l->parent = parent;
  if (parent == root_.get()) l->identity = identity;
  set_digests(l);
  parent->children.add(edge_of(parent, l->identity, key.first(page_size_)), std::move(leaf));
  touch(l);
  refresh(l);
  refresh(parent);  // no longer a leaf
  return l;
}

std::size_t HiRadixCache::common_tokens(const Node* child,
                                        std::span<const std::int32_t> tokens) const {
  std::size_t common = 0;
  const std::span<const std::int32_t> key = child->key();
  const std::size_t limit = std::min(key.size(), tokens.size() / page_size_ * page_size_);
  while (common < limit &&
         std::equal(key.begin() + static_cast<std::ptrdiff_t>(common),
                    key.begin() + static_cast<std::ptrdiff_t>(common + page_size_),
                    tokens.begin() + static_cast<std::ptrdiff_t>(common))) {
    common += page_size_;
  }
  return common;
}

HiRadixCache::Node* HiRadixCache::split(Node* node, std::size_t tokens) {
  forget(node);  // both halves are refreshed once in place
  auto mid = Node::make(node->key().first(tokens));
  Node* m = mid.get();
  m->id = next_id_++;
  m->parent = node->parent;
  if (!node->device.empty()) {
    m->device.assign(node->device.begin(), node->device.begin() + static_cast<std::ptrdiff_t>(tokens));
    node->device.erase(node->device.begin(), node->device.begin() + static_cast<std::ptrdiff_t>(tokens));
  }
  if (!node->host.empty()) {
    m->host.assign(node->host.begin(), node->host.begin() + static_cast<std::ptrdiff_t>(tokens));
    node->host.erase(node->host.begin(), node->host.begin() + static_cast<std::ptrdiff_t>(tokens));
  }
  node->drop_key_front(tokens);
  const auto upper_pages = static_cast<std::ptrdiff_t>(tokens / page_size_);
  if (!node->digests.empty()) {
    m->digests.assign(node->digests.begin(), node->digests.begin() + upper_pages);
    node->digests.erase(node->digests.begin(), node->digests.begin() + upper_pages);
  }
  m->stored_pages = std::min<std::int64_t>(node->stored_pages, upper_pages);
  node->stored_pages = std::max<std::int64_t>(0, node->stored_pages - upper_pages);
  m->backup_op = node->backup_op;
  if (node->backup_op != 0) pending_->backups[node->backup_op].nodes.push_back(m);
  m->lock = node->lock;  // every lock at or below node passed through the whole old node
  m->last_access = node->last_access;
  m->hits = node->hits;
  m->write_op = node->write_op;
  m->load_op = node->load_op;
  m->evict_after_write = node->evict_after_write;
  m->identity = node->identity;
  if (node->write_op != 0) pending_->writes[node->write_op].nodes.push_back(m);
  if (node->load_op != 0) pending_->loads[node->load_op].nodes.push_back(m);
  Node* parent = node->parent;
  // The upper half takes the node's place (the same first page), the node goes under it.
  std::unique_ptr<Node> lower = parent->children.take(
      edge_of(parent, m->identity, m->key().first(page_size_)), node,
      std::move(mid));
  node->parent = m;
  m->children.add(edge_of(m, {}, node->key().first(page_size_)), std::move(lower));
  refresh(m);
  refresh(node);
  return m;
}

HiRadixCache::MatchResult HiRadixCache::match_prefix(std::span<const std::int32_t> tokens,
                                                     std::string_view identity) {
  MatchResult r;
  r.last_device_node = r.last_host_node = root_.get();
  const std::size_t usable = tokens.size() / page_size_ * page_size_;
  Node* node = root_.get();
  std::size_t pos = 0;
  bool device_run = true;
  std::vector<Node*> to_write;
  while (pos < usable) {
    Node* child = child_of(node, tokens.subspan(pos, page_size_), identity);
    if (child == nullptr) break;
    const std::size_t common = common_tokens(child, tokens.subspan(pos, usable - pos));
    if (common < child->key().size()) child = split(child, common);
    ++child->hits;
    touch(child);
    if (device_run && !child->device.empty()) {
      append(r.device_slots, child->device);
      r.last_device_node = child;
    } else {
      device_run = false;
      r.host_hit_tokens += static_cast<std::int64_t>(child->key().size());
    }
    r.last_host_node = child;
    if (policy_ == WritePolicy::kWriteThroughSelective &&
        child->hits >= config_.write_through_threshold) {
      to_write.push_back(child);
    }
    pos += common;
    node = child;
    if (common < child->key().size()) break;
  }
  for (Node* n : to_write) {
    if (n->host.empty() && !n->device.empty() && n->write_op == 0) write_node(n);
  }
  events_.matched_device_tokens += r.device_slots.size();
  events_.matched_host_tokens += static_cast<std::uint64_t>(r.host_hit_tokens);
  events_.unmatched_tokens += tokens.size() - r.device_slots.size() -
                              static_cast<std::size_t>(r.host_hit_tokens);
  if (pos < usable) {
    events_.miss_evicted_tokens +=
        ghost_->take_evicted_tokens(ghost_parent(node, identity), tokens.subspan(pos, usable - pos),
                                    page_size_);
  }
  return r;
}

void HiRadixCache::register_metrics(MetricsRegistry& registry, MetricLabels labels) {
  metrics_.attach(registry, std::move(labels));
  const Events& e = events_;
  constexpr const char* kMatch = "hicache_match_tokens_total";
  constexpr const char* kMatchHelp =
      "Prompt tokens match_prefix found on each tier (none: not in the tree); every call counts";
  metrics_.add(kMatch, kMatchHelp, {{"tier", "device"}}, e.matched_device_tokens);
  metrics_.add(kMatch, kMatchHelp, {{"tier", "host"}}, e.matched_host_tokens);
  metrics_.add(kMatch, kMatchHelp, {{"tier", "none"}}, e.unmatched_tokens);
  metrics_.add("hicache_loaded_back_tokens_total", "Host tokens loaded back to the device", {},
               e.loaded_back_tokens);
  metrics_.add("hicache_prefetched_tokens_total", "Tokens prefetches from L3 added to the tree",
               {}, e.prefetched_tokens);
  constexpr const char* kEvicted = "hicache_evicted_tokens_total";
  constexpr const char* kEvictedHelp = "Tokens evicted from a tier";
  metrics_.add(kEvicted, kEvictedHelp, {{"tier", "device"}}, e.evicted_device_tokens);
  metrics_.add(kEvicted, kEvictedHelp, {{"tier", "host"}}, e.evicted_host_tokens);
  constexpr const char* kRefused = kMissesMetric;
  constexpr const char* kRefusedHelp = kMissesHelp;
  metrics_.add(kRefused, kRefusedHelp, {{"reason", "evicted"}}, e.miss_evicted_tokens);
  metrics_.add(kRefused, kRefusedHelp, {{"reason", "load_refused_by_cost"}},
               e.miss_load_refused_tokens);
  metrics_.add(kRefused, kRefusedHelp, {{"reason", "prefetch_refused_by_cost"}},
               e.miss_prefetch_refused_tokens);
  metrics_.add(kRefused, kRefusedHelp, {{"reason", "prefetch_revoked"}},
               e.miss_revoked_tokens);
  metrics_.add(kRefused, kRefusedHelp, {{"reason", "load_failed"}}, e.miss_load_failed_tokens);
  metrics_.add("hicache_write_failures_total", "Device-to-host writes that failed", {},
               e.write_failures);
  metrics_.add("hicache_collective_failures_total",
               "TP agreement calls that failed (each rank then goes alone)", {}, e.tp_failures);
  metrics_.add("hicache_demotions_total", "Demotion rounds between the watermarks", {},
               e.demotions);
  metrics_.add("hicache_resets_total", "Cache resets", {}, e.resets);
  constexpr const char* kUsed = "hicache_pool_used_tokens";
  constexpr const char* kUsedHelp = "Token slots in use per tier (device: as of the last step)";
  constexpr const char* kCapacity = "hicache_pool_capacity_tokens";
  constexpr const char* kCapacityHelp = "Token slots per tier";
  metrics_.add(kUsed, kUsedHelp, {{"tier", "device"}}, device_used_tokens_);
  HostKVPool* host = &host_pool_;
  metrics_.add_gauge_fn(kUsed, kUsedHelp, {{"tier", "host"}}, [host] {
    return static_cast<double>(host->capacity_tokens() - host->free_tokens());
  });
  const auto device_capacity = static_cast<double>(device_pool_.allocator().capacity_tokens());
  metrics_.add_gauge_fn(kCapacity, kCapacityHelp, {{"tier", "device"}},
                        [device_capacity] { return device_capacity; });
  const auto host_capacity = static_cast<double>(host_pool_.capacity_tokens());
  metrics_.add_gauge_fn(kCapacity, kCapacityHelp, {{"tier", "host"}},
                        [host_capacity] { return host_capacity; });
}

std::int64_t HiRadixCache::cached_prefix_tokens(std::span<const std::int32_t> tokens,
                                                std::string_view identity) const {
  const Node* node = root_.get();
  std::size_t pos = 0;
  while (pos + page_size_ <= tokens.size()) {
    const Node* child =
        child_of(const_cast<Node*>(node), tokens.subspan(pos, page_size_), identity);
    if (child == nullptr) break;
    const std::size_t common = common_tokens(child, tokens.subspan(pos));
    pos += common;
    if (common < child->key().size()) break;
    node = child;
  }
  return static_cast<std::int64_t>(pos);
}

std::int64_t HiRadixCache::insert(std::span<const std::int32_t> tokens,
                                  std::span<const std::int64_t> device_slots,
                                  std::string_view identity) {
  if (tokens.size() % page_size_ != 0) {
    throw InvalidArgument(str_cat("insert: ", tokens.size(), " tokens is not a whole number of ",
                                  page_size_, "-token pages"));
  }
  if (device_slots.size() != tokens.size()) {
    throw InvalidArgument(str_cat("insert: ", device_slots.size(), " device slots for ",
                                  tokens.size(), " tokens"));
  }
  Node* node = root_.get();
  std::size_t pos = 0;
  std::int64_t duplicate = 0;
  while (pos < tokens.size()) {
    Node* child = child_of(node, tokens.subspan(pos, page_size_), identity);
    if (child == nullptr) {
      Node* l = add_leaf(node, tokens.subspan(pos), identity);
      l->device.assign(device_slots.begin() + static_cast<std::ptrdiff_t>(pos), device_slots.end());
      refresh(l);
      if (policy_ == WritePolicy::kWriteThrough) write_node(l);
      return duplicate;
    }
    const std::size_t common = common_tokens(child, tokens.subspan(pos));
    if (common < child->key().size()) child = split(child, common);
    touch(child);
    // Cached already, on the device or on the host: the caller's slots duplicate it. (Adopting
    // them as the device copy of a host-only node would need a backup -> synced transition the
    // page states do not have; load_back is the way back to the device.)
    duplicate += static_cast<std::int64_t>(common);
    pos += common;
    node = child;
  }
  return duplicate;
}

void HiRadixCache::lock(Node* node) {
  for (Node* n = node; n != nullptr; n = n->parent) {
    if (++n->lock == 1) refresh(n);  // no longer evictable
  }
}

void HiRadixCache::unlock(Node* node) {
  for (Node* n = node; n != nullptr; n = n->parent) {
    if (n->lock <= (n == root_.get() ? 1 : 0)) {
      throw StateError(str_cat("unlock: node ", node->id, " is not locked"));
    }
  }
  for (Node* n = node; n != nullptr; n = n->parent) {
    if (--n->lock == 0) refresh(n);
  }
}

void HiRadixCache::write_node(Node* node) {
  if (!config_.host_tier) return;  // device only: the node stays device-only
  const auto tokens = static_cast<std::int64_t>(node->device.size());
  // TP: the room is judged on what every rank has alike (host_room(), and the writes in flight,
  // which the write queue holds at most), never on the pool's or the queue's own state, which
  // the controller's threads change at times that differ between ranks.
  const bool tp = agreeing();
  if (tp && (host_room() < tokens || pending_->writes.size() >= controller_.config().queue_capacity)) {
    return;  // host full or queue full: the node stays device-only
  }
  auto host = controller_.reserve_write(tokens);
  if (!host && !tp) return;  // host full or queue full: the node stays device-only
  if (host && !controller_.write_reserved(node->device, *host, 0, node->id)) return;  // stopped
  node->write_op = node->id;
  lock(node);
  pending_->writes[node->id] = Pending::Op{node, {node}};
  if (host) {
    node->host = std::move(*host);
  } else {
    // The room was there by the agreed count but not in this rank's pool: something else holds
    // its pages (the caller broke the contract of host_room()). The write fails here, and the
    // next check_events makes every rank drop it.
    arrived_->writes[node->id] = Arrived::kFailed;
  }
  refresh(node);
}

bool HiRadixCache::moving_pays(std::int64_t tokens, std::int64_t bytes_per_second, double* gbps,
                               double* estimate_s) {
  if (bytes_per_second == kUnmeasured) return true;
  const auto bandwidth = static_cast<double>(bytes_per_second);
  const double bytes =
      static_cast<double>(tokens) * static_cast<double>(device_pool_.geometry().token_bytes());
  *gbps = bandwidth / 1e9;
  *estimate_s = bytes / bandwidth;
  counters_.last_recompute_estimate_s =
      static_cast<double>(tokens) * config_.recompute_seconds_per_token;
  return *estimate_s <= counters_.last_recompute_estimate_s;
}

namespace {
// bytes / seconds as whole bytes per second (at least 1), or `unmeasured` before a transfer.
std::int64_t rate(double bytes, double seconds, std::int64_t unmeasured) {
  if (bytes <= 0 || seconds <= 0) return unmeasured;
  return std::max<std::int64_t>(1, static_cast<std::int64_t>(std::min(bytes / seconds, 1e18)));
}
}  // namespace

std::int64_t HiRadixCache::local_load_bps() const {
  const ControllerStats cs = controller_.stats();
  return rate(static_cast<double>(cs.bytes_loaded), cs.load_seconds, kUnmeasured);
}

std::int64_t HiRadixCache::local_prefetch_bps() const {
  if (storage_ == nullptr) return kUnmeasured;
  return rate(static_cast<double>(storage_->read_bytes()), storage_->read_seconds(), kUnmeasured);
}

// Measured bandwidths differ between ranks: TP ranks go by the slowest, as agreed.
std::int64_t HiRadixCache::load_bps() const {
  return agreeing() ? agreed_load_bps_ : local_load_bps();
}

std::int64_t HiRadixCache::prefetch_bps() const {
  return agreeing() ? agreed_prefetch_bps_ : local_prefetch_bps();
}

bool HiRadixCache::agreeing() const { return tp_ != nullptr && tp_->failure().empty(); }

bool HiRadixCache::all_ranks(bool local, const char* tag) {
  if (!agreeing()) return local;
  std::int64_t value[1] = {local ? 1 : 0};
  if (!tp_->min_allreduce(value, tag).ok) {
    ++events_.tp_failures;
    return local;  // the collective is failed for good: each rank goes on alone
  }
  return value[0] == 1;
}

std::int64_t HiRadixCache::host_room() const {
  if (!agreeing()) return host_pool_.free_tokens();
  return host_pool_.capacity_tokens() - index_->host_tokens - prefetch_reserved_tokens_;
}

bool HiRadixCache::load_back_pays(std::int64_t tokens) {
  if (config_.recompute_seconds_per_token <= 0) return true;
  const bool pays = moving_pays(tokens, load_bps(), &counters_.measured_load_gbps,
                                &counters_.last_load_estimate_s);
  if (!pays) {
    ++events_.load_backs_refused_by_cost;
    events_.miss_load_refused_tokens += tokens;
  }
  return pays;
}

std::optional<std::vector<std::int64_t>> HiRadixCache::load_back(Node* node) {
  std::vector<Node*> path;
  for (Node* n = node; n != root_.get(); n = n->parent) path.push_back(n);
  std::reverse(path.begin(), path.end());
  std::vector<Node*> missing;
  std::vector<std::int64_t> host;
  for (Node* n : path) {
    if (!n->device.empty()) continue;
    if (n->host.empty()) return std::nullopt;  // a gap: nothing to load it from
    missing.push_back(n);
    append(host, n->host);
  }
  if (!missing.empty()) {
    if (static_cast<std::int64_t>(host.size()) < config_.load_back_min_tokens) return std::nullopt;
    if (!load_back_pays(static_cast<std::int64_t>(host.size()))) return std::nullopt;
    const NodeId op = next_id_++;
    lock(node);  // the path stays while it loads (and eviction below cannot take it)
    auto device = controller_.load(host, 0, op);
    if (!device) {
      evict_device(static_cast<std::int64_t>(host.size()));
      device = controller_.load(host, 0, op);
    }
    if (!device) {
      unlock(node);
      return std::nullopt;
    }
    std::size_t at = 0;
    for (Node* n : missing) {
      n->device.assign(device->begin() + static_cast<std::ptrdiff_t>(at),
                       device->begin() + static_cast<std::ptrdiff_t>(at + n->key().size()));
      at += n->key().size();
      n->load_op = op;
      refresh(n);
    }
    pending_->loads[op] = Pending::Op{node, missing};
    events_.loaded_back_tokens += host.size();
  }
  std::vector<std::int64_t> out;
  for (Node* n : path) {
    touch(n);
    append(out, n->device);
  }
  return out;
}

void HiRadixCache::drop_device(Node* node) {
  const auto n = static_cast<std::int64_t>(node->device.size());
  if (!node->host.empty()) {
    controller_.evict_device(node->device, node->host);
  } else {
    device_pool_.allocator().free(node->device);
  }
  node->device.clear();
  refresh(node);
  events_.evicted_device_tokens += n;
}

void HiRadixCache::remove_leaf(Node* node) {
  Node* parent = node->parent;
  forget(node);
  ghost_->remember(ghost_parent(parent, node->identity), node->id, node->key(), page_size_);
  parent->children.take(
      edge_of(parent, node->identity, node->key().first(page_size_)), node);  // freed here
  refresh(parent);  // may be a leaf now
}

std::int64_t HiRadixCache::evict_device(std::int64_t tokens) {
  // The index holds the candidates in eviction order: unlocked, no op in flight, no child on
  // the device. A node without a host copy is dropped when nothing hangs below it; otherwise
  // (and always under write-back) it is written first and freed on the ack. Under the
  // write-through policies such a node is one whose write found the host pool full: without
  // this the device could fill up with inner nodes that nothing ever frees.
  std::int64_t freed = 0, scheduled = 0;  // scheduled: write-back evictions freed on the ack
  std::vector<Node*> passed_over;         // host full and a subtree below: kept this call
  while (freed + scheduled < tokens) {
    Node* n = next_victim(true);
    if (n == nullptr) break;
    if (n->host.empty() && (policy_ == WritePolicy::kWriteBack || !n->children.empty())) {
      write_node(n);
      if (n->write_op == 0 && !n->children.empty() && config_.host_tier) {
        // The host is full (on some rank): host-only leaves make room for its copy (without
        // it a device of such inner nodes could never be freed, nothing in flight to wait on).
        evict_host(static_cast<std::int64_t>(n->device.size()));
        write_node(n);
      }
      if (n->write_op != 0) {  // out of the index while it writes
        n->evict_after_write = true;
        scheduled += static_cast<std::int64_t>(n->device.size());
        continue;
      }
      if (!n->children.empty()) {
        n->passed_over = true;
        refresh(n);
        passed_over.push_back(n);
        continue;
      }
    }
    freed += static_cast<std::int64_t>(n->device.size());
    drop_device(n);  // its parent may become a candidate
    if (n->host.empty()) remove_leaf(n);  // no KV anywhere: the node goes
  }
  for (Node* n : passed_over) {
    n->passed_over = false;
    refresh(n);
  }
  return freed;
}

std::int64_t HiRadixCache::evict_host_to_free(std::int64_t target) {
  const std::int64_t need = target - host_room();
  return need > 0 ? evict_host(need) : 0;
}

std::int64_t HiRadixCache::evict_host(std::int64_t tokens) {
  // Candidates in eviction order: unlocked host-only leaves with no op in flight. A node that
  // goes may leave its parent such a leaf.
  std::int64_t freed = 0;
  while (freed < tokens) {
    Node* n = next_victim(false);
    if (n == nullptr) break;
    controller_.evict_host(n->host);
    freed += static_cast<std::int64_t>(n->host.size());
    remove_leaf(n);
  }
  events_.evicted_host_tokens += freed;
  return freed;
}

void HiRadixCache::apply_write_ack(NodeId id, std::int64_t agreed, std::int64_t local) {
  const bool ok = agreed == Arrived::kOk, local_ok = local == Arrived::kOk;
  auto taken = pending_->take(pending_->writes, id);
  if (!taken) return;
  Pending::Op& op = *taken;
  for (Node* n : op.nodes) {
    n->write_op = 0;
    if (!ok) {
      // The controller freed the host pages of a failed write; where the write worked here but
      // failed on another rank, this rank drops its copy too, so the trees stay identical.
      if (local_ok) host_pool_.discard(n->host);
      n->host.clear();
      n->evict_after_write = false;
    }
    refresh(n);
  }
  if (!ok) ++events_.write_failures;
  unlock(op.holder);
  for (Node* n : op.nodes) {
    if (n->evict_after_write) {
      n->evict_after_write = false;
      if (n->lock == 0 && n->load_op == 0) drop_device(n);
    }
    if (ok) backup_node(n);
  }
}

void HiRadixCache::apply_load_ack(NodeId id, std::int64_t agreed, std::int64_t local) {
  const bool ok = agreed == Arrived::kOk, local_ok = local == Arrived::kOk;
  auto taken = pending_->take(pending_->loads, id);
  if (!taken) return;
  Pending::Op& op = *taken;
  for (Node* n : op.nodes) {
    n->load_op = 0;
    if (!ok) {
      events_.miss_load_failed_tokens += n->device.size();
      // The device slots are not to be used; the host copy is intact. Where the load worked
      // here, its host pages went to synced: back to backup with the device copy freed.
      if (local_ok) {
        controller_.evict_device(n->device, n->host);
      } else {
        device_pool_.allocator().free(n->device);
      }
      n->device.clear();
    }
    refresh(n);
  }
  if (!ok) ++events_.load_failures;
  unlock(op.holder);
}

void HiRadixCache::apply_backup_ack(NodeId id, std::int64_t agreed, std::int64_t /*local*/) {
  auto taken = pending_->take(pending_->backups, id);
  if (!taken) return;
  const std::int64_t completed_tokens =
      pending_->forgotten_backups.erase(id) != 0 ? 0 : agreed - 1;
  // The op's pages run from the uppermost part (split off last) down to the holder.
  std::vector<Node*> nodes = taken->nodes;
  std::sort(nodes.begin(), nodes.end(), [](Node* a, Node* b) {
    int da = 0, db = 0;
    for (Node* n = a; n != nullptr; n = n->parent) ++da;
    for (Node* n = b; n != nullptr; n = n->parent) ++db;
    return da < db;
  });
  std::int64_t pages = completed_tokens / page_size_;
  for (Node* n : nodes) {
    n->backup_op = 0;
    const auto own = static_cast<std::int64_t>(n->key().size()) / page_size_;
    n->stored_pages = std::max(n->stored_pages, std::min(own, pages));
    pages = std::max<std::int64_t>(0, pages - own);
    refresh(n);
  }
  unlock(taken->holder);
}

std::uint64_t HiRadixCache::event_seq() const { return controller_.events()->seq(); }

bool HiRadixCache::wait_for_events(std::uint64_t seen,
                                   std::optional<std::chrono::steady_clock::time_point> deadline) {
  if (tp_ != nullptr && tp_->size() > 1 && tp_->failure().empty()) {
    std::this_thread::yield();
    return true;
  }
  auto until = deadline;
  if (storage_ != nullptr) {
    for (const auto& [id, p] : pending_->prefetches) {
      if (const auto d = storage_->terminate_deadline(*p.op)) until = until ? std::min(*until, *d) : *d;
    }
  }
  if (controller_.events()->wait(seen, until)) return true;
  return !deadline || *until < *deadline;  // woken for a prefetch's timeout: that is progress
}

void HiRadixCache::check_events() {
  apply_events();
  demote();
  // The device allocator is the main loop's: its occupancy is published here for a scrape.
  const auto& a = device_pool_.allocator();
  device_used_tokens_.set(static_cast<double>(a.capacity_tokens() - a.free_tokens()));
}

void HiRadixCache::demote() {
  if (config_.demote_low_watermark <= 0) return;
  const double capacity = static_cast<double>(device_pool_.allocator().capacity_tokens());
  const auto free_tokens = static_cast<double>(device_pool_.allocator().free_tokens());
  if (free_tokens >= config_.demote_low_watermark * capacity) return;
  // Tokens already on their way out: write-backs that free their device copy on the ack.
  std::int64_t leaving = 0;
  for (const auto& [id, op] : pending_->writes) {
    for (const Node* n : op.nodes) {
      if (n->evict_after_write) leaving += static_cast<std::int64_t>(n->device.size());
    }
  }
  const auto target =
      static_cast<std::int64_t>(config_.demote_high_watermark * capacity - free_tokens) - leaving;
  if (target <= 0) return;
  ++events_.demotions;
  evict_device(target);  // frees synced copies now, writes the others and frees them on the ack
}

void HiRadixCache::apply_events() {
  acks_.clear();
  controller_.drain_write_acks(acks_);
  for (const Ack& a : acks_) arrived_->writes[a.node] = Arrived::outcome(a.ok);
  acks_.clear();
  controller_.drain_load_acks(acks_);
  for (const Ack& a : acks_) arrived_->loads[a.node] = Arrived::outcome(a.ok);
  if (storage_ != nullptr) {
    backup_acks_.clear();
    storage_->drain_backup_acks(backup_acks_);
    for (const BackupAck& a : backup_acks_) arrived_->backups[a.id] = a.completed_tokens + 1;
    revoked_.clear();
    storage_->drain_revokes(revoked_);
    for (std::string& id : revoked_) arrived_->revoked.insert(std::move(id));
  }
  const bool agree = tp_ != nullptr && tp_->failure().empty();
  if (!agree) {
    // One rank (or the TP collective failed for good, and each rank goes on alone, counted):
    // apply everything that arrived.
    for (const auto& [id, v] : arrived_->writes) apply_write_ack(id, v, v);
    for (const auto& [id, v] : arrived_->loads) apply_load_ack(id, v, v);
    for (const auto& [id, v] : arrived_->backups) apply_backup_ack(id, v, v);
    arrived_->writes.clear();
    arrived_->loads.clear();
    arrived_->backups.clear();
    std::vector<std::string> finished;
    for (const auto& [id, p] : pending_->prefetches) {
      if (arrived_->revoked.count(id) != 0 || p.op->stage() == PrefetchStage::kFinished) {
        finished.push_back(id);
      }
    }
    std::sort(finished.begin(), finished.end());
    for (const std::string& id : finished) {
      // Finished prefetches become visible now, not when the scheduler next looks at them.
      const auto& op = *pending_->prefetches.at(id).op;
      finish_prefetch(id, false, op.completed_tokens() / page_size_);
    }
    arrived_->revoked.clear();
    return;
  }
  agree_and_apply();
}

// TP ranks: every change to the tree comes from values all ranks agreed on, so the trees stay
// identical (docs/architecture.md, "Tensor parallelism"). The ranks run the same ops in the same
// order, so their pending ops carry the same ids; for the oldest kAgreeSlots of each kind every
// rank says what arrived (0: not yet), and only what arrived everywhere is applied, with the
// outcome of the worst rank. The same min-reduction carries, per prefetch, whether this rank's
// policy lets it terminate and the pages it completed, and the bandwidths the cost rule weighs:
// the step's one collective call.
void HiRadixCache::agree_and_apply() {
  // Nothing pending: nothing can have arrived, and nothing is pending on any rank either (the
  // ranks start and end ops at the same agreed steps), so every rank skips the reduction alike.
  // An idle engine's steps cost no collective.
  if (pending_->writes.empty() && pending_->loads.empty() && pending_->backups.empty() &&
      pending_->prefetches.empty()) {
    arrived_->revoked.clear();  // revokes of prefetches that already ended
    return;
  }
  constexpr std::size_t K = kAgreeSlots;
  auto oldest = [](const auto& ops) {
    using Id = typename std::decay_t<decltype(ops)>::key_type;
    std::vector<Id> ids;
    ids.reserve(ops.size());
    for (const auto& [id, op] : ops) ids.push_back(id);
    std::sort(ids.begin(), ids.end());
    if (ids.size() > K) ids.resize(K);
    return ids;
  };
  const std::vector<NodeId> writes = oldest(pending_->writes), loads = oldest(pending_->loads),
                            backups = oldest(pending_->backups);
  const std::vector<std::string> prefetches = oldest(pending_->prefetches);
  // The buffer's sections; their sizes follow the pending sets, the same on every rank.
  const std::size_t W = writes.size(), L = loads.size(), B = backups.size(), P = prefetches.size();
  const std::size_t at_loads = W, at_backups = W + L, at_state = at_backups + B,
                    at_ready = at_state + P, at_pages = at_ready + P, at_bps = at_pages + P;
  agree_buffer_.assign(at_bps + 2, 0);
  // What arrived here, at `at` in the buffer; then, after the reduction, what arrived
  // everywhere goes to `apply(id, agreed, local)` and leaves the arrived set.
  auto fill = [&](const std::vector<NodeId>& ids, const auto& arrived, std::size_t at) {
    for (std::size_t i = 0; i < ids.size(); ++i) {
      if (auto it = arrived.find(ids[i]); it != arrived.end()) agree_buffer_[at + i] = it->second;
    }
  };
  auto apply = [&](const std::vector<NodeId>& ids, auto& arrived, std::size_t at, auto&& fn) {
    for (std::size_t i = 0; i < ids.size(); ++i) {
      if (agree_buffer_[at + i] == 0) continue;
      const std::int64_t local = arrived.at(ids[i]);
      arrived.erase(ids[i]);
      (this->*fn)(ids[i], agree_buffer_[at + i], local);
    }
  };
  fill(writes, arrived_->writes, 0);
  fill(loads, arrived_->loads, at_loads);
  fill(backups, arrived_->backups, at_backups);
  for (std::size_t i = 0; i < P; ++i) {
    const PrefetchOperation& op = *pending_->prefetches.at(prefetches[i]).op;
    if (arrived_->revoked.count(prefetches[i]) != 0) {
      agree_buffer_[at_state + i] = 1;
    } else if (op.stage() == PrefetchStage::kFinished) {
      agree_buffer_[at_state + i] = 2;
    }
    agree_buffer_[at_ready + i] = storage_->can_terminate(op) ? 1 : 0;
    agree_buffer_[at_pages + i] = op.completed_tokens() / page_size_;
  }
  agree_buffer_[at_bps] = local_load_bps();
  agree_buffer_[at_bps + 1] = local_prefetch_bps();
  if (!tp_->min_allreduce(agree_buffer_, "radix.events").ok) {
    ++events_.tp_failures;
    apply_events();  // the collective is failed for good: the local path from now on
    return;
  }
  agreed_load_bps_ = agree_buffer_[at_bps];
  agreed_prefetch_bps_ = agree_buffer_[at_bps + 1];
  apply(writes, arrived_->writes, 0, &HiRadixCache::apply_write_ack);
  apply(loads, arrived_->loads, at_loads, &HiRadixCache::apply_load_ack);
  apply(backups, arrived_->backups, at_backups, &HiRadixCache::apply_backup_ack);
  for (std::size_t i = 0; i < P; ++i) {
    const std::int64_t pages = agree_buffer_[at_pages + i];
    if (agree_buffer_[at_state + i] != 0) {
      finish_prefetch(prefetches[i], false, pages);  // revoked or finished everywhere
      continue;
    }
    Pending::Prefetch& p = pending_->prefetches.at(prefetches[i]);
    p.agreed_ready = agree_buffer_[at_ready + i] == 1;
    p.agreed_pages = pages;
  }
  // Revokes of prefetches that already ended (check_prefetch_progress got there first).
  std::erase_if(arrived_->revoked,
                [&](const std::string& id) { return pending_->prefetches.count(id) == 0; });
}

void HiRadixCache::set_digests(Node* node) {
  if (!keyer_) return;
  std::optional<PageDigest> seed;
  if (node->parent == root_.get() && !node->identity.empty()) {
    seed = keyer_->identity_seed(node->identity);
  }
  const PageDigest* prior = node->parent == root_.get()
                                ? (seed ? &*seed : nullptr)
                                : (node->parent->digests.empty() ? nullptr
                                                                 : &node->parent->digests.back());
  std::vector<std::string> keys;
  node->digests.clear();
  keyer_->keys(node->key(), prior, keys, &node->digests);
}

void HiRadixCache::backup_node(Node* node) {
  if (storage_ == nullptr || node->host.empty() || node->backup_op != 0 ||
      node->digests.size() * page_size_ != node->key().size() ||
      node->stored_pages * page_size_ == static_cast<std::int64_t>(node->key().size())) {
    return;
  }
  // Room in the queue by the backups in flight (the queue holds at most those), the same count
  // on every rank, so that none queues a backup the others do not.
  if (pending_->backups.size() >= storage_->backup_queue_capacity()) return;
  std::vector<std::string> keys;
  keys.reserve(node->digests.size());
  for (const PageDigest& d : node->digests) keys.push_back(keyer_->key(d));
  const auto id = storage_->write_storage(node->host, std::move(keys));
  if (!id) return;  // backup queue full: the node stays host-only, L1/L2 unaffected
  node->backup_op = *id;
  lock(node);
  refresh(node);
  pending_->backups[*id] = Pending::Op{node, {node}};
}

bool HiRadixCache::prefetch_from_storage(const std::string& request_id, Node* node,
                                         std::span<const std::int32_t> tokens,
                                         std::string_view identity) {
  if (storage_ == nullptr || pending_->prefetches.count(request_id) != 0) return false;
  const std::size_t usable = tokens.size() / page_size_ * page_size_;
  if (usable == 0) return false;
  if (node != root_.get() && node->digests.empty()) return false;  // no chain to continue
  if (config_.recompute_seconds_per_token > 0 &&
      !moving_pays(static_cast<std::int64_t>(usable), prefetch_bps(),
                   &counters_.measured_prefetch_gbps, &counters_.last_prefetch_estimate_s)) {
    // Reading it from L3 would take longer than recomputing it.
    ++events_.prefetches_refused_by_cost;
    events_.miss_prefetch_refused_tokens += usable;
    return false;
  }
  std::optional<PageDigest> prior;
  if (node != root_.get()) {
    prior = node->digests.back();
  } else if (!identity.empty()) {
    prior = keyer_->identity_seed(identity);
  }
  // Room in the queue and in the prefetch budget, by the prefetches in flight (the queue holds
  // at most those) and the host tokens they reserved: the same counts on every TP rank.
  const auto want = static_cast<std::int64_t>(usable);
  if (pending_->prefetches.size() >= storage_->prefetch_queue_capacity() ||
      prefetch_reserved_tokens_ + want > storage_->config().prefetch_budget_tokens) {
    return false;
  }
  lock(node);  // before making room: the prefix it continues must stay
  // Host pages for what it may fetch, reserved here as SGLang does (the pages past the hit are
  // freed when it ends): host memory changes hands only on this thread, at calls every rank
  // makes, so host_room() stays the same on every rank. Without room, host-only pages make it.
  if (const std::int64_t room = host_room(); room < want) evict_host(want - room);
  std::optional<std::vector<std::int64_t>> slots;
  if (host_room() >= want) slots = host_pool_.alloc(want);
  std::shared_ptr<PrefetchOperation> op;
  if (slots) op = storage_->prefetch_into(request_id, tokens.first(usable), prior, *slots);
  if (!op) {  // the host is short, or the controller stopped
    if (slots) host_pool_.free(*slots);
    unlock(node);
    return false;
  }
  prefetch_reserved_tokens_ += want;
  pending_->prefetches[request_id] = Pending::Prefetch{
      std::move(op), node,
      std::vector<std::int32_t>(tokens.begin(), tokens.begin() + static_cast<std::ptrdiff_t>(usable)),
      node == root_.get() ? std::string(identity) : std::string(), want};
  return true;
}

bool HiRadixCache::check_prefetch_progress(const std::string& request_id,
                                           std::int64_t* inserted_tokens) {
  if (inserted_tokens != nullptr) *inserted_tokens = 0;
  auto it = pending_->prefetches.find(request_id);
  if (it == pending_->prefetches.end()) {
    if (auto done = pending_->inserted.extract(request_id); !done.empty()) {
      if (inserted_tokens != nullptr) *inserted_tokens = done.mapped();
    }
    return true;
  }
  // Whether to terminate now depends on local timing: TP ranks go by what the last
  // check_events agreed (or one rank would terminate alone, a deadlock of the reference), and
  // keep the pages every rank had completed then.
  const Pending::Prefetch& p = it->second;
  std::optional<std::int64_t> pages;
  if (agreeing()) {
    if (!p.agreed_ready) return false;
    pages = p.agreed_pages;
  } else if (!storage_->can_terminate(*p.op)) {
    return false;
  }
  finish_prefetch(request_id, false, pages ? *pages : p.op->completed_tokens() / page_size_);
  if (inserted_tokens != nullptr) *inserted_tokens = pending_->inserted[request_id];
  pending_->inserted.erase(request_id);
  return true;
}

void HiRadixCache::release_aborted_request(const std::string& request_id) {
  if (pending_->prefetches.count(request_id) != 0) finish_prefetch(request_id, true, 0);
  pending_->inserted.erase(request_id);
}

std::size_t HiRadixCache::prefetches_in_flight() const { return pending_->prefetches.size(); }

void HiRadixCache::finish_prefetch(const std::string& request_id, bool aborted,
                                   std::optional<std::int64_t> agreed_pages) {
  arrived_->revoked.erase(request_id);
  auto node_handle = pending_->prefetches.extract(request_id);
  Pending::Prefetch& p = node_handle.mapped();
  const PrefetchResult r = storage_->terminate_prefetch(*p.op, agreed_pages);
  prefetch_reserved_tokens_ -= p.reserved;
  if (r.revoked && !aborted) {
    ++events_.revoked_prefetches;
    events_.miss_revoked_tokens += p.tokens.size();
  }
  std::int64_t inserted = 0;
  if (!aborted && r.tokens > 0) {
    inserted = insert_host(p.node, std::span(p.tokens).first(static_cast<std::size_t>(r.tokens)),
                           r.host_slots, p.identity);
    events_.prefetched_tokens += r.tokens;
  } else if (!r.host_slots.empty()) {
    host_pool_.free(r.host_slots);
  }
  pending_->inserted[request_id] = inserted;
  unlock(p.node);
}

std::int64_t HiRadixCache::insert_host(Node* node, std::span<const std::int32_t> tokens,
                                       std::span<const std::int64_t> host_slots,
                                       std::string_view identity) {
  std::size_t pos = 0;
  while (pos < tokens.size()) {
    Node* child = child_of(node, tokens.subspan(pos, page_size_), identity);
    if (child == nullptr) {
      Node* l = add_leaf(node, tokens.subspan(pos), identity);
      l->host.assign(host_slots.begin() + static_cast<std::ptrdiff_t>(pos), host_slots.end());
      l->stored_pages = static_cast<std::int64_t>(l->key().size()) / page_size_;  // came from L3
      refresh(l);
      return static_cast<std::int64_t>(tokens.size() - pos);
    }
    const std::size_t common = common_tokens(child, tokens.subspan(pos));
    if (common < child->key().size()) child = split(child, common);
    // Cached already (another request got there first): the fetched copy is not needed.
    host_pool_.free(host_slots.subspan(pos, common));
    touch(child);
    pos += common;
    node = child;
  }
  return 0;
}

void HiRadixCache::detach_storage() {
  if (storage_ == nullptr) return;
  if (tp_ != nullptr && tp_->failure().empty()) {
    storage_->stop_when_idle();
  } else {
    storage_->stop();
  }
  // Every op ended; each backup's ack is queued. Applied here, on each rank alone: what they
  // differ in (the pages completed) is forgotten below with everything known to be in L3.
  backup_acks_.clear();
  storage_->drain_backup_acks(backup_acks_);
  std::vector<NodeId> backups;
  for (const auto& [id, op] : pending_->backups) backups.push_back(id);
  std::sort(backups.begin(), backups.end());
  for (NodeId id : backups) apply_backup_ack(id, 1, 1);  // released, nothing counted as stored
  arrived_->backups.clear();
  revoked_.clear();
  storage_->drain_revokes(revoked_);
  // Prefetches end in the same order on every rank: terminate_prefetch agrees on each one's
  // completed pages, which are inserted (the rest freed).
  std::vector<std::string> prefetches;
  for (const auto& [id, p] : pending_->prefetches) prefetches.push_back(id);
  std::sort(prefetches.begin(), prefetches.end());
  for (const std::string& id : prefetches) {
    // The ranks agree on each one's completed pages here (the pages may differ by rank now
    // that every op ended, and no step's reduction saw the last of them).
    std::optional<std::int64_t> pages;
    if (!agreeing()) pages = pending_->prefetches.at(id).op->completed_tokens() / page_size_;
    finish_prefetch(id, false, pages);
  }
  arrived_->revoked.clear();
  storage_ = nullptr;
  keyer_.reset();
  forget_stored_pages();
}

void HiRadixCache::attach_storage(StorageController& storage, const KeyNamespace& keys) {
  if (storage_ != nullptr) throw StateError("attach_storage: L3 is attached already");
  if (!config_.host_tier) {
    throw InvalidArgument("attach_storage: the cache has no host tier (host_tier false)");
  }
  auto keyer = std::make_unique<PageKeyer>(keys);
  if (keyer->page_size() != page_size_) {
    throw InvalidArgument(str_cat("attach_storage: key namespace page_size ", keyer->page_size(),
                                  " differs from the pools' ", page_size_));
  }
  keyer_ = std::move(keyer);
  storage_ = &storage;
  storage_->set_event_signal(controller_.events());
  // Parents first: each node's chain continues its parent's last digest.
  for_each_node([this](Node* n) { set_digests(n); });
}

template <typename Fn>
void HiRadixCache::for_each_node(Fn&& fn) {
  std::vector<Node*> todo{root_.get()};
  while (!todo.empty()) {
    Node* n = todo.back();
    todo.pop_back();
    if (n != root_.get()) fn(n);
    n->children.for_each([&](Node* c) { todo.push_back(c); });
  }
}

void HiRadixCache::forget_stored_pages() {
  for (const auto& [id, op] : pending_->backups) pending_->forgotten_backups.insert(id);
  for_each_node([this](Node* n) {
    if (n->stored_pages == 0) return;
    n->stored_pages = 0;
    refresh(n);
  });
}

std::string HiRadixCache::describe() const {
  std::string out;
  std::function<void(const Node*, int)> walk = [&](const Node* n, int depth) {
    if (n != root_.get()) {
      out += str_cat(std::string(static_cast<std::size_t>(depth), ' '),
                     n->identity.empty() ? "" : str_cat("(", n->identity, ") "), "[", n->key().front(), "..+",
                     n->key().size(), "] dev ", n->device.size(), " host ", n->host.size(),
                     n->write_op != 0 ? " writing" : "", n->load_op != 0 ? " loading" : "",
                     n->backup_op != 0 ? " backing-up" : "", " lock ", n->lock, " stored ",
                     n->stored_pages, "\n");
    }
    std::vector<std::pair<std::string, const Node*>> children;
    n->children.for_each([&](const Node* c) {
      children.emplace_back(
          edge_key(n == root_.get(), c->identity, c->key().first(page_size_)), c);
    });
    std::sort(children.begin(), children.end());
    for (const auto& [k, c] : children) walk(c, depth + 1);
  };
  walk(root_.get(), -1);
  return out;
}

std::int64_t HiRadixCache::evictable_device_tokens() const {
  return index_->evictable_device_tokens;
}

RadixCacheStats HiRadixCache::stats() const {
  RadixCacheStats s = counters_;
  const auto v = [](const Counter& c) { return static_cast<std::int64_t>(c.value()); };
  s.demotions = v(events_.demotions);
  s.evicted_device_tokens = v(events_.evicted_device_tokens);
  s.evicted_host_tokens = v(events_.evicted_host_tokens);
  s.load_backs_refused_by_cost = v(events_.load_backs_refused_by_cost);
  s.load_failures = v(events_.load_failures);
  s.loaded_back_tokens = v(events_.loaded_back_tokens);
  s.prefetched_tokens = v(events_.prefetched_tokens);
  s.prefetches_refused_by_cost = v(events_.prefetches_refused_by_cost);
  s.resets = v(events_.resets);
  s.revoked_prefetches = v(events_.revoked_prefetches);
  s.tp_failures = v(events_.tp_failures);
  s.write_failures = v(events_.write_failures);
  s.nodes = index_->nodes;
  s.device_tokens = index_->device_tokens;
  s.evictable_device_tokens = index_->evictable_device_tokens;
  s.host_tokens = index_->host_tokens;
  s.writes_in_flight = index_->writing;
  s.loads_in_flight = index_->loading;
  s.backups_in_flight = index_->backing_up;
  s.stored_tokens = index_->stored_tokens;
  return s;
}

std::string HiRadixCache::check_invariants() const {
  std::string problem;
  std::int64_t nodes = 0, device_tokens = 0, host_tokens = 0, stored_tokens = 0;
  std::int64_t device_candidates = 0, host_candidates = 0, ops = 0, evictable = 0;
  std::function<void(const Node*)> walk = [&](const Node* n) {
    if (!problem.empty()) return;
    if (n != root_.get()) {
      const std::size_t len = n->key().size();
      if (len == 0 || len % page_size_ != 0) problem = str_cat("node ", n->id, ": key of ", len);
      else if (n->device.empty() && n->host.empty()) problem = str_cat("node ", n->id, ": no KV");
      else if (!n->device.empty() && n->device.size() != len)
        problem = str_cat("node ", n->id, ": ", n->device.size(), " device slots for ", len);
      else if (!n->host.empty() && n->host.size() != len)
        problem = str_cat("node ", n->id, ": ", n->host.size(), " host slots for ", len);
      else if (n->lock < 0) problem = str_cat("node ", n->id, ": lock ", n->lock);
      std::int64_t child_locks = 0;
      n->children.for_each([&](const Node* c) { child_locks += c->lock; });
      if (problem.empty() && n->lock < child_locks) {
        problem = str_cat("node ", n->id, ": lock ", n->lock, " below its children's ", child_locks);
      }
      // The indexes and totals, recomputed from the node as it is now.
      std::int64_t on_device_children = 0;
      n->children.for_each([&](const Node* c) { on_device_children += c->device.empty() ? 0 : 1; });
      const bool free_to_go = n->lock == 0 && n->write_op == 0 && n->load_op == 0;
      if (free_to_go) evictable += static_cast<std::int64_t>(n->device.size());
      const bool device_candidate = free_to_go && !n->device.empty() && on_device_children == 0;
      const bool host_candidate =
          free_to_go && n->device.empty() && !n->host.empty() && n->children.empty();
      // An entry's key may be older than the node's (touch is lazy), never newer.
      const EvictKey key = evict_key(n);
      auto indexed = [&](const std::optional<EvictIndex::iterator>& at) {
        return at && (*at)->second == n && (*at)->first <= key;
      };
      ++nodes;
      device_tokens += static_cast<std::int64_t>(n->device.size());
      host_tokens += static_cast<std::int64_t>(n->host.size());
      stored_tokens += n->stored_pages * page_size_;
      ops += (n->write_op != 0 ? 1 : 0) + (n->load_op != 0 ? 1 : 0) + (n->backup_op != 0 ? 1 : 0);
      device_candidates += device_candidate ? 1 : 0;
      host_candidates += host_candidate ? 1 : 0;
      if (!problem.empty()) {
      } else if (n->device_children != on_device_children) {
        problem = str_cat("node ", n->id, ": counts ", n->device_children,
                          " children on the device, has ", on_device_children);
      } else if (indexed(n->indexed.device_at) != device_candidate) {
        problem = str_cat("node ", n->id, device_candidate ? ": missing from" : ": stale in",
                          " the device eviction index");
      } else if (indexed(n->indexed.host_at) != host_candidate) {
        problem = str_cat("node ", n->id, host_candidate ? ": missing from" : ": stale in",
                          " the host eviction index");
      }
    }
    n->children.for_each([&](const Node* c) {
      if (c->parent != n) problem = str_cat("node ", c->id, ": wrong parent");
      // Found under its own edge: a child filed under another hash would never be matched.
      if (n->children.find(edge_of(n, c->identity, c->key().first(page_size_)),
                           [&](const Node& x) { return &x == c; }) != c) {
        problem = str_cat("node ", c->id, ": not under its first page in its parent's map");
      }
      walk(c);
    });
  };
  walk(root_.get());
  if (!problem.empty()) return problem;
  if (static_cast<std::int64_t>(index_->device.size()) != device_candidates ||
      static_cast<std::int64_t>(index_->host.size()) != host_candidates) {
    return str_cat("eviction indexes hold ", index_->device.size(), " device and ",
                   index_->host.size(), " host entries for ", device_candidates, " and ",
                   host_candidates, " candidates");
  }
  if (index_->nodes != nodes || index_->device_tokens != device_tokens ||
      index_->host_tokens != host_tokens || index_->stored_tokens != stored_tokens ||
      index_->writing + index_->loading + index_->backing_up != ops ||
      index_->evictable_device_tokens != evictable) {
    return str_cat("running totals (nodes ", index_->nodes, ", device ", index_->device_tokens,
                   ", host ", index_->host_tokens, ", stored ", index_->stored_tokens,
                   ", evictable ", index_->evictable_device_tokens, ") differ from the tree's (",
                   nodes, ", ", device_tokens, ", ", host_tokens, ", ", stored_tokens, ", ",
                   evictable, ")");
  }
  return problem;
}

}  // namespace hicache
