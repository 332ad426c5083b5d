// The tools' cache flags: a schema key set into the HiCacheConfig JSON a tool builds.
#pragma once

#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace hicache::workload {

// Sets `key` (a schema key; "model.layers" goes inside "model") to `value` in `cache`.
inline void set_cache_key(nlohmann::json& cache, std::string_view key,
                          const nlohmann::json& value) {
  constexpr std::string_view kModel = "model.";
  if (key.starts_with(kModel)) {
    cache["model"][std::string(key.substr(kModel.size()))] = value;
  } else {
    cache[std::string(key)] = value;
  }
}

}  // namespace hicache::workload
