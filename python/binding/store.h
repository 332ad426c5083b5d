// The store side of hicache._hicache: Store (PyStore, a StorageBackend opened on its own by
// open_store or shared with a HiCache) and PageLayout (where SGLang's host pool keeps a page).
// register_store() adds IoResult, PageLayout, Store, key_prefix and validate_key to the module.
//
// Threads: every PyStore method is called with the GIL held and releases it around the store's
// I/O; the store itself is thread-safe (StorageBackend's contract).
// Errors: InvalidArgument (ValueError) for a bad argument, before any I/O; per-key outcomes are
// values (IoResult).
#ifndef HICACHE_PYTHON_BINDING_STORE_H_
#define HICACHE_PYTHON_BINDING_STORE_H_

#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "storage/storage_backend.h"
#include "transfer/metrics.h"

namespace hicache::binding {

namespace py = pybind11;

// (address, bytes) ranges, one list per key: a key with several ranges is one record gathered
// from (scattered into) them.
using Ranges = std::vector<std::vector<std::pair<std::uintptr_t, std::size_t>>>;

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

  std::size_t record_bytes() const { return static_cast<std::size_t>(layers * page) * row_bytes; }
  int records() const { return mla ? 1 : 2; }
  // Appends the record names of page `key` (records() of them).
  void names(const std::string& key, std::vector<std::string>& out) const;
  // Appends one range list per record of the page starting at host slot `slot`.
  // REQUIRES: slot starts a page of the pool, else InvalidArgument.
  void ranges(std::int64_t slot, Ranges& out) const;
};

class PyStore {
 public:
  // Registers the store's metrics with this object's registry until it is destroyed.
  explicit PyStore(std::shared_ptr<StorageBackend> store) : store_(std::move(store)) {
    store_->register_metrics(metrics_);
  }
  ~PyStore() { store_->unregister_metrics(); }
  PyStore(const PyStore&) = delete;
  PyStore& operator=(const PyStore&) = delete;

  const std::shared_ptr<StorageBackend>& backend() const { return store_; }
  std::string name() const { return std::string(store_->name()); }

  // Leading keys that are stored.
  std::size_t batch_exists(const py::sequence& keys);
  // Whether each key is stored, every key asked (a sparse set: SGLang's trailing-window pools).
  std::vector<bool> exists_each(const py::sequence& keys);
  // One buffer per key (buffers.h's region_of); the key's record is read into (written from)
  // the buffer's memory in place.
  std::vector<IoResult> batch_get(const py::sequence& keys, const py::sequence& buffers);
  std::vector<IoResult> batch_set(const py::sequence& keys, const py::sequence& buffers);
  // Raw ranges: a key with several ranges is gathered into one record on set and scattered from
  // it on get (one copy); with one range it moves in place. Null or empty ranges are refused.
  // `staged` reads every record through a staging buffer (one copy): a key that is not ok
  // leaves its ranges untouched.
  std::vector<IoResult> batch_get_ptrs(const py::sequence& keys, const Ranges& ranges,
                                       bool staged = false);
  std::vector<IoResult> batch_set_ptrs(const py::sequence& keys, const Ranges& ranges);

  // SGLang's pages (hicache.sglang): each key's records from / into its host pool page; True
  // per key when every record of it moved.
  std::vector<bool> pages_io(const PageLayout& layout, const py::sequence& keys,
                             py::handle host_indices, bool get);
  // Leading keys whose every record is stored.
  std::size_t pages_exist(const PageLayout& layout, const py::sequence& keys);

  // The C++ store's own batch calls on the same ranges, from `threads` C++ threads (batch i on
  // thread i % threads), without Python in the loop: the benchmark's baseline. Seconds of wall
  // time; RuntimeError when a key did not move.
  double time_batches(const std::vector<std::vector<std::string>>& keys,
                      const std::vector<Ranges>& ranges, bool get, int threads);

  bool remove(const std::string& key);
  void clear();
  std::string stats_json() const { return store_->stats().to_json(); }
  std::string metrics_json() const { return metrics_.json_text(); }
  std::string metrics_text() const { return metrics_.prometheus_text(); }

 private:
  std::vector<IoResult> io(const py::sequence& keys, const py::sequence& buffers, bool get);

  std::shared_ptr<StorageBackend> store_;
  MetricsRegistry metrics_;
};

// Adds IoResult, key_prefix, validate_key, PageLayout and Store to `m`.
void register_store(py::module_& m);

}  // namespace hicache::binding

#endif  // HICACHE_PYTHON_BINDING_STORE_H_
