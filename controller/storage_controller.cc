#include "controller/storage_controller.h"

#include <algorithm>

#include "pools/paged_token_allocator.h"
#include "storage/page_key.h"
#include "transfer/errors.h"

namespace hicache {

StorageController::StorageController(HostKVPool& host, StorageBackend& storage,
                                     Collective& collective, StorageControllerConfig config)
    : host_(host), storage_(storage), collective_(collective), config_(config),
      page_size_(host.geometry().page_size), backup_queue_(config.queue_capacity) {
  if (config_.io_batch_pages < 1) {
    throw InvalidArgument(str_cat("storage controller: io_batch_pages ", config_.io_batch_pages,
                                  " < 1"));
  }
  if (config_.queue_capacity < 1) throw InvalidArgument("storage controller: queue_capacity 0");
  if (!host_.has_contiguous_pages()) {
    staging_.resize(static_cast<std::size_t>(host_.geometry().page_bytes() *
                                             config_.io_batch_pages));
  }
  backup_thread_ = std::thread([this] { backup_loop(); });
}

StorageController::~StorageController() { stop(); }

void StorageController::stop() {
  backup_queue_.stop();
  if (backup_thread_.joinable()) backup_thread_.join();
  for (BackupOp& op : backup_queue_.drain()) {
    backup_acks_.enqueue(BackupAck{op.id, 0, static_cast<std::int64_t>(op.pages.size()) * page_size_,
                                   "stopped before the backup ran"});
  }
}

std::optional<std::int64_t> StorageController::write_storage(
    std::span<const std::int64_t> host_slots, std::vector<std::string> keys) {
  BackupOp op;
  slots_to_pages(host_slots, static_cast<std::int32_t>(page_size_), host_.num_pages(),
                 "write_storage", op.pages);
  if (op.pages.size() != keys.size()) {
    throw InvalidArgument(str_cat("write_storage: ", op.pages.size(), " pages but ", keys.size(),
                                  " keys"));
  }
  for (const auto& k : keys) validate_key(k);
  op.keys = std::move(keys);
  op.id = next_id_.fetch_add(1);
  const std::int64_t id = op.id;
  if (backup_queue_.push(std::move(op)) != PushResult::kOk) return std::nullopt;
  return id;
}

std::size_t StorageController::drain_backup_acks(std::vector<BackupAck>& out) {
  BackupAck ack;
  std::size_t n = 0;
  while (backup_acks_.try_dequeue(ack)) {
    out.push_back(std::move(ack));
    ++n;
  }
  return n;
}

void StorageController::backup_loop() {
  while (auto op = backup_queue_.pop()) {
    BackupAck ack;
    try {
      ack = run_backup(*op);
    } catch (const std::exception& e) {
      // The op's collective may not have run on this rank: the collective then fails on the
      // others (divergence or timeout) and stays failed, which turns L3 off visibly everywhere.
      ++failed_ops_;
      ack = BackupAck{op->id, 0, static_cast<std::int64_t>(op->pages.size()) * page_size_,
                      str_cat("backup failed: ", e.what())};
    }
    backup_acks_.enqueue(std::move(ack));
  }
}

BackupAck StorageController::run_backup(const BackupOp& op) {
  const auto total_pages = static_cast<std::int64_t>(op.pages.size());
  BackupAck ack{op.id, 0, total_pages * page_size_, {}};
  std::int64_t stored = total_pages;  // ranks other than 0 under MLA store nothing and agree
  if (!config_.mla || collective_.rank() == 0) {
    stored = 0;
    const auto batch = static_cast<std::size_t>(config_.io_batch_pages);
    for (std::size_t begin = 0; begin < op.pages.size(); begin += batch) {
      const std::size_t end = std::min(op.pages.size(), begin + batch);
      const std::int64_t ok = write_batch(op, begin, end, ack.error);
      stored += ok;
      if (ok != static_cast<std::int64_t>(end - begin)) break;  // the first failure ends it
    }
  }
  std::int64_t agreed[1] = {stored * page_size_};
  if (const auto r = collective_.min_allreduce(agreed, "backup.completed"); !r.ok) {
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
  const auto results = storage_.batch_set(
      std::span<const std::string>(op.keys).subspan(begin, n), spans);
  std::int64_t ok = 0;
  while (ok < static_cast<std::int64_t>(n) && results[ok].is_ok()) ++ok;
  if (ok < static_cast<std::int64_t>(n)) {
    error = str_cat("page ", begin + ok, " (key '", op.keys[begin + ok], "'): ",
                    to_string(results[ok].status), " ", results[ok].reason);
  }
  return ok;
}

}  // namespace hicache
