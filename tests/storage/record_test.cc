#include "storage/record.h"

#include <gtest/gtest.h>

#include <vector>

#include "transfer/errors.h"

namespace hicache {
namespace {

std::vector<std::byte> payload_for(std::string_view key, std::size_t n) {
  std::vector<std::byte> out(n);
  std::uint64_t x = std::hash<std::string_view>{}(key) | 1;
  for (auto& b : out) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    b = static_cast<std::byte>(x);
  }
  return out;
}

struct Encoded {
  std::vector<std::byte> head;
  std::vector<std::byte> payload;
};

Encoded encode(std::string_view key, std::size_t n) {
  Encoded e{std::vector<std::byte>(record_head_bytes(key)), payload_for(key, n)};
  encode_record_head(key, e.payload, e.head);
  return e;
}

TEST(Record, ValidHeadAndPayloadCheck) {
  const Encoded e = encode("k1", 4096);
  std::uint64_t checksum = 0;
  EXPECT_EQ(check_record_head(e.head, "k1", 4096, &checksum), "");
  EXPECT_EQ(checksum, payload_checksum(e.payload));
  EXPECT_EQ(check_record_payload(e.payload, checksum), "");
}

TEST(Record, EveryMismatchIsNamed) {
  const Encoded e = encode("k1", 4096);
  std::uint64_t checksum = 0;
  EXPECT_NE(check_record_head(e.head, "k22", 4096, &checksum).find("key length"), std::string::npos);
  EXPECT_NE(check_record_head(e.head, "k9", 4096, &checksum).find("holds key 'k1'"),
            std::string::npos);
  EXPECT_NE(check_record_head(e.head, "k1", 4095, &checksum).find("payload of 4096"),
            std::string::npos);
  EXPECT_NE(check_record_head(std::span(e.head).first(10), "k1", 4096, &checksum)
                .find("truncated"),
            std::string::npos);
  auto flipped = e.head;
  flipped[0] ^= std::byte{1};
  EXPECT_NE(check_record_head(flipped, "k1", 4096, &checksum).find("magic"), std::string::npos);
  flipped = e.head;
  flipped[4] = std::byte{9};
  EXPECT_NE(check_record_head(flipped, "k1", 4096, &checksum).find("version 9"),
            std::string::npos);
  flipped = e.head;
  flipped[9] ^= std::byte{1};  // payload length field, header checksum now wrong
  EXPECT_NE(check_record_head(flipped, "k1", 4096, &checksum).find("header checksum"),
            std::string::npos);
  ASSERT_EQ(check_record_head(e.head, "k1", 4096, &checksum), "");
  auto bad_payload = e.payload;
  bad_payload[4000] ^= std::byte{0x80};
  EXPECT_NE(check_record_payload(bad_payload, checksum), "");
}

// The payload starts at a multiple of 64 bytes whatever the key's length (the padding is zero),
// and a head whose padding is not zero is refused.
TEST(Record, ThePayloadIsAlignedAndThePaddingIsChecked) {
  for (std::size_t k = 1; k <= 240; ++k) {
    const std::string key(k, 'a');
    const std::size_t head = record_head_bytes(key);
    EXPECT_EQ(head % kPayloadAlignment, 0u) << k;
    EXPECT_GE(head, kRecordHeaderBytes + k);
    EXPECT_LT(head, kRecordHeaderBytes + k + kPayloadAlignment);
  }
  Encoded e = encode("pad", 64);
  ASSERT_EQ(e.head.size(), 64u);
  std::uint64_t checksum = 0;
  ASSERT_EQ(check_record_head(e.head, "pad", 64, &checksum), "");
  e.head[63] = std::byte{1};
  EXPECT_NE(check_record_head(e.head, "pad", 64, &checksum).find("nonzero padding at byte 63"),
            std::string::npos);
  // A version-1 head (no padding) is not this format's: a miss, never data.
  Encoded old = encode("pad", 64);
  old.head[4] = std::byte{1};
  EXPECT_NE(check_record_head(old.head, "pad", 64, &checksum).find("format version 1"),
            std::string::npos);
}

TEST(Record, EncodeRejectsWrongBuffer) {
  std::vector<std::byte> head(10);
  const auto p = payload_for("k", 16);
  EXPECT_THROW(encode_record_head("k1", p, head), InvalidArgument);
  // Found by fuzzing: an empty key was refused with a message about the buffer size.
  std::vector<std::byte> exact(kRecordHeaderBytes);
  try {
    encode_record_head("", p, exact);
    FAIL() << "an empty key was encoded";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("key of 0 bytes"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace hicache
