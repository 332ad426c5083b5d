// hicache._hicache: the C++ library as a Python extension (pybind11). The Python package
// (python/hicache/) wraps it; see there for the public surface. Each concern registers its own
// classes: buffers.h (how Python memory is read, no classes), store.h (Store, PageLayout,
// IoResult), async_store.h (AsyncStore: batch jobs on C++ threads, LMCache's connector
// surface), cache.h (HiCache, PrefetchOperation). Test doubles live apart, in the test-only
// module hicache._testing (tests/python/testing_module.cc), never in this one.
//
// Memory comes in by pointer and is never copied on the way in: torch tensors (data_ptr) and
// objects with the buffer protocol. The GIL is released around every call that does I/O or
// waits. C++ errors become Python exceptions: InvalidArgument -> ValueError, IoError (a store
// directory that cannot be created or opened) -> OSError, other hicache errors -> RuntimeError;
// per-key I/O results stay values (IoResult).
#include <pybind11/pybind11.h>

#include <exception>

#include "python/binding/async_store.h"
#include "python/binding/cache.h"
#include "python/binding/store.h"
#include "transfer/errors.h"

PYBIND11_MODULE(_hicache, m) {
  namespace py = pybind11;
  using namespace hicache;
  m.doc() = "hicache: hierarchical KV cache (C++ core)";
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const InvalidArgument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const IoError& e) {
      PyErr_SetString(PyExc_OSError, e.what());
    } catch (const Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });
  binding::register_store(m);
  binding::register_cache(m);
  binding::register_async_store(m);
}
