#include "controller/hi_radix_cache.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <thread>

#include "controller/radix/agreement.h"
#include "controller/radix/eviction.h"
#include "controller/radix/ghost_set.h"
#include "controller/kv_events.h"
#include "controller/radix/l3_paths.h"
#include "controller/radix/tier_events.h"
#include "controller/radix/tree.h"
#include "transfer/errors.h"

namespace hicache {

namespace {

// Write priorities (lower first in the controller's write queue, FIFO among equals): a write
// that frees device memory on its ack (write-back eviction and demotion, the copy of an evicted
// inner node) goes before backups (write-through and selective writes), which only add a host
// copy: the scheduler waiting for device room waits on the first kind. Loads have one kind (the
// batch's load back): priority 0. docs/design-notes.md, "Operation priorities".
constexpr std::int64_t kEvictionWritePriority = 0, kBackupWritePriority = 1;

template <typename T>
void append(std::vector<T>& to, const std::vector<T>& from) {
  to.insert(to.end(), from.begin(), from.end());
}

}  // namespace

// What the L3 paths ask of the cache: the coordinator's own tree edits, locks and host room.
namespace {

// Where a store's records are, as the KV events name it: a file store's on a local disk, the
// others' in a server (Redis, Redis Cluster).
KvMedium l3_medium(const StorageBackend& store) {
  return store.name() == "file" ? KvMedium::kDisk : KvMedium::kExternal;
}

}  // namespace

class HiRadixCache::L3Hooks final : public radix::L3Paths::Cache {
 public:
  explicit L3Hooks(HiRadixCache& cache) : c_(cache) {}
  void lock(Node* node) override { c_.lock(node); }
  void unlock(Node* node) override { c_.unlock(node); }
  std::int64_t evict_host(std::int64_t tokens) override { return c_.evict_host(tokens); }
  std::int64_t host_room() const override { return c_.host_room(); }
  Node* split_node(Node* node, std::size_t tokens) override { return c_.split(node, tokens); }
  Node* add_node(Node* parent, std::span<const std::int32_t> key,
                 std::string_view identity) override {
    return c_.add_leaf(parent, key, identity);
  }
  void refresh(Node* node) override { c_.refresh(node); }
  void apply_backup_ack(NodeId id, std::int64_t agreed, std::int64_t local) override {
    c_.apply_backup_ack(id, agreed, local);
  }
  std::uint64_t l3_removal_clock() const override {
    return c_.tier_events_ ? c_.tier_events_->l3_clock() : 0;
  }

 private:
  HiRadixCache& c_;
};

HiRadixCache::HiRadixCache(HiCacheController& controller, DeviceKVPool& device_pool,
                           HostKVPool& host_pool, RadixCacheConfig config,
                           StorageController* storage, const KeyNamespace* keys, Collective* tp)
    : controller_(controller),
      device_pool_(device_pool),
      host_pool_(host_pool),
      config_(config),
      page_size_(device_pool.geometry().page_size),
      policy_(controller.config().write_policy) {
  if ((storage == nullptr) != (keys == nullptr)) {
    throw InvalidArgument("radix cache: storage and its key namespace go together");
  }
  if (!config_.host_tier && storage != nullptr) {
    throw InvalidArgument("radix cache: host_tier false (device only) with a storage tier");
  }
  std::unique_ptr<PageKeyer> keyer;
  if (keys != nullptr) {
    keyer = std::make_unique<PageKeyer>(*keys);
    if (keyer->page_size() != page_size_) {
      throw InvalidArgument(str_cat("radix cache: key namespace page_size ", keyer->page_size(),
                                    " differs from the pools' ", page_size_));
    }
  }
  if (host_pool.geometry().page_size != page_size_) {
    throw InvalidArgument(str_cat("radix cache: host page size ", host_pool.geometry().page_size,
                                  " differs from the device's ", page_size_));
  }
  config_.validate();
  config_.load_back_min_tokens = std::max<std::int64_t>(config_.load_back_min_tokens, page_size_);
  tree_ = std::make_unique<radix::Tree>(page_size_, config_.edge_hash_bits);
  index_ = std::make_unique<radix::EvictionIndex>(config_.eviction_policy, page_size_);
  ghost_ = std::make_unique<radix::GhostSet>(
      (host_pool.capacity_tokens() + device_pool.allocator().capacity_tokens()) / page_size_);
  pending_ = std::make_unique<radix::PendingOps>();
  arrived_ = std::make_unique<radix::ArrivedAcks>();
  agreement_ = std::make_unique<radix::Agreement>(tp);
  cost_ = std::make_unique<radix::CostRule>(config_.recompute_seconds_per_token,
                                            device_pool.geometry().token_bytes());
  l3_hooks_ = std::make_unique<L3Hooks>(*this);
  l3_ = std::make_unique<radix::L3Paths>(*l3_hooks_, *tree_, *pending_, *arrived_, *agreement_,
                                         *cost_, events_, host_pool_);
  if (storage != nullptr) l3_->attach(*storage, std::move(keyer), controller_.events());
}

void RadixCacheConfig::validate() const {
  if (write_through_threshold < 1) {
    throw InvalidArgument(
        str_cat("radix cache: write_through_threshold ", write_through_threshold, " < 1"));
  }
  if (!(demote_low_watermark >= 0 && demote_low_watermark <= demote_high_watermark &&
        demote_high_watermark <= 1)) {
    throw InvalidArgument(str_cat("radix cache: demote watermarks low ", demote_low_watermark,
                                  " high ", demote_high_watermark,
                                  " must satisfy 0 <= low <= high <= 1"));
  }
  if (load_back_min_tokens < 0) {
    throw InvalidArgument(
        str_cat("radix cache: load_back_min_tokens ", load_back_min_tokens, " < 0"));
  }
  if (!(recompute_seconds_per_token >= 0 && std::isfinite(recompute_seconds_per_token))) {
    throw InvalidArgument(str_cat("radix cache: recompute_seconds_per_token ",
                                  recompute_seconds_per_token, " is not a finite number >= 0"));
  }
  if (edge_hash_bits < 1 || edge_hash_bits > 64) {
    throw InvalidArgument(
        str_cat("radix cache: edge_hash_bits ", edge_hash_bits, " is not in 1..64"));
  }
}

HiRadixCache::~HiRadixCache() = default;

void HiRadixCache::reset() {
  // The threads first: once they are stopped nothing reads or writes a page of either pool, and
  // every ack, revoke and op they held is dropped (reset starts them again). The storage
  // controller runs what is queued before it stops, so that TP ranks stop in step.
  l3_->reset();
  controller_.reset();
  *pending_ = radix::PendingOps{};  // prefetch ops go; their host pages go with the pool
  *arrived_ = radix::ArrivedAcks{};
  acks_.clear();
  ghost_->clear();
  if (tier_events_) tier_events_->tree_dropped();
  index_->clear();
  tree_->clear();
  device_pool_.allocator().reset();
  host_pool_.reset();
  ++events_.resets;
  if (tier_events_) tier_events_->publish();
}

void HiRadixCache::refresh(Node* node) {
  index_->refresh(node);
  if (tier_events_) tier_events_->observe(node);
}

void HiRadixCache::publish_kv_events(KvEventPublisher& publisher) {
  if (tier_events_) throw StateError("publish_kv_events: the cache publishes KV events already");
  if (stats().nodes != 0) {
    throw InvalidArgument("publish_kv_events: the tree is not empty; call it before inserting");
  }
  l3_->keep_digests(page_size_);
  tier_events_ = std::make_unique<radix::TierEvents>(publisher, *tree_, page_size_);
  if (const StorageController* s = l3_->storage()) {
    tier_events_->attach_l3(l3_->key_prefix(), l3_medium(s->storage()));
  }
}

std::vector<std::int64_t> HiRadixCache::held_block_hashes(bool device) const {
  std::vector<std::int64_t> out;
  if (!tier_events_) return out;
  tree_->for_each_node([&](Node* n) {
    const bool held = device ? !n->device.empty() && n->load_op == 0
                             : !n->host.empty() && n->write_op == 0;
    if (!held) return;
    for (const PageDigest& d : n->digests) out.push_back(kv_block_hash(d));
  });
  std::sort(out.begin(), out.end());
  return out;
}

void HiRadixCache::l3_records_removed(std::span<const std::string> keys) {
  if (tier_events_) tier_events_->l3_removed(keys);
}

HiRadixCache::Node* HiRadixCache::add_leaf(Node* parent, std::span<const std::int32_t> key,
                                           std::string_view identity) {
  Node* l = tree_->add_leaf(parent, key, identity);
  l3_->set_digests(l);
  refresh(l);
  refresh(parent);  // no longer a leaf
  return l;
}

HiRadixCache::Node* HiRadixCache::split(Node* node, std::size_t tokens) {
  index_->forget(node);  // both halves are refreshed once in place
  Node* m = tree_->split(node, tokens);
  const auto upper = static_cast<std::ptrdiff_t>(tokens);
  if (!node->device.empty()) {
    m->device.assign(node->device.begin(), node->device.begin() + upper);
    node->device.erase(node->device.begin(), node->device.begin() + upper);
  }
  if (!node->host.empty()) {
    m->host.assign(node->host.begin(), node->host.begin() + upper);
    node->host.erase(node->host.begin(), node->host.begin() + upper);
  }
  const auto upper_pages = static_cast<std::ptrdiff_t>(tokens / page_size_);
  if (!node->digests.empty()) {
    m->digests.assign(node->digests.begin(), node->digests.begin() + upper_pages);
    node->digests.erase(node->digests.begin(), node->digests.begin() + upper_pages);
  }
  m->stored_pages = std::min<std::int64_t>(node->stored_pages, upper_pages);
  node->stored_pages = std::max<std::int64_t>(0, node->stored_pages - upper_pages);
  m->backup_op = node->backup_op;
  m->write_op = node->write_op;
  m->load_op = node->load_op;
  m->evict_after_write = node->evict_after_write;
  m->announced = node->announced;  // the same pages, announced where they were
  if (node->backup_op != 0) pending_->backups[node->backup_op].nodes.push_back(m);
  if (node->write_op != 0) pending_->writes[node->write_op].nodes.push_back(m);
  if (node->load_op != 0) pending_->loads[node->load_op].nodes.push_back(m);
  refresh(m);
  refresh(node);
  return m;
}

HiRadixCache::MatchResult HiRadixCache::match_prefix(std::span<const std::int32_t> tokens,
                                                     std::string_view identity) {
  MatchResult r;
  r.last_device_node = r.last_host_node = tree_->root();
  const std::size_t usable = tokens.size() / page_size_ * page_size_;
  Node* node = tree_->root();
  std::size_t pos = 0;
  bool device_run = true;
  std::vector<Node*> to_write;
  while (pos < usable) {
    Node* child = tree_->child_of(node, tokens.subspan(pos, page_size_), identity);
    if (child == nullptr) break;
    const std::size_t common = tree_->common_tokens(child, tokens.subspan(pos, usable - pos));
    if (common < child->key().size()) child = split(child, common);
    ++child->hits;
    tree_->touch(child);
    if (device_run && !child->device.empty()) {
      append(r.device_slots, child->device);
      r.last_device_node = child;
    } else {
      device_run = false;
      r.host_hit_tokens += static_cast<std::int64_t>(child->key().size());
    }
    r.last_host_node = child;
    if (policy_ == WritePolicy::kWriteThroughSelective &&
        child->hits >= config_.write_through_threshold) {
      to_write.push_back(child);
    }
    pos += common;
    node = child;
    if (common < child->key().size()) break;
  }
  for (Node* n : to_write) {
    if (n->host.empty() && !n->device.empty() && n->write_op == 0)
      write_node(n, kBackupWritePriority);
  }
  events_.matched_device_tokens += r.device_slots.size();
  events_.matched_host_tokens += static_cast<std::uint64_t>(r.host_hit_tokens);
  events_.unmatched_tokens +=
      tokens.size() - r.device_slots.size() - static_cast<std::size_t>(r.host_hit_tokens);
  if (pos < usable) {
    events_.miss_evicted_tokens += ghost_->take_evicted_tokens(
        radix::GhostSet::parent_name(node->id, node == tree_->root(), identity),
        tokens.subspan(pos, usable - pos), page_size_);
  }
  return r;
}

std::int64_t HiRadixCache::insert(std::span<const std::int32_t> tokens,
                                  std::span<const std::int64_t> device_slots,
                                  std::string_view identity) {
  if (tokens.size() % page_size_ != 0) {
    throw InvalidArgument(str_cat("insert: ", tokens.size(), " tokens is not a whole number of ",
                                  page_size_, "-token pages"));
  }
  if (device_slots.size() != tokens.size()) {
    throw InvalidArgument(
        str_cat("insert: ", device_slots.size(), " device slots for ", tokens.size(), " tokens"));
  }
  Node* node = tree_->root();
  std::size_t pos = 0;
  std::int64_t duplicate = 0;
  while (pos < tokens.size()) {
    Node* child = tree_->child_of(node, tokens.subspan(pos, page_size_), identity);
    if (child == nullptr) {
      Node* l = add_leaf(node, tokens.subspan(pos), identity);
      l->device.assign(device_slots.begin() + static_cast<std::ptrdiff_t>(pos), device_slots.end());
      refresh(l);
      if (policy_ == WritePolicy::kWriteThrough) write_node(l, kBackupWritePriority);
      return duplicate;
    }
    const std::size_t common = tree_->common_tokens(child, tokens.subspan(pos));
    if (common < child->key().size()) child = split(child, common);
    tree_->touch(child);
    // Cached already, on the device or on the host: the caller's slots duplicate it. (Adopting
    // them as the device copy of a host-only node would need a backup -> synced transition the
    // page states do not have; load_back is the way back to the device.)
    duplicate += static_cast<std::int64_t>(common);
    pos += common;
    node = child;
  }
  return duplicate;
}

void HiRadixCache::lock(Node* node) {
  for (Node* n = node; n != nullptr; n = n->parent) {
    if (++n->lock == 1) refresh(n);  // no longer evictable
  }
}

void HiRadixCache::unlock(Node* node) {
  for (Node* n = node; n != nullptr; n = n->parent) {
    if (n->lock <= (n == tree_->root() ? 1 : 0)) {
      throw StateError(str_cat("unlock: node ", node->id, " is not locked"));
    }
  }
  for (Node* n = node; n != nullptr; n = n->parent) {
    if (--n->lock == 0) refresh(n);
  }
}

void HiRadixCache::write_node(Node* node, std::int64_t priority) {
  if (!config_.host_tier) return;  // device only: the node stays device-only
  const auto tokens = static_cast<std::int64_t>(node->device.size());
  // TP: the room is judged on what every rank has alike (host_room(), and the writes in flight,
  // which the write queue holds at most), never on the pool's or the queue's own state, which
  // the controller's threads change at times that differ between ranks.
  const bool tp = agreement_->agreeing();
  if (tp &&
      (host_room() < tokens || pending_->writes.size() >= controller_.config().queue_capacity)) {
    return;  // host full or queue full: the node stays device-only
  }
  auto host = controller_.reserve_write(tokens);
  if (!host && !tp) return;  // host full or queue full: the node stays device-only
  if (host && !controller_.write_reserved(node->device, *host, priority, node->id))
    return;  // stopped
  node->write_op = node->id;
  lock(node);
  pending_->writes[node->id] = radix::PendingOps::Op{node, {node}};
  if (host) {
    node->host = std::move(*host);
  } else {
    // The room was there by the agreed count but not in this rank's pool: something else holds
    // its pages (the caller broke the contract of host_room()). The write fails here, and the
    // next check_events makes every rank drop it.
    arrived_->writes[node->id] = radix::ArrivedAcks::kFailed;
  }
  refresh(node);
}

std::optional<std::vector<std::int64_t>> HiRadixCache::load_back(Node* node) {
  std::vector<Node*> path;
  for (Node* n = node; n != tree_->root(); n = n->parent) path.push_back(n);
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
    if (!load_back_pays(static_cast<std::int64_t>(host.size()))) return std::nullopt;
    const NodeId op = tree_->next_id();
    lock(node);  // the path stays while it loads (and eviction below cannot take it)
    auto device = controller_.load(host, 0, op);
    if (!device) {
      evict_device(static_cast<std::int64_t>(host.size()));
      device = controller_.load(host, 0, op);
    }
    if (!device) {
      unlock(node);
      return std::nullopt;
    }
    std::size_t at = 0;
    for (Node* n : missing) {
      n->device.assign(device->begin() + static_cast<std::ptrdiff_t>(at),
                       device->begin() + static_cast<std::ptrdiff_t>(at + n->key().size()));
      at += n->key().size();
      n->load_op = op;
      refresh(n);
    }
    pending_->loads[op] = radix::PendingOps::Op{node, missing};
    events_.loaded_back_tokens += host.size();
  }
  std::vector<std::int64_t> out;
  for (Node* n : path) {
    tree_->touch(n);
    append(out, n->device);
  }
  return out;
}

void HiRadixCache::drop_device(Node* node) {
  const auto n = static_cast<std::int64_t>(node->device.size());
  if (!node->host.empty()) {
    controller_.evict_device(node->device, node->host);
  } else {
    device_pool_.allocator().free(node->device);
    events_.dropped_device_tokens += n;
  }
  node->device.clear();
  refresh(node);
  events_.evicted_device_tokens += n;
}

std::int64_t HiRadixCache::evict_device(std::int64_t tokens) {
  // The index holds the candidates in eviction order: unlocked, no op in flight, no child on
  // the device. A node without a host copy is dropped when nothing hangs below it; otherwise
  // (and always under write-back) it is written first and freed on the ack. Under the
  // write-through policies such a node is one whose write found the host pool full: without
  // this the device could fill up with inner nodes that nothing ever frees.
  std::int64_t freed = 0, scheduled = 0;  // scheduled: write-back evictions freed on the ack
  std::vector<Node*> passed_over;         // host full and a subtree below: kept this call
  const bool timed = metrics_.attached();  // metrics off: no clock read on this path
  const auto started =
      timed ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
  while (freed + scheduled < tokens) {
    Node* n = index_->next_victim(radix::Tier::kDevice);
    if (n == nullptr) break;
    if (n->host.empty() && (policy_ == WritePolicy::kWriteBack || !n->children.empty())) {
      write_node(n, kEvictionWritePriority);
      if (n->write_op == 0 && !n->children.empty() && config_.host_tier) {
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
        refresh(n);
        passed_over.push_back(n);
        continue;
      }
    }
    freed += static_cast<std::int64_t>(n->device.size());
    drop_device(n);                       // its parent may become a candidate
    if (n->host.empty()) remove_leaf(n);  // no KV anywhere: the node goes
  }
  for (Node* n : passed_over) {
    n->passed_over = false;
    refresh(n);
  }
  if (timed && freed + scheduled > 0) {
    events_.device_eviction_seconds.observe(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
  }
  return freed;
}

std::int64_t HiRadixCache::evict_host_to_free(std::int64_t target) {
  const std::int64_t need = target - host_room();
  return need > 0 ? evict_host(need) : 0;
}

std::int64_t HiRadixCache::evict_host(std::int64_t tokens) {
  // Candidates in eviction order: unlocked host-only leaves with no op in flight. A node that
  // goes may leave its parent such a leaf.
  std::int64_t freed = 0;
  while (freed < tokens) {
    Node* n = index_->next_victim(radix::Tier::kHost);
    if (n == nullptr) break;
    controller_.evict_host(n->host);
    freed += static_cast<std::int64_t>(n->host.size());
    remove_leaf(n);
  }
  events_.evicted_host_tokens += freed;
  return freed;
}

void HiRadixCache::apply_write_ack(NodeId id, std::int64_t agreed, std::int64_t local) {
  const bool ok = agreed == radix::ArrivedAcks::kOk, local_ok = local == radix::ArrivedAcks::kOk;
  auto taken = radix::PendingOps::take(pending_->writes, id);
  if (!taken) return;
  radix::PendingOps::Op& op = *taken;
  for (Node* n : op.nodes) {
    n->write_op = 0;
    if (!ok) {
      // The controller freed the host pages of a failed write; where the write worked here but
      // failed on another rank, this rank drops its copy too, so the trees stay identical.
      if (local_ok) host_pool_.discard(n->host);
      n->host.clear();
      n->evict_after_write = false;
    }
    refresh(n);
  }
  if (!ok) ++events_.write_failures;
  unlock(op.holder);
  for (Node* n : op.nodes) {
    if (n->evict_after_write) {
      n->evict_after_write = false;
      if (n->lock == 0 && n->load_op == 0) drop_device(n);
    }
    if (ok) l3_->backup_node(n);
  }
}

void HiRadixCache::apply_load_ack(NodeId id, std::int64_t agreed, std::int64_t local) {
  const bool ok = agreed == radix::ArrivedAcks::kOk, local_ok = local == radix::ArrivedAcks::kOk;
  auto taken = radix::PendingOps::take(pending_->loads, id);
  if (!taken) return;
  radix::PendingOps::Op& op = *taken;
  for (Node* n : op.nodes) {
    n->load_op = 0;
    if (!ok) {
      events_.miss_load_failed_tokens += n->device.size();
      // The device slots are not to be used; the host copy is intact. Where the load worked
      // here, its host pages went to synced: back to backup with the device copy freed.
      if (local_ok) {
        controller_.evict_device(n->device, n->host);
      } else {
        device_pool_.allocator().free(n->device);
      }
      n->device.clear();
    }
    refresh(n);
  }
  if (!ok) ++events_.load_failures;
  unlock(op.holder);
}

void HiRadixCache::apply_backup_ack(NodeId id, std::int64_t agreed, std::int64_t /*local*/) {
  auto taken = radix::PendingOps::take(pending_->backups, id);
  if (!taken) return;
  const std::int64_t completed_tokens = pending_->forgotten_backups.erase(id) != 0 ? 0 : agreed - 1;
  // The op's pages run from the uppermost part (split off last) down to the holder.
  std::vector<Node*> nodes = taken->nodes;
  std::sort(nodes.begin(), nodes.end(), [](Node* a, Node* b) {
    int da = 0, db = 0;
    for (Node* n = a; n != nullptr; n = n->parent) ++da;
    for (Node* n = b; n != nullptr; n = n->parent) ++db;
    return da < db;
  });
  std::int64_t pages = completed_tokens / page_size_;
  for (Node* n : nodes) {
    n->backup_op = 0;
    const auto own = static_cast<std::int64_t>(n->key().size()) / page_size_;
    const std::int64_t was = n->stored_pages;
    n->stored_pages = std::max(n->stored_pages, std::min(own, pages));
    if (tier_events_) tier_events_->l3_stored(n, was, n->stored_pages, taken->l3_clock);
    pages = std::max<std::int64_t>(0, pages - own);
    refresh(n);
  }
  unlock(taken->holder);
}

std::uint64_t HiRadixCache::event_seq() const { return controller_.events()->seq(); }

bool HiRadixCache::wait_for_events(std::uint64_t seen,
                                   std::optional<std::chrono::steady_clock::time_point> deadline) {
  if (agreement_->lockstep()) {
    std::this_thread::yield();
    return true;
  }
  const auto until = l3_->next_deadline(deadline);
  if (controller_.events()->wait(seen, until)) return true;
  return !deadline || *until < *deadline;  // woken for a prefetch's timeout: that is progress
}

void HiRadixCache::check_events() {
  apply_events();
  demote();
  if (tier_events_) {
    if (pending_->backups.empty()) tier_events_->l3_forget_removals();
    tier_events_->publish();
  }
  // The device allocator is the main loop's: its occupancy is published here for a scrape.
  const auto& a = device_pool_.allocator();
  device_used_tokens_.set(static_cast<double>(a.capacity_tokens() - a.free_tokens()));
}

void HiRadixCache::demote() {
  if (config_.demote_low_watermark <= 0) return;
  const double capacity = static_cast<double>(device_pool_.allocator().capacity_tokens());
  const auto free_tokens = static_cast<double>(device_pool_.allocator().free_tokens());
  if (free_tokens >= config_.demote_low_watermark * capacity) return;
  // Tokens already on their way out: write-backs that free their device copy on the ack.
  std::int64_t leaving = 0;
  for (const auto& [id, op] : pending_->writes) {
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

void HiRadixCache::remove_leaf(Node* node) {
  Node* parent = node->parent;
  index_->forget(node);
  ghost_->remember(
      radix::GhostSet::parent_name(parent->id, parent == tree_->root(), node->identity), node->id,
      node->key(), page_size_);
  if (tier_events_) tier_events_->leaving(node);  // what it held goes with it
  tree_->remove_leaf(node);  // freed here
  refresh(parent);           // may be a leaf now
}

std::int64_t HiRadixCache::cached_prefix_tokens(std::span<const std::int32_t> tokens,
                                                std::string_view identity) const {
  return static_cast<std::int64_t>(tree_->prefix_tokens(tokens, identity));
}

std::int64_t HiRadixCache::local_load_bps() const {
  const ControllerStats cs = controller_.stats();
  return radix::CostRule::rate(static_cast<double>(cs.bytes_loaded), cs.load_seconds);
}

bool HiRadixCache::all_ranks(bool local, const char* tag) {
  bool failed = false;
  const bool all = agreement_->on_every_rank(local, tag, &failed);
  if (failed) ++events_.tp_failures;
  return all;
}

std::int64_t HiRadixCache::host_room() const {
  if (!agreement_->agreeing()) return host_pool_.free_tokens();
  return host_pool_.capacity_tokens() - index_->totals().host_tokens - l3_->reserved_tokens();
}

bool HiRadixCache::load_back_pays(std::int64_t tokens) {
  if (!cost_->on()) return true;
  const bool pays = cost_->moving_pays(radix::CostRule::Move::kLoad, tokens,
                                       agreement_->load_bps(local_load_bps()));
  if (!pays) {
    ++events_.load_backs_refused_by_cost;
    events_.miss_load_refused_tokens += tokens;
  }
  return pays;
}

void HiRadixCache::apply_events() {
  acks_.clear();
  controller_.drain_write_acks(acks_);
  for (const Ack& a : acks_) arrived_->writes[a.node] = radix::ArrivedAcks::outcome(a.ok);
  acks_.clear();
  controller_.drain_load_acks(acks_);
  for (const Ack& a : acks_) arrived_->loads[a.node] = radix::ArrivedAcks::outcome(a.ok);
  l3_->drain_acks();
  if (agreement_->agreeing()) {
    agree_and_apply();
    return;
  }
  // One rank (or the TP collective failed for good, and each rank goes on alone, counted):
  // apply everything that arrived.
  for (const auto& [id, v] : arrived_->writes) apply_write_ack(id, v, v);
  for (const auto& [id, v] : arrived_->loads) apply_load_ack(id, v, v);
  for (const auto& [id, v] : arrived_->backups) apply_backup_ack(id, v, v);
  arrived_->writes.clear();
  arrived_->loads.clear();
  arrived_->backups.clear();
  l3_->finish_arrived_prefetches();
}

// TP ranks: only what every rank agreed on changes the tree (radix/agreement.h), in the order
// the step lists it: writes, loads, backups, then prefetches.
void HiRadixCache::agree_and_apply() {
  // Nothing pending: nothing can have arrived, and nothing is pending on any rank either (the
  // ranks start and end ops at the same agreed steps), so every rank skips the reduction alike.
  // An idle engine's steps cost no collective.
  if (pending_->idle()) {
    arrived_->revoked.clear();  // revokes of prefetches that already ended
    return;
  }
  const radix::Agreement::Step* step =
      agreement_->reduce(*pending_, *arrived_, l3_->storage(), page_size_, local_load_bps(),
                         l3_->local_prefetch_bps());
  if (step == nullptr) {
    ++events_.tp_failures;
    apply_events();  // the collective is failed for good: the local path from now on
    return;
  }
  for (const auto& a : step->writes) apply_write_ack(a.id, a.agreed, a.local);
  for (const auto& a : step->loads) apply_load_ack(a.id, a.agreed, a.local);
  for (const auto& a : step->backups) apply_backup_ack(a.id, a.agreed, a.local);
  for (const auto& p : step->prefetches) {
    if (p.ended) {
      l3_->finish_prefetch(p.id, false, p.pages);  // revoked or finished everywhere
      continue;
    }
    radix::PendingOps::Prefetch& pending = pending_->prefetches.at(p.id);
    pending.agreed_ready = p.ready;
    pending.agreed_pages = p.pages;
  }
  // Revokes of prefetches that already ended (check_prefetch_progress got there first).
  std::erase_if(arrived_->revoked,
                [&](const std::string& id) { return pending_->prefetches.count(id) == 0; });
}

bool HiRadixCache::prefetch_from_storage(const std::string& request_id, Node* node,
                                         std::span<const std::int32_t> tokens,
                                         std::string_view identity) {
  return l3_->prefetch(request_id, node, tokens, identity);
}

bool HiRadixCache::check_prefetch_progress(const std::string& request_id,
                                           std::int64_t* inserted_tokens) {
  return l3_->check_progress(request_id, inserted_tokens);
}

void HiRadixCache::release_aborted_request(const std::string& request_id) {
  l3_->release_aborted(request_id);
}

std::size_t HiRadixCache::prefetches_in_flight() const { return pending_->prefetches.size(); }

void HiRadixCache::detach_storage() {
  l3_->detach();
  if (!tier_events_) return;
  tier_events_->detach_l3();
  tier_events_->publish();
}

void HiRadixCache::attach_storage(StorageController& storage, const KeyNamespace& keys) {
  if (l3_->attached()) throw StateError("attach_storage: L3 is attached already");
  if (!config_.host_tier) {
    throw InvalidArgument("attach_storage: the cache has no host tier (host_tier false)");
  }
  auto keyer = std::make_unique<PageKeyer>(keys);
  if (keyer->page_size() != page_size_) {
    throw InvalidArgument(str_cat("attach_storage: key namespace page_size ", keyer->page_size(),
                                  " differs from the pools' ", page_size_));
  }
  l3_->attach(storage, std::move(keyer), controller_.events());
  if (tier_events_) tier_events_->attach_l3(l3_->key_prefix(), l3_medium(storage.storage()));
}

void HiRadixCache::forget_stored_pages() {
  l3_->forget_stored_pages();
  if (!tier_events_) return;
  tier_events_->l3_cleared();
  tier_events_->publish();
}

std::string HiRadixCache::describe() const {
  std::string out;
  std::function<void(const Node*, int)> walk = [&](const Node* n, int depth) {
    if (n != tree_->root()) {
      out += str_cat(std::string(static_cast<std::size_t>(depth), ' '),
                     n->identity.empty() ? "" : str_cat("(", n->identity, ") "), "[",
                     n->key().front(), "..+", n->key().size(), "] dev ", n->device.size(), " host ",
                     n->host.size(), n->write_op != 0 ? " writing" : "",
                     n->load_op != 0 ? " loading" : "", n->backup_op != 0 ? " backing-up" : "",
                     " lock ", n->lock, " stored ", n->stored_pages, "\n");
    }
    for (const Node* c : tree_->ordered_children(n)) walk(c, depth + 1);
  };
  walk(tree_->root(), -1);
  return out;
}

void HiRadixCache::register_metrics(MetricsRegistry& registry, MetricLabels labels) {
  metrics_.attach(registry, std::move(labels));
  events_.register_in(metrics_);
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

RadixCacheStats HiRadixCache::stats() const {
  RadixCacheStats s;
  const radix::CostRule::Inputs& cost = cost_->inputs();
  s.measured_load_gbps = cost.measured_load_gbps;
  s.last_load_estimate_s = cost.last_load_estimate_s;
  s.measured_prefetch_gbps = cost.measured_prefetch_gbps;
  s.last_prefetch_estimate_s = cost.last_prefetch_estimate_s;
  s.last_recompute_estimate_s = cost.last_recompute_estimate_s;
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
  });
  if (!problem.empty()) return problem;
  return index_->check(*tree_);
}

}  // namespace hicache
