// Real redis-server processes for the Redis storage tests: one server, or a 3-node cluster, on
// free loopback ports, started with MALLOC_CONF=thp:always and stopped by PID (or by the kernel
// when the test process dies).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "redis_launcher.h"

namespace hicache::testing {

// Paths of redis-server / redis-cli (PATH, then /usr/bin); empty when absent.
std::string find_redis_server();
std::string find_redis_cli();

// Runs redis-cli -p port args... and returns its stdout.
std::string redis_cli(int port, const std::vector<std::string>& args);

// A plain connection for raw RESP commands (bytes bypassing the record format, CLIENT PAUSE,
// ASKING): the tools' client.
using RawClient = bench::RespClient;

// A redis-server of the tests: the tools' launcher (tools/bench/redis_launcher.h, which has the
// kernel kill it when the test process dies, so a crashed test leaves no server behind).
class RedisServer {
 public:
  // Starts on a free port with `extra` arguments; false with *error otherwise.
  bool start(std::vector<std::string> extra = {}, std::string* error = nullptr);
  // Same port and arguments as the last start.
  bool restart(std::string* error = nullptr);
  // SIGKILL + waitpid; idempotent.
  void stop() { process_.stop(); }
  int port() const { return process_.port(); }
  bool running() const { return process_.running(); }

 private:
  bench::RedisProcess process_;
};

// A 3-master cluster; false with *error when it could not be formed.
class RedisCluster {
 public:
  bool start(int nodes, std::string* error);
  std::vector<int> ports() const;
  RedisServer& node(std::size_t i) { return *servers_[i]; }
  std::size_t size() const { return servers_.size(); }

 private:
  std::vector<std::unique_ptr<RedisServer>> servers_;
};

}  // namespace hicache::testing
