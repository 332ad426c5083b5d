// radix::EvictionOrder, EvictionIndex and GhostSet on their own: the policies' order and its
// footprint weighting, which nodes are candidates on each tier, lazy re-keying after a touch, the running totals, a missed
// refresh named by check(), and the ghosts' one count per evicted page.
#include "controller/radix/eviction.h"

#include <gtest/gtest.h>

#include <vector>

#include "controller/radix/ghost_set.h"

#include "tests/controller/radix/test_pages.h"

namespace hicache::radix {
namespace {

constexpr std::int32_t kPage = kTestPage;

// A leaf holding device KV (slots 0..), refreshed into `index`.
Node* device_leaf(Tree& tree, EvictionIndex& index, Node* parent, std::int32_t first) {
  Node* n = tree.add_leaf(parent, pages_from(first, 1), "");
  n->device.assign(kPage, first);
  index.refresh(n);
  index.refresh(parent);
  return n;
}

TEST(EvictionOrder, LruGoesByAccessLfuByHitsThenAccess) {
  Tree tree(kPage, 64);
  Node* old_often = tree.add_leaf(tree.root(), pages_from(1, 1), "");
  Node* new_rare = tree.add_leaf(tree.root(), pages_from(2, 1), "");
  old_often->hits = 9;
  const auto lru = EvictionOrder::make(EvictionPolicy::kLru);
  const auto lfu = EvictionOrder::make(EvictionPolicy::kLfu);
  EXPECT_LT(lru->key(*old_often, Tier::kDevice), lru->key(*new_rare, Tier::kDevice));  // older
  EXPECT_LT(lfu->key(*new_rare, Tier::kHost), lfu->key(*old_often, Tier::kHost));  // fewer hits
  new_rare->hits = 9;  // a tie on hits: the older goes
  EXPECT_LT(lfu->key(*old_often, Tier::kHost), lfu->key(*new_rare, Tier::kHost));
  EXPECT_EQ(parse_eviction_policy("lfu"), EvictionPolicy::kLfu);
  EXPECT_THROW(parse_eviction_policy("fifo"), InvalidArgument);
}

// Greedy-Dual-Size over the access clock: a node whose state is 9x its KV stays a tenth as long
// past its tier's frontier as a KV-only node. Each tier weighs against its own frontier, a
// frontier never goes back, and a later access never lowers a node's mark.
TEST(EvictionOrder, AStateHeavyNodeAgesByItsFootprintAgainstItsTiersFrontier) {
  constexpr std::int64_t kKvPerToken = 10;
  Tree tree(kPage, 64);
  Node* light = tree.add_leaf(tree.root(), pages_from(1, 1), "");  // clock 1
  Node* heavy = tree.add_leaf(tree.root(), pages_from(2, 1), "");  // clock 2
  heavy->sidecar_bytes = 9 * kPage * kKvPerToken;
  for (int i = 0; i < 98; ++i) tree.touch(light);  // clock 100
  tree.advance_frontier(Tier::kDevice, 100);       // a node of mark 100 left the device
  tree.advance_frontier(Tier::kDevice, 50);        // a smaller mark: the frontier stays
  EXPECT_EQ(tree.frontier(Tier::kDevice), 100u);
  EXPECT_EQ(tree.frontier(Tier::kHost), 0u);
  for (int i = 0; i < 100; ++i) tree.touch(light);  // clock 200
  tree.touch(heavy);                                // clock 201
  EXPECT_EQ(eviction_mark(*light, Tier::kDevice, kKvPerToken), 200u);  // KV only: its access
  EXPECT_EQ(eviction_mark(*heavy, Tier::kDevice, kKvPerToken), 100u + 101u / 10);
  EXPECT_EQ(eviction_mark(*heavy, Tier::kHost, kKvPerToken), 201u / 10);
  EXPECT_EQ(eviction_mark(*heavy, Tier::kDevice, 0), 201u);  // unweighted
  const auto lru = EvictionOrder::make(EvictionPolicy::kLru, kKvPerToken);
  const auto plain = EvictionOrder::make(EvictionPolicy::kLru);
  EXPECT_LT(lru->key(*heavy, Tier::kDevice), lru->key(*light, Tier::kDevice));  // goes first
  EXPECT_LT(plain->key(*light, Tier::kDevice), plain->key(*heavy, Tier::kDevice));
  const std::uint64_t before = eviction_mark(*heavy, Tier::kDevice, kKvPerToken);
  tree.touch(heavy);
  EXPECT_GE(eviction_mark(*heavy, Tier::kDevice, kKvPerToken), before);

  // In the index: the heavy node is the first victim though touched last, and stays indexed
  // under its older key after later touches and frontier moves (check() allows older keys).
  EvictionIndex index(EvictionPolicy::kLru, kPage, kKvPerToken);
  heavy->device.assign(kPage, 0);
  light->device.assign(kPage, kPage);
  index.refresh(heavy);
  index.refresh(light);
  EXPECT_EQ(index.next_victim(Tier::kDevice), heavy);
  tree.advance_frontier(Tier::kDevice, index.mark(*heavy, Tier::kDevice));
  for (int i = 0; i < 50; ++i) tree.touch(heavy);  // mark 110 + 142 / 10: still before light
  EXPECT_EQ(index.check(tree), "");
  EXPECT_EQ(index.next_victim(Tier::kDevice), heavy);
  for (int i = 0; i < 1000; ++i) tree.touch(heavy);  // mark 110 + 1142 / 10 = 224 > 200
  EXPECT_EQ(index.check(tree), "");
  EXPECT_EQ(index.next_victim(Tier::kDevice), light);
}

TEST(EvictionIndex, ADeviceCandidateHasNoChildOnTheDeviceAndAHostCandidateIsAHostOnlyLeaf) {
  Tree tree(kPage, 64);
  EvictionIndex index(EvictionPolicy::kLru, kPage);
  Node* parent = device_leaf(tree, index, tree.root(), 1);
  Node* child = device_leaf(tree, index, parent, 2);
  EXPECT_EQ(index.candidates(Tier::kDevice), 1u);
  EXPECT_EQ(index.next_victim(Tier::kDevice), child);  // the parent holds a device child
  EXPECT_EQ(index.totals().device_tokens, 2 * kPage);
  EXPECT_EQ(index.totals().evictable_device_tokens, 2 * kPage);
  // The child moves to the host: the parent becomes a device candidate, the child a host one.
  child->host = child->device;
  child->device.clear();
  index.refresh(child);
  EXPECT_EQ(parent->device_children, 0);
  EXPECT_EQ(index.next_victim(Tier::kDevice), parent);
  EXPECT_EQ(index.next_victim(Tier::kHost), child);
  // A lock or an op in flight takes a node out; its tokens are no longer evictable.
  child->lock = 1;
  parent->lock = 1;
  index.refresh(child);
  index.refresh(parent);
  EXPECT_EQ(index.next_victim(Tier::kHost), nullptr);
  EXPECT_EQ(index.next_victim(Tier::kDevice), nullptr);
  EXPECT_EQ(index.totals().evictable_device_tokens, 0);
  EXPECT_EQ(index.check(tree), "");
  index.forget(child);
  tree.remove_leaf(child);
  EXPECT_EQ(index.totals().nodes, 1);
  EXPECT_EQ(index.totals().host_tokens, 0);
  EXPECT_EQ(index.check(tree), "");
}

TEST(EvictionIndex, ATouchNeedsNoRefreshTheFrontIsReKeyed) {
  Tree tree(kPage, 64);
  EvictionIndex index(EvictionPolicy::kLru, kPage);
  Node* a = device_leaf(tree, index, tree.root(), 1);
  Node* b = device_leaf(tree, index, tree.root(), 2);
  EXPECT_EQ(index.next_victim(Tier::kDevice), a);
  tree.touch(a);                     // a is now the most recent; its entry keeps the older key
  EXPECT_EQ(index.check(tree), "");  // an older key is allowed
  EXPECT_EQ(index.next_victim(Tier::kDevice), b);
  EXPECT_EQ(index.candidates(Tier::kDevice), 2u);
}

TEST(EvictionIndex, CheckNamesAChangeThatWasNotRefreshed) {
  Tree tree(kPage, 64);
  EvictionIndex index(EvictionPolicy::kLfu, kPage);
  Node* a = device_leaf(tree, index, tree.root(), 1);
  a->lock = 1;  // no refresh
  EXPECT_NE(index.check(tree).find("stale in the device eviction index"), std::string::npos);
  index.refresh(a);
  EXPECT_EQ(index.check(tree), "");
  a->stored_pages = 1;  // no refresh
  EXPECT_NE(index.check(tree).find("running totals"), std::string::npos);
}

TEST(GhostSet, EachEvictedPageCountsOnceAndTheWalkGoesIntoEvictedChildren) {
  GhostSet ghosts(100);
  const auto parent_key = pages_from(1, 2), child_key = pages_from(5, 1);
  const std::uint64_t root = GhostSet::parent_name(0, true, "");
  ghosts.remember(GhostSet::parent_name(7, false, ""), 8, child_key, kPage);  // child of node 7
  ghosts.remember(root, 7, parent_key, kPage);
  std::vector<std::int32_t> prompt = parent_key;
  prompt.insert(prompt.end(), child_key.begin(), child_key.end());
  EXPECT_EQ(ghosts.take_evicted_tokens(root, prompt, kPage), 3 * kPage);
  EXPECT_EQ(ghosts.take_evicted_tokens(root, prompt, kPage), 0);  // counted already
  // Another identity never finds them.
  EXPECT_EQ(ghosts.take_evicted_tokens(GhostSet::parent_name(0, true, "t"), prompt, kPage), 0);
  ghosts.remember(root, 9, parent_key, kPage);  // evicted again: counts again
  EXPECT_EQ(ghosts.take_evicted_tokens(root, parent_key, kPage), 2 * kPage);
}

TEST(GhostSet, OverCapacityTheOldestGoFirst) {
  GhostSet ghosts(3);
  const std::uint64_t root = GhostSet::parent_name(0, true, "");
  ghosts.remember(root, 1, pages_from(1, 2), kPage);
  ghosts.remember(root, 2, pages_from(2, 2), kPage);  // 4 pages > 3: the first goes
  EXPECT_EQ(ghosts.pages(), 2);
  EXPECT_EQ(ghosts.take_evicted_tokens(root, pages_from(1, 2), kPage), 0);
  EXPECT_EQ(ghosts.take_evicted_tokens(root, pages_from(2, 2), kPage), 2 * kPage);
  ghosts.remember(root, 3, pages_from(3, 4), kPage);  // over the capacity on its own: not kept
  EXPECT_EQ(ghosts.take_evicted_tokens(root, pages_from(3, 4), kPage), 0);
}

}  // namespace
}  // namespace hicache::radix
