#include "transfer/cuda_device.h"

#include <cuda_runtime.h>

#include <exception>
#include <memory>
#include <utility>
#include <vector>

#include "transfer/copy_plan.h"
#include "transfer/errors.h"
#include "transfer/mutex.h"

namespace hicache {
namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw DeviceError(str_cat(what, " failed: ", static_cast<int>(err), " ", cudaGetErrorName(err),
                              " (", cudaGetErrorString(err), ")"));
  }
}

class CudaEvent final : public Event {
 public:
  explicit CudaEvent(int ordinal) : ordinal_(ordinal) {
    check(cudaSetDevice(ordinal_), "cudaSetDevice");
    check(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreate");
  }
  ~CudaEvent() override { cudaEventDestroy(event_); }

  bool query() const override {
    const cudaError_t err = cudaEventQuery(event_);
    if (err == cudaErrorNotReady) return false;
    check(err, "cudaEventQuery");
    return true;
  }
  void synchronize() const override { check(cudaEventSynchronize(event_), "cudaEventSynchronize"); }
  cudaEvent_t handle() const { return event_; }
  int ordinal() const { return ordinal_; }

 private:
  int ordinal_;
  cudaEvent_t event_ = nullptr;
};

class CudaStream final : public Stream {
 public:
  explicit CudaStream(int ordinal) : ordinal_(ordinal) {
    check(cudaSetDevice(ordinal_), "cudaSetDevice");
    check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  }
  // Wraps a stream the caller owns.
  CudaStream(int ordinal, cudaStream_t borrowed)
      : ordinal_(ordinal), stream_(borrowed), owned_(false) {}
  ~CudaStream() override {
    cudaStreamSynchronize(stream_);
    if (owned_) cudaStreamDestroy(stream_);
  }

  void copy_async(void* dst, const void* src, std::size_t bytes) override {
    if (bytes == 0) return;
    if (dst == nullptr || src == nullptr) {
      throw InvalidArgument(str_cat("Stream::copy: null pointer for a copy of ", bytes, " bytes"));
    }
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_), "cudaMemcpyAsync");
  }

  void copy_batch_async(std::span<const CopyRegion> regions) override {
    for (const CopyRegion& r : regions) {
      if (r.bytes != 0 && (r.dst == nullptr || r.src == nullptr)) {
        throw InvalidArgument(
            str_cat("Stream::copy_batch: null pointer for a copy of ", r.bytes, " bytes"));
      }
    }
#if CUDART_VERSION >= 12080
    // One driver call for the whole list (the `direct` io path of page_first layouts has one
    // region per token run: thousands per op). The legacy default stream is not allowed there.
    if (stream_ != nullptr && stream_ != cudaStreamLegacy && regions.size() > 1) {
      thread_local std::vector<void*> dsts;
      thread_local std::vector<const void*> srcs;
      thread_local std::vector<std::size_t> sizes;
      dsts.clear();
      srcs.clear();
      sizes.clear();
      for (const CopyRegion& r : regions) {
        if (r.bytes == 0) continue;
        dsts.push_back(r.dst);
        srcs.push_back(r.src);
        sizes.push_back(r.bytes);
      }
      if (dsts.empty()) return;
      cudaMemcpyAttributes attr{};
      attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
      attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
      std::size_t attr_index = 0;
#if CUDART_VERSION >= 13000
      check(cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), dsts.size(), &attr,
                                 &attr_index, 1, stream_),
            "cudaMemcpyBatchAsync");
#else
      std::size_t fail_index = 0;
      check(cudaMemcpyBatchAsync(dsts.data(), const_cast<void**>(srcs.data()), sizes.data(),
                                 dsts.size(), &attr, &attr_index, 1, &fail_index, stream_),
            "cudaMemcpyBatchAsync");
#endif
      return;
    }
#endif
    for (const CopyRegion& r : regions) copy_async(r.dst, r.src, r.bytes);
  }

  void transfer_pages_async(const PageTransfer& t, int max_blocks) override {
    validate_page_transfer(t);
    check(cudaSetDevice(ordinal_), "cudaSetDevice");
    check(static_cast<cudaError_t>(launch_transfer_pages_cuda(t, stream_, max_blocks)),
          "transfer_pages kernel launch");
  }

  void launch_host_func(std::function<void()> fn) override {
    if (!fn) throw InvalidArgument("Stream::launch_host_func: empty function");
    auto* payload = new HostFunc{std::move(fn), this};
    const cudaError_t err = cudaLaunchHostFunc(stream_, &CudaStream::trampoline, payload);
    if (err != cudaSuccess) {
      delete payload;
      check(err, "cudaLaunchHostFunc");
    }
  }

  void record(Event& event) override {
    auto* cuda_event = dynamic_cast<CudaEvent*>(&event);
    if (cuda_event == nullptr) {
      throw InvalidArgument("Stream::record: the event belongs to another device backend");
    }
    check(cudaEventRecord(cuda_event->handle(), stream_), "cudaEventRecord");
  }

  void wait(const Event& event) override {
    const auto* cuda_event = dynamic_cast<const CudaEvent*>(&event);
    if (cuda_event == nullptr) {
      throw InvalidArgument("Stream::wait: the event belongs to another device backend");
    }
    check(cudaStreamWaitEvent(stream_, cuda_event->handle(), 0), "cudaStreamWaitEvent");
  }

  void synchronize() override {
    check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    std::exception_ptr error;
    {
      MutexLock lock(mu_);
      error = std::exchange(host_func_error_, nullptr);
    }
    if (error) {
      try {
        std::rethrow_exception(error);
      } catch (const std::exception& e) {
        throw DeviceError(str_cat("cuda stream: a host function failed: ", e.what()));
      }
    }
  }

  cudaStream_t handle() const { return stream_; }
  void* native_handle() const override { return stream_; }

 private:
  struct HostFunc {
    std::function<void()> fn;
    CudaStream* stream;
  };

  // Runs on the CUDA runtime's callback thread; an exception must not escape into the runtime.
  static void CUDART_CB trampoline(void* data) {
    std::unique_ptr<HostFunc> payload(static_cast<HostFunc*>(data));
    try {
      payload->fn();
    } catch (...) {
      payload->stream->keep_current_error();
    }
  }

  // In a handler: keeps the exception being handled unless one is kept already. A function of
  // its own: clang's thread-safety analysis does not look into handlers, but it checks this.
  void keep_current_error() HICACHE_EXCLUDES(mu_) {
    MutexLock lock(mu_);
    if (!host_func_error_) host_func_error_ = std::current_exception();
  }

  int ordinal_;
  cudaStream_t stream_ = nullptr;
  bool owned_ = true;
  Mutex mu_;
  std::exception_ptr host_func_error_ HICACHE_GUARDED_BY(mu_);
};

}  // namespace

bool cuda_device_present(std::string* why) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    if (why != nullptr) {
      *why = str_cat("cudaGetDeviceCount returned ", static_cast<int>(err), " (",
                     cudaGetErrorName(err), ": ", cudaGetErrorString(err), ")");
    }
    cudaGetLastError();  // clear the non-sticky error
    return false;
  }
  if (count == 0) {
    if (why != nullptr) *why = "the CUDA runtime reports 0 devices";
    return false;
  }
  return true;
}

CudaDevice::CudaDevice(int ordinal) : ordinal_(ordinal) {
  int count = 0;
  check(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
  if (ordinal < 0 || ordinal >= count) {
    throw DeviceError(str_cat("CUDA device ordinal ", ordinal, " out of range: ", count,
                              " device(s) present"));
  }
  check(cudaSetDevice(ordinal_), "cudaSetDevice");
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, ordinal_), "cudaGetDeviceProperties");
  name_ = str_cat(prop.name, " (sm_", prop.major, prop.minor, ", ", prop.multiProcessorCount,
                  " SMs, ", prop.totalGlobalMem >> 30, " GiB)");
}

CudaDevice::~CudaDevice() = default;

Buffer CudaDevice::alloc_device(std::size_t bytes) {
  if (bytes == 0) throw InvalidArgument("CudaDevice::alloc_device: size is 0 bytes");
  check(cudaSetDevice(ordinal_), "cudaSetDevice");
  void* p = nullptr;
  check(cudaMalloc(&p, bytes), str_cat("cudaMalloc of ", bytes, " bytes").c_str());
  Buffer buffer(p, bytes, [](void* data, std::size_t) { cudaFree(data); });
  check(cudaMemset(p, 0, bytes), "cudaMemset");
  return buffer;
}

Buffer CudaDevice::alloc_host(std::size_t bytes, const HostMemoryOptions& options) {
  if (bytes == 0) throw InvalidArgument("CudaDevice::alloc_host: size is 0 bytes");
  Buffer mapped = map_host_memory(bytes, options);
  check(cudaHostRegister(mapped.data(), mapped.size(), cudaHostRegisterDefault),
        str_cat("cudaHostRegister of ", mapped.size(), " bytes").c_str());
  // The new buffer unregisters, then the moved-from mapping's release unmaps.
  auto holder = std::make_shared<Buffer>(std::move(mapped));
  void* data = holder->data();
  const std::size_t size = holder->size();
  return Buffer(data, size, [holder](void* p, std::size_t) mutable {
    cudaHostUnregister(p);
    holder.reset();
  });
}

Buffer CudaDevice::wrap_device(void* data, std::size_t bytes) {
  Buffer checked = Device::wrap_device(data, bytes);  // the argument checks
  cudaPointerAttributes attr{};
  check(cudaPointerGetAttributes(&attr, data), "cudaPointerGetAttributes");
  if ((attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) ||
      attr.device != ordinal_) {
    throw DeviceError(str_cat("CudaDevice::wrap_device: ", data, " is not memory of GPU ",
                              ordinal_, " (cudaPointerGetAttributes type ",
                              static_cast<int>(attr.type), ", device ", attr.device, ")"));
  }
  return checked;
}

Buffer CudaDevice::wrap_host(void* data, std::size_t bytes) {
  Buffer checked = Device::wrap_host(data, bytes);
  cudaPointerAttributes attr{};
  check(cudaPointerGetAttributes(&attr, data), "cudaPointerGetAttributes");
  if (attr.type == cudaMemoryTypeHost) return checked;  // page-locked already (pin_memory)
  if (attr.type != cudaMemoryTypeUnregistered) {
    throw DeviceError(str_cat("CudaDevice::wrap_host: ", data,
                              " is device memory, not host memory (type ",
                              static_cast<int>(attr.type), ")"));
  }
  check(cudaHostRegister(data, bytes, cudaHostRegisterDefault),
        str_cat("cudaHostRegister of the engine's ", bytes, " bytes").c_str());
  return Buffer(data, bytes, [](void* p, std::size_t) { cudaHostUnregister(p); });
}

std::unique_ptr<Stream> CudaDevice::create_stream() { return std::make_unique<CudaStream>(ordinal_); }

std::unique_ptr<Stream> CudaDevice::wrap_stream(void* native) {
  // nullptr is the legacy default stream, which is a valid stream to order work on.
  return std::make_unique<CudaStream>(ordinal_, static_cast<cudaStream_t>(native));
}

std::unique_ptr<Event> CudaDevice::create_event() { return std::make_unique<CudaEvent>(ordinal_); }

void CudaDevice::synchronize() {
  check(cudaSetDevice(ordinal_), "cudaSetDevice");
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

}  // namespace hicache
