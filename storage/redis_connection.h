// The connection layer under RedisStorage (private to storage/): pipelined Redis connections on
// Boost.Asio, with hiredis's reader parsing the replies.
//
// - IoThreads owns its threads, each running its own io_context. Each Connection lives on a strand
//   of one of them, so its state is touched by one handler at a time.
// - A caller builds Requests (RESP bytes, plus for a GET the key and destination span), hands
//   them to Connection::submit and waits on their Completion. Requests on one connection are
//   pipelined: written in one scatter-gather write (a SET's payload is sent from the caller's
//   span, never copied into a buffer of ours; large ones not even into the socket, see
//   ConnectionOptions::splice_min_bytes) and answered in order.
// - Replies are parsed by hiredis's redisReader with our own object functions: a GET's bulk
//   string is checked as a record and its payload copied straight from the reader's buffer into
//   the destination span; integers, statuses and errors land in the Request; only arrays
//   (CLUSTER SLOTS, CONFIG GET) are built as RespValue trees. The reader's and the socket's
//   buffers are kept for the connection's life (reader->maxbuf = 0): no allocation per value.
// - Timeouts: a connection must make progress (bytes of a reply) within timeout of sending or of
//   its last progress, and connect plus handshake within connect_timeout; otherwise it is closed.
//   A closed connection (timeout, socket error, server gone) fails every request it holds with
//   the reason; the next submit reconnects. A failed connect sets a backoff (doubling from
//   backoff_initial up to backoff_max): until it passes, submits fail at once, nobody sleeps.
// - With TLS (ConnectionOptions::tls) a TLS handshake, verifying the server's certificate and
//   name, comes first; its failure is the connect's, with OpenSSL's reason.
// - The handshake (AUTH when a password is set, READONLY for a replica read from, CONFIG GET
//   proto-max-bulk-len) runs before any
//   request is written; a SET whose value is over the server's bulk limit fails without being
//   sent, so the connection stays usable.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "storage/storage_backend.h"
#include "transfer/mutex.h"

namespace boost::asio::ssl {
class context;
}

namespace hicache::redis {

// An array reply (or one of its elements). `type` is a hiredis REDIS_REPLY_* constant.
struct RespValue {
  int type = 0;
  long long integer = 0;
  std::string str;
  std::vector<std::unique_ptr<RespValue>> elements;
};

// Counts the requests of one dispatch still unanswered; the dispatching thread waits on it.
class Completion {
 public:
  explicit Completion(std::size_t requests) : remaining_(requests) {}
  void finish_one();
  void wait();

 private:
  Mutex mu_;
  std::condition_variable cv_;
  std::size_t remaining_ HICACHE_GUARDED_BY(mu_);
};

enum class Outcome : std::uint8_t {
  kPending,
  kNil,          // nil reply (GET of an absent key)
  kInteger,      // `integer`
  kStatus,       // `text` ("OK")
  kString,       // `text`: a bulk string for a request that is not a GET
  kValue,        // GET: a valid record; its payload is in `dst`
  kBadRecord,    // GET: the value is not a valid record for this key and size; `text` says why
  kServerError,  // `text`: the server's error reply (MOVED/ASK included)
  kIoError,      // `text`: the connection failed, timed out, or the value was refused unsent
  kArray,        // `array`
};

// One command and, once finished, its outcome. The submitter owns it and keeps it (and the
// memory its views point to) alive until its Completion is done.
struct Request {
  // What to send: `command`, then when not empty `payload` followed by "\r\n".
  std::string_view command;
  ConstByteSpan payload;
  std::uint64_t bulk_bytes = 0;  // largest bulk string sent (checked against the server limit)
  bool asking = false;           // precede with ASKING (cluster ASK redirect)
  // For a GET: the key the record must hold, and where its payload goes.
  bool is_get = false;
  std::string_view key;
  ByteSpan dst;
  // Routing, owned by the storage layer.
  std::uint16_t slot = 0;
  std::size_t node = 0;
  bool replica_ok = false;  // a read a replica may answer (cluster "read_from_replicas")

  Outcome outcome = Outcome::kPending;
  long long integer = 0;
  std::string text;
  bool unsent = false;  // kIoError without reaching the server (refused here, or shutting down)
  std::unique_ptr<RespValue> array;
  Completion* completion = nullptr;

  void reset_outcome() {
    outcome = Outcome::kPending;
    integer = 0;
    unsent = false;
    text.clear();
    array.reset();
  }
};

// Bytes a bulk-string reply of `len` bytes takes on the wire.
std::size_t bulk_reply_bytes(std::size_t len);

// RESP encoding, appended to `out` (a command is an array head, then one bulk string per
// argument). append_bulk_head writes only "$<len>\r\n", for an argument whose bytes follow from
// elsewhere (a value sent from the caller's span). These run per key on the batch path, so they
// format numbers with std::to_chars rather than a stream.
void append_array_head(std::string& out, std::size_t args);  // "*<args>\r\n"
void append_bulk_head(std::string& out, std::size_t len);    // "$<len>\r\n"
void append_bulk(std::string& out, std::string_view arg);    // "$<len>\r\n<arg>\r\n"

// `threads` threads (at least 1), each running its own io_context, until stop() or destruction.
// A connection is bound to one of them (round robin), for its life.
class IoThreads {
 public:
  explicit IoThreads(int threads);
  ~IoThreads();
  IoThreads(const IoThreads&) = delete;
  IoThreads& operator=(const IoThreads&) = delete;

  // Lets the threads finish the work queued (connections must be shut down first) and joins
  // them. Idempotent.
  void stop();
  // Handlers that threw (the thread carried on; the connection concerned fails its requests at
  // their timeout).
  std::uint64_t handler_failures() const;

  class Impl;
  Impl& impl() { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

struct ConnectionOptions {
  std::string host;
  std::uint16_t port = 0;
  std::chrono::milliseconds timeout{2000};
  std::chrono::milliseconds connect_timeout{1000};
  std::chrono::milliseconds backoff_initial{100};
  std::chrono::milliseconds backoff_max{5000};
  std::string username;  // with password: AUTH username password (an ACL user)
  std::string password;
  // Send READONLY in the handshake: a cluster replica then answers reads of its master's slots.
  bool readonly = false;
  // TLS: every connection runs a TLS handshake with this context (trusted CAs, verification
  // mode, a client certificate) before the Redis handshake; nullptr: plain TCP. Payloads are
  // then copied (splice_min_bytes does not apply).
  std::shared_ptr<boost::asio::ssl::context> tls;
  // The name the server's certificate must carry (a DNS name, or an IP address checked against
  // its IP SANs), also sent as SNI when a DNS name. Empty: `host`.
  std::string tls_server_name;
  // SET payloads of at least this many bytes are sent without a copy: vmsplice'd into a pipe
  // and spliced to the socket, whose packets then reference the caller's pages until the server
  // has read them (it has, once it replies). 0: every byte is copied into the socket.
  std::size_t splice_min_bytes = 0;
};

class Connection {
 public:
  Connection(IoThreads& io, ConnectionOptions options);
  // REQUIRES: shut_down() was called and the IoThreads stopped (or never ran a handler of it).
  ~Connection();
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  // Queues requests (connecting first when needed). Each one finishes exactly once: its outcome
  // is set, then its completion's finish_one() is called. Thread-safe.
  void submit(std::vector<Request*> requests);

  // Closes the socket, fails whatever is queued or pending, and fails later submits. Thread-safe;
  // takes effect on the connection's strand.
  void shut_down();

  const std::string& name() const;  // "host:port"
  // Payload bytes handed to the socket without a copy (spliced) so far.
  std::uint64_t spliced_bytes() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace hicache::redis
