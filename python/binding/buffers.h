// Buffer interop for the extension hicache._hicache: how Python objects become (address, bytes)
// ranges of host or device memory. Nothing here copies: each function only reads the object's
// address and size, checked, so that the caller can hand them to the C++ library.
//
// REQUIRES for every function here: the GIL is held.
// Errors: InvalidArgument naming the bad buffer (its index or `what`) and why it was refused.
#ifndef HICACHE_PYTHON_BINDING_BUFFERS_H_
#define HICACHE_PYTHON_BINDING_BUFFERS_H_

#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace hicache::binding {

namespace py = pybind11;

// One contiguous range of a Python object's memory; `view` keeps a buffer export alive (a
// bytearray cannot be resized under it) until the Region is destroyed, which must happen with
// the GIL held.
struct Region {
  std::byte* data = nullptr;
  std::size_t size = 0;
  std::optional<py::buffer_info> view;
};

// The memory of buffer number `index` of a call: a contiguous torch tensor in host memory
// (data_ptr, no view kept) or a C-contiguous object with the buffer protocol, exported writable
// when `writable` (the call reads into it).
Region region_of(py::handle obj, bool writable, std::size_t index);

// Each element of `keys` as a string (TypeError via pybind11 for a non-string).
std::vector<std::string> keys_of(const py::sequence& keys);

// The first slot of each of `n` pages from SGLang's host_indices (a contiguous int64 tensor on
// the host, page i starting at host_indices[i * page], or a sequence of ints). Refuses fewer
// than n * page indices.
std::vector<std::int64_t> page_slots(py::handle indices, std::size_t n, std::int64_t page);

// Address and byte size of a contiguous tensor on any device (the engine's KV memory); `what`
// names it in errors.
std::pair<void*, std::size_t> tensor_memory(py::handle t, const char* what);

}  // namespace hicache::binding

#endif  // HICACHE_PYTHON_BINDING_BUFFERS_H_
