#include "storage/redis_storage.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include "pools/kv_pattern.h"
#include "tools/support/redis_launcher.h"
#include "storage/file_storage.h"
#include "storage/record.h"
#include "storage/redis_cluster.h"
#include "storage/redis_connection.h"
#include "storage/peer_process.h"
#include "storage/redis_test_servers.h"
#include "transfer/errors.h"

namespace hicache {
namespace {

// The servers the tests restart keep their port while down: it must lie below the kernel's
// ephemeral range, from which any process's outgoing connection may take it meanwhile.
TEST(RedisTestServers, PortsLieBelowTheEphemeralRange) {
  int low = 0;
  std::ifstream("/proc/sys/net/ipv4/ip_local_port_range") >> low;
  if (low < 20001) GTEST_SKIP() << "ephemeral range starts at " << low << ": no room below it";
  for (int i = 0; i < 20; ++i) {
    const int port = bench::pick_server_port();
    ASSERT_GE(port, 1024);
    EXPECT_LT(port + 10000, low) << "port " << port << " (cluster bus " << port + 10000
                                 << ") is not below the ephemeral range from " << low;
  }
}

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;
using testing::RawClient;
using testing::redis_cli;

std::uint64_t seed_of(const std::string& key) { return std::hash<std::string>{}(key); }

std::vector<std::byte> page_for(const std::string& key, std::size_t bytes) {
  std::vector<std::byte> out(bytes);
  fill_pattern(out, seed_of(key), 0, 0);
  return out;
}

bool holds_page_of(const std::string& key, std::span<const std::byte> data) {
  return find_pattern_mismatch(data, seed_of(key), 0, 0) < 0;
}

std::vector<std::string> make_keys(const std::string& stem, int n) {
  std::vector<std::string> keys;
  for (int i = 0; i < n; ++i) keys.push_back(str_cat(stem, "-", i));
  return keys;
}

std::vector<IoResult> put(StorageBackend& s, const std::vector<std::string>& keys,
                          std::size_t bytes) {
  std::vector<std::vector<std::byte>> pages;
  std::vector<ConstByteSpan> spans;
  for (const auto& k : keys) pages.push_back(page_for(k, bytes));
  for (const auto& p : pages) spans.emplace_back(p);
  return s.batch_set(keys, spans);
}

void put_ok(StorageBackend& s, const std::vector<std::string>& keys, std::size_t bytes) {
  const auto results = put(s, keys, bytes);
  for (std::size_t i = 0; i < keys.size(); ++i) {
    ASSERT_TRUE(results[i].is_ok()) << keys[i] << ": " << results[i].reason;
  }
}

// Reads keys into fresh buffers; every ok page must hold its key's bytes.
std::vector<IoResult> get(StorageBackend& s, const std::vector<std::string>& keys,
                          std::size_t bytes) {
  std::vector<std::vector<std::byte>> pages(keys.size(), std::vector<std::byte>(bytes));
  std::vector<ByteSpan> spans;
  for (auto& p : pages) spans.emplace_back(p);
  auto results = s.batch_get(keys, spans);
  EXPECT_EQ(results.size(), keys.size());
  for (std::size_t i = 0; i < results.size(); ++i) {
    if (results[i].is_ok()) {
      EXPECT_TRUE(holds_page_of(keys[i], pages[i])) << keys[i];
    }
  }
  return results;
}

void expect_all(const std::vector<IoResult>& results, IoStatus status) {
  for (std::size_t i = 0; i < results.size(); ++i) {
    EXPECT_EQ(results[i].status, status) << i << ": " << results[i].reason;
  }
}

std::string json_for(int port, const std::string& extra = "") {
  return str_cat(R"({"backend": "redis", "host": "127.0.0.1", "port": )", port,
                 extra.empty() ? "" : ", ", extra, "}");
}

std::unique_ptr<RedisStorage> open_redis(int port, const std::string& extra = "") {
  return std::make_unique<RedisStorage>(RedisConfig::from_json_text(json_for(port, extra)));
}

// A raw SET of arbitrary bytes, bypassing the record format.
void raw_set(int port, const std::string& key, std::string_view value) {
  RawClient c(port);
  ASSERT_TRUE(c.ok());
  ASSERT_EQ(c.command({"SET", key, std::string(value)}), "+OK");
}

std::string record_of(const std::string& key, std::span<const std::byte> payload) {
  std::string out(record_head_bytes(key), '\0');
  encode_record_head(key, payload, std::as_writable_bytes(std::span(out)));
  out.append(reinterpret_cast<const char*>(payload.data()), payload.size());
  return out;
}

// ---- configuration and cluster helpers (no server) ----

// A port taken by another server between the pick and our server's bind: the launcher must not
// take that server's answer for its own child's (a test would then flush or kill another test's
// data).
TEST(RedisTestServers, AServerOnThePortThatIsNotOurChildIsAFailure) {
  if (testing::find_redis_server().empty()) GTEST_SKIP() << "redis-server is not installed";
  bench::RedisProcess first, second;
  std::string error;
  ASSERT_TRUE(first.start({}, &error)) << error;
  EXPECT_FALSE(second.start_on(first.port(), {}, &error));
  EXPECT_NE(error.find(str_cat("port ", first.port())), std::string::npos) << error;
  EXPECT_FALSE(second.running());
  EXPECT_EQ(RawClient(first.port()).command({"PING"}), "+PONG") << "the first server is untouched";
}

TEST(RedisStorageConfig, ParsesFieldsAndDefaults) {
  const auto c = RedisConfig::from_json_text(
      R"({"backend": "redis", "host": "10.0.0.1", "port": 7000, "connections": 2,
          "timeout_ms": 300, "connect_timeout_ms": 200, "reconnect_backoff_ms": [5, 50],
          "max_value_bytes": 4096, "io_threads": 1, "zero_copy_min_bytes": 0})");
  ASSERT_EQ(c.nodes.size(), 1u);
  EXPECT_EQ(c.nodes[0].host, "10.0.0.1");
  EXPECT_EQ(c.nodes[0].port, 7000);
  EXPECT_FALSE(c.cluster);
  EXPECT_EQ(c.connections, 2);
  EXPECT_EQ(c.timeout, 300ms);
  EXPECT_EQ(c.connect_timeout, 200ms);
  EXPECT_EQ(c.backoff_initial, 5ms);
  EXPECT_EQ(c.backoff_max, 50ms);
  EXPECT_EQ(c.max_value_bytes, 4096u);
  EXPECT_EQ(c.io_threads, 1);
  EXPECT_EQ(c.zero_copy_min_bytes, 0u);
  const auto d = RedisConfig::from_json_text(R"({"backend": "redis"})");
  EXPECT_EQ(d.nodes[0].port, 6379);
  EXPECT_EQ(d.max_value_bytes, 512u << 20);
  EXPECT_EQ(d.io_threads, 0);  // automatic: the store resolves it
  EXPECT_EQ(d.zero_copy_min_bytes, 64u << 10);
  EXPECT_TRUE(d.check_at_start);
  const auto cpus = static_cast<int>(std::thread::hardware_concurrency());
  auto lazy = [](RedisConfig x) {  // no server here: opened without the check at start
    x.check_at_start = false;
    return x;
  };
  EXPECT_EQ(RedisStorage(lazy(d)).config().io_threads, std::clamp(cpus / 4, 1, 4));
  EXPECT_EQ(RedisStorage(lazy(c)).config().io_threads, 1);
  const auto cl = RedisConfig::from_json_text(
      R"({"backend": "redis", "cluster": true, "nodes": ["127.0.0.1:7000", "[::1]:7001"]})");
  ASSERT_EQ(cl.nodes.size(), 2u);
  EXPECT_EQ(cl.nodes[1].host, "::1");
  EXPECT_EQ(cl.nodes[1].port, 7001);
}

TEST(RedisStorageConfig, RejectsUnknownFieldsAndBadValuesByName) {
  auto message = [](const std::string& json) -> std::string {
    try {
      RedisConfig::from_json_text(json);
    } catch (const InvalidArgument& e) {
      return e.what();
    }
    return "no error";
  };
  const auto unknown = message(R"({"backend": "redis", "hots": "x"})");
  EXPECT_NE(unknown.find("'hots'"), std::string::npos) << unknown;
  EXPECT_NE(unknown.find("timeout_ms"), std::string::npos) << unknown;  // lists the valid ones
  EXPECT_NE(message(R"({"port": 70000})").find("'port'"), std::string::npos);
  EXPECT_NE(message(R"({"port": "6379"})").find("'port'"), std::string::npos);
  EXPECT_NE(message(R"({"connections": 0})").find("'connections'"), std::string::npos);
  EXPECT_NE(message(R"({"io_threads": -1})").find("'io_threads'"), std::string::npos);
  EXPECT_NE(message(R"({"zero_copy_min_bytes": -1})").find("'zero_copy_min_bytes'"),
            std::string::npos);
  EXPECT_NE(message(R"({"host": ""})").find("key 'host' is empty"), std::string::npos);
  EXPECT_NE(message(R"({"host": 5})").find("'host' has a value of the wrong type: 5"),
            std::string::npos);
  EXPECT_NE(message(R"({"timeout_ms": 0})").find("'timeout_ms' = 0 is outside"),
            std::string::npos);
  EXPECT_NE(message(R"({"connect_timeout_ms": 0})").find("'connect_timeout_ms' = 0 is outside"),
            std::string::npos);
  EXPECT_NE(message(R"({"password": 5})").find("'password' has a value of the wrong type: 5"),
            std::string::npos);
  EXPECT_NE(message(R"({"max_value_bytes": 0})").find("'max_value_bytes' = 0 is outside"),
            std::string::npos);
  EXPECT_NE(message(R"({"cluster": "yes"})").find(R"('cluster' has a value of the wrong type: "yes")"),
            std::string::npos);
  EXPECT_NE(message(R"({"cluster": true, "nodes": []})").find("key 'nodes' must be a non-empty"),
            std::string::npos);
  EXPECT_NE(message(R"({"read_from_replicas": 1})").find("'read_from_replicas' has a value of"),
            std::string::npos);
  // The same checks when a config is built in code.
  RedisConfig negative;
  negative.io_threads = -2;
  try {
    RedisStorage store(negative);
    ADD_FAILURE() << "io_threads -2 accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("io_threads must be >= 0"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("-2"), std::string::npos) << e.what();
  }
  RedisConfig no_connections;
  no_connections.connections = 0;
  EXPECT_THROW(RedisStorage{no_connections}, InvalidArgument);
  EXPECT_NE(message(R"({"reconnect_backoff_ms": [10]})").find("reconnect_backoff_ms"),
            std::string::npos);
  EXPECT_NE(message(R"({"reconnect_backoff_ms": [50, 10]})").find("reconnect_backoff_ms"),
            std::string::npos);
  EXPECT_NE(message(R"({"cluster": true, "nodes": ["nohost"]})").find("nohost"), std::string::npos);
  EXPECT_NE(message(R"({"nodes": ["a:1", "b:2"]})").find("'cluster' is false"), std::string::npos);
  EXPECT_NE(message(R"({"nodes": ["a:1"], "port": 5})").find("not both"), std::string::npos);
  EXPECT_NE(message("[1]").find("object"), std::string::npos);
  const auto replicas = message(R"({"read_from_replicas": true})");
  EXPECT_NE(replicas.find("'read_from_replicas' needs 'cluster': true"), std::string::npos)
      << replicas;
  EXPECT_TRUE(RedisConfig::from_json_text(
                  R"({"cluster": true, "nodes": ["a:1"], "read_from_replicas": true})")
                  .read_from_replicas);
}

// The threads of this process, as the kernel lists them. A thread is started and joined first:
// ThreadSanitizer starts its own background thread with the process's second thread, and that
// one must be in every count, not in the first difference taken.
std::size_t process_threads() {
  std::thread([] {}).join();
  std::size_t n = 0;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/task")) {
    n += e.is_directory() ? 1 : 0;
  }
  return n;
}

// io_threads: the threads the store's connections run on (one io_context each), started with the
// store.
TEST(RedisStorageConfig, IoThreadsAreTheThreadsTheStoreRuns) {
  auto open = [](int threads) {
    return make_storage(str_cat(R"({"backend": "redis", "port": 1, "check_at_start": false, )",
                                R"("io_threads": )", threads, "}"));
  };
  const std::size_t before = process_threads();
  auto one = open(1);
  const std::size_t with_one = process_threads();
  auto three = open(3);
  const std::size_t with_three = process_threads();
  EXPECT_EQ(with_one - before, 1u) << "threads: " << before << ", " << with_one;
  EXPECT_EQ(with_three - with_one, 3u) << "threads: " << with_one << ", " << with_three;
}

// connect_timeout_ms bounds a connection's set-up, the handshake included: a server that
// accepts (here the kernel, for a listener nobody accepts from) and never answers fails the
// batch after it, not after timeout_ms; with the check at start, the start fails after it.
TEST(RedisStorageConfig, AHandshakeNobodyAnswersEndsAfterTheConnectTimeout) {
  const int listener = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(listener, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  ASSERT_EQ(::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(::listen(listener, 16), 0);
  ASSERT_EQ(::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const int port = ntohs(addr.sin_port);
  {
    auto s = open_redis(port, R"("connections": 1, "connect_timeout_ms": 300,
                                 "timeout_ms": 20000, "check_at_start": false)");
    const auto t0 = Clock::now();
    const auto r = get(*s, {"k"}, 4096);
    const auto took = Clock::now() - t0;
    ASSERT_EQ(r[0].status, IoStatus::kError);
    EXPECT_NE(r[0].reason.find("timed out after 300 ms"), std::string::npos) << r[0].reason;
    EXPECT_GE(took, 250ms);
    EXPECT_LT(took, 5s) << "ended by timeout_ms, not by connect_timeout_ms";
  }
  const auto t0 = Clock::now();
  try {
    auto s = open_redis(port, R"("connect_timeout_ms": 300, "timeout_ms": 20000)");
    ADD_FAILURE() << "a store whose server never answered was opened";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("timed out after 300 ms"), std::string::npos) << e.what();
  }
  EXPECT_LT(Clock::now() - t0, 5s);
  ::close(listener);
}

TEST(RedisStorageConfig, FactoryBuildsARedisBackend) {
  auto s = make_storage(
      R"({"backend": "redis", "port": 1, "connect_timeout_ms": 100, "check_at_start": false})");
  EXPECT_EQ(s->name(), "redis");
}

// A server that cannot be reached is an error at start naming it and the cause, unless
// check_at_start is false (then batches fail per key, as below).
TEST(RedisStorageConfig, AnUnreachableServerIsAnErrorAtStart) {
  try {
    auto s = make_storage(R"({"backend": "redis", "port": 1, "connect_timeout_ms": 200})");
    ADD_FAILURE() << "a store nobody answers for was opened";
  } catch (const IoError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("127.0.0.1:1 does not answer at start"), std::string::npos) << what;
    EXPECT_NE(what.find("check_at_start"), std::string::npos) << what;
  }
  EXPECT_THROW(make_storage(R"({"backend": "redis", "port": 1, "check_at_start": 1})"),
               InvalidArgument);
}

// Batches of about 4 MiB, and at least one page per connection; a file store takes 64 MiB.
TEST(RedisStorageConfig, PreferredBatchIsAboutFourMiBAndAPagePerConnection) {
  auto redis = make_storage(
      R"({"backend": "redis", "port": 1, "connections": 3, "connect_timeout_ms": 100,
          "check_at_start": false})");
  EXPECT_EQ(redis->preferred_batch_pages(256 << 10), 16);
  EXPECT_EQ(redis->preferred_batch_pages(2 << 10), 2048);
  EXPECT_EQ(redis->preferred_batch_pages(8 << 20), 3);
  const auto root = std::filesystem::temp_directory_path() / str_cat("hicache-pref-", ::getpid());
  {
    FileStorage file(FileStorageConfig{.root = root.string()});
    EXPECT_EQ(file.preferred_batch_pages(256 << 10), 256);
    EXPECT_EQ(file.preferred_batch_pages(128 << 20), 1);
  }
  std::filesystem::remove_all(root);
}

TEST(RedisClusterRouting, Crc16AndKeySlotsFollowTheClusterSpec) {
  EXPECT_EQ(redis::crc16("123456789"), 0x31C3);
  EXPECT_EQ(redis::key_slot("foo"), 12182);  // CLUSTER KEYSLOT foo
  EXPECT_EQ(redis::key_slot("{user1000}.following"), redis::key_slot("{user1000}.followers"));
  EXPECT_EQ(redis::key_slot("{user1000}.following"), redis::key_slot("user1000"));
  EXPECT_EQ(redis::key_slot("foo{}{bar}"), redis::crc16("foo{}{bar}") % 16384);  // empty tag
  EXPECT_EQ(redis::key_slot("foo{{bar}}zap"), redis::key_slot("{bar"));
}

TEST(RedisClusterRouting, ParsesRedirects) {
  const auto moved = redis::parse_redirect("MOVED 3999 127.0.0.1:6381");
  ASSERT_TRUE(moved);
  EXPECT_FALSE(moved->ask);
  EXPECT_EQ(moved->slot, 3999);
  EXPECT_EQ(moved->target.host, "127.0.0.1");
  EXPECT_EQ(moved->target.port, 6381);
  const auto ask = redis::parse_redirect("ASK 1 :7000");
  ASSERT_TRUE(ask);
  EXPECT_TRUE(ask->ask);
  EXPECT_EQ(ask->target.host, "");
  EXPECT_FALSE(redis::parse_redirect("ERR wrong"));
  EXPECT_FALSE(redis::parse_redirect("MOVED 99999 a:1"));
  EXPECT_FALSE(redis::parse_redirect("MOVED 1 a:0"));
}

TEST(RespEncoding, CommandsAreExactlyTheBytesRedisExpects) {
  std::string out;
  redis::append_array_head(out, 3);
  redis::append_bulk(out, "MSETNX");
  redis::append_bulk(out, "");
  redis::append_bulk_head(out, 262'176);
  EXPECT_EQ(out, "*3\r\n$6\r\nMSETNX\r\n$0\r\n\r\n$262176\r\n");
  out.clear();
  redis::append_bulk_head(out, std::numeric_limits<std::size_t>::max());
  EXPECT_EQ(out, "$18446744073709551615\r\n");
  // A value's bulk string on the wire is what a reply of that length takes.
  out.clear();
  redis::append_bulk(out, std::string(1000, 'v'));
  EXPECT_EQ(out.size(), redis::bulk_reply_bytes(1000));
}

// A suite's servers, started once for the suite by Start (nullptr with start_error_ when they
// could not be; the tests then fail with the reason, or skip without redis-server) and stopped
// at its end.
template <typename Servers, bool (*Start)(Servers&, std::string*)>
class ServersSuite : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (testing::find_redis_server().empty() || testing::find_redis_cli().empty()) return;
    auto servers = std::make_unique<Servers>();
    if (Start(*servers, &start_error_)) servers_ = servers.release();
  }
  static void TearDownTestSuite() {
    delete servers_;
    servers_ = nullptr;
  }
  void SetUp() override {
    if (testing::find_redis_server().empty()) GTEST_SKIP() << "redis-server is not installed";
    ASSERT_NE(servers_, nullptr) << start_error_;
  }
  // In a derived SetUp, after ServersSuite::SetUp: nothing more to do.
  bool stopped() const { return IsSkipped() || HasFatalFailure(); }

  static inline Servers* servers_ = nullptr;
  static inline std::string start_error_;
};

bool start_one_server(testing::RedisServer& s, std::string* error) { return s.start({}, error); }
bool start_cluster(testing::RedisCluster& c, std::string* error) {
  return c.start(3, /*cluster=*/true, error);
}
constexpr int kReplicatedNodeTimeoutMs = 1000;
bool start_replicated_cluster(testing::RedisCluster& c, std::string* error) {
  return c.start(3, /*cluster=*/true, error, /*replicas=*/1, kReplicatedNodeTimeoutMs);
}

// Two engine processes over one Redis (a server or a cluster): B, connected before A writes,
// finds every page A stores and reads its bytes; a page A removes is a miss for B, never stale
// bytes. Redis sees every writer: no flag and no detection are needed (issue 38).
void expect_two_processes_see_each_others_records(
    const std::function<std::unique_ptr<StorageBackend>()>& open) {
  const auto keys = make_keys("two-proc", 4);
  constexpr std::size_t kBytes = 64 << 10;
  std::unique_ptr<StorageBackend> store;  // each child's own
  // In a child: '+' when exists says `hits` and every read is what `want` says (1 the key's
  // page, 0 a miss).
  auto check = [&](std::size_t hits, const std::vector<int>& want) -> char {
    if (store->batch_exists(keys) != hits) return '-';
    std::vector<std::vector<std::byte>> pages(keys.size(), std::vector<std::byte>(kBytes));
    std::vector<ByteSpan> spans;
    for (auto& p : pages) spans.emplace_back(p);
    const auto r = store->batch_get(keys, spans);
    for (std::size_t i = 0; i < keys.size(); ++i) {
      const bool right = want[i] == 1 ? r[i].is_ok() && holds_page_of(keys[i], pages[i])
                                      : r[i].status == IoStatus::kMiss;
      if (!right) return '-';
    }
    return '+';
  };
  testing::PeerProcess b([&](char c) -> char {
    switch (c) {
      case 'o': store = open(); return '+';
      case '0': return store->batch_exists(keys) == 0 ? '+' : '-';
      case 'n': return check(4, {1, 1, 1, 1});
      case 'm': return check(1, {1, 0, 1, 1});
      default: return '?';
    }
  });
  ASSERT_EQ(b.ask('o'), '+');
  ASSERT_EQ(b.ask('0'), '+');
  testing::PeerProcess a([&](char c) -> char {
    switch (c) {
      case 'o': store = open(); return '+';
      case 'w': {
        const auto r = put(*store, keys, kBytes);
        return std::all_of(r.begin(), r.end(), [](const IoResult& x) { return x.is_ok(); }) ? '+'
                                                                                          : '-';
      }
      case 'r': return store->remove(keys[1]) ? '+' : '-';
      default: return '?';
    }
  });
  ASSERT_EQ(a.ask('o'), '+');
  ASSERT_EQ(a.ask('w'), '+');
  EXPECT_EQ(b.ask('n'), '+') << "B does not see (or misreads) the pages A wrote after B connected";
  ASSERT_EQ(a.ask('r'), '+');
  EXPECT_EQ(b.ask('m'), '+') << "B answers stale or wrong data for a page A removed";
}

// ---- one server ----

class RedisStorageTest : public ServersSuite<testing::RedisServer, start_one_server> {
 protected:
  void SetUp() override {
    ServersSuite::SetUp();
    if (stopped()) return;
    RawClient c(port());
    ASSERT_EQ(c.command({"FLUSHALL"}), "+OK");
  }
  static int port() { return servers_->port(); }
};

TEST_F(RedisStorageTest, TwoProcessesSeeEachOthersRecords) {
  expect_two_processes_see_each_others_records([] { return open_redis(port()); });
}

TEST_F(RedisStorageTest, RoundTripsByteForByte) {
  auto s = open_redis(port(), R"("connections": 3)");
  for (std::size_t bytes : {std::size_t{4096}, std::size_t{65536}, std::size_t{1} << 20}) {
    const auto keys = make_keys(str_cat("rt", bytes), 6);
    put_ok(*s, keys, bytes);
    expect_all(get(*s, keys, bytes), IoStatus::kOk);
  }
  const auto st = s->stats();
  EXPECT_EQ(st.set_written, 18u);
  EXPECT_EQ(st.get_hits, 18u);
  EXPECT_EQ(st.bytes_written, 6u * (4096 + 65536 + (1 << 20)));
  EXPECT_EQ(st.bytes_read, st.bytes_written);
  EXPECT_EQ(st.bad_records, 0u);
  // Stored as a record: header + key + payload.
  const std::string size = redis_cli(port(), {"strlen", "rt4096-0"});
  EXPECT_EQ(std::stoul(size), record_head_bytes("rt4096-0") + 4096);
}

// Large payloads are spliced from the caller's pages (zero_copy_min_bytes): what the server
// stores is the bytes of the call, however the payloads lie in memory (odd sizes, unaligned),
// mixed with copied ones on one pipeline, and larger than the pipe and the socket buffers; once
// batch_set returned, the caller may overwrite its pages at once.
TEST_F(RedisStorageTest, ZeroCopyPayloadsAreTheBytesOfTheCall) {
  auto s = open_redis(port(), R"("connections": 1, "zero_copy_min_bytes": 65536)");
  const std::vector<std::size_t> sizes = {70'001, 4096, 8u << 20, 65'536, 100, 3u << 20};
  std::vector<std::string> keys;
  std::vector<std::vector<std::byte>> pages;
  std::vector<ConstByteSpan> spans;
  std::size_t spliced = 0;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    keys.push_back(str_cat("zc-", i));
    // One byte in: no payload starts on a page boundary.
    pages.emplace_back(sizes[i] + 1);
    fill_pattern(std::span(pages.back()).subspan(1), seed_of(keys.back()), 0, 0);
    spans.emplace_back(std::span(pages.back()).subspan(1));
    if (sizes[i] >= 65'536) spliced += sizes[i];
  }
  const auto results = s->batch_set(keys, spans);
  for (std::size_t i = 0; i < keys.size(); ++i) {
    ASSERT_TRUE(results[i].is_ok()) << keys[i] << ": " << results[i].reason;
  }
  for (auto& p : pages) std::fill(p.begin(), p.end(), std::byte{0xEE});
  EXPECT_EQ(s->zero_copy_bytes(), spliced) << "the large payloads went by splice, the rest not";
  for (std::size_t i = 0; i < keys.size(); ++i) {
    expect_all(get(*s, {keys[i]}, sizes[i]), IoStatus::kOk);
  }
  // The same bytes through a store that copies every payload.
  auto copying = open_redis(port(), R"("zero_copy_min_bytes": 0)");
  for (std::size_t i = 0; i < keys.size(); ++i) {
    expect_all(get(*copying, {keys[i]}, sizes[i]), IoStatus::kOk);
  }
  put_ok(*copying, {"copied"}, 1 << 20);
  EXPECT_EQ(copying->zero_copy_bytes(), 0u);
  expect_all(get(*s, {"copied"}, 1 << 20), IoStatus::kOk);
}

// Memory the kernel cannot pin for a pipe (memfd_secret here; a device mapping in general):
// vmsplice refuses it, and the payload is copied into the socket instead.
TEST_F(RedisStorageTest, PayloadsTheKernelCannotReferenceAreCopied) {
  const int fd = static_cast<int>(::syscall(SYS_memfd_secret, 0));
  if (fd < 0) GTEST_SKIP() << "memfd_secret unavailable: " << std::strerror(errno);
  constexpr std::size_t kBytes = 1 << 20;
  ASSERT_EQ(::ftruncate(fd, kBytes), 0);
  void* mem = ::mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  ASSERT_NE(mem, MAP_FAILED) << std::strerror(errno);
  const std::span<std::byte> page(static_cast<std::byte*>(mem), kBytes);
  fill_pattern(page, seed_of("secret"), 0, 0);
  auto s = open_redis(port(), R"("connections": 1)");
  const std::vector<std::string> keys = {"secret"};
  const std::vector<ConstByteSpan> spans = {page};
  const auto results = s->batch_set(keys, spans);
  ::munmap(mem, kBytes);
  ASSERT_TRUE(results[0].is_ok()) << results[0].reason;
  EXPECT_EQ(s->zero_copy_bytes(), 0u);
  expect_all(get(*s, keys, kBytes), IoStatus::kOk);
}

TEST_F(RedisStorageTest, ManySmallValuesInOneBatch) {
  auto s = open_redis(port(), R"("connections": 2)");
  const auto keys = make_keys("many", 1500);
  put_ok(*s, keys, 4096);
  expect_all(get(*s, keys, 4096), IoStatus::kOk);
  EXPECT_EQ(s->batch_exists(keys), keys.size());
}

TEST_F(RedisStorageTest, AbsentKeysMissAndExistsCountsThePrefix) {
  auto s = open_redis(port());
  put_ok(*s, {"a", "b", "d"}, 4096);
  EXPECT_EQ(s->batch_exists(std::vector<std::string>{"a", "b", "c", "d"}), 2u);
  EXPECT_EQ(s->batch_exists(std::vector<std::string>{"c", "a"}), 0u);
  EXPECT_EQ(s->batch_exists(std::vector<std::string>{}), 0u);
  const auto r = get(*s, {"a", "c"}, 4096);
  EXPECT_TRUE(r[0].is_ok());
  EXPECT_EQ(r[1].status, IoStatus::kMiss);
  EXPECT_EQ(s->stats().exists_queries, 6u);
  EXPECT_EQ(s->stats().get_misses, 1u);
}

// exists_each answers every key of a sparse set (batch_exists stops at the first absent one).
TEST_F(RedisStorageTest, ExistsEachAnswersEveryKeyOfASparseSet) {
  auto s = open_redis(port(), R"("connections": 1)");
  put_ok(*s, {"e0", "e2", "e3"}, 4096);
  const std::vector<std::string> keys = {"e0", "e1", "e2", "e3", "e4"};
  EXPECT_EQ(s->exists_each(keys), (std::vector<bool>{true, false, true, true, false}));
  EXPECT_EQ(s->batch_exists(keys), 1u) << "batch_exists still stops at the first absent key";
  EXPECT_TRUE(s->exists_each(std::vector<std::string>{}).empty());
  EXPECT_EQ(s->stats().exists_queries, 10u);
  EXPECT_THROW(s->exists_each(std::vector<std::string>{"ok", "a b"}), InvalidArgument);
}

TEST_F(RedisStorageTest, SetSkipsKeysAlreadyStored) {
  auto s = open_redis(port());
  put_ok(*s, {"x", "y"}, 8192);
  put_ok(*s, {"x", "y", "z"}, 8192);
  const auto st = s->stats();
  EXPECT_EQ(st.set_written, 3u);
  EXPECT_EQ(st.set_deduplicated, 2u);
  // Another client (another engine) finds them too.
  auto other = open_redis(port());
  put_ok(*other, {"x", "z"}, 8192);
  EXPECT_EQ(other->stats().set_written, 0u);
  expect_all(get(*other, {"x", "y", "z"}, 8192), IoStatus::kOk);
}

// Calls of a command the server counted since its last CONFIG RESETSTAT.
std::uint64_t command_calls(int port, const std::string& command) {
  const std::string info = redis_cli(port, {"info", "commandstats"});
  const std::string field = str_cat("cmdstat_", command, ":calls=");
  const auto at = info.find(field);
  return at == std::string::npos ? 0 : std::stoull(info.substr(at + field.size()));
}

// New pages go straight out as MSETNX; once batches find their keys stored, EXISTS is asked
// first and stored pages' bytes are not sent; batches of new pages turn that off again.
TEST_F(RedisStorageTest, SetProbesWithExistsOnlyWhileBatchesFindTheirKeysStored) {
  auto s = open_redis(port());
  ASSERT_EQ(redis_cli(port(), {"config", "resetstat"}), "OK\n");
  const auto keys = make_keys("nx", 8);
  put_ok(*s, keys, 4096);
  EXPECT_EQ(command_calls(port(), "msetnx"), 8u);
  EXPECT_EQ(command_calls(port(), "exists"), 0u);
  // Stored already: the server keeps the first record and the batch counts them deduplicated.
  put_ok(*s, keys, 4096);
  EXPECT_EQ(command_calls(port(), "msetnx"), 16u);
  EXPECT_EQ(s->stats().set_written, 8u);
  EXPECT_EQ(s->stats().set_deduplicated, 8u);
  // Now the keys are asked first, and no value goes.
  put_ok(*s, keys, 4096);
  EXPECT_EQ(command_calls(port(), "exists"), 8u);
  EXPECT_EQ(command_calls(port(), "msetnx"), 16u);
  EXPECT_EQ(s->stats().set_deduplicated, 16u);
  expect_all(get(*s, keys, 4096), IoStatus::kOk);
  // Batches of new pages: probed while the estimate decays, then sent directly for good.
  int probed = 0, direct_after_probing = 0;
  for (int b = 0; b < 16; ++b) {
    const auto before = command_calls(port(), "exists");
    put_ok(*s, make_keys(str_cat("fresh", b), 8), 4096);
    if (command_calls(port(), "exists") > before) {
      EXPECT_EQ(direct_after_probing, 0) << "probing came back at batch " << b;
      ++probed;
    } else {
      ++direct_after_probing;
    }
  }
  EXPECT_GE(probed, 1);
  EXPECT_LE(probed, 8);
  EXPECT_EQ(s->stats().set_written, 8u + 16 * 8);
  EXPECT_EQ(s->stats().set_deduplicated, 16u);
}

// Two engines backing up the same pages at once: each page is written exactly once in all
// (MSETNX is decided by the server, so no check-then-write race can write it twice).
TEST_F(RedisStorageTest, ConcurrentEnginesWriteEachPageExactlyOnce) {
  auto a = open_redis(port());
  auto b = open_redis(port());
  for (int round = 0; round < 4; ++round) {
    const auto keys = make_keys(str_cat("race", round), 64);
    std::thread ta([&] { put_ok(*a, keys, 4096); });
    std::thread tb([&] { put_ok(*b, keys, 4096); });
    ta.join();
    tb.join();
    expect_all(get(*a, keys, 4096), IoStatus::kOk);
  }
  EXPECT_EQ(a->stats().set_written + b->stats().set_written, 4u * 64);
  EXPECT_EQ(a->stats().set_deduplicated + b->stats().set_deduplicated, 4u * 64);
}

TEST_F(RedisStorageTest, BadRecordsAreMissesCountedAndRemoved) {
  auto s = open_redis(port());
  const std::size_t bytes = 4096;
  const auto good = page_for("k", bytes);
  raw_set(port(), "garbage", "hello, not a record");
  raw_set(port(), "foreign", record_of("strange", page_for("strange", bytes)));  // same length
  const std::string full = record_of("truncated", page_for("truncated", bytes));
  raw_set(port(), "truncated", std::string_view(full).substr(0, full.size() / 2));
  std::string flipped = record_of("flipped", page_for("flipped", bytes));
  flipped.back() ^= 1;
  raw_set(port(), "flipped", flipped);
  raw_set(port(), "headonly", std::string_view(full).substr(0, 20));
  put_ok(*s, {"wrongsize"}, bytes / 2);  // a valid record, read with a span of the wrong size

  const std::vector<std::string> keys = {"garbage", "foreign",  "truncated",
                                         "flipped", "headonly", "wrongsize"};
  const auto r = get(*s, keys, bytes);
  for (std::size_t i = 0; i < keys.size(); ++i) {
    EXPECT_EQ(r[i].status, IoStatus::kMiss) << keys[i];
    EXPECT_NE(r[i].reason.find("bad record"), std::string::npos) << r[i].reason;
    EXPECT_EQ(redis_cli(port(), {"exists", keys[i]}), "0\n") << keys[i] << " was not removed";
  }
  EXPECT_NE(r[1].reason.find("strange"), std::string::npos) << r[1].reason;
  EXPECT_NE(r[3].reason.find("checksum"), std::string::npos) << r[3].reason;
  const auto st = s->stats();
  EXPECT_EQ(st.bad_records, keys.size());
  EXPECT_EQ(st.get_misses, keys.size());
  EXPECT_EQ(st.get_hits, 0u);
}

TEST_F(RedisStorageTest, RejectsBadInputBeforeSendingAnything) {
  auto s = open_redis(port());
  std::vector<std::byte> page(64);
  std::vector<ByteSpan> one = {ByteSpan(page)};
  std::vector<ConstByteSpan> one_src = {ConstByteSpan(page)};
  EXPECT_THROW(s->batch_get(std::vector<std::string>{""}, one), InvalidArgument);
  EXPECT_THROW(s->batch_set(std::vector<std::string>{"a b"}, one_src), InvalidArgument);
  EXPECT_THROW(s->batch_get(std::vector<std::string>{"a", "b"}, one), InvalidArgument);
  std::vector<ByteSpan> empty = {ByteSpan()};
  EXPECT_THROW(s->batch_get(std::vector<std::string>{"a"}, empty), InvalidArgument);
  EXPECT_THROW(s->batch_exists(std::vector<std::string>{""}), InvalidArgument);
  EXPECT_THROW(s->remove(""), InvalidArgument);
  EXPECT_EQ(redis_cli(port(), {"dbsize"}), "0\n");
}

TEST_F(RedisStorageTest, ValueOverMaxValueBytesIsAPerKeyErrorAndNotSent) {
  auto s = open_redis(port(), R"("max_value_bytes": 65536)");
  const std::vector<std::string> keys = {"small", "large"};
  std::vector<std::vector<std::byte>> pages = {page_for("small", 4096), page_for("large", 65536)};
  std::vector<ConstByteSpan> spans(pages.begin(), pages.end());
  const auto r = s->batch_set(keys, spans);
  EXPECT_TRUE(r[0].is_ok()) << r[0].reason;
  ASSERT_EQ(r[1].status, IoStatus::kError);
  EXPECT_NE(r[1].reason.find("max_value_bytes 65536"), std::string::npos) << r[1].reason;
  EXPECT_NE(r[1].reason.find(std::to_string(record_head_bytes("large") + 65536)), std::string::npos)
      << r[1].reason;
  EXPECT_EQ(redis_cli(port(), {"exists", "large"}), "0\n");
  EXPECT_EQ(s->stats().set_errors, 1u);
}

TEST_F(RedisStorageTest, RemoveAndClear) {
  auto s = open_redis(port());
  put_ok(*s, {"r1", "r2", "r3"}, 4096);
  EXPECT_TRUE(s->remove("r1"));
  EXPECT_FALSE(s->remove("r1"));
  EXPECT_EQ(s->batch_exists(std::vector<std::string>{"r2", "r1"}), 1u);
  EXPECT_EQ(s->stats().removes, 1u);
  s->clear();
  EXPECT_EQ(s->batch_exists(std::vector<std::string>{"r2"}), 0u);
  EXPECT_EQ(redis_cli(port(), {"dbsize"}), "0\n");
}

// touch tells the server a chain was just used (TOUCH): the server's idle time of each stored
// key of the chain starts again, the others' goes on; absent keys are skipped. The server's LRU
// clock counts whole seconds, so the records first age for two.
TEST_F(RedisStorageTest, TouchTellsTheServerTheChainWasJustUsed) {
  auto s = open_redis(port());
  EXPECT_TRUE(s->touch_does_io());
  put_ok(*s, {"head", "mid", "tail", "other"}, 4096);
  std::this_thread::sleep_for(std::chrono::milliseconds(2100));  // the server's clock, not ours
  RawClient c(port());
  const auto idle = [&](const std::string& key) {
    const std::string reply = c.command({"OBJECT", "IDLETIME", key});
    EXPECT_EQ(reply.rfind(':', 0), 0u) << key << ": " << reply;
    return std::stoll(reply.substr(1));
  };
  for (const char* k : {"head", "mid", "tail", "other"}) ASSERT_GE(idle(k), 1) << k;
  s->touch(std::vector<std::string>{"head", "mid", "absent", "tail"});
  EXPECT_EQ(idle("head"), 0);
  EXPECT_EQ(idle("mid"), 0);
  EXPECT_EQ(idle("tail"), 0);
  EXPECT_GE(idle("other"), 1) << "a key the chain does not name was refreshed";
  EXPECT_EQ(s->stats().touched, 3u);
  EXPECT_EQ(s->stats().touch_errors, 0u);
}

TEST_F(RedisStorageTest, ConcurrentBatchesFromSeveralThreads) {
  auto s = open_redis(port(), R"("connections": 3, "io_threads": 2)");
  const std::vector<std::string> shared = make_keys("shared", 8);
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 5; ++round) {
        auto keys = make_keys(str_cat("t", t, "r", round), 6);
        keys.insert(keys.end(), shared.begin(), shared.end());
        const std::size_t bytes = 16384;
        for (const auto& r : put(*s, keys, bytes)) failures += r.is_ok() ? 0 : 1;
        std::vector<std::vector<std::byte>> pages(keys.size(), std::vector<std::byte>(bytes));
        std::vector<ByteSpan> spans(pages.begin(), pages.end());
        const auto got = s->batch_get(keys, spans);
        for (std::size_t i = 0; i < keys.size(); ++i) {
          if (!got[i].is_ok() || !holds_page_of(keys[i], pages[i])) ++failures;
        }
        if (s->batch_exists(keys) != keys.size()) ++failures;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  const auto st = s->stats();
  EXPECT_EQ(st.set_written, 4u * 5 * 6 + shared.size());
  EXPECT_EQ(st.get_hits, 4u * 5 * (6 + shared.size()));
}

// ---- faults, each on its own server ----

class RedisStorageFaults : public ::testing::Test {
 protected:
  void SetUp() override {
    if (testing::find_redis_server().empty() || testing::find_redis_cli().empty()) {
      GTEST_SKIP() << "redis-server / redis-cli are not installed";
    }
  }
  void start(std::vector<std::string> extra = {}) {
    std::string error;
    ASSERT_TRUE(server_.start(std::move(extra), &error)) << error;
  }
  testing::RedisServer server_;
};

// A fake Redis server on a loopback port of the test's. It accepts `connections` connections one
// after the other, answers each one's handshake (CONFIG GET proto-max-bulk-len), and hands what
// follows to `answer(connection, seen, fd)`, which erases from `seen` what it has answered
// (false: close this connection). join() waits for every connection to end and says how each
// did: 0 at end of file, otherwise the errno of the read that failed.
class FakeRedisServer {
 public:
  using Answer = std::function<bool(int connection, std::string& seen, int fd)>;
  FakeRedisServer(int connections, Answer answer) {
    listener_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof addr;
    if (listener_ < 0 || ::bind(listener_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
        ::listen(listener_, 4) != 0 ||
        ::getsockname(listener_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      return;  // port() stays 0
    }
    port_ = ntohs(addr.sin_port);
    thread_ = std::thread([this, connections, answer = std::move(answer)] {
      for (int conn = 0; conn < connections; ++conn) {
        const int c = ::accept(listener_, nullptr, nullptr);
        if (c < 0) return;
        endings_.push_back(serve(conn, c, answer));
        ::close(c);
      }
    });
  }
  ~FakeRedisServer() {
    join();
    if (listener_ >= 0) ::close(listener_);
  }
  int port() const { return port_; }
  std::vector<int> join() {
    if (thread_.joinable()) thread_.join();
    return endings_;
  }

 private:
  static int serve(int conn, int c, const Answer& answer) {
    std::string seen;
    std::vector<char> buf(1 << 16);
    bool configured = false;
    for (;;) {
      const ssize_t n = ::read(c, buf.data(), buf.size());
      if (n <= 0) return n == 0 ? 0 : errno;
      seen.append(buf.data(), static_cast<std::size_t>(n));
      if (!configured && seen.find("proto-max-bulk-len\r\n") != std::string::npos) {
        configured = true;
        seen.clear();
        const std::string reply = "*2\r\n$18\r\nproto-max-bulk-len\r\n$9\r\n536870912\r\n";
        if (::write(c, reply.data(), reply.size()) < 0) return errno;
      } else if (configured && !answer(conn, seen, c)) {
        return -1;
      }
    }
  }

  int listener_ = -1;
  int port_ = 0;
  std::vector<int> endings_;
  std::thread thread_;
};

// A server that answers a GET with an array header of 2^31 - 1 elements: the client refuses to
// allocate for it, fails the request with the reason, and neither crashes nor hangs; the reply
// parser's callbacks never let an exception through hiredis's C code.
TEST(RedisStorageFakeServer, AHugeArrayReplyIsRefusedWithTheReason) {
  FakeRedisServer server(1, [](int, std::string& seen, int fd) {
    if (seen.find("GET") == std::string::npos) return true;
    seen.clear();
    const std::string reply = "*2147483647\r\n";
    return ::write(fd, reply.data(), reply.size()) >= 0;
  });
  ASSERT_NE(server.port(), 0);
  {
    auto s = open_redis(server.port(),
                        R"("connections": 1, "timeout_ms": 10000, "check_at_start": false)");
    const auto t0 = Clock::now();
    const auto r = get(*s, {"k"}, 4096);
    ASSERT_EQ(r.size(), 1u);
    EXPECT_EQ(r[0].status, IoStatus::kError);
    EXPECT_NE(r[0].reason.find("array reply of 2147483647 elements"), std::string::npos)
        << r[0].reason;
    EXPECT_LT(Clock::now() - t0, 5s) << "failed at once, not at the timeout";
  }  // the store closes its connection: the fake server's read ends
  EXPECT_EQ(server.join().size(), 1u);
}

// A connection abandoned with requests in flight is reset, not closed: the kernel drops what it
// still had to send (spliced bytes of the caller's pages among them) rather than sending it after
// the caller was told the batch failed. The fake server answers the handshake and then nothing;
// the batch times out, and the server's next read must see the reset (ECONNRESET), where an
// orderly close would give it the rest of the bytes and then end of file. A connection closed
// with nothing in flight (the store destroyed) is closed in order.
TEST(RedisStorageFakeServer, AConnectionAbandonedMidBatchIsResetAndAnIdleOneClosedInOrder) {
  // The first connection answers nothing after the handshake; the second answers each EXISTS
  // with 0.
  FakeRedisServer server(2, [](int conn, std::string& seen, int fd) {
    for (std::size_t at; conn == 1 && (at = seen.find("EXISTS")) != std::string::npos;) {
      seen.erase(0, at + 6);
      if (::write(fd, ":0\r\n", 4) < 0) return false;
    }
    return true;
  });
  ASSERT_NE(server.port(), 0);
  {
    // A timeout the answered batch below keeps on a loaded machine under a sanitizer.
    auto s = open_redis(server.port(), R"("connections": 1, "timeout_ms": 1500, "check_at_start": false)");
    const auto w = put(*s, {"abandoned"}, 1 << 20);  // spliced: over zero_copy_min_bytes
    EXPECT_EQ(w[0].status, IoStatus::kError);
    EXPECT_NE(w[0].reason.find("timed out"), std::string::npos) << w[0].reason;
    // The next batch connects again (the second connection) and is answered; destroying the
    // store with nothing in flight then closes that connection in order.
    // (Were it not answered, it would time out and reset this connection too.)
    EXPECT_EQ(s->batch_exists(std::vector<std::string>{"present"}), 0u);
  }
  const std::vector<int> endings = server.join();
  ASSERT_EQ(endings.size(), 2u);
  EXPECT_EQ(endings[0], ECONNRESET) << "the abandoned connection ended with " << endings[0];
  EXPECT_EQ(endings[1], 0) << "the idle connection ended with " << endings[1];
}

TEST_F(RedisStorageFaults, UnreachableServerGivesPerKeyErrorsAndBacksOff) {
  start();
  const int port = server_.port();
  server_.stop();
  auto s = open_redis(port, R"("connections": 1, "connect_timeout_ms": 500,
                              "reconnect_backoff_ms": [20000, 40000], "check_at_start": false)");
  const auto t0 = Clock::now();
  const auto r = get(*s, {"a", "b"}, 4096);
  expect_all(r, IoStatus::kError);
  EXPECT_NE(r[0].reason.find("cannot connect"), std::string::npos) << r[0].reason;
  EXPECT_EQ(s->batch_exists(std::vector<std::string>{"a"}), 0u);  // an error counts as absent
  const auto w = put(*s, {"a"}, 4096);
  EXPECT_EQ(w[0].status, IoStatus::kError);
  EXPECT_NE(w[0].reason.find("next attempt in"), std::string::npos) << w[0].reason;
  EXPECT_LT(Clock::now() - t0, 10s) << "nobody waited out the 20 s backoff";
  EXPECT_EQ(s->stats().get_errors, 2u);
}

TEST_F(RedisStorageFaults, ServerKilledInTheMiddleOfABatch) {
  start();
  auto s = open_redis(server_.port(), R"("timeout_ms": 10000, "connections": 2)");
  const auto keys = make_keys("mid", 8);
  put_ok(*s, keys, 65536);  // connections are up
  // The server stops answering while our batch is on the wire; then it dies. The pause is in
  // force once its +OK is back (a DEBUG SLEEP sent just before could still be read after our
  // batch by a server the scheduler had not run yet, and the batch then succeeded).
  ASSERT_EQ(RawClient(server_.port()).command({"CLIENT", "PAUSE", "20000", "ALL"}), "+OK");
  std::thread killer([&] {
    std::this_thread::sleep_for(300ms);
    server_.stop();
  });
  const auto t0 = Clock::now();
  const auto r = get(*s, keys, 65536);
  const auto took = Clock::now() - t0;
  killer.join();
  expect_all(r, IoStatus::kError);
  EXPECT_NE(r[0].reason.find(str_cat(":", server_.port())), std::string::npos) << r[0].reason;
  EXPECT_LT(took, 3s);  // ended by the kill, not by the 10 s timeout
}

TEST_F(RedisStorageFaults, ServerKilledDuringALargeTransfer) {
  start();
  auto s = open_redis(server_.port(), R"("connections": 4, "timeout_ms": 30000)");
  const auto keys = make_keys("big", 24);
  put_ok(*s, keys, 1 << 20);
  std::thread killer([&] {
    std::this_thread::sleep_for(3ms);
    server_.stop();
  });
  const auto t0 = Clock::now();
  const auto r = get(*s, keys, 1 << 20);  // ok pages are checked byte for byte
  killer.join();
  EXPECT_LT(Clock::now() - t0, 10s) << "ended by the kill, not by the 30 s timeout";
  for (const auto& x : r) {
    EXPECT_NE(x.status, IoStatus::kMiss) << x.reason;
    if (!x.is_ok()) {
      EXPECT_FALSE(x.reason.empty());
    }
  }
  expect_all(get(*s, keys, 1 << 20), IoStatus::kError);  // and later batches fail cleanly
}

TEST_F(RedisStorageFaults, ClientRecoversAfterTheServerRestarts) {
  start();
  auto s = open_redis(server_.port(), R"("reconnect_backoff_ms": [10, 40])");
  put_ok(*s, {"p"}, 4096);
  server_.stop();
  expect_all(get(*s, {"p"}, 4096), IoStatus::kError);
  expect_all(get(*s, {"p"}, 4096), IoStatus::kError);
  std::string error;
  ASSERT_TRUE(server_.restart(&error)) << error;
  std::this_thread::sleep_for(60ms);                  // past the longest backoff
  expect_all(get(*s, {"p"}, 4096), IoStatus::kMiss);  // the restarted server is empty
  put_ok(*s, {"p", "q"}, 4096);
  expect_all(get(*s, {"p", "q"}, 4096), IoStatus::kOk);
}

// The connection's last write before the server went away carried a spliced payload behind a
// copied value: the reconnect's handshake must not reuse that write's layout (it sent stale
// bytes and then spun the I/O thread).
TEST_F(RedisStorageFaults, AReconnectAfterAZeroCopyWriteSendsOnlyItsOwnBytes) {
  start();
  auto s = open_redis(server_.port(),
                      R"("connections": 1, "reconnect_backoff_ms": [10, 40], "timeout_ms": 5000)");
  std::vector<std::vector<std::byte>> pages = {page_for("small", 4096), page_for("large", 1 << 20)};
  const std::vector<std::string> keys = {"small", "large"};
  const std::vector<ConstByteSpan> spans = {pages[0], pages[1]};
  for (const auto& r : s->batch_set(keys, spans)) ASSERT_TRUE(r.is_ok()) << r.reason;
  EXPECT_EQ(s->zero_copy_bytes(), 1u << 20);
  server_.stop();
  expect_all(get(*s, {"small"}, 4096), IoStatus::kError);
  std::string error;
  ASSERT_TRUE(server_.restart(&error)) << error;
  std::this_thread::sleep_for(60ms);  // past the longest backoff
  put_ok(*s, {"after"}, 4096);
  put_ok(*s, {"after-large"}, 1 << 20);
  expect_all(get(*s, {"after"}, 4096), IoStatus::kOk);
  expect_all(get(*s, {"after-large"}, 1 << 20), IoStatus::kOk);
}

TEST_F(RedisStorageFaults, SlowServerTimesOut) {
  start();
  auto s = open_redis(server_.port(), R"("timeout_ms": 200, "connections": 1)");
  put_ok(*s, {"slow"}, 4096);
  // In force once its +OK is back (see ServerKilledInTheMiddleOfABatch).
  ASSERT_EQ(RawClient(server_.port()).command({"CLIENT", "PAUSE", "1200", "ALL"}), "+OK");
  const auto t0 = Clock::now();
  const auto r = get(*s, {"slow"}, 4096);
  const auto took = Clock::now() - t0;
  ASSERT_EQ(r[0].status, IoStatus::kError);
  EXPECT_NE(r[0].reason.find("timed out"), std::string::npos) << r[0].reason;
  EXPECT_GE(took, 150ms);
  EXPECT_LT(took, 900ms);
  // Once the server is back, a later batch succeeds.
  const auto until = Clock::now() + 5s;
  IoStatus last = IoStatus::kError;
  while (Clock::now() < until && last != IoStatus::kOk) {
    std::this_thread::sleep_for(100ms);
    last = get(*s, {"slow"}, 4096)[0].status;
  }
  EXPECT_EQ(last, IoStatus::kOk);
}

TEST_F(RedisStorageFaults, ValueOverTheServerLimitIsAClearErrorAndTheStoreStaysUsable) {
  start({"--proto-max-bulk-len", "1mb"});
  auto s = open_redis(server_.port(), R"("connections": 1)");
  const auto r = put(*s, {"huge", "fine"}, 2 << 20);
  ASSERT_EQ(r[0].status, IoStatus::kError);
  EXPECT_NE(r[0].reason.find("proto-max-bulk-len of 1048576"), std::string::npos) << r[0].reason;
  EXPECT_EQ(r[1].status, IoStatus::kError);
  put_ok(*s, {"small"}, 512 << 10);
  expect_all(get(*s, {"small"}, 512 << 10), IoStatus::kOk);
  EXPECT_EQ(redis_cli(server_.port(), {"exists", "huge"}), "0\n");
}

// Without CONFIG the client cannot learn the limit: the server itself refuses the value (an
// error reply, then it closes the connection), which must still end as per-key errors.
TEST_F(RedisStorageFaults, ServerRefusingAValueUnannouncedIsAPerKeyErrorToo) {
  start({"--proto-max-bulk-len", "1mb", "--rename-command", "CONFIG", ""});
  auto s = open_redis(server_.port(), R"("connections": 1)");
  put_ok(*s, {"before"}, 4096);
  const auto r = put(*s, {"huge", "after"}, 2 << 20);
  ASSERT_EQ(r[0].status, IoStatus::kError);
  EXPECT_FALSE(r[0].reason.empty());
  EXPECT_EQ(r[1].status, IoStatus::kError) << "'after' shared the pipeline the server closed";
  // A new connection: the one the server is closing must not carry the next batch (it did
  // when the server answered 'after' with a second protocol error before it closed).
  put_ok(*s, {"small"}, 4096);
  expect_all(get(*s, {"before", "small"}, 4096), IoStatus::kOk);
}

TEST_F(RedisStorageFaults, PasswordIsSentAtConnect) {
  start({"--requirepass", "s3cret"});
  auto s = open_redis(server_.port(), R"("password": "s3cret")");
  put_ok(*s, {"locked"}, 4096);
  expect_all(get(*s, {"locked"}, 4096), IoStatus::kOk);
  // No password, or a wrong one: an error at start naming the cause...
  for (const char* extra : {"", R"("password": "nope")"}) {
    try {
      auto refused = open_redis(server_.port(), extra);
      ADD_FAILURE() << "opened with " << extra;
    } catch (const IoError& e) {
      const std::string what = e.what();
      EXPECT_TRUE(what.find("NOAUTH") != std::string::npos ||
                  what.find("AUTH refused") != std::string::npos)
          << what;
      EXPECT_EQ(what.find("nope"), std::string::npos) << "the password is printed: " << what;
    }
  }
  // ... and, opened without the check, per-key errors that say why.
  auto anonymous = open_redis(server_.port(), R"("check_at_start": false)");
  const auto r = get(*anonymous, {"locked"}, 4096);
  ASSERT_EQ(r[0].status, IoStatus::kError);
  EXPECT_NE(r[0].reason.find("NOAUTH"), std::string::npos) << r[0].reason;
  auto wrong = open_redis(server_.port(), R"("password": "nope", "check_at_start": false)");
  const auto w = get(*wrong, {"locked"}, 4096);
  ASSERT_EQ(w[0].status, IoStatus::kError);
  EXPECT_NE(w[0].reason.find("AUTH refused"), std::string::npos) << w[0].reason;
}

// An ACL user (Redis 6+), the default user off: the user and its password open the store; a
// wrong password, another user or no user is an error at start naming the cause, never
// printing the password; a username without a password is refused at parse.
TEST_F(RedisStorageFaults, AnAclUserAuthenticatesWithUsernameAndPassword) {
  start({"--user", "alice", "on", ">wonder", "~*", "&*", "+@all", "--user", "default", "off"});
  auto s = open_redis(server_.port(), R"("username": "alice", "password": "wonder")");
  put_ok(*s, {"acl"}, 4096);
  expect_all(get(*s, {"acl"}, 4096), IoStatus::kOk);
  for (const char* extra : {R"("username": "alice", "password": "nope")",
                            R"("username": "bob", "password": "wonder")", R"("password": "wonder")",
                            ""}) {
    try {
      auto refused = open_redis(server_.port(), extra);
      ADD_FAILURE() << "opened with " << extra;
    } catch (const IoError& e) {
      const std::string what = e.what();
      EXPECT_TRUE(what.find("WRONGPASS") != std::string::npos ||
                  what.find("NOAUTH") != std::string::npos)
          << extra << ": " << what;
      EXPECT_EQ(what.find("nope"), std::string::npos) << "the password is printed: " << what;
      EXPECT_EQ(what.find("wonder"), std::string::npos) << "the password is printed: " << what;
    }
  }
  try {
    RedisConfig::from_json_text(R"({"host": "127.0.0.1", "username": "alice"})");
    ADD_FAILURE() << "a username without a password was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'username' ('alice') needs a 'password'"),
              std::string::npos)
        << e.what();
  }
}

// ---- TLS ----

// Certificates made for the suite with the openssl tool: a CA, a server certificate it signs
// for 127.0.0.1 and localhost, a client certificate it signs, and a second CA nobody trusts.
struct TestPki {
  std::filesystem::path dir;
  std::string error;

  bool make() {
    const std::string openssl = bench::find_binary("openssl");
    if (openssl.empty()) {
      error = "the openssl tool is not installed";
      return false;
    }
    char tmpl[] = "/tmp/hicache-pki-XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) return false;
    dir = tmpl;
    std::ofstream(dir / "server.ext") << "subjectAltName=IP:127.0.0.1,DNS:localhost\n";
    std::ofstream(dir / "client.ext") << "extendedKeyUsage=clientAuth\n";
    const auto key = [&](const std::string& name) {
      return std::vector<std::string>{openssl, "req", "-newkey", "ec", "-pkeyopt",
                                      "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
                                      path(name + ".key")};
    };
    auto run = [&](std::vector<std::string> argv) {
      int status = 0;
      bench::run_capture(std::move(argv), &status);
      if (status != 0) error = "openssl failed making the test certificates";
      return status == 0;
    };
    for (const std::string ca : {"ca", "rogue-ca"}) {
      auto argv = key(ca);
      argv.insert(argv.end(), {"-x509", "-days", "2", "-subj", "/CN=hicache test " + ca, "-out",
                               path(ca + ".crt")});
      if (!run(argv)) return false;
    }
    for (const std::string leaf : {"server", "client"}) {
      auto argv = key(leaf);
      argv.insert(argv.end(), {"-subj", "/CN=hicache " + leaf, "-out", path(leaf + ".csr")});
      if (!run(argv)) return false;
      if (!run({openssl, "x509", "-req", "-in", path(leaf + ".csr"), "-CA", path("ca.crt"),
                "-CAkey", path("ca.key"), "-CAcreateserial", "-days", "2", "-extfile",
                path(leaf + ".ext"), "-out", path(leaf + ".crt")})) {
        return false;
      }
    }
    return true;
  }
  std::string path(const std::string& name) const { return (dir / name).string(); }
  ~TestPki() {
    std::error_code ec;
    if (!dir.empty()) std::filesystem::remove_all(dir, ec);
  }
};

// One redis-server with a plain port (for the launcher and admin) and a TLS port.
struct TlsServer {
  TestPki pki;
  testing::RedisServer server;
  int tls_port = 0;
  bool start(std::string* error) {
    if (!pki.make()) {
      *error = pki.error;
      return false;
    }
    tls_port = bench::pick_server_port();
    return server.start({"--tls-port", std::to_string(tls_port), "--tls-cert-file",
                         pki.path("server.crt"), "--tls-key-file", pki.path("server.key"),
                         "--tls-ca-cert-file", pki.path("ca.crt"), "--tls-auth-clients",
                         "optional"},
                        error);
  }
};
bool start_tls_server(TlsServer& s, std::string* error) { return s.start(error); }

class RedisTlsTest : public ServersSuite<TlsServer, start_tls_server> {
 protected:
  void SetUp() override {
    ServersSuite::SetUp();
    if (stopped()) return;
    ASSERT_EQ(RawClient(servers_->server.port()).command({"FLUSHALL"}), "+OK");
    ASSERT_EQ(redis_cli(servers_->server.port(), {"config", "set", "tls-auth-clients", "optional"}),
              "OK\n");
  }
  static const TestPki& pki() { return servers_->pki; }
  // A store on the TLS port; `tls` is the "tls" object's members.
  static std::unique_ptr<RedisStorage> open_tls(const std::string& tls,
                                                const std::string& extra = "") {
    return open_redis(servers_->tls_port,
                      str_cat(R"("connect_timeout_ms": 2000, "tls": {)", tls, "}", extra));
  }
  static std::string ca() { return str_cat(R"("ca_file": ")", pki().path("ca.crt"), R"(")"); }
  // The IoError opening a store throws, or "opened".
  template <typename Open>
  static std::string start_error(Open&& open) {
    try {
      auto s = open();
      return "opened";
    } catch (const IoError& e) {
      return e.what();
    }
  }
};

TEST_F(RedisTlsTest, RoundTripsByteForByteOverTls) {
  for (const std::string name : {"", R"(, "server_name": "localhost")"}) {
    auto s = open_tls(ca() + name);
    const auto keys = make_keys(str_cat("tls", name.size()), 40);
    put_ok(*s, keys, 256 << 10);  // over the zero-copy threshold: copied through TLS instead
    expect_all(get(*s, keys, 256 << 10), IoStatus::kOk);
    EXPECT_EQ(s->batch_exists(keys), keys.size());
    EXPECT_EQ(s->zero_copy_bytes(), 0u);
  }
}

// Connections the server drops are made again, each with a fresh TLS session: the batch in
// flight fails per key, the next ones succeed.
TEST_F(RedisTlsTest, ReconnectsAfterTheServerDropsTheConnections) {
  auto s = open_tls(ca(), R"(, "connections": 2, "reconnect_backoff_ms": [1, 10])");
  put_ok(*s, make_keys("before", 8), 64 << 10);
  for (int round = 0; round < 3; ++round) {
    ASSERT_NE(RawClient(servers_->server.port()).command({"CLIENT", "KILL", "SKIPME", "yes"}), "");
    const auto keys = make_keys(str_cat("after", round), 8);
    const auto first = put(*s, keys, 64 << 10);  // may meet a dropped connection
    if (!std::all_of(first.begin(), first.end(), [](const IoResult& r) { return r.is_ok(); })) {
      put_ok(*s, keys, 64 << 10);
    }
    expect_all(get(*s, keys, 64 << 10), IoStatus::kOk);
  }
  expect_all(get(*s, make_keys("before", 8), 64 << 10), IoStatus::kOk);
}

// A server that requires client certificates: without one the store fails at start; with the
// CA-signed one it works.
TEST_F(RedisTlsTest, PresentsAClientCertificateWhenTheServerAsks) {
  ASSERT_EQ(redis_cli(servers_->server.port(), {"config", "set", "tls-auth-clients", "yes"}),
            "OK\n");
  const std::string refused = start_error([&] { return open_tls(ca()); });
  EXPECT_NE(refused.find(str_cat("127.0.0.1:", servers_->tls_port)), std::string::npos) << refused;
  EXPECT_NE(refused.find("certificate required"), std::string::npos) << refused;
  auto s = open_tls(str_cat(ca(), R"(, "cert_file": ")", pki().path("client.crt"),
                            R"(", "key_file": ")", pki().path("client.key"), R"(")"));
  put_ok(*s, {"mutual"}, 4096);
  expect_all(get(*s, {"mutual"}, 4096), IoStatus::kOk);
}

// Each misconfiguration is one error at start that names the node and the cause.
TEST_F(RedisTlsTest, EachMisconfigurationIsOneClearErrorAtStart) {
  const std::string node = str_cat("127.0.0.1:", servers_->tls_port);
  const std::string untrusted = start_error(
      [&] { return open_tls(str_cat(R"("ca_file": ")", pki().path("rogue-ca.crt"), R"(")")); });
  EXPECT_NE(untrusted.find(node), std::string::npos) << untrusted;
  EXPECT_NE(untrusted.find("certificate was refused"), std::string::npos) << untrusted;
  // The server sends its CA along (OpenSSL's auto-chain), or only its own certificate.
  EXPECT_TRUE(untrusted.find("certificate in certificate chain") != std::string::npos ||
              untrusted.find("unable to get local issuer certificate") != std::string::npos)
      << untrusted;
  const std::string wrong_name =
      start_error([&] { return open_tls(ca() + R"(, "server_name": "redis.example.com")"); });
  EXPECT_NE(wrong_name.find("hostname mismatch"), std::string::npos) << wrong_name;
  // Plain text to the TLS port, and TLS to the plain port.
  const std::string plain = start_error([&] { return open_redis(servers_->tls_port); });
  EXPECT_NE(plain.find(node), std::string::npos) << plain;
  EXPECT_NE(plain.find("a TLS port? set \"tls\""), std::string::npos) << plain;
  const std::string tls_to_plain = start_error([&] {
    return open_redis(servers_->server.port(), str_cat(R"("tls": {)", ca(), "}"));
  });
  EXPECT_NE(tls_to_plain.find("TLS handshake failed"), std::string::npos) << tls_to_plain;
  EXPECT_NE(tls_to_plain.find("does the server speak TLS"), std::string::npos) << tls_to_plain;
  // Without verification the rogue CA is accepted (testing setups only).
  auto unverified = open_tls(R"("verify": false)");
  put_ok(*unverified, {"unverified"}, 4096);
}

TEST(RedisTlsConfig, BadSettingsAndFilesAreNamed) {
  auto message = [](const std::string& json) -> std::string {
    try {
      auto s = make_storage(json);
    } catch (const InvalidArgument& e) {
      return e.what();
    }
    return "no error";
  };
  EXPECT_NE(message(R"({"backend": "redis", "tls": true})").find("'tls' must be an object"),
            std::string::npos);
  EXPECT_NE(message(R"({"backend": "redis", "tls": {"ca": "x"}})").find("unknown key 'ca'"),
            std::string::npos);
  EXPECT_NE(message(R"({"backend": "redis", "tls": {"cert_file": "c.pem"}})").find("go together"),
            std::string::npos);
  EXPECT_NE(message(R"({"backend": "redis", "tls": {"key_file": "k.pem"}})").find("only key_file"),
            std::string::npos);
  EXPECT_NE(message(R"({"backend": "redis", "tls": {"verify": "no"}})")
                .find(R"('verify' has a value of the wrong type: "no")"),
            std::string::npos);
  EXPECT_NE(message(R"({"backend": "redis", "tls": {"server_name": 5}})")
                .find("'server_name' has a value of the wrong type: 5"),
            std::string::npos);
  const std::string missing = message(
      R"({"backend": "redis", "check_at_start": false, "tls": {"ca_file": "/nonexistent/ca.pem"}})");
  EXPECT_NE(missing.find("tls ca_file '/nonexistent/ca.pem'"), std::string::npos) << missing;
  const auto c = RedisConfig::from_json_text(
      R"({"tls": {"ca_file": "a.pem", "server_name": "r.local", "verify": false}})");
  EXPECT_TRUE(c.tls.enabled);
  EXPECT_EQ(c.tls.ca_file, "a.pem");
  EXPECT_EQ(c.tls.server_name, "r.local");
  EXPECT_FALSE(c.tls.verify);
  EXPECT_FALSE(RedisConfig::from_json_text("{}").tls.enabled);
}

// ---- a 3-node cluster ----

class RedisClusterTest : public ServersSuite<testing::RedisCluster, start_cluster> {
 protected:
  static inline testing::RedisCluster*& cluster_ = servers_;
  void SetUp() override {
    ServersSuite::SetUp();
    if (stopped()) return;
    for (int p : cluster_->ports()) ASSERT_EQ(RawClient(p).command({"FLUSHALL"}), "+OK");
  }
  static std::unique_ptr<RedisStorage> open_cluster(std::vector<int> seeds) {
    std::string nodes;
    for (int p : seeds) nodes += str_cat(nodes.empty() ? "" : ", ", "\"127.0.0.1:", p, "\"");
    return std::make_unique<RedisStorage>(RedisConfig::from_json_text(str_cat(
        R"({"backend": "redis", "cluster": true, "connections": 2, "nodes": [)", nodes, "]}")));
  }
  static int owner_port(const std::string& key) {
    // The node that does not answer MOVED serves the key's slot.
    for (int p : cluster_->ports()) {
      if (RawClient(p).command({"GET", key}).rfind("-MOVED", 0) != 0) return p;
    }
    return 0;
  }
  static std::string node_id(int port) {
    std::string id = redis_cli(port, {"cluster", "myid"});
    while (!id.empty() && (id.back() == '\n' || id.back() == '\r')) id.pop_back();
    return id;
  }

};

TEST_F(RedisClusterTest, TwoProcessesSeeEachOthersRecords) {
  expect_two_processes_see_each_others_records([] { return open_cluster(cluster_->ports()); });
}

// A chain's keys live in many slots: each TOUCH goes to its key's node.
TEST_F(RedisClusterTest, TouchReachesEveryKeysNode) {
  auto s = open_cluster(cluster_->ports());
  std::vector<std::string> keys;
  for (int i = 0; i < 24; ++i) keys.push_back(str_cat("chain-", i));
  put_ok(*s, keys, 1024);
  s->touch(keys);
  EXPECT_EQ(s->stats().touched, keys.size());
  EXPECT_EQ(s->stats().touch_errors, 0u);
  std::set<int> nodes;
  for (const auto& k : keys) nodes.insert(owner_port(k));
  EXPECT_GT(nodes.size(), 1u) << "the chain lives on one node: the test shows nothing";
}

TEST_F(RedisClusterTest, KeySlotsMatchTheServer) {
  for (const std::string key : {"foo", "page-0", "ns.p64.tp0of1-abcdef", "{tag}x"}) {
    EXPECT_EQ(redis_cli(cluster_->ports()[0], {"cluster", "keyslot", key}),
              str_cat(redis::key_slot(key), "\n"))
        << key;
  }
}

TEST_F(RedisClusterTest, RoundTripSpreadsKeysOverTheNodes) {
  auto s = open_cluster(cluster_->ports());
  // A cluster gets at least two I/O threads by default; the nodes' connections spread over them.
  const auto cpus = static_cast<int>(std::thread::hardware_concurrency());
  EXPECT_EQ(s->config().io_threads, std::clamp(cpus / 4, 2, 4));
  const auto keys = make_keys("cl", 60);
  put_ok(*s, keys, 16384);
  expect_all(get(*s, keys, 16384), IoStatus::kOk);
  EXPECT_EQ(s->batch_exists(keys), keys.size());
  for (int p : cluster_->ports()) {
    EXPECT_GT(std::stoi(redis_cli(p, {"dbsize"})), 5) << "node " << p << " holds too few keys";
  }
  EXPECT_TRUE(s->remove(keys[0]));
  EXPECT_EQ(s->batch_exists(keys), 0u);
  s->clear();
  for (int p : cluster_->ports()) EXPECT_EQ(redis_cli(p, {"dbsize"}), "0\n");
}

TEST_F(RedisClusterTest, StartsFromOneSeedAndRemovesBadRecordsOnTheirNode) {
  auto s = open_cluster({cluster_->ports()[2]});
  const auto keys = make_keys("seed", 20);
  put_ok(*s, keys, 4096);
  expect_all(get(*s, keys, 4096), IoStatus::kOk);
  const int owner = owner_port("seed-3");
  ASSERT_NE(owner, 0);
  raw_set(owner, "seed-3", "junk");
  const auto r = get(*s, {"seed-3"}, 4096);
  EXPECT_EQ(r[0].status, IoStatus::kMiss);
  EXPECT_EQ(redis_cli(owner, {"exists", "seed-3"}), "0\n");
  EXPECT_EQ(s->stats().bad_records, 1u);
}

// Moves one key's slot from its owner to another node by hand, as a resharding does: while the
// slot migrates the client must follow ASK, afterwards MOVED.
TEST_F(RedisClusterTest, FollowsAskAndMovedWhileASlotMigrates) {
  auto s = open_cluster(cluster_->ports());
  const std::string key = "migrating-key";
  const std::string slot = std::to_string(redis::key_slot(key));
  const int from = owner_port(key);
  ASSERT_NE(from, 0);
  int to = 0;
  for (int p : cluster_->ports()) to = (p != from && to == 0) ? p : to;
  const std::string from_id = node_id(from), to_id = node_id(to);
  ASSERT_EQ(redis_cli(to, {"cluster", "setslot", slot, "importing", from_id}), "OK\n");
  ASSERT_EQ(redis_cli(from, {"cluster", "setslot", slot, "migrating", to_id}), "OK\n");

  // Absent on the source: ASK to the target, for EXISTS, SET and GET alike.
  put_ok(*s, {key}, 8192);
  {
    RawClient target(to);  // stored on the target, visible there only after ASKING
    EXPECT_EQ(target.command({"EXISTS", key}).rfind("-MOVED", 0), 0u);
    EXPECT_EQ(target.command({"ASKING"}), "+OK");
    EXPECT_EQ(target.command({"EXISTS", key}), ":1");
  }
  expect_all(get(*s, {key}, 8192), IoStatus::kOk);
  EXPECT_EQ(s->batch_exists(std::vector<std::string>{key}), 1u);

  // The migration ends: every node learns the new owner; the client's map is stale -> MOVED.
  for (int p : cluster_->ports()) {
    ASSERT_EQ(redis_cli(p, {"cluster", "setslot", slot, "node", to_id}), "OK\n") << p;
  }
  EXPECT_EQ(redis_cli(to, {"exists", key}), "1\n");
  expect_all(get(*s, {key}, 8192), IoStatus::kOk);
  put_ok(*s, {key, "other-key"}, 8192);
  EXPECT_EQ(s->stats().set_written, 2u);
  EXPECT_EQ(s->stats().set_deduplicated, 1u);
  // Give the slot back so the cluster is as it was.
  ASSERT_EQ(RawClient(to).command({"DEL", key}), ":1");
  for (int p : cluster_->ports()) redis_cli(p, {"cluster", "setslot", slot, "node", from_id});
}

// ---- 3 masters with a replica each (cluster-node-timeout 1 s) ----

class RedisReplicatedClusterTest
    : public ServersSuite<testing::RedisCluster, start_replicated_cluster> {
 protected:
  static constexpr int kNodeTimeoutMs = kReplicatedNodeTimeoutMs;
  static inline testing::RedisCluster*& cluster_ = servers_;
  void SetUp() override {
    ServersSuite::SetUp();
    if (stopped()) return;
    std::string error;
    ASSERT_TRUE(cluster_->wait_healthy(30, &error)) << error;
    ASSERT_EQ(cluster_->masters().size(), 3u);
    for (int p : cluster_->masters()) ASSERT_EQ(RawClient(p).command({"FLUSHALL"}), "+OK");
    wait_replicated();
    // A node lists a replica in CLUSTER SLOTS once gossip says it replicates: until then a
    // client finds none to read from.
    const auto until = Clock::now() + 10s;
    for (bool listed = false; !listed; std::this_thread::sleep_for(20ms)) {
      ASSERT_LT(Clock::now(), until) << "CLUSTER SLOTS does not list every replica";
      listed = true;
      for (int node : cluster_->ports()) {
        const std::string slots = redis_cli(node, {"cluster", "slots"});
        for (int p : cluster_->replicas()) {
          listed = listed && slots.find(str_cat("\n", p, "\n")) != std::string::npos;
        }
      }
    }
  }
  static std::unique_ptr<RedisStorage> open_cluster(const std::string& extra = "") {
    std::string nodes;
    for (int p : cluster_->ports()) {
      nodes += str_cat(nodes.empty() ? "" : ", ", "\"127.0.0.1:", p, "\"");
    }
    return std::make_unique<RedisStorage>(RedisConfig::from_json_text(
        str_cat(R"({"backend": "redis", "cluster": true, "connections": 2, "timeout_ms": 2000,
                    "connect_timeout_ms": 300, "reconnect_backoff_ms": [20, 200], "nodes": [)",
                nodes, "]", extra, "}")));
  }
  static long long info_field(const std::string& info, const std::string& field) {
    const auto at = info.find(field + ":");
    return at == std::string::npos ? -1 : std::atoll(info.c_str() + at + field.size() + 1);
  }
  // Until every replica has applied its master's whole replication stream.
  static void wait_replicated() {
    const auto until = Clock::now() + 10s;
    for (bool done = false; !done;) {
      ASSERT_LT(Clock::now(), until) << "replicas did not catch up";
      done = true;
      for (int p : cluster_->replicas()) {
        const std::string info = RawClient(p).command({"INFO", "replication"});
        const auto link = info.find("master_link_status:up");
        done = done && link != std::string::npos &&
               info_field(info, "slave_repl_offset") == info_field(info, "master_repl_offset");
        const int master = static_cast<int>(info_field(info, "master_port"));
        const std::string minfo = RawClient(master).command({"INFO", "replication"});
        done = done && info_field(minfo, "master_repl_offset") ==
                           info_field(info, "slave_repl_offset");
      }
      if (!done) std::this_thread::sleep_for(10ms);
    }
  }
  static long long gets_served(int port) {
    const std::string stats = RawClient(port).command({"INFO", "commandstats"});
    const auto at = stats.find("cmdstat_get:calls=");  // absent: never called
    return at == std::string::npos ? 0 : std::atoll(stats.c_str() + at + 18);
  }
  static long long total_gets(const std::vector<int>& ports) {
    long long total = 0;
    for (int p : ports) total += gets_served(p);
    return total;
  }

};

// "read_from_replicas": GETs and EXISTS are answered by the replicas, writes by the masters;
// without it the masters answer everything.
TEST_F(RedisReplicatedClusterTest, ReadsGoToReplicasOnlyWhenAllowed) {
  const auto keys = make_keys("rr", 60);
  for (const bool replicas : {true, false}) {
    SCOPED_TRACE(replicas ? "read_from_replicas" : "masters only");
    auto s = open_cluster(replicas ? R"(, "read_from_replicas": true)" : "");
    put_ok(*s, keys, 4096);
    wait_replicated();
    for (int p : cluster_->ports()) ASSERT_EQ(RawClient(p).command({"CONFIG", "RESETSTAT"}), "+OK");
    expect_all(get(*s, keys, 4096), IoStatus::kOk);
    EXPECT_EQ(s->batch_exists(keys), keys.size());
    const long long on_replicas = total_gets(cluster_->replicas());
    const long long on_masters = total_gets(cluster_->masters());
    EXPECT_EQ(on_replicas, replicas ? 60 : 0);
    EXPECT_EQ(on_masters, replicas ? 0 : 60);
    if (replicas) {
      for (int p : cluster_->replicas()) EXPECT_GT(gets_served(p), 5) << "replica " << p;
    }
    // A bad record read from a replica is removed on its master (the replica follows).
    const std::string key = keys[7];
    int owner = 0;
    for (int p : cluster_->masters()) {
      if (RawClient(p).command({"GET", key}).rfind("-MOVED", 0) != 0) owner = p;
    }
    ASSERT_NE(owner, 0);
    raw_set(owner, key, "junk");
    wait_replicated();
    const auto bad = get(*s, {key}, 4096);
    EXPECT_EQ(bad[0].status, IoStatus::kMiss) << bad[0].reason;
    EXPECT_EQ(redis_cli(owner, {"exists", key}), "0\n");
    EXPECT_EQ(s->stats().bad_records, 1u);
    for (int p : cluster_->masters()) ASSERT_EQ(RawClient(p).command({"FLUSHALL"}), "+OK");
    wait_replicated();
  }
}

// A replica that goes down: its reads go to its master at once, without waiting for the cluster
// to mark it failed; back up, it serves reads again.
TEST_F(RedisReplicatedClusterTest, AReplicaDownSendsItsReadsToItsMaster) {
  auto s = open_cluster(R"(, "read_from_replicas": true)");
  const auto keys = make_keys("rd", 60);
  put_ok(*s, keys, 4096);
  wait_replicated();
  expect_all(get(*s, keys, 4096), IoStatus::kOk);
  const int replica = cluster_->replicas()[0];
  testing::RedisServer* down = cluster_->server_on(replica);
  ASSERT_NE(down, nullptr);
  down->stop();
  const auto start = Clock::now();
  expect_all(get(*s, keys, 4096), IoStatus::kOk);
  EXPECT_EQ(s->batch_exists(keys), keys.size());
  EXPECT_LT(Clock::now() - start, std::chrono::milliseconds(kNodeTimeoutMs))
      << "the reads waited for the cluster to mark the replica failed";
  std::string error;
  ASSERT_TRUE(down->restart(&error)) << error;
  ASSERT_TRUE(cluster_->wait_healthy(30, &error)) << error;
}

// A master killed in the middle of backups and prefetches: its replica is promoted, the client
// follows within the node timeout plus a few seconds, nothing wrong is served meanwhile, and
// every key replicated before the kill reads back. The killed server then comes back as a
// replica (the stress tool's redis_failover fault).
TEST_F(RedisReplicatedClusterTest, FollowsAFailoverUnderTraffic) {
  constexpr std::size_t kBytes = 16384;
  auto s = open_cluster();
  const auto before = make_keys("pre", 120);
  put_ok(*s, before, kBytes);
  wait_replicated();
  int victim = 0;
  for (int p : cluster_->masters()) {
    if (RawClient(p).command({"GET", before[0]}).rfind("-MOVED", 0) != 0) victim = p;
  }
  ASSERT_NE(victim, 0);

  std::atomic<bool> stop{false};
  std::atomic<std::int64_t> killed_at_ns{0}, recovered_at_ns{0};
  std::atomic<int> batches{0}, failed_batches{0};
  std::mutex written_mu;
  std::vector<std::string> written;  // acknowledged by batch_set
  std::thread traffic([&] {
    for (int n = 0; !stop.load(); ++n) {
      // A batch counts towards the recovery only when it started after the kill (one in flight
      // then may have had its answers already).
      const auto started = Clock::now().time_since_epoch().count();
      const auto live = make_keys(str_cat("live", n), 8);
      const auto set = put(*s, live, kBytes);
      std::vector<std::string> reads;
      for (int i = 0; i < 16; ++i) reads.push_back(before[(n * 16 + i) % before.size()]);
      const auto got = get(*s, reads, kBytes);  // every ok page is checked byte for byte
      bool all_ok = true;
      for (std::size_t i = 0; i < live.size(); ++i) {
        if (set[i].is_ok()) {
          std::lock_guard lock(written_mu);
          written.push_back(live[i]);
        }
        all_ok = all_ok && set[i].is_ok();
      }
      for (const auto& r : got) all_ok = all_ok && r.is_ok();
      ++batches;
      if (!all_ok) ++failed_batches;
      if (all_ok && killed_at_ns.load() != 0 && recovered_at_ns.load() == 0 &&
          started > killed_at_ns.load()) {
        recovered_at_ns = Clock::now().time_since_epoch().count();
      }
    }
  });
  std::this_thread::sleep_for(300ms);
  const int before_kill = batches.load();
  ASSERT_GT(before_kill, 0);
  EXPECT_EQ(failed_batches.load(), 0) << "batches failed before any fault";
  testing::RedisServer* dead = cluster_->server_on(victim);
  ASSERT_NE(dead, nullptr);
  dead->stop();
  killed_at_ns = Clock::now().time_since_epoch().count();
  const auto deadline = Clock::now() + std::chrono::milliseconds(kNodeTimeoutMs) + 8s;
  while (recovered_at_ns.load() == 0 && Clock::now() < deadline) std::this_thread::sleep_for(20ms);
  std::this_thread::sleep_for(500ms);  // traffic after the recovery
  stop = true;
  traffic.join();
  ASSERT_NE(recovered_at_ns.load(), 0) << "no batch succeeded within the node timeout + 8 s";
  const double recovery_s = static_cast<double>(recovered_at_ns - killed_at_ns) / 1e9;
  RecordProperty("recovery_seconds", std::to_string(recovery_s));
  std::printf("[failover] recovered %.2f s after the kill; %d batches, %d failed\n", recovery_s,
              batches.load(), failed_batches.load());
  EXPECT_GT(failed_batches.load(), 0) << "the kill went unnoticed: not a failover test";
  EXPECT_GT(s->stats().topology_refreshes, 1u);

  // Everything replicated before the kill is on the promoted replica.
  expect_all(get(*s, before, kBytes), IoStatus::kOk);
  // What was acknowledged during the run is there, or (written to the dead master and not yet
  // replicated) a miss; never an error now, never wrong bytes (get() checks them).
  std::size_t hits = 0;
  for (std::size_t at = 0; at < written.size(); at += 64) {
    const std::vector<std::string> chunk(written.begin() + static_cast<std::ptrdiff_t>(at),
                                         written.begin() + static_cast<std::ptrdiff_t>(
                                                               std::min(at + 64, written.size())));
    for (const auto& r : get(*s, chunk, kBytes)) {
      EXPECT_TRUE(r.is_ok() || r.status == IoStatus::kMiss) << r.reason;
      hits += r.is_ok() ? 1 : 0;
    }
  }
  EXPECT_GT(hits, written.size() / 2);
  // New writes and reads work everywhere.
  const auto after = make_keys("after", 60);
  put_ok(*s, after, kBytes);
  expect_all(get(*s, after, kBytes), IoStatus::kOk);

  // The dead master comes back as a replica of the one promoted in its place (once the
  // promotion happened: back before it, it would still own its slots, empty).
  const auto promoted_by = Clock::now() + 30s;
  while (cluster_->masters().size() < 3 && Clock::now() < promoted_by) {
    std::this_thread::sleep_for(20ms);
  }
  ASSERT_EQ(cluster_->masters().size(), 3u) << "no replica was promoted";
  std::string error;
  ASSERT_TRUE(dead->restart(&error)) << error;
  ASSERT_TRUE(cluster_->wait_healthy(30, &error)) << error;
  const auto replicas = cluster_->replicas();
  EXPECT_NE(std::find(replicas.begin(), replicas.end(), victim), replicas.end())
      << "the restarted server is not a replica";
  expect_all(get(*s, after, kBytes), IoStatus::kOk);
}

}  // namespace
}  // namespace hicache
