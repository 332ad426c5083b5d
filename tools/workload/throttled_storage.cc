#include "tools/workload/throttled_storage.h"

#include <cmath>
#include <thread>

#include "transfer/errors.h"

namespace hicache::workload {

std::string L3Throttle::describe() const {
  if (!active()) return "off";
  std::string out;
  if (bytes_per_second > 0) out = str_cat(bytes_per_second / 1e6, " MB/s");
  if (latency_s > 0) out += str_cat(out.empty() ? "" : ", ", latency_s * 1e3, " ms per call");
  return out;
}

ThrottledStorage::ThrottledStorage(std::unique_ptr<StorageBackend> inner, L3Throttle throttle)
    : inner_(std::move(inner)), throttle_(throttle) {
  if (!inner_) throw InvalidArgument("ThrottledStorage: no store to wrap (null)");
  if (!std::isfinite(throttle_.bytes_per_second) || throttle_.bytes_per_second < 0) {
    throw InvalidArgument(str_cat("ThrottledStorage: bandwidth ", throttle_.bytes_per_second,
                                  " bytes/s (>= 0, 0: unlimited)"));
  }
  if (!std::isfinite(throttle_.latency_s) || throttle_.latency_s < 0) {
    throw InvalidArgument(str_cat("ThrottledStorage: latency ", throttle_.latency_s, " s (>= 0)"));
  }
}

ThrottledStorage::~ThrottledStorage() = default;

void ThrottledStorage::wait(std::uint64_t bytes) {
  const Clock::time_point now = Clock::now();
  Clock::time_point done =
      now + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(throttle_.latency_s));
  if (throttle_.bytes_per_second > 0 && bytes > 0) {
    const auto transfer = std::chrono::duration_cast<Clock::duration>(
        std::chrono::duration<double>(static_cast<double>(bytes) / throttle_.bytes_per_second));
    MutexLock lock(mu_);
    const Clock::time_point start = std::max(done, link_free_);
    link_free_ = start + transfer;
    done = link_free_;
  }
  std::this_thread::sleep_until(done);
  waited_ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - now).count();
}

std::size_t ThrottledStorage::batch_exists(std::span<const std::string> keys) {
  wait(0);
  return inner_->batch_exists(keys);
}

std::vector<bool> ThrottledStorage::exists_each(std::span<const std::string> keys) {
  wait(0);  // one call, as the store makes it
  return inner_->exists_each(keys);
}

std::vector<IoResult> ThrottledStorage::do_batch_get(std::span<const std::string> keys,
                                                     std::span<const ByteSpan> dst) {
  std::uint64_t bytes = 0;
  for (const ByteSpan& d : dst) bytes += d.size();
  wait(bytes);
  return inner_->batch_get(keys, dst);
}

std::vector<IoResult> ThrottledStorage::do_batch_set(std::span<const std::string> keys,
                                                     std::span<const ConstByteSpan> src) {
  std::uint64_t bytes = 0;
  for (const ConstByteSpan& s : src) bytes += s.size();
  wait(bytes);
  return inner_->batch_set(keys, src);
}

}  // namespace hicache::workload
