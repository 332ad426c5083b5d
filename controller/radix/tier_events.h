// radix::TierEvents: the KV events of HiRadixCache (controller/kv_events.h): which pages the
// tree holds on the device (GPU) and on the host (CPU_PINNED), and which pages its backups
// made durable in L3 (DISK for a file store, EXTERNAL for Redis), published as one batch per
// step. Observations of the tree, never a second source of truth:
//   - a page is announced on the device once its KV is there (inserted, or a load's ack), and on
//     the host once its copy is synced (a write's ack, or a prefetch inserted it); removed when
//     it leaves that tier (eviction, a failed op, a reset);
//   - in L3 once a backup's ack says the ranks stored it (the agreed pages, never a failed
//     backup); removed when the store says a record went (its LRU, a corrupt record, a clear)
//     or when L3 is detached (what this cache announced there).
// Each node remembers what it announced (Node::announced); a split hands it to both halves, so
// the pages, not the nodes, are what a subscriber follows.
//
// Threads: everything but l3_removed() is the engine's main loop's (as the tree).
// l3_removed() is called on a storage thread; it publishes its own batch.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "controller/kv_events.h"
#include "controller/radix/node.h"
#include "transfer/mutex.h"

namespace hicache::radix {

class Tree;

class TierEvents {
 public:
  // `publisher` outlives this object; `l3` is the medium of the attached store's records.
  TierEvents(KvEventPublisher& publisher, const Tree& tree, std::int32_t page_size);

  // After any change of `node`'s tiers or ops in flight: queues what it holds now and had not
  // announced, and the removal of what it announced and no longer holds. REQUIRES: the node's
  // digests are set (one per page).
  void observe(Node* node);
  // `node` leaves the tree (whatever slots it still names go with it): the removal of what it
  // announced.
  void leaving(Node* node);
  // A backup's ack: `node`'s pages [from, to) are durable in L3 (the ranks agreed); queued
  // unless the store removed one of them since the backup was queued (`queued_at`, an
  // l3_clock() reading): a page is never announced in L3 after its removal was.
  void l3_stored(const Node* node, std::int64_t from, std::int64_t to, std::uint64_t queued_at);
  // The store removed these records (page keys; keys outside `prefix` are another namespace's
  // and ignored). Publishes the removal of those announced in L3 at once. Thread-safe.
  void l3_removed(std::span<const std::string> keys);
  // L3 from now on, records under `prefix` in `medium`; detach_l3() queues the removal of what
  // was announced there, and so does l3_cleared() (the store was emptied) without detaching.
  void attach_l3(std::string prefix, KvMedium medium);
  void detach_l3();
  void l3_cleared();
  // Removal clock (thread-safe): l3_stored's `queued_at`.
  std::uint64_t l3_clock() const;
  // No backup is in flight: the removals remembered for l3_stored() can go.
  void l3_forget_removals();
  // The tree goes (a reset): the removal of every page announced on the device or the host.
  void tree_dropped();
  // Sends what was queued since the last call as one batch (nothing when nothing was).
  void publish();

 private:
  std::int64_t parent_hash(const Node* node) const;
  const std::string& identity_of(const Node* node) const;

  KvEventPublisher& publisher_;
  const Tree& tree_;
  std::int32_t page_size_;
  std::vector<KvEvent> queued_;
  // L3: what this cache announced there and what the store removed since (for l3_stored).
  mutable Mutex l3_mu_;
  std::string l3_prefix_ HICACHE_GUARDED_BY(l3_mu_);
  KvMedium l3_medium_ HICACHE_GUARDED_BY(l3_mu_) = KvMedium::kDisk;
  bool l3_on_ HICACHE_GUARDED_BY(l3_mu_) = false;
  std::unordered_set<std::int64_t> l3_announced_ HICACHE_GUARDED_BY(l3_mu_);
  std::unordered_map<std::int64_t, std::uint64_t> l3_removed_at_ HICACHE_GUARDED_BY(l3_mu_);
  std::uint64_t l3_clock_ HICACHE_GUARDED_BY(l3_mu_) = 0;
};

}  // namespace hicache::radix
