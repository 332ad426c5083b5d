#include "controller/config.h"

#include <gtest/gtest.h>

#include "transfer/errors.h"

namespace hicache {
namespace {

// The backend name inside a storage object, found without a JSON parser in the test.
std::string storage_backend_name(const std::string& json) {
  const auto at = json.find("\"backend\":\"");
  if (at == std::string::npos) return "";
  const auto begin = at + 11;
  return json.substr(begin, json.find('"', begin) - begin);
}

constexpr const char* kFull = R"({
  "device": "host", "page_size": 64, "device_tokens": 8192,
  "model": {"attention": "mha", "layers": 32, "kv_heads": 8, "head_dim": 128, "dtype": "bf16"},
  "host_ratio": 2.5, "host_layout": "page_first_direct", "io_backend": "kernel",
  "write_policy": "write_back", "layer_slots": 4, "queue_capacity": 16, "kernel_max_blocks": 8})";

TEST(HiCacheConfig, ParsesEveryKey) {
  const HiCacheConfig c = HiCacheConfig::from_json_text(kFull);
  EXPECT_EQ(c.device, "host");
  EXPECT_EQ(c.geometry, KVGeometry::mha(32, 8, 128, DType::kBFloat16, 64));
  EXPECT_EQ(c.device_tokens, 8192);
  EXPECT_EQ(c.host_tokens(), 20480);
  EXPECT_EQ(c.host_layout, HostLayout::kPageFirstDirect);
  EXPECT_EQ(c.controller.io_backend, IoBackend::kKernel);
  EXPECT_EQ(c.controller.write_policy, WritePolicy::kWriteBack);
  EXPECT_EQ(c.controller.layer_slots, 4);
  EXPECT_EQ(c.controller.queue_capacity, 16u);
  EXPECT_EQ(c.controller.kernel_max_blocks, 8);
}

TEST(HiCacheConfig, ParsesTheStorageKeys) {
  const HiCacheConfig c = HiCacheConfig::from_json_text(R"({
    "device_tokens": 128, "model": {"layers": 2, "kv_heads": 1, "head_dim": 8},
    "storage": {"backend": "file", "root": "/tmp/x"}, "model_name": "llama", "model_fingerprint": "r7",
    "prefetch_policy": "timeout", "prefetch_threshold_tokens": 256,
    "prefetch_budget_tokens": 4096, "prefetch_timeout_base_ms": 50,
    "prefetch_timeout_per_page_ms": 1, "prefetch_timeout_cap_ms": 900, "storage_batch_pages": 8})");
  EXPECT_EQ(storage_backend_name(c.storage), "file");
  EXPECT_EQ(c.model_name, "llama");
  EXPECT_EQ(c.model_fingerprint, "r7");
  EXPECT_EQ(c.storage_controller.policy, PrefetchPolicy::kTimeout);
  EXPECT_EQ(c.storage_controller.prefetch_threshold_tokens, 256);
  EXPECT_EQ(c.storage_controller.prefetch_budget_tokens, 4096);
  EXPECT_EQ(c.storage_controller.timeout_base.count(), 50);
  EXPECT_EQ(c.storage_controller.timeout_per_page.count(), 1);
  EXPECT_EQ(c.storage_controller.timeout_cap.count(), 900);
  EXPECT_EQ(c.storage_controller.io_batch_pages, 8);
  EXPECT_FALSE(c.storage_controller.mla);
  const HiCacheConfig none = HiCacheConfig::from_json_text(
      R"({"device_tokens": 128, "model": {"layers": 2, "kv_heads": 1, "head_dim": 8}})");
  EXPECT_EQ(none.storage, "") << "no L3 unless configured";
  EXPECT_EQ(none.storage_controller.prefetch_threshold_tokens, 64) << "one page by default";
}

TEST(HiCacheConfig, ParsesTheRadixKeys) {
  const HiCacheConfig c = HiCacheConfig::from_json_text(R"({
    "device_tokens": 128, "model": {"layers": 2, "kv_heads": 1, "head_dim": 8},
    "eviction_policy": "lfu", "write_through_threshold": 3, "load_back_min_tokens": 256,
    "recompute_seconds_per_token": 2.5e-5, "demote_low_watermark": 0.1,
    "demote_high_watermark": 0.3})");
  EXPECT_TRUE(c.radix.host_tier);
  EXPECT_EQ(c.radix.eviction_policy, EvictionPolicy::kLfu);
  EXPECT_EQ(c.radix.write_through_threshold, 3);
  EXPECT_EQ(c.radix.load_back_min_tokens, 256);
  EXPECT_DOUBLE_EQ(c.radix.recompute_seconds_per_token, 2.5e-5);
  EXPECT_DOUBLE_EQ(c.radix.demote_low_watermark, 0.1);
  EXPECT_DOUBLE_EQ(c.radix.demote_high_watermark, 0.3);
  const HiCacheConfig device_only = HiCacheConfig::from_json_text(
      R"({"device_tokens": 128, "model": {"layers": 2, "kv_heads": 1, "head_dim": 8},
          "host_tier": false})");
  EXPECT_FALSE(device_only.radix.host_tier);
  const RadixCacheConfig defaults;
  const HiCacheConfig none = HiCacheConfig::from_json_text(
      R"({"device_tokens": 128, "model": {"layers": 2, "kv_heads": 1, "head_dim": 8}})");
  EXPECT_EQ(none.radix.eviction_policy, defaults.eviction_policy);
  EXPECT_EQ(none.radix.write_through_threshold, defaults.write_through_threshold);
  EXPECT_EQ(none.radix.load_back_min_tokens, defaults.load_back_min_tokens);
  EXPECT_EQ(none.radix.demote_low_watermark, 0);
}

TEST(HiCacheConfig, DefaultsAndMla) {
  const HiCacheConfig c = HiCacheConfig::from_json_text(
      R"({"device_tokens": 128, "host_bytes": 100000000,
          "model": {"attention": "mla", "layers": 2, "kv_lora_rank": 512, "qk_rope_head_dim": 64}})");
  EXPECT_EQ(c.device, "auto");
  EXPECT_EQ(c.geometry.attention, AttentionKind::kMLA);
  EXPECT_EQ(c.geometry.page_size, 64);
  EXPECT_EQ(c.host_tokens(), 100000000 / c.geometry.page_bytes() * 64);
  EXPECT_EQ(c.controller.write_policy, WritePolicy::kWriteThroughSelective);
  EXPECT_EQ(c.controller.io_backend, IoBackend::kDirect);
}

// Each bad document raises an error that names the offending key or value.
TEST(HiCacheConfig, BadInputNamesTheKeyOrValue) {
  const std::pair<const char*, const char*> cases[] = {
      {R"({"model": {"layers": 1, "kv_heads": 1, "head_dim": 8}, "device_tokens": 64, "colour": 1})",
       "'colour'"},
      {R"({"model": {"layers": 1, "kv_heads": 1, "head_dim": 8, "heads": 2}, "device_tokens": 64})",
       "'heads'"},
      {R"({"model": {"layers": 1, "kv_heads": 1, "head_dim": 8}, "device_tokens": 100})", "100"},
      {R"({"model": {"layers": 1, "kv_heads": 1, "head_dim": 8, "dtype": "fp4"}, "device_tokens": 64})",
       "'fp4'"},
      {R"({"model": {"layers": 0, "kv_heads": 1, "head_dim": 8}, "device_tokens": 64})",
       "num_layers"},
      {R"({"model": {"layers": 1, "kv_heads": 1, "head_dim": 8}, "device_tokens": 64,
           "write_policy": "sometimes"})", "'sometimes'"},
      {R"({"model": {"layers": 1, "kv_heads": 1, "head_dim": 8}, "device_tokens": 64,
           "io_backend": "dma"})", "'dma'"},
      {R"({"model": {"layers": 1, "kv_heads": 1, "head_dim": 8}, "device_tokens": 64,
           "host_layout": "page_last"})", "'page_last'"},
      {R"({"model": {"layers": 1, "kv_heads": 1, "head_dim": 8}, "device_tokens": 64,
           "host_ratio": 2, "host_tokens": 64})", "exactly one"},
      {R"({"model": {"layers": 1, "kv_heads": 1, "head_dim": 8}, "device_tokens": "many"})",
       "device_tokens"},
      {R"({"model": {"layers": 1, "kv_heads": 1, "head_dim": 8}, "device_tokens": 64,
           "device": "tpu"})", "'tpu'"},
      {R"({"model": {"layers": 1, "kv_heads": 1, "head_dim": 8}, "device_tokens": 64,
           "layer_slots": 0})", "layer_slots"},
      {R"({"device_tokens": 64})", "'model'"},
      {R"({"model": {"layers": 1, "kv_heads": 1, "head_dim": 8}, "device_tokens": 64,
           "prefetch_policy": "eager"})", "'eager'"},
      {R"({"model": {"layers": 1, "kv_heads": 1, "head_dim": 8}, "device_tokens": 64,
           "prefetch_budget_tokens": 10})", "prefetch_budget_tokens"},
      {R"({"model": {"layers": 1, "kv_heads": 1, "head_dim": 8}, "device_tokens": 64,
           "storage": "file"})", "'storage'"},
      {R"({"model": {"layers": 1, "kv_heads": 1, "head_dim": 8}, "device_tokens": 64,
           "storage_batch_pages": -1})", "storage_batch_pages"},
      {R"({"model": {"layers": 1, "kv_heads": 1, "head_dim": 8}, "device_tokens": 64,
           "eviction_policy": "fifo"})", "'fifo'"},
      {R"({"model": {"layers": 1, "kv_heads": 1, "head_dim": 8}, "device_tokens": 64,
           "write_through_threshold": 0})", "write_through_threshold"},
      {R"({"model": {"layers": 1, "kv_heads": 1, "head_dim": 8}, "device_tokens": 64,
           "load_back_min_tokens": 1.5})", "load_back_min_tokens"},
      {R"({"model": {"layers": 1, "kv_heads": 1, "head_dim": 8}, "device_tokens": 64,
           "recompute_seconds_per_token": -1})", "recompute_seconds_per_token -1"},
      {R"({"model": {"layers": 1, "kv_heads": 1, "head_dim": 8}, "device_tokens": 64,
           "demote_low_watermark": 0.5, "demote_high_watermark": 0.2})", "low 0.5 high 0.2"},
      {R"({"model": {"layers": 1, "kv_heads": 1, "head_dim": 8}, "device_tokens": 64,
           "demote_high_watermark": 1.5})", "high 1.5"},
      {R"({"model": {"layers": 1, "kv_heads": 1, "head_dim": 8}, "device_tokens": 64,
           "host_tier": "no"})", "host_tier"},
      {R"({"model": {"layers": 1, "kv_heads": 1, "head_dim": 8}, "device_tokens": 64,
           "host_tier": false, "storage": {"backend": "file", "root": "/tmp/x"}})",
       "host_tier false"},
      {R"([1, 2])", "object"},
      {R"({"model": )", "not valid JSON"},
      // Found by fuzzing: a number too large for any type escaped as nlohmann's out_of_range.
      {R"({"page_size": 5555e54088})", "not valid JSON"},
  };
  for (const auto& [text, needle] : cases) {
    try {
      HiCacheConfig::from_json_text(text);
      ADD_FAILURE() << "accepted: " << text;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
          << "message '" << e.what() << "' does not name " << needle;
    }
  }
}

}  // namespace
}  // namespace hicache
