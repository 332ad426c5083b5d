#include "controller/radix/tier_events.h"

#include "controller/radix/tree.h"

namespace hicache::radix {

TierEvents::TierEvents(KvEventPublisher& publisher, const Tree& tree, std::int32_t page_size)
    : publisher_(publisher), tree_(tree), page_size_(page_size) {}

namespace {

std::vector<std::int64_t> block_hashes(const Node* node, std::int64_t from, std::int64_t to) {
  std::vector<std::int64_t> out;
  out.reserve(static_cast<std::size_t>(to - from));
  for (std::int64_t p = from; p < to; ++p) {
    out.push_back(kv_block_hash(node->digests[static_cast<std::size_t>(p)]));
  }
  return out;
}

}  // namespace

const std::string& TierEvents::identity_of(const Node* node) const {
  while (node->parent != nullptr && node->parent != tree_.root()) node = node->parent;
  return node->identity;
}

std::int64_t TierEvents::parent_hash(const Node* node) const {
  return kv_block_hash(node->parent->digests.back());
}

void TierEvents::leaving(Node* node) {
  const auto pages = static_cast<std::int64_t>(node->digests.size());
  if (node->announced.device) {
    queued_.emplace_back(KvBlockRemoved{block_hashes(node, 0, pages), KvMedium::kGpu});
  }
  if (node->announced.host) {
    queued_.emplace_back(KvBlockRemoved{block_hashes(node, 0, pages), KvMedium::kCpuPinned});
  }
  node->announced = {};
}

void TierEvents::observe(Node* node) {
  if (node == tree_.root()) return;
  const auto pages = static_cast<std::int64_t>(node->key().size()) / page_size_;
  if (static_cast<std::int64_t>(node->digests.size()) != pages) {
    throw StateError(str_cat("kv events: node ", node->id, " has ", node->digests.size(),
                             " page digests for ", pages, " pages"));
  }
  const bool device = !node->device.empty() && node->load_op == 0;
  const bool host = !node->host.empty() && node->write_op == 0;
  const auto announce = [&](bool now, bool& was, KvMedium medium) {
    if (now == was) return;
    was = now;
    if (!now) {
      queued_.emplace_back(KvBlockRemoved{block_hashes(node, 0, pages), medium});
      return;
    }
    KvBlockStored e{.block_hashes = block_hashes(node, 0, pages),
                    .token_ids = {node->key().begin(), node->key().end()},
                    .block_size = page_size_,
                    .identity = identity_of(node),
                    .medium = medium};
    const bool top = node->parent == tree_.root();
    if (!top) e.parent_block_hash = parent_hash(node);
    queued_.emplace_back(std::move(e));
  };
  announce(device, node->announced.device, KvMedium::kGpu);
  announce(host, node->announced.host, KvMedium::kCpuPinned);
}

void TierEvents::l3_stored(const Node* node, std::int64_t from, std::int64_t to,
                           std::uint64_t queued_at) {
  if (from >= to) return;
  KvMedium medium;
  std::vector<std::int64_t> hashes = block_hashes(node, from, to);
  {
    MutexLock lock(l3_mu_);
    if (!l3_on_) return;
    medium = l3_medium_;
    // A page the store removed after the backup was queued may be gone already (its removal
    // was published): the announcement stops before it, never says more than the store holds.
    for (std::size_t i = 0; i < hashes.size(); ++i) {
      const auto it = l3_removed_at_.find(hashes[i]);
      if (it != l3_removed_at_.end() && it->second > queued_at) {
        hashes.resize(i);
        to = from + static_cast<std::int64_t>(i);
        break;
      }
    }
    l3_announced_.insert(hashes.begin(), hashes.end());
  }
  if (hashes.empty()) return;
  KvBlockStored e{.block_hashes = std::move(hashes),
                  .token_ids = {node->key().begin() + from * page_size_,
                                node->key().begin() + to * page_size_},
                  .block_size = page_size_,
                  .identity = identity_of(node),
                  .medium = medium};
  if (from > 0) {
    e.parent_block_hash = kv_block_hash(node->digests[static_cast<std::size_t>(from - 1)]);
  } else if (node->parent != tree_.root()) {
    e.parent_block_hash = parent_hash(node);
  }
  queued_.emplace_back(std::move(e));
}

void TierEvents::l3_removed(std::span<const std::string> keys) {
  KvBlockRemoved e;
  {
    MutexLock lock(l3_mu_);
    if (!l3_on_) return;
    ++l3_clock_;
    for (const std::string& key : keys) {
      if (key.size() <= l3_prefix_.size() || key.compare(0, l3_prefix_.size(), l3_prefix_) != 0 ||
          key[l3_prefix_.size()] != '-') {
        continue;
      }
      const std::optional<std::int64_t> h = kv_block_hash_of_key(key);
      if (!h) continue;
      l3_removed_at_[*h] = l3_clock_;
      if (l3_announced_.erase(*h) != 0) e.block_hashes.push_back(*h);
    }
    e.medium = l3_medium_;
  }
  if (e.block_hashes.empty()) return;
  std::vector<KvEvent> batch;
  batch.emplace_back(std::move(e));
  publisher_.publish(std::move(batch));
}

void TierEvents::attach_l3(std::string prefix, KvMedium medium) {
  MutexLock lock(l3_mu_);
  l3_prefix_ = std::move(prefix);
  l3_medium_ = medium;
  l3_on_ = true;
}

void TierEvents::detach_l3() {
  l3_cleared();
  MutexLock lock(l3_mu_);
  l3_on_ = false;
}

void TierEvents::l3_cleared() {
  KvBlockRemoved e;
  {
    MutexLock lock(l3_mu_);
    if (!l3_on_) return;
    e.block_hashes.assign(l3_announced_.begin(), l3_announced_.end());
    e.medium = l3_medium_;
    l3_announced_.clear();
    l3_removed_at_.clear();
  }
  if (!e.block_hashes.empty()) queued_.emplace_back(std::move(e));
}

void TierEvents::l3_forget_removals() {
  MutexLock lock(l3_mu_);
  l3_removed_at_.clear();
}

std::uint64_t TierEvents::l3_clock() const {
  MutexLock lock(l3_mu_);
  return l3_clock_;
}

void TierEvents::tree_dropped() {
  std::vector<std::int64_t> device, host;
  tree_.for_each_node([&](Node* n) {
    if (n == tree_.root()) return;
    for (const auto& [was, into] : {std::pair{&n->announced.device, &device},
                                    std::pair{&n->announced.host, &host}}) {
      if (!*was) continue;
      *was = false;
      for (const PageDigest& d : n->digests) into->push_back(kv_block_hash(d));
    }
  });
  if (!device.empty()) queued_.emplace_back(KvBlockRemoved{std::move(device), KvMedium::kGpu});
  if (!host.empty()) queued_.emplace_back(KvBlockRemoved{std::move(host), KvMedium::kCpuPinned});
}

void TierEvents::publish() {
  if (queued_.empty()) return;
  publisher_.publish(std::move(queued_));
  queued_.clear();
}

}  // namespace hicache::radix
