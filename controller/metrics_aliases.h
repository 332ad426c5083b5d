// Engine metric aliases: hicache's series under the names and labels that SGLang (its HiCache
// and radix-cache metrics), vLLM (KV cache and CPU offload usage) and LMCache (hit tokens)
// publish, so that a dashboard built for one of those engines shows hicache's figures with no
// edits. Each alias is a MetricsRegistry alias series: computed at scrape time from hicache's
// own series (nothing is counted twice), carrying their tp_rank. docs/metrics.md lists every
// alias with its meaning, its hicache source and where the name comes from; the names hicache
// cannot produce are listed there too, with why.
#pragma once

#include <string>
#include <vector>

#include "transfer/metrics.h"

namespace hicache {

struct EngineMetricAlias {
  std::string name;  // the engine's family name, e.g. "sglang:evicted_tokens_total"
  MetricsRegistry::Type type;
  MetricLabels labels;                // the engine's labels of this series (besides tp_rank)
  std::string source;                 // hicache's family
  std::vector<MetricLabels> selects;  // its series this one sums (MetricsRegistry::add_alias)
  std::string help;
};

// Every alias series, in the order docs/metrics.md lists them.
const std::vector<EngineMetricAlias>& engine_metric_aliases();

// The series `alias` names in the text exposition: name{k="v",...} (name alone without labels).
std::string alias_series_name(const EngineMetricAlias& alias);

// Registers every alias in `registry` for `owner` (MetricsRegistry::forget(owner) removes them),
// each with `constant` labels (the same for the whole process, such as SGLang's model_name)
// after the carried ones and before its own. Aliases of families that are absent (no L3,
// metrics registered later) show once they exist.
void register_engine_metric_aliases(MetricsRegistry& registry, const void* owner,
                                    const MetricLabels& constant = {});

}  // namespace hicache
