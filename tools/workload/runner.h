// Drives a SimulatedEngine with a planned workload the way clients would: a request is sent once
// the request it depends on finished (and, with the barrier, once every request of the earlier
// rounds did), at Poisson arrival times when a rate is set (else as soon as it is ready), with at
// most `max_inflight` requests in flight. Between steps it collects the engine's reports and the
// queue depths. Sleeps only when nothing is in flight and the next arrival is in the future (a
// client's think time, not the engine's).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "tools/workload/simulated_engine.h"
#include "tools/workload/engine_stack.h"
#include "tools/workload/workload.h"

namespace hicache::workload {

struct RunOptions {
  double request_rate = 0;  // requests/s over all clients (Poisson); 0: all at once
  int max_inflight = 0;     // 0: no cap
  bool barrier = false;     // round r+1 waits until round r is done
  std::uint64_t seed = 1;
  std::string label;        // progress lines
  bool progress = true;     // progress on stderr (a bar on a terminal, else a line each 5 s)
  // > 0: every this many engine steps L3 is detached (HiCache::detach_storage) or, when
  // detached, attached again from the config (attach_storage): L3 runs in windows, as an
  // operator taking the store away and back would make it. The tiers' L3 figures add up over
  // the windows.
  std::int64_t l3_detach_every = 0;
};

struct RequestRecord {
  int index = 0;        // in the plan
  int instance = 0;
  bool rejected = false;  // larger than the device pool can ever hold
  bool aborted = false;   // ended by an engine reset
  double sent_s = 0;      // since the run's start
  FinishedRequest report;
};

// Everything one instance measured, as flat maps so that instances merge by adding up (counters)
// or taking the largest (maxima).
struct InstanceResult {
  std::vector<RequestRecord> records;
  std::map<std::string, double> counters;
  std::map<std::string, double> maxima;
  double duration_s = 0;
  std::string first_mismatch;
  // TP: each rank's own figures, rank 0 first (rank_figures()); empty without TP.
  std::vector<std::map<std::string, double>> ranks;
};

// One rank's figures for InstanceResult::ranks: its L3 hit tokens (storage_hit_tokens), bytes
// backed up (l2_to_l3_bytes) and read from L3 (l3_to_l2_bytes), pages verified and mismatched.
std::map<std::string, double> rank_figures(const InstanceResult& rank);

class Runner {
 public:
  // `mine`: the plan indices this instance serves (all of them for one instance); a dependency
  // outside `mine` counts as done (the round barrier between instances guarantees it).
  Runner(EngineStack& stack, const std::vector<PlannedRequest>& plan, std::vector<int> mine,
         RunOptions options, int instance = 0);

  // Runs the requests of `mine` whose round is in [first_round, last_round] to completion.
  void run_rounds(int first_round, int last_round);
  // The whole share: round by round with the barrier, else all rounds at once.
  void run_all();
  // Waits until every write, load and backup is acknowledged (what the tree holds is in L2/L3).
  void flush();

  // Counters and maxima as of now (engine, radix cache, controller, storage controller).
  InstanceResult result() const;

 private:
  void sample();
  void report_progress(bool final);
  // The figures the L3 store and its controller count (they go with a detach).
  std::map<std::string, double> l3_counters() const;
  // --l3_detach_every: detach or attach again.
  void toggle_l3();

  EngineStack& stack_;
  const std::vector<PlannedRequest>& plan_;
  std::vector<int> mine_;
  RunOptions options_;
  int instance_;
  std::vector<char> done_;   // by plan index
  std::vector<char> sent_;
  std::vector<double> finished_at_;  // by plan index; 0: not finished here
  std::vector<std::size_t> record_at_;  // by plan index: its place in records_, once sent
  std::vector<RequestRecord> records_;
  std::map<std::string, double> maxima_;
  std::map<std::string, double> retired_l3_;  // l3_counters() of the detached stores
  std::int64_t steps_ = 0;
  std::int64_t l3_detaches_ = 0;
  bool l3_detached_ = false;  // by toggle_l3
  double started_ = 0;
  double last_progress_ = 0;
  std::int64_t cached_tokens_ = 0, prompt_tokens_ = 0;
};

double now_seconds();  // steady clock, seconds

}  // namespace hicache::workload
