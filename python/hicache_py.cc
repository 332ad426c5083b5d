// hicache._hicache: the C++ library as a Python extension (pybind11). The Python package
// (python/hicache/) wraps it; see there for the public surface.
//
// Memory comes in by pointer and is never copied on the way in: torch tensors (data_ptr) and
// objects with the buffer protocol. The GIL is released around every call that does I/O or
// waits. C++ errors become Python exceptions: InvalidArgument -> ValueError, IoError (a store
// directory that cannot be created or opened) -> OSError, other hicache errors -> RuntimeError;
// per-key I/O results stay values (IoResult).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <thread>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "controller/config.h"
#include "controller/config_schema.h"
#include "controller/hicache.h"
#include "controller/hi_radix_cache.h"
#include "controller/storage_controller.h"
#include "pools/paged_token_allocator.h"
#include "storage/page_key.h"
#include "storage/storage_backend.h"
#include "transfer/errors.h"
#include "transfer/metrics.h"

namespace py = pybind11;

namespace hicache {
namespace {

// One contiguous range of a Python object's memory; `view` keeps a buffer export alive (a
// bytearray cannot be resized under it) until the call returns with the GIL held again.
struct Region {
  std::byte* data = nullptr;
  std::size_t size = 0;
  std::optional<py::buffer_info> view;
};

Region region_of(py::handle obj, bool writable, std::size_t index) {
  Region r;
  if (py::hasattr(obj, "data_ptr") && py::hasattr(obj, "element_size")) {  // a torch tensor
    if (py::str(obj.attr("device").attr("type")).cast<std::string>() != "cpu") {
      throw InvalidArgument(str_cat("buffer ", index, ": a tensor on ",
                                    py::str(obj.attr("device")).cast<std::string>(),
                                    ", not in host memory"));
    }
    if (!obj.attr("is_contiguous")().cast<bool>()) {
      throw InvalidArgument(str_cat("buffer ", index, ": the tensor is not contiguous"));
    }
    r.data = reinterpret_cast<std::byte*>(obj.attr("data_ptr")().cast<std::uintptr_t>());
    r.size = obj.attr("numel")().cast<std::size_t>() * obj.attr("element_size")().cast<std::size_t>();
    return r;
  }
  if (!PyObject_CheckBuffer(obj.ptr())) {
    throw InvalidArgument(str_cat("buffer ", index, ": a ", py::str(py::type::of(obj).attr("__name__")).cast<std::string>(),
                                  " is neither a tensor nor an object with the buffer protocol"));
  }
  py::buffer b = py::reinterpret_borrow<py::buffer>(obj);
  py::buffer_info info;
  try {
    info = b.request(writable);
  } catch (py::error_already_set& e) {  // BufferError: not writable, or no such view
    throw InvalidArgument(str_cat("buffer ", index, writable ? " (read into)" : "", ": ", e.what()));
  }
  py::ssize_t stride = info.itemsize;
  for (py::ssize_t d = info.ndim - 1; d >= 0; --d) {  // C order only
    if (info.shape[d] != 1 && info.strides[d] != stride) {
      throw InvalidArgument(str_cat("buffer ", index, ": not C-contiguous"));
    }
    stride *= info.shape[d];
  }
  r.data = static_cast<std::byte*>(info.ptr);
  r.size = static_cast<std::size_t>(info.size * info.itemsize);
  r.view.emplace(std::move(info));
  return r;
}

std::vector<std::string> keys_of(const py::sequence& keys) {
  std::vector<std::string> out;
  out.reserve(keys.size());
  for (py::handle k : keys) out.push_back(k.cast<std::string>());
  return out;
}

// Where each page of an SGLang host pool lies, and how its records are named (hicache.sglang):
// an MHA page is two records, its K half "<prefix>-<key>-k" and its V half "-v", each in the
// order of SGLang's flat data page; an MLA page is one record "-kv". With the page_first layouts
// a record is one range; with layer_first, one range per layer.
struct PageLayout {
  std::string prefix;
  std::string layout;  // layer_first | page_first | page_first_direct
  bool mla = false;
  std::int64_t page = 0, layers = 0, slots = 0;
  std::size_t row_bytes = 0;  // one token of one layer
  std::uintptr_t base = 0;    // kv_buffer's first byte
  std::size_t half = 0;       // bytes from K to V (MHA)

  std::size_t record_bytes() const {
    return static_cast<std::size_t>(layers * page) * row_bytes;
  }
  int records() const { return mla ? 1 : 2; }
  void names(const std::string& key, std::vector<std::string>& out) const {
    if (mla) {
      out.push_back(str_cat(prefix, "-", key, "-kv"));
    } else {
      out.push_back(str_cat(prefix, "-", key, "-k"));
      out.push_back(str_cat(prefix, "-", key, "-v"));
    }
  }
  using Ranges = std::vector<std::vector<std::pair<std::uintptr_t, std::size_t>>>;
  void ranges(std::int64_t slot, Ranges& out) const {
    if (slot < 0 || slot >= slots || slot % page != 0) {
      throw InvalidArgument(str_cat("hicache: host slot ", slot, " does not start a page of the pool (page size ",
                                    page, ", ", slots, " slots)"));
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
};

// The first slot of each of `n` pages from SGLang's host_indices (an int64 tensor, page i
// starting at host_indices[i * page_size], or a sequence of ints).
std::vector<std::int64_t> page_slots(py::handle indices, std::size_t n, std::int64_t page) {
  std::vector<std::int64_t> out(n);
  if (py::hasattr(indices, "data_ptr")) {
    const auto dtype = py::str(indices.attr("dtype")).cast<std::string>();
    if (dtype != "torch.int64" || !indices.attr("is_contiguous")().cast<bool>() ||
        py::str(indices.attr("device").attr("type")).cast<std::string>() != "cpu") {
      throw InvalidArgument(str_cat("hicache: host_indices must be a contiguous int64 tensor on the host, not ",
                                    dtype));
    }
    const auto count = indices.attr("numel")().cast<std::size_t>();
    if (count < n * static_cast<std::size_t>(page)) {
      throw InvalidArgument(str_cat("hicache: ", n, " keys need ", n * static_cast<std::size_t>(page),
                                    " host indices, got ", count));
    }
    const auto* p = reinterpret_cast<const std::int64_t*>(indices.attr("data_ptr")().cast<std::uintptr_t>());
    for (std::size_t i = 0; i < n; ++i) out[i] = p[i * static_cast<std::size_t>(page)];
    return out;
  }
  const auto seq = py::reinterpret_borrow<py::sequence>(indices);
  if (seq.size() < n * static_cast<std::size_t>(page)) {
    throw InvalidArgument(str_cat("hicache: ", n, " keys need ", n * static_cast<std::size_t>(page),
                                  " host indices, got ", seq.size()));
  }
  for (std::size_t i = 0; i < n; ++i) out[i] = seq[i * static_cast<std::size_t>(page)].cast<std::int64_t>();
  return out;
}

// A store opened on its own (open_store) or shared with a HiCache. `batch_*_ptrs` take raw
// (address, bytes) ranges: a key with several ranges is gathered into one record on set and
// scattered from it on get (one copy); with one range it moves in place.
class PyStore {
 public:
  explicit PyStore(std::shared_ptr<StorageBackend> store) : store_(std::move(store)) {
    store_->register_metrics(metrics_);
  }
  ~PyStore() { store_->unregister_metrics(); }

  const std::shared_ptr<StorageBackend>& backend() const { return store_; }
  std::string name() const { return std::string(store_->name()); }

  std::size_t batch_exists(const py::sequence& keys) {
    const auto k = keys_of(keys);
    py::gil_scoped_release nogil;
    return store_->batch_exists(k);
  }

  std::vector<IoResult> batch_get(const py::sequence& keys, const py::sequence& buffers) {
    return io(keys, buffers, true);
  }
  std::vector<IoResult> batch_set(const py::sequence& keys, const py::sequence& buffers) {
    return io(keys, buffers, false);
  }

  using Ranges = std::vector<std::vector<std::pair<std::uintptr_t, std::size_t>>>;
  std::vector<IoResult> batch_get_ptrs(const py::sequence& keys, const Ranges& ranges) {
    return io_ptrs(keys_of(keys), ranges, true);
  }
  std::vector<IoResult> batch_set_ptrs(const py::sequence& keys, const Ranges& ranges) {
    return io_ptrs(keys_of(keys), ranges, false);
  }

  // SGLang's pages (hicache.sglang): each key's records from / into its host pool page; True
  // per key when every record of it moved.
  std::vector<bool> pages_io(const PageLayout& layout, const py::sequence& keys,
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
  // Leading keys whose every record is stored.
  std::size_t pages_exist(const PageLayout& layout, const py::sequence& keys) {
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

  bool remove(const std::string& key) {
    py::gil_scoped_release nogil;
    return store_->remove(key);
  }
  void clear() {
    py::gil_scoped_release nogil;
    store_->clear();
  }
  std::string stats_json() const { return store_->stats().to_json(); }
  std::string metrics_json() const { return metrics_.json_text(); }
  std::string metrics_text() const { return metrics_.prometheus_text(); }

 private:
  std::vector<IoResult> io(const py::sequence& keys, const py::sequence& buffers, bool get) {
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

  std::vector<IoResult> io_ptrs(const std::vector<std::string>& keys, const Ranges& ranges,
                                bool get) {
    check_ranges(keys, ranges, get);
    py::gil_scoped_release nogil;
    return move_ranges(*store_, keys, ranges, get);
  }

 public:
  // The C++ store's own batch calls on the same ranges, from `threads` C++ threads (batch i on
  // thread i % threads), without Python in the loop: the benchmark's baseline. Seconds of wall
  // time; RuntimeError when a key did not move.
  double time_batches(const std::vector<std::vector<std::string>>& keys,
                      const std::vector<Ranges>& ranges, bool get, int threads) {
    if (keys.size() != ranges.size() || threads < 1) {
      throw InvalidArgument(str_cat("time_batches: ", keys.size(), " key batches, ",
                                    ranges.size(), " range batches, ", threads, " threads"));
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

 private:
  static void check_ranges(const std::vector<std::string>& keys, const Ranges& ranges, bool get) {
    if (keys.size() != ranges.size()) {
      throw InvalidArgument(str_cat(get ? "batch_get_ptrs" : "batch_set_ptrs", ": ", keys.size(),
                                    " keys but ", ranges.size(), " range lists"));
    }
    for (std::size_t i = 0; i < ranges.size(); ++i) {
      if (ranges[i].empty()) throw InvalidArgument(str_cat("key '", keys[i], "': no ranges"));
      for (const auto& [p, n] : ranges[i]) {
        if (p == 0 || n == 0) {
          throw InvalidArgument(str_cat("key '", keys[i], "': range (", p, ", ", n,
                                        ") is null or empty"));
        }
      }
    }
  }

  // Without the GIL: one range moves in place; several are gathered into (scattered from) one
  // record through a staging buffer.
  static std::vector<IoResult> move_ranges(StorageBackend& store,
                                           const std::vector<std::string>& keys,
                                           const Ranges& ranges, bool get) {
    std::vector<std::vector<std::byte>> staging(keys.size());
    std::vector<ByteSpan> spans(keys.size());
    for (std::size_t i = 0; i < keys.size(); ++i) {
      if (ranges[i].size() == 1) {
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

  std::shared_ptr<StorageBackend> store_;
  MetricsRegistry metrics_;
};

// Address and byte size of a tensor on any device (the engine's KV memory), contiguous.
std::pair<void*, std::size_t> tensor_memory(py::handle t, const char* what) {
  if (!py::hasattr(t, "data_ptr") || !py::hasattr(t, "element_size")) {
    throw InvalidArgument(str_cat(what, ": a tensor, not a ",
                                  py::str(py::type::of(t).attr("__name__")).cast<std::string>()));
  }
  if (!t.attr("is_contiguous")().cast<bool>()) {
    throw InvalidArgument(str_cat(what, ": the tensor is not contiguous"));
  }
  return {reinterpret_cast<void*>(t.attr("data_ptr")().cast<std::uintptr_t>()),
          t.attr("numel")().cast<std::size_t>() * t.attr("element_size")().cast<std::size_t>()};
}

// The device pool's slots when the engine's own allocator hands them out (SGLang's
// token_to_kv_pool_allocator, a Python object): hicache never allocates device slots then (loads
// go into slots the engine chose, load_into), treats every slot as the engine's, and the slots
// it frees (evict_device, loads dropped by a reset) are collected here for the Python side to
// hand back to the engine's allocator, on its own thread, with the GIL.
class EngineSlots final : public TokenSlotAllocator {
 public:
  EngineSlots(std::int64_t num_tokens, std::int32_t page_size)
      : page_size_(page_size), num_pages_(num_tokens / page_size) {}
  std::int32_t page_size() const override { return page_size_; }
  std::int64_t num_pages() const override { return num_pages_; }
  std::int64_t free_tokens() const override { return 0; }  // the engine's to know
  bool is_allocated(std::int64_t page) const override { return page >= 0 && page < num_pages_; }
  bool alloc(std::int64_t, std::vector<std::int64_t>&) override { return false; }
  void free(std::span<const std::int64_t> slots) override {
    std::vector<std::int64_t> pages;
    slots_to_pages(slots, page_size_, num_pages_, "EngineSlots::free", pages);  // checks first
    std::lock_guard hold(mu_);
    returned_.insert(returned_.end(), slots.begin(), slots.end());
  }
  void reset() override {}
  std::vector<std::int64_t> take_returned() {
    std::lock_guard hold(mu_);
    return std::exchange(returned_, {});
  }

 private:
  std::int32_t page_size_;
  std::int64_t num_pages_;
  std::mutex mu_;
  std::vector<std::int64_t> returned_;
};

// A store whose every call throws while `throwing` is set (else it forwards to `inner`): the
// Python suite's way to show that a backend's exception never ends hicache's storage threads.
class ThrowingStorage final : public StorageBackend {
 public:
  explicit ThrowingStorage(std::shared_ptr<StorageBackend> inner) : inner_(std::move(inner)) {}
  std::string_view name() const override { return "throwing"; }
  std::size_t batch_exists(std::span<const std::string> keys) override {
    check();
    return inner_->batch_exists(keys);
  }
  bool remove(const std::string& key) override { return inner_->remove(key); }
  void clear() override { inner_->clear(); }
  std::atomic<bool> throwing{true};

 protected:
  std::vector<IoResult> do_batch_get(std::span<const std::string> keys,
                                     std::span<const ByteSpan> dst) override {
    check();
    return inner_->batch_get(keys, dst);
  }
  std::vector<IoResult> do_batch_set(std::span<const std::string> keys,
                                     std::span<const ConstByteSpan> src) override {
    check();
    return inner_->batch_set(keys, src);
  }

 private:
  void check() const {
    if (throwing) throw std::runtime_error("the test store threw");
  }
  std::shared_ptr<StorageBackend> inner_;
};

PageState parse_page_state(const std::string& name) {
  for (PageState s : {PageState::kFree, PageState::kReserved, PageState::kProtected,
                      PageState::kSynced, PageState::kBackup}) {
    if (to_string(s) == name) return s;
  }
  throw InvalidArgument(str_cat("page state '", name, "': valid are free, reserved, protected, synced, backup"));
}

std::optional<PageDigest> prior_of(const std::optional<std::string>& hex) {
  if (!hex || hex->empty()) return std::nullopt;
  return digest_from_hex(*hex);
}

// Calls drain() (it moves what arrived into the caller's list and returns the list's size)
// until it returns at least `n` or `timeout_s` passed, sleeping on `signal` in between: whatever
// arrives after a drain bumps the signal, so no arrival is missed and nothing polls.
template <typename Drain>
void wait_for(const std::shared_ptr<EventSignal>& signal, std::size_t n, double timeout_s,
              Drain&& drain) {
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(std::max(timeout_s, 0.0)));
  while (true) {
    const std::uint64_t seen = signal->seq();
    if (drain() >= n || !signal->wait(seen, deadline)) break;
  }
}

// A HiCache; `store` (may be None) is the one its config names, opened by the Python side so
// that it can be handed out as a Store too. The engine's KV tensors (optional) are wrapped in
// place; `keep` holds them alive as long as the cache.
class PyHiCache {
 public:
  PyHiCache(const std::string& config_json, std::shared_ptr<PyStore> store, py::object device_kv,
            py::object host_kv, py::object device_k, py::object device_v,
            const std::string& dim_order, bool engine_allocator)
      : store_(std::move(store)) {
    const HiCacheConfig config = HiCacheConfig::from_json_text(config_json);
    HiCacheParts parts;
    if (engine_allocator) {
      engine_slots_ = std::make_unique<EngineSlots>(config.device_tokens,
                                                    config.geometry.page_size);
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
    py::gil_scoped_release nogil;  // the TP rendezvous and pool pre-faulting wait
    cache_ = std::make_unique<HiCache>(config, std::move(parts));
  }
  ~PyHiCache() { close(); }

  // The cache for one call. Calls may run on several Python threads at once (the scheduler's
  // start_loading while the forward thread waits for a layer, with the GIL released): each holds
  // a shared lock on the cache's life, and close() waits for them, so no call runs on a cache
  // that is being destroyed.
  struct Use {
    std::shared_lock<std::shared_mutex> lock;
    HiCache& hc;
  };
  Use use() {
    std::shared_lock lock(life_);
    if (!cache_) throw StateError("HiCache is closed");
    return Use{std::move(lock), *cache_};
  }
  void close() {
    py::gil_scoped_release nogil;  // calls in flight finish first; none of them needs the GIL
    std::unique_lock lock(life_);
    cache_.reset();
  }
  std::shared_ptr<PyStore> store() const { return store_; }
  // L3 at run time (HiCache::detach_storage / attach_storage / clear_storage).
  // Without the GIL: they wait for the storage threads, a TP agreement or a store's connect.
  void detach_storage() {
    {
      Use u = use();
      py::gil_scoped_release nogil;
      u.hc.detach_storage();
    }
    store_.reset();
  }
  void attach_storage(const py::object& store) {
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
  void clear_storage() {
    Use u = use();
    py::gil_scoped_release nogil;
    u.hc.clear_storage();
  }

  // Acks of `kind` ("write" or "load") until `n` arrived or `timeout_s` passed, waiting on the
  // controller's event signal without the GIL: [(node id, ok)].
  std::vector<std::pair<NodeId, bool>> wait_acks(const std::string& kind, std::size_t n,
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

  // Runs drain(storage controller) (it appends what arrived and returns how many it holds)
  // until that is at least `n` or `timeout_s` passed, waiting on the controller's event signal
  // (which the storage controller notifies after every backup ack and revoke) without the GIL.
  // Without a store nothing arrives: it waits out the timeout (when n > 0) all the same.
  template <typename Drain>
  void drain_waiting(HiCache& hc, std::size_t n, double timeout_s, Drain&& drain) {
    StorageController* sc = hc.storage_controller();
    py::gil_scoped_release nogil;
    wait_for(hc.controller().events(), n, timeout_s,
             [&]() -> std::size_t { return sc == nullptr ? 0 : drain(*sc); });
  }

  // Device slots hicache handed back since the last call (engine_allocator mode; else none).
  std::vector<std::int64_t> take_returned_device_slots() {
    return engine_slots_ ? engine_slots_->take_returned() : std::vector<std::int64_t>{};
  }

  StorageController& storage_controller(HiCache& hc) {
    StorageController* sc = hc.storage_controller();
    if (sc == nullptr) throw StateError("no L3 store is attached");
    return *sc;
  }
  // The page keys of `tokens` (whole pages) chained after `prior_hex` (a page's hex digest, as
  // SGLang's get_hash_str gives), and each page's hex digest.
  std::pair<std::vector<std::string>, std::vector<std::string>> page_keys(
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

 private:
  std::unique_ptr<EngineSlots> engine_slots_;  // outlives cache_ (declared first)
  std::unique_ptr<PageKeyer> keyer_;
  std::shared_ptr<PyStore> store_;
  std::vector<py::object> keep_;
  std::shared_mutex life_;
  std::unique_ptr<HiCache> cache_;
};

}  // namespace
}  // namespace hicache

PYBIND11_MODULE(_hicache, m) {
  using namespace hicache;
  m.doc() = "hicache: hierarchical KV cache (C++ core)";
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const InvalidArgument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const IoError& e) {
      PyErr_SetString(PyExc_OSError, e.what());
    } catch (const Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });

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

  m.def("validate_config", [](const std::string& text) {
    (void)HiCacheConfig::from_json_text(text);
  });
  m.def("config_reference", &config_reference_markdown);
  m.def("key_prefix",
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
             if (layout != "layer_first" && layout != "page_first" && layout != "page_first_direct") {
               throw InvalidArgument(str_cat("hicache: layout '", layout, "'"));
             }
             if (page < 1 || layers < 1 || slots < page || row_bytes == 0 || base == 0) {
               throw InvalidArgument(str_cat("hicache: page layout page ", page, ", layers ", layers,
                                             ", slots ", slots, ", row bytes ", row_bytes));
             }
             return PageLayout{std::move(prefix), std::move(layout), mla, page, layers, slots,
                               row_bytes, base, half};
           }),
           py::arg("prefix"), py::arg("layout"), py::arg("mla"), py::arg("page"),
           py::arg("layers"), py::arg("slots"), py::arg("row_bytes"), py::arg("base"),
           py::arg("half"))
      .def_property_readonly("record_bytes", &PageLayout::record_bytes)
      .def_property_readonly("records", &PageLayout::records)
      .def("names",
           [](const PageLayout& l, const std::string& key) {
             std::vector<std::string> out;
             l.names(key, out);
             return out;
           })
      .def("ranges", [](const PageLayout& l, std::int64_t slot) {
        PageLayout::Ranges out;
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
      .def("batch_get_ptrs", &PyStore::batch_get_ptrs, py::arg("keys"), py::arg("ranges"))
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

  m.def("_throwing_store",
        [](const std::shared_ptr<PyStore>& inner) {
          auto backend = std::make_shared<ThrowingStorage>(inner->backend());
          auto* raw = backend.get();
          auto store = std::make_shared<PyStore>(std::move(backend));
          // (store, set_throwing): the switch keeps the store alive
          return py::make_tuple(store, py::cpp_function([store, raw](bool on) {
                                  raw->throwing = on;
                                }));
        },
        py::arg("inner"), "For tests: a store over `inner` that throws from every call while on");

  py::class_<PrefetchOperation, std::shared_ptr<PrefetchOperation>>(
      m, "PrefetchOperation", "The handle of one prefetch (StorageController)")
      .def_property_readonly("request_id", &PrefetchOperation::request_id)
      .def_property_readonly("stage",
                             [](const PrefetchOperation& op) {
                               switch (op.stage()) {
                                 case PrefetchStage::kQueued: return "queued";
                                 case PrefetchStage::kRevoked: return "revoked";
                                 case PrefetchStage::kLoading: return "loading";
                                 case PrefetchStage::kFinished: return "finished";
                                 case PrefetchStage::kTerminated: return "terminated";
                               }
                               return "?";
                             })
      .def_property_readonly("hit_tokens", &PrefetchOperation::hit_tokens)
      .def_property_readonly("completed_tokens", &PrefetchOperation::completed_tokens)
      .def_property_readonly("error", &PrefetchOperation::error);

  py::class_<PyHiCache>(m, "HiCache")
      .def(py::init<const std::string&, std::shared_ptr<PyStore>, py::object, py::object,
                    py::object, py::object, const std::string&, bool>(),
           py::arg("config_json"), py::arg("store"), py::arg("device_kv") = py::none(),
           py::arg("host_kv") = py::none(), py::arg("device_k") = py::none(),
           py::arg("device_v") = py::none(), py::arg("dim_order") = "sglang",
           py::arg("engine_allocator") = false)
      .def("alloc_device",
           [](PyHiCache& c, std::int64_t tokens) {
             return c.use().hc.device_pool().allocator().alloc(tokens);
           },
           py::arg("tokens"))
      .def("free_device",
           [](PyHiCache& c, const std::vector<std::int64_t>& slots) {
             c.use().hc.device_pool().allocator().free(slots);
           },
           py::arg("slots"))
      .def("write",
           [](PyHiCache& c, const std::vector<std::int64_t>& device_slots, NodeId node) {
             return c.use().hc.controller().write(device_slots, 0, node);
           },
           py::arg("device_slots"), py::arg("node_id"))
      .def("load_into",
           [](PyHiCache& c, const std::vector<std::int64_t>& host_slots,
              const std::vector<std::int64_t>& device_slots, NodeId node) {
             return c.use().hc.controller().load_into(host_slots, device_slots, 0, node);
           },
           py::arg("host_slots"), py::arg("device_slots"), py::arg("node_id"))
      .def("evict_device",
           [](PyHiCache& c, const std::vector<std::int64_t>& device_slots,
              const std::vector<std::int64_t>& host_slots) {
             return c.use().hc.controller().evict_device(device_slots, host_slots);
           },
           py::arg("device_slots"), py::arg("host_slots"))
      .def("start_loading",
           [](PyHiCache& c) {
             auto u = c.use();
             py::gil_scoped_release nogil;  // blocks while every layer slot is still in use
             return u.hc.controller().start_loading();
           })
      .def("wait_for_layer",
           [](PyHiCache& c, std::int32_t layer) {
             auto u = c.use();
             py::gil_scoped_release nogil;
             return u.hc.device_pool().wait_for_layer(layer);
           },
           py::arg("layer"))
      .def("release_loading",
           [](PyHiCache& c, std::int32_t slot) {
             c.use().hc.controller().layer_done_counter().release(slot);
           },
           py::arg("slot"))
      // --- for a drop-in controller over the engine's allocators (hicache.sglang) -----
      .def("take_returned_device_slots", &PyHiCache::take_returned_device_slots)
      .def("host_alloc",
           [](PyHiCache& c, std::int64_t tokens) { return c.use().hc.host_pool().alloc(tokens); },
           py::arg("tokens"))
      .def("host_free",
           [](PyHiCache& c, const std::vector<std::int64_t>& slots) {
             c.use().hc.host_pool().free(slots);
           },
           py::arg("slots"))
      .def("host_mark_synced",
           [](PyHiCache& c, const std::vector<std::int64_t>& slots) {
             c.use().hc.host_pool().mark_synced(slots);
           },
           py::arg("slots"))
      .def("host_require_state",
           [](PyHiCache& c, const std::vector<std::int64_t>& slots, const std::string& state,
              const std::string& what) {
             c.use().hc.host_pool().require_state(slots, parse_page_state(state), what);
           },
           py::arg("slots"), py::arg("state"), py::arg("what"))
      .def("host_all_in_state",
           [](PyHiCache& c, const std::vector<std::int64_t>& slots, const std::string& state) {
             return c.use().hc.host_pool().all_in_state(slots, parse_page_state(state));
           },
           py::arg("slots"), py::arg("state"))
      .def("host_states",
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
      .def("evict_host",
           [](PyHiCache& c, const std::vector<std::int64_t>& host_slots) {
             return c.use().hc.controller().evict_host(host_slots);
           },
           py::arg("host_slots"))
      .def("wait_layer",
           [](PyHiCache& c, std::int32_t slot, std::int32_t layer) {
             auto u = c.use();
             py::gil_scoped_release nogil;
             return u.hc.controller().layer_done_counter().wait_until(slot, layer);
           },
           py::arg("slot"), py::arg("layer"))
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
      .def("write_storage",
           [](PyHiCache& c, const std::vector<std::int64_t>& host_slots,
              std::vector<std::string> keys) {
             auto u = c.use();
             return c.storage_controller(u.hc).write_storage(host_slots, std::move(keys));
           },
           py::arg("host_slots"), py::arg("keys"))
      .def("drain_backup_acks",
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
      .def("drain_revokes",
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
      .def("prefetch_into",
           [](PyHiCache& c, std::string request_id, const std::vector<std::int32_t>& tokens,
              const std::optional<std::string>& prior_hex,
              const std::vector<std::int64_t>& host_slots) {
             auto u = c.use();
             return c.storage_controller(u.hc).prefetch_into(std::move(request_id), tokens,
                                                             prior_of(prior_hex), host_slots);
           },
           py::arg("request_id"), py::arg("tokens"), py::arg("prior_hex"), py::arg("host_slots"))
      .def("terminate_prefetch",
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
      .def("cached_prefix_tokens",
           [](PyHiCache& c, const std::vector<std::int32_t>& tokens) {
             return c.use().hc.cache().cached_prefix_tokens(tokens);
           },
           py::arg("tokens"));
}
