#include "storage/redis_io_threads.h"

#include <pthread.h>
#include <signal.h>

#include <algorithm>
#include <exception>

namespace hicache::redis {

IoThreads::IoThreads(int threads) : impl_(std::make_unique<Impl>()) {
  for (int i = 0; i < std::max(threads, 1); ++i) {
    impl_->shards.push_back(std::make_unique<Impl::Shard>());
  }
  for (auto& shard : impl_->shards) {
    impl_->threads.emplace_back([impl = impl_.get(), io = &shard->io] {
      // splice() to a socket the peer reset raises SIGPIPE (it takes no MSG_NOSIGNAL), which
      // would end the process: these threads, the only ones that write to the sockets, keep it
      // blocked; the call fails with EPIPE instead.
      sigset_t pipe_signal;
      sigemptyset(&pipe_signal);
      sigaddset(&pipe_signal, SIGPIPE);
      pthread_sigmask(SIG_BLOCK, &pipe_signal, nullptr);
      // A handler that throws (an allocation failing) must not end the thread, or the process:
      // the run goes on, and the connection it was serving fails its requests at their
      // timeout.
      for (;;) {
        try {
          io->run();
          return;
        } catch (const std::exception&) {
          impl->handler_failures.fetch_add(1, std::memory_order_relaxed);
        }
      }
    });
  }
}

IoThreads::~IoThreads() { stop(); }

std::uint64_t IoThreads::handler_failures() const {
  return impl_->handler_failures.load(std::memory_order_relaxed);
}

void IoThreads::stop() {
  for (auto& shard : impl_->shards) shard->work.reset();
  for (auto& t : impl_->threads) {
    if (t.joinable()) t.join();
  }
}

}  // namespace hicache::redis
