#!/usr/bin/env python3
"""hicache-bench --metrics-port scraped by a real Prometheus server: every engine alias that
docs/metrics.md lists (SGLang's, vLLM's and LMCache's names) is scraped with its type and moves
during the run.

Usage: bench_metrics_scrape_test.py HICACHE_BENCH METRICS_MD. Exit 0: passed; 1: failed (each
failure named); 77: skipped (no prometheus binary).

The bench runs a small multiturn workload (a few seconds) over device, host and a file store,
sized so that every path the aliases count is taken: device and host evictions, host full (so
device KV is dropped with no host copy), prefetches from L3 of every outcome, a prefetch budget
and queues of one op (declines and dropped backups), and the best_effort policy over store
calls of one page (a prefetch ends with the pages read by the next step: some read, some not).
Prometheus scrapes it every 200 ms. "Moves": a counter or a histogram's count
starts at 0 with the process (every series is registered when the cache is built), so a
positive value scraped is one that moved; a gauge must take two values.
"""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

SKIP = 77
HOST_TOKENS = 1536
BENCH_FLAGS = [
    "--no-progress", "--seed", "1", "--workload", "multiturn", "--clients", "12", "--rounds", "8",
    "--request-tokens", "64", "--system-prompt-tokens", "128", "--output-tokens", "4",
    "--request-rate", "30", "--layers", "4", "--kv-heads", "1", "--head-dim", "64",
    "--page-size", "16", "--device-tokens", "1024", "--host-tokens", str(HOST_TOKENS),
    "--tiers", "file", "--prefetch-threshold-tokens", "128", "--prefetch-budget-tokens", "256",
    "--queue-capacity", "1", "--storage-batch-pages", "1", "--prefetch-policy", "best_effort",
    # The cost rule off: on this tiny model (12 us of compute per token, a 16 KiB page per call)
    # it rightly recomputes what L3 holds, and the L3 series would not move.
    "--recompute-seconds-per-token", "0",
]
# Series the bench cannot move, each with why and the unit test that moves it instead.
NEED_NOT_MOVE = {
    'sglang:storage_prefetch_unfulfilled_tokens_total{reason="dropped"}':
        "hicache-bench never aborts a request "
        "(HiRadixCacheStorage.PrefetchOutcomesAndUnfulfilledTokensAddUpToTheAgreedHit)",
    'sglang:storage_prefetch_unfulfilled_tokens_total{reason="shrunk"}':
        "two requests would have to read the same pages from L3 at once; the bench's requests "
        "share only the system prompt, which never leaves the tree "
        "(HiRadixCacheStorage.PrefetchOutcomesAndUnfulfilledTokensAddUpToTheAgreedHit)",
    'sglang:storage_prefetch_unfulfilled_tokens_total{reason="host_capacity"}':
        "the radix cache reserves host pages before it queues a prefetch; only the storage "
        "controller's own reservation is revoked for host room "
        "(StorageController.ARevokedReservationCountsItsHitAsUnfulfilledForHostCapacity)",
}
# With one rank the radix cache asks the file store's index before it queues a prefetch: L3's
# misses (whole, or below the threshold) are declined there (outcome declined_absent), never
# queued and revoked. A store asked on the prefetch thread revokes them (the test named).
_ASKED_FIRST = ("one rank and the file store: the radix cache asks the store's index before it "
                "queues, so misses are declined_absent, not revoked "
                "(HiRadixCacheStorage.PrefetchOutcomesAndUnfulfilledTokensAddUpToTheAgreedHit "
                "revokes them through a store asked on the prefetch thread)")
for _series in ('sglang:hicache_prefetch_outcomes_total{outcome="revoked_insufficient"}',
                'sglang:hicache_prefetch_outcomes_total{outcome="revoked_full_miss"}',
                'sglang:storage_prefetch_unfulfilled_tokens_total{reason="below_threshold"}'):
    NEED_NOT_MOVE[_series] = _ASKED_FIRST
CONSTANT = {"sglang:hicache_host_total_tokens": HOST_TOKENS}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read().decode()


def aliases_of(doc_path):
    """(series text, name, {label: value}, type) of every row of the doc's alias tables."""
    row = re.compile(r"^\| `((?:sglang|vllm|lmcache):[^`{]+)(\{[^`]*\})?` \| (counter|gauge|histogram) \|")
    out = []
    with open(doc_path) as f:
        for line in f:
            m = row.match(line)
            if not m:
                continue
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            out.append((m.group(1) + (m.group(2) or ""), m.group(1), labels, m.group(3)))
    return out


def main(bench, doc):
    if shutil.which("prometheus") is None:
        print("SKIP: prometheus not installed (Debian package prometheus)")
        return SKIP
    aliases = aliases_of(doc)
    if len(aliases) < 40:
        print(f"FAIL: {doc} lists {len(aliases)} alias series; the table was not read")
        return 1
    work = tempfile.mkdtemp(prefix="hicache-scrape-")
    api, target = free_port(), free_port()
    with open(os.path.join(work, "prometheus.yml"), "w") as f:
        f.write("global:\n  scrape_interval: 200ms\n  scrape_timeout: 200ms\n"
                "scrape_configs:\n  - job_name: bench\n    static_configs:\n"
                f"      - targets: ['127.0.0.1:{target}']\n")
    prom = subprocess.Popen(
        ["prometheus", f"--config.file={work}/prometheus.yml",
         f"--storage.tsdb.path={work}/data", f"--web.listen-address=127.0.0.1:{api}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    failures = []
    try:
        # Prometheus hands its scrape loop the configured targets a few seconds after it
        # starts (its discovery updates are throttled): the bench starts once the target is
        # there, so the first scrapes see it from its start.
        deadline = time.monotonic() + 60
        while True:  # waiting on another process, bounded
            try:
                targets = json.loads(get(f"http://127.0.0.1:{api}/api/v1/targets", 1)[1])
                if targets["data"]["activeTargets"]:
                    break
            except (OSError, ValueError, KeyError):
                pass
            if time.monotonic() > deadline or prom.poll() is not None:
                print("FAIL: Prometheus did not take the scrape target within 60 s")
                return 1
            time.sleep(0.1)
        started = time.monotonic()
        run = subprocess.run([bench, "--metrics-port", str(target),
                              "--storage-dir", os.path.join(work, "l3")] + BENCH_FLAGS,
                             capture_output=True, text=True, timeout=300)
        print(f"hicache-bench ran {time.monotonic() - started:.1f} s, exit {run.returncode}")
        if run.returncode != 0:
            print(run.stdout[-3000:], run.stderr[-3000:])
            return 1
        time.sleep(0.5)  # the scrape that finds the target gone is the last one

        def query(promql):
            q = urllib.parse.urlencode({"query": promql})
            status, body = get(f"http://127.0.0.1:{api}/api/v1/query?{q}")
            result = json.loads(body)["data"]["result"]
            return float(result[0]["value"][1]) if result else None

        for series, name, labels, kind in aliases:
            selector = ",".join(f'{k}="{v}"' for k, v in labels.items())
            metric = name + "_count" if kind == "histogram" else name
            sel = f'{metric}{{job="bench",{selector}}}' if selector else f'{metric}{{job="bench"}}'
            samples = query(f"count_over_time({sel}[10m])")
            if not samples:
                failures.append(f"{series}: Prometheus scraped no sample")
                continue
            q = urllib.parse.urlencode({"metric": name})
            meta = json.loads(get(f"http://127.0.0.1:{api}/api/v1/metadata?{q}")[1])["data"]
            scraped = meta.get(name, [{}])[0].get("type")
            if scraped != kind:
                failures.append(f"{series}: scraped as a {scraped}, the doc says {kind}")
            high, low = query(f"max_over_time({sel}[10m])"), query(f"min_over_time({sel}[10m])")
            if series in CONSTANT:
                if high != CONSTANT[series] or low != high:
                    failures.append(f"{series}: {low}..{high}, expected {CONSTANT[series]} throughout")
            elif series in NEED_NOT_MOVE:
                print(f"  not required to move: {series}: {NEED_NOT_MOVE[series]}")
            elif kind == "gauge" and not high > low:
                failures.append(f"{series}: stayed at {high} over {samples:.0f} samples")
            elif kind != "gauge" and not high > 0:
                failures.append(f"{series}: stayed at 0 over {samples:.0f} samples")
    finally:
        prom.terminate()
        try:
            prom.wait(timeout=30)
        except subprocess.TimeoutExpired:
            prom.kill()
            prom.wait()
        shutil.rmtree(work, ignore_errors=True)
    for f in failures:
        print("FAIL:", f)
    print(f"{len(aliases)} alias series checked, {len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print(__doc__)
        sys.exit(2)
    sys.exit(main(sys.argv[1], sys.argv[2]))
