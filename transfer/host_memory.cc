#include "transfer/host_memory.h"

#include <sys/mman.h>
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

#include "transfer/errors.h"

namespace hicache {
namespace {

constexpr std::size_t kHugePage = std::size_t{2} << 20;
constexpr std::size_t kSmallPage = 4096;

std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }

// Writes one byte per 4 KiB page of [begin, end) so every page is resident before the pool is
// used.
void touch(std::byte* data, std::size_t begin, std::size_t end) {
  for (std::size_t off = begin; off < end; off += kSmallPage) {
    reinterpret_cast<volatile std::byte*>(data)[off] = std::byte{0};
  }
}

int prefault_thread_count(std::size_t bytes, int requested) {
  if (requested > 0) return requested;
  const auto cpus = static_cast<std::size_t>(std::max(1u, std::thread::hardware_concurrency()));
  const std::size_t by_size = std::max<std::size_t>(1, bytes / (std::size_t{256} << 20));
  return static_cast<int>(std::min({cpus, by_size, std::size_t{16}}));
}

// Pre-faults in huge-page-aligned slices on several threads; the calling thread takes a slice
// too and prints a progress line every ~10% for large mappings.
void prefault(std::byte* data, std::size_t bytes, const HostMemoryOptions& options) {
  const int threads = prefault_thread_count(bytes, options.prefault_threads);
  const bool report = bytes >= options.progress_threshold_bytes;
  const std::size_t slice = round_up((bytes + threads - 1) / threads, kHugePage);
  std::atomic<std::size_t> done{0};
  // Touches [begin, end) in tenths; the caller's slice also prints the total after each tenth.
  auto run = [&](std::size_t begin, std::size_t end, bool print) {
    const std::size_t step = std::max(round_up((end - begin) / 10, kHugePage), kHugePage);
    for (std::size_t at = begin; at < end; at += step) {
      const std::size_t stop = std::min(end, at + step);
      touch(data, at, stop);
      const std::size_t total = done.fetch_add(stop - at, std::memory_order_relaxed) + (stop - at);
      if (print) {
        std::fprintf(stderr, "[hicache] pre-faulting %s on %d threads: %zu%% of %.1f GiB\n",
                     options.label.c_str(), threads, total * 100 / bytes,
                     static_cast<double>(bytes) / (1 << 30));
      }
    }
  };
  std::vector<std::thread> helpers;
  for (int t = 1; t < threads && static_cast<std::size_t>(t) * slice < bytes; ++t) {
    const std::size_t begin = static_cast<std::size_t>(t) * slice;
    helpers.emplace_back(run, begin, std::min(bytes, begin + slice), false);
  }
  run(0, std::min(bytes, slice), report);
  for (std::thread& h : helpers) h.join();
}

}  // namespace

Buffer map_host_memory(std::size_t bytes, const HostMemoryOptions& options) {
  if (bytes == 0) throw InvalidArgument("map_host_memory: size is 0 bytes");
  const std::size_t size = round_up(bytes, kHugePage);
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    throw DeviceError(str_cat("map_host_memory: mmap of ", size, " bytes failed: ",
                              std::strerror(errno)));
  }
  if (madvise(p, size, MADV_HUGEPAGE) != 0) {
    // Huge pages refused (THP disabled): let the kernel populate the mapping in one go instead.
    munmap(p, size);
    p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1,
             0);
    if (p == MAP_FAILED) {
      throw DeviceError(str_cat("map_host_memory: mmap(MAP_POPULATE) of ", size,
                                " bytes failed: ", std::strerror(errno)));
    }
  }
  Buffer buffer(p, size, [](void* data, std::size_t n) { munmap(data, n); });
  prefault(buffer.data(), size, options);
  if (options.mlock && ::mlock(p, size) != 0) {
    const int err = errno;
    rlimit limit{};
    getrlimit(RLIMIT_MEMLOCK, &limit);
    throw DeviceError(str_cat("map_host_memory: mlock of ", size, " bytes for ", options.label,
                              " failed: ", std::strerror(err), " (RLIMIT_MEMLOCK is ",
                              limit.rlim_cur, " bytes)"));
  }
  return buffer;
}

std::string describe_host_memory(const Buffer& buffer) {
  std::ifstream smaps("/proc/self/smaps");
  const auto begin = reinterpret_cast<std::uintptr_t>(buffer.data());
  std::string line;
  bool in_range = false;
  std::size_t rss_kb = 0, huge_kb = 0;
  while (std::getline(smaps, line)) {
    std::uintptr_t lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2 && line.find(':') > line.find(' ')) {
      in_range = lo <= begin && begin < hi;
      continue;
    }
    if (!in_range) continue;
    std::sscanf(line.c_str(), "Rss: %zu kB", &rss_kb);
    std::sscanf(line.c_str(), "AnonHugePages: %zu kB", &huge_kb);
  }
  std::ostringstream out;
  out << buffer.size() / (1 << 20) << " MiB mapped, " << rss_kb / 1024 << " MiB resident, "
      << huge_kb / 1024 << " MiB in huge pages";
  return out.str();
}

}  // namespace hicache
