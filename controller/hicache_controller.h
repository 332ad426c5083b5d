// HiCacheController: moves KV pages between the device pool (L1) and the host pool (L2) on its
// own threads, driven by the engine's main loop (the radix cache).
//
//   write(device_slots)  reserves and protects host pages, queues an all-layer D->H copy for the
//                        write thread; the main loop later drains a WriteAck per node.
//   load(host_slots)     reserves device slots, protects the host pages, and holds the op until
//                        start_loading() merges every held op into one batch; the load thread
//                        copies it layer by layer and marks each layer in the LayerDoneCounter,
//                        which the forward pass waits on (DeviceKVPool::wait_for_layer).
//   evict_device / evict_host  free a tier's copy after checking the page states.
//   sidecars             a hybrid model's sidecar pools (pools/sidecar_pool.h): pages of them
//                        named in a write or a load (SidecarIo) move in the same op as its KV,
//                        in the same copy batch (a load's land with layer 0), and are acked,
//                        failed, returned and evicted with it.
//   reset() / stop()     end the threads promptly, return every slot held by queued or in-flight
//                        work, and (reset) start again.
//
// Threading: write(), load(), start_loading(), evict_*, drain_*, reset() and stop() are called
// from the main loop only (the device allocator is the main loop's). A failed copy never kills
// a thread: it is counted and reaches the main loop through the ack (ok = false).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string_view>
#include <thread>
#include <vector>

#include "controller/event_signal.h"
#include "controller/slot_arena.h"
#include "pools/device_kv_pool.h"
#include "pools/host_kv_pool.h"
#include "pools/sidecar_pool.h"
#include "transfer/cache_operation.h"
#include "transfer/device.h"
#include "transfer/layer_done_counter.h"
#include "transfer/metrics.h"
#include "transfer/op_queue.h"

namespace hicache {

enum class WritePolicy { kWriteThrough, kWriteThroughSelective, kWriteBack };
// How host <-> device copies are issued: kDirect, a list of contiguous copies (one
// cudaMemcpyBatchAsync on CUDA: the copy engines); kKernel, one gather/scatter launch (SMs);
// kAuto, chosen per op by choose_io_backend().
enum class IoBackend { kDirect, kKernel, kAuto };

// Throw InvalidArgument naming the value and the valid ones.
WritePolicy parse_write_policy(std::string_view name);
IoBackend parse_io_backend(std::string_view name);
std::string_view to_string(WritePolicy policy);
std::string_view to_string(IoBackend io);

// What choose_io_backend() weighs about one op.
struct CopyShape {
  bool to_host = false;           // device -> host (a write); else a layer-by-layer load
  std::int64_t bytes = 0;         // every byte the op moves
  std::int64_t run_bytes = 0;     // one contiguous run in both layouts (a direct copy's size)
  std::int64_t runs_per_call = 0;  // runs one copy call moves: a write's all, a load's per layer
};

// The path one op's copies take (never kAuto). `configured` other than kAuto is kept. kAuto:
//   - page_first host memory: kernel (its runs are one token of one layer; direct on CUDA is
//     refused, and on the host backend both walk the same units);
//   - otherwise on the host backend: direct;
//   - on CUDA, runs under kAutoSmallRunBytes, kAutoKernelMinRuns or more per copy call: kernel
//     (the copy engines move small runs slowly); then writes (device -> host) of at least
//     kAutoKernelWriteBytes: kernel; the rest (every other load, small writes): direct.
// Measured on an H200 (2026-11-29, docs/performance.md): writes of 8 MiB pages cycling through
// the pools reached 0.71-0.74 of the copy engine's ceiling with direct and 0.90-0.95 with the
// kernel (hicache-opbench); loads 0.84 (one page) and 0.99 (16 pages) direct against 0.68 and
// 0.89 kernel; 2 KiB ops ran 172k writes/s direct against 119k. Runs of 8 KiB (hicache-gpubench
// layer_first 4): 16 pages, all layers, 0.17-0.35 direct against 0.81-0.83 kernel; one layer
// of one page (2 runs) 0.95 direct against 0.47; runs of 64 KiB: direct 0.95-1.01 for loads.
inline constexpr std::int64_t kAutoKernelWriteBytes = std::int64_t{1} << 20;
inline constexpr std::int64_t kAutoSmallRunBytes = std::int64_t{32} << 10;
inline constexpr std::int64_t kAutoKernelMinRuns = 16;
IoBackend choose_io_backend(IoBackend configured, DeviceBackend device, HostLayout host_layout,
                            const CopyShape& op);

struct ControllerConfig {
  WritePolicy write_policy = WritePolicy::kWriteThrough;  // for the radix cache
  IoBackend io_backend = IoBackend::kAuto;
  std::int32_t layer_slots = 3;         // LayerDoneCounter slots (batches in flight)
  std::size_t queue_capacity = 4096;    // ops queued per queue before write()/load() push back
  std::int32_t kernel_max_blocks = 0;   // CUDA block cap of the kernel io path (0: none)
};

// One acknowledged node of a write or a load. ok = false: the copy failed; for a write the host
// pages were freed, for a load the device slots hold garbage and the host pages are backup again.
struct Ack {
  NodeId node;
  bool ok;
};

// Pages of one sidecar pool that go with a write, a load or an eviction: `pool` is the pool's
// index in the controller's list; host and device slots of equal length, whole pages of that
// pool. The caller allocates them from the pool (host pages reserved for a write, device pages
// from its allocator for a load), as it does KV slots for load_into.
struct SidecarIo {
  std::int32_t pool = 0;
  std::span<const std::int64_t> host_slots;
  std::span<const std::int64_t> device_slots;
};

struct ControllerStats {
  std::uint64_t writes_done = 0, write_failures = 0;
  std::uint64_t load_batches_done = 0, load_failures = 0;
  std::uint64_t bytes_written = 0, bytes_loaded = 0;  // sidecar bytes included
  // Wall time of the successful load batches, from the load thread taking a batch to its last
  // layer landing (waits on start_loading's ready_after included): bytes_loaded / load_seconds
  // is the host -> device bandwidth the radix cache weighs against recomputing.
  double load_seconds = 0;
  // Of bytes_written / bytes_loaded, the sidecar pools' (the rest is KV: whole tokens).
  std::uint64_t sidecar_bytes_written = 0, sidecar_bytes_loaded = 0;
  // The successful device -> host copies (one per write op the thread ran, merged writes
  // counted once) and their wall time, from the copy's start to its synchronisation.
  std::uint64_t write_batches_done = 0;
  double write_seconds = 0;
  // Copy batches (write batches and load batches, failed ones too) by the I/O path they took:
  // with io_backend auto, what choose_io_backend() picked.
  std::uint64_t direct_batches = 0, kernel_batches = 0;
};

class HiCacheController {
 public:
  // The pools must share the geometry and outlive the controller, as must `sidecars` (distinct
  // pools; their indices are SidecarIo::pool). Starts the threads.
  HiCacheController(Device& device, DeviceKVPool& device_pool, HostKVPool& host_pool,
                    const ControllerConfig& config = {},
                    std::span<SidecarPool* const> sidecars = {});
  ~HiCacheController();
  HiCacheController(const HiCacheController&) = delete;
  HiCacheController& operator=(const HiCacheController&) = delete;

  // Backs up `device_slots` (whole pages) to newly reserved host pages; returns those host
  // slots, or nothing (nothing reserved) when the host pool is full or the write queue is.
  // `ready_after`: an event the caller recorded on its compute stream after the work that wrote
  // these slots (the forward pass that produced the KV). The copy starts on the device only
  // after that work, and the host does not block; without it, work still running on another
  // stream may not have written the bytes yet (a pending-write hazard). The event is waited on
  // at the call, so the caller may re-record it afterwards.
  std::optional<std::vector<std::int64_t>> write(std::span<const std::int64_t> device_slots,
                                                 std::int64_t priority,
                                                 std::optional<NodeId> ack_node,
                                                 const Event* ready_after = nullptr);
  // write() in two steps, for callers that decide on the room before they queue the copy (TP
  // ranks judge it on state that is the same on every rank, HiRadixCache::host_room(), and
  // must not let the pool's own count decide). reserve_write takes `tokens` host slots when the
  // pool has them and the write queue has room (nothing otherwise); the room then holds until
  // write_reserved, since only the main loop queues writes. write_reserved queues the copy into
  // the reserved slots and consumes the reservation whatever happens: false (slots freed) only
  // after stop(); bad device slots throw InvalidArgument, the slots freed first.
  // release_write hands an unused reservation back.
  // `sidecars`: sidecar pages copied in the same op, their host pages reserved (allocated from
  // the sidecar host pool) by the caller; like the KV reservation they are consumed whatever
  // happens (synced on success, freed on a failure or a bad argument).
  std::optional<std::vector<std::int64_t>> reserve_write(std::int64_t tokens);
  bool write_reserved(std::span<const std::int64_t> device_slots,
                      std::span<const std::int64_t> host_slots, std::int64_t priority,
                      std::optional<NodeId> ack_node, const Event* ready_after = nullptr,
                      std::span<const SidecarIo> sidecars = {});
  void release_write(std::span<const std::int64_t> host_slots);
  // Loads host pages in backup state into newly allocated device slots; returns those slots, or
  // nothing (nothing changed) when the device pool or the load queue is full.
  std::optional<std::vector<std::int64_t>> load(std::span<const std::int64_t> host_slots,
                                                std::int64_t priority,
                                                std::optional<NodeId> ack_node);
  // Loads host pages in backup state into device slots the engine chose: slots it took from
  // device_pool().allocator() (the engine's allocator where it passed one), whole pages, as
  // many as host_slots. From here on they are handled as load()'s are: a load dropped by
  // stop() or reset() before it ran frees them back to that allocator; a load that ran and
  // failed is acknowledged not ok and the caller frees them (the radix cache does). False
  // (nothing changed, the slots still the caller's) when the load queue is full. Throws
  // InvalidArgument for mismatched or malformed slot lists, StateError for a host page not in
  // backup or a device page not allocated; nothing changes then.
  // `sidecars`: sidecar pages loaded in the same op (host pages in backup, device pages taken
  // from the sidecar pool's allocator), checked as the KV's are; they land before layer 0 is
  // marked done.
  bool load_into(std::span<const std::int64_t> host_slots, std::span<const std::int64_t> device_slots,
                 std::int64_t priority, std::optional<NodeId> ack_node,
                 std::span<const SidecarIo> sidecars = {});
  // Hands every load queued since the last call to the load thread as one batch and returns the
  // LayerDoneCounter slot its consumer waits on (also installed as the device pool's layer-wait
  // hook), or -1 when nothing was queued (the pool's layer waits then return true at once). The caller releases the slot when its forward pass is
  // done: layer_done_counter().release(slot). Blocks while layer_slots batches are in flight
  // and their consumers have not released them yet.
  // `ready_after`: an event recorded on the compute stream after the last work that reads the
  // device slots this batch overwrites (slots freed by a finished request whose kernels may still
  // run): the copies start only after it (a pending-read hazard), without blocking the host.
  // The forward pass then waits per layer on the host (DeviceKVPool::wait_for_layer) or on the
  // device (layer_done_counter().wait_on_stream(slot, layer, compute)).
  std::int32_t start_loading(const Event* ready_after = nullptr);
  LayerDoneCounter& layer_done_counter() { return *counter_; }

  // Append the acks that arrived since the last call; never block.
  std::size_t drain_write_acks(std::vector<Ack>& out);
  std::size_t drain_load_acks(std::vector<Ack>& out);
  // Notified after every ack is queued (and by the storage controller the cache attaches): the
  // main loop waits on it instead of polling the queues (see event_signal.h). Shared, so that a
  // storage controller notifying it may outlive this controller.
  const std::shared_ptr<EventSignal>& events() const { return events_; }

  // Frees the device copy of pages whose host copy is synced (they become backup). Throws
  // StateError naming the inconsistent page otherwise; nothing changes then.
  // `sidecars` go with them, checked as the KV's before anything changes. Returns the KV tokens.
  std::int64_t evict_device(std::span<const std::int64_t> device_slots,
                            std::span<const std::int64_t> host_slots,
                            std::span<const SidecarIo> sidecars = {});
  // Frees host pages in backup state (and the sidecars' host pages, their device slots unused).
  // Throws StateError otherwise; nothing changes then.
  std::int64_t evict_host(std::span<const std::int64_t> host_slots,
                          std::span<const SidecarIo> sidecars = {});
  std::size_t num_sidecars() const { return sidecars_.size(); }
  SidecarPool& sidecar(std::size_t pool) const { return *sidecars_.at(pool); }

  // Stops the threads, returns every slot held by queued or in-flight ops, drops pending acks,
  // and starts again. Counter slots handed out before are void: do not release them.
  void reset();
  // As reset() without the restart. Idempotent; the destructor calls it.
  void stop();

  ControllerStats stats() const;
  const ControllerConfig& config() const { return config_; }
  // Registers this controller's counters, latency histograms and queue depths in `registry`
  // (with `labels` on every series) until it is destroyed or registers again.
  void register_metrics(MetricsRegistry& registry, MetricLabels labels = {});
  // Forgets what register_metrics registered and stops timing ops. Main loop only, as
  // register_metrics.
  void unregister_metrics();

 private:
  struct LoadBatch {
    std::int64_t priority = 0;
    std::int32_t slot = -1;
    CacheOperation op;
  };
  static constexpr int kMaxMergedWrites = 16;
  void start_threads();
  void write_loop();
  void load_loop();
  struct Scratch;  // per-thread reusable page lists and copy regions
  // Chooses the op's I/O path (choose_io_backend) and turns its slots into page lists in
  // `scratch` (pinned memory for the kernel path).
  void prepare_pages(const CacheOperation& op, Scratch& scratch, bool to_host);
  // Enqueues the copy of the prepared pages for layers [lb, le) on `stream`.
  void enqueue_copy(Stream& stream, Scratch& scratch, bool to_host, std::int32_t lb,
                    std::int32_t le);
  void run_write(CacheOperation& op, Scratch& scratch, int ops);
  // An op whose lists come from the arena.
  // write()'s input check: whole pages of this device pool, at least one.
  void check_write_slots(std::span<const std::int64_t> device_slots);
  CacheOperation make_op(std::span<const std::int64_t> host_slots,
                         std::span<const std::int64_t> device_slots, std::int64_t priority,
                         std::optional<NodeId> ack_node);
  void run_load(LoadBatch& batch, Scratch& scratch);
  // Throws InvalidArgument naming a bad pool index, mismatched lists or slots that are not
  // whole pages of the pool, StateError naming a host page not in `host_state` or (with
  // allocated_device) a device page its allocator did not hand out; nothing changes then.
  void check_sidecars(std::span<const SidecarIo> sidecars, std::string_view what,
                      PageState host_state, bool allocated_device) const;
  // The op's sidecar lists, copied from `sidecars`.
  void add_sidecars(CacheOperation& op, std::span<const SidecarIo> sidecars);
  // Copies every sidecar page of `op` (device -> host when to_host) on `stream`; the sidecar
  // bytes.
  std::uint64_t enqueue_sidecar_copies(Stream& stream, Scratch& scratch, const CacheOperation& op,
                                       bool to_host);
  // The host pages of op's sidecars: moved to `to` (complete_io), or for kFree freed after
  // abort_io (a write that did not land). Never throws: pages in another state are left alone.
  void finish_sidecar_hosts(const CacheOperation& op, PageState to);
  // Load ops dropped before they ran: KV and sidecar host pages back to backup, device slots
  // freed.
  void return_load(CacheOperation& op);
  // Protects the host pages and queues the load; false (host pages back to backup) when full.
  bool queue_load(std::span<const std::int64_t> host_slots,
                  std::span<const std::int64_t> device_slots, std::int64_t priority,
                  std::optional<NodeId> ack_node, std::span<const SidecarIo> sidecars = {});
  // Gives a finished op's lists back to the arena, then acks its nodes and wakes the waiters.
  void finish_op(CacheOperation& op, moodycamel::ConcurrentQueue<Ack>& acks, bool ok,
                 Scratch& scratch);
  void return_queued_slots();

  Device& device_;
  DeviceKVPool& device_pool_;
  HostKVPool& host_pool_;
  ControllerConfig config_;
  std::vector<SidecarPool*> sidecars_;
  std::unique_ptr<LayerDoneCounter> counter_;
  std::unique_ptr<Stream> write_stream_, load_stream_;
  OpQueue<CacheOperation> write_queue_;
  OpQueue<CacheOperation> pending_loads_;  // main loop only until start_loading()
  OpQueue<LoadBatch> load_queue_;
  struct AckQueues;
  std::unique_ptr<AckQueues> acks_;
  Counter sidecar_bytes_written_, sidecar_bytes_loaded_;
  Counter writes_done_, write_failures_, load_batches_done_, load_failures_, bytes_written_,
      bytes_loaded_, load_ns_, write_batches_done_, write_ns_, direct_batches_, kernel_batches_;
  Histogram write_latency_, load_latency_;
  std::atomic<bool> timed_{false};  // registered: ops are timed for the latency histograms
  MetricsScope metrics_;  // after what it registers: it goes first
  bool running_ = false;
  // Main loop only: write()'s slot check and start_loading()'s drained ops, reused.
  std::vector<std::int64_t> check_pages_;
  std::vector<CacheOperation> load_ops_;
  SlotArena arena_;  // before the threads: they give lists back until joined
  std::shared_ptr<EventSignal> events_ = std::make_shared<EventSignal>();  // before the threads
  std::thread write_thread_, load_thread_;
};

}  // namespace hicache
