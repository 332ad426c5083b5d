// error_of(f) (tests): the message of what f() throws, or "(no error)" when it returns, so that
// a test asserts on the words of a refusal.
#pragma once

#include <exception>
#include <string>

namespace hicache {

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace hicache
