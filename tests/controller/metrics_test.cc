#include "transfer/metrics.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <sstream>
#include <thread>

#include "controller/hicache.h"
#include "controller/metrics_aliases.h"
#include "controller/metrics_server.h"
#include "storage/file_storage.h"
#include "transfer/errors.h"

namespace hicache {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

TEST(MetricsRegistry, RendersCountersGaugesAndHistogramsInTheExpositionFormat) {
  MetricsRegistry r;
  Counter c;
  Gauge g;
  Histogram h({0.001, 0.01});
  c += 41;
  ++c;
  g.set(2.5);
  h.observe(0.0005);
  h.observe(0.005);
  h.observe(7);
  r.add("hicache_test_total", "A counter", {{"tier", "host"}}, c, this);
  r.add("hicache_test_gauge", "A \"gauge\"\nwith a newline", {}, g, this);
  r.add("hicache_test_seconds", "A histogram", {{"dir", "a\"b"}}, h, this);
  EXPECT_EQ(r.prometheus_text(),
            "# HELP hicache_test_total A counter\n"
            "# TYPE hicache_test_total counter\n"
            "hicache_test_total{tier=\"host\"} 42\n"
            "# HELP hicache_test_gauge A \"gauge\"\\nwith a newline\n"
            "# TYPE hicache_test_gauge gauge\n"
            "hicache_test_gauge 2.5\n"
            "# HELP hicache_test_seconds A histogram\n"
            "# TYPE hicache_test_seconds histogram\n"
            "hicache_test_seconds_bucket{dir=\"a\\\"b\",le=\"0.001\"} 1\n"
            "hicache_test_seconds_bucket{dir=\"a\\\"b\",le=\"0.01\"} 2\n"
            "hicache_test_seconds_bucket{dir=\"a\\\"b\",le=\"+Inf\"} 3\n"
            "hicache_test_seconds_sum{dir=\"a\\\"b\"} 7.0055\n"
            "hicache_test_seconds_count{dir=\"a\\\"b\"} 3\n");
  const json j = json::parse(r.json_text());
  EXPECT_EQ(j["hicache_test_total"]["series"][0]["value"], 42);
  EXPECT_EQ(j["hicache_test_total"]["series"][0]["labels"]["tier"], "host");
  EXPECT_EQ(j["hicache_test_seconds"]["series"][0]["count"], 3);
  EXPECT_EQ(j["hicache_test_seconds"]["series"][0]["buckets"][1][1], 2);
  EXPECT_EQ(r.value("hicache_test_total", {{"tier", "host"}}), 42);
  EXPECT_EQ(r.value("hicache_test_total", {{"tier", "device"}}), -1);
}

TEST(MetricsRegistry, RefusesBadNamesDuplicatesAndConflictingFamilies) {
  MetricsRegistry r;
  Counter c;
  Gauge g;
  Histogram h;
  EXPECT_THROW(r.add("1bad", "h", {}, c, this), InvalidArgument);
  EXPECT_THROW(r.add("ok_total", "h", {{"bad-label", "x"}}, c, this), InvalidArgument);
  EXPECT_THROW(r.add("ok_seconds", "h", {{"le", "x"}}, h, this), InvalidArgument);
  r.add("ok_total", "h", {{"a", "1"}}, c, this);
  EXPECT_THROW(r.add("ok_total", "h", {{"a", "1"}}, c, this), InvalidArgument);
  EXPECT_THROW(r.add("ok_total", "h", {{"a", "2"}}, g, this), InvalidArgument);
  EXPECT_THROW(r.add("ok_total", "other help", {{"a", "2"}}, c, this), InvalidArgument);
  r.add("ok_total", "h", {{"a", "2"}}, c, this);  // same family, other labels
  EXPECT_NE(r.prometheus_text().find("ok_total{a=\"2\"} 0"), std::string::npos);
  EXPECT_THROW(Histogram({1, 1}), InvalidArgument);
}

TEST(MetricsRegistry, AScopeForgetsWhatItRegisteredWhenItGoes) {
  MetricsRegistry r;
  Counter kept;
  r.add("kept_total", "h", {}, kept, &r);
  {
    Counter c;
    MetricsScope scope;
    scope.attach(r, {{"tp_rank", "3"}});
    scope.add("gone_total", "h", {{"x", "y"}}, c);
    EXPECT_EQ(r.value("gone_total", {{"tp_rank", "3"}, {"x", "y"}}), 0);
  }
  EXPECT_EQ(r.value("gone_total", {{"tp_rank", "3"}, {"x", "y"}}), -1);
  EXPECT_EQ(r.prometheus_text().find("gone_total"), std::string::npos);
  EXPECT_NE(r.prometheus_text().find("kept_total 0"), std::string::npos);
}

// An alias series shows the sum of the series it selects under another name and labels, with
// the source series' other labels carried; it follows them (nothing is copied at registration).
TEST(MetricsRegistry, AnAliasShowsTheSeriesItSelectsUnderAnotherNameAndLabels) {
  MetricsRegistry r;
  Counter device, host, storage, other_rank;
  Gauge used;
  Histogram latency({0.01, 0.1});
  device += 3;
  host += 5;
  storage += 7;
  other_rank += 100;
  used.set(0.25);
  latency.observe(0.005);
  latency.observe(0.05);
  r.add("src_total", "h", {{"tp_rank", "0"}, {"tier", "device"}}, device, this);
  r.add("src_total", "h", {{"tp_rank", "0"}, {"tier", "host"}}, host, this);
  r.add("src_total", "h", {{"tp_rank", "0"}, {"tier", "storage"}}, storage, this);
  r.add("src_total", "h", {{"tp_rank", "1"}, {"tier", "host"}}, other_rank, this);
  r.add("src_ratio", "g", {{"tp_rank", "0"}, {"tier", "host"}}, used, this);
  r.add("src_seconds", "s", {{"tp_rank", "0"}, {"dir", "in"}}, latency, this);
  using T = MetricsRegistry::Type;
  r.add_alias("eng:hits_total", "Hits", T::kCounter, {{"mode", "device_hit"}}, "src_total",
              {{{"tier", "device"}}}, this);
  r.add_alias("eng:hits_total", "Hits", T::kCounter, {{"mode", "below"}}, "src_total",
              {{{"tier", "host"}}, {{"tier", "storage"}}}, this);
  r.add_alias("eng:usage_perc", "Usage", T::kGauge, {}, "src_ratio", {{{"tier", "host"}}}, this);
  r.add_alias("eng:seconds", "Seconds", T::kHistogram, {}, "src_seconds", {{{"dir", "in"}}}, this);
  const std::string text = r.prometheus_text();
  const std::string aliases = text.substr(text.find("# HELP eng:hits_total"));
  EXPECT_EQ(aliases,
            "# HELP eng:hits_total Hits\n"
            "# TYPE eng:hits_total counter\n"
            "eng:hits_total{tp_rank=\"0\",mode=\"device_hit\"} 3\n"
            "eng:hits_total{tp_rank=\"0\",mode=\"below\"} 12\n"
            "eng:hits_total{tp_rank=\"1\",mode=\"below\"} 100\n"
            "# HELP eng:usage_perc Usage\n"
            "# TYPE eng:usage_perc gauge\n"
            "eng:usage_perc{tp_rank=\"0\"} 0.25\n"
            "# HELP eng:seconds Seconds\n"
            "# TYPE eng:seconds histogram\n"
            "eng:seconds_bucket{tp_rank=\"0\",le=\"0.01\"} 1\n"
            "eng:seconds_bucket{tp_rank=\"0\",le=\"0.1\"} 2\n"
            "eng:seconds_bucket{tp_rank=\"0\",le=\"+Inf\"} 2\n"
            "eng:seconds_sum{tp_rank=\"0\"} 0.055\n"
            "eng:seconds_count{tp_rank=\"0\"} 2\n");
  // The source moves, the alias with it; the JSON snapshot and value() show aliases too.
  host += 1;
  EXPECT_EQ(r.value("eng:hits_total", {{"tp_rank", "0"}, {"mode", "below"}}), 13);
  EXPECT_EQ(r.value("eng:seconds", {{"tp_rank", "0"}}), 2) << "a histogram's count";
  EXPECT_EQ(r.value("eng:hits_total", {{"mode", "below"}}), -1) << "tp_rank is carried";
  const json j = json::parse(r.json_text());
  EXPECT_EQ(j["eng:hits_total"]["type"], "counter");
  EXPECT_EQ(j["eng:hits_total"]["series"][1]["value"], 13);
  EXPECT_EQ(j["eng:hits_total"]["series"][1]["labels"]["mode"], "below");
  EXPECT_EQ(j["eng:seconds"]["series"][0]["buckets"][1][1], 2);
  EXPECT_EQ(j["eng:usage_perc"]["type"], "gauge");
}

TEST(MetricsRegistry, AnAliasOfAnAbsentFamilyShowsNothingUntilItExistsAndGoesWithItsOwner) {
  MetricsRegistry r;
  using T = MetricsRegistry::Type;
  int alias_owner = 0;
  r.add_alias("eng:later_total", "h", T::kCounter, {}, "later_total", {{}}, &alias_owner);
  EXPECT_EQ(r.prometheus_text(), "") << "no family to show yet";
  EXPECT_EQ(r.json_text(), "{}");
  EXPECT_EQ(r.value("eng:later_total"), -1);
  {
    Counter c;
    c += 9;
    MetricsScope scope;
    scope.attach(r, {{"tp_rank", "2"}});
    scope.add("later_total", "h", {}, c);
    EXPECT_EQ(r.value("eng:later_total", {{"tp_rank", "2"}}), 9);
  }
  EXPECT_EQ(r.prometheus_text(), "") << "the source went with its scope";
  r.forget(&alias_owner);
  Counter again;
  r.add("later_total", "h", {}, again, this);
  EXPECT_EQ(r.prometheus_text().find("eng:later_total"), std::string::npos) << "forgotten";
}

TEST(MetricsRegistry, AliasesRefuseBadNamesClashesAndAnotherType) {
  MetricsRegistry r;
  using T = MetricsRegistry::Type;
  Counter c;
  Gauge g;
  r.add("src_total", "h", {}, c, this);
  r.add("ratio", "h", {}, g, this);
  const auto expect_error = [&](auto&& call, const std::string& naming) {
    try {
      call();
      ADD_FAILURE() << "no error; expected one naming " << naming;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(naming), std::string::npos) << e.what();
    }
  };
  expect_error([&] { r.add_alias("1bad", "h", T::kCounter, {}, "src_total", {{}}, this); }, "1bad");
  expect_error(
      [&] {
        r.add_alias("a:ok", "h", T::kCounter, {{"bad-l", "x"}}, "src_total", {{}}, this);
      },
      "bad-l");
  expect_error([&] { r.add_alias("a:ok", "h", T::kCounter, {}, "src_total", {}, this); },
               "selects no series");
  expect_error([&] { r.add_alias("src_total", "h", T::kCounter, {}, "ratio", {{}}, this); },
               "'src_total' is a family's name");
  expect_error([&] { r.add_alias("a:ok", "h", T::kCounter, {}, "ratio", {{}}, this); },
               "its source 'ratio' is a gauge");
  r.add_alias("a:ok", "h", T::kCounter, {{"k", "v"}}, "src_total", {{}}, this);
  expect_error(
      [&] {
        r.add_alias("a:ok", "h", T::kCounter, {{"k", "v"}}, "src_total", {{}}, this);
      },
      "registered already");
  expect_error([&] { r.add_alias("a:ok", "other", T::kCounter, {}, "src_total", {{}}, this); },
               "exists as a counter with help 'h'");
  expect_error([&] { r.add("a:ok", "h", {}, c, this); }, "an alias family's name");
  EXPECT_EQ(r.value("a:ok", {{"k", "v"}}), 0) << "the refusals changed nothing";
  EXPECT_EQ(r.value("a:ok", {}), -1);
}

TEST(MetricsRegistry, ScrapesWhileCountersRunAreConsistent) {
  MetricsRegistry r;
  Counter c;
  Histogram h;
  r.add("busy_total", "h", {}, c, this);
  r.add("busy_seconds", "h", {}, h, this);
  std::atomic<bool> stop{false};
  std::thread writer([&] {
    while (!stop) {
      ++c;
      h.observe(1e-5);
    }
  });
  double last = 0;
  for (int i = 0; i < 200; ++i) {
    const json j = json::parse(r.json_text());
    const double now = j["busy_total"]["series"][0]["value"].get<double>();
    EXPECT_GE(now, last);
    last = now;
    const auto& hs = j["busy_seconds"]["series"][0];
    EXPECT_EQ(hs["count"], hs["buckets"].back()[1]);
  }
  stop = true;
  writer.join();
}

// ------------------------------------------------------------------------------------------
// HiCache's registry and its /metrics endpoint.

struct Http {
  int status = 0;
  std::string head, body;
};

Http http(int port, const std::string& method, const std::string& path) {
  Http out;
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    return out;
  }
  const std::string req =
      str_cat(method, " ", path, " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
  (void)::send(fd, req.data(), req.size(), MSG_NOSIGNAL);
  std::string all;
  char buf[65536];
  for (ssize_t n; (n = ::recv(fd, buf, sizeof buf, 0)) > 0;) all.append(buf, static_cast<std::size_t>(n));
  ::close(fd);
  const auto split = all.find("\r\n\r\n");
  if (split == std::string::npos || all.size() < 12) return out;
  out.status = std::stoi(all.substr(9, 3));
  out.head = all.substr(0, split);
  out.body = all.substr(split + 4);
  return out;
}

// A HiCache with L3 on a file store, /metrics on a free loopback port, and a few pages through
// every tier: a prompt inserted (written to the host, backed up to L3), matched again.
struct Traffic {
  fs::path root = fs::temp_directory_path() / str_cat("hicache-metrics-", ::getpid());
  std::unique_ptr<HiCache> hc;
  std::vector<std::int32_t> tokens = std::vector<std::int32_t>(64);

  Traffic() {
    fs::remove_all(root);
    hc = std::make_unique<HiCache>(HiCacheConfig::from_json_text(str_cat(
        R"({"device": "host", "page_size": 4, "device_tokens": 256,
            "model": {"layers": 2, "kv_heads": 1, "head_dim": 8}, "metrics_port": 0,
            "storage": {"backend": "file", "root": ")",
        root.string(), R"("}})")));
    std::iota(tokens.begin(), tokens.end(), 100);
    auto slots = hc->device_pool().allocator().alloc(64);
    hc->cache().insert(tokens, *slots);
    settle();
    (void)hc->cache().match_prefix(tokens);
    hc->cache().check_events();
  }
  ~Traffic() {
    hc.reset();
    fs::remove_all(root);
  }
  void settle() {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (std::chrono::steady_clock::now() < deadline) {
      const auto seen = hc->cache().event_seq();
      hc->cache().check_events();
      const auto s = hc->cache().stats();
      if (s.writes_in_flight == 0 && s.backups_in_flight == 0 && s.loads_in_flight == 0) return;
      hc->cache().wait_for_events(seen, std::chrono::steady_clock::now() + std::chrono::seconds(1));
    }
    FAIL() << "writes, backups or loads never finished";
  }
};

TEST(HiCacheMetrics, EveryComponentReportsIntoOneRegistry) {
  Traffic t;
  const MetricsRegistry& r = t.hc->metrics();
  const auto v = [&](const char* name, MetricLabels labels) {
    labels.insert(labels.begin(), {"tp_rank", "0"});
    return r.value(name, labels);
  };
  const double page_bytes = static_cast<double>(t.hc->config().geometry.page_bytes());
  EXPECT_GE(v("hicache_ops_total", {{"direction", "l1_to_l2"}, {"outcome", "ok"}}), 1);
  EXPECT_EQ(v("hicache_bytes_total", {{"direction", "l1_to_l2"}}), 16 * page_bytes);
  EXPECT_EQ(v("hicache_bytes_total", {{"direction", "l2_to_l3"}}), 16 * page_bytes);
  EXPECT_GE(v("hicache_ops_total", {{"direction", "l2_to_l3"}, {"outcome", "ok"}}), 1);
  EXPECT_EQ(v("hicache_storage_keys_total", {{"backend", "file"}, {"op", "set"}, {"result", "written"}}),
            16);
  EXPECT_EQ(v("hicache_match_tokens_total", {{"tier", "device"}}), 64);
  EXPECT_EQ(v("hicache_pool_used_tokens", {{"tier", "device"}}), 64);
  EXPECT_EQ(v("hicache_pool_capacity_tokens", {{"tier", "host"}}), 512);
  EXPECT_GE(v("hicache_op_latency_seconds", {{"direction", "l1_to_l2"}}), 1) << "histogram count";
  EXPECT_EQ(v("hicache_queue_depth", {{"queue", "write"}}), 0);
  // Misses by reason, from the tree and from the store, in one family.
  EXPECT_EQ(v("hicache_misses_total", {{"reason", "prefetch_revoked"}}), 0);
  EXPECT_EQ(v("hicache_misses_total", {{"backend", "file"}, {"reason", "corrupt_record"}}), 0);
  EXPECT_EQ(v("hicache_misses_total", {{"backend", "file"}, {"reason", "not_stored"}}), 0);
}

// A page that was cached and left the tree is a miss "evicted" the first time it is asked for
// again (a request matched at every step counts once); a page never cached is not. Bounded: the
// oldest evicted pages are forgotten (capacity: the two pools' pages, 48 here).
TEST(HiCacheMetrics, MissesOfPagesThatLeftTheTreeAreCountedAsEvicted) {
  HiCache hc(HiCacheConfig::from_json_text(
      R"({"device": "host", "page_size": 4, "device_tokens": 64, "host_tokens": 128,
          "model": {"layers": 2, "kv_heads": 1, "head_dim": 8}})"));
  HiRadixCache& cache = hc.cache();
  const auto evicted = [&] {
    return hc.metrics().value("hicache_misses_total", {{"tp_rank", "0"}, {"reason", "evicted"}});
  };
  const auto prompt = [](std::int32_t first) {
    std::vector<std::int32_t> p(32);  // 8 pages
    std::iota(p.begin(), p.end(), first);
    return p;
  };
  const auto cache_and_evict = [&](const std::vector<std::int32_t>& p) {
    auto slots = hc.device_pool().allocator().alloc(static_cast<std::int64_t>(p.size()));
    ASSERT_TRUE(slots.has_value());
    cache.insert(p, *slots);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (std::chrono::steady_clock::now() < deadline) {
      const auto seen = cache.event_seq();
      cache.check_events();
      if (cache.stats().writes_in_flight == 0) break;
      cache.wait_for_events(seen, std::chrono::steady_clock::now() + std::chrono::seconds(1));
    }
    ASSERT_EQ(cache.stats().writes_in_flight, 0);
    cache.evict_device(1 << 20);
    cache.evict_host(1 << 20);
    ASSERT_EQ(cache.cached_prefix_tokens(p), 0);
  };
  const auto a = prompt(1000);
  cache_and_evict(a);
  EXPECT_EQ(evicted(), 0);
  (void)cache.match_prefix(prompt(5000));  // never cached
  EXPECT_EQ(evicted(), 0);
  // Shares three pages with the evicted prompt, then leaves it.
  auto diverging = a;
  diverging[13] = -1;
  (void)cache.match_prefix(diverging);
  EXPECT_EQ(evicted(), 12);
  (void)cache.match_prefix(a);
  EXPECT_EQ(evicted(), 32) << "the three pages count once";
  (void)cache.match_prefix(a);
  EXPECT_EQ(evicted(), 32) << "asked again: already counted";
  // A split node (two prompts share five pages) walks through both removed parts.
  const auto b = prompt(20000);
  auto b2 = b;
  b2[20] = -7;
  auto slots = hc.device_pool().allocator().alloc(32);
  ASSERT_TRUE(slots.has_value());
  cache.insert(b2, *slots);
  cache_and_evict(b);
  const double before = evicted();
  (void)cache.match_prefix(b);
  EXPECT_EQ(evicted() - before, 32);
  (void)cache.match_prefix(b2);
  EXPECT_EQ(evicted() - before, 44) << "b2's own three pages; the shared five counted with b";
  // Five more prompts of 8 pages push the first evicted ones out of the 48-page memory.
  for (std::int32_t i = 0; i < 5; ++i) cache_and_evict(prompt(40000 + 1000 * i));
  const double later = evicted();
  (void)cache.match_prefix(a);
  EXPECT_EQ(evicted(), later) << "the oldest evicted pages are forgotten";
  // Evicted again after a re-insert: counted again.
  cache_and_evict(prompt(44000));
  (void)cache.match_prefix(prompt(44000));
  EXPECT_EQ(evicted(), later + 32);
  // reset() forgets what left the tree: node ids start again.
  cache_and_evict(prompt(43000));
  cache.reset();
  (void)cache.match_prefix(prompt(43000));
  EXPECT_EQ(evicted(), later + 32);
}

TEST(HiCacheMetrics, ServesPrometheusTextAndJsonOverLoopback) {
  Traffic t;
  const int port = t.hc->metrics_port();
  ASSERT_GT(port, 0);
  const Http text = http(port, "GET", "/metrics");
  EXPECT_EQ(text.status, 200) << text.head;
  EXPECT_NE(text.head.find("text/plain; version=0.0.4"), std::string::npos) << text.head;
  EXPECT_NE(text.body.find("# TYPE hicache_ops_total counter"), std::string::npos);
  EXPECT_NE(text.body.find("hicache_match_tokens_total{tp_rank=\"0\",tier=\"device\"} 64"),
            std::string::npos)
      << text.body;
  const Http j = http(port, "GET", "/metrics.json");
  EXPECT_EQ(j.status, 200);
  EXPECT_EQ(json::parse(j.body)["hicache_match_tokens_total"]["type"], "counter");
  EXPECT_EQ(http(port, "GET", "/nope").status, 404);
  EXPECT_EQ(http(port, "POST", "/metrics").status, 405);
  const Http head = http(port, "HEAD", "/metrics");
  EXPECT_EQ(head.status, 200);
  EXPECT_TRUE(head.body.empty());
}

TEST(HiCacheMetrics, AMetricsPortInUseOrABadAddressIsAnErrorAtConstruction) {
  Traffic t;
  const std::string base = R"({"device": "host", "page_size": 4, "device_tokens": 64,
      "model": {"layers": 2, "kv_heads": 1, "head_dim": 8}, )";
  try {
    HiCache second(HiCacheConfig::from_json_text(
        str_cat(base, R"("metrics_port": )", t.hc->metrics_port(), "}")));
    ADD_FAILURE() << "bound a port in use";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(str_cat("127.0.0.1:", t.hc->metrics_port())),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(HiCache(HiCacheConfig::from_json_text(
                   str_cat(base, R"("metrics_port": 0, "metrics_bind": "localhost:x"})"))),
               InvalidArgument);
  EXPECT_EQ(http(t.hc->metrics_port(), "GET", "/metrics").status, 200) << "first still serves";
}

TEST(HiCacheMetrics, MetricsOffRegistersNothingAndServesNothing) {
  const std::string base = R"({"device": "host", "page_size": 4, "device_tokens": 64,
      "model": {"layers": 2, "kv_heads": 1, "head_dim": 8}, "metrics": false)";
  HiCache hc(HiCacheConfig::from_json_text(base + "}"));
  EXPECT_EQ(hc.metrics().prometheus_text(), "");
  EXPECT_EQ(hc.metrics_port(), -1);
  try {
    HiCache refused(HiCacheConfig::from_json_text(base + R"(, "metrics_port": 0})"));
    ADD_FAILURE() << "a metrics server without metrics";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("metrics is false"), std::string::npos) << e.what();
  }
}

// A store shared with the engine outlives the cache whose registry it reported into: the cache
// takes the store's series with it (the store's destructor hung on the dead registry's mutex).
TEST(HiCacheMetrics, ASharedStoreOutlivesTheCacheThatRegisteredIt) {
  const fs::path root = fs::temp_directory_path() / str_cat("hicache-shared-", ::getpid());
  fs::remove_all(root);
  auto store = std::make_shared<FileStorage>(FileStorageConfig{.root = root.string()});
  for (int i = 0; i < 2; ++i) {
    HiCacheParts parts;
    parts.storage = store;
    HiCache hc(HiCacheConfig::from_json_text(R"({"device": "host", "page_size": 4,
        "device_tokens": 64, "model": {"layers": 2, "kv_heads": 1, "head_dim": 8}})"),
               std::move(parts));
    EXPECT_NE(hc.metrics().prometheus_text().find("backend=\"file\""), std::string::npos);
  }
  store.reset();
  fs::remove_all(root);
}

// Runs `argv` and returns its exit status and output (stdout and stderr).
int run_command(const std::vector<std::string>& argv, const std::string& input,
                std::string& output) {
  char in_path[] = "/tmp/hicache-metrics-in-XXXXXX";
  char out_path[] = "/tmp/hicache-metrics-out-XXXXXX";
  const int in_fd = ::mkstemp(in_path), out_fd = ::mkstemp(out_path);
  (void)!::write(in_fd, input.data(), input.size());
  ::lseek(in_fd, 0, SEEK_SET);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(in_fd, 0);
    ::dup2(out_fd, 1);
    ::dup2(out_fd, 2);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execvp(args[0], args.data());
    std::_Exit(127);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  std::ifstream f(out_path);
  output.assign(std::istreambuf_iterator<char>(f), {});
  ::close(in_fd);
  ::close(out_fd);
  ::unlink(in_path);
  ::unlink(out_path);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128;
}

bool have(const char* program) {
  std::string out;
  return run_command({"sh", "-c", str_cat("command -v ", program)}, "", out) == 0;
}

TEST(HiCacheMetrics, TheEndpointPassesPromtool) {
  if (!have("promtool")) GTEST_SKIP() << "promtool not installed (Debian package prometheus)";
  Traffic t;
  const Http text = http(t.hc->metrics_port(), "GET", "/metrics");
  ASSERT_EQ(text.status, 200);
  std::string out;
  const int status = run_command({"promtool", "check", "metrics"}, text.body, out);
  // promtool's linter names what it dislikes; a clean exposition prints nothing. It reserves
  // ':' for recording rules, so the engine aliases (SGLang's, vLLM's and LMCache's own names,
  // which those engines publish as they are) are the one thing it may name, with status 3
  // (lint problems only; 1 would be an exposition it cannot parse).
  std::string rest;
  std::istringstream lines(out);
  for (std::string line; std::getline(lines, line);) {
    const bool alias_colon =
        std::any_of(engine_metric_aliases().begin(), engine_metric_aliases().end(),
                    [&](const EngineMetricAlias& a) {
                      return line == a.name + " metric names should not contain ':'";
                    });
    if (!alias_colon && !line.empty()) rest += line + "\n";
  }
  EXPECT_TRUE(status == 0 || (status == 3 && !out.empty())) << status << " " << out;
  EXPECT_EQ(rest, "") << out;
}

// A real Prometheus server scrapes the endpoint; what its query API returns for the match
// counter is what the JSON snapshot says (the cache is idle meanwhile, so the value holds).
TEST(HiCacheMetrics, ARealPrometheusScrapeAgreesWithTheJsonSnapshot) {
  if (!have("prometheus")) GTEST_SKIP() << "prometheus not installed (Debian package prometheus)";
  Traffic t;
  const fs::path dir = t.root.string() + "-prometheus";
  fs::remove_all(dir);
  fs::create_directories(dir);
  // A free port for Prometheus's own HTTP API.
  MetricsRegistry empty;
  int api_port = 0;
  {
    MetricsServer probe(empty, "127.0.0.1", 0);
    api_port = probe.port();
  }
  std::ofstream(dir / "prometheus.yml")
      << "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n"
      << "  - job_name: hicache\n    static_configs:\n      - targets: ['127.0.0.1:"
      << t.hc->metrics_port() << "']\n";
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    const int devnull = ::open("/dev/null", O_WRONLY);
    ::dup2(devnull, 1);
    ::dup2(devnull, 2);
    const std::string config = "--config.file=" + (dir / "prometheus.yml").string();
    const std::string data = "--storage.tsdb.path=" + (dir / "data").string();
    const std::string listen = str_cat("--web.listen-address=127.0.0.1:", api_port);
    ::execlp("prometheus", "prometheus", config.c_str(), data.c_str(), listen.c_str(),
             static_cast<char*>(nullptr));
    std::_Exit(127);
  }
  const json snapshot = json::parse(t.hc->metrics().json_text());
  double expected = -1;
  for (const auto& s : snapshot["hicache_match_tokens_total"]["series"]) {
    if (s["labels"]["tier"] == "device") expected = s["value"].get<double>();
  }
  ASSERT_EQ(expected, 64);
  // Prometheus needs a moment to start and scrape; bounded by a deadline, not a sleep count.
  double scraped = -1;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (scraped < 0 && std::chrono::steady_clock::now() < deadline) {
    const Http q = http(api_port, "GET",
                        "/api/v1/query?query=hicache_match_tokens_total%7Btier%3D%22device%22%7D");
    if (q.status == 200) {
      const json r = json::parse(q.body, nullptr, false);
      if (!r.is_discarded() && !r["data"]["result"].empty()) {
        scraped = std::stod(r["data"]["result"][0]["value"][1].get<std::string>());
        EXPECT_EQ(r["data"]["result"][0]["metric"]["job"], "hicache");
        break;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // waiting on another process
  }
  ::kill(pid, SIGTERM);
  int status = 0;
  ::waitpid(pid, &status, 0);
  fs::remove_all(dir);
  EXPECT_EQ(scraped, expected) << "Prometheus scraped nothing within 60 s";
  EXPECT_GE(t.hc->metrics().value("hicache_ops_total", {{"tp_rank", "0"},
                                                        {"direction", "l1_to_l2"},
                                                        {"outcome", "ok"}}),
            1);
}

// ------------------------------------------------------------------------------------------
// Engine metric aliases (controller/metrics_aliases.h, docs/metrics.md).

// The expected value of an alias series, computed from the JSON snapshot of its hicache source:
// the sum over the source series that include one of the selects, carrying tp_rank 0.
struct Expected {
  bool found = false;
  double value = 0, sum = 0;  // a histogram's count and sum
};

Expected expected_from_source(const json& snapshot, const EngineMetricAlias& a) {
  Expected out;
  if (!snapshot.contains(a.source)) return out;
  for (const auto& s : snapshot[a.source]["series"]) {
    const auto matches = [&](const MetricLabels& select) {
      for (const auto& [k, v] : select) {
        if (!s["labels"].contains(k) || s["labels"][k] != v) return false;
      }
      return true;
    };
    if (s["labels"]["tp_rank"] != "0" ||
        std::none_of(a.selects.begin(), a.selects.end(), matches)) {
      continue;
    }
    out.found = true;
    if (s.contains("count")) {
      out.value += s["count"].get<double>();
      out.sum += s["sum"].get<double>();
    } else {
      out.value += s["value"].get<double>();
    }
  }
  return out;
}

MetricLabels rank0(const EngineMetricAlias& a) {
  MetricLabels labels = {{"tp_rank", "0"}, {"model_name", "model"}};
  labels.insert(labels.end(), a.labels.begin(), a.labels.end());
  return labels;
}

// Every alias renders in the text exposition with its engine's type, and shows the sum of its
// hicache source series (each alias's source exists in a cache with L3).
TEST(HiCacheMetrics, EveryEngineAliasRendersWithItsTypeAndItsSourcesValue) {
  Traffic t;
  t.hc->cache().record_prefill(8, 4, 2, 6);
  const MetricsRegistry& r = t.hc->metrics();
  const json snapshot = json::parse(r.json_text());
  const std::string text = r.prometheus_text();
  ASSERT_GE(engine_metric_aliases().size(), 40u);
  for (const EngineMetricAlias& a : engine_metric_aliases()) {
    SCOPED_TRACE(alias_series_name(a));
    const char* type = a.type == MetricsRegistry::Type::kCounter ? "counter"
                       : a.type == MetricsRegistry::Type::kGauge ? "gauge"
                                                                 : "histogram";
    EXPECT_NE(text.find(str_cat("# TYPE ", a.name, " ", type, "\n")), std::string::npos);
    const Expected e = expected_from_source(snapshot, a);
    ASSERT_TRUE(e.found) << "no series of " << a.source;
    EXPECT_EQ(r.value(a.name, rank0(a)), e.value);
    const auto& series = snapshot[a.name]["series"];
    const auto it = std::find_if(series.begin(), series.end(), [&](const json& s) {
      for (const auto& [k, v] : rank0(a)) {
        if (!s["labels"].contains(k) || s["labels"][k] != v) return false;
      }
      return s["labels"].size() == rank0(a).size();
    });
    ASSERT_NE(it, series.end()) << "not in the JSON snapshot";
    if (a.type == MetricsRegistry::Type::kHistogram) {
      EXPECT_EQ((*it)["count"].get<double>(), e.value);
      EXPECT_EQ((*it)["sum"].get<double>(), e.sum);
    } else {
      EXPECT_EQ((*it)["value"].get<double>(), e.value);
    }
  }
}

// What a dashboard built for SGLang HiCache, vLLM or LMCache reads, with values the traffic
// determines: 64 tokens inserted (16 pages written to the host and backed up to L3), matched,
// then evicted from the device; one reported prefill.
TEST(HiCacheMetrics, EngineAliasesShowTheFiguresTheirDashboardsRead) {
  Traffic t;
  const MetricsRegistry& r = t.hc->metrics();
  const auto v = [&](const char* name, MetricLabels labels = {}) {
    labels.insert(labels.begin(), {{"tp_rank", "0"}, {"model_name", "model"}});
    return r.value(name, labels);
  };
  t.hc->cache().record_prefill(64, 32, 16, 48);
  EXPECT_EQ(v("sglang:prefill_effective_tokens_total", {{"mode", "input"}}), 48);
  EXPECT_EQ(v("sglang:prefill_effective_tokens_total", {{"mode", "device_hit"}}), 64);
  EXPECT_EQ(v("sglang:prefill_effective_tokens_total", {{"mode", "host_hit"}}), 32);
  EXPECT_EQ(v("sglang:prefill_effective_tokens_total", {{"mode", "storage_hit"}}), 16);
  EXPECT_EQ(v("sglang:cached_tokens_total", {{"cache_source", "storage"}}), 16);
  EXPECT_EQ(v("sglang:cache_hit_rate"), 112.0 / 160.0);
  EXPECT_EQ(v("lmcache:num_hit_tokens_total"), 48) << "host and storage";
  EXPECT_EQ(v("lmcache:num_vllm_hit_tokens_total"), 64);
  EXPECT_EQ(v("lmcache:num_prompt_tokens_total"), 160);
  EXPECT_EQ(v("sglang:hicache_host_total_tokens"), 512);
  EXPECT_EQ(v("sglang:hicache_host_used_tokens"), 64);
  EXPECT_EQ(v("vllm:kv_offload_cpu_cache_usage_perc"), 64.0 / 512.0);
  EXPECT_EQ(v("vllm:kv_cache_usage_perc"), 64.0 / 256.0);
  EXPECT_EQ(v("vllm:gpu_cache_usage_perc"), 64.0 / 256.0);
  const double page_bytes = static_cast<double>(t.hc->config().geometry.page_bytes());
  EXPECT_EQ(v("sglang:hicache_backup_tokens_total", {{"pool", "kv"}}), 64);
  EXPECT_EQ(v("lmcache:num_stored_tokens_total"), 64);
  EXPECT_EQ(v("sglang:hicache_backup_bytes_total"), 16 * page_bytes);
  EXPECT_GE(v("sglang:hicache_backup_duration_seconds"), 1) << "write ops timed";
  EXPECT_EQ(v("sglang:backuped_tokens_total"), 64);
  EXPECT_GE(v("sglang:backup_pgs"), 1) << "store calls";
  EXPECT_EQ(v("sglang:load_back_tokens_total", {{"pool", "kv"}}), 0);
  // Evicting the device: its synced copies are freed (not dropped), the call is timed.
  EXPECT_EQ(t.hc->cache().evict_device(1 << 20), 64);
  EXPECT_EQ(v("sglang:evicted_tokens_total"), 64);
  EXPECT_EQ(v("sglang:eviction_duration_seconds"), 1);
  EXPECT_EQ(v("sglang:hicache_dropped_tokens_total", {{"reason", "no_host_copy"}, {"pool", "kv"}}),
            0);
  // Loaded back: tokens, bytes and the load's latency once it is acknowledged.
  const auto m = t.hc->cache().match_prefix(t.tokens);
  ASSERT_EQ(m.host_hit_tokens, 64);
  t.hc->cache().lock(m.last_host_node);
  ASSERT_TRUE(t.hc->cache().load_back(m.last_host_node).has_value());
  const std::int32_t slot = t.hc->controller().start_loading();
  ASSERT_GE(slot, 0);
  for (std::int32_t l = 0; l < t.hc->config().geometry.num_layers; ++l) {
    ASSERT_TRUE(t.hc->device_pool().wait_for_layer(l));
  }
  t.hc->controller().layer_done_counter().release(slot);
  t.settle();
  t.hc->cache().unlock(m.last_host_node);
  EXPECT_EQ(v("sglang:load_back_tokens_total", {{"pool", "kv"}}), 64);
  EXPECT_EQ(v("sglang:load_back_bytes_total"), 16 * page_bytes);
  EXPECT_EQ(v("sglang:load_back_duration_seconds"), 1);
}

TEST(HiCacheMetrics, RecordPrefillRefusesANegativeCountAndCountsNothing) {
  Traffic t;
  const auto input = [&] {
    return t.hc->metrics().value("sglang:prefill_effective_tokens_total",
                                 {{"tp_rank", "0"}, {"model_name", "model"}, {"mode", "input"}});
  };
  t.hc->cache().record_prefill(0, 0, 0, 5);
  try {
    t.hc->cache().record_prefill(1, 2, -3, 4);
    ADD_FAILURE() << "a negative count was taken";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("storage tokens -3"), std::string::npos) << e.what();
  }
  EXPECT_EQ(input(), 5) << "nothing of the refused prefill was counted";
  EXPECT_EQ(t.hc->metrics().value("hicache_prefill_tokens_total",
                                  {{"tp_rank", "0"}, {"source", "device"}}),
            0);
}

// Without a host tier every device eviction frees KV that exists nowhere else: dropped.
TEST(HiCacheMetrics, DeviceKVFreedWithNoHostCopyCountsAsDropped) {
  HiCache hc(HiCacheConfig::from_json_text(
      R"({"device": "host", "page_size": 4, "device_tokens": 64, "host_tier": false,
          "model": {"layers": 2, "kv_heads": 1, "head_dim": 8}})"));
  std::vector<std::int32_t> tokens(32);
  std::iota(tokens.begin(), tokens.end(), 7);
  auto slots = hc.device_pool().allocator().alloc(32);
  ASSERT_TRUE(slots.has_value());
  hc.cache().insert(tokens, *slots);
  EXPECT_EQ(hc.cache().evict_device(32), 32);
  const MetricLabels labels = {
      {"tp_rank", "0"}, {"model_name", "model"}, {"reason", "no_host_copy"}, {"pool", "kv"}};
  const MetricLabels rank = {{"tp_rank", "0"}, {"model_name", "model"}};
  EXPECT_EQ(hc.metrics().value("sglang:hicache_dropped_tokens_total", labels), 32);
  EXPECT_EQ(hc.metrics().value("hicache_dropped_tokens_total",
                               {{"tp_rank", "0"}, {"tier", "device"}, {"reason", "no_host_copy"}}),
            32);
  EXPECT_EQ(hc.metrics().value("sglang:evicted_tokens_total", rank), 32);
  EXPECT_EQ(hc.metrics().value("sglang:eviction_duration_seconds", rank), 1);
  EXPECT_EQ(hc.cache().evict_device(32), 0);
  EXPECT_EQ(hc.metrics().value("sglang:eviction_duration_seconds", rank), 1)
      << "a call that evicted nothing is not timed";
}

// docs/metrics.md lists every alias series (name and labels) in its table.
TEST(HiCacheMetrics, EveryEngineAliasIsInTheMetricsDoc) {
  std::ifstream f(HICACHE_METRICS_DOC);
  ASSERT_TRUE(f.good()) << HICACHE_METRICS_DOC;
  const std::string doc((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  for (const EngineMetricAlias& a : engine_metric_aliases()) {
    const std::string row = str_cat("| `", alias_series_name(a), "` | ");
    EXPECT_NE(doc.find(row), std::string::npos) << "docs/metrics.md has no row " << row;
  }
}

}  // namespace
}  // namespace hicache
