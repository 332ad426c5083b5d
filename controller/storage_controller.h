// StorageController: the L2 <-> L3 half of the controller (docs/architecture.md, threads table).
//
// Prefetch (L3 -> L2), in two phases so host memory is never reserved for misses:
// prefetch(request_id, tokens, prior) queues an op and returns its handle. The prefetch thread
// hashes the tokens page by page, asks the backend how many leading pages it holds, and
// min-reduces that over the ranks. Below prefetch_threshold tokens the op is revoked (its request
// id goes on the revoke queue). Otherwise every rank reserves host pages for exactly the agreed
// hit, within the prefetch budget, and the ranks agree on what all of them got (reserve -> agree
// -> commit or abort: one rank short of memory or budget aborts it everywhere). The I/O worker
// then reads batch by batch into the host pages (in place where the layout has contiguous pages),
// counting a page as completed only once its bytes are in host memory, and stops at the first
// failed page or when terminated. terminate_prefetch(op) stops the op, min-reduces the completed
// pages over the ranks, hands the agreed prefix to the caller (host pages in state backup, and
// their keys) and frees the rest, exactly once.
//
// Collectives: each thread that reduces has its own Collective (prefetch thread, backup thread,
// and the caller's thread for terminate_prefetch), as SGLang uses separate process groups: two
// threads sharing one communicator would interleave their calls differently on different ranks.
// Every rank must queue the same ops in the same order (the scheduler is deterministic), and each
// op makes the same collective calls on every rank whatever the local outcome: local failures
// become values (zero hits, zero reserved, zero completed), never skipped calls.
//
// Backup: write_storage(host_slots, keys) queues an op; the backup thread writes it batch by
// batch (batch_pages() pages per batch_set, zero-copy from host pages where the layout has
// contiguous pages, else through a reused staging buffer), stops at the first page that failed,
// min-reduces the completed tokens over the TP ranks, and acks (id, completed tokens): completed
// is exactly the prefix every rank has stored (the reference acks a failed backup as if it had
// worked). With MLA only rank 0 writes; the others take part in the reduction with the full
// length. The queue is FIFO: every rank must run the same ops in the same order, since each op
// makes one collective call.
//
// Sidecar pools (a hybrid model's state, docs/hybrid.md): a backup names each pool's pages of
// the op beside the KV's, written under the pool's namespace (sidecar_namespace) after the KV's
// pages; the stored prefix is the leading pages whose KV and sidecar pages are all stored. A
// prefetch's hit is the longest prefix every pool can restore (RestorablePrefix) from the records
// L3 holds: the KV's leading run, then each pool's records of those pages asked one by one
// (exists_each), agreed by the ranks in one collective (RestorablePrefix::agree) instead of the
// KV hit's MIN. It reads the sidecar pages that restore that prefix (all_pages: every page,
// trailing: the window before its end), then the KV pages; completed_tokens() is the longest
// prefix the pages landed so far restore.
//
// A backend that throws or a collective that fails never ends the thread: the op is acked with
// zero completed tokens and the reason, and failed_ops() counts it.
//
// The caller keeps the host pages alive and unchanged (locked in the radix tree) until the ack.
#pragma once

#include <concurrentqueue/concurrentqueue.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "controller/event_signal.h"
#include "controller/read_pacer.h"
#include "pools/host_kv_pool.h"
#include "pools/sidecar_pool.h"
#include "storage/collective.h"
#include "storage/page_key.h"
#include "storage/storage_backend.h"
#include "transfer/mutex.h"
#include "transfer/op_queue.h"
#include "transfer/transfer_buffer.h"

namespace hicache {

enum class PrefetchPolicy {
  kBestEffort,    // the scheduler may terminate whenever it wants
  kWaitComplete,  // terminate only once the op has finished
  kTimeout,       // terminate once finished or after a time that grows with the pages, capped
};
// "best_effort", "wait_complete", "timeout"; throws InvalidArgument naming anything else.
PrefetchPolicy parse_prefetch_policy(std::string_view name);

struct StorageControllerConfig {
  // Pages per storage call (batch_get / batch_set); 0 (the default): the store's
  // preferred_batch_pages (FileStorage: 64 MiB, since each call has a fixed cost; RedisStorage:
  // about 4 MiB). A batch is also what terminate_prefetch may wait for, so it stays bounded.
  std::int64_t io_batch_pages = 0;
  bool mla = false;                  // KV identical on every rank: rank 0 alone writes
  std::size_t queue_capacity = 1024;
  // A hit below this many tokens is revoked (at least one page: smaller values mean one page).
  // The component's default is one page; HiCacheConfig's is 256 tokens (SGLang's).
  std::int64_t prefetch_threshold_tokens = 0;
  // Host tokens that prefetches may hold at once (reserved until terminated); must be >= one
  // page. A prefetch that would exceed it is declined (revoked).
  std::int64_t prefetch_budget_tokens = std::int64_t{1} << 40;
  PrefetchPolicy policy = PrefetchPolicy::kBestEffort;
  // kTimeout: base + per_page * pages, at most cap.
  std::chrono::milliseconds timeout_base{100}, timeout_per_page{2}, timeout_cap{5000};
};

enum class PrefetchStage {
  kQueued,   // waiting for, or in, the hit query and agreement
  kRevoked,  // below threshold, declined for budget or memory, or stopped: holds nothing
  kLoading,  // host pages reserved, the I/O worker reads (or will)
  kFinished, // the I/O worker is done with it (all read, failed, or terminated early)
  kTerminated,  // terminate_prefetch returned its result
};

class StorageController;

// The namespace of sidecar pool `spec`'s L3 records beside the KV's namespace `kv`: the KV's
// model and page size, the pool's name, policy, window and geometry in the fingerprint, its
// dtype, the page_first_direct layout, and this rank's shard (a sidecar pool is never shared by
// the ranks, even under MLA: every rank stores its own). A record of another pool, model,
// dtype, format or geometry has another key.
KeyNamespace sidecar_namespace(const KeyNamespace& kv, const SidecarSpec& spec);

// One sidecar pool's pages in a backup, a prefetch's reservation or its result.
struct SidecarPagesIo {
  std::int32_t pool = 0;  // the index of the pool in the controller's sidecars
  // The pages' indices in the op (page i of its KV), ascending. write_storage: the pages to
  // store. PrefetchResult: the pages kept. prefetch_into: unused (empty).
  std::vector<std::int64_t> pages;
  // Host slots of the pool, slots_per_page per page: one page per entry of `pages`; for
  // prefetch_into, the reservation (state reserved): one page per whole page of the tokens for
  // an all_pages pool, min(window, pages) for a trailing one.
  std::vector<std::int64_t> host_slots;
};

// Prefetch budget credits (host tokens held by prefetches). A credit gives its tokens back when
// released or destroyed, whichever comes first, so no path (error, revoke, stop, an op dropped
// by its owner) can leak budget and turn L3 off. The counter is shared so that a credit may
// outlive the controller.
class BudgetCredit {
 public:
  BudgetCredit() = default;
  // Takes `tokens` from `used` if that keeps it within `limit`; empty (tokens() == 0) otherwise.
  static BudgetCredit take(std::shared_ptr<std::atomic<std::int64_t>> used, std::int64_t tokens,
                           std::int64_t limit);
  BudgetCredit(BudgetCredit&& other) noexcept { *this = std::move(other); }
  BudgetCredit& operator=(BudgetCredit&& other) noexcept;
  ~BudgetCredit() { release(); }
  void release();
  std::int64_t tokens() const { return tokens_; }

 private:
  std::shared_ptr<std::atomic<std::int64_t>> used_;
  std::int64_t tokens_ = 0;
};

// The handle of one prefetch. Thread-safe to query.
class PrefetchOperation {
 public:
  const std::string& request_id() const { return request_id_; }
  PrefetchStage stage() const;
  // Agreed hit (tokens) once past the agreement; 0 before and when revoked.
  std::int64_t hit_tokens() const { return hit_pages_.load() * page_size_; }
  // Tokens whose bytes are in host memory on this rank so far.
  std::int64_t completed_tokens() const { return completed_pages_.load() * page_size_; }
  // The first storage error met on this rank, if any.
  std::string error() const;
  // True once the I/O worker read every page of the hit (not cut short): the pages wait in host
  // memory for terminate_prefetch. Lock-free.
  bool io_done() const { return io_done_.load(std::memory_order_acquire); }

  PrefetchOperation(std::string request_id, std::vector<std::int32_t> tokens,
                    std::optional<PageDigest> prior, std::int64_t page_size);

 private:
  friend class StorageController;
  // Replaces error_. Catch handlers set it through this function: clang's thread-safety
  // analysis does not look into handlers, but it checks this body.
  void set_error(std::string error) HICACHE_EXCLUDES(mu_);

  const std::string request_id_;
  std::vector<std::int32_t> tokens_;
  std::optional<PageDigest> prior_;
  const std::int64_t page_size_;
  std::chrono::steady_clock::time_point queued_at_ = std::chrono::steady_clock::now();

  mutable Mutex mu_;
  std::condition_variable cv_;
  PrefetchStage stage_ HICACHE_GUARDED_BY(mu_) = PrefetchStage::kQueued;
  bool worker_started_ HICACHE_GUARDED_BY(mu_) = false;
  // When the I/O worker finished reading every page of the hit (not cut short by a terminate):
  // terminate_prefetch measures from it how long the fetched pages waited to be taken.
  std::optional<std::chrono::steady_clock::time_point> io_done_at_ HICACHE_GUARDED_BY(mu_);
  // io_done_at_ is set: read by io_done() without mu_ (the radix cache asks at every step for
  // every pending prefetch).
  std::atomic<bool> io_done_{false};
  std::string error_ HICACHE_GUARDED_BY(mu_);
  std::atomic<bool> terminate_{false};
  std::atomic<std::int64_t> hit_pages_{0};
  std::atomic<std::int64_t> completed_pages_{0};
  std::vector<std::string> keys_;      // the agreed hit's keys
  std::vector<std::int64_t> slots_;    // host slots reserved for them
  // Per sidecar pool (prefetch_into): the caller's reservation, and once agreed the pages to
  // read (op page indices), the pool pages they land in, and which landed (the I/O worker's).
  struct SidecarFetch {
    std::vector<std::int64_t> reserved;  // empty: this rank could not reserve (no hit here)
    std::vector<std::int64_t> at, host_pages;
    std::vector<std::uint8_t> landed;
  };
  std::vector<SidecarFetch> sidecars_;
  bool caller_slots_ = false;          // slots_ came from prefetch_into (all kept to terminate)
  BudgetCredit budget_;                // credits held while host pages are reserved
};

struct PrefetchResult {
  bool revoked = false;                   // the op was revoked (nothing fetched, all freed)
  std::int64_t tokens = 0;                // agreed completed prefix
  std::vector<std::int64_t> host_slots;   // its host slots (pages in state backup)
  std::vector<std::string> keys;          // one per page
  // Per sidecar pool that kept pages: the pages of the prefix it restores (pages in state
  // backup, as the KV's); the rest of the reservation was freed.
  std::vector<SidecarPagesIo> sidecars;
};

struct BackupAck {
  std::int64_t id = 0;
  std::int64_t completed_tokens = 0;  // the stored prefix, agreed by every rank
  std::int64_t total_tokens = 0;
  std::string error;                  // why completed < total, when known on this rank
};

class StorageController {
 public:
  // Throws InvalidArgument naming a bad config value. `keyer` names the pages (this rank's
  // namespace); the three collectives serve the prefetch thread, the backup thread and the
  // caller of terminate_prefetch (all of one TP group, one communicator each). `sidecars`: the
  // cache's sidecar pools (their host tiers move to and from L3 with the KV), in the order
  // SidecarPagesIo::pool names them; they outlive the controller.
  StorageController(HostKVPool& host, StorageBackend& storage, const KeyNamespace& keys,
                    Collective& prefetch_collective, Collective& backup_collective,
                    Collective& main_collective, StorageControllerConfig config = {},
                    std::vector<SidecarPool*> sidecars = {});
  ~StorageController();
  StorageController(const StorageController&) = delete;
  StorageController& operator=(const StorageController&) = delete;

  StorageBackend& storage() const { return storage_; }

  // Queues the backup of the pages of `host_slots` (whole pages, in order) under `keys`, one per
  // page, and of the sidecar pages of `sidecars` beside them. Returns the op id, or nothing when
  // the queue is full or stopped. Throws InvalidArgument (nothing queued) when the slots are not
  // whole pages of this pool or the counts differ or a key is invalid, or a sidecar entry names
  // a pool that does not exist or twice, pages out of order or outside the op, or slots that
  // are not one whole page of the pool per page.
  std::optional<std::int64_t> write_storage(std::span<const std::int64_t> host_slots,
                                            std::vector<std::string> keys,
                                            std::span<const SidecarPagesIo> sidecars = {});

  // Whether write_storage() / prefetch() would find room in their queue now. Only the caller's
  // thread pushes, and the threads only take, so the answer holds until the caller's next push.
  // It differs between TP ranks (their threads take at their own pace): a caller that must
  // decide alike on every rank counts its own ops in flight against the capacities instead.
  bool can_queue_backup() const { return backup_queue_.size() < backup_queue_.capacity(); }
  bool can_queue_prefetch() const { return prefetch_queue_.size() < prefetch_queue_.capacity(); }
  std::size_t backup_queue_capacity() const { return backup_queue_.capacity(); }
  std::size_t prefetch_queue_capacity() const { return prefetch_queue_.capacity(); }
  const StorageControllerConfig& config() const { return config_; }

  // Recency for the store (StorageBackend::touch): `keys`, a chain in prefix order, pages the
  // cache just served or backed up. Handed to the touch thread, which passes each chain to the
  // store in the order they came (a later chain ends younger); never waits for the store. A
  // hint: chains beyond kMaxPendingTouchKeys keys waiting are dropped and counted
  // (hicache_storage_touch_keys_total{result="dropped"}). Throws InvalidArgument for a bad key.
  void touch(std::vector<std::string> keys);
  static constexpr std::size_t kMaxPendingTouchKeys = std::size_t{1} << 16;
  // Keys touch() passed to the store so far.
  std::int64_t touched_keys() const { return static_cast<std::int64_t>(touched_keys_.value()); }

  // Moves finished backups' acks into `out` (appends); never blocks.
  std::size_t drain_backup_acks(std::vector<BackupAck>& out);

  // Queues a prefetch of the whole pages of `tokens`, chained after `prior` (the digest of the
  // page before tokens[0]; nothing at the start of a sequence). Returns nothing when the queue is
  // full or stopped. Throws InvalidArgument for an empty request id, and with sidecar pools
  // (their pages need the caller's reservation: prefetch_into).
  std::shared_ptr<PrefetchOperation> prefetch(std::string request_id,
                                              std::span<const std::int32_t> tokens,
                                              std::optional<PageDigest> prior = std::nullopt);
  // As prefetch(), into host slots the caller reserved before it asked (SGLang's radix cache
  // allocates them first): `host_slots` whole pages in state reserved, at least one per whole
  // page of `tokens`. The op owns them from here; the hit is read into the first of them, and
  // terminate_prefetch frees every one past the agreed prefix (all of them when the op was
  // revoked) and returns the prefix. Nothing is freed on the controller's threads: the host
  // pool's free count changes only on the caller's thread, at calls every TP rank makes in the
  // same order, so an allocation there finds the same room on every rank. Takes no prefetch
  // budget (the caller limits what it reserves). The ranks agree on the hit only: the caller's
  // slots hold it on every rank. With sidecar pools, `sidecars` reserves each pool's host pages
  // (SidecarPagesIo::host_slots; every pool once), owned by the op as the KV's are. A pool
  // given no slots at all: this rank could not reserve them (under TP a pool's free count can
  // differ between the ranks); the op still runs its collectives, with no hit on this rank, so
  // the ranks agree on nothing restorable and it is revoked everywhere. Returns
  // nothing, the slots still the caller's, when the queue is full or stopped. Throws
  // InvalidArgument (malformed or too few slots, a sidecar pool missing, unknown or twice, empty
  // request id) or StateError (a page not reserved); nothing changes then.
  std::shared_ptr<PrefetchOperation> prefetch_into(std::string request_id,
                                                   std::span<const std::int32_t> tokens,
                                                   std::optional<PageDigest> prior,
                                                   std::span<const std::int64_t> host_slots,
                                                   std::span<const SidecarPagesIo> sidecars = {});
  // Host pages of sidecar pool `pool` that prefetch_into reserves for `pages` whole pages: all
  // of them for an all_pages pool, min(window, pages) for a trailing one.
  std::int64_t sidecar_reserve_pages(std::int32_t pool, std::int64_t pages) const;
  std::size_t num_sidecars() const { return sidecars_.size(); }
  // The key of sidecar pool `pool`'s record of the page whose KV key is `kv_key` (a key of this
  // controller's namespace). Thread-safe.
  std::string sidecar_key(std::size_t pool, const std::string& kv_key) const;
  // Whether held_pages() answers without I/O: the store's exists_without_io().
  bool answers_held_pages_locally() const { return storage_.exists_without_io(); }
  // How many leading pages of `keys` (a prefetch's page keys, in order: the radix cache's
  // keyer) L3 holds and could restore; with sidecar pools the longest prefix every pool
  // restores (RestorablePrefix). This rank's answer, no collective: asked on the caller's
  // thread of a store that answers without I/O (answers_held_pages_locally()), before any host
  // memory is reserved. A failed query answers 0 (counted in the failed ops). Thread-safe.
  std::int64_t held_pages(std::span<const std::string> keys);
  // Moves revoked request ids into `out`; never blocks.
  std::size_t drain_revokes(std::vector<std::string>& out);
  // Whether the policy lets the scheduler terminate `op` now (this rank's view; the scheduler
  // agrees across ranks before acting on it).
  bool can_terminate(const PrefetchOperation& op) const;
  // Changes the prefetch policy from now on (ops in flight included): the main loop's thread
  // only (the one that asks can_terminate), every TP rank at the same step. For a check that
  // must not depend on timing (hicache-stress's end-of-run L3 probe takes wait_complete).
  void set_prefetch_policy(PrefetchPolicy policy) { config_.policy = policy; }
  // Tells `op`'s I/O to stop after the batch in flight (the cost rule's cut: a prefetch that no
  // longer pays); the op then finishes with the pages that landed, which terminate_prefetch
  // agrees on and keeps as for any op. Never blocks; nothing once the op stopped reading.
  void cut_prefetch(PrefetchOperation& op) const { op.terminate_ = true; }
  // When time alone will make can_terminate(op) true (the timeout policy, while op still
  // loads); nothing when only a stage change can.
  std::optional<std::chrono::steady_clock::time_point> terminate_deadline(
      const PrefetchOperation& op) const;
  // A signal notified after every backup ack, revoke and prefetch stage change, so that the
  // main loop can sleep until one happens (HiRadixCache attaches its controller's). Thread-safe.
  void set_event_signal(std::shared_ptr<EventSignal> signal);
  // Stops `op` (waiting at most for the batch in flight and for the hit agreement), agrees on the
  // completed prefix with the other ranks (main_collective), frees the host pages past it, and
  // returns the prefix. With `agreed_pages` the caller has agreed on the prefix already (a
  // step's fused reduction over completed_tokens(), which only grows): no collective call, and
  // the prefix is the smaller of it and what completed here. Throws StateError when called
  // twice for one op.
  PrefetchResult terminate_prefetch(PrefetchOperation& op,
                                    std::optional<std::int64_t> agreed_pages = std::nullopt);
  // Host tokens held by prefetches now.
  std::int64_t prefetch_tokens_held() const { return budget_used_->load(); }

  // Ops that ended in an exception (backend or collective failure), since construction.
  std::int64_t failed_ops() const { return static_cast<std::int64_t>(failed_ops_.value()); }
  // Prefetch reads so far: payload bytes that landed and the time of the batch_get calls that
  // brought them (the L3 -> host bandwidth the radix cache weighs against recomputing).
  std::int64_t read_bytes() const { return static_cast<std::int64_t>(read_bytes_.value()); }
  double read_seconds() const { return static_cast<double>(read_ns_.value()) * 1e-9; }
  // The batch_get calls that brought read_bytes(). Readable from any thread, as the others.
  std::int64_t read_calls() const { return static_cast<std::int64_t>(read_calls_.value()); }
  // Backups so far: the batch_set calls that stored written_bytes() and their time.
  std::int64_t write_calls() const { return static_cast<std::int64_t>(write_calls_.value()); }
  double write_seconds() const { return static_cast<double>(write_ns_.value()) * 1e-9; }
  // hicache_prefetch_confirm_seconds: from the last page of a prefetch that read its whole hit
  // to the terminate_prefetch that took its pages.
  const Histogram& prefetch_confirm_latency() const { return prefetch_confirm_latency_; }
  // Pages per storage call: io_batch_pages, or its automatic value. A backup writes batches of
  // it. A prefetch reads batches of it when io_batch_pages is set; with the automatic value,
  // of at most it, paced to about 20 ms a read (ReadPacer), so that a cut or a terminate waits
  // about that long at most for the read in flight.
  std::int64_t batch_pages() const { return batch_pages_; }
  // Backup payload bytes the store accepted so far.
  std::int64_t written_bytes() const { return static_cast<std::int64_t>(written_bytes_.value()); }
  // Of the sidecar pools' pages: bytes stored by backups, and read by prefetches (not counted in
  // written_bytes() / read_bytes(), which are the KV's).
  std::int64_t sidecar_written_bytes() const {
    return static_cast<std::int64_t>(sidecar_written_bytes_.value());
  }
  std::int64_t sidecar_read_bytes() const {
    return static_cast<std::int64_t>(sidecar_read_bytes_.value());
  }
  // Registers the backup and prefetch counters (ops by outcome, pages, revokes, latency
  // histograms) and the queue depths in `registry` until destroyed or registered again.
  void register_metrics(MetricsRegistry& registry, MetricLabels labels = {});

  // Stops the threads promptly: queued backups are acked with zero completed tokens, queued
  // prefetches revoked, loading ones finished as they stand (terminate_prefetch still returns
  // their pages). The prefetch and backup threads' collectives are cancelled
  // (Collective::cancel), so a thread inside the collective of an op that the other ranks took
  // off their queues unrun returns at once instead of at the timeout. Idempotent.
  void stop();
  // Waits until every queued backup and prefetch agreement has run, then stop(): the TP ranks'
  // threads are then all idle between ops, so none is left inside a collective the others never
  // join, and the prefetch and backup collectives can be resume()d. For a detach of L3.
  void stop_when_idle();
  // Waits until every queued backup and prefetch agreement has run (on a store that fails,
  // each fails at once or at its timeout), then stop(), then drops every ack and revoke not yet
  // drained and starts the threads again: for the owner's reset (HiRadixCache::reset), which
  // forgets every op and frees every host page itself. Every TP rank calls it at the same step. Prefetch ops the caller still holds are finished or revoked (terminate_prefetch
  // returns their pages; after a host pool reset do not free them).
  void reset();

 private:
  struct BackupOp {
    std::int64_t priority = 0;  // always 0: FIFO
    std::int64_t id = 0;
    std::chrono::steady_clock::time_point submitted = std::chrono::steady_clock::now();
    std::vector<std::int64_t> pages;
    std::vector<std::string> keys;
    struct Sidecar {
      std::size_t pool = 0;
      std::vector<std::int64_t> at, host_pages;  // op page indices, the pool's pages
    };
    std::vector<Sidecar> sidecars;
  };

  // A sidecar pool as L3 sees it.
  struct Sidecar {
    HostKVPool* host = nullptr;
    SidecarHitPolicy policy = SidecarHitPolicy::kAllPages;
    std::int32_t window = 1;
    std::int32_t slots_per_page = 1;
    std::int64_t batch_pages = 1;  // pages per store call
    std::string prefix;            // its keys' namespace prefix
  };

  struct PrefetchTask {
    std::int64_t priority = 0;  // always 0: FIFO
    std::shared_ptr<PrefetchOperation> op;
  };

  void backup_loop();
  // This rank's hit of `keys`: the leading pages L3 holds (batch_exists) and, per sidecar
  // pool, which of those it holds (held[pool], exists_each). Throws what the store throws.
  std::int64_t query_hit(std::span<const std::string> keys,
                         std::vector<std::vector<std::uint8_t>>& held);
  void prefetch_loop();
  void prefetch_io_loop();
  std::shared_ptr<PrefetchOperation> queue_prefetch(std::shared_ptr<PrefetchOperation> op);
  void agree_and_reserve(const std::shared_ptr<PrefetchOperation>& handle);
  void read_pages(PrefetchOperation& op);
  void revoke(PrefetchOperation& op);
  void finish(PrefetchOperation& op);
  void notify_events();
  // The timeout policy's limit for `op`, from its queueing.
  std::chrono::steady_clock::duration prefetch_timeout(const PrefetchOperation& op) const;
  BackupAck run_backup(const BackupOp& op);
  // Writes the pages [begin, end) of op; returns how many leading pages are stored.
  void start_threads();
  // Queued backups and prefetches not yet run by their thread (a thread decrements it after
  // the op, collectives included).
  void op_queued();
  void op_done();
  void wait_until_idle();
  std::int64_t write_batch(const BackupOp& op, std::size_t begin, std::size_t end,
                           std::string& error);
  // Stores op's sidecar pages of op pages below `limit`; returns the stored prefix: `limit`, or
  // the op page of the first sidecar page that failed.
  std::int64_t write_sidecars(const BackupOp& op, std::int64_t limit, std::string& error);
  // The longest prefix of op's hit that its landed pages restore: `kv_pages` KV pages and the
  // sidecar pages marked landed (with every KV page landed when kv_pages is the hit).
  std::int64_t restorable_landed(const PrefetchOperation& op, std::int64_t kv_pages) const;
  // Reads op's agreed sidecar pages (the I/O worker, before the KV's).
  void read_sidecars(PrefetchOperation& op);
  // The op's sidecar slots not in `keep` (per pool, its kept pages' slots) back to free.
  void free_sidecar_rest(PrefetchOperation& op, const std::vector<SidecarPagesIo>& keep);

  HostKVPool& host_;
  StorageBackend& storage_;
  PageKeyer keyer_;  // prefetch thread only
  const std::string kv_prefix_;  // keyer_'s prefix, for every thread
  std::vector<Sidecar> sidecars_;
  Collective& prefetch_collective_;
  Collective& backup_collective_;
  Collective& main_collective_;
  StorageControllerConfig config_;
  std::int64_t page_size_;
  std::shared_ptr<std::atomic<std::int64_t>> budget_used_ =
      std::make_shared<std::atomic<std::int64_t>>(0);
  Mutex signal_mu_;  // before the threads: they notify until joined
  std::shared_ptr<EventSignal> signal_ HICACHE_GUARDED_BY(signal_mu_);

  OpQueue<PrefetchTask> prefetch_queue_;
  TransferBuffer<PrefetchTask> prefetch_io_queue_;  // hit agreement -> reads
  moodycamel::ConcurrentQueue<std::string> revokes_;
  std::int64_t batch_pages_ = 1;
  // Automatic batches only; observed by the prefetch I/O worker only.
  std::unique_ptr<ReadPacer> read_pacer_;
  // Staging for layouts without contiguous pages, grown on first use to one batch.
  std::vector<std::byte> prefetch_staging_;  // prefetch I/O worker only
  std::thread prefetch_thread_;
  std::thread prefetch_io_thread_;

  OpQueue<BackupOp> backup_queue_;
  moodycamel::ConcurrentQueue<BackupAck> backup_acks_;
  std::atomic<std::int64_t> next_id_{1};
  Counter failed_ops_, read_bytes_, read_ns_, read_calls_, written_bytes_, write_ns_,
      write_calls_;
  Counter sidecar_written_bytes_, sidecar_read_bytes_;
  Counter backups_ok_, backups_failed_, prefetches_, revoked_, terminated_, prefetched_pages_;
  Histogram backup_latency_, prefetch_latency_;
  // From a prefetch's last read (every page of its hit read, not cut short) to the
  // terminate_prefetch that hands its pages to the cache: how long fetched pages wait for the
  // engine to take them (hicache_prefetch_confirm_seconds).
  Histogram prefetch_confirm_latency_;
  // The agreed L3 hits (tokens) and, of the revoked ones, why: below the threshold (a full
  // miss or some pages), or some rank without host room (all of the hit unfulfilled).
  Counter hit_tokens_, unfulfilled_below_threshold_, unfulfilled_host_capacity_;
  Counter revoked_insufficient_, revoked_full_miss_, revoked_host_capacity_;
  Counter touched_keys_, dropped_touch_keys_;  // touch(): keys passed to the store, dropped
  // Per storage call: the pages it was asked for, and GB/s (1e9 bytes/s) of those it moved.
  Histogram backup_batch_pages_{std::vector<double>{1, 5, 10, 50, 100}};
  Histogram prefetch_batch_pages_{std::vector<double>{1, 5, 10, 50, 100}};
  Histogram backup_gbps_{std::vector<double>{0.1, 0.5, 1, 5, 10, 50, 100}};
  Histogram prefetch_gbps_{std::vector<double>{0.1, 0.5, 1, 5, 10, 50, 100}};
  MetricsScope metrics_;  // after what it registers: it goes first
  Mutex idle_mu_;
  std::condition_variable idle_cv_;
  std::int64_t outstanding_ HICACHE_GUARDED_BY(idle_mu_) = 0;
  std::vector<std::byte> staging_;  // backup thread only
  std::thread backup_thread_;
  // touch(): chains waiting for the touch thread, and their key count.
  Mutex touch_mu_;
  std::condition_variable touch_cv_;
  std::vector<std::vector<std::string>> touches_ HICACHE_GUARDED_BY(touch_mu_);
  std::size_t touch_keys_ HICACHE_GUARDED_BY(touch_mu_) = 0;
  bool touch_stop_ HICACHE_GUARDED_BY(touch_mu_) = false;
  std::thread touch_thread_;
  void touch_loop();
};

}  // namespace hicache
