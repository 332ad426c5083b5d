#!/usr/bin/env python3
"""hicache's vLLM tier and LMCache adapter against the C++ store's own calls, in one run.

For each block geometry (vLLM blocks of --block-tokens 16 tokens, bf16, K and V of every layer:
by default Llama-3.2-1B's 16 layers x 8 KV heads x 64 = 512 KiB, and Llama-3.1-8B's 32 x 8 x
128 = 2 MiB) and 1 and 4 jobs in flight, the same blocks of one primary region (an anonymous
mapping, as vLLM's primary CPU tier is) move through:

  vLLM     hicache.vllm.HiCacheTier driven as vLLM's tiering manager drives it, from one
           thread: submit_store / submit_load jobs of --job-mib MiB of blocks (JobMetadata
           with block ids), get_finished_jobs polled once per step, each step waiting on the tier's
           event_fd in place of the engine's forward pass;
  LMCache  hicache.lmcache.HiCacheL2Adapter driven as LMCache's bridge drives it:
           submit_batch_set / submit_batch_get of the same rows as memoryviews, the eventfd
           polled, drain_completions;
  C++      the same store's own batch_set / batch_get on the same rows, called from as many C++
           threads as there are jobs in flight (Store.time_batches), without Python;

all three on one store per round (a file store in a fresh directory, or with --redis a Redis
server, which each round flushes). Prints the best GB/s of each, the ratios adapter / C++
(target >= 0.9) and each adapter's job latency (submit to reported) p50 / p99. Rounds as in
tools/bench_rounds.py (fresh store and keys, order rotating, sync before each step; each round
stores --set-passes sets of fresh blocks and reads them back --get-passes times). A ratio is the median over the groups of the adapter's
figure over the C++ figure of the same group (the two ran back to back): on these VMs one
step's figure swings 30% from group to group, so the ratio of the two sides' bests compares
two different minutes of the machine, and each paired ratio does not. Every get is checked after its clock stops: the rows read back must equal the rows
stored; the exit status is 1 when any byte differs.

    PYTHONPATH=build/python /usr/bin/python3 tools/adapter_bench.py [--dir D] [--reps N]
        [--redis [redis://]HOST:PORT] [--models L:H:D,...] [--jobs 1,4] [--mib M] [--job-mib J]
        [--set-passes P] [--get-passes P] [--quick]
"""
import argparse
import ctypes
import mmap
import os
import random
import select
import shutil
import sys
import tempfile
import time
from collections import namedtuple

import hicache
from bench_rounds import paired_median, run_rounds, size_label
from hicache.lmcache import HiCacheL2Adapter
from hicache.vllm import HiCacheTier

# vLLM's JobMetadata (v3: job_id, keys, block_ids, is_promotion, req_context)
JobMetadata = namedtuple("JobMetadata", "job_id keys block_ids is_promotion req_context")
SIDES = ("cpp", "vllm", "lmcache")


def row_bytes(tokens, layers, heads, head_dim, dtype_bytes=2):
    """One vLLM block of every layer's K and V."""
    return tokens * layers * 2 * heads * head_dim * dtype_bytes


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


class Region:
    """The primary tier: 2n rows of `row` bytes (sources 0..n-1, load targets n..2n-1) in one
    anonymous mapping on transparent huge pages, as vLLM's shared mmap is page aligned."""

    def __init__(self, n, row):
        self.n, self.row = n, row
        self.mem = mmap.mmap(-1, 2 * n * row)
        self.mem.madvise(getattr(mmap, "MADV_HUGEPAGE", 14))
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.mem))
        self.view = memoryview(self.mem).cast("B", (2 * n, row))
        self.flat = memoryview(self.mem)
        rng = random.Random(1)
        for r in range(n):
            self.flat[r * row:(r + 1) * row] = rng.randbytes(row)

    def rows(self, first, count):
        return self.flat[first * self.row:(first + count) * self.row]

    def clear_targets(self):
        self.flat[self.n * self.row:] = bytes(self.n * self.row)

    def verify_targets(self):
        """Bytes of the load targets that differ from their sources (0 when all match)."""
        if self.rows(self.n, self.n) == self.rows(0, self.n):
            return 0
        return sum(self.rows(self.n + r, 1) != self.rows(r, 1) for r in range(self.n)) * self.row


def drive_tier(tier, keys, jobs, in_flight, load, latencies):
    """vLLM's scheduler loop: submit up to `in_flight` jobs, poll get_finished_jobs once per
    step; with nothing finished the step waits on the tier's event_fd (the forward pass)."""
    fd = tier.event_fd()
    pending, j = {}, 0
    t0 = time.perf_counter()
    while j < len(jobs) or pending:
        while j < len(jobs) and len(pending) < in_flight:
            first, count = jobs[j]
            rows = range(first + (len(keys) if load else 0), first + count +
                         (len(keys) if load else 0))
            job = JobMetadata(j, keys[first:first + count], list(rows), load, None)
            (tier.submit_load if load else tier.submit_store)(job)
            pending[j] = time.perf_counter()
            j += 1
        finished = tier.get_finished_jobs()
        if not finished:
            select.select([fd], [], [], 1.0)
            continue
        now = time.perf_counter()
        for r in finished:
            if not r.success:
                raise RuntimeError(f"vLLM tier: job {r.job_id} failed")
            latencies.append(now - pending.pop(r.job_id))
    return time.perf_counter() - t0


def drive_adapter(adapter, region, keys, jobs, in_flight, load, latencies):
    """LMCache's bridge: submit batches of (keys, memoryviews), poll the eventfd, drain."""
    fd = adapter.event_fd()
    pending, j = {}, 0
    submit = adapter.submit_batch_get if load else adapter.submit_batch_set
    t0 = time.perf_counter()
    while j < len(jobs) or pending:
        while j < len(jobs) and len(pending) < in_flight:
            first, count = jobs[j]
            base = first + (region.n if load else 0)
            views = [region.rows(base + i, 1) for i in range(count)]
            pending[submit(keys=keys[first:first + count], memoryviews=views)] = \
                time.perf_counter()
            j += 1
        select.select([fd], [], [], 1.0)
        now = time.perf_counter()
        for fid, ok, error, per_key in adapter.drain_completions():
            if not ok or not all(per_key):
                raise RuntimeError(f"LMCache adapter: job {fid} failed: {error} {per_key}")
            latencies.append(now - pending.pop(fid))
    return time.perf_counter() - t0


def bench(storage_for, root, geometry, tokens, n, job_blocks, in_flight, reps, set_passes,
          get_passes, trace):
    row = row_bytes(tokens, *geometry)
    region = Region(n, row)
    jobs = [(b, min(job_blocks, n - b)) for b in range(0, n, job_blocks)]
    namespace = {"model": "bench/llama", "dtype": "bf16", "block_size": tokens}
    latencies = {(side, op): [] for side in ("vllm", "lmcache") for op in ("set", "get")}
    mismatched = [0]

    def make_round(rep, rep_root):
        store = hicache.open_store(storage_for(rep_root))
        tier = HiCacheTier(offloading_spec=None, primary_kv_view=region.view, tier_type="hicache",
                           storage=store, namespace=namespace)
        adapter = HiCacheL2Adapter(storage=store, namespace="bench")
        rng = random.Random(f"{rep}-{row}-{in_flight}")
        # Fresh keys for each set pass (the store deduplicates); get pass g reads set pass
        # g % set_passes.
        vllm_keys = [[rng.randbytes(32) + bytes(4) for _ in range(n)]  # OffloadKey: hash, group
                     for _ in range(set_passes)]
        lmc_keys = [[f"bench/llama@01000000@0@{rng.getrandbits(256):064x}" for _ in range(n)]
                    for _ in range(set_passes)]
        # the C++ side's records are named as the adapter names LMCache's (other hashes)
        cpp_names = [[[adapter.record_name(f"bench/llama@01000000@0@{rng.getrandbits(256):064x}")
                       for _ in range(c)] for _, c in jobs] for _ in range(set_passes)]

        def cpp(load, p):
            names, ranges = [], []
            for (first, count), batch in zip(jobs, cpp_names[p]):
                base = first + (n if load else 0)
                names.append(batch)
                ranges.append([[(region.base + (base + i) * row, row)] for i in range(count)])
            return store._s.time_batches(names, ranges, load, in_flight)

        def step(side, load, p):
            def run():
                if load:
                    region.clear_targets()
                if side == "cpp":
                    s = cpp(load, p)
                elif side == "vllm":
                    s = drive_tier(tier, vllm_keys[p], jobs, in_flight, load,
                                   latencies[("vllm", "get" if load else "set")])
                else:
                    s = drive_adapter(adapter, region, lmc_keys[p], jobs, in_flight, load,
                                      latencies[("lmcache", "get" if load else "set")])
                if load:  # after the clock: every byte read back
                    mismatched[0] += region.verify_targets()
                return s
            return (f"{side}_{'get' if load else 'set'}", run)

        def close():
            tier.shutdown()
            adapter.close()
            if storage_for(rep_root).get("backend") == "redis":
                store.clear()

        groups = [[step(side, False, p) for side in SIDES] for p in range(set_passes)]
        groups += [[step(side, True, g % set_passes) for side in SIDES]
                   for g in range(get_passes)]
        return n * row, groups, close

    figures = run_rounds(reps, root, make_round, trace)
    return row, figures, latencies, mismatched[0]


def parse_models(text):
    models = []
    for item in text.split(","):
        parts = item.split(":")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise argparse.ArgumentTypeError(f"'{item}' is not LAYERS:KV_HEADS:HEAD_DIM")
        models.append(tuple(int(p) for p in parts))
    return models


def parse_jobs(text):
    try:
        jobs = [int(j) for j in text.split(",")]
    except ValueError:
        jobs = [0]
    if not all(j >= 1 for j in jobs):
        raise argparse.ArgumentTypeError(f"'{text}' is not a list of counts >= 1")
    return jobs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=None, help="file store directory (default: a temp dir)")
    ap.add_argument("--redis", default=None, metavar="[redis://]HOST:PORT",
                    help="a Redis server to run on instead of the file store (FLUSHDB after "
                         "each round: use a server of its own)")
    ap.add_argument("--models", type=parse_models, default=parse_models("16:8:64,32:8:128"),
                    help="block geometries LAYERS:KV_HEADS:HEAD_DIM (bf16, K and V)")
    ap.add_argument("--block-tokens", type=int, default=16)
    ap.add_argument("--jobs", type=parse_jobs, default=parse_jobs("1,4"),
                    help="jobs in flight")
    ap.add_argument("--job-mib", type=int, default=8,
                    help="MiB a job moves (whole blocks, at least one): 16 blocks of 512 KiB, "
                         "4 of 2 MiB")
    ap.add_argument("--mib", type=int, default=64, help="MiB each side moves per step")
    ap.add_argument("--reps", type=int, default=15,
                    help="rounds (a fresh store each): 15 give each row 45 paired sets and gets")
    ap.add_argument("--set-passes", type=int, default=3,
                    help="sets of fresh blocks per side, per round")
    ap.add_argument("--get-passes", type=int, default=3,
                    help="gets of what a round stored, per side (reads are short)")
    ap.add_argument("--quick", action="store_true",
                    help="a few small blocks, one round: the test's mode, figures meaningless")
    args = ap.parse_args()
    if args.job_mib < 1:
        ap.error(f"--job-mib: {args.job_mib} is not >= 1")
    job_bytes = args.job_mib << 20
    if args.quick:
        args.models, args.mib, args.reps = [(2, 2, 64)], 1, 1
        args.set_passes, args.get_passes = 1, 1
        job_bytes = 64 << 10
    for name in ("block_tokens", "mib", "reps", "set_passes", "get_passes"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: {getattr(args, name)} is not >= 1")
    if args.redis:
        host, _, port = args.redis.removeprefix("redis://").rpartition(":")
        if not host or not port.isdigit():
            ap.error(f"--redis: '{args.redis}' is not HOST:PORT")
        redis = {"backend": "redis", "host": host, "port": int(port)}

        def storage_for(_root):
            return redis
        where = f"Redis at {args.redis}"
    else:
        def storage_for(rep_root):
            return {"backend": "file", "root": rep_root, "io_threads": 4}
        where = "file store in {root}"
    root = tempfile.mkdtemp(prefix="hicache-adapterbench-", dir=args.dir)
    print(f"{where.format(root=root)}; {os.cpu_count()} CPUs; {args.reps} rounds; jobs of "
          f"{size_label(job_bytes)}; GB/s: the best step; ratios: the median of the paired "
          "steps' ratios")
    print(f"{'block':>8} {'jobs':>4} {'op':>3} {'C++ GB/s':>8} {'vLLM GB/s':>9} "
          f"{'LMCache GB/s':>12} {'vLLM/C++':>8} {'LMCache/C++':>11} "
          f"{'vLLM p50/p99 ms':>15} {'LMCache p50/p99 ms':>18}")
    worst = {"vllm": 1e9, "lmcache": 1e9}
    mismatched = 0
    try:
        for geometry in args.models:
            row = row_bytes(args.block_tokens, *geometry)
            job_blocks = max(1, job_bytes // row)
            n = max(job_blocks * 8, (args.mib << 20) // row)  # 8 jobs at least
            for in_flight in args.jobs:
                row, figures, lat, bad = bench(
                    storage_for, root, geometry, args.block_tokens, n, job_blocks,
                    in_flight, args.reps, args.set_passes, args.get_passes,
                    bool(os.environ.get("HICACHE_BENCH_TRACE")))
                mismatched += bad
                best = {name: max(f) for name, f in figures.items()}
                for op in ("set", "get"):
                    cpp = best[f"cpp_{op}"]
                    cells = []
                    for side in ("vllm", "lmcache"):
                        ratio = paired_median(figures, f"{side}_{op}", f"cpp_{op}")
                        worst[side] = min(worst[side], ratio)
                        ms = lat[(side, op)]
                        cells.append((ratio, f"{percentile(ms, 0.5) * 1e3:.2f}/"
                                             f"{percentile(ms, 0.99) * 1e3:.2f}"))
                    print(f"{size_label(row):>8} {in_flight:>4} {op:>3} {cpp:>8.2f} "
                          f"{best[f'vllm_{op}']:>9.2f} {best[f'lmcache_{op}']:>12.2f} "
                          f"{cells[0][0]:>8.2f} {cells[1][0]:>11.2f} {cells[0][1]:>15} "
                          f"{cells[1][1]:>18}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"worst ratio vLLM / C++: {worst['vllm']:.2f}, LMCache / C++: {worst['lmcache']:.2f} "
          f"(target >= 0.9)")
    if mismatched:
        print(f"verified: NO, {mismatched} bytes read back differ from what was stored")
        return 1
    print("verified: every byte read back through each path equals what was stored")
    return 0


if __name__ == "__main__":
    sys.exit(main())
