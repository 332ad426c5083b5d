// An engine outside the tree that uses the installed package the way the README shows: a
// HiCache built from a JSON file, one prompt computed and cached, then served again from each
// tier (device, host after the device copy is evicted, and L3 in a second, fresh HiCache over
// the same store), every page checked byte for byte.
//
//   consumer CONFIG.json
#include <chrono>
#include <cstdio>
#include <vector>

#include "hicache/controller/hicache.h"
#include "hicache/pools/kv_pattern.h"

namespace {

using hicache::HiRadixCache;

// The KV of page p of a prompt: a model's KV derives from the whole prefix; here, a seed.
std::uint64_t seed_of(const std::vector<std::int32_t>& tokens, std::size_t page, int page_size) {
  std::uint64_t h = 1469598103934665603ull;
  for (std::size_t i = 0; i < (page + 1) * static_cast<std::size_t>(page_size); ++i) {
    h = (h ^ static_cast<std::uint64_t>(tokens[i])) * 1099511628211ull;
  }
  return h;
}

// What the scheduler does each step until no write, load, backup or prefetch is in flight.
void settle(hicache::HiCache& hc) {
  for (;;) {
    const std::uint64_t seen = hc.cache().event_seq();
    hc.cache().check_events();
    const auto s = hc.cache().stats();
    if (s.writes_in_flight + s.loads_in_flight + s.backups_in_flight == 0 &&
        hc.cache().prefetches_in_flight() == 0) {
      return;
    }
    hc.cache().wait_for_events(seen, std::chrono::steady_clock::now() + std::chrono::seconds(1));
  }
}

// Serves one request: the cached prefix (from L3 when the tree lacks it), loaded back to the
// device layer by layer; the rest computed and inserted. Returns the pages found cached and
// checks each of them against the KV its prefix derives.
std::size_t serve(hicache::HiCache& hc, const std::vector<std::int32_t>& tokens, bool& ok) {
  auto& cache = hc.cache();
  auto& pool = hc.device_pool();
  const int page = cache.page_size();
  cache.check_events();
  auto m = cache.match_prefix(tokens);
  const auto known = m.device_slots.size() + static_cast<std::size_t>(m.host_hit_tokens);
  if (hc.storage_controller() != nullptr && known < tokens.size() &&
      cache.prefetch_from_storage("req", m.last_host_node, std::span(tokens).subspan(known))) {
    while (!cache.check_prefetch_progress("req")) settle(hc);
    m = cache.match_prefix(tokens);
  }
  HiRadixCache::Node* held = m.last_host_node;
  cache.lock(held);
  std::vector<std::int64_t> slots = m.device_slots;
  if (m.host_hit_tokens > 0) {
    if (auto back = cache.load_back(held)) {
      slots = std::move(*back);
      const std::int32_t batch = hc.controller().start_loading();
      for (int l = 0; l < hc.config().geometry.num_layers; ++l) ok &= pool.wait_for_layer(l);
      if (batch >= 0) hc.controller().layer_done_counter().release(batch);
    }
  }
  const std::size_t cached = slots.size() / page;
  for (std::size_t p = 0; p < cached; ++p) {
    ok &= hicache::verify_page(pool.layout(), slots[p * page] / page, seed_of(tokens, p, page));
  }
  const std::size_t pages = tokens.size() / page;
  if (pages > cached) {
    auto fresh = pool.allocator().alloc(static_cast<std::int64_t>((pages - cached) * page));
    if (!fresh) {
      ok = false;
      return cached;
    }
    for (std::size_t p = cached; p < pages; ++p) {  // "compute" the rest
      hicache::fill_page(pool.layout(), (*fresh)[(p - cached) * page] / page,
                         seed_of(tokens, p, page));
    }
    slots.insert(slots.end(), fresh->begin(), fresh->end());
  }
  const std::int64_t dup = cache.insert(tokens, slots);
  const auto ours = static_cast<std::int64_t>(cached) * page;
  if (dup > ours) pool.allocator().free(std::span(slots).subspan(ours, dup - ours));
  cache.unlock(held);
  settle(hc);
  return cached;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: consumer CONFIG.json\n");
    return 2;
  }
  const auto config = hicache::HiCacheConfig::from_json_file(argv[1]);
  const int page = config.geometry.page_size;
  std::vector<std::int32_t> prompt(8 * static_cast<std::size_t>(page));
  for (std::size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<std::int32_t>(i * 7 + 3);

  bool ok = true;
  std::size_t first = 0, device = 0, host = 0, l3 = 0;
  {
    hicache::HiCache hc(config);
    first = serve(hc, prompt, ok);   // computed, written to host, backed up to L3
    device = serve(hc, prompt, ok);  // all on the device
    hc.cache().evict_device(static_cast<std::int64_t>(prompt.size()));
    host = serve(hc, prompt, ok);    // loaded back from the host
  }
  {
    hicache::HiCache fresh(config);  // another engine: only L3 knows the prompt
    l3 = serve(fresh, prompt, ok);
  }
  std::printf("consumer: pages cached first %zu, device %zu, host %zu, L3 %zu of 8; bytes %s\n",
              first, device, host, l3, ok ? "verified" : "WRONG");
  return ok && first == 0 && device == 8 && host == 8 && l3 == 8 ? 0 : 1;
}
