#include "controller/hicache.h"

#include <exception>
#include <nlohmann/json.hpp>

#include "controller/metrics_aliases.h"
#include "transfer/errors.h"

namespace hicache {
namespace {

KeyNamespace derive_namespace(const HiCacheConfig& c) {
  KeyNamespace ns{.model = c.model_name,
                  .fingerprint = c.model_fingerprint,
                  .dtype = std::string(to_string(c.geometry.dtype)),
                  .layout = std::string(to_string(c.host_layout)),
                  .page_size = c.geometry.page_size,
                  .tp_rank = c.tp.rank,
                  .tp_size = c.tp.size,
                  .mla = c.geometry.attention == AttentionKind::kMLA};
  (void)ns.prefix();  // names an empty field now, before anything starts
  return ns;
}

void check_collectives(const HiCacheCollectives& given, const TensorParallelConfig& tp) {
  Collective* all[] = {given.prefetch, given.backup, given.main};
  const char* names[] = {"prefetch", "backup", "main"};
  for (int i = 0; i < 3; ++i) {
    if (all[i] == nullptr) {
      throw InvalidArgument(str_cat("HiCache: the ", names[i],
                                    " collective is missing (give all three, or none)"));
    }
    if (all[i]->rank() != tp.rank || all[i]->size() != tp.size) {
      throw InvalidArgument(str_cat("HiCache: the ", names[i], " collective is rank ",
                                    all[i]->rank(), " of ", all[i]->size(),
                                    ", the config says tp_rank ", tp.rank, " of tp_size ",
                                    tp.size));
    }
  }
  if (tp.size > 1 && (given.prefetch == given.backup || given.prefetch == given.main ||
                      given.backup == given.main)) {
    throw InvalidArgument(
        "HiCache: the prefetch, backup and main collectives must be separate groups with more "
        "than one rank (each thread agrees on its own stream of calls)");
  }
}

// The store config as HiCache opens it. A file store of an MLA model under TP is shared: every
// rank reads the records rank 0 writes (docs/configuration.md, "shared"); "shared": false is
// refused there, naming the value. Anything else is passed on as it is (make_storage checks it).
std::string storage_json_for(const HiCacheConfig& c, const std::string& json_text) {
  if (c.geometry.attention != AttentionKind::kMLA || c.tp.size <= 1) return json_text;
  auto j = nlohmann::json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || j.value("backend", nlohmann::json()) != "file") return json_text;
  if (const auto it = j.find("shared"); it != j.end() && *it == false) {
    throw InvalidArgument(str_cat("storage: \"shared\": false, but an MLA model under TP (tp_size ",
                                  c.tp.size, ") shares its pages between the ranks; leave "
                                  "\"shared\" unset"));
  }
  j["shared"] = true;
  return j.dump();
}

}  // namespace

HiCache::HiCache(const HiCacheConfig& config, HiCacheParts parts)
    : config_(config),
      device_(parts.device),
      storage_(std::move(parts.storage)),
      wrap_storage_(std::move(parts.wrap_storage)) {
  if (parts.device_kv && (!parts.device_k.empty() || !parts.device_v.empty())) {
    throw InvalidArgument("HiCache: the engine's device KV is one buffer (device_kv) or per-layer "
                          "buffers (device_k, device_v), not both");
  }
  if (parts.device_allocator != nullptr && !parts.device_kv && parts.device_k.empty()) {
    throw InvalidArgument("HiCache: an engine allocator (device_allocator) hands out slots of the "
                          "engine's device KV memory: pass that memory too");
  }
  // Everything that can be refused is refused before a thread starts.
  config_.validate();
  if (storage_ && !config_.radix.host_tier) {
    throw InvalidArgument("HiCache: a storage tier needs the host tier (host_tier is false)");
  }
  ns_ = derive_namespace(config_);
  const bool any_collective = parts.collectives.prefetch || parts.collectives.backup ||
                              parts.collectives.main;
  if (any_collective) check_collectives(parts.collectives, config_.tp);
  if (!any_collective && config_.tp.size > 1) {
    validate_group_config("config: tp", config_.tp.rank, config_.tp.size, config_.tp.store_dir,
                          config_.tp.timeout);
  }

  if (device_ == nullptr) {
    owned_device_ = Device::create(config_.device);
    device_ = owned_device_.get();
  }
  if (!storage_ && !config_.storage.empty()) {
    storage_ = open_storage(config_.storage);
  }

  if (any_collective) {
    collectives_ = parts.collectives;
  } else if (config_.tp.size == 1) {
    // A collective of one rank never waits: one serves every role.
    owned_collectives_[0] = std::make_unique<LocalCollective>();
    collectives_ = {owned_collectives_[0].get(), owned_collectives_[0].get(),
                    owned_collectives_[0].get()};
  } else {
    const char* roles[] = {"prefetch", "backup", "main"};
    for (int i = 0; i < 3; ++i) {
      owned_collectives_[i] = make_tp_group(roles[i]);
    }
    collectives_ = {owned_collectives_[0].get(), owned_collectives_[1].get(),
                    owned_collectives_[2].get()};
  }

  const auto& g = config_.geometry;
  if (parts.device_kv) {
    device_pool_ = std::make_unique<DeviceKVPool>(*device_, g, config_.device_tokens,
                                                  *parts.device_kv, parts.device_allocator);
  } else if (!parts.device_k.empty()) {
    device_pool_ = std::make_unique<DeviceKVPool>(*device_, g, config_.device_tokens,
                                                  parts.device_k, parts.device_v,
                                                  parts.device_layer_bytes, parts.device_allocator);
  } else {
    device_pool_ = std::make_unique<DeviceKVPool>(*device_, g, config_.device_tokens);
  }
  const std::int64_t host_tokens = config_.radix.host_tier ? config_.host_tokens() : g.page_size;
  if (parts.host_kv) {
    host_pool_ = std::make_unique<HostKVPool>(*device_, g, config_.host_layout, host_tokens,
                                              *parts.host_kv);
  } else {
    host_pool_ = std::make_unique<HostKVPool>(*device_, g, config_.host_layout, host_tokens);
  }
  std::vector<SidecarPool*> sidecars;
  for (const auto& entry : parts.sidecar_device) {
    const std::string& name = entry.first;  // a structured binding: clang 15 cannot capture it
    if (std::none_of(config_.sidecars.begin(), config_.sidecars.end(),
                     [&](const SidecarSpec& s) { return s.name == name; })) {
      throw InvalidArgument(str_cat("HiCache: device memory for sidecar pool '", name,
                                    "', which the config does not declare"));
    }
  }
  for (const SidecarSpec& spec : config_.sidecars) {
    const auto engine = parts.sidecar_device.find(spec.name);
    sidecar_pools_.push_back(engine == parts.sidecar_device.end()
                                 ? std::make_unique<SidecarPool>(*device_, spec)
                                 : std::make_unique<SidecarPool>(*device_, spec, engine->second));
    sidecars.push_back(sidecar_pools_.back().get());
  }
  controller_ = std::make_unique<HiCacheController>(*device_, *device_pool_, *host_pool_,
                                                    config_.controller, sidecars);
  try {
    if (storage_) {
      auto sc = config_.storage_controller;
      sc.mla = g.attention == AttentionKind::kMLA;
      storage_controller_ = std::make_unique<StorageController>(
          *host_pool_, *storage_, ns_, *collectives_.prefetch, *collectives_.backup,
          *collectives_.main, sc, sidecars);
    }
    cache_ = std::make_unique<HiRadixCache>(
        *controller_, *device_pool_, *host_pool_, config_.radix, storage_controller_.get(),
        storage_controller_ ? &ns_ : nullptr, config_.tp.size > 1 ? collectives_.main : nullptr);
    const MetricLabels rank = {{"tp_rank", std::to_string(config_.tp.rank)}};
    if (config_.metrics) {
      controller_->register_metrics(*metrics_, rank);
      cache_->register_metrics(*metrics_, rank);
      if (storage_controller_) storage_controller_->register_metrics(*metrics_, rank);
      if (storage_) storage_->register_metrics(*metrics_, rank);
      // SGLang's, vLLM's and LMCache's names; model_name as SGLang's series carry it.
      register_engine_metric_aliases(*metrics_, this, {{"model_name", config_.model_name}});
    }
    if (!config_.kv_events.endpoint.empty() && config_.tp.rank == config_.kv_events_publish_rank) {
      kv_events_ = std::make_unique<KvEventPublisher>(config_.kv_events,
                                                      config_.metrics ? metrics_.get() : nullptr);
      cache_->publish_kv_events(*kv_events_);
      observe_removals();
    }
    if (config_.metrics_port >= 0) {
      metrics_server_ =
          std::make_unique<MetricsServer>(*metrics_, config_.metrics_bind, config_.metrics_port);
    }
  } catch (...) {
    stop();
    if (storage_) storage_->set_removal_observer({});
    throw;
  }
}

HiCache::~HiCache() {
  stop();
  if (storage_) storage_->set_removal_observer({});  // a shared store outlives the cache
  cache_.reset();  // each part forgets its metrics as it goes
  storage_controller_.reset();
  controller_.reset();
  host_pool_.reset();
  device_pool_.reset();
  // A store the engine shares may outlive this cache and its registry.
  if (storage_) storage_->unregister_metrics();
  storage_.reset();
}

std::unique_ptr<Collective> HiCache::make_tp_group(const std::string& role) const {
  // Named after the namespace every rank shares: this rank's own names its TP slice.
  KeyNamespace group = ns_;
  group.tp_rank = 0;
  return make_gloo_collective(GlooConfig{.rank = config_.tp.rank,
                                         .size = config_.tp.size,
                                         .store_dir = config_.tp.store_dir,
                                         .prefix = str_cat("hicache.", group.prefix(), ".", role),
                                         .hostname = config_.tp.hostname,
                                         .timeout = config_.tp.timeout,
                                         .connect_timeout = config_.tp.connect_timeout});
}

std::int32_t HiCache::sidecar_index(std::string_view name) const {
  std::string names;
  for (std::size_t i = 0; i < sidecar_pools_.size(); ++i) {
    if (sidecar_pools_[i]->spec().name == name) return static_cast<std::int32_t>(i);
    names += str_cat(i ? ", " : "", sidecar_pools_[i]->spec().name);
  }
  throw InvalidArgument(str_cat("HiCache: no sidecar pool '", name, "' (the config has ",
                                names.empty() ? std::string("none") : names, ")"));
}

void HiCache::detach_storage() {
  if (!storage_controller_) return;
  cache_->detach_storage();
  storage_controller_.reset();  // forgets its metrics
  if (storage_) storage_->set_removal_observer({});
  if (storage_) storage_->unregister_metrics();
  storage_.reset();
}

void HiCache::attach_storage(const std::string& storage_json, HiCacheCollectives collectives) {
  if (storage_controller_) throw StateError("attach_storage: L3 is attached already");
  const std::string& json = storage_json.empty() ? config_.storage : storage_json;
  if (json.empty()) throw InvalidArgument("attach_storage: no storage config (empty)");
  // A rank whose store cannot be opened still joins the agreement (attach_agreed), so that no
  // rank attaches alone.
  std::shared_ptr<StorageBackend> store;
  std::exception_ptr error;
  try {
    store = open_storage(json);
  } catch (...) {
    error = std::current_exception();
  }
  attach_agreed(std::move(store), error, collectives);
}

std::shared_ptr<StorageBackend> HiCache::open_storage(const std::string& json) const {
  std::unique_ptr<StorageBackend> store = make_storage(storage_json_for(config_, json));
  if (!wrap_storage_) return store;
  std::shared_ptr<StorageBackend> wrapped = wrap_storage_(std::move(store));
  if (!wrapped) throw InvalidArgument("HiCache: wrap_storage returned no store (null)");
  return wrapped;
}

void HiCache::attach_storage(std::shared_ptr<StorageBackend> store,
                             HiCacheCollectives collectives) {
  attach_agreed(std::move(store), nullptr, collectives);
}

void HiCache::attach_agreed(std::shared_ptr<StorageBackend> store, std::exception_ptr error,
                            HiCacheCollectives collectives) {
  if (stopped_) throw StateError("attach_storage: the cache is stopped");
  if (storage_controller_) throw StateError("attach_storage: L3 is attached already");
  if (!config_.radix.host_tier) {
    throw InvalidArgument("attach_storage: a storage tier needs the host tier (host_tier is false)");
  }
  if (!store && !error) {
    error = std::make_exception_ptr(InvalidArgument("attach_storage: no store (null)"));
  }
  Collective* pre = collectives.prefetch != nullptr ? collectives.prefetch : collectives_.prefetch;
  Collective* back = collectives.backup != nullptr ? collectives.backup : collectives_.backup;
  bool renew[2] = {false, false};
  for (int role = 0; role < 2; ++role) {
    Collective* c = role == 0 ? pre : back;
    c->resume();
    renew[role] = !c->failure().empty();
  }
  // TP: every rank opened its store, and all renew the same groups, or none attaches (a rank
  // with L3 alone would make collective calls the others never make).
  if (config_.tp.size > 1) {
    std::vector<std::int64_t> v = {error ? 0 : 1, renew[0] ? 0 : 1, renew[1] ? 0 : 1};
    if (!collectives_.main->min_allreduce(v, "hicache.attach_storage").ok) {
      throw StateError(str_cat("attach_storage: the TP agreement failed (",
                               collectives_.main->failure(), ")"));
    }
    if (v[0] == 0 && !error) {
      throw StateError("attach_storage: another TP rank could not open its store");
    }
    renew[0] = v[1] == 0;
    renew[1] = v[2] == 0;
  }
  if (error) std::rethrow_exception(error);
  for (int role = 0; role < 2; ++role) {
    if (!renew[role]) continue;
    Collective*& c = role == 0 ? pre : back;
    const char* name = role == 0 ? "prefetch" : "backup";
    if (owned_collectives_[role] == nullptr || owned_collectives_[role].get() != c ||
        config_.tp.size == 1) {
      throw StateError(str_cat("attach_storage: the ", name, " collective failed for good (",
                               c->failure(), "): pass fresh collectives"));
    }
    // A fresh group of the same ranks (every rank renews it at the same step and meets again);
    // the cache's pointer follows at once, so a failure below leaves nothing dangling.
    ++group_renewals_;
    owned_collectives_[role] = make_tp_group(str_cat(name, ".a", group_renewals_));
    c = owned_collectives_[role].get();
    (role == 0 ? collectives_.prefetch : collectives_.backup) = c;
  }
  auto sc = config_.storage_controller;
  sc.mla = config_.geometry.attention == AttentionKind::kMLA;
  std::vector<SidecarPool*> sidecars;
  for (const auto& pool : sidecar_pools_) sidecars.push_back(pool.get());
  auto controller = std::make_unique<StorageController>(*host_pool_, *store, ns_, *pre, *back,
                                                        *collectives_.main, sc, sidecars);
  cache_->attach_storage(*controller, ns_);
  collectives_.prefetch = pre;
  collectives_.backup = back;
  storage_ = std::move(store);
  storage_controller_ = std::move(controller);
  observe_removals();
  if (config_.metrics) {
    const MetricLabels rank = {{"tp_rank", std::to_string(config_.tp.rank)}};
    storage_controller_->register_metrics(*metrics_, rank);
    storage_->register_metrics(*metrics_, rank);
  }
}

void HiCache::observe_removals() {
  if (!kv_events_ || !storage_) return;
  storage_->set_removal_observer(
      [cache = cache_.get()](std::span<const std::string> keys) { cache->l3_records_removed(keys); });
}

void HiCache::clear_storage() {
  if (!storage_) return;
  storage_->clear();
  cache_->forget_stored_pages();
}

void HiCache::stop() {
  if (stopped_) return;
  stopped_ = true;
  metrics_server_.reset();  // no scrape reads a part that goes next
  if (storage_controller_) storage_controller_->stop();
  if (controller_) controller_->stop();
}

}  // namespace hicache
