// HostDevice: the host emulation backend of the device runtime (see transfer/device.h for the
// ordering rules it implements). Device memory is pre-faulted host memory; each Stream is one
// worker thread that runs its queue in order; an Event is a (stream, sequence number) pair.
#pragma once

#include <memory>
#include <vector>

#include "transfer/device.h"
#include "transfer/mutex.h"

namespace hicache {

namespace host_backend {
struct StreamState;
}

class HostDevice final : public Device {
 public:
  HostDevice();
  ~HostDevice() override;

  DeviceBackend backend() const override { return DeviceBackend::kHost; }
  std::string name() const override;
  Buffer alloc_device(std::size_t bytes) override;
  Buffer alloc_host(std::size_t bytes, const HostMemoryOptions& options = {}) override;
  bool device_memory_is_host_accessible() const override { return true; }
  std::unique_ptr<Stream> create_stream() override;
  std::unique_ptr<Stream> wrap_stream(void* native) override;
  std::unique_ptr<Event> create_event() override;
  void synchronize() override;

 private:
  Mutex mu_;
  // States of the streams created so far; expired entries are pruned on create_stream().
  std::vector<std::weak_ptr<host_backend::StreamState>> streams_ HICACHE_GUARDED_BY(mu_);
};

}  // namespace hicache
