#include "tools/workload/model_presets.h"

#include "transfer/errors.h"

namespace hicache::workload {
namespace {

using nlohmann::json;

// Fills `into`'s missing keys from `from`.
void fill_missing(json& into, const json& from) {
  for (const auto& [k, v] : from.items()) {
    if (!into.contains(k)) into[k] = v;
  }
}

}  // namespace

std::span<const ModelPreset> model_presets() {
  static const ModelPreset kPresets[] = {
      {"deepseek-v3",
       "DeepSeek-V3/R1: mla, 61 layers, kv_lora_rank 512, qk_rope_head_dim 64, bf16, page 64 "
       "(69 KiB per token)",
       json{{"model",
             {{"attention", "mla"},
              {"layers", 61},
              {"kv_lora_rank", 512},
              {"qk_rope_head_dim", 64},
              {"dtype", "bf16"}}},
            {"page_size", 64}}},
      {"hybrid",
       "a hybrid reference model (a small Qwen3-Next-like shape): mha, 4 full-attention layers "
       "(4 kv heads x 64, bf16), page 16; sidecar pools 'state' (12 linear-attention layers x "
       "16 KiB fp32: 192 KiB per checkpoint, trailing) and 'index' (an indexer's 128-byte key "
       "per token, all_pages)",
       json{{"model",
             {{"attention", "mha"},
              {"layers", 4},
              {"kv_heads", 4},
              {"head_dim", 64},
              {"dtype", "bf16"}}},
            {"page_size", 16},
            {"sidecars",
             {{"state",
               {{"policy", "trailing"},
                {"window_pages", 1},
                {"layers", 12},
                {"slots_per_page", 1},
                {"slot_bytes", 16384},
                {"dtype", "fp32"},
                {"device_pages", 160},
                {"host_pages", 640}}},
              {"index",
               {{"policy", "all_pages"},
                {"slots_per_page", 16},
                {"slot_bytes", 128},
                {"dtype", "bf16"},
                {"device_pages", 512},
                {"host_pages", 2048}}}}}}},
  };
  return kPresets;
}

std::string model_presets_usage() {
  std::string out;
  for (const ModelPreset& p : model_presets()) {
    std::string left = str_cat("  ", p.name);
    if (left.size() < 32) left += std::string(32 - left.size(), ' ');
    out += str_cat(left, " ", p.description, "\n");
  }
  return out;
}

json resolve_cache(const ToolDefaults& defaults, std::string_view preset, const json& user) {
  const ModelPreset* chosen = nullptr;
  std::string known;
  for (const ModelPreset& p : model_presets()) {
    if (p.name == preset) chosen = &p;
    known += str_cat(known.empty() ? "" : ", ", p.name);
  }
  if (!preset.empty() && chosen == nullptr) {
    throw InvalidArgument(str_cat("model: unknown preset '", preset, "'; known: ", known));
  }
  json out = defaults.cache;
  json model = json::object();
  if (chosen != nullptr) {
    for (const auto& [k, v] : chosen->cache.items()) {
      if (k == "model") {
        model = v;
      } else {
        out[k] = v;
      }
    }
  }
  for (const auto& [k, v] : user.items()) {
    if (k != "model") out[k] = v;
  }
  if (user.contains("model")) {
    if (!user["model"].is_object()) {
      out["model"] = user["model"];  // not an object: the library names it
      return out;
    }
    const json& given = user["model"];
    if (chosen != nullptr && given.contains("attention") &&
        given["attention"] != model["attention"]) {
      throw InvalidArgument(str_cat("model.attention ", given["attention"].dump(),
                                    " contradicts the preset '", preset, "' (",
                                    model["attention"].dump(), ")"));
    }
    for (const auto& [k, v] : given.items()) model[k] = v;
  }
  fill_missing(model, defaults.model_common);
  const json attention = model.contains("attention") ? model["attention"] : json("mha");
  if (attention == "mha") fill_missing(model, defaults.model_mha);
  if (attention == "mla") fill_missing(model, defaults.model_mla);
  out["model"] = model;
  return out;
}

std::string describe(const ToolDefaults& defaults) {
  json d = defaults.cache;
  d["model"] = defaults.model_common;
  if (!defaults.model_mha.empty()) d["model.mha"] = defaults.model_mha;
  if (!defaults.model_mla.empty()) d["model.mla"] = defaults.model_mla;
  return d.dump();
}

}  // namespace hicache::workload
