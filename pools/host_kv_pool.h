// HostKVPool: the L2 tier, pinned host memory holding KV pages in one of three layouts
// (pools/kv_layout.h), with a state per page (pools/page_state.h).
//
// Slots are token slots as on the device; the pool allocates and changes state in whole
// pages. All methods are thread-safe: the engine's main loop allocates and evicts while the
// controller's threads complete I/O. Every method that raises leaves the pool unchanged.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "kernels/layout_math.h"
#include "pools/kv_geometry.h"
#include "pools/kv_layout.h"
#include "pools/page_state.h"
#include "pools/paged_token_allocator.h"
#include "transfer/device.h"
#include "transfer/mutex.h"

namespace hicache {

// How big the host pool is: exactly one of the three.
struct HostPoolSize {
  double ratio = 0;         // times the device pool's tokens
  std::int64_t bytes = 0;   // total bytes (rounded down to whole pages)
  std::int64_t tokens = 0;  // token slots (a multiple of the page size)

  // Resolves to a token count; throws InvalidArgument naming the bad value (none or several
  // given, a non-positive value, less than one page).
  std::int64_t resolve_tokens(const KVGeometry& geometry, std::int64_t device_tokens) const;
};

class HostKVPool {
 public:
  // Maps and pre-faults the pool through device.alloc_host. Throws InvalidArgument for a bad
  // geometry or token count, DeviceError when the memory is refused.
  HostKVPool(Device& device, const KVGeometry& geometry, HostLayout layout,
             std::int64_t num_tokens, const HostMemoryOptions& memory = {});
  // Wraps the engine's host KV buffer of exactly num_tokens slots in place (`external.order`:
  // SGLang's kv_buffer shapes, or hicache's); page-locks it on CUDA when it is not already (undone when the pool goes). The
  // page states start free: the engine hands the pool's pages to hicache. Throws
  // InvalidArgument naming a null buffer or one of another size; DeviceError when it cannot be page-locked.
  HostKVPool(Device& device, const KVGeometry& geometry, HostLayout layout,
             std::int64_t num_tokens, const ExternalKVBuffer& external);

  const KVGeometry& geometry() const { return geometry_; }
  HostLayout host_layout() const { return host_layout_; }
  const LayoutDesc& layout() const { return desc_; }
  // Read without mu_: the allocator's size is set at construction and never changes.
  std::int64_t capacity_tokens() const HICACHE_NO_THREAD_SAFETY_ANALYSIS {
    return allocator_.capacity_tokens();
  }
  std::int64_t num_pages() const HICACHE_NO_THREAD_SAFETY_ANALYSIS {
    return allocator_.num_pages();
  }
  std::int64_t free_tokens() const;
  std::size_t size_bytes() const {
    return static_cast<std::size_t>(kv_buffer_bytes(geometry_, desc_.num_tokens));
  }
  // True when the KV memory is the engine's (wrapped, never freed here).
  bool wraps_engine_memory() const { return wrapped_; }

  // Allocates whole pages (free -> reserved). Returns nothing, with nothing changed, when the
  // pool is short. Throws InvalidArgument unless num_tokens is a positive page multiple.
  std::optional<std::vector<std::int64_t>> alloc(std::int64_t num_tokens);
  bool alloc(std::int64_t num_tokens, std::vector<std::int64_t>& slots);

  // Page-state transitions over the pages of `slots` (whole pages, see slots_to_pages). All
  // pages are checked before any changes; one page in a wrong state raises StateError.
  void free(std::span<const std::int64_t> slots);           // reserved|backup -> free
  // synced -> free: drops a host copy whose device copy stays (TP ranks that agreed a write
  // failed, when it worked on this rank).
  void discard(std::span<const std::int64_t> slots);
  void protect_write(std::span<const std::int64_t> slots);  // reserved -> protected
  void protect_load(std::span<const std::int64_t> slots);   // backup -> protected
  // protected -> `to`, which must be kSynced (a device copy exists) or kBackup.
  void complete_io(std::span<const std::int64_t> slots, PageState to);
  void abort_io(std::span<const std::int64_t> slots);    // protected -> reserved (no valid data)
  void mark_backup(std::span<const std::int64_t> slots);  // synced -> backup (device copy gone)
  // backup -> synced: the engine put the same bytes on the device again (it recomputed the
  // prefix, SGLang's update_synced), so the host copy once more shadows a live device copy.
  void mark_synced(std::span<const std::int64_t> slots);
  // Every page -> free (the owner dropped all it held: HiRadixCache::reset). A page in state
  // protected has a copy in flight: StateError naming it, nothing changed.
  void reset();

  PageState page_state(std::int64_t page) const;
  // True when every page of `slots` is in `state`.
  bool all_in_state(std::span<const std::int64_t> slots, PageState state) const;
  // Throws StateError "<what>: page P (slot S) is X, needs Y" for the first page of `slots`
  // not in `state`; InvalidArgument for a malformed slot list.
  void require_state(std::span<const std::int64_t> slots, PageState state,
                     std::string_view what) const;
  // Pages currently in `state`.
  std::int64_t count_in_state(PageState state) const;

  // True when the layout stores each page as one contiguous block (page_first,
  // page_first_direct): page_bytes() then gives a zero-copy view for storage I/O.
  bool has_contiguous_pages() const { return page_block_contiguous(desc_); }
  // The bytes of page `page`. Throws StateError when the layout has no contiguous page,
  // InvalidArgument for a page out of range.
  std::span<std::byte> page_bytes(std::int64_t page) const;
  // Serialises page `page` into `out` (exactly page_total_bytes bytes): the page_bytes view
  // where the layout has one, else (layer, kv, token) order; copy_page_in reads it back: the staging path for storage I/O on layouts without contiguous
  // pages. Throws InvalidArgument for a page out of range or a buffer of the wrong size.
  void copy_page_out(std::int64_t page, std::span<std::byte> out) const;
  void copy_page_in(std::int64_t page, std::span<const std::byte> in);

 private:
  void transition(std::span<const std::int64_t> slots, std::uint8_t from, PageState to,
                  std::string_view op) HICACHE_REQUIRES(mu_);

  KVGeometry geometry_;
  HostLayout host_layout_;
  Buffer memory_;
  LayoutDesc desc_;
  bool wrapped_ = false;
  mutable Mutex mu_;
  PagedTokenAllocator allocator_ HICACHE_GUARDED_BY(mu_);
  std::vector<PageState> states_ HICACHE_GUARDED_BY(mu_);
  std::vector<std::int64_t> scratch_ HICACHE_GUARDED_BY(mu_);
  std::vector<std::int64_t> sorted_ HICACHE_GUARDED_BY(mu_);
  mutable std::vector<std::int64_t> check_ HICACHE_GUARDED_BY(mu_);  // state checks, reused
};

}  // namespace hicache
