// Helpers for reading JSON configuration objects (nlohmann::json) with errors that name the bad
// key and value. Private to the library's .cc files: public headers stay free of nlohmann.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <set>
#include <span>
#include <string>
#include <string_view>

#include "transfer/errors.h"

namespace hicache::json_fields {

// Parses text that must hold a JSON object; `what` names the config in the error.
inline nlohmann::json parse_object(std::string_view text, std::string_view what) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    // parse_error, and out_of_range for a number too large for any type (found by fuzzing).
    throw InvalidArgument(str_cat(what, ": not valid JSON: ", e.what()));
  }
  if (!j.is_object()) throw InvalidArgument(str_cat(what, ": the top level must be a JSON object"));
  return j;
}

// Throws InvalidArgument naming the first key of `object` not in `known`, listing the valid ones.
inline void reject_unknown(const nlohmann::json& object, std::span<const std::string_view> known,
                           std::string_view what) {
  const std::set<std::string_view> valid_keys(known.begin(), known.end());
  for (const auto& [key, value] : object.items()) {
    if (valid_keys.count(key) == 0) {
      std::string valid;
      for (const std::string_view k : valid_keys) valid += str_cat(valid.empty() ? "" : ", ", k);
      throw InvalidArgument(str_cat(what, ": unknown key '", key, "' (valid: ", valid, ")"));
    }
  }
}

template <typename T>
T get(const nlohmann::json& object, const char* key, T fallback, std::string_view what) {
  auto it = object.find(key);
  if (it == object.end()) return fallback;
  try {
    return it->get<T>();
  } catch (const nlohmann::json::exception&) {
    throw InvalidArgument(str_cat(what, ": key '", key, "' has a value of the wrong type: ",
                                  it->dump()));
  }
}

// An integer in [lo, hi].
inline std::int64_t get_int(const nlohmann::json& object, const char* key, std::int64_t fallback,
                            std::int64_t lo, std::int64_t hi, std::string_view what) {
  const auto it = object.find(key);
  if (it != object.end() && !it->is_number_integer()) {
    throw InvalidArgument(str_cat(what, ": key '", key, "' must be an integer, got ", it->dump()));
  }
  const auto v = get<std::int64_t>(object, key, fallback, what);
  if (v < lo || v > hi) {
    throw InvalidArgument(str_cat(what, ": key '", key, "' = ", v, " is outside [", lo, ", ", hi,
                                  "]"));
  }
  return v;
}

}  // namespace hicache::json_fields
