#include "pools/sidecar_pool.h"

#include <limits>

#include "transfer/errors.h"

namespace hicache {

SidecarHitPolicy parse_sidecar_hit_policy(std::string_view name) {
  if (name == "all_pages") return SidecarHitPolicy::kAllPages;
  if (name == "trailing" || name == "trailing_pages") return SidecarHitPolicy::kTrailing;
  throw InvalidArgument(
      str_cat("sidecar hit policy '", name, "': valid are all_pages, trailing (trailing_pages)"));
}

std::string_view to_string(SidecarHitPolicy policy) {
  return policy == SidecarHitPolicy::kAllPages ? "all_pages" : "trailing";
}

namespace {

bool valid_name(std::string_view name) {
  if (name.empty() || name.size() > 64 || name == "kv") return false;
  for (char c : name) {
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_')) return false;
  }
  return true;
}

std::string bytes_text(std::int64_t b) {
  if (b >= (std::int64_t{1} << 20) && b % (std::int64_t{1} << 20) == 0) {
    return str_cat(b >> 20, " MiB");
  }
  if (b >= 1024 && b % 1024 == 0) return str_cat(b >> 10, " KiB");
  return str_cat(b, " B");
}

}  // namespace

void SidecarSpec::validate() const {
  if (!valid_name(name)) {
    throw InvalidArgument(str_cat("sidecar pool '", name,
                                  "': a name is 1-64 characters of a-z, 0-9 and _, and not 'kv'"));
  }
  const auto bad = [&](std::string_view field, auto value, std::string_view rule) {
    throw InvalidArgument(str_cat("sidecar pool '", name, "': ", field, " ", value, ": ", rule));
  };
  if (layers <= 0) bad("layers", layers, "must be > 0");
  if (slots_per_page <= 0) bad("slots_per_page", slots_per_page, "must be > 0");
  if (window_pages <= 0) bad("window_pages", window_pages, "must be > 0");
  if (policy == SidecarHitPolicy::kAllPages && window_pages != 1) {
    bad("window_pages", window_pages, "applies to the trailing policy only (leave it 1)");
  }
  const std::int64_t elem = dtype_size(dtype);
  if (slot_bytes <= 0 || slot_bytes % elem != 0) {
    bad("slot_bytes", slot_bytes, str_cat("must be a positive multiple of ", elem, " (",
                                          to_string(dtype), ")"));
  }
  if (slot_bytes > (std::int64_t{1} << 30)) bad("slot_bytes", slot_bytes, "must be at most 1 GiB");
  if (device_pages <= 0) bad("device_pages", device_pages, "must be > 0");
  if (host_pages < device_pages) {
    bad("host_pages", host_pages,
        str_cat("must be at least device_pages (", device_pages,
                "): every device page must find room on the host when it is written back"));
  }
  const std::int64_t per_page = page_bytes();
  const std::int64_t most = std::numeric_limits<std::int64_t>::max() / 4;
  if (per_page <= 0 || host_pages > most / per_page) {
    bad("host_pages", host_pages, "makes the pool larger than an int64 byte count");
  }
}

KVGeometry SidecarSpec::geometry() const {
  return KVGeometry::mla(layers, static_cast<std::int32_t>(slot_bytes / dtype_size(dtype)), 0,
                         dtype, slots_per_page);
}

std::int64_t SidecarSpec::page_bytes() const {
  return slot_bytes * layers * std::int64_t{slots_per_page};
}

std::string SidecarSpec::describe() const {
  const std::string policy_text =
      policy == SidecarHitPolicy::kTrailing ? str_cat("trailing (window ", window_pages, ")")
                                            : std::string("all_pages");
  return str_cat(name, ": ", policy_text, ", ", layers, " layers x ", slots_per_page, " slot",
                 slots_per_page == 1 ? "" : "s", " x ", bytes_text(slot_bytes), " ",
                 to_string(dtype), " = ", bytes_text(page_bytes()), "/page, device ",
                 device_pages, " / host ", host_pages, " pages");
}

namespace {

const SidecarSpec& checked(const SidecarSpec& spec) {
  spec.validate();
  return spec;
}

}  // namespace

SidecarPool::SidecarPool(Device& device, const SidecarSpec& spec, const HostMemoryOptions& memory)
    : spec_(checked(spec)),
      device_pool_(device, spec_.geometry(), spec_.device_pages * spec_.slots_per_page),
      host_pool_(device, spec_.geometry(), HostLayout::kPageFirstDirect,
                 spec_.host_pages * spec_.slots_per_page, memory) {}

namespace {

// The engine's buffer for `spec`'s device tier, checked before the pool wraps it.
const ExternalKVBuffer& checked_device(const SidecarSpec& spec, const ExternalKVBuffer& b) {
  const std::int64_t slots = spec.device_pages * spec.slots_per_page;
  const auto want = static_cast<std::size_t>(kv_buffer_bytes(spec.geometry(), slots));
  if (b.data == nullptr || b.bytes != want) {
    throw InvalidArgument(str_cat("sidecar pool '", spec.name, "': the engine's device buffer is ",
                                  b.data == nullptr ? std::string("null")
                                                    : str_cat(b.bytes, " bytes"),
                                  "; it must be ", want, " bytes (", spec.device_pages,
                                  " pages x ", spec.slots_per_page, " slots x ", spec.layers,
                                  " layers x ", spec.slot_bytes, " bytes)"));
  }
  return b;
}

}  // namespace

SidecarPool::SidecarPool(Device& device, const SidecarSpec& spec,
                         const ExternalKVBuffer& device_memory, const HostMemoryOptions& memory)
    : spec_(checked(spec)),
      device_pool_(device, spec_.geometry(), spec_.device_pages * spec_.slots_per_page,
                   checked_device(spec_, device_memory)),
      host_pool_(device, spec_.geometry(), HostLayout::kPageFirstDirect,
                 spec_.host_pages * spec_.slots_per_page, memory) {}

}  // namespace hicache
