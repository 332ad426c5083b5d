// The cache side of hicache._hicache: HiCache (PyHiCache, one hicache::HiCache built from a
// config, over the engine's KV tensors when given) and, for an engine whose own allocator hands
// out device slots, EngineSlots. register_cache() adds HiCache, PrefetchOperation,
// validate_config and config_reference to the module.
//
// Threads: Python may call a PyHiCache from several threads at once (the scheduler's
// start_loading while the forward thread waits for a layer, with the GIL released); every call
// that waits or does I/O releases the GIL, and close() waits for the calls in flight.
// Errors: StateError (RuntimeError) on a closed cache or, for L3 calls, when no store is
// attached; InvalidArgument (ValueError) for a bad argument.
#ifndef HICACHE_PYTHON_BINDING_CACHE_H_
#define HICACHE_PYTHON_BINDING_CACHE_H_

#include <pybind11/pybind11.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "controller/hicache.h"
#include "controller/storage_controller.h"
#include "pools/paged_token_allocator.h"
#include "python/binding/store.h"
#include "storage/page_key.h"
#include "transfer/mutex.h"

namespace hicache::binding {

namespace py = pybind11;

// The device pool's slots when the engine's own allocator hands them out (SGLang's
// token_to_kv_pool_allocator, a Python object): hicache never allocates device slots then (loads
// go into slots the engine chose, load_into), treats every slot as the engine's, and the slots
// it frees (evict_device, loads dropped by a reset) are collected here for the Python side to
// hand back to the engine's allocator, on its own thread, with the GIL. Thread-safe.
class EngineSlots final : public TokenSlotAllocator {
 public:
  EngineSlots(std::int64_t num_tokens, std::int32_t page_size)
      : page_size_(page_size), num_pages_(num_tokens / page_size) {}
  std::int32_t page_size() const override { return page_size_; }
  std::int64_t num_pages() const override { return num_pages_; }
  std::int64_t free_tokens() const override { return 0; }  // the engine's to know
  bool is_allocated(std::int64_t page) const override { return page >= 0 && page < num_pages_; }
  bool alloc(std::int64_t, std::vector<std::int64_t>&) override { return false; }
  // Collects whole pages of slots; InvalidArgument (nothing collected) for any other slot.
  void free(std::span<const std::int64_t> slots) override;
  void reset() override {}
  // The slots freed since the last call, in the order they were freed.
  std::vector<std::int64_t> take_returned();

 private:
  std::int32_t page_size_;
  std::int64_t num_pages_;
  Mutex mu_;
  std::vector<std::int64_t> returned_ HICACHE_GUARDED_BY(mu_);
};

// A host page state by its name (to_string(PageState)); InvalidArgument naming the valid ones.
PageState parse_page_state(const std::string& name);

// A page digest from SGLang's hex string; none for None or "".
std::optional<PageDigest> prior_of(const std::optional<std::string>& hex);

// Calls drain() (it moves what arrived into the caller's list and returns the list's size)
// until it returns at least `n` or `timeout_s` passed, sleeping on `signal` in between: whatever
// arrives after a drain bumps the signal, so no arrival is missed and nothing polls.
// REQUIRES: the GIL is released.
template <typename Drain>
void wait_for(const std::shared_ptr<EventSignal>& signal, std::size_t n, double timeout_s,
              Drain&& drain) {
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(std::max(timeout_s, 0.0)));
  while (true) {
    const std::uint64_t seen = signal->seq();
    if (drain() >= n || !signal->wait(seen, deadline)) break;
  }
}

// A HiCache; `store` (may be None) is the one its config names, opened by the Python side so
// that it can be handed out as a Store too. The engine's KV tensors (optional) are wrapped in
// place; `keep` holds them alive as long as the cache.
// REQUIRES: every method is called with the GIL held.
class PyHiCache {
 public:
  // Builds the cache (without the GIL: the TP rendezvous and pool pre-faulting wait). With
  // `engine_allocator`, the device slots are the engine's (EngineSlots).
  // `sidecars`: None, or {pool name: the engine's device tensor of that sidecar pool}
  // (HiCacheParts::sidecar_device).
  PyHiCache(const std::string& config_json, std::shared_ptr<PyStore> store, py::object device_kv,
            py::object host_kv, py::object device_k, py::object device_v,
            const std::string& dim_order, bool engine_allocator, py::object sidecars);
  ~PyHiCache() { close(); }

  // The cache for one call: holds a shared lock on the cache's life, so that close() waits for
  // it and no call runs on a cache that is being destroyed. StateError once closed.
  struct Use {
    std::shared_lock<std::shared_mutex> lock;
    HiCache& hc;
  };
  Use use() {
    std::shared_lock lock(life_);
    if (!cache_) throw StateError("HiCache is closed");
    return Use{std::move(lock), *cache_};
  }
  // Destroys the cache once the calls in flight finished (none of them needs the GIL).
  // Idempotent.
  void close();

  std::shared_ptr<PyStore> store() const { return store_; }
  // L3 at run time (HiCache::detach_storage / attach_storage / clear_storage). Without the
  // GIL: they wait for the storage threads, a TP agreement or a store's connect. `store` is a
  // Store or a JSON text opened here.
  void detach_storage();
  void attach_storage(const py::object& store);
  void clear_storage();

  // Acks of `kind` ("write" or "load") until `n` arrived or `timeout_s` passed, waiting on the
  // controller's event signal without the GIL: [(node id, ok)].
  std::vector<std::pair<NodeId, bool>> wait_acks(const std::string& kind, std::size_t n,
                                                 double timeout_s);

  // Runs drain(storage controller) (it appends what arrived and returns how many it holds)
  // until that is at least `n` or `timeout_s` passed, waiting on the controller's event signal
  // (which the storage controller notifies after every backup ack and revoke) without the GIL.
  // Without a store nothing arrives: it waits out the timeout (when n > 0) all the same.
  template <typename Drain>
  void drain_waiting(HiCache& hc, std::size_t n, double timeout_s, Drain&& drain) {
    StorageController* sc = hc.storage_controller();
    py::gil_scoped_release nogil;
    wait_for(hc.controller().events(), n, timeout_s,
             [&]() -> std::size_t { return sc == nullptr ? 0 : drain(*sc); });
  }

  // Device slots hicache handed back since the last call (engine_allocator mode; else none).
  std::vector<std::int64_t> take_returned_device_slots() {
    return engine_slots_ ? engine_slots_->take_returned() : std::vector<std::int64_t>{};
  }

  // `hc`'s storage controller; StateError when no L3 store is attached.
  StorageController& storage_controller(HiCache& hc);

  // Device-side ordering with the engine's compute stream, instead of a host synchronisation.
  // `stream` is the engine's stream as a native handle (a cudaStream_t: torch's
  // Stream.cuda_stream, 0 for the legacy default stream); none means no ordering (nullptr
  // returned). The stream is wrapped once
  // and kept until close(); a cache without CUDA refuses a nonzero handle (InvalidArgument,
  // Device::wrap_stream).
  //   ready_for_write: an event recorded now on `stream`, for write()'s ready_after (the copy
  //     starts on the device after the work queued so far, which wrote the slots).
  //   ready_for_load: the same for start_loading()'s ready_after (a batch's copies start after
  //     the work queued so far, which may still read the slots they overwrite).
  //   engine_stream: the wrapped stream, for LayerDoneCounter::wait_on_stream.
  // Each event is re-recorded by the next call of its kind; the controller waits on it at the
  // call, so that is safe, and a call that finds it re-recorded by another thread waits on a
  // later point (longer, never too short).
  Event* ready_for_write(HiCache& hc, std::optional<std::uintptr_t> stream);
  Event* ready_for_load(HiCache& hc, std::optional<std::uintptr_t> stream);
  Stream* engine_stream(HiCache& hc, std::optional<std::uintptr_t> stream);
  // The page keys of `tokens` (whole pages) chained after `prior_hex` (a page's hex digest, as
  // SGLang's get_hash_str gives), and each page's hex digest.
  std::pair<std::vector<std::string>, std::vector<std::string>> page_keys(
      const std::vector<std::int32_t>& tokens, const std::optional<std::string>& prior_hex);

 private:
  // Records the write's (or, for_load, the load's) ready event on `stream`; null without one.
  Event* record_on(HiCache& hc, std::optional<std::uintptr_t> stream, bool for_load);
  std::unique_ptr<EngineSlots> engine_slots_;  // outlives cache_ (declared first)
  // The engine's streams wrapped so far and the two ready events; released by close() before
  // the cache (their device).
  Mutex streams_mu_;
  std::vector<std::pair<std::uintptr_t, std::unique_ptr<Stream>>> streams_
      HICACHE_GUARDED_BY(streams_mu_);
  std::unique_ptr<Event> write_ready_ HICACHE_GUARDED_BY(streams_mu_);
  std::unique_ptr<Event> load_ready_ HICACHE_GUARDED_BY(streams_mu_);
  std::unique_ptr<PageKeyer> keyer_;
  std::shared_ptr<PyStore> store_;
  std::vector<py::object> keep_;
  // cache_ is reset only under the writer's hold on life_ (close()) and read only under a
  // reader's (use()). Neither is annotated: the reader's hold leaves use() inside the returned
  // Use, a lock that outlives the function that took it, which clang's analysis cannot follow.
  std::shared_mutex life_;  // NOT annotated (opt-out): use() returns its shared hold inside Use
  std::unique_ptr<HiCache> cache_;  // guarded by life_ (unchecked: see life_)
};

// Adds validate_config, config_reference, PrefetchOperation and HiCache to `m`.
// REQUIRES: register_store(m) ran first (HiCache takes and returns Store).
void register_cache(py::module_& m);

}  // namespace hicache::binding

#endif  // HICACHE_PYTHON_BINDING_CACHE_H_
