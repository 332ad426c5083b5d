#include "controller/radix/sidecar_units.h"

#include <algorithm>

#include "controller/restorable.h"
#include "transfer/errors.h"

namespace hicache::radix {

void SidecarUnits::check_insert(std::span<const SidecarInsert> sidecars, std::int64_t pages,
                                std::int64_t cached_pages) const {
  std::vector<bool> seen(controller_.num_sidecars(), false);
  std::vector<std::int64_t> slot_pages;
  for (const SidecarInsert& si : sidecars) {
    if (si.pool < 0 || static_cast<std::size_t>(si.pool) >= controller_.num_sidecars()) {
      throw InvalidArgument(str_cat("insert: sidecar pool ", si.pool, " does not exist (",
                                    controller_.num_sidecars(), " sidecar pools)"));
    }
    const SidecarPool& pool = controller_.sidecar(static_cast<std::size_t>(si.pool));
    const std::string what = str_cat("insert: sidecar pool '", pool.spec().name, "'");
    if (seen[static_cast<std::size_t>(si.pool)]) throw InvalidArgument(what + " is given twice");
    seen[static_cast<std::size_t>(si.pool)] = true;
    for (std::size_t k = 0; k < si.pages.size(); ++k) {
      if (si.pages[k] < 0 || si.pages[k] >= pages || (k > 0 && si.pages[k] <= si.pages[k - 1])) {
        throw InvalidArgument(str_cat(what, ": page ", si.pages[k], " (entry ", k,
                                      ") is out of order or outside the sequence's ", pages,
                                      " pages"));
      }
    }
    if (pool.spec().policy == SidecarHitPolicy::kAllPages) {
      // Every page the tree does not hold yet (those it holds it has already).
      const auto listed = std::count_if(si.pages.begin(), si.pages.end(),
                                        [&](std::int64_t p) { return p >= cached_pages; });
      if (listed != pages - cached_pages) {
        throw InvalidArgument(str_cat(what, " is all_pages: it needs pages ", cached_pages, "..",
                                      pages - 1, " (the tree holds the first ", cached_pages,
                                      "), got ", listed, " of them"));
      }
    }
    const std::size_t want = si.pages.size() * static_cast<std::size_t>(pool.spec().slots_per_page);
    if (si.device_slots.size() != want) {
      throw InvalidArgument(str_cat(what, ": ", si.device_slots.size(), " device slots for ",
                                    si.pages.size(), " pages of ", pool.spec().slots_per_page,
                                    " slots"));
    }
    slot_pages.clear();
    slots_to_pages(si.device_slots, pool.spec().slots_per_page, pool.device_pool().num_pages(),
                   what, slot_pages);
  }
  // An all_pages pool restores nothing without its pages: new pages need an entry of each.
  if (pages > cached_pages) {
    for (std::size_t i = 0; i < controller_.num_sidecars(); ++i) {
      const SidecarSpec& spec = controller_.sidecar(i).spec();
      if (spec.policy == SidecarHitPolicy::kAllPages && !seen[i]) {
        throw InvalidArgument(str_cat("insert: sidecar pool '", spec.name,
                                      "' is all_pages: it needs pages ", cached_pages, "..",
                                      pages - 1, " (the tree holds the first ", cached_pages,
                                      "), got none"));
      }
    }
  }
}

void SidecarUnits::adopt(Node* leaf, std::span<const SidecarInsert> sidecars,
                         std::int64_t first_page) const {
  for (const SidecarInsert& si : sidecars) {
    const auto spp = static_cast<std::size_t>(slots_per_page(si.pool));
    Node::SidecarPages sp{.pool = si.pool};
    for (std::size_t k = 0; k < si.pages.size(); ++k) {
      if (si.pages[k] < first_page) continue;
      sp.pages.push_back(static_cast<std::int32_t>(si.pages[k] - first_page));
      const auto at = si.device_slots.begin() + static_cast<std::ptrdiff_t>(k * spp);
      sp.device.insert(sp.device.end(), at, at + static_cast<std::ptrdiff_t>(spp));
    }
    if (sp.pages.empty()) continue;
    leaf->sidecar_bytes += page_bytes(si.pool) * static_cast<std::int64_t>(sp.pages.size());
    leaf->sidecars.push_back(std::move(sp));
  }
}

void SidecarUnits::adopt_host(Node* node, std::vector<SidecarPagesIo>& fetched,
                              std::int64_t first_page) const {
  const std::int64_t end_page = first_page + static_cast<std::int64_t>(node->key().size()) /
                                                  tree_.page_size();
  for (SidecarPagesIo& io : fetched) {
    const auto spp = static_cast<std::ptrdiff_t>(slots_per_page(io.pool));
    auto held = std::find_if(node->sidecars.begin(), node->sidecars.end(),
                             [&](const Node::SidecarPages& sp) { return sp.pool == io.pool; });
    SidecarPagesIo rest{.pool = io.pool, .pages = {}, .host_slots = {}};
    for (std::size_t k = 0; k < io.pages.size(); ++k) {
      const auto slot = io.host_slots.begin() + static_cast<std::ptrdiff_t>(k) * spp;
      const auto page = static_cast<std::int32_t>(io.pages[k] - first_page);
      const bool inside = io.pages[k] >= first_page && io.pages[k] < end_page;
      if (inside && held == node->sidecars.end()) {
        node->sidecars.push_back({.pool = io.pool, .pages = {}, .device = {}, .host = {}});
        held = std::prev(node->sidecars.end());
      }
      Node::SidecarPages* sp = inside ? &*held : nullptr;
      const auto at = sp ? std::lower_bound(sp->pages.begin(), sp->pages.end(), page)
                         : std::vector<std::int32_t>::iterator{};
      if (sp == nullptr || (at != sp->pages.end() && *at == page)) {  // not its, or held
        rest.pages.push_back(io.pages[k]);
        rest.host_slots.insert(rest.host_slots.end(), slot, slot + spp);
        continue;
      }
      const auto k_at = at - sp->pages.begin();
      sp->pages.insert(at, page);
      sp->host.insert(sp->host.begin() + k_at * spp, slot, slot + spp);
      node->sidecar_bytes += page_bytes(io.pool);
    }
    io = std::move(rest);
  }
  // Pools in the order of their index, as insert() lists them.
  std::sort(node->sidecars.begin(), node->sidecars.end(),
            [](const Node::SidecarPages& a, const Node::SidecarPages& b) { return a.pool < b.pool; });
}

void SidecarUnits::split(Node* node, Node* upper, std::int64_t upper_pages) const {
  const auto cut = static_cast<std::int32_t>(upper_pages);
  for (Node::SidecarPages& sp : node->sidecars) {
    const auto k = static_cast<std::ptrdiff_t>(
        std::lower_bound(sp.pages.begin(), sp.pages.end(), cut) - sp.pages.begin());
    if (k == 0) {
      for (std::int32_t& page : sp.pages) page -= cut;
      continue;
    }
    const std::ptrdiff_t slots = k * slots_per_page(sp.pool);
    Node::SidecarPages up{.pool = sp.pool};
    up.pages.assign(sp.pages.begin(), sp.pages.begin() + k);
    sp.pages.erase(sp.pages.begin(), sp.pages.begin() + k);
    for (std::int32_t& page : sp.pages) page -= cut;
    for (auto [from, to] : {std::pair{&sp.device, &up.device}, std::pair{&sp.host, &up.host}}) {
      if (from->empty()) continue;
      to->assign(from->begin(), from->begin() + slots);
      from->erase(from->begin(), from->begin() + slots);
    }
    const std::int64_t moved = page_bytes(sp.pool) * static_cast<std::int64_t>(k);
    upper->sidecar_bytes += moved;
    node->sidecar_bytes -= moved;
    upper->sidecars.push_back(std::move(up));
  }
  std::erase_if(node->sidecars, [](const Node::SidecarPages& sp) { return sp.pages.empty(); });
}

SidecarUnits::Restorable SidecarUnits::restorable(const Node* end, std::int64_t pages,
                                                  std::int64_t device_pages) const {
  if (pages == 0) return {};
  const std::int32_t page_size = tree_.page_size();
  std::vector<std::vector<std::uint8_t>> held(
      controller_.num_sidecars(), std::vector<std::uint8_t>(static_cast<std::size_t>(pages), 0));
  std::int64_t start = pages;
  for (const Node* n = end; n != tree_.root(); n = n->parent) {  // deepest first
    start -= static_cast<std::int64_t>(n->key().size()) / page_size;
    for (const Node::SidecarPages& sp : n->sidecars) {
      for (std::int32_t page : sp.pages) {
        held[static_cast<std::size_t>(sp.pool)][static_cast<std::size_t>(start + page)] = 1;
      }
    }
  }
  RestorablePrefix prefix;
  prefix.reset(pages, pages);
  for (std::size_t i = 0; i < held.size(); ++i) {
    const SidecarSpec& spec = controller_.sidecar(i).spec();
    prefix.intersect(spec.policy, spec.window_pages, held[i]);
  }
  Restorable r{.all = prefix.largest()};
  r.on_device = std::min(r.all, device_pages);
  while (r.on_device > 0 && !prefix.restorable(r.on_device)) --r.on_device;
  return r;
}

std::vector<SidecarPageSlots> SidecarUnits::device_slots(const Node* node,
                                                        std::int32_t pool) const {
  if (pool < 0 || static_cast<std::size_t>(pool) >= controller_.num_sidecars()) {
    throw InvalidArgument(str_cat("sidecar_device_slots: sidecar pool ", pool,
                                  " does not exist (", controller_.num_sidecars(),
                                  " sidecar pools)"));
  }
  std::vector<const Node*> path;
  for (const Node* n = node; n != tree_.root(); n = n->parent) path.push_back(n);
  const auto spp = static_cast<std::size_t>(slots_per_page(pool));
  std::vector<SidecarPageSlots> out;
  std::int64_t start = 0;
  for (auto it = path.rbegin(); it != path.rend(); ++it) {
    for (const Node::SidecarPages& sp : (*it)->sidecars) {
      if (sp.pool != pool || sp.device.empty()) continue;
      for (std::size_t k = 0; k < sp.pages.size(); ++k) {
        const auto at = sp.device.begin() + static_cast<std::ptrdiff_t>(k * spp);
        out.push_back({start + sp.pages[k],
                       std::vector<std::int64_t>(at, at + static_cast<std::ptrdiff_t>(spp))});
      }
    }
    start += static_cast<std::int64_t>((*it)->key().size()) / tree_.page_size();
  }
  return out;
}

std::pair<std::int64_t, std::int64_t> SidecarUnits::slots_held(std::int32_t pool) const {
  std::pair<std::int64_t, std::int64_t> held{0, 0};
  tree_.for_each_node([&](const Node* n) {
    for (const Node::SidecarPages& sp : n->sidecars) {
      if (sp.pool != pool) continue;
      held.first += static_cast<std::int64_t>(sp.device.size());
      held.second += static_cast<std::int64_t>(sp.host.size());
    }
  });
  return held;
}

std::string SidecarUnits::check(const Node& n) const {
  std::vector<bool> seen(controller_.num_sidecars(), false);
  const auto node_pages = static_cast<std::int64_t>(n.key().size()) / tree_.page_size();
  std::int64_t bytes = 0;
  for (const Node::SidecarPages& sp : n.sidecars) {
    if (sp.pool < 0 || static_cast<std::size_t>(sp.pool) >= seen.size() ||
        seen[static_cast<std::size_t>(sp.pool)] || sp.pages.empty()) {
      return str_cat("node ", n.id, ": sidecar pool ", sp.pool, " listed badly");
    }
    seen[static_cast<std::size_t>(sp.pool)] = true;
    bytes += page_bytes(sp.pool) * static_cast<std::int64_t>(sp.pages.size());
    for (std::size_t k = 0; k < sp.pages.size(); ++k) {
      if (sp.pages[k] < 0 || sp.pages[k] >= node_pages ||
          (k > 0 && sp.pages[k] <= sp.pages[k - 1])) {
        return str_cat("node ", n.id, ": sidecar pool ", sp.pool, " page ", sp.pages[k],
                       " out of order or outside the node's ", node_pages, " pages");
      }
    }
    const std::size_t slots = sp.pages.size() * static_cast<std::size_t>(slots_per_page(sp.pool));
    if (sp.device.size() != (n.device.empty() ? 0 : slots) ||
        sp.host.size() != (n.host.empty() ? 0 : slots)) {
      return str_cat("node ", n.id, ": sidecar pool ", sp.pool, " has ", sp.device.size(),
                     " device / ", sp.host.size(), " host slots for the KV's tiers (dev ",
                     n.device.size(), ", host ", n.host.size(), "): want ", slots, " each");
    }
  }
  if (bytes != n.sidecar_bytes) {
    return str_cat("node ", n.id, ": counts ", n.sidecar_bytes, " sidecar bytes, holds ", bytes);
  }
  return {};
}

void SidecarUnits::reset_pools() const {
  for (std::size_t i = 0; i < controller_.num_sidecars(); ++i) {
    controller_.sidecar(i).device_pool().allocator().reset();
    controller_.sidecar(i).host_pool().reset();
  }
}

}  // namespace hicache::radix
