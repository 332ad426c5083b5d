// The model a tool runs (hicache-bench, hicache-stress): a named preset of a real model's KV
// geometry, the user's model keys over it, and the tool's own defaults for what is still
// missing, each default applied only where it applies to the model's attention kind (an mla
// model takes no kv_heads or head_dim: the library refuses them there, so a tool default must
// not put them in). An explicit key that does not apply (--kv-heads with --attention mla) is
// the user's, and the library refuses it naming the key.
//
//   ToolDefaults d{.cache = {{"device_tokens", 8192}},
//                  .model_common = {{"layers", 16}},
//                  .model_mha = {{"kv_heads", 4}, {"head_dim", 64}}};
//   json cache = resolve_cache(d, "deepseek-v3", user);  // then HiCacheConfig::from_json_text
#pragma once

#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <string_view>

namespace hicache::workload {

struct ModelPreset {
  std::string_view name;         // what --model takes
  std::string_view description;  // one line for --help
  // Cache keys it sets: the "model" object and top-level keys (page_size).
  nlohmann::json cache;
};

// Every preset: "deepseek-v3" (61 layers, MLA, kv_lora_rank 512, qk_rope_head_dim 64, bf16,
// page 64: 576 values x 2 bytes x 61 layers = 70272 bytes per token, 4.3 MiB per page).
std::span<const ModelPreset> model_presets();

// "  NAME  description" lines for a tool's usage.
std::string model_presets_usage();

// A tool's own cache settings, below the preset and the user's.
struct ToolDefaults {
  nlohmann::json cache = nlohmann::json::object();         // top-level keys, no "model"
  nlohmann::json model_common = nlohmann::json::object();  // model keys of any attention kind
  nlohmann::json model_mha = nlohmann::json::object();     // only for an mha model
  nlohmann::json model_mla = nlohmann::json::object();     // only for an mla model
};

// The cache JSON a tool builds: defaults.cache, then the preset's top-level keys, then the
// user's (what flags and a config file gave); the "model" object likewise: the preset's, the
// user's over it, then defaults.model_common and the kind's defaults for the keys still missing.
// The kind is the user's model.attention, else the preset's, else mha (the library's default).
// `preset` empty: none. Throws InvalidArgument for an unknown preset (naming it and the known
// ones) and for a user's model.attention that contradicts the preset's.
nlohmann::json resolve_cache(const ToolDefaults& defaults, std::string_view preset,
                             const nlohmann::json& user);

// `defaults` as the one JSON object --help shows ({"model": {...}, ...}, the kinds' model keys
// under "model.mha" / "model.mla").
std::string describe(const ToolDefaults& defaults);

}  // namespace hicache::workload
