// hicache-microbench: op-level benchmarks of the foundation, each against a baseline measured
// in the same run (numbers on these machines vary 2-4x from minute to minute; ratios taken in
// one run do not). Prints Google Benchmark's table, then one ratio line per comparison.
//
//   PagedTokenAllocator alloc+free of one 64-token page (pages/s)
//   HostDevice stream copy of 256 KiB blocks on one stream vs plain memcpy (GB/s, ratio)
//   metrics on vs off for tiny controller writes (ratio)
//   HiCacheController write/load of 1 and 16 8-MiB pages vs memcpy, tiny-page latency and ops/s
//   (controller_bench.cc)
#include <benchmark/benchmark.h>

#include <cstdio>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "pools/paged_token_allocator.h"
#include "transfer/host_device.h"
#include "transfer/host_memory.h"

namespace {

constexpr std::size_t kBlock = 256 * 1024;
constexpr std::size_t kBlocks = 256;  // 64 MiB working set: larger than the L2/L3 caches

void BM_AllocatorAllocFreePage64(benchmark::State& state) {
  hicache::PagedTokenAllocator allocator(64 * 4096, 64);
  std::vector<std::int64_t> slots;
  slots.reserve(64);
  for (auto _ : state) {
    slots.clear();
    allocator.alloc(64, slots);
    allocator.free(slots);
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_AllocatorAllocFreePage64);

struct Blocks {
  hicache::Buffer src = hicache::map_host_memory(kBlock * kBlocks);
  hicache::Buffer dst = hicache::map_host_memory(kBlock * kBlocks);
};

Blocks& blocks() {
  static Blocks b;
  return b;
}

void BM_Memcpy256K(benchmark::State& state) {
  Blocks& b = blocks();
  std::size_t i = 0;
  for (auto _ : state) {
    std::memcpy(b.dst.data() + i * kBlock, b.src.data() + i * kBlock, kBlock);
    benchmark::ClobberMemory();
    i = (i + 1) % kBlocks;
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * kBlock));
}
BENCHMARK(BM_Memcpy256K);

// Enqueues 256 KiB copies on one stream, synchronizing every `kBlocks` copies, so the figure
// includes the queue's overhead per item and the wake-ups.
void BM_HostStreamCopy256K(benchmark::State& state) {
  Blocks& b = blocks();
  hicache::HostDevice device;
  auto stream = device.create_stream();
  std::size_t i = 0;
  for (auto _ : state) {
    stream->copy_async(b.dst.data() + i * kBlock, b.src.data() + i * kBlock, kBlock);
    if (++i == kBlocks) {
      stream->synchronize();
      i = 0;
    }
  }
  stream->synchronize();
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * kBlock));
}
BENCHMARK(BM_HostStreamCopy256K)->UseRealTime();

// Collects throughput per benchmark so ratios can be printed after the run.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& run : runs) {
      auto it = run.counters.find("bytes_per_second");
      if (it != run.counters.end()) bytes_per_s[run.benchmark_name()] = it->second;
      auto items = run.counters.find("items_per_second");
      if (items != run.counters.end()) items_per_s[run.benchmark_name()] = items->second;
      if (auto p = run.counters.find("p50_us"); p != run.counters.end()) {
        p50_us[run.benchmark_name()] = p->second;
      }
      if (auto p = run.counters.find("p99_us"); p != run.counters.end()) {
        p99_us[run.benchmark_name()] = p->second;
      }
      if (auto p = run.counters.find("on_over_off"); p != run.counters.end()) {
        on_over_off[run.benchmark_name()] = p->second;
      }
    }
  }
  std::map<std::string, double> bytes_per_s, items_per_s, p50_us, p99_us, on_over_off;
};

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 2;
  RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  auto& bps = reporter.bytes_per_s;
  for (const auto& [name, ratio] : reporter.on_over_off) {
    std::printf("metrics on / off, 1-page writes of 2 KiB pages: ratio %.3f (target >= 0.95)\n",
                ratio);
  }
  for (auto& [name, v] : reporter.items_per_s) {
    if (name.rfind("BM_Allocator", 0) == 0) {
      std::printf("allocator alloc+free of 64-token pages: %.2f M pages/s\n", v / 1e6);
    }
    if (name.rfind("BM_RadixStep", 0) == 0) {
      std::printf("radix cache + controller per scheduler step (64 requests x 2048 tokens, "
                  "shared prefixes, no compute): %.0f us\n", 1e6 / v);
    }
    if (name.rfind("BM_RadixMatchPrefix", 0) == 0) {
      std::printf("match_prefix of a cached 2048-token prompt: %.2f ns per token\n", 1e9 / v);
    }
    if (name.rfind("BM_ControllerWriteTinyPipelined", 0) == 0) {
      std::printf("controller 1-page writes of 2 KiB pages, 4 in flight: %.0f ops/s\n", v);
    } else if (name.rfind("BM_ControllerWriteTiny", 0) == 0) {
      std::printf("controller 1-page writes of 2 KiB pages (one in flight): %.0f ops/s, "
                  "submit->ack p50 %.1f us, p99 %.1f us\n",
                  v, reporter.p50_us[name], reporter.p99_us[name]);
    }
  }
  const std::string copy = "BM_HostStreamCopy256K/real_time", base = "BM_Memcpy256K";
  if (bps.count(copy) && bps.count(base)) {
    std::printf("host stream copy 256 KiB: %.2f GB/s, memcpy %.2f GB/s, ratio %.2f\n",
                bps[copy] / 1e9, bps[base] / 1e9, bps[copy] / bps[base]);
  }
  for (const char* pages : {"1", "16"}) {
    const std::string memcpy_name = std::string("BM_MemcpyPages/") + pages + "/real_time";
    for (const char* op : {"BM_ControllerWrite/", "BM_ControllerLoad/"}) {
      const std::string name = std::string(op) + pages + "/real_time";
      if (bps.count(name) && bps.count(memcpy_name)) {
        std::printf("%s %s page(s) of 8 MiB: %.2f GB/s, memcpy %.2f GB/s, ratio %.2f\n", op + 3,
                    pages, bps[name] / 1e9, bps[memcpy_name] / 1e9, bps[name] / bps[memcpy_name]);
      }
    }
  }
  return 0;
}
