#include "tools/workload/runner.h"

#include <unistd.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>

#include "transfer/errors.h"

namespace hicache::workload {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// A metric of the cache's registry, this rank's (0 when absent).
static double cache_metric(const EngineStack& stack, const char* name, MetricLabels labels) {
  // Every metric carries its rank (a rank's figures are under its own number, not 0's).
  HiCache& hicache = const_cast<EngineStack&>(stack).hicache();
  labels.insert(labels.begin(), {"tp_rank", std::to_string(hicache.config().tp.rank)});
  return std::max(0.0, hicache.metrics().value(name, labels));
}

// The steady clock's time point of a now_seconds() value.
static std::chrono::steady_clock::time_point steady_time(double seconds) {
  return std::chrono::steady_clock::time_point(
      std::chrono::duration_cast<std::chrono::steady_clock::duration>(
          std::chrono::duration<double>(seconds)));
}

Runner::Runner(EngineStack& stack, const std::vector<PlannedRequest>& plan, std::vector<int> mine,
               RunOptions options, int instance)
    : stack_(stack), plan_(plan), mine_(std::move(mine)), options_(std::move(options)),
      instance_(instance), done_(plan.size(), 0), sent_(plan.size(), 0),
      finished_at_(plan.size(), 0.0), record_at_(plan.size(), 0) {
  if (options_.request_rate < 0) {
    throw InvalidArgument(str_cat("request rate ", options_.request_rate, " < 0"));
  }
  if (options_.max_inflight < 0) {
    throw InvalidArgument(str_cat("max inflight ", options_.max_inflight, " < 0"));
  }
  // What is not ours counts as done (another instance serves it, before our round starts).
  std::vector<char> ours(plan.size(), 0);
  for (int i : mine_) ours[static_cast<std::size_t>(i)] = 1;
  for (std::size_t i = 0; i < plan.size(); ++i) done_[i] = ours[i] ? 0 : 1;
  started_ = now_seconds();
}

void Runner::run_all() {
  int last = 0;
  for (int i : mine_) last = std::max(last, plan_[static_cast<std::size_t>(i)].round);
  if (!options_.barrier) return run_rounds(0, last);
  for (int r = 0; r <= last; ++r) run_rounds(r, r);
}

void Runner::run_rounds(int first_round, int last_round) {
  std::vector<int> todo;
  for (int i : mine_) {
    const int r = plan_[static_cast<std::size_t>(i)].round;
    if (r >= first_round && r <= last_round && !done_[static_cast<std::size_t>(i)]) todo.push_back(i);
  }
  std::unordered_map<std::string, int> by_id;
  for (int i : todo) by_id.emplace(plan_[static_cast<std::size_t>(i)].id, i);
  std::mt19937_64 rng(options_.seed * 7919 + static_cast<std::uint64_t>(first_round) * 104729 +
                      static_cast<std::uint64_t>(instance_));
  std::exponential_distribution<double> gap(options_.request_rate > 0 ? options_.request_rate : 1);
  const double round_start = now_seconds();
  double next_arrival = round_start;
  // When a client could send: its previous request finished (or the rounds started), its
  // Poisson arrival came, and the in-flight cap had room. TTFT counts from there, so a request
  // that waits for the runner's loop (a prefill in progress) still counts that wait.
  double cap_freed_at = round_start;
  std::size_t remaining = todo.size(), cursor = 0;
  int inflight = 0;
  SimulatedEngine& engine = stack_.engine();
  std::int64_t iteration = 0;
  while (remaining > 0) {
    const double now = now_seconds();
    bool any_ready = false;
    bool arrival_pending = false;  // a ready request waits for its Poisson arrival only
    for (std::size_t k = cursor; k < todo.size(); ++k) {
      const int idx = todo[k];
      if (sent_[static_cast<std::size_t>(idx)]) continue;
      const PlannedRequest& p = plan_[static_cast<std::size_t>(idx)];
      if (p.depends_on >= 0 && !done_[static_cast<std::size_t>(p.depends_on)]) continue;
      any_ready = true;
      if (options_.max_inflight > 0 && inflight >= options_.max_inflight) break;
      if (options_.request_rate > 0 && now < next_arrival) {
        arrival_pending = true;
        break;
      }
      double arrival = p.depends_on >= 0 && finished_at_[static_cast<std::size_t>(p.depends_on)] > 0
                           ? finished_at_[static_cast<std::size_t>(p.depends_on)]
                           : round_start;
      if (options_.request_rate > 0) arrival = std::max(arrival, next_arrival);
      if (options_.max_inflight > 0) arrival = std::max(arrival, cap_freed_at);
      arrival = std::min(arrival, now);
      engine.submit(SimulatedRequest{p.id, p.tokens, p.output_tokens, p.identity,
                                     steady_time(arrival)});
      sent_[static_cast<std::size_t>(idx)] = 1;
      ++inflight;
      record_at_[static_cast<std::size_t>(idx)] = records_.size();
      records_.push_back(RequestRecord{.index = idx, .instance = instance_, .sent_s = now - started_});
      if (options_.request_rate > 0) next_arrival += gap(rng);
    }
    while (cursor < todo.size() && sent_[static_cast<std::size_t>(todo[cursor])]) ++cursor;

    const bool busy = engine.step();
    if (options_.l3_detach_every > 0 && ++steps_ % options_.l3_detach_every == 0) toggle_l3();
    bool finished_any = false;
    for (FinishedRequest& f : engine.drain_finished()) {
      finished_any = true;
      const int idx = by_id.at(f.id);
      done_[static_cast<std::size_t>(idx)] = 1;
      finished_at_[static_cast<std::size_t>(idx)] = now_seconds();
      if (options_.max_inflight > 0 && inflight == options_.max_inflight) cap_freed_at = now_seconds();
      --inflight;
      --remaining;
      RequestRecord& record = records_[record_at_[static_cast<std::size_t>(idx)]];
      if (f.aborted) {
        record.aborted = true;
        continue;
      }
      prompt_tokens_ += f.prompt_tokens;
      cached_tokens_ += f.prompt_tokens - f.computed_tokens;
      record.report = std::move(f);
    }
    if (!busy && inflight > 0 && engine.waiting() == 0 && engine.decoding() == 0) {
      // The engine dropped them: larger than its device pool can ever hold.
      for (RequestRecord& r : records_) {
        if (!done_[static_cast<std::size_t>(r.index)] && by_id.count(plan_[static_cast<std::size_t>(r.index)].id)) {
          r.rejected = true;
          done_[static_cast<std::size_t>(r.index)] = 1;
          finished_at_[static_cast<std::size_t>(r.index)] = now_seconds();
          --inflight;
          --remaining;
        }
      }
    }
    if ((++iteration & 15) == 0) sample();
    if (busy && !finished_any) {
      // A step that could run nothing sleeps until an ack or a prefetch lets the next one, or
      // until the next client sends (a finished request would free a follow-up at once).
      std::optional<std::chrono::steady_clock::time_point> until;
      if (arrival_pending) {
        until = steady_time(next_arrival);
      }
      engine.wait_for_progress(until);
    }
    if (!busy && inflight == 0 && remaining > 0) {
      // Readiness again: what finished (or was rejected) in this iteration frees its follow-ups.
      any_ready = false;
      for (std::size_t k = cursor; k < todo.size() && !any_ready; ++k) {
        const PlannedRequest& p = plan_[static_cast<std::size_t>(todo[k])];
        any_ready = !sent_[static_cast<std::size_t>(todo[k])] &&
                    (p.depends_on < 0 || done_[static_cast<std::size_t>(p.depends_on)]);
      }
      if (!any_ready) {
        throw StateError(str_cat("workload runner: ", remaining,
                                 " requests wait for requests outside rounds ", first_round, "..",
                                 last_round));
      }
      if (options_.request_rate > 0 && next_arrival > now_seconds()) {
        // Idle until the next client sends (think time between arrivals, not engine work).
        std::this_thread::sleep_for(std::chrono::duration<double>(next_arrival - now_seconds()));
      }
    }
    report_progress(false);
  }
  if (l3_detached_) toggle_l3();  // L3 back for what follows (a flush, the next rounds)
  sample();
  report_progress(true);
}

void Runner::toggle_l3() {
  HiCache& hc = stack_.hicache();
  if (l3_detached_) {
    hc.attach_storage();
    l3_detached_ = false;
  } else if (hc.storage() != nullptr) {
    // The backups in flight land first (a detach would wait for them too), so that they are
    // counted here before the counters go.
    stack_.engine().flush();
    for (const auto& [k, v] : l3_counters()) retired_l3_[k] += v;
    hc.detach_storage();
    l3_detached_ = true;
    ++l3_detaches_;
  }
}

void Runner::flush() {
  stack_.engine().flush();
  sample();
}

void Runner::sample() {
  auto up = [this](const char* name, double v) {
    double& m = maxima_[name];
    if (v > m) m = v;
  };
  const auto s = stack_.cache().stats();
  up("writes_in_flight", static_cast<double>(s.writes_in_flight));
  up("loads_in_flight", static_cast<double>(s.loads_in_flight));
  up("backups_in_flight", static_cast<double>(s.backups_in_flight));
  up("prefetches_in_flight", static_cast<double>(stack_.cache().prefetches_in_flight()));
  up("requests_waiting", static_cast<double>(stack_.engine().waiting()));
  up("requests_decoding", static_cast<double>(stack_.engine().decoding()));
  up("device_tokens_cached", static_cast<double>(s.device_tokens));
  up("host_tokens_cached", static_cast<double>(s.host_tokens));
}

void Runner::report_progress(bool final) {
  if (!options_.progress) return;
  const bool tty = ::isatty(STDERR_FILENO) != 0;
  const double now = now_seconds();
  if (!final && now - last_progress_ < (tty ? 0.25 : 5.0)) return;
  last_progress_ = now;
  std::size_t finished = 0;
  for (const auto& r : records_) finished += r.rejected || r.aborted || !r.report.id.empty() ? 1 : 0;
  const double elapsed = now - started_;
  // Rounds done: every request of the round (of this instance) finished.
  std::map<int, std::pair<int, int>> rounds;  // round -> (requests, done)
  for (int i : mine_) {
    auto& [total, done] = rounds[plan_[static_cast<std::size_t>(i)].round];
    ++total;
    done += done_[static_cast<std::size_t>(i)] ? 1 : 0;
  }
  int rounds_done = 0;
  for (const auto& [round, counts] : rounds) rounds_done += counts.first == counts.second ? 1 : 0;
  std::string bar;  // on a terminal: [#######.............] of the requests
  if (tty) {
    const std::size_t filled = mine_.empty() ? 20 : finished * 20 / mine_.size();
    bar = "[" + std::string(filled, '#') + std::string(20 - filled, '.') + "] ";
  }
  std::fprintf(stderr, "%s%s[%s] rounds %d/%zu, %zu/%zu requests, %.1f req/s, hit rate %.1f%%%s",
               tty ? "\r" : "", bar.c_str(), options_.label.c_str(), rounds_done, rounds.size(), finished,
               mine_.size(),
               elapsed > 0 ? static_cast<double>(finished) / elapsed : 0.0,
               prompt_tokens_ > 0 ? 100.0 * static_cast<double>(cached_tokens_) / static_cast<double>(prompt_tokens_) : 0.0,
               tty && !final ? "   " : "\n");
  std::fflush(stderr);
}

InstanceResult Runner::result() const {
  InstanceResult out;
  out.records = records_;
  out.maxima = maxima_;
  out.duration_s = now_seconds() - started_;
  auto& c = out.counters;
  const auto& e = stack_.engine().stats();
  c["steps"] = static_cast<double>(e.steps);
  c["decode_steps"] = static_cast<double>(e.decode_steps);
  c["verified_pages"] = static_cast<double>(e.verified_pages);
  c["mismatched_pages"] = static_cast<double>(e.mismatched_pages);
  // Hybrid models: the sidecar pages verified, the requests not cached, the sidecar bytes
  // between the tiers (the tiers' KV figures below leave them out but for l1/l2, which count
  // them: the controller's bytes_written / bytes_loaded do).
  c["verified_sidecar_pages"] = static_cast<double>(e.verified_sidecar_pages);
  c["uncached_requests"] = static_cast<double>(e.uncached_requests);
  const ControllerStats cs = stack_.controller().stats();
  c["sidecar_l1_to_l2_bytes"] = static_cast<double>(cs.sidecar_bytes_written);
  c["sidecar_l2_to_l1_bytes"] = static_cast<double>(cs.sidecar_bytes_loaded);
  if (const StorageController* sc = stack_.hicache().storage_controller()) {
    c["sidecar_l2_to_l3_bytes"] = static_cast<double>(sc->sidecar_written_bytes());
    c["sidecar_l3_to_l2_bytes"] = static_cast<double>(sc->sidecar_read_bytes());
  }
  c["rejected_requests"] = static_cast<double>(e.rejected);
  c["deferred_admissions"] = static_cast<double>(e.deferred);
  c["prefetches"] = static_cast<double>(e.prefetches);
  c["compute_seconds"] = e.compute_seconds;
  c["step_seconds"] = e.step_seconds;
  c["step_calls"] = static_cast<double>(e.step_calls);
  // TP: the scheduler thread's collective (the radix cache's step reduction, the engine's own
  // agreements) and the storage threads' groups, as this rank counts them.
  const HiCache& hc = stack_.hicache();
  if (hc.config().tp.size > 1) {
    const HiCacheCollectives& g = hc.collectives();
    c["tp_main_collectives"] = static_cast<double>(g.main->calls());
    c["tp_main_collective_seconds"] = g.main->seconds();
    c["tp_storage_collectives"] = static_cast<double>(g.prefetch->calls() + g.backup->calls());
  }
  // The tiers' totals come from the cache's metrics registry (what /metrics serves).
  const auto metric = [&](const char* name, MetricLabels labels) {
    return cache_metric(stack_, name, std::move(labels));
  };
  c["evicted_device_tokens"] = metric("hicache_evicted_tokens_total", {{"tier", "device"}});
  c["evicted_host_tokens"] = metric("hicache_evicted_tokens_total", {{"tier", "host"}});
  c["prefetched_tokens"] = metric("hicache_prefetched_tokens_total", {});
  c["write_failures"] = metric("hicache_write_failures_total", {});
  // Tokens missed, by reason (hicache_misses_total).
  for (const char* reason : {"evicted", "prefetch_revoked", "load_failed", "load_refused_by_cost",
                             "prefetch_refused_by_cost"}) {
    c[str_cat("missed_tokens_", reason)] = metric("hicache_misses_total", {{"reason", reason}});
  }
  c["demotions"] = metric("hicache_demotions_total", {});
  c["l1_to_l2_bytes"] = metric("hicache_bytes_total", {{"direction", "l1_to_l2"}});
  c["l2_to_l1_bytes"] = metric("hicache_bytes_total", {{"direction", "l2_to_l1"}});
  c["l2_to_l1_seconds"] = stack_.controller().stats().load_seconds;
  c["controller_write_failures"] =
      metric("hicache_ops_total", {{"direction", "l1_to_l2"}, {"outcome", "failed"}});
  c["controller_load_failures"] =
      metric("hicache_ops_total", {{"direction", "l2_to_l1"}, {"outcome", "failed"}});
  for (const auto& [k, v] : l3_counters()) c[k] = v;
  for (const auto& [k, v] : retired_l3_) c[k] += v;
  // Prefetch confirmation in steps begun (hicache_prefetch_confirm_steps, and under TP the
  // ranks' skew, hicache_prefetch_rank_wait_steps; this rank's series, the radix cache's, so
  // they outlive an L3 detach and are not in l3_counters): cumulative buckets as per-bucket
  // counts.
  HiCache& hicache = const_cast<EngineStack&>(stack_).hicache();
  const auto all = nlohmann::json::parse(hicache.metrics().json_text());
  const std::string rank = std::to_string(hicache.config().tp.rank);
  for (const char* name : {"prefetch_confirm_steps", "prefetch_rank_wait_steps"}) {
    const auto f = all.find(str_cat("hicache_", name));
    if (f == all.end()) continue;
    for (const auto& series : f->at("series")) {
      if (series.at("labels").value("tp_rank", "") != rank) continue;
      double below = 0;
      const auto& buckets = series.at("buckets");
      for (std::size_t i = 0; i < buckets.size(); ++i) {
        const double cumulative = buckets[i][1].get<double>();
        c[str_cat(name, "_bucket_", i)] = cumulative - below;
        below = cumulative;
      }
    }
  }
  if (options_.l3_detach_every > 0) c["l3_detaches"] = static_cast<double>(l3_detaches_);
  out.first_mismatch = stack_.engine().first_mismatch();
  return out;
}

std::map<std::string, double> rank_figures(const InstanceResult& rank) {
  std::map<std::string, double> out;
  double hits = 0;
  for (const RequestRecord& r : rank.records)
    hits += static_cast<double>(r.report.storage_hit_tokens);
  out["storage_hit_tokens"] = hits;
  for (const char* k : {"l2_to_l3_bytes", "l3_to_l2_bytes", "verified_pages", "mismatched_pages"}) {
    const auto it = rank.counters.find(k);
    out[k] = it != rank.counters.end() ? it->second : 0.0;
  }
  return out;
}

std::map<std::string, double> Runner::l3_counters() const {
  std::map<std::string, double> c;
  const auto metric = [&](const char* name, MetricLabels labels) {
    return cache_metric(stack_, name, std::move(labels));
  };
  c["l2_to_l3_bytes"] = metric("hicache_bytes_total", {{"direction", "l2_to_l3"}});
  c["l3_to_l2_bytes"] = metric("hicache_bytes_total", {{"direction", "l3_to_l2"}});
  c["l3_to_l2_seconds"] = 0;
  if (const StorageController* sc = const_cast<EngineStack&>(stack_).storage_controller()) {
    c["l3_to_l2_seconds"] = sc->read_seconds();
    // The confirmation histogram's buckets: counts add up over ranks and instances, and the
    // report reads its percentiles from the sums (summarize: prefetch_confirm_ms).
    const auto counts = sc->prefetch_confirm_latency().counts();
    for (std::size_t i = 0; i < counts.size(); ++i) {
      c[str_cat("prefetch_confirm_bucket_", i)] = static_cast<double>(counts[i]);
    }
  }
  c["storage_errors"] = metric("hicache_storage_op_failures_total", {});
  if (const StorageBackend* b = const_cast<EngineStack&>(stack_).storage()) {
    const auto storage_keys = [&](const char* op, const char* result) {
      return metric("hicache_storage_keys_total",
                    {{"backend", std::string(b->name())}, {"op", op}, {"result", result}});
    };
    c["storage_get_errors"] = storage_keys("get", "error");
    c["storage_set_errors"] = storage_keys("set", "error");
    c["storage_get_misses"] = storage_keys("get", "miss");
    c["storage_bad_records"] = metric("hicache_storage_bad_records_total",
                                      {{"backend", std::string(b->name())}});
    // What the store itself wrote: the backups' bytes less the pages it held already.
    c["l3_stored_bytes"] = metric("hicache_storage_bytes_total",
                                  {{"backend", std::string(b->name())}, {"direction", "written"}});
  }
  return c;
}

}  // namespace hicache::workload
