// hicache-opbench's hybrid workloads (tools/opbench.cc): a hybrid model's state moved beside its
// KV pages against the same bytes moved as KV pages alone, through one HiCacheController in one
// run (docs/hybrid.md, "Moving sidecar pages").
//
//   hybrid_write_p16  per op: 16 KV pages (8 MiB each) and one 16 MiB state page (8 layers of
//                     2 MiB) device -> host, against 18 KV pages (the same 144 MiB).
//   hybrid_load_p16   the same, host -> device, layer by layer (start_loading, then every
//                     layer waited on in order).
//
// Rounds alternate which side goes first; each side runs `ops` ops one after another (--quick:
// one round of one op), each timed
// from submit to ack (a load: to its last layer and its ack). ratio = the median over rounds of
// (kv_only seconds / hybrid seconds), both sides moving the same bytes: the target is
// >= 0.9. Every byte of the last round's ops is checked after the clock stopped (state and KV
// pages carry key-derived data, pools/kv_pattern.h), and every slot of every pool must be free
// at the end.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>

#include "transfer/device.h"

namespace hicache::opbench {

struct HybridResult {
  nlohmann::ordered_json line;  // the workload's JSON line
  bool ok = false;              // verified and pools clean
};

// `load`: hybrid_load_p16, else hybrid_write_p16. `rounds` of `ops` ops per side.
HybridResult run_hybrid(Device& device, bool load, std::int64_t rounds, std::int64_t ops);

}  // namespace hicache::opbench
