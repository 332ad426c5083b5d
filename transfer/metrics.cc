#include "transfer/metrics.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <variant>

#include "transfer/errors.h"

namespace hicache {
namespace {

bool valid_name(std::string_view name, bool label) {
  if (name.empty()) return false;
  for (std::size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' ||
                       (!label && c == ':');
    if (!alpha && !(i > 0 && c >= '0' && c <= '9')) return false;
  }
  return !(label && name.rfind("__", 0) == 0);
}

std::string number(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (v == std::floor(v) && std::fabs(v) < 1e15) {
    return std::to_string(static_cast<long long>(v));
  }
  // The shortest text that reads back as `v` (0.1, not 0.10000000000000001): a bucket's le
  // label then reads as other exporters write it, so a dashboard's le="0.1" selects it.
  char buf[32];
  const auto end = std::to_chars(buf, buf + sizeof buf, v).ptr;
  return std::string(buf, end);
}

std::string escape(std::string_view s, bool quotes) {
  std::string out;
  for (char c : s) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else if (quotes && c == '"') {
      out += "\\\"";
    } else {
      out += c;
    }
  }
  return out;
}

std::string json_string(std::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

std::string json_number(double v) { return std::isfinite(v) ? number(v) : "null"; }

std::string label_text(const MetricLabels& labels, std::string_view extra_key = {},
                       std::string_view extra_value = {}) {
  if (labels.empty() && extra_key.empty()) return "";
  std::string out = "{";
  for (const auto& [k, v] : labels) {
    out += str_cat(out.size() > 1 ? "," : "", k, "=\"", escape(v, true), "\"");
  }
  if (!extra_key.empty()) {
    out += str_cat(out.size() > 1 ? "," : "", extra_key, "=\"", extra_value, "\"");
  }
  return out + "}";
}

std::string_view type_name(MetricsRegistry::Type t) {
  switch (t) {
    case MetricsRegistry::Type::kCounter: return "counter";
    case MetricsRegistry::Type::kGauge: return "gauge";
    case MetricsRegistry::Type::kHistogram: return "histogram";
  }
  return "untyped";
}

}  // namespace

Histogram::Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)) {
  if (!std::is_sorted(bounds_.begin(), bounds_.end()) ||
      std::adjacent_find(bounds_.begin(), bounds_.end()) != bounds_.end()) {
    throw InvalidArgument("Histogram: bucket bounds must be strictly ascending");
  }
  buckets_ = std::make_unique<std::atomic<std::uint64_t>[]>(bounds_.size() + 1);
  for (std::size_t i = 0; i <= bounds_.size(); ++i) buckets_[i].store(0);
}

std::vector<double> Histogram::latency_bounds() {
  return {1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3,
          5e-3, 1e-2, 2.5e-2, 5e-2, 0.1,  0.25,   0.5,  1,    2.5,    5,    10};
}

void Histogram::observe(double v) {
  const auto at = static_cast<std::size_t>(
      std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin());
  buckets_[at].fetch_add(1, std::memory_order_relaxed);
  double sum = sum_.load(std::memory_order_relaxed);
  while (!sum_.compare_exchange_weak(sum, sum + v, std::memory_order_relaxed)) {
  }
  count_.fetch_add(1, std::memory_order_relaxed);
}

std::vector<std::uint64_t> Histogram::counts() const {
  std::vector<std::uint64_t> out(bounds_.size() + 1);
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = buckets_[i].load(std::memory_order_relaxed);
  return out;
}

struct MetricsRegistry::Series {
  MetricLabels labels;
  const void* owner = nullptr;
  std::variant<const Counter*, const Gauge*, const Histogram*, std::function<double()>> source;

  double scalar() const {
    if (const auto* c = std::get_if<const Counter*>(&source)) return static_cast<double>((*c)->value());
    if (const auto* g = std::get_if<const Gauge*>(&source)) return (*g)->value();
    if (const auto* f = std::get_if<std::function<double()>>(&source)) return (*f)();
    return static_cast<double>(std::get<const Histogram*>(source)->count());
  }
};

struct MetricsRegistry::AliasSeries {
  MetricLabels labels;
  std::string source;
  std::vector<MetricLabels> selects;
  const void* owner = nullptr;
};

template <typename S>
struct MetricsRegistry::FamilyOf {
  std::string name, help;
  Type type;
  std::vector<S> series;
};

// One series as a scrape reads it: a value, or a histogram's buckets (bounds set).
struct MetricsRegistry::Sample {
  MetricLabels labels;
  double value = 0;
  const std::vector<double>* bounds = nullptr;  // a histogram's; valid while mu_ is held
  std::vector<std::uint64_t> counts;            // per bucket, not cumulative
  double sum = 0;

  static Sample of(const Series& s) {
    Sample out{s.labels};
    if (const auto* h = std::get_if<const Histogram*>(&s.source)) {
      out.bounds = &(*h)->bounds();
      out.counts = (*h)->counts();
      out.sum = (*h)->sum();
    } else {
      out.value = s.scalar();
    }
    return out;
  }
  // A counter's or gauge's value; a histogram's count.
  double scalar() const {
    if (bounds == nullptr) return value;
    return static_cast<double>(std::accumulate(counts.begin(), counts.end(), std::uint64_t{0}));
  }
  // Adds `other` (same kind); false when the histograms' bounds differ (nothing added).
  bool add(const Sample& other) {
    if (bounds == nullptr) {
      value += other.value;
      return true;
    }
    if (other.bounds == nullptr || *other.bounds != *bounds) return false;
    for (std::size_t i = 0; i < counts.size(); ++i) counts[i] += other.counts[i];
    sum += other.sum;
    return true;
  }
};

namespace {

bool has_key(const MetricLabels& labels, std::string_view key) {
  return std::any_of(labels.begin(), labels.end(), [&](const auto& kv) { return kv.first == key; });
}

bool includes(const MetricLabels& labels, const MetricLabels& pairs) {
  return std::all_of(pairs.begin(), pairs.end(), [&](const auto& p) {
    return std::find(labels.begin(), labels.end(), p) != labels.end();
  });
}

}  // namespace

MetricsRegistry::MetricsRegistry() = default;
MetricsRegistry::~MetricsRegistry() = default;

const MetricsRegistry::Family* MetricsRegistry::find_family(std::string_view name) const {
  for (const auto& f : families_) {
    if (f->name == name) return f.get();
  }
  return nullptr;
}

const MetricsRegistry::AliasFamily* MetricsRegistry::find_alias(std::string_view name) const {
  for (const auto& a : aliases_) {
    if (a->name == name) return a.get();
  }
  return nullptr;
}

MetricsRegistry::Family& MetricsRegistry::family(std::string_view name, std::string_view help,
                                                 Type type) {
  if (find_alias(name) != nullptr) {
    throw InvalidArgument(str_cat("metrics: '", name, "' is an alias family's name"));
  }
  for (auto& f : families_) {
    if (f->name != name) continue;
    if (f->type != type || f->help != help) {
      throw InvalidArgument(str_cat("metrics: family '", name, "' exists as a ",
                                    type_name(f->type), " with help '", f->help, "'"));
    }
    return *f;
  }
  families_.push_back(std::make_unique<Family>(
      Family{std::string(name), std::string(help), type, {}}));
  return *families_.back();
}

void MetricsRegistry::add_series(std::string_view name, std::string_view help, Type type,
                                 Series series) {
  if (!valid_name(name, false)) throw InvalidArgument(str_cat("metrics: bad name '", name, "'"));
  for (const auto& [k, v] : series.labels) {
    if (!valid_name(k, true) || (type == Type::kHistogram && k == "le")) {
      throw InvalidArgument(str_cat("metrics: bad label name '", k, "' on '", name, "'"));
    }
  }
  MutexLock lock(mu_);
  Family& f = family(name, help, type);
  for (const Series& s : f.series) {
    if (s.labels == series.labels) {
      throw InvalidArgument(str_cat("metrics: '", name, label_text(series.labels),
                                    "' is registered already"));
    }
  }
  f.series.push_back(std::move(series));
}

void MetricsRegistry::add(std::string_view name, std::string_view help, MetricLabels labels,
                          const Counter& counter, const void* owner) {
  add_series(name, help, Type::kCounter, Series{std::move(labels), owner, &counter});
}

void MetricsRegistry::add(std::string_view name, std::string_view help, MetricLabels labels,
                          const Gauge& gauge, const void* owner) {
  add_series(name, help, Type::kGauge, Series{std::move(labels), owner, &gauge});
}

void MetricsRegistry::add(std::string_view name, std::string_view help, MetricLabels labels,
                          const Histogram& histogram, const void* owner) {
  add_series(name, help, Type::kHistogram, Series{std::move(labels), owner, &histogram});
}

void MetricsRegistry::add_counter_fn(std::string_view name, std::string_view help,
                                     MetricLabels labels, std::function<double()> read,
                                     const void* owner) {
  add_series(name, help, Type::kCounter, Series{std::move(labels), owner, std::move(read)});
}

void MetricsRegistry::add_gauge_fn(std::string_view name, std::string_view help,
                                   MetricLabels labels, std::function<double()> read,
                                   const void* owner) {
  add_series(name, help, Type::kGauge, Series{std::move(labels), owner, std::move(read)});
}

void MetricsRegistry::add_alias(std::string_view name, std::string_view help, Type type,
                                MetricLabels labels, std::string_view source,
                                std::vector<MetricLabels> selects, const void* owner) {
  if (!valid_name(name, false)) throw InvalidArgument(str_cat("metrics: bad name '", name, "'"));
  if (!valid_name(source, false)) {
    throw InvalidArgument(str_cat("metrics: alias '", name, "': bad source name '", source, "'"));
  }
  if (selects.empty()) {
    throw InvalidArgument(str_cat("metrics: alias '", name, label_text(labels),
                                  "' selects no series of '", source, "'"));
  }
  for (const auto& [k, v] : labels) {
    if (!valid_name(k, true) || (type == Type::kHistogram && k == "le")) {
      throw InvalidArgument(str_cat("metrics: bad label name '", k, "' on '", name, "'"));
    }
  }
  for (const MetricLabels& select : selects) {
    for (const auto& [k, v] : select) {
      if (!valid_name(k, true)) {
        throw InvalidArgument(
            str_cat("metrics: alias '", name, "': bad label name '", k, "' in a select"));
      }
    }
  }
  MutexLock lock(mu_);
  if (find_family(name) != nullptr) {
    throw InvalidArgument(str_cat("metrics: alias '", name, "' is a family's name"));
  }
  if (const Family* src = find_family(source); src != nullptr && src->type != type) {
    throw InvalidArgument(str_cat("metrics: alias '", name, "' is a ", type_name(type),
                                  " but its source '", source, "' is a ", type_name(src->type)));
  }
  AliasFamily* family = nullptr;
  for (auto& a : aliases_) {
    if (a->name == name) family = a.get();
  }
  if (family == nullptr) {
    aliases_.push_back(
        std::make_unique<AliasFamily>(AliasFamily{std::string(name), std::string(help), type, {}}));
    family = aliases_.back().get();
  } else if (family->type != type || family->help != help) {
    throw InvalidArgument(str_cat("metrics: alias family '", name, "' exists as a ",
                                  type_name(family->type), " with help '", family->help, "'"));
  }
  for (const AliasSeries& s : family->series) {
    if (s.labels == labels) {
      throw InvalidArgument(
          str_cat("metrics: alias '", name, label_text(labels), "' is registered already"));
    }
  }
  family->series.push_back(
      AliasSeries{std::move(labels), std::string(source), std::move(selects), owner});
}

std::vector<MetricsRegistry::Sample> MetricsRegistry::resolve(const AliasFamily& alias) const {
  std::vector<Sample> out;
  for (const AliasSeries& a : alias.series) {
    const Family* src = find_family(a.source);
    if (src == nullptr || src->type != alias.type) continue;
    const std::size_t first = out.size();  // this alias series' samples start here
    for (const Series& s : src->series) {
      const auto select =
          std::find_if(a.selects.begin(), a.selects.end(),
                       [&](const MetricLabels& p) { return includes(s.labels, p); });
      if (select == a.selects.end()) continue;
      Sample x = Sample::of(s);
      x.labels.clear();
      for (const auto& kv : s.labels) {
        if (!has_key(*select, kv.first) && !has_key(a.labels, kv.first)) x.labels.push_back(kv);
      }
      x.labels.insert(x.labels.end(), a.labels.begin(), a.labels.end());
      const auto same = std::find_if(out.begin() + static_cast<std::ptrdiff_t>(first), out.end(),
                                     [&](const Sample& o) { return o.labels == x.labels; });
      if (same == out.end()) {
        out.push_back(std::move(x));
      } else {
        (void)same->add(x);  // a histogram of other bounds is left out
      }
    }
  }
  return out;
}

void MetricsRegistry::forget(const void* owner) {
  MutexLock lock(mu_);
  for (auto& f : families_) {
    std::erase_if(f->series, [owner](const Series& s) { return s.owner == owner; });
  }
  std::erase_if(families_, [](const auto& f) { return f->series.empty(); });
  for (auto& a : aliases_) {
    std::erase_if(a->series, [owner](const AliasSeries& s) { return s.owner == owner; });
  }
  std::erase_if(aliases_, [](const auto& a) { return a->series.empty(); });
}

std::string MetricsRegistry::prometheus_text() const {
  MutexLock lock(mu_);
  std::string out;
  const auto family_text = [&out](const std::string& name, const std::string& help, Type type,
                                  const std::vector<Sample>& samples) {
    if (samples.empty()) return;
    out += str_cat("# HELP ", name, " ", escape(help, false), "\n# TYPE ", name, " ",
                   type_name(type), "\n");
    for (const Sample& s : samples) text_sample(out, name, s);
  };
  for (const auto& f : families_) {
    std::vector<Sample> samples;
    for (const Series& s : f->series) samples.push_back(Sample::of(s));
    family_text(f->name, f->help, f->type, samples);
  }
  for (const auto& a : aliases_) family_text(a->name, a->help, a->type, resolve(*a));
  return out;
}

std::string MetricsRegistry::json_text() const {
  MutexLock lock(mu_);
  std::string out = "{";
  const auto family_json = [&out](const std::string& name, const std::string& help, Type type,
                                  const std::vector<Sample>& samples) {
    if (samples.empty()) return;
    out += str_cat(out.size() > 1 ? "," : "", json_string(name), ":{\"type\":\"", type_name(type),
                   "\",\"help\":", json_string(help), ",\"series\":[");
    bool first = true;
    for (const Sample& s : samples) {
      out += first ? "{\"labels\":{" : ",{\"labels\":{";
      first = false;
      for (std::size_t i = 0; i < s.labels.size(); ++i) {
        out += str_cat(i ? "," : "", json_string(s.labels[i].first), ":",
                       json_string(s.labels[i].second));
      }
      out += "}";
      if (s.bounds != nullptr) {
        std::uint64_t cumulative = 0;
        std::string buckets;
        for (std::size_t i = 0; i < s.counts.size(); ++i) {
          cumulative += s.counts[i];
          const std::string le = i < s.bounds->size() ? json_number((*s.bounds)[i]) : "\"+Inf\"";
          buckets += str_cat(i ? "," : "", "[", le, ",", cumulative, "]");
        }
        out += str_cat(",\"count\":", cumulative, ",\"sum\":", json_number(s.sum), ",\"buckets\":[",
                       buckets, "]}");
      } else {
        out += str_cat(",\"value\":", json_number(s.value), "}");
      }
    }
    out += "]}";
  };
  for (const auto& f : families_) {
    std::vector<Sample> samples;
    for (const Series& s : f->series) samples.push_back(Sample::of(s));
    family_json(f->name, f->help, f->type, samples);
  }
  for (const auto& a : aliases_) family_json(a->name, a->help, a->type, resolve(*a));
  return out + "}";
}

double MetricsRegistry::value(std::string_view name, const MetricLabels& labels) const {
  MutexLock lock(mu_);
  if (const Family* f = find_family(name)) {
    for (const Series& s : f->series) {
      if (s.labels == labels) return s.scalar();
    }
    return -1;
  }
  if (const AliasFamily* a = find_alias(name)) {
    for (const Sample& s : resolve(*a)) {
      if (s.labels == labels) return s.scalar();
    }
  }
  return -1;
}

void MetricsRegistry::text_sample(std::string& out, const std::string& name, const Sample& s) {
  if (s.bounds == nullptr) {
    out += str_cat(name, label_text(s.labels), " ", number(s.value), "\n");
    return;
  }
  std::uint64_t cumulative = 0;
  for (std::size_t i = 0; i < s.counts.size(); ++i) {
    cumulative += s.counts[i];
    const std::string le = i < s.bounds->size() ? number((*s.bounds)[i]) : "+Inf";
    out += str_cat(name, "_bucket", label_text(s.labels, "le", le), " ", cumulative, "\n");
  }
  out += str_cat(name, "_sum", label_text(s.labels), " ", number(s.sum), "\n");
  // The count is the +Inf bucket's, so the two agree even while observe() runs.
  out += str_cat(name, "_count", label_text(s.labels), " ", cumulative, "\n");
}

void MetricsScope::attach(MetricsRegistry& registry, MetricLabels labels) {
  reset();
  registry_ = &registry;
  common_ = std::move(labels);
}

void MetricsScope::reset() {
  if (registry_ != nullptr) registry_->forget(this);
  registry_ = nullptr;
}

MetricLabels MetricsScope::with_common(MetricLabels labels) const {
  MetricLabels out = common_;
  out.insert(out.end(), labels.begin(), labels.end());
  return out;
}

}  // namespace hicache
