// CudaDevice: the device runtime on a GPU through the CUDA runtime API. Compiled only when the
// toolkit is found (HICACHE_WITH_CUDA). Pinned host memory is mapped and pre-faulted like the
// host pools, then registered with cudaHostRegister (faster than cudaHostAlloc for large pools,
// whose registration of untouched memory is single-threaded and slow).
#pragma once

#include <string>

#include "transfer/device.h"

namespace hicache {

// True when the CUDA runtime sees at least one GPU; otherwise `why` gets the runtime's error
// (on a machine without a driver: code 35, cudaErrorInsufficientDriver).
bool cuda_device_present(std::string* why);

class CudaDevice final : public Device {
 public:
  // Throws DeviceError when `ordinal` is not a usable GPU.
  explicit CudaDevice(int ordinal);
  ~CudaDevice() override;

  DeviceBackend backend() const override { return DeviceBackend::kCuda; }
  std::string name() const override { return name_; }
  Buffer alloc_device(std::size_t bytes) override;
  Buffer alloc_host(std::size_t bytes, const HostMemoryOptions& options = {}) override;
  Buffer wrap_device(void* data, std::size_t bytes) override;
  Buffer wrap_host(void* data, std::size_t bytes) override;
  bool device_memory_is_host_accessible() const override { return false; }
  std::unique_ptr<Stream> create_stream() override;
  std::unique_ptr<Stream> wrap_stream(void* native) override;
  std::unique_ptr<Event> create_event() override;
  void synchronize() override;

  int ordinal() const { return ordinal_; }

 private:
  int ordinal_;
  std::string name_;
};

}  // namespace hicache
