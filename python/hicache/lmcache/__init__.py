"""hicache as an LMCache L2 adapter (LMCache's `native_plugin` type), docs/lmcache.md.

LMCache's multiprocess server loads it with

    --l2-adapter '{"type": "native_plugin", "module_path": "hicache.lmcache",
                   "class_name": "HiCacheL2Adapter",
                   "adapter_params": {"storage": {"backend": "file", "root": "/var/cache/l2"}},
                   "max_capacity_gb": 0}'

and calls the class with `adapter_params` as keyword arguments. The class is the C++
hicache._hicache.AsyncStore (C++ worker threads, an eventfd, zero-copy buffers), so LMCache's
bridge talks to it exactly as to one of its own C++ connectors: event_fd, submit_batch_get /
submit_batch_set (keys, memoryviews), submit_batch_exists, submit_batch_delete,
drain_completions -> [(future_id, ok, error, per_key)], close.
"""

import json as _json

from .. import _hicache
from .. import Store as _Store

__all__ = ["HiCacheL2Adapter"]


class HiCacheL2Adapter(_hicache.AsyncStore):
    """LMCache's native_plugin L2 connector over a hicache store (file, Redis, Redis Cluster).

    storage: the store's config (the `storage` object of hicache's config schema) as a dict or
        JSON text, or an open hicache.Store (shared; its metrics stay in its own registry).
    namespace: a prefix of every record name ("" for none; [A-Za-z0-9_+=@,%.-], at most 160
        bytes): deployments sharing one store but never each other's pages pick different ones.
        LMCache's keys already carry the model name, the KV rank and the cache salt.
    workers: C++ threads running jobs (each job is one store batch call).
    max_pending: jobs queued or running; a submit beyond it completes at once as failed
        (ok False, error "queue full ...") rather than blocking or raising: LMCache counts it as
        a failed store / a miss.
    metrics_port: -1 (off), 0 (a free port, see .metrics_port) or a port: serves the metrics at
        http://metrics_bind:port/metrics (Prometheus text) and /metrics.json until close().
    spin_us: how long a worker that ended the only job in flight looks for the next one before
        it sleeps (0..10^7 microseconds; 0 never looks): the bridge's next submit then wakes no
        sleeping thread (docs/lmcache.md).

    Bad arguments raise ValueError naming them; a store that cannot be opened raises OSError or
    RuntimeError. Unknown keyword arguments raise TypeError (nothing is silently ignored).
    """

    def __init__(self, storage, namespace="", workers=4, max_pending=1024, metrics_port=-1,
                 metrics_bind="127.0.0.1", spin_us=_hicache.AsyncStore.DEFAULT_SPIN_US):
        if isinstance(storage, _Store):
            native = storage._s
        elif isinstance(storage, dict):
            native = _json.dumps(storage)
        elif isinstance(storage, str):
            native = storage
        else:
            raise ValueError("HiCacheL2Adapter: storage is a dict, JSON text or a hicache.Store, "
                             f"not {type(storage).__name__}")
        if not isinstance(namespace, str):
            raise ValueError(f"HiCacheL2Adapter: namespace {namespace!r} is not a string")
        super().__init__(native, prefix=namespace, workers=int(workers),
                         max_pending=int(max_pending), metrics_port=int(metrics_port),
                         metrics_bind=str(metrics_bind), spin_us=int(spin_us))

    def metrics(self):
        """The adapter's metrics (jobs and keys by kind and outcome, job latency, pending jobs,
        and the store's own when it was opened here), as a dict."""
        return _json.loads(self.metrics_json())
