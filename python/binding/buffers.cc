// See buffers.h.
#include "python/binding/buffers.h"

#include "transfer/errors.h"

namespace hicache::binding {

Region region_of(py::handle obj, bool writable, std::size_t index) {
  Region r;
  if (py::hasattr(obj, "data_ptr") && py::hasattr(obj, "element_size")) {  // a torch tensor
    if (py::str(obj.attr("device").attr("type")).cast<std::string>() != "cpu") {
      throw InvalidArgument(str_cat("buffer ", index, ": a tensor on ",
                                    py::str(obj.attr("device")).cast<std::string>(),
                                    ", not in host memory"));
    }
    if (!obj.attr("is_contiguous")().cast<bool>()) {
      throw InvalidArgument(str_cat("buffer ", index, ": the tensor is not contiguous"));
    }
    r.data = reinterpret_cast<std::byte*>(obj.attr("data_ptr")().cast<std::uintptr_t>());
    r.size =
        obj.attr("numel")().cast<std::size_t>() * obj.attr("element_size")().cast<std::size_t>();
    return r;
  }
  if (!PyObject_CheckBuffer(obj.ptr())) {
    throw InvalidArgument(str_cat("buffer ", index, ": a ",
                                  py::str(py::type::of(obj).attr("__name__")).cast<std::string>(),
                                  " is neither a tensor nor an object with the buffer protocol"));
  }
  py::buffer b = py::reinterpret_borrow<py::buffer>(obj);
  py::buffer_info info;
  try {
    info = b.request(writable);
  } catch (py::error_already_set& e) {  // BufferError: not writable, or no such view
    throw InvalidArgument(
        str_cat("buffer ", index, writable ? " (read into)" : "", ": ", e.what()));
  }
  py::ssize_t stride = info.itemsize;
  for (py::ssize_t d = info.ndim - 1; d >= 0; --d) {  // C order only
    if (info.shape[d] != 1 && info.strides[d] != stride) {
      throw InvalidArgument(str_cat("buffer ", index, ": not C-contiguous"));
    }
    stride *= info.shape[d];
  }
  r.data = static_cast<std::byte*>(info.ptr);
  r.size = static_cast<std::size_t>(info.size * info.itemsize);
  r.view.emplace(std::move(info));
  return r;
}

std::vector<std::string> keys_of(const py::sequence& keys) {
  std::vector<std::string> out;
  out.reserve(keys.size());
  for (py::handle k : keys) out.push_back(k.cast<std::string>());
  return out;
}

std::vector<std::int64_t> page_slots(py::handle indices, std::size_t n, std::int64_t page) {
  std::vector<std::int64_t> out(n);
  if (py::hasattr(indices, "data_ptr")) {
    const auto dtype = py::str(indices.attr("dtype")).cast<std::string>();
    if (dtype != "torch.int64" || !indices.attr("is_contiguous")().cast<bool>() ||
        py::str(indices.attr("device").attr("type")).cast<std::string>() != "cpu") {
      throw InvalidArgument(str_cat(
          "hicache: host_indices must be a contiguous int64 tensor on the host, not ", dtype));
    }
    const auto count = indices.attr("numel")().cast<std::size_t>();
    if (count < n * static_cast<std::size_t>(page)) {
      throw InvalidArgument(str_cat("hicache: ", n, " keys need ",
                                    n * static_cast<std::size_t>(page), " host indices, got ",
                                    count));
    }
    const auto* p =
        reinterpret_cast<const std::int64_t*>(indices.attr("data_ptr")().cast<std::uintptr_t>());
    for (std::size_t i = 0; i < n; ++i) out[i] = p[i * static_cast<std::size_t>(page)];
    return out;
  }
  const auto seq = py::reinterpret_borrow<py::sequence>(indices);
  if (seq.size() < n * static_cast<std::size_t>(page)) {
    throw InvalidArgument(str_cat("hicache: ", n, " keys need ", n * static_cast<std::size_t>(page),
                                  " host indices, got ", seq.size()));
  }
  for (std::size_t i = 0; i < n; ++i)
    out[i] = seq[i * static_cast<std::size_t>(page)].cast<std::int64_t>();
  return out;
}

std::pair<void*, std::size_t> tensor_memory(py::handle t, const char* what) {
  if (!py::hasattr(t, "data_ptr") || !py::hasattr(t, "element_size")) {
    throw InvalidArgument(str_cat(what, ": a tensor, not a ",
                                  py::str(py::type::of(t).attr("__name__")).cast<std::string>()));
  }
  if (!t.attr("is_contiguous")().cast<bool>()) {
    throw InvalidArgument(str_cat(what, ": the tensor is not contiguous"));
  }
  return {reinterpret_cast<void*>(t.attr("data_ptr")().cast<std::uintptr_t>()),
          t.attr("numel")().cast<std::size_t>() * t.attr("element_size")().cast<std::size_t>()};
}

}  // namespace hicache::binding
