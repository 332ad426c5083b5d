// A tool's --config FILE (hicache-bench, hicache-stress): one JSON object holding the tool's own
// settings (its flag names with '_' for '-') and the cache's (the library's schema keys, SGLang's
// names included, and "model": a preset's name or a model object). The file is applied first and
// the command line's flags after it, so a flag wins over the file.
//
//   apply_config_file(path, s.cache, s.model, [&](std::string_view key) { ... a ToolKey ... });
#pragma once

#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace hicache::workload {

// What a tool setting's JSON value must be.
enum class ValueKind { kInt, kDouble, kString, kBool };

// One of the tool's own keys: its kind and how the tool takes its value (as text: a string's
// characters, else the JSON text of the number or boolean).
struct ToolKey {
  ValueKind kind = ValueKind::kString;
  std::function<void(const std::string& text)> set;
};

// The tool's key of that name (with '_'), or nullopt when it has none.
using ToolKeyLookup = std::function<std::optional<ToolKey>(std::string_view key)>;

// True for a key a HiCacheConfig JSON takes at its top level ("model", "kv_events", a schema key
// without a dot, an SGLang alias).
bool is_cache_json_key(std::string_view key);

// Applies the JSON object in `path`: "model" sets `preset` (a string) or goes into
// cache["model"] key by key (an object); a key `tool_key` knows is type-checked and handed to it
// (a tool key wins over a cache key of the same name); a cache key goes into `cache` (a model
// flag's name, "layers", into cache["model"]); the library checks the cache's values later.
// Throws InvalidArgument naming the file and the key for an unreadable file, text that is not
// one JSON object, an unknown key (with the nearest schema key), a key with '-', and a value of
// the wrong kind. REQUIRES: nothing of the file applied yet (a throw may leave part applied; the
// tools exit 2 on it).
void apply_config_file(const std::string& path, nlohmann::json& cache, std::string& preset,
                       const ToolKeyLookup& tool_key);

// The FILE of every "--config FILE" in argv, in order (each applied in turn, then the flags).
// Throws InvalidArgument when --config is the last argument.
std::vector<std::string> config_file_arguments(int argc, char** argv);

}  // namespace hicache::workload
