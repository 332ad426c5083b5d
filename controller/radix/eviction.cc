#include "controller/radix/eviction.h"

#include <iterator>

namespace hicache {

EvictionPolicy parse_eviction_policy(std::string_view name) {
  if (name == "lru") return EvictionPolicy::kLru;
  if (name == "lfu") return EvictionPolicy::kLfu;
  throw InvalidArgument(str_cat("unknown eviction policy '", name, "' (valid: lru, lfu)"));
}

std::string_view to_string(EvictionPolicy policy) {
  return policy == EvictionPolicy::kLfu ? "lfu" : "lru";
}

namespace radix {

std::uint64_t eviction_mark(const Node& node, Tier tier, std::int64_t kv_bytes_per_token) {
  if (node.sidecar_bytes <= 0 || kv_bytes_per_token <= 0) return node.last_access;
  const std::uint64_t f = node.access_frontier[static_cast<std::size_t>(tier)];
  if (f >= node.last_access) return node.last_access;  // no turnover to weigh yet
  __extension__ typedef unsigned __int128 Wide;  // marks times bytes: no overflow
  const auto kv = static_cast<Wide>(node.key_size) * static_cast<Wide>(kv_bytes_per_token);
  const Wide footprint = kv + static_cast<Wide>(node.sidecar_bytes);
  return f + static_cast<std::uint64_t>(static_cast<Wide>(node.last_access - f) * kv / footprint);
}

namespace {

class LruOrder final : public EvictionOrder {
 public:
  explicit LruOrder(std::int64_t kv_bytes_per_token) : kv_(kv_bytes_per_token) {}
  EvictKey key(const Node& node, Tier tier) const override {
    return {0, eviction_mark(node, tier, kv_), node.id};
  }

 private:
  std::int64_t kv_;
};

class LfuOrder final : public EvictionOrder {
 public:
  explicit LfuOrder(std::int64_t kv_bytes_per_token) : kv_(kv_bytes_per_token) {}
  EvictKey key(const Node& node, Tier tier) const override {
    return {node.hits, eviction_mark(node, tier, kv_), node.id};
  }

 private:
  std::int64_t kv_;
};

bool free_to_go(const Node& n) { return n.lock == 0 && n.write_op == 0 && n.load_op == 0; }

}  // namespace

std::unique_ptr<EvictionOrder> EvictionOrder::make(EvictionPolicy policy,
                                                   std::int64_t kv_bytes_per_token) {
  if (policy == EvictionPolicy::kLfu) return std::make_unique<LfuOrder>(kv_bytes_per_token);
  return std::make_unique<LruOrder>(kv_bytes_per_token);
}

EvictionIndex::EvictionIndex(EvictionPolicy policy, std::int32_t page_size,
                             std::int64_t kv_bytes_per_token)
    : order_(EvictionOrder::make(policy, kv_bytes_per_token)), page_size_(page_size) {}

void EvictionIndex::clear() {
  device_.clear();
  host_.clear();
  totals_ = Totals{};
}

void EvictionIndex::add(const Node::Indexed& x, std::int64_t sign) {
  totals_.nodes += sign * (x.counted ? 1 : 0);
  totals_.device_tokens += sign * x.device_tokens;
  totals_.evictable_device_tokens += sign * x.evictable_device_tokens;
  totals_.host_tokens += sign * x.host_tokens;
  totals_.stored_tokens += sign * x.stored_tokens;
  totals_.writing += sign * (x.writing ? 1 : 0);
  totals_.loading += sign * (x.loading ? 1 : 0);
  totals_.backing_up += sign * (x.backing_up ? 1 : 0);
}

// A touched node goes last under LRU: its insertion at the end, like the erase by iterator, is
// amortized O(1).
void EvictionIndex::move(EvictIndex& index, std::optional<EvictIndex::iterator>& at,
                         const std::optional<EvictKey>& key, Node* node) {
  if (at && key && (*at)->first == *key) return;
  if (at) index.erase(*at);
  at.reset();
  if (!key) return;
  const bool last = index.empty() || std::prev(index.end())->first < *key;
  at = last ? index.emplace_hint(index.end(), *key, node) : index.emplace(*key, node).first;
}

Node* EvictionIndex::next_victim(Tier tier) {
  const bool device = tier == Tier::kDevice;
  EvictIndex& index = device ? device_ : host_;
  while (!index.empty()) {
    auto first = index.begin();
    Node* n = first->second;
    const EvictKey now = order_->key(*n, tier);
    if (first->first == now) return n;  // every other key is older yet, and so is the node's
    auto& at = device ? n->indexed.device_at : n->indexed.host_at;
    index.erase(first);
    at = index.emplace(now, n).first;
  }
  return nullptr;
}

void EvictionIndex::refresh(Node* node) {
  if (node->parent == nullptr) return;  // the root holds no KV, never evicted
  const bool go = free_to_go(*node);
  Node::Indexed now;
  now.counted = true;
  now.on_device = !node->device.empty();
  now.device_tokens = static_cast<std::int64_t>(node->device.size());
  now.evictable_device_tokens = go ? now.device_tokens : 0;
  now.host_tokens = static_cast<std::int64_t>(node->host.size());
  now.stored_tokens = node->stored_pages * page_size_;
  now.writing = node->write_op != 0;
  now.loading = node->load_op != 0;
  now.backing_up = node->backup_op != 0;
  std::optional<EvictKey> device_key, host_key;
  if (go && now.on_device && node->device_children == 0 && !node->passed_over) {
    device_key = order_->key(*node, Tier::kDevice);
  }
  // A host copy a backup reads stays until the backup's ack.
  if (go && !now.backing_up && !now.on_device && !node->host.empty() && node->children.empty()) {
    host_key = order_->key(*node, Tier::kHost);
  }
  Node::Indexed& was = node->indexed;
  add(was, -1);
  add(now, 1);
  now.device_at = was.device_at;
  now.host_at = was.host_at;
  move(device_, now.device_at, device_key, node);
  move(host_, now.host_at, host_key, node);
  const bool device_changed = was.on_device != now.on_device;
  was = now;
  if (device_changed) {
    node->parent->device_children += now.on_device ? 1 : -1;
    refresh(node->parent);  // it may have become (or stopped being) a device candidate
  }
}

void EvictionIndex::forget(Node* node) {
  Node::Indexed& was = node->indexed;
  add(was, -1);
  move(device_, was.device_at, std::nullopt, node);
  move(host_, was.host_at, std::nullopt, node);
  const bool was_on_device = was.on_device;
  was = Node::Indexed{};
  if (was_on_device) {
    --node->parent->device_children;
    refresh(node->parent);
  }
}

std::string EvictionIndex::check(const Tree& tree) const {
  std::string problem;
  Totals sum;
  std::int64_t device_candidates = 0, host_candidates = 0;
  tree.for_each_node([&](const Node* n) {
    if (!problem.empty()) return;
    std::int64_t on_device_children = 0;
    n->children.for_each([&](const Node* c) { on_device_children += c->device.empty() ? 0 : 1; });
    const bool go = free_to_go(*n);
    const bool device_candidate = go && !n->device.empty() && on_device_children == 0;
    const bool host_candidate = go && n->backup_op == 0 && n->device.empty() && !n->host.empty() &&
                                n->children.empty();
    // An entry's key may be older than the node's (touch is lazy), never newer.
    auto indexed = [&](const std::optional<EvictIndex::iterator>& at, Tier tier) {
      return at && (*at)->second == n && (*at)->first <= order_->key(*n, tier);
    };
    ++sum.nodes;
    sum.device_tokens += static_cast<std::int64_t>(n->device.size());
    sum.host_tokens += static_cast<std::int64_t>(n->host.size());
    sum.stored_tokens += n->stored_pages * page_size_;
    sum.writing += n->write_op != 0 ? 1 : 0;
    sum.loading += n->load_op != 0 ? 1 : 0;
    sum.backing_up += n->backup_op != 0 ? 1 : 0;
    if (go) sum.evictable_device_tokens += static_cast<std::int64_t>(n->device.size());
    device_candidates += device_candidate ? 1 : 0;
    host_candidates += host_candidate ? 1 : 0;
    if (n->device_children != on_device_children) {
      problem = str_cat("node ", n->id, ": counts ", n->device_children,
                        " children on the device, has ", on_device_children);
    } else if (indexed(n->indexed.device_at, Tier::kDevice) != device_candidate) {
      problem = str_cat("node ", n->id, device_candidate ? ": missing from" : ": stale in",
                        " the device eviction index");
    } else if (indexed(n->indexed.host_at, Tier::kHost) != host_candidate) {
      problem = str_cat("node ", n->id, host_candidate ? ": missing from" : ": stale in",
                        " the host eviction index");
    }
  });
  if (!problem.empty()) return problem;
  if (static_cast<std::int64_t>(device_.size()) != device_candidates ||
      static_cast<std::int64_t>(host_.size()) != host_candidates) {
    return str_cat("eviction indexes hold ", device_.size(), " device and ", host_.size(),
                   " host entries for ", device_candidates, " and ", host_candidates,
                   " candidates");
  }
  const Totals& t = totals_;
  if (t.nodes != sum.nodes || t.device_tokens != sum.device_tokens ||
      t.host_tokens != sum.host_tokens || t.stored_tokens != sum.stored_tokens ||
      t.writing != sum.writing || t.loading != sum.loading || t.backing_up != sum.backing_up ||
      t.evictable_device_tokens != sum.evictable_device_tokens) {
    return str_cat(
        "running totals (nodes ", t.nodes, ", device ", t.device_tokens, ", host ", t.host_tokens,
        ", stored ", t.stored_tokens, ", ops ", t.writing + t.loading + t.backing_up,
        ", evictable ", t.evictable_device_tokens, ") differ from the tree's (", sum.nodes, ", ",
        sum.device_tokens, ", ", sum.host_tokens, ", ", sum.stored_tokens, ", ",
        sum.writing + sum.loading + sum.backing_up, ", ", sum.evictable_device_tokens, ")");
  }
  return problem;
}

}  // namespace radix
}  // namespace hicache
