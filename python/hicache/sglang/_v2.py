"""SGLang's HiCacheStorage v2 (hybrid models): the pool types, the restorable-prefix rule and
the v2 methods HiCacheStore takes from _StorageV2.

A hybrid model's cache is a KV pool (the anchor) plus sidecar pools (Mamba / linear-attention
state, sliding-window KV, a sparse-attention indexer, ...). SGLang registers each pool with
register_mem_host_pool_v2 and then asks for a prefix's pages pool by pool (PoolTransfer).

Records. The KV pool keeps HiCacheStore's records (v1 and v2 read the same pages). A sidecar
page is ONE record, `<namespace>-<key>-s`, gathering every range the pool's
get_page_buffer_meta names for that page (in its order); the namespace is the KV namespace's
fields with the pool's dtypes, followed by `.pool-<name>.b<bytes of each range>`, so a record of
another pool, model, dtype, layout, page size or geometry is never found. Sidecar reads go
through a staging buffer in C++ (one host copy): a record the store rejects (header, key, size
or checksum) leaves the host pool untouched.

Hit rule (SGLang's current one, issue #39147): a prefix of p pages is restorable when the KV
holds pages 0..p-1 and every pool can restore p: an all_pages pool holds pages 0..p-1, a
trailing_pages pool with window N holds pages max(0, p-N)..p-1. The answer is the set of such p
(the intersection of every pool's legal endpoints within 1..KV hit), not the minimum of each
pool's largest endpoint.

Errors: the batch methods never raise (SGLang's storage threads are not restarted and every TP
rank must ack the same number of times); a transfer that fails for any reason is all False
and counted in get_stats() (v2_transfer_errors, v2_exists_errors). Registration errors raise
ValueError naming the pool.
"""

import bisect
import hashlib
import logging
import re
import threading
from dataclasses import dataclass, field
from enum import Enum

from .. import _hicache

_log = logging.getLogger("hicache.sglang")

try:  # SGLang's own classes where SGLang is installed
    from sglang.srt.mem_cache.hicache_storage import (PoolHitPolicy, PoolName, PoolTransfer,
                                                      PoolTransferResult)
except Exception:  # noqa: BLE001 - no SGLang (or one without v2): stand-ins with its names
    class PoolName(str, Enum):
        """SGLang's pool names (the values SGLang's hybrid host pool group uses)."""
        KV = "kv"
        MAMBA = "mamba"
        SWA = "swa"
        INDEXER = "indexer"
        DEEPSEEK_V4_C4 = "deepseek_v4_c4"
        DEEPSEEK_V4_C4_INDEXER = "deepseek_v4_c4_indexer"
        DEEPSEEK_V4_C4_INDEXER_SCALE = "deepseek_v4_c4_indexer_scale"
        DEEPSEEK_V4_C128 = "deepseek_v4_c128"
        DEEPSEEK_V4_C4_STATE = "deepseek_v4_c4_state"
        DEEPSEEK_V4_C4_INDEXER_STATE = "deepseek_v4_c4_indexer_state"
        DEEPSEEK_V4_C128_STATE = "deepseek_v4_c128_state"
        DRAFT = "draft"
        DRAFT_INDEXER = "draft_indexer"
        DRAFT_SWA = "draft_swa"

        def __str__(self):
            return self.value

    class PoolHitPolicy(str, Enum):
        """all_pages: the pool holds every page of the prefix; trailing_pages: its last N."""
        ALL_PAGES = "all_pages"
        TRAILING_PAGES = "trailing_pages"

    @dataclass
    class PoolTransfer:
        """One pool's pages of a v2 call (SGLang's field names)."""
        name: PoolName
        host_indices: object = None
        device_indices: object = None
        keys: list = None
        hit_policy: PoolHitPolicy = PoolHitPolicy.ALL_PAGES
        nodes_to_load: list = None
        indices_from_pool: object = None

    @dataclass
    class PoolTransferResult:
        """batch_exists_v2's answer (SGLang's field names)."""
        kv_hit_pages: int = 0
        extra_pool_hit_pages: dict = field(default_factory=dict)
        restorable_prefix_pages: list = None

_KV = "kv"
_SIDECAR_LAYOUTS = ("page_first", "page_first_direct")
_NAME = re.compile(r"[A-Za-z0-9_]+\Z")
# Pools whose host state is TP-sharded even when the KV is the same on every rank (MLA): their
# records carry the TP rank.
_TP_SHARDED = {"mamba"}


def pool_name(name):
    """A pool's name as a string (a PoolName's value, or the string itself)."""
    value = getattr(name, "value", name)
    if not isinstance(value, str) or not _NAME.match(value):
        raise ValueError(f"hicache: pool name {name!r} (want letters, digits and '_')")
    return value


class PoolResults(dict):
    """{pool name: value}, keyed by the pool's string name and answering SGLang's PoolName
    members too (a str Enum hashes by its member name, not its value)."""

    def __getitem__(self, key):
        return dict.__getitem__(self, getattr(key, "value", key))

    def __setitem__(self, key, value):
        dict.__setitem__(self, getattr(key, "value", key), value)

    def __contains__(self, key):
        return dict.__contains__(self, getattr(key, "value", key))

    def get(self, key, default=None):
        return dict.get(self, getattr(key, "value", key), default)


def legal_endpoints(present, policy, window=1):
    """The prefix lengths p in 1..len(present) that a pool holding pages {i: present[i]} can
    restore: all_pages needs pages 0..p-1, trailing_pages pages max(0, p-window)..p-1."""
    trailing = getattr(policy, "value", policy) == "trailing_pages"
    window = max(1, int(window))
    out, run = [], 0
    for i, ok in enumerate(present):
        run = run + 1 if ok else 0
        p = i + 1
        if trailing:
            if run >= min(window, p):
                out.append(p)
        elif run == p:
            out.append(p)
        else:
            break
    return out


def restorable_prefix(kv_hit, endpoint_lists):
    """The sorted prefix lengths every pool can restore: {1..kv_hit} intersected with each
    pool's legal endpoints."""
    common = set(range(1, kv_hit + 1))
    for endpoints in endpoint_lists:
        common.intersection_update(endpoints)
    return sorted(common)


def agree_restorable(lists_per_rank):
    """The prefix (pages) the TP / CP / PP ranks agree on: the largest length in every rank's
    restorable list, 0 when they share none (rank 0 [2, 4], rank 1 [2, 3] -> 2; the minimum of
    each rank's largest, 3, is a prefix rank 0 cannot restore). SGLang's controller does this
    reduction across its ranks; this is the rule it must use. ValueError for no ranks or a rank
    without a list."""
    lists = list(lists_per_rank)
    if not lists:
        raise ValueError("hicache: agree_restorable needs the lists of at least one rank")
    common = None
    for rank, pages in enumerate(lists):
        if pages is None:
            raise ValueError(f"hicache: rank {rank} has no restorable list (None)")
        common = set(pages) if common is None else common & set(pages)
    return max(common, default=0)


def _numel(indices):
    return int(indices.numel()) if hasattr(indices, "numel") else len(indices)


def _buffers(host_pool):
    """The host tensors a sidecar pool's pages lie in: get_hybrid_pool_buffer(), else
    kv_buffer (a tensor or a list of tensors); each a contiguous tensor in host memory."""
    if hasattr(host_pool, "get_hybrid_pool_buffer"):
        bufs = host_pool.get_hybrid_pool_buffer()
    else:
        bufs = getattr(host_pool, "kv_buffer", None)
    if bufs is None:
        raise ValueError("has neither get_hybrid_pool_buffer() nor a kv_buffer")
    bufs = list(bufs) if isinstance(bufs, (list, tuple)) else [bufs]
    for b in bufs:
        if not hasattr(b, "data_ptr") or not b.is_contiguous() or str(b.device) != "cpu":
            raise ValueError("has a buffer that is not a contiguous tensor in host memory")
    bufs = [b for b in bufs if b.numel() > 0]
    if not bufs:
        raise ValueError("has no host memory (empty buffers)")
    return bufs


class SidecarPool:
    """A registered sidecar host pool: its record namespace and where each page's ranges lie.

    Reads from the SGLang host pool: `layout` (page_first or page_first_direct), `page_size`,
    `get_page_buffer_meta(indices)` -> (addresses, byte sizes), the same number of ranges for
    every page in the same order, and its buffers (see _buffers), which every range must lie in.
    """

    def __init__(self, host_pool, name, namespace):
        layout = getattr(host_pool, "layout", None)
        if layout not in _SIDECAR_LAYOUTS:
            raise ValueError(f"hicache: pool '{name}': host layout {layout!r}; a sidecar pool "
                             f"moves by pointer only in {', '.join(_SIDECAR_LAYOUTS)}")
        page = getattr(host_pool, "page_size", None)
        if not isinstance(page, int) or page < 1:
            raise ValueError(f"hicache: pool '{name}': page_size {page!r} is not an int >= 1")
        if not callable(getattr(host_pool, "get_page_buffer_meta", None)):
            raise ValueError(f"hicache: pool '{name}': no get_page_buffer_meta(indices)")
        try:
            bufs = _buffers(host_pool)
        except ValueError as e:
            raise ValueError(f"hicache: pool '{name}' {e}") from None
        self.host_pool, self.name, self.layout, self.page = host_pool, name, layout, page
        self._extents = sorted((b.data_ptr(), b.data_ptr() + b.numel() * b.element_size())
                               for b in bufs)
        self._starts = [s for s, _ in self._extents]
        self._bufs = bufs  # keeps the memory alive
        import torch
        try:
            _, sizes = self._meta(torch.arange(page, dtype=torch.int64), 1, None)
        except ValueError as e:
            raise ValueError(f"hicache: pool '{name}': page 0: {e}") from None
        self.sizes = tuple(sizes)
        dtypes = []
        for b in bufs:
            text = str(b.dtype).replace("torch.", "")
            if text not in dtypes:
                dtypes.append(text)
        geometry = "+".join(str(s) for s in self.sizes)
        if len(geometry) > 48:  # many ranges: their sizes by digest, to bound the key's length
            digest = hashlib.sha256(geometry.encode()).hexdigest()[:12]
            geometry = f"{sum(self.sizes)}n{len(self.sizes)}g{digest}"
        model, fingerprint, tp_rank, tp_size, mla = namespace
        shared = mla and name not in _TP_SHARDED
        self.prefix = (_hicache.key_prefix(model, fingerprint, "+".join(dtypes), layout, page,
                                           tp_rank, tp_size, shared)
                       + f".pool-{name}.b{geometry}")
        try:  # a namespace too long for a record name fails here, not on every call
            _hicache.validate_key(f"{self.prefix}-{'0' * 64}-s")
        except ValueError as e:
            raise ValueError(f"hicache: pool '{name}': {e}") from None

    def same_geometry(self, other):
        return (self.prefix, self._extents) == (other.prefix, other._extents)

    def _meta(self, host_indices, pages, want):
        """(ranges per page, sizes of page 0) from the pool's get_page_buffer_meta, each range
        checked to lie in the pool's buffers and to have the registered size."""
        ptrs, sizes = self.host_pool.get_page_buffer_meta(host_indices)
        ptrs, sizes = list(ptrs), list(sizes)
        if len(ptrs) != len(sizes) or not ptrs or len(ptrs) % pages:
            raise ValueError(f"get_page_buffer_meta gave {len(ptrs)} addresses and "
                             f"{len(sizes)} sizes for {pages} page(s)")
        per = len(ptrs) // pages
        if want is not None and per != len(want):
            raise ValueError(f"{per} ranges per page, registered with {len(want)}")
        out = []
        for i in range(pages):
            page = []
            for j in range(per):
                p, n = int(ptrs[i * per + j]), int(sizes[i * per + j])
                if want is not None and n != want[j]:
                    raise ValueError(f"page {i} range {j}: {n} bytes, registered with {want[j]}")
                k = bisect.bisect_right(self._starts, p) - 1
                if n <= 0 or k < 0 or p + n > self._extents[k][1]:
                    raise ValueError(f"page {i} range {j} ({p:#x}, {n} bytes) is outside the "
                                     "pool's buffers")
                page.append((p, n))
            out.append(page)
        return out, [n for _, n in out[0]]

    def ranges(self, host_indices, pages):
        """One range list per page (REQUIRES: host_indices holds pages * page_size slots)."""
        return self._meta(host_indices, pages, self.sizes)[0]


class _StorageV2:
    """SGLang's v2 methods, mixed into HiCacheStore (which provides _store, _layout, _pool,
    _prefix, register_mem_pool_host and the namespace fields)."""

    def _v2_init(self):
        self._sidecars = {}
        self.registered_pools = {}  # what SGLang's default register_mem_host_pool_v2 keeps
        self._v2_lock = threading.Lock()
        self._v2_counts = {"v2_transfer_errors": 0, "v2_exists_errors": 0}

    def _v2_count(self, what, err):
        _log.warning("hicache: %s failed: %s: %s", what, type(err).__name__, err)
        with self._v2_lock:
            key = "v2_exists_errors" if what == "batch_exists_v2" else "v2_transfer_errors"
            self._v2_counts[key] += 1

    def register_mem_host_pool_v2(self, host_pool, host_pool_name):
        """Registers one pool of SGLang's hybrid host pool group (the KV anchor included).
        The KV pool is the one register_mem_pool_host registers; a sidecar pool is read as
        SidecarPool says. ValueError naming the pool: a name registered before with another
        pool geometry, an unknown layout, a pool without what SidecarPool reads."""
        name = pool_name(host_pool_name)
        if name == _KV:
            if getattr(host_pool, "kv_buffer", None) is None:
                raise ValueError("hicache: pool 'kv' has no kv_buffer (a logical anchor without "
                                 "KV memory is not supported)")
            if self._prefix is None:
                self.register_mem_pool_host(host_pool)
            elif host_pool is not self._pool:
                layout, prefix, buf = self._kv_geometry(host_pool)
                have = (self._prefix, self._layout.record_bytes, self._buf.data_ptr(),
                        self._buf.numel() * self._buf.element_size())
                now = (prefix, layout.record_bytes, buf.data_ptr(),
                       buf.numel() * buf.element_size())
                if now != have:
                    raise ValueError(f"hicache: pool 'kv' is registered already with another "
                                     f"host pool (namespace, record bytes, buffer, bytes: "
                                     f"{have}; now {now})")
        else:
            pool = SidecarPool(host_pool, name, (self.model_name, self._fingerprint,
                                                 self.tp_rank, self.tp_size, self.is_mla))
            old = self._sidecars.get(name)
            if old is not None and not old.same_geometry(pool):
                raise ValueError(f"hicache: pool '{name}' is registered already with another "
                                 f"geometry ({old.prefix} vs {pool.prefix})")
            self._sidecars[name] = pool
        self.registered_pools[name] = host_pool

    def _sidecar(self, name):
        pool = self._sidecars.get(name)
        if pool is None:
            raise KeyError(f"pool '{name}' is not registered (register_mem_host_pool_v2)")
        return pool

    # --- the hit query --------------------------------------------------------------------

    def batch_exists_v2(self, keys, pool_transfers=None, extra_info=None):
        """The restorable prefix of the page chain `keys` (SGLang's page hashes) over the KV
        and each pool of pool_transfers (its hit_policy; a trailing window of
        len(transfer.keys) pages, at least 1). kv_hit_pages is the largest restorable length
        (0 if none), restorable_prefix_pages all of them, extra_pool_hit_pages each pool's own
        largest legal endpoint within the KV hit (non-zero entries, 'kv' included). Two store
        calls: the KV's leading run, then every sidecar record of those pages. Never raises:
        an error answers nothing restorable."""
        try:
            return self._exists_v2(list(keys), list(pool_transfers or []))
        except Exception as e:  # noqa: BLE001 - the prefetch thread must survive
            self._v2_count("batch_exists_v2", e)
            return _result(0, PoolResults(), [])

    def _exists_v2(self, keys, transfers):
        self._ready()
        kv = self._store.pages_exist(self._layout, keys) if keys else 0
        hits = PoolResults()
        if kv:
            hits[_KV] = kv
        asked, names = [], []
        for t in transfers:
            name = pool_name(t.name)
            if name == _KV:
                continue
            pool = self._sidecars.get(name)
            if pool is None:  # a pool this store cannot serve: no prefix is restorable
                _log.warning("hicache: batch_exists_v2: pool '%s' is not registered", name)
                return _result(0, hits, [])
            asked.append((name, t.hit_policy, max(1, len(t.keys or []))))
            names.extend(f"{pool.prefix}-{k}-s" for k in keys[:kv])
        present = self._store.exists_each(names) if names else []
        endpoint_lists = []
        for i, (name, policy, window) in enumerate(asked):
            legal = legal_endpoints(present[i * kv:(i + 1) * kv], policy, window)
            endpoint_lists.append(legal)
            if legal:
                hits[name] = legal[-1]
        common = restorable_prefix(kv, endpoint_lists)
        return _result(common[-1] if common else 0, hits, common)

    # --- moving pages ---------------------------------------------------------------------

    def batch_get_v2(self, transfers, extra_info=None):
        """Reads each transfer's pages (transfer.keys) into its pool's host slots
        (transfer.host_indices, page i from element i * page_size). {pool name:
        [bool] * len(transfer.keys)}; False for a page that is absent or whose record was
        rejected (its slots untouched, sidecar pools), all False for a transfer that fails."""
        return self._io_v2(transfers, get=True)

    def batch_set_v2(self, transfers, extra_info=None):
        """Writes each transfer's pages from its pool's host slots; the result as
        batch_get_v2's (True: stored)."""
        return self._io_v2(transfers, get=False)

    def _io_v2(self, transfers, get):
        out = PoolResults()
        op = "batch_get_v2" if get else "batch_set_v2"
        try:
            transfers = list(transfers or [])
        except Exception as e:  # noqa: BLE001
            self._v2_count(op, e)
            return out
        batch = []  # (transfer name, count, first record index) of the sidecar transfers
        names, ranges = [], []
        for t in transfers:
            try:
                name = pool_name(t.name)
            except ValueError as e:
                self._v2_count(op, e)
                out[str(getattr(t, "name", t))] = [False] * _count(t)
                continue
            keys = list(t.keys or [])
            out[name] = [False] * len(keys)
            if not keys:
                continue
            try:
                if name == _KV:
                    self._ready()
                    _check_count(t, keys, int(self._pool.page_size), name)
                    out[name] = self._store.pages_io(self._layout, keys, t.host_indices, get)
                    continue
                pool = self._sidecar(name)
                _check_count(t, keys, pool.page, name)
                pages = pool.ranges(t.host_indices, len(keys))
                batch.append((name, len(keys), len(names)))
                names.extend(f"{pool.prefix}-{k}-s" for k in keys)
                ranges.extend(pages)
            except Exception as e:  # noqa: BLE001 - never raise from a batch call
                self._v2_count(op, e)
        if not names:
            return out
        try:
            if get:
                results = self._store.batch_get_ptrs(names, ranges, staged=True)
            else:
                results = self._store.batch_set_ptrs(names, ranges)
        except Exception as e:  # noqa: BLE001
            self._v2_count(op, e)
            return out
        for name, count, first in batch:
            out[name] = [r.ok for r in results[first:first + count]]
        return out

    def _v2_stats(self):
        with self._v2_lock:
            return dict(self._v2_counts)


def _count(t):
    try:
        return len(t.keys or [])
    except Exception:  # noqa: BLE001
        return 0


def _check_count(t, keys, page, name):
    if t.host_indices is None or _numel(t.host_indices) != len(keys) * page:
        got = None if t.host_indices is None else _numel(t.host_indices)
        raise ValueError(f"pool '{name}': {len(keys)} keys need {len(keys) * page} host "
                         f"indices, got {got}")


def _result(kv_hit, hits, restorable):
    """A PoolTransferResult; SGLang releases without restorable_prefix_pages get it as an
    attribute."""
    try:
        return PoolTransferResult(kv_hit_pages=kv_hit, extra_pool_hit_pages=hits,
                                  restorable_prefix_pages=restorable)
    except TypeError:
        result = PoolTransferResult(kv_hit_pages=kv_hit, extra_pool_hit_pages=hits)
        result.restorable_prefix_pages = restorable
        return result
