#include "controller/radix/agreement.h"

#include <algorithm>
#include <type_traits>

namespace hicache::radix {

std::optional<PendingOps::Op> PendingOps::take(std::unordered_map<NodeId, Op>& ops, NodeId id) {
  auto it = ops.find(id);
  if (it == ops.end()) return std::nullopt;
  Op op = std::move(it->second);
  ops.erase(it);
  return op;
}

bool Agreement::on_every_rank(bool local, const char* tag, bool* failed) {
  if (!agreeing()) return local;
  std::int64_t value[1] = {local ? 1 : 0};
  if (!tp_->min_allreduce(value, tag).ok) {
    *failed = true;
    return local;  // the collective is failed for good: each rank goes on alone
  }
  return value[0] == 1;
}

const Agreement::Step* Agreement::reduce(const PendingOps& pending, ArrivedAcks& arrived,
                                         const StorageController* storage, std::int32_t page_size,
                                         const CostRule::Values& local_costs) {
  auto sorted = [](const auto& ops) {
    using Id = typename std::decay_t<decltype(ops)>::key_type;
    std::vector<Id> ids;
    ids.reserve(ops.size());
    for (const auto& [id, op] : ops) ids.push_back(id);
    std::sort(ids.begin(), ids.end());
    return ids;
  };
  std::vector<NodeId> writes = sorted(pending.writes), loads = sorted(pending.loads),
                      backups = sorted(pending.backups);
  std::vector<std::string> prefetches = sorted(pending.prefetches);
  {
    // How many of each kind fit: one of each in turn, the oldest first.
    const std::size_t room = std::min(tp_->max_values(), std::size_t{1} << 20) - CostRule::kValues;
    const std::size_t have[4] = {writes.size(), loads.size(), backups.size(), prefetches.size()};
    const std::size_t cost[4] = {1, 1, 1, 4};
    std::size_t take[4] = {0, 0, 0, 0}, used = 0;
    for (bool more = true; more;) {
      more = false;
      for (std::size_t k = 0; k < 4; ++k) {
        if (take[k] < std::min(have[k], kAgreeSlots) && used + cost[k] <= room) {
          ++take[k];
          used += cost[k];
          more = true;
        }
      }
    }
    writes.resize(take[0]);
    loads.resize(take[1]);
    backups.resize(take[2]);
    prefetches.resize(take[3]);
  }
  // The buffer's sections; their sizes follow the pending sets, the same on every rank.
  const std::size_t W = writes.size(), L = loads.size(), B = backups.size(), P = prefetches.size();
  const std::size_t at_loads = W, at_backups = W + L, at_state = at_backups + B,
                    at_ready = at_state + P, at_pages = at_ready + P, at_landed = at_pages + P,
                    at_costs = at_landed + P;
  buffer_.assign(at_costs + CostRule::kValues, 0);
  // What arrived here, at `at` in the buffer.
  auto fill = [&](const std::vector<NodeId>& ids, const auto& acks, std::size_t at) {
    for (std::size_t i = 0; i < ids.size(); ++i) {
      if (auto it = acks.find(ids[i]); it != acks.end()) buffer_[at + i] = it->second;
    }
  };
  fill(writes, arrived.writes, 0);
  fill(loads, arrived.loads, at_loads);
  fill(backups, arrived.backups, at_backups);
  for (std::size_t i = 0; i < P; ++i) {
    const PendingOps::Prefetch& p = pending.prefetches.at(prefetches[i]);
    const PrefetchOperation& op = *p.op;
    if (arrived.revoked.count(prefetches[i]) != 0) {
      buffer_[at_state + i] = 1;
    } else if (op.stage() == PrefetchStage::kFinished) {
      buffer_[at_state + i] = 2;
    }
    buffer_[at_ready + i] = p.may_terminate(*storage) ? 1 : 0;
    buffer_[at_pages + i] = op.completed_tokens() / page_size;
    // 1 + steps since it landed here (a landing not counted yet: 0 steps), 0 before: the min
    // is 0 until every rank's landed, then the last rank's count.
    buffer_[at_landed + i] =
        p.steps_since_landed >= 0 ? p.steps_since_landed + 1 : (op.io_done() ? 1 : 0);
  }
  std::copy(local_costs.begin(), local_costs.end(), buffer_.begin() + static_cast<std::ptrdiff_t>(at_costs));
  if (!tp_->min_allreduce(buffer_, "radix.events").ok) return nullptr;
  std::copy_n(buffer_.begin() + static_cast<std::ptrdiff_t>(at_costs), CostRule::kValues,
              agreed_costs_.begin());
  // What arrived everywhere leaves the arrived set, with the worst rank's value and this one's.
  auto take = [&](const std::vector<NodeId>& ids, auto& acks, std::size_t at, auto& out) {
    out.clear();
    for (std::size_t i = 0; i < ids.size(); ++i) {
      if (buffer_[at + i] == 0) continue;
      const std::int64_t local = acks.at(ids[i]);
      acks.erase(ids[i]);
      out.push_back(Step::Ack{ids[i], buffer_[at + i], local});
    }
  };
  take(writes, arrived.writes, 0, step_.writes);
  take(loads, arrived.loads, at_loads, step_.loads);
  take(backups, arrived.backups, at_backups, step_.backups);
  step_.prefetches.clear();
  for (std::size_t i = 0; i < P; ++i) {
    step_.prefetches.push_back(Step::Prefetch{prefetches[i], buffer_[at_state + i] != 0,
                                              buffer_[at_ready + i] == 1, buffer_[at_pages + i],
                                              buffer_[at_landed + i] - 1});
  }
  return &step_;
}

}  // namespace hicache::radix
