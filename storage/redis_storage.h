// RedisStorage: the L3 tier on Redis, one server or a Redis Cluster shared by many engines.
//
// - Every value is a record (storage/record.h): header + key + payload. A GET reply is checked
//   and its payload copied from the reply parser's buffer into the caller's span; a value that is
//   not a valid record for the key and span size is a miss, counted in bad_records and DELeted.
// - A batch costs about one round trip: its commands are pipelined. Each node has a pool of
//   `connections` connections; a batch is split over them by bytes, so large values travel over
//   several sockets in parallel rather than down one deep pipeline (docs/design-notes.md). SET
//   payloads are sent from the caller's spans by scatter-gather writes, never copied; socket and
//   parser buffers live as long as their connection.
// - SET payloads of zero_copy_min_bytes (64 KiB) and more are not copied into the socket:
//   vmsplice + splice hand the kernel references to the caller's pages (256 KiB SETs on the
//   3-node cluster: client CPU 0.23 -> 0.18 s per GiB, +11% throughput). A batch returns once
//   the server has replied to each value, i.e. read it, so the caller may reuse its pages at
//   once. A failed batch (timeout, lost connection) resets the connection, which drops what the
//   kernel still had to send; bytes the server had already received may still be read by it,
//   from pages the caller has changed since: the record's checksum, computed over the bytes the
//   caller passed, then fails, and the record reads as a miss and is removed, never as data.
//   Pages the kernel cannot reference (a device mapping) are copied instead.
// - Threads: `io_threads` threads, each running its own io_context (0, the default: one per 4
//   CPUs, 1 to 4, at least 2 for a cluster, so that on a small machine the store does not take
//   redis-server's core); each connection is bound to one of them, round robin. A
//   calling thread builds its requests, hands them to the connections and waits for them; calls
//   from many threads run concurrently and share the connections' pipelines.
// - Faults are per-key results, never exceptions: a connection that fails, is closed or makes no
//   progress for timeout_ms fails the requests it holds with the reason; the next batch
//   reconnects. A failed connect blocks further attempts to that node for a backoff that doubles
//   from reconnect_backoff_ms[0] to [1] (requests fail at once meanwhile; nobody sleeps).
// - A record larger than max_value_bytes, or than the server's proto-max-bulk-len (read at
//   connect), is a per-key error naming both sizes and is not sent.
// - batch_set sends values as MSETNX, which the server refuses for a stored key, so no page is
//   stored twice; while recent batches found their keys stored it asks EXISTS first (one
//   pipelined round) and sends only the absent keys' values (see RedisStorage::Impl::set).
// - Cluster ("cluster": true): the slot map comes from CLUSTER SLOTS of a seed node, keys are
//   routed by CRC16 slot (hash tags honoured) and a batch is split per node. MOVED updates the
//   map (and refreshes it), ASK is followed with ASKING; up to 5 redirects per key.
// - Failover: a request that fails on its connection (the master is down), or with CLUSTERDOWN
//   or TRYAGAIN, makes the client re-read the slot map (at most every 50 ms however many
//   batches fail) and go again when its slot now has another master. Until a replica is promoted
//   (the cluster's node timeout, plus its election) such requests are per-key errors; then they
//   succeed, and keys the dead master had not yet replicated read as misses.
// - "read_from_replicas": GET and EXISTS go to a replica of their slot (connections that send
//   READONLY), writes and DEL to the master. A replica lags its master: a key written a moment
//   ago may read as absent there (a miss, never wrong bytes: a record is checked against its
//   key). A replica that no longer serves the slot answers MOVED and the master is asked.
// - clear() sends FLUSHDB to the server (every master of a cluster): it assumes the database is
//   dedicated to this store. Best effort; failures are not reported.
//
// JSON: {"backend": "redis", "host": "127.0.0.1", "port": 6379, "cluster": false,
//        "nodes": ["host:port", ...] (instead of host/port: the seeds of a cluster),
//        "connections": 4, "io_threads": 0, "timeout_ms": 2000, "connect_timeout_ms": 1000,
//        "reconnect_backoff_ms": [100, 5000], "username": "", "password": "",
//        "max_value_bytes": 536870912,
//        "zero_copy_min_bytes": 65536, "check_at_start": true, "read_from_replicas": false,
//        "tls": {"ca_file": "", "cert_file": "", "key_file": "", "server_name": "",
//                "verify": true}}  ("tls" present: TLS on; zero_copy_min_bytes does not apply)
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "storage/storage_backend.h"

namespace hicache {

struct RedisEndpoint {
  std::string host;
  std::uint16_t port = 0;
};

// TLS to every node (Boost.Asio's SSL over OpenSSL). The server's certificate is verified by
// default: it must chain to `ca_file` (PEM; empty: the system's trusted CAs) and carry the node's
// name (`server_name`, or the host each node is reached at: a DNS name, or an IP address matched
// against the certificate's IP SANs). A client certificate (`cert_file` and `key_file`, PEM) is
// presented when given, for servers with tls-auth-clients. A bad file is an error at start
// naming it.
struct RedisTlsConfig {
  bool enabled = false;
  std::string ca_file;
  std::string cert_file;
  std::string key_file;
  std::string server_name;
  bool verify = true;  // false: any certificate is accepted (testing only)

  // The keys of the "tls" object (any other is refused; tests hold a row per key).
  static constexpr std::array<std::string_view, 5> kJsonKeys = {
      "ca_file", "cert_file", "key_file", "server_name", "verify"};
};

struct RedisConfig {
  std::vector<RedisEndpoint> nodes{{"127.0.0.1", 6379}};  // one server, or the cluster's seeds
  bool cluster = false;
  int connections = 4;  // per node
  int io_threads = 0;   // 0: one per 4 CPUs, 1 (cluster: 2) to 4 (config() shows the number)
  std::chrono::milliseconds timeout{2000};
  std::chrono::milliseconds connect_timeout{1000};
  std::chrono::milliseconds backoff_initial{100};
  std::chrono::milliseconds backoff_max{5000};
  // AUTH at connect when `password` is set: as an ACL user (Redis 6+) with `username`, else
  // as the default user. A username without a password is refused at parse.
  std::string username;
  std::string password;
  std::uint64_t max_value_bytes = 512ull << 20;  // record bytes (header + key + payload)
  // Payloads of at least this many bytes are sent without copying them into the socket (see
  // redis::ConnectionOptions::splice_min_bytes); 0 copies every byte.
  std::uint64_t zero_copy_min_bytes = 64 << 10;
  // At construction, PING every node (a cluster: after reading its slot map): a store that
  // cannot be reached, or refuses the password, is an IoError at start naming the node and the
  // cause. false: start anyway; batches fail per key and reconnect as they go (a fleet that
  // prefers to serve without L3 until it comes back).
  bool check_at_start = true;
  // Cluster only: reads (GET, EXISTS) from replicas (see above).
  bool read_from_replicas = false;
  RedisTlsConfig tls;

  // The keys of the JSON object (from_json_text refuses any other; "tls" is an object of
  // RedisTlsConfig::kJsonKeys; tests hold a row per key).
  static constexpr std::array<std::string_view, 17> kJsonKeys = {
      "backend", "host", "port", "cluster", "nodes", "connections", "io_threads", "timeout_ms",
      "connect_timeout_ms", "reconnect_backoff_ms", "username", "password", "max_value_bytes",
      "zero_copy_min_bytes", "check_at_start", "read_from_replicas", "tls"};

  // Throws InvalidArgument naming an unknown field or a bad value, listing the valid fields.
  static RedisConfig from_json_text(std::string_view json_text);
};

class RedisStorage final : public StorageBackend {
 public:
  // In cluster mode asks the seeds for the slot map; with check_at_start (the default) PINGs
  // every node and throws IoError when one cannot be reached or refuses the password. Without
  // it connects lazily (a cluster that cannot be reached yet is retried by later batches, whose
  // keys go to the first seed until then).
  explicit RedisStorage(RedisConfig config);
  // Closes every connection and joins the I/O threads. REQUIRES: no call in progress.
  ~RedisStorage() override;

  std::string_view name() const override { return "redis"; }
  std::size_t batch_exists(std::span<const std::string> keys) override;
  // Every key in one pipelined round trip (EXISTS per key).
  std::vector<bool> exists_each(std::span<const std::string> keys) override;
  bool remove(const std::string& key) override;
  // TOUCH of each key (StorageBackend::touch), one pipelined round trip per node; under
  // allkeys-lru / allkeys-lfu the server then counts the chain as just used.
  void touch(std::span<const std::string> keys) override;
  bool touch_does_io() const override { return true; }
  void clear() override;

  const RedisConfig& config() const { return config_; }
  // Payload bytes sent without a copy so far (see RedisConfig::zero_copy_min_bytes).
  std::uint64_t zero_copy_bytes() const;
  // About 4 MiB, and at least one page per connection of a node: deep pipelines of large values
  // cost redis-server more per byte (docs/performance.md has the figures).
  std::int64_t preferred_batch_pages(std::int64_t page_bytes) const override;

 protected:
  std::vector<IoResult> do_batch_get(std::span<const std::string> keys,
                                     std::span<const ByteSpan> dst) override;
  std::vector<IoResult> do_batch_set(std::span<const std::string> keys,
                                     std::span<const ConstByteSpan> src) override;

 private:
  class Impl;
  RedisConfig config_;
  std::unique_ptr<Impl> impl_;
};

std::unique_ptr<StorageBackend> make_redis_storage(std::string_view json_text);

}  // namespace hicache
