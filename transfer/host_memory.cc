#include "transfer/host_memory.h"

#include <sys/mman.h>
#include <sys/resource.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "transfer/errors.h"

namespace hicache {
namespace {

constexpr std::size_t kHugePage = std::size_t{2} << 20;
constexpr std::size_t kSmallPage = 4096;

std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }

// Writes one byte per 4 KiB page so every page is resident before the pool is used; prints a
// progress line every ~10% for large mappings.
void prefault(std::byte* data, std::size_t bytes, const HostMemoryOptions& options) {
  const bool report = bytes >= options.progress_threshold_bytes;
  const std::size_t step = std::max(round_up(bytes / 10, kHugePage), kHugePage);
  for (std::size_t done = 0; done < bytes; done += step) {
    const std::size_t end = std::min(bytes, done + step);
    for (std::size_t off = done; off < end; off += kSmallPage) {
      reinterpret_cast<volatile std::byte*>(data)[off] = std::byte{0};
    }
    if (report) {
      std::fprintf(stderr, "[hicache] pre-faulting %s: %zu%% of %.1f GiB\n", options.label.c_str(),
                   end * 100 / bytes, static_cast<double>(bytes) / (1 << 30));
    }
  }
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
