// The device runtime: memory, streams and events behind one interface with two backends.
//
//   CudaDevice  a GPU through the CUDA runtime (compiled when the toolkit is found).
//   HostDevice  device memory is ordinary memory and every stream is an in-order worker thread.
//               This is a real backend with CUDA's ordering rules, not a mock: it runs the whole
//               system on machines without a GPU.
//
// Ordering rules, the same on both backends:
//   - work enqueued on one stream runs in enqueue order, each item after the previous finished;
//   - Stream::record(e) captures all work enqueued on that stream so far; e.query() is true
//     and e.synchronize() returns once that work is done (an event never recorded is done);
//     recording again re-arms the event with the newer point;
//   - Stream::wait(e) makes work enqueued on the waiting stream afterwards start only after the
//     work e captured at the time of the call; the caller does not block;
//   - Stream::synchronize() blocks until everything enqueued on the stream so far is done.
// Streams and events are used from any thread. Destroying a stream lets its queued work finish.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "kernels/page_transfer.h"
#include "transfer/buffer.h"
#include "transfer/host_memory.h"

namespace hicache {

enum class DeviceBackend { kHost, kCuda };

std::string_view to_string(DeviceBackend backend);

// One contiguous copy. Pointers may be device or host memory of the device they run on.
struct CopyRegion {
  void* dst = nullptr;
  const void* src = nullptr;
  std::size_t bytes = 0;
};

class Event {
 public:
  virtual ~Event() = default;
  // True when all work captured by the last record() has completed (or it was never recorded).
  virtual bool query() const = 0;
  // Blocks the calling thread until query() is true.
  virtual void synchronize() const = 0;
};

class Stream {
 public:
  virtual ~Stream() = default;

  // Enqueues a copy of `bytes` bytes; returns at once. Source and destination must stay valid
  // until the copy has run. REQUIRES: the ranges do not overlap.
  virtual void copy_async(void* dst, const void* src, std::size_t bytes) = 0;
  // Enqueues the copies of `regions` as one item (the list itself is copied and may be
  // released on return).
  virtual void copy_batch_async(std::span<const CopyRegion> regions) = 0;
  // Enqueues a page gather/scatter between two layouts (the `kernel` I/O path): one kernel
  // launch of at most `max_blocks` blocks on CUDA (0: no cap), the CPU implementation of the same
  // index math on the host backend. Validates `t` first (InvalidArgument, nothing enqueued).
  virtual void transfer_pages_async(const PageTransfer& t, int max_blocks = 0) = 0;
  // Enqueues a host function that runs in stream order (cudaLaunchHostFunc on CUDA; the worker
  // thread itself on the host backend). It must not block on other work, call into the device
  // runtime, or throw (CUDA runs host functions on one runtime thread and may serialise them
  // with other streams: a blocking one can deadlock the device); an
  // exception it throws anyway is caught and reported by synchronize().
  virtual void launch_host_func(std::function<void()> fn) = 0;

  // Captures the work enqueued so far into `event`. REQUIRES: event from the same device.
  virtual void record(Event& event) = 0;
  // Orders later work on this stream after the work `event` captured. Does not block.
  virtual void wait(const Event& event) = 0;
  // Blocks until all enqueued work has run. Throws DeviceError if any of it failed since the
  // last synchronize(); the failure is then cleared.
  virtual void synchronize() = 0;
  // The backend's own stream (a cudaStream_t on CUDA), null on the host backend.
  virtual void* native_handle() const { return nullptr; }
};

class Device {
 public:
  virtual ~Device() = default;

  // Creates the backend named by `backend`: "host", "cuda" or "auto" (CUDA when a GPU is
  // present, else host). "cuda" without a usable GPU, or in a build without CUDA, throws
  // DeviceError saying why; any other name throws InvalidArgument listing the valid ones.
  static std::unique_ptr<Device> create(std::string_view backend = "auto", int cuda_ordinal = 0);

  // True when this build has the CUDA backend and a GPU answers; `why` gets the reason if not.
  static bool cuda_available(std::string* why = nullptr);

  virtual DeviceBackend backend() const = 0;
  // Human-readable description ("host emulation, 2 CPUs", "NVIDIA H100 80GB HBM3 (sm_90)").
  virtual std::string name() const = 0;

  // Device memory, zeroed. Throws InvalidArgument for 0 bytes, DeviceError when refused.
  virtual Buffer alloc_device(std::size_t bytes) = 0;
  // Page-locked host memory that the device's copies reach directly, zeroed and pre-faulted.
  virtual Buffer alloc_host(std::size_t bytes, const HostMemoryOptions& options = {}) = 0;
  // Memory the engine owns, used in place and never freed or reallocated: the Buffer returned
  // holds it without owning it, and its release undoes only what wrapping did (a CUDA host
  // registration it made). Throws InvalidArgument for a null pointer or 0 bytes, DeviceError
  // when the runtime refuses it (CUDA: wrap_device of memory that is not the device's,
  // wrap_host of memory that cannot be page-locked). The host backend takes any memory.
  virtual Buffer wrap_device(void* data, std::size_t bytes);
  virtual Buffer wrap_host(void* data, std::size_t bytes);
  // True when device memory is ordinary host memory the CPU may read and write directly.
  virtual bool device_memory_is_host_accessible() const = 0;

  virtual std::unique_ptr<Stream> create_stream() = 0;
  // A Stream over a stream the engine already has (a cudaStream_t on CUDA, such as its compute
  // stream), so that controller calls can order work on it (LayerDoneCounter::wait_on_stream)
  // and take events from it. Not owned: destroying the wrapper leaves the stream alone. The host
  // backend has no native streams and throws InvalidArgument.
  virtual std::unique_ptr<Stream> wrap_stream(void* native) = 0;
  virtual std::unique_ptr<Event> create_event() = 0;
  // Blocks until all work on all streams of this device is done.
  virtual void synchronize() = 0;
};

}  // namespace hicache
