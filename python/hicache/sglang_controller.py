"""hicache's controller as a drop-in for SGLang's HiCacheController.

SGLang's HiRadixCache builds its controller with

    self.cache_controller = HiCacheController(token_to_kv_pool_allocator, self.token_to_kv_pool_host,
                                              page_size, self.tp_group, load_cache_event=...,
                                              write_policy=..., io_backend=..., storage_backend=...,
                                              prefetch_threshold=..., model_name=...,
                                              storage_backend_extra_config=...)

Importing this class instead (`from hicache.sglang import HiCacheController`) is the whole
change. The surface follows SGLang's managers/cache_controller.py of 2025-08-28, with the acks
of later releases (`HiCacheAck(start_event, finish_event, node_ids)` in list-like queues that
also answer `qsize()` / `get()`); docs/sglang.md lists every difference. Behind it run hicache's
C++ threads on the engine's own tensors (the device pool's per-layer `k_buffer` / `v_buffer` or
MLA `kv_buffer`, the host pool's `kv_buffer`), wrapped in place, never copied.

Ownership. The engine's device allocator stays the engine's: loads go into slots taken from it,
and slots hicache frees (evict_device) go back to it. The host pool's allocator and page states
become hicache's: the host pool object's `alloc`, `free`, `available_size`, `clear` and state
methods are rebound to hicache's host pool, so the radix cache and the controller share one
allocator with strict page states (a wrong transition raises, naming the page).
"""

import collections
import json
import os
import threading

from . import _hicache

__all__ = ["HiCacheController", "HiCacheAck", "BackupAck", "HiCacheDeviceError"]

_WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
_OWN_EXTRA_KEY = "hicache"  # extra-config object merged into the HiCache config (tp_store_dir, ...)
_DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float8_e4m3fn": "fp8",
           "float8_e5m2": "fp8", "uint8": "fp8"}


class HiCacheDeviceError(RuntimeError):
    """A copy between device and host memory failed: the bytes are not to be used."""


class _DoneEvent:
    """The events of an ack: hicache acknowledges a copy only once it has completed."""

    def query(self):
        return True

    def synchronize(self):
        pass

    def wait(self, stream=None):
        pass

    def record(self, stream=None):
        pass


_DONE = _DoneEvent()
HiCacheAck = collections.namedtuple("HiCacheAck", "start_event finish_event node_ids")
BackupAck = collections.namedtuple("BackupAck", "id completed_tokens")


class _AckQueue:
    """A list of acks (SGLang's later releases iterate, pop and slice it) that also answers as
    a queue.Queue (qsize, empty, get, get_nowait: the 2025 releases); `unwrap` maps an item to
    what get() returns. Every read first moves what the C++ side acknowledged since (`pull`),
    then raises a failure `check` finds (after the good acks are in the list). A blocking get()
    waits without the GIL through `wait(timeout)` (SGLang's write_back waits so)."""

    def __init__(self, pull, unwrap=lambda item: item, wait=None, check=lambda: None):
        self._pull = pull
        self._unwrap = unwrap
        self._wait = wait
        self._check = check
        self._items = []

    def _refresh(self):
        self._items.extend(self._pull())
        self._check()
        return self._items

    # list
    def __len__(self):
        return len(self._refresh())

    def __iter__(self):
        return iter(list(self._refresh()))

    def __getitem__(self, i):
        return self._refresh()[i]

    def __delitem__(self, i):
        del self._items[i]

    def __bool__(self):
        return len(self) > 0

    def pop(self, i=-1):
        return (self._items or self._refresh()).pop(i)  # what was counted is there already

    def append(self, item):
        self._items.append(item)

    def clear(self):
        self._items.clear()

    # queue.Queue
    def qsize(self):
        return len(self)

    def empty(self):
        return len(self) == 0

    def get(self, block=True, timeout=None):
        import queue
        import time
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._refresh():
            left = None if deadline is None else deadline - time.monotonic()
            if not block or self._wait is None or (left is not None and left <= 0):
                raise queue.Empty
            self._items.extend(self._wait(60.0 if left is None else left))
        return self._unwrap(self._items.pop(0))

    def get_nowait(self):
        return self.get(block=False)

    def put(self, item, block=True, timeout=None):
        self._items.append(item)


class LayerDoneCounter:
    """SGLang's LayerDoneCounter over hicache's: the device pool's get_key_buffer(layer) calls
    wait_until(layer), which returns once that layer of the consumer's load batch is in device
    memory (without the GIL), and raises HiCacheDeviceError when the batch failed, was dropped
    by reset() or never started. A batch holds a slot of hicache's counter until its consumer
    waited for the last layer or set another consumer, or until every slot is taken and a new
    batch starts (SGLang's ring of producer slots never blocks the scheduler); hicache hands a
    slot to a new batch only once the old one's copies are all done, and a consumer of a batch
    whose slot moved on finds its layers in place. Slots carry a generation, so a consumer never
    releases or waits for a later batch in the same slot."""

    def __init__(self, controller, num_layers, num_slots):
        self._c = controller
        self.num_layers = num_layers
        self.num_counters = num_slots
        self._lock = threading.Lock()
        self._next_gen = 1
        self._live = {}  # slot -> the generation of the batch started in it (until reset)
        self._held = collections.deque()  # (slot, gen) not released by their consumer, oldest first
        self._void = set()  # (slot, gen) dropped by reset()
        self._consumer = None  # (slot, gen)
        self.producer_index = -1

    @property
    def consumer_index(self):
        return -1 if self._consumer is None else self._consumer[0]

    def _release(self, entry):
        with self._lock:
            if entry not in self._held:
                return
            self._held.remove(entry)
        self._c._cache.release_loading(entry[0])

    def _make_room(self):
        with self._lock:
            oldest = self._held[0] if len(self._held) >= self.num_counters else None
        if oldest is not None:
            self._release(oldest)

    def _started(self, slot):
        with self._lock:
            gen, self._next_gen = self._next_gen, self._next_gen + 1
            self._live[slot] = gen
            self._held.append((slot, gen))
        self.producer_index = slot

    def _forget(self):
        with self._lock:
            self._void.update(self._live.items())  # the controller's reset voided every batch
            self._live.clear()
            self._held.clear()
        self._consumer = None
        self.producer_index = -1

    def next_producer(self):
        """SGLang 2025's ready_to_load_host_cache() calls this, then sets load_cache_event: the
        loads queued since the last batch start now, and their slot is returned (-1: none)."""
        return self._c.start_loading()

    def update_producer(self):
        return self.producer_index

    def set_consumer(self, index):
        previous = self._consumer
        with self._lock:
            self._consumer = None if index < 0 else (index, self._live.get(index, 0))
        if previous is not None and previous != self._consumer:
            self._release(previous)

    def wait_until(self, threshold):
        consumer = self._consumer
        if consumer is None:
            return
        slot, gen = consumer
        with self._lock:
            void = gen == 0 or consumer in self._void
            moved_on = self._live.get(slot) != gen  # a later batch has the slot: ours is done
        if void:
            raise HiCacheDeviceError(
                f"hicache: load batch {slot} was dropped by reset() or never started; its bytes "
                "are not in device memory")
        if not moved_on and not self._c._cache.wait_layer(slot, int(threshold)):
            raise HiCacheDeviceError(
                f"hicache: layer {threshold} of load batch {slot} failed or the controller "
                "stopped: its bytes are not in device memory")
        if threshold >= self.num_layers - 1:
            self._release(consumer)

    def reset(self):
        pass  # the producer side is hicache's own


def _as_list(indices):
    if hasattr(indices, "tolist"):
        return indices.tolist()
    return list(indices)


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


def _dtype_name(dtype):
    text = str(dtype)
    text = text[len("torch."):] if text.startswith("torch.") else text
    if text not in _DTYPES:
        raise ValueError(f"hicache: KV dtype {dtype} is not supported (valid: "
                         f"{', '.join(sorted(_DTYPES))})")
    return _DTYPES[text]


def _tp_of(tp_group):
    if tp_group is None:
        return 0, 1
    import torch.distributed as dist
    return dist.get_rank(group=tp_group), dist.get_world_size(group=tp_group)


class _Prefetch:
    """The operation prefetch() returns, with the reference's fields: `hash_value` lists the
    pages the op may still bring (all of them while the hit is unknown, the agreed hit while it
    loads, the completed prefix once terminated), so that SGLang's completion test
    `completed_tokens == len(hash_value) * page_size` holds exactly when the op is done."""

    _counter = 0

    def __init__(self, request_id, host_indices, token_ids, last_hash, native, hashes, page):
        import time
        self.request_id = request_id
        self.host_indices = host_indices
        self.token_ids = token_ids
        self.last_hash = last_hash
        self.native = native  # None when the queue refused it: done, nothing read
        self.start_time = time.monotonic()
        self.id = _Prefetch._counter
        _Prefetch._counter += 1
        self._hashes = hashes
        self._page = page
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

    def mark_done(self):
        pass  # terminate_prefetch ends it


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
        self._host_slots = _SlotTable(mem_pool_host.size, self.page_size, mem_pool_host.kv_buffer)
        self._device_slots = _SlotTable(int(device_k[0].shape[0]), self.page_size, device_k[0])
        self.storage_backend = _StorageView(self._cache) if self.enable_storage else None
        self._take_over_host_pool(mem_pool_host)
        self.layer_done_counter = LayerDoneCounter(self, self._cache.num_layers,
                                                   config.get("layer_slots", 3))
        if hasattr(self.mem_pool_device, "register_layer_transfer_counter"):
            self.mem_pool_device.register_layer_transfer_counter(self.layer_done_counter)

        self._failures = []  # failed copies not yet raised
        self._loads_queued = 0
        self._prefetches = {}  # request id -> _Prefetch, until terminated or its revoke is read
        self.ack_write_queue = _AckQueue(
            lambda: self._acks("write"), lambda ack: ack.node_ids[0],
            wait=lambda t: self._acks("write", t), check=self._raise_failures)
        self.ack_load_queue = _AckQueue(
            lambda: self._acks("load"), lambda ack: ack.node_ids[0],
            wait=lambda t: self._acks("load", t), check=self._raise_failures)
        self.ack_backup_queue = _AckQueue(self._backup_acks)
        self.prefetch_revoke_queue = _AckQueue(self._cache.drain_revokes, self._deliver_revoke)
        self.host_mem_release_queue = _AckQueue(lambda: [])  # releases are applied at once
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
        extra.pop("prefetch_threshold", None)  # SGLang passes it as prefetch_threshold too
        own = extra.pop(_OWN_EXTRA_KEY, {})
        if not isinstance(own, dict):
            raise ValueError(f"hicache: extra config '{_OWN_EXTRA_KEY}' must be an object of "
                             f"HiCache config keys, not {own!r}")
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
        changed) when the host pool or the write queue is full."""
        self._sync_compute()
        host = self._cache.write(_as_list(device_indices), int(node_id))
        return None if host is None else self._host_slots(host)

    def load(self, host_indices, priority=None, node_id=0):
        """Loads host pages (state backup) into device slots from the engine's allocator; the
        device indices, or None (nothing changed) when either is short. The copy runs at the
        next start_loading()."""
        host = _as_list(host_indices)
        device_indices = self.mem_pool_device_allocator.alloc(len(host))
        if device_indices is None:
            return None
        self._sync_compute()
        try:
            queued = self._cache.load_into(host, _as_list(device_indices), int(node_id))
        except Exception:
            self.mem_pool_device_allocator.free(device_indices)
            raise
        if not queued:
            self.mem_pool_device_allocator.free(device_indices)
            return None
        self._loads_queued += 1
        return device_indices

    def _sync_compute(self):
        """On a GPU, as SGLang's controller: the work queued so far on the compute stream
        (the forward pass that wrote the pages, the batch that last read the slots a load will
        overwrite) finishes before hicache's copy streams touch the slots."""
        if self._cuda:
            import torch
            torch.cuda.current_stream().synchronize()

    def start_loading(self):
        """Starts every load queued since the last call as one batch; its producer index (the
        consumer's set_consumer argument), or -1 when nothing was queued."""
        if self._loads_queued == 0:
            return -1
        self._loads_queued = 0
        self.layer_done_counter._make_room()
        slot = self._cache.start_loading()
        if slot >= 0:
            self.layer_done_counter._started(slot)
        return slot

    def evict_device(self, device_indices, host_indices):
        """Frees the device copy of pages whose host copy is synced (they become backup)."""
        device = _as_list(device_indices)
        n = self._cache.evict_device(device, _as_list(host_indices))
        self._return_device_slots(device, device_indices)
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

    def _return_device_slots(self, expected=None, expected_tensor=None):
        """Hands the device slots hicache freed back to the engine's allocator; when they are
        exactly `expected`, as the caller's own tensor."""
        slots = self._cache.take_returned_device_slots()
        if slots and slots == expected:
            self.mem_pool_device_allocator.free(expected_tensor)
        elif slots:
            self.mem_pool_device_allocator.free(self._device_slots(slots))

    def _acks(self, kind, timeout=None):
        """The acks of `kind` that arrived (with `timeout`: waits up to that long for one,
        without the GIL). A failed copy is recorded and raised once every good ack drained with
        it is in its queue."""
        out = []
        got = (self._cache.wait_acks(kind, 0, 0.0) if timeout is None
               else self._cache.wait_acks(kind, 1, timeout))
        for node, ok in got:
            if not ok:
                if kind == "write":
                    self.write_failures += 1
                else:
                    self.load_failures += 1
                self._failures.append(
                    f"the {'device -> host' if kind == 'write' else 'host -> device'} copy of "
                    f"node {node} failed")
            elif node != 0:  # the reference acknowledges no op of node 0
                out.append(HiCacheAck(_DONE, _DONE, [node]))
        return out

    def _raise_failures(self):
        if self._failures:
            failures, self._failures = self._failures, []
            raise HiCacheDeviceError("hicache: " + "; ".join(failures) +
                                     ": those bytes are not to be used")

    # --- L2 <-> L3 ----------------------------------------------------------------------

    def _backup_acks(self):
        return [BackupAck(op_id, completed) for op_id, completed, _total, _error
                in self._cache.drain_backup_acks()]

    def write_storage(self, host_indices, token_ids, hash_value=None):
        """Queues the backup of host pages to L3; its id (ack_backup_queue gets (id, completed
        tokens), completed being the prefix every rank stored). `hash_value`: the pages' hashes
        (SGLang's get_hash_str chain), or the hash of the page before token_ids[0], or None at
        the start of a sequence. None when the queue is full."""
        host = _as_list(host_indices)
        if isinstance(hash_value, (list, tuple)):
            prefix = self._cache.key_prefix
            keys = [f"{prefix}-{h}" for h in hash_value]
        else:
            keys, _ = self._cache.page_keys(list(token_ids), hash_value)
        pages = len(host) // self.page_size
        return self._cache.write_storage(host[:pages * self.page_size], keys[:pages])

    def prefetch(self, request_id, host_indices, new_input_tokens, last_hash=None):
        """Reads the L3 hit of new_input_tokens into host_indices (the radix cache's
        reservation, whole pages). The pages stay the op's until terminate_prefetch, which
        frees those past the agreed prefix, or until its revoke is read from
        prefetch_revoke_queue, which frees them all: host memory changes only on this thread."""
        tokens = list(new_input_tokens)
        host = _as_list(host_indices)
        native = self._cache.prefetch_into(str(request_id), tokens, last_hash, host)
        _, hashes = self._cache.page_keys(tokens, last_hash)
        op = _Prefetch(request_id, host_indices, tokens, last_hash, native, hashes,
                       self.page_size)
        self._prefetches[request_id] = op
        return op

    def terminate_prefetch(self, operation):
        """Ends a prefetch: (completed tokens, page hashes) agreed by every rank; the pages
        past them are freed. A second call returns the same."""
        if operation._terminated is None:
            if operation.native is None:  # refused by a stopped controller: nothing was read
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
        self.prefetch_tokens_occupied = 0
        self._prefetches.clear()  # their pages go with the host pool's clear()
        self._failures.clear()
        self._loads_queued = 0

    def metrics(self):
        return json.loads(self._cache.metrics_json())

    def close(self):
        self._cache.close()
