// Mutex, MutexLock, UniqueLock (and SharedMutex, ReaderLock, WriterLock over std::shared_mutex):
// std::mutex with the thread-safety annotations of
// transfer/thread_annotations.h, so that clang's -Wthread-safety checks every access to the
// members a Mutex guards (libstdc++'s std::mutex and std::lock_guard carry no annotations).
//
//   mutable Mutex mu_;
//   std::condition_variable cv_;
//   bool ready_ HICACHE_GUARDED_BY(mu_) = false;
//
//   void set() {                          // the usual scope
//     { MutexLock lock(mu_); ready_ = true; }
//     cv_.notify_all();
//   }
//   void wait() {                         // a condition-variable wait
//     MutexLock lock(mu_);
//     while (!ready_) mu_.wait(cv_);
//   }
//   void take() {                         // a lock released early
//     UniqueLock lock(mu_);
//     ...
//     lock.unlock();                      // from here the analysis rejects guarded accesses
//     cv_.notify_one();
//   }
//
// Waits: Mutex::wait and wait_until block on a std::condition_variable with the mutex
// held by the caller (through a MutexLock, a UniqueLock or lock()): they release it while
// blocked and hold it again when they return, exactly like std::condition_variable::wait on a
// std::unique_lock, so to the analysis the mutex stays held throughout. Write the condition as a
// loop in the function that holds the lock (`while (!ready_) mu_.wait(cv_);`), not as a predicate
// lambda: a lambda is analysed as a function of its own, without the caller's lock.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <shared_mutex>

#include "transfer/thread_annotations.h"

namespace hicache {

class HICACHE_CAPABILITY("mutex") Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void lock() HICACHE_ACQUIRE() { mu_.lock(); }
  void unlock() HICACHE_RELEASE() { mu_.unlock(); }
  bool try_lock() HICACHE_TRY_ACQUIRE(true) { return mu_.try_lock(); }

  // Blocks on `cv` until notified (or spuriously woken); the caller holds this mutex.
  void wait(std::condition_variable& cv) HICACHE_REQUIRES(this) {
    Adopted held(mu_);
    cv.wait(held.native);
  }
  // As wait, until `deadline` at the latest: std::cv_status::timeout when it passed.
  template <typename Clock, typename Duration>
  std::cv_status wait_until(std::condition_variable& cv,
                            const std::chrono::time_point<Clock, Duration>& deadline)
      HICACHE_REQUIRES(this) {
    Adopted held(mu_);
    return cv.wait_until(held.native, deadline);
  }

 private:
  // The caller's lock owns mu_: a std::unique_lock adopts it for the wait and gives it back
  // without unlocking, also when the wait throws.
  struct Adopted {
    explicit Adopted(std::mutex& mu) : native(mu, std::adopt_lock) {}
    ~Adopted() { native.release(); }
    Adopted(const Adopted&) = delete;
    Adopted& operator=(const Adopted&) = delete;
    std::unique_lock<std::mutex> native;
  };

  std::mutex mu_;
};

// Holds a Mutex for its scope (std::lock_guard).
class HICACHE_SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex& mu) HICACHE_ACQUIRE(mu) : mu_(mu) { mu_.lock(); }
  ~MutexLock() HICACHE_RELEASE() { mu_.unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex& mu_;
};

// Holds a Mutex for its scope, and may release it before the scope ends and take it again
// (std::unique_lock without deferred or adopted locking). The destructor releases it if held.
class HICACHE_SCOPED_CAPABILITY UniqueLock {
 public:
  explicit UniqueLock(Mutex& mu) HICACHE_ACQUIRE(mu) : mu_(mu) { mu_.lock(); }
  ~UniqueLock() HICACHE_RELEASE() {
    if (held_) mu_.unlock();
  }
  UniqueLock(const UniqueLock&) = delete;
  UniqueLock& operator=(const UniqueLock&) = delete;

  void lock() HICACHE_ACQUIRE() {
    mu_.lock();
    held_ = true;
  }
  void unlock() HICACHE_RELEASE() {
    mu_.unlock();
    held_ = false;
  }

 private:
  Mutex& mu_;
  bool held_ = true;
};

// A reader-writer lock: many readers (ReaderLock) or one writer (WriterLock). A member
// HICACHE_GUARDED_BY a SharedMutex may be read under either lock and written only under the
// writer's; a function that only reads names it in HICACHE_REQUIRES_SHARED.
class HICACHE_CAPABILITY("shared mutex") SharedMutex {
 public:
  SharedMutex() = default;
  SharedMutex(const SharedMutex&) = delete;
  SharedMutex& operator=(const SharedMutex&) = delete;

  void lock() HICACHE_ACQUIRE() { mu_.lock(); }
  void unlock() HICACHE_RELEASE() { mu_.unlock(); }
  void lock_shared() HICACHE_ACQUIRE_SHARED() { mu_.lock_shared(); }
  void unlock_shared() HICACHE_RELEASE_SHARED() { mu_.unlock_shared(); }

 private:
  std::shared_mutex mu_;
};

// Holds a SharedMutex shared (as a reader) for its scope (std::shared_lock).
class HICACHE_SCOPED_CAPABILITY ReaderLock {
 public:
  explicit ReaderLock(SharedMutex& mu) HICACHE_ACQUIRE_SHARED(mu) : mu_(mu) { mu_.lock_shared(); }
  ~ReaderLock() HICACHE_RELEASE() { mu_.unlock_shared(); }
  ReaderLock(const ReaderLock&) = delete;
  ReaderLock& operator=(const ReaderLock&) = delete;

 private:
  SharedMutex& mu_;
};

// Holds a SharedMutex exclusively (as the writer) for its scope (std::unique_lock).
class HICACHE_SCOPED_CAPABILITY WriterLock {
 public:
  explicit WriterLock(SharedMutex& mu) HICACHE_ACQUIRE(mu) : mu_(mu) { mu_.lock(); }
  ~WriterLock() HICACHE_RELEASE() { mu_.unlock(); }
  WriterLock(const WriterLock&) = delete;
  WriterLock& operator=(const WriterLock&) = delete;

 private:
  SharedMutex& mu_;
};

}  // namespace hicache
