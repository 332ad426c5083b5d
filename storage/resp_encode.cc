// RESP encoding (storage/redis_connection.h): commands as arrays of bulk strings, and the size
// of a bulk reply, formatted with std::to_chars (these run per key on the batch path).
#include <charconv>
#include <cstddef>
#include <string>
#include <string_view>

#include "storage/redis_connection.h"

namespace hicache::redis {

std::size_t bulk_reply_bytes(std::size_t len) {
  std::size_t digits = 1;
  for (std::size_t v = len; v >= 10; v /= 10) ++digits;
  return 1 + digits + 2 + len + 2;  // "$<len>\r\n<bytes>\r\n"
}

namespace {

void append_count(std::string& out, char kind, std::size_t n) {
  char buf[24];
  buf[0] = kind;
  char* end = std::to_chars(buf + 1, buf + sizeof(buf) - 2, n).ptr;
  *end++ = '\r';
  *end++ = '\n';
  out.append(buf, end);
}

}  // namespace

void append_array_head(std::string& out, std::size_t args) { append_count(out, '*', args); }
void append_bulk_head(std::string& out, std::size_t len) { append_count(out, '$', len); }

void append_bulk(std::string& out, std::string_view arg) {
  append_count(out, '$', arg.size());
  out += arg;
  out += "\r\n";
}

}  // namespace hicache::redis
