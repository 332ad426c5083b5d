#include "transfer/layer_done_counter.h"

#include <thread>

#include "transfer/errors.h"

namespace hicache {

LayerDoneCounter::LayerDoneCounter(std::int32_t num_layers, std::int32_t num_slots, Device* device)
    : num_layers_(num_layers), num_slots_(num_slots) {
  if (num_layers <= 0) {
    throw InvalidArgument(str_cat("LayerDoneCounter: num_layers must be > 0, got ", num_layers));
  }
  if (num_slots <= 0) {
    throw InvalidArgument(str_cat("LayerDoneCounter: num_slots must be > 0, got ", num_slots));
  }
  slots_.resize(num_slots);
  if (device != nullptr) {
    for (std::int32_t i = 0; i < num_slots * num_layers; ++i) {
      events_.push_back(device->create_event());
    }
  }
}

void LayerDoneCounter::check_layer(std::int32_t layer, const char* what) const {
  if (layer < 0 || layer >= num_layers_) {
    throw InvalidArgument(str_cat("LayerDoneCounter::", what, ": layer ", layer,
                                  " is out of range [0, ", num_layers_, ")"));
  }
}

void LayerDoneCounter::check_slot(std::int32_t slot, const char* what) const {
  if (slot < 0 || slot >= num_slots_) {
    throw InvalidArgument(str_cat("LayerDoneCounter::", what, ": slot ", slot,
                                  " is out of range [0, ", num_slots_, ")"));
  }
}

std::int32_t LayerDoneCounter::acquire() {
  MutexLock lock(mu_);
  for (;;) {
    if (stopped_) return -1;
    for (std::int32_t k = 0; k < num_slots_; ++k) {
      const std::int32_t i = (next_ + k) % num_slots_;
      if (slots_[i].holders == 0) {
        slots_[i] = Slot{.done = 0, .enqueued = 0, .holders = 2, .failed = false};
        next_ = (i + 1) % num_slots_;
        return i;
      }
    }
    mu_.wait(changed_);  // woken by release() or stop()
  }
}

void LayerDoneCounter::mark_layer_done(std::int32_t slot, std::int32_t layer) {
  check_slot(slot, "mark_layer_done");
  {
    MutexLock lock(mu_);
    Slot& s = slots_[slot];
    if (s.holders == 0) {
      throw StateError(str_cat("LayerDoneCounter::mark_layer_done: slot ", slot,
                               " is not claimed"));
    }
    if (layer != s.done) {
      throw StateError(str_cat("LayerDoneCounter::mark_layer_done: slot ", slot, " expects layer ",
                               s.done, ", got ", layer));
    }
    ++s.done;
  }
  changed_.notify_all();
}

void LayerDoneCounter::mark_layer_enqueued(std::int32_t slot, std::int32_t layer) {
  check_slot(slot, "mark_layer_enqueued");
  {
    MutexLock lock(mu_);
    Slot& s = slots_[slot];
    if (s.holders == 0) {
      throw StateError(str_cat("LayerDoneCounter::mark_layer_enqueued: slot ", slot,
                               " is not claimed"));
    }
    if (layer != s.enqueued) {
      throw StateError(str_cat("LayerDoneCounter::mark_layer_enqueued: slot ", slot,
                               " expects layer ", s.enqueued, ", got ", layer));
    }
    ++s.enqueued;
  }
  changed_.notify_all();
}

void LayerDoneCounter::fail(std::int32_t slot) {
  check_slot(slot, "fail");
  {
    MutexLock lock(mu_);
    slots_[slot].failed = true;
  }
  changed_.notify_all();
}

bool LayerDoneCounter::wait_over(const Slot& s, std::int32_t layer, Awaited awaited) const {
  switch (awaited) {
    case Awaited::kDone:
      return s.done > layer || s.failed || stopped_;
    case Awaited::kDoneOrEnqueued:
      return s.done > layer || s.enqueued > layer || s.failed || stopped_;
    case Awaited::kEnqueued:
      return s.enqueued > layer || s.failed || stopped_;
  }
  return true;
}

void LayerDoneCounter::spin_then_wait(const Slot& s, std::int32_t layer, Awaited awaited) {
  if (wait_over(s, layer, awaited)) return;
  const auto give_up = std::chrono::steady_clock::now() + kSpinBeforeBlock;
  do {
    mu_.unlock();
    std::this_thread::yield();
    mu_.lock();
    if (wait_over(s, layer, awaited)) return;
  } while (std::chrono::steady_clock::now() < give_up);
  while (!wait_over(s, layer, awaited)) mu_.wait(changed_);
}

bool LayerDoneCounter::wait_until(std::int32_t slot, std::int32_t layer) {
  check_slot(slot, "wait_until");
  check_layer(layer, "wait_until");
  UniqueLock lock(mu_);
  const Slot& s = slots_[slot];
  if (events_.empty()) {
    spin_then_wait(s, layer, Awaited::kDone);
    return s.done > layer;
  }
  // With events a layer is also done once the event recorded after its copy has completed, so
  // the producer need not mark it (a host function per layer stalls a CUDA stream).
  spin_then_wait(s, layer, Awaited::kDoneOrEnqueued);
  if (s.done > layer) return true;
  if (s.failed || stopped_ || s.enqueued <= layer) return false;
  const Event& event = *events_[static_cast<std::size_t>(slot) * num_layers_ + layer];
  lock.unlock();  // the slot is ours until we release it: its events are not re-recorded
  try {
    const auto give_up = std::chrono::steady_clock::now() + kSpinBeforeBlock;
    while (!event.query()) {
      if (std::chrono::steady_clock::now() >= give_up) {
        event.synchronize();
        break;
      }
      std::this_thread::yield();
    }
  } catch (const std::exception&) {
    return false;  // the copy failed (a CUDA error); the load's ack reports it
  }
  return true;
}

bool LayerDoneCounter::wait_on_stream(std::int32_t slot, std::int32_t layer, Stream& compute) {
  if (events_.empty()) return wait_until(slot, layer);
  check_slot(slot, "wait_on_stream");
  check_layer(layer, "wait_on_stream");
  {
    MutexLock lock(mu_);
    const Slot& s = slots_[slot];
    spin_then_wait(s, layer, Awaited::kEnqueued);
    if (s.enqueued <= layer) return false;
  }
  compute.wait(*events_[static_cast<std::size_t>(slot) * num_layers_ + layer]);
  return true;
}

bool LayerDoneCounter::is_done(std::int32_t slot, std::int32_t layer) const {
  check_slot(slot, "is_done");
  check_layer(layer, "is_done");
  MutexLock lock(mu_);
  const Slot& s = slots_[slot];
  if (s.done > layer) return true;
  if (events_.empty() || s.enqueued <= layer) return false;
  try {
    return events_[static_cast<std::size_t>(slot) * num_layers_ + layer]->query();
  } catch (const std::exception&) {
    return false;
  }
}

void LayerDoneCounter::release(std::int32_t slot) {
  check_slot(slot, "release");
  {
    MutexLock lock(mu_);
    Slot& s = slots_[slot];
    if (s.holders == 0) {
      throw StateError(str_cat("LayerDoneCounter::release: slot ", slot, " is released twice"));
    }
    --s.holders;
  }
  changed_.notify_all();
}

Event* LayerDoneCounter::layer_event(std::int32_t slot, std::int32_t layer) const {
  check_slot(slot, "layer_event");
  if (events_.empty()) return nullptr;
  check_layer(layer, "layer_event");
  return events_[static_cast<std::size_t>(slot) * num_layers_ + layer].get();
}

void LayerDoneCounter::stop() {
  {
    MutexLock lock(mu_);
    stopped_ = true;
  }
  changed_.notify_all();
}

void LayerDoneCounter::reset() {
  {
    MutexLock lock(mu_);
    for (Slot& s : slots_) s = Slot{};
    stopped_ = false;
    next_ = 0;
  }
  changed_.notify_all();
}

std::int32_t LayerDoneCounter::busy_slots() const {
  MutexLock lock(mu_);
  std::int32_t n = 0;
  for (const Slot& s : slots_) n += s.holders > 0;
  return n;
}

}  // namespace hicache
