// The radix cache's test engine, shared by the hi_radix_cache_*_test.cc files: a small engine
// around a HiRadixCache (pools, controller, optional L3) that runs requests as a scheduler does
// and verifies every page it serves byte for byte, and the helpers the tests build prompts with.
#pragma once

#include "controller/hi_radix_cache.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <map>
#include <optional>
#include <random>
#include <thread>

#include <filesystem>
#include <fstream>
#include <unistd.h>

#include "pools/kv_pattern.h"
#include "storage/file_storage.h"
#include "transfer/errors.h"
#include "transfer/host_device.h"
#include "tests/controller/faulty_device.h"
#include "tests/controller/forwarding_store.h"

namespace hicache::radix_test {

constexpr std::int32_t kPage = 4;

inline KVGeometry geometry() { return KVGeometry::mha(2, 1, 8, DType::kFloat16, kPage); }

// The data of page i of a sequence derives from its whole token prefix, as a model's KV does,
// and from the cache identity (a LoRA adapter's KV differs for the same tokens).
inline std::uint64_t page_seed(std::span<const std::int32_t> tokens, std::size_t page,
                        std::string_view identity = {}) {
  const auto prefix = tokens.first((page + 1) * kPage);
  return std::hash<std::string_view>{}(std::string_view(
             reinterpret_cast<const char*>(prefix.data()), prefix.size_bytes())) ^
         (identity.empty() ? 0 : std::hash<std::string_view>{}(identity) * 31);
}

inline KeyNamespace key_ns() {
  return {.model = "m", .fingerprint = "f", .dtype = "fp16", .layout = "page_first",
          .page_size = kPage};
}

// An L3 shared by several engines: a file store in a temporary directory.
struct L3 {
  std::filesystem::path root;
  FileStorage file;
  LocalCollective local;
  // The storage controller's collectives (TP tests give each its group).
  Collective* prefetch = &local;
  Collective* backup = &local;
  Collective* main = &local;
  // The store engines use: the file store, or a test's wrapper around it.
  StorageBackend* store = &file;
  explicit L3(const std::string& name)
      : root(std::filesystem::temp_directory_path() / str_cat("hicache-radix-", name, "-", ::getpid())),
        file(FileStorageConfig{.root = (std::filesystem::remove_all(root), root.string())}) {}
  ~L3() { std::filesystem::remove_all(root); }
};

using testing::Forwarding;

// A gate the test opens; callers wait at it.
class Gate {
 public:
  // Waits until open (counted as held meanwhile).
  void pass() {
    std::unique_lock lock(mu_);
    ++held_;
    cv_.notify_all();
    cv_.wait(lock, [&] { return open_; });
    --held_;
  }
  bool held() {
    std::lock_guard lock(mu_);
    return held_ > 0;
  }
  void wait_held() {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return held_ > 0; });
  }
  void open() {
    std::lock_guard lock(mu_);
    open_ = true;
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int held_ = 0;
  bool open_ = false;
};

// Reads are slow: each waits `delay`, and once `free_reads` went through, each waits at the gate.
class SlowReads final : public Forwarding {
 public:
  SlowReads(StorageBackend& inner, std::chrono::milliseconds delay, int free_reads)
      : Forwarding(inner), delay_(delay), free_reads_(free_reads) {}
  ~SlowReads() override { gate.open(); }
  int reads() const { return reads_.load(); }
  Gate gate;

 protected:
  std::vector<IoResult> do_batch_get(std::span<const std::string> keys,
                                     std::span<const ByteSpan> dst) override {
    std::this_thread::sleep_for(delay_);  // the slow store (a test's, never a hot path)
    if (reads_++ >= free_reads_) gate.pass();
    return inner_.batch_get(keys, dst);
  }

 private:
  const std::chrono::milliseconds delay_;
  const int free_reads_;
  std::atomic<int> reads_{0};
};

// Hands the controller's queued loads to its load thread and waits on every layer, as a
// forward pass does.
inline void run_loads(HiCacheController& controller, DeviceKVPool& device_pool) {
  const std::int32_t slot = controller.start_loading();
  if (slot < 0) return;
  for (std::int32_t l = 0; l < geometry().num_layers; ++l) {
    EXPECT_TRUE(device_pool.wait_for_layer(l)) << "a load failed: layer " << l;
  }
  controller.layer_done_counter().release(slot);
}

// Holds what match `m` found for a request: locks its deepest node and loads its host part
// back (waiting on every layer), or, when the load back is refused, holds the device part only.
// `slots` gets the device slots of the prefix held; *loaded says whether it loaded. Returns the
// node locked.
inline HiRadixCache::Node* hold_match(HiRadixCache& cache, HiCacheController& controller,
                                      DeviceKVPool& device_pool,
                                      const HiRadixCache::MatchResult& m,
                                      std::vector<std::int64_t>& slots, bool* loaded) {
  HiRadixCache::Node* held = m.last_host_node;
  cache.lock(held);
  slots = m.device_slots;
  *loaded = false;
  if (m.host_hit_tokens == 0) return held;
  if (auto back = cache.load_back(held)) {
    slots = std::move(*back);
    run_loads(controller, device_pool);
    *loaded = true;
    return held;
  }
  cache.unlock(held);
  cache.lock(m.last_device_node);
  return m.last_device_node;
}

// Every device and host slot is the tree's (no request holds any, no op in flight), and the
// tree is consistent.
inline void expect_tree_accounting(const HiRadixCache& cache, const DeviceKVPool& device_pool,
                                   const HostKVPool& host_pool) {
  const auto s = cache.stats();
  EXPECT_EQ(device_pool.allocator().capacity_tokens() - device_pool.allocator().free_tokens(),
            s.device_tokens);
  EXPECT_EQ(host_pool.capacity_tokens() - host_pool.free_tokens(), s.host_tokens);
  EXPECT_EQ(cache.check_invariants(), "");
}

// A small engine around the cache: what a scheduler does for one request.
struct Engine {
  testing::FaultyDevice device;  // fails nothing unless a test asks
  DeviceKVPool device_pool;
  HostKVPool host_pool;
  HiCacheController controller;
  KeyNamespace ns = key_ns();
  std::unique_ptr<StorageController> storage;
  HiRadixCache cache;
  std::int64_t verified_pages = 0, recomputed_pages = 0, loaded_requests = 0, dropped = 0;
  std::int64_t requests = 0;

  Engine(WritePolicy policy, std::int64_t device_pages, std::int64_t host_pages,
         RadixCacheConfig config = {}, L3* l3 = nullptr, StorageControllerConfig sc = {},
         Collective* tp = nullptr)
      : device_pool(device, geometry(), device_pages * kPage),
        host_pool(device, geometry(), HostLayout::kPageFirst, host_pages * kPage),
        controller(device, device_pool, host_pool, ControllerConfig{.write_policy = policy}),
        storage(l3 == nullptr ? nullptr
                              : std::make_unique<StorageController>(host_pool, *l3->store, ns,
                                                                    *l3->prefetch, *l3->backup,
                                                                    *l3->main, sc)),
        cache(controller, device_pool, host_pool, config, storage.get(),
              l3 == nullptr ? nullptr : &ns, tp) {}

  // Runs one request: match, load back, "compute" the rest, insert, release. Every page it reads
  // from the cache is checked byte for byte against the data its prefix derives.
  void run(std::span<const std::int32_t> tokens, std::string_view identity = {}) {
    check();
    auto m = cache.match_prefix(tokens, identity);
    const std::size_t known = m.device_slots.size() + static_cast<std::size_t>(m.host_hit_tokens);
    if (storage && tokens.size() / kPage * kPage > known) {
      // Past the tree: ask L3 for the rest, wait for it (a scheduler would run other requests
      // meanwhile), and match again.
      const std::string id = str_cat("req-", ++requests);
      if (cache.prefetch_from_storage(id, m.last_host_node, tokens.subspan(known), identity)) {
        while (!cache.check_prefetch_progress(id)) check();
        m = cache.match_prefix(tokens, identity);
      }
    }
    std::vector<std::int64_t> slots;
    bool loaded = false;
    HiRadixCache::Node* held = hold_match(cache, controller, device_pool, m, slots, &loaded);
    loaded_requests += loaded ? 1 : 0;
    const std::size_t cached_pages = slots.size() / kPage;
    for (std::size_t p = 0; p < cached_pages; ++p) {
      ASSERT_TRUE(verify_page(device_pool.layout(), slots[p * kPage] / kPage,
                              page_seed(tokens, p, identity)))
          << "page " << p << " served with wrong bytes";
      ++verified_pages;
    }
    const std::size_t total_pages = tokens.size() / kPage;
    const auto missing = static_cast<std::int64_t>((total_pages - cached_pages) * kPage);
    if (missing > 0) {
      auto fresh = device_pool.allocator().alloc(missing);
      if (!fresh) {
        cache.evict_device(missing);
        fresh = device_pool.allocator().alloc(missing);
      }
      for (int attempt = 0; attempt < 4 && !fresh; ++attempt) {
        // Nodes with writes or loads in flight cannot go yet (write-back frees on the ack):
        // wait for them, as a scheduler keeps the request queued, then evict again.
        settle();
        fresh = device_pool.allocator().alloc(missing);
        if (!fresh) {
          cache.evict_device(missing);
          fresh = device_pool.allocator().alloc(missing);
        }
      }
      if (!fresh) {  // everything left is in use by this request: drop it
        ++dropped;
        cache.unlock(held);
        return;
      }
      for (std::size_t p = cached_pages; p < total_pages; ++p) {
        fill_page(device_pool.layout(), (*fresh)[(p - cached_pages) * kPage] / kPage,
                  page_seed(tokens, p, identity));
        ++recomputed_pages;
      }
      slots.insert(slots.end(), fresh->begin(), fresh->end());
    }
    const std::int64_t dup = cache.insert(tokens.first(total_pages * kPage), slots, identity);
    // Slots [cached, dup) are ours and duplicate the tree's: free them.
    const auto ours_from = static_cast<std::int64_t>(cached_pages * kPage);
    if (dup > ours_from) {
      device_pool.allocator().free(std::span(slots).subspan(ours_from, dup - ours_from));
    }
    cache.unlock(held);
  }

  // The step's check_events, counted when an op was in flight (under TP the only call that
  // reduces, and only then).
  void check() {
    const auto s = cache.stats();
    if (s.writes_in_flight + s.loads_in_flight + s.backups_in_flight > 0 ||
        cache.prefetches_in_flight() > 0) {
      ++busy_checks;
    }
    cache.check_events();
  }
  std::int64_t busy_checks = 0;

  // Lets every write and load finish and applies the acks.
  void settle() {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    do {
      check();
      const auto s = cache.stats();
      if (s.writes_in_flight == 0 && s.loads_in_flight == 0 && s.backups_in_flight == 0 &&
          cache.prefetches_in_flight() == 0) {
        return;
      }
      std::this_thread::yield();
    } while (std::chrono::steady_clock::now() < deadline);
    FAIL() << "writes or loads never finished";
  }

  // Every device and host slot is the tree's (no request holds any between runs).
  void expect_accounting() {
    settle();
    expect_tree_accounting(cache, device_pool, host_pool);
  }
};

inline std::vector<std::int32_t> seq(std::initializer_list<std::int32_t> pages_of) {
  std::vector<std::int32_t> t;
  for (std::int32_t v : pages_of) {
    for (int i = 0; i < kPage; ++i) t.push_back(v * 10 + i);
  }
  return t;
}

// Stores `tokens` in L3 as an engine does: a write-through engine runs them and settles.
// Returns the tokens it backed up.
inline std::int64_t store_in_l3(L3& l3, std::span<const std::int32_t> tokens,
                         std::string_view identity = {}) {
  Engine first(WritePolicy::kWriteThrough, 32, 64, {}, &l3);
  first.run(tokens, identity);
  first.settle();
  first.expect_accounting();
  return first.cache.stats().stored_tokens;
}

}  // namespace hicache::radix_test
