// Storage benchmarks (issue figures), each against a baseline measured in the same run:
//   page keys: chained SHA-256 over 64-token pages (pages/s; target >= 1M/s);
//   FileStorage batch_exists from the in-memory index (keys/s; target >= 1M/s);
//   FileStorage batch_exists of absent keys beside another live instance (shared, detected:
//   remembered absent, and asked of the disk) against the store alone (its index answers);
//   FileStorage batch_set / batch_get of 8 MiB and 256 KiB pages (GB/s) against fio on the same
//   directory: sequential 1 MiB blocks, buffered and O_DIRECT (target >= 0.8 of fio buffered);
//   batch_set is also run in pairs with fio's write, each side after a sync (the ratio of record);
//   StorageController backup and prefetch through FileStorage and RedisStorage (a redis-server
//   started here on a free loopback port), same shapes, against the store's
//   own batch_set / batch_get (target >= 0.9).
// The directory is $HICACHE_BENCH_DIR (default /var/tmp); fio is optional (without it the
// baseline lines say so).
#include <benchmark/benchmark.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <numeric>
#include <string>
#include <thread>

#include "controller/storage_controller.h"
#include "pools/kv_pattern.h"
#include "storage/collective.h"
#include "storage/file_storage.h"
#include "storage/redis_storage.h"
#include "controller/hicache.h"
#include "tools/support/redis_launcher.h"
#include "storage/page_key.h"
#include "storage/record.h"
#include "transfer/errors.h"
#include "transfer/host_device.h"
#include "transfer/host_memory.h"

namespace {

using namespace hicache;
namespace fs = std::filesystem;

fs::path bench_dir() {
  const char* env = std::getenv("HICACHE_BENCH_DIR");
  return fs::path(env != nullptr ? env : "/var/tmp") / str_cat("hicache-storagebench-", ::getpid());
}

KeyNamespace bench_ns() {
  return {.model = "bench", .fingerprint = "r1", .dtype = "fp16", .layout = "page_first",
          .page_size = 64};
}

void BM_PageKeys(benchmark::State& state) {
  PageKeyer keyer(bench_ns());
  std::vector<std::int32_t> tokens(64 * 1024);
  std::iota(tokens.begin(), tokens.end(), 1000);
  std::vector<std::string> keys;
  for (auto _ : state) {
    keys.clear();
    keyer.keys(tokens, nullptr, keys);
    benchmark::DoNotOptimize(keys.data());
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * 1024));
}
BENCHMARK(BM_PageKeys)->Unit(benchmark::kMillisecond);

// min_allreduce of 5 int64 (the widest the controllers fuse, plus the call check) among N
// in-process ranks, one thread each: the latency each TP agreement costs (issue figure).
void BM_InProcessMinAllreduce(benchmark::State& state) {
  const int size = static_cast<int>(state.range(0));
  constexpr int kCalls = 2000;
  std::int64_t calls = 0;
  for (auto _ : state) {
    auto ranks = InProcessGroup::make_ranks(size);
    std::vector<std::thread> threads;
    for (auto& c : ranks) {
      threads.emplace_back([&c] {
        std::vector<std::int64_t> v(5);
        for (int i = 0; i < kCalls; ++i) {
          std::fill(v.begin(), v.end(), c->rank() + i);
          c->min_allreduce(v, "bench");
        }
      });
    }
    for (auto& t : threads) t.join();
    calls += kCalls;
  }
  // Seconds per call (printed with a unit prefix, e.g. 15.5u).
  state.counters["per_call"] = benchmark::Counter(
      static_cast<double>(calls), benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}
BENCHMARK(BM_InProcessMinAllreduce)->Arg(2)->Arg(4)->UseRealTime()->Unit(benchmark::kMillisecond);

void BM_FileExists(benchmark::State& state) {
  const fs::path dir = bench_dir() / "exists";
  FileStorage store(FileStorageConfig{.root = dir.string(), .io_threads = 0});
  PageKeyer keyer(bench_ns());
  std::vector<std::int32_t> tokens(64 * 4096);
  std::iota(tokens.begin(), tokens.end(), 7);
  std::vector<std::string> keys;
  keyer.keys(tokens, nullptr, keys);
  std::vector<std::byte> page(512);
  std::vector<ConstByteSpan> spans(keys.size(), ConstByteSpan(page));
  store.batch_set(keys, spans);
  for (auto _ : state) benchmark::DoNotOptimize(store.batch_exists(keys));
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * keys.size()));
  store.clear();
  store.flush_trash();
  fs::remove_all(dir);
}
BENCHMARK(BM_FileExists)->Unit(benchmark::kMillisecond);

// The page keys of `pages` pages of consecutive token ids from `first_token`.
std::vector<std::string> page_keys(std::size_t pages, std::int32_t first_token) {
  PageKeyer keyer(bench_ns());
  std::vector<std::int32_t> tokens(64 * pages);
  std::iota(tokens.begin(), tokens.end(), first_token);
  std::vector<std::string> keys;
  keyer.keys(tokens, nullptr, keys);
  return keys;
}

// batch_exists of 4096 stored keys in one batch. arg 0: the store alone (its index answers);
// 1: beside another live instance (shared): each key was found on disk before and no instance
// removed a record since (trusted, no disk query); 2: shared, after another instance removed a
// record (each key asked of the disk again: one fstatat; the other instance stores and removes
// one record before each iteration, untimed).
void BM_FileExistsStored(benchmark::State& state) {
  const int mode = static_cast<int>(state.range(0));
  const fs::path dir = bench_dir() / "stored";
  fs::remove_all(dir);
  const FileStorageConfig config{.root = dir.string(), .io_threads = 0};
  const std::vector<std::string> keys = page_keys(4096, 13);
  std::vector<std::byte> page(512);
  FileStorage store(config);
  std::vector<ConstByteSpan> spans(keys.size(), ConstByteSpan(page));
  store.batch_set(keys, spans);
  std::unique_ptr<FileStorage> other;
  if (mode != 0) other = std::make_unique<FileStorage>(config);
  store.batch_exists(keys);  // found on disk once
  std::size_t hits = 0;
  std::int64_t removed = 0;
  const std::vector<ConstByteSpan> one{ConstByteSpan(page)};
  for (auto _ : state) {
    if (mode == 2) {
      state.PauseTiming();
      const std::string victim = str_cat("removed-", removed++);
      other->batch_set(std::span(&victim, 1), one);
      other->remove(victim);
      state.ResumeTiming();
    }
    hits += store.batch_exists(keys);
  }
  if (hits != state.iterations() * keys.size()) state.SkipWithError("a stored key was missed");
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * keys.size()));
  other.reset();
  store.clear();
  store.flush_trash();
  fs::remove_all(dir);
}
BENCHMARK(BM_FileExistsStored)->Arg(0)->Arg(1)->Arg(2)->Repetitions(3)
    ->Unit(benchmark::kMillisecond);

// batch_exists of absent keys, one key per call (SGLang's prefix query stops at its first miss),
// 4096 keys, over a root holding 1024 records. arg 0: the store alone (its index answers, no
// disk query: the answer of a store that is not shared); 1: beside another live instance of the
// same root (shared, detected), asked again: each key is remembered absent since its first
// lookup; 2: shared, each key asked for the first time since the other instance published a
// record (one fstatat each: the other instance stores one record before each iteration, untimed).
void BM_FileExistsAbsent(benchmark::State& state) {
  const int mode = static_cast<int>(state.range(0));
  const fs::path dir = bench_dir() / "absent";
  fs::remove_all(dir);
  const FileStorageConfig config{.root = dir.string(), .io_threads = 0};
  const std::vector<std::string> keys = page_keys(5120, 11);
  const std::vector<std::string> stored(keys.begin(), keys.begin() + 1024);
  const std::vector<std::string> absent(keys.begin() + 1024, keys.end());
  std::vector<std::byte> page(512);
  {
    std::unique_ptr<FileStorage> store = std::make_unique<FileStorage>(config);
    std::vector<ConstByteSpan> spans(stored.size(), ConstByteSpan(page));
    store->batch_set(stored, spans);
  }
  FileStorage store(config);
  std::unique_ptr<FileStorage> other;
  if (mode != 0) other = std::make_unique<FileStorage>(config);
  auto ask_all = [&] {
    std::size_t hits = 0;
    for (const std::string& k : absent) hits += store.batch_exists(std::span(&k, 1));
    return hits;
  };
  if (mode == 1) ask_all();  // remembered from here on
  std::size_t hits = 0;
  std::int64_t published = 0;
  const std::vector<ConstByteSpan> one{ConstByteSpan(page)};
  for (auto _ : state) {
    if (mode == 2) {
      state.PauseTiming();
      const std::vector<std::string> fresh{str_cat("published-", published++)};
      other->batch_set(fresh, one);
      state.ResumeTiming();
    }
    hits += ask_all();
  }
  if (hits != 0) state.SkipWithError("an absent key was reported present");
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * absent.size()));
  other.reset();
  store.clear();
  store.flush_trash();
  fs::remove_all(dir);
}
BENCHMARK(BM_FileExistsAbsent)->Arg(0)->Arg(1)->Arg(2)->Repetitions(3)
    ->Unit(benchmark::kMillisecond);

// batch_set into a full store, every record evicting an older one: the cost per record must not
// grow with the batch (arg: records per batch). 512-byte payloads, a store of 8192 records.
void BM_FileEvictingSet(benchmark::State& state) {
  const auto batch = static_cast<std::size_t>(state.range(0));
  const fs::path dir = bench_dir() / "evict";
  fs::remove_all(dir);
  constexpr std::size_t kRecords = 8192, kPayload = 512;
  const std::uint64_t record = record_head_bytes("e-00000000-0000000") + kPayload;
  FileStorage store(FileStorageConfig{.root = dir.string(), .capacity_bytes = kRecords * record,
                                      .io_threads = 1});
  std::vector<std::byte> page(kPayload, std::byte{7});
  const auto fill = [&](std::uint64_t round, std::size_t n) {
    std::vector<std::string> keys;
    for (std::size_t i = 0; i < n; ++i) keys.push_back(str_cat("e-", 10000000 + round, "-", 1000000 + i));
    std::vector<ConstByteSpan> spans(n, ConstByteSpan(page));
    return std::pair{keys, spans};
  };
  {
    auto [keys, spans] = fill(0, kRecords);  // full: every later record evicts one
    store.batch_set(keys, spans);
  }
  std::uint64_t round = 1;
  for (auto _ : state) {
    state.PauseTiming();
    auto [keys, spans] = fill(round++, batch);
    state.ResumeTiming();
    benchmark::DoNotOptimize(store.batch_set(keys, spans));
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * batch));
  store.clear();
  store.flush_trash();
  fs::remove_all(dir);
}
BENCHMARK(BM_FileEvictingSet)->Arg(16)->Arg(4096)->UseRealTime()->Unit(benchmark::kMillisecond);

// Warm restart of a file store holding N records (args: N, 1 = from the clean close's index
// snapshot, 0 = the directory scan a crash leaves): the time to open it. Target: 1e6 records in
// <= 1 s from the snapshot. Keys of 66 characters, as a page key's hex digest; 64-byte payloads.
void BM_FileWarmRestart(benchmark::State& state) {
  const auto records = static_cast<std::size_t>(state.range(0));
  const bool snapshot = state.range(1) != 0;
  const fs::path dir = bench_dir() / str_cat("warm-", records);
  static std::map<std::size_t, bool> made;
  if (!made[records]) {
    fs::remove_all(dir);
    FileStorage store(FileStorageConfig{.root = dir.string(), .io_threads = 4});
    std::vector<std::byte> page(64, std::byte{3});
    for (std::size_t at = 0; at < records; at += 4096) {
      std::vector<std::string> keys;
      for (std::size_t i = at; i < std::min(records, at + 4096); ++i) {
        char hex[67];
        std::snprintf(hex, sizeof hex, "w-%064llx", static_cast<unsigned long long>(i) * 0x9e3779b97f4a7c15ULL);
        keys.emplace_back(hex);
      }
      std::vector<ConstByteSpan> spans(keys.size(), ConstByteSpan(page));
      store.batch_set(keys, spans);
    }
    made[records] = true;
  }
  for (auto _ : state) {
    state.PauseTiming();
    if (!snapshot) fs::remove(dir / ".index");
    state.ResumeTiming();
    auto store = std::make_unique<FileStorage>(FileStorageConfig{.root = dir.string()});
    state.PauseTiming();
    if (store->stats().stored_keys != records || store->started_from_snapshot() != snapshot) {
      state.SkipWithError(str_cat("opened with ", store->stats().stored_keys, " records, snapshot ",
                                  store->started_from_snapshot()).c_str());
    }
    store.reset();  // the clean close writes the snapshot again
    state.ResumeTiming();
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * records));
}
BENCHMARK(BM_FileWarmRestart)
    ->ArgsProduct({{100'000, 1'000'000}, {1, 0}})
    ->Iterations(3)
    ->Unit(benchmark::kMillisecond);

// A batch of `pages` pages of `page_bytes`, in one pre-faulted buffer filled with key data.
struct PageBatch {
  std::vector<std::string> keys;
  Buffer memory;
  std::vector<ConstByteSpan> src;
  std::vector<ByteSpan> dst;
  PageBatch(const std::string& stem, std::size_t pages, std::size_t page_bytes)
      : memory(map_host_memory(pages * page_bytes)) {
    auto* base = static_cast<std::byte*>(memory.data());
    for (std::size_t i = 0; i < pages; ++i) {
      keys.push_back(str_cat(stem, "-", i));
      ByteSpan span(base + i * page_bytes, page_bytes);
      fill_pattern(span, i, 0, 0);
      src.emplace_back(span);
      dst.push_back(span);
    }
  }
  void rename(std::uint64_t round) {
    for (std::size_t i = 0; i < keys.size(); ++i) keys[i] = str_cat("r", round, "-", i);
  }
};

// args: page KiB, pages per batch
void BM_FileSet(benchmark::State& state) {
  const std::size_t page_bytes = static_cast<std::size_t>(state.range(0)) << 10;
  const auto pages = static_cast<std::size_t>(state.range(1));
  const fs::path dir = bench_dir() / "set";
  // Capacity of a few batches: eviction (rename to trash, unlink in the background) runs as it
  // would in a full store.
  FileStorage store(FileStorageConfig{.root = dir.string(),
                                      .capacity_bytes = 4 * pages * (page_bytes + 4096)});
  PageBatch batch("set", pages, page_bytes);
  std::uint64_t round = 0;
  for (auto _ : state) {
    batch.rename(round++);  // fresh keys: nothing is deduplicated away
    for (const auto& r : store.batch_set(batch.keys, batch.src)) {
      if (!r.is_ok()) state.SkipWithError(r.reason.c_str());
    }
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * pages * page_bytes));
  store.clear();
  store.flush_trash();
  fs::remove_all(dir);
}

void BM_FileGet(benchmark::State& state) {
  const std::size_t page_bytes = static_cast<std::size_t>(state.range(0)) << 10;
  const auto pages = static_cast<std::size_t>(state.range(1));
  const fs::path dir = bench_dir() / "get";
  FileStorage store(FileStorageConfig{.root = dir.string()});
  PageBatch batch("get", pages, page_bytes);
  store.batch_set(batch.keys, batch.src);
  for (auto _ : state) {
    for (const auto& r : store.batch_get(batch.keys, batch.dst)) {
      if (!r.is_ok()) state.SkipWithError(r.reason.c_str());
    }
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * pages * page_bytes));
  store.clear();
  store.flush_trash();
  fs::remove_all(dir);
}
// Four batches (512 MiB of 8 MiB pages, 256 MiB of 256 KiB ones): the same bytes in the same
// number of new files as the fio baseline writes.
BENCHMARK(BM_FileSet)->Args({8192, 16})->Args({256, 256})->Iterations(4)->Repetitions(3)
    ->ReportAggregatesOnly(true)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_FileGet)->Args({8192, 16})->Args({256, 256})->Repetitions(3)
    ->ReportAggregatesOnly(true)->UseRealTime()->Unit(benchmark::kMillisecond);

// A page_first host pool of `pages` pages of `page_bytes` (32 layers x 8 heads x 128 dims fp16:
// 128 KiB per token, so 8 MiB pages hold 64 tokens and 256 KiB pages 2), a store (backend 0:
// a file store; 1: RedisStorage on a redis-server this tool starts on a free loopback port) and
// a storage controller on one rank.
std::shared_ptr<StorageBackend> redis_store_or_null() {
  static std::unique_ptr<bench::RedisDeployment> server;
  static std::shared_ptr<RedisStorage> store;
  if (!server) {
    server = std::make_unique<bench::RedisDeployment>();
    std::string error;
    if (!server->start(1, false, &error)) {
      std::fprintf(stderr, "storagebench: cannot start redis-server: %s\n", error.c_str());
      return nullptr;
    }
    RedisConfig config;
    config.nodes = {{"127.0.0.1", static_cast<std::uint16_t>(server->ports()[0])}};
    store = std::make_shared<RedisStorage>(config);
  }
  return store;
}

// The cache the library builds (HiCache) around that host pool and store; the bench drives its
// StorageController directly.
struct ControllerRig {
  fs::path dir;
  std::shared_ptr<FileStorage> file;
  std::shared_ptr<StorageBackend> store;
  std::unique_ptr<HiCache> hc;
  KVGeometry g;
  HostKVPool* host_pool = nullptr;
  StorageController* ctl = nullptr;
  EventSignal* events = nullptr;
  ControllerRig(std::size_t page_bytes, std::size_t pages, const char* name, std::uint64_t capacity,
                int backend)
      : dir(bench_dir() / name) {
    if (backend == 0) {
      file = std::make_shared<FileStorage>(
          FileStorageConfig{.root = dir.string(), .capacity_bytes = capacity});
      store = file;
    } else {
      store = redis_store_or_null();
      if (store == nullptr) return;
      store->clear();
    }
    const auto page = static_cast<std::int64_t>(page_bytes / (128 << 10));
    // The controller's default batch (as many pages as make 64 MiB per storage call); every
    // hit prefetched (no threshold beyond one page).
    const nlohmann::json config = {
        {"device", "host"},
        {"page_size", page},
        {"device_tokens", page},
        {"host_tokens", static_cast<std::int64_t>(2 * pages) * page},
        {"host_layout", "page_first"},
        {"model", {{"layers", 32}, {"kv_heads", 8}, {"head_dim", 128}, {"dtype", "fp16"}}},
        {"model_name", "bench"},
        {"model_fingerprint", "r1"},
        {"prefetch_threshold_tokens", 0}};
    HiCacheParts parts;
    parts.storage = store;
    hc = std::make_unique<HiCache>(HiCacheConfig::from_json_text(config.dump()), std::move(parts));
    g = hc->config().geometry;
    host_pool = &hc->host_pool();
    ctl = hc->storage_controller();
    events = hc->controller().events().get();
  }
  HostKVPool& host() { return *host_pool; }
  const KeyNamespace& ns() const { return hc->key_namespace(); }
  ~ControllerRig() {
    hc.reset();
    if (store != nullptr) store->clear();
    if (file) file->flush_trash();
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
};

// Paired measurements (disk figures drift within seconds here): each iteration times the
// store's own call and the controller's op on the same bytes, alternating which goes first, and
// reports both rates and their ratio.
using Clock = std::chrono::steady_clock;

// How the bench waits for the controller, as an engine's main loop with nothing else to do:
// asleep on the controller's event signal until `done()` (checked after reading the signal, so
// no event is missed). Spinning here would take one of the machine's two cores from the store's
// own threads (and redis-server) and charge that to the controller.
template <typename Done>
void wait_until(EventSignal& events, Done done) {
  for (;;) {
    const std::uint64_t seen = events.seq();
    if (done()) return;
    events.wait(seen);
  }
}

void report_pair(benchmark::State& state, double bytes, double store_s, double ctl_s) {
  state.counters["store_GBps"] = bytes / store_s / 1e9;
  state.counters["controller_GBps"] = bytes / ctl_s / 1e9;
  state.counters["ratio"] = store_s / ctl_s;
}

void BM_BackupVsSet(benchmark::State& state) {
  const std::size_t page_bytes = static_cast<std::size_t>(state.range(0)) << 10;
  const auto pages = static_cast<std::size_t>(state.range(1));
  ControllerRig rig(page_bytes, pages, "backup", 8 * pages * (page_bytes + 4096),
                    static_cast<int>(state.range(2)));
  if (!rig.ctl) return state.SkipWithError("no redis-server");
  const auto slots = *rig.host().alloc(static_cast<std::int64_t>(pages) * rig.g.page_size);
  std::vector<ConstByteSpan> spans;
  for (std::size_t i = 0; i < pages; ++i) {
    const std::int64_t page = slots[i * rig.g.page_size] / rig.g.page_size;
    fill_page(rig.host().layout(), page, i);
    spans.push_back(rig.host().page_bytes(page));
  }
  std::vector<BackupAck> acks;
  double store_s = 0, ctl_s = 0;
  std::uint64_t round = 0;
  for (auto _ : state) {
    std::vector<std::string> set_keys, backup_keys;
    for (std::size_t i = 0; i < pages; ++i) {
      set_keys.push_back(str_cat("s", round, "-", i));
      backup_keys.push_back(str_cat("b", round, "-", i));
    }
    for (int half = 0; half < 2; ++half) {
      const auto t0 = Clock::now();
      if ((half + round) % 2 == 0) {
        for (const auto& r : rig.store->batch_set(set_keys, spans)) {
          if (!r.is_ok()) state.SkipWithError(r.reason.c_str());
        }
        store_s += std::chrono::duration<double>(Clock::now() - t0).count();
      } else {
        rig.ctl->write_storage(slots, backup_keys);
        acks.clear();
        wait_until(*rig.events, [&] { return rig.ctl->drain_backup_acks(acks) > 0; });
        if (acks[0].completed_tokens != acks[0].total_tokens) {
          state.SkipWithError(acks[0].error.c_str());
        }
        ctl_s += std::chrono::duration<double>(Clock::now() - t0).count();
      }
    }
    ++round;
  }
  report_pair(state, static_cast<double>(state.iterations() * pages * page_bytes), store_s, ctl_s);
}

void BM_PrefetchVsGet(benchmark::State& state) {
  const std::size_t page_bytes = static_cast<std::size_t>(state.range(0)) << 10;
  const auto pages = static_cast<std::size_t>(state.range(1));
  ControllerRig rig(page_bytes, pages, "prefetch", 0, static_cast<int>(state.range(2)));
  if (!rig.ctl) return state.SkipWithError("no redis-server");
  std::vector<std::int32_t> tokens(pages * static_cast<std::size_t>(rig.g.page_size));
  std::iota(tokens.begin(), tokens.end(), 11);
  PageKeyer keyer(rig.ns());
  std::vector<std::string> keys;
  keyer.keys(tokens, nullptr, keys);
  const auto slots = *rig.host().alloc(static_cast<std::int64_t>(tokens.size()));
  std::vector<ByteSpan> spans;
  for (std::size_t i = 0; i < pages; ++i) {
    spans.push_back(rig.host().page_bytes(slots[i * rig.g.page_size] / rig.g.page_size));
  }
  rig.ctl->write_storage(slots, keys);
  std::vector<BackupAck> acks;
  wait_until(*rig.events, [&] { return rig.ctl->drain_backup_acks(acks) > 0; });
  double store_s = 0, ctl_s = 0;
  std::uint64_t round = 0;
  for (auto _ : state) {
    for (int half = 0; half < 2; ++half) {
      const auto t0 = Clock::now();
      if ((half + round) % 2 == 0) {
        for (const auto& r : rig.store->batch_get(keys, spans)) {
          if (!r.is_ok()) state.SkipWithError(r.reason.c_str());
        }
        store_s += std::chrono::duration<double>(Clock::now() - t0).count();
      } else {
        auto op = rig.ctl->prefetch("bench", tokens);
        wait_until(*rig.events, [&] {
          return op->stage() != PrefetchStage::kQueued && op->stage() != PrefetchStage::kLoading;
        });
        const PrefetchResult res = rig.ctl->terminate_prefetch(*op);
        if (res.tokens != static_cast<std::int64_t>(tokens.size())) {
          state.SkipWithError("short prefetch");
        }
        rig.host().free(res.host_slots);
        ctl_s += std::chrono::duration<double>(Clock::now() - t0).count();
      }
    }
    ++round;
  }
  report_pair(state, static_cast<double>(state.iterations() * pages * page_bytes), store_s, ctl_s);
}
// Third argument: 0 file store, 1 Redis.
BENCHMARK(BM_BackupVsSet)->Args({8192, 16, 0})->Args({256, 256, 0})->Args({8192, 16, 1})
    ->Args({256, 256, 1})->Iterations(6)
    ->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_PrefetchVsGet)->Args({8192, 16, 0})->Args({256, 256, 0})->Args({8192, 16, 1})
    ->Args({256, 256, 1})->Iterations(20)
    ->UseRealTime()->Unit(benchmark::kMillisecond);

class RatioReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& run : runs) {
      if (auto it = run.counters.find("bytes_per_second"); it != run.counters.end()) {
        bytes_per_s[run.benchmark_name()] = it->second;
      }
      if (auto it = run.counters.find("items_per_second"); it != run.counters.end()) {
        items_per_s[run.benchmark_name()] = it->second;
      }
      if (auto it = run.counters.find("ratio"); it != run.counters.end()) {
        pairs[run.benchmark_name()] = {run.counters.at("controller_GBps"),
                                       run.counters.at("store_GBps"), it->second};
      }
    }
  }
  std::map<std::string, double> bytes_per_s, items_per_s;
  struct Pair {
    double controller, store, ratio;
  };
  std::map<std::string, Pair> pairs;
};

// One fio run shaped like a benchmark: `files` new files of `file_bytes`, written (or read back)
// sequentially in blocks of min(1 MiB, file size) with psync, buffered or O_DIRECT. Returns
// bytes/s, or 0 without fio. A read reads the files the last write left in `dir`.
double fio_once(const fs::path& dir, std::size_t file_bytes, std::size_t files, bool write,
                bool direct) {
  const fs::path out = bench_dir() / "fio.json";
  const char* mode = write ? "write" : "read";
  const std::string cmd = str_cat(
      "fio --name=seq --directory=", dir.string(), " --rw=", mode,
      " --bs=", std::min<std::size_t>(file_bytes, 1 << 20), " --nrfiles=", files,
      " --filesize=", file_bytes, " --size=", files * file_bytes,
      " --ioengine=psync --create_on_open=", write ? 1 : 0, " --direct=", direct ? 1 : 0,
      " --output-format=json --output=", out.string(), " >/dev/null 2>&1");
  if (std::system(cmd.c_str()) != 0) return 0;
  try {
    std::FILE* f = std::fopen(out.c_str(), "r");
    if (f == nullptr) return 0;
    const auto j = nlohmann::json::parse(f);
    std::fclose(f);
    return j.at("jobs").at(0).at(mode).at("bw_bytes").get<double>();
  } catch (const std::exception&) {
    return 0;
  }
}

// fio write then read of the files, three times on a fresh directory; the medians as
// {write, read} bytes/s, or {0, 0} without fio.
std::pair<double, double> run_fio(const fs::path& dir, std::size_t file_bytes, std::size_t files,
                                  bool direct) {
  std::vector<double> bw[2];
  for (int rep = 0; rep < 3; ++rep) {
    std::error_code ec;
    fs::remove_all(dir, ec);
    fs::create_directories(dir);
    for (int m = 0; m < 2; ++m) {
      const double b = fio_once(dir, file_bytes, files, /*write=*/m == 0, direct);
      if (b == 0) return {0, 0};
      bw[m].push_back(b);
    }
  }
  std::error_code ec;
  fs::remove_all(dir, ec);
  for (auto& v : bw) std::sort(v.begin(), v.end());
  return {bw[0][1], bw[1][1]};
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// FileStorage batch_set against fio's buffered write of the same new files, in pairs: the disk
// of these VMs swings several-fold within a minute (dirty-page write-back of whatever ran
// before), so both sides of a pair start after a sync() with no dirty pages, the order
// alternates, and the figure is the median of the per-pair ratios. The store writes
// `batches` batches of `pages` fresh keys. Returns false without fio.
struct SetVsFio {
  double store, fio, ratio;  // medians: bytes/s, bytes/s, store / fio
  double ratio_min, ratio_max;
};
bool paired_set_vs_fio(std::size_t page_bytes, std::size_t pages, std::size_t batches, int reps,
                       SetVsFio& out) {
  const fs::path dir = bench_dir() / "pair";
  const std::size_t files = pages * batches;
  const double bytes = static_cast<double>(files * page_bytes);
  PageBatch batch("pair", pages, page_bytes);
  std::vector<double> store_bw, fio_bw, ratios;
  std::uint64_t round = 0;
  for (int rep = 0; rep < reps; ++rep) {
    double f = 0, o = 0;
    auto fio_side = [&] {
      fs::create_directories(dir / "fio");
      ::sync();
      f = fio_once(dir / "fio", page_bytes, files, /*write=*/true, /*direct=*/false);
      fs::remove_all(dir / "fio");
    };
    auto store_side = [&] {
      FileStorage store(FileStorageConfig{.root = (dir / "store").string()});
      ::sync();
      const auto t0 = std::chrono::steady_clock::now();
      for (std::size_t b = 0; b < batches; ++b) {
        batch.rename(round++);
        for (const auto& r : store.batch_set(batch.keys, batch.src)) {
          if (!r.is_ok()) throw Error(str_cat("paired batch_set: ", r.reason));
        }
      }
      o = bytes / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      store.clear();
      store.flush_trash();
    };
    if (rep % 2 == 0) {
      fio_side();
      store_side();
    } else {
      store_side();
      fio_side();
    }
    fs::remove_all(dir);
    if (f == 0) return false;
    store_bw.push_back(o);
    fio_bw.push_back(f);
    ratios.push_back(o / f);
  }
  out = {median(store_bw), median(fio_bw), median(ratios),
         *std::min_element(ratios.begin(), ratios.end()),
         *std::max_element(ratios.begin(), ratios.end())};
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 2;
  RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  auto& ips = reporter.items_per_s;
  auto& bps = reporter.bytes_per_s;
  if (ips.count("BM_PageKeys")) {
    std::printf("page keys (SHA-256 chain, 64 tokens): %.2f M pages/s (target >= 1)\n",
                ips["BM_PageKeys"] / 1e6);
  }
  if (ips.count("BM_FileExists")) {
    std::printf("file batch_exists, 4096 keys per batch: %.2f M keys/s (target >= 1)\n",
                ips["BM_FileExists"] / 1e6);
  }
  auto stored = [](int mode) {
    return str_cat("BM_FileExistsStored/", mode, "/repeats:3_median");
  };
  if (ips.count(stored(0)) && ips.count(stored(1)) && ips.count(stored(2))) {
    const double alone = ips[stored(0)];
    std::printf("file batch_exists of 4096 stored keys (medians of 3): alone %.2f M keys/s; "
                "shared, nothing removed since found %.2f M/s, ratio %.2f; shared, after another "
                "instance removed a record %.2f M/s, ratio %.2f\n",
                alone / 1e6, ips[stored(1)] / 1e6, ips[stored(1)] / alone, ips[stored(2)] / 1e6,
                ips[stored(2)] / alone);
  }
  auto absent = [](int mode) {
    return str_cat("BM_FileExistsAbsent/", mode, "/repeats:3_median");
  };
  if (ips.count(absent(0)) && ips.count(absent(1)) && ips.count(absent(2))) {
    const double alone = ips[absent(0)];
    const double remembered = ips[absent(1)];
    const double first = ips[absent(2)];
    std::printf("file batch_exists of an absent key (one per call, medians of 3): alone (the "
                "index answers) %.2f M/s; shared (another instance live), remembered absent "
                "%.2f M/s, ratio %.2f; shared, first ask after another instance published "
                "%.2f M/s, ratio %.2f\n",
                alone / 1e6, remembered / 1e6, remembered / alone, first / 1e6, first / alone);
  }
  if (ips.count("BM_FileEvictingSet/16/real_time") && ips.count("BM_FileEvictingSet/4096/real_time")) {
    const double small = 1e6 / ips["BM_FileEvictingSet/16/real_time"];
    const double large = 1e6 / ips["BM_FileEvictingSet/4096/real_time"];
    std::printf("file batch_set into a full store (every record evicts one): %.1f us per record "
                "at 16 per batch, %.1f at 4096, ratio %.2f (target <= 2)\n",
                small, large, large / small);
  }
  for (const char* n : {"100000", "1000000"}) {
    const std::string warm = str_cat("BM_FileWarmRestart/", n, "/1/iterations:3");
    const std::string scan = str_cat("BM_FileWarmRestart/", n, "/0/iterations:3");
    if (ips.count(warm) && ips.count(scan)) {
      const double records = std::atof(n);
      std::printf("file store restart with %s records: %.3f s from the snapshot, %.3f s by "
                  "scanning, ratio %.2f (target at 1e6: <= 1 s)\n",
                  n, records / ips[warm], records / ips[scan], ips[scan] / ips[warm]);
    }
  }
  for (const auto& [name, p] : reporter.pairs) {
    std::printf("%s: controller %.2f GB/s, the store's own call %.2f GB/s, ratio %.2f "
                "(target >= 0.9)\n",
                name.c_str(), p.controller, p.store, p.ratio);
  }
  bool any_file = false;
  for (const auto& [name, v] : bps) any_file |= name.rfind("BM_File", 0) == 0;
  if (!any_file) return 0;
  struct Shape {
    const char* args;
    std::size_t page_bytes, pages;
  };
  for (const Shape& shape : {Shape{"8192/16", 8 << 20, 64}, Shape{"256/256", 256 << 10, 1024}}) {
    const auto [fio_w, fio_r] = run_fio(bench_dir() / "fio", shape.page_bytes, shape.pages, false);
    const auto [fio_dw, fio_dr] = run_fio(bench_dir() / "fio", shape.page_bytes, shape.pages, true);
    if (fio_w == 0) {
      std::printf("fio baseline unavailable (install fio); ratios skipped\n");
      break;
    }
    std::printf("fio, %zu new files of %zu KiB: buffered write %.2f GB/s, read %.2f GB/s; "
                "direct write %.2f GB/s, read %.2f GB/s\n",
                shape.pages, shape.page_bytes >> 10, fio_w / 1e9, fio_r / 1e9, fio_dw / 1e9,
                fio_dr / 1e9);
    SetVsFio paired{};
    if (paired_set_vs_fio(shape.page_bytes, shape.pages / 4, 4, 5, paired)) {
      std::printf("  file batch_set of %zu KiB pages, %zu batches of %zu, paired with fio's "
                  "buffered write of the same files (median of 5 pairs, sync before each side): "
                  "%.2f GB/s vs fio %.2f GB/s, ratio %.2f (pairs %.2f-%.2f; target >= 0.8)\n",
                  shape.page_bytes >> 10, std::size_t{4}, shape.pages / 4, paired.store / 1e9,
                  paired.fio / 1e9, paired.ratio, paired.ratio_min, paired.ratio_max);
    }
    // batch_set's ratio is the paired one above; the unpaired medians swing with the disk.
    const std::string stem = str_cat("BM_FileGet/", shape.args, "/");
    for (const auto& [n, v] : bps) {
      if (n.rfind(stem, 0) != 0 || !n.ends_with("_median")) continue;
      std::printf("  file batch_get of %zu KiB pages (median of 3): %.2f GB/s, ratio to fio "
                  "buffered read %.2f\n",
                  shape.page_bytes >> 10, v / 1e9, v / fio_r);
    }
  }
  std::error_code ec;
  fs::remove_all(bench_dir(), ec);
  return 0;
}
