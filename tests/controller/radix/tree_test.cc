// radix::Tree on its own: lookups by edge (first page, identity under the root), splits that
// keep a node's place, side-effect-free prefix walks, colliding edge hashes, structure checks.
#include "controller/radix/tree.h"

#include <gtest/gtest.h>

#include <vector>

#include "tests/controller/radix/test_pages.h"

namespace hicache::radix {
namespace {

constexpr std::int32_t kPage = kTestPage;

TEST(RadixTree, ChildrenAreFoundByTheirFirstPageAndUnderTheRootByIdentity) {
  Tree tree(kPage, 64);
  const auto key = pages_from(1, 2);
  Node* a = tree.add_leaf(tree.root(), key, "a");
  Node* plain = tree.add_leaf(tree.root(), key, "");
  EXPECT_NE(a, plain);
  EXPECT_EQ(tree.child_of(tree.root(), std::span(key).first(kPage), "a"), a);
  EXPECT_EQ(tree.child_of(tree.root(), std::span(key).first(kPage), ""), plain);
  EXPECT_EQ(tree.child_of(tree.root(), std::span(key).first(kPage), "b"), nullptr);
  // Below the root the identity is the subtree's: a child is found whatever is passed.
  const auto more = pages_from(7, 1);
  Node* below = tree.add_leaf(a, more, "ignored");
  EXPECT_EQ(below->identity, "");
  EXPECT_EQ(tree.child_of(a, more, "anything"), below);
  EXPECT_EQ(a->identity, "a");
  EXPECT_LT(a->id, plain->id);
  EXPECT_LT(a->last_access, below->last_access);  // add_leaf touches
}

TEST(RadixTree, SplitPutsTheUpperPartInTheNodesPlaceAndLeavesTheTiersToTheCaller) {
  Tree tree(kPage, 64);
  const auto key = pages_from(1, 3);
  Node* n = tree.add_leaf(tree.root(), key, "id");
  n->lock = 2;
  n->hits = 5;
  n->device.assign(key.size(), 9);
  const NodeId old_id = n->id;
  Node* upper = tree.split(n, kPage);
  EXPECT_EQ(std::vector<std::int32_t>(upper->key().begin(), upper->key().end()),
            std::vector<std::int32_t>(key.begin(), key.begin() + kPage));
  EXPECT_EQ(n->key().size(), 2u * kPage);
  EXPECT_EQ(n->key().front(), key[kPage]);
  EXPECT_EQ(n->id, old_id);
  EXPECT_GT(upper->id, old_id);
  EXPECT_EQ(upper->lock, 2);
  EXPECT_EQ(upper->hits, 5);
  EXPECT_EQ(upper->last_access, n->last_access);
  EXPECT_EQ(upper->identity, "id");
  EXPECT_EQ(n->parent, upper);
  EXPECT_EQ(upper->parent, tree.root());
  EXPECT_TRUE(upper->device.empty());       // tiers: the caller's to divide
  EXPECT_EQ(n->device.size(), key.size());  // still all on the lower part
  EXPECT_EQ(tree.child_of(tree.root(), std::span(key).first(kPage), "id"), upper);
  EXPECT_EQ(tree.child_of(upper, std::span(key).subspan(kPage, kPage), ""), n);
  EXPECT_EQ(tree.check_node(tree.root()), "");
  EXPECT_EQ(tree.check_node(upper), "");
  EXPECT_EQ(tree.check_node(n), "");
}

TEST(RadixTree, PrefixTokensStopsInsideANodeAndChangesNothing) {
  Tree tree(kPage, 64);
  const auto key = pages_from(1, 3);
  Node* n = tree.add_leaf(tree.root(), key, "");
  const std::uint64_t access = n->last_access;
  std::vector<std::int32_t> asked(key.begin(), key.begin() + 2 * kPage);
  asked.push_back(-1);  // a partial page never counts
  EXPECT_EQ(tree.prefix_tokens(asked, ""), 2u * kPage);
  EXPECT_EQ(tree.prefix_tokens(key, "other"), 0u);
  EXPECT_EQ(tree.prefix_tokens(key, ""), key.size());
  asked[kPage] += 1;  // the second page differs
  EXPECT_EQ(tree.prefix_tokens(asked, ""), static_cast<std::size_t>(kPage));
  EXPECT_EQ(n->key().size(), key.size());  // no split
  EXPECT_EQ(n->hits, 0);
  EXPECT_EQ(n->last_access, access);
  EXPECT_EQ(tree.common_tokens(n, asked), static_cast<std::size_t>(kPage));
}

TEST(RadixTree, CollidingEdgeHashesStillFindEveryChild) {
  Tree tree(kPage, 1);  // two slots: 40 children collide
  std::vector<Node*> nodes;
  for (int i = 0; i < 40; ++i) nodes.push_back(tree.add_leaf(tree.root(), pages_from(i, 1), ""));
  for (int i = 0; i < 40; i += 2) tree.remove_leaf(nodes[static_cast<std::size_t>(i)]);
  for (int i = 0; i < 40; ++i) {
    Node* found = tree.child_of(tree.root(), pages_from(i, 1), "");
    EXPECT_EQ(found, i % 2 == 0 ? nullptr : nodes[static_cast<std::size_t>(i)]) << i;
  }
  EXPECT_EQ(tree.root()->children.size(), 20u);
  EXPECT_EQ(tree.check_node(tree.root()), "");
  std::size_t seen = 0;
  tree.for_each_node([&](Node*) { ++seen; });
  EXPECT_EQ(seen, 20u);
}

TEST(RadixTree, CheckNodeNamesALockBelowItsChildrensAndAWrongParent) {
  Tree tree(kPage, 64);
  Node* parent = tree.add_leaf(tree.root(), pages_from(1, 1), "");
  Node* child = tree.add_leaf(parent, pages_from(2, 1), "");
  child->lock = 1;
  EXPECT_NE(tree.check_node(parent).find("below its children's 1"), std::string::npos);
  parent->lock = 1;
  EXPECT_EQ(tree.check_node(parent), "");
  child->parent = tree.root();
  EXPECT_NE(tree.check_node(parent).find("wrong parent"), std::string::npos);
}

TEST(RadixTree, OrderedChildrenDoNotDependOnInsertionOrder) {
  Tree one(kPage, 64), other(kPage, 64);
  for (int i : {3, 1, 2}) one.add_leaf(one.root(), pages_from(i, 1), i == 2 ? "x" : "");
  for (int i : {2, 3, 1}) other.add_leaf(other.root(), pages_from(i, 1), i == 2 ? "x" : "");
  auto firsts = [](const Tree& t) {
    std::vector<std::int32_t> out;
    for (const Node* c : t.ordered_children(t.root())) out.push_back(c->key().front());
    return out;
  };
  EXPECT_EQ(firsts(one), firsts(other));
  EXPECT_EQ(firsts(one).size(), 3u);
}

}  // namespace
}  // namespace hicache::radix
