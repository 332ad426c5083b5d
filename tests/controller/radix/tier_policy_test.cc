// radix::TierPolicy on its own: a real controller over host-backed pools moves the bytes, a fake
// of TierPolicy::Cache stands in for the coordinator (locks and refreshes over a real tree and
// eviction index, leaves removed, synced copies recorded). Writes per policy and their acks,
// load back and its refusals (below the minimum, recomputing cheaper), device and host
// eviction that falls short when the candidates run out, demotion between the watermarks.
#include "controller/radix/tier_policy.h"

#include <gtest/gtest.h>

#include <vector>

#include "pools/kv_pattern.h"
#include "tests/controller/radix/fake_locks.h"
#include "tests/controller/radix/test_pages.h"
#include "tests/controller/wait_acks.h"
#include "transfer/host_device.h"

namespace hicache::radix {
namespace {

constexpr std::int32_t kPage = kTestPage;

KVGeometry geometry() { return KVGeometry::mha(2, 1, 8, DType::kFloat16, kPage); }

// The coordinator's part: locks up the path, refresh into the index, a leaf's removal.
class FakeCache final : public TierPolicy::Cache {
 public:
  FakeCache(Tree& tree, EvictionIndex& index) : tree_(tree), index_(index) {}
  void lock(Node* node) override { lock_path(node, index_); }
  void unlock(Node* node) override { unlock_path(node, index_); }
  void refresh(Node* node) override { index_.refresh(node); }
  void remove_leaf(Node* node) override {
    Node* parent = node->parent;
    removed.push_back(node->id);
    index_.forget(node);
    tree_.remove_leaf(node);
    index_.refresh(parent);
  }
  void host_copy_synced(Node* node) override { synced.push_back(node->id); }
  bool l3_attached() const override { return l3; }
  // A backup as L3Paths::backup_node queues it: the node locked, the op pending.
  bool back_up_leaving(Node* node) override {
    if (!backup_room) return false;
    leaving.push_back(node->id);
    node->backup_op = ++last_backup;
    pending->backups[node->backup_op] = PendingOps::Op{node, {node}};
    lock(node);
    return true;
  }
  // The backup's agreed ack as L3Paths::apply_backup_ack applies it (every page stored, or none).
  void ack_backup(TierPolicy& tiers, Node* node, bool stored) {
    pending->backups.erase(node->backup_op);
    node->backup_op = 0;
    if (stored) node->stored_pages = static_cast<std::int64_t>(node->key().size()) / kTestPage;
    refresh(node);
    unlock(node);
    tiers.backup_acked(node);
  }
  std::int64_t prefetch_reserved_tokens() const override { return reserved; }
  bool timed() const override { return false; }

  std::vector<NodeId> removed, synced, leaving;
  std::int64_t reserved = 0;
  bool l3 = false, backup_room = true;
  PendingOps* pending = nullptr;
  std::int64_t last_backup = 0;

 private:
  Tree& tree_;
  EvictionIndex& index_;
};

// A TierPolicy with everything it works on: pools of `device_pages` and `host_pages` pages.
struct Rig {
  HostDevice device;
  DeviceKVPool device_pool;
  HostKVPool host_pool;
  HiCacheController controller;
  Tree tree{kPage, 64};
  EvictionIndex index{EvictionPolicy::kLru, kPage};
  PendingOps pending;
  ArrivedAcks arrived;
  Agreement agreement{nullptr};
  CostRule cost;
  CacheEvents events;
  FakeCache cache{tree, index};
  TierPolicy tiers;

  Rig(WritePolicy policy, std::int64_t device_pages, std::int64_t host_pages,
      TierPolicy::Config config = {}, double recompute_seconds_per_token = 0)
      : device_pool(device, geometry(), device_pages * kPage),
        host_pool(device, geometry(), HostLayout::kPageFirst, host_pages * kPage),
        controller(device, device_pool, host_pool, ControllerConfig{.write_policy = policy}),
        cost(recompute_seconds_per_token, geometry().token_bytes()),
        tiers(cache, tree, index, pending, arrived, agreement, cost, events, controller,
              device_pool, host_pool, config) {
    cache.pending = &pending;
  }

  // A new leaf under `parent` whose `pages` device pages hold data keyed by (first, page).
  Node* device_leaf(Node* parent, std::int32_t first, int pages) {
    Node* n = tree.add_leaf(parent, pages_from(first, pages), "");
    auto slots = device_pool.allocator().alloc(pages * kPage);
    EXPECT_TRUE(slots.has_value());
    for (int p = 0; p < pages; ++p) {
      fill_page(device_pool.layout(), (*slots)[static_cast<std::size_t>(p * kPage)] / kPage,
                seed(first, p));
    }
    n->device = std::move(*slots);
    index.refresh(n);
    index.refresh(parent);
    return n;
  }
  static std::uint64_t seed(std::int32_t first, int page) {
    return static_cast<std::uint64_t>(first) * 1000 + static_cast<std::uint64_t>(page);
  }
  // Every page of `slots` (a node's device or host slots) holds the data device_leaf wrote.
  static bool holds(const LayoutDesc& layout, const std::vector<std::int64_t>& slots,
                    std::int32_t first) {
    for (std::size_t p = 0; p * kPage < slots.size(); ++p) {
      if (!verify_page(layout, slots[p * kPage] / kPage, seed(first, static_cast<int>(p)))) {
        return false;
      }
    }
    return !slots.empty();
  }
  // Waits for `n` write acks and applies them, as check_events does on one rank.
  void apply_writes(std::size_t n) {
    for (const Ack& a : wait_acks(controller, true, n)) {
      tiers.apply_write_ack(a.node, ArrivedAcks::outcome(a.ok), ArrivedAcks::outcome(a.ok));
    }
  }
  // Runs the queued loads (as a forward pass waits for them) and applies their acks.
  void run_loads(std::size_t n) {
    const std::int32_t slot = controller.start_loading();
    ASSERT_GE(slot, 0);
    for (std::int32_t l = 0; l < geometry().num_layers; ++l) {
      ASSERT_TRUE(device_pool.wait_for_layer(l));
    }
    controller.layer_done_counter().release(slot);
    for (const Ack& a : wait_acks(controller, false, n)) {
      tiers.apply_load_ack(a.node, ArrivedAcks::outcome(a.ok), ArrivedAcks::outcome(a.ok));
    }
  }
  // A leaf whose KV is on the host only: written through, acked, device copy evicted.
  Node* host_only_leaf(std::int32_t first, int pages) {
    Node* n = device_leaf(tree.root(), first, pages);
    tiers.inserted(n);
    apply_writes(1);
    EXPECT_EQ(tiers.evict_device(pages * kPage), pages * kPage);
    EXPECT_TRUE(n->device.empty());
    return n;
  }
};

TEST(TierPolicy, WriteThroughWritesOnInsertAndTheAckSyncsTheHostCopy) {
  Rig rig(WritePolicy::kWriteThrough, 8, 8);
  Node* n = rig.device_leaf(rig.tree.root(), 1, 2);
  rig.tiers.inserted(n);
  EXPECT_EQ(n->write_op, n->id);
  EXPECT_EQ(n->lock, 1);  // held until the ack
  EXPECT_EQ(n->host.size(), 8u);
  EXPECT_EQ(rig.pending.writes.count(n->id), 1u);
  EXPECT_TRUE(rig.cache.synced.empty());
  rig.apply_writes(1);
  EXPECT_EQ(n->write_op, 0);
  EXPECT_EQ(n->lock, 0);
  EXPECT_TRUE(rig.pending.writes.empty());
  EXPECT_TRUE(Rig::holds(rig.host_pool.layout(), n->host, 1));  // the device's bytes
  EXPECT_EQ(rig.cache.synced, std::vector<NodeId>{n->id});
  EXPECT_EQ(rig.index.check(rig.tree), "");
}

TEST(TierPolicy, WriteBackAndSelectiveWriteNothingOnInsert) {
  for (WritePolicy policy : {WritePolicy::kWriteBack, WritePolicy::kWriteThroughSelective}) {
    Rig rig(policy, 8, 8);
    Node* n = rig.device_leaf(rig.tree.root(), 1, 2);
    rig.tiers.inserted(n);
    EXPECT_EQ(n->write_op, 0) << to_string(policy);
    EXPECT_TRUE(n->host.empty());
    EXPECT_EQ(rig.host_pool.free_tokens(), 32);
  }
}

TEST(TierPolicy, SelectiveWriteIsDueAtTheThresholdOnly) {
  Rig rig(WritePolicy::kWriteThroughSelective, 8, 8, {.write_through_threshold = 3});
  Node* n = rig.device_leaf(rig.tree.root(), 1, 1);
  n->hits = 2;
  EXPECT_FALSE(rig.tiers.selective_write_due(*n));
  n->hits = 3;
  EXPECT_TRUE(rig.tiers.selective_write_due(*n));
  rig.tiers.write_selected(n);
  EXPECT_EQ(n->write_op, n->id);
  rig.apply_writes(1);
  rig.tiers.write_selected(n);  // has its host copy: nothing more
  EXPECT_EQ(n->write_op, 0);
  Rig through(WritePolicy::kWriteThrough, 8, 8, {.write_through_threshold = 1});
  Node* m = through.device_leaf(through.tree.root(), 1, 1);
  m->hits = 5;
  EXPECT_FALSE(through.tiers.selective_write_due(*m));  // not the selective policy
}

TEST(TierPolicy, AWriteWithoutHostRoomLeavesTheNodeDeviceOnly) {
  Rig rig(WritePolicy::kWriteThrough, 8, 1);  // one host page
  Node* n = rig.device_leaf(rig.tree.root(), 1, 2);
  rig.tiers.inserted(n);
  EXPECT_EQ(n->write_op, 0);
  EXPECT_EQ(n->lock, 0);
  EXPECT_TRUE(n->host.empty());
  EXPECT_TRUE(rig.pending.writes.empty());
  EXPECT_EQ(rig.host_pool.free_tokens(), kPage);
}

TEST(TierPolicy, AWriteThatFailedOnAnotherRankDropsThisRanksCopy) {
  Rig rig(WritePolicy::kWriteThrough, 8, 8);
  Node* n = rig.device_leaf(rig.tree.root(), 1, 2);
  rig.tiers.inserted(n);
  const std::vector<Ack> acks = wait_acks(rig.controller, true, 1);
  ASSERT_EQ(acks.size(), 1u);
  ASSERT_TRUE(acks[0].ok);                                                   // it worked here ...
  rig.tiers.apply_write_ack(n->id, ArrivedAcks::kFailed, ArrivedAcks::kOk);  // ... not everywhere
  EXPECT_TRUE(n->host.empty());
  EXPECT_EQ(rig.host_pool.free_tokens(), 32);  // the synced copy went back to the pool
  EXPECT_EQ(n->lock, 0);
  EXPECT_EQ(rig.events.write_failures.value(), 1u);
  EXPECT_TRUE(rig.cache.synced.empty());
  EXPECT_TRUE(Rig::holds(rig.device_pool.layout(), n->device, 1));       // the device copy stays
  rig.tiers.apply_write_ack(n->id, ArrivedAcks::kOk, ArrivedAcks::kOk);  // not pending: nothing
  EXPECT_EQ(rig.events.write_failures.value(), 1u);
  EXPECT_TRUE(rig.cache.synced.empty());
}

TEST(TierPolicy, DeviceEvictionFallsShortWhenOnlyLockedNodesAreLeft) {
  Rig rig(WritePolicy::kWriteThroughSelective, 8, 8);  // nothing written: device-only leaves
  Node* held = rig.device_leaf(rig.tree.root(), 1, 2);
  Node* loose = rig.device_leaf(rig.tree.root(), 2, 2);
  const NodeId loose_id = loose->id;
  rig.cache.lock(held);
  EXPECT_EQ(rig.device_pool.allocator().free_tokens(), 16);
  EXPECT_EQ(rig.tiers.evict_device(16), 8);                     // asked for both, only one could go
  EXPECT_EQ(rig.cache.removed, std::vector<NodeId>{loose_id});  // no KV anywhere: it left
  EXPECT_EQ(rig.device_pool.allocator().free_tokens(), 24);
  EXPECT_TRUE(Rig::holds(rig.device_pool.layout(), held->device, 1));
  EXPECT_EQ(rig.events.dropped_device_tokens.value(), 8u);
  EXPECT_EQ(rig.tiers.evict_device(8), 0);  // nothing left to take
  rig.cache.unlock(held);
  EXPECT_EQ(rig.tiers.evict_device(8), 8);
  EXPECT_EQ(rig.device_pool.allocator().free_tokens(), 32);
  EXPECT_EQ(rig.events.evicted_device_tokens.value(), 16u);
  EXPECT_EQ(rig.index.check(rig.tree), "");
}

TEST(TierPolicy, WriteBackEvictionWritesFirstAndFreesTheDeviceOnTheAck) {
  Rig rig(WritePolicy::kWriteBack, 8, 8);
  Node* n = rig.device_leaf(rig.tree.root(), 1, 2);
  EXPECT_EQ(rig.tiers.evict_device(8), 0);  // scheduled, not freed yet
  EXPECT_EQ(n->write_op, n->id);
  EXPECT_TRUE(n->evict_after_write);
  EXPECT_EQ(rig.device_pool.allocator().free_tokens(), 24);
  EXPECT_EQ(rig.tiers.evict_device(8), 0);  // a node being written is no candidate
  rig.apply_writes(1);
  EXPECT_TRUE(n->device.empty());
  EXPECT_FALSE(n->evict_after_write);
  EXPECT_EQ(rig.device_pool.allocator().free_tokens(), 32);
  EXPECT_TRUE(Rig::holds(rig.host_pool.layout(), n->host, 1));
  EXPECT_TRUE(rig.cache.removed.empty());  // on the host: it stays in the tree
  EXPECT_EQ(rig.index.check(rig.tree), "");
}

TEST(TierPolicy, LoadBackBringsTheHostCopyBackByteForByte) {
  Rig rig(WritePolicy::kWriteThrough, 8, 8);
  Node* n = rig.host_only_leaf(1, 2);
  const auto slots = rig.tiers.load_back(n);
  ASSERT_TRUE(slots.has_value());
  EXPECT_EQ(slots->size(), 8u);
  EXPECT_EQ(*slots, n->device);
  EXPECT_NE(n->load_op, 0);
  EXPECT_EQ(n->lock, 1);  // until the load's ack
  rig.run_loads(1);
  EXPECT_EQ(n->load_op, 0);
  EXPECT_EQ(n->lock, 0);
  EXPECT_TRUE(Rig::holds(rig.device_pool.layout(), n->device, 1));
  EXPECT_EQ(rig.events.loaded_back_tokens.value(), 8u);
  // On the device already: the slots, no load.
  EXPECT_EQ(rig.tiers.load_back(n), n->device);
  EXPECT_TRUE(rig.pending.loads.empty());
}

TEST(TierPolicy, LoadBackIsRefusedBelowTheMinimumAndOverAGap) {
  Rig rig(WritePolicy::kWriteThrough, 8, 8, {.load_back_min_tokens = 3 * kPage});
  Node* n = rig.host_only_leaf(1, 2);
  EXPECT_EQ(rig.tiers.load_back(n), std::nullopt);  // 8 tokens < 12
  EXPECT_TRUE(n->device.empty());
  EXPECT_EQ(n->lock, 0);
  EXPECT_TRUE(rig.pending.loads.empty());
  // A node on neither tier above it (only a test can make one): nothing to load from.
  Node* gap = rig.tree.add_leaf(rig.tree.root(), pages_from(5, 1), "");
  Node* below = rig.tree.add_leaf(gap, pages_from(6, 4), "");
  below->host = *rig.host_pool.alloc(4 * kPage);
  EXPECT_EQ(rig.tiers.load_back(below), std::nullopt);
  EXPECT_EQ(rig.events.loaded_back_tokens.value(), 0u);
}

// The cost rule needs a measured bandwidth: the first load back moves (nothing measured), the
// second is weighed at what the first measured.
TEST(TierPolicy, ALoadBackIsRefusedWhenRecomputingIsCheaper) {
  for (const double recompute : {1e-15, 1.0}) {
    Rig rig(WritePolicy::kWriteThrough, 8, 8, {}, recompute);
    Node* n = rig.host_only_leaf(1, 2);
    ASSERT_TRUE(rig.tiers.load_back(n).has_value());  // unmeasured: moves
    rig.run_loads(1);
    // The step's sampling (HiRadixCache::check_events): the load is measured.
    const ControllerStats cs = rig.controller.stats();
    rig.cost.sample(CostRule::Link::kHostLoad, static_cast<double>(cs.load_batches_done),
                    static_cast<double>(cs.bytes_loaded), cs.load_seconds);
    ASSERT_TRUE(rig.cost.link(CostRule::Link::kHostLoad).measured());
    EXPECT_EQ(rig.tiers.evict_device(8), 8);
    const auto second = rig.tiers.load_back(n);
    if (recompute < 1) {  // recomputing 8 tokens takes no time at all: refused
      EXPECT_EQ(second, std::nullopt);
      EXPECT_TRUE(n->device.empty());
      EXPECT_EQ(n->lock, 0);
      EXPECT_TRUE(rig.pending.loads.empty());
      EXPECT_EQ(rig.events.load_backs_refused_by_cost.value(), 1u);
      EXPECT_EQ(rig.events.miss_load_refused_tokens.value(), 8u);
    } else {  // a second per token: moving is cheaper
      ASSERT_TRUE(second.has_value());
      rig.run_loads(1);
      EXPECT_TRUE(Rig::holds(rig.device_pool.layout(), n->device, 1));
      EXPECT_EQ(rig.events.load_backs_refused_by_cost.value(), 0u);
    }
    EXPECT_GT(rig.cost.inputs().measured_load_gbps, 0);
  }
}

TEST(TierPolicy, HostEvictionTakesOnlyUnlockedHostOnlyLeaves) {
  Rig rig(WritePolicy::kWriteThrough, 8, 8);
  const NodeId host_only_id = rig.host_only_leaf(1, 2)->id;
  Node* held = rig.host_only_leaf(3, 2);
  rig.cache.lock(held);
  Node* synced = rig.device_leaf(rig.tree.root(), 2, 2);  // device and host
  rig.tiers.inserted(synced);
  rig.apply_writes(1);
  EXPECT_EQ(rig.host_pool.free_tokens(), 8);
  EXPECT_EQ(rig.tiers.evict_host(24), 8);  // only the unlocked host-only leaf
  EXPECT_EQ(rig.cache.removed, std::vector<NodeId>{host_only_id});
  EXPECT_EQ(rig.host_pool.free_tokens(), 16);
  EXPECT_EQ(synced->host.size(), 8u);
  EXPECT_EQ(held->host.size(), 8u);
  EXPECT_EQ(rig.events.evicted_host_tokens.value(), 8u);
  EXPECT_EQ(rig.tiers.evict_host_to_free(16), 0);  // 16 free already
  EXPECT_EQ(rig.tiers.evict_host_to_free(32), 0);  // nothing left it may take
  rig.cache.unlock(held);
  EXPECT_EQ(rig.tiers.evict_host_to_free(24), 8);
  EXPECT_EQ(rig.tiers.host_room(), 24);
  EXPECT_EQ(rig.index.check(rig.tree), "");
}

// Exclusive admission: the host write backs nothing up; host eviction backs a leaf up (locked,
// counted as leaving) and frees it on the ack, frees a leaf L3 holds already at once, keeps one
// whose backup failed (counted) and stops when the backup queue is full.
TEST(TierPolicy, ExclusiveAdmissionBacksUpWhatLeavesTheHostAndFreesItOnTheAck) {
  Rig rig(WritePolicy::kWriteThrough, 8, 8, {.storage_admission = StorageAdmission::kExclusive});
  rig.cache.l3 = true;
  Node* a = rig.host_only_leaf(1, 2);  // the coldest
  Node* b = rig.host_only_leaf(2, 2);
  const NodeId a_id = a->id, b_id = b->id;
  EXPECT_TRUE(rig.cache.synced.empty()) << "the host write backs nothing up";
  b->stored_pages = 2;  // b is in L3 already (a prefetched copy)
  rig.index.refresh(b);
  EXPECT_EQ(rig.tiers.evict_host(16), 8) << "b now; a on its ack";
  EXPECT_EQ(rig.cache.leaving, std::vector<NodeId>{a_id});
  EXPECT_EQ(rig.cache.removed, std::vector<NodeId>{b_id});
  EXPECT_TRUE(a->leave_host_after_backup);
  EXPECT_EQ(a->lock, 1);
  EXPECT_TRUE(Rig::holds(rig.host_pool.layout(), a->host, 1)) << "kept until the ack";
  EXPECT_EQ(rig.tiers.evict_host_to_free(32), 0) << "a's 8 tokens count as leaving";
  EXPECT_EQ(rig.cache.leaving.size(), 1u);
  rig.cache.ack_backup(rig.tiers, a, true);
  EXPECT_EQ(rig.cache.removed, (std::vector<NodeId>{b_id, a_id}));
  EXPECT_EQ(rig.host_pool.free_tokens(), 32);
  EXPECT_EQ(rig.events.evicted_host_tokens.value(), 16u);
  EXPECT_EQ(rig.events.backup_kept_tokens.value(), 0u);

  Node* c = rig.host_only_leaf(3, 2);
  EXPECT_EQ(rig.tiers.evict_host(8), 0);
  rig.cache.ack_backup(rig.tiers, c, false);  // the backup did not land
  EXPECT_FALSE(c->leave_host_after_backup);
  EXPECT_TRUE(Rig::holds(rig.host_pool.layout(), c->host, 3)) << "nothing lost";
  EXPECT_EQ(rig.events.backup_kept_tokens.value(), 8u);
  EXPECT_EQ(rig.host_pool.free_tokens(), 24);
  EXPECT_EQ(rig.index.check(rig.tree), "");
  rig.cache.backup_room = false;  // the backup queue is full: c stays, no flag
  EXPECT_EQ(rig.tiers.evict_host(8), 0);
  EXPECT_FALSE(c->leave_host_after_backup);
  EXPECT_EQ(c->lock, 0);
  rig.cache.backup_room = true;
  EXPECT_EQ(rig.tiers.evict_host(8), 0);  // tried again at its next turn
  EXPECT_EQ(rig.cache.leaving.size(), 3u);
  rig.cache.ack_backup(rig.tiers, c, true);
  EXPECT_EQ(rig.host_pool.free_tokens(), 32);
  EXPECT_EQ(rig.index.check(rig.tree), "");

  // Without L3 exclusive admission frees at once, as write_through does.
  rig.cache.l3 = false;
  rig.host_only_leaf(4, 1);
  EXPECT_EQ(rig.tiers.evict_host(4), 4);
  EXPECT_EQ(rig.cache.leaving.size(), 3u);
}

TEST(TierPolicy, DemotionBelowTheLowWatermarkFreesTowardsTheHighOne) {
  Rig rig(WritePolicy::kWriteThrough, 8, 8,
          {.demote_low_watermark = 0.25, .demote_high_watermark = 0.5});
  std::vector<Node*> leaves;
  for (int i = 0; i < 3; ++i) {
    leaves.push_back(rig.device_leaf(rig.tree.root(), i + 1, 2));
    rig.tiers.inserted(leaves.back());
  }
  rig.apply_writes(3);
  rig.tiers.demote();  // 8 of 32 free: not below a quarter
  EXPECT_EQ(rig.events.demotions.value(), 0u);
  EXPECT_EQ(rig.device_pool.allocator().free_tokens(), 8);
  Node* last = rig.device_leaf(rig.tree.root(), 4, 1);  // 4 free: below a quarter
  rig.tiers.inserted(last);
  rig.apply_writes(1);
  rig.tiers.demote();  // frees towards half: 12 tokens, the oldest synced leaves first
  EXPECT_EQ(rig.events.demotions.value(), 1u);
  EXPECT_EQ(rig.device_pool.allocator().free_tokens(), 20);
  EXPECT_TRUE(leaves[0]->device.empty());
  EXPECT_TRUE(leaves[1]->device.empty());
  EXPECT_FALSE(leaves[2]->device.empty());
  EXPECT_TRUE(Rig::holds(rig.host_pool.layout(), leaves[0]->host, 1));
}

}  // namespace
}  // namespace hicache::radix
