#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>

#include <signal.h>

#include <algorithm>
#include <ctime>
#include <vector>

#include "storage/collective.h"
#include "transfer/errors.h"
#include "transfer/mutex.h"

namespace hicache {
namespace {

// Gloo writes to its sockets without MSG_NOSIGNAL, so a peer that died raises SIGPIPE, whose
// default action kills this process: one dead TP rank would take every other rank down with it.
// While a guard lives, SIGPIPE is blocked in this thread (and in threads it creates: Gloo's
// event loop is started under the guard and inherits the mask), and a SIGPIPE raised meanwhile
// is consumed before the mask is restored; the write itself fails with EPIPE, which Gloo reports
// as an error. The process's own SIGPIPE disposition is left as the embedding engine set it.
class SigpipeGuard {
 public:
  SigpipeGuard() {
    sigemptyset(&pipe_);
    sigaddset(&pipe_, SIGPIPE);
    sigset_t pending;
    sigpending(&pending);
    was_pending_ = sigismember(&pending, SIGPIPE) == 1;
    pthread_sigmask(SIG_BLOCK, &pipe_, &old_);
  }
  ~SigpipeGuard() {
    if (!was_pending_) {
      const timespec zero{0, 0};
      while (sigtimedwait(&pipe_, nullptr, &zero) == SIGPIPE) {
      }
    }
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  SigpipeGuard(const SigpipeGuard&) = delete;
  SigpipeGuard& operator=(const SigpipeGuard&) = delete;

 private:
  sigset_t pipe_, old_;
  bool was_pending_ = false;
};

// The reduction is an exchange rather than gloo::allreduce: each rank sends its vector to every
// peer over Gloo's unbound buffers, receives theirs and takes the minimum itself. For the few
// int64 a call carries this is one message hop, and it is what makes a call cancellable:
// gloo::allreduce keeps its buffers to itself, so nothing can wake a thread waiting inside it
// before its timeout, while UnboundBuffer::abortWaitRecv/abortWaitSend wake ours. Once the
// collective has failed (an interrupted call included) the connections are closed: the peers'
// waits on this rank then fail at once, and no message for a call that is over keeps Gloo's
// event loop busy.
class GlooCollective final : public Collective {
 public:
  // Longest vector one call carries (values plus the two call-check elements of
  // Collective::min_allreduce); every rank's receive slots are this long.
  static constexpr std::size_t kMaxElements = kCollectiveMaxValues + 2;

  explicit GlooCollective(const GlooConfig& c) : config_(c) {
    SigpipeGuard guard;
    gloo::transport::tcp::attr attr;
    attr.hostname = c.hostname;
    auto device = gloo::transport::tcp::CreateDevice(attr);
    gloo::rendezvous::FileStore file_store(c.store_dir);
    gloo::rendezvous::PrefixStore store(c.prefix, file_store);
    context_ = std::make_shared<gloo::rendezvous::Context>(c.rank, c.size);
    context_->setTimeout(c.connect_timeout);
    context_->connectFullMesh(store, device);
    context_->setTimeout(c.timeout);
    const std::size_t stride = kMaxElements + 1;
    send_words_.resize(stride);
    recv_words_.resize(stride * static_cast<std::size_t>(c.size));
    // Made once and reused by every call (slots tell the calls apart): nothing is allocated per
    // call, and a buffer is never destroyed while a failed call's message may still arrive.
    send_ = context_->createUnboundBuffer(send_words_.data(),
                                          send_words_.size() * sizeof(std::int64_t));
    recv_ = context_->createUnboundBuffer(recv_words_.data(),
                                          recv_words_.size() * sizeof(std::int64_t));
  }

  int rank() const override { return config_.rank; }
  int size() const override { return config_.size; }
  std::string_view name() const override { return "gloo"; }
  std::size_t max_values() const override { return kCollectiveMaxValues; }

 protected:
  std::string reduce_min(std::span<std::int64_t> buffer) override {
    if (buffer.size() > kMaxElements) {
      return str_cat("a call carries at most ", kMaxElements - 2, " values, not ",
                     buffer.size() - 2);
    }
    if (config_.size == 1) return {};
    SigpipeGuard guard;
    const std::size_t stride = kMaxElements + 1;
    const std::uint64_t slot = slot_++;
    send_words_[0] = static_cast<std::int64_t>(buffer.size());
    std::copy(buffer.begin(), buffer.end(), send_words_.begin() + 1);
    std::string error;
    bool cancelled = false;
    try {
      {
        MutexLock lock(wait_mu_);
        if (interrupted_) return "cancelled before the call began";
        in_flight_ = true;
      }
      const auto deadline = std::chrono::steady_clock::now() + config_.timeout;
      for (int peer = 0; peer < config_.size; ++peer) {
        if (peer == config_.rank) continue;
        recv_->recv(peer, slot, static_cast<std::size_t>(peer) * stride * sizeof(std::int64_t),
                    stride * sizeof(std::int64_t));
      }
      for (int peer = 0; peer < config_.size; ++peer) {
        if (peer != config_.rank) {
          send_->send(peer, slot, 0, (buffer.size() + 1) * sizeof(std::int64_t));
        }
      }
      for (int i = 1; i < config_.size && !cancelled; ++i) {
        cancelled = !recv_->waitRecv(left_until(deadline));
      }
      for (int i = 1; i < config_.size && !cancelled; ++i) {
        cancelled = !send_->waitSend(left_until(deadline));
      }
    } catch (const std::exception& e) {
      error = str_cat("gloo: ", e.what());
    }
    {
      MutexLock lock(wait_mu_);
      in_flight_ = false;
    }
    if (cancelled) return "cancelled during the call";
    if (!error.empty()) return error;
    for (int peer = 0; peer < config_.size; ++peer) {
      if (peer == config_.rank) continue;
      const std::int64_t* words = recv_words_.data() + static_cast<std::size_t>(peer) * stride;
      if (words[0] != static_cast<std::int64_t>(buffer.size())) {
        return str_cat("rank ", peer, " reduces ", words[0] - 2, " values while this rank reduces ",
                       buffer.size() - 2, " (divergence)");
      }
      for (std::size_t i = 0; i < buffer.size(); ++i) {
        buffer[i] = std::min(buffer[i], words[i + 1]);
      }
    }
    return {};
  }

  void interrupt(const std::string&) override {
    MutexLock lock(wait_mu_);
    interrupted_ = true;
    if (in_flight_) {
      send_->abortWaitSend();
      recv_->abortWaitRecv();
    }
  }

  void close_transport(const std::string&) override {
    SigpipeGuard guard;
    context_->closeConnections();
  }

 private:
  // The time left until `deadline`, at least zero. Gloo's own deadline overload truncates toward
  // zero, so 1-2 ms past the deadline it passes -1 ms, which Gloo reads as "unset" and replaces
  // with the context's whole timeout.
  static std::chrono::milliseconds left_until(std::chrono::steady_clock::time_point deadline) {
    return std::max(std::chrono::milliseconds(0),
                    std::chrono::duration_cast<std::chrono::milliseconds>(
                        deadline - std::chrono::steady_clock::now()));
  }

  GlooConfig config_;
  std::shared_ptr<gloo::rendezvous::Context> context_;
  std::uint64_t slot_ = 0;
  std::vector<std::int64_t> send_words_;  // [length, values...]
  std::vector<std::int64_t> recv_words_;  // one [length, values...] slot of kMaxElements + 1 per rank

  // Declared after context_: destroyed first (a buffer's destructor waits until Gloo's event loop
  // holds no reference to it).
  std::unique_ptr<gloo::transport::UnboundBuffer> send_, recv_;

  Mutex wait_mu_;  // interrupt() against the call in flight
  bool interrupted_ HICACHE_GUARDED_BY(wait_mu_) = false;
  bool in_flight_ HICACHE_GUARDED_BY(wait_mu_) = false;
};

}  // namespace

std::unique_ptr<Collective> make_gloo_collective(const GlooConfig& config) {
  validate_group_config("gloo", config.rank, config.size, config.store_dir, config.timeout);
  if (config.connect_timeout.count() <= 0) {
    throw InvalidArgument(
        str_cat("gloo collective: connect_timeout ", config.connect_timeout.count(), " ms"));
  }
  try {
    return std::make_unique<GlooCollective>(config);
  } catch (const std::exception& e) {
    throw Error(str_cat("gloo collective: rank ", config.rank, " of ", config.size,
                        " could not connect: ", e.what()));
  }
}

}  // namespace hicache
