// Throwaway redis-server processes for the benchmarks, the stress tool and the tests (one support
// library, hicache_redis_launcher): one server, or a cluster, on free loopback ports, started with MALLOC_CONF=thp:always
// (the server's page faults bound SETs of new keys otherwise, docs/design-notes.md), killed by PID
// when destroyed, and also by the kernel if this process dies (PR_SET_PDEATHSIG).
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace hicache::bench {

// Path of an executable (PATH, then /usr/bin); empty when absent.
std::string find_binary(const char* name);

// A free loopback port for a server that may be killed and started again on the same port, with
// port + 10000 (the cluster bus) free too; 0 when none is found. Drawn at random below the
// kernel's ephemeral range (net.ipv4.ip_local_port_range): a port inside it can be taken, while
// the server is down, as the source port of any process's outgoing connection, and the restart
// then fails to bind (a stress run under `ctest -j2` lost a restart that way). Falls back to a
// port the kernel hands out when the range leaves no room below it.
int pick_server_port();

// Runs argv (argv[0] a path), stdin from `stdin_path` (or /dev/null), and returns its stdout;
// *status gets the wait status. Several may run at once: see SpawnedOutput.
class SpawnedOutput {
 public:
  SpawnedOutput(std::vector<std::string> argv, const std::string& stdin_path = "/dev/null");
  ~SpawnedOutput();
  SpawnedOutput(const SpawnedOutput&) = delete;
  SpawnedOutput& operator=(const SpawnedOutput&) = delete;
  // Reads stdout to the end and reaps the child. Empty output when the spawn failed.
  std::string wait(int* status = nullptr);

 private:
  pid_t pid_ = -1;
  int fd_ = -1;
};
std::string run_capture(std::vector<std::string> argv, int* status = nullptr);

// A blocking RESP client on a loopback port for setup work (populate, INFO, FLUSHALL).
class RespClient {
 public:
  explicit RespClient(int port);
  ~RespClient();
  RespClient(const RespClient&) = delete;
  RespClient& operator=(const RespClient&) = delete;
  bool ok() const { return fd_ >= 0; }
  // Sends one command; returns the reply's first line ("+OK", ":1", "-MOVED ...", "$-1") and,
  // for a bulk string, its body instead ("" on an I/O error). Values may be large.
  std::string command(const std::vector<std::string_view>& args);

 private:
  bool read_line(std::string& line);
  int fd_ = -1;
  std::string buf_;
  std::size_t pos_ = 0;
};

class RedisProcess {
 public:
  RedisProcess() = default;
  ~RedisProcess();
  RedisProcess(const RedisProcess&) = delete;
  RedisProcess& operator=(const RedisProcess&) = delete;
  // Starts redis-server on a free port (whose +10000 cluster-bus port is free too) with `extra`
  // arguments, and waits until it answers PING (a NOAUTH error counts: a server with
  // --requirepass); false with *error otherwise.
  bool start(const std::vector<std::string>& extra, std::string* error);
  // The same on this port. A server that answers there but is not this one's child (another
  // process took the port first) is a failure, never taken for ours.
  bool start_on(int port, const std::vector<std::string>& extra, std::string* error);
  void stop();  // SIGKILL + waitpid; idempotent
  // SIGKILL, then a new server on the same port with the same arguments (an empty dataset: the
  // servers run without persistence). False with *error when it does not come back.
  bool restart(std::string* error);
  int port() const { return port_; }
  bool running() const { return pid_ > 0; }

 private:
  bool make_dir(std::string* error);
  pid_t pid_ = -1;
  int port_ = 0;
  std::string dir_;
  std::vector<std::string> extra_;
};

// One server (nodes == 1, no cluster mode) or a cluster of `nodes` masters, each with `replicas`
// replicas, formed with redis-cli --cluster create (cluster-node-timeout `node_timeout_ms`) and
// waited for until every node says cluster_state:ok and every replica's link to its master is up.
// `extra`: more redis-server arguments for every server.
class RedisDeployment {
 public:
  bool start(int nodes, bool cluster, std::string* error, int replicas = 0,
             int node_timeout_ms = 5000, const std::vector<std::string>& extra = {});
  std::vector<int> ports() const;  // every server's, masters and replicas alike
  // The server on `port` (nullptr when none of ours): to kill and restart it.
  RedisProcess* server_on(int port);
  // The ports of the servers that call themselves master / replica now (ROLE), of the ones
  // running.
  std::vector<int> masters() const;
  std::vector<int> replicas() const;
  // Waits until every running node says cluster_state:ok and every running replica's link is up;
  // false with *error after `seconds`.
  bool wait_healthy(double seconds, std::string* error) const;

 private:
  std::vector<std::unique_ptr<RedisProcess>> servers_;
  std::vector<int> with_role(std::string_view role) const;
};

}  // namespace hicache::bench
