"""Paired rounds: a path through Python against the C++ store's own calls, in one run.

The benchmarks that put a Python-driven path beside the store's own batch calls on the same
pages (tools/python_store_bench.py, tools/adapter_bench.py) measure the same way, because
throughput on these VMs drifts 2-4x from minute to minute and the disk's writeback of one step
lands on the next:

- each round opens a fresh store (removing the last round's records in the background would
  compete with this round's writes) and writes fresh keys (the store deduplicates);
- a round runs groups of steps that compete (every side's set, then every side's get, perhaps
  again), and the order inside a group rotates from group to group and round to round, so no
  side always goes first;
- the page cache's dirty pages are flushed (os.sync) before each step;
- each figure is the best of the rounds; `run_rounds` also keeps every step's figure, so that a
  caller can compare two sides step by step: the sides of one group run back to back, so the
  ratio of their figures in one group is free of the drift between groups, and the median of
  those ratios is a steadier figure than the ratio of two bests (each side's best may come from
  another minute of the machine's).
"""
import os
import shutil


def best_of_rounds(reps, root, make_round, trace=False):
    """Runs `reps` rounds (run_rounds); returns {step name: best GB/s}."""
    return {name: max(figures) for name, figures in run_rounds(reps, root, make_round,
                                                               trace).items()}


def paired_median(samples, side, base):
    """The median over the groups of samples[side][i] / samples[base][i]: the i-th figures of
    two step names that always share a group (run_rounds keeps them in group order)."""
    if not samples[side] or len(samples[side]) != len(samples[base]):
        raise ValueError(f"paired_median: {len(samples[side])} figures of {side}, "
                         f"{len(samples[base])} of {base}")
    ratios = sorted(a / b for a, b in zip(samples[side], samples[base]))
    mid = len(ratios) // 2
    return ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2


def run_rounds(reps, root, make_round, trace=False):
    """Runs `reps` rounds; returns {step name: [GB/s of each run of the step, in order]}.

    make_round(rep, rep_root) -> (nbytes, groups, close): the round's store lives under
    rep_root (created by make_round if it needs it, removed here afterwards); `groups` is a
    list of lists of (name, step), each step() moving nbytes and returning its seconds;
    close() runs after the round's last step, once the groups are dropped (a store that only
    the steps hold is then gone before its directory is removed).
    """
    figures = {}
    for rep in range(reps):
        rep_root = os.path.join(root, f"r{rep}")
        nbytes, groups, close = make_round(rep, rep_root)
        try:
            for g, group in enumerate(groups):
                shift = (rep + g) % len(group)
                for name, step in group[shift:] + group[:shift]:
                    os.sync()  # each step starts with no dirty pages of the one before
                    gbps = nbytes / step() / 1e9
                    if trace:
                        print(rep, name, round(gbps, 2), flush=True)
                    figures.setdefault(name, []).append(gbps)
        finally:
            groups = group = step = None  # noqa: F841 (drops the round's store)
            close()
            close = None  # what it closed goes too
            shutil.rmtree(rep_root, ignore_errors=True)
    return figures


def size_label(nbytes):
    """'2 MiB', '512 KiB', '100 B'."""
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"
