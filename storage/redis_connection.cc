#include "storage/redis_connection.h"

#include <fcntl.h>
#include <hiredis/read.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/write.hpp>
#include <cerrno>
#include <cstring>
#include <deque>
#include <limits>
#include <new>
#include <system_error>
#include <thread>

#include "storage/record.h"
#include "storage/redis_io_threads.h"
#include "transfer/errors.h"

namespace hicache::redis {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
// Owns its socket: operations of a torn-down connection's stream can reach only that closed
// socket, never the one the next connection opens.
using TlsStream = asio::ssl::stream<tcp::socket>;
using Clock = std::chrono::steady_clock;
using boost::system::error_code;

void Completion::finish_one() {
  // Notified under the lock: the waiter cannot return (and destroy *this) before we let go.
  MutexLock lock(mu_);
  if (--remaining_ == 0) cv_.notify_all();
}

void Completion::wait() {
  MutexLock lock(mu_);
  while (remaining_ != 0) mu_.wait(cv_);
}

namespace {

constexpr std::string_view kAsking = "*1\r\n$6\r\nASKING\r\n";
constexpr std::string_view kReadonly = "*1\r\n$8\r\nREADONLY\r\n";
constexpr std::string_view kCrlf = "\r\n";
constexpr std::string_view kAskingReply = "+OK\r\n";
constexpr std::string_view kProtocolErrorPrefix = "ERR Protocol error";
constexpr std::size_t kReadChunk = 256 * 1024;
// The reader compacts its buffer (a memmove of what is left) after each reply once 1 KiB is
// consumed; feeding it about one reply at a time keeps that memmove short.
constexpr std::size_t kMinFeed = 1024;

std::string resp_command(std::initializer_list<std::string_view> args) {
  std::string out;
  append_array_head(out, args.size());
  for (std::string_view a : args) append_bulk(out, a);
  return out;
}


constexpr std::size_t kMaxIovecs = 1024;  // IOV_MAX on Linux

// The pipe a connection splices large payloads through. Without one (pipe() refused), payloads
// are copied like the rest.
struct SplicePipe {
  int read_end = -1;
  int write_end = -1;
  std::size_t capacity = 0;  // bytes the pipe holds: one vmsplice moves at most this much
  std::size_t in_pipe = 0;   // bytes vmspliced in and not yet spliced out

  SplicePipe() = default;
  SplicePipe(const SplicePipe&) = delete;
  SplicePipe& operator=(const SplicePipe&) = delete;
  ~SplicePipe() { close(); }

  bool ready() const { return write_end >= 0; }

  void open() {
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0) return;
    read_end = fds[0];
    write_end = fds[1];
    // 256 KiB moves a 256 KiB page in one call and keeps a process's pipes (one a connection)
    // well inside the per-user pipe-user-pages-soft; a pipe left at 64 KiB (the size refused)
    // still works, in more calls.
    const int size = ::fcntl(write_end, F_SETPIPE_SZ, 256 << 10);
    const int got = size > 0 ? size : ::fcntl(write_end, F_GETPIPE_SZ);
    capacity = got > 0 ? static_cast<std::size_t>(got) : 4096;
  }

  void close() {
    if (read_end >= 0) ::close(read_end);
    if (write_end >= 0) ::close(write_end);
    read_end = write_end = -1;
    in_pipe = 0;
  }
};

// Top-level replies are stored in place into the request they answer; this object stands for
// "handled" towards hiredis, which needs a non-null pointer.
char g_in_place;
void* const kInPlace = &g_in_place;

}  // namespace

class Connection::Impl {
 public:
  Impl(asio::io_context& io, ConnectionOptions options)
      : opt_(std::move(options)),
        name_(str_cat(opt_.host, ":", opt_.port)),
        strand_(asio::make_strand(io)),
        socket_(strand_),
        timer_(strand_),
        resolver_(strand_),
        read_buf_(kReadChunk),
        backoff_(opt_.backoff_initial) {
    reset_reader();
    if (!opt_.password.empty()) {
      auth_.command = auth_command_ =
          opt_.username.empty() ? resp_command({"AUTH", opt_.password})
                                : resp_command({"AUTH", opt_.username, opt_.password});
    }
    if (opt_.readonly) readonly_.command = kReadonly;
    config_command_ = resp_command({"CONFIG", "GET", "proto-max-bulk-len"});
    config_.command = config_command_;
  }

  ~Impl() {
    if (reader_ != nullptr) redisReaderFree(reader_);
  }

  const std::string& name() const { return name_; }
  std::uint64_t spliced_bytes() const { return spliced_bytes_.load(std::memory_order_relaxed); }

  void submit(std::vector<Request*> requests) {
    asio::post(strand_, [this, reqs = std::move(requests)] { on_submit(reqs); });
  }

  void shut_down() {
    asio::post(strand_, [this] {
      closed_ = true;
      teardown(str_cat(name_, ": storage is shutting down"));
    });
  }

 private:
  enum class State : std::uint8_t { kIdle, kConnecting, kTls, kHandshake, kReady };
  struct Pending {
    Request* req;
    bool asking_reply;        // the +OK of the ASKING sent before req
    std::uint64_t write_seq;  // the write that carries it
  };

  // ---- submission and writing ----

  void on_submit(const std::vector<Request*>& reqs) {
    if (closed_) {
      for (Request* r : reqs) {
        finish_error(r, str_cat(name_, ": storage is shutting down"), /*unsent=*/true);
      }
      return;
    }
    if (state_ == State::kIdle) {
      const auto now = Clock::now();
      if (now < next_connect_) {
        const auto wait =
            std::chrono::duration_cast<std::chrono::milliseconds>(next_connect_ - now).count();
        for (Request* r : reqs) {
          finish_error(r, str_cat(last_error_, " (next attempt in ", wait, " ms)"));
        }
        return;
      }
      queued_.insert(queued_.end(), reqs.begin(), reqs.end());
      start_connect();
      return;
    }
    queued_.insert(queued_.end(), reqs.begin(), reqs.end());
    start_write();
  }

  void start_write() {
    if (writing_ || state_ != State::kReady || queued_.empty()) return;
    write_bufs_.clear();
    splices_.clear();
    const bool was_idle = pending_.empty();
    for (Request* r : queued_) {
      if (server_max_bulk_ != 0 && r->bulk_bytes > server_max_bulk_) {
        finish_error(r, str_cat(name_, ": value of ", r->bulk_bytes,
                                " bytes exceeds the server's proto-max-bulk-len of ",
                                server_max_bulk_, " bytes; not sent"),
                     /*unsent=*/true);
        continue;
      }
      if (r->asking) {
        write_bufs_.push_back(asio::buffer(kAsking));
        pending_.push_back({r, true, write_seq_ + 1});
      }
      write_bufs_.push_back(asio::buffer(r->command));
      if (!r->payload.empty()) {
        if (opt_.splice_min_bytes != 0 && r->payload.size() >= opt_.splice_min_bytes) {
          splices_.push_back(write_bufs_.size());
        }
        write_bufs_.push_back(asio::buffer(r->payload.data(), r->payload.size()));
        write_bufs_.push_back(asio::buffer(kCrlf));
      }
      pending_.push_back({r, false, write_seq_ + 1});
    }
    queued_.clear();
    if (write_bufs_.empty()) return;
    if (was_idle) {
      deadline_ = Clock::now() + opt_.timeout;
      arm_timer();
    }
    write_now();
  }

  void write_now() {
    writing_ = true;
    const auto gen = gen_;
    const auto seq = ++write_seq_;
    if (!splices_.empty() && splice_.ready()) {
      cursor_ = {};
      continue_spliced_write(gen, seq);
      return;
    }
    auto done = [this, gen, seq, keep = tls_](const error_code& ec, std::size_t) {
      on_write_done(gen, seq, ec ? ec.message() : std::string());
    };
    // Everything, in as few system calls as the socket takes (asio::transfer_all() caps each
    // writev at 64 KiB: a pipeline of 256 KiB values cost 16 calls per MiB and a third of the
    // SET throughput redis-benchmark gets from one send per pipeline), and nothing more once
    // the connection was torn down: the buffers are the failed requests', which their callers
    // may have freed. The condition runs on the strand before each step.
    auto more = [this, gen](const error_code& ec, std::size_t) -> std::size_t {
      return ec || gen != gen_ ? 0 : std::numeric_limits<std::size_t>::max();
    };
    on_stream([&](auto& stream) {
      asio::async_write(stream, write_bufs_, more, std::move(done));
    });
  }

  void on_write_done(std::uint64_t gen, std::uint64_t seq, const std::string& error) {
    if (gen != gen_) return;
    writing_ = false;
    if (!error.empty()) {
      // A TLS 1.3 server checks the client's certificate after the client's handshake is done,
      // then sends its alert ("certificate required") and closes; the handshake's commands can
      // meet that close first. The read in flight delivers the alert (or the close), and the
      // connect deadline bounds it: the reader names the cause.
      if (tls_ && state_ == State::kHandshake) return;
      fail(str_cat(name_, ": write failed: ", error));
      return;
    }
    written_seq_ = seq;
    finish_answered();
    if (gen == gen_) start_write();
  }

  // ---- zero-copy payloads (see ConnectionOptions::splice_min_bytes) ----
  // write_bufs_ is sent in order; the buffers listed in splices_ (large SET payloads) go through
  // the connection's pipe (vmsplice: the pipe references the caller's pages; splice: the socket's
  // packets reference them in turn), everything else by sendmsg. The socket is non-blocking: a
  // full send buffer parks the write until the socket is writable again.

  struct WriteCursor {
    std::size_t buf = 0;     // the buffer being sent
    std::size_t offset = 0;  // its bytes handed to the socket (copied) or to the pipe (spliced)
    std::size_t next_splice = 0;  // index into splices_ of the next spliced buffer
  };

  void continue_spliced_write(std::uint64_t gen, std::uint64_t seq) {
    for (;;) {
      if (cursor_.buf >= write_bufs_.size()) {
        on_write_done(gen, seq, {});
        return;
      }
      const bool spliced =
          cursor_.next_splice < splices_.size() && splices_[cursor_.next_splice] == cursor_.buf;
      const StepResult step = spliced ? splice_step() : send_step();
      if (step == StepResult::kProgress) continue;
      if (step == StepResult::kBlocked) {
        socket_.async_wait(tcp::socket::wait_write, [this, gen, seq](const error_code& ec) {
          if (gen != gen_) return;
          if (ec) {
            on_write_done(gen, seq, ec.message());
            return;
          }
          continue_spliced_write(gen, seq);
        });
        return;
      }
      on_write_done(gen, seq, write_error_);
      return;
    }
  }

  enum class StepResult : std::uint8_t { kProgress, kBlocked, kFailed };

  StepResult failed_step(const char* call, int err) {
    write_error_ = str_cat(call, ": ", std::error_code(err, std::system_category()).message());
    return StepResult::kFailed;
  }

  // Sends the copied buffers from the cursor up to the next spliced one (or the end). None is
  // empty (commands, CRLF, ASKING), so every call sends at least a byte or blocks.
  StepResult send_step() {
    iovecs_.clear();
    const std::size_t stop =
        cursor_.next_splice < splices_.size() ? splices_[cursor_.next_splice] : write_bufs_.size();
    for (std::size_t b = cursor_.buf; b < stop && iovecs_.size() < kMaxIovecs; ++b) {
      const std::size_t skip = b == cursor_.buf ? cursor_.offset : 0;
      iovecs_.push_back({const_cast<char*>(static_cast<const char*>(write_bufs_[b].data())) + skip,
                         write_bufs_[b].size() - skip});
    }
    if (iovecs_.empty()) {  // the cursor stands on a spliced buffer: a bug, not progress
      write_error_ = "internal: no bytes to send at the write cursor";
      return StepResult::kFailed;
    }
    msghdr msg{};
    msg.msg_iov = iovecs_.data();
    msg.msg_iovlen = iovecs_.size();
    // More follows (a payload): let the kernel hold this command head for the payload's packets.
    const int more = stop < write_bufs_.size() ? MSG_MORE : 0;
    const ssize_t n = ::sendmsg(socket_.native_handle(), &msg, MSG_NOSIGNAL | MSG_DONTWAIT | more);
    if (n < 0) {
      if (errno == EINTR) return StepResult::kProgress;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return StepResult::kBlocked;
      return failed_step("sendmsg", errno);
    }
    advance_copied(static_cast<std::size_t>(n));
    return StepResult::kProgress;
  }

  void advance_copied(std::size_t n) {
    while (n > 0) {
      const std::size_t left = write_bufs_[cursor_.buf].size() - cursor_.offset;
      if (n < left) {
        cursor_.offset += n;
        return;
      }
      n -= left;
      ++cursor_.buf;
      cursor_.offset = 0;
    }
  }

  // Moves the spliced buffer at the cursor on: into the pipe when it is empty, then from the pipe
  // to the socket.
  StepResult splice_step() {
    const auto& buf = write_bufs_[cursor_.buf];
    if (splice_.in_pipe == 0) {
      const std::size_t left = buf.size() - cursor_.offset;
      if (left == 0) {
        ++cursor_.buf;
        ++cursor_.next_splice;
        cursor_.offset = 0;
        return StepResult::kProgress;
      }
      iovec v{const_cast<char*>(static_cast<const char*>(buf.data())) + cursor_.offset,
              std::min(left, splice_.capacity)};
      const ssize_t m = ::vmsplice(splice_.write_end, &v, 1, SPLICE_F_NONBLOCK);
      if (m < 0) {
        if (errno == EINTR) return StepResult::kProgress;
        // Pages the kernel cannot reference (a device mapping: EFAULT; ENOMEM): the rest of this
        // payload is copied by send_step like any other buffer, from where the pipe left it.
        ++cursor_.next_splice;
        return StepResult::kProgress;
      }
      splice_.in_pipe = static_cast<std::size_t>(m);
      cursor_.offset += static_cast<std::size_t>(m);
    }
    const bool more = cursor_.offset < buf.size() || cursor_.buf + 1 < write_bufs_.size();
    const ssize_t q = ::splice(splice_.read_end, nullptr, socket_.native_handle(), nullptr,
                               splice_.in_pipe, SPLICE_F_NONBLOCK | (more ? SPLICE_F_MORE : 0));
    if (q < 0) {
      if (errno == EINTR) return StepResult::kProgress;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return StepResult::kBlocked;
      return failed_step("splice", errno);
    }
    splice_.in_pipe -= static_cast<std::size_t>(q);
    spliced_bytes_.fetch_add(static_cast<std::uint64_t>(q), std::memory_order_relaxed);
    return StepResult::kProgress;
  }

  // Requests answered while the write carrying them was still running (a server may reply
  // early, e.g. with an error): their memory is handed back only once the write let go of it.
  void finish_answered() {
    std::vector<Request*> answered;
    answered.swap(answered_);
    for (Request* r : answered) finish(r);
  }

  // ---- connecting ----

  void start_connect() {
    state_ = State::kConnecting;
    const auto gen = ++gen_;
    deadline_ = Clock::now() + opt_.connect_timeout;
    arm_timer();
    error_code ec;
    const auto address = asio::ip::make_address(opt_.host, ec);
    if (!ec) {
      socket_.async_connect(tcp::endpoint(address, opt_.port),
                            [this, gen](const error_code& e) { on_connect(gen, e); });
      return;
    }
    resolver_.async_resolve(
        opt_.host, std::to_string(opt_.port),
        [this, gen](const error_code& e, const tcp::resolver::results_type& results) {
          if (gen != gen_) return;
          if (e) {
            connect_failed(str_cat("resolve: ", e.message()));
            return;
          }
          asio::async_connect(socket_, results, [this, gen](const error_code& e2, const auto&) {
            on_connect(gen, e2);
          });
        });
  }

  void on_connect(std::uint64_t gen, const error_code& ec) {
    if (gen != gen_) return;
    if (ec) {
      connect_failed(ec.message());
      return;
    }
    error_code ignored;
    socket_.set_option(tcp::no_delay(true), ignored);
    // The spliced write path calls sendmsg/splice itself and relies on EAGAIN, never a block.
    socket_.non_blocking(true, ignored);
    if (opt_.tls) {
      start_tls(gen);
      return;
    }
    if (opt_.splice_min_bytes != 0 && !splice_.ready()) splice_.open();
    start_handshake();
  }

  // A fresh TLS stream per connection, which takes the connected socket over (socket_ is left
  // closed, for the next connect). Its handlers hold it: a torn-down connection's stream lives
  // until its aborted operations have completed.
  void start_tls(std::uint64_t gen) {
    tls_ = std::make_shared<TlsStream>(std::move(socket_), *opt_.tls);
    SSL* ssl = tls_->native_handle();
    const std::string& name = opt_.tls_server_name.empty() ? opt_.host : opt_.tls_server_name;
    error_code not_ip;
    asio::ip::make_address(name, not_ip);
    // OpenSSL checks the name during verification, and says which check failed.
    const int set = not_ip ? SSL_set1_host(ssl, name.c_str())
                           : X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(ssl), name.c_str());
    if (set != 1) {
      connect_failed(str_cat("TLS: cannot check the server's certificate for '", name, "'"));
      return;
    }
    if (not_ip) SSL_set_tlsext_host_name(ssl, name.c_str());
    state_ = State::kTls;
    tls_->async_handshake(TlsStream::client, [this, gen, keep = tls_](const error_code& ec) {
      if (gen != gen_) return;
      if (ec) {
        connect_failed(str_cat("TLS handshake failed: ", tls_failure(*keep, ec)));
        return;
      }
      start_handshake();
    });
  }

  // Calls f with the stream the connection's bytes go through: the TLS stream, or the socket.
  template <typename F>
  void on_stream(F&& f) {
    if (tls_) {
      f(*tls_);
    } else {
      f(socket_);
    }
  }

  // Why a TLS handshake failed: the certificate check's verdict when it failed, else OpenSSL's.
  static std::string tls_failure(TlsStream& tls, const error_code& ec) {
    const long verdict = SSL_get_verify_result(tls.native_handle());
    if (verdict != X509_V_OK) {
      return str_cat("the server's certificate was refused: ",
                     X509_verify_cert_error_string(verdict));
    }
    if (ec == asio::error::eof || ec == asio::ssl::error::stream_truncated) {
      return "the server closed the connection (does it speak TLS on this port?)";
    }
    return str_cat(ec.message(), " (does the server speak TLS on this port?)");
  }

  void start_handshake() {
    state_ = State::kHandshake;
    server_max_bulk_ = 0;
    write_bufs_.clear();
    splices_.clear();  // they index write_bufs_: the last write's would point past the handshake
    for (Request* hs : {&auth_, &readonly_, &config_}) {
      if (hs->command.empty()) continue;
      hs->reset_outcome();
      write_bufs_.push_back(asio::buffer(hs->command));
      pending_.push_back({hs, false, write_seq_ + 1});
    }
    start_read();
    write_now();
  }

  void on_handshake_reply(Request* r) {
    if (r == &auth_) {
      if (r->outcome != Outcome::kStatus) connect_failed(str_cat("AUTH refused: ", r->text));
      return;
    }
    if (r == &readonly_) {
      if (r->outcome != Outcome::kStatus) connect_failed(str_cat("READONLY refused: ", r->text));
      return;
    }
    // CONFIG GET: ["proto-max-bulk-len", "<bytes>"]; an error (CONFIG disabled) leaves it unknown.
    if (r->outcome == Outcome::kArray && r->array->elements.size() == 2 && r->array->elements[1]) {
      try {
        server_max_bulk_ = std::stoull(r->array->elements[1]->str);
      } catch (const std::exception&) {
        server_max_bulk_ = 0;
      }
    }
    r->array.reset();
    state_ = State::kReady;
    backoff_ = opt_.backoff_initial;
    last_error_.clear();
    start_write();
  }

  void connect_failed(const std::string& why) {
    last_error_ = str_cat(name_, ": cannot connect: ", why);
    next_connect_ = Clock::now() + backoff_;
    backoff_ = std::min(backoff_ * 2, opt_.backoff_max);
    teardown(last_error_);
  }

  // An established connection failed: fail what it holds; the next submit may reconnect at once.
  void fail(const std::string& why) {
    if (state_ == State::kConnecting || state_ == State::kTls || state_ == State::kHandshake) {
      connect_failed(why);
      return;
    }
    last_error_ = why;
    next_connect_ = Clock::time_point{};
    teardown(why);
  }

  void teardown(const std::string& why) {
    ++gen_;
    error_code ignored;
    // Abandoned with requests in flight: reset rather than close, so the kernel drops what it
    // still holds to send, spliced bytes of the caller's pages among them, instead of sending it
    // after the caller has been told the batch failed and may have reused them.
    tcp::socket& sock = tls_ ? tls_->next_layer() : socket_;
    if (sock.is_open() && (writing_ || !pending_.empty())) {
      sock.set_option(asio::socket_base::linger(true, 0), ignored);
    }
    sock.close(ignored);
    socket_.close(ignored);
    tls_.reset();  // its pending handlers hold it until they have run
    resolver_.cancel();
    timer_.cancel();
    writing_ = false;
    splices_.clear();
    state_ = State::kIdle;
    // Bytes left in the pipe reference the pages of requests failed below: the pipe goes with
    // them (a new one is opened at the next connect).
    if (splice_.in_pipe != 0) splice_.close();
    reset_reader();
    std::deque<Pending> pending;
    pending.swap(pending_);
    std::vector<Request*> queued;
    queued.swap(queued_);
    // The socket is closed: no write of ours reads their memory any more. (Spliced bytes the
    // server had already received may still be read by it, from pages the caller may change
    // once told: the record's checksum makes such a record a miss, see redis_storage.h.)
    finish_answered();
    for (const Pending& p : pending) {
      if (!p.asking_reply) finish_error(p.req, why);
    }
    for (Request* r : queued) finish_error(r, why);
  }

  // ---- timeouts ----

  void arm_timer() {
    if (timer_armed_) {
      if (deadline_ < timer_.expiry()) timer_.cancel();  // the handler re-arms earlier
      return;
    }
    timer_armed_ = true;
    timer_.expires_at(deadline_);
    timer_.async_wait([this](const error_code&) { on_timer(); });
  }

  void on_timer() {
    timer_armed_ = false;
    if (state_ == State::kIdle) return;
    if (state_ == State::kReady && pending_.empty()) return;
    if (Clock::now() < deadline_) {
      arm_timer();
      return;
    }
    if (state_ == State::kReady) {
      fail(str_cat(name_, ": timed out: no reply within ", opt_.timeout.count(), " ms"));
    } else if (state_ == State::kTls) {
      // A plain server reads a ClientHello as the start of a command and waits for its end.
      connect_failed(str_cat("TLS handshake failed: no answer within ",
                             opt_.connect_timeout.count(),
                             " ms (does the server speak TLS on this port?)"));
    } else {
      connect_failed(str_cat("timed out after ", opt_.connect_timeout.count(), " ms"));
    }
  }

  // ---- reading ----

  void start_read() {
    const auto gen = gen_;
    auto done = [this, gen, keep = tls_](const error_code& ec, std::size_t n) {
      if (gen != gen_) return;
      on_read(ec, n);
    };
    on_stream([&](auto& stream) {
      stream.async_read_some(asio::buffer(read_buf_), std::move(done));
    });
  }

  void on_read(const error_code& ec, std::size_t n) {
    if (ec) {
      // Closed before the handshake's replies: a TLS port spoken to in plain text does that.
      const char* hint = state_ == State::kHandshake && !opt_.tls
                             ? " during the handshake (a TLS port? set \"tls\")"
                             : "";
      fail(ec == asio::error::eof || ec == asio::error::connection_reset
               ? str_cat(name_, ": connection closed by the server", hint)
               : str_cat(name_, ": read failed: ", ec.message(), hint));
      return;
    }
    deadline_ = Clock::now() + (state_ == State::kReady ? opt_.timeout : opt_.connect_timeout);
    if (consume(read_buf_.data(), n)) start_read();
  }

  // Feeds bytes to the reader and finishes every complete reply. False when the connection was
  // torn down meanwhile.
  bool consume(const char* data, std::size_t n) {
    const auto gen = gen_;
    std::size_t off = 0;
    while (off < n) {
      const std::size_t piece = std::min(n - off, std::max(front_missing_bytes(), kMinFeed));
      if (redisReaderFeed(reader_, data + off, piece) != REDIS_OK) {
        fail(str_cat(name_, ": reply parser: ", reader_->errstr));
        return false;
      }
      off += piece;
      if (!drain() || gen != gen_) return false;
    }
    return true;
  }

  // Bytes still missing for the reply at the front, when its size is known (GET, ASKING).
  std::size_t front_missing_bytes() const {
    if (pending_.empty()) return 0;
    const Pending& p = pending_.front();
    std::size_t expected = 0;
    if (p.asking_reply) {
      expected = kAskingReply.size();
    } else if (p.req->is_get) {
      expected = bulk_reply_bytes(record_head_bytes(p.req->key) + p.req->dst.size());
    }
    const std::size_t buffered = reader_->len - reader_->pos;
    return expected > buffered ? expected - buffered : 0;
  }

  bool drain() {
    const auto gen = gen_;
    for (;;) {
      void* reply = nullptr;
      t_current = this;
      callback_error_.clear();
      const int rc = redisReaderGetReply(reader_, &reply);
      t_current = nullptr;
      if (rc != REDIS_OK) {
        fail(str_cat(name_, ": reply parser: ",
                     callback_error_.empty() ? std::string(reader_->errstr) : callback_error_));
        return false;
      }
      if (reply == nullptr) return true;
      std::unique_ptr<RespValue> tree;
      if (reply != kInPlace) tree.reset(static_cast<RespValue*>(reply));
      if (pending_.empty()) {
        fail(str_cat(name_, ": a reply arrived with no request pending"));
        return false;
      }
      const Pending p = pending_.front();
      pending_.pop_front();
      if (p.asking_reply) continue;
      if (tree) {
        p.req->outcome = Outcome::kArray;
        p.req->array = std::move(tree);
      }
      // After a protocol error (a value over proto-max-bulk-len the client could not know of)
      // the server closes the connection, and it may answer what follows with more protocol
      // errors first: this request gets the error, everything behind it fails now, and the
      // next batch reconnects instead of writing into a socket the server is closing.
      std::string closing;
      if (p.req->outcome == Outcome::kServerError &&
          p.req->text.starts_with(kProtocolErrorPrefix)) {
        closing = str_cat(name_, ": the server closes the connection after: ", p.req->text);
      }
      if (p.write_seq > written_seq_ && p.req->completion != nullptr) {
        answered_.push_back(p.req);
      } else {
        finish(p.req);  // p.req may be gone after this
        if (gen != gen_) return false;
      }
      if (!closing.empty()) {
        fail(closing);
        return false;
      }
    }
  }

  void finish(Request* r) {
    if (r->completion == nullptr) {
      on_handshake_reply(r);
      return;
    }
    r->completion->finish_one();  // r may be gone after this
  }

  // `unsent`: refused here for what it is, not for the connection's state.
  void finish_error(Request* r, std::string why, bool unsent = false) {
    if (r->completion == nullptr) return;  // a handshake request: the connection is going anyway
    r->outcome = Outcome::kIoError;
    r->text = std::move(why);
    r->unsent = unsent;
    r->completion->finish_one();
  }

  // ---- hiredis object functions ----
  // They run inside redisReaderGetReply on this connection's strand (t_current). Top-level
  // replies go into the request at the front of pending_; array elements build a RespValue.

  static thread_local Impl* t_current;

  static void* attach(const redisReadTask* task, std::unique_ptr<RespValue> v) {
    RespValue* raw = v.get();
    if (task->parent != nullptr) {
      auto* parent = static_cast<RespValue*>(task->parent->obj);
      parent->elements[static_cast<std::size_t>(task->idx)] = std::move(v);
    } else {
      v.release();  // the root: owned by the reader until handed back by GetReply
    }
    return raw;
  }

  Request* front_request() {
    if (pending_.empty() || pending_.front().asking_reply) return nullptr;
    return pending_.front().req;
  }

  // The object functions are called from hiredis's C code, which an exception must not cross
  // (it would end the process): each one catches, records why in callback_error_, and returns
  // nullptr, which makes hiredis fail the read; drain() then fails the connection with the
  // reason.
  template <typename F>
  static void* guarded(F&& f) noexcept {
    try {
      return f();
    } catch (const std::exception& e) {
      if (t_current != nullptr) t_current->callback_error_ = e.what();
      return nullptr;
    }
  }

  // Larger arrays are refused (a broken or hostile server could make the reader allocate
  // gigabytes): CLUSTER SLOTS has one entry per slot range, at most 16384.
  static constexpr int kMaxArrayElements = 1 << 20;

  static void* create_string(const redisReadTask* task, char* str, std::size_t len) {
    return guarded([&] { return create_string_unguarded(task, str, len); });
  }
  static void* create_array(const redisReadTask* task, int elements) {
    return guarded([&] { return create_array_unguarded(task, elements); });
  }
  static void* create_integer(const redisReadTask* task, long long value) {
    return guarded([&] { return create_integer_unguarded(task, value); });
  }
  static void* create_nil(const redisReadTask* task) {
    return guarded([&] { return create_nil_unguarded(task); });
  }

  static void* create_string_unguarded(const redisReadTask* task, char* str, std::size_t len) {
    if (task->parent != nullptr) {
      auto v = std::make_unique<RespValue>();
      v->type = task->type;
      v->str.assign(str, len);
      return attach(task, std::move(v));
    }
    Request* r = t_current->front_request();
    if (r == nullptr) return kInPlace;  // ASKING's +OK, or a stray reply drain() catches
    if (task->type == REDIS_REPLY_ERROR) {
      r->outcome = Outcome::kServerError;
      r->text.assign(str, len);
    } else if (task->type == REDIS_REPLY_STATUS) {
      r->outcome = Outcome::kStatus;
      r->text.assign(str, len);
    } else if (r->is_get) {
      check_record(r, reinterpret_cast<const std::byte*>(str), len);
    } else {
      r->outcome = Outcome::kString;
      r->text.assign(str, len);
    }
    return kInPlace;
  }

  static void check_record(Request* r, const std::byte* data, std::size_t len) {
    const std::size_t head = record_head_bytes(r->key);
    const std::size_t want = head + r->dst.size();
    auto bad = [&](std::string why) {
      r->outcome = Outcome::kBadRecord;
      r->text = std::move(why);
    };
    if (len < head) return bad(str_cat("truncated record: ", len, " bytes"));
    std::uint64_t checksum = 0;
    if (auto why = check_record_head({data, head}, r->key, r->dst.size(), &checksum);
        !why.empty()) {
      return bad(std::move(why));
    }
    if (len != want) return bad(str_cat("record of ", len, " bytes, expected ", want));
    std::memcpy(r->dst.data(), data + head, r->dst.size());
    if (auto why = check_record_payload(r->dst, checksum); !why.empty()) return bad(std::move(why));
    r->outcome = Outcome::kValue;
  }

  static void* create_array_unguarded(const redisReadTask* task, int elements) {
    if (elements > kMaxArrayElements) {
      throw std::length_error(str_cat("array reply of ", elements, " elements (at most ",
                                      kMaxArrayElements, " accepted)"));
    }
    auto v = std::make_unique<RespValue>();
    v->type = REDIS_REPLY_ARRAY;
    v->elements.resize(static_cast<std::size_t>(std::max(elements, 0)));
    return attach(task, std::move(v));
  }

  static void* create_integer_unguarded(const redisReadTask* task, long long value) {
    if (task->parent != nullptr) {
      auto v = std::make_unique<RespValue>();
      v->type = REDIS_REPLY_INTEGER;
      v->integer = value;
      return attach(task, std::move(v));
    }
    if (Request* r = t_current->front_request()) {
      r->outcome = Outcome::kInteger;
      r->integer = value;
    }
    return kInPlace;
  }

  static void* create_nil_unguarded(const redisReadTask* task) {
    if (task->parent != nullptr) {
      auto v = std::make_unique<RespValue>();
      v->type = REDIS_REPLY_NIL;
      return attach(task, std::move(v));
    }
    if (Request* r = t_current->front_request()) r->outcome = Outcome::kNil;
    return kInPlace;
  }

  static void free_object(void* obj) {
    if (obj != kInPlace) delete static_cast<RespValue*>(obj);
  }

  static inline redisReplyObjectFunctions functions_ = {create_string, create_array, create_integer,
                                                        create_nil, free_object};

  void reset_reader() {
    if (reader_ != nullptr) redisReaderFree(reader_);
    reader_ = redisReaderCreateWithFunctions(&functions_);
    if (reader_ == nullptr) throw std::bad_alloc();
    reader_->maxbuf = 0;  // keep the buffer between replies
  }

  const ConnectionOptions opt_;
  const std::string name_;
  asio::strand<asio::io_context::executor_type> strand_;
  // Everything below is touched only on strand_.
  tcp::socket socket_;
  // With TLS, one per connection, owning the connected socket (socket_ is then closed).
  std::shared_ptr<TlsStream> tls_;
  asio::steady_timer timer_;
  tcp::resolver resolver_;
  std::vector<char> read_buf_;
  redisReader* reader_ = nullptr;
  std::vector<asio::const_buffer> write_bufs_;
  std::vector<std::size_t> splices_;  // indexes into write_bufs_ of the payloads to splice
  WriteCursor cursor_;
  std::vector<iovec> iovecs_;
  std::string write_error_;
  SplicePipe splice_;
  std::atomic<std::uint64_t> spliced_bytes_{0};  // read from any thread
  std::vector<Request*> queued_;                 // not yet written
  std::deque<Pending> pending_;                  // written, awaiting their replies in order
  std::vector<Request*> answered_;               // answered before their write completed
  std::uint64_t write_seq_ = 0;                  // writes started
  std::uint64_t written_seq_ = 0;                // the last write completed
  State state_ = State::kIdle;
  bool writing_ = false;
  bool closed_ = false;
  bool timer_armed_ = false;
  std::uint64_t gen_ = 0;  // bumped on every (re)connect and teardown; stale handlers compare it
  Clock::time_point deadline_{};
  Clock::time_point next_connect_{};
  std::chrono::milliseconds backoff_;
  std::string last_error_;
  std::uint64_t server_max_bulk_ = 0;  // 0: unknown
  std::string callback_error_;         // why an object function refused (see guarded)
  std::string auth_command_, config_command_;
  Request auth_, readonly_, config_;  // handshake requests (completion == nullptr)
};

thread_local Connection::Impl* Connection::Impl::t_current = nullptr;

Connection::Connection(IoThreads& io, ConnectionOptions options)
    : impl_(std::make_unique<Impl>(io.impl().pick(), std::move(options))) {}
Connection::~Connection() = default;
void Connection::submit(std::vector<Request*> requests) { impl_->submit(std::move(requests)); }
void Connection::shut_down() { impl_->shut_down(); }
const std::string& Connection::name() const { return impl_->name(); }
std::uint64_t Connection::spliced_bytes() const { return impl_->spliced_bytes(); }

}  // namespace hicache::redis
