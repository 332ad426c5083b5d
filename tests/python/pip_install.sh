#!/usr/bin/env bash
# `pip install --no-build-isolation .` from the checkout (setuptools driving CMake, no index),
# into a target directory, then the installed package is imported and a store round trip runs.
set -euo pipefail
python=${1:?python} src=${2:?source dir} work=${3:?work dir}
rm -rf "$work/target" && mkdir -p "$work" "$src/build-pip"
if ! HICACHE_CMAKE_ARGS="-DHICACHE_CUDA=OFF" HICACHE_PIP_BUILD_DIR="$work/cmake" \
    "$python" -m pip install --no-build-isolation --no-index --no-deps --target "$work/target" \
    "$src" >"$work/pip.log" 2>&1; then
  tail -40 "$work/pip.log"
  exit 1
fi
cd "$work"
PYTHONPATH="$work/target" PYTHONDONTWRITEBYTECODE=1 "$python" - "$work" <<'PY'
import os, sys, tempfile
import hicache
assert hicache.__file__.startswith(os.path.join(sys.argv[1], "target")), hicache.__file__
store = hicache.open_store({"backend": "file", "root": tempfile.mkdtemp(dir=sys.argv[1])})
data = bytes(range(256)) * 64
assert store.batch_set(["page"], [data])[0].ok
out = bytearray(len(data))
assert store.batch_get(["page"], [out])[0].ok and bytes(out) == data
from hicache.sglang import HiCacheController, HiCacheStore  # noqa: F401 - the subpackage
import hicache.sglang.controller, hicache.sglang.store  # noqa: E401,F401
from hicache.vllm import HiCacheTier  # noqa: F401
from hicache.lmcache import HiCacheL2Adapter
import select
l2 = HiCacheL2Adapter(storage={"backend": "file", "root": tempfile.mkdtemp(dir=sys.argv[1])})
fid = l2.submit_batch_set(keys=["a/b"], memoryviews=[memoryview(data)])
assert select.select([l2.event_fd()], [], [], 10)[0]
assert l2.drain_completions() == [(fid, True, "", [True])]
l2.close()
print("pip-installed package: ok")
PY
