#include "transfer/host_memory.h"

#include <gtest/gtest.h>

#include "transfer/errors.h"

namespace hicache {
namespace {

TEST(HostMemory, MapsZeroedMemoryRoundedToHugePages) {
  Buffer b = map_host_memory(3 << 20);
  EXPECT_EQ(b.size(), std::size_t{4} << 20);
  for (std::size_t i = 0; i < b.size(); i += 4093) ASSERT_EQ(b.data()[i], std::byte{0});
  b.data()[b.size() - 1] = std::byte{1};  // writable to the last byte
  EXPECT_NE(describe_host_memory(b).find("4 MiB mapped"), std::string::npos)
      << describe_host_memory(b);
}

TEST(HostMemory, ZeroBytesIsAnError) {
  EXPECT_THROW(map_host_memory(0), InvalidArgument);
}

TEST(HostMemory, BufferMovesOwnershipAndReleasesOnce) {
  int released = 0;
  {
    Buffer a(reinterpret_cast<void*>(0x1000), 16, [&](void*, std::size_t) { ++released; });
    Buffer b(std::move(a));
    EXPECT_FALSE(a);
    Buffer c;
    c = std::move(b);
    EXPECT_EQ(c.size(), 16u);
  }
  EXPECT_EQ(released, 1);
}

}  // namespace
}  // namespace hicache

namespace hicache {
namespace {

// Every slice of a mapping pre-faulted on several threads is resident, including an uneven last
// slice, and reads back zero.
TEST(HostMemory, ParallelFirstTouchLeavesEveryPageResident) {
  for (int threads : {1, 3, 7}) {
    Buffer b = map_host_memory((std::size_t{50} << 20) + 12345,
                               HostMemoryOptions{.prefault_threads = threads});
    const std::string d = describe_host_memory(b);
    const std::string mapped = std::to_string(b.size() >> 20) + " MiB mapped, ";
    EXPECT_NE(d.find(mapped + std::to_string(b.size() >> 20) + " MiB resident"), std::string::npos)
        << threads << " threads: " << d;
    for (std::size_t off = 0; off < b.size(); off += 4096) {
      ASSERT_EQ(b.data()[off], std::byte{0}) << off;
    }
  }
}

}  // namespace
}  // namespace hicache
