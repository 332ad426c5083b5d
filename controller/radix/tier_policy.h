// radix::TierPolicy: HiRadixCache's tier policy, the decisions that move a node's KV between the
// device (L1) and the host (L2) and their bookkeeping on the node:
//   - writes to the host: write_through on insert, write_through_selective once a match brings
//     a node's hits to the threshold, write_back only when the node is evicted from the device
//     (the device copy is freed on the write's ack); an eviction's write goes before backups;
//   - load back of a host-resident path to the device, refused below load_back_min_tokens or
//     when the cost rule (cost_model.h, CostRule) says recomputing is cheaper;
//   - device and host eviction in the eviction index's order, and demotion between the
//     watermarks at each step;
//   - L3 admission (storage_admission.h): write_through backs a host copy up once it is synced;
//     exclusive backs it up only as host eviction takes it (a copy already in L3 goes at once),
//     the host copy kept until the backup's ack, freed on it, kept when the backup did not land;
//   - the application of a write's or a load's ack (the agreed and this rank's outcome).
// A node's sidecar pages (a hybrid model's state, Node::sidecars) move with its KV in the same
// controller op, on every one of these paths: written, loaded back, evicted and freed together.
// A sidecar pool short of room makes it: a write evicts host-only leaves until the node's
// sidecar pages fit on the host, a load back evicts device nodes until they fit on the device
// (a state page is far larger than a KV page, and the KV pools' own room would never free one).
// It moves KV through the HiCacheController and the pools; the tree's locks, the refresh that
// keeps the eviction index and the KV events current, a leaf's removal and the L3 backups it
// asks of the cache it serves (TierPolicy::Cache, HiRadixCache).
//
// TP: every call happens at the same step on every rank; a write's room is judged on state that
// only agreed events change (host_room(), the writes in flight), never on the pool's or the
// queue's own state (docs/design-notes.md, "Tensor parallelism and collectives").
//
// Not thread-safe: the engine's main loop owns it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "controller/hicache_controller.h"
#include "controller/radix/agreement.h"
#include "controller/radix/events.h"
#include "controller/radix/eviction.h"
#include "controller/radix/node.h"
#include "controller/radix/storage_admission.h"
#include "controller/radix/tree.h"
#include "controller/storage_controller.h"
#include "pools/device_kv_pool.h"
#include "pools/host_kv_pool.h"

namespace hicache::radix {

class alignas(64) TierPolicy {
 public:
  // What the tier policy asks of the cache it serves.
  class Cache {
   public:
    // Lock counts on `node` and its ancestors (HiRadixCache::lock / unlock).
    virtual void lock(Node* node) = 0;
    virtual void unlock(Node* node) = 0;
    // After every change to a node's tiers, lock or ops in flight (the eviction index, the KV
    // events).
    virtual void refresh(Node* node) = 0;
    // Takes a leaf without KV out of the tree, remembering its pages as evicted.
    virtual void remove_leaf(Node* node) = 0;
    // A write's agreed ack made `node`'s host copy synced: the L3 paths may back it up
    // (write_through admission only).
    virtual void host_copy_synced(Node* node) = 0;
    // Exclusive admission: L3 is attached; and the backup of a host-only leaf that host
    // eviction takes (L3Paths::back_up_leaving: true when queued, the host copy then out of
    // host eviction until the ack, which comes back through backup_acked()).
    virtual bool l3_attached() const = 0;
    virtual bool back_up_leaving(Node* node) = 0;
    // Host tokens that prefetches in flight hold (they count against host_room()).
    virtual std::int64_t prefetch_reserved_tokens() const = 0;
    // Metrics are registered: evict_device times its calls (no clock read otherwise).
    virtual bool timed() const = 0;

   protected:
    ~Cache() = default;
  };

  struct Config {
    // false: device only, nothing is written to the host (evicted pages are gone).
    bool host_tier = true;
    std::int32_t write_through_threshold = 2;  // hits before a selective write; >= 1
    std::int64_t load_back_min_tokens = 0;     // smaller host hits are refused (recomputed)
    double demote_low_watermark = 0;           // fractions of the device pool; low 0: off
    double demote_high_watermark = 0;
    StorageAdmission storage_admission = StorageAdmission::kWriteThrough;
    std::int32_t storage_admission_min_hits = 1;  // reuse: matches before a backup; >= 1
  };

  // Write priorities (lower first in the controller's write queue, FIFO among equals): a write
  // that frees device memory on its ack (write-back eviction and demotion, the copy of an
  // evicted inner node) goes before backups (write-through and selective writes), which only
  // add a host copy: a scheduler waiting for device room waits on the first kind.
  static constexpr std::int64_t kEvictionWritePriority = 0, kBackupWritePriority = 1;

  // Everything referred to outlives this object. The write policy is the controller's.
  TierPolicy(Cache& cache, Tree& tree, EvictionIndex& index, PendingOps& pending,
             ArrivedAcks& arrived, Agreement& agreement, CostRule& cost, CacheEvents& events,
             HiCacheController& controller, DeviceKVPool& device_pool, HostKVPool& host_pool,
             Config config);

  // write_through_selective: a match that brought `node`'s hits to the threshold makes it due
  // for a write (write_selected). Inline: match_prefix asks it of every node it passes.
  bool selective_write_due(const Node& node) const {
    return selective_ && node.hits >= config_.write_through_threshold;
  }
  // The storage admission lets `node`'s synced host copy go to L3 (reuse: once a match brought
  // its hits to storage_admission_min_hits; write_through: always; exclusive: only on leaving
  // the host, never here).
  bool reused_enough(const Node& node) const {
    return !reuse_ || node.hits >= config_.storage_admission_min_hits;
  }
  // reuse: a match that brought `node`'s hits to the minimum makes its synced host copy due for
  // a backup (L3Paths::backup_node skips what is not synced, stored or backing up already).
  bool reuse_backup_due(const Node& node) const {
    return reuse_ && node.hits == config_.storage_admission_min_hits;
  }
  // Writes a device-only node with no write in flight to the host (at backup priority);
  // nothing for any other node, or when the host or the write queue is full.
  void write_selected(Node* node);
  // A leaf insert() added with device KV: write_through writes it to the host at once.
  void inserted(Node* leaf);

  // HiRadixCache::load_back: the device slots of the whole prefix up to `node`, after one
  // controller load of its host-resident part (those nodes stay locked until the load's ack);
  // nothing when refused (a node on neither tier, fewer host tokens than load_back_min_tokens,
  // recomputing cheaper by the cost rule, or the device short even after evicting).
  std::optional<std::vector<std::int64_t>> load_back(Node* node);
  // The cost rule for a load back of `tokens` with `sidecar_bytes` of sidecar pages beside
  // them (true when the rule is off); a refusal is counted.
  bool load_back_pays(std::int64_t tokens, std::int64_t sidecar_bytes = 0);

  // HiRadixCache::evict_device: frees up to `tokens` device tokens in the index's order;
  // returns how many were freed now (write-back writes, freed on their ack, count towards
  // `tokens` but not in the result). Fewer when the candidates run out.
  std::int64_t evict_device(std::int64_t tokens);
  // HiRadixCache::evict_host: frees host-only leaves (they leave the tree) in the index's order;
  // returns the tokens freed now. Exclusive admission with L3 attached: a leaf not yet whole in
  // L3 is backed up instead and freed on the ack (it counts towards `tokens`, not in the
  // result); eviction stops when the backup queue is full (room comes with the acks in flight).
  std::int64_t evict_host(std::int64_t tokens);
  // evict_host until host_room() reaches `target` (as far as host-only leaves allow); host
  // copies whose backup is in flight to leave the host count as free.
  std::int64_t evict_host_to_free(std::int64_t target);
  // A backup's agreed ack was applied to `node` (L3Paths::Cache::backup_acked): a host copy
  // that was leaving the host is freed when the whole node is in L3 and it is still a host-only
  // leaf nobody holds; when the backup did not land it stays (counted in backup_kept_tokens).
  void backup_acked(Node* node);
  // HiRadixCache::host_room: the pool's free count (one rank), or under TP its capacity less the
  // tree's host tokens and the prefetches' reservations (the same count on every rank).
  std::int64_t host_room() const;
  // When less than the low watermark of the device is free, evicts towards the high one (what
  // write-backs in flight will free counts as freed). Once per step.
  void demote();

  // A write's or a load's ack, with the agreed (worst over the ranks) and this rank's values
  // as encoded in ArrivedAcks. Nothing for an op that is not pending.
  void apply_write_ack(NodeId id, std::int64_t agreed, std::int64_t local);
  void apply_load_ack(NodeId id, std::int64_t agreed, std::int64_t local);

  // A prefetch's host pages of each sidecar pool (pages[i] pages of pool i), room made as a
  // write makes it (host-only leaves go while a pool is short by sidecar_host_room). Their
  // slots (pages[i] x slots_per_page, reserved or not) count with the tree's sidecar host slots
  // until released. False, nothing reserved, when a pool
  // stays short. A pool whose agreed room sufficed but whose own free pages did not (TP: the
  // controller's threads free pages at times that differ between the ranks) gets no slots, and
  // the prefetch restores nothing (StorageController::prefetch_into).
  // `counted`: each pool's slots counted.
  bool reserve_prefetch_sidecars(std::span<const std::int64_t> pages,
                                 std::vector<SidecarPagesIo>& out,
                                 std::vector<std::int64_t>& counted);
  // `slots` host slots of sidecar pool `pool` that a prefetch counted are no longer its (freed,
  // or never reserved on this rank); those a node took count as the node's.
  void sidecar_hosts_released(std::int32_t pool, std::int64_t slots) {
    sidecar_host_held_[static_cast<std::size_t>(pool)] -= slots;
  }
  // The tree was dropped (HiRadixCache::reset): it holds no sidecar host slots.
  void forget_sidecar_hosts() { std::fill(sidecar_host_held_.begin(), sidecar_host_held_.end(), 0); }

 private:
  // Writes a device-only node to the host at `priority`; nothing when the host or the queue is
  // full (the node stays device-only), or with no host tier.
  void write_node(Node* node, std::int64_t priority);
  // Frees `node`'s device copy (its host copy, if any, goes from synced to backup).
  void drop_device(Node* node);
  // Frees a host-only leaf's host copy; the node leaves the tree.
  void drop_host(Node* node);
  // Every page of `node` is in L3.
  bool whole_in_l3(const Node& node) const {
    return node.stored_pages * tree_.page_size() == static_cast<std::int64_t>(node.key().size());
  }
  // Host tokens of the backups in flight that free their host copy on the ack.
  std::int64_t leaving_host_tokens() const;
  // Fills io_ with the sidecar pages of `nodes` as the controller takes them (spans into the
  // nodes' lists: valid until those change).
  const std::vector<SidecarIo>& sidecar_io(std::span<Node* const> nodes);
  // Host slots sidecar pool `pool` may still take: its free count (one rank), or under TP its
  // capacity less the tree's sidecar host slots (the same on every rank, as host_room()).
  std::int64_t sidecar_host_room(std::int32_t pool) const;
  // Makes room on the host for every sidecar page of the device-only `node`, evicting host-only
  // leaves while a pool is short (by sidecar_host_room); false when they do not fit.
  bool make_sidecar_host_room(Node* node);
  // The same for `slots` host slots of sidecar pool `pool`; true when they fit.
  bool make_sidecar_host_room(std::int32_t pool, std::int64_t slots);
  // Reserves host pages for every sidecar page of `node` (SidecarPages::host) in this rank's
  // pools; false (nothing reserved) when a pool is short.
  bool reserve_sidecar_hosts(Node* node);
  // Allocates device pages for every sidecar page of `nodes` (SidecarPages::device), evicting
  // device nodes while a pool is short; false (nothing allocated) when they do not fit.
  bool alloc_sidecar_devices(std::span<Node* const> nodes);
  // Frees the sidecar device pages of `node` to their allocators and forgets them.
  void free_sidecar_devices(Node* node);
  // The host -> device load of `missing` (KV in `host`) for load_back under op id `op`; the
  // device slots, or nothing (nothing allocated or queued) when the device or the queue is short.
  std::optional<std::vector<std::int64_t>> load_nodes(std::span<Node* const> missing,
                                                      const std::vector<std::int64_t>& host,
                                                      NodeId op);

  // What insert, eviction and the acks read first, in one cache line: the scheduler's calls come
  // between the other work of a step, which evicts the caches.
  Cache& cache_;
  EvictionIndex& index_;
  HiCacheController& controller_;
  CacheEvents& events_;
  DeviceKVPool& device_pool_;
  PendingOps& pending_;
  WritePolicy policy_;
  bool selective_;  // policy_ is write_through_selective
  bool host_tier_;  // config_.host_tier
  bool exclusive_;  // config_.storage_admission is exclusive
  bool reuse_;      // ... is reuse
  Tree& tree_;
  ArrivedAcks& arrived_;
  Agreement& agreement_;
  CostRule& cost_;
  HostKVPool& host_pool_;
  Config config_;
  std::vector<SidecarIo> io_;  // reused by sidecar_io()
  // Per sidecar pool, the host slots the tree's nodes hold (writes in flight included) and
  // prefetches reserved: the agreed count sidecar_host_room() subtracts under TP.
  std::vector<std::int64_t> sidecar_host_held_;
  // Evictions in a row that free none of a short sidecar pool's pages before making room stops.
  static constexpr int kBarrenEvictions = 4;
};

}  // namespace hicache::radix
