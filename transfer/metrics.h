// Metrics: counters, gauges and histograms that the components own and update on their hot
// paths (one relaxed atomic add each), and the registry that names them for a scrape. A component
// keeps its metric objects as members and registers them with register_metrics(registry, ...):
// the registry holds references, never copies, so a snapshot reads the very counters the
// component increments. The registry renders Prometheus text exposition (version 0.0.4) and a
// JSON snapshot of the same values.
//
// Names follow Prometheus conventions: hicache_<what>_<unit>, counters end in _total; labels
// separate tiers, directions and reasons. A family is one name with one type and help; its
// series differ by labels and may come from different components.
//
// An alias family shows existing series under another name and labels (the names another
// engine's dashboards read: SGLang's sglang:*, vLLM's vllm:*, LMCache's lmcache:*). It holds no
// counter of its own: a scrape sums the series it names, so the hot path counts once.
//
// Thread-safety: updates are lock-free from any thread; registration, removal and rendering
// take the registry's mutex. A MetricsScope removes what it registered when it is destroyed, so
// a component declares its scope after its metrics (it goes first) and a scrape never reads a
// destroyed counter.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "transfer/mutex.h"

namespace hicache {

using MetricLabels = std::vector<std::pair<std::string, std::string>>;

// The one family several components report misses into (each with its own reasons).
inline constexpr const char* kMissesMetric = "hicache_misses_total";
inline constexpr const char* kMissesHelp =
    "Tokens (tree) or keys (store) asked for and not served from the cache, by reason";
// Families the radix cache and the storage controller both report into, and the tier-to-tier
// token counts of the two controllers.
inline constexpr const char* kPrefetchOutcomesMetric = "hicache_prefetch_outcomes_total";
inline constexpr const char* kPrefetchOutcomesHelp =
    "Prefetches asked of L3, by outcome: declined before a query, issued, revoked after the hit";
inline constexpr const char* kPrefetchUnfulfilledMetric =
    "hicache_prefetch_unfulfilled_tokens_total";
inline constexpr const char* kPrefetchUnfulfilledHelp =
    "Tokens of an agreed L3 hit that did not reach the tree, by reason";
inline constexpr const char* kTokensMetric = "hicache_tokens_total";
inline constexpr const char* kTokensHelp = "KV tokens moved between tiers, by direction";

class Counter {
 public:
  void add(std::uint64_t n = 1) { v_.fetch_add(n, std::memory_order_relaxed); }
  Counter& operator++() {
    add();
    return *this;
  }
  Counter& operator+=(std::uint64_t n) {
    add(n);
    return *this;
  }
  std::uint64_t value() const { return v_.load(std::memory_order_relaxed); }

 private:
  std::atomic<std::uint64_t> v_{0};
};

class Gauge {
 public:
  void set(double v) { v_.store(v, std::memory_order_relaxed); }
  double value() const { return v_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> v_{0};
};

// Cumulative buckets of seconds (or any unit): observe() adds to the first bucket whose upper
// bound holds the value, and to the sum and count.
class Histogram {
 public:
  // Upper bounds, ascending; +Inf is implied.
  explicit Histogram(std::vector<double> bounds = latency_bounds());
  void observe(double v);
  // 1 us .. 10 s, about three per decade: transfer latencies from a tiny page to a slow store.
  static std::vector<double> latency_bounds();

  const std::vector<double>& bounds() const { return bounds_; }
  // Per-bucket counts (not cumulative), bounds().size() + 1 of them (the last is +Inf).
  std::vector<std::uint64_t> counts() const;
  double sum() const { return sum_.load(std::memory_order_relaxed); }
  std::uint64_t count() const { return count_.load(std::memory_order_relaxed); }

 private:
  std::vector<double> bounds_;
  std::unique_ptr<std::atomic<std::uint64_t>[]> buckets_;
  std::atomic<double> sum_{0};
  std::atomic<std::uint64_t> count_{0};
};

class MetricsRegistry {
 public:
  enum class Type { kCounter, kGauge, kHistogram };

  MetricsRegistry();
  ~MetricsRegistry();
  MetricsRegistry(const MetricsRegistry&) = delete;
  MetricsRegistry& operator=(const MetricsRegistry&) = delete;

  // Register a series of family `name`; `owner` tags it for forget(). Throws InvalidArgument
  // when the name or a label is not a valid Prometheus name, when the family exists with
  // another type or help, or when the same labels are registered twice.
  void add(std::string_view name, std::string_view help, MetricLabels labels,
           const Counter& counter, const void* owner);
  void add(std::string_view name, std::string_view help, MetricLabels labels, const Gauge& gauge,
           const void* owner);
  void add(std::string_view name, std::string_view help, MetricLabels labels,
           const Histogram& histogram, const void* owner);
  // A gauge computed at scrape time on the scraping thread: `read` must be thread-safe.
  void add_gauge_fn(std::string_view name, std::string_view help, MetricLabels labels,
                    std::function<double()> read, const void* owner);
  // A counter computed at scrape time (a difference of two counters): `read` must be
  // thread-safe and never decrease.
  void add_counter_fn(std::string_view name, std::string_view help, MetricLabels labels,
                      std::function<double()> read, const void* owner);
  // An alias series: at each scrape, the sum of the series of family `source` whose labels
  // include every pair of one of `selects` (several selects add up), rendered as family `name`
  // (of `type`, with `help`) with those series' other labels (tp_rank, ...) followed by
  // `labels`; series that differ in their other labels stay apart. Histograms add up bucket by
  // bucket (a series with other bounds than the first is left out). Source series of another
  // type, or none at all (the family is absent, e.g. no L3), contribute nothing, and an alias
  // family with nothing to show is not rendered. Throws InvalidArgument when a name or label
  // is not valid, `selects` is empty, `name` is a family's (or an alias family's of another
  // type or help), `source` exists with another type, or these labels are registered already.
  void add_alias(std::string_view name, std::string_view help, Type type, MetricLabels labels,
                 std::string_view source, std::vector<MetricLabels> selects, const void* owner);
  // Removes every series (and alias series) `owner` registered.
  void forget(const void* owner);

  // Prometheus text exposition format 0.0.4.
  std::string prometheus_text() const;
  // {"<family>": {"type": ..., "help": ..., "series": [{"labels": {...}, "value": V} |
  //  {"labels": {...}, "count": N, "sum": S, "buckets": [[le, cumulative], ...]}]}}
  std::string json_text() const;
  // The value of one counter or gauge series (a histogram's count), alias series included, or
  // -1 when absent.
  double value(std::string_view name, const MetricLabels& labels = {}) const;

 private:
  struct Series;
  struct AliasSeries;
  template <typename S>
  struct FamilyOf;  // a name, a type, a help and the series (or alias series) under them
  using Family = FamilyOf<Series>;
  using AliasFamily = FamilyOf<AliasSeries>;
  struct Sample;
  // The family `name` (created if new); throws when it exists with another type or help.
  Family& family(std::string_view name, std::string_view help, Type type) HICACHE_REQUIRES(mu_);
  void add_series(std::string_view name, std::string_view help, Type type, Series series);
  const Family* find_family(std::string_view name) const HICACHE_REQUIRES(mu_);
  const AliasFamily* find_alias(std::string_view name) const HICACHE_REQUIRES(mu_);
  // What an alias family shows now: one sample per distinct label set.
  std::vector<Sample> resolve(const AliasFamily& alias) const HICACHE_REQUIRES(mu_);
  // One sample's lines of the text exposition.
  static void text_sample(std::string& out, const std::string& name, const Sample& s);

  mutable Mutex mu_;
  std::vector<std::unique_ptr<Family>> families_ HICACHE_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<AliasFamily>> aliases_ HICACHE_GUARDED_BY(mu_);
};

// What one component registered; forgets it on destruction. Declare it after the metrics it
// names.
class MetricsScope {
 public:
  MetricsScope() = default;
  ~MetricsScope() { reset(); }
  MetricsScope(const MetricsScope&) = delete;
  MetricsScope& operator=(const MetricsScope&) = delete;

  // Starts registering into `registry` with `labels` added to every series (a component
  // registers into one registry: a second call forgets what the first registered).
  void attach(MetricsRegistry& registry, MetricLabels labels = {});
  void reset();
  bool attached() const { return registry_ != nullptr; }

  template <typename Metric>
  void add(std::string_view name, std::string_view help, MetricLabels labels, const Metric& m) {
    if (registry_ != nullptr) registry_->add(name, help, with_common(std::move(labels)), m, this);
  }
  void add_counter_fn(std::string_view name, std::string_view help, MetricLabels labels,
                      std::function<double()> read) {
    if (registry_ != nullptr) {
      registry_->add_counter_fn(name, help, with_common(std::move(labels)), std::move(read), this);
    }
  }
  void add_gauge_fn(std::string_view name, std::string_view help, MetricLabels labels,
                    std::function<double()> read) {
    if (registry_ != nullptr) {
      registry_->add_gauge_fn(name, help, with_common(std::move(labels)), std::move(read), this);
    }
  }
  // MetricsRegistry::add_alias; the common labels are not added (the alias carries its
  // source series' own).
  void add_alias(std::string_view name, std::string_view help, MetricsRegistry::Type type,
                 MetricLabels labels, std::string_view source, std::vector<MetricLabels> selects) {
    if (registry_ != nullptr) {
      registry_->add_alias(name, help, type, std::move(labels), source, std::move(selects), this);
    }
  }

 private:
  MetricLabels with_common(MetricLabels labels) const;
  MetricsRegistry* registry_ = nullptr;
  MetricLabels common_;
};

}  // namespace hicache
