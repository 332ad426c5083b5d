"""hicache: a hierarchical KV cache for LLM serving (device, pinned host memory, storage).

The C++ library as a Python package:

    import hicache
    cache = hicache.HiCache({"device": "host", "device_tokens": 8192,
                             "model": {"layers": 32, "kv_heads": 8, "head_dim": 128},
                             "storage": {"backend": "file", "root": "/var/cache/hicache"}})
    cache.metrics()          # every counter, gauge and histogram, as a dict

    store = hicache.open_store({"backend": "file", "root": "/tmp/l3"})
    store.batch_set(["k1"], [tensor])      # per-key results: IoResult (ok / miss / error)
    store.batch_get(["k1"], [out_tensor])  # read in place, never copied on the way in

Configuration: the same JSON schema as the C++ library (docs/configuration.md), as a dict or a
path to a JSON file. Bad configuration raises ValueError naming the key and the value; a store
that cannot be opened raises RuntimeError; per-key I/O results are values, never exceptions.
The GIL is released during every I/O and every wait.
"""

import json as _json
import os as _os

from . import _hicache
from ._hicache import IoResult  # noqa: F401

__all__ = ["HiCache", "Store", "IoResult", "open_store", "config_reference"]


def _json_text(config, what):
    if isinstance(config, dict):
        return _json.dumps(config)
    if isinstance(config, (str, _os.PathLike)):
        try:
            with open(config, encoding="utf-8") as f:
                return f.read()
        except OSError as e:
            raise OSError(e.errno, f"{what}: cannot read '{config}': {e.strerror}") from None
    raise TypeError(f"{what}: a dict or a path to a JSON file, not {type(config).__name__}")


class Store:
    """An L3 store (file, Redis, Redis Cluster) on its own: bytes by key.

    Buffers are torch tensors in host memory (contiguous) or any C-contiguous object with the
    buffer protocol; a buffer's size is the record's payload size (a record of another size is a
    miss). Results are one IoResult per key; `bool(result)` is True when it is ok.
    """

    def __init__(self, native):
        self._s = native

    @property
    def name(self):
        return self._s.name

    def batch_exists(self, keys):
        """How many leading keys are stored (stops at the first absent one)."""
        return self._s.batch_exists(list(keys))

    def batch_get(self, keys, buffers):
        return self._s.batch_get(list(keys), list(buffers))

    def batch_set(self, keys, buffers):
        return self._s.batch_set(list(keys), list(buffers))

    def batch_get_ptrs(self, keys, ranges):
        """Reads each key into its list of (address, bytes) ranges (scattered in order).

        The caller guarantees every range is valid, writable memory for the whole call.
        """
        return self._s.batch_get_ptrs(list(keys), ranges)

    def batch_set_ptrs(self, keys, ranges):
        """Stores each key from its list of (address, bytes) ranges (gathered in order)."""
        return self._s.batch_set_ptrs(list(keys), ranges)

    def remove(self, key):
        return self._s.remove(key)

    def clear(self):
        self._s.clear()

    def stats(self):
        return _json.loads(self._s.stats_json())

    def metrics(self):
        return _json.loads(self._s.metrics_json())

    def metrics_text(self):
        return self._s.metrics_text()


def open_store(config):
    """Opens an L3 store from its config (the `storage` object of the HiCache schema)."""
    return Store(_hicache.Store(_json_text(config, "open_store")))


class HiCache:
    """The whole cache (pools, controllers, store, radix tree, metrics) built from one config."""

    def __init__(self, config):
        text = _json_text(config, "HiCache")
        _hicache.validate_config(text)  # a bad config is refused before a store is opened
        parsed = _json.loads(text)
        native_store = None
        storage = parsed.get("storage", parsed.get("hicache_storage_backend"))
        if isinstance(storage, dict):
            native_store = _hicache.Store(_json.dumps(storage))
        self._c = _hicache.HiCache(text, native_store)
        self._store = Store(native_store) if native_store is not None else None

    @property
    def store(self):
        """The L3 store (a Store), or None without one."""
        return self._store

    @property
    def key_prefix(self):
        return self._c.key_prefix

    @property
    def metrics_port(self):
        return self._c.metrics_port

    @property
    def page_size(self):
        return self._c.page_size

    @property
    def device_tokens(self):
        return self._c.device_tokens

    @property
    def host_tokens(self):
        return self._c.host_tokens

    def cached_prefix_tokens(self, tokens):
        return self._c.cached_prefix_tokens(list(tokens))

    def metrics(self):
        """Every metric as a dict (the JSON snapshot /metrics.json serves)."""
        return _json.loads(self._c.metrics_json())

    def metrics_text(self):
        """Prometheus text exposition."""
        return self._c.metrics_text()

    def close(self):
        """Stops every thread and frees the pools; idempotent."""
        self._c.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def config_reference():
    """The configuration reference (Markdown), generated from the schema."""
    return _hicache.config_reference()
