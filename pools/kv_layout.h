// Host KV layouts and their LayoutDesc (kernels/layout_math.h): the strides that transfer/ and
// storage/ use without knowing the pool classes.
//
// Shapes, outermost first (u = unit_bytes, L = layers, kv = 2 for MHA and 1 for MLA):
//   device             [L][kv][tokens][u]               one K and one V buffer per layer
//   layer_first        [L][kv][tokens][u]               per (layer, K/V) a token-indexed buffer
//   page_first         [pages][page_size][L][kv][u]     all of a token's layers together
//   page_first_direct  [pages][L][kv][page_size][u]     per (page, layer, K/V) one run
// SGLang puts K/V outermost in its host layouts; hicache puts it inside the page for page_first
// and page_first_direct, so that a whole page (every layer, K and V) is one contiguous block:
// storage reads and writes it in place, with no staging copy (zero-copy L3 I/O). layer_first
// has no contiguous page; storage I/O on it goes through a staging buffer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "kernels/layout_math.h"
#include "pools/kv_geometry.h"

namespace hicache {

enum class HostLayout { kLayerFirst, kPageFirst, kPageFirstDirect };

// The dimension order of a buffer: hicache's own (above), or SGLang's, which puts K/V outermost
// (S = token slots, P = page size, H x D = one unit):
//   device, layer_first  MHA (2, L, S, H, D)        MLA (L, S, 1, D)
//   page_first           MHA (2, S, L, H, D)        MLA (S, L, 1, D)
//   page_first_direct    MHA (2, S/P, L, P, H, D)   MLA (S/P, L, P, 1, D)
// With SGLang's order an MHA page is two blocks (K, V), so storage I/O on it goes through a
// staging buffer; an MLA page_first(_direct) page is one block, as in hicache's order.
enum class DimOrder { kHicache, kSglang };
// Accepts "hicache", "sglang"; throws InvalidArgument otherwise.
DimOrder parse_dim_order(std::string_view name);
std::string_view to_string(DimOrder order);

// A KV buffer the engine owns, which a pool wraps in place: hicache never frees, reallocates or
// resizes it, and the engine keeps it alive (and does not move it) for the pool's lifetime.
struct ExternalKVBuffer {
  void* data = nullptr;
  std::size_t bytes = 0;  // exactly kv_buffer_bytes(geometry, num_tokens)
  DimOrder order = DimOrder::kSglang;
};

// Accepts "layer_first", "page_first", "page_first_direct"; throws InvalidArgument otherwise.
HostLayout parse_host_layout(std::string_view name);
std::string_view to_string(HostLayout layout);

// Strides of a host buffer of `num_tokens` slots (a positive multiple of page_size) in `layout`.
// Throws InvalidArgument for a bad token count.
LayoutDesc make_host_layout(HostLayout layout, const KVGeometry& geometry, std::int64_t num_tokens,
                            void* base, DimOrder order = DimOrder::kHicache);
// Strides of the device KV buffer (one K and one V buffer per layer, token-indexed; with
// SGLang's order all K buffers first, then all V buffers).
LayoutDesc make_device_layout(const KVGeometry& geometry, std::int64_t num_tokens, void* base,
                              DimOrder order = DimOrder::kHicache);

// Bytes a buffer of `num_tokens` slots occupies in any layout.
std::int64_t kv_buffer_bytes(const KVGeometry& geometry, std::int64_t num_tokens);

// Throws InvalidArgument unless num_tokens is a positive multiple of the page size.
void check_token_count(const KVGeometry& geometry, std::int64_t num_tokens, std::string_view what);

}  // namespace hicache
