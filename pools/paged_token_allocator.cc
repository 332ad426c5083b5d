#include "pools/paged_token_allocator.h"

#include <algorithm>

#include "transfer/errors.h"

namespace hicache {

void slots_to_pages(std::span<const std::int64_t> slots, std::int32_t page_size,
                    std::int64_t num_pages, std::string_view what,
                    std::vector<std::int64_t>& pages) {
  if (slots.size() % page_size != 0) {
    throw InvalidArgument(str_cat(what, ": ", slots.size(),
                                  " slots is not a whole number of pages of ", page_size));
  }
  const std::int64_t capacity = num_pages * page_size;
  for (std::size_t i = 0; i < slots.size(); i += page_size) {
    const std::int64_t first = slots[i];
    if (first < 0 || first >= capacity) {
      throw InvalidArgument(str_cat(what, ": slot ", first, " is out of range [0, ", capacity, ")"));
    }
    if (first % page_size != 0) {
      throw InvalidArgument(str_cat(what, ": slot ", first, " at index ", i,
                                    " does not start a page (page size ", page_size, ")"));
    }
    for (std::int32_t j = 1; j < page_size; ++j) {
      if (slots[i + j] != first + j) {
        throw InvalidArgument(str_cat(what, ": slot ", slots[i + j], " at index ", i + j,
                                      " breaks page ", first / page_size, " (expected slot ",
                                      first + j, ")"));
      }
    }
  }
  pages.reserve(pages.size() + slots.size() / page_size);
  for (std::size_t i = 0; i < slots.size(); i += page_size) pages.push_back(slots[i] / page_size);
}

void pages_to_slots(std::span<const std::int64_t> pages, std::int32_t page_size,
                    std::vector<std::int64_t>& slots) {
  slots.reserve(slots.size() + pages.size() * page_size);
  for (std::int64_t page : pages) {
    for (std::int32_t j = 0; j < page_size; ++j) slots.push_back(page * page_size + j);
  }
}

PagedTokenAllocator::PagedTokenAllocator(std::int64_t num_tokens, std::int32_t page_size)
    : num_pages_(0), page_size_(page_size) {
  if (page_size <= 0) {
    throw InvalidArgument(str_cat("PagedTokenAllocator: page_size must be > 0, got ", page_size));
  }
  if (num_tokens <= 0 || num_tokens % page_size != 0) {
    throw InvalidArgument(str_cat("PagedTokenAllocator: ", num_tokens,
                                  " tokens is not a positive multiple of the page size ",
                                  page_size));
  }
  num_pages_ = num_tokens / page_size;
  allocated_.assign(num_pages_, 0);
  reset();
}

bool PagedTokenAllocator::is_allocated(std::int64_t page) const {
  return page >= 0 && page < num_pages_ && allocated_[page] != 0;
}

bool PagedTokenAllocator::alloc(std::int64_t num_tokens, std::vector<std::int64_t>& slots) {
  if (num_tokens <= 0 || num_tokens % page_size_ != 0) {
    throw InvalidArgument(str_cat("PagedTokenAllocator::alloc: ", num_tokens,
                                  " tokens is not a positive multiple of the page size ",
                                  page_size_));
  }
  scratch_.clear();
  if (!alloc_pages(num_tokens / page_size_, scratch_)) return false;
  pages_to_slots(scratch_, page_size_, slots);
  return true;
}

std::optional<std::vector<std::int64_t>> PagedTokenAllocator::alloc(std::int64_t num_tokens) {
  std::vector<std::int64_t> slots;
  if (!alloc(num_tokens, slots)) return std::nullopt;
  return slots;
}

bool PagedTokenAllocator::alloc_pages(std::int64_t count, std::vector<std::int64_t>& pages) {
  if (count <= 0) {
    throw InvalidArgument(str_cat("PagedTokenAllocator::alloc_pages: count must be > 0, got ",
                                  count));
  }
  if (count > free_pages()) return false;
  for (std::int64_t i = 0; i < count; ++i) {
    const std::int64_t page = free_stack_.back();
    free_stack_.pop_back();
    allocated_[page] = 1;
    pages.push_back(page);
  }
  return true;
}

void PagedTokenAllocator::check_pages_freeable(std::span<const std::int64_t> pages,
                                               std::string_view what) {
  // Mark pages as we check them so a page listed twice is caught; undo the marks before
  // reporting, so an error leaves the allocator exactly as it was.
  std::size_t checked = 0;
  auto undo = [&] {
    for (std::size_t k = 0; k < checked; ++k) allocated_[pages[k]] = 1;
  };
  for (; checked < pages.size(); ++checked) {
    const std::int64_t page = pages[checked];
    if (page < 0 || page >= num_pages_) {
      undo();
      throw InvalidArgument(str_cat(what, ": page ", page, " is out of range [0, ", num_pages_, ")"));
    }
    if (allocated_[page] != 1) {
      undo();
      const bool twice = std::find(pages.begin(), pages.begin() + checked, page) !=
                         pages.begin() + checked;
      throw StateError(str_cat(what, ": page ", page, " (slot ", page * page_size_, ") ",
                               twice ? "is listed twice" : "is not allocated"));
    }
    allocated_[page] = 2;  // provisionally freed
  }
  undo();
}

void PagedTokenAllocator::free(std::span<const std::int64_t> slots) {
  scratch_.clear();
  slots_to_pages(slots, page_size_, num_pages_, "PagedTokenAllocator::free", scratch_);
  free_pages(scratch_);
}

void PagedTokenAllocator::free_pages(std::span<const std::int64_t> pages) {
  check_pages_freeable(pages, "PagedTokenAllocator::free");
  for (std::int64_t page : pages) {
    allocated_[page] = 0;
    free_stack_.push_back(page);
  }
}

void PagedTokenAllocator::reset() {
  std::fill(allocated_.begin(), allocated_.end(), 0);
  free_stack_.clear();
  free_stack_.reserve(num_pages_);
  for (std::int64_t page = num_pages_ - 1; page >= 0; --page) free_stack_.push_back(page);
}

}  // namespace hicache
