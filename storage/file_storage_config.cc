// FileStorageConfig's JSON form (the store object of the config schema; keys in
// FileStorageConfig::kJsonKeys, storage/file_storage.h).
#include <cstdint>
#include <string>
#include <string_view>

#include "storage/file_storage.h"
#include "storage/json_fields.h"
#include "transfer/errors.h"

namespace hicache {

FileStorageConfig FileStorageConfig::from_json_text(std::string_view json_text) {
  constexpr std::string_view what = "file storage config";
  const auto j = json_fields::parse_object(json_text, what);
  json_fields::reject_unknown(j, kJsonKeys, what);
  FileStorageConfig c;
  c.root = json_fields::get<std::string>(j, "root", "", what);
  if (c.root.empty()) throw InvalidArgument(str_cat(what, ": 'root' (a directory) is required"));
  c.capacity_bytes = static_cast<std::uint64_t>(
      json_fields::get_int(j, "capacity_bytes", 0, 0, INT64_MAX, what));
  if (j.contains("disk_reserve")) {
    if (!j["disk_reserve"].is_number() || !(j["disk_reserve"].get<double>() >= 0.0) ||
        !(j["disk_reserve"].get<double>() <= 0.9)) {
      throw InvalidArgument(str_cat(what, ": disk_reserve ", j["disk_reserve"].dump(),
                                    " is not a fraction of the filesystem in [0, 0.9]"));
    }
    c.disk_reserve = j["disk_reserve"].get<double>();
  }
  const auto durability = json_fields::get<std::string>(j, "durability", "none", what);
  if (durability == "none") {
    c.durability = Durability::kNone;
  } else if (durability == "group_commit") {
    c.durability = Durability::kGroupCommit;
  } else {
    throw InvalidArgument(str_cat(what, ": durability '", durability,
                                  "' (valid: none, group_commit)"));
  }
  c.io_threads = static_cast<int>(json_fields::get_int(j, "io_threads", 4, 0, 256, what));
  if (j.contains("shared")) c.shared = json_fields::get<bool>(j, "shared", false, what);
  return c;
}

}  // namespace hicache
