#include "pools/kv_pattern.h"

#include <cstring>

#include "transfer/errors.h"

namespace hicache {
namespace {

std::uint64_t mix(std::uint64_t x) {  // splitmix64 finaliser
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

std::uint64_t run_seed(std::uint64_t key, std::int32_t layer, std::int32_t kv) {
  return mix(mix(key) ^ (static_cast<std::uint64_t>(layer) << 32) ^
             static_cast<std::uint64_t>(kv));
}

std::uint8_t pattern_byte(std::uint64_t seed, std::uint64_t pos) {
  return static_cast<std::uint8_t>(mix(seed ^ (pos / 8)) >> (8 * (pos % 8)));
}

}  // namespace

void fill_pattern(std::span<std::byte> out, std::uint64_t key, std::int32_t layer, std::int32_t kv,
                  std::uint64_t offset) {
  const std::uint64_t seed = run_seed(key, layer, kv);
  std::size_t i = 0;
  for (; i < out.size() && (offset + i) % 8 != 0; ++i) {
    out[i] = std::byte{pattern_byte(seed, offset + i)};
  }
  for (; i + 8 <= out.size(); i += 8) {
    const std::uint64_t word = mix(seed ^ ((offset + i) / 8));
    std::memcpy(out.data() + i, &word, 8);  // little-endian: byte b is word >> 8b
  }
  for (; i < out.size(); ++i) out[i] = std::byte{pattern_byte(seed, offset + i)};
}

std::int64_t find_pattern_mismatch(std::span<const std::byte> data, std::uint64_t key,
                                   std::int32_t layer, std::int32_t kv, std::uint64_t offset) {
  const std::uint64_t seed = run_seed(key, layer, kv);
  std::size_t i = 0;
  for (; i + 8 <= data.size() && (offset + i) % 8 == 0; i += 8) {
    const std::uint64_t word = mix(seed ^ ((offset + i) / 8));
    if (std::memcmp(data.data() + i, &word, 8) != 0) break;
  }
  for (; i < data.size(); ++i) {
    if (data[i] != std::byte{pattern_byte(seed, offset + i)}) return static_cast<std::int64_t>(i);
  }
  return -1;
}

void fill_page(const LayoutDesc& d, std::int64_t page, std::uint64_t key) {
  const auto unit = static_cast<std::size_t>(d.unit_bytes);
  for (std::int32_t layer = 0; layer < d.num_layers; ++layer) {
    for (std::int32_t kv = 0; kv < d.num_kv; ++kv) {
      for (std::int32_t t = 0; t < d.page_size; ++t) {
        const std::int64_t slot = page * d.page_size + t;
        std::span<std::byte> out(reinterpret_cast<std::byte*>(d.base + unit_offset(d, layer, kv, slot)),
                                 unit);
        fill_pattern(out, key, layer, kv, static_cast<std::uint64_t>(t) * unit);
      }
    }
  }
}

bool verify_page(const LayoutDesc& d, std::int64_t page, std::uint64_t key, std::string* where) {
  const auto unit = static_cast<std::size_t>(d.unit_bytes);
  for (std::int32_t layer = 0; layer < d.num_layers; ++layer) {
    for (std::int32_t kv = 0; kv < d.num_kv; ++kv) {
      for (std::int32_t t = 0; t < d.page_size; ++t) {
        const std::int64_t slot = page * d.page_size + t;
        std::span<const std::byte> data(
            reinterpret_cast<const std::byte*>(d.base + unit_offset(d, layer, kv, slot)), unit);
        const std::int64_t bad =
            find_pattern_mismatch(data, key, layer, kv, static_cast<std::uint64_t>(t) * unit);
        if (bad >= 0) {
          if (where != nullptr) {
            *where = str_cat("page ", page, " layer ", layer, " kv ", kv, " token ", t, " byte ",
                             bad);
          }
          return false;
        }
      }
    }
  }
  return true;
}

}  // namespace hicache
