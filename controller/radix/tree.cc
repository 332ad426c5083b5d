#include "controller/radix/tree.h"

#include <xxhash.h>

#include <algorithm>
#include <utility>

namespace hicache::radix {

namespace {

// The hash of an edge in its parent's map: its first page, and under the root the cache
// identity too (the page hashed with the identity's hash as the seed).
std::uint64_t edge_hash(bool at_root, std::string_view identity,
                        std::span<const std::int32_t> page) {
  const XXH64_hash_t seed =
      at_root && !identity.empty() ? XXH3_64bits(identity.data(), identity.size()) : 0;
  return XXH3_64bits_withSeed(page.data(), page.size_bytes(), seed);
}

// The order of an edge among its siblings: its first page's bytes, and under the root its cache
// identity before them (length first, so an identity and a page never pose as another pair).
std::string edge_order_key(bool at_root, std::string_view identity,
                           std::span<const std::int32_t> page) {
  const auto* bytes = reinterpret_cast<const char*>(page.data());
  if (!at_root || identity.empty()) return std::string(bytes, page.size_bytes());
  const auto n = static_cast<std::uint32_t>(identity.size());
  std::string key(reinterpret_cast<const char*>(&n), sizeof n);
  key += identity;
  key.append(bytes, page.size_bytes());
  return key;
}

}  // namespace

Tree::Tree(std::int32_t page_size, std::int32_t edge_hash_bits)
    : page_size_(page_size), edge_hash_bits_(edge_hash_bits) {
  clear();
}

void Tree::clear() {
  root_ = Node::make({});
  root_->lock = 1;  // never evicted
}

std::uint64_t Tree::edge_of(const Node* parent, std::string_view identity,
                            std::span<const std::int32_t> page) const {
  const std::uint64_t h = edge_hash(parent == root_.get(), identity, page);
  return edge_hash_bits_ >= 64 ? h : h & ((std::uint64_t{1} << edge_hash_bits_) - 1);
}

Node* Tree::child_of(const Node* node, std::span<const std::int32_t> page,
                     std::string_view identity) const {
  const bool at_root = node == root_.get();
  return node->children.find(edge_of(node, identity, page), [&](const Node& c) {
    return (!at_root || c.identity == identity) &&
           std::equal(page.begin(), page.end(), c.key().begin());
  });
}

std::size_t Tree::common_tokens(const Node* child, std::span<const std::int32_t> tokens) const {
  std::size_t common = 0;
  const std::span<const std::int32_t> key = child->key();
  const std::size_t limit = std::min(key.size(), tokens.size() / page_size_ * page_size_);
  while (common < limit &&
         std::equal(key.begin() + static_cast<std::ptrdiff_t>(common),
                    key.begin() + static_cast<std::ptrdiff_t>(common + page_size_),
                    tokens.begin() + static_cast<std::ptrdiff_t>(common))) {
    common += page_size_;
  }
  return common;
}

std::size_t Tree::prefix_tokens(std::span<const std::int32_t> tokens,
                                std::string_view identity) const {
  const Node* node = root_.get();
  std::size_t pos = 0;
  while (pos + page_size_ <= tokens.size()) {
    const Node* child = child_of(node, tokens.subspan(pos, page_size_), identity);
    if (child == nullptr) break;
    const std::size_t common = common_tokens(child, tokens.subspan(pos));
    pos += common;
    if (common < child->key().size()) break;
    node = child;
  }
  return pos;
}

Node* Tree::add_leaf(Node* parent, std::span<const std::int32_t> key, std::string_view identity) {
  auto leaf = Node::make(key);
  Node* l = leaf.get();
  l->id = next_id();
  l->parent = parent;
  if (parent == root_.get()) l->identity = identity;
  parent->children.add(edge_of(parent, l->identity, key.first(page_size_)), std::move(leaf));
  touch(l);
  return l;
}

Node* Tree::split(Node* node, std::size_t tokens) {
  auto upper = Node::make(node->key().first(tokens));
  Node* m = upper.get();
  m->id = next_id();
  m->parent = node->parent;
  node->drop_key_front(tokens);
  m->lock = node->lock;  // every lock at or below node passed through the whole old node
  m->last_access = node->last_access;
  m->access_frontier = node->access_frontier;
  m->hits = node->hits;
  m->identity = node->identity;
  Node* parent = node->parent;
  // The upper half takes the node's place (the same first page), the node goes under it.
  std::unique_ptr<Node> lower = parent->children.take(
      edge_of(parent, m->identity, m->key().first(page_size_)), node, std::move(upper));
  node->parent = m;
  m->children.add(edge_of(m, {}, node->key().first(page_size_)), std::move(lower));
  return m;
}

void Tree::remove_leaf(Node* node) {
  Node* parent = node->parent;
  parent->children.take(edge_of(parent, node->identity, node->key().first(page_size_)),
                        node);  // freed here
}

std::vector<const Node*> Tree::ordered_children(const Node* node) const {
  std::vector<std::pair<std::string, const Node*>> keyed;
  keyed.reserve(node->children.size());
  node->children.for_each([&](const Node* c) {
    keyed.emplace_back(edge_order_key(node == root_.get(), c->identity, c->key().first(page_size_)),
                       c);
  });
  std::sort(keyed.begin(), keyed.end());
  std::vector<const Node*> out;
  out.reserve(keyed.size());
  for (const auto& [k, c] : keyed) out.push_back(c);
  return out;
}

std::string Tree::check_node(const Node* n) const {
  if (n != root_.get()) {
    const std::size_t len = n->key().size();
    if (len == 0 || len % page_size_ != 0) return str_cat("node ", n->id, ": key of ", len);
    if (n->lock < 0) return str_cat("node ", n->id, ": lock ", n->lock);
    std::int64_t child_locks = 0;
    n->children.for_each([&](const Node* c) { child_locks += c->lock; });
    if (n->lock < child_locks) {
      return str_cat("node ", n->id, ": lock ", n->lock, " below its children's ", child_locks);
    }
  }
  std::string problem;
  n->children.for_each([&](const Node* c) {
    if (!problem.empty()) return;
    if (c->parent != n) {
      problem = str_cat("node ", c->id, ": wrong parent");
    } else if (n->children.find(edge_of(n, c->identity, c->key().first(page_size_)),
                                [&](const Node& x) { return &x == c; }) != c) {
      // A child filed under another hash would never be matched.
      problem = str_cat("node ", c->id, ": not under its first page in its parent's map");
    }
  });
  return problem;
}

}  // namespace hicache::radix
