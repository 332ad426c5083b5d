// Pool memory in host RAM: the host KV pool's pages and the host backend's emulated device
// memory. A first touch of 4 KiB pages runs two orders of magnitude slower than of huge pages
// (docs/design-notes.md), so pool memory is mapped with MADV_HUGEPAGE (falling
// back to MAP_POPULATE where huge pages are refused), pre-faulted at creation, optionally
// mlock'ed, and never handed back to the kernel while the pool lives.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "transfer/buffer.h"

namespace hicache {

struct HostMemoryOptions {
  // Lock the pages in RAM (mlock). Failure to lock is an error naming RLIMIT_MEMLOCK.
  bool mlock = false;
  // Name used in the progress line printed (to stderr) while large mappings are pre-faulted.
  std::string label = "pool";
  // Mappings of at least this many bytes print progress while they are pre-faulted.
  std::size_t progress_threshold_bytes = std::size_t{4} << 30;
  // Threads that pre-fault the mapping (first touch), each its own slice: the kernel zeroes
  // and maps pages in parallel, which a single thread cannot (hundreds of GB would take
  // minutes). 0: one per CPU, at most 16, and one per 256 MiB at least, so small pools use one.
  int prefault_threads = 0;
};

// Maps `bytes` (rounded up to 2 MiB) of zeroed, pre-faulted anonymous memory (first touch in
// parallel, see HostMemoryOptions::prefault_threads). On CUDA the pinned pools register the
// mapping only after this, so registration finds every page resident.
// Throws InvalidArgument for bytes == 0 and DeviceError when the kernel refuses the memory.
Buffer map_host_memory(std::size_t bytes, const HostMemoryOptions& options = {});

// One line on how the mapping is backed: mapped, resident and huge-page MiB, read from
// /proc/self/smaps (diagnostics for the smoke run and benchmarks; slow, never on a hot path).
std::string describe_host_memory(const Buffer& buffer);

}  // namespace hicache
