"""hicache for SGLang: its L3 storage backend and a drop-in for its cache controller.

    from hicache.sglang import HiCacheStore       # --hicache-storage-backend dynamic
    from hicache.sglang import HiCacheController  # in place of SGLang's HiCacheController

The names are the package's (store.py, controller.py); configs name the module
"hicache.sglang" (`"module_path": "hicache.sglang", "class_name": "HiCacheStore"`).
HiCacheStore also serves SGLang's storage v2 for hybrid models (_v2.py): PoolName,
PoolHitPolicy, PoolTransfer and PoolTransferResult are SGLang's classes where SGLang is
installed, stand-ins with its field names otherwise; agree_restorable is the rule by which TP
ranks agree on a restorable prefix. docs/sglang.md covers all of it.
"""

from .controller import (  # noqa: F401
    BackupAck,
    HiCacheAck,
    HiCacheController,
    HiCacheDeviceError,
    get_hash_str,
)
from ._v2 import (  # noqa: F401 - SGLang's own classes where SGLang is installed
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
    agree_restorable,
)
from .store import HiCacheStore  # noqa: F401

__all__ = ["HiCacheStore", "HiCacheController", "HiCacheAck", "BackupAck", "HiCacheDeviceError",
           "get_hash_str", "PoolName", "PoolHitPolicy", "PoolTransfer", "PoolTransferResult",
           "agree_restorable"]
