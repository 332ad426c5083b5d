// register_cache() (cache.h): HiCache's Python methods, each a thin call into hicache::HiCache
// through PyHiCache::use(), and the prefetch handle.
#include <pybind11/stl.h>

#include <algorithm>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "controller/config.h"
#include "controller/config_schema.h"
#include "python/binding/cache.h"
#include "transfer/errors.h"

namespace hicache::binding {

namespace {

// A Python call's sidecar pages, {pool name: (host_slots, device_slots)}, as the controller
// takes them (SidecarIo spans into `slots`). InvalidArgument names a pool the cache lacks.
struct SidecarArgs {
  std::vector<std::pair<std::vector<std::int64_t>, std::vector<std::int64_t>>> slots;
  std::vector<SidecarIo> io;

  SidecarArgs(HiCache& hc, const std::map<std::string, std::pair<std::vector<std::int64_t>,
                                                                 std::vector<std::int64_t>>>& given) {
    slots.reserve(given.size());
    for (const auto& [name, pair] : given) {
      const std::int32_t pool = hc.sidecar_index(name);
      slots.push_back(pair);
      io.push_back({pool, slots.back().first, slots.back().second});
    }
  }
};

using SidecarPairs =
    std::map<std::string, std::pair<std::vector<std::int64_t>, std::vector<std::int64_t>>>;

}  // namespace

void register_cache(py::module_& m) {
  m.def("validate_config",
        [](const std::string& text) { (void)HiCacheConfig::from_json_text(text); });
  m.def("config_reference", &config_reference_markdown);

  py::class_<PrefetchOperation, std::shared_ptr<PrefetchOperation>>(
      m, "PrefetchOperation", "The handle of one prefetch (StorageController)")
      .def_property_readonly("request_id", &PrefetchOperation::request_id)
      .def_property_readonly("stage",
                             [](const PrefetchOperation& op) {
                               switch (op.stage()) {
                                 case PrefetchStage::kQueued:
                                   return "queued";
                                 case PrefetchStage::kRevoked:
                                   return "revoked";
                                 case PrefetchStage::kLoading:
                                   return "loading";
                                 case PrefetchStage::kFinished:
                                   return "finished";
                                 case PrefetchStage::kTerminated:
                                   return "terminated";
                               }
                               return "?";
                             })
      .def_property_readonly("hit_tokens", &PrefetchOperation::hit_tokens)
      .def_property_readonly("completed_tokens", &PrefetchOperation::completed_tokens)
      .def_property_readonly("error", &PrefetchOperation::error);

  py::class_<PyHiCache>(m, "HiCache")
      .def(py::init<const std::string&, std::shared_ptr<PyStore>, py::object, py::object,
                    py::object, py::object, const std::string&, bool, py::object>(),
           py::arg("config_json"), py::arg("store"), py::arg("device_kv") = py::none(),
           py::arg("host_kv") = py::none(), py::arg("device_k") = py::none(),
           py::arg("device_v") = py::none(), py::arg("dim_order") = "sglang",
           py::arg("engine_allocator") = false, py::arg("sidecars") = py::none())
      // --- sidecar pools (a hybrid model's state: docs/hybrid.md) ----------------------------
      .def_property_readonly("sidecar_names",
                             [](PyHiCache& c) {
                               auto u = c.use();
                               std::vector<std::string> names;
                               for (std::size_t i = 0; i < u.hc.controller().num_sidecars(); ++i) {
                                 names.push_back(u.hc.controller().sidecar(i).spec().name);
                               }
                               return names;
                             })
      .def(
          "sidecar_alloc_device",
          [](PyHiCache& c, const std::string& name, std::int64_t pages) {
            SidecarPool& p = c.use().hc.sidecar_pool(name);
            return p.device_pool().allocator().alloc(pages * p.spec().slots_per_page);
          },
          py::arg("name"), py::arg("pages"))
      .def(
          "sidecar_free_device",
          [](PyHiCache& c, const std::string& name, const std::vector<std::int64_t>& slots) {
            c.use().hc.sidecar_pool(name).device_pool().allocator().free(slots);
          },
          py::arg("name"), py::arg("slots"))
      .def(
          "sidecar_free_host",
          [](PyHiCache& c, const std::string& name, const std::vector<std::int64_t>& slots) {
            c.use().hc.sidecar_pool(name).host_pool().free(slots);
          },
          py::arg("name"), py::arg("slots"))
      .def(
          "write_with_sidecars",
          [](PyHiCache& c, const std::vector<std::int64_t>& device_slots, NodeId node,
             const std::map<std::string, std::vector<std::int64_t>>& sidecars)
              -> std::optional<std::pair<std::vector<std::int64_t>,
                                         std::map<std::string, std::vector<std::int64_t>>>> {
            auto u = c.use();
            HiCacheController& ctl = u.hc.controller();
            for (const auto& [name, slots] : sidecars) (void)u.hc.sidecar_index(name);  // named
            auto kv = ctl.reserve_write(static_cast<std::int64_t>(device_slots.size()));
            if (!kv) return std::nullopt;
            // Each pool's host pages (as many as its device slots); none: all go back.
            SidecarPairs pairs;
            for (const auto& [name, slots] : sidecars) {
              auto host = u.hc.sidecar_pool(name).host_pool().alloc(
                  static_cast<std::int64_t>(slots.size()));
              if (!host) {
                for (const auto& [done, pair] : pairs) {
                  u.hc.sidecar_pool(done).host_pool().free(pair.first);
                }
                ctl.release_write(*kv);
                return std::nullopt;
              }
              pairs[name] = {std::move(*host), slots};
            }
            SidecarArgs args(u.hc, pairs);
            if (!ctl.write_reserved(device_slots, *kv, 0, node, nullptr, args.io)) {
              return std::nullopt;  // stopped: every reservation consumed
            }
            std::map<std::string, std::vector<std::int64_t>> hosts;
            for (auto& [name, pair] : pairs) hosts[name] = std::move(pair.first);
            return std::make_pair(std::move(*kv), std::move(hosts));
          },
          py::arg("device_slots"), py::arg("node_id"), py::arg("sidecars"))
      .def(
          "load_into_with_sidecars",
          [](PyHiCache& c, const std::vector<std::int64_t>& host_slots,
             const std::vector<std::int64_t>& device_slots, NodeId node,
             const SidecarPairs& sidecars) {
            auto u = c.use();
            SidecarArgs args(u.hc, sidecars);
            return u.hc.controller().load_into(host_slots, device_slots, 0, node, args.io);
          },
          py::arg("host_slots"), py::arg("device_slots"), py::arg("node_id"), py::arg("sidecars"))
      .def(
          "evict_device_with_sidecars",
          [](PyHiCache& c, const std::vector<std::int64_t>& device_slots,
             const std::vector<std::int64_t>& host_slots, const SidecarPairs& sidecars) {
            auto u = c.use();
            SidecarArgs args(u.hc, sidecars);
            return u.hc.controller().evict_device(device_slots, host_slots, args.io);
          },
          py::arg("device_slots"), py::arg("host_slots"), py::arg("sidecars"))
      .def(
          "alloc_device",
          [](PyHiCache& c, std::int64_t tokens) {
            return c.use().hc.device_pool().allocator().alloc(tokens);
          },
          py::arg("tokens"))
      .def(
          "free_device",
          [](PyHiCache& c, const std::vector<std::int64_t>& slots) {
            c.use().hc.device_pool().allocator().free(slots);
          },
          py::arg("slots"))
      .def(
          "write",
          [](PyHiCache& c, const std::vector<std::int64_t>& device_slots, NodeId node,
             std::optional<std::uintptr_t> stream) {
            auto u = c.use();
            return u.hc.controller().write(device_slots, 0, node,
                                           c.ready_for_write(u.hc, stream));
          },
          py::arg("device_slots"), py::arg("node_id"), py::arg("stream") = py::none())
      .def(
          "load_into",
          [](PyHiCache& c, const std::vector<std::int64_t>& host_slots,
             const std::vector<std::int64_t>& device_slots, NodeId node) {
            return c.use().hc.controller().load_into(host_slots, device_slots, 0, node);
          },
          py::arg("host_slots"), py::arg("device_slots"), py::arg("node_id"))
      .def(
          "evict_device",
          [](PyHiCache& c, const std::vector<std::int64_t>& device_slots,
             const std::vector<std::int64_t>& host_slots) {
            return c.use().hc.controller().evict_device(device_slots, host_slots);
          },
          py::arg("device_slots"), py::arg("host_slots"))
      .def(
          "start_loading",
          [](PyHiCache& c, std::optional<std::uintptr_t> stream) {
            auto u = c.use();
            const Event* ready = c.ready_for_load(u.hc, stream);
            py::gil_scoped_release nogil;  // blocks while every layer slot is still in use
            return u.hc.controller().start_loading(ready);
          },
          py::arg("stream") = py::none())
      .def(
          "wait_for_layer",
          [](PyHiCache& c, std::int32_t layer) {
            auto u = c.use();
            py::gil_scoped_release nogil;
            return u.hc.device_pool().wait_for_layer(layer);
          },
          py::arg("layer"))
      .def(
          "release_loading",
          [](PyHiCache& c, std::int32_t slot) {
            c.use().hc.controller().layer_done_counter().release(slot);
          },
          py::arg("slot"))
      // --- for a drop-in controller over the engine's allocators (hicache.sglang) -----
      .def("take_returned_device_slots", &PyHiCache::take_returned_device_slots)
      .def(
          "evict_device_returning",
          // evict_device, then the device slots hicache handed back (engine_allocator mode):
          // (pages' tokens evicted, None when they are exactly `device_slots`, else the list).
          // One call and no list back in the common case, for the drop-in's hot path.
          [](PyHiCache& c, const std::vector<std::int64_t>& device_slots,
             const std::vector<std::int64_t>& host_slots)
              -> std::pair<std::int64_t, std::optional<std::vector<std::int64_t>>> {
            const std::int64_t n =
                c.use().hc.controller().evict_device(device_slots, host_slots);
            std::vector<std::int64_t> returned = c.take_returned_device_slots();
            if (!returned.empty() && returned == device_slots) return {n, std::nullopt};
            return {n, std::move(returned)};
          },
          py::arg("device_slots"), py::arg("host_slots"))
      .def(
          "host_alloc",
          [](PyHiCache& c, std::int64_t tokens) { return c.use().hc.host_pool().alloc(tokens); },
          py::arg("tokens"))
      .def(
          "host_free",
          [](PyHiCache& c, const std::vector<std::int64_t>& slots) {
            c.use().hc.host_pool().free(slots);
          },
          py::arg("slots"))
      .def(
          "host_mark_synced",
          [](PyHiCache& c, const std::vector<std::int64_t>& slots) {
            c.use().hc.host_pool().mark_synced(slots);
          },
          py::arg("slots"))
      .def(
          "host_require_state",
          [](PyHiCache& c, const std::vector<std::int64_t>& slots, const std::string& state,
             const std::string& what) {
            c.use().hc.host_pool().require_state(slots, parse_page_state(state), what);
          },
          py::arg("slots"), py::arg("state"), py::arg("what"))
      .def(
          "host_all_in_state",
          [](PyHiCache& c, const std::vector<std::int64_t>& slots, const std::string& state) {
            return c.use().hc.host_pool().all_in_state(slots, parse_page_state(state));
          },
          py::arg("slots"), py::arg("state"))
      .def(
          "host_states",
          [](PyHiCache& c, const std::vector<std::int64_t>& slots) {
            auto u = c.use();
            const std::int64_t page = u.hc.config().geometry.page_size;
            std::vector<std::string> out;
            for (std::size_t i = 0; i < slots.size(); i += static_cast<std::size_t>(page)) {
              out.emplace_back(to_string(u.hc.host_pool().page_state(slots[i] / page)));
            }
            return out;
          },
          py::arg("slots"))
      .def("host_reset", [](PyHiCache& c) { c.use().hc.host_pool().reset(); })
      .def_property_readonly("host_free_tokens",
                             [](PyHiCache& c) { return c.use().hc.host_pool().free_tokens(); })
      .def(
          "evict_host",
          [](PyHiCache& c, const std::vector<std::int64_t>& host_slots) {
            return c.use().hc.controller().evict_host(host_slots);
          },
          py::arg("host_slots"))
      .def(
          "wait_layer",
          [](PyHiCache& c, std::int32_t slot, std::int32_t layer,
             std::optional<std::uintptr_t> stream) {
            auto u = c.use();
            Stream* compute = c.engine_stream(u.hc, stream);
            py::gil_scoped_release nogil;
            LayerDoneCounter& counter = u.hc.controller().layer_done_counter();
            // With a stream: the host waits only until the layer's copy is enqueued, and the
            // stream waits for the copy on the device.
            return compute != nullptr ? counter.wait_on_stream(slot, layer, *compute)
                                      : counter.wait_until(slot, layer);
          },
          py::arg("slot"), py::arg("layer"), py::arg("stream") = py::none())
      .def_property_readonly("num_layers",
                             [](PyHiCache& c) { return c.use().hc.config().geometry.num_layers; })
      .def("reset_controllers",
           [](PyHiCache& c) {
             auto u = c.use();
             py::gil_scoped_release nogil;  // joins threads, waits for storage ops to agree
             if (StorageController* sc = u.hc.storage_controller()) sc->reset();
             u.hc.controller().reset();
           })
      .def("page_keys", &PyHiCache::page_keys, py::arg("tokens"), py::arg("prior_hex"))
      .def(
          "write_storage",
          [](PyHiCache& c, const std::vector<std::int64_t>& host_slots,
             std::vector<std::string> keys) {
            auto u = c.use();
            return c.storage_controller(u.hc).write_storage(host_slots, std::move(keys));
          },
          py::arg("host_slots"), py::arg("keys"))
      .def(
          "drain_backup_acks",
          [](PyHiCache& c, std::size_t n, double timeout_s) {
            auto u = c.use();
            std::vector<BackupAck> acks;
            c.drain_waiting(u.hc, n, timeout_s, [&](StorageController& sc) {
              sc.drain_backup_acks(acks);
              return acks.size();
            });
            std::vector<std::tuple<std::int64_t, std::int64_t, std::int64_t, std::string>> out;
            for (BackupAck& a : acks) {
              out.emplace_back(a.id, a.completed_tokens, a.total_tokens, std::move(a.error));
            }
            return out;
          },
          py::arg("n") = 0, py::arg("timeout_s") = 0.0)
      .def(
          "drain_revokes",
          [](PyHiCache& c, std::size_t n, double timeout_s) {
            auto u = c.use();
            std::vector<std::string> out;
            c.drain_waiting(u.hc, n, timeout_s, [&](StorageController& sc) {
              sc.drain_revokes(out);
              return out.size();
            });
            return out;
          },
          py::arg("n") = 0, py::arg("timeout_s") = 0.0)
      .def(
          "prefetch_into",
          [](PyHiCache& c, std::string request_id, const std::vector<std::int32_t>& tokens,
             const std::optional<std::string>& prior_hex,
             const std::vector<std::int64_t>& host_slots) {
            auto u = c.use();
            return c.storage_controller(u.hc).prefetch_into(std::move(request_id), tokens,
                                                            prior_of(prior_hex), host_slots);
          },
          py::arg("request_id"), py::arg("tokens"), py::arg("prior_hex"), py::arg("host_slots"))
      .def(
          "terminate_prefetch",
          [](PyHiCache& c, PrefetchOperation& op) {
            auto u = c.use();
            StorageController& sc = c.storage_controller(u.hc);
            PrefetchResult r;
            {
              py::gil_scoped_release nogil;  // waits for the agreement and the batch in flight
              r = sc.terminate_prefetch(op);
            }
            std::vector<std::string> hexes;
            const std::size_t cut = u.hc.key_namespace().prefix().size() + 1;  // "<prefix>-"
            for (const std::string& k : r.keys) hexes.push_back(k.substr(std::min(cut, k.size())));
            return std::make_tuple(r.tokens, std::move(r.host_slots), std::move(hexes));
          },
          py::arg("op"))
      .def("wait_acks", &PyHiCache::wait_acks, py::arg("kind"), py::arg("n"),
           py::arg("timeout_s") = 60.0)
      .def("close", &PyHiCache::close)
      .def("detach_storage", &PyHiCache::detach_storage)
      .def("attach_storage", &PyHiCache::attach_storage, py::arg("store"))
      .def("clear_storage", &PyHiCache::clear_storage)
      .def_property_readonly("store", &PyHiCache::store)
      .def_property_readonly("key_prefix",
                             [](PyHiCache& c) { return c.use().hc.key_namespace().prefix(); })
      .def_property_readonly("metrics_port", [](PyHiCache& c) { return c.use().hc.metrics_port(); })
      .def_property_readonly("device_tokens",
                             [](PyHiCache& c) { return c.use().hc.config().device_tokens; })
      .def_property_readonly("host_tokens",
                             [](PyHiCache& c) { return c.use().hc.config().host_tokens(); })
      .def_property_readonly("page_size",
                             [](PyHiCache& c) { return c.use().hc.config().geometry.page_size; })
      .def("metrics_json", [](PyHiCache& c) { return c.use().hc.metrics().json_text(); })
      .def("metrics_text", [](PyHiCache& c) { return c.use().hc.metrics().prometheus_text(); })
      .def(
          "cached_prefix_tokens",
          [](PyHiCache& c, const std::vector<std::int32_t>& tokens) {
            return c.use().hc.cache().cached_prefix_tokens(tokens);
          },
          py::arg("tokens"));
}

}  // namespace hicache::binding
