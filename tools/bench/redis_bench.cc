// hicache-redisbench: RedisStorage batch_set / batch_get against redis-benchmark SET / GET on the
// same server, with the same value size, connection count and pipeline depth (issue target:
// ratio >= 0.8), on one server and on a 3-node cluster, for 8 MiB and 256 KiB pages.
//
// It starts its own servers (redis-server with MALLOC_CONF=thp:always on free loopback ports;
// the cluster formed by redis-cli --cluster create) and skips, saying why, when redis-server,
// redis-cli or redis-benchmark is missing.
//
// Shapes (PAGE_KIB:PAGES_PER_BATCH:CONNECTIONS): a batch is `pages` pages; RedisStorage splits a
// node's share of a batch over its `connections` connections, so each connection carries about
// pages / (nodes * connections) requests pipelined. redis-benchmark runs with -c connections and
// -P that depth (rounded, at least 1), one process per node. The defaults use RedisStorage's
// default 4 connections: 8 MiB x 16 (depth 4; 1 on the cluster), 256 KiB x 256 (depth 64; 21)
// and 256 KiB x 16 (depth 4; 1), the last being where redis-benchmark itself is at its best.
// Each timed run moves --mib MiB (default 256) of payload: batches = that / batch bytes.
//
// Paired rounds (figures on these machines drift 2-4x within a minute): each round runs
// redis-benchmark SET then GET, and RedisStorage batch_set then batch_get, alternating which pair
// goes first. The servers' state between runs is set by --servers:
//   full (the default): every server is capped (maxmemory, allkeys-lru) and filled to the cap
//        before the first timed run, and never flushed: each SET of a new key evicts an old one
//        and reuses its memory, as in a cache at capacity, which an L3 shared by many engines is
//        after its first hours. Both clients write into the same steady state. GET runs get
//        headroom above the cap (see ServerRegime::prepare).
//   warm: emptied between runs with FLUSHALL ASYNC. jemalloc keeps the freed memory only until
//        its decay (about 10 s) hands it back to the kernel, so how much a run faults in again
//        depends on how long the previous run and the flush took: on these VMs, where a fault
//        costs the server more than the SET, single rounds of either client swung 0.6-4.6 GB/s.
//   cold: emptied with FLUSHALL (SYNC), which purges at once: every run faults in fresh pages.
// A fault here costs more than on bare metal: memory the guest hands back is taken back by the
// host, and its next first touch faults twice (server CPU 1.5-3 s per GiB of 256 KiB SETs in
// such runs, against 0.22-0.3 at capacity).
//
//   ours SET: `batches` batches of fresh keys (nothing deduplicated), each batch timed; no flush
//             in the middle of a run, as redis-benchmark's SET run has none;
//   ours GET: one batch's keys, written untimed, read back `batches` times (every page verified
//             once per round);
//   redis-benchmark SET: -t set -d <page bytes> -r 1e9 -n <pages * batches / nodes> (new keys,
//             like ours; on a cluster node the same SET with a hash tag of that node, value -x);
//   redis-benchmark GET: -r <pages per node>, a keyspace populated first (one batch's worth, as
//             ours reads); the hit rate is read from INFO stats and only hits count as bytes.
// The ratio printed is the median of the per-round ratios (ours / redis-benchmark).
//
// Usage: hicache-redisbench [--rounds N] [--mib MIB_PER_RUN] [--single] [--cluster]
//                           [--io-threads N] [--zero-copy-min-bytes N] [--servers full|warm|cold]
//                           [--shape PAGE_KIB:PAGES_PER_BATCH:CONNECTIONS]...
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "pools/kv_pattern.h"
#include "tools/support/redis_launcher.h"
#include "storage/redis_storage.h"
#include "transfer/errors.h"
#include "transfer/host_memory.h"

namespace {

using namespace hicache;
using namespace hicache::bench;
using Clock = std::chrono::steady_clock;

struct Shape {
  std::size_t page_bytes;
  std::size_t pages;
  int connections;
};

struct Options {
  int rounds = 3;
  std::size_t run_mib = 256;  // payload per timed run: batches = run_mib / batch size (at least 1)
  bool single = true;
  bool cluster = true;
  int io_threads = 0;                  // RedisStorage's: 0 is its default (one per 4 CPUs)
  std::string servers = "full";        // full | warm | cold: the servers' state between runs
  long long zero_copy_min_bytes = -1;  // RedisStorage's: -1 keeps its default
  std::vector<Shape> shapes;
};

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

std::string key_name(const std::string& prefix, std::size_t i) {
  char digits[24];
  std::snprintf(digits, sizeof digits, "%012zu", i);
  return prefix + digits;
}

// The node a deployment's redis-benchmark drives, with the key prefix its commands use.
struct Target {
  int port;
  std::string prefix;  // "key:" (redis-benchmark -t set/get) or "k{TAG}:" on a cluster node
};

// A hash tag whose slot the node at `port` owns (its GET is answered, not MOVED).
std::string owned_tag(int port) {
  RespClient c(port);
  for (int t = 0; t < 10000; ++t) {
    const std::string key = str_cat("{", t, "}probe");
    const std::string reply = c.command({"GET", key});
    if (!reply.empty() && reply.rfind("-MOVED", 0) != 0 && reply[0] != '-') {
      return std::to_string(t);
    }
  }
  return {};
}

std::uint64_t info_field(const std::string& info, const std::string& field) {
  const auto at = info.find(field + ":");
  return at == std::string::npos ? 0
                                 : std::strtoull(info.c_str() + at + field.size() + 1, nullptr, 10);
}

// The servers' state between runs (see --servers above).
class ServerRegime {
 public:
  ServerRegime(std::vector<int> ports, std::string mode)
      : ports_(std::move(ports)), mode_(std::move(mode)) {}

  // Full: caps every server at `cap_bytes` per node (allkeys-lru) and writes page-sized values
  // under each target's prefix until it evicts, i.e. is at its cap. Warm and cold: empties the
  // servers. False with *error.
  bool prepare(const std::vector<std::string>& prefixes, std::size_t page_bytes,
               std::size_t cap_bytes, std::size_t read_headroom, std::string* error) {
    cap_ = cap_bytes;
    read_headroom_ = read_headroom;
    if (mode_ != "full") {
      empty();
      return true;
    }
    const std::string value(page_bytes, 'f');
    for (std::size_t n = 0; n < ports_.size(); ++n) {
      RespClient c(ports_[n]);
      if (!set_config(c, "maxmemory-policy", "allkeys-lru", error) ||
          !set_config(c, "maxmemory", std::to_string(cap_), error)) {
        return false;
      }
      c.command({"CONFIG", "RESETSTAT"});
      for (std::size_t i = 0; info_field(c.command({"INFO", "stats"}), "evicted_keys") == 0;) {
        for (const std::size_t end = i + 8; i < end; ++i) {
          if (const auto r = c.command({"SET", key_name(prefixes[n] + "fill:", i), value});
              r != "+OK") {
            *error = str_cat("filling port ", ports_[n], ": ", r);
            return false;
          }
        }
      }
    }
    return true;
  }

  // Before a GET run. Full: each server's cap becomes what it holds plus `read_headroom`, so
  // nothing is evicted while the GET keys are written and read. At the cap, a GET's reply, which
  // waits in the client's output buffer and counts against maxmemory, evicted keys, and the LRU
  // clock (one tick a second) cannot tell the keys being read from the rest of the run.
  bool before_read(std::string* error) {
    if (mode_ != "full") return true;
    for (int p : ports_) {
      RespClient c(p);
      const std::uint64_t used = info_field(c.command({"INFO", "memory"}), "used_memory");
      if (!set_config(c, "maxmemory",
                      std::to_string(std::max<std::uint64_t>(used, cap_) + read_headroom_),
                      error)) {
        return false;
      }
    }
    return true;
  }

  // After a SET + GET pair of one client. Full: the cap again (the next SET run evicts down to
  // it). Warm: FLUSHALL ASYNC, then wait until the lazy-free thread has freed it all. Cold:
  // FLUSHALL (SYNC), after which redis-server has jemalloc hand its pages back to the kernel.
  bool after_runs(std::string* error) {
    if (mode_ == "full") return cap_all(cap_, error);
    empty();
    return true;
  }

  const char* describe() const {
    return mode_ == "full"   ? "full (capped, evicting, never flushed)"
           : mode_ == "warm" ? "flushed warm (FLUSHALL ASYNC) between runs"
                             : "flushed cold (FLUSHALL SYNC) between runs";
  }

 private:
  static bool set_config(RespClient& c, std::string_view key, const std::string& value,
                         std::string* error) {
    if (const auto r = c.command({"CONFIG", "SET", key, value}); r != "+OK") {
      *error = str_cat("CONFIG SET ", key, " ", value, ": ", r);
      return false;
    }
    return true;
  }

  bool cap_all(std::size_t bytes, std::string* error) {
    if (mode_ != "full") return true;
    for (int p : ports_) {
      RespClient c(p);
      if (!set_config(c, "maxmemory", std::to_string(bytes), error)) return false;
    }
    return true;
  }

  void empty() {
    const bool cold = mode_ == "cold";
    for (int p : ports_) {
      RespClient c(p);
      c.command({"FLUSHALL", cold ? "SYNC" : "ASYNC"});
      while (!cold && info_field(c.command({"INFO", "memory"}), "lazyfree_pending_objects") != 0) {
      }
    }
  }

  std::vector<int> ports_;
  std::string mode_;
  std::size_t cap_ = 0, read_headroom_ = 0;
};

// Where a run's CPU went: the client's (this process for ours; the reaped redis-benchmark
// processes for the baseline, their start-up included), the servers' (/proc/PID/stat), and the
// share of both CPUs idle (/proc/stat). Linux only; zeros where a file cannot be read.
class CpuMeter {
 public:
  explicit CpuMeter(const std::vector<int>& ports) {
    for (int p : ports) {
      pids_.push_back(
          static_cast<int>(info_field(RespClient(p).command({"INFO", "server"}), "process_id")));
    }
  }

  struct Sample {
    double busy = 0, total = 0;  // jiffies of all CPUs
    double servers_s = 0, self_s = 0, children_s = 0;
  };

  Sample take() const {
    Sample out;
    std::ifstream stat("/proc/stat");
    std::string cpu;
    stat >> cpu;
    double v = 0;
    for (int i = 0; i < 8 && stat >> v; ++i) {
      out.total += v;
      if (i != 3 && i != 4) out.busy += v;  // idle and iowait
    }
    const double tick = static_cast<double>(::sysconf(_SC_CLK_TCK));
    for (int pid : pids_) {
      std::ifstream f(str_cat("/proc/", pid, "/stat"));
      std::string line;
      std::getline(f, line);
      const auto close = line.rfind(')');
      if (close == std::string::npos) continue;
      std::istringstream fields(line.substr(close + 2));
      std::string skip;
      for (int i = 0; i < 11; ++i) fields >> skip;  // state .. cmajflt
      double utime = 0, stime = 0;
      fields >> utime >> stime;
      out.servers_s += (utime + stime) / tick;
    }
    out.self_s = rusage_seconds(RUSAGE_SELF);
    out.children_s = rusage_seconds(RUSAGE_CHILDREN);
    return out;
  }

  // "client+servers s/GiB idle%" of the run between two samples that moved `bytes`.
  static std::string describe(const Sample& a, const Sample& b, bool baseline, double bytes) {
    const double gib = bytes / static_cast<double>(1ull << 30);
    const double client = baseline ? b.children_s - a.children_s : b.self_s - a.self_s;
    const double total = b.total - a.total;
    const double idle = total > 0 ? 100.0 * (1.0 - (b.busy - a.busy) / total) : 0;
    char out[64];
    std::snprintf(out, sizeof out, "%.2f+%.2f %.0f%%", client / gib,
                  (b.servers_s - a.servers_s) / gib, idle);
    return out;
  }

 private:
  static double rusage_seconds(int who) {
    rusage r{};
    ::getrusage(who, &r);
    return static_cast<double>(r.ru_utime.tv_sec + r.ru_stime.tv_sec) +
           static_cast<double>(r.ru_utime.tv_usec + r.ru_stime.tv_usec) / 1e6;
  }

  std::vector<int> pids_;
};

// redis-benchmark for one op against every target at once (one process per node).
class Baseline {
 public:
  // SETs draw keys from this many: practically every SET stores a new key, as ours do (a SET
  // that overwrites a key lets the server reuse the old value's memory, and new memory costs the
  // server page faults).
  static constexpr std::size_t kFreshKeyspace = 1'000'000'000;

  Baseline(std::string binary, std::vector<Target> targets, bool cluster, const Shape& s,
           int batches, std::string value_file)
      : binary_(std::move(binary)),
        targets_(std::move(targets)),
        cluster_(cluster),
        shape_(s),
        value_file_(std::move(value_file)) {
    const std::size_t nodes = targets_.size();
    depth_ =
        std::max<std::size_t>(1, (s.pages + nodes * static_cast<std::size_t>(s.connections) / 2) /
                                     (nodes * static_cast<std::size_t>(s.connections)));
    keyspace_ = (s.pages + nodes - 1) / nodes;
    const std::size_t unit = depth_ * static_cast<std::size_t>(s.connections);
    requests_ = (s.pages * static_cast<std::size_t>(batches) / nodes + unit - 1) / unit * unit;
  }

  std::vector<std::string> argv(const Target& t, bool set) const {
    std::vector<std::string> a = {binary_,
                                  "-h",
                                  "127.0.0.1",
                                  "-p",
                                  std::to_string(t.port),
                                  "-c",
                                  std::to_string(shape_.connections),
                                  "-P",
                                  std::to_string(depth_),
                                  "-n",
                                  std::to_string(requests_),
                                  "-r",
                                  std::to_string(set ? kFreshKeyspace : keyspace_),
                                  "--csv"};
    if (!cluster_) {
      a.insert(a.end(), {"-t", set ? "set" : "get", "-d", std::to_string(shape_.page_bytes)});
    } else if (set) {
      a.insert(a.end(), {"-x", "SET", t.prefix + "__rand_int__"});
    } else {
      a.insert(a.end(), {"GET", t.prefix + "__rand_int__"});
    }
    return a;
  }

  std::string describe(bool set) const {
    std::string out;
    for (const auto& w : argv(targets_[0], set)) out += (out.empty() ? "" : " ") + w;
    if (cluster_ && set) out += str_cat(" < <", shape_.page_bytes, " bytes of x>");
    if (cluster_) out += "  (one per node, at once)";
    return out;
  }

  // Makes every key of the keyspace hold a page-sized value (for GET).
  void populate() const {
    const std::string value(shape_.page_bytes, 'x');
    for (const Target& t : targets_) {
      RespClient c(t.port);
      for (std::size_t i = 0; i < keyspace_; ++i) {
        const std::string key = key_name(t.prefix, i);
        if (c.command({"STRLEN", key}) != str_cat(":", shape_.page_bytes)) {
          c.command({"SET", key, value});
        }
      }
    }
  }

  // Payload MB/s over all nodes (for GET only hits count), or nullopt with *error. The processes
  // start together; each reports its own rate, so the aggregate is all their requests over the
  // window they ran in (a sum of rates would overstate when one finishes early).
  // Before a GET run (untimed): the keyspace populated, the servers' hit counters reset.
  void prepare_get() const {
    populate();
    for (const Target& t : targets_) RespClient(t.port).command({"CONFIG", "RESETSTAT"});
  }

  // Payload bytes of one run (GET: before the hit rate).
  double bytes() const {
    return static_cast<double>(requests_ * targets_.size() * shape_.page_bytes);
  }

  // REQUIRES for a GET run: prepare_get() just before.
  std::optional<double> run(bool set, std::string* error, double* hit_rate) const {
    std::vector<std::unique_ptr<SpawnedOutput>> procs;
    for (const Target& t : targets_) {
      procs.push_back(std::make_unique<SpawnedOutput>(argv(t, set),
                                                      cluster_ && set ? value_file_ : "/dev/null"));
    }
    // Each process is reaped by its own thread, so its exit time is taken when it exits.
    std::vector<std::string> outs(procs.size());
    std::vector<int> statuses(procs.size(), 0);
    std::vector<Clock::time_point> exits(procs.size());
    {
      std::vector<std::thread> reapers;
      for (std::size_t i = 0; i < procs.size(); ++i) {
        reapers.emplace_back([&, i] {
          outs[i] = procs[i]->wait(&statuses[i]);
          exits[i] = Clock::now();
        });
      }
      for (auto& t : reapers) t.join();
    }
    double longest_s = 0;
    Clock::time_point first_start = Clock::time_point::max(), last_exit{};
    for (std::size_t i = 0; i < procs.size(); ++i) {
      const int status = statuses[i];
      const std::string& out = outs[i];
      // Last line: "TEST","rps",...
      auto end = out.find_last_not_of("\r\n");
      const auto start = out.rfind('\n', end == std::string::npos ? 0 : end);
      const std::string line = out.substr(start == std::string::npos ? 0 : start + 1);
      const auto sep = line.find("\",\"");
      if (status != 0 || sep == std::string::npos) {
        *error = str_cat("redis-benchmark failed (status ", status, "): ", out.substr(0, 300));
        return std::nullopt;
      }
      const double rps = std::strtod(line.c_str() + sep + 3, nullptr);
      if (rps <= 0) {
        *error = str_cat("redis-benchmark reported no rate: ", line);
        return std::nullopt;
      }
      const double own_s = static_cast<double>(requests_) / rps;
      longest_s = std::max(longest_s, own_s);
      first_start = std::min(first_start, exits[i] - std::chrono::duration_cast<Clock::duration>(
                                                         std::chrono::duration<double>(own_s)));
      last_exit = std::max(last_exit, exits[i]);
    }
    // The processes start one after another and run at slightly different times: their
    // requests all ran within [the earliest start, the last exit], which is what the aggregate
    // rate is over (the longest single run's time overstated it by 0-8% here). A process's
    // start is its exit less its own time (its teardown shifts both ends alike).
    const double window_s =
        std::max(longest_s, std::chrono::duration<double>(last_exit - first_start).count());
    double fraction = 1;
    if (!set) {
      std::uint64_t hits = 0, misses = 0;
      for (const Target& t : targets_) {
        const std::string info = RespClient(t.port).command({"INFO", "stats"});
        hits += info_field(info, "keyspace_hits");
        misses += info_field(info, "keyspace_misses");
      }
      fraction =
          hits + misses == 0 ? 0 : static_cast<double>(hits) / static_cast<double>(hits + misses);
    }
    if (hit_rate != nullptr) *hit_rate = fraction;
    const double requests = static_cast<double>(requests_ * targets_.size());
    return requests / window_s * fraction * static_cast<double>(shape_.page_bytes) / 1e6;
  }

  std::size_t depth() const { return depth_; }

 private:
  std::string binary_;
  std::vector<Target> targets_;
  bool cluster_;
  Shape shape_;
  std::string value_file_;
  std::size_t depth_ = 1, keyspace_ = 1, requests_ = 1;
};

// RedisStorage over a batch of pages: src pattern-filled, dst separate (verified).
class Ours {
 public:
  Ours(const std::vector<int>& ports, bool cluster, const Shape& s, int batches, int io_threads,
       long long zero_copy_min_bytes)
      : shape_(s),
        batches_(batches),
        src_(map_host_memory(s.pages * s.page_bytes)),
        dst_(map_host_memory(s.pages * s.page_bytes)) {
    RedisConfig cfg;
    cfg.nodes.clear();
    for (int p : ports) cfg.nodes.push_back({"127.0.0.1", static_cast<std::uint16_t>(p)});
    cfg.cluster = cluster;
    cfg.connections = s.connections;
    cfg.timeout = std::chrono::milliseconds(20000);
    cfg.io_threads = io_threads;
    if (zero_copy_min_bytes >= 0) {
      cfg.zero_copy_min_bytes = static_cast<std::uint64_t>(zero_copy_min_bytes);
    }
    store_ = std::make_unique<RedisStorage>(cfg);
    auto* sbase = static_cast<std::byte*>(src_.data());
    auto* dbase = static_cast<std::byte*>(dst_.data());
    for (std::size_t i = 0; i < s.pages; ++i) {
      ByteSpan page(sbase + i * s.page_bytes, s.page_bytes);
      fill_pattern(page, i, 0, 0);
      src_spans_.emplace_back(page);
      dst_spans_.emplace_back(dbase + i * s.page_bytes, s.page_bytes);
    }
  }

  // batch_set of `batches` batches of fresh keys, all held afterwards (the same bytes as a
  // redis-benchmark SET run leaves: a flush in the middle would hand ours the memory the first
  // half freed while redis-benchmark's second half faults in new pages). Returns payload MB/s.
  std::optional<double> set(int round, std::string* error) {
    const auto written_before = store_->stats().set_written;
    double t = 0;
    for (int b = 0; b < batches_; ++b) {
      keys_.clear();
      for (std::size_t i = 0; i < shape_.pages; ++i)
        keys_.push_back(str_cat(prefix_, round, "-", b, "-", i));
      const auto t0 = Clock::now();
      const auto results = store_->batch_set(keys_, src_spans_);
      t += seconds_since(t0);
      for (const auto& r : results) {
        if (!r.is_ok()) {
          *error = str_cat("batch_set: ", r.reason);
          return std::nullopt;
        }
      }
    }
    const auto written = store_->stats().set_written;
    if (written - written_before != shape_.pages * static_cast<std::size_t>(batches_)) {
      *error = "batch_set deduplicated a fresh key";
      return std::nullopt;
    }
    return bytes() / t / 1e6;
  }

  // batch_get of one batch's keys `batches` times; every page verified after the first read.
  // prepare_get (re)writes the keys first, untimed: a full server may have evicted any key of the
  // SET run (its LRU clock ticks once a second, so keys of the same second look alike).
  bool prepare_get(std::string* error) {
    keys_.clear();
    for (std::size_t i = 0; i < shape_.pages; ++i) keys_.push_back(str_cat(prefix_, "get-", i));
    for (const auto& r : store_->batch_set(keys_, src_spans_)) {
      if (!r.is_ok()) {
        *error = str_cat("batch_set of the GET keys: ", r.reason);
        return false;
      }
    }
    return true;
  }

  // REQUIRES: prepare_get() just before.
  std::optional<double> get(std::string* error) {
    std::memset(dst_.data(), 0, shape_.pages * shape_.page_bytes);
    double t = 0;
    for (int b = 0; b < batches_; ++b) {
      const auto t0 = Clock::now();
      const auto results = store_->batch_get(keys_, dst_spans_);
      t += seconds_since(t0);
      for (const auto& r : results) {
        if (!r.is_ok()) {
          *error = str_cat("batch_get: ", to_string(r.status), " ", r.reason);
          return std::nullopt;
        }
      }
      if (b == 0) {
        for (std::size_t i = 0; i < shape_.pages; ++i) {
          if (find_pattern_mismatch(dst_spans_[i], i, 0, 0) >= 0) {
            *error = str_cat("batch_get: page ", i, " differs from what was stored");
            return std::nullopt;
          }
        }
      }
    }
    return bytes() / t / 1e6;
  }

  void clear() { store_->clear(); }
  int io_threads() const { return store_->config().io_threads; }
  // Payload bytes of one run.
  double bytes() const { return static_cast<double>(shape_.pages * shape_.page_bytes) * batches_; }

 private:
  Shape shape_;
  int batches_;
  Buffer src_, dst_;
  std::vector<ConstByteSpan> src_spans_;
  std::vector<ByteSpan> dst_spans_;
  std::vector<std::string> keys_;
  std::unique_ptr<RedisStorage> store_;
  // Keys of this instance: fresh for every shape, since full servers keep earlier runs' keys.
  inline static int instances_ = 0;
  std::string prefix_ = str_cat("o", instances_++, "p");
};

// Runs every shape on one deployment; false on a failure (printed).
bool bench_deployment(const char* label, const std::vector<int>& ports, bool cluster,
                      const Options& opt, const std::string& benchmark_bin,
                      const std::string& tmpdir) {
  std::vector<Target> targets;
  for (int p : ports) {
    if (!cluster) {
      targets.push_back({p, "key:"});
      continue;
    }
    const std::string tag = owned_tag(p);
    if (tag.empty()) {
      std::printf("%s: no hash tag found for node %d\n", label, p);
      return false;
    }
    targets.push_back({p, str_cat("k{", tag, "}:")});
  }
  for (const Shape& s : opt.shapes) {
    const std::string value_file = str_cat(tmpdir, "/value-", s.page_bytes);
    if (cluster) {
      std::ofstream(value_file, std::ios::binary) << std::string(s.page_bytes, 'x');
    }
    const int batches =
        static_cast<int>(std::max<std::size_t>(1, (opt.run_mib << 20) / (s.pages * s.page_bytes)));
    Baseline base(benchmark_bin, targets, cluster, s, batches, value_file);
    Ours ours(ports, cluster, s, batches, opt.io_threads, opt.zero_copy_min_bytes);
    std::printf(
        "\n%s, %zu KiB pages, %zu per batch, %d batches per run, %d connections per node, "
        "pipeline depth %zu per connection, RedisStorage io_threads %d\n  %s\n  %s\n",
        label, s.page_bytes >> 10, s.pages, batches, s.connections, base.depth(), ours.io_threads(),
        base.describe(true).c_str(), base.describe(false).c_str());
    std::fflush(stdout);
    // Full servers hold three batches' share per node at least, and 256 MiB. Reads get four
    // shares of headroom: the GET keys written (a share, in jemalloc's size classes up to 1.25
    // of it) and the replies waiting in output buffers (at most as much).
    const std::size_t share = s.pages * s.page_bytes / targets.size();
    const std::size_t cap = std::max<std::size_t>(256 << 20, 3 * share);
    std::vector<std::string> prefixes;
    for (const Target& t : targets) prefixes.push_back(t.prefix);
    ServerRegime servers(ports, opt.servers);
    if (std::string error; !servers.prepare(prefixes, s.page_bytes, cap, 4 * share, &error)) {
      std::printf("%s: %s\n", label, error.c_str());
      return false;
    }
    if (opt.servers == "full") {
      std::printf("  servers capped at %zu MiB each (allkeys-lru; %zu MiB more while reading)\n",
                  cap >> 20, (4 * share) >> 20);
    }
    const CpuMeter meter(ports);
    std::map<std::string, std::vector<double>> ours_mb, base_mb, ratio;
    std::vector<double> hit_rates;
    for (int round = 0; round < opt.rounds; ++round) {
      std::string error;
      std::optional<double> os, og, bs, bg;
      double hits = 0;
      std::string cpu_ours[2], cpu_base[2];  // SET, GET: CpuMeter::describe
      for (int half = 0; half < 2; ++half) {
        const bool baseline = (half + round) % 2 == 0;
        auto& set_mb = baseline ? bs : os;
        auto& get_mb = baseline ? bg : og;
        const double bytes = baseline ? base.bytes() : ours.bytes();
        auto s0 = meter.take();
        set_mb = baseline ? base.run(true, &error, nullptr) : ours.set(round, &error);
        (baseline ? cpu_base : cpu_ours)[0] = CpuMeter::describe(s0, meter.take(), baseline, bytes);
        if (set_mb && servers.before_read(&error) &&
            (baseline ? (base.prepare_get(), true) : ours.prepare_get(&error))) {
          s0 = meter.take();
          get_mb = baseline ? base.run(false, &error, &hits) : ours.get(&error);
          (baseline ? cpu_base : cpu_ours)[1] =
              CpuMeter::describe(s0, meter.take(), baseline, bytes);
        }
        if (error.empty()) servers.after_runs(&error);
        if (!error.empty()) break;
      }
      if (!error.empty()) {
        std::printf("  round %d failed: %s\n", round, error.c_str());
        return false;
      }
      std::printf(
          "  round %d: SET ours %.0f MB/s, redis-benchmark %.0f MB/s (%.2f); GET ours "
          "%.0f MB/s, redis-benchmark %.0f MB/s (%.2f, hit rate %.3f)\n",
          round, *os, *bs, *os / *bs, *og, *bg, *og / *bg, hits);
      std::printf(
          "    CPU s/GiB client+servers, CPUs idle: SET ours %s, redis-benchmark %s; GET ours %s, "
          "redis-benchmark %s\n",
          cpu_ours[0].c_str(), cpu_base[0].c_str(), cpu_ours[1].c_str(), cpu_base[1].c_str());
      std::fflush(stdout);
      ours_mb["set"].push_back(*os);
      base_mb["set"].push_back(*bs);
      ratio["set"].push_back(*os / *bs);
      ours_mb["get"].push_back(*og);
      base_mb["get"].push_back(*bg);
      ratio["get"].push_back(*og / *bg);
    }
    for (const char* op : {"set", "get"}) {
      std::printf(
          "%s %zu KiB x %zu, %d conns, depth %zu: batch_%s %.0f MB/s, redis-benchmark %s "
          "%.0f MB/s, ratio %.2f (median of %d paired rounds; target >= 0.8)\n",
          label, s.page_bytes >> 10, s.pages, s.connections, base.depth(), op, median(ours_mb[op]),
          op[0] == 's' ? "SET" : "GET", median(base_mb[op]), median(ratio[op]), opt.rounds);
    }
    std::fflush(stdout);
    std::remove(value_file.c_str());
  }
  return true;
}

bool parse_args(int argc, char** argv, Options& opt) {
  bool which = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> const char* { return i + 1 < argc ? argv[++i] : nullptr; };
    if (a == "--rounds" || a == "--mib") {
      const char* v = next();
      if (v == nullptr || std::atoi(v) < 1) return false;
      if (a == "--rounds") {
        opt.rounds = std::atoi(v);
      } else {
        opt.run_mib = static_cast<std::size_t>(std::atoi(v));
      }
    } else if (a == "--io-threads") {
      const char* v = next();
      if (v == nullptr || std::atoi(v) < 0 || std::atoi(v) > 64) return false;
      opt.io_threads = std::atoi(v);
    } else if (a == "--zero-copy-min-bytes") {
      const char* v = next();
      if (v == nullptr || std::atoll(v) < 0) return false;
      opt.zero_copy_min_bytes = std::atoll(v);
    } else if (a == "--servers") {
      const char* v = next();
      if (v == nullptr || (std::strcmp(v, "full") != 0 && std::strcmp(v, "warm") != 0 &&
                           std::strcmp(v, "cold") != 0)) {
        return false;
      }
      opt.servers = v;
    } else if (a == "--single" || a == "--cluster") {
      if (!which) opt.single = opt.cluster = false;
      which = true;
      (a == "--single" ? opt.single : opt.cluster) = true;
    } else if (a == "--shape") {
      const char* v = next();
      unsigned long kib = 0, pages = 0;
      int conns = 0;
      if (v == nullptr || std::sscanf(v, "%lu:%lu:%d", &kib, &pages, &conns) != 3 || kib == 0 ||
          pages == 0 || conns < 1) {
        return false;
      }
      opt.shapes.push_back({kib << 10, pages, conns});
    } else {
      return false;
    }
  }
  if (opt.shapes.empty()) {
    opt.shapes = {{8 << 20, 16, 4}, {256 << 10, 256, 4}, {256 << 10, 16, 4}};
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  if (!parse_args(argc, argv, opt)) {
    std::fprintf(stderr,
                 "usage: %s [--rounds N (3)] [--mib MIB_PER_RUN (256)] [--single] [--cluster]\n"
                 "          [--io-threads N (0: RedisStorage's default)] [--zero-copy-min-bytes N "
                 "(RedisStorage's zero_copy_min_bytes; 0 copies every payload)]\n"
                 "          [--servers full|warm|cold (full: capped and evicting, the "
                 "default; warm: FLUSHALL ASYNC between runs; cold: FLUSHALL SYNC)]\n"
                 "          [--shape PAGE_KIB:PAGES_PER_BATCH:CONNECTIONS]... "
                 "(default 8192:16:4, 256:256:4 and 256:16:4)\n",
                 argv[0]);
    return 2;
  }
  const std::string server = find_binary("redis-server");
  const std::string benchmark_bin = find_binary("redis-benchmark");
  const std::string cli = find_binary("redis-cli");
  if (server.empty() || benchmark_bin.empty()) {
    std::printf(
        "SKIPPED: redis-server and redis-benchmark are needed (found: redis-server '%s', "
        "redis-benchmark '%s'); install redis-server / redis-tools\n",
        server.c_str(), benchmark_bin.c_str());
    return 0;
  }
  char tmpl[] = "/tmp/hicache-redisbench-XXXXXX";
  if (::mkdtemp(tmpl) == nullptr) {
    std::printf("mkdtemp failed\n");
    return 1;
  }
  const std::string tmpdir = tmpl;
  std::printf(
      "hicache-redisbench: %d paired rounds, %zu MiB per timed run, servers %s; "
      "ours = RedisStorage, payload MB/s (1 MB = 1e6 bytes)\n",
      opt.rounds, opt.run_mib, ServerRegime({}, opt.servers).describe());
  int rc = 0;
  try {
    if (opt.single) {
      RedisDeployment one;
      std::string error;
      if (!one.start(1, false, &error)) {
        std::printf("single node: cannot start redis-server: %s\n", error.c_str());
        rc = 1;
      } else if (!bench_deployment("single", one.ports(), false, opt, benchmark_bin, tmpdir)) {
        rc = 1;
      }
    }
    if (opt.cluster) {
      if (cli.empty()) {
        std::printf("\ncluster: SKIPPED: redis-cli is needed to form the cluster\n");
      } else {
        RedisDeployment three;
        std::string error;
        if (!three.start(3, true, &error)) {
          std::printf("cluster: cannot start a 3-node cluster: %s\n", error.c_str());
          rc = 1;
        } else if (!bench_deployment("cluster", three.ports(), true, opt, benchmark_bin, tmpdir)) {
          rc = 1;
        }
      }
    }
  } catch (const std::exception& e) {
    std::printf("error: %s\n", e.what());
    rc = 1;
  }
  std::remove(tmpdir.c_str());
  return rc;
}
