"""SGLang's HiCacheStorage v2 (hybrid models) against HiCacheStore, written from SGLang's
interface as described in the project's reference notes (section 1: PoolTransfer, hit policies,
the restorable prefix, the TP intersection). A stand-in for SGLang's hybrid controller calls the
store in SGLang's order over host pools with SGLang's hybrid shapes (a KV anchor, a Mamba state
pool with one 68 KiB entry per checkpoint, a sliding-window KV pool, a DSA indexer pool reusing
the KV's indices), all torch CPU tensors. Every byte is checked through the pools' tensors."""
import os
import types

import pytest

torch = pytest.importorskip("torch", reason="python3-torch is not installed")

from conftest import HostPool  # noqa: E402
from hicache.sglang import (HiCacheStore, PoolHitPolicy, PoolName, PoolTransfer,  # noqa: E402
                            agree_restorable)
from test_sglang_store import indices, sglang_keys  # noqa: E402

PAGE = 4  # tokens per KV page
PAGES = 16  # KV pages of each host pool
ALL, TRAIL = PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES


# --- host pools with SGLang's hybrid shapes ---------------------------------------------------

class PageFirstPool:
    """A sidecar host pool as SGLang's hybrid group hands it to a backend: `layout`,
    `page_size`, its host tensors (get_hybrid_pool_buffer() when `hybrid`, else kv_buffer) and
    get_page_buffer_meta(indices) -> (addresses, sizes), the ranges of each page in a fixed
    order. Each buffer's first dimension is the slot (page_first)."""

    def __init__(self, buffers, page_size, hybrid, layout="page_first"):
        self.layout, self.page_size, self._list = layout, page_size, buffers
        self.size = buffers[0].shape[0]
        if hybrid:
            self.get_hybrid_pool_buffer = lambda: list(self._list)
            self.kv_buffer = list(buffers)
        else:
            self.kv_buffer = buffers[0]

    def _row(self, buf):
        return buf[0].numel() * buf.element_size()

    def get_page_buffer_meta(self, host_indices):
        idx = host_indices.tolist()
        assert len(idx) % self.page_size == 0
        ptrs, sizes = [], []
        for i in range(0, len(idx), self.page_size):
            for buf in self._list:
                ptrs.append(buf.data_ptr() + idx[i] * self._row(buf))
                sizes.append(self.page_size * self._row(buf))
        return ptrs, sizes

    def fill_random(self, seed):
        g = torch.Generator().manual_seed(seed)
        for buf in self._list:
            raw = torch.randint(0, 256, (buf.numel() * buf.element_size(),), generator=g,
                                dtype=torch.uint8)
            buf.view(-1).view(torch.uint8).copy_(raw)

    def fill(self, value):
        for buf in self._list:
            buf.view(-1).view(torch.uint8).fill_(value)

    def page_bytes(self, slot):
        """The page starting at `slot`, every buffer's part in order, as bytes."""
        return b"".join(bytes(buf[slot:slot + self.page_size].contiguous().view(-1)
                              .view(torch.uint8).numpy().tobytes()) for buf in self._list)


def mamba_pool(slots=8, layers=2, state=(8, 32, 32)):
    """SGLang's MambaPoolHost in page_first: page_size 1; a float32 temporal state per layer
    (64 KiB per entry with the default shape) and a bf16 conv state (4 KiB)."""
    temporal = torch.zeros((slots, layers, 1) + state, dtype=torch.float32)
    conv = torch.zeros((slots, layers, 1, 16, 64), dtype=torch.bfloat16)
    return PageFirstPool([temporal, conv], 1, hybrid=True)


class SwaPool(PageFirstPool):
    """A sliding-window KV host pool: MHA page_first, kv_buffer (2, slots, layers, H, D); each
    page is its K range then its V range."""

    def __init__(self, layers=2, heads=2, head_dim=16):
        buf = torch.zeros((2, PAGES * PAGE, layers, heads, head_dim), dtype=torch.bfloat16)
        super().__init__([buf[0], buf[1]], PAGE, hybrid=False)
        self.kv_buffer = buf  # one tensor, K half then V half


def indexer_pool():
    """A DSA indexer host pool: page_first (slots, layers, 1, D) fp8 keys as uint8, one range
    per page, its slots the KV's (indices_from_pool="kv")."""
    return PageFirstPool([torch.zeros((PAGES * PAGE, 2, 1, 132), dtype=torch.uint8)], PAGE,
                         hybrid=False)


def kv_pool(mla=False):
    return HostPool("page_first", mla=mla, layers=2, heads=2, head_dim=8, page_size=PAGE,
                    pages=PAGES)


def hybrid_pools(seed=None, mla=False):
    pools = {"kv": kv_pool(mla), "mamba": mamba_pool(), "swa": SwaPool(), "indexer": indexer_pool()}
    if seed is not None:
        pools["kv"].fill_random(seed)
        for i, name in enumerate(("mamba", "swa", "indexer")):
            pools[name].fill_random(seed * 10 + i)
    return pools


def config(root, model="test-model", tp_rank=0, tp_size=1, mla=False):
    return types.SimpleNamespace(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, is_mla_model=mla,
        is_page_first_layout=True, model_name=model, enable_storage_metrics=False,
        extra_config={"backend_name": "hicache", "module_path": "hicache.sglang",
                      "class_name": "HiCacheStore", "interface_v1": 1,
                      "storage": {"backend": "file", "root": str(root)}})


# --- a stand-in for SGLang's hybrid controller ------------------------------------------------

POLICY = {"mamba": (TRAIL, 1), "swa": (TRAIL, 2), "indexer": (ALL, None)}


class HybridController:
    """The store's side of SGLang's hybrid cache controller: construction and registration at
    attach; backup = batch_set_v2 for the sidecars, then the KV in 128-page batches
    (batch_set_v1); prefetch = batch_exists_v2 over the whole chain, then per KV batch
    batch_get_v1 plus batch_get_v2 for the KV-derived indexer on the same host indices, then,
    if every batch fully succeeded, the trailing pools once with keys re-aligned to the last N
    pages of the hit."""

    BATCH = 128

    def __init__(self, root, pools, **cfg):
        self.pools = pools
        self.store = HiCacheStore(config(root, **cfg), {})
        self.store.register_mem_pool_host(pools["kv"])
        for name, pool in pools.items():
            self.store.register_mem_host_pool_v2(pool, PoolName(name))

    def backup(self, keys, mamba_at=(), swa_pages=(), mamba_slot=lambda i: i):
        """Stores pages 0..len(keys)-1: KV and indexer at slot i * PAGE, SWA pages
        `swa_pages`, a Mamba checkpoint after each page of `mamba_at` (slot mamba_slot(i))."""
        swa = list(swa_pages)
        mamba = list(mamba_at)
        side = [
            PoolTransfer(name=PoolName.MAMBA, keys=[keys[i] for i in mamba],
                         host_indices=torch.tensor([mamba_slot(i) for i in mamba],
                                                   dtype=torch.int64), hit_policy=TRAIL),
            PoolTransfer(name=PoolName.SWA, keys=[keys[i] for i in swa],
                         host_indices=indices(swa, PAGE), hit_policy=TRAIL),
            PoolTransfer(name=PoolName.INDEXER, keys=list(keys),
                         host_indices=indices(range(len(keys)), PAGE), hit_policy=ALL,
                         indices_from_pool=PoolName.KV),
        ]
        res = self.store.batch_set_v2(side)
        assert res == {"mamba": [True] * len(mamba), "swa": [True] * len(swa),
                       "indexer": [True] * len(keys)}
        for b in range(0, len(keys), self.BATCH):
            ks = keys[b:b + self.BATCH]
            assert self.store.batch_set_v1(ks, indices(range(b, b + len(ks)), PAGE)) == \
                [True] * len(ks)

    def query(self, keys):
        return self.store.batch_exists_v2(keys, [
            PoolTransfer(name=PoolName(n), keys=keys[-w:] if w else list(keys), hit_policy=p)
            for n, (p, w) in POLICY.items()])

    def prefetch(self, keys, dst_slot_mamba=7, swa_base=8):
        """Reads the restorable prefix into this controller's pools: KV and indexer at slot
        i * PAGE, SWA page i at slot (swa_base + i % 2) * PAGE... (the last N pages), the Mamba
        state at dst_slot_mamba. Returns (hit, {pool: results})."""
        hit = self.query(keys).kv_hit_pages
        got = {"kv": [], "indexer": []}
        for b in range(0, hit, self.BATCH):
            ks = keys[b:min(hit, b + self.BATCH)]
            hi = indices(range(b, b + len(ks)), PAGE)
            got["kv"] += self.store.batch_get_v1(ks, hi)
            got["indexer"] += self.store.batch_get_v2([PoolTransfer(
                name=PoolName.INDEXER, keys=ks, host_indices=hi, hit_policy=ALL,
                indices_from_pool=PoolName.KV)])["indexer"]
        if hit and all(got["kv"]) and all(got["indexer"]):
            swa_keys = keys[max(0, hit - 2):hit]
            res = self.store.batch_get_v2([
                PoolTransfer(name=PoolName.MAMBA, keys=keys[hit - 1:hit], hit_policy=TRAIL,
                             host_indices=torch.tensor([dst_slot_mamba], dtype=torch.int64)),
                PoolTransfer(name=PoolName.SWA, keys=swa_keys, hit_policy=TRAIL,
                             host_indices=indices(range(swa_base, swa_base + len(swa_keys)),
                                                  PAGE))])
            got.update(res)
        return hit, got


def chain(pages, start=0):
    return sglang_keys(list(range(start, start + pages * PAGE)), PAGE)


def record_file(root, key, pool):
    names = [f for f in os.listdir(root) if key in f and f".pool-{pool}." in f]
    assert len(names) == 1, names
    return root / names[0]


# --- the contract -----------------------------------------------------------------------------

def test_backup_then_prefetch_restores_every_pools_bytes(tmp_path):
    src = HybridController(tmp_path, hybrid_pools(seed=1))
    keys = chain(8)
    # two nodes of 4 pages: a Mamba checkpoint and the SWA window at the end of each
    src.backup(keys, mamba_at=[3, 7], swa_pages=[2, 3, 6, 7])
    dst = HybridController(tmp_path, hybrid_pools())  # another engine, empty pools
    q = dst.query(keys)
    assert q.kv_hit_pages == 8
    assert q.restorable_prefix_pages == [4, 8]
    assert dict(q.extra_pool_hit_pages) == {"kv": 8, "indexer": 8, "swa": 8, "mamba": 8}
    hit, got = dst.prefetch(keys)
    assert hit == 8 and got == {"kv": [True] * 8, "indexer": [True] * 8, "mamba": [True],
                                "swa": [True, True]}
    s, d = src.pools, dst.pools
    for i in range(8):
        assert d["kv"].page_bytes(i * PAGE) == s["kv"].page_bytes(i * PAGE)
        assert d["indexer"].page_bytes(i * PAGE) == s["indexer"].page_bytes(i * PAGE)
    assert d["mamba"].page_bytes(7) == s["mamba"].page_bytes(7)  # the state after page 8
    assert len(d["mamba"].page_bytes(7)) == 68 << 10
    assert d["swa"].page_bytes(8 * PAGE) == s["swa"].page_bytes(6 * PAGE)
    assert d["swa"].page_bytes(9 * PAGE) == s["swa"].page_bytes(7 * PAGE)


def test_a_shorter_prefix_reads_the_checkpoint_that_ends_it(tmp_path):
    """A request that shares the first node only: the state after page 4, not after page 8."""
    src = HybridController(tmp_path, hybrid_pools(seed=2))
    keys = chain(8)
    src.backup(keys, mamba_at=[3, 7], swa_pages=[2, 3, 6, 7])
    dst = HybridController(tmp_path, hybrid_pools())
    other = keys[:4] + chain(3, start=1000)  # diverges after page 4 (its own hashes)
    hit, got = dst.prefetch(other)
    assert hit == 4 and got["mamba"] == [True]
    assert dst.pools["mamba"].page_bytes(7) == src.pools["mamba"].page_bytes(3)


def test_holes_in_trailing_checkpoints_intersect_39147(tmp_path):
    """SGLang #39147: SWA legal at {1, 3}, Mamba at {1, 2}. The minimum of each pool's largest
    endpoint (2) is a prefix SWA cannot restore; the intersection gives 1."""
    c = HybridController(tmp_path, hybrid_pools(seed=3))
    keys = chain(3)
    c.backup(keys, mamba_at=[0, 1], swa_pages=[0, 2])
    q = c.store.batch_exists_v2(keys, [
        PoolTransfer(name=PoolName.SWA, keys=keys[-1:], hit_policy=TRAIL),  # window 1
        PoolTransfer(name=PoolName.MAMBA, keys=keys[-1:], hit_policy=TRAIL)])
    assert q.restorable_prefix_pages == [1]
    assert q.kv_hit_pages == 1
    assert dict(q.extra_pool_hit_pages) == {"kv": 3, "swa": 3, "mamba": 2}


def test_a_window_of_two_needs_both_pages_and_the_answer_is_in_every_set(tmp_path):
    """SWA window 2 with pages {0, 1, 3, 4}: legal {1, 2, 5}; Mamba checkpoints after pages 1
    and 4: legal {1, 4}. Restorable: [1] (min of maxima would say 4)."""
    c = HybridController(tmp_path, hybrid_pools(seed=4))
    keys = chain(5)
    c.backup(keys, mamba_at=[0, 3], swa_pages=[0, 1, 3, 4])
    q = c.query(keys)
    assert q.restorable_prefix_pages == [1]
    assert q.kv_hit_pages == 1
    assert dict(q.extra_pool_hit_pages) == {"kv": 5, "indexer": 5, "swa": 5, "mamba": 4}


def test_the_kv_hit_bounds_every_pool_and_an_all_pages_gap_cuts_the_prefix(tmp_path):
    c = HybridController(tmp_path, hybrid_pools(seed=5))
    keys = chain(6)
    c.backup(keys[:4], mamba_at=[1, 3], swa_pages=[0, 1, 2, 3])  # KV holds 4 of the 6
    q = c.query(keys)
    assert q.restorable_prefix_pages == [2, 4] and q.kv_hit_pages == 4
    os.remove(record_file(tmp_path, keys[2], "indexer"))  # the indexer lacks page 3
    q = HybridController(tmp_path, hybrid_pools()).query(keys)  # an engine started after
    assert q.restorable_prefix_pages == [2] and q.kv_hit_pages == 2
    assert dict(q.extra_pool_hit_pages) == {"kv": 4, "indexer": 2, "swa": 4, "mamba": 4}


def test_nothing_restorable_answers_zero_and_an_empty_list(tmp_path):
    c = HybridController(tmp_path, hybrid_pools(seed=6))
    keys = chain(3)
    q = c.query(keys)
    assert (q.kv_hit_pages, dict(q.extra_pool_hit_pages), q.restorable_prefix_pages) == \
        (0, {}, [])
    c.backup(keys, mamba_at=[], swa_pages=[0, 1, 2])  # no Mamba state at all
    q = c.query(keys)
    assert (q.kv_hit_pages, q.restorable_prefix_pages) == (0, [])
    assert "mamba" not in q.extra_pool_hit_pages and q.extra_pool_hit_pages["kv"] == 3


def test_the_hit_query_asks_each_record_once(tmp_path):
    c = HybridController(tmp_path, hybrid_pools(seed=7))
    keys = chain(6)
    c.backup(keys[:5], mamba_at=[4], swa_pages=[3, 4])
    before = c.store.get_stats()["exists_queries"]
    c.query(keys)
    asked = c.store.get_stats()["exists_queries"] - before
    # the KV chain's K and V records (one call), then three pools' records of the 5 KV pages
    assert asked == 2 * 6 + 3 * 5


@pytest.mark.parametrize("pool", ["mamba", "swa", "indexer"])
@pytest.mark.parametrize("fault", ["corrupt", "missing", "foreign-model", "foreign-geometry"])
def test_a_bad_sidecar_record_is_false_and_leaves_the_pool_untouched(tmp_path, pool, fault):
    keys = chain(2)
    writer_cfg = {"model": "other-model"} if fault == "foreign-model" else {}
    pools = hybrid_pools(seed=8)
    if fault == "foreign-geometry":  # the same hash, written by a pool of another geometry
        pools = {"kv": pools["kv"], "mamba": mamba_pool(state=(8, 32, 16)),
                 "swa": SwaPool(heads=4), "indexer": PageFirstPool(
                     [torch.zeros((PAGES * PAGE, 2, 1, 128), dtype=torch.uint8)], PAGE, False)}
        for i, name in enumerate(("mamba", "swa", "indexer")):
            pools[name].fill_random(80 + i)
    src = HybridController(tmp_path, pools, **writer_cfg)
    src.backup(keys, mamba_at=[1], swa_pages=[0, 1])
    if fault == "corrupt":
        path = record_file(tmp_path, keys[1], pool)
        with open(path, "r+b") as f:  # one payload byte flipped, mid-record
            f.seek(os.path.getsize(path) // 2)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0x5A]))
    elif fault == "missing":
        os.remove(record_file(tmp_path, keys[1], pool))
    dst = HybridController(tmp_path, hybrid_pools())
    dst.pools[pool].fill(0xA5)
    before = dst.pools[pool].page_bytes(PAGE if pool != "mamba" else 1)
    slots = {"mamba": torch.tensor([1], dtype=torch.int64), "swa": indices([1], PAGE),
             "indexer": indices([1], PAGE)}[pool]
    res = dst.store.batch_get_v2([PoolTransfer(name=PoolName(pool), keys=keys[1:2],
                                               host_indices=slots, hit_policy=POLICY[pool][0])])
    assert res == {pool: [False]}
    assert dst.pools[pool].page_bytes(PAGE if pool != "mamba" else 1) == before
    if fault == "corrupt":
        assert dst.store.get_stats()["bad_records"] == 1
    q = dst.query(keys)
    assert pool not in q.extra_pool_hit_pages or q.extra_pool_hit_pages[pool] < 2
    assert 2 not in q.restorable_prefix_pages


def test_a_host_indices_length_mismatch_is_all_false_and_touches_nothing(tmp_path):
    c = HybridController(tmp_path, hybrid_pools(seed=9))
    keys = chain(3)
    res = c.store.batch_set_v2([
        PoolTransfer(name=PoolName.INDEXER, keys=keys, host_indices=indices(range(3), PAGE)[:-1]),
        PoolTransfer(name=PoolName.SWA, keys=keys, host_indices=indices(range(3), PAGE))])
    assert res == {"indexer": [False] * 3, "swa": [True] * 3}
    assert c.store.get_stats()["v2_transfer_errors"] == 1
    assert not [f for f in os.listdir(tmp_path) if ".pool-indexer." in f]  # nothing stored
    assert c.store.batch_set_v1(keys, indices(range(3), PAGE)) == [True] * 3
    dst = HybridController(tmp_path, hybrid_pools())
    dst.pools["swa"].fill(0x11)
    before = dst.pools["swa"].page_bytes(0)
    res = dst.store.batch_get_v2([
        PoolTransfer(name=PoolName.SWA, keys=keys, host_indices=indices(range(4), PAGE)),
        PoolTransfer(name=PoolName.KV, keys=keys, host_indices=indices(range(4), PAGE))])
    assert res == {"swa": [False] * 3, "kv": [False] * 3}
    assert dst.pools["swa"].page_bytes(0) == before
    assert dst.pools["kv"].page_bytes(0) == bytes(len(dst.pools["kv"].page_bytes(0)))
    assert dst.store.get_stats()["v2_transfer_errors"] == 2


def test_v1_and_v2_read_the_same_kv_records(tmp_path):
    a = HybridController(tmp_path, hybrid_pools(seed=10))
    keys = chain(4)
    assert a.store.batch_set_v1(keys[:2], indices([0, 1], PAGE)) == [True, True]
    assert a.store.batch_set_v2([PoolTransfer(name=PoolName.KV, keys=keys[2:],
                                              host_indices=indices([2, 3], PAGE))]) == \
        {"kv": [True, True]}
    b = HybridController(tmp_path, hybrid_pools())
    assert b.store.batch_exists(keys) == 4
    assert b.store.batch_exists_v2(keys).kv_hit_pages == 4
    assert b.store.batch_get_v2([PoolTransfer(name=PoolName.KV, keys=keys[:2],
                                              host_indices=indices([5, 6], PAGE))]) == \
        {"kv": [True, True]}
    assert b.store.batch_get_v1(keys[2:], indices([7, 8], PAGE)) == [True, True]
    for src, dst in ((0, 5), (1, 6), (2, 7), (3, 8)):
        assert b.pools["kv"].page_bytes(dst * PAGE) == a.pools["kv"].page_bytes(src * PAGE)


def test_results_are_keyed_by_the_pool_name_string_and_answer_poolname(tmp_path):
    c = HybridController(tmp_path, hybrid_pools(seed=11))
    keys = chain(2)
    res = c.store.batch_set_v2([PoolTransfer(name=PoolName.SWA, keys=keys,
                                             host_indices=indices([0, 1], PAGE))])
    assert list(res) == ["swa"] and type(list(res)[0]) is str
    assert res[PoolName.SWA] == res["swa"] == [True, True] and PoolName.SWA in res
    assert c.store.batch_set_v2([PoolTransfer(name="swa", keys=[], host_indices=None)]) == \
        {"swa": []}


def test_tp_ranks_agree_on_the_largest_common_length(tmp_path):
    """Rank 0's checkpoints give {2, 4}, rank 1's {2, 3}: the ranks take 2 (not min(4, 3) = 3,
    which rank 0 cannot restore), and each reads its own shard of the state."""
    ranks = [HybridController(tmp_path, hybrid_pools(seed=20 + r), tp_rank=r, tp_size=2)
             for r in range(2)]
    keys = chain(4)
    ranks[0].backup(keys, mamba_at=[1, 3], swa_pages=[0, 1, 2, 3])
    ranks[1].backup(keys, mamba_at=[1, 2], swa_pages=[0, 1, 2, 3])
    lists = [c.query(keys).restorable_prefix_pages for c in ranks]
    assert lists == [[2, 4], [2, 3]]
    agreed = agree_restorable(lists)
    assert agreed == 2
    for r, c in enumerate(ranks):
        dst = HybridController(tmp_path, hybrid_pools(), tp_rank=r, tp_size=2)
        res = dst.store.batch_get_v2([PoolTransfer(
            name=PoolName.MAMBA, keys=keys[agreed - 1:agreed], hit_policy=TRAIL,
            host_indices=torch.tensor([5], dtype=torch.int64))])
        assert res == {"mamba": [True]}
        assert dst.pools["mamba"].page_bytes(5) == c.pools["mamba"].page_bytes(1)
    assert ranks[0].pools["mamba"].page_bytes(1) != ranks[1].pools["mamba"].page_bytes(1)


def test_agree_restorable_is_the_largest_length_in_every_list():
    assert agree_restorable([[2, 4], [2, 3]]) == 2
    assert agree_restorable([[1, 3, 5], [3, 5], [1, 2, 3, 5]]) == 5
    assert agree_restorable([[4], [3]]) == 0
    assert agree_restorable([[]]) == 0
    with pytest.raises(ValueError, match="at least one rank"):
        agree_restorable([])
    with pytest.raises(ValueError, match="rank 1"):
        agree_restorable([[1], None])


def test_under_mla_the_mamba_state_is_per_rank_and_the_indexer_shared(tmp_path):
    """MLA KV is the same on every rank (one namespace); the Mamba state is TP-sharded and
    keeps the rank; the indexer, like the KV, is shared."""
    keys = chain(2)
    r0 = HybridController(tmp_path, hybrid_pools(seed=30, mla=True), mla=True, tp_rank=0,
                          tp_size=2)
    r0.backup(keys, mamba_at=[1], swa_pages=[])
    r1 = HybridController(tmp_path, hybrid_pools(mla=True), mla=True, tp_rank=1, tp_size=2)
    res = r1.store.batch_get_v2([
        PoolTransfer(name=PoolName.INDEXER, keys=keys, host_indices=indices([0, 1], PAGE)),
        PoolTransfer(name=PoolName.MAMBA, keys=keys[1:], host_indices=torch.tensor([1]))])
    assert res == {"indexer": [True, True], "mamba": [False]}
    assert r1.pools["indexer"].page_bytes(PAGE) == r0.pools["indexer"].page_bytes(PAGE)


# --- registration -----------------------------------------------------------------------------

def test_registration_reads_the_pools_geometry_and_refuses_a_conflict(tmp_path):
    pools = hybrid_pools()
    c = HybridController(tmp_path, pools)
    c.store.register_mem_host_pool_v2(pools["mamba"], "mamba")  # the same pool again: fine
    c.store.register_mem_host_pool_v2(pools["kv"], PoolName.KV)
    with pytest.raises(ValueError, match="pool 'mamba' is registered already"):
        c.store.register_mem_host_pool_v2(mamba_pool(state=(8, 32, 16)), PoolName.MAMBA)
    with pytest.raises(ValueError, match="pool 'kv' is registered already"):
        c.store.register_mem_host_pool_v2(kv_pool(), "kv")
    other = mamba_pool()
    other.layout = "layer_first"
    with pytest.raises(ValueError, match="pool 'mamba2': host layout 'layer_first'"):
        c.store.register_mem_host_pool_v2(other, "mamba2")
    bare = types.SimpleNamespace(layout="page_first", page_size=1, kv_buffer=torch.zeros(4))
    with pytest.raises(ValueError, match="pool 'bare': no get_page_buffer_meta"):
        c.store.register_mem_host_pool_v2(bare, "bare")
    anchor = types.SimpleNamespace(layout="page_first", page_size=PAGE, kv_buffer=None)
    with pytest.raises(ValueError, match="logical anchor"):
        HiCacheStore(config(tmp_path), {}).register_mem_host_pool_v2(anchor, "kv")
    with pytest.raises(ValueError, match="pool name"):
        c.store.register_mem_host_pool_v2(pools["swa"], "swa/1")
    long = HiCacheStore(config(tmp_path, model="m" * 150), {})
    long.register_mem_pool_host(kv_pool())
    with pytest.raises(ValueError, match="pool 'mamba': bad storage key"):
        long.register_mem_host_pool_v2(mamba_pool(), "mamba")
    assert set(c.store.registered_pools) == {"kv", "mamba", "swa", "indexer"}


def test_the_kv_pool_registered_through_v2_alone_serves_v1(tmp_path):
    pool = kv_pool()
    pool.fill_random(40)
    store = HiCacheStore(config(tmp_path), {})
    store.register_mem_host_pool_v2(pool, PoolName.KV)
    keys = chain(2)
    assert store.batch_set_v1(keys, indices([0, 1], PAGE)) == [True, True]
    assert store.batch_exists(keys) == 2


# --- never raise ------------------------------------------------------------------------------

def test_batch_calls_never_raise(tmp_path):
    c = HybridController(tmp_path, hybrid_pools(seed=50))
    keys = chain(2)
    # an unregistered pool: False for it, the other transfers served
    res = c.store.batch_set_v2([
        PoolTransfer(name=PoolName.DRAFT, keys=keys, host_indices=indices([0, 1], PAGE)),
        PoolTransfer(name=PoolName.SWA, keys=keys, host_indices=indices([0, 1], PAGE))])
    assert res == {"draft": [False, False], "swa": [True, True]}
    # a host index outside the pool: refused before any byte moves
    res = c.store.batch_get_v2([PoolTransfer(
        name=PoolName.SWA, keys=keys[:1], host_indices=indices([PAGES + 3], PAGE))])
    assert res == {"swa": [False]}
    # a pool whose get_page_buffer_meta fails
    broken = mamba_pool()
    c.store.register_mem_host_pool_v2(broken, "mamba_b")

    def boom(_):
        raise RuntimeError("device lost")
    broken.get_page_buffer_meta = boom
    assert c.store.batch_set_v2([PoolTransfer(name="mamba_b", keys=keys[:1],
                                              host_indices=torch.tensor([0]))]) == \
        {"mamba_b": [False]}
    # a query naming a pool the store does not have: nothing restorable
    q = c.store.batch_exists_v2(keys, [PoolTransfer(name=PoolName.DRAFT, keys=keys)])
    assert (q.kv_hit_pages, q.restorable_prefix_pages) == (0, [])
    # before any registration
    fresh = HiCacheStore(config(tmp_path), {})
    assert fresh.batch_exists_v2(keys).kv_hit_pages == 0
    assert fresh.batch_get_v2([PoolTransfer(name=PoolName.KV, keys=keys,
                                            host_indices=indices([0, 1], PAGE))]) == \
        {"kv": [False, False]}
    assert fresh.get_stats()["v2_exists_errors"] == 1
    assert fresh.get_stats()["v2_transfer_errors"] == 1
    assert c.store.get_stats()["v2_transfer_errors"] == 3


def test_the_docs_table_of_v2_methods_is_the_stores():
    """docs/sglang.md's storage v2 table names SGLang's v2 methods, each one HiCacheStore's own
    (not SGLang's default, which raises or only records the pool)."""
    import pathlib
    from test_sglang_store import doc_table
    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "sglang.md").read_text()
    rows = doc_table(doc, "| method | `HiCacheStore` |")
    named = {first.strip("`").split("(")[0] for first, _ in rows}
    assert named == {"register_mem_host_pool_v2", "batch_exists_v2", "batch_get_v2",
                     "batch_set_v2"}
    from hicache.sglang._v2 import _StorageV2
    for method in named:
        assert getattr(HiCacheStore, method) is getattr(_StorageV2, method)
