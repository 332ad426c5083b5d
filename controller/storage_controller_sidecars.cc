// StorageController's part for a hybrid model's sidecar pools (storage_controller.h, docs/hybrid.md):
// the pools' record namespaces and keys, their pages in a backup, the restorable prefix a
// prefetch's landed pages give, their reads before the KV's, and the reservation's rest freed at
// terminate. The rest of the class is storage_controller.cc.
#include <algorithm>

#include "controller/restorable.h"
#include "controller/storage_controller.h"
#include "transfer/errors.h"

namespace hicache {

KeyNamespace sidecar_namespace(const KeyNamespace& kv, const SidecarSpec& spec) {
  KeyNamespace ns = kv;
  ns.fingerprint = str_cat(kv.fingerprint, "+sidecar=", spec.name, ",", to_string(spec.policy),
                           spec.policy == SidecarHitPolicy::kTrailing
                               ? str_cat(",w", spec.window_pages)
                               : std::string(),
                           ",l", spec.layers, ",s", spec.slots_per_page, ",b", spec.slot_bytes);
  ns.dtype = std::string(to_string(spec.dtype));
  ns.layout = std::string(to_string(HostLayout::kPageFirstDirect));
  ns.mla = false;
  return ns;
}

std::string StorageController::sidecar_key(std::size_t pool, const std::string& kv_key) const {
  return str_cat(sidecars_[pool].prefix, std::string_view(kv_key).substr(kv_prefix_.size()));
}

std::int64_t StorageController::write_sidecars(const BackupOp& op, std::int64_t limit,
                                               std::string& error) {
  std::vector<std::string> keys;
  std::vector<ConstByteSpan> spans;
  for (const BackupOp::Sidecar& side : op.sidecars) {
    const Sidecar& sc = sidecars_[side.pool];
    const auto batch = static_cast<std::size_t>(sc.batch_pages);
    const auto page_bytes = static_cast<std::int64_t>(sc.host->geometry().page_bytes());
    // Its pages of the prefix still stored, in batches; the first failure cuts the prefix.
    const auto n = static_cast<std::size_t>(
        std::lower_bound(side.at.begin(), side.at.end(), limit) - side.at.begin());
    for (std::size_t begin = 0; begin < n; begin += batch) {
      const std::size_t end = std::min(n, begin + batch);
      keys.clear();
      spans.clear();
      for (std::size_t k = begin; k < end; ++k) {
        keys.push_back(sidecar_key(side.pool, op.keys[static_cast<std::size_t>(side.at[k])]));
        spans.push_back(sc.host->page_bytes(side.host_pages[k]));
      }
      const auto results = storage_.batch_set(keys, spans);
      std::size_t ok = 0;
      while (ok < keys.size() && results[ok].is_ok()) ++ok;
      sidecar_written_bytes_ += static_cast<std::int64_t>(ok) * page_bytes;
      if (ok < keys.size()) {
        const std::int64_t page = side.at[begin + ok];
        if (page < limit) {
          limit = page;
          error = str_cat("sidecar pool ", side.pool, " page ", page, " (key '", keys[ok],
                          "'): ", to_string(results[ok].status), " ", results[ok].reason);
        }
        break;
      }
    }
  }
  return limit;
}

std::int64_t StorageController::sidecar_reserve_pages(std::int32_t pool,
                                                     std::int64_t pages) const {
  if (pool < 0 || static_cast<std::size_t>(pool) >= sidecars_.size()) {
    throw InvalidArgument(str_cat("sidecar pool ", pool, " is not one of the ", sidecars_.size(),
                                  " pools"));
  }
  const Sidecar& sc = sidecars_[static_cast<std::size_t>(pool)];
  return sc.policy == SidecarHitPolicy::kAllPages ? pages
                                                  : std::min<std::int64_t>(sc.window, pages);
}

std::int64_t StorageController::restorable_landed(const PrefetchOperation& op,
                                                  std::int64_t kv_pages) const {
  const std::int64_t hit = op.hit_pages_.load();
  RestorablePrefix restorable;
  restorable.reset(std::min(kv_pages, hit), hit);
  std::vector<std::uint8_t> held(static_cast<std::size_t>(hit));
  for (std::size_t p = 0; p < op.sidecars_.size(); ++p) {
    const PrefetchOperation::SidecarFetch& f = op.sidecars_[p];
    std::fill(held.begin(), held.end(), 0);
    for (std::size_t k = 0; k < f.at.size(); ++k) {
      held[static_cast<std::size_t>(f.at[k])] = f.landed[k];
    }
    restorable.intersect(sidecars_[p].policy, sidecars_[p].window, held);
  }
  return restorable.largest();
}

void StorageController::read_sidecars(PrefetchOperation& op) {
  std::vector<std::string> keys;
  std::vector<ByteSpan> spans;
  std::vector<std::int64_t> slots;
  for (std::size_t p = 0; p < op.sidecars_.size(); ++p) {
    PrefetchOperation::SidecarFetch& f = op.sidecars_[p];
    const Sidecar& sc = sidecars_[p];
    const auto batch = static_cast<std::size_t>(sc.batch_pages);
    const auto page_bytes = static_cast<std::int64_t>(sc.host->geometry().page_bytes());
    bool failed = false;
    for (std::size_t begin = 0; begin < f.at.size() && !failed && !op.terminate_; begin += batch) {
      const std::size_t end = std::min(f.at.size(), begin + batch);
      keys.clear();
      spans.clear();
      slots.clear();
      for (std::size_t k = begin; k < end; ++k) {
        keys.push_back(sidecar_key(p, op.keys_[static_cast<std::size_t>(f.at[k])]));
        spans.push_back(sc.host->page_bytes(f.host_pages[k]));
        for (std::int32_t i = 0; i < sc.slots_per_page; ++i) {
          slots.push_back(f.host_pages[k] * sc.slots_per_page + i);
        }
      }
      sc.host->protect_write(slots);
      std::vector<IoResult> results;
      std::string error;
      try {
        results = storage_.batch_get(keys, spans);
      } catch (const std::exception& e) {
        error = e.what();
      }
      // Each page lands (backup) or goes back to reserved; the first failure ends the pool:
      // the pages after it restore nothing the hit's prefix before it does not.
      std::size_t ok = 0;
      while (ok < results.size() && ok < keys.size() && results[ok].is_ok()) ++ok;
      const auto spp = static_cast<std::size_t>(sc.slots_per_page);
      const std::span<const std::int64_t> all(slots);
      if (ok > 0) sc.host->complete_io(all.first(ok * spp), PageState::kBackup);
      if (ok < keys.size()) sc.host->abort_io(all.subspan(ok * spp));
      for (std::size_t k = 0; k < ok; ++k) f.landed[begin + k] = 1;
      sidecar_read_bytes_ += static_cast<std::int64_t>(ok) * page_bytes;
      if (ok < keys.size()) {
        failed = true;
        if (error.empty()) {
          error = str_cat(to_string(results[ok].status), " ", results[ok].reason);
        }
        op.set_error(str_cat("sidecar pool ", p, " page ", f.at[begin + ok], " (key '", keys[ok],
                             "'): ", error));
      }
    }
  }
}

void StorageController::free_sidecar_rest(PrefetchOperation& op,
                                          const std::vector<SidecarPagesIo>& keep) {
  for (std::size_t p = 0; p < op.sidecars_.size(); ++p) {
    PrefetchOperation::SidecarFetch& f = op.sidecars_[p];
    std::vector<std::int64_t> kept;
    for (const SidecarPagesIo& io : keep) {
      if (static_cast<std::size_t>(io.pool) == p) kept = io.host_slots;
    }
    std::sort(kept.begin(), kept.end());
    std::vector<std::int64_t> rest;
    for (std::int64_t slot : f.reserved) {
      if (!std::binary_search(kept.begin(), kept.end(), slot)) rest.push_back(slot);
    }
    if (!rest.empty()) sidecars_[p].host->free(rest);
    f.reserved.clear();
  }
}

}  // namespace hicache
