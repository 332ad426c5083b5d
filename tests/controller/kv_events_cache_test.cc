// The cache's KV events followed by a subscriber over real sockets (ZeroMQ SUB for the live
// stream, DEALER for the replay): what it rebuilds per medium is what the tree holds on the
// device and the host, and what the file store holds on disk; a detach, a clear and a reset
// remove what they drop.
#include <gtest/gtest.h>
#include <msgpack.hpp>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <vector>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "controller/hicache.h"
#include "storage/file_storage.h"
#include "tests/controller/forwarding_store.h"
#include "transfer/errors.h"

namespace hicache {
namespace {

namespace fs = std::filesystem;

struct TempDir {
  fs::path path = fs::temp_directory_path() / str_cat("hicache-kvev-", ::getpid(), "-", ++count);
  TempDir() { fs::remove_all(path); }
  ~TempDir() { fs::remove_all(path); }
  static inline int count = 0;
};

// tcp://A:PORT -> tcp://127.0.0.1:PORT (the publisher may report the wildcard it bound).
std::string loopback(const std::string& endpoint) {
  return str_cat("tcp://127.0.0.1:", endpoint.substr(endpoint.rfind(':') + 1));
}

// A router's view: per medium, the blocks stored and not removed since.
struct View {
  std::map<std::string, std::set<std::int64_t>> held;
  std::map<std::string, std::int64_t> removed;
  std::int64_t unknown_removals = 0;
  std::uint64_t next_seq = 0;

  void apply(const std::string& payload) {
    msgpack::object_handle oh = msgpack::unpack(payload.data(), payload.size());
    const msgpack::object& batch = oh.get();
    ASSERT_EQ(batch.type, msgpack::type::ARRAY);
    ASSERT_EQ(batch.via.array.size, 3u);
    const msgpack::object& events = batch.via.array.ptr[1];
    for (std::uint32_t i = 0; i < events.via.array.size; ++i) {
      const msgpack::object& e = events.via.array.ptr[i];
      const auto tag = e.via.array.ptr[0].as<std::string>();
      if (tag == "BlockStored") {
        const auto hashes = e.via.array.ptr[1].as<std::vector<std::int64_t>>();
        const auto tokens = e.via.array.ptr[3].as<std::vector<std::int64_t>>();
        const auto block = e.via.array.ptr[4].as<std::int64_t>();
        EXPECT_EQ(static_cast<std::int64_t>(tokens.size()),
                  static_cast<std::int64_t>(hashes.size()) * block);
        held[e.via.array.ptr[6].as<std::string>()].insert(hashes.begin(), hashes.end());
      } else if (tag == "BlockRemoved") {
        const auto hashes = e.via.array.ptr[1].as<std::vector<std::int64_t>>();
        const auto medium = e.via.array.ptr[2].as<std::string>();
        for (std::int64_t h : hashes) unknown_removals += held[medium].erase(h) == 0 ? 1 : 0;
        removed[medium] += static_cast<std::int64_t>(hashes.size());
      } else {
        ADD_FAILURE() << "unexpected event " << tag;
      }
    }
  }
};

class Subscriber {
 public:
  explicit Subscriber(KvEventPublisher& p)
      : sub_(ctx_, zmq::socket_type::sub), replay_(ctx_, zmq::socket_type::dealer) {
    sub_.set(zmq::sockopt::subscribe, "kv");
    sub_.set(zmq::sockopt::rcvhwm, 0);
    sub_.connect(loopback(p.endpoint()));
    replay_.set(zmq::sockopt::linger, 0);
    replay_.connect(p.replay_endpoint());
  }

  // Takes what arrived live (in order, gaps filled from the replay), then what the replay has
  // past the last batch seen: the publisher was flushed, so that is everything.
  void catch_up(View& v) {
    std::vector<zmq::message_t> frames;
    while (zmq::recv_multipart(sub_, std::back_inserter(frames), zmq::recv_flags::dontwait)) {
      EXPECT_EQ(frames[0].to_string(), "kv");
      const std::uint64_t seq = be64(frames[1].to_string());
      if (seq > v.next_seq) replay(v, seq);
      if (seq == v.next_seq) {
        v.apply(frames[2].to_string());
        ++v.next_seq;
        ++live;
      }
      frames.clear();
    }
    replay(v, UINT64_MAX);
  }

  std::int64_t live = 0, replayed = 0;

 private:
  static std::uint64_t be64(const std::string& s) {
    std::uint64_t x = 0;
    for (unsigned char c : s) x = x << 8 | c;
    return x;
  }
  void replay(View& v, std::uint64_t upto) {
    std::string start(8, '\0');
    for (int i = 0; i < 8; ++i) start[i] = static_cast<char>(v.next_seq >> (56 - 8 * i));
    std::array<zmq::const_buffer, 2> request = {zmq::buffer(std::string_view()),
                                                zmq::buffer(start)};
    ASSERT_TRUE(zmq::send_multipart(replay_, request));
    while (true) {
      std::vector<zmq::message_t> frames;
      zmq::pollitem_t item{replay_.handle(), 0, ZMQ_POLLIN, 0};
      ASSERT_EQ(zmq::poll(&item, 1, std::chrono::milliseconds(10000)), 1) << "no replay answer";
      ASSERT_TRUE(zmq::recv_multipart(replay_, std::back_inserter(frames)));
      ASSERT_GE(frames.size(), 3u);
      if (frames[1].to_string() == std::string(8, '\xff')) return;
      const std::uint64_t seq = be64(frames[1].to_string());
      if (seq < v.next_seq || seq >= upto) continue;  // had it, or the live stream brings it
      EXPECT_EQ(seq, v.next_seq) << "a batch is missing from the replay";
      v.apply(frames[2].to_string());
      ++v.next_seq;
      ++replayed;
    }
  }

  zmq::context_t ctx_;
  zmq::socket_t sub_, replay_;
};

std::set<std::int64_t> as_set(const std::vector<std::int64_t>& v) { return {v.begin(), v.end()}; }

// The file store's records of this namespace, by block hash (the key names the page digest).
std::set<std::int64_t> disk_blocks(const fs::path& root, const std::string& prefix) {
  std::set<std::int64_t> out;
  for (const auto& f : fs::directory_iterator(root)) {
    const std::string name = f.path().filename().string();
    if (name.rfind(prefix + "-", 0) != 0 || name.size() != prefix.size() + 65) continue;
    const auto h = kv_block_hash_of_key(name);
    if (h) out.insert(*h);
  }
  return out;
}

TEST(KvEventsCache, ASubscriberRebuildsWhatTheCacheHoldsOnEveryTier) {
  TempDir l3;
  // Pages of 4 tokens x 2 layers x K/V x 8 dims x fp16: 256 bytes, a record ~ 300 bytes; the
  // store holds ~ 40 of them, fewer than the run backs up, so its LRU evicts.
  HiCache hc(HiCacheConfig::from_json_text(str_cat(
      R"({"device": "host", "page_size": 4, "device_tokens": 64, "host_ratio": 2,
          "model": {"attention": "mha", "layers": 2, "kv_heads": 1, "head_dim": 8},
          "model_name": "m", "model_fingerprint": "f",
          "storage": {"backend": "file", "capacity_bytes": 4000, "root": ")",
      l3.path.string(), R"("},
          "kv_events": {"endpoint": "tcp://*:0", "replay_endpoint": "tcp://127.0.0.1:0",
                        "topic": "kv"}})")));
  ASSERT_NE(hc.kv_events(), nullptr);
  Subscriber sub(*hc.kv_events());
  View view;
  HiRadixCache& cache = hc.cache();
  const auto settle = [&] {
    for (int i = 0; i < 4000; ++i) {
      const std::uint64_t seen = cache.event_seq();
      cache.check_events();
      const RadixCacheStats s = cache.stats();
      if (s.writes_in_flight == 0 && s.loads_in_flight == 0 && s.backups_in_flight == 0) break;
      cache.wait_for_events(seen, std::chrono::steady_clock::now() + std::chrono::milliseconds(10));
    }
  };
  const auto check = [&](const char* when) {
    hc.kv_events()->flush();
    sub.catch_up(view);
    SCOPED_TRACE(when);
    EXPECT_EQ(view.held["GPU"], as_set(cache.held_block_hashes(true)));
    EXPECT_EQ(view.held["CPU_PINNED"], as_set(cache.held_block_hashes(false)));
    EXPECT_EQ(view.held["DISK"], hc.storage() ? disk_blocks(l3.path, hc.key_namespace().prefix())
                                              : std::set<std::int64_t>{});
    EXPECT_EQ(view.unknown_removals, 0);
    EXPECT_TRUE(view.held["EXTERNAL"].empty());
  };
  // Twelve sequences of 12 tokens (3 pages each) sharing their first page by pairs: the device
  // (16 pages) and the host (32) overflow, so every tier evicts.
  for (int r = 0; r < 12; ++r) {
    std::vector<std::int32_t> tokens(12);
    for (int i = 0; i < 12; ++i) tokens[i] = i < 4 ? 1000 * (r / 2) + i : 100000 * r + i;
    const auto m = cache.match_prefix(tokens);
    const auto cached = static_cast<std::int64_t>(m.device_slots.size());
    if (cache.evictable_device_tokens() + hc.device_pool().allocator().free_tokens() < 12) settle();
    if (hc.device_pool().allocator().free_tokens() < 12 - cached) {
      cache.evict_device(12 - cached - hc.device_pool().allocator().free_tokens());
      settle();
    }
    auto slots = hc.device_pool().allocator().alloc(12 - cached);
    ASSERT_TRUE(slots) << "round " << r;
    std::vector<std::int64_t> all = m.device_slots;
    all.insert(all.end(), slots->begin(), slots->end());
    const std::int64_t had = cache.insert(tokens, all);
    hc.device_pool().allocator().free(std::span(all).first(static_cast<std::size_t>(had))
                                          .subspan(static_cast<std::size_t>(cached)));
    settle();
    if (r % 3 == 2) cache.evict_host(8);
    if (r == 6) check("half way");
  }
  settle();
  check("after the run");
  EXPECT_GT(view.removed["GPU"], 0);
  EXPECT_GT(view.removed["CPU_PINNED"], 0);
  EXPECT_GT(view.removed["DISK"], 0) << "the store's LRU evicted nothing";
  EXPECT_FALSE(view.held["GPU"].empty());
  EXPECT_FALSE(view.held["CPU_PINNED"].empty());
  EXPECT_FALSE(view.held["DISK"].empty());
  EXPECT_GT(sub.live + sub.replayed, 0);

  // L3 detached: every block announced there is removed.
  hc.detach_storage();
  check("after detach");
  EXPECT_TRUE(view.held["DISK"].empty());
  // Attached again, the store still holds those records, but this cache announced none of
  // them: a subscriber's L3 set is what the cache stored since. Cleared: nothing there.
  hc.attach_storage();
  hc.clear_storage();
  check("after attach and clear");
  // A reset drops the tree: nothing on the device or the host any more.
  cache.reset();
  check("after reset");
  EXPECT_TRUE(view.held["GPU"].empty());
  EXPECT_TRUE(view.held["CPU_PINNED"].empty());
}

// A file store whose every batch stores its first page only: the rest fail.
class FirstPageOnly final : public hicache::testing::FileForwarding {
 public:
  using FileForwarding::FileForwarding;
  std::string_view name() const override { return "first-page-only"; }

 protected:
  std::vector<IoResult> do_batch_set(std::span<const std::string> keys,
                                     std::span<const ConstByteSpan> src) override {
    std::vector<IoResult> out = inner_.batch_set(keys.first(1), src.first(1));
    out.resize(keys.size(), IoResult::error("injected failure"));
    return out;
  }
};

// The illegal twin of an L3 announcement: a backup that failed is never announced. Each backup
// stores its first page only; the subscriber's L3 blocks are exactly the records on disk (one per
// backed-up node), never the pages whose writes failed. The store is not a file store by name:
// its records are EXTERNAL.
TEST(KvEventsCache, AFailedBackupIsNeverAnnouncedInL3) {
  TempDir l3;
  auto store = std::make_shared<FirstPageOnly>(l3.path.string());
  HiCacheParts parts;
  parts.storage = store;
  HiCache hc(HiCacheConfig::from_json_text(
                 R"({"device": "host", "page_size": 4, "device_tokens": 64, "host_ratio": 2,
          "model": {"attention": "mha", "layers": 2, "kv_heads": 1, "head_dim": 8},
          "kv_events": {"endpoint": "tcp://*:0", "replay_endpoint": "tcp://127.0.0.1:0",
                        "topic": "kv"}})"),
             std::move(parts));
  Subscriber sub(*hc.kv_events());
  View view;
  HiRadixCache& cache = hc.cache();
  for (int r = 0; r < 3; ++r) {
    std::vector<std::int32_t> tokens(12);
    for (int i = 0; i < 12; ++i) tokens[i] = 100000 * r + i;
    auto slots = hc.device_pool().allocator().alloc(12);
    ASSERT_TRUE(slots);
    ASSERT_EQ(cache.insert(tokens, *slots), 0);
  }
  for (int i = 0; i < 4000 && cache.stats().backups_in_flight + cache.stats().writes_in_flight +
                                      (i == 0 ? 1 : 0) > 0; ++i) {
    const std::uint64_t seen = cache.event_seq();
    cache.check_events();
    cache.wait_for_events(seen, std::chrono::steady_clock::now() + std::chrono::milliseconds(10));
  }
  hc.kv_events()->flush();
  sub.catch_up(view);
  const std::set<std::int64_t> disk = disk_blocks(l3.path, hc.key_namespace().prefix());
  EXPECT_EQ(disk.size(), 3u);  // one page of each of the three nodes
  EXPECT_EQ(view.held["EXTERNAL"], disk);
  EXPECT_TRUE(view.held["DISK"].empty());
  EXPECT_EQ(view.held["CPU_PINNED"].size(), 9u);  // the host holds all nine pages
}

// The one rank that publishes: with two TP ranks and kv_events.publish_rank 1, rank 1 has a
// publisher and rank 0 none (it binds nothing); without the endpoint no rank has one.
TEST(KvEventsCache, OnlyThePublishingRankPublishes) {
  const auto config = [](int rank, bool events) {
    return HiCacheConfig::from_json_text(str_cat(
        R"({"device": "host", "page_size": 4, "device_tokens": 64, "tp_size": 2, "tp_rank": )",
        rank, R"(, "model": {"attention": "mha", "layers": 2, "kv_heads": 1, "head_dim": 8})",
        events ? R"(, "kv_events": {"endpoint": "tcp://*:0", "publish_rank": 1}})" : "}"));
  };
  std::vector<std::unique_ptr<Collective>> groups[3];
  for (auto& g : groups) g = InProcessGroup::make_ranks(2);
  const auto parts = [&](int rank) {
    HiCacheParts p;
    p.collectives = {groups[0][rank].get(), groups[1][rank].get(), groups[2][rank].get()};
    return p;
  };
  {
    HiCache r0(config(0, true), parts(0));
    HiCache r1(config(1, true), parts(1));
    EXPECT_EQ(r0.kv_events(), nullptr);
    ASSERT_NE(r1.kv_events(), nullptr);
    EXPECT_NE(r1.kv_events()->endpoint().find("tcp://"), std::string::npos);
  }
  HiCache off(config(1, false), parts(1));
  EXPECT_EQ(off.kv_events(), nullptr);
  EXPECT_TRUE(off.cache().held_block_hashes(true).empty());
}

}  // namespace
}  // namespace hicache
