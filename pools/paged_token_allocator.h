// PagedTokenAllocator: page-granular allocation of token slots in a KV buffer.
//
// Token slots are what engines index KV buffers with; pages are what hicache moves. Page p owns
// slots [p * page_size, (p + 1) * page_size). Allocation hands out whole pages (no partial
// success); free takes slot lists made of whole pages and rejects anything else, naming the
// offending slot, without changing any state. Not thread-safe: the owner serialises calls.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

namespace hicache {

// Converts a slot list made of whole pages, each page's slots consecutive and in order
// (p*ps, p*ps+1, ..., p*ps+ps-1), into page ids appended to `pages`. Throws InvalidArgument
// naming the first bad slot (`what` prefixes the message); `pages` is unchanged then.
void slots_to_pages(std::span<const std::int64_t> slots, std::int32_t page_size,
                    std::int64_t num_pages, std::string_view what,
                    std::vector<std::int64_t>& pages);

// Appends the slots of `pages` to `slots`.
void pages_to_slots(std::span<const std::int64_t> pages, std::int32_t page_size,
                    std::vector<std::int64_t>& slots);

// What hands out the device pool's token slots: the pool's own PagedTokenAllocator, or the
// engine's allocator behind this interface (the engine then chooses the slots loads go into).
// Contract, as PagedTokenAllocator's below: whole pages, no partial success, a bad free throws
// and changes nothing. Called from the engine's main loop only. (An implementation that
// overrides alloc adds `using TokenSlotAllocator::alloc;` to keep the optional-returning form.)
class TokenSlotAllocator {
 public:
  virtual ~TokenSlotAllocator() = default;
  virtual std::int32_t page_size() const = 0;
  virtual std::int64_t num_pages() const = 0;
  std::int64_t capacity_tokens() const { return num_pages() * page_size(); }
  virtual std::int64_t free_tokens() const = 0;
  virtual bool is_allocated(std::int64_t page) const = 0;
  virtual bool alloc(std::int64_t num_tokens, std::vector<std::int64_t>& slots) = 0;
  std::optional<std::vector<std::int64_t>> alloc(std::int64_t num_tokens) {
    std::vector<std::int64_t> slots;
    if (!alloc(num_tokens, slots)) return std::nullopt;
    return slots;
  }
  virtual void free(std::span<const std::int64_t> slots) = 0;
  virtual void reset() = 0;
};

class PagedTokenAllocator final : public TokenSlotAllocator {
 public:
  // Throws InvalidArgument unless page_size > 0 and num_tokens is a positive multiple of it.
  PagedTokenAllocator(std::int64_t num_tokens, std::int32_t page_size);

  std::int64_t capacity_tokens() const { return num_pages_ * page_size_; }
  std::int64_t num_pages() const override { return num_pages_; }
  std::int32_t page_size() const override { return page_size_; }
  std::int64_t free_pages() const { return static_cast<std::int64_t>(free_stack_.size()); }
  std::int64_t free_tokens() const override { return free_pages() * page_size_; }
  bool is_allocated(std::int64_t page) const override;

  // Allocates num_tokens / page_size pages and appends their slots to `slots`. Returns false,
  // with nothing allocated and `slots` unchanged, when too few pages are free. Throws
  // InvalidArgument unless num_tokens is a positive multiple of the page size.
  bool alloc(std::int64_t num_tokens, std::vector<std::int64_t>& slots) override;
  std::optional<std::vector<std::int64_t>> alloc(std::int64_t num_tokens);
  // Allocates `count` pages and appends their ids to `pages`; false (nothing changed) if short.
  bool alloc_pages(std::int64_t count, std::vector<std::int64_t>& pages);

  // Frees the pages of `slots` (see slots_to_pages). Throws InvalidArgument for a malformed
  // list or an out-of-range slot, StateError for a page not allocated or listed twice; in every
  // error case nothing is freed.
  void free(std::span<const std::int64_t> slots) override;
  void free_pages(std::span<const std::int64_t> pages);

  // Frees everything.
  void reset() override;

 private:
  void check_pages_freeable(std::span<const std::int64_t> pages, std::string_view what);

  std::int64_t num_pages_;
  std::int32_t page_size_;
  std::vector<std::int64_t> free_stack_;  // free page ids; the back is handed out next
  std::vector<std::uint8_t> allocated_;   // per page: 1 when allocated
  std::vector<std::int64_t> scratch_;     // reused page list for free()
};

}  // namespace hicache
