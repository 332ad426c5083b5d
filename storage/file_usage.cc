#include "storage/file_usage.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "storage/posix_file.h"
#include "transfer/errors.h"

namespace hicache {
namespace {

using posix_file::errno_text;

// An open-file-description lock on byte `byte` of `fd`: 0, or the errno (EAGAIN or EACCES:
// another open holds a conflicting lock).
int lock_byte(int fd, short type, off_t byte, bool wait) {
  struct flock fl {};
  fl.l_type = type;
  fl.l_whence = SEEK_SET;
  fl.l_start = byte;
  fl.l_len = 1;
  while (::fcntl(fd, wait ? F_OFD_SETLKW : F_OFD_SETLK, &fl) != 0) {
    if (errno != EINTR) return errno;
  }
  return 0;
}

}  // namespace

std::unique_ptr<FileUsage> FileUsage::open(int root_fd, const std::filesystem::path& root,
                                           bool exclusive) {
  std::unique_ptr<FileUsage> u(new FileUsage());
  const std::filesystem::path path = root / ".usage";
  u->fd_ = ::openat(root_fd, ".usage", O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (u->fd_ < 0) throw IoError(errno_text("file storage: open", path, errno));
  if (exclusive) {
    const int err = lock_byte(u->fd_, F_WRLCK, 0, false);
    if (err == EAGAIN || err == EACCES) {
      throw IoError(str_cat("file storage: root '", root.string(),
                            "' is in use by another live instance, and this one was opened "
                            "with \"shared\": false (the root to itself); leave \"shared\" "
                            "unset to share the root"));
    }
    u->alone_ = true;  // (a filesystem without locks: the config's word is taken)
    return u;
  }
  struct stat st {};
  if (::fstat(u->fd_, &st) != 0 ||
      (st.st_size < static_cast<off_t>(kBytesOfFile) && ::ftruncate(u->fd_, kBytesOfFile) != 0)) {
    throw IoError(errno_text("file storage: size", path, errno));
  }
  void* p = ::mmap(nullptr, kBytesOfFile, PROT_READ | PROT_WRITE, MAP_SHARED, u->fd_, 0);
  if (p == MAP_FAILED) throw IoError(errno_text("file storage: map", path, errno));
  u->count_ = static_cast<std::uint64_t*>(p);
  const int err = lock_byte(u->fd_, F_RDLCK, 0, false);
  if (err == EAGAIN || err == EACCES) {
    throw IoError(str_cat("file storage: root '", root.string(),
                          "' is held by a live instance opened with \"shared\": false (it "
                          "shares the root with no other instance)"));
  }
  u->locked_ = err == 0;
  if (u->locked_) {
    u->alone_ = lock_byte(u->fd_, F_WRLCK, 1, false) == 0;
    if (!u->alone_) u->locked_ = lock_byte(u->fd_, F_RDLCK, 1, /*wait=*/true) == 0;
  }
  return u;
}

FileUsage::~FileUsage() {
  if (counted_) at(kInstances).fetch_sub(1);
  if (count_ != nullptr) ::munmap(count_, kBytesOfFile);
  if (fd_ >= 0) ::close(fd_);  // releases the locks
}

void FileUsage::settle(std::uint64_t scanned) {
  if (alone_) {
    at(kBytes).store(scanned);
    at(kInstances).store(1);
    lock_byte(fd_, F_RDLCK, 1, /*wait=*/true);  // a conversion: granted at once
  } else {
    at(kInstances).fetch_add(1);
  }
  counted_ = true;
}

bool FileUsage::last_at_close() const { return locked_ && lock_byte(fd_, F_WRLCK, 1, false) == 0; }

std::uint64_t FileUsage::instances() const {
  return std::max<std::uint64_t>(1, at(kInstances).load());
}

}  // namespace hicache
