// Index math of KV buffer layouts, shared by the CUDA kernels and the CPU transfer path.
//
// Every KV buffer in hicache, device or host, whatever its layout, is described by a
// LayoutDesc: a base pointer and four byte strides that place the "unit" of one token of one
// layer of K or V (or of the MLA latent). Both the GPU gather/scatter kernels and the CPU
// implementation the host backend runs call these functions, so the CPU test suite checks the
// arithmetic the GPU executes.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define HICACHE_HD __host__ __device__ __forceinline__
#else
#define HICACHE_HD inline
#endif

namespace hicache {

struct LayoutDesc {
  std::uint8_t* base = nullptr;  // first byte of the buffer
  std::int64_t num_tokens = 0;   // capacity in token slots, a multiple of page_size
  std::int32_t num_layers = 0;
  std::int32_t num_kv = 0;       // 2 for MHA (K then V), 1 for MLA (one latent buffer)
  std::int32_t page_size = 0;    // tokens per page
  std::int64_t unit_bytes = 0;   // bytes of one token of one layer of one of K/V
  std::int64_t page_stride = 0;  // bytes between page p and page p + 1
  std::int64_t token_stride = 0; // bytes between consecutive tokens of one page
  std::int64_t layer_stride = 0; // bytes between layer l and layer l + 1
  std::int64_t kv_stride = 0;    // bytes between K and V of the same token and layer
  // Buffers per (layer, kv) at unrelated addresses (an engine's per-layer tensors): the byte
  // offset from `base` of the buffer of (layer, kv) is layer_offsets[layer * num_kv + kv], and
  // layer_stride and kv_stride are unused. Null: layer * layer_stride + kv * kv_stride. The
  // same table twice: in host memory for the CPU (plans, the CPU path), and in device memory for
  // the kernels (the host copy on the host emulation). Both outlive every transfer that uses
  // the layout.
  const std::int64_t* layer_offsets = nullptr;
  const std::int64_t* layer_offsets_device = nullptr;
  std::int64_t layer_offsets_bits = 0;  // the table's entries ORed (their common alignment)
};

// Byte offset from `d.base` of the buffer of (layer, kv).
HICACHE_HD std::int64_t layer_offset(const LayoutDesc& d, std::int32_t layer, std::int32_t kv) {
#if defined(__CUDA_ARCH__)
  const std::int64_t* table = d.layer_offsets_device;
#else
  const std::int64_t* table = d.layer_offsets;
#endif
  return table != nullptr ? table[layer * d.num_kv + kv] : layer * d.layer_stride + kv * d.kv_stride;
}

// Byte offset from `d.base` of the unit (layer, kv, token slot).
HICACHE_HD std::int64_t unit_offset(const LayoutDesc& d, std::int32_t layer, std::int32_t kv,
                                    std::int64_t token) {
  const std::int64_t page = token / d.page_size;
  const std::int64_t in_page = token - page * d.page_size;
  return page * d.page_stride + in_page * d.token_stride + layer_offset(d, layer, kv);
}

// Byte offset of the first unit of page `page` for (layer, kv).
HICACHE_HD std::int64_t page_unit_offset(const LayoutDesc& d, std::int32_t layer, std::int32_t kv,
                                         std::int64_t page) {
  return page * d.page_stride + layer_offset(d, layer, kv);
}

// True when the tokens of one page of one (layer, kv) lie back to back, so that the page's
// units for that (layer, kv) form one run of page_size * unit_bytes bytes.
HICACHE_HD bool page_run_contiguous(const LayoutDesc& d) { return d.token_stride == d.unit_bytes; }

// Bytes of one page of one (layer, kv) when page_run_contiguous(d).
HICACHE_HD std::int64_t page_run_bytes(const LayoutDesc& d) {
  return d.unit_bytes * d.page_size;
}

// Bytes of one whole page: all layers, K and V.
HICACHE_HD std::int64_t page_total_bytes(const LayoutDesc& d) {
  return d.unit_bytes * d.page_size * d.num_layers * d.num_kv;
}

// True when all bytes of a page (every layer, K and V) form one contiguous block starting at
// page * page_stride: the layout then offers a zero-copy byte view of a whole page.
HICACHE_HD bool page_block_contiguous(const LayoutDesc& d) {
  return d.page_stride == page_total_bytes(d);
}

}  // namespace hicache
