// StorageAdmission: when HiRadixCache writes a host page to L3 (the tier policy applies it,
// radix/tier_policy.h). Part of the radix cache's public configuration.
#pragma once

#include <string_view>

namespace hicache {

// write_through: every page whose host copy is synced is backed up to L3 at once, so L3 holds a
// superset of the host. exclusive: a page goes to L3 when it leaves the host (host eviction,
// coldest first), and its host copy is freed on the backup's ack; a page already in L3 leaves
// the host at once. L3 then adds its capacity to the host's instead of duplicating it. reuse:
// a page is backed up once its node was matched again by later requests
// (RadixCacheConfig::storage_admission_min_hits times), as soon as its host copy is synced
// then; a page no request asked for again never goes to L3, and leaves the host as under
// write_through.
enum class StorageAdmission { kWriteThrough, kExclusive, kReuse };
// "write_through", "exclusive" or "reuse"; anything else throws InvalidArgument naming it and
// the valid ones.
StorageAdmission parse_storage_admission(std::string_view name);
std::string_view to_string(StorageAdmission admission);

}  // namespace hicache
