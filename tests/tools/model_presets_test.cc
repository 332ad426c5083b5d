// The tools' model resolution: a tool's defaults go only where they apply to the attention
// kind, a preset sits under the user's keys, and the result is a config the library accepts.
#include "tools/workload/model_presets.h"

#include <gtest/gtest.h>

#include "controller/config.h"
#include "transfer/errors.h"

namespace hicache::workload {
namespace {

using nlohmann::json;

const ToolDefaults kTool{.cache = {{"device", "host"}, {"device_tokens", 1024}},
                         .model_common = {{"layers", 4}},
                         .model_mha = {{"kv_heads", 2}, {"head_dim", 32}},
                         .model_mla = json::object()};

TEST(ModelPresets, MhaDefaultsFillAnMhaModelOnly) {
  const json mha = resolve_cache(kTool, "", json::object());
  EXPECT_EQ(mha["model"], (json{{"layers", 4}, {"kv_heads", 2}, {"head_dim", 32}}));
  EXPECT_EQ(HiCacheConfig::from_json_text(mha.dump()).geometry.attention, AttentionKind::kMHA);
  const json user = {
      {"model", {{"attention", "mla"}, {"kv_lora_rank", 32}, {"qk_rope_head_dim", 16}}}};
  const json mla = resolve_cache(kTool, "", user);
  EXPECT_FALSE(mla["model"].contains("kv_heads")) << mla.dump();
  EXPECT_FALSE(mla["model"].contains("head_dim")) << mla.dump();
  EXPECT_EQ(mla["model"]["layers"], 4);
  const HiCacheConfig c = HiCacheConfig::from_json_text(mla.dump());
  EXPECT_EQ(c.geometry.attention, AttentionKind::kMLA);
  EXPECT_EQ(c.geometry.page_bytes(), 4 * (32 + 16) * 2 * 64);  // fp16, the library's page 64
}

TEST(ModelPresets, AnExplicitKeyThatDoesNotApplyStaysTheUsersAndTheLibraryNamesIt) {
  const json user = {
      {"model",
       {{"attention", "mla"}, {"kv_lora_rank", 32}, {"qk_rope_head_dim", 16}, {"kv_heads", 2}}}};
  const json c = resolve_cache(kTool, "", user);
  EXPECT_EQ(c["model"]["kv_heads"], 2);
  try {
    (void)HiCacheConfig::from_json_text(c.dump());
    FAIL() << "kv_heads accepted for an mla model";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(
        std::string(e.what()).find("'model.kv_heads' does not apply to model.attention 'mla'"),
        std::string::npos)
        << e.what();
  }
}

TEST(ModelPresets, DeepSeekV3PresetUnderTheUsersKeys) {
  const json c = resolve_cache(kTool, "deepseek-v3", json::object());
  const HiCacheConfig full = HiCacheConfig::from_json_text(c.dump());
  EXPECT_EQ(full.geometry.attention, AttentionKind::kMLA);
  EXPECT_EQ(full.geometry.num_layers, 61);
  EXPECT_EQ(full.geometry.page_size, 64);
  EXPECT_EQ(full.geometry.dtype, DType::kBFloat16);
  EXPECT_EQ(full.geometry.page_bytes(), std::int64_t{61} * 576 * 2 * 64);  // 70272 bytes a token
  EXPECT_EQ(full.device_tokens, 1024);                                     // the tool's
  // The user's keys win over the preset's (a 2-layer DeepSeek for a quick run).
  const json user = {{"model", {{"layers", 2}}}, {"page_size", 16}};
  const HiCacheConfig small =
      HiCacheConfig::from_json_text(resolve_cache(kTool, "deepseek-v3", user).dump());
  EXPECT_EQ(small.geometry.num_layers, 2);
  EXPECT_EQ(small.geometry.page_size, 16);
  EXPECT_EQ(small.geometry.attention, AttentionKind::kMLA);
}

TEST(ModelPresets, UnknownPresetAndContradictingAttentionAreRefusedByName) {
  try {
    (void)resolve_cache(kTool, "llama-9", json::object());
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("unknown preset 'llama-9'; known: deepseek-v3"),
              std::string::npos)
        << e.what();
  }
  try {
    (void)resolve_cache(kTool, "deepseek-v3", json{{"model", {{"attention", "mha"}}}});
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("contradicts the preset 'deepseek-v3'"), std::string::npos)
        << e.what();
  }
  EXPECT_NO_THROW(resolve_cache(kTool, "deepseek-v3", json{{"model", {{"attention", "mla"}}}}));
}

}  // namespace
}  // namespace hicache::workload
