#!/usr/bin/env bash
# Installs the build tree into a temporary prefix, then configures, builds and runs the
# consumer project against it with find_package(hicache).
set -euo pipefail
build=${1:?build dir} work=${2:?work dir} src=${3:?consumer source}
rm -rf "$work" && mkdir -p "$work"
cmake --install "$build" --prefix "$work/prefix" >/dev/null
cmake -S "$src" -B "$work/build" -G Ninja -DCMAKE_PREFIX_PATH="$work/prefix" \
  -DCMAKE_BUILD_RPATH="$work/prefix/lib" >/dev/null
cmake --build "$work/build" >/dev/null
LD_LIBRARY_PATH="$work/prefix/lib:${LD_LIBRARY_PATH:-}" "$work/build/consumer"
