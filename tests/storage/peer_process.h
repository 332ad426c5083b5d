// PeerProcess: a child process (fork) that a test drives one command byte at a time, for tests
// of stores that several processes use. Fork it before the parent starts threads of its own
// where it can; the child opens its own stores (nothing of the parent's).
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <functional>

#include "transfer/errors.h"

namespace hicache::testing {

// Runs `handle` in the child for each command byte the parent sends, and answers with the byte
// it returns ('E' when it throws); EOF on its command pipe ends the child (_exit(0)).
class PeerProcess {
 public:
  explicit PeerProcess(const std::function<char(char)>& handle) {
    int cmd[2], reply[2];
    if (::pipe(cmd) != 0 || ::pipe(reply) != 0) throw IoError("PeerProcess: pipe failed");
    pid_ = ::fork();
    if (pid_ < 0) throw IoError("PeerProcess: fork failed");
    if (pid_ == 0) {
      ::close(cmd[1]);
      ::close(reply[0]);
      for (char c; ::read(cmd[0], &c, 1) == 1;) {
        char r = 'E';
        try {
          r = handle(c);
        } catch (...) {
        }
        if (::write(reply[1], &r, 1) != 1) break;
      }
      ::_exit(0);
    }
    ::close(cmd[0]);
    ::close(reply[1]);
    cmd_ = cmd[1];
    reply_ = reply[0];
  }
  ~PeerProcess() {
    ::close(cmd_);
    ::close(reply_);
    if (pid_ > 0) ::waitpid(pid_, nullptr, 0);
  }
  PeerProcess(const PeerProcess&) = delete;
  PeerProcess& operator=(const PeerProcess&) = delete;

  // Sends `c` and returns the child's answer ('X' when it is gone).
  char ask(char c) {
    char r = 'X';
    if (::write(cmd_, &c, 1) != 1 || ::read(reply_, &r, 1) != 1) return 'X';
    return r;
  }
  // Kills the child (SIGKILL, as a crash) and reaps it.
  void kill() {
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

 private:
  pid_t pid_ = -1;
  int cmd_ = -1, reply_ = -1;
};

}  // namespace hicache::testing
