#include "tools/workload/engine_stack.h"

#include "transfer/errors.h"

namespace hicache::workload {
EngineStack::EngineStack(const StackConfig& c, std::unique_ptr<StorageBackend> storage)
    : device_(Device::create(c.cache.device)),
      device_pool_(*device_, c.cache.geometry, c.cache.device_tokens),
      host_pool_(*device_, c.cache.geometry, c.cache.host_layout,
                 c.cache.radix.host_tier ? c.cache.host_tokens() : c.cache.geometry.page_size),
      controller_(*device_, device_pool_, host_pool_, c.cache.controller),
      storage_(std::move(storage)) {
  if (!storage_ && !c.cache.storage.empty()) storage_ = make_storage(c.cache.storage);
  if (storage_) {
    if (!c.cache.radix.host_tier) {
      throw InvalidArgument("engine stack: a storage tier needs the host tier");
    }
    ns_ = KeyNamespace{.model = c.cache.model_name,
                       .fingerprint = c.cache.model_fingerprint,
                       .dtype = std::string(to_string(c.cache.geometry.dtype)),
                       .layout = std::string(to_string(c.cache.host_layout)),
                       .page_size = c.cache.geometry.page_size,
                       .mla = c.cache.geometry.attention == AttentionKind::kMLA};
    storage_controller_ = std::make_unique<StorageController>(
        host_pool_, *storage_, ns_, local_, local_, local_, c.cache.storage_controller);
  }
  cache_ = std::make_unique<HiRadixCache>(controller_, device_pool_, host_pool_, c.cache.radix,
                                          storage_controller_.get(),
                                          storage_controller_ ? &ns_ : nullptr);
  auto engine = c.engine;
  engine.use_storage = engine.use_storage && storage_controller_ != nullptr;
  engine_ = std::make_unique<SimulatedEngine>(*cache_, controller_, device_pool_, host_pool_,
                                              *device_, engine);
}

EngineStack::~EngineStack() {
  engine_.reset();
  cache_.reset();
  if (storage_controller_) storage_controller_->stop();
  controller_.stop();
}

}  // namespace hicache::workload
