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
  priority = std::min(priority, other.priority);
  // Emptied, keeping the lists' capacity (the controller recycles them).
  other.host_slots.clear();
  other.device_slots.clear();
  other.node_ids.clear();
}

std::vector<CacheOperation> CacheOperation::split(std::int32_t k, std::int32_t page_size) const {
  if (k < 1) throw InvalidArgument(str_cat("CacheOperation::split: k must be >= 1, got ", k));
  if (page_size < 1 || host_slots.size() % page_size != 0 ||
      host_slots.size() != device_slots.size()) {
    throw InvalidArgument(str_cat("CacheOperation::split: ", host_slots.size(),
                                  " slots are not whole pages of ", page_size));
  }
  const std::int64_t pages = static_cast<std::int64_t>(host_slots.size()) / page_size;
  const std::int64_t pieces = std::max<std::int64_t>(1, std::min<std::int64_t>(k, pages));
  std::vector<CacheOperation> out;
  out.reserve(pieces);
  std::int64_t page = 0;
  for (std::int64_t i = 0; i < pieces; ++i) {
    const std::int64_t n = pages / pieces + (i < pages % pieces ? 1 : 0);
    const auto begin = static_cast<std::ptrdiff_t>(page * page_size);
    const auto end = static_cast<std::ptrdiff_t>((page + n) * page_size);
    CacheOperation piece;
    piece.host_slots.assign(host_slots.begin() + begin, host_slots.begin() + end);
    piece.device_slots.assign(device_slots.begin() + begin, device_slots.begin() + end);
    piece.priority = priority;
    out.push_back(std::move(piece));
    page += n;
  }
  out.back().node_ids = node_ids;
  return out;
}

}  // namespace hicache
