#include "controller/metrics_server.h"

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/strand.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include <atomic>
#include <chrono>
#include <thread>

#include "transfer/errors.h"

namespace hicache {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

constexpr auto kClientTimeout = std::chrono::seconds(5);

// One request and its response on one connection, kept alive while the client keeps it.
class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket socket, const MetricsRegistry& registry, std::atomic<std::uint64_t>& served)
      : stream_(std::move(socket)), registry_(registry), served_(served) {}

  void start() { read(); }

 private:
  void read() {
    request_ = {};
    stream_.expires_after(kClientTimeout);
    http::async_read(stream_, buffer_, request_,
                     [self = shared_from_this()](beast::error_code ec, std::size_t) {
                       if (ec) return self->close();
                       self->respond();
                     });
  }

  void respond() {
    response_ = {};
    response_.version(request_.version());
    response_.keep_alive(request_.keep_alive());
    response_.set(http::field::server, "hicache");
    const auto target = request_.target();
    if (request_.method() != http::verb::get && request_.method() != http::verb::head) {
      response_.result(http::status::method_not_allowed);
      response_.set(http::field::allow, "GET, HEAD");
      response_.set(http::field::content_type, "text/plain");
      response_.body() = "GET /metrics or /metrics.json\n";
    } else if (target == "/metrics") {
      response_.result(http::status::ok);
      response_.set(http::field::content_type, "text/plain; version=0.0.4; charset=utf-8");
      response_.body() = registry_.prometheus_text();
    } else if (target == "/metrics.json") {
      response_.result(http::status::ok);
      response_.set(http::field::content_type, "application/json");
      response_.body() = registry_.json_text();
    } else {
      response_.result(http::status::not_found);
      response_.set(http::field::content_type, "text/plain");
      response_.body() = "not found: GET /metrics or /metrics.json\n";
    }
    if (request_.method() == http::verb::head) {
      response_.content_length(response_.body().size());
      response_.body().clear();
    }
    response_.prepare_payload();
    served_.fetch_add(1, std::memory_order_relaxed);
    stream_.expires_after(kClientTimeout);
    http::async_write(stream_, response_,
                      [self = shared_from_this()](beast::error_code ec, std::size_t) {
                        if (ec || !self->response_.keep_alive()) return self->close();
                        self->read();
                      });
  }

  void close() {
    beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream_.close();
  }

  beast::tcp_stream stream_;
  beast::flat_buffer buffer_;
  http::request<http::string_body> request_;
  http::response<http::string_body> response_;
  const MetricsRegistry& registry_;
  std::atomic<std::uint64_t>& served_;
};

}  // namespace

struct MetricsServer::Impl {
  const MetricsRegistry& registry;
  asio::io_context io{1};
  tcp::acceptor acceptor{io};
  std::atomic<std::uint64_t> served{0};
  int port = 0;
  std::thread thread;

  explicit Impl(const MetricsRegistry& r) : registry(r) {}

  void accept() {
    acceptor.async_accept(asio::make_strand(io), [this](beast::error_code ec, tcp::socket s) {
      if (ec == asio::error::operation_aborted || !acceptor.is_open()) return;
      if (!ec) std::make_shared<Session>(std::move(s), registry, served)->start();
      accept();  // a failed accept (EMFILE, a reset peer) does not end the server
    });
  }
};

MetricsServer::MetricsServer(const MetricsRegistry& registry, const std::string& bind_address,
                             int port)
    : impl_(std::make_unique<Impl>(registry)) {
  if (port < 0 || port > 65535) {
    throw InvalidArgument(str_cat("metrics server: port ", port, " is outside [0, 65535]"));
  }
  boost::system::error_code ec;
  const auto address = asio::ip::make_address(bind_address, ec);
  if (ec) {
    throw InvalidArgument(str_cat("metrics server: bind address '", bind_address,
                                  "' is not an IP address"));
  }
  const tcp::endpoint endpoint(address, static_cast<unsigned short>(port));
  auto& a = impl_->acceptor;
  a.open(endpoint.protocol(), ec);
  if (!ec) a.set_option(asio::socket_base::reuse_address(true), ec);
  if (!ec) a.bind(endpoint, ec);
  if (!ec) a.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) {
    throw Error(str_cat("metrics server: cannot listen on ", bind_address, ":", port, ": ",
                        ec.message()));
  }
  impl_->port = a.local_endpoint().port();
  impl_->accept();
  impl_->thread = std::thread([impl = impl_.get()] { impl->io.run(); });
}

MetricsServer::~MetricsServer() {
  // Closing on the I/O thread ends the accept loop; stop() ends every session's pending
  // operation, and their sockets close as the handlers are destroyed.
  asio::post(impl_->io, [impl = impl_.get()] {
    beast::error_code ignored;
    impl->acceptor.close(ignored);
    impl->io.stop();
  });
  if (impl_->thread.joinable()) impl_->thread.join();
}

int MetricsServer::port() const { return impl_->port; }

std::uint64_t MetricsServer::requests() const { return impl_->served.load(); }

}  // namespace hicache
