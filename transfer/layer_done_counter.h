// LayerDoneCounter: how the forward pass learns that layer i of a layer-by-layer load is in
// device memory.
//
// The load thread (producer) claims a slot per batch, then marks layers done in order (without a
// device), or, with a device, records an event after each layer's copy and announces it
// (mark_layer_enqueued): the layer is done when the event completes. The forward pass
// (consumer) waits on that slot for each layer before reading it. Several slots let
// the load of the next batch start while the current batch's consumer still waits (overlap
// mode). Unlike the reference:
//   - a slot's count is reset *before* it is handed to a producer and a slot is not reused
//     until both its producer and its consumer released it, so a consumer never sees a count
//     left over from an earlier batch (no running ahead into a partial layer);
//   - when every slot is busy a new producer waits for one to free instead of asserting;
//   - a failed batch wakes its consumer with a failure instead of leaving it waiting forever,
//     and stop() wakes everyone.
// On CUDA the controller also records one event per (slot, layer), so the compute stream can
// wait on the device instead of blocking the host (layer_event()).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <vector>

#include "transfer/device.h"
#include "transfer/mutex.h"

namespace hicache {

class LayerDoneCounter {
 public:
  // Throws InvalidArgument unless num_layers > 0 and num_slots > 0. With a device, one event
  // per (slot, layer) is created for device-side waits.
  LayerDoneCounter(std::int32_t num_layers, std::int32_t num_slots = 3, Device* device = nullptr);

  std::int32_t num_layers() const { return num_layers_; }
  std::int32_t num_slots() const { return num_slots_; }

  // Producer: claims a free slot with its count at 0, waiting while all slots are busy.
  // Returns the slot, or -1 once stop() was called.
  std::int32_t acquire();
  // Producer: layer `layer` of the slot's batch is in device memory. Layers are marked in
  // order; marking another layer than the next one throws StateError.
  void mark_layer_done(std::int32_t slot, std::int32_t layer);
  // Producer (with a device): layer `layer`'s copy and its event are enqueued on the load stream
  // (the event is recorded). Layers are announced in order, as for mark_layer_done.
  void mark_layer_enqueued(std::int32_t slot, std::int32_t layer);
  // Producer: the batch failed; every waiter on the slot wakes and gets false.
  void fail(std::int32_t slot);

  // Consumer: blocks until `layer` of the slot's batch is done: marked done, or, with a device,
  // enqueued and its event completed (the controller marks nothing and lets the events tell).
  // Returns true then; false when the batch failed or stop() was called first.
  bool wait_until(std::int32_t slot, std::int32_t layer);
  // Consumer, device-side wait: makes `compute` wait for `layer` of the slot's batch on the
  // device; the host blocks only until that layer's copy is enqueued (microseconds after
  // start_loading), never for the copy itself. Work enqueued on `compute` afterwards reads the
  // layer's bytes. Without a device (no events) it falls back to wait_until. Returns false when
  // the batch failed before the layer was enqueued or stop() was called; a copy that fails after
  // it was enqueued is reported by the load's ack (the bytes are then not to be used).
  bool wait_on_stream(std::int32_t slot, std::int32_t layer, Stream& compute);
  // Non-blocking form of wait_until (with a device, one event query).
  bool is_done(std::int32_t slot, std::int32_t layer) const;

  // Producer and consumer each release the slot once; it is reused only after both did.
  void release(std::int32_t slot);

  // The event recorded after `layer` of the slot was copied (null without a device).
  Event* layer_event(std::int32_t slot, std::int32_t layer) const;

  // Wakes every waiter; acquire() returns -1 and wait_until() false from now on.
  void stop();
  // Frees every slot and clears stop (after the controller's threads have been joined).
  void reset();

  // Slots currently claimed (for accounting tests).
  std::int32_t busy_slots() const;

 private:
  struct Slot {
    std::int32_t done = 0;     // layers done in the current batch
    std::int32_t enqueued = 0;  // layers whose copy and event are enqueued
    std::int32_t holders = 0;  // 2 while claimed: producer + consumer
    bool failed = false;
  };
  // How long a consumer re-checks (yielding the CPU in between) before it blocks. A blocked
  // consumer costs the producer a wake-up per layer; on a VM whose idle vCPU halts, that
  // wake-up slowed a layer-by-layer load of 1 MiB layers by 15-20% (hicache-opbench load_p1:
  // 0.80-0.85 of memcpy blocking, 1.0-1.1 spinning). CUDA's default host synchronisation
  // spins for the same reason. Past the budget it blocks: a consumer far ahead of its load
  // (or of a stopped controller) does not burn a core.
  static constexpr std::chrono::microseconds kSpinBeforeBlock{100};
  // What a consumer of `layer` waits for, besides a failure of the batch or stop().
  enum class Awaited {
    kDone,            // the layer marked done
    kDoneOrEnqueued,  // marked done, or its copy and event enqueued
    kEnqueued,        // its copy and event enqueued
  };
  // Whether the wait for `layer` of slot `s` is over: what it awaits happened, the batch
  // failed, or stop() was called.
  bool wait_over(const Slot& s, std::int32_t layer, Awaited awaited) const HICACHE_REQUIRES(mu_);
  // Waits until wait_over(): spins (releasing mu_ and yielding in between) up to
  // kSpinBeforeBlock, then blocks on changed_.
  void spin_then_wait(const Slot& s, std::int32_t layer, Awaited awaited) HICACHE_REQUIRES(mu_);
  void check_slot(std::int32_t slot, const char* what) const;
  void check_layer(std::int32_t layer, const char* what) const;

  std::int32_t num_layers_;
  std::int32_t num_slots_;
  mutable Mutex mu_;
  std::condition_variable changed_;  // any slot's count, holders or failure, or stop
  std::vector<Slot> slots_ HICACHE_GUARDED_BY(mu_);
  std::int32_t next_ HICACHE_GUARDED_BY(mu_) = 0;  // where acquire() starts looking
  bool stopped_ HICACHE_GUARDED_BY(mu_) = false;
  std::vector<std::unique_ptr<Event>> events_;  // [slot * num_layers + layer]
};

}  // namespace hicache
