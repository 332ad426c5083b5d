#include "tools/support/redis_launcher.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

extern char** environ;

namespace hicache::bench {

namespace {

namespace fs = std::filesystem;

sockaddr_in loopback(int port) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<std::uint16_t>(port));
  return addr;
}

bool port_free(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  const sockaddr_in addr = loopback(port);
  const bool ok = ::bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) == 0;
  ::close(fd);
  return ok;
}

}  // namespace

int pick_server_port() {
  int ephemeral_low = 32768;
  if (std::ifstream range("/proc/sys/net/ipv4/ip_local_port_range"); range) range >> ephemeral_low;
  // The port in [10000, low - 10000), so that port + 10000 is below the range too.
  if (const int lo = 10000, hi = ephemeral_low - 10000; hi > lo) {
    std::mt19937 rng(std::random_device{}());
    std::uniform_int_distribution<int> draw(lo, hi - 1);
    for (int attempt = 0; attempt < 200; ++attempt) {
      const int port = draw(rng);
      if (port_free(port) && port_free(port + 10000)) return port;
    }
  }
  // No room below the range: a port the kernel hands out.
  for (int attempt = 0; attempt < 100; ++attempt) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr = loopback(0);
    socklen_t len = sizeof addr;
    int port = 0;
    if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
      port = ntohs(addr.sin_port);
    }
    ::close(fd);
    if (port > 0 && port + 10000 <= 65535 && port_free(port + 10000)) return port;
  }
  return 0;
}

namespace {

std::vector<char*> argv_of(std::vector<std::string>& args) {
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  return argv;
}

}  // namespace

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

SpawnedOutput::SpawnedOutput(std::vector<std::string> args, const std::string& stdin_path) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return;
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
  posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, stdin_path.c_str(), O_RDONLY, 0);
  auto argv = argv_of(args);
  const int rc = ::posix_spawn(&pid_, argv[0], &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  ::close(fds[1]);
  if (rc != 0) {
    pid_ = -1;
    ::close(fds[0]);
    return;
  }
  fd_ = fds[0];
}

std::string SpawnedOutput::wait(int* status) {
  std::string out;
  if (fd_ >= 0) {
    char buf[4096];
    for (ssize_t n; (n = ::read(fd_, buf, sizeof buf)) > 0;) {
      out.append(buf, static_cast<std::size_t>(n));
    }
    ::close(fd_);
    fd_ = -1;
  }
  int st = -1;
  if (pid_ > 0) ::waitpid(pid_, &st, 0);
  pid_ = -1;
  if (status != nullptr) *status = st;
  return out;
}

SpawnedOutput::~SpawnedOutput() { wait(); }

std::string run_capture(std::vector<std::string> argv, int* status) {
  return SpawnedOutput(std::move(argv)).wait(status);
}

RespClient::RespClient(int port) {
  fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd_ < 0) return;
  const sockaddr_in addr = loopback(port);
  timeval tv{30, 0};
  ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  if (::connect(fd_, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0) {
    ::close(fd_);
    fd_ = -1;
  }
}

RespClient::~RespClient() {
  if (fd_ >= 0) ::close(fd_);
}

bool RespClient::read_line(std::string& line) {
  for (;;) {
    const auto eol = buf_.find("\r\n", pos_);
    if (eol != std::string::npos) {
      line.assign(buf_, pos_, eol - pos_);
      pos_ = eol + 2;
      return true;
    }
    char chunk[65536];
    const ssize_t n = ::recv(fd_, chunk, sizeof chunk, 0);
    if (n <= 0) return false;
    buf_.append(chunk, static_cast<std::size_t>(n));
  }
}

std::string RespClient::command(const std::vector<std::string_view>& args) {
  if (fd_ < 0) return {};
  std::string head = "*" + std::to_string(args.size()) + "\r\n";
  std::vector<iovec> iov;
  std::vector<std::string> lens;
  lens.reserve(args.size());
  for (std::string_view a : args) lens.push_back("$" + std::to_string(a.size()) + "\r\n");
  iov.push_back({head.data(), head.size()});
  static char crlf[] = "\r\n";
  for (std::size_t i = 0; i < args.size(); ++i) {
    iov.push_back({lens[i].data(), lens[i].size()});
    iov.push_back({const_cast<char*>(args[i].data()), args[i].size()});
    iov.push_back({crlf, 2});
  }
  std::size_t at = 0;  // first iovec not fully sent
  while (at < iov.size()) {
    msghdr msg{};
    msg.msg_iov = iov.data() + at;
    msg.msg_iovlen = std::min<std::size_t>(iov.size() - at, 512);
    ssize_t n = ::sendmsg(fd_, &msg, MSG_NOSIGNAL);
    if (n <= 0) return {};
    while (at < iov.size() && static_cast<std::size_t>(n) >= iov[at].iov_len) {
      n -= static_cast<ssize_t>(iov[at].iov_len);
      ++at;
    }
    if (at < iov.size()) {
      iov[at].iov_base = static_cast<char*>(iov[at].iov_base) + n;
      iov[at].iov_len -= static_cast<std::size_t>(n);
    }
  }
  if (pos_ > 0) {
    buf_.erase(0, pos_);
    pos_ = 0;
  }
  std::string line;
  if (!read_line(line)) return {};
  if (line.size() < 2 || line[0] != '$' || line == "$-1") return line;
  const std::size_t len = std::stoull(line.substr(1));
  while (buf_.size() - pos_ < len + 2) {
    char chunk[65536];
    const ssize_t n = ::recv(fd_, chunk, sizeof chunk, 0);
    if (n <= 0) return {};
    buf_.append(chunk, static_cast<std::size_t>(n));
  }
  std::string body = buf_.substr(pos_, len);
  pos_ += len + 2;
  return body;
}

bool RedisProcess::make_dir(std::string* error) {
  if (dir_.empty()) {
    char tmpl[] = "/tmp/hicache-redis-XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) {
      *error = std::string("mkdtemp: ") + std::strerror(errno);
      return false;
    }
    dir_ = tmpl;
  }
  return true;
}

bool RedisProcess::start(const std::vector<std::string>& extra, std::string* error) {
  for (int attempt = 0; attempt < 5; ++attempt) {
    const int p = pick_server_port();
    if (p != 0 && start_on(p, extra, error)) return true;
  }
  return false;
}

bool RedisProcess::restart(std::string* error) {
  const int port = port_;
  if (port == 0) {
    *error = "restart: the server was never started";
    return false;
  }
  const auto extra = extra_;
  return start_on(port, extra, error);
}

bool RedisProcess::start_on(int port, const std::vector<std::string>& extra, std::string* error) {
  stop();
  if (!make_dir(error)) return false;
  extra_ = extra;
  const std::string server = find_binary("redis-server");
  std::vector<std::string> args = {server,
                                   "--port",
                                   std::to_string(port),
                                   "--bind",
                                   "127.0.0.1",
                                   "--save",
                                   "",
                                   "--appendonly",
                                   "no",
                                   "--daemonize",
                                   "no",
                                   "--dir",
                                   dir_,
                                   "--logfile",
                                   dir_ + "/redis.log"};
  args.insert(args.end(), extra.begin(), extra.end());
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    if (std::strncmp(*e, "MALLOC_CONF=", 12) != 0) env.emplace_back(*e);
  }
  env.emplace_back("MALLOC_CONF=thp:always");
  auto argv = argv_of(args);
  auto envp = argv_of(env);
  // fork + exec rather than posix_spawn, for PR_SET_PDEATHSIG: a killed benchmark leaves no
  // server behind. The child calls only async-signal-safe functions.
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) {
    *error = std::string("fork: ") + std::strerror(errno);
    return false;
  }
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);
    const int devnull = ::open("/dev/null", O_RDWR);
    if (devnull >= 0) {
      ::dup2(devnull, STDIN_FILENO);
      ::dup2(devnull, STDOUT_FILENO);
    }
    ::execve(argv[0], argv.data(), envp.data());
    ::_exit(127);
  }
  pid_ = pid;
  port_ = port;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (std::chrono::steady_clock::now() < until) {
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {  // exited: port taken, or bad arguments
      pid_ = -1;
      *error = "redis-server on port " + std::to_string(port) + " exited at start (log: " + dir_ +
               "/redis.log)";
      return false;
    }
    RespClient c(port);
    const std::string pong = c.ok() ? c.command({"PING"}) : std::string();
    // The port was free when picked, but another process may have taken it since, with our
    // server failing to bind: an answer counts only when it comes from our child. (A server
    // with a password cannot be asked; its NOAUTH answer is taken as it is.)
    if (pong == "+PONG" &&
        c.command({"INFO", "server"}).find("process_id:" + std::to_string(pid_) + "\r\n") ==
            std::string::npos) {
      stop();
      *error = "port " + std::to_string(port) + " is answered by another redis-server";
      return false;
    }
    if (pong == "+PONG" || pong.rfind("-NOAUTH", 0) == 0) return true;  // answering
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  *error = "redis-server on port " + std::to_string(port) + " does not answer PING";
  stop();
  return false;
}

void RedisProcess::stop() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGKILL);
  int status = 0;
  ::waitpid(pid_, &status, 0);
  pid_ = -1;
}

RedisProcess::~RedisProcess() {
  stop();
  if (!dir_.empty()) {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
}

bool RedisDeployment::start(int nodes, bool cluster, std::string* error, int replicas,
                            int node_timeout_ms, const std::vector<std::string>& more) {
  std::vector<std::string> extra = more;
  if (cluster) {
    extra.insert(extra.end(), {"--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                               "--cluster-node-timeout", std::to_string(node_timeout_ms)});
  } else {
    replicas = 0;
  }
  for (int i = 0; i < nodes * (1 + replicas); ++i) {
    auto s = std::make_unique<RedisProcess>();
    if (!s->start(extra, error)) return false;
    servers_.push_back(std::move(s));
  }
  if (!cluster) return true;
  std::vector<std::string> create = {find_binary("redis-cli"),
                                     "-h",
                                     "127.0.0.1",
                                     "-p",
                                     std::to_string(servers_[0]->port()),
                                     "--cluster",
                                     "create"};
  for (const auto& s : servers_) create.push_back("127.0.0.1:" + std::to_string(s->port()));
  create.insert(create.end(), {"--cluster-replicas", std::to_string(replicas), "--cluster-yes"});
  const std::string out = run_capture(create);
  if (!wait_healthy(30, error)) {
    *error += "; redis-cli said: " + out;
    return false;
  }
  return true;
}

bool RedisDeployment::wait_healthy(double seconds, std::string* error) const {
  const auto until =
      std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  std::string last;
  while (std::chrono::steady_clock::now() < until) {
    bool all_ok = true;
    std::size_t running = 0;
    for (const auto& s : servers_) running += s->running() ? 1 : 0;
    const std::size_t replica_count = replicas().size();
    for (const auto& s : servers_) {
      if (!s->running()) continue;
      RespClient c(s->port());
      // Every node knows every running node as connected, none failed or still in handshake,
      // and the replicas as replicas: a slot map read from any node then lists them all.
      const std::string nodes = c.command({"CLUSTER", "NODES"});
      std::size_t connected = 0, as_replica = 0;
      bool troubled = false;
      for (std::size_t at = 0; at < nodes.size();) {
        auto eol = nodes.find('\n', at);
        if (eol == std::string::npos) eol = nodes.size();
        const std::string line = nodes.substr(at, eol - at);
        at = eol + 1;
        if (line.empty()) continue;
        troubled = troubled || line.find("fail") != std::string::npos ||
                   line.find("handshake") != std::string::npos;
        connected += line.find(" connected") != std::string::npos ? 1 : 0;
        as_replica += line.find("slave") != std::string::npos ? 1 : 0;
      }
      if (troubled || connected != running || as_replica != replica_count) {
        all_ok = false;
        last = "127.0.0.1:" + std::to_string(s->port()) + " sees " + std::to_string(connected) +
               " of " + std::to_string(running) + " nodes connected, " +
               std::to_string(as_replica) + " of " + std::to_string(replica_count) +
               " replicas" + (troubled ? ", some failed or in handshake" : "");
        break;
      }
      const std::string info = c.command({"CLUSTER", "INFO"});
      if (info.find("cluster_state:ok") == std::string::npos) {
        all_ok = false;
        last = "127.0.0.1:" + std::to_string(s->port()) + " is not cluster_state:ok";
        break;
      }
      const std::string repl = c.command({"INFO", "replication"});
      if (repl.find("role:slave") != std::string::npos &&
          repl.find("master_link_status:up") == std::string::npos) {
        all_ok = false;
        last = "replica 127.0.0.1:" + std::to_string(s->port()) + " has no link to its master";
        break;
      }
    }
    if (all_ok) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  *error = "cluster not healthy after " + std::to_string(seconds) + " s: " + last;
  return false;
}

std::vector<int> RedisDeployment::ports() const {
  std::vector<int> out;
  for (const auto& s : servers_) out.push_back(s->port());
  return out;
}

RedisProcess* RedisDeployment::server_on(int port) {
  for (auto& s : servers_) {
    if (s->port() == port) return s.get();
  }
  return nullptr;
}

std::vector<int> RedisDeployment::with_role(std::string_view role) const {
  std::vector<int> out;
  for (const auto& s : servers_) {
    if (!s->running()) continue;
    RespClient c(s->port());
    const std::string info = c.command({"INFO", "replication"});
    if (info.find("role:" + std::string(role)) != std::string::npos) out.push_back(s->port());
  }
  return out;
}

std::vector<int> RedisDeployment::masters() const { return with_role("master"); }
std::vector<int> RedisDeployment::replicas() const { return with_role("slave"); }

}  // namespace hicache::bench
