// Errors of hicache. API misuse and bad input raise exceptions derived from hicache::Error,
// whose message names the bad value; expected outcomes of normal operation (a full pool, a
// storage miss) are return values, never exceptions. A function that raises leaves the state
// it was called on unchanged.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace hicache {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A value the caller passed is out of its domain (zero size, unknown name, bad slot).
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

// An operation is illegal in the current state (a page-state transition, a double free).
class StateError : public Error {
 public:
  using Error::Error;
};

// The system refused I/O the caller asked for at set-up: a directory that cannot be created or
// opened, a file that cannot be read. (Per-key storage I/O never throws: it is a result.)
class IoError : public Error {
 public:
  using Error::Error;
};

// The device runtime failed (CUDA error, a stream task that raised, memory refused).
class DeviceError : public Error {
 public:
  using Error::Error;
};

// Concatenates its arguments with operator<< (GCC 12 has no std::format).
template <typename... Args>
std::string str_cat(Args&&... args) {
  std::ostringstream out;
  (out << ... << std::forward<Args>(args));
  return out.str();
}

}  // namespace hicache
