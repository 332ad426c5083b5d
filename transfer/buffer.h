// Buffer: an owned block of memory (device memory, pinned host memory) that frees itself.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <utility>

namespace hicache {

class Buffer {
 public:
  using Release = std::function<void(void* data, std::size_t size)>;

  Buffer() = default;
  // Takes ownership of [data, data + size); `release` is called once when the buffer dies.
  Buffer(void* data, std::size_t size, Release release)
      : data_(data), size_(size), release_(std::move(release)) {}
  Buffer(Buffer&& other) noexcept { swap(other); }
  Buffer& operator=(Buffer&& other) noexcept {
    Buffer tmp(std::move(other));
    swap(tmp);
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() {
    if (data_ != nullptr && release_) release_(data_, size_);
  }

  std::byte* data() const { return static_cast<std::byte*>(data_); }
  std::size_t size() const { return size_; }
  explicit operator bool() const { return data_ != nullptr; }

 private:
  void swap(Buffer& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(size_, other.size_);
    std::swap(release_, other.release_);
  }

  void* data_ = nullptr;
  std::size_t size_ = 0;
  Release release_;
};

}  // namespace hicache
