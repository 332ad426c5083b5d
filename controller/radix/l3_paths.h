// radix::L3Paths: HiRadixCache's paths to and from L3 (a StorageController): page digests that
// chain each node's keys (per cache identity), backups of synced host copies, prefetches that
// bring a prompt's continuation into host pages and insert it as host-resident nodes, and L3
// attached or detached at run time. It holds what only L3 needs (the storage controller, the
// key chain, the host tokens prefetches reserved, the backups' acks); the tree's structure, its
// locks, the eviction index, host eviction and the KV events it reaches through the cache it
// serves (L3Paths::Cache, HiRadixCache).
//
// TP: every call happens at the same step on every rank; the decisions it takes (room in a
// queue, in the prefetch budget, on the host) read only state that agreed events change, and a
// prefetch terminates only on what the ranks agreed (agreement.h).
//
// Not thread-safe: the engine's main loop owns it.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_set>
#include <vector>

#include "controller/radix/agreement.h"
#include "controller/radix/events.h"
#include "controller/radix/tree.h"
#include "controller/storage_controller.h"
#include "pools/host_kv_pool.h"
#include "storage/page_key.h"

namespace hicache::radix {

class L3Paths {
 public:
  // What the L3 paths ask of the cache they serve: tree edits that keep the tiers and the
  // eviction index right, locks, and the host tokens the tree may still take.
  class Cache {
   public:
    virtual void lock(Node* node) = 0;
    virtual void unlock(Node* node) = 0;
    virtual std::int64_t evict_host(std::int64_t tokens) = 0;
    virtual std::int64_t host_room() const = 0;
    // Tree::split with the tiers divided and the index refreshed.
    virtual Node* split_node(Node* node, std::size_t tokens) = 0;
    // Tree::add_leaf with its digests set and the index refreshed (the leaf holds no KV yet).
    virtual Node* add_node(Node* parent, std::span<const std::int32_t> key,
                           std::string_view identity) = 0;
    virtual void refresh(Node* node) = 0;
    // A backup's agreed ack: `node`'s pages [from, to) are in L3 (the KV events announce them;
    // `queued_at` is l3_removal_clock() when the backup was queued).
    virtual void l3_stored(const Node* node, std::int64_t from, std::int64_t to,
                           std::uint64_t queued_at) = 0;
    // The KV events' L3 removal clock (TierEvents::l3_clock; 0 without events), read as a
    // backup is queued.
    virtual std::uint64_t l3_removal_clock() const = 0;
    // A backup's agreed ack was applied to `node` (stored_pages updated, the op's lock
    // released): the tier policy frees a host copy that was leaving the host
    // (TierPolicy::backup_acked). The op's nodes come deepest first.
    virtual void backup_acked(Node* node) = 0;
    // Sidecar pools (docs/hybrid.md). A prefetch's host pages of each pool
    // (TierPolicy::reserve_prefetch_sidecars); `slots` of pool `pool` it counted that went
    // back (TierPolicy::sidecar_hosts_released); a host-only node takes the fetched pages of its
    // range (from the prefetch's page `first_page`) that it lacks, out of `fetched`
    // (SidecarUnits::adopt_host); free_sidecar_hosts frees (and stops counting) every slot of
    // `fetched`.
    virtual bool reserve_prefetch_sidecars(std::span<const std::int64_t> pages,
                                           std::vector<SidecarPagesIo>& out,
                                           std::vector<std::int64_t>& counted) = 0;
    virtual void sidecar_hosts_released(std::int32_t pool, std::int64_t slots) = 0;
    virtual void adopt_sidecar_hosts(Node* node, std::vector<SidecarPagesIo>& fetched,
                                     std::int64_t first_page) = 0;
    virtual void free_sidecar_hosts(std::span<const SidecarPagesIo> fetched) = 0;

   protected:
    ~Cache() = default;
  };

  // Everything referred to outlives this object.
  L3Paths(Cache& cache, Tree& tree, PendingOps& pending, ArrivedAcks& arrived, Agreement& agreement,
          CostRule& cost, CacheEvents& events, HostKVPool& host_pool);

  // L3 from now on: `storage` under `keyer` (its page size the tree's: the caller checked).
  // Nodes get the page digests they lack; the storage's events wake `signal`'s waiters.
  void attach(StorageController& storage, std::unique_ptr<PageKeyer> keyer,
              std::shared_ptr<EventSignal> signal);
  // See HiRadixCache::detach_storage. Nothing without L3.
  void detach();
  bool attached() const { return storage_ != nullptr; }
  // The tree forgets which of its pages L3 holds (backups in flight will count nothing).
  void forget_stored_pages();
  // Stops the storage threads after what they have queued, drops every prefetch's
  // reservation and the acks not yet drained (HiRadixCache::reset; the pending ops go there).
  void reset();

  // The digests that chain `node`'s page keys after its parent's (or its identity's seed).
  // Nothing without L3, unless keep_digests() was called (the KV events name pages by them).
  void set_digests(Node* node);
  // Every node gets its digests from now on, with L3 or without (sets those it lacks).
  void keep_digests(std::int32_t page_size);
  // Backs a synced host copy up to L3 when it is not there yet and the backup queue has room
  // (by the backups in flight); the host copy stays (no host eviction takes it) until the ack,
  // while the node's device copy may go. Nothing without L3, or for a node whose host write is
  // still in flight (not synced yet).
  void backup_node(Node* node);
  // Exclusive admission: backs up a host copy that is leaving the host (as backup_node); true
  // when its backup was queued. False, with nothing counted, when the backup queue has no room
  // by the backups in flight (the copy stays until a later eviction), without L3, or when the
  // node cannot be backed up (no page digests, a backup in flight).
  bool back_up_leaving(Node* node);
  // A backup's ack (agreed and local values as in ArrivedAcks: completed tokens + 1): the
  // leading pages the ranks completed count as stored (none for a backup whose store was
  // cleared meanwhile), the lock is released, then each node is handed to Cache::backup_acked.
  // Nothing for a backup that is not pending.
  void apply_backup_ack(NodeId id, std::int64_t agreed, std::int64_t local);

  // HiRadixCache::prefetch_from_storage, check_prefetch_progress, release_aborted_request.
  bool prefetch(const std::string& request_id, Node* node, std::span<const std::int32_t> tokens,
                std::string_view identity);
  bool check_progress(const std::string& request_id, std::int64_t* inserted_tokens);
  void release_aborted(const std::string& request_id);
  // Terminates the request's prefetch (with `agreed_pages` when the ranks agreed on the
  // completed pages already) and inserts what it fetched, or frees it all when `aborted`; a
  // revoked one is counted. REQUIRES: the prefetch is pending.
  void finish_prefetch(const std::string& request_id, bool aborted,
                       std::optional<std::int64_t> agreed_pages);
  // One rank (or the ranks no longer agree): ends every prefetch that was revoked or finished,
  // in request-id order, with the pages it completed here.
  void finish_arrived_prefetches();

  // Recency for L3 (StorageController::touch): the pages L3 holds of the path from the root to
  // `node`, in prefix order (a chain's head youngest), so that a full store evicts tails before
  // heads. For a match's deepest node (hits served from the device or host refresh what they
  // cover) and after a backup's ack (the older head made younger than the new tail). A node is
  // touched once until L3 gets new records (a later ack). Nothing without L3.
  void touch_path(Node* node);

  // Moves the backup acks and revoked prefetches that arrived into `arrived`.
  void drain_acks();
  // The cost rule's cut (once per step): a prefetch still loading past its deadline
  // (PendingOps::Prefetch::cut_at) stops after the batch in flight and ends with the pages that
  // arrived.
  void cut_late_prefetches();
  // The earliest timeout among the pending prefetches (the timeout policy, the cost rule's
  // deadlines), or `until`.
  std::optional<std::chrono::steady_clock::time_point> next_deadline(
      std::optional<std::chrono::steady_clock::time_point> until) const;
  // Host tokens held by prefetches in flight.
  std::int64_t reserved_tokens() const { return reserved_tokens_; }
  const StorageController* storage() const { return storage_; }
  // The namespace prefix of the page keys. REQUIRES: attached().
  const std::string& key_prefix() const { return keyer_->prefix(); }

 private:
  // Adds fetched host pages under `node`, with the sidecar pages fetched beside them; pages
  // already in the tree keep theirs and the fetched copies are freed, but for the sidecar pages
  // a host-only node (no op in flight) lacks: it takes them (a restore inside it may need them).
  // Returns the tokens added.
  std::int64_t insert_host(Node* node, std::span<const std::int32_t> tokens,
                           std::span<const std::int64_t> host_slots, std::string_view identity,
                           std::span<const SidecarPagesIo> sidecars);

  // A prefetch's sidecar reservation that no op took: `held` freed, the rest of `counted`
  // (pools this rank could not reserve) no longer counted.
  void release_sidecars(std::span<const SidecarPagesIo> held, std::span<const std::int64_t> counted);
  // Each pool's count a prefetch took (`counted`) less the slots `kept` still holds: released.
  void release_uncounted(std::span<const std::int64_t> counted,
                         std::span<const SidecarPagesIo> kept);

  Cache& cache_;
  Tree& tree_;
  PendingOps& pending_;
  ArrivedAcks& arrived_;
  Agreement& agreement_;
  CostRule& cost_;
  CacheEvents& events_;
  HostKVPool& host_pool_;
  StorageController* storage_ = nullptr;
  std::unique_ptr<PageKeyer> keyer_;
  // keep_digests(): chains digests without L3 (a digest does not depend on the namespace).
  std::unique_ptr<PageKeyer> digest_keyer_;
  std::int64_t reserved_tokens_ = 0;    // host tokens held by prefetches in flight
  std::vector<BackupAck> backup_acks_;  // reused
  // touch_path(): nodes whose path was touched since L3 last got new records.
  std::unordered_set<NodeId> touched_;
  std::vector<std::string> revoked_;    // reused
};

}  // namespace hicache::radix
