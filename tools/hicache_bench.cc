// hicache-bench: the synthetic workload tool, and the main job. It runs a simulated serving
// engine (SimulatedEngine: scheduler, prefill layer by layer overlapping the loads, decode) over
// HiRadixCache and every tier, fed by a synthetic workload (multiturn, longcontext, tree;
// tools/workload/workload.h), verifies every page read from any tier byte for byte, and reports
// SGLang bench_multiturn's metrics (TTFT, ITL, end-to-end latency, throughput, cache hit rate
// per round) plus per-tier hits, bytes and bandwidth, queue depths, revokes and errors.
//
// Settings come from flags and from a JSON file (--config; the keys are the flag names with '_'
// for '-'; flags given on the command line win). The cache's own settings are the library's
// schema (controller/config_schema.h, docs/configuration.md): the same keys, flags and defaults
// as every HiCache; the main job sets a few of them (main_job(): its MHA model keys only for an
// MHA model), --model NAME a preset's (tools/workload/model_presets.h), and the user's win.
// The L3 store is the one of the configuration's tier; a --storage object is that of the tier
// its backend names, and is refused when no configuration run uses it. The TP group's keys
// (--tp-rank, --tp-size, --tp-store-dir) are refused: --tp N sets them for each rank it starts.
// --compare runs the workload under several
// configurations (device only, + host, + host + file, + host + redis with --redis) and prints
// them side by side. --metrics-port P serves the cache's Prometheus metrics at
// http://127.0.0.1:P/metrics while the workload runs (instance i of --instances on P + i; 0: a
// free port, printed). --tp N runs each instance as N rank processes (fork), each with its own
// pools; an MHA rank holds its own slice of the KV (page data salted by rank, its own page keys),
// MLA ranks hold the same KV (one key namespace: rank 0 alone backs up, every rank prefetches).
// The ranks agree over Gloo groups that meet in a fresh temporary directory; the report adds
// the scheduler's collective calls per step, the time in them, and each rank's L3 figures.
// --instances N runs N engine processes (fork, before any thread exists), each with its own L1/L2,
// sharing one L3; round r of client c runs on instance (c + r) % N, so a conversation moves between
// instances and finds its earlier rounds only in L3. The rounds are then run with a barrier: every
// instance finishes round r and lands its backups in L3 before any starts round r+1. An instance
// that does not answer a round within
// --instance-timeout-s fails the run; the parent kills and reaps every instance.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "controller/config_schema.h"
#include "storage/redis_cluster.h"
#include "tools/workload/cache_flags.h"
#include "tools/workload/config_file.h"
#include "tools/workload/engine_stack.h"
#include "tools/workload/model_presets.h"
#include "tools/workload/report.h"
#include "tools/workload/runner.h"
#include "tools/workload/workload.h"
#include "transfer/errors.h"

namespace {

namespace fs = std::filesystem;
using hicache::InvalidArgument;
using hicache::IoError;
using hicache::str_cat;
using nlohmann::json;
namespace wl = hicache::workload;

struct Settings {
  // workload
  std::string workload = "multiturn";
  std::int64_t seed = 1, clients = 16, rounds = 6, request_tokens = 512, output_tokens = 32,
               system_prompt_tokens = 256, documents = 4, questions = 4, document_tokens = 8192,
               trees = 2, branching = 3, depth = 3, tenants = 1;
  std::string length_dist = "uniform";
  double request_rate = 0;
  std::int64_t max_inflight = 0, l3_detach_every = 0;
  bool barrier = false;
  // The cache's settings (HiCacheConfig's JSON keys): while parsing, the user's (flags and
  // --config); after parse(), resolve_cache's: the main job's, the preset's, then the user's.
  json cache = json::object();
  std::string model;  // a preset (model_presets()); empty: none
  // engine
  std::int64_t max_batch = 8, max_running = 64, max_prefetches = 4;
  double cost_per_token_layer = 3e-6, decode_step_seconds = 0.002, host_free_target = 0.1;
  // what-if: a slow L3 (ThrottledStorage around the store of the file and redis tiers)
  double l3_bandwidth_mbps = 0, l3_latency_ms = 0;
  // tiers
  std::string tiers = "file";
  bool compare = false;
  std::string compare_configs = "device,host,file";
  std::string storage_dir, redis;
  bool keep_storage = false;
  std::int64_t instances = 1;
  std::int64_t tp = 1;
  double instance_timeout_s = 600;
  // output
  std::string report, plot;
  bool progress = true;
  std::string kv_events_view;
};

// The main job's cache: a small synthetic model on the host emulation (every page verified by
// the CPU), and prefetches that wait for their pages (so L3 hits do not depend on timing).
// Everything else is the library's default. The model's MHA keys go only into an MHA model; an
// MLA model needs its own widths (--kv-lora-rank, --qk-rope-head-dim) or a preset (--model).
const wl::ToolDefaults& main_job() {
  static const wl::ToolDefaults kMainJob{
      .cache = {{"device", "host"}, {"device_tokens", 8192}, {"prefetch_policy", "wait_complete"}},
      .model_common = {{"layers", 16}},
      .model_mha = {{"kv_heads", 4}, {"head_dim", 64}},
      .model_mla = json::object()};
  return kMainJob;
}

using Kind = wl::ValueKind;

struct Option {
  const char* name;  // flag without "--", '-' separated; the JSON key has '_'
  const char* help;
  std::function<void(Settings&, const std::string&)> set;  // value as text
  bool is_switch = false;                                   // a flag without a value
  std::function<json(const Settings&)> get;
  Kind kind = Kind::kString;  // what a JSON config value must be
};

std::int64_t to_int(const std::string& name, const std::string& v, std::int64_t min) {
  char* end = nullptr;
  errno = 0;
  const long long x = std::strtoll(v.c_str(), &end, 10);
  if (errno != 0 || end == v.c_str() || *end != '\0' || x < min) {
    throw InvalidArgument(str_cat(name, ": '", v, "' is not an integer >= ", min));
  }
  return x;
}

double to_double(const std::string& name, const std::string& v, double min) {
  char* end = nullptr;
  const double x = std::strtod(v.c_str(), &end);
  if (end == v.c_str() || *end != '\0' || !(x >= min)) {
    throw InvalidArgument(str_cat(name, ": '", v, "' is not a number >= ", min));
  }
  return x;
}

bool to_bool(const std::string& name, const std::string& v) {
  if (v == "true" || v == "1") return true;
  if (v == "false" || v == "0") return false;
  throw InvalidArgument(str_cat(name, ": '", v, "' is not true or false"));
}

#define INT_OPT(field, min, help)                                                                \
  Option{#field, help,                                                                           \
         [](Settings& s, const std::string& v) { s.field = to_int(#field, v, min); }, false,     \
         [](const Settings& s) { return json(s.field); }, Kind::kInt}
#define DBL_OPT(field, min, help)                                                                \
  Option{#field, help,                                                                           \
         [](Settings& s, const std::string& v) { s.field = to_double(#field, v, min); }, false,  \
         [](const Settings& s) { return json(s.field); }, Kind::kDouble}
#define STR_OPT(field, help)                                                                     \
  Option{#field, help, [](Settings& s, const std::string& v) { s.field = v; }, false,            \
         [](const Settings& s) { return json(s.field); }, Kind::kString}
#define BOOL_OPT(field, help)                                                                    \
  Option{#field, help,                                                                           \
         [](Settings& s, const std::string& v) { s.field = to_bool(#field, v); }, true,          \
         [](const Settings& s) { return json(s.field); }, Kind::kBool}

const std::vector<Option>& options() {
  static const std::vector<Option> kOptions = {
      STR_OPT(workload, "multiturn | longcontext | tree (default multiturn)"),
      INT_OPT(seed, 0, "seed of the synthetic tokens and arrivals (1)"),
      INT_OPT(clients, 1, "multiturn: clients (16)"),
      INT_OPT(rounds, 1, "multiturn: rounds per client (6)"),
      INT_OPT(request_tokens, 1, "question length L (multiturn, longcontext), tree segment (512)"),
      STR_OPT(length_dist, "fixed | uniform (L/2..3L/2) | lognormal (median L) (uniform)"),
      INT_OPT(output_tokens, 0, "answer length O, decoded token by token (32)"),
      INT_OPT(system_prompt_tokens, 0, "multiturn: system prompt shared by all clients (256)"),
      INT_OPT(documents, 1, "longcontext: documents (4)"),
      INT_OPT(questions, 1, "longcontext: questions per document (4)"),
      INT_OPT(document_tokens, 1, "longcontext: document length (8192)"),
      INT_OPT(trees, 1, "tree: trees (2)"),
      INT_OPT(branching, 1, "tree: at most this many children per node (3)"),
      INT_OPT(depth, 1, "tree: depth (3)"),
      STR_OPT(model,
              "a model preset for the cache's model keys (below); the model flags and "
              "keys override it"),
      INT_OPT(tenants, 1,
              "cache identities sharing the prompts (multiturn: by client, "
              "longcontext: by question, tree: by tree); none hits another's pages (1)"),
      DBL_OPT(request_rate, 0, "Poisson arrivals, requests/s over all clients; 0: all at once (0)"),
      INT_OPT(max_inflight, 0, "requests in flight at most; 0: no cap (0)"),
      BOOL_OPT(barrier, "round r+1 starts once round r is done (always on with --instances)"),
      INT_OPT(max_batch, 1, "requests admitted per prefill pass (8)"),
      INT_OPT(max_running, 1, "requests prefilling or decoding at once (64)"),
      INT_OPT(max_prefetches, 1, "L3 prefetches in flight (4)"),
      DBL_OPT(cost_per_token_layer, 0, "simulated prefill compute, s per token per layer (3e-6)"),
      DBL_OPT(decode_step_seconds, 0, "simulated decode step, s (0.002)"),
      DBL_OPT(host_free_target, 0, "host fraction kept free by evicting before admission (0.1)"),
      DBL_OPT(l3_bandwidth_mbps, 0,
              "what-if: the L3 store's calls share a link of this many MB/s (file and redis "
              "tiers; the storage threads wait); 0: unthrottled (0)"),
      DBL_OPT(l3_latency_ms, 0, "what-if: each L3 store call takes at least this many ms (0)"),
      STR_OPT(tiers, "the configuration of a single run: device | host | file | redis (file)"),
      BOOL_OPT(compare, "run every configuration of --compare-configs side by side"),
      STR_OPT(compare_configs,
              "configurations for --compare (device,host,file; redis added "
              "when --redis is given)"),
      STR_OPT(storage_dir, "file store root (default: a new directory under /tmp, removed)"),
      BOOL_OPT(keep_storage, "keep the file store and a stable key namespace (warm restarts)"),
      STR_OPT(redis, "Redis for the redis tier: HOST:PORT, or HOST:PORT,HOST:PORT,... (cluster)"),
      INT_OPT(instances, 1, "engine processes sharing L3 (1)"),
      INT_OPT(tp, 1,
              "tensor-parallel ranks per instance, each a process with its own slice of "
              "the KV and its own pools, agreeing over Gloo (1)"),
      INT_OPT(l3_detach_every, 0,
              "detach L3 every N engine steps and attach it again N steps "
              "later (the store reopened from the config); 0: never (0)"),
      DBL_OPT(instance_timeout_s, 0,
              "--instances: an instance that does not finish a round "
              "within this many seconds fails the run; 0: no limit (600)"),
      STR_OPT(report, "write the JSON report here"),
      STR_OPT(plot, "write an SVG plot here (TTFT per round, hit rate per tier)"),
      BOOL_OPT(progress, "progress on stderr (true; --no-progress turns it off)"),
      STR_OPT(kv_events_view,
              "with --kv-events, one configuration and one process: write here, at the end, "
              "the block hashes the cache holds per tier (JSON), to check a subscriber's view"),
  };
  return kOptions;
}

std::string flag_name(const char* name) {
  std::string f = name;
  for (char& c : f) c = c == '_' ? '-' : c;
  return f;
}

std::string usage() {
  std::string u = "usage: hicache-bench [--config FILE.json] [options]\n";
  for (const Option& o : options()) {
    std::string left = "  --" + flag_name(o.name) + (o.is_switch ? "" : " V");
    if (left.size() < 32) left += std::string(32 - left.size(), ' ');
    u += left + " " + o.help + "\n";
  }
  u += "Model presets (--model NAME, or \"model\": \"NAME\" in --config):\n";
  u += wl::model_presets_usage();
  u += str_cat(
      "Cache settings (the library's; docs/configuration.md has each key's allowed values;\n"
      "the main job sets ",
      wl::describe(main_job()),
      ",\n"
      "model.mha only for an mha model, then a preset's keys, then yours;\n"
      "the key namespace is model_name hicache-bench and a model_fingerprint fresh per run,\n"
      "or 'synthetic' with --keep-storage, unless given):\n");
  u += hicache::config_flags_usage();
  u += "  --config-reference              print the configuration reference (Markdown) and exit\n"
       "  --help\n"
       "JSON config: {\"workload\": \"tree\", \"depth\": 4, \"write_policy\": \"write_back\", ...}: the\n"
       "same names with '_' (cache keys as in HiCacheConfig's JSON, SGLang's names included).\n"
       "Exit code: 0 all pages verified, 1 a wrong page or a failed instance, 2 bad settings.\n";
  return u;
}

[[noreturn]] void usage_error(const std::string& message) {
  std::fprintf(stderr, "hicache-bench: %s\n%s", message.c_str(), usage().c_str());
  std::exit(2);
}

const Option* find_option(std::string_view key) {
  for (const Option& o : options()) {
    if (key == o.name || key == flag_name(o.name)) return &o;
  }
  return nullptr;
}

void set_cache_key(Settings& s, std::string_view key, const json& value) {
  hicache::workload::set_cache_key(s.cache, key, value);
}

// --config FILE: the options above by name, the cache's keys into s.cache.
void apply_json_file(Settings& s, const std::string& path) {
  wl::apply_config_file(path, s.cache, s.model, [&s](std::string_view key) -> std::optional<wl::ToolKey> {
    const Option* o = find_option(key);
    if (o == nullptr) return std::nullopt;
    return wl::ToolKey{o->kind, [&s, o](const std::string& text) { o->set(s, text); }};
  });
}

Settings parse(int argc, char** argv) {
  Settings s;
  try {
    // The files first: flags override them.
    for (const std::string& path : wl::config_file_arguments(argc, argv)) apply_json_file(s, path);
    for (int i = 1; i < argc; ++i) {
      std::string_view flag = argv[i];
      if (flag == "--help" || flag == "-h") {
        std::fputs(usage().c_str(), stdout);
        std::exit(0);
      }
      if (flag == "--config") {
        ++i;
        continue;
      }
      if (flag == "--config-reference") {
        std::fputs(hicache::config_reference_markdown().c_str(), stdout);
        std::exit(0);
      }
      if (flag.substr(0, 2) != "--") throw InvalidArgument(str_cat("unexpected argument '", flag, "'"));
      flag.remove_prefix(2);
      bool negated = false;
      if (flag.substr(0, 3) == "no-") {
        const Option* o = find_option(flag.substr(3));
        if (o != nullptr && o->is_switch) {
          o->set(s, "false");
          negated = true;
        }
      }
      if (negated) continue;
      if (flag.find('_') == std::string_view::npos && find_option(flag) == nullptr) {
        const auto* k = hicache::find_config_flag(flag);
        const bool negated_bool = k == nullptr && flag.substr(0, 3) == "no-" &&
                                  hicache::find_config_flag(flag.substr(3)) != nullptr &&
                                  hicache::find_config_flag(flag.substr(3))->type ==
                                      hicache::ConfigType::kBool;
        if (negated_bool) {
          set_cache_key(s, hicache::find_config_flag(flag.substr(3))->key, false);
          continue;
        }
        if (k != nullptr && k->type == hicache::ConfigType::kBool) {
          set_cache_key(s, k->key, true);
          continue;
        }
        if (k != nullptr) {
          if (i + 1 >= argc) throw InvalidArgument(str_cat("--", flag, ": missing value"));
          set_cache_key(s, k->key, json::parse(hicache::config_flag_json(*k, argv[++i])));
          continue;
        }
      }
      const Option* o = find_option(flag);
      if (o == nullptr || flag.find('_') != std::string_view::npos) {
        std::string key(flag);
        for (char& c : key) c = c == '-' ? '_' : c;
        const std::string near = hicache::nearest_config_key(key);
        throw InvalidArgument(str_cat("unknown flag '--", flag, "'",
                                      near.empty() ? "" : str_cat(" (the key '", near, "'?)")));
      }
      if (o->is_switch) {
        o->set(s, "true");
      } else {
        if (i + 1 >= argc) throw InvalidArgument(str_cat("--", flag, ": missing value"));
        o->set(s, argv[++i]);
      }
    }
    wl::refuse_tool_owned_tp_keys(s.cache, s.tp);
    if (!s.kv_events_view.empty() &&
        (s.compare || s.instances > 1 || s.tp > 1 || !s.cache.contains("kv_events") ||
         !s.cache["kv_events"].contains("endpoint"))) {
      throw InvalidArgument(str_cat("--kv-events-view '", s.kv_events_view,
                                    "' needs --kv-events, one configuration (no --compare) and "
                                    "one process (no --instances, no --tp)"));
    }
    if ((s.l3_bandwidth_mbps > 0 || s.l3_latency_ms > 0) && !s.compare && s.tiers != "file" &&
        s.tiers != "redis") {
      throw InvalidArgument(str_cat("--l3-bandwidth-mbps / --l3-latency-ms slow the L3 store, "
                                    "but --tiers ", s.tiers, " has none (file, redis, or --compare)"));
    }
    for (const char* alias : {"hicache_storage_backend", "hicache_storage_backend_extra_config"}) {
      if (s.cache.contains(alias)) {
        throw InvalidArgument(
            str_cat("key '", alias,
                    "' (SGLang's) is not taken: the L3 store is the one of --tiers "
                    "(file, redis); give that store's own keys as 'storage', e.g. {\"backend\": "
                    "\"file\", \"capacity_bytes\": 1000000000}"));
      }
    }
    s.cache = wl::resolve_cache(main_job(), s.model, s.cache);
  } catch (const InvalidArgument& e) {
    usage_error(e.what());
  }
  return s;
}

json settings_json(const Settings& s) {
  json j = json::object();
  for (const Option& o : options()) j[o.name] = o.get(s);
  j["cache"] = s.cache;
  return j;
}

wl::WorkloadConfig workload_config(const Settings& s) {
  wl::WorkloadConfig w;
  w.kind = wl::parse_kind(s.workload);
  w.seed = static_cast<std::uint64_t>(s.seed);
  w.clients = static_cast<int>(s.clients);
  w.rounds = static_cast<int>(s.rounds);
  w.request_tokens = s.request_tokens;
  w.length_dist = wl::parse_length_dist(s.length_dist);
  w.output_tokens = s.output_tokens;
  w.system_prompt_tokens = s.system_prompt_tokens;
  w.documents = static_cast<int>(s.documents);
  w.questions = static_cast<int>(s.questions);
  w.document_tokens = s.document_tokens;
  w.trees = static_cast<int>(s.trees);
  w.branching = static_cast<int>(s.branching);
  w.depth = static_cast<int>(s.depth);
  w.tenants = static_cast<int>(s.tenants);
  w.validate();
  return w;
}

// The storage object of make_storage for a --redis value.
json redis_json(const std::string& spec) {
  std::vector<std::string> nodes;
  std::stringstream in(spec);
  for (std::string part; std::getline(in, part, ',');) {
    if (!hicache::redis::parse_host_port(part)) {
      throw InvalidArgument(str_cat("--redis: '", part, "' is not HOST:PORT"));
    }
    nodes.push_back(part);
  }
  if (nodes.empty()) throw InvalidArgument("--redis: empty");
  if (nodes.size() == 1) {
    const auto hp = *hicache::redis::parse_host_port(nodes[0]);
    return {{"backend", "redis"}, {"host", hp.host}, {"port", hp.port}};
  }
  return {{"backend", "redis"}, {"cluster", true}, {"nodes", nodes}};
}

// The user's L3 store object (--storage, or "storage" in --config), or null. It is the store of
// the tier its backend names (file or redis), with what the tool decides filled in where it is
// missing (file: root, shared; redis: the nodes of --redis); the other tiers have no L3.
const json* user_store(const Settings& s) {
  const auto it = s.cache.find("storage");
  return it == s.cache.end() ? nullptr : &*it;
}

std::string user_store_backend(const Settings& s) {
  const json* store = user_store(s);
  if (store == nullptr || !store->is_object() || !store->contains("backend")) return "";
  const json& b = (*store)["backend"];
  return b.is_string() ? b.get<std::string>() : b.dump();
}

// The configurations of the run, in order: --tiers, or --compare-configs (plus redis when
// --redis or a redis store object is given).
std::vector<std::string> configurations(const Settings& s) {
  std::vector<std::string> tiers;
  if (!s.compare) return {s.tiers};
  std::stringstream in(s.compare_configs);
  for (std::string t; std::getline(in, t, ',');) tiers.push_back(t);
  const bool redis = !s.redis.empty() || user_store_backend(s) == "redis";
  if (redis && std::find(tiers.begin(), tiers.end(), "redis") == tiers.end()) {
    tiers.push_back("redis");
  }
  return tiers;
}

// Refuses (InvalidArgument) a user's store that no configuration of `tiers` uses, or that names
// what a flag names too.
void check_user_store(const Settings& s, const std::vector<std::string>& tiers) {
  const json* store = user_store(s);
  if (store == nullptr) return;
  if (!store->is_object()) {
    throw InvalidArgument(str_cat("storage: ", store->dump(), " is not a JSON object"));
  }
  const std::string backend = user_store_backend(s);
  if (backend != "file" && backend != "redis") {
    throw InvalidArgument(str_cat("storage: backend '", backend,
                                  "': hicache-bench's L3 tiers are "
                                  "file and redis (the store of the --tiers of that name)"));
  }
  if (std::find(tiers.begin(), tiers.end(), backend) == tiers.end()) {
    std::string run;
    for (const auto& t : tiers) run += str_cat(run.empty() ? "" : ", ", t);
    throw InvalidArgument(str_cat("storage (backend '", backend, "') is the store of the ", backend,
                                  " tier, and no configuration run uses it (", run,
                                  "); give --tiers ", backend, " or leave --storage out"));
  }
  if (backend == "file" && store->contains("root") && !s.storage_dir.empty()) {
    throw InvalidArgument(
        "storage.root and --storage-dir both name the file store's root; "
        "give one");
  }
  const bool names_redis = store->contains("host") || store->contains("port") ||
                           store->contains("nodes") || store->contains("cluster");
  if (backend == "redis" && names_redis && !s.redis.empty()) {
    throw InvalidArgument(
        "storage's host/port/nodes/cluster and --redis both name the Redis; "
        "give one");
  }
}

// The file tier's root: the user's store's, else --storage-dir; empty: a fresh temporary one.
std::string file_root(const Settings& s) {
  if (user_store_backend(s) == "file" && (*user_store(s)).contains("root")) {
    const json& root = (*user_store(s))["root"];
    if (!root.is_string())
      throw InvalidArgument(str_cat("storage.root: ", root.dump(), " is not a path"));
    return root.get<std::string>();
  }
  return s.storage_dir;
}

// The stack of one configuration; `storage_root` for the file tier. The cache is the library's
// HiCacheConfig from the cache settings plus what the tier decides (the store, the host tier).
wl::StackConfig stack_config(const Settings& s, const std::string& tier,
                             const std::string& storage_root, const std::string& fingerprint) {
  wl::StackConfig c;
  json h = s.cache;
  h.erase("storage");  // the tier's (below)
  if (!h.contains("model_name")) h["model_name"] = "hicache-bench";
  if (!h.contains("model_fingerprint")) h["model_fingerprint"] = fingerprint;
  const json* mine = user_store_backend(s) == tier ? user_store(s) : nullptr;
  if (tier == "file") {
    json store = mine != nullptr ? *mine : json{{"backend", "file"}};
    store["root"] = storage_root;
    // Several processes on the root: shared. One: the store detects whether it is alone (an
    // explicit false would take the root to itself and refuse a second bench on it).
    if (!store.contains("shared") && s.instances * s.tp > 1) store["shared"] = true;
    h["storage"] = store;
  } else if (tier == "redis") {
    if (s.redis.empty() && mine == nullptr) {
      throw InvalidArgument(
          "tier redis: --redis HOST:PORT (or a redis 'storage' object) is required");
    }
    json store = mine != nullptr ? *mine : json::object();
    if (!s.redis.empty()) {
      const json nodes = redis_json(s.redis);
      for (const auto& [k, v] : nodes.items()) store[k] = v;
    }
    h["storage"] = store;
  } else if (tier != "device" && tier != "host") {
    throw InvalidArgument(str_cat("unknown tier '", tier, "': valid are device, host, file, redis"));
  }
  if (tier == "device") h["host_tier"] = false;
  c.cache = hicache::HiCacheConfig::from_json_text(h.dump());
  c.engine.max_batch = static_cast<int>(s.max_batch);
  c.engine.max_running = static_cast<int>(s.max_running);
  c.engine.max_prefetches = static_cast<int>(s.max_prefetches);
  c.engine.cost_per_token_layer = s.cost_per_token_layer;
  c.engine.decode_step_seconds = s.decode_step_seconds;
  c.engine.host_free_target = s.host_free_target;
  c.engine.use_storage = tier == "file" || tier == "redis";
  if (c.engine.use_storage) {
    c.l3_throttle = {.bytes_per_second = s.l3_bandwidth_mbps * 1e6,
                     .latency_s = s.l3_latency_ms * 1e-3};
  }
  return c;
}

wl::RunOptions run_options(const Settings& s, const std::string& label, int instances) {
  return wl::RunOptions{.request_rate = s.request_rate / instances,
                        .max_inflight = static_cast<int>(s.max_inflight),
                        .barrier = s.barrier || instances > 1,
                        .seed = static_cast<std::uint64_t>(s.seed),
                        .label = label,
                        .progress = s.progress,
                        .l3_detach_every = s.l3_detach_every};
}

// One process: the stack, the run, then every write and backup landed (kept stores hold it all).
void announce_metrics(wl::EngineStack& stack, const std::string& label) {
  if (const int port = stack.hicache().metrics_port(); port >= 0) {
    std::printf("[hicache-bench] %s: metrics at http://%s:%d/metrics\n", label.c_str(),
                stack.hicache().config().metrics_bind.c_str(), port);
    std::fflush(stdout);
  }
}

// --kv-events-view: what the cache holds per tier at the end, as a subscriber should have it.
void write_kv_events_view(wl::EngineStack& stack, const std::string& path) {
  hicache::HiCache& hc = stack.hicache();
  if (hc.kv_events() != nullptr) hc.kv_events()->flush();  // every batch of the run is out
  json view = {{"GPU", hc.cache().held_block_hashes(true)},
               {"CPU_PINNED", hc.cache().held_block_hashes(false)},
               {"key_prefix", hc.key_namespace().prefix()},
               {"published_batches", hc.kv_events() ? hc.kv_events()->published_batches() : 0},
               {"dropped_batches", hc.kv_events() ? hc.kv_events()->dropped_batches() : 0}};
  std::ofstream out(path);
  out << view.dump() << "\n";
  if (!out) throw std::runtime_error(str_cat("--kv-events-view: cannot write '", path, "'"));
}

void announce_kv_events(wl::EngineStack& stack, const std::string& label) {
  if (hicache::KvEventPublisher* p = stack.hicache().kv_events()) {
    std::printf("[hicache-bench] %s: KV events to %s%s%s\n", label.c_str(), p->endpoint().c_str(),
                p->replay_endpoint().empty() ? "" : ", replay at ",
                p->replay_endpoint().c_str());
    std::fflush(stdout);
  }
}

wl::InstanceResult run_single(const Settings& s, const wl::StackConfig& config,
                              const std::vector<wl::PlannedRequest>& plan, const std::string& label) {
  wl::EngineStack stack(config);
  announce_metrics(stack, label);
  announce_kv_events(stack, label);
  std::vector<int> all(plan.size());
  for (std::size_t i = 0; i < plan.size(); ++i) all[i] = static_cast<int>(i);
  wl::Runner runner(stack, plan, all, run_options(s, label, 1));
  runner.run_all();
  wl::InstanceResult r = runner.result();
  runner.flush();
  const double duration = r.duration_s;
  r = runner.result();  // counters after the flush (backups included), the run's duration
  r.duration_s = duration;
  if (!s.kv_events_view.empty()) write_kv_events_view(stack, s.kv_events_view);
  return r;
}

// Line I/O over pipes between the parent and an instance.
enum class Read { kLine, kClosed, kTimedOut };

// Reads one line; with a deadline (wl::now_seconds(), 0: none) gives up once it passes.
Read read_line(int fd, std::string& line, double deadline = 0) {
  line.clear();
  char c;
  while (true) {
    if (deadline > 0) {
      const double left = deadline - wl::now_seconds();
      pollfd p{.fd = fd, .events = POLLIN, .revents = 0};
      const int ready = left > 0 ? ::poll(&p, 1, static_cast<int>(left * 1000) + 1) : 0;
      if (ready < 0 && errno == EINTR) continue;
      if (ready == 0) return Read::kTimedOut;
    }
    const ssize_t n = ::read(fd, &c, 1);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return Read::kClosed;
    if (c == '\n') return Read::kLine;
    line += c;
  }
}

bool write_all(int fd, const std::string& text) {
  std::size_t off = 0;
  while (off < text.size()) {
    const ssize_t n = ::write(fd, text.data() + off, text.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    off += static_cast<std::size_t>(n);
  }
  return true;
}

// An instance process: builds its stack, then runs rounds a..b on "R <a> <b>" (and lands its
// writes and backups in L3 before answering "D"), and on "E" answers with its result as one JSON
// line.
[[noreturn]] void instance_main(const Settings& s, const wl::StackConfig& config,
                                const std::vector<wl::PlannedRequest>& plan, int instance,
                                int instances, int in_fd, int out_fd, const std::string& label) {
  int code = 0;
  try {
    // Each instance serves its own /metrics: instance i on metrics_port + i.
    wl::StackConfig own = config;
    const int rank = own.cache.tp.rank, tp = own.cache.tp.size;
    if (own.cache.metrics_port > 0) own.cache.metrics_port += instance * tp + rank;
    const std::string name = tp > 1 ? str_cat(label, " #", instance, " rank ", rank)
                                    : str_cat(label, " #", instance);
    wl::EngineStack stack(own);
    announce_metrics(stack, name);
    std::vector<int> mine;
    for (std::size_t i = 0; i < plan.size(); ++i) {
      if ((plan[i].client + plan[i].round) % instances == instance) mine.push_back(static_cast<int>(i));
    }
    wl::RunOptions options = run_options(s, name, instances);
    options.progress = options.progress && rank == 0;  // the ranks serve the same requests
    wl::Runner runner(stack, plan, mine, options, instance);
    double busy = 0;
    for (std::string line; read_line(in_fd, line) == Read::kLine;) {
      if (line.rfind("R ", 0) == 0) {
        int first = 0, last = 0;
        if (std::sscanf(line.c_str(), "R %d %d", &first, &last) != 2) {
          throw std::runtime_error(str_cat("bad command from the parent: '", line, "'"));
        }
        const double t0 = wl::now_seconds();
        runner.run_rounds(first, last);
        busy += wl::now_seconds() - t0;
        runner.flush();
        if (!write_all(out_fd, "D\n")) break;
      } else if (line == "E") {
        wl::InstanceResult r = runner.result();
        r.duration_s = busy;  // time spent running rounds, not waiting at the barrier
        write_all(out_fd, wl::to_json(r).dump() + "\n");
        break;
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hicache-bench: instance %d rank %d: %s\n", instance,
                 config.cache.tp.rank, e.what());
    code = 1;
  }
  std::fflush(stdout);
  std::fflush(stderr);
  std::_Exit(code);
}

// N instance processes for one configuration, each `tp` rank processes (instance i's rank r is
// child i * tp + r); the parent holds no threads when it forks. Returns one result per
// instance: its rank 0's, with the pages every rank verified added up; `barriered` says whether
// the rounds ran one at a time.
std::vector<wl::InstanceResult> run_instances(const Settings& s, const wl::StackConfig& config,
                                              const std::vector<wl::PlannedRequest>& plan,
                                              const std::string& label, int n, int tp,
                                              bool* barriered) {
  struct Child {
    pid_t pid = -1;
    int to = -1, from = -1;
  };
  // TP: each instance's Gloo groups meet in a directory of their own, fresh for this run.
  std::string rendezvous;
  if (tp > 1) {
    char tmpl[] = "/tmp/hicache-bench-tp-XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) throw std::runtime_error(str_cat("mkdtemp: ", std::strerror(errno)));
    rendezvous = tmpl;
  }
  struct RemoveDir {
    const std::string& dir;
    ~RemoveDir() {
      std::error_code ec;
      if (!dir.empty()) fs::remove_all(dir, ec);
    }
  } remove_rendezvous{rendezvous};
  std::vector<Child> children;
  for (int child = 0; child < n * tp; ++child) {
    const int i = child / tp;
    wl::StackConfig own = config;
    if (tp > 1) {
      own.cache.tp.rank = child % tp;
      own.cache.tp.size = tp;
      own.cache.tp.store_dir = str_cat(rendezvous, "/instance-", i);
      // MHA: each rank holds its own heads (salted data, its own keys); MLA: every rank the same.
      if (own.cache.geometry.attention == hicache::AttentionKind::kMHA) {
        own.engine.data_salt = static_cast<std::uint64_t>(own.cache.tp.rank);
      }
    }
    int down[2], up[2];
    if (::pipe2(down, O_CLOEXEC) != 0 || ::pipe2(up, O_CLOEXEC) != 0) {
      throw std::runtime_error(str_cat("pipe: ", std::strerror(errno)));
    }
    std::fflush(stdout);
    std::fflush(stderr);
    const pid_t pid = ::fork();
    if (pid < 0) throw std::runtime_error(str_cat("fork: ", std::strerror(errno)));
    if (pid == 0) {
      for (const Child& c : children) {
        ::close(c.to);
        ::close(c.from);
      }
      ::close(down[1]);
      ::close(up[0]);
      instance_main(s, own, plan, i, n, down[0], up[1], label);
    }
    ::close(down[0]);
    ::close(up[1]);
    children.push_back({pid, down[1], up[0]});
  }
  int last_round = 0;
  for (const auto& p : plan) last_round = std::max(last_round, p.round);
  bool failed = false;
  std::string line;
  // The run's wall time: from round 0's start to the last instance's last round (barriers and
  // the flushes that hand rounds over through L3 included), as a client population sees it.
  // A hung instance (a deadlock, a stopped process) must not hang the parent: past the deadline
  // the run fails and every instance is killed below.
  auto deadline = [&] {
    return s.instance_timeout_s > 0 ? wl::now_seconds() + s.instance_timeout_s : 0.0;
  };
  auto answered = [&](std::size_t i, const std::string& what, double by, const char* expect) {
    const Read got = read_line(children[i].from, line, by);
    if (got == Read::kLine && (expect == nullptr || line == expect)) return true;
    const std::string why = got == Read::kTimedOut
                                ? str_cat("gave no answer within ", s.instance_timeout_s, " s to")
                            : got == Read::kClosed ? std::string("ended (see its error above) during")
                                                   : str_cat("answered '", line, "' to");
    const std::string who =
        tp > 1 ? str_cat(i / static_cast<std::size_t>(tp), " rank ", i % static_cast<std::size_t>(tp))
               : std::to_string(i);
    std::fprintf(stderr, "hicache-bench: %s: instance %s %s %s\n", label.c_str(), who.c_str(),
                 why.c_str(), what.c_str());
    return false;
  };
  // With a barrier the instances run round by round; without one (a single instance of TP
  // ranks and no --barrier) all rounds at once, each client's next round sent as soon as its
  // last one finished, as in one process: the same workload at every TP size.
  const bool barrier = run_options(s, label, n).barrier;
  *barriered = barrier;
  const double t0 = wl::now_seconds();
  for (int first = 0; first <= last_round && !failed;) {
    const int last = barrier ? first : last_round;
    for (const Child& c : children) {
      failed |= !write_all(c.to, str_cat("R ", first, " ", last, "\n"));
    }
    const double by = deadline();
    const std::string what =
        last == first ? str_cat("round ", first) : str_cat("rounds ", first, "-", last);
    for (std::size_t i = 0; i < children.size() && !failed; ++i) {
      failed |= !answered(i, what, by, "D");
    }
    first = last + 1;
  }
  const double wall = wl::now_seconds() - t0;
  std::vector<wl::InstanceResult> results;
  const double by = deadline();
  for (std::size_t i = 0; i < children.size(); ++i) {
    const Child& c = children[i];
    if (!failed && write_all(c.to, "E\n") && answered(i, "the request for its result", by,
                                                      nullptr)) {
      try {
        results.push_back(wl::instance_result_from_json(json::parse(line)));
        results.back().duration_s = wall;
      } catch (const std::exception& e) {
        std::fprintf(stderr, "hicache-bench: bad result from an instance: %s\n", e.what());
        failed = true;
      }
    } else {
      failed = true;
    }
  }
  for (const Child& c : children) {
    ::close(c.to);
    ::close(c.from);
    if (failed) ::kill(c.pid, SIGKILL);
    int status = 0;
    while (::waitpid(c.pid, &status, 0) < 0 && errno == EINTR) {
    }
    failed |= !WIFEXITED(status) || WEXITSTATUS(status) != 0;
  }
  if (failed) throw std::runtime_error(str_cat(label, ": an instance failed (see above)"));
  // Each instance's ranks ran the same requests: rank 0 reports them, every rank's page checks
  // count, and each rank's L3 figures are kept apart.
  std::vector<wl::InstanceResult> merged;
  for (int i = 0; i < n; ++i) {
    std::vector<std::map<std::string, double>> ranks;
    for (int rank = 0; rank < tp && tp > 1; ++rank) {
      ranks.push_back(wl::rank_figures(results[static_cast<std::size_t>(i * tp + rank)]));
    }
    wl::InstanceResult r = std::move(results[static_cast<std::size_t>(i * tp)]);
    r.ranks = std::move(ranks);
    for (int rank = 1; rank < tp; ++rank) {
      const wl::InstanceResult& other = results[static_cast<std::size_t>(i * tp + rank)];
      for (const char* k : {"verified_pages", "mismatched_pages"}) {
        r.counters[k] += other.counters.count(k) != 0 ? other.counters.at(k) : 0.0;
      }
      if (r.first_mismatch.empty() && !other.first_mismatch.empty()) {
        r.first_mismatch = str_cat("rank ", rank, ": ", other.first_mismatch);
      }
    }
    merged.push_back(std::move(r));
  }
  return merged;
}

std::string default_fingerprint(const Settings& s) {
  if (s.keep_storage) return "synthetic";
  return str_cat("run-", ::getpid(), "-",
                 std::chrono::system_clock::now().time_since_epoch().count());
}

int run(const Settings& s) {
  // A dead instance's pipe must be an error on write, not a signal that kills the parent
  // (which would leave the temporary store behind).
  ::signal(SIGPIPE, SIG_IGN);
  const wl::WorkloadConfig wc = workload_config(s);
  const std::vector<wl::PlannedRequest> plan = wl::generate(wc);
  const std::vector<std::string> tiers = configurations(s);
  const std::string fingerprint = default_fingerprint(s);
  // Validate every configuration before running any (a bad one is exit code 2, nothing run).
  try {
    check_user_store(s, tiers);
    for (const std::string& t : tiers) stack_config(s, t, "/nonexistent", fingerprint);
  } catch (const InvalidArgument& e) {
    usage_error(e.what());
  }
  if (s.tp > 1 && s.request_rate > 0) {
    usage_error("--tp > 1 needs --request-rate 0: arrivals by the clock would differ between "
                "the rank processes, and TP ranks must serve the same requests at the same steps");
  }
  if (s.instances > 1) {
    for (const std::string& t : tiers) {
      if (t == "device" || t == "host") {
        std::fprintf(stderr, "hicache-bench: note: --instances with tier '%s' shares nothing "
                             "between instances\n", t.c_str());
      }
    }
  }
  std::printf("[hicache-bench] workload %s: %zu requests, seed %lld; %lld instance(s) of %lld "
              "TP rank(s); configurations:", std::string(wl::to_string(wc.kind)).c_str(),
              plan.size(), static_cast<long long>(s.seed), static_cast<long long>(s.instances),
              static_cast<long long>(s.tp));
  for (const auto& t : tiers) std::printf(" %s", t.c_str());
  std::printf("\n");
  std::fflush(stdout);

  std::vector<json> summaries;
  bool wrong = false;
  for (const std::string& tier : tiers) {
    const std::string name = tier == "device" ? "device" : tier == "host" ? "host" : "host+" + tier;
    // The file tier: the given root, or a fresh directory removed after the run.
    std::string root = file_root(s);
    bool remove_root = false;
    if (tier == "file" && root.empty()) {
      char tmpl[] = "/tmp/hicache-bench-XXXXXX";
      if (::mkdtemp(tmpl) == nullptr) throw std::runtime_error(str_cat("mkdtemp: ", std::strerror(errno)));
      root = tmpl;
      remove_root = !s.keep_storage;
      if (s.keep_storage) std::printf("[hicache-bench] file store kept at %s\n", root.c_str());
    }
    const auto config = stack_config(s, tier, root, fingerprint);
    wl::ConfigRun run{name, {}, config.cache.geometry.page_bytes(), config.cache.geometry.page_size};
    try {
      run.tp = static_cast<int>(s.tp);
      if (s.instances > 1 || s.tp > 1) {
        run.instances = run_instances(s, config, plan, name, static_cast<int>(s.instances),
                                      static_cast<int>(s.tp), &run.barrier);
      } else {
        run.barrier = run_options(s, name, 1).barrier;
        run.instances.push_back(run_single(s, config, plan, name));
      }
    } catch (...) {
      if (remove_root) fs::remove_all(root);
      throw;
    }
    if (remove_root) {
      std::error_code ec;
      fs::remove_all(root, ec);
    }
    json summary = wl::summarize(run, plan);
    wrong |= summary["mismatched_pages"].get<double>() > 0;
    summaries.push_back(std::move(summary));
  }
  std::printf("\n%s", wl::format_table(summaries).c_str());
  if (!s.report.empty()) {
    std::ofstream out(s.report);
    out << json{{"tool", "hicache-bench"},
                {"workload", wl::to_string(wc.kind)},
                {"settings", wl::redact_secrets(settings_json(s))},
                {"configurations", summaries}}
               .dump(2)
        << "\n";
    if (!out) throw std::runtime_error(str_cat("cannot write the report to '", s.report, "'"));
    std::printf("[hicache-bench] report: %s\n", s.report.c_str());
  }
  if (!s.plot.empty()) {
    std::ofstream out(s.plot);
    out << wl::render_svg(summaries, str_cat("hicache-bench ", wl::to_string(wc.kind), ", ",
                                             plan.size(), " requests, ", s.instances,
                                             " instance(s)"));
    if (!out) throw std::runtime_error(str_cat("cannot write the plot to '", s.plot, "'"));
    std::printf("[hicache-bench] plot: %s\n", s.plot.c_str());
  }
  for (const json& sm : summaries) {
    if (sm["mismatched_pages"].get<double>() > 0) {
      std::fprintf(stderr, "hicache-bench: %s served a wrong page: %s\n",
                   sm["name"].get<std::string>().c_str(), sm["first_mismatch"].get<std::string>().c_str());
    }
  }
  // An L3 that failed after start kept L1/L2 serving; the summary says so rather than a plain ok.
  std::string l3_failures;
  for (const json& sm : summaries) {
    if (const double errors = sm["storage_errors"].get<double>(); errors > 0) {
      l3_failures += str_cat(l3_failures.empty() ? "" : ", ", sm["name"].get<std::string>(), ": ",
                             static_cast<long long>(errors), " storage errors");
    }
  }
  if (wrong) {
    std::printf("[hicache-bench] FAILED: wrong bytes served\n");
  } else if (!l3_failures.empty()) {
    std::printf("[hicache-bench] ok: every page verified, but L3 failed (%s): those pages were "
                "recomputed\n", l3_failures.c_str());
  } else {
    std::printf("[hicache-bench] ok: every page verified\n");
  }
  return wrong ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Settings settings = parse(argc, argv);
  try {
    return run(settings);
  } catch (const InvalidArgument& e) {
    usage_error(e.what());
  } catch (const IoError& e) {  // a storage directory that cannot be created: a bad setting
    usage_error(e.what());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hicache-bench: %s\n", e.what());
    return 1;
  }
}
