#include <cstdint>
#include <cstring>
#include <initializer_list>

#include "kernels/page_transfer.h"

namespace hicache {

void transfer_pages_cpu(const PageTransfer& t) {
  const std::int64_t n = transfer_item_count(t);
  for (std::int64_t i = 0; i < n; ++i) {
    const TransferItem item = transfer_item(t, i);
    std::memcpy(t.dst.base + item.dst_offset, t.src.base + item.src_offset,
                static_cast<std::size_t>(item.bytes));
  }
}

}  // namespace hicache

namespace hicache {

std::int32_t transfer_vector_bytes(const PageTransfer& t) {
  std::uint64_t bits = reinterpret_cast<std::uintptr_t>(t.dst.base) |
                       reinterpret_cast<std::uintptr_t>(t.src.base);
  for (const LayoutDesc* d : {&t.dst, &t.src}) {
    bits |= static_cast<std::uint64_t>(d->page_stride | d->token_stride | d->layer_stride |
                                       d->kv_stride | d->unit_bytes | d->layer_offsets_bits);
  }
  bits |= 16;  // cap at 16 bytes
  return static_cast<std::int32_t>(bits & (~bits + 1));  // lowest set bit
}

}  // namespace hicache
