#include "storage/collective.h"

#include <chrono>

#include <algorithm>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>

#include "transfer/errors.h"

namespace hicache {
namespace {

// The call check: tag and call number folded into 62 bits (so negation cannot overflow).
std::int64_t call_check(std::string_view tag, std::uint64_t call) {
  std::uint64_t h = std::hash<std::string_view>{}(tag) ^ (call * 0x9E3779B97F4A7C15ull);
  h ^= h >> 29;
  return static_cast<std::int64_t>(h & ((1ull << 62) - 1));
}

}  // namespace

double Collective::seconds() const {
  return static_cast<double>(nanos_.load(std::memory_order_relaxed)) * 1e-9;
}

std::uint64_t Collective::calls() const {
  MutexLock lock(mu_);
  return calls_;
}

void Collective::fail_for_good_locked(std::string why) {
  if (!failure_.empty()) return;
  failure_ = std::move(why);
  close_transport(failure_);
}

CollectiveResult Collective::fail_locked(std::span<std::int64_t> values, std::string why) {
  std::fill(values.begin(), values.end(), 0);
  fail_for_good_locked(std::move(why));
  return CollectiveResult{false, failure_};
}

CollectiveResult Collective::min_allreduce(std::span<std::int64_t> values, std::string_view tag) {
  MutexLock lock(mu_);
  if (!failure_.empty()) return fail_locked(values, failure_);
  const std::uint64_t call = calls_++;
  auto where = [&] {
    return str_cat(name(), " collective, rank ", rank(), " of ", size(), ", call #", call, " '",
                   tag, "': ");
  };
  {
    MutexLock cancel_lock(cancel_mu_);
    if (!cancelled_.empty()) {
      // Refused before it began: nothing was sent, so the collective is not failed for good.
      --calls_;
      std::fill(values.begin(), values.end(), 0);
      return CollectiveResult{false, str_cat(where(), "cancelled: ", cancelled_)};
    }
    in_call_ = true;
  }
  const std::int64_t check = call_check(tag, call);
  buffer_.assign(values.begin(), values.end());
  buffer_.push_back(check);
  buffer_.push_back(-check);
  const auto started = std::chrono::steady_clock::now();
  std::string error = reduce_min(buffer_);
  nanos_ += std::chrono::duration_cast<std::chrono::nanoseconds>(
                std::chrono::steady_clock::now() - started)
                .count();
  std::string interrupted;
  {
    MutexLock cancel_lock(cancel_mu_);
    in_call_ = false;
    if (!interrupted_.empty()) interrupted = str_cat("cancelled during the call: ", interrupted_);
  }
  if (!error.empty()) {
    return fail_locked(values, str_cat(where(), interrupted.empty() ? error : interrupted));
  }
  if (!interrupted.empty()) {
    // The reduction completed before the interrupt took effect, so its values are returned. The
    // peers normally got theirs too, but closing the transport now (a hard close, an NCCL abort)
    // may cut off data a peer on another host still needed: that peer then fails its call, and
    // its values are zeros, never a partial result. Later calls here fail.
    fail_for_good_locked(str_cat(where(), interrupted));
  }
  const std::size_t n = values.size();
  if (buffer_[n] != -buffer_[n + 1]) {
    return fail_locked(values, str_cat(name(), " collective, rank ", rank(), " of ", size(), ", call #", call,
                        " '", tag, "': ranks entered different collective calls (divergence)"));
  }
  std::copy_n(buffer_.begin(), n, values.begin());
  return {};
}

void validate_group_config(std::string_view kind, int rank, int size, const std::string& store_dir,
                           std::chrono::milliseconds timeout) {
  if (size < 1 || rank < 0 || rank >= size) {
    throw InvalidArgument(str_cat(kind, " collective: rank ", rank, " outside [0, size ", size, ")"));
  }
  if (timeout.count() <= 0) {
    throw InvalidArgument(str_cat(kind, " collective: timeout ", timeout.count(), " ms"));
  }
  std::error_code ec;
  if (!store_dir.empty()) std::filesystem::create_directories(store_dir, ec);
  if (store_dir.empty() || !std::filesystem::is_directory(store_dir)) {
    throw InvalidArgument(str_cat(kind, " collective: store_dir '", store_dir,
                                  "' is not a directory"));
  }
}

GroupFailureNote::GroupFailureNote(const std::string& store_dir, const std::string& prefix)
    : path_((std::filesystem::path(store_dir) / (prefix + ".failed")).string()) {}

void GroupFailureNote::publish(int rank, const std::string& why) const {
  std::error_code ec;
  if (std::filesystem::exists(path_, ec)) return;
  // Written whole under a name of this rank's, then renamed: a reader sees all of it or nothing.
  const std::string tmp = str_cat(path_, ".", rank, ".tmp");
  bool written = false;
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << "rank " << rank << " failed: " << why;
    out.close();  // a write error may show only when the file is closed
    written = !out.fail();
  }
  if (written) std::filesystem::rename(tmp, path_, ec);
  if (!written || ec) std::filesystem::remove(tmp, ec);
}

void GroupFailureNote::clear() const {
  std::error_code ec;
  std::filesystem::remove(path_, ec);
}

std::string GroupFailureNote::read() const {
  std::ifstream in(path_);
  if (!in) return {};
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return text.empty() ? "a rank failed (no reason recorded)" : text;
}

std::string Collective::failure() const {
  MutexLock lock(mu_);
  return failure_;
}

bool Collective::in_call() const {
  MutexLock lock(cancel_mu_);
  return in_call_;
}

void Collective::cancel(std::string_view why) {
  if (size() == 1) return;  // never waits for anyone: nothing to end
  MutexLock lock(cancel_mu_);
  if (!cancelled_.empty()) return;
  cancelled_ = why.empty() ? std::string("cancelled") : std::string(why);
  if (in_call_ && interrupted_.empty()) {
    interrupted_ = cancelled_;
    interrupt(cancelled_);
  }
}

void Collective::resume() {
  MutexLock lock(cancel_mu_);
  // A call the cancel interrupted failed the collective (failure_), which this does not lift.
  cancelled_.clear();
}

// ---------------------------------------------------------------------------------------------
// InProcessGroup

struct InProcessGroup::State {
  int size;
  std::chrono::milliseconds timeout;
  Mutex mu;
  std::condition_variable cv;
  std::uint64_t generation HICACHE_GUARDED_BY(mu) = 0;
  int arrived HICACHE_GUARDED_BY(mu) = 0;
  std::vector<std::int64_t> acc HICACHE_GUARDED_BY(mu), result HICACHE_GUARDED_BY(mu);
  std::string broken HICACHE_GUARDED_BY(mu), divergence HICACHE_GUARDED_BY(mu);

  // Breaks the group for every rank (the first reason stays) and returns the reason.
  std::string break_group(std::string why) HICACHE_REQUIRES(mu) {
    if (broken.empty()) broken = std::move(why);
    cv.notify_all();
    return broken;
  }
};

namespace {

class InProcessRank final : public Collective {
 public:
  InProcessRank(std::shared_ptr<InProcessGroup> group, int rank, int size)
      : group_(std::move(group)), rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view name() const override { return "in-process"; }
  std::size_t max_values() const override { return kCollectiveMaxValues; }

 protected:
  std::string reduce_min(std::span<std::int64_t> buffer) override {
    // The buffer holds the two call-check elements beside the values (Gloo's limit, here too).
    if (buffer.size() > kCollectiveMaxValues + 2) {
      return str_cat("a call carries at most ", kCollectiveMaxValues, " values, not ",
                     buffer.size() - 2);
    }
    return group_->arrive(rank_, buffer);
  }
  void interrupt(const std::string& why) override { group_->interrupt(rank_, why); }
  void close_transport(const std::string& why) override { group_->leave(rank_, why); }

 private:
  std::shared_ptr<InProcessGroup> group_;
  int rank_, size_;
};

}  // namespace

InProcessGroup::InProcessGroup(int size, std::chrono::milliseconds timeout)
    : state_(std::make_shared<State>()) {
  if (size < 1) throw InvalidArgument(str_cat("in-process collective: size ", size, " < 1"));
  if (timeout.count() <= 0) {
    throw InvalidArgument(str_cat("in-process collective: timeout ", timeout.count(), " ms"));
  }
  state_->size = size;
  state_->timeout = timeout;
}

std::vector<std::unique_ptr<Collective>> InProcessGroup::make_ranks(
    int size, std::chrono::milliseconds timeout, std::shared_ptr<InProcessGroup>* group) {
  auto g = std::make_shared<InProcessGroup>(size, timeout);
  std::vector<std::unique_ptr<Collective>> ranks;
  for (int r = 0; r < size; ++r) ranks.push_back(std::make_unique<InProcessRank>(g, r, size));
  if (group != nullptr) *group = g;
  return ranks;
}

std::string InProcessGroup::divergence() const {
  MutexLock lock(state_->mu);
  return state_->divergence;
}

int InProcessGroup::waiting() const {
  MutexLock lock(state_->mu);
  return state_->arrived;
}

void InProcessGroup::interrupt(int rank, const std::string& why) {
  State& s = *state_;
  MutexLock lock(s.mu);
  s.break_group(str_cat("rank ", rank, " cancelled its call: ", why));
}

void InProcessGroup::leave(int rank, const std::string& why) {
  State& s = *state_;
  MutexLock lock(s.mu);
  s.break_group(str_cat("rank ", rank, "'s collective failed: ", why));
}

std::string InProcessGroup::arrive(int rank, std::span<std::int64_t> buffer) {
  State& s = *state_;
  MutexLock lock(s.mu);
  if (!s.broken.empty()) return s.broken;
  const std::uint64_t generation = s.generation;
  if (s.arrived == 0) {
    s.acc.assign(buffer.begin(), buffer.end());
  } else if (s.acc.size() != buffer.size()) {
    s.divergence = str_cat("rank ", rank, " reduces ", buffer.size() - 2,
                           " values while an earlier rank reduces ", s.acc.size() - 2);
    return s.break_group(s.divergence);
  } else {
    for (std::size_t i = 0; i < buffer.size(); ++i) s.acc[i] = std::min(s.acc[i], buffer[i]);
  }
  if (++s.arrived == s.size) {
    const std::size_t n = s.acc.size();
    if (n >= 2 && s.acc[n - 2] != -s.acc[n - 1] && s.divergence.empty()) {
      s.divergence = "ranks entered different collective calls (tag or call number differ)";
    }
    s.result = s.acc;
    s.arrived = 0;
    ++s.generation;
    s.cv.notify_all();
    std::copy(s.result.begin(), s.result.end(), buffer.begin());
    return {};
  }
  const auto deadline = std::chrono::steady_clock::now() + s.timeout;
  while (s.generation == generation && s.broken.empty()) {
    if (s.mu.wait_until(s.cv, deadline) == std::cv_status::timeout) break;
  }
  if (s.generation != generation) {
    std::copy(s.result.begin(), s.result.end(), buffer.begin());
    return {};
  }
  if (!s.broken.empty()) return s.broken;
  return s.break_group(str_cat("rank ", rank, " waited ", s.timeout.count(), " ms for ",
                        s.size - s.arrived, " other rank(s)"));
}

}  // namespace hicache
