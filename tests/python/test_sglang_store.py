"""hicache as SGLang's L3 (HiCacheStore), exercised the way SGLang's controller calls it, over a
host pool built with SGLang's shapes and attributes (conftest.HostPool). Every byte is checked
through the pool's own tensor."""
import gc
import hashlib
import importlib
import os
import pathlib
import re
import struct
import subprocess
import threading
import sys
import types

import pytest

torch = pytest.importorskip("torch", reason="python3-torch is not installed")

from hicache.sglang import HiCacheStore

LAYOUTS = ["layer_first", "page_first", "page_first_direct"]


def sglang_keys(tokens, page_size, prior=None):
    """SGLang's page keys: chained SHA-256 hex over little-endian uint32 token ids."""
    keys, prev = [], prior
    for i in range(0, len(tokens) - page_size + 1, page_size):
        h = hashlib.sha256()
        if prev is not None:
            h.update(bytes.fromhex(prev))
        h.update(struct.pack(f"<{page_size}I", *tokens[i:i + page_size]))
        prev = h.hexdigest()
        keys.append(prev)
    return keys


def storage_config(root, tp_rank=0, tp_size=1, mla=False, layout="page_first", **extra):
    return types.SimpleNamespace(
        tp_rank=tp_rank, tp_size=tp_size, is_mla_model=mla,
        is_page_first_layout=layout != "layer_first", model_name="test-model",
        extra_config={"backend_name": "hicache", "module_path": "hicache.sglang",
                      "class_name": "HiCacheStore", "interface_v1": 1,
                      "storage": {"backend": "file", "root": str(root)}, **extra})


def same(a, b):
    """Byte equality (random bits hold NaNs, which torch.equal calls unequal)."""
    return a.numel() == b.numel() and torch.equal(a.view(torch.int16), b.view(torch.int16))


def make_store(pool, root, storage=None, **kw):
    cfg = storage_config(root, mla=pool.mla, layout=pool.layout, **kw)
    if storage is not None:
        cfg.extra_config["storage"] = storage
    store = HiCacheStore(cfg, None)
    store.register_mem_pool_host(pool)
    return store


def indices(pages, page_size):
    return torch.tensor([p * page_size + t for p in pages for t in range(page_size)],
                        dtype=torch.int64)


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_v1_round_trips_every_layout_byte_for_byte_into_the_engines_buffer(
        tmp_path, host_pool, layout, mla):
    src = host_pool(layout, mla=mla)
    src.fill_random(1)
    keys = sglang_keys(list(range(100, 100 + 6 * src.page_size)), src.page_size)
    store = make_store(src, tmp_path)
    written = [0, 3, 5, 7, 8, 15]  # host pages backed up
    assert store.batch_set_v1(keys, indices(written, src.page_size)) == [True] * 6
    # Another engine (another pool, same geometry) prefetches into other slots.
    dst = host_pool(layout, mla=mla)
    reader = make_store(dst, tmp_path)
    assert reader.batch_exists(keys) == 6
    into = [2, 4, 6, 9, 11, 1]
    assert reader.batch_get_v1(keys, indices(into, dst.page_size)) == [True] * 6
    for w, r in zip(written, into):
        assert dst.page_bytes(r * dst.page_size) == src.page_bytes(w * src.page_size)
    # Pages that were not read stay zero.
    assert dst.page_bytes(0) == bytes(len(dst.page_bytes(0)))


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_classic_flat_pages_and_v1_share_records(tmp_path, host_pool, layout, mla):
    pool = host_pool(layout, mla=mla)
    pool.fill_random(2)
    store = make_store(pool, tmp_path)
    keys = sglang_keys(list(range(40)), pool.page_size)[:3]
    # The classic copying path: flat data pages in, flat pages out.
    values = [pool.get_data_page(p * pool.page_size) for p in (1, 2, 3)]
    assert store.batch_set(keys, values)
    got = store.batch_get(keys)
    assert all(g is not None and same(g, v) for g, v in zip(got, values))
    targets = [pool.get_dummy_flat_data_page() for _ in keys]
    assert store.batch_get(keys, targets) == targets
    assert store.get(keys[0]) is not None and store.exists(keys[2])
    assert store.get("0" * 64) is None and not store.exists("0" * 64)
    # ... and the zero-copy path reads the same records into pool pages.
    fresh = host_pool(layout, mla=mla)
    reader = make_store(fresh, tmp_path)
    assert reader.batch_get_v1(keys, indices([4, 5, 6], pool.page_size)) == [True] * 3
    for i, p in enumerate((4, 5, 6)):
        assert same(fresh.get_data_page(p * pool.page_size), values[i])
    assert store.set(sglang_keys([7] * pool.page_size, pool.page_size)[0], values[0])


def test_batch_exists_counts_consecutive_hits_from_the_start(tmp_path, host_pool):
    pool = host_pool("page_first")
    store = make_store(pool, tmp_path)
    keys = sglang_keys(list(range(5 * pool.page_size)), pool.page_size)
    assert store.batch_set_v1([keys[0], keys[1], keys[3]], indices([0, 1, 2], 4)) == [True] * 3
    assert store.batch_exists(keys) == 2
    assert store.batch_exists(keys[3:]) == 1
    assert store.batch_exists([]) == 0


def test_backup_thread_and_prefetch_thread_as_sglangs_controller_runs_them(tmp_path, host_pool):
    """One store, one host pool (as on one SGLang rank): backups of pages 0..383 in batches of
    128 from one thread while another prefetches what is stored so far (batch_exists, then
    batch_get_v1 of the hit) into pages 384..767, as SGLang's controller does."""
    P, pages = 4, 384
    pool = host_pool("page_first_direct", layers=2, heads=2, head_dim=8, page_size=P,
                     pages=2 * pages)
    pool.fill_random(3)
    pool.kv_buffer[:, pages:].zero_()
    store = make_store(pool, tmp_path)
    keys = sglang_keys(list(range(pages * P)), P)
    errors, done = [], threading.Event()

    def backup():
        try:
            for b in range(0, pages, 128):
                ok = store.batch_set_v1(keys[b:b + 128], indices(range(b, b + 128), P))
                assert ok == [True] * 128
        except Exception as e:  # noqa: BLE001
            errors.append(e)
        finally:
            done.set()

    def prefetch():
        try:
            while True:
                finished = done.is_set()
                hit = store.batch_exists(keys)
                if hit:
                    ok = store.batch_get_v1(keys[:hit], indices(range(pages, pages + hit), P))
                    assert ok == [True] * hit
                if finished:
                    assert hit == pages
                    return
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=backup), threading.Thread(target=prefetch)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    for p in range(pages):
        assert pool.page_bytes((pages + p) * P) == pool.page_bytes(p * P), p


def test_mla_rank_zero_writes_and_every_rank_reads(tmp_path, host_pool):
    rank0 = host_pool("page_first", mla=True)
    rank0.fill_random(4)
    keys = sglang_keys(list(range(12)), 4)
    w = make_store(rank0, tmp_path, tp_rank=0, tp_size=2)
    assert w.batch_set_v1(keys, indices([0, 1, 2], 4)) == [True] * 3
    rank1 = host_pool("page_first", mla=True)
    r = make_store(rank1, tmp_path, tp_rank=1, tp_size=2)
    assert r.batch_get_v1(keys, indices([3, 4, 5], 4)) == [True] * 3
    assert rank1.page_bytes(12) == rank0.page_bytes(0)


def test_mha_ranks_and_models_never_share_a_record(tmp_path, host_pool):
    pool = host_pool("page_first")
    pool.fill_random(5)
    keys = sglang_keys(list(range(8)), 4)
    assert make_store(pool, tmp_path, tp_rank=0, tp_size=2).batch_set_v1(
        keys, indices([0, 1], 4)) == [True, True]
    assert make_store(host_pool("page_first"), tmp_path, tp_rank=1, tp_size=2).batch_exists(keys) == 0
    other = HiCacheStore(storage_config(tmp_path, tp_rank=0, tp_size=2), None)
    other.model_name = "another-model"
    other.register_mem_pool_host(host_pool("page_first"))
    assert other.batch_exists(keys) == 0
    pp = HiCacheStore(types.SimpleNamespace(**vars(storage_config(tmp_path, tp_rank=0, tp_size=2)),
                                            pp_rank=1, pp_size=2), None)
    pp.register_mem_pool_host(host_pool("page_first"))
    assert pp.batch_exists(keys) == 0


def test_another_fingerprint_misses_the_pages_written_under_the_first(tmp_path, host_pool):
    """model_fingerprint is in every key's namespace: a store of another revision (or of none)
    misses every page the first wrote, under the same keys in the same root; the same revision
    reads them byte for byte."""
    src = host_pool("page_first")
    src.fill_random(11)
    keys = sglang_keys(list(range(3 * src.page_size)), src.page_size)
    writer = make_store(src, tmp_path, model_fingerprint="rev-1")
    assert writer.batch_set_v1(keys, indices([0, 1, 2], src.page_size)) == [True] * 3
    for other in ({"model_fingerprint": "rev-2"}, {}):
        reader = make_store(host_pool("page_first"), tmp_path, **other)
        assert reader.batch_exists(keys) == 0, other
        assert reader.batch_get_v1(keys, indices([0, 1, 2], src.page_size)) == [False] * 3
    dst = host_pool("page_first")
    same_revision = make_store(dst, tmp_path, model_fingerprint="rev-1")
    assert same_revision.batch_exists(keys) == 3
    assert same_revision.batch_get_v1(keys, indices([3, 4, 5], dst.page_size)) == [True] * 3
    for i in range(3):
        assert dst.page_bytes((3 + i) * dst.page_size) == src.page_bytes(i * src.page_size)


SGLANG_RADIX_KEYS = {"prefetch_threshold": 256, "prefetch_timeout_base": 1,
                     "prefetch_timeout_per_ki_token": 0.25,
                     "hicache_storage_pass_prefix_keys": True}


def test_sglangs_radix_keys_are_accepted_and_left_to_sglang(tmp_path, host_pool):
    """docs/sglang.md: the radix cache's keys are SGLang's (earlier releases pass them on in the
    extra config): the store accepts them and nothing of it changes, so a store given them and
    one without them share every record."""
    from hicache.sglang.store import _SGLANG_KEYS
    assert set(SGLANG_RADIX_KEYS) <= _SGLANG_KEYS
    src = host_pool("page_first")
    src.fill_random(12)
    keys = sglang_keys(list(range(2 * src.page_size)), src.page_size)
    with_radix = make_store(src, tmp_path, **SGLANG_RADIX_KEYS)
    assert with_radix.batch_set_v1(keys, indices([0, 1], src.page_size)) == [True] * 2
    dst = host_pool("page_first")
    plain = make_store(dst, tmp_path)
    assert plain.batch_get_v1(keys, indices([2, 3], dst.page_size)) == [True] * 2
    assert dst.page_bytes(2 * dst.page_size) == src.page_bytes(0)
    assert dst.page_bytes(3 * dst.page_size) == src.page_bytes(src.page_size)
    assert with_radix.batch_exists(keys) == plain.batch_exists(keys) == 2


def test_the_docs_table_of_extra_config_keys_is_the_stores():
    """docs/sglang.md's HiCacheStore table names every key the store reads, and no other."""
    from hicache.sglang.store import _OWN_KEYS, _SGLANG_KEYS
    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "sglang.md").read_text()
    rows = doc_table(doc, "| extra config key | `HiCacheStore` |")
    named = {k for first, _ in rows for k in re.findall(r"`([a-z_0-9]+)`", first)}
    assert named == _OWN_KEYS | _SGLANG_KEYS


def doc_table(text, header):
    """The rows (first cell, second cell) of the Markdown table under `header`."""
    lines = text.splitlines()
    start = lines.index(header) + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        first, second = [c.strip() for c in line.strip().strip("|").split(" | ", 1)]
        rows.append((first, second))
    return rows


def test_a_corrupt_or_missing_record_is_false_and_the_rest_is_served(tmp_path, host_pool):
    pool = host_pool("page_first")
    pool.fill_random(6)
    store = make_store(pool, tmp_path)
    keys = sglang_keys(list(range(16)), 4)
    assert store.batch_set_v1(keys, indices([0, 1, 2, 3], 4)) == [True] * 4
    victim = [f for f in os.listdir(tmp_path) if keys[1] in f and f.endswith("-v")]
    assert len(victim) == 1
    with open(tmp_path / victim[0], "r+b") as f:  # flip one payload byte
        f.seek(-3, os.SEEK_END)
        b = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))
    os.remove(tmp_path / [f for f in os.listdir(tmp_path) if keys[2] in f and f.endswith("-k")][0])
    dst = host_pool("page_first")
    reader = make_store(dst, tmp_path)
    assert reader.batch_get_v1(keys, indices([4, 5, 6, 7], 4)) == [True, False, False, True]
    assert dst.page_bytes(16) == pool.page_bytes(0)
    assert dst.page_bytes(28) == pool.page_bytes(12)
    stats = reader.get_stats()
    assert stats["bad_records"] == 1 and stats["get_misses"] == 2
    assert reader.batch_exists(keys) == 1  # the corrupt record was dropped


def test_a_full_disk_gives_false_for_the_pages_that_did_not_fit(tmp_path, host_pool):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a 1 MiB tmpfs here (needs root): the full-disk case is not run")
    try:
        pool = host_pool("page_first", layers=4, heads=4, head_dim=64, page_size=16, pages=24)
        pool.fill_random(7)  # 64 KiB per record, two records per page: 24 pages = 3 MiB
        # A capacity larger than the disk (left to follow the filesystem, the store would evict
        # instead): the disk fills within one batch, whose own records are never evicted for it.
        store = make_store(pool, mnt, storage={"backend": "file", "root": str(mnt),
                                               "capacity_bytes": 64 << 20})
        keys = sglang_keys(list(range(24 * 16)), 16)
        ok = store.batch_set_v1(keys, indices(range(24), 16))
        assert True in ok and False in ok
        assert store.get_stats()["set_errors"] > 0
        dst = host_pool("page_first", layers=4, heads=4, head_dim=64, page_size=16, pages=24)
        reader = make_store(dst, mnt, storage={"backend": "file", "root": str(mnt),
                                               "capacity_bytes": 64 << 20})
        got = reader.batch_get_v1(keys, indices(range(24), 16))
        for p, (wrote, read) in enumerate(zip(ok, got)):
            assert read == wrote
            if read:
                assert dst.page_bytes(p * 16) == pool.page_bytes(p * 16)
    finally:
        # The stores hold the directory open (and a thread that empties its trash): close them
        # before the unmount.
        store = reader = None
        gc.collect()
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_killed_redis_gives_false_never_an_exception(host_pool, redis_server):
    pool = host_pool("page_first")
    pool.fill_random(8)
    cfg = storage_config("unused")
    cfg.extra_config["storage"] = {"backend": "redis", "host": "127.0.0.1",
                                   "port": redis_server.port, "timeout_ms": 1000,
                                   "connect_timeout_ms": 500}
    store = HiCacheStore(cfg, None)
    store.register_mem_pool_host(pool)
    keys = sglang_keys(list(range(16)), 4)
    assert store.batch_set_v1(keys, indices([0, 1, 2, 3], 4)) == [True] * 4
    dst = host_pool("page_first")
    assert store.batch_exists(keys) == 4
    redis_server.kill()
    assert store.batch_get_v1(keys, indices([4, 5, 6, 7], 4)) == [False] * 4
    assert store.batch_set_v1(keys[:1], indices([8], 4)) == [False]
    assert store.batch_exists(keys) == 0
    assert dst.page_bytes(16) == bytes(len(dst.page_bytes(16)))


def test_sglangs_dynamic_loader_constructs_it_from_the_extra_config(tmp_path, host_pool):
    cfg = storage_config(tmp_path)
    extra = cfg.extra_config
    cls = getattr(importlib.import_module(extra["module_path"]), extra["class_name"])
    store = cls(cfg, {})
    store.register_mem_pool_host(host_pool("layer_first"))
    assert store.batch_exists(sglang_keys(list(range(4)), 4)) == 0


@pytest.mark.parametrize("flag", [0, 1, True, False, None])
def test_interface_v1_selects_sglangs_calls_and_both_are_served(tmp_path, host_pool, flag):
    """SGLang reads interface_v1 to pick the zero-copy methods or the flat-page ones; the store
    serves both on the same records whatever the flag (None: the key left out), and refuses a
    value SGLang would not read as meant."""
    def open_store(pool):
        cfg = storage_config(tmp_path, interface_v1=flag)
        if flag is None:
            del cfg.extra_config["interface_v1"]
        store = HiCacheStore(cfg, None)
        store.register_mem_pool_host(pool)
        return store
    src = host_pool("page_first")
    src.fill_random(3)
    store = open_store(src)
    keys = sglang_keys(list(range(2 * src.page_size)), src.page_size)
    assert store.batch_set_v1(keys[:1], indices([1], src.page_size)) == [True]
    assert store.batch_set(keys[1:], [src.get_data_page(2 * src.page_size)])
    got = store.batch_get(keys[:1])[0]
    assert same(got, src.get_data_page(src.page_size))
    dst = host_pool("page_first")
    assert store.batch_exists(keys) == 2
    reader = open_store(dst)
    assert reader.batch_get_v1(keys[1:], indices([5], dst.page_size)) == [True]
    assert dst.page_bytes(5 * dst.page_size) == src.page_bytes(2 * src.page_size)
    for bad in ("1", 2, -1, "yes"):
        with pytest.raises(ValueError, match=f"'interface_v1' is {re.escape(repr(bad))}"):
            HiCacheStore(storage_config(tmp_path, interface_v1=bad), None)


def test_bad_settings_are_clear_errors(tmp_path, host_pool):
    with pytest.raises(ValueError, match="unknown extra_config key.*'?storag'?"):
        HiCacheStore(storage_config(tmp_path, storag={}), None)
    with pytest.raises(ValueError, match="valid backends"):
        HiCacheStore(types.SimpleNamespace(extra_config={"storage": {"backend": "s3"}}), None)
    # A Redis nobody answers for: an error at start naming it (SGLang does not start on it).
    with pytest.raises(OSError, match="127.0.0.1:1 does not answer at start"):
        HiCacheStore(types.SimpleNamespace(extra_config={"storage": {
            "backend": "redis", "port": 1, "connect_timeout_ms": 200}}), None)
    store = HiCacheStore(storage_config(tmp_path), None)
    with pytest.raises(RuntimeError, match="register_mem_pool_host"):
        store.batch_exists(["a" * 64])
    pool = host_pool("page_first")
    pool.layout = "sideways"
    with pytest.raises(ValueError, match="layout 'sideways'"):
        store.register_mem_pool_host(pool)
    store.register_mem_pool_host(host_pool("page_first"))
    with pytest.raises(ValueError, match="host slot 2 does not start a page"):
        store.batch_set_v1(["a" * 64], torch.tensor([2, 3, 4, 5]))
    with pytest.raises(ValueError, match="2 keys need 8 host indices"):
        store.batch_get_v1(["a" * 64, "b" * 64], torch.tensor([0, 1, 2, 3]))
    assert store.get_stats()["sets"] == 0


def test_it_subclasses_sglangs_interface_when_sglang_is_importable(tmp_path):
    """With SGLang importable (a stand-in module of SGLang's path and class name here, since
    SGLang is not installed), HiCacheStore is a HiCacheStorage; without it, a plain class."""
    pkg = tmp_path / "sglang" / "srt" / "mem_cache"
    pkg.mkdir(parents=True)
    for d in (tmp_path / "sglang", tmp_path / "sglang" / "srt", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "hicache_storage.py").write_text(
        "from abc import ABC\nclass HiCacheStorage(ABC):\n    pass\n")
    code = ("import hicache.sglang as s, sys\n"
            "from sglang.srt.mem_cache.hicache_storage import HiCacheStorage\n"
            "sys.exit(0 if issubclass(s.HiCacheStore, HiCacheStorage) else 3)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ["PYTHONPATH"]]))
    assert subprocess.run([sys.executable, "-c", code], env=env).returncode == 0
    import importlib.util

    import hicache.sglang
    if importlib.util.find_spec("sglang") is None:  # this process: no SGLang, a plain class
        assert hicache.sglang.store._Base is object
