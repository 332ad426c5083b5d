#include "transfer/cache_operation.h"

#include <algorithm>

#include "transfer/errors.h"

namespace hicache {

CacheOperation CacheOperation::make(std::vector<std::int64_t> host_slots,
                                    std::vector<std::int64_t> device_slots, std::int64_t priority,
                                    std::optional<NodeId> ack_node) {
  if (host_slots.size() != device_slots.size() || host_slots.empty()) {
    throw InvalidArgument(str_cat("CacheOperation: ", host_slots.size(), " host slots for ",
                                  device_slots.size(), " device slots (need equal, non-zero)"));
  }
  CacheOperation op;
  op.host_slots = std::move(host_slots);
  op.device_slots = std::move(device_slots);
  if (ack_node) op.node_ids.push_back(*ack_node);
  op.priority = priority;
  return op;
}

void CacheOperation::merge(CacheOperation&& other) {
  submitted = std::min(submitted, other.submitted);
  host_slots.insert(host_slots.end(), other.host_slots.begin(), other.host_slots.end());
  device_slots.insert(device_slots.end(), other.device_slots.begin(), other.device_slots.end());
  node_ids.insert(node_ids.end(), other.node_ids.begin(), other.node_ids.end());
  for (SidecarSlots& s : other.sidecars) sidecars.push_back(std::move(s));
  other.sidecars.clear();
  priority = std::min(priority, other.priority);
  // Emptied, keeping the lists' capacity (the controller recycles them).
  other.host_slots.clear();
  other.device_slots.clear();
  other.node_ids.clear();
}

}  // namespace hicache
