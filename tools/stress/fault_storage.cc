#include "tools/stress/fault_storage.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "tools/support/redis_launcher.h"
#include "transfer/errors.h"

namespace hicache::stress {

namespace fs = std::filesystem;

FaultInjectingStorage::FaultInjectingStorage(std::unique_ptr<StorageBackend> inner,
                                             std::uint64_t seed)
    : inner_(std::move(inner)), rng_(seed) {}

FaultInjectingStorage::~FaultInjectingStorage() = default;

void FaultInjectingStorage::set_rates(const FaultRates& rates) {
  MutexLock lock(mu_);
  rates_ = rates;
}

InjectedCounts FaultInjectingStorage::injected() const {
  return {errors_.load(), exists_errors_.load(), slow_.load(), timeouts_.load(),
          disk_full_sets_.load()};
}

bool FaultInjectingStorage::roll(double p) {
  if (p <= 0) return false;
  MutexLock lock(mu_);
  return std::uniform_real_distribution<double>(0, 1)(rng_) < p;
}

bool FaultInjectingStorage::delay_batch() {
  FaultRates r;
  std::int64_t slow_us = 0;
  {
    MutexLock lock(mu_);
    r = rates_;
    slow_us = std::uniform_int_distribution<std::int64_t>(0, std::int64_t{r.slow_ms} * 1000)(rng_);
  }
  if (roll(r.timeout)) {
    ++timeouts_;
    std::this_thread::sleep_for(std::chrono::milliseconds(r.timeout_ms));  // the fault itself
    return true;
  }
  if (roll(r.slow)) {
    ++slow_;
    std::this_thread::sleep_for(std::chrono::microseconds(slow_us));  // the fault itself
  }
  return false;
}

std::size_t FaultInjectingStorage::batch_exists(std::span<const std::string> keys) {
  double p;
  {
    MutexLock lock(mu_);
    p = rates_.exists_error;
  }
  if (roll(p)) {
    ++exists_errors_;
    return 0;  // an I/O error counts as absent
  }
  return inner_->batch_exists(keys);
}

std::vector<IoResult> FaultInjectingStorage::do_batch_get(std::span<const std::string> keys,
                                                          std::span<const ByteSpan> dst) {
  if (delay_batch()) {
    for (const ByteSpan& d : dst) std::memset(d.data(), 0xA5, d.size());
    return std::vector<IoResult>(keys.size(), IoResult::error("injected: timed out"));
  }
  auto results = inner_->batch_get(keys, dst);
  double p;
  {
    MutexLock lock(mu_);
    p = rates_.error;
  }
  for (std::size_t i = 0; i < results.size(); ++i) {
    if (results[i].is_ok() && roll(p)) {
      ++errors_;
      // The bytes landed, but the call failed: garbage is what a caller must never use.
      std::memset(dst[i].data(), 0x5A, dst[i].size());
      results[i] = IoResult::error("injected: read error");
    }
  }
  if (track_own_writes_) {
    MutexLock lock(ledger_mu_);
    for (std::size_t i = 0; i < results.size(); ++i) {
      if (results[i].is_ok() && own_keys_.count(keys[i]) == 0) ++foreign_reads_;
    }
  }
  return results;
}

std::vector<IoResult> FaultInjectingStorage::do_batch_set(std::span<const std::string> keys,
                                                          std::span<const ConstByteSpan> src) {
  if (disk_full_) {
    disk_full_sets_ += keys.size();
    return std::vector<IoResult>(keys.size(), IoResult::error("injected: No space left on device"));
  }
  if (delay_batch()) {
    return std::vector<IoResult>(keys.size(), IoResult::error("injected: timed out"));
  }
  double p;
  {
    MutexLock lock(mu_);
    p = rates_.error;
  }
  std::vector<IoResult> results(keys.size());
  std::vector<std::string> pass_keys;
  std::vector<ConstByteSpan> pass_src;
  std::vector<std::size_t> where;
  for (std::size_t i = 0; i < keys.size(); ++i) {
    if (roll(p)) {
      ++errors_;
      results[i] = IoResult::error("injected: write error");
    } else {
      pass_keys.push_back(keys[i]);
      pass_src.push_back(src[i]);
      where.push_back(i);
    }
  }
  // The ledger takes a key before the store does, so that another storage thread of this
  // process that reads it as soon as it lands never counts it as another instance's; a key the
  // store then refused leaves the ledger again (unless it was stored here before).
  std::vector<std::string> new_in_ledger;
  if (track_own_writes_) {
    MutexLock lock(ledger_mu_);
    for (const std::string& k : pass_keys) {
      if (own_keys_.insert(k).second) new_in_ledger.push_back(k);
    }
  }
  if (!pass_keys.empty()) {
    const auto inner = inner_->batch_set(pass_keys, pass_src);
    for (std::size_t j = 0; j < inner.size(); ++j) results[where[j]] = inner[j];
  }
  if (!new_in_ledger.empty()) {
    MutexLock lock(ledger_mu_);
    for (std::size_t j = 0; j < pass_keys.size(); ++j) {
      if (!results[where[j]].is_ok() &&
          std::find(new_in_ledger.begin(), new_in_ledger.end(), pass_keys[j]) != new_in_ledger.end()) {
        own_keys_.erase(pass_keys[j]);
      }
    }
  }
  return results;
}

namespace {

class FileCorruptor final : public Corruptor {
 public:
  explicit FileCorruptor(fs::path root) : root_(std::move(root)) {}

  bool flip_byte(std::mt19937_64& rng) override {
    const fs::path p = pick(rng);
    if (p.empty()) return false;
    const int fd = ::open(p.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) return false;
    bool ok = false;
    struct stat st {};
    if (::fstat(fd, &st) == 0 && st.st_size > 0) {
      const off_t at = static_cast<off_t>(rng() % static_cast<std::uint64_t>(st.st_size));
      unsigned char b = 0;
      if (::pread(fd, &b, 1, at) == 1) {
        b ^= static_cast<unsigned char>(1u << (rng() % 8));
        ok = ::pwrite(fd, &b, 1, at) == 1;
      }
    }
    ::close(fd);
    return ok;
  }

  bool truncate(std::mt19937_64& rng) override {
    const fs::path p = pick(rng);
    if (p.empty()) return false;
    std::error_code ec;
    const auto size = fs::file_size(p, ec);
    if (ec || size == 0) return false;
    fs::resize_file(p, rng() % size, ec);
    return !ec;
  }

 private:
  // A uniformly chosen record file (reservoir sampling over one directory scan).
  fs::path pick(std::mt19937_64& rng) {
    fs::path chosen;
    std::uint64_t seen = 0;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(root_, ec)) {
      if (!e.is_regular_file(ec)) continue;
      if (rng() % ++seen == 0) chosen = e.path();
    }
    return chosen;
  }

  fs::path root_;
};

class RedisCorruptor final : public Corruptor {
 public:
  explicit RedisCorruptor(std::function<std::vector<int>()> ports) : ports_(std::move(ports)) {}

  bool flip_byte(std::mt19937_64& rng) override {
    bench::RespClient c(pick(rng));
    std::string key, value;
    if (!random_record(c, key, value)) return false;
    const std::size_t at = rng() % value.size();
    std::string b(1, static_cast<char>(value[at] ^ static_cast<char>(1u << (rng() % 8))));
    const std::string offset = std::to_string(at);
    return c.command({"SETRANGE", key, offset, b}).rfind(':', 0) == 0;
  }

  bool truncate(std::mt19937_64& rng) override {
    bench::RespClient c(pick(rng));
    std::string key, value;
    if (!random_record(c, key, value)) return false;
    return c.command({"SET", key, std::string_view(value).substr(0, rng() % value.size())}) == "+OK";
  }

 private:
  // A random stored key and its value; false when the store is empty or unreachable.
  static bool random_record(bench::RespClient& c, std::string& key, std::string& value) {
    if (!c.ok()) return false;
    key = c.command({"RANDOMKEY"});
    if (key.empty() || key == "$-1") return false;
    value = c.command({"GET", key});
    return !value.empty() && value != "$-1";
  }

  int pick(std::mt19937_64& rng) const {
    const std::vector<int> ports = ports_();
    return ports.empty() ? 0 : ports[rng() % ports.size()];
  }

  std::function<std::vector<int>()> ports_;
};

}  // namespace

std::unique_ptr<Corruptor> make_file_corruptor(fs::path root) {
  return std::make_unique<FileCorruptor>(std::move(root));
}

std::unique_ptr<Corruptor> make_redis_corruptor(std::function<std::vector<int>()> ports) {
  return std::make_unique<RedisCorruptor>(std::move(ports));
}

}  // namespace hicache::stress
