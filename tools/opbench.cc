// hicache-opbench: a fixed suite of controller operations on the host backend, one JSON object
// per line per workload: ops/s, pages/s, GB/s (bytes moved, each byte counted once per tier
// crossing), submit -> ack latency (p50/p99, nearest rank), a byte-for-byte check, whether every
// pool slot is free again, and a plain memcpy of the same bytes in the same run.
//
// Geometry: 32 layers x 8 KV heads x head dim 128, fp16, page 64 tokens (8 MiB pages), host
// layout layer_first, direct io; device pool 80 pages, host pool 160 pages (both pre-faulted at
// creation); write_through; prefetch threshold 256 tokens. The `_tiny` workloads use 1 layer x
// 1 head x head dim 8 (2 KiB pages): they measure the controller, not the copies.
//
//   write_pP    N ops of P pages, 4 in flight (closed loop, after 4 warm-up ops). On each ack
//               the driver evicts the device copy, then the host copy, and submits the next op.
//   load_pP     steps of 4 load ops of P pages: queue the 4, start_loading(), wait on every
//               layer in order, collect the 4 acks, evict the device copies (3 warm-up steps).
//   backup_pP / prefetch_pP   rounds through a FileStorage (one warm-up round): K ops of fresh
//               tokens with precomputed page keys are backed up, 4 in flight (every ack must
//               report all tokens); then the same K keys are prefetched R times each, 4 in flight,
//               into host pages the controller reserves; an op is done when all its bytes landed,
//               then it is terminated (which must report all tokens) and its pages freed. At the
//               end of a round the records are deleted. The two workloads share their rounds:
//               the backup phase is timed for backup_pP, the prefetch phase for prefetch_pP.
//
// What is verified, always outside the timed part (verified = all of it held):
//   - Page data derives from a key (pools/kv_pattern.h): device pages from (workload, device
//     page) for writes, host pages from (workload, host page) for loads, and from the page's
//     chained SHA-256 key for backup/prefetch.
//   - Writes: the device pool is filled before the warm-up; the host pool is zeroed between the
//     warm-up and the timed ops. The final window (the last 4 ops, which have no successor to
//     submit) is not evicted on its ack: once the clock has stopped, its host copies are checked
//     byte for byte against their device pages' keys, then evicted. The warm-up window is
//     checked the same way. Every ack must be ok, and the controller's counters must show
//     exactly the ops and bytes submitted. (With the allocator's LIFO reuse, a final-window op
//     that acked without copying anything would still find the bytes an earlier timed op copied
//     into the same pair of pages; everything short of that is caught.)
//   - Loads: steps run one after another and are timed one by one, so untimed work can sit
//     between them. The device pool is zeroed before the warm-up and before the last timed step;
//     the device copies of the warm-up steps and of the last step are checked after their acks,
//     outside the step's time, before they are evicted.
//   - Backup/prefetch: the source pages are filled before the round's clock starts; the host
//     pool is zeroed between the backup and the prefetch phase; every prefetched page of the
//     warm-up round, and of the final window (the last 4 prefetches) of every timed round, is
//     checked against its key after the clock stopped, before its pages are freed. That checks
//     the backed-up bytes as well (L2 -> L3 -> L2).
//
// Waiting: the controllers have no blocking wait for acks (the main loop drains them without
// blocking), so the driver drains in a loop with std::this_thread::yield() between empty drains
// and polls a prefetch's completed tokens the same way: no fixed sleeps in the timed part, and
// the controller's threads get the CPU whenever they want it (2 cores).
//
// --device cuda: the same suite on a GPU. The CPU reaches device pages through a pinned mirror
// of the device pool (filled, then copied over; copied back before a check), always outside the
// timed part. Write and load lines then also carry ceiling_gbps: right after the workload, the
// same bytes copied in page-sized chunks between a pinned buffer and device memory of one window
// each, on one stream, in the workload's direction (D2H for writes, H2D for loads): the copy
// engine's rate for contiguous pages, against which the controller's scattered layer-by-layer
// copies are measured.
//
// memcpy_gbps: right after each workload, std::memcpy of the same total bytes in chunks of the
// page size between two pre-faulted buffers of one window each (4 ops' pages: the pools'
// allocators hand the pages an op freed to the next op, so the copies cycle over about that many
// pages too; with 8 MiB pages, 1-page ops fit partly in a 32 MiB L3, 16-page ops do not).
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "controller/hicache.h"
#include "controller/hicache_controller.h"
#include "controller/storage_controller.h"
#include "pools/device_kv_pool.h"
#include "pools/host_kv_pool.h"
#include "pools/kv_pattern.h"
#include "storage/collective.h"
#include "storage/file_storage.h"
#include "storage/page_key.h"
#include "transfer/device.h"
#include "transfer/errors.h"
#include "transfer/host_memory.h"
#include "tools/opbench_hybrid.h"

namespace {

namespace fs = std::filesystem;
using hicache::str_cat;
using Clock = std::chrono::steady_clock;

constexpr const char* kUsage = R"(usage: hicache-opbench [options]
Runs a fixed suite of controller operations on the host backend (or a GPU) and prints one JSON
object per line per workload (ops/s, pages/s, GB/s, submit->ack p50/p99 ms, byte verification,
pools clean, and a plain memcpy of the same bytes in the same run; on a GPU also the copy
engine's rate for the same bytes).
  --workload NAME[,NAME...]  run only these (repeatable; default all, in this order):
                             write_p1 write_p16 load_p1 load_p16 write_p1_tiny load_p1_tiny
                             backup_p16 prefetch_p16 backup_p4 prefetch_p4
                             hybrid_write_p16 hybrid_load_p16
                             (backup_pN and prefetch_pN share their rounds: naming either runs
                             both phases and prints the ones named; hybrid_*: a 16 MiB state
                             page beside 16 KV pages against 18 KV pages, ratio of the two)
  --quick                    every op, step and round count divided by 10, rounded up (warm-ups
                             unchanged): the whole suite in under 30 s on 2 cores
  --device host|cuda         device backend (host)
  --io-backend auto|direct|kernel
                             the controller's I/O path (default auto, the library's default:
                             per op; direct: copy lists; kernel: one gather or scatter launch
                             per op and layer range)
  --kernel-max-blocks N      the kernel path's block cap (the config's kernel_max_blocks;
                             default 0, no cap)
  --storage-dir DIR          file store root for backup/prefetch (default: a fresh directory
                             under the temp directory, removed at exit)
  --help
Exit status: 0 when every workload verified and left its pools clean, 1 otherwise or on an
error, 2 for bad flags.
)";

constexpr std::array<std::string_view, 12> kWorkloads = {
    "write_p1",     "write_p16",  "load_p1",      "load_p16",  "write_p1_tiny",
    "load_p1_tiny", "backup_p16", "prefetch_p16", "backup_p4", "prefetch_p4",
    "hybrid_write_p16", "hybrid_load_p16"};

constexpr int kInFlight = 4;  // write, backup and prefetch ops in flight; loads per step
constexpr std::int64_t kDevicePages = 80;
constexpr std::int64_t kHostPages = 160;
constexpr std::int64_t kPrefetchThresholdTokens = 256;

struct Options {
  bool quick = false;
  std::vector<std::string> workloads;  // empty: all
  std::string storage_dir;             // empty: a temporary directory
  std::string device = "host";
  std::string io_backend = "auto";
  std::int64_t kernel_max_blocks = 0;  // the config's default: no cap
};

[[noreturn]] void usage_error(const std::string& message) {
  std::fprintf(stderr, "hicache-opbench: %s\n%s", message.c_str(), kUsage);
  std::exit(2);
}

void add_workloads(std::string_view list, Options& o) {
  while (true) {
    const std::size_t comma = list.find(',');
    const std::string_view name = list.substr(0, comma);
    if (std::find(kWorkloads.begin(), kWorkloads.end(), name) == kWorkloads.end()) {
      usage_error(str_cat("unknown workload '", name, "'"));
    }
    o.workloads.emplace_back(name);
    if (comma == std::string_view::npos) return;
    list.remove_prefix(comma + 1);
  }
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string_view flag = argv[i];
    std::optional<std::string_view> value;
    if (const std::size_t eq = flag.find('='); flag.starts_with("--") && eq != flag.npos) {
      value = flag.substr(eq + 1);
      flag = flag.substr(0, eq);
    }
    if (flag == "--help" || flag == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    if (flag == "--quick") {
      if (value) usage_error(str_cat("--quick takes no value, got '", *value, "'"));
      o.quick = true;
      continue;
    }
    if (flag != "--workload" && flag != "--storage-dir" && flag != "--device" &&
        flag != "--io-backend" && flag != "--kernel-max-blocks") {
      usage_error(str_cat("unknown flag '", argv[i], "'"));
    }
    if (!value) {
      if (i + 1 >= argc) usage_error(str_cat(flag, " needs a value"));
      value = argv[++i];
    }
    if (value->empty()) usage_error(str_cat(flag, ": empty value"));
    if (flag == "--workload") {
      add_workloads(*value, o);
    } else if (flag == "--device") {
      if (*value != "host" && *value != "cuda") {
        usage_error(str_cat("--device: '", *value, "': valid are host, cuda"));
      }
      o.device = *value;
    } else if (flag == "--io-backend") {
      if (*value != "auto" && *value != "direct" && *value != "kernel") {
        usage_error(str_cat("--io-backend: '", *value, "': valid are auto, direct, kernel"));
      }
      o.io_backend = *value;
    } else if (flag == "--kernel-max-blocks") {
      char* end = nullptr;
      const std::string text(*value);
      const long long n = std::strtoll(text.c_str(), &end, 10);
      if (end == nullptr || *end != '\0' || n < 0 || n > (1 << 20)) {
        usage_error(str_cat("--kernel-max-blocks: '", text, "': valid are 0..1048576"));
      }
      o.kernel_max_blocks = n;
    } else {
      o.storage_dir = *value;
    }
  }
  return o;
}

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }
double ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

// The p-th percentile by nearest rank: the smallest value with at least p% of them at or below.
double nearest_rank(std::vector<double> values, double p) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const auto rank = static_cast<std::size_t>(std::ceil(p / 100.0 * values.size()));
  return values[std::clamp<std::size_t>(rank, 1, values.size()) - 1];
}

// Keys of pattern data: distinct per workload and page.
std::uint64_t page_seed(std::uint64_t workload, std::int64_t page) {
  return (workload << 32) ^ static_cast<std::uint64_t>(page);
}

std::vector<std::int64_t> pages_of(std::span<const std::int64_t> slots, std::int32_t page_size,
                                   std::int64_t num_pages) {
  std::vector<std::int64_t> pages;
  hicache::slots_to_pages(slots, page_size, num_pages, "hicache-opbench", pages);
  return pages;
}

// What one workload measured.
struct Measure {
  std::int64_t ops = 0, pages = 0;
  double bytes = 0, seconds = 0;
  std::int64_t window_pages = 1;   // pages in flight at once: the memcpy baseline's buffers
  std::vector<double> latency_ms;  // submit -> ack, one per timed op
  enum class Copy { kNone, kToHost, kToDevice } direction = Copy::kNone;  // the ceiling's
  bool verified = true;
  std::uint64_t kernel_batches = 0, direct_batches = 0;  // the controller's copy batches by path
  std::string problem;  // the first reason verified is false
  nlohmann::ordered_json extra = nlohmann::ordered_json::object();

  void fail(const std::string& why) {
    if (verified) problem = why;
    verified = false;
  }
};

// The HiCache the library builds for one geometry (pools, controller, and with `storage_root`
// a file store and its storage controller), reused by every workload of that geometry; each
// workload leaves every slot free again.
std::unique_ptr<hicache::HiCache> make_hicache(hicache::Device& device,
                                               const hicache::KVGeometry& g,
                                               const std::string& storage_root,
                                               const std::string& fingerprint,
                                               const Options& o) {
  nlohmann::json c = {
      {"page_size", g.page_size},
      {"device_tokens", kDevicePages * g.page_size},
      {"host_tokens", kHostPages * g.page_size},
      {"model",
       {{"layers", g.num_layers}, {"kv_heads", g.num_kv_heads}, {"head_dim", g.head_dim},
        {"dtype", hicache::to_string(g.dtype)}}},
      {"write_policy", "write_through"},
      {"io_backend", o.io_backend},
      {"kernel_max_blocks", o.kernel_max_blocks},
      {"host_layout", "layer_first"},
      {"model_name", "hicache-opbench"},
      {"model_fingerprint", fingerprint},
      {"prefetch_threshold_tokens", kPrefetchThresholdTokens}};
  if (!storage_root.empty()) c["storage"] = {{"backend", "file"}, {"root", storage_root}};
  hicache::HiCacheParts parts;
  parts.device = &device;
  return std::make_unique<hicache::HiCache>(hicache::HiCacheConfig::from_json_text(c.dump()),
                                            std::move(parts));
}

class Rig {
 public:
  Rig(hicache::Device& device, const hicache::KVGeometry& geometry,
      const Options& o, const std::string& storage_root = "",
      const std::string& fingerprint = "unversioned")
      : hc(make_hicache(device, geometry, storage_root, fingerprint, o)),
        g(geometry),
        dev(hc->device_pool()),
        host(hc->host_pool()),
        controller(hc->controller()),
        device_(device), dev_cpu_(dev.layout()) {
    if (!device.device_memory_is_host_accessible()) {
      mirror_ = device.alloc_host(dev.size_bytes());
      dev_cpu_.base = reinterpret_cast<std::uint8_t*>(mirror_.data());
      stream_ = device.create_stream();
    }
  }

  // The device pool as the CPU writes and reads it: the pool itself, or its pinned mirror (then
  // push_device() after writing, pull_device() before reading).
  const hicache::LayoutDesc& dev_cpu() const { return dev_cpu_; }
  void push_device() {
    if (stream_) sync_copy(dev.layout().base, mirror_.data(), dev.size_bytes());
  }
  void pull_device() {
    if (stream_) sync_copy(mirror_.data(), dev.layout().base, dev.size_bytes());
  }

  bool clean() const {
    return dev.allocator().free_tokens() == dev.capacity_tokens() &&
           host.free_tokens() == host.capacity_tokens();
  }
  void zero_host() { std::memset(host.layout().base, 0, host.size_bytes()); }
  void zero_device() {
    std::memset(dev_cpu_.base, 0, dev.size_bytes());
    push_device();
  }

  // With a GPU: `bytes` copied in page-sized chunks between a pinned buffer and device memory of
  // `window_pages` pages each, page i to page i, cycling, on one stream; GB/s. 0 on the host
  // backend (memcpy_gbps is its baseline).
  double ceiling_gbps(double bytes, std::int64_t window_pages, Measure::Copy direction) {
    if (!stream_ || direction == Measure::Copy::kNone) return 0;
    const auto page = static_cast<std::size_t>(g.page_bytes());
    const auto window = static_cast<std::size_t>(window_pages);
    const hicache::Buffer pinned = device_.alloc_host(window * page);
    const hicache::Buffer on_device = device_.alloc_device(window * page);
    const auto chunks = static_cast<std::size_t>(bytes / static_cast<double>(page));
    const bool to_host = direction == Measure::Copy::kToHost;
    stream_->copy_async(to_host ? pinned.data() : on_device.data(),
                        to_host ? on_device.data() : pinned.data(), page);  // warm-up
    stream_->synchronize();
    const auto t0 = Clock::now();
    for (std::size_t c = 0; c < chunks; ++c) {
      const std::size_t at = (c % window) * page;
      stream_->copy_async(to_host ? pinned.data() + at : on_device.data() + at,
                          to_host ? on_device.data() + at : pinned.data() + at, page);
    }
    stream_->synchronize();
    const double s = seconds(Clock::now() - t0);
    return s > 0 ? static_cast<double>(chunks * page) / s / 1e9 : 0;
  }

  // std::memcpy of `bytes` in page-sized chunks from one pre-faulted buffer of `window_pages`
  // pages to another, page i to page i, cycling; GB/s.
  double memcpy_gbps(double bytes, std::int64_t window_pages) const {
    const auto page = static_cast<std::size_t>(g.page_bytes());
    const auto window = static_cast<std::size_t>(window_pages);
    const hicache::Buffer src = hicache::map_host_memory(window * page);
    const hicache::Buffer dst = hicache::map_host_memory(window * page);
    const auto chunks = static_cast<std::size_t>(bytes / static_cast<double>(page));
    const auto t0 = Clock::now();
    for (std::size_t c = 0; c < chunks; ++c) {
      const std::size_t at = (c % window) * page;
      std::memcpy(dst.data() + at, src.data() + at, page);
      std::atomic_signal_fence(std::memory_order_seq_cst);  // keep every copy
    }
    const double s = seconds(Clock::now() - t0);
    return s > 0 ? static_cast<double>(chunks * page) / s / 1e9 : 0;
  }

  std::unique_ptr<hicache::HiCache> hc;
  const hicache::KVGeometry g;
  hicache::DeviceKVPool& dev;
  hicache::HostKVPool& host;
  hicache::HiCacheController& controller;

 private:
  void sync_copy(void* dst, const void* src, std::size_t bytes) {
    stream_->copy_async(dst, src, bytes);
    stream_->synchronize();
  }

  hicache::Device& device_;
  hicache::LayoutDesc dev_cpu_;
  hicache::Buffer mirror_;
  std::unique_ptr<hicache::Stream> stream_;
};

// v rounded to `decimals` decimals (dividing by a power of ten prints without a tail of digits).
double round_to(double v, int decimals) {
  const double scale = std::pow(10.0, decimals);
  return std::round(v * scale) / scale;
}

// Prints one workload's line; returns whether it passed.
bool report(std::string_view name, Rig& rig, const Measure& m, bool pools_clean) {
  const double s = m.seconds > 0 ? m.seconds : 1e-9;
  nlohmann::ordered_json j;
  j["workload"] = name;
  j["io_backend"] = std::string(hicache::to_string(rig.hc->config().controller.io_backend));
  if (const std::int32_t cap = rig.hc->config().controller.kernel_max_blocks; cap != 0) {
    j["kernel_max_blocks"] = cap;
  }
  if (m.kernel_batches + m.direct_batches > 0) {  // what auto chose (all of it, warm-up too)
    j["kernel_batches"] = m.kernel_batches;
    j["direct_batches"] = m.direct_batches;
  }
  j["ops"] = m.ops;
  j["pages"] = m.pages;
  j["page_bytes"] = rig.g.page_bytes();
  j["seconds"] = round_to(m.seconds, 4);
  j["ops_per_s"] = round_to(static_cast<double>(m.ops) / s, 1);
  j["pages_per_s"] = round_to(static_cast<double>(m.pages) / s, 1);
  j["gbps"] = round_to(m.bytes / s / 1e9, 3);
  j["p50_ms"] = round_to(nearest_rank(m.latency_ms, 50), 4);
  j["p99_ms"] = round_to(nearest_rank(m.latency_ms, 99), 4);
  j.update(m.extra);
  j["verified"] = m.verified;
  j["pools_clean"] = pools_clean;
  j["memcpy_gbps"] = round_to(rig.memcpy_gbps(m.bytes, m.window_pages), 3);
  if (const double ceiling = rig.ceiling_gbps(m.bytes, m.window_pages, m.direction); ceiling > 0) {
    j["ceiling_gbps"] = round_to(ceiling, 3);
    j["ratio_to_ceiling"] = round_to(m.bytes / s / 1e9 / ceiling, 3);
  }
  if (!m.problem.empty()) j["problem"] = m.problem;
  std::puts(j.dump().c_str());
  std::fflush(stdout);
  return m.verified && pools_clean;
}

// Checks the `slots` of layout `d` against the seed `seed_of(i)` of their i-th page.
template <typename SeedOf>
void verify_pages(const hicache::LayoutDesc& d, std::span<const std::int64_t> slots,
                  std::int32_t page_size, std::int64_t num_pages, SeedOf seed_of,
                  std::string_view what, Measure& m) {
  const auto pages = pages_of(slots, page_size, num_pages);
  for (std::size_t i = 0; i < pages.size(); ++i) {
    std::string where;
    if (!hicache::verify_page(d, pages[i], seed_of(i), &where)) {
      m.fail(str_cat(what, " differs at ", where));
    }
  }
}

// ----------------------------------------------------------------------------------------------
// write_pP: L1 -> L2

Measure run_writes(Rig& rig, std::uint64_t workload, std::int64_t pages_per_op, std::int64_t ops) {
  Measure m;
  const std::int32_t ps = rig.g.page_size;
  const std::int64_t tokens = pages_per_op * ps;
  const std::int64_t dev_pages = rig.dev.allocator().num_pages();
  for (std::int64_t d = 0; d < dev_pages; ++d) {
    hicache::fill_page(rig.dev_cpu(), d, page_seed(workload, d));
  }
  rig.push_device();
  struct Op {
    std::vector<std::int64_t> dev, host;
    Clock::time_point submitted;
  };
  std::array<Op, kInFlight> window;
  std::vector<int> held;  // the final window: acked, not evicted
  std::vector<hicache::Ack> acks;
  acks.reserve(4 * kInFlight);
  const hicache::ControllerStats before = rig.controller.stats();

  auto submit = [&](int i) {
    Op& op = window[i];
    op.dev.clear();
    if (!rig.dev.allocator().alloc(tokens, op.dev)) throw hicache::Error("device pool short");
    op.submitted = Clock::now();
    auto host = rig.controller.write(op.dev, 0, hicache::NodeId{i});
    if (!host) throw hicache::Error("write refused: host pool or write queue full");
    op.host = std::move(*host);
  };
  // Runs `count` ops, kInFlight at a time; returns the time from the first submit to the last
  // ack. The ops of the final window stay in `held`, their copies on both tiers.
  auto phase = [&](std::int64_t count, bool timed) {
    held.clear();
    std::int64_t submitted = 0, acked = 0;
    const auto t0 = Clock::now();
    auto last_ack = t0;
    for (; submitted < std::min<std::int64_t>(count, kInFlight); ++submitted) {
      submit(static_cast<int>(submitted));
    }
    while (acked < count) {
      acks.clear();
      if (rig.controller.drain_write_acks(acks) == 0) {
        std::this_thread::yield();
        continue;
      }
      last_ack = Clock::now();
      for (const hicache::Ack& a : acks) {
        const int i = static_cast<int>(a.node);
        Op& op = window[i];
        ++acked;
        if (timed) m.latency_ms.push_back(ms(last_ack - op.submitted));
        if (!a.ok) {  // the controller freed the host pages
          m.fail(str_cat("write ack of window slot ", i, " not ok"));
          rig.dev.allocator().free(op.dev);
          op.dev.clear();
          op.host.clear();
        } else if (submitted == count) {
          held.push_back(i);
          continue;
        } else {
          rig.controller.evict_device(op.dev, op.host);
          rig.controller.evict_host(op.host);
        }
        if (submitted < count) {
          submit(i);
          ++submitted;
        }
      }
    }
    return seconds(last_ack - t0);
  };
  auto check_and_evict_held = [&](std::string_view what) {
    for (int i : held) {
      const auto dev_pages_of_op = pages_of(window[i].dev, ps, dev_pages);
      verify_pages(
          rig.host.layout(), window[i].host, ps, rig.host.num_pages(),
          [&](std::size_t k) { return page_seed(workload, dev_pages_of_op[k]); }, what, m);
      rig.controller.evict_device(window[i].dev, window[i].host);
      rig.controller.evict_host(window[i].host);
    }
    held.clear();
  };

  const double warmup_s = phase(kInFlight, /*timed=*/false);
  check_and_evict_held("warm-up host copy");
  rig.zero_host();
  m.seconds = phase(ops, /*timed=*/true);
  check_and_evict_held("final-window host copy");

  const hicache::ControllerStats after = rig.controller.stats();
  const auto all_ops = static_cast<std::uint64_t>(ops + kInFlight);
  const auto all_bytes = all_ops * static_cast<std::uint64_t>(pages_per_op * rig.g.page_bytes());
  if (after.writes_done - before.writes_done != all_ops ||
      after.bytes_written - before.bytes_written != all_bytes) {
    m.fail(str_cat("controller counted ", after.writes_done - before.writes_done, " writes of ",
                   after.bytes_written - before.bytes_written, " bytes, expected ", all_ops, " of ",
                   all_bytes));
  }
  m.ops = ops;
  m.pages = ops * pages_per_op;
  m.window_pages = kInFlight * pages_per_op;
  m.direction = Measure::Copy::kToHost;
  m.bytes = static_cast<double>(m.pages) * static_cast<double>(rig.g.page_bytes());
  m.extra["pages_per_op"] = pages_per_op;
  m.extra["in_flight"] = kInFlight;
  // Where a write's time goes (warm-up included): the write thread's copy batches (merged ops
  // count once), their rate from the batch's start to its stream synchronisation, and the
  // share of the run the thread spent in them. copy_gbps near the ceiling with a low busy share
  // means the time goes between batches; copy_gbps itself low means inside the copy.
  m.kernel_batches = after.kernel_batches - before.kernel_batches;
  m.direct_batches = after.direct_batches - before.direct_batches;
  const double write_s = after.write_seconds - before.write_seconds;
  m.extra["write_batches"] = after.write_batches_done - before.write_batches_done;
  const double wall_s = m.seconds + warmup_s;
  m.extra["copy_gbps"] = round_to(
      write_s > 0 ? static_cast<double>(after.bytes_written - before.bytes_written) / write_s / 1e9
                  : 0.0,
      3);
  m.extra["write_thread_busy"] = round_to(wall_s > 0 ? write_s / wall_s : 0.0, 3);
  return m;
}

// ----------------------------------------------------------------------------------------------
// load_pP: L2 -> L1, layer by layer

Measure run_loads(Rig& rig, std::uint64_t workload, std::int64_t pages_per_op, std::int64_t steps) {
  constexpr int kWarmupSteps = 3;
  Measure m;
  const std::int32_t ps = rig.g.page_size;
  const std::int32_t layers = rig.g.num_layers;
  const std::int64_t host_pages = rig.host.num_pages();
  const std::int64_t dev_pages = rig.dev.allocator().num_pages();
  const hicache::ControllerStats before = rig.controller.stats();

  // The host pages the loads read: key-derived data, state backup (the only copy above L3).
  std::array<std::vector<std::int64_t>, kInFlight> host, dev;
  for (auto& slots : host) {
    if (!rig.host.alloc(pages_per_op * ps, slots)) throw hicache::Error("host pool short");
    for (std::int64_t page : pages_of(slots, ps, host_pages)) {
      hicache::fill_page(rig.host.layout(), page, page_seed(workload, page));
    }
    rig.host.protect_write(slots);
    rig.host.complete_io(slots, hicache::PageState::kBackup);
  }

  std::vector<double> first_layer_ms, all_layers_ms;
  std::vector<hicache::Ack> acks;
  acks.reserve(4 * kInFlight);
  // One step; returns its time without the verification.
  auto step = [&](bool timed, bool verify) {
    std::array<Clock::time_point, kInFlight> submitted;
    const auto t0 = Clock::now();
    for (int i = 0; i < kInFlight; ++i) {
      submitted[i] = Clock::now();
      auto slots = rig.controller.load(host[i], 0, hicache::NodeId{i});
      if (!slots) throw hicache::Error("load refused: device pool or load queue full");
      dev[i] = std::move(*slots);
    }
    const auto start = Clock::now();
    const std::int32_t slot = rig.controller.start_loading();
    if (slot < 0) throw hicache::Error("start_loading queued nothing");
    Clock::time_point first_layer;
    for (std::int32_t layer = 0; layer < layers; ++layer) {
      if (!rig.dev.wait_for_layer(layer)) throw hicache::Error(str_cat("load of layer ", layer, " failed"));
      if (layer == 0) first_layer = Clock::now();
    }
    const auto all_layers = Clock::now();
    rig.controller.layer_done_counter().release(slot);
    std::array<bool, kInFlight> ok{};
    for (int got = 0; got < kInFlight;) {
      acks.clear();
      if (rig.controller.drain_load_acks(acks) == 0) {
        std::this_thread::yield();
        continue;
      }
      const auto now = Clock::now();
      for (const hicache::Ack& a : acks) {
        const int i = static_cast<int>(a.node);
        ok[i] = a.ok;
        if (!a.ok) m.fail(str_cat("load ack of op ", i, " not ok"));
        if (timed) m.latency_ms.push_back(ms(now - submitted[i]));
        ++got;
      }
    }
    double s = seconds(Clock::now() - t0);
    if (timed) {
      first_layer_ms.push_back(ms(first_layer - start));
      all_layers_ms.push_back(ms(all_layers - start));
    }
    if (verify) rig.pull_device();
    for (int i = 0; verify && i < kInFlight; ++i) {
      const auto host_pages_of_op = pages_of(host[i], ps, host_pages);
      verify_pages(
          rig.dev_cpu(), dev[i], ps, dev_pages,
          [&](std::size_t k) { return page_seed(workload, host_pages_of_op[k]); },
          "loaded device copy", m);
    }
    const auto t1 = Clock::now();
    for (int i = 0; i < kInFlight; ++i) {
      if (ok[i]) {
        rig.controller.evict_device(dev[i], host[i]);
      } else {  // the host pages went back to backup; the device slots are ours to free
        rig.dev.allocator().free(dev[i]);
      }
    }
    return s + seconds(Clock::now() - t1);
  };

  rig.zero_device();
  for (int w = 0; w < kWarmupSteps; ++w) step(/*timed=*/false, /*verify=*/true);
  for (std::int64_t s = 0; s < steps; ++s) {
    const bool last = s + 1 == steps;
    if (last) rig.zero_device();
    m.seconds += step(/*timed=*/true, /*verify=*/last);
  }
  for (const auto& slots : host) rig.controller.evict_host(slots);

  const hicache::ControllerStats after = rig.controller.stats();
  m.kernel_batches = after.kernel_batches - before.kernel_batches;
  m.direct_batches = after.direct_batches - before.direct_batches;
  const auto batches = static_cast<std::uint64_t>(steps + kWarmupSteps);
  const auto all_bytes =
      batches * kInFlight * static_cast<std::uint64_t>(pages_per_op * rig.g.page_bytes());
  if (after.load_batches_done - before.load_batches_done != batches ||
      after.bytes_loaded - before.bytes_loaded != all_bytes) {
    m.fail(str_cat("controller counted ", after.load_batches_done - before.load_batches_done,
                   " load batches of ", after.bytes_loaded - before.bytes_loaded,
                   " bytes, expected ", batches, " of ", all_bytes));
  }
  m.ops = steps * kInFlight;
  m.pages = m.ops * pages_per_op;
  m.window_pages = kInFlight * pages_per_op;
  m.direction = Measure::Copy::kToDevice;
  m.bytes = static_cast<double>(m.pages) * static_cast<double>(rig.g.page_bytes());
  m.extra["pages_per_op"] = pages_per_op;
  m.extra["steps"] = steps;
  m.extra["first_layer_ready_p50_ms"] = round_to(nearest_rank(first_layer_ms, 50), 4);
  m.extra["all_layers_ready_p50_ms"] = round_to(nearest_rank(all_layers_ms, 50), 4);
  return m;
}

// ----------------------------------------------------------------------------------------------
// backup_pP / prefetch_pP: rounds of L2 -> L3 -> L2 through the rig's file store

struct StorageSpec {
  std::int64_t pages_per_op;
  std::int64_t ops_per_round;     // K
  std::int64_t rounds;            // timed, after one warm-up round
  std::int64_t prefetch_repeats;  // R: prefetches of each op's keys per round
};

class StorageRounds {
 public:
  // `next_token` hands out fresh token ids across every round of the run.
  StorageRounds(Rig& rig, const StorageSpec& spec, std::int32_t& next_token)
      : rig_(rig),
        spec_(spec),
        next_token_(next_token),
        store_(dynamic_cast<hicache::FileStorage&>(*rig.hc->storage())),
        controller_(*rig.hc->storage_controller()),
        keyer_(rig.hc->key_namespace()),
        ops_(static_cast<std::size_t>(spec.ops_per_round)) {}

  // The warm-up round, then the timed rounds; the backup phases go to `backup`, the prefetch
  // phases to `prefetch`.
  void run(Measure& backup, Measure& prefetch) {
    for (std::int64_t round = 0; round <= spec_.rounds; ++round) {
      const bool timed = round > 0;
      set_up(round);
      const double backup_s = backup_phase(timed, backup);
      for (Op& op : ops_) rig_.host.free(op.source);
      rig_.zero_host();
      const double prefetch_s = prefetch_phase(timed, prefetch);
      if (timed) {
        backup.seconds += backup_s;
        prefetch.seconds += prefetch_s;
      }
      // Untimed clean-up: delete the round's records and wait for the unlinks.
      for (const Op& op : ops_) {
        for (const auto& key : op.keys) store_.remove(key);
      }
      store_.flush_trash();
    }
    if (controller_.prefetch_tokens_held() != 0) {
      prefetch.fail(str_cat(controller_.prefetch_tokens_held(), " prefetch tokens still held"));
    }
    describe(backup, prefetch);
  }

 private:
  struct Op {
    std::vector<std::int32_t> tokens;
    std::vector<std::string> keys;
    std::vector<std::uint64_t> seeds;  // one per page, from its key's digest
    std::vector<std::int64_t> source;  // host slots the backup reads
  };

  std::int64_t op_tokens() const { return spec_.pages_per_op * rig_.g.page_size; }

  // Untimed: fresh tokens and their keys; source pages filled with the keys' data.
  void set_up(std::int64_t round) {
    const std::int32_t ps = rig_.g.page_size;
    backup_keys_.resize(ops_.size());
    for (std::size_t i = 0; i < ops_.size(); ++i) {
      Op& op = ops_[i];
      op.tokens.resize(static_cast<std::size_t>(op_tokens()));
      for (auto& t : op.tokens) t = next_token_++;
      op.keys.clear();
      digests_.clear();
      keyer_.keys(op.tokens, nullptr, op.keys, &digests_);
      op.seeds.clear();
      for (const auto& d : digests_) {
        std::uint64_t seed = 0;
        std::memcpy(&seed, d.data(), sizeof(seed));
        op.seeds.push_back(seed);
      }
      op.source.clear();
      if (!rig_.host.alloc(op_tokens(), op.source)) throw hicache::Error("host pool short");
      const auto pages = pages_of(op.source, ps, rig_.host.num_pages());
      for (std::size_t p = 0; p < pages.size(); ++p) {
        hicache::fill_page(rig_.host.layout(), pages[p], op.seeds[p]);
      }
      backup_keys_[i] = op.keys;
    }
    request_ids_.resize(ops_.size() * static_cast<std::size_t>(spec_.prefetch_repeats));
    for (std::size_t j = 0; j < request_ids_.size(); ++j) {
      request_ids_[j] = str_cat("r", round, "-", j);
    }
  }

  // Backs up the K ops, kInFlight at a time; returns the time from the first submit to the last
  // ack.
  double backup_phase(bool timed, Measure& m) {
    struct InFlight {
      std::int64_t id = -1;
      std::size_t op = 0;
      Clock::time_point submitted;
    };
    std::array<InFlight, kInFlight> window;
    std::size_t submitted = 0, acked = 0;
    auto submit = [&](InFlight& w) {
      w.op = submitted++;
      w.submitted = Clock::now();
      const auto id = controller_.write_storage(ops_[w.op].source, std::move(backup_keys_[w.op]));
      if (!id) throw hicache::Error("write_storage refused: backup queue full");
      w.id = *id;
    };
    const auto t0 = Clock::now();
    auto last_ack = t0;
    for (auto& w : window) {
      if (submitted < ops_.size()) submit(w);
    }
    while (acked < ops_.size()) {
      acks_.clear();
      if (controller_.drain_backup_acks(acks_) == 0) {
        std::this_thread::yield();
        continue;
      }
      last_ack = Clock::now();
      for (const hicache::BackupAck& a : acks_) {
        auto w = std::find_if(window.begin(), window.end(),
                              [&](const InFlight& f) { return f.id == a.id; });
        if (w == window.end()) throw hicache::Error(str_cat("unknown backup ack ", a.id));
        ++acked;
        if (timed) m.latency_ms.push_back(ms(last_ack - w->submitted));
        if (a.completed_tokens != op_tokens() || a.total_tokens != op_tokens()) {
          m.fail(str_cat("backup stored ", a.completed_tokens, " of ", op_tokens(),
                         " tokens: ", a.error));
        }
        w->id = -1;
        if (submitted < ops_.size()) submit(*w);
      }
    }
    return seconds(last_ack - t0);
  }

  // Prefetches every op's keys R times (round robin), kInFlight at a time; an op is done when
  // all its bytes landed, then terminated and its pages freed. Returns the time from the first
  // submit to the last terminate. Checks the prefetched pages of the final window (all of them
  // in the warm-up round) once the clock stopped.
  double prefetch_phase(bool timed, Measure& m) {
    struct InFlight {
      std::shared_ptr<hicache::PrefetchOperation> handle;
      std::size_t op = 0;
      Clock::time_point submitted;
    };
    std::array<InFlight, kInFlight> window;
    std::vector<Held> held;
    const std::size_t n = request_ids_.size();
    std::size_t submitted = 0, done = 0;
    auto submit = [&](InFlight& w) {
      w.op = submitted % ops_.size();
      w.submitted = Clock::now();
      w.handle = controller_.prefetch(std::move(request_ids_[submitted]), ops_[w.op].tokens);
      if (!w.handle) throw hicache::Error("prefetch refused: prefetch queue full");
      ++submitted;
    };
    const auto t0 = Clock::now();
    auto last_done = t0;
    for (auto& w : window) {
      if (submitted < n) submit(w);
    }
    while (done < n) {
      bool progressed = false;
      for (InFlight& w : window) {
        if (!w.handle || !landed(*w.handle)) continue;
        hicache::PrefetchResult result = controller_.terminate_prefetch(*w.handle);
        last_done = Clock::now();
        progressed = true;
        ++done;
        if (timed) m.latency_ms.push_back(ms(last_done - w.submitted));
        if (result.tokens != op_tokens()) {
          m.fail(str_cat("prefetch terminated with ", result.tokens, " of ", op_tokens(),
                         " tokens: ", w.handle->error()));
        }
        if (submitted == n) {
          held.push_back(Held{w.op, std::move(result)});
        } else if (!timed) {  // the warm-up checks every prefetch (the clock does not run)
          check_and_free(Held{w.op, std::move(result)}, "warm-up prefetched page", m);
        } else if (!result.host_slots.empty()) {
          rig_.host.free(result.host_slots);
        }
        w.handle.reset();
        if (submitted < n) submit(w);
      }
      if (!progressed) std::this_thread::yield();
    }
    const double s = seconds(last_done - t0);
    for (const Held& h : held) check_and_free(h, "final-window prefetched page", m);
    return s;
  }

  // All the op's bytes are in host memory, or it ended short (revoked, failed, finished).
  bool landed(const hicache::PrefetchOperation& op) const {
    if (op.completed_tokens() == op_tokens()) return true;
    const hicache::PrefetchStage stage = op.stage();
    return stage != hicache::PrefetchStage::kQueued && stage != hicache::PrefetchStage::kLoading;
  }

  struct Held {
    std::size_t op;
    hicache::PrefetchResult result;
  };
  void check_and_free(const Held& h, std::string_view what, Measure& m) {
    const Op& op = ops_[h.op];
    if (!std::equal(h.result.keys.begin(), h.result.keys.end(), op.keys.begin())) {
      m.fail(str_cat(what, ": prefetch returned other keys than asked for"));
    }
    verify_pages(
        rig_.host.layout(), h.result.host_slots, rig_.g.page_size, rig_.host.num_pages(),
        [&](std::size_t k) { return op.seeds[k]; }, what, m);
    if (!h.result.host_slots.empty()) rig_.host.free(h.result.host_slots);
  }

  void describe(Measure& backup, Measure& prefetch) const {
    const double page_bytes = static_cast<double>(rig_.g.page_bytes());
    backup.ops = spec_.rounds * spec_.ops_per_round;
    prefetch.ops = backup.ops * spec_.prefetch_repeats;
    for (Measure* m : {&backup, &prefetch}) {
      m->pages = m->ops * spec_.pages_per_op;
      m->bytes = static_cast<double>(m->pages) * page_bytes;
      m->window_pages = kInFlight * spec_.pages_per_op;
      m->extra["pages_per_op"] = spec_.pages_per_op;
      m->extra["in_flight"] = kInFlight;
      m->extra["rounds"] = spec_.rounds;
      m->extra["ops_per_round"] = spec_.ops_per_round;
    }
    prefetch.extra["prefetches_per_op"] = spec_.prefetch_repeats;
  }

  Rig& rig_;
  const StorageSpec spec_;
  std::int32_t& next_token_;
  hicache::FileStorage& store_;
  hicache::StorageController& controller_;
  hicache::PageKeyer keyer_;
  std::vector<Op> ops_;
  std::vector<std::vector<std::string>> backup_keys_;  // moved into write_storage
  std::vector<std::string> request_ids_;               // moved into prefetch
  std::vector<hicache::PageDigest> digests_;
  std::vector<hicache::BackupAck> acks_;
};

// ----------------------------------------------------------------------------------------------

// A fresh directory under the temp directory, removed with everything in it at the end.
class TempDir {
 public:
  TempDir() {
    std::string templ = (fs::temp_directory_path() / "hicache-opbench-XXXXXX").string();
    if (::mkdtemp(templ.data()) == nullptr) {
      throw hicache::Error(
          str_cat("cannot create a directory like ", templ, ": ", std::strerror(errno)));
    }
    path_ = templ;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

int run(const Options& o) {
  auto wanted = [&](std::string_view name) {
    return o.workloads.empty() ||
           std::find(o.workloads.begin(), o.workloads.end(), name) != o.workloads.end();
  };
  auto scaled = [&](std::int64_t n) { return o.quick ? (n + 9) / 10 : n; };
  auto device = hicache::Device::create(o.device);
  const auto standard_geometry = hicache::KVGeometry::mha(32, 8, 128, hicache::DType::kFloat16, 64);
  const auto tiny_geometry = hicache::KVGeometry::mha(1, 1, 8, hicache::DType::kFloat16, 64);
  // The standard rig carries the file store of the storage workloads.
  std::optional<TempDir> temp;
  if (o.storage_dir.empty()) temp.emplace();
  const fs::path root = o.storage_dir.empty() ? temp->path() : fs::path(o.storage_dir);
  const std::string fingerprint =
      str_cat("run-", ::getpid(), "-", Clock::now().time_since_epoch().count());
  std::unique_ptr<Rig> standard, tiny;
  auto rig_for = [&](bool is_tiny) -> Rig& {
    auto& rig = is_tiny ? tiny : standard;
    if (!rig) {
      rig = is_tiny ? std::make_unique<Rig>(*device, tiny_geometry, o)
                    : std::make_unique<Rig>(*device, standard_geometry, o,
                                            root.string(), fingerprint);
    }
    return *rig;
  };
  bool all_ok = true;
  std::uint64_t workload_id = 0;

  struct WriteOrLoad {
    std::string_view name;
    bool load, tiny;
    std::int64_t pages_per_op, count;
  };
  const WriteOrLoad copies[] = {
      {"write_p1", false, false, 1, 2000},      {"write_p16", false, false, 16, 150},
      {"load_p1", true, false, 1, 600},         {"load_p16", true, false, 16, 40},
      {"write_p1_tiny", false, true, 1, 20000}, {"load_p1_tiny", true, true, 1, 3000},
  };
  for (const WriteOrLoad& w : copies) {
    ++workload_id;
    if (!wanted(w.name)) continue;
    Rig& rig = rig_for(w.tiny);
    const Measure m = w.load ? run_loads(rig, workload_id, w.pages_per_op, scaled(w.count))
                             : run_writes(rig, workload_id, w.pages_per_op, scaled(w.count));
    all_ok &= report(w.name, rig, m, rig.clean());
  }

  struct StoragePair {
    std::string_view backup, prefetch;
    StorageSpec spec;
  };
  const StoragePair pairs[] = {
      {"backup_p16", "prefetch_p16", {16, 8, 14, 2}},
      {"backup_p4", "prefetch_p4", {4, 40, 10, 3}},
  };
  std::int32_t next_token = 1;  // fresh tokens for every backed-up op of the run
  for (const StoragePair& p : pairs) {
    if (!wanted(p.backup) && !wanted(p.prefetch)) continue;
    Rig& rig = rig_for(false);
    StorageSpec spec = p.spec;
    spec.rounds = scaled(spec.rounds);
    Measure backup, prefetch;
    StorageRounds(rig, spec, next_token).run(backup, prefetch);
    const bool clean = rig.clean();
    if (wanted(p.backup)) all_ok &= report(p.backup, rig, backup, clean);
    if (wanted(p.prefetch)) all_ok &= report(p.prefetch, rig, prefetch, clean);
  }

  for (const bool load : {false, true}) {
    if (!wanted(load ? "hybrid_load_p16" : "hybrid_write_p16")) continue;
    // Pools of their own (the standard rig's are released first: memory for both).
    standard.reset();
    tiny.reset();
    const auto r = hicache::opbench::run_hybrid(*device, load, scaled(7), o.quick ? 1 : 3);
    std::puts(r.line.dump().c_str());
    std::fflush(stdout);
    all_ok &= r.ok;
  }
  return all_ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const Options options = parse(argc, argv);
  try {
    return run(options);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hicache-opbench: %s\n", e.what());
    return 1;
  }
}
