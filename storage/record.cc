#include "storage/record.h"

#include <xxhash.h>
#if defined(__x86_64__)
// libxxhash's runtime dispatch: XXH3 on the widest vector unit the CPU has (AVX2 / AVX-512),
// the same hash values as the portable build.
#include <xxh_x86dispatch.h>
#endif

#include <bit>
#include <cstring>

#include "transfer/errors.h"

namespace hicache {
namespace {

static_assert(std::endian::native == std::endian::little, "records are little-endian");
constexpr std::uint32_t kMagic = 0x564B4348;  // "HCKV" in memory order

template <typename T>
void put(std::span<std::byte> out, std::size_t at, T value) {
  std::memcpy(out.data() + at, &value, sizeof value);
}
template <typename T>
T get(std::span<const std::byte> in, std::size_t at) {
  T value;
  std::memcpy(&value, in.data() + at, sizeof value);
  return value;
}

std::uint64_t head_checksum(std::span<const std::byte> head24, std::string_view key) {
  return XXH3_64bits_withSeed(key.data(), key.size(), XXH3_64bits(head24.data(), 24));
}

}  // namespace

std::uint64_t payload_checksum(std::span<const std::byte> payload) {
  return XXH3_64bits(payload.data(), payload.size());
}

void encode_record_head(std::string_view key, std::uint64_t payload_bytes, std::uint64_t checksum,
                        std::span<std::byte> head) {
  if (key.empty() || key.size() > 0xFFFF) {
    throw InvalidArgument(str_cat("record head: key of ", key.size(),
                                  " bytes, must be 1 to 65535 bytes"));
  }
  if (head.size() != record_head_bytes(key)) {
    throw InvalidArgument(str_cat("record head for key '", key, "': buffer of ", head.size(),
                                  " bytes, want ", record_head_bytes(key)));
  }
  put<std::uint32_t>(head, 0, kMagic);
  put<std::uint16_t>(head, 4, kRecordVersion);
  put<std::uint16_t>(head, 6, static_cast<std::uint16_t>(key.size()));
  put<std::uint64_t>(head, 8, payload_bytes);
  put<std::uint64_t>(head, 16, checksum);
  put<std::uint64_t>(head, 24, head_checksum(head.first(24), key));
  std::memcpy(head.data() + kRecordHeaderBytes, key.data(), key.size());
  std::memset(head.data() + kRecordHeaderBytes + key.size(), 0,
              head.size() - kRecordHeaderBytes - key.size());
}

void encode_record_head(std::string_view key, std::span<const std::byte> payload,
                        std::span<std::byte> head) {
  encode_record_head(key, payload.size(), payload_checksum(payload), head);
}

std::string check_record_head(std::span<const std::byte> head, std::string_view key,
                              std::uint64_t payload_bytes, std::uint64_t* checksum) {
  if (head.size() < kRecordHeaderBytes) {
    return str_cat("truncated header: ", head.size(), " of ", kRecordHeaderBytes, " bytes");
  }
  if (get<std::uint32_t>(head, 0) != kMagic) return "bad magic (not a hicache record)";
  if (const auto v = get<std::uint16_t>(head, 4); v != kRecordVersion) {
    return str_cat("format version ", v, ", this build reads ", kRecordVersion);
  }
  const auto key_bytes = get<std::uint16_t>(head, 6);
  if (key_bytes != key.size() || head.size() != record_head_bytes_for(key_bytes)) {
    return str_cat("key length ", key_bytes, ", expected ", key.size());
  }
  const std::string_view stored_key(reinterpret_cast<const char*>(head.data()) + kRecordHeaderBytes,
                                    key_bytes);
  if (get<std::uint64_t>(head, 24) != head_checksum(head.first(24), stored_key)) {
    return "header checksum mismatch";
  }
  if (stored_key != key) return str_cat("record holds key '", stored_key, "'");
  for (std::size_t i = kRecordHeaderBytes + key_bytes; i < head.size(); ++i) {
    if (head[i] != std::byte{0}) return str_cat("nonzero padding at byte ", i);
  }
  if (const auto n = get<std::uint64_t>(head, 8); n != payload_bytes) {
    return str_cat("payload of ", n, " bytes, expected ", payload_bytes);
  }
  *checksum = get<std::uint64_t>(head, 16);
  return {};
}

std::string check_record_payload(std::span<const std::byte> payload, std::uint64_t checksum) {
  if (payload_checksum(payload) != checksum) return "payload checksum mismatch";
  return {};
}

}  // namespace hicache
