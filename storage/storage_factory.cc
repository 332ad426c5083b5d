#include <nlohmann/json.hpp>

#include "storage/file_storage.h"
#include "storage/redis_storage.h"
#include "storage/storage_backend.h"
#include "transfer/errors.h"

namespace hicache {

std::unique_ptr<StorageBackend> make_storage(std::string_view json_text) {
  const auto j = nlohmann::json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) {
    throw InvalidArgument(str_cat("storage config is not a JSON object: '", json_text, "'"));
  }
  const auto it = j.find("backend");
  const std::string backend = it != j.end() && it->is_string() ? it->get<std::string>() : "";
  if (backend == "file") return make_file_storage(json_text);
  if (backend == "redis") return make_redis_storage(json_text);
  throw InvalidArgument(str_cat("storage config: backend ",
                                it == j.end() ? std::string("missing") : "'" + it->dump() + "'",
                                "; valid backends: \"file\", \"redis\""));
}

}  // namespace hicache
