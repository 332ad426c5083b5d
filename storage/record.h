// The stored record format, shared by every backend: a 32-byte header, the key, zero padding to
// a multiple of 64 bytes, the payload.
//
//   offset  size  field
//        0     4  magic "HCKV"
//        4     2  format version (2)
//        6     2  key length K
//        8     8  payload length
//       16     8  XXH3-64 of the payload
//       24     8  XXH3-64 of the key, seeded with XXH3-64 of bytes 0..23
//       32     K  key
//     32+K     .  zero bytes up to H = 32+K rounded up to a multiple of 64
//        H     .  payload
//
// The padding puts the payload at the same alignment as the caller's page (a page-aligned host
// pool): the kernel's copies between a file's page cache and user memory run at about 1.6x the
// speed when source and destination agree on alignment (docs/performance.md).
// Integers are little-endian. A reader checks the head (magic, version, head checksum, key,
// payload length) before it trusts any field, and the payload checksum after reading it; any
// mismatch makes the record a miss that is removed, never data.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace hicache {

inline constexpr std::size_t kRecordHeaderBytes = 32;
inline constexpr std::size_t kPayloadAlignment = 64;
inline constexpr std::uint16_t kRecordVersion = 2;

// Bytes before the payload for a key of `key_bytes`: header, key and padding.
constexpr std::size_t record_head_bytes_for(std::size_t key_bytes) {
  return (kRecordHeaderBytes + key_bytes + kPayloadAlignment - 1) / kPayloadAlignment *
         kPayloadAlignment;
}
inline std::size_t record_head_bytes(std::string_view key) { return record_head_bytes_for(key.size()); }

std::uint64_t payload_checksum(std::span<const std::byte> payload);

// Writes header, key and padding for `payload` into `head` (exactly record_head_bytes(key)
// bytes).
void encode_record_head(std::string_view key, std::span<const std::byte> payload,
                        std::span<std::byte> head);
// Same, with a checksum the caller computed already.
void encode_record_head(std::string_view key, std::uint64_t payload_bytes, std::uint64_t checksum,
                        std::span<std::byte> head);

// Checks a head read back for `key` and an expected payload length. Returns an empty string when
// it is valid (and the stored payload checksum in *checksum), else the reason.
std::string check_record_head(std::span<const std::byte> head, std::string_view key,
                              std::uint64_t payload_bytes, std::uint64_t* checksum);

// Empty when the payload's checksum matches, else the reason.
std::string check_record_payload(std::span<const std::byte> payload, std::uint64_t checksum);

}  // namespace hicache
