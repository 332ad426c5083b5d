#include "controller/hicache_controller.h"

#include <chrono>
#include "controller/drain_queue.h"

#include <concurrentqueue/concurrentqueue.h>

#include <algorithm>

#include "pools/paged_token_allocator.h"
#include "transfer/copy_plan.h"
#include "transfer/errors.h"

namespace hicache {

// How long the write and load threads look for the next op before they sleep (OpQueue::
// pop_spinning), as a layer's consumer does (LayerDoneCounter): a write() or start_loading()
// that finds its thread still looking wakes no sleeping thread.
constexpr std::chrono::microseconds kSpinBeforeSleep{100};

WritePolicy parse_write_policy(std::string_view name) {
  if (name == "write_through") return WritePolicy::kWriteThrough;
  if (name == "write_through_selective") return WritePolicy::kWriteThroughSelective;
  if (name == "write_back") return WritePolicy::kWriteBack;
  throw InvalidArgument(str_cat("unknown write policy '", name,
                                "': valid are write_through, write_through_selective, write_back"));
}

IoBackend parse_io_backend(std::string_view name) {
  if (name == "direct") return IoBackend::kDirect;
  if (name == "kernel") return IoBackend::kKernel;
  if (name == "auto") return IoBackend::kAuto;
  throw InvalidArgument(str_cat("unknown io backend '", name, "': valid are direct, kernel, auto"));
}

IoBackend choose_io_backend(IoBackend configured, DeviceBackend device, HostLayout host_layout,
                            const CopyShape& op) {
  if (configured != IoBackend::kAuto) return configured;
  if (host_layout == HostLayout::kPageFirst) return IoBackend::kKernel;
  if (device != DeviceBackend::kCuda) return IoBackend::kDirect;
  if (op.run_bytes < kAutoSmallRunBytes && op.runs_per_call >= kAutoKernelMinRuns) {
    return IoBackend::kKernel;
  }
  return op.to_host && op.bytes >= kAutoKernelWriteBytes ? IoBackend::kKernel : IoBackend::kDirect;
}

std::string_view to_string(WritePolicy policy) {
  switch (policy) {
    case WritePolicy::kWriteThrough:
      return "write_through";
    case WritePolicy::kWriteThroughSelective:
      return "write_through_selective";
    case WritePolicy::kWriteBack:
      return "write_back";
  }
  return "unknown";
}

std::string_view to_string(IoBackend io) {
  switch (io) {
    case IoBackend::kDirect:
      return "direct";
    case IoBackend::kKernel:
      return "kernel";
    case IoBackend::kAuto:
      return "auto";
  }
  return "unknown";
}

struct HiCacheController::AckQueues {
  moodycamel::ConcurrentQueue<Ack> write, load;
};

// Page lists and copy regions a thread reuses from op to op (no allocation per op once warm).
// The kernel path reads page lists on the device, so they live in pinned host memory.
struct HiCacheController::Scratch {
  std::vector<std::int64_t> host_pages, device_pages;
  std::vector<std::pair<std::int64_t, std::int64_t>> pairs;  // (host page, device page)
  std::vector<CopyRegion> regions;
  std::vector<std::int64_t> sidecar_host_pages, sidecar_device_pages;
  Buffer pinned;  // [host pages | device pages], grown on demand
  std::int64_t* pinned_host = nullptr;
  std::int64_t* pinned_device = nullptr;
  std::vector<NodeId> ack_nodes;  // the finished op's nodes, acked after its lists went back
  IoBackend io = IoBackend::kDirect;  // the path prepare_pages chose for the op
};

HiCacheController::HiCacheController(Device& device, DeviceKVPool& device_pool,
                                     HostKVPool& host_pool, const ControllerConfig& config,
                                     std::span<SidecarPool* const> sidecars)
    : device_(device),
      device_pool_(device_pool),
      host_pool_(host_pool),
      config_(config),
      sidecars_(sidecars.begin(), sidecars.end()),
      write_queue_(config.queue_capacity),
      pending_loads_(config.queue_capacity),
      load_queue_(std::max<std::size_t>(config.layer_slots, 1)),
      acks_(std::make_unique<AckQueues>()) {
  if (!(device_pool.geometry() == host_pool.geometry())) {
    throw InvalidArgument(str_cat("HiCacheController: device pool geometry (",
                                  device_pool.geometry().describe(),
                                  ") differs from host pool geometry (",
                                  host_pool.geometry().describe(), ")"));
  }
  if (config.queue_capacity == 0) {
    throw InvalidArgument("HiCacheController: queue_capacity must be > 0");
  }
  for (std::size_t i = 0; i < sidecars_.size(); ++i) {
    if (sidecars_[i] == nullptr) {
      throw InvalidArgument(str_cat("HiCacheController: sidecar pool ", i, " is null"));
    }
    for (std::size_t j = 0; j < i; ++j) {
      if (sidecars_[j] == sidecars_[i] || sidecars_[j]->spec().name == sidecars_[i]->spec().name) {
        throw InvalidArgument(str_cat("HiCacheController: sidecar pool '",
                                      sidecars_[i]->spec().name, "' is given twice"));
      }
    }
  }
  if (device.backend() == DeviceBackend::kCuda && config.io_backend == IoBackend::kDirect &&
      host_pool.host_layout() == HostLayout::kPageFirst) {
    // Correct, but a run of page_first is one token of one layer: measured 1.3-4.9 GB/s on an
    // H100 against about 50 for the kernel. Refused rather than switched (SGLang switches the
    // layout to layer_first, which also changes the L3 key namespace under the user).
    throw InvalidArgument(
        "HiCacheController: host_layout 'page_first' with io_backend 'direct' on CUDA copies one "
        "token of one layer per region (1.3-4.9 GB/s on an H100, against up to 50 GB/s with the "
        "kernel): use io_backend 'kernel', or host_layout 'page_first_direct' or 'layer_first' "
        "with 'direct'");
  }
  counter_ = std::make_unique<LayerDoneCounter>(device_pool.geometry().num_layers,
                                                config.layer_slots, &device);
  write_stream_ = device.create_stream();
  load_stream_ = device.create_stream();
  start_threads();
}

HiCacheController::~HiCacheController() { stop(); }

CacheOperation HiCacheController::make_op(std::span<const std::int64_t> host_slots,
                                          std::span<const std::int64_t> device_slots,
                                          std::int64_t priority, std::optional<NodeId> ack_node) {
  auto host = arena_.take();
  host.assign(host_slots.begin(), host_slots.end());
  auto device = arena_.take();
  device.assign(device_slots.begin(), device_slots.end());
  CacheOperation op = CacheOperation::make(std::move(host), std::move(device), priority, std::nullopt);
  op.node_ids = arena_.take();
  if (ack_node) op.node_ids.push_back(*ack_node);
  if (timed_.load(std::memory_order_relaxed)) op.submitted = std::chrono::steady_clock::now();
  return op;
}

void HiCacheController::start_threads() {
  running_ = true;
  write_thread_ = std::thread([this] { write_loop(); });
  load_thread_ = std::thread([this] { load_loop(); });
}

void HiCacheController::check_write_slots(std::span<const std::int64_t> device_slots) {
  check_pages_.clear();
  slots_to_pages(device_slots, device_pool_.geometry().page_size,
                 device_pool_.num_pages(), "HiCacheController::write", check_pages_);
  if (device_slots.empty()) throw InvalidArgument("HiCacheController::write: no slots");
}

std::optional<std::vector<std::int64_t>> HiCacheController::write(
    std::span<const std::int64_t> device_slots, std::int64_t priority,
    std::optional<NodeId> ack_node, const Event* ready_after) {
  check_write_slots(device_slots);  // before the reservation: bad input changes nothing
  auto host_slots = reserve_write(static_cast<std::int64_t>(device_slots.size()));
  if (!host_slots) return std::nullopt;
  if (!write_reserved(device_slots, *host_slots, priority, ack_node, ready_after)) {
    return std::nullopt;
  }
  return host_slots;
}

std::optional<std::vector<std::int64_t>> HiCacheController::reserve_write(std::int64_t tokens) {
  if (write_queue_.size() >= write_queue_.capacity()) return std::nullopt;
  return host_pool_.alloc(tokens);
}

void HiCacheController::release_write(std::span<const std::int64_t> host_slots) {
  host_pool_.free(host_slots);
}

bool HiCacheController::write_reserved(std::span<const std::int64_t> device_slots,
                                       std::span<const std::int64_t> host_slots,
                                       std::int64_t priority, std::optional<NodeId> ack_node,
                                       const Event* ready_after,
                                       std::span<const SidecarIo> sidecars) {
  try {
    check_write_slots(device_slots);
    if (host_slots.size() != device_slots.size()) {
      throw InvalidArgument(str_cat("HiCacheController::write: ", host_slots.size(),
                                    " reserved host slots for ", device_slots.size(),
                                    " device slots"));
    }
    check_sidecars(sidecars, "HiCacheController::write", PageState::kReserved,
                   /*allocated_device=*/false);
  } catch (...) {
    host_pool_.free(host_slots);
    for (const SidecarIo& io : sidecars) {
      try {
        sidecars_.at(io.pool)->host_pool().free(io.host_slots);
      } catch (const std::exception&) {
        // Not a reservation of that pool: nothing of it to give back.
      }
    }
    throw;
  }
  host_pool_.protect_write(host_slots);
  for (const SidecarIo& io : sidecars) sidecars_[io.pool]->host_pool().protect_write(io.host_slots);
  auto op = make_op(host_slots, device_slots, priority, ack_node);
  add_sidecars(op, sidecars);
  // Before the push, so the write thread cannot enqueue this op's copy ahead of the wait. It
  // orders every later copy of the write stream after the producer's work: exact for this op,
  // conservative for ops the priority queue runs before it (and harmless if the push fails).
  if (ready_after != nullptr) write_stream_->wait(*ready_after);
  if (write_queue_.push(std::move(op)) != PushResult::kOk) {  // stopped (reserve_write saw room)
    finish_sidecar_hosts(op, PageState::kFree);
    arena_.give(std::move(op));
    host_pool_.abort_io(host_slots);
    host_pool_.free(host_slots);
    return false;
  }
  return true;
}

void HiCacheController::check_sidecars(std::span<const SidecarIo> sidecars,
                                       std::string_view what, PageState host_state,
                                       bool allocated_device) const {
  std::vector<std::int64_t> pages;
  for (const SidecarIo& io : sidecars) {
    if (io.pool < 0 || static_cast<std::size_t>(io.pool) >= sidecars_.size()) {
      throw InvalidArgument(str_cat(what, ": sidecar pool ", io.pool, " does not exist (",
                                    sidecars_.size(), " sidecar pools)"));
    }
    const SidecarPool& pool = *sidecars_[io.pool];
    const std::string where = str_cat(what, " (sidecar '", pool.spec().name, "')");
    if (io.host_slots.size() != io.device_slots.size() || io.host_slots.empty()) {
      throw InvalidArgument(str_cat(where, ": ", io.host_slots.size(), " host slots for ",
                                    io.device_slots.size(), " device slots (need equal, non-zero)"));
    }
    const std::int32_t ps = pool.spec().slots_per_page;
    pages.clear();
    slots_to_pages(io.host_slots, ps, pool.host_pool().num_pages(), where + " host", pages);
    pages.clear();
    slots_to_pages(io.device_slots, ps, pool.device_pool().num_pages(), where + " device", pages);
    pool.host_pool().require_state(io.host_slots, host_state, where);
    std::sort(pages.begin(), pages.end());
    if (const auto dup = std::adjacent_find(pages.begin(), pages.end()); dup != pages.end()) {
      throw InvalidArgument(str_cat(where, ": device page ", *dup, " is listed twice"));
    }
    for (std::int64_t page : allocated_device ? pages : std::vector<std::int64_t>{}) {
      if (!pool.device_pool().allocator().is_allocated(page)) {
        throw StateError(str_cat(where, ": device page ", page,
                                 " is not allocated: take the slots from the pool's allocator"));
      }
    }
  }
}

void HiCacheController::add_sidecars(CacheOperation& op, std::span<const SidecarIo> sidecars) {
  for (const SidecarIo& io : sidecars) {
    op.sidecars.push_back(SidecarSlots{
        .pool = io.pool,
        .host_slots = std::vector<std::int64_t>(io.host_slots.begin(), io.host_slots.end()),
        .device_slots = std::vector<std::int64_t>(io.device_slots.begin(), io.device_slots.end())});
  }
}

std::uint64_t HiCacheController::enqueue_sidecar_copies(Stream& stream, Scratch& s,
                                                        const CacheOperation& op, bool to_host) {
  std::uint64_t bytes = 0;
  for (const SidecarSlots& side : op.sidecars) {
    SidecarPool& pool = *sidecars_.at(side.pool);
    const std::int32_t ps = pool.spec().slots_per_page;
    s.sidecar_host_pages.clear();
    s.sidecar_device_pages.clear();
    slots_to_pages(side.host_slots, ps, pool.host_pool().num_pages(), "sidecar host slots",
                   s.sidecar_host_pages);
    slots_to_pages(side.device_slots, ps, pool.device_pool().num_pages(), "sidecar device slots",
                   s.sidecar_device_pages);
    // page_first_direct on the host and the device layout: one run per page and layer, whatever
    // the io backend (a state page is large; the kernel path's gain is for many small runs).
    s.regions.clear();
    const LayoutDesc& host = pool.host_pool().layout();
    const LayoutDesc& dev = pool.device_pool().layout();
    const std::int32_t layers = pool.spec().layers;
    if (to_host) {
      append_page_copies(host, s.sidecar_host_pages, dev, s.sidecar_device_pages, 0, layers,
                         s.regions);
    } else {
      append_page_copies(dev, s.sidecar_device_pages, host, s.sidecar_host_pages, 0, layers,
                         s.regions);
    }
    stream.copy_batch_async(s.regions);
    bytes += static_cast<std::uint64_t>(s.sidecar_host_pages.size()) *
             static_cast<std::uint64_t>(pool.spec().page_bytes());
  }
  return bytes;
}

void HiCacheController::finish_sidecar_hosts(const CacheOperation& op, PageState to) {
  for (const SidecarSlots& side : op.sidecars) {
    try {
      HostKVPool& host = sidecars_.at(side.pool)->host_pool();
      if (to == PageState::kFree) {
        host.abort_io(side.host_slots);
        host.free(side.host_slots);
      } else {
        host.complete_io(side.host_slots, to);
      }
    } catch (const std::exception&) {
      // Not in the state this op left them in; nothing more to return.
    }
  }
}

void HiCacheController::return_load(CacheOperation& op) {
  host_pool_.complete_io(op.host_slots, PageState::kBackup);
  device_pool_.allocator().free(op.device_slots);
  finish_sidecar_hosts(op, PageState::kBackup);
  for (const SidecarSlots& side : op.sidecars) {
    try {
      sidecars_.at(side.pool)->device_pool().allocator().free(side.device_slots);
    } catch (const std::exception&) {
    }
  }
}

std::optional<std::vector<std::int64_t>> HiCacheController::load(
    std::span<const std::int64_t> host_slots, std::int64_t priority,
    std::optional<NodeId> ack_node) {
  if (host_slots.empty()) throw InvalidArgument("HiCacheController::load: no slots");
  // Checked before the device allocation so that a bad call leaves both pools untouched.
  host_pool_.require_state(host_slots, PageState::kBackup, "HiCacheController::load");
  auto device_slots = device_pool_.allocator().alloc(static_cast<std::int64_t>(host_slots.size()));
  if (!device_slots) return std::nullopt;
  if (!queue_load(host_slots, *device_slots, priority, ack_node)) {
    device_pool_.allocator().free(*device_slots);
    return std::nullopt;
  }
  return device_slots;
}

bool HiCacheController::load_into(std::span<const std::int64_t> host_slots,
                                  std::span<const std::int64_t> device_slots,
                                  std::int64_t priority, std::optional<NodeId> ack_node,
                                  std::span<const SidecarIo> sidecars) {
  constexpr const char* kWhat = "HiCacheController::load_into";
  if (host_slots.empty()) throw InvalidArgument(str_cat(kWhat, ": no slots"));
  if (host_slots.size() != device_slots.size()) {
    throw InvalidArgument(str_cat(kWhat, ": ", host_slots.size(), " host slots for ",
                                  device_slots.size(), " device slots"));
  }
  host_pool_.require_state(host_slots, PageState::kBackup, kWhat);
  check_pages_.clear();
  slots_to_pages(device_slots, device_pool_.geometry().page_size, device_pool_.num_pages(), kWhat,
                 check_pages_);
  for (std::int64_t page : check_pages_) {
    if (!device_pool_.allocator().is_allocated(page)) {
      throw StateError(str_cat(kWhat, ": device page ", page, " (slot ",
                               page * device_pool_.geometry().page_size,
                               ") is not allocated: take the slots from device_pool().allocator()"));
    }
  }
  check_sidecars(sidecars, kWhat, PageState::kBackup, /*allocated_device=*/true);
  return queue_load(host_slots, device_slots, priority, ack_node, sidecars);
}

bool HiCacheController::queue_load(std::span<const std::int64_t> host_slots,
                                   std::span<const std::int64_t> device_slots,
                                   std::int64_t priority, std::optional<NodeId> ack_node,
                                   std::span<const SidecarIo> sidecars) {
  host_pool_.protect_load(host_slots);
  for (const SidecarIo& io : sidecars) sidecars_[io.pool]->host_pool().protect_load(io.host_slots);
  auto op = make_op(host_slots, device_slots, priority, ack_node);
  add_sidecars(op, sidecars);
  if (pending_loads_.push(std::move(op)) != PushResult::kOk) {
    finish_sidecar_hosts(op, PageState::kBackup);
    arena_.give(std::move(op));
    host_pool_.complete_io(host_slots, PageState::kBackup);
    return false;
  }
  return true;
}

std::int32_t HiCacheController::start_loading(const Event* ready_after) {
  std::vector<CacheOperation>& ops = load_ops_;  // reused: no allocation per step
  ops.clear();
  if (pending_loads_.drain_into(ops) == 0) {
    // A forward pass with nothing to load: its layer waits return at once, rather than asking
    // the last batch's slot (released, and failed if that batch failed).
    device_pool_.set_layer_wait_hook(nullptr);
    return -1;
  }
  if (ready_after != nullptr) load_stream_->wait(*ready_after);
  LoadBatch batch;
  batch.op = std::move(ops.front());
  for (std::size_t i = 1; i < ops.size(); ++i) {
    batch.op.merge(std::move(ops[i]));
    arena_.give(std::move(ops[i]));
  }
  ops.clear();
  batch.priority = batch.op.priority;
  batch.slot = counter_->acquire();
  if (batch.slot < 0) {  // stopped: give everything back
    return_load(batch.op);
    return -1;
  }
  const std::int32_t slot = batch.slot;
  LayerDoneCounter* counter = counter_.get();
  device_pool_.set_layer_wait_hook(
      [counter, slot](std::int32_t layer) { return counter->wait_until(slot, layer); });
  // The load queue holds layer_slots batches; acquire() above already bounds batches in flight
  // by the same number, so this push cannot find the queue full.
  load_queue_.push(std::move(batch));
  return slot;
}

std::size_t HiCacheController::drain_write_acks(std::vector<Ack>& out) {
  return drain_queue(acks_->write, out);
}

std::size_t HiCacheController::drain_load_acks(std::vector<Ack>& out) {
  return drain_queue(acks_->load, out);
}

void HiCacheController::prepare_pages(const CacheOperation& op, Scratch& s, bool to_host) {
  const std::int32_t ps = device_pool_.geometry().page_size;
  const KVGeometry& g = device_pool_.geometry();
  const LayoutDesc& host = host_pool_.layout();
  const std::int64_t pages = op.num_tokens() / ps;
  const CopyShape shape{
      .to_host = to_host,
      .bytes = op.num_tokens() * g.token_bytes(),
      .run_bytes = page_run_contiguous(host) ? page_run_bytes(host) : host.unit_bytes,
      .runs_per_call = pages * host.num_kv * (to_host ? host.num_layers : 1)};
  s.io = choose_io_backend(config_.io_backend, device_.backend(), host_pool_.host_layout(), shape);
  (s.io == IoBackend::kDirect ? direct_batches_ : kernel_batches_) += 1;
  s.host_pages.clear();
  s.device_pages.clear();
  slots_to_pages(op.host_slots, ps, host_pool_.num_pages(), "controller host slots",
                 s.host_pages);
  slots_to_pages(op.device_slots, ps, device_pool_.num_pages(),
                 "controller device slots", s.device_pages);
  if (s.io == IoBackend::kDirect) {
    // Sorted host pages read or write host memory in address order (as the reference does).
    s.pairs.clear();
    for (std::size_t i = 0; i < s.host_pages.size(); ++i) {
      s.pairs.emplace_back(s.host_pages[i], s.device_pages[i]);
    }
    std::sort(s.pairs.begin(), s.pairs.end());
    for (std::size_t i = 0; i < s.pairs.size(); ++i) {
      s.host_pages[i] = s.pairs[i].first;
      s.device_pages[i] = s.pairs[i].second;
    }
    return;
  }
  const std::size_t need = 2 * s.host_pages.size() * sizeof(std::int64_t);
  if (s.pinned.size() < need) {
    s.pinned = device_.alloc_host(std::max<std::size_t>(need, 1 << 16));
    s.pinned_host = reinterpret_cast<std::int64_t*>(s.pinned.data());
    s.pinned_device = s.pinned_host + s.pinned.size() / (2 * sizeof(std::int64_t));
  }
  std::copy(s.host_pages.begin(), s.host_pages.end(), s.pinned_host);
  std::copy(s.device_pages.begin(), s.device_pages.end(), s.pinned_device);
}

void HiCacheController::enqueue_copy(Stream& stream, Scratch& s, bool to_host, std::int32_t lb,
                                     std::int32_t le) {
  const LayoutDesc& host = host_pool_.layout();
  const LayoutDesc& dev = device_pool_.layout();
  if (s.io == IoBackend::kDirect) {
    s.regions.clear();
    if (to_host) {
      append_page_copies(host, s.host_pages, dev, s.device_pages, lb, le, s.regions);
    } else {
      append_page_copies(dev, s.device_pages, host, s.host_pages, lb, le, s.regions);
    }
    stream.copy_batch_async(s.regions);
    return;
  }
  const auto n = static_cast<std::int64_t>(s.host_pages.size());
  const PageTransfer t = to_host
                             ? PageTransfer{host, dev, s.pinned_host, s.pinned_device, n, lb, le}
                             : PageTransfer{dev, host, s.pinned_device, s.pinned_host, n, lb, le};
  stream.transfer_pages_async(t, config_.kernel_max_blocks);
}

void HiCacheController::run_write(CacheOperation& op, Scratch& s, int ops) {
  bool ok = true;
  const auto started = std::chrono::steady_clock::now();
  try {
    prepare_pages(op, s, /*to_host=*/true);
    enqueue_copy(*write_stream_, s, /*to_host=*/true, 0, device_pool_.geometry().num_layers);
    const std::uint64_t sidecar_bytes =
        op.sidecars.empty() ? 0 : enqueue_sidecar_copies(*write_stream_, s, op, /*to_host=*/true);
    write_stream_->synchronize();
    host_pool_.complete_io(op.host_slots, PageState::kSynced);
    finish_sidecar_hosts(op, PageState::kSynced);
    bytes_written_ += static_cast<std::uint64_t>(op.num_tokens() *
                                                 device_pool_.geometry().token_bytes()) +
                      sidecar_bytes;
    sidecar_bytes_written_ += sidecar_bytes;
    writes_done_ += static_cast<std::uint64_t>(ops);
    write_ns_ += static_cast<std::uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() -
                                                             started)
            .count());
    ++write_batches_done_;
  } catch (const std::exception&) {
    ok = false;
    write_failures_ += static_cast<std::uint64_t>(ops);
    try {
      host_pool_.abort_io(op.host_slots);
      host_pool_.free(op.host_slots);
    } catch (const std::exception&) {
      // The pages were not in the state this op left them in; nothing more to return.
    }
    finish_sidecar_hosts(op, PageState::kFree);
  }
  finish_op(op, acks_->write, ok, s);
}

void HiCacheController::run_load(LoadBatch& batch, Scratch& s) {
  bool ok = true;
  const std::int32_t layers = device_pool_.geometry().num_layers;
  const auto started = std::chrono::steady_clock::now();
  try {
    std::int32_t layer = 0;
    prepare_pages(batch.op, s, /*to_host=*/false);
    // A hybrid model's state is read from its first layer on: it lands before layer 0's mark.
    const std::uint64_t sidecar_bytes =
        batch.op.sidecars.empty()
            ? 0
            : enqueue_sidecar_copies(*load_stream_, s, batch.op, /*to_host=*/false);
    // Every layer is enqueued at once, each followed by its event: the consumer waits on the
    // event, so it wakes as each layer lands without this thread waking per layer. No host
    // function marks layers done: on CUDA each one stalls the stream until the runtime's
    // callback thread has run it, which held an H100's layer-by-layer load of 16 MiB layers to
    // 0.7 of the copy engine's rate and of 1 MiB layers to 0.25 (hicache-opbench --device cuda).
    // (Copies that were enqueued cannot fail on the host backend: they were validated first; on
    // CUDA a failed copy is a sticky context error and synchronize throws.)
    LayerDoneCounter* counter = counter_.get();
    const std::int32_t slot = batch.slot;
    for (; layer < layers; ++layer) {
      enqueue_copy(*load_stream_, s, /*to_host=*/false, layer, layer + 1);
      if (Event* e = counter_->layer_event(slot, layer)) {
        load_stream_->record(*e);
        counter->mark_layer_enqueued(slot, layer);
      } else {
        load_stream_->launch_host_func(
            [counter, slot, layer] { counter->mark_layer_done(slot, layer); });
      }
    }
    load_stream_->synchronize();
    host_pool_.complete_io(batch.op.host_slots, PageState::kSynced);
    finish_sidecar_hosts(batch.op, PageState::kSynced);
    bytes_loaded_ += static_cast<std::uint64_t>(batch.op.num_tokens() *
                                                device_pool_.geometry().token_bytes()) +
                     sidecar_bytes;
    sidecar_bytes_loaded_ += sidecar_bytes;
    load_ns_ += static_cast<std::uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() -
                                                             started)
            .count());
    ++load_batches_done_;
  } catch (const std::exception&) {
    ok = false;
    ++load_failures_;
    // Copies and layer marks enqueued before the failure must be over before the slot and the
    // pages are handed back (a late mark would land on the slot's next batch).
    try {
      load_stream_->synchronize();
    } catch (const std::exception&) {
    }
    counter_->fail(batch.slot);
    try {
      host_pool_.complete_io(batch.op.host_slots, PageState::kBackup);
    } catch (const std::exception&) {
    }
    finish_sidecar_hosts(batch.op, PageState::kBackup);
  }
  counter_->release(batch.slot);
  finish_op(batch.op, acks_->load, ok, s);
}

void HiCacheController::finish_op(CacheOperation& op, moodycamel::ConcurrentQueue<Ack>& acks,
                                  bool ok, Scratch& s) {
  // The op's lists go back to the arena before its acks are posted: a caller that has seen
  // the ack finds them there, so its next write() or load() takes a list instead of
  // allocating one (ControllerAllocations counts this).
  if (timed_.load(std::memory_order_relaxed) && op.submitted.time_since_epoch().count() != 0) {
    const double latency =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - op.submitted).count();
    (&acks == &acks_->write ? write_latency_ : load_latency_).observe(latency);
  }
  s.ack_nodes.swap(op.node_ids);
  arena_.give(std::move(op));  // with the scratch's previous node list in place of this op's
  for (NodeId node : s.ack_nodes) acks.enqueue(Ack{node, ok});
  events_->notify();
}

void HiCacheController::write_loop() {
  Scratch scratch;
  while (auto op = write_queue_.pop_spinning(kSpinBeforeSleep)) {
    // Writes queued meanwhile go along (up to kMaxMergedWrites ops, in priority order): one
    // copy batch and one stream synchronisation for all of them, instead of two thread
    // hand-offs per op. A failed batch fails every op in it (each is acked, not ok).
    int ops = 1;
    for (; ops < kMaxMergedWrites; ++ops) {
      auto more = write_queue_.try_pop();
      if (!more) break;
      op->merge(std::move(*more));
      arena_.give(std::move(*more));
    }
    run_write(*op, scratch, ops);
  }
}

void HiCacheController::load_loop() {
  Scratch scratch;
  while (auto batch = load_queue_.pop_spinning(kSpinBeforeSleep)) run_load(*batch, scratch);
}

std::int64_t HiCacheController::evict_device(std::span<const std::int64_t> device_slots,
                                             std::span<const std::int64_t> host_slots,
                                             std::span<const SidecarIo> sidecars) {
  constexpr const char* kWhat = "HiCacheController::evict_device";
  if (device_slots.size() != host_slots.size()) {
    throw InvalidArgument(str_cat(kWhat, ": ", device_slots.size(), " device slots for ",
                                  host_slots.size(), " host slots"));
  }
  host_pool_.require_state(host_slots, PageState::kSynced, kWhat);
  check_sidecars(sidecars, kWhat, PageState::kSynced, /*allocated_device=*/true);
  // The allocator checks the whole list (range, whole pages, allocated, listed once) before it
  // frees anything, and the host pages were checked above, so an error changes nothing.
  device_pool_.allocator().free(device_slots);
  host_pool_.mark_backup(host_slots);
  for (const SidecarIo& io : sidecars) {
    sidecars_[io.pool]->device_pool().allocator().free(io.device_slots);
    sidecars_[io.pool]->host_pool().mark_backup(io.host_slots);
  }
  return static_cast<std::int64_t>(device_slots.size());
}

std::int64_t HiCacheController::evict_host(std::span<const std::int64_t> host_slots,
                                           std::span<const SidecarIo> sidecars) {
  constexpr const char* kWhat = "HiCacheController::evict_host";
  host_pool_.require_state(host_slots, PageState::kBackup, kWhat);
  for (const SidecarIo& io : sidecars) {
    if (io.pool < 0 || static_cast<std::size_t>(io.pool) >= sidecars_.size()) {
      throw InvalidArgument(str_cat(kWhat, ": sidecar pool ", io.pool, " does not exist (",
                                    sidecars_.size(), " sidecar pools)"));
    }
    sidecars_[io.pool]->host_pool().require_state(io.host_slots, PageState::kBackup, kWhat);
  }
  host_pool_.free(host_slots);
  for (const SidecarIo& io : sidecars) sidecars_[io.pool]->host_pool().free(io.host_slots);
  return static_cast<std::int64_t>(host_slots.size());
}

void HiCacheController::return_queued_slots() {
  for (CacheOperation& op : write_queue_.drain()) {
    host_pool_.abort_io(op.host_slots);
    host_pool_.free(op.host_slots);
    finish_sidecar_hosts(op, PageState::kFree);
  }
  for (CacheOperation& op : pending_loads_.drain()) return_load(op);
  for (LoadBatch& batch : load_queue_.drain()) return_load(batch.op);
  std::vector<Ack> dropped;
  drain_queue(acks_->write, dropped);
  drain_queue(acks_->load, dropped);
}

void HiCacheController::stop() {
  if (!running_) return;
  running_ = false;
  write_queue_.stop();
  pending_loads_.stop();  // a load() after stop is refused, not held for a batch never started
  load_queue_.stop();
  counter_->stop();
  write_thread_.join();
  load_thread_.join();
  device_pool_.set_layer_wait_hook(nullptr);
  return_queued_slots();
}

void HiCacheController::reset() {
  stop();
  write_queue_.reset();
  load_queue_.reset();
  pending_loads_.reset();
  counter_->reset();
  start_threads();
}

ControllerStats HiCacheController::stats() const {
  return ControllerStats{writes_done_.value(),      write_failures_.value(),
                         load_batches_done_.value(), load_failures_.value(),
                         bytes_written_.value(),     bytes_loaded_.value(),
                         static_cast<double>(load_ns_.value()) * 1e-9,
                         sidecar_bytes_written_.value(), sidecar_bytes_loaded_.value(),
                         write_batches_done_.value(),
                         static_cast<double>(write_ns_.value()) * 1e-9,
                         direct_batches_.value(),
                         kernel_batches_.value()};
}

void HiCacheController::unregister_metrics() {
  timed_.store(false, std::memory_order_relaxed);
  metrics_.reset();
}

void HiCacheController::register_metrics(MetricsRegistry& registry, MetricLabels labels) {
  metrics_.attach(registry, std::move(labels));
  timed_.store(true, std::memory_order_relaxed);
  const MetricLabels write = {{"direction", "l1_to_l2"}}, load = {{"direction", "l2_to_l1"}};
  constexpr const char* kOps = "hicache_ops_total";
  constexpr const char* kOpsHelp = "Transfer ops acknowledged, by direction and outcome";
  metrics_.add(kOps, kOpsHelp, {{"direction", "l1_to_l2"}, {"outcome", "ok"}}, writes_done_);
  metrics_.add(kOps, kOpsHelp, {{"direction", "l1_to_l2"}, {"outcome", "failed"}},
               write_failures_);
  metrics_.add(kOps, kOpsHelp, {{"direction", "l2_to_l1"}, {"outcome", "ok"}},
               load_batches_done_);
  metrics_.add(kOps, kOpsHelp, {{"direction", "l2_to_l1"}, {"outcome", "failed"}},
               load_failures_);
  constexpr const char* kBytes = "hicache_bytes_total";
  constexpr const char* kBytesHelp = "KV bytes moved between tiers, by direction";
  // The KV's alone (bytes_written_ / bytes_loaded_ count the sidecars' too, for the cost rule);
  // a hybrid model's sidecar bytes have their own series, as L3's do (StorageController).
  metrics_.add_counter_fn(kBytes, kBytesHelp, write, [this] {
    return static_cast<double>(bytes_written_.value() - sidecar_bytes_written_.value());
  });
  metrics_.add_counter_fn(kBytes, kBytesHelp, load, [this] {
    return static_cast<double>(bytes_loaded_.value() - sidecar_bytes_loaded_.value());
  });
  if (!sidecars_.empty()) {
    constexpr const char* kSide = "hicache_sidecar_bytes_total";
    constexpr const char* kSideHelp =
        "Sidecar pool bytes (a hybrid model's state) moved between tiers, by direction";
    metrics_.add(kSide, kSideHelp, write, sidecar_bytes_written_);
    metrics_.add(kSide, kSideHelp, load, sidecar_bytes_loaded_);
  }
  // Whole tokens move: the KV's bytes (all but the sidecars') over a token's are tokens, exactly.
  const auto token_bytes = static_cast<double>(device_pool_.geometry().token_bytes());
  metrics_.add_counter_fn(kTokensMetric, kTokensHelp, write, [this, token_bytes] {
    return static_cast<double>(bytes_written_.value() - sidecar_bytes_written_.value()) /
           token_bytes;
  });
  metrics_.add_counter_fn(kTokensMetric, kTokensHelp, load, [this, token_bytes] {
    return static_cast<double>(bytes_loaded_.value() - sidecar_bytes_loaded_.value()) /
           token_bytes;
  });
  constexpr const char* kLatency = "hicache_op_latency_seconds";
  constexpr const char* kLatencyHelp = "Transfer op latency from submit to acknowledgement";
  metrics_.add(kLatency, kLatencyHelp, write, write_latency_);
  metrics_.add(kLatency, kLatencyHelp, load, load_latency_);
  metrics_.add_gauge_fn("hicache_queue_depth", "Ops waiting in a queue",
                        {{"queue", "write"}},
                        [this] { return static_cast<double>(write_queue_.size()); });
  metrics_.add_gauge_fn("hicache_queue_depth", "Ops waiting in a queue", {{"queue", "load"}},
                        [this] { return static_cast<double>(load_queue_.size()); });
}

}  // namespace hicache
