// KV events: what the cache holds, per tier, for a KV-aware router (SGLang's router, Dynamo's KV
// router, llm-d's scheduler). Wire-compatible with SGLang's and vLLM's event publishers: a
// subscriber written for them decodes ours.
//
// Wire (ZeroMQ PUB, one message of three frames per batch):
//   [topic bytes, 8-byte big-endian sequence number, msgpack EventBatch]
//   EventBatch = [ts: float seconds since the epoch, events: [...], attn_dp_rank: int | nil]
// Events, in the array encoding (SGLang's and vLLM's older form; the default):
//   ["BlockStored", block_hashes: [int], parent_block_hash: int | nil, token_ids: [int],
//    block_size: int, lora_id: int | nil, medium: str]            (+ lora_name: nil, vllm dialect)
//   (a cache identity makes it BlockStoredWithMetadata: one more field {"cache_salt": identity})
//   ["BlockRemoved", block_hashes: [int], medium: str]
//   ["AllBlocksCleared"]
// and in the map encoding (2026 form): the same fields as a map, "type" first, named as above.
// Medium: "GPU" (device), "CPU_PINNED" (host; "CPU" in the vllm dialect), "DISK" (a file store),
// "EXTERNAL" (Redis, Redis Cluster).
//
// Replay (ZeroMQ ROUTER, optional): a request [identity, b"", 8-byte big-endian start sequence]
// is answered with one [identity, b"", seq, payload] per buffered batch from `start` on, then
// the end marker [identity, b"", 0xff x 8, b""]. A malformed request (not two frames after the
// identity, a delimiter that is not empty, or a sequence that is not 8 bytes) is answered with
// [identity, b"", b"", error text] and changes nothing. A start older than the buffer gets what
// the buffer still holds. The ROUTER queues up to replay_batches + 2 messages per client, so
// one replay at a time per client always arrives whole.
//
// Sequence numbers start at 0 and grow by 1 per batch. A batch the queue had no room for keeps
// its number and is counted as dropped: a subscriber sees the gap, asks for a replay, and a
// replay that skips the number tells it the batch is lost (the replay buffer never held it).
// A batch whose events were all filtered out (media not published) is not a batch: it takes no
// number, so a gap always means a lost batch. A subscriber that was only slow (ZeroMQ dropped
// for it at the high-water mark) gets every batch still in the replay buffer back.
//
// Threads: publish() may be called from any thread and never blocks (a bounded queue in front
// of the publisher's own thread, which owns both sockets, encodes the batches and answers
// replays; it sleeps in zmq_poll on the ROUTER and an eventfd that publish() signals). The
// destructor sends what is queued, then stops the thread; the sockets then linger at most 1 s
// for slow peers. An exception on the thread is caught, counted
// (hicache_kv_event_errors_total) and logged to stderr; the thread goes on.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "storage/page_key.h"
#include "transfer/metrics.h"

namespace hicache {

enum class KvMedium : std::uint8_t { kGpu, kCpuPinned, kDisk, kExternal };

// A block's hash on the wire: the page digest's first 8 bytes, big-endian, as a signed 64-bit
// integer (SGLang's hashes are signed 64-bit).
std::int64_t kv_block_hash(const PageDigest& digest);
// The same from an L3 page key ("<namespace>-<64 hex digits>"); nullopt when `key` does not end
// in a digest.
std::optional<std::int64_t> kv_block_hash_of_key(std::string_view key);

struct KvBlockStored {
  std::vector<std::int64_t> block_hashes;
  std::optional<std::int64_t> parent_block_hash;  // the page before the first; none at a root
  std::vector<std::int32_t> token_ids;            // block_hashes.size() * block_size of them
  std::int64_t block_size = 0;
  std::string identity;  // cache identity (tenant / LoRA); empty: none. Sent as cache_salt.
  KvMedium medium = KvMedium::kGpu;
};
struct KvBlockRemoved {
  std::vector<std::int64_t> block_hashes;
  KvMedium medium = KvMedium::kGpu;
};
struct KvAllBlocksCleared {};
using KvEvent = std::variant<KvBlockStored, KvBlockRemoved, KvAllBlocksCleared>;

// Endpoints are ZeroMQ's ("tcp://host:port", "ipc://path", "inproc://name"); a tcp port is
// 0..65535 (0 or * bind a free port; a connected endpoint needs a real one).
struct KvEventsConfig {
  std::string endpoint;         // PUB; "tcp://*:5557" binds (wildcard, ipc, inproc), else connects
  std::string replay_endpoint;  // ROUTER, always binds; empty: no replay
  std::string topic;            // the first frame of every message
  // Which media are published (the others' events are not sent); all four by default.
  // AllBlocksCleared has no medium and is always sent.
  bool gpu = true, cpu_pinned = true, disk = true, external = true;
  bool vllm_dialect = false;  // vLLM's names: "CPU" for the host, lora_name in BlockStored
  bool map_encoding = false;  // events as maps ("type" first) instead of tagged arrays
  std::optional<std::int64_t> attn_dp_rank;  // the batch's third field; nil when unset
  std::int64_t replay_batches = 10000;       // batches kept for replay (>= 0)
  std::int64_t queue_batches = 10000;        // batches waiting for the thread before drops (>= 1)
};

// The medium's name on the wire; throws InvalidArgument for a value outside the enum.
std::string_view kv_medium_name(KvMedium medium, bool vllm_dialect);

class KvEventPublisher {
 public:
  // Binds or connects the sockets (on the calling thread, so a bad endpoint throws
  // InvalidArgument naming it; so do an empty endpoint and sizes out of range) and starts the
  // thread. Registers its metrics in `registry` when given, which must outlive the publisher
  // (hicache_kv_event_batches_total{outcome=published|dropped}, hicache_kv_events_total{type}
  // (sent events, type as on the wire), hicache_kv_event_queue_batches,
  // hicache_kv_event_errors_total).
  KvEventPublisher(KvEventsConfig config, MetricsRegistry* registry = nullptr);
  ~KvEventPublisher();
  KvEventPublisher(const KvEventPublisher&) = delete;
  KvEventPublisher& operator=(const KvEventPublisher&) = delete;

  // One batch, stamped now. Events of media not published are left out; an empty batch is not
  // sent and takes no number. Never blocks; a full queue drops the batch (counted; its number
  // stays a gap). Throws InvalidArgument, publishing nothing, for a BlockStored whose block_size
  // is below 1 or whose token_ids are not block_hashes.size() * block_size, or a medium outside
  // the enum.
  void publish(std::vector<KvEvent> events);
  // Blocks until every batch published before the call is sent (tests; shutdown).
  void flush();

  // The endpoints as ZeroMQ reports them (ZMQ_LAST_ENDPOINT): a port 0 or * request names the
  // port the system chose, and a wildcard reads as its address ("tcp://*:0" ->
  // "tcp://0.0.0.0:41234", which a local client can connect to). Empty: no replay.
  std::string endpoint() const;
  std::string replay_endpoint() const;
  const KvEventsConfig& config() const { return config_; }

  std::uint64_t published_batches() const { return published_.value(); }
  std::uint64_t dropped_batches() const { return dropped_.value(); }

 private:
  friend class KvEventPublisherTestPeer;
  struct Impl;
  KvEventsConfig config_;
  Counter published_, dropped_;
  std::unique_ptr<Impl> impl_;
};

// Tests only (tests/controller/kv_events_test.cc): hold(true) keeps the publisher's thread off
// its queue, so batches wait (and overflow) until hold(false); replays are still answered, and
// flush() waits for hold(false). The destructor sends the queue even while held. Costs
// publish() nothing.
class KvEventPublisherTestPeer {
 public:
  static void hold(KvEventPublisher& publisher, bool held);
};

}  // namespace hicache
