// CUDA gather/scatter of KV pages between layouts (see page_transfer.h). One warp copies one
// item at a time with the widest loads the alignment allows (16 bytes where it can), keeping
// four independent loads in flight per thread; pinned host memory is reached through unified
// virtual addressing, so one kernel serves host->device and device->host.
#include <cuda_runtime.h>

#include "kernels/page_transfer.h"

namespace hicache {
namespace {

template <int kBytes>
struct Vec;
template <>
struct Vec<16> {
  using type = uint4;
};
template <>
struct Vec<8> {
  using type = uint2;
};
template <>
struct Vec<4> {
  using type = unsigned int;
};
template <>
struct Vec<2> {
  using type = unsigned short;
};
template <>
struct Vec<1> {
  using type = unsigned char;
};

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;
// A warp copies one chunk of an item at a time, so a transfer of a few large runs (one page of
// one layer is two 128 KiB runs in the standard geometry) still spreads over many warps.
constexpr std::int64_t kChunkBytes = 2048;

template <int kBytes>
__global__ void __launch_bounds__(kThreads)
    transfer_pages_kernel(PageTransfer t, std::int64_t work, std::int64_t chunks) {
  using T = typename Vec<kBytes>::type;
  const int lane = threadIdx.x & 31;
  const std::int64_t warp = (static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x) >> 5;
  const std::int64_t warps = (static_cast<std::int64_t>(gridDim.x) * kThreads) >> 5;
  for (std::int64_t w = warp; w < work; w += warps) {
    const TransferItem item = transfer_item(t, w / chunks);
    const std::int64_t begin = (w % chunks) * kChunkBytes;
    const std::int64_t end = begin + kChunkBytes < item.bytes ? begin + kChunkBytes : item.bytes;
    const T* __restrict__ src = reinterpret_cast<const T*>(t.src.base + item.src_offset + begin);
    T* __restrict__ dst = reinterpret_cast<T*>(t.dst.base + item.dst_offset + begin);
    const std::int64_t n = (end - begin) / kBytes;
    std::int64_t k = lane;
    for (; k + 96 < n; k += 128) {
      const T a = src[k], b = src[k + 32], c = src[k + 64], d = src[k + 96];
      dst[k] = a;
      dst[k + 32] = b;
      dst[k + 64] = c;
      dst[k + 96] = d;
    }
    for (; k < n; k += 32) dst[k] = src[k];
  }
}

template <int kBytes>
cudaError_t launch(const PageTransfer& t, std::int64_t work, std::int64_t chunks, int blocks,
                   cudaStream_t stream) {
  transfer_pages_kernel<kBytes><<<blocks, kThreads, 0, stream>>>(t, work, chunks);
  return cudaGetLastError();
}

}  // namespace

int launch_transfer_pages_cuda(const PageTransfer& t, void* cuda_stream, int max_blocks) {
  const std::int64_t items = transfer_item_count(t);
  if (items == 0) return 0;
  // Every item of a transfer has the same size (a run or a unit); chunks are a power of two,
  // so the vector width, which divides the item size, divides every chunk boundary too.
  const std::int64_t item_bytes = transfer_item(t, 0).bytes;
  const std::int64_t chunks = (item_bytes + kChunkBytes - 1) / kChunkBytes;
  const std::int64_t work = items * chunks;
  std::int64_t blocks = (work + kWarpsPerBlock - 1) / kWarpsPerBlock;
  if (max_blocks > 0 && blocks > max_blocks) blocks = max_blocks;
  if (blocks > 65535) blocks = 65535;
  auto stream = static_cast<cudaStream_t>(cuda_stream);
  const int b = static_cast<int>(blocks);
  switch (transfer_vector_bytes(t)) {
    case 16:
      return launch<16>(t, work, chunks, b, stream);
    case 8:
      return launch<8>(t, work, chunks, b, stream);
    case 4:
      return launch<4>(t, work, chunks, b, stream);
    case 2:
      return launch<2>(t, work, chunks, b, stream);
    default:
      return launch<1>(t, work, chunks, b, stream);
  }
}

}  // namespace hicache
