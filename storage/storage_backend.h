// StorageBackend: the L3 tier. It moves bytes between page keys and caller-provided spans (host
// pool pages), and knows nothing of pools (docs/architecture.md).
//
// Contract, for every backend:
// - Results are per key: ok, miss (absent, or a record that failed validation: it is counted,
//   removed and never handed over as data), or error (I/O failure, with the reason). Storage I/O
//   never raises; only API misuse does (InvalidArgument naming the bad value, before anything is
//   read or written).
// - batch_get writes into the caller's spans in place. A span's size is the payload size the
//   caller expects; a record of any other size is a miss. After a result other than ok the
//   span's bytes are unspecified (it may hold part of a rejected record): use none of them.
// - batch_set is idempotent and deduplicated: a key the store already holds is not written again,
//   and a key another batch of this process is storing right now is not written twice (this
//   batch waits for that write and reports its outcome). Ok means the record is stored (and, with
//   a durable setting, durable).
// - All calls are thread-safe; batches from several threads run concurrently.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "transfer/metrics.h"
#include "transfer/mutex.h"

namespace hicache {

enum class IoStatus : std::uint8_t { kOk, kMiss, kError };
std::string_view to_string(IoStatus status);

struct IoResult {
  IoStatus status = IoStatus::kMiss;
  std::string reason;  // empty when ok; why for a miss of a bad record and for an error

  static IoResult ok() { return {IoStatus::kOk, {}}; }
  static IoResult miss(std::string why = {}) { return {IoStatus::kMiss, std::move(why)}; }
  static IoResult error(std::string why) { return {IoStatus::kError, std::move(why)}; }
  bool is_ok() const { return status == IoStatus::kOk; }
};

using ByteSpan = std::span<std::byte>;
using ConstByteSpan = std::span<const std::byte>;

// A snapshot of a backend's counters (monotonic since construction, except the two gauges).
struct StorageStats {
  std::uint64_t exists_queries = 0;  // keys asked by batch_exists
  std::uint64_t gets = 0;            // keys asked by batch_get
  std::uint64_t get_hits = 0;
  std::uint64_t get_misses = 0;      // absent, plus bad records
  std::uint64_t get_errors = 0;
  std::uint64_t bad_records = 0;     // header, key, size or checksum mismatch (also in misses)
  std::uint64_t sets = 0;            // keys passed to batch_set
  std::uint64_t set_written = 0;     // records actually written
  std::uint64_t set_deduplicated = 0;  // already stored, or stored by a concurrent batch
  std::uint64_t set_errors = 0;
  std::uint64_t bytes_read = 0;      // payload bytes handed to callers
  std::uint64_t bytes_written = 0;   // payload bytes written
  std::uint64_t removes = 0;
  std::uint64_t evictions = 0;
  std::uint64_t eviction_failures = 0;  // records the evictor could not remove (skipped)
  std::uint64_t stored_keys = 0;     // gauge, where the backend knows it (file store)
  std::uint64_t stored_bytes = 0;    // gauge, record bytes incl. headers
  std::uint64_t capacity_bytes = 0;  // gauge, the bound on stored_bytes (0: none, or unknown)
  std::uint64_t capacity_shrinks = 0;  // a full disk made the store shrink its capacity
  std::uint64_t topology_refreshes = 0;  // a cluster's slot map re-read after a failure or MOVED
  std::uint64_t touched = 0;         // keys touch() found stored and refreshed
  std::uint64_t touch_errors = 0;    // keys touch() could not refresh (a server's error)

  std::string to_json() const;
};

class StorageBackend {
 public:
  virtual ~StorageBackend();
  StorageBackend(const StorageBackend&) = delete;
  StorageBackend& operator=(const StorageBackend&) = delete;

  virtual std::string_view name() const = 0;

  // How many leading keys are present (a prefix hit); stops at the first absent key. An I/O
  // error counts as absent.
  virtual std::size_t batch_exists(std::span<const std::string> keys) = 0;
  // Whether each key is present, every key asked (a sparse set, where batch_exists stops at
  // the first absent key: SGLang's trailing-window pools). An I/O error counts as absent.
  // Default: one batch_exists per key (an index lookup in the file store); Redis asks every
  // key in one pipelined round trip.
  virtual std::vector<bool> exists_each(std::span<const std::string> keys);
  // Whether batch_exists / exists_each answer without waiting for I/O (an index in memory; a
  // shared file store may stat a key it has not indexed), so that an engine's scheduler thread
  // may ask them itself before it reserves host memory for a prefetch. Default false: a store
  // (or a wrapper) that does not say so is asked on a storage thread.
  virtual bool exists_without_io() const { return false; }

  // Reads each key into dst[i] (dst[i].size() is the expected payload size).
  std::vector<IoResult> batch_get(std::span<const std::string> keys, std::span<const ByteSpan> dst);

  // Stores src[i] under keys[i]; see the contract above for deduplication.
  std::vector<IoResult> batch_set(std::span<const std::string> keys,
                                  std::span<const ConstByteSpan> src);

  // How many pages of `page_bytes` one batch_get / batch_set should carry for this store's best
  // throughput (callers that cut large transfers into batches ask; at least 1). By default as
  // many as make 64 MiB: each call has a fixed cost (a file store wakes its workers and waits
  // for the last key).
  virtual std::int64_t preferred_batch_pages(std::int64_t page_bytes) const {
    return std::max<std::int64_t>(1, (std::int64_t{64} << 20) / std::max<std::int64_t>(page_bytes, 1));
  }

  // Marks the records of `keys`, a chain in prefix order (a page is reachable only through the
  // pages before it), as just used, keys[0] the most recently: a bounded store then evicts a
  // chain's tail before its head and never strands pages behind a head it dropped. Absent keys
  // are skipped; a failure is counted (touch_errors), never thrown: a touch is a hint.
  // Thread-safe. The file store changes its index in memory; Redis tells the server (TOUCH,
  // one pipelined round trip per node: touch_does_io()), so a caller on an engine's loop hands
  // it to a thread of its own (StorageController's touch thread, AsyncStore's workers).
  // Default: nothing.
  virtual void touch(std::span<const std::string> /*keys*/) {}
  // Whether touch() waits for I/O (a server round trip). A wrapper answers for its store.
  virtual bool touch_does_io() const {
    const StorageBackend* inner = wrapped();
    return inner != nullptr && inner->touch_does_io();
  }

  // Removes a key; false when it was absent.
  virtual bool remove(const std::string& key) = 0;
  // Removes every record of this store.
  virtual void clear() = 0;

  // Told the key of every record the store takes out: its LRU's evictions, remove(), clear()
  // (the file store; Redis's FLUSHDB names no keys), a corrupt record dropped, and (the file
  // store) a record another instance removed, once this one notices. Called on the thread that
  // removed it, possibly with the store's lock held: it must be quick and must not call the
  // store. One observer at a time; an empty function removes it. Thread-safe.
  using RemovalObserver = std::function<void(std::span<const std::string> keys)>;
  void set_removal_observer(RemovalObserver observer);

  // For a store that wraps another (wrapped() below), the three calls stand for the wrapped
  // store: its counters and gauges, registered under its name.
  StorageStats stats() const;
  // Registers the store's counters (keys per operation and result, bad records, bytes,
  // evictions) and its size in `registry`, labelled with `labels` and backend=name(), until
  // the store is destroyed or registers again.
  void register_metrics(MetricsRegistry& registry, MetricLabels labels = {});
  // Forgets what register_metrics registered (a registry that goes before the store: a cache
  // that shared it).
  void unregister_metrics();

 protected:
  StorageBackend();

  // A store that wraps another and keeps no records of its own (a throttle or a fault injector
  // in tools/: it forwards every call) returns the wrapped store, owned by it. stats(),
  // register_metrics(), unregister_metrics() and set_removal_observer() then go to that store,
  // so the counts and removals are the real store's. Default: none.
  virtual StorageBackend* wrapped() const { return nullptr; }

  // Called with validated arguments. do_batch_set receives only keys no other batch of this
  // process is storing; it skips keys the store already holds (count them with
  // note_deduplicated) and reports them ok.
  virtual std::vector<IoResult> do_batch_get(std::span<const std::string> keys,
                                             std::span<const ByteSpan> dst) = 0;
  virtual std::vector<IoResult> do_batch_set(std::span<const std::string> keys,
                                             std::span<const ConstByteSpan> src) = 0;
  // Backends with a size gauge override this.
  virtual void fill_gauges(StorageStats& /*stats*/) const {}
  // Tells the removal observer (see set_removal_observer).
  void note_removed(std::span<const std::string> keys) const;

  // Counters the backends bump.
  struct Counters {
    Counter exists_queries, gets, get_hits, get_misses, get_errors, bad_records, sets,
        set_written, set_deduplicated, set_errors, bytes_read, bytes_written, removes, evictions,
        eviction_failures, capacity_shrinks, topology_refreshes, touched, touch_errors;
  };
  Counters counters_;
  MetricsScope metrics_;  // after the counters it registers

 private:
  class Inflight;
  std::unique_ptr<Inflight> inflight_;
  mutable Mutex observer_mu_;
  RemovalObserver removal_observer_ HICACHE_GUARDED_BY(observer_mu_);
};

// Builds a backend from a JSON object: {"backend": "file", ...} or {"backend": "redis", ...}.
// An unknown backend or field is an InvalidArgument that lists the valid ones.
std::unique_ptr<StorageBackend> make_storage(std::string_view json_text);

}  // namespace hicache
