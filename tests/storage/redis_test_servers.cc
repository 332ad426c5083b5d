#include "storage/redis_test_servers.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include "redis_launcher.h"

namespace hicache::testing {

namespace {

int connect_loopback(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<std::uint16_t>(port));
  timeval tv{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

}  // namespace

std::string find_redis_server() { return bench::find_binary("redis-server"); }
std::string find_redis_cli() { return bench::find_binary("redis-cli"); }

std::string redis_cli(int port, const std::vector<std::string>& args) {
  std::vector<std::string> all = {find_redis_cli(), "-h", "127.0.0.1", "-p", std::to_string(port)};
  all.insert(all.end(), args.begin(), args.end());
  return bench::run_capture(std::move(all));
}

RawClient::RawClient(int port) : fd_(connect_loopback(port)) {}

RawClient::~RawClient() {
  if (fd_ >= 0) ::close(fd_);
}

bool RawClient::send(std::string_view bytes) {
  while (!bytes.empty()) {
    const ssize_t n = ::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL);
    if (n <= 0) return false;
    bytes.remove_prefix(static_cast<std::size_t>(n));
  }
  return true;
}

std::string RawClient::command(const std::vector<std::string>& args) {
  std::string resp = "*" + std::to_string(args.size()) + "\r\n";
  for (const auto& a : args) resp += "$" + std::to_string(a.size()) + "\r\n" + a + "\r\n";
  if (!send(resp)) return {};
  std::string line;
  char c;
  while (::recv(fd_, &c, 1, 0) == 1) {
    if (c == '\n' && !line.empty() && line.back() == '\r') {
      line.pop_back();
      return line;
    }
    line += c;
  }
  return {};
}

bool RedisServer::start(std::vector<std::string> extra, std::string* error) {
  std::string ignored;
  extra.insert(extra.begin(), {"--enable-debug-command", "local"});
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
