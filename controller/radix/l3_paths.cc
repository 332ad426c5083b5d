#include "controller/radix/l3_paths.h"

#include <algorithm>
#include <limits>

namespace hicache::radix {

L3Paths::L3Paths(Cache& cache, Tree& tree, PendingOps& pending, ArrivedAcks& arrived,
                 Agreement& agreement, CostRule& cost, CacheEvents& events, HostKVPool& host_pool)
    : cache_(cache),
      tree_(tree),
      pending_(pending),
      arrived_(arrived),
      agreement_(agreement),
      cost_(cost),
      events_(events),
      host_pool_(host_pool) {}

void L3Paths::attach(StorageController& storage, std::unique_ptr<PageKeyer> keyer,
                     std::shared_ptr<EventSignal> signal) {
  keyer_ = std::move(keyer);
  storage_ = &storage;
  storage_->set_event_signal(std::move(signal));
  // Parents first: each node's chain continues its parent's last digest.
  tree_.for_each_node([this](Node* n) { set_digests(n); });
}

void L3Paths::reset() {
  if (storage_ != nullptr) storage_->reset();
  reserved_tokens_ = 0;
  backup_acks_.clear();
  revoked_.clear();
}

void L3Paths::keep_digests(std::int32_t page_size) {
  KeyNamespace ns{.model = "kv-events", .fingerprint = "none", .dtype = "none",
                  .layout = "none", .page_size = page_size};
  digest_keyer_ = std::make_unique<PageKeyer>(ns);
  tree_.for_each_node([this](Node* n) {
    if (n->digests.empty()) set_digests(n);
  });
}

void L3Paths::set_digests(Node* node) {
  PageKeyer* keyer = keyer_ ? keyer_.get() : digest_keyer_.get();
  if (keyer == nullptr) return;
  const bool under_root = node->parent == tree_.root();
  std::optional<PageDigest> seed;
  if (under_root && !node->identity.empty()) seed = keyer->identity_seed(node->identity);
  const PageDigest* prior =
      under_root ? (seed ? &*seed : nullptr)
                 : (node->parent->digests.empty() ? nullptr : &node->parent->digests.back());
  std::vector<std::string> keys;
  node->digests.clear();
  keyer->keys(node->key(), prior, keys, &node->digests);
}

void L3Paths::backup_node(Node* node) {
  const std::int32_t page = tree_.page_size();
  // Only a synced host copy: a write in flight still fills the host pages.
  if (storage_ == nullptr || node->host.empty() || node->write_op != 0 || node->backup_op != 0 ||
      node->digests.size() * page != node->key().size() ||
      node->stored_pages * page == static_cast<std::int64_t>(node->key().size())) {
    return;
  }
  // Room in the queue by the backups in flight (the queue holds at most those), the same count
  // on every rank, so that none queues a backup the others do not.
  if (pending_.backups.size() >= storage_->backup_queue_capacity()) {
    events_.backup_dropped_tokens += node->host.size();
    return;
  }
  std::vector<std::string> keys;
  keys.reserve(node->digests.size());
  for (const PageDigest& d : node->digests) keys.push_back(keyer_->key(d));
  // The node's sidecar pages go with its KV (page offsets in the node are the op's pages).
  std::vector<SidecarPagesIo> sidecars;
  for (const Node::SidecarPages& sp : node->sidecars) {
    sidecars.push_back({.pool = sp.pool,
                        .pages = std::vector<std::int64_t>(sp.pages.begin(), sp.pages.end()),
                        .host_slots = sp.host});
  }
  const std::uint64_t clock = cache_.l3_removal_clock();  // before the store can take it
  const auto id = storage_->write_storage(node->host, std::move(keys), sidecars);
  if (!id) {  // backup queue full: the node stays host-only, L1/L2 unaffected
    events_.backup_dropped_tokens += node->host.size();
    return;
  }
  // The op reads the host copy: it stays (out of host eviction: backup_op) until the ack. The
  // node is not locked, so its device copy and its path may leave the device meanwhile; a
  // lock would hold them there for as long as L3 takes to answer.
  node->backup_op = *id;
  cache_.refresh(node);
  pending_.backups[*id] = PendingOps::Op{node, {node}, clock};
}

bool L3Paths::back_up_leaving(Node* node) {
  if (storage_ == nullptr || pending_.backups.size() >= storage_->backup_queue_capacity()) {
    return false;
  }
  backup_node(node);
  return node->backup_op != 0;
}

void L3Paths::apply_backup_ack(NodeId id, std::int64_t agreed, std::int64_t /*local*/) {
  auto taken = PendingOps::take(pending_.backups, id);
  if (!taken) return;
  const std::int64_t completed_tokens = pending_.forgotten_backups.erase(id) != 0 ? 0 : agreed - 1;
  // The op's pages run from the uppermost part (split off last) down to the holder.
  std::vector<Node*> nodes = taken->nodes;
  std::sort(nodes.begin(), nodes.end(), [](Node* a, Node* b) {
    int da = 0, db = 0;
    for (Node* n = a; n != nullptr; n = n->parent) ++da;
    for (Node* n = b; n != nullptr; n = n->parent) ++db;
    return da < db;
  });
  const std::int32_t page = tree_.page_size();
  std::int64_t pages = completed_tokens / page;
  for (Node* n : nodes) {
    n->backup_op = 0;
    const auto own = static_cast<std::int64_t>(n->key().size()) / page;
    const std::int64_t was = n->stored_pages;
    n->stored_pages = std::max(n->stored_pages, std::min(own, pages));
    cache_.l3_stored(n, was, n->stored_pages, taken->l3_clock);
    pages = std::max<std::int64_t>(0, pages - own);
    cache_.refresh(n);
  }
  if (completed_tokens > 0) {
    touched_.clear();  // new records, younger than every touch so far
    touch_path(taken->holder);
  }
  // Deepest first: a leaf that leaves the host may leave its parent a leaf that can follow.
  for (auto it = nodes.rbegin(); it != nodes.rend(); ++it) cache_.backup_acked(*it);
}

void L3Paths::touch_path(Node* node) {
  if (storage_ == nullptr || node == nullptr || node->parent == nullptr ||
      !touched_.insert(node->id).second) {
    return;
  }
  std::vector<Node*> path;
  for (Node* n = node; n->parent != nullptr; n = n->parent) path.push_back(n);
  const auto page = static_cast<std::int64_t>(tree_.page_size());
  std::vector<std::string> keys;
  for (auto it = path.rbegin(); it != path.rend(); ++it) {
    const Node* n = *it;
    const std::int64_t stored = std::min<std::int64_t>(n->stored_pages,
                                                       static_cast<std::int64_t>(n->digests.size()));
    for (std::int64_t i = 0; i < stored; ++i) {
      keys.push_back(keyer_->key(n->digests[static_cast<std::size_t>(i)]));
      // The page's sidecar records right after it: a chain restores only with them.
      for (const Node::SidecarPages& sp : n->sidecars) {
        if (std::binary_search(sp.pages.begin(), sp.pages.end(), static_cast<std::int32_t>(i))) {
          keys.push_back(storage_->sidecar_key(static_cast<std::size_t>(sp.pool), keys.back()));
        }
      }
    }
    // A page past the stored prefix is unreachable in L3 beyond it: the chain ends here.
    if (stored * page < static_cast<std::int64_t>(n->key().size())) break;
  }
  if (!keys.empty()) storage_->touch(std::move(keys));
}

bool L3Paths::prefetch(const std::string& request_id, Node* node,
                       std::span<const std::int32_t> tokens, std::string_view identity) {
  if (storage_ == nullptr || pending_.prefetches.count(request_id) != 0) return false;
  const std::size_t page = static_cast<std::size_t>(tree_.page_size());
  std::size_t usable = tokens.size() / page * page;
  if (usable == 0) return false;
  Node* const root = tree_.root();
  if (node != root && node->digests.empty()) return false;  // no chain to continue
  ++events_.prefetch_attempts;
  // A hit no longer than the span stays below the threshold: declined before any query (the
  // same decision on every rank), as SGLang's radix cache does.
  if (static_cast<std::int64_t>(usable) < storage_->config().prefetch_threshold_tokens) {
    ++events_.prefetches_too_short;
    return false;
  }
  std::optional<PageDigest> prior;
  if (node != root) {
    prior = node->digests.back();
  } else if (!identity.empty()) {
    prior = keyer_->identity_seed(identity);
  }
  // One rank, and a store that answers from memory: the existence answer comes here, before
  // any host page is reserved or evicted for it and before the request waits a step for a
  // query; the prefetch then asks for the held pages only. (Under TP the ranks' stores may
  // differ, and the storage controller's query agrees on the hit.)
  if (!agreement_.lockstep() && storage_->answers_held_pages_locally()) {
    std::vector<std::string> keys;
    keyer_->keys(tokens.first(usable), prior ? &*prior : nullptr, keys);
    const auto held = static_cast<std::size_t>(storage_->held_pages(keys)) * page;
    if (held == 0 ||
        static_cast<std::int64_t>(held) < storage_->config().prefetch_threshold_tokens) {
      ++events_.prefetches_absent;
      return false;
    }
    usable = held;
  }
  const auto want = static_cast<std::int64_t>(usable);
  const CostRule::Values costs = agreement_.costs(cost_.local());
  if (cost_.on()) {
    // Reading it from L3, after what the prefetches in flight have still to read on the same
    // link, would take longer than recomputing it. The counts are agreed state under TP.
    std::int64_t wait_tokens = 0;
    for (const auto& [id, q] : pending_.prefetches) {
      const std::int64_t done = agreement_.agreeing() ? q.agreed_pages * tree_.page_size()
                                                      : q.op->completed_tokens();
      wait_tokens += std::max<std::int64_t>(0, q.reserved - done);
    }
    const std::int64_t batch = std::max<std::int64_t>(1, storage_->batch_pages());
    const std::int64_t ops = 1 + (want / tree_.page_size() + batch - 1) / batch;  // query, reads
    // Until a read was measured (on every rank), the store's writes stand for its reads, and a
    // store that writes slower than it reads would never be read: one prefetch at a time goes
    // anyway, to measure (the cut bounds what it costs).
    const bool probe = !CostRule::l3_reads_measured(costs) && pending_.prefetches.empty();
    if (!probe && !cost_.moving_pays(CostRule::Move::kPrefetch, costs, want, 0, ops, wait_tokens,
                                     static_cast<std::int64_t>(pending_.prefetches.size()))) {
      ++events_.prefetches_refused_by_cost;
      events_.miss_prefetch_refused_tokens += usable;
      return false;
    }
  }
  // Room in the queue and in the prefetch budget, by the prefetches in flight (the queue holds
  // at most those) and the host tokens they reserved: the same counts on every TP rank.
  if (pending_.prefetches.size() >= storage_->prefetch_queue_capacity() ||
      reserved_tokens_ + want > storage_->config().prefetch_budget_tokens) {
    ++events_.prefetches_rate_limited;
    return false;
  }
  cache_.lock(node);  // before making room: the prefix it continues must stay
  // Host pages for what it may fetch, reserved here as SGLang does (the pages past the hit are
  // freed when it ends): host memory changes hands only on this thread, at calls every rank
  // makes, so host_room() stays the same on every rank. Without room, host-only pages make it.
  if (const std::int64_t room = cache_.host_room(); room < want) cache_.evict_host(want - room);
  std::optional<std::vector<std::int64_t>> slots;
  if (cache_.host_room() >= want) slots = host_pool_.alloc(want);
  // Each sidecar pool's pages for what it may restore, room made as for a write.
  std::vector<std::int64_t> side_pages, side_counted;
  std::vector<SidecarPagesIo> side;
  for (std::size_t i = 0; i < storage_->num_sidecars(); ++i) {
    side_pages.push_back(storage_->sidecar_reserve_pages(static_cast<std::int32_t>(i),
                                                         want / tree_.page_size()));
  }
  if (slots && !side_pages.empty() &&
      !cache_.reserve_prefetch_sidecars(side_pages, side, side_counted)) {
    host_pool_.free(*slots);
    slots.reset();
  }
  std::shared_ptr<PrefetchOperation> op;
  if (slots) op = storage_->prefetch_into(request_id, tokens.first(usable), prior, *slots, side);
  if (!op) {  // the host is short, or the controller stopped
    if (slots) {
      host_pool_.free(*slots);
      release_sidecars(side, side_counted);
    } else {
      ++events_.prefetches_host_full;
    }
    cache_.unlock(node);
    return false;
  }
  ++events_.prefetches_issued;
  reserved_tokens_ += want;
  PendingOps::Prefetch& p = pending_.prefetches[request_id] = PendingOps::Prefetch{
      std::move(op), node,
      std::vector<std::int32_t>(tokens.begin(),
                                tokens.begin() + static_cast<std::ptrdiff_t>(usable)),
      node == root ? std::string(identity) : std::string(), want, std::move(side_counted)};
  // Past this, waiting for the rest costs more than recomputing the tokens would have.
  if (const auto recompute = CostRule::recompute_seconds(costs, want); cost_.on() && recompute) {
    p.cut_at = std::chrono::steady_clock::now() +
               std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                   std::chrono::duration<double>(*recompute));
  }
  return true;
}

void L3Paths::release_uncounted(std::span<const std::int64_t> counted,
                                std::span<const SidecarPagesIo> kept) {
  for (std::size_t i = 0; i < counted.size(); ++i) {
    std::int64_t slots = 0;
    for (const SidecarPagesIo& io : kept) {
      if (static_cast<std::size_t>(io.pool) == i) slots += static_cast<std::int64_t>(io.host_slots.size());
    }
    cache_.sidecar_hosts_released(static_cast<std::int32_t>(i), counted[i] - slots);
  }
}

void L3Paths::release_sidecars(std::span<const SidecarPagesIo> held,
                               std::span<const std::int64_t> counted) {
  // Of each pool's count, what `held` holds is released by the free below.
  release_uncounted(counted, held);
  cache_.free_sidecar_hosts(held);
}

bool L3Paths::check_progress(const std::string& request_id, std::int64_t* inserted_tokens) {
  if (inserted_tokens != nullptr) *inserted_tokens = 0;
  auto it = pending_.prefetches.find(request_id);
  if (it == pending_.prefetches.end()) {
    if (auto done = pending_.inserted.extract(request_id); !done.empty()) {
      if (inserted_tokens != nullptr) *inserted_tokens = done.mapped();
    }
    return true;
  }
  // Whether to terminate now depends on local timing: TP ranks go by what the last
  // check_events agreed (or one rank would terminate alone, a deadlock of the reference), and
  // keep the pages every rank had completed then.
  const PendingOps::Prefetch& p = it->second;
  std::optional<std::int64_t> pages;
  if (agreement_.agreeing()) {
    if (!p.agreed_ready) return false;
    pages = p.agreed_pages;
  } else if (!p.may_terminate(*storage_)) {
    return false;
  }
  finish_prefetch(request_id, false, pages ? *pages : p.op->completed_tokens() / tree_.page_size());
  if (inserted_tokens != nullptr) *inserted_tokens = pending_.inserted[request_id];
  pending_.inserted.erase(request_id);
  return true;
}

void L3Paths::release_aborted(const std::string& request_id) {
  if (pending_.prefetches.count(request_id) != 0) finish_prefetch(request_id, true, 0);
  pending_.inserted.erase(request_id);
}

void L3Paths::finish_prefetch(const std::string& request_id, bool aborted,
                              std::optional<std::int64_t> agreed_pages) {
  arrived_.revoked.erase(request_id);
  auto node_handle = pending_.prefetches.extract(request_id);
  PendingOps::Prefetch& p = node_handle.mapped();
  // Whether every page had landed, asked before terminate (which cuts a prefetch short).
  const bool landed = p.steps_since_landed >= 0 || p.op->io_done();
  const PrefetchResult r = storage_->terminate_prefetch(*p.op, agreed_pages);
  reserved_tokens_ -= p.reserved;
  // The sidecar slots it counted and did not keep are gone (terminate freed them, or this rank
  // never had them); those it kept count until a node takes or frees them.
  release_uncounted(p.sidecar_counted, r.sidecars);
  if (landed && !aborted && !r.revoked) {
    const std::int64_t here = std::max<std::int64_t>(0, p.steps_since_landed);
    if (!agreement_.agreeing()) {
      events_.prefetch_confirm_steps.observe(static_cast<double>(here));
    } else if (p.agreed_landed_steps >= 0) {
      // TP: the pages serve a request once every rank has them, so the I/O is done when the
      // last rank's landed; the steps this rank's waited before that are the ranks' skew.
      events_.prefetch_confirm_steps.observe(static_cast<double>(p.agreed_landed_steps));
      events_.prefetch_rank_wait_steps.observe(
          static_cast<double>(std::max<std::int64_t>(0, here - p.agreed_landed_steps)));
    }
  }
  if (r.revoked && !aborted) {
    ++events_.revoked_prefetches;
    events_.miss_revoked_tokens += p.tokens.size();
  }
  std::int64_t inserted = 0;
  if (!aborted && r.tokens > 0) {
    inserted = insert_host(p.node, std::span(p.tokens).first(static_cast<std::size_t>(r.tokens)),
                           r.host_slots, p.identity, r.sidecars);
    events_.prefetched_tokens += r.tokens;
  } else {
    if (!r.host_slots.empty()) host_pool_.free(r.host_slots);
    cache_.free_sidecar_hosts(r.sidecars);
  }
  // The agreed hit of a prefetch that was not revoked (the revoked one's the storage controller
  // counted): what the tree did not get of it, and why.
  if (const std::int64_t hit = p.op->hit_tokens(); !r.revoked && hit > 0) {
    if (aborted) {
      events_.unfulfilled_dropped_tokens += hit;
    } else {
      events_.unfulfilled_transfer_tokens += hit - r.tokens;
      events_.unfulfilled_shrunk_tokens += r.tokens - inserted;
    }
  }
  pending_.inserted[request_id] = inserted;
  cache_.unlock(p.node);
}

void L3Paths::finish_arrived_prefetches() {
  std::vector<std::string> finished;
  for (const auto& [id, p] : pending_.prefetches) {
    if (arrived_.revoked.count(id) != 0 || p.op->stage() == PrefetchStage::kFinished) {
      finished.push_back(id);
    }
  }
  std::sort(finished.begin(), finished.end());
  for (const std::string& id : finished) {
    // Finished prefetches become visible now, not when the scheduler next looks at them.
    const auto& op = *pending_.prefetches.at(id).op;
    finish_prefetch(id, false, op.completed_tokens() / tree_.page_size());
  }
  arrived_.revoked.clear();
}

std::int64_t L3Paths::insert_host(Node* node, std::span<const std::int32_t> tokens,
                                  std::span<const std::int64_t> host_slots,
                                  std::string_view identity,
                                  std::span<const SidecarPagesIo> fetched) {
  const std::int32_t page = tree_.page_size();
  std::vector<SidecarPagesIo> sidecars(fetched.begin(), fetched.end());  // what no node took yet
  std::size_t pos = 0;
  while (pos < tokens.size()) {
    Node* child = tree_.child_of(node, tokens.subspan(pos, page), identity);
    if (child == nullptr) {
      Node* l = cache_.add_node(node, tokens.subspan(pos), identity);
      l->host.assign(host_slots.begin() + static_cast<std::ptrdiff_t>(pos), host_slots.end());
      l->stored_pages = static_cast<std::int64_t>(l->key().size()) / page;  // came from L3
      // Its sidecar pages come with it; the rest go back.
      cache_.adopt_sidecar_hosts(l, sidecars, static_cast<std::int64_t>(pos) / page);
      cache_.free_sidecar_hosts(sidecars);
      cache_.refresh(l);
      return static_cast<std::int64_t>(tokens.size() - pos);
    }
    const std::size_t common = tree_.common_tokens(child, tokens.subspan(pos));
    if (common < child->key().size()) child = cache_.split_node(child, common);
    // Cached already (another request got there first): the fetched KV is not needed. A
    // host-only node with no op in flight takes the fetched sidecar pages it lacks (a prefetch
    // brings a trailing pool's window only, so a node split off one may lack a window).
    host_pool_.free(host_slots.subspan(pos, common));
    if (!sidecars.empty() && child->device.empty() && child->write_op == 0 &&
        child->load_op == 0) {
      cache_.adopt_sidecar_hosts(child, sidecars, static_cast<std::int64_t>(pos) / page);
      cache_.refresh(child);
    }
    tree_.touch(child);
    pos += common;
    node = child;
  }
  cache_.free_sidecar_hosts(sidecars);
  return 0;
}

void L3Paths::drain_acks() {
  if (storage_ == nullptr) return;
  // A step begins (check_events): count it for every prefetch whose pages wait in host memory.
  for (auto& [id, p] : pending_.prefetches) {
    if (p.steps_since_landed >= 0) {
      ++p.steps_since_landed;
    } else if (p.op->io_done()) {
      p.steps_since_landed = 1;
    }
  }
  backup_acks_.clear();
  storage_->drain_backup_acks(backup_acks_);
  for (const BackupAck& a : backup_acks_) arrived_.backups[a.id] = a.completed_tokens + 1;
  revoked_.clear();
  storage_->drain_revokes(revoked_);
  for (std::string& id : revoked_) arrived_.revoked.insert(std::move(id));
}

void L3Paths::cut_late_prefetches() {
  if (storage_ == nullptr) return;
  const auto now = std::chrono::steady_clock::now();
  for (auto& [id, p] : pending_.prefetches) {
    if (p.cut || !p.cut_at || now < *p.cut_at || p.op->io_done()) continue;
    const PrefetchStage stage = p.op->stage();
    if (stage != PrefetchStage::kQueued && stage != PrefetchStage::kLoading) continue;
    storage_->cut_prefetch(*p.op);
    p.cut = true;
    ++events_.prefetches_cut;
  }
}

std::optional<std::chrono::steady_clock::time_point> L3Paths::next_deadline(
    std::optional<std::chrono::steady_clock::time_point> until) const {
  if (storage_ == nullptr) return until;
  auto earliest = [&](std::chrono::steady_clock::time_point d) {
    until = until ? std::min(*until, d) : d;
  };
  for (const auto& [id, p] : pending_.prefetches) {
    if (const auto d = storage_->terminate_deadline(*p.op)) earliest(*d);
    if (p.cut_at && !p.cut) earliest(*p.cut_at);
  }
  return until;
}

void L3Paths::detach() {
  if (storage_ == nullptr) return;
  touched_.clear();
  if (agreement_.agreeing()) {
    storage_->stop_when_idle();
  } else {
    storage_->stop();
  }
  // Every op ended; each backup's ack is queued. Applied here, on each rank alone: what they
  // differ in (the pages completed) is forgotten below with everything known to be in L3.
  backup_acks_.clear();
  storage_->drain_backup_acks(backup_acks_);
  std::vector<NodeId> backups;
  for (const auto& [id, op] : pending_.backups) backups.push_back(id);
  std::sort(backups.begin(), backups.end());
  for (NodeId id : backups) apply_backup_ack(id, 1, 1);  // released, nothing stored
  arrived_.backups.clear();
  revoked_.clear();
  storage_->drain_revokes(revoked_);
  // Prefetches end in the same order on every rank: terminate_prefetch agrees on each one's
  // completed pages, which are inserted (the rest freed).
  std::vector<std::string> prefetches;
  for (const auto& [id, p] : pending_.prefetches) prefetches.push_back(id);
  std::sort(prefetches.begin(), prefetches.end());
  for (const std::string& id : prefetches) {
    // The ranks agree on each one's completed pages here (the pages may differ by rank now
    // that every op ended, and no step's reduction saw the last of them).
    std::optional<std::int64_t> pages;
    if (!agreement_.agreeing()) {
      pages = pending_.prefetches.at(id).op->completed_tokens() / tree_.page_size();
    }
    finish_prefetch(id, false, pages);
  }
  arrived_.revoked.clear();
  storage_ = nullptr;
  keyer_.reset();
  forget_stored_pages();
}

void L3Paths::forget_stored_pages() {
  for (const auto& [id, op] : pending_.backups) pending_.forgotten_backups.insert(id);
  tree_.for_each_node([this](Node* n) {
    if (n->stored_pages == 0) return;
    n->stored_pages = 0;
    cache_.refresh(n);
  });
}

}  // namespace hicache::radix
