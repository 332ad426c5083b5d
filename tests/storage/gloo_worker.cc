// One rank of the Gloo collective tests: gloo_worker RANK SIZE STORE_DIR SCENARIO.
// Exits 0 when the scenario behaves as expected; prints why otherwise.
//   agree:   200 rounds of min_allreduce and barriers; every result checked; prints the median
//            min_allreduce latency (rank 0).
//   diverge: rank 0 calls tag "a", the others "b": every rank must see a failed call.
//   dead:    the last rank exits right after a first barrier; the others' next call must fail within
//            the timeout (2 s) instead of hanging.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
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
    c = make_gloo_collective(GlooConfig{.rank = rank, .size = size, .store_dir = argv[3],
                                        .timeout = std::chrono::milliseconds(
                                            scenario == "agree" ? 30000 : 2000)});
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
  std::fprintf(stderr, "unknown scenario %s\n", scenario.c_str());
  return 2;
}
