#include "controller/radix/events.h"

#include "transfer/errors.h"

namespace hicache::radix {

void CacheEvents::record_prefill(std::int64_t device, std::int64_t host, std::int64_t storage,
                                 std::int64_t computed) {
  const std::pair<const char*, std::int64_t> parts[] = {
      {"device", device}, {"host", host}, {"storage", storage}, {"computed", computed}};
  for (const auto& [name, tokens] : parts) {
    if (tokens < 0) {
      throw InvalidArgument(str_cat("record_prefill: ", name, " tokens ", tokens, " < 0"));
    }
  }
  prefill_device_tokens += static_cast<std::uint64_t>(device);
  prefill_host_tokens += static_cast<std::uint64_t>(host);
  prefill_storage_tokens += static_cast<std::uint64_t>(storage);
  prefill_computed_tokens += static_cast<std::uint64_t>(computed);
}

double CacheEvents::prefill_hit_ratio() const {
  const auto cached = static_cast<double>(
      prefill_device_tokens.value() + prefill_host_tokens.value() + prefill_storage_tokens.value());
  const double all = cached + static_cast<double>(prefill_computed_tokens.value());
  return all > 0 ? cached / all : 0;
}

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
  scope.add("hicache_eviction_duration_seconds",
            "Time of an evict_device call that evicted or scheduled anything", {{"tier", "device"}},
            e.device_eviction_seconds);
  scope.add("hicache_prefetch_confirm_steps",
            "Steps begun between a prefetch's last page landing (under TP: on the last rank) "
            "and the cache taking its pages (prefetches that read their whole hit; 0 or 1: at "
            "the first step after the I/O)",
            {}, e.prefetch_confirm_steps);
  scope.add("hicache_prefetch_rank_wait_steps",
            "TP: steps a prefetch's pages, landed whole on this rank, waited for the other "
            "ranks' to land",
            {}, e.prefetch_rank_wait_steps);
  scope.add("hicache_dropped_tokens_total",
            "Device tokens whose KV was freed with no host copy (recomputed when asked again)",
            {{"tier", "device"}, {"reason", "no_host_copy"}}, e.dropped_device_tokens);
  scope.add("hicache_backup_dropped_tokens_total",
            "Host tokens whose backup to L3 was skipped, by reason", {{"reason", "queue_full"}},
            e.backup_dropped_tokens);
  scope.add("hicache_backup_kept_tokens_total",
            "Host tokens kept on the host because their backup to L3 on leaving it did not "
            "land (exclusive storage admission)",
            {{"reason", "backup_failed"}}, e.backup_kept_tokens);
  constexpr const char* kRefused = kMissesMetric;
  constexpr const char* kRefusedHelp = kMissesHelp;
  scope.add(kRefused, kRefusedHelp, {{"reason", "evicted"}}, e.miss_evicted_tokens);
  scope.add(kRefused, kRefusedHelp, {{"reason", "load_refused_by_cost"}},
            e.miss_load_refused_tokens);
  scope.add(kRefused, kRefusedHelp, {{"reason", "prefetch_refused_by_cost"}},
            e.miss_prefetch_refused_tokens);
  scope.add(kRefused, kRefusedHelp, {{"reason", "prefetch_revoked"}}, e.miss_revoked_tokens);
  scope.add(kRefused, kRefusedHelp, {{"reason", "load_failed"}}, e.miss_load_failed_tokens);
  constexpr const char* kOutcomes = kPrefetchOutcomesMetric;
  constexpr const char* kOutcomesHelp = kPrefetchOutcomesHelp;
  scope.add(kOutcomes, kOutcomesHelp, {{"outcome", "attempts"}}, e.prefetch_attempts);
  scope.add(kOutcomes, kOutcomesHelp, {{"outcome", "issued"}}, e.prefetches_issued);
  scope.add(kOutcomes, kOutcomesHelp, {{"outcome", "declined_too_short"}}, e.prefetches_too_short);
  scope.add(kOutcomes, kOutcomesHelp, {{"outcome", "declined_rate_limited"}},
            e.prefetches_rate_limited);
  scope.add(kOutcomes, kOutcomesHelp, {{"outcome", "declined_by_cost"}},
            e.prefetches_refused_by_cost);
  scope.add(kOutcomes, kOutcomesHelp, {{"outcome", "declined_host_full"}}, e.prefetches_host_full);
  scope.add(kOutcomes, kOutcomesHelp, {{"outcome", "declined_absent"}}, e.prefetches_absent);
  scope.add(kOutcomes, kOutcomesHelp, {{"outcome", "cut_by_cost"}}, e.prefetches_cut);
  constexpr const char* kUnfulfilled = kPrefetchUnfulfilledMetric;
  constexpr const char* kUnfulfilledHelp = kPrefetchUnfulfilledHelp;
  scope.add(kUnfulfilled, kUnfulfilledHelp, {{"reason", "storage_transfer"}},
            e.unfulfilled_transfer_tokens);
  scope.add(kUnfulfilled, kUnfulfilledHelp, {{"reason", "dropped"}}, e.unfulfilled_dropped_tokens);
  scope.add(kUnfulfilled, kUnfulfilledHelp, {{"reason", "shrunk"}}, e.unfulfilled_shrunk_tokens);
  constexpr const char* kPrefill = "hicache_prefill_tokens_total";
  constexpr const char* kPrefillHelp =
      "Prompt tokens of the prefills the engine reported, by where they came from";
  scope.add(kPrefill, kPrefillHelp, {{"source", "device"}}, e.prefill_device_tokens);
  scope.add(kPrefill, kPrefillHelp, {{"source", "host"}}, e.prefill_host_tokens);
  scope.add(kPrefill, kPrefillHelp, {{"source", "storage"}}, e.prefill_storage_tokens);
  scope.add(kPrefill, kPrefillHelp, {{"source", "computed"}}, e.prefill_computed_tokens);
  scope.add_gauge_fn("hicache_prefill_hit_ratio",
                     "Cached prompt tokens over all prompt tokens of the reported prefills", {},
                     [&e] { return e.prefill_hit_ratio(); });
  scope.add("hicache_write_failures_total", "Device-to-host writes that failed", {},
            e.write_failures);
  scope.add("hicache_collective_failures_total",
            "TP agreement calls that failed (each rank then goes alone)", {}, e.tp_failures);
  scope.add("hicache_demotions_total", "Demotion rounds between the watermarks", {}, e.demotions);
  scope.add("hicache_resets_total", "Cache resets", {}, e.resets);
}

}  // namespace hicache::radix
