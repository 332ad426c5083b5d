// HiRadixCache cost as the cache grows (issue: costs that stay flat). For N = 1e3, 1e4, 1e5 and
// 1e6 cached pages at page sizes 1 and 64, a tree of 64 shared 8-page prefixes with unique
// 8-page tails (about N/8 nodes), all on the host, and a steady state that keeps N constant:
// each iteration inserts a new tail on the device (written through to the host), evicts it
// from the device, evicts the least recently used host leaf, matches a random cached request,
// and calls check_events() and stats() once. Each of these six calls is timed on its own; the
// run prints the mean per call for every N and the ratio of the 1e6 figure to the 1e3 figure
// (target: every ratio <= 3), and, against a baseline measured in the same run (one dependent
// read at a random place in 128 MiB), how many such reads match_prefix costs more at 1e6 than
// at 1e3: at 1e6 a random request's tail is in no cache. insert() includes queueing the
// write-through to the controller; the wait for its ack is not timed. With
// --benchmark_repetitions=N every figure of the summary is the median of N runs.
// Tiny KV (1 layer x 1 head x 1 dim) keeps the copies out of the figures.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "controller/hicache.h"
#include "transfer/errors.h"

namespace {

using namespace hicache;
using Clock = std::chrono::steady_clock;

constexpr int kFamilies = 64, kPrefixPages = 8, kTailPages = 8;
constexpr std::array<const char*, 6> kOps = {"insert",    "evict_device", "evict_host",
                                             "match",     "check_events", "stats"};

struct Tree {
  std::unique_ptr<HiCache> hc;
  std::int32_t page;
  std::int64_t tails = 0;  // tails inserted so far; the live ones are the newest
  std::int64_t live = 0;   // tails in the tree

  Tree(std::int64_t pages, std::int32_t page_size, const char* policy) : page(page_size) {
    const std::int64_t device_pages = 4 * kFamilies * kPrefixPages;
    const std::int64_t host_pages = pages + device_pages;
    hc = std::make_unique<HiCache>(HiCacheConfig::from_json_text(str_cat(
        R"({"device": "host", "page_size": )", page_size, R"(, "device_tokens": )",
        device_pages * page_size, R"(, "host_tokens": )", host_pages * page_size,
        R"(, "model": {"layers": 1, "kv_heads": 1, "head_dim": 1, "dtype": "fp16"},)",
        R"( "write_policy": "write_through", "eviction_policy": ")", policy,
        R"(", "metrics": false})")));
    // The prefixes, then tails until N pages are cached, in batches that fit the device.
    std::vector<std::vector<std::int32_t>> batch;
    for (int f = 0; f < kFamilies; ++f) batch.push_back(prefix(f));
    add(batch);
    const std::int64_t want_tails = (pages - kFamilies * kPrefixPages) / kTailPages;
    while (live < want_tails) {
      batch.clear();
      for (int i = 0; i < 3 * kFamilies && live + static_cast<std::int64_t>(batch.size()) < want_tails;
           ++i) {
        batch.push_back(request(tails + static_cast<std::int64_t>(batch.size())));
      }
      add(batch);
      tails += static_cast<std::int64_t>(batch.size());
      live += static_cast<std::int64_t>(batch.size());
    }
  }

  std::vector<std::int32_t> prefix(int family) const {
    std::vector<std::int32_t> t(static_cast<std::size_t>(kPrefixPages * page));
    for (std::size_t i = 0; i < t.size(); ++i) t[i] = family * 10'000'000 + static_cast<std::int32_t>(i);
    return t;
  }
  // Request `tail`: its family's prefix and its own tail.
  std::vector<std::int32_t> request(std::int64_t tail) const {
    std::vector<std::int32_t> t = prefix(static_cast<int>(tail % kFamilies));
    for (int i = 0; i < kTailPages * page; ++i) {
      t.push_back(-1 - static_cast<std::int32_t>(tail * kTailPages * page + i));
    }
    return t;
  }

  // Inserts the requests on the device, waits for their writes, evicts them to the host.
  void add(const std::vector<std::vector<std::int32_t>>& requests) {
    HiRadixCache& cache = hc->cache();
    for (const auto& r : requests) insert(r);
    settle();
    cache.evict_device(std::int64_t{1} << 40);
  }
  // Inserts a request whose prefix is cached; returns the time insert() took.
  Clock::duration insert(const std::vector<std::int32_t>& r) {
    HiRadixCache& cache = hc->cache();
    auto& allocator = hc->device_pool().allocator();
    const std::int64_t own = cache.cached_prefix_tokens(r);
    auto fresh = allocator.alloc(static_cast<std::int64_t>(r.size()) - own);
    if (!fresh) throw StateError("radix bench: device pool short");
    std::vector<std::int64_t> slots(static_cast<std::size_t>(own), 0);  // cached: not used
    slots.insert(slots.end(), fresh->begin(), fresh->end());
    const auto t0 = Clock::now();
    const std::int64_t dup = cache.insert(r, slots);
    const auto t = Clock::now() - t0;
    if (dup != own) throw StateError(str_cat("radix bench: ", dup, " tokens cached, not ", own));
    return t;
  }
  void settle() {
    HiRadixCache& cache = hc->cache();
    for (;;) {
      const std::uint64_t seen = cache.event_seq();
      cache.check_events();
      if (cache.stats().writes_in_flight == 0) return;
      cache.wait_for_events(seen, Clock::now() + std::chrono::seconds(5));
    }
  }
};

void BM_RadixScale(benchmark::State& state) {
  const std::int64_t pages = state.range(0);
  const auto page = static_cast<std::int32_t>(state.range(1));
  Tree tree(pages, page, state.range(2) != 0 ? "lfu" : "lru");
  HiRadixCache& cache = tree.hc->cache();
  std::mt19937_64 rng(7);
  std::array<Clock::duration, kOps.size()> spent{};
  const auto tail_tokens = static_cast<std::int64_t>(kTailPages) * page;
  auto timed = [&](std::size_t op, auto&& fn) {
    const auto t0 = Clock::now();
    fn();
    spent[op] += Clock::now() - t0;
  };
  for (auto _ : state) {
    spent[0] += tree.insert(tree.request(tree.tails++));
    tree.settle();
    std::int64_t freed = 0;
    timed(1, [&] { freed = cache.evict_device(tail_tokens); });
    // A tail, or (where a family lost all its tails and then its prefix) a whole request.
    if (freed < tail_tokens) {
      state.SkipWithError(str_cat("evict_device freed ", freed).c_str());
      break;
    }
    timed(2, [&] { freed = cache.evict_host(tail_tokens); });
    if (freed < tail_tokens) {
      state.SkipWithError(str_cat("evict_host freed ", freed).c_str());
      break;
    }
    const auto r = tree.request(tree.tails - 1 - static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(tree.live / 2)));
    timed(3, [&] { benchmark::DoNotOptimize(cache.match_prefix(r).host_hit_tokens); });
    timed(4, [&] { cache.check_events(); });
    timed(5, [&] { benchmark::DoNotOptimize(cache.stats().nodes); });
  }
  const auto nodes = cache.stats().nodes;
  for (std::size_t op = 0; op < kOps.size(); ++op) {
    state.counters[std::string(kOps[op]) + "_us"] =
        std::chrono::duration<double, std::micro>(spent[op]).count() /
        static_cast<double>(state.iterations());
  }
  state.counters["nodes"] = static_cast<double>(nodes);
}
// N pages, page size, LFU (0: LRU). Fixed iterations: the same ops at every N.
BENCHMARK(BM_RadixScale)
    ->ArgsProduct({{1000, 10'000, 100'000, 1'000'000}, {1, 64}, {0, 1}})
    ->Iterations(3000)
    ->Unit(benchmark::kMillisecond);


// match_prefix alone over a large tree: a random cached request each call (its tail in no cache),
// timed alone. For comparing changes to the lookup, without the sweep's other calls in between.
void BM_MatchCold(benchmark::State& state) {
  Tree tree(state.range(0), static_cast<std::int32_t>(state.range(1)), "lru");
  HiRadixCache& cache = tree.hc->cache();
  std::mt19937_64 rng(11);
  for (auto _ : state) {
    const auto r = tree.request(
        tree.tails - 1 - static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(tree.live)));
    const auto t0 = Clock::now();
    benchmark::DoNotOptimize(cache.match_prefix(r).host_hit_tokens);
    state.SetIterationTime(std::chrono::duration<double>(Clock::now() - t0).count());
  }
}
BENCHMARK(BM_MatchCold)
    ->ArgsProduct({{1000, 1'000'000}, {1, 64}})
    ->Iterations(20000)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

class SweepReporter : public benchmark::ConsoleReporter {
 public:
  // With --benchmark_repetitions=N the summary takes each figure's median over the N runs
  // (Google Benchmark reports the aggregates after the runs, so the median replaces them).
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& run : runs) {
      if (run.error_occurred) continue;
      if (run.run_type == Run::RT_Aggregate && run.aggregate_name != "median") continue;
      for (const char* op : kOps) {
        auto it = run.counters.find(std::string(op) + "_us");
        if (it != run.counters.end()) us[run.run_name.str()][op] = it->second;
      }
    }
  }
  std::map<std::string, std::map<std::string, double>> us;
};

// The baseline: one dependent read at a random place in a buffer as large as a 1e6-page tree
// (its nodes, keys and maps), in ns: what a lookup pays for each level of the tree that is not in
// the caches.
double random_read_ns() {
  constexpr std::size_t kBytes = std::size_t{128} << 20;
  const std::size_t n = kBytes / sizeof(std::size_t);
  std::vector<std::size_t> next(n), order(n);
  for (std::size_t i = 0; i < n; ++i) order[i] = i;
  std::mt19937_64 rng(3);
  std::shuffle(order.begin(), order.end(), rng);
  for (std::size_t i = 0; i < n; ++i) next[order[i]] = order[(i + 1) % n];
  constexpr int kReads = 1 << 20;
  std::size_t at = order[0];
  const auto t0 = Clock::now();
  for (int i = 0; i < kReads; ++i) at = next[at];
  const auto t = Clock::now() - t0;
  benchmark::DoNotOptimize(at);
  return std::chrono::duration<double, std::nano>(t).count() / kReads;
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 2;
  SweepReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  int over = 0;
  double read_ns = 0;
  if (!reporter.us.empty()) {  // the median of three
    std::array<double, 3> reads{random_read_ns(), random_read_ns(), random_read_ns()};
    std::sort(reads.begin(), reads.end());
    read_ns = reads[1];
  }
  if (read_ns > 0) {
    std::printf("baseline: one dependent random read over 128 MiB: %.0f ns\n", read_ns);
  }
  for (const char* policy : {"0", "1"}) {
    for (const char* page : {"1", "64"}) {
      const auto at = [&](const char* n) {
        auto it = reporter.us.find(str_cat("BM_RadixScale/", n, "/", page, "/", policy,
                                           "/iterations:3000"));
        return it == reporter.us.end() ? nullptr : &it->second;
      };
      const auto* small = at("1000");
      const auto* large = at("1000000");
      if (small == nullptr || large == nullptr) continue;
      std::printf("page %s, %s: per call at 1e3 / 1e6 pages, ratio (target <= 3)\n", page,
                  policy[0] == '1' ? "lfu" : "lru");
      for (const char* op : kOps) {
        const double a = small->at(op), b = large->at(op);
        const double ratio = a > 0 ? b / a : 0;
        over += ratio > 3 ? 1 : 0;
        std::printf("  %-13s %9.2f us %9.2f us  %5.2f%s\n", op, a, b, ratio,
                    ratio > 3 ? "  over target" : "");
      }
      std::printf("  match at 1e6 costs %.1f random reads more than at 1e3\n",
                  (large->at("match") - small->at("match")) * 1000 / read_ns);
    }
  }
  return over == 0 ? 0 : 1;
}
