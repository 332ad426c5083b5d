"""hicache as a vLLM secondary offloading tier (vLLM's SecondaryTierManager), docs/vllm.md.

vLLM's offloading connector loads it out of tree from its `secondary_tiers` config:

    {"type": "HiCacheTier", "module_path": "hicache.vllm",
     "storage": {"backend": "file", "root": "/nvme/vllm-tier"},
     "namespace": {"model": "meta-llama/Llama-3.1-8B", "fingerprint": "main", "dtype": "bf16",
                   "block_size": 16, "tp_size": 1}}

Bytes move between the rows of vLLM's primary CPU tier (`primary_kv_view`, one row per block
id) and the store by pointer, on hicache's C++ threads (hicache._hicache.AsyncStore) without
the GIL; every call from vLLM returns at once except drain_jobs and shutdown.
"""

import enum as _enum
import json as _json
import select as _select
from collections import namedtuple as _namedtuple
from dataclasses import dataclass as _dataclass

from .. import _hicache

try:  # vLLM's factory requires a subclass of its SecondaryTierManager
    from vllm.v1.kv_offload.tiering.base import SecondaryTierManager as _Base
except ImportError:  # works without vLLM (tests, other drivers)
    _Base = object

try:
    from vllm.v1.kv_offload.base import LookupResult
except ImportError:
    class LookupResult(_enum.Enum):
        """vLLM's lookup answers (the names vLLM uses)."""
        MISS = 0
        HIT = 1
        HIT_PENDING = 2
        RETRY = 3

try:
    from vllm.v1.kv_offload.tiering.base import JobResult
except ImportError:
    JobResult = _namedtuple("JobResult", ["job_id", "success"])

try:  # what build_metric_definitions declares each metric with
    from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingGaugeMetadata
except ImportError:
    @_dataclass(frozen=True)
    class OffloadingCounterMetadata:
        """A counter's declaration (vLLM's names): its help text and label names."""
        documentation: str
        labelnames: tuple = ()

    @_dataclass(frozen=True)
    class OffloadingGaugeMetadata:
        """A gauge's declaration (vLLM's names): its help text and label names."""
        documentation: str
        labelnames: tuple = ()

try:  # what get_stats returns: vLLM's container where it has gauges and counters
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats as TierStats)
    if not all(hasattr(TierStats, m) for m in ("set_gauge", "increase_counter", "is_empty")):
        raise ImportError("an OffloadingConnectorStats without metrics by name")
except ImportError:
    class TierStats:
        """What get_stats returns without vLLM (vLLM's OffloadingConnectorStats surface):
        `gauges` and `counters`, dicts of metric name -> value (no labels: the tier's metrics
        have none), filled through set_gauge / increase_counter."""

        def __init__(self):
            self.gauges, self.counters = {}, {}

        def set_gauge(self, name, value, labelvalues=()):
            self.gauges[name] = value

        def increase_counter(self, name, value=1, labelvalues=()):
            self.counters[name] = self.counters.get(name, 0) + value

        def is_empty(self):
            return not self.gauges and not self.counters

__all__ = ["HiCacheTier", "HiCacheTierMetrics", "LookupResult", "JobResult", "TierStats",
           "OffloadingCounterMetadata", "OffloadingGaugeMetadata"]

class HiCacheTierMetrics:
    """The names of the metrics the tier declares to vLLM (build_metric_definitions) and
    reports through get_stats. Gauges are the store's, read at each get_stats; counters are the
    tier's observations since the previous get_stats. None has labels."""

    CAPACITY_BYTES = "vllm:kv_offload_hicache_capacity_bytes"
    USAGE_BYTES = "vllm:kv_offload_hicache_usage_bytes"
    STORED_BLOCKS = "vllm:kv_offload_hicache_stored_blocks"
    LOOKUP_HITS = "vllm:kv_offload_hicache_lookup_hits"
    LOOKUP_MISSES = "vllm:kv_offload_hicache_lookup_misses"
    LOAD_BYTES = "vllm:kv_offload_hicache_load_bytes"
    STORE_BYTES = "vllm:kv_offload_hicache_store_bytes"
    LOAD_FAILURES = "vllm:kv_offload_hicache_load_failures"
    STORE_FAILURES = "vllm:kv_offload_hicache_store_failures"

    GAUGES = {
        CAPACITY_BYTES: "Bytes the tier's store may hold: its capacity_bytes, or with 0 the "
                        "records plus the disk's free space less the reserve (file store); 0 "
                        "where the store cannot tell (Redis: its maxmemory bounds it).",
        USAGE_BYTES: "Record bytes (payload and header) the tier's store holds, of every "
                     "deployment sharing it (file store; 0 on Redis).",
        STORED_BLOCKS: "Records the tier's store holds, of every deployment sharing it (file "
                       "store; 0 on Redis).",
    }
    COUNTERS = {
        LOOKUP_HITS: "Lookups the tier answered HIT (RETRY answers are not counted).",
        LOOKUP_MISSES: "Lookups the tier answered MISS (RETRY answers are not counted).",
        LOAD_BYTES: "Bytes the tier loaded into the primary tier (jobs that succeeded).",
        STORE_BYTES: "Bytes of blocks the tier's store jobs handed to the store, when the job "
                     "succeeded (a block the store held already counts, one another job of the "
                     "tier was writing does not).",
        LOAD_FAILURES: "Load (promotion) jobs that failed: a block missing, corrupt or "
                       "unreadable, bad block ids, a full queue, a job after shutdown.",
        STORE_FAILURES: "Store jobs that failed: an I/O error, bad block ids, a full queue, a "
                        "job after shutdown.",
    }


_COUNTER_FIELDS = {  # the tier's own counter -> its metric
    "hits": HiCacheTierMetrics.LOOKUP_HITS, "misses": HiCacheTierMetrics.LOOKUP_MISSES,
    "load_bytes": HiCacheTierMetrics.LOAD_BYTES, "store_bytes": HiCacheTierMetrics.STORE_BYTES,
    "load_failures": HiCacheTierMetrics.LOAD_FAILURES,
    "store_failures": HiCacheTierMetrics.STORE_FAILURES,
}

_MAX_ANSWERS = 1 << 16  # exists answers kept for the next lookup of their key

_NAMESPACE_FIELDS = {"model", "fingerprint", "dtype", "block_size", "tp_size", "pp_size",
                     "identity", "layout"}


def _prefix(namespace, row_bytes):
    """hicache's key prefix for this deployment: model, weights fingerprint, KV dtype, block
    size, parallel layout (a row holds every worker's KV: TP and PP sizes), row size and
    identity, so that two models, two layouts or two tenants never share a record."""
    if not isinstance(namespace, dict):
        raise ValueError(f"HiCacheTier: namespace must be a dict, not {type(namespace).__name__}")
    unknown = set(namespace) - _NAMESPACE_FIELDS
    if unknown:
        raise ValueError(f"HiCacheTier: namespace keys {sorted(unknown)} (valid: "
                         f"{sorted(_NAMESPACE_FIELDS)})")
    for required in ("model", "dtype", "block_size"):
        if required not in namespace:
            raise ValueError(f"HiCacheTier: namespace lacks '{required}'")
    pp = int(namespace.get("pp_size", 1))
    layout = (f"vllm.{namespace.get('layout', 'worker')}.row{row_bytes}.pp{pp}"
              f".id-{namespace.get('identity', '')}")
    return _hicache.key_prefix(str(namespace["model"]), str(namespace.get("fingerprint", "none")),
                               str(namespace["dtype"]), layout, int(namespace["block_size"]),
                               0, int(namespace.get("tp_size", 1)), False)


class HiCacheTier(_Base):
    """A secondary tier over a hicache store (file, Redis, Redis Cluster).

    Keyword arguments (vLLM's factory passes the first three, and the tier config's own keys):
    offloading_spec, primary_kv_view (2-D C-contiguous byte memoryview, one row per block id),
    tier_type, storage (the store's config dict, or an open hicache.Store), namespace (dict:
    model, dtype, block_size required; fingerprint, tp_size, pp_size, identity, layout
    optional), workers, max_pending, metrics_port, metrics_bind and spin_us (the AsyncStore's:
    metrics_port -1 off, 0 a free port, /metrics and /metrics.json until shutdown; spin_us how
    long a worker that ended the only job in flight looks for the next, 0 never).

    lookup: HIT when the tier stored the key, or the store holds it (the file store answers from
    its index, no I/O); on a store without an index (Redis) it answers RETRY while an exists
    job runs, then the job's answer. A key with a store job in flight is RETRY. Jobs report
    success False when any of their keys failed (missing, corrupt, I/O error): vLLM then
    recomputes; never wrong bytes.

    vLLM's metric hooks: build_metric_definitions declares HiCacheTierMetrics (the store's
    capacity, usage and stored blocks as gauges; lookup hits and misses, loaded and stored
    bytes, failed jobs as counters) and get_stats returns and resets them. touch refreshes the
    file store's recency (see there).
    """

    def __init__(self, offloading_spec=None, primary_kv_view=None, tier_type=None, *,
                 storage, namespace, workers=4, max_pending=1024, metrics_port=-1,
                 metrics_bind="127.0.0.1", spin_us=_hicache.AsyncStore.DEFAULT_SPIN_US):
        if _Base is not object:
            super().__init__(offloading_spec=offloading_spec, primary_kv_view=primary_kv_view,
                             tier_type=tier_type)
        self._offloading_spec, self._primary_kv_view, self.tier_type = (
            offloading_spec, primary_kv_view, tier_type)
        view = memoryview(primary_kv_view)
        if view.ndim != 2 or view.itemsize != 1 or not view.c_contiguous or view.readonly:
            raise ValueError("HiCacheTier: primary_kv_view must be a writable 2-D C-contiguous "
                             f"byte view (ndim {view.ndim}, itemsize {view.itemsize}, "
                             f"contiguous {view.c_contiguous}, readonly {view.readonly})")
        self._rows, self._row_bytes = view.shape
        self._flat = view.cast("B")
        if isinstance(storage, dict):  # opened here: its metrics join the tier's registry
            native = _json.dumps(storage)
        elif hasattr(storage, "_s") and isinstance(storage._s, _hicache.Store):  # hicache.Store
            native = storage._s
        else:
            raise ValueError(f"HiCacheTier: storage must be a dict, not {type(storage).__name__}")
        self._async = _hicache.AsyncStore(native, prefix=_prefix(namespace, self._row_bytes),
                                          workers=int(workers), max_pending=int(max_pending),
                                          metrics_port=int(metrics_port),
                                          metrics_bind=str(metrics_bind),
                                          spin_us=int(spin_us))
        self._async.bind_rows(self._flat, self._row_bytes)  # jobs name rows, no view per block
        self._indexed = self._async.store_name == "file"  # exists from the index, no I/O
        self._fd = self._async.event_fd()
        self._futures = {}       # future id -> ("store" | "load", job_id, keys) | ("exists", key)
        self._storing = {}       # key -> store jobs in flight
        self._asking = set()     # keys with an exists job in flight
        self._answers = {}       # key -> bool: an exists job's answer, used by the next lookup
        self._finished = []      # JobResults not yet returned
        self._counts = dict.fromkeys(_COUNTER_FIELDS, 0)  # observations since get_stats
        self._closed = False

    # --- the tier contract ----------------------------------------------------------------

    def lookup(self, key, req_context=None):
        answer = self._lookup(key)
        if answer is not LookupResult.RETRY:
            self._counts["hits" if answer is LookupResult.HIT else "misses"] += 1
        return answer

    def submit_store(self, job_metadata):
        self._submit(job_metadata, "store")

    def submit_load(self, job_metadata):
        self._submit(job_metadata, "load")

    def get_finished_jobs(self):
        self._pump()
        out, self._finished = self._finished, []
        return out

    def drain_jobs(self):
        """Blocks until every submitted job has finished (reported by get_finished_jobs)."""
        while self._futures:
            if self._closed:  # close() finished every accepted job: one drain takes them all
                self._pump()
                break
            _select.select([self._fd], [], [], 1.0)
            self._pump()

    def has_pending_work(self):
        return bool(self._futures or self._finished)

    def on_new_request(self, req_context):
        try:
            from vllm.v1.kv_offload.base import RequestOffloadingContext
        except ImportError:
            return None
        return RequestOffloadingContext()

    def on_request_finished(self, req_context):
        pass  # no per-request state

    def touch(self, keys, req_context=None):
        """vLLM's recency hint: the file store makes the blocks' records its most recently used,
        the first key youngest (vLLM passes a request's keys in prefix order, so a full store
        evicts a prefix's tail before its head), in memory on this thread; on Redis a worker
        sends TOUCH (the server's LRU / LFU counts them as just used) and this thread does not
        wait. Never reported as a job; nothing after shutdown."""
        if self._closed or not keys:
            return
        self._async.touch([bytes(k).hex() for k in keys])

    def take_events(self):
        return []

    def on_schedule_end(self, context=None):
        pass

    def get_stats(self):
        """Returns and resets the tier's observations, as a TierStats (vLLM's
        OffloadingConnectorStats where vLLM has one): the gauges of HiCacheTierMetrics.GAUGES
        read from the store now (stats(): capacity_bytes, stored_bytes, stored_keys), and the
        counters of HiCacheTierMetrics.COUNTERS counted since the previous call (a counter that
        did not move is left out). Never blocks (the store's gauges are in memory); also after
        shutdown."""
        self._pump()
        out = TierStats()
        store = self.stats()
        m = HiCacheTierMetrics
        out.set_gauge(m.CAPACITY_BYTES, store["capacity_bytes"])
        out.set_gauge(m.USAGE_BYTES, store["stored_bytes"])
        out.set_gauge(m.STORED_BLOCKS, store["stored_keys"])
        for field, name in _COUNTER_FIELDS.items():
            if self._counts[field]:
                out.increase_counter(name, self._counts[field])
                self._counts[field] = 0
        return out

    def shutdown(self):
        """Finishes every accepted job (reported by the next get_finished_jobs), then stops."""
        if not self._closed:
            self._async.close()
            self._closed = True
        self._pump()

    @classmethod
    def build_metric_definitions(cls, tier_config):
        """The metrics get_stats reports, by name (HiCacheTierMetrics): capacity, usage and
        stored-block gauges, lookup hit and miss, load and store byte, and failed-job counters.
        The same whatever `tier_config` (the tier's config dict, which vLLM passes without an
        instance) holds; the names are fixed, so one HiCacheTier per vLLM engine."""
        m = HiCacheTierMetrics
        out = {name: OffloadingGaugeMetadata(documentation=doc) for name, doc in m.GAUGES.items()}
        out.update({name: OffloadingCounterMetadata(documentation=doc)
                    for name, doc in m.COUNTERS.items()})
        return out

    # --- hicache's own ------------------------------------------------------------------

    def stats(self):
        """The store's counters and gauges (stored_bytes, capacity_bytes, ...) as a dict."""
        return _json.loads(self._async.stats_json())

    def metrics_text(self):
        return self._async.metrics_text()

    @property
    def metrics_port(self):
        """The port serving /metrics, or -1."""
        return self._async.metrics_port

    def event_fd(self):
        """A file descriptor readable while the tier's store has completions the tier has not
        taken in; get_finished_jobs (and lookup) take them in and clear it, so a driver calls
        get_finished_jobs before it waits. vLLM polls once per step and never waits on it; a
        driver with nothing else to do (a benchmark) can select() on it instead of spinning.
        RuntimeError after shutdown."""
        if self._closed:
            raise RuntimeError("HiCacheTier: event_fd after shutdown")
        return self._fd

    # --- internals --------------------------------------------------------------------------

    def _lookup(self, key):
        self._pump()
        k = bytes(key).hex()
        if self._storing.get(k):
            return LookupResult.RETRY
        if self._indexed:
            return LookupResult.HIT if self._async.exists_now([k]) == 1 else LookupResult.MISS
        if k in self._answers:
            return LookupResult.HIT if self._answers.pop(k) else LookupResult.MISS
        if k not in self._asking:
            try:
                self._futures[self._async.submit_batch_exists(keys=[k])] = ("exists", k)
            except Exception:  # the object-store tier's pattern: a failed lookup is a miss
                return LookupResult.MISS
            self._asking.add(k)
        return LookupResult.RETRY

    def _end(self, job_id, kind, success, nbytes=0):
        """Reports a job (at the next get_finished_jobs) and counts it."""
        self._finished.append(JobResult(job_id, success))
        if success:
            self._counts[f"{kind}_bytes"] += nbytes
        else:
            self._counts[f"{kind}_failures"] += 1

    def _submit(self, job, kind):
        job_id = job.job_id
        ids = getattr(job, "chunk_ids", None)
        if ids is None:
            ids = job.block_ids
        keys = [bytes(k).hex() for k in job.keys]
        ids = [int(b) for b in (ids.tolist() if hasattr(ids, "tolist") else ids)]
        if len(ids) != len(keys) or any(b < 0 or b >= self._rows for b in ids):
            self._end(job_id, kind, False)  # never a short or foreign row
            return
        if kind == "store":  # duplicates: a key being stored now is stored once
            pairs = [(k, b) for k, b in zip(keys, ids) if not self._storing.get(k)]
            keys, ids = [p[0] for p in pairs], [p[1] for p in pairs]
            if not keys:
                self._end(job_id, kind, True)
                return
        try:
            submit = (self._async.submit_rows_set if kind == "store"
                      else self._async.submit_rows_get)
            fid = submit(keys=keys, rows=ids)
        except Exception:  # closed, or refused: a failed job, never an exception in vLLM
            self._end(job_id, kind, False)
            return
        self._futures[fid] = (kind, job_id, keys)
        if kind == "store":
            for k in keys:
                self._storing[k] = self._storing.get(k, 0) + 1

    def _pump(self):
        for fid, ok, _error, per_key in self._async.drain_completions():
            entry = self._futures.pop(fid, None)
            if entry is None:
                continue
            if entry[0] == "exists":
                self._asking.discard(entry[1])
                if len(self._answers) >= _MAX_ANSWERS:  # answers nobody came back for
                    self._answers.clear()
                self._answers[entry[1]] = bool(ok and per_key and per_key[0])
                continue
            kind, job_id, keys = entry
            if kind == "store":
                for k in keys:
                    self._storing[k] -= 1
                    if not self._storing[k]:
                        del self._storing[k]
            self._end(job_id, kind, bool(ok and all(per_key)), len(keys) * self._row_bytes)

