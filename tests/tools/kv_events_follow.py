#!/usr/bin/env python3
"""A KV-aware router's view of hicache-bench, over real sockets (python3-zmq, python3-msgpack):
the subscriber binds, the bench connects its publisher to it (an endpoint without a wildcard
connects) and serves replay; the subscriber follows every batch, asks the replay endpoint for
any sequence numbers it missed, and rebuilds per medium the set of blocks the cache holds. At the
end its sets must equal the cache's own: the tree's device and host pages (the bench's
--kv-events-view) and the file store's records on disk (DISK). The run must also have removed
blocks from every tier (evictions in each), so that removals were followed too.

Usage: kv_events_follow.py HICACHE_BENCH [extra bench flags...]
"""
import json
import os
import socket
import subprocess
import sys
import tempfile

import msgpack
import zmq

END = b"\xff" * 8


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def to_signed(h):
    return h - (1 << 64) if h >= 1 << 63 else h


class Follower:
    def __init__(self, ctx, replay_endpoint):
        self.sets = {"GPU": set(), "CPU_PINNED": set(), "DISK": set(), "EXTERNAL": set()}
        self.removed = {m: 0 for m in self.sets}
        self.unknown_removals = []
        self.next_seq = 0
        self.batches = 0
        self.replayed = 0
        self.lost = []
        self.replay = ctx.socket(zmq.DEALER)
        self.replay.setsockopt(zmq.LINGER, 0)
        self.replay.connect(replay_endpoint)

    def apply(self, payload):
        ts, events, dp_rank = msgpack.unpackb(payload, raw=False)
        assert isinstance(ts, float) and dp_rank is None, (ts, dp_rank)
        for ev in events:
            tag = ev[0]
            if tag == "BlockStored":
                hashes, parent, tokens, block_size, lora_id, medium = ev[1:7]
                assert len(tokens) == len(hashes) * block_size, ev[:2]
                assert lora_id is None and (parent is None or isinstance(parent, int))
                self.sets[medium].update(hashes)
            elif tag == "BlockRemoved":
                hashes, medium = ev[1], ev[2]
                for h in hashes:
                    if h in self.sets[medium]:
                        self.sets[medium].discard(h)
                    else:
                        self.unknown_removals.append((medium, h))
                self.removed[medium] += len(hashes)
            elif tag == "AllBlocksCleared":
                for s in self.sets.values():
                    s.clear()
            else:
                raise AssertionError(f"unknown event {ev!r}")
        self.batches += 1

    def fill_gap(self, upto):
        """Asks the replay endpoint for [next_seq, upto) and applies what it has."""
        self.replay.send_multipart([b"", self.next_seq.to_bytes(8, "big")])
        while True:
            if not self.replay.poll(10000):
                raise AssertionError(f"replay from {self.next_seq}: no answer in 10 s")
            frames = self.replay.recv_multipart()
            assert frames[0] == b"", frames
            if frames[1] == END:
                break
            assert len(frames[1]) == 8, f"replay error: {frames[1:]!r}"
            seq = int.from_bytes(frames[1], "big")
            if self.next_seq <= seq < upto:
                if seq != self.next_seq:
                    self.lost.extend(range(self.next_seq, seq))
                self.apply(frames[2])
                self.replayed += 1
                self.next_seq = seq + 1
        if self.next_seq < upto:
            self.lost.extend(range(self.next_seq, upto))
            self.next_seq = upto

    def on_message(self, frames, alive):
        topic, seq_bytes, payload = frames
        assert topic == b"kv", topic
        seq = int.from_bytes(seq_bytes, "big")
        if seq < self.next_seq:
            return  # had it from a replay
        if seq > self.next_seq:
            assert alive, f"sequence {self.next_seq}..{seq - 1} missed after the bench exited"
            self.fill_gap(seq)
        self.apply(payload)
        self.next_seq = seq + 1


def main():
    bench, extra = sys.argv[1], sys.argv[2:]
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)  # the library's queue never drops for this subscriber
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    replay = f"tcp://127.0.0.1:{free_port()}"
    follower = Follower(ctx, replay)
    with tempfile.TemporaryDirectory() as tmp:
        root, view_path = os.path.join(tmp, "l3"), os.path.join(tmp, "view.json")
        cmd = [bench, "--no-progress", "--tiers", "file", "--storage-dir", root, "--keep-storage",
               "--kv-events", f"tcp://127.0.0.1:{port}", "--kv-events-replay", replay,
               "--kv-events-topic", "kv", "--kv-events-view", view_path] + extra
        proc = subprocess.Popen(cmd)
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        quiet = 0
        while True:
            alive = proc.poll() is None
            if poller.poll(200):
                follower.on_message(sub.recv_multipart(), alive)
                quiet = 0
            elif not alive:
                quiet += 1
                if quiet >= 5:  # the bench is gone and nothing came for a second
                    break
        assert proc.returncode == 0, f"hicache-bench exited with {proc.returncode}"
        view = json.load(open(view_path))
        prefix = view["key_prefix"] + "-"
        disk = {to_signed(int(name[len(prefix):len(prefix) + 16], 16))
                for name in os.listdir(root)
                if name.startswith(prefix) and len(name) == len(prefix) + 64}
    f = follower
    print(f"[kv_events_follow] {f.batches} batches ({f.replayed} replayed, {len(f.lost)} lost); "
          f"held GPU {len(f.sets['GPU'])} CPU_PINNED {len(f.sets['CPU_PINNED'])} "
          f"DISK {len(f.sets['DISK'])}; removed {f.removed}")
    assert not f.lost, f"batches lost for good: {f.lost[:10]}"
    assert not f.unknown_removals, f"removals of blocks never stored: {f.unknown_removals[:5]}"
    assert f.batches == view["published_batches"], (f.batches, view["published_batches"])
    assert view["dropped_batches"] == 0, view["dropped_batches"]
    for medium, mine in (("GPU", set(view["GPU"])), ("CPU_PINNED", set(view["CPU_PINNED"])),
                         ("DISK", disk)):
        got = f.sets[medium]
        assert mine, f"the cache holds nothing on {medium}: the run checks nothing there"
        assert got == mine, (f"{medium}: subscriber has {len(got)} blocks, the cache {len(mine)}; "
                             f"{len(got - mine)} only in the subscriber's, "
                             f"{len(mine - got)} only in the cache's")
        assert f.removed[medium] > 0, f"no {medium} removal followed: the run evicted nothing"
    assert not f.sets["EXTERNAL"], "a file store's records are DISK"
    print("[kv_events_follow] ok: the subscriber's view is the cache's on every tier")


if __name__ == "__main__":
    main()
