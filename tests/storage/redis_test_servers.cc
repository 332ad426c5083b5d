#include "storage/redis_test_servers.h"

#include "tools/support/redis_launcher.h"

namespace hicache::testing {

std::string find_redis_server() { return bench::find_binary("redis-server"); }
std::string find_redis_cli() { return bench::find_binary("redis-cli"); }

std::string redis_cli(int port, const std::vector<std::string>& args) {
  std::vector<std::string> all = {find_redis_cli(), "-h", "127.0.0.1", "-p", std::to_string(port)};
  all.insert(all.end(), args.begin(), args.end());
  return bench::run_capture(std::move(all));
}

}  // namespace hicache::testing
