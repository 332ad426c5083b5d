#include "storage/collective.h"

#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <thread>

#include "transfer/device.h"
#include "transfer/errors.h"

extern char** environ;

namespace hicache {
namespace {

// Waits (yielding) until `ready` holds, for at most 20 s: false if it never did, so a broken
// feature fails the test instead of hanging it.
template <typename Ready>
bool eventually(Ready ready) {
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!ready()) {
    if (std::chrono::steady_clock::now() > give_up) return false;
    std::this_thread::yield();
  }
  return true;
}

// Runs fn(rank, collective) on one thread per rank.
template <typename Fn>
void run_ranks(std::vector<std::unique_ptr<Collective>>& ranks, Fn fn) {
  std::vector<std::thread> threads;
  for (auto& c : ranks) threads.emplace_back([&fn, &c] { fn(c->rank(), *c); });
  for (auto& t : threads) t.join();
}

TEST(Collective, LocalIsTheIdentity) {
  LocalCollective c;
  std::vector<std::int64_t> v = {5, -3, 7};
  EXPECT_TRUE(c.min_allreduce(v, "hits").ok);
  EXPECT_EQ(v, (std::vector<std::int64_t>{5, -3, 7}));
  EXPECT_TRUE(c.barrier("step").ok);
}

TEST(Collective, InProcessFourRanksAgreeOnTheMinimumEveryRound) {
  std::shared_ptr<InProcessGroup> group;
  auto ranks = InProcessGroup::make_ranks(4, std::chrono::seconds(30), &group);
  run_ranks(ranks, [](int rank, Collective& c) {
    for (int round = 0; round < 500; ++round) {
      std::vector<std::int64_t> v = {100 + rank * 7 + round, 50 - rank, round % (rank + 1)};
      const auto r = c.min_allreduce(v, "prefetch.hits");
      ASSERT_TRUE(r.ok) << r.error;
      ASSERT_EQ(v, (std::vector<std::int64_t>{100 + round, 47, 0})) << "round " << round;
      if (round % 50 == 0) {
        ASSERT_TRUE(c.barrier("step").ok);
      }
    }
  });
  EXPECT_EQ(group->divergence(), "");
}

TEST(Collective, DifferentTagsAreADivergenceOnEveryRankAndZeroTheValues) {
  std::shared_ptr<InProcessGroup> group;
  auto ranks = InProcessGroup::make_ranks(2, std::chrono::seconds(30), &group);
  std::vector<CollectiveResult> results(2);
  std::vector<std::vector<std::int64_t>> values(2, {9, 9});
  run_ranks(ranks, [&](int rank, Collective& c) {
    results[rank] = c.min_allreduce(values[rank], rank == 0 ? "prefetch.hits" : "backup.done");
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_FALSE(results[r].ok);
    EXPECT_NE(results[r].error.find("divergence"), std::string::npos) << results[r].error;
    EXPECT_EQ(values[r], (std::vector<std::int64_t>{0, 0})) << "failure counts as zero";
  }
  EXPECT_NE(group->divergence(), "");
  // Failed once, failed for good: no later call can hang or pretend to agree.
  std::vector<std::int64_t> v = {3};
  EXPECT_FALSE(ranks[0]->min_allreduce(v, "prefetch.hits").ok);
  EXPECT_EQ(v[0], 0);
  EXPECT_NE(ranks[1]->failure(), "");
}

TEST(Collective, SkippedCallIsCaughtAsDivergence) {
  // Rank 1 skips one call (the reference's deadlock): its next call meets rank 0's second one.
  std::shared_ptr<InProcessGroup> group;
  auto ranks = InProcessGroup::make_ranks(2, std::chrono::seconds(30), &group);
  std::vector<int> ok(2, 1);  // not vector<bool>: ranks write their own element concurrently
  run_ranks(ranks, [&](int rank, Collective& c) {
    std::vector<std::int64_t> v = {1};
    if (rank == 0) ok[0] = c.min_allreduce(v, "a").ok && ok[0];
    ok[rank] = c.min_allreduce(v, "b").ok && ok[rank];
    if (rank == 1) ok[1] = c.min_allreduce(v, "a").ok && ok[1];
  });
  EXPECT_FALSE(ok[0]);
  EXPECT_FALSE(ok[1]);
  EXPECT_NE(group->divergence(), "");
}

TEST(Collective, DifferentLengthsAreADivergence) {
  std::shared_ptr<InProcessGroup> group;
  auto ranks = InProcessGroup::make_ranks(2, std::chrono::seconds(30), &group);
  std::vector<int> ok(2, 0);
  run_ranks(ranks, [&](int rank, Collective& c) {
    std::vector<std::int64_t> v(rank + 1, 4);
    ok[rank] = c.min_allreduce(v, "x").ok;
  });
  EXPECT_FALSE(ok[0]);
  EXPECT_FALSE(ok[1]);
  EXPECT_NE(group->divergence().find("reduces"), std::string::npos) << group->divergence();
}

TEST(Collective, AMissingRankTimesOutInsteadOfHanging) {
  auto ranks = InProcessGroup::make_ranks(2, std::chrono::milliseconds(100));
  std::vector<std::int64_t> v = {8};
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = ranks[0]->min_allreduce(v, "hits");
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.error.find("waited 100 ms"), std::string::npos) << r.error;
  EXPECT_EQ(v[0], 0);
  // The late rank fails at once rather than waiting for a partner that gave up.
  std::vector<std::int64_t> w = {8};
  EXPECT_FALSE(ranks[1]->min_allreduce(w, "hits").ok);
  EXPECT_EQ(w[0], 0);
}

// stop(): a rank inside a call its peers will never make returns at once, not at the timeout;
// the interrupted collective stays failed (a resume() cannot make the ranks agree again).
TEST(Collective, CancelEndsACallInFlightAndTheCollectiveStaysFailed) {
  std::shared_ptr<InProcessGroup> group;
  auto ranks = InProcessGroup::make_ranks(2, std::chrono::seconds(30), &group);
  std::vector<std::int64_t> v = {8, 9};
  CollectiveResult r;
  std::thread waiter([&] { r = ranks[1]->min_allreduce(v, "backup.done"); });
  ASSERT_TRUE(eventually([&] { return group->waiting() != 0; })) << "rank 1 never entered";
  ranks[1]->cancel("the storage controller stopped");
  waiter.join();
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.error.find("cancelled during the call: the storage controller stopped"),
            std::string::npos)
      << r.error;
  EXPECT_EQ(v, (std::vector<std::int64_t>{0, 0}));
  ranks[1]->resume();
  std::vector<std::int64_t> w = {8};
  EXPECT_FALSE(ranks[1]->min_allreduce(w, "next").ok) << "an interrupted collective stays failed";
  EXPECT_EQ(w[0], 0);
  // The peer's next call fails at once too: the group is broken, as a closed connection would
  // break it over a network.
  std::vector<std::int64_t> x = {8};
  const auto peer = ranks[0]->min_allreduce(x, "backup.done");
  EXPECT_FALSE(peer.ok);
  EXPECT_NE(peer.error.find("rank 1 cancelled its call"), std::string::npos) << peer.error;
}

// A cancel that interrupted nothing refuses calls (without counting them) until resume(), after
// which the ranks agree again: a reset after stop keeps L3 on.
TEST(Collective, CancelWithNoCallInFlightRefusesCallsUntilResume) {
  std::shared_ptr<InProcessGroup> group;
  auto ranks = InProcessGroup::make_ranks(2, std::chrono::seconds(30), &group);
  for (auto& c : ranks) c->cancel("stopping");
  for (auto& c : ranks) {
    std::vector<std::int64_t> v = {3};
    const auto r = c->min_allreduce(v, "hits");
    EXPECT_FALSE(r.ok);
    EXPECT_NE(r.error.find("cancelled: stopping"), std::string::npos) << r.error;
    EXPECT_EQ(v[0], 0);
    EXPECT_EQ(c->failure(), "") << "a refused call does not fail the collective";
  }
  EXPECT_EQ(group->waiting(), 0) << "a refused call never reached the group";
  for (auto& c : ranks) c->resume();
  run_ranks(ranks, [](int rank, Collective& c) {
    std::vector<std::int64_t> v = {10 + rank, 20 - rank};
    const auto r = c.min_allreduce(v, "hits");
    ASSERT_TRUE(r.ok) << r.error;
    EXPECT_EQ(v, (std::vector<std::int64_t>{10, 19}));
  });
  EXPECT_EQ(group->divergence(), "");
  // One rank never waits: cancel leaves it working (a TP=1 engine's one collective serves the
  // caller's thread too).
  LocalCollective local;
  local.cancel("stopping");
  std::vector<std::int64_t> v = {4};
  EXPECT_TRUE(local.min_allreduce(v, "hits").ok);
  EXPECT_EQ(v[0], 4);
}

// A backend whose reduction holds until released and then completes, whatever a cancel did
// meanwhile (its transport had already finished): what a cancel at the edge of a call means is
// then the base's decision alone. It records what the base asks of it.
class EdgeCollective final : public Collective {
 public:
  int rank() const override { return 0; }
  int size() const override { return 2; }
  std::string_view name() const override { return "edge"; }

  void release() {
    std::lock_guard lock(mu_);
    released_ = true;
    cv_.notify_all();
  }
  std::string reduce_error;  // what reduce_min returns (set before a call)
  int interrupts = 0, closes = 0;
  std::string closed_why;

 protected:
  std::string reduce_min(std::span<std::int64_t>) override {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return released_; });
    return reduce_error;
  }
  void interrupt(const std::string&) override { ++interrupts; }
  void close_transport(const std::string& why) override {
    ++closes;
    closed_why = why;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool released_ = false;
};

// A cancel that lands while the call is in progress but too late to disturb its transport: the
// call returns its values (every rank has them), yet the collective is failed for good, resume()
// does not lift it, and this rank's side of the group is closed so that the peers, for whom the
// call went well, do not wait on this rank at their next call until their timeout.
TEST(Collective, CancelAsACallCompletesFailsForGoodAndClosesTheTransport) {
  EdgeCollective c;
  std::vector<std::int64_t> v = {4, 5};
  CollectiveResult r;
  std::thread caller([&] { r = c.min_allreduce(v, "backup.done"); });
  ASSERT_TRUE(eventually([&] { return c.in_call(); }));
  c.cancel("stopping");
  c.release();
  caller.join();
  EXPECT_TRUE(r.ok) << r.error;
  EXPECT_EQ(v, (std::vector<std::int64_t>{4, 5}));
  EXPECT_EQ(c.interrupts, 1);
  EXPECT_NE(c.failure().find("cancelled during the call: stopping"), std::string::npos)
      << c.failure();
  EXPECT_EQ(c.closes, 1);
  EXPECT_EQ(c.closed_why, c.failure());
  c.resume();
  std::vector<std::int64_t> w = {7};
  const auto next = c.min_allreduce(w, "next");
  EXPECT_FALSE(next.ok) << "resume() lifted the failure of an interrupted call";
  EXPECT_EQ(next.error, c.failure());
  EXPECT_EQ(w[0], 0);
  EXPECT_EQ(c.closes, 1) << "closed once";
  EXPECT_FALSE(c.in_call());
}

// Any failure closes the transport, once: a transport error here.
TEST(Collective, AFailedCallClosesTheTransportOnce) {
  EdgeCollective c;
  c.reduce_error = "connection reset by peer";
  c.release();
  std::vector<std::int64_t> v = {4};
  const auto r = c.min_allreduce(v, "hits");
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.error.find("connection reset by peer"), std::string::npos) << r.error;
  EXPECT_EQ(c.closes, 1);
  EXPECT_EQ(c.closed_why, r.error);
  EXPECT_FALSE(c.min_allreduce(v, "hits").ok);
  EXPECT_EQ(c.closes, 1);
  EXPECT_EQ(c.interrupts, 0);
}

// In process, a rank's failure breaks the group: the peer's next call fails at once with it.
TEST(Collective, InProcessRankThatFailsBreaksTheGroup) {
  std::shared_ptr<InProcessGroup> group;
  auto ranks = InProcessGroup::make_ranks(2, std::chrono::seconds(30), &group);
  group->leave(1, "a local failure");
  std::vector<std::int64_t> v = {3};
  const auto r = ranks[0]->min_allreduce(v, "hits");
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.error.find("rank 1's collective failed: a local failure"), std::string::npos)
      << r.error;
}

TEST(GroupFailureNote, PublishedOnceAndReadByEveryRank) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("hicache-note-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  GroupFailureNote rank0(dir.string(), "tp"), rank1(dir.string(), "tp"), other(dir.string(), "pp");
  EXPECT_EQ(rank0.read(), "");
  rank1.publish(1, "cancelled during the call: stopping");
  EXPECT_EQ(rank0.read(), "rank 1 failed: cancelled during the call: stopping");
  rank0.publish(0, "later");
  EXPECT_EQ(rank0.read(), "rank 1 failed: cancelled during the call: stopping") << "first stays";
  EXPECT_EQ(other.read(), "") << "another prefix is another group";
  rank0.clear();
  EXPECT_EQ(rank1.read(), "") << "cleared for every rank";
  rank0.publish(0, "next launch");
  EXPECT_EQ(rank1.read(), "rank 0 failed: next launch");
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir),
                          std::filesystem::directory_iterator()),
            1)
      << "no temporary file left beside the note";
  // A directory that cannot be written loses only the note.
  GroupFailureNote gone((dir / "missing").string(), "tp");
  gone.publish(0, "x");
  EXPECT_EQ(gone.read(), "");
  std::filesystem::remove_all(dir);
}

TEST(Collective, BadArgumentsAreNamed) {
  EXPECT_THROW(InProcessGroup::make_ranks(0), InvalidArgument);
  EXPECT_THROW(make_gloo_collective(GlooConfig{.rank = 2, .size = 2, .store_dir = "/tmp"}),
               InvalidArgument);
  EXPECT_THROW(make_gloo_collective(GlooConfig{.rank = 0, .size = 1, .store_dir = ""}),
               InvalidArgument);
}

TEST(GlooCollective, ABadConnectTimeoutIsNamed) {
  try {
    make_gloo_collective(GlooConfig{.rank = 0, .size = 1, .store_dir = "/tmp",
                                    .connect_timeout = std::chrono::milliseconds(0)});
    ADD_FAILURE() << "a connect_timeout of 0 ms was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("connect_timeout 0 ms"), std::string::npos) << e.what();
  }
}

// The rendezvous waits connect_timeout, not the call timeout: a rank whose peer never starts
// fails set-up once connect_timeout is over, with the reason, and not before it.
TEST(GlooCollective, APeerThatNeverStartsFailsSetUpAfterTheConnectTimeout) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("hicache-gloo-" + std::to_string(::getpid()) + "-alone");
  std::filesystem::remove_all(dir);
  const auto t0 = std::chrono::steady_clock::now();
  try {
    make_gloo_collective(GlooConfig{.rank = 0, .size = 2, .store_dir = dir.string(),
                                    .timeout = std::chrono::milliseconds(50),
                                    .connect_timeout = std::chrono::milliseconds(1500)});
    ADD_FAILURE() << "set-up succeeded without the peer";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 0 of 2 could not connect"), std::string::npos)
        << e.what();
  }
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_GE(took, std::chrono::milliseconds(1500)) << "gave up before connect_timeout";
  EXPECT_LT(took, std::chrono::seconds(30));
  std::filesystem::remove_all(dir);
}

// Gloo: N processes of gloo_worker over TCP on loopback.
int run_gloo(int size, const std::string& scenario) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("hicache-gloo-" + std::to_string(::getpid()) + "-" + scenario + "-" +
                    std::to_string(size));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  std::vector<pid_t> pids;
  for (int r = 0; r < size; ++r) {
    std::vector<std::string> args = {HICACHE_GLOO_WORKER, std::to_string(r), std::to_string(size),
                                     dir.string(), scenario};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_t pid = 0;
    if (posix_spawn(&pid, HICACHE_GLOO_WORKER, nullptr, nullptr, argv.data(), environ) != 0) {
      return -1;
    }
    pids.push_back(pid);
  }
  int failures = 0;
  for (std::size_t r = 0; r < pids.size(); ++r) {
    int status = 0;
    ::waitpid(pids[r], &status, 0);
    if (WIFSIGNALED(status)) {
      ADD_FAILURE() << "gloo_worker rank " << r << " (" << scenario << ") killed by signal "
                    << WTERMSIG(status) << " (" << strsignal(WTERMSIG(status)) << ")";
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ++failures;
  }
  std::filesystem::remove_all(dir);
  return failures;
}

TEST(GlooCollective, TwoProcessesAgree) { EXPECT_EQ(run_gloo(2, "agree"), 0); }
TEST(GlooCollective, FourProcessesAgree) { EXPECT_EQ(run_gloo(4, "agree"), 0); }
// Each worker exits 0 only when it saw the divergence (or the peer's exit) as a failed call.
TEST(GlooCollective, DivergenceFailsEveryRank) { EXPECT_EQ(run_gloo(2, "diverge"), 0); }
TEST(GlooCollective, ADeadRankFailsTheOthersWithinTheTimeout) {
  EXPECT_EQ(run_gloo(3, "dead"), 0);
}
// A rank inside a call its peer never makes is cancelled: it returns at once (the timeout is
// 30 s), says why, and the collective stays failed.
TEST(GlooCollective, CancelEndsACallThePeerNeverMakes) { EXPECT_EQ(run_gloo(2, "cancel"), 0); }
// Different vector lengths are a divergence on every rank, never a read past a buffer.
TEST(GlooCollective, DifferentLengthsFailEveryRank) { EXPECT_EQ(run_gloo(2, "lengths"), 0); }
// A rank whose collective fails on its own (a call it refuses before sending anything) closes
// its connections: the peer's call fails at once, not at its 30 s timeout.
TEST(GlooCollective, ARankThatFailsAloneFailsThePeerAtOnce) {
  EXPECT_EQ(run_gloo(2, "closes"), 0);
}


// NCCL: needs a GPU per rank. Set-up failures and a lone rank run on one GPU; agreement across
// ranks needs two GPUs (NCCL refuses two ranks of one communicator on the same GPU).
std::filesystem::path fresh_dir(const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("hicache-nccl-" + std::to_string(::getpid()) + "-" + name);
  std::filesystem::remove_all(dir);
  return dir;
}

#define SKIP_WITHOUT_NCCL()                                                      \
  do {                                                                           \
    std::string why;                                                             \
    if (!nccl_available(&why)) GTEST_SKIP() << "NCCL unavailable: " << why;      \
  } while (0)

TEST(NcclCollective, BadArgumentsAreNamedOnEveryMachine) {
  try {
    make_nccl_collective(NcclConfig{.rank = 3, .size = 2, .store_dir = "/tmp"});
    FAIL() << "rank 3 of 2 accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("rank 3"), std::string::npos) << e.what();
  }
  EXPECT_THROW(make_nccl_collective(NcclConfig{.cuda_ordinal = -1, .store_dir = "/tmp"}),
               InvalidArgument);
  EXPECT_THROW(make_nccl_collective(NcclConfig{.store_dir = ""}), InvalidArgument);
  EXPECT_THROW(make_nccl_collective(NcclConfig{.store_dir = "/tmp",
                                               .timeout = std::chrono::milliseconds(0)}),
               InvalidArgument);
}

TEST(NcclCollective, WithoutAGpuTheErrorSaysWhy) {
  std::string why;
  if (nccl_available(&why)) GTEST_SKIP() << "a GPU answers here; covered by the tests below";
  try {
    make_nccl_collective(NcclConfig{.store_dir = fresh_dir("nogpu").string()});
    FAIL() << "created without a GPU";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
  }
}

TEST(NcclCollective, OneRankIsTheIdentity) {
  SKIP_WITHOUT_NCCL();
  auto c = make_nccl_collective(NcclConfig{.store_dir = fresh_dir("one").string()});
  std::vector<double> us;
  for (int round = 0; round < 200; ++round) {
    std::vector<std::int64_t> v = {5 + round, -3, std::int64_t{1} << 40, round % 3};
    const auto want = v;
    const auto t0 = std::chrono::steady_clock::now();
    const auto r = c->min_allreduce(v, "hits");
    us.push_back(
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    ASSERT_TRUE(r.ok) << r.error;
    ASSERT_EQ(v, want);
  }
  EXPECT_TRUE(c->barrier("step").ok);
  std::vector<std::int64_t> big(1000, 9);  // grows the device buffer
  EXPECT_TRUE(c->min_allreduce(big, "big").ok);
  EXPECT_EQ(big, std::vector<std::int64_t>(1000, 9));
  std::sort(us.begin(), us.end());
  std::printf("nccl min_allreduce, 1 rank: median %.1f us, p99 %.1f us\n", us[us.size() / 2],
              us[us.size() * 99 / 100]);
}

// A peer that failed for good left its note: the next call fails at once with the peer's reason,
// and the collective stays failed (its communicator aborted; the destructor must not hang).
TEST(NcclCollective, APeersFailureNoteFailsTheNextCall) {
  SKIP_WITHOUT_NCCL();
  const std::string dir = fresh_dir("note").string();
  auto c = make_nccl_collective(NcclConfig{.store_dir = dir, .prefix = "tp"});
  std::vector<std::int64_t> v = {5, 6};
  ASSERT_TRUE(c->min_allreduce(v, "before").ok) << c->failure();
  GroupFailureNote(dir, "other").publish(1, "another group's failure");
  ASSERT_TRUE(c->min_allreduce(v, "other group").ok) << c->failure();
  GroupFailureNote(dir, "tp").publish(1, "cancelled during the call: stopping");
  const auto r = c->min_allreduce(v, "after");
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.error.find("rank 1 failed: cancelled during the call: stopping"), std::string::npos)
      << r.error;
  EXPECT_EQ(v, (std::vector<std::int64_t>{0, 0}));
  std::vector<std::int64_t> w = {7};
  EXPECT_FALSE(c->min_allreduce(w, "later").ok);
  EXPECT_EQ(w[0], 0);
}

// What an earlier launch left in the directory is not this launch's failure: rank 0 clears the
// note before it publishes the id.
TEST(NcclCollective, AStaleFailureNoteIsClearedAtSetUp) {
  SKIP_WITHOUT_NCCL();
  const std::string dir = fresh_dir("stale").string();
  GroupFailureNote(dir, "tp").publish(1, "the earlier launch's failure");
  auto c = make_nccl_collective(NcclConfig{.store_dir = dir, .prefix = "tp"});
  std::vector<std::int64_t> v = {5};
  const auto r = c->min_allreduce(v, "hits");
  EXPECT_TRUE(r.ok) << r.error;
  EXPECT_EQ(v[0], 5);
}

TEST(NcclCollective, APeerThatNeverJoinsFailsSetUpWithinTheTimeout) {
  SKIP_WITHOUT_NCCL();
  const auto t0 = std::chrono::steady_clock::now();
  try {
    make_nccl_collective(NcclConfig{.rank = 0, .size = 2, .store_dir = fresh_dir("alone").string(),
                                    .timeout = std::chrono::milliseconds(2000)});
    FAIL() << "set up without its peer";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("joined within 2000 ms"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(30));
}

TEST(NcclCollective, ARankWithoutRankZeroFailsWithinTheTimeout) {
  SKIP_WITHOUT_NCCL();
  try {
    make_nccl_collective(NcclConfig{.rank = 1, .size = 2, .store_dir = fresh_dir("norank0").string(),
                                    .timeout = std::chrono::milliseconds(500)});
    FAIL() << "set up without rank 0";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("published no NCCL id"), std::string::npos) << e.what();
  }
}

// Two ranks on GPUs 0 and 1, set up concurrently; empty when the machine has one GPU (`why`).
std::vector<std::unique_ptr<Collective>> two_gpu_ranks(const std::string& name,
                                                       std::chrono::milliseconds timeout,
                                                       std::string* why) {
  try {
    Device::create("cuda", 1);
  } catch (const std::exception& e) {
    *why = std::string("needs a second GPU (NCCL allows one rank per GPU): ") + e.what();
    return {};
  }
  const std::string dir = fresh_dir(name).string();
  std::vector<std::unique_ptr<Collective>> ranks(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      ranks[r] = make_nccl_collective(NcclConfig{.rank = r, .size = 2, .cuda_ordinal = r,
                                                 .store_dir = dir, .timeout = timeout});
    });
  }
  for (auto& t : threads) t.join();
  return ranks;
}

// Agreement, then a divergence, which fails both ranks for good.
TEST(NcclCollective, TwoGpusAgreeAndDetectDivergence) {
  SKIP_WITHOUT_NCCL();
  std::string why;
  auto ranks = two_gpu_ranks("two", std::chrono::milliseconds(3000), &why);
  if (ranks.empty()) GTEST_SKIP() << why;
  run_ranks(ranks, [](int rank, Collective& c) {
    for (int round = 0; round < 100; ++round) {
      std::vector<std::int64_t> v = {100 + rank + round, 7 * (2 - rank)};
      ASSERT_TRUE(c.min_allreduce(v, "hits").ok) << c.failure();
      ASSERT_EQ(v, (std::vector<std::int64_t>{100 + round, 7}));
    }
    std::vector<std::int64_t> v = {5};
    EXPECT_FALSE(c.min_allreduce(v, rank == 0 ? "a" : "b").ok);
    EXPECT_EQ(v[0], 0);
  });
  std::vector<std::int64_t> v = {5};
  EXPECT_FALSE(ranks[0]->min_allreduce(v, "hits").ok);
}

TEST(NcclCollective, ARankThatStopsCallingFailsThePeerWithinTheTimeout) {
  SKIP_WITHOUT_NCCL();
  std::string why;
  auto ranks = two_gpu_ranks("stall", std::chrono::milliseconds(1000), &why);
  if (ranks.empty()) GTEST_SKIP() << why;
  std::vector<std::int64_t> v = {5};
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = ranks[0]->min_allreduce(v, "hits");  // rank 1 never calls
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.error.find("no reply within 1000 ms"), std::string::npos) << r.error;
  EXPECT_EQ(v[0], 0);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(20));
}

}  // namespace
}  // namespace hicache
