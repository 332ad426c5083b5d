#include "tools/workload/simulated_engine.h"

#include <algorithm>
#include <optional>
#include <string_view>
#include <thread>

#include "pools/kv_layout.h"
#include "pools/kv_pattern.h"
#include "pools/sidecar_pool.h"
#include "transfer/copy_plan.h"
#include "transfer/errors.h"

namespace hicache {

std::uint64_t page_data_seed(std::span<const std::int32_t> tokens, std::size_t page,
                             std::int32_t page_size, std::string_view identity) {
  const auto prefix = tokens.first((page + 1) * static_cast<std::size_t>(page_size));
  const std::uint64_t seed = std::hash<std::string_view>{}(
      std::string_view(reinterpret_cast<const char*>(prefix.data()), prefix.size_bytes()));
  return identity.empty() ? seed : seed ^ (std::hash<std::string_view>{}(identity) * 31);
}

SimulatedEngine::SimulatedEngine(HiRadixCache& cache, HiCacheController& controller,
                                 DeviceKVPool& device_pool, HostKVPool& host_pool, Device& device,
                                 SimulatedEngineConfig config)
    : cache_(cache), controller_(controller), device_pool_(device_pool), host_pool_(host_pool),
      config_(config), page_size_(cache.page_size()) {
  if (config_.max_batch < 1) {
    throw InvalidArgument(str_cat("simulated engine: max_batch ", config_.max_batch, " < 1"));
  }
  if (config_.max_running < config_.max_batch) {
    throw InvalidArgument(str_cat("simulated engine: max_running ", config_.max_running,
                                  " < max_batch ", config_.max_batch));
  }
  if (!(config_.decode_step_seconds >= 0)) {
    throw InvalidArgument(str_cat("simulated engine: decode_step_seconds ",
                                  config_.decode_step_seconds, " < 0"));
  }
  if (config_.max_prefetches < 1) {
    throw InvalidArgument(str_cat("simulated engine: max_prefetches ", config_.max_prefetches,
                                  " < 1"));
  }
  if (!(config_.host_free_target >= 0 && config_.host_free_target <= 1)) {
    throw InvalidArgument(str_cat("simulated engine: host_free_target ", config_.host_free_target,
                                  " outside [0, 1]"));
  }
  if (config_.cost_per_token_layer < 0) {
    throw InvalidArgument(str_cat("simulated engine: cost_per_token_layer ",
                                  config_.cost_per_token_layer, " < 0"));
  }
  if (config_.checkpoint_every_pages < 1) {
    throw InvalidArgument(str_cat("simulated engine: checkpoint_every_pages ",
                                  config_.checkpoint_every_pages, " < 1"));
  }
  if (controller_.num_sidecars() > 0 && !device.device_memory_is_host_accessible()) {
    throw InvalidArgument(
        "simulated engine: a hybrid model (sidecar pools) on a device whose memory the CPU "
        "cannot read: the engine writes and checks sidecar pages in place (host emulation only)");
  }
  if (config_.stage_page_data || !device.device_memory_is_host_accessible()) {
    // One page in the device pool's own layout, so that a page moves as the pool's runs.
    staging_ = device.alloc_host(
        static_cast<std::size_t>(kv_buffer_bytes(device_pool_.geometry(), page_size_)));
    staging_desc_ = make_device_layout(device_pool_.geometry(), page_size_, staging_.data());
    staging_stream_ = device.create_stream();
  }
}

void SimulatedEngine::stage_copy(std::int64_t page, bool to_device) {
  const LayoutDesc& pool = device_pool_.layout();
  const std::int64_t pool_page[1] = {page}, staged_page[1] = {0};
  staging_regions_.clear();
  if (to_device) {
    append_page_copies(pool, pool_page, staging_desc_, staged_page, 0, pool.num_layers,
                       staging_regions_);
  } else {
    append_page_copies(staging_desc_, staged_page, pool, pool_page, 0, pool.num_layers,
                       staging_regions_);
  }
  staging_stream_->copy_batch_async(staging_regions_);
  staging_stream_->synchronize();  // throws DeviceError naming the failed copy
}

void SimulatedEngine::fill_device_page(std::int64_t page, std::uint64_t seed) {
  if (!staging_stream_) return fill_page(device_pool_.layout(), page, seed);
  fill_page(staging_desc_, 0, seed);
  stage_copy(page, /*to_device=*/true);
}

bool SimulatedEngine::verify_device_page(std::int64_t page, std::uint64_t seed) {
  if (!staging_stream_) return verify_page(device_pool_.layout(), page, seed);
  stage_copy(page, /*to_device=*/false);
  return verify_page(staging_desc_, 0, seed);
}

void SimulatedEngine::submit(SimulatedRequest request) {
  if (request.output_tokens < 0 ||
      static_cast<std::size_t>(request.output_tokens) >= request.tokens.size()) {
    throw InvalidArgument(str_cat("simulated engine: request '", request.id, "' has ",
                                  request.output_tokens, " output tokens of ",
                                  request.tokens.size(), ": the prompt must not be empty"));
  }
  if (request.tokens.size() < static_cast<std::size_t>(page_size_)) {
    throw InvalidArgument(str_cat("simulated engine: request '", request.id, "' has ",
                                  request.tokens.size(), " tokens, less than one page"));
  }
  if (request.arrival == std::chrono::steady_clock::time_point{}) {
    request.arrival = std::chrono::steady_clock::now();
  }
  waiting_.push_back(Waiting{std::move(request)});
  stalled_ = false;  // a new request may run at the next step: no waiting before it
}

bool SimulatedEngine::admit(Waiting& w, std::vector<Running>& batch) {
  SimulatedRequest& request = w.request;
  const std::size_t prompt = request.prompt().size();
  // Whole pages of prompt and answer go into the tree at the end; slots are taken for them now.
  const std::size_t cacheable = request.tokens.size() / page_size_ * page_size_;
  auto m = cache_.match_prefix(request.prompt(), request.identity);
  Running r;
  r.held = m.last_host_node;
  cache_.lock(r.held);
  // Device slots for what is computed first (evicting while the prefix is locked), and only
  // then the load back: a request deferred for memory has loaded nothing (its loads would be
  // evicted again by the admissions that ran instead, and loaded again next time).
  // Evicts only what is missing, and only when eviction can make the request fit (free plus
  // evictable, as SGLang's scheduler weighs it): evicting for a request that is deferred anyway
  // would empty the device of pages that later requests hit.
  auto alloc = [&](std::int64_t tokens) -> std::optional<std::vector<std::int64_t>> {
    if (tokens == 0) return std::vector<std::int64_t>{};
    auto& allocator = device_pool_.allocator();
    auto got = allocator.alloc(tokens);
    if (!got) {
      const std::int64_t missing = tokens - allocator.free_tokens();
      if (cache_.evictable_device_tokens() >= missing) {
        cache_.evict_device(missing);
        got = allocator.alloc(tokens);
      }
    }
    return got;
  };
  const auto host_part = m.host_hit_tokens;
  const auto missing = static_cast<std::int64_t>(cacheable - m.device_slots.size()) - host_part;
  auto fresh = alloc(missing);
  if (!fresh) {
    cache_.unlock(r.held);
    ++stats_.deferred;
    return false;
  }
  r.slots = m.device_slots;
  std::int64_t loaded = 0;
  if (host_part > 0) {
    if (auto back = cache_.load_back(r.held)) {
      loaded = static_cast<std::int64_t>(back->size() - r.slots.size());
      r.slots = std::move(*back);
    } else {  // refused (cost, or device short): recompute the host part
      auto extra = alloc(host_part);
      if (!extra) {
        device_pool_.allocator().free(*fresh);
        cache_.unlock(r.held);
        ++stats_.deferred;
        return false;
      }
      cache_.unlock(r.held);
      r.held = m.last_device_node;
      cache_.lock(r.held);
      r.slots.insert(r.slots.end(), extra->begin(), extra->end());
    }
  }
  r.slots.insert(r.slots.end(), fresh->begin(), fresh->end());
  r.cached_tokens = m.device_slots.size() + static_cast<std::size_t>(loaded);
  r.prompt_tokens = prompt;
  // A hybrid model's load back may cover pages on the device already (past the device part's
  // restorable end): device hits, not host ones.
  const std::int64_t resident = loaded > 0 ? m.resident_host_hit_tokens : 0;
  loaded -= resident;
  const auto device_hit = static_cast<std::int64_t>(r.cached_tokens) - loaded;
  const std::int64_t from_storage = std::min(loaded, w.storage_tokens);
  const auto computed = static_cast<std::int64_t>(prompt - r.cached_tokens);
  r.storage_asks = w.storage_asks;
  r.known_before_prefetch = w.known_before_prefetch;
  r.storage_tokens = w.storage_tokens;
  r.load_failures = w.load_failures;
  r.report = FinishedRequest{.id = request.id,
                             .prompt_tokens = static_cast<std::int64_t>(prompt),
                             .output_tokens = request.output_tokens,
                             .device_hit_tokens = device_hit,
                             .host_hit_tokens = loaded - from_storage,
                             .storage_hit_tokens = from_storage,
                             .computed_tokens = computed};
  r.request = std::move(request);
  batch.push_back(std::move(r));
  return true;
}

void SimulatedEngine::note_mismatch(const Running& r, const std::string& what) {
  ++stats_.mismatched_pages;
  if (first_mismatch_.empty()) first_mismatch_ = str_cat("request ", r.request.id, " ", what);
}

void SimulatedEngine::verify(const Running& r) {
  const std::size_t pages = r.cached_tokens / page_size_;
  for (std::size_t p = 0; p < pages; ++p) {
    const std::int64_t page = r.slots[p * page_size_] / page_size_;
    if (verify_device_page(page,
                           data_seed(r.request, p))) {
      ++stats_.verified_pages;
    } else {
      note_mismatch(r, str_cat("page ", p));
    }
  }
  if (controller_.num_sidecars() > 0) verify_sidecars(r);
}

std::uint64_t SimulatedEngine::sidecar_seed(const SimulatedRequest& request, std::size_t page,
                                            std::size_t pool) const {
  return data_seed(request, page) * 0x100000001B3ull + pool + 1;
}

void SimulatedEngine::verify_sidecars(const Running& r) {
  const auto p = static_cast<std::int64_t>(r.cached_tokens) / page_size_;
  if (p == 0) return;
  for (std::size_t pool = 0; pool < controller_.num_sidecars(); ++pool) {
    const SidecarPool& sp = controller_.sidecar(pool);
    const std::int64_t from = sp.spec().policy == SidecarHitPolicy::kAllPages
                                  ? 0
                                  : std::max<std::int64_t>(0, p - sp.spec().window_pages);
    const auto held = cache_.sidecar_device_slots(r.held, static_cast<std::int32_t>(pool));
    for (std::int64_t page = from; page < p; ++page) {
      const auto it = std::find_if(held.begin(), held.end(),
                                   [&](const auto& h) { return h.page == page; });
      if (it == held.end()) {
        note_mismatch(r, str_cat("sidecar pool ", sp.spec().name, " page ", page,
                                 " missing at a restorable prefix of ", p, " pages"));
        continue;
      }
      const std::int64_t pool_page = it->device_slots[0] / sp.spec().slots_per_page;
      if (verify_page(sp.device_pool().layout(), pool_page,
                      sidecar_seed(r.request, static_cast<std::size_t>(page), pool))) {
        ++stats_.verified_pages;
        ++stats_.verified_sidecar_pages;
      } else {
        note_mismatch(r, str_cat("sidecar pool ", sp.spec().name, " page ", page));
      }
    }
  }
}

std::vector<std::int64_t> SimulatedEngine::sidecar_pages(std::size_t pool, std::size_t from,
                                                         std::size_t pages) const {
  const SidecarSpec& spec = controller_.sidecar(pool).spec();
  std::vector<std::int64_t> out;
  if (spec.policy == SidecarHitPolicy::kAllPages) {
    for (std::size_t q = from; q < pages; ++q) out.push_back(static_cast<std::int64_t>(q));
    return out;
  }
  // A trailing pool: the window before each checkpoint (every checkpoint_every_pages pages and
  // the last page), of the pages computed.
  std::vector<bool> take(pages, false);
  const auto every = static_cast<std::size_t>(config_.checkpoint_every_pages);
  const auto window = static_cast<std::size_t>(spec.window_pages);
  for (std::size_t q = 0; q < pages; ++q) {
    if ((q + 1) % every != 0 && q + 1 != pages) continue;
    for (std::size_t k = q + 1 > window ? q + 1 - window : 0; k <= q; ++k) take[k] = true;
  }
  for (std::size_t q = from; q < pages; ++q) {
    if (take[q]) out.push_back(static_cast<std::int64_t>(q));
  }
  return out;
}

std::optional<std::vector<std::int64_t>> SimulatedEngine::alloc_sidecar(std::size_t pool,
                                                                        std::int64_t n) {
  TokenSlotAllocator& a = controller_.sidecar(pool).device_pool().allocator();
  const std::int64_t slots = n * controller_.sidecar(pool).spec().slots_per_page;
  if (slots == 0) return std::vector<std::int64_t>{};
  auto got = a.alloc(slots);
  // Device nodes go (their sidecar pages with them) while they free this pool's pages: a few
  // in a row that free none end it. With nothing to evict while writes or backups are in
  // flight (their nodes are not candidates until acked), the acks are applied and waited for,
  // as the KV's failed loads are (retry_after_failed_loads): those counts change only at agreed
  // acks, so TP ranks make the same check_events calls.
  for (int barren = 0, quiet = 0; !got && barren < 4 && quiet < kQuietWaits;) {
    const std::int64_t before = a.free_tokens();
    if (cache_.evict_device(page_size_) == 0) {
      // Writes and backups lock their nodes until acked.
      const auto busy = [&] {
        const auto st = cache_.stats();
        return st.writes_in_flight > 0;
      };
      if (!busy()) break;
      const std::uint64_t seen = cache_.event_seq();
      cache_.check_events();
      if (busy()) {
        quiet = cache_.wait_for_events(seen, std::chrono::steady_clock::now() + kQuietWait)
                    ? 0
                    : quiet + 1;
      }
      continue;
    }
    got = a.alloc(slots);
    barren = a.free_tokens() > before ? 0 : barren + 1;
  }
  return got;
}

// A prefilled request's tokens by where they came from (counted once its prefill ran: a request
// whose loads failed is admitted again, and counted then).
void SimulatedEngine::account(const Running& r, std::optional<double> compute_seconds) {
  const FinishedRequest& f = r.report;
  cache_.record_prefill(f.device_hit_tokens, f.host_hit_tokens, f.storage_hit_tokens,
                        f.computed_tokens, compute_seconds);
  stats_.device_hit_tokens += f.device_hit_tokens;
  stats_.loaded_back_tokens += f.host_hit_tokens + f.storage_hit_tokens;
  stats_.storage_hit_tokens += f.storage_hit_tokens;
  stats_.computed_tokens += f.computed_tokens;
  stats_.prompt_tokens += f.prompt_tokens;
  stats_.output_tokens += f.output_tokens;
}

// The step's loads failed: nothing of the batch may use what they copied. Each request gives
// back its own slots and its lock and waits again at the queue's front (kMaxLoadFailures times
// at most, then it is rejected). The failed loads' slots still look cached until their acks (not
// ok) free them, so this waits for those acks to be applied before anything is admitted again.
void SimulatedEngine::retry_after_failed_loads(std::vector<Running>& batch) {
  for (auto it = batch.rbegin(); it != batch.rend(); ++it) {
    Running& r = *it;
    device_pool_.allocator().free(std::span(r.slots).subspan(r.cached_tokens));
    cache_.unlock(r.held);
    ++stats_.failed_prefills;
    if (r.load_failures + 1 >= kMaxLoadFailures) {
      ++stats_.rejected;
      continue;
    }
    waiting_.push_front(Waiting{std::move(r.request), r.storage_asks, r.known_before_prefetch,
                                r.storage_tokens, r.load_failures + 1});
  }
  batch.clear();
  int quiet = 0;
  while (cache_.stats().loads_in_flight > 0 && quiet < kQuietWaits) {
    const std::uint64_t seen = cache_.event_seq();
    cache_.check_events();
    if (cache_.stats().loads_in_flight == 0) break;
    quiet = cache_.wait_for_events(seen, std::chrono::steady_clock::now() + kQuietWait) ? 0
                                                                                       : quiet + 1;
  }
}

std::uint64_t SimulatedEngine::data_seed(const SimulatedRequest& request, std::size_t page) const {
  const std::uint64_t seed = page_data_seed(request.tokens, page, page_size_, request.identity);
  return config_.data_salt == 0 ? seed : seed ^ (config_.data_salt * 0x9E3779B97F4A7C15ull);
}

bool SimulatedEngine::step() {
  const auto t0 = std::chrono::steady_clock::now();
  ++stats_.step_calls;
  stalled_ = false;
  events_seen_ = cache_.event_seq();  // before the events are drained: none is missed
  cache_.check_events();
  // Prefetches that are over rejoin the queue's front.
  for (std::size_t i = 0; i < prefetching_.size();) {
    Waiting& w = prefetching_[i];
    // What the prefetch itself added to the tree: pages another request cached meanwhile (the
    // prefix grew while this one waited) are not L3 hits and are not counted as such.
    if (cache_.check_prefetch_progress(w.request.id, &w.storage_tokens)) {
      waiting_.push_front(std::move(w));
      prefetching_.erase(prefetching_.begin() + static_cast<std::ptrdiff_t>(i));
    } else {
      ++i;
    }
  }
  const auto host_target = static_cast<std::int64_t>(
      config_.host_free_target * static_cast<double>(host_pool_.capacity_tokens()));
  cache_.evict_host_to_free(host_target);
  std::vector<Running> batch;
  std::deque<Waiting> deferred;
  while (!waiting_.empty() && static_cast<int>(batch.size()) < config_.max_batch &&
         static_cast<int>(batch.size() + decoding_.size()) < config_.max_running) {
    Waiting w = std::move(waiting_.front());
    waiting_.pop_front();
    if (config_.use_storage && w.storage_asks < kMaxStorageAsks) {
      // Ask L3 for what follows the tree: at the first admission, and again when the tree lost
      // part of the prefix since the last ask (host eviction while the request waited for
      // device memory), at most kMaxStorageAsks times per request.
      const auto span = w.request.prompt();
      const std::int64_t known = cache_.cached_prefix_tokens(span, w.request.identity);
      if (known < static_cast<std::int64_t>(span.size()) && (w.storage_asks == 0 || known < w.known_before_prefetch)) {
        if (static_cast<int>(prefetching_.size()) >= config_.max_prefetches) {
          deferred.push_back(std::move(w));  // waits for a prefetch slot
          continue;
        }
        ++w.storage_asks;
        w.known_before_prefetch = known;
        auto m = cache_.match_prefix(span, w.request.identity);
        if (cache_.prefetch_from_storage(w.request.id, m.last_host_node,
                                         span.subspan(static_cast<std::size_t>(known)),
                                         w.request.identity)) {
          ++stats_.prefetches;
          prefetching_.push_back(std::move(w));
          continue;
        }
      }
    }
    if (!admit(w, batch)) deferred.push_back(std::move(w));
  }
  for (auto it = deferred.rbegin(); it != deferred.rend(); ++it) waiting_.push_front(std::move(*it));
  if (batch.empty() && decoding_.empty()) {
    // Loads queued by an admission that was then deferred for memory run only once handed to
    // the load thread; nobody reads them in this step, so the consumer's side is released now.
    if (const std::int32_t slot = controller_.start_loading(); slot >= 0) {
      controller_.layer_done_counter().release(slot);
    }
    stats_.step_seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (waiting_.empty() && prefetching_.empty()) return false;
    const auto s = cache_.stats();
    if (prefetching_.empty() && s.writes_in_flight == 0 && s.loads_in_flight == 0 &&
        s.backups_in_flight == 0) {
      // Nothing in flight will free memory: the front request can never fit.
      waiting_.pop_front();
      ++stats_.rejected;
      return true;
    }
    stalled_ = true;  // waiting on prefetches, or on memory that acks will free
    return true;
  }

  // The prefill forward pass, layer by layer, overlapping the loads (with no prefill, only the
  // loads of deferred admissions are released).
  const std::int32_t slot = controller_.start_loading();
  if (batch.empty()) {
    if (slot >= 0) controller_.layer_done_counter().release(slot);
  } else {
    std::int64_t computed = 0;
    for (const Running& r : batch) computed += static_cast<std::int64_t>(r.prompt_tokens - r.cached_tokens);
    const auto per_layer = std::chrono::duration<double>(config_.cost_per_token_layer *
                                                         static_cast<double>(computed));
    bool loaded = true;
    double computing = 0;  // the forward pass's compute time, waits for loads excluded
    for (std::int32_t layer = 0; layer < device_pool_.geometry().num_layers; ++layer) {
      loaded = device_pool_.wait_for_layer(layer) && loaded;
      if (loaded && per_layer.count() > 0) {
        const auto t = std::chrono::steady_clock::now();
        std::this_thread::sleep_for(per_layer);  // the GPU computing layer `layer`
        computing += std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
        stats_.compute_seconds += per_layer.count();
      }
    }
    if (slot >= 0) {
      controller_.layer_done_counter().release(slot);
      // TP: one rank's failed load spoils the batch on every rank (their forward passes
      // combine), and the ranks must schedule alike.
      loaded = cache_.on_every_rank(loaded, "engine.loads_ok");
    }
    if (!loaded) retry_after_failed_loads(batch);
    const auto now = std::chrono::steady_clock::now();
    for (Running& r : batch) {
      // The cache's cost rule weighs what a computed token cost (each request's share of the
      // pass); with no compute simulated there is no cost to report.
      const double share =
          computed > 0 ? computing * static_cast<double>(r.prompt_tokens - r.cached_tokens) /
                             static_cast<double>(computed)
                       : 0;
      account(r, per_layer.count() > 0 ? std::optional<double>(share) : std::nullopt);
      verify(r);
      r.report.ttft_s = std::chrono::duration<double>(now - r.request.arrival).count();
      r.first_token = now;
      r.left = std::max(0, r.request.output_tokens - 1);  // prefill produced the first
      if (r.left == 0) {
        finish(r);
      } else {
        decoding_.push_back(std::move(r));
      }
    }
  }
  // Then one decode step for every decoding request (those just prefilled included).
  if (!decoding_.empty()) decode_step();
  ++stats_.steps;
  stats_.step_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return true;
}

void SimulatedEngine::decode_step() {
  if (config_.decode_step_seconds > 0) {
    std::this_thread::sleep_for(std::chrono::duration<double>(config_.decode_step_seconds));
    stats_.compute_seconds += config_.decode_step_seconds;
  }
  ++stats_.decode_steps;
  for (std::size_t i = 0; i < decoding_.size();) {
    if (--decoding_[i].left > 0) {
      ++i;
      continue;
    }
    finish(decoding_[i]);
    decoding_.erase(decoding_.begin() + static_cast<std::ptrdiff_t>(i));
  }
}

void SimulatedEngine::finish(Running& r) {
  const auto now = std::chrono::steady_clock::now();
  const std::size_t cacheable = r.slots.size();
  const std::size_t cached_pages = r.cached_tokens / page_size_, pages = cacheable / page_size_;
  for (std::size_t p = cached_pages; p < pages; ++p) {
    fill_device_page(r.slots[p * page_size_] / page_size_,
                     data_seed(r.request, p));
  }
  // Hybrid: each pool's pages of what was computed, written with their data.
  std::vector<std::vector<std::int64_t>> side_pages, side_slots;
  bool complete = true;
  for (std::size_t pool = 0; pool < controller_.num_sidecars() && complete; ++pool) {
    side_pages.push_back(sidecar_pages(pool, cached_pages, pages));
    auto slots = alloc_sidecar(pool, static_cast<std::int64_t>(side_pages.back().size()));
    if (!slots) {
      complete = false;
      side_pages.pop_back();
      break;
    }
    const SidecarPool& sp = controller_.sidecar(pool);
    const auto spp = static_cast<std::size_t>(sp.spec().slots_per_page);
    for (std::size_t k = 0; k < side_pages.back().size(); ++k) {
      fill_page(sp.device_pool().layout(), (*slots)[k * spp] / static_cast<std::int64_t>(spp),
                sidecar_seed(r.request, static_cast<std::size_t>(side_pages.back()[k]), pool));
    }
    side_slots.push_back(std::move(*slots));
  }
  const auto ours = static_cast<std::int64_t>(r.cached_tokens);
  if (!complete) {
    // A pool has no room for the state to complete the entry: not cached (slots go back).
    for (std::size_t pool = 0; pool < side_slots.size(); ++pool) {
      controller_.sidecar(pool).device_pool().allocator().free(side_slots[pool]);
    }
    device_pool_.allocator().free(std::span(r.slots).subspan(r.cached_tokens));
    ++stats_.uncached_requests;
  } else {
    std::vector<HiRadixCache::SidecarInsert> side;
    for (std::size_t pool = 0; pool < side_pages.size(); ++pool) {
      side.push_back({static_cast<std::int32_t>(pool), side_pages[pool], side_slots[pool]});
    }
    const std::int64_t dup = cache_.insert(std::span(r.request.tokens).first(cacheable), r.slots,
                                           r.request.identity, side);
    if (dup > ours) device_pool_.allocator().free(std::span(r.slots).subspan(ours, dup - ours));
    // The tree keeps its own sidecar pages of the pages it held already: ours go back.
    const std::int64_t dup_pages = dup / page_size_;
    for (std::size_t pool = 0; pool < side_pages.size(); ++pool) {
      const auto spp = static_cast<std::size_t>(controller_.sidecar(pool).spec().slots_per_page);
      std::vector<std::int64_t> back;
      for (std::size_t k = 0; k < side_pages[pool].size() && side_pages[pool][k] < dup_pages; ++k) {
        back.insert(back.end(), side_slots[pool].begin() + static_cast<std::ptrdiff_t>(k * spp),
                    side_slots[pool].begin() + static_cast<std::ptrdiff_t>((k + 1) * spp));
      }
      if (!back.empty()) controller_.sidecar(pool).device_pool().allocator().free(back);
    }
  }
  cache_.unlock(r.held);
  ++stats_.finished;
  if (config_.record_finished) {
    r.report.e2e_s = std::chrono::duration<double>(now - r.request.arrival).count();
    if (r.request.output_tokens > 1) {
      r.report.itl_s = std::chrono::duration<double>(now - r.first_token).count() /
                       (r.request.output_tokens - 1);
    }
    finished_.push_back(std::move(r.report));
  }
}

bool SimulatedEngine::wait_for_progress(std::optional<std::chrono::steady_clock::time_point> deadline) {
  if (!stalled_) return true;
  return wait_quietly(deadline);
}

// Waits for an event after the last step's start, kQuietWait at most (the backstop that lets
// the loops below give up on an op that never answers): false when it passed quietly.
bool SimulatedEngine::wait_quietly(std::optional<std::chrono::steady_clock::time_point> deadline) {
  const auto backstop = std::chrono::steady_clock::now() + kQuietWait;
  if (deadline && *deadline <= backstop) {
    cache_.wait_for_events(events_seen_, deadline);
    return true;
  }
  return cache_.wait_for_events(events_seen_, backstop);
}

void SimulatedEngine::run_until_idle(std::int64_t max_steps) {
  int quiet = 0;
  for (std::int64_t i = 0; i < max_steps && step(); ++i) {
    quiet = wait_for_progress() ? 0 : quiet + 1;
    if (quiet == kQuietWaits) return;  // stuck: the caller finds requests still waiting
  }
}

void SimulatedEngine::flush(std::int64_t max_steps) {
  int quiet = 0;
  for (std::int64_t i = 0; i < max_steps; ++i) {
    const bool busy = step();
    const auto s = cache_.stats();
    if (!busy && s.writes_in_flight == 0 && s.loads_in_flight == 0 && s.backups_in_flight == 0) {
      return;
    }
    // Acks in flight (the threads are working), or requests waiting for them.
    const bool moved = busy ? wait_for_progress() : wait_quietly({});
    quiet = moved ? 0 : quiet + 1;
    if (quiet == kQuietWaits) return;  // stuck: the caller finds ops still in flight
  }
}

std::size_t SimulatedEngine::reset() {
  stalled_ = false;  // nothing to wait for until the next step
  std::vector<const SimulatedRequest*> ended;
  for (const Waiting& w : waiting_) ended.push_back(&w.request);
  for (const Waiting& w : prefetching_) ended.push_back(&w.request);
  for (const Running& r : decoding_) ended.push_back(&r.request);
  if (config_.record_finished) {
    for (const SimulatedRequest* r : ended) finished_.push_back(FinishedRequest{.id = r->id, .aborted = true});
  }
  const std::size_t n = ended.size();
  stats_.aborted += static_cast<std::int64_t>(n);
  waiting_.clear();
  prefetching_.clear();
  decoding_.clear();  // their slots and locks go with the tree
  cache_.reset();
  return n;
}

std::vector<FinishedRequest> SimulatedEngine::drain_finished() {
  std::vector<FinishedRequest> out;
  out.swap(finished_);
  return out;
}

}  // namespace hicache
