#include "storage/file_index_snapshot.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include <xxhash.h>

#include "storage/posix_file.h"

namespace hicache {
namespace {

constexpr std::uint64_t kMagic = 0x7865646e69636869;  // "hicindex"
constexpr std::uint64_t kVersion = 1;
// The smallest record: a length, a key of one byte and a size.
constexpr std::size_t kMinRecordBytes = 17;

}  // namespace

IndexSnapshotWriter::IndexSnapshotWriter(std::uint64_t records) {
  buf_.reserve(static_cast<std::size_t>(32 + records * 64));
  put(kMagic);
  put(kVersion);
  put(records);
}

void IndexSnapshotWriter::put(std::uint64_t v) {
  buf_.append(reinterpret_cast<const char*>(&v), 8);
}

void IndexSnapshotWriter::add(std::string_view key, std::uint64_t bytes) {
  put(key.size());
  buf_ += key;
  put(bytes);
}

std::string IndexSnapshotWriter::finish() {
  put(XXH3_64bits(buf_.data(), buf_.size()));
  return std::move(buf_);
}

void publish_index_snapshot(const std::string& data, const std::filesystem::path& tmp,
                            int dir_fd) {
  bool ok = false;
  {
    posix_file::Fd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    ok = fd.fd >= 0;
    for (std::size_t at = 0; ok && at < data.size();) {
      const ssize_t n = ::write(fd.fd, data.data() + at, data.size() - at);
      if (n < 0 && errno == EINTR) continue;
      ok = n > 0;
      at += ok ? static_cast<std::size_t>(n) : 0;
    }
    ok = ok && ::fdatasync(fd.fd) == 0;
  }
  if (!ok || ::renameat(AT_FDCWD, tmp.c_str(), dir_fd, kIndexSnapshotName) != 0) {
    ::unlink(tmp.c_str());
  }
}

MappedIndexSnapshot::MappedIndexSnapshot(MappedIndexSnapshot&& o) noexcept
    : base_(std::exchange(o.base_, nullptr)), bytes_(o.bytes_) {}

MappedIndexSnapshot::~MappedIndexSnapshot() {
  if (base_ != nullptr) ::munmap(const_cast<char*>(base_), bytes_);
}

bool MappedIndexSnapshot::map(int fd, std::size_t n) {
  void* p = ::mmap(nullptr, n, PROT_READ, MAP_PRIVATE | MAP_POPULATE, fd, 0);
  if (p == MAP_FAILED) return false;
  base_ = static_cast<const char*>(p);
  bytes_ = n;
  return true;
}

bool IndexSnapshotReader::get(std::uint64_t& v) {
  if (end_ - at_ < 8) return false;
  std::memcpy(&v, data_ + at_, 8);
  at_ += 8;
  return true;
}

bool IndexSnapshotReader::open(const char* data, std::size_t size) {
  if (size < 32) return false;
  data_ = data;
  end_ = size - 8;  // the checksum follows
  at_ = 0;
  std::uint64_t checksum = 0;
  std::memcpy(&checksum, data + end_, 8);
  std::uint64_t magic = 0, version = 0;
  return XXH3_64bits(data, end_) == checksum && get(magic) && magic == kMagic && get(version) &&
         version == kVersion && get(count_) && count_ <= end_ / kMinRecordBytes;
}

bool IndexSnapshotReader::next(std::string_view& key, std::uint64_t& bytes,
                               std::uint64_t max_key_bytes) {
  std::uint64_t len = 0;
  if (!get(len) || len > max_key_bytes || end_ - at_ < len) return false;
  key = std::string_view(data_ + at_, static_cast<std::size_t>(len));
  at_ += static_cast<std::size_t>(len);
  return get(bytes);
}

}  // namespace hicache
