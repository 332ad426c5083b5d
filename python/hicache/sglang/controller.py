"""hicache's controller as a drop-in for SGLang's HiCacheController.

SGLang's HiRadixCache builds its controller with

    self.cache_controller = HiCacheController(token_to_kv_pool_allocator, self.token_to_kv_pool_host,
                                              page_size, self.tp_group, load_cache_event=...,
                                              write_policy=..., io_backend=..., storage_backend=...,
                                              prefetch_threshold=..., model_name=...,
                                              storage_backend_extra_config=...)

Importing this class instead (`from hicache.sglang import HiCacheController`) is the whole
change. The surface follows SGLang's managers/cache_controller.py of 2025-08-28 and what the
radix cache of 2025-09 and later asks of it: `get_hash_str`, write acks
(`HiCacheAck(start_event, finish_event, node_ids)`) queued by write() itself, whose
finish_event follows the copy, in list-like queues that also answer queue.Queue's `qsize()` /
`get(block, timeout)`, and prefetch operations with `is_terminated()`; docs/sglang.md lists
every difference. The extra config's "hicache" object takes the HiCache config keys the
drop-in can honour; the radix cache's keys are refused (the radix cache is SGLang's here). Behind it run hicache's
C++ threads on the engine's own tensors (the device pool's per-layer `k_buffer` / `v_buffer` or
MLA `kv_buffer`, the host pool's `kv_buffer`), wrapped in place, never copied.

Ownership. The engine's device allocator stays the engine's: loads go into slots taken from it,
and slots hicache frees (evict_device) go back to it. The host pool's allocator and page states
become hicache's: the host pool object's `alloc`, `free`, `available_size`, `clear` and state
methods are rebound to hicache's host pool, so the radix cache and the controller share one
allocator with strict page states (a wrong transition raises, naming the page).

Beside it in the subpackage: _config.py (the extra config's keys, checked), _hashes.py
(get_hash_str and the token id checks), _queues.py (the ack queues, their events and
LayerDoneCounter); this module exports their public names.
"""

import itertools
import json
import os
import time

from .. import _hicache
from ._config import (  # noqa: F401 - tests/python read the tables from this module
    _OWN_EFFECTIVE,
    _OWN_EXTRA_KEY,
    _OWN_FROM_SGLANG,
    _OWN_RADIX,
    _SGLANG_RADIX_EXTRA_KEYS,
    _WRITE_POLICIES,
    _dtype_name,
    _own_config,
    _tp_of,
)
from ._hashes import _as_list, _digest_hex, _token_ids, get_hash_str
from ._queues import (
    _DONE,
    BackupAck,
    HiCacheAck,
    HiCacheDeviceError,
    LayerDoneCounter,
    _AckQueue,
    _CopyEvent,
    _Feed,
    _ReleaseQueue,
)

__all__ = ["HiCacheController", "HiCacheAck", "BackupAck", "HiCacheDeviceError", "get_hash_str"]


def _no_priority(priority, call):
    """The drop-in runs writes in call order and starts the loads queued since the last
    start_loading() as one batch; SGLang's radix cache passes no priority."""
    if priority is not None:
        raise ValueError(f"hicache: {call}(priority={priority!r}): the drop-in controller takes no "
                         "priority (writes run in call order, loads as one batch per "
                         "start_loading()); pass None")


def _tensor(values, like=None):
    import torch
    device = like.device if like is not None and hasattr(like, "device") else "cpu"
    return torch.tensor(values, dtype=torch.int64, device=device)


class _SlotTable:
    """Slot lists of whole pages as int64 tensors, cut from one table of every slot (cheaper
    than building each from a list: a page is one row)."""

    def __init__(self, slots, page_size, like):
        import torch
        self._page = page_size
        self._rows = torch.arange(slots, dtype=torch.int64, device=like.device).view(-1, page_size)

    def __call__(self, slots):
        p = self._page
        if len(slots) == p:
            return self._rows[slots[0] // p].clone()  # a copy: the caller may change it
        return self._rows[[s // p for s in slots[::p]]].flatten()


class _Prefetch:
    """The operation prefetch() returns, with SGLang's PrefetchOperation surface: request_id,
    host_indices, token_ids, last_hash, prefix_keys, start_time, id, hash_value,
    completed_tokens, is_done / is_terminated, mark_done / mark_terminate, increment.

    `hash_value` lists the pages the op may still bring (all of them while the hit is unknown,
    the agreed hit while it loads, the completed prefix once terminated), so that SGLang's
    completion test `completed_tokens == len(hash_value) * page_size` holds exactly when the op
    is done. `is_terminated()` is true once the op can bring nothing more than it has: it was
    terminated, had nothing to fetch, or its reads stopped short of the hit (a failed page), so
    the 2025-09 radix cache's `wait_complete` and `timeout` policies end it. A revoked op is
    ended by its revoke (prefetch_revoke_queue), as in SGLang."""

    _counter = itertools.count()

    def __init__(self, controller, request_id, host_indices, token_ids, last_hash, prefix_keys,
                 native, hashes):
        self.request_id = request_id
        self.host_indices = host_indices
        self.token_ids = token_ids
        self.last_hash = last_hash
        self.prefix_keys = prefix_keys
        self.native = native  # None: nothing to fetch, or refused by a stopped controller
        self.start_time = time.monotonic()
        self.id = next(_Prefetch._counter)
        self._controller = controller
        self._hashes = hashes
        self._page = controller.page_size
        self._terminated = None  # (completed tokens, hashes) once terminated

    @property
    def hash_value(self):
        if self._terminated is not None:
            return self._terminated[1]
        if self.native is None or self.native.stage == "revoked":
            return []
        if self.native.stage == "queued":
            return self._hashes
        return self._hashes[:self.native.hit_tokens // self._page]

    @property
    def completed_tokens(self):
        if self._terminated is not None:
            return self._terminated[0]
        return self.native.completed_tokens if self.native is not None else 0

    def is_done(self):
        return self._terminated is not None or self.native is None or \
            self.native.stage in ("revoked", "finished", "terminated")

    def is_terminated(self):
        if self._terminated is not None or self.native is None:
            return True
        native = self.native
        stage = native.stage
        return stage == "terminated" or (
            stage == "finished" and native.completed_tokens < native.hit_tokens)

    def mark_terminate(self):
        """Ends the op now, as the controller's terminate_prefetch() does (the pages past the
        prefix every rank completed are freed); terminate_prefetch() then returns the same."""
        self._controller.terminate_prefetch(self)

    mark_done = mark_terminate  # SGLang 2025-08's name

    def increment(self, num_tokens):
        """SGLang's I/O thread counts its reads with this; hicache's own prefetch I/O thread
        counts them here (completed_tokens), so a count from Python would name pages that were
        never read: refused."""
        raise RuntimeError(
            f"hicache: increment({num_tokens!r}) on prefetch {self.request_id!r}: the completed "
            "tokens are counted by hicache's prefetch I/O thread as pages land in host memory")


class _StorageView:
    """What SGLang asks of the controller's storage_backend: clear() and get_stats()."""

    def __init__(self, cache):
        self._cache = cache

    def clear(self):
        self._cache.clear_storage()

    def get_stats(self):
        return json.loads(self._cache.metrics_json())


class HiCacheController:
    """SGLang's HiCacheController, run by hicache (see the module's docstring)."""

    def __init__(self, token_to_kv_pool_allocator, mem_pool_host, page_size, tp_group=None,
                 load_cache_event=None, write_policy="write_through_selective", io_backend="",
                 storage_backend=None, prefetch_threshold=256, model_name=None,
                 storage_backend_extra_config=None):
        if write_policy not in _WRITE_POLICIES:
            raise ValueError(f"Invalid write policy: {write_policy}")
        self.mem_pool_device_allocator = token_to_kv_pool_allocator
        self.mem_pool_device = token_to_kv_pool_allocator.get_kvcache()
        self.mem_pool_host = mem_pool_host
        self.page_size = int(page_size)
        self.write_policy = write_policy
        self.io_backend = io_backend
        self.load_cache_event = load_cache_event
        self._tp_group = tp_group
        self.tp_rank, self.tp_world_size = _tp_of(tp_group)
        self.enable_storage = storage_backend is not None
        self.storage_backend_type = storage_backend
        self.prefetch_threshold = max(int(prefetch_threshold), self.page_size)
        self.prefetch_tokens_occupied = 0
        self.prefetch_capacity_limit = int(0.8 * (mem_pool_host.size - self.mem_pool_device.size))

        config, device_k, device_v = self._config(storage_backend, storage_backend_extra_config,
                                                  model_name)
        self._cache = _hicache.HiCache(json.dumps(config), None, host_kv=mem_pool_host.kv_buffer,
                                       device_k=device_k, device_v=device_v,
                                       dim_order="sglang", engine_allocator=True)
        self._keep = (mem_pool_host.kv_buffer, device_k, device_v)
        self._cuda = config["device"] == "cuda"
        if self._cuda:
            import torch
            self._cuda_index = device_k[0].device.index
            if self._cuda_index is None:
                self._cuda_index = torch.cuda.current_device()
            # The current stream's handle without building a Stream object per call (the raw
            # getter torch's compiled code uses), else the public way.
            self._raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
                lambda index: torch.cuda.current_stream(index).cuda_stream)
        self._host_slots = _SlotTable(mem_pool_host.size, self.page_size, mem_pool_host.kv_buffer)
        self._device_slots = _SlotTable(int(device_k[0].shape[0]), self.page_size, device_k[0])
        self.storage_backend = _StorageView(self._cache) if self.enable_storage else None
        self._take_over_host_pool(mem_pool_host)
        self.layer_done_counter = LayerDoneCounter(self, self._cache.num_layers,
                                                   config.get("layer_slots", 3))
        if hasattr(self.mem_pool_device, "register_layer_transfer_counter"):
            self.mem_pool_device.register_layer_transfer_counter(self.layer_done_counter)

        self._failures = {}  # failed copies not yet raised: key -> message
        self._host_copy = {}  # device page -> first host slot of its copy (write / load)
        self._loads_queued = 0
        self._prefetches = {}  # request id -> _Prefetch, until terminated or its revoke is read
        # Writes are acknowledged by a token of their own (hicache's write thread acks each op
        # by it), so that each ack's finish_event follows its own copy.
        self._write_tokens = itertools.count(1)
        self._writes_in_flight = {}  # token -> _CopyEvent
        self._write_feed = _Feed(lambda n, t: self._cache.wait_acks("write", n, t),
                                 self._writes_done)
        self._load_feed = _Feed(lambda n, t: self._cache.wait_acks("load", n, t),
                                self._loads_done)
        self.ack_write_queue = _AckQueue(self._write_feed, lambda ack: ack.node_ids[0],
                                         done=lambda ack: ack.finish_event._state is True,
                                         check=self._raise_failures)
        self.ack_load_queue = _AckQueue(self._load_feed, lambda ack: ack.node_ids[0],
                                        check=self._raise_failures)
        self.ack_backup_queue = _AckQueue(_Feed(
            lambda n, t: self._cache.drain_backup_acks(n, t),
            lambda acks: self.ack_backup_queue._items.extend(
                BackupAck(op_id, completed) for op_id, completed, _total, _error in acks)))
        self.prefetch_revoke_queue = _AckQueue(_Feed(
            lambda n, t: self._cache.drain_revokes(n, t),
            lambda ids: self.prefetch_revoke_queue._items.extend(ids)), self._deliver_revoke)
        self.host_mem_release_queue = _ReleaseQueue()  # releases are applied at once
        self.write_failures = 0
        self.load_failures = 0

    # --- construction -------------------------------------------------------------------

    def _config(self, storage_backend, extra, model_name):
        dev = self.mem_pool_device
        mla = hasattr(dev, "kv_buffer") and not hasattr(dev, "k_buffer")
        if mla:
            device_k, device_v = list(dev.kv_buffer), None
            first = device_k[0]
            model = {"attention": "mla", "layers": len(device_k),
                     "kv_lora_rank": int(dev.kv_lora_rank),
                     "qk_rope_head_dim": int(dev.qk_rope_head_dim)}
        else:
            device_k, device_v = list(dev.k_buffer), list(dev.v_buffer)
            first = device_k[0]
            model = {"layers": len(device_k), "kv_heads": int(first.shape[1]),
                     "head_dim": int(first.shape[2])}
        model["dtype"] = _dtype_name(first.dtype)
        config = {
            "device": "cuda" if first.device.type == "cuda" else "host",
            "page_size": self.page_size,
            "device_tokens": int(first.shape[0]),  # SGLang's buffers count the padding page
            "host_tokens": int(self.mem_pool_host.size),
            "host_layout": self.mem_pool_host.layout,
            "write_policy": self.write_policy,
            "model": model,
            "model_name": model_name or "model",
            "prefetch_threshold_tokens": self.prefetch_threshold,
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_world_size,
            # Queues that never fill: a call refused on one TP rank only would make the ranks'
            # trees (and calls) differ; SGLang's own queues are unbounded.
            "queue_capacity": 1 << 20,
        }
        if self.io_backend in ("direct", "kernel"):
            config["io_backend"] = self.io_backend
        if isinstance(extra, str):
            extra = json.loads(extra) if extra.strip() else {}
        extra = dict(extra or {})
        own = _own_config(extra.pop(_OWN_EXTRA_KEY, {}))
        for key in _SGLANG_RADIX_EXTRA_KEYS:
            extra.pop(key, None)  # SGLang's radix cache reads these (prefetch_threshold: above)
        if storage_backend is not None:
            if storage_backend == "file" and "root" not in extra:
                extra["root"] = os.environ.get("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR",
                                               "/tmp/hicache")
            config["hicache_storage_backend"] = storage_backend
            config["hicache_storage_backend_extra_config"] = extra
        config.update(own)
        if self.tp_world_size > 1 and "tp_store_dir" in config:
            config["tp_store_dir"] = self._fresh_rendezvous(config["tp_store_dir"])
        return config, device_k, device_v

    def _fresh_rendezvous(self, base):
        """A directory of this start's own under `base`, agreed over tp_group: Gloo's file
        rendezvous refuses keys an earlier start left behind."""
        import tempfile
        import torch.distributed as dist
        mine = tempfile.mkdtemp(prefix="hicache-run-", dir=base) if self.tp_rank == 0 else None
        names = [None] * self.tp_world_size
        dist.all_gather_object(names, mine, group=self._tp_group)
        return names[0]

    def _take_over_host_pool(self, pool):
        """Rebinds the host pool's allocator and page-state methods to hicache's host pool."""
        c = self._cache
        like = pool.kv_buffer

        def alloc(need_size):
            if need_size == 0:
                return _tensor([], like)
            slots = c.host_alloc(int(need_size))
            return None if slots is None else self._host_slots(slots)

        def free(indices):
            slots = _as_list(indices)
            if slots:
                c.host_free(slots)
            return len(slots)

        def in_state(state):
            return lambda indices: c.host_all_in_state(_as_list(indices), state)

        def require(state, what):
            return lambda indices: c.host_require_state(_as_list(indices), state, what)

        pool.alloc = alloc
        pool.free = free
        pool.available_size = lambda: c.host_free_tokens
        pool.clear = c.host_reset
        pool.update_synced = lambda indices: c.host_mark_synced(_as_list(indices))
        pool.update_prefetch = require("backup", "update_prefetch")  # read in: already backup
        pool.is_synced = in_state("synced")
        pool.is_backup = in_state("backup")
        pool.is_reserved = in_state("reserved")
        pool.is_protected = in_state("protected")
        pool.get_state = lambda indices: c.host_states(_as_list(indices))

    # --- L1 <-> L2 ----------------------------------------------------------------------

    def write(self, device_indices, priority=None, node_id=0):
        """Backs up device pages to new host pages; the host indices, or None (nothing
        changed) when the host pool or the write queue is full. Its ack is in ack_write_queue
        when this returns (none for node 0, as SGLang), its finish_event done once the copy
        is; until then the host pages are protected (evicting, loading or backing them up to
        L3 raises) and the queue view (qsize, get) does not count the ack."""
        _no_priority(priority, "write")
        token = next(self._write_tokens)
        device = _as_list(device_indices)
        host = self._cache.write(device, token, self._compute_stream())
        if host is None:
            return None
        self._remember_host_copy(device, host)
        event = _CopyEvent(self, int(node_id))
        self._writes_in_flight[token] = event
        if node_id != 0:  # the reference acknowledges no op of node 0
            self.ack_write_queue.append(HiCacheAck(_DONE, event, [node_id]))
        return self._host_slots(host)

    def load(self, host_indices, priority=None, node_id=0):
        """Loads host pages (state backup) into device slots from the engine's allocator; the
        device indices, or None (nothing changed) when either is short. The copy runs at the
        next start_loading(); its ack is posted once the copy completed."""
        _no_priority(priority, "load")
        host = _as_list(host_indices)
        device_indices = self.mem_pool_device_allocator.alloc(len(host))
        if device_indices is None:
            return None
        device = _as_list(device_indices)
        try:
            queued = self._cache.load_into(host, device, int(node_id))
        except Exception:
            self.mem_pool_device_allocator.free(device_indices)
            raise
        if not queued:
            self.mem_pool_device_allocator.free(device_indices)
            return None
        self._remember_host_copy(device, host)
        self._loads_queued += 1
        return device_indices

    def _remember_host_copy(self, device, host):
        """Notes which host page holds the copy of each device page (written to it or loaded
        from it), for evict_device(device_indices) without host indices."""
        p = self.page_size
        for i in range(0, len(device), p):
            self._host_copy[device[i] // p] = host[i]

    def _compute_stream(self):
        """On a GPU, the engine's current stream (a cudaStream_t handle; 0 is the legacy default
        stream), else None. hicache records an event on it and its copy streams wait for that
        event on the device: a write copies the pages only after the work queued so far (the
        forward pass that wrote them), a load batch overwrites its slots only after the work
        that may still read them, and the host never blocks for either (SGLang's 2025-08
        controller synchronised the stream instead)."""
        return self._raw_stream(self._cuda_index) if self._cuda else None

    def start_loading(self):
        """Starts every load queued since the last call as one batch; its producer index (the
        consumer's set_consumer argument), or -1 when nothing was queued."""
        if self._loads_queued == 0:
            return -1
        self._loads_queued = 0
        self.layer_done_counter._make_room()
        slot = self._cache.start_loading(self._compute_stream())
        if slot >= 0:
            self.layer_done_counter._started(slot)
        return slot

    def evict_device(self, device_indices, host_indices=None):
        """Frees the device copy of pages whose host copy is synced (they become backup).
        Without host_indices (SGLang's later radix caches pass the device indices only) the
        host copy is the one write() made or load() read from; a device page with neither is a
        ValueError naming it."""
        device = _as_list(device_indices)
        p = self.page_size
        if host_indices is None:
            host = []
            for slot in device:
                start = self._host_copy.get(slot // p)
                if start is None:
                    raise ValueError(f"hicache: evict_device: device page {slot // p} has no "
                                     "host copy (neither written by write() nor loaded by "
                                     "load()); pass its host_indices")
                host.append(start + slot % p)
        else:
            host = _as_list(host_indices)
        n, returned = self._cache.evict_device_returning(device, host)
        for slot in device[::p]:
            self._host_copy.pop(slot // p, None)
        if returned is None:  # exactly the caller's slots: its own tensor goes back
            self.mem_pool_device_allocator.free(device_indices)
        elif returned:
            self.mem_pool_device_allocator.free(self._device_slots(returned))
        return n

    def evict_host(self, host_indices, backup_only=True):
        if not backup_only:
            raise ValueError("Other eviction policies are not supported yet.")
        return self._cache.evict_host(_as_list(host_indices))

    def append_host_mem_release(self, host_indices):
        """Frees host pages the radix cache no longer needs (at once: no thread is needed)."""
        slots = _as_list(host_indices)
        if slots:
            self._cache.host_free(slots)

    def _return_device_slots(self):
        """Hands the device slots hicache freed back to the engine's allocator."""
        slots = self._cache.take_returned_device_slots()
        if slots:
            self.mem_pool_device_allocator.free(self._device_slots(slots))

    def _writes_done(self, acks):
        """Records the write thread's acks [(token, ok)]: each ack's finish_event completes; a
        failed copy leaves the queue (its host pages were freed) and is raised once, by the
        next read of the queue or by its event."""
        for token, ok in acks:
            event = self._writes_in_flight.pop(token, None)
            if event is None:
                continue  # dropped by reset()
            if ok:
                event._state = True
                continue
            self.write_failures += 1
            event._state = f"the device -> host copy of node {event.node} failed"
            self._failures[event] = event._state
            items = self.ack_write_queue._items
            items[:] = [ack for ack in items if ack.finish_event is not event]

    def _loads_done(self, acks):
        """Records the load thread's acks [(node, ok)]: a load is acknowledged once its copy
        completed; a failed one is raised once the good acks drained with it are queued."""
        for node, ok in acks:
            if not ok:
                self.load_failures += 1
                self._failures[object()] = f"the host -> device copy of node {node} failed"
            elif node != 0:  # the reference acknowledges no op of node 0
                self.ack_load_queue.append(HiCacheAck(_DONE, _DONE, [node]))

    def _raise_failures(self):
        if self._failures:
            failures = list(self._failures.values())
            self._failures.clear()
            raise HiCacheDeviceError("hicache: " + "; ".join(failures) +
                                     ": those bytes are not to be used")

    # --- L2 <-> L3 ----------------------------------------------------------------------

    def get_hash_str(self, token_ids, prior_hash=None):
        """SGLang's page hash (module function get_hash_str): the radix cache names its pages
        with it, and they are the keys write_storage(hash_value=...) stores under and the
        last_hash prefetch() chains from."""
        return get_hash_str(token_ids, prior_hash)

    def _require_written(self, host, call):
        """Host pages a backup reads must hold their bytes: synced or backup, not reserved
        (never written) or protected (a write into them still running)."""
        states = self._cache.host_states(host)
        for page, state in enumerate(states):
            if state not in ("synced", "backup"):
                raise RuntimeError(
                    f"hicache: {call}: host page {host[page * self.page_size] // self.page_size} "
                    f"is {state}, not synced or backup: its bytes are not there yet (wait for "
                    "its write ack's finish_event)")

    def write_storage(self, host_indices, token_ids, hash_value=None, prefix_keys=None):
        """Queues the backup of host pages (whole pages, written: synced or backup) to L3; its
        id (ack_backup_queue gets BackupAck(id, completed_tokens), completed being the prefix
        every rank stored), or None when the queue is full. `hash_value`: the pages' hashes
        (SGLang's get_hash_str chain, one per page: the L3 keys), or the hash of the page
        before token_ids[0], or None at the start of a sequence. `prefix_keys` (SGLang's
        hicache_storage_pass_prefix_keys): the hashes before the first page, checked to chain
        into it; hicache's keys are chained already and need nothing more."""
        host = _as_list(host_indices)
        pages, rest = divmod(len(host), self.page_size)
        if rest or not pages:
            raise ValueError(f"hicache: write_storage of {len(host)} host slots: whole pages "
                             f"of {self.page_size} tokens, at least one")
        tokens = getattr(token_ids, "token_ids", token_ids)  # a list, or SGLang's RadixKey
        if isinstance(hash_value, (list, tuple)):
            hashes = [_digest_hex(h, "write_storage hash_value") for h in hash_value]
            if len(hashes) != pages:
                raise ValueError(f"hicache: write_storage of {pages} pages with {len(hashes)} "
                                 "hash values: one per page")
        else:
            prior = _digest_hex(hash_value, "write_storage hash_value") if hash_value else None
            _, hashes = self._cache.page_keys(_token_ids(tokens, "write_storage"), prior)
            if len(hashes) < pages:
                raise ValueError(f"hicache: write_storage of {pages} pages with "
                                 f"{len(tokens)} token ids")
            hashes = hashes[:pages]
        if prefix_keys:
            before = _digest_hex(list(prefix_keys)[-1], "write_storage prefix_keys")
            if get_hash_str(list(tokens)[:self.page_size], before) != hashes[0]:
                raise ValueError("hicache: write_storage: the first page's hash does not chain "
                                 f"from prefix_keys[-1] {before}")
        self._require_written(host, "write_storage")
        prefix = self._cache.key_prefix
        return self._cache.write_storage(host, [f"{prefix}-{h}" for h in hashes])

    def prefetch(self, request_id, host_indices, new_input_tokens, last_hash=None,
                 prefix_keys=None):
        """Reads the L3 hit of new_input_tokens into host_indices (the radix cache's
        reservation, whole pages). The pages stay the op's until terminate_prefetch, which
        frees those past the agreed prefix, or until its revoke is read from
        prefetch_revoke_queue, which frees them all: host memory changes only on this thread.
        `host_indices` None (the radix cache found no host room): nothing to fetch; the op
        is done and terminated at once with nothing, and no revoke follows. `last_hash`: the
        get_hash_str of the page before new_input_tokens (None at the start); `prefix_keys`,
        when given, must end with it."""
        tokens = _token_ids(new_input_tokens, "prefetch")
        prior = _digest_hex(last_hash, "prefetch last_hash") if last_hash else None
        if prefix_keys:
            before = _digest_hex(list(prefix_keys)[-1], "prefetch prefix_keys")
            if before != prior:
                raise ValueError(f"hicache: prefetch: prefix_keys end with {before}, last_hash "
                                 f"is {last_hash!r}")
        if host_indices is None:
            return _Prefetch(self, request_id, None, tokens, last_hash, prefix_keys, None, [])
        host = _as_list(host_indices)
        native = self._cache.prefetch_into(str(request_id), tokens, prior, host)
        _, hashes = self._cache.page_keys(tokens, prior)
        op = _Prefetch(self, request_id, host_indices, tokens, last_hash, prefix_keys, native,
                       hashes)
        if native is not None:
            self._prefetches[request_id] = op
        return op

    def terminate_prefetch(self, operation):
        """Ends a prefetch: (completed tokens, page hashes) agreed by every rank; the pages
        past them are freed. A second call returns the same."""
        if operation._terminated is None:
            if operation.native is None:  # nothing to fetch, or refused by a stopped controller
                if operation.host_indices is not None:
                    self._cache.host_free(_as_list(operation.host_indices))
                operation._terminated = (0, [])
            else:
                tokens, _slots, hashes = self._cache.terminate_prefetch(operation.native)
                operation._terminated = (tokens, hashes)
            self._prefetches.pop(operation.request_id, None)
        return operation._terminated

    def _deliver_revoke(self, request_id):
        """A revoke read from prefetch_revoke_queue: the op's pages go back now."""
        op = self._prefetches.get(request_id)
        if op is not None:
            self.terminate_prefetch(op)
        return request_id

    def prefetch_rate_limited(self):
        return self.prefetch_tokens_occupied >= self.prefetch_capacity_limit

    # --- the rest -----------------------------------------------------------------------

    def reset(self):
        """Stops and restarts the threads; queued and in-flight ops are dropped and their
        device slots go back to the engine's allocator."""
        self._cache.reset_controllers()
        self.layer_done_counter._forget()
        self._return_device_slots()
        for q in (self.ack_write_queue, self.ack_load_queue, self.ack_backup_queue,
                  self.prefetch_revoke_queue, self.host_mem_release_queue):
            q.clear()
        dropped, self._writes_in_flight = self._writes_in_flight, {}
        for event in dropped.values():
            event._state = f"the device -> host copy of node {event.node} was dropped by reset()"
        self.prefetch_tokens_occupied = 0
        self._prefetches.clear()  # their pages go with the host pool's clear()
        self._host_copy.clear()
        self._failures.clear()
        self._loads_queued = 0

    def metrics(self):
        return json.loads(self._cache.metrics_json())

    def close(self):
        self.host_mem_release_queue.close()  # ends a get() waiting on it without a timeout
        self._cache.close()
