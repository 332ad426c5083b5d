// HiRadixCache's observations of itself (hi_radix_cache.h): stats(), the metrics it registers,
// describe() and check_invariants() for tests, and the block hashes the tree holds. They read
// the rooms and change nothing.
#include <algorithm>
#include <cmath>
#include <functional>

#include "controller/hi_radix_cache.h"  // IWYU pragma: associated
#include "controller/kv_events.h"
#include "controller/radix/agreement.h"
#include "controller/radix/eviction.h"
#include "controller/radix/sidecar_units.h"
#include "controller/radix/tree.h"

namespace hicache {

std::vector<std::int64_t> HiRadixCache::held_block_hashes(bool device) const {
  std::vector<std::int64_t> out;
  if (!tier_events_) return out;
  tree_->for_each_node([&](Node* n) {
    const bool held =
        device ? !n->device.empty() && n->load_op == 0 : !n->host.empty() && n->write_op == 0;
    if (!held) return;
    for (const PageDigest& d : n->digests) out.push_back(kv_block_hash(d));
  });
  std::sort(out.begin(), out.end());
  return out;
}

namespace {

// " sidecars 0@[1,3] 1@[0,1,2,3]": each sidecar pool's pages of the node, or nothing.
std::string sidecar_text(const radix::Node& n) {
  std::string out;
  for (const radix::Node::SidecarPages& sp : n.sidecars) {
    out += str_cat(out.empty() ? " sidecars " : " ", sp.pool, "@[");
    for (std::size_t k = 0; k < sp.pages.size(); ++k) out += str_cat(k ? "," : "", sp.pages[k]);
    out += "]";
  }
  return out;
}

}  // namespace

std::string HiRadixCache::describe() const {
  std::string out;
  std::function<void(const Node*, int)> walk = [&](const Node* n, int depth) {
    if (n != tree_->root()) {
      out += str_cat(std::string(static_cast<std::size_t>(depth), ' '),
                     n->identity.empty() ? "" : str_cat("(", n->identity, ") "), "[",
                     n->key().front(), "..+", n->key().size(), "] dev ", n->device.size(), " host ",
                     n->host.size(), n->write_op != 0 ? " writing" : "",
                     n->load_op != 0 ? " loading" : "", n->backup_op != 0 ? " backing-up" : "",
                     " lock ", n->lock, " stored ", n->stored_pages, sidecar_text(*n), "\n");
    }
    for (const Node* c : tree_->ordered_children(n)) walk(c, depth + 1);
  };
  walk(tree_->root(), -1);
  return out;
}

void HiRadixCache::register_metrics(MetricsRegistry& registry, MetricLabels labels) {
  metrics_.attach(registry, std::move(labels));
  events_.register_in(metrics_);
  cost_->register_in(metrics_);
  constexpr const char* kUsed = "hicache_pool_used_tokens";
  constexpr const char* kUsedHelp = "Token slots in use per tier (device: as of the last step)";
  constexpr const char* kCapacity = "hicache_pool_capacity_tokens";
  constexpr const char* kCapacityHelp = "Token slots per tier";
  metrics_.add(kUsed, kUsedHelp, {{"tier", "device"}}, device_used_tokens_);
  HostKVPool* host = &host_pool_;
  metrics_.add_gauge_fn(kUsed, kUsedHelp, {{"tier", "host"}}, [host] {
    return static_cast<double>(host->capacity_tokens() - host->free_tokens());
  });
  const auto device_capacity = static_cast<double>(device_pool_.allocator().capacity_tokens());
  metrics_.add_gauge_fn(kCapacity, kCapacityHelp, {{"tier", "device"}},
                        [device_capacity] { return device_capacity; });
  const auto host_capacity = static_cast<double>(host_pool_.capacity_tokens());
  metrics_.add_gauge_fn(kCapacity, kCapacityHelp, {{"tier", "host"}},
                        [host_capacity] { return host_capacity; });
  constexpr const char* kUsage = "hicache_pool_usage_ratio";
  constexpr const char* kUsageHelp = "Token slots in use over token slots per tier (0 to 1)";
  const Gauge* device_used = &device_used_tokens_;
  metrics_.add_gauge_fn(kUsage, kUsageHelp, {{"tier", "device"}}, [device_used, device_capacity] {
    return device_capacity > 0 ? device_used->value() / device_capacity : 0;
  });
  metrics_.add_gauge_fn(kUsage, kUsageHelp, {{"tier", "host"}}, [host, host_capacity] {
    return host_capacity > 0
               ? static_cast<double>(host->capacity_tokens() - host->free_tokens()) / host_capacity
               : 0;
  });
}

std::int64_t HiRadixCache::evictable_device_tokens() const {
  return index_->totals().evictable_device_tokens;
}

void HiRadixCache::record_prefill(std::int64_t device_tokens, std::int64_t host_tokens,
                                  std::int64_t storage_tokens, std::int64_t computed_tokens,
                                  std::optional<double> compute_seconds) {
  if (compute_seconds && !(*compute_seconds >= 0 && std::isfinite(*compute_seconds))) {
    throw InvalidArgument(
        str_cat("record_prefill: compute_seconds ", *compute_seconds, " is not a finite number >= 0"));
  }
  events_.record_prefill(device_tokens, host_tokens, storage_tokens, computed_tokens);
  if (compute_seconds) cost_->report_prefill(computed_tokens, *compute_seconds);
}

RadixCacheStats HiRadixCache::stats() const {
  RadixCacheStats s;
  const radix::CostRule::Inputs& cost = cost_->inputs();
  s.measured_load_gbps = cost.measured_load_gbps;
  s.last_load_estimate_s = cost.last_load_estimate_s;
  s.measured_prefetch_gbps = cost.measured_prefetch_gbps;
  s.last_prefetch_estimate_s = cost.last_prefetch_estimate_s;
  s.last_recompute_estimate_s = cost.last_recompute_estimate_s;
  s.prefetches_cut = static_cast<std::int64_t>(events_.prefetches_cut.value());
  const auto v = [](const Counter& c) { return static_cast<std::int64_t>(c.value()); };
  s.demotions = v(events_.demotions);
  s.evicted_device_tokens = v(events_.evicted_device_tokens);
  s.evicted_host_tokens = v(events_.evicted_host_tokens);
  s.load_backs_refused_by_cost = v(events_.load_backs_refused_by_cost);
  s.load_failures = v(events_.load_failures);
  s.loaded_back_tokens = v(events_.loaded_back_tokens);
  s.prefetched_tokens = v(events_.prefetched_tokens);
  s.prefetches_refused_by_cost = v(events_.prefetches_refused_by_cost);
  s.resets = v(events_.resets);
  s.revoked_prefetches = v(events_.revoked_prefetches);
  s.tp_failures = v(events_.tp_failures);
  s.write_failures = v(events_.write_failures);
  const radix::EvictionIndex::Totals& t = index_->totals();
  s.nodes = t.nodes;
  s.device_tokens = t.device_tokens;
  s.evictable_device_tokens = t.evictable_device_tokens;
  s.host_tokens = t.host_tokens;
  s.writes_in_flight = t.writing;
  s.loads_in_flight = t.loading;
  s.backups_in_flight = t.backing_up;
  s.backup_kept_tokens = v(events_.backup_kept_tokens);
  s.stored_tokens = t.stored_tokens;
  return s;
}

std::string HiRadixCache::check_invariants() const {
  std::string problem = tree_->check_node(tree_->root());
  tree_->for_each_node([&](const Node* n) {
    if (!problem.empty()) return;
    problem = tree_->check_node(n);
    if (!problem.empty()) return;
    const std::size_t len = n->key().size();
    if (n->device.empty() && n->host.empty()) {
      problem = str_cat("node ", n->id, ": no KV");
    } else if (!n->device.empty() && n->device.size() != len) {
      problem = str_cat("node ", n->id, ": ", n->device.size(), " device slots for ", len);
    } else if (!n->host.empty() && n->host.size() != len) {
      problem = str_cat("node ", n->id, ": ", n->host.size(), " host slots for ", len);
    }
    // Sidecar pages live on the tiers the KV lives on, inside the node, in order, once per pool.
    if (problem.empty()) problem = sidecars_->check(*n);
  });
  if (!problem.empty()) return problem;
  return index_->check(*tree_);
}

}  // namespace hicache
