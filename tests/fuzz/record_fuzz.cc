// libFuzzer target: the storage record format (storage/record.h).
//   1. Arbitrary bytes read back as a record for a key must be accepted or refused with a
//      reason, never crash or read out of bounds.
//   2. A record encoded from the input's key and payload must check clean, and the same record
//      with one input-chosen bit flipped must be refused (a corrupt record is never data).
#include <cstddef>
#include <cstdint>
#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "storage/record.h"
#include "transfer/errors.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace hicache;
  if (size < 2) return 0;
  const std::size_t key_len = 1 + data[0] % 64;
  const std::uint8_t flip = data[1];
  data += 2;
  size -= 2;
  const std::string key(reinterpret_cast<const char*>(data), std::min(key_len, size));
  const auto* bytes = reinterpret_cast<const std::byte*>(data);

  // 1. The input itself as a stored record of `key`, with the payload length it implies.
  const std::size_t head_bytes = record_head_bytes(key);
  if (size >= head_bytes) {
    std::uint64_t checksum = 0;
    const std::span<const std::byte> head(bytes, head_bytes);
    const std::span<const std::byte> payload(bytes + head_bytes, size - head_bytes);
    if (check_record_head(head, key, payload.size(), &checksum).empty()) {
      (void)check_record_payload(payload, checksum);
    }
  }

  // 2. Encode, check, flip one bit of the header, key or payload, check again.
  const std::span<const std::byte> payload(bytes + key.size(), size - key.size());
  std::vector<std::byte> record(head_bytes + payload.size());
  if (key.empty()) {  // not a valid key: refused with a clear error, nothing written
    try {
      encode_record_head(key, payload, std::span(record).first(head_bytes));
    } catch (const InvalidArgument&) {
      return 0;
    }
    std::abort();
  }
  encode_record_head(key, payload, std::span(record).first(head_bytes));
  std::copy(payload.begin(), payload.end(), record.begin() + static_cast<std::ptrdiff_t>(head_bytes));
  std::uint64_t checksum = 0;
  if (!check_record_head(std::span(record).first(head_bytes), key, payload.size(), &checksum)
           .empty() ||
      !check_record_payload(std::span(record).subspan(head_bytes), checksum).empty()) {
    std::abort();  // a record we wrote does not read back
  }
  const std::size_t bit = (static_cast<std::size_t>(flip) * 7919u) % (record.size() * 8);
  record[bit / 8] ^= std::byte{static_cast<std::uint8_t>(1u << (bit % 8))};
  const bool head_ok =
      check_record_head(std::span(record).first(head_bytes), key, payload.size(), &checksum)
          .empty();
  if (head_ok && check_record_payload(std::span(record).subspan(head_bytes), checksum).empty()) {
    std::abort();  // a flipped bit went unnoticed
  }
  return 0;
}
