// How HiRadixCache's TP ranks agree, and what they agree on: the ops in flight (PendingOps),
// the acks that arrived on this rank (ArrivedAcks) and the step's one collective (Agreement),
// which also carries the estimates the cost rule weighs (cost_model.h).
//
// The rule (docs/architecture.md, "Tensor parallelism"): every change to the tree comes from
// values all ranks agreed on, so the trees stay identical. The ranks run the same ops in the
// same order, so their pending ops carry the same ids; once per step, for the oldest
// ops of each kind (at most kAgreeSlots, and together within the collective's max_values()),
// every rank says what arrived (0: not yet), and only what arrived everywhere is applied, with
// the worst rank's outcome. The same min-reduction carries, per prefetch, whether this rank
// lets it terminate and the pages it completed, and the cost rule's estimates
// (CostRule::Values). Nothing pending: no reduction (every rank skips it alike).
//
// Not thread-safe: the engine's main loop owns them.
#pragma once

#include <chrono>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "controller/radix/cost_model.h"
#include "controller/radix/node.h"
#include "controller/storage_controller.h"
#include "storage/collective.h"

namespace hicache::radix {

// Ops in flight: the node that holds the op's lock, and every node the op covers (a split adds
// the new upper part).
struct PendingOps {
  struct Op {
    Node* holder = nullptr;
    std::vector<Node*> nodes;
    std::uint64_t l3_clock = 0;  // backups: TierEvents::l3_clock() when it was queued
  };
  std::unordered_map<NodeId, Op> writes, loads, backups;
  // Backups in flight when the store was cleared: whatever they complete counts as nothing.
  std::unordered_set<NodeId> forgotten_backups;
  struct Prefetch {
    std::shared_ptr<PrefetchOperation> op;
    Node* node = nullptr;  // locked while the prefetch lasts
    std::vector<std::int32_t> tokens;
    std::string identity;
    std::int64_t reserved = 0;  // host tokens reserved for it
    // Per sidecar pool, the host slots it counts (TierPolicy::reserve_prefetch_sidecars).
    std::vector<std::int64_t> sidecar_counted;
    // TP: what the last check_events agreed (whether every rank's policy lets it terminate, and
    // the pages every rank had completed then).
    bool agreed_ready = false;
    std::int64_t agreed_pages = 0;
    // Steps (check_events calls) begun since its I/O was seen done on this rank; -1 before.
    std::int64_t steps_since_landed = -1;
    // TP: Step::Prefetch::landed_steps of the last check_events (-1: not landed everywhere).
    std::int64_t agreed_landed_steps = -1;
    // The cost rule's deadline: past it, waiting for the rest costs more than recomputing it
    // would have (nothing when the rule is off or not measured). `cut`: this rank told its I/O
    // to stop after the batch in flight (StorageController::cut_prefetch).
    std::optional<std::chrono::steady_clock::time_point> cut_at;
    bool cut = false;
    // This rank's view: the prefetch may terminate now (its policy allows it, or it was cut and
    // its I/O stopped).
    bool may_terminate(const StorageController& storage) const {
      return storage.can_terminate(*op) || (cut && op->stage() == PrefetchStage::kFinished);
    }
  };
  std::unordered_map<std::string, Prefetch> prefetches;
  // Prefetches that ended (check_events may end one before the scheduler asks): the tokens each
  // added to the tree, until check_prefetch_progress or release_aborted_request takes them.
  std::unordered_map<std::string, std::int64_t> inserted;

  // Removes and returns the op an ack names (nothing for an op this cache did not start).
  static std::optional<Op> take(std::unordered_map<NodeId, Op>& ops, NodeId id);
  // No write, load, backup or prefetch in flight.
  bool idle() const {
    return writes.empty() && loads.empty() && backups.empty() && prefetches.empty();
  }
};

// Acks that arrived on this rank and are not applied yet (TP: not yet agreed), each already
// encoded as the value the ranks min-reduce (never 0, which means "not arrived"): writes and
// loads kOk or kFailed, backups completed tokens + 1.
struct ArrivedAcks {
  static constexpr std::int64_t kFailed = 1, kOk = 2;
  static std::int64_t outcome(bool ok) { return ok ? kOk : kFailed; }
  std::unordered_map<NodeId, std::int64_t> writes, loads, backups;
  std::unordered_set<std::string> revoked;  // prefetch request ids
};

class Agreement {
 public:
  static constexpr std::size_t kAgreeSlots = 64;  // ops of each kind agreed per step

  // `tp`: the main loop's collective, or null (one rank). Not owned; outlives this.
  explicit Agreement(Collective* tp) : tp_(tp) {}

  // The ranks agree: a TP collective that has not failed.
  bool agreeing() const { return tp_ != nullptr && tp_->failure().empty(); }
  // More than one rank, and agreeing: each check_events() is a collective every rank joins.
  bool lockstep() const { return tp_ != nullptr && tp_->size() > 1 && tp_->failure().empty(); }
  // `local` when not agreeing, else true only when it is true on every rank (one min-reduction
  // under `tag`). A failed reduction sets *failed and answers `local` (each rank goes alone).
  bool on_every_rank(bool local, const char* tag, bool* failed);

  // What the step's reduction decided, in the order to apply it (ids ascending per kind).
  struct Step {
    struct Ack {
      NodeId id;
      std::int64_t agreed, local;  // the worst rank's and this rank's value (ArrivedAcks)
    };
    std::vector<Ack> writes, loads, backups;  // arrived on every rank
    struct Prefetch {
      std::string id;
      bool ended = false;      // revoked or finished on every rank: finish it with `pages`
      bool ready = false;      // every rank's policy lets it terminate
      std::int64_t pages = 0;  // completed on every rank
      // Steps (check_events calls) begun since the last rank's I/O landed whole (the fewest
      // any rank counted: PendingOps::Prefetch::steps_since_landed); -1 while a rank's has not.
      std::int64_t landed_steps = -1;
    };
    std::vector<Prefetch> prefetches;
  };
  // The step's one collective. REQUIRES: agreeing() and !pending.idle(). Returns what every
  // rank agreed (valid until the next call) and takes those acks out of `arrived`; records the
  // agreed cost estimates. Null when the collective failed (for good: agreeing() is false from
  // now on); then nothing changed. The oldest ops of each kind go in, one of each kind in turn
  // while the call has room (a prefetch takes 4 values, an ack 1; the estimates kValues): the
  // same ops on every rank, since their pending sets are the same.
  const Step* reduce(const PendingOps& pending, ArrivedAcks& arrived,
                     const StorageController* storage, std::int32_t page_size,
                     const CostRule::Values& local_costs);

  // The estimates to weigh: this rank's own, or under TP the cautious view of every rank's as
  // of the last reduction (nothing measured until one).
  CostRule::Values costs(const CostRule::Values& local) const {
    return agreeing() ? agreed_costs_ : local;
  }

 private:
  Collective* tp_;
  std::vector<std::int64_t> buffer_;  // reused
  Step step_;                         // reused
  CostRule::Values agreed_costs_ = CostRule::kNothingMeasured;
};

}  // namespace hicache::radix
