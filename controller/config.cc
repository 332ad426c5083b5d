#include "controller/config.h"

#include <nlohmann/json.hpp>

#include <fstream>
#include <set>
#include <sstream>

#include "storage/json_fields.h"
#include "transfer/errors.h"

namespace hicache {
namespace {

using nlohmann::json;

void reject_unknown(const json& object, const std::set<std::string>& known, std::string_view where) {
  json_fields::reject_unknown(object, known, str_cat("config", where));
}

template <typename T>
T get(const json& object, const char* key, T fallback) {
  return json_fields::get<T>(object, key, fallback, "config");
}

std::int32_t get_int32(const json& object, const char* key, std::int32_t fallback) {
  const auto v = get<std::int64_t>(object, key, fallback);
  if (v < INT32_MIN || v > INT32_MAX) {
    throw InvalidArgument(str_cat("config: key '", key, "' is out of range: ", v));
  }
  return static_cast<std::int32_t>(v);
}

KVGeometry parse_model(const json& model, std::int32_t page_size) {
  if (!model.is_object()) throw InvalidArgument("config: 'model' must be an object");
  reject_unknown(model,
                 {"attention", "layers", "kv_heads", "head_dim", "kv_lora_rank",
                  "qk_rope_head_dim", "dtype"},
                 ".model");
  const std::string attention = get<std::string>(model, "attention", "mha");
  const DType dtype = parse_dtype(get<std::string>(model, "dtype", "fp16"));
  const std::int32_t layers = get_int32(model, "layers", 0);
  if (attention == "mha") {
    return KVGeometry::mha(layers, get_int32(model, "kv_heads", 0),
                           get_int32(model, "head_dim", 0), dtype, page_size);
  }
  if (attention == "mla") {
    return KVGeometry::mla(layers, get_int32(model, "kv_lora_rank", 0),
                           get_int32(model, "qk_rope_head_dim", 0), dtype, page_size);
  }
  throw InvalidArgument(str_cat("config: model.attention '", attention, "': valid are mha, mla"));
}

}  // namespace

HiCacheConfig HiCacheConfig::from_json_text(std::string_view text) {
  const json root = json_fields::parse_object(text, "config");
  reject_unknown(root,
                 {"device", "page_size", "device_tokens", "model", "host_ratio", "host_bytes",
                  "host_tokens", "host_layout", "io_backend", "write_policy", "layer_slots",
                  "queue_capacity", "kernel_max_blocks", "storage", "model_name",
                  "model_fingerprint", "prefetch_policy", "prefetch_threshold_tokens",
                  "prefetch_budget_tokens", "prefetch_timeout_base_ms",
                  "prefetch_timeout_per_page_ms", "prefetch_timeout_cap_ms",
                  "storage_batch_pages", "host_tier", "eviction_policy",
                  "write_through_threshold", "load_back_min_tokens",
                  "recompute_seconds_per_token", "demote_low_watermark",
                  "demote_high_watermark", "tp_rank", "tp_size", "tp_store_dir", "tp_hostname",
                  "tp_timeout_ms", "tp_connect_timeout_ms"},
                 "");
  HiCacheConfig c;
  c.device = get<std::string>(root, "device", "auto");
  if (c.device != "auto" && c.device != "host" && c.device != "cuda") {
    throw InvalidArgument(str_cat("config: device '", c.device, "': valid are auto, cuda, host"));
  }
  if (!root.contains("model")) throw InvalidArgument("config: 'model' is required");
  c.geometry = parse_model(root["model"], get_int32(root, "page_size", 64));
  c.device_tokens = get<std::int64_t>(root, "device_tokens", 0);
  check_token_count(c.geometry, c.device_tokens, "config: device_tokens");
  if (root.contains("host_ratio") || root.contains("host_bytes") || root.contains("host_tokens")) {
    c.host_size = HostPoolSize{.ratio = get<double>(root, "host_ratio", 0),
                               .bytes = get<std::int64_t>(root, "host_bytes", 0),
                               .tokens = get<std::int64_t>(root, "host_tokens", 0)};
  }
  c.host_tokens();  // validates the host size
  c.host_layout = parse_host_layout(get<std::string>(root, "host_layout", "layer_first"));
  c.controller.io_backend = parse_io_backend(get<std::string>(root, "io_backend", "direct"));
  c.controller.write_policy =
      parse_write_policy(get<std::string>(root, "write_policy", "write_through_selective"));
  c.controller.layer_slots = get_int32(root, "layer_slots", 3);
  if (c.controller.layer_slots < 1) {
    throw InvalidArgument(str_cat("config: layer_slots must be >= 1, got ", c.controller.layer_slots));
  }
  const auto capacity = get<std::int64_t>(root, "queue_capacity", 4096);
  if (capacity < 1) throw InvalidArgument(str_cat("config: queue_capacity must be >= 1, got ", capacity));
  c.controller.queue_capacity = static_cast<std::size_t>(capacity);
  c.controller.kernel_max_blocks = get_int32(root, "kernel_max_blocks", 0);
  if (c.controller.kernel_max_blocks < 0) {
    throw InvalidArgument(str_cat("config: kernel_max_blocks must be >= 0, got ",
                                  c.controller.kernel_max_blocks));
  }
  // L3: the backend's own object is validated by make_storage when the engine builds it; here it
  // only has to be an object.
  if (root.contains("storage")) {
    if (!root["storage"].is_object()) throw InvalidArgument("config: 'storage' must be an object");
    c.storage = root["storage"].dump();
  }
  c.model_name = get<std::string>(root, "model_name", c.model_name);
  c.model_fingerprint = get<std::string>(root, "model_fingerprint", c.model_fingerprint);
  auto& s = c.storage_controller;
  s.policy = parse_prefetch_policy(get<std::string>(root, "prefetch_policy", "best_effort"));
  const auto page = static_cast<std::int64_t>(c.geometry.page_size);
  s.prefetch_threshold_tokens =
      json_fields::get_int(root, "prefetch_threshold_tokens", page, 0, INT64_MAX, "config");
  s.prefetch_budget_tokens = json_fields::get_int(root, "prefetch_budget_tokens",
                                                  s.prefetch_budget_tokens, page, INT64_MAX,
                                                  "config");
  s.timeout_base = std::chrono::milliseconds(
      json_fields::get_int(root, "prefetch_timeout_base_ms", s.timeout_base.count(), 0,
                           INT32_MAX, "config"));
  s.timeout_per_page = std::chrono::milliseconds(
      json_fields::get_int(root, "prefetch_timeout_per_page_ms", s.timeout_per_page.count(), 0,
                           INT32_MAX, "config"));
  s.timeout_cap = std::chrono::milliseconds(json_fields::get_int(
      root, "prefetch_timeout_cap_ms", s.timeout_cap.count(), 0, INT32_MAX, "config"));
  s.io_batch_pages =
      json_fields::get_int(root, "storage_batch_pages", s.io_batch_pages, 0, 1 << 20, "config");
  s.mla = c.geometry.attention == AttentionKind::kMLA;
  RadixCacheConfig& r = c.radix;
  r.host_tier = get<bool>(root, "host_tier", r.host_tier);
  r.eviction_policy = parse_eviction_policy(get<std::string>(root, "eviction_policy", "lru"));
  r.write_through_threshold = static_cast<std::int32_t>(json_fields::get_int(
      root, "write_through_threshold", r.write_through_threshold, 1, INT32_MAX, "config"));
  r.load_back_min_tokens = json_fields::get_int(root, "load_back_min_tokens",
                                                r.load_back_min_tokens, 0, INT64_MAX, "config");
  r.recompute_seconds_per_token =
      get<double>(root, "recompute_seconds_per_token", r.recompute_seconds_per_token);
  r.demote_low_watermark = get<double>(root, "demote_low_watermark", r.demote_low_watermark);
  r.demote_high_watermark = get<double>(root, "demote_high_watermark", r.demote_high_watermark);
  TensorParallelConfig& tp = c.tp;
  tp.rank = get_int32(root, "tp_rank", tp.rank);
  tp.size = get_int32(root, "tp_size", tp.size);
  tp.store_dir = get<std::string>(root, "tp_store_dir", tp.store_dir);
  tp.hostname = get<std::string>(root, "tp_hostname", tp.hostname);
  tp.timeout = std::chrono::milliseconds(
      json_fields::get_int(root, "tp_timeout_ms", tp.timeout.count(), 1, INT32_MAX, "config"));
  tp.connect_timeout = std::chrono::milliseconds(json_fields::get_int(
      root, "tp_connect_timeout_ms", tp.connect_timeout.count(), 1, INT32_MAX, "config"));
  c.validate();
  return c;
}

HiCacheConfig HiCacheConfig::from_json_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw InvalidArgument(str_cat("config: cannot read '", path, "'"));
  std::stringstream text;
  text << in.rdbuf();
  try {
    return from_json_text(text.str());
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(str_cat(path, ": ", e.what()));
  }
}

void HiCacheConfig::validate() const {
  if (device != "auto" && device != "host" && device != "cuda") {
    throw InvalidArgument(str_cat("config: device '", device, "': valid are auto, cuda, host"));
  }
  check_token_count(geometry, device_tokens, "config: device_tokens");
  try {
    radix.validate();
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(str_cat("config: ", e.what()));
  }
  if (!radix.host_tier && !storage.empty()) {
    throw InvalidArgument("config: host_tier false (a device-only cache) takes no 'storage'");
  }
  if (radix.host_tier) {
    const std::int64_t host = host_tokens();
    if (host < device_tokens) {
      // As SGLang: every device page must find room on the host when it is written back.
      throw InvalidArgument(str_cat("config: the host pool (", host, " tokens, host_ratio ",
                                    host_size.ratio, " / host_bytes ", host_size.bytes,
                                    " / host_tokens ", host_size.tokens,
                                    ") is smaller than the device pool (device_tokens ",
                                    device_tokens, "); give a host pool at least as large"));
    }
  }
  if (tp.size < 1) throw InvalidArgument(str_cat("config: tp_size must be >= 1, got ", tp.size));
  if (tp.rank < 0 || tp.rank >= tp.size) {
    throw InvalidArgument(str_cat("config: tp_rank ", tp.rank, " is outside [0, tp_size ",
                                  tp.size, ")"));
  }
  if (storage_controller.prefetch_budget_tokens < geometry.page_size) {
    throw InvalidArgument(str_cat("config: prefetch_budget_tokens ",
                                  storage_controller.prefetch_budget_tokens,
                                  " is less than one page (", geometry.page_size, ")"));
  }
}

}  // namespace hicache
