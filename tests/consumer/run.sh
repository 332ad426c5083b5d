#!/usr/bin/env bash
# Installs the build tree into a temporary prefix, then configures, builds and runs the
# consumer project against it with find_package(hicache), on a HiCache config with a file store.
set -euo pipefail
build=${1:?build dir} work=${2:?work dir} src=${3:?consumer source}
rm -rf "$work" && mkdir -p "$work"
cmake --install "$build" --prefix "$work/prefix" >/dev/null

# The installed headers are exactly the public ones and what they include (internal headers are
# not installed), and each public header compiles against the prefix alone.
installed=$(cd "$work/prefix/include/hicache" && find . -name '*.h' -o -name '*.cuh' | sed 's|^\./||' | sort)
expected=$(sort "$build/hicache_installed_headers.txt" | sed '/^$/d')
if [ "$installed" != "$expected" ]; then
  echo "installed headers differ from the public surface (< installed, > expected):" >&2
  diff <(echo "$installed") <(echo "$expected") >&2 || true
  exit 1
fi
sed '/^$/d; s|.*|#include "hicache/&"|' "$build/hicache_public_headers.txt" >"$work/public_headers.cc"

cmake -S "$src" -B "$work/build" -G Ninja -DCMAKE_PREFIX_PATH="$work/prefix" \
  -DCMAKE_BUILD_RPATH="$work/prefix/lib" -DHICACHE_PUBLIC_HEADERS_TU="$work/public_headers.cc" >/dev/null
cmake --build "$work/build" >/dev/null
cat >"$work/hicache.json" <<JSON
{"device": "host", "page_size": 16, "device_tokens": 512,
 "model": {"attention": "mha", "layers": 4, "kv_heads": 2, "head_dim": 32, "dtype": "bf16"},
 "host_ratio": 2.0, "write_policy": "write_through", "prefetch_policy": "wait_complete",
 "prefetch_threshold_tokens": 64,
 "model_name": "consumer", "storage": {"backend": "file", "root": "$work/store"}}
JSON
LD_LIBRARY_PATH="$work/prefix/lib:${LD_LIBRARY_PATH:-}" "$work/build/consumer" "$work/hicache.json"

# The Python package, where the build has one: imported from the prefix's site-packages with no
# library path set (the extension finds libhicache through its RUNPATH).
pkg=$(find "$work/prefix" -path '*-packages/hicache/__init__.py' -print -quit)
if [ -n "$pkg" ]; then
  PYTHONPATH=$(dirname "$(dirname "$pkg")") PYTHONDONTWRITEBYTECODE=1 /usr/bin/python3 -c "
import hicache, sys
from hicache.sglang import HiCacheController, HiCacheStore  # the subpackage is installed
with hicache.HiCache(sys.argv[1]) as c:
    assert c.store is not None and c.page_size == 16, c
print('installed python package: ok')" "$work/hicache.json"
fi
