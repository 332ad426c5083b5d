#include "pools/kv_layout.h"

#include "transfer/errors.h"

namespace hicache {

HostLayout parse_host_layout(std::string_view name) {
  if (name == "layer_first") return HostLayout::kLayerFirst;
  if (name == "page_first") return HostLayout::kPageFirst;
  if (name == "page_first_direct") return HostLayout::kPageFirstDirect;
  throw InvalidArgument(str_cat("unknown host layout '", name,
                                "': valid are layer_first, page_first, page_first_direct"));
}

DimOrder parse_dim_order(std::string_view name) {
  if (name == "hicache") return DimOrder::kHicache;
  if (name == "sglang") return DimOrder::kSglang;
  throw InvalidArgument(str_cat("unknown dimension order '", name, "': valid are hicache, sglang"));
}

std::string_view to_string(DimOrder order) {
  return order == DimOrder::kSglang ? "sglang" : "hicache";
}

std::string_view to_string(HostLayout layout) {
  switch (layout) {
    case HostLayout::kLayerFirst:
      return "layer_first";
    case HostLayout::kPageFirst:
      return "page_first";
    case HostLayout::kPageFirstDirect:
      return "page_first_direct";
  }
  return "unknown";
}

void check_token_count(const KVGeometry& geometry, std::int64_t num_tokens, std::string_view what) {
  if (num_tokens <= 0 || num_tokens % geometry.page_size != 0) {
    throw InvalidArgument(str_cat(what, ": ", num_tokens,
                                  " tokens is not a positive multiple of the page size ",
                                  geometry.page_size));
  }
}

std::int64_t kv_buffer_bytes(const KVGeometry& geometry, std::int64_t num_tokens) {
  return geometry.token_bytes() * num_tokens;
}

namespace {

LayoutDesc base_desc(const KVGeometry& geometry, std::int64_t num_tokens, void* base) {
  geometry.validate();
  LayoutDesc d;
  d.base = static_cast<std::uint8_t*>(base);
  d.num_tokens = num_tokens;
  d.num_layers = geometry.num_layers;
  d.num_kv = geometry.num_kv();
  d.page_size = geometry.page_size;
  d.unit_bytes = geometry.unit_bytes();
  return d;
}

}  // namespace

LayoutDesc make_host_layout(HostLayout layout, const KVGeometry& geometry, std::int64_t num_tokens,
                            void* base, DimOrder order) {
  check_token_count(geometry, num_tokens, "make_host_layout");
  LayoutDesc d = base_desc(geometry, num_tokens, base);
  const std::int64_t u = d.unit_bytes;
  const std::int64_t kv = d.num_kv;
  const std::int64_t layers = d.num_layers;
  const std::int64_t ps = d.page_size;
  if (order == DimOrder::kSglang) {
    // K/V outermost: the V half starts after every layer's K.
    d.kv_stride = kv > 1 ? layers * num_tokens * u : 0;
    switch (layout) {
      case HostLayout::kLayerFirst:  // (2, L, S, unit)
        d.token_stride = u;
        d.page_stride = ps * u;
        d.layer_stride = num_tokens * u;
        return d;
      case HostLayout::kPageFirst:  // (2, S, L, unit)
        d.layer_stride = u;
        d.token_stride = layers * u;
        d.page_stride = ps * d.token_stride;
        return d;
      case HostLayout::kPageFirstDirect:  // (2, S/P, L, P, unit)
        d.token_stride = u;
        d.layer_stride = ps * u;
        d.page_stride = layers * d.layer_stride;
        return d;
    }
  }
  switch (layout) {
    case HostLayout::kLayerFirst:
      d.token_stride = u;
      d.page_stride = ps * u;
      d.kv_stride = num_tokens * u;
      d.layer_stride = kv * num_tokens * u;
      return d;
    case HostLayout::kPageFirst:
      d.kv_stride = u;
      d.layer_stride = kv * u;
      d.token_stride = layers * kv * u;
      d.page_stride = ps * d.token_stride;
      return d;
    case HostLayout::kPageFirstDirect:
      d.token_stride = u;
      d.kv_stride = ps * u;
      d.layer_stride = kv * ps * u;
      d.page_stride = layers * d.layer_stride;
      return d;
  }
  throw InvalidArgument(str_cat("make_host_layout: unknown layout value ", static_cast<int>(layout)));
}

LayoutDesc make_device_layout(const KVGeometry& geometry, std::int64_t num_tokens, void* base,
                              DimOrder order) {
  check_token_count(geometry, num_tokens, "make_device_layout");
  // The device buffer is token-indexed per (layer, K/V), the same strides as layer_first.
  return make_host_layout(HostLayout::kLayerFirst, geometry, num_tokens, base, order);
}

}  // namespace hicache
