// Forwarding: a store in front of another (a test's file store) that forwards every call; a
// test's store overrides the one it changes. FileForwarding owns the file store it fronts. It does not say it answers existence without I/O
// (StorageBackend::exists_without_io), so the radix cache asks it on the prefetch thread.
#pragma once

#include <span>
#include <string>
#include <vector>

#include "storage/file_storage.h"
#include "storage/storage_backend.h"

namespace hicache::testing {

class Forwarding : public StorageBackend {
 public:
  explicit Forwarding(StorageBackend& inner) : inner_(inner) {}
  std::string_view name() const override { return inner_.name(); }
  std::size_t batch_exists(std::span<const std::string> keys) override {
    return inner_.batch_exists(keys);
  }
  bool remove(const std::string& key) override { return inner_.remove(key); }
  void clear() override { inner_.clear(); }

 protected:
  std::vector<IoResult> do_batch_get(std::span<const std::string> keys,
                                     std::span<const ByteSpan> dst) override {
    return inner_.batch_get(keys, dst);
  }
  std::vector<IoResult> do_batch_set(std::span<const std::string> keys,
                                     std::span<const ConstByteSpan> src) override {
    return inner_.batch_set(keys, src);
  }
  StorageBackend* wrapped() const override { return &inner_; }
  StorageBackend& inner_;
};

// The file store a FileForwarding owns (a base, so that it is built before the Forwarding).
struct OwnedFileStore {
  explicit OwnedFileStore(const std::string& root) : owned_file(FileStorageConfig{.root = root}) {}
  FileStorage owned_file;
};

// A Forwarding in front of a file store of its own, in `root`.
class FileForwarding : private OwnedFileStore, public Forwarding {
 public:
  explicit FileForwarding(const std::string& root)
      : OwnedFileStore(root), Forwarding(owned_file) {}
};

}  // namespace hicache::testing
