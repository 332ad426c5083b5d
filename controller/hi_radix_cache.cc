#include "controller/hi_radix_cache.h"

#include <algorithm>
#include <functional>
#include <queue>
#include <unordered_map>

#include "transfer/errors.h"

namespace hicache {

struct HiRadixCache::Node {
  NodeId id = 0;
  Node* parent = nullptr;
  std::vector<std::int32_t> key;     // whole pages
  std::vector<std::int64_t> device;  // empty: not on the device
  std::vector<std::int64_t> host;    // empty: not on the host
  std::unordered_map<std::string, std::unique_ptr<Node>> children;  // by first page's bytes
  std::int64_t lock = 0;
  std::uint64_t last_access = 0;
  std::int64_t hits = 0;
  NodeId write_op = 0;  // in flight, 0: none
  NodeId load_op = 0;
  bool evict_after_write = false;  // write_back: free the device copy on the ack
};

// Ops in flight: the node that holds the op's lock, and every node the op covers (a split adds
// the new upper part).
struct HiRadixCache::Pending {
  struct Op {
    Node* holder = nullptr;
    std::vector<Node*> nodes;
  };
  std::unordered_map<NodeId, Op> writes, loads;

  // Removes and returns the op an ack names (nothing for an op this cache did not start).
  static std::optional<Op> take(std::unordered_map<NodeId, Op>& ops, NodeId id) {
    auto it = ops.find(id);
    if (it == ops.end()) return std::nullopt;
    Op op = std::move(it->second);
    ops.erase(it);
    return op;
  }
};

namespace {

std::string page_key(std::span<const std::int32_t> page) {
  return std::string(reinterpret_cast<const char*>(page.data()), page.size_bytes());
}

template <typename T>
void append(std::vector<T>& to, const std::vector<T>& from) {
  to.insert(to.end(), from.begin(), from.end());
}

}  // namespace

HiRadixCache::HiRadixCache(HiCacheController& controller, DeviceKVPool& device_pool,
                           HostKVPool& host_pool, RadixCacheConfig config)
    : controller_(controller), device_pool_(device_pool), host_pool_(host_pool), config_(config),
      page_size_(device_pool.geometry().page_size), policy_(controller.config().write_policy),
      root_(std::make_unique<Node>()), pending_(std::make_unique<Pending>()) {
  if (host_pool.geometry().page_size != page_size_) {
    throw InvalidArgument(str_cat("radix cache: host page size ", host_pool.geometry().page_size,
                                  " differs from the device's ", page_size_));
  }
  if (config_.write_through_threshold < 1) {
    throw InvalidArgument(str_cat("radix cache: write_through_threshold ",
                                  config_.write_through_threshold, " < 1"));
  }
  if (config_.load_back_min_tokens < 0) {
    throw InvalidArgument(str_cat("radix cache: load_back_min_tokens ",
                                  config_.load_back_min_tokens, " < 0"));
  }
  config_.load_back_min_tokens = std::max<std::int64_t>(config_.load_back_min_tokens, page_size_);
  root_->lock = 1;  // never evicted
}

HiRadixCache::~HiRadixCache() = default;

HiRadixCache::Node* HiRadixCache::child_of(Node* node, std::span<const std::int32_t> page) const {
  auto it = node->children.find(page_key(page));
  return it == node->children.end() ? nullptr : it->second.get();
}

void HiRadixCache::touch(Node* node) { node->last_access = ++clock_; }

HiRadixCache::Node* HiRadixCache::split(Node* node, std::size_t tokens) {
  auto mid = std::make_unique<Node>();
  Node* m = mid.get();
  m->id = next_id_++;
  m->parent = node->parent;
  m->key.assign(node->key.begin(), node->key.begin() + static_cast<std::ptrdiff_t>(tokens));
  if (!node->device.empty()) {
    m->device.assign(node->device.begin(), node->device.begin() + static_cast<std::ptrdiff_t>(tokens));
    node->device.erase(node->device.begin(), node->device.begin() + static_cast<std::ptrdiff_t>(tokens));
  }
  if (!node->host.empty()) {
    m->host.assign(node->host.begin(), node->host.begin() + static_cast<std::ptrdiff_t>(tokens));
    node->host.erase(node->host.begin(), node->host.begin() + static_cast<std::ptrdiff_t>(tokens));
  }
  node->key.erase(node->key.begin(), node->key.begin() + static_cast<std::ptrdiff_t>(tokens));
  m->lock = node->lock;  // every lock at or below node passed through the whole old node
  m->last_access = node->last_access;
  m->hits = node->hits;
  m->write_op = node->write_op;
  m->load_op = node->load_op;
  m->evict_after_write = node->evict_after_write;
  if (node->write_op != 0) pending_->writes[node->write_op].nodes.push_back(m);
  if (node->load_op != 0) pending_->loads[node->load_op].nodes.push_back(m);
  Node* parent = node->parent;
  const std::string upper = page_key(std::span(m->key).first(page_size_));
  std::unique_ptr<Node> lower = std::move(parent->children[upper]);
  node->parent = m;
  m->children.emplace(page_key(std::span(node->key).first(page_size_)), std::move(lower));
  parent->children[upper] = std::move(mid);
  return m;
}

HiRadixCache::MatchResult HiRadixCache::match_prefix(std::span<const std::int32_t> tokens) {
  MatchResult r;
  r.last_device_node = r.last_host_node = root_.get();
  const std::size_t usable = tokens.size() / page_size_ * page_size_;
  Node* node = root_.get();
  std::size_t pos = 0;
  bool device_run = true;
  std::vector<Node*> to_write;
  while (pos < usable) {
    Node* child = child_of(node, tokens.subspan(pos, page_size_));
    if (child == nullptr) break;
    std::size_t common = 0;
    const std::size_t limit = std::min(child->key.size(), usable - pos);
    while (common < limit &&
           std::equal(child->key.begin() + static_cast<std::ptrdiff_t>(common),
                      child->key.begin() + static_cast<std::ptrdiff_t>(common + page_size_),
                      tokens.begin() + static_cast<std::ptrdiff_t>(pos + common))) {
      common += page_size_;
    }
    if (common < child->key.size()) child = split(child, common);
    touch(child);
    ++child->hits;
    if (device_run && !child->device.empty()) {
      append(r.device_slots, child->device);
      r.last_device_node = child;
    } else {
      device_run = false;
      r.host_hit_tokens += static_cast<std::int64_t>(child->key.size());
    }
    r.last_host_node = child;
    if (policy_ == WritePolicy::kWriteThroughSelective &&
        child->hits >= config_.write_through_threshold) {
      to_write.push_back(child);
    }
    pos += common;
    node = child;
    if (common < child->key.size()) break;
  }
  for (Node* n : to_write) {
    if (n->host.empty() && !n->device.empty() && n->write_op == 0) write_node(n);
  }
  return r;
}

std::int64_t HiRadixCache::insert(std::span<const std::int32_t> tokens,
                                  std::span<const std::int64_t> device_slots) {
  if (tokens.size() % page_size_ != 0) {
    throw InvalidArgument(str_cat("insert: ", tokens.size(), " tokens is not a whole number of ",
                                  page_size_, "-token pages"));
  }
  if (device_slots.size() != tokens.size()) {
    throw InvalidArgument(str_cat("insert: ", device_slots.size(), " device slots for ",
                                  tokens.size(), " tokens"));
  }
  Node* node = root_.get();
  std::size_t pos = 0;
  std::int64_t duplicate = 0;
  while (pos < tokens.size()) {
    Node* child = child_of(node, tokens.subspan(pos, page_size_));
    if (child == nullptr) {
      auto leaf = std::make_unique<Node>();
      Node* l = leaf.get();
      l->id = next_id_++;
      l->parent = node;
      l->key.assign(tokens.begin() + static_cast<std::ptrdiff_t>(pos), tokens.end());
      l->device.assign(device_slots.begin() + static_cast<std::ptrdiff_t>(pos), device_slots.end());
      touch(l);
      node->children.emplace(page_key(tokens.subspan(pos, page_size_)), std::move(leaf));
      if (policy_ == WritePolicy::kWriteThrough) write_node(l);
      return duplicate;
    }
    std::size_t common = 0;
    const std::size_t limit = std::min(child->key.size(), tokens.size() - pos);
    while (common < limit &&
           std::equal(child->key.begin() + static_cast<std::ptrdiff_t>(common),
                      child->key.begin() + static_cast<std::ptrdiff_t>(common + page_size_),
                      tokens.begin() + static_cast<std::ptrdiff_t>(pos + common))) {
      common += page_size_;
    }
    if (common < child->key.size()) child = split(child, common);
    touch(child);
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
  for (Node* n = node; n != nullptr; n = n->parent) ++n->lock;
}

void HiRadixCache::unlock(Node* node) {
  for (Node* n = node; n != nullptr; n = n->parent) {
    if (n->lock <= (n == root_.get() ? 1 : 0)) {
      throw StateError(str_cat("unlock: node ", node->id, " is not locked"));
    }
  }
  for (Node* n = node; n != nullptr; n = n->parent) --n->lock;
}

void HiRadixCache::write_node(Node* node) {
  auto host = controller_.write(node->device, 0, node->id);
  if (!host) return;  // host full or queue full: the node stays device-only
  node->host = std::move(*host);
  node->write_op = node->id;
  lock(node);
  pending_->writes[node->id] = Pending::Op{node, {node}};
}

std::optional<std::vector<std::int64_t>> HiRadixCache::load_back(Node* node) {
  std::vector<Node*> path;
  for (Node* n = node; n != root_.get(); n = n->parent) path.push_back(n);
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
    const NodeId op = next_id_++;
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
                       device->begin() + static_cast<std::ptrdiff_t>(at + n->key.size()));
      at += n->key.size();
      n->load_op = op;
    }
    pending_->loads[op] = Pending::Op{node, missing};
    counters_.loaded_back_tokens += static_cast<std::int64_t>(host.size());
  }
  std::vector<std::int64_t> out;
  for (Node* n : path) {
    touch(n);
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
  }
  node->device.clear();
  counters_.evicted_device_tokens += n;
}

void HiRadixCache::remove_leaf(Node* node) {
  Node* parent = node->parent;
  parent->children.erase(page_key(std::span(node->key).first(page_size_)));
}

std::int64_t HiRadixCache::evict_device(std::int64_t tokens) {
  auto older = [](Node* a, Node* b) { return a->last_access > b->last_access; };
  std::priority_queue<Node*, std::vector<Node*>, decltype(older)> heap(older);
  auto candidate = [&](Node* n) {
    if (n == root_.get() || n->device.empty() || n->lock > 0 || n->write_op != 0 ||
        n->load_op != 0) {
      return false;
    }
    for (const auto& [k, c] : n->children) {
      if (!c->device.empty()) return false;
    }
    // Without a host copy the node can go only if nothing hangs below it (or write-back saves
    // it first).
    return !n->host.empty() || n->children.empty() || policy_ == WritePolicy::kWriteBack;
  };
  std::function<void(Node*)> walk = [&](Node* n) {
    if (candidate(n)) heap.push(n);
    for (auto& [k, c] : n->children) walk(c.get());
  };
  walk(root_.get());
  std::int64_t freed = 0, scheduled = 0;  // scheduled: write-back evictions freed on the ack
  while (freed + scheduled < tokens && !heap.empty()) {
    Node* n = heap.top();
    heap.pop();
    if (!candidate(n)) continue;
    Node* parent = n->parent;
    if (n->host.empty() && policy_ == WritePolicy::kWriteBack) {
      write_node(n);
      if (n->write_op != 0) {
        n->evict_after_write = true;
        scheduled += static_cast<std::int64_t>(n->device.size());
        continue;
      }
      if (!n->children.empty()) continue;  // host full and it holds a subtree: keep it
    }
    freed += static_cast<std::int64_t>(n->device.size());
    drop_device(n);
    if (n->host.empty()) remove_leaf(n);  // no KV anywhere: the node goes
    if (candidate(parent)) heap.push(parent);
  }
  return freed;
}

std::int64_t HiRadixCache::evict_host(std::int64_t tokens) {
  auto older = [](Node* a, Node* b) { return a->last_access > b->last_access; };
  std::priority_queue<Node*, std::vector<Node*>, decltype(older)> heap(older);
  auto candidate = [&](Node* n) {
    return n != root_.get() && !n->host.empty() && n->device.empty() && n->children.empty() &&
           n->lock == 0 && n->write_op == 0 && n->load_op == 0;
  };
  std::function<void(Node*)> walk = [&](Node* n) {
    if (candidate(n)) heap.push(n);
    for (auto& [k, c] : n->children) walk(c.get());
  };
  walk(root_.get());
  std::int64_t freed = 0;
  while (freed < tokens && !heap.empty()) {
    Node* n = heap.top();
    heap.pop();
    Node* parent = n->parent;
    controller_.evict_host(n->host);
    freed += static_cast<std::int64_t>(n->host.size());
    remove_leaf(n);
    if (candidate(parent)) heap.push(parent);
  }
  counters_.evicted_host_tokens += freed;
  return freed;
}

void HiRadixCache::check_events() {
  acks_.clear();
  controller_.drain_write_acks(acks_);
  for (const Ack& ack : acks_) {
    auto taken = pending_->take(pending_->writes, ack.node);
    if (!taken) continue;
    Pending::Op& op = *taken;
    for (Node* n : op.nodes) {
      n->write_op = 0;
      if (!ack.ok) {
        n->host.clear();  // the controller freed the host pages
        n->evict_after_write = false;
      }
    }
    if (!ack.ok) ++counters_.write_failures;
    unlock(op.holder);
    for (Node* n : op.nodes) {
      if (n->evict_after_write) {
        n->evict_after_write = false;
        if (n->lock == 0 && n->load_op == 0) drop_device(n);
      }
    }
  }
  acks_.clear();
  controller_.drain_load_acks(acks_);
  for (const Ack& ack : acks_) {
    auto taken = pending_->take(pending_->loads, ack.node);
    if (!taken) continue;
    Pending::Op& op = *taken;
    for (Node* n : op.nodes) {
      n->load_op = 0;
      if (!ack.ok) {  // the device slots hold garbage; the host copy is intact
        device_pool_.allocator().free(n->device);
        n->device.clear();
      }
    }
    if (!ack.ok) ++counters_.load_failures;
    unlock(op.holder);
  }
}

RadixCacheStats HiRadixCache::stats() const {
  RadixCacheStats s = counters_;
  std::function<void(const Node*)> walk = [&](const Node* n) {
    if (n != root_.get()) {
      ++s.nodes;
      s.device_tokens += static_cast<std::int64_t>(n->device.size());
      s.host_tokens += static_cast<std::int64_t>(n->host.size());
      s.writes_in_flight += n->write_op != 0;
      s.loads_in_flight += n->load_op != 0;
    }
    for (const auto& [k, c] : n->children) walk(c.get());
  };
  walk(root_.get());
  return s;
}

std::string HiRadixCache::check_invariants() const {
  std::string problem;
  std::function<void(const Node*)> walk = [&](const Node* n) {
    if (!problem.empty()) return;
    if (n != root_.get()) {
      const std::size_t len = n->key.size();
      if (len == 0 || len % page_size_ != 0) problem = str_cat("node ", n->id, ": key of ", len);
      else if (n->device.empty() && n->host.empty()) problem = str_cat("node ", n->id, ": no KV");
      else if (!n->device.empty() && n->device.size() != len)
        problem = str_cat("node ", n->id, ": ", n->device.size(), " device slots for ", len);
      else if (!n->host.empty() && n->host.size() != len)
        problem = str_cat("node ", n->id, ": ", n->host.size(), " host slots for ", len);
      else if (n->lock < 0) problem = str_cat("node ", n->id, ": lock ", n->lock);
      std::int64_t child_locks = 0;
      for (const auto& [k, c] : n->children) child_locks += c->lock;
      if (problem.empty() && n->lock < child_locks) {
        problem = str_cat("node ", n->id, ": lock ", n->lock, " below its children's ", child_locks);
      }
    }
    for (const auto& [k, c] : n->children) {
      if (c->parent != n) problem = str_cat("node ", c->id, ": wrong parent");
      walk(c.get());
    }
  };
  walk(root_.get());
  return problem;
}

}  // namespace hicache
