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

bool CostRule::moving_pays(Move move, std::int64_t tokens, std::int64_t bytes_per_second,
                           std::int64_t extra_bytes) {
  if (bytes_per_second == kUnmeasured) return true;
  const auto bandwidth = static_cast<double>(bytes_per_second);
  const double bytes = static_cast<double>(tokens) * static_cast<double>(token_bytes_) +
                       static_cast<double>(extra_bytes);
  const bool load = move == Move::kLoad;
  double& gbps = load ? inputs_.measured_load_gbps : inputs_.measured_prefetch_gbps;
  double& move_s = load ? inputs_.last_load_estimate_s : inputs_.last_prefetch_estimate_s;
  gbps = bandwidth / 1e9;
  move_s = bytes / bandwidth;
  inputs_.last_recompute_estimate_s = static_cast<double>(tokens) * recompute_seconds_per_token_;
  return move_s <= inputs_.last_recompute_estimate_s;
}

std::int64_t CostRule::rate(double bytes, double seconds) {
  if (bytes <= 0 || seconds <= 0) return kUnmeasured;
  return std::max<std::int64_t>(1, static_cast<std::int64_t>(std::min(bytes / seconds, 1e18)));
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
                                         std::int64_t local_load_bps,
                                         std::int64_t local_prefetch_bps) {
  constexpr std::size_t K = kAgreeSlots;
  auto oldest = [](const auto& ops) {
    using Id = typename std::decay_t<decltype(ops)>::key_type;
    std::vector<Id> ids;
    ids.reserve(ops.size());
    for (const auto& [id, op] : ops) ids.push_back(id);
    std::sort(ids.begin(), ids.end());
    if (ids.size() > K) ids.resize(K);
    return ids;
  };
  const std::vector<NodeId> writes = oldest(pending.writes), loads = oldest(pending.loads),
                            backups = oldest(pending.backups);
  const std::vector<std::string> prefetches = oldest(pending.prefetches);
  // The buffer's sections; their sizes follow the pending sets, the same on every rank.
  const std::size_t W = writes.size(), L = loads.size(), B = backups.size(), P = prefetches.size();
  const std::size_t at_loads = W, at_backups = W + L, at_state = at_backups + B,
                    at_ready = at_state + P, at_pages = at_ready + P, at_bps = at_pages + P;
  buffer_.assign(at_bps + 2, 0);
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
    const PrefetchOperation& op = *pending.prefetches.at(prefetches[i]).op;
    if (arrived.revoked.count(prefetches[i]) != 0) {
      buffer_[at_state + i] = 1;
    } else if (op.stage() == PrefetchStage::kFinished) {
      buffer_[at_state + i] = 2;
    }
    buffer_[at_ready + i] = storage->can_terminate(op) ? 1 : 0;
    buffer_[at_pages + i] = op.completed_tokens() / page_size;
  }
  buffer_[at_bps] = local_load_bps;
  buffer_[at_bps + 1] = local_prefetch_bps;
  if (!tp_->min_allreduce(buffer_, "radix.events").ok) return nullptr;
  agreed_load_bps_ = buffer_[at_bps];
  agreed_prefetch_bps_ = buffer_[at_bps + 1];
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
                                              buffer_[at_ready + i] == 1, buffer_[at_pages + i]});
  }
  return &step_;
}

}  // namespace hicache::radix
