// NcclCollective: min_allreduce over GPUs (storage/collective.h). Built in CUDA builds with NCCL
// (HICACHE_WITH_NCCL); elsewhere make_nccl_collective() says why it is unavailable.
#include <chrono>
#include <filesystem>
#include <string>

#include "storage/collective.h"
#include "transfer/errors.h"

#if HICACHE_WITH_NCCL
#include <cuda_runtime.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/prefix_store.h>
#include <nccl.h>

#include <condition_variable>
#include <cstring>
#include <thread>
#include <vector>

#include "transfer/cuda_device.h"
#include "transfer/mutex.h"
#endif

namespace hicache {

#if HICACHE_WITH_NCCL
namespace {

using Clock = std::chrono::steady_clock;

std::string cuda_error(cudaError_t err, const char* what) {
  return str_cat(what, ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")");
}

std::string nccl_error(ncclResult_t r, const char* what, ncclComm_t comm = nullptr) {
  std::string text = str_cat(what, ": ", ncclGetErrorString(r));
  if (comm != nullptr) {
    const char* last = ncclGetLastError(comm);
    if (last != nullptr && *last != '\0') text += str_cat(" (", last, ")");
  }
  return text;
}

class NcclCollective final : public Collective {
 public:
  explicit NcclCollective(const NcclConfig& c) : config_(c), note_(c.store_dir, c.prefix) {
    if (cudaError_t err = cudaSetDevice(c.cuda_ordinal); err != cudaSuccess) {
      throw Error(cuda_error(err, "cudaSetDevice"));
    }
    if (cudaError_t err = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking);
        err != cudaSuccess) {
      throw Error(cuda_error(err, "cudaStreamCreate"));
    }
    try {
      init_comm(exchange_unique_id());
    } catch (...) {
      cudaStreamDestroy(stream_);
      release_buffers();
      throw;
    }
    watchdog_ = std::thread([this] { watch(); });
  }

  // Reads aborted_ without mu_ after the join: the watchdog has ended and no call is in flight
  // while the collective is destroyed.
  ~NcclCollective() override HICACHE_NO_THREAD_SAFETY_ANALYSIS {
    {
      MutexLock lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    watchdog_.join();
    cudaSetDevice(config_.cuda_ordinal);
    cudaStreamSynchronize(stream_);
    // Abort, not finalize: finalize is itself collective and would wait on peers that may be
    // gone; abort releases this rank's resources without them.
    if (!aborted_) ncclCommAbort(comm_);
    cudaStreamDestroy(stream_);
    release_buffers();
  }

  int rank() const override { return config_.rank; }
  int size() const override { return config_.size; }
  std::string_view name() const override { return "nccl"; }

 protected:
  std::string reduce_min(std::span<std::int64_t> buffer) override {
    if (cudaError_t err = cudaSetDevice(config_.cuda_ordinal); err != cudaSuccess) {
      return cuda_error(err, "cudaSetDevice");
    }
    // A peer that failed for good aborted only its own communicator: this rank's all-reduce would
    // wait on it until the timeout. Its note says so first.
    if (std::string failed = note_.read(); !failed.empty()) return failed;
    if (std::string e = reserve(buffer.size()); !e.empty()) return e;
    const std::size_t bytes = buffer.size() * sizeof(std::int64_t);
    std::memcpy(host_, buffer.data(), bytes);
    if (cudaError_t err = cudaMemcpyAsync(device_, host_, bytes, cudaMemcpyHostToDevice, stream_);
        err != cudaSuccess) {
      return cuda_error(err, "cudaMemcpyAsync to the device");
    }
    if (cancelled()) return "cancelled before the call began";
    const Clock::time_point deadline = Clock::now() + config_.timeout;
    ncclResult_t r = ncclAllReduce(device_, device_, buffer.size(), ncclInt64, ncclMin, comm_,
                                   stream_);
    // From here an early return leaves an NCCL kernel that may wait on its peers for ever on the
    // stream (the destructor's synchronisation would hang on it): abort the communicator first.
    if (std::string e = settle(r, "ncclAllReduce", deadline); !e.empty()) {
      abort_comm();
      return e + "; communicator aborted";
    }
    if (cudaError_t err = cudaMemcpyAsync(host_, device_, bytes, cudaMemcpyDeviceToHost, stream_);
        err != cudaSuccess) {
      abort_comm();
      return cuda_error(err, "cudaMemcpyAsync to the host") + "; communicator aborted";
    }
    // The watchdog aborts the communicator if the stream is not done by the deadline; the NCCL
    // kernel then exits and the synchronisation below returns.
    arm(deadline);
    const cudaError_t err = cudaStreamSynchronize(stream_);
    const bool timed_out = disarm();
    if (timed_out) {
      if (cancelled()) return "cancelled during the call; communicator aborted";
      return str_cat("no reply within ", config_.timeout.count(),
                     " ms (a peer is gone or called another collective); communicator aborted");
    }
    if (err != cudaSuccess) return cuda_error(err, "cudaStreamSynchronize");
    ncclResult_t async = ncclSuccess;
    if (ncclResult_t q = ncclCommGetAsyncError(comm_, &async); q != ncclSuccess) {
      return nccl_error(q, "ncclCommGetAsyncError", comm_);
    }
    if (async != ncclSuccess) return nccl_error(async, "ncclAllReduce (async)", comm_);
    std::memcpy(buffer.data(), host_, bytes);
    return {};
  }

 private:
  // Rank 0 creates the id and publishes it; the others wait for it up to the timeout.
  ncclUniqueId exchange_unique_id() {
    gloo::rendezvous::FileStore file_store(config_.store_dir);
    gloo::rendezvous::PrefixStore store(config_.prefix, file_store);
    const std::string key = "nccl-unique-id";
    ncclUniqueId id{};
    if (config_.rank == 0) {
      if (ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) {
        throw Error(nccl_error(r, "ncclGetUniqueId"));
      }
      note_.clear();
      store.set(key, std::vector<char>(id.internal, id.internal + sizeof(id.internal)));
      return id;
    }
    try {
      store.wait({key}, config_.timeout);
    } catch (const std::exception& e) {
      throw Error(str_cat("rank 0 published no NCCL id under '", config_.store_dir, "' within ",
                          config_.timeout.count(), " ms: ", e.what()));
    }
    const std::vector<char> bytes = store.get(key);
    if (bytes.size() != sizeof(id.internal)) {
      throw Error(str_cat("the NCCL id under '", config_.store_dir, "' has ", bytes.size(),
                          " bytes, expected ", sizeof(id.internal)));
    }
    std::memcpy(id.internal, bytes.data(), bytes.size());
    return id;
  }

  // Non-blocking set-up so that a peer that never joins cannot hang this rank: the state is
  // polled every millisecond until ready or the timeout (start-up only, never on a hot path).
  void init_comm(const ncclUniqueId& id) {
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    const Clock::time_point deadline = Clock::now() + config_.timeout;
    ncclResult_t r = ncclCommInitRankConfig(&comm_, config_.size, id, config_.rank, &cfg);
    if (r != ncclSuccess && r != ncclInProgress) {
      throw Error(nccl_error(r, "ncclCommInitRankConfig"));
    }
    for (;;) {
      ncclResult_t state = ncclInProgress;
      if (ncclResult_t q = ncclCommGetAsyncError(comm_, &state); q != ncclSuccess) state = q;
      if (state == ncclSuccess) return;
      if (state != ncclInProgress || Clock::now() >= deadline) {
        const std::string why =
            state == ncclInProgress
                ? str_cat("not all ", config_.size, " ranks joined within ",
                          config_.timeout.count(), " ms")
                : nccl_error(state, "ncclCommInitRankConfig", comm_);
        ncclCommAbort(comm_);
        comm_ = nullptr;
        throw Error(why);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

  // A non-blocking communicator may answer ncclInProgress while it enqueues; wait for it.
  std::string settle(ncclResult_t r, const char* what, Clock::time_point deadline) {
    while (r == ncclInProgress) {
      if (Clock::now() >= deadline) return str_cat(what, ": still in progress at the timeout");
      if (cancelled()) return str_cat(what, ": cancelled while in progress");
      std::this_thread::yield();
      if (ncclResult_t q = ncclCommGetAsyncError(comm_, &r); q != ncclSuccess) r = q;
    }
    return r == ncclSuccess ? std::string() : nccl_error(r, what, comm_);
  }

  std::string reserve(std::size_t n) {
    if (n <= capacity_) return {};
    release_buffers();
    const std::size_t bytes = n * sizeof(std::int64_t);
    if (cudaError_t err = cudaMalloc(&device_, bytes); err != cudaSuccess) {
      device_ = nullptr;
      return cuda_error(err, "cudaMalloc");
    }
    if (cudaError_t err = cudaMallocHost(&host_, bytes); err != cudaSuccess) {
      host_ = nullptr;
      return cuda_error(err, "cudaMallocHost");
    }
    capacity_ = n;
    return {};
  }

  void release_buffers() {
    if (device_ != nullptr) cudaFree(device_);
    if (host_ != nullptr) cudaFreeHost(host_);
    device_ = nullptr;
    host_ = nullptr;
    capacity_ = 0;
  }

  // cancel(): the watchdog aborts the communicator now if a call is armed, or as soon as one is.
  void interrupt(const std::string&) override {
    {
      MutexLock lock(mu_);
      cancelled_ = true;
    }
    cv_.notify_all();
  }

  // Failed for good: no kernel of this rank may wait on its peers any more, and the peers learn
  // it at their next call (an abort here does not reach their communicators).
  void close_transport(const std::string& why) override {
    abort_comm();
    note_.publish(config_.rank, why);
  }

  void abort_comm() {
    MutexLock lock(mu_);
    if (!aborted_) ncclCommAbort(comm_);
    aborted_ = true;
  }

  bool cancelled() {
    MutexLock lock(mu_);
    return cancelled_;
  }

  void arm(Clock::time_point deadline) {
    {
      MutexLock lock(mu_);
      armed_ = true;
      deadline_ = deadline;
    }
    cv_.notify_all();
  }

  // Returns true when the watchdog aborted the communicator during this call.
  bool disarm() {
    bool aborted = false;
    {
      MutexLock lock(mu_);
      armed_ = false;
      aborted = aborted_;
    }
    cv_.notify_all();
    return aborted;
  }

  void watch() {
    MutexLock lock(mu_);
    while (!stopping_) {
      if (!armed_) {
        while (!armed_ && !stopping_) mu_.wait(cv_);
        continue;
      }
      const Clock::time_point deadline = deadline_;
      while (armed_ && !stopping_ && !cancelled_) {
        if (mu_.wait_until(cv_, deadline) == std::cv_status::timeout) break;
      }
      if (!armed_ || stopping_) continue;
      // Armed past the deadline, or cancelled.
      if (!aborted_) ncclCommAbort(comm_);  // makes the stuck kernel exit; the caller's sync then returns
      aborted_ = true;
      armed_ = false;
      while (!stopping_) mu_.wait(cv_);
    }
  }

  NcclConfig config_;
  GroupFailureNote note_;
  cudaStream_t stream_ = nullptr;
  ncclComm_t comm_ = nullptr;
  std::int64_t* device_ = nullptr;
  std::int64_t* host_ = nullptr;  // pinned staging
  std::size_t capacity_ = 0;

  Mutex mu_;
  std::condition_variable cv_;
  bool armed_ HICACHE_GUARDED_BY(mu_) = false;
  bool stopping_ HICACHE_GUARDED_BY(mu_) = false;
  Clock::time_point deadline_ HICACHE_GUARDED_BY(mu_);
  bool aborted_ HICACHE_GUARDED_BY(mu_) = false;  // read without it once the watchdog ended
  bool cancelled_ HICACHE_GUARDED_BY(mu_) = false;  // interrupt() was called
  std::thread watchdog_;
};

}  // namespace
#endif

bool nccl_available(std::string* why) {
#if HICACHE_WITH_NCCL
  return cuda_device_present(why);
#else
  if (why != nullptr) *why = "this build has no CUDA/NCCL (configure with HICACHE_CUDA=ON)";
  return false;
#endif
}

std::unique_ptr<Collective> make_nccl_collective(const NcclConfig& config) {
  validate_group_config("nccl", config.rank, config.size, config.store_dir, config.timeout);
  if (config.cuda_ordinal < 0) {
    throw InvalidArgument(str_cat("nccl collective: cuda_ordinal ", config.cuda_ordinal, " < 0"));
  }
  std::string why;
  if (!nccl_available(&why)) throw Error(str_cat("nccl collective: unavailable: ", why));
#if HICACHE_WITH_NCCL
  try {
    return std::make_unique<NcclCollective>(config);
  } catch (const std::exception& e) {
    throw Error(str_cat("nccl collective: rank ", config.rank, " of ", config.size, " on GPU ",
                        config.cuda_ordinal, " could not connect: ", e.what()));
  }
#else
  return nullptr;
#endif
}

}  // namespace hicache
