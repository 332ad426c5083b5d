// Collectives: how the tensor-parallel ranks agree (docs/architecture.md, "Tensor parallelism").
//
// One operation does all the work: an element-wise minimum of a fixed-size int64 vector over the
// ranks (a step's counts are fused into one call, since each call costs a network round trip), plus a
// barrier. Every call carries a tag naming its call site. The tag and a per-collective call
// number are fused into the same reduction as two extra elements (h and -h, whose minima differ
// when ranks disagree), so every implementation detects ranks that entered different calls, the
// first failure class of the reference (deadlocks from skipped or conditional collectives).
//
// Failure (a divergence, a peer that timed out or died, a transport error): the values are set to
// zero on the ranks that see it, so a prefetch or backup counts as zero hits / zero completed, and
// the result says why. A collective that failed once stays failed (the ranks may disagree on
// where the stream of calls stands), so later calls fail at once with the first reason: L3 is
// then off on every rank, L1 and L2 keep serving, and the status shows it. A rank whose
// collective fails closes its side of the group at once (close_transport()), so a peer waiting
// on it, now or in its next call, fails at once too rather than at its timeout.
//
// The multi-process groups (Gloo, NCCL) meet through a directory shared by the ranks: it must be
// fresh for each launch of the group (a new directory, or a prefix of its own), as with any
// FileStore rendezvous; what an earlier launch left there (addresses, an NCCL id) would be read
// as this launch's. NCCL's rank 0 also clears a failure note at set-up (the id still needs a
// fresh directory).
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "transfer/mutex.h"

namespace hicache {

// The most values one min_allreduce of the multi-process groups carries (Gloo's message slots;
// the in-process group keeps the same limit, so the tests meet it too). A longer vector goes in
// several calls (RestorablePrefix::agree).
inline constexpr std::size_t kCollectiveMaxValues = 62;

struct CollectiveResult {
  bool ok = true;
  std::string error;  // why, when !ok
};

class Collective {
 public:
  virtual ~Collective() = default;
  Collective(const Collective&) = delete;
  Collective& operator=(const Collective&) = delete;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string_view name() const = 0;
  // The most values one min_allreduce carries (a longer call fails); unbounded by default.
  virtual std::size_t max_values() const { return std::numeric_limits<std::size_t>::max(); }

  // Element-wise minimum over the ranks, in place. Not reentrant: one caller thread at a time
  // per rank (concurrent callers are serialised).
  CollectiveResult min_allreduce(std::span<std::int64_t> values, std::string_view tag);
  // Every rank has entered barrier(tag).
  CollectiveResult barrier(std::string_view tag) { return min_allreduce({}, tag); }

  // The first failure, or empty.
  std::string failure() const;
  // Calls made on this rank so far (what each costs under TP is a round trip between ranks).
  std::uint64_t calls() const;
  // Wall time this rank spent inside its calls' reductions (waiting for the peers included).
  // Readable from any thread, while a call runs too.
  double seconds() const;
  // A call is in progress on this rank now (what a cancel() would interrupt).
  bool in_call() const;

  // Ends the call in flight on this rank, if any, at once, and refuses every later call until
  // resume(): they fail with "cancelled: <why>". Thread-safe: stop() calls it from the owner's
  // thread while a storage thread may be inside min_allreduce. It exists for shutdown: when the
  // ranks stop, one rank's thread may already have entered the collective of an op that its
  // peers took off their queues unrun, and without a cancel it would wait out the timeout.
  // A call it interrupted leaves the collective failed for good (the ranks no longer agree on
  // where the stream of calls stands, and the transport may be closed); one that interrupted
  // nothing does not. A collective of one rank never waits, so cancel() leaves it as it is
  // (one LocalCollective may serve every role of a TP=1 engine, the caller's included).
  void cancel(std::string_view why);
  // Lifts cancel() (a reset after stop): calls run again. A collective that failed, by a call
  // the cancel interrupted or otherwise, stays failed.
  void resume();

 protected:
  Collective() = default;
  // Reduces `buffer` in place (element-wise minimum); returns an error text or empty.
  virtual std::string reduce_min(std::span<std::int64_t> buffer) = 0;
  // Makes the reduce_min running on another thread return an error soon (cancel()); called at
  // most once per call, only while a reduce_min runs or is about to start, never concurrently
  // with itself. An implementation must also fail a reduce_min that starts after it.
  virtual void interrupt(const std::string& why) = 0;
  // Called once, when this collective fails for good (`why` is the failure), on the calling
  // thread with no reduce_min running: shut this rank's side of the group so that its peers'
  // calls fail at once instead of waiting for it until their timeout. The failure may be local
  // (a cancel that landed as the call completed, a call refused before it was sent), in which
  // case the peers would otherwise wait on a rank that will never send again.
  virtual void close_transport(const std::string& why) = 0;

 private:
  // Zeroes `values`, records `why` as the failure for good (the first one stays) and returns
  // the result that says so.
  CollectiveResult fail_locked(std::span<std::int64_t> values, std::string why)
      HICACHE_REQUIRES(mu_);
  // The first failure stays, and closes this rank's side of the group.
  void fail_for_good_locked(std::string why) HICACHE_REQUIRES(mu_);

  mutable Mutex mu_;  // held through a call
  std::uint64_t calls_ HICACHE_GUARDED_BY(mu_) = 0;
  std::atomic<std::int64_t> nanos_{0};
  std::string failure_ HICACHE_GUARDED_BY(mu_);
  std::vector<std::int64_t> buffer_ HICACHE_GUARDED_BY(mu_);

  // cancel() state, apart from mu_ so that cancel() never waits for the call it ends.
  mutable Mutex cancel_mu_;
  bool in_call_ HICACHE_GUARDED_BY(cancel_mu_) = false;
  // Why cancel() interrupted the call in flight.
  std::string interrupted_ HICACHE_GUARDED_BY(cancel_mu_);
  std::string cancelled_ HICACHE_GUARDED_BY(cancel_mu_);  // the reason, while cancelled
};

// One rank: the reduction is the identity (of any length).
class LocalCollective final : public Collective {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string_view name() const override { return "local"; }

 protected:
  std::string reduce_min(std::span<std::int64_t>) override { return {}; }
  void interrupt(const std::string&) override {}
  void close_transport(const std::string&) override {}
};

// N ranks as threads of one process (how the tests run TP=2 and TP=4): make_ranks() returns one
// Collective per rank, each to be used by its own thread. A call carries at most
// kCollectiveMaxValues values, as over Gloo. A rank that waits longer than
// `timeout` for the others fails (and with it the group). divergence() keeps the first
// tag/sequence mismatch so a test can fail loudly on it.
class InProcessGroup : public std::enable_shared_from_this<InProcessGroup> {
 public:
  static std::vector<std::unique_ptr<Collective>> make_ranks(
      int size, std::chrono::milliseconds timeout = std::chrono::seconds(30),
      std::shared_ptr<InProcessGroup>* group = nullptr);

  std::string divergence() const;
  // Ranks inside the call now in progress (a test waits on it to cancel a call in flight).
  int waiting() const;

  // Implementation detail of the rank handles. An interrupt or a rank's failure breaks the
  // group: the other ranks' calls fail too, as a peer's closed connection fails them over a
  // network.
  std::string arrive(int rank, std::span<std::int64_t> buffer);
  void interrupt(int rank, const std::string& why);
  void leave(int rank, const std::string& why);
  explicit InProcessGroup(int size, std::chrono::milliseconds timeout);

 private:
  struct State;
  std::shared_ptr<State> state_;
};

// A note in a group's shared directory that one rank's collective failed for good, for the
// backends whose transport cannot tell the peers (an NCCL communicator aborted on one rank
// leaves the others' kernels waiting on it): each call checks it first (one stat) and fails at
// once with the rank's reason. The first rank to fail writes it (of two at once, either).
class GroupFailureNote {
 public:
  GroupFailureNote(const std::string& store_dir, const std::string& prefix);
  // Best effort (a directory that cannot be written only loses the shortcut).
  void publish(int rank, const std::string& why) const;
  // "rank R failed: <why>", or empty while no rank failed.
  std::string read() const;
  // Removes a note left by an earlier launch in the same directory. Rank 0 calls it before it
  // publishes the group's id, so no note of this launch can be lost to it (every peer fails only
  // after set-up, which needs that id).
  void clear() const;

 private:
  std::string path_;
};

// Checks what every multi-process group needs (rank in [0, size), a positive timeout, a store
// directory that exists or can be created); throws InvalidArgument naming the bad value.
void validate_group_config(std::string_view kind, int rank, int size, const std::string& store_dir,
                           std::chrono::milliseconds timeout);

// Processes over TCP (Gloo), rendezvous through a shared directory (a FileStore).
struct GlooConfig {
  int rank = 0;
  int size = 1;
  std::string store_dir;              // shared by all ranks; created if missing
  std::string prefix = "hicache";     // separates groups that share a store_dir
  std::string hostname = "127.0.0.1";  // the address this rank listens on
  std::chrono::milliseconds timeout{30000};  // each call
  // The rendezvous: every rank up and connected. Longer than a call's timeout, because ranks
  // start seconds apart (each loads its weights at its own speed) while a call that waits
  // longer than `timeout` means a dead or diverged peer.
  std::chrono::milliseconds connect_timeout{120000};
};

// Throws InvalidArgument naming a bad rank/size/directory/timeout, and Error when the rendezvous
// fails (a peer never showed up within connect_timeout).
std::unique_ptr<Collective> make_gloo_collective(const GlooConfig& config);

// GPUs (NCCL), one rank per GPU, compiled in CUDA builds. Rank 0 creates the NCCL unique id and
// hands it to the others through a shared directory (Gloo's FileStore), so no other launcher is
// needed. The reduction runs on the rank's own stream over a small device buffer; a watchdog
// thread aborts the communicator when a call outlasts `timeout` (a dead or diverged peer), so a
// call fails with the reason instead of hanging, and the collective stays failed from then on.
struct NcclConfig {
  int rank = 0;
  int size = 1;
  int cuda_ordinal = 0;               // the GPU of this rank
  std::string store_dir;              // shared by all ranks; created if missing
  std::string prefix = "hicache";     // separates groups that share a store_dir
  std::chrono::milliseconds timeout{30000};  // rendezvous, communicator set-up, and each call
};

// True when this build has NCCL and a GPU answers; `why` gets the reason if not.
bool nccl_available(std::string* why = nullptr);

// Throws InvalidArgument naming a bad rank/size/ordinal/directory, and Error when NCCL is not
// available or the set-up fails (a peer that never showed up within the timeout included).
std::unique_ptr<Collective> make_nccl_collective(const NcclConfig& config);

}  // namespace hicache
