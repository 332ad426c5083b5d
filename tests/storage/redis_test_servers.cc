#include "storage/redis_test_servers.h"

#include "redis_launcher.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <filesystem>
#include <thread>

extern char** environ;

namespace hicache::testing {

namespace {

namespace fs = std::filesystem;

std::string find_binary(const char* name) {
  if (const char* path = std::getenv("PATH")) {
    std::string_view rest(path);
    while (!rest.empty()) {
      const auto colon = rest.find(':');
      const auto dir = rest.substr(0, colon);
      const fs::path candidate = fs::path(std::string(dir)) / name;
      if (!dir.empty() && ::access(candidate.c_str(), X_OK) == 0) return candidate.string();
      if (colon == std::string_view::npos) break;
      rest.remove_prefix(colon + 1);
    }
  }
  const std::string fallback = std::string("/usr/bin/") + name;
  return ::access(fallback.c_str(), X_OK) == 0 ? fallback : std::string();
}

std::vector<char*> argv_of(std::vector<std::string>& args) {
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  return argv;
}

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

std::string find_redis_server() { return find_binary("redis-server"); }
std::string find_redis_cli() { return find_binary("redis-cli"); }

std::string redis_cli(int port, const std::vector<std::string>& args) {
  std::vector<std::string> all = {find_redis_cli(), "-h", "127.0.0.1", "-p", std::to_string(port)};
  all.insert(all.end(), args.begin(), args.end());
  int pipe_fds[2];
  if (::pipe2(pipe_fds, O_CLOEXEC) != 0) return {};
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, pipe_fds[1], STDOUT_FILENO);
  posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  auto argv = argv_of(all);
  pid_t pid = -1;
  const int rc = ::posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  ::close(pipe_fds[1]);
  std::string out;
  if (rc == 0) {
    char buf[4096];
    for (ssize_t n; (n = ::read(pipe_fds[0], buf, sizeof buf)) > 0;) out.append(buf, static_cast<std::size_t>(n));
    int status = 0;
    ::waitpid(pid, &status, 0);
  }
  ::close(pipe_fds[0]);
  return out;
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

bool RedisServer::start(std::vector<std::string> extra, int port, std::string* error) {
  extra_ = std::move(extra);
  if (dir_.empty()) {
    char tmpl[] = "/tmp/hicache-redis-XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) {
      if (error) *error = "mkdtemp failed";
      return false;
    }
    dir_ = tmpl;
  }
  if (port != 0) return start_on(port, error);
  for (int attempt = 0; attempt < 5; ++attempt) {
    const int p = bench::pick_server_port();
    if (p != 0 && start_on(p, error)) return true;
  }
  return false;
}

bool RedisServer::restart(std::string* error) { return start_on(port_, error); }

bool RedisServer::start_on(int port, std::string* error) {
  stop();
  const std::string server = find_redis_server();
  std::vector<std::string> args = {server, "--port", std::to_string(port), "--bind", "127.0.0.1",
                                   "--save", "", "--appendonly", "no", "--daemonize", "no",
                                   "--dir", dir_, "--enable-debug-command", "local",
                                   "--logfile", dir_ + "/redis-" + std::to_string(port) + ".log"};
  args.insert(args.end(), extra_.begin(), extra_.end());
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) {
    if (std::strncmp(*e, "MALLOC_CONF=", 12) != 0) env_strings.emplace_back(*e);
  }
  env_strings.emplace_back("MALLOC_CONF=thp:always");
  auto argv = argv_of(args);
  auto envp = argv_of(env_strings);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, "/dev/null", O_WRONLY, 0);
  pid_t pid = -1;
  const int rc = ::posix_spawn(&pid, server.c_str(), &actions, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) {
    if (error) *error = "posix_spawn " + server + ": " + std::strerror(rc);
    return false;
  }
  pid_ = pid;
  port_ = port;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (std::chrono::steady_clock::now() < until) {
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {  // exited: port taken, or bad arguments
      pid_ = -1;
      if (error) *error = "redis-server on port " + std::to_string(port) + " exited at start";
      return false;
    }
    RawClient c(port);
    if (c.ok()) {
      const std::string pong = c.command({"PING"});
      if (pong == "+PONG" || pong.rfind("-NOAUTH", 0) == 0) return true;  // answering
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (error) *error = "redis-server on port " + std::to_string(port) + " does not answer PING";
  stop();
  return false;
}

void RedisServer::stop() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGKILL);
  int status = 0;
  ::waitpid(pid_, &status, 0);
  pid_ = -1;
}

RedisServer::~RedisServer() {
  stop();
  if (!dir_.empty()) {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
}

bool RedisCluster::start(int nodes, std::string* error) {
  std::vector<std::string> create = {"--cluster", "create"};
  for (int i = 0; i < nodes; ++i) {
    auto s = std::make_unique<RedisServer>();
    if (!s->start({"--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                   "--cluster-node-timeout", "5000"},
                  0, error)) {
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
      all_ok = all_ok &&
               redis_cli(s->port(), {"cluster", "info"}).find("cluster_state:ok") != std::string::npos;
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
