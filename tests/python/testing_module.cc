// hicache._testing: test doubles for the Python suites, built into the build tree's package
// (PYTHONPATH=<build>/python) and never installed, packaged or imported by hicache itself
// (tests/layering_check.sh refuses an import of it under python/hicache).
//
// It shares the production Store type with hicache._hicache (pybind11 shares registered types
// between modules built with the same pybind11; Store is not module_local), so a store made
// here is a hicache._hicache.Store that HiCache.attach_storage accepts.
#include <pybind11/pybind11.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "python/binding/store.h"
#include "storage/storage_backend.h"

namespace hicache::testing {
namespace {

// A store whose every call but remove/clear throws while `throwing` is set (else it forwards to
// `inner`): the Python suite's way to show that a backend's exception never ends hicache's
// storage threads.
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

// A store whose get/set wait while its gate is shut (it starts shut), then forward to `inner`:
// jobs held in flight for as long as a test needs, released at once. Exists is not gated and the
// store answers to inner's name (a "file" store still answers lookups from its index). A wait
// longer than 30 s throws (a test that forgot to open the gate fails instead of hanging).
class GatedStorage final : public StorageBackend {
 public:
  explicit GatedStorage(std::shared_ptr<StorageBackend> inner) : inner_(std::move(inner)) {}
  std::string_view name() const override { return inner_->name(); }
  std::size_t batch_exists(std::span<const std::string> keys) override {
    return inner_->batch_exists(keys);
  }
  bool remove(const std::string& key) override { return inner_->remove(key); }
  void clear() override { inner_->clear(); }
  void set_open(bool open) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      open_ = open;
    }
    cv_.notify_all();
  }
  int waiting() {
    std::lock_guard<std::mutex> lock(mu_);
    return waiting_;
  }

 protected:
  std::vector<IoResult> do_batch_get(std::span<const std::string> keys,
                                     std::span<const ByteSpan> dst) override {
    wait();
    return inner_->batch_get(keys, dst);
  }
  std::vector<IoResult> do_batch_set(std::span<const std::string> keys,
                                     std::span<const ConstByteSpan> src) override {
    wait();
    return inner_->batch_set(keys, src);
  }

 private:
  void wait() {
    std::unique_lock<std::mutex> lock(mu_);
    ++waiting_;
    const bool opened = cv_.wait_for(lock, std::chrono::seconds(30), [this] { return open_; });
    --waiting_;
    if (!opened) throw std::runtime_error("the gated store stayed shut for 30 s");
  }
  std::shared_ptr<StorageBackend> inner_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
  int waiting_ = 0;
};

}  // namespace
}  // namespace hicache::testing

PYBIND11_MODULE(_testing, m) {
  namespace py = pybind11;
  using hicache::binding::PyStore;
  m.doc() = "hicache test doubles (build tree only; never installed)";
  py::module_::import("hicache._hicache");  // registers Store, which the functions here take
  m.def(
      "throwing_store",
      [](const std::shared_ptr<PyStore>& inner) {
        auto backend = std::make_shared<hicache::testing::ThrowingStorage>(inner->backend());
        auto* raw = backend.get();
        auto store = std::make_shared<PyStore>(std::move(backend));
        // (store, set_throwing): the switch keeps the store alive
        return py::make_tuple(store,
                              py::cpp_function([store, raw](bool on) { raw->throwing = on; }));
      },
      py::arg("inner"),
      "A store over `inner` that throws from every call while on (it starts on); returns "
      "(store, set_throwing)");
  m.def(
      "gated_store",
      [](const std::shared_ptr<PyStore>& inner) {
        auto backend = std::make_shared<hicache::testing::GatedStorage>(inner->backend());
        auto* raw = backend.get();
        auto store = std::make_shared<PyStore>(std::move(backend));
        return py::make_tuple(
            store,
            py::cpp_function([store, raw](bool open) { raw->set_open(open); }),
            py::cpp_function([store, raw] {
              py::gil_scoped_release nogil;
              return raw->waiting();
            }));
      },
      py::arg("inner"),
      "A store over `inner` whose get/set wait while its gate is shut (it starts shut); "
      "returns (store, set_open, waiting): waiting() is how many calls wait at the gate");
}
