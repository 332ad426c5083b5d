#include "controller/radix/cost_model.h"

#include <algorithm>
#include <cmath>

namespace hicache::radix {

namespace {
constexpr double kMiB = 1024.0 * 1024.0;
}  // namespace

void LinkEstimate::sample(double ops, double bytes, double seconds) {
  if (ops < last_[0] || bytes < last_[1] || seconds < last_[2]) {
    last_[0] = last_[1] = last_[2] = 0;  // the counters started over
  }
  const double d_ops = ops - last_[0], d_bytes = bytes - last_[1], d_s = seconds - last_[2];
  // A change seen in part (the counters are read one after the other while a call lands) stays
  // for the next step's sample, which then sees all of it.
  if (d_ops <= 0 || d_s <= 0 || !std::isfinite(d_s) || !std::isfinite(d_bytes)) return;
  last_[0] = ops;
  last_[1] = bytes;
  last_[2] = seconds;
  fit(d_ops, d_bytes / kMiB, d_s);
}

void LinkEstimate::fit(double ops, double mib, double seconds) {
  // Recursive least squares with forgetting: x = (ops, mib), y = seconds.
  const double x[2] = {ops, mib};
  const double px[2] = {p_[0][0] * x[0] + p_[0][1] * x[1], p_[1][0] * x[0] + p_[1][1] * x[1]};
  const double denom = kForget + x[0] * px[0] + x[1] * px[1];
  const double k[2] = {px[0] / denom, px[1] / denom};
  const double err = seconds - (x[0] * theta_[0] + x[1] * theta_[1]);
  theta_[0] += k[0] * err;
  theta_[1] += k[1] * err;
  // Samples all alike leave one direction unobserved; its variance must not grow without bound.
  const double forget = p_[0][0] + p_[1][1] > 1e8 ? 1.0 : kForget;
  for (int i = 0; i < 2; ++i) {
    for (int j = 0; j < 2; ++j) p_[i][j] = (p_[i][j] - k[i] * px[j]) / forget;
  }
  ++samples_;
}

void LinkEstimate::reset() { *this = LinkEstimate(); }

double LinkEstimate::seconds(double ops, double bytes) const {
  // A fit that went negative in one parameter (noise over samples all alike) is read with that
  // parameter at zero.
  return std::max(0.0, theta_[0]) * ops + std::max(0.0, theta_[1]) * bytes / kMiB;
}

double LinkEstimate::bytes_per_second() const {
  if (!measured() || theta_[1] <= 0) return 0;
  return kMiB / theta_[1];
}

double LinkEstimate::latency_seconds() const { return measured() ? std::max(0.0, theta_[0]) : 0; }

PrefillEstimate::PrefillEstimate(std::optional<double> prior) {
  if (prior && *prior > 0) {
    tokens_ = 1024;
    seconds_ = *prior * tokens_;
  }
}

void PrefillEstimate::report(std::int64_t tokens, double seconds) {
  if (tokens <= 0) return;
  tokens_ = tokens_ * kDecay + static_cast<double>(tokens);
  seconds_ = seconds_ * kDecay + seconds;
}

CostRule::CostRule(std::optional<double> recompute_seconds_per_token, std::int64_t token_bytes)
    : on_(!recompute_seconds_per_token || *recompute_seconds_per_token > 0),
      token_bytes_(token_bytes),
      prefill_(recompute_seconds_per_token) {
  publish();
}

void CostRule::sample(Link link, double ops, double bytes, double seconds) {
  links_[static_cast<std::size_t>(link)].sample(ops, bytes, seconds);
  publish();
}

void CostRule::reset(Link link) {
  links_[static_cast<std::size_t>(link)].reset();
  publish();
}

void CostRule::report_prefill(std::int64_t tokens, double seconds) {
  prefill_.report(tokens, seconds);
  publish();
}

CostRule::Values CostRule::local() const {
  Values v = kNothingMeasured;
  auto put = [&](Link l, std::size_t at) {
    const LinkEstimate& e = link(l);
    const double bps = e.bytes_per_second();
    if (bps <= 0) return;
    v[at] = std::max<std::int64_t>(1, static_cast<std::int64_t>(std::min(bps, 1e18)));
    v[at + 1] = -static_cast<std::int64_t>(std::min(e.latency_seconds() * 1e9, 1e15));
  };
  put(Link::kHostLoad, 0);
  // A store's reads before the first one landed: its writes (the backups, which come first)
  // went over the same store, and say more than nothing of it.
  put(link(Link::kL3Read).measured() ? Link::kL3Read : Link::kL3Write, 2);
  v[5] = link(Link::kL3Read).measured() ? 1 : 0;
  if (prefill_.measured()) {
    v[4] = std::llround(std::min(prefill_.seconds_per_token() * 1e15, 9e18));
  }
  return v;
}

std::optional<double> CostRule::recompute_seconds(const Values& v, std::int64_t tokens) {
  if (v[4] == kUnmeasured) return std::nullopt;
  return static_cast<double>(tokens) * static_cast<double>(v[4]) * 1e-15;
}

bool CostRule::moving_pays(Move move, const Values& v, std::int64_t tokens,
                           std::int64_t extra_bytes, std::int64_t ops, std::int64_t wait_tokens,
                           std::int64_t wait_ops) {
  const bool load = move == Move::kLoad;
  const std::int64_t bps = v[load ? 0 : 2];
  const double latency = -static_cast<double>(v[load ? 1 : 3]) * 1e-9;
  const std::optional<double> recompute = recompute_seconds(v, tokens);
  if (bps == kUnmeasured || !recompute) return true;  // the move measures what is missing
  const double bytes = static_cast<double>(tokens + wait_tokens) *
                           static_cast<double>(token_bytes_) +
                       static_cast<double>(extra_bytes);
  const double move_s =
      static_cast<double>(ops + wait_ops) * latency + bytes / static_cast<double>(bps);
  (load ? inputs_.measured_load_gbps : inputs_.measured_prefetch_gbps) =
      static_cast<double>(bps) / 1e9;
  (load ? inputs_.last_load_estimate_s : inputs_.last_prefetch_estimate_s) = move_s;
  inputs_.last_recompute_estimate_s = *recompute;
  return move_s <= *recompute;
}

void CostRule::publish() {
  for (std::size_t i = 0; i < kLinks; ++i) {
    published_[2 * i].store(links_[i].bytes_per_second(), std::memory_order_relaxed);
    published_[2 * i + 1].store(links_[i].latency_seconds(), std::memory_order_relaxed);
  }
  published_[2 * kLinks].store(prefill_.seconds_per_token(), std::memory_order_relaxed);
}

void CostRule::register_in(MetricsScope& scope) const {
  for (std::size_t i = 0; i < kLinks; ++i) {
    scope.add_gauge_fn("hicache_link_bandwidth_bytes_per_second",
                       "Bytes per second of a link, fit online from its transfers (0: none yet)",
                       {{"link", kLinkNames[i]}},
                       [this, i] { return published_[2 * i].load(std::memory_order_relaxed); });
    scope.add_gauge_fn("hicache_link_latency_seconds",
                       "Seconds per call of a link beside its bytes, fit online (0: none yet)",
                       {{"link", kLinkNames[i]}},
                       [this, i] { return published_[2 * i + 1].load(std::memory_order_relaxed); });
  }
  scope.add_gauge_fn(
      "hicache_recompute_seconds_per_token",
      "The engine's prefill cost per computed token the cost rule weighs (0: not measured)", {},
      [this] { return published_[2 * kLinks].load(std::memory_order_relaxed); });
}

}  // namespace hicache::radix
