#include "transfer/device.h"

#include "transfer/errors.h"
#include "transfer/host_device.h"
#if HICACHE_WITH_CUDA
#include "transfer/cuda_device.h"
#endif

namespace hicache {

std::string_view to_string(DeviceBackend backend) {
  switch (backend) {
    case DeviceBackend::kHost:
      return "host";
    case DeviceBackend::kCuda:
      return "cuda";
  }
  return "unknown";
}

bool Device::cuda_available(std::string* why) {
#if HICACHE_WITH_CUDA
  return cuda_device_present(why);
#else
  if (why != nullptr) *why = "hicache was built without CUDA (HICACHE_CUDA=OFF or no toolkit found)";
  return false;
#endif
}

std::unique_ptr<Device> Device::create(std::string_view backend, int cuda_ordinal) {
  if (backend == "host") return std::make_unique<HostDevice>();
  if (backend != "cuda" && backend != "auto") {
    throw InvalidArgument(
        str_cat("unknown device backend '", backend, "': valid are \"auto\", \"cuda\", \"host\""));
  }
  std::string why;
  if (!cuda_available(&why)) {
    if (backend == "auto") return std::make_unique<HostDevice>();
    throw DeviceError(str_cat("device backend \"cuda\" is not usable here: ", why));
  }
#if HICACHE_WITH_CUDA
  return std::make_unique<CudaDevice>(cuda_ordinal);
#else
  (void)cuda_ordinal;
  return std::make_unique<HostDevice>();  // unreachable: cuda_available() is false
#endif
}

Buffer Device::wrap_device(void* data, std::size_t bytes) {
  if (data == nullptr || bytes == 0) {
    throw InvalidArgument(str_cat("Device::wrap_device: ", bytes, " bytes at ", data,
                                  ": the engine's memory must be a non-null, non-empty range"));
  }
  return Buffer(data, bytes, [](void*, std::size_t) {});  // the engine's: never freed here
}

Buffer Device::wrap_host(void* data, std::size_t bytes) {
  if (data == nullptr || bytes == 0) {
    throw InvalidArgument(str_cat("Device::wrap_host: ", bytes, " bytes at ", data,
                                  ": the engine's memory must be a non-null, non-empty range"));
  }
  return Buffer(data, bytes, [](void*, std::size_t) {});
}

}  // namespace hicache
