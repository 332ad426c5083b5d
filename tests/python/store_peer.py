"""One SGLang TP rank's HiCacheStore in a process of its own, for the multi-process tests
(test_sglang_shared.py). It reads one JSON command per line on stdin and answers one JSON line on
stdout:

  {"op": "open", "rank": r, "tp_size": n, "mla": true, "layout": "page_first", "storage": {...},
   "seed": s}                          -> {"ok": true}  (its host pool, filled from the seed)
  {"op": "set", "keys": [...], "pages": [...]}  -> {"ok": [bool...], "digests": [hex...]}
  {"op": "get", "keys": [...], "pages": [...]}  -> {"ok": [bool...], "digests": [hex...]}
  {"op": "exists", "keys": [...]}               -> {"hits": n}
  {"op": "delete", "key": k}                    -> {"removed": bool}

`pages` are host pool pages; a digest is the SHA-256 of a page's bytes in the pool after the call.
An exception is answered as {"error": "..."}; EOF ends the process.
"""
import hashlib
import json
import os
import sys
import traceback
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from conftest import HostPool  # noqa: E402
from hicache.sglang import HiCacheStore  # noqa: E402


def indices(pages, page_size):
    return torch.tensor([p * page_size + t for p in pages for t in range(page_size)],
                        dtype=torch.int64)


class Rank:
    def open(self, rank, tp_size, mla, layout, storage, seed):
        self.pool = HostPool(layout, mla=mla)
        self.pool.fill_random(seed)
        cfg = types.SimpleNamespace(
            tp_rank=rank, tp_size=tp_size, is_mla_model=mla,
            is_page_first_layout=layout != "layer_first", model_name="test-model",
            extra_config={"backend_name": "hicache", "module_path": "hicache.sglang",
                          "class_name": "HiCacheStore", "interface_v1": 1, "storage": storage})
        self.store = HiCacheStore(cfg, None)
        self.store.register_mem_pool_host(self.pool)
        return {"ok": True}

    def digests(self, pages):
        P = self.pool.page_size
        return [hashlib.sha256(self.pool.page_bytes(p * P)).hexdigest() for p in pages]

    def set(self, keys, pages):
        ok = self.store.batch_set_v1(keys, indices(pages, self.pool.page_size))
        return {"ok": list(ok), "digests": self.digests(pages)}

    def get(self, keys, pages):
        ok = self.store.batch_get_v1(keys, indices(pages, self.pool.page_size))
        return {"ok": list(ok), "digests": self.digests(pages)}

    def exists(self, keys):
        return {"hits": self.store.batch_exists(keys)}

    def delete(self, key):
        return {"removed": bool(self.store.delete(key))}


def main():
    rank = Rank()
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            answer = getattr(rank, op)(**cmd)
        except Exception as e:  # noqa: BLE001 - reported to the test, which fails on it
            answer = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
