#include "controller/kv_events.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <system_error>
#include <thread>
#include <utility>
#include <zmq.hpp>
#include <zmq_addon.hpp>

// msgpack-cxx without Boost (MSGPACK_NO_BOOST comes with the hicache_msgpack target).
#include <msgpack.hpp>

#include "transfer/errors.h"
#include "transfer/mutex.h"

namespace hicache {
namespace {

constexpr int kLingerMs = 1000;  // what the sockets may still send after the destructor

using Packer = msgpack::packer<msgpack::sbuffer>;
using Seq = std::array<char, 8>;

Seq be64(std::uint64_t v) {
  Seq out;
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(v >> (56 - 8 * i));
  return out;
}

std::uint64_t from_be64(const void* data) {
  const auto* p = static_cast<const unsigned char*>(data);
  std::uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v = (v << 8) | p[i];
  return v;
}

std::optional<KvMedium> medium_of(const KvEvent& event) {
  if (const auto* s = std::get_if<KvBlockStored>(&event)) return s->medium;
  if (const auto* r = std::get_if<KvBlockRemoved>(&event)) return r->medium;
  return std::nullopt;
}

// One event's fields, in order: a tagged array, or a map whose keys are the field names.
class Fields {
 public:
  Fields(Packer& pk, bool map, std::size_t n) : pk_(pk), map_(map) {
    map ? pk.pack_map(static_cast<std::uint32_t>(n)) : pk.pack_array(static_cast<std::uint32_t>(n));
  }
  template <typename T>
  void add(std::string_view name, const T& value) {
    key(name);
    pk_.pack(value);
  }
  void add_nil(std::string_view name) {
    key(name);
    pk_.pack_nil();
  }
  void add_salt(std::string_view identity) {  // SGLang's BlockStoredWithMetadata
    key("metadata");
    pk_.pack_map(1);
    pk_.pack(std::string_view("cache_salt"));
    pk_.pack(identity);
  }

 private:
  void key(std::string_view name) {
    if (map_) pk_.pack(name);
  }
  Packer& pk_;
  bool map_;
};

// A tcp endpoint's port must be a number in range (ZeroMQ wraps 99999 to 34463 and connects to
// port 0 without complaint); * binds a free port.
void check_port(std::string_view field, std::string_view endpoint, bool binds) {
  if (!endpoint.starts_with("tcp://")) return;
  const std::size_t colon = endpoint.rfind(':');
  const std::string_view port = endpoint.substr(colon + 1);
  if (binds && port == "*") return;
  unsigned value = 0;
  const auto [end, ec] = std::from_chars(port.data(), port.data() + port.size(), value);
  const char* why = nullptr;
  if (colon < 6 || port.empty() || ec != std::errc() || end != port.data() + port.size() ||
      value > 65535) {
    why = "needs a port 0..65535";
  } else if (!binds && value == 0) {
    why = "is connected (only tcp://*:..., ipc:// and inproc:// bind) and port 0 names no peer";
  }
  if (why != nullptr)
    throw InvalidArgument(str_cat("KvEventsConfig.", field, " '", endpoint, "' ", why));
}

}  // namespace

std::int64_t kv_block_hash(const PageDigest& digest) {
  return static_cast<std::int64_t>(from_be64(digest.data()));
}

std::optional<std::int64_t> kv_block_hash_of_key(std::string_view key) {
  constexpr std::size_t kHex = 64;
  if (key.size() < kHex + 1 || key[key.size() - kHex - 1] != '-') return std::nullopt;
  const std::string_view hex = key.substr(key.size() - kHex);
  if (!std::all_of(hex.begin(), hex.end(),
                   [](char c) { return std::isxdigit(static_cast<unsigned char>(c)); })) {
    return std::nullopt;
  }
  return kv_block_hash(digest_from_hex(hex));
}

std::string_view kv_medium_name(KvMedium medium, bool vllm_dialect) {
  constexpr std::string_view kNames[] = {"GPU", "CPU_PINNED", "DISK", "EXTERNAL"};
  const auto i = static_cast<std::size_t>(medium);
  if (i >= std::size(kNames)) {
    throw InvalidArgument(str_cat("KvMedium ", i, " is not a medium"));
  }
  return medium == KvMedium::kCpuPinned && vllm_dialect ? "CPU" : kNames[i];
}

struct KvEventPublisher::Impl {
  struct Batch {
    std::uint64_t seq = 0;
    double ts = 0;
    std::vector<KvEvent> events;
  };

  explicit Impl(KvEventPublisher& o) : owner(o), cfg(o.config_) {
    if (wake_fd < 0) throw std::system_error(errno, std::generic_category(), "eventfd");
    const bool binds = cfg.endpoint.starts_with("tcp://*") || cfg.endpoint.starts_with("ipc://") ||
                       cfg.endpoint.starts_with("inproc://");
    check_port("endpoint", cfg.endpoint, binds);
    pub.set(zmq::sockopt::linger, kLingerMs);
    open(pub, "endpoint", cfg.endpoint, binds);
    endpoint = pub.get(zmq::sockopt::last_endpoint);
    if (!cfg.replay_endpoint.empty()) {
      check_port("replay_endpoint", cfg.replay_endpoint, true);
      replay = zmq::socket_t(ctx, zmq::socket_type::router);
      replay.set(zmq::sockopt::linger, kLingerMs);
      replay.set(zmq::sockopt::sndhwm,
                 static_cast<int>(std::min<std::int64_t>(cfg.replay_batches + 2, 1 << 30)));
      open(replay, "replay_endpoint", cfg.replay_endpoint, true);
      replay_endpoint = replay.get(zmq::sockopt::last_endpoint);
    }
  }
  ~Impl() { ::close(wake_fd); }

  static void open(zmq::socket_t& socket, std::string_view field, const std::string& endpoint,
                   bool binds) {
    try {
      binds ? socket.bind(endpoint) : socket.connect(endpoint);
    } catch (const zmq::error_t& e) {
      throw InvalidArgument(str_cat("KvEventsConfig.", field, " '", endpoint, "': cannot ",
                                    binds ? "bind" : "connect", ": ", e.what()));
    }
  }

  void register_metrics(MetricsRegistry& registry) {
    metrics.attach(registry);
    constexpr const char* kBatches = "hicache_kv_event_batches_total";
    constexpr const char* kBatchesHelp = "KV event batches, sent or dropped at a full queue";
    metrics.add(kBatches, kBatchesHelp, {{"outcome", "published"}}, owner.published_);
    metrics.add(kBatches, kBatchesHelp, {{"outcome", "dropped"}}, owner.dropped_);
    constexpr const char* kEvents = "hicache_kv_events_total";
    constexpr const char* kEventsHelp = "KV events sent, by type";
    metrics.add(kEvents, kEventsHelp, {{"type", "BlockStored"}}, sent_events[0]);
    metrics.add(kEvents, kEventsHelp, {{"type", "BlockRemoved"}}, sent_events[1]);
    metrics.add(kEvents, kEventsHelp, {{"type", "AllBlocksCleared"}}, sent_events[2]);
    metrics.add_gauge_fn("hicache_kv_event_queue_batches", "KV event batches waiting to be sent",
                         {}, [this] { return static_cast<double>(queued()); });
    metrics.add("hicache_kv_event_errors_total",
                "Exceptions caught on the KV event publisher's thread (each logged)", {}, errors);
  }

  void signal() const {
    const std::uint64_t one = 1;
    // Cannot fail: 8 bytes to an eventfd refuse only when its counter nears 2^64.
    [[maybe_unused]] const ssize_t n = ::write(wake_fd, &one, sizeof one);
  }

  std::size_t queued() const HICACHE_EXCLUDES(mu) {
    MutexLock lock(mu);
    return queue.size();
  }

  void enqueue(Batch batch) HICACHE_EXCLUDES(mu) {
    bool wake = false;
    {
      MutexLock lock(mu);
      batch.seq = next_seq++;
      if (queue.size() >= static_cast<std::size_t>(cfg.queue_batches)) {
        ++owner.dropped_;
        return;
      }
      queue.push_back(std::move(batch));
      ++accepted;
      wake = queue.size() == 1;  // the thread drains until empty: one signal per refill
    }
    if (wake) signal();
  }

  void flush() HICACHE_EXCLUDES(mu) {
    MutexLock lock(mu);
    const std::uint64_t target = accepted;
    while (handled < target) mu.wait(flushed);
  }

  void stop() HICACHE_EXCLUDES(mu) {
    {
      MutexLock lock(mu);
      stopping = true;
    }
    signal();
    thread.join();
  }

  // The thread: sleep until a batch or a replay request comes, send, answer; until stopped.
  void run() {
    for (bool running = true; running;) {
      guarded("waiting for work", [this] { wait_and_answer(); });
      running = drain();
    }
  }

  template <typename F>
  void guarded(const char* what, F&& f) {
    try {
      f();
    } catch (const std::exception& e) {
      ++errors;
      std::fprintf(stderr, "[hicache] kv events: %s failed: %s\n", what, e.what());
    }
  }

  void wait_and_answer() {
    zmq_pollitem_t items[2] = {{nullptr, wake_fd, ZMQ_POLLIN, 0},
                               {replay.handle(), 0, ZMQ_POLLIN, 0}};
    if (zmq_poll(items, replay ? 2 : 1, -1) < 0) {
      if (zmq_errno() == EINTR) return;
      throw zmq::error_t();
    }
    std::uint64_t count = 0;
    if ((items[0].revents & ZMQ_POLLIN) != 0 && ::read(wake_fd, &count, sizeof count) < 0 &&
        errno != EAGAIN) {
      throw std::system_error(errno, std::generic_category(), "reading the eventfd");
    }
    if (!replay || (items[1].revents & ZMQ_POLLIN) == 0) return;
    std::vector<zmq::message_t> request;
    while (zmq::recv_multipart(replay, std::back_inserter(request), zmq::recv_flags::dontwait)) {
      answer(request);
      request.clear();
    }
  }

  // Sends what is queued (unless held); false once stopping and nothing is left.
  bool drain() HICACHE_EXCLUDES(mu) {
    for (;;) {
      Batch batch;
      {
        MutexLock lock(mu);
        if (queue.empty() || (held && !stopping)) {
          const bool stop = stopping && queue.empty();
          flushed.notify_all();
          return !stop;
        }
        batch = std::move(queue.front());
        queue.pop_front();
      }
      guarded("sending a batch", [&] { send(batch); });
      MutexLock lock(mu);
      ++handled;
    }
  }

  void send(const Batch& batch) {
    std::string payload = encode(batch);
    const Seq seq = be64(batch.seq);
    send_frames(pub, {zmq::buffer(cfg.topic), zmq::buffer(seq), zmq::buffer(payload)});
    ++owner.published_;
    for (const KvEvent& e : batch.events) ++sent_events[e.index()];
    if (!replay || cfg.replay_batches == 0) return;
    ring.emplace_back(batch.seq, std::move(payload));
    if (ring.size() > static_cast<std::size_t>(cfg.replay_batches)) ring.pop_front();
  }

  std::string encode(const Batch& batch) const {
    msgpack::sbuffer buf;
    Packer pk(buf);
    pk.pack_array(3);
    pk.pack_double(batch.ts);
    pk.pack_array(static_cast<std::uint32_t>(batch.events.size()));
    for (const KvEvent& e : batch.events) std::visit([&](const auto& ev) { encode(pk, ev); }, e);
    cfg.attn_dp_rank ? pk.pack(*cfg.attn_dp_rank) : pk.pack_nil();
    return std::string(buf.data(), buf.size());
  }
  void encode(Packer& pk, const KvBlockStored& e) const {
    const bool salt = !e.identity.empty();
    Fields f(pk, cfg.map_encoding, 7 + (cfg.vllm_dialect ? 1 : 0) + (salt ? 1 : 0));
    f.add("type", std::string_view("BlockStored"));
    f.add("block_hashes", e.block_hashes);
    e.parent_block_hash ? f.add("parent_block_hash", *e.parent_block_hash)
                        : f.add_nil("parent_block_hash");
    f.add("token_ids", e.token_ids);
    f.add("block_size", e.block_size);
    f.add_nil("lora_id");
    f.add("medium", kv_medium_name(e.medium, cfg.vllm_dialect));
    if (cfg.vllm_dialect) f.add_nil("lora_name");
    if (salt) f.add_salt(e.identity);
  }
  void encode(Packer& pk, const KvBlockRemoved& e) const {
    Fields f(pk, cfg.map_encoding, 3);
    f.add("type", std::string_view("BlockRemoved"));
    f.add("block_hashes", e.block_hashes);
    f.add("medium", kv_medium_name(e.medium, cfg.vllm_dialect));
  }
  void encode(Packer& pk, const KvAllBlocksCleared&) const {
    Fields(pk, cfg.map_encoding, 1).add("type", std::string_view("AllBlocksCleared"));
  }

  // One replay request (frames[0] is the identity the ROUTER put first).
  void answer(const std::vector<zmq::message_t>& frames) {
    const zmq::const_buffer id = zmq::buffer(frames[0].data(), frames[0].size());
    const zmq::const_buffer empty;
    std::string error;
    if (frames.size() != 3) {
      error = str_cat(
          "expected 2 frames after the identity (empty delimiter, 8-byte start "
          "sequence), got ",
          frames.size() - 1);
    } else if (frames[1].size() != 0) {
      error = str_cat("the delimiter frame has ", frames[1].size(), " bytes, not 0");
    } else if (frames[2].size() != 8) {
      error = str_cat("the start sequence has ", frames[2].size(), " bytes, not 8");
    }
    if (!error.empty()) {
      error = "replay request: " + error;
      send_frames(replay, {id, empty, empty, zmq::buffer(error)});
      return;
    }
    const std::uint64_t start = from_be64(frames[2].data());
    auto it = std::lower_bound(ring.begin(), ring.end(), start,
                               [](const auto& entry, std::uint64_t s) { return entry.first < s; });
    for (; it != ring.end(); ++it) {
      const Seq seq = be64(it->first);
      send_frames(replay, {id, empty, zmq::buffer(seq), zmq::buffer(it->second)});
    }
    const Seq end = be64(~std::uint64_t{0});
    send_frames(replay, {id, empty, zmq::buffer(end), empty});
  }

  // PUB and a ROUTER without ROUTER_MANDATORY drop at the high-water mark instead of blocking,
  // so a non-blocking send succeeds or throws.
  static void send_frames(zmq::socket_t& socket, std::initializer_list<zmq::const_buffer> frames) {
    std::size_t left = frames.size();
    for (const zmq::const_buffer& frame : frames) {
      const auto more = --left > 0 ? zmq::send_flags::sndmore : zmq::send_flags::none;
      if (!socket.send(frame, more | zmq::send_flags::dontwait)) {
        throw Error("kv events: a send would have blocked");
      }
    }
  }

  KvEventPublisher& owner;
  const KvEventsConfig& cfg;
  const int wake_fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);  // publish() -> the thread
  zmq::context_t ctx;
  zmq::socket_t pub{ctx, zmq::socket_type::pub}, replay;  // the thread's once it runs
  std::string endpoint, replay_endpoint;                  // as bound; constant
  Counter sent_events[3];                                 // by KvEvent index
  Counter errors;
  std::deque<std::pair<std::uint64_t, std::string>> ring;  // the thread's: seq, payload

  mutable Mutex mu;
  std::condition_variable flushed;  // handled grew
  std::deque<Batch> queue HICACHE_GUARDED_BY(mu);
  std::uint64_t next_seq HICACHE_GUARDED_BY(mu) = 0;
  std::uint64_t accepted HICACHE_GUARDED_BY(mu) = 0;  // batches queued, ever
  std::uint64_t handled HICACHE_GUARDED_BY(mu) = 0;   // of those, sent or failed
  bool held HICACHE_GUARDED_BY(mu) = false;           // KvEventPublisherTestPeer::hold
  bool stopping HICACHE_GUARDED_BY(mu) = false;
  std::thread thread;
  MetricsScope metrics;  // last: forgets the series before anything they read goes
};

KvEventPublisher::KvEventPublisher(KvEventsConfig config, MetricsRegistry* registry)
    : config_(std::move(config)) {
  if (config_.endpoint.empty()) throw InvalidArgument("KvEventsConfig.endpoint is empty");
  if (config_.replay_batches < 0) {
    throw InvalidArgument(
        str_cat("KvEventsConfig.replay_batches is ", config_.replay_batches, "; must be >= 0"));
  }
  if (config_.queue_batches < 1) {
    throw InvalidArgument(
        str_cat("KvEventsConfig.queue_batches is ", config_.queue_batches, "; must be >= 1"));
  }
  impl_ = std::make_unique<Impl>(*this);
  if (registry != nullptr) impl_->register_metrics(*registry);
  impl_->thread = std::thread([impl = impl_.get()] { impl->run(); });
}

KvEventPublisher::~KvEventPublisher() { impl_->stop(); }

void KvEventPublisher::publish(std::vector<KvEvent> events) {
  for (const KvEvent& event : events) {
    if (const auto medium = medium_of(event)) kv_medium_name(*medium, false);  // in range?
    const auto* s = std::get_if<KvBlockStored>(&event);
    if (s == nullptr) continue;
    if (s->block_size < 1 ||
        s->token_ids.size() != s->block_hashes.size() * static_cast<std::size_t>(s->block_size)) {
      throw InvalidArgument(str_cat("KvBlockStored: ", s->token_ids.size(), " token ids for ",
                                    s->block_hashes.size(), " blocks of block_size ",
                                    s->block_size));
    }
  }
  const bool sent[] = {config_.gpu, config_.cpu_pinned, config_.disk, config_.external};
  std::erase_if(events, [&](const KvEvent& event) {
    const auto medium = medium_of(event);  // in range: checked above
    return medium && !sent[static_cast<std::size_t>(*medium)];
  });
  if (events.empty()) return;
  const auto now = std::chrono::system_clock::now().time_since_epoch();
  impl_->enqueue({0, std::chrono::duration<double>(now).count(), std::move(events)});
}

void KvEventPublisher::flush() { impl_->flush(); }
std::string KvEventPublisher::endpoint() const { return impl_->endpoint; }
std::string KvEventPublisher::replay_endpoint() const { return impl_->replay_endpoint; }

void KvEventPublisherTestPeer::hold(KvEventPublisher& publisher, bool held) {
  KvEventPublisher::Impl& impl = *publisher.impl_;
  {
    MutexLock lock(impl.mu);
    impl.held = held;
  }
  impl.signal();
}

}  // namespace hicache
