#include "tools/workload/engine_stack.h"

namespace hicache::workload {
namespace {

HiCacheParts parts_with(std::shared_ptr<StorageBackend> storage) {
  HiCacheParts parts;
  parts.storage = std::move(storage);
  return parts;
}

}  // namespace

EngineStack::EngineStack(const StackConfig& c, std::shared_ptr<StorageBackend> storage)
    : hicache_(c.cache, parts_with(std::move(storage))) {
  auto engine = c.engine;
  engine.use_storage = engine.use_storage && hicache_.storage_controller() != nullptr;
  engine_ = std::make_unique<SimulatedEngine>(hicache_.cache(), hicache_.controller(),
                                              hicache_.device_pool(), hicache_.host_pool(),
                                              hicache_.device(), engine);
}

EngineStack::~EngineStack() { engine_.reset(); }

}  // namespace hicache::workload
