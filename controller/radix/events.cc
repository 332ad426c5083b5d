#include "controller/radix/events.h"

namespace hicache::radix {

void CacheEvents::register_in(MetricsScope& scope) const {
  const CacheEvents& e = *this;
  constexpr const char* kMatch = "hicache_match_tokens_total";
  constexpr const char* kMatchHelp =
      "Prompt tokens match_prefix found on each tier (none: not in the tree); every call counts";
  scope.add(kMatch, kMatchHelp, {{"tier", "device"}}, e.matched_device_tokens);
  scope.add(kMatch, kMatchHelp, {{"tier", "host"}}, e.matched_host_tokens);
  scope.add(kMatch, kMatchHelp, {{"tier", "none"}}, e.unmatched_tokens);
  scope.add("hicache_loaded_back_tokens_total", "Host tokens loaded back to the device", {},
            e.loaded_back_tokens);
  scope.add("hicache_prefetched_tokens_total", "Tokens prefetches from L3 added to the tree", {},
            e.prefetched_tokens);
  constexpr const char* kEvicted = "hicache_evicted_tokens_total";
  constexpr const char* kEvictedHelp = "Tokens evicted from a tier";
  scope.add(kEvicted, kEvictedHelp, {{"tier", "device"}}, e.evicted_device_tokens);
  scope.add(kEvicted, kEvictedHelp, {{"tier", "host"}}, e.evicted_host_tokens);
  constexpr const char* kRefused = kMissesMetric;
  constexpr const char* kRefusedHelp = kMissesHelp;
  scope.add(kRefused, kRefusedHelp, {{"reason", "evicted"}}, e.miss_evicted_tokens);
  scope.add(kRefused, kRefusedHelp, {{"reason", "load_refused_by_cost"}},
            e.miss_load_refused_tokens);
  scope.add(kRefused, kRefusedHelp, {{"reason", "prefetch_refused_by_cost"}},
            e.miss_prefetch_refused_tokens);
  scope.add(kRefused, kRefusedHelp, {{"reason", "prefetch_revoked"}}, e.miss_revoked_tokens);
  scope.add(kRefused, kRefusedHelp, {{"reason", "load_failed"}}, e.miss_load_failed_tokens);
  scope.add("hicache_write_failures_total", "Device-to-host writes that failed", {},
            e.write_failures);
  scope.add("hicache_collective_failures_total",
            "TP agreement calls that failed (each rank then goes alone)", {}, e.tp_failures);
  scope.add("hicache_demotions_total", "Demotion rounds between the watermarks", {}, e.demotions);
  scope.add("hicache_resets_total", "Cache resets", {}, e.resets);
}

}  // namespace hicache::radix
