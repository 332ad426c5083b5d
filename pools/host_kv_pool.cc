#include "pools/host_kv_pool.h"

#include <algorithm>
#include <cstring>
#include <cmath>

#include "transfer/errors.h"

namespace hicache {

std::string_view to_string(PageState state) {
  switch (state) {
    case PageState::kFree:
      return "free";
    case PageState::kReserved:
      return "reserved";
    case PageState::kProtected:
      return "protected";
    case PageState::kSynced:
      return "synced";
    case PageState::kBackup:
      return "backup";
  }
  return "unknown";
}

std::int64_t HostPoolSize::resolve_tokens(const KVGeometry& geometry,
                                          std::int64_t device_tokens) const {
  const int given = (ratio != 0) + (bytes != 0) + (tokens != 0);
  if (given != 1) {
    throw InvalidArgument(str_cat("host pool size: give exactly one of ratio, bytes, tokens (got ",
                                  given, ")"));
  }
  const std::int64_t page = geometry.page_size;
  std::int64_t result = 0;
  if (ratio != 0) {
    if (!(ratio > 0) || !std::isfinite(ratio)) {
      throw InvalidArgument(str_cat("host pool size: ratio must be > 0, got ", ratio));
    }
    if (device_tokens <= 0) {
      throw InvalidArgument(str_cat("host pool size: a ratio needs the device pool's tokens, got ",
                                    device_tokens));
    }
    result = static_cast<std::int64_t>(ratio * static_cast<double>(device_tokens)) / page * page;
  } else if (bytes != 0) {
    if (bytes < 0) throw InvalidArgument(str_cat("host pool size: bytes must be > 0, got ", bytes));
    result = bytes / geometry.page_bytes() * page;
  } else {
    if (tokens < 0 || tokens % page != 0) {
      throw InvalidArgument(str_cat("host pool size: ", tokens,
                                    " tokens is not a positive multiple of the page size ", page));
    }
    result = tokens;
  }
  if (result < page) {
    throw InvalidArgument(str_cat("host pool size: resolves to ", result,
                                  " tokens, less than one page of ", page));
  }
  return result;
}

HostKVPool::HostKVPool(Device& device, const KVGeometry& geometry, HostLayout layout,
                       std::int64_t num_tokens, const HostMemoryOptions& memory)
    : geometry_(geometry),
      host_layout_(layout),
      allocator_((check_token_count(geometry, num_tokens, "HostKVPool"), num_tokens),
                 geometry.page_size) {
  geometry_.validate();
  memory_ = device.alloc_host(static_cast<std::size_t>(kv_buffer_bytes(geometry_, num_tokens)),
                              memory);
  desc_ = make_host_layout(layout, geometry_, num_tokens, memory_.data());
  states_.assign(allocator_.num_pages(), PageState::kFree);
}

HostKVPool::HostKVPool(Device& device, const KVGeometry& geometry, HostLayout layout,
                       std::int64_t num_tokens, const ExternalKVBuffer& external)
    : geometry_(geometry),
      host_layout_(layout),
      wrapped_(true),
      allocator_((check_token_count(geometry, num_tokens, "HostKVPool"), num_tokens),
                 geometry.page_size) {
  geometry_.validate();
  const auto need = static_cast<std::size_t>(kv_buffer_bytes(geometry_, num_tokens));
  if (external.data == nullptr || external.bytes != need) {  // strides follow the slot count
    throw InvalidArgument(str_cat("HostKVPool: the engine's buffer (", external.bytes, " bytes at ",
                                  external.data, ") is not ", num_tokens, " slots of ",
                                  geometry_.token_bytes(), " bytes (", need,
                                  "): the host pool's tokens must be the buffer's slot count"));
  }
  memory_ = device.wrap_host(external.data, external.bytes);
  desc_ = make_host_layout(layout, geometry_, num_tokens, memory_.data(), external.order);
  states_.assign(allocator_.num_pages(), PageState::kFree);
}

std::int64_t HostKVPool::free_tokens() const {
  MutexLock lock(mu_);
  return allocator_.free_tokens();
}

std::optional<std::vector<std::int64_t>> HostKVPool::alloc(std::int64_t num_tokens) {
  std::vector<std::int64_t> slots;
  if (!alloc(num_tokens, slots)) return std::nullopt;
  return slots;
}

bool HostKVPool::alloc(std::int64_t num_tokens, std::vector<std::int64_t>& slots) {
  MutexLock lock(mu_);
  const std::size_t first = slots.size();
  if (!allocator_.alloc(num_tokens, slots)) return false;
  for (std::size_t i = first; i < slots.size(); i += geometry_.page_size) {
    states_[slots[i] / geometry_.page_size] = PageState::kReserved;
  }
  return true;
}

void HostKVPool::transition(std::span<const std::int64_t> slots, std::uint8_t from, PageState to,
                            std::string_view op) {
  scratch_.clear();
  slots_to_pages(slots, geometry_.page_size, allocator_.num_pages(),
                 op, scratch_);  // op names the call in full: no string built per call
  for (std::int64_t page : scratch_) {
    if ((state_bit(states_[page]) & from) == 0) {
      std::string wanted;
      for (int s = 0; s < kNumPageStates; ++s) {
        if (from & (1 << s)) {
          wanted += wanted.empty() ? "" : " or ";
          wanted += to_string(static_cast<PageState>(s));
        }
      }
      throw StateError(str_cat(op, ": page ", page, " (slot ",
                               page * geometry_.page_size, ") is ", to_string(states_[page]),
                               ", needs ", wanted));
    }
  }
  sorted_.assign(scratch_.begin(), scratch_.end());
  std::sort(sorted_.begin(), sorted_.end());
  if (auto dup = std::adjacent_find(sorted_.begin(), sorted_.end()); dup != sorted_.end()) {
    throw StateError(str_cat(op, ": page ", *dup, " (slot ",
                             *dup * geometry_.page_size, ") is listed twice"));
  }
  if (to == PageState::kFree) allocator_.free_pages(scratch_);
  for (std::int64_t page : scratch_) states_[page] = to;
}

void HostKVPool::free(std::span<const std::int64_t> slots) {
  MutexLock lock(mu_);
  transition(slots, state_bit(PageState::kReserved) | state_bit(PageState::kBackup),
             PageState::kFree, "HostKVPool::free");
}

void HostKVPool::reset() {
  MutexLock lock(mu_);
  for (std::size_t page = 0; page < states_.size(); ++page) {
    if (states_[page] == PageState::kProtected) {
      throw StateError(str_cat("host pool reset: page ", page, " (slot ",
                               static_cast<std::int64_t>(page) * geometry_.page_size,
                               ") is protected: a copy is in flight"));
    }
  }
  std::fill(states_.begin(), states_.end(), PageState::kFree);
  allocator_.reset();
}

void HostKVPool::discard(std::span<const std::int64_t> slots) {
  MutexLock lock(mu_);
  transition(slots, state_bit(PageState::kSynced), PageState::kFree, "HostKVPool::discard");
}

void HostKVPool::protect_write(std::span<const std::int64_t> slots) {
  MutexLock lock(mu_);
  transition(slots, state_bit(PageState::kReserved), PageState::kProtected, "HostKVPool::protect_write");
}

void HostKVPool::protect_load(std::span<const std::int64_t> slots) {
  MutexLock lock(mu_);
  transition(slots, state_bit(PageState::kBackup), PageState::kProtected, "HostKVPool::protect_load");
}

void HostKVPool::complete_io(std::span<const std::int64_t> slots, PageState to) {
  if (to != PageState::kSynced && to != PageState::kBackup) {
    throw InvalidArgument(str_cat("HostKVPool::complete_io: target state must be synced or "
                                  "backup, got ",
                                  to_string(to)));
  }
  MutexLock lock(mu_);
  transition(slots, state_bit(PageState::kProtected), to, "HostKVPool::complete_io");
}

void HostKVPool::abort_io(std::span<const std::int64_t> slots) {
  MutexLock lock(mu_);
  transition(slots, state_bit(PageState::kProtected), PageState::kReserved, "HostKVPool::abort_io");
}

void HostKVPool::mark_backup(std::span<const std::int64_t> slots) {
  MutexLock lock(mu_);
  transition(slots, state_bit(PageState::kSynced), PageState::kBackup, "HostKVPool::mark_backup");
}

void HostKVPool::mark_synced(std::span<const std::int64_t> slots) {
  MutexLock lock(mu_);
  transition(slots, state_bit(PageState::kBackup), PageState::kSynced, "HostKVPool::mark_synced");
}

PageState HostKVPool::page_state(std::int64_t page) const {
  MutexLock lock(mu_);
  if (page < 0 || page >= allocator_.num_pages()) {
    throw InvalidArgument(str_cat("HostKVPool::page_state: page ", page, " is out of range [0, ",
                                  allocator_.num_pages(), ")"));
  }
  return states_[page];
}

bool HostKVPool::all_in_state(std::span<const std::int64_t> slots, PageState state) const {
  MutexLock lock(mu_);
  check_.clear();
  slots_to_pages(slots, geometry_.page_size, num_pages(), "HostKVPool::all_in_state", check_);
  for (std::int64_t page : check_) {
    if (states_[page] != state) return false;
  }
  return true;
}

void HostKVPool::require_state(std::span<const std::int64_t> slots, PageState state,
                               std::string_view what) const {
  MutexLock lock(mu_);
  check_.clear();
  slots_to_pages(slots, geometry_.page_size, num_pages(), what, check_);
  for (std::int64_t page : check_) {
    if (states_[page] != state) {
      throw StateError(str_cat(what, ": page ", page, " (slot ", page * geometry_.page_size,
                               ") is ", to_string(states_[page]), ", needs ", to_string(state)));
    }
  }
}

std::int64_t HostKVPool::count_in_state(PageState state) const {
  MutexLock lock(mu_);
  std::int64_t n = 0;
  for (PageState s : states_) n += s == state;
  return n;
}

std::span<std::byte> HostKVPool::page_bytes(std::int64_t page) const {
  if (!has_contiguous_pages()) {
    throw StateError(str_cat("HostKVPool::page_bytes: layout ", to_string(host_layout_),
                             " has no contiguous page; use page_first or page_first_direct"));
  }
  if (page < 0 || page >= num_pages()) {
    throw InvalidArgument(str_cat("HostKVPool::page_bytes: page ", page, " is out of range [0, ",
                                  num_pages(), ")"));
  }
  return {reinterpret_cast<std::byte*>(desc_.base + page * desc_.page_stride),
          static_cast<std::size_t>(page_total_bytes(desc_))};
}

namespace {

// Visits the runs of page `page`: the whole block where the layout has one, else (layer, kv,
// token) order. fn(offset from base, bytes).
template <typename Fn>
void for_each_page_run(const LayoutDesc& d, std::int64_t page, Fn fn) {
  if (page_block_contiguous(d)) {
    fn(page * d.page_stride, page_total_bytes(d));
    return;
  }
  const bool runs = page_run_contiguous(d);
  for (std::int32_t layer = 0; layer < d.num_layers; ++layer) {
    for (std::int32_t kv = 0; kv < d.num_kv; ++kv) {
      if (runs) {
        fn(page_unit_offset(d, layer, kv, page), page_run_bytes(d));
        continue;
      }
      for (std::int64_t t = 0; t < d.page_size; ++t) {
        fn(unit_offset(d, layer, kv, page * d.page_size + t), d.unit_bytes);
      }
    }
  }
}

void check_page_buffer(const LayoutDesc& d, std::int64_t page, std::int64_t pages,
                       std::size_t bytes, const char* what) {
  if (page < 0 || page >= pages) {
    throw InvalidArgument(str_cat("HostKVPool::", what, ": page ", page, " is out of range [0, ",
                                  pages, ")"));
  }
  if (bytes != static_cast<std::size_t>(page_total_bytes(d))) {
    throw InvalidArgument(str_cat("HostKVPool::", what, ": buffer of ", bytes,
                                  " bytes, a page has ", page_total_bytes(d)));
  }
}

}  // namespace

void HostKVPool::copy_page_out(std::int64_t page, std::span<std::byte> out) const {
  check_page_buffer(desc_, page, num_pages(), out.size(), "copy_page_out");
  std::byte* to = out.data();
  for_each_page_run(desc_, page, [&](std::int64_t offset, std::int64_t bytes) {
    std::memcpy(to, desc_.base + offset, static_cast<std::size_t>(bytes));
    to += bytes;
  });
}

void HostKVPool::copy_page_in(std::int64_t page, std::span<const std::byte> in) {
  check_page_buffer(desc_, page, num_pages(), in.size(), "copy_page_in");
  const std::byte* from = in.data();
  for_each_page_run(desc_, page, [&](std::int64_t offset, std::int64_t bytes) {
    std::memcpy(desc_.base + offset, from, static_cast<std::size_t>(bytes));
    from += bytes;
  });
}

}  // namespace hicache
