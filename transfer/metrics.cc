#include "transfer/metrics.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
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
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
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

struct MetricsRegistry::Family {
  std::string name, help;
  Type type;
  std::vector<Series> series;
};

MetricsRegistry::MetricsRegistry() = default;
MetricsRegistry::~MetricsRegistry() = default;

MetricsRegistry::Family& MetricsRegistry::family(std::string_view name, std::string_view help,
                                                 Type type) {
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

void MetricsRegistry::forget(const void* owner) {
  MutexLock lock(mu_);
  for (auto& f : families_) {
    std::erase_if(f->series, [owner](const Series& s) { return s.owner == owner; });
  }
  std::erase_if(families_, [](const auto& f) { return f->series.empty(); });
}

std::string MetricsRegistry::prometheus_text() const {
  MutexLock lock(mu_);
  std::string out;
  for (const auto& f : families_) {
    out += str_cat("# HELP ", f->name, " ", escape(f->help, false), "\n# TYPE ", f->name, " ",
                   type_name(f->type), "\n");
    for (const Series& s : f->series) {
      const auto* h = std::get_if<const Histogram*>(&s.source);
      if (h == nullptr) {
        out += str_cat(f->name, label_text(s.labels), " ", number(s.scalar()), "\n");
        continue;
      }
      const auto counts = (*h)->counts();
      std::uint64_t cumulative = 0;
      for (std::size_t i = 0; i < counts.size(); ++i) {
        cumulative += counts[i];
        const std::string le = i < (*h)->bounds().size() ? number((*h)->bounds()[i]) : "+Inf";
        out += str_cat(f->name, "_bucket", label_text(s.labels, "le", le), " ", cumulative, "\n");
      }
      out += str_cat(f->name, "_sum", label_text(s.labels), " ", number((*h)->sum()), "\n");
      // The count is the +Inf bucket's, so the two agree even while observe() runs.
      out += str_cat(f->name, "_count", label_text(s.labels), " ", cumulative, "\n");
    }
  }
  return out;
}

std::string MetricsRegistry::json_text() const {
  MutexLock lock(mu_);
  std::string out = "{";
  for (const auto& f : families_) {
    out += str_cat(out.size() > 1 ? "," : "", json_string(f->name), ":{\"type\":\"",
                   type_name(f->type), "\",\"help\":", json_string(f->help), ",\"series\":[");
    bool first = true;
    for (const Series& s : f->series) {
      out += first ? "{\"labels\":{" : ",{\"labels\":{";
      first = false;
      for (std::size_t i = 0; i < s.labels.size(); ++i) {
        out += str_cat(i ? "," : "", json_string(s.labels[i].first), ":",
                       json_string(s.labels[i].second));
      }
      out += "}";
      if (const auto* h = std::get_if<const Histogram*>(&s.source)) {
        const auto counts = (*h)->counts();
        std::uint64_t cumulative = 0;
        std::string buckets;
        for (std::size_t i = 0; i < counts.size(); ++i) {
          cumulative += counts[i];
          const std::string le =
              i < (*h)->bounds().size() ? json_number((*h)->bounds()[i]) : "\"+Inf\"";
          buckets += str_cat(i ? "," : "", "[", le, ",", cumulative, "]");
        }
        out += str_cat(",\"count\":", cumulative, ",\"sum\":", json_number((*h)->sum()),
                       ",\"buckets\":[", buckets, "]}");
      } else {
        out += str_cat(",\"value\":", json_number(s.scalar()), "}");
      }
    }
    out += "]}";
  }
  return out + "}";
}

double MetricsRegistry::value(std::string_view name, const MetricLabels& labels) const {
  MutexLock lock(mu_);
  for (const auto& f : families_) {
    if (f->name != name) continue;
    for (const Series& s : f->series) {
      if (s.labels == labels) return s.scalar();
    }
  }
  return -1;
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
