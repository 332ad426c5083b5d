// CacheOperation: one unit of L1 <-> L2 work queued to the controller's write or load thread:
// the host and device token slots to copy between, the radix-tree nodes to acknowledge when it
// is done, and a priority (lower runs first: HiRadixCache queues a write that frees device
// memory before backups; docs/design-notes.md, "Operation priorities").
//
// An operation that needs no acknowledgement says so explicitly (no node ids); no valid node id
// is overloaded to mean "none" (the reference treats node 0 that way).
#pragma once

#include <chrono>

#include <cstdint>
#include <optional>
#include <vector>

namespace hicache {

using NodeId = std::int64_t;

// Sidecar pages that move with an operation's KV (a hybrid model's state, pools/sidecar_pool.h):
// token slots of the controller's sidecar pool number `pool`, host and device lists of equal
// length in whole pages of that pool. They are copied in the same batch as the KV, counted in
// the same op, and acknowledged with it.
struct SidecarSlots {
  std::int32_t pool = 0;
  std::vector<std::int64_t> host_slots;
  std::vector<std::int64_t> device_slots;
};

struct CacheOperation {
  std::vector<std::int64_t> host_slots;
  std::vector<std::int64_t> device_slots;
  std::vector<NodeId> node_ids;  // acknowledged when done; empty: no acknowledgement
  std::vector<SidecarSlots> sidecars;  // sidecar pages that go with the KV (none for most models)
  std::int64_t priority = 0;     // lower first; FIFO among equals (the queue keeps the order)
  // When the caller submitted it (for the submit-to-ack latency); merged ops keep the earliest.
  std::chrono::steady_clock::time_point submitted{};

  // Throws InvalidArgument when the slot lists differ in length or are empty.
  static CacheOperation make(std::vector<std::int64_t> host_slots,
                             std::vector<std::int64_t> device_slots, std::int64_t priority,
                             std::optional<NodeId> ack_node);

  bool needs_ack() const { return !node_ids.empty(); }
  std::int64_t num_tokens() const { return static_cast<std::int64_t>(host_slots.size()); }

  // Appends other's slots, sidecar slots and node ids (other is left empty, its KV and node
  // lists' capacity kept); the priority becomes the lower of the two.
  void merge(CacheOperation&& other);
};

}  // namespace hicache
