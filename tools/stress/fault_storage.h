// Fault injection for hicache-stress.
//
// FaultInjectingStorage wraps a real backend and, at configurable rates, turns results into
// errors (a get's span is then filled with garbage, which the contract says nobody may use),
// delays batches (slow storage), times batches out (a delay, then every key an error), fails
// sets as a full disk would, and fails exists queries. Everything it injects is counted.
//
// It can also keep a ledger of the keys stored through it (track_own_writes): a page read back
// whose key this process never stored was written by another process on the same store, which
// is how hicache-stress --instances counts the L3 hits one instance takes from another's pages.
//
// Corruptors change stored records behind the backend's back: flip one byte of a random record,
// or truncate one, in the file store's directory or in Redis (RANDOMKEY, SETRANGE / SET). The
// backend must detect every one when it is read (a miss counted as a bad record), never serve it.
#pragma once

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <unordered_set>

#include "storage/storage_backend.h"
#include "transfer/mutex.h"

namespace hicache::stress {

struct FaultRates {
  double error = 0;         // per key of a get or set: an error result
  double exists_error = 0;  // per exists query: fails (counts as nothing stored)
  double slow = 0;          // per batch: a delay of up to slow_ms
  int slow_ms = 20;
  double timeout = 0;       // per batch: timeout_ms, then every key an error "timed out"
  int timeout_ms = 50;
};

struct InjectedCounts {
  std::uint64_t errors = 0, exists_errors = 0, slow = 0, timeouts = 0, disk_full_sets = 0;
};

class FaultInjectingStorage final : public StorageBackend {
 public:
  FaultInjectingStorage(std::unique_ptr<StorageBackend> inner, std::uint64_t seed);
  ~FaultInjectingStorage() override;

  void set_rates(const FaultRates& rates);
  // While on, every set fails with "No space left on device" (for stores without a real one).
  void set_disk_full(bool on) { disk_full_ = on; }
  InjectedCounts injected() const;
  // From now on, remember every key a set stored and count the pages a get read whose key was
  // never stored here (foreign_reads). Off by default (the ledger grows with the keys stored).
  void track_own_writes() { track_own_writes_ = true; }
  std::uint64_t foreign_reads() const { return foreign_reads_.load(); }
  StorageBackend& inner() { return *inner_; }

  std::string_view name() const override { return "fault-injecting"; }
  std::size_t batch_exists(std::span<const std::string> keys) override;
  void touch(std::span<const std::string> keys) override { inner_->touch(keys); }
  bool remove(const std::string& key) override { return inner_->remove(key); }
  void clear() override { inner_->clear(); }
  std::int64_t preferred_batch_pages(std::int64_t page_bytes) const override {
    return inner_->preferred_batch_pages(page_bytes);
  }

 protected:
  std::vector<IoResult> do_batch_get(std::span<const std::string> keys,
                                     std::span<const ByteSpan> dst) override;
  std::vector<IoResult> do_batch_set(std::span<const std::string> keys,
                                     std::span<const ConstByteSpan> src) override;

 private:
  bool roll(double p) HICACHE_EXCLUDES(mu_);
  // Slow or timed out (true: the caller answers every key with an error).
  bool delay_batch() HICACHE_EXCLUDES(mu_);

  std::unique_ptr<StorageBackend> inner_;
  mutable Mutex mu_;
  std::mt19937_64 rng_ HICACHE_GUARDED_BY(mu_);
  FaultRates rates_ HICACHE_GUARDED_BY(mu_);
  std::atomic<bool> disk_full_{false};
  std::atomic<bool> track_own_writes_{false};
  mutable Mutex ledger_mu_;
  std::unordered_set<std::string> own_keys_ HICACHE_GUARDED_BY(ledger_mu_);
  std::atomic<std::uint64_t> foreign_reads_{0};
  std::atomic<std::uint64_t> errors_{0}, exists_errors_{0}, slow_{0}, timeouts_{0},
      disk_full_sets_{0};
};

// Changes a random stored record behind the store's back. Both return false when the store
// holds nothing to corrupt right now.
class Corruptor {
 public:
  virtual ~Corruptor() = default;
  virtual bool flip_byte(std::mt19937_64& rng) = 0;
  virtual bool truncate(std::mt19937_64& rng) = 0;
};

// Records are the regular files directly under `root` (not .tmp/ or .trash/).
std::unique_ptr<Corruptor> make_file_corruptor(std::filesystem::path root);
// Over RESP connections to 127.0.0.1: a record of a server `ports` returns (asked each time: the
// masters of a cluster change with failovers), chosen at random.
std::unique_ptr<Corruptor> make_redis_corruptor(std::function<std::vector<int>()> ports);

}  // namespace hicache::stress
