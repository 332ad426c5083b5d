#include "pools/device_kv_pool.h"

#include <algorithm>

#include "transfer/errors.h"

namespace hicache {

DeviceKVPool::DeviceKVPool(Device& device, const KVGeometry& geometry, std::int64_t num_tokens)
    : device_(&device), geometry_(geometry) {
  geometry_.validate();
  check_token_count(geometry_, num_tokens, "DeviceKVPool");
  use_allocator(num_tokens, nullptr);
  memory_.push_back(
      device.alloc_device(static_cast<std::size_t>(kv_buffer_bytes(geometry_, num_tokens))));
  desc_ = make_device_layout(geometry_, num_tokens, memory_[0].data());
}

DeviceKVPool::DeviceKVPool(Device& device, const KVGeometry& geometry, std::int64_t num_tokens,
                           const ExternalKVBuffer& external, TokenSlotAllocator* engine_allocator)
    : device_(&device), geometry_(geometry), wrapped_(true) {
  geometry_.validate();
  check_token_count(geometry_, num_tokens, "DeviceKVPool");
  const auto need = static_cast<std::size_t>(kv_buffer_bytes(geometry_, num_tokens));
  // Exactly the size: the strides between layers (and K and V) follow from the slot count, so
  // a buffer of another slot count would be read at the wrong offsets from layer 1 on.
  if (external.data == nullptr || external.bytes != need) {
    throw InvalidArgument(str_cat("DeviceKVPool: the engine's buffer (", external.bytes,
                                  " bytes at ", external.data, ") is not ", num_tokens,
                                  " slots of ", geometry_.token_bytes(), " bytes (", need,
                                  "): device_tokens must be the buffer's slot count"));
  }
  use_allocator(num_tokens, engine_allocator);
  memory_.push_back(device.wrap_device(external.data, external.bytes));
  desc_ = make_device_layout(geometry_, num_tokens, memory_[0].data(), external.order);
}

DeviceKVPool::DeviceKVPool(Device& device, const KVGeometry& geometry, std::int64_t num_tokens,
                           std::span<void* const> k, std::span<void* const> v,
                           std::size_t buffer_bytes, TokenSlotAllocator* engine_allocator)
    : device_(&device), geometry_(geometry), wrapped_(true) {
  geometry_.validate();
  check_token_count(geometry_, num_tokens, "DeviceKVPool");
  if (buffer_bytes != static_cast<std::size_t>(num_tokens * geometry_.unit_bytes())) {
    throw InvalidArgument(str_cat("DeviceKVPool: the engine's per-layer buffers hold ", buffer_bytes,
                                  " bytes each, not ", num_tokens, " slots of ",
                                  geometry_.unit_bytes(), " bytes (",
                                  num_tokens * geometry_.unit_bytes(),
                                  "): device_tokens must be their slot count"));
  }
  const auto layers = static_cast<std::size_t>(geometry_.num_layers);
  const auto kv = static_cast<std::size_t>(geometry_.num_kv());
  if (k.size() != layers || v.size() != (kv == 2 ? layers : 0)) {
    throw InvalidArgument(str_cat("DeviceKVPool: ", k.size(), " K and ", v.size(),
                                  " V buffers for ", layers, " layers of ",
                                  kv == 2 ? "MHA (one K and one V each)" : "MLA (one each, no V)"));
  }
  const std::int64_t run = num_tokens * geometry_.unit_bytes();  // one buffer's bytes
  std::vector<std::uintptr_t> all;
  for (void* p : k) all.push_back(reinterpret_cast<std::uintptr_t>(p));
  for (void* p : v) all.push_back(reinterpret_cast<std::uintptr_t>(p));
  for (std::size_t i = 0; i < all.size(); ++i) {
    if (all[i] == 0) throw InvalidArgument(str_cat("DeviceKVPool: buffer ", i, " is null"));
  }
  const auto at = [&](std::size_t i) { return static_cast<std::int64_t>(all[i]); };
  const std::int64_t layer_stride = layers > 1 ? at(1) - at(0) : run;
  bool one_stride = true;  // one allocation cut into layers: addressed by strides
  for (std::size_t l = 0; l < layers; ++l) {
    for (std::size_t c = 0; c < kv; ++c) {
      const std::size_t i = c * layers + l;
      one_stride = one_stride &&
                   at(i) == at(c * layers) + static_cast<std::int64_t>(l) * layer_stride;
    }
  }
  std::vector<std::uintptr_t> sorted = all;
  std::sort(sorted.begin(), sorted.end());
  for (std::size_t i = 1; i < sorted.size(); ++i) {
    if (sorted[i] - sorted[i - 1] < static_cast<std::uintptr_t>(run)) {
      throw InvalidArgument(str_cat("DeviceKVPool: the engine's buffers at ",
                                    reinterpret_cast<void*>(sorted[i - 1]), " and ",
                                    reinterpret_cast<void*>(sorted[i]), " overlap (each holds ",
                                    run, " bytes)"));
    }
  }
  use_allocator(num_tokens, engine_allocator);
  for (std::uintptr_t p : all) {
    memory_.push_back(device.wrap_device(reinterpret_cast<void*>(p), static_cast<std::size_t>(run)));
  }
  if (one_stride) {
    desc_ = make_device_layout(geometry_, num_tokens, k[0]);
    desc_.layer_stride = layer_stride;
    desc_.kv_stride = kv == 2 ? at(layers) - at(0) : 0;
    return;
  }
  // Unrelated addresses: a table of each buffer's offset from the lowest, in host memory and
  // copied to device memory for the kernels.
  desc_ = make_device_layout(geometry_, num_tokens, reinterpret_cast<void*>(sorted.front()));
  desc_.layer_stride = 0;
  desc_.kv_stride = 0;
  layer_offsets_.resize(layers * kv);
  for (std::size_t l = 0; l < layers; ++l) {
    for (std::size_t c = 0; c < kv; ++c) {
      const std::int64_t offset = at(c * layers + l) - static_cast<std::int64_t>(sorted.front());
      layer_offsets_[l * kv + c] = offset;
      desc_.layer_offsets_bits |= offset;
    }
  }
  const std::size_t table_bytes = layer_offsets_.size() * sizeof(std::int64_t);
  layer_offsets_device_ = device.alloc_device(table_bytes);
  auto stream = device.create_stream();
  stream->copy_async(layer_offsets_device_.data(), layer_offsets_.data(), table_bytes);
  stream->synchronize();
  desc_.layer_offsets = layer_offsets_.data();
  desc_.layer_offsets_device = reinterpret_cast<const std::int64_t*>(layer_offsets_device_.data());
}

void DeviceKVPool::use_allocator(std::int64_t num_tokens, TokenSlotAllocator* engine_allocator) {
  if (engine_allocator == nullptr) {
    own_allocator_ = std::make_unique<PagedTokenAllocator>(num_tokens, geometry_.page_size);
    allocator_ = own_allocator_.get();
    return;
  }
  if (engine_allocator->page_size() != geometry_.page_size ||
      engine_allocator->capacity_tokens() > num_tokens) {
    throw InvalidArgument(str_cat("DeviceKVPool: the engine's allocator (page size ",
                                  engine_allocator->page_size(), ", ",
                                  engine_allocator->capacity_tokens(),
                                  " slots) does not fit the pool (page size ", geometry_.page_size,
                                  ", ", num_tokens, " slots)"));
  }
  allocator_ = engine_allocator;
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
  MutexLock lock(hook_mu_);
  layer_wait_hook_ = std::move(hook);
}

bool DeviceKVPool::wait_for_layer(std::int32_t layer) const {
  if (layer < 0 || layer >= geometry_.num_layers) {
    throw InvalidArgument(str_cat("DeviceKVPool::wait_for_layer: layer ", layer,
                                  " is out of range [0, ", geometry_.num_layers, ")"));
  }
  std::function<bool(std::int32_t)> hook;
  {
    MutexLock lock(hook_mu_);
    hook = layer_wait_hook_;  // a small capture: copied without allocating
  }
  // Called without the lock: the forward thread waits here while the main loop may install the
  // next batch's hook.
  return hook ? hook(layer) : true;
}

}  // namespace hicache
