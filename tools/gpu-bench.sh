#!/usr/bin/env bash
# One command on a GPU machine: build, run the GPU tests, check the kernels for register
# spills, run the main job and the stress tool on the GPU, the Python package on the GPU (its
# CUDA tests, the SGLang drop-in's replay with every engine tensor on the GPU, the drop-in's
# benchmark against hicache-opbench), the controller's copy ops against the copy engine, then
# time scattered-page transfers (direct and kernel I/O) against a contiguous pinned copy for 1,
# 16 and 256 pages of the standard geometry.
#
#   bash tools/gpu-bench.sh            (DEPS_PREFIX=dir adds a prefix where the -dev packages
#                                       were unpacked, for machines that cannot apt-get)
#
# GPU_BENCH_STAGES=list runs only those stages, in this order (default: all of them):
#   tests      the C++ GPU tests and the kernels' register check
#   sanitizer  compute-sanitizer over the CUDA tests
#   main       hicache-bench on the GPU (auto, direct and kernel I/O)
#   stress     hicache-stress on the GPU, 30 s per I/O backend
#   python     the Python package built for $PYTHON (default python3, which must import torch
#              with CUDA): tests/python/test_package.py's CUDA cases, the drop-in replay
#              (tests/python/test_sglang_controller.py with HICACHE_TEST_DEVICE=cuda) and
#              tools/controller_bench.py --device cuda (direct and kernel I/O)
#   opbench    hicache-opbench --device cuda, auto, direct and kernel I/O (ratio_to_ceiling), and
#              the kernel's writes capped at 8 and 32 blocks
#   transfers  hicache-gpubench for the three host layouts, for fragments of 8 and 64 KiB, and
#              the pinned pool bring-up
# Each stage prints its wall time.
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
stages=",${GPU_BENCH_STAGES:-tests,sanitizer,main,stress,python,opbench,transfers},"
for s in ${stages//,/ }; do
  case "$s" in
    tests|sanitizer|main|stress|python|opbench|transfers) ;;
    *) echo "[gpu-bench] GPU_BENCH_STAGES: unknown stage '$s' (valid: tests sanitizer main" \
         "stress python opbench transfers)" >&2; exit 2 ;;
  esac
done
want() { [[ "$stages" == *",$1,"* ]]; }
stage_start=$SECONDS
stage() {  # stage NAME: announces it and the previous stage's wall time
  echo "[gpu-bench] ($((SECONDS - stage_start)) s) stage $1"
  stage_start=$SECONDS
}
py=${PYTHON:-python3}
python_args=()
if want python; then
  if ! "$py" -c 'import torch, pybind11, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
    echo "[gpu-bench] FAIL: stage python needs $py with torch (CUDA) and pybind11"; exit 1
  fi
  if ! "$py" -c 'import os, sys, sysconfig
sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'; then
    echo "[gpu-bench] FAIL: stage python needs the C headers of $py (Python.h)"; exit 1
  fi
  python_args=(-DHICACHE_PYTHON=ON -DPython3_EXECUTABLE="$(command -v "$py")"
               -Dpybind11_DIR="$("$py" -m pybind11 --cmakedir)")
fi
stage build
echo "[gpu-bench] building in $build"
# The lent GPU machines' compiler wrapper links libstdc++ statically: the C++ binaries load no
# second C++ runtime, so the check after each link only warns here, and the Python stage
# preloads the system's libstdc++ (README: Python).
cmake -S . -B "$build" -G Ninja -DHICACHE_CUDA=ON -DHICACHE_WERROR="${GPU_BENCH_WERROR:-ON}" \
  -DHICACHE_ALLOW_STATIC_CXX_RUNTIME=ON "${extra[@]}" "${python_args[@]}" >/dev/null
targets=(hicache)  # what the stages asked for run
if want tests || want sanitizer; then
  targets+=(transfer_test kernels_test controller_test storage_test)
fi
if want main; then targets+=(hicache-bench); fi
if want stress; then targets+=(hicache-stress); fi
if want python; then targets+=(hicache_python hicache_python_testing hicache-opbench); fi
if want opbench; then targets+=(hicache-opbench); fi
if want transfers; then targets+=(hicache-gpubench); fi
if ! cmake --build "$build" -j "$(nproc)" --target "${targets[@]}" >"$build/build.log" 2>&1; then
  tail -60 "$build/build.log"; echo "[gpu-bench] FAIL: build (whole log: $build/build.log)"; exit 1
fi
if want tests; then
stage tests
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
"$build/tests/controller_test" --gtest_filter='Cuda*:*StreamHazard*:*Engine*Memory*' \
  --gtest_brief=1 || failed=1
"$build/tests/storage_test" --gtest_filter='Nccl*' --gtest_brief=1 || failed=1
fi
sanitizer=/usr/local/cuda/bin/compute-sanitizer
if want sanitizer && [ -x "$sanitizer" ]; then
  stage sanitizer
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
if want main; then
  stage main
  for io in auto direct kernel; do
    "$build/tools/hicache-bench" --device cuda --io-backend "$io" --no-progress || failed=1
  done
fi
if want stress; then
  stage stress
  echo "[gpu-bench] hicache-stress on the GPU, every fault, 30 s per I/O backend"
  for io in direct kernel; do
    "$build/tools/hicache-stress" --device cuda --io-backend "$io" --seconds 30 --no-progress \
      --seed 5 | tail -3 || failed=1
  done
fi
if want python; then
  stage python
  # A libhicache.so built by a toolchain that links libstdc++ statically carries its own C++
  # runtime; torch maps the system's: preload that one so both use it (README: Python).
  libstdcxx=$(/sbin/ldconfig -p 2>/dev/null | awk '/libstdc\+\+\.so\.6 .*x86-64/ {print $NF; exit}')
  run_py() { PYTHONPATH="$build/python" LD_PRELOAD="${libstdcxx:-}" timeout 300 "$@"; }
  echo "[gpu-bench] $py: $("$py" -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())')"
  run_py "$py" -m pytest -q -p no:cacheprovider tests/python/test_package.py -k cuda || failed=1
  HICACHE_TEST_DEVICE=cuda run_py "$py" -m pytest -q -p no:cacheprovider \
    tests/python/test_sglang_controller.py || failed=1
  for io in direct kernel; do  # SGLang's two io_backends, the C++ run on the same one
    run_py "$py" tools/controller_bench.py --device cuda --io-backend "$io" \
      --opbench "$build/tools/hicache-opbench" || failed=1
  done
fi
if want opbench; then
  stage opbench
  for io in auto direct kernel; do
    "$build/tools/hicache-opbench" --device cuda --io-backend "$io" \
      --workload write_p1,write_p16,load_p1,load_p16,write_p1_tiny,load_p1_tiny || failed=1
  done
  # The kernel's writes on a few SMs (kernel_max_blocks), leaving the rest to the model.
  for cap in 8 32; do
    "$build/tools/hicache-opbench" --device cuda --io-backend kernel --kernel-max-blocks "$cap" \
      --workload write_p1,write_p16 || failed=1
  done
fi
if want transfers; then
  stage transfers
  for layout in layer_first page_first page_first_direct; do
    "$build/tools/hicache-gpubench" "$layout"
  done
  # Small scattered fragments: runs of 8 KiB and 64 KiB per layer and K/V.
  for tokens in 4 32; do "$build/tools/hicache-gpubench" layer_first "$tokens"; done
  "$build/tools/hicache-gpubench" pin "${PIN_GIB:-32}"
fi
stage end
if [ "$failed" != 0 ]; then echo "[gpu-bench] FAIL: a GPU test failed (see above)"; exit 1; fi
