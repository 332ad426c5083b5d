// A shared object built by the cxx_runtime tests with -static-libstdc++: what a toolchain that
// links the C++ runtime statically makes of libhicache.so (cmake/check_cxx_runtime.cmake).
#include <sstream>
#include <string>

std::string hicache_cxx_runtime_probe(int x) {
  std::ostringstream out;
  out << x;
  return out.str();
}
