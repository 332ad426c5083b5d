// IoThreads' inside (storage/redis_connection.h declares IoThreads): one io_context per thread,
// which a connection picks for its life. Private to the Redis client (redis_connection.cc,
// redis_io_threads.cc).
#pragma once

#include <atomic>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "storage/redis_connection.h"

namespace hicache::redis {

class IoThreads::Impl {
 public:
  // One io_context per thread, each with its own reactor: asio performs a socket's reads and
  // its continued writes in the thread running the reactor, so threads sharing one io_context
  // would still do the I/O of every connection in one thread at a time.
  struct Shard {
    boost::asio::io_context io{1};
    boost::asio::executor_work_guard<boost::asio::io_context::executor_type> work{
        io.get_executor()};
  };
  std::vector<std::unique_ptr<Shard>> shards;
  std::vector<std::thread> threads;
  std::atomic<std::size_t> next{0};
  std::atomic<std::uint64_t> handler_failures{0};

  // The shard for a new connection: round robin.
  boost::asio::io_context& pick() {
    return shards[next.fetch_add(1, std::memory_order_relaxed) % shards.size()]->io;
  }
};

}  // namespace hicache::redis
