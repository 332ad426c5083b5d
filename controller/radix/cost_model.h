// What moving KV costs against recomputing it, measured online (issue 39, "never slower than
// recomputing"): each link's bytes per second and per-operation latency, fit from the
// controllers' counters once per step (LinkEstimate), the engine's prefill cost per token from
// its reports (PrefillEstimate), and the rule that weighs them (CostRule).
//
// Under TP the ranks decide on the same numbers: CostRule::local() encodes this rank's
// estimates as min-reducible values, the step's one collective reduces them (the slowest
// link, the longest latency, the cheapest recompute: the cautious view), and every decision
// reads the agreed values (Agreement::costs).
//
// Not thread-safe but for the published gauges (register_in): the engine's main loop owns it.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>

#include "transfer/metrics.h"

namespace hicache::radix {

// One link's cost per call, t = ops * latency + bytes / bandwidth, fit by recursive least
// squares with forgetting (a sample's weight halves every ~35 samples) over the changes of the
// link's cumulative counters between two steps. Written by hand: two parameters, no library
// offers an online fit this small.
class LinkEstimate {
 public:
  // The link's cumulative counters now: calls, bytes and busy seconds (summed over the calls).
  // What changed since the last sample taken is one sample; no new call or no time: none yet
  // (the change waits for the next call). Counters that went back (a new store) start over.
  void sample(double ops, double bytes, double seconds);
  // Forgets every sample (a store attached or detached).
  void reset();
  bool measured() const { return samples_ > 0; }
  // REQUIRES measured(). Predicted seconds for `ops` calls moving `bytes`.
  double seconds(double ops, double bytes) const;
  double bytes_per_second() const;  // 0 before a sample
  double latency_seconds() const;   // 0 before a sample
  std::int64_t samples() const { return samples_; }

 private:
  static constexpr double kForget = 0.98;
  void fit(double ops, double mib, double seconds);
  double last_[3] = {0, 0, 0};  // the counters at the last call
  double theta_[2] = {0, 0};    // seconds per call, seconds per MiB
  double p_[2][2] = {{1e4, 0}, {0, 1e4}};
  std::int64_t samples_ = 0;
};

// The engine's prefill cost per computed token: an exponentially weighted ratio of the reported
// seconds over the reported tokens (each report's weight 0.9 of the next's), starting from the
// configured prior (weighed as 1024 tokens of reports) when there is one.
class PrefillEstimate {
 public:
  explicit PrefillEstimate(std::optional<double> prior);
  // One prefill: `tokens` computed in `seconds`. A report with no tokens carries no cost per
  // token and changes nothing. REQUIRES tokens >= 0, seconds finite and >= 0 (the caller checks).
  void report(std::int64_t tokens, double seconds);
  bool measured() const { return tokens_ > 0; }
  double seconds_per_token() const { return measured() ? seconds_ / tokens_ : 0; }

 private:
  static constexpr double kDecay = 0.9;
  double seconds_ = 0, tokens_ = 0;
};

// Moves KV only where moving it is predicted to take no longer than recomputing it.
class CostRule {
 public:
  enum class Link { kHostLoad, kHostWrite, kL3Read, kL3Write };
  static constexpr std::size_t kLinks = 4;
  static constexpr const char* kLinkNames[kLinks] = {"l2_to_l1", "l1_to_l2", "l3_to_l2",
                                                     "l2_to_l3"};
  enum class Move { kLoad, kPrefetch };  // host -> device, L3 -> host
  static constexpr std::int64_t kUnmeasured = std::numeric_limits<std::int64_t>::max();

  // What a decision weighs, encoded so that an element-wise minimum over the ranks is the
  // cautious view: [load bytes/s, -load latency ns, L3 read bytes/s, -L3 read latency ns,
  // recompute femtoseconds per token, L3 reads measured (1) or not (0)]; kUnmeasured for a rate
  // or a cost not measured (latency 0).
  static constexpr std::size_t kValues = 6;
  using Values = std::array<std::int64_t, kValues>;
  static constexpr Values kNothingMeasured = {kUnmeasured, 0, kUnmeasured, 0, kUnmeasured, 0};
  // Whether L3's reads were measured (on every rank, for agreed values); until then the read
  // estimate is the writes' (local()).
  static bool l3_reads_measured(const Values& v) { return v[5] == 1; }

  // The inputs of the last decision of each kind (RadixCacheStats reports them).
  struct Inputs {
    double measured_load_gbps = 0, last_load_estimate_s = 0;
    double measured_prefetch_gbps = 0, last_prefetch_estimate_s = 0;
    double last_recompute_estimate_s = 0;
  };

  // `recompute_seconds_per_token`: nothing (on, measured from the engine's reports alone), 0
  // (off: every hit moves), or > 0 (on, that value the prior of the reports). `token_bytes`:
  // the KV of one token over all layers.
  CostRule(std::optional<double> recompute_seconds_per_token, std::int64_t token_bytes);
  bool on() const { return on_; }

  // Once per step: each link's cumulative counters (calls, bytes, busy seconds).
  void sample(Link link, double ops, double bytes, double seconds);
  void reset(Link link);  // a new store: its links start over
  // The engine computed `tokens` of a prefill in `seconds`.
  void report_prefill(std::int64_t tokens, double seconds);

  const LinkEstimate& link(Link l) const { return links_[static_cast<std::size_t>(l)]; }
  const PrefillEstimate& prefill() const { return prefill_; }
  // This rank's estimates, encoded (see Values). Until L3's first read was measured, its reads
  // are predicted by its writes' estimate (backups come first, over the same store; the L3
  // paths still let one prefetch at a time through to measure the reads).
  Values local() const;

  // What moving `tokens` (plus `extra_bytes` that move with them: a hybrid model's sidecar
  // pages) in `ops` calls costs, after `wait_tokens` of KV in `wait_ops` calls queued ahead on
  // the same link, against recomputing the tokens, by the estimates `v`. True when moving takes no
  // longer, and when the link or the recompute cost is not measured yet (the move measures it).
  // Records the decision's inputs.
  bool moving_pays(Move move, const Values& v, std::int64_t tokens, std::int64_t extra_bytes = 0,
                   std::int64_t ops = 1, std::int64_t wait_tokens = 0, std::int64_t wait_ops = 0);
  // Seconds to recompute `tokens` by `v`; nothing when not measured.
  static std::optional<double> recompute_seconds(const Values& v, std::int64_t tokens);
  const Inputs& inputs() const { return inputs_; }

  // Gauges of this rank's estimates (hicache_link_bandwidth_bytes_per_second{link},
  // hicache_link_latency_seconds{link}, hicache_recompute_seconds_per_token; 0 while not
  // measured), read on any thread. This object must outlive the registration.
  void register_in(MetricsScope& scope) const;

 private:
  void publish();
  bool on_;
  std::int64_t token_bytes_;
  std::array<LinkEstimate, kLinks> links_;
  PrefillEstimate prefill_;
  Inputs inputs_;
  // What the gauges read: per link bandwidth and latency, then the recompute cost.
  std::array<std::atomic<double>, 2 * kLinks + 1> published_{};
};

}  // namespace hicache::radix
