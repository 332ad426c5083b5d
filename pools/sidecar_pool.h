// Sidecar pools: the state a hybrid model needs beside its attention KV (docs/hybrid.md). A
// cached prefix of such a model is usable only as far as every sidecar pool can restore it:
//
//   all_pages  one page per KV page (a sparse-attention indexer's keys): a prefix of p pages is
//              restorable when the pool holds pages 0..p-1;
//   trailing   only the last `window_pages` pages before the end of a prefix are needed
//              (Mamba / SSM / linear-attention state, window 1: the state after the prefix;
//              sliding-window KV, window = the window in pages): a prefix of p pages is
//              restorable when the pool holds pages p-window..p-1 (from 0 when p < window).
//
// A sidecar page always belongs to one KV page (page i of a prefix). `slots_per_page` says what
// it holds: the KV page size for per-token data (sliding-window KV, indexer keys), 1 for one
// state checkpoint per page. Each pool has its own device and host pages, sized on their own:
// never carved out of the KV pools, never counted in them.
//
// A sidecar pool is a KV pool of a latent-shaped geometry (layers x slot_bytes): it shares the
// KV pools' page states, copy paths and storage record format; geometry() gives that shape.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "pools/device_kv_pool.h"
#include "pools/host_kv_pool.h"
#include "pools/kv_geometry.h"
#include "pools/kv_layout.h"
#include "transfer/device.h"

namespace hicache {

enum class SidecarHitPolicy { kAllPages, kTrailing };

// Accepts "all_pages", "trailing" (and SGLang's "trailing_pages"); throws InvalidArgument naming
// the value and the valid ones.
SidecarHitPolicy parse_sidecar_hit_policy(std::string_view name);
std::string_view to_string(SidecarHitPolicy policy);

struct SidecarSpec {
  std::string name;  // [a-z0-9_], 1-64 characters, not "kv"; part of the storage namespace
  SidecarHitPolicy policy = SidecarHitPolicy::kAllPages;
  std::int32_t window_pages = 1;    // trailing only: the pages an endpoint needs before it
  std::int32_t layers = 1;          // the model layers the state has (1: one block per page)
  std::int32_t slots_per_page = 1;  // the KV page size (per-token data) or 1 (a checkpoint)
  std::int64_t slot_bytes = 0;      // one slot of one layer, a multiple of the dtype's size
  DType dtype = DType::kBFloat16;
  std::int64_t device_pages = 0;  // pages of device memory
  std::int64_t host_pages = 0;    // pages of host memory (at least device_pages)

  // Throws InvalidArgument naming the pool, the first bad field and its value.
  void validate() const;
  // The latent-shaped KV geometry of one pool page (layers x slot_bytes, page = slots_per_page).
  KVGeometry geometry() const;
  // Bytes of one pool page over all layers.
  std::int64_t page_bytes() const;
  // "mamba: trailing (window 1), 24 layers x 1 slot x 2 MiB bf16 = 48 MiB/page, device 64 / host 256 pages"
  std::string describe() const;
};

// One sidecar pool's device and host pages. The host pages are in page_first_direct layout: a
// page is one contiguous block (storage reads and writes it in place), and each layer of it one
// run (a copy between the tiers is one region per page and layer). Not copyable; the Device
// outlives it.
class SidecarPool {
 public:
  // Validates the spec and allocates both tiers (host memory pre-faulted). Throws
  // InvalidArgument for a bad spec, DeviceError when the memory is refused.
  SidecarPool(Device& device, const SidecarSpec& spec, const HostMemoryOptions& memory = {});
  // The same, with the engine's device memory for the device tier, wrapped in place (never
  // freed; the engine keeps it alive and unmoved while the pool lives), as DeviceKVPool wraps
  // the engine's KV: one buffer of device_pages x slots_per_page slots of the latent-shaped
  // geometry (layers x slot_bytes), exactly kv_buffer_bytes of it, in `device.order` (SGLang's:
  // (layers, slots, 1, slot elements); hicache's: (slots, layers, slot elements)). Throws
  // InvalidArgument naming the pool and a null or wrong-sized buffer.
  SidecarPool(Device& device, const SidecarSpec& spec, const ExternalKVBuffer& device_memory,
              const HostMemoryOptions& memory = {});

  const SidecarSpec& spec() const { return spec_; }
  DeviceKVPool& device_pool() { return device_pool_; }
  const DeviceKVPool& device_pool() const { return device_pool_; }
  HostKVPool& host_pool() { return host_pool_; }
  const HostKVPool& host_pool() const { return host_pool_; }

 private:
  SidecarSpec spec_;
  DeviceKVPool device_pool_;
  HostKVPool host_pool_;
};

}  // namespace hicache
