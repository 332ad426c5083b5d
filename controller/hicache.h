// HiCache: the front door. Built from one HiCacheConfig, it owns and wires every part an engine
// needs below its scheduler: the device runtime (or the engine's own), the device and host KV
// pools, HiCacheController, the L3 store (make_storage), the page-key namespace, the TP
// collectives, StorageController and HiRadixCache. The engine's main loop then drives cache()
// each step (see hi_radix_cache.h) and uses device_pool() as its KV memory.
//
//   auto config = hicache::HiCacheConfig::from_json_file("hicache.json");
//   hicache::HiCache hc(config);
//   auto m = hc.cache().match_prefix(tokens);
//   ...
//
// Construction validates the whole configuration (each key's range, and the rules between keys:
// a host pool smaller than the device pool, a store without a host tier, a TP rank outside the
// group) and opens the store before any thread starts; a bad value throws InvalidArgument
// naming it, a store that cannot be opened throws its error, and nothing is left running.
// The destructor stops every thread, then releases the parts in the reverse order of their
// construction.
//
// The key namespace is derived here and nowhere else: model name and fingerprint, KV dtype,
// host layout, page size, TP rank and size, and MLA (one namespace for every rank, since every
// rank holds the same KV).
//
// Threading: as HiRadixCache, the engine's main loop owns it.
#pragma once

#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "controller/config.h"
#include "controller/hi_radix_cache.h"
#include "controller/hicache_controller.h"
#include "controller/kv_events.h"
#include "controller/metrics_server.h"
#include "controller/storage_controller.h"
#include "pools/device_kv_pool.h"
#include "pools/host_kv_pool.h"
#include "pools/sidecar_pool.h"
#include "storage/collective.h"
#include "storage/page_key.h"
#include "storage/storage_backend.h"
#include "transfer/device.h"

namespace hicache {

// The collectives of one TP rank (all three null, or all three set, each a separate group:
// the prefetch thread, the backup thread and the main loop each agree on their own stream of
// calls). They must outlive the HiCache.
struct HiCacheCollectives {
  Collective* prefetch = nullptr;
  Collective* backup = nullptr;
  Collective* main = nullptr;
};

// What an embedding engine (or a test) passes in instead of letting HiCache build it.
struct HiCacheParts {
  // The engine's device runtime; null: Device::create(config.device). Must outlive the HiCache.
  Device* device = nullptr;
  // A store to use instead of make_storage(config.storage) (a fault injector, a store the engine
  // shares with other caches); requires the host tier. Its metrics report into the cache that
  // registered it last, until that cache goes.
  std::shared_ptr<StorageBackend> storage;
  // Wraps each store HiCache opens from a config (at construction and in attach_storage(json)):
  // a what-if throttle or a fault injector that the real storage threads then call. Returns the
  // store to use (not null); empty: the store as opened.
  std::function<std::shared_ptr<StorageBackend>(std::unique_ptr<StorageBackend>)> wrap_storage;
  // TP collectives; none: one LocalCollective for tp_size 1, Gloo groups from config.tp for
  // more ranks.
  HiCacheCollectives collectives;
  // The engine's KV memory, wrapped in place instead of allocated (never freed by hicache; the
  // engine keeps it alive and unmoved while the HiCache lives). Device: one buffer
  // (device_kv, of config.device_tokens slots) or per-layer K/V buffers (device_k, device_v,
  // wherever they lie: see DeviceKVPool); host: one buffer of config's host tokens in config.host_layout, in
  // host_kv.order. Empty: allocated by the device runtime.
  std::optional<ExternalKVBuffer> device_kv;
  std::vector<void*> device_k, device_v;
  std::size_t device_layer_bytes = 0;  // the size of each of device_k / device_v
  std::optional<ExternalKVBuffer> host_kv;
  // The engine's slot allocator for the device pool (must outlive the HiCache); null: the
  // pool's own.
  TokenSlotAllocator* device_allocator = nullptr;
  // The engine's device memory of sidecar pools (config.sidecars), by pool name, wrapped in
  // place as the KV's is (SidecarPool's engine-memory constructor); a pool not named here
  // allocates its own. A name that is not a pool of the config is refused.
  std::map<std::string, ExternalKVBuffer> sidecar_device;
};

class HiCache {
 public:
  // Throws InvalidArgument naming a bad value (state unchanged: nothing started), Error when
  // the store or the TP rendezvous fails, DeviceError when pool memory is refused.
  explicit HiCache(const HiCacheConfig& config, HiCacheParts parts = {});
  ~HiCache();
  HiCache(const HiCache&) = delete;
  HiCache& operator=(const HiCache&) = delete;

  const HiCacheConfig& config() const { return config_; }
  Device& device() { return *device_; }
  DeviceKVPool& device_pool() { return *device_pool_; }
  HostKVPool& host_pool() { return *host_pool_; }
  HiCacheController& controller() { return *controller_; }
  // The sidecar pools of config.sidecars (docs/hybrid.md): the index of the one named `name`
  // (SidecarInsert::pool, HiRadixCache::sidecar_device_slots) and the pool. InvalidArgument
  // naming a pool the config does not have.
  std::int32_t sidecar_index(std::string_view name) const;
  SidecarPool& sidecar_pool(std::string_view name) { return *sidecar_pools_[sidecar_index(name)]; }
  HiRadixCache& cache() { return *cache_; }
  // Null without L3.
  StorageBackend* storage() { return storage_.get(); }
  StorageController* storage_controller() { return storage_controller_.get(); }
  // This rank's collectives (for tp_size 1 one LocalCollective serves every role); an attach
  // may renew the prefetch and backup groups.
  const HiCacheCollectives& collectives() const { return collectives_; }
  // The namespace every page key of this cache carries (also without L3).
  const KeyNamespace& key_namespace() const { return ns_; }
  // The KV event publisher (config kv_events), or null: off, or not the publishing TP rank.
  KvEventPublisher* kv_events() { return kv_events_.get(); }
  // Every component's counters, gauges and histograms (hicache_*), with tp_rank as a label.
  MetricsRegistry& metrics() { return *metrics_; }
  // The port /metrics is served on, or -1 without a metrics server (metrics_port -1).
  int metrics_port() const { return metrics_server_ ? metrics_server_->port() : -1; }

  // L3 at run time, called by the main loop (every TP rank at the same step).
  // detach_storage: HiRadixCache::detach_storage, then the store and its controller go; L1 and
  // L2 keep serving. Nothing without L3.
  void detach_storage();
  // attach_storage: a store from `storage_json` (the config's "storage" object; empty: the
  // config's own) and a StorageController for it. Its prefetch and backup collectives: the
  // cache's own, resumed (a TP group that failed for good is replaced by a fresh one, all ranks
  // meeting again), or `collectives` when given (required when the engine passed its own and
  // they failed). Throws (InvalidArgument, IoError, StateError when L3 is attached) and changes
  // nothing when the store cannot be opened.
  void attach_storage(const std::string& storage_json = {}, HiCacheCollectives collectives = {});
  // The same with a store the caller built (shared, as HiCacheParts::storage).
  void attach_storage(std::shared_ptr<StorageBackend> store, HiCacheCollectives collectives = {});
  // Empties the store (every record; Redis: FLUSHDB) and makes the tree forget what it held.
  // Nothing without L3.
  void clear_storage();

  // Stops every thread (storage threads first, then the controller's); idempotent. The parts
  // stay readable; the cache takes no more work.
  void stop();

 private:
  HiCacheConfig config_;
  std::unique_ptr<MetricsRegistry> metrics_ = std::make_unique<MetricsRegistry>();  // last to go
  std::unique_ptr<Device> owned_device_;
  Device* device_ = nullptr;
  std::shared_ptr<StorageBackend> storage_;
  decltype(HiCacheParts::wrap_storage) wrap_storage_;
  KeyNamespace ns_;
  // TP: local for one rank, owned Gloo groups for several, or the engine's.
  std::unique_ptr<Collective> owned_collectives_[3];
  HiCacheCollectives collectives_;
  std::unique_ptr<DeviceKVPool> device_pool_;
  std::unique_ptr<HostKVPool> host_pool_;
  std::vector<std::unique_ptr<SidecarPool>> sidecar_pools_;  // config.sidecars, in order
  std::unique_ptr<HiCacheController> controller_;
  std::unique_ptr<StorageController> storage_controller_;
  std::unique_ptr<KvEventPublisher> kv_events_;  // outlives the cache that publishes through it
  std::unique_ptr<HiRadixCache> cache_;
  std::unique_ptr<MetricsServer> metrics_server_;
  bool stopped_ = false;
  int group_renewals_ = 0;  // fresh TP groups made by attaches: names the next one
  // The store's removals go to the KV events (L3 records that left), when both are on.
  void observe_removals();
  // make_storage of the store config as HiCache opens it, wrapped by wrap_storage_.
  std::shared_ptr<StorageBackend> open_storage(const std::string& json) const;
  // A Gloo group of this rank's TP ranks named after the namespace and `role`.
  std::unique_ptr<Collective> make_tp_group(const std::string& role) const;
  // attach_storage after the store was opened (or `error`, when it could not be): agreed over
  // the TP ranks first.
  void attach_agreed(std::shared_ptr<StorageBackend> store, std::exception_ptr error,
                     HiCacheCollectives collectives);
};

}  // namespace hicache
