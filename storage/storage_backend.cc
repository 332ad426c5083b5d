#include "storage/storage_backend.h"

#include <nlohmann/json.hpp>

#include <condition_variable>
#include <exception>
#include <unordered_map>

#include "storage/page_key.h"
#include "transfer/errors.h"
#include "transfer/mutex.h"

namespace hicache {

std::string_view to_string(IoStatus status) {
  switch (status) {
    case IoStatus::kOk: return "ok";
    case IoStatus::kMiss: return "miss";
    case IoStatus::kError: return "error";
  }
  return "?";
}

std::string StorageStats::to_json() const {
  nlohmann::json j = {{"exists_queries", exists_queries}, {"gets", gets},
                      {"get_hits", get_hits},             {"get_misses", get_misses},
                      {"get_errors", get_errors},         {"bad_records", bad_records},
                      {"sets", sets},                     {"set_written", set_written},
                      {"set_deduplicated", set_deduplicated}, {"set_errors", set_errors},
                      {"bytes_read", bytes_read},         {"bytes_written", bytes_written},
                      {"removes", removes},               {"evictions", evictions},
                      {"eviction_failures", eviction_failures}, {"stored_keys", stored_keys},
                      {"stored_bytes", stored_bytes},     {"capacity_bytes", capacity_bytes},
                      {"capacity_shrinks", capacity_shrinks},
                      {"topology_refreshes", topology_refreshes},
                      {"touched", touched},               {"touch_errors", touch_errors}};
  return j.dump();
}

void StorageBackend::set_removal_observer(RemovalObserver observer) {
  if (StorageBackend* inner = wrapped()) return inner->set_removal_observer(std::move(observer));
  MutexLock lock(observer_mu_);
  removal_observer_ = std::move(observer);
}

void StorageBackend::note_removed(std::span<const std::string> keys) const {
  if (keys.empty()) return;
  MutexLock lock(observer_mu_);
  if (removal_observer_) removal_observer_(keys);
}

// Keys some batch of this process is storing right now, with the outcome once known.
// The keys batch_set is writing now, so that a second writer of a key waits for the first
// instead of writing the same record again.
class StorageBackend::Inflight {
 public:
  // One key's write: set once by its writer, waited for by the others.
  struct Slot {
    Mutex mu;
    std::condition_variable cv;
    bool done HICACHE_GUARDED_BY(mu) = false;
    IoResult result HICACHE_GUARDED_BY(mu);

    void finish(const IoResult& r) {
      {
        MutexLock lock(mu);
        result = r;
        done = true;
      }
      cv.notify_all();
    }
    IoResult wait() {
      MutexLock lock(mu);
      while (!done) mu.wait(cv);
      return result;
    }
  };
  Mutex mu;
  std::unordered_map<std::string, std::shared_ptr<Slot>> slots HICACHE_GUARDED_BY(mu);
};

StorageBackend::StorageBackend() : inflight_(std::make_unique<Inflight>()) {}
std::vector<bool> StorageBackend::exists_each(std::span<const std::string> keys) {
  std::vector<bool> out(keys.size(), false);
  for (std::size_t i = 0; i < keys.size(); ++i) out[i] = batch_exists(keys.subspan(i, 1)) == 1;
  return out;
}

StorageBackend::~StorageBackend() = default;

namespace {

template <typename Span>
void validate_batch(std::span<const std::string> keys, std::span<const Span> spans,
                    const char* what) {
  if (keys.size() != spans.size()) {
    throw InvalidArgument(str_cat(what, ": ", keys.size(), " keys but ", spans.size(), " spans"));
  }
  for (std::size_t i = 0; i < keys.size(); ++i) {
    validate_key(keys[i]);
    if (spans[i].empty()) {
      throw InvalidArgument(str_cat(what, ": span ", i, " for key '", keys[i], "' is empty"));
    }
  }
}

}  // namespace

std::vector<IoResult> StorageBackend::batch_get(std::span<const std::string> keys,
                                                std::span<const ByteSpan> dst) {
  validate_batch(keys, dst, "batch_get");
  std::vector<IoResult> results;
  try {
    results = do_batch_get(keys, dst);
  } catch (const std::exception& e) {
    results.assign(keys.size(), IoResult::error(str_cat(name(), " batch_get failed: ", e.what())));
  }
  if (results.size() != keys.size()) {
    results.assign(keys.size(), IoResult::error(str_cat(name(), " batch_get returned ",
                                                        results.size(), " results")));
  }
  counters_.gets += keys.size();
  for (std::size_t i = 0; i < keys.size(); ++i) {
    switch (results[i].status) {
      case IoStatus::kOk:
        ++counters_.get_hits;
        counters_.bytes_read += dst[i].size();
        break;
      case IoStatus::kMiss: ++counters_.get_misses; break;
      case IoStatus::kError: ++counters_.get_errors; break;
    }
  }
  return results;
}

std::vector<IoResult> StorageBackend::batch_set(std::span<const std::string> keys,
                                                std::span<const ConstByteSpan> src) {
  validate_batch(keys, src, "batch_set");
  const std::size_t n = keys.size();
  std::vector<IoResult> results(n);
  // For each key: mine (this batch writes it), a slot of another batch, or an earlier index of
  // this batch holding the same key.
  std::vector<std::shared_ptr<Inflight::Slot>> theirs(n);
  std::vector<std::size_t> same_as(n, n);
  std::vector<std::size_t> mine;
  mine.reserve(n);
  std::vector<std::shared_ptr<Inflight::Slot>> my_slots;
  {
    MutexLock lock(inflight_->mu);
    std::unordered_map<std::string_view, std::size_t> first;
    for (std::size_t i = 0; i < n; ++i) {
      if (auto [it, fresh] = first.try_emplace(keys[i], i); !fresh) {
        same_as[i] = it->second;
        continue;
      }
      auto [it, fresh] = inflight_->slots.try_emplace(keys[i]);
      if (!fresh) {
        theirs[i] = it->second;
        continue;
      }
      it->second = std::make_shared<Inflight::Slot>();
      my_slots.push_back(it->second);
      mine.push_back(i);
    }
  }

  std::vector<IoResult> written;
  try {
    if (mine.size() == n) {
      written = do_batch_set(keys, src);
    } else if (!mine.empty()) {
      std::vector<std::string> sub_keys;
      std::vector<ConstByteSpan> sub_src;
      sub_keys.reserve(mine.size());
      sub_src.reserve(mine.size());
      for (std::size_t i : mine) {
        sub_keys.push_back(keys[i]);
        sub_src.push_back(src[i]);
      }
      written = do_batch_set(sub_keys, sub_src);
    }
  } catch (const std::exception& e) {
    written.assign(mine.size(), IoResult::error(str_cat(name(), " batch_set failed: ", e.what())));
  }
  if (written.size() != mine.size()) {
    written.assign(mine.size(), IoResult::error(str_cat(name(), " batch_set returned ",
                                                        written.size(), " results")));
  }
  {
    MutexLock lock(inflight_->mu);
    for (std::size_t m = 0; m < mine.size(); ++m) inflight_->slots.erase(keys[mine[m]]);
  }
  for (std::size_t m = 0; m < mine.size(); ++m) {
    results[mine[m]] = written[m];
    my_slots[m]->finish(written[m]);
  }

  counters_.sets += n;
  for (std::size_t i = 0; i < n; ++i) {
    if (theirs[i]) {
      results[i] = theirs[i]->wait();
      if (results[i].is_ok()) ++counters_.set_deduplicated;
    } else if (same_as[i] != n) {
      results[i] = results[same_as[i]];
      if (results[i].is_ok()) ++counters_.set_deduplicated;
    }
    if (results[i].status != IoStatus::kOk) ++counters_.set_errors;
  }
  return results;
}

StorageStats StorageBackend::stats() const {
  if (const StorageBackend* inner = wrapped()) return inner->stats();
  StorageStats s;
  const Counters& c = counters_;
  s.exists_queries = c.exists_queries.value();
  s.gets = c.gets.value();
  s.get_hits = c.get_hits.value();
  s.get_misses = c.get_misses.value();
  s.get_errors = c.get_errors.value();
  s.bad_records = c.bad_records.value();
  s.sets = c.sets.value();
  s.set_written = c.set_written.value();
  s.set_deduplicated = c.set_deduplicated.value();
  s.set_errors = c.set_errors.value();
  s.bytes_read = c.bytes_read.value();
  s.bytes_written = c.bytes_written.value();
  s.removes = c.removes.value();
  s.evictions = c.evictions.value();
  s.eviction_failures = c.eviction_failures.value();
  s.capacity_shrinks = c.capacity_shrinks.value();
  s.topology_refreshes = c.topology_refreshes.value();
  s.touched = c.touched.value();
  s.touch_errors = c.touch_errors.value();
  fill_gauges(s);
  return s;
}

void StorageBackend::unregister_metrics() {
  if (StorageBackend* inner = wrapped()) inner->unregister_metrics();
  metrics_.reset();
}

void StorageBackend::register_metrics(MetricsRegistry& registry, MetricLabels labels) {
  if (StorageBackend* inner = wrapped()) return inner->register_metrics(registry, std::move(labels));
  labels.emplace_back("backend", std::string(name()));
  metrics_.attach(registry, std::move(labels));
  const Counters& c = counters_;
  constexpr const char* kKeys = "hicache_storage_keys_total";
  constexpr const char* kKeysHelp = "Keys the L3 store was asked for, by operation and result";
  metrics_.add(kKeys, kKeysHelp, {{"op", "exists"}, {"result", "asked"}}, c.exists_queries);
  metrics_.add(kKeys, kKeysHelp, {{"op", "get"}, {"result", "hit"}}, c.get_hits);
  metrics_.add(kKeys, kKeysHelp, {{"op", "get"}, {"result", "miss"}}, c.get_misses);
  metrics_.add(kKeys, kKeysHelp, {{"op", "get"}, {"result", "error"}}, c.get_errors);
  metrics_.add(kKeys, kKeysHelp, {{"op", "set"}, {"result", "written"}}, c.set_written);
  metrics_.add(kKeys, kKeysHelp, {{"op", "set"}, {"result", "deduplicated"}},
               c.set_deduplicated);
  metrics_.add(kKeys, kKeysHelp, {{"op", "set"}, {"result", "error"}}, c.set_errors);
  metrics_.add(kKeys, kKeysHelp, {{"op", "remove"}, {"result", "removed"}}, c.removes);
  metrics_.add(kKeys, kKeysHelp, {{"op", "touch"}, {"result", "touched"}}, c.touched);
  metrics_.add(kKeys, kKeysHelp, {{"op", "touch"}, {"result", "error"}}, c.touch_errors);
  metrics_.add("hicache_storage_bad_records_total",
               "Records read back corrupt, truncated or foreign (served as misses, removed)", {},
               c.bad_records);
  constexpr const char* kBytes = "hicache_storage_bytes_total";
  constexpr const char* kBytesHelp = "Payload bytes read from and written to the L3 store";
  metrics_.add(kBytes, kBytesHelp, {{"direction", "read"}}, c.bytes_read);
  metrics_.add(kBytes, kBytesHelp, {{"direction", "written"}}, c.bytes_written);
  metrics_.add("hicache_storage_evictions_total", "Records the store evicted for capacity", {},
               c.evictions);
  metrics_.add("hicache_storage_eviction_failures_total",
               "Records the evictor could not remove", {}, c.eviction_failures);
  // The store's share of the misses: keys it does not hold, records it found corrupt (removed
  // and served as misses), and keys it could not read.
  metrics_.add_counter_fn(kMissesMetric, kMissesHelp, {{"reason", "not_stored"}}, [&c] {
    const double bad = static_cast<double>(c.bad_records.value());
    return std::max(0.0, static_cast<double>(c.get_misses.value()) - bad);
  });
  metrics_.add(kMissesMetric, kMissesHelp, {{"reason", "corrupt_record"}}, c.bad_records);
  metrics_.add(kMissesMetric, kMissesHelp, {{"reason", "storage_error"}}, c.get_errors);
  metrics_.add_gauge_fn("hicache_storage_stored_bytes", "Record bytes the store holds", {},
                        [this] { return static_cast<double>(stats().stored_bytes); });
  metrics_.add_gauge_fn("hicache_storage_capacity_bytes",
                        "The bound on the record bytes (0: none); a full disk lowers it", {},
                        [this] { return static_cast<double>(stats().capacity_bytes); });
  metrics_.add("hicache_storage_capacity_shrinks_total",
               "Writes that met a full disk within the capacity (it shrank to what fits)", {},
               c.capacity_shrinks);
  metrics_.add("hicache_storage_topology_refreshes_total",
               "A cluster's slot map re-read after a failed request or a MOVED redirect", {},
               c.topology_refreshes);
}

}  // namespace hicache
