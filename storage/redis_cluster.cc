#include "storage/redis_cluster.h"

#include <hiredis/read.h>

#include <array>
#include <charconv>

#include "storage/redis_connection.h"
#include "transfer/errors.h"

namespace hicache::redis {

namespace {

constexpr std::array<std::uint16_t, 256> make_crc16_table() {
  std::array<std::uint16_t, 256> table{};
  for (unsigned i = 0; i < 256; ++i) {
    unsigned crc = i << 8;
    for (int b = 0; b < 8; ++b) crc = (crc & 0x8000u) ? (crc << 1) ^ 0x1021u : crc << 1;
    table[i] = static_cast<std::uint16_t>(crc & 0xFFFFu);
  }
  return table;
}

constexpr auto kCrc16Table = make_crc16_table();

std::optional<std::uint16_t> parse_port(std::string_view text) {
  unsigned value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size() || value < 1 || value > 65535) {
    return std::nullopt;
  }
  return static_cast<std::uint16_t>(value);
}

}  // namespace

std::uint16_t crc16(std::string_view data) {
  std::uint16_t crc = 0;
  for (char c : data) {
    const auto byte = static_cast<std::uint8_t>(c);
    crc = static_cast<std::uint16_t>((crc << 8) ^ kCrc16Table[((crc >> 8) ^ byte) & 0xFFu]);
  }
  return crc;
}

std::uint16_t key_slot(std::string_view key) {
  if (const auto open = key.find('{'); open != std::string_view::npos) {
    const auto close = key.find('}', open + 1);
    if (close != std::string_view::npos && close > open + 1) {
      key = key.substr(open + 1, close - open - 1);
    }
  }
  return static_cast<std::uint16_t>(crc16(key) % kClusterSlots);
}

std::string HostPort::to_string() const {
  return host.find(':') != std::string::npos ? str_cat("[", host, "]:", port)
                                             : str_cat(host, ":", port);
}

std::optional<HostPort> parse_host_port(std::string_view text) {
  const auto colon = text.rfind(':');
  if (colon == std::string_view::npos) return std::nullopt;
  std::string_view host = text.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  const auto port = parse_port(text.substr(colon + 1));
  if (!port) return std::nullopt;
  return HostPort{std::string(host), *port};
}

std::optional<Redirect> parse_redirect(std::string_view error) {
  Redirect r;
  if (error.starts_with("MOVED ")) {
    error.remove_prefix(6);
  } else if (error.starts_with("ASK ")) {
    r.ask = true;
    error.remove_prefix(4);
  } else {
    return std::nullopt;
  }
  const auto space = error.find(' ');
  if (space == std::string_view::npos) return std::nullopt;
  unsigned slot = 0;
  const auto [end, ec] = std::from_chars(error.data(), error.data() + space, slot);
  if (ec != std::errc() || end != error.data() + space || slot >= kClusterSlots) {
    return std::nullopt;
  }
  r.slot = static_cast<std::uint16_t>(slot);
  auto target = parse_host_port(error.substr(space + 1));
  if (!target) return std::nullopt;
  r.target = std::move(*target);
  return r;
}

std::vector<SlotRange> parse_cluster_slots(const RespValue& reply) {
  std::vector<SlotRange> out;
  if (reply.type != REDIS_REPLY_ARRAY) return {};
  for (const auto& entry : reply.elements) {
    // [first, last, [host, port, id, ...], replicas...]
    if (!entry || entry->type != REDIS_REPLY_ARRAY || entry->elements.size() < 3) return {};
    const auto& e = entry->elements;
    const auto& master = e[2];
    if (!e[0] || !e[1] || !master || e[0]->type != REDIS_REPLY_INTEGER ||
        e[1]->type != REDIS_REPLY_INTEGER || master->type != REDIS_REPLY_ARRAY ||
        master->elements.size() < 2 || !master->elements[0] || !master->elements[1] ||
        master->elements[1]->type != REDIS_REPLY_INTEGER) {
      return {};
    }
    const long long first = e[0]->integer, last = e[1]->integer, port = master->elements[1]->integer;
    if (first < 0 || last >= kClusterSlots || first > last || port < 1 || port > 65535) return {};
    SlotRange range{static_cast<int>(first), static_cast<int>(last),
                    {master->elements[0]->str, static_cast<std::uint16_t>(port)}, {}};
    for (std::size_t i = 3; i < e.size(); ++i) {
      const auto& r = e[i];
      if (!r || r->type != REDIS_REPLY_ARRAY || r->elements.size() < 2 || !r->elements[0] ||
          !r->elements[1] || r->elements[1]->type != REDIS_REPLY_INTEGER ||
          r->elements[1]->integer < 1 || r->elements[1]->integer > 65535) {
        continue;
      }
      range.replicas.push_back(
          {r->elements[0]->str, static_cast<std::uint16_t>(r->elements[1]->integer)});
    }
    out.push_back(std::move(range));
  }
  return out;
}

}  // namespace hicache::redis
