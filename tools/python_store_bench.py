#!/usr/bin/env python3
"""hicache's SGLang L3 backend through Python against the C++ store, in one run.

For each page size (SGLang pages of 8 MiB and 256 KiB: K and V halves, page_first MHA host
pool) and 1 and 4 threads: HiCacheStore.batch_set_v1 / batch_get_v1 called from Python threads,
against the same store's own batch_set / batch_get on the same host pool ranges called from C++
threads (Store.time_batches), on one file store (durability none) in a fresh directory.
Prints GB/s of each and the ratio Python / C++ (target >= 0.9). Each figure is the best of
--reps rounds; a round writes fresh keys (the store deduplicates) and reads what it wrote, and
rounds alternate which side goes first; the page cache's dirty pages are flushed (sync) before
each step, so that no step pays for the writeback of the one before.

    PYTHONPATH=build/python /usr/bin/python3 tools/python_store_bench.py [--dir D] [--reps N]
"""
import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
import types

import torch

from bench_rounds import best_of_rounds, size_label
from hicache.sglang import HiCacheStore


class Pool:
    """A page_first MHA host pool with SGLang's attributes."""

    def __init__(self, pages, page_size, layers, heads, head_dim):
        self.layout, self.page_size, self.layer_num = "page_first", page_size, layers
        self.head_num, self.head_dim, self.dtype = heads, head_dim, torch.bfloat16
        self.size = pages * page_size
        self.kv_buffer = torch.empty((2, self.size, layers, heads, head_dim), dtype=self.dtype)
        self.kv_buffer.view(torch.int16).random_(-30000, 30000)


def run_threads(n, fn):
    threads = [threading.Thread(target=fn, args=(t,)) for t in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def bench(root, page_bytes, pages, batch, threads, reps):
    # page_bytes = 2 (K, V) * layers * page_size * heads * head_dim * 2 bytes
    page_size, heads, head_dim = 64, 8, 128
    layers = max(1, page_bytes // (2 * page_size * heads * head_dim * 2))
    pool = Pool(pages, page_size, layers, heads, head_dim)
    idx = torch.arange(pool.size, dtype=torch.int64)
    batches = [list(range(b, min(b + batch, pages))) for b in range(0, pages, batch)]
    real_page = 0

    def make_round(rep, rep_root):
        nonlocal real_page
        cfg = types.SimpleNamespace(tp_rank=0, tp_size=1, is_mla_model=False,
                                    is_page_first_layout=True, model_name="bench",
                                    extra_config={"interface_v1": 1, "storage": {
                                        "backend": "file", "root": rep_root, "io_threads": 4}})
        store = HiCacheStore(cfg, None)
        store.register_mem_pool_host(pool)
        native = store._store
        real_page = 2 * store._record_bytes
        py_keys = [[f"py{rep}-{p:08x}" for p in b] for b in batches]
        cpp_keys = [[f"cpp{rep}-{p:08x}" for p in b] for b in batches]

        def py_io(get, keys):
            def work(t):
                for i in range(t, len(batches), threads):
                    pages_i = batches[i]
                    sl = idx[pages_i[0] * page_size:(pages_i[-1] + 1) * page_size]
                    io = store.batch_get_v1 if get else store.batch_set_v1
                    assert all(io(keys[i], sl)), "a page did not move"
            return run_threads(threads, work)

        def cpp_io(get, keys):
            names, ranges = [], []
            for i, b in enumerate(batches):
                n, r = [], []
                for k, p in zip(keys[i], b):
                    n.extend(store._layout.names(k))
                    r.extend(store._layout.ranges(p * page_size))
                names.append(n)
                ranges.append(r)
            return native.time_batches(names, ranges, get, threads)

        groups = [[("cpp_set", lambda: cpp_io(False, cpp_keys)),
                   ("py_set", lambda: py_io(False, py_keys))],
                  [("cpp_get", lambda: cpp_io(True, cpp_keys)),
                   ("py_get", lambda: py_io(True, py_keys))]]
        return real_page * pages, groups, lambda: None

    best = best_of_rounds(reps, root, make_round,
                          trace=bool(os.environ.get("HICACHE_BENCH_TRACE")))
    return real_page, best


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=None, help="store directory (default: a fresh temp dir)")
    ap.add_argument("--reps", type=int, default=4)
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="hicache-pybench-", dir=args.dir)
    print(f"file store in {root}; torch {torch.__version__}; {os.cpu_count()} CPUs")
    print(f"{'page':>8} {'threads':>7} {'op':>4} {'python GB/s':>12} {'C++ GB/s':>9} {'ratio':>6}")
    worst = 1e9
    try:
        for page_bytes, pages, batch in ((8 << 20, 64, 16), (256 << 10, 1024, 128)):
            for threads in (1, 4):
                real, b = bench(root, page_bytes, pages, batch, threads, args.reps)
                for op in ("set", "get"):
                    r = b[f"py_{op}"] / b[f"cpp_{op}"]
                    worst = min(worst, r)
                    label = size_label(real)
                    print(f"{label:>8} {threads:>7} {op:>4} {b[f'py_{op}']:>12.2f} "
                          f"{b[f'cpp_{op}']:>9.2f} {r:>6.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"worst ratio python / C++: {worst:.2f} (target >= 0.9)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
