// hicache-bench's results: one summary per configuration (JSON, with the metrics of SGLang's
// bench_multiturn plus per-tier figures), the side-by-side table, and the SVG plot.
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "tools/workload/runner.h"
#include "tools/workload/workload.h"

namespace hicache::workload {

struct ConfigRun {
  std::string name;                      // "device", "host", "host+file", "host+redis"
  std::vector<InstanceResult> instances;
  std::int64_t page_bytes = 0;           // KV bytes of one page (all layers)
  std::int32_t page_size = 0;
  // TP ranks per instance. Each instance's result is its rank 0's (the ranks serve the same
  // requests), with every rank's pages verified added up.
  int tp = 1;
  // Round r+1 of every client waited for the whole of round r (--barrier, --instances > 1).
  bool barrier = false;
};

// Nearest-rank percentile of `values` (q in (0, 1]); 0 when empty.
double percentile(std::vector<double> values, double q);

// Summary of one configuration over every instance. Keys: see docs/tools.md (hicache-bench, --report).
// tokens.cross_instance_storage_hit counts the L3 hits of requests whose dependency (a
// conversation's previous round, a tree node's parent) ran on another instance: an
// approximation (it includes shared prefixes such as the system prompt, which either instance
// may have written; longcontext requests have no dependency and report 0).

nlohmann::json summarize(const ConfigRun& run, const std::vector<PlannedRequest>& plan);

// The configurations side by side, one column each.
std::string format_table(const std::vector<nlohmann::json>& summaries);

// A copy of `settings` for a report: the value of every key that names a secret (password,
// secret, token, private key; at any depth, in objects and arrays) replaced by "<redacted>".
nlohmann::json redact_secrets(const nlohmann::json& settings);

// TTFT per round (lines) and hit rate per tier (stacked bars), one colour per configuration.
std::string render_svg(const std::vector<nlohmann::json>& summaries, const std::string& title);

}  // namespace hicache::workload

namespace hicache::workload {

// An instance's result as JSON and back (hicache-bench --instances sends it over a pipe).
nlohmann::json to_json(const InstanceResult& result);
InstanceResult instance_result_from_json(const nlohmann::json& j);

}  // namespace hicache::workload
