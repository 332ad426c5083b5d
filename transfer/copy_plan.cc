#include "transfer/copy_plan.h"

#include "transfer/errors.h"

namespace hicache {
void append_page_copies(const LayoutDesc& dst, std::span<const std::int64_t> dst_pages,
                        const LayoutDesc& src, std::span<const std::int64_t> src_pages,
                        std::int32_t layer_begin, std::int32_t layer_end,
                        std::vector<CopyRegion>& regions) {
  if (dst_pages.size() != src_pages.size()) {
    throw InvalidArgument(str_cat("copy plan: ", dst_pages.size(), " destination pages for ",
                                  src_pages.size(), " source pages"));
  }
  const PageTransfer t{dst,         src,      dst_pages.data(), src_pages.data(),
                       static_cast<std::int64_t>(dst_pages.size()), layer_begin, layer_end};
  validate_page_transfer(t);
  const std::int64_t n = transfer_item_count(t);
  regions.reserve(regions.size() + static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) {
    const TransferItem item = transfer_item(t, i);
    regions.push_back({dst.base + item.dst_offset, src.base + item.src_offset,
                       static_cast<std::size_t>(item.bytes)});
  }
}

void validate_page_transfer(const PageTransfer& t) {
  if (t.dst.num_layers != t.src.num_layers || t.dst.num_kv != t.src.num_kv ||
      t.dst.page_size != t.src.page_size || t.dst.unit_bytes != t.src.unit_bytes) {
    throw InvalidArgument(str_cat("page transfer: layouts differ (layers ", t.dst.num_layers, "/",
                                  t.src.num_layers, ", kv ", t.dst.num_kv, "/", t.src.num_kv,
                                  ", page ", t.dst.page_size, "/", t.src.page_size,
                                  ", unit bytes ", t.dst.unit_bytes, "/", t.src.unit_bytes, ")"));
  }
  if (t.layer_begin < 0 || t.layer_end > t.dst.num_layers || t.layer_begin >= t.layer_end) {
    throw InvalidArgument(str_cat("page transfer: layer range [", t.layer_begin, ", ",
                                  t.layer_end, ") is not inside [0, ", t.dst.num_layers, ")"));
  }
  if (t.num_pages < 0 || (t.num_pages > 0 && (t.dst_pages == nullptr || t.src_pages == nullptr))) {
    throw InvalidArgument(str_cat("page transfer: ", t.num_pages, " pages with null page lists"));
  }
  const std::int64_t dst_pages = t.dst.num_tokens / t.dst.page_size;
  const std::int64_t src_pages = t.src.num_tokens / t.src.page_size;
  for (std::int64_t i = 0; i < t.num_pages; ++i) {
    if (t.dst_pages[i] < 0 || t.dst_pages[i] >= dst_pages) {
      throw InvalidArgument(str_cat("page transfer: destination page ", t.dst_pages[i],
                                    " is out of range [0, ", dst_pages, ")"));
    }
    if (t.src_pages[i] < 0 || t.src_pages[i] >= src_pages) {
      throw InvalidArgument(str_cat("page transfer: source page ", t.src_pages[i],
                                    " is out of range [0, ", src_pages, ")"));
    }
  }
}

}  // namespace hicache
