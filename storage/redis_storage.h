// RedisStorage: placeholder until the Redis client lands.
#pragma once

#include <memory>
#include <string_view>

#include "storage/storage_backend.h"

namespace hicache {

std::unique_ptr<StorageBackend> make_redis_storage(std::string_view json_text);

}  // namespace hicache
