// HiCacheConfig: everything needed to build the device pool, the host pool and the controller,
// read from JSON (the keys mirror SGLang's HiCache flags). Unknown keys and bad values are
// errors that name them. Example:
//
//   {"device": "host", "page_size": 64, "device_tokens": 8192,
//    "model": {"attention": "mha", "layers": 32, "kv_heads": 8, "head_dim": 128, "dtype": "fp16"},
//    "host_ratio": 2.0, "host_layout": "layer_first", "io_backend": "direct",
//    "write_policy": "write_through_selective", "layer_slots": 3, "queue_capacity": 4096}
//
// Host size: exactly one of host_ratio, host_bytes, host_tokens (host_ratio 2.0 by default).
//
// L3 (optional): "storage" is the backend's object for make_storage (e.g. {"backend": "file",
// "root": "/var/cache/hicache"}); "model_name" and "model_fingerprint" (the weights revision) go
// into every page key's namespace; "prefetch_policy" (best_effort | wait_complete | timeout),
// "prefetch_threshold_tokens" (default one page), "prefetch_budget_tokens" (default unlimited,
// at least one page), "prefetch_timeout_base_ms" / "_per_page_ms" / "_cap_ms" (100 / 2 / 5000),
// "storage_batch_pages" (0: the store's preferred batch, 64 MiB for files, ~4 MiB for Redis).
//
// Radix cache (HiRadixCache, see RadixCacheConfig for each): "host_tier" (true; false: a
// device-only prefix cache, which takes no "storage"), "eviction_policy" (lru | lfu),
// "write_through_threshold" (2), "load_back_min_tokens" (0: one page),
// "recompute_seconds_per_token" (0: off), "demote_low_watermark" / "demote_high_watermark"
// (0 / 0: off).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>

#include "controller/hi_radix_cache.h"
#include "controller/hicache_controller.h"
#include "controller/storage_controller.h"
#include "pools/host_kv_pool.h"
#include "pools/kv_geometry.h"
#include "pools/kv_layout.h"

namespace hicache {

// Tensor parallelism: this rank and the group. With size > 1 and no collectives passed to
// HiCache, the ranks meet through Gloo over TCP, rendezvous in `store_dir` (shared by the ranks).
struct TensorParallelConfig {
  int rank = 0;
  int size = 1;
  std::string store_dir;
  std::string hostname = "127.0.0.1";                // the address this rank listens on
  std::chrono::milliseconds timeout{30000};          // each agreement call
  std::chrono::milliseconds connect_timeout{120000};  // the rendezvous
};

struct HiCacheConfig {
  std::string device = "auto";
  KVGeometry geometry;
  std::int64_t device_tokens = 0;
  HostPoolSize host_size{.ratio = 2.0};
  HostLayout host_layout = HostLayout::kLayerFirst;
  ControllerConfig controller;
  std::string storage;  // JSON object for make_storage; empty: no L3
  std::string model_name = "model";
  std::string model_fingerprint = "unversioned";
  StorageControllerConfig storage_controller;
  RadixCacheConfig radix;
  TensorParallelConfig tp;

  // Parses and validates a JSON object; throws InvalidArgument naming the key and value.
  static HiCacheConfig from_json_text(std::string_view text);
  // The same, from a file; also names the file when it cannot be read.
  static HiCacheConfig from_json_file(const std::string& path);
  // Checks every value and the rules between them (a host pool smaller than the device pool, a
  // store without the host tier, a TP rank outside the group); throws InvalidArgument naming
  // the values. HiCache calls it before it builds anything.
  void validate() const;
  // The host pool's token count this configuration resolves to.
  std::int64_t host_tokens() const { return host_size.resolve_tokens(geometry, device_tokens); }
};

}  // namespace hicache
