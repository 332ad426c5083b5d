#include "pools/device_kv_pool.h"

#include "transfer/errors.h"

namespace hicache {

DeviceKVPool::DeviceKVPool(Device& device, const KVGeometry& geometry, std::int64_t num_tokens)
    : device_(&device),
      geometry_(geometry),
      allocator_((check_token_count(geometry, num_tokens, "DeviceKVPool"), num_tokens),
                 geometry.page_size) {
  geometry_.validate();
  memory_ = device.alloc_device(static_cast<std::size_t>(kv_buffer_bytes(geometry_, num_tokens)));
  desc_ = make_device_layout(geometry_, num_tokens, memory_.data());
}

std::byte* DeviceKVPool::buffer(std::int32_t layer, std::int32_t kv) const {
  if (layer < 0 || layer >= geometry_.num_layers) {
    throw InvalidArgument(str_cat("DeviceKVPool::buffer: layer ", layer, " is out of range [0, ",
                                  geometry_.num_layers, ")"));
  }
  if (kv < 0 || kv >= geometry_.num_kv()) {
    throw InvalidArgument(str_cat("DeviceKVPool::buffer: kv index ", kv, " is out of range [0, ",
                                  geometry_.num_kv(), ")"));
  }
  return reinterpret_cast<std::byte*>(desc_.base + page_unit_offset(desc_, layer, kv, 0));
}

void DeviceKVPool::set_layer_wait_hook(std::function<bool(std::int32_t)> hook) {
  layer_wait_hook_ = std::move(hook);
}

bool DeviceKVPool::wait_for_layer(std::int32_t layer) const {
  if (layer < 0 || layer >= geometry_.num_layers) {
    throw InvalidArgument(str_cat("DeviceKVPool::wait_for_layer: layer ", layer,
                                  " is out of range [0, ", geometry_.num_layers, ")"));
  }
  return layer_wait_hook_ ? layer_wait_hook_(layer) : true;
}

}  // namespace hicache
