#include "controller/config.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <vector>

#include "controller/config_schema.h"
#include "storage/json_fields.h"
#include "transfer/errors.h"

namespace hicache {
namespace {

using nlohmann::json;

// What parsing fills before the geometry can be built.
struct Draft {
  HiCacheConfig c;
  std::string attention, dtype;
  std::int64_t page_size = 0, layers = 0, kv_heads = 0, head_dim = 0, kv_lora_rank = 0,
               qk_rope_head_dim = 0;
  double host_ratio = 0;
  std::int64_t host_bytes = 0, host_tokens = 0;
};

constexpr double kInf = std::numeric_limits<double>::infinity();

// The "sidecars" object: one SidecarSpec per pool, in the order of their names. Throws
// InvalidArgument naming the pool and the key (an unknown or missing key, a value of the wrong
// type, a field the spec refuses).
std::vector<SidecarSpec> parse_sidecars(const json& sidecars) {
  static constexpr std::array<std::string_view, 8> kKeys = {
      "policy", "slot_bytes", "device_pages", "host_pages",
      "layers", "slots_per_page", "window_pages", "dtype"};
  std::vector<SidecarSpec> out;
  for (const auto& item : sidecars.items()) {
    // Named references, not a structured binding: the lambdas below capture them.
    const std::string& name = item.key();
    const json& pool = item.value();
    const std::string where = str_cat("config: sidecars.", name);
    if (!pool.is_object()) {
      throw InvalidArgument(str_cat(where, " is ", pool.dump(), "; it must be a JSON object"));
    }
    for (const auto& [key, value] : pool.items()) {
      if (std::find(kKeys.begin(), kKeys.end(), key) == kKeys.end()) {
        throw InvalidArgument(str_cat(where, ": unknown key '", key,
                                      "' (known: policy, slot_bytes, device_pages, host_pages, "
                                      "layers, slots_per_page, window_pages, dtype)"));
      }
    }
    const auto integer = [&](const char* key, std::int64_t fallback, bool required) {
      if (!pool.contains(key)) {
        if (required) throw InvalidArgument(str_cat(where, ".", key, " is required"));
        return fallback;
      }
      const json& v = pool.at(key);
      if (!v.is_number_integer()) {
        throw InvalidArgument(str_cat(where, ".", key, " is ", v.dump(), "; it must be an integer"));
      }
      return v.get<std::int64_t>();
    };
    const auto text = [&](const char* key, const char* fallback, bool required) {
      if (!pool.contains(key)) {
        if (required) throw InvalidArgument(str_cat(where, ".", key, " is required"));
        return std::string(fallback);
      }
      const json& v = pool.at(key);
      if (!v.is_string()) {
        throw InvalidArgument(str_cat(where, ".", key, " is ", v.dump(), "; it must be a string"));
      }
      return v.get<std::string>();
    };
    const auto int32 = [&](const char* key, std::int64_t v) {
      if (v < std::numeric_limits<std::int32_t>::min() ||
          v > std::numeric_limits<std::int32_t>::max()) {
        throw InvalidArgument(str_cat(where, ".", key, " is ", v, "; it must fit 32 bits"));
      }
      return static_cast<std::int32_t>(v);
    };
    SidecarSpec spec;
    spec.name = name;
    try {
      spec.policy = parse_sidecar_hit_policy(text("policy", "", true));
      spec.dtype = parse_dtype(text("dtype", "bf16", false));
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(str_cat(where, ": ", e.what()));
    }
    spec.slot_bytes = integer("slot_bytes", 0, true);
    spec.device_pages = integer("device_pages", 0, true);
    spec.host_pages = integer("host_pages", 0, true);
    spec.layers = int32("layers", integer("layers", 1, false));
    spec.slots_per_page = int32("slots_per_page", integer("slots_per_page", 1, false));
    spec.window_pages = int32("window_pages", integer("window_pages", 1, false));
    try {
      spec.validate();
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(str_cat("config: sidecars: ", e.what()));
    }
    out.push_back(std::move(spec));
  }
  return out;
}
constexpr double kMaxInt32 = 2147483647.0;
constexpr double kMaxCount = 4611686018427387904.0;  // 2^62: counts of tokens or bytes

struct Key {
  ConfigKeyInfo info;
  double lo = -kInf, hi = kInf;  // numbers: the allowed range, inclusive
  bool lo_open = false;          // lo itself is not allowed
  void (*set)(Draft&, const json&);
};

std::int64_t as_int(const json& v) { return v.get<std::int64_t>(); }
std::int32_t as_int32(const json& v) { return static_cast<std::int32_t>(v.get<std::int64_t>()); }
std::chrono::milliseconds as_ms(const json& v) { return std::chrono::milliseconds(as_int(v)); }

bool is_device_name(std::string_view s) { return s == "auto" || s == "host" || s == "cuda"; }

// kv_events.media: "GPU,CPU_PINNED" -> the four flags.
void set_media(KvEventsConfig& c, std::string_view text) {
  c.gpu = c.cpu_pinned = c.disk = c.external = false;
  std::size_t at = 0;
  while (at <= text.size()) {
    const std::size_t comma = std::min(text.find(',', at), text.size());
    const std::string_view m = text.substr(at, comma - at);
    bool* flag = m == "GPU"          ? &c.gpu
                 : m == "CPU_PINNED" ? &c.cpu_pinned
                 : m == "DISK"       ? &c.disk
                 : m == "EXTERNAL"   ? &c.external
                                     : nullptr;
    if (flag == nullptr || *flag) throw InvalidArgument("not a medium, or one named twice");
    *flag = true;
    at = comma + 1;
  }
}

// The one table. Defaults are JSON text, applied through the same setters as a user's values.
const std::vector<Key>& keys() {
  using T = ConfigType;
  static const std::vector<Key> kKeys = {
      {{"device", "device", T::kString, R"("auto")", "auto | host | cuda",
        "device runtime: cuda, the host emulation, or cuda when a GPU answers", "", ""},
       -kInf, kInf, false,
       [](Draft& d, const json& v) {
         const auto s = v.get<std::string>();
         if (!is_device_name(s)) throw InvalidArgument("not a device");
         d.c.device = s;
       }},
      {{"page_size", "page-size", T::kInteger, "64", ">= 1",
        "tokens per page: the unit of every copy, L3 record and key", "--page-size",
        "SGLang's default is 1; its HiCache guide recommends 64, which makes each L3 record and "
        "each copy large enough to run at disk and copy-engine speed"},
       1, 1 << 20, false, [](Draft& d, const json& v) { d.page_size = as_int(v); }},
      {{"device_tokens", "device-tokens", T::kInteger, "", "a positive multiple of page_size",
        "device KV pool, tokens (required)", "", ""},
       1, kMaxCount, false, [](Draft& d, const json& v) { d.c.device_tokens = as_int(v); }},
      {{"model.attention", "attention", T::kString, R"("mha")", "mha | mla",
        "attention kind: per-layer K and V (mha), or one latent buffer per layer (mla)", "", ""},
       -kInf, kInf, false,
       [](Draft& d, const json& v) {
         const auto s = v.get<std::string>();
         if (s != "mha" && s != "mla") throw InvalidArgument("not an attention kind");
         d.attention = s;
       }},
      {{"model.layers", "layers", T::kInteger, "", ">= 1", "model layers (required)", "", ""},
       1, kMaxInt32, false, [](Draft& d, const json& v) { d.layers = as_int(v); }},
      {{"model.kv_heads", "kv-heads", T::kInteger, "", ">= 1",
        "KV heads of this rank (mha; required there)", "", ""},
       1, kMaxInt32, false, [](Draft& d, const json& v) { d.kv_heads = as_int(v); }},
      {{"model.head_dim", "head-dim", T::kInteger, "", ">= 1", "head dim (mha; required there)",
        "", ""},
       1, kMaxInt32, false, [](Draft& d, const json& v) { d.head_dim = as_int(v); }},
      {{"model.kv_lora_rank", "kv-lora-rank", T::kInteger, "", ">= 1",
        "latent width (mla; required there)", "", ""},
       1, kMaxInt32, false, [](Draft& d, const json& v) { d.kv_lora_rank = as_int(v); }},
      {{"model.qk_rope_head_dim", "qk-rope-head-dim", T::kInteger, "", ">= 1",
        "rope width (mla; required there)", "", ""},
       1, kMaxInt32, false, [](Draft& d, const json& v) { d.qk_rope_head_dim = as_int(v); }},
      {{"model.dtype", "dtype", T::kString, R"("fp16")", "fp16 | bf16 | fp8 | fp32",
        "KV dtype", "--kv-cache-dtype", ""},
       -kInf, kInf, false,
       [](Draft& d, const json& v) {
         d.dtype = std::string(to_string(parse_dtype(v.get<std::string>())));
       }},
      {{"host_ratio", "host-ratio", T::kNumber, "2.0", "> 0, the host pool >= the device pool",
        "host pool size as a multiple of the device pool (one of host_ratio, host_bytes, "
        "host_tokens)",
        "--hicache-ratio", ""},
       0, kInf, true, [](Draft& d, const json& v) { d.host_ratio = v.get<double>(); }},
      {{"host_bytes", "host-bytes", T::kInteger, "", "> 0",
        "host pool size in bytes, rounded down to whole pages (replaces host_ratio)",
        "--hicache-size (GB there)", ""},
       0, kMaxCount, true, [](Draft& d, const json& v) { d.host_bytes = as_int(v); }},
      {{"host_tokens", "host-tokens", T::kInteger, "", "a positive multiple of page_size",
        "host pool size in tokens (replaces host_ratio)", "", ""},
       0, kMaxCount, true, [](Draft& d, const json& v) { d.host_tokens = as_int(v); }},
      {{"host_layout", "host-layout", T::kString, R"("layer_first")",
        "layer_first | page_first | page_first_direct",
        "host pool layout (part of the L3 key namespace)", "--hicache-mem-layout", ""},
       -kInf, kInf, false,
       [](Draft& d, const json& v) { d.c.host_layout = parse_host_layout(v.get<std::string>()); }},
      {{"io_backend", "io-backend", T::kString, R"("auto")", "auto | direct | kernel",
        "host <-> device copies: copy-engine batches (direct), the gather/scatter kernel, or "
        "auto: chosen per op",
        "--hicache-io-backend",
        "SGLang's default is kernel. auto: on CUDA, runs under 32 KiB, 16 or more per copy "
        "call, take the kernel, then writes of 1 MiB and more, and everything else direct; "
        "page_first takes the kernel; the host backend takes direct. On an H200 writes of 8 "
        "MiB pages reached 0.71-0.74 of the copy engine's ceiling with direct and 0.90-0.95 "
        "with the kernel (0.89-0.94 on 8 blocks: kernel_max_blocks), loads 0.84-0.99 with "
        "direct and 0.68-0.89 with the kernel, 2 KiB ops ran faster direct, and runs of 8 KiB "
        "at 0.17-0.35 direct against 0.81-0.94 kernel from 16 pages up. direct leaves the SMs "
        "to the model; page_first with direct is refused on CUDA"},
       -kInf, kInf, false,
       [](Draft& d, const json& v) {
         d.c.controller.io_backend = parse_io_backend(v.get<std::string>());
       }},
      {{"write_policy", "write-policy", T::kString, R"("write_through")",
        "write_through | write_through_selective | write_back",
        "when device pages are written to the host: at insert, after write_through_threshold "
        "hits, or at eviction",
        "--hicache-write-policy", ""},
       -kInf, kInf, false,
       [](Draft& d, const json& v) {
         d.c.controller.write_policy = parse_write_policy(v.get<std::string>());
       }},
      {{"layer_slots", "layer-slots", T::kInteger, "3", ">= 1",
        "load batches in flight at once (LayerDoneCounter slots)", "", ""},
       1, 64, false, [](Draft& d, const json& v) { d.c.controller.layer_slots = as_int32(v); }},
      {{"queue_capacity", "queue-capacity", T::kInteger, "4096", ">= 1",
        "ops queued per queue (write, load, backup, prefetch) before a call pushes back", "", ""},
       1, 1 << 24, false,
       [](Draft& d, const json& v) {
         d.c.controller.queue_capacity = static_cast<std::size_t>(as_int(v));
         d.c.storage_controller.queue_capacity = d.c.controller.queue_capacity;
       }},
      {{"kernel_max_blocks", "kernel-max-blocks", T::kInteger, "0", ">= 0",
        "CUDA blocks of the kernel io path at most (0: no cap)", "", ""},
       0, kMaxInt32, false,
       [](Draft& d, const json& v) { d.c.controller.kernel_max_blocks = as_int32(v); }},
      {{"host_tier", "host-tier", T::kBool, "true", "true | false",
        "false: a device-only prefix cache (no host pool to speak of, no storage)", "", ""},
       -kInf, kInf, false, [](Draft& d, const json& v) { d.c.radix.host_tier = v.get<bool>(); }},
      {{"eviction_policy", "eviction-policy", T::kString, R"("lru")", "lru | lfu",
        "which unlocked node eviction takes first, on both tiers", "--radix-eviction-policy",
        ""},
       -kInf, kInf, false,
       [](Draft& d, const json& v) {
         d.c.radix.eviction_policy = parse_eviction_policy(v.get<std::string>());
       }},
      {{"write_through_threshold", "write-through-threshold", T::kInteger, "2", ">= 1",
        "hits before write_through_selective writes a node to the host", "", ""},
       1, kMaxInt32, false,
       [](Draft& d, const json& v) { d.c.radix.write_through_threshold = as_int32(v); }},
      {{"load_back_min_tokens", "load-back-min-tokens", T::kInteger, "0", ">= 0",
        "host hits shorter than this are recomputed instead of loaded (0: one page)", "", ""},
       0, kMaxCount, false, [](Draft& d, const json& v) { d.c.radix.load_back_min_tokens = as_int(v); }},
      {{"recompute_seconds_per_token", "recompute-seconds-per-token", T::kNumber, "", ">= 0",
        "cost-aware tiers: a host or L3 hit slower to move than to recompute is recomputed, a "
        "prefetch still loading when recomputing would have been done is cut; the engine's "
        "prefill cost per token, measured from its reports when absent, the prior of those "
        "reports when > 0, and 0 (explicitly): off",
        "", ""},
       0, kInf, false,
       [](Draft& d, const json& v) { d.c.radix.recompute_seconds_per_token = v.get<double>(); }},
      {{"demote_low_watermark", "demote-low-watermark", T::kNumber, "0", "[0, 1)",
        "demotion starts when less than this fraction of the device is free (0: off)", "", ""},
       0, 1, false,
       [](Draft& d, const json& v) { d.c.radix.demote_low_watermark = v.get<double>(); }},
      {{"demote_high_watermark", "demote-high-watermark", T::kNumber, "0",
        "[0, 1], above demote_low_watermark when that is on",
        "... and frees nodes until this fraction would be free", "", ""},
       0, 1, false,
       [](Draft& d, const json& v) { d.c.radix.demote_high_watermark = v.get<double>(); }},
      {{"storage_admission", "storage-admission", T::kString, R"("write_through")",
        "write_through | exclusive | reuse",
        "when host pages are written to L3: as soon as they reach the host (L3 holds a "
        "superset of the host), only as host eviction takes them, coldest first (L3 adds "
        "its capacity to the host's), or once later requests asked for them "
        "storage_admission_min_hits times (pages used once never reach L3)",
        "", ""},
       -kInf, kInf, false,
       [](Draft& d, const json& v) {
         d.c.radix.storage_admission = parse_storage_admission(v.get<std::string>());
       }},
      {{"storage_admission_min_hits", "storage-admission-min-hits", T::kInteger, "1", ">= 1",
        "storage_admission reuse: the matches by later requests before a node's pages go to L3 "
        "(refused with another admission)",
        "", ""},
       1, kMaxInt32, false,
       [](Draft& d, const json& v) { d.c.radix.storage_admission_min_hits = as_int32(v); }},
      {{"storage", "storage", T::kObject, "",
        R"({"backend": "file", "root": DIR, ...} | {"backend": "redis", ...})",
        "the L3 store (none: no L3); the backend's own keys are its reference",
        "--hicache-storage-backend", ""},
       -kInf, kInf, false, [](Draft& d, const json& v) { d.c.storage = v.dump(); }},
      {{"sidecars", "sidecars", T::kObject, "",
        R"({NAME: {"policy": "all_pages" | "trailing", "slot_bytes": B, "device_pages": D, )"
        R"("host_pages": H, "layers": 1, "slots_per_page": 1, "window_pages": 1, )"
        R"("dtype": "bf16"}, ...})",
        "a hybrid model's sidecar pools (state, sliding window, indexer) that move with the KV "
        "(docs/hybrid.md); none: KV only",
        "", ""},
       -kInf, kInf, false, [](Draft& d, const json& v) { d.c.sidecars = parse_sidecars(v); }},
      {{"model_name", "model-name", T::kString, R"("model")", "non-empty",
        "the model, in every page key's namespace", "", ""},
       -kInf, kInf, false,
       [](Draft& d, const json& v) { d.c.model_name = v.get<std::string>(); }},
      {{"model_fingerprint", "model-fingerprint", T::kString, R"("unversioned")", "non-empty",
        "the weights revision, in every page key's namespace: a new revision never reads old "
        "pages",
        "", ""},
       -kInf, kInf, false,
       [](Draft& d, const json& v) { d.c.model_fingerprint = v.get<std::string>(); }},
      {{"prefetch_policy", "prefetch-policy", T::kString, R"("best_effort")",
        "best_effort | wait_complete | timeout",
        "when the scheduler may end a prefetch: at once, when it completed, or after its "
        "timeout",
        "--hicache-storage-prefetch-policy", ""},
       -kInf, kInf, false,
       [](Draft& d, const json& v) {
         d.c.storage_controller.policy = parse_prefetch_policy(v.get<std::string>());
       }},
      {{"prefetch_threshold_tokens", "prefetch-threshold-tokens", T::kInteger, "256", ">= 0",
        "L3 hits shorter than this are not prefetched (less than a page: one page)",
        "prefetch_threshold (extra config)", ""},
       0, kMaxCount, false,
       [](Draft& d, const json& v) {
         d.c.storage_controller.prefetch_threshold_tokens = as_int(v);
       }},
      {{"prefetch_budget_tokens", "prefetch-budget-tokens", T::kInteger, "1099511627776",
        ">= page_size", "host tokens prefetches may hold at once (default: no limit)", "", ""},
       1, kMaxCount, false,
       [](Draft& d, const json& v) { d.c.storage_controller.prefetch_budget_tokens = as_int(v); }},
      {{"prefetch_timeout_base_ms", "prefetch-timeout-base-ms", T::kInteger, "100", ">= 0",
        "timeout policy: a prefetch may take base + per_page x pages, at most cap",
        "prefetch_timeout_base (extra config, s)",
        "SGLang's default is 1 s; hicache's scheduler admits other requests while one waits, "
        "and its L3 reads run at disk or network speed, so the budget is per page"},
       0, kMaxInt32, false,
       [](Draft& d, const json& v) { d.c.storage_controller.timeout_base = as_ms(v); }},
      {{"prefetch_timeout_per_page_ms", "prefetch-timeout-per-page-ms", T::kInteger, "2",
        ">= 0", "timeout policy: per page", "prefetch_timeout_per_ki_token (extra config, s)",
        "SGLang's default is 0.25 s per 1024 tokens (16 ms per 64-token page)"},
       0, kMaxInt32, false,
       [](Draft& d, const json& v) { d.c.storage_controller.timeout_per_page = as_ms(v); }},
      {{"prefetch_timeout_cap_ms", "prefetch-timeout-cap-ms", T::kInteger, "5000", ">= 0",
        "timeout policy: at most", "", ""},
       0, kMaxInt32, false,
       [](Draft& d, const json& v) { d.c.storage_controller.timeout_cap = as_ms(v); }},
      {{"storage_batch_pages", "storage-batch-pages", T::kInteger, "0", "[0, 1048576]",
        "pages per storage call (0: the store's preferred batch: 64 MiB for files, ~4 MiB for "
        "Redis; a prefetch's reads then paced below it to about 20 ms each)",
        "", ""},
       0, 1 << 20, false,
       [](Draft& d, const json& v) { d.c.storage_controller.io_batch_pages = as_int(v); }},
      {{"tp_rank", "tp-rank", T::kInteger, "0", "[0, tp_size)", "this rank", "", ""},
       0, kMaxInt32, false, [](Draft& d, const json& v) { d.c.tp.rank = as_int32(v); }},
      {{"tp_size", "tp-size", T::kInteger, "1", ">= 1", "tensor-parallel ranks", "--tp-size",
        ""},
       1, 65536, false, [](Draft& d, const json& v) { d.c.tp.size = as_int32(v); }},
      {{"tp_store_dir", "tp-store-dir", T::kString, R"("")", "a directory every rank reaches",
        "Gloo rendezvous of the ranks (tp_size > 1 without an engine's collectives)", "", ""},
       -kInf, kInf, false, [](Draft& d, const json& v) { d.c.tp.store_dir = v.get<std::string>(); }},
      {{"tp_hostname", "tp-hostname", T::kString, R"("127.0.0.1")", "an address of this host",
        "the address this rank listens on for Gloo", "", ""},
       -kInf, kInf, false, [](Draft& d, const json& v) { d.c.tp.hostname = v.get<std::string>(); }},
      {{"tp_timeout_ms", "tp-timeout-ms", T::kInteger, "30000", ">= 1",
        "an agreement call that waits longer fails (a dead or diverged rank)", "", ""},
       1, kMaxInt32, false, [](Draft& d, const json& v) { d.c.tp.timeout = as_ms(v); }},
      {{"metrics", "metrics", T::kBool, "true", "true | false",
        "register every component's metrics (false: none, and ops are not timed)", "", ""},
       -kInf, kInf, false, [](Draft& d, const json& v) { d.c.metrics = v.get<bool>(); }},
      {{"metrics_port", "metrics-port", T::kInteger, "-1", "-1 (off) | 0 (a free port) | 1-65535",
        "serve Prometheus metrics at http://metrics_bind:metrics_port/metrics (and "
        "/metrics.json)",
        "", ""},
       -1, 65535, false, [](Draft& d, const json& v) { d.c.metrics_port = as_int32(v); }},
      {{"metrics_bind", "metrics-bind", T::kString, R"("127.0.0.1")", "an IP address of this host",
        "the address the metrics server listens on (loopback: only this host scrapes)", "", ""},
       -kInf, kInf, false,
       [](Draft& d, const json& v) { d.c.metrics_bind = v.get<std::string>(); }},
      {{"kv_events.endpoint", "kv-events", T::kString, R"("")",
        "a ZeroMQ endpoint (tcp://*:5557 binds, tcp://HOST:PORT connects) | empty (off)",
        "publish KV events (what the cache holds per tier) for a KV-aware router",
        "--kv-events-config", ""},
       -kInf, kInf, false,
       [](Draft& d, const json& v) { d.c.kv_events.endpoint = v.get<std::string>(); }},
      {{"kv_events.replay_endpoint", "kv-events-replay", T::kString, R"("")",
        "a ZeroMQ endpoint to bind | empty (no replay)",
        "where a subscriber that missed batches asks for them again", "", ""},
       -kInf, kInf, false,
       [](Draft& d, const json& v) { d.c.kv_events.replay_endpoint = v.get<std::string>(); }},
      {{"kv_events.topic", "kv-events-topic", T::kString, R"("")", "any text",
        "the topic (first frame) of every event message", "", ""},
       -kInf, kInf, false,
       [](Draft& d, const json& v) { d.c.kv_events.topic = v.get<std::string>(); }},
      {{"kv_events.media", "kv-events-media", T::kString, R"("GPU,CPU_PINNED,DISK,EXTERNAL")",
        "a comma-separated subset of GPU, CPU_PINNED, DISK, EXTERNAL",
        "the tiers whose events are published (DISK: a file store, EXTERNAL: Redis)", "", ""},
       -kInf, kInf, false,
       [](Draft& d, const json& v) { set_media(d.c.kv_events, v.get<std::string>()); }},
      {{"kv_events.dialect", "kv-events-dialect", T::kString, R"("sglang")", "sglang | vllm",
        "vllm: the host is \"CPU\" and BlockStored carries lora_name, as vLLM's events", "", ""},
       -kInf, kInf, false,
       [](Draft& d, const json& v) {
         const auto s = v.get<std::string>();
         if (s != "sglang" && s != "vllm") throw InvalidArgument("not a dialect");
         d.c.kv_events.vllm_dialect = s == "vllm";
       }},
      {{"kv_events.encoding", "kv-events-encoding", T::kString, R"("array")", "array | map",
        "events as tagged arrays (every router decodes them) or as maps with a type key", "",
        ""},
       -kInf, kInf, false,
       [](Draft& d, const json& v) {
         const auto s = v.get<std::string>();
         if (s != "array" && s != "map") throw InvalidArgument("not an encoding");
         d.c.kv_events.map_encoding = s == "map";
       }},
      {{"kv_events.dp_rank", "kv-events-dp-rank", T::kInteger, "-1", "-1 (nil) | >= 0",
        "the data-parallel rank every batch names (its third field)", "", ""},
       -1, kMaxInt32, false,
       [](Draft& d, const json& v) {
         const std::int64_t r = as_int(v);
         d.c.kv_events.attn_dp_rank = r < 0 ? std::nullopt : std::optional<std::int64_t>(r);
       }},
      {{"kv_events.publish_rank", "kv-events-publish-rank", T::kInteger, "0", "[0, tp_size)",
        "the one TP rank that publishes (the ranks' trees agree)", "", ""},
       0, kMaxInt32, false,
       [](Draft& d, const json& v) { d.c.kv_events_publish_rank = as_int32(v); }},
      {{"kv_events.replay_batches", "kv-events-replay-batches", T::kInteger, "10000",
        "[1, 1048576]", "batches kept for replay", "", ""},
       1, 1 << 20, false,
       [](Draft& d, const json& v) { d.c.kv_events.replay_batches = as_int(v); }},
      {{"kv_events.queue_batches", "kv-events-queue-batches", T::kInteger, "10000",
        "[1, 1048576]", "batches waiting for the publisher's thread before one is dropped", "",
        ""},
       1, 1 << 20, false,
       [](Draft& d, const json& v) { d.c.kv_events.queue_batches = as_int(v); }},
      {{"tp_connect_timeout_ms", "tp-connect-timeout-ms", T::kInteger, "120000", ">= 1",
        "the rendezvous of every rank (ranks start seconds apart)", "", ""},
       1, kMaxInt32, false, [](Draft& d, const json& v) { d.c.tp.connect_timeout = as_ms(v); }},
  };
  return kKeys;
}

const std::vector<ConfigAliasInfo>& aliases() {
  static const std::vector<ConfigAliasInfo> kAliases = {
      {"hicache_ratio", "host_ratio"},
      {"hicache_size", "host_bytes = GB x 1e9 (0: unset, as in SGLang); replaces host_ratio"},
      {"hicache_write_policy", "write_policy"},
      {"hicache_io_backend", "io_backend"},
      {"hicache_mem_layout", "host_layout"},
      {"hicache_storage_prefetch_policy", "prefetch_policy"},
      {"hicache_storage_backend",
       "storage: \"file\" is the file store (root: the extra config's \"root\", else "
       "/tmp/hicache, SGLang's directory); \"hicache\" takes the store object from the extra "
       "config"},
      {"hicache_storage_backend_extra_config",
       "a JSON object or JSON text: prefetch_threshold -> prefetch_threshold_tokens, "
       "prefetch_timeout_base (s) -> prefetch_timeout_base_ms, prefetch_timeout_per_ki_token "
       "(s per 1024 tokens) -> prefetch_timeout_per_page_ms (rounded to ms); every other key "
       "goes into the store object"},
  };
  return kAliases;
}

const Key* find_key(std::string_view name) {
  for (const Key& k : keys()) {
    if (k.info.key == name) return &k;
  }
  return nullptr;
}

std::string_view type_words(ConfigType t) {
  switch (t) {
    case ConfigType::kInteger: return "an integer";
    case ConfigType::kNumber: return "a number";
    case ConfigType::kString: return "a string";
    case ConfigType::kBool: return "true or false";
    case ConfigType::kObject: return "a JSON object";
  }
  return "?";
}

bool has_type(const json& v, ConfigType t) {
  switch (t) {
    case ConfigType::kInteger: return v.is_number_integer();
    case ConfigType::kNumber: return v.is_number();
    case ConfigType::kString: return v.is_string();
    case ConfigType::kBool: return v.is_boolean();
    case ConfigType::kObject: return v.is_object();
  }
  return false;
}

std::string unknown_key_error(std::string_view name) {
  const std::string near = nearest_config_key(name);
  return str_cat("config: unknown key '", name, "'",
                 near.empty() ? std::string(" (the keys: docs/configuration.md)")
                              : str_cat("; did you mean '", near, "'?"));
}

void apply(Draft& d, const Key& k, const json& v) {
  if (!has_type(v, k.info.type)) {
    throw InvalidArgument(str_cat("config: key '", k.info.key, "' is ", v.dump(), "; it must be ",
                                  type_words(k.info.type)));
  }
  const auto bad = [&](std::string_view why) {
    return InvalidArgument(str_cat("config: key '", k.info.key, "' is ", v.dump(), "; allowed: ",
                                   k.info.allowed, why.empty() ? "" : " (", why,
                                   why.empty() ? "" : ")"));
  };
  if (v.is_number()) {
    const double x = v.get<double>();
    if (!std::isfinite(x) || x < k.lo || x > k.hi || (k.lo_open && x == k.lo)) throw bad("");
  }
  try {
    k.set(d, v);
  } catch (const InvalidArgument& e) {
    throw bad(e.what());
  } catch (const json::exception& e) {
    throw bad(e.what());
  }
}

// SGLang's names -> ours, in place. An alias and the key it stands for, both given, are refused.
void expand_aliases(json& root) {
  const auto take = [&](const char* alias, const char* key) {
    if (!root.contains(alias)) return;
    if (root.contains(key)) {
      throw InvalidArgument(str_cat("config: '", alias, "' (SGLang's name) and '", key,
                                    "' both given; give one"));
    }
    root[key] = root[alias];
    root.erase(alias);
  };
  take("hicache_ratio", "host_ratio");
  take("hicache_write_policy", "write_policy");
  take("hicache_io_backend", "io_backend");
  take("hicache_mem_layout", "host_layout");
  take("hicache_storage_prefetch_policy", "prefetch_policy");
  if (root.contains("hicache_size")) {
    const json gb = root["hicache_size"];
    root.erase("hicache_size");
    if (!gb.is_number() || !(gb.get<double>() >= 0) || !std::isfinite(gb.get<double>())) {
      throw InvalidArgument(str_cat("config: key 'hicache_size' is ", gb.dump(),
                                    "; allowed: GB >= 0 (0: unset)"));
    }
    if (gb.get<double>() > 0) {
      if (root.contains("host_bytes")) {
        throw InvalidArgument("config: 'hicache_size' (SGLang's name) and 'host_bytes' both given");
      }
      root["host_bytes"] = static_cast<std::int64_t>(gb.get<double>() * 1e9);
      root.erase("host_ratio");  // SGLang: the size overrides the ratio
    }
  }
  json extra = json::object();
  if (root.contains("hicache_storage_backend_extra_config")) {
    extra = root["hicache_storage_backend_extra_config"];
    root.erase("hicache_storage_backend_extra_config");
    if (extra.is_string()) extra = json_fields::parse_object(extra.get<std::string>(),
                                                             "config: hicache_storage_backend_extra_config");
    if (!extra.is_object()) {
      throw InvalidArgument(str_cat("config: key 'hicache_storage_backend_extra_config' is ",
                                    extra.dump(), "; it must be a JSON object or its text"));
    }
    if (!root.contains("hicache_storage_backend")) {
      throw InvalidArgument(
          "config: 'hicache_storage_backend_extra_config' needs 'hicache_storage_backend'");
    }
  }
  if (!root.contains("hicache_storage_backend")) return;
  const json backend = root["hicache_storage_backend"];
  root.erase("hicache_storage_backend");
  if (root.contains("storage")) {
    throw InvalidArgument("config: 'hicache_storage_backend' (SGLang's name) and 'storage' both given");
  }
  const auto move_seconds = [&](const char* from, const char* to, double scale) {
    if (!extra.contains(from)) return;
    if (!extra[from].is_number() || !(extra[from].get<double>() >= 0)) {
      throw InvalidArgument(str_cat("config: hicache_storage_backend_extra_config: '", from,
                                    "' is ", extra[from].dump(), "; allowed: seconds >= 0"));
    }
    if (root.contains(to)) {
      throw InvalidArgument(str_cat("config: '", from, "' (SGLang's extra config) and '", to,
                                    "' both given"));
    }
    root[to] = static_cast<std::int64_t>(std::llround(extra[from].get<double>() * scale));
    extra.erase(from);
  };
  if (extra.contains("prefetch_threshold")) {
    if (root.contains("prefetch_threshold_tokens")) {
      throw InvalidArgument(
          "config: 'prefetch_threshold' (SGLang's extra config) and 'prefetch_threshold_tokens' "
          "both given");
    }
    root["prefetch_threshold_tokens"] = extra["prefetch_threshold"];
    extra.erase("prefetch_threshold");
  }
  const double page = root.contains("page_size") && root["page_size"].is_number_integer()
                          ? root["page_size"].get<double>()
                          : 64.0;
  move_seconds("prefetch_timeout_base", "prefetch_timeout_base_ms", 1000.0);
  move_seconds("prefetch_timeout_per_ki_token", "prefetch_timeout_per_page_ms",
               1000.0 * page / 1024.0);
  // SGLang's own switches that are not the store's.
  for (const char* k : {"backend_name", "module_path", "class_name", "interface_v1",
                        "hicache_storage_pass_prefix_keys"}) {
    extra.erase(k);
  }
  const std::string name = backend.is_string() ? backend.get<std::string>() : backend.dump();
  if (name == "file") {
    json store = {{"backend", "file"}, {"root", "/tmp/hicache"}};
    for (const auto& [k, v] : extra.items()) store[k] = v;
    root["storage"] = store;
  } else if (name == "hicache") {
    root["storage"] = extra;
  } else {
    throw InvalidArgument(str_cat("config: key 'hicache_storage_backend' is '", name,
                                  "'; allowed: file | hicache (hicache: the store object in the "
                                  "extra config, e.g. {\"backend\": \"redis\", ...})"));
  }
}

std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diag = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

std::string default_text(const ConfigKeyInfo& k) {
  if (k.default_json.empty()) return "";
  const json v = json::parse(k.default_json);
  return v.is_string() ? v.get<std::string>() : v.dump();
}

}  // namespace

std::span<const ConfigKeyInfo> config_keys() {
  static const std::vector<ConfigKeyInfo> kInfos = [] {
    std::vector<ConfigKeyInfo> out;
    for (const Key& k : keys()) out.push_back(k.info);
    return out;
  }();
  return kInfos;
}

std::span<const ConfigAliasInfo> config_aliases() { return aliases(); }

const ConfigKeyInfo* find_config_flag(std::string_view flag) {
  for (const ConfigKeyInfo& k : config_keys()) {
    if (k.flag == flag) return &k;
  }
  return nullptr;
}

std::string config_flag_json(const ConfigKeyInfo& key, std::string_view text) {
  const std::string t(text);
  const auto bad = [&] {
    return InvalidArgument(str_cat("--", key.flag, ": '", text, "' is not ", type_words(key.type)));
  };
  switch (key.type) {
    case ConfigType::kInteger: {
      char* end = nullptr;
      errno = 0;
      const long long v = std::strtoll(t.c_str(), &end, 10);
      if (errno != 0 || end == t.c_str() || *end != '\0') throw bad();
      return json(static_cast<std::int64_t>(v)).dump();
    }
    case ConfigType::kNumber: {
      char* end = nullptr;
      const double v = std::strtod(t.c_str(), &end);
      if (end == t.c_str() || *end != '\0' || !std::isfinite(v)) throw bad();
      return json(v).dump();
    }
    case ConfigType::kBool:
      if (t == "true" || t == "1") return "true";
      if (t == "false" || t == "0") return "false";
      throw bad();
    case ConfigType::kString:
      return json(t).dump();
    case ConfigType::kObject: {
      const json v = json::parse(t, nullptr, false);
      if (v.is_discarded() || !v.is_object()) throw bad();
      return v.dump();
    }
  }
  throw bad();
}

std::string config_flags_usage() {
  std::string out;
  for (const ConfigKeyInfo& k : config_keys()) {
    std::string left = str_cat("  --", k.flag, k.type == ConfigType::kBool ? "" : " V");
    if (left.size() < 34) left += std::string(34 - left.size(), ' ');
    const std::string d = default_text(k);
    out += str_cat(left, " ", k.help, d.empty() ? "" : str_cat(" (", d, ")"), "\n");
  }
  return out;
}

std::string config_reference_markdown() {
  std::string out =
      "| key | flag | type | default | allowed | SGLang | what |\n"
      "| --- | --- | --- | --- | --- | --- | --- |\n";
  const auto cell = [](std::string_view s) {
    std::string r;
    for (char c : s) r += c == '|' ? std::string("\\|") : std::string(1, c);
    return r;
  };
  for (const ConfigKeyInfo& k : config_keys()) {
    const std::string d = default_text(k);
    out += str_cat("| `", k.key, "` | `--", k.flag, "` | ", type_words(k.type), " | ",
                   d.empty() ? std::string("-") : str_cat("`", d, "`"), " | ", cell(k.allowed),
                   " | ", k.sglang.empty() ? std::string("-") : str_cat("`", k.sglang, "`"),
                   " | ", cell(k.help), " |\n");
  }
  out += "\nWhere a default differs from SGLang's:\n\n";
  for (const ConfigKeyInfo& k : config_keys()) {
    if (!k.differs.empty()) out += str_cat("- `", k.key, "`: ", k.differs, ".\n");
  }
  out += "\nSGLang's names, accepted as aliases (an alias and its key both given are refused):\n\n"
         "| SGLang key | sets |\n| --- | --- |\n";
  for (const ConfigAliasInfo& a : config_aliases()) {
    out += str_cat("| `", a.alias, "` | ", cell(a.maps_to), " |\n");
  }
  return out;
}

std::string nearest_config_key(std::string_view unknown) {
  std::string best;
  std::size_t best_distance = std::max<std::size_t>(2, unknown.size() / 3) + 1;
  const auto consider = [&](std::string_view name) {
    const std::size_t dist = edit_distance(unknown, name);
    if (dist < best_distance) {
      best_distance = dist;
      best = name;
    }
  };
  for (const ConfigKeyInfo& k : config_keys()) consider(k.key);
  for (const ConfigAliasInfo& a : config_aliases()) consider(a.alias);
  return best;
}

HiCacheConfig HiCacheConfig::from_json_text(std::string_view text) {
  json root = json_fields::parse_object(text, "config");
  expand_aliases(root);
  Draft d;
  for (const Key& k : keys()) {
    if (!k.info.default_json.empty()) k.set(d, json::parse(k.info.default_json));
  }
  std::set<std::string> given;
  for (const auto& [name, value] : root.items()) {
    if (name == "model" || name == "kv_events") {
      if (!value.is_object()) {
        throw InvalidArgument(str_cat("config: key '", name, "' is ", value.dump(),
                                      "; it must be a JSON object"));
      }
      for (const auto& [inner, v] : value.items()) {
        const std::string full = str_cat(name, ".", inner);
        const Key* k = find_key(full);
        if (k == nullptr) throw InvalidArgument(unknown_key_error(full));
        apply(d, *k, v);
        given.insert(full);
      }
      continue;
    }
    const Key* k = find_key(name);
    if (k == nullptr || name.rfind("model.", 0) == 0 || name.rfind("kv_events.", 0) == 0) {
      throw InvalidArgument(unknown_key_error(name));
    }
    apply(d, *k, value);
    given.insert(name);
  }
  const auto require = [&](const char* key, const char* what) {
    if (given.count(key) == 0) {
      throw InvalidArgument(str_cat("config: key '", key, "' is required (", what, ")"));
    }
  };
  const auto refuse = [&](const char* key, std::string_view attention) {
    if (given.count(key) != 0) {
      throw InvalidArgument(str_cat("config: key '", key, "' does not apply to model.attention '",
                                    attention, "'"));
    }
  };
  require("model.layers", "the model's layer count");
  if (given.count("storage_admission_min_hits") != 0 &&
      d.c.radix.storage_admission != StorageAdmission::kReuse) {
    throw InvalidArgument(str_cat("config: key 'storage_admission_min_hits' applies to "
                                  "storage_admission 'reuse' only, not '",
                                  to_string(d.c.radix.storage_admission), "'"));
  }
  if (given.count("kv_events.endpoint") == 0 || d.c.kv_events.endpoint.empty()) {
    for (const std::string& key : given) {
      if (key.rfind("kv_events.", 0) == 0 && key != "kv_events.endpoint") {
        throw InvalidArgument(str_cat("config: key '", key,
                                      "' is set, but kv_events.endpoint is not: no KV events are "
                                      "published; give the endpoint or leave the key out"));
      }
    }
  }
  require("device_tokens", "the device KV pool's size in tokens");
  const DType dtype = parse_dtype(d.dtype);
  const auto page = static_cast<std::int32_t>(d.page_size);
  HiCacheConfig c = std::move(d.c);
  if (d.attention == "mha") {
    require("model.kv_heads", "an mha model's KV heads");
    require("model.head_dim", "an mha model's head dim");
    refuse("model.kv_lora_rank", "mha");
    refuse("model.qk_rope_head_dim", "mha");
    c.geometry = KVGeometry::mha(static_cast<std::int32_t>(d.layers),
                                 static_cast<std::int32_t>(d.kv_heads),
                                 static_cast<std::int32_t>(d.head_dim), dtype, page);
  } else {
    require("model.kv_lora_rank", "an mla model's latent width");
    require("model.qk_rope_head_dim", "an mla model's rope width");
    refuse("model.kv_heads", "mla");
    refuse("model.head_dim", "mla");
    c.geometry = KVGeometry::mla(static_cast<std::int32_t>(d.layers),
                                 static_cast<std::int32_t>(d.kv_lora_rank),
                                 static_cast<std::int32_t>(d.qk_rope_head_dim), dtype, page);
  }
  // The ratio is the default size; a size in bytes or tokens replaces it.
  const bool sized = given.count("host_bytes") != 0 || given.count("host_tokens") != 0;
  c.host_size = HostPoolSize{.ratio = sized && given.count("host_ratio") == 0 ? 0 : d.host_ratio,
                             .bytes = d.host_bytes,
                             .tokens = d.host_tokens};
  c.storage_controller.mla = c.geometry.attention == AttentionKind::kMLA;
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
  if (!is_device_name(device)) {
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

  for (const SidecarSpec& s : sidecars) {
    try {
      s.validate();
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(str_cat("config: sidecars: ", e.what()));
    }
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
  if (!metrics && metrics_port >= 0) {
    throw InvalidArgument(str_cat("config: metrics_port ", metrics_port,
                                  " serves metrics, but metrics is false"));
  }
  if (metrics_port < -1 || metrics_port > 65535) {
    throw InvalidArgument(str_cat("config: metrics_port ", metrics_port,
                                  " is outside [-1, 65535] (-1: off, 0: a free port)"));
  }
  if (kv_events_publish_rank < 0 || kv_events_publish_rank >= tp.size) {
    throw InvalidArgument(str_cat("config: kv_events.publish_rank ", kv_events_publish_rank,
                                  " is outside [0, tp_size ", tp.size, ")"));
  }
  if (model_name.empty() || model_fingerprint.empty()) {
    throw InvalidArgument(str_cat("config: model_name '", model_name, "' and model_fingerprint '",
                                  model_fingerprint, "' must not be empty"));
  }
}

}  // namespace hicache
