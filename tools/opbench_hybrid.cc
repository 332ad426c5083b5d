#include "tools/opbench_hybrid.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "controller/hicache_controller.h"
#include "pools/device_kv_pool.h"
#include "pools/host_kv_pool.h"
#include "pools/kv_pattern.h"
#include "pools/paged_token_allocator.h"
#include "pools/sidecar_pool.h"
#include "transfer/errors.h"

namespace hicache::opbench {
namespace {

using Clock = std::chrono::steady_clock;
using Slots = std::vector<std::int64_t>;

constexpr std::int64_t kKvPages = 16;    // per hybrid op, beside one state page
constexpr std::int64_t kPoolPages = 40;  // KV pages per tier
constexpr std::int64_t kStateLayers = 8;
constexpr std::int64_t kStateSlotBytes = 2 << 20;  // 8 x 2 MiB = one 16 MiB state page

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

double round_to(double v, int decimals) {
  const double scale = std::pow(10.0, decimals);
  return std::round(v * scale) / scale;
}

// A device pool as the CPU writes and reads it: the pool itself on the host backend, else a
// pinned mirror copied over before a run and back before a check.
class CpuView {
 public:
  CpuView(Device& device, const LayoutDesc& layout, std::size_t bytes)
      : layout_(layout), cpu_(layout), bytes_(bytes) {
    if (!device.device_memory_is_host_accessible()) {
      mirror_ = device.alloc_host(bytes);
      cpu_.base = reinterpret_cast<std::uint8_t*>(mirror_.data());
      stream_ = device.create_stream();
    }
  }
  const LayoutDesc& cpu() const { return cpu_; }
  void push() { copy(layout_.base, cpu_.base); }
  void pull() { copy(cpu_.base, layout_.base); }

 private:
  void copy(void* dst, const void* src) {
    if (!stream_) return;
    stream_->copy_async(dst, src, bytes_);
    stream_->synchronize();
  }
  LayoutDesc layout_, cpu_;
  std::size_t bytes_;
  Buffer mirror_;
  std::unique_ptr<Stream> stream_;
};

struct Rig {
  Device& device;
  KVGeometry g = KVGeometry::mha(32, 8, 128, DType::kFloat16, 64);
  DeviceKVPool dev{device, g, kPoolPages * g.page_size};
  HostKVPool host{device, g, HostLayout::kLayerFirst, kPoolPages * g.page_size};
  SidecarPool state{device, SidecarSpec{.name = "state",
                                        .policy = SidecarHitPolicy::kTrailing,
                                        .layers = kStateLayers,
                                        .slots_per_page = 1,
                                        .slot_bytes = kStateSlotBytes,
                                        .dtype = DType::kBFloat16,
                                        .device_pages = 2,
                                        .host_pages = 2}};
  std::vector<SidecarPool*> pools{&state};
  HiCacheController c{device, dev, host, ControllerConfig{}, pools};
  CpuView dev_cpu{device, dev.layout(), dev.size_bytes()};
  CpuView state_cpu{device, state.device_pool().layout(), state.device_pool().size_bytes()};
  std::vector<Ack> acks;

  explicit Rig(Device& d) : device(d) {}

  bool clean() const {
    return dev.allocator().free_tokens() == dev.capacity_tokens() &&
           host.free_tokens() == host.capacity_tokens() &&
           state.device_pool().allocator().free_tokens() == state.device_pool().capacity_tokens() &&
           state.host_pool().free_tokens() == state.host_pool().capacity_tokens();
  }
  // Waits (on the controller's event signal, no polling) for one ack; false when not ok.
  bool wait_ack(bool write) {
    for (;;) {
      const std::uint64_t seen = c.events()->seq();
      acks.clear();
      if ((write ? c.drain_write_acks(acks) : c.drain_load_acks(acks)) > 0) return acks[0].ok;
      c.events()->wait(seen, Clock::now() + std::chrono::seconds(60));
    }
  }
};

// One side's op: its KV pages and (hybrid) its state page, on both tiers.
struct Op {
  std::uint64_t id = 0;  // every op's pages carry data of their own
  Slots kv_dev, kv_host, state_dev, state_host;
  std::vector<SidecarIo> io() const {
    if (state_dev.empty()) return {};
    return {SidecarIo{0, state_host, state_dev}};
  }
};

// The data of page `page` of op `op` (the state page is page kStatePage).
constexpr std::int64_t kStatePage = 1000;
std::uint64_t seed(std::uint64_t op, std::int64_t page) {
  return (0x5eedULL << 48) ^ (op << 16) ^ static_cast<std::uint64_t>(page);
}

class Hybrid {
 public:
  Hybrid(Device& device, bool load) : rig_(device), load_(load) {}

  HybridResult run(std::int64_t rounds, std::int64_t ops) {
    std::vector<double> ratios, hybrid_gbps, kv_gbps;
    const double op_bytes = static_cast<double>((kKvPages + 2) * rig_.g.page_bytes());
    for (std::int64_t r = 0; r < rounds + 1; ++r) {  // round 0: warm-up
      const bool last = r == rounds;
      double seconds[2] = {0, 0};
      for (int k = 0; k < 2; ++k) {
        const int side = (r % 2 == 0) ? k : 1 - k;  // 0 hybrid, 1 kv only
        seconds[side] = run_side(side == 0, ops, last);
      }
      if (r == 0) continue;
      ratios.push_back(seconds[1] / seconds[0]);
      hybrid_gbps.push_back(static_cast<double>(ops) * op_bytes / seconds[0] / 1e9);
      kv_gbps.push_back(static_cast<double>(ops) * op_bytes / seconds[1] / 1e9);
    }
    HybridResult out;
    const bool clean = rig_.clean();
    auto& j = out.line;
    j["workload"] = load_ ? "hybrid_load_p16" : "hybrid_write_p16";
    j["rounds"] = rounds;
    j["ops_per_side"] = ops;
    j["op_bytes"] = static_cast<std::int64_t>(op_bytes);
    j["state_page_bytes"] = rig_.state.spec().page_bytes();
    j["hybrid_gbps"] = round_to(median(hybrid_gbps), 3);
    j["kv_only_gbps"] = round_to(median(kv_gbps), 3);
    j["ratio"] = round_to(median(ratios), 3);
    j["ratio_min"] = round_to(ratios.empty() ? 0 : *std::min_element(ratios.begin(), ratios.end()), 3);
    j["target"] = 0.9;
    j["verified"] = verified_;
    j["pools_clean"] = clean;
    if (!problem_.empty()) j["problem"] = problem_;
    out.ok = verified_ && clean;
    return out;
  }

 private:
  void fail(const std::string& why) {
    if (verified_) problem_ = why;
    verified_ = false;
  }

  // The op's slots on the device (and, for a load, its copies on the host in backup), filled.
  Op prepare(bool hybrid) {
    Op op;
    op.id = ++ops_made_;
    const std::int64_t kv_pages = hybrid ? kKvPages : kKvPages + 2;
    const std::int32_t ps = rig_.g.page_size;
    if (!rig_.dev.allocator().alloc(kv_pages * ps, op.kv_dev)) throw Error("device pool short");
    if (hybrid) {
      op.state_dev = *rig_.state.device_pool().allocator().alloc(1);
    }
    Slots pages;
    slots_to_pages(op.kv_dev, ps, rig_.dev.num_pages(), "opbench", pages);
    for (std::size_t i = 0; i < pages.size(); ++i) {
      fill_page(rig_.dev_cpu.cpu(), pages[i], seed(op.id, static_cast<std::int64_t>(i)));
    }
    rig_.dev_cpu.push();
    if (hybrid) {
      fill_page(rig_.state_cpu.cpu(), op.state_dev[0], seed(op.id, kStatePage));
      rig_.state_cpu.push();
    }
    if (load_) {  // written once, untimed; the device copies go
      write(op);
      if (!rig_.wait_ack(true)) throw Error("the load's set-up write failed");
      const auto io = op.io();
      rig_.c.evict_device(op.kv_dev, op.kv_host, io);
      op.kv_dev.clear();
      op.state_dev.clear();
    }
    return op;
  }

  void write(Op& op) {
    auto host = rig_.c.reserve_write(static_cast<std::int64_t>(op.kv_dev.size()));
    if (!host) throw Error("host pool short");
    op.kv_host = std::move(*host);
    if (!op.state_dev.empty()) op.state_host = *rig_.state.host_pool().alloc(1);
    const auto io = op.io();
    if (!rig_.c.write_reserved(op.kv_dev, op.kv_host, 0, NodeId{1}, nullptr, io)) {
      throw Error("write refused");
    }
  }

  // Checks the op's copy on the tier it was moved to.
  void verify(const Op& op, bool hybrid) {
    const std::int32_t ps = rig_.g.page_size;
    Slots pages;
    std::string where;
    if (load_) {
      rig_.dev_cpu.pull();
      slots_to_pages(op.kv_dev, ps, rig_.dev.num_pages(), "opbench", pages);
      for (std::size_t i = 0; i < pages.size(); ++i) {
        if (!verify_page(rig_.dev_cpu.cpu(), pages[i],
                         seed(op.id, static_cast<std::int64_t>(i)), &where)) {
          fail("a loaded KV page differs at " + where);
        }
      }
      if (hybrid) {
        rig_.state_cpu.pull();
        if (!verify_page(rig_.state_cpu.cpu(), op.state_dev[0], seed(op.id, kStatePage), &where)) {
          fail("the loaded state page differs at " + where);
        }
      }
      return;
    }
    slots_to_pages(op.kv_host, ps, rig_.host.num_pages(), "opbench", pages);
    for (std::size_t i = 0; i < pages.size(); ++i) {
      if (!verify_page(rig_.host.layout(), pages[i],
                       seed(op.id, static_cast<std::int64_t>(i)), &where)) {
        fail("a written KV page differs at " + where);
      }
    }
    if (hybrid && !verify_page(rig_.state.host_pool().layout(), op.state_host[0], seed(op.id, kStatePage),
                               &where)) {
      fail("the written state page differs at " + where);
    }
  }

  // `ops` ops of one side, one after another; the seconds they took from submit to ack.
  double run_side(bool hybrid, std::int64_t ops, bool check) {
    double total = 0;
    for (std::int64_t i = 0; i < ops; ++i) {
      Op op = prepare(hybrid);
      const auto t0 = Clock::now();
      bool ok = true;
      if (load_) {
        op.kv_dev = *rig_.dev.allocator().alloc(static_cast<std::int64_t>(op.kv_host.size()));
        if (hybrid) op.state_dev = *rig_.state.device_pool().allocator().alloc(1);
        const auto io = op.io();
        if (!rig_.c.load_into(op.kv_host, op.kv_dev, 0, NodeId{2}, io)) throw Error("load refused");
        const std::int32_t slot = rig_.c.start_loading();
        for (std::int32_t layer = 0; layer < rig_.g.num_layers; ++layer) {
          ok = rig_.dev.wait_for_layer(layer) && ok;
        }
        rig_.c.layer_done_counter().release(slot);
        ok = rig_.wait_ack(false) && ok;
      } else {
        write(op);
        ok = rig_.wait_ack(true);
      }
      total += std::chrono::duration<double>(Clock::now() - t0).count();
      // Nothing injects faults here: a failed copy is an error of the run.
      if (!ok) throw Error(hybrid ? "a hybrid op failed" : "a KV-only op failed");
      if (check) verify(op, hybrid);
      const auto io = op.io();
      rig_.c.evict_device(op.kv_dev, op.kv_host, io);
      rig_.c.evict_host(op.kv_host, io);
    }
    return total;
  }

  Rig rig_;
  bool load_;
  std::uint64_t ops_made_ = 0;
  bool verified_ = true;
  std::string problem_;
};

}  // namespace

HybridResult run_hybrid(Device& device, bool load, std::int64_t rounds, std::int64_t ops) {
  return Hybrid(device, load).run(rounds, ops);
}

}  // namespace hicache::opbench
