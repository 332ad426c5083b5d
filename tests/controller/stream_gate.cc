#include "stream_gate.h"

#include <stdexcept>
#include <string>

namespace hicache {

void StreamGate::hold(Stream& stream) {
  if (device_.backend() == DeviceBackend::kCuda) {
#if HICACHE_WITH_CUDA
    const int err = launch_stream_gate(reinterpret_cast<const volatile int*>(flag_.data()),
                                       stream.native_handle());
    if (err != 0) throw std::runtime_error("stream gate launch failed: " + std::to_string(err));
#endif
    return;
  }
  stream.launch_host_func([this] {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return open_; });
  });
}

void StreamGate::open() {
  {
    std::lock_guard lock(mu_);
    open_ = true;
  }
  cv_.notify_all();
  __atomic_store_n(reinterpret_cast<int*>(flag_.data()), 1, __ATOMIC_SEQ_CST);
}

}  // namespace hicache
