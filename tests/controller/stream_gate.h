// A gate that holds a stream's later work until the test opens it, on either backend: a host
// function blocking the host backend's stream worker, or on CUDA a one-thread kernel spinning on
// a flag in pinned host memory (with a cycle budget of some seconds, so a test that forgets to
// open it cannot hang the GPU). Test-only: the engine's host functions must never block.
#pragma once

#include <condition_variable>
#include <mutex>

#include "transfer/device.h"

namespace hicache {

#if HICACHE_WITH_CUDA
// Defined in stream_gate.cu; returns the launch's cudaError_t as an int.
int launch_stream_gate(const volatile int* flag, void* cuda_stream);
#endif

class StreamGate {
 public:
  explicit StreamGate(Device& device) : device_(device), flag_(device.alloc_host(4096)) {}
  ~StreamGate() { open(); }

  void hold(Stream& stream);
  void open();

 private:
  Device& device_;
  Buffer flag_;  // pinned; an int the CUDA kernel polls
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
};

}  // namespace hicache
