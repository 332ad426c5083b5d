// libFuzzer target: every JSON configuration parser. Any input must give a configuration or an
// InvalidArgument naming the problem; any other exception, a crash or a hang is a finding.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "controller/config.h"
#include "storage/file_storage.h"
#include "storage/redis_storage.h"
#include "transfer/errors.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    (void)hicache::HiCacheConfig::from_json_text(text);
  } catch (const hicache::InvalidArgument&) {
  }
  try {
    (void)hicache::RedisConfig::from_json_text(text);
  } catch (const hicache::InvalidArgument&) {
  }
  try {
    (void)hicache::FileStorageConfig::from_json_text(text);
  } catch (const hicache::InvalidArgument&) {
  }
  return 0;
}
