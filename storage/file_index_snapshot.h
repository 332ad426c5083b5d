// The file store's index snapshot (<root>/.index): the file that lets a restart skip the
// directory scan (about 5 us per record). FileStorage writes one at a clean close and removes it
// when the next store opens, before it accepts a write (file_storage.cc says when it is
// trusted). This file holds only its format:
//   magic, version, count, then per record (least recently used first) the key's length, the
//   key and the record's bytes, each number 8 bytes little-endian; last, an XXH3 of everything
//   before. Anything else is not a snapshot, and the store scans the directory instead.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

namespace hicache {

inline constexpr const char* kIndexSnapshotName = ".index";

// Builds a snapshot in memory: add() each record in order, then finish().
class IndexSnapshotWriter {
 public:
  explicit IndexSnapshotWriter(std::uint64_t records);
  void add(std::string_view key, std::uint64_t bytes);
  // The whole file (the checksum appended). Call once, after the last add().
  std::string finish();

 private:
  void put(std::uint64_t v);
  std::string buf_;
};

// Writes `data` to `tmp`, syncs it and renames it to kIndexSnapshotName in the directory
// `dir_fd`. A snapshot that cannot be written whole is not published (`tmp` is removed):
// the next start scans.
void publish_index_snapshot(const std::string& data, const std::filesystem::path& tmp,
                            int dir_fd);

// A snapshot file mapped read-only; the mapping stays readable after the file is removed.
class MappedIndexSnapshot {
 public:
  MappedIndexSnapshot() = default;
  MappedIndexSnapshot(MappedIndexSnapshot&& o) noexcept;
  MappedIndexSnapshot& operator=(MappedIndexSnapshot&&) = delete;
  ~MappedIndexSnapshot();
  // Maps the first `n` bytes of `fd`; false when the system refuses.
  bool map(int fd, std::size_t n);
  const char* data() const { return base_; }
  std::size_t size() const { return bytes_; }

 private:
  const char* base_ = nullptr;
  std::size_t bytes_ = 0;
};

// Reads a snapshot's records in order.
class IndexSnapshotReader {
 public:
  // False when `data` is not a whole snapshot of this version: too short, a wrong checksum,
  // magic or version, or a count its bytes cannot hold.
  bool open(const char* data, std::size_t size);
  std::uint64_t count() const { return count_; }
  // The next record; false when it runs past the end or its key is longer than
  // `max_key_bytes`. `key` points into the data.
  bool next(std::string_view& key, std::uint64_t& bytes, std::uint64_t max_key_bytes);
  // True once every record was read and nothing but the checksum is left.
  bool at_end() const { return at_ == end_; }

 private:
  bool get(std::uint64_t& v);
  const char* data_ = nullptr;
  std::size_t at_ = 0, end_ = 0;
  std::uint64_t count_ = 0;
};

}  // namespace hicache
