#include "controller/metrics_aliases.h"

#include "transfer/errors.h"

namespace hicache {
namespace {

using Type = MetricsRegistry::Type;

// One engine family: its series share the type and the help.
struct Family {
  std::string name;
  Type type;
  std::string help;
  struct Series {
    MetricLabels labels;
    std::string source;
    std::vector<MetricLabels> selects;
  };
  std::vector<Series> series;
};

std::vector<EngineMetricAlias> flatten(const std::vector<Family>& families) {
  std::vector<EngineMetricAlias> out;
  for (const Family& f : families) {
    for (const Family::Series& s : f.series) {
      out.push_back(EngineMetricAlias{f.name, f.type, s.labels, s.source, s.selects, f.help});
    }
  }
  return out;
}

std::vector<EngineMetricAlias> build() {
  const MetricLabels host = {{"tier", "host"}}, device = {{"tier", "device"}};
  const MetricLabels l1_to_l2 = {{"direction", "l1_to_l2"}}, l2_to_l1 = {{"direction", "l2_to_l1"}};
  const MetricLabels l2_to_l3 = {{"direction", "l2_to_l3"}}, l3_to_l2 = {{"direction", "l3_to_l2"}};
  const MetricLabels from_device = {{"source", "device"}}, from_host = {{"source", "host"}},
                     from_storage = {{"source", "storage"}}, computed = {{"source", "computed"}};
  const MetricLabels kv = {{"pool", "kv"}};
  const MetricLabels any;  // a select every series of the family matches
  constexpr const char* kPrefill = "hicache_prefill_tokens_total";
  std::vector<Family> f = {
      // SGLang (python/sglang/srt/metrics/collector.py and its HiCache collectors).
      {"sglang:hicache_host_used_tokens",
       Type::kGauge,
       "Host (L2) token slots in use",
       {{{}, "hicache_pool_used_tokens", {host}}}},
      {"sglang:hicache_host_total_tokens",
       Type::kGauge,
       "Host (L2) token slots",
       {{{}, "hicache_pool_capacity_tokens", {host}}}},
      {"sglang:prefill_effective_tokens_total",
       Type::kCounter,
       "Prompt tokens of the prefills by mode: computed (input) or hit on a tier",
       {{{{"mode", "input"}}, kPrefill, {computed}},
        {{{"mode", "device_hit"}}, kPrefill, {from_device}},
        {{{"mode", "host_hit"}}, kPrefill, {from_host}},
        {{{"mode", "storage_hit"}}, kPrefill, {from_storage}}}},
      {"sglang:cached_tokens_total",
       Type::kCounter,
       "Cached prompt tokens of the prefills by the tier they came from",
       {{{{"cache_source", "device"}}, kPrefill, {from_device}},
        {{{"cache_source", "host"}}, kPrefill, {from_host}},
        {{{"cache_source", "storage"}}, kPrefill, {from_storage}}}},
      {"sglang:cache_hit_rate",
       Type::kGauge,
       "Cached over all prompt tokens of the prefills so far (0 to 1)",
       {{{}, "hicache_prefill_hit_ratio", {any}}}},
      {"sglang:load_back_tokens_total",
       Type::kCounter,
       "Tokens loaded from host to device",
       {{kv, kTokensMetric, {l2_to_l1}}}},
      {"sglang:load_back_bytes_total",
       Type::kCounter,
       "KV bytes loaded from host to device",
       {{{}, "hicache_bytes_total", {l2_to_l1}}}},
      {"sglang:load_back_duration_seconds",
       Type::kHistogram,
       "Host-to-device load batch latency, submit to acknowledgement",
       {{{}, "hicache_op_latency_seconds", {l2_to_l1}}}},
      {"sglang:hicache_backup_tokens_total",
       Type::kCounter,
       "Tokens written from device to host",
       {{kv, kTokensMetric, {l1_to_l2}}}},
      {"sglang:hicache_backup_bytes_total",
       Type::kCounter,
       "KV bytes written from device to host",
       {{{}, "hicache_bytes_total", {l1_to_l2}}}},
      {"sglang:hicache_backup_duration_seconds",
       Type::kHistogram,
       "Device-to-host write latency, submit to acknowledgement",
       {{{}, "hicache_op_latency_seconds", {l1_to_l2}}}},
      {"sglang:evicted_tokens_total",
       Type::kCounter,
       "Tokens evicted from the device",
       {{{}, "hicache_evicted_tokens_total", {device}}}},
      {"sglang:eviction_duration_seconds",
       Type::kHistogram,
       "Time of a device eviction call that evicted anything",
       {{{}, "hicache_eviction_duration_seconds", {device}}}},
      {"sglang:hicache_dropped_tokens_total",
       Type::kCounter,
       "Device tokens whose KV was freed with no host copy, by reason and pool",
       {{{{"reason", "no_host_copy"}, {"pool", "kv"}},
         "hicache_dropped_tokens_total",
         {{{"tier", "device"}, {"reason", "no_host_copy"}}}}}},
      {"sglang:prefetched_tokens_total",
       Type::kCounter,
       "Tokens prefetches read from L3 and kept (the agreed completed prefix)",
       {{{}, "hicache_prefetched_tokens_total", {any}}}},
      {"sglang:backuped_tokens_total",
       Type::kCounter,
       "Tokens written from host to L3",
       {{{}, kTokensMetric, {l2_to_l3}}}},
      {"sglang:prefetch_pgs",
       Type::kHistogram,
       "Pages per L3 read call",
       {{{}, "hicache_storage_batch_pages", {l3_to_l2}}}},
      {"sglang:backup_pgs",
       Type::kHistogram,
       "Pages per L3 write call",
       {{{}, "hicache_storage_batch_pages", {l2_to_l3}}}},
      {"sglang:prefetch_bandwidth",
       Type::kHistogram,
       "GB/s per L3 read call",
       {{{}, "hicache_storage_batch_bandwidth_gbps", {l3_to_l2}}}},
      {"sglang:backup_bandwidth",
       Type::kHistogram,
       "GB/s per L3 write call",
       {{{}, "hicache_storage_batch_bandwidth_gbps", {l2_to_l3}}}},
      {"sglang:hicache_prefetch_outcomes_total", Type::kCounter, "L3 prefetches by outcome", {}},
      {"sglang:hicache_backup_dropped_tokens_total",
       Type::kCounter,
       "Host tokens whose backup to L3 was dropped",
       {{{}, "hicache_backup_dropped_tokens_total", {{{"reason", "queue_full"}}}}}},
      {"sglang:storage_prefetch_hit_tokens_total",
       Type::kCounter,
       "Tokens of the L3 hits every rank agreed on",
       {{{}, "hicache_prefetch_hit_tokens_total", {any}}}},
      {"sglang:storage_prefetch_unfulfilled_tokens_total",
       Type::kCounter,
       "Tokens of an agreed L3 hit that did not reach the tree, by reason",
       {}},
      // vLLM (vllm/v1/metrics/loggers.py; the CPU offloading connector's metrics).
      {"vllm:kv_cache_usage_perc",
       Type::kGauge,
       "Device KV cache usage (1: full)",
       {{{}, "hicache_pool_usage_ratio", {device}}}},
      {"vllm:gpu_cache_usage_perc",
       Type::kGauge,
       "Device KV cache usage (1: full); vLLM's older name of vllm:kv_cache_usage_perc",
       {{{}, "hicache_pool_usage_ratio", {device}}}},
      {"vllm:kv_offload_cpu_cache_usage_perc",
       Type::kGauge,
       "Host (offload) KV usage (1: full)",
       {{{}, "hicache_pool_usage_ratio", {host}}}},
      // LMCache (lmcache/observability.py; prometheus_client adds _total to counters).
      {"lmcache:num_hit_tokens_total",
       Type::kCounter,
       "Prompt tokens served from below the device: host and L3",
       {{{}, kPrefill, {from_host, from_storage}}}},
      {"lmcache:num_vllm_hit_tokens_total",
       Type::kCounter,
       "Prompt tokens served from the device prefix cache",
       {{{}, kPrefill, {from_device}}}},
      {"lmcache:num_prompt_tokens_total",
       Type::kCounter,
       "Prompt tokens of the prefills",
       {{{}, kPrefill, {from_device, from_host, from_storage, computed}}}},
      {"lmcache:num_stored_tokens_total",
       Type::kCounter,
       "Tokens stored from the device into the host tier",
       {{{}, kTokensMetric, {l1_to_l2}}}},
  };
  for (Family& fam : f) {
    if (fam.name == "sglang:hicache_prefetch_outcomes_total") {
      for (const char* o : {"attempts", "issued", "declined_too_short", "declined_rate_limited",
                            "revoked_insufficient", "revoked_full_miss"}) {
        fam.series.push_back({{{"outcome", o}}, kPrefetchOutcomesMetric, {{{"outcome", o}}}});
      }
    } else if (fam.name == "sglang:storage_prefetch_unfulfilled_tokens_total") {
      for (const char* r :
           {"below_threshold", "host_capacity", "storage_transfer", "dropped", "shrunk"}) {
        fam.series.push_back({{{"reason", r}}, kPrefetchUnfulfilledMetric, {{{"reason", r}}}});
      }
    }
  }
  return flatten(f);
}

}  // namespace

const std::vector<EngineMetricAlias>& engine_metric_aliases() {
  static const std::vector<EngineMetricAlias> aliases = build();
  return aliases;
}

std::string alias_series_name(const EngineMetricAlias& alias) {
  if (alias.labels.empty()) return alias.name;
  std::string out = alias.name + "{";
  for (std::size_t i = 0; i < alias.labels.size(); ++i) {
    out += str_cat(i ? "," : "", alias.labels[i].first, "=\"", alias.labels[i].second, "\"");
  }
  return out + "}";
}

void register_engine_metric_aliases(MetricsRegistry& registry, const void* owner,
                                    const MetricLabels& constant) {
  for (const EngineMetricAlias& a : engine_metric_aliases()) {
    MetricLabels labels = constant;
    labels.insert(labels.end(), a.labels.begin(), a.labels.end());
    registry.add_alias(a.name, a.help, a.type, std::move(labels), a.source, a.selects, owner);
  }
}

}  // namespace hicache
