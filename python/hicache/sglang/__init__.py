"""hicache for SGLang: its L3 storage backend and a drop-in for its cache controller.

    from hicache.sglang import HiCacheStore       # --hicache-storage-backend dynamic
    from hicache.sglang import HiCacheController  # in place of SGLang's HiCacheController

The names are the package's (store.py, controller.py); configs name the module
"hicache.sglang" (`"module_path": "hicache.sglang", "class_name": "HiCacheStore"`).
docs/sglang.md covers both.
"""

from .controller import (  # noqa: F401
    BackupAck,
    HiCacheAck,
    HiCacheController,
    HiCacheDeviceError,
    get_hash_str,
)
from .store import HiCacheStore  # noqa: F401

__all__ = ["HiCacheStore", "HiCacheController", "HiCacheAck", "BackupAck", "HiCacheDeviceError",
           "get_hash_str"]
