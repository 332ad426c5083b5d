#include "transfer/copy_plan.h"

#include "transfer/errors.h"

namespace hicache {
namespace {

void check_compatible(const LayoutDesc& dst, const LayoutDesc& src) {
  if (dst.num_layers != src.num_layers || dst.num_kv != src.num_kv ||
      dst.page_size != src.page_size || dst.unit_bytes != src.unit_bytes) {
    throw InvalidArgument(str_cat("copy plan: layouts differ (layers ", dst.num_layers, "/",
                                  src.num_layers, ", kv ", dst.num_kv, "/", src.num_kv, ", page ",
                                  dst.page_size, "/", src.page_size, ", unit bytes ",
                                  dst.unit_bytes, "/", src.unit_bytes, ")"));
  }
}

void check_page(const LayoutDesc& d, std::int64_t page, const char* side) {
  const std::int64_t pages = d.num_tokens / d.page_size;
  if (page < 0 || page >= pages) {
    throw InvalidArgument(str_cat("copy plan: ", side, " page ", page, " is out of range [0, ",
                                  pages, ")"));
  }
}

}  // namespace

void append_page_copies(const LayoutDesc& dst, std::span<const std::int64_t> dst_pages,
                        const LayoutDesc& src, std::span<const std::int64_t> src_pages,
                        std::int32_t layer_begin, std::int32_t layer_end,
                        std::vector<CopyRegion>& regions) {
  check_compatible(dst, src);
  if (dst_pages.size() != src_pages.size()) {
    throw InvalidArgument(str_cat("copy plan: ", dst_pages.size(), " destination pages for ",
                                  src_pages.size(), " source pages"));
  }
  if (layer_begin < 0 || layer_end > dst.num_layers || layer_begin >= layer_end) {
    throw InvalidArgument(str_cat("copy plan: layer range [", layer_begin, ", ", layer_end,
                                  ") is not inside [0, ", dst.num_layers, ")"));
  }
  for (std::size_t i = 0; i < dst_pages.size(); ++i) {
    check_page(dst, dst_pages[i], "destination");
    check_page(src, src_pages[i], "source");
  }
  const bool runs = page_run_contiguous(dst) && page_run_contiguous(src);
  const auto unit = static_cast<std::size_t>(dst.unit_bytes);
  for (std::size_t i = 0; i < dst_pages.size(); ++i) {
    for (std::int32_t layer = layer_begin; layer < layer_end; ++layer) {
      for (std::int32_t kv = 0; kv < dst.num_kv; ++kv) {
        if (runs) {
          regions.push_back({dst.base + page_unit_offset(dst, layer, kv, dst_pages[i]),
                             src.base + page_unit_offset(src, layer, kv, src_pages[i]),
                             static_cast<std::size_t>(page_run_bytes(dst))});
          continue;
        }
        for (std::int32_t t = 0; t < dst.page_size; ++t) {
          regions.push_back(
              {dst.base + unit_offset(dst, layer, kv, dst_pages[i] * dst.page_size + t),
               src.base + unit_offset(src, layer, kv, src_pages[i] * src.page_size + t), unit});
        }
      }
    }
  }
}

}  // namespace hicache
