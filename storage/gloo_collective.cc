#include <gloo/allreduce.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>

#include <signal.h>

#include <ctime>

#include "storage/collective.h"
#include "transfer/errors.h"

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

class GlooCollective final : public Collective {
 public:
  explicit GlooCollective(const GlooConfig& c) : config_(c) {
    SigpipeGuard guard;
    gloo::transport::tcp::attr attr;
    attr.hostname = c.hostname;
    auto device = gloo::transport::tcp::CreateDevice(attr);
    gloo::rendezvous::FileStore file_store(c.store_dir);
    gloo::rendezvous::PrefixStore store(c.prefix, file_store);
    context_ = std::make_shared<gloo::rendezvous::Context>(c.rank, c.size);
    context_->setTimeout(c.timeout);
    context_->connectFullMesh(store, device);
  }

  int rank() const override { return config_.rank; }
  int size() const override { return config_.size; }
  std::string_view name() const override { return "gloo"; }

 protected:
  std::string reduce_min(std::span<std::int64_t> buffer) override {
    SigpipeGuard guard;
    try {
      gloo::AllreduceOptions opts(context_);
      opts.setOutput(buffer.data(), buffer.size());
      opts.setReduceFunction(
          static_cast<void (*)(void*, const void*, const void*, std::size_t)>(
              &gloo::min<std::int64_t>));
      opts.setTag(tag_++);
      opts.setTimeout(config_.timeout);
      gloo::allreduce(opts);
    } catch (const std::exception& e) {
      return str_cat("gloo: ", e.what());
    }
    return {};
  }

 private:
  GlooConfig config_;
  std::shared_ptr<gloo::rendezvous::Context> context_;
  std::uint32_t tag_ = 0;
};

}  // namespace

std::unique_ptr<Collective> make_gloo_collective(const GlooConfig& config) {
  validate_group_config("gloo", config.rank, config.size, config.store_dir, config.timeout);
  try {
    return std::make_unique<GlooCollective>(config);
  } catch (const std::exception& e) {
    throw Error(str_cat("gloo collective: rank ", config.rank, " of ", config.size,
                        " could not connect: ", e.what()));
  }
}

}  // namespace hicache
