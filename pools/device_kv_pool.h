// DeviceKVPool: the L1 tier, the engine's KV buffer in device memory, indexed by token slot,
// with its PagedTokenAllocator. Per layer it exposes the K and V buffers (or the MLA latent
// buffer) that attention reads, and a hook through which the attention of layer i waits until
// that layer has been loaded (the controller installs its LayerDoneCounter there).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "kernels/layout_math.h"
#include "pools/kv_geometry.h"
#include "pools/kv_layout.h"
#include "pools/paged_token_allocator.h"
#include "transfer/device.h"
#include "transfer/mutex.h"

namespace hicache {

class DeviceKVPool {
 public:
  // Allocates num_tokens slots of device memory. Throws InvalidArgument for a bad geometry or
  // a token count that is not a positive page multiple, DeviceError when memory is refused.
  DeviceKVPool(Device& device, const KVGeometry& geometry, std::int64_t num_tokens);
  // Wraps the engine's device KV buffer (one allocation, in `external.order`) of exactly
  // num_tokens slots (external.bytes must be kv_buffer_bytes), in place. `engine_allocator` (may be null: the pool's own) hands out the slots that
  // writes read and loads fill; it must have the geometry's page size and at most num_tokens
  // slots, and outlive the pool. Throws InvalidArgument naming a null or short buffer, an
  // allocator that does not fit; DeviceError when the runtime refuses the memory.
  DeviceKVPool(Device& device, const KVGeometry& geometry, std::int64_t num_tokens,
               const ExternalKVBuffer& external, TokenSlotAllocator* engine_allocator = nullptr);
  // Wraps the engine's per-layer buffers: k[l] (and v[l] for MHA), each [num_tokens][unit] of
  // exactly `buffer_bytes` (SGLang's k_buffer / v_buffer lists), not overlapping. Buffers at one
  // constant stride from layer to layer (one allocation cut into layers) are addressed by
  // strides; buffers at unrelated addresses (one allocation each) through a table of their
  // offsets, kept in host and in device memory (LayoutDesc::layer_offsets).
  DeviceKVPool(Device& device, const KVGeometry& geometry, std::int64_t num_tokens,
               std::span<void* const> k, std::span<void* const> v, std::size_t buffer_bytes,
               TokenSlotAllocator* engine_allocator = nullptr);

  const KVGeometry& geometry() const { return geometry_; }
  const LayoutDesc& layout() const { return desc_; }
  // Slots the allocator hands out (the engine's allocator may keep some, as SGLang's padding page).
  std::int64_t capacity_tokens() const { return allocator_->capacity_tokens(); }
  // Slots and pages of the KV buffer: the range every slot passed to the pool must lie in.
  std::int64_t num_slots() const { return desc_.num_tokens; }
  std::int64_t num_pages() const { return desc_.num_tokens / geometry_.page_size; }
  std::size_t size_bytes() const {
    return static_cast<std::size_t>(kv_buffer_bytes(geometry_, desc_.num_tokens));
  }
  Device& device() const { return *device_; }

  // The allocator of this pool's slots (its own, or the engine's). Not thread-safe: the
  // engine's main loop owns it.
  TokenSlotAllocator& allocator() { return *allocator_; }
  const TokenSlotAllocator& allocator() const { return *allocator_; }
  // True when the KV memory is the engine's (wrapped, never freed here).
  bool wraps_engine_memory() const { return wrapped_; }

  // Device pointer of the [tokens][unit] buffer of `layer` for K (kv = 0) or V (kv = 1); MLA
  // has only kv = 0, the latent buffer. Throws InvalidArgument for an index out of range.
  std::byte* buffer(std::int32_t layer, std::int32_t kv) const;
  std::byte* k_buffer(std::int32_t layer) const { return buffer(layer, 0); }
  std::byte* v_buffer(std::int32_t layer) const { return buffer(layer, 1); }

  // Installs the function that wait_for_layer() calls; an empty one removes it. Thread-safe
  // against wait_for_layer on other threads (which keep calling the hook they started with).
  void set_layer_wait_hook(std::function<bool(std::int32_t layer)> hook);
  // Called by attention before it reads `layer`: returns once the layer's loads are complete
  // (at once when no hook is installed). False when they failed: the pages this step loaded
  // hold no valid data for the layer, and whatever reads them must be dropped (and the load's
  // ack, not ok, then frees those device slots).
  [[nodiscard]] bool wait_for_layer(std::int32_t layer) const;

 private:
  Device* device_;
  KVGeometry geometry_;
  void use_allocator(std::int64_t num_tokens, TokenSlotAllocator* engine_allocator);

  std::vector<Buffer> memory_;  // one buffer, or the engine's per-layer buffers
  std::vector<std::int64_t> layer_offsets_;  // per-layer buffers at unrelated addresses
  Buffer layer_offsets_device_;              // the same table, for the kernels
  LayoutDesc desc_;
  std::unique_ptr<PagedTokenAllocator> own_allocator_;
  TokenSlotAllocator* allocator_ = nullptr;
  bool wrapped_ = false;
  mutable Mutex hook_mu_;
  // Replaced by the main loop (start_loading) while the forward thread may be waiting on the
  // last one: copied and replaced under hook_mu_, called outside it.
  std::function<bool(std::int32_t)> layer_wait_hook_ HICACHE_GUARDED_BY(hook_mu_);
};

}  // namespace hicache
