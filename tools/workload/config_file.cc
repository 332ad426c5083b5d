#include "tools/workload/config_file.h"

#include <fstream>
#include <sstream>

#include "controller/config_schema.h"
#include "tools/workload/cache_flags.h"
#include "transfer/errors.h"

namespace hicache::workload {

namespace {

std::string flag_name(std::string_view key) {
  std::string f(key);
  for (char& c : f) c = c == '_' ? '-' : c;
  return f;
}

bool fits(ValueKind kind, const nlohmann::json& value) {
  switch (kind) {
    case ValueKind::kString:
      return value.is_string();
    case ValueKind::kBool:
      return value.is_boolean();
    case ValueKind::kInt:
      return value.is_number_integer();
    case ValueKind::kDouble:
      return value.is_number();
  }
  return false;
}

}  // namespace

bool is_cache_json_key(std::string_view key) {
  if (key == "model" || key == "kv_events") return true;
  for (const auto& k : config_keys()) {
    if (k.key == key && key.find('.') == std::string_view::npos) return true;
  }
  for (const auto& a : config_aliases()) {
    if (a.alias == key) return true;
  }
  return false;
}

void apply_config_file(const std::string& path, nlohmann::json& cache, std::string& preset,
                       const ToolKeyLookup& tool_key) {
  std::ifstream in(path);
  if (!in) throw InvalidArgument(str_cat("--config: cannot read '", path, "'"));
  std::stringstream text;
  text << in.rdbuf();
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text.str());
  } catch (const std::exception& e) {
    throw InvalidArgument(str_cat("--config '", path, "': not JSON: ", e.what()));
  }
  if (!j.is_object()) throw InvalidArgument(str_cat("--config '", path, "': not a JSON object"));
  for (const auto& [key, value] : j.items()) {
    if (key == "model") {  // the cache's model object, or a preset's name
      if (value.is_object()) {
        for (const auto& [inner, v] : value.items()) cache["model"][inner] = v;
      } else if (value.is_string()) {
        preset = value.get<std::string>();
      } else {
        throw InvalidArgument(str_cat("--config '", path, "': key 'model' is ", value.dump(),
                                      ", it must be a preset's name or a model object"));
      }
      continue;
    }
    const bool dashed = key.find('-') != std::string::npos;
    const std::optional<ToolKey> mine = dashed ? std::nullopt : tool_key(key);
    if (!mine && !dashed) {
      // The cache's keys: checked by HiCacheConfig when the tool builds its cache.
      if (is_cache_json_key(key)) {
        cache[key] = value;
        continue;
      }
      if (const auto* k = find_config_flag(flag_name(key))) {  // "layers"
        set_cache_key(cache, k->key, value);
        continue;
      }
    }
    if (!mine) {
      const std::string near = nearest_config_key(key);
      throw InvalidArgument(str_cat("--config '", path, "': unknown key '", key, "'",
                                    near.empty() ? "" : str_cat("; did you mean '", near, "'?")));
    }
    if (!fits(mine->kind, value)) {
      static const char* kWant[] = {"an integer", "a number", "a string", "true or false"};
      throw InvalidArgument(str_cat("--config '", path, "': key '", key, "' is ", value.dump(),
                                    ", it must be ", kWant[static_cast<int>(mine->kind)]));
    }
    mine->set(value.is_string() ? value.get<std::string>() : value.dump());
  }
}

std::vector<std::string> config_file_arguments(int argc, char** argv) {
  std::vector<std::string> paths;
  for (int i = 1; i < argc; ++i) {
    if (std::string_view(argv[i]) != "--config") continue;
    if (i + 1 >= argc) throw InvalidArgument("--config: missing file");
    paths.emplace_back(argv[++i]);
  }
  return paths;
}

}  // namespace hicache::workload
