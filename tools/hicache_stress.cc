// hicache-stress: the engine loop with every tier under a seeded random workload, for a given
// time or step count, with faults injected at configurable rates:
//
//   error       storage get/set results turned into errors (a failed get's span is filled
//               with garbage first: nobody may use it)
//   exists      exists queries failing
//   slow        storage batches delayed up to --slow-ms
//   timeout     storage batches that wait --timeout-ms and then fail every key
//   corrupt     one byte of a random stored record flipped on disk or in Redis
//   truncate    a random stored record truncated
//   disk_full   the file store's disk filled to the last byte for a window (a tmpfs the tool
//               mounts, with a ballast file; without the right to mount, sets fail with ENOSPC
//               through the injector instead; Redis: the injector)
//   redis_restart  a redis-server of the cluster killed (SIGKILL) and started again, empty, on
//               the same port
//   redis_failover a master killed; its replica takes over after the cluster's node timeout; at
//               the window's end the old master comes back, as a replica
//   host_exhaust   every free host page taken for a window (another tenant of the pool)
//   reset       HiRadixCache::reset through SimulatedEngine::reset in the middle of traffic
//   l3_detach   L3 detached (HiCache::detach_storage) for a window, then attached again
//   rank_delay  --tp: the last rank sleeps --rank-delay-ms before a step, at --rank-delay-rate
//               per step, so the ranks reach their agreements at different times
//
// --tp N runs N rank processes over Gloo groups (one engine each, its own pools; one shared file
// store). An MHA rank holds its own slice of the KV (page data salted by rank, its own keys);
// MLA ranks hold the same KV under one key namespace, rank 0 alone backs it up and every rank
// prefetches it (--attention mla --kv-lora-rank R --qk-rope-head-dim D, or --model). Every rank
// injects its own storage errors, delays and timeouts (its own seed); rank 0 alone corrupts,
// truncates and fills the shared disk. Resets and detaches happen at the same step on every rank:
// rank 0 decides them by its clock, and one reduction per step (the tool's own) carries its
// decisions, the end of the run, and every 16 steps a hash of each rank's tree, which must agree.
// At the end the parent also compares the ranks' final trees. Under TP the radix cache owns the
// host pool, so host_exhaust (another tenant taking host pages on one rank) is left out; Redis is
// file-only for now under --tp.
//
// --instances N runs N engine processes (each with --tp ranks) over the one file store, as
// several engines share a directory: each has its own pools and draws its own requests from the
// same prefix families, so they read each other's pages. Each verifies every page it serves;
// each counts the pages it read from L3 that it never stored (cross_instance_l3_pages: another
// instance's). Instance 0's rank 0 alone corrupts, truncates and fills the shared disk; the other
// faults are each process's own.
//
// --config FILE takes the settings as one JSON object (the flags' names with '_', the cache's
// keys, "model" a preset's name or a model object), as hicache-bench's does; flags override it.
//
// The Redis run uses a cluster of 3 masters with a replica each (cluster-node-timeout 1 s).
//
// Every page the engine reads from any tier is verified byte for byte against the data its
// token prefix derives. At the end the faults stop, the engine drains, every write and backup
// lands, everything is evicted, and the tool checks that both pools are entirely free (no slot
// leaked), the tree is consistent, and L3 still works (a page backed up after all the faults is
// found again after a reset: the storage threads did not die). It prints the table and exits
// 0 when nothing wrong was served and nothing leaked, 1 otherwise, 2 for bad flags.
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "controller/config_schema.h"
#include "storage/file_storage.h"
#include "storage/page_key.h"
#include "tools/stress/fault_storage.h"
#include "tools/support/redis_launcher.h"
#include "tools/workload/cache_flags.h"
#include "tools/workload/config_file.h"
#include "tools/workload/engine_stack.h"
#include "tools/workload/model_presets.h"
#include "transfer/errors.h"

// After the headers above: it defines BLOCK_SIZE, a name moodycamel's queue uses.
#include <sys/mount.h>
#include <sys/prctl.h>
#include <csignal>

namespace {

namespace fs = std::filesystem;
using hicache::InvalidArgument;
using hicache::str_cat;
using Clock = std::chrono::steady_clock;

const std::vector<std::string> kFaults = {
    "error",        "exists", "slow",     "timeout",  "corrupt", "truncate", "disk_full",
    "redis_restart", "redis_failover", "host_exhaust", "reset", "l3_detach", "rank_delay"};
constexpr int kRedisNodeTimeoutMs = 1000;

struct Settings {
  double seconds = 60;
  std::int64_t steps = 0;  // > 0: stop after this many engine steps instead
  std::uint64_t seed = 1;
  std::string storage = "file";
  // The cache's settings (HiCacheConfig's JSON keys): while parsing, the flags'; after parse(),
  // resolve_cache's: the scenario's, the preset's, then the flags'.
  nlohmann::json cache = nlohmann::json::object();
  std::string model;  // a preset (--model); empty: none
  std::set<std::string> faults{kFaults.begin(), kFaults.end()};
  double error_rate = 0.02, exists_error_rate = 0.01, slow_rate = 0.05, timeout_rate = 0.005;
  int slow_ms = 20, timeout_ms = 50;
  double corrupt_every_s = 0.2, truncate_every_s = 0.5, disk_full_every_s = 7,
         disk_full_window_s = 1, redis_restart_every_s = 10, redis_failover_every_s = 12,
         redis_failover_window_s = 4, host_exhaust_every_s = 4, host_exhaust_window_s = 0.5,
         reset_every_s = 6, l3_detach_every_s = 8, l3_detach_window_s = 1;
  std::int64_t tmpfs_mb = 64;
  int tp = 1;
  int instances = 1;  // engine processes over the one store
  double rank_delay_rate = 0.05;
  int rank_delay_ms = 20;
  std::string report;
  bool progress = true;
};

constexpr const char* kUsage = R"(usage: hicache-stress [options]
  --seconds S             run time (default 60)
  --steps N               stop after N engine steps instead (0: by time; --seconds on the
                          command line clears steps a --config file set)
  --seed N                workload and fault seed (1)
  --storage file|redis    L3: a file store on a tmpfs it mounts (or a temporary directory), or
                          a Redis Cluster it starts on free loopback ports (3 masters with a
                          replica each) (file)
  --faults LIST|all|none  comma list of: error, exists, slow, timeout, corrupt, truncate,
                          disk_full, redis_restart, redis_failover, host_exhaust, reset,
                          l3_detach, rank_delay (all)
  --error-rate P          per key of a get/set (0.02)     --exists-error-rate P  (0.01)
  --slow-rate P           per batch (0.05)                --slow-ms N            (20)
  --timeout-rate P        per batch (0.005)               --timeout-ms N         (50)
  --corrupt-every-s S     (0.2)                           --truncate-every-s S   (0.5)
  --disk-full-every-s S   (7)                             --disk-full-window-s S (1)
  --redis-restart-every-s S (10)
  --redis-failover-every-s S (12)                         --redis-failover-window-s S (4)
  --l3-detach-every-s S   (8)                             --l3-detach-window-s S (1)
  --host-exhaust-every-s S (4)                            --host-exhaust-window-s S (0.5)
  --reset-every-s S       (6)
  --tp N                  TP ranks, each a process over Gloo (1)
  --instances N           engine processes over the one file store (each with its own pools
                          and requests, --tp ranks each); they read each other's pages (1)
  --rank-delay-rate P     per step of the last rank (0.05)  --rank-delay-ms N   (20)
  --tmpfs-mb N            size of the file store's tmpfs (64)
  --model NAME            a model preset for the cache's model keys (the model flags override it)
  --report FILE           also write the table as JSON
  --no-progress           no progress lines on stderr (--progress: on again, over a
                          --config file's "progress": false)
  --config FILE           a JSON object of these settings (the names with '_': "seconds",
                          "faults", "tp", ...) and the cache's keys ("model": a preset's name or
                          a model object, as in hicache-bench); the flags override it
Exit code: 0 pass (no wrong byte served, no slot leaked, L3 alive), 1 fail, 2 bad flags.
Cache settings: the library's (docs/configuration.md), over the scenario's below; on CUDA
(--device cuda) pages are verified through copies.
)";

// The scenario: a small model on the host emulation; prefetches wait for their pages up to
// 20 ms + 2 ms per page (at most 200 ms), then take what landed, so slow and timed-out storage
// shows as partial prefetches, not stalls. The model's MHA keys go only into an MHA model; an
// MLA model needs its widths (--attention mla --kv-lora-rank R --qk-rope-head-dim D) or a preset.
const hicache::workload::ToolDefaults& scenario() {
  static const hicache::workload::ToolDefaults kScenario{
      .cache = {{"device", "host"},
                {"page_size", 16},
                {"device_tokens", 4096},
                {"model_name", "hicache-stress"},
                {"prefetch_policy", "timeout"},
                {"prefetch_timeout_base_ms", 20},
                {"prefetch_timeout_per_page_ms", 2},
                {"prefetch_timeout_cap_ms", 200},
                {"prefetch_threshold_tokens", 32}},
      .model_common = {{"layers", 4}},
      .model_mha = {{"kv_heads", 2}, {"head_dim", 32}},
      .model_mla = nlohmann::json::object()};
  return kScenario;
}

std::string usage() {
  return str_cat(kUsage, "  scenario: ", hicache::workload::describe(scenario()),
                 " (model.mha only for an mha model), then a preset's keys, then the flags'\n",
                 "Model presets (--model NAME; a preset's pages are large: give --tmpfs-mb and "
                 "--device-tokens to suit):\n",
                 hicache::workload::model_presets_usage(), hicache::config_flags_usage());
}

[[noreturn]] void usage_error(const std::string& message) {
  std::fprintf(stderr, "hicache-stress: %s\n%s", message.c_str(), usage().c_str());
  std::exit(2);
}

double number(const std::string& flag, const char* v, double min) {
  char* end = nullptr;
  const double x = std::strtod(v, &end);
  if (end == v || *end != '\0' || !(x >= min)) {
    usage_error(str_cat(flag, ": '", v, "' is not a number >= ", min));
  }
  return x;
}

// The tool's own settings by JSON key (the flag's name with '_'), for --config.
const std::map<std::string, hicache::workload::ValueKind>& tool_keys() {
  using K = hicache::workload::ValueKind;
  static const std::map<std::string, K> kKeys = {
      {"seconds", K::kDouble},           {"steps", K::kInt},
      {"seed", K::kInt},                 {"storage", K::kString},
      {"faults", K::kString},            {"error_rate", K::kDouble},
      {"exists_error_rate", K::kDouble}, {"slow_rate", K::kDouble},
      {"slow_ms", K::kInt},              {"timeout_rate", K::kDouble},
      {"timeout_ms", K::kInt},           {"corrupt_every_s", K::kDouble},
      {"truncate_every_s", K::kDouble},  {"disk_full_every_s", K::kDouble},
      {"disk_full_window_s", K::kDouble}, {"redis_restart_every_s", K::kDouble},
      {"redis_failover_every_s", K::kDouble}, {"redis_failover_window_s", K::kDouble},
      {"l3_detach_every_s", K::kDouble}, {"l3_detach_window_s", K::kDouble},
      {"host_exhaust_every_s", K::kDouble}, {"host_exhaust_window_s", K::kDouble},
      {"reset_every_s", K::kDouble},     {"tp", K::kInt},
      {"instances", K::kInt},            {"rank_delay_rate", K::kDouble},
      {"rank_delay_ms", K::kInt},        {"tmpfs_mb", K::kInt},
      {"report", K::kString},            {"progress", K::kBool}};
  return kKeys;
}

std::map<std::string, double*> double_flags(Settings& s) {
  return {{"--seconds", &s.seconds},
          {"--error-rate", &s.error_rate},
          {"--exists-error-rate", &s.exists_error_rate},
          {"--slow-rate", &s.slow_rate},
          {"--timeout-rate", &s.timeout_rate},
          {"--corrupt-every-s", &s.corrupt_every_s},
          {"--truncate-every-s", &s.truncate_every_s},
          {"--disk-full-every-s", &s.disk_full_every_s},
          {"--disk-full-window-s", &s.disk_full_window_s},
          {"--redis-restart-every-s", &s.redis_restart_every_s},
          {"--redis-failover-every-s", &s.redis_failover_every_s},
          {"--redis-failover-window-s", &s.redis_failover_window_s},
          {"--l3-detach-every-s", &s.l3_detach_every_s},
          {"--l3-detach-window-s", &s.l3_detach_window_s},
          {"--host-exhaust-every-s", &s.host_exhaust_every_s},
          {"--host-exhaust-window-s", &s.host_exhaust_window_s},
          {"--reset-every-s", &s.reset_every_s},
          {"--rank-delay-rate", &s.rank_delay_rate}};
}

// One of the tool's own flags with its value (from the command line or --config); false when
// `flag` is not one of them.
bool set_tool_flag(Settings& s, const std::string& flag, const char* v) {
  auto doubles = double_flags(s);
  if (auto it = doubles.find(flag); it != doubles.end()) {
    *it->second = number(flag, v, 0);
  } else if (flag == "--steps") {
    s.steps = static_cast<std::int64_t>(number(flag, v, 0));
  } else if (flag == "--seed") {
    s.seed = static_cast<std::uint64_t>(number(flag, v, 0));
  } else if (flag == "--slow-ms") {
    s.slow_ms = static_cast<int>(number(flag, v, 0));
  } else if (flag == "--timeout-ms") {
    s.timeout_ms = static_cast<int>(number(flag, v, 0));
  } else if (flag == "--rank-delay-ms") {
    s.rank_delay_ms = static_cast<int>(number(flag, v, 0));
  } else if (flag == "--tp") {
    s.tp = static_cast<int>(number(flag, v, 1));
  } else if (flag == "--instances") {
    s.instances = static_cast<int>(number(flag, v, 1));
  } else if (flag == "--tmpfs-mb") {
    s.tmpfs_mb = static_cast<std::int64_t>(number(flag, v, 8));
  } else if (flag == "--report") {
    s.report = v;
  } else if (flag == "--model") {
    s.model = v;
  } else if (flag == "--progress") {  // --config's "progress": true | false
    s.progress = std::string_view(v) == "true";
  } else if (flag == "--storage") {
    s.storage = v;
    if (s.storage != "file" && s.storage != "redis") {
      usage_error(str_cat("--storage: '", v, "': valid are file, redis"));
    }
  } else if (flag == "--faults") {
    s.faults.clear();
    const std::string list = v;
    if (list == "all") {
      s.faults.insert(kFaults.begin(), kFaults.end());
    } else if (list != "none") {
      std::stringstream in(list);
      for (std::string f; std::getline(in, f, ',');) {
        if (std::find(kFaults.begin(), kFaults.end(), f) == kFaults.end()) {
          usage_error(str_cat("--faults: unknown fault '", f, "'"));
        }
        s.faults.insert(f);
      }
    }
  } else {
    return false;
  }
  return true;
}

// --config FILE: the tool's keys as their flags, the cache's into s.cache.
void apply_config_file(Settings& s, const std::string& path) {
  hicache::workload::apply_config_file(
      path, s.cache, s.model,
      [&s](std::string_view key) -> std::optional<hicache::workload::ToolKey> {
        const auto it = tool_keys().find(std::string(key));
        if (it == tool_keys().end()) return std::nullopt;
        std::string flag = str_cat("--", key);
        for (char& c : flag) c = c == '_' ? '-' : c;
        return hicache::workload::ToolKey{
            it->second, [&s, flag](const std::string& text) { set_tool_flag(s, flag, text.c_str()); }};
      });
}

Settings parse(int argc, char** argv) {
  Settings s;
  try {
    // The files first: flags override them.
    for (const std::string& path : hicache::workload::config_file_arguments(argc, argv)) {
      apply_config_file(s, path);
    }
  } catch (const InvalidArgument& e) {
    usage_error(e.what());
  }
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::fputs(usage().c_str(), stdout);
      std::exit(0);
    }
    if (flag == "--no-progress" || flag == "--progress") {
      s.progress = flag == "--progress";
      continue;
    }
    if (i + 1 >= argc) usage_error(str_cat("unknown flag or missing value: ", flag));
    const char* v = argv[++i];
    if (flag == "--config") continue;  // applied above
    // The cache's flags, but --storage, which is this tool's (it starts its own store).
    if (const auto* k = hicache::find_config_flag(flag.substr(2));
        k != nullptr && flag != "--storage") {
      try {
        const auto value = nlohmann::json::parse(hicache::config_flag_json(*k, v));
        hicache::workload::set_cache_key(s.cache, k->key, value);
      } catch (const InvalidArgument& e) {
        usage_error(e.what());
      }
      continue;
    }
    if (!set_tool_flag(s, flag, v)) usage_error(str_cat("unknown flag: ", flag));
    if (flag == "--seconds") s.steps = 0;  // the command line's run time over a file's steps
  }
  if (s.tp > 1 && s.storage == "redis") {
    usage_error("--tp > 1 runs on the file store only (--storage file)");
  }
  if (s.instances > 1 && s.storage == "redis") {
    usage_error("--instances > 1 runs on the file store only (--storage file): the instances "
                "share its directory");
  }
  if (s.tp > 1) s.faults.erase("host_exhaust");  // the radix cache owns the host pool under TP
  auto doubles = double_flags(s);
  for (const char* rate : {"--error-rate", "--exists-error-rate", "--slow-rate", "--timeout-rate",
                           "--rank-delay-rate"}) {
    if (*doubles[rate] > 1) usage_error(str_cat(rate, ": ", *doubles[rate], " is not a probability"));
  }
  if (s.seconds <= 0 && s.steps == 0) usage_error("--seconds must be > 0 (or give --steps)");
  try {
    hicache::workload::refuse_tool_owned_tp_keys(s.cache, s.tp);
    s.cache = hicache::workload::resolve_cache(scenario(), s.model, s.cache);
    (void)hicache::HiCacheConfig::from_json_text(s.cache.dump());  // bad cache flags: exit 2
  } catch (const InvalidArgument& e) {
    usage_error(e.what());
  }
  return s;
}

// A tmpfs for the file store (a real full disk), when this process may mount one.
class Tmpfs {
 public:
  explicit Tmpfs(std::int64_t mb) {
    char tmpl[] = "/tmp/hicache-stress-XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) throw std::runtime_error(str_cat("mkdtemp: ", std::strerror(errno)));
    dir_ = tmpl;
    const std::string opts = str_cat("size=", mb, "m");
    mounted_ = ::mount("tmpfs", dir_.c_str(), "tmpfs", 0, opts.c_str()) == 0;
    if (!mounted_) why_not_ = std::strerror(errno);
    fs::create_directories(dir_ / "store");
  }
  ~Tmpfs() {
    release_ballast();
    if (mounted_) ::umount2(dir_.c_str(), MNT_DETACH);
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  bool mounted() const { return mounted_; }
  const std::string& why_not() const { return why_not_; }
  fs::path store() const { return dir_ / "store"; }
  // Fills the file system to the last byte.
  void fill() {
    const int fd = ::open((dir_ / "ballast").c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
    if (fd < 0) return;
    std::vector<char> chunk(1 << 20, 0);
    for (std::size_t size = chunk.size(); size >= 512;) {
      const ssize_t n = ::write(fd, chunk.data(), size);
      if (n < 0) {
        if (errno != ENOSPC) break;
        size /= 2;  // the last bytes, in smaller writes
      }
    }
    ::close(fd);
  }
  void release_ballast() {
    std::error_code ec;
    fs::remove(dir_ / "ballast", ec);
  }

 private:
  fs::path dir_;
  bool mounted_ = false;
  std::string why_not_;
};

// Requests over 16 families of shared prefixes, each up to 48 pages, plus own pages and a short
// answer: the tree shares, evicts, loads back and prefetches constantly. The families derive
// from the seed alone; the requests drawn from them from the seed and `stream` (--instances:
// the instance), so instances ask for the same prefixes in their own order.
class RequestSource {
 public:
  RequestSource(std::uint64_t seed, std::int32_t page, std::uint64_t stream = 0)
      : rng_(seed), page_(page) {
    for (int f = 0; f < 16; ++f) {
      std::vector<std::int32_t> t;
      for (int i = 0; i < 48 * page; ++i) t.push_back(static_cast<std::int32_t>(rng_() >> 33));
      families_.push_back(std::move(t));
    }
    if (stream != 0) rng_.seed(seed ^ (stream * 0x9E3779B97F4A7C15ull));
  }
  hicache::SimulatedRequest next() {
    const auto& fam = families_[rng_() % families_.size()];
    const auto shared = static_cast<std::size_t>((2 + rng_() % 47) * static_cast<std::uint64_t>(page_));
    hicache::SimulatedRequest r;
    r.id = str_cat("s", n_++);
    r.tokens.assign(fam.begin(), fam.begin() + static_cast<std::ptrdiff_t>(shared));
    const auto own = static_cast<int>(rng_() % (3 * static_cast<std::uint64_t>(page_) + 1));
    for (int i = 0; i < own; ++i) r.tokens.push_back(static_cast<std::int32_t>(rng_() >> 33));
    r.output_tokens = static_cast<std::int32_t>(rng_() % 9);
    for (int i = 0; i < r.output_tokens; ++i) r.tokens.push_back(static_cast<std::int32_t>(rng_() >> 33));
    return r;
  }
  std::mt19937_64& rng() { return rng_; }

 private:
  std::mt19937_64 rng_;
  std::int32_t page_;
  std::vector<std::vector<std::int32_t>> families_;
  std::int64_t n_ = 0;
};

// A fault that fires every `every` seconds (jittered), optionally lasting `window` seconds.
struct Periodic {
  std::string name;
  double every = 0, window = 0;
  double next = 0, ends = -1;  // seconds since start; ends >= 0: a window is open
  std::int64_t fired = 0;
};

double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The L3 store of a run, set up once (by the parent, under --tp, before any rank forks).
struct Store {
  std::unique_ptr<Tmpfs> tmpfs;
  std::unique_ptr<hicache::bench::RedisDeployment> redis;
  std::string json;
  fs::path root;
};

// False (said on stderr) when the store cannot be started.
bool setup_store(const Settings& s, Store& store) {
  using namespace hicache;
  std::unique_ptr<Tmpfs>& tmpfs = store.tmpfs;
  std::unique_ptr<bench::RedisDeployment>& redis = store.redis;
  std::string& storage_json = store.json;
  fs::path& store_root = store.root;
  if (s.storage == "file") {
    tmpfs = std::make_unique<Tmpfs>(s.tmpfs_mb);
    store_root = tmpfs->store();
    // On the tmpfs the store's capacity follows the filesystem (its free space less the
    // reserve), and the ballast makes the disk fill under it: real ENOSPC, evictions and
    // shrinks. Without a tmpfs the store sits on the machine's disk: a fixed capacity then.
    // Under --tp and --instances every process opens the root: shared. Alone, the store
    // detects it.
    nlohmann::json file = {{"backend", "file"}, {"root", store_root.string()}};
    if (s.tp * s.instances > 1) file["shared"] = true;
    if (!tmpfs->mounted()) file["capacity_bytes"] = s.tmpfs_mb * 3 / 4 << 20;
    storage_json = file.dump();
    std::printf("[hicache-stress] file store on %s (%s)\n", store_root.c_str(),
                tmpfs->mounted() ? str_cat("tmpfs of ", s.tmpfs_mb, " MiB").c_str()
                                 : str_cat("no tmpfs: ", tmpfs->why_not(),
                                           "; a full disk is injected").c_str());
  } else {
    redis = std::make_unique<bench::RedisDeployment>();
    std::string error;
    if (!redis->start(3, /*cluster=*/true, &error, /*replicas=*/1, kRedisNodeTimeoutMs,
                      {"--maxmemory", "96mb", "--maxmemory-policy", "allkeys-lru"})) {
      std::fprintf(stderr, "hicache-stress: cannot start the redis cluster: %s\n", error.c_str());
      return false;
    }
    nlohmann::json nodes = nlohmann::json::array();
    std::string listed;
    for (int p : redis->ports()) {
      nodes.push_back(str_cat("127.0.0.1:", p));
      listed += str_cat(" ", p);
    }
    storage_json = nlohmann::json{{"backend", "redis"},       {"cluster", true},
                                  {"nodes", nodes},           {"timeout_ms", 500},
                                  {"connect_timeout_ms", 300}, {"reconnect_backoff_ms", {20, 500}}}
                       .dump();
    std::printf("[hicache-stress] redis cluster, 3 masters with a replica each, on 127.0.0.1 "
                "ports%s\n",
                listed.c_str());
  }
  std::fflush(stdout);
  return true;
}

// This process's place: its instance (--instances) and its rank in the instance's TP group.
struct Rank {
  int rank = 0, size = 1;
  std::string rendezvous;   // where the Gloo groups meet (size > 1)
  std::string result_file;  // a child process: its table and final tree, for the parent
  int instance = 0, instances = 1;
};

// One rank's run (the whole run without --tp and --instances): the table on stdout, or into
// me.result_file.
int run_rank(const Settings& s, Store& store, const Rank& me) {
  using namespace hicache;
  const bool tp = me.size > 1;
  auto on = [&](const std::string& f) { return s.faults.count(f) != 0; };
  Tmpfs* tmpfs = store.tmpfs.get();
  bench::RedisDeployment* redis = store.redis.get();
  const std::string& storage_json = store.json;
  const fs::path& store_root = store.root;
  // Each rank injects its own storage faults.
  auto faulty = std::make_shared<stress::FaultInjectingStorage>(
      make_storage(storage_json), s.seed + static_cast<std::uint64_t>(me.rank) * 7919 +
                                      static_cast<std::uint64_t>(me.instance) * 104729);
  stress::FaultInjectingStorage* inject = faulty.get();
  const stress::FaultRates rates{.error = on("error") ? s.error_rate : 0,
                                 .exists_error = on("exists") ? s.exists_error_rate : 0,
                                 .slow = on("slow") ? s.slow_rate : 0,
                                 .slow_ms = s.slow_ms,
                                 .timeout = on("timeout") ? s.timeout_rate : 0,
                                 .timeout_ms = s.timeout_ms};
  inject->set_rates(rates);
  std::unique_ptr<stress::Corruptor> corruptor =
      s.storage == "file" ? stress::make_file_corruptor(store_root)
                          : stress::make_redis_corruptor([&redis] { return redis->masters(); });

  workload::StackConfig config;
  nlohmann::json cache = s.cache;
  if (!cache.contains("model_fingerprint")) cache["model_fingerprint"] = str_cat("seed", s.seed);
  config.cache = HiCacheConfig::from_json_text(cache.dump());
  if (tp) {
    config.cache.tp.rank = me.rank;
    config.cache.tp.size = me.size;
    config.cache.tp.store_dir = me.rendezvous;
    // MHA: each rank holds its own heads (salted data, its own keys); MLA: every rank the same.
    if (config.cache.geometry.attention == AttentionKind::kMHA) {
      config.engine.data_salt = static_cast<std::uint64_t>(me.rank);
    }
  }
  config.engine.max_batch = 8;
  config.engine.max_prefetches = 4;
  // --instances: a page read from L3 that this process never stored is another instance's.
  // An MLA rank other than 0 stores nothing (rank 0 backs up for the instance): its reads say
  // nothing about other instances, so it keeps no ledger.
  const bool counts_cross_instance =
      me.instances > 1 && (me.rank == 0 || config.cache.geometry.attention == AttentionKind::kMHA);
  if (counts_cross_instance) inject->track_own_writes();
  workload::EngineStack stack(config, faulty);
  SimulatedEngine& engine = stack.engine();
  const std::int32_t page = config.cache.geometry.page_size;
  RequestSource source(s.seed, page, static_cast<std::uint64_t>(me.instance));

  // Faults on their own clock: each rank's (rank 0's alone for the shared disk). Faults every
  // rank takes at the same step (`agreed`): rank 0's clock, its decisions carried to the others
  // by the step's control reduction (TP).
  std::vector<Periodic> periodic, agreed;
  auto add = [&](const char* name, double every, double window) {
    if (on(name) && every > 0) periodic.push_back({name, every, window, every * 0.5});
  };
  if (me.rank == 0 && me.instance == 0) {  // the shared disk's faults: one process's
    add("corrupt", s.corrupt_every_s, 0);
    add("truncate", s.truncate_every_s, 0);
    add("disk_full", s.disk_full_every_s, s.disk_full_window_s);
  }
  if (s.storage == "redis") {
    add("redis_restart", s.redis_restart_every_s, 0);
    add("redis_failover", s.redis_failover_every_s, s.redis_failover_window_s);
  }
  add("host_exhaust", s.host_exhaust_every_s, s.host_exhaust_window_s);
  const std::size_t local_faults = periodic.size();
  add("l3_detach", s.l3_detach_every_s, s.l3_detach_window_s);
  add("reset", s.reset_every_s, 0);
  agreed.assign(periodic.begin() + static_cast<std::ptrdiff_t>(local_faults), periodic.end());
  periodic.resize(local_faults);

  std::int64_t submitted = 0, finished = 0, aborted = 0, corrupt_injected = 0, restart_failures = 0;
  std::vector<std::int64_t> held_host;
  // The faults' own draws: the requests' generator must draw the same on every rank.
  std::mt19937_64 rng(s.seed * 31 + 7 + static_cast<std::uint64_t>(me.rank) +
                      static_cast<std::uint64_t>(me.instance) * 1000003);
  int failed_master = 0;  // the port of the master redis_failover killed, while down
  // What the storage controllers of earlier attaches counted (l3_detach ends each one).
  std::int64_t retired_written = 0, retired_read = 0, retired_failed = 0;
  auto restart_redis = [&](int port) {
    std::string error;
    if (!redis->server_on(port)->restart(&error)) {
      ++restart_failures;
      std::fprintf(stderr, "hicache-stress: redis restart failed: %s\n", error.c_str());
    }
  };
  auto close_window = [&](Periodic& p) {
    if (p.name == "redis_failover") {
      if (failed_master != 0) restart_redis(failed_master);  // it rejoins as a replica
      failed_master = 0;
    } else if (p.name == "l3_detach") {
      if (stack.storage() == nullptr) stack.hicache().attach_storage(faulty);
    } else if (p.name == "disk_full") {
      if (tmpfs && tmpfs->mounted()) tmpfs->release_ballast();
      inject->set_disk_full(false);
    } else if (p.name == "host_exhaust" && !held_host.empty()) {
      stack.host_pool().free(held_host);
      held_host.clear();
    }
    p.ends = -1;
  };
  auto fire = [&](Periodic& p) {
    ++p.fired;
    if (p.name == "corrupt") {
      if (corruptor->flip_byte(rng)) {
        ++corrupt_injected;
      } else {
        --p.fired;  // nothing stored to flip: not a fault
      }
    } else if (p.name == "truncate") {
      if (corruptor->truncate(rng)) {
        ++corrupt_injected;
      } else {
        --p.fired;
      }
    } else if (p.name == "disk_full") {
      if (s.storage == "file" && tmpfs->mounted()) {
        tmpfs->fill();
      } else {
        inject->set_disk_full(true);
      }
    } else if (p.name == "redis_restart") {
      // Not while a failover is under way: a replica restarted then will not take over, and
      // the cluster stays down until the window ends, which tests nothing more.
      std::vector<int> up;
      for (int port : redis->ports()) {
        if (redis->server_on(port)->running()) up.push_back(port);
      }
      if (failed_master != 0 || up.empty()) {
        --p.fired;
      } else {
        restart_redis(up[rng() % up.size()]);
      }
    } else if (p.name == "redis_failover") {
      const std::vector<int> masters = redis->masters();
      if (masters.empty()) {
        --p.fired;
      } else {
        failed_master = masters[rng() % masters.size()];
        redis->server_on(failed_master)->stop();
      }
    } else if (p.name == "l3_detach") {
      engine.flush();  // the backups in flight land and count here, before the controller goes
      if (const StorageController* sc = stack.storage_controller()) {
        retired_written += sc->written_bytes();
        retired_read += sc->read_bytes();
        retired_failed += sc->failed_ops();
      }
      stack.hicache().detach_storage();
    } else if (p.name == "host_exhaust") {
      const std::int64_t free = stack.host_pool().free_tokens() / page * page;
      if (free > 0) {
        if (auto got = stack.host_pool().alloc(free)) held_host = std::move(*got);
      }
    } else if (p.name == "reset") {
      aborted += static_cast<std::int64_t>(engine.reset());
      held_host.clear();  // the reset freed every host page, the ones held here too
    }
  };

  const auto t0 = Clock::now();
  double last_progress = 0;
  std::int64_t steps = 0;
  auto drain = [&] {
    for (const FinishedRequest& f : engine.drain_finished()) {
      if (!f.aborted) ++finished;
    }
  };
  auto keep_going = [&] { return s.steps > 0 ? steps < s.steps : since(t0) < s.seconds; };
  // TP: the step's control reduction. Rank 0's decisions (stop; per agreed fault: fire or close
  // its window) and every rank's tree hash every 16 steps; the others send the largest value
  // where rank 0 decides, so the minimum is rank 0's.
  Collective* main_group = tp ? stack.hicache().collectives().main : nullptr;
  std::int64_t tree_checks = 0, tree_divergences = 0, rank_delays = 0;
  std::string control_failure;
  constexpr std::int64_t kNone = std::numeric_limits<std::int64_t>::max();
  std::vector<std::int64_t> control;
  auto step_fault = [&](Periodic& p, double now, bool fire_it) {
    if (!fire_it) {
      close_window(p);
      return;
    }
    fire(p);
    if (p.window > 0) p.ends = now + p.window;
    p.next = now + p.every * std::uniform_real_distribution<double>(0.5, 1.5)(rng);
  };
  auto run_local = [&](std::vector<Periodic>& faults, double now) {
    for (Periodic& p : faults) {
      if (p.ends >= 0 && now >= p.ends) close_window(p);
      if (p.ends < 0 && now >= p.next) step_fault(p, now, true);
    }
  };
  bool stop = false;
  while (tp ? !stop : keep_going()) {
    // Outstanding: not finished, aborted or rejected (the engine drops a request larger than
    // its device pool with no report; none of these can be, and the pass condition says so).
    while (submitted - finished - aborted - engine.stats().rejected < 32) {
      engine.submit(source.next());
      ++submitted;
    }
    if (tp && on("rank_delay") && me.rank == me.size - 1 &&
        std::uniform_real_distribution<double>(0, 1)(rng) < s.rank_delay_rate) {
      ++rank_delays;
      std::this_thread::sleep_for(std::chrono::milliseconds(s.rank_delay_ms));
    }
    engine.step();
    ++steps;
    drain();
    const double now = since(t0);
    run_local(periodic, now);
    if (!tp) {
      run_local(agreed, now);
    } else {
      control.assign(1 + agreed.size() + 2, kNone);
      if (me.rank == 0) {
        control[0] = keep_going() ? 0 : 1;
        for (std::size_t i = 0; i < agreed.size(); ++i) {
          const Periodic& p = agreed[i];
          control[1 + i] = p.ends >= 0 && now >= p.ends ? 2 : p.ends < 0 && now >= p.next ? 1 : 0;
        }
      }
      const std::size_t at_hash = 1 + agreed.size();
      control[at_hash] = control[at_hash + 1] = 0;
      if (steps % 16 == 0) {
        const auto h = static_cast<std::int64_t>(std::hash<std::string>{}(stack.cache().describe()) >> 1);
        control[at_hash] = h;
        control[at_hash + 1] = -h;
        ++tree_checks;
      }
      if (const auto r = main_group->min_allreduce(control, "stress.control"); !r.ok) {
        control_failure = r.error;
        break;
      }
      if (control[at_hash] != -control[at_hash + 1]) ++tree_divergences;
      for (std::size_t i = 0; i < agreed.size(); ++i) {
        if (control[1 + i] != 0) step_fault(agreed[i], now, control[1 + i] == 1);
      }
      stop = control[0] == 1;
    }
    if (s.progress && me.rank == 0 && me.instance == 0 && now - last_progress >= 5) {
      last_progress = now;
      std::fprintf(stderr, "[hicache-stress] %.0f s: %lld steps, %lld requests done, %lld aborted, %lld wrong pages\n",
                   now, static_cast<long long>(steps), static_cast<long long>(finished),
                   static_cast<long long>(aborted),
                   static_cast<long long>(engine.stats().mismatched_pages));
    }
  }
  const double run_seconds = since(t0);

  // Quiesce: faults off, what is queued finishes, every write and backup lands.
  for (auto* faults : {&periodic, &agreed}) {
    for (Periodic& p : *faults) {
      if (p.ends >= 0) close_window(p);
    }
  }
  inject->set_rates({});
  inject->set_disk_full(false);
  if (redis) {
    // Every server back and the cluster whole again before the end checks.
    std::string error;
    if (!redis->wait_healthy(60, &error)) {
      ++restart_failures;
      std::fprintf(stderr, "hicache-stress: the redis cluster did not recover: %s\n", error.c_str());
    }
  }
  engine.run_until_idle(50'000'000);
  engine.flush();
  drain();
  const bool drained = engine.waiting() == 0 && engine.decoding() == 0;

  // Everything evicted: both pools must be entirely free, and the tree consistent (checked
  // before the probe below, whose reset would free the pools wholesale).
  // Evicting a device-only node writes it to the host first and frees it on the write's ack, so
  // each round waits for the writes it started (engine.flush): checking right away, as this
  // once did, found a finished write's ack not yet applied and reported its path as leaked.
  auto evict_everything = [&] {
    for (int i = 0; i < 8; ++i) {
      stack.cache().check_events();
      stack.cache().evict_device(stack.device_pool().capacity_tokens());
      engine.flush();
      stack.cache().evict_host(stack.host_pool().capacity_tokens());
    }
  };
  const std::string final_tree = stack.cache().describe();
  evict_everything();
  const std::int64_t device_leak =
      stack.device_pool().capacity_tokens() - stack.device_pool().allocator().free_tokens();
  const std::int64_t host_leak = stack.host_pool().capacity_tokens() - stack.host_pool().free_tokens();
  const std::string invariants = stack.cache().check_invariants();
  if (device_leak != 0 || host_leak != 0) {
    // A leak explains itself: the host pages' states, and what of the tree eviction left.
    std::string states;
    for (int st = 0; st < kNumPageStates; ++st) {
      const auto state = static_cast<PageState>(st);
      states += str_cat(" ", to_string(state), "=", stack.host_pool().count_in_state(state));
    }
    std::fprintf(stderr, "hicache-stress: slots left after evicting everything (device %lld, "
                         "host %lld); host pages by state:%s\ntree:\n%s\n",
                 static_cast<long long>(device_leak), static_cast<long long>(host_leak),
                 states.c_str(), stack.cache().describe().c_str());
  }

  // L3 alive after everything: a fresh conversation is backed up (all 8 pages must be in the
  // store: asked directly), the cache is reset, and the same request finds its pages in L3.
  // Up to 10 attempts, 250 ms apart: a Redis connection may sit in its reconnect backoff after
  // the last restart (this is the end-of-run check, not the engine's loop).
  SimulatedRequest probe;
  for (int i = 0; i < 8 * page; ++i) {
    probe.tokens.push_back(static_cast<std::int32_t>(source.rng()() >> 33));
  }
  std::vector<std::string> probe_keys;
  PageKeyer(stack.key_namespace()).keys(probe.tokens, nullptr, probe_keys);
  probe.tokens.push_back(1);
  probe.output_tokens = 1;
  bool l3_alive = false;
  int probe_attempts = 0;
  std::size_t probe_stored = 0;
  // The probe's prefetch waits for its pages: the run's timeout policy (tens of ms) would make
  // this check depend on how fast a starved machine reads them (a 4.3 MiB-page preset under the
  // sanitizers could miss it on every attempt). Every rank at the same step.
  if (StorageController* sc = stack.storage_controller()) {
    sc->set_prefetch_policy(PrefetchPolicy::kWaitComplete);
  }
  for (; probe_attempts < 10 && !l3_alive; ++probe_attempts) {
    if (probe_attempts > 0) std::this_thread::sleep_for(std::chrono::milliseconds(250));
    probe.id = str_cat("probe-", probe_attempts);
    engine.submit(probe);
    engine.run_until_idle();
    engine.flush();
    engine.drain_finished();
    probe_stored = inject->inner().batch_exists(probe_keys);
    engine.reset();
    probe.id = str_cat("probe-", probe_attempts, "-again");
    engine.submit(probe);
    engine.run_until_idle();
    std::int64_t from_l3 = 0;
    for (const FinishedRequest& f : engine.drain_finished()) from_l3 += f.storage_hit_tokens;
    // TP: every rank's probe must have worked, and all of them try again alike.
    const bool mine = probe_stored == probe_keys.size() && from_l3 > 0;
    if (!mine) {
      const auto st = inject->inner().stats();
      std::fprintf(stderr, "hicache-stress: rank %d: probe %d found %zu of %zu pages stored, %lld "
                           "tokens read from L3 (store capacity %llu bytes, %llu used, %lld set "
                           "errors; storage controller failed ops %lld)\n",
                   me.rank, probe_attempts, probe_stored, probe_keys.size(),
                   static_cast<long long>(from_l3), static_cast<unsigned long long>(st.capacity_bytes),
                   static_cast<unsigned long long>(st.stored_bytes), static_cast<long long>(st.set_errors),
                   static_cast<long long>(stack.storage_controller() ? stack.storage_controller()->failed_ops() : -1));
    }
    l3_alive = stack.cache().on_every_rank(mine, "stress.probe");
    engine.flush();
  }
  evict_everything();
  const bool clean_after_probe =
      stack.device_pool().allocator().free_tokens() == stack.device_pool().capacity_tokens() &&
      stack.host_pool().free_tokens() == stack.host_pool().capacity_tokens();

  const auto& es = engine.stats();
  const auto cs = stack.cache().stats();
  const auto ctl = stack.controller().stats();
  const StorageController* sc = stack.storage_controller();
  const auto inner = inject->inner().stats();
  const auto inj = inject->injected();
  const double page_bytes = static_cast<double>(config.cache.geometry.page_bytes());
  std::map<std::string, std::int64_t> faults_fired;
  for (const auto* faults : {&periodic, &agreed}) {
    for (const Periodic& p : *faults) faults_fired[p.name] = p.fired;
  }
  if (tp) faults_fired["rank_delay"] = rank_delays;
  faults_fired["error"] = static_cast<std::int64_t>(inj.errors);
  faults_fired["exists"] = static_cast<std::int64_t>(inj.exists_errors);
  faults_fired["slow"] = static_cast<std::int64_t>(inj.slow);
  faults_fired["timeout"] = static_cast<std::int64_t>(inj.timeouts);
  faults_fired["disk_full_sets_refused"] = static_cast<std::int64_t>(inj.disk_full_sets);
  const std::int64_t detected = static_cast<std::int64_t>(inner.bad_records);
  const std::int64_t wrong = es.mismatched_pages;
  const std::string tp_failure =
      !control_failure.empty() ? control_failure : tp ? main_group->failure() : std::string();
  const bool pass = wrong == 0 && device_leak == 0 && host_leak == 0 && invariants.empty() &&
                    l3_alive && drained && restart_failures == 0 && es.rejected == 0 &&
                    clean_after_probe && tree_divergences == 0 && tp_failure.empty() &&
                    cs.tp_failures == 0;

  nlohmann::json table = {
      {"seconds", run_seconds},
      {"steps", steps},
      {"requests_submitted", submitted},
      {"requests_finished", finished},
      {"requests_aborted_by_reset", aborted},
      // KV pages (a hybrid model's sidecar bytes are counted apart, below).
      {"pages_l1_to_l2",
       static_cast<double>(ctl.bytes_written - ctl.sidecar_bytes_written) / page_bytes},
      {"pages_l2_to_l1",
       static_cast<double>(ctl.bytes_loaded - ctl.sidecar_bytes_loaded) / page_bytes},
      {"pages_l2_to_l3",
       static_cast<double>(retired_written + (sc ? sc->written_bytes() : 0)) / page_bytes},
      {"pages_l3_to_l2",
       static_cast<double>(retired_read + (sc ? sc->read_bytes() : 0)) / page_bytes},
      {"pages_verified", es.verified_pages},
      {"faults", faults_fired},
      {"storage_op_failures_seen", retired_failed + (sc ? sc->failed_ops() : 0)},
      {"storage_get_errors", inner.get_errors},
      {"storage_set_errors", inner.set_errors},
      {"storage_topology_refreshes", inner.topology_refreshes},
      {"storage_capacity_shrinks", inner.capacity_shrinks},
      {"storage_evictions", inner.evictions},
      {"corruptions_injected", corrupt_injected},
      {"corruptions_detected", detected},
      {"corruptions_not_read", std::max<std::int64_t>(0, corrupt_injected - detected)},
      // Every page served is verified, so a corruption that got past the store's checks shows
      // as a wrong page: the two figures are one count.
      {"corruptions_undetected", wrong},
      {"wrong_pages_served", wrong},
      {"device_slots_leaked", device_leak},
      {"host_slots_leaked", host_leak},
      {"tree_consistent", invariants.empty()},
      {"drained", drained},
      {"l3_alive_after_faults", l3_alive},
      {"l3_probe_attempts", probe_attempts},
      {"pools_clean_after_probe", clean_after_probe},
      {"requests_rejected", es.rejected},
      {"resets", cs.resets},
      {"pass", pass}};
  if (ctl.sidecar_bytes_written > 0) {  // a hybrid model: its state's own figures
    table["sidecar_bytes_l1_to_l2"] = ctl.sidecar_bytes_written;
    table["sidecar_bytes_l2_to_l1"] = ctl.sidecar_bytes_loaded;
    table["sidecar_bytes_l2_to_l3"] = sc ? sc->sidecar_written_bytes() : 0;
    table["sidecar_bytes_l3_to_l2"] = sc ? sc->sidecar_read_bytes() : 0;
    table["sidecar_pages_verified"] = es.verified_sidecar_pages;
  }
  if (me.instances > 1) {
    table["instance"] = me.instance;
    // Null where this process cannot tell (an MLA rank other than 0).
    table["cross_instance_l3_pages"] =
        counts_cross_instance ? nlohmann::json(inject->foreign_reads()) : nlohmann::json();
  }
  if (tp) {
    table["tp_rank"] = me.rank;
    table["tp_size"] = me.size;
    table["tree_checks"] = tree_checks;
    table["tree_divergences"] = tree_divergences;
    table["tp_failure"] = tp_failure;
    table["tp_main_collectives"] = main_group->calls();
  }
  if (!me.result_file.empty()) {
    std::ofstream out(me.result_file);
    out << nlohmann::json{{"table", table}, {"final_tree", final_tree}}.dump() << "\n";
    std::fflush(stdout);
    return pass && out ? 0 : 1;
  }
  std::printf("\nhicache-stress, %s store, %s, %s I/O, seed %llu, faults:", s.storage.c_str(),
              stack.device().name().c_str(),
              std::string(to_string(config.cache.controller.io_backend)).c_str(),
              static_cast<unsigned long long>(s.seed));
  for (const auto& f : s.faults) std::printf(" %s", f.c_str());
  std::printf("\n");
  for (const auto& [k, v] : table.items()) {
    if (k == "faults") {
      for (const auto& [fk, fv] : v.items()) std::printf("  fault %-30s %s\n", fk.c_str(), fv.dump().c_str());
    } else {
      std::printf("  %-36s %s\n", k.c_str(), v.dump().c_str());
    }
  }
  if (!invariants.empty()) std::printf("  tree problem: %s\n", invariants.c_str());
  if (wrong > 0) std::printf("  first wrong page: %s\n", engine.first_mismatch().c_str());
  if (!s.report.empty()) {
    std::ofstream(s.report) << table.dump(2) << "\n";
  }
  std::printf("[hicache-stress] %s\n", pass ? "PASS" : "FAIL");
  return pass ? 0 : 1;
}

// The run: the store, then one rank here, or (--tp, --instances) a process per rank of each
// instance, forked before any thread exists, whose tables and final trees are compared here.
int run(const Settings& s) {
  Store store;
  if (!setup_store(s, store)) return 1;
  if (s.tp <= 1 && s.instances <= 1) return run_rank(s, store, Rank{});
  char tmpl[] = "/tmp/hicache-stress-tp-XXXXXX";
  if (::mkdtemp(tmpl) == nullptr) throw std::runtime_error(str_cat("mkdtemp: ", std::strerror(errno)));
  const std::string dir = tmpl;
  struct RemoveDir {
    const std::string& dir;
    ~RemoveDir() {
      std::error_code ec;
      fs::remove_all(dir, ec);
    }
  } remove_dir{dir};
  // Process p is instance p / tp, rank p % tp.
  const int processes = s.instances * s.tp;
  auto result_file = [&](int p) { return str_cat(dir, "/process-", p, ".json"); };
  std::vector<pid_t> children;
  // A process never outlives the run: one that failed to start takes the started ones down
  // (they would wait for it at the rendezvous), and a process dies with the parent.
  struct Reap {
    std::vector<pid_t>& children;
    bool armed = true;
    ~Reap() {
      if (!armed) return;
      for (pid_t pid : children) ::kill(pid, SIGKILL);
      for (pid_t pid : children) {
        while (::waitpid(pid, nullptr, 0) < 0 && errno == EINTR) {
        }
      }
    }
  } reap{children};
  const pid_t parent = ::getpid();
  for (int p = 0; p < processes; ++p) {
    const int instance = p / s.tp, r = p % s.tp;
    std::fflush(stdout);
    std::fflush(stderr);
    const pid_t pid = ::fork();
    if (pid < 0) throw std::runtime_error(str_cat("fork: ", std::strerror(errno)));
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) std::_Exit(1);  // the parent died before the line above
      int code = 1;
      try {
        code = run_rank(s, store,
                        Rank{r, s.tp, str_cat(dir, "/instance-", instance, "-gloo"),
                             result_file(p), instance, s.instances});
      } catch (const std::exception& e) {
        std::fprintf(stderr, "hicache-stress: instance %d rank %d: %s\n", instance, r, e.what());
      }
      std::fflush(stdout);
      std::fflush(stderr);
      std::_Exit(code);  // the parent's store and directory are the parent's to remove
    }
    children.push_back(pid);
  }
  bool pass = true;
  for (pid_t pid : children) {
    int status = 0;
    pid_t got = -1;
    while ((got = ::waitpid(pid, &status, 0)) < 0 && errno == EINTR) {
    }
    pass = pass && got == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  reap.armed = false;
  std::vector<nlohmann::json> results(static_cast<std::size_t>(processes));
  bool all_results = true;
  for (int p = 0; p < processes; ++p) {
    std::ifstream in(result_file(p));
    try {
      in >> results[static_cast<std::size_t>(p)];
    } catch (const std::exception&) {
      std::fprintf(stderr, "hicache-stress: instance %d rank %d left no result\n", p / s.tp,
                   p % s.tp);
      all_results = false;
    }
  }
  pass = pass && all_results;
  // Within an instance: the ranks' final trees are one tree, and (MLA: the ranks hold the same
  // KV under one namespace) rank 0 alone backed up.
  const bool mla = s.cache["model"].value("attention", "mha") == "mla";
  bool trees_identical = all_results, backups_by_rank_0_only = true;
  std::int64_t cross_instance_pages = 0;
  for (int p = 0; p < processes && all_results; ++p) {
    const nlohmann::json& j = results[static_cast<std::size_t>(p)];
    const nlohmann::json& first = results[static_cast<std::size_t>(p / s.tp * s.tp)];
    trees_identical = trees_identical && j["final_tree"] == first["final_tree"];
    if (mla && p % s.tp != 0 && j["table"]["pages_l2_to_l3"].get<double>() != 0) {
      backups_by_rank_0_only = false;
    }
    const auto& cross = j["table"].value("cross_instance_l3_pages", nlohmann::json());
    if (cross.is_number()) cross_instance_pages += cross.get<std::int64_t>();
  }
  pass = pass && trees_identical && backups_by_rank_0_only;
  std::printf("\nhicache-stress, %s store, %d instance(s) of %d TP rank(s)%s, seed %llu, faults:",
              s.storage.c_str(), s.instances, s.tp, s.tp > 1 ? " over Gloo" : "",
              static_cast<unsigned long long>(s.seed));
  for (const auto& f : s.faults) std::printf(" %s", f.c_str());
  std::printf("\n");
  if (all_results) {
    // One row per figure, one column per process.
    for (const auto& [k, v] : results[0]["table"].items()) {
      if (k == "faults") {
        for (const auto& [fk, fv] : v.items()) {
          std::printf("  fault %-30s", fk.c_str());
          for (const auto& j : results) std::printf(" %12s", j["table"]["faults"].value(fk, nlohmann::json(0)).dump().c_str());
          std::printf("\n");
        }
        continue;
      }
      std::printf("  %-36s", k.c_str());
      for (const auto& j : results) std::printf(" %12s", j["table"][k].dump().c_str());
      std::printf("\n");
    }
  }
  if (s.tp > 1) {
    std::printf("  %-36s %s\n", "final_trees_identical", trees_identical ? "true" : "false");
  }
  if (mla && s.tp > 1) {
    std::printf("  %-36s %s\n", "mla_backups_by_rank_0_only",
                backups_by_rank_0_only ? "true" : "false");
  }
  if (s.instances > 1) {
    std::printf("  %-36s %lld\n", "cross_instance_l3_pages_total",
                static_cast<long long>(cross_instance_pages));
  }
  if (!trees_identical && all_results) {
    for (int p = 0; p < processes; ++p) {
      std::printf("  instance %d rank %d's tree:\n%s\n", p / s.tp, p % s.tp,
                  results[static_cast<std::size_t>(p)]["final_tree"].get<std::string>().c_str());
    }
  }
  if (!s.report.empty()) {
    nlohmann::json all = nlohmann::json::array();
    for (const auto& j : results) all.push_back(j.is_object() ? j["table"] : nlohmann::json());
    nlohmann::json report{
        {"ranks", all}, {"final_trees_identical", trees_identical}, {"pass", pass}};
    if (mla && s.tp > 1) report["mla_backups_by_rank_0_only"] = backups_by_rank_0_only;
    if (s.instances > 1) {
      report["instances"] = s.instances;
      report["cross_instance_l3_pages"] = cross_instance_pages;
    }
    std::ofstream(s.report) << report.dump(2) << "\n";
  }
  std::printf("[hicache-stress] %s\n", pass ? "PASS" : "FAIL");
  return pass ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const Settings settings = parse(argc, argv);
  try {
    return run(settings);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hicache-stress: FAIL: %s\n", e.what());
    return 1;
  }
}
