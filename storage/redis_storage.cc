#include "storage/redis_storage.h"

#include <algorithm>
#include <boost/asio/ssl/context.hpp>
#include <atomic>
#include <functional>
#include <optional>
#include <set>
#include <thread>

#include "storage/json_fields.h"
#include "storage/page_key.h"
#include "storage/record.h"
#include "storage/redis_cluster.h"
#include "storage/redis_connection.h"
#include "transfer/errors.h"
#include "transfer/mutex.h"

namespace hicache {

using redis::Outcome;
using redis::Request;
using Clock = std::chrono::steady_clock;

RedisConfig RedisConfig::from_json_text(std::string_view json_text) {
  constexpr std::string_view what = "redis storage config";
  const auto j = json_fields::parse_object(json_text, what);
  json_fields::reject_unknown(j, kJsonKeys, what);
  RedisConfig c;
  c.cluster = json_fields::get<bool>(j, "cluster", false, what);
  if (j.contains("nodes")) {
    if (j.contains("host") || j.contains("port")) {
      throw InvalidArgument(str_cat(what, ": give either 'nodes' or 'host'/'port', not both"));
    }
    const auto& nodes = j.at("nodes");
    if (!nodes.is_array() || nodes.empty()) {
      throw InvalidArgument(str_cat(
          what, ": key 'nodes' must be a non-empty array of \"host:port\", got ", nodes.dump()));
    }
    c.nodes.clear();
    for (const auto& n : nodes) {
      const auto hp = n.is_string() ? redis::parse_host_port(n.get<std::string>()) : std::nullopt;
      if (!hp || hp->host.empty()) {
        throw InvalidArgument(
            str_cat(what, ": key 'nodes' holds ", n.dump(), ", not a \"host:port\""));
      }
      c.nodes.push_back({hp->host, hp->port});
    }
    if (!c.cluster && c.nodes.size() != 1) {
      throw InvalidArgument(str_cat(what, ": key 'nodes' lists ", c.nodes.size(),
                                    " servers but 'cluster' is false (one server expected)"));
    }
  } else {
    const auto host = json_fields::get<std::string>(j, "host", "127.0.0.1", what);
    if (host.empty()) throw InvalidArgument(str_cat(what, ": key 'host' is empty"));
    const auto port = json_fields::get_int(j, "port", 6379, 1, 65535, what);
    c.nodes = {{host, static_cast<std::uint16_t>(port)}};
  }
  c.connections = static_cast<int>(json_fields::get_int(j, "connections", 4, 1, 256, what));
  c.io_threads = static_cast<int>(json_fields::get_int(j, "io_threads", 0, 0, 64, what));
  c.timeout =
      std::chrono::milliseconds(json_fields::get_int(j, "timeout_ms", 2000, 1, 3'600'000, what));
  c.connect_timeout = std::chrono::milliseconds(
      json_fields::get_int(j, "connect_timeout_ms", 1000, 1, 3'600'000, what));
  if (const auto it = j.find("reconnect_backoff_ms"); it != j.end()) {
    const bool shape = it->is_array() && it->size() == 2 && (*it)[0].is_number_integer() &&
                       (*it)[1].is_number_integer();
    const std::int64_t lo = shape ? (*it)[0].get<std::int64_t>() : 0;
    const std::int64_t hi = shape ? (*it)[1].get<std::int64_t>() : 0;
    if (!shape || lo < 1 || hi < lo || hi > 3'600'000) {
      throw InvalidArgument(str_cat(what, ": key 'reconnect_backoff_ms' must be [initial, max] ",
                                    "with 1 <= initial <= max <= 3600000, got ", it->dump()));
    }
    c.backoff_initial = std::chrono::milliseconds(lo);
    c.backoff_max = std::chrono::milliseconds(hi);
  }
  c.username = json_fields::get<std::string>(j, "username", "", what);
  c.password = json_fields::get<std::string>(j, "password", "", what);
  if (!c.username.empty() && c.password.empty()) {
    throw InvalidArgument(str_cat(what, ": key 'username' ('", c.username,
                                  "') needs a 'password' (an ACL user authenticates with both)"));
  }
  c.max_value_bytes = static_cast<std::uint64_t>(
      json_fields::get_int(j, "max_value_bytes", 512ll << 20, 1, INT64_MAX, what));
  c.zero_copy_min_bytes = static_cast<std::uint64_t>(
      json_fields::get_int(j, "zero_copy_min_bytes", 64 << 10, 0, INT64_MAX, what));
  c.check_at_start = json_fields::get<bool>(j, "check_at_start", true, what);
  c.read_from_replicas = json_fields::get<bool>(j, "read_from_replicas", false, what);
  if (const auto it = j.find("tls"); it != j.end()) {
    const std::string tls_what = str_cat(what, ": 'tls'");
    if (!it->is_object()) {
      throw InvalidArgument(str_cat(tls_what, " must be an object (e.g. {\"ca_file\": ...}), got ",
                                    it->dump()));
    }
    json_fields::reject_unknown(*it, RedisTlsConfig::kJsonKeys, tls_what);
    c.tls.enabled = true;
    c.tls.ca_file = json_fields::get<std::string>(*it, "ca_file", "", tls_what);
    c.tls.cert_file = json_fields::get<std::string>(*it, "cert_file", "", tls_what);
    c.tls.key_file = json_fields::get<std::string>(*it, "key_file", "", tls_what);
    c.tls.server_name = json_fields::get<std::string>(*it, "server_name", "", tls_what);
    c.tls.verify = json_fields::get<bool>(*it, "verify", true, tls_what);
    if (c.tls.cert_file.empty() != c.tls.key_file.empty()) {
      throw InvalidArgument(str_cat(tls_what, ": 'cert_file' and 'key_file' go together (got ",
                                    c.tls.cert_file.empty() ? "only key_file" : "only cert_file",
                                    ")"));
    }
  }
  if (c.read_from_replicas && !c.cluster) {
    throw InvalidArgument(
        str_cat(what, ": key 'read_from_replicas' needs 'cluster': true (replicas are found in ",
                "the cluster's slot map)"));
  }
  return c;
}

namespace {

constexpr int kMaxRedirects = 5;

// The request reached its node's connection, and the connection failed (not a refusal here).
bool connection_failed(const Request& r) { return r.outcome == Outcome::kIoError && !r.unsent; }

// A failure after which the slot map may have changed: the node's connection failed (it may be
// down and its replica promoted), or the cluster says so.
bool maybe_remapped(const Request& r) {
  return connection_failed(r) ||
         (r.outcome == Outcome::kServerError &&
          (r.text.starts_with("CLUSTERDOWN") || r.text.starts_with("TRYAGAIN")));
}

// Appends the RESP encoding of a command with one key argument (and an optional bulk length
// announced for a value that follows) to `arena`; returns its [offset, size).
std::pair<std::size_t, std::size_t> append_key_command(std::string& arena, std::string_view verb,
                                                       std::string_view key) {
  const std::size_t start = arena.size();
  redis::append_array_head(arena, 2);
  redis::append_bulk(arena, verb);
  redis::append_bulk(arena, key);
  return {start, arena.size() - start};
}

}  // namespace

class RedisStorage::Impl {
 public:
  Impl(RedisStorage& owner, const RedisConfig& config)
      : owner_(owner), config_(config), tls_(make_tls_context(config.tls)), io_(config.io_threads) {
    slots_.assign(redis::kClusterSlots, -1);
    read_slots_.assign(redis::kClusterSlots, -1);
    WriterLock lock(map_mu_);
    for (const auto& n : config.nodes) node_index_locked(n.host, n.port, /*readonly=*/false);
  }

  ~Impl() {
    {
      ReaderLock lock(map_mu_);
      for (const auto& node : nodes_) {
        for (const auto& c : node->conns) c->shut_down();
      }
    }
    io_.stop();
  }

  void start() {
    if (config_.cluster) refresh_slots();
    if (!config_.check_at_start) return;
    static constexpr std::string_view kPing = "*1\r\n$4\r\nPING\r\n";
    const std::size_t known = known_nodes();
    for (std::size_t n = 0; n < known; ++n) {
      std::vector<Request> reqs = ask_node(n, kPing);
      if (reqs[0].outcome == Outcome::kStatus || reqs[0].outcome == Outcome::kString) continue;
      const redis::HostPort at = endpoint_of(n);
      throw IoError(str_cat("redis storage: ", at.host, ":", at.port, " does not answer at start: ",
                            reqs[0].text.empty() ? "no reply" : reqs[0].text,
                            " (\"check_at_start\": false starts without it and retries)"));
    }
  }

  std::uint64_t zero_copy_bytes() const {
    ReaderLock lock(map_mu_);
    std::uint64_t total = 0;
    for (const auto& node : nodes_) {
      for (const auto& c : node->conns) total += c->spliced_bytes();
    }
    return total;
  }

  std::size_t exists(std::span<const std::string> keys) {
    const std::vector<bool> each = exists_each(keys);
    std::size_t present = 0;
    while (present < each.size() && each[present]) ++present;
    return present;
  }

  std::vector<bool> exists_each(std::span<const std::string> keys) {
    std::string arena;
    std::vector<Request> reqs = key_requests(keys, "EXISTS", arena, /*read=*/true);
    execute(reqs);
    std::vector<bool> out(reqs.size(), false);
    for (std::size_t i = 0; i < reqs.size(); ++i) {
      out[i] = reqs[i].outcome == Outcome::kInteger && reqs[i].integer == 1;
    }
    return out;
  }

  std::vector<IoResult> get(std::span<const std::string> keys, std::span<const ByteSpan> dst) {
    std::string arena;
    std::vector<Request> reqs = key_requests(keys, "GET", arena, /*read=*/true);
    for (std::size_t i = 0; i < keys.size(); ++i) {
      reqs[i].is_get = true;
      reqs[i].key = keys[i];
      reqs[i].dst = dst[i];
    }
    execute(reqs);
    std::vector<IoResult> results(keys.size());
    std::vector<std::string> bad;
    for (std::size_t i = 0; i < keys.size(); ++i) {
      Request& r = reqs[i];
      switch (r.outcome) {
        case Outcome::kValue:
          results[i] = IoResult::ok();
          break;
        case Outcome::kNil:
          results[i] = IoResult::miss();
          break;
        case Outcome::kBadRecord:
          ++owner_.counters_.bad_records;
          bad.push_back(keys[i]);
          results[i] = IoResult::miss(str_cat("bad record '", keys[i], "' removed: ", r.text));
          break;
        default:
          results[i] = IoResult::error(failure("GET", keys[i], r));
          break;
      }
    }
    if (!bad.empty()) {
      std::string del_arena;
      std::vector<Request> dels = key_requests(bad, "DEL", del_arena);
      execute(dels);
      owner_.note_removed(bad);
    }
    return results;
  }

  // batch_set. Values go as MSETNX key record (one key): the server stores a key only when it is
  // absent, so a page is never written twice, whichever engine sharing the store wrote it first
  // (a reply of 0: it was there, deduplicated). Not SET key record NX: an argument after the
  // value puts more than the value in the server's buffer when it reads the command whole, and
  // redis-server then copies the value instead of adopting its buffer (a 256 KiB memmove and a
  // fresh allocation per SET: ~10% of the servers' CPU). Sending a value already stored wastes
  // its bytes, though; so while recent batches found their keys stored (a running estimate of
  // that share at kProbeAbovePermille or more), the keys are first asked with EXISTS and only
  // the absent ones' values go. The probe costs a round trip per batch (12-18% of a 256 KiB x 16
  // batch's time on the 3-node cluster here), so batches of new pages, the usual case, go
  // without it.
  std::vector<IoResult> set(std::span<const std::string> keys, std::span<const ConstByteSpan> src) {
    const std::size_t n = keys.size();
    std::vector<IoResult> results(n);
    // The keys whose records fit; the others are per-key errors, and nothing of them is sent.
    std::vector<std::size_t> candidates;
    candidates.reserve(n);
    for (std::size_t i = 0; i < n; ++i) {
      const std::uint64_t record = record_head_bytes(keys[i]) + src[i].size();
      if (record > config_.max_value_bytes) {
        results[i] = IoResult::error(str_cat("SET '", keys[i], "': record of ", record,
                                             " bytes exceeds max_value_bytes ",
                                             config_.max_value_bytes, "; not sent"));
        continue;
      }
      candidates.push_back(i);
    }
    if (candidates.empty()) return results;

    std::size_t stored = 0;  // candidates found stored, by the probe or by MSETNX's 0
    std::vector<std::size_t> to_send;
    if (stored_permille_.load(std::memory_order_relaxed) < kProbeAbovePermille) {
      to_send = candidates;
    } else {
      std::vector<std::string> probe_keys;
      probe_keys.reserve(candidates.size());
      for (std::size_t i : candidates) probe_keys.push_back(keys[i]);
      std::string arena;
      std::vector<Request> probes = key_requests(probe_keys, "EXISTS", arena);
      execute(probes);
      for (std::size_t c = 0; c < candidates.size(); ++c) {
        const std::size_t i = candidates[c];
        const Request& r = probes[c];
        if (r.outcome != Outcome::kInteger) {
          results[i] = IoResult::error(failure("EXISTS", keys[i], r));
        } else if (r.integer != 0) {
          ++owner_.counters_.set_deduplicated;
          ++stored;
          results[i] = IoResult::ok();
        } else {
          to_send.push_back(i);
        }
      }
    }

    if (!to_send.empty()) {
      // "*3 MSETNX key $<record>" + record head, then the payload straight from the caller's
      // span. Each record head, whose checksum is a pass over the payload (~8 us per 256 KiB
      // here), is filled in just before its request is handed to a connection, so the first
      // values are on the wire while later heads are being computed.
      static constexpr std::string_view kMsetnxHead = "*3\r\n$6\r\nMSETNX\r\n";
      std::string arena;
      std::size_t arena_bytes = 0;
      for (std::size_t i : to_send) {
        arena_bytes += kMsetnxHead.size() + 2 * keys[i].size() + kRecordHeaderBytes + 48;
      }
      arena.reserve(arena_bytes);
      std::vector<std::pair<std::size_t, std::size_t>> spans;
      spans.reserve(to_send.size());
      for (std::size_t i : to_send) {
        const std::string& key = keys[i];
        const std::size_t start = arena.size();
        const std::size_t head = record_head_bytes(key);
        arena += kMsetnxHead;
        redis::append_bulk(arena, key);
        redis::append_bulk_head(arena, head + src[i].size());
        arena.resize(arena.size() + head);
        spans.emplace_back(start, arena.size() - start);
      }
      std::vector<Request> reqs(to_send.size());
      for (std::size_t a = 0; a < to_send.size(); ++a) {
        const std::size_t i = to_send[a];
        reqs[a].command = std::string_view(arena).substr(spans[a].first, spans[a].second);
        reqs[a].payload = src[i];
        reqs[a].bulk_bytes = record_head_bytes(keys[i]) + src[i].size();
        reqs[a].slot = slot_of(keys[i]);
      }
      execute(reqs, [&](const Request& r) {
        const auto a = static_cast<std::size_t>(&r - reqs.data());
        const std::size_t i = to_send[a];
        const std::size_t head = record_head_bytes(keys[i]);
        char* head_at = arena.data() + spans[a].first + spans[a].second - head;
        encode_record_head(keys[i], src[i], std::span(reinterpret_cast<std::byte*>(head_at), head));
      });
      for (std::size_t a = 0; a < to_send.size(); ++a) {
        const std::size_t i = to_send[a];
        const Request& r = reqs[a];
        if (r.outcome == Outcome::kInteger && r.integer == 1) {
          ++owner_.counters_.set_written;
          owner_.counters_.bytes_written += src[i].size();
          results[i] = IoResult::ok();
        } else if (r.outcome == Outcome::kInteger && r.integer == 0) {
          ++owner_.counters_.set_deduplicated;
          ++stored;
          results[i] = IoResult::ok();
        } else {
          results[i] = IoResult::error(failure("MSETNX", keys[i], r));
        }
      }
    }
    // A quarter of the estimate's weight on this batch: after a batch of stored keys, about five
    // batches of new ones turn the probe off again.
    const auto now = static_cast<int>(stored * 1000 / candidates.size());
    const int before = stored_permille_.load(std::memory_order_relaxed);
    stored_permille_.store((3 * before + now) / 4, std::memory_order_relaxed);
    return results;
  }

  // TOUCH per key, the tail first (the head's access is the latest), down each node's pipeline:
  // one round trip per node. The server's LRU (or LFU) then counts the chain as just used.
  void touch(std::span<const std::string> keys) {
    const std::vector<std::string> tail_first(keys.rbegin(), keys.rend());
    std::string arena;
    std::vector<Request> reqs = key_requests(tail_first, "TOUCH", arena);
    execute(reqs);
    for (const Request& r : reqs) {
      if (r.outcome != Outcome::kInteger) {
        ++owner_.counters_.touch_errors;
      } else if (r.integer == 1) {
        ++owner_.counters_.touched;
      }
    }
  }

  bool remove(const std::string& key) {
    std::string arena;
    std::vector<Request> reqs = key_requests(std::span(&key, 1), "DEL", arena);
    execute(reqs);
    if (reqs[0].outcome != Outcome::kInteger || reqs[0].integer == 0) return false;
    ++owner_.counters_.removes;
    owner_.note_removed(std::span(&key, 1));
    return true;
  }

  void clear() {
    std::set<std::size_t> targets;
    if (config_.cluster) {
      refresh_slots();
      ReaderLock lock(map_mu_);
      for (std::int32_t s : slots_) {
        if (s >= 0) targets.insert(static_cast<std::size_t>(s));
      }
      if (targets.empty()) {
        for (std::size_t i = 0; i < nodes_.size(); ++i) targets.insert(i);
      }
    } else {
      targets.insert(0);
    }
    static constexpr std::string_view kFlush = "*1\r\n$7\r\nFLUSHDB\r\n";
    std::vector<Request> reqs(targets.size());
    std::size_t k = 0;
    for (std::size_t node : targets) {
      reqs[k].command = kFlush;
      reqs[k].node = node;
      ++k;
    }
    dispatch(reqs);  // best effort
  }

 private:
  struct Node {
    redis::HostPort address;
    bool readonly = false;  // a replica's connections for reads (READONLY)
    std::vector<std::unique_ptr<redis::Connection>> conns;
    std::atomic<std::size_t> next{0};  // round-robin start for small batches
  };

  std::uint16_t slot_of(std::string_view key) const {
    return config_.cluster ? redis::key_slot(key) : 0;
  }

  // One request per key: "<verb> <key>"; `read`: a replica may answer it.
  std::vector<Request> key_requests(std::span<const std::string> keys, std::string_view verb,
                                    std::string& arena, bool read = false) {
    std::vector<std::pair<std::size_t, std::size_t>> spans;
    spans.reserve(keys.size());
    arena.reserve(keys.size() * (keys.empty() ? 0 : keys[0].size() + 24));
    for (const auto& key : keys) spans.push_back(append_key_command(arena, verb, key));
    std::vector<Request> reqs(keys.size());
    for (std::size_t i = 0; i < keys.size(); ++i) {
      reqs[i].command = std::string_view(arena).substr(spans[i].first, spans[i].second);
      reqs[i].slot = slot_of(keys[i]);
      reqs[i].replica_ok = read && config_.read_from_replicas;
    }
    return reqs;
  }

  static std::string failure(std::string_view verb, std::string_view key, const Request& r) {
    switch (r.outcome) {
      case Outcome::kIoError:
        return str_cat(verb, " '", key, "': ", r.text);
      case Outcome::kServerError:
        return str_cat(verb, " '", key, "': the server replied: ", r.text);
      default:
        return str_cat(verb, " '", key, "': unexpected reply");
    }
  }

  // Called for a request right before it is first handed to a connection.
  using Prepare = std::function<void(const Request&)>;

  // Runs the requests, routing each by slot (cluster) and following MOVED/ASK redirects, until
  // each has its final outcome. `prepare` runs for each request before its first send
  // (redirected requests are resent as prepared). A cluster's failover: a request that failed on
  // its connection, or with CLUSTERDOWN / TRYAGAIN, makes the client re-read the slot map, and
  // is sent again when its slot now lives elsewhere (a replica promoted); otherwise its failure
  // stands. Within kMaxRedirects rounds.
  void execute(std::span<Request> reqs, const Prepare& prepare = {}) {
    std::vector<Request*> todo;
    todo.reserve(reqs.size());
    for (Request& r : reqs) todo.push_back(&r);
    for (int round = 0;; ++round) {
      bool no_replica = false;  // a read the map names no replica for went to the master
      if (config_.cluster) {
        ReaderLock lock(map_mu_);
        for (Request* r : todo) {
          if (!r->asking) r->node = route_locked(*r);
          no_replica = no_replica || (r->replica_ok && read_slots_[r->slot] < 0);
        }
      }
      dispatch(todo, round == 0 ? prepare : Prepare{});
      if (!config_.cluster) return;
      const auto answered_at = Clock::now();
      // A cluster lists a replica only once it has reported replicating (a new one, or one
      // whose master was just promoted): while reads find none, the map is re-read, at most
      // once per kReplicaRecheck.
      if (no_replica) refresh_slots(answered_at - kReplicaRecheck);
      std::vector<Request*> again;
      std::vector<Request*> failed;
      bool moved = false;
      for (Request* r : todo) {
        if (r->replica_ok && round < kMaxRedirects && replica_failed(*r)) {
          // A replica down, loading or cut off from its master: its master answers instead.
          r->replica_ok = false;
          r->asking = false;
          r->reset_outcome();
          again.push_back(r);
          continue;
        }
        if (maybe_remapped(*r)) {
          failed.push_back(r);
          continue;
        }
        if (r->outcome != Outcome::kServerError) continue;
        auto redirect = redis::parse_redirect(r->text);
        if (!redirect) continue;
        if (round == kMaxRedirects) {
          r->text = str_cat("gave up after ", kMaxRedirects, " redirects, last: ", r->text);
          continue;
        }
        if (redirect->target.host.empty()) redirect->target.host = host_of(r->node);
        const std::size_t target = node_index(redirect->target.host, redirect->target.port);
        if (redirect->ask) {
          r->asking = true;
          r->node = target;
        } else {
          // From a replica too (it lost the slot): the master answers from now on.
          r->asking = false;
          r->replica_ok = false;
          moved = true;
          WriterLock lock(map_mu_);
          slots_[redirect->slot] = static_cast<std::int32_t>(target);
        }
        r->reset_outcome();
        again.push_back(r);
      }
      if (moved) refresh_slots(answered_at);
      if (!failed.empty() && round < kMaxRedirects) {
        if (!moved) refresh_slots(answered_at - kFailureRecheck);
        ReaderLock lock(map_mu_);
        for (Request* r : failed) {
          if (route_locked(*r) == r->node && !r->asking) continue;  // nowhere else to go
          r->asking = false;
          r->reset_outcome();
          again.push_back(r);
        }
      }
      if (again.empty()) return;
      todo.swap(again);
    }
  }

  // A read routed to a replica that failed there: on the connection, or because the replica
  // cannot serve (LOADING, MASTERDOWN).
  bool replica_failed(const Request& r) const {
    const bool refused = r.outcome == Outcome::kServerError &&
                         (r.text.starts_with("LOADING") || r.text.starts_with("MASTERDOWN"));
    if (!refused && !connection_failed(r)) return false;
    ReaderLock lock(map_mu_);
    return nodes_[r.node]->readonly;
  }

  // The node a request goes to: a replica of its slot when it may and one is known, else the
  // slot's master (the first seed while the map is unknown).
  std::size_t route_locked(const Request& r) const HICACHE_REQUIRES_SHARED(map_mu_) {
    if (r.replica_ok && read_slots_[r.slot] >= 0) {
      return static_cast<std::size_t>(read_slots_[r.slot]);
    }
    return slots_[r.slot] >= 0 ? static_cast<std::size_t>(slots_[r.slot]) : 0;
  }

  void dispatch(std::span<Request> reqs) {
    std::vector<Request*> ptrs;
    ptrs.reserve(reqs.size());
    for (Request& r : reqs) ptrs.push_back(&r);
    dispatch(ptrs);
  }

  // Sends each request to its node (r->node), splitting a node's share over its connections by
  // bytes, and waits for all of them. With `prepare`, the
  // connections' shares are handed over in chunks of about kStreamChunk bytes, the connections
  // in turn, each request prepared right before its chunk goes: every connection starts
  // writing after one chunk's preparation instead of the whole batch's.
  void dispatch(const std::vector<Request*>& reqs, const Prepare& prepare = {}) {
    if (reqs.empty()) return;
    redis::Completion done(reqs.size());
    std::vector<std::vector<Request*>> per_node;
    for (Request* r : reqs) {
      r->completion = &done;
      if (per_node.size() <= r->node) per_node.resize(r->node + 1);
      per_node[r->node].push_back(r);
    }
    std::vector<Part> parts;
    {
      // Nodes and their connections are never removed: the pointers outlive the lock.
      ReaderLock lock(map_mu_);
      for (std::size_t n = 0; n < per_node.size(); ++n) {
        if (!per_node[n].empty()) split_over_connections(*nodes_[n], per_node[n], parts);
      }
    }
    try {
      const std::size_t chunk_bytes = prepare ? kStreamChunk : SIZE_MAX;
      for (bool left = true; left;) {
        left = false;
        for (Part& part : parts) {
          if (part.next == part.reqs.size()) continue;
          std::vector<Request*> chunk;
          std::size_t bytes = 0;
          while (part.next < part.reqs.size() && bytes < chunk_bytes) {
            Request* r = part.reqs[part.next++];
            if (prepare) prepare(*r);
            chunk.push_back(r);
            bytes += weight(*r);
          }
          part.conn->submit(std::move(chunk));
          part.sent = part.next;
          left |= part.next < part.reqs.size();
        }
      }
    } catch (...) {
      // The connections hold pointers to the submitted requests and to `done`: fail the rest
      // and wait for the submitted ones before the stack they live on goes.
      for (Part& part : parts) {
        for (; part.sent < part.reqs.size(); ++part.sent) {
          part.reqs[part.sent]->outcome = Outcome::kIoError;
          part.reqs[part.sent]->text = "not sent: preparing the batch failed";
          done.finish_one();
        }
      }
      done.wait();
      throw;
    }
    done.wait();
  }

  // One connection's share of a dispatch, and how much of it was handed over.
  struct Part {
    redis::Connection* conn;
    std::vector<Request*> reqs;
    std::size_t next = 0;  // prepared
    std::size_t sent = 0;  // handed to the connection
  };
  static constexpr std::size_t kStreamChunk = 256 * 1024;
  static constexpr std::size_t kMinPartBytes = 64 * 1024;

  static std::size_t weight(const Request& r) {
    return r.command.size() + r.payload.size() + r.dst.size();
  }

  // Splits a node's requests, in order, into parts of about equal bytes, one per connection but
  // none under kMinPartBytes: small commands (EXISTS, DEL, small values) go down one pipeline,
  // where more sockets would only add system calls on both sides.
  static void split_over_connections(Node& node, const std::vector<Request*>& reqs,
                                     std::vector<Part>& parts) {
    std::size_t total = 0;
    for (const Request* r : reqs) total += weight(*r);
    const std::size_t k = std::clamp<std::size_t>(total / kMinPartBytes, 1, node.conns.size());
    const std::size_t first = node.next.fetch_add(1, std::memory_order_relaxed);
    std::vector<Request*> part;
    std::size_t part_index = 0, acc = 0;
    for (std::size_t i = 0; i < reqs.size(); ++i) {
      part.push_back(reqs[i]);
      acc += weight(*reqs[i]);
      const bool last = i + 1 == reqs.size();
      // Part p ends once the bytes so far reach (p + 1) / k of the total.
      if (last || (part_index + 1 < k && acc * k >= (part_index + 1) * total)) {
        parts.push_back(
            Part{node.conns[(first + part_index) % node.conns.size()].get(), std::move(part)});
        part = {};
        ++part_index;
      }
    }
  }

  std::size_t known_nodes() {
    ReaderLock lock(map_mu_);
    return nodes_.size();
  }

  // One command to one node, waited for; the reply is in the request.
  std::vector<Request> ask_node(std::size_t node, std::string_view command) {
    std::vector<Request> reqs(1);
    reqs[0].command = command;
    reqs[0].node = node;
    dispatch(reqs);
    return reqs;
  }

  redis::HostPort endpoint_of(std::size_t node) {
    ReaderLock lock(map_mu_);
    return nodes_[node]->address;
  }

  std::string host_of(std::size_t node) {
    ReaderLock lock(map_mu_);
    return nodes_[node]->address.host;
  }

  // The node for host:port, added when new. `readonly`: the replica connections reads go to
  // (their handshake sends READONLY), kept apart from a master's at the same address.
  std::size_t node_index(const std::string& host, std::uint16_t port, bool readonly = false) {
    {
      ReaderLock lock(map_mu_);
      if (const auto i = find_node_locked(host, port, readonly)) return *i;
    }
    WriterLock lock(map_mu_);
    return node_index_locked(host, port, readonly);
  }

  std::optional<std::size_t> find_node_locked(const std::string& host, std::uint16_t port,
                                              bool readonly) const
      HICACHE_REQUIRES_SHARED(map_mu_) {
    for (std::size_t i = 0; i < nodes_.size(); ++i) {
      const Node& n = *nodes_[i];
      if (n.address.host == host && n.address.port == port && n.readonly == readonly) return i;
    }
    return std::nullopt;
  }

  std::size_t node_index_locked(const std::string& host, std::uint16_t port, bool readonly)
      HICACHE_REQUIRES(map_mu_) {
    if (const auto i = find_node_locked(host, port, readonly)) return *i;
    auto node = std::make_unique<Node>();
    node->address = {host, port};
    node->readonly = readonly;
    redis::ConnectionOptions o;
    o.host = host;
    o.port = port;
    o.timeout = config_.timeout;
    o.connect_timeout = config_.connect_timeout;
    o.backoff_initial = config_.backoff_initial;
    o.backoff_max = config_.backoff_max;
    o.username = config_.username;
    o.password = config_.password;
    o.readonly = readonly;
    o.tls = tls_;
    o.tls_server_name = config_.tls.server_name;
    o.splice_min_bytes = tls_ ? 0 : static_cast<std::size_t>(config_.zero_copy_min_bytes);
    for (int c = 0; c < config_.connections; ++c) {
      node->conns.push_back(std::make_unique<redis::Connection>(io_, o));
    }
    nodes_.push_back(std::move(node));
    return nodes_.size() - 1;
  }

  // Asks the known nodes in turn for CLUSTER SLOTS and installs the first valid answer: the
  // masters, and (read_from_replicas) a replica per range to read from, the ranges spread over
  // their replicas. When one started at `not_before` or later (when the caller saw what makes
  // it ask, less how stale a map it accepts), that map stands and this call returns at once: a
  // failover's failed batches ask once, not once each.
  void refresh_slots(std::optional<Clock::time_point> not_before = std::nullopt) {
    MutexLock refresh(refresh_mu_);
    if (not_before && last_refresh_ >= *not_before) return;
    ++owner_.counters_.topology_refreshes;
    last_refresh_ = Clock::now();
    static constexpr std::string_view kClusterSlots = "*2\r\n$7\r\nCLUSTER\r\n$5\r\nSLOTS\r\n";
    const std::size_t known = known_nodes();
    for (std::size_t n = 0; n < known; ++n) {
      std::vector<Request> reqs = ask_node(n, kClusterSlots);
      if (reqs[0].outcome != Outcome::kArray) continue;
      const auto ranges = redis::parse_cluster_slots(*reqs[0].array);
      if (ranges.empty()) continue;
      const std::string asked = host_of(n);
      auto host = [&](const redis::HostPort& hp) { return hp.host.empty() ? asked : hp.host; };
      WriterLock lock(map_mu_);
      std::fill(slots_.begin(), slots_.end(), -1);
      std::fill(read_slots_.begin(), read_slots_.end(), -1);
      for (std::size_t i = 0; i < ranges.size(); ++i) {
        const auto& range = ranges[i];
        const auto idx = static_cast<std::int32_t>(
            node_index_locked(host(range.master), range.master.port, /*readonly=*/false));
        std::fill(slots_.begin() + range.first, slots_.begin() + range.last + 1, idx);
        if (!config_.read_from_replicas || range.replicas.empty()) continue;
        const auto& replica = range.replicas[i % range.replicas.size()];
        const auto ridx = static_cast<std::int32_t>(
            node_index_locked(host(replica), replica.port, /*readonly=*/true));
        std::fill(read_slots_.begin() + range.first, read_slots_.begin() + range.last + 1, ridx);
      }
      return;
    }
  }

  // The connections' TLS context, or nullptr. A file that cannot be read: InvalidArgument
  // naming it and OpenSSL's reason.
  static std::shared_ptr<boost::asio::ssl::context> make_tls_context(const RedisTlsConfig& t) {
    namespace ssl = boost::asio::ssl;
    if (!t.enabled) return nullptr;
    auto ctx = std::make_shared<ssl::context>(ssl::context::tls_client);
    ctx->set_options(ssl::context::default_workarounds | ssl::context::no_sslv2 |
                     ssl::context::no_sslv3 | ssl::context::no_tlsv1 | ssl::context::no_tlsv1_1);
    auto step = [](const char* what, const std::string& file, auto&& f) {
      boost::system::error_code ec;
      f(ec);
      if (ec) {
        throw InvalidArgument(str_cat("redis storage: tls ", what, file.empty() ? "" : " '", file,
                                      file.empty() ? "" : "'", ": ", ec.message()));
      }
    };
    ctx->set_verify_mode(t.verify ? ssl::verify_peer : ssl::verify_none);
    if (!t.ca_file.empty()) {
      step("ca_file", t.ca_file, [&](auto& ec) { ctx->load_verify_file(t.ca_file, ec); });
    } else {
      step("system CA paths", "", [&](auto& ec) { ctx->set_default_verify_paths(ec); });
    }
    if (!t.cert_file.empty()) {
      step("cert_file", t.cert_file,
           [&](auto& ec) { ctx->use_certificate_chain_file(t.cert_file, ec); });
      step("key_file", t.key_file,
           [&](auto& ec) { ctx->use_private_key_file(t.key_file, ssl::context::pem, ec); });
    }
    return ctx;
  }

  RedisStorage& owner_;
  const RedisConfig& config_;
  std::shared_ptr<boost::asio::ssl::context> tls_;
  redis::IoThreads io_;  // before the nodes: stopped explicitly, destroyed after them
  Mutex refresh_mu_;  // one refresh at a time; taken before map_mu_
  mutable SharedMutex map_mu_;
  // batch_set: the share of keys recent batches found already stored, in permille (see set()).
  // Concurrent batches may lose each other's updates; it is an estimate either way.
  static constexpr int kProbeAbovePermille = 62;  // about 1 key in 16
  std::atomic<int> stored_permille_{0};
  // Append-only: a Node stays where it is for the store's life.
  std::vector<std::unique_ptr<Node>> nodes_ HICACHE_GUARDED_BY(map_mu_);
  std::vector<std::int32_t> slots_ HICACHE_GUARDED_BY(map_mu_);       // slot -> node, -1 unknown
  std::vector<std::int32_t> read_slots_ HICACHE_GUARDED_BY(map_mu_);  // slot -> replica, -1 none
  Clock::time_point last_refresh_ HICACHE_GUARDED_BY(refresh_mu_){};  // when the last refresh started
  // How stale a map is accepted: while reads find no replica listed, and while a node fails (an
  // outage's failed batches do not each cost a CLUSTER SLOTS; a promotion is still seen within
  // this long).
  static constexpr auto kReplicaRecheck = std::chrono::seconds(1);
  static constexpr auto kFailureRecheck = std::chrono::milliseconds(50);
};

namespace {

// io_threads 0: one I/O thread per 4 CPUs, 1 to 4, and at least 2 for a cluster. Each thread has
// its own io_context (redis_connection.h). On 2 CPUs, next to a redis-server on the same machine,
// one thread is best for one node (with the threads sharing one io_context, a second thread
// took 256 KiB GETs in batches of 16 from 0.95-1.1 of redis-benchmark to 0.5-0.65), while on the
// 3-node cluster two threads moved 256 KiB x 16 SETs from 3.9-4.0 to 4.4-4.5 GB/s and 8 MiB
// GETs from 2.6-2.9 to 3.1 GB/s (hicache-redisbench, 2026-11-23); three were no better.
RedisConfig resolved(RedisConfig c) {
  if (c.io_threads < 0) {
    throw InvalidArgument(
        str_cat("RedisStorage: io_threads must be >= 0 (0: automatic), got ", c.io_threads));
  }
  if (c.connections < 1) {
    throw InvalidArgument(str_cat("RedisStorage: connections must be >= 1, got ", c.connections));
  }
  if (c.io_threads == 0) {
    const auto cpus = static_cast<int>(std::thread::hardware_concurrency());
    c.io_threads = std::clamp(cpus / 4, c.cluster ? 2 : 1, 4);
  }
  return c;
}

}  // namespace

RedisStorage::RedisStorage(RedisConfig config)
    : config_(resolved(std::move(config))), impl_(std::make_unique<Impl>(*this, config_)) {
  impl_->start();
}

RedisStorage::~RedisStorage() = default;

std::size_t RedisStorage::batch_exists(std::span<const std::string> keys) {
  for (const auto& k : keys) validate_key(k);
  counters_.exists_queries += keys.size();
  if (keys.empty()) return 0;
  return impl_->exists(keys);
}

std::vector<bool> RedisStorage::exists_each(std::span<const std::string> keys) {
  for (const auto& k : keys) validate_key(k);
  counters_.exists_queries += keys.size();
  if (keys.empty()) return {};
  return impl_->exists_each(keys);
}

bool RedisStorage::remove(const std::string& key) {
  validate_key(key);
  return impl_->remove(key);
}

void RedisStorage::touch(std::span<const std::string> keys) {
  std::size_t valid = 0;
  for (const auto& k : keys) {
    try {
      validate_key(k);
      ++valid;
    } catch (const InvalidArgument&) {
      break;  // a hint: the chain's valid head is touched, the rest counted as not refreshed
    }
  }
  if (valid < keys.size()) counters_.touch_errors += keys.size() - valid;
  if (valid == 0) return;
  try {
    impl_->touch(keys.first(valid));
  } catch (const std::exception&) {
    counters_.touch_errors += valid;  // a hint: never thrown
  }
}

void RedisStorage::clear() { impl_->clear(); }

std::uint64_t RedisStorage::zero_copy_bytes() const { return impl_->zero_copy_bytes(); }

std::vector<IoResult> RedisStorage::do_batch_get(std::span<const std::string> keys,
                                                 std::span<const ByteSpan> dst) {
  return impl_->get(keys, dst);
}

std::vector<IoResult> RedisStorage::do_batch_set(std::span<const std::string> keys,
                                                 std::span<const ConstByteSpan> src) {
  return impl_->set(keys, src);
}

std::int64_t RedisStorage::preferred_batch_pages(std::int64_t page_bytes) const {
  return std::max<std::int64_t>(config_.connections,
                                (std::int64_t{4} << 20) / std::max<std::int64_t>(page_bytes, 1));
}

std::unique_ptr<StorageBackend> make_redis_storage(std::string_view json_text) {
  return std::make_unique<RedisStorage>(RedisConfig::from_json_text(json_text));
}

}  // namespace hicache
