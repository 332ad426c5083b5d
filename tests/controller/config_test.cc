#include "controller/config.h"

#include <gtest/gtest.h>

#include "controller/config_schema.h"
#include "transfer/errors.h"

#include <fstream>
#include <optional>
#include <tuple>
#include <sstream>

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
  EXPECT_EQ(none.storage_controller.prefetch_threshold_tokens, 256) << "SGLang's default";
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
  EXPECT_DOUBLE_EQ(c.radix.recompute_seconds_per_token.value(), 2.5e-5);
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
  EXPECT_EQ(c.controller.write_policy, WritePolicy::kWriteThrough);
  EXPECT_EQ(c.controller.io_backend, IoBackend::kAuto);
}

// Each bad document raises an error that names the offending key or value.
TEST(HiCacheConfig, BadSidecarsAreNamed) {
  const std::string head =
      R"({"model": {"layers": 1, "kv_heads": 1, "head_dim": 8}, "device_tokens": 64, )";
  const std::string good = R"("policy": "trailing", "slot_bytes": 64, "device_pages": 2, "host_pages": 4)";
  const std::pair<std::string, const char*> cases[] = {
      {R"("sidecars": 3})", "key 'sidecars' is 3"},
      {R"("sidecars": {"state": 3}})", "config: sidecars.state is 3; it must be a JSON object"},
      {R"("sidecars": {"state": {)" + good + R"(, "colour": 1}}})",
       "sidecars.state: unknown key 'colour'"},
      {R"("sidecars": {"state": {"slot_bytes": 64, "device_pages": 2, "host_pages": 4}}})",
       "sidecars.state.policy is required"},
      {R"("sidecars": {"state": {"policy": "last", "slot_bytes": 64, "device_pages": 2, "host_pages": 4}}})",
       "sidecars.state: sidecar hit policy 'last'"},
      {R"("sidecars": {"state": {)" + good + R"(, "dtype": "fp4"}}})", "sidecars.state: "},
      {R"("sidecars": {"state": {)" + good + R"(, "layers": "two"}}})",
       "sidecars.state.layers is \"two\"; it must be an integer"},
      {R"("sidecars": {"state": {)" + good + R"(, "layers": 4294967296}}})",
       "sidecars.state.layers is 4294967296; it must fit 32 bits"},
      {R"("sidecars": {"state": {"policy": "trailing", "slot_bytes": 64, "device_pages": 4, "host_pages": 2}}})",
       "config: sidecars: sidecar pool 'state': host_pages 2: must be at least device_pages (4)"},
      {R"("sidecars": {"kv": {)" + good + R"(}}})", "sidecar pool 'kv'"},
  };
  for (const auto& [tail, want] : cases) {
    try {
      HiCacheConfig::from_json_text(head + tail);
      ADD_FAILURE() << "accepted: " << tail;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  }
  const auto c = HiCacheConfig::from_json_text(
      head + R"("sidecars": {"swa": {)" + good + R"(, "window_pages": 4, "slots_per_page": 8}, "a": {"policy": "all_pages", "slot_bytes": 8, "device_pages": 1, "host_pages": 1}}})");
  ASSERT_EQ(c.sidecars.size(), 2u);
  EXPECT_EQ(c.sidecars[0].name, "a") << "in the order of their names";
  EXPECT_EQ(c.sidecars[1].window_pages, 4);
  EXPECT_EQ(c.sidecars[1].slots_per_page, 8);
  EXPECT_EQ(c.sidecars[1].dtype, DType::kBFloat16);
}

TEST(HiCacheConfig, BadInputNamesTheKeyOrValue) {
  const std::pair<const char*, const char*> cases[] = {
      {R"({"model": {"layers": 1, "kv_heads": 1, "head_dim": 8}, "device_tokens": 64, "colour": 1})",
       "'colour'"},
      {R"({"model": {"layers": 1, "kv_heads": 1, "head_dim": 8, "heads": 2}, "device_tokens": 64})",
       "unknown key 'model.heads'; did you mean 'model.kv_heads'?"},
      {R"({"model": {"layers": 1, "kv_heads": 1, "head_dim": 8}, "device_tokens": 100})", "100"},
      {R"({"model": {"layers": 1, "kv_heads": 1, "head_dim": 8, "dtype": "fp4"}, "device_tokens": 64})",
       "'fp4'"},
      {R"({"model": {"layers": 0, "kv_heads": 1, "head_dim": 8}, "device_tokens": 64})",
       "key 'model.layers' is 0; allowed: >= 1"},
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
           "device": "tpu"})", "key 'device' is \"tpu\"; allowed: auto | host | cuda"},
      {R"({"model": {"layers": 1, "kv_heads": 1, "head_dim": 8}, "device_tokens": 64,
           "layer_slots": 0})", "layer_slots"},
      {R"({"device_tokens": 64})", "key 'model.layers' is required"},
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
           "storage_admission": "write_around"})",
       "key 'storage_admission' is \"write_around\"; allowed: write_through | exclusive | reuse"},
      {R"({"model": {"layers": 1, "kv_heads": 1, "head_dim": 8}, "device_tokens": 64,
           "storage_admission": "reuse", "storage_admission_min_hits": 0})",
       "key 'storage_admission_min_hits' is 0; allowed: >= 1"},
      {R"({"model": {"layers": 1, "kv_heads": 1, "head_dim": 8}, "device_tokens": 64,
           "storage_admission_min_hits": 2})",
       "key 'storage_admission_min_hits' applies to storage_admission 'reuse' only, not "
       "'write_through'"},
      {R"({"model": {"layers": 1, "kv_heads": 1, "head_dim": 8}, "device_tokens": 64,
           "write_through_threshold": 0})", "write_through_threshold"},
      {R"({"model": {"layers": 1, "kv_heads": 1, "head_dim": 8}, "device_tokens": 64,
           "load_back_min_tokens": 1.5})", "load_back_min_tokens"},
      {R"({"model": {"layers": 1, "kv_heads": 1, "head_dim": 8}, "device_tokens": 64,
           "recompute_seconds_per_token": -1})", "key 'recompute_seconds_per_token' is -1; allowed: >= 0"},
      {R"({"model": {"layers": 1, "kv_heads": 1, "head_dim": 8}, "device_tokens": 64,
           "demote_low_watermark": 0.5, "demote_high_watermark": 0.2})", "low 0.5 high 0.2"},
      {R"({"model": {"layers": 1, "kv_heads": 1, "head_dim": 8}, "device_tokens": 64,
           "demote_high_watermark": 1.5})", "key 'demote_high_watermark' is 1.5"},
      {R"({"model": {"layers": 1, "kv_heads": 1, "head_dim": 8}, "device_tokens": 64,
           "host_tier": "no"})", "host_tier"},
      {R"({"model": {"layers": 1, "kv_heads": 1, "head_dim": 8}, "device_tokens": 64,
           "host_tier": false, "storage": {"backend": "file", "root": "/tmp/x"}})",
       "host_tier false"},
      {R"([1, 2])", "object"},
      {R"({"model": )", "not valid JSON"},
      // An unsigned count past int64 must not wrap into a negative one.
      {R"({"model": {"layers": 1, "kv_heads": 1, "head_dim": 8},
           "device_tokens": 18446744073709551615})", "key 'device_tokens' is 18446744073709551615"},
      {R"({"model": {"layers": 1, "kv_heads": 1, "head_dim": 8}, "device_tokens": 64,
           "load_back_min_tokens": 9223372036854775808})", "key 'load_back_min_tokens'"},
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


constexpr const char* kModel =
    R"("device_tokens": 128, "model": {"layers": 2, "kv_heads": 1, "head_dim": 8})";

HiCacheConfig parse_with(const std::string& extra) {
  return HiCacheConfig::from_json_text(str_cat("{", kModel, extra.empty() ? "" : ", ", extra, "}"));
}

std::string error_of(const std::string& extra) {
  try {
    parse_with(extra);
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "(accepted)";
}

// The struct's own defaults (what code that builds a config by hand gets) are the schema's.
TEST(ConfigSchema, TheStructDefaultsAreTheSchemaDefaults) {
  const HiCacheConfig parsed = parse_with("");
  const HiCacheConfig built;
  EXPECT_EQ(parsed.device, built.device);
  EXPECT_EQ(parsed.host_layout, built.host_layout);
  EXPECT_EQ(parsed.host_size.ratio, built.host_size.ratio);
  EXPECT_EQ(parsed.controller.write_policy, built.controller.write_policy);
  EXPECT_EQ(parsed.controller.io_backend, built.controller.io_backend);
  EXPECT_EQ(parsed.controller.layer_slots, built.controller.layer_slots);
  EXPECT_EQ(parsed.controller.queue_capacity, built.controller.queue_capacity);
  EXPECT_EQ(parsed.controller.kernel_max_blocks, built.controller.kernel_max_blocks);
  EXPECT_EQ(parsed.model_name, built.model_name);
  EXPECT_EQ(parsed.model_fingerprint, built.model_fingerprint);
  const auto& ps = parsed.storage_controller;
  const auto& bs = built.storage_controller;
  EXPECT_EQ(ps.policy, bs.policy);
  EXPECT_EQ(ps.prefetch_threshold_tokens, bs.prefetch_threshold_tokens);
  EXPECT_EQ(ps.prefetch_budget_tokens, bs.prefetch_budget_tokens);
  EXPECT_EQ(ps.timeout_base, bs.timeout_base);
  EXPECT_EQ(ps.timeout_per_page, bs.timeout_per_page);
  EXPECT_EQ(ps.timeout_cap, bs.timeout_cap);
  EXPECT_EQ(ps.io_batch_pages, bs.io_batch_pages);
  EXPECT_EQ(parsed.radix.host_tier, built.radix.host_tier);
  EXPECT_EQ(parsed.radix.eviction_policy, built.radix.eviction_policy);
  EXPECT_EQ(parsed.radix.write_through_threshold, built.radix.write_through_threshold);
  EXPECT_EQ(parsed.radix.load_back_min_tokens, built.radix.load_back_min_tokens);
  EXPECT_EQ(parsed.radix.recompute_seconds_per_token, built.radix.recompute_seconds_per_token);
  EXPECT_EQ(parsed.tp.rank, built.tp.rank);
  EXPECT_EQ(parsed.tp.size, built.tp.size);
  EXPECT_EQ(parsed.tp.hostname, built.tp.hostname);
  EXPECT_EQ(parsed.tp.timeout, built.tp.timeout);
  EXPECT_EQ(parsed.tp.connect_timeout, built.tp.connect_timeout);
  EXPECT_EQ(parsed.metrics, built.metrics);
  EXPECT_EQ(parsed.metrics_port, built.metrics_port);
  EXPECT_EQ(parsed.metrics_bind, built.metrics_bind);
  const HiCacheConfig events = parse_with(R"("kv_events": {"endpoint": "tcp://*:5557"})");
  const KvEventsConfig& pe = events.kv_events;
  const KvEventsConfig& be = built.kv_events;
  EXPECT_EQ(parsed.kv_events.endpoint, be.endpoint);
  EXPECT_EQ(pe.replay_endpoint, be.replay_endpoint);
  EXPECT_EQ(pe.topic, be.topic);
  EXPECT_EQ(std::tuple(pe.gpu, pe.cpu_pinned, pe.disk, pe.external),
            std::tuple(be.gpu, be.cpu_pinned, be.disk, be.external));
  EXPECT_EQ(pe.vllm_dialect, be.vllm_dialect);
  EXPECT_EQ(pe.map_encoding, be.map_encoding);
  EXPECT_EQ(pe.attn_dp_rank, be.attn_dp_rank);
  EXPECT_EQ(pe.replay_batches, be.replay_batches);
  EXPECT_EQ(pe.queue_batches, be.queue_batches);
  EXPECT_EQ(events.kv_events_publish_rank, built.kv_events_publish_rank);
  EXPECT_EQ(parsed.geometry.page_size, 64);
  EXPECT_EQ(parsed.geometry.dtype, DType::kFloat16);
}

// Every key of the table parses its own default, and a bad value of each type is refused naming
// the key.
TEST(ConfigSchema, EveryKeyNamesItselfWhenGivenTheWrongType) {
  for (const ConfigKeyInfo& k : config_keys()) {
    const std::string key(k.key);
    const std::string wrong = k.type == ConfigType::kString ? "7" : R"("seven")";
    std::string doc;
    if (key.rfind("model.", 0) == 0) {
      doc = str_cat(R"({"device_tokens": 128, "model": {"layers": 2, "kv_heads": 1, "head_dim": 8, ")",
                    key.substr(6), R"(": )", wrong, "}}");
    } else if (key.rfind("kv_events.", 0) == 0) {
      doc = str_cat("{", kModel, R"(, "kv_events": {)",
                    key == "kv_events.endpoint" ? "" : R"("endpoint": "tcp://*:5557", )", R"(")",
                    key.substr(10), R"(": )", wrong, "}}");
    } else {
      doc = str_cat("{", kModel, R"(, ")", key, R"(": )", wrong, "}");
    }
    try {
      HiCacheConfig::from_json_text(doc);
      ADD_FAILURE() << "accepted " << doc;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(str_cat("key '", key, "'")), std::string::npos)
          << e.what();
    }
  }
}

TEST(HiCacheConfig, ParsesTheKvEventsKeys) {
  const HiCacheConfig c = parse_with(R"("tp_size": 2, "tp_store_dir": "/tmp/x",
      "kv_events": {"endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://*:5558",
      "topic": "kv", "media": "GPU,DISK", "dialect": "vllm", "encoding": "map", "dp_rank": 3,
      "publish_rank": 1, "replay_batches": 7, "queue_batches": 9})");
  const KvEventsConfig& e = c.kv_events;
  EXPECT_EQ(e.endpoint, "tcp://127.0.0.1:5557");
  EXPECT_EQ(e.replay_endpoint, "tcp://*:5558");
  EXPECT_EQ(e.topic, "kv");
  EXPECT_EQ(std::tuple(e.gpu, e.cpu_pinned, e.disk, e.external),
            std::tuple(true, false, true, false));
  EXPECT_TRUE(e.vllm_dialect);
  EXPECT_TRUE(e.map_encoding);
  EXPECT_EQ(e.attn_dp_rank, std::optional<std::int64_t>(3));
  EXPECT_EQ(c.kv_events_publish_rank, 1);
  EXPECT_EQ(e.replay_batches, 7);
  EXPECT_EQ(e.queue_batches, 9);
  // The defaults: every medium, SGLang's dialect and arrays, no DP rank, rank 0 publishes.
  const HiCacheConfig d = parse_with(R"("kv_events": {"endpoint": "tcp://*:5557"})");
  EXPECT_TRUE(d.kv_events.gpu && d.kv_events.cpu_pinned && d.kv_events.disk &&
              d.kv_events.external);
  EXPECT_FALSE(d.kv_events.vllm_dialect || d.kv_events.map_encoding);
  EXPECT_EQ(d.kv_events.attn_dp_rank, std::nullopt);
  EXPECT_EQ(d.kv_events_publish_rank, 0);
  EXPECT_TRUE(parse_with("").kv_events.endpoint.empty());  // off unless given
}

TEST(HiCacheConfig, KvEventsKeysAreRefusedNamingTheKey) {
  const auto err = [](const std::string& inner) {
    return error_of(str_cat(R"("kv_events": {"endpoint": "tcp://*:5557", )", inner, "}"));
  };
  for (const char* media : {R"("TAPE")", R"("GPU,GPU")", R"("GPU,")", R"("")"}) {
    const std::string e = err(str_cat(R"("media": )", media));
    EXPECT_NE(e.find(str_cat("key 'kv_events.media' is ", media)), std::string::npos) << e;
  }
  EXPECT_NE(err(R"("dialect": "trtllm")").find("key 'kv_events.dialect' is \"trtllm\""),
            std::string::npos);
  EXPECT_NE(err(R"("encoding": "json")").find("key 'kv_events.encoding' is \"json\""),
            std::string::npos);
  EXPECT_NE(err(R"("dp_rank": -2)").find("key 'kv_events.dp_rank' is -2"), std::string::npos);
  EXPECT_NE(err(R"("replay_batches": 0)").find("key 'kv_events.replay_batches' is 0"),
            std::string::npos);
  EXPECT_NE(err(R"("queue_batches": 0)").find("key 'kv_events.queue_batches' is 0"),
            std::string::npos);
  EXPECT_NE(err(R"("publish_rank": 1)").find("kv_events.publish_rank 1 is outside [0, tp_size 1)"),
            std::string::npos);
  EXPECT_NE(err(R"("colour": 1)").find("unknown key 'kv_events.colour'"), std::string::npos);
  // Nothing parsed and ignored: a kv_events key without the endpoint (or with an empty one).
  for (const char* doc : {R"("kv_events": {"topic": "kv"})",
                          R"("kv_events": {"endpoint": "", "media": "GPU"})"}) {
    const std::string e = error_of(doc);
    EXPECT_NE(e.find("is set, but kv_events.endpoint is not"), std::string::npos) << e;
  }
  EXPECT_NE(error_of(R"("kv_events": "tcp://*:5557")").find("key 'kv_events' is"),
            std::string::npos);
  EXPECT_NE(error_of(R"("kv_events.endpoint": "tcp://*:5557")").find("unknown key"),
            std::string::npos);
}

TEST(ConfigSchema, UnknownKeysSuggestTheNearestKnownOne) {
  EXPECT_NE(error_of(R"("host_ration": 2)").find("did you mean 'host_ratio'?"), std::string::npos);
  EXPECT_NE(error_of(R"("prefetch_treshold_tokens": 2)").find("'prefetch_threshold_tokens'"),
            std::string::npos);
  EXPECT_NE(error_of(R"("hicache_ration": 2)").find("did you mean 'hicache_ratio'?"),
            std::string::npos);
  EXPECT_NE(error_of(R"("zzzzzzzzzzzz": 2)").find("unknown key 'zzzzzzzzzzzz' (the keys:"),
            std::string::npos);
  EXPECT_EQ(nearest_config_key("colour"), "");
}

TEST(ConfigSchema, KeysThatGoTogetherAreCheckedTogether) {
  const std::string small = error_of(R"("host_tokens": 64)");
  EXPECT_NE(small.find("host pool (64 tokens"), std::string::npos) << small;
  EXPECT_NE(small.find("device_tokens 128"), std::string::npos) << small;
  EXPECT_NE(error_of(R"("host_ratio": 0.5)").find("smaller than the device pool"),
            std::string::npos);
  const std::string mla = error_of(R"("model_name": "x", "page_size": 64)");
  EXPECT_EQ(mla, "(accepted)");
  try {
    HiCacheConfig::from_json_text(R"({"device_tokens": 128, "model": {"attention": "mla",
        "layers": 2, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "kv_heads": 4}})");
    ADD_FAILURE() << "kv_heads accepted for mla";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'model.kv_heads' does not apply to model.attention 'mla'"),
              std::string::npos)
        << e.what();
  }
  // A size in bytes replaces the default ratio; a ratio given with it is two sizes.
  EXPECT_EQ(parse_with(R"("host_tokens": 256)").host_tokens(), 256);
  EXPECT_NE(error_of(R"("host_ratio": 2, "host_tokens": 256)").find("exactly one"),
            std::string::npos);
}

TEST(ConfigSchema, SglangNamesAreAliasesInSglangUnits) {
  const HiCacheConfig c = parse_with(R"("hicache_ratio": 3, "hicache_write_policy": "write_back",
      "hicache_io_backend": "kernel", "hicache_mem_layout": "page_first_direct",
      "hicache_storage_prefetch_policy": "timeout", "hicache_storage_backend": "file",
      "hicache_storage_backend_extra_config": "{\"prefetch_threshold\": 128, \"prefetch_timeout_base\": 0.5, \"prefetch_timeout_per_ki_token\": 0.25, \"root\": \"/tmp/sg\", \"backend_name\": \"hicache\"}")");
  EXPECT_EQ(c.host_tokens(), 384);
  EXPECT_EQ(c.controller.write_policy, WritePolicy::kWriteBack);
  EXPECT_EQ(c.controller.io_backend, IoBackend::kKernel);
  EXPECT_EQ(c.host_layout, HostLayout::kPageFirstDirect);
  EXPECT_EQ(c.storage_controller.policy, PrefetchPolicy::kTimeout);
  EXPECT_EQ(c.storage_controller.prefetch_threshold_tokens, 128);
  EXPECT_EQ(c.storage_controller.timeout_base.count(), 500);
  // 0.25 s per 1024 tokens is 15.6 ms per 64-token page: rounded to 16.
  EXPECT_EQ(c.storage_controller.timeout_per_page.count(), 16);
  EXPECT_EQ(c.storage, R"({"backend":"file","root":"/tmp/sg"})");
  // hicache_size is in GB (1e9 bytes) and replaces the ratio, as in SGLang; 0 means unset.
  const HiCacheConfig sized = parse_with(R"("hicache_ratio": 3, "hicache_size": 0.001)");
  EXPECT_EQ(sized.host_size.bytes, 1000000);
  EXPECT_EQ(sized.host_size.ratio, 0);
  EXPECT_EQ(parse_with(R"("hicache_size": 0)").host_size.ratio, 2.0);
  // The store object itself through the extra config.
  const HiCacheConfig redis = parse_with(R"("hicache_storage_backend": "hicache",
      "hicache_storage_backend_extra_config": {"backend": "redis", "port": 7000})");
  EXPECT_EQ(redis.storage, R"({"backend":"redis","port":7000})");
  EXPECT_NE(error_of(R"("hicache_ratio": 3, "host_ratio": 2)").find("both given"),
            std::string::npos);
  EXPECT_NE(error_of(R"("hicache_storage_backend": "mooncake")").find("allowed: file | hicache"),
            std::string::npos);
  EXPECT_NE(error_of(R"("hicache_storage_backend_extra_config": {"x": 1})")
                .find("needs 'hicache_storage_backend'"),
            std::string::npos);
  EXPECT_NE(error_of(R"("hicache_write_policy": "often")").find("key 'write_policy' is \"often\""),
            std::string::npos);
}

TEST(ConfigSchema, FlagsTakeTextOfTheKeysType) {
  const ConfigKeyInfo* layers = find_config_flag("layers");
  ASSERT_NE(layers, nullptr);
  EXPECT_EQ(layers->key, "model.layers");
  EXPECT_EQ(config_flag_json(*layers, "16"), "16");
  EXPECT_THROW(config_flag_json(*layers, "16x"), InvalidArgument);
  EXPECT_EQ(config_flag_json(*find_config_flag("host-ratio"), "0.5"), "0.5");
  EXPECT_EQ(config_flag_json(*find_config_flag("host-tier"), "false"), "false");
  EXPECT_EQ(config_flag_json(*find_config_flag("write-policy"), "write_back"), R"("write_back")");
  try {
    config_flag_json(*find_config_flag("page-size"), "big");
    ADD_FAILURE();
  } catch (const InvalidArgument& e) {
    EXPECT_STREQ(e.what(), "--page-size: 'big' is not an integer");
  }
  EXPECT_EQ(find_config_flag("host_ratio"), nullptr) << "flags use '-'";
  const std::string usage = config_flags_usage();
  EXPECT_NE(usage.find("--write-policy V"), std::string::npos);
  EXPECT_NE(usage.find("(write_through)"), std::string::npos);
}

// docs/configuration.md carries the generated reference; regenerate it with
// `hicache-bench --config-reference` when the schema changes.
TEST(ConfigSchema, TheReferenceInTheDocsIsTheSchemas) {
  std::ifstream in(HICACHE_CONFIG_REFERENCE);
  ASSERT_TRUE(in) << "cannot read " << HICACHE_CONFIG_REFERENCE;
  std::stringstream text;
  text << in.rdbuf();
  const std::string reference = config_reference_markdown();
  EXPECT_NE(text.str().find(reference), std::string::npos)
      << "docs/configuration.md is out of date; its table must be:\n"
      << reference;
}

}  // namespace
}  // namespace hicache
