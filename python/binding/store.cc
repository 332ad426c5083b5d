// See store.h.
#include "python/binding/store.h"

#include <pybind11/stl.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>

#include "python/binding/buffers.h"
#include "storage/page_key.h"
#include "transfer/errors.h"

namespace hicache::binding {
namespace {

void check_ranges(const std::vector<std::string>& keys, const Ranges& ranges, bool get) {
  if (keys.size() != ranges.size()) {
    throw InvalidArgument(str_cat(get ? "batch_get_ptrs" : "batch_set_ptrs", ": ", keys.size(),
                                  " keys but ", ranges.size(), " range lists"));
  }
  for (std::size_t i = 0; i < ranges.size(); ++i) {
    if (ranges[i].empty()) throw InvalidArgument(str_cat("key '", keys[i], "': no ranges"));
    for (const auto& [p, n] : ranges[i]) {
      if (p == 0 || n == 0) {
        throw InvalidArgument(
            str_cat("key '", keys[i], "': range (", p, ", ", n, ") is null or empty"));
      }
    }
  }
}

// Without the GIL: one range moves in place; several are gathered into (scattered from) one
// record through a staging buffer. `staged` (get only) reads every record through a staging
// buffer, so that a record the store rejects (corrupt, truncated, foreign) leaves the caller's
// memory untouched: its bytes are copied out only when the record was good.
std::vector<IoResult> move_ranges(StorageBackend& store, const std::vector<std::string>& keys,
                                  const Ranges& ranges, bool get, bool staged = false) {
  std::vector<std::vector<std::byte>> staging(keys.size());
  std::vector<ByteSpan> spans(keys.size());
  for (std::size_t i = 0; i < keys.size(); ++i) {
    if (ranges[i].size() == 1 && !(get && staged)) {
      spans[i] = ByteSpan(reinterpret_cast<std::byte*>(ranges[i][0].first), ranges[i][0].second);
      continue;
    }
    std::size_t total = 0;
    for (const auto& r : ranges[i]) total += r.second;
    staging[i].resize(total);
    spans[i] = ByteSpan(staging[i]);
    if (!get) {
      std::size_t at = 0;
      for (const auto& [p, n] : ranges[i]) {
        std::memcpy(staging[i].data() + at, reinterpret_cast<const void*>(p), n);
        at += n;
      }
    }
  }
  if (!get) {
    std::vector<ConstByteSpan> src(spans.begin(), spans.end());
    return store.batch_set(keys, src);
  }
  std::vector<IoResult> out = store.batch_get(keys, spans);
  for (std::size_t i = 0; i < keys.size(); ++i) {
    if (staging[i].empty() || !out[i].is_ok()) continue;
    std::size_t at = 0;
    for (const auto& [p, n] : ranges[i]) {
      std::memcpy(reinterpret_cast<void*>(p), staging[i].data() + at, n);
      at += n;
    }
  }
  return out;
}

std::vector<IoResult> io_ptrs(StorageBackend& store, const std::vector<std::string>& keys,
                              const Ranges& ranges, bool get, bool staged = false) {
  check_ranges(keys, ranges, get);
  py::gil_scoped_release nogil;
  return move_ranges(store, keys, ranges, get, staged);
}

}  // namespace

void PageLayout::names(const std::string& key, std::vector<std::string>& out) const {
  if (mla) {
    out.push_back(str_cat(prefix, "-", key, "-kv"));
  } else {
    out.push_back(str_cat(prefix, "-", key, "-k"));
    out.push_back(str_cat(prefix, "-", key, "-v"));
  }
}

void PageLayout::ranges(std::int64_t slot, Ranges& out) const {
  if (slot < 0 || slot >= slots || slot % page != 0) {
    throw InvalidArgument(str_cat("hicache: host slot ", slot,
                                  " does not start a page of the pool (page size ", page, ", ",
                                  slots, " slots)"));
  }
  const auto s = static_cast<std::uintptr_t>(slot);
  const auto p = static_cast<std::uintptr_t>(page), l = static_cast<std::uintptr_t>(layers);
  for (int r = 0; r < records(); ++r) {
    const std::uintptr_t start = base + (r == 0 ? 0 : half);
    auto& v = out.emplace_back();
    if (layout == "layer_first") {
      for (std::uintptr_t layer = 0; layer < l; ++layer) {
        v.emplace_back(start + (layer * static_cast<std::uintptr_t>(slots) + s) * row_bytes,
                       p * row_bytes);
      }
    } else if (layout == "page_first") {
      v.emplace_back(start + s * l * row_bytes, record_bytes());
    } else {
      v.emplace_back(start + (s / p) * l * p * row_bytes, record_bytes());
    }
  }
}

std::size_t PyStore::batch_exists(const py::sequence& keys) {
  const auto k = keys_of(keys);
  py::gil_scoped_release nogil;
  return store_->batch_exists(k);
}

std::vector<IoResult> PyStore::batch_get(const py::sequence& keys, const py::sequence& buffers) {
  return io(keys, buffers, true);
}
std::vector<IoResult> PyStore::batch_set(const py::sequence& keys, const py::sequence& buffers) {
  return io(keys, buffers, false);
}

std::vector<bool> PyStore::exists_each(const py::sequence& keys) {
  const auto k = keys_of(keys);
  py::gil_scoped_release nogil;
  return store_->exists_each(k);  // Redis: one round trip
}

std::vector<IoResult> PyStore::batch_get_ptrs(const py::sequence& keys, const Ranges& ranges,
                                              bool staged) {
  return io_ptrs(*store_, keys_of(keys), ranges, true, staged);
}
std::vector<IoResult> PyStore::batch_set_ptrs(const py::sequence& keys, const Ranges& ranges) {
  return io_ptrs(*store_, keys_of(keys), ranges, false);
}

std::vector<bool> PyStore::pages_io(const PageLayout& layout, const py::sequence& keys,
                                    py::handle host_indices, bool get) {
  const auto k = keys_of(keys);
  const auto slots = page_slots(host_indices, k.size(), layout.page);
  std::vector<std::string> names;
  Ranges ranges;
  names.reserve(k.size() * 2);
  ranges.reserve(k.size() * 2);
  for (std::size_t i = 0; i < k.size(); ++i) {
    layout.names(k[i], names);
    layout.ranges(slots[i], ranges);
  }
  std::vector<IoResult> results;
  {
    py::gil_scoped_release nogil;
    results = move_ranges(*store_, names, ranges, get);
  }
  std::vector<bool> out(k.size(), true);
  const auto per = static_cast<std::size_t>(layout.records());
  for (std::size_t i = 0; i < results.size(); ++i) {
    if (!results[i].is_ok()) out[i / per] = false;
  }
  return out;
}
std::size_t PyStore::pages_exist(const PageLayout& layout, const py::sequence& keys) {
  const auto k = keys_of(keys);
  std::vector<std::string> names;
  for (const auto& key : k) layout.names(key, names);
  std::size_t hit = 0;
  {
    py::gil_scoped_release nogil;
    hit = store_->batch_exists(names);
  }
  return hit / static_cast<std::size_t>(layout.records());
}

bool PyStore::remove(const std::string& key) {
  py::gil_scoped_release nogil;
  return store_->remove(key);
}
void PyStore::clear() {
  py::gil_scoped_release nogil;
  store_->clear();
}
std::vector<IoResult> PyStore::io(const py::sequence& keys, const py::sequence& buffers, bool get) {
  const auto k = keys_of(keys);
  if (k.size() != buffers.size()) {
    throw InvalidArgument(str_cat(get ? "batch_get" : "batch_set", ": ", k.size(), " keys but ",
                                  buffers.size(), " buffers"));
  }
  std::vector<Region> regions;
  regions.reserve(k.size());
  for (std::size_t i = 0; i < k.size(); ++i) regions.push_back(region_of(buffers[i], get, i));
  std::vector<IoResult> out;
  {
    py::gil_scoped_release nogil;
    if (get) {
      std::vector<ByteSpan> spans;
      for (const Region& r : regions) spans.emplace_back(r.data, r.size);
      out = store_->batch_get(k, spans);
    } else {
      std::vector<ConstByteSpan> spans;
      for (const Region& r : regions) spans.emplace_back(r.data, r.size);
      out = store_->batch_set(k, spans);
    }
  }
  return out;  // the views are released here, with the GIL
}

double PyStore::time_batches(const std::vector<std::vector<std::string>>& keys,
                             const std::vector<Ranges>& ranges, bool get, int threads) {
  if (keys.size() != ranges.size() || threads < 1) {
    throw InvalidArgument(str_cat("time_batches: ", keys.size(), " key batches, ", ranges.size(),
                                  " range batches, ", threads, " threads"));
  }
  for (std::size_t b = 0; b < keys.size(); ++b) check_ranges(keys[b], ranges[b], get);
  py::gil_scoped_release nogil;
  std::atomic<bool> failed{false};
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      for (std::size_t b = static_cast<std::size_t>(t); b < keys.size();
           b += static_cast<std::size_t>(threads)) {
        for (const IoResult& r : move_ranges(*store_, keys[b], ranges[b], get)) {
          if (!r.is_ok()) failed = true;
        }
      }
    });
  }
  for (auto& th : pool) th.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (failed) throw Error("time_batches: a key did not move");
  return s;
}

void register_store(py::module_& m) {
  py::class_<IoResult>(m, "IoResult", "Outcome of one key: status 'ok', 'miss' or 'error'")
      .def_property_readonly("status",
                             [](const IoResult& r) { return std::string(to_string(r.status)); })
      .def_readonly("reason", &IoResult::reason)
      .def_property_readonly("ok", &IoResult::is_ok)
      .def("__bool__", &IoResult::is_ok)
      .def("__repr__", [](const IoResult& r) {
        return str_cat("IoResult(", to_string(r.status), r.reason.empty() ? "" : ": ", r.reason,
                       ")");
      });

  m.def(
      "key_prefix",
      [](const std::string& model, const std::string& fingerprint, const std::string& dtype,
         const std::string& layout, std::int64_t page_size, int tp_rank, int tp_size, bool mla) {
        KeyNamespace ns{model, fingerprint, dtype, layout, page_size, tp_rank, tp_size, mla};
        return ns.prefix();
      },
      py::arg("model"), py::arg("fingerprint"), py::arg("dtype"), py::arg("layout"),
      py::arg("page_size"), py::arg("tp_rank"), py::arg("tp_size"), py::arg("mla"));
  m.def("validate_key", &validate_key);

  py::class_<PageLayout>(m, "PageLayout")
      .def(py::init([](std::string prefix, std::string layout, bool mla, std::int64_t page,
                       std::int64_t layers, std::int64_t slots, std::size_t row_bytes,
                       std::uintptr_t base, std::size_t half) {
             if (layout != "layer_first" && layout != "page_first" &&
                 layout != "page_first_direct") {
               throw InvalidArgument(str_cat("hicache: layout '", layout, "'"));
             }
             if (page < 1 || layers < 1 || slots < page || row_bytes == 0 || base == 0) {
               throw InvalidArgument(str_cat("hicache: page layout page ", page, ", layers ",
                                             layers, ", slots ", slots, ", row bytes ", row_bytes));
             }
             return PageLayout{std::move(prefix),
                               std::move(layout),
                               mla,
                               page,
                               layers,
                               slots,
                               row_bytes,
                               base,
                               half};
           }),
           py::arg("prefix"), py::arg("layout"), py::arg("mla"), py::arg("page"), py::arg("layers"),
           py::arg("slots"), py::arg("row_bytes"), py::arg("base"), py::arg("half"))
      .def_property_readonly("record_bytes", &PageLayout::record_bytes)
      .def_property_readonly("records", &PageLayout::records)
      .def("names",
           [](const PageLayout& l, const std::string& key) {
             std::vector<std::string> out;
             l.names(key, out);
             return out;
           })
      .def("ranges", [](const PageLayout& l, std::int64_t slot) {
        Ranges out;
        l.ranges(slot, out);
        return out;
      });

  py::class_<PyStore, std::shared_ptr<PyStore>>(m, "Store")
      .def(py::init([](const std::string& json_text) {
             std::shared_ptr<StorageBackend> backend;
             {
               py::gil_scoped_release nogil;  // a Redis store connects
               backend = make_storage(json_text);
             }
             return std::make_shared<PyStore>(std::move(backend));
           }),
           py::arg("json_text"))
      .def_property_readonly("name", &PyStore::name)
      .def("batch_exists", &PyStore::batch_exists, py::arg("keys"))
      .def("batch_get", &PyStore::batch_get, py::arg("keys"), py::arg("buffers"))
      .def("batch_set", &PyStore::batch_set, py::arg("keys"), py::arg("buffers"))
      .def("exists_each", &PyStore::exists_each, py::arg("keys"))
      .def("batch_get_ptrs", &PyStore::batch_get_ptrs, py::arg("keys"), py::arg("ranges"),
           py::arg("staged") = false)
      .def("batch_set_ptrs", &PyStore::batch_set_ptrs, py::arg("keys"), py::arg("ranges"))
      .def("pages_io", &PyStore::pages_io, py::arg("layout"), py::arg("keys"),
           py::arg("host_indices"), py::arg("get"))
      .def("pages_exist", &PyStore::pages_exist, py::arg("layout"), py::arg("keys"))
      .def("time_batches", &PyStore::time_batches, py::arg("keys"), py::arg("ranges"),
           py::arg("get"), py::arg("threads"))
      .def("remove", &PyStore::remove, py::arg("key"))
      .def("clear", &PyStore::clear)
      .def("stats_json", &PyStore::stats_json)
      .def("metrics_json", &PyStore::metrics_json)
      .def("metrics_text", &PyStore::metrics_text);
}

}  // namespace hicache::binding
