"""hicache as SGLang's L3 storage backend (SGLang's `HiCacheStorage` interface).

SGLang loads it with

    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "hicache",
        "module_path": "hicache.sglang", "class_name": "HiCacheStore", "interface_v1": 1,
        "storage": {"backend": "file", "root": "/var/cache/hicache", "capacity_bytes": 1e12}}'

and calls `HiCacheStore(storage_config, kwargs)`, then `register_mem_pool_host(host_pool)`.
See docs/sglang.md for every setting.

Records. SGLang names a page by a chained SHA-256 (hex); hicache prefixes it with a namespace
built from storage_config and the host pool (model, fingerprint, KV dtype, host layout, page
size, and the TP / PP / attention-CP slice, or "mla" where every TP rank holds the same KV), so
two ranks or two models never read each other's pages. An MHA page is two records, its K half
(`<prefix>-<key>-k`) and its V half (`-v`), each in the order of SGLang's flat data page; an MLA
page is one record (`-kv`). With the page_first layouts every record is one contiguous range of
the host pool and moves in place; with layer_first a record is gathered from (and scattered to)
one range per layer, one host copy. Every record carries hicache's header and checksum: a
corrupt, truncated or foreign record is a miss (False), never bytes handed to SGLang.

Hybrid models (SGLang's storage v2: register_mem_host_pool_v2, batch_exists_v2, batch_get_v2,
batch_set_v2) are served by the methods HiCacheStore takes from _v2._StorageV2; the KV pool
keeps these records there too.
"""

import json
import os

from .. import _hicache
from ._v2 import _StorageV2

try:  # subclass SGLang's interface when SGLang is installed; work without it
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage as _Base
except Exception:  # noqa: BLE001 - any import failure means "no SGLang here"
    _Base = object

__all__ = ["HiCacheStore"]

# Keys of the extra config that SGLang's dynamic loader and SGLang itself read (later releases
# take the radix cache's out before the backend sees the extra config, earlier ones do not).
# interface_v1 tells SGLang which methods to call; HiCacheStore serves both, so it is only
# checked to be a flag SGLang reads as meant.
_SGLANG_KEYS = {
    "backend_name", "module_path", "class_name", "interface_v1", "prefetch_threshold",
    "prefetch_timeout_base", "prefetch_timeout_per_ki_token", "hicache_storage_pass_prefix_keys",
}
# hicache's own keys of the extra config.
_OWN_KEYS = {"storage", "model_fingerprint"}
_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
_DEFAULT_ROOT = "/tmp/hicache"  # SGLang's file backend's default directory


def _field(config, name, default=None):
    if config is None:
        return default
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


def _dtype_name(dtype):
    text = str(dtype)
    return text[len("torch."):] if text.startswith("torch.") else text


class HiCacheStore(_StorageV2, _Base):
    """SGLang's HiCacheStorage over hicache's file store, Redis or Redis Cluster.

    Results follow SGLang's interface: batch_exists counts consecutive hits from the first key;
    the *_v1 methods return one bool per key; get/batch_get return the target (or a new tensor)
    or None; set/batch_set return True when every page is stored. No method raises for an I/O
    failure: a failed or missing page is False / None and is counted in get_stats().
    """

    def __init__(self, storage_config=None, kwargs=None):
        extra = _field(storage_config, "extra_config") or {}
        if isinstance(extra, str):
            extra = json.loads(extra) if extra.strip() else {}
        if not isinstance(extra, dict):
            raise ValueError(f"hicache: extra_config must be a JSON object, not {extra!r}")
        unknown = sorted(set(extra) - _SGLANG_KEYS - _OWN_KEYS)
        if unknown:
            raise ValueError(
                f"hicache: unknown extra_config key(s) {', '.join(unknown)}; hicache reads "
                f"{', '.join(sorted(_OWN_KEYS))} (the store goes in 'storage', as in the "
                "HiCache config schema)")
        storage = extra.get("storage")
        if storage is None:
            root = os.environ.get("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", _DEFAULT_ROOT)
            storage = {"backend": "file", "root": root}
        if not isinstance(storage, dict):
            raise ValueError(f"hicache: extra_config 'storage' must be an object, not {storage!r}")
        self.tp_rank = int(_field(storage_config, "tp_rank", 0) or 0)
        self.tp_size = int(_field(storage_config, "tp_size", 1) or 1)
        self.is_mla = bool(_field(storage_config, "is_mla_model", False))
        self.model_name = _field(storage_config, "model_name", None) or "model"
        fingerprint = str(extra.get("model_fingerprint", "unversioned"))
        # The newer parallel slices: each separates keys only where the slice holds other KV.
        for name, rank, size in (("pp", "pp_rank", "pp_size"),
                                 ("cp", "attn_cp_rank", "attn_cp_size")):
            r = int(_field(storage_config, rank, 0) or 0)
            n = int(_field(storage_config, size, 1) or 1)
            if n > 1:
                fingerprint += f".{name}{r}of{n}"
        self._fingerprint = fingerprint
        if self.is_mla and self.tp_size > 1 and storage.get("backend") == "file":
            # Every rank of an MLA model reads the records rank 0 writes: the file store is
            # shared (a rank opened before rank 0 writes must find them; docs/configuration.md).
            if storage.get("shared") is False:
                raise ValueError(
                    "hicache: storage 'shared': false, but an MLA model under TP "
                    f"(tp_size {self.tp_size}) shares its pages between the ranks' processes; "
                    "leave 'shared' unset")
            storage = dict(storage, shared=True)
        v1 = extra.get("interface_v1", 0)
        if isinstance(v1, str) or v1 not in (0, 1):
            raise ValueError(
                f"hicache: extra_config 'interface_v1' is {v1!r}: 1 (or true) makes SGLang call "
                "batch_get_v1 / batch_set_v1 (zero-copy), 0 (or false, or no key) batch_get / "
                "batch_set with flat pages; HiCacheStore serves both on the same records")
        self._store = _hicache.Store(json.dumps(storage))
        self._pool = None
        self._prefix = None
        self._v2_init()

    # --- the host pool --------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host):
        """Reads the host pool's buffer, layout and geometry once; every page moves by pointer."""
        layout, prefix, buf = self._kv_geometry(mem_pool_host)
        self._layout = layout
        self._record_bytes = layout.record_bytes
        self._pool = mem_pool_host
        self._buf = buf  # keeps the memory alive
        self._prefix = prefix

    def _kv_geometry(self, mem_pool_host):
        """(PageLayout, namespace prefix, kv_buffer) of a KV host pool; ValueError naming what
        is wrong with it."""
        layout = getattr(mem_pool_host, "layout", None)
        if layout not in _LAYOUTS:
            raise ValueError(f"hicache: host pool layout {layout!r}: valid are {', '.join(_LAYOUTS)}")
        buf = mem_pool_host.kv_buffer
        if not buf.is_contiguous():
            raise ValueError("hicache: the host pool's kv_buffer is not contiguous")
        if str(buf.device) != "cpu":
            raise ValueError(f"hicache: the host pool's kv_buffer is on {buf.device}, not the host")
        page = int(mem_pool_host.page_size)
        mla = self.is_mla
        shape = tuple(buf.shape)
        want_dims = {("layer_first", False): 5, ("page_first", False): 5,
                     ("page_first_direct", False): 6, ("layer_first", True): 4,
                     ("page_first", True): 4, ("page_first_direct", True): 5}[(layout, mla)]
        if len(shape) != want_dims:
            raise ValueError(f"hicache: a {'MLA' if mla else 'MHA'} {layout} kv_buffer has "
                             f"{want_dims} dimensions, this one has shape {shape}")
        es = buf.element_size()
        if layout == "layer_first":
            layers = shape[1] if not mla else shape[0]
            slots = shape[2] if not mla else shape[1]
        elif layout == "page_first":
            slots = shape[1] if not mla else shape[0]
            layers = shape[2] if not mla else shape[1]
        else:
            slots = (shape[1] if not mla else shape[0]) * page
            layers = shape[2] if not mla else shape[1]
        row = 1  # elements of one token of one layer (H * D, or 1 * D for MLA)
        for d in shape[-2:]:
            row *= d
        prefix = _hicache.key_prefix(
            self.model_name, self._fingerprint, _dtype_name(buf.dtype), layout, page,
            self.tp_rank, self.tp_size, mla)
        page_layout = _hicache.PageLayout(
            prefix=prefix, layout=layout, mla=mla, page=page, layers=layers, slots=slots,
            row_bytes=row * es, base=buf.data_ptr(), half=0 if mla else (buf.numel() // 2) * es)
        return page_layout, prefix, buf

    def _ready(self):
        if self._prefix is None:
            raise RuntimeError("hicache: register_mem_pool_host(host_pool) was not called")

    def _records(self, keys, ranges_of, items, get):
        """Moves the records of each key from / to ranges_of(item); True per key when all of
        its records moved."""
        names, ranges = [], []
        for key, item in zip(keys, items):
            names.extend(self._layout.names(key))
            ranges.extend(ranges_of(item))
        io = self._store.batch_get_ptrs if get else self._store.batch_set_ptrs
        results = io(names, ranges)
        per = self._layout.records
        return [all(r.ok for r in results[i * per:(i + 1) * per]) for i in range(len(keys))]

    # --- SGLang's zero-copy interface -----------------------------------------------------

    def batch_get_v1(self, keys, host_indices, extra_info=None):
        self._ready()
        return self._store.pages_io(self._layout, keys, host_indices, True)

    def batch_set_v1(self, keys, host_indices, extra_info=None):
        self._ready()
        return self._store.pages_io(self._layout, keys, host_indices, False)

    # --- the classic interface (flat data pages) ------------------------------------------

    def batch_exists(self, keys, extra_info=None):
        self._ready()
        return self._store.pages_exist(self._layout, keys)

    def exists(self, key):
        return self.batch_exists([key]) == 1

    def _flat_ranges(self, target):
        import torch  # noqa: F401 - a flat page is a torch tensor
        if not target.is_contiguous() or str(target.device) != "cpu":
            raise ValueError("hicache: a flat page must be a contiguous tensor in host memory")
        size = target.numel() * target.element_size()
        per = 1 if self.is_mla else 2
        if size != per * self._record_bytes:
            raise ValueError(f"hicache: a flat page of {size} bytes; this pool's pages are "
                             f"{per * self._record_bytes}")
        step = size // per
        return [[(target.data_ptr() + i * step, step)] for i in range(per)]

    def _new_flat_page(self):
        if hasattr(self._pool, "get_dummy_flat_data_page"):
            return self._pool.get_dummy_flat_data_page()
        import torch
        per = 1 if self.is_mla else 2
        return torch.empty(per * self._record_bytes // self._buf.element_size(),
                           dtype=self._buf.dtype)

    def get(self, key, target_location=None, target_sizes=None):
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        self._ready()
        keys = list(keys)
        targets = (list(target_locations) if target_locations is not None
                   else [self._new_flat_page() for _ in keys])
        if len(targets) != len(keys):
            raise ValueError(f"hicache: {len(keys)} keys but {len(targets)} target locations")
        ok = self._records(keys, self._flat_ranges, targets, get=True)
        return [t if good else None for t, good in zip(targets, ok)]

    def set(self, key, value=None, target_location=None, target_sizes=None):
        return self.batch_set([key], None if value is None else [value],
                              None if target_location is None else [target_location])

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None):
        self._ready()
        keys = list(keys)
        pages = values if values is not None else target_locations
        if pages is None:
            raise ValueError("hicache: batch_set needs values (flat data pages)")
        pages = list(pages)
        if len(pages) != len(keys):
            raise ValueError(f"hicache: {len(keys)} keys but {len(pages)} values")
        return all(self._records(keys, self._flat_ranges, pages, get=False))

    # --- the rest -------------------------------------------------------------------------

    def delete(self, key):
        self._ready()
        removed = [self._store.remove(n) for n in self._layout.names(key)]
        return any(removed)

    def clear(self):
        """Removes every record of the store (every namespace in it)."""
        self._store.clear()

    def get_stats(self):
        """The store's counters since it was opened (a dict: keys asked, hits, misses, errors,
        bad records, bytes, evictions, size), and the v2 calls' failures (v2_transfer_errors:
        transfers answered all False for an error; v2_exists_errors: batch_exists_v2 calls
        answered nothing for one)."""
        stats = json.loads(self._store.stats_json())
        stats.update(self._v2_stats())
        return stats

    def metrics_text(self):
        """The store's Prometheus text exposition (hicache_storage_*)."""
        return self._store.metrics_text()
