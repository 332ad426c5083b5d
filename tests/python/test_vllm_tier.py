"""Contract suite of hicache.vllm.HiCacheTier, written from vLLM's SecondaryTierManager (v3): a
stand-in for vLLM's tiering manager calls the tier from one thread, in vLLM's order (poll
finished jobs once per step, lookups, stores after the primary copy, promotions as loads),
with the primary CPU tier a 2-D byte view of rows."""
import random
import threading
import time
import urllib.request
from collections import namedtuple

import pytest

import hicache
from hicache import _testing
from hicache.vllm import HiCacheTier, LookupResult

ROW = 8192
JobMetadata = namedtuple("JobMetadata", "job_id keys block_ids is_promotion req_context")
TransferJob = namedtuple("TransferJob", "job_id keys chunk_ids is_promotion req_context")
NS = {"model": "meta-llama/Llama-3.1-8B", "fingerprint": "main", "dtype": "bf16",
      "block_size": 16, "tp_size": 2}


def primary(rows=32):
    mem = bytearray(rows * ROW)
    return mem, memoryview(mem).cast("B", (rows, ROW))


def block_key(i, group=0):
    """vLLM's OffloadKey: a block hash followed by the KV cache group, 4 bytes big-endian."""
    return random.Random(i).randbytes(32) + group.to_bytes(4, "big")


def fill(mem, row, seed):
    mem[row * ROW:(row + 1) * ROW] = random.Random(seed).randbytes(ROW)


def row(mem, r):
    return bytes(mem[r * ROW:(r + 1) * ROW])


def make(view, storage, namespace=NS, **kw):
    return HiCacheTier(offloading_spec=None, primary_kv_view=view, tier_type="hicache",
                       storage=storage, namespace=namespace, **kw)


def finish(tier, job_ids, timeout=30):
    """vLLM's steps: poll get_finished_jobs once per step until the jobs ended; each job must be
    reported exactly once. Returns {job_id: success}."""
    got = {}
    deadline = time.monotonic() + timeout
    while set(job_ids) - set(got):
        assert time.monotonic() < deadline, f"jobs {set(job_ids) - set(got)} never finished"
        for r in tier.get_finished_jobs():
            assert r.job_id not in got, f"job {r.job_id} reported twice"
            got[r.job_id] = r.success
        time.sleep(0.005)  # one engine step
    return got


def store_rows(tier, mem, keys, job_id=1):
    """Fills rows 0.. with random bytes and stores them under `keys` (one job, which must
    succeed)."""
    for r in range(len(keys)):
        fill(mem, r, r)
    tier.submit_store(JobMetadata(job_id, keys, list(range(len(keys))), False, None))
    assert finish(tier, [job_id]) == {job_id: True}


@pytest.fixture
def file_storage(tmp_path):
    return {"backend": "file", "root": str(tmp_path / "tier")}


def test_store_wipe_lookup_load_every_byte(file_storage):
    mem, view = primary()
    tier = make(view, file_storage)
    keys = [block_key(i) for i in range(8)]
    for r in range(8):
        fill(mem, r, r)
    expect = [row(mem, r) for r in range(8)]
    assert all(tier.lookup(k, None) == LookupResult.MISS for k in keys)
    tier.submit_store(JobMetadata(1, keys, list(range(8)), False, None))
    tier.drain_jobs()  # vLLM's reset_cache: blocks until the job ended, then one poll has it
    assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(1, True)]
    assert not tier.has_pending_work()
    mem[:] = bytes(len(mem))  # the primary tier forgets them
    assert all(tier.lookup(k, None) == LookupResult.HIT for k in keys)
    tier.submit_load(TransferJob(2, keys, list(range(16, 24)), True, None))  # later vLLM names
    assert finish(tier, [2]) == {2: True}
    for i in range(8):
        assert row(mem, 16 + i) == expect[i], f"block {i}"
    assert row(mem, 0) == bytes(ROW)  # nothing but the named rows was written
    tier.shutdown()


def test_in_flight_store_is_retry_and_restart_hits(file_storage):
    inner = hicache._hicache.Store('{"backend": "file", "root": "%s"}' % file_storage["root"])
    gated, set_open, waiting = _testing.gated_store(inner)
    mem, view = primary()
    tier = make(view, hicache.Store(gated), workers=2)
    keys = [block_key(100 + i) for i in range(4)]
    for r in range(4):
        fill(mem, r, 100 + r)
    tier.submit_store(JobMetadata(7, keys[:2], [0, 1], False, None))
    tier.submit_store(JobMetadata(8, keys[2:], [2, 3], False, None))  # a store beside it
    assert tier.has_pending_work()
    assert [tier.lookup(k, None) for k in keys] == [LookupResult.RETRY] * 4
    assert tier.get_finished_jobs() == []  # never blocks
    # shutdown with both jobs in flight waits for them and loses neither
    closer = threading.Thread(target=tier.shutdown)
    closer.start()
    closer.join(0.3)
    assert closer.is_alive()
    set_open(True)
    closer.join(30)
    assert not closer.is_alive()
    assert finish(tier, [7, 8]) == {7: True, 8: True}
    mem2, view2 = primary()
    again = make(view2, file_storage)  # a restart on the same file store
    assert [again.lookup(k, None) for k in keys] == [LookupResult.HIT] * 4
    again.submit_load(JobMetadata(1, keys, [5, 6, 7, 8], True, None))
    assert finish(again, [1]) == {1: True}
    assert [row(mem2, r) for r in (5, 6, 7, 8)] == [row(mem, r) for r in range(4)]
    again.shutdown()


def test_namespaces_never_share_records(file_storage):
    mem, view = primary()
    tier = make(view, file_storage)
    fill(mem, 0, 1)
    tier.submit_store(JobMetadata(1, [block_key(1)], [0], False, None))
    assert finish(tier, [1]) == {1: True}
    other_tp = make(primary()[1], file_storage, namespace=dict(NS, tp_size=4))
    tenant = make(primary()[1], file_storage, namespace=dict(NS, identity="tenant-b"))
    other_group = block_key(1, group=1)
    assert other_tp.lookup(block_key(1), None) == LookupResult.MISS
    assert tenant.lookup(block_key(1), None) == LookupResult.MISS
    assert tier.lookup(other_group, None) == LookupResult.MISS
    for t in (tier, other_tp, tenant):
        t.shutdown()


def test_failed_jobs_are_results_not_exceptions(file_storage):
    mem, view = primary(rows=4)
    tier = make(view, file_storage)
    tier.submit_store(JobMetadata(1, [block_key(1)], [4], False, None))  # past the last row
    tier.submit_load(JobMetadata(2, [block_key(2)], [0], True, None))  # absent
    tier.submit_store(JobMetadata(3, [block_key(3), block_key(4)], [0], False, None))  # 2 vs 1
    mem[:] = b"\x77" * len(mem)
    assert finish(tier, [1, 2, 3]) == {1: False, 2: False, 3: False}
    assert mem == b"\x77" * len(mem)  # no row was written by the failed jobs
    tier.shutdown()
    tier.submit_store(JobMetadata(4, [block_key(5)], [0], False, None))  # after shutdown
    assert finish(tier, [4]) == {4: False}


def test_bad_configuration_is_refused(file_storage):
    _, view = primary()
    with pytest.raises(ValueError, match="lacks 'dtype'"):
        make(view, file_storage, namespace={"model": "m", "block_size": 16})
    with pytest.raises(ValueError, match="colour"):
        make(view, file_storage, namespace=dict(NS, colour="red"))
    with pytest.raises(ValueError, match="2-D"):
        make(memoryview(bytearray(ROW)), file_storage)
    with pytest.raises(TypeError):
        make(view, file_storage, no_such_option=1)


def test_redis_lookups_a_dead_server_and_its_return(redis_server):
    storage = {"backend": "redis", "host": "127.0.0.1", "port": redis_server.port}
    mem, view = primary()
    tier = make(view, storage)
    keys = [block_key(i) for i in range(3)]
    for r in range(3):
        fill(mem, r, 50 + r)
    tier.submit_store(JobMetadata(1, keys[:2], [0, 1], False, None))
    assert finish(tier, [1]) == {1: True}

    def ask(k):  # vLLM asks again next step while the answer is RETRY
        deadline = time.monotonic() + 10
        while (answer := tier.lookup(k, None)) == LookupResult.RETRY:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        return answer

    assert tier.lookup(keys[0], None) == LookupResult.RETRY  # Redis is asked off the thread
    assert [ask(k) for k in keys] == [LookupResult.HIT, LookupResult.HIT, LookupResult.MISS]
    tier.submit_load(JobMetadata(2, keys[:2], [10, 11], True, None))
    assert finish(tier, [2]) == {2: True}
    assert row(mem, 10) == row(mem, 0) and row(mem, 11) == row(mem, 1)
    redis_server.kill()  # a dead server: jobs fail, lookups miss, nothing blocks
    tier.submit_load(JobMetadata(3, keys[:1], [12], True, None))
    assert finish(tier, [3]) == {3: False}
    assert ask(keys[0]) == LookupResult.MISS
    redis_server.restart()  # an empty server on the same port: the tier recovers (each of the
    # store's connections reconnects after its own backoff, so a job may still fail at first)
    deadline = time.monotonic() + 15
    job = 10
    while True:
        tier.submit_store(JobMetadata(job, keys[2:], [2], False, None))
        tier.submit_load(JobMetadata(job + 1, keys[2:], [13], True, None))
        if finish(tier, [job, job + 1]) == {job: True, job + 1: True}:
            break
        assert time.monotonic() < deadline, "the tier never recovered"
        job += 2
        time.sleep(0.05)
    assert row(mem, 13) == row(mem, 2)
    while ask(keys[2]) != LookupResult.HIT:  # an exists on a connection still backing off
        assert time.monotonic() < deadline, "lookups never recovered"  # answers absent
        time.sleep(0.05)
    assert ask(keys[0]) == LookupResult.MISS  # the restarted server is empty
    tier.drain_jobs()
    tier.shutdown()


def test_usage_and_metrics_are_reported(file_storage):
    mem, view = primary()
    tier = make(view, dict(file_storage, capacity_bytes=1 << 30), metrics_port=0)
    for r in range(3):
        fill(mem, r, r)
    tier.submit_store(JobMetadata(1, [block_key(i) for i in range(3)], [0, 1, 2], False, None))
    assert finish(tier, [1]) == {1: True}
    stats = tier.stats()
    assert stats["stored_keys"] == 3 and stats["capacity_bytes"] == 1 << 30
    assert stats["stored_bytes"] >= 3 * ROW
    with urllib.request.urlopen(f"http://127.0.0.1:{tier.metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    assert 'hicache_async_jobs_total{kind="set",outcome="ok"} 1' in text
    assert "hicache_storage_stored_bytes" in text and "hicache_storage_capacity_bytes" in text
    tier.shutdown()


def test_metric_definitions_declare_what_get_stats_reports(file_storage):
    from hicache.vllm import HiCacheTierMetrics as M
    from hicache.vllm import OffloadingCounterMetadata, OffloadingGaugeMetadata
    defs = HiCacheTier.build_metric_definitions({"type": "HiCacheTier", "storage": file_storage})
    gauges = {n for n, d in defs.items() if isinstance(d, OffloadingGaugeMetadata)}
    counters = {n for n, d in defs.items() if isinstance(d, OffloadingCounterMetadata)}
    assert gauges == {M.CAPACITY_BYTES, M.USAGE_BYTES, M.STORED_BLOCKS}  # vLLM's capacity gauge
    assert counters == {M.LOOKUP_HITS, M.LOOKUP_MISSES, M.LOAD_BYTES, M.STORE_BYTES,
                        M.LOAD_FAILURES, M.STORE_FAILURES}
    assert all(d.documentation and d.labelnames == () for d in defs.values())
    assert all(n.startswith("vllm:kv_offload_hicache_") for n in defs)
    # every metric get_stats reports is declared (vLLM refuses an undeclared one)
    mem, view = primary()
    tier = make(view, dict(file_storage, capacity_bytes=1 << 30))
    fill(mem, 0, 1)
    tier.submit_store(JobMetadata(1, [block_key(1)], [0], False, None))
    tier.submit_load(JobMetadata(2, [block_key(2)], [1], True, None))  # absent: fails
    assert finish(tier, [1, 2]) == {1: True, 2: False}
    tier.lookup(block_key(1), None)
    stats = tier.get_stats()
    assert set(stats.gauges) | set(stats.counters) <= set(defs)
    tier.shutdown()


def test_get_stats_reports_capacity_usage_and_resets_counters(file_storage):
    from hicache.vllm import HiCacheTierMetrics as M
    mem, view = primary()
    tier = make(view, dict(file_storage, capacity_bytes=1 << 30))
    first = tier.get_stats()  # an empty store: the gauges, no counter moved
    assert first.gauges == {M.CAPACITY_BYTES: 1 << 30, M.USAGE_BYTES: 0, M.STORED_BLOCKS: 0}
    assert first.counters == {}
    keys = [block_key(i) for i in range(3)]
    assert tier.lookup(keys[0], None) == LookupResult.MISS
    store_rows(tier, mem, keys)
    assert [tier.lookup(k, None) for k in keys] == [LookupResult.HIT] * 3
    tier.submit_load(JobMetadata(2, keys[:2], [10, 11], True, None))
    tier.submit_load(JobMetadata(3, [block_key(9)], [12], True, None))  # absent
    tier.submit_store(JobMetadata(4, [block_key(8)], [99], False, None))  # past the last row
    assert finish(tier, [2, 3, 4]) == {2: True, 3: False, 4: False}
    stats = tier.get_stats()
    assert stats.gauges[M.CAPACITY_BYTES] == 1 << 30
    assert stats.gauges[M.STORED_BLOCKS] == 3
    grown = stats.gauges[M.USAGE_BYTES]  # three rows and their record headers
    assert 3 * ROW < grown <= 3 * (ROW + 320)
    assert stats.counters == {M.LOOKUP_HITS: 3, M.LOOKUP_MISSES: 1, M.STORE_BYTES: 3 * ROW,
                              M.LOAD_BYTES: 2 * ROW, M.LOAD_FAILURES: 1, M.STORE_FAILURES: 1}
    again = tier.get_stats()  # reset: nothing observed since, the gauges as they are
    assert again.counters == {}
    assert again.gauges == stats.gauges
    tier.submit_store(JobMetadata(5, keys[:1], [0], False, None))  # stored already: no bytes
    assert finish(tier, [5]) == {5: True}
    assert tier.get_stats().gauges[M.USAGE_BYTES] == grown
    tier.shutdown()
    assert tier.get_stats().gauges[M.STORED_BLOCKS] == 3  # still answers after shutdown


def test_touch_keeps_a_prefixs_head_and_asks_no_io(tmp_path):
    """vLLM's touch(keys), a request's keys in prefix order: the file store makes them its
    youngest records, the first key youngest, with no I/O (on this thread); a full store then
    evicts another
    prefix's tail. Without the touch, A's tail (a1) would be the oldest record and go."""
    mem, view = primary()
    # Room for four records of a row each, not five.
    tier = make(view, {"backend": "file", "root": str(tmp_path / "tier"), "capacity_bytes": 36000})
    a, b, c = ([block_key(i), block_key(i + 1)] for i in (10, 20, 30))
    store_rows(tier, mem, a, job_id=1)
    store_rows(tier, mem, b, job_id=2)  # oldest to youngest: a1 a0 b1 b0
    before = tier.stats()
    tier.touch(a + [block_key(7)], None)  # a stored prefix and an unknown key: b1 b0 a1 a0
    after = tier.stats()
    assert (after["gets"], after["exists_queries"], after["sets"]) == (
        before["gets"], before["exists_queries"], before["sets"])  # no I/O asked of the store
    assert not tier.has_pending_work()  # nothing submitted
    store_rows(tier, mem, c[:1], job_id=3)  # full: the oldest goes
    assert [tier.lookup(k, None) for k in a + b] == [
        LookupResult.HIT, LookupResult.HIT, LookupResult.HIT, LookupResult.MISS]
    tier.shutdown()
    tier.touch(a, None)  # after shutdown: nothing, no error


def test_touch_on_redis_tells_the_server_off_the_thread(redis_server):
    """On Redis, touch is a server round trip (TOUCH): a worker sends it and vLLM's thread does
    not wait; it reports no job, and the server counts the stored keys as just used."""
    storage = {"backend": "redis", "host": "127.0.0.1", "port": redis_server.port}
    mem, view = primary()
    tier = make(view, storage)
    keys = [block_key(i) for i in range(3)]
    store_rows(tier, mem, keys[:2], job_id=1)
    tier.touch(keys, None)  # two stored, one not
    deadline = time.monotonic() + 10
    while tier.stats()["touched"] < 2:
        assert time.monotonic() < deadline, tier.stats()
        time.sleep(0.005)
    assert tier.stats()["touched"] == 2 and tier.stats()["touch_errors"] == 0
    assert tier.get_finished_jobs() == []  # a touch is no job of vLLM's
    assert not tier.has_pending_work()
    tier.shutdown()
    tier.touch(keys, None)  # after shutdown: dropped, no error


def test_event_fd_is_readable_until_finished_jobs_are_taken(file_storage):
    import select
    mem, view = primary()
    tier = make(view, file_storage)
    fd = tier.event_fd()
    assert select.select([fd], [], [], 0)[0] == []
    tier.submit_store(JobMetadata(1, [block_key(1)], [0], False, None))
    assert select.select([fd], [], [], 10)[0] == [fd]  # the job ended
    assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(1, True)]
    assert select.select([fd], [], [], 0)[0] == []
    tier.shutdown()
    with pytest.raises(RuntimeError, match="after shutdown"):
        tier.event_fd()


def test_rows_move_by_number_and_bad_rows_are_refused_before_anything_is_queued(file_storage):
    """The tier's jobs name rows of the bound primary region (AsyncStore.bind_rows /
    submit_rows_*): bytes stored from one row come back into another; a row outside the
    region, a count mismatch, rows with no region, a second bind and a region that is not whole
    rows are refused with the bad value named, and nothing is queued."""
    import json
    import select

    from hicache import _hicache

    mem, view = primary(8)
    for r in range(4):
        fill(mem, r, 100 + r)
    store = _hicache.AsyncStore(json.dumps(file_storage), prefix="rows", workers=2)
    unbound = _hicache.AsyncStore(json.dumps(file_storage), prefix="rows", workers=1)
    fd = store.event_fd()

    def wait(fid):
        while True:
            select.select([fd], [], [], 10)
            done = {c[0]: c for c in store.drain_completions()}
            if fid in done:
                return done[fid]

    with pytest.raises(ValueError, match="no region bound"):
        unbound.submit_rows_get(keys=["a"], rows=[0])
    unbound.close()
    with pytest.raises(ValueError, match="not a whole number of 3000-byte rows"):
        store.bind_rows(view.cast("B"), 3000)
    store.bind_rows(view.cast("B"), ROW)
    with pytest.raises(ValueError, match="bound already"):
        store.bind_rows(view.cast("B"), ROW)
    cases = [
        (lambda: store.submit_rows_set(keys=["a", "b"], rows=[0, 8]), "row 1 is 8, outside"),
        (lambda: store.submit_rows_get(keys=["a"], rows=[-1]), "row 0 is -1, outside"),
        (lambda: store.submit_rows_get(keys=["a", "b"], rows=[0]), "2 keys but 1 rows"),
        (lambda: store.submit_rows_set(keys=["a", ""], rows=[0, 1]), "key 1 is empty"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
    assert store.pending == 0 and store.drain_completions() == []

    keys = [f"k{r}" for r in range(4)]
    fid, ok, error, per_key = wait(store.submit_rows_set(keys=keys, rows=[0, 1, 2, 3]))
    assert ok and all(per_key), error
    fid, ok, error, per_key = wait(store.submit_rows_get(keys=keys[::-1], rows=[4, 5, 6, 7]))
    assert ok and all(per_key), error
    for i, r in enumerate([3, 2, 1, 0]):
        assert row(mem, 4 + i) == row(mem, r)  # key k3 into row 4, ...
    store.close()
