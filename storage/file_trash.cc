#include "storage/file_trash.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <system_error>

#include "transfer/errors.h"

namespace hicache {

namespace fs = std::filesystem;

FileTrash::FileTrash(fs::path dir, std::function<void()> recreate_dirs)
    : dir_(std::move(dir)), recreate_dirs_(std::move(recreate_dirs)) {}

FileTrash::~FileTrash() { stop(); }

void FileTrash::adopt_leftovers() {
  std::error_code ec;
  MutexLock lock(mu_);
  for (const auto& entry : fs::directory_iterator(dir_, ec)) {
    queue_.push_back({entry.path(), 0});
    ++pending_;
  }
}

void FileTrash::start() {
  thread_ = std::thread([this] { loop(); });
}

void FileTrash::stop() {
  {
    MutexLock lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  idle_cv_.notify_all();
  if (thread_.joinable()) thread_.join();  // what is left in the folder goes at the next start
}

bool FileTrash::take(const fs::path& path, std::uint64_t bytes, bool* moved) {
  const fs::path to = dir_ / str_cat(::getpid(), ".", seq_.fetch_add(1));
  if (::rename(path.c_str(), to.c_str()) != 0) {
    if (errno == ENOENT && ::access(path.c_str(), F_OK) != 0) {
      if (!fs::exists(dir_)) {  // the trash folder itself vanished: recreate it and retry
        recreate_dirs_();
        if (::rename(path.c_str(), to.c_str()) == 0) {
          if (moved != nullptr) *moved = true;
          push(to, bytes);
          return true;
        }
      }
      return true;  // the file is gone already
    }
    return false;
  }
  if (moved != nullptr) *moved = true;
  push(to, bytes);
  return true;
}

void FileTrash::push(fs::path to, std::uint64_t bytes) {
  {
    MutexLock lock(mu_);
    queue_.push_back({std::move(to), bytes});
    ++pending_;
    bytes_ += bytes;
  }
  work_cv_.notify_one();
}

void FileTrash::flush() {
  MutexLock lock(mu_);
  while (pending_ != 0 && !stop_) mu_.wait(idle_cv_);
}

void FileTrash::loop() {
  UniqueLock lock(mu_);
  while (true) {
    while (!stop_ && queue_.empty()) mu_.wait(work_cv_);
    if (stop_) return;
    auto [path, bytes] = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    std::error_code ec;
    fs::remove_all(path, ec);  // a failure leaves it for the next start; nothing waits on it
    lock.lock();
    bytes_ -= bytes;
    if (--pending_ == 0) idle_cv_.notify_all();
  }
}

}  // namespace hicache
