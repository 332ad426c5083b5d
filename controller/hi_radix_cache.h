// HiRadixCache: the radix-tree prefix cache that drives the controller, as an engine's scheduler
// calls it every step (the reference is SGLang's HiRadixCache over its RadixCache).
//
// Keys are token ids; every edge holds whole pages (page_size tokens). A node's KV may be on the
// device (device slots), on the host (host slots), on both, or on neither (then the node is
// gone: this version keeps no storage-only nodes; docs/architecture.md, "Tiers and the life of
// a page", says why). Per node: lock count, last access, hit count.
//
// How an engine uses it, each step:
//   check_events()                     drain the controller's acks (writes done, loads done)
//   m = match_prefix(tokens)           device-resident prefix (slots ready to use), plus how many
//                                      more tokens sit on host (m.host_hit_tokens)
//   lock(m.last_host_node)             protect what the request uses from eviction
//   load_back(m.last_host_node)        host pages -> fresh device slots (layer by layer once the
//                                      controller's start_loading() runs); nothing when refused
//   ... forward pass; new KV in device slots from the device allocator ...
//   insert(tokens, slots)              returns how many leading tokens were cached already: the
//                                      caller frees those of its slots (they duplicate the tree's)
//   unlock(node)                       when the request finishes
//   evict_device(n) / evict_host(n)    when a pool runs short
//
// Write policies (ControllerConfig::write_policy): write_through backs a node up to host as soon
// as it is inserted; write_through_selective once its hit count reaches write_through_threshold;
// write_back only when it is evicted from the device (the device pages are freed when the write
// is acknowledged). A node with a write or a load in flight is locked; the ack unlocks it.
//
// Storage (optional, a StorageController): under the write_through admission (the default), once
// a node's host copy is synced it is backed up to L3 under its chained page keys (the host copy
// stays, out of host eviction, until the backup ack; the node is not locked, so its device copy
// may go meanwhile); under exclusive, a host copy goes to L3 only as it leaves the host (host
// eviction), kept until the ack and freed on it, kept on the host when the backup did not land;
// under reuse, as under write_through once a later request matched the node
// (RadixCacheConfig::storage_admission). A request whose prefix continues past the tree can prefetch_from_storage(); check_events() inserts every
// finished prefetch as host-resident nodes at once (the reference waits until the scheduler scans
// the request again), and check_prefetch_progress() terminates one per the prefetch policy.
// This version keeps no storage-only nodes: a node leaves the tree with its last tier above L3.
//
// Hybrid models (docs/hybrid.md): with sidecar pools in the controller, insert() takes each
// pool's pages of the sequence beside its KV (SidecarInsert); a node's KV pages and its sidecar
// pages are one unit, written, loaded back and evicted together. match_prefix() returns the
// restorable prefix: the longest prefix every pool can restore by its hit policy (an all_pages
// pool holds every page of it; a trailing pool the last window_pages pages before its end),
// never a longer one, and the device part is itself restorable; sidecar_device_slots() then
// names the device slots of a pool's pages on the matched path. This version keeps sidecar pools
// off L3 (an L3 store is refused at construction and in attach_storage).
//
// Inside, a coordinator over the rooms of controller/radix/ (docs/architecture.md, "The radix
// cache in rooms"): the tree's structure (tree.h), the eviction order and index (eviction.h),
// the ghosts of evicted pages (ghost_set.h), the TP agreement and the cost rule (agreement.h),
// the L3 paths and the backups' acks (l3_paths.h), the tier policy: writes, load back, device
// and host eviction, demotion and the writes' and loads' acks (tier_policy.h), the KV events
// (tier_events.h), a hybrid model's sidecar pages (sidecar_units.h). This class holds the
// public API, the tree edits that keep every room
// current (split, add, remove, refresh), locks and the step that drains, agrees and hands each
// ack to its room; its observations (stats, metrics, describe, check_invariants) are in
// hi_radix_cache_stats.cc.
//
// Not thread-safe: the engine's main loop owns it (as it owns the device allocator).
#pragma once

#include <chrono>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "controller/hicache_controller.h"
#include "controller/radix/events.h"
#include "controller/radix/eviction_policy.h"
#include "controller/radix/sidecar_types.h"
#include "controller/radix/storage_admission.h"
#include "controller/storage_controller.h"
#include "pools/device_kv_pool.h"
#include "pools/host_kv_pool.h"
#include "storage/page_key.h"

namespace hicache {

namespace radix {
struct Node;
class Tree;
class EvictionIndex;
class GhostSet;
struct PendingOps;
struct ArrivedAcks;
class Agreement;
class CostRule;
class L3Paths;
class TierPolicy;
class TierEvents;
class SidecarUnits;
}  // namespace radix

class KvEventPublisher;

struct RadixCacheConfig {
  // false: a device-only prefix cache (no hierarchy; the baseline hicache-bench --compare
  // measures against): nothing is written to the host, evicted pages are gone. Storage must be
  // absent then.
  bool host_tier = true;
  EvictionPolicy eviction_policy = EvictionPolicy::kLru;  // for both device and host eviction
  // A node's sidecar bytes (a hybrid model's state) weigh against its KV bytes in the eviction
  // order (radix::eviction_mark, docs/hybrid.md): a node holding much state per token it saves
  // leaves sooner. No effect without sidecar pools. false: the order of the last access alone
  // (the baseline the footprint benchmark measures against).
  bool weigh_footprint = true;
  std::int32_t write_through_threshold = 2;               // hits before a selective write
  std::int64_t load_back_min_tokens = 0;  // smaller host hits are recomputed (0: one page)
  // Cost-aware tiers (radix/cost_model.h): a host hit is loaded back, and an L3 hit prefetched,
  // only where moving it is predicted to take no longer than recomputing it; a prefetch still
  // loading once recomputing its tokens would have been done is cut at the pages that arrived.
  // The links' bytes per second and latency are fit online from the controllers' transfers, and
  // the engine's cost of recomputing one token (prefill, all layers, seconds) from its
  // record_prefill reports. Nothing (the default): on, the cost measured from the reports alone
  // (until the first, and until a link's first transfer, everything moves). > 0: on, this value
  // the prior the reports refine. 0, set explicitly: off (every hit moves).
  std::optional<double> recompute_seconds_per_token;
  // Demotion between watermarks (fractions of the device pool): when check_events() finds less
  // than `low` of the device free, it starts freeing LRU/LFU nodes until `high` would be free,
  // without blocking: synced copies go at once, write-back nodes are written and go on the
  // ack. Admission then finds room instead of evicting (and waiting) in the scheduler's path.
  // low = 0: off.
  double demote_low_watermark = 0;
  double demote_high_watermark = 0;
  // When host pages are written to L3 (storage_admission.h): write_through at once, exclusive
  // as they leave the host, reuse once requests asked for them again.
  StorageAdmission storage_admission = StorageAdmission::kWriteThrough;
  // reuse admission: the matches (later requests that passed a node) before its pages go to
  // L3. >= 1 (1: a prefix seen again).
  std::int32_t storage_admission_min_hits = 1;
  // Bits of an edge's 64-bit hash the tree keys children by (1..64). Only tests lower it: edges
  // then collide, which the tree handles (slower, never wrong).
  std::int32_t edge_hash_bits = 64;

  // Throws InvalidArgument naming the field and value that are out of range (the cross-field
  // rules between the cache, its pools and its storage are the constructor's).
  void validate() const;
};

struct RadixCacheStats {
  std::int64_t nodes = 0;
  std::int64_t device_tokens = 0;  // tokens whose KV the tree holds on the device
  // Of those, the ones in nodes no request holds and no copy is in flight for: what
  // evict_device can free (at once, or on a write's ack; SGLang's evictable_size). A scheduler
  // weighs free + evictable before it admits, so it never evicts for a request it then defers.
  std::int64_t evictable_device_tokens = 0;
  std::int64_t host_tokens = 0;       // ... on the host
  std::int64_t writes_in_flight = 0;  // nodes
  std::int64_t loads_in_flight = 0;   // nodes
  std::int64_t write_failures = 0, load_failures = 0;
  std::int64_t evicted_device_tokens = 0, evicted_host_tokens = 0;
  std::int64_t loaded_back_tokens = 0;
  std::int64_t stored_tokens = 0;      // tokens of tree nodes known to be in L3
  std::int64_t backups_in_flight = 0;  // nodes
  // Exclusive admission: host tokens whose backup on leaving the host did not land in L3 (they
  // stayed on the host; a later eviction tries again).
  std::int64_t backup_kept_tokens = 0;
  std::int64_t prefetched_tokens = 0, revoked_prefetches = 0;
  std::int64_t tp_failures = 0;  // TP agreement calls that failed (each rank then goes alone)
  // Cost-aware load back: refusals, prefetches cut past their deadline, and the inputs of the
  // last decision.
  std::int64_t load_backs_refused_by_cost = 0, prefetches_refused_by_cost = 0;
  std::int64_t prefetches_cut = 0;
  double measured_prefetch_gbps = 0, last_prefetch_estimate_s = 0;
  std::int64_t demotions = 0;  // check_events() calls that started a demotion
  std::int64_t resets = 0;
  double measured_load_gbps = 0, last_load_estimate_s = 0, last_recompute_estimate_s = 0;
};

class HiRadixCache {
 public:
  using Node = radix::Node;  // opaque to callers: pass back what the cache handed out

  // A sidecar pool's pages of an inserted sequence, and one sidecar page on a matched path
  // (controller/radix/sidecar_units.h).
  using SidecarInsert = radix::SidecarInsert;
  using SidecarPageSlots = radix::SidecarPageSlots;

  struct MatchResult {
    std::vector<std::int64_t> device_slots;  // KV of the device-resident prefix
    Node* last_device_node = nullptr;        // deepest node of that prefix (root when empty)
    Node* last_host_node = nullptr;          // deepest node whose KV is on device or host
    std::int64_t host_hit_tokens = 0;        // what load_back(last_host_node) would add
    // Of host_hit_tokens, those on the device already: past a hybrid model's restorable end
    // (docs/hybrid.md), or below a host-only node (a part computed again after its load back
    // was refused keeps its device copy); load_back copies only the rest from the host.
    std::int64_t resident_host_hit_tokens = 0;
  };

  // The pools and the controllers must outlive the cache and share the page size. `storage` and
  // `keys` go together (L3 on) or are both absent.
  HiRadixCache(HiCacheController& controller, DeviceKVPool& device_pool, HostKVPool& host_pool,
               RadixCacheConfig config = {}, StorageController* storage = nullptr,
               const KeyNamespace* keys = nullptr, Collective* tp = nullptr);
  ~HiRadixCache();
  HiRadixCache(const HiRadixCache&) = delete;
  HiRadixCache& operator=(const HiRadixCache&) = delete;

  std::int32_t page_size() const { return page_size_; }
  // Registers the cache's event counters (tokens matched per tier, loaded back, prefetched,
  // evicted; misses by reason; failures) in `registry` until destroyed or registered again.
  void register_metrics(MetricsRegistry& registry, MetricLabels labels = {});
  // The engine reports one prefill (SGLang's scheduler does so per prefill batch): of its
  // prompt tokens, how many were on the device, loaded back from the host, brought from L3 by
  // a prefetch (then loaded back), and computed. Counted in hicache_prefill_tokens_total by
  // source and hicache_prefill_hit_ratio. `compute_seconds`: the forward pass's time computing
  // the computed tokens (waits for loads excluded), which the cost rule weighs as the cost of
  // recomputing a token (RadixCacheConfig::recompute_seconds_per_token; with no computed
  // tokens it says nothing of that cost and is not used). InvalidArgument naming a negative
  // count or a negative or non-finite time (nothing counted).
  void record_prefill(std::int64_t device_tokens, std::int64_t host_tokens,
                      std::int64_t storage_tokens, std::int64_t computed_tokens,
                      std::optional<double> compute_seconds = std::nullopt);

  // Cache identity (`identity` below): what besides the tokens decides a page's KV, such as a
  // LoRA adapter, a cache salt or a tenant (SGLang's extra_key, vLLM's cache_salt). Sequences
  // of different identities never share a node or an L3 key; the empty identity is the cache
  // without identities. The tree keeps one subtree per identity under the root, and L3 keys
  // chain from PageKeyer::identity_seed.

  // Longest cached prefix of the whole pages of `tokens`; splits nodes at page boundaries and
  // updates access times and hit counts on the way.
  MatchResult match_prefix(std::span<const std::int32_t> tokens, std::string_view identity = {});

  // How many leading tokens of `tokens` (whole pages) the tree holds on the device or the host,
  // without match_prefix's side effects (no split, no access time, no hit). For accounting.
  std::int64_t cached_prefix_tokens(std::span<const std::int32_t> tokens,
                                    std::string_view identity = {}) const;

  // Adds tokens (whole pages) whose KV is in `device_slots` (one slot per token). Returns the
  // number of leading tokens already in the tree (on the device or the host); their slots stay
  // the caller's to free, the rest belong to the tree from now on. `sidecars`: each sidecar
  // pool's pages of the sequence; those of pages already in the tree stay the caller's too (the
  // tree keeps the pages it has: a checkpoint for a cached page is not adopted). Throws
  // InvalidArgument for a partial page, a slot count that differs, or a bad sidecar list (a pool
  // that does not exist or is given twice, pages out of order or out of range, an all_pages
  // pool missing a page the tree does not hold yet, slots that are not whole pages of the
  // pool); nothing changes then.
  std::int64_t insert(std::span<const std::int32_t> tokens,
                      std::span<const std::int64_t> device_slots, std::string_view identity = {},
                      std::span<const SidecarInsert> sidecars = {});
  // The pages of sidecar pool `pool` that the path from the root to `node` holds on the device,
  // page indices ascending (after a match: the state to restore the prefix from). Throws
  // InvalidArgument for a pool that does not exist.
  std::vector<SidecarPageSlots> sidecar_device_slots(const Node* node, std::int32_t pool) const;
  // The slots of sidecar pool `pool` the tree holds: {on the device, on the host}. A walk of the
  // tree, for tests and tools (the pool's used slots, when no request holds any).
  std::pair<std::int64_t, std::int64_t> sidecar_slots_held(std::int32_t pool) const;

  // Brings the host-resident nodes on the path to `node` back to the device (one controller
  // load; the forward pass waits per layer after start_loading()). Returns the device slots of
  // the whole prefix up to `node`, or nothing when refused: the host part is smaller than
  // load_back_min_tokens, recomputing it is predicted cheaper (recompute_seconds_per_token),
  // or the device is short even after evicting. Nodes being loaded are
  // locked until the load ack.
  std::optional<std::vector<std::int64_t>> load_back(Node* node);

  // Lock counts protect a node and its ancestors from eviction. Throws StateError when unlock
  // would take a count below zero.
  void lock(Node* node);
  void unlock(Node* node);

  // Frees at least `tokens` device tokens when it can (LRU over unlocked nodes none of whose
  // children is on the device); returns how many were freed now. write_back nodes without a
  // host copy are written first and freed on the ack (not counted here, but counted towards
  // `tokens` so that no more is written than needed); when the host is full they are dropped
  // like any node without a host copy.
  std::int64_t evict_device(std::int64_t tokens);
  // Frees host tokens of nodes that are on the host only (LRU, unlocked, leaves); returns how
  // many. Such nodes leave the tree.
  std::int64_t evict_host(std::int64_t tokens);
  // evict_host until `target` host tokens are free (as far as host-only leaves allow); returns
  // the tokens freed. With TP ranks "free" is host_room(), the same on every rank.
  std::int64_t evict_host_to_free(std::int64_t target);
  // Host tokens the tree may still take. One rank: the host pool's free count. TP ranks: the
  // pool's capacity less the host pages of the tree's nodes and of its prefetches in flight, a
  // count only agreed events change, so it is the same on every rank (the pool's own count
  // runs ahead of it on a rank whose write failed: the controller's thread frees the pages
  // before the ranks agree on the failure). Under TP the radix cache must be the only user of
  // the host pool and of the controllers' queues.
  std::int64_t host_room() const;
  // `local` with no TP ranks; with them, true only when it is true on every rank (one
  // min-reduction under `tag`), for the engine's own decisions that must not differ by rank.
  bool on_every_rank(bool local, const char* tag) { return all_ranks(local, tag); }

  // Drains the controllers' acks and applies them: writes done (and backups started), loads
  // done, backups done, revoked prefetches, finished prefetches inserted. Call once per step.
  // With a TP collective (`tp`, the main loop's own), every rank calls it every step, and it
  // makes the cache's only collective call: one min-reduction that carries everything the
  // ranks must agree on (what arrived, of the oldest kAgreeSlots ops of each kind; whether each
  // of those prefetches may terminate and the pages it completed; the bandwidths the cost rule
  // weighs), none when nothing is in flight. Only what arrived on every rank is applied, with
  // the worst rank's outcome, so the trees of all ranks stay identical. Every other decision
  // (a write's host room, a queue's room, host eviction, a prefetch's termination) is taken on
  // state that only agreed events change, so no other call of the cache makes a collective.
  void check_events();
  // Controller events (acks queued, prefetches changing stage) happened so far: read it before
  // check_events(), and when the step then finds nothing it can do, wait_for_events() with it.
  std::uint64_t event_seq() const;
  // Sleeps until an event after `seen`, or `deadline`, or the timeout of a pending prefetch
  // (the timeout policy) or its cost deadline (the cut), whichever comes first; no polling. False only when `deadline` passed
  // with nothing happening. With TP ranks it only yields (and says true): the ranks keep
  // stepping, since each check_events() is a collective all of them must join.
  bool wait_for_events(std::uint64_t seen,
                       std::optional<std::chrono::steady_clock::time_point> deadline = {});

  // Prefetches from L3 the whole pages of `tokens` that follow `node`'s prefix (`tokens` starts
  // right after it). When the host pool has less free than that, host-only pages are evicted
  // first (LRU/LFU) to make room. `node` stays locked until the prefetch ends. False when there is
  // no storage, nothing to fetch, or the request id is in use, and when it is declined: its
  // pages are fewer than the prefetch threshold (no hit could reach it), reading them would
  // cost more than recomputing, the queue or the prefetch budget is full, or the host has no
  // room (each counted in hicache_prefetch_outcomes_total). `identity` is the request's (it
  // matters when `node` is the root: deeper nodes carry theirs).
  bool prefetch_from_storage(const std::string& request_id, Node* node,
                             std::span<const std::int32_t> tokens, std::string_view identity = {});
  // True once the request's prefetch is over (its pages are in the tree, or it was revoked);
  // terminates it first when the policy allows (TP: when the last check_events agreed that every
  // rank's policy allows, with the pages all of them had completed then; a prefetch started in
  // this step is never terminated before the next check_events). False while it still loads. With
  // `inserted_tokens`, the first true also says how many tokens the prefetch added to the tree:
  // what it read from L3 less what another request had cached meanwhile (0 when revoked).
  bool check_prefetch_progress(const std::string& request_id,
                               std::int64_t* inserted_tokens = nullptr);
  // Ends a request's prefetch and frees what it fetched.
  void release_aborted_request(const std::string& request_id);
  std::size_t prefetches_in_flight() const;

  // Drops the whole tree and every op in flight (SGLang's flush_cache / HiRadixCache.reset):
  // stops the controllers' threads (nothing reads or writes a page afterwards), forgets every
  // pending ack, frees every device and host page, and starts the threads again. The caller
  // must hold nothing of the tree: no locks, no slots it got from it (the engine aborts its
  // requests first). Every TP rank calls it at the same step. Counters stay. With L3 it first
  // lets the storage threads run what they have queued (the same ops on every rank), so their
  // collectives stay in step.
  void reset();

  // L3 at run time; every TP rank calls these at the same step.
  // detach_storage: stops the storage threads (one rank: queued backups and prefetches are
  // cancelled; TP: what is queued runs first, so the ranks' collectives stay in step), applies
  // what they acknowledged (locks released, a prefetch's agreed pages inserted and the rest
  // freed, each page once), and forgets what the tree knew to be in L3. L1 and L2 keep serving;
  // the StorageController may be destroyed afterwards. Nothing without L3.
  void detach_storage();
  // attach_storage: L3 from now on, under `keys` (its page size the tree's; InvalidArgument
  // otherwise, and nothing changes). Nodes get the page digests they lack, so prefetches and
  // backups chain keys again. StateError when L3 is attached already.
  void attach_storage(StorageController& storage, const KeyNamespace& keys);
  // The store was emptied: the tree forgets which of its pages it held.
  void forget_stored_pages();

  // KV events (controller/kv_events.h): from now on the pages the tree holds on the device and
  // on the host, and those its backups made durable in L3, are published through `publisher`
  // (it outlives the cache), one batch per check_events(), reset() and detach_storage(). Call
  // it before the first insert (InvalidArgument otherwise, and StateError when called twice;
  // nothing changes then). Under TP, call it on the one rank that publishes: the trees agree.
  void publish_kv_events(KvEventPublisher& publisher);
  // The store removed these records (its LRU, a corrupt record, a clear): the removal of those
  // the events announced in L3 is published at once. Thread-safe (a store's threads call it);
  // nothing without KV events or L3.
  void l3_records_removed(std::span<const std::string> keys);

  // The block hashes (kv_block_hash of each page's digest) of the pages the tree holds on the
  // device (`device`: KV there, no load in flight) or on the host (a synced copy, no write in
  // flight), sorted: what a KV-event subscriber must have rebuilt, computed from the nodes, not
  // from what was announced. Empty without KV events (no digests). For tests and tools.
  std::vector<std::int64_t> held_block_hashes(bool device) const;

  RadixCacheStats stats() const;
  // stats().evictable_device_tokens without the rest: what evict_device can free, for a
  // scheduler weighing each admission (O(1), a running total).
  std::int64_t evictable_device_tokens() const;
  // Empty when the tree is consistent with itself and the pools: every lock count >= 0, no
  // node without KV, keys of whole pages, slot counts that match, parents locked at least as
  // much as their children; else the first problem found. For tests.
  std::string check_invariants() const;
  // The tree in a canonical order, one line per node (key, tiers, ops in flight, lock, pages in
  // L3), without slot numbers: equal on TP ranks whose trees are identical. For tests.
  std::string describe() const;

 private:
  // The rooms (controller/radix/): the tree's structure, the eviction order and index, the
  // ghosts of evicted pages, the ops in flight and the acks that arrived, the TP agreement and
  // the cost rule, the L3 paths, the tier policy, the KV events. This class coordinates them:
  // the public API, tree edits that keep every room current, locks, the step (check_events:
  // acks drained, agreed and handed to the room that applies them), metrics (the observations
  // are in hi_radix_cache_stats.cc).
  class Hooks;  // what the rooms ask of the cache (radix::L3Paths::Cache, TierPolicy::Cache)

  // Tree::split with the tiers divided (slots, digests, stored pages, ops in flight) and both
  // halves refreshed.
  Node* split(Node* node, std::size_t tokens);
  // Tree::add_leaf with its digests set and the index refreshed (no KV yet).
  Node* add_leaf(Node* parent, std::span<const std::int32_t> key, std::string_view identity);
  // The eviction index's refresh() and the KV events' observe(): every change to a node's
  // tiers, lock, ops in flight, hits or children is followed by it; check_invariants() checks
  // that none was missed.
  void refresh(Node* node);
  // Takes a leaf without KV out of the tree, remembering its pages as evicted.
  void remove_leaf(Node* node);
  // match_prefix with sidecar pools: cuts `r` (the whole match, ending at `end`) to the longest
  // restorable prefix, and its device part to the longest restorable one on the device,
  // splitting the nodes where a cut falls inside one.
  void cut_to_restorable(MatchResult& r);
  // The node that ends `pages` pages into the path to `end` (split there when a node spans the
  // cut); the root for 0.
  Node* node_at_page(Node* end, std::int64_t pages);

  void agree_and_apply();
  // Once per step: each link's counters into the cost rule's estimates.
  void sample_links();
  void apply_events();
  // `local` with no TP collective (or one failed for good), else true only when it is true on
  // every rank (one min-reduction under `tag`).
  bool all_ranks(bool local, const char* tag);

  HiCacheController& controller_;
  DeviceKVPool& device_pool_;
  HostKVPool& host_pool_;
  RadixCacheConfig config_;
  std::int32_t page_size_;
  // The write policy is write_through_selective: only then does match_prefix ask the tier
  // policy whether a node it passed is due for a write (no other room's memory on its path).
  bool selective_writes_;
  std::unique_ptr<radix::Tree> tree_;
  std::unique_ptr<radix::EvictionIndex> index_;
  std::unique_ptr<radix::GhostSet> ghost_;  // pages that left the tree: the "evicted" misses
  std::unique_ptr<radix::PendingOps> pending_;
  std::unique_ptr<radix::ArrivedAcks> arrived_;
  std::unique_ptr<radix::Agreement> agreement_;
  std::unique_ptr<radix::CostRule> cost_;
  std::unique_ptr<radix::SidecarUnits> sidecars_;  // a hybrid model's sidecar pages
  std::unique_ptr<Hooks> hooks_;
  std::unique_ptr<radix::L3Paths> l3_;
  std::unique_ptr<radix::TierPolicy> tiers_;        // write, load back, evict, demote; their acks
  std::unique_ptr<radix::TierEvents> tier_events_;  // null: no KV events
  // What happened, counted where it happens (the main loop) and read by a scrape on any thread.
  radix::CacheEvents events_;
  Gauge device_used_tokens_;
  MetricsScope metrics_;   // after what it registers: it goes first
  std::vector<Ack> acks_;  // reused
};

}  // namespace hicache
