// Controller benchmarks on the host backend (issue figures): write and load throughput for ops
// of 1 and 16 pages of the standard geometry (8 MiB pages) against a plain memcpy of the same
// bytes, and submit->ack latency (p50/p99) and ops/s of 1-page writes with tiny pages (1 layer,
// 1 head, head dim 8: 2 KiB), which measure the controller itself rather than the copies.
// One op in flight (closed loop); the ack is awaited by draining, as a main loop would.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <atomic>
#include <thread>

#include "controller/hi_radix_cache.h"
#include "controller/hicache.h"
#include "controller/hicache_controller.h"
#include "transfer/host_device.h"
#include "transfer/host_memory.h"
#include "transfer/metrics.h"

namespace {

using namespace hicache;

// The pools and controller of a HiCache the library builds (host backend, no L3), driven
// directly.
std::unique_ptr<HiCache> make_cache(const KVGeometry& g, std::int64_t pages, bool metrics) {
  const std::string config = str_cat(
      R"({"device": "host", "page_size": )", g.page_size, R"(, "device_tokens": )",
      pages * g.page_size, R"(, "host_tokens": )", pages * g.page_size,
      R"(, "model": {"layers": )", g.num_layers, R"(, "kv_heads": )", g.num_kv_heads,
      R"(, "head_dim": )", g.head_dim, R"(, "dtype": ")", to_string(g.dtype), R"("}, "metrics": )",
      metrics ? "true" : "false", "}");
  return std::make_unique<HiCache>(HiCacheConfig::from_json_text(config));
}

struct Rig {
  std::unique_ptr<HiCache> hc;
  KVGeometry g;
  DeviceKVPool& dev;
  HostKVPool& host;
  HiCacheController& controller;
  Rig(const KVGeometry& geometry, std::int64_t pages, bool metrics = true)
      : hc(make_cache(geometry, pages, metrics)),
        g(geometry),
        dev(hc->device_pool()),
        host(hc->host_pool()),
        controller(hc->controller()) {}
};

void wait_ack(HiCacheController& c, bool write, std::vector<Ack>& acks) {
  acks.clear();
  while ((write ? c.drain_write_acks(acks) : c.drain_load_acks(acks)) == 0) {
    std::this_thread::yield();
  }
}

KVGeometry standard() { return KVGeometry::mha(32, 8, 128, DType::kFloat16, 64); }

void BM_ControllerWrite(benchmark::State& state) {
  const std::int64_t pages = state.range(0);
  Rig rig(standard(), 32);
  auto d = *rig.dev.allocator().alloc(pages * 64);
  std::vector<Ack> acks;
  for (auto _ : state) {
    auto h = rig.controller.write(d, 0, NodeId{1});
    wait_ack(rig.controller, true, acks);
    rig.host.mark_backup(*h);
    rig.controller.evict_host(*h);
  }
  state.SetBytesProcessed(state.iterations() * pages * rig.g.page_bytes());
}
BENCHMARK(BM_ControllerWrite)->Arg(1)->Arg(16)->UseRealTime()->Unit(benchmark::kMillisecond);

void BM_ControllerLoad(benchmark::State& state) {
  const std::int64_t pages = state.range(0);
  Rig rig(standard(), 32);
  auto d = *rig.dev.allocator().alloc(pages * 64);
  std::vector<Ack> acks;
  auto h = *rig.controller.write(d, 0, NodeId{1});
  wait_ack(rig.controller, true, acks);
  rig.controller.evict_device(d, h);
  for (auto _ : state) {
    auto back = rig.controller.load(h, 0, NodeId{2});
    const std::int32_t slot = rig.controller.start_loading();
    const bool loaded = rig.dev.wait_for_layer(rig.g.num_layers - 1);
    rig.controller.layer_done_counter().release(slot);
    if (!loaded) {
      state.SkipWithError("a load failed");
      break;
    }
    wait_ack(rig.controller, false, acks);
    rig.controller.evict_device(*back, h);
  }
  state.SetBytesProcessed(state.iterations() * pages * rig.g.page_bytes());
}
BENCHMARK(BM_ControllerLoad)->Arg(1)->Arg(16)->UseRealTime()->Unit(benchmark::kMillisecond);

void BM_MemcpyPages(benchmark::State& state) {
  const std::size_t bytes = static_cast<std::size_t>(state.range(0)) * standard().page_bytes();
  Buffer a = map_host_memory(bytes), b = map_host_memory(bytes);
  for (auto _ : state) {
    std::memcpy(b.data(), a.data(), bytes);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * bytes));
}
BENCHMARK(BM_MemcpyPages)->Arg(1)->Arg(16)->UseRealTime()->Unit(benchmark::kMillisecond);

void BM_ControllerWriteTiny(benchmark::State& state) {
  Rig rig(KVGeometry::mha(1, 1, 8, DType::kFloat16, 64), 64);
  auto d = *rig.dev.allocator().alloc(64);
  std::vector<Ack> acks;
  std::vector<double> us;
  us.reserve(1 << 20);
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    auto h = rig.controller.write(d, 0, NodeId{1});
    wait_ack(rig.controller, true, acks);
    us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0)
                     .count());
    rig.host.mark_backup(*h);
    rig.controller.evict_host(*h);
  }
  std::sort(us.begin(), us.end());
  if (!us.empty()) {
    state.counters["p50_us"] = us[us.size() / 2];
    state.counters["p99_us"] = us[std::min(us.size() - 1, us.size() * 99 / 100)];
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_ControllerWriteTiny)->UseRealTime();

// As above with 4 writes in flight (closed loop: each ack frees its host pages and submits the
// next write), the shape of hicache-opbench's write_p1_tiny.
void BM_ControllerWriteTinyPipelined(benchmark::State& state) {
  constexpr int kInFlight = 4;
  Rig rig(KVGeometry::mha(1, 1, 8, DType::kFloat16, 64), 64);
  auto d = *rig.dev.allocator().alloc(kInFlight * 64);
  std::vector<std::vector<std::int64_t>> host(kInFlight);
  auto submit = [&](int i) {
    host[i] = *rig.controller.write(std::span(d).subspan(i * 64, 64), 0, NodeId{i});
  };
  for (int i = 0; i < kInFlight; ++i) submit(i);
  std::vector<Ack> acks;
  std::int64_t done = 0;
  for (auto _ : state) {
    acks.clear();
    while (rig.controller.drain_write_acks(acks) == 0) std::this_thread::yield();
    for (const Ack& a : acks) {
      const int i = static_cast<int>(a.node);
      rig.host.mark_backup(host[i]);
      rig.controller.evict_host(host[i]);
      submit(i);
    }
    done += static_cast<std::int64_t>(acks.size());
  }
  rig.controller.stop();
  state.SetItemsProcessed(done);
}
BENCHMARK(BM_ControllerWriteTinyPipelined)->UseRealTime();

// The cost of metrics on the hot path (issue figure: within 5%): one controller of tiny pages
// runs rounds of 256 closed-loop 1-page writes, alternately registered in a registry that a
// thread scrapes ten times a second (latency histograms, submit timestamps; Prometheus's default
// is a scrape every 15 s) and not registered, so both sides see the same threads on the same
// machine. Reports each side's ops/s and the median over the pairs of rounds of on/off.
void BM_MetricsCostTinyWrites(benchmark::State& state) {
  Rig rig(KVGeometry::mha(1, 1, 8, DType::kFloat16, 64), 64, /*metrics=*/false);
  MetricsRegistry registry;
  std::atomic<bool> stop{false};
  std::thread scraper([&] {
    while (!stop.load()) {
      benchmark::DoNotOptimize(registry.prometheus_text());
      std::this_thread::sleep_for(std::chrono::milliseconds(100));  // 10 scrapes/s
    }
  });
  auto d = *rig.dev.allocator().alloc(64);
  std::vector<Ack> acks;
  double off_s = 0, on_s = 0;
  std::int64_t rounds = 0;
  constexpr int kOps = 256;
  auto round = [&](bool metrics) {
    if (metrics) {
      rig.controller.register_metrics(registry);
    } else {
      rig.controller.unregister_metrics();
    }
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < kOps; ++i) {
      auto h = rig.controller.write(d, 0, NodeId{1});
      wait_ack(rig.controller, true, acks);
      rig.host.mark_backup(*h);
      rig.controller.evict_host(*h);
    }
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  std::vector<double> pair_ratios;
  for (auto _ : state) {
    const bool on_first = rounds % 2 == 1;  // which side goes first alternates
    double on_round = on_first ? round(true) : 0;
    const double off_round = round(false);
    if (!on_first) on_round = round(true);
    on_s += on_round;
    off_s += off_round;
    pair_ratios.push_back(off_round / on_round);
    ++rounds;
  }
  rig.controller.unregister_metrics();
  stop = true;
  scraper.join();
  const double ops = static_cast<double>(rounds * kOps);
  state.counters["off_ops_per_s"] = ops / off_s;
  state.counters["on_ops_per_s"] = ops / on_s;
  // The median of the pairs: a round that a vCPU stall hit moves the totals, not the median.
  std::sort(pair_ratios.begin(), pair_ratios.end());
  state.counters["on_over_off"] = pair_ratios.empty() ? 0 : pair_ratios[pair_ratios.size() / 2];
  state.SetItemsProcessed(2 * rounds * kOps);
}
BENCHMARK(BM_MetricsCostTinyWrites)->UseRealTime()->Unit(benchmark::kMillisecond)->MinTime(2);

}  // namespace

// HiRadixCache overhead per scheduler step (issue figure): a batch of 64 requests of 2048-token
// prompts (page 64) sharing eight 1024-token system prompts, each with its own 1024-token tail:
// match_prefix, lock, allocate + insert the new pages, unlock, check_events, evict when the
// device runs short. Tiny pages (1 layer x 1 head x 8 dims: 2 KiB) keep the copies out of the
// figure; no compute is simulated. Write-through-selective, as SGLang's default.
void BM_RadixStep(benchmark::State& state) {
  constexpr int kRequests = 64, kPromptPages = 32, kPage = 64;
  Rig rig(KVGeometry::mha(1, 1, 8, DType::kFloat16, kPage), 4 * kRequests * kPromptPages);
  HiRadixCache& cache = rig.hc->cache();
  std::int32_t next_tail = 1 << 20;
  std::vector<std::int32_t> tokens(kPromptPages * kPage);
  for (auto _ : state) {
    cache.check_events();
    for (int r = 0; r < kRequests; ++r) {
      const int family = r % 8;
      for (int i = 0; i < 16 * kPage; ++i) tokens[i] = family * 100000 + i;
      for (int i = 16 * kPage; i < kPromptPages * kPage; ++i) tokens[i] = next_tail++;
      auto m = cache.match_prefix(tokens);
      cache.lock(m.last_device_node);
      const auto missing = static_cast<std::int64_t>(tokens.size() - m.device_slots.size());
      auto fresh = rig.dev.allocator().alloc(missing);
      if (!fresh) {
        cache.evict_device(missing);
        fresh = rig.dev.allocator().alloc(missing);
      }
      if (!fresh) {
        state.SkipWithError("device pool exhausted");
        break;
      }
      std::vector<std::int64_t> slots = m.device_slots;
      slots.insert(slots.end(), fresh->begin(), fresh->end());
      const std::int64_t dup = cache.insert(tokens, slots);
      const auto ours = static_cast<std::int64_t>(m.device_slots.size());
      if (dup > ours) rig.dev.allocator().free(std::span(slots).subspan(ours, dup - ours));
      cache.unlock(m.last_device_node);
    }
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_RadixStep)->UseRealTime()->Unit(benchmark::kMicrosecond);

// match_prefix over a cached 2048-token prompt (32 pages in 2 nodes): cost per token.
void BM_RadixMatchPrefix(benchmark::State& state) {
  constexpr int kPage = 64;
  Rig rig(KVGeometry::mha(1, 1, 8, DType::kFloat16, kPage), 64);
  HiRadixCache cache(rig.controller, rig.dev, rig.host);
  std::vector<std::int32_t> tokens(32 * kPage);
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::int32_t>(i);
  auto slots = *rig.dev.allocator().alloc(static_cast<std::int64_t>(tokens.size()));
  cache.insert(std::span(tokens).first(16 * kPage), std::span(slots).first(16 * kPage));
  cache.insert(tokens, slots);
  for (auto _ : state) benchmark::DoNotOptimize(cache.match_prefix(tokens).device_slots.data());
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * tokens.size()));
}
BENCHMARK(BM_RadixMatchPrefix)->UseRealTime();
