// Small POSIX file helpers of the file store (storage/file_*.cc): an owned descriptor, an
// errno message naming the path, and full-length positional vector I/O.
#pragma once

#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <string>

#include "transfer/errors.h"

namespace hicache::posix_file {

// "<op> <path>: <strerror(err)>".
inline std::string errno_text(const char* op, const std::filesystem::path& path, int err) {
  return str_cat(op, " ", path.string(), ": ", std::strerror(err));
}

// A file descriptor closed at scope exit (a negative one is not open).
struct Fd {
  int fd = -1;
  explicit Fd(int f) : fd(f) {}
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
};

// Full-length positional vector I/O from offset 0 (retries short transfers and EINTR; a read
// stops at the end of the file). Returns the bytes moved, or -errno. Advances `iov`'s entries.
template <bool kWrite>
ssize_t full_iov(int fd, iovec* iov, int iovcnt) {
  std::size_t total = 0;
  off_t offset = 0;
  while (iovcnt > 0) {
    const ssize_t n =
        kWrite ? ::pwritev(fd, iov, iovcnt, offset) : ::preadv(fd, iov, iovcnt, offset);
    if (n < 0) {
      if (errno == EINTR) continue;
      return -errno;
    }
    if (n == 0) break;  // EOF on read
    total += static_cast<std::size_t>(n);
    offset += n;
    auto left = static_cast<std::size_t>(n);
    while (iovcnt > 0 && left >= iov->iov_len) {
      left -= iov->iov_len;
      ++iov;
      --iovcnt;
    }
    if (iovcnt > 0) {
      iov->iov_base = static_cast<char*>(iov->iov_base) + left;
      iov->iov_len -= left;
    }
  }
  return static_cast<ssize_t>(total);
}

}  // namespace hicache::posix_file
