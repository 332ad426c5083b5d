#include "controller/kv_events.h"

#include <gtest/gtest.h>

#include <chrono>
#include <limits>
#include <map>
#include <msgpack.hpp>
#include <set>
#include <sstream>
#include <stdexcept>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "controller/error_of.h"
#include "transfer/errors.h"

namespace hicache {
namespace {

using Frames = std::vector<std::string>;
constexpr std::uint64_t kEnd = ~std::uint64_t{0};

std::string be64(std::uint64_t v) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(v >> (56 - 8 * i));
  return out;
}
std::uint64_t seq_of(const std::string& bytes) {
  if (bytes.size() != 8) throw std::runtime_error("a sequence of " + std::to_string(bytes.size()));
  std::uint64_t v = 0;
  for (unsigned char c : bytes) v = (v << 8) | c;
  return v;
}

// A batch as a subscriber decodes it: the timestamp, and the events and attn_dp_rank as
// msgpack-cxx prints them (JSON-like: nil is null, strings quoted, maps in wire order).
struct Decoded {
  double ts = 0;
  std::string events, rank;
};
std::string text(const msgpack::object& o) {
  std::ostringstream out;
  out << o;
  return out.str();
}
Decoded decode(const std::string& payload) {
  const msgpack::object_handle handle = msgpack::unpack(payload.data(), payload.size());
  const msgpack::object& batch = handle.get();
  if (batch.type != msgpack::type::ARRAY || batch.via.array.size != 3 ||
      batch.via.array.ptr[0].type != msgpack::type::FLOAT64 ||
      batch.via.array.ptr[1].type != msgpack::type::ARRAY) {
    throw std::runtime_error("not an EventBatch: " + text(batch));
  }
  return {batch.via.array.ptr[0].via.f64, text(batch.via.array.ptr[1]),
          text(batch.via.array.ptr[2])};
}

// A router's side: SUB for the stream, DEALER for replays, both over loopback tcp.
struct Subscriber {
  explicit Subscriber(const KvEventPublisher& p, const std::string& prefix = "",
                      int rcvhwm = 1000) {
    sub.set(zmq::sockopt::rcvhwm, rcvhwm);
    sub.set(zmq::sockopt::subscribe, prefix);
    sub.set(zmq::sockopt::rcvtimeo, 10000);
    sub.connect(p.endpoint());
    dealer.set(zmq::sockopt::rcvtimeo, 10000);
    if (!p.replay_endpoint().empty()) dealer.connect(p.replay_endpoint());
  }
  static Frames receive(zmq::socket_t& socket) {
    std::vector<zmq::message_t> parts;
    if (!zmq::recv_multipart(socket, std::back_inserter(parts)))
      throw std::runtime_error("timeout");
    Frames out;
    for (const auto& m : parts) out.push_back(m.to_string());
    return out;
  }
  // The next message of the stream with a sequence >= from: [topic, seq, payload].
  Frames next(std::uint64_t from) {
    for (;;) {
      Frames m = receive(sub);
      if (m.size() != 3) throw std::runtime_error("a message of " + std::to_string(m.size()));
      if (seq_of(m[1]) >= from) return m;
    }
  }
  Frames ask(const Frames& request) {
    for (std::size_t i = 0; i < request.size(); ++i) {
      const auto more = i + 1 < request.size() ? zmq::send_flags::sndmore : zmq::send_flags::none;
      if (!dealer.send(zmq::buffer(request[i]), more)) throw std::runtime_error("send");
    }
    return receive(dealer);
  }
  // A replay from `start`: (seq, payload) per batch; checks the end marker.
  std::vector<std::pair<std::uint64_t, std::string>> replay(std::uint64_t start) {
    std::vector<std::pair<std::uint64_t, std::string>> out;
    for (Frames reply = ask({"", be64(start)});; reply = receive(dealer)) {
      if (reply.size() != 3 || !reply[0].empty()) throw std::runtime_error("a bad replay reply");
      if (seq_of(reply[1]) == kEnd) {
        EXPECT_EQ(reply[2], "");
        return out;
      }
      out.emplace_back(seq_of(reply[1]), reply[2]);
    }
  }
  // Publishes AllBlocksCleared probes until one arrives (a SUB misses what is sent before its
  // subscription reaches the publisher); returns how many went out, the number a test's own
  // first batch gets.
  std::uint64_t sync(KvEventPublisher& p) {
    sub.set(zmq::sockopt::rcvtimeo, 20);
    for (std::uint64_t probes = 1; probes <= 500; ++probes) {
      p.publish({KvAllBlocksCleared{}});
      std::vector<zmq::message_t> parts;
      if (zmq::recv_multipart(sub, std::back_inserter(parts))) {
        sub.set(zmq::sockopt::rcvtimeo, 10000);
        return probes;
      }
    }
    throw std::runtime_error("no probe arrived");
  }

  zmq::context_t ctx;
  zmq::socket_t sub{ctx, zmq::socket_type::sub}, dealer{ctx, zmq::socket_type::dealer};
};

KvEventsConfig config_with_replay() {
  KvEventsConfig c;
  c.endpoint = "tcp://*:0";
  c.replay_endpoint = "tcp://127.0.0.1:0";
  c.topic = "kv";
  return c;
}

std::vector<KvEvent> stored(std::int64_t hash, KvMedium medium = KvMedium::kGpu) {
  return {KvBlockStored{{hash}, std::nullopt, {1, 2}, 2, "", medium}};
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

struct Encoding {
  bool map, vllm;
};
class KvEventWire : public ::testing::TestWithParam<Encoding> {};

TEST_P(KvEventWire, EveryFieldOfEveryEventTypeReachesASubscriber) {
  const auto [map, vllm] = GetParam();
  KvEventsConfig c = config_with_replay();
  c.map_encoding = map;
  c.vllm_dialect = vllm;
  if (vllm) c.attn_dp_rank = 3;
  KvEventPublisher p(c);
  Subscriber s(p);
  const std::uint64_t first = s.sync(p);
  const double before = now_s();
  constexpr std::int64_t kMin = std::numeric_limits<std::int64_t>::min();
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  p.publish({KvBlockStored{{kMin, -7}, 42, {1, 2, 70000, 4}, 2, "tenant-a", KvMedium::kCpuPinned},
             KvBlockStored{{kMax}, std::nullopt, {5}, 1, "", KvMedium::kDisk},
             KvBlockRemoved{{-1, 9}, KvMedium::kExternal}, KvAllBlocksCleared{}});
  p.publish({KvBlockRemoved{{0}, KvMedium::kGpu}});
  const Frames m = s.next(first);
  const double after = now_s();
  EXPECT_EQ(m[0], "kv");
  EXPECT_EQ(seq_of(m[1]), first);
  const Decoded d = decode(m[2]);
  EXPECT_GE(d.ts, before);
  EXPECT_LE(d.ts, after);
  EXPECT_EQ(d.rank, vllm ? "3" : "null");
  const std::string cpu = vllm ? "\"CPU\"" : "\"CPU_PINNED\"";
  std::string want;
  if (!map) {
    const std::string lora_name = vllm ? ",null" : "";
    want = "[[\"BlockStored\",[-9223372036854775808,-7],42,[1,2,70000,4],2,null," + cpu +
           lora_name +
           ",{\"cache_salt\":\"tenant-a\"}],[\"BlockStored\",[9223372036854775807],"
           "null,[5],1,null,\"DISK\"" +
           lora_name +
           "],[\"BlockRemoved\",[-1,9],\"EXTERNAL\"],"
           "[\"AllBlocksCleared\"]]";
  } else {
    const std::string lora_name = vllm ? ",\"lora_name\":null" : "";
    want =
        "[{\"type\":\"BlockStored\",\"block_hashes\":[-9223372036854775808,-7],"
        "\"parent_block_hash\":42,\"token_ids\":[1,2,70000,4],\"block_size\":2,"
        "\"lora_id\":null,\"medium\":" +
        cpu + lora_name +
        ",\"metadata\":{\"cache_salt\":\"tenant-a\"}},{\"type\":\"BlockStored\","
        "\"block_hashes\":[9223372036854775807],\"parent_block_hash\":null,\"token_ids\":[5],"
        "\"block_size\":1,\"lora_id\":null,\"medium\":\"DISK\"" +
        lora_name +
        "},"
        "{\"type\":\"BlockRemoved\",\"block_hashes\":[-1,9],\"medium\":\"EXTERNAL\"},"
        "{\"type\":\"AllBlocksCleared\"}]";
  }
  EXPECT_EQ(d.events, want);
  const Frames second = s.next(first + 1);
  EXPECT_EQ(seq_of(second[1]), first + 1);
  EXPECT_EQ(decode(second[2]).events,
            map ? "[{\"type\":\"BlockRemoved\",\"block_hashes\":[0],\"medium\":\"GPU\"}]"
                : "[[\"BlockRemoved\",[0],\"GPU\"]]");
  // The replay holds the same bytes.
  p.flush();
  const auto replayed = s.replay(first);
  ASSERT_EQ(replayed.size(), 2u);
  EXPECT_EQ(replayed[0], std::make_pair(first, m[2]));
  EXPECT_EQ(replayed[1], std::make_pair(first + 1, second[2]));
}

INSTANTIATE_TEST_SUITE_P(Encodings, KvEventWire,
                         ::testing::Values(Encoding{false, false}, Encoding{false, true},
                                           Encoding{true, false}, Encoding{true, true}),
                         [](const ::testing::TestParamInfo<Encoding>& encoding) {
                           return std::string(encoding.param.map ? "Map" : "Array") +
                                  (encoding.param.vllm ? "Vllm" : "Sglang");
                         });

TEST(KvEventPublisher, SequenceNumbersStartAtZeroAndGrowByOne) {
  KvEventPublisher p(config_with_replay());
  for (int i = 0; i < 5; ++i) p.publish(stored(100 + i));
  p.flush();
  Subscriber s(p);
  const auto all = s.replay(0);
  ASSERT_EQ(all.size(), 5u);
  for (std::uint64_t i = 0; i < 5; ++i) {
    EXPECT_EQ(all[i].first, i);
    EXPECT_EQ(decode(all[i].second).events,
              "[[\"BlockStored\",[" + std::to_string(100 + i) + "],null,[1,2],2,null,\"GPU\"]]");
  }
  EXPECT_EQ(p.published_batches(), 5u);
}

TEST(KvEventPublisher, TopicFramesAreTheTopicAndSubscribersFilterOnThem) {
  KvEventsConfig c = config_with_replay();
  c.topic = "kv-a";
  KvEventPublisher p(c);
  // Connected first, so its subscription is in place by the time the others' are.
  Subscriber other(p, "kv-b");
  Subscriber exact(p, "kv-a"), all(p);
  exact.sync(p);
  const std::uint64_t first = all.sync(p);
  p.publish(stored(7));
  EXPECT_EQ(exact.next(first)[0], "kv-a");
  EXPECT_EQ(all.next(first)[0], "kv-a");
  other.sub.set(zmq::sockopt::rcvtimeo, 100);
  std::vector<zmq::message_t> parts;
  EXPECT_FALSE(zmq::recv_multipart(other.sub, std::back_inserter(parts)));
}

TEST(KvEventPublisher, ReplayFromAStartReturnsTheBufferedBatchesThenTheEndMarker) {
  KvEventPublisher p(config_with_replay());
  Subscriber s(p);
  const std::uint64_t first = s.sync(p);
  std::vector<std::string> streamed;
  for (int i = 0; i < 10; ++i) p.publish(stored(i));
  for (std::uint64_t i = 0; i < 10; ++i) streamed.push_back(s.next(first + i)[2]);
  p.flush();
  const auto tail = s.replay(first + 3);
  ASSERT_EQ(tail.size(), 7u);
  for (std::uint64_t i = 0; i < 7; ++i) {
    EXPECT_EQ(tail[i].first, first + 3 + i);
    EXPECT_EQ(tail[i].second, streamed[3 + i]);
  }
  EXPECT_TRUE(s.replay(first + 10).empty());
  EXPECT_TRUE(s.replay(kEnd - 1).empty());
  EXPECT_EQ(s.replay(0).size(), first + 10);  // the probes too: nothing was evicted
}

TEST(KvEventPublisher, ReplayOfASequenceOlderThanTheBufferReturnsWhatIsLeft) {
  KvEventsConfig c = config_with_replay();
  c.replay_batches = 4;
  KvEventPublisher p(c);
  for (int i = 0; i < 10; ++i) p.publish(stored(i));
  p.flush();
  Subscriber s(p);
  const auto left = s.replay(2);
  ASSERT_EQ(left.size(), 4u);
  for (std::uint64_t i = 0; i < 4; ++i) {
    EXPECT_EQ(left[i].first, 6 + i);
    EXPECT_EQ(decode(left[i].second).events,
              "[[\"BlockStored\",[" + std::to_string(6 + i) + "],null,[1,2],2,null,\"GPU\"]]");
  }
}

TEST(KvEventPublisher, MalformedReplayRequestsGetAnErrorAndChangeNothing) {
  KvEventPublisher p(config_with_replay());
  p.publish(stored(1));
  p.publish(stored(2));
  p.flush();
  Subscriber s(p);
  const std::pair<Frames, std::string> cases[] = {
      {{be64(0)}, "got 1"},  // no delimiter
      {{""}, "got 1"},       // an empty message
      {{"", std::string(9, '\0')}, "9 bytes, not 8"},
      {{"", "1234567"}, "7 bytes, not 8"},
      {{"x", be64(0)}, "delimiter frame has 1 bytes"},
      {{"", be64(0), ""}, "got 3"},
  };
  for (const auto& [request, why] : cases) {
    const Frames reply = s.ask(request);
    ASSERT_EQ(reply.size(), 3u) << why;
    EXPECT_EQ(reply[0], "");
    EXPECT_EQ(reply[1], "");
    EXPECT_NE(reply[2].find("replay request: "), std::string::npos) << reply[2];
    EXPECT_NE(reply[2].find(why), std::string::npos) << reply[2];
  }
  const auto all = s.replay(0);
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[1].first, 1u);
  p.publish(stored(3));
  p.flush();
  const auto third = s.replay(2);
  ASSERT_EQ(third.size(), 1u);
  EXPECT_EQ(third[0].first, 2u);
  EXPECT_EQ(decode(third[0].second).events, "[[\"BlockStored\",[3],null,[1,2],2,null,\"GPU\"]]");
}

TEST(KvEventPublisher, ASlowSubscriberRecoversEveryBatchThroughReplay) {
  constexpr std::uint64_t kBatches = 2000;
  KvEventsConfig c = config_with_replay();
  c.replay_batches = static_cast<std::int64_t>(kBatches) + 1000;
  KvEventPublisher p(c);
  Subscriber s(p, "", /*rcvhwm=*/1);
  const std::uint64_t first = s.sync(p);
  // ~20 KiB per batch (token ids of 5 bytes each): 40 MiB, more than the socket buffers hold.
  std::vector<std::int32_t> tokens(4096, 70000);
  for (std::uint64_t i = 0; i < kBatches; ++i) {
    p.publish({KvBlockStored{
        {static_cast<std::int64_t>(i)}, std::nullopt, tokens, 4096, "", KvMedium::kGpu}});
  }
  p.flush();
  std::map<std::uint64_t, std::string> got;
  s.sub.set(zmq::sockopt::rcvtimeo, 500);  // all was sent; a pause means nothing more comes
  for (std::vector<zmq::message_t> parts; zmq::recv_multipart(s.sub, std::back_inserter(parts));
       parts.clear()) {
    if (const std::uint64_t seq = seq_of(parts[1].to_string()); seq >= first) {
      got[seq] = parts[2].to_string();
    }
  }
  ASSERT_LT(got.size(), kBatches) << "nothing was dropped: the test shows nothing";
  std::uint64_t gap = first;
  while (got.count(gap) != 0) ++gap;
  const auto replayed = s.replay(gap);
  ASSERT_EQ(replayed.size(), first + kBatches - gap);
  for (std::uint64_t i = 0; i < replayed.size(); ++i) {
    ASSERT_EQ(replayed[i].first, gap + i);
    if (got.count(gap + i) != 0) {
      EXPECT_EQ(replayed[i].second, got[gap + i]);
    }
    got[gap + i] = replayed[i].second;
  }
  EXPECT_EQ(got.size(), kBatches);
}

TEST(KvEventPublisher, AFullQueueDropsTheBatchAndItsNumberStaysAGapInTheReplay) {
  KvEventsConfig c = config_with_replay();
  c.queue_batches = 2;
  MetricsRegistry registry;
  KvEventPublisher p(c, &registry);
  Subscriber s(p);
  KvEventPublisherTestPeer::hold(p, true);
  for (int i = 0; i < 5; ++i) p.publish(stored(i));  // 0 and 1 wait; 2, 3, 4 are dropped
  EXPECT_EQ(p.dropped_batches(), 3u);
  EXPECT_EQ(registry.value("hicache_kv_event_queue_batches"), 2);
  EXPECT_TRUE(s.replay(0).empty());  // held: answered, with nothing sent yet
  KvEventPublisherTestPeer::hold(p, false);
  p.flush();  // room again
  p.publish(stored(5));
  p.flush();
  const auto all = s.replay(0);
  ASSERT_EQ(all.size(), 3u);
  EXPECT_EQ(all[0].first, 0u);
  EXPECT_EQ(all[1].first, 1u);
  EXPECT_EQ(all[2].first, 5u);
  EXPECT_EQ(decode(all[2].second).events, "[[\"BlockStored\",[5],null,[1,2],2,null,\"GPU\"]]");
  EXPECT_EQ(p.published_batches(), 3u);
  EXPECT_EQ(registry.value("hicache_kv_event_batches_total", {{"outcome", "published"}}), 3);
  EXPECT_EQ(registry.value("hicache_kv_event_batches_total", {{"outcome", "dropped"}}), 3);
  EXPECT_EQ(registry.value("hicache_kv_event_queue_batches"), 0);
  EXPECT_EQ(registry.value("hicache_kv_events_total", {{"type", "BlockStored"}}), 3);
  EXPECT_EQ(registry.value("hicache_kv_event_errors_total"), 0);
}

TEST(KvEventPublisher, UnpublishedMediaAreLeftOutAndAnEmptiedBatchTakesNoNumber) {
  KvEventsConfig c = config_with_replay();
  c.gpu = false;
  c.disk = false;
  MetricsRegistry registry;
  KvEventPublisher p(c, &registry);
  p.publish({KvBlockStored{{1}, std::nullopt, {1}, 1, "", KvMedium::kGpu},
             KvBlockStored{{2}, std::nullopt, {2}, 1, "", KvMedium::kCpuPinned},
             KvBlockRemoved{{3}, KvMedium::kDisk}, KvAllBlocksCleared{}});
  p.publish({KvBlockStored{{4}, std::nullopt, {4}, 1, "", KvMedium::kGpu},
             KvBlockRemoved{{5}, KvMedium::kDisk}});  // nothing left: not a batch
  p.publish({KvBlockRemoved{{6}, KvMedium::kExternal}});
  p.flush();
  Subscriber s(p);
  const auto all = s.replay(0);
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[0].first, 0u);
  EXPECT_EQ(decode(all[0].second).events,
            "[[\"BlockStored\",[2],null,[2],1,null,\"CPU_PINNED\"],[\"AllBlocksCleared\"]]");
  EXPECT_EQ(all[1].first, 1u);
  EXPECT_EQ(decode(all[1].second).events, "[[\"BlockRemoved\",[6],\"EXTERNAL\"]]");
  EXPECT_EQ(p.published_batches(), 2u);
  EXPECT_EQ(p.dropped_batches(), 0u);
  EXPECT_EQ(registry.value("hicache_kv_events_total", {{"type", "BlockStored"}}), 1);
  EXPECT_EQ(registry.value("hicache_kv_events_total", {{"type", "BlockRemoved"}}), 1);
  EXPECT_EQ(registry.value("hicache_kv_events_total", {{"type", "AllBlocksCleared"}}), 1);
}

TEST(KvEventPublisher, TheDestructorSendsWhatIsQueued) {
  auto p = std::make_unique<KvEventPublisher>(config_with_replay());
  Subscriber s(*p);
  const std::uint64_t first = s.sync(*p);
  p->flush();
  KvEventPublisherTestPeer::hold(*p, true);
  for (int i = 0; i < 3; ++i) p->publish(stored(10 + i));
  EXPECT_EQ(p->published_batches(), first);  // held: all three still queued
  p.reset();
  for (std::uint64_t i = 0; i < 3; ++i) {
    const Frames m = s.next(first + i);
    EXPECT_EQ(seq_of(m[1]), first + i);
    EXPECT_EQ(decode(m[2]).events,
              "[[\"BlockStored\",[" + std::to_string(10 + i) + "],null,[1,2],2,null,\"GPU\"]]");
  }
}

TEST(KvEventPublisher, AMalformedBlockStoredIsRefusedAndTakesNoNumber) {
  KvEventPublisher p(config_with_replay());
  EXPECT_EQ(error_of([&] {
              p.publish({KvAllBlocksCleared{},
                         KvBlockStored{{1, 2}, std::nullopt, {1, 2, 3}, 2, "", KvMedium::kGpu}});
            }),
            "KvBlockStored: 3 token ids for 2 blocks of block_size 2");
  EXPECT_EQ(error_of([&] {
              p.publish({KvBlockStored{{1}, std::nullopt, {}, 0, "", KvMedium::kGpu}});
            }),
            "KvBlockStored: 0 token ids for 1 blocks of block_size 0");
  EXPECT_EQ(error_of([&] {
              p.publish({KvBlockRemoved{{1}, static_cast<KvMedium>(9)}});
            }),
            "KvMedium 9 is not a medium");
  p.publish(stored(1));
  p.flush();
  Subscriber s(p);
  const auto all = s.replay(0);
  ASSERT_EQ(all.size(), 1u);
  EXPECT_EQ(all[0].first, 0u);
}

TEST(KvEventPublisher, BadConfigurationThrowsNamingTheValue) {
  auto error = [](auto change) {
    KvEventsConfig c = config_with_replay();
    change(c);
    return error_of([&] { KvEventPublisher p(c); });
  };
  EXPECT_EQ(error([](KvEventsConfig& c) { c.endpoint = ""; }), "KvEventsConfig.endpoint is empty");
  EXPECT_EQ(error([](KvEventsConfig& c) { c.replay_batches = -1; }),
            "KvEventsConfig.replay_batches is -1; must be >= 0");
  EXPECT_EQ(error([](KvEventsConfig& c) { c.queue_batches = 0; }),
            "KvEventsConfig.queue_batches is 0; must be >= 1");
  EXPECT_EQ(error([](KvEventsConfig& c) { c.endpoint = "tcp://*:99999"; }),
            "KvEventsConfig.endpoint 'tcp://*:99999' needs a port 0..65535");
  EXPECT_EQ(error([](KvEventsConfig& c) { c.endpoint = "tcp://127.0.0.1"; }),
            "KvEventsConfig.endpoint 'tcp://127.0.0.1' needs a port 0..65535");
  EXPECT_EQ(error([](KvEventsConfig& c) { c.endpoint = "tcp://127.0.0.1:0"; }),
            "KvEventsConfig.endpoint 'tcp://127.0.0.1:0' is connected (only tcp://*:..., ipc:// "
            "and inproc:// bind) and port 0 names no peer");
  EXPECT_EQ(error([](KvEventsConfig& c) { c.replay_endpoint = "tcp://127.0.0.1:x"; }),
            "KvEventsConfig.replay_endpoint 'tcp://127.0.0.1:x' needs a port 0..65535");
  EXPECT_EQ(error([](KvEventsConfig& c) { c.endpoint = "bogus://x"; }),
            "KvEventsConfig.endpoint 'bogus://x': cannot connect: Protocol not supported");
  EXPECT_EQ(error([](KvEventsConfig& c) { c.replay_endpoint = "tcp://no.such.host.invalid:0"; }),
            "KvEventsConfig.replay_endpoint 'tcp://no.such.host.invalid:0': cannot bind: No such "
            "device");
  // A port another publisher holds.
  KvEventPublisher holder(config_with_replay());
  const std::string taken = holder.replay_endpoint();
  EXPECT_EQ(error([&](KvEventsConfig& c) { c.replay_endpoint = taken; }),
            "KvEventsConfig.replay_endpoint '" + taken + "': cannot bind: Address already in use");
}

TEST(KvEventPublisher, EndpointsNameTheBoundPorts) {
  KvEventPublisher p(config_with_replay());
  EXPECT_TRUE(p.endpoint().starts_with("tcp://0.0.0.0:")) << p.endpoint();
  EXPECT_NE(p.endpoint(), "tcp://0.0.0.0:0");
  EXPECT_TRUE(p.replay_endpoint().starts_with("tcp://127.0.0.1:")) << p.replay_endpoint();
  EXPECT_NE(p.replay_endpoint(), "tcp://127.0.0.1:0");
  KvEventsConfig c = config_with_replay();
  c.replay_endpoint = "";
  EXPECT_EQ(KvEventPublisher(c).replay_endpoint(), "");
}

TEST(KvEventHash, IsThePageDigestsFirstEightBytesAsASignedBigEndianInteger) {
  PageDigest d{};
  for (std::size_t i = 0; i < d.size(); ++i) d[i] = static_cast<std::uint8_t>(0xf0 + i % 16);
  // f0 f1 f2 f3 f4 f5 f6 f7 as a signed 64-bit integer.
  EXPECT_EQ(kv_block_hash(d), static_cast<std::int64_t>(0xf0f1f2f3f4f5f6f7ull));
  EXPECT_EQ(kv_block_hash(d), -1084818905618843913);
  d[0] = 0x01;
  EXPECT_EQ(kv_block_hash(d), 0x01f1f2f3f4f5f6f7);
  const std::string hex = to_hex(d);
  EXPECT_EQ(kv_block_hash_of_key("model-tp0-" + hex), kv_block_hash(d));
  EXPECT_EQ(kv_block_hash_of_key("-" + hex), kv_block_hash(d));
  EXPECT_EQ(kv_block_hash_of_key(hex), std::nullopt);                    // no namespace
  EXPECT_EQ(kv_block_hash_of_key("ns-" + hex.substr(1)), std::nullopt);  // 63 digits
  EXPECT_EQ(kv_block_hash_of_key("ns-" + hex.substr(1) + "g"), std::nullopt);
  EXPECT_EQ(kv_block_hash_of_key("ns_" + hex), std::nullopt);
}

}  // namespace
}  // namespace hicache
