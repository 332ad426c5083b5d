#include "controller/radix/tier_policy.h"

#include <algorithm>
#include <chrono>

#include "transfer/errors.h"

namespace hicache {

StorageAdmission parse_storage_admission(std::string_view name) {
  if (name == "write_through") return StorageAdmission::kWriteThrough;
  if (name == "exclusive") return StorageAdmission::kExclusive;
  if (name == "reuse") return StorageAdmission::kReuse;
  throw InvalidArgument(
      str_cat("unknown storage admission '", name, "' (valid: write_through, exclusive, reuse)"));
}

std::string_view to_string(StorageAdmission admission) {
  switch (admission) {
    case StorageAdmission::kExclusive:
      return "exclusive";
    case StorageAdmission::kReuse:
      return "reuse";
    case StorageAdmission::kWriteThrough:
      break;
  }
  return "write_through";
}

namespace radix {

namespace {

template <typename T>
void append(std::vector<T>& to, const std::vector<T>& from) {
  to.insert(to.end(), from.begin(), from.end());
}

}  // namespace

TierPolicy::TierPolicy(Cache& cache, Tree& tree, EvictionIndex& index, PendingOps& pending,
                       ArrivedAcks& arrived, Agreement& agreement, CostRule& cost,
                       CacheEvents& events, HiCacheController& controller,
                       DeviceKVPool& device_pool, HostKVPool& host_pool, Config config)
    : cache_(cache),
      index_(index),
      controller_(controller),
      events_(events),
      device_pool_(device_pool),
      pending_(pending),
      policy_(controller.config().write_policy),
      selective_(policy_ == WritePolicy::kWriteThroughSelective),
      host_tier_(config.host_tier),
      exclusive_(config.storage_admission == StorageAdmission::kExclusive),
      reuse_(config.storage_admission == StorageAdmission::kReuse),
      tree_(tree),
      arrived_(arrived),
      agreement_(agreement),
      cost_(cost),
      host_pool_(host_pool),
      config_(config),
      sidecar_host_held_(controller.num_sidecars(), 0) {}

void TierPolicy::write_selected(Node* node) {
  if (node->host.empty() && !node->device.empty() && node->write_op == 0) {
    write_node(node, kBackupWritePriority);
  }
}

void TierPolicy::inserted(Node* leaf) {
  if (policy_ == WritePolicy::kWriteThrough) write_node(leaf, kBackupWritePriority);
}

void TierPolicy::write_node(Node* node, std::int64_t priority) {
  if (!host_tier_) return;  // device only: the node stays device-only
  const auto tokens = static_cast<std::int64_t>(node->device.size());
  // TP: the room is judged on what every rank has alike (host_room(), and the writes in flight,
  // which the write queue holds at most), never on the pool's or the queue's own state, which
  // the controller's threads change at times that differ between ranks.
  const bool tp = agreement_.agreeing();
  if (tp &&
      (host_room() < tokens || pending_.writes.size() >= controller_.config().queue_capacity)) {
    return;  // host full or queue full: the node stays device-only
  }
  if (!make_sidecar_host_room(node)) return;  // a sidecar pool's host is full: device-only
  auto host = controller_.reserve_write(tokens);
  if (!host && !tp) return;  // host full or queue full: the node stays device-only
  if (host && !reserve_sidecar_hosts(node)) {
    controller_.release_write(*host);
    if (!tp) return;  // the node stays device-only
    host.reset();     // TP: the agreed room was there, this rank's pool disagrees: fail it below
  }
  if (host) {
    Node* one[] = {node};
    bool queued = false;
    try {
      queued = controller_.write_reserved(node->device, *host, priority, node->id, nullptr,
                                          sidecar_io(one));
    } catch (...) {
      for (auto& sp : node->sidecars) sp.host.clear();  // the controller freed them
      throw;
    }
    if (!queued) {
      for (auto& sp : node->sidecars) sp.host.clear();  // the controller freed them
      return;                                           // stopped
    }
  }
  node->write_op = node->id;
  cache_.lock(node);
  pending_.writes[node->id] = PendingOps::Op{node, {node}};
  if (host) {
    node->host = std::move(*host);
    for (const auto& sp : node->sidecars) {
      sidecar_host_held_[static_cast<std::size_t>(sp.pool)] +=
          static_cast<std::int64_t>(sp.host.size());
    }
  } else {
    // The room was there by the agreed count but not in this rank's pool: something else holds
    // its pages (the caller broke the contract of host_room()). The write fails here, and the
    // next check_events makes every rank drop it.
    arrived_.writes[node->id] = ArrivedAcks::kFailed;
  }
  cache_.refresh(node);
}

std::optional<std::vector<std::int64_t>> TierPolicy::load_back(Node* node) {
  std::vector<Node*> path;
  for (Node* n = node; n != tree_.root(); n = n->parent) path.push_back(n);
  std::reverse(path.begin(), path.end());
  std::vector<Node*> missing;
  std::vector<std::int64_t> host;
  for (Node* n : path) {
    if (!n->device.empty()) continue;
    if (n->host.empty()) return std::nullopt;  // a gap: nothing to load it from
    missing.push_back(n);
    append(host, n->host);
  }
  if (!missing.empty()) {
    if (static_cast<std::int64_t>(host.size()) < config_.load_back_min_tokens) return std::nullopt;
    std::int64_t sidecar_bytes = 0;
    for (const Node* n : missing) {
      for (const auto& sp : n->sidecars) {
        const SidecarSpec& spec = controller_.sidecar(static_cast<std::size_t>(sp.pool)).spec();
        sidecar_bytes += static_cast<std::int64_t>(sp.pages.size()) * spec.page_bytes();
      }
    }
    if (!load_back_pays(static_cast<std::int64_t>(host.size()), sidecar_bytes)) {
      return std::nullopt;
    }
    const NodeId op = tree_.next_id();
    cache_.lock(node);  // the path stays while it loads (and eviction below cannot take it)
    std::optional<std::vector<std::int64_t>> device;
    try {
      device = load_nodes(missing, host, op);
    } catch (...) {
      cache_.unlock(node);
      throw;
    }
    if (!device) {
      cache_.unlock(node);
      return std::nullopt;
    }
    std::size_t at = 0;
    for (Node* n : missing) {
      n->device.assign(device->begin() + static_cast<std::ptrdiff_t>(at),
                       device->begin() + static_cast<std::ptrdiff_t>(at + n->key().size()));
      at += n->key().size();
      n->load_op = op;
      cache_.refresh(n);
    }
    pending_.loads[op] = PendingOps::Op{node, missing};
    events_.loaded_back_tokens += host.size();
  }
  std::vector<std::int64_t> out;
  for (Node* n : path) {
    tree_.touch(n);
    append(out, n->device);
  }
  return out;
}

bool TierPolicy::load_back_pays(std::int64_t tokens, std::int64_t sidecar_bytes) {
  if (!cost_.on()) return true;
  const bool pays = cost_.moving_pays(CostRule::Move::kLoad, agreement_.costs(cost_.local()),
                                      tokens, sidecar_bytes);
  if (!pays) {
    ++events_.load_backs_refused_by_cost;
    events_.miss_load_refused_tokens += tokens;
  }
  return pays;
}

void TierPolicy::drop_device(Node* node) {
  const auto n = static_cast<std::int64_t>(node->device.size());
  if (!node->host.empty()) {
    Node* one[] = {node};
    controller_.evict_device(node->device, node->host, sidecar_io(one));
    for (auto& sp : node->sidecars) sp.device.clear();
  } else {
    device_pool_.allocator().free(node->device);
    free_sidecar_devices(node);
    events_.dropped_device_tokens += n;
  }
  node->device.clear();
  cache_.refresh(node);
  events_.evicted_device_tokens += n;
}

std::int64_t TierPolicy::evict_device(std::int64_t tokens) {
  // The index holds the candidates in eviction order: unlocked, no op in flight, no child on
  // the device. A node without a host copy is dropped when nothing hangs below it; otherwise
  // (and always under write-back) it is written first and freed on the ack. Under the
  // write-through policies such a node is one whose write found the host pool full: without
  // this the device could fill up with inner nodes that nothing ever frees.
  std::int64_t freed = 0, scheduled = 0;  // scheduled: write-back evictions freed on the ack
  std::vector<Node*> passed_over;         // host full and a subtree below: kept this call
  const bool timed = cache_.timed();      // metrics off: no clock read on this path
  const auto started =
      timed ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
  while (freed + scheduled < tokens) {
    Node* n = index_.next_victim(Tier::kDevice);
    if (n == nullptr) break;
    tree_.advance_frontier(Tier::kDevice, index_.mark(*n, Tier::kDevice));
    if (n->host.empty() && (policy_ == WritePolicy::kWriteBack || !n->children.empty())) {
      write_node(n, kEvictionWritePriority);
      if (n->write_op == 0 && !n->children.empty() && host_tier_) {
        // The host is full (on some rank): host-only leaves make room for its copy (without
        // it a device of such inner nodes could never be freed, nothing in flight to wait on).
        evict_host(static_cast<std::int64_t>(n->device.size()));
        write_node(n, kEvictionWritePriority);
      }
      if (n->write_op != 0) {  // out of the index while it writes
        n->evict_after_write = true;
        scheduled += static_cast<std::int64_t>(n->device.size());
        continue;
      }
      if (!n->children.empty()) {
        n->passed_over = true;
        cache_.refresh(n);
        passed_over.push_back(n);
        continue;
      }
    }
    freed += static_cast<std::int64_t>(n->device.size());
    drop_device(n);                              // its parent may become a candidate
    if (n->host.empty()) cache_.remove_leaf(n);  // no KV anywhere: the node goes
  }
  for (Node* n : passed_over) {
    n->passed_over = false;
    cache_.refresh(n);
  }
  if (timed && freed + scheduled > 0) {
    events_.device_eviction_seconds.observe(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
  }
  return freed;
}

std::int64_t TierPolicy::evict_host_to_free(std::int64_t target) {
  const std::int64_t need = target - host_room() - (exclusive_ ? leaving_host_tokens() : 0);
  return need > 0 ? evict_host(need) : 0;
}

std::int64_t TierPolicy::leaving_host_tokens() const {
  std::int64_t leaving = 0;
  for (const auto& [id, op] : pending_.backups) {
    for (const Node* n : op.nodes) {
      if (n->leave_host_after_backup) leaving += static_cast<std::int64_t>(n->host.size());
    }
  }
  return leaving;
}

void TierPolicy::drop_host(Node* node) {
  for (const auto& sp : node->sidecars) {
    sidecar_host_held_[static_cast<std::size_t>(sp.pool)] -=
        static_cast<std::int64_t>(sp.host.size());
  }
  Node* one[] = {node};
  controller_.evict_host(node->host, sidecar_io(one));
  events_.evicted_host_tokens += node->host.size();
  cache_.remove_leaf(node);
}

std::int64_t TierPolicy::evict_host(std::int64_t tokens) {
  // Candidates in eviction order: unlocked host-only leaves with no op in flight. A node that
  // goes may leave its parent such a leaf. Exclusive admission: a leaf L3 does not hold whole
  // goes there first, out of the index (backing up) until the ack frees it.
  const bool to_l3 = exclusive_ && cache_.l3_attached();
  std::int64_t freed = 0, scheduled = 0;
  while (freed + scheduled < tokens) {
    Node* n = index_.next_victim(Tier::kHost);
    if (n == nullptr) break;
    tree_.advance_frontier(Tier::kHost, index_.mark(*n, Tier::kHost));
    const auto size = static_cast<std::int64_t>(n->host.size());
    if (to_l3 && !whole_in_l3(*n)) {
      // Queue full (the same count on every rank): the acks in flight bring the room.
      if (!cache_.back_up_leaving(n)) break;
      n->leave_host_after_backup = true;
      scheduled += size;
      continue;
    }
    freed += size;
    drop_host(n);
  }
  return freed;
}

void TierPolicy::backup_acked(Node* node) {
  if (!node->leave_host_after_backup) return;
  node->leave_host_after_backup = false;
  if (!whole_in_l3(*node)) {
    // Failed (or partly stored): nothing acknowledged is lost by the admission policy.
    events_.backup_kept_tokens += node->host.size();
    return;
  }
  // Used again while it was written (held, loaded back, a child added): it stays, in L3 now, and
  // a later eviction frees it at once.
  if (node->lock != 0 || !node->device.empty() || !node->children.empty() || node->write_op != 0 ||
      node->load_op != 0 || node->host.empty()) {
    return;
  }
  drop_host(node);
}

std::int64_t TierPolicy::host_room() const {
  if (!agreement_.agreeing()) return host_pool_.free_tokens();
  return host_pool_.capacity_tokens() - index_.totals().host_tokens -
         cache_.prefetch_reserved_tokens();
}

void TierPolicy::demote() {
  if (config_.demote_low_watermark <= 0) return;
  const double capacity = static_cast<double>(device_pool_.allocator().capacity_tokens());
  const auto free_tokens = static_cast<double>(device_pool_.allocator().free_tokens());
  if (free_tokens >= config_.demote_low_watermark * capacity) return;
  // Tokens already on their way out: write-backs that free their device copy on the ack.
  std::int64_t leaving = 0;
  for (const auto& [id, op] : pending_.writes) {
    for (const Node* n : op.nodes) {
      if (n->evict_after_write) leaving += static_cast<std::int64_t>(n->device.size());
    }
  }
  const auto target =
      static_cast<std::int64_t>(config_.demote_high_watermark * capacity - free_tokens) - leaving;
  if (target <= 0) return;
  ++events_.demotions;
  evict_device(target);  // frees synced copies now, writes the others and frees them on the ack
}

void TierPolicy::apply_write_ack(NodeId id, std::int64_t agreed, std::int64_t local) {
  const bool ok = agreed == ArrivedAcks::kOk, local_ok = local == ArrivedAcks::kOk;
  auto taken = PendingOps::take(pending_.writes, id);
  if (!taken) return;
  PendingOps::Op& op = *taken;
  for (Node* n : op.nodes) {
    n->write_op = 0;
    if (!ok) {
      // The controller freed the host pages of a failed write; where the write worked here but
      // failed on another rank, this rank drops its copy too, so the trees stay identical.
      if (local_ok) host_pool_.discard(n->host);
      n->host.clear();
      for (auto& sp : n->sidecars) {
        const auto pool = static_cast<std::size_t>(sp.pool);
        if (local_ok) controller_.sidecar(pool).host_pool().discard(sp.host);
        sidecar_host_held_[pool] -= static_cast<std::int64_t>(sp.host.size());
        sp.host.clear();
      }
      n->evict_after_write = false;
    }
    cache_.refresh(n);
  }
  if (!ok) ++events_.write_failures;
  cache_.unlock(op.holder);
  for (Node* n : op.nodes) {
    if (n->evict_after_write) {
      n->evict_after_write = false;
      // Freed only if still free to go: a child that reached the device while it wrote (a
      // request extended the prefix) keeps it there, or the path's device part would have a
      // gap (a device page below a host-only parent). It goes later, as any candidate.
      if (n->lock == 0 && n->load_op == 0 && n->device_children == 0) drop_device(n);
    }
    if (ok && !exclusive_ && reused_enough(*n)) cache_.host_copy_synced(n);
  }
}

void TierPolicy::apply_load_ack(NodeId id, std::int64_t agreed, std::int64_t local) {
  const bool ok = agreed == ArrivedAcks::kOk, local_ok = local == ArrivedAcks::kOk;
  auto taken = PendingOps::take(pending_.loads, id);
  if (!taken) return;
  PendingOps::Op& op = *taken;
  for (Node* n : op.nodes) {
    n->load_op = 0;
    if (!ok) {
      events_.miss_load_failed_tokens += n->device.size();
      // The device slots are not to be used; the host copy is intact. Where the load worked
      // here, its host pages went to synced: back to backup with the device copy freed.
      if (local_ok) {
        Node* one[] = {n};
        controller_.evict_device(n->device, n->host, sidecar_io(one));
        for (auto& sp : n->sidecars) sp.device.clear();
      } else {
        device_pool_.allocator().free(n->device);
        free_sidecar_devices(n);
      }
      n->device.clear();
    }
    cache_.refresh(n);
  }
  if (!ok) ++events_.load_failures;
  cache_.unlock(op.holder);
}

const std::vector<SidecarIo>& TierPolicy::sidecar_io(std::span<Node* const> nodes) {
  io_.clear();
  for (const Node* n : nodes) {
    for (const auto& sp : n->sidecars) io_.push_back(SidecarIo{sp.pool, sp.host, sp.device});
  }
  return io_;
}

std::int64_t TierPolicy::sidecar_host_room(std::int32_t pool) const {
  const HostKVPool& host = controller_.sidecar(static_cast<std::size_t>(pool)).host_pool();
  if (!agreement_.agreeing()) return host.free_tokens();
  return host.capacity_tokens() - sidecar_host_held_[static_cast<std::size_t>(pool)];
}

bool TierPolicy::make_sidecar_host_room(std::int32_t pool, std::int64_t slots) {
  // Host-only leaves go, coldest first, while they free this pool's pages: a few that free
  // none (they hold no page of it) end the attempt, so one insert cannot empty the host.
  for (int barren = 0; sidecar_host_room(pool) < slots && barren < kBarrenEvictions;) {
    const std::int64_t before = sidecar_host_room(pool);
    if (evict_host(tree_.page_size()) == 0) break;
    barren = sidecar_host_room(pool) > before ? 0 : barren + 1;
  }
  return sidecar_host_room(pool) >= slots;
}

bool TierPolicy::make_sidecar_host_room(Node* node) {
  for (const Node::SidecarPages& sp : node->sidecars) {
    const auto need = static_cast<std::int64_t>(sp.pages.size()) *
                      controller_.sidecar(static_cast<std::size_t>(sp.pool)).spec().slots_per_page;
    if (!make_sidecar_host_room(sp.pool, need)) return false;
  }
  return true;
}

bool TierPolicy::reserve_prefetch_sidecars(std::span<const std::int64_t> pages,
                                           std::vector<SidecarPagesIo>& out,
                                           std::vector<std::int64_t>& counted) {
  out.clear();
  counted.clear();
  for (std::size_t i = 0; i < pages.size(); ++i) {
    const auto pool = static_cast<std::int32_t>(i);
    const std::int64_t need = pages[i] * controller_.sidecar(i).spec().slots_per_page;
    if (!make_sidecar_host_room(pool, need)) {
      for (std::size_t j = 0; j < out.size(); ++j) {
        if (!out[j].host_slots.empty()) controller_.sidecar(j).host_pool().free(out[j].host_slots);
        sidecar_hosts_released(out[j].pool, counted[j]);
      }
      out.clear();
      counted.clear();
      return false;
    }
    // Counted whether or not this rank's own pool had the pages (the agreed count).
    SidecarPagesIo io{.pool = pool, .pages = {}, .host_slots = {}};
    if (auto slots = controller_.sidecar(i).host_pool().alloc(need)) io.host_slots = std::move(*slots);
    sidecar_host_held_[i] += need;
    counted.push_back(need);
    out.push_back(std::move(io));
  }
  return true;
}

bool TierPolicy::reserve_sidecar_hosts(Node* node) {
  for (std::size_t i = 0; i < node->sidecars.size(); ++i) {
    Node::SidecarPages& sp = node->sidecars[i];
    SidecarPool& pool = controller_.sidecar(static_cast<std::size_t>(sp.pool));
    const auto need = static_cast<std::int64_t>(sp.pages.size()) * pool.spec().slots_per_page;
    auto host = pool.host_pool().alloc(need);
    if (!host) {
      for (std::size_t j = 0; j < i; ++j) {
        Node::SidecarPages& done = node->sidecars[j];
        controller_.sidecar(static_cast<std::size_t>(done.pool)).host_pool().free(done.host);
        done.host.clear();
      }
      return false;
    }
    sp.host = std::move(*host);
  }
  return true;
}

bool TierPolicy::alloc_sidecar_devices(std::span<Node* const> nodes) {
  for (std::size_t k = 0; k < nodes.size(); ++k) {
    for (Node::SidecarPages& sp : nodes[k]->sidecars) {
      TokenSlotAllocator& a =
          controller_.sidecar(static_cast<std::size_t>(sp.pool)).device_pool().allocator();
      const auto need = static_cast<std::int64_t>(sp.host.size());
      auto device = a.alloc(need);
      // As reserve_sidecar_hosts: device nodes go while they free this pool's pages. A victim
      // that write_back must write first frees nothing now: the load back is refused this step
      // (the engine recomputes, or asks again once the write's ack freed the room).
      for (int barren = 0; !device && barren < kBarrenEvictions;) {
        const std::int64_t before = a.free_tokens();
        if (evict_device(tree_.page_size()) == 0) break;
        barren = a.free_tokens() > before ? 0 : barren + 1;
        device = a.alloc(need);
      }
      if (!device) {
        for (std::size_t j = 0; j <= k; ++j) free_sidecar_devices(nodes[j]);
        return false;
      }
      sp.device = std::move(*device);
    }
  }
  return true;
}

void TierPolicy::free_sidecar_devices(Node* node) {
  for (Node::SidecarPages& sp : node->sidecars) {
    if (sp.device.empty()) continue;
    controller_.sidecar(static_cast<std::size_t>(sp.pool)).device_pool().allocator().free(sp.device);
    sp.device.clear();
  }
}

std::optional<std::vector<std::int64_t>> TierPolicy::load_nodes(
    std::span<Node* const> missing, const std::vector<std::int64_t>& host, NodeId op) {
  const bool sidecars = std::any_of(missing.begin(), missing.end(),
                                    [](const Node* n) { return !n->sidecars.empty(); });
  if (!sidecars) {
    auto device = controller_.load(host, 0, op);
    if (!device) {
      evict_device(static_cast<std::int64_t>(host.size()));
      device = controller_.load(host, 0, op);
    }
    return device;
  }
  // A hybrid model's nodes: the KV's device slots and every sidecar page's, then one load.
  const auto tokens = static_cast<std::int64_t>(host.size());
  auto device = device_pool_.allocator().alloc(tokens);
  if (!device) {
    evict_device(tokens);
    device = device_pool_.allocator().alloc(tokens);
  }
  if (!device) return std::nullopt;
  if (!alloc_sidecar_devices(missing)) {
    device_pool_.allocator().free(*device);
    return std::nullopt;
  }
  const auto give_back = [&] {
    device_pool_.allocator().free(*device);
    for (Node* n : missing) free_sidecar_devices(n);
  };
  bool queued = false;
  try {
    queued = controller_.load_into(host, *device, 0, op, sidecar_io(missing));
  } catch (...) {
    give_back();
    throw;
  }
  if (!queued) give_back();  // the queue is full
  return queued ? device : std::nullopt;
}

}  // namespace radix
}  // namespace hicache
