// Deterministic KV test data: every byte of a page is a function of (page key, layer, K/V,
// offset), so any tier can verify any page it loads without keeping a copy. Used by the tests,
// the workload tool and the stress tool.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "kernels/layout_math.h"

namespace hicache {

// Fills `out` with the bytes of unit run (key, layer, kv) starting at byte `offset` of that run.
void fill_pattern(std::span<std::byte> out, std::uint64_t key, std::int32_t layer, std::int32_t kv,
                  std::uint64_t offset = 0);
// Returns the index of the first byte of `data` that differs from the pattern, or -1.
std::int64_t find_pattern_mismatch(std::span<const std::byte> data, std::uint64_t key,
                                   std::int32_t layer, std::int32_t kv, std::uint64_t offset = 0);

// Writes the pattern of page key `key` into page `page` of a CPU-addressable buffer `d`, for
// every layer and K/V (each (layer, kv) run is the pattern from offset 0).
void fill_page(const LayoutDesc& d, std::int64_t page, std::uint64_t key);
// Checks page `page` of `d` against key `key`; returns true when every byte matches. On a
// mismatch `where` (if given) receives "layer L kv K token T byte B".
bool verify_page(const LayoutDesc& d, std::int64_t page, std::uint64_t key,
                 std::string* where = nullptr);

}  // namespace hicache
