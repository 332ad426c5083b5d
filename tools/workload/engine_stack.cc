#include "tools/workload/engine_stack.h"

#include "tools/workload/throttled_storage.h"
#include "transfer/errors.h"

namespace hicache::workload {
namespace {

HiCacheParts parts_with(std::shared_ptr<StorageBackend> storage, const L3Throttle& throttle) {
  HiCacheParts parts;
  parts.storage = std::move(storage);
  if (throttle.active()) {
    parts.wrap_storage = [throttle](std::unique_ptr<StorageBackend> store) {
      return std::make_shared<ThrottledStorage>(std::move(store), throttle);
    };
  }
  return parts;
}

}  // namespace

EngineStack::EngineStack(const StackConfig& c, std::shared_ptr<StorageBackend> storage)
    : hicache_(c.cache, parts_with(std::move(storage), c.l3_throttle)) {
  auto engine = c.engine;
  engine.use_storage = engine.use_storage && hicache_.storage_controller() != nullptr;
  engine_ = std::make_unique<SimulatedEngine>(hicache_.cache(), hicache_.controller(),
                                              hicache_.device_pool(), hicache_.host_pool(),
                                              hicache_.device(), engine);
}

EngineStack::~EngineStack() { engine_.reset(); }

}  // namespace hicache::workload
