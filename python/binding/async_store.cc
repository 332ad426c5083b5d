// See async_store.h.
#include "python/binding/async_store.h"

#include <pybind11/stl.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <exception>
#include <span>
#include <utility>

#include "python/binding/store.h"
#include "storage/page_key.h"
#include "transfer/errors.h"

namespace hicache::binding {
namespace {

constexpr std::size_t kMaxPrefixBytes = 160;  // leaves room for "-%h" + 64 hex digits
constexpr const char* kKindNames[] = {"get", "set", "exists", "delete", "touch"};

constexpr std::int64_t kMaxSpinUs = 10'000'000;

bool plain(unsigned char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
         c == '_' || c == '+' || c == '=' || c == '@' || c == ',' || c == '.' || c == '-';
}

std::size_t index_of(AsyncStore::Kind k) { return static_cast<std::size_t>(k); }

}  // namespace

AsyncStore::AsyncStore(std::shared_ptr<StorageBackend> store, bool own_metrics,
                       std::string prefix, int workers, std::size_t max_pending,
                       int metrics_port, const std::string& metrics_bind, std::int64_t spin_us)
    : store_(std::move(store)),
      own_metrics_(own_metrics),
      prefix_(std::move(prefix)),
      max_pending_(max_pending),
      spin_(spin_us) {
  if (!store_) throw InvalidArgument("AsyncStore: no store");
  if (workers < 1 || workers > 256) {
    throw InvalidArgument(str_cat("AsyncStore: workers ", workers, " (1..256)"));
  }
  if (max_pending < 1) throw InvalidArgument("AsyncStore: max_pending 0 (at least 1)");
  if (spin_us < 0 || spin_us > kMaxSpinUs) {
    throw InvalidArgument(str_cat("AsyncStore: spin_us ", spin_us, " (0..", kMaxSpinUs, ")"));
  }
  if (metrics_port < -1 || metrics_port > 65535) {
    throw InvalidArgument(str_cat("AsyncStore: metrics_port ", metrics_port, " (-1..65535)"));
  }
  if (!prefix_.empty()) {
    if (prefix_.size() > kMaxPrefixBytes) {
      throw InvalidArgument(str_cat("AsyncStore: prefix '", prefix_, "' is longer than ",
                                    kMaxPrefixBytes, " bytes"));
    }
    try {
      validate_key(prefix_);
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(str_cat("AsyncStore: prefix: ", e.what()));
    }
  }
  efd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (efd_ < 0) throw Error(str_cat("AsyncStore: eventfd: ", std::strerror(errno)));

  if (own_metrics_) store_->register_metrics(metrics_);
  scope_.attach(metrics_);
  for (std::size_t k = 0; k < kKinds; ++k) {
    const std::string kind = kKindNames[k];
    constexpr const char* kJobs = "hicache_async_jobs_total";
    constexpr const char* kJobsHelp = "Batch jobs of the async store, by kind and outcome";
    scope_.add(kJobs, kJobsHelp, {{"kind", kind}, {"outcome", "ok"}}, kinds_[k].ok);
    scope_.add(kJobs, kJobsHelp, {{"kind", kind}, {"outcome", "failed"}}, kinds_[k].failed);
    scope_.add(kJobs, kJobsHelp, {{"kind", kind}, {"outcome", "rejected"}}, kinds_[k].rejected);
    constexpr const char* kKeys = "hicache_async_keys_total";
    constexpr const char* kKeysHelp =
        "Keys in async store jobs, by kind and per-key result (ok: read, stored, present, removed)";
    scope_.add(kKeys, kKeysHelp, {{"kind", kind}, {"result", "ok"}}, kinds_[k].keys_ok);
    scope_.add_counter_fn(kKeys, kKeysHelp, {{"kind", kind}, {"result", "not_ok"}},
                          [m = &kinds_[k]] {
                            return static_cast<double>(m->keys.value() - m->keys_ok.value());
                          });
    scope_.add("hicache_async_job_seconds", "Async store jobs, submit to completion",
               {{"kind", kind}}, kinds_[k].seconds);
  }
  scope_.add_gauge_fn("hicache_async_pending_jobs", "Async store jobs queued or running", {},
                      [this] { return static_cast<double>(pending()); });
  if (metrics_port >= 0) {
    try {
      MutexLock lock(close_mu_);
      server_ = std::make_unique<MetricsServer>(metrics_, metrics_bind, metrics_port);
    } catch (...) {
      ::close(efd_);
      if (own_metrics_) store_->unregister_metrics();
      throw;
    }
  }

  workers_.reserve(static_cast<std::size_t>(workers));
  for (int i = 0; i < workers; ++i) workers_.emplace_back([this] { worker(); });
}

AsyncStore::~AsyncStore() {
  close();
  scope_.reset();
  if (own_metrics_) store_->unregister_metrics();
  MutexLock lock(pins_mu_);
  pins_.clear();  // with the GIL (pybind11 destroys us with it held)
  rows_ = Region{};
  rows_obj_ = py::object();
}

int AsyncStore::event_fd() const {
  MutexLock lock(done_mu_);
  if (fd_closed_) throw Error("AsyncStore: closed");
  return efd_;
}

int AsyncStore::metrics_port() {
  MutexLock lock(close_mu_);
  return server_ ? server_->port() : -1;
}

std::size_t AsyncStore::pending() const {
  MutexLock lock(mu_);
  return in_flight_;
}

std::size_t AsyncStore::looking() const {
  MutexLock lock(mu_);
  return looking_;
}

std::string AsyncStore::record_name(const std::string& key) const {
  if (key.empty()) throw InvalidArgument("AsyncStore: an empty key");
  std::string name = prefix_.empty() ? std::string() : prefix_ + "-";
  const std::size_t head = name.size();
  static constexpr char kHex[] = "0123456789ABCDEF";
  for (std::size_t i = 0; i < key.size(); ++i) {
    const auto c = static_cast<unsigned char>(key[i]);
    if (plain(c) && !(i == 0 && head == 0 && c == '.')) {
      name.push_back(static_cast<char>(c));
    } else {
      name.push_back('%');
      name.push_back(kHex[c >> 4]);
      name.push_back(kHex[c & 15]);
    }
  }
  if (name.size() > kMaxKeyBytes) {  // "%h" never comes out of the escaping above
    PageHasher hasher;
    name.resize(head);
    name += "%h" + to_hex(hasher.hash_bytes(key));
  }
  return name;
}

std::size_t AsyncStore::exists_now(const py::sequence& keys) {
  std::vector<std::string> names;
  for (const auto& k : keys_of(keys)) names.push_back(record_name(k));
  py::gil_scoped_release nogil;
  return store_->batch_exists(names);
}

void AsyncStore::touch(const py::sequence& keys) {
  std::vector<std::string> names;
  for (const auto& k : keys_of(keys)) names.push_back(record_name(k));
  if (names.empty()) return;
  if (!store_->touch_does_io()) {
    py::gil_scoped_release nogil;
    store_->touch(names);
    return;
  }
  // A server round trip: a worker tells the server, this thread does not wait.
  KindMetrics& m = kinds_[index_of(Kind::kTouch)];
  bool wake = false;
  {
    MutexLock lock(mu_);
    if (closed_ || in_flight_ >= max_pending_) {
      m.rejected.add();
      m.keys.add(names.size());
      return;
    }
    Job job;
    job.kind = Kind::kTouch;
    job.names = std::move(names);
    job.submitted = std::chrono::steady_clock::now();
    job.silent = true;
    wake = queue_locked(std::move(job));
  }
  if (wake) cv_.notify_one();
}

std::uint64_t AsyncStore::submit_batch_get(const py::sequence& keys, const py::sequence& buffers) {
  return submit(Kind::kGet, keys, &buffers);
}
std::uint64_t AsyncStore::submit_batch_set(const py::sequence& keys, const py::sequence& buffers) {
  return submit(Kind::kSet, keys, &buffers);
}
std::uint64_t AsyncStore::submit_batch_exists(const py::sequence& keys) {
  return submit(Kind::kExists, keys, nullptr);
}
std::uint64_t AsyncStore::submit_batch_delete(const py::sequence& keys) {
  return submit(Kind::kDelete, keys, nullptr);
}

void AsyncStore::bind_rows(const py::object& region, std::size_t row_bytes) {
  if (rows_obj_) throw InvalidArgument("AsyncStore.bind_rows: a region is bound already");
  if (row_bytes == 0) throw InvalidArgument("AsyncStore.bind_rows: row_bytes 0");
  Region r = region_of(region, /*writable=*/true, 0);
  if (r.size == 0 || r.size % row_bytes != 0) {
    throw InvalidArgument(str_cat("AsyncStore.bind_rows: a region of ", r.size,
                                  " bytes is not a whole number of ", row_bytes, "-byte rows"));
  }
  row_count_ = r.size / row_bytes;
  row_bytes_ = row_bytes;
  rows_ = std::move(r);
  rows_obj_ = region;
}

std::uint64_t AsyncStore::submit_rows_get(const py::sequence& keys, const py::sequence& rows) {
  return submit(Kind::kGet, keys, nullptr, &rows);
}
std::uint64_t AsyncStore::submit_rows_set(const py::sequence& keys, const py::sequence& rows) {
  return submit(Kind::kSet, keys, nullptr, &rows);
}

std::uint64_t AsyncStore::submit(Kind kind, const py::sequence& keys, const py::sequence* buffers,
                                 const py::sequence* rows) {
  const char* what = kKindNames[index_of(kind)];
  {
    MutexLock lock(mu_);
    if (closed_) throw Error(str_cat("AsyncStore: submit_batch_", what, " after close()"));
  }
  Job job;
  job.kind = kind;
  const auto k = keys_of(keys);
  if (k.empty()) throw InvalidArgument(str_cat("submit_batch_", what, ": no keys"));
  Pin pin;
  std::vector<Region>& regions = pin.regions;
  if (buffers != nullptr) {
    if (k.size() != buffers->size()) {
      throw InvalidArgument(str_cat("submit_batch_", what, ": ", k.size(), " keys but ",
                                    buffers->size(), " memoryviews"));
    }
    regions.reserve(k.size());
    for (std::size_t i = 0; i < k.size(); ++i) {
      pin.objects.append((*buffers)[i]);
      regions.push_back(region_of((*buffers)[i], kind == Kind::kGet, i));
      if (regions.back().size == 0) {
        throw InvalidArgument(str_cat("submit_batch_", what, ": buffer ", i, " is empty"));
      }
      job.buffers.emplace_back(regions.back().data, regions.back().size);
    }
  }
  if (rows != nullptr) {
    if (!rows_obj_) {
      throw InvalidArgument(str_cat("submit_rows_", what, ": no region bound (bind_rows)"));
    }
    if (k.size() != rows->size()) {
      throw InvalidArgument(
          str_cat("submit_rows_", what, ": ", k.size(), " keys but ", rows->size(), " rows"));
    }
    job.buffers.reserve(k.size());
    for (std::size_t i = 0; i < k.size(); ++i) {
      const auto r = (*rows)[i].cast<std::int64_t>();
      if (r < 0 || static_cast<std::uint64_t>(r) >= row_count_) {
        throw InvalidArgument(str_cat("submit_rows_", what, ": row ", i, " is ", r,
                                      ", outside the bound region's 0..", row_count_ - 1));
      }
      job.buffers.emplace_back(rows_.data + static_cast<std::size_t>(r) * row_bytes_, row_bytes_);
    }
  }
  job.names.reserve(k.size());
  for (std::size_t i = 0; i < k.size(); ++i) {
    if (k[i].empty()) {
      throw InvalidArgument(str_cat("submit_batch_", what, ": key ", i, " is empty"));
    }
    job.names.push_back(record_name(k[i]));
  }
  job.submitted = std::chrono::steady_clock::now();

  bool full = false;
  bool wake = false;
  std::uint64_t id = 0;
  {
    MutexLock lock(mu_);
    if (closed_) throw Error(str_cat("AsyncStore: submit_batch_", what, " after close()"));
    id = next_id_++;
    job.id = id;
    full = in_flight_ >= max_pending_;
    if (!full) {
      // Pinned before the job can run, so that its completion always finds them.
      {
        MutexLock pins(pins_mu_);
        if (!regions.empty()) pins_.emplace(id, std::move(pin));
      }
      wake = queue_locked(std::move(job));
    }
  }
  if (full) {
    kinds_[index_of(kind)].rejected.add();
    kinds_[index_of(kind)].keys.add(k.size());
    publish({id, false, str_cat("queue full (", max_pending_, " jobs pending)"),
             std::vector<bool>(k.size(), false)});
  } else if (wake) {
    cv_.notify_one();
  }
  return id;
}

void AsyncStore::worker() {
  bool ran = false;  // a job just ended: the next one may follow at once
  for (;;) {
    Job job;
    if (ran && take_looking(job)) {
      // taken while looking
    } else {
      MutexLock lock(mu_);
      while (queue_.empty() && !closed_) mu_.wait(cv_);
      if (queue_.empty()) return;  // closed and drained
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    ran = true;
    Completion c;
    try {
      c = run(job);
    } catch (const std::exception& e) {
      c = {job.id, false, str_cat("hicache: ", e.what()), std::vector<bool>(job.names.size())};
    } catch (...) {
      c = {job.id, false, "hicache: unknown exception", std::vector<bool>(job.names.size())};
    }
    KindMetrics& m = kinds_[index_of(job.kind)];
    (c.ok ? m.ok : m.failed).add();
    m.keys.add(job.names.size());
    std::uint64_t good = 0;
    for (bool b : c.per_key) good += b ? 1 : 0;
    m.keys_ok.add(good);
    m.seconds.observe(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - job.submitted).count());
    if (!job.silent) publish(std::move(c));
    {
      MutexLock lock(mu_);
      --in_flight_;
    }
  }
}

bool AsyncStore::queue_locked(Job job) {
  ++in_flight_;
  queue_.push_back(std::move(job));
  // A worker still looking takes the job without a wake-up (see spin_us in the header).
  return queue_.size() > looking_;
}

bool AsyncStore::take_looking(Job& job) {
  {
    MutexLock lock(mu_);
    // Only with nothing else in flight: then the next submit is what the driver waits on, and a
    // worker looking beside running jobs would take their CPU.
    if (spin_.count() == 0 || !queue_.empty() || in_flight_ > 0 || closed_ || looking_ > 0) {
      return false;
    }
    ++looking_;
  }
  const auto give_up = std::chrono::steady_clock::now() + spin_;
  for (;;) {
    std::this_thread::yield();
    MutexLock lock(mu_);
    if (!queue_.empty()) {
      --looking_;
      job = std::move(queue_.front());
      queue_.pop_front();
      return true;
    }
    if (closed_ || std::chrono::steady_clock::now() >= give_up) {
      --looking_;  // under mu_: a submit from now on wakes a sleeping worker
      return false;
    }
  }
}

AsyncStore::Completion AsyncStore::run(const Job& job) {
  Completion c{job.id, true, {}, std::vector<bool>(job.names.size(), false)};
  const std::span<const std::string> names(job.names);
  switch (job.kind) {
    case Kind::kGet:
    case Kind::kSet: {
      std::vector<IoResult> results;
      if (job.kind == Kind::kGet) {
        std::vector<ByteSpan> spans;
        spans.reserve(job.buffers.size());
        for (const auto& [p, n] : job.buffers) spans.emplace_back(p, n);
        results = store_->batch_get(names, spans);
      } else {
        std::vector<ConstByteSpan> spans;
        spans.reserve(job.buffers.size());
        for (const auto& [p, n] : job.buffers) spans.emplace_back(p, n);
        results = store_->batch_set(names, spans);
      }
      for (std::size_t i = 0; i < results.size(); ++i) {
        c.per_key[i] = results[i].is_ok();
        // A get's miss is a per-key answer; an error (and any set that did not store) fails
        // the job.
        const bool fails = job.kind == Kind::kGet ? results[i].status == IoStatus::kError
                                                  : !results[i].is_ok();
        if (fails) {
          if (c.ok) c.error = str_cat("key ", i, ": ", to_string(results[i].status),
                                      results[i].reason.empty() ? "" : ": ", results[i].reason);
          c.ok = false;
        }
      }
      break;
    }
    case Kind::kExists: {
      // batch_exists counts leading hits: one call per miss finds each key's answer.
      std::size_t at = 0;
      while (at < names.size()) {
        const std::size_t hit = store_->batch_exists(names.subspan(at));
        for (std::size_t i = at; i < at + hit; ++i) c.per_key[i] = true;
        at += hit + 1;
      }
      break;
    }
    case Kind::kDelete:
      for (std::size_t i = 0; i < names.size(); ++i) c.per_key[i] = store_->remove(names[i]);
      break;
    case Kind::kTouch:  // a hint: what the store refreshed is in its own counters
      store_->touch(names);
      c.per_key.assign(names.size(), true);
      break;
  }
  return c;
}

void AsyncStore::publish(Completion c) {
  MutexLock lock(done_mu_);
  done_.push_back(std::move(c));
  if (!fd_closed_) {
    const std::uint64_t one = 1;
    // Cannot fail short of counter overflow (2^64 - 2 undrained signals).
    [[maybe_unused]] const ssize_t n = ::write(efd_, &one, sizeof one);
  }
}

std::vector<AsyncStore::Completion> AsyncStore::drain_completions() {
  std::vector<Completion> out;
  {
    MutexLock lock(done_mu_);
    if (!fd_closed_) {
      std::uint64_t count = 0;
      [[maybe_unused]] const ssize_t n = ::read(efd_, &count, sizeof count);  // EAGAIN: none
    }
    out.swap(done_);
  }
  MutexLock pins(pins_mu_);
  for (const Completion& c : out) pins_.erase(c.id);  // with the GIL: releases the exports
  return out;
}

void AsyncStore::close() {
  py::gil_scoped_release nogil;  // the workers finish their jobs without it
  MutexLock serial(close_mu_);
  {
    MutexLock lock(mu_);
    closed_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_) {
    if (t.joinable()) t.join();
  }
  workers_.clear();
  server_.reset();
  MutexLock lock(done_mu_);
  if (!fd_closed_) {
    ::close(efd_);
    fd_closed_ = true;
  }
}

void register_async_store(py::module_& m) {
  py::class_<AsyncStore>(m, "AsyncStore",
                         "A store driven by batch jobs on C++ worker threads; completions on an "
                         "eventfd (LMCache's native_plugin connector surface)")
      .def(py::init([](py::object storage, std::string prefix, int workers,
                       std::size_t max_pending, int metrics_port, const std::string& metrics_bind,
                       std::int64_t spin_us) {
             std::shared_ptr<StorageBackend> backend;
             bool own = false;
             if (py::isinstance<PyStore>(storage)) {
               backend = storage.cast<PyStore&>().backend();
             } else if (py::isinstance<py::str>(storage)) {
               const auto text = storage.cast<std::string>();
               py::gil_scoped_release nogil;  // a Redis store connects
               backend = make_storage(text);
               own = true;
             } else {
               throw InvalidArgument(str_cat(
                   "AsyncStore: storage is a Store or the store's JSON config, not a ",
                   py::str(py::type::of(storage).attr("__name__")).cast<std::string>()));
             }
             return std::make_unique<AsyncStore>(std::move(backend), own, std::move(prefix),
                                                 workers, max_pending, metrics_port, metrics_bind,
                                                 spin_us);
           }),
           py::arg("storage"), py::kw_only(), py::arg("prefix") = "", py::arg("workers") = 4,
           py::arg("max_pending") = 1024, py::arg("metrics_port") = -1,
           py::arg("metrics_bind") = "127.0.0.1", py::arg("spin_us") = AsyncStore::kDefaultSpinUs)
      .def_readonly_static("DEFAULT_SPIN_US", &AsyncStore::kDefaultSpinUs)
      .def("event_fd", &AsyncStore::event_fd)
      .def("submit_batch_get", &AsyncStore::submit_batch_get, py::arg("keys"),
           py::arg("memoryviews"))
      .def("submit_batch_set", &AsyncStore::submit_batch_set, py::arg("keys"),
           py::arg("memoryviews"))
      .def("submit_batch_exists", &AsyncStore::submit_batch_exists, py::arg("keys"))
      .def("submit_batch_delete", &AsyncStore::submit_batch_delete, py::arg("keys"))
      .def("bind_rows", &AsyncStore::bind_rows, py::arg("region"), py::arg("row_bytes"))
      .def("submit_rows_get", &AsyncStore::submit_rows_get, py::arg("keys"), py::arg("rows"))
      .def("submit_rows_set", &AsyncStore::submit_rows_set, py::arg("keys"), py::arg("rows"))
      .def("drain_completions",
           [](AsyncStore& s) {
             py::list out;
             for (auto& c : s.drain_completions()) {
               py::list per_key;
               for (bool b : c.per_key) per_key.append(py::bool_(b));
               out.append(py::make_tuple(c.id, c.ok, c.error, per_key));
             }
             return out;
           })
      .def("close", &AsyncStore::close)
      .def("record_name", &AsyncStore::record_name, py::arg("key"))
      .def("exists_now", &AsyncStore::exists_now, py::arg("keys"))
      .def("touch", &AsyncStore::touch, py::arg("keys"))
      .def_property_readonly("store_name", &AsyncStore::store_name)
      .def("stats_json", &AsyncStore::stats_json)
      .def_property_readonly("prefix", &AsyncStore::prefix)
      .def_property_readonly("pending", &AsyncStore::pending)
      .def_property_readonly("looking", &AsyncStore::looking)
      .def_property_readonly("metrics_port", &AsyncStore::metrics_port)
      .def("metrics_json", &AsyncStore::metrics_json)
      .def("metrics_text", &AsyncStore::metrics_text);
}

}  // namespace hicache::binding
