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

Engine adapters are subpackages, imported on their own: hicache.sglang (SGLang's L3 backend
HiCacheStore and the drop-in HiCacheController, docs/sglang.md), hicache.vllm (vLLM's secondary
offloading tier HiCacheTier, docs/vllm.md), hicache.lmcache (LMCache's native_plugin L2
adapter HiCacheL2Adapter, docs/lmcache.md).

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
    """The whole cache (pools, controllers, store, radix tree, metrics) built from one config.

    The engine's KV tensors, when given, are the pools' memory, wrapped in place and never
    freed, copied or moved (the cache keeps a reference to them): `device_kv` one tensor of the
    device pool (SGLang's order: MHA (2, L, S, H, D), MLA (L, S, 1, D)), or `device_k` /
    `device_v` lists of per-layer tensors (S, H, D), SGLang's k_buffer / v_buffer, allocated
    together or one by one; `host_kv` one tensor in the config's host_layout (SGLang's kv_buffer shapes).
    `dim_order` "hicache" reads them in hicache's own orders instead.

    A hybrid model's sidecar pools (the config's `sidecars`: a state, a sliding window, an
    indexer's keys; docs/hybrid.md) allocate their own memory, or wrap the engine's device
    tensors given as `sidecars={name: tensor}` (one tensor per pool of device_pages x
    slots_per_page slots of layers x slot_bytes, SGLang's order (layers, slots, 1, elements)).
    Their pages move with the KV's: `write`, `load_into` and `evict_device` take
    `sidecars={name: ...}`.
    """

    def __init__(self, config, *, device_kv=None, host_kv=None, device_k=None, device_v=None,
                 dim_order="sglang", sidecars=None):
        text = _json_text(config, "HiCache")
        _hicache.validate_config(text)  # a bad config is refused before a store is opened
        parsed = _json.loads(text)
        native_store = None
        storage = parsed.get("storage", parsed.get("hicache_storage_backend"))
        if isinstance(storage, dict):
            native_store = _hicache.Store(_json.dumps(storage))
        self._c = _hicache.HiCache(text, native_store, device_kv=device_kv, host_kv=host_kv,
                                   device_k=device_k, device_v=device_v, dim_order=dim_order,
                                   sidecars=dict(sidecars) if sidecars is not None else None)
        self._store = Store(native_store) if native_store is not None else None

    # --- the controller, for an engine that drives it (slots are token slot lists) ---------

    def alloc_device(self, tokens):
        """Whole pages of device slots from the pool's allocator, or None when short."""
        return self._c.alloc_device(tokens)

    def free_device(self, slots):
        self._c.free_device(list(slots))

    def write(self, device_slots, node_id, sidecars=None):
        """Backs up device slots to new host slots (returned; None when the host pool or the
        queue is full); an ack (node_id, ok) follows. With `sidecars` ({pool name: device
        slots}), those sidecar pages are copied in the same op to new host pages of their pools:
        returns (host_slots, {pool name: host slots}), or None (nothing reserved)."""
        if sidecars is None:
            return self._c.write(list(device_slots), node_id)
        return self._c.write_with_sidecars(list(device_slots), node_id,
                                           {k: list(v) for k, v in sidecars.items()})

    def load_into(self, host_slots, device_slots, node_id, sidecars=None):
        """Loads host pages (backup state) into device slots the engine allocated; False when
        the load queue is full. Runs at the next start_loading(). `sidecars`: {pool name:
        (host slots, device slots)} loaded in the same op, landed before layer 0 is done."""
        if sidecars is None:
            return self._c.load_into(list(host_slots), list(device_slots), node_id)
        return self._c.load_into_with_sidecars(
            list(host_slots), list(device_slots), node_id,
            {k: (list(h), list(d)) for k, (h, d) in sidecars.items()})

    def evict_device(self, device_slots, host_slots, sidecars=None):
        """Frees device slots whose host copy is synced; the host copy stays (backup).
        `sidecars`: {pool name: (host slots, device slots)} evicted with them."""
        if sidecars is None:
            return self._c.evict_device(list(device_slots), list(host_slots))
        return self._c.evict_device_with_sidecars(
            list(device_slots), list(host_slots),
            {k: (list(h), list(d)) for k, (h, d) in sidecars.items()})

    # --- sidecar pools (a hybrid model's state; docs/hybrid.md) --------------------------------

    @property
    def sidecar_names(self):
        """The config's sidecar pools, in the order of their names."""
        return list(self._c.sidecar_names)

    def sidecar_alloc_device(self, name, pages):
        """Device slots of `pages` pages of pool `name` (slots_per_page each), or None."""
        return self._c.sidecar_alloc_device(name, pages)

    def sidecar_free_device(self, name, slots):
        self._c.sidecar_free_device(name, list(slots))

    def sidecar_free_host(self, name, slots):
        """Frees host pages of pool `name` (reserved or backup)."""
        self._c.sidecar_free_host(name, list(slots))

    def start_loading(self):
        """Starts the queued loads as one batch; its layer counter (release it after the
        forward pass with release_loading), or -1 when nothing was queued."""
        return self._c.start_loading()

    def wait_for_layer(self, layer):
        """Waits (without the GIL) until `layer` of the current batch is loaded; False when
        the batch failed."""
        return self._c.wait_for_layer(layer)

    def release_loading(self, counter):
        self._c.release_loading(counter)

    def wait_acks(self, kind, n, timeout_s=60.0):
        """Acks of "write" or "load" ops, [(node_id, ok)], until n arrived or the timeout."""
        return self._c.wait_acks(kind, n, timeout_s)

    @property
    def store(self):
        """The L3 store (a Store), or None without one."""
        return self._store

    # --- L3 at run time (every TP rank at the same step) ------------------------------------

    def detach_storage(self):
        """Stops L3: queued backups and prefetches end, their pages freed once; L1/L2 serve on."""
        self._c.detach_storage()
        self._store = None

    def attach_storage(self, store):
        """Attaches a store: a Store, or its config (a dict or JSON text); an error (ValueError,
        OSError) changes nothing."""
        if isinstance(store, Store):
            native = store._s
        else:
            native = _hicache.Store(_json_text(store, "attach_storage"))
        self._c.attach_storage(native)
        self._store = store if isinstance(store, Store) else Store(native)

    def clear_storage(self):
        """Empties the store and forgets which pages it held."""
        self._c.clear_storage()

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
