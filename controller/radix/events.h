// radix::CacheEvents: what happened in HiRadixCache, counted where it happens (the engine's main
// loop, in any room of controller/radix/) and read by a metrics scrape on any thread (the
// counters are atomic). stats() and register_metrics() read them; register_in() names them as
// metrics, in one place.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "transfer/metrics.h"

namespace hicache::radix {

struct CacheEvents {
  Counter demotions, evicted_device_tokens, evicted_host_tokens, load_backs_refused_by_cost,
      load_failures, loaded_back_tokens, prefetched_tokens, prefetches_refused_by_cost, resets,
      revoked_prefetches, tp_failures, write_failures, matched_device_tokens, matched_host_tokens,
      unmatched_tokens;
  // hicache_misses_total, in tokens, by reason (the counts above are ops)
  Counter miss_evicted_tokens, miss_load_refused_tokens, miss_prefetch_refused_tokens,
      miss_revoked_tokens, miss_load_failed_tokens;
  // Device tokens whose KV was freed with no host copy (recomputed if asked for again).
  Counter dropped_device_tokens;
  // Host tokens whose backup to L3 was skipped: the backup queue was full.
  Counter backup_dropped_tokens;
  // Exclusive admission: host tokens whose backup on leaving the host did not land in L3; they
  // stayed on the host (nothing is lost by the admission policy).
  Counter backup_kept_tokens;
  // Prefetches asked of L3 by outcome (hicache_prefetch_outcomes_total): asked for (a span of
  // whole pages continuing a keyed prefix), queued, declined before any query (span below the
  // threshold, queue or budget full, slower than recomputing, no host room).
  Counter prefetch_attempts, prefetches_issued, prefetches_too_short, prefetches_rate_limited,
      prefetches_host_full;
  // Prefetches declined because L3 holds none of the span, or less than the threshold: asked
  // of a store that answers without I/O, on one rank, before anything was reserved.
  Counter prefetches_absent;
  // Queued prefetches the cost rule cut: still loading once recomputing their tokens would have
  // been done (they keep the pages that arrived).
  Counter prefetches_cut;
  // Tokens of a queued prefetch's agreed L3 hit that the tree did not get, by reason: not
  // read in time or read failed, the request aborted, cached meanwhile by another request.
  Counter unfulfilled_transfer_tokens, unfulfilled_dropped_tokens, unfulfilled_shrunk_tokens;
  // Prompt tokens of the prefills the engine reported (record_prefill), by where they came from.
  Counter prefill_device_tokens, prefill_host_tokens, prefill_storage_tokens,
      prefill_computed_tokens;
  // Seconds per evict_device call that evicted (or scheduled) anything.
  Histogram device_eviction_seconds;
  // Per prefetch that read its whole hit: the steps (check_events calls) that began between its
  // last page landing and the cache taking its pages. 0 or 1: taken at the first step after
  // the I/O; more: the prefetch policy held it (hicache_prefetch_confirm_steps). Under TP the
  // last page is the last rank's (counted when every rank's I/O landed whole, from the
  // step's agreement), and each rank also counts the steps its own pages waited for the other
  // ranks' (hicache_prefetch_rank_wait_steps; TP only).
  static constexpr std::array<double, 9> kConfirmStepBounds = {0, 1, 2, 3, 4, 8, 16, 32, 64};
  Histogram prefetch_confirm_steps{
      std::vector<double>(kConfirmStepBounds.begin(), kConfirmStepBounds.end())};
  Histogram prefetch_rank_wait_steps{
      std::vector<double>(kConfirmStepBounds.begin(), kConfirmStepBounds.end())};

  // Counts one prefill (SGLang's per-batch prefill accounting): prompt tokens served from the
  // device, loaded back from the host, brought from L3 by a prefetch, and computed. Throws
  // InvalidArgument naming the value when one is negative (nothing is counted then).
  void record_prefill(std::int64_t device, std::int64_t host, std::int64_t storage,
                      std::int64_t computed);
  // The prefills' hit ratio so far: cached (device, host, storage) over all prompt tokens; 0
  // before the first.
  double prefill_hit_ratio() const;

  // Registers every counter above in `scope` (attached to a registry) under its metric name
  // (hicache_match_tokens_total by tier, hicache_misses_total by reason, ...). The counters
  // must outlive the registration (the scope's owner goes first).
  void register_in(MetricsScope& scope) const;
};

}  // namespace hicache::radix
