// HiCacheConfig: everything HiCache needs to build the device pool, the host pool, the
// controllers, the store and the radix cache, read from one JSON object. Every key, its type,
// default, allowed values and SGLang counterpart are in the schema (config_schema.h; the
// reference is docs/configuration.md). Example:
//
//   {"device": "host", "page_size": 64, "device_tokens": 8192,
//    "model": {"attention": "mha", "layers": 32, "kv_heads": 8, "head_dim": 128, "dtype": "bf16"},
//    "host_ratio": 2.0, "write_policy": "write_through",
//    "storage": {"backend": "file", "root": "/var/cache/hicache"}}
//
// Unknown keys are errors that suggest the nearest known key; bad values are errors that name
// the key, the value and what is allowed.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>

#include "controller/hi_radix_cache.h"
#include "controller/hicache_controller.h"
#include "controller/kv_events.h"
#include "controller/storage_controller.h"
#include "pools/host_kv_pool.h"
#include "pools/kv_geometry.h"
#include "pools/kv_layout.h"
#include "pools/sidecar_pool.h"

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
  // A hybrid model's sidecar pools (docs/hybrid.md), in the order of their names; the "sidecars"
  // object: {"<name>": {"policy": ..., "slot_bytes": ..., "device_pages": ..., ...}}.
  std::vector<SidecarSpec> sidecars;
  std::string model_name = "model";
  std::string model_fingerprint = "unversioned";
  StorageControllerConfig storage_controller{.queue_capacity = 4096,
                                             .prefetch_threshold_tokens = 256};
  RadixCacheConfig radix;
  TensorParallelConfig tp;
  // The /metrics HTTP server: -1 off, 0 a free port, else that port; on metrics_bind.
  bool metrics = true;  // false: nothing registered, no op timing on the hot path
  int metrics_port = -1;
  std::string metrics_bind = "127.0.0.1";
  // KV events for routers (controller/kv_events.h): off while the endpoint is empty. Only
  // `kv_events_publish_rank` publishes.
  KvEventsConfig kv_events;
  int kv_events_publish_rank = 0;

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
