// FileStorage: one file per key under a root directory, on the local disk.
//
// - A record is written to <root>/.tmp/ and renamed into <root>/<key>, so a crash leaves the old
//   record, the new one or nothing, never a torn one. Durability "none" leaves flushing to the
//   kernel; "group_commit" makes a whole batch durable with one syncfs before the renames and
//   one after (an fsync per page caps a file tier at a few hundred pages/s, docs/design-notes.md).
// - An in-memory index (key -> record bytes, LRU order) answers batch_exists without touching the
//   disk. A clean close saves it as <root>/.index (checksummed); the next start loads it (about
//   1 s per million records), removes it durably before accepting a write, and checks its
//   records against the directory in the background (a record removed meanwhile is dropped; a
//   read of it before then is a miss). Without a valid snapshot (after a crash, or in shared
//   mode, which writes none) the index is rebuilt from the directory (oldest modification
//   first). Either way a restarted engine finds its pages again, and what a crash can lose is
//   what was not yet acknowledged.
// - capacity_bytes (0: unlimited) bounds the record bytes; a set that overflows it evicts least
//   recently used records. A batch's keys are a chain in prefix order (a page is reachable only
//   through the pages before it): after a get or set they are the youngest records, keys[0]
//   youngest of all, so the store evicts a chain's tail before its head; touch() orders a chain
//   the cache served from its other tiers the same way. Eviction renames a record into <root>/.trash/ (a fast metadata
//   operation) and a background thread unlinks it (an unlink costs a disk round trip). A
//   record that cannot be moved is dropped from the index, counted and skipped: the evictor never
//   wedges. A record larger than the whole capacity is refused, not thrashed. Eviction never
//   takes a key of the batch being written: what a batch reports stored is stored when it
//   returns (a batch larger than the capacity leaves the store over it until the next write).
// - A batch is worked on by io_threads threads: the caller and io_threads - 1 workers of a
//   Boost.Asio thread_pool (of io_threads threads, so concurrent batches find workers), each
//   taking the next key; a one-key batch runs in the caller. Disk full, permission denied or a removed directory are per-key errors, and the
//   store keeps serving what still works (the .tmp/ and .trash/ folders are recreated on demand).
//
// - Several processes (engine instances, the TP ranks of an MLA model) may use one root. Every
//   instance registers in <root>/.usage (a 32-byte file, mapped shared, and locked with
//   open-file-description locks, which a crash releases): byte 0's lock tells an instance
//   opened with "shared": false from the others, byte 1's tells whether a starting instance is
//   alone, and the file counts the root's record bytes, the live instances, and the records any
//   of them published and removed. An instance runs "shared" while another one is live (unless
//   the config says which: `shared`, below), and answers from its own index while it is alone.
//   Shared, each keeps its own index; a key its index lacks is looked up on disk (one fstatat)
//   and adopted, so a page another instance stored is found. A key found absent is remembered
//   (at most 64 Ki of them) until any other instance publishes a record: a repeated miss costs
//   a lookup in memory, not a disk query (the publication count is in .usage; no polling).
//   A key the index holds is confirmed on disk too (one fstatat) before exists or a put's
//   deduplication trusts it, unless no other instance removed a record since it was last found
//   there: another process may have evicted it. A record that vanished before or during a read
//   is a miss (also one removed by hand, which no instance counts).
//   The processes stay within one capacity together: with capacity_bytes,
//   the bytes of every record in the root are counted in .usage (a record is renamed in only
//   where no other process's is, so it is counted once), and a process evicts its own least
//   recently used records (written or adopted) while that sum is over the capacity (one whose
//   records are all pinned leaves it over until another writes); a start with no other
//   instance alive resets the counts to what its scan found. With the
//   capacity following the filesystem each keeps the reserve free, which bounds them together,
//   and each may grow to an equal share (the root's records plus the free space, less the
//   reserve, over the live instances counted in .usage): one below its share writes on into
//   half the reserve at most and those above it evict their own on their next write, so the
//   instance that filled the disk first does not keep it (while it sits idle, half the reserve
//   stays free). The filesystem is asked on every write then (one statvfs, under the store's
//   lock). An instance that died leaves the live count high (the survivors stay shared, with
//   smaller shares) until a start finds no other alive.
//   An adoption evicts like a write does, but never a key of the same call. The index snapshot
//   is written at close only by the last live instance (its lock on byte 1 proves it).
//
// - A write that meets ENOSPC although the store is within its capacity (another program filled
//   the disk) shrinks the capacity to what fits, evicts least recently used records down to it
//   (unlinked at once) and is tried once more.
//
// JSON: {"backend": "file", "root": "/path", "capacity_bytes": 0, "disk_reserve": 0.05,
//        "durability": "none", "io_threads": 4, "shared": <unset>}
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "storage/storage_backend.h"

namespace hicache {

enum class Durability { kNone, kGroupCommit };

struct FileStorageConfig {
  std::string root;
  // Record bytes the store keeps (least recently used evicted beyond). 0: follow the
  // filesystem: what is stored at start plus the free space, less disk_reserve of the
  // filesystem's size (at least 1 MiB) left to everything else.
  std::uint64_t capacity_bytes = 0;
  double disk_reserve = 0.05;
  Durability durability = Durability::kNone;
  int io_threads = 4;
  // Whether other processes use the root. Unset (the default): detected, see above: shared
  // while another instance is live. true: always shared (a miss is asked of the disk even while
  // alone). false: this instance is the root's only user: it refuses to open beside a live
  // instance (IoError naming the root), and an instance started beside it refuses likewise.
  std::optional<bool> shared;

  // The keys of the JSON object (from_json_text refuses any other; tests hold a row per key).
  static constexpr std::array<std::string_view, 7> kJsonKeys = {
      "backend", "root", "capacity_bytes", "disk_reserve", "durability", "io_threads", "shared"};

  // Throws InvalidArgument naming an unknown field or a bad value, listing the valid fields.
  static FileStorageConfig from_json_text(std::string_view json_text);
};

class FileStorage final : public StorageBackend {
 public:
  // Creates the root (and parents) when missing; throws InvalidArgument naming the root when it
  // cannot be created or is not a directory.
  explicit FileStorage(FileStorageConfig config);
  ~FileStorage() override;

  std::string_view name() const override { return "file"; }
  std::size_t batch_exists(std::span<const std::string> keys) override;
  // From the index (a record another instance published: one fstatat, remembered).
  bool exists_without_io() const override { return true; }
  // This instance's LRU order (StorageBackend::touch); a batch_get or batch_set leaves its keys
  // in the same order, keys[0] youngest.
  void touch(std::span<const std::string> keys) override;
  bool remove(const std::string& key) override;
  void clear() override;

  // The default's 64 MiB per call, but at most a quarter of the capacity: a batch's own records
  // are never evicted for it, so a batch near the capacity could not make room.
  std::int64_t preferred_batch_pages(std::int64_t page_bytes) const override;

  // Waits until the background thread has unlinked every evicted or removed record.
  void flush_trash();
  // True when this store started from the index snapshot of a clean close (not a scan).
  bool started_from_snapshot() const;
  const FileStorageConfig& config() const { return config_; }

 protected:
  std::vector<IoResult> do_batch_get(std::span<const std::string> keys,
                                     std::span<const ByteSpan> dst) override;
  std::vector<IoResult> do_batch_set(std::span<const std::string> keys,
                                     std::span<const ConstByteSpan> src) override;
  void fill_gauges(StorageStats& stats) const override;

 private:
  class Impl;
  FileStorageConfig config_;
  std::unique_ptr<Impl> impl_;
};

std::unique_ptr<StorageBackend> make_file_storage(std::string_view json_text);

}  // namespace hicache
