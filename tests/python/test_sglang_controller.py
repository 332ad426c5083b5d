"""hicache.sglang.HiCacheController driven the way SGLang's HiRadixCache drives its controller.

The driver below replays the radix cache's calls over many requests that share prefixes:
match -> prefetch from L3 into host pages it allocated -> terminate -> load back host pages ->
start_loading -> the forward pass waits layer by layer (the device pool's get_key_buffer) ->
compute the rest into slots from the engine's allocator -> write through -> drain the write
acks (list style, as SGLang's later releases) -> back up to L3 -> drain the backup acks and
revokes (queue style, as the 2025 releases) -> evict device and host pages under pressure.
The device pool is SGLang's shape (per-layer k_buffer / v_buffer with a padding page), the host
pool SGLang's kv_buffer in each layout. The "model" checks every byte it reads from a cached
page against the bytes that page was computed with (per page, layer, K/V and TP rank)."""
import json
import os
import subprocess
import sys
import threading
import time

import pytest

torch = pytest.importorskip("torch", reason="python3-torch is not installed")

sys.path.insert(0, os.path.dirname(__file__))
from conftest import HostPool  # noqa: E402
from test_sglang_store import sglang_keys  # noqa: E402

from hicache.sglang import HiCacheController  # noqa: E402
from hicache.sglang_controller import HiCacheDeviceError  # noqa: E402
import hicache  # noqa: E402

P, L, H, D = 4, 3, 2, 8


class DevicePool:
    """SGLang's MHATokenToKVPool / MLATokenToKVPool: one tensor per layer, a padding page."""

    def __init__(self, pages, mla=False):
        self.page_size, self.layer_num, self.size = P, L, pages * P
        self.dtype, self.mla = torch.bfloat16, mla
        rows = self.size + P
        if mla:
            self.kv_lora_rank, self.qk_rope_head_dim = D - 4, 4
            self.kv_buffer = [torch.zeros((rows, 1, D), dtype=self.dtype) for _ in range(L)]
        else:
            self.head_num, self.head_dim = H, D
            self.k_buffer = [torch.zeros((rows, H, D), dtype=self.dtype) for _ in range(L)]
            self.v_buffer = [torch.zeros((rows, H, D), dtype=self.dtype) for _ in range(L)]
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
    """The calls SGLang's HiRadixCache makes, over per-page nodes (a page chain is a path)."""

    def __init__(self, layout, root, mla=False, rank=0, tp_group=None, extra=None,
                 device_pages=24, host_pages=48, storage=True, style="later"):
        """style "later": start_loading() and acks read as lists (SGLang's later releases);
        "2025": load_cache_event with next_producer(), acks read as queues, prefetches
        finished by SGLang's own completion test (the 2025-08 radix cache)."""
        self.rank, self.tp_group, self.mla, self.style = rank, tp_group, mla, style
        self.event = threading.Event() if style == "2025" else None
        self.pool = DevicePool(device_pages, mla)
        self.alloc = Allocator(self.pool)
        self.host = HostPool(layout, mla=mla, layers=L, heads=H, head_dim=D, page_size=P,
                             pages=host_pages)
        cfg = {"storage": {"backend": "file", "root": str(root)}} if storage else {}
        cfg.update(extra or {})
        self.ctrl = HiCacheController(
            self.alloc, self.host, P, tp_group, load_cache_event=self.event,
            write_policy="write_through", io_backend="direct",
            storage_backend="hicache" if storage else None, prefetch_threshold=P,
            model_name="drop-in-test",
            storage_backend_extra_config=json.dumps(cfg["storage"] | ({"hicache": extra}
                                                                      if extra else {}))
            if storage else (json.dumps({"hicache": extra}) if extra else None))
        self.nodes = {}
        self.next_id = 1
        self.clock = 0
        self.writing, self.loading, self.backups = {}, {}, {}
        self.verified = {"device": 0, "loaded": 0, "prefetched": 0}
        self.revoked = self.prefetch_calls = 0
        self.prefetched_pages = 0

    # --- TP: what SGLang's radix cache min-reduces before acting on a queue ------------------
    def agreed(self, n):
        if self.tp_group is None:
            return n
        import torch.distributed as dist
        t = torch.tensor(n, dtype=torch.int)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.tp_group)
        return int(t.item())

    # --- events --------------------------------------------------------------------------
    def written(self, nid):
        node = self.writing.pop(nid)
        node.backed_up = True
        node.lock -= 1
        self.backup(node)

    def loaded(self, nid):
        for node in self.loading.pop(nid):
            node.lock -= 1

    def check_events(self):
        if self.style == "2025":  # queues of node ids
            q = self.ctrl.ack_write_queue
            for _ in range(self.agreed(q.qsize())):
                self.written(q.get())
            q = self.ctrl.ack_load_queue
            while not q.empty():
                self.loaded(q.get_nowait())
        else:  # lists of acks with events
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
            q = self.ctrl.ack_load_queue
            done = self.agreed(len(q))
            for ack in list(q)[:done]:
                for nid in ack.node_ids:
                    self.loaded(nid)
            del q[:done]
        q = self.ctrl.prefetch_revoke_queue  # the 2025 releases: a queue
        for _ in range(self.agreed(q.qsize())):
            q.get()
            self.revoked += 1
        q = self.ctrl.ack_backup_queue
        for _ in range(self.agreed(q.qsize())):
            ack = q.get()
            node = self.backups.pop(ack.id)
            node.backing_up = False
            node.host_lock -= 1
            node.in_l3 = ack.completed_tokens == P

    def backup(self, node):
        if node.in_l3 or not self.ctrl.enable_storage:
            return
        op_id = self.ctrl.write_storage(node.host, node.tokens, [node.hash])
        assert op_id is not None
        self.backups[op_id] = node
        node.backing_up = True
        node.host_lock += 1

    # --- eviction (LRU over unlocked nodes) ------------------------------------------------
    def evict_device(self, tokens):
        freed = 0
        for node in sorted(self.nodes.values(), key=lambda n: n.last_use):
            if freed >= tokens:
                break
            if node.device is None or node.lock > 0:
                continue
            if node.backed_up:
                assert self.ctrl.evict_device(node.device, node.host) == P
                node.device = None
            else:
                self.alloc.free(node.device)
                del self.nodes[node.hash]
            freed += P

    def evict_host(self, tokens):
        freed = 0
        for node in sorted(self.nodes.values(), key=lambda n: n.last_use):
            if freed >= tokens:
                break
            if node.host is None or node.device is not None or node.lock or node.host_lock:
                continue
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

    # --- one request -----------------------------------------------------------------------
    def serve(self, rid, tokens):
        self.clock += 1
        hashes = sglang_keys(tokens, P)
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
            rest = tokens[i * P:n * P]
            host = self.ctrl.mem_pool_host.alloc(len(rest))
            if host is None:
                self.evict_host(len(rest))
                host = self.ctrl.mem_pool_host.alloc(len(rest))
            if host is not None:
                self.ctrl.prefetch_tokens_occupied += len(rest)
                op = self.ctrl.prefetch(rid, host, rest, hashes[i - 1] if i else None)
                self.prefetch_calls += 1
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    if self.style == "2025":  # SGLang's wait_complete test
                        if op.completed_tokens == len(op.hash_value) * P:
                            break
                    elif op.is_done():
                        break
                    time.sleep(0.0005)
                completed, hash_value = self.ctrl.terminate_prefetch(op)
                completed = self.agreed(completed)
                self.ctrl.prefetch_tokens_occupied -= len(rest)
                assert hash_value == hashes[i:i + completed // P]
                if completed:
                    self.ctrl.mem_pool_host.update_prefetch(host[:completed])
                for j in range(completed // P):
                    node = self.new_node(hashes[i + j], tokens[(i + j) * P:(i + j + 1) * P])
                    node.host = host[j * P:(j + 1) * P]
                    node.backed_up = node.in_l3 = True
                    node.lock += 1
                    fetched.append(node)
                matched += fetched
                i += completed // P
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
        if self.style == "2025":  # ready_to_load_host_cache()
            producer = self.ctrl.layer_done_counter.next_producer()
            self.event.set()
        else:
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
                    got = buf[node.device].view(torch.int16)
                    want = pattern(node.hash, layer, which, self.rank, self.mla)
                    assert torch.equal(got, want), (
                        f"rank {self.rank}: page {node.hash[:12]} layer {layer} buffer {which}")
            for j in range(n - i):
                for which, buf in enumerate(buffers):
                    buf[new[j * P:(j + 1) * P]] = pattern(
                        hashes[i + j], layer, which, self.rank, self.mla).view(torch.bfloat16)
        for node in matched:
            kind = "prefetched" if id(node) in from_l3 else "loaded" if id(node) in loaded \
                else "device"
            self.verified[kind] += 1
            node.lock -= 1
        # Insert the new pages and write them through to the host.
        for j in range(n - i):
            node = self.new_node(hashes[i + j], tokens[(i + j) * P:(i + j + 1) * P])
            node.device = new[j * P:(j + 1) * P]
            host = self.ctrl.write(node.device, node_id=node.id)
            if host is None:
                self.evict_host(P)
                host = self.ctrl.write(node.device, node_id=node.id)
            if host is not None:
                node.host = host
                node.lock += 1
                self.writing[node.id] = node
        self.check_events()

    def new_node(self, page_hash, tokens):
        node = Node(self.next_id, page_hash, tokens)
        self.next_id += 1
        node.last_use = self.clock
        self.nodes[page_hash] = node
        return node

    def settle(self):
        """Drains every outstanding ack."""
        deadline = time.monotonic() + 60
        while (self.writing or self.loading or self.backups) and time.monotonic() < deadline:
            self.check_events()
            time.sleep(0.001)
        assert not (self.writing or self.loading or self.backups)

    def check_no_leak(self):
        """Every device and host page is either free or held by exactly one node."""
        self.settle()
        dev = sum(1 for node in self.nodes.values() if node.device is not None)
        assert len(self.alloc.free_pages) + dev == self.pool.size // P
        host = sum(1 for node in self.nodes.values() if node.host is not None)
        assert self.ctrl.mem_pool_host.available_size() + host * P == self.host.size


def requests(count, seed, families=5):
    """Requests that share prefixes: family f's tokens, cut at random page counts."""
    import random
    rng = random.Random(seed)
    for r in range(count):
        f = rng.randrange(families)
        pages = rng.randint(2, 9)
        yield f"req-{seed}-{r}", [f * 100000 + t for t in range(pages * P)]


def run_phases(layout, root, mla=False, rank=0, tp_group=None, extra=None, count=60,
               style="later"):
    """Phase 1 computes, writes through and backs up; phase 2, a fresh engine on the same
    store, finds the pages in L3 only and reads them back through prefetch and load."""
    d = Driver(layout, root, mla, rank, tp_group, extra, style=style)
    for rid, tokens in requests(count, 1):
        d.serve(rid, tokens)
    d.check_no_leak()
    first = dict(d.verified)
    nodes_1 = sorted(d.nodes)
    d.ctrl.close()
    d2 = Driver(layout, root, mla, rank, tp_group, extra, style=style)
    for rid, tokens in requests(count // 2, 2):
        d2.serve(rid, tokens)
    d2.check_no_leak()
    second = dict(d2.verified)
    summary = {"first": first, "second": second, "nodes_1": nodes_1, "nodes_2": sorted(d2.nodes)}
    d2.ctrl.close()
    return summary


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_the_radix_cache_call_sequence_serves_every_byte(tmp_path, layout, mla):
    s = run_phases(layout, tmp_path / "l3", mla)
    assert s["first"]["device"] > 20 and s["first"]["loaded"] > 10, s
    assert s["second"]["prefetched"] > 10, s


def test_sglang_2025s_call_sequence_serves_every_byte(tmp_path):
    """The 2025-08 radix cache: ready_to_load_host_cache() (next_producer, then the event),
    acks as queues of node ids, prefetches ended by its completion test."""
    s = run_phases("page_first", tmp_path / "l3", style="2025")
    assert s["first"]["device"] > 20 and s["first"]["loaded"] > 10, s
    assert s["second"]["prefetched"] > 10, s


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
    """One device page written through (its ack taken) and evicted: (device, host) slots."""
    c = d.ctrl
    dev = d.alloc.alloc(P)
    host = c.write(dev, node_id=node_id)
    deadline = time.monotonic() + 30
    while not c.ack_write_queue and time.monotonic() < deadline:
        time.sleep(0.001)
    assert c.ack_write_queue.pop(0).node_ids == [node_id]
    assert c.evict_device(dev, host) == P
    return dev, host


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
    bad, set_throwing = hicache._hicache._throwing_store(good._s)
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


def test_a_failed_copy_raises_after_the_good_acks_drained_with_it_are_queued(tmp_path):
    """hicache posts (node, ok) acks; one not ok among good ones: the good ones stay in the
    queue (their nodes are not lost) and reading the queue raises once, naming the node."""
    d = Driver("page_first", tmp_path, storage=False)
    c = d.ctrl
    native = c._cache

    class OneFailure:
        def __init__(self):
            self.acks = [(11, True), (12, False), (13, True)]

        def wait_acks(self, kind, n, timeout):
            out, self.acks = (self.acks, []) if kind == "write" else ([], self.acks)
            return out

        def __getattr__(self, name):
            return getattr(native, name)

    c._cache = OneFailure()
    with pytest.raises(HiCacheDeviceError, match="node 12"):
        len(c.ack_write_queue)
    assert [ack.node_ids for ack in c.ack_write_queue] == [[11], [13]], "no good ack lost"
    assert c.write_failures == 1
    c._cache = native
    c.close()


def test_a_blocking_get_waits_for_the_ack_as_write_back_does(tmp_path):
    """SGLang's write_back evicts by writing and then blocking on ack_write_queue.get()."""
    d = Driver("page_first", tmp_path, storage=False)
    c = d.ctrl
    for node in (21, 22):
        assert c.write(d.alloc.alloc(P), node_id=node) is not None
    assert [c.ack_write_queue.get(), c.ack_write_queue.get()] == [21, 22]
    with pytest.raises(Exception) as empty:
        c.ack_write_queue.get(timeout=0.05)
    assert type(empty.value).__name__ == "Empty"
    c.close()


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
