// hicache-bench: the main job. Until the synthetic workload lands (issue: hicache-bench), it
// runs a smoke round trip through all three tiers and prints what it did: it builds the device
// and host KV pools on the chosen device backend, writes pages whose bytes derive from their
// keys into device memory, backs them up to host through the write thread (L1 -> L2), loads
// them back into fresh device pages layer by layer through the load thread (L2 -> L1), backs
// the host pages up to a file store in a temporary directory (L2 -> L3, the backup thread),
// drops them from host memory and prefetches them back (L3 -> L2: hit query, reservation,
// read, terminate), verifying every byte at every step.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <exception>
#include <string>
#include <string_view>
#include <vector>

#include <span>
#include <thread>

#include <filesystem>
#include <unistd.h>

#include "controller/hicache_controller.h"
#include "controller/storage_controller.h"
#include "storage/file_storage.h"
#include "pools/device_kv_pool.h"
#include "pools/host_kv_pool.h"
#include "pools/kv_pattern.h"
#include "transfer/device.h"
#include "transfer/errors.h"

namespace {

using hicache::str_cat;
using Clock = std::chrono::steady_clock;

struct Options {
  std::string device = "host";
  std::string layout = "layer_first";
  std::string dtype = "fp16";
  std::string io = "direct";
  int layers = 32, heads = 8, head_dim = 128, page_size = 64;
  long pages = 32;  // pages moved each way (the device pool holds twice that)
  double host_ratio = 2.0;
  std::string storage_dir;  // empty: a temporary directory
};

constexpr const char* kUsage = R"(usage: hicache-bench [options]
  --device auto|host|cuda     device backend (default host)
  --layout layer_first|page_first|page_first_direct   host layout (default layer_first)
  --dtype fp16|bf16|fp8|fp32  KV dtype (default fp16)
  --io direct|kernel          controller io backend (default direct)
  --layers N --heads N --head-dim N --page-size N   KV geometry (default 32 8 128 64)
  --pages N                   pages to move each way (default 32)
  --host-ratio X              host pool size as a ratio of the device pool (default 2)
  --storage-dir DIR           file store root (default: a fresh directory under /tmp, removed
                              at the end)
  --help
)";

[[noreturn]] void usage_error(const std::string& message) {
  std::fprintf(stderr, "hicache-bench: %s\n%s", message.c_str(), kUsage);
  std::exit(2);
}

long parse_long(std::string_view flag, const char* text) {
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(text, &end, 10);
  if (errno != 0 || end == text || *end != '\0' || v <= 0) {
    usage_error(str_cat(flag, ": '", text, "' is not a positive integer"));
  }
  return v;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string_view flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    if (i + 1 >= argc) usage_error(str_cat("unknown flag or missing value: ", flag));
    const char* value = argv[++i];
    if (flag == "--device") o.device = value;
    else if (flag == "--layout") o.layout = value;
    else if (flag == "--dtype") o.dtype = value;
    else if (flag == "--io") o.io = value;
    else if (flag == "--layers") o.layers = static_cast<int>(parse_long(flag, value));
    else if (flag == "--heads") o.heads = static_cast<int>(parse_long(flag, value));
    else if (flag == "--head-dim") o.head_dim = static_cast<int>(parse_long(flag, value));
    else if (flag == "--page-size") o.page_size = static_cast<int>(parse_long(flag, value));
    else if (flag == "--pages") o.pages = parse_long(flag, value);
    else if (flag == "--storage-dir") o.storage_dir = value;
    else if (flag == "--host-ratio") {
      char* end = nullptr;
      o.host_ratio = std::strtod(value, &end);
      if (end == value || *end != '\0' || !(o.host_ratio > 0)) {
        usage_error(str_cat("--host-ratio: '", value, "' is not a positive number"));
      }
    } else {
      usage_error(str_cat("unknown flag: ", flag));
    }
  }
  return o;
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Drains acks until `n` arrived (the smoke run has nothing else to do meanwhile).
std::vector<hicache::Ack> wait_acks(hicache::HiCacheController& c, bool write, std::size_t n) {
  std::vector<hicache::Ack> acks;
  while (acks.size() < n) {
    write ? c.drain_write_acks(acks) : c.drain_load_acks(acks);
    std::this_thread::yield();
  }
  return acks;
}

int run(const Options& o) {
  auto device = hicache::Device::create(o.device);
  const auto geometry = hicache::KVGeometry::mha(o.layers, o.heads, o.head_dim,
                                                 hicache::parse_dtype(o.dtype), o.page_size);
  const auto layout = hicache::parse_host_layout(o.layout);
  hicache::ControllerConfig config;
  config.io_backend = hicache::parse_io_backend(o.io);
  std::printf("[hicache-bench] device: %s\n", device->name().c_str());
  std::printf("[hicache-bench] geometry: %s\n", geometry.describe().c_str());

  auto t0 = Clock::now();
  hicache::DeviceKVPool device_pool(*device, geometry, 2 * o.pages * o.page_size);
  const std::int64_t host_tokens = hicache::HostPoolSize{.ratio = o.host_ratio}.resolve_tokens(
      geometry, device_pool.capacity_tokens());
  hicache::HostKVPool host_pool(*device, geometry, layout, host_tokens);
  hicache::HiCacheController controller(*device, device_pool, host_pool, config);
  std::printf("[hicache-bench] pools: device %lld tokens (%.1f MiB), host %lld tokens (%.1f MiB, "
              "%s), io %s, created in %.3f s\n",
              static_cast<long long>(device_pool.capacity_tokens()),
              device_pool.size_bytes() / 1048576.0, static_cast<long long>(host_tokens),
              host_pool.size_bytes() / 1048576.0, o.layout.c_str(), o.io.c_str(),
              seconds_since(t0));

  // Staging buffer in the device layout, CPU-addressable on every backend.
  hicache::Buffer staging = device->alloc_host(device_pool.size_bytes());
  hicache::LayoutDesc staging_desc = device_pool.layout();
  staging_desc.base = reinterpret_cast<std::uint8_t*>(staging.data());
  auto stream = device->create_stream();

  // 1. The "forward pass": fill device pages with data derived from their keys.
  auto& allocator = device_pool.allocator();
  auto device_slots = allocator.alloc(o.pages * o.page_size);
  if (!device_slots) throw hicache::Error("device pool too small");
  std::vector<std::int64_t> src_pages;
  hicache::slots_to_pages(*device_slots, o.page_size, allocator.num_pages(), "smoke", src_pages);
  for (std::int64_t page : src_pages) hicache::fill_page(staging_desc, page, 1000 + page);
  stream->copy_async(device_pool.layout().base, staging.data(), device_pool.size_bytes());
  stream->synchronize();

  // 2. L1 -> L2: one write per page, acknowledged by node id (= index).
  t0 = Clock::now();
  std::vector<std::int64_t> host_slots;
  for (long i = 0; i < o.pages; ++i) {
    auto h = controller.write(std::span(*device_slots).subspan(i * o.page_size, o.page_size), 0,
                              hicache::NodeId{i});
    if (!h) throw hicache::Error("host pool too small");
    host_slots.insert(host_slots.end(), h->begin(), h->end());
  }
  long failed = 0;
  for (const auto& ack : wait_acks(controller, true, static_cast<std::size_t>(o.pages))) {
    failed += !ack.ok;
  }
  const double write_s = seconds_since(t0);
  std::vector<std::int64_t> host_pages;
  hicache::slots_to_pages(host_slots, o.page_size, host_pool.num_pages(), "smoke", host_pages);
  long bad = 0;
  for (std::size_t i = 0; i < host_pages.size(); ++i) {
    bad += !hicache::verify_page(host_pool.layout(), host_pages[i], 1000 + src_pages[i]);
  }
  // Evict the device copy: the host now holds the only copy above storage.
  controller.evict_device(*device_slots, host_slots);
  std::memset(staging.data(), 0, staging.size());
  stream->copy_async(device_pool.layout().base, staging.data(), device_pool.size_bytes());
  stream->synchronize();

  // 3. L2 -> L1 into fresh device slots, layer by layer, as a forward pass consumes it.
  t0 = Clock::now();
  auto back = controller.load(host_slots, 0, hicache::NodeId{0});
  if (!back) throw hicache::Error("device pool too small");
  const std::int32_t slot = controller.start_loading();
  for (std::int32_t layer = 0; layer < geometry.num_layers; ++layer) {
    device_pool.wait_for_layer(layer);
  }
  const double load_s = seconds_since(t0);
  controller.layer_done_counter().release(slot);
  for (const auto& ack : wait_acks(controller, false, 1)) failed += !ack.ok;
  stream->copy_async(staging.data(), device_pool.layout().base, device_pool.size_bytes());
  stream->synchronize();
  std::vector<std::int64_t> back_pages;
  hicache::slots_to_pages(*back, o.page_size, allocator.num_pages(), "smoke", back_pages);
  for (std::size_t i = 0; i < back_pages.size(); ++i) {
    bad += !hicache::verify_page(staging_desc, back_pages[i], 1000 + src_pages[i]);
  }

  const double bytes = static_cast<double>(o.pages) * geometry.page_bytes();
  std::printf("[hicache-bench] L1->L2: %ld writes of 1 page, %.1f MiB in %.4f s (%.2f GB/s)\n",
              o.pages, bytes / 1048576.0, write_s, bytes / write_s / 1e9);
  std::printf("[hicache-bench] L2->L1: 1 load of %ld pages, layer by layer, %.1f MiB in %.4f s "
              "(%.2f GB/s)\n",
              o.pages, bytes / 1048576.0, load_s, bytes / load_s / 1e9);
  controller.evict_device(*back, host_slots);

  // 4. L2 -> L3: back the host pages up to a file store under their chained page keys.
  namespace fs = std::filesystem;
  const bool temporary = o.storage_dir.empty();
  const fs::path root = temporary ? fs::temp_directory_path() /
                                        str_cat("hicache-bench-", ::getpid())
                                  : fs::path(o.storage_dir);
  long storage_pages = 0;
  {
    hicache::FileStorage store(hicache::FileStorageConfig{.root = root.string()});
    hicache::LocalCollective local;
    const hicache::KeyNamespace ns{.model = "hicache-bench", .fingerprint = "smoke",
                                   .dtype = o.dtype, .layout = o.layout,
                                   .page_size = o.page_size};
    hicache::StorageController storage(host_pool, store, ns, local, local, local);
    std::vector<std::int32_t> tokens(static_cast<std::size_t>(o.pages * o.page_size));
    for (std::size_t t = 0; t < tokens.size(); ++t) tokens[t] = static_cast<std::int32_t>(t * 7 + 1);
    hicache::PageKeyer keyer(ns);
    std::vector<std::string> keys;
    keyer.keys(tokens, nullptr, keys);
    t0 = Clock::now();
    storage.write_storage(host_slots, keys);
    std::vector<hicache::BackupAck> backup;
    while (storage.drain_backup_acks(backup) == 0) std::this_thread::yield();
    const double backup_s = seconds_since(t0);
    if (backup[0].completed_tokens != backup[0].total_tokens) {
      std::fprintf(stderr, "[hicache-bench] backup stored %lld of %lld tokens: %s\n",
                   static_cast<long long>(backup[0].completed_tokens),
                   static_cast<long long>(backup[0].total_tokens), backup[0].error.c_str());
      ++failed;
    }
    // The host copy goes; storage holds the only copy now.
    controller.evict_host(host_slots);

    // 5. L3 -> L2: prefetch the sequence back into fresh host pages.
    t0 = Clock::now();
    auto op = storage.prefetch("smoke", tokens);
    while (op->stage() == hicache::PrefetchStage::kQueued ||
           op->stage() == hicache::PrefetchStage::kLoading) {
      std::this_thread::yield();
    }
    const hicache::PrefetchResult got = storage.terminate_prefetch(*op);
    const double prefetch_s = seconds_since(t0);
    storage_pages = static_cast<long>(got.keys.size());
    if (storage_pages != o.pages) {
      std::fprintf(stderr, "[hicache-bench] prefetch returned %ld of %ld pages: %s\n",
                   storage_pages, o.pages, op->error().c_str());
      ++failed;
    }
    std::vector<std::int64_t> fetched_pages;
    hicache::slots_to_pages(got.host_slots, o.page_size, host_pool.num_pages(), "smoke",
                            fetched_pages);
    for (std::size_t i = 0; i < fetched_pages.size(); ++i) {
      bad += !hicache::verify_page(host_pool.layout(), fetched_pages[i], 1000 + src_pages[i]);
    }
    if (!got.host_slots.empty()) host_pool.free(got.host_slots);
    std::printf("[hicache-bench] L2->L3: backup of %ld pages to %s, %.1f MiB in %.4f s "
                "(%.2f GB/s)\n",
                o.pages, root.c_str(), bytes / 1048576.0, backup_s, bytes / backup_s / 1e9);
    std::printf("[hicache-bench] L3->L2: prefetch of %ld pages (hit query, reservation, read), "
                "%.1f MiB in %.4f s (%.2f GB/s)\n",
                storage_pages, bytes / 1048576.0, prefetch_s, bytes / prefetch_s / 1e9);
    if (temporary) {
      store.clear();
      store.flush_trash();
    }
  }
  if (temporary) {
    std::error_code ec;
    fs::remove_all(root, ec);
  }
  const bool clean = host_pool.free_tokens() == host_pool.capacity_tokens() &&
                     allocator.free_tokens() == allocator.capacity_tokens();
  std::printf("[hicache-bench] verified %ld pages across L1, L2 and L3: %ld mismatches, %ld "
              "failures; pools clean: %s\n",
              2 * o.pages + storage_pages, bad, failed, clean ? "yes" : "no");
  return bad == 0 && failed == 0 && clean ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const Options options = parse(argc, argv);
  try {
    return run(options);
  } catch (const hicache::InvalidArgument& e) {
    usage_error(e.what());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hicache-bench: %s\n", e.what());
    return 1;
  }
}
