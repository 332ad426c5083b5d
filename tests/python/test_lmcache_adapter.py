"""Contract suite of hicache.lmcache.HiCacheL2Adapter, written from LMCache's native_plugin
interface: a stand-in for LMCache drives the adapter as LMCache does (its factory builds the
class from module_path/class_name/adapter_params and checks the methods; controller threads
submit under the bridge's lock; one bridge thread polls the eventfd and drains completions).
"""
import importlib
import os
import random
import select
import threading
import time
import urllib.request

import pytest

import hicache
from hicache import _testing
from hicache.lmcache import HiCacheL2Adapter

PAGE = 64 * 1024


def lmcache_key(chunk, model="meta-llama/Llama-3.1-8B", rank=0, salt=None):
    """LMCache's key string: <model>@<kv_rank 8 hex>@<object group hex>@<chunk hash hex>."""
    key = f"{model}@{(1 << 24) | rank:08x}@0@{chunk:064x}"
    return key if salt is None else f"{key}@{salt}"


def page(seed, size=PAGE):
    return bytearray(random.Random(seed).randbytes(size))


class Bridge:
    """LMCache's NativeConnectorL2Adapter, reduced to its threading: submits register the
    future id under a lock held across the native submit; one thread polls the eventfd (500 ms
    timeout, as LMCache) and drains completions; an unknown id is an error here."""

    def __init__(self, client):
        self.client = client
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.pending = set()
        self.done = {}
        self.unknown = []
        self.duplicates = []
        self.stop = False
        self.fd = client.event_fd()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self):
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        while not self.stop:
            if not poller.poll(500):
                continue
            for fid, ok, error, per_key in self.client.drain_completions():
                with self.cond:
                    if fid in self.done:
                        self.duplicates.append(fid)
                    elif fid not in self.pending:
                        self.unknown.append(fid)
                    self.pending.discard(fid)
                    self.done[fid] = (ok, error, per_key)
                    self.cond.notify_all()

    def submit(self, method, *args, **kwargs):
        with self.lock:
            fid = getattr(self.client, method)(*args, **kwargs)
            self.pending.add(fid)
            return fid

    def wait(self, fid, timeout=30):
        with self.cond:
            assert self.cond.wait_for(lambda: fid in self.done, timeout), f"job {fid} never ended"
            return self.done[fid]

    def close(self):
        self.stop = True
        self.thread.join(5)
        assert not self.thread.is_alive()
        self.client.close()
        assert not self.unknown and not self.duplicates


def load_adapter(adapter_params, module_path="hicache.lmcache", class_name="HiCacheL2Adapter"):
    """LMCache's native_plugin factory: import, build with adapter_params, check the surface."""
    cls = getattr(importlib.import_module(module_path), class_name)
    client = cls(**adapter_params)
    for name in ("event_fd", "submit_batch_get", "submit_batch_set", "submit_batch_exists",
                 "drain_completions", "close"):
        if not callable(getattr(client, name, None)):
            client.close()
            raise TypeError(f"{class_name} lacks {name}")
    assert callable(getattr(client, "submit_batch_delete", None))  # L2 eviction enabled
    return client


def read_back(bridge, keys, expected):
    """Gets keys into fresh buffers; every key must hit with exactly its expected bytes."""
    dst = [bytearray(len(e)) for e in expected]
    ok, error, per_key = bridge.wait(bridge.submit("submit_batch_get", keys=keys,
                                                   memoryviews=[memoryview(b) for b in dst]))
    assert (ok, error, per_key) == (True, "", [True] * len(keys))
    for i, (got, want) in enumerate(zip(dst, expected)):
        assert got == want, f"key {keys[i]}"


def over_file_store(double, params):
    """A test double (hicache._testing) over the file store of `params`: (Store, switches...)."""
    inner = hicache._hicache.Store('{"backend": "file", "root": "%s"}' % params["storage"]["root"])
    native, *switches = double(inner)
    return (hicache.Store(native), *switches)


@pytest.fixture
def file_params(tmp_path):
    return {"storage": {"backend": "file", "root": str(tmp_path / "l2")}}


def test_store_wipe_load_every_byte(file_params, tmp_path):
    bridge = Bridge(load_adapter(file_params))
    keys = [lmcache_key(i, salt="tenant-a") for i in range(16)]
    src = [page(i) for i in range(16)]
    expect = [bytes(b) for b in src]
    ok, error, per_key = bridge.wait(bridge.submit("submit_batch_set", keys=keys,
                                                   memoryviews=[memoryview(b) for b in src]))
    assert (ok, error, per_key) == (True, "", [True] * 16)
    for b in src:  # wipe the L1 buffers: what comes back must come from the store
        b[:] = bytes(PAGE)
    dst = [bytearray(PAGE) for _ in range(16)]
    ok, error, per_key = bridge.wait(bridge.submit("submit_batch_get", keys=keys,
                                                   memoryviews=[memoryview(b) for b in dst]))
    assert (ok, per_key) == (True, [True] * 16)
    for i in range(16):
        assert bytes(dst[i]) == expect[i], f"page {i}"
    # The model name's '/' is escaped: every record is a file directly under the store's root.
    names = [bridge.client.record_name(k) for k in keys]
    assert all("/" not in n for n in names) and len(set(names)) == 16
    bridge.close()


def test_exists_and_get_answer_per_key(file_params):
    bridge = Bridge(load_adapter(file_params))
    keys = [lmcache_key(i) for i in range(4)]
    stored = [page(10), page(12)]
    ok, _, _ = bridge.wait(bridge.submit("submit_batch_set", keys=[keys[0], keys[2]],
                                         memoryviews=stored))
    assert ok
    assert bridge.wait(bridge.submit("submit_batch_exists", keys=keys)) == \
        (True, "", [True, False, True, False])
    dst = [bytearray(b"\x5a" * PAGE) for _ in range(4)]
    ok, error, per_key = bridge.wait(bridge.submit("submit_batch_get", keys=keys,
                                                   memoryviews=dst))
    assert (ok, per_key) == (True, [True, False, True, False])  # misses do not fail the batch
    assert dst[0] == stored[0] and dst[2] == stored[1]
    assert dst[1] == b"\x5a" * PAGE and dst[3] == b"\x5a" * PAGE  # missed buffers untouched
    # delete (LMCache's eviction): per key, removed or not.
    assert bridge.wait(bridge.submit("submit_batch_delete", keys=[keys[2], keys[1]])) == \
        (True, "", [True, False])
    assert bridge.wait(bridge.submit("submit_batch_exists", keys=keys))[2] == \
        [True, False, False, False]
    # A record of another size is a miss, never wrong bytes (the store drops it as bad).
    short = [bytearray(b"\x5a" * (PAGE // 2))]
    assert bridge.wait(bridge.submit("submit_batch_get", keys=[keys[0]], memoryviews=short))[:3:2] \
        == (True, [False])
    bridge.close()


def test_keys_stay_distinct_escaped_or_hashed(file_params):
    client = load_adapter(dict(file_params, namespace="bf16.tp0of1"))
    a, b = "m/x@1", "m%2Fx@1"  # an escaped key never equals another key's name
    assert client.record_name(a) != client.record_name(b)
    assert client.record_name(a).startswith("bf16.tp0of1-")
    long1, long2 = lmcache_key(1, salt="s" * 128), lmcache_key(2, salt="s" * 128)
    n1, n2 = client.record_name(long1), client.record_name(long2)
    assert len(n1) <= 240 and n1 != n2 and "%h" in n1
    bridge = Bridge(client)
    bufs = [page(1), page(2)]
    assert bridge.wait(bridge.submit("submit_batch_set", keys=[long1, long2],
                                     memoryviews=bufs))[0]
    out = [bytearray(PAGE), bytearray(PAGE)]
    assert bridge.wait(bridge.submit("submit_batch_get", keys=[long1, long2],
                                     memoryviews=out))[2] == [True, True]
    assert out == bufs
    bridge.close()


def test_concurrent_controllers(file_params):
    """LMCache's store and prefetch controllers submit at once; every job completes exactly once
    with its own bytes."""
    bridge = Bridge(load_adapter(dict(file_params, workers=3)))
    errors = []

    def controller(t):
        try:
            for r in range(5):
                keys = [lmcache_key(1000 * t + 10 * r + i) for i in range(4)]
                src = [page(1000 * t + 10 * r + i, 16 * 1024) for i in range(4)]
                ok, _, _ = bridge.wait(bridge.submit("submit_batch_set", keys=keys,
                                                     memoryviews=src))
                assert ok
                dst = [bytearray(16 * 1024) for _ in range(4)]
                ok, _, per_key = bridge.wait(bridge.submit("submit_batch_get", keys=keys,
                                                           memoryviews=dst))
                assert ok and per_key == [True] * 4 and dst == src
        except BaseException as e:  # reported on the main thread
            errors.append(e)

    threads = [threading.Thread(target=controller, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert len(bridge.done) == 40 and not bridge.pending
    m = bridge.client.metrics()["hicache_async_jobs_total"]["series"]
    counts = {(s["labels"]["kind"], s["labels"]["outcome"]): s["value"] for s in m}
    assert counts[("set", "ok")] == 20 and counts[("get", "ok")] == 20
    assert counts[("get", "failed")] == 0
    bridge.close()


def test_restart_on_same_file_store_hits(file_params):
    keys = [lmcache_key(i) for i in range(8)]
    src = [page(100 + i) for i in range(8)]
    first = Bridge(load_adapter(file_params))
    assert first.wait(first.submit("submit_batch_set", keys=keys, memoryviews=src))[0]
    first.close()
    second = Bridge(load_adapter(file_params))
    assert second.wait(second.submit("submit_batch_exists", keys=keys))[2] == [True] * 8
    read_back(second, keys, src)
    second.close()


def test_close_with_jobs_in_flight_loses_nothing_acknowledged(file_params):
    gated, set_open, waiting = over_file_store(_testing.gated_store, file_params)
    client = HiCacheL2Adapter(storage=gated, workers=2)
    keys = [[lmcache_key(10 * j + i) for i in range(3)] for j in range(6)]
    src = [[page(10 * j + i, 8192) for i in range(3)] for j in range(6)]
    ids = [client.submit_batch_set(keys=k, memoryviews=[memoryview(b) for b in s])
           for k, s in zip(keys, src)]
    assert client.pending == 6
    deadline = time.monotonic() + 10
    while waiting() < 2 and time.monotonic() < deadline:  # both workers hold a job at the gate
        time.sleep(0.01)
    assert waiting() == 2
    closer = threading.Thread(target=client.close)
    closer.start()
    closer.join(0.3)
    assert closer.is_alive()  # close waits for the accepted jobs
    with pytest.raises(RuntimeError, match="after close"):
        client.submit_batch_exists(keys=keys[0])
    set_open(True)
    closer.join(30)
    assert not closer.is_alive()
    client.close()  # idempotent
    with pytest.raises(RuntimeError):
        client.event_fd()
    done = client.drain_completions()  # still drained after close
    assert sorted(c[0] for c in done) == sorted(ids)
    assert all(c[1] and c[3] == [True] * 3 for c in done)
    assert client.drain_completions() == []
    again = Bridge(load_adapter(file_params))
    for k, s in zip(keys, src):
        read_back(again, k, s)
    again.close()


def wait_until(predicate, what, timeout=10):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.001)


def test_a_worker_looking_for_the_next_job_takes_it_and_a_sleeping_one_still_wakes(file_params):
    """After the only job in flight a worker looks for the next one (spin_us) instead of
    sleeping: a submit then finds it and wakes nobody, a second submit still wakes a sleeping
    worker (both jobs run at once), and close() does not wait out a look."""
    gated, set_open, waiting = over_file_store(_testing.gated_store, file_params)
    client = HiCacheL2Adapter(storage=gated, workers=2, spin_us=5_000_000)
    bridge = Bridge(client)
    src = {k: page(i, 8192) for i, k in enumerate(["a", "b", "c", "d"])}
    set_open(True)
    assert bridge.wait(bridge.submit("submit_batch_set", keys=["a"],
                                     memoryviews=[src["a"]]))[0]
    wait_until(lambda: client.looking == 1, "a worker looks after the only job")
    set_open(False)
    b = bridge.submit("submit_batch_set", keys=["b"], memoryviews=[src["b"]])
    c = bridge.submit("submit_batch_set", keys=["c"], memoryviews=[src["c"]])
    # the looking worker took b; c woke the sleeping one: both wait at the gate together (well
    # before the 5 s look would have ended had the looking worker left b queued)
    wait_until(lambda: waiting() == 2, "both jobs run at once", timeout=2.5)
    assert client.looking == 0 and client.pending == 2
    set_open(True)
    assert bridge.wait(b)[0] and bridge.wait(c)[0]
    wait_until(lambda: client.looking == 1, "a worker looks again")
    d = bridge.submit("submit_batch_set", keys=["d"], memoryviews=[src["d"]])
    assert bridge.wait(d)[0]
    wait_until(lambda: client.looking == 1, "and again")
    started = time.monotonic()
    bridge.close()
    assert time.monotonic() - started < 2.5  # the 5 s look ends at close()
    assert client.looking == 0 and client.pending == 0
    again = Bridge(load_adapter(file_params))
    read_back(again, list(src), list(src.values()))
    again.close()
    never = HiCacheL2Adapter(storage=file_params["storage"], spin_us=0)
    assert never.submit_batch_exists(keys=["a"]) == 1
    wait_until(lambda: never.pending == 0, "the exists job ends")
    assert never.looking == 0  # spin_us 0: the worker sleeps at once
    never.close()


def test_full_queue_fails_the_job_at_once(file_params):
    gated, set_open, _ = over_file_store(_testing.gated_store, file_params)
    client = HiCacheL2Adapter(storage=gated, workers=1, max_pending=2)
    fd = client.event_fd()
    a = client.submit_batch_set(keys=["a"], memoryviews=[page(1, 4096)])
    b = client.submit_batch_set(keys=["b"], memoryviews=[page(2, 4096)])
    c = client.submit_batch_set(keys=["c"], memoryviews=[page(3, 4096)])  # never blocks
    r, _, _ = select.select([fd], [], [], 5)
    assert r == [fd]
    assert client.drain_completions() == [(c, False, "queue full (2 jobs pending)", [False])]
    assert select.select([fd], [], [], 0)[0] == []  # drained: the eventfd is clear again
    set_open(True)
    got = {}
    while len(got) < 2:
        assert select.select([fd], [], [], 10)[0] == [fd]
        got.update({x[0]: x for x in client.drain_completions()})
    assert got == {a: (a, True, "", [True]), b: (b, True, "", [True])}
    m = client.metrics()["hicache_async_jobs_total"]["series"]
    counts = {(s["labels"]["kind"], s["labels"]["outcome"]): s["value"] for s in m}
    assert counts[("set", "rejected")] == 1 and counts[("set", "ok")] == 2
    client.close()


def test_a_throwing_store_fails_jobs_and_the_worker_lives_on(file_params):
    throwing, set_throwing = over_file_store(_testing.throwing_store, file_params)
    bridge = Bridge(HiCacheL2Adapter(storage=throwing, workers=1))
    ok, error, per_key = bridge.wait(bridge.submit("submit_batch_set", keys=["k"],
                                                   memoryviews=[page(1, 4096)]))
    assert (ok, per_key) == (False, [False]) and "the test store threw" in error
    set_throwing(False)
    assert bridge.wait(bridge.submit("submit_batch_set", keys=["k"],
                                     memoryviews=[page(1, 4096)]))[0]
    read_back(bridge, ["k"], [page(1, 4096)])
    bridge.close()


def test_bad_input_is_refused_before_anything_is_queued(file_params):
    client = load_adapter(file_params)
    good = [bytearray(4096)]
    cases = [
        (lambda: client.submit_batch_set(keys=["a", "b"], memoryviews=good), "2 keys but 1"),
        (lambda: client.submit_batch_get(keys=["a"], memoryviews=[b"\0" * 4096]), "buffer 0"),
        (lambda: client.submit_batch_get(keys=["a"], memoryviews=[memoryview(bytearray(8))
                                                                  .toreadonly()]), "buffer 0"),
        (lambda: client.submit_batch_set(keys=[], memoryviews=[]), "no keys"),
        (lambda: client.submit_batch_exists(keys=["a", ""]), "key 1 is empty"),
        (lambda: client.submit_batch_set(keys=["a"], memoryviews=[bytearray()]), "empty"),
        (lambda: client.submit_batch_set(keys=["a"], memoryviews=[memoryview(bytearray(16))[::2]]),
         "not C-contiguous"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
    assert client.pending == 0
    assert select.select([client.event_fd()], [], [], 0.2)[0] == []
    assert client.drain_completions() == []
    assert client.submit_batch_exists(keys=["a"]) == 1  # a refused submit takes no id
    client.close()
    with pytest.raises(ValueError, match="workers 0"):
        load_adapter(dict(file_params, workers=0))
    with pytest.raises(ValueError, match="spin_us -1"):
        load_adapter(dict(file_params, spin_us=-1))
    with pytest.raises(ValueError, match="prefix"):
        load_adapter(dict(file_params, namespace="a/b"))
    with pytest.raises(TypeError):
        load_adapter(dict(file_params, no_such_option=1))  # nothing parsed and ignored
    with pytest.raises(ValueError, match="storage"):
        load_adapter({"storage": 42})


def test_buffers_are_pinned_until_drained(file_params):
    """The adapter holds each buffer until its completion is drained: a bytearray under a job
    cannot be resized (its memory cannot move) while the job may still touch it."""
    client = load_adapter(file_params)
    buf = bytearray(4096)
    fid = client.submit_batch_get(keys=["absent"], memoryviews=[buf])
    with pytest.raises(BufferError):
        buf.extend(b"x")
    fd = client.event_fd()
    assert select.select([fd], [], [], 10)[0] == [fd]
    assert [c[0] for c in client.drain_completions()] == [fid]
    buf.extend(b"x")  # released once drained
    client.close()


def test_redis_round_trip_a_dead_server_and_its_return(redis_server):
    params = {"storage": {"backend": "redis", "host": "127.0.0.1", "port": redis_server.port},
              "namespace": "lm"}
    bridge = Bridge(load_adapter(params))
    keys = [lmcache_key(i) for i in range(6)]
    src = [page(200 + i) for i in range(6)]
    assert bridge.wait(bridge.submit("submit_batch_set", keys=keys, memoryviews=src))[0]
    assert bridge.wait(bridge.submit("submit_batch_exists", keys=keys + ["absent"]))[2] == \
        [True] * 6 + [False]
    read_back(bridge, keys, src)
    dst = [bytearray(PAGE) for _ in range(2)]
    redis_server.kill()  # a dead server fails jobs (ok False with the reason), never hangs them
    ok, error, per_key = bridge.wait(bridge.submit("submit_batch_get", keys=keys[:2],
                                                   memoryviews=dst))
    assert (ok, per_key) == (False, [False, False]) and error
    redis_server.restart()  # an empty server on the same port: the adapter recovers (each of
    # the store's connections reconnects after its own backoff, so a job may still fail at first)
    deadline = time.monotonic() + 15
    while True:
        dst = [bytearray(PAGE) for _ in range(2)]
        stored = bridge.wait(bridge.submit("submit_batch_set", keys=keys[:2],
                                           memoryviews=src[:2]))
        got = bridge.wait(bridge.submit("submit_batch_get", keys=keys[:2], memoryviews=dst))
        if stored[0] and got[:3:2] == (True, [True, True]):
            break
        assert time.monotonic() < deadline, f"the adapter never recovered: {stored} {got}"
        time.sleep(0.05)
    assert dst == src[:2]
    while bridge.wait(bridge.submit("submit_batch_exists", keys=keys[1:3]))[2] != [True, False]:
        assert time.monotonic() < deadline, "exists never recovered"  # (a connection still
        time.sleep(0.05)  # backing off answers absent); keys[2] is gone with the old server
    bridge.close()


def test_metrics_over_http_include_the_store_opened_here(file_params):
    client = load_adapter(dict(file_params, metrics_port=0))
    port = client.metrics_port
    assert port > 0
    bridge = Bridge(client)
    assert bridge.wait(bridge.submit("submit_batch_set", keys=["k"],
                                     memoryviews=[page(1, 4096)]))[0]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    assert 'hicache_async_jobs_total{kind="set",outcome="ok"} 1' in text
    assert 'hicache_storage_keys_total' in text and "hicache_async_pending_jobs" in text
    bridge.close()
    assert client.metrics_port == -1  # close() stops serving
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
    with pytest.raises(ValueError, match="metrics_port 70000"):
        load_adapter(dict(file_params, metrics_port=70000))
