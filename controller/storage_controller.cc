#include "controller/storage_controller.h"

#include <chrono>
#include "controller/drain_queue.h"

#include <algorithm>
#include <cstdio>
#include <utility>

#include "controller/restorable.h"
#include "pools/paged_token_allocator.h"
#include "transfer/errors.h"

namespace hicache {

PrefetchPolicy parse_prefetch_policy(std::string_view name) {
  if (name == "best_effort") return PrefetchPolicy::kBestEffort;
  if (name == "wait_complete") return PrefetchPolicy::kWaitComplete;
  if (name == "timeout") return PrefetchPolicy::kTimeout;
  throw InvalidArgument(str_cat("prefetch policy '", name,
                                "' (valid: best_effort, wait_complete, timeout)"));
}

BudgetCredit BudgetCredit::take(std::shared_ptr<std::atomic<std::int64_t>> used,
                                std::int64_t tokens, std::int64_t limit) {
  BudgetCredit credit;
  std::int64_t now = used->load();
  while (now + tokens <= limit) {
    if (used->compare_exchange_weak(now, now + tokens)) {
      credit.used_ = std::move(used);
      credit.tokens_ = tokens;
      break;
    }
  }
  return credit;
}

BudgetCredit& BudgetCredit::operator=(BudgetCredit&& other) noexcept {
  if (this != &other) {
    release();
    used_ = std::move(other.used_);
    tokens_ = std::exchange(other.tokens_, 0);
  }
  return *this;
}

void BudgetCredit::release() {
  if (used_) *used_ -= tokens_;
  used_.reset();
  tokens_ = 0;
}

PrefetchOperation::PrefetchOperation(std::string request_id, std::vector<std::int32_t> tokens,
                                     std::optional<PageDigest> prior, std::int64_t page_size)
    : request_id_(std::move(request_id)), tokens_(std::move(tokens)), prior_(prior),
      page_size_(page_size) {}

PrefetchStage PrefetchOperation::stage() const {
  MutexLock lock(mu_);
  return stage_;
}

std::string PrefetchOperation::error() const {
  MutexLock lock(mu_);
  return error_;
}

void PrefetchOperation::set_error(std::string error) {
  MutexLock lock(mu_);
  error_ = std::move(error);
}

StorageController::StorageController(HostKVPool& host, StorageBackend& storage,
                                     const KeyNamespace& keys, Collective& prefetch_collective,
                                     Collective& backup_collective, Collective& main_collective,
                                     StorageControllerConfig config,
                                     std::vector<SidecarPool*> sidecars)
    : host_(host), storage_(storage), keyer_(keys), kv_prefix_(keyer_.prefix()),
      prefetch_collective_(prefetch_collective),
      backup_collective_(backup_collective), main_collective_(main_collective), config_(config),
      page_size_(host.geometry().page_size), prefetch_queue_(config.queue_capacity),
      prefetch_io_queue_(config.queue_capacity), backup_queue_(config.queue_capacity) {
  if (config_.io_batch_pages < 0) {
    throw InvalidArgument(str_cat("storage controller: io_batch_pages ", config_.io_batch_pages,
                                  " < 0 (0: automatic)"));
  }
  batch_pages_ = config_.io_batch_pages > 0
                     ? config_.io_batch_pages
                     : std::max<std::int64_t>(
                           1, storage.preferred_batch_pages(host.geometry().page_bytes()));
  // Automatic batches: a prefetch's reads are paced (ReadPacer); an explicit size is kept.
  if (config_.io_batch_pages == 0) read_pacer_ = std::make_unique<ReadPacer>(batch_pages_);
  if (config_.queue_capacity < 1) throw InvalidArgument("storage controller: queue_capacity 0");
  if (keyer_.page_size() != page_size_) {
    throw InvalidArgument(str_cat("storage controller: key namespace page_size ",
                                  keyer_.page_size(), " differs from the host pool's ", page_size_));
  }
  if (config_.prefetch_budget_tokens < page_size_) {
    throw InvalidArgument(str_cat("storage controller: prefetch_budget_tokens ",
                                  config_.prefetch_budget_tokens, " is less than one page (",
                                  page_size_, " tokens)"));
  }
  if (config_.prefetch_threshold_tokens < 0) {
    throw InvalidArgument(str_cat("storage controller: prefetch_threshold_tokens ",
                                  config_.prefetch_threshold_tokens, " < 0"));
  }
  config_.prefetch_threshold_tokens = std::max(config_.prefetch_threshold_tokens, page_size_);
  if (config_.timeout_base.count() < 0 || config_.timeout_per_page.count() < 0 ||
      config_.timeout_cap.count() < 0) {
    throw InvalidArgument("storage controller: prefetch timeouts must be >= 0 ms");
  }
  for (SidecarPool* pool : sidecars) {
    if (pool == nullptr) throw InvalidArgument("storage controller: a null sidecar pool");
    const SidecarSpec& spec = pool->spec();
    if (!pool->host_pool().has_contiguous_pages()) {
      throw InvalidArgument(str_cat("storage controller: sidecar pool '", spec.name,
                                    "' has no contiguous host pages"));
    }
    Sidecar sc{.host = &pool->host_pool(),
               .policy = spec.policy,
               .window = spec.window_pages,
               .slots_per_page = spec.slots_per_page,
               .batch_pages = config_.io_batch_pages > 0
                                  ? config_.io_batch_pages
                                  : std::max<std::int64_t>(
                                        1, storage.preferred_batch_pages(spec.page_bytes())),
               .prefix = PageKeyer(sidecar_namespace(keys, spec)).prefix()};
    validate_key(str_cat(sc.prefix, "-", std::string(64, '0')));  // a key fits the stores
    sidecars_.push_back(std::move(sc));
  }
  start_threads();
}

void StorageController::start_threads() {
  // A cancel by an earlier stop() that interrupted no call is lifted (one that did leaves the
  // collective failed, and L3 off, with the reason).
  prefetch_collective_.resume();
  backup_collective_.resume();
  backup_thread_ = std::thread([this] { backup_loop(); });
  prefetch_thread_ = std::thread([this] { prefetch_loop(); });
  prefetch_io_thread_ = std::thread([this] { prefetch_io_loop(); });
  {
    MutexLock lock(touch_mu_);
    touch_stop_ = false;
  }
  touch_thread_ = std::thread([this] { touch_loop(); });
}

StorageController::~StorageController() { stop(); }

void StorageController::reset() {
  // Every queued backup and prefetch agreement runs first: the TP ranks queued the same ops (the
  // radix cache agrees on room before queuing), so their threads make the same collective calls
  // and are all idle, between ops, when they are stopped.
  wait_until_idle();
  stop();
  // Acks of what stop() ended: the caller drops its view of those ops with them.
  std::vector<BackupAck> backups;
  drain_queue(backup_acks_, backups);
  std::vector<std::string> revokes;
  drain_queue(revokes_, revokes);
  backup_queue_.reset();
  prefetch_queue_.reset();
  prefetch_io_queue_.reset();
  {
    MutexLock lock(idle_mu_);
    outstanding_ = 0;
  }
  start_threads();
}

void StorageController::stop_when_idle() {
  wait_until_idle();
  stop();
}

void StorageController::stop() {
  backup_queue_.stop();
  prefetch_queue_.stop();
  prefetch_io_queue_.stop();
  // The ranks stop at the same step, but each takes its own queued ops off unrun: a thread that
  // already entered the collective of such an op would wait for peers that never come until the
  // timeout. Cancelling ends that call at once (the op is acked or finished with zero).
  prefetch_collective_.cancel("the storage controller stopped");
  backup_collective_.cancel("the storage controller stopped");
  if (backup_thread_.joinable()) backup_thread_.join();
  if (prefetch_thread_.joinable()) prefetch_thread_.join();
  if (prefetch_io_thread_.joinable()) prefetch_io_thread_.join();
  {
    MutexLock lock(touch_mu_);
    touch_stop_ = true;
    touches_.clear();  // hints: nothing waits for them
    touch_keys_ = 0;
  }
  touch_cv_.notify_all();
  if (touch_thread_.joinable()) touch_thread_.join();
  // Ops that never ran are over too: a later reset() (or wait_until_idle) must not wait for them.
  for (BackupOp& op : backup_queue_.drain()) {
    backup_acks_.enqueue(BackupAck{op.id, 0, static_cast<std::int64_t>(op.pages.size()) * page_size_,
                                   "stopped before the backup ran"});
    op_done();
  }
  for (PrefetchTask& t : prefetch_queue_.drain()) {
    revoke(*t.op);
    op_done();
  }
  for (PrefetchTask& t : prefetch_io_queue_.drain()) finish(*t.op);
  notify_events();
}

void StorageController::set_event_signal(std::shared_ptr<EventSignal> signal) {
  MutexLock lock(signal_mu_);
  signal_ = std::move(signal);
}

void StorageController::notify_events() {
  MutexLock lock(signal_mu_);
  if (signal_ != nullptr) signal_->notify();
}

// ---------------------------------------------------------------------------------------------
// Backup

std::optional<std::int64_t> StorageController::write_storage(
    std::span<const std::int64_t> host_slots, std::vector<std::string> keys,
    std::span<const SidecarPagesIo> sidecars) {
  BackupOp op;
  slots_to_pages(host_slots, static_cast<std::int32_t>(page_size_), host_.num_pages(),
                 "write_storage", op.pages);
  if (op.pages.size() != keys.size()) {
    throw InvalidArgument(str_cat("write_storage: ", op.pages.size(), " pages but ", keys.size(),
                                  " keys"));
  }
  for (const auto& k : keys) validate_key(k);
  std::vector<bool> seen(sidecars_.size(), false);
  for (const SidecarPagesIo& io : sidecars) {
    if (io.pool < 0 || static_cast<std::size_t>(io.pool) >= sidecars_.size() ||
        seen[static_cast<std::size_t>(io.pool)]) {
      throw InvalidArgument(str_cat("write_storage: sidecar pool ", io.pool, " is not one of the ",
                                    sidecars_.size(), " pools, or is given twice"));
    }
    seen[static_cast<std::size_t>(io.pool)] = true;
    const Sidecar& sc = sidecars_[static_cast<std::size_t>(io.pool)];
    BackupOp::Sidecar side{.pool = static_cast<std::size_t>(io.pool), .at = io.pages, .host_pages = {}};
    for (std::size_t k = 0; k < io.pages.size(); ++k) {
      if (io.pages[k] < 0 || io.pages[k] >= static_cast<std::int64_t>(op.pages.size()) ||
          (k > 0 && io.pages[k] <= io.pages[k - 1])) {
        throw InvalidArgument(str_cat("write_storage: sidecar pool ", io.pool, " page ",
                                      io.pages[k], " out of order or outside the op's ",
                                      op.pages.size(), " pages"));
      }
    }
    slots_to_pages(io.host_slots, sc.slots_per_page, sc.host->num_pages(),
                   "write_storage (sidecar)", side.host_pages);
    if (side.host_pages.size() != io.pages.size()) {
      throw InvalidArgument(str_cat("write_storage: sidecar pool ", io.pool, ": ",
                                    side.host_pages.size(), " host pages for ", io.pages.size(),
                                    " pages"));
    }
    if (!side.at.empty()) op.sidecars.push_back(std::move(side));
  }
  op.keys = std::move(keys);
  op.id = next_id_.fetch_add(1);
  const std::int64_t id = op.id;
  op_queued();
  if (backup_queue_.push(std::move(op)) != PushResult::kOk) {
    op_done();
    return std::nullopt;
  }
  return id;
}

void StorageController::touch(std::vector<std::string> keys) {
  if (keys.empty()) return;
  for (const auto& k : keys) validate_key(k);
  const std::size_t n = keys.size();
  {
    MutexLock lock(touch_mu_);
    if (touch_stop_ || touch_keys_ + n > kMaxPendingTouchKeys) {
      dropped_touch_keys_ += n;
      return;
    }
    touch_keys_ += n;
    touches_.push_back(std::move(keys));
  }
  touch_cv_.notify_one();
}

void StorageController::touch_loop() {
  std::vector<std::vector<std::string>> chains;
  while (true) {
    {
      MutexLock lock(touch_mu_);
      while (touches_.empty() && !touch_stop_) touch_mu_.wait(touch_cv_);
      if (touch_stop_) return;
      chains.swap(touches_);
      touch_keys_ = 0;
    }
    for (const auto& chain : chains) {
      try {
        storage_.touch(chain);
        touched_keys_ += chain.size();
      } catch (const std::exception& e) {  // a hint: the thread lives on, the keys are counted
        dropped_touch_keys_ += chain.size();
        ++failed_ops_;
        std::fprintf(stderr, "[hicache] storage touch failed: %s\n", e.what());
      }
    }
    chains.clear();
  }
}

std::size_t StorageController::drain_backup_acks(std::vector<BackupAck>& out) {
  return drain_queue(backup_acks_, out);
}

void StorageController::backup_loop() {
  while (auto op = backup_queue_.pop()) {
    BackupAck ack = run_backup(*op);
    ++(ack.error.empty() ? backups_ok_ : backups_failed_);
    backup_latency_.observe(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - op->submitted).count());
    backup_acks_.enqueue(std::move(ack));
    notify_events();
    op_done();
  }
}

void StorageController::op_queued() {
  MutexLock lock(idle_mu_);
  ++outstanding_;
}

void StorageController::op_done() {
  MutexLock lock(idle_mu_);
  if (--outstanding_ == 0) idle_cv_.notify_all();
}

void StorageController::wait_until_idle() {
  MutexLock lock(idle_mu_);
  while (outstanding_ != 0) idle_mu_.wait(idle_cv_);
}

BackupAck StorageController::run_backup(const BackupOp& op) {
  const auto total_pages = static_cast<std::int64_t>(op.pages.size());
  BackupAck ack{op.id, 0, total_pages * page_size_, {}};
  // Ranks other than 0 under MLA store no KV and agree with the whole op (their sidecar pages,
  // their own shard, they do store).
  std::int64_t stored = total_pages;
  if (!config_.mla || backup_collective_.rank() == 0) {
    stored = 0;
    try {
      const auto batch = static_cast<std::size_t>(batch_pages_);
      for (std::size_t begin = 0; begin < op.pages.size(); begin += batch) {
        const std::size_t end = std::min(op.pages.size(), begin + batch);
        const std::int64_t ok = write_batch(op, begin, end, ack.error);
        stored += ok;
        if (ok != static_cast<std::int64_t>(end - begin)) break;  // the first failure ends it
      }
    } catch (const std::exception& e) {
      ++failed_ops_;
      ack.error = str_cat("backup failed: ", e.what());
    }
  }
  if (!op.sidecars.empty() && stored > 0) {
    try {
      stored = write_sidecars(op, stored, ack.error);
    } catch (const std::exception& e) {
      ++failed_ops_;
      ack.error = str_cat("sidecar backup failed: ", e.what());
      stored = 0;  // which of its pages are stored is unknown
    }
  }
  // Always reduce, whatever happened locally: a skipped call would hang the other ranks.
  std::int64_t agreed[1] = {stored * page_size_};
  if (const auto r = backup_collective_.min_allreduce(agreed, "backup.completed"); !r.ok) {
    ++failed_ops_;
    if (ack.error.empty()) ack.error = r.error;
  }
  ack.completed_tokens = agreed[0];
  return ack;
}

std::int64_t StorageController::write_batch(const BackupOp& op, std::size_t begin,
                                            std::size_t end, std::string& error) {
  const std::size_t n = end - begin;
  const auto page_bytes = static_cast<std::size_t>(host_.geometry().page_bytes());
  std::vector<ConstByteSpan> spans(n);
  if (!host_.has_contiguous_pages() && staging_.size() < n * page_bytes) {
    staging_.resize(n * page_bytes);
  }
  for (std::size_t i = 0; i < n; ++i) {
    const std::int64_t page = op.pages[begin + i];
    if (host_.has_contiguous_pages()) {
      spans[i] = host_.page_bytes(page);
    } else {
      std::span<std::byte> slot(staging_.data() + i * page_bytes, page_bytes);
      host_.copy_page_out(page, slot);
      spans[i] = slot;
    }
  }
  const auto t0 = std::chrono::steady_clock::now();
  const auto results = storage_.batch_set(
      std::span<const std::string>(op.keys).subspan(begin, n), spans);
  const auto ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0)
          .count();
  std::int64_t ok = 0;
  while (ok < static_cast<std::int64_t>(n) && results[ok].is_ok()) ++ok;
  written_bytes_ += ok * static_cast<std::int64_t>(page_bytes);
  if (ok > 0) {
    write_ns_ += static_cast<std::int64_t>(ns);
    ++write_calls_;
  }
  backup_batch_pages_.observe(static_cast<double>(n));
  if (ok > 0 && ns > 0) {  // bytes per nanosecond: GB/s
    backup_gbps_.observe(static_cast<double>(ok) * static_cast<double>(page_bytes) /
                         static_cast<double>(ns));
  }
  if (ok < static_cast<std::int64_t>(n)) {
    error = str_cat("page ", begin + ok, " (key '", op.keys[begin + ok], "'): ",
                    to_string(results[ok].status), " ", results[ok].reason);
  }
  return ok;
}

// ---------------------------------------------------------------------------------------------
// Prefetch

std::shared_ptr<PrefetchOperation> StorageController::prefetch(
    std::string request_id, std::span<const std::int32_t> tokens,
    std::optional<PageDigest> prior) {
  if (request_id.empty()) throw InvalidArgument("prefetch: empty request id");
  if (!sidecars_.empty()) {
    throw InvalidArgument(str_cat("prefetch: ", sidecars_.size(),
                                  " sidecar pools need the caller's reservation (prefetch_into)"));
  }
  return queue_prefetch(std::make_shared<PrefetchOperation>(
      std::move(request_id), std::vector<std::int32_t>(tokens.begin(), tokens.end()), prior,
      page_size_));
}

std::shared_ptr<PrefetchOperation> StorageController::prefetch_into(
    std::string request_id, std::span<const std::int32_t> tokens, std::optional<PageDigest> prior,
    std::span<const std::int64_t> host_slots, std::span<const SidecarPagesIo> sidecars) {
  if (request_id.empty()) throw InvalidArgument("prefetch_into: empty request id");
  const auto pages = static_cast<std::int64_t>(tokens.size()) / page_size_;
  if (static_cast<std::int64_t>(host_slots.size()) < pages * page_size_) {
    throw InvalidArgument(str_cat("prefetch_into: ", host_slots.size(), " host slots for ", pages,
                                  " whole pages of ", page_size_, " tokens"));
  }
  if (sidecars.size() != sidecars_.size()) {
    throw InvalidArgument(str_cat("prefetch_into: ", sidecars.size(), " sidecar reservations for ",
                                  sidecars_.size(), " sidecar pools"));
  }
  std::vector<PrefetchOperation::SidecarFetch> fetch(sidecars_.size());
  std::vector<bool> seen(sidecars_.size(), false);
  for (const SidecarPagesIo& io : sidecars) {
    const std::int64_t want = sidecar_reserve_pages(io.pool, pages);  // throws for a bad pool
    const auto i = static_cast<std::size_t>(io.pool);
    if (seen[i]) throw InvalidArgument(str_cat("prefetch_into: sidecar pool ", io.pool, " twice"));
    seen[i] = true;
    if (io.host_slots.empty()) continue;  // not reserved on this rank: no hit here
    std::vector<std::int64_t> held;
    slots_to_pages(io.host_slots, sidecars_[i].slots_per_page, sidecars_[i].host->num_pages(),
                   "prefetch_into (sidecar)", held);
    if (static_cast<std::int64_t>(held.size()) != want) {
      throw InvalidArgument(str_cat("prefetch_into: sidecar pool ", io.pool, ": ", held.size(),
                                    " host pages reserved for ", want));
    }
    sidecars_[i].host->require_state(io.host_slots, PageState::kReserved, "prefetch_into");
    fetch[i].reserved.assign(io.host_slots.begin(), io.host_slots.end());
  }
  host_.require_state(host_slots, PageState::kReserved, "prefetch_into");
  auto op = std::make_shared<PrefetchOperation>(
      std::move(request_id), std::vector<std::int32_t>(tokens.begin(), tokens.end()), prior,
      page_size_);
  op->slots_.assign(host_slots.begin(), host_slots.end());
  op->sidecars_ = std::move(fetch);
  op->caller_slots_ = true;
  auto queued = queue_prefetch(op);
  if (queued == nullptr) {  // still the caller's
    op->slots_.clear();
    op->sidecars_.clear();
  }
  return queued;
}

std::shared_ptr<PrefetchOperation> StorageController::queue_prefetch(
    std::shared_ptr<PrefetchOperation> op) {
  op_queued();
  ++prefetches_;
  if (prefetch_queue_.push(PrefetchTask{0, op}) != PushResult::kOk) {
    op_done();
    return nullptr;
  }
  return op;
}

std::int64_t StorageController::query_hit(std::span<const std::string> keys,
                                         std::vector<std::vector<std::uint8_t>>& held) {
  const auto hit_pages = static_cast<std::int64_t>(storage_.batch_exists(keys));
  std::vector<std::string> side;
  for (std::size_t p = 0; p < sidecars_.size() && hit_pages > 0; ++p) {
    side.clear();
    for (std::int64_t i = 0; i < hit_pages; ++i) {
      side.push_back(sidecar_key(p, keys[static_cast<std::size_t>(i)]));
    }
    const std::vector<bool> present = storage_.exists_each(side);
    held[p].assign(present.begin(), present.end());
  }
  return hit_pages;
}

std::int64_t StorageController::held_pages(std::span<const std::string> keys) {
  std::vector<std::vector<std::uint8_t>> held(sidecars_.size());
  std::int64_t hit_pages = 0;
  try {
    hit_pages = query_hit(keys, held);
  } catch (const std::exception&) {
    ++failed_ops_;
    return 0;
  }
  if (sidecars_.empty()) return hit_pages;
  RestorablePrefix restorable;
  restorable.reset(std::min<std::int64_t>(hit_pages, static_cast<std::int64_t>(keys.size())),
                   static_cast<std::int64_t>(keys.size()));
  for (std::size_t p = 0; p < sidecars_.size(); ++p) {
    restorable.intersect(sidecars_[p].policy, sidecars_[p].window, held[p]);
  }
  return restorable.largest();
}

std::size_t StorageController::drain_revokes(std::vector<std::string>& out) {
  return drain_queue(revokes_, out);
}

void StorageController::prefetch_loop() {
  while (auto task = prefetch_queue_.pop()) {
    agree_and_reserve(task->op);
    op_done();
  }
}

void StorageController::agree_and_reserve(const std::shared_ptr<PrefetchOperation>& handle) {
  PrefetchOperation& op = *handle;
  // Phase 1: the hit. Local failures become a zero hit; the reduction always runs.
  std::int64_t hit_pages = 0;
  // Per sidecar pool: which pages of the KV hit L3 holds (none where the query failed).
  std::vector<std::vector<std::uint8_t>> held(sidecars_.size());
  try {
    keyer_.keys(op.tokens_, op.prior_ ? &*op.prior_ : nullptr, op.keys_);
    // A sidecar pool without a reservation on this rank: no hit here (no query either).
    const bool reserved = std::none_of(op.sidecars_.begin(), op.sidecars_.end(),
                                       [](const auto& f) { return f.reserved.empty(); });
    if (reserved) hit_pages = query_hit(op.keys_, held);
  } catch (const std::exception& e) {
    ++failed_ops_;
    op.set_error(str_cat("prefetch hit query failed: ", e.what()));
  }
  std::int64_t agreed_hit[1] = {hit_pages};
  if (sidecars_.empty()) {
    if (!prefetch_collective_.min_allreduce(agreed_hit, "prefetch.hit").ok) ++failed_ops_;
  } else {
    // The longest prefix every pool of every rank restores: the ranks intersect their sets of
    // restorable lengths (a trailing pool's have gaps), in one call (several past
    // kCollectiveMaxValues pages: RestorablePrefix::agree).
    RestorablePrefix restorable;
    restorable.reset(std::min<std::int64_t>(hit_pages, static_cast<std::int64_t>(op.keys_.size())),
                     static_cast<std::int64_t>(op.tokens_.size()) / page_size_);
    for (std::size_t p = 0; p < sidecars_.size(); ++p) {
      restorable.intersect(sidecars_[p].policy, sidecars_[p].window, held[p]);
    }
    if (!restorable.agree(prefetch_collective_, "prefetch.restorable")) ++failed_ops_;
    agreed_hit[0] = restorable.largest();
  }
  const std::int64_t hit_tokens = std::max<std::int64_t>(agreed_hit[0], 0) * page_size_;
  hit_tokens_ += hit_tokens;
  if (hit_tokens < config_.prefetch_threshold_tokens) {
    ++(hit_tokens == 0 ? revoked_full_miss_ : revoked_insufficient_);
    unfulfilled_below_threshold_ += hit_tokens;
    revoke(op);
    return;
  }
  // Phase 2: every rank reserves exactly the agreed hit (budget, then host pages), then the
  // ranks agree on what all of them got.
  const std::int64_t want = agreed_hit[0] * page_size_;
  std::int64_t got = 0;
  try {
    if (op.caller_slots_) {  // reserved by the caller, at least one page per page of tokens
      got = agreed_hit[0];
    } else if (op.budget_ = BudgetCredit::take(budget_used_, want, config_.prefetch_budget_tokens);
               op.budget_.tokens() == want) {
      if (host_.alloc(want, op.slots_)) {
        got = agreed_hit[0];
      } else {
        op.budget_.release();
      }
    }
  } catch (const std::exception& e) {
    ++failed_ops_;
    op.set_error(str_cat("prefetch reservation failed: ", e.what()));
  }
  std::int64_t agreed_got[1] = {got};
  // The caller's slots hold the hit on every rank (each rank queued the same op the same way):
  // nothing to agree on, and no call on any rank.
  if (!op.caller_slots_ && !prefetch_collective_.min_allreduce(agreed_got, "prefetch.reserve").ok) {
    ++failed_ops_;
  }
  if (agreed_got[0] < agreed_hit[0]) {  // some rank is short: abort everywhere
    if (!op.caller_slots_) {
      if (!op.slots_.empty()) host_.free(op.slots_);
      op.slots_.clear();
    }
    op.budget_.release();
    ++revoked_host_capacity_;
    unfulfilled_host_capacity_ += want;
    revoke(op);
    return;
  }
  op.keys_.resize(static_cast<std::size_t>(agreed_hit[0]));
  // The sidecar pages that restore the hit: every page of an all_pages pool, the window before
  // the hit's end of a trailing one, each into the next page of the pool's reservation.
  for (std::size_t p = 0; p < op.sidecars_.size(); ++p) {
    PrefetchOperation::SidecarFetch& f = op.sidecars_[p];
    const Sidecar& sc = sidecars_[p];
    const std::int64_t from = sc.policy == SidecarHitPolicy::kAllPages
                                  ? 0
                                  : std::max<std::int64_t>(0, agreed_hit[0] - sc.window);
    for (std::int64_t page = from; page < agreed_hit[0]; ++page) {
      f.at.push_back(page);
      f.host_pages.push_back(f.reserved[static_cast<std::size_t>((page - from) * sc.slots_per_page)] /
                             sc.slots_per_page);
    }
    f.landed.assign(f.at.size(), 0);
  }
  op.hit_pages_ = agreed_hit[0];
  {
    MutexLock lock(op.mu_);
    op.stage_ = PrefetchStage::kLoading;
  }
  op.cv_.notify_all();
  notify_events();
  // Never blocks: terminate_prefetch on the main loop may be waiting for this thread to reach
  // an op queued behind this one, so a backlogged I/O stage ends this prefetch instead.
  if (!prefetch_io_queue_.try_put(PrefetchTask{0, handle})) {
    finish(op);  // stopped or full: nothing is read, terminate frees the pages
  }
}

void StorageController::revoke(PrefetchOperation& op) {
  ++revoked_;
  revokes_.enqueue(op.request_id_);  // queued before the stage shows it, so a waiter finds it
  {
    MutexLock lock(op.mu_);
    op.stage_ = PrefetchStage::kRevoked;
  }
  op.cv_.notify_all();
  notify_events();
}

void StorageController::finish(PrefetchOperation& op) {
  {
    MutexLock lock(op.mu_);
    if (op.stage_ == PrefetchStage::kLoading) {
      op.stage_ = PrefetchStage::kFinished;
      if (!op.terminate_ && op.completed_pages_.load() == op.hit_pages_.load()) {
        op.io_done_at_ = std::chrono::steady_clock::now();  // every page landed
        op.io_done_.store(true, std::memory_order_release);
      }
    }
  }
  op.cv_.notify_all();
  notify_events();
}

void StorageController::prefetch_io_loop() {
  while (auto task = prefetch_io_queue_.get()) {
    PrefetchOperation& op = *task->op;
    bool skipped = false;
    {
      MutexLock lock(op.mu_);
      if (op.terminate_) {  // terminated (or cut) before it started: read nothing, touch nothing
        if (op.stage_ == PrefetchStage::kLoading) op.stage_ = PrefetchStage::kFinished;
        skipped = true;
      } else {
        op.worker_started_ = true;
      }
    }
    if (skipped) {
      op.cv_.notify_all();  // terminate_prefetch, on the main loop, waits for this itself
      notify_events();      // and a cut op's main loop waits for it to finish
      continue;
    }
    try {
      read_pages(op);
    } catch (const std::exception& e) {
      ++failed_ops_;
      op.set_error(str_cat("prefetch read failed: ", e.what()));
    }
    finish(op);
  }
}

void StorageController::read_pages(PrefetchOperation& op) {
  std::size_t pages = static_cast<std::size_t>(op.hit_pages_.load());
  const bool sidecars = !op.sidecars_.empty();
  if (sidecars) {
    read_sidecars(op);
    // Only the KV pages that the landed sidecar pages can restore are worth reading.
    pages = static_cast<std::size_t>(restorable_landed(op, op.hit_pages_.load()));
  }
  const auto page_bytes = static_cast<std::size_t>(host_.geometry().page_bytes());
  const std::span<const std::int64_t> all_slots(op.slots_);
  std::vector<ByteSpan> spans;
  for (std::size_t begin = 0, n = 0; begin < pages && !op.terminate_; begin += n) {
    n = std::min(pages - begin, static_cast<std::size_t>(read_pacer_ ? read_pacer_->next_pages()
                                                                      : batch_pages_));
    const auto slots = all_slots.subspan(begin * page_size_, n * page_size_);
    host_.protect_write(slots);
    std::size_t ok = 0;
    std::string error;
    try {
      spans.clear();
      if (!host_.has_contiguous_pages() && prefetch_staging_.size() < n * page_bytes) {
        prefetch_staging_.resize(n * page_bytes);
      }
      for (std::size_t i = 0; i < n; ++i) {
        const std::int64_t page = slots[i * page_size_] / page_size_;
        spans.push_back(host_.has_contiguous_pages()
                            ? host_.page_bytes(page)
                            : ByteSpan(prefetch_staging_.data() + i * page_bytes, page_bytes));
      }
      const auto t0 = std::chrono::steady_clock::now();
      const auto results = storage_.batch_get(
          std::span<const std::string>(op.keys_).subspan(begin, n), spans);
      const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                          std::chrono::steady_clock::now() - t0)
                          .count();
      while (ok < n && results[ok].is_ok()) ++ok;
      prefetch_batch_pages_.observe(static_cast<double>(n));
      if (read_pacer_ && ok == n) {
        read_pacer_->observe(static_cast<std::int64_t>(n), static_cast<double>(ns) * 1e-9);
      }
      if (ok > 0) {
        read_ns_ += static_cast<std::int64_t>(ns);
        read_bytes_ += static_cast<std::int64_t>(ok * page_bytes);
        ++read_calls_;
        if (ns > 0) {  // bytes per nanosecond: GB/s
          prefetch_gbps_.observe(static_cast<double>(ok * page_bytes) / static_cast<double>(ns));
        }
      }
      if (ok < n) {
        error = str_cat("page ", begin + ok, " (key '", op.keys_[begin + ok], "'): ",
                        to_string(results[ok].status), " ", results[ok].reason);
      }
      if (!host_.has_contiguous_pages()) {
        for (std::size_t i = 0; i < ok; ++i) {
          host_.copy_page_in(slots[i * page_size_] / page_size_, spans[i]);
        }
      }
    } catch (const std::exception& e) {
      ok = 0;
      error = e.what();
    }
    // Pages count as completed only now that their bytes are in host memory; with sidecar
    // pools, as far as the landed pages restore.
    if (ok > 0) host_.complete_io(slots.first(ok * page_size_), PageState::kBackup);
    if (ok < n) host_.abort_io(slots.subspan(ok * page_size_));
    if (sidecars) {
      op.completed_pages_ = restorable_landed(op, static_cast<std::int64_t>(begin + ok));
    } else {
      op.completed_pages_ += static_cast<std::int64_t>(ok);
    }
    if (ok < n) {
      MutexLock lock(op.mu_);
      op.error_ = std::move(error);
      break;
    }
  }
}

std::chrono::steady_clock::duration StorageController::prefetch_timeout(
    const PrefetchOperation& op) const {
  return std::min(config_.timeout_cap,
                  config_.timeout_base +
                      config_.timeout_per_page * std::max<std::int64_t>(op.hit_pages_.load(), 1));
}

std::optional<std::chrono::steady_clock::time_point> StorageController::terminate_deadline(
    const PrefetchOperation& op) const {
  const PrefetchStage stage = op.stage();
  if (config_.policy != PrefetchPolicy::kTimeout ||
      (stage != PrefetchStage::kQueued && stage != PrefetchStage::kLoading)) {
    return std::nullopt;
  }
  return op.queued_at_ + prefetch_timeout(op);
}

bool StorageController::can_terminate(const PrefetchOperation& op) const {
  const PrefetchStage stage = op.stage();
  const bool done = stage != PrefetchStage::kQueued && stage != PrefetchStage::kLoading;
  switch (config_.policy) {
    case PrefetchPolicy::kBestEffort: return true;
    case PrefetchPolicy::kWaitComplete: return done;
    case PrefetchPolicy::kTimeout: {
      if (done) return true;
      return std::chrono::steady_clock::now() - op.queued_at_ >= prefetch_timeout(op);
    }
  }
  return true;
}

PrefetchResult StorageController::terminate_prefetch(PrefetchOperation& op,
                                                     std::optional<std::int64_t> agreed_pages) {
  PrefetchStage stage;
  {
    MutexLock lock(op.mu_);
    if (op.stage_ == PrefetchStage::kTerminated) {
      throw StateError(str_cat("terminate_prefetch: request '", op.request_id_,
                               "' was terminated already"));
    }
    op.terminate_ = true;
    // Wait for the agreement (bounded by two collectives) and for the batch in flight.
    while (op.stage_ != PrefetchStage::kRevoked && op.stage_ != PrefetchStage::kFinished &&
           !(op.stage_ == PrefetchStage::kLoading && !op.worker_started_)) {
      op.mu_.wait(op.cv_);
    }
    stage = op.stage_;  // final but for kTerminated, set below
  }
  // A loading op the worker has not started yet will be skipped by it: from here on nothing
  // of the op is read. A revoked op holds nothing and makes no collective call (the revoke was
  // agreed by every rank); any other op's completed prefix is agreed by every rank, since all
  // terminate the same ops in the same order.
  PrefetchResult result;
  result.revoked = stage == PrefetchStage::kRevoked;
  if (result.revoked && op.caller_slots_ && !op.slots_.empty()) {
    host_.free(op.slots_);  // the caller's reservation, untouched
    op.slots_.clear();
  }
  if (result.revoked) free_sidecar_rest(op, {});
  if (!result.revoked) {
    std::int64_t completed[1] = {op.completed_pages_.load()};
    if (agreed_pages) {
      completed[0] = *agreed_pages;
    } else if (!main_collective_.min_allreduce(completed, "prefetch.terminate").ok) {
      ++failed_ops_;
    }
    const auto agreed = static_cast<std::size_t>(
        std::clamp<std::int64_t>(completed[0], 0, op.completed_pages_.load()));
    const std::span<const std::int64_t> slots(op.slots_);
    const std::size_t keep = agreed * static_cast<std::size_t>(page_size_);
    if (keep < slots.size()) host_.free(slots.subspan(keep));
    result.tokens = static_cast<std::int64_t>(keep);
    result.host_slots.assign(slots.begin(), slots.begin() + static_cast<std::ptrdiff_t>(keep));
    result.keys.assign(op.keys_.begin(), op.keys_.begin() + static_cast<std::ptrdiff_t>(agreed));
    // Each pool keeps its landed pages of the agreed prefix (those restore it: the agreed
    // length is restorable on every rank), the rest of its reservation is freed.
    for (std::size_t p = 0; p < op.sidecars_.size(); ++p) {
      const PrefetchOperation::SidecarFetch& f = op.sidecars_[p];
      const auto spp = static_cast<std::int64_t>(sidecars_[p].slots_per_page);
      SidecarPagesIo kept{.pool = static_cast<std::int32_t>(p), .pages = {}, .host_slots = {}};
      for (std::size_t k = 0; k < f.at.size(); ++k) {
        if (f.at[k] >= static_cast<std::int64_t>(agreed) || f.landed[k] == 0) continue;
        kept.pages.push_back(f.at[k]);
        for (std::int64_t i = 0; i < spp; ++i) kept.host_slots.push_back(f.host_pages[k] * spp + i);
      }
      if (!kept.pages.empty()) result.sidecars.push_back(std::move(kept));
    }
    free_sidecar_rest(op, result.sidecars);
    op.budget_.release();
    prefetched_pages_ += agreed;
    ++terminated_;
    const auto now = std::chrono::steady_clock::now();
    prefetch_latency_.observe(std::chrono::duration<double>(now - op.queued_at_).count());
    MutexLock lock(op.mu_);
    if (op.io_done_at_) {
      prefetch_confirm_latency_.observe(std::chrono::duration<double>(now - *op.io_done_at_).count());
    }
  }
  {
    MutexLock lock(op.mu_);
    op.stage_ = PrefetchStage::kTerminated;
  }
  op.cv_.notify_all();
  return result;
}

void StorageController::register_metrics(MetricsRegistry& registry, MetricLabels labels) {
  metrics_.attach(registry, std::move(labels));
  constexpr const char* kOps = "hicache_ops_total";
  constexpr const char* kOpsHelp = "Transfer ops acknowledged, by direction and outcome";
  metrics_.add(kOps, kOpsHelp, {{"direction", "l2_to_l3"}, {"outcome", "ok"}}, backups_ok_);
  metrics_.add(kOps, kOpsHelp, {{"direction", "l2_to_l3"}, {"outcome", "failed"}},
               backups_failed_);
  metrics_.add(kOps, kOpsHelp, {{"direction", "l3_to_l2"}, {"outcome", "ok"}}, terminated_);
  metrics_.add(kOps, kOpsHelp, {{"direction", "l3_to_l2"}, {"outcome", "revoked"}}, revoked_);
  metrics_.add("hicache_prefetches_total", "Prefetches submitted to the storage controller", {},
               prefetches_);
  metrics_.add("hicache_prefetched_pages_total",
               "Pages prefetches kept once terminated (the agreed completed prefix)", {},
               prefetched_pages_);
  constexpr const char* kBytes = "hicache_bytes_total";
  constexpr const char* kBytesHelp = "KV bytes moved between tiers, by direction";
  metrics_.add(kBytes, kBytesHelp, {{"direction", "l2_to_l3"}}, written_bytes_);
  metrics_.add(kBytes, kBytesHelp, {{"direction", "l3_to_l2"}}, read_bytes_);
  if (!sidecars_.empty()) {
    constexpr const char* kSide = "hicache_sidecar_bytes_total";
    constexpr const char* kSideHelp =
        "Sidecar pool bytes (a hybrid model's state) moved between tiers, by direction";
    metrics_.add(kSide, kSideHelp, {{"direction", "l2_to_l3"}}, sidecar_written_bytes_);
    metrics_.add(kSide, kSideHelp, {{"direction", "l3_to_l2"}}, sidecar_read_bytes_);
  }
  constexpr const char* kLatency = "hicache_op_latency_seconds";
  constexpr const char* kLatencyHelp = "Transfer op latency from submit to acknowledgement";
  metrics_.add(kLatency, kLatencyHelp, {{"direction", "l2_to_l3"}}, backup_latency_);
  metrics_.add(kLatency, kLatencyHelp, {{"direction", "l3_to_l2"}}, prefetch_latency_);
  metrics_.add("hicache_prefetch_confirm_seconds",
               "Time from a prefetch's last page landing in host memory to the cache taking its "
               "pages (terminate_prefetch), for prefetches that read their whole hit",
               {}, prefetch_confirm_latency_);
  constexpr const char* kTouch = "hicache_storage_touch_keys_total";
  constexpr const char* kTouchHelp =
      "Keys of the recency hints for L3 (chains the cache served or backed up), by result";
  metrics_.add(kTouch, kTouchHelp, {{"result", "passed"}}, touched_keys_);
  metrics_.add(kTouch, kTouchHelp, {{"result", "dropped"}}, dropped_touch_keys_);
  metrics_.add("hicache_storage_op_failures_total",
               "Storage ops that failed (I/O error, failed agreement, a thread's exception)", {},
               failed_ops_);
  metrics_.add_gauge_fn("hicache_queue_depth", "Ops waiting in a queue", {{"queue", "backup"}},
                        [this] { return static_cast<double>(backup_queue_.size()); });
  metrics_.add_gauge_fn("hicache_queue_depth", "Ops waiting in a queue", {{"queue", "prefetch"}},
                        [this] { return static_cast<double>(prefetch_queue_.size()); });
  // Whole pages move: bytes over the bytes of a token are tokens, exactly.
  const auto token_bytes = static_cast<double>(host_.geometry().token_bytes());
  metrics_.add_counter_fn(
      kTokensMetric, kTokensHelp, {{"direction", "l2_to_l3"}},
      [this, token_bytes] { return static_cast<double>(written_bytes_.value()) / token_bytes; });
  metrics_.add_counter_fn(
      kTokensMetric, kTokensHelp, {{"direction", "l3_to_l2"}},
      [this, token_bytes] { return static_cast<double>(read_bytes_.value()) / token_bytes; });
  constexpr const char* kPages = "hicache_storage_batch_pages";
  constexpr const char* kPagesHelp = "Pages asked of the store per call, by direction";
  metrics_.add(kPages, kPagesHelp, {{"direction", "l2_to_l3"}}, backup_batch_pages_);
  metrics_.add(kPages, kPagesHelp, {{"direction", "l3_to_l2"}}, prefetch_batch_pages_);
  constexpr const char* kGbps = "hicache_storage_batch_bandwidth_gbps";
  constexpr const char* kGbpsHelp =
      "GB/s (1e9 bytes/s) of the pages a store call moved, per call, by direction";
  metrics_.add(kGbps, kGbpsHelp, {{"direction", "l2_to_l3"}}, backup_gbps_);
  metrics_.add(kGbps, kGbpsHelp, {{"direction", "l3_to_l2"}}, prefetch_gbps_);
  metrics_.add("hicache_prefetch_hit_tokens_total",
               "Tokens of the L3 hits every rank agreed on (before the threshold)", {},
               hit_tokens_);
  metrics_.add(kPrefetchOutcomesMetric, kPrefetchOutcomesHelp,
               {{"outcome", "revoked_insufficient"}}, revoked_insufficient_);
  metrics_.add(kPrefetchOutcomesMetric, kPrefetchOutcomesHelp, {{"outcome", "revoked_full_miss"}},
               revoked_full_miss_);
  metrics_.add(kPrefetchOutcomesMetric, kPrefetchOutcomesHelp,
               {{"outcome", "revoked_host_capacity"}}, revoked_host_capacity_);
  metrics_.add(kPrefetchUnfulfilledMetric, kPrefetchUnfulfilledHelp,
               {{"reason", "below_threshold"}}, unfulfilled_below_threshold_);
  metrics_.add(kPrefetchUnfulfilledMetric, kPrefetchUnfulfilledHelp, {{"reason", "host_capacity"}},
               unfulfilled_host_capacity_);
}

}  // namespace hicache
