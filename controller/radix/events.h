// radix::CacheEvents: what happened in HiRadixCache, counted where it happens (the engine's main
// loop, in any room of controller/radix/) and read by a metrics scrape on any thread (the
// counters are atomic). stats() and register_metrics() read them; register_in() names them as
// metrics, in one place.
#pragma once

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

  // Registers every counter above in `scope` (attached to a registry) under its metric name
  // (hicache_match_tokens_total by tier, hicache_misses_total by reason, ...). The counters
  // must outlive the registration (the scope's owner goes first).
  void register_in(MetricsScope& scope) const;
};

}  // namespace hicache::radix
