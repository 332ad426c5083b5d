// ThrottledStorage: a what-if slow L3 for hicache-bench (--l3-bandwidth, --l3-latency-ms). It
// wraps a real store and forwards every call to it; each batch_exists, batch_get and batch_set
// also takes at least `latency_s`, and each get and set its payload bytes at
// `bytes_per_second` on one link that every calling thread shares: transfers reserve the link
// in the order they reach it (one timeline), so four threads do not get four times the
// bandwidth. The wait is spent on the calling thread, which is the storage controller's own I/O
// thread: its queues, batching and cut-offs see a slow store exactly as they would see a slow
// device. A deduplicated set is charged as if written (the store answers after the wait).
//
// Records, counters and removals are the wrapped store's (wrapped()): stats(), the metrics and
// the KV events' removal observer see the real store; name() is its name.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "storage/storage_backend.h"
#include "transfer/mutex.h"

namespace hicache::workload {

struct L3Throttle {
  double bytes_per_second = 0;  // the shared link; 0: unlimited
  double latency_s = 0;         // per call
  bool active() const { return bytes_per_second > 0 || latency_s > 0; }
  // "50 MB/s, 20 ms per call" (or "off").
  std::string describe() const;
};

class ThrottledStorage final : public StorageBackend {
 public:
  // Throws InvalidArgument naming the value for a negative or non-finite rate or latency, and
  // for a null store.
  ThrottledStorage(std::unique_ptr<StorageBackend> inner, L3Throttle throttle);
  ~ThrottledStorage() override;

  std::string_view name() const override { return inner_->name(); }
  std::size_t batch_exists(std::span<const std::string> keys) override;
  std::vector<bool> exists_each(std::span<const std::string> keys) override;
  // A query waits latency_s when one is set (it is I/O then), else the store answers.
  bool exists_without_io() const override {
    return throttle_.latency_s <= 0 && inner_->exists_without_io();
  }
  void touch(std::span<const std::string> keys) override { inner_->touch(keys); }  // in memory
  bool remove(const std::string& key) override { return inner_->remove(key); }
  void clear() override { inner_->clear(); }
  std::int64_t preferred_batch_pages(std::int64_t page_bytes) const override {
    return inner_->preferred_batch_pages(page_bytes);
  }

  const L3Throttle& throttle() const { return throttle_; }
  // Seconds the calls waited in all (summed over threads).
  double waited_seconds() const { return static_cast<double>(waited_ns_.load()) * 1e-9; }

 protected:
  std::vector<IoResult> do_batch_get(std::span<const std::string> keys,
                                     std::span<const ByteSpan> dst) override;
  std::vector<IoResult> do_batch_set(std::span<const std::string> keys,
                                     std::span<const ConstByteSpan> src) override;
  StorageBackend* wrapped() const override { return inner_.get(); }

 private:
  using Clock = std::chrono::steady_clock;
  // Waits out one call of `bytes` payload: the latency, then the call's turn on the link.
  void wait(std::uint64_t bytes) HICACHE_EXCLUDES(mu_);

  std::unique_ptr<StorageBackend> inner_;
  const L3Throttle throttle_;
  Mutex mu_;
  Clock::time_point link_free_ HICACHE_GUARDED_BY(mu_){};  // when the link's last reservation ends
  std::atomic<std::int64_t> waited_ns_{0};
};

}  // namespace hicache::workload
