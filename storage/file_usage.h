// FileUsage: <root>/.usage, what the file store instances on one root share (every instance
// opens it). Its counts, mapped shared, 8 bytes each:
//  kBytes        the bytes of every record in the root: each instance adds what it renames in
//                and takes off what it renames out, and, shared with capacity_bytes, evicts
//                while the sum is over the capacity;
//  kInstances    the live instances: more than one makes an instance without a "shared" key
//                shared;
//  kPublications the records all of them published: an instance's memory of absent keys holds
//                while the others' part of it stands still;
//  kRemovals     the records all of them took out of the root: an index entry found on disk
//                holds while the others' part of it stands still.
// Its locks are open-file-description locks (fcntl F_OFD_SETLK: one per open of the file, so
// two instances in one process exclude each other too; a crash releases them; a lock converts
// between read and write atomically):
//  byte 0, for life: a read lock by every instance, a write lock by one opened with
//    "shared": false, so neither kind opens beside the other;
//  byte 1: a starting instance tries a write lock. Granted, no other is live: it scans, sets
//    kBytes and kInstances to what it found (mending an instance that died between a rename
//    and its count, or died counted), then converts to a read lock held for life (settle()).
//    Refused, it waits for a read lock (a lone starter finishing its start), then scans and
//    adds itself to kInstances (its scan would undo the renames the others count meanwhile).
//    At close a conversion to a write lock that is granted proves the instance is the last one
//    live (last_at_close()).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>

namespace hicache {

class FileUsage {
 public:
  enum Count { kBytes = 0, kInstances = 1, kPublications = 2, kRemovals = 3 };

  // Opens <root>/.usage in the directory `root_fd` and takes this instance's locks. With
  // `exclusive` ("shared": false) only byte 0's write lock is taken and nothing is mapped
  // (exclusive() is true, at() must not be called). Throws IoError when the file cannot be
  // opened, sized or mapped, or when the root is held by a live instance of the other kind.
  static std::unique_ptr<FileUsage> open(int root_fd, const std::filesystem::path& root,
                                         bool exclusive);
  ~FileUsage();  // leaves kInstances if settle() counted it; closing the file drops the locks
  FileUsage(const FileUsage&) = delete;
  FileUsage& operator=(const FileUsage&) = delete;

  bool exclusive() const { return count_ == nullptr; }
  // The locks work on this filesystem (else an instance is never provably alone).
  bool locked() const { return locked_; }
  // No other instance was live at the start.
  bool alone() const { return alone_; }
  // A shared count. REQUIRES: !exclusive().
  std::atomic_ref<std::uint64_t> at(Count c) const { return std::atomic_ref(count_[c]); }
  // After this instance's scan found `scanned` bytes: alone, sets kBytes and kInstances and
  // keeps byte 1 as a read lock; else adds itself to kInstances.
  void settle(std::uint64_t scanned);
  // At close: whether this is the root's last live instance.
  bool last_at_close() const;
  // kInstances, at least 1.
  std::uint64_t instances() const;

 private:
  FileUsage() = default;
  static constexpr std::size_t kBytesOfFile = 32;

  int fd_ = -1;
  std::uint64_t* count_ = nullptr;
  bool locked_ = false;
  bool alone_ = false;
  bool counted_ = false;  // in kInstances
};

}  // namespace hicache
