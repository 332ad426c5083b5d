// Redis Cluster routing helpers (private to storage/): key slots, redirect errors and the
// CLUSTER SLOTS reply. See https://redis.io/docs/reference/cluster-spec/.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace hicache::redis {

inline constexpr int kClusterSlots = 16384;

// CRC16-XMODEM (polynomial 0x1021, initial value 0), the cluster's key hash:
// crc16("123456789") == 0x31C3.
std::uint16_t crc16(std::string_view data);

// The cluster slot of a key: crc16 of the hash tag (the part between the first '{' and the
// next '}', when not empty) or of the whole key, modulo 16384.
std::uint16_t key_slot(std::string_view key);

struct HostPort {
  std::string host;
  std::uint16_t port = 0;
  std::string to_string() const;
};

// "host:port" or "[v6addr]:port"; nullopt when malformed or the port is outside 1..65535.
std::optional<HostPort> parse_host_port(std::string_view text);

// A MOVED or ASK error reply: "MOVED <slot> <host>:<port>" / "ASK <slot> <host>:<port>". The host
// may be empty (the server does not know its address): the caller fills in the one it asked.
struct Redirect {
  bool ask = false;
  std::uint16_t slot = 0;
  HostPort target;
};
std::optional<Redirect> parse_redirect(std::string_view error);

struct RespValue;
struct SlotRange {
  int first = 0;
  int last = 0;
  HostPort master;                 // host may be empty (see Redirect)
  std::vector<HostPort> replicas;  // the same; a malformed replica entry is left out
};
// The ranges of a CLUSTER SLOTS reply with their masters and replicas; empty when the reply is
// not one.
std::vector<SlotRange> parse_cluster_slots(const RespValue& reply);

}  // namespace hicache::redis
