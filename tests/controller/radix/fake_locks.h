// Locks as the coordinator takes them (HiRadixCache::lock / unlock), for the rooms' fakes of
// their cache hooks: a count on the node and on every ancestor, the eviction index refreshed
// when a count leaves or reaches zero.
#pragma once

#include "controller/radix/eviction.h"
#include "controller/radix/node.h"

namespace hicache::radix {

inline void lock_path(Node* node, EvictionIndex& index) {
  for (Node* n = node; n != nullptr; n = n->parent) {
    if (++n->lock == 1) index.refresh(n);
  }
}

inline void unlock_path(Node* node, EvictionIndex& index) {
  for (Node* n = node; n != nullptr; n = n->parent) {
    if (--n->lock == 0) index.refresh(n);
  }
}

}  // namespace hicache::radix
