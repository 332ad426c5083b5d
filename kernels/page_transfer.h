// Page gather/scatter between two KV layouts: the `kernel` I/O path. One call moves, for the
// layers [layer_begin, layer_end), page src_pages[i] of `src` into page dst_pages[i] of `dst`.
//
// The work is cut into items: one (page, layer, K/V) run when both layouts keep a page's tokens
// back to back, else one (page, layer, K/V, token) unit. transfer_item() below is the single
// definition of what an item copies; the CPU path (page_transfer_cpu.cc) and the CUDA kernel
// (page_transfer.cu) both call it.
#pragma once

#include <cstdint>

#include "kernels/layout_math.h"

namespace hicache {

struct PageTransfer {
  LayoutDesc dst;
  LayoutDesc src;
  // Page lists of num_pages entries each, readable by the CPU and, on CUDA, by the device:
  // pinned host memory. They must stay valid until the transfer has run.
  const std::int64_t* dst_pages = nullptr;
  const std::int64_t* src_pages = nullptr;
  std::int64_t num_pages = 0;
  std::int32_t layer_begin = 0;
  std::int32_t layer_end = 0;
};

struct TransferItem {
  std::int64_t dst_offset;
  std::int64_t src_offset;
  std::int64_t bytes;
};

// True when items are whole (page, layer, K/V) runs.
HICACHE_HD bool transfer_by_runs(const PageTransfer& t) {
  return page_run_contiguous(t.dst) && page_run_contiguous(t.src);
}

HICACHE_HD std::int64_t transfer_item_count(const PageTransfer& t) {
  const std::int64_t per_page =
      std::int64_t{t.layer_end - t.layer_begin} * t.dst.num_kv *
      (transfer_by_runs(t) ? 1 : t.dst.page_size);
  return t.num_pages * per_page;
}

// Item `index` in [0, transfer_item_count(t)): ordered page-major, then layer, K/V, token.
HICACHE_HD TransferItem transfer_item(const PageTransfer& t, std::int64_t index) {
  const bool runs = transfer_by_runs(t);
  const std::int64_t tokens = runs ? 1 : t.dst.page_size;
  const std::int64_t token = index % tokens;
  index /= tokens;
  const auto kv = static_cast<std::int32_t>(index % t.dst.num_kv);
  index /= t.dst.num_kv;
  const std::int64_t layers = t.layer_end - t.layer_begin;
  const auto layer = static_cast<std::int32_t>(t.layer_begin + index % layers);
  const std::int64_t i = index / layers;
  const std::int64_t dst_slot = t.dst_pages[i] * t.dst.page_size + token;
  const std::int64_t src_slot = t.src_pages[i] * t.src.page_size + token;
  return {unit_offset(t.dst, layer, kv, dst_slot), unit_offset(t.src, layer, kv, src_slot),
          runs ? page_run_bytes(t.dst) : t.dst.unit_bytes};
}

// Runs the transfer on the calling thread. REQUIRES: t was validated (transfer/copy_plan.h).
void transfer_pages_cpu(const PageTransfer& t);

// Largest power of two up to 16 dividing both base addresses, every stride and the item size:
// the width of the loads and stores the CUDA kernel uses.
std::int32_t transfer_vector_bytes(const PageTransfer& t);

// Enqueues the transfer on `cuda_stream` (a cudaStream_t) as one kernel launch of at most
// `max_blocks` thread blocks (0: as many as the work wants), so a transfer leaves
// multiprocessors to the model. Returns 0 or the cudaError_t of the launch. Defined only in
// builds with CUDA. REQUIRES: t was validated.
int launch_transfer_pages_cuda(const PageTransfer& t, void* cuda_stream, int max_blocks);

}  // namespace hicache
