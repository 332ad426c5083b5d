// SimulatedEngine: the main loop of a serving engine around HiRadixCache, for the workload tool
// and the tests (an embedding engine has its own). Each step() does what a scheduler does:
//
//   1. check_events() on the cache (acks, finished prefetches);
//   2. admit waiting requests into the batch (up to max_batch): match the prefix; when L3 is on
//      and the request continues past the tree, start a prefetch and let the request wait for
//      it (other requests run meanwhile); once it is over, match again (and ask L3 again when
//      the tree lost part of the prefix while the request waited for memory);
//   3. for each admitted request: lock its prefix, load back the host part (when the cache
//      accepts), allocate device slots for the tokens to compute (evicting when short);
//   4. start_loading(), then the forward pass layer by layer: wait for layer l's loads
//      (DeviceKVPool::wait_for_layer) and "compute" it for cost_per_token_layer seconds per
//      computed token, so loads overlap with compute;
//   5. verify, byte for byte, every page the batch read from the cache (device prefix, loaded
//      back, prefetched) against the data its token prefix derives;
//   6. one decode step for the requests decoding; a request whose answer is complete writes
//      its new pages' data, is inserted, frees the duplicate slots, unlocks, finishes.
//
// Decode: a request's last `output_tokens` tokens are its answer. Prefill computes the prompt
// (and produces the first output token); the request then decodes one token per step, each
// decode step costing `decode_step_seconds` for the whole decoding batch, and holds its device
// slots (prompt and answer) until it finishes, when its whole pages go into the tree, so that
// the next round of a conversation finds its answer cached too (as SGLang inserts finished
// requests). Requests report TTFT (arrival to the end of the prefill), end-to-end latency and
// the mean inter-token latency through drain_finished().
//
// Hybrid models (a controller with sidecar pools, docs/hybrid.md): the engine is a hybrid
// reference model. Every computed page writes each all_pages pool's page, and each trailing
// pool's pages at its checkpoints (every checkpoint_every_pages pages and the sequence's last
// page, with the window before each); each page's data derives from the whole prefix and the
// pool, as a model's state after that page does. A request restores the state at its
// restorable prefix (the match is cut there): every sidecar page that restore reads (an
// all_pages pool's pages of the prefix, a trailing pool's window before its end) is checked
// byte for byte, as the KV pages are. An insert takes the sidecar pages of the pages computed;
// a pool short of device room evicts device nodes and, with none left while writes are in
// flight, applies and waits for their acks; when it still has no room, the request is not
// inserted (its slots go back), as an engine drops a cache entry it cannot complete.
//
// Page data derives from the whole token prefix of the page (as a model's KV does), so any tier
// can be checked: every page a request finds cached is verified before its prefill counts.
// Where the CPU cannot read device memory (CUDA), pages are written and read through a pinned
// one-page staging buffer and the engine's own stream (a copy and a synchronisation per page, on
// the main loop; the loads the check follows are complete by then, wait_for_layer having
// returned). `stage_page_data` takes that path on the host backend too, so tests cover it.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "controller/hi_radix_cache.h"
#include "transfer/device.h"

namespace hicache {

struct SimulatedRequest {
  std::string id;
  std::vector<std::int32_t> tokens;  // prompt, then the answer's output_tokens
  std::int32_t output_tokens = 0;    // 0: prefill only
  std::string identity;  // the cache identity (tenant, LoRA adapter); empty: none
  // When the request arrived (TTFT counts from here); default: when submitted.
  std::chrono::steady_clock::time_point arrival{};

  // The tokens before the answer.
  std::span<const std::int32_t> prompt() const {
    return std::span(tokens).first(tokens.size() - static_cast<std::size_t>(output_tokens));
  }
};

// What a finished request reports. Tokens of the prompt by where they came from: the device
// prefix, host pages loaded back (of which `storage_hit_tokens` came from L3 by this request's
// prefetch), and computed.
struct FinishedRequest {
  std::string id;
  std::int64_t prompt_tokens = 0, output_tokens = 0;
  std::int64_t device_hit_tokens = 0, host_hit_tokens = 0, storage_hit_tokens = 0;
  std::int64_t computed_tokens = 0;
  double ttft_s = 0, e2e_s = 0;
  double itl_s = 0;  // mean time between output tokens (0 with fewer than 2)
  bool aborted = false;  // reset() ended it: only the id is meaningful
};

struct SimulatedEngineConfig {
  int max_batch = 8;                   // requests admitted per prefill forward pass
  int max_running = 64;                // requests prefilling or decoding at once
  double decode_step_seconds = 0.0;    // simulated cost of one decode forward pass
  double cost_per_token_layer = 0.0;   // simulated compute, seconds per token per layer
  bool use_storage = true;             // prefetch from L3 when the cache has one
  int max_prefetches = 2;              // prefetches in flight; later requests wait their turn
                                       // (by then the tree may hold what they would fetch)
  // Before admitting, evict host pages (LRU) until this fraction of the host pool is free, so
  // writes keep finding room (pages then live on in L3 when it is on).
  double host_free_target = 0.1;
  // Keep per-request records for drain_finished() (off: only the totals in stats()).
  bool record_finished = true;
  // Write and verify page data through copies to a staging page even where the CPU could reach
  // device memory directly (always on where it cannot).
  bool stage_page_data = false;
  // Mixed into every page's data seed: a TP rank's slice of the KV differs from another's (the
  // rank's number), so a page served from another rank's slice fails its check. 0: none.
  std::uint64_t data_salt = 0;
  // Hybrid models: a trailing sidecar pool's checkpoints, every this many pages (and at the
  // end of every sequence inserted). >= 1.
  std::int32_t checkpoint_every_pages = 4;
};

struct SimulatedEngineStats {
  std::int64_t steps = 0, finished = 0;
  std::int64_t step_calls = 0;  // step() calls, those that could run nothing included
  std::int64_t prompt_tokens = 0;
  std::int64_t output_tokens = 0;
  std::int64_t device_hit_tokens = 0;   // served from the device prefix
  std::int64_t loaded_back_tokens = 0;  // host -> device for the request
  std::int64_t storage_hit_tokens = 0;  // of those, prefetched from L3 for the request
  std::int64_t computed_tokens = 0;
  std::int64_t prefetches = 0;
  std::int64_t verified_pages = 0, mismatched_pages = 0;  // sidecar pages included
  std::int64_t verified_sidecar_pages = 0;  // of verified_pages, sidecar pools' (hybrid)
  std::int64_t uncached_requests = 0;  // hybrid: finished without insert (a pool had no room)
  std::int64_t deferred = 0;  // admissions put back for lack of device memory
  std::int64_t rejected = 0;  // requests larger than the device pool can ever hold, or whose
                              // loads failed kMaxLoadFailures times
  std::int64_t failed_prefills = 0;  // prefills dropped (and retried) because a load failed
  double step_seconds = 0;    // wall time inside step(), compute included
  double compute_seconds = 0; // simulated compute (prefill and decode)
  std::int64_t decode_steps = 0;
  std::int64_t aborted = 0;  // requests reset() ended
};

// The 64-bit seed of page `page` of `tokens`: a hash of the whole prefix up to its end, and of
// the cache identity (a tenant's or an adapter's KV differs for the same tokens, so a page
// served across identities fails its check).
std::uint64_t page_data_seed(std::span<const std::int32_t> tokens, std::size_t page,
                             std::int32_t page_size, std::string_view identity = {});

class SimulatedEngine {
 public:
  SimulatedEngine(HiRadixCache& cache, HiCacheController& controller, DeviceKVPool& device_pool,
                  HostKVPool& host_pool, Device& device, SimulatedEngineConfig config = {});

  void submit(SimulatedRequest request);
  // One scheduler step; false when nothing was waiting or running. A step that can run nothing
  // (every request waits for a prefetch, or for memory that in-flight acks will free) returns
  // true at once; wait_for_progress() then sleeps until that changes.
  bool step();
  // After a step() that could run nothing: sleeps until an event it waits for (an ack, a
  // prefetch changing stage, a prefetch timeout) or `deadline`, with no polling (with TP ranks,
  // which must keep stepping together, it only yields). After any other step it returns at once.
  // Sleeps kQuietWait at most: false when that long passed with nothing happening.
  bool wait_for_progress(std::optional<std::chrono::steady_clock::time_point> deadline = {});
  // Steps until every submitted request finished (or `max_steps`, or kQuietWaits quiet waits
  // in a row: an op in flight that never answers, a bug, ends the loop instead of hanging it).
  void run_until_idle(std::int64_t max_steps = 1 << 30);
  static constexpr std::chrono::seconds kQuietWait{1};
  static constexpr int kQuietWaits = 30;
  std::size_t waiting() const { return waiting_.size() + prefetching_.size(); }
  std::size_t decoding() const { return decoding_.size(); }
  // Steps (without admitting anything new beyond what is queued) until no write, load or
  // backup is in flight, so that what the tree holds is on the host and in L3: an instance
  // hands a conversation over to another through L3 after this. Returns at `max_steps`.
  void flush(std::int64_t max_steps = 1 << 30);
  // Aborts every request (reported by drain_finished() with `aborted`) and resets the cache
  // (HiRadixCache::reset): what a serving engine does to flush its cache under traffic.
  // Returns the number of requests aborted.
  std::size_t reset();
  // The requests finished since the last call (config.record_finished).
  std::vector<FinishedRequest> drain_finished();
  const SimulatedEngineStats& stats() const { return stats_; }
  // The first verification failure ("request R page P"), or empty.
  const std::string& first_mismatch() const { return first_mismatch_; }

 private:
  // The seed of page `page` of the request's tokens, salted with data_salt.
  std::uint64_t data_seed(const SimulatedRequest& request, std::size_t page) const;
  struct Waiting {
    SimulatedRequest request;
    int storage_asks = 0;
    std::int64_t known_before_prefetch = 0;  // tree prefix at the last ask
    std::int64_t storage_tokens = 0;  // what its prefetch added to the tree
    int load_failures = 0;            // prefills dropped because their loads failed
  };
  struct Running {
    SimulatedRequest request;
    HiRadixCache::Node* held = nullptr;
    std::vector<std::int64_t> slots;     // cached prefix, then the computed pages
    std::size_t cached_tokens = 0;       // read from the cache (to verify)
    std::size_t prompt_tokens = 0;
    std::int32_t left = 0;               // output tokens still to decode
    std::chrono::steady_clock::time_point first_token{};
    FinishedRequest report;
    // What it waited with (kept for a retry after failed loads).
    int storage_asks = 0;
    std::int64_t known_before_prefetch = 0, storage_tokens = 0;
    int load_failures = 0;
  };
  static constexpr int kMaxStorageAsks = 3;
  static constexpr int kMaxLoadFailures = 3;
  bool admit(Waiting& w, std::vector<Running>& batch);
  // Reports `r`'s prefill to the cache (record_prefill), with its share of the forward pass's
  // compute time when compute is simulated.
  void account(const Running& r, std::optional<double> compute_seconds);
  void retry_after_failed_loads(std::vector<Running>& batch);
  void verify(const Running& r);
  // Hybrid: checks the sidecar pages the restore of r's cached prefix reads.
  void verify_sidecars(const Running& r);
  // Hybrid: the pages of pool `pool` a sequence of `pages` pages whose first `from` pages were
  // cached inserts.
  std::vector<std::int64_t> sidecar_pages(std::size_t pool, std::size_t from,
                                          std::size_t pages) const;
  // The seed of pool `pool`'s page `page` of the request.
  std::uint64_t sidecar_seed(const SimulatedRequest& request, std::size_t page,
                             std::size_t pool) const;
  // Device slots of `n` pages of sidecar pool `pool`, evicting while short; nothing when they
  // do not fit.
  std::optional<std::vector<std::int64_t>> alloc_sidecar(std::size_t pool, std::int64_t n);
  void note_mismatch(const Running& r, const std::string& what);
  // Writes page `page` of the device pool with the data of `seed` / checks it (directly, or
  // through the staging page).
  void fill_device_page(std::int64_t page, std::uint64_t seed);
  bool verify_device_page(std::int64_t page, std::uint64_t seed);
  void stage_copy(std::int64_t page, bool to_device);
  void finish(Running& r);
  void decode_step();
  bool wait_quietly(std::optional<std::chrono::steady_clock::time_point> deadline);

  HiRadixCache& cache_;
  HiCacheController& controller_;
  DeviceKVPool& device_pool_;
  HostKVPool& host_pool_;
  SimulatedEngineConfig config_;
  std::int32_t page_size_;
  std::deque<Waiting> waiting_;
  std::vector<Waiting> prefetching_;
  std::vector<Running> decoding_;
  std::vector<FinishedRequest> finished_;
  SimulatedEngineStats stats_;
  std::string first_mismatch_;
  // The staging path (null where the CPU writes device pages directly).
  Buffer staging_;  // declared first: the stream goes first
  std::unique_ptr<Stream> staging_stream_;
  LayoutDesc staging_desc_{};
  std::vector<CopyRegion> staging_regions_;
  std::uint64_t events_seen_ = 0;  // the cache's event_seq() when the last step began
  bool stalled_ = false;           // the last step could run nothing
};

}  // namespace hicache
