#include "controller/hi_radix_cache.h"

#include <algorithm>
#include <cmath>
#include <thread>

#include "controller/kv_events.h"
#include "controller/radix/agreement.h"
#include "controller/radix/eviction.h"
#include "controller/radix/ghost_set.h"
#include "controller/radix/l3_paths.h"
#include "controller/radix/sidecar_units.h"
#include "controller/radix/tier_events.h"
#include "controller/radix/tier_policy.h"
#include "controller/radix/tree.h"
#include "transfer/errors.h"

namespace hicache {

namespace {

template <typename T>
void append(std::vector<T>& to, const std::vector<T>& from) {
  to.insert(to.end(), from.begin(), from.end());
}

// Where a store's records are, as the KV events name it: a file store's on a local disk, the
// others' in a server (Redis, Redis Cluster).
KvMedium l3_medium(const StorageBackend& store) {
  return store.name() == "file" ? KvMedium::kDisk : KvMedium::kExternal;
}

}  // namespace

// What the rooms ask of the coordinator (radix::L3Paths::Cache, radix::TierPolicy::Cache): its
// tree edits that keep the tiers, the eviction index and the KV events right, locks, and the
// other rooms' answers.
class HiRadixCache::Hooks final : public radix::L3Paths::Cache, public radix::TierPolicy::Cache {
 public:
  explicit Hooks(HiRadixCache& cache) : c_(cache) {}
  void lock(Node* node) override { c_.lock(node); }
  void unlock(Node* node) override { c_.unlock(node); }
  void refresh(Node* node) override { c_.refresh(node); }
  // L3Paths::Cache
  std::int64_t evict_host(std::int64_t tokens) override { return c_.tiers_->evict_host(tokens); }
  std::int64_t host_room() const override { return c_.tiers_->host_room(); }
  Node* split_node(Node* node, std::size_t tokens) override { return c_.split(node, tokens); }
  Node* add_node(Node* parent, std::span<const std::int32_t> key,
                 std::string_view identity) override {
    return c_.add_leaf(parent, key, identity);
  }
  void l3_stored(const Node* node, std::int64_t from, std::int64_t to,
                 std::uint64_t queued_at) override {
    if (c_.tier_events_) c_.tier_events_->l3_stored(node, from, to, queued_at);
  }
  std::uint64_t l3_removal_clock() const override {
    return c_.tier_events_ ? c_.tier_events_->l3_clock() : 0;
  }
  void backup_acked(Node* node) override { c_.tiers_->backup_acked(node); }
  bool reserve_prefetch_sidecars(std::span<const std::int64_t> pages,
                                 std::vector<SidecarPagesIo>& out,
                                 std::vector<std::int64_t>& counted) override {
    return c_.tiers_->reserve_prefetch_sidecars(pages, out, counted);
  }
  void sidecar_hosts_released(std::int32_t pool, std::int64_t slots) override {
    c_.tiers_->sidecar_hosts_released(pool, slots);
  }
  void adopt_sidecar_hosts(Node* node, std::vector<SidecarPagesIo>& fetched,
                           std::int64_t first_page) override {
    c_.sidecars_->adopt_host(node, fetched, first_page);
  }
  void free_sidecar_hosts(std::span<const SidecarPagesIo> fetched) override {
    for (const SidecarPagesIo& io : fetched) {
      if (io.host_slots.empty()) continue;
      c_.controller_.sidecar(static_cast<std::size_t>(io.pool)).host_pool().free(io.host_slots);
      c_.tiers_->sidecar_hosts_released(io.pool, static_cast<std::int64_t>(io.host_slots.size()));
    }
  }
  // TierPolicy::Cache
  void remove_leaf(Node* node) override { c_.remove_leaf(node); }
  void host_copy_synced(Node* node) override { c_.l3_->backup_node(node); }
  bool l3_attached() const override { return c_.l3_->attached(); }
  bool back_up_leaving(Node* node) override { return c_.l3_->back_up_leaving(node); }
  std::int64_t prefetch_reserved_tokens() const override { return c_.l3_->reserved_tokens(); }
  bool timed() const override { return c_.metrics_.attached(); }

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
      selective_writes_(controller.config().write_policy == WritePolicy::kWriteThroughSelective) {
  if ((storage == nullptr) != (keys == nullptr)) {
    throw InvalidArgument("radix cache: storage and its key namespace go together");
  }
  if (!config_.host_tier && storage != nullptr) {
    throw InvalidArgument("radix cache: host_tier false (device only) with a storage tier");
  }
  if (storage != nullptr && storage->num_sidecars() != controller.num_sidecars()) {
    throw InvalidArgument(str_cat("radix cache: the storage controller has ",
                                  storage->num_sidecars(), " sidecar pools, the controller ",
                                  controller.num_sidecars()));
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
  // A node's sidecar bytes weigh against its KV's (radix::eviction_mark); without sidecar
  // pools every node is KV alone and the order is plain LRU / LFU.
  index_ = std::make_unique<radix::EvictionIndex>(
      config_.eviction_policy, page_size_,
      config_.weigh_footprint ? device_pool.geometry().token_bytes() : 0);
  ghost_ = std::make_unique<radix::GhostSet>(
      (host_pool.capacity_tokens() + device_pool.allocator().capacity_tokens()) / page_size_);
  pending_ = std::make_unique<radix::PendingOps>();
  arrived_ = std::make_unique<radix::ArrivedAcks>();
  agreement_ = std::make_unique<radix::Agreement>(tp);
  cost_ = std::make_unique<radix::CostRule>(config_.recompute_seconds_per_token,
                                            device_pool.geometry().token_bytes());
  sidecars_ = std::make_unique<radix::SidecarUnits>(controller_, *tree_);
  hooks_ = std::make_unique<Hooks>(*this);
  l3_ = std::make_unique<radix::L3Paths>(*hooks_, *tree_, *pending_, *arrived_, *agreement_, *cost_,
                                         events_, host_pool_);
  tiers_ = std::make_unique<radix::TierPolicy>(
      *hooks_, *tree_, *index_, *pending_, *arrived_, *agreement_, *cost_, events_, controller_,
      device_pool_, host_pool_,
      radix::TierPolicy::Config{.host_tier = config_.host_tier,
                                .write_through_threshold = config_.write_through_threshold,
                                .load_back_min_tokens = config_.load_back_min_tokens,
                                .demote_low_watermark = config_.demote_low_watermark,
                                .demote_high_watermark = config_.demote_high_watermark,
                                .storage_admission = config_.storage_admission,
                                .storage_admission_min_hits = config_.storage_admission_min_hits});
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
  if (recompute_seconds_per_token &&
      !(*recompute_seconds_per_token >= 0 && std::isfinite(*recompute_seconds_per_token))) {
    throw InvalidArgument(str_cat("radix cache: recompute_seconds_per_token ",
                                  *recompute_seconds_per_token, " is not a finite number >= 0"));
  }
  if (storage_admission_min_hits < 1) {
    throw InvalidArgument(str_cat("radix cache: storage_admission_min_hits ",
                                  storage_admission_min_hits, " < 1"));
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
  sidecars_->reset_pools();
  tiers_->forget_sidecar_hosts();
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
  sidecars_->split(node, m, upper_pages);
  m->stored_pages = std::min<std::int64_t>(node->stored_pages, upper_pages);
  node->stored_pages = std::max<std::int64_t>(0, node->stored_pages - upper_pages);
  m->backup_op = node->backup_op;
  m->write_op = node->write_op;
  m->load_op = node->load_op;
  m->evict_after_write = node->evict_after_write;
  m->leave_host_after_backup = node->leave_host_after_backup;
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
    if (selective_writes_ && tiers_->selective_write_due(*child)) to_write.push_back(child);
    // Asked for again: to L3 (a host write in flight backs it up on its ack instead).
    if (tiers_->reuse_backup_due(*child)) l3_->backup_node(child);
    pos += common;
    node = child;
    if (common < child->key().size()) break;
  }
  if (sidecars_->on()) cut_to_restorable(r);
  // Of the host part, what is on the device already (load_back skips it): the device run cut
  // at a hybrid model's restorable end, and nodes computed again below a host-only parent
  // (insert keeps their device copy and leaves the parent on the host).
  for (Node* n = r.last_host_node; n != r.last_device_node && n != tree_->root(); n = n->parent) {
    if (!n->device.empty()) r.resident_host_hit_tokens += static_cast<std::int64_t>(n->key().size());
  }
  if (!to_write.empty()) {
    // A write may make room for sidecar pages by evicting host-only leaves: the path it found
    // stays while it writes.
    lock(node);
    for (Node* n : to_write) tiers_->write_selected(n);
    unlock(node);
  }
  l3_->touch_path(node);  // the L3 pages of what was served here stay younger than tails
  events_.matched_device_tokens += r.device_slots.size() + static_cast<std::uint64_t>(r.resident_host_hit_tokens);
  events_.matched_host_tokens +=
      static_cast<std::uint64_t>(r.host_hit_tokens - r.resident_host_hit_tokens);
  events_.unmatched_tokens +=
      tokens.size() - r.device_slots.size() - static_cast<std::size_t>(r.host_hit_tokens);
  if (pos < usable) {
    events_.miss_evicted_tokens += ghost_->take_evicted_tokens(
        radix::GhostSet::parent_name(node->id, node == tree_->root(), identity),
        tokens.subspan(pos, usable - pos), page_size_);
  }
  return r;
}

void HiRadixCache::cut_to_restorable(MatchResult& r) {
  const auto device_pages = static_cast<std::int64_t>(r.device_slots.size()) / page_size_;
  const std::int64_t pages = device_pages + r.host_hit_tokens / page_size_;
  const radix::SidecarUnits::Restorable cut =
      sidecars_->restorable(r.last_host_node, pages, device_pages);
  if (cut.on_device < device_pages) {
    r.device_slots.resize(static_cast<std::size_t>(cut.on_device * page_size_));
    r.last_device_node = node_at_page(r.last_device_node, cut.on_device);
  }
  if (cut.all < pages) r.last_host_node = node_at_page(r.last_host_node, cut.all);
  r.host_hit_tokens = (cut.all - cut.on_device) * page_size_;
}

HiRadixCache::Node* HiRadixCache::node_at_page(Node* end, std::int64_t pages) {
  std::vector<Node*> path;
  for (Node* n = end; n != tree_->root(); n = n->parent) path.push_back(n);
  std::int64_t start = 0;
  for (auto it = path.rbegin(); it != path.rend() && start < pages; ++it) {
    const auto node_pages = static_cast<std::int64_t>((*it)->key().size()) / page_size_;
    if (start + node_pages == pages) return *it;
    if (start + node_pages > pages) {
      return split(*it, static_cast<std::size_t>((pages - start) * page_size_));
    }
    start += node_pages;
  }
  return pages == 0 ? tree_->root() : end;
}

std::vector<HiRadixCache::SidecarPageSlots> HiRadixCache::sidecar_device_slots(
    const Node* node, std::int32_t pool) const {
  return sidecars_->device_slots(node, pool);
}

std::pair<std::int64_t, std::int64_t> HiRadixCache::sidecar_slots_held(std::int32_t pool) const {
  return sidecars_->slots_held(pool);
}

std::int64_t HiRadixCache::insert(std::span<const std::int32_t> tokens,
                                  std::span<const std::int64_t> device_slots,
                                  std::string_view identity,
                                  std::span<const SidecarInsert> sidecars) {
  if (tokens.size() % page_size_ != 0) {
    throw InvalidArgument(str_cat("insert: ", tokens.size(), " tokens is not a whole number of ",
                                  page_size_, "-token pages"));
  }
  if (device_slots.size() != tokens.size()) {
    throw InvalidArgument(
        str_cat("insert: ", device_slots.size(), " device slots for ", tokens.size(), " tokens"));
  }
  if (sidecars_->on()) {
    sidecars_->check_insert(
        sidecars, static_cast<std::int64_t>(tokens.size()) / page_size_,
        static_cast<std::int64_t>(tree_->prefix_tokens(tokens, identity)) / page_size_);
  }
  Node* node = tree_->root();
  std::size_t pos = 0;
  std::int64_t duplicate = 0;
  while (pos < tokens.size()) {
    Node* child = tree_->child_of(node, tokens.subspan(pos, page_size_), identity);
    if (child == nullptr) {
      Node* l = add_leaf(node, tokens.subspan(pos), identity);
      l->device.assign(device_slots.begin() + static_cast<std::ptrdiff_t>(pos), device_slots.end());
      // The sidecar pages of the new part go with it; those of cached pages stay the caller's.
      sidecars_->adopt(l, sidecars, static_cast<std::int64_t>(pos) / page_size_);
      refresh(l);
      tiers_->inserted(l);
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

std::optional<std::vector<std::int64_t>> HiRadixCache::load_back(Node* node) {
  return tiers_->load_back(node);
}

std::int64_t HiRadixCache::evict_device(std::int64_t tokens) {
  return tiers_->evict_device(tokens);
}

std::int64_t HiRadixCache::evict_host(std::int64_t tokens) { return tiers_->evict_host(tokens); }

std::int64_t HiRadixCache::evict_host_to_free(std::int64_t target) {
  return tiers_->evict_host_to_free(target);
}

std::int64_t HiRadixCache::host_room() const { return tiers_->host_room(); }

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
  tiers_->demote();
  if (tier_events_) {
    if (pending_->backups.empty()) tier_events_->l3_forget_removals();
    tier_events_->publish();
  }
  // The device allocator is the main loop's: its occupancy is published here for a scrape.
  const auto& a = device_pool_.allocator();
  device_used_tokens_.set(static_cast<double>(a.capacity_tokens() - a.free_tokens()));
}

void HiRadixCache::remove_leaf(Node* node) {
  Node* parent = node->parent;
  index_->forget(node);
  ghost_->remember(
      radix::GhostSet::parent_name(parent->id, parent == tree_->root(), node->identity), node->id,
      node->key(), page_size_);
  if (tier_events_) tier_events_->leaving(node);  // what it held goes with it
  tree_->remove_leaf(node);                       // freed here
  refresh(parent);                                // may be a leaf now
}

std::int64_t HiRadixCache::cached_prefix_tokens(std::span<const std::int32_t> tokens,
                                                std::string_view identity) const {
  return static_cast<std::int64_t>(tree_->prefix_tokens(tokens, identity));
}

bool HiRadixCache::all_ranks(bool local, const char* tag) {
  bool failed = false;
  const bool all = agreement_->on_every_rank(local, tag, &failed);
  if (failed) ++events_.tp_failures;
  return all;
}

void HiRadixCache::sample_links() {
  using Link = radix::CostRule::Link;
  const ControllerStats cs = controller_.stats();
  cost_->sample(Link::kHostLoad, static_cast<double>(cs.load_batches_done),
                static_cast<double>(cs.bytes_loaded), cs.load_seconds);
  cost_->sample(Link::kHostWrite, static_cast<double>(cs.write_batches_done),
                static_cast<double>(cs.bytes_written), cs.write_seconds);
  if (const StorageController* st = l3_->storage()) {
    // The calls first: a call is counted after its bytes and time (a call seen has them).
    const auto reads = static_cast<double>(st->read_calls());
    cost_->sample(Link::kL3Read, reads, static_cast<double>(st->read_bytes()), st->read_seconds());
    const auto writes = static_cast<double>(st->write_calls());
    cost_->sample(Link::kL3Write, writes, static_cast<double>(st->written_bytes()),
                  st->write_seconds());
  }
}

void HiRadixCache::apply_events() {
  sample_links();
  acks_.clear();
  controller_.drain_write_acks(acks_);
  for (const Ack& a : acks_) arrived_->writes[a.node] = radix::ArrivedAcks::outcome(a.ok);
  acks_.clear();
  controller_.drain_load_acks(acks_);
  for (const Ack& a : acks_) arrived_->loads[a.node] = radix::ArrivedAcks::outcome(a.ok);
  l3_->cut_late_prefetches();
  l3_->drain_acks();
  if (agreement_->agreeing()) {
    agree_and_apply();
    return;
  }
  // One rank (or the TP collective failed for good, and each rank goes on alone, counted):
  // apply everything that arrived.
  for (const auto& [id, v] : arrived_->writes) tiers_->apply_write_ack(id, v, v);
  for (const auto& [id, v] : arrived_->loads) tiers_->apply_load_ack(id, v, v);
  for (const auto& [id, v] : arrived_->backups) l3_->apply_backup_ack(id, v, v);
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
      agreement_->reduce(*pending_, *arrived_, l3_->storage(), page_size_, cost_->local());
  if (step == nullptr) {
    ++events_.tp_failures;
    apply_events();  // the collective is failed for good: the local path from now on
    return;
  }
  for (const auto& a : step->writes) tiers_->apply_write_ack(a.id, a.agreed, a.local);
  for (const auto& a : step->loads) tiers_->apply_load_ack(a.id, a.agreed, a.local);
  for (const auto& a : step->backups) l3_->apply_backup_ack(a.id, a.agreed, a.local);
  for (const auto& p : step->prefetches) {
    radix::PendingOps::Prefetch& pending = pending_->prefetches.at(p.id);
    pending.agreed_landed_steps = p.landed_steps;
    if (p.ended) {
      l3_->finish_prefetch(p.id, false, p.pages);  // revoked or finished everywhere
      continue;
    }
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
  cost_->reset(radix::CostRule::Link::kL3Read);  // the next store's links are its own
  cost_->reset(radix::CostRule::Link::kL3Write);
  if (!tier_events_) return;
  tier_events_->detach_l3();
  tier_events_->publish();
}

void HiRadixCache::attach_storage(StorageController& storage, const KeyNamespace& keys) {
  if (l3_->attached()) throw StateError("attach_storage: L3 is attached already");
  if (storage.num_sidecars() != controller_.num_sidecars()) {
    throw InvalidArgument(str_cat("attach_storage: the storage controller has ",
                                  storage.num_sidecars(), " sidecar pools, the controller ",
                                  controller_.num_sidecars()));
  }
  if (!config_.host_tier) {
    throw InvalidArgument("attach_storage: the cache has no host tier (host_tier false)");
  }
  auto keyer = std::make_unique<PageKeyer>(keys);
  if (keyer->page_size() != page_size_) {
    throw InvalidArgument(str_cat("attach_storage: key namespace page_size ", keyer->page_size(),
                                  " differs from the pools' ", page_size_));
  }
  l3_->attach(storage, std::move(keyer), controller_.events());
  cost_->reset(radix::CostRule::Link::kL3Read);  // a store's links are measured anew
  cost_->reset(radix::CostRule::Link::kL3Write);
  if (tier_events_) tier_events_->attach_l3(l3_->key_prefix(), l3_medium(storage.storage()));
}

void HiRadixCache::forget_stored_pages() {
  l3_->forget_stored_pages();
  if (!tier_events_) return;
  tier_events_->l3_cleared();
  tier_events_->publish();
}

}  // namespace hicache
