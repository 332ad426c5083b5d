"""SGLang runs each TP rank as a process of its own; for an MLA model only rank 0 writes L3 and
every rank reads the same keys. Two HiCacheStore instances in two processes (store_peer.py),
ranks 0 and 1 of tp_size 2, over one file root (no "shared" key in the config) and over one
Redis: rank 1, opened before rank 0 writes, sees rank 0's pages and reads identical bytes into
its own host pool; a page rank 0 deletes is a miss for rank 1, never stale bytes (issue 38).
The same for two engines (MHA, TP 1, the same namespace) on one root: there the file store
finds the other live instance by itself (nothing forces "shared")."""
import json
import os
import subprocess
import sys
import types

import pytest

torch = pytest.importorskip("torch", reason="python3-torch is not installed")

from hicache.sglang import HiCacheStore  # noqa: E402

PEER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "store_peer.py")
KEYS = [f"{i:064x}" for i in range(0x5151, 0x5155)]  # SGLang's keys: 64 hex digits


class Rank:
    """A store_peer.py process: one rank's HiCacheStore and host pool."""

    def __init__(self, rank, tp_size, mla, storage, seed):
        self.proc = subprocess.Popen([sys.executable, PEER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=os.environ.copy())
        assert self.ask("open", rank=rank, tp_size=tp_size, mla=mla, layout="page_first",
                        storage=storage, seed=seed) == {"ok": True}

    def ask(self, op, **args):
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"store_peer.py ({op}) ended with status {self.proc.wait()}"
        answer = json.loads(line)
        assert "error" not in answer, answer.get("trace", answer["error"])
        return answer

    def close(self):
        self.proc.stdin.close()
        assert self.proc.wait(timeout=60) == 0


@pytest.fixture(params=["file", "redis"])
def storage(request, tmp_path):
    if request.param == "file":
        return {"backend": "file", "root": str(tmp_path / "l3")}  # no "shared" key
    server = request.getfixturevalue("redis_server")
    return {"backend": "redis", "host": "127.0.0.1", "port": server.port}


# (reader rank, writer rank, tp_size, mla): MLA ranks of one model; two MHA engines at TP 1.
SHAPES = {"mla-tp2": (1, 0, 2, True), "two-engines": (0, 0, 1, False)}


@pytest.mark.parametrize("shape", SHAPES)
def test_a_reader_sees_and_reads_what_another_process_wrote_after_it_opened(storage, shape):
    read_rank, write_rank, tp_size, mla = SHAPES[shape]
    reader = Rank(read_rank, tp_size, mla, storage, seed=11)  # opened first, nothing written
    writer = Rank(write_rank, tp_size, mla, storage, seed=10)
    try:
        assert reader.ask("exists", keys=KEYS) == {"hits": 0}
        wrote = writer.ask("set", keys=KEYS, pages=[0, 3, 5, 7])
        assert wrote["ok"] == [True] * 4
        assert writer.ask("exists", keys=KEYS) == {"hits": 4}
        assert reader.ask("exists", keys=KEYS) == {"hits": 4}
        before = reader.ask("get", keys=[], pages=[2, 4, 6, 9])["digests"]
        assert not set(before) & set(wrote["digests"]), "the pools start with the same bytes"
        read = reader.ask("get", keys=KEYS, pages=[2, 4, 6, 9])
        assert read["ok"] == [True] * 4
        assert read["digests"] == wrote["digests"]
        # Rank 0 removes a page: for rank 1 it is a miss, the page it reads into keeps its bytes,
        # and the rest still read right.
        assert writer.ask("delete", key=KEYS[1]) == {"removed": True}
        assert reader.ask("exists", keys=KEYS) == {"hits": 1}
        untouched = reader.ask("get", keys=[], pages=[10])["digests"]
        again = reader.ask("get", keys=KEYS, pages=[12, 10, 13, 14])
        assert again["ok"] == [True, False, True, True]
        assert again["digests"] == [wrote["digests"][0], untouched[0], *wrote["digests"][2:]]
    finally:
        writer.close()
        reader.close()


def test_mla_under_tp_refuses_a_file_store_that_is_not_shared(tmp_path):
    cfg = types.SimpleNamespace(
        tp_rank=1, tp_size=2, is_mla_model=True, model_name="test-model",
        extra_config={"storage": {"backend": "file", "root": str(tmp_path), "shared": False}})
    with pytest.raises(ValueError, match="shared"):
        HiCacheStore(cfg, None)
