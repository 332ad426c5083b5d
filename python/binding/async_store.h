// AsyncStore (hicache._hicache.AsyncStore): a store (StorageBackend) driven through a queue of
// batch jobs run by its own C++ worker threads, with completions signalled on a Linux eventfd.
// Its Python surface is LMCache's native_plugin L2 connector (hicache.lmcache exports it under
// LMCache's loading convention; docs/lmcache.md); the vLLM tier can drive it the same way.
//
//   submit_batch_get(keys, memoryviews) -> id     read each key into its buffer
//   submit_batch_set(keys, memoryviews) -> id     store each buffer under its key
//   submit_batch_exists(keys) -> id               which keys are stored
//   submit_batch_delete(keys) -> id               remove keys (LMCache's eviction)
//   bind_rows(view, row_bytes)                    one region of rows, for the calls below
//   submit_rows_get(keys, rows) -> id             read key i into row rows[i] of the region
//   submit_rows_set(keys, rows) -> id             store row rows[i] under key i
//   event_fd() -> int                             readable while completions wait to be drained
//   drain_completions() -> [(id, ok, error, per_key)]   never blocks; clears the eventfd
//   close()                                       finishes every accepted job, then stops
//
// Keys are opaque strings: each is stored as the record "<prefix>-<escaped key>" (every byte
// outside [A-Za-z0-9_+=@,.-] percent-encoded, so distinct keys stay distinct and a model name
// with '/' is a safe file name), or "<prefix>-%h<sha256 hex of the key>" when the escaped name
// would pass the store's key limit. Without a prefix the "<prefix>-" part is absent.
//
// Buffers: one per key, C-contiguous objects with the buffer protocol (memoryview, bytearray,
// numpy) or host torch tensors, exported writable for get. Nothing is copied: the workers read
// and write the buffers' memory in place, and each buffer's export (hence its memory) is held
// from submit until its job's completion has been drained (or the AsyncStore is destroyed);
// the caller must not touch a buffer of a get before its completion.
// Rows: a caller whose buffers are the rows of one region (vLLM's primary CPU tier) binds it
// once, and then names rows by number: no memoryview is made, exported or pinned per key. The
// region (a writable C-contiguous buffer whose size is a multiple of row_bytes, or a host
// tensor) stays exported until the AsyncStore is destroyed; bind_rows is allowed once.
//
// Completions: (id, ok, error, per_key). get: per_key[i] is True when key i was read into its
// buffer (a missed key's buffer is unspecified); ok is False only when a key hit an I/O error
// (error says which). set: per_key[i] True when stored; ok when all were. exists / delete:
// per_key[i] True when stored / removed; ok unless the job failed. A job that could not run
// (queue full, an exception in a worker) completes with ok False, per_key all False and the
// reason in error: a worker never dies, and no job is lost.
//
// Threads: every method is called with the GIL held and may be called from several Python
// threads at once; submit never blocks (bad input raises ValueError before anything is queued:
// a key/buffer count mismatch, an empty batch, an empty key, a buffer that cannot be written
// for a get, a row outside the bound region or rows without one; a full queue completes the job
// as failed at once, no exception). Workers never
// take the GIL. Errors: ValueError for bad input, RuntimeError for a submit after close().
#ifndef HICACHE_PYTHON_BINDING_ASYNC_STORE_H_
#define HICACHE_PYTHON_BINDING_ASYNC_STORE_H_

#include <pybind11/pybind11.h>

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "controller/metrics_server.h"
#include "python/binding/buffers.h"
#include "storage/storage_backend.h"
#include "transfer/metrics.h"
#include "transfer/mutex.h"

namespace hicache::binding {

namespace py = pybind11;

class AsyncStore {
 public:
  enum class Kind { kGet, kSet, kExists, kDelete, kTouch };
  static constexpr std::int64_t kDefaultSpinUs = 200;

  struct Completion {
    std::uint64_t id = 0;
    bool ok = false;
    std::string error;
    std::vector<bool> per_key;
  };

  // `store` is shared (a Store's backend, or one opened for this object); `own_metrics`
  // registers the store's metrics in this object's registry (false when another registry
  // already holds them). `workers` >= 1 threads run jobs; at most `max_pending` jobs are queued
  // or running (>= 1). `prefix`: "" or a valid key of at most 160 bytes. InvalidArgument
  // otherwise.
  // `metrics_port` >= 0 serves this object's registry at http://metrics_bind:port/metrics (0:
  // a free port) until close(); -1: off. A port that cannot be bound is an Error.
  // `spin_us` (0..10^7): how long a worker that ended the only job in flight looks for the next
  // one (yielding the CPU in between) before it sleeps; 0 never looks. A driver that submits
  // its next job on the completion (vLLM's and LMCache's, one job in flight) then wakes no
  // sleeping thread: on a VM whose idle vCPU halts, the wake-up cost the submitting Python
  // thread 16 us of the 26 us of a 16-key submit_rows_get (docs/vllm.md has the figures). The
  // controller's write and load threads look for the same reason.
  AsyncStore(std::shared_ptr<StorageBackend> store, bool own_metrics, std::string prefix,
             int workers, std::size_t max_pending, int metrics_port = -1,
             const std::string& metrics_bind = "127.0.0.1",
             std::int64_t spin_us = kDefaultSpinUs);
  // close(), then releases the buffers of undrained completions. REQUIRES: the GIL is held.
  ~AsyncStore();
  AsyncStore(const AsyncStore&) = delete;
  AsyncStore& operator=(const AsyncStore&) = delete;

  // The eventfd; RuntimeError after close().
  int event_fd() const;
  std::uint64_t submit_batch_get(const py::sequence& keys, const py::sequence& buffers);
  std::uint64_t submit_batch_set(const py::sequence& keys, const py::sequence& buffers);
  std::uint64_t submit_batch_exists(const py::sequence& keys);
  std::uint64_t submit_batch_delete(const py::sequence& keys);
  // See Rows above. InvalidArgument: bound already, an empty region, a row_bytes that is 0 or
  // does not divide its size.
  void bind_rows(const py::object& region, std::size_t row_bytes);
  std::uint64_t submit_rows_get(const py::sequence& keys, const py::sequence& rows);
  std::uint64_t submit_rows_set(const py::sequence& keys, const py::sequence& rows);
  // Every completion queued since the last call (also after close()); releases their buffers.
  std::vector<Completion> drain_completions();
  // Refuses new jobs, waits (without the GIL) for every queued and running job, stops the
  // workers and closes the eventfd. Idempotent, thread-safe.
  void close();

  // On the calling thread, without the GIL: how many leading keys the store holds (the file
  // store answers from its index; Redis asks the server, so callers that must not block use
  // submit_batch_exists there).
  std::size_t exists_now(const py::sequence& keys);
  // StorageBackend::touch of the records of `keys`, a chain in prefix order, never waiting for
  // I/O: the file store makes them its youngest (keys[0] first) on the calling thread, without
  // the GIL, also after close(); Redis is told by a worker (a job with no completion, counted
  // as kind "touch"; dropped and counted rejected after close() or with max_pending jobs in
  // flight).
  void touch(const py::sequence& keys);
  std::string store_name() const { return std::string(store_->name()); }
  std::string stats_json() const { return store_->stats().to_json(); }
  // The record name of `key` (see above); InvalidArgument for an empty key.
  std::string record_name(const std::string& key) const;
  std::size_t pending() const;
  // Workers looking for a next job (0 or 1; see spin_us).
  std::size_t looking() const;
  const std::string& prefix() const { return prefix_; }
  std::string metrics_json() const { return metrics_.json_text(); }
  std::string metrics_text() const { return metrics_.prometheus_text(); }
  // The /metrics port, or -1 when not serving.
  int metrics_port();

 private:
  struct Job {
    std::uint64_t id = 0;
    Kind kind = Kind::kGet;
    std::vector<std::string> names;
    std::vector<std::pair<std::byte*, std::size_t>> buffers;
    std::chrono::steady_clock::time_point submitted;
    bool silent = false;  // no completion (a touch handed to a worker)
  };
  struct KindMetrics {
    Counter ok, failed, rejected, keys, keys_ok;
    Histogram seconds;
  };

  // Exactly one of `buffers` (one per key) and `rows` (one per key, of the bound region), or
  // neither (exists, delete).
  std::uint64_t submit(Kind kind, const py::sequence& keys, const py::sequence* buffers,
                       const py::sequence* rows = nullptr);
  void worker();
  // Queues `job` (counted in flight); true when no worker looking will take it, so the caller
  // must wake one (notify_one, after releasing mu_).
  bool queue_locked(Job job) HICACHE_REQUIRES(mu_);
  // After a job: when no job is queued or running, looks for the next one (yielding in between)
  // for spin_; true with the job taken. False at once when a job is queued (the
  // caller takes it), another runs, or the store is closed.
  bool take_looking(Job& job);
  Completion run(const Job& job);
  void publish(Completion c);

  std::shared_ptr<StorageBackend> store_;
  bool own_metrics_;
  std::string prefix_;
  std::size_t max_pending_;
  std::chrono::microseconds spin_;

  mutable Mutex mu_;  // the job queue
  std::condition_variable cv_;
  std::deque<Job> queue_ HICACHE_GUARDED_BY(mu_);
  std::size_t in_flight_ HICACHE_GUARDED_BY(mu_) = 0;  // queued + running
  std::size_t looking_ HICACHE_GUARDED_BY(mu_) = 0;    // workers in take_looking (0 or 1)
  bool closed_ HICACHE_GUARDED_BY(mu_) = false;
  std::uint64_t next_id_ HICACHE_GUARDED_BY(mu_) = 1;

  mutable Mutex done_mu_;  // completions, the eventfd
  std::vector<Completion> done_ HICACHE_GUARDED_BY(done_mu_);
  int efd_ HICACHE_GUARDED_BY(done_mu_) = -1;
  bool fd_closed_ HICACHE_GUARDED_BY(done_mu_) = false;

  // What keeps a job's buffers valid: their exports and the objects themselves (a tensor has
  // no export). Created and destroyed with the GIL held.
  struct Pin {
    std::vector<Region> regions;
    py::list objects;
  };
  Mutex pins_mu_;
  std::unordered_map<std::uint64_t, Pin> pins_ HICACHE_GUARDED_BY(pins_mu_);

  // The bound region (bind_rows): set once with the GIL held, read by submits (which hold the
  // GIL too); released by the destructor after close().
  Region rows_;
  py::object rows_obj_;
  std::size_t row_bytes_ = 0;
  std::size_t row_count_ = 0;

  Mutex close_mu_;  // serialises close()
  std::vector<std::thread> workers_;

  static constexpr std::size_t kKinds = 5;
  KindMetrics kinds_[kKinds];
  MetricsRegistry metrics_;
  MetricsScope scope_;  // after what it registers
  std::unique_ptr<MetricsServer> server_ HICACHE_GUARDED_BY(close_mu_);  // reads metrics_
};

// Adds AsyncStore to `m`.
void register_async_store(py::module_& m);

}  // namespace hicache::binding

#endif  // HICACHE_PYTHON_BINDING_ASYNC_STORE_H_
