// Thread-safety annotations: what protects what, stated in the code and checked by clang's
// -Wthread-safety (CMake option HICACHE_THREAD_SAFETY; CI's clang build turns it on).
//
// A lock is a capability (hicache::Mutex, transfer/mutex.h). A member names the lock that
// protects it, a function names the locks it needs held or must not hold:
//
//   class Queue {
//    public:
//     void push(int v) HICACHE_EXCLUDES(mu_) {
//       MutexLock lock(mu_);
//       push_locked(v);
//     }
//    private:
//     void push_locked(int v) HICACHE_REQUIRES(mu_) { items_.push_back(v); }
//     Mutex mu_;
//     std::vector<int> items_ HICACHE_GUARDED_BY(mu_);
//   };
//
// The analysis then rejects a read or write of items_, or a call of push_locked, on a path that
// does not hold mu_. It is intra-procedural: a function is checked against its own annotations
// and those of what it calls; lambdas are functions of their own (they see no lock of the
// function that creates them). Constructors, destructors and catch handlers are not checked:
// a handler reaches guarded members through a function of its own, whose body is.
// HICACHE_NO_THREAD_SAFETY_ANALYSIS turns the check off for one function; each use says why.
// Locals cannot be annotated: a lock and what it guards go in a struct.
//
// Under compilers other than clang every macro expands to nothing.
#pragma once

#if defined(__clang__)
#define HICACHE_THREAD_ANNOTATION_(x) __attribute__((x))
#else
#define HICACHE_THREAD_ANNOTATION_(x)
#endif

// On a class: its objects are capabilities (locks); x names the kind in messages ("mutex").
#define HICACHE_CAPABILITY(x) HICACHE_THREAD_ANNOTATION_(capability(x))
// On a class: an RAII object that holds the capabilities its constructor acquires until it is
// destroyed (or until its own release function runs).
#define HICACHE_SCOPED_CAPABILITY HICACHE_THREAD_ANNOTATION_(scoped_lockable)

// On a data member: read and written only with capability x held.
#define HICACHE_GUARDED_BY(x) HICACHE_THREAD_ANNOTATION_(guarded_by(x))
// On a pointer member: what it points to is read and written only with x held (the pointer
// itself is not guarded).
#define HICACHE_PT_GUARDED_BY(x) HICACHE_THREAD_ANNOTATION_(pt_guarded_by(x))

// On a function: called only with these capabilities held; they are still held on return.
#define HICACHE_REQUIRES(...) HICACHE_THREAD_ANNOTATION_(requires_capability(__VA_ARGS__))
// As HICACHE_REQUIRES, for a capability held at least shared (a reader's lock).
#define HICACHE_REQUIRES_SHARED(...) \
  HICACHE_THREAD_ANNOTATION_(requires_shared_capability(__VA_ARGS__))
// On a function: called only with these capabilities not held (it takes them itself).
#define HICACHE_EXCLUDES(...) HICACHE_THREAD_ANNOTATION_(locks_excluded(__VA_ARGS__))
// On a function: acquires these capabilities (none named: the object it is called on) and
// returns holding them.
#define HICACHE_ACQUIRE(...) HICACHE_THREAD_ANNOTATION_(acquire_capability(__VA_ARGS__))
// On a function: releases these capabilities (none named: the object it is called on).
#define HICACHE_RELEASE(...) HICACHE_THREAD_ANNOTATION_(release_capability(__VA_ARGS__))
// As HICACHE_ACQUIRE, shared (a reader's lock).
#define HICACHE_ACQUIRE_SHARED(...) \
  HICACHE_THREAD_ANNOTATION_(acquire_shared_capability(__VA_ARGS__))
// As HICACHE_RELEASE, for a capability held shared.
#define HICACHE_RELEASE_SHARED(...) \
  HICACHE_THREAD_ANNOTATION_(release_shared_capability(__VA_ARGS__))
// On a function returning bool: acquires the capabilities when it returns the first argument
// (HICACHE_TRY_ACQUIRE(true): a try_lock).
#define HICACHE_TRY_ACQUIRE(...) HICACHE_THREAD_ANNOTATION_(try_acquire_capability(__VA_ARGS__))

// On a function: not checked. For the few accesses the analysis cannot follow; every use
// carries a comment saying why the access is safe.
#define HICACHE_NO_THREAD_SAFETY_ANALYSIS HICACHE_THREAD_ANNOTATION_(no_thread_safety_analysis)
