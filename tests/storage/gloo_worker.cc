// One rank of the Gloo collective tests: gloo_worker RANK SIZE STORE_DIR SCENARIO.
// Exits 0 when the scenario behaves as expected; prints why otherwise.
//   agree:   200 rounds of min_allreduce and barriers; every result checked; prints the median
//            min_allreduce latency (rank 0).
//   diverge: rank 0 calls tag "a", the others "b": every rank must see a failed call.
//   dead:    the last rank exits right after a first barrier; the others' next call must fail within
//            the timeout (2 s) instead of hanging.
//   cancel:  rank 1 enters a call rank 0 never makes and is cancelled from another thread once
//            it is inside: the call must fail as cancelled during the call, well before the
//            timeout (30 s), and the collective must stay failed after resume(); rank 0 stays
//            connected until rank 1 is done (it polls for a file).
//   lengths: rank 0 reduces 2 values, the others 3: every rank must see the length mismatch.
//   closes:  rank 0 fails on its own (a call of 63 values, over the limit, refused unsent) and
//            stays alive; rank 1's call must fail because rank 0 closed its connections, not at
//            the timeout (30 s).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "storage/collective.h"

int main(int argc, char** argv) {
  using namespace hicache;
  if (argc != 5) {
    std::fprintf(stderr, "usage: gloo_worker RANK SIZE STORE_DIR SCENARIO\n");
    return 2;
  }
  const int rank = std::atoi(argv[1]);
  const int size = std::atoi(argv[2]);
  const std::string scenario = argv[4];
  std::unique_ptr<Collective> c;
  try {
    // The rendezvous has its own timeout (connect_timeout, 120 s): the processes may start
    // seconds apart on a loaded machine. Calls wait 30 s, except in "dead", where a peer that
    // is gone must fail the call within 2 s.
    c = make_gloo_collective(GlooConfig{
        .rank = rank, .size = size, .store_dir = argv[3],
        .timeout = std::chrono::milliseconds(scenario == "dead" ? 2000 : 30000)});
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
    return 1;
  }
  if (scenario == "agree") {
    std::vector<double> us;
    for (int round = 0; round < 200; ++round) {
      std::vector<std::int64_t> v = {1000 + rank + round, 7 * (size - rank), round};
      const auto t0 = std::chrono::steady_clock::now();
      const auto r = c->min_allreduce(v, "hits");
      us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0)
                       .count());
      const std::vector<std::int64_t> want = {1000 + round, 7, round};
      if (!r.ok || v != want) {
        std::fprintf(stderr, "rank %d round %d: %s\n", rank, round, r.ok ? "wrong values" : r.error.c_str());
        return 1;
      }
      if (round % 20 == 0 && !c->barrier("step").ok) return 1;
    }
    std::sort(us.begin(), us.end());
    if (rank == 0) {
      std::printf("gloo min_allreduce, %d processes: median %.0f us, p99 %.0f us\n", size,
                  us[us.size() / 2], us[us.size() * 99 / 100]);
    }
    return 0;
  }
  if (scenario == "diverge") {
    std::vector<std::int64_t> v = {5};
    const auto r = c->min_allreduce(v, rank == 0 ? "a" : "b");
    if (r.ok || v[0] != 0) {
      std::fprintf(stderr, "rank %d: divergence not detected\n", rank);
      return 1;
    }
    return 0;
  }
  if (scenario == "dead") {
    // One call that every rank completes first, so the dead rank leaves only once the mesh is
    // up on every side (leaving during the others' handshakes is a failed start, not this case).
    if (!c->barrier("connected").ok) {
      std::fprintf(stderr, "rank %d: first barrier failed: %s\n", rank, c->failure().c_str());
      return 1;
    }
    if (rank == size - 1) std::_Exit(0);
    std::vector<std::int64_t> v = {5};
    const auto t0 = std::chrono::steady_clock::now();
    const auto r = c->min_allreduce(v, "hits");
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (r.ok || v[0] != 0 || s > 20) {
      std::fprintf(stderr, "rank %d: dead peer not reported (ok=%d, %.1f s)\n", rank, r.ok, s);
      return 1;
    }
    return 0;
  }
  // Rank 0 of "cancel" and "closes": stays connected, calling nothing, until rank 1 is done (or
  // 60 s), so that nothing but the scenario itself can end rank 1's call.
  const std::filesystem::path done = std::filesystem::path(argv[3]) / "rank1-done";
  auto wait_for_rank1 = [&] {
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (!std::filesystem::exists(done) && std::chrono::steady_clock::now() < give_up) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return std::filesystem::exists(done) ? 0 : 1;
  };
  if (scenario == "cancel") {
    if (!c->barrier("connected").ok) return 1;
    if (rank == 0) return wait_for_rank1();
    std::thread canceller([&] {
      const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(20);
      while (!c->in_call() && std::chrono::steady_clock::now() < give_up) {
        std::this_thread::yield();
      }
      // Into the wait proper, not just the call's start (rank 0 never calls, so the call cannot
      // end first): the cancel must end a call that is blocked on the transport. Not timing:
      // any delay gives the same result, a longer one only tests the blocked wait more surely.
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      c->cancel("the storage controller stopped");
    });
    std::vector<std::int64_t> v = {5, 6};
    const auto t0 = std::chrono::steady_clock::now();
    const auto r = c->min_allreduce(v, "backup.done");
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    canceller.join();
    c->resume();  // has no effect: the call was interrupted
    std::vector<std::int64_t> w = {5};
    const auto next = c->min_allreduce(w, "next");
    std::ofstream(done).put('1');
    if (r.ok ||
        r.error.find("cancelled during the call: the storage controller stopped") ==
            std::string::npos ||
        v != std::vector<std::int64_t>{0, 0} || s > 20 || next.ok || w[0] != 0 ||
        next.error != c->failure() || c->failure().empty()) {
      std::fprintf(stderr, "rank 1: cancel not seen (ok=%d, %.1f s, '%s'; next ok=%d '%s')\n",
                   r.ok, s, r.error.c_str(), next.ok, next.error.c_str());
      return 1;
    }
    return 0;
  }
  if (scenario == "closes") {
    if (!c->barrier("connected").ok) return 1;
    if (rank == 0) {
      std::vector<std::int64_t> v(63, 5);
      const auto r = c->min_allreduce(v, "hits");
      if (r.ok || r.error.find("at most 62 values") == std::string::npos) {
        std::fprintf(stderr, "rank 0: a call of 63 values was not refused ('%s')\n",
                     r.error.c_str());
        std::ofstream(done).put('1');
        return 1;
      }
      return wait_for_rank1();
    }
    std::vector<std::int64_t> v = {5};
    const auto t0 = std::chrono::steady_clock::now();
    const auto r = c->min_allreduce(v, "hits");
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::ofstream(done).put('1');
    if (r.ok || v[0] != 0 || r.error.find("Timed out") != std::string::npos || s > 20) {
      std::fprintf(stderr, "rank 1: rank 0's failure not seen at once (ok=%d, %.1f s, '%s')\n",
                   r.ok, s, r.error.c_str());
      return 1;
    }
    std::printf("rank 1: %s\n", r.error.c_str());
    return 0;
  }
  if (scenario == "lengths") {
    std::vector<std::int64_t> v(rank == 0 ? 2 : 3, 5);
    const auto r = c->min_allreduce(v, "hits");
    const std::string want =
        rank == 0 ? "rank 1 reduces 3 values while this rank reduces 2 (divergence)"
                  : "rank 0 reduces 2 values while this rank reduces 3 (divergence)";
    if (r.ok || r.error.find(want) == std::string::npos ||
        std::any_of(v.begin(), v.end(), [](std::int64_t x) { return x != 0; })) {
      std::fprintf(stderr, "rank %d: length divergence not detected (%s)\n", rank, r.error.c_str());
      return 1;
    }
    return 0;
  }
  std::fprintf(stderr, "unknown scenario %s\n", scenario.c_str());
  return 2;
}
