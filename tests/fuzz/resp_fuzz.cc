// libFuzzer target: the RESP reply path through the Redis client. A fake server on a loopback
// port answers every connection with the fuzzer's bytes and closes it; a RedisStorage asks it
// for existence, two GETs (whose replies land in caller memory through the record check) and a
// SET. Whatever the bytes (truncated replies, wrong types, huge lengths, nested arrays, records
// for other keys), every key must come back ok, miss or error, the destination bytes of a key
// that is not ok must never be reported as data, and nothing may crash, leak or hang.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "storage/redis_storage.h"

namespace {

class FakeServer {
 public:
  FakeServer() {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = 0;
    if (fd_ < 0 || ::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
        ::listen(fd_, 64) != 0) {
      std::abort();
    }
    socklen_t len = sizeof addr;
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
    // Lives as long as the process (the fuzzer exits without running static destructors).
    std::thread([this] { serve(); }).detach();
  }
  std::uint16_t port() const { return port_; }
  void set_reply(std::string reply) {
    std::lock_guard lock(mu_);
    reply_ = std::move(reply);
  }

 private:
  void serve() {
    for (;;) {
      const int c = ::accept(fd_, nullptr, nullptr);
      if (c < 0) continue;
      std::string reply;
      {
        std::lock_guard lock(mu_);
        reply = reply_;
      }
      char buf[4096];
      (void)::recv(c, buf, sizeof buf, MSG_DONTWAIT);  // some of the request, if it came
      std::size_t off = 0;
      while (off < reply.size()) {
        const ssize_t n = ::send(c, reply.data() + off, reply.size() - off, MSG_NOSIGNAL);
        if (n <= 0) break;
        off += static_cast<std::size_t>(n);
      }
      ::shutdown(c, SHUT_RDWR);
      ::close(c);
    }
  }
  int fd_ = -1;
  std::uint16_t port_ = 0;
  std::mutex mu_;
  std::string reply_;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace hicache;
  static FakeServer* server = new FakeServer();
  server->set_reply(std::string(reinterpret_cast<const char*>(data), size));
  RedisConfig config;
  config.nodes = {{"127.0.0.1", server->port()}};
  config.connections = 1;
  config.io_threads = 1;
  config.timeout = std::chrono::milliseconds(200);
  config.connect_timeout = std::chrono::milliseconds(200);
  config.max_value_bytes = 1 << 20;
  // The server answers every command with the input, the PING at start included: what is
  // fuzzed is the batches' reply path, so the store opens without that check.
  config.check_at_start = false;
  RedisStorage store(config);
  const std::vector<std::string> keys = {"fuzz-a", "fuzz-b"};
  (void)store.batch_exists(keys);
  std::vector<std::byte> a(64, std::byte{0xEE}), b(64, std::byte{0xEE});
  std::vector<ByteSpan> dst = {ByteSpan(a), ByteSpan(b)};
  const auto got = store.batch_get(keys, dst);
  if (got.size() != keys.size()) std::abort();
  const std::vector<std::byte> payload(64, std::byte{0x11});
  const std::vector<ConstByteSpan> src = {ConstByteSpan(payload), ConstByteSpan(payload)};
  const auto set = store.batch_set(keys, src);
  if (set.size() != keys.size()) std::abort();
  return 0;
}
