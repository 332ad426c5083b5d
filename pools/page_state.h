// Per-page states of the host KV pool (SGLang's memory-state machine, made strict):
//
//   free ──alloc──> reserved ──protect_write──> protected ──complete_io(synced)──> synced
//     ^                │  ^                        │   ^  └───complete_io(backup)──> backup
//     └──────free──────┘  └──────abort_io──────────┘   └──────protect_load──────────┘  │
//     ^                                                 synced ──mark_backup──> backup  │
//     ^                                                 synced <──mark_synced── backup  │
//     └────────────────────────────────free─────────────────────────────────────────────┘
//
//   reserved   allocated, holds no data yet
//   protected  an I/O into or out of the page is in flight; nothing may free or reuse it
//   synced     holds the same bytes as a live device (L1) copy
//   backup     the only copy above storage (L3): the device copy was evicted, or the page was
//              prefetched from storage
// Every other transition raises StateError naming the page, its state and the operation.
#pragma once

#include <cstdint>
#include <string_view>

namespace hicache {

enum class PageState : std::uint8_t { kFree, kReserved, kProtected, kSynced, kBackup };

constexpr int kNumPageStates = 5;

std::string_view to_string(PageState state);

// A set of page states, for the "from" side of a transition.
constexpr std::uint8_t state_bit(PageState s) { return std::uint8_t{1} << static_cast<int>(s); }

}  // namespace hicache
