// The tools' cache flags: a schema key set into the HiCacheConfig JSON a tool builds, and the keys
// a tool sets itself.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "transfer/errors.h"

namespace hicache::workload {

// Sets `key` (a schema key; "model.layers" goes inside "model", "kv_events.topic" inside
// "kv_events") to `value` in `cache`.
inline void set_cache_key(nlohmann::json& cache, std::string_view key,
                          const nlohmann::json& value) {
  const std::size_t dot = key.find('.');
  if (dot != std::string_view::npos) {
    cache[std::string(key.substr(0, dot))][std::string(key.substr(dot + 1))] = value;
  } else {
    cache[std::string(key)] = value;
  }
}

// The tools start their TP ranks themselves (--tp N), so the group's keys are theirs to set.
// Throws InvalidArgument naming a key the user gave in `cache` (the flags' and config file's
// keys, before the tool's own): tp_rank, tp_size and tp_store_dir always (a tool's process never
// joins a group started by hand: it would wait for peers that never come), and tp_hostname,
// tp_timeout_ms and tp_connect_timeout_ms when `tp` is 1 (no group: nothing would read them).
inline void refuse_tool_owned_tp_keys(const nlohmann::json& cache, std::int64_t tp) {
  for (const char* key : {"tp_rank", "tp_size", "tp_store_dir"}) {
    if (cache.contains(key)) {
      throw InvalidArgument(
          str_cat("key '", key,
                  "': this tool starts its TP ranks itself (--tp N) and sets each rank's "
                  "tp_rank, tp_size and tp_store_dir; it does not join a group started by hand"));
    }
  }
  if (tp > 1) return;
  for (const char* key : {"tp_hostname", "tp_timeout_ms", "tp_connect_timeout_ms"}) {
    if (cache.contains(key)) {
      throw InvalidArgument(
          str_cat("key '", key, "' applies to TP groups only; give --tp N (N > 1) with it"));
    }
  }
}

}  // namespace hicache::workload
