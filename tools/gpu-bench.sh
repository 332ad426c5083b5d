#!/usr/bin/env bash
# One command on a GPU machine: build, run the GPU tests, check the kernels for register
# spills, run the main job and the stress tool on the GPU, then time scattered-page transfers
# (direct and kernel I/O) against a contiguous pinned copy for 1, 16 and 256 pages of the
# standard geometry.
#
#   bash tools/gpu-bench.sh            (DEPS_PREFIX=dir adds a prefix where the -dev packages
#                                       were unpacked, for machines that cannot apt-get)
#
# For a GPU machine without the Debian packages (the lent device machines), on a Debian 12
# machine first:  mkdir .deps && cd .deps && apt-get download libconcurrentqueue-dev
#   libboost1.81-dev nlohmann-json3-dev libgtest-dev libgmock-dev libbenchmark-dev
#   libbenchmark1debian libhiredis-dev libhiredis0.14 libgloo-dev libgloo0 libssl-dev libssl3
#   libxxhash-dev libxxhash0 liburing-dev liburing2 libibverbs1 libnl-3-200 libnl-route-3-200
#   pkgconf pkgconf-bin libpkgconf3 libzmq3-dev libzmq5 cppzmq-dev libsodium23 libsodium-dev
#   libpgm-5.3-0 libpgm-dev libnorm1 libnorm-dev libmsgpack-cxx-dev
#   (about 20 MiB; .deps/ is ignored by git; the ZeroMQ part is untested on a device machine)
# then there:  for f in .deps/*.deb; do dpkg -x $f /tmp/deps; done
#              DEPS_PREFIX=/tmp/deps bash tools/gpu-bench.sh
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-build-gpu}
extra=()
if [ -n "${DEPS_PREFIX:-}" ]; then
  extra=(-DCMAKE_PREFIX_PATH="$DEPS_PREFIX/usr" -DCMAKE_INCLUDE_PATH="$DEPS_PREFIX/usr/include")
  export LD_LIBRARY_PATH="$DEPS_PREFIX/usr/lib/x86_64-linux-gnu:$DEPS_PREFIX/usr/lib:${LD_LIBRARY_PATH:-}"
  # Debian's Gloo package names its library by absolute path (/usr/lib/libgloo.so.0.5.0) in its
  # CMake targets: point them at the unpacked copy.
  for targets in "$DEPS_PREFIX"/usr/share/cmake/Gloo/GlooTargets-*.cmake; do
    [ -e "$targets" ] && sed -i "s#\"/usr/lib/libgloo#\"$DEPS_PREFIX/usr/lib/libgloo#g" "$targets"
  done
  # hiredis and xxhash ship only .pc files, which name /usr: let pkg-config read the unpacked ones
  # and prefix their paths with the unpack directory.
  if ! command -v pkg-config >/dev/null && [ -x "$DEPS_PREFIX/usr/bin/pkgconf" ]; then
    export PATH="$DEPS_PREFIX/usr/bin:$PATH"
  fi
  export PKG_CONFIG_LIBDIR="$DEPS_PREFIX/usr/lib/x86_64-linux-gnu/pkgconfig:$DEPS_PREFIX/usr/share/pkgconfig"
  export PKG_CONFIG_SYSROOT_DIR="$DEPS_PREFIX"
fi
failed=0  # a failing test does not stop the timings; the exit code reports it
echo "[gpu-bench] building in $build"
# The lent GPU machines' compiler wrapper links libstdc++ statically: this script's binaries load
# no second C++ runtime, so the check after each link only warns here (README: Python).
cmake -S . -B "$build" -G Ninja -DHICACHE_CUDA=ON -DHICACHE_WERROR=ON \
  -DHICACHE_ALLOW_STATIC_CXX_RUNTIME=ON "${extra[@]}" >/dev/null
cmake --build "$build" -j "$(nproc)" --target hicache transfer_test kernels_test controller_test \
  storage_test hicache-gpubench hicache-bench hicache-stress
echo "[gpu-bench] register use of the transfer kernels (ptxas -v):"
/usr/local/cuda/bin/nvcc -std=c++17 -I. -gencode arch=compute_90,code=sm_90 -Xptxas -v -c \
  kernels/page_transfer.cu -o /dev/null 2>&1 | grep -E 'Used|spill' | sed 's/^/  /'
if /usr/local/cuda/bin/nvcc -std=c++17 -I. -gencode arch=compute_90,code=sm_90 -Xptxas -v -c \
  kernels/page_transfer.cu -o /dev/null 2>&1 | grep -E '[1-9][0-9]* bytes spill'; then
  echo "[gpu-bench] FAIL: register spills"; exit 1
fi
echo "[gpu-bench] GPU tests"
"$build/tests/transfer_test" --gtest_filter='Cuda*:DeviceFactory*:HostMemory*' --gtest_brief=1 || failed=1
"$build/tests/kernels_test" --gtest_brief=1 || failed=1
"$build/tests/controller_test" --gtest_filter='Cuda*:*StreamHazard*' --gtest_brief=1 || failed=1
"$build/tests/storage_test" --gtest_filter='Nccl*' --gtest_brief=1 || failed=1
sanitizer=/usr/local/cuda/bin/compute-sanitizer
if [ -x "$sanitizer" ]; then
  echo "[gpu-bench] compute-sanitizer over the CUDA tests"
  for tool in memcheck racecheck synccheck initcheck; do
    "$sanitizer" --tool "$tool" --error-exitcode 9 "$build/tests/transfer_test" \
      --gtest_filter='Cuda*' --gtest_brief=1 | tail -1 || failed=1
  done
  for tool in memcheck racecheck; do
    "$sanitizer" --tool "$tool" --error-exitcode 9 "$build/tests/controller_test" \
      --gtest_filter='Cuda*:*StreamHazard*/cuda' --gtest_brief=1 | tail -1 || failed=1
  done
fi
for io in direct kernel; do "$build/tools/hicache-bench" --device cuda --io-backend "$io" --no-progress || failed=1; done
echo "[gpu-bench] hicache-stress on the GPU, every fault, 30 s per I/O backend"
for io in direct kernel; do
  "$build/tools/hicache-stress" --device cuda --io-backend "$io" --seconds 30 --no-progress \
    --seed 5 | tail -3 || failed=1
done
for layout in layer_first page_first page_first_direct; do
  "$build/tools/hicache-gpubench" "$layout"
done
"$build/tools/hicache-gpubench" pin "${PIN_GIB:-32}"
if [ "$failed" != 0 ]; then echo "[gpu-bench] FAIL: a GPU test failed (see above)"; exit 1; fi
