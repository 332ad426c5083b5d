// Uses the installed headers and library: a host pool round trip with verified bytes.
#include <cstdio>

#include "hicache/pools/host_kv_pool.h"
#include "hicache/pools/kv_pattern.h"
#include "hicache/transfer/device.h"

int main() {
  auto device = hicache::Device::create("host");
  auto geometry = hicache::KVGeometry::mha(2, 2, 16, hicache::DType::kBFloat16, 16);
  hicache::HostKVPool pool(*device, geometry, hicache::HostLayout::kPageFirst, 64);
  auto slots = pool.alloc(16);
  if (!slots) return 1;
  hicache::fill_page(pool.layout(), (*slots)[0] / 16, 42);
  const bool ok = hicache::verify_page(pool.layout(), (*slots)[0] / 16, 42);
  pool.free(*slots);
  std::printf("consumer: find_package(hicache) works, page verified: %s\n", ok ? "yes" : "no");
  return ok ? 0 : 1;
}
