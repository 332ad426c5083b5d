"""hicache.sglang.HiCacheController driven the way SGLang's HiRadixCache drives its controller.

The driver below replays the radix cache's calls over many requests that share prefixes, in
the shape of SGLang's radix cache of 2025-08 or of 2025-09 (see Driver): match -> prefetch from
L3 into host pages it allocated -> end it by the stop policy -> terminate -> load back host
pages -> start loading -> the forward pass waits layer by layer (the device pool's
get_key_buffer) -> compute the rest into slots from the engine's allocator -> write through
(or write several leaves back at eviction) -> drain the write acks -> back up to L3 -> drain
the backup acks and revokes -> evict device and host pages under pressure, leaves first.
The device pool is SGLang's shape (per-layer k_buffer / v_buffer with a padding page), the host
pool SGLang's kv_buffer in each layout. The "model" checks every byte it reads from a cached
page against the bytes that page was computed with (per page, layer, K/V and TP rank).

HICACHE_TEST_DEVICE=cuda puts the engine's device buffers on the GPU (torch's own CUDA tensors;
the driver's slot indices stay CPU tensors) and makes every forward pass start with long GPU
work on torch's current stream (busy()), before it writes the new pages and before the loads
start (page_first then takes the kernel I/O path, which hicache requires for it on a GPU): a write copied without waiting for that work would back up stale bytes, a layer read
before its copy landed would be stale, and the model's checks would say so. The default, cpu,
runs on the host backend."""
import hashlib
import json
import os
import pathlib
import queue
import re
import struct
import subprocess
import sys
import threading
import time

import pytest

torch = pytest.importorskip("torch", reason="python3-torch is not installed")

sys.path.insert(0, os.path.dirname(__file__))
from conftest import HostPool  # noqa: E402
from test_sglang_store import doc_table, sglang_keys  # noqa: E402

from hicache.sglang import HiCacheController  # noqa: E402
from hicache.sglang import BackupAck, HiCacheDeviceError  # noqa: E402
import hicache  # noqa: E402
from hicache._testing import throwing_store  # noqa: E402

P, L, H, D = 4, 3, 2, 8

DEVICE = os.environ.get("HICACHE_TEST_DEVICE", "cpu")
if DEVICE not in ("cpu", "cuda"):
    raise ValueError(f"HICACHE_TEST_DEVICE={DEVICE!r}: valid are cpu, cuda")
if DEVICE == "cuda" and not torch.cuda.is_available():
    raise RuntimeError("HICACHE_TEST_DEVICE=cuda, but torch sees no GPU")


def io_backend_for(layout):
    """direct, but kernel for page_first on a GPU: its direct copies are one token of one layer
    each, which hicache refuses there (SGLang's own rule)."""
    return "kernel" if DEVICE == "cuda" and layout == "page_first" else "direct"


def busy():
    """Long work on the engine's compute stream (about a millisecond on a GPU; nothing on the
    host backend), so that whatever is queued after it lands late."""
    if DEVICE == "cuda":
        torch.cuda._sleep(2_000_000)


def put(buf, slots, values):
    """The forward pass writes KV into the engine's device buffer (on its current stream)."""
    buf[slots] = values.to(buf.device)


def read(buf, slots):
    """The bytes of `slots` in the engine's device buffer, on the CPU (on a GPU: copied on the
    current stream, so after everything queued there, the layer waits included)."""
    return buf[slots].view(torch.int16).cpu()


class DevicePool:
    """SGLang's MHATokenToKVPool / MLATokenToKVPool: one tensor per layer, a padding page."""

    def __init__(self, pages, mla=False):
        self.page_size, self.layer_num, self.size = P, L, pages * P
        self.dtype, self.mla = torch.bfloat16, mla
        rows = self.size + P
        if mla:
            self.kv_lora_rank, self.qk_rope_head_dim = D - 4, 4
            self.kv_buffer = [torch.zeros((rows, 1, D), dtype=self.dtype, device=DEVICE)
                              for _ in range(L)]
        else:
            self.head_num, self.head_dim = H, D
            self.k_buffer = [torch.zeros((rows, H, D), dtype=self.dtype, device=DEVICE)
                             for _ in range(L)]
            self.v_buffer = [torch.zeros((rows, H, D), dtype=self.dtype, device=DEVICE)
                             for _ in range(L)]
        self.layer_transfer_counter = None

    def register_layer_transfer_counter(self, counter):
        self.layer_transfer_counter = counter

    def layer_buffers(self, layer):
        return [self.kv_buffer[layer]] if self.mla else [self.k_buffer[layer], self.v_buffer[layer]]

    def get_key_buffer(self, layer):  # SGLang's: waits for the layer of the batch being loaded
        if self.layer_transfer_counter is not None:
            self.layer_transfer_counter.wait_until(layer)
        return self.layer_buffers(layer)


class Allocator:
    """SGLang's paged token allocator: whole pages, page 0 reserved as padding."""

    def __init__(self, pool):
        self.pool = pool
        self.free_pages = list(range(1, pool.size // P + 1))

    def get_kvcache(self):
        return self.pool

    def available_size(self):
        return len(self.free_pages) * P

    def alloc(self, n):
        assert n % P == 0
        if n // P > len(self.free_pages):
            return None
        pages, self.free_pages = self.free_pages[:n // P], self.free_pages[n // P:]
        return torch.tensor([p * P + j for p in pages for j in range(P)], dtype=torch.int64)

    def free(self, indices):
        slots = indices.tolist()
        pages = sorted({s // P for s in slots})
        assert len(slots) == len(pages) * P and not set(pages) & set(self.free_pages), slots
        assert all(p >= 1 for p in pages), "the padding page was handed out"
        self.free_pages.extend(pages)


_patterns = {}


def pattern(page_hash, layer, which, rank, mla):
    """The KV the model computes for one page: deterministic in the page's hash and place."""
    key = (page_hash, layer, which, rank, mla)
    if key not in _patterns:
        g = torch.Generator().manual_seed(int(page_hash[:12], 16) ^ (layer * 131 + which * 7 + rank * 1009))
        shape = (P, 1, D) if mla else (P, H, D)
        _patterns[key] = torch.randint(-30000, 30000, shape, generator=g, dtype=torch.int16)
    return _patterns[key]


class Node:
    def __init__(self, nid, page_hash, tokens):
        self.id, self.hash, self.tokens = nid, page_hash, tokens
        self.device = self.host = None
        self.backed_up = self.in_l3 = self.backing_up = False
        self.lock = 0  # device copy in use (SGLang's lock_ref)
        self.host_lock = 0  # host copy being backed up (SGLang's host_ref_counter)
        self.last_use = 0


class Driver:
    """The calls SGLang's HiRadixCache makes, over per-page nodes (a page chain is a path).

    shape "2025-09" (SGLang's radix cache of September 2025 and later): page hashes from the
    controller's get_hash_str, start_loading(), write acks read as a list at once
    (finish_event.query() / synchronize()), write-back's writing_check(write_back=True) that
    reads the list once, clears it and asserts every write was acknowledged, backups with the
    node's page hashes, prefetches ended by can_terminate_prefetch (is_terminated() included)
    and the storage queues drained together (revokes, backup acks, host memory releases).
    shape "2025-08": load_cache_event with next_producer(), acks read as queues of node ids
    (write-back blocks on get()), backups chained from the prior page's hash, prefetches ended
    by the completion test, and prefetch(rid, None, ...) when the host pool has no room.
    policy: the prefetch stop policy (best_effort, wait_complete, timeout); write_policy:
    write_through, or write_back (pages reach the host only when eviction takes them)."""

    def __init__(self, layout, root, mla=False, rank=0, tp_group=None, extra=None,
                 device_pages=24, host_pages=48, storage=True, shape="2025-09",
                 policy="wait_complete", write_policy="write_through", timeout_s=(1.0, 0.25)):
        assert shape in ("2025-08", "2025-09")
        self.rank, self.tp_group, self.mla, self.shape = rank, tp_group, mla, shape
        self.policy, self.write_policy = policy, write_policy
        self.timeout_base, self.timeout_per_page = timeout_s[0], timeout_s[1] * P / 1024
        self.event = threading.Event() if shape == "2025-08" else None
        self.pool = DevicePool(device_pages, mla)
        self.alloc = Allocator(self.pool)
        self.host = HostPool(layout, mla=mla, layers=L, heads=H, head_dim=D, page_size=P,
                             pages=host_pages)
        cfg = {"storage": {"backend": "file", "root": str(root)}} if storage else {}
        self.ctrl = HiCacheController(
            self.alloc, self.host, P, tp_group, load_cache_event=self.event,
            write_policy=write_policy, io_backend=io_backend_for(layout),
            storage_backend="hicache" if storage else None, prefetch_threshold=P,
            model_name="drop-in-test",
            storage_backend_extra_config=json.dumps(cfg["storage"] | ({"hicache": extra}
                                                                      if extra else {}))
            if storage else (json.dumps({"hicache": extra}) if extra else None))
        self.nodes = {}
        self.next_id = 1
        self.clock = 0
        self.writing, self.loading, self.backups = {}, {}, {}
        self.ongoing_prefetch = {}  # request id -> op (SGLang's ongoing_prefetch)
        self.verified = {"device": 0, "loaded": 0, "prefetched": 0}
        self.revoked = self.prefetch_calls = self.no_room_prefetches = 0
        self.written_back = self.cut_short = 0
        self.most_written_back = 0  # the most leaves one eviction wrote back
        self.prefetched_pages = 0

    # --- TP: what SGLang's radix cache reduces before acting on a queue --------------------
    def agreed(self, n, op="min"):
        if self.tp_group is None:
            return n
        import torch.distributed as dist
        t = torch.tensor(n, dtype=torch.int)
        dist.all_reduce(t, op=dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.MAX,
                        group=self.tp_group)
        return int(t.item())

    def page_hashes(self, tokens, prior=None):
        if self.shape == "2025-09":  # insert(): the controller's get_hash_str, page by page
            out = []
            for i in range(0, len(tokens) - P + 1, P):
                prior = self.ctrl.get_hash_str(tokens[i:i + P], prior_hash=prior)
                out.append(prior)
            return out
        return sglang_keys(tokens, P, prior)

    # --- events --------------------------------------------------------------------------
    def written(self, nid):
        node = self.writing.pop(nid)
        node.backed_up = True
        node.lock -= 1
        self.backup(node)

    def loaded(self, nid):
        for node in self.loading.pop(nid):
            node.lock -= 1

    def writing_check(self):
        if self.shape == "2025-08":  # queues of node ids
            q = self.ctrl.ack_write_queue
            for _ in range(self.agreed(q.qsize())):
                self.written(q.get())
            return
        if not self.writing:
            return
        q = self.ctrl.ack_write_queue
        done = 0
        for _, finish_event, _ids in q:
            if not finish_event.query():
                break
            done += 1
        for _ in range(self.agreed(done)):
            _, finish_event, ids = q.pop(0)
            finish_event.synchronize()
            for nid in ids:
                self.written(nid)

    def loading_check(self):
        q = self.ctrl.ack_load_queue
        if self.shape == "2025-08":
            while not q.empty():
                self.loaded(q.get_nowait())
            return
        done = 0
        for _, finish_event, ids in q:
            if not finish_event.query():
                break
            done += 1
            for nid in ids:
                self.loaded(nid)
        del q[:done]

    def check_events(self):
        self.writing_check()
        self.loading_check()
        if not self.ctrl.enable_storage:
            return
        c = self.ctrl
        if self.shape == "2025-08":
            for _ in range(self.agreed(c.prefetch_revoke_queue.qsize())):
                self.revoke(c.prefetch_revoke_queue.get())
            for _ in range(self.agreed(c.ack_backup_queue.qsize())):
                self.backed_up(c.ack_backup_queue.get())
            return
        # drain_storage_control_queues: one reduction of the three sizes, then each queue
        sizes = [c.prefetch_revoke_queue.qsize(), c.ack_backup_queue.qsize(),
                 c.host_mem_release_queue.qsize()]
        n_revoke, n_backup, n_release = (self.agreed(n) for n in sizes)
        for _ in range(n_revoke):
            self.revoke(c.prefetch_revoke_queue.get())
        for _ in range(n_backup):
            self.backed_up(c.ack_backup_queue.get())
        released = [c.host_mem_release_queue.get() for _ in range(n_release)]
        if released:
            c.mem_pool_host.free(torch.cat(released))

    def revoke(self, rid):
        self.revoked += 1
        self.ongoing_prefetch.pop(rid, None)

    def backed_up(self, ack):
        node = self.backups.pop(ack.id)
        node.backing_up = False
        node.host_lock -= 1
        node.in_l3 = ack.completed_tokens == P

    def backup(self, node):
        if node.in_l3 or not self.ctrl.enable_storage:
            return
        if self.shape == "2025-09":  # write_backup_storage(node): the node's page hashes
            op_id = self.ctrl.write_storage(node.host, node.tokens, [node.hash])
        else:  # the hash of the page before
            op_id = self.ctrl.write_storage(node.host, node.tokens, node.prior)
        assert op_id is not None
        self.backups[op_id] = node
        node.backing_up = True
        node.host_lock += 1

    # --- eviction (LRU over unlocked leaves, as SGLang's: a parent goes after its children) ---
    def leaves(self, tier, going=()):
        """Nodes with a copy on `tier` and no child with one there (children on any tier for
        the host: a node leaves the tree with its host copy); `going`: nodes whose device copy
        this eviction takes already (SGLang's write_back_nodes)."""
        held = (lambda n: n.device is not None and n not in going) if tier == "device" else \
            (lambda n: True)
        parents = {n.prior for n in self.nodes.values() if held(n)}
        mine = held if tier == "device" else (lambda n: n.host is not None)
        return sorted((n for n in self.nodes.values() if mine(n) and n.hash not in parents),
                      key=lambda n: n.last_use)

    def evict_device(self, tokens):
        freed = 0
        write_back = []
        while freed < tokens:
            parents = {n.prior for n in self.nodes.values()}
            node = next((n for n in self.leaves("device", write_back) if n.lock == 0
                         and (n.backed_up or self.write_policy == "write_back"
                              or n.hash not in parents)), None)
            if node is None:
                break
            if node.backed_up:
                assert self.evict_device_copy(node) == P
                node.device = None
            elif self.write_policy == "write_back":  # write_backup(node, write_back=True)
                host = self.ctrl.write(node.device, node_id=node.id)
                if host is None:
                    self.evict_host(P)
                    host = self.ctrl.write(node.device, node_id=node.id)
                if host is None:
                    break
                node.host = host
                self.writing[node.id] = node
                write_back.append(node)
            else:
                self.alloc.free(node.device)  # a leaf never written to the host: gone
                del self.nodes[node.hash]
            freed += P
        if self.write_policy == "write_back":
            self.write_back_check()
            for node in write_back:
                node.backed_up = True
                assert self.evict_device_copy(node) == P
                node.device = None
            self.written_back += len(write_back)
            self.most_written_back = max(self.most_written_back, len(write_back))

    def evict_device_copy(self, node):
        """_evict_backuped: 2025-08 passes the host indices, later releases the device ones
        only."""
        if self.shape == "2025-08":
            return self.ctrl.evict_device(node.device, node.host)
        return self.ctrl.evict_device(node.device)

    def write_back_check(self):
        """writing_check(write_back=True): every write of the eviction acknowledged before the
        device copies go."""
        q = self.ctrl.ack_write_queue
        if self.shape == "2025-08":
            while self.writing:  # blocks on each ack
                del self.writing[q.get()]
            return
        for _, finish_event, ids in q:  # the list is read once
            finish_event.synchronize()
            for nid in ids:
                del self.writing[nid]
        q.clear()
        assert not self.writing, f"writes not acknowledged: {sorted(self.writing)}"

    def evict_host(self, tokens):
        freed = 0
        while freed < tokens:
            node = next((n for n in self.leaves("host")
                         if n.device is None and not n.lock and not n.host_lock), None)
            if node is None:
                break
            assert self.ctrl.evict_host(node.host) == P
            del self.nodes[node.hash]
            freed += P

    def on_device(self, n, take):
        """take() (device slots for n tokens, or None), evicting when short; pages still being
        written are locked, so when eviction finds too few it takes the write acks that arrived
        meanwhile and tries again."""
        deadline = time.monotonic() + 30
        while True:
            got = take()
            if got is None:
                self.evict_device(n)
                got = take()
            if got is not None or not (self.writing or self.loading) or \
                    time.monotonic() > deadline:
                return got
            self.check_events()
            time.sleep(0.0005)

    # --- L3 prefetch -----------------------------------------------------------------------
    def can_terminate_prefetch(self, op):
        if self.policy == "best_effort":
            return True
        if self.shape == "2025-08" or op.hash_value:
            completed = op.completed_tokens == len(op.hash_value) * P
        else:
            completed = False  # 2025-09: nothing known yet is not complete
        if self.policy == "wait_complete":
            can = completed
        else:
            limit = self.timeout_base + len(op.hash_value) * self.timeout_per_page
            can = completed or time.monotonic() - op.start_time > limit
        if self.shape == "2025-08":
            return can
        terminated = op.is_terminated()
        return self.agreed(int(not can), "max") == 0 or self.agreed(int(terminated), "max") == 1

    def prefetch(self, rid, tokens, i, hashes):
        """Prefetches tokens past the i matched pages; the nodes made of what it brought."""
        n = len(hashes)
        rest = tokens[i * P:n * P]
        last_hash = hashes[i - 1] if i else None
        host = self.ctrl.mem_pool_host.alloc(len(rest))
        if host is None:
            self.evict_host(len(rest))
            host = self.ctrl.mem_pool_host.alloc(len(rest))
        if host is None:
            if self.shape == "2025-08":  # the prefetch is issued anyway, with no host pages
                op = self.ctrl.prefetch(rid, None, rest, last_hash)
                assert op.host_indices is None and op.is_done() and op.completed_tokens == 0
                self.no_room_prefetches += 1
            return []
        self.ctrl.prefetch_tokens_occupied += len(rest)
        op = self.ctrl.prefetch(rid, host, rest, last_hash)
        self.ongoing_prefetch[rid] = op
        self.prefetch_calls += 1
        # best_effort: every other op is ended at once (whatever landed), the others once every
        # rank is done (as a request that waited in the queue meanwhile)
        patient = self.policy == "best_effort" and self.prefetch_calls % 2
        deadline = time.monotonic() + 30
        while rid in self.ongoing_prefetch and time.monotonic() < deadline:
            if patient:
                if self.agreed(int(op.is_done())) == 1:
                    break
            elif self.can_terminate_prefetch(op):
                break
            self.check_events()
            time.sleep(0.0005)
        assert time.monotonic() < deadline, "the prefetch never ended"
        self.ctrl.prefetch_tokens_occupied -= len(rest)
        if rid not in self.ongoing_prefetch:  # revoked: its pages went back with the revoke
            return []
        del self.ongoing_prefetch[rid]
        completed, hash_value = self.ctrl.terminate_prefetch(op)
        agreed = self.agreed(completed)
        assert op.is_terminated() and op.is_done()
        assert hash_value == hashes[i:i + completed // P]
        if completed < op.native.hit_tokens:  # ended before all of the hit landed
            self.cut_short += 1
        if self.shape == "2025-08":
            if agreed:
                self.ctrl.mem_pool_host.update_prefetch(host[:agreed])
        else:
            self.ctrl.append_host_mem_release(host[agreed:completed])
        fetched = []
        for j in range(agreed // P):
            node = self.new_node(hashes[i + j], tokens[(i + j) * P:(i + j + 1) * P],
                                 hashes[i + j - 1] if i + j else None)
            node.host = host[j * P:(j + 1) * P]
            node.backed_up = node.in_l3 = True
            node.lock += 1
            fetched.append(node)
        return fetched

    # --- one request -----------------------------------------------------------------------
    def serve(self, rid, tokens):
        self.clock += 1
        hashes = self.page_hashes(tokens)
        assert hashes == sglang_keys(tokens, P), "get_hash_str is SGLang's chain"
        n = len(hashes)
        i = 0
        while i < n and hashes[i] in self.nodes:
            i += 1
        matched = [self.nodes[h] for h in hashes[:i]]
        for node in matched:
            node.lock += 1
            node.last_use = self.clock
        # L3: prefetch the rest into host pages this cache allocates first.
        fetched = []
        if self.ctrl.enable_storage and i < n and not self.ctrl.prefetch_rate_limited():
            fetched = self.prefetch(rid, tokens, i, hashes)
            matched += fetched
            i += len(fetched)
        # Load back what is only on the host, as one batch.
        to_load = [node for node in matched if node.device is None]
        if to_load:
            host = torch.cat([node.host for node in to_load])
            device = self.on_device(len(host),
                                    lambda: self.ctrl.load(host, node_id=to_load[-1].id))
            assert device is not None, "the device pool cannot hold one request"
            for j, node in enumerate(to_load):
                node.device = device[j * P:(j + 1) * P]
                node.lock += 1
            self.loading[to_load[-1].id] = to_load
        if self.shape == "2025-08":  # ready_to_load_host_cache()
            producer = self.ctrl.layer_done_counter.next_producer()
            self.event.set()
        else:
            busy()  # the loads' copies start after it (they may overwrite slots it reads)
            producer = self.ctrl.start_loading()
        self.ctrl.layer_done_counter.set_consumer(producer)
        # The forward pass: read the cached pages layer by layer, write the new ones.
        new = self.on_device((n - i) * P, lambda: self.alloc.alloc((n - i) * P)) if i < n else None
        assert i == n or new is not None
        loaded = {id(node) for node in to_load}
        from_l3 = {id(node) for node in fetched}
        for layer in range(L):
            buffers = self.pool.get_key_buffer(layer)
            for node in matched:
                for which, buf in enumerate(buffers):
                    got = read(buf, node.device)
                    want = pattern(node.hash, layer, which, self.rank, self.mla)
                    assert torch.equal(got, want), (
                        f"rank {self.rank}: page {node.hash[:12]} layer {layer} buffer {which}")
            busy()  # the new pages' KV lands late: their writes below must wait for it
            for j in range(n - i):
                for which, buf in enumerate(buffers):
                    put(buf, new[j * P:(j + 1) * P], pattern(
                        hashes[i + j], layer, which, self.rank, self.mla).view(torch.bfloat16))
        for node in matched:
            kind = "prefetched" if id(node) in from_l3 else "loaded" if id(node) in loaded \
                else "device"
            self.verified[kind] += 1
            node.lock -= 1
        # Insert the new pages; write them through to the host (write_back: at eviction).
        for j in range(n - i):
            node = self.new_node(hashes[i + j], tokens[(i + j) * P:(i + j + 1) * P],
                                 hashes[i + j - 1] if i + j else None)
            node.device = new[j * P:(j + 1) * P]
            if self.write_policy == "write_back":
                continue
            host = self.ctrl.write(node.device, node_id=node.id)
            if host is None:
                self.evict_host(P)
                host = self.ctrl.write(node.device, node_id=node.id)
            if host is not None:
                node.host = host
                node.lock += 1
                self.writing[node.id] = node
        self.check_events()

    def new_node(self, page_hash, tokens, prior):
        node = Node(self.next_id, page_hash, tokens)
        node.prior = prior
        self.next_id += 1
        node.last_use = self.clock
        self.nodes[page_hash] = node
        return node

    def settle(self):
        """Drains every outstanding ack. Under TP this is scheduler steps that every rank takes
        together, as SGLang's ranks do: check_events makes collective calls, so a rank whose
        own acks are in (loads complete at each rank's pace) keeps stepping until every rank's
        are; the ranks agree on whether to step again and on giving up."""
        deadline = time.monotonic() + 60
        while self.agreed(int(bool(self.writing or self.loading or self.backups)), "max"):
            if self.agreed(int(time.monotonic() >= deadline), "max"):
                break
            self.check_events()
            time.sleep(0.001)
        assert not (self.writing or self.loading or self.backups)

    def check_no_leak(self):
        """Every device and host page is either free or held by exactly one node."""
        self.settle()
        assert not self.ongoing_prefetch
        dev = sum(1 for node in self.nodes.values() if node.device is not None)
        assert len(self.alloc.free_pages) + dev == self.pool.size // P
        host = sum(1 for node in self.nodes.values() if node.host is not None)
        assert self.ctrl.mem_pool_host.available_size() + host * P == self.host.size


    def release_all(self):
        """Drops the whole tree as the radix cache's reset-free teardown would: device copies
        evicted (or freed where never written), then host copies; every device slot is back
        in the engine's allocator and every host page free."""
        self.check_no_leak()
        for node in list(self.nodes.values()):
            if node.device is not None and node.backed_up:
                assert self.ctrl.evict_device(node.device, node.host) == P
            elif node.device is not None:
                self.alloc.free(node.device)
            node.device = None
        for node in list(self.nodes.values()):
            if node.host is not None:
                assert self.ctrl.evict_host(node.host) == P
        self.nodes.clear()
        assert len(self.alloc.free_pages) == self.pool.size // P
        assert self.ctrl.mem_pool_host.available_size() == self.host.size


def requests(count, seed, families=5):
    """Requests that share prefixes: family f's tokens, cut at random page counts."""
    import random
    rng = random.Random(seed)
    for r in range(count):
        f = rng.randrange(families)
        pages = rng.randint(2, 9)
        yield f"req-{seed}-{r}", [f * 100000 + t for t in range(pages * P)]


def run_phases(layout, root, mla=False, rank=0, tp_group=None, extra=None, count=60,
               shape="2025-09", policy="wait_complete", write_policy="write_through",
               timeout_s=(1.0, 0.25), host_pages_2=48):
    """Phase 1 computes, writes through and backs up; phase 2, a fresh engine on the same
    store (under `write_policy`, with `host_pages_2` host pages), finds the pages in L3 only and
    reads them back through prefetch (under `policy`) and load, and computes new ones beside
    them."""
    d = Driver(layout, root, mla, rank, tp_group, extra, shape=shape, policy=policy)
    for rid, tokens in requests(count, 1):
        d.serve(rid, tokens)
    d.check_no_leak()
    first = dict(d.verified)
    nodes_1 = sorted(d.nodes)
    d.release_all()
    d.ctrl.close()
    d2 = Driver(layout, root, mla, rank, tp_group, extra, shape=shape, policy=policy,
                write_policy=write_policy, timeout_s=timeout_s, host_pages=host_pages_2)
    for rid, tokens in requests(count // 2, 2, families=8):  # families 5-7 are new
        d2.serve(rid, tokens)
    d2.check_no_leak()
    second = dict(d2.verified)
    nodes_2 = sorted(d2.nodes)
    d2.release_all()
    summary = {"first": first, "second": second, "nodes_1": nodes_1, "nodes_2": nodes_2,
               "written_back": d2.written_back, "cut_short": d2.cut_short,
               "prefetch_calls": d2.prefetch_calls, "revoked": d2.revoked,
               "most_written_back": d2.most_written_back,
               "no_room_prefetches": d2.no_room_prefetches}
    d2.ctrl.close()
    return summary


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_the_radix_cache_call_sequence_serves_every_byte(tmp_path, layout, mla):
    s = run_phases(layout, tmp_path / "l3", mla)
    assert s["first"]["device"] > 20 and s["first"]["loaded"] > 10, s
    assert s["second"]["prefetched"] > 10, s


@pytest.mark.parametrize("policy", ["best_effort", "wait_complete", "timeout"])
@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
@pytest.mark.parametrize("shape", ["2025-08", "2025-09"])
def test_both_sglang_shapes_serve_every_byte_under_every_policy(tmp_path, shape, write_policy,
                                                                 policy):
    """SGLang's radix cache of 2025-08 and of 2025-09 over the drop-in, with storage: phase 1
    writes through and backs up, phase 2 (a fresh engine on the same store) prefetches under
    each stop policy and, under write_back, writes several leaves back at each eviction. Every
    byte the forward pass reads is checked; every device and host page is accounted for."""
    # timeout: half a millisecond, so that some prefetches end before their reads do (the
    # timeout branch itself: test_the_prefetch_operation_has_sglangs_surface_for_every_policy)
    s = run_phases("page_first", tmp_path / "l3", shape=shape, policy=policy,
                   write_policy=write_policy, timeout_s=(0.0005, 0.0))
    assert s["first"]["device"] > 20 and s["first"]["loaded"] > 10, s
    assert s["prefetch_calls"] > 10, s
    if policy == "wait_complete":
        assert s["second"]["prefetched"] > 10 and s["cut_short"] == 0, s
    else:  # every prefetch ended with what had landed (checked byte for byte), or nothing
        assert s["second"]["prefetched"] + s["cut_short"] > 0, s
    if write_policy == "write_back":
        assert s["written_back"] > 10 and s["most_written_back"] >= 2, s  # several leaves at once
        assert s["second"]["loaded"] > 0, s


def test_a_full_host_pool_makes_2025_08_prefetch_nothing_and_every_byte_still_checks(tmp_path):
    """SGLang 2025-08 issues prefetch(rid, None, tokens, last_hash) when the host pool has no
    room even after evicting it: with a host pool barely larger than the device pool (every
    device page has its write-through copy there), the replay's phase 2 takes that path often,
    each such op is done with nothing fetched, and the rest of the run still prefetches, loads
    and serves every byte checked, nothing leaked (the op itself:
    test_a_prefetch_without_host_pages_is_nothing_to_fetch)."""
    s = run_phases("page_first", tmp_path / "l3", shape="2025-08", policy="wait_complete",
                   host_pages_2=26)
    assert s["no_room_prefetches"] > 5, s
    assert s["second"]["prefetched"] > 10 and s["second"]["loaded"] > 0, s


def test_acks_work_as_a_list_and_as_a_queue_and_node_zero_is_not_acknowledged(tmp_path):
    d = Driver("page_first", tmp_path, storage=False)
    c = d.ctrl
    slots = d.alloc.alloc(2 * P)
    assert c.write(slots, node_id=0) is not None  # the reference acks no op of node 0
    host = c.write(d.alloc.alloc(P), node_id=7)
    deadline = time.monotonic() + 30
    while c.ack_write_queue.qsize() < 1 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert c.ack_write_queue.qsize() == 1
    assert c.ack_write_queue.get() == 7
    assert c.ack_write_queue.empty()
    assert c.mem_pool_host.is_synced(host)
    assert not c.mem_pool_host.is_backup(host)
    assert c.mem_pool_host.get_state(host) == ["synced"]
    c.close()


def test_illegal_host_transitions_raise_and_change_nothing(tmp_path):
    d = Driver("layer_first", tmp_path, storage=False)
    c = d.ctrl
    host = c.mem_pool_host.alloc(P)
    free_before = c.mem_pool_host.available_size()
    with pytest.raises(RuntimeError, match="reserved"):
        c.evict_host(host)  # reserved, not backup
    with pytest.raises(RuntimeError, match="reserved"):
        c.mem_pool_host.update_synced(host)
    with pytest.raises(ValueError):
        c.mem_pool_host.alloc(P + 1)  # not whole pages
    with pytest.raises(ValueError):
        c.evict_host(host, backup_only=False)
    assert c.mem_pool_host.available_size() == free_before
    assert c.mem_pool_host.get_state(host) == ["reserved"]
    c.mem_pool_host.free(host)
    with pytest.raises(RuntimeError, match="free"):
        c.mem_pool_host.free(host)  # twice
    assert c.mem_pool_host.available_size() == free_before + P
    # evict_device of a page whose host copy is not synced yet: refused, both copies kept.
    dev = d.alloc.alloc(P)
    host = c.mem_pool_host.alloc(P)
    with pytest.raises(RuntimeError, match="reserved"):
        c.evict_device(dev, host)
    assert len(d.alloc.free_pages) == d.pool.size // P - 1
    with pytest.raises(ValueError, match="write policy"):
        HiCacheController(d.alloc, d.host, P, None, write_policy="write_sometimes")
    c.close()


def test_a_reset_mid_run_drops_everything_and_the_cache_serves_on(tmp_path):
    """SGLang's flush: cache_controller.reset(), the host pool's clear(), the allocator's
    clear(), the tree forgotten, with writes, backups and acks in flight. Afterwards every page
    is free and the same controller serves and verifies again."""
    d = Driver("page_first", tmp_path / "l3")
    for round_ in range(3):
        for rid, tokens in requests(12, 10 + round_):
            d.serve(rid, tokens)
        d.ctrl.reset()  # acks, writes and backups in flight are dropped
        d.ctrl.mem_pool_host.clear()
        d.alloc.free_pages = list(range(1, d.pool.size // P + 1))
        d.nodes.clear()
        d.writing.clear()
        d.loading.clear()
        d.backups.clear()
        assert d.ctrl.mem_pool_host.available_size() == d.host.size
        assert len(d.ctrl.ack_write_queue) == 0 and d.ctrl.ack_backup_queue.qsize() == 0
    for rid, tokens in requests(12, 20):
        d.serve(rid, tokens)
    d.check_no_leak()
    assert d.verified["device"] > 0 and d.verified["prefetched"] > 0, d.verified
    d.ctrl.close()


def written_and_evicted(d, node_id):
    """One device page written through (its ack taken once its copy is done, as SGLang
    2025-09's writing_check) and evicted: (device, host) slots."""
    c = d.ctrl
    dev = d.alloc.alloc(P)
    host = c.write(dev, node_id=node_id)
    ack = c.ack_write_queue.pop(0)
    assert ack.node_ids == [node_id]
    ack.finish_event.synchronize()
    assert c.evict_device(dev, host) == P
    return dev, host


def test_evict_device_finds_the_host_copy_when_given_device_indices_only(tmp_path):
    """SGLang's later radix caches call evict_device(node.value): the host copy is the one
    write() made, or the one load() read from; a device page with neither is refused, naming
    it, and nothing changes."""
    d = Driver("page_first", tmp_path, storage=False)
    c = d.ctrl
    dev = d.alloc.alloc(2 * P)
    host = c.write(dev, node_id=1)
    c.ack_write_queue.pop(0).finish_event.synchronize()
    assert c.evict_device(dev) == 2 * P
    assert c.mem_pool_host.get_state(host) == ["backup", "backup"]
    assert len(d.alloc.free_pages) == d.pool.size // P
    dev2 = c.load(host[P:], node_id=2)
    c.layer_done_counter.set_consumer(c.start_loading())
    d.pool.get_key_buffer(L - 1)
    assert c.ack_load_queue.get(timeout=30) == 2
    stranger = d.alloc.alloc(P)
    with pytest.raises(ValueError, match=f"device page {stranger[0].item() // P} has no host"):
        c.evict_device(stranger)
    with pytest.raises(ValueError, match="has no host"):
        c.evict_device(dev)  # evicted already: its copy is forgotten
    assert c.evict_device(dev2) == P
    assert c.mem_pool_host.get_state(host) == ["backup", "backup"]
    d.alloc.free(stranger)
    assert c.evict_host(host) == 2 * P
    assert len(d.alloc.free_pages) == d.pool.size // P
    assert c.mem_pool_host.available_size() == d.host.size
    c.close()


def test_a_device_page_recomputed_after_eviction_is_synced_again(tmp_path):
    """SGLang's update_synced: an evicted node gets a fresh device value; its host copy
    shadows it again and the node can be evicted to the host once more."""
    d = Driver("page_first", tmp_path, storage=False)
    c = d.ctrl
    dev, host = written_and_evicted(d, 3)
    assert d.alloc.free_pages.count(dev[0].item() // P) == 1, "the slots went back to SGLang"
    assert c.mem_pool_host.is_backup(host)
    dev2 = d.alloc.alloc(P)
    c.mem_pool_host.update_synced(host)
    assert c.evict_device(dev2, host) == P
    assert c.evict_host(host) == P
    assert c.mem_pool_host.available_size() == d.host.size
    c.close()


def test_a_store_that_throws_leaves_the_threads_alive(tmp_path):
    """Backups against a store that throws are acked with 0 tokens, prefetches revoked; the
    same controller then backs up and prefetches once the store answers again."""
    d = Driver("page_first", tmp_path / "l3")
    c = d.ctrl
    good = hicache.open_store({"backend": "file", "root": str(tmp_path / "l3")})
    bad, set_throwing = throwing_store(good._s)
    c._cache.detach_storage()
    c._cache.attach_storage(bad)
    for rid, tokens in requests(8, 3):
        d.serve(rid, tokens)
    d.settle()
    assert not any(node.in_l3 for node in d.nodes.values()), "nothing was stored"
    assert d.prefetch_calls > 0 and d.revoked == d.prefetch_calls, \
        "every prefetch was revoked (its hit query throws: no hit)"
    set_throwing(False)
    for node in d.nodes.values():
        if node.host is not None and not node.backing_up:
            d.backup(node)
    d.settle()
    stored = [node for node in d.nodes.values() if node.in_l3]
    assert stored, "backups work again on the same threads"
    d.check_no_leak()
    c.close()


def test_a_failed_layer_raises_instead_of_serving_the_bytes(tmp_path):
    d = Driver("page_first", tmp_path, storage=False)
    c = d.ctrl
    _, host = written_and_evicted(d, 5)
    assert c.load(host, node_id=6) is not None
    producer = c.start_loading()
    c.reset()  # the batch is dropped: its layers will never land
    c.layer_done_counter.set_consumer(producer)
    with pytest.raises(HiCacheDeviceError):
        d.pool.get_key_buffer(0)
    c.close()


class Withheld:
    """The controller's C++ side with the write thread's acks held back until release(): a
    copy that has not completed yet, as the queue and its events see it, without racing the
    real write thread. `fail` names nodes whose copy is reported failed."""

    def __init__(self, ctrl, fail=()):
        self.native, self.ctrl, self.fail = ctrl._cache, ctrl, set(fail)
        self.held, self.released = [], threading.Event()

    def wait_acks(self, kind, n, timeout):
        if kind != "write":
            return self.native.wait_acks(kind, n, timeout)
        if not self.released.is_set():
            self.held += self.native.wait_acks(kind, 0, 0.0)
            if n:
                self.released.wait(timeout)  # as the C++ wait: sleeps without holding the GIL
            if not self.released.is_set():
                return []
        out = self.held + self.native.wait_acks(kind, 0 if self.held else n, timeout)
        self.held = []
        nodes = {t: e.node for t, e in self.ctrl._writes_in_flight.items()}
        return [(t, ok and nodes.get(t) not in self.fail) for t, ok in out]

    def __getattr__(self, name):
        return getattr(self.native, name)


def written(c, device, host):
    """The host copy holds the device pages' bytes (every layer, K and V)."""
    pool = c.mem_pool_device
    for layer in range(L):
        for which, buf in enumerate(pool.layer_buffers(layer)):
            got = c.mem_pool_host.kv_buffer[which, host] if not pool.mla else None
            if got is None or not torch.equal(read(buf, device),
                                              got[:, layer].view(torch.int16)):
                return False
    return True


def test_a_write_ack_is_queued_at_write_and_its_finish_event_follows_the_copy(tmp_path):
    """SGLang 2025-09 reads ack_write_queue as a list right after write(): the ack is there,
    and its finish_event says whether the copy is done (query), waits for it without the GIL
    (synchronize, wait), and only then counts in the queue view (qsize, get)."""
    d = Driver("page_first", tmp_path, storage=False)
    c = d.ctrl
    dev = d.alloc.alloc(P)
    for layer in range(L):
        for which, buf in enumerate(d.pool.layer_buffers(layer)):
            put(buf, dev, pattern("ab" * 32, layer, which, 0, False).view(torch.bfloat16))
    held = Withheld(c)
    c._cache = held
    host = c.write(dev, node_id=7)
    assert len(c.ack_write_queue) == 1
    start_event, finish_event, ids = c.ack_write_queue[0]
    assert ids == [7] and start_event.query()
    assert not finish_event.query() and c.ack_write_queue.qsize() == 0
    assert c.ack_write_queue.empty()
    with pytest.raises(queue.Empty):
        c.ack_write_queue.get(block=False)
    with pytest.raises(queue.Empty):
        c.ack_write_queue.get_nowait()
    t0 = time.monotonic()
    with pytest.raises(queue.Empty):
        c.ack_write_queue.get(timeout=0.05)
    assert time.monotonic() - t0 >= 0.05
    waiter_done = threading.Event()
    waiter = threading.Thread(target=lambda: (finish_event.synchronize(), waiter_done.set()))
    waiter.start()
    assert not waiter_done.wait(0.05), "synchronize() returned before the copy was reported"
    held.released.set()  # this thread runs while the waiter waits: the GIL is free
    waiter.join(30)
    assert waiter_done.is_set() and finish_event.query()
    assert written(c, dev, host), "once the event is done the host holds the bytes"
    assert c.ack_write_queue.qsize() == 1 and c.ack_write_queue.get() == 7
    assert len(c.ack_write_queue) == 0
    c._cache = held.native
    c.close()


def test_write_back_of_several_leaves_passes_the_2025_09_check(tmp_path):
    """Eviction under write_back writes several leaves, then writing_check(write_back=True)
    reads ack_write_queue once, synchronizes each finish_event, clears the list and asserts that
    every write was acknowledged; the device copies then go (their host copies are synced)."""
    d = Driver("page_first", tmp_path, storage=False, write_policy="write_back")
    c = d.ctrl
    for round_ in range(20):
        leaves = {}
        for node in range(1, 6):
            dev = d.alloc.alloc(P)
            host = c.write(dev, node_id=100 * round_ + node)
            assert host is not None
            leaves[100 * round_ + node] = (dev, host)
        ongoing = set(leaves)
        for _, finish_event, ids in c.ack_write_queue:
            finish_event.synchronize()
            ongoing -= set(ids)
        c.ack_write_queue.clear()
        assert not ongoing, f"round {round_}: writes not acknowledged: {sorted(ongoing)}"
        for dev, host in leaves.values():
            assert c.evict_device(dev, host) == P
            assert c.evict_host(host) == P
    assert len(d.alloc.free_pages) == d.pool.size // P
    assert c.mem_pool_host.available_size() == d.host.size
    c.close()


def test_a_failed_copy_raises_after_the_good_acks_drained_with_it_are_queued(tmp_path):
    """hicache's write thread reports (token, ok); one not ok among good ones: the good acks
    stay in the queue (their nodes are not lost), the failed one leaves it, and reading the
    queue raises once, naming the node; the failed ack's own event raises too."""
    d = Driver("page_first", tmp_path, storage=False)
    c = d.ctrl
    held = Withheld(c, fail={12})
    c._cache = held
    for node in (11, 12, 13):
        assert c.write(d.alloc.alloc(P), node_id=node) is not None
    failed_event = c.ack_write_queue[1].finish_event
    held.released.set()
    for event in [ack.finish_event for ack in c.ack_write_queue._items]:
        if event is not failed_event:
            event.synchronize()
    with pytest.raises(HiCacheDeviceError, match="node 12"):
        len(c.ack_write_queue)
    assert [ack.node_ids for ack in c.ack_write_queue] == [[11], [13]], "no good ack lost"
    assert c.write_failures == 1
    with pytest.raises(HiCacheDeviceError, match="node 12"):
        failed_event.synchronize()
    assert [c.ack_write_queue.get(), c.ack_write_queue.get()] == [11, 13]
    c._cache = held.native
    c.close()


def test_writes_dropped_by_reset_raise_from_their_events(tmp_path):
    d = Driver("page_first", tmp_path, storage=False)
    c = d.ctrl
    held = Withheld(c)
    c._cache = held
    c.write(d.alloc.alloc(P), node_id=5)
    event = c.ack_write_queue[0].finish_event
    c._cache = held.native
    c.reset()
    assert len(c.ack_write_queue) == 0
    with pytest.raises(HiCacheDeviceError, match="dropped by reset"):
        event.query()
    c.close()


def test_a_blocking_get_waits_for_the_ack_as_write_back_does(tmp_path):
    """SGLang 2025-08's write_back evicts by writing and then blocking on
    ack_write_queue.get()."""
    d = Driver("page_first", tmp_path, storage=False)
    c = d.ctrl
    for node in (21, 22):
        assert c.write(d.alloc.alloc(P), node_id=node) is not None
    assert [c.ack_write_queue.get(), c.ack_write_queue.get()] == [21, 22]
    with pytest.raises(queue.Empty):
        c.ack_write_queue.get(timeout=0.05)
    c.close()


def get_in_thread(q, timeout):
    """q.get(timeout=...) on another thread: (the item or the exception, thread)."""
    out = []
    thread = threading.Thread(target=lambda: out.append(_call(q.get, timeout=timeout)))
    thread.start()
    return out, thread


def _call(fn, **kw):
    try:
        return fn(**kw)
    except Exception as e:  # noqa: BLE001 - the test looks at it
        return e


def expect_empty(q):
    """queue.Queue's get on an empty queue: block=False and get_nowait raise queue.Empty at
    once, get(timeout=t) after waiting t, asleep (a wait that spun would use the CPU time it
    waited)."""
    with pytest.raises(queue.Empty):
        q.get(block=False)
    with pytest.raises(queue.Empty):
        q.get_nowait()
    t0, cpu0 = time.monotonic(), time.process_time()
    with pytest.raises(queue.Empty):
        q.get(timeout=0.2)
    assert time.monotonic() - t0 >= 0.2
    assert time.process_time() - cpu0 < 0.1, "the wait polled"
    with pytest.raises(ValueError):
        q.get(timeout=-1)


def expect_queue_semantics(q, produce, expect):
    """expect_empty(q); then a get(timeout=30) waiting on another thread (without the GIL:
    this thread produces meanwhile) returns what arrives."""
    expect_empty(q)
    out, thread = get_in_thread(q, 30)
    produce()
    thread.join(60)
    assert not thread.is_alive() and out == [expect() if callable(expect) else expect], out


def test_without_a_store_the_storage_queues_wait_asleep(tmp_path):
    d = Driver("page_first", tmp_path, storage=False)
    for q in (d.ctrl.ack_backup_queue, d.ctrl.prefetch_revoke_queue):
        expect_empty(q)
    d.ctrl.close()


def test_every_queue_gets_as_queue_queue_does(tmp_path):
    """ack_write_queue, ack_load_queue, ack_backup_queue and prefetch_revoke_queue, each waited
    on the way queue.Queue allows, with its item produced while a get waits on another thread;
    host_mem_release_queue never holds anything (the drop-in frees at once): its get() waits
    for its timeout, or without one until the controller closes."""
    d = Driver("page_first", tmp_path / "l3")
    c = d.ctrl
    dev = d.alloc.alloc(P)
    tokens = list(range(1000, 1000 + P))
    page_hash = c.get_hash_str(tokens)
    box = {}
    expect_queue_semantics(c.ack_write_queue,
                           lambda: box.update(host=c.write(dev, node_id=31)), 31)
    assert c.evict_device(dev, box["host"]) == P  # the copy is done: the host copy is synced

    def load():
        box["dev"] = c.load(box["host"], node_id=32)
        c.layer_done_counter.set_consumer(c.start_loading())
    expect_queue_semantics(c.ack_load_queue, load, 32)
    expect_queue_semantics(c.ack_backup_queue,
                           lambda: box.update(id=c.write_storage(box["host"], tokens, [page_hash])),
                           lambda: BackupAck(box["id"], P))
    missing = [7] * (2 * P)  # never stored: revoked
    expect_queue_semantics(c.prefetch_revoke_queue,
                           lambda: box.update(op=c.prefetch("gone", c.mem_pool_host.alloc(2 * P),
                                                            missing)), "gone")
    assert c.terminate_prefetch(box["op"]) == (0, [])
    q = c.host_mem_release_queue
    assert q.qsize() == 0 and q.empty()
    expect_empty(q)
    # Blocking without a timeout: waits, as queue.Queue's get() does, until close() ends it.
    ended = []

    def wait_for_ever():
        try:
            q.get()
        except queue.Empty as e:
            ended.append(str(e))
    waiter = threading.Thread(target=wait_for_ever)
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive() and not ended
    c.layer_done_counter.set_consumer(-1)
    c.close()
    waiter.join(10)
    assert not waiter.is_alive() and "closed" in ended[0], ended


def test_prefetch_pages_change_hands_only_on_the_callers_thread(tmp_path):
    """TP ranks must find the same host room at the same call: a prefetch's pages stay
    reserved until terminate (past the prefix freed) or until its revoke is read (all freed),
    however far the prefetch thread got."""
    d = Driver("page_first", tmp_path / "l3")
    for rid, tokens in requests(6, 4):
        d.serve(rid, tokens)
    d.check_no_leak()
    d.ctrl.close()
    d = Driver("page_first", tmp_path / "l3")
    c, pool = d.ctrl, d.ctrl.mem_pool_host
    stored = next(tokens for _, tokens in requests(6, 4))
    missing = [7] * (4 * P)  # never stored: below the one-page threshold, revoked
    free = pool.available_size()
    hit = c.prefetch("hit", pool.alloc(len(stored) + 2 * P), stored + [5] * (2 * P))
    miss = c.prefetch("miss", pool.alloc(len(missing)), missing)
    deadline = time.monotonic() + 30
    while not (hit.is_done() and miss.is_done()) and time.monotonic() < deadline:
        time.sleep(0.001)
    assert hit.completed_tokens == len(hit.hash_value) * P == len(stored)
    assert time.monotonic() - hit.start_time < 30
    assert pool.available_size() == free - len(stored) - 2 * P - len(missing), \
        "the prefetch thread freed pages"
    assert c.prefetch_revoke_queue.qsize() == 1
    assert c.prefetch_revoke_queue.get() == "miss"
    assert pool.available_size() == free - len(stored) - 2 * P, "the revoke read frees them all"
    assert c.terminate_prefetch(hit)[0] == len(stored)
    assert pool.available_size() == free - len(stored), "terminate frees past the prefix"
    assert c.terminate_prefetch(hit)[0] == len(stored), "a second terminate returns the same"
    pool.free(hit.host_indices[:len(stored)])
    assert pool.available_size() == free
    c.close()


def sha_chain(pages, prior=None):
    """SGLang's chain computed here independently: sha256(prior digest || u32le tokens)."""
    out = []
    for page in pages:
        h = hashlib.sha256()
        if prior:
            h.update(bytes.fromhex(prior))
        for t in page:
            for one in (t if isinstance(t, tuple) else (t,)):
                h.update(struct.pack("<I", one))
        prior = h.hexdigest()
        out.append(prior)
    return out


def test_get_hash_str_is_sglangs_chain(tmp_path):
    d = Driver("page_first", tmp_path, storage=False)
    c = d.ctrl
    pages = [[0, 1, 2, 3], [2**32 - 1, 7, 65536, 5], [9, 9, 9, 9]]
    chain = sha_chain(pages)
    got, prior = [], None
    for page in pages:
        prior = c.get_hash_str(page, prior_hash=prior)
        got.append(prior)
    assert got == chain
    assert c.get_hash_str(pages[0], "") == chain[0], "an empty prior is no prior, as SGLang's"
    assert c.get_hash_str(pages[1], chain[0].upper()) == chain[1]
    bigram = [(1, 2), (3, 4)]
    assert c.get_hash_str(bigram) == sha_chain([bigram])[0] == c.get_hash_str([1, 2, 3, 4])
    for bad in (-1, 2**32, "5", 1.5):
        with pytest.raises(ValueError, match=re.escape(repr(bad))):
            c.get_hash_str([0, bad, 2, 3])
    for prior in ("ab", "zz" * 32, 5):
        with pytest.raises(ValueError, match="prior_hash"):
            c.get_hash_str(pages[0], prior)
    c.close()


def test_the_l3_keys_and_the_prefetch_chain_are_get_hash_strs(tmp_path):
    """A page SGLang's radix cache backs up under its get_hash_str is found by a prefetch
    chained from the hash before it: pages 0-1 backed up with their hashes (2025-09), pages
    2-3 with the hash before them (2025-08); a fresh engine prefetches pages 1-3 after
    last_hash = hash(page 0), and all four from no last_hash, and reads the bytes."""
    tokens = list(range(500, 500 + 4 * P))
    d = Driver("page_first", tmp_path / "l3")
    c = d.ctrl
    hashes = []
    for i in range(4):
        hashes.append(c.get_hash_str(tokens[i * P:(i + 1) * P], hashes[-1] if hashes else None))
    dev = d.alloc.alloc(4 * P)
    for layer in range(L):
        for which, buf in enumerate(d.pool.layer_buffers(layer)):
            for i in range(4):
                put(buf, dev[i * P:(i + 1) * P],
                    pattern(hashes[i], layer, which, 0, False).view(torch.bfloat16))
    host = c.write(dev, node_id=1)
    c.ack_write_queue[0].finish_event.synchronize()
    with pytest.raises(ValueError, match="one per page"):
        c.write_storage(host[:2 * P], tokens[:2 * P], hashes[:1])
    with pytest.raises(ValueError, match="page hash"):
        c.write_storage(host[:2 * P], tokens[:2 * P], [hashes[0], "x" * 64])
    with pytest.raises(ValueError, match="chain"):
        c.write_storage(host[:2 * P], tokens[:2 * P], hashes[:2], prefix_keys=[hashes[3]])
    ids = [c.write_storage(host[:2 * P], tokens[:2 * P], hashes[:2], prefix_keys=[]),
           c.write_storage(host[2 * P:], tokens[2 * P:], hashes[1], prefix_keys=hashes[:2])]
    acks = [c.ack_backup_queue.get(timeout=30) for _ in ids]
    assert sorted(acks) == sorted(BackupAck(i, 2 * P) for i in ids)
    c.close()
    d2 = Driver("page_first", tmp_path / "l3")
    c2 = d2.ctrl
    for rid, last, want in (("after-0", hashes[0], hashes[1:]), ("all", None, hashes)):
        rest = tokens[(4 - len(want)) * P:]
        slots = c2.mem_pool_host.alloc(len(rest))
        op = c2.prefetch(rid, slots, rest, last)
        deadline = time.monotonic() + 30
        while not op.is_done() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert c2.terminate_prefetch(op) == (len(rest), want)
        for i, h in enumerate(want):
            for layer in range(L):
                for which in range(2):
                    got = c2.mem_pool_host.kv_buffer[which, slots[i * P:(i + 1) * P], layer]
                    assert torch.equal(got.view(torch.int16), pattern(h, layer, which, 0, False))
        c2.mem_pool_host.free(slots)
    with pytest.raises(ValueError, match="prefix_keys"):
        c2.prefetch("x", c2.mem_pool_host.alloc(P), tokens[P:2 * P], hashes[0],
                    prefix_keys=[hashes[1]])
    c2.close()


def test_write_storage_refuses_host_pages_whose_bytes_are_not_there(tmp_path):
    """A backup reads host pages: one still reserved (never written) or protected (its write
    still running) is refused, naming the page and its state; nothing is queued."""
    d = Driver("page_first", tmp_path / "l3")
    c = d.ctrl
    host = c.mem_pool_host.alloc(P)
    with pytest.raises(RuntimeError, match="reserved"):
        c.write_storage(host, list(range(P)), None)
    assert c.ack_backup_queue.qsize() == 0
    with pytest.raises(ValueError, match="whole pages"):
        c.write_storage(host[:P - 1], list(range(P)), None)
    c.mem_pool_host.free(host)
    c.close()


def wait_done(op):
    deadline = time.monotonic() + 30
    while not op.is_done() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert op.is_done()


def can_terminate_prefetch(op, policy, timeout_s=(1.0, 0.25)):
    """SGLang 2025-09's HiRadixCache.can_terminate_prefetch on one rank."""
    if policy == "best_effort":
        return True
    completed = bool(op.hash_value) and op.completed_tokens == len(op.hash_value) * P
    if policy == "wait_complete":
        can = completed
    else:
        limit = timeout_s[0] + len(op.hash_value) * timeout_s[1] * P / 1024
        can = completed or time.monotonic() - op.start_time > limit
    return can or op.is_terminated()


def store_pages(root, tokens):
    """Backs tokens up to L3 (whole pages) through a drop-in of its own; their hashes."""
    d = Driver("page_first", root)
    c = d.ctrl
    hashes = sglang_keys(tokens, P)
    dev = d.alloc.alloc(len(tokens))
    host = c.write(dev, node_id=1)
    c.ack_write_queue[0].finish_event.synchronize()
    op = c.write_storage(host, tokens, hashes)
    assert c.ack_backup_queue.get(timeout=30) == BackupAck(op, len(tokens))
    c.close()
    return hashes


def test_the_prefetch_operation_has_sglangs_surface_for_every_policy(tmp_path):
    tokens = list(range(2000, 2000 + 4 * P))
    hashes = store_pages(tmp_path / "l3", tokens)
    d = Driver("page_first", tmp_path / "l3")
    c = d.ctrl
    pool = c.mem_pool_host
    free = pool.available_size()
    host = pool.alloc(len(tokens))
    op = c.prefetch("r1", host, tokens, None, prefix_keys=None)
    assert (op.request_id, op.token_ids, op.last_hash, op.prefix_keys) == ("r1", tokens, None, None)
    assert op.host_indices is host and op.start_time <= time.monotonic() and op.id >= 0
    assert can_terminate_prefetch(op, "best_effort")
    wait_done(op)
    assert op.hash_value == hashes and op.completed_tokens == len(tokens)
    assert not op.is_terminated(), "done, not terminated: SGLang's completion test ends it"
    for policy in ("wait_complete", "timeout"):
        assert can_terminate_prefetch(op, policy)
    with pytest.raises(RuntimeError, match="counted by hicache"):
        op.increment(P)
    op.mark_terminate()  # ends it as terminate_prefetch does
    assert op.is_terminated() and pool.available_size() == free - len(tokens)
    assert c.terminate_prefetch(op) == (len(tokens), hashes)
    pool.free(host)
    # An op whose reads stop short (page 3's record is corrupt): is_terminated() ends it under
    # wait_complete, which its completion test alone never would.
    record = tmp_path / "l3" / f"{c._cache.key_prefix}-{hashes[2]}"
    data = bytearray(record.read_bytes())
    data[-8:] = bytes(b ^ 0xFF for b in data[-8:])
    record.write_bytes(bytes(data))
    host = pool.alloc(len(tokens))
    op = c.prefetch("r2", host, tokens, None)
    wait_done(op)
    assert op.completed_tokens == 2 * P and len(op.hash_value) == 4
    assert op.is_terminated()
    assert can_terminate_prefetch(op, "wait_complete")
    assert c.terminate_prefetch(op) == (2 * P, hashes[:2])
    assert pool.available_size() == free - 2 * P
    pool.free(host[:2 * P])
    assert pool.available_size() == free
    # An op revoked but not read yet: hash_value empty, so only the timeout policy (its time
    # up) or best_effort end it; its revoke frees its pages.
    op = c.prefetch("r3", pool.alloc(2 * P), [3] * (2 * P), None)
    wait_done(op)
    assert op.hash_value == [] and not op.is_terminated()
    assert not can_terminate_prefetch(op, "wait_complete")
    assert not can_terminate_prefetch(op, "timeout", (3600.0, 0.0))
    op.start_time -= 2.0
    assert can_terminate_prefetch(op, "timeout", (1.0, 0.0))
    assert c.prefetch_revoke_queue.get(timeout=30) == "r3"
    assert pool.available_size() == free
    c.close()


def test_a_prefetch_without_host_pages_is_nothing_to_fetch(tmp_path):
    """SGLang 2025-08 issues prefetch(rid, None, tokens, last_hash) when the host pool has no
    room: an op that is done and terminated, with nothing, and no revoke."""
    d = Driver("page_first", tmp_path / "l3")
    c = d.ctrl
    free = c.mem_pool_host.available_size()
    op = c.prefetch("none", None, list(range(4 * P)), None)
    assert op.host_indices is None and op.is_done() and op.is_terminated()
    assert op.hash_value == [] and op.completed_tokens == 0
    for policy in ("best_effort", "wait_complete", "timeout"):
        assert can_terminate_prefetch(op, policy)
    assert c.terminate_prefetch(op) == (0, [])
    with pytest.raises(queue.Empty):
        c.prefetch_revoke_queue.get(timeout=0.05)
    assert c.mem_pool_host.available_size() == free
    c.close()


def test_write_and_load_take_no_priority(tmp_path):
    d = Driver("page_first", tmp_path, storage=False)
    c = d.ctrl
    dev = d.alloc.alloc(P)
    with pytest.raises(ValueError, match="priority=3"):
        c.write(dev, priority=3, node_id=1)
    assert c.mem_pool_host.available_size() == d.host.size and len(c.ack_write_queue) == 0
    host = c.write(dev, priority=None, node_id=1)
    c.ack_write_queue.pop(0).finish_event.synchronize()
    assert c.evict_device(dev, host) == P
    free = len(d.alloc.free_pages)
    with pytest.raises(ValueError, match="priority=0"):
        c.load(host, priority=0, node_id=2)
    assert len(d.alloc.free_pages) == free and c.mem_pool_host.is_backup(host)
    c.close()


def config_keys():
    """Every key of the HiCache config schema and its SGLang aliases (the reference's tables)."""
    keys = set()
    for line in hicache.config_reference().splitlines():
        m = re.match(r"\| `([a-z_.]+)` \|", line)
        if m:
            keys.add(m.group(1).split(".")[0])
    return keys


def test_every_config_key_is_classified_for_the_drop_in():
    from hicache.sglang.controller import _OWN_EFFECTIVE, _OWN_FROM_SGLANG, _OWN_RADIX
    tables = [set(_OWN_EFFECTIVE), set(_OWN_FROM_SGLANG), set(_OWN_RADIX)]
    assert not (tables[0] & tables[1] or tables[0] & tables[2] or tables[1] & tables[2])
    assert config_keys() == tables[0] | tables[1] | tables[2]


def test_the_docs_table_of_the_hicache_object_is_the_drop_ins():
    """docs/sglang.md's table of the "hicache" object puts each key in the row the drop-in's
    tables (_config.py) put it: effective, refused as SGLang's value, or refused as a decision of
    SGLang's radix cache; a key added to one and not the other fails here."""
    from hicache.sglang._config import _OWN_EFFECTIVE, _OWN_FROM_SGLANG, _OWN_RADIX
    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "sglang.md").read_text()
    documented = {"effective": set(), "from_sglang": set(), "radix": set()}
    for first, second in doc_table(doc, '| `"hicache"` key | in the drop-in |'):
        if second.startswith("effective"):
            kind = "effective"
        elif second.startswith("refused: taken from SGLang"):
            kind = "from_sglang"
        else:
            assert second.startswith("refused"), second
            kind = "radix"
        documented[kind] |= set(re.findall(r"`([a-z_0-9]+)`", first))
    assert documented["effective"] == set(_OWN_EFFECTIVE)
    assert documented["from_sglang"] == set(_OWN_FROM_SGLANG)
    assert documented["radix"] == set(_OWN_RADIX)


REFUSED = {"prefetch_policy": "wait_complete", "prefetch_timeout_base_ms": 10,
           "prefetch_timeout_per_page_ms": 1, "prefetch_timeout_cap_ms": 100,
           "prefetch_budget_tokens": 64, "eviction_policy": "lfu", "write_through_threshold": 3,
           "load_back_min_tokens": 8, "recompute_seconds_per_token": 0.001,
           "demote_low_watermark": 0.1, "demote_high_watermark": 0.2,
           "storage_admission": "exclusive", "storage_admission_min_hits": 2,
           "hicache_storage_prefetch_policy": "timeout", "page_size": 8, "device": "host",
           "device_tokens": 64, "model": {"layers": 3}, "host_ratio": 4, "host_bytes": 1 << 20,
           "host_tokens": 256, "hicache_ratio": 4, "hicache_size": 1, "host_layout": "page_first",
           "hicache_mem_layout": "page_first", "io_backend": "kernel",
           "hicache_io_backend": "kernel", "write_policy": "write_back",
           "hicache_write_policy": "write_back", "host_tier": False,
           "storage": {"backend": "file", "root": "/tmp/x"}, "hicache_storage_backend": "file",
           "hicache_storage_backend_extra_config": {}, "model_name": "m",
           "prefetch_threshold_tokens": 8, "tp_rank": 0, "tp_size": 1,
           "kv_events": {"endpoint": "tcp://*:5557"}}


@pytest.mark.parametrize("key", sorted(REFUSED))
def test_a_key_the_drop_in_cannot_honour_is_refused_naming_it(tmp_path, key):
    from hicache.sglang.controller import _OWN_FROM_SGLANG, _OWN_RADIX
    where = _OWN_RADIX.get(key) or _OWN_FROM_SGLANG[key]
    why = "radix cache" if key in _OWN_RADIX else "takes the value from SGLang"
    with pytest.raises(ValueError, match=f"'hicache.{key}'.*{re.escape(why)}.*{re.escape(where)}"):
        Driver("page_first", tmp_path / "l3", extra={key: REFUSED[key]})


EFFECTIVE_BAD = {"model_fingerprint": "", "metrics": 3, "metrics_port": -5,
                 "metrics_bind": 7, "tp_store_dir": 5, "tp_hostname": 5, "tp_timeout_ms": 0,
                 "tp_connect_timeout_ms": 0, "queue_capacity": 0, "layer_slots": 0,
                 "kernel_max_blocks": -1, "storage_batch_pages": -1}


@pytest.mark.parametrize("key", sorted(EFFECTIVE_BAD))
def test_a_key_the_drop_in_honours_reaches_hicaches_config(tmp_path, key):
    """The drop-in passes these on: a bad value is refused by the config parser, naming it."""
    from hicache.sglang.controller import _OWN_EFFECTIVE
    assert set(EFFECTIVE_BAD) == set(_OWN_EFFECTIVE)
    with pytest.raises(ValueError, match=key):
        Driver("page_first", tmp_path / "l3", extra={key: EFFECTIVE_BAD[key]})


def test_the_keys_the_drop_in_honours_change_what_they_say(tmp_path):
    d = Driver("page_first", tmp_path / "l3", extra={"model_fingerprint": "rev-7",
                                                     "layer_slots": 5, "metrics_port": 0})
    assert ".rev-7." in d.ctrl._cache.key_prefix
    assert d.ctrl.layer_done_counter.num_counters == 5
    assert d.ctrl._cache.metrics_port > 0
    d.ctrl.close()
    d = Driver("page_first", tmp_path / "l3", extra={"metrics": False})
    assert "hicache_ops_total" not in d.ctrl._cache.metrics_text()
    d.ctrl.close()
    d = Driver("page_first", tmp_path / "l3")
    assert ".unversioned." in d.ctrl._cache.key_prefix and d.ctrl._cache.metrics_port == -1
    assert "hicache_ops_total" in d.ctrl._cache.metrics_text()
    d.ctrl.close()


def test_sglangs_radix_keys_in_the_extra_config_are_left_to_sglang(tmp_path):
    """SGLang 2025-08 passes its radix cache's keys in the extra config; SGLang reads them, so
    they do not reach hicache's config (where they would set hicache's radix cache's)."""
    d = Driver("page_first", tmp_path / "l3")
    alloc, host = d.alloc, d.host
    d.ctrl.close()
    extra = {"backend": "file", "root": str(tmp_path / "l3"), "prefetch_threshold": 4,
             "prefetch_timeout_base": 1, "prefetch_timeout_per_ki_token": 0.25,
             "hicache_storage_pass_prefix_keys": True}
    c = HiCacheController(alloc, HostPool("page_first", layers=L, heads=H, head_dim=D,
                                          page_size=P, pages=48), P, None,
                          storage_backend="hicache", prefetch_threshold=P,
                          storage_backend_extra_config=json.dumps(extra))
    assert c.enable_storage
    c.close()


def _tp_worker(rank, world, init_file, root, out):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    extra = {"tp_store_dir": str(root) + "-tp", "tp_timeout_ms": 20000}
    s = run_phases("page_first", root, rank=rank, tp_group=dist.group.WORLD, extra=extra,
                   count=40)
    with open(out, "w") as f:
        json.dump(s, f)
    dist.destroy_process_group()


def test_two_tp_ranks_in_two_processes_agree_over_gloo(tmp_path):
    """Two ranks, each its own process, pools and slice of the KV, one store: both serve every
    byte right, and their trees stay identical."""
    init = tmp_path / "init"
    os.makedirs(str(tmp_path / "l3") + "-tp", exist_ok=True)
    procs = [subprocess.Popen([sys.executable, __file__, str(r), "2", str(init),
                               str(tmp_path / "l3"), str(tmp_path / f"out{r}.json")])
             for r in range(2)]
    for p in procs:
        assert p.wait(timeout=240) == 0
    a, b = (json.load(open(tmp_path / f"out{r}.json")) for r in range(2))
    assert a["nodes_1"] == b["nodes_1"] and a["nodes_2"] == b["nodes_2"]
    assert a["first"] == b["first"] and a["second"] == b["second"]
    assert a["second"]["prefetched"] > 5, a


if __name__ == "__main__":
    _tp_worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])


@pytest.mark.skipif(DEVICE == "cuda", reason="the host backend's refusal")
def test_an_engine_stream_on_the_host_backend_is_refused_naming_it_and_changes_nothing(tmp_path):
    """The host backend has no native streams: the drop-in passes none there, and a handle
    passed anyway is a ValueError from write, start_loading and wait_layer before anything
    changed (on a GPU the handle is torch's current stream, waited on by hicache's copies)."""
    d = Driver("page_first", tmp_path, storage=False)
    c = d.ctrl
    assert c._compute_stream() is None
    dev = d.alloc.alloc(P)
    for layer in range(L):
        for which, buf in enumerate(d.pool.layer_buffers(layer)):
            put(buf, dev, pattern("cd" * 32, layer, which, 0, False).view(torch.bfloat16))
    free = c._cache.host_free_tokens
    with pytest.raises(ValueError, match="wrap_stream.*no native streams"):
        c._cache.write(dev.tolist(), 1, 0)
    assert c._cache.host_free_tokens == free and len(c.ack_write_queue) == 0
    host = c.write(dev, node_id=1)  # and the same call without a stream goes through
    c.ack_write_queue[0].finish_event.synchronize()
    assert c.evict_device(dev, host) == P
    back = c.load(host, node_id=2)
    with pytest.raises(ValueError, match="no native streams"):
        c._cache.start_loading(0)
    slot = c.start_loading()  # the load queued before the refusal is still there
    assert slot >= 0
    with pytest.raises(ValueError, match="no native streams"):
        c._cache.wait_layer(slot, 0, 0)
    c.layer_done_counter.set_consumer(slot)
    for layer in range(L):
        for which, buf in enumerate(d.pool.get_key_buffer(layer)):
            assert torch.equal(read(buf, back), pattern("cd" * 32, layer, which, 0, False))
    assert written(c, back, host)
    c.close()
