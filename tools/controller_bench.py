#!/usr/bin/env python3
"""hicache's drop-in SGLang controller driven from Python, against hicache-opbench in one run.

The workloads and geometry of hicache-opbench (tools/opbench.cc): 32 layers x 8 KV heads x head
dim 128, fp16, pages of 64 tokens (8 MiB), host layout layer_first, direct io, device pool 80
pages, host pool 160, 4 ops in flight; `_tiny`: 1 layer x 1 head x head dim 8 (2 KiB pages).
Here the pools are SGLang's shapes (per-layer k_buffer / v_buffer with a padding page, the host
kv_buffer) and every call goes through hicache.sglang.HiCacheController as SGLang's radix cache
makes it:

  write_pP   N ops of P pages, 4 in flight: write(); on each ack (ack_write_queue) evict the
             device copy, then the host copy, and submit the next.
  load_pP    N steps of 4 load() ops of P pages: start_loading(), set_consumer(), the device
             pool's get_key_buffer(layer) for every layer in order, the 4 acks
             (ack_load_queue), then evict_device.

Prints one JSON line per workload with the Python figures, the C++ figures of the same
workload from `hicache-opbench --workload W` run by this script, and python_vs_cpp (GB/s for
the 8 MiB workloads, ops/s for the tiny ones; targets >= 0.8 and >= 30k tiny ops/s). The final
window's bytes are checked after the clock stops (device page == host page, every layer, K and
V); `verified` says whether they matched.

    PYTHONPATH=build/python /usr/bin/python3 tools/controller_bench.py \
        [--opbench build/tools/hicache-opbench] [--quick] [--workload write_p1,...] \
        [--device cpu|cuda] [--io-backend direct|kernel]

--device cuda puts the engine's device buffers on the GPU (torch's own CUDA tensors; the
slot indices stay CPU tensors, as SGLang's host indices are) and runs hicache-opbench with
--device cuda: the Python calls then order hicache's copies after torch's current stream on
the device (no host synchronisation), and the figures compare with the C++ path on the same GPU.
--io-backend is SGLang's (default direct), given to the drop-in and to hicache-opbench alike.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from hicache.sglang import HiCacheController

PAGE = 64
IN_FLIGHT = 4
_MADV_HUGEPAGE = 14


def tensor(shape, dtype):
    """An uninitialised tensor on transparent huge pages, as hicache's own pools are: 2 MiB
    aligned, advised before the first touch, so that the engine's memory and the C++ run's
    differ in nothing but the caller."""
    import ctypes
    huge = 2 << 20
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(nbytes + huge, dtype=torch.uint8)
    skip = -raw.data_ptr() % huge
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise(ctypes.c_void_p(raw.data_ptr() + skip),
                 ctypes.c_size_t((nbytes + huge - 1) // huge * huge), _MADV_HUGEPAGE)
    return raw[skip:skip + nbytes].view(dtype).view(shape)


WORKLOADS = {  # name: (load, tiny, pages per op, count), hicache-opbench's
    "write_p1": (False, False, 1, 2000), "write_p16": (False, False, 16, 150),
    "load_p1": (True, False, 1, 600), "load_p16": (True, False, 16, 40),
    "write_p1_tiny": (False, True, 1, 20000), "load_p1_tiny": (True, True, 1, 3000),
}


DEVICE = ["cpu"]
IO_BACKEND = ["direct"]  # SGLang's io_backend, passed to the drop-in and to hicache-opbench


def device_tensor(shape, dtype):
    if DEVICE[0] == "cuda":
        return torch.empty(shape, dtype=dtype, device="cuda")
    return tensor(shape, dtype)


class DevicePool:
    def __init__(self, pages, layers, heads, head_dim):
        self.page_size, self.layer_num, self.size = PAGE, layers, pages * PAGE
        self.dtype, self.head_num, self.head_dim = torch.float16, heads, head_dim
        rows = self.size + PAGE
        self.k_buffer = [device_tensor((rows, heads, head_dim), self.dtype) for _ in range(layers)]
        self.v_buffer = [device_tensor((rows, heads, head_dim), self.dtype) for _ in range(layers)]
        for t in self.k_buffer + self.v_buffer:
            t.view(torch.int16).random_(-30000, 30000)
        self.layer_transfer_counter = None

    def register_layer_transfer_counter(self, counter):
        self.layer_transfer_counter = counter

    def get_key_buffer(self, layer):
        self.layer_transfer_counter.wait_until(layer)
        return self.k_buffer[layer]


class Allocator:
    """SGLang's paged allocator, kept cheap (views of one slot table) so that the figures are
    the controller's, not the benchmark's."""

    def __init__(self, pool):
        self.pool = pool
        self.free_pages = list(range(1, pool.size // PAGE + 1))
        self.table = torch.arange(pool.size + PAGE, dtype=torch.int64).view(-1, PAGE)

    def get_kvcache(self):
        return self.pool

    def alloc(self, n):
        k = n // PAGE
        if k > len(self.free_pages):
            return None
        pages, self.free_pages = self.free_pages[:k], self.free_pages[k:]
        return self.table[pages[0]] if k == 1 else self.table[pages].flatten()

    def free(self, indices):
        if indices._base is self.table._base and len(indices) == PAGE:  # a row alloc() handed out
            self.free_pages.append(indices.storage_offset() // PAGE)
            return
        self.free_pages.extend(sorted({i // PAGE for i in indices.tolist()}))


class HostPool:
    def __init__(self, pages, layers, heads, head_dim):
        self.layout, self.page_size, self.layer_num = "layer_first", PAGE, layers
        self.size, self.dtype = pages * PAGE, torch.float16
        self.kv_buffer = tensor((2, layers, self.size, heads, head_dim), self.dtype)
        self.kv_buffer.zero_()


def rig(tiny):
    layers, heads, head_dim = (1, 1, 8) if tiny else (32, 8, 128)
    dev = DevicePool(80, layers, heads, head_dim)
    alloc = Allocator(dev)
    host = HostPool(160, layers, heads, head_dim)
    ctrl = HiCacheController(alloc, host, PAGE, None, write_policy="write_through",
                             io_backend=IO_BACKEND[0], model_name="controller-bench")
    page_bytes = 2 * layers * PAGE * heads * head_dim * 2
    return dev, alloc, host, ctrl, page_bytes


def same_bytes(dev, host, device_slots, host_slots):
    for layer in range(dev.layer_num):
        for kv, buf in enumerate((dev.k_buffer, dev.v_buffer)):
            if not torch.equal(buf[layer][device_slots].view(torch.int16).cpu(),
                               host.kv_buffer[kv, layer][host_slots].view(torch.int16)):
                return False
    return True


def wait_acks(queue, n):
    """Takes n acks from an ack queue (list style), polling as SGLang's scheduler does: an ack
    is taken once its finish_event says the copy is done (a write's ack is in the list at once,
    a load's once its copy completed)."""
    got = []
    while len(got) < n:
        if queue and queue[0].finish_event.query():
            got.append(queue.pop(0))
        else:
            time.sleep(0)
    return got


def run_writes(pages, count):
    dev, alloc, host, ctrl, page_bytes = rig(tiny=TINY[0])
    ops = {}
    latencies = []
    next_id = [1]

    def submit():
        d = alloc.alloc(pages * PAGE)
        node = next_id[0]
        next_id[0] += 1
        h = ctrl.write(d, node_id=node)
        assert h is not None
        ops[node] = (d, h, time.perf_counter())

    def finish(node, timed):
        d, h, t0 = ops.pop(node)
        if timed:
            latencies.append(time.perf_counter() - t0)
        return d, h

    for _ in range(IN_FLIGHT):  # warm-up window
        submit()
    for ack in wait_acks(ctrl.ack_write_queue, IN_FLIGHT):
        d, h = finish(ack.node_ids[0], False)
        ctrl.evict_device(d, h)
        ctrl.evict_host(h)
    t0 = time.perf_counter()
    for _ in range(IN_FLIGHT):
        submit()
    done = submitted = IN_FLIGHT
    last = []
    while done < count + IN_FLIGHT:
        for ack in wait_acks(ctrl.ack_write_queue, 1):
            d, h = finish(ack.node_ids[0], True)
            done += 1
            if submitted < count:
                ctrl.evict_device(d, h)
                ctrl.evict_host(h)
                submit()
                submitted += 1
            else:
                last.append((d, h))
    seconds = time.perf_counter() - t0
    verified = all(same_bytes(dev, host, d, h) for d, h in last)
    ctrl.close()
    return count, pages, page_bytes, seconds, latencies, verified


def run_loads(pages, count):
    dev, alloc, host, ctrl, page_bytes = rig(tiny=TINY[0])
    # Host pages in state backup for the 4 ops of a step: written once, device copies evicted.
    sources, written = [], []
    for k in range(IN_FLIGHT):
        d = alloc.alloc(pages * PAGE)
        sources.append(ctrl.write(d, node_id=k + 1))
        written.append(d)
    wait_acks(ctrl.ack_write_queue, IN_FLIGHT)
    for d, h in zip(written, sources):
        ctrl.evict_device(d, h)
    latencies = []
    steps = count  # hicache-opbench counts load steps (of IN_FLIGHT ops each)
    seconds = 0.0
    verified = True
    for step in range(steps + 3):  # 3 warm-up steps
        timed = step >= 3
        t0 = time.perf_counter()
        loaded = []
        for k, h in enumerate(sources):
            loaded.append(ctrl.load(h, node_id=100 + k))
        producer = ctrl.start_loading()
        ctrl.layer_done_counter.set_consumer(producer)
        for layer in range(dev.layer_num):
            dev.get_key_buffer(layer)
        wait_acks(ctrl.ack_load_queue, IN_FLIGHT)
        elapsed = time.perf_counter() - t0
        if timed:
            seconds += elapsed
            latencies.extend([elapsed] * IN_FLIGHT)
        if step == steps + 2:
            verified = all(same_bytes(dev, host, d, h) for d, h in zip(loaded, sources))
        for d, h in zip(loaded, sources):
            ctrl.evict_device(d, h)
    ctrl.close()
    return steps * IN_FLIGHT, pages, page_bytes, seconds, latencies, verified


TINY = [False]


def python_figures(name, scale):
    load, tiny, pages, count = WORKLOADS[name]
    TINY[0] = tiny
    count = max(IN_FLIGHT, count // scale)
    ops, pages, page_bytes, seconds, lat, verified = (run_loads if load else run_writes)(pages, count)
    return {"ops": ops, "ops_per_s": round(ops / seconds, 1),
            "gbps": round(ops * pages * page_bytes / seconds / 1e9, 3),
            "p50_ms": round(statistics.median(lat) * 1e3, 4), "verified": verified}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--opbench", default=os.path.join("build", "tools", "hicache-opbench"))
    ap.add_argument("--quick", action="store_true", help="a tenth of the ops")
    ap.add_argument("--workload", default=",".join(WORKLOADS))
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--io-backend", default="direct", choices=("direct", "kernel"),
                    help="SGLang's io_backend for the drop-in; hicache-opbench takes the same")
    args = ap.parse_args()
    IO_BACKEND[0] = args.io_backend
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: torch sees no GPU")
    DEVICE[0] = args.device
    names = [w for w in args.workload.split(",") if w]
    for w in names:
        if w not in WORKLOADS:
            sys.exit(f"--workload {w}: valid are {', '.join(WORKLOADS)}")
    cmd = [args.opbench, "--workload", ",".join(names)] + (["--quick"] if args.quick else []) + \
        (["--device", "cuda"] if args.device == "cuda" else []) + ["--io-backend", args.io_backend]
    cpp = {}
    for line in subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            cpp[row["workload"]] = row
    ok = True
    for name in names:
        py = python_figures(name, 10 if args.quick else 1)
        c = cpp[name]
        key = "ops_per_s" if WORKLOADS[name][1] else "gbps"
        ratio = py[key] / c[key] if c[key] else 0.0
        ok &= py["verified"]
        print(json.dumps({"workload": name, "device": args.device,
                          "io_backend": args.io_backend, "python": py,
                          "cpp": {k: c[k] for k in ("ops_per_s", "gbps", "p50_ms", "verified")},
                          "python_vs_cpp": round(ratio, 3), "measure": key}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
