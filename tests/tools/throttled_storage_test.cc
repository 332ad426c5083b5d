#include "tools/workload/throttled_storage.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <thread>
#include <vector>

#include "transfer/errors.h"

namespace hicache::workload {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

struct Root {
  fs::path path = fs::temp_directory_path() / str_cat("hicache-throttle-", ::getpid(), "-", ++n);
  Root() { fs::remove_all(path); }
  ~Root() { fs::remove_all(path); }
  std::unique_ptr<StorageBackend> open() const {
    return make_storage(str_cat(R"({"backend": "file", "root": ")", path.string(), R"("})"));
  }
  static inline int n = 0;
};

std::vector<std::byte> page_bytes(std::size_t n, int seed) {
  std::vector<std::byte> b(n);
  for (std::size_t i = 0; i < n; ++i) b[i] = static_cast<std::byte>((i * 131 + seed) & 0xff);
  return b;
}

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// The bytes set through the throttle are the bytes read back through it, and what the counts,
// the gauges and the removal observer see is the real store's (name included).
TEST(ThrottledStorage, ForwardsEveryCallAndReportsTheRealStore) {
  Root root;
  ThrottledStorage store(root.open(), {.bytes_per_second = 1e9, .latency_s = 0});
  EXPECT_EQ(store.name(), "file");
  std::vector<std::string> removed;
  store.set_removal_observer([&removed](std::span<const std::string> keys) {
    removed.insert(removed.end(), keys.begin(), keys.end());
  });
  const std::vector<std::string> keys = {"a", "b", "c"};
  std::vector<std::vector<std::byte>> src;
  std::vector<ConstByteSpan> src_spans;
  for (int i = 0; i < 3; ++i) src.push_back(page_bytes(4096, i));
  for (const auto& s : src) src_spans.emplace_back(s);
  for (const IoResult& r : store.batch_set(keys, src_spans)) EXPECT_TRUE(r.is_ok()) << r.reason;
  EXPECT_EQ(store.batch_exists(keys), 3u);
  std::vector<std::vector<std::byte>> dst(3, std::vector<std::byte>(4096));
  std::vector<ByteSpan> dst_spans;
  for (auto& d : dst) dst_spans.emplace_back(d);
  for (const IoResult& r : store.batch_get(keys, dst_spans)) EXPECT_TRUE(r.is_ok()) << r.reason;
  EXPECT_EQ(dst, src);
  const StorageStats st = store.stats();
  EXPECT_EQ(st.set_written, 3u);
  EXPECT_EQ(st.get_hits, 3u);
  EXPECT_EQ(st.bytes_read, 3u * 4096);
  EXPECT_EQ(st.stored_keys, 3u);
  EXPECT_TRUE(store.remove("b"));
  EXPECT_EQ(removed, std::vector<std::string>{"b"});
  EXPECT_EQ(store.stats().stored_keys, 2u);
  store.set_removal_observer({});
  EXPECT_TRUE(store.remove("a"));
  EXPECT_EQ(removed, std::vector<std::string>{"b"});  // no observer any more
}

// Every call takes at least the latency; the link's bandwidth is shared: two threads each
// sending 1 MiB at 20 MB/s take at least the time of 2 MiB, not of 1.
TEST(ThrottledStorage, EachCallWaitsItsLatencyAndThreadsShareTheLink) {
  Root root;
  ThrottledStorage slow(root.open(), {.bytes_per_second = 0, .latency_s = 0.03});
  const std::vector<std::string> key = {"k"};
  Clock::time_point t = Clock::now();
  EXPECT_EQ(slow.batch_exists(key), 0u);
  EXPECT_GE(seconds_since(t), 0.03);
  // exists_each is one call to the store: one latency for five keys, not five (>= 0.15 s).
  const double before = slow.waited_seconds();
  t = Clock::now();
  EXPECT_EQ(slow.exists_each(std::vector<std::string>{"k", "l", "m", "n", "o"}),
            std::vector<bool>(5, false));
  EXPECT_GE(seconds_since(t), 0.03);
  EXPECT_LT(slow.waited_seconds() - before, 0.12);

  Root other;
  ThrottledStorage link(other.open(), {.bytes_per_second = 20e6, .latency_s = 0});
  const std::size_t mib = std::size_t{1} << 20;
  const auto a = page_bytes(mib, 1), b = page_bytes(mib, 2);
  t = Clock::now();
  std::thread second([&] {
    const ConstByteSpan s[] = {ConstByteSpan(b)};
    const std::string k[] = {"b"};
    EXPECT_TRUE(link.batch_set(k, s)[0].is_ok());
  });
  const ConstByteSpan s[] = {ConstByteSpan(a)};
  const std::string k[] = {"a"};
  EXPECT_TRUE(link.batch_set(k, s)[0].is_ok());
  second.join();
  EXPECT_GE(seconds_since(t), 2.0 * static_cast<double>(mib) / 20e6);
  EXPECT_GE(link.waited_seconds(), 2.0 * static_cast<double>(mib) / 20e6);
  EXPECT_EQ(link.stats().set_written, 2u);
}

TEST(ThrottledStorage, ABadRateOrLatencyOrNoStoreIsRefused) {
  Root root;
  auto error_of = [&](L3Throttle t, bool with_store = true) -> std::string {
    try {
      ThrottledStorage s(with_store ? root.open() : nullptr, t);
    } catch (const InvalidArgument& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(error_of({.bytes_per_second = -5}).find("bandwidth -5"), std::string::npos);
  EXPECT_NE(error_of({.latency_s = std::nan("")}).find("latency nan"), std::string::npos);
  EXPECT_NE(error_of({.latency_s = -1}).find("latency -1"), std::string::npos);
  EXPECT_NE(error_of({}, false).find("null"), std::string::npos);
  EXPECT_EQ(error_of({.bytes_per_second = 1e6, .latency_s = 0.001}), "");
  EXPECT_EQ((L3Throttle{.bytes_per_second = 50e6, .latency_s = 0.02}).describe(),
            "50 MB/s, 20 ms per call");
  EXPECT_EQ(L3Throttle{}.describe(), "off");
}

}  // namespace
}  // namespace hicache::workload
