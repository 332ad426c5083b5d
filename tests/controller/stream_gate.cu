#include <cuda_runtime.h>

namespace hicache {
namespace {

__global__ void stream_gate_kernel(const volatile int* flag, long long max_cycles) {
  const long long start = clock64();
  while (*flag == 0 && clock64() - start < max_cycles) {
  }
}

}  // namespace

int launch_stream_gate(const volatile int* flag, void* cuda_stream) {
  // ~10 s at 2 GHz: the longest a forgotten gate can hold the GPU.
  stream_gate_kernel<<<1, 1, 0, static_cast<cudaStream_t>(cuda_stream)>>>(flag, 20'000'000'000LL);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace hicache
