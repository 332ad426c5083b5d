#include "controller/simulated_engine.h"

#include <string_view>
#include <thread>

#include "pools/kv_pattern.h"
#include "transfer/errors.h"

namespace hicache {

std::uint64_t page_data_seed(std::span<const std::int32_t> tokens, std::size_t page,
                             std::int32_t page_size) {
  const auto prefix = tokens.first((page + 1) * static_cast<std::size_t>(page_size));
  return std::hash<std::string_view>{}(
      std::string_view(reinterpret_cast<const char*>(prefix.data()), prefix.size_bytes()));
}

SimulatedEngine::SimulatedEngine(HiRadixCache& cache, HiCacheController& controller,
                                 DeviceKVPool& device_pool, HostKVPool& host_pool, Device& device,
                                 SimulatedEngineConfig config)
    : cache_(cache), controller_(controller), device_pool_(device_pool), host_pool_(host_pool),
      verifiable_(device.device_memory_is_host_accessible()), config_(config),
      page_size_(cache.page_size()) {
  if (config_.max_batch < 1) {
    throw InvalidArgument(str_cat("simulated engine: max_batch ", config_.max_batch, " < 1"));
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
}

void SimulatedEngine::submit(SimulatedRequest request) {
  if (request.tokens.size() < static_cast<std::size_t>(page_size_)) {
    throw InvalidArgument(str_cat("simulated engine: request '", request.id, "' has ",
                                  request.tokens.size(), " tokens, less than one page"));
  }
  request.tokens.resize(request.tokens.size() / page_size_ * page_size_);  // whole pages
  waiting_.push_back(Waiting{std::move(request)});
}

bool SimulatedEngine::admit(SimulatedRequest& request, std::vector<Running>& batch) {
  auto m = cache_.match_prefix(request.tokens);
  Running r;
  r.held = m.last_host_node;
  cache_.lock(r.held);
  r.slots = m.device_slots;
  std::int64_t loaded = 0;
  if (m.host_hit_tokens > 0) {
    if (auto back = cache_.load_back(r.held)) {
      loaded = static_cast<std::int64_t>(back->size() - r.slots.size());
      r.slots = std::move(*back);
    } else {  // refused: recompute the host part
      cache_.unlock(r.held);
      r.held = m.last_device_node;
      cache_.lock(r.held);
    }
  }
  const auto missing = static_cast<std::int64_t>(request.tokens.size() - r.slots.size());
  if (missing > 0) {
    auto fresh = device_pool_.allocator().alloc(missing);
    if (!fresh) {
      cache_.evict_device(missing);
      fresh = device_pool_.allocator().alloc(missing);
    }
    if (!fresh) {
      // Loads already queued for it complete anyway (their nodes stay in the tree); the request
      // waits for memory.
      cache_.unlock(r.held);
      ++stats_.deferred;
      return false;
    }
    r.slots.insert(r.slots.end(), fresh->begin(), fresh->end());
  }
  r.cached_tokens = request.tokens.size() - static_cast<std::size_t>(missing);
  stats_.device_hit_tokens += static_cast<std::int64_t>(r.cached_tokens) - loaded;
  stats_.loaded_back_tokens += loaded;
  stats_.computed_tokens += missing;
  stats_.prompt_tokens += static_cast<std::int64_t>(request.tokens.size());
  r.request = std::move(request);
  batch.push_back(std::move(r));
  return true;
}

void SimulatedEngine::verify(const Running& r) {
  const std::size_t pages = r.cached_tokens / page_size_;
  if (!verifiable_) {
    stats_.unverified_pages += static_cast<std::int64_t>(pages);
    return;
  }
  for (std::size_t p = 0; p < pages; ++p) {
    const std::int64_t page = r.slots[p * page_size_] / page_size_;
    if (verify_page(device_pool_.layout(), page, page_data_seed(r.request.tokens, p, page_size_))) {
      ++stats_.verified_pages;
    } else {
      ++stats_.mismatched_pages;
      if (first_mismatch_.empty()) first_mismatch_ = str_cat("request ", r.request.id, " page ", p);
    }
  }
}

bool SimulatedEngine::step() {
  const auto t0 = std::chrono::steady_clock::now();
  cache_.check_events();
  // Prefetches that are over rejoin the queue's front.
  for (std::size_t i = 0; i < prefetching_.size();) {
    if (cache_.check_prefetch_progress(prefetching_[i].request.id)) {
      waiting_.push_front(std::move(prefetching_[i]));
      prefetching_.erase(prefetching_.begin() + static_cast<std::ptrdiff_t>(i));
    } else {
      ++i;
    }
  }
  const auto host_target = static_cast<std::int64_t>(
      config_.host_free_target * static_cast<double>(host_pool_.capacity_tokens()));
  if (host_pool_.free_tokens() < host_target) {
    cache_.evict_host(host_target - host_pool_.free_tokens());
  }
  std::vector<Running> batch;
  std::deque<Waiting> deferred;
  while (!waiting_.empty() && static_cast<int>(batch.size()) < config_.max_batch) {
    Waiting w = std::move(waiting_.front());
    waiting_.pop_front();
    if (config_.use_storage && !w.asked_storage) {
      // First admission: ask L3 for what follows the tree (one prefetch per request).
      auto m = cache_.match_prefix(w.request.tokens);
      const std::size_t known = m.device_slots.size() + static_cast<std::size_t>(m.host_hit_tokens);
      if (known < w.request.tokens.size()) {
        if (static_cast<int>(prefetching_.size()) >= config_.max_prefetches) {
          deferred.push_back(std::move(w));  // waits for a prefetch slot
          continue;
        }
        w.asked_storage = true;
        if (cache_.prefetch_from_storage(w.request.id, m.last_host_node,
                                         std::span(w.request.tokens).subspan(known))) {
          ++stats_.prefetches;
          prefetching_.push_back(std::move(w));
          continue;
        }
      }
      w.asked_storage = true;
    }
    if (!admit(w.request, batch)) deferred.push_back(std::move(w));
  }
  for (auto it = deferred.rbegin(); it != deferred.rend(); ++it) waiting_.push_front(std::move(*it));
  if (batch.empty()) {
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
    std::this_thread::yield();  // waiting on prefetches, or on memory that acks will free
    return true;
  }

  // The forward pass, layer by layer, overlapping the loads.
  const std::int32_t slot = controller_.start_loading();
  std::int64_t computed = 0;
  for (const Running& r : batch) computed += static_cast<std::int64_t>(r.request.tokens.size() - r.cached_tokens);
  const auto per_layer = std::chrono::duration<double>(config_.cost_per_token_layer *
                                                       static_cast<double>(computed));
  for (std::int32_t layer = 0; layer < device_pool_.geometry().num_layers; ++layer) {
    device_pool_.wait_for_layer(layer);
    if (per_layer.count() > 0) {
      std::this_thread::sleep_for(per_layer);  // the GPU computing layer `layer`
      stats_.compute_seconds += per_layer.count();
    }
  }
  if (slot >= 0) controller_.layer_done_counter().release(slot);

  for (Running& r : batch) {
    verify(r);
    const std::size_t pages = r.request.tokens.size() / page_size_;
    if (verifiable_) {
      for (std::size_t p = r.cached_tokens / page_size_; p < pages; ++p) {
        fill_page(device_pool_.layout(), r.slots[p * page_size_] / page_size_,
                  page_data_seed(r.request.tokens, p, page_size_));
      }
    }
    const std::int64_t dup = cache_.insert(r.request.tokens, r.slots);
    const auto ours = static_cast<std::int64_t>(r.cached_tokens);
    if (dup > ours) device_pool_.allocator().free(std::span(r.slots).subspan(ours, dup - ours));
    cache_.unlock(r.held);
    ++stats_.finished;
  }
  ++stats_.steps;
  stats_.step_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return true;
}

void SimulatedEngine::run_until_idle(std::int64_t max_steps) {
  for (std::int64_t i = 0; i < max_steps && step(); ++i) {
  }
}

}  // namespace hicache
