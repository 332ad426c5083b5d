// Real redis-server processes for the Redis storage tests: one server, or a 3-node cluster, on
// free loopback ports, started with MALLOC_CONF=thp:always and stopped by PID (or by the kernel
// when the test process dies).
#pragma once

#include <string>
#include <vector>

#include "tools/support/redis_launcher.h"

namespace hicache::testing {

// Paths of redis-server / redis-cli (PATH, then /usr/bin); empty when absent.
std::string find_redis_server();
std::string find_redis_cli();

// Runs redis-cli -p port args... and returns its stdout.
std::string redis_cli(int port, const std::vector<std::string>& args);

// A plain connection for raw RESP commands (bytes bypassing the record format, CLIENT PAUSE,
// ASKING): the tools' client.
using RawClient = bench::RespClient;

// The tests' redis-servers and 3-master cluster are the tools' (tools/support/redis_launcher.h):
// the kernel kills them when the test process dies, so a crashed test leaves no server behind.
using RedisServer = bench::RedisProcess;
using RedisCluster = bench::RedisDeployment;

}  // namespace hicache::testing
