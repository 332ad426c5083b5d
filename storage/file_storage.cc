#include "storage/file_storage.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <boost/asio/post.hpp>
#include <boost/asio/thread_pool.hpp>
#include <cerrno>
#include <cstring>
#include <exception>
#include <filesystem>
#include <latch>
#include <list>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "storage/file_index_snapshot.h"
#include "storage/file_trash.h"
#include "storage/file_usage.h"
#include "storage/page_key.h"
#include "storage/posix_file.h"
#include "storage/record.h"
#include "transfer/errors.h"
#include "transfer/mutex.h"

namespace hicache {

namespace fs = std::filesystem;

using posix_file::errno_text;
using posix_file::Fd;
using posix_file::full_iov;

class FileStorage::Impl {
 public:
  Impl(FileStorage& owner, const FileStorageConfig& config)
      : owner_(owner), config_(config), root_(config.root), tmp_(root_ / ".tmp"),
        trash_(root_ / ".trash", [this] { ensure_dirs(); }) {
    std::error_code ec;
    fs::create_directories(root_, ec);
    if (!fs::is_directory(root_)) {
      throw IoError(str_cat("file storage: root '", config.root,
                            "' is not a directory and cannot be created",
                                    ec ? ": " + ec.message() : std::string()));
    }
    if (::access(root_.c_str(), R_OK | W_OK | X_OK) != 0) {
      throw IoError(errno_text("file storage: root not writable:", root_, errno));
    }
    ensure_dirs();
    root_fd_ = ::open(root_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (root_fd_ < 0) throw IoError(errno_text("file storage: open", root_, errno));
    // Before anything reads the directory: whether another instance is live (file_usage.h).
    try {
      open_usage();
    } catch (...) {
      ::close(root_fd_);
      throw;
    }
    if (usage_) {
      MutexLock lock(mu_);
      removals_at_open_ = foreign_removals_locked();
    }
    // Crash debris: records evicted but not yet unlinked, and half-written temporaries.
    // (Beside a live instance, its temporaries are its writes in progress; only those of
    // processes that are gone are debris.)
    trash_.adopt_leftovers();
    for (const auto& entry : fs::directory_iterator(tmp_, ec)) {
      if (alone_at_start() || !writer_alive(entry.path())) trash_.take(entry.path());
    }
    MappedIndexSnapshot snapshot;
    std::vector<std::string_view> unverified;  // into `snapshot`
    from_snapshot_ = load_snapshot(snapshot, unverified);
    if (!from_snapshot_) rebuild_index();
    if (usage_) usage_->settle(total_bytes_);
    {
      MutexLock lock(mu_);
      capacity_from_disk_ = config_.capacity_bytes == 0;
      capacity_ = capacity_from_disk_ ? disk_capacity_locked() : config_.capacity_bytes;
      evict_locked();
    }
    if (config_.io_threads > 0) {
      pool_ = std::make_unique<boost::asio::thread_pool>(static_cast<std::size_t>(config_.io_threads));
    }
    trash_.start();
    if (from_snapshot_) {  // also an empty snapshot: the directory may hold records it lacks
      // The views stay valid: the mapping moves with the thread.
      verify_thread_ = std::thread(
          [this, buf = std::move(snapshot), keys = std::move(unverified)] { verify(keys); });
    }
  }

  ~Impl() {
    if (pool_) pool_->join();
    verify_stop_.store(true, std::memory_order_relaxed);
    if (verify_thread_.joinable()) verify_thread_.join();
    // No call runs any more: the index is final. Only the root's last live instance writes a
    // snapshot (one beside live instances would describe a directory they go on changing).
    if (!usage_ || usage_->last_at_close()) write_snapshot();
    trash_.stop();  // what is left in .trash/ is unlinked at the next start
    ::close(root_fd_);
  }

  std::size_t exists(std::span<const std::string> keys) {
    MutexLock lock(mu_);
    std::size_t n = 0;
    bool adopted = false;
    for (; n < keys.size(); ++n) {
      if (indexed_locked(keys[n])) continue;
      if (!adopt_locked(keys[n])) break;
      adopted = true;
    }
    if (adopted) {
      // What was adopted counts against capacity_bytes; the keys just reported present stay.
      std::vector<Pin> pins;
      for (std::size_t i = 0; i < n; ++i) pin_locked(index_.find(keys[i]), pins);
      evict_locked();
      unpin_locked(pins);
    }
    return n;
  }

  // Whether the index holds `key`. Shared, the disk is asked too (one fstatat) unless no other
  // instance has removed a record since this one was last found there: another process may
  // have evicted it, and a stale entry would answer "stored" for a record that is gone (a
  // prefetch planned for nothing, a backup deduplicated and never written).
  // Alone again after another instance removed records (it was live for a while): those
  // records may still be in this index, so the same confirmation holds until each entry is found
  // on disk once; with nothing removed since this instance opened, the index is the truth.
  bool indexed_locked(const std::string& key) HICACHE_REQUIRES(mu_) {
    auto it = index_.find(key);
    if (it == index_.end()) return false;
    // Read before the disk is asked, as in adopt_locked: a removal after this read moves it.
    const std::uint64_t epoch = usage_ ? foreign_removals_locked() : kUnconfirmed;
    if (!shared_now() && (usage_ == nullptr || epoch == removals_at_open_)) return true;
    if (it->second.confirmed == epoch && epoch != kUnconfirmed) return true;
    struct stat st {};
    if (::fstatat(root_fd_, key.c_str(), &st, 0) == 0) {
      it->second.confirmed = epoch;
      return true;
    }
    unindex_locked(it);
    return false;
  }

  // Shared: a record another process wrote since the index was built is indexed when first
  // asked for (one fstatat). A key found absent is remembered until another instance publishes
  // a record (absent_). The caller then evicts for it (evict_locked), keeping the keys it is
  // answering for.
  bool adopt_locked(const std::string& key) HICACHE_REQUIRES(mu_) {
    if (!shared_now()) return false;
    if (usage_ == nullptr) return adopt_from_disk_locked(key);
    // Read before the disk is asked: a record published after this read moves the count again
    // (its rename precedes its count), so what is remembered below is dropped before it is
    // trusted. A record published before it is renamed in already, and the fstatat finds it.
    const std::uint64_t epoch = foreign_publications_locked();
    if (epoch != absent_epoch_) {
      absent_.clear();
      absent_epoch_ = epoch;
    }
    if (absent_.contains(key)) return false;
    if (adopt_from_disk_locked(key)) return true;
    if (absent_.size() >= kMaxAbsent) absent_.clear();
    absent_.insert(key);
    return false;
  }

  // Indexes `key` when its record is on disk (one fstatat), whatever the sharing.
  bool adopt_from_disk_locked(const std::string& key) HICACHE_REQUIRES(mu_) {
    const std::uint64_t epoch = usage_ ? foreign_removals_locked() : kUnconfirmed;
    struct stat st {};
    if (::fstatat(root_fd_, key.c_str(), &st, 0) != 0 || !S_ISREG(st.st_mode)) return false;
    insert_locked(key, static_cast<std::uint64_t>(st.st_size))->second.confirmed = epoch;
    return true;
  }

  // Whether another instance may change the root now: "shared" in the config, or, unset,
  // another live instance counted in .usage (a load from the shared mapping, no system call).
  bool shared_now() const {
    if (config_.shared.has_value()) return *config_.shared;
    return usage_ == nullptr || !usage_->locked() || usage_->instances() > 1;
  }
  // Whether no other instance was live when this one started (one opened with "shared": false
  // made sure of it).
  bool alone_at_start() const { return usage_ == nullptr || usage_->alone(); }

  // Records the other instances published since this one opened (more precisely: every
  // publication counted in .usage less this instance's own; they are counted under mu_).
  std::uint64_t foreign_publications_locked() const HICACHE_REQUIRES(mu_) {
    return usage_->at(FileUsage::kPublications).load() - own_publications_;
  }
  // The same for records taken out of the root (evicted, removed, dropped as bad): an index entry
  // found on disk while it stood still (Entry::confirmed) is trusted without asking again.
  std::uint64_t foreign_removals_locked() const HICACHE_REQUIRES(mu_) {
    return usage_->at(FileUsage::kRemovals).load() - own_removals_;
  }

  std::vector<IoResult> get(std::span<const std::string> keys, std::span<const ByteSpan> dst) {
    std::vector<IoResult> results(keys.size());
    // Shared mode adopts records during the reads, and evicts for them: the batch's records stay
    // pinned until every read of it is done (their reads may not have started).
    std::vector<Pin> pins;
    if (shared_now()) {
      MutexLock lock(mu_);
      for (const std::string& key : keys) {
        if (auto it = index_.find(key); it != index_.end()) pin_locked(it, pins);
      }
    }
    Unpin unpin{*this, pins};
    fan_out(keys.size(), [&](std::size_t i) { results[i] = get_one(keys, i, dst[i], pins); });
    touch(keys);  // the workers took the keys in any order: the batch's chain order decides
    return results;
  }

  // StorageBackend::touch: from the tail to the head, each indexed key to the LRU's young end,
  // so keys[0] ends up the youngest. Returns the keys found.
  std::size_t touch(std::span<const std::string> keys) {
    MutexLock lock(mu_);
    std::size_t found = 0;
    for (std::size_t i = keys.size(); i-- > 0;) {
      if (auto it = index_.find(keys[i]); it != index_.end()) {
        lru_.splice(lru_.end(), lru_, it->second.lru);
        ++found;
      }
    }
    return found;
  }

  std::vector<IoResult> set(std::span<const std::string> keys, std::span<const ConstByteSpan> src) {
    const std::size_t n = keys.size();
    std::vector<IoResult> results(n);
    std::vector<fs::path> tmps(n);
    const bool group = config_.durability == Durability::kGroupCommit;
    // Every record this batch reports stored stays pinned (never evicted) until it returns.
    std::vector<Pin> pins;
    Unpin unpin{*this, pins};
    fan_out(n, [&](std::size_t i) {
      results[i] = write_one(keys, i, src[i], tmps[i], !group, pins);
    });
    if (group && std::any_of(tmps.begin(), tmps.end(), [](const fs::path& p) { return !p.empty(); })) {
      // Group commit: the payloads reach the disk before any rename makes them visible, and the
      // renames before the batch reports ok.
      const std::string sync_error = syncfs_root();
      for (std::size_t i = 0; i < n; ++i) {
        if (tmps[i].empty()) continue;
        if (!sync_error.empty()) {
          ::unlink(tmps[i].c_str());
          results[i] = IoResult::error(sync_error);
        } else {
          results[i] = publish(keys, i, tmps[i], record_head_bytes(keys[i]) + src[i].size(), pins);
        }
      }
      if (sync_error.empty()) {
        if (std::string again = syncfs_root(); !again.empty()) {
          for (auto& r : results) {
            if (r.is_ok()) r = IoResult::error(again);
          }
        }
      }
    }
    touch(keys);
    return results;
  }

  bool remove(const std::string& key) {
    MutexLock lock(mu_);
    auto it = index_.find(key);
    if (it == index_.end()) return false;
    drop_locked(it, /*count_eviction=*/false);
    ++owner_.counters_.removes;
    return true;
  }

  void clear() {
    MutexLock lock(mu_);
    while (!index_.empty()) {
      drop_locked(index_.begin(), false);
      ++owner_.counters_.removes;
    }
  }

  bool from_snapshot() const { return from_snapshot_; }

  void flush_trash() { trash_.flush(); }

  void gauges(StorageStats& s) const {
    MutexLock lock(mu_);
    s.stored_keys = index_.size();
    s.stored_bytes = total_bytes_;
    s.capacity_bytes = capacity_;
  }

  std::uint64_t capacity() const {
    MutexLock lock(mu_);
    return capacity_;
  }
  // The capacity a record of `bytes` is held against: a capacity that follows the filesystem
  // and has shrunk below it is asked again first (space may have come back).
  std::uint64_t capacity_for(std::uint64_t bytes) {
    MutexLock lock(mu_);
    if (capacity_from_disk_ && capacity_ != 0 && bytes > capacity_) {
      if (const std::uint64_t asked = disk_capacity_locked(); asked != 0) capacity_ = asked;
    }
    return capacity_;
  }

 private:
  struct Entry {
    std::uint64_t bytes;
    std::list<const std::string*>::iterator lru;
    std::uint64_t generation = 0;  // distinguishes a key re-inserted after it left the index
    std::uint32_t pins = 0;        // calls answering for this record now: never evicted
    // Shared: the other instances' removals counted when the record was last known on disk
    // (kUnconfirmed: never, e.g. indexed by the start's scan).
    std::uint64_t confirmed = kUnconfirmed;
  };
  static constexpr std::uint64_t kUnconfirmed = ~std::uint64_t{0};
  // A record a call pinned: unpinned when the call ends (if it is still the same record).
  struct Pin {
    std::string key;
    std::uint64_t generation;
  };
  // Unpins a call's records when it ends, however it ends.
  struct Unpin {
    Impl& impl;
    std::vector<Pin>& pins;
    ~Unpin() {
      if (pins.empty()) return;
      MutexLock lock(impl.mu_);
      impl.unpin_locked(pins);
    }
  };
  using Index = std::unordered_map<std::string, Entry>;

  // Runs fn(i) for i in [0, n): the calling thread and up to io_threads - 1 pool workers take
  // the next index in turn until none is left (one post per worker, not per key, and the
  // caller works instead of waiting: a prefetch of 256 x 256 KiB pages in batches of 64
  // through the storage controller went from 9.5 to 11.8 GB/s, hicache-storagebench).
  // Inline for one key or without a pool.
  template <typename Fn>
  void fan_out(std::size_t n, Fn&& fn) {
    if (n <= 1 || !pool_) {
      for (std::size_t i = 0; i < n; ++i) fn(i);
      return;
    }
    // get_one/write_one report failures as results; what still escapes (std::bad_alloc, a
    // throwing filesystem call) stops every thread taking keys and is rethrown here once no
    // helper touches this frame any more (batch_get/batch_set turn it into per-key errors).
    std::atomic<std::size_t> next{0};
    struct FirstError {
      Mutex mu;
      std::exception_ptr error HICACHE_GUARDED_BY(mu);
      // In a handler: keeps the exception being handled unless one is kept already.
      void keep_current() {
        MutexLock lock(mu);
        if (!error) error = std::current_exception();
      }
      // Reads without mu: called once every helper counted down the latch, which orders their
      // writes before this read.
      std::exception_ptr after_helpers() const HICACHE_NO_THREAD_SAFETY_ANALYSIS { return error; }
    } first_error;
    auto work = [&] {
      try {
        for (std::size_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) fn(i);
      } catch (...) {
        next.store(n, std::memory_order_relaxed);
        first_error.keep_current();
      }
    };
    const std::size_t helpers = std::min(n, static_cast<std::size_t>(config_.io_threads)) - 1;
    std::latch done(static_cast<std::ptrdiff_t>(helpers));
    std::size_t posted = 0;
    try {
      for (; posted < helpers; ++posted) {
        boost::asio::post(*pool_, [&] {
          work();
          done.count_down();
        });
      }
    } catch (...) {
      next.store(n, std::memory_order_relaxed);
      done.count_down(static_cast<std::ptrdiff_t>(helpers - posted));
      done.wait();
      throw;
    }
    work();
    done.wait();
    if (std::exception_ptr error = first_error.after_helpers()) std::rethrow_exception(error);
  }

  // Reads keys[i]; the batch's other keys are never evicted for an adoption here (their reads
  // may not have started).
  IoResult get_one(std::span<const std::string> keys, std::size_t i, ByteSpan dst,
                   std::vector<Pin>& pins) {
    const std::string& key = keys[i];
    const fs::path path = root_ / key;
    const std::uint64_t want = record_head_bytes(key) + dst.size();
    {
      MutexLock lock(mu_);
      auto it = index_.find(key);
      if (it == index_.end()) {
        if (!adopt_locked(key)) return IoResult::miss();
        it = index_.find(key);
        pin_locked(it, pins);
        evict_locked();
      }
      lru_.splice(lru_.end(), lru_, it->second.lru);
      if (const std::uint64_t stored = it->second.bytes; stored != want) {
        ++owner_.counters_.bad_records;
        drop_locked(it, false);
        return IoResult::miss(str_cat("bad record '", key, "' removed: record of ", stored,
                                      " bytes, expected ", want));
      }
    }
    Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (fd.fd < 0) {
      const int err = errno;
      if (err == ENOENT) {
        forget_if_same(key, nullptr);
        return IoResult::miss();
      }
      return IoResult::error(errno_text("open", path, err));
    }
    std::array<std::byte, record_head_bytes_for(kMaxKeyBytes)> head_buf;
    const std::size_t head_bytes = record_head_bytes(key);
    iovec iov[2] = {{head_buf.data(), head_bytes}, {dst.data(), dst.size()}};
    const ssize_t n = full_iov<false>(fd.fd, iov, 2);
    if (n < 0) return IoResult::error(errno_text("read", path, static_cast<int>(-n)));
    std::string bad;
    std::uint64_t checksum = 0;
    struct stat st {};
    // Always: forget_if_same below removes the record only when it is still this file (the
    // stress tool found a truncated record kept, and missed, forever without it).
    // A failed fstat says nothing about the record: an error, and the record is left alone (as a
    // bad record it could not be matched to its file, and would stay indexed and missed).
    if (::fstat(fd.fd, &st) != 0) return IoResult::error(errno_text("fstat", path, errno));
    if (static_cast<std::uint64_t>(n) < want) {
      bad = str_cat("truncated record: ", n, " of ", want, " bytes");
    } else if (static_cast<std::uint64_t>(st.st_size) != want) {
      bad = str_cat("record of ", st.st_size, " bytes, expected ", want);
    } else {
      bad = check_record_head(std::span(head_buf).first(head_bytes), key, dst.size(), &checksum);
      if (bad.empty()) bad = check_record_payload(dst, checksum);
    }
    if (bad.empty()) return IoResult::ok();
    ++owner_.counters_.bad_records;
    forget_if_same(key, &st);
    return IoResult::miss(str_cat("bad record '", key, "' removed: ", bad));
  }

  // Writes the record to a temporary file; publishes it at once unless the caller batches the
  // publication (group commit), in which case `tmp` keeps the temporary's path.
  IoResult write_one(std::span<const std::string> keys, std::size_t i, ConstByteSpan src,
                     fs::path& tmp, bool publish_now, std::vector<Pin>& pins) {
    const std::string& key = keys[i];
    const std::uint64_t bytes = record_head_bytes(key) + src.size();
    {
      MutexLock lock(mu_);
      if (indexed_locked(key)) {
        pin_locked(index_.find(key), pins);
        ++owner_.counters_.set_deduplicated;
        return IoResult::ok();
      }
    }
    if (const std::uint64_t cap = capacity_for(bytes); cap != 0 && bytes > cap) {
      return IoResult::error(str_cat("record '", key, "' of ", bytes,
                                     " bytes exceeds the store's capacity of ", cap, " bytes"));
    }
    std::array<std::byte, record_head_bytes_for(kMaxKeyBytes)> head_buf;
    const std::size_t head_bytes = record_head_bytes(key);
    encode_record_head(key, src, std::span(head_buf).first(head_bytes));
    fs::path path;
    int err = 0;
    for (int attempt = 0; attempt < 2; ++attempt) {
      // Not named after the key: a key of kMaxKeyBytes plus ".<pid>.<seq>" would pass the file
      // system's 255-byte name limit once seq_ grows.
      path = tmp_ / str_cat("w.", ::getpid(), ".", seq_.fetch_add(1));
      err = write_file(path, std::span(head_buf).first(head_bytes), src);
      // The disk is full although the store is within its capacity (another program filled
      // it): the capacity shrinks to what fits, older records make room, and the write is
      // tried once more.
      if (err != ENOSPC || attempt == 1) break;
      make_room_after_enospc(bytes);
    }
    if (err != 0) return IoResult::error(errno_text("write", path, err));
    if (!publish_now) {
      tmp = std::move(path);
      return IoResult::ok();
    }
    return publish(keys, i, path, bytes, pins);
  }

  // Writes head + payload to a new file at `path`; 0, or the errno (the file removed).
  int write_file(const fs::path& path, std::span<const std::byte> head, ConstByteSpan src) {
    int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0 && errno == ENOENT) {  // the directory was removed under us: recreate it
      ensure_dirs();
      fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    }
    if (fd < 0) return errno;
    iovec iov[2] = {{const_cast<std::byte*>(head.data()), head.size()},
                    {const_cast<std::byte*>(src.data()), src.size()}};
    const ssize_t n = full_iov<true>(fd, iov, 2);
    const int close_rc = ::close(fd);
    const int close_err = errno;
    if (n < 0 || static_cast<std::size_t>(n) != head.size() + src.size() || close_rc != 0) {
      ::unlink(path.c_str());
      return n < 0 ? static_cast<int>(-n) : close_rc != 0 ? close_err : ENOSPC;
    }
    return 0;
  }

  // ENOSPC within the capacity: the capacity becomes what is stored less room for the record
  // that did not fit and for each other write that may be in flight (io_threads of them; never
  // below one record), and no more than the filesystem now gives when the capacity follows it;
  // least recently used records are evicted down to it, and their files are unlinked before the
  // caller retries.
  void make_room_after_enospc(std::uint64_t bytes) {
    {
      MutexLock lock(mu_);
      const std::uint64_t room =
          bytes * static_cast<std::uint64_t>(std::max(1, config_.io_threads) + 1);
      const std::uint64_t used = used_locked();  // shared: the root's total, as evict counts
      const std::uint64_t fits = std::max(used > room ? used - room : 0, bytes);
      const std::uint64_t bound = capacity_from_disk_ ? disk_capacity_locked() : capacity_;
      // Never below the record that is retried: it is refused otherwise, not stored.
      capacity_ = std::max(bound == 0 ? fits : std::min(bound, fits), bytes);
      ++owner_.counters_.capacity_shrinks;
      evict_locked(/*recheck_disk=*/false);
    }
    flush_trash();
  }

  // capacity_bytes 0: what is stored plus the filesystem's free space, less a reserve of
  // disk_reserve of the filesystem (at least 1 MiB) left to everything else; at least 1 byte
  // (a filesystem already past its reserve leaves the store nothing). 0 (no bound) only when
  // the filesystem cannot be asked.
  std::uint64_t disk_capacity_locked() const HICACHE_REQUIRES(mu_) {
    struct statvfs v {};
    if (::fstatvfs(root_fd_, &v) != 0) return 0;
    const auto total = static_cast<double>(v.f_blocks) * static_cast<double>(v.f_frsize);
    const std::uint64_t free_bytes = static_cast<std::uint64_t>(v.f_bavail) * v.f_frsize;
    const auto reserve =
        std::max<std::uint64_t>(std::uint64_t{1} << 20,
                                static_cast<std::uint64_t>(config_.disk_reserve * total));
    // May be below what is stored: the store then evicts down to it. Records in the trash are
    // free space to come (the trash thread unlinks them): counting them as used would evict
    // far more than the disk needs whenever the thread lags.
    const std::uint64_t usable = total_bytes_ + free_bytes + trash_.pending_bytes();
    std::uint64_t capacity = usable > reserve ? usable - reserve : 1;
    if (usage_ && shared_now()) {
      // Shared: up to an equal share of what the root's records and the free space give (less
      // the reserve). Without it whoever filled the disk first would keep it: the others, held
      // to their own records plus a free space that stays at the reserve, could never grow. One
      // below its share writes on into half the reserve at most (never the whole disk: an
      // instance above its share may sit idle, and the share trusts counts a crash can leave
      // high); those above it give that back by evicting their own on their next write, until
      // the shares are even.
      const std::uint64_t root_usable =
          usage_->at(FileUsage::kBytes).load() + free_bytes + trash_.pending_bytes();
      if (root_usable > reserve && usable > reserve / 2) {
        const std::uint64_t share = (root_usable - reserve) / usage_->instances();
        capacity = std::max(capacity, std::min(share, usable - reserve / 2));
      }
    }
    return capacity;
  }

  // Renames a written temporary into place and indexes it, then evicts over capacity.
  // Eviction never takes a key of the same batch: a batch reports ok only for records that are
  // stored when it returns (one larger than the capacity leaves the store over it until the next
  // write).
  IoResult publish(std::span<const std::string> keys, std::size_t i, const fs::path& tmp,
                   std::uint64_t bytes, std::vector<Pin>& pins) {
    const std::string& key = keys[i];
    MutexLock lock(mu_);
    if (auto it = index_.find(key); it != index_.end()) {  // a concurrent writer got there first
      ::unlink(tmp.c_str());
      pin_locked(it, pins);
      ++owner_.counters_.set_deduplicated;
      return IoResult::ok();
    }
    const fs::path path = root_ / key;
    // Read before the rename: a removal by another instance after the rename moves it.
    const std::uint64_t epoch = usage_ ? foreign_removals_locked() : kUnconfirmed;
    // Beside other instances (or where they may come): never over another process's record (it
    // is counted once).
    int rc = usage_ != nullptr
                 ? ::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, path.c_str(), RENAME_NOREPLACE)
                 : ::rename(tmp.c_str(), path.c_str());
    if (rc != 0 && errno == EINVAL && usage_ != nullptr) {
      // A filesystem without RENAME_NOREPLACE (NFS): link() never replaces either.
      rc = ::link(tmp.c_str(), path.c_str());
      if (rc == 0) ::unlink(tmp.c_str());
    }
    if (rc != 0) {
      const int err = errno;
      ::unlink(tmp.c_str());
      if (err == EEXIST && adopt_from_disk_locked(key)) {  // another process stored it meanwhile
        pin_locked(index_.find(key), pins);
        ++owner_.counters_.set_deduplicated;
        evict_locked();
        return IoResult::ok();
      }
      return IoResult::error(errno_text("rename into", path, err));
    }
    if (usage_ != nullptr) {
      usage_->at(FileUsage::kBytes).fetch_add(bytes);
      // After the rename: another instance that sees the count moved finds the record.
      usage_->at(FileUsage::kPublications).fetch_add(1);
      ++own_publications_;
      absent_.erase(key);
    }
    auto at = insert_locked(key, bytes);
    at->second.confirmed = epoch;
    pin_locked(at, pins);
    ++owner_.counters_.set_written;
    owner_.counters_.bytes_written += bytes - record_head_bytes(key);
    evict_locked();
    return IoResult::ok();
  }

  Index::iterator insert_locked(std::string key, std::uint64_t bytes) HICACHE_REQUIRES(mu_) {
    auto [it, inserted] = index_.try_emplace(std::move(key), Entry{bytes, {}, 0, 0, kUnconfirmed});
    if (!inserted) return it;  // indexed already: its place and size stay
    it->second.lru = lru_.insert(lru_.end(), &it->first);
    it->second.generation = ++generation_;
    total_bytes_ += bytes;
    return it;
  }

  // Pins a record for the call that owns `pins` and makes it the most recently used: a call
  // that answers for a record (stored, already there, adopted) keeps it until it returns.
  void pin_locked(Index::iterator it, std::vector<Pin>& pins) HICACHE_REQUIRES(mu_) {
    ++it->second.pins;
    pins.push_back(Pin{it->first, it->second.generation});
    lru_.splice(lru_.end(), lru_, it->second.lru);
  }
  void unpin_locked(std::vector<Pin>& pins) HICACHE_REQUIRES(mu_) {
    for (const Pin& p : pins) {
      auto it = index_.find(p.key);
      if (it != index_.end() && it->second.generation == p.generation) --it->second.pins;
    }
    pins.clear();
  }

  // Evicts least recently used records until the total fits, never a pinned one. Pinned
  // records are the most recently used, so the walk from the oldest end meets few of them:
  // the cost is linear in what is evicted.
  void evict_locked(bool recheck_disk = true) HICACHE_REQUIRES(mu_) {
    // A capacity that follows the filesystem is asked again before anything is evicted: space
    // another program freed (or took) since moves it. Shared, it is asked on every write (one
    // statvfs): the other instances move it all the time, and one that kept the figure of its
    // start would hold the disk while they shrink.
    if (recheck_disk && capacity_from_disk_ && capacity_ != 0 &&
        (shared_now() || used_locked() > capacity_)) {
      // A filesystem that cannot be asked this time (0) leaves the capacity as it was: 0 would
      // mean no bound, and no later write would ask again.
      if (const std::uint64_t asked = disk_capacity_locked(); asked != 0) capacity_ = asked;
    }
    if (capacity_ == 0 || used_locked() <= capacity_) return;
    auto victim = lru_.begin();
    while (used_locked() > capacity_ && victim != lru_.end()) {
      auto it = index_.find(**victim++);
      if (it->second.pins > 0) continue;
      drop_locked(it, /*count_eviction=*/true);
    }
  }

  // Takes a record out of the index only (its file is gone already).
  // Every record leaving the index goes here: the removal observer hears of it.
  void unindex_locked(Index::iterator it) HICACHE_REQUIRES(mu_) {
    owner_.note_removed(std::span(&it->first, 1));
    total_bytes_ -= it->second.bytes;
    lru_.erase(it->second.lru);
    index_.erase(it);
  }

  // Takes a record out of the index and moves its file to the trash. A file that cannot be moved
  // is skipped and counted: it stays on disk, out of the index, until the next start sees it.
  void drop_locked(Index::iterator it, bool count_eviction) HICACHE_REQUIRES(mu_) {
    const fs::path path = root_ / it->first;
    const std::uint64_t bytes = it->second.bytes;
    unindex_locked(it);
    if (count_eviction) ++owner_.counters_.evictions;
    bool moved = false;
    if (!trash_.take(path, bytes, &moved) && count_eviction) {
      ++owner_.counters_.eviction_failures;
    }
    if (moved && usage_) {
      usage_->at(FileUsage::kBytes).fetch_sub(bytes);
      // After the rename, as publications are counted (see indexed_locked).
      usage_->at(FileUsage::kRemovals).fetch_add(1);
      ++own_removals_;
    }
  }

  // Remembered absent keys (absent_) at most; beyond, the memory starts over.
  static constexpr std::size_t kMaxAbsent = std::size_t{1} << 16;

  // Opens <root>/.usage (storage/file_usage.h): into usage_, or, for "shared": false, into
  // exclusive_ (its lock, no counts).
  void open_usage() {
    auto u = FileUsage::open(root_fd_, root_, /*exclusive=*/config_.shared == false);
    (u->exclusive() ? exclusive_ : usage_) = std::move(u);
  }
  // What the capacity bounds: the root's total (shared, with capacity_bytes) or this index's
  // (a capacity that follows the filesystem counts this index's records plus the free space).
  std::uint64_t used_locked() const HICACHE_REQUIRES(mu_) {
    return usage_ && !capacity_from_disk_ && shared_now() ? usage_->at(FileUsage::kBytes).load()
                                                           : total_bytes_;
  }

  // A bad record (`seen`: the file it was read from) or a vanished one (nullptr): drop it from
  // the index, and a bad one from the disk too, unless a writer replaced the file since (then the
  // new record stays). A record that vanished and is there again was written anew meanwhile
  // (evicted, then stored by another batch): it stays.
  void forget_if_same(const std::string& key, const struct stat* seen) {
    MutexLock lock(mu_);
    auto it = index_.find(key);
    if (it == index_.end()) return;
    struct stat now {};
    const fs::path path = root_ / key;
    if (::stat(path.c_str(), &now) != 0) {
      unindex_locked(it);
      return;
    }
    if (seen == nullptr || now.st_ino != seen->st_ino || now.st_dev != seen->st_dev) return;
    drop_locked(it, false);
  }

  // A temporary is named <key>.<pid>.<seq>: true when that process still runs.
  static bool writer_alive(const fs::path& tmp) {
    const std::string name = tmp.filename().string();
    const auto last = name.rfind('.');
    if (last == std::string::npos || last == 0) return false;
    const auto prev = name.rfind('.', last - 1);
    if (prev == std::string::npos) return false;
    const std::string digits = name.substr(prev + 1, last - prev - 1);
    if (digits.empty() || digits.find_first_not_of("0123456789") != std::string::npos ||
        digits.size() > 9) {
      return false;
    }
    const auto pid = static_cast<pid_t>(std::stol(digits));
    return pid > 0 && (::kill(pid, 0) == 0 || errno == EPERM);
  }

  void ensure_dirs() {
    std::error_code ec;
    fs::create_directories(tmp_, ec);
    fs::create_directories(trash_.dir(), ec);
  }

  std::string syncfs_root() {
    if (::syncfs(root_fd_) != 0) return errno_text("syncfs", root_, errno);
    return {};
  }

  // The index snapshot (storage/file_index_snapshot.h) lets a restart skip the directory scan.
  // It is written only at a clean close, and removed (durably) when the next store opens, before
  // it accepts a write: so a snapshot on disk always describes the directory as the last clean
  // close left it, and a crash (no snapshot) falls back to the full scan. Shared mode writes
  // none (other processes change the directory) and removes one it finds.
  void write_snapshot() {
    std::string data;
    {
      MutexLock lock(mu_);
      IndexSnapshotWriter w(lru_.size());
      for (const std::string* key : lru_) w.add(*key, index_.at(*key).bytes);
      data = w.finish();
    }
    publish_index_snapshot(data, tmp_ / str_cat(kIndexSnapshotName, ".", ::getpid(), ".0"),
                           root_fd_);
  }

  // Loads the snapshot into the index and removes it; false (and the index empty) when there
  // is none, it does not check, or it cannot be removed. `buf` keeps the snapshot and `keys`
  // its keys, to check against the directory in the background (verify).
  bool load_snapshot(MappedIndexSnapshot& buf, std::vector<std::string_view>& keys) {
    Fd fd(::openat(root_fd_, kIndexSnapshotName, O_RDONLY | O_CLOEXEC));
    if (fd.fd < 0) return false;
    // Removed first: from here on the directory changes, and a snapshot left behind would
    // describe it wrongly after a crash. (Not synced: after a power loss that undoes the
    // removal, the background check of the next start reconciles the stale snapshot.)
    if (::unlinkat(root_fd_, kIndexSnapshotName, 0) != 0) return false;
    if (!alone_at_start()) return false;
    struct stat st {};
    if (::fstat(fd.fd, &st) != 0 || st.st_size < 32) return false;
    // Mapped, not read: the page cache's pages serve it without a fresh page (and its fault,
    // 10-16 us per 4 KiB on these machines) per 4 KiB of index.
    if (!buf.map(fd.fd, static_cast<std::size_t>(st.st_size))) return false;
    IndexSnapshotReader reader;
    if (!reader.open(buf.data(), buf.size())) return false;
    MutexLock lock(mu_);
    index_.reserve(static_cast<std::size_t>(reader.count()));
    keys.reserve(static_cast<std::size_t>(reader.count()));
    for (std::uint64_t i = 0; i < reader.count(); ++i) {
      std::string_view key;
      std::uint64_t bytes = 0;
      if (!reader.next(key, bytes, kMaxKeyBytes) || bytes == 0 || !valid_key(key)) {
        return forget_snapshot_locked(keys);
      }
      const std::size_t before = index_.size();
      insert_locked(std::string(key), bytes);
      if (index_.size() == before) return forget_snapshot_locked(keys);  // a key twice: not a snapshot we wrote
      keys.push_back(key);
    }
    if (!reader.at_end()) return forget_snapshot_locked(keys);
    return true;
  }

  // Undoes a snapshot's partial load (see load_snapshot); false.
  bool forget_snapshot_locked(std::vector<std::string_view>& keys) HICACHE_REQUIRES(mu_) {
    while (!index_.empty()) unindex_locked(index_.begin());
    keys.clear();
    return false;
  }

  static bool valid_key(std::string_view key) {
    try {
      validate_key(key);
      return true;
    } catch (const InvalidArgument&) {
      return false;
    }
  }

  // Checks a loaded snapshot against the directory, off the start path: drops its records
  // whose files are gone (a read of one before then is a miss anyway), then indexes, as the
  // least recently used, records the snapshot lacks (only a power loss that undid a snapshot's
  // removal leaves such records: without this they would hold disk space the capacity never
  // counts). One stat per record, under the index lock one record at a time.
  void verify(const std::vector<std::string_view>& keys) {
    std::string key;
    for (std::string_view k : keys) {
      if (verify_stop_.load(std::memory_order_relaxed)) return;
      key.assign(k);
      forget_if_same(key, nullptr);
    }
    std::error_code ec;
    for (fs::directory_iterator it(root_, ec), end; !ec && it != end; it.increment(ec)) {
      if (verify_stop_.load(std::memory_order_relaxed)) return;
      key = it->path().filename().string();
      if (!valid_key(key)) continue;  // .tmp, .trash, foreign files
      MutexLock lock(mu_);
      struct stat st {};
      if (index_.count(key) != 0 || ::fstatat(root_fd_, key.c_str(), &st, 0) != 0 ||
          !S_ISREG(st.st_mode)) {
        continue;
      }
      auto at = insert_locked(key, static_cast<std::uint64_t>(st.st_size));
      // The start counted only the snapshot's records in .usage.
      if (usage_) usage_->at(FileUsage::kBytes).fetch_add(at->second.bytes);
      lru_.splice(lru_.begin(), lru_, at->second.lru);
      evict_locked();
    }
  }

  void rebuild_index() {
    struct Found {
      std::string key;
      std::uint64_t bytes;
      timespec mtime;
    };
    std::vector<Found> found;
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(root_, ec)) {
      std::string name = entry.path().filename().string();
      try {
        validate_key(name);
      } catch (const InvalidArgument&) {
        continue;  // .tmp, .trash, foreign files
      }
      struct stat st {};
      if (::stat(entry.path().c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
      found.push_back({std::move(name), static_cast<std::uint64_t>(st.st_size), st.st_mtim});
    }
    std::sort(found.begin(), found.end(), [](const Found& a, const Found& b) {
      return std::tie(a.mtime.tv_sec, a.mtime.tv_nsec) < std::tie(b.mtime.tv_sec, b.mtime.tv_nsec);
    });
    MutexLock lock(mu_);
    for (auto& f : found) insert_locked(f.key, f.bytes);
  }

  FileStorage& owner_;
  const FileStorageConfig& config_;
  const fs::path root_, tmp_;
  int root_fd_ = -1;
  std::atomic<std::uint64_t> seq_{0};

  mutable Mutex mu_;
  Index index_ HICACHE_GUARDED_BY(mu_);
  // index_'s keys; front: least recently used
  std::list<const std::string*> lru_ HICACHE_GUARDED_BY(mu_);
  std::uint64_t generation_ HICACHE_GUARDED_BY(mu_) = 0;
  std::uint64_t capacity_ HICACHE_GUARDED_BY(mu_) = 0;  // 0: no bound
  bool capacity_from_disk_ HICACHE_GUARDED_BY(mu_) = false;
  std::uint64_t total_bytes_ HICACHE_GUARDED_BY(mu_) = 0;

  std::unique_ptr<boost::asio::thread_pool> pool_;

  FileTrash trash_;  // <root>/.trash: evicted and removed records, unlinked in the background
  bool from_snapshot_ = false;
  std::unique_ptr<FileUsage> usage_;      // <root>/.usage, mapped (none with "shared": false)
  std::unique_ptr<FileUsage> exclusive_;  // "shared": false: its lock on .usage, no counts
  // Shared: keys found absent on disk while the other instances' publications stood at
  // absent_epoch_ (see adopt_locked); own_publications_: this instance's part of that count.
  std::unordered_set<std::string> absent_ HICACHE_GUARDED_BY(mu_);
  std::uint64_t absent_epoch_ HICACHE_GUARDED_BY(mu_) = 0;
  std::uint64_t own_publications_ HICACHE_GUARDED_BY(mu_) = 0;
  std::uint64_t own_removals_ HICACHE_GUARDED_BY(mu_) = 0;
  // foreign_removals_locked() when this instance opened, read before its index was built: an
  // index entry can be stale only once the count has moved past it.
  std::uint64_t removals_at_open_ HICACHE_GUARDED_BY(mu_) = 0;
  std::atomic<bool> verify_stop_{false};
  std::thread verify_thread_;  // checks a loaded snapshot against the directory
};

FileStorage::FileStorage(FileStorageConfig config)
    : config_(std::move(config)), impl_(std::make_unique<Impl>(*this, config_)) {}
FileStorage::~FileStorage() = default;

std::size_t FileStorage::batch_exists(std::span<const std::string> keys) {
  for (const auto& k : keys) validate_key(k);
  counters_.exists_queries += keys.size();
  return impl_->exists(keys);
}

bool FileStorage::remove(const std::string& key) {
  validate_key(key);
  return impl_->remove(key);
}

void FileStorage::clear() { impl_->clear(); }
void FileStorage::touch(std::span<const std::string> keys) {
  counters_.touched += impl_->touch(keys);
}
void FileStorage::flush_trash() { impl_->flush_trash(); }
bool FileStorage::started_from_snapshot() const { return impl_->from_snapshot(); }

std::vector<IoResult> FileStorage::do_batch_get(std::span<const std::string> keys,
                                                std::span<const ByteSpan> dst) {
  return impl_->get(keys, dst);
}

std::vector<IoResult> FileStorage::do_batch_set(std::span<const std::string> keys,
                                                std::span<const ConstByteSpan> src) {
  return impl_->set(keys, src);
}

void FileStorage::fill_gauges(StorageStats& stats) const { impl_->gauges(stats); }

std::int64_t FileStorage::preferred_batch_pages(std::int64_t page_bytes) const {
  std::int64_t bytes = std::int64_t{64} << 20;
  if (const std::uint64_t cap = impl_->capacity(); cap != 0) {
    bytes = std::min<std::int64_t>(bytes, static_cast<std::int64_t>(cap / 4));
  }
  return std::max<std::int64_t>(1, bytes / std::max<std::int64_t>(page_bytes, 1));
}

std::unique_ptr<StorageBackend> make_file_storage(std::string_view json_text) {
  return std::make_unique<FileStorage>(FileStorageConfig::from_json_text(json_text));
}

}  // namespace hicache
