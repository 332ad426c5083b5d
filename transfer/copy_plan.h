// Copy plans: the list of contiguous copies that moves pages between two KV layouts
// (kernels/layout_math.h). This is the `direct` I/O path: one copy per page and (layer, K/V)
// when both layouts store a page's tokens back to back, one per token otherwise.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kernels/layout_math.h"
#include "kernels/page_transfer.h"
#include "transfer/device.h"

namespace hicache {

// Appends to `regions` the copies that move, for layers [layer_begin, layer_end), page
// src_pages[i] of `src` into page dst_pages[i] of `dst`. Throws InvalidArgument when the two
// layouts disagree on geometry, the spans differ in length, or a page is out of range.
void append_page_copies(const LayoutDesc& dst, std::span<const std::int64_t> dst_pages,
                        const LayoutDesc& src, std::span<const std::int64_t> src_pages,
                        std::int32_t layer_begin, std::int32_t layer_end,
                        std::vector<CopyRegion>& regions);

// Throws InvalidArgument when the layouts of `t` disagree on geometry, its layer range is empty
// or out of bounds, or a page is out of range (reads the page lists on the CPU).
void validate_page_transfer(const PageTransfer& t);

}  // namespace hicache
