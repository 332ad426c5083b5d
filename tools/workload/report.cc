#include "tools/workload/report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>

#include "controller/radix/events.h"
#include "transfer/errors.h"
#include "transfer/metrics.h"

namespace hicache::workload {
namespace {

using nlohmann::json;

json stats_ms(const std::vector<double>& seconds) {
  double sum = 0;
  for (double v : seconds) sum += v;
  return json{{"avg", seconds.empty() ? 0.0 : sum / static_cast<double>(seconds.size()) * 1e3},
              {"p50", percentile(seconds, 0.5) * 1e3},
              {"p90", percentile(seconds, 0.9) * 1e3},
              {"p99", percentile(seconds, 0.99) * 1e3}};
}

double ratio(double a, double b) { return b > 0 ? a / b : 0.0; }

// Prefetch confirmation (a prefetch's last page landed -> the cache took its pages), from the
// summed buckets (counters "<prefix>_bucket_<i>") of a histogram with `bounds`: the count, and
// for p50 / p99 the upper bound (times `scale`) of the bucket that holds the percentile (-1
// past the last bound), so each is an "at most". hicache_prefetch_confirm_seconds (in ms) and
// hicache_prefetch_confirm_steps.
json bucket_percentiles(std::map<std::string, double>& counters, const std::string& prefix,
                        const std::vector<double>& bounds, double scale) {
  std::vector<double> counts;
  double total = 0;
  for (std::size_t i = 0; i <= bounds.size(); ++i) {
    counts.push_back(counters[str_cat(prefix, "_bucket_", i)]);
    total += counts.back();
  }
  const auto at_most = [&](double q) {
    double seen = 0;
    for (std::size_t i = 0; i < counts.size(); ++i) {
      seen += counts[i];
      if (total > 0 && seen >= q * total) return i < bounds.size() ? bounds[i] * scale : -1.0;
    }
    return 0.0;
  };
  return json{{"count", total}, {"p50_at_most", at_most(0.5)}, {"p99_at_most", at_most(0.99)}};
}

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

}  // namespace

double percentile(std::vector<double> values, double q) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const auto rank = static_cast<std::size_t>(std::ceil(q * static_cast<double>(values.size())));
  return values[std::clamp<std::size_t>(rank, 1, values.size()) - 1];
}

json summarize(const ConfigRun& run, const std::vector<PlannedRequest>& plan) {
  std::map<std::string, double> counters, maxima;
  double duration = 0;
  std::vector<const RequestRecord*> records;
  std::vector<int> instance_of(plan.size(), -1);
  std::string first_mismatch;
  for (const InstanceResult& r : run.instances) {
    for (const auto& [k, v] : r.counters) counters[k] += v;
    for (const auto& [k, v] : r.maxima) maxima[k] = std::max(maxima[k], v);
    duration = std::max(duration, r.duration_s);
    for (const RequestRecord& rec : r.records) {
      records.push_back(&rec);
      instance_of[static_cast<std::size_t>(rec.index)] = rec.instance;
    }
    if (first_mismatch.empty()) first_mismatch = r.first_mismatch;
  }
  std::vector<double> ttft, itl, e2e;
  double prompt = 0, output = 0, device = 0, host = 0, storage = 0, computed = 0, cross = 0;
  std::int64_t rejected = 0, aborted = 0;
  struct Round {
    std::vector<double> ttft, e2e;
    double prompt = 0, device = 0, host = 0, storage = 0;
  };
  std::map<int, Round> rounds;
  for (const RequestRecord* rec : records) {
    if (rec->rejected || rec->aborted) {
      ++(rec->rejected ? rejected : aborted);
      continue;
    }
    const FinishedRequest& f = rec->report;
    const PlannedRequest& p = plan[static_cast<std::size_t>(rec->index)];
    ttft.push_back(f.ttft_s);
    e2e.push_back(f.e2e_s);
    if (f.output_tokens > 1) itl.push_back(f.itl_s);
    prompt += static_cast<double>(f.prompt_tokens);
    output += static_cast<double>(f.output_tokens);
    device += static_cast<double>(f.device_hit_tokens);
    host += static_cast<double>(f.host_hit_tokens);
    storage += static_cast<double>(f.storage_hit_tokens);
    computed += static_cast<double>(f.computed_tokens);
    if (p.depends_on >= 0 && instance_of[static_cast<std::size_t>(p.depends_on)] != rec->instance) {
      cross += static_cast<double>(f.storage_hit_tokens);
    }
    Round& r = rounds[p.round];
    r.ttft.push_back(f.ttft_s);
    r.e2e.push_back(f.e2e_s);
    r.prompt += static_cast<double>(f.prompt_tokens);
    r.device += static_cast<double>(f.device_hit_tokens);
    r.host += static_cast<double>(f.host_hit_tokens);
    r.storage += static_cast<double>(f.storage_hit_tokens);
  }
  const double cached = device + host + storage;
  const auto page_bytes = static_cast<double>(run.page_bytes);
  auto tier = [&](const char* bytes_key, const char* seconds_key) {
    const double bytes = counters[bytes_key];
    // Timed directions: over the copy time the controller measured; the others over the run.
    const double seconds = seconds_key != nullptr ? counters[seconds_key] : duration;
    return json{{"bytes", bytes},
                {"pages", page_bytes > 0 ? bytes / page_bytes : 0.0},
                {"gbps", ratio(bytes, seconds) / 1e9},
                {"gbps_over", seconds_key != nullptr ? "transfer time" : "run time"}};
  };
  json per_round = json::array();
  for (const auto& [r, v] : rounds) {
    double sum = 0;
    for (double x : v.e2e) sum += x;
    per_round.push_back({{"round", r},
                         {"requests", v.ttft.size()},
                         {"ttft_ms", stats_ms(v.ttft)},
                         {"e2e_avg_ms", v.e2e.empty() ? 0.0 : sum / static_cast<double>(v.e2e.size()) * 1e3},
                         {"prompt_tokens", v.prompt},
                         {"hit_rate", ratio(v.device + v.host + v.storage, v.prompt)},
                         {"tier_hit_rate",
                          {{"device", ratio(v.device, v.prompt)},
                           {"host", ratio(v.host, v.prompt)},
                           {"storage", ratio(v.storage, v.prompt)}}}});
  }
  // TP: each rank's L3 figures (MLA: every rank hits, rank 0 alone backs up).
  json per_rank = json::array();
  for (std::size_t i = 0; i < run.instances.size(); ++i) {
    const auto& ranks = run.instances[i].ranks;
    for (std::size_t rank = 0; rank < ranks.size(); ++rank) {
      const auto& f = ranks[rank];
      const auto get = [&](const char* k) { return f.count(k) != 0 ? f.at(k) : 0.0; };
      per_rank.push_back({{"instance", i},
                          {"rank", rank},
                          {"storage_hit_tokens", get("storage_hit_tokens")},
                          {"l2_to_l3_pages", ratio(get("l2_to_l3_bytes"), page_bytes)},
                          {"l3_to_l2_pages", ratio(get("l3_to_l2_bytes"), page_bytes)},
                          {"verified_pages", get("verified_pages")},
                          {"mismatched_pages", get("mismatched_pages")}});
    }
  }
  const auto finished = static_cast<double>(ttft.size());
  double storage_errors = counters["storage_errors"] + counters["storage_get_errors"] +
                          counters["storage_set_errors"];
  return json{
      {"name", run.name},
      {"instances", run.instances.size()},
      {"barrier", run.barrier},
      {"requests", finished},
      {"rejected_requests", rejected},
      {"aborted_requests", aborted},
      {"duration_s", duration},
      {"throughput_req_s", ratio(finished, duration)},
      {"input_tokens_per_s", ratio(prompt, duration)},
      {"output_tokens_per_s", ratio(output, duration)},
      {"ttft_ms", stats_ms(ttft)},
      {"itl_ms", stats_ms(itl)},
      {"e2e_ms", stats_ms(e2e)},
      {"tokens",
       {{"prompt", prompt},
        {"output", output},
        {"cached", cached},
        {"computed", computed},
        {"device_hit", device},
        {"host_hit", host},
        {"storage_hit", storage},
        {"cross_instance_storage_hit", cross}}},
      {"lookups", {{"lookups", prompt}, {"hits", cached}, {"misses", computed}}},
      {"hit_rate", ratio(cached, prompt)},
      {"tier_hit_rate",
       {{"device", ratio(device, prompt)},
        {"host", ratio(host, prompt)},
        {"storage", ratio(storage, prompt)}}},
      {"recomputed_tokens", computed},
      {"tiers",
       {{"l1_to_l2", tier("l1_to_l2_bytes", nullptr)},
        {"l2_to_l1", tier("l2_to_l1_bytes", "l2_to_l1_seconds")},
        {"l2_to_l3", tier("l2_to_l3_bytes", nullptr)},
        {"l3_to_l2", tier("l3_to_l2_bytes", "l3_to_l2_seconds")}}},
      // Bytes the L3 store wrote (l2_to_l3 less the pages it held already and skipped).
      {"l3_stored_bytes", counters["l3_stored_bytes"]},
      {"queue_depth_max", maxima},
      {"prefetch_confirm_ms",
       bucket_percentiles(counters, "prefetch_confirm", Histogram::latency_bounds(), 1e3)},
      {"prefetch_confirm_steps",
       bucket_percentiles(counters, "prefetch_confirm_steps",
                          std::vector<double>(radix::CacheEvents::kConfirmStepBounds.begin(),
                                              radix::CacheEvents::kConfirmStepBounds.end()),
                          1)},
      {"prefetch_rank_wait_steps",
       bucket_percentiles(counters, "prefetch_rank_wait_steps",
                          std::vector<double>(radix::CacheEvents::kConfirmStepBounds.begin(),
                                              radix::CacheEvents::kConfirmStepBounds.end()),
                          1)},
      {"missed_tokens_prefetch_revoked", counters["missed_tokens_prefetch_revoked"]},
      {"missed_tokens_evicted", counters["missed_tokens_evicted"]},
      {"storage_errors", storage_errors},
      {"verified_pages", counters["verified_pages"]},
      {"mismatched_pages", counters["mismatched_pages"]},
      {"first_mismatch", first_mismatch},
      // Hybrid models: sidecar (state) bytes per tier, the sidecar pages verified (of
      // verified_pages), requests finished without a cache entry (a pool had no room).
      {"sidecars",
       {{"l1_to_l2_bytes", counters["sidecar_l1_to_l2_bytes"]},
        {"l2_to_l1_bytes", counters["sidecar_l2_to_l1_bytes"]},
        {"l2_to_l3_bytes", counters["sidecar_l2_to_l3_bytes"]},
        {"l3_to_l2_bytes", counters["sidecar_l3_to_l2_bytes"]},
        {"verified_pages", counters["verified_sidecar_pages"]},
        {"uncached_requests", counters["uncached_requests"]}}},
      // The scheduler's collective calls per step() (those that ran nothing included) and the
      // time they took, and step() itself (compute included).
      {"tp",
       {{"ranks", run.tp},
        {"scheduler_steps", counters["step_calls"]},
        {"forward_steps", counters["steps"]},
        {"collectives_per_step", ratio(counters["tp_main_collectives"], counters["step_calls"])},
        {"collective_ms_per_step",
         ratio(counters["tp_main_collective_seconds"], counters["step_calls"]) * 1e3},
        {"step_ms", ratio(counters["step_seconds"], counters["step_calls"]) * 1e3},
        {"storage_thread_collectives", counters["tp_storage_collectives"]},
        {"per_rank", per_rank}}},
      {"page_bytes", run.page_bytes},
      {"page_size", run.page_size},
      {"counters", counters},
      {"per_round", per_round}};
}

std::string format_table(const std::vector<json>& summaries) {
  struct Row {
    std::string label;
    std::vector<std::string> cells;
  };
  std::vector<Row> rows;
  auto add = [&](const std::string& label, auto cell) {
    Row r{label, {}};
    for (const json& s : summaries) r.cells.push_back(cell(s));
    rows.push_back(std::move(r));
  };
  auto num = [](const char* f, auto path) {
    return [f, path](const json& s) { return fmt(f, path(s)); };
  };
  add("configuration", [](const json& s) { return s["name"].get<std::string>(); });
  add("requests", num("%.0f", [](const json& s) { return s["requests"].get<double>(); }));
  add("duration (s)", num("%.2f", [](const json& s) { return s["duration_s"].get<double>(); }));
  add("requests/s", num("%.2f", [](const json& s) { return s["throughput_req_s"].get<double>(); }));
  add("input tokens/s", num("%.0f", [](const json& s) { return s["input_tokens_per_s"].get<double>(); }));
  for (const char* p : {"avg", "p50", "p90", "p99"}) {
    add(std::string("TTFT ") + p + " (ms)", num("%.1f", [p](const json& s) { return s["ttft_ms"][p].get<double>(); }));
  }
  add("ITL avg (ms)", num("%.2f", [](const json& s) { return s["itl_ms"]["avg"].get<double>(); }));
  add("E2E avg (ms)", num("%.1f", [](const json& s) { return s["e2e_ms"]["avg"].get<double>(); }));
  add("cache hit rate", num("%.1f%%", [](const json& s) { return 100 * s["hit_rate"].get<double>(); }));
  for (const char* t : {"device", "host", "storage"}) {
    add(std::string("  from ") + t, num("%.1f%%", [t](const json& s) { return 100 * s["tier_hit_rate"][t].get<double>(); }));
  }
  add("cross-instance L3 hits (tokens)", num("%.0f", [](const json& s) { return s["tokens"]["cross_instance_storage_hit"].get<double>(); }));
  add("recomputed tokens", num("%.0f", [](const json& s) { return s["recomputed_tokens"].get<double>(); }));
  for (const char* t : {"l1_to_l2", "l2_to_l1", "l2_to_l3", "l3_to_l2"}) {
    add(std::string(t) + " GB (GB/s)", [t](const json& s) {
      return fmt("%.2f", s["tiers"][t]["bytes"].get<double>() / 1e9) + " (" +
             fmt("%.2f", s["tiers"][t]["gbps"].get<double>()) + ")";
    });
  }
  add("L3 GB stored (l2_to_l3 less what it held)",
      num("%.2f", [](const json& s) { return s["l3_stored_bytes"].get<double>() / 1e9; }));
  add("tokens missed: evicted",
      num("%.0f", [](const json& s) { return s["missed_tokens_evicted"].get<double>(); }));
  add("tokens missed: prefetch revoked", num("%.0f", [](const json& s) {
        return s["missed_tokens_prefetch_revoked"].get<double>();
      }));
  add("TP ranks", num("%.0f", [](const json& s) { return s["tp"]["ranks"].get<double>(); }));
  add("step ms (collectives per step, ms in them)", [](const json& s) {
    const json& t = s["tp"];
    return fmt("%.3f", t["step_ms"].get<double>()) + " (" +
           fmt("%.2f", t["collectives_per_step"].get<double>()) + ", " +
           fmt("%.3f", t["collective_ms_per_step"].get<double>()) + ")";
  });
  // TP: "instance: rank 0 / rank 1 ...", instances apart by ';'.
  const auto by_rank = [&](const char* label, const char* key) {
    const bool any = std::any_of(summaries.begin(), summaries.end(),
                                 [](const json& s) { return !s["tp"]["per_rank"].empty(); });
    if (!any) return;
    add(label, [key](const json& s) {
      std::string cell;
      for (const json& r : s["tp"]["per_rank"]) {
        const bool first = r["rank"].get<int>() == 0;
        cell += str_cat(first && !cell.empty() ? "; "
                        : first                ? ""
                                               : " / ",
                        fmt("%.0f", r[key].get<double>()));
      }
      return cell.empty() ? std::string("-") : cell;
    });
  };
  by_rank("L3 hit tokens by rank", "storage_hit_tokens");
  by_rank("L2->L3 pages by rank", "l2_to_l3_pages");
  for (const auto& [label, key] : {std::pair{"prefetch confirm ms p50/p99 (<=)", "prefetch_confirm_ms"},
                                    std::pair{"prefetch confirm steps p50/p99 (<=)",
                                              "prefetch_confirm_steps"},
                                    std::pair{"TP rank wait steps p50/p99 (<=)",
                                              "prefetch_rank_wait_steps"}}) {
    add(label, [key = std::string(key)](const json& s) {
      const json& c = s[key];
      if (c["count"].get<double>() == 0) return std::string("-");
      return fmt("%.3g", c["p50_at_most"].get<double>()) + " / " +
             fmt("%.3g", c["p99_at_most"].get<double>());
    });
  }
  add("storage errors", num("%.0f", [](const json& s) { return s["storage_errors"].get<double>(); }));
  add("sidecar MiB L1>L2 / L2>L1 / L2>L3 / L3>L2", [](const json& s) {
    if (!s.contains("sidecars")) return std::string("-");
    const json& sc = s["sidecars"];
    double total = 0;
    std::string cell;
    for (const char* k : {"l1_to_l2_bytes", "l2_to_l1_bytes", "l2_to_l3_bytes", "l3_to_l2_bytes"}) {
      const double mib = sc[k].get<double>() / (1 << 20);
      total += mib;
      cell += str_cat(cell.empty() ? "" : " / ", fmt("%.1f", mib));
    }
    return total > 0 ? cell : std::string("-");
  });
  add("pages verified", num("%.0f", [](const json& s) { return s["verified_pages"].get<double>(); }));
  add("wrong pages", num("%.0f", [](const json& s) { return s["mismatched_pages"].get<double>(); }));
  std::size_t w0 = 0;
  std::vector<std::size_t> w(summaries.size(), 0);
  for (const Row& r : rows) {
    w0 = std::max(w0, r.label.size());
    for (std::size_t i = 0; i < r.cells.size(); ++i) w[i] = std::max(w[i], r.cells[i].size());
  }
  std::string out;
  for (const Row& r : rows) {
    out += r.label + std::string(w0 - r.label.size() + 2, ' ');
    for (std::size_t i = 0; i < r.cells.size(); ++i) {
      out += std::string(w[i] - r.cells[i].size() + (i ? 3 : 0), ' ') + r.cells[i];
    }
    out += "\n";
  }
  return out;
}

std::string render_svg(const std::vector<json>& summaries, const std::string& title) {
  static const char* kColours[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"};
  const double W = 1080, H = 420, left = 60, top = 50, pw = 400, ph = 300;
  std::string s = fmt("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\"", W) +
                  fmt(" height=\"%.0f\" font-family=\"sans-serif\" font-size=\"12\">\n", H);
  s += "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  auto text = [&](double x, double y, const std::string& t, const char* anchor = "start") {
    std::string esc;
    for (char c : t) esc += c == '<' ? std::string("&lt;") : c == '&' ? std::string("&amp;") : std::string(1, c);
    s += fmt("<text x=\"%.1f\"", x) + fmt(" y=\"%.1f\"", y) + " text-anchor=\"" + anchor + "\">" + esc + "</text>\n";
  };
  auto line = [&](double x1, double y1, double x2, double y2, const char* colour, double width) {
    s += fmt("<line x1=\"%.1f\"", x1) + fmt(" y1=\"%.1f\"", y1) + fmt(" x2=\"%.1f\"", x2) +
         fmt(" y2=\"%.1f\"", y2) + " stroke=\"" + colour + "\"" + fmt(" stroke-width=\"%.1f\"/>\n", width);
  };
  text(W / 2, 20, title, "middle");
  // Left: TTFT p50 per round.
  double max_ttft = 0;
  int max_round = 0;
  for (const json& c : summaries) {
    for (const json& r : c["per_round"]) {
      max_ttft = std::max(max_ttft, r["ttft_ms"]["p50"].get<double>());
      max_round = std::max(max_round, r["round"].get<int>());
    }
  }
  if (max_ttft <= 0) max_ttft = 1;
  text(left + pw / 2, top - 10, "TTFT p50 per round (ms)", "middle");
  line(left, top + ph, left + pw, top + ph, "black", 1);
  line(left, top, left, top + ph, "black", 1);
  for (int i = 0; i <= 4; ++i) {
    text(left - 5, top + ph - ph * i / 4 + 4, fmt("%.0f", max_ttft * i / 4), "end");
  }
  auto xr = [&](int round) { return left + (max_round > 0 ? pw * round / max_round : pw / 2); };
  for (int r = 0; r <= max_round; ++r) text(xr(r), top + ph + 16, std::to_string(r), "middle");
  text(left + pw / 2, top + ph + 34, "round", "middle");
  for (std::size_t i = 0; i < summaries.size(); ++i) {
    const char* colour = kColours[i % 6];
    std::string points;
    for (const json& r : summaries[i]["per_round"]) {
      points += fmt("%.1f,", xr(r["round"].get<int>())) +
                fmt("%.1f ", top + ph - ph * r["ttft_ms"]["p50"].get<double>() / max_ttft);
    }
    s += "<polyline fill=\"none\" stroke=\"" + std::string(colour) + "\" stroke-width=\"2\" points=\"" + points + "\"/>\n";
    const double ly = top + 14.0 * static_cast<double>(i) + 6;
    line(left + 10, ly, left + 30, ly, colour, 2);
    text(left + 35, ly + 4, summaries[i]["name"].get<std::string>());
  }
  // Right: hit rate per tier, one stacked bar per configuration.
  const double bx = left + pw + 90;
  text(bx + pw / 2, top - 10, "cache hit rate by tier (% of prompt tokens)", "middle");
  line(bx, top + ph, bx + pw, top + ph, "black", 1);
  line(bx, top, bx, top + ph, "black", 1);
  for (int i = 0; i <= 4; ++i) text(bx - 5, top + ph - ph * i / 4 + 4, std::to_string(25 * i), "end");
  static const char* kTierColours[] = {"#4c72b0", "#55a868", "#c44e52"};
  static const char* kTiers[] = {"device", "host", "storage"};
  const double slot = pw / static_cast<double>(std::max<std::size_t>(1, summaries.size()));
  for (std::size_t i = 0; i < summaries.size(); ++i) {
    double y = top + ph;
    for (int t = 0; t < 3; ++t) {
      const double h = ph * summaries[i]["tier_hit_rate"][kTiers[t]].get<double>();
      s += fmt("<rect x=\"%.1f\"", bx + slot * static_cast<double>(i) + slot * 0.2) + fmt(" y=\"%.1f\"", y - h) +
           fmt(" width=\"%.1f\"", slot * 0.6) + fmt(" height=\"%.1f\"", h) + " fill=\"" + kTierColours[t] + "\"/>\n";
      y -= h;
    }
    text(bx + slot * (static_cast<double>(i) + 0.5), top + ph + 16, summaries[i]["name"].get<std::string>(), "middle");
  }
  for (int t = 0; t < 3; ++t) {
    s += fmt("<rect x=\"%.1f\"", bx + pw + 10) + fmt(" y=\"%.1f\"", top + 16.0 * t) +
         " width=\"10\" height=\"10\" fill=\"" + kTierColours[t] + "\"/>\n";
    text(bx + pw + 24, top + 16.0 * t + 9, kTiers[t]);
  }
  s += "</svg>\n";
  return s;
}

}  // namespace hicache::workload

namespace hicache::workload {

nlohmann::json to_json(const InstanceResult& r) {
  nlohmann::json records = nlohmann::json::array();
  for (const RequestRecord& rec : r.records) {
    const FinishedRequest& f = rec.report;
    records.push_back({rec.index, rec.instance, rec.rejected, rec.sent_s, f.id, f.prompt_tokens,
                       f.output_tokens, f.device_hit_tokens, f.host_hit_tokens,
                       f.storage_hit_tokens, f.computed_tokens, f.ttft_s, f.e2e_s, f.itl_s,
                       rec.aborted});
  }
  return {{"records", records}, {"counters", r.counters}, {"maxima", r.maxima},
          {"duration_s", r.duration_s}, {"first_mismatch", r.first_mismatch}};
}

InstanceResult instance_result_from_json(const nlohmann::json& j) {
  InstanceResult r;
  for (const auto& a : j.at("records")) {
    RequestRecord rec;
    rec.index = a.at(0).get<int>();
    rec.instance = a.at(1).get<int>();
    rec.rejected = a.at(2).get<bool>();
    rec.sent_s = a.at(3).get<double>();
    FinishedRequest& f = rec.report;
    f.id = a.at(4).get<std::string>();
    f.prompt_tokens = a.at(5).get<std::int64_t>();
    f.output_tokens = a.at(6).get<std::int64_t>();
    f.device_hit_tokens = a.at(7).get<std::int64_t>();
    f.host_hit_tokens = a.at(8).get<std::int64_t>();
    f.storage_hit_tokens = a.at(9).get<std::int64_t>();
    f.computed_tokens = a.at(10).get<std::int64_t>();
    f.ttft_s = a.at(11).get<double>();
    f.e2e_s = a.at(12).get<double>();
    f.itl_s = a.at(13).get<double>();
    rec.aborted = a.at(14).get<bool>();
    r.records.push_back(std::move(rec));
  }
  r.counters = j.at("counters").get<std::map<std::string, double>>();
  r.maxima = j.at("maxima").get<std::map<std::string, double>>();
  r.duration_s = j.at("duration_s").get<double>();
  r.first_mismatch = j.at("first_mismatch").get<std::string>();
  return r;
}

json redact_secrets(const json& settings) {
  static constexpr std::string_view kSecretWords[] = {"password", "secret", "token", "key_file",
                                                      "private_key"};
  const auto is_secret = [](std::string key) {
    std::transform(key.begin(), key.end(), key.begin(),
                   [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    for (std::string_view w : kSecretWords) {
      if (key.find(w) != std::string::npos) return true;
    }
    return false;
  };
  json out = settings;
  std::vector<json*> todo{&out};
  while (!todo.empty()) {
    json* j = todo.back();
    todo.pop_back();
    if (j->is_object()) {
      for (auto it = j->begin(); it != j->end(); ++it) {
        if (is_secret(it.key())) {
          *it = "<redacted>";
        } else {
          todo.push_back(&*it);
        }
      }
    } else if (j->is_array()) {
      for (auto& v : *j) todo.push_back(&v);
    }
  }
  return out;
}

}  // namespace hicache::workload
