#include "storage/redis_test_servers.h"

#include <chrono>
#include <thread>

#include "redis_launcher.h"

namespace hicache::testing {

std::string find_redis_server() { return bench::find_binary("redis-server"); }
std::string find_redis_cli() { return bench::find_binary("redis-cli"); }

std::string redis_cli(int port, const std::vector<std::string>& args) {
  std::vector<std::string> all = {find_redis_cli(), "-h", "127.0.0.1", "-p", std::to_string(port)};
  all.insert(all.end(), args.begin(), args.end());
  return bench::run_capture(std::move(all));
}

bool RedisServer::start(std::vector<std::string> extra, std::string* error) {
  std::string ignored;
  return process_.start(extra, error != nullptr ? error : &ignored);
}

bool RedisServer::restart(std::string* error) {
  std::string ignored;
  return process_.restart(error != nullptr ? error : &ignored);
}

bool RedisCluster::start(int nodes, std::string* error) {
  std::vector<std::string> create = {"--cluster", "create"};
  for (int i = 0; i < nodes; ++i) {
    auto s = std::make_unique<RedisServer>();
    if (!s->start({"--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                   "--cluster-node-timeout", "5000"},
                  error)) {
      return false;
    }
    create.push_back("127.0.0.1:" + std::to_string(s->port()));
    servers_.push_back(std::move(s));
  }
  create.insert(create.end(), {"--cluster-replicas", "0", "--cluster-yes"});
  const std::string out = redis_cli(servers_[0]->port(), create);
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (std::chrono::steady_clock::now() < until) {
    bool all_ok = true;
    for (const auto& s : servers_) {
      all_ok = all_ok && redis_cli(s->port(), {"cluster", "info"}).find("cluster_state:ok") !=
                             std::string::npos;
    }
    if (all_ok) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (error) *error = "cluster did not reach cluster_state:ok; redis-cli said: " + out;
  return false;
}

std::vector<int> RedisCluster::ports() const {
  std::vector<int> out;
  for (const auto& s : servers_) out.push_back(s->port());
  return out;
}

}  // namespace hicache::testing
