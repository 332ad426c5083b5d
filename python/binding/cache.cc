// See cache.h.
#include "python/binding/cache.h"

#include <tuple>

#include "controller/config.h"
#include "python/binding/buffers.h"
#include "transfer/errors.h"

namespace hicache::binding {

void EngineSlots::free(std::span<const std::int64_t> slots) {
  std::vector<std::int64_t> pages;
  slots_to_pages(slots, page_size_, num_pages_, "EngineSlots::free", pages);  // checks first
  MutexLock hold(mu_);
  returned_.insert(returned_.end(), slots.begin(), slots.end());
}

std::vector<std::int64_t> EngineSlots::take_returned() {
  MutexLock hold(mu_);
  return std::exchange(returned_, {});
}

PageState parse_page_state(const std::string& name) {
  for (PageState s : {PageState::kFree, PageState::kReserved, PageState::kProtected,
                      PageState::kSynced, PageState::kBackup}) {
    if (to_string(s) == name) return s;
  }
  throw InvalidArgument(
      str_cat("page state '", name, "': valid are free, reserved, protected, synced, backup"));
}

std::optional<PageDigest> prior_of(const std::optional<std::string>& hex) {
  if (!hex || hex->empty()) return std::nullopt;
  return digest_from_hex(*hex);
}

PyHiCache::PyHiCache(const std::string& config_json, std::shared_ptr<PyStore> store,
                     py::object device_kv, py::object host_kv, py::object device_k,
                     py::object device_v, const std::string& dim_order, bool engine_allocator,
                     py::object sidecars)
    : store_(std::move(store)) {
  const HiCacheConfig config = HiCacheConfig::from_json_text(config_json);
  HiCacheParts parts;
  if (engine_allocator) {
    engine_slots_ = std::make_unique<EngineSlots>(config.device_tokens, config.geometry.page_size);
    parts.device_allocator = engine_slots_.get();
  }
  if (store_) parts.storage = store_->backend();
  const DimOrder order = parse_dim_order(dim_order);
  if (!device_kv.is_none()) {
    auto [p, n] = tensor_memory(device_kv, "device_kv");
    parts.device_kv = ExternalKVBuffer{p, n, order};
    keep_.push_back(device_kv);
  }
  if (!host_kv.is_none()) {
    auto [p, n] = tensor_memory(host_kv, "host_kv");
    parts.host_kv = ExternalKVBuffer{p, n, order};
    keep_.push_back(host_kv);
  }
  for (auto [list, out, what] : {std::tuple{&device_k, &parts.device_k, "device_k"},
                                 std::tuple{&device_v, &parts.device_v, "device_v"}}) {
    if (list->is_none()) continue;
    std::size_t i = 0;
    for (py::handle t : py::reinterpret_borrow<py::sequence>(*list)) {
      const auto [p, n] = tensor_memory(t, str_cat(what, "[", i, "]").c_str());
      if (parts.device_layer_bytes == 0) parts.device_layer_bytes = n;
      if (n != parts.device_layer_bytes) {
        throw InvalidArgument(str_cat(what, "[", i, "] holds ", n, " bytes, the first buffer ",
                                      parts.device_layer_bytes));
      }
      out->push_back(p);
      ++i;
    }
    keep_.push_back(*list);
  }
  if (!sidecars.is_none()) {
    for (auto [name, t] : py::reinterpret_borrow<py::dict>(sidecars)) {
      const std::string pool = py::str(name);
      const auto [p, n] = tensor_memory(t, str_cat("sidecars['", pool, "']").c_str());
      parts.sidecar_device[pool] = ExternalKVBuffer{p, n, order};
      keep_.push_back(py::reinterpret_borrow<py::object>(t));
    }
  }
  py::gil_scoped_release nogil;  // the TP rendezvous and pool pre-faulting wait
  cache_ = std::make_unique<HiCache>(config, std::move(parts));
}

void PyHiCache::close() {
  py::gil_scoped_release nogil;  // calls in flight finish first; none of them needs the GIL
  std::unique_lock lock(life_);
  {
    MutexLock streams(streams_mu_);
    write_ready_.reset();
    load_ready_.reset();
    streams_.clear();
  }
  cache_.reset();
}

Stream* PyHiCache::engine_stream(HiCache& hc, std::optional<std::uintptr_t> stream) {
  if (!stream) return nullptr;
  MutexLock lock(streams_mu_);
  for (auto& [handle, wrapped] : streams_) {
    if (handle == *stream) return wrapped.get();
  }
  // An engine has a handful of streams (compute, and perhaps one per overlap worker): kept.
  streams_.emplace_back(*stream, hc.device().wrap_stream(reinterpret_cast<void*>(*stream)));
  return streams_.back().second.get();
}

Event* PyHiCache::record_on(HiCache& hc, std::optional<std::uintptr_t> stream, bool for_load) {
  Stream* s = engine_stream(hc, stream);
  if (s == nullptr) return nullptr;
  MutexLock lock(streams_mu_);
  std::unique_ptr<Event>& event = for_load ? load_ready_ : write_ready_;
  if (!event) event = hc.device().create_event();
  s->record(*event);
  return event.get();
}

Event* PyHiCache::ready_for_write(HiCache& hc, std::optional<std::uintptr_t> stream) {
  return record_on(hc, stream, /*for_load=*/false);
}

Event* PyHiCache::ready_for_load(HiCache& hc, std::optional<std::uintptr_t> stream) {
  return record_on(hc, stream, /*for_load=*/true);
}

void PyHiCache::detach_storage() {
  {
    Use u = use();
    py::gil_scoped_release nogil;
    u.hc.detach_storage();
  }
  store_.reset();
}

void PyHiCache::attach_storage(const py::object& store) {
  std::shared_ptr<PyStore> s;
  if (py::isinstance<py::str>(store)) {
    const std::string json = store.cast<std::string>();
    std::shared_ptr<StorageBackend> backend;
    {
      py::gil_scoped_release nogil;
      backend = make_storage(json);
    }
    s = std::make_shared<PyStore>(std::move(backend));
  } else {
    s = store.cast<std::shared_ptr<PyStore>>();
  }
  {
    Use u = use();
    py::gil_scoped_release nogil;
    u.hc.attach_storage(s->backend());
  }
  store_ = std::move(s);
}

void PyHiCache::clear_storage() {
  Use u = use();
  py::gil_scoped_release nogil;
  u.hc.clear_storage();
}

std::vector<std::pair<NodeId, bool>> PyHiCache::wait_acks(const std::string& kind, std::size_t n,
                                                          double timeout_s) {
  if (kind != "write" && kind != "load") {
    throw InvalidArgument(str_cat("wait_acks: kind '", kind, "': valid are write, load"));
  }
  Use u = use();
  HiCacheController& c = u.hc.controller();
  std::vector<Ack> acks;
  {
    py::gil_scoped_release nogil;
    wait_for(c.events(), n, timeout_s, [&] {
      kind == "write" ? c.drain_write_acks(acks) : c.drain_load_acks(acks);
      return acks.size();
    });
  }
  std::vector<std::pair<NodeId, bool>> out;
  for (const Ack& a : acks) out.emplace_back(a.node, a.ok);
  return out;
}

StorageController& PyHiCache::storage_controller(HiCache& hc) {
  StorageController* sc = hc.storage_controller();
  if (sc == nullptr) throw StateError("no L3 store is attached");
  return *sc;
}

std::pair<std::vector<std::string>, std::vector<std::string>> PyHiCache::page_keys(
    const std::vector<std::int32_t>& tokens, const std::optional<std::string>& prior_hex) {
  Use u = use();
  if (!keyer_) keyer_ = std::make_unique<PageKeyer>(u.hc.key_namespace());
  const std::optional<PageDigest> prior = prior_of(prior_hex);
  std::vector<std::string> keys, hexes;
  std::vector<PageDigest> digests;
  keyer_->keys(tokens, prior ? &*prior : nullptr, keys, &digests);
  for (const PageDigest& d : digests) hexes.push_back(to_hex(d));
  return {std::move(keys), std::move(hexes)};
}

}  // namespace hicache::binding
