// One simulated engine instance, as hicache-bench and hicache-stress run it: the HiCache the
// library assembles from the configuration, and the SimulatedEngine main loop over it.
#pragma once

#include <memory>

#include "controller/config.h"
#include "controller/hicache.h"
#include "tools/workload/simulated_engine.h"
#include "tools/workload/throttled_storage.h"

namespace hicache::workload {

struct StackConfig {
  HiCacheConfig cache;
  SimulatedEngineConfig engine;
  // A what-if slow L3: every store the cache opens from cache.storage is wrapped in a
  // ThrottledStorage (not a store passed to the constructor).
  L3Throttle l3_throttle;
};

class EngineStack {
 public:
  // `storage`: a backend to use instead of building one from config.cache.storage (the stress
  // tool's fault injector wraps one); nullptr: built from the JSON when it is not empty.
  explicit EngineStack(const StackConfig& config, std::shared_ptr<StorageBackend> storage = nullptr);
  ~EngineStack();
  EngineStack(const EngineStack&) = delete;
  EngineStack& operator=(const EngineStack&) = delete;

  HiCache& hicache() { return hicache_; }
  Device& device() { return hicache_.device(); }
  DeviceKVPool& device_pool() { return hicache_.device_pool(); }
  HostKVPool& host_pool() { return hicache_.host_pool(); }
  HiCacheController& controller() { return hicache_.controller(); }
  StorageBackend* storage() { return hicache_.storage(); }
  StorageController* storage_controller() { return hicache_.storage_controller(); }
  HiRadixCache& cache() { return hicache_.cache(); }
  SimulatedEngine& engine() { return *engine_; }
  const KeyNamespace& key_namespace() const { return hicache_.key_namespace(); }

 private:
  HiCache hicache_;
  std::unique_ptr<SimulatedEngine> engine_;  // goes first: it drives the cache
};

}  // namespace hicache::workload
