// hicache._testing: test doubles for the Python suites, built into the build tree's package
// (PYTHONPATH=<build>/python) and never installed, packaged or imported by hicache itself
// (tests/layering_check.sh refuses an import of it under python/hicache).
//
// It shares the production Store type with hicache._hicache (pybind11 shares registered types
// between modules built with the same pybind11; Store is not module_local), so a store made
// here is a hicache._hicache.Store that HiCache.attach_storage accepts.
#include <pybind11/pybind11.h>

#include <atomic>
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
}
