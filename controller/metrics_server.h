// MetricsServer: serves a MetricsRegistry over HTTP on its own thread (Boost.Beast over Asio):
//
//   GET /metrics        Prometheus text exposition (text/plain; version=0.0.4)
//   GET /metrics.json   the JSON snapshot of the same values
//
// anything else is 404, a method other than GET or HEAD 405. It never blocks the cache: a scrape
// reads the registry's atomics under the registry's mutex, which updates never take. One
// connection is served at a time; a client that stalls is cut off after a few seconds.
//
// Binds to loopback unless told otherwise: metrics are for the host's scraper or a sidecar;
// exposing them wider is a deliberate setting.
#pragma once

#include <memory>
#include <string>

#include "transfer/metrics.h"

namespace hicache {

class MetricsServer {
 public:
  // Listens on `bind_address`:`port` (0: a free port, see port()). Throws InvalidArgument for
  // an address that does not parse, Error when the port cannot be bound (naming both). The
  // registry must outlive the server.
  MetricsServer(const MetricsRegistry& registry, const std::string& bind_address, int port);
  // Stops: closes the listener and any connection, joins the thread.
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  int port() const;
  // Requests answered so far.
  std::uint64_t requests() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace hicache
