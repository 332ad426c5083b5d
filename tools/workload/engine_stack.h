// One simulated engine instance with all its tiers, as hicache-bench and hicache-stress build it:
// device backend, device and host KV pools, HiCacheController, optional L3 (a StorageBackend
// from make_storage's JSON, a StorageController over local collectives), HiRadixCache and the
// SimulatedEngine main loop. Members are declared in dependency order, so destruction stops the
// engine's threads before the pools and the store go.
#pragma once

#include <memory>
#include <string>

#include "controller/config.h"
#include "controller/hi_radix_cache.h"
#include "controller/simulated_engine.h"
#include "controller/storage_controller.h"
#include "pools/device_kv_pool.h"
#include "pools/host_kv_pool.h"
#include "storage/collective.h"
#include "storage/storage_backend.h"
#include "transfer/device.h"

namespace hicache::workload {

struct StackConfig {
  // Pools, controller, storage controller, radix cache (cache.storage: L3 JSON;
  // cache.radix.host_tier false: device only, cache.storage must be empty).
  HiCacheConfig cache;
  SimulatedEngineConfig engine;
};

class EngineStack {
 public:
  // `storage`: a backend to use instead of building one from config.cache.storage (the stress
  // tool's fault injector wraps one); nullptr: built from the JSON when it is not empty.
  explicit EngineStack(const StackConfig& config, std::unique_ptr<StorageBackend> storage = nullptr);
  ~EngineStack();
  EngineStack(const EngineStack&) = delete;
  EngineStack& operator=(const EngineStack&) = delete;

  Device& device() { return *device_; }
  DeviceKVPool& device_pool() { return device_pool_; }
  HostKVPool& host_pool() { return host_pool_; }
  HiCacheController& controller() { return controller_; }
  StorageBackend* storage() { return storage_.get(); }
  StorageController* storage_controller() { return storage_controller_.get(); }
  HiRadixCache& cache() { return *cache_; }
  SimulatedEngine& engine() { return *engine_; }
  const KeyNamespace& key_namespace() const { return ns_; }

 private:
  std::unique_ptr<Device> device_;
  DeviceKVPool device_pool_;
  HostKVPool host_pool_;
  HiCacheController controller_;
  std::unique_ptr<StorageBackend> storage_;
  LocalCollective local_;
  KeyNamespace ns_;
  std::unique_ptr<StorageController> storage_controller_;
  std::unique_ptr<HiRadixCache> cache_;
  std::unique_ptr<SimulatedEngine> engine_;
};

}  // namespace hicache::workload
