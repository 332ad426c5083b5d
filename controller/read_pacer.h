// ReadPacer: sizes a prefetch's storage reads so that one read takes about a target time. A
// cut or a terminate waits for the read in flight (a storage call cannot be interrupted), so a
// read of the configured cap on a slow store (64 MiB at 50 MB/s: 1.3 s) would hold the request
// that long past the moment recomputing would have been done.
//
// It fits seconds = latency + pages x per_page over the recent reads (least squares, each read
// weighing kDecay of the one after it) and asks for the pages that take the target:
// max(kTargetSeconds, 2 x latency), so a store whose calls cost a fixed latency still reads
// batches worth that latency. It starts at one page and at most doubles per read; while the
// recent reads all had one size (the fit cannot then tell latency from bandwidth) it doubles,
// which also re-measures a store that changed. Never below one page nor above `cap_pages`.
// observe() is called by one thread (the storage controller's prefetch I/O worker).
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>

namespace hicache {

class ReadPacer {
 public:
  static constexpr double kTargetSeconds = 0.02;
  static constexpr double kDecay = 0.8;

  explicit ReadPacer(std::int64_t cap_pages) : cap_(std::max<std::int64_t>(1, cap_pages)) {}

  // The pages of the next read (any thread).
  std::int64_t next_pages() const { return next_.load(std::memory_order_relaxed); }

  // A read of `pages` pages that took `seconds` (only whole successful reads inform it).
  void observe(std::int64_t pages, double seconds) {
    if (pages <= 0 || !(seconds >= 0) || !std::isfinite(seconds)) return;
    const auto n = static_cast<double>(pages);
    s0_ = s0_ * kDecay + 1;
    s1_ = s1_ * kDecay + n;
    s2_ = s2_ * kDecay + n * n;
    t0_ = t0_ * kDecay + seconds;
    t1_ = t1_ * kDecay + n * seconds;
    const double spread = s0_ * s2_ - s1_ * s1_;  // the sizes' variance, times s0^2
    // Without a spread of sizes the fit cannot tell latency from bandwidth: grow (explore).
    double want = static_cast<double>(cap_);
    if (spread > 1e-6 * s0_ * s2_) {
      const double per_page = (s0_ * t1_ - s1_ * t0_) / spread;
      latency_ = std::max(0.0, (t0_ - per_page * s1_) / s0_);
      const double target = std::max(kTargetSeconds, 2 * latency_);
      if (per_page > 0) want = (target - latency_) / per_page;  // else the latency is all
    }
    const double grown = static_cast<double>(std::min(cap_, 2 * pages));
    const auto next = static_cast<std::int64_t>(std::clamp(std::floor(want), 1.0, grown));
    next_.store(next, std::memory_order_relaxed);
  }

  double latency_seconds() const { return latency_; }

 private:
  const std::int64_t cap_;
  std::atomic<std::int64_t> next_{1};
  double s0_ = 0, s1_ = 0, s2_ = 0, t0_ = 0, t1_ = 0;
  double latency_ = 0;
};

}  // namespace hicache
