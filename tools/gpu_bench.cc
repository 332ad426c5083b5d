// hicache-gpubench: H2D and D2H throughput of scattered KV pages through the `direct` path (the
// copy list of the runs, one cudaMemcpyBatchAsync where the runtime has it) and the `kernel`
// path (one gather/scatter launch), against a contiguous pinned copy of the same bytes on the
// same stream (the ceiling), all measured in one run. Standard geometry: 32 layers, 8 KV heads,
// head dim 128, fp16, page 64 (8 MiB per page, runs of 128 KiB per layer and K/V).
//   hicache-gpubench [LAYOUT [PAGE_TOKENS]]   LAYOUT: layer_first (default), page_first,
//                                             page_first_direct; PAGE_TOKENS: 64 (default)
//   hicache-gpubench pin [GIB]                the pinned pool's bring-up
// Exits 0 with a note when no GPU answers.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "controller/hicache.h"
#include "transfer/copy_plan.h"
#include "transfer/device.h"
#include "transfer/host_memory.h"

namespace {

using Clock = std::chrono::steady_clock;

// Times `enqueue` on the stream: grows the repetition count until one timing takes 20 ms, then
// returns the best GB/s (for `bytes` per repetition) of five such timings, since single timings
// on a shared machine vary by tens of percent.
template <typename F>
double gbps(hicache::Stream& stream, double bytes, F&& enqueue) {
  enqueue();
  stream.synchronize();  // warm-up
  auto time_reps = [&](int reps) {
    const auto t0 = Clock::now();
    for (int i = 0; i < reps; ++i) enqueue();
    stream.synchronize();
    return std::chrono::duration<double>(Clock::now() - t0).count();
  };
  int reps = 1;
  while (reps < 4096 && time_reps(reps) < 0.02) reps *= 2;
  double best = 0;
  for (int i = 0; i < 5; ++i) best = std::max(best, bytes * reps / time_reps(reps) / 1e9);
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  std::string why;
  if (!hicache::Device::cuda_available(&why)) {
    std::printf("hicache-gpubench: no GPU, nothing measured (%s)\n", why.c_str());
    return 0;
  }
  const std::string layout_name = argc > 1 ? argv[1] : "layer_first";
  auto device = hicache::Device::create("cuda");
  if (layout_name == "pin") {
    // Pinned pool bring-up: map + first touch (1 thread, then the default) + cudaHostRegister.
    const std::size_t gib = argc > 2 ? std::stoul(argv[2]) : 16;
    for (int threads : {1, 0}) {
      const auto t0 = Clock::now();
      hicache::Buffer b = device->alloc_host(
          gib << 30, hicache::HostMemoryOptions{.label = "bench pool",
                                                .progress_threshold_bytes = ~std::size_t{0},
                                                .prefault_threads = threads});
      const double s = std::chrono::duration<double>(Clock::now() - t0).count();
      std::printf("pinned host pool of %zu GiB, first touch on %s: %.2f s (%.1f GB/s)\n", gib,
                  threads == 1 ? "1 thread" : "the default threads", s,
                  static_cast<double>(gib << 30) / s / 1e9);
    }
    return 0;
  }
  // The pools are a HiCache's (no L3, no metrics): the bench times the same pools the cache
  // moves pages between, built from the same config an engine passes.
  constexpr std::int64_t kPool = 320;  // pages in each pool
  hicache::HiCacheConfig config;
  // `hicache-gpubench LAYOUT TOKENS`: pages of TOKENS tokens (default 64), so that each page's
  // run per layer and K/V is TOKENS x 2 KiB: 4 tokens give the 8 KiB fragments, 32 the 64 KiB.
  const int page_tokens = argc > 2 ? std::atoi(argv[2]) : 64;
  if (page_tokens < 1 || page_tokens > 1024) {
    std::fprintf(stderr, "hicache-gpubench: page tokens '%s': valid are 1..1024\n", argv[2]);
    return 2;
  }
  config.geometry =
      hicache::KVGeometry::mha(32, 8, 128, hicache::DType::kFloat16, page_tokens);
  config.device_tokens = kPool * config.geometry.page_size;
  config.host_size = hicache::HostPoolSize{.tokens = config.device_tokens};
  config.host_layout = hicache::parse_host_layout(layout_name);
  config.metrics = false;
  hicache::HiCache cache(config, hicache::HiCacheParts{.device = device.get()});
  const auto& g = config.geometry;
  const hicache::DeviceKVPool& dev = cache.device_pool();
  const hicache::HostKVPool& host = cache.host_pool();
  hicache::Buffer flat_host = device->alloc_host(256 * g.page_bytes());
  hicache::Buffer flat_dev = device->alloc_device(256 * g.page_bytes());
  hicache::Buffer lists = device->alloc_host(2 * kPool * sizeof(std::int64_t));
  auto* dpages = reinterpret_cast<std::int64_t*>(lists.data());
  auto* hpages = dpages + kPool;
  std::vector<std::int64_t> perm(kPool);
  std::iota(perm.begin(), perm.end(), 0);
  std::mt19937 rng(1);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::copy(perm.begin(), perm.end(), dpages);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::copy(perm.begin(), perm.end(), hpages);
  auto stream = device->create_stream();

  std::printf("device: %s; host layout %s; %s\n", device->name().c_str(), layout_name.c_str(),
              g.describe().c_str());
  std::printf("%-4s %6s %-6s %10s %10s %10s %8s %8s\n", "dir", "pages", "scope", "direct",
              "kernel", "ceiling", "dir/ceil", "ker/ceil");
  for (const char* dir : {"H2D", "D2H"}) {
    const bool h2d = dir[0] == 'H';
    for (std::int64_t n : {1, 16, 256}) {
      for (bool per_layer : {false, true}) {
        const std::int32_t le = per_layer ? 1 : g.num_layers;
        const double bytes = static_cast<double>(n) * g.page_bytes() / g.num_layers * le;
        const auto& dst = h2d ? dev.layout() : host.layout();
        const auto& src = h2d ? host.layout() : dev.layout();
        std::int64_t* dst_pages = h2d ? dpages : hpages;
        std::int64_t* src_pages = h2d ? hpages : dpages;
        std::vector<hicache::CopyRegion> regions;
        hicache::append_page_copies(dst, {dst_pages, static_cast<std::size_t>(n)}, src,
                                    {src_pages, static_cast<std::size_t>(n)}, 0, le, regions);
        const double direct = gbps(*stream, bytes, [&] { stream->copy_batch_async(regions); });
        const hicache::PageTransfer t{dst, src, dst_pages, src_pages, n, 0, le};
        const double kernel = gbps(*stream, bytes, [&] { stream->transfer_pages_async(t); });
        void* cd = h2d ? flat_dev.data() : flat_host.data();
        void* cs = h2d ? flat_host.data() : flat_dev.data();
        const double ceiling = gbps(*stream, bytes, [&] {
          stream->copy_async(cd, cs, static_cast<std::size_t>(bytes));
        });
        std::printf("%-4s %6lld %-6s %10.2f %10.2f %10.2f %8.2f %8.2f\n", dir,
                    static_cast<long long>(n), per_layer ? "layer" : "all", direct, kernel,
                    ceiling, direct / ceiling, kernel / ceiling);
      }
    }
  }
  return 0;
}
