// hicache-microbench: op-level benchmarks of the foundation, each against a baseline measured
// in the same run (numbers on these machines vary 2-4x from minute to minute; ratios taken in
// one run do not). Prints Google Benchmark's table, then one ratio line per comparison.
//
//   PagedTokenAllocator alloc+free of one 64-token page (pages/s)
//   HostDevice stream copy of 256 KiB blocks on one stream vs plain memcpy (GB/s, ratio)
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
    }
  }
  std::map<std::string, double> bytes_per_s, items_per_s;
};

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 2;
  RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  auto& bps = reporter.bytes_per_s;
  for (auto& [name, v] : reporter.items_per_s) {
    if (name.rfind("BM_Allocator", 0) == 0) {
      std::printf("allocator alloc+free of 64-token pages: %.2f M pages/s\n", v / 1e6);
    }
  }
  const std::string copy = "BM_HostStreamCopy256K/real_time", base = "BM_Memcpy256K";
  if (bps.count(copy) && bps.count(base)) {
    std::printf("host stream copy 256 KiB: %.2f GB/s, memcpy %.2f GB/s, ratio %.2f\n",
                bps[copy] / 1e9, bps[base] / 1e9, bps[copy] / bps[base]);
  }
  return 0;
}
