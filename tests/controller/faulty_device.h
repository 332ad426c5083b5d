// FaultyDevice (tests): the host backend with copies that fail on demand. It forwards everything
// to a HostDevice; while `fail_loads` is above zero, each copy enqueued into device memory (a
// host -> device load) throws DeviceError instead and takes one off the count, as a CUDA copy
// that cannot be issued would; `fail_writes` does the same for copies into host memory (device
// -> host writes), counted in `failed` too. Any copy
// into device memory counts: the controller's loads, and the simulated engine's staged page
// fills (stage_page_data); `copies_to_device` counts the copy calls that reached it. Every copy
// is also counted by its path: `copy_batches` (the direct io path) and `page_transfers` (the
// kernel io path, each with the block cap it was given in `max_blocks_seen`).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <utility>
#include <vector>

#include "transfer/errors.h"
#include "transfer/host_device.h"

namespace hicache::testing {

class FaultyDevice final : public Device {
 public:
  std::atomic<int> fail_loads{0};
  std::atomic<int> fail_writes{0};
  std::atomic<int> failed{0};            // copies failed so far
  std::atomic<int> copies_to_device{0};  // copy calls into device memory (failed ones too)
  std::atomic<int> copy_batches{0};      // copy_batch_async calls
  std::atomic<int> page_transfers{0};    // transfer_pages_async calls
  std::atomic<int> max_blocks_seen{-1};  // the last transfer_pages_async's max_blocks

  // The write gate: while held, each copy into host memory (a controller write batch is one
  // copy call) waits for a permit. hold_writes() arms it, allow_writes(n) lets n more through,
  // wait_for_held_writes(k) returns once k copies in all have had to wait at it (the k-th
  // waits now), release_writes() opens it.
  void hold_writes() {
    std::lock_guard lock(mu_);
    holding_ = true;
    permits_ = 0;
  }
  void allow_writes(int n) {
    std::lock_guard lock(mu_);
    permits_ += n;
    held_.notify_all();
  }
  void release_writes() {
    std::lock_guard lock(mu_);
    holding_ = false;
    held_.notify_all();
  }
  void wait_for_held_writes(int total) {
    std::unique_lock lock(mu_);
    held_.wait(lock, [&] { return held_total_ >= total; });
  }

  DeviceBackend backend() const override { return inner_.backend(); }
  std::string name() const override { return "faulty " + inner_.name(); }
  Buffer alloc_device(std::size_t bytes) override {
    Buffer b = inner_.alloc_device(bytes);
    std::lock_guard lock(mu_);
    const auto at = reinterpret_cast<std::uintptr_t>(b.data());
    device_ranges_.emplace_back(at, at + b.size());
    return b;
  }
  Buffer alloc_host(std::size_t bytes, const HostMemoryOptions& options = {}) override {
    return inner_.alloc_host(bytes, options);
  }
  bool device_memory_is_host_accessible() const override {
    return inner_.device_memory_is_host_accessible();
  }
  std::unique_ptr<Stream> create_stream() override {
    return std::make_unique<FaultyStream>(*this, inner_.create_stream());
  }
  std::unique_ptr<Stream> wrap_stream(void* native) override {
    return std::make_unique<FaultyStream>(*this, inner_.wrap_stream(native));
  }
  std::unique_ptr<Event> create_event() override { return inner_.create_event(); }
  void synchronize() override { inner_.synchronize(); }

 private:
  class FaultyStream final : public Stream {
   public:
    FaultyStream(FaultyDevice& device, std::unique_ptr<Stream> inner)
        : device_(device), inner_(std::move(inner)) {}
    void copy_async(void* dst, const void* src, std::size_t bytes) override {
      device_.maybe_fail(dst);
      inner_->copy_async(dst, src, bytes);
    }
    void copy_batch_async(std::span<const CopyRegion> regions) override {
      ++device_.copy_batches;
      if (!regions.empty()) device_.maybe_fail(regions.front().dst);
      inner_->copy_batch_async(regions);
    }
    void transfer_pages_async(const PageTransfer& t, int max_blocks = 0) override {
      ++device_.page_transfers;
      device_.max_blocks_seen = max_blocks;
      device_.maybe_fail(reinterpret_cast<const void*>(t.dst.base));
      inner_->transfer_pages_async(t, max_blocks);
    }
    void launch_host_func(std::function<void()> fn) override {
      inner_->launch_host_func(std::move(fn));
    }
    void record(Event& event) override { inner_->record(event); }
    void wait(const Event& event) override { inner_->wait(event); }
    void synchronize() override { inner_->synchronize(); }

   private:
    FaultyDevice& device_;
    std::unique_ptr<Stream> inner_;
  };

  void maybe_fail(const void* dst) {
    const auto at = reinterpret_cast<std::uintptr_t>(dst);
    {
      std::unique_lock lock(mu_);
      bool into_device = false;
      for (const auto& [lo, hi] : device_ranges_)
        into_device = into_device || (at >= lo && at < hi);
      if (!into_device) {
        if (holding_ && permits_ == 0) {
          ++held_total_;
          held_.notify_all();  // wait_for_held_writes
          held_.wait(lock, [this] { return !holding_ || permits_ > 0; });
        }
        if (holding_) --permits_;
        take_one(fail_writes, "injected write failure (FaultyDevice)");
        return;
      }
    }
    ++copies_to_device;
    take_one(fail_loads, "injected load failure (FaultyDevice)");
  }

  // Throws (counted) when `count` is above zero, taking one off it.
  void take_one(std::atomic<int>& count, const char* what) {
    for (int n = count.load(); n > 0;) {
      if (count.compare_exchange_weak(n, n - 1)) {
        ++failed;
        throw DeviceError(what);
      }
    }
  }

  HostDevice inner_;
  std::mutex mu_;
  std::condition_variable held_;  // the write gate's waiters, and wait_for_held_write()
  std::vector<std::pair<std::uintptr_t, std::uintptr_t>> device_ranges_;  // guarded by mu_
  bool holding_ = false;  // guarded by mu_
  int permits_ = 0;       // guarded by mu_
  int held_total_ = 0;    // guarded by mu_: copies that waited at the gate, in all
};

}  // namespace hicache::testing
