// FileTrash: a file store's trash folder and the thread that empties it. Evicted and removed
// records are renamed into the folder (cheap, and atomic against readers, which then miss) and
// unlinked in the background, so no caller waits for an unlink of a large file. Space that is
// queued but not yet unlinked is counted (pending_bytes), so that a capacity taken from the
// disk's free space does not evict twice for it. What is left in the folder at a close or a
// crash is queued again by the next store that opens the root (adopt_leftovers).
//
// Threads: every method may be called from any thread; start() and stop() once each, by the
// owner.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <filesystem>
#include <functional>
#include <thread>
#include <utility>

#include "transfer/mutex.h"

namespace hicache {

class FileTrash {
 public:
  // `dir`: the trash folder. `recreate_dirs`: called when the folder has vanished under a
  // move (the store recreates its working folders), before the move is tried once more.
  FileTrash(std::filesystem::path dir, std::function<void()> recreate_dirs);
  ~FileTrash();  // stop()
  FileTrash(const FileTrash&) = delete;
  FileTrash& operator=(const FileTrash&) = delete;

  // Queues what the folder holds now (left by an earlier close or crash; its size unknown).
  void adopt_leftovers();
  // Starts the thread that unlinks what is queued.
  void start();
  // Stops the thread after the unlink in progress; what is still queued stays in the folder
  // for the next start. Idempotent.
  void stop();

  // Moves `path` into the folder and queues it; `bytes` (its size, where known) counts in
  // pending_bytes() until it is unlinked. True when the file was moved or was gone already;
  // false when the rename failed otherwise (the file stays). `moved`: set when this call
  // took the file away (not when it was gone already).
  bool take(const std::filesystem::path& path, std::uint64_t bytes = 0, bool* moved = nullptr);
  // Blocks until everything queued so far has been unlinked (or stop()).
  void flush();
  const std::filesystem::path& dir() const { return dir_; }
  // Bytes queued and not unlinked yet: free space to come.
  std::uint64_t pending_bytes() const { return bytes_.load(std::memory_order_relaxed); }

 private:
  void push(std::filesystem::path to, std::uint64_t bytes);
  void loop();

  const std::filesystem::path dir_;
  const std::function<void()> recreate_dirs_;
  std::atomic<std::uint64_t> seq_{0};  // names in the folder: <pid>.<seq>
  Mutex mu_;
  std::condition_variable work_cv_, idle_cv_;
  // path, bytes (0: unknown)
  std::deque<std::pair<std::filesystem::path, std::uint64_t>> queue_ HICACHE_GUARDED_BY(mu_);
  std::atomic<std::uint64_t> bytes_{0};
  std::size_t pending_ HICACHE_GUARDED_BY(mu_) = 0;  // queued or being unlinked
  bool stop_ HICACHE_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace hicache
