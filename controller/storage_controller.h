// StorageController: the L2 <-> L3 half of the controller (shared/DESIGN.md, threads table).
// This file has the backup path; prefetch follows (issue 5).
//
// Backup: write_storage(host_slots, keys) queues an op; the backup thread writes it batch by
// batch (io_batch_pages pages per batch_set, zero-copy from host pages where the layout has
// contiguous pages, else through a reused staging buffer), stops at the first page that failed,
// min-reduces the completed tokens over the TP ranks, and acks (id, completed tokens): completed
// is exactly the prefix every rank has stored (the reference acks a failed backup as if it had
// worked). With MLA only rank 0 writes; the others take part in the reduction with the full
// length. The queue is FIFO: every rank must run the same ops in the same order, since each op
// makes one collective call.
//
// A backend that throws or a collective that fails never ends the thread: the op is acked with
// zero completed tokens and the reason, and failed_ops() counts it.
//
// The caller keeps the host pages alive and unchanged (locked in the radix tree) until the ack.
#pragma once

#include <concurrentqueue/concurrentqueue.h>

#include <atomic>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "pools/host_kv_pool.h"
#include "storage/collective.h"
#include "storage/storage_backend.h"
#include "transfer/op_queue.h"

namespace hicache {

struct StorageControllerConfig {
  std::int64_t io_batch_pages = 16;  // pages per storage call
  bool mla = false;                  // KV identical on every rank: rank 0 alone writes
  std::size_t queue_capacity = 1024;
};

struct BackupAck {
  std::int64_t id = 0;
  std::int64_t completed_tokens = 0;  // the stored prefix, agreed by every rank
  std::int64_t total_tokens = 0;
  std::string error;                  // why completed < total, when known on this rank
};

class StorageController {
 public:
  // Throws InvalidArgument naming a bad config value.
  StorageController(HostKVPool& host, StorageBackend& storage, Collective& collective,
                    StorageControllerConfig config = {});
  ~StorageController();
  StorageController(const StorageController&) = delete;
  StorageController& operator=(const StorageController&) = delete;

  // Queues the backup of the pages of `host_slots` (whole pages, in order) under `keys`, one per
  // page. Returns the op id, or nothing when the queue is full or stopped. Throws
  // InvalidArgument (nothing queued) when the slots are not whole pages of this pool or the
  // counts differ or a key is invalid.
  std::optional<std::int64_t> write_storage(std::span<const std::int64_t> host_slots,
                                            std::vector<std::string> keys);

  // Moves finished backups' acks into `out` (appends); never blocks.
  std::size_t drain_backup_acks(std::vector<BackupAck>& out);

  // Ops that ended in an exception (backend or collective failure), since construction.
  std::int64_t failed_ops() const { return failed_ops_.load(); }

  // Stops the thread promptly: queued ops are acked with zero completed tokens. Idempotent.
  void stop();

 private:
  struct BackupOp {
    std::int64_t priority = 0;  // always 0: FIFO
    std::int64_t id = 0;
    std::vector<std::int64_t> pages;
    std::vector<std::string> keys;
  };

  void backup_loop();
  BackupAck run_backup(const BackupOp& op);
  // Writes the pages [begin, end) of op; returns how many leading pages are stored.
  std::int64_t write_batch(const BackupOp& op, std::size_t begin, std::size_t end,
                           std::string& error);

  HostKVPool& host_;
  StorageBackend& storage_;
  Collective& collective_;
  StorageControllerConfig config_;
  std::int64_t page_size_;

  OpQueue<BackupOp> backup_queue_;
  moodycamel::ConcurrentQueue<BackupAck> backup_acks_;
  std::atomic<std::int64_t> next_id_{1};
  std::atomic<std::int64_t> failed_ops_{0};
  std::vector<std::byte> staging_;  // backup thread only
  std::thread backup_thread_;
};

}  // namespace hicache
